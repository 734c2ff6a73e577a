"""`init`: build a model straight into its shards, never whole on one device.

The model is first built abstractly (`eqx.filter_eval_shape`), which gives its
structure, its non-array leaves and the plan. Then the array leaves are built in
groups, one `jax.jit` each with `out_shardings`: XLA's SPMD partitioner splits the
computation, random-number generation included (JAX's partitionable threefry), so
each device computes and holds only its shards, and XLA drops the rest of the
factory as dead code. Each group is lowered with threefry unrolled on CPU
(`_rng_lowering`), so its program holds no random-number temporaries: JAX's rolled
CPU lowering keeps about 3x every random leaf's shard alive, and one `jit` for the
whole model then peaks at about 2.3 times the model's bytes. Non-array leaves
(functions, Python floats such as `Dropout.p`, static fields) never pass through
`jit`, so they come back exactly as the factory makes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import numpy as np

from ._derive import plan_for
from ._errors import EqshardError, Problem, SpecError
from ._fields import FROM_FIELDS
from ._plan import Plan, Spec, Unspecified
from ._rng_lowering import unrolled_threefry
from ._sharding import AnyMesh, Devices, local_devices, on_devices
from ._values import unplaceable

__all__ = ["init", "initializer"]

Model = TypeVar("Model")


def _is_array(x: object) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def initializer(factory: Callable[[], Any], plan: Plan) -> Any:
    """The jitted function that builds `factory()`'s array leaves in `plan`'s shardings.

    It returns the array part of the model (`eqx.partition(model, eqx.is_array)[0]`),
    in one program, lowered as JAX lowers it: the usual recipe, which
    `benchmarks/bench_init.py` compares `init` with (`init` builds groups of leaves,
    its random numbers lowered unrolled on CPU).
    """
    flat = [
        (s if s is not None else plan.replicated()) if _is_array(leaf) else None
        for leaf, s in zip(plan.resolved.leaves, plan.flat_shardings)
    ]
    out_shardings = jax.tree_util.tree_unflatten(plan.resolved.treedef, flat)

    def arrays() -> Any:
        return eqx.filter(factory(), eqx.is_array)

    return jax.jit(arrays, out_shardings=out_shardings)


def init(
    factory: Callable[[], Model],
    spec: Spec = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    unspecified: Unspecified = "replicate",
) -> Model:
    """Builds a model straight into its shards: no device ever holds a whole leaf it
    should hold only a shard of.

    **Example:**

    ```python
    model = eqshard.init(functools.partial(GPT, cfg, key=key), rules, mesh=mesh)
    ```

    **Arguments:**

    - `factory`: a function of no arguments that builds the model (pass
        `functools.partial(MyModel, cfg, key=key)` or a lambda). It must be pure JAX:
        it is traced twice (once abstractly, once under `jit`).
    - `spec`: anything `eqshard.apply` takes, a `Plan` included.
    - `mesh`: as for `eqshard.plan`; `devices`: a list of devices, or a count, the
        first that many of this process.
    - `unspecified`: as for `eqshard.plan`.

    **Returns:**

    The model, its array leaves placed as the spec says, every other leaf exactly as
    `factory` makes it. The array leaves are, bit for bit, what the usual recipe
    computes: `factory`'s arrays built by one `jax.jit` with the plan's shardings as
    `out_shardings` (building in groups, and the unrolled random-number hash, change
    no bit on JAX 0.10; on JAX 0.8 and 0.12, XLA may sum draws in another order
    there, so a sum of draws may differ in the last bits). `jax.random`'s bits are the same on every split and in an eager build
    (JAX's partitionable threefry). Float maths is compiled by XLA, so it may differ
    in the last bit from an eager `factory()`, which rounds each operation on its
    own (`jax.random.normal(key, shape) * 0.02` does, and so can the scaling inside
    `jax.random.uniform`, `exp`, `log` and sums); and where a split changes how XLA
    computes a reduction (a sum, or a `linspace`, along a split dimension), from an
    unsplit `jax.jit(factory)()`. Compare with an eager build within a tolerance.

    **Raises:**

    `eqshard.SpecError` listing every leaf that cannot be laid out, and every leaf
    that `factory` returns as a NumPy array of a 64-bit type while JAX runs with
    32-bit types (it would be cast); `eqshard.EqshardError` when `factory` fails to
    trace, saying why, or when the mesh is a `jax.sharding.AbstractMesh`.
    """
    wide: dict[int, str] = {}

    def traced() -> Any:
        # The factory's own leaves, before `eval_shape` makes them abstract: a NumPy
        # array is still one here, and `jit` would cast a 64-bit one. Such a leaf
        # leaves abstract and uncast (a cast can overflow, and warn).
        leaves, treedef = jax.tree_util.tree_flatten(factory())
        for i, leaf in enumerate(leaves):
            why = None
            if isinstance(leaf, (np.ndarray, np.generic)):
                why = unplaceable(leaf, "`eqshard.init`")
            if why is not None:
                wide[i] = why
                leaves[i] = jax.ShapeDtypeStruct(
                    leaf.shape, jax.dtypes.canonicalize_dtype(leaf.dtype)
                )
        return jax.tree_util.tree_unflatten(treedef, leaves)

    try:
        abstract = eqx.filter_eval_shape(traced)
    except Exception as error:
        raise EqshardError(
            f"`eqshard.init` traces `factory` to build the model abstractly, and it raised "
            f"{type(error).__name__}: {error}; `factory` takes no arguments and is pure "
            "JAX (use functools.partial(MyModel, ..., key=key))"
        ) from error
    planned = plan_for(
        abstract,
        spec,
        mesh=mesh,
        devices=local_devices(devices, "`eqshard.init`"),
        unspecified=unspecified,
    )
    plan = planned.plan
    refused = [Problem(plan.resolved.where(i), why) for i, why in wide.items()]
    if planned.problems or refused:
        headline = "`eqshard.init` cannot place these leaves" if refused else None
        raise SpecError(planned.problems + refused, headline)
    on_devices(plan.mesh, "`eqshard.init`", plan.devices)
    leaves = list(plan.resolved.leaves)
    for group in _groups(leaves):
        for i, array in zip(group, _compiled(factory, plan, group)()):
            leaves[i] = array
    return jax.tree_util.tree_unflatten(plan.resolved.treedef, leaves)


_GROUP_BYTES = 1 << 27


def _groups(leaves: list[Any]) -> list[list[int]]:
    """The array leaves in groups built by one `jit` each, in model order.

    Each `jit` computes only its group (XLA drops the rest of the factory as dead
    code), so only one group's program, and its temporaries where a JAX keeps any,
    is alive at a time. A group holds at most `max(largest leaf, all / 16, 128 MiB)`
    bytes: few programs to compile (one for a small model), each small enough that
    compiling it costs little memory.
    """
    sizes = {
        i: math.prod(leaf.shape) * leaf.dtype.itemsize
        for i, leaf in enumerate(leaves)
        if _is_array(leaf)
    }
    if not sizes:
        return []
    budget = max(max(sizes.values()), sum(sizes.values()) // 16, _GROUP_BYTES)
    groups: list[list[int]] = [[]]
    held = 0
    for i, size in sizes.items():
        if groups[-1] and held + size > budget:
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += size
    return groups


def _initializer(factory: Callable[[], Any], plan: Plan, group: list[int]) -> Any:
    """The jitted function that builds the leaves `group` of `factory()`, in order."""
    shardings = [plan.flat_shardings[i] or plan.replicated() for i in group]

    def arrays() -> list[Any]:
        leaves = jax.tree_util.tree_leaves(factory())
        return [leaves[i] for i in group]

    return jax.jit(arrays, out_shardings=shardings)


def _compiled(factory: Callable[[], Any], plan: Plan, group: list[int]) -> Any:
    """`_initializer` compiled, its random numbers lowered without temporaries."""
    with unrolled_threefry():
        return _initializer(factory, plan, group).lower().compile()
