"""`apply`: place every array leaf of a model, in one batched `jax.device_put`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding
from jaxtyping import PyTree

from ._errors import Problem, SpecError
from ._plan import Unspecified, plan
from ._sharding import Device
from ._spec import FROM_FIELDS

__all__ = ["apply"]


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
    abstract = [i for i in indices if isinstance(leaves[i], jax.ShapeDtypeStruct)]
    if abstract:
        raise SpecError(
            [
                Problem(p.resolved.where(i), "is abstract (a jax.ShapeDtypeStruct)")
                for i in abstract
            ],
            "`eqshard.apply` places concrete arrays; for an abstract model use "
            "`eqshard.plan(model, spec).shardings`, e.g. as `out_shardings` of the "
            "jitted function that builds the model",
        )
    targets = [s for s in p.flat_shardings if s is not None]
    sources = [_source(leaves[i], target) for i, target in zip(indices, targets)]
    placed = jax.device_put(sources, targets)
    for i, array in zip(indices, placed):
        leaves[i] = array
    return jax.tree_util.tree_unflatten(p.resolved.treedef, leaves)
