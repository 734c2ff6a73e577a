"""The "did you mean" of a rule path that matches nothing.

The pattern is laid against each leaf path and changed only where it does not
match (`aligned`); so are its variants with one segment left out (a level the model
does not have). `difflib` picks the closest of those that match some leaf. Leaf
paths that differ only in their indices form one family, tried once (`Guesses`), so
a model with a thousand layers costs what one with two does.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from ._grammar import DEEP, Deep, Parsed, Part, parse, render
from ._match import Pattern, glob_matches, match
from ._names import name

__all__ = ["Guesses", "aligned", "closest"]


def _fix(part: Part | Deep, seg: str) -> Part | Deep:
    """`part` where it matches `seg` (or is `*`), else `seg`; `*` for an index where
    `part` is a name."""
    if (
        part is None
        or part == seg
        or (isinstance(part, tuple) and glob_matches(part, seg))
        or (isinstance(part, frozenset) and seg in part)
    ):
        return part
    if seg.isdigit() and not (isinstance(part, str) and part.isdigit()):
        return None
    return seg


def _aligned(parts: Parsed, path: Sequence[str]) -> str | None:
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
        if not Pattern(middle).match(path[len(head) : len(path) - len(tail)]):
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

    def _representatives(self, parts: Parsed) -> list[Sequence[str]]:
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
