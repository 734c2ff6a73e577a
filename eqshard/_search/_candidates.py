"""The candidates of `eqshard suggest`: every strategy on every factorization of the
device count into a `("data", d) x (axis, m)` mesh, each written as readable rules.

One generator gives them all: each family of `_families.FAMILIES` (its table: the
strategies' names are `STRATEGIES`, `eqshard suggest --help` lists them) builds its
draft on each factorization it is tried on, from the step traced once
(`_setup.setup_of`: the roles come from the step's jaxpr, `_profile.py`, never from
names), and the draft is written here as readable rules, checked and estimated.

A leaf whose chosen dim does not divide its split is replicated (over that axis),
and the candidate names it in `repairs`, with its shape and the split; a candidate
left with nothing split that its strategy is about (Megatron where no column- or
row-parallel weight divides, FSDP where no leaf does) is dropped with the reason,
as is a candidate whose batch does not split over `data`, and one whose layouts
(device by device: every leaf, every optimizer state leaf and the batch) are those
of a candidate before it. Every candidate kept is planned here (`plan_faults` on a
device count: no devices), and its rules checked to give each leaf exactly the
expression meant, so no candidate is ever silently wrong.

The rules survive a change of device count: the axis that scales with it is
declared `"*"`, the tensor-parallel degree fixed. The data strategies and the
two-dimensional ones declare `[["data", "*"], ["model", m]]`, write the data part
of each expression with `*` (`"... o i -> * ... o4 i"` copies over `data`,
`"... o i -> ... i* o4"` splits `i` over it, `"... o -> ... o4*"` splits `o` over
both) and the batch `"b ... -> b* ... 4"`; Megatron declares `[["data", 1],
["model", "*"]]` and writes `"... o i -> ... o* i"`. On the run's own count each
`*` is the size it stands for, so the layouts are exactly those of the fixed
counts (`Candidate.mesh` stays that concrete mesh). On another count, a leaf whose
split does not divide there is the planner's error, named, never silently
replicated.

Rules are written readably (`_globs.py`): one group per role, expression and
comment, each as few path globs as match its leaves and no other, each with a
comment naming its role and partners; the file's comment names the strategy and
the mesh.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._derive import derived_plan
from .._errors import EqshardError, whole_number
from .._expression import parse
from .._paths._globs import readable_rules
from .._paths._names import name
from .._plan import plan_faults
from .._problems import problem_lines
from .._rules import match_rules
from .._specfile._model import Rule, Rules
from ._dims import activation_dims
from ._estimate import Estimated, HeldLeaf, estimated
from ._families import Family, candidate_name, families_named, meshes, same_as
from ._setup import SOURCE, Draft, Setup, setup_of

__all__ = ["Candidate", "candidates"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate layout of `eqshard suggest`.

    - `strategy`: one of `STRATEGIES`.
    - `mesh`: `(("data", d), (axis, m))`, the mesh its rules declare: its second axis
        `"model"`, or `"expert"` or `"context"` for those families.
    - `rules`: a spec file's `Rules`: its declared `"mesh"`, `"batch"`, an
        `"optimizer"` section where the strategy has one, a comment per rule and
        for the file.
    - `repairs`: one line per leaf whose layout did not divide and was replicated
        (over the axis it did not divide), naming it, its shape and the split.
    - `estimated`: its figures before any compile (`_estimate.py`): the bytes held
        exact, the rest estimated.
    """

    strategy: str
    mesh: tuple[tuple[str, int], ...]
    rules: Rules
    repairs: tuple[str, ...] = ()
    estimated: Estimated | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        """`"fsdp x tensor on data=4, model=2"`: how tables and `dropped` name it."""
        (_, data), (axis, size) = self.mesh
        return candidate_name(self.strategy, data, size, axis)


# --------------------------------------------------------------------------- #
# Writing and checking the rules.
# --------------------------------------------------------------------------- #


def _written(setup: Setup, draft: Draft) -> list[Rule]:
    """The draft's ruled leaves as readable rules, checked to give each leaf exactly
    its expression (else one literal rule per leaf, which always does)."""
    keys: dict[tuple[str, str], list[int]] = {}
    for k, (comment, expr) in draft.ruled.items():
        # one group per role and expression: comments that differ only in the
        # indices of the paths they name (`feeds layers.1.weight`) are one
        keys.setdefault((_INDEX_SEGMENT.sub(".#.", comment), expr), []).append(k)
    groups = list(keys.values())
    meta = [
        (_merged_comment([draft.ruled[k][0] for k in members]), expr)
        for (_, expr), members in keys.items()
    ]
    paths = [leaf.segments for leaf in setup.leaves]
    found = [
        Rule(path, parse(meta[g][1]), meta[g][0], i)
        for i, (path, g) in enumerate(readable_rules(paths, groups))
    ]
    if _gives(setup, draft, found):
        return found
    literal = [
        Rule(name(setup.leaves[k].segments), parse(expr), comment, i)
        for i, (k, (comment, expr)) in enumerate(sorted(draft.ruled.items()))
    ]
    if not _gives(setup, draft, literal):
        raise EqshardError(
            "eqshard suggest wrote rules that do not give each leaf its expression; "
            "please report it to eqshard"
        )
    return literal


_INDEX_SEGMENT = re.compile(r"(?<=\.)[0-9]+(?=\.)")  # `1` in `layers.1.weight`


def _merged_comment(comments: Sequence[str]) -> str:
    """Comments that differ only in the indices of the paths they name, as one:
    each index that differs written as the alternatives of the path language
    (`column-parallel: feeds layers.{1,3,5,7}.weight`)."""
    first = comments[0]
    if all(c == first for c in comments):
        return first
    columns = zip(*(_INDEX_SEGMENT.findall(c) for c in comments))
    found = iter(
        items.pop() if len(items) == 1 else "{" + ",".join(sorted(items, key=int)) + "}"
        for items in (set(column) for column in columns)
    )
    return _INDEX_SEGMENT.sub(lambda _: next(found), first)


def _gives(setup: Setup, draft: Draft, rules: list[Rule]) -> bool:
    """Whether `rules` give each ruled leaf its expression, and the others none."""
    matches, problems = match_rules(Rules(tuple(rules)), setup.planned_for)
    if problems:
        return False
    arrays = [m for m in matches if m.source != "none"]
    for k, found in enumerate(arrays):
        want = draft.ruled.get(k)
        if want is None:
            if found.source == "rule":
                return False
        elif found.source != "rule" or found.expr != parse(want[1]):
            return False
    return True


def _normal(sharding: Any) -> tuple[Any, ...]:
    """A sharding as the devices see it: each dim's mesh axes as (size, stride) in
    the row-major device order, axes of size 1 left out; the same for two meshes
    that order the devices alike."""
    if sharding is None:
        return ()
    mesh = sharding.mesh
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    strides: dict[str, int] = {}
    stride = 1
    for axis in reversed(mesh.axis_names):
        strides[axis] = stride
        stride *= sizes[axis]
    out = []
    for entry in sharding.spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(tuple((sizes[a], strides[a]) for a in axes if sizes[a] > 1))
    while out and not out[-1]:
        out.pop()
    return tuple(out)


def _checked(setup: Setup, candidate: Candidate, splits_batch: bool) -> tuple[Any, Any, str | None]:
    """The candidate's layouts as the devices see them (a key that two candidates
    share when they lay everything out alike) and its plan, or why its rules do not
    plan."""
    matches, _ = match_rules(candidate.rules, setup.planned_for)
    by_dims = [setup.names.get(i, f"leaf {i}") for i, m in enumerate(matches) if m.source == "dims"]
    if by_dims:  # the activations' names are the annotations' too: not what was meant
        named = ", ".join(by_dims[:5]) + (
            f" and {len(by_dims) - 5} more" if len(by_dims) > 5 else ""
        )
        return (
            None,
            None,
            (
                f'its "dims", which map the names the step gives its activations, would lay '
                f"out {named} too, whose annotations name the same dims; name the "
                "activations' axes apart from the parameters' dims to have it generated"
            ),
        )
    fault = _activation_fault(setup, candidate)
    if fault is not None:
        return None, None, fault
    planned = plan_faults(setup.planned_for, candidate.rules, devices=setup.devices)
    if planned.problems or planned.warnings:
        faults = problem_lines(planned.problems) if planned.problems else []
        faults += [str(w) for w in planned.warnings]
        return None, None, "its rules do not plan: " + "; ".join(faults)
    plan = planned.plan
    (_, data), (axis, model) = candidate.mesh
    batch = ((data, model),) if splits_batch and data > 1 else ()
    key = (
        tuple(map(_normal, plan.flat_shardings)),
        tuple(map(_normal, plan.optimizer.flat_shardings)),
        batch,
        # the activations' layouts set the expert and context families apart
        () if axis == "model" else (axis, tuple(sorted(candidate.rules.dims.items()))),
    )
    return key, plan, None


def _activation_fault(setup: Setup, candidate: Candidate) -> str | None:
    """Why the candidate's `"dims"` cannot lay out an activation the step names: two
    of its names on one mesh axis, or a dim the axes do not divide; else `None`."""
    sizes = dict(candidate.mesh)
    dims = candidate.rules.dims
    for items, shape in setup.named:
        taken: dict[str, str] = {}
        for n, size in zip(items, shape):
            target = dims.get(n) if isinstance(n, str) else None
            if target is None:
                continue
            if target == "*":
                axes = [a for a, k in candidate.mesh if k > 1]
            else:  # a mesh axis, or several (a tuple): a candidate's dims name one
                axes = [target] if isinstance(target, str) else list(target)
            for axis in axes:
                if axis in taken:
                    return (
                        f'its "dims" map both {taken[axis]!r} and {n!r} of an activation '
                        f"named {tuple(items)} to the mesh axis {axis!r}"
                    )
                taken[axis] = str(n)
            split = math.prod(sizes.get(a, 1) for a in axes)
            if size % split:
                return (
                    f"an activation named {tuple(items)} has {size} along {n!r}, which does "
                    f"not divide over {' x '.join(axes)} ({split} devices)"
                )
    return None


def _batch_fault(setup: Setup, data: int) -> str | None:
    for where, shape in setup.batch:
        if shape and shape[0] % data:
            return (
                f"the batch's leading dim does not split over data={data}: {where} has "
                f"shape {list(shape)}"
            )
    return None


def candidates(
    step: Callable[..., Any],
    model: Any,
    *args: Any,
    devices: int,
    strategies: Sequence[str] | None = None,
) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """Every candidate layout for `devices` devices (the kept ones), and the dropped
    ones as `(name, reason)`.

    **Example:**

    ```python
    kept, dropped = candidates(step, eqx.filter_eval_shape(build), opt_state, batch, devices=8)
    kept[0].strategy, kept[0].mesh     # "data parallel", (("data", 8), ("model", 1))
    eqshard.dump(kept[3].rules, "megatron.eqshard.json")
    ```

    **Arguments:**

    - `step`: the training step, called as `step(model, *args)`, as `eqshard.cost`
        takes it; its jaxpr shows the tensor-parallel pairs.
    - `model`: the model, abstract (`eqx.filter_eval_shape`) or concrete.
    - `*args`: the step's other arguments, as `eqshard.cost` takes them: `(opt_state,
        batch)`, or `(state, opt_state, batch)` for a stateful model.
    - `devices`: the device count (no devices are needed).
    - `strategies`: the names of the families to make candidates of (a list, or one
        string separated by commas); by default every one of `STRATEGIES`.

    **Returns:**

    The candidates kept, in the order of `STRATEGIES` and, within one, of the size
    of `model`; and `(name, reason)` for each one dropped, and for each family
    `strategies` names that finds nothing to split (no stacked experts, say).

    **Raises:**

    `eqshard.StepError` when the step cannot be traced; `eqshard.EqshardError` when
    `devices` is not a whole number from 1, or `strategies` names no strategy.
    """
    whole_number(devices, "`devices`")
    families = families_named(strategies)
    setup = setup_of(step, model, args, devices)
    kept: list[Candidate] = []
    dropped: list[tuple[str, str]] = []
    seen: dict[Any, str] = {}
    applying = [family for family in families if family.applies(setup)]
    if strategies is not None:  # a family asked for by name says why it made none
        dropped += [(f.name, f.lacks) for f in families if f not in applying]
    for family, data, model_size in meshes(applying, devices):
        title = candidate_name(family.name, data, model_size, family.axis)
        reason = same_as(family, data, model_size)
        splits_batch = family.splits_batch
        if reason is None and splits_batch:
            reason = _batch_fault(setup, data * model_size if family.batch_over_both else data)
        built: Draft | str = reason if reason is not None else family.build(setup, data, model_size)
        if isinstance(built, str):
            dropped.append((title, built))
            continue
        candidate = _candidate(setup, family, data, model_size, built)
        key, plan, fault = _checked(setup, candidate, splits_batch)
        if fault is not None:
            dropped.append((title, fault))
            continue
        if key in seen:
            dropped.append((title, f"the same layout as {seen[key]}"))
            continue
        seen[key] = title
        figures = _estimated(setup, family, candidate, plan)
        kept.append(dataclasses.replace(candidate, estimated=figures))
    return kept, dropped


def _portable_mesh(family: Family, model: int) -> tuple[tuple[str, int | None], ...]:
    """The mesh the rules declare: the axis that scales with the device count as `"*"`
    (`None`), the tensor-parallel degree fixed: `data` x `model` (or `expert`, or
    `context`), or Megatron's `model` alone (`data` has one device)."""
    if family.meshes == "model":
        return (("data", 1), ("model", None))
    return (("data", None), (family.axis, model))


def _portable_text(family: Family, model: int) -> str:
    """The file comment's sentence on the device counts the rules plan on."""
    if family.meshes == "model":
        return (
            " The mesh declares 'model' as \"*\": the rules plan on any device count "
            "where every split dim divides."
        )
    if model == 1:
        return (
            " The mesh declares 'data' as \"*\": the rules plan on any device count "
            "where every split dim divides."
        )
    return (
        f" The mesh declares 'data' as \"*\" and {family.axis!r} as {model}: the rules plan "
        f"on any multiple of {model} devices where every split dim divides."
    )


def _estimated(setup: Setup, family: Family, candidate: Candidate, plan: Any) -> Estimated:
    """The candidate's figures before any compile (`_estimate.py`)."""
    leaves = [
        HeldLeaf(
            leaf.index,
            leaf.role,
            leaf.parameter,
            bool(jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact)),
            leaf.dtype,
        )
        for leaf in setup.leaves
    ]
    optimizer = [derived_plan(arg, plan).plan for arg in setup.built]
    return estimated(
        plan,
        leaves,
        optimizer,
        setup.batch_bytes,
        setup.profile,
        candidate.mesh,
        splits_batch=family.splits_batch,
        optimizer_apart=candidate.rules.optimizer is not None,
        spread=family.axis != "model",
    )


def _candidate(setup: Setup, family: Family, data: int, model: int, draft: Draft) -> Candidate:
    strategy = family.name
    axis = family.axis
    mesh = (("data", data), (axis, model))
    comment = f"{strategy} on data={data} x {axis}={model} ({setup.devices} devices): "
    comment += family.description + "."
    comment += _portable_text(family, model)
    dims = activation_dims(setup, family, draft, model)
    if dims:
        named = ", ".join(
            f"{n} over {axis!r}" if axis else f"{n} whole" for n, axis in dims.items()
        )
        comment += f" The activations' axes: {named}."
    if draft.repairs:
        comment += f" {len(draft.repairs)} leaves did not divide and were replicated."
    optimizer = draft.optimizer
    rules = Rules(
        tuple(_written(setup, draft)),
        dims=dims,
        default=draft.default,
        source=SOURCE,
        mesh=_portable_mesh(family, model),
        batch=parse(draft.batch),
        optimizer=optimizer,
        comment=comment,
    )
    return Candidate(strategy, mesh, rules, tuple(draft.repairs))
