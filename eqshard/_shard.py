"""Placing one array: `shard` outside `jit`, `constrain` inside it."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.core
from jaxtyping import Array, ArrayLike

from ._errors import EqshardError
from ._expression import Expression
from ._sharding import Device, sharding

__all__ = ["constrain", "shard"]


def shard(
    x: ArrayLike,
    expr: str | Expression,
    *,
    devices: Sequence[Device] | None = None,
) -> Array:
    """Places one array as an einshard expression says.

    The same layout as `einshard.einshard(x, expr)`, placed with one
    `jax.device_put` rather than a host callback per shard.

    **Example:**

    ```python
    w1 = eqshard.shard(w1, "x y -> x y*")   # columns split over all devices
    ```

    **Arguments:**

    - `x`: a `jax.Array` or a NumPy array. It is not modified.
    - `expr`: an einshard expression (text or `eqshard.Expression`).
    - `devices`: the devices to use, all of them; `jax.devices()` by default.

    **Returns:**

    A new `jax.Array` with the values of `x`, placed by the expression. An array
    already in that sharding is returned as it is, without a copy.

    **Raises:**

    `eqshard.ExpressionError` when the expression is malformed or does not fit the
    array's shape or the devices, and `eqshard.EqshardError` when called on a
    traced value inside `jit` (use `eqshard.constrain` there).
    """
    if isinstance(x, jax.core.Tracer):
        raise EqshardError(
            "`eqshard.shard` was called on a traced value inside `jit`; use "
            "`eqshard.constrain(x, expr)` there, which adds a sharding constraint"
        )
    shape = getattr(x, "shape", None)
    if shape is None:
        raise EqshardError(
            f"`eqshard.shard` takes an array, not {type(x).__name__}; wrap it with "
            "`jnp.asarray` first"
        )
    return jax.device_put(x, sharding(expr, shape, devices=devices))


def _check_context_mesh() -> None:
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        return
    kinds = {str(kind).rsplit(".", 1)[-1] for kind in context.axis_types}
    if kinds - {"Auto"}:
        raise EqshardError(
            f"`eqshard.constrain` places values on its own mesh of Auto axes, but the "
            f"mesh set by `jax.set_mesh` has {'/'.join(sorted(kinds))} axes "
            f"({context}). Under Explicit axes use `jax.sharding.reshard` with that "
            "mesh; inside `shard_map` the values are already per-device. Or set a mesh "
            "with `axis_types=(jax.sharding.AxisType.Auto,) * n`"
        )


def constrain(
    x: Array,
    expr: str | Expression,
    *,
    devices: Sequence[Device] | None = None,
) -> Array:
    """Constrains an intermediate value, such as an activation, to an expression's layout.

    Inside `jax.jit` or `eqx.filter_jit` this is
    `jax.lax.with_sharding_constraint` with the expression's sharding: the
    compiler keeps the value in that layout at this point. Outside `jit` it places
    the value, as `eqshard.shard` does.

    **Example:**

    ```python
    @eqx.filter_jit
    def forward(model, x):
        x = eqshard.constrain(x, "batch d -> batch* d")
        return jax.vmap(model)(x)
    ```

    **Arguments:**

    - `x`: the value, traced or concrete.
    - `expr`: an einshard expression (text or `eqshard.Expression`).
    - `devices`: the devices to use, all of them; `jax.devices()` by default. They
        must be the devices the rest of the computation runs on.

    **Returns:**

    `x`, constrained to the layout.

    **Raises:**

    `eqshard.ExpressionError` when the expression does not fit `x`, and
    `eqshard.EqshardError` inside `jax.set_mesh` with Explicit or Manual axes, where
    JAX itself decides layouts and a constraint on another mesh cannot apply.
    """
    _check_context_mesh()
    return jax.lax.with_sharding_constraint(x, sharding(expr, x.shape, devices=devices))
