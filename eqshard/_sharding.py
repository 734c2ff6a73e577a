"""From a layout to a `jax.sharding.NamedSharding`, cached.

Meshes are built with `AxisType.Auto` axes and filled with the devices in
row-major order, as einshard fills them on CPU and GPU. Auto axes mean that
arrays placed by eqshard work in `jax.jit` with no mesh set, and inside
`jax.set_mesh(mesh)` when that mesh's axes are Auto too. A mesh with Explicit
axes (the default of `jax.make_mesh` since JAX 0.10) is a different mode: see
`eqshard.constrain`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._errors import EqshardError
from ._expression import Expression, parse
from ._layout import layout, shape_of

if TYPE_CHECKING:
    from jaxlib._jax import Device
else:
    Device = jax.Device

__all__ = ["cached_sharding", "device_tuple", "mesh", "named_sharding", "sharding"]


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
            f"`devices` is a list of JAX devices, such as `jax.devices()[:4]`, not "
            f"{type(devices).__name__}"
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


@functools.lru_cache(maxsize=1024)
def mesh(
    mesh_shape: tuple[int, ...], axis_names: tuple[str, ...], devices: tuple[Device, ...]
) -> Mesh:
    """A mesh of Auto axes, filled with `devices` in row-major order. Cached."""
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(
        grid.reshape(mesh_shape),
        axis_names,
        axis_types=(AxisType.Auto,) * len(axis_names),
    )


def named_sharding(
    mesh_shape: tuple[int, ...],
    mesh_axes: tuple[str, ...],
    spec: Sequence[str | tuple[str, ...] | None],
    devices: tuple[Device, ...],
) -> NamedSharding:
    """The `NamedSharding` of `spec` on the cached row-major mesh of `devices`."""
    return NamedSharding(mesh(mesh_shape, mesh_axes, devices), PartitionSpec(*spec))


@functools.lru_cache(maxsize=8192)
def cached_sharding(
    expr: str | Expression, shape: tuple[int, ...], devices: tuple[Device, ...]
) -> NamedSharding:
    lay = layout(parse(expr), shape, len(devices))
    return named_sharding(lay.mesh_shape, lay.mesh_axes, lay.spec, devices)


def sharding(
    expr: str | Expression,
    shape: Sequence[int],
    *,
    devices: Sequence[Device] | np.ndarray | None = None,
) -> NamedSharding:
    """The `NamedSharding` that an einshard expression gives an array of `shape`.

    **Example:**

    ```python
    s = eqshard.sharding("a b -> 2 a2* b*", (4, 8))   # on 16 devices
    s.mesh.shape      # {'_0': 2, 'a': 4, 'b': 2}
    s.spec            # PartitionSpec('a', 'b')
    ```

    **Arguments:**

    - `expr`: an einshard expression, as text or as an `eqshard.Expression`.
    - `shape`: the array's shape.
    - `devices`: the devices to use, all of them; `jax.devices()` by default. Pass a
        list to place on a subset. Their order is the row-major order of the mesh.

    **Returns:**

    A `jax.sharding.NamedSharding` on a mesh with Auto axes, one per element of the
    right side (`...` adds none), named after the element (`_<i>` for standalone
    replication elements). Devices hold the same blocks as under einshard.
    The result is cached per (expression, shape, devices), so a repeated call costs
    a dictionary look-up.

    **Raises:**

    `eqshard.ExpressionError` with a caret under the fault when the expression is
    malformed, is in short form, does not match the rank of `shape`, does not use
    exactly the devices given, or splits a dimension unevenly.
    """
    if not isinstance(expr, (str, Expression)):
        parse(expr)  # raises the EqshardError that says what an expression is
    return cached_sharding(expr, shape_of(shape), device_tuple(devices))
