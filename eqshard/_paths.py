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
    last = parts[-1]
    literal_end = last not in ("*", "**")

    def dp(path: Sequence[str]) -> bool:
        if literal_end and (not path or path[-1] != last):
            return False  # the common case, `**.up.weight`, rejected at once
        # reach[j]: the parts so far match the first j segments.
        reach = [True] + [False] * len(path)
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

    return dp


def match(pattern: str, path: Sequence[str]) -> bool:
    """Whether a dotted glob `pattern` matches the segments of `path`.

    **Example:** `match("**.up.weight", ("0", "mu", "blocks", "0", "up", "weight"))`
    is `True`; `match("blocks.*.up", ("blocks", "up"))` is `False`.
    """
    return _matcher(pattern)(path)
