"""A step's arguments laid out by structure, beside the plan's derivation.

Under a plan, each argument of a step (`eqshard.jit`, `eqshard.cost`) is laid out as
`eqshard.apply(argument, plan)` lays out a tree built from the model
(`_derive.derived_plan`). The model takes the parameters' shardings, and subtrees
shaped like it take them too. In an optimizer state they take the optimizer
section's. The model's `eqx.nn.State` takes its own layouts. An argument that holds
nothing of the model's is the batch (`Batches`). A batch leaf the data loader already
placed on the plan's devices keeps its sharding. The others take `batch=`, else the
spec file's `"batch"`, else data parallel: an expression for every leaf, or
`BatchRules`, leaf by leaf by its path within its argument (the rules' paths matched
by `_paths`' one matcher, as a file's top-level rules are).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ._annotation import Annotation, for_rank
from ._derive import derived_plan
from ._errors import EqshardError, ExpressionError, SpecError
from ._expression import Expression
from ._fields import is_array_like, is_stateful_pair, leaf_name
from ._paths._closest import Guesses
from ._paths._names import name as path_name, segments
from ._plan import Plan, Planned
from ._problems import Problem, named
from ._rules import dims_expression
from ._sharding import as_placement, device_count, mesh_devices, placed_sharding, sharding
from ._specfile._model import BatchRules, Named, Rule, Rules, batch_expression
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
    "abstract_array",
    "batch_layout",
    "batch_sharding",
    "data_parallel",
    "is_built",
    "lay_out_arguments",
]

_ARRAYS = (jax.Array, np.ndarray, np.generic)  # what `eqx.is_array` holds an array


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
    placed = None if p.devices is None else as_placement(p.devices)  # a count: abstract
    return placed_sharding(expr, shape, None, placed)


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
    planned = derived_plan(value, p)
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


def abstract_array(x: Any) -> Any:
    """An array leaf as a `jax.ShapeDtypeStruct`, keeping its sharding where it has
    one; anything else as it is."""
    if isinstance(x, (*_ARRAYS, jax.ShapeDtypeStruct)):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
    return x
