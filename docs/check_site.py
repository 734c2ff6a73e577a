"""Checks the built documentation site for what a reader would see broken.

Run: `python docs/check_site.py SITE_DIR` after `mkdocs build --site-dir SITE_DIR`.
It reads every HTML page under SITE_DIR (standard library only) and exits 1,
naming the file, the line and the text, when a page has:

- **a list rendered as text:** a `<p>` whose text starts with `- `, `* `, `+ ` or
  `1. ` (Markdown needs a blank line before a list, and an indented code block
  inside a list item needs one after it);
- **a clipped code line:** a line of a `<pre>` block wider than `WIDTH` characters,
  which the reader must scroll sideways to see;
- **an untyped API signature:** a function's or a method's signature (mkdocstrings,
  `separate_signature: true`) with a parameter or a return value that has no type
  annotation.

A code block that holds a real tool's output, too wide to narrow without changing
it, may say so: `<!-- wide: "why" -->` right before it (as the Sybil skips of
conftest.py name theirs) lets its lines be wider, and this script prints each
such block, so none is exempt silently.
"""

from __future__ import annotations

import ast
import re
import sys
import unicodedata
from html.parser import HTMLParser
from pathlib import Path
from typing import NamedTuple

# The column, in monospace characters. mkdocs-material's grid is 61rem wide; with
# `toc.integrate` only the left sidebar (12.1rem) stands beside the content, whose
# inner margins are 1.2rem a side, so the content is 61 - 12.1 - 2.4 = 46.5rem. A
# code block's font is 0.8rem x 0.85 = 0.68rem with 1.176em of padding a side
# (1.6rem in all): 44.9rem of text. Roboto Mono advances 0.6em (1,229 of 2,048
# units), 0.408rem a character: 110 characters. Every size is in rem, so the
# count holds at every root font size; a code block inside a list item loses
# 1.25em (1rem, 2.5 characters), and at a 960px window, with the sidebar folded
# away, the column is 107. 100 leaves that margin and the fallback fonts' (Menlo
# and Consolas are 0.55em to 0.6em), and it is the COLUMNS=100 under which
# conftest.py runs the docs' console blocks. (Without `toc.integrate` the column
# was 61 - 2 x 12.1 - 2.4 - 1.6 = 32.8rem: 80 characters.)
WIDTH = 100

_LIST_AS_TEXT = re.compile(r"(?:[-*+]|\d+\.) ")
_WIDE = re.compile(r"\s*wide:\s*(.*?)\s*$", re.DOTALL)
# The tags that wrap a highlighted code block: a `wide:` comment before a block
# survives them, and anything else in between cancels it.
_CODE_WRAPPERS = {"div", "pre", "code", "span"}
_TYPED_KINDS = {"function", "method"}  # signatures that must be typed throughout
_SIGNED_KINDS = {*_TYPED_KINDS, "class"}  # and a class's (its parameters), where shown


class Fault(NamedTuple):
    """One thing a reader would see broken: where, what rule, and the text."""

    file: str
    line: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.rule}: {self.text}"


class WideBlock(NamedTuple):
    """A code block whose lines may be wider than the column, and why."""

    file: str
    line: int
    widest: int
    why: str


def display_width(line: str) -> int:
    """Columns a line takes in a monospace font: East Asian wide characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line.expandtabs())


def list_as_text(paragraph: str) -> bool:
    """Whether a paragraph's text starts as a Markdown list item does."""
    return _LIST_AS_TEXT.match(paragraph.lstrip()) is not None


def wide_lines(block: str, width: int = WIDTH) -> list[tuple[int, str]]:
    """The lines of a code block wider than `width`: (its width, the line)."""
    return [
        (display_width(line), line) for line in block.split("\n") if display_width(line) > width
    ]


def untyped(signature: str, kind: str) -> list[str]:
    """What a signature leaves untyped: each parameter with no annotation (but
    `self` and `cls`), and the return value of a function or method. A signature
    that does not read as Python is reported as such."""
    try:
        tree = ast.parse(f"def {signature.strip()}: ...")
    except SyntaxError:
        return [f"the signature does not read as Python: {' '.join(signature.split())}"]
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef):
        return ["the signature does not read as a function"]
    arguments = function.args
    named = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    named += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
    missing = [
        f"parameter `{a.arg}`"
        for a in named
        if a.annotation is None and a.arg not in ("self", "cls")
    ]
    if kind in _TYPED_KINDS and function.returns is None:
        missing.append("the return value")
    return missing


class _Page(HTMLParser):
    """Collects one page's faults and its exempt wide blocks."""

    def __init__(self, name: str, width: int) -> None:
        super().__init__(convert_charrefs=True)
        self.name = name
        self.width = width
        self.faults: list[Fault] = []
        self.wide: list[WideBlock] = []
        self._paragraph: list[str] | None = None
        self._paragraph_line = 0
        self._paragraph_code = 0  # depth of inline <code> inside the paragraph
        self._paragraph_opens_with_code = False
        self._pre: list[str] | None = None
        self._pre_line = 0
        self._pre_depth = 0
        self._pre_why: str | None = None
        self._pending_why: str | None = None
        self._kind: str | None = None  # the kind of the API object last headed
        self._signature_depth: int | None = None  # the div depth of a doc-signature
        self._in_signature = False
        self._div_depth = 0

    def handle_comment(self, data: str) -> None:
        found = _WIDE.match(data)
        if found:
            self._pending_why = found.group(1).strip('"') or "(no reason given)"

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag not in _CODE_WRAPPERS:
            self._pending_why = None
        if tag == "div":
            self._div_depth += 1
            if "doc-signature" in classes:
                self._signature_depth = self._div_depth
        elif tag == "code" and "doc-symbol-heading" in classes:
            self._kind = next(
                (
                    c.removeprefix("doc-symbol-")
                    for c in classes
                    if c.startswith("doc-symbol-") and c != "doc-symbol-heading"
                ),
                None,
            )
        if tag == "p" and self._pre is None:
            self._paragraph, self._paragraph_line = [], self.getpos()[0]
            self._paragraph_code, self._paragraph_opens_with_code = 0, False
        elif tag == "code" and self._paragraph is not None:
            self._paragraph_code += 1
        elif tag == "pre":
            if self._pre is None:
                self._pre, self._pre_line, self._pre_depth = [], self.getpos()[0], 0
                self._pre_why, self._pending_why = self._pending_why, None
                self._in_signature = self._signature_depth is not None
            self._pre_depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "code" and self._paragraph is not None:
            self._paragraph_code = max(self._paragraph_code - 1, 0)
        if tag == "p" and self._paragraph is not None:
            text = "".join(self._paragraph)
            if list_as_text(text) and not self._paragraph_opens_with_code:
                self._fault(self._paragraph_line, "a list rendered as text", _brief(text))
            self._paragraph = None
        elif tag == "pre" and self._pre is not None:
            self._pre_depth -= 1
            if self._pre_depth == 0:
                self._end_pre("".join(self._pre))
                self._pre = None
        elif tag == "div":
            if self._signature_depth == self._div_depth:
                self._signature_depth = None
            self._div_depth -= 1

    def handle_data(self, data: str) -> None:
        if self._pre is not None:
            self._pre.append(data)
            return
        if data.strip():
            self._pending_why = None
        if self._paragraph is not None:
            if not "".join(self._paragraph).strip() and data.strip():
                self._paragraph_opens_with_code = self._paragraph_code > 0  # `- x` is code
            self._paragraph.append(data)

    def _end_pre(self, block: str) -> None:
        lines = wide_lines(block, self.width)
        if lines and self._pre_why is not None:
            widest = max(width for width, _ in lines)
            self.wide.append(WideBlock(self.name, self._pre_line, widest, self._pre_why))
        elif lines:
            for width, line in lines:
                rule = f"a code line of {width} characters, wider than the column ({self.width})"
                if self._in_signature:
                    rule += "; mkdocstrings wraps signatures where ruff or black is installed"
                self._fault(self._pre_line, rule, _brief(line))
        if self._in_signature and self._kind in _SIGNED_KINDS:
            for what in untyped(block, self._kind):
                self._fault(
                    self._pre_line, f"an API signature ({self._kind}) with no type for", what
                )
        self._in_signature = False

    def _fault(self, line: int, rule: str, text: str) -> None:
        self.faults.append(Fault(self.name, line, rule, text))


def _brief(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def check_html(html: str, name: str = "<html>", width: int = WIDTH) -> list[Fault]:
    """The faults of one page's HTML."""
    return check_page(html, name, width)[0]


def check_page(html: str, name: str, width: int = WIDTH) -> tuple[list[Fault], list[WideBlock]]:
    """The faults of one page's HTML, and the code blocks it marks `wide:`."""
    page = _Page(name, width)
    page.feed(html)
    page.close()
    return page.faults, page.wide


def check_site(site: Path, width: int = WIDTH) -> tuple[list[Fault], list[WideBlock]]:
    """The faults of every HTML page under `site`, and the blocks marked `wide:`."""
    faults: list[Fault] = []
    wide: list[WideBlock] = []
    for path in sorted(site.rglob("*.html")):
        found, marked = check_page(
            path.read_text(encoding="utf-8"), str(path.relative_to(site)), width
        )
        faults += found
        wide += marked
    return faults, wide


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(
            "usage: python docs/check_site.py SITE_DIR (a directory mkdocs built)", file=sys.stderr
        )
        return 2
    site = Path(argv[0])
    if not any(site.rglob("*.html")):
        print(f"{site} holds no HTML page: build the site first (mkdocs build)", file=sys.stderr)
        return 2
    faults, wide = check_site(site)
    for block in wide:
        print(
            f"{block.file}:{block.line}: a code block of {block.widest} characters, "
            f"marked wide: {block.why}"
        )
    for fault in faults:
        print(fault)
    pages = sum(1 for _ in site.rglob("*.html"))
    verdict = f"{len(faults)} problem{'s' * (len(faults) != 1)}" if faults else "ok"
    print(f"{site}: {pages} pages, column {WIDTH} characters: {verdict}")
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
