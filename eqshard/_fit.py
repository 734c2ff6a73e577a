"""Fitting layouts onto a mesh: the user's, or one shared row-major mesh.

A layout (see `_layout.py`) puts devices in row-major order on its own mesh. Each
of its sharded axes covers a range of that order: the axis of size `s` whose
major neighbours multiply to `before` splits the devices at strides `before` to
`before * s`. A mesh of axes `(m0, m1, ...)` splits the same order at the
products `m0`, `m0*m1`, ... A layout **fits** a mesh when every sharded axis
starts and ends on such a split: then that axis is the mesh axes between them,
and writing the layout's spec with those axes gives every device exactly its
einshard blocks. Replication elements impose nothing, and nothing here looks at
devices, so fitting works on an abstract mesh inside `jit` and on a mesh whose
devices are in topology order: einshard's device `i` is `mesh.devices.flat[i]`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Iterable, Sequence

from ._expression import Element, Expression
from ._layout import Layout, axes_of, layout

__all__ = [
    "MeshShape",
    "cut_points",
    "declared_sizes",
    "fit",
    "grouping",
    "groupings",
    "mesh_shape_of",
    "mesh_text",
    "misfit",
    "reordered",
    "shared_mesh",
]


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The axes of a mesh, major first: what fitting needs to know of it."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def __str__(self) -> str:
        return "(" + ", ".join(f"{n!r}: {s}" for n, s in zip(self.names, self.sizes)) + ")"


def _ranges(lay: Layout) -> dict[str, tuple[int, int]]:
    """Each sharded axis of `lay` (used by a dim, of size > 1), as its range of strides."""
    used = {axis for entry in lay.spec for axis in axes_of(entry)}
    ranges, before = {}, 1
    for axis, size in zip(lay.mesh_axes, lay.mesh_shape):
        if axis in used and size > 1:
            ranges[axis] = (before, before * size)
        before *= size
    return ranges


def cut_points(lay: Layout) -> frozenset[int]:
    """Where `lay` splits the row-major device order: its sharded axes' ends."""
    return frozenset(point for span in _ranges(lay).values() for point in span)


def fit(lay: Layout, mesh: MeshShape) -> tuple[str | tuple[str, ...] | None, ...] | None:
    """`lay`'s spec on `mesh` (each array dim's mesh axes, major first), or `None`
    when it does not fit. `mesh` must have as many devices as `lay`."""
    ends = list(itertools.accumulate(mesh.sizes, operator.mul))
    starts = [1, *ends[:-1]]
    splits = {1, *ends}
    on_mesh: dict[str, tuple[str, ...]] = {}
    for axis, (lo, hi) in _ranges(lay).items():
        if lo not in splits or hi not in splits:
            return None
        on_mesh[axis] = tuple(
            name for name, start, end in zip(mesh.names, starts, ends) if lo <= start < end <= hi
        )
    spec: list[str | tuple[str, ...] | None] = []
    for entry in lay.spec:  # a group's axes in its order, each as the mesh axes it covers
        names = tuple(name for axis in axes_of(entry) for name in on_mesh.get(axis, ()))
        spec.append(None if not names else names[0] if len(names) == 1 else names)
    return tuple(spec)


def _chain(points: Iterable[int], n_devices: int) -> tuple[int, ...] | None:
    """The axis sizes of the mesh that splits at exactly `points`, if they divide."""
    sizes, previous = [], 1
    for point in sorted({*points, n_devices} - {1}):
        if point % previous:
            return None
        sizes.append(point // previous)
        previous = point
    return tuple(sizes) or (1,)


def shared_mesh(layouts: Iterable[Layout], n_devices: int) -> MeshShape | None:
    """The coarsest mesh, axes `m0`, `m1`, ..., that every layout fits, or `None`.

    It splits the devices where any layout's sharded axes do; it exists when those
    points form a chain in which each divides the next (always, on a power-of-two
    device count).

    **Example:** layouts split at `{2}` (`"a b -> a2 b4"`) and at `{8}`
    (`"a -> a8"`) share the mesh `(2, 4)`; `(2, 6)` and `(3, 4)` splits on 12
    devices share none (2 does not divide 3).
    """
    points: set[int] = set()
    for lay in layouts:
        points |= cut_points(lay)
    sizes = _chain(points, n_devices)
    if sizes is None:
        return None
    return MeshShape(tuple(f"m{i}" for i in range(len(sizes))), sizes)


def grouping(lay: Layout, n_devices: int) -> tuple[int, ...]:
    """How `lay` groups the row-major devices: the mesh shape it splits them into."""
    return _chain(cut_points(lay), n_devices) or (n_devices,)


def groupings(layouts: Iterable[Layout], n_devices: int) -> list[tuple[int, ...]]:
    """The device groupings of `layouts` that no other one refines, as mesh shapes:
    more than one means the layouts disagree on how devices are grouped."""
    sets = {cut_points(lay) | {n_devices} for lay in layouts}
    maximal = [s for s in sets if not any(s < other for other in sets)]
    return sorted(_chain(s, n_devices) or (n_devices,) for s in maximal)


def reordered(expr: Expression, shape: tuple[int, ...], mesh: MeshShape) -> Expression | None:
    """`expr` with its right side's elements reordered so that it fits `mesh`, or
    `None` when no order does. The original order is tried first."""
    elements = [item for item in expr.rhs if isinstance(item, Element)]
    if len(elements) > 8:  # 8! orders at most; more is never a useful suggestion
        return None
    slots = [i for i, item in enumerate(expr.rhs) if isinstance(item, Element)]
    for order in itertools.permutations(elements):
        rhs = list(expr.rhs)
        for slot, element in zip(slots, order):
            rhs[slot] = element
        candidate = Expression(expr.lhs, tuple(rhs))
        if fit(layout(candidate, shape, mesh.size), mesh) is not None:
            return candidate
    return None


def declared_sizes(axes: Sequence[tuple[str, int | None]], devices: int) -> tuple[int, ...] | None:
    """The sizes of a declared mesh's axes on `devices` devices (an axis of size `None`,
    a spec file's `"*"`, takes what the others leave), or `None` where they do not
    multiply to it."""
    fixed = math.prod(size for _, size in axes if size is not None)
    star = any(size is None for _, size in axes)
    if (devices % fixed) if star else (devices != fixed):
        return None
    return tuple(devices // fixed if size is None else size for _, size in axes)


def mesh_shape_of(names: Sequence[str], sizes: Sequence[int]) -> MeshShape:
    """A `MeshShape` from a mesh's axis names and sizes."""
    return MeshShape(tuple(names), tuple(int(s) for s in sizes))


def mesh_text(axes: Iterable[tuple[str, int]]) -> str:
    """A mesh's axes as tables show them: `data=4 x model=2` (`-` for none)."""
    return " x ".join(f"{name}={size}" for name, size in axes) or "-"


def _cuts(points: Iterable[int], n_devices: int) -> str:
    """`2 blocks of 4 and 4 blocks of 2`: how split points cut the device order."""
    parts = [f"{p} blocks of {n_devices // p}" for p in sorted(set(points) - {1, n_devices})]
    return " and ".join(parts) or "one block"


def misfit(expr: Expression, shape: tuple[int, ...], mesh: MeshShape) -> str:
    """Why `expr` on an array of `shape` does not fit `mesh`, and how to fix it."""
    lay = layout(expr, shape, mesh.size)
    mesh_points = itertools.accumulate(mesh.sizes, operator.mul)
    better = reordered(expr, shape, mesh)
    fix = (
        f"write {str(better)!r}, the same counts in the mesh's order"
        if better is not None
        else "no order of these counts fits it; split each dim over neighbouring mesh axes"
    )
    return (
        f"does not fit the mesh {mesh}: it cuts the device order into "
        f"{_cuts(cut_points(lay), mesh.size)}, where the mesh's axes cut it into "
        f"{_cuts(mesh_points, mesh.size)}; {fix}"
    )
