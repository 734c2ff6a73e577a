"""Dotted leaf paths and the glob patterns of spec files, matched without regexes.

A leaf's path is its pytree key path written with dots: attribute names,
sequence indices and dict keys, as in `blocks.0.attn.query_proj.weight`. In a
pattern, a segment `*` matches one segment, `**` any number of segments (none
included), and any other segment with `*` in it, such as `*_proj`, is a glob
within one segment whose every `*` matches any run of that segment's characters.

Matching never backtracks. A pattern is cut at its `**`s into blocks of fixed
length; the first block must start the path and the last end it, and each block
between is placed at its leftmost fit after the one before, which is optimal since
`**` takes anything. A glob is cut at its `*`s the same way, with `str.find`. So a
match costs O(len(pattern) x len(path)) segment tests, and a glob O(len(glob) x
len(segment)) characters, whatever a spec file holds.

`PathIndex` finds the first of many patterns that matches a path without trying
the patterns that cannot. Each pattern gets one *anchor*, a test that some segment
of every path it matches passes: a literal segment at a fixed place from the start
or the end, a literal segment anywhere, or the literal prefix or suffix of a glob.
Of a pattern's anchors it takes the one fewest other patterns share (then: a
placed literal, a literal anywhere, a glob's end; the longer). A path looks up each of
its segments, and each of their prefixes and suffixes of the lengths in use, in
dicts keyed by anchor, which costs O(characters of the path); only the patterns so
found, and those with no anchor (only `*`, `**` and globs without literal ends),
are tried, in their order.
"""

from __future__ import annotations

import difflib
import functools
import heapq
import re
from collections.abc import Sequence
from typing import Any, Union

from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

__all__ = ["PathIndex", "aligned", "closest", "dotted", "match", "segments"]


def _segment(key: Any) -> str:
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def segments(path: Sequence[Any]) -> tuple[str, ...]:
    """The segments of a JAX key path: `(GetAttrKey('blocks'), SequenceKey(0))` ->
    `('blocks', '0')`."""
    return tuple(_segment(key) for key in path)


def dotted(path: Sequence[Any]) -> str:
    """A JAX key path with dots: `blocks.0.attn.query_proj.weight`."""
    return ".".join(segments(path))


# One segment of a pattern: a literal (str), `*` (None), or a glob within a segment:
# its pieces between `*`s, at least two (`*_proj` -> ('', '_proj')).
_Part = Union[str, None, tuple[str, ...]]
_Block = tuple[_Part, ...]


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
    """A pattern cut at its `**`s into blocks of parts: `head`, the `inner` blocks
    (empty ones left out) and `tail`; `fixed` when it has no `**`."""

    __slots__ = ("fixed", "head", "inner", "length", "tail")

    def __init__(self, text: str) -> None:
        blocks: list[list[_Part]] = [[]]
        for raw in text.split("."):
            if raw == "**":
                blocks.append([])
            elif raw == "*":
                blocks[-1].append(None)
            elif "*" in raw:
                blocks[-1].append(tuple(raw.split("*")))
            else:
                blocks[-1].append(raw)
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
    return _Pattern(pattern)


def match(pattern: str, path: Sequence[str]) -> bool:
    """Whether a dotted glob `pattern` matches the segments of `path`.

    **Example:** `match("**.up.weight", ("0", "mu", "blocks", "0", "up", "weight"))`
    is `True`; `match("blocks.*.up", ("blocks", "up"))` is `False`;
    `match("**.*_proj", ("attn", "query_proj"))` is `True`.
    """
    return _compile(pattern).match(path)


# An anchor: ("s", k, lit) or ("e", k, lit), the segment k from the start or the end
# is `lit`; ("x", lit), some segment is `lit`; ("p", text) or ("q", text), some
# segment starts or ends with `text`. Its rank: lower is preferred.
_Anchor = tuple[Any, ...]
_RANK = {"s": 0, "e": 0, "x": 1, "p": 2, "q": 2}


def _anchors(pattern: str) -> list[_Anchor]:
    """Every anchor of `pattern`: tests that some segment of any path it matches
    passes."""
    parts = pattern.split(".")
    n = len(parts)
    if "**" in parts:
        first = parts.index("**")
        last = n - 1 - parts[::-1].index("**")
    else:
        first = last = n
    found: list[_Anchor] = []
    for k, raw in enumerate(parts):
        if "*" not in raw:
            if k < first:
                found.append(("s", k, raw))
            elif k > last:
                found.append(("e", n - 1 - k, raw))
            else:
                found.append(("x", raw))
        elif raw != "*" and raw != "**":
            prefix, suffix = raw[: raw.index("*")], raw[raw.rindex("*") + 1 :]
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
        self._compiled: list[_Pattern | None] = [None] * len(self.patterns)
        # by anchor: `_start[k][lit]`, `_end[k][lit]`, `_anywhere[lit]`,
        # `_prefix[text]`, `_suffix[text]`: the positions of the patterns, in order
        self._start: list[dict[str, list[int]]] = []
        self._end: list[dict[str, list[int]]] = []
        self._anywhere: dict[str, list[int]] = {}
        self._prefix: dict[str, list[int]] = {}
        self._suffix: dict[str, list[int]] = {}
        self._free: list[int] = []  # the patterns with no anchor
        options = [_anchors(p) for p in self.patterns]
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
        if compiled is None:
            compiled = self._compiled[position] = _Pattern(self.patterns[position])
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


_LITERAL = re.compile(r"[^.*\s]+")  # a segment a rule path can name literally


def _fix(part: str, seg: str) -> str | None:
    """`part` where it matches `seg` (or is `*`), else `seg`: `*` for an index where
    `part` is a name; `None` when `seg` cannot be written in a pattern."""
    if part == "*" or part == seg or ("*" in part and match(part, (seg,))):
        return part
    if seg.isdigit() and not part.isdigit():
        return "*"
    return seg if _LITERAL.fullmatch(seg) else None


def aligned(pattern: str, path: Sequence[str]) -> str | None:
    """`pattern`, changed only where it does not match `path`, so that it does.

    Each segment of the pattern is laid against the path's (the part before the
    first `**` from the start, the part after the last from the end), and each
    literal or glob that the path's segment does not match is replaced by that
    segment. `None` when the pattern's length cannot fit the path's, or its `**`s
    hold literals the path does not have.

    **Example:** `aligned("**.upp.weight", ("blocks", "0", "up", "weight"))` is
    `"**.up.weight"`; `aligned("blocks.*.qurey", ("blocks", "1", "query"))` is
    `"blocks.*.query"`.
    """
    parts = pattern.split(".")
    if "**" not in parts:
        head, middle, tail = parts, [], []
        if len(parts) != len(path):
            return None
    else:
        first = parts.index("**")
        last = len(parts) - 1 - parts[::-1].index("**")
        head, middle, tail = parts[:first], parts[first : last + 1], parts[last + 1 :]
        if len(path) < len(head) + len(tail):
            return None
        if not match(".".join(middle), path[len(head) : len(path) - len(tail)]):
            return None
    fixed = [_fix(part, seg) for part, seg in zip(head, path)]
    fixed += middle
    fixed += [_fix(part, seg) for part, seg in zip(tail, path[len(path) - len(tail) :])]
    return None if None in fixed else ".".join(fixed)  # type: ignore[arg-type]


def closest(
    pattern: str, paths: Sequence[Sequence[str]], n: int = 3
) -> list[tuple[str, list[int]]]:
    """Patterns close to `pattern` that match some of `paths`, for a "did you mean".

    The candidates are `pattern`, and `pattern` less any one segment (a level the
    model does not have), aligned to each path (`aligned`); and, for a pattern
    without `**`, the paths themselves. `difflib.get_close_matches` picks the
    closest. Paths that differ only in their indices (`blocks.0.up`, `blocks.1.up`)
    are tried once, through the one whose indices agree most with the pattern's, so
    a model of a thousand layers costs what one of a few layers does.

    **Returns:** up to `n` `(pattern, indices)`, closest first, each with the
    positions in `paths` of the paths it matches.
    """
    parts = pattern.split(".")
    variants = [pattern] + [
        ".".join(parts[:k] + parts[k + 1 :])
        for k, part in enumerate(parts)
        if part != "**" and len(parts) > 1
    ]
    families: dict[tuple[str, ...], tuple[int, Sequence[str]]] = {}
    for path in paths:
        family = tuple("#" if seg.isdigit() else seg for seg in path)
        agree = sum(a == b for a, b in zip(path, parts)) + sum(
            a == b for a, b in zip(reversed(path), reversed(parts))
        )
        if family not in families or agree > families[family][0]:
            families[family] = (agree, path)
    candidates: set[str] = set()
    for _, path in families.values():
        for variant in variants:
            text = aligned(variant, path)
            if text is not None:
                candidates.add(text)
        if "**" not in parts and all(_LITERAL.fullmatch(seg) for seg in path):
            candidates.add(".".join(path))
    best = difflib.get_close_matches(pattern, sorted(candidates), n=n, cutoff=0.6)
    return [(text, [i for i, path in enumerate(paths) if match(text, path)]) for text in best]
