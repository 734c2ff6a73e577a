"""Dotted leaf paths and the glob patterns of spec files, matched without regexes.

A leaf's path is its pytree key path written with dots: attribute names,
sequence indices and dict keys, as in `blocks.0.attn.query_proj.weight`. In a
pattern, `*` matches one segment and `**` any number of segments, none included.
Matching is a dynamic programme over segments: linear in the pattern times the
path, whatever the pattern, so a spec file cannot cause catastrophic backtracking.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

__all__ = ["dotted", "match", "segments"]


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


@functools.lru_cache(maxsize=4096)
def _matcher(pattern: str) -> Callable[[Sequence[str]], bool]:
    """A function that tells whether a path's segments match `pattern`.

    Patterns without `**` compare segment by segment; only `**` needs the DP.
    """
    parts = tuple(pattern.split("."))
    if "**" not in parts:
        if "*" not in parts:
            return lambda path: tuple(path) == parts
        return lambda path: (
            len(path) == len(parts) and all(p == "*" or p == s for p, s in zip(parts, path))
        )
    # Split at the last `**`: the tail after it has a fixed length, so it must match
    # the path's last segments, which rejects most paths at once; only the head
    # (up to and including that `**`) needs the DP, and `**` alone needs nothing.
    cut = len(parts) - parts[::-1].index("**")
    head, tail = parts[:cut], parts[cut:]

    def matches(path: Sequence[str]) -> bool:
        rest = len(path) - len(tail)
        if rest < 0 or not all(p == "*" or p == s for p, s in zip(tail, path[rest:])):
            return False
        return head == ("**",) or _dp(head, path[:rest])

    return matches


def _dp(parts: Sequence[str], path: Sequence[str]) -> bool:
    """Whether `parts` match all of `path`: linear in len(parts) x len(path)."""
    reach = [True] + [False] * len(path)  # reach[j]: the parts so far match path[:j]
    for part in parts:
        if part == "**":
            # zero or more segments: once reached, every later position is too
            for j in range(1, len(path) + 1):
                reach[j] = reach[j] or reach[j - 1]
        else:
            reach = [False] + [
                reach[j] and (part == "*" or part == path[j]) for j in range(len(path))
            ]
    return reach[len(path)]


def match(pattern: str, path: Sequence[str]) -> bool:
    """Whether a dotted glob `pattern` matches the segments of `path`.

    **Example:** `match("**.up.weight", ("0", "mu", "blocks", "0", "up", "weight"))`
    is `True`; `match("blocks.*.up", ("blocks", "up"))` is `False`.
    """
    return _matcher(pattern)(path)
