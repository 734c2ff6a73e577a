"""The rule-path grammar: `parse`, the parsed pattern's parts, and `render`.

In a pattern, a segment `*` matches one segment, `**` any number of segments (none
included), and any other unquoted segment with `*` in it, such as `*_proj`, is a
glob within one segment whose every `*` matches any run of that segment's
characters. A segment `{0,2,4}` (alternatives: plain names or indices between braces,
separated by commas) matches any one of them. A quoted segment is always literal: `['*']` matches only the key `*`,
and a key is quoted as `name` quotes it, so `parse` reads back exactly what `name`
writes. `parse` reads a pattern with one hand-written loop (a spec file never runs
code: no `eval`), and a fault is a `PathError` with a caret under its column. The
schema's `path` pattern accepts exactly what `parse` accepts. `render` writes a
parsed pattern back as text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Union

from .._errors import PathError
from ._names import name

__all__ = ["DEEP", "Deep", "Parsed", "Part", "parse", "quoted_key", "render"]


class Deep:
    """`**`, the segment that matches any number of segments: the value `DEEP`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DEEP"


DEEP = Deep()
"""`**` in a parsed pattern."""

Part = Union[str, None, tuple[str, ...], frozenset[str]]
"""One segment of a pattern: a literal (`str`), `*` (`None`), a glob within a
segment: its pieces between `*`s, at least two (`*_proj` -> `('', '_proj')`), or
alternatives (`{0,2}` -> `frozenset({'0', '2'})`)."""

Parsed = tuple[Union[Part, Deep], ...]
"""What `parse` gives: parts, and `DEEP` for `**`."""

_STOP = re.compile(r"[.\[]")  # where an unquoted segment ends
_GLOB_CHARS = re.compile(r"[^.\s\[\]'\"{}]+")  # a literal or a glob, as it is
_BAD = re.compile(r"[\s\[\]'\"{}]")  # what an unquoted segment may not hold
_ALTERNATIVE = re.compile(r"[^.*\s\[\]'\"{},]+")  # one of `{a,b}`
_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "n": "\n", "r": "\r", "t": "\t"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_INDEX = re.compile(r"\[([0-9]+)\]")  # an index as `keystr` writes it
_HEX = frozenset("0123456789abcdefABCDEF")
_QUOTING = (
    "a key holding '.', '*', white space, a bracket or a quote is written quoted, "
    "as eqshard names it"
)


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> Parsed:
    """The segments of a rule path: literals (quoted or not), `*` (`None`), globs
    (their pieces between `*`s), alternatives (a `frozenset`) and `**` (`DEEP`).

    **Example:** `parse("**['a.b'].*_proj.{0,2}")` is
    `(DEEP, "a.b", ("", "_proj"), frozenset({"0", "2"}))`.

    **Raises:** `eqshard.PathError` with a caret under the fault, and the path with
    the key quoted where that is the fix.
    """
    return _parse(text, hints=True)


def _parse(text: str, *, hints: bool) -> Parsed:
    n = len(text)
    if n == 0:
        raise PathError(text, 0, "an empty rule path; name a segment ('**' matches every leaf)")
    parts: list[Part | Deep] = []
    i = start = 0  # where the segment, and its dotted part, start
    while True:
        if text[i] == "[":
            literal, i = _quoted(text, i, start if hints else None)
            parts.append(literal)
        else:
            stop = _STOP.search(text, i)
            end = n if stop is None else stop.start()
            parts.append(_unquoted(text, i, end, hints))
            i = end
        if i == n:
            return tuple(parts)
        if text[i] == "[":
            continue
        if text[i] != ".":
            raise PathError(text, i, "after a quoted key comes '.', another quoted key, or the end")
        if i + 1 == n:
            raise PathError(text, i, "the path ends with '.'; drop it, or name a segment after it")
        if text[i + 1] == "[":
            raise PathError(
                text,
                i,
                "a quoted key follows the segment before it with no '.' between: "
                f"write {text[:i] + text[i + 1 :]!r}",
            )
        i = start = i + 1


def _unquoted(text: str, start: int, end: int, hints: bool) -> Part | Deep:
    """The segment `text[start:end]`, written without quotes."""
    run = text[start:end]
    if run == "**":
        return DEEP
    if run == "*":
        return None
    if not run:
        if start == 0:
            raise PathError(text, 0, "the path starts with '.'; drop it ('**.' matches any prefix)")
        raise PathError(
            text,
            start,
            "an empty segment: segments are separated by one '.'; an empty key is written ['']",
        )
    if run[0] == "{":
        return _alternatives(text, start, end)
    if "{" in run or "}" in run:
        at = start + min(k for k in (run.find("{"), run.find("}")) if k >= 0)
        raise PathError(
            text,
            at,
            f"{text[at]!r} in a segment; alternatives are a whole segment, such as "
            "layers.{0,2,4}.weight; a key holding a brace is written quoted, as eqshard "
            "names it",
        )
    if not _GLOB_CHARS.fullmatch(run):
        bad = _BAD.search(run)
        at = start + (bad.start() if bad else 0)
        what = "white space" if text[at].isspace() else repr(text[at])
        hint = _quoted_hint(text, start) if hints else ""
        raise PathError(text, at, f"{what} in a segment; {_QUOTING}{hint}")
    if "**" in run:
        hint = _quoted_hint(text, start) if hints else ""
        raise PathError(
            text,
            start + run.index("**"),
            "'**' is a whole segment (any number of segments); in a glob each '*' stands "
            f"alone, as in '*_proj'; a key holding '*' is written quoted{hint}",
            length=2,
        )
    return tuple(run.split("*")) if "*" in run else run


def _alternatives(text: str, start: int, end: int) -> frozenset[str]:
    """The alternatives `text[start:end]`, `{a,b,...}`: plain names or indices."""
    close = text.find("}", start, end)
    if close < 0:
        raise PathError(
            text, start, "the alternatives are not closed; end them with '}'", length=end - start
        )
    if close + 1 != end:
        raise PathError(
            text,
            close + 1,
            "alternatives are a whole segment: after '}' comes '.', a quoted key, or the end",
        )
    found: list[str] = []
    at = start + 1
    for item in text[start + 1 : close].split(","):
        if not _ALTERNATIVE.fullmatch(item):
            bad = next((k for k, c in enumerate(item) if not _ALTERNATIVE.fullmatch(c)), 0)
            what = "an empty alternative" if not item else f"{item[bad]!r} in an alternative"
            raise PathError(
                text,
                at + bad,
                f"{what}; alternatives are plain names or indices between braces, "
                "separated by ',', such as {0,2,4} or {query_proj,key_proj}",
            )
        found.append(item)
        at += len(item) + 1
    return frozenset(found)


def _alternative_order(item: str) -> tuple[bool, int, str]:
    return (not item.isdigit(), int(item) if item.isdigit() else 0, item)


def _quote(seg: str) -> str:
    return f"[{seg!r}]"


def _quoted_hint(text: str, start: int) -> str:
    """`: <the path with the key from `start` to the next '.' quoted>`, where that
    path reads; else an example."""
    end = text.find(".", start)
    end = len(text) if end < 0 else end
    dot = start > 0 and text[start - 1] == "."
    hint = text[: start - dot] + _quote(text[start:end]) + text[end:]
    try:
        _parse(hint, hints=False)
    except PathError:
        return " (params['a b'].w, for instance)"
    return f": {hint}"


def _quoted(text: str, at: int, start: int | None) -> tuple[str, int]:
    """The key quoted at `text[at]` (a '['), and where it ends. `start`, where the
    dotted part it is in starts, is for the hint (`None`: no hint)."""
    n = len(text)
    quote = text[at + 1] if at + 1 < n else ""
    if quote not in ("'", '"'):
        index = _INDEX.match(text, at)
        if index is not None:  # `layers[0]`, as `jax.tree_util.keystr` writes it
            dotted = f"{text[:at]}{'.' * (at > 0)}{index[1]}{text[index.end() :]}"
            raise PathError(
                text,
                at,
                f"an index is a segment of its own, after a '.': {dotted}",
                length=index.end() - at,
            )
        hint = ""
        if start is not None:  # a key with a bracket in it: quote all of it
            hint = _quoted_hint(text, start if "[" not in text[start:at] else at)
        raise PathError(text, at, f"'[' opens a quoted key, ['...'] or [\"...\"]; {_QUOTING}{hint}")
    out: list[str] = []
    i = at + 2
    while True:
        if i >= n:
            raise PathError(
                text,
                at,
                f"the quoted key is not closed; end it with {quote + ']'!r}",
                length=n - at,
            )
        c = text[i]
        if c == quote:
            break
        if c == "\\":
            char, i = _escape(text, i)
            out.append(char)
            continue
        out.append(c)
        i += 1
    if i + 1 >= n or text[i + 1] != "]":
        raise PathError(
            text, i + 1, f"a quoted key ends with {quote + ']'!r}; put ']' right after the {quote}"
        )
    return "".join(out), i + 2


def quoted_key(text: str, at: int) -> tuple[str, int]:
    """The key that `repr` quoted at `text[at]` (a '[', as in `['a b']`), and where
    it ends: how `name` and `jax.tree_util.keystr` write a dict key.

    **Raises:** `PathError` when no quoted key starts there.
    """
    return _quoted(text, at, None)


def _escape(text: str, at: int) -> tuple[str, int]:
    """The character the escape at `text[at]` (a backslash) stands for, and where
    it ends: the escapes Python's `repr` writes."""
    kind = text[at + 1 : at + 2]
    if kind in _ESCAPES:
        return _ESCAPES[kind], at + 2
    digits = _HEX_ESCAPES.get(kind)
    if digits is not None:
        hex_digits = text[at + 2 : at + 2 + digits]
        if len(hex_digits) == digits and all(c in _HEX for c in hex_digits):
            code = int(hex_digits, 16)
            if code <= 0x10FFFF:
                return chr(code), at + 2 + digits
            raise PathError(
                text, at, f"U+{code:X} is past the last code point, U+10FFFF", length=2 + digits
            )
        valid = next((k for k, c in enumerate(hex_digits) if c not in _HEX), len(hex_digits))
        raise PathError(text, at, f"'\\{kind}' takes {digits} hex digits", length=2 + valid)
    escape = f"'\\{kind}'" if kind.isprintable() else f"'\\' before {kind!r}"
    raise PathError(
        text,
        at,
        f"{escape} is not an escape of a quoted key; those are the escapes "
        "Python's repr writes: \\\\ \\' \\\" \\n \\r \\t \\xhh \\uhhhh \\Uhhhhhhhh",
        length=2,
    )


def render(parts: Sequence[Part | Deep]) -> str:
    """A parsed pattern as text, quoting literals where they must be (`name`): the
    inverse of `parse` (alternatives in order, indices by value: `{0,2,10,key}`).

    **Example:** `render((DEEP, "attn", ("", "_proj"), "weight"))` is
    `"**.attn.*_proj.weight"`.
    """
    text = ""
    for part in parts:
        if isinstance(part, str):
            written = name((part,))
            text += written if written.startswith("[") or not text else f".{written}"
            continue
        if isinstance(part, Deep):
            written = "**"
        elif part is None:
            written = "*"
        elif isinstance(part, frozenset):
            written = "{" + ",".join(sorted(part, key=_alternative_order)) + "}"
        else:
            written = "*".join(part)
        text += f".{written}" if text else written
    return text
