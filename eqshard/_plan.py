"""Plans: the sharding of every array leaf of a model, on one mesh.

`plan(model, spec)` resolves the spec, lays out every array leaf, and fits all the
layouts onto one mesh (`_fit.py`): the user's (`mesh=`, `jax.set_mesh`, or a spec
file's declared mesh), where a layout that does not fit is a problem; else the
coarsest shared row-major mesh, which exists on any power-of-two device count.
Each leaf's devices hold exactly the blocks that `eqshard.expression.sharding` (and einshard)
would give them; only the mesh they are written on is shared. Where no shared
mesh exists, each expression keeps its own mesh, as `eqshard.expression.sharding` builds it.

Planning needs no devices: given a count (`simulate=65536`), every mesh is the
`jax.sharding.AbstractMesh` of the axes the same devices would get, so the
layouts, `PartitionSpec`s and bytes per device are those of the concrete plan,
and only placing or compiling needs devices (`_sharding.on_devices`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Union

import equinox as eqx
import jax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._errors import EqshardError, ExpressionError, SpecError
from ._expression import Expression
from ._fields import FROM_FIELDS, is_array_like, is_stateful_pair
from ._fit import MeshShape, fit, grouping, groupings, mesh_shape_of, misfit, shared_mesh
from ._layout import Layout, layout
from ._partition import sharding_mesh
from ._problems import Problem
from ._protocol import Resolver, SpecLeaf, Target, is_resolver, is_spec_leaf
from ._resolve import Resolved, resolve
from ._sharding import (
    AnyMesh,
    Device,
    Devices,
    Placement,
    abstract_mesh,
    as_placement,
    device_count,
    local_devices,
    mesh as build_mesh,
    mesh_devices,
    named_sharding,
    on_devices,
    partition_spec,
    placement,
    user_mesh,
    with_devices,
)
from ._specfile._read import read_path
from ._warnings import EqshardWarning, MeshWarning, warn

__all__ = [
    "Plan",
    "Planned",
    "Spec",
    "Unspecified",
    "as_plan",
    "declared_mesh",
    "placing",
    "plan",
    "plan_faults",
    "spec_tree",
]

Unspecified = Literal["replicate", "keep"]

Spec = Union[str, Expression, os.PathLike, Resolver, "Plan", "PyTree[SpecLeaf]", None]
"""What every function that lays something out takes as its spec (`eqshard.plan`,
`apply`, `constrain`, `init`, `restore`, `abstract`, `report`, `cost`, `suggest`,
`diff`):

- an einshard expression (text or `Expression`), for every array leaf: a `str` is
    always an expression, never a file name;
- a spec file, as a `pathlib.Path` (read with `eqshard.load`);
- a resolver: `eqshard.resolvers.FROM_FIELDS` (the model's `eqshard.field`s, the default),
    the `Rules` of a spec file, `eqshard.FSDP`, or the user's own;
- a `Plan`, made for the model (it lays out any tree built from it);
- a spec tree: the model's structure with a `SpecLeaf` per leaf, or a prefix of it.
"""


@functools.lru_cache(maxsize=8192)
def _layout(expr: Expression, shape: tuple[int, ...], n_devices: int) -> Layout:
    return layout(expr, shape, n_devices)


def _replicated(ndim: int, n_devices: int) -> Layout:
    return Layout((n_devices,), ("_0",), (None,) * ndim)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Where every array leaf of a model goes. Made by `eqshard.plan`.

    A plan compares and hashes by identity. So it can be a static argument of
    `eqx.filter_jit`, as in `eqshard.constrain(model, plan)` inside a step.

    **Attributes:**

    - `mesh`: the one mesh every sharding is written on, or `None` (see "The mesh").
    - `shardings`: the model's structure with a `NamedSharding` for each array leaf;
        `None` for other leaves, and for leaves kept where they are.
    - `partition_specs`: the same, with each leaf's `PartitionSpec`.
    - `expressions`: the same, with each leaf's complete `Expression` (`None` where the
        spec gave none).
    - `devices`: the devices the plan places on, in einshard's order, or the count of
        `simulate=` (see "Device counts").
    - `mesh_is_given`: whether `mesh` is the user's or a spec file's, not eqshard's.
    - `spec`, `unspecified`: what the plan was made from; they also lay out the model's
        `eqx.nn.State` when the plan meets one.
    - `abstract`: the tree with a `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` at
        every array leaf, other leaves unchanged: what Orbax restores into.
    - `optimizer`: the optimizer section, a plan of the same model whose shardings are
        the optimizer state's (see the guide "Annotations and spec trees").
    - `follows`: in an optimizer section, whether each leaf takes its parameter's layout
        (`"default": "parameter"`); else `None`.

    !!! info "The mesh"

        `mesh` is the user's: `mesh=`, the mesh of `jax.set_mesh`, or the `"mesh"` a
        spec file declares, built with Auto axes. Else it is a shared row-major mesh of
        Auto axes `m0`, `m1`, ... For a plan made for a count, it is a
        `jax.sharding.AbstractMesh` of the same axes. It is `None` when the layouts
        share no mesh. Then each sharding has its expression's own mesh, as
        `eqshard.expression.sharding` builds it.

    !!! info "Device counts"

        For a plan made with `simulate=65536`, `devices` is that count. Every mesh is
        then a `jax.sharding.AbstractMesh`. What places or compiles with the plan
        (`apply`, `init`, `restore`, `cost`) uses the first that many of
        `jax.devices()`, as `devices=n` does. On the user's abstract mesh, `devices` is
        `None`.

    The guide "Annotations and spec trees" says more: the optimizer section and
    memory kinds.
    """

    mesh: AnyMesh | None
    resolved: Resolved = dataclasses.field(repr=False)
    flat_shardings: list[NamedSharding | None] = dataclasses.field(repr=False)
    devices: Placement | None = dataclasses.field(default=None, repr=False)
    mesh_is_given: bool = dataclasses.field(default=False, repr=False)
    spec: Any = dataclasses.field(default=None, repr=False)
    unspecified: Unspecified = dataclasses.field(default="replicate", repr=False)
    section: Plan | None = dataclasses.field(default=None, repr=False)
    follows: tuple[bool, ...] | None = dataclasses.field(default=None, repr=False)

    @property
    def optimizer(self) -> Plan:
        """The plan of the optimizer state's layouts: the optimizer section, else
        this plan (see the class's notes)."""
        return self if self.section is None else self.section

    def replicated(self) -> NamedSharding:
        """A full copy on every device of the plan, on its mesh where it has one."""
        if self.mesh is not None:
            return NamedSharding(self.mesh, PartitionSpec())
        assert self.devices is not None
        return named_sharding((device_count(self.devices),), ("_0",), (), self.devices)

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

    def __eqshard_rules__(self) -> Any:
        """The plan as a spec file's `Rules`, for `eqshard.dump`: a rule per leaf with
        an expression (its path, its expression, its memory kind), the user's mesh where
        the plan has one, and the device count; the leaves with none replicated."""
        from ._paths._names import name, segments
        from ._specfile._model import Rule, Rules

        resolved, rules = self.resolved, []
        memory = resolved.memory or [None] * len(resolved.leaves)
        for i, expr in enumerate(resolved.exprs):
            if expr is not None:
                key = resolved.fields[i].path
                path = name(segments(key)) if key else "**"
                kind = memory[i]
                if kind not in (None, "device", "pinned_host"):
                    raise EqshardError(
                        f"{resolved.where(i)} is held in {kind!r} memory, which a spec file "
                        "cannot write ('device' or 'pinned_host'); it is not written"
                    )
                held = "pinned_host" if kind == "pinned_host" else None
                rules.append(Rule(path, expr, resolved.origins[i], len(rules), held))
        mesh = None
        if self.mesh_is_given and self.mesh is not None:
            mesh = tuple(
                (str(n), int(s)) for n, s in zip(self.mesh.axis_names, self.mesh.axis_sizes)
            )
        count = device_count(self.devices) if self.devices is not None else None
        return Rules(tuple(rules), devices=count, mesh=mesh)

    @functools.cached_property
    def abstract(self) -> PyTree[Any]:
        """The tree with a `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` at every
        array leaf the plan lays out, and every other leaf unchanged: a target for
        Orbax's `restore` and for `jax.jit`'s `out_shardings`."""
        leaves = [
            leaf
            if sharding is None
            else jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
            for leaf, sharding in zip(self.resolved.leaves, self.flat_shardings)
        ]
        return self._tree(leaves)

    def __repr__(self) -> str:  # short: a plan may lay out thousands of leaves
        laid_out = sum(s is not None for s in self.flat_shardings)
        return f"Plan(mesh={self.mesh}, leaves={laid_out})"


_PLACING: weakref.WeakKeyDictionary[Plan, tuple[tuple[Device, ...], Plan]] = (
    weakref.WeakKeyDictionary()
)


def placing(plan: Plan, what: str) -> Plan:
    """The plan that places arrays: `plan` itself where it holds devices; for one made
    for a count `n`, its layouts on the first `n` of `jax.devices()` (cached).

    **Raises:** `EqshardError` where this process has fewer than `n` devices, or the
    plan's mesh is the user's `jax.sharding.AbstractMesh`.
    """
    if not isinstance(plan.devices, int):
        on_devices(plan.mesh, what, plan.devices)
        return plan
    devices = tuple(local_devices(plan.devices, what) or ())
    cached = _PLACING.get(plan)
    if cached is not None and cached[0] == devices:
        return cached[1]
    placed = _on(plan, devices)
    _PLACING[plan] = (devices, placed)
    return placed


def _on(plan: Plan, devices: tuple[Device, ...]) -> Plan:
    def moved(s: NamedSharding | None) -> NamedSharding | None:
        if s is None:
            return None
        return NamedSharding(with_devices(s.mesh, devices), s.spec, memory_kind=s.memory_kind)

    return dataclasses.replace(
        plan,
        mesh=None if plan.mesh is None else with_devices(plan.mesh, devices),
        flat_shardings=[moved(s) for s in plan.flat_shardings],
        devices=devices,
        section=None if plan.section is None else _on(plan.section, devices),
    )


class Planned(NamedTuple):
    """A plan with the faults found while making it (a faulty leaf has no sharding);
    `matched`: the leaves of another tree that took a layout by structure."""

    plan: Plan
    problems: list[Problem]
    warnings: list[EqshardWarning]
    matched: int = 0


class _Laid(NamedTuple):
    """One spec resolved against the model and laid out, before fitting: the
    parameters', or the optimizer section's."""

    resolved: Resolved
    layouts: list[Layout | None]
    where: str  # how a problem of this spec names a leaf: `{}`, or its optimizer state


def _laid_out(
    resolved: Resolved, n: int, replicate: bool, problems: list[Problem], where: str = "{}"
) -> _Laid:
    """Every leaf's layout on `n` devices: its expression's, a replication where
    it has none and `replicate` says so, else `None` (a problem's leaf, added to
    `problems`, or one kept where it is)."""
    layouts: list[Layout | None] = []
    for i, (leaf, expr) in enumerate(zip(resolved.leaves, resolved.exprs)):
        if expr is not None:
            try:
                layouts.append(_layout(expr, tuple(leaf.shape), n))
            except ExpressionError as error:
                context = f"{leaf.dtype}{list(leaf.shape)} {str(expr)!r}"
                problem = Problem.from_error(resolved.where(i), error, context)
                problems.append(_named(problem, where))
                resolved.failed.add(i)
                layouts.append(None)
        elif replicate and i not in resolved.failed and is_array_like(leaf):
            layouts.append(_replicated(len(leaf.shape), n))
        else:
            layouts.append(None)
    return _Laid(resolved, layouts, where)


_OPTIMIZER_STATE = "the optimizer state of {}"


def _named(problem: Problem, where: str) -> Problem:
    """`problem`, its leaf named as `where` says (a file's place stays as it is)."""
    if where == "{}" or problem.file is not None or "::" in problem.where:
        return problem
    return dataclasses.replace(problem, where=where.format(problem.where))


def optimizer_spec(spec: Any, optimizer: Any) -> Any:
    """The optimizer section's spec: `optimizer=`, else a spec file's `"optimizer"`
    section, else `None` (the state follows the parameters).

    **Raises:** `EqshardError` when both are given, or when the parameters' rules
    say `"default": "parameter"`, which only an optimizer section may.
    """
    from ._specfile._model import PARAMETER, Rules

    if isinstance(spec, Rules) and spec.default == PARAMETER:
        raise EqshardError(
            f'{spec.source}: "default": "parameter" is for the optimizer state (its '
            "state leaves follow their parameters); the parameters' rules say 'replicate', "
            "'error' or 'fsdp'. Pass these rules as `optimizer=`"
        )
    declared = spec.optimizer if isinstance(spec, Rules) else None
    if optimizer is not None and declared is not None:
        raise EqshardError(
            f'{spec.source} has an "optimizer" section, and `optimizer=` is given too; '
            "pass one or the other"
        )
    if isinstance(optimizer, Plan):
        raise EqshardError(
            "`optimizer=` takes a spec (rules, a spec tree, an expression, `eqshard.FSDP`), "
            "not a `Plan`: the section is laid out with the parameters, on one mesh"
        )
    return optimizer if optimizer is not None else declared


def plan_faults(
    model: PyTree[Any],
    spec: Spec = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Sequence[Device] | int | None = None,
    unspecified: Unspecified = "replicate",
    context: Any = None,
    fit_onto: AnyMesh | None = None,
    optimizer: Any = None,
) -> Planned:
    """`plan`, collecting every problem of every leaf rather than raising them.

    A leaf whose expression cannot be read cannot be laid out, but every other leaf
    still is, so one pass finds every independent fault. `context` is the model
    `model` was built from, where `model` is part of its state (`Target.context`);
    `fit_onto`, the mesh of that model's plan, which the layouts must fit, though
    the spec is resolved as without a mesh (it is not the user's). `optimizer`, the
    optimizer section's spec (`optimizer_spec`): resolved against the model's
    parameters and fitted onto the same mesh as they are.
    """
    if unspecified not in ("replicate", "keep"):
        raise EqshardError(f"`unspecified` must be 'replicate' or 'keep', not {unspecified!r}")
    spec = read_path(spec)
    section_spec = optimizer_spec(spec, optimizer)
    target_mesh = user_mesh(mesh, devices)
    if target_mesh is None and not (is_resolver(spec) or isinstance(spec, (str, Expression))):
        target_mesh = sharding_mesh(jax.tree_util.tree_leaves(spec, is_leaf=is_spec_leaf), devices)
    problems: list[Problem] = []
    placed_on: Placement | None
    if target_mesh is None:
        placed_on = as_placement(devices)
        n = device_count(placed_on)
        declared, found = declared_mesh(spec, n)
        if declared is None and not found and section_spec is not None:
            declared, found = declared_mesh(section_spec, n)  # `optimizer=` a file's
        problems += found
        if declared is not None:
            target_mesh = build_mesh(declared.sizes, declared.names, placed_on)
    else:
        placed_on = mesh_devices(target_mesh)
        n = target_mesh.size
    resolved, resolving, warnings = resolve(model, spec, Target(n, target_mesh, context))
    problems += resolving
    parts = [_laid_out(resolved, n, unspecified == "replicate", problems)]
    if section_spec is not None:
        parameters = model[0] if is_stateful_pair(model) else model  # the state has none
        section, resolving, found = resolve(parameters, section_spec, Target(n, target_mesh))
        problems += [_named(problem, _OPTIMIZER_STATE) for problem in resolving]
        warnings += found
        parts.append(_laid_out(section, n, False, problems, _OPTIMIZER_STATE))

    distinct = {lay for part in parts for lay in part.layouts if lay is not None}
    on_mesh = target_mesh if target_mesh is not None else fit_onto
    if on_mesh is not None:
        on = mesh_shape_of(on_mesh.axis_names, on_mesh.axis_sizes)
        specs = {lay: fit(lay, on) for lay in distinct}
        for part in parts:
            for i, lay in enumerate(part.layouts):
                if lay is not None and specs[lay] is None:
                    problem = _does_not_fit(part.resolved, i, on)
                    if target_mesh is None:  # the mesh of the model's plan
                        problem = dataclasses.replace(
                            problem,
                            message=f"{problem.message}; it is the mesh of the model's plan: "
                            "make the plan from `(model, state)`, so that one mesh fits both",
                        )
                    problems.append(_named(problem, part.where))
                    part.resolved.failed.add(i)
                    part.layouts[i] = None
        by_layout = {
            lay: NamedSharding(on_mesh, partition_spec(spec))
            for lay, spec in specs.items()
            if spec is not None
        }
        common: AnyMesh | None = on_mesh
    else:
        assert placed_on is not None
        shared = shared_mesh(distinct, n)
        if shared is None:  # each expression keeps its own mesh, as `sharding` builds it
            common = None
            by_layout = {
                lay: named_sharding(lay.mesh_shape, lay.mesh_axes, lay.spec, placed_on)
                for lay in distinct
            }
        else:
            common = build_mesh(shared.sizes, shared.names, placed_on)
            by_layout = {
                lay: NamedSharding(common, partition_spec(fit(lay, shared) or ()))
                for lay in distinct
            }
            everything = [lay for part in parts for lay in part.layouts]
            found = _disagreement(parts, everything, shared, n)
            if found is not None:
                warnings.append(found)
    flat = _shardings(parts[0], by_layout)
    made = Plan(common, resolved, flat, placed_on, target_mesh is not None, spec, unspecified)
    if len(parts) > 1:
        made = dataclasses.replace(made, section=_section(made, parts[1], by_layout))
    return Planned(made, problems, warnings)


HOST_MEMORY_JAX = (0, 10)
"""The first JAX whose arrays keep a host memory kind on every backend eqshard is
tested on: JAX 0.8.1's CPU backend places a `"pinned_host"` array in device memory,
and its SPMD partitioner fails on steps that move one."""


def _memory_supported(memory: Sequence[str | None]) -> None:
    """Refuses host memory on a JAX that would place it silently in device memory."""
    kind = next((k for k in memory if k not in (None, "device")), None)
    if kind is not None and jax.__version_info__ < HOST_MEMORY_JAX:
        raise EqshardError(
            f'a rule holds leaves in host memory ("memory": {kind!r}), and this is JAX '
            f"{jax.__version__}, which does not keep arrays there on every backend (on "
            "CPU it places them in device memory, silently) or compile steps that move "
            'them; use JAX 0.10 or later, or leave "memory" out of the rule'
        )


def _shardings(part: _Laid, by_layout: dict[Layout, NamedSharding]) -> list[NamedSharding | None]:
    """Each leaf's sharding, in the memory kind its rule names.

    **Raises:** `EqshardError` for host memory on a JAX before `HOST_MEMORY_JAX`.
    """
    memory = part.resolved.memory or [None] * len(part.layouts)
    _memory_supported(memory)
    return [
        None
        if lay is None
        else by_layout[lay]
        if kind in (None, "device")
        else by_layout[lay].with_memory_kind(kind)
        for lay, kind in zip(part.layouts, memory)
    ]


def _section(made: Plan, part: _Laid, by_layout: dict[Layout, NamedSharding]) -> Plan:
    """The optimizer section of the plan `made`: the section's sharding where it
    gives a leaf one, its parameter's where it gives none (`"default":
    "parameter"`, or a `None` in a spec tree) and the leaf is not a problem's. A
    `(model, state)` plan's state leaves follow too: no optimizer state holds them."""
    own = _shardings(part, by_layout)
    section = part.resolved
    model = made.resolved
    count = len(own)
    flat, exprs, origins, follows = [], [], [], []
    for i, (sharding, expr) in enumerate(zip(made.flat_shardings, model.exprs)):
        mine = i < count and (own[i] is not None or i in section.failed)
        follows.append(not mine)
        flat.append(own[i] if mine else sharding)
        exprs.append(section.exprs[i] if mine else expr)
        if mine:
            origins.append(section.origins[i])
        else:
            origin = model.origins[i]
            origins.append(f"the parameter's ({origin})" if origin else "the parameter's")
    resolved = dataclasses.replace(
        model, exprs=exprs, origins=origins, failed={i for i in section.failed if i < count}
    )
    return dataclasses.replace(made, resolved=resolved, flat_shardings=flat, follows=tuple(follows))


def declared_mesh(spec: Any, n_devices: int) -> tuple[MeshShape | None, list[Problem]]:
    """The mesh a spec declares for `n_devices` (a spec file's `"mesh"`), if any."""
    declare = getattr(type(spec), "__eqshard_mesh__", None)
    if declare is None:
        return None, []
    return declare(spec, n_devices)


def _does_not_fit(resolved: Resolved, i: int, on: MeshShape) -> Problem:
    leaf, expr = resolved.leaves[i], resolved.exprs[i]
    assert expr is not None
    shape = tuple(leaf.shape)
    why = misfit(expr, shape, on)
    return Problem(resolved.where(i), f"{leaf.dtype}{list(shape)} {str(expr)!r} {why}")


def _disagreement(
    parts: list[_Laid], layouts: list[Layout | None], shared: MeshShape, n: int
) -> MeshWarning | None:
    """A warning when the shared mesh needs more axes than any one layout asks for:
    their device groupings conflict, and XLA will move data between them. `layouts`
    are the parts' layouts, one after the other."""
    leaves = [(part, i) for part in parts for i in range(len(part.layouts))]
    groups: dict[tuple[int, ...], int] = {}
    for k, lay in enumerate(layouts):
        if lay is not None:
            groups.setdefault(grouping(lay, n), k)
    most = max((len(g) for g in groups), default=1)
    if len(shared.sizes) <= most:
        return None

    def where(k: int) -> str:
        part, i = leaves[k]
        return part.where.format(part.resolved.where(i))

    def expr(k: int) -> str:
        part, i = leaves[k]
        return repr(str(part.resolved.exprs[i]))

    maximal = groupings([lay for lay in layouts if lay is not None], n)
    named = [f"{where(groups[g])} ({expr(groups[g])}) as {g}" for g in maximal if g in groups]
    first = groups[maximal[0]] if maximal and maximal[0] in groups else 0
    return MeshWarning(
        where(first),
        f"the layouts group the devices in ways that disagree: {'; '.join(named)}. They "
        f"share only the mesh {shared.sizes}, with more axes than any one of them asks "
        "for, so XLA moves data between the groupings (all-gathers and permutes rather "
        "than one all-reduce). Give them layouts that group devices alike, or pass "
        "`mesh=` to be told which do not fit it",
    )


def plan(
    model: PyTree[Any],
    spec: Spec = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    simulate: int | None = None,
    unspecified: Unspecified = "replicate",
    optimizer: Spec | None = None,
) -> Plan:
    """Resolves a spec against a model and lays out every array leaf, placing nothing.

    It works on abstract models (`eqx.filter_eval_shape`) as well as concrete ones, so
    checking a spec costs no device memory; with `simulate=`, it needs no devices.

    **Example:**

    ```python
    p = eqshard.plan(model, spec)
    p.mesh                        # Mesh('m0': 8)
    p.partition_specs.w1          # PartitionSpec(None, 'm0')

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    eqshard.plan(model, spec, mesh=mesh).partition_specs.w1   # P(None, 'model')

    big = eqshard.plan(model, spec, simulate=65536)   # abstractly: no devices needed
    big.mesh                      # AbstractMesh('m0': 65536, ...)
    ```

    **Arguments:**

    - `model`: an Equinox model or any pytree, concrete or abstract.
    - `spec`: where the expressions come from: the model's `eqshard.field`s (the
        default), a spec tree or a prefix of one, one expression, `eqshard.Rules`,
        `eqshard.FSDP`, a `PartitionSpec` tree, or a `Plan`.
    - `mesh`: the user's `jax.sharding.Mesh`; by default the mesh of `jax.set_mesh`,
        else the spec file's.
    - `devices`: else, this process's devices: a list, or a count (the first that
        many); by default all of `jax.devices()`.
    - `simulate`: else, a count of devices this process need not have: every mesh is
        then a `jax.sharding.AbstractMesh`.
    - `unspecified`: what an array leaf without an expression gets: `"replicate"` (the
        default) or `"keep"` (it stays where it is).
    - `optimizer`: how the optimizer state is laid out; by default the spec file's
        `"optimizer"` section, else each parameter's own layout.

    **Returns:**

    A `Plan`.

    **Raises:**

    - `eqshard.SpecError`: every leaf that cannot be laid out, one line each, or the
        first path where the spec's structure differs from the model's.
    - `eqshard.UsageError`: both `devices` and `simulate` are given.
    - `eqshard.EqshardError`: `devices` is neither devices nor a count this process
        has.
    - `eqshard.MeshWarning` (a warning): with no user mesh, the layouts group devices
        in ways that disagree.

    The guide "Annotations and spec trees" says more: specs, meshes, device counts,
    the optimizer section and the errors.
    """
    placed = placement(devices, simulate, what="`eqshard.plan`", was_simulated=True)
    planned = plan_faults(
        model, spec, mesh=mesh, devices=placed, unspecified=unspecified, optimizer=optimizer
    )
    if planned.problems:
        raise SpecError(planned.problems)
    warn(planned.warnings)
    return planned.plan


def as_plan(
    tree: PyTree[Any],
    spec: Spec,
    *,
    mesh: AnyMesh | None = None,
    devices: Sequence[Device] | int | None = None,
    unspecified: Unspecified = "replicate",
    optimizer: Any = None,
    args: Sequence[Any] = (),
) -> Plan:
    """Any spec as a `Plan`, the one place a spec becomes one: a `Plan` as it is; else
    (a path read) planned for `tree`, raising as `plan` does, with the model's
    `eqx.nn.State` among a step's other arguments `args` where the spec can lay it out
    (not a spec tree): `(tree, state)`, so that one mesh fits both.

    **Raises:** `EqshardError` for `mesh=` or `devices=` with a `Plan`; `SpecError`.
    """
    if isinstance(spec, Plan):
        if devices is not None or mesh is not None:
            given = "devices" if devices is not None else "mesh"
            raise EqshardError(
                f"`{given}=` is given with a `Plan`, which has its mesh already; pass one "
                "or the other"
            )
        return spec
    lays_out_state = is_resolver(spec) or isinstance(spec, (str, Expression, os.PathLike))
    if lays_out_state and not is_stateful_pair(tree):
        state = next((arg for arg in args if isinstance(arg, eqx.nn.State)), None)
        tree = tree if state is None else (tree, state)
    return plan(
        tree, spec, mesh=mesh, devices=devices, unspecified=unspecified, optimizer=optimizer
    )


def spec_tree(model: PyTree[Any], spec: Spec = FROM_FIELDS) -> PyTree[Expression | None]:
    """The spec tree of a model: its structure, with an expression per array leaf.

    **Example:**

    ```python
    tree = eqshard.spec_tree(model)   # from the eqshard.field annotations
    tree = eqx.tree_at(lambda s: s.head.weight, tree, "v d -> v* d",
                       is_leaf=lambda x: x is None)
    model = eqshard.apply(model, tree)
    ```

    **Arguments:**

    - `model`: an Equinox model or any pytree, concrete or abstract (from
        `eqx.filter_eval_shape`, with `jax.ShapeDtypeStruct` leaves).
    - `spec`: where the expressions come from, as for `eqshard.plan`; by default the
        model's `eqshard.field`s (see "Specs").

    **Returns:**

    A pytree with the model's structure, an `Expression` or `None` in each leaf's place
    (see "The tree").

    **Raises:**

    - `eqshard.SpecError`: lists every faulty leaf by dotted path and `Class.field`.

    !!! info "Specs"

        `spec` may be the `Rules` of a spec file; its `"devices"` is checked against the
        devices JAX has. It may be `eqshard.FSDP`, or an expression for every leaf. It
        may be a spec tree; its prefix is written out whole. It may be a `Plan`: its
        `expressions`, as laid out for its devices.

    !!! info "The tree"

        Each array leaf's place holds its complete `Expression`. Short forms get their
        left side from the annotation. It holds `None` where no field gives one. Every
        other leaf's place holds `None`. Since `None` is an empty subtree to JAX, pass
        `is_leaf=lambda x: x is None` to `eqx.tree_at` when replacing one.
    """
    from ._sharding import device_tuple

    if isinstance(spec, Plan):
        return spec.expressions
    source = FROM_FIELDS if spec is None else spec
    n = len(device_tuple(None))
    declared, problems = declared_mesh(source, n)  # its logical dims are laid out on it
    on = None if declared is None else abstract_mesh(declared.sizes, declared.names)
    resolved, resolving, found = resolve(model, source, Target(n, on))
    problems += resolving
    if problems:
        raise SpecError(problems)
    warn(found)
    return jax.tree_util.tree_unflatten(resolved.treedef, resolved.exprs)
