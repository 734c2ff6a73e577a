"""The step as one object: `eqshard.jit`, a drop-in for `eqx.filter_jit` whose compiled
program takes and gives the active plan's layouts.

Under a plan (`eqshard.use(plan)`, or `plan=`), each of the step's arguments is laid out
as `eqshard.apply(argument, plan)` lays out a tree built from the model
(`_derive.plan_for`). The model takes the parameters' shardings, and subtrees shaped
like it take them too. In an optimizer state they take the optimizer section's. The
model's `eqx.nn.State` takes its own layouts. An argument that holds nothing of the
model's is the batch (`Batches`). A batch leaf the data loader already placed on the
plan's devices keeps its sharding. The others take `batch=`, else the spec file's
`"batch"`, else data parallel: an expression for every leaf, or `BatchRules`, leaf by
leaf by its path within its argument (the rules' paths matched by `_paths`' one
matcher, as a file's top-level rules are). These are the compiled program's input
shardings (`jax.jit`'s `in_shardings`).

The outputs are laid out the same way, by structure; anything that holds nothing of the
model's is replicated. They are held there by a constraint at the end of the traced
step, since their structure is known only once it is traced. That constraint is the last
word on an output's layout.

One `jax.jit` is made per plan and per structure of the arguments, on the first call
that needs it. The structure is their tree, their non-array leaves, their shapes, and
the shardings of batch leaves already placed. `jax.jit` keeps its own cache beside it.
Leaves not yet placed (fresh from a constructor) are moved into the program's layouts
before the call, so the first call traces the program that later calls, given its
placed outputs, run. So a step is traced and compiled once per plan. Called under
another plan, it is traced again, for that plan. With no plan it is `eqx.filter_jit`
itself.

The body is traced on the plan's mesh as it is, as the user's own `jax.jit` traces
it, so their `jax.shard_map` over that mesh runs. On a mesh of Explicit axes
(`jax.make_mesh`'s default since JAX 0.9), where JAX refuses an operation of the body
(plain `eqx.nn` layers split Megatron-style contract a split dim with no
`out_sharding`), the body is traced again with those axes made Auto, as
`jax.sharding.auto_axes` runs a function. The step's inputs and outputs keep the
plan's shardings and axis types.

An `eqx.error_if` that fires raises `eqx.EquinoxRuntimeError`, as under
`eqx.filter_jit` (`_compat.equinox_runtime_error`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.core
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from . import _compat
from ._activations import Active, active, using
from ._annotation import Annotation, for_rank
from ._constrain import constrained
from ._derive import plan_for, plan_for_outputs
from ._errors import EqshardError, ExpressionError, SpecError
from ._expression import Expression
from ._fields import is_array_like, is_stateful_pair, leaf_name
from ._paths._closest import Guesses
from ._paths._names import name as path_name, segments
from ._plan import Plan, Planned, placing, plan as make_plan_or_raise
from ._problems import Problem, named
from ._protocol import is_resolver
from ._rules import dims_expression
from ._sharding import AnyMesh, device_count, mesh_devices, sharding
from ._specfile._model import BatchRules, Named, Rule, Rules, batch_expression
from ._specfile._read import read_path
from ._values import source_for
from ._warnings import (
    EqshardWarning,
    IndivisibleBatchWarning,
    UnusedRule,
    UnusedRuleWarning,
    unused_message,
    warn,
)

__all__ = [
    "Argument",
    "Batches",
    "Donate",
    "Step",
    "abstract_array",
    "batch_layout",
    "batch_sharding",
    "data_parallel",
    "is_built",
    "jit",
    "lay_out_arguments",
    "planned_for",
]

Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]

_DONATE: dict[str, tuple[bool, bool, bool]] = {  # donate first, donate rest, quiet
    "all": (True, True, True),
    "all-except-first": (False, True, True),
    "warn": (True, True, False),
    "warn-except-first": (False, True, False),
    "none": (False, False, False),
}

_ARRAYS = (jax.Array, np.ndarray, np.generic)  # what `eqx.is_array` holds an array


def _is_traced(x: Any) -> bool:
    """A leaf the step traces: an array, or an abstract one given to `lower`."""
    return isinstance(x, (*_ARRAYS, jax.ShapeDtypeStruct))


# -- the batch ---------------------------------------------------------------------


def data_parallel(p: Plan) -> str:
    """The default batch layout: the leading dim over the first axis of the user's
    (or the spec file's) mesh, replicated over the others; else over every device."""
    if p.mesh is None or not p.mesh_is_given:
        return "b ... -> b* ..."
    first, rest = p.mesh.axis_sizes[0], p.mesh.size // p.mesh.axis_sizes[0]
    return f"b ... -> b{first} ..." + (f" {rest}" if rest > 1 else "")


def batch_sharding(shape: tuple[int, ...], expr: str | None, p: Plan) -> NamedSharding:
    """The sharding of a batch leaf of `shape` laid out by `expr`: on the plan's
    mesh where it fits, else on its own mesh over the same devices; a scalar, or no
    expression, whole on every device.

    **Raises:** `ExpressionError` where `expr` does not lay out the leaf.
    """
    if expr is None or not shape:
        return p.replicated()
    if p.mesh is not None:
        try:
            return sharding(expr, shape, mesh=p.mesh)
        except EqshardError:
            pass
    return sharding(expr, shape, devices=p.devices)


class Batches:
    """Lays out a step's batch: by `batch=` where it is given; else a leaf already
    placed on the plan's devices keeps its sharding, and the others follow the spec
    file's `"batch"`, else `data_parallel`. A layout is one expression for every
    leaf, or `BatchRules`: each leaf by the first rule whose path matches its path
    within its argument, else by their default (`expr`; `None` under `"error"`),
    and a leaf that layout does not divide as their `indivisible` says.

    `used` is what laid out a leaf, if anything did: the expression, or the rules'
    place (`model.eqshard.json::$.batch`). `whole` names the leaves the rules left
    whole; `warnings()` gives them, and the rules that matched no leaf."""

    def __init__(self, batch: str | Expression | BatchRules | None, p: Plan) -> None:
        self.given = batch is not None
        if batch is None:  # a plan made from `Rules` (or `cost`'s spec, planned here)
            batch = p.spec.batch if isinstance(p.spec, Rules) else None
        self.rules = batch if isinstance(batch, BatchRules) else None
        default: Any = batch if self.rules is None else self.rules.default
        self.expr: str | None = (
            data_parallel(p)
            if default is None
            else "... -> * ..."
            if default == "replicate"
            else None
            if default == "error"
            else str(default)
        )
        self.plan = p
        self.devices = mesh_devices(p.mesh) if p.mesh is not None else p.devices
        self.used: str | None = None
        self.whole: list[tuple[str, str]] = []  # (where, what and by what)
        self._matched: set[int] = set()
        self._paths: list[tuple[str, ...]] = []

    def sharding(self, x: Any, path: tuple[Any, ...] = (), where: str = "the batch") -> Any:
        """The sharding of one batch leaf (`x` a concrete or abstract array, at `path`
        within its argument, `where` in messages), or the `Problem` that says why it
        cannot be laid out."""
        rule = None
        if self.rules is not None:
            found = segments(path)
            self._paths.append(found)
            rule = self.rules.rule_for(found)
            if rule is not None:
                self._matched.add(rule.index)
        placed = getattr(x, "sharding", None)
        if not self.given and self.placed(placed):
            return placed
        shape = tuple(x.shape)
        if not shape:  # a scalar is whole on every device, whatever the expression
            return self.plan.replicated()
        expr = self.expr if rule is None else str(rule.expr)
        if rule is not None and isinstance(rule.expr, Named):  # dims by name: the file's
            named = self._named(rule, rule.expr, shape, where)
            if isinstance(named, Problem):
                return named
            expr = str(named)
        if expr is None:  # the rules' "default": "error"
            assert self.rules is not None
            return Problem(
                where,
                f"no rule of {self.rules.where('$')} matches the batch leaf "
                f'{leaf_name(path)} ({_what(x)}), and its "default" is "error"; add '
                f"a rule whose path matches {leaf_name(path)!r}, or give a default",
            )
        try:
            laid = batch_sharding(shape, expr, self.plan)
        except ExpressionError as error:
            return self._refused(x, where, expr, rule, error)
        self.used = expr if self.rules is None else self.rules.where("$")
        return laid

    def _named(
        self, rule: Rule, named: Named, shape: tuple[int, ...], where: str
    ) -> Expression | Problem:
        """The expression a batch rule's dims by name give a leaf of `shape`: what the
        spec file's `dims` and `logical_axis_rules` give those dims, on the plan's mesh
        (MaxText's batch, `activation_embed_and_logits_batch activation_norm_length`)."""
        assert self.rules is not None
        place = self.rules.where(f"$.rules[{rule.index}]")
        spec = self.plan.spec
        if not isinstance(spec, Rules):
            return Problem(
                where,
                f"{place} names the batch's dims ({named.text!r}), and the plan was not made "
                "from a spec file whose dims or logical_axis_rules lay them out; plan from "
                "that file, or give the rule an expression",
            )
        annotation = for_rank(Annotation(f"{place}.dims", named.text, named.items), len(shape))
        found = dims_expression(spec, annotation, where, self.plan.mesh, noun="array")
        if found is None:
            return batch_expression("... -> * ...")
        if isinstance(found, Expression):
            return found
        if isinstance(found, Problem):
            return found
        return Problem(where, f"{place}: the spec file's mesh does not fit the devices")

    def _refused(
        self, x: Any, where: str, expr: str, rule: Rule | None, error: ExpressionError
    ) -> Any:
        """A leaf `expr` cannot lay out: whole where the rules say so and the fault is
        only that it does not divide; else the `Problem` naming it and the rule."""
        if self.rules is None:
            context = (
                f"the batch {_what(x)} cannot be laid out by {expr!r}; pass "
                "eqshard.jit(..., batch=...) an expression that splits it, or place it first"
            )
            return Problem.from_error(where, error, context)
        if rule is not None:
            place = f"$.rules[{rule.index}]"
        else:
            place = "$" if self.rules.default is None else "$.default"
        by = f"{self.rules.where(place)} ({expr!r})"
        if place == "$":
            by = f"data parallel, the default of {by}"
        n = self._count()
        if not self._indivisible(tuple(x.shape), expr, n):
            context = (
                f"the batch {_what(x)} cannot be laid out by {by}; give it a rule that fits it"
            )
            return Problem.from_error(where, error, context)
        if self.rules.indivisible == "replicate":
            short = "data parallel" if place == "$" else f"{self.rules.section}{place[1:]}"
            self.whole.append((where, f"{_what(x)} by {short} ({expr!r})"))
            return self.plan.replicated()
        context = (
            f"the batch {_what(x)} is laid out by {by}, which does not divide it over {n} "
            f'devices; set "indivisible": "replicate" in {self.rules.where("$")} to leave '
            "such a leaf whole, or give it a rule that divides it (or '... -> * ...')"
        )
        return Problem.from_error(where, error, context)

    def _count(self) -> int:
        p = self.plan
        return device_count(p.devices) if p.devices is not None else (p.mesh.size if p.mesh else 1)

    def _indivisible(self, shape: tuple[int, ...], expr: str, n: int) -> bool:
        """Whether `expr` fails on `shape` only because its sizes do not divide: it
        lays out the same rank with every size `n` times larger, which every count of
        an expression over `n` devices divides."""
        try:
            batch_sharding(tuple(size * n for size in shape), expr, self.plan)
        except ExpressionError:
            return False
        return True

    def warnings(self) -> list[EqshardWarning]:
        """The leaves the rules left whole, and the rules that matched no leaf (with
        the closest rule path that matches some: a typo's fix)."""
        if self.rules is None:
            return []
        found: list[EqshardWarning] = []
        if self.whole:
            found.append(IndivisibleBatchWarning(self.rules.where("$"), self.whole))
        unused = [rule for rule in self.rules.rules if rule.index not in self._matched]
        if unused and self._paths:
            guesses = Guesses(self._paths)
            entries = []
            for rule in unused:
                message = unused_message(rule.path, "the batch")
                close = guesses.closest(rule.path)
                if not close:
                    entries.append(UnusedRule(rule.index, rule.path, message))
                    continue
                best, at = close[0]
                leaves = tuple(dict.fromkeys(path_name(self._paths[i]) or "''" for i in at))
                message += f"; did you mean {best!r}, which matches {named(leaves)}?"
                suggestions = tuple(text for text, _ in close)
                entries.append(UnusedRule(rule.index, rule.path, message, suggestions, leaves))
            found.append(
                UnusedRuleWarning(self.rules.source, entries, tree="the batch", section="$.batch")
            )
        return found

    def placed(self, placed: Any) -> bool:
        """Whether `placed` (a leaf's sharding) lays it out on the plan's devices,
        in the plan's order, as one compiled program can take it with the plan's."""
        if not isinstance(placed, NamedSharding) or not isinstance(placed.mesh, Mesh):
            return False
        return isinstance(self.devices, tuple) and tuple(placed.mesh.devices.flat) == self.devices


def batch_layout(batch: Any) -> str | BatchRules | None:
    """`batch=` as `eqshard.jit` and `eqshard.cost` take it, checked: a complete
    expression (as text), `BatchRules`, or `None`.

    **Raises:** `ExpressionError`, with a caret, for a malformed or short
    expression; `EqshardError` for anything else.
    """
    if batch is None or isinstance(batch, BatchRules):
        return batch
    if not isinstance(batch, (str, Expression)):
        raise EqshardError(
            "`batch=` is a complete expression such as 'b ... -> b* ...', or "
            f"`eqshard.BatchRules` (rules over the batch's paths), not {type(batch).__name__}"
        )
    return str(batch_expression(batch))


def _what(x: Any) -> str:
    """A leaf's dtype and shape, as messages give them: `float32[3, 2]`."""
    return f"{np.dtype(x.dtype).name}{list(x.shape)}"


# -- the arguments -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Argument:
    """How one argument of a step is laid out.

    - `kind`: `"model"` (the plan's model, or part of a `(model, state)` plan's),
        `"built"` (built from the model: an optimizer state, gradients, the model's
        `eqx.nn.State`), or `"batch"`.
    - `plan`: for the model and what is built from it, the argument's own plan
        (`Plan.abstract` its laid-out leaves); `None` for the batch.
    - `shardings`: one per leaf of the argument (`jax.tree_util.tree_leaves`),
        `None` for a leaf that is not an array or that the plan keeps where it is.
    """

    kind: str
    plan: Plan | None
    shardings: list[Any]


def is_built(planned: Planned) -> bool:
    """Whether some leaf of a step's argument took a parameter's or the state's
    layout by structure (at its place in a subtree shaped like the model, with its
    shape): an optimizer state, not a batch."""
    return not planned.problems and planned.matched > 0


def _argument(
    value: Any, name: str, p: Plan, batches: Batches, first: bool
) -> tuple[Argument, list[Problem]]:
    """How one argument is laid out, with the problems found (see `Argument`)."""
    leaves = jax.tree_util.tree_leaves(value)
    planned = plan_for(value, p)
    is_state = isinstance(value, eqx.nn.State)
    if (
        is_state
        or (planned.matched > 0 and not planned.problems)
        or (first and _is_model(value, p))
    ):
        if planned.problems:
            return Argument("built", None, [None] * len(leaves)), [
                dataclasses.replace(problem, where=f"{name}: {problem.where}")
                for problem in planned.problems
            ]
        kind = "model" if _is_model(value, p) else "built"
        return Argument(kind, planned.plan, list(planned.plan.flat_shardings)), []
    problems: list[Problem] = []
    shardings: list[Any] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        if not is_array_like(leaf):
            shardings.append(None)
            continue
        found = batches.sharding(leaf, path, f"{name}{jax.tree_util.keystr(path)}")
        if isinstance(found, Problem):
            problems.append(found)
            found = None
        shardings.append(found)
    return Argument("batch", None, shardings), problems


def _is_model(value: Any, p: Plan) -> bool:
    """Whether `value` is the plan's model, or the model of a `(model, state)` plan."""
    model = p.resolved.model
    treedef = jax.tree_util.tree_structure(value)
    if treedef == p.resolved.treedef:
        return True
    return is_stateful_pair(model) and treedef == jax.tree_util.tree_structure(model[0])


def lay_out_arguments(
    p: Plan, arguments: Sequence[tuple[str, Any]], batch: str | BatchRules | None = None
) -> tuple[list[Argument], Batches]:
    """Each of a step's arguments laid out by the plan (see the module's notes), the
    first as the model where it has the model's structure; warns of batch leaves
    that batch rules left whole, and of batch rules that matched no leaf.

    **Arguments:** `p`, the plan; `arguments`, `(name, value)` pairs in order;
    `batch`, the batch's expression or rules, if given.

    **Returns:** an `Argument` for each, and the `Batches` that laid out the batch.

    **Raises:** `SpecError` naming each argument that the plan cannot lay out: a
    model or optimizer state whose shapes differ from the plan's, or a batch leaf
    the batch's layout cannot split.
    """
    batches = Batches(batch, p)
    laid: list[Argument] = []
    problems: list[Problem] = []
    for i, (name, value) in enumerate(arguments):
        argument, found = _argument(value, name, p, batches, i == 0)
        laid.append(argument)
        problems += found
    if not problems and all(a.kind == "batch" for a in laid) and arguments:
        problems.append(
            Problem(
                "the step's arguments",
                "none is the plan's model or built from it (no subtree has the model's "
                "structure and shapes); lay the step out by the plan of the model it takes",
            )
        )
    if problems:
        raise SpecError(problems, "the step's arguments cannot be laid out by the plan")
    warn(batches.warnings())
    return laid, batches


def planned_for(model: Any, args: Sequence[Any], spec: Any) -> Any:
    """What a spec is planned for, for a step called as `step(model, *args)`:
    `(model, state)` where the model's `eqx.nn.State` is among `args`, so that one
    mesh fits both; else the model. A spec tree, which has a place for the model's
    leaves only, is planned for the model (the plan then replicates the state)."""
    spec = read_path(spec)
    if is_stateful_pair(model) or not (is_resolver(spec) or isinstance(spec, (str, Expression))):
        return model
    state = next((arg for arg in args if isinstance(arg, eqx.nn.State)), None)
    return model if state is None else (model, state)


def _outputs(out: Any, p: Plan, name: str) -> list[Any]:
    """The sharding of each leaf of a step's output, by structure (see the module's
    notes): anything that holds nothing of the model's, replicated."""
    planned = plan_for_outputs(out, p)
    if planned.problems and planned.matched:
        raise SpecError(
            [dataclasses.replace(q, where=f"output {q.where}") for q in planned.problems],
            f"the step {name} returns a tree built from the model that the plan cannot lay out",
        )
    return list(planned.plan.flat_shardings)


# -- the step ----------------------------------------------------------------------


@jax.tree_util.register_static
class _Static:
    """A step's non-array outputs, carried through `jax.jit` in the output's tree."""

    def __init__(self, value: Any) -> None:
        self.value = value


@functools.cache
def _explicit_refusals() -> tuple[type[Exception], ...]:
    """JAX's error for an operation its Explicit axes cannot type: the body is then
    traced again on Auto axes. Where this JAX keeps it elsewhere, no error: every body
    on an Explicit mesh runs on Auto axes, as before eqshard ran it on Explicit ones."""
    try:
        return (_compat.sharding_type_error(),)
    except EqshardError as error:
        _compat.warn_once(error, "runs every step's body on Auto axes")
        return ()


def _auto(mesh: AnyMesh | None) -> Any:
    """The abstract mesh with `mesh`'s Explicit axes made Auto, for the step's body;
    `None` where it has none."""
    if mesh is None:
        return None
    explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit]
    if not explicit:
        return None
    return mesh.abstract_mesh.update_axis_types(dict.fromkeys(explicit, AxisType.Auto))


@dataclasses.dataclass
class _Program:
    """One `jax.jit` of a step, for one plan and one structure of its arguments."""

    jitted: Any
    shardings: list[Any]  # one per traced leaf: the program's input shardings
    donated: list[int]  # positions, among the traced leaves, of those donated
    kept: list[int]
    arguments: list[Argument]
    batches: Batches


@dataclasses.dataclass
class _Layout:
    """For one plan and one structure of the arguments: how they are laid out, and
    the program for each placement of the batch leaves already placed."""

    plan: Plan
    active: Active
    treedef: Any
    static: tuple[Any, ...]
    batch: list[int]  # positions, among the traced leaves, of the batch's
    programs: dict[tuple[Any, ...], _Program]
    arguments: list[Argument]  # as the first call's batch placed them
    batches: Batches
    auto: bool = False  # the body runs with the mesh's Explicit axes made Auto


class Step:
    """A step compiled by `eqshard.jit`: called as the function it wraps.

    **Attributes:**

    - `__wrapped__`: the function.
    - `donate`: as given to `eqshard.jit`.
    - `plan`: the plan given to `eqshard.jit`, or `None`: the active one.
    - `batch`: the batch's expression, its `BatchRules`, or `None`.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        donate: Donate = "none",
        plan: Plan | None = None,
        batch: str | Expression | BatchRules | None = None,
    ) -> None:
        if not callable(fn):
            raise EqshardError(f"`eqshard.jit` takes a function, not {type(fn).__name__}")
        if donate not in _DONATE:
            raise EqshardError(
                f"`donate={donate!r}` is not one of eqx.filter_jit's: "
                + ", ".join(map(repr, _DONATE))
            )
        if plan is not None and not isinstance(plan, Plan):
            raise EqshardError(
                f"`plan=` takes an `eqshard.Plan` (`eqshard.plan(model, spec)`), not "
                f"{type(plan).__name__}; for a spec, make its plan first"
            )
        functools.update_wrapper(self, fn)
        self.__wrapped__ = fn
        self.donate: Donate = donate
        self.donate_first, self.donate_rest, self._quiet = _DONATE[donate]
        self.plan = plan
        self.batch = batch_layout(batch)
        self._plain = eqx.filter_jit(fn, donate=donate)
        try:
            self._signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin, or a callable with no signature
            self._signature = None
        self._layouts: dict[Any, _Layout] = {}

    def __repr__(self) -> str:
        name = getattr(self.__wrapped__, "__qualname__", repr(self.__wrapped__))
        return f"eqshard.jit({name}, donate={self.donate!r})"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return functools.partial(self, instance)

    def __reduce__(self) -> Any:  # to a worker process: a plan holds this one's devices
        return (_rebuilt, (self.__wrapped__, self.donate, self.batch))

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._call(args, kwargs)
        except eqx.EquinoxRuntimeError as error:
            error.__traceback__ = None  # as eqx.filter_jit: the message holds the stacks
            raise

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        spec = self.plan if self.plan is not None else _spec(active())
        if spec is None:
            return self._plain(*args, **kwargs)
        if isinstance(spec, Plan) and isinstance(spec.devices, int):
            spec = placing(spec, "`eqshard.jit`")  # made for a count: its first n devices
        # As in eqx.filter_jit's own call: `eqx.error_if` records the stack it is traced
        # under up to the frame that holds this local, for its error's message.
        __equinox_jit_id__ = os.urandom(16)
        program, layout, traced = self._program(spec, args, kwargs, lowering=False)
        _move(traced, layout.batch, program.shardings)
        donated = [traced[i] for i in program.donated]
        kept = [traced[i] for i in program.kept]
        try:
            with _compat.quiet_callback_failures(), warnings.catch_warnings():
                if self._quiet:
                    warnings.filterwarnings(
                        "ignore", message="Some donated buffers were not usable"
                    )
                (out, static), program = self._traced(
                    layout, program, lambda p: p.jitted(donated, kept), args, kwargs, traced
                )
            if out and isinstance(out[0], jax.Array) and not isinstance(out[0], jax.core.Tracer):
                # As eqx.filter_jit waits for each call: runs that pile up can deadlock
                # XLA:CPU's collectives across simulated devices. An `eqx.error_if`
                # that fired is raised here.
                out[0].block_until_ready()
        except (ValueError, jax.errors.JaxRuntimeError) as error:
            runtime = _compat.equinox_runtime_error(error, __equinox_jit_id__)
            if runtime is not None:
                raise runtime from None  # JAX's long message says nothing more
            if isinstance(error, ValueError) and "does not match the sharding" in str(error):
                raise self._misplaced(program, args, kwargs, traced) from None
            raise
        return _combined(out, static)

    def lower(self, /, *args: Any, **kwargs: Any) -> Lowered:
        """The step lowered for the active plan (or `plan=`), over concrete or
        abstract arguments (`jax.ShapeDtypeStruct`s, such as `eqx.filter_eval_shape`
        gives), without running it: `.compile()` it, read its text, or its
        `cost_analysis()` and `memory_analysis()`.

        **Raises:** `eqshard.EqshardError` when no plan is active and none was given.
        """
        spec = self.plan if self.plan is not None else _spec(active())
        if spec is None:
            raise EqshardError(
                "`lower` lays the step out by a plan, and none is active: call it inside "
                "`with eqshard.use(plan):`, or make the step with `eqshard.jit(fn, plan=plan)`"
            )
        program, layout, traced = self._program(spec, args, kwargs, lowering=True)
        abstract = [_abstract(x, s) for x, s in zip(traced, program.shardings)]
        donated = [abstract[i] for i in program.donated]
        kept = [abstract[i] for i in program.kept]
        lowered, program = self._traced(
            layout, program, lambda p: p.jitted.lower(donated, kept), args, kwargs, traced
        )
        return Lowered(lowered, program, self, abstract)

    # -- internals

    def _bound(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if kwargs and self._signature is not None:
            bound = self._signature.bind(*args, **kwargs)
            return bound.args, bound.kwargs
        return args, kwargs

    def _program(
        self, spec: Plan | Active, args: tuple[Any, ...], kwargs: dict[str, Any], lowering: bool
    ) -> tuple[_Program, _Layout, list[Any]]:
        args, kwargs = self._bound(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        is_traced = _is_traced if lowering else (lambda x: isinstance(x, _ARRAYS))
        traced = [x for x in leaves if is_traced(x)]
        static = tuple(_TRACED if is_traced(x) else x for x in leaves)
        key = (spec, treedef, static, tuple(np.shape(x) for x in traced))
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= _CACHED:  # static arguments that change every call
                self._layouts.pop(next(iter(self._layouts)))
            layout = self._layouts[key] = self._layout(spec, args, kwargs, treedef, static)
        placed = tuple(_placed(traced[i]) for i in layout.batch)
        program = layout.programs.get(placed)
        if program is None:
            program = layout.programs[placed] = self._compile(layout, args, kwargs, traced)
        return program, layout, traced

    def _layout(
        self, spec: Plan | Active, args: Any, kwargs: Any, treedef: Any, static: Any
    ) -> _Layout:
        if isinstance(spec, Plan):
            p, on = spec, _active_of(spec)
        elif spec.plan is not None:
            p, on = spec.plan, spec
        else:  # rules alone: planned for the step's first argument, the model
            if not args:
                raise EqshardError(
                    "`eqshard.use(rules)` lays a step out by a plan of its first argument, the "
                    "model, and this step was called with none; pass `eqshard.use(plan)`"
                )
            model = jax.tree_util.tree_map(abstract_array, args[0])
            rest = jax.tree_util.tree_map(abstract_array, args[1:])
            p = make_plan_or_raise(
                planned_for(model, rest, spec.rules),
                spec.rules,
                mesh=spec.mesh,
                devices=spec.devices,
            )
            on = dataclasses.replace(spec, plan=p)
        arguments, batches = self._arguments(p, args, kwargs)
        kinds = [a.kind for a in arguments for _ in a.shardings]  # per leaf of (args, kwargs)
        traced_kinds = [kind for kind, x in zip(kinds, static) if x is _TRACED]
        batch = [k for k, kind in enumerate(traced_kinds) if kind == "batch"]
        auto = not _explicit_refusals()  # see `_traced`
        return _Layout(p, on, treedef, static, batch, {}, arguments, batches, auto)

    def _arguments(self, p: Plan, args: Any, kwargs: Any) -> tuple[list[Argument], Batches]:
        names = self._names(len(args))
        # in the order `jax.tree_util.tree_flatten((args, kwargs))` visits them
        pairs = [*zip(names, args), *((f"`{k}`", kwargs[k]) for k in sorted(kwargs))]
        return lay_out_arguments(p, pairs, self.batch)

    def _names(self, count: int) -> list[str]:
        """The positional arguments' names, as messages give them."""
        params = [] if self._signature is None else list(self._signature.parameters.values())
        names = []
        for i in range(count):
            if i < len(params) and params[i].kind in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            ):
                names.append(f"`{params[i].name}`")
            else:
                names.append(f"argument {i}")
        return names

    def _compile(self, layout: _Layout, args: Any, kwargs: Any, traced: list[Any]) -> _Program:
        if layout.programs:  # the batch is placed otherwise than at the first call
            arguments, batches = self._arguments(layout.plan, args, kwargs)
        else:
            arguments, batches = layout.arguments, layout.batches
        flat = [s for argument in arguments for s in argument.shardings]
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        assert len(flat) == len(leaves)
        shardings = [s for s, x in zip(flat, layout.static) if x is _TRACED]
        first = len(jax.tree_util.tree_leaves(args[0])) if args else 0
        first_traced = sum(1 for x in layout.static[:first] if x is _TRACED)
        donate = [
            (self.donate_first if k < first_traced else self.donate_rest)
            for k in range(len(traced))
        ]
        donated = [k for k, d in enumerate(donate) if d]
        kept = [k for k, d in enumerate(donate) if not d]
        run = _traced_body(self.__wrapped__, layout, donated, kept)
        jitted = jax.jit(
            run,
            in_shardings=([shardings[k] for k in donated], [shardings[k] for k in kept]),
            donate_argnums=(0,) if donated else (),
        )
        return _Program(jitted, shardings, donated, kept, arguments, batches)

    def _traced(
        self,
        layout: _Layout,
        program: _Program,
        attempt: Callable[[_Program], Any],
        args: Any,
        kwargs: Any,
        traced: list[Any],
    ) -> tuple[Any, _Program]:
        """`attempt(program)` (a call or a lowering, which traces the body first), with
        the body on the plan's Explicit axes as the user's own `jax.jit` runs it; where
        JAX refuses an operation there (a matmul that contracts a split dim with no
        `out_sharding`, as plain `eqx.nn` layers split Megatron-style do), once more with
        the body on Auto axes, as `jax.sharding.auto_axes` runs it. The first trace
        failed before anything ran, so nothing was donated. Where the body ran on Auto
        axes already, or the mesh has no Explicit axes, JAX's error is the user's."""
        try:
            return attempt(program), program
        except _explicit_refusals() as error:
            if layout.auto or _auto(layout.plan.mesh) is None:
                raise
            refused = error
        layout.auto = True
        layout.programs.clear()
        args, kwargs = self._bound(args, kwargs)
        placed = tuple(_placed(traced[i]) for i in layout.batch)
        program = layout.programs[placed] = self._compile(layout, args, kwargs, traced)
        try:
            return attempt(program), program
        except Exception as error:
            error.add_note(
                "eqshard traced the step's body on Auto axes since, on the plan's Explicit "
                f"axes, JAX refused it: {refused}"
            )
            raise

    def _misplaced(
        self, program: _Program, args: Any, kwargs: Any, traced: list[Any]
    ) -> EqshardError:
        """The error for arguments placed otherwise than the plan lays them out."""
        args, kwargs = self._bound(args, kwargs)
        paths = [
            path
            for (path, leaf) in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
            if isinstance(leaf, _ARRAYS)
        ]
        problems = []
        for path, x, want in zip(paths, traced, program.shardings):
            have = getattr(x, "sharding", None)
            if want is None or have is None or have.is_equivalent_to(want, np.ndim(x)):
                continue
            problems.append(
                Problem(
                    f"the step's {_argument_name(path, self._names(len(args)))}",
                    f"is placed as {_brief(have)}, and the plan lays it out as "
                    f"{_brief(want)}; place the tree with `eqshard.apply(tree, plan)` "
                    "once, before the loop",
                )
            )
        if not problems:  # not reached: JAX named a mismatch
            problems.append(Problem("the step's arguments", "placed otherwise than the plan"))
        name = getattr(self.__wrapped__, "__qualname__", "the step")
        return SpecError(problems, f"{name} is called with arrays placed otherwise than its plan")


_TRACED = object()  # a traced leaf's place among the static ones
_CACHED = 256  # layouts kept per step, the oldest dropped first


def _rebuilt(fn: Any, donate: Donate, batch: str | BatchRules | None) -> Step:
    return Step(fn, donate=donate, batch=batch)


def _spec(found: Active | None) -> Plan | Active | None:
    """What lays a step out: the active plan, else the active rules (`Active`)."""
    if found is None:
        return None
    return found.plan if found.plan is not None else found


def _active_of(p: Plan) -> Active:
    rules = p.spec if isinstance(p.spec, Rules) else None
    return Active(rules, p.mesh if p.mesh_is_given else None, p.devices, p)


def _move(traced: list[Any], batch: list[int], shardings: list[Any]) -> None:
    """Each traced leaf that `jax.jit` would move, moved into the program's layout
    first, in one `jax.device_put`: a leaf not yet placed (a NumPy array, or a JAX
    array left uncommitted, as a model fresh from its constructor is), and a batch leaf
    committed to other devices or another layout (a loader's
    `jax.device_put(x, jax.devices()[0])`, or any layout under `batch=`): the batch is
    new each step, so moving it is the step's own work.

    So the first call of a step traces and compiles the program that every later call,
    given the first's placed outputs, runs: the arrays' abstract values (which carry
    their mesh) are the same. A leaf of the model committed elsewhere is left for
    `jax.jit` to refuse, and `Step._misplaced` to name."""
    moved: list[int] = []
    batch_leaves = set(batch)
    for i, (x, target) in enumerate(zip(traced, shardings)):
        if target is None:
            continue
        have = getattr(x, "sharding", None)
        if have is None:  # NumPy: not placed
            moved.append(i)
        elif have is target or have == target or have.is_equivalent_to(target, np.ndim(x)):
            continue
        elif i in batch_leaves or not getattr(x, "committed", True):
            moved.append(i)
    if moved:
        targets = [shardings[i] for i in moved]
        sources = [source_for(traced[i], target) for i, target in zip(moved, targets)]
        placed = jax.device_put(sources, targets)  # as `eqshard.apply` places them
        for i, x in zip(moved, placed):
            traced[i] = x


def _placed(x: Any) -> Any:
    """A batch leaf's own sharding, where it is a `NamedSharding` (the data loader's
    layout, which it may keep); else `None`."""
    s = getattr(x, "sharding", None)
    return s if isinstance(s, NamedSharding) else None


def abstract_array(x: Any) -> Any:
    """An array leaf as a `jax.ShapeDtypeStruct`, keeping its sharding where it has
    one; anything else as it is."""
    if isinstance(x, (*_ARRAYS, jax.ShapeDtypeStruct)):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
    return x


def _abstract(x: Any, target: Any) -> Any:
    """A traced leaf as `lower` hands it to `jax.jit`: abstract, with the program's
    input sharding."""
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=target)


def _brief(s: Any) -> str:
    if isinstance(s, NamedSharding):  # written the same on every JAX
        spec = ", ".join(map(repr, s.spec))
        return f"P({spec}) on {dict(zip(s.mesh.axis_names, s.mesh.axis_sizes))}"
    return type(s).__name__


def _argument_name(path: Any, names: list[str]) -> str:
    """`params` `.layers[0].weight` for a key path into `(args, kwargs)`."""
    if len(path) >= 2 and getattr(path[0], "idx", None) == 0:
        i = getattr(path[1], "idx", 0)
        head = names[i] if i < len(names) else f"argument {i}"
        return f"{head} {jax.tree_util.keystr(tuple(path[2:]))}".rstrip()
    return jax.tree_util.keystr(tuple(path[1:]))


def _traced_body(fn: Callable[..., Any], layout: _Layout, donated: list[int], kept: list[int]):
    """The function `jax.jit` traces: the step over its arguments rebuilt, with the
    plan active; its outputs held to the plan's layouts."""
    p = layout.plan
    auto = _auto(p.mesh) if layout.auto else None
    name = getattr(fn, "__qualname__", type(fn).__name__)

    def run(donated_leaves: list[Any], kept_leaves: list[Any]) -> tuple[list[Any], _Static]:
        traced: list[Any] = [None] * (len(donated) + len(kept))
        for k, v in zip(donated, donated_leaves):
            traced[k] = v
        for k, v in zip(kept, kept_leaves):
            traced[k] = v
        values = iter(traced)
        leaves = [next(values) if x is _TRACED else x for x in layout.static]
        args, kwargs = jax.tree_util.tree_unflatten(layout.treedef, leaves)
        with using(layout.active):
            if auto is None:
                out = fn(*args, **kwargs)
            else:
                with jax.sharding.use_abstract_mesh(auto):
                    args, kwargs = _to_auto((args, kwargs))
                    out = fn(*args, **kwargs)
            targets = _outputs(out, p, name)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        arrays = [k for k, x in enumerate(out_leaves) if isinstance(x, _ARRAYS)]
        held = [k for k in arrays if targets[k] is not None]
        for k, value in zip(
            held, constrained([out_leaves[k] for k in held], [targets[k] for k in held])
        ):
            out_leaves[k] = value
        static = [None if isinstance(x, _ARRAYS) else x for x in out_leaves]
        return [out_leaves[k] for k in arrays], _Static((out_tree, static, arrays))

    run.__name__ = getattr(fn, "__name__", "step")
    run.__qualname__ = name
    return run


def _to_auto(tree: Any) -> Any:
    """`tree`'s arrays as values of the Auto abstract mesh in effect (as
    `jax.sharding.auto_axes` converts its inputs): their layouts stay as they are."""
    return jax.tree_util.tree_map(
        lambda x: jax.sharding.reshard(x, PartitionSpec()) if isinstance(x, jax.Array) else x,
        tree,
    )


def _combined(out: list[Any], static: _Static) -> Any:
    out_tree, leaves, arrays = static.value
    leaves = list(leaves)
    for k, value in zip(arrays, out):
        leaves[k] = value
    return jax.tree_util.tree_unflatten(out_tree, leaves)


class Lowered:
    """A step lowered by `Step.lower`: `jax.stages.Lowered`'s methods, and
    `compile()`, which gives a `Compiled` called as the step is."""

    def __init__(self, lowered: Any, program: _Program, step: Step, abstract: list[Any]) -> None:
        self.lowered = lowered
        self.program = program
        self.abstract = abstract  # the traced leaves, abstract, with their input shardings
        self._step = step

    @property
    def in_shardings(self) -> list[Any]:
        """The program's input sharding for each traced leaf of the arguments."""
        return list(self.program.shardings)

    @property
    def arguments(self) -> list[Argument]:
        """How each argument is laid out (see `Argument`)."""
        return list(self.program.arguments)

    @property
    def batch(self) -> str | None:
        """The expression that laid out a batch leaf, or the place of the batch rules
        that did (`model.eqshard.json::$.batch`); `None` where none was laid out."""
        return self.program.batches.used

    def __getattr__(self, name: str) -> Any:  # `cost_analysis`, `compiler_ir`, ...
        return getattr(self.lowered, name)

    def as_text(self, *args: Any, **kwargs: Any) -> str:
        return self.lowered.as_text(*args, **kwargs)

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Compiled:
        """Compiles it; `compiler_options` as `jax.stages.Lowered.compile` takes them
        (XLA's debug options by name, for this compile only)."""
        return Compiled(self.lowered.compile(compiler_options), self.program, self._step)


class Compiled:
    """A compiled step: called as the step is, with arrays of the shapes and
    placements it was lowered for (its non-array arguments are those it was
    lowered with, whatever a call passes, as for `eqx.filter_jit`'s compiled
    steps), with `jax.stages.Compiled`'s `as_text()`, `cost_analysis()` and
    `memory_analysis()`."""

    def __init__(self, compiled: Any, program: _Program, step: Step) -> None:
        self.compiled = compiled
        self.program = program
        self._step = step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._step._bound(args, kwargs)
        traced = [x for x in jax.tree_util.tree_leaves((args, kwargs)) if isinstance(x, _ARRAYS)]
        donated = [traced[i] for i in self.program.donated]
        kept = [traced[i] for i in self.program.kept]
        try:
            out, static = self.compiled(donated, kept)
        except ValueError as error:  # JAX's words for arguments placed otherwise
            if "disagree with the shardings of arguments" not in str(error):
                raise
            raise self._step._misplaced(self.program, args, kwargs, traced) from None
        return _combined(out, static)


def jit(
    fn: Callable[..., Any] | None = None,
    *,
    donate: Donate = "none",
    plan: Plan | None = None,
    batch: str | Expression | BatchRules | None = None,
) -> Any:
    """`eqx.filter_jit`, with the active plan's layouts pinned on the step's inputs and
    outputs.

    **Example:**

    ```python
    @eqshard.jit(donate="all")
    def step(model, opt_state, batch):
        grads = eqx.filter_grad(loss)(model, batch)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state

    with eqshard.use(plan):                 # any plan: fields, a spec tree, rules
        model, opt_state = eqshard.apply((model, opt_state), plan)
        for batch in batches:
            model, opt_state = step(model, opt_state, batch)
    ```

    **Arguments:**

    - `fn`: the step; as a decorator, leave it out.
    - `donate`: as for `eqx.filter_jit`: `"all"`, `"all-except-first"`, `"warn"`,
        `"warn-except-first"` or `"none"` (the default).
    - `plan`: the plan to lay the step out by, always; by default the active one (see
        "Which plan").
    - `batch`: the batch's layout, for every batch leaf, placed or not: a complete
        expression such as `"b ... -> b* ..."`, or `eqshard.BatchRules`, leaf by leaf.

    **Returns:**

    The step (a `eqshard.results.Step`), called as `fn` is; `step.lower(*args)` lowers it for
    the active plan over concrete or abstract arguments.

    **Raises:**

    - `eqshard.EqshardError`: a `donate` eqx.filter_jit does not know, a `plan` that is
        not a `Plan`, or a `batch` that is neither (a malformed one with a caret).
    - `eqshard.SpecError`, when called: an argument the plan cannot lay out, or one
        already placed otherwise (see "Errors").

    !!! info "Which plan"

        By default the step is laid out by the plan of `eqshard.use(plan)` where it is
        called. Under `eqshard.use(rules)`, it is a plan of its first argument by those
        rules. With no plan active, the step is `eqx.filter_jit`.

    !!! info "How the arguments and outputs are laid out"

        Under a plan, each array argument and each array output is laid out by
        structure. That is how `eqshard.apply(tree, plan)` lays out a tree built from
        the model:

        - the model, and subtrees shaped like it, take the parameters' shardings;
        - an optimizer state takes the optimizer section's (ZeRO);
        - the model's `eqx.nn.State` takes its own;
        - an argument that holds nothing of the model's is the batch (see "The batch");
        - any other output is replicated.

        These are the compiled program's input and output shardings. So the parameters
        leave the step as they came in: ZeRO-1 pays its all-gather, and FSDP stays
        split. `eqshard.cost`, `eqshard check --step`, `suggest`, `diff` and
        `eqshard.testing` compile this same program for each spec.

    !!! info "The batch"

        A batch leaf already placed on the plan's devices keeps its sharding. The others
        take `batch`, else the spec file's `"batch"`, else data parallel. A batch
        committed elsewhere is moved there. Batch rules lay out each leaf by its path
        within its argument (`nodes` for `graph.nodes`), and warn of the leaves they
        leave whole (`eqshard.IndivisibleBatchWarning`).

    !!! info "Tracing"

        The step is traced and compiled once per plan, however the first call's
        arguments are placed. The plan is active while it is traced, so named
        activations and `eqshard.constrain(tree)` follow it. The body runs on the
        plan's mesh as it is, so the user's own `jax.shard_map` over it runs. Where JAX
        refuses an operation on Explicit axes (a matmul contracting a split dim with no
        `out_sharding`), the body is traced once more with them Auto, as under
        `jax.sharding.auto_axes`. The outputs keep the plan's axis types.

    !!! info "Runtime errors"

        An `eqx.error_if` that fires raises `eqx.EquinoxRuntimeError` with the
        user's message, as under `eqx.filter_jit`.

    !!! info "Errors"

        When the step is called, `eqshard.SpecError` names each argument the plan cannot
        lay out: shapes that differ from the plan's model, or a batch leaf the batch's
        layout cannot split (naming the leaf, its shape and the rule). It also names each argument already placed otherwise
        than the plan lays it out.
    """
    if fn is None:
        return functools.partial(jit, donate=donate, plan=plan, batch=batch)
    return Step(fn, donate=donate, plan=plan, batch=batch)
