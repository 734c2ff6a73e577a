"""From a layout to a `jax.sharding.NamedSharding`, cached.

Meshes are built with `AxisType.Auto` axes and filled with the devices in
row-major order, as einshard fills them on CPU and GPU. Given a device count
rather than devices, the same mesh is built abstractly (`abstract_mesh`): a
`jax.sharding.AbstractMesh` of the same axis names and sizes, on which every
layout, `PartitionSpec` and `shard_shape` is the same, and nothing is placed. Auto axes mean that
arrays placed by eqshard work in `jax.jit` with no mesh set, and inside
`jax.set_mesh(mesh)` when that mesh's axes are Auto too. A mesh with Explicit
axes (the default of `jax.make_mesh` since JAX 0.9) is a different mode: see
`eqshard.constrain`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from ._errors import EqshardError, UsageError, whole_number
from ._expression import Expression, parse
from ._fit import fit, mesh_shape_of, misfit
from ._jit_key import JIT_KEY as JIT_KEY  # made before any step is traced: see _jit_key
from ._layout import MAX_DEVICES, device_count_of, layout, shape_of
from ._warnings import deprecated

if TYPE_CHECKING:
    from jaxlib._jax import Device
else:
    Device = jax.Device

__all__ = [
    "MAX_DEVICES",
    "AnyMesh",
    "Devices",
    "Placement",
    "abstract_mesh",
    "as_placement",
    "cached_sharding",
    "context_mesh",
    "device_count",
    "device_tuple",
    "local_devices",
    "mesh",
    "mesh_devices",
    "named_sharding",
    "on_devices",
    "partition_spec",
    "placed_sharding",
    "placement",
    "sharding",
    "simulate_message",
    "user_mesh",
    "with_devices",
]

Placement = Union[tuple[Device, ...], int]
"""What a layout is placed on without a user's mesh: devices in einshard's order
(its device `i` is the `i`-th), or a count of devices, laid out abstractly."""

Devices = Union[int, Sequence[Device], None]
"""What `devices=` takes everywhere: a count (the first that many of this process's
devices), or a list of devices (`None`: all of this process's)."""


def as_placement(devices: Sequence[Device] | np.ndarray | int | None) -> Placement:
    """A `Placement` as eqshard passes one inside (`plan_faults`, a plan's devices, a
    spec file's count): a count (an `int`) as it is, laid out abstractly, else the
    devices (`device_tuple`). Never the user's `devices=`: `placement` reads that.

    **Raises:** `EqshardError` for a count below 1, or what `device_tuple` raises.
    """
    if isinstance(devices, (int, np.integer)):
        return device_count_of(devices if isinstance(devices, bool) else int(devices), "`devices`")
    return device_tuple(devices)


def simulate_message(count: int, here: int) -> str:
    """The deprecation of `devices=count` meaning devices this process does not have."""
    return (
        f"`devices={count}` means {count} of this process's devices, and it has {here}: "
        f"pass `simulate={count}` to lay out (or compile) for {count} devices it does not have"
    )


def placement(
    devices: Devices | np.ndarray = None,
    simulate: int | None = None,
    *,
    what: str,
    was_simulated: bool = False,
) -> Placement | None:
    """The one reading of `devices=` and `simulate=`: `devices` are real devices (a
    count is the first that many of this process's, `local_devices`), `simulate` a
    count of devices this process does not have, laid out abstractly (a count in the
    `Placement`); `None` where neither is given.

    `was_simulated`: `what` read `devices=n` as a count to lay out abstractly before
    `simulate=` (`plan`, `sharding`, `report`, `abstract`): a count more than this
    process has keeps that meaning for one release, with a `DeprecationWarning`.

    **Raises:** `UsageError` for both given; `EqshardError` for a count below 1, more
    than this process has (without `was_simulated`), or what `device_tuple` raises.
    """
    if simulate is not None:
        if devices is not None:
            raise UsageError(
                f"{what} takes `devices=` (this process's devices) or `simulate=` (a count "
                "of devices it does not have, laid out abstractly), not both; pass one"
            )
        return device_count_of(simulate, "`simulate`")
    if devices is None:
        return None
    if isinstance(devices, (int, np.integer)):
        count = device_count_of(devices if isinstance(devices, bool) else int(devices), "`devices`")
        here = len(jax.devices())
        if was_simulated and count > here:
            deprecated(simulate_message(count, here))
            return count
        return tuple(local_devices(count, what) or ())
    return device_tuple(devices)


def local_devices(devices: Devices, what: str) -> Sequence[Device] | None:
    """`devices=` for what places arrays (`apply`, `shard`, `init`, `restore`): a
    count is the first that many of `jax.devices()`, as `eqshard.cost` takes
    it; a list is itself.

    **Raises:** `EqshardError` for a count this process has not as many devices for
    (laying out needs no devices: `simulate=n` does that).
    """
    if not isinstance(devices, (int, np.integer)):
        return devices
    count = whole_number(devices if isinstance(devices, bool) else int(devices), "`devices`")
    here = jax.devices()
    if count > len(here):
        raise EqshardError(
            f"{what} places arrays on `devices={count}`, the first {count} of `jax.devices()`, "
            f"and there are {len(here)}; pass at most {len(here)}, or lay out for devices "
            f"this process does not have with `eqshard.plan(model, spec, simulate={count})`"
        )
    if jax.process_count() > 1 and count != len(here):
        raise EqshardError(
            f"{what} places arrays on `devices={count}`, and this is one of "
            f"{jax.process_count()} processes, which hold {len(here)} devices together: "
            "every process places onto the same devices, so pass them all "
            f"(`devices={len(here)}`), a list of devices, or a `jax.sharding.Mesh`"
        )
    return tuple(here[:count])


def device_count(placed: Placement) -> int:
    """How many devices a `Placement` holds."""
    return placed if isinstance(placed, int) else len(placed)


def device_tuple(devices: Sequence[Device] | np.ndarray | None) -> tuple[Device, ...]:
    """The devices to place on: `jax.devices()` when `devices` is `None`."""
    if devices is None:
        return tuple(jax.devices())
    given: Any = devices
    if isinstance(given, np.ndarray):  # such as `mesh.devices`: row-major order
        given = given.ravel().tolist()
    try:
        devices = tuple(given)
    except TypeError:
        raise EqshardError(
            f"`devices` is a list of JAX devices, such as `jax.devices()[:4]`, or a device "
            f"count, such as 4096, to lay out abstractly; not {type(devices).__name__}"
        ) from None
    wrong = next((d for d in devices if not isinstance(d, jax.Device)), None)
    if wrong is not None:
        raise EqshardError(
            f"`devices` holds {wrong!r}, which is not a JAX device; pass devices such as "
            "`jax.devices()[:4]`"
        )
    if not devices:
        raise EqshardError("`devices` is empty; pass at least one device, or None for all")
    if len(set(devices)) != len(devices):
        seen: set[Device] = set()
        twice = next(d for d in devices if d in seen or seen.add(d))
        raise EqshardError(f"`devices` holds {twice} twice; list each device once")
    return devices


AnyMesh = Union[Mesh, AbstractMesh]


def context_mesh() -> AnyMesh | None:
    """The mesh set by `jax.set_mesh`, if any: the concrete one outside `jit`, the
    abstract one inside it."""
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        return None
    try:
        concrete = jax.sharding.get_mesh()
    except ValueError:  # inside `jit`, only the abstract mesh is known
        return abstract
    return abstract if concrete.empty else concrete


def user_mesh(mesh: object, devices: object) -> AnyMesh | None:
    """The user's mesh: `mesh=` if given, else the mesh of `jax.set_mesh` when no
    `devices=` are given either; `None` where eqshard chooses the mesh itself.

    **Raises:** `EqshardError` when both `mesh=` and `devices=` are given, or
    `mesh=` is not a mesh.
    """
    if mesh is None:
        return context_mesh() if devices is None else None
    if devices is not None:
        raise EqshardError(
            "`mesh=` and `devices=` (or `simulate=`) are both given; pass one: a mesh holds "
            "its devices"
        )
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise EqshardError(
            f"`mesh=` is a `jax.sharding.Mesh`, such as `jax.make_mesh((2, 4), ('data', "
            f"'model'))`, not {type(mesh).__name__}; for a list of devices use `devices=`"
        )
    if mesh.empty:
        raise EqshardError("`mesh=` is an empty mesh; give a mesh with devices")
    return mesh


def on_devices(mesh: AnyMesh | None, what: str, placed: object = None) -> None:
    """Checks that `what` (such as "`eqshard.apply`"), which places or compiles
    arrays, has devices to do it on: its mesh is not a `jax.sharding.AbstractMesh`,
    and `placed` (the plan's `devices`, or `devices=` as given) is not a count,
    which lays out abstractly.

    **Raises:** `EqshardError` saying how to make a concrete mesh.
    """
    if isinstance(placed, int):
        on = (
            f"a `jax.sharding.AbstractMesh` {dict(zip(mesh.axis_names, mesh.axis_sizes))}, "
            "which has no devices"
            if mesh is not None
            else "abstract meshes, which have no devices"
        )
        raise EqshardError(
            f"{what} needs a mesh with devices, and its layouts were made for "
            f"`simulate={placed}` devices, on {on}; pass this process's devices, such as "
            f"`devices={placed}` or `devices=jax.devices()[:{placed}]`, or a concrete "
            "`jax.sharding.Mesh`. `simulate=` serves `eqshard.plan`, `eqshard.report`, "
            "`eqshard.abstract`, `eqshard.expression.sharding`, and `eqshard.constrain` inside `jit`"
        )
    if isinstance(mesh, AbstractMesh):
        raise EqshardError(
            f"{what} needs a mesh with devices, and its mesh is a "
            f"`jax.sharding.AbstractMesh` {dict(zip(mesh.axis_names, mesh.axis_sizes))}, "
            "which has none (given as `mesh=`, set by `jax.sharding.use_abstract_mesh`, or "
            "held by the `Plan`); pass a concrete `jax.sharding.Mesh`, such as "
            "`jax.make_mesh((2, 4), ('data', 'model'))` or `jax.sharding.Mesh("
            "np.array(jax.devices()).reshape(2, 4), ('data', 'model'))`. An AbstractMesh "
            "serves `eqshard.plan`, `eqshard.abstract`, `eqshard.expression.sharding`, and "
            "`eqshard.constrain` inside `jit`"
        )


def mesh_devices(mesh: AnyMesh) -> tuple[Device, ...] | None:
    """A concrete mesh's devices in einshard's order (`mesh.devices.flat`)."""
    return tuple(mesh.devices.flat) if isinstance(mesh, Mesh) else None


@functools.lru_cache(maxsize=1024)
def partition_spec(spec: Sequence[Any]) -> PartitionSpec:
    """A layout's `PartitionSpec`, with a full copy written `P()` however many dims
    the leaf has: so a replicated sharding compares equal to `Plan.replicated()`'s
    and to what `constrain` gives, whichever made it."""
    if all(axis is None for axis in spec):
        return PartitionSpec()
    return PartitionSpec(*spec)


def abstract_mesh(mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]) -> AbstractMesh:
    """An `AbstractMesh` of Auto axes: the one place one is built. JAX 0.8.1 to
    0.11 take `AbstractMesh(axis_sizes, axis_names, axis_types)` alike, but the
    axis types' default changes (Auto, then Explicit after 0.11), so they are
    always given."""
    return AbstractMesh(
        tuple(mesh_shape), tuple(axis_names), axis_types=(AxisType.Auto,) * len(axis_names)
    )


@functools.lru_cache(maxsize=1024)
def mesh(mesh_shape: tuple[int, ...], axis_names: tuple[str, ...], devices: Placement) -> AnyMesh:
    """A mesh of Auto axes, filled with `devices` in row-major order; for a device
    count, the `AbstractMesh` of the same axes. Cached."""
    if isinstance(devices, int):
        return abstract_mesh(mesh_shape, axis_names)
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(
        grid.reshape(mesh_shape),
        axis_names,
        axis_types=(AxisType.Auto,) * len(axis_names),
    )


def with_devices(abstract: AnyMesh, devices: Sequence[Device]) -> Mesh:
    """The concrete mesh of `abstract`'s axes (sizes, names and types), filled with
    `devices` in row-major order, as `mesh` fills one."""
    grid = np.empty(len(devices), dtype=object)
    grid[:] = list(devices)
    return Mesh(
        grid.reshape(tuple(abstract.axis_sizes)),
        tuple(abstract.axis_names),
        axis_types=tuple(abstract.axis_types),
    )


def named_sharding(
    mesh_shape: tuple[int, ...],
    mesh_axes: tuple[str, ...],
    spec: Sequence[str | tuple[str, ...] | None],
    devices: Placement,
) -> NamedSharding:
    """The `NamedSharding` of `spec` on the cached row-major mesh of `devices` (an
    abstract mesh for a device count)."""
    return NamedSharding(mesh(mesh_shape, mesh_axes, devices), partition_spec(spec))


@functools.lru_cache(maxsize=8192)
def cached_sharding(
    expr: str | Expression, shape: tuple[int, ...], devices: Placement
) -> NamedSharding:
    lay = layout(parse(expr), shape, device_count(devices))
    return named_sharding(lay.mesh_shape, lay.mesh_axes, lay.spec, devices)


@functools.lru_cache(maxsize=8192)
def sharding_on(expr: str | Expression, shape: tuple[int, ...], on: AnyMesh) -> NamedSharding:
    """The `NamedSharding` of `expr` written on the user's mesh `on`. Cached.

    **Raises:** `ExpressionError` when the layout does not fit the mesh.
    """
    parsed = parse(expr)
    lay = layout(parsed, shape, on.size)
    axes = mesh_shape_of(on.axis_names, on.axis_sizes)
    spec = fit(lay, axes)
    if spec is None:
        first, last = parsed.span_of_rhs(0), parsed.span_of_rhs(len(parsed.rhs) - 1)
        raise parsed.error(misfit(parsed, shape, axes), (first[0], last[1]))
    return NamedSharding(on, partition_spec(spec))


def sharding(
    expr: str | Expression,
    shape: Sequence[int],
    *,
    mesh: AnyMesh | None = None,
    devices: Devices | np.ndarray = None,
    simulate: int | None = None,
) -> NamedSharding:
    """The `NamedSharding` that an einshard expression gives an array of `shape`.

    **Example:**

    ```python
    s = eqshard.expression.sharding("a b -> 2 a2* b*", (4, 8), simulate=16)   # no devices needed
    s.mesh.shape      # {'_0': 2, 'a': 4, 'b': 2}
    s.spec            # PartitionSpec('a', 'b')

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    eqshard.expression.sharding("a b -> a2 b4", (4, 8), mesh=mesh).spec   # P('data', 'model')
    ```

    **Arguments:**

    - `expr`: an einshard expression, as text or as an `eqshard.expression.Expression`.
    - `shape`: the array's shape.
    - `mesh`: the mesh to write the layout on; by default the mesh of `jax.set_mesh`.
    - `devices`: else, this process's devices to use: a list, or a count (the first
        that many); by default all of `jax.devices()`.
    - `simulate`: else, a count of devices this process need not have: the sharding is
        then on a `jax.sharding.AbstractMesh` of the same axes.

    **Returns:**

    A `jax.sharding.NamedSharding`, on the user's mesh (with its axis names) or on a mesh
    of Auto axes named after the right side's elements. Cached.

    **Raises:**

    - `eqshard.ExpressionError`: the expression is malformed, a short form, of the wrong
        rank, not for the devices given, uneven, or does not fit the mesh.
    - `eqshard.UsageError`: both `devices` and `simulate` are given.

    See the guide "The expression language" for the mesh a sharding is on.
    """
    if not isinstance(expr, (str, Expression)):
        parse(expr)  # raises the EqshardError that says what an expression is
    placed = placement(devices, simulate, what="`eqshard.expression.sharding`", was_simulated=True)
    return placed_sharding(expr, shape, mesh, placed)


def placed_sharding(
    expr: str | Expression, shape: Sequence[int], mesh: AnyMesh | None, placed: Placement | None
) -> NamedSharding:
    """`sharding` once `devices=` and `simulate=` are read (`placement`): on the
    user's mesh, else on `placed` (all of `jax.devices()` for `None`)."""
    on = user_mesh(mesh, placed)
    if on is not None:
        return sharding_on(expr, shape_of(shape), on)
    return cached_sharding(expr, shape_of(shape), placed or device_tuple(None))
