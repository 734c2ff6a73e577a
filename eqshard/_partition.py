"""JAX's own layouts as spec leaves: a `PartitionSpec` on the plan's mesh, or a
`NamedSharding` with its mesh, written as the einshard expression that lays the leaf
out the same way, device by device.

The expression's right side is the mesh's axes in the mesh's order. A dim split over
one mesh axis is named after it, a dim split over several is a group of them in the
`PartitionSpec`'s order (the major first), and an axis no dim uses is a replication
count (consecutive ones merged, size-1 ones left out). So `P(("fsdp", "data"),
"tensor")` on the mesh `(data=2, tensor=2, fsdp=2)` is `"(fsdp data) tensor -> data2
tensor2 fsdp2"`, and `P("data")` for a matrix on `(data=4, model=2)` is
`"data a -> data4 2 a"`. Fitted back onto the mesh, it is that `PartitionSpec` again.
A mesh axis's name that is not letters and `_` is quoted (`'x0'`); where one cannot
name a dim at all (it holds a quote or white space), every dim gets a letter.
"""

from __future__ import annotations

import itertools
import math
import string
from collections.abc import Sequence
from typing import Any, TypeGuard

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ._errors import EqshardError
from ._expression import Expression, name_text, parse

__all__ = [
    "device_count",
    "expression_of",
    "is_jax_layout",
    "same_mesh",
    "sharding_mesh",
    "text_of",
]


def is_jax_layout(x: object) -> TypeGuard[PartitionSpec | NamedSharding]:
    """Whether `x` is one of JAX's own layouts a spec leaf may be: a
    `PartitionSpec` or a `NamedSharding`."""
    return isinstance(x, (PartitionSpec, NamedSharding))


def text_of(x: PartitionSpec | NamedSharding) -> str:
    """`x` as messages show it: `P('data', None)`, `NamedSharding(P('data'), mesh
    data=4 x model=2)`; the same on every JAX."""
    spec = x.spec if isinstance(x, NamedSharding) else x
    entries = ", ".join(repr(entry) for entry in spec)
    if isinstance(x, NamedSharding):
        axes = " x ".join(f"{n}={s}" for n, s in zip(x.mesh.axis_names, x.mesh.axis_sizes))
        return f"NamedSharding(P({entries}) on {axes})"
    return f"P({entries})"


def _writable(axis: object) -> bool:
    """Whether a mesh axis's name can name a dim in an expression (quoted where it is
    not letters and `_`): the parser says, as it takes no quote or white space in a
    name, nor `_0`, `_1`, ..."""
    if not isinstance(axis, str):
        return False
    try:
        parse(f"{name_text(axis)} -> {name_text(axis)}")
    except EqshardError:
        return False
    return True


def _fresh(taken: set[str]) -> str:
    """The first of `a`, `b`, ..., `z`, `aa`, `ab`, ... that is not taken, taken now."""
    for length in itertools.count(1):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            name = "".join(letters)
            if name not in taken:
                taken.add(name)
                return name
    raise EqshardError("not reached: the names never run out")  # pragma: no cover


def expression_of(
    spec: PartitionSpec, names: Sequence[str], sizes: Sequence[int], shape: Sequence[int]
) -> Expression:
    """The einshard expression that lays an array of `shape` out as `spec` does on a
    mesh of axes `names` of `sizes` (see the module's notes).

    **Raises:** `EqshardError` where `spec` has more entries than the array has dims,
    names a mesh axis the mesh lacks or one twice, splits a dim into blocks that do not
    divide it, or is `PartitionSpec.UNCONSTRAINED` (which leaves the layout to the
    compiler, and so says none).
    """
    shown = text_of(spec)
    ndim = len(shape)
    entries = list(spec)
    if len(entries) > ndim:
        raise EqshardError(
            f"{shown} has {len(entries)} entries, and the leaf has {ndim} "
            f"{'dim' if ndim == 1 else 'dims'}; write one entry per dim at most"
        )
    entries += [None] * (ndim - len(entries))
    size_of = dict(zip(names, sizes))
    groups: list[tuple[str, ...]] = []
    used: dict[str, int] = {}
    for dim, entry in enumerate(entries):
        if entry is PartitionSpec.UNCONSTRAINED:
            raise EqshardError(
                f"{shown} leaves dim {dim} UNCONSTRAINED: the compiler chooses its layout, "
                "so it has none to place; name its mesh axes, or None to keep it whole"
            )
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for axis in axes:
            if axis not in size_of:
                raise EqshardError(
                    f"{shown} splits dim {dim} over the mesh axis {axis!r}, and the mesh has "
                    f"the axes {', '.join(map(repr, names))}; name one of them"
                )
            if axis in used:
                raise EqshardError(
                    f"{shown} splits dims {used[axis]} and {dim} over the mesh axis {axis!r}; "
                    "a mesh axis splits one dim of an array"
                )
            used[axis] = dim
        blocks = math.prod(int(size_of[axis]) for axis in axes)
        if shape[dim] % blocks:
            over = " x ".join(f"{axis}={size_of[axis]}" for axis in axes)
            raise EqshardError(
                f"{shown} splits dim {dim} (size {shape[dim]} of shape {tuple(shape)}) over "
                f"{over}: {blocks} blocks, which do not divide it; split it over axes whose "
                f"sizes multiply to a divisor of {shape[dim]}"
            )
        groups.append(axes)
    named = all(_writable(axis) for axis in used)
    taken: set[str] = set(names) if named else set()
    label = {axis: name_text(axis) if named else _fresh(taken) for axis in names if axis in used}
    lhs: list[str] = []
    whole: list[str] = []
    for axes in groups:
        if not axes:
            name = _fresh(taken)
            lhs.append(name)
            whole.append(name)
        elif len(axes) == 1:
            lhs.append(label[axes[0]])
        else:
            lhs.append(f"({' '.join(label[axis] for axis in axes)})")
    rhs: list[str] = []
    copies = 1
    for axis, size in zip(names, sizes):
        if axis in used:
            if copies > 1:
                rhs.append(str(copies))
                copies = 1
            rhs.append(f"{label[axis]}{size if size > 1 else ''}")
        else:
            copies *= int(size)
    if copies > 1:
        rhs.append(str(copies))
    rhs += whole
    left = " ".join(lhs) if lhs else "..."
    right = " ".join([*rhs, "..."] if not lhs else rhs) if rhs or not lhs else "..."
    return parse(f"{left} -> {right}")


def sharding_mesh(leaves: Sequence[Any], devices: object) -> Any:
    """The mesh of the `NamedSharding`s among a spec tree's `leaves`, which the plan
    is then made on, as they hold their devices; `None` where they hold none.

    **Raises:** `EqshardError` where they are on several meshes, or `devices=` is
    given too.
    """
    meshes: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, NamedSharding) and not any(leaf.mesh == m for m in meshes):
            meshes.append(leaf.mesh)
    if not meshes:
        return None
    if len(meshes) > 1:
        shown = "; ".join(
            " x ".join(f"{n}={s}" for n, s in zip(m.axis_names, m.axis_sizes)) for m in meshes
        )
        raise EqshardError(
            f"the spec's NamedShardings are on {len(meshes)} meshes ({shown}); a plan "
            "places every leaf on one mesh: give them one, or pass `mesh=`"
        )
    if devices is not None:
        raise EqshardError(
            "`devices=` is given, and the spec's NamedShardings hold their own devices; "
            "pass one or the other"
        )
    return meshes[0]


def same_mesh(a: Any, b: Any) -> bool:
    """Whether meshes `a` and `b` have the same axes and sizes, and the same devices
    in the same order where both hold devices."""
    if tuple(a.axis_names) != tuple(b.axis_names) or tuple(a.axis_sizes) != tuple(b.axis_sizes):
        return False
    concrete = [isinstance(m, jax.sharding.Mesh) for m in (a, b)]
    if all(concrete):
        return [d.id for d in a.devices.flat] == [d.id for d in b.devices.flat]
    return True


def device_count(mesh: Any) -> int:
    return math.prod(int(s) for s in mesh.axis_sizes)
