"""Plans: the sharding of every array leaf of a model, on one shared mesh.

`plan(model, spec)` resolves the spec, lays out every array leaf, and fits all
the layouts onto one mesh where one exists (always, on a power-of-two device
count). Each leaf's devices hold exactly the blocks that `eqshard.sharding` (and
einshard) would give them; only the mesh they are written on is shared, so the
model works inside `jax.set_mesh(plan.mesh)`, `shard_map` and
`with_sharding_constraint` code written against that mesh. Where no shared mesh
exists, each expression keeps its own mesh, as `eqshard.sharding` builds it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._errors import EqshardError, EqshardWarning, ExpressionError, Problem, SpecError, warn
from ._expression import Expression
from ._fields import FROM_FIELDS, is_array_like
from ._layout import Layout, layout, shared_mesh
from ._resolve import Resolved, resolve
from ._resolver import Target
from ._sharding import Device, device_tuple, mesh, named_sharding

__all__ = ["Plan", "Planned", "Unspecified", "make_plan", "plan", "plan_for"]

Unspecified = Literal["replicate", "keep"]


@functools.lru_cache(maxsize=8192)
def _layout(expr: Expression, shape: tuple[int, ...], n_devices: int) -> Layout:
    return layout(expr, shape, n_devices)


def _replicated(ndim: int, n_devices: int) -> Layout:
    return Layout((n_devices,), ("_0",), (None,) * ndim)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Where every array leaf of a model goes. Made by `eqshard.plan`.

    A plan compares and hashes by identity, so it can be a static argument of
    `eqx.filter_jit`, as in `eqshard.constrain(model, plan)` inside a step.

    **Attributes:**

    - `mesh`: the one mesh (Auto axes `m0`, `m1`, ...) that every sharding is
        written on, or `None` when the layouts share no mesh (then each sharding
        has its expression's own mesh, as `eqshard.sharding` builds it).
    - `shardings`: the model's structure with a `NamedSharding` for each array leaf
        (`None` for other leaves, and for leaves kept where they are).
    - `partition_specs`: the same, with each leaf's `PartitionSpec`.
    - `expressions`: the same, with each leaf's complete `Expression` (`None` where
        the spec gave none).
    """

    mesh: Mesh | None
    resolved: Resolved = dataclasses.field(repr=False)
    flat_shardings: list[NamedSharding | None] = dataclasses.field(repr=False)

    def _tree(self, flat: list[Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.resolved.treedef, flat)

    @functools.cached_property
    def shardings(self) -> PyTree[NamedSharding | None]:
        return self._tree(self.flat_shardings)

    @functools.cached_property
    def partition_specs(self) -> PyTree[PartitionSpec | None]:
        return self._tree([None if s is None else s.spec for s in self.flat_shardings])

    @functools.cached_property
    def expressions(self) -> PyTree[Expression | None]:
        return self._tree(self.resolved.exprs)

    def __repr__(self) -> str:
        return f"Plan(mesh={self.mesh}, shardings={self.shardings})"


class Planned(NamedTuple):
    """A plan with the faults found while making it: leaves with a problem have no
    sharding (see `Plan.failed`)."""

    plan: Plan
    problems: list[Problem]
    warnings: list[EqshardWarning]


def make_plan(
    model: PyTree[Any],
    spec: Any = FROM_FIELDS,
    *,
    devices: Sequence[Device] | None = None,
    unspecified: Unspecified = "replicate",
) -> Planned:
    """`plan`, collecting every problem of every leaf rather than raising them.

    A leaf whose expression cannot be read cannot be laid out, but every other leaf
    still is, so one pass finds every independent fault.
    """
    if unspecified not in ("replicate", "keep"):
        raise EqshardError(f"`unspecified` must be 'replicate' or 'keep', not {unspecified!r}")
    devices = device_tuple(devices)
    n = len(devices)
    resolved, problems, warnings = resolve(model, spec, Target(n))

    layouts: list[Layout | None] = []
    replicate = unspecified == "replicate"
    for i, (leaf, expr) in enumerate(zip(resolved.leaves, resolved.exprs)):
        if expr is not None:
            try:
                layouts.append(_layout(expr, tuple(leaf.shape), n))
            except ExpressionError as error:
                context = f"{leaf.dtype}{list(leaf.shape)} {str(expr)!r}"
                problems.append(Problem.from_error(resolved.where(i), error, context))
                resolved.failed.add(i)
                layouts.append(None)
        elif replicate and i not in resolved.failed and is_array_like(leaf):
            layouts.append(_replicated(len(leaf.shape), n))
        else:
            layouts.append(None)

    distinct = {lay for lay in layouts if lay is not None}
    shared = shared_mesh(distinct, n)
    if shared is None:  # each expression keeps its own mesh, as `eqshard.sharding` builds it
        common = None
        by_layout = {
            lay: named_sharding(lay.mesh_shape, lay.mesh_axes, lay.spec, devices)
            for lay in distinct
        }
    else:
        common = mesh(shared.mesh_shape, shared.mesh_axes, devices)
        by_layout = {
            lay: named_sharding(shared.mesh_shape, shared.mesh_axes, shared.spec_of(lay), devices)
            for lay in distinct
        }
    flat = [None if lay is None else by_layout[lay] for lay in layouts]
    return Planned(Plan(mesh=common, resolved=resolved, flat_shardings=flat), problems, warnings)


def _fits_plan(tree: Any, given: Plan) -> list[Problem]:
    """Why `given` cannot lay out `tree`: another structure, or leaves of other shapes."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    resolved = given.resolved
    if treedef != resolved.treedef:
        return [
            Problem(
                "the root",
                f"the plan was made for a pytree of another structure ({len(resolved.leaves)} "
                f"leaves; this one has {len(leaves)}); make the plan from a model of the "
                "same structure, or pass the spec instead",
            )
        ]
    return [
        Problem(
            resolved.where(i),
            f"the plan was made for shape {tuple(old.shape)}, and this leaf has "
            f"{tuple(new.shape)}; make the plan from this model",
        )
        for i, (new, old, sharding) in enumerate(zip(leaves, resolved.leaves, given.flat_shardings))
        if sharding is not None and tuple(getattr(new, "shape", ())) != tuple(old.shape)
    ]


def plan_for(
    tree: PyTree[Any],
    spec: Any,
    *,
    devices: Sequence[Device] | None = None,
    unspecified: Unspecified = "replicate",
) -> Planned:
    """The plan that lays out `tree`: `spec` itself when it is a `Plan` made for a tree
    of the same structure and shapes, else `make_plan(tree, spec, ...)`."""
    if not isinstance(spec, Plan):
        return make_plan(tree, spec, devices=devices, unspecified=unspecified)
    if devices is not None:
        raise EqshardError(
            "`devices` is given with a `Plan`, which has its devices already; pass one or the other"
        )
    return Planned(spec, _fits_plan(tree, spec), [])


def plan(
    model: PyTree[Any],
    spec: Any = FROM_FIELDS,
    *,
    devices: Sequence[Device] | None = None,
    unspecified: Unspecified = "replicate",
) -> Plan:
    """Resolves a spec against a model and lays out every array leaf, placing nothing.

    It works on abstract models (`eqx.filter_eval_shape`) as well as concrete ones,
    so checking a spec costs no device memory.

    **Example:**

    ```python
    p = eqshard.plan(model, spec)
    p.mesh                        # Mesh('m0': 8)
    p.partition_specs.w1          # PartitionSpec(None, 'm0')
    with jax.set_mesh(p.mesh): ...
    ```

    **Arguments:**

    - `model`: an Equinox model or any pytree.
    - `spec`: where the expressions come from. By default the model's
        `eqshard.field`s; else a spec tree with the model's structure, a prefix of
        it (one expression or `None` for a whole subtree), a single expression for
        every array leaf, or a resolver such as `eqshard.Rules`. A leaf may be an
        `Expression`, its text, or `None`.
    - `devices`: the devices to use, all of them; `jax.devices()` by default.
    - `unspecified`: what an array leaf whose expression is `None` gets:
        `"replicate"` (a full copy on every device, the default) or `"keep"` (it
        stays where it is).

    **Returns:**

    A `Plan`.

    **Raises:**

    `eqshard.SpecError` listing every faulty leaf, one line each with its key path,
    shape, expression and the rule it breaks (rank, divisibility, device count or
    annotation); or naming the first path where the spec's structure differs from
    the model's.
    """
    planned = make_plan(model, spec, devices=devices, unspecified=unspecified)
    if planned.problems:
        raise SpecError(planned.problems)
    warn(planned.warnings)
    return planned.plan
