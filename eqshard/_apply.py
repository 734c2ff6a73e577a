"""`apply`: place every array leaf of a model, in one batched `jax.device_put`."""

from __future__ import annotations

from typing import Any, TypeVar, overload

import equinox as eqx
import jax

from ._derive import derived_plan
from ._errors import SpecError
from ._fields import FROM_FIELDS
from ._plan import Planned, Spec, Unspecified, placing
from ._problems import Problem
from ._sharding import AnyMesh, Devices, placement
from ._values import source_for, unplaceable
from ._warnings import warn

__all__ = ["apply", "place"]

M = TypeVar("M", bound=eqx.Module)  # a model keeps its type; any other tree is Any


def _refusal(source: Any, target: jax.sharding.Sharding) -> str | None:
    try:
        jax.device_put(source, target)
    except (TypeError, ValueError, RuntimeError) as error:
        return str(error).split("\n")[0]
    return None


@overload
def apply(
    model: M,
    spec: Spec = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    unspecified: Unspecified = "replicate",
) -> M: ...


@overload
def apply(
    model: Any,
    spec: Spec = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    unspecified: Unspecified = "replicate",
) -> Any: ...


def apply(
    model: Any,
    spec: Spec = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    unspecified: Unspecified = "replicate",
) -> Any:
    """Places every array leaf of a model as its spec says, in one pass.

    After this, the user's `eqx.filter_jit` step runs sharded, and the model code does
    not change.

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
    - `mesh`: the `jax.sharding.Mesh` to lay the model out on, with its axis names; by
        default the mesh of `jax.set_mesh`, if one is set.
    - `devices`: else, this process's devices: a list, or a count (the first that
        many); by default all of `jax.devices()`.
    - `unspecified`: what an array leaf with no expression gets: `"replicate"` (a full
        copy on every device, the default) or `"keep"` (left where it is).

    **Returns:**

    A new model of the same structure, its array leaves in their shardings (see "What
    comes back").

    **Raises:**

    - `eqshard.SpecError`: lists every leaf whose expression does not fit, or names the
        first path where the spec's structure differs from the model's (see "Errors").
    - `eqshard.EqshardError`: the mesh is a `jax.sharding.AbstractMesh`, which has no
        devices to place on, or `devices` is more than this process has.

    !!! info "What comes back"

        The array leaves are new arrays with exactly the input's values. An array
        already in its sharding is reused, not copied. Other leaves (functions, Python
        numbers, static fields) pass through untouched. The input model is not modified.
    """
    placed = placement(devices, what="`eqshard.apply`")
    planned = derived_plan(model, spec, mesh=mesh, devices=placed, unspecified=unspecified)
    return place(model, planned)


def place(tree: Any, planned: Planned, what: str = "`eqshard.apply`") -> Any:
    """Places every leaf of `tree` that `planned` gives a sharding, in one
    `jax.device_put`; raises every problem of the plan and of the values at once."""
    p = placing(planned.plan, what)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    indices = [i for i, s in enumerate(p.flat_shardings) if s is not None]
    refused = [
        Problem(p.resolved.where(i), why)
        for i in indices
        if (why := unplaceable(leaves[i], what)) is not None
    ]
    if planned.problems or refused:
        headline = f"{what} cannot place these leaves" if refused else None
        raise SpecError(planned.problems + refused, headline)
    warn(planned.warnings)
    targets = [s for s in p.flat_shardings if s is not None]
    sources = [source_for(leaves[i], target) for i, target in zip(indices, targets)]
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
            f"{what} cannot place these leaves",
        ) from None
    for i, array in zip(indices, placed):
        leaves[i] = array
    return jax.tree_util.tree_unflatten(treedef, leaves)
