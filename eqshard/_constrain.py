"""Placing values: `shard` for one array outside `jit`, `constrain` inside it."""

from __future__ import annotations

from typing import Any, TypeVar, overload

import equinox as eqx
import jax
import jax.core
from jax.sharding import AxisType, NamedSharding
from jaxtyping import Array, ArrayLike

from ._activations import activation_sharding, active, is_names, marked
from ._apply import place
from ._derive import derived_plan
from ._errors import EqshardError, SpecError
from ._expression import Expression
from ._fields import FROM_FIELDS, is_array_like
from ._plan import Plan, Spec, Unspecified
from ._sharding import AnyMesh, Devices, Placement, on_devices, placed_sharding, placement
from ._specfile._model import Rules
from ._values import source_for, unplaceable

__all__ = ["constrain", "constrained", "shard"]

M = TypeVar("M", bound=eqx.Module)  # a model keeps its type; any other tree is Any


def shard(
    x: ArrayLike,
    expr: str | Expression,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
) -> Array:
    """Places one array as an einshard expression says.

    It gives the same layout as `einshard.einshard(x, expr)`. It places with one
    `jax.device_put`, rather than a host callback per shard.

    **Example:**

    ```python
    w1 = eqshard.apply(w1, "x y -> x y*")   # columns split over all devices
    ```

    **Arguments:**

    - `x`: a `jax.Array` or a NumPy array. It is not modified.
    - `expr`: an einshard expression (text or `eqshard.expression.Expression`).
    - `mesh`: the mesh to place on, with its axis names; by default the mesh of
        `jax.set_mesh`, if one is set.
    - `devices`: else, this process's devices: a list, or a count (the first that
        many); by default all of `jax.devices()`.

    **Returns:**

    A new `jax.Array` with the values of `x`, placed by the expression. An array already
    in that sharding is returned as it is, without a copy.

    **Raises:**

    - `eqshard.ExpressionError`: the expression is malformed, or does not fit the
        array's shape or the devices.
    - `eqshard.EqshardError`: called on a traced value inside `jit` (use
        `eqshard.constrain` there), or on a `jax.sharding.AbstractMesh`, which has no
        devices.
    """
    return _shard(x, expr, mesh, placement(devices, what="`eqshard.shard`"))


def _shard(x: ArrayLike, expr: str | Expression, mesh: AnyMesh | None, placed: Any) -> Array:
    """`shard` once `devices=` is read (`placement`)."""
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
    why = unplaceable(x, "`eqshard.shard`")
    if why is not None:
        raise EqshardError(f"the array {why}")
    return _put(x, placed_sharding(expr, shape, mesh, placed), "`eqshard.shard`", placed)


def _put(x: ArrayLike, target: NamedSharding, what: str, devices: object) -> Array:
    """`x` placed in `target`, outside `jit`: one `jax.device_put`."""
    on_devices(target.mesh, what, devices)
    return jax.device_put(source_for(x, target), target)


class _ByTheActivePlan:
    """`constrain`'s default spec: the plan of `eqshard.use(plan)`, else the fields."""

    def __repr__(self) -> str:
        return "the active plan, else FROM_FIELDS"


BY_THE_ACTIVE_PLAN: Any = _ByTheActivePlan()


@overload
def constrain(
    x: M,
    spec: Spec = BY_THE_ACTIVE_PLAN,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    simulate: int | None = None,
    unspecified: Unspecified = "replicate",
    rules: Rules | Plan | None = None,
) -> M: ...


@overload
def constrain(
    x: Any,
    spec: Spec = BY_THE_ACTIVE_PLAN,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    simulate: int | None = None,
    unspecified: Unspecified = "replicate",
    rules: Rules | Plan | None = None,
) -> Any: ...


def constrain(
    x: Any,
    spec: Spec = BY_THE_ACTIVE_PLAN,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    simulate: int | None = None,
    unspecified: Unspecified = "replicate",
    rules: Rules | Plan | None = None,
) -> Any:
    """Constrains values inside `jit` to a layout: one activation, or a whole model.

    Inside `jax.jit` or `eqx.filter_jit` this is `jax.lax.with_sharding_constraint`
    (`jax.sharding.reshard` on Explicit axes). Outside `jit` it places the values, as
    `eqshard.apply` does.

    **Example:**

    ```python
    @eqx.filter_jit
    def step(model, x, y):
        x = eqshard.constrain(x, "batch d -> batch* d")
        grads = eqx.filter_grad(loss)(model, x, y)
        model = eqx.apply_updates(model, update(grads))
        return eqshard.constrain(model)              # the active plan's layouts

    class Block(eqx.Module):
        def __call__(self, x):                       # x: (batch, seq, embed)
            x = eqshard.constrain(x, ("batch", "seq", "embed"))   # by the active rules
            ...
    ```

    **Arguments:**

    - `x`: one array, or a pytree such as a model; traced or concrete.
    - `spec`: an expression or a tuple of dim names (`None` and a leading `...` left
        free) for one array, or any spec for a pytree; by default the active plan.
    - `mesh`: the mesh to constrain on; by default the mesh of `jax.set_mesh`.
    - `devices`: else, this process's devices the computation runs on: a list, or a
        count (the first that many); by default all of `jax.devices()`.
    - `simulate`: else, a count of devices (inside `jit` only): the layout on a
        `jax.sharding.AbstractMesh` of that many.
    - `unspecified`: as for `eqshard.apply`.
    - `rules`: with names, the `eqshard.Rules` (or a plan made from them) that lay them
        out, rather than those of `eqshard.use`.

    **Returns:**

    `x`, constrained to the layout; with names and no rules active, `x` itself.

    **Raises:**

    - `eqshard.ExpressionError`, `eqshard.SpecError`: the spec does not fit `x` or the
        mesh, naming each leaf (with names: the spec file's `$.dims` for a name it
        does not map, or two names mapped to one mesh axis).
    - `eqshard.UsageError`: both `devices` and `simulate` are given.
    - `eqshard.EqshardError`: names that do not match `x`'s rank.

    The guide "Activations, optimizer state and host memory" says more: why
    constrain, named activations, specs, meshes and host memory.
    """
    placed = placement(devices, simulate, what="`eqshard.constrain`")
    if spec is BY_THE_ACTIVE_PLAN:
        spec = _by_the_active_plan(x, mesh, placed)
    if is_names(x, spec):
        return _named(x, spec, rules, mesh, placed)
    if rules is not None:
        raise EqshardError(
            "`rules=` lays out an array whose axes are named, as in "
            "`eqshard.constrain(x, ('batch', 'embed'), rules=rules)`; for an expression or "
            "a spec, pass the rules as the spec: `eqshard.constrain(model, rules)`"
        )
    traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(x))
    if is_array_like(x) and isinstance(spec, (str, Expression)):
        one: Any = x  # an array: what comes back is one too
        if not traced:
            placed_one: Any = _shard(one, spec, mesh, placed)
            return placed_one
        return constrained([one], [placed_sharding(spec, one.shape, mesh, placed)])[0]
    planned = derived_plan(x, spec, mesh=mesh, devices=placed, unspecified=unspecified)
    if not traced:
        return place(x, planned, "`eqshard.constrain`")
    if planned.problems:
        raise SpecError(planned.problems)
    p = planned.plan
    leaves, treedef = jax.tree_util.tree_flatten(x)
    indices = [i for i, s in enumerate(p.flat_shardings) if s is not None]
    held = constrained([leaves[i] for i in indices], [s for s in p.flat_shardings if s is not None])
    for i, value in zip(indices, held):
        leaves[i] = value
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _by_the_active_plan(x: Any, mesh: Any, devices: Any) -> Spec:
    """`constrain`'s default spec: the active plan where `x` is its model or built
    from it (on the mesh or devices given, its spec laid out again); else the
    fields, as with no plan (a module that constrains itself or a submodule, a
    plain array)."""
    found = active()
    p = None if found is None else found.plan
    if p is None:
        return FROM_FIELDS
    planned = derived_plan(x, p)
    if not planned.matched:
        return FROM_FIELDS
    return p.spec if mesh is not None or devices is not None else p


def _named(
    x: Any,
    names: Any,
    rules: Rules | Plan | None,
    mesh: AnyMesh | None,
    devices: Placement | None,
) -> Any:
    """`x`, whose axes `names` names, held to the layout the rules give it; `x`
    itself where no rules are active."""
    target = activation_sharding(x, names, rules, mesh=mesh, devices=devices)
    if target is None:
        return marked(x)  # while `eqshard suggest` records the names, for its jaxpr walk
    if not isinstance(x, jax.core.Tracer):
        why = unplaceable(x, "`eqshard.constrain`")
        if why is not None:
            raise EqshardError(f"the array {why}")
        return _put(x, target, "`eqshard.constrain`", devices)
    return constrained([x], [target])[0]


def constrained(values: list[Any], shardings: list[NamedSharding]) -> list[Any]:
    """`values` held to `shardings` inside `jit`: a sharding constraint where the
    mesh's axes are Auto, `jax.sharding.reshard` where they are Explicit (the mesh
    of `jax.set_mesh`, in JAX's sharding-in-types mode); a sharding in host memory
    (`"pinned_host"`) by `jax.device_put`, which moves the value there, as a
    sharding constraint does not (JAX 0.10 keeps its memory kind as it is)."""
    host = [s.memory_kind not in (None, "device") for s in shardings]
    explicit = [any(kind == AxisType.Explicit for kind in s.mesh.axis_types) for s in shardings]
    if not any(explicit) and not any(host):
        return jax.lax.with_sharding_constraint(values, shardings)
    return [
        jax.device_put(v, s)
        if h
        else jax.sharding.reshard(v, s)
        if e
        else jax.lax.with_sharding_constraint(v, s)
        for v, s, e, h in zip(values, shardings, explicit, host)
    ]
