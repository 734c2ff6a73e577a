"""Rule paths matched against leaf paths, without backtracking.

A pattern is cut at its `**`s into blocks of fixed length; the first block must
start the path and the last end it, and each block between is placed at its
leftmost fit after the one before, which is optimal since `**` takes anything. A
glob is cut at its `*`s the same way, with `str.find`; alternatives (`{0,2}`) are a
set lookup. So a match costs
O(len(pattern) x len(path)) segment tests, and a glob O(len(glob) x len(segment))
characters, whatever a spec file holds.

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

import functools
import heapq
from collections.abc import Sequence
from typing import Any

from ._grammar import DEEP, Deep, Parsed, Part, parse

__all__ = ["PathIndex", "Pattern", "glob_matches", "match"]

_Block = tuple[Part, ...]  # a run of parts between `**`s


def glob_matches(pieces: tuple[str, ...], seg: str) -> bool:
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
        elif isinstance(part, frozenset):
            if path[start + k] not in part:
                return False
        elif not glob_matches(part, path[start + k]):
            return False
    return True


class Pattern:
    """A parsed pattern cut at its `**`s into blocks of parts: `head`, the `inner`
    blocks (empty ones left out) and `tail`; `fixed` when it has no `**`."""

    __slots__ = ("fixed", "head", "inner", "length", "tail")

    def __init__(self, parts: Parsed) -> None:
        blocks: list[list[Part]] = [[]]
        for part in parts:
            if isinstance(part, Deep):
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
def _compile(pattern: str) -> Pattern:
    return Pattern(parse(pattern))


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


def _anchors(parts: Parsed) -> list[_Anchor]:
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
        self._compiled: list[Pattern | Parsed] = list(parsed)  # compiled when first tried
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
        if not isinstance(compiled, Pattern):
            compiled = self._compiled[position] = Pattern(compiled)
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
