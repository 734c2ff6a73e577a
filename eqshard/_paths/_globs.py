"""Readable rules: the fewest, shortest rule paths that give groups of leaves their
expressions, and no other leaf.

`readable_rules` writes rules for groups of a model's leaves (the leaves of one
group share an expression); a leaf in no group is left to the default. Each
group's rules come after those of the groups written before it, so a rule may also
match leaves that an earlier rule took (rules are tried in order, the first that
matches wins), and must match no leaf of a later group or of the default. For one
group:

1. each leaf's path, with its indices made `*` where that matches no leaf it must
   not (`blocks.*.attn.query_proj.weight`; `layers.0.weight` stays where
   `layers.1.weight` is in another group), nor an earlier group's unless it
   then matches several leaves of its own;
2. paths that differ in one segment merged into a glob of what those segments share
   (`attn.*_proj.weight` for the query, key and value projections, after the
   rule that takes `attn.output_proj.weight`; `*` where they share nothing), as
   long as it matches no leaf it must not; paths that differ in one index, into
   `*` where it may, else into the alternatives of those indices
   (`layers.{0,2,4,6}.weight`, where the odd layers have another role), which
   match exactly the leaves the paths did;
3. each shortened to the shortest `**.` and a tail that matches no leaf of another
   group that the whole pattern does not (`**.up.weight`; a tail starts with a name
   or a glob, not with an index or `*`), or kept whole where that is shorter
   (`embed.weight`);
4. a rule whose leaves the group's other rules match is dropped, so every rule
   gives some leaf its expression.

Groups are written in a few orders (as given, smallest first, largest first), and
the order with the fewest rules, then the fewest characters, is kept; its rules are
then put in the order of the model's leaves, as far as each rule that takes leaves
another rule also matches stays before it.
The caller checks the result with the rules' own matching.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ._grammar import DEEP, render
from ._match import match
from ._names import is_plain

__all__ = ["readable_rules"]

Path = tuple[str, ...]
Parts = tuple[Any, ...]  # a parsed pattern: literals, `None` (`*`), globs, `DEEP`


class _Paths:
    """The model's leaf paths, and which of them a pattern matches (kept per pattern)."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = [tuple(p) for p in paths]
        self._found: dict[str, frozenset[int]] = {}

    def matched(self, parts: Parts) -> frozenset[int]:
        text = render(parts)
        found = self._found.get(text)
        if found is None:
            found = frozenset(i for i, path in enumerate(self.paths) if match(text, path))
            self._found[text] = found
        return found


def _allowed(paths: _Paths, parts: Parts, forbidden: frozenset[int]) -> bool:
    return not (paths.matched(parts) & forbidden)


def _indices_starred(
    paths: _Paths, path: Path, members: frozenset[int], forbidden: frozenset[int]
) -> Parts:
    """`path` with as many of its indices made `*` as match no forbidden leaf (nor a
    leaf of an earlier group, unless it then matches several of its own)."""
    digits = [k for k, seg in enumerate(path) if seg.isdigit()]
    for size in range(len(digits), 0, -1):
        for chosen in itertools.combinations(digits, size):
            parts = tuple(None if k in chosen else seg for k, seg in enumerate(path))
            found = paths.matched(parts)
            if not found & forbidden and (found <= members or len(found & members) > 1):
                return parts
    return tuple(path)


def _common_prefix(texts: Sequence[str]) -> str:
    first = min(texts)
    last = max(texts)  # the two that differ first, in sorted order
    k = 0
    while k < min(len(first), len(last)) and first[k] == last[k]:
        k += 1
    return first[:k]


def _common_suffix(texts: Sequence[str]) -> str:
    return _common_prefix([t[::-1] for t in texts])[::-1]


def _glob(literals: Sequence[str]) -> Any:
    """The glob of what `literals` share at their start and end: `*_proj` for
    `query_proj` and `key_proj`; `*` (`None`) where they share nothing."""
    prefix = _common_prefix(literals)
    shortest = min(len(t) for t in literals)
    suffix = _common_suffix([t[len(prefix) :] for t in literals])
    suffix = suffix[: max(0, shortest - len(prefix))] if suffix else ""
    if not prefix and not suffix:
        return None
    return (prefix, suffix)


def _indices(literals: Sequence[Any]) -> frozenset[str] | None:
    """The indices `literals` (indices, or alternatives of indices) stand for; `None`
    where one is not an index."""
    found: set[str] = set()
    for seg in literals:
        items = seg if isinstance(seg, frozenset) else {seg}
        if not all(isinstance(item, str) and item.isdigit() for item in items):
            return None
        found |= items
    return frozenset(found)


def _merge_siblings(paths: _Paths, patterns: list[Parts], forbidden: frozenset[int]) -> list[Parts]:
    """Patterns that differ in one literal segment, merged into one glob there, while
    the glob matches no forbidden leaf; indices into `*`, else their alternatives."""
    merged = True
    while merged:
        merged = False
        for at in range(max((len(p) for p in patterns), default=0)):
            buckets: dict[Parts, list[int]] = {}
            for k, parts in enumerate(patterns):
                if at < len(parts) and (
                    (isinstance(parts[at], str) and is_plain(parts[at]))
                    or isinstance(parts[at], frozenset)
                ):
                    key = (*parts[:at], "\0", *parts[at + 1 :])
                    buckets.setdefault(key, []).append(k)
            for members in buckets.values():
                if len(members) < 2:
                    continue
                first = patterns[members[0]]
                literals = [patterns[k][at] for k in members]
                indices = _indices(literals)
                if indices is None:
                    if any(isinstance(seg, frozenset) for seg in literals):
                        continue
                    glob = _glob(literals)
                else:
                    glob = None  # `*`, else the alternatives, which match no more
                candidate = (*first[:at], glob, *first[at + 1 :])
                if not _allowed(paths, candidate, forbidden):
                    if indices is None:
                        continue
                    candidate = (*first[:at], indices, *first[at + 1 :])
                keep = [p for k, p in enumerate(patterns) if k not in members]
                patterns = [*keep[: members[0]], candidate, *keep[members[0] :]]
                merged = True
                break
            if merged:
                break
    return patterns


def _names_something(part: Any) -> bool:
    """Whether a pattern's segment can start a tail after `**`: a name or a glob with
    a literal part (`up`, `*_proj`), not an index or a bare `*`, which say little."""
    if isinstance(part, str):
        return not part.isdigit()
    return isinstance(part, tuple)


def _shortest(paths: _Paths, parts: Parts, members: frozenset[int]) -> Parts:
    """`parts`, or `**` and a tail of it, whichever is shortest as text and matches
    no leaf outside `members` that `parts` does not (shortening never widens a rule
    onto other groups' leaves)."""
    options = [parts] + [
        (DEEP, *parts[len(parts) - k :])
        for k in range(1, len(parts))
        if _names_something(parts[len(parts) - k])
    ]
    others = paths.matched(parts) - members
    allowed = [p for p in options if paths.matched(p) - members <= others]
    return min(allowed, key=lambda p: (len(render(p)), len(p)))


def _cover(paths: _Paths, members: frozenset[int], forbidden: frozenset[int]) -> list[Parts]:
    """The patterns of one group: they match every member, and no forbidden leaf."""
    patterns: list[Parts] = []
    for i in sorted(members):
        parts = _indices_starred(paths, paths.paths[i], members, forbidden)
        if parts not in patterns:
            patterns.append(parts)
    patterns = _merge_siblings(paths, patterns, forbidden)
    shortened: list[Parts] = []
    for parts in patterns:
        short = _shortest(paths, parts, members)
        if short not in shortened:
            shortened.append(short)
    # drop a pattern whose members the others match, then one that comes too late
    kept = list(shortened)
    for parts in reversed(shortened):
        others = [p for p in kept if p != parts]
        mine = paths.matched(parts) & members
        if others and mine <= frozenset().union(*(paths.matched(p) & members for p in others)):
            kept = others
    taken: set[int] = set()
    result = []
    for parts in kept:
        new = (paths.matched(parts) & members) - taken
        if new:
            result.append(parts)
            taken |= new
    return result


def _write(
    paths: _Paths, groups: Sequence[frozenset[int]], order: Sequence[int]
) -> list[tuple[str, int]]:
    every = frozenset(range(len(paths.paths)))
    covered: frozenset[int] = frozenset()
    rules: list[tuple[str, int]] = []
    for g in order:
        members = groups[g]
        forbidden = every - members - covered
        rules += [(render(parts), g) for parts in _cover(paths, members, forbidden)]
        covered |= members
    return rules


def readable_rules(paths: Sequence[Path], groups: Sequence[Sequence[int]]) -> list[tuple[str, int]]:
    """Rule paths, in order, that give each group's leaves their group and no other
    leaf a rule (see the module docstring).

    **Example:**

    ```python
    readable_rules(
        [("attn", "q", "weight"), ("attn", "k", "weight"), ("attn", "o", "weight")],
        [[2], [0, 1]],
    )   # [("**.o.weight", 0), ("**.weight", 1)]: the second rule comes after the first
    ```

    **Arguments:**

    - `paths`: every array leaf's path, as segments (`_paths.segments`).
    - `groups`: the leaves of each group, as positions in `paths`; disjoint.

    **Returns:**

    `(rule path, group)` pairs, in the order the rules must be tried.
    """
    found = _Paths(paths)
    sets = [frozenset(g) for g in groups if g]
    index = [k for k, g in enumerate(groups) if g]
    orders = {
        tuple(range(len(sets))),
        tuple(sorted(range(len(sets)), key=lambda k: (len(sets[k]), k))),
        tuple(sorted(range(len(sets)), key=lambda k: (-len(sets[k]), k))),
    }
    best: list[tuple[str, int]] | None = None
    for order in sorted(orders):
        rules = _write(found, sets, order)
        if best is None or (len(rules), sum(len(r) for r, _ in rules)) < (
            len(best),
            sum(len(r) for r, _ in best),
        ):
            best = rules
    return [(text, index[g]) for text, g in _in_model_order(found, best or [])]


def _in_model_order(paths: _Paths, rules: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """`rules` reordered to follow the model's leaves where they may: a rule moves
    before another unless that one matches leaves it takes (so each leaf keeps its
    rule)."""
    matched = [frozenset(i for i, p in enumerate(paths.paths) if match(t, p)) for t, _ in rules]
    taken: list[frozenset[int]] = []
    seen: set[int] = set()
    for found in matched:
        taken.append(found - seen)
        seen |= found
    before = [
        {j for j in range(k) if matched[k] & taken[j]} for k in range(len(rules))
    ]  # the rules that must stay before rule k
    order: list[int] = []
    placed: set[int] = set()
    while len(order) < len(rules):
        ready = [k for k in range(len(rules)) if k not in placed and before[k] <= placed]
        k = min(ready, key=lambda k: (min(taken[k], default=len(paths.paths)), k))
        order.append(k)
        placed.add(k)
    return [rules[k] for k in order]
