"""Values in, values out: what placing may take, and what it hands `jax.device_put`.

Placing never changes a value and never ties the result to a buffer the user can
still write to:

- a NumPy array of a 64-bit type, with JAX in 32-bit mode, is refused, since
  `device_put` would cast it (2**40 + 1 would become 1);
- a NumPy array placed on CPU devices is copied first: XLA:CPU may use an aligned
  host buffer in place, and reads it after `device_put` returns, so a later write
  into the array (or into any array it is a view of, read-only or not) would
  change the placed model;
- a JAX array on one CPU device is handed over as a NumPy view of its (immutable)
  buffer, which JAX splits into shards in one host pass: several times faster
  than the device-to-device path on CPU.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

__all__ = ["narrowed", "source_for", "unplaceable"]


def narrowed(dtype: Any) -> str | None:
    """Why JAX cannot hold `dtype` as it is (a 64-bit type in 32-bit mode), with the
    fix; or `None`. `apply`, `init` and `restore` all say it in these words."""
    held = jax.dtypes.canonicalize_dtype(dtype)
    if held == dtype:
        return None
    return (
        "JAX runs with 32-bit types, so placing it would change its values; cast it "
        f"(`x.astype(np.{held.name})`) or enable `jax_enable_x64`"
    )


def unplaceable(x: Any, what: str) -> str | None:
    """Why `x` cannot be placed with its values intact by `what` (such as
    "`eqshard.apply`"), or `None`."""
    if isinstance(x, jax.core.Tracer):
        return (
            f"is traced: {what} places concrete arrays outside `jit`; inside, use "
            "`eqshard.constrain`"
        )
    if isinstance(x, jax.ShapeDtypeStruct):
        return (
            f"is abstract (a jax.ShapeDtypeStruct): {what} places concrete arrays; for an "
            "abstract model use `eqshard.plan(model, spec).shardings`, e.g. as "
            "`out_shardings` of the jitted function that builds the model"
        )
    if isinstance(x, (np.ndarray, np.generic)):
        why = narrowed(x.dtype)
        if why is not None:
            return f"is a NumPy {x.dtype} array, and {why}"
    return None


def _on_cpu(target: jax.sharding.Sharding) -> bool:
    return any(device.platform == "cpu" for device in target.device_set)


def source_for(x: Any, target: jax.sharding.Sharding) -> Any:
    """What to hand `jax.device_put` to place `x` at `target` (see the module's notes).

    Weakly typed arrays and arrays of extended dtypes (PRNG keys) go as they are, and
    so do accelerator arrays, arrays already spread over devices, and arrays already
    in place.
    """
    if isinstance(x, np.ndarray):
        return np.array(x, copy=True) if _on_cpu(target) else x
    if not isinstance(x, jax.Array) or jnp.issubdtype(x.dtype, jax.dtypes.extended) or x.weak_type:
        return x  # NumPy has no weak types, and no PRNG key dtype
    source = x.sharding
    if not isinstance(source, SingleDeviceSharding) or source == target:
        return x
    if next(iter(source.device_set)).platform != "cpu" or x.is_deleted():
        return x
    return np.asarray(x)
