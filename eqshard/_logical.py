"""Logical axis rules, as Flax and MaxText resolve them: an ordered table of
`(logical name, mesh axes)` pairs placing each named dim of an array.

This module imports no JAX: `eqshard validate` reads a spec file's table with it.

Flax's resolution (`flax/linen/spmd.py`, `_logical_to_mesh_axes`), which MaxText uses:

- the rules are read in the table's order; a rule claims its name's dim when that dim
  is still unclaimed and none of the rule's mesh axes is used by the array yet, all of
  its axes or none;
- so a name may have several rules, the later ones fallbacks, and a mesh axis splits
  one dim of an array at most;
- a rule to `None` (JSON `null`) or to no axes (`[]`) claims its dim whole, and later
  rules of that name are then not read;
- a name no rule claims is whole.

Then MaxText's treatment of the mesh (`src/maxtext/utils/sharding.py`,
`remove_size_one_mesh_axis`): an axis of size 1, or one the mesh lacks, is dropped
from the dims it placed. It still counted as used while the rules were read, so a
size-1 axis claimed first keeps a later rule from taking its dim: MaxText leaves the
sequence dim of its activations whole on a mesh whose `expert` axis has size 1.
`tests/peers/` holds both peers' code as oracles, and their own test cases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ._errors import EqshardError

__all__ = ["AxisRule", "Placed", "axis_rules", "place"]


@dataclasses.dataclass(frozen=True)
class AxisRule:
    """One rule of a table: a logical name and the mesh axes it splits its dim over,
    the major first (none: whole).

    **Attributes:** `name`; `axes`, a tuple of mesh axis names; `index`, the rule's
    place in its table, for messages.
    """

    name: str
    axes: tuple[str, ...]
    index: int


@dataclasses.dataclass(frozen=True)
class Placed:
    """Where the rules put one dim of an array.

    **Attributes:**

    - `axes`: the mesh axes it is split over, the major first; none where it is whole.
    - `rule`: the rule that claimed it, or `None` where none did.
    - `dropped`: the axes of that rule left out, each of size 1 or not on the mesh.
    """

    axes: tuple[str, ...] = ()
    rule: AxisRule | None = None
    dropped: tuple[str, ...] = ()


def axis_rules(table: object, what: str = "`logical_axis_rules`") -> tuple[AxisRule, ...]:
    """`table`, a list of `(name, axes)` pairs as Flax and MaxText write them (`axes` a
    mesh axis, a list of them, or `None`), as `AxisRule`s.

    **Raises:** `EqshardError` naming `what` and the pair at fault: a pair that is not
    two items, a name that is not text, or axes that are not a name, names or `None`.
    """
    if isinstance(table, (str, bytes)) or not isinstance(table, Sequence):
        raise EqshardError(
            f"{what} is a list of (logical name, mesh axes) pairs, such as "
            f"[('batch', ('data', 'fsdp')), ('embed', 'fsdp')], not {table!r}"
        )
    rules = []
    for index, pair in enumerate(table):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise EqshardError(f"{what}[{index}] is a (logical name, mesh axes) pair, not {pair!r}")
        name, axes = pair
        if not isinstance(name, str) or not name:
            raise EqshardError(f"{what}[{index}]'s logical name is text, not {name!r}")
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        elif isinstance(axes, Sequence) and all(isinstance(a, str) and a for a in axes):
            axes = tuple(axes)
        else:
            raise EqshardError(
                f"{what}[{index}] ({name!r}) maps it to {axes!r}; map a logical name to a "
                "mesh axis, a list of them (the major first), or None (whole)"
            )
        rules.append(AxisRule(name, axes, index))
    return tuple(rules)


def place(
    names: Sequence[str | None], rules: Sequence[AxisRule], sizes: Mapping[str, int]
) -> tuple[Placed, ...]:
    """Where `rules` put each dim of an array whose dims are `names` (`None` for a dim
    with no name), on a mesh of axes `sizes` (see the module's notes).

    **Raises:** `EqshardError` where a name is given twice, which says no dim.
    """
    seen: set[str] = set()
    for name in names:
        if name is not None and name in seen:
            raise EqshardError(
                f"the dims {tuple(names)} name {name!r} twice; the rules place a name's "
                "one dim: give each dim its own name"
            )
        if name is not None:
            seen.add(name)
    claimed: list[AxisRule | None] = [None] * len(names)
    used: set[str] = set()
    position = {name: i for i, name in enumerate(names) if name is not None}
    for rule in rules:
        i = position.get(rule.name)
        if i is None or claimed[i] is not None or used.intersection(rule.axes):
            continue
        claimed[i] = rule
        used.update(rule.axes)
    placed = []
    for rule in claimed:
        if rule is None:
            placed.append(Placed())
            continue
        kept = tuple(axis for axis in rule.axes if sizes.get(axis, 1) != 1)
        dropped = tuple(axis for axis in rule.axes if axis not in kept)
        placed.append(Placed(kept, rule, dropped))
    return tuple(placed)
