"""`apply`: place every array leaf of a model, in one batched `jax.device_put`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding
from jaxtyping import PyTree

from ._errors import Problem, SpecError
from ._fields import FROM_FIELDS
from ._plan import Unspecified, plan
from ._sharding import Device

__all__ = ["apply"]


def _unplaceable(x: Any) -> str | None:
    """Why `x` cannot be placed with its values intact, or `None`."""
    if isinstance(x, jax.core.Tracer):
        return (
            "is traced: `eqshard.apply` places concrete arrays outside `jit`; inside, "
            "use `eqshard.constrain(model, spec)`"
        )
    if isinstance(x, jax.ShapeDtypeStruct):
        return (
            "is abstract (a jax.ShapeDtypeStruct): `eqshard.apply` places concrete arrays; "
            "for an abstract model use `eqshard.plan(model, spec).shardings`, e.g. as "
            "`out_shardings` of the jitted function that builds the model"
        )
    if isinstance(x, np.ndarray) and jax.dtypes.canonicalize_dtype(x.dtype) != x.dtype:
        return (
            f"is a NumPy {x.dtype} array, and JAX runs with 32-bit types, so placing it "
            f"would change its values; cast it (`x.astype(np.{x.dtype.name[:-2]}32)`) "
            "or enable `jax_enable_x64`"
        )
    return None


def _refusal(source: Any, target: jax.sharding.Sharding) -> str | None:
    try:
        jax.device_put(source, target)
    except (TypeError, ValueError, RuntimeError) as error:
        return str(error).split("\n")[0]
    return None


def _source(x: Any, target: jax.sharding.Sharding) -> Any:
    """What to hand `jax.device_put` to place `x` at `target`.

    Weakly typed arrays and arrays of extended dtypes (PRNG keys) go as they are.

    An array that lives on one CPU device is handed over as a NumPy view of its
    buffer (no copy is made): JAX then places it through its host path, which
    splits it into shards in one pass, where the device-to-device path runs one
    slicing computation per shard and is several times slower on CPU. PjRt keeps
    the source buffer alive, and safe from donation, for as long as the view is
    used. Everything else (accelerator arrays, arrays already spread over devices,
    arrays already in place) goes to `device_put` as it is.
    """
    if not isinstance(x, jax.Array) or jnp.issubdtype(x.dtype, jax.dtypes.extended) or x.weak_type:
        return x  # NumPy has no weak types, and no PRNG key dtype
    source = x.sharding
    if not isinstance(source, SingleDeviceSharding) or source == target:
        return x
    if next(iter(source.device_set)).platform != "cpu" or x.is_deleted():
        return x
    return np.asarray(x)


def apply(
    model: PyTree[Any],
    spec: Any = FROM_FIELDS,
    *,
    devices: Sequence[Device] | None = None,
    unspecified: Unspecified = "replicate",
) -> PyTree[Any]:
    """Places every array leaf of a model as its spec says, in one pass.

    After this, the user's `eqx.filter_jit` step runs sharded, and the model code
    does not change.

    **Example:**

    ```python
    model = eqshard.apply(model)                        # from eqshard.field annotations
    model = eqshard.apply(model, spec)                  # a spec tree, e.g. from eqx.tree_at
    model = eqshard.apply(model, "... -> * ...")        # replicate everything
    model = eqshard.apply(model, eqshard.load("model.eqshard.json"))
    ```

    **Arguments:**

    - `model`: an Equinox model or any pytree of arrays and other leaves.
    - `spec`: as for `eqshard.plan`: by default the model's `eqshard.field`s; else a
        spec tree, a prefix of one, a single expression, or a resolver such as
        `eqshard.Rules`.
    - `devices`: the devices to use, all of them; `jax.devices()` by default.
    - `unspecified`: what an array leaf with no expression gets: `"replicate"` (a
        full copy on every device, the default) or `"keep"` (left where it is).

    **Returns:**

    A new model of the same structure. Its array leaves are new arrays with exactly
    the input's values, in their shardings; an array already in its sharding is
    reused, not copied. Other leaves (functions, Python numbers, static fields) pass
    through untouched. The input model is not modified.

    **Raises:**

    `eqshard.SpecError` listing every leaf whose expression does not fit (one line
    each: key path, shape, expression, the rule it breaks), or naming the first
    path where the spec's structure differs from the model's.
    """
    p = plan(model, spec, devices=devices, unspecified=unspecified)
    leaves = list(p.resolved.leaves)
    indices = [i for i, s in enumerate(p.flat_shardings) if s is not None]
    problems = [
        Problem(p.resolved.where(i), why)
        for i in indices
        if (why := _unplaceable(leaves[i])) is not None
    ]
    if problems:
        raise SpecError(problems, "`eqshard.apply` cannot place these leaves")
    targets = [s for s in p.flat_shardings if s is not None]
    sources = [_source(leaves[i], target) for i, target in zip(indices, targets)]
    try:
        placed = jax.device_put(sources, targets)
    except (TypeError, ValueError, RuntimeError):
        # Find which leaves JAX refused, one by one, and name them.
        raise SpecError(
            [
                Problem(p.resolved.where(i), f"JAX cannot place it: {error}")
                for i, source, target in zip(indices, sources, targets)
                if (error := _refusal(source, target)) is not None
            ]
            or [Problem("the model", "JAX refused to place it")],
            "`eqshard.apply` cannot place these leaves",
        ) from None
    for i, array in zip(indices, placed):
        leaves[i] = array
    return jax.tree_util.tree_unflatten(p.resolved.treedef, leaves)
