"""Dotted leaf paths and the glob patterns of spec files, matched without regexes.

A leaf's path is its pytree key path written with dots: attribute names,
sequence indices and dict keys, as in `blocks.0.attn.query_proj.weight`. A key a
dotted path cannot show as it is (empty, or holding '.', '*', white space, a
bracket, a quote, or a character `str.isprintable` refuses, such as a control
character) is written quoted, as Python's `repr` writes it, in brackets right
after the segment before it: `_weights['w[0,0] 16x0e,32x0e']`, `params["it's"].w`,
`['']`. That text (`name`) is the one name of a leaf in every message, report and
`check`, and read as a pattern it matches exactly that leaf: `name` and `parse`
are inverses.

A segment names a key by its text alone: the index 0 of a list, the key 0 of a dict
and the key '0' of a dict are all `0`, and `['w']` is `w`. Two children of one node
never share a text (a node is a sequence or a dict, and a dict's keys must sort
against each other to flatten, so they are all strings or all numbers).

In a pattern, a segment `*` matches one segment, `**` any number of segments (none
included), and any other unquoted segment with `*` in it, such as `*_proj`, is a
glob within one segment whose every `*` matches any run of that segment's
characters. A quoted segment is always literal: `['*']` matches only the key `*`.
`parse` reads a pattern with one hand-written loop (a spec file never runs code:
no `eval`), and a fault is a `PathError` with a caret under its column. The
schema's `path` pattern accepts exactly what `parse` accepts.

Matching never backtracks. A pattern is cut at its `**`s into blocks of fixed
length; the first block must start the path and the last end it, and each block
between is placed at its leftmost fit after the one before, which is optimal since
`**` takes anything. A glob is cut at its `*`s the same way, with `str.find`. So a
match costs O(len(pattern) x len(path)) segment tests, and a glob O(len(glob) x
len(segment)) characters, whatever a spec file holds.

`PathIndex` finds the first of many patterns that matches a path without trying
the patterns that cannot. Each pattern gets one *anchor*, a test that some segment
of every path it matches passes: a literal segment (quoted or not) at a fixed place
from the start or the end, a literal segment anywhere, or the literal prefix or
suffix of a glob. Of a pattern's anchors it takes the one fewest other patterns
share (then: a placed literal, a literal anywhere, a glob's end; the longer). A path
looks up each of its segments, and each of their prefixes and suffixes of the
lengths in use, in dicts keyed by anchor, which costs O(characters of the path);
only the patterns so found, and those with no anchor (only `*`, `**` and globs
without literal ends), are tried, in their order.
"""

from __future__ import annotations

import difflib
import functools
import heapq
import re
from collections.abc import Sequence
from typing import Any, Union

from .._errors import PathError

__all__ = [
    "DEEP",
    "Guesses",
    "PathIndex",
    "aligned",
    "closest",
    "dotted",
    "match",
    "name",
    "parse",
    "quoted_key",
    "render",
    "segments",
]


@functools.cache
def _key_fields() -> dict[type, str]:
    """JAX's key classes, and the attribute that holds each one's key. JAX is
    imported only here, so the spec-file layer reads patterns without it."""
    from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

    return {GetAttrKey: "name", SequenceKey: "idx", DictKey: "key", FlattenedIndexKey: "key"}


def _segment(key: Any, fields: dict[type, str]) -> str:
    field = fields.get(type(key))
    return str(key) if field is None else str(getattr(key, field))


def segments(path: Sequence[Any]) -> tuple[str, ...]:
    """The segments of a JAX key path: `(GetAttrKey('blocks'), SequenceKey(0))` ->
    `('blocks', '0')`."""
    fields = _key_fields()
    return tuple(_segment(key, fields) for key in path)


_PLAIN = re.compile(r"[^.*\s\[\]'\"]+")  # a literal segment written as it is


def name(segs: Sequence[str]) -> str:
    """The segments as one dotted name, each quoted where it must be.

    **Example:** `name(("_weights", "w[0,0] 16x0e,32x0e"))` is
    `"_weights['w[0,0] 16x0e,32x0e']"`; `name(("blocks", "0", "w"))` is
    `"blocks.0.w"`; `name(())` is `""`.
    """
    text = ""
    for seg in segs:
        if _PLAIN.fullmatch(seg) and seg.isprintable():
            text += f".{seg}" if text else seg
        else:
            text += f"[{seg!r}]"
    return text


def dotted(path: Sequence[Any]) -> str:
    """A JAX key path as one name (`name`): `blocks.0.attn.query_proj.weight`."""
    return name(segments(path))


class _Deep:
    """`**`, the segment that matches any number of segments: the value `DEEP`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DEEP"


DEEP = _Deep()
"""`**` in a parsed pattern."""

# One segment of a pattern: a literal (str), `*` (None), or a glob within a segment:
# its pieces between `*`s, at least two (`*_proj` -> ('', '_proj')).
_Part = Union[str, None, tuple[str, ...]]
_Block = tuple[_Part, ...]
# What `parse` gives: those, and `DEEP` for `**`.
_Parsed = tuple[Union[_Part, _Deep], ...]

_STOP = re.compile(r"[.\[]")  # where an unquoted segment ends
_GLOB_CHARS = re.compile(r"[^.\s\[\]'\"]+")  # a literal or a glob, as it is
_BAD = re.compile(r"[\s\[\]'\"]")  # what an unquoted segment may not hold
_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "n": "\n", "r": "\r", "t": "\t"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_INDEX = re.compile(r"\[([0-9]+)\]")  # an index as `keystr` writes it
_HEX = frozenset("0123456789abcdefABCDEF")
_QUOTING = (
    "a key holding '.', '*', white space, a bracket or a quote is written quoted, "
    "as eqshard names it"
)


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> _Parsed:
    """The segments of a rule path: literals (quoted or not), `*` (`None`), globs
    (their pieces between `*`s) and `**` (`DEEP`).

    **Example:** `parse("**['a.b'].*_proj")` is `(DEEP, "a.b", ("", "_proj"))`.

    **Raises:** `eqshard.PathError` with a caret under the fault, and the path with
    the key quoted where that is the fix.
    """
    return _parse(text, hints=True)


def _parse(text: str, *, hints: bool) -> _Parsed:
    n = len(text)
    if n == 0:
        raise PathError(text, 0, "an empty rule path; name a segment ('**' matches every leaf)")
    parts: list[_Part | _Deep] = []
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


def _unquoted(text: str, start: int, end: int, hints: bool) -> _Part | _Deep:
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


def render(parts: Sequence[_Part | _Deep]) -> str:
    """A parsed pattern as text, quoting literals where they must be (`name`): the
    inverse of `parse`.

    **Example:** `render((DEEP, "attn", ("", "_proj"), "weight"))` is
    `"**.attn.*_proj.weight"`.
    """
    text = ""
    for part in parts:
        if isinstance(part, str):
            written = name((part,))
            text += written if written.startswith("[") or not text else f".{written}"
            continue
        written = "**" if isinstance(part, _Deep) else "*" if part is None else "*".join(part)
        text += f".{written}" if text else written
    return text


def _glob(pieces: tuple[str, ...], seg: str) -> bool:
    """Whether `seg` matches the glob cut into `pieces` at its `*`s. Each piece
    between the ends goes at its leftmost place: O(len(glob) x len(seg))."""
    first, last = pieces[0], pieces[-1]
    end = len(seg) - len(last)
    if end < len(first) or not seg.startswith(first) or not seg.endswith(last):
        return False
    pos = len(first)
    for piece in pieces[1:-1]:
        found = seg.find(piece, pos, end)
        if found < 0:
            return False
        pos = found + len(piece)
    return True


def _fits(block: _Block, path: Sequence[str], start: int) -> bool:
    """Whether `block` matches `path[start:start + len(block)]`."""
    for k, part in enumerate(block):
        if part is None:
            continue
        if isinstance(part, str):
            if part != path[start + k]:
                return False
        elif not _glob(part, path[start + k]):
            return False
    return True


class _Pattern:
    """A parsed pattern cut at its `**`s into blocks of parts: `head`, the `inner`
    blocks (empty ones left out) and `tail`; `fixed` when it has no `**`."""

    __slots__ = ("fixed", "head", "inner", "length", "tail")

    def __init__(self, parts: _Parsed) -> None:
        blocks: list[list[_Part]] = [[]]
        for part in parts:
            if isinstance(part, _Deep):
                blocks.append([])
            else:
                blocks[-1].append(part)
        self.fixed = len(blocks) == 1  # the path has the pattern's length
        self.head: _Block = tuple(blocks[0])
        self.tail: _Block = tuple(blocks[-1]) if len(blocks) > 1 else ()
        self.inner: tuple[_Block, ...] = tuple(tuple(b) for b in blocks[1:-1] if b)
        self.length = sum(len(b) for b in blocks)  # the fewest segments it matches

    def match(self, path: Sequence[str]) -> bool:
        n = len(path)
        if self.fixed:
            return n == self.length and _fits(self.head, path, 0)
        tail = self.tail
        if n < self.length or not (_fits(tail, path, n - len(tail)) and _fits(self.head, path, 0)):
            return False
        pos, end = len(self.head), n - len(tail)
        for block in self.inner:
            # the leftmost place for this block leaves the most room for the rest
            last = end - len(block)
            while pos <= last and not _fits(block, path, pos):
                pos += 1
            if pos > last:
                return False
            pos += len(block)
        return True


@functools.lru_cache(maxsize=4096)
def _compile(pattern: str) -> _Pattern:
    return _Pattern(parse(pattern))


def match(pattern: str, path: Sequence[str]) -> bool:
    """Whether a rule path `pattern` matches the segments of `path`.

    **Example:** `match("**.up.weight", ("0", "mu", "blocks", "0", "up", "weight"))`
    is `True`; `match("blocks.*.up", ("blocks", "up"))` is `False`;
    `match("**.*_proj", ("attn", "query_proj"))` is `True`;
    `match("_weights['w[0,0] 16x0e']", ("_weights", "w[0,0] 16x0e"))` is `True`.

    **Raises:** `eqshard.PathError` when `pattern` is not a rule path.
    """
    return _compile(pattern).match(path)


# An anchor: ("s", k, lit) or ("e", k, lit), the segment k from the start or the end
# is `lit`; ("x", lit), some segment is `lit`; ("p", text) or ("q", text), some
# segment starts or ends with `text`. Its rank: lower is preferred.
_Anchor = tuple[Any, ...]
_RANK = {"s": 0, "e": 0, "x": 1, "p": 2, "q": 2}


def _anchors(parts: _Parsed) -> list[_Anchor]:
    """Every anchor of a parsed pattern: tests that some segment of any path it
    matches passes."""
    n = len(parts)
    deep = [k for k, part in enumerate(parts) if part is DEEP]
    first, last = (deep[0], deep[-1]) if deep else (n, n)
    found: list[_Anchor] = []
    for k, part in enumerate(parts):
        if isinstance(part, str):
            if k < first:
                found.append(("s", k, part))
            elif k > last:
                found.append(("e", n - 1 - k, part))
            else:
                found.append(("x", part))
        elif isinstance(part, tuple):
            prefix, suffix = part[0], part[-1]
            if prefix:
                found.append(("p", prefix))
            if suffix:
                found.append(("q", suffix))
    return found


class PathIndex:
    """Many patterns, indexed so that a path tries only those that may match it.

    **Example:** `PathIndex(["**.bias", "blocks.*.*_proj.weight"]).first(("blocks",
    "0", "query_proj", "weight"))` is `1`. See the module docstring for the design.
    """

    __slots__ = (
        "_anywhere",
        "_compiled",
        "_end",
        "_free",
        "_prefix",
        "_prefix_firsts",
        "_prefix_lengths",
        "_start",
        "_suffix",
        "_suffix_lasts",
        "_suffix_lengths",
        "patterns",
    )

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns: tuple[str, ...] = tuple(patterns)
        parsed = [parse(p) for p in self.patterns]
        self._compiled: list[_Pattern | _Parsed] = list(parsed)  # compiled when first tried
        # by anchor: `_start[k][lit]`, `_end[k][lit]`, `_anywhere[lit]`,
        # `_prefix[text]`, `_suffix[text]`: the positions of the patterns, in order
        self._start: list[dict[str, list[int]]] = []
        self._end: list[dict[str, list[int]]] = []
        self._anywhere: dict[str, list[int]] = {}
        self._prefix: dict[str, list[int]] = {}
        self._suffix: dict[str, list[int]] = {}
        self._free: list[int] = []  # the patterns with no anchor
        options = [_anchors(parts) for parts in parsed]
        shared: dict[_Anchor, int] = {}
        for found in options:
            for anchor in set(found) if len(found) > 1 else found:
                shared[anchor] = shared.get(anchor, 0) + 1
        for position, found in enumerate(options):
            if not found:
                self._free.append(position)
                continue
            # the anchor the fewest patterns share; then literal, placed, longer
            anchor = (
                found[0]
                if len(found) == 1
                else min(found, key=lambda a: (shared[a], _RANK[a[0]], -len(a[-1])))
            )
            kind = anchor[0]
            if kind == "s" or kind == "e":
                table = self._start if kind == "s" else self._end
                table.extend({} for _ in range(anchor[1] + 1 - len(table)))
                table[anchor[1]].setdefault(anchor[2], []).append(position)
            else:
                table = {"x": self._anywhere, "p": self._prefix, "q": self._suffix}[kind]
                table.setdefault(anchor[1], []).append(position)
        self._prefix_lengths = sorted({len(t) for t in self._prefix})
        self._suffix_lengths = sorted({len(t) for t in self._suffix})
        self._prefix_firsts = frozenset(t[0] for t in self._prefix)
        self._suffix_lasts = frozenset(t[-1] for t in self._suffix)

    def __len__(self) -> int:
        return len(self.patterns)

    def _buckets(self, segs: Sequence[str]) -> list[list[int]]:
        """The lists of patterns whose anchor `segs` passes, each in pattern order.
        A list may come twice (a segment seen twice), never a pattern in two lists."""
        found: list[list[int]] = []
        n = len(segs)
        start, end, anywhere = self._start, self._end, self._anywhere
        prefix, suffix = self._prefix, self._suffix
        for i, seg in enumerate(segs):
            if i < len(start):
                bucket = start[i].get(seg)
                if bucket is not None:
                    found.append(bucket)
            if n - 1 - i < len(end):
                bucket = end[n - 1 - i].get(seg)
                if bucket is not None:
                    found.append(bucket)
            if anywhere:
                bucket = anywhere.get(seg)
                if bucket is not None:
                    found.append(bucket)
            if prefix and seg and seg[0] in self._prefix_firsts:
                for length in self._prefix_lengths:
                    if length > len(seg):
                        break
                    bucket = prefix.get(seg[:length])
                    if bucket is not None:
                        found.append(bucket)
            if suffix and seg and seg[-1] in self._suffix_lasts:
                for length in self._suffix_lengths:
                    if length > len(seg):
                        break
                    bucket = suffix.get(seg[len(seg) - length :])
                    if bucket is not None:
                        found.append(bucket)
        if self._free:
            found.append(self._free)
        return found

    def _matches(self, position: int, segs: Sequence[str]) -> bool:
        compiled = self._compiled[position]
        if not isinstance(compiled, _Pattern):
            compiled = self._compiled[position] = _Pattern(compiled)
        return compiled.match(segs)

    def first(self, segs: Sequence[str]) -> int | None:
        """The position of the first pattern that matches `segs`, or `None`."""
        buckets = self._buckets(segs)
        if len(buckets) == 1:
            for position in buckets[0]:
                if self._matches(position, segs):
                    return position
            return None
        tried = -1
        for position in heapq.merge(*buckets):
            if position != tried and self._matches(position, segs):
                return position
            tried = position
        return None

    def all(self, segs: Sequence[str]) -> list[int]:
        """The positions of every pattern that matches `segs`, in order."""
        every: list[int] = []
        tried = -1
        for position in heapq.merge(*self._buckets(segs)):
            if position != tried and self._matches(position, segs):
                every.append(position)
            tried = position
        return every


def _fix(part: _Part | _Deep, seg: str) -> _Part | _Deep:
    """`part` where it matches `seg` (or is `*`), else `seg`; `*` for an index where
    `part` is a name."""
    if part is None or part == seg or (isinstance(part, tuple) and _glob(part, seg)):
        return part
    if seg.isdigit() and not (isinstance(part, str) and part.isdigit()):
        return None
    return seg


def _aligned(parts: _Parsed, path: Sequence[str]) -> str | None:
    deep = [k for k, part in enumerate(parts) if part is DEEP]
    if not deep:
        head, middle, tail = parts, (), ()
        if len(parts) != len(path):
            return None
    else:
        first, last = deep[0], deep[-1]
        head, middle, tail = parts[:first], parts[first : last + 1], parts[last + 1 :]
        if len(path) < len(head) + len(tail):
            return None
        if not _Pattern(middle).match(path[len(head) : len(path) - len(tail)]):
            return None
    fixed = [_fix(part, seg) for part, seg in zip(head, path)]
    fixed += middle
    fixed += [_fix(part, seg) for part, seg in zip(tail, path[len(path) - len(tail) :])]
    return render(fixed)


def aligned(pattern: str, path: Sequence[str]) -> str | None:
    """`pattern`, changed only where it does not match `path`, so that it does.

    Each segment of the pattern is laid against the path's (the part before the
    first `**` from the start, the part after the last from the end), and each
    literal or glob that the path's segment does not match is replaced by that
    segment (quoted where it must be). `None` when the pattern's length cannot fit
    the path's, or its `**`s hold literals the path does not have.

    **Example:** `aligned("**.upp.weight", ("blocks", "0", "up", "weight"))` is
    `"**.up.weight"`; `aligned("blocks.*.qurey", ("blocks", "1", "query"))` is
    `"blocks.*.query"`.
    """
    return _aligned(parse(pattern), path)


class Guesses:
    """The "did you mean" of rule paths against one model's leaf paths, made once
    for many rules: paths that differ only in their indices (`blocks.0.up`,
    `blocks.1.up`) form one family, tried once, and each guess's matches are kept.

    **Example:** `Guesses(paths).closest("blocks.*.upp.weight")` is
    `[("blocks.*.up.weight", [2, 12, ...])]`.
    """

    def __init__(self, paths: Sequence[Sequence[str]]) -> None:
        self.paths = paths
        self._families: dict[tuple[str, ...], list[int]] = {}
        for i, path in enumerate(paths):
            family = tuple("#" if seg.isdigit() else seg for seg in path)
            self._families.setdefault(family, []).append(i)
        self._matches: dict[str, list[int]] = {}

    def _representatives(self, parts: _Parsed) -> list[Sequence[str]]:
        """One path of each family: the one whose indices agree most with the
        pattern's (any, when the pattern names no index)."""
        if not any(isinstance(part, str) and part.isdigit() for part in parts):
            return [self.paths[members[0]] for members in self._families.values()]
        found = []
        for members in self._families.values():
            best = max(
                members,
                key=lambda i: (
                    sum(a == b for a, b in zip(self.paths[i], parts))
                    + sum(a == b for a, b in zip(reversed(self.paths[i]), reversed(parts))),
                    -i,
                ),
            )
            found.append(self.paths[best])
        return found

    def matching(self, text: str) -> list[int]:
        """The positions of the paths `text` matches (kept for the next rule)."""
        if text not in self._matches:
            self._matches[text] = [i for i, path in enumerate(self.paths) if match(text, path)]
        return self._matches[text]

    def closest(self, pattern: str, n: int = 3) -> list[tuple[str, list[int]]]:
        """Patterns close to `pattern` that match some of the paths.

        The candidates are `pattern`, and `pattern` less any one segment (a level
        the model does not have), aligned to each path (`aligned`); and, for a
        pattern without `**`, the paths themselves, as `name` writes them.
        `difflib`'s `get_close_matches` picks the closest.

        **Returns:** up to `n` `(pattern, indices)`, closest first, each with the
        positions of the paths it matches.
        """
        parts = parse(pattern)
        variants = [parts] + [
            parts[:k] + parts[k + 1 :]
            for k, part in enumerate(parts)
            if part is not DEEP and len(parts) > 1
        ]
        candidates: set[str] = set()
        for path in self._representatives(parts):
            for variant in variants:
                text = _aligned(variant, path)
                if text is not None:
                    candidates.add(text)
            if DEEP not in parts and path:
                candidates.add(name(path))
        best = difflib.get_close_matches(pattern, sorted(candidates), n=n, cutoff=0.6)
        return [(text, self.matching(text)) for text in best]


def closest(
    pattern: str, paths: Sequence[Sequence[str]], n: int = 3
) -> list[tuple[str, list[int]]]:
    """`Guesses(paths).closest(pattern, n)`: a "did you mean" for one rule path."""
    return Guesses(paths).closest(pattern, n)
