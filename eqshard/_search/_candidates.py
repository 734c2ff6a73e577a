"""The candidates of `eqshard suggest`: every strategy on every factorization of the
device count into a `("data", d) x ("model", m)` mesh, each written as readable rules.

One generator gives them all:

| strategy | parameters | optimizer state | batch |
| --- | --- | --- | --- |
| `"data parallel"` | whole on every device | as the parameters | over `data` |
| `"fsdp"` | `"default": "fsdp"` over `data` | as the parameters | over `data` |
| `"zero-1"` | whole on every device | `"optimizer": {"default": "fsdp"}` | over `data` |
| `"expert parallel"` | stacked experts split by expert over `data`, the rest whole | as the parameters | over `data` |
| `"megatron"` | column-, row- and vocab-parallel over `model` | as the parameters | whole |
| `"data x tensor"` | Megatron over `model`, copied over `data` | as the parameters | over `data` |
| `"fsdp x tensor"` | Megatron over `model`, FSDP over `data` | as the parameters | over `data` |

The data strategies take `model = 1`, Megatron `data = 1`, and the two-dimensional
ones every other factorization; where a two-dimensional one has an axis of size 1 it
is the same layout as a one-dimensional one, and is dropped saying so. The Megatron
roles come from the step's jaxpr (`_megatron.py`), never from names.

A leaf whose chosen dim does not divide its split is replicated (over that axis),
and the candidate names it in `repairs`, with its shape and the split; a candidate
left with nothing split that its strategy is about (Megatron where no column- or
row-parallel weight divides, FSDP where no leaf does) is dropped with the reason,
as is a candidate whose batch does not split over `data`, and one whose layouts
(device by device: every leaf, every optimizer state leaf and the batch) are those
of a candidate before it. Every candidate kept is planned here (`make_plan` on a
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
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np

from .._activations import recording
from .._arguments import is_built  # a batch is what `cost` (and `eqshard.jit`) take for one
from .._derive import derived_plan as plan_for
from .._errors import EqshardError, whole_number
from .._expression import parse
from .._fields import LeafInfo, is_array_like, leaf_name, walk_fields
from .._fsdp import Over, fsdp_leaf, is_fsdp_replicated
from .._paths._globs import readable_rules
from .._paths._names import name, segments
from .._pipeline import marking
from .._plan import plan_faults as make_plan
from .._problems import problem_lines
from .._report import STAGE
from .._rules import match_rules
from .._specfile._model import Rule, Rules
from ._estimate import Estimated, HeldLeaf, estimated
from ._megatron import Pipelined, Role, StepProfile, abstract_leaf, step_profile

__all__ = ["FAMILIES", "STRATEGIES", "Candidate", "Family", "candidates", "families_named"]

_SOURCE = "<candidate>"


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
        return _name(self.strategy, data, size, axis)


def _name(strategy: str, data: int, model: int, axis: str = "model") -> str:
    return f"{strategy} on data={data}, {axis}={model}"


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """An array leaf of what the rules lay out (the model, and its state)."""

    path: str
    segments: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    info: LeafInfo
    role: Role | None
    parameter: bool  # of the model, not of its eqx.nn.State
    index: int = 0  # in the leaves of what the rules lay out

    @property
    def label(self) -> str:
        """`blocks.up.bias float32[2, 128]`: the leaf, its dtype and shape."""
        return f"{self.path} {self.dtype}{list(self.shape)}"


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every candidate is built from: the leaves with their roles, the batch's
    leaves, and what the rules are planned for."""

    planned_for: Any
    leaves: tuple[_Leaf, ...]
    names: dict[int, str]  # leaf index (in `tree_leaves(model)`) -> its name
    roles: dict[int, Role]  # by leaf index
    batch: tuple[tuple[str, tuple[int, ...]], ...]  # each batch leaf's name and shape
    pairs: bool  # whether the step shows any column- and row-parallel pair
    devices: int
    activations: tuple[str, ...]  # the names the model gives its activations' axes
    batch_names: frozenset[str]  # those only ever on an activation's batch axis
    named: tuple[tuple[tuple[Any, ...], tuple[int, ...]], ...]  # each recorded constrain
    profile: StepProfile  # the step's jaxpr, read once
    built: tuple[Any, ...]  # the arguments built from the model (an optimizer state)
    batch_bytes: tuple[int, ...]  # each batch leaf's bytes, whole


def _setup(step: Callable[..., Any], model: Any, args: Sequence[Any], devices: int) -> _Setup:
    model = jax.tree_util.tree_map(abstract_leaf, model)
    args = [jax.tree_util.tree_map(abstract_leaf, arg) for arg in args]
    with recording() as named, marking():
        profile = step_profile(step, model, *args)
    roles = profile.roles
    state = next((arg for arg in args if isinstance(arg, eqx.nn.State)), None)
    planned_for = model if state is None else (model, state)
    n_model = len(jax.tree_util.tree_leaves(model))
    items = walk_fields(planned_for)
    names = {i: leaf_name(item.path) for i, item in enumerate(items)}
    leaves = tuple(
        _Leaf(
            names[i],
            segments(item.path),
            tuple(int(s) for s in item.leaf.shape),
            str(item.leaf.dtype),
            item,
            roles.get(i) if i < n_model else None,
            i < n_model,
            i,
        )
        for i, item in enumerate(items)
        if is_array_like(item.leaf)
    )
    whole = make_plan(planned_for, "... -> * ...", devices=devices).plan
    batch: list[tuple[str, tuple[int, ...]]] = []
    batch_bytes: list[int] = []
    built: list[Any] = []
    for k, arg in enumerate(args):
        if isinstance(arg, eqx.nn.State):
            continue
        if is_built(plan_for(arg, whole)):
            built.append(arg)
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            if is_array_like(leaf):
                where = f"argument {k + 2}" + (f"'s leaf {leaf_name(path)}" if path else "")
                batch.append((where, tuple(int(s) for s in leaf.shape)))
                size = int(np.prod(leaf.shape, dtype=np.int64))
                batch_bytes.append(size * np.dtype(leaf.dtype).itemsize)
    pairs = any(r.kind in ("column", "row") for r in roles.values())
    activations, batch_names = _activation_names(named, {shape[0] for _, shape in batch if shape})
    return _Setup(
        planned_for,
        leaves,
        names,
        roles,
        tuple(batch),
        pairs,
        devices,
        activations,
        batch_names,
        tuple(named),
        profile,
        tuple(built),
        tuple(batch_bytes),
    )


def _activation_names(
    named: Sequence[tuple[tuple[Any, ...], tuple[int, ...]]], batch_sizes: set[int]
) -> tuple[tuple[str, ...], frozenset[str]]:
    """The names the model's `constrain` calls give (in order of first use), and those
    that only ever name an activation's leading axis, of the batch's size: the batch
    axis, which a strategy that splits the batch maps to `data`. Every other name is
    mapped to `null` (the axis whole), as Megatron keeps the activations between its
    pairs."""
    order: dict[str, None] = {}
    elsewhere: set[str] = set()
    for items, shape in named:
        for axis, n in enumerate(items):
            if isinstance(n, str):
                order.setdefault(n)
                if axis != 0 or shape[0] not in batch_sizes:
                    elsewhere.add(n)
    return tuple(order), frozenset(order.keys() - elsewhere)


# --------------------------------------------------------------------------- #
# Expressions.
# --------------------------------------------------------------------------- #


def _names(rank: int, role: Role) -> dict[int, str]:
    """A readable name for each axis an expression names: `o` and `i` for a
    weight's output and input, `v` and `d` for a vocabulary's, `_`, `__`, ... for
    the others."""
    given: list[tuple[int | None, str]] = [(role.axis, "o")]
    if role.kind in ("column", "row"):
        given = [(role.output, "o"), (role.contracted, "i")]
    elif role.kind == "vocab":
        given = [(role.output, "v"), (role.contracted, "d")]
    elif role.kind == "embedding":
        others = [a for a in role.inner if a != role.axis]
        given = [(role.axis, "v"), *((a, "d") for a in others[:1] if len(others) == 1)]
    named = {a: n for a, n in given if a is not None}
    blanks = 0
    for a in range(min(role.inner), rank):
        if a not in named:
            blanks += 1
            named[a] = "_" * blanks
    return named


def _expression(rank: int, role: Role, data_axis: int | None, data: int, model: int) -> str:
    """The expression that splits `role.axis` over `model` (and `data_axis`, if any,
    over `data`), replicating over what is left: `"... o i -> * ... o4 i"`.

    The axis that scales with the device count is written with `*`, so that the rules
    plan on any count the fixed part divides: `data` (`* ... o4 i` replicates over
    it, `... i* o4` splits `i` over it, `... o4*` splits `o` over both, `data` the
    major part), or, where `data` has one device (Megatron), `model` (`... o* i`).
    On this device count each `*` is `data` (or `model`), so the layout is the one
    the fixed counts would give."""
    start = min(role.inner)
    named = _names(rank, role)
    scales = data == 1  # Megatron: `model` takes every device
    counts = {role.axis: "*" if scales else str(model)}
    if data_axis is not None and not scales:
        counts[data_axis] = f"{model}*" if data_axis == role.axis else "*"
    order = list(range(start, rank))
    if data_axis is not None and data_axis != role.axis:
        order.remove(data_axis)
        order.insert(0, data_axis)  # the major mesh axis first
    lhs = ["..."] * (start > 0) + [named[a] for a in range(start, rank)]
    rhs = ["*"] * (data > 1 and data_axis is None) + ["..."] * (start > 0)
    rhs += [named[a] + counts.get(a, "") for a in order]
    return f"{' '.join(lhs)} -> {' '.join(rhs)}"


def _data_axis(leaf: _Leaf, role: Role, data: int, model: int) -> int | None:
    """The axis FSDP splits a tensor-parallel leaf along over `data`: of the axes where
    it is used, the largest (once split over `model`) that `data` divides, the last
    of equals."""
    sizes = {a: leaf.shape[a] // (model if a == role.axis else 1) for a in role.inner}
    fits = [a for a, size in sizes.items() if size % data == 0]
    return max(fits, key=lambda a: (sizes[a], a)) if fits else None


_KIND = {
    "column": "column-parallel",
    "row": "row-parallel",
    "vocab": "vocab-parallel",
    "embedding": "vocab-parallel embedding",
    "bias": "column-parallel bias",
}


def _comment(setup: _Setup, role: Role) -> str:
    """A rule's comment: the leaf's role, and the leaves it is paired with."""
    partners = ", ".join(setup.names[j] for j in role.partners)
    if role.kind == "column":
        return f"column-parallel: feeds {partners}"
    if role.kind == "row":
        return f"row-parallel: fed by {partners}; one all-reduce over 'model'"
    if role.kind == "vocab":
        return "vocab-parallel: split over its outputs, which feed no other weight"
    if role.kind == "embedding":
        return "vocab-parallel embedding: looked up by the batch"
    partner = setup.roles.get(role.partners[0]) if role.partners else None
    kind = "vocab" if partner is not None and partner.kind == "vocab" else "column"
    return f"{kind}-parallel bias of {partners}: split as its output"


# --------------------------------------------------------------------------- #
# Strategies.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class _Draft:
    """A candidate before its rules are written: each ruled leaf's (comment,
    expression), the default, the optimizer section, the batch, the repairs."""

    ruled: dict[int, tuple[str, str]] = dataclasses.field(default_factory=dict)
    default: Literal["replicate", "fsdp"] = "replicate"
    optimizer: Rules | None = None
    batch: str = "... -> * ..."
    repairs: list[str] = dataclasses.field(default_factory=list)


def _batch(data: int, model: int) -> str:
    """The batch's leading dim over `data`, which takes the devices `model` leaves (its
    `*`), copied over `model`: `"b ... -> b* ... 4"`, or `"b ... -> b* ..."`."""
    return "b ... -> b* ..." + (f" {model}" if model > 1 else "")


def _fsdp_repairs(setup: _Setup, data: int, model: int, only: Callable[[_Leaf], bool]) -> list[str]:
    """A line for each leaf `only` picks that FSDP over `data` cannot split."""
    split = Over(data, "data", (), (model,) if model > 1 else ())
    lines = []
    for leaf in setup.leaves:
        if not only(leaf):
            continue
        _, origin = fsdp_leaf(leaf.shape, leaf.info.annotation, split)
        if is_fsdp_replicated(origin):
            why = origin.split("replicated, ", 1)[1]
            lines.append(f"{leaf.label}: {why}; replicated over 'data'")
    return lines


def _fsdp_splits_something(setup: _Setup, data: int, only: Callable[[_Leaf], bool]) -> bool:
    split = Over(data, "data")
    return any(
        not is_fsdp_replicated(fsdp_leaf(leaf.shape, leaf.info.annotation, split)[1])
        for leaf in setup.leaves
        if only(leaf)
    )


def _data_parallel(setup: _Setup, data: int, model: int) -> _Draft | str:
    return _Draft(batch=_batch(data, model))


def _fsdp(setup: _Setup, data: int, model: int) -> _Draft | str:
    if data == 1:
        return "'data' has one device: nothing to split"
    if not _fsdp_splits_something(setup, data, lambda leaf: True):
        return f"no leaf has a dim that divides over data={data}"
    repairs = _fsdp_repairs(setup, data, model, lambda leaf: True)
    return _Draft(default="fsdp", batch=_batch(data, model), repairs=repairs)


def _zero_1(setup: _Setup, data: int, model: int) -> _Draft | str:
    def parameter(leaf: _Leaf) -> bool:
        return leaf.parameter

    if data == 1:
        return "'data' has one device: nothing to split"
    if not _fsdp_splits_something(setup, data, parameter):
        return f"no parameter has a dim that divides over data={data}, to split its moments"
    section = Rules(
        default="fsdp",
        source=_SOURCE,
        section="$.optimizer",
        comment="Every optimizer state leaf of every parameter, split over 'data' as FSDP "
        "would split the parameter.",
    )
    repairs = [
        line.replace("; replicated over 'data'", "; its optimizer state replicated over 'data'")
        for line in _fsdp_repairs(setup, data, model, parameter)
    ]
    return _Draft(optimizer=section, batch=_batch(data, model), repairs=repairs)


def _tensor(setup: _Setup, data: int, model: int, fsdp: bool) -> _Draft | str:
    """Megatron over `model`: each leaf with a role split along its axis, replicated
    over `data` (`fsdp=False`) or split by FSDP over it too."""
    if model == 1:
        return "'model' has one device: nothing to split"
    if not setup.pairs:
        return "the step's jaxpr shows no column- and row-parallel pair of weights"
    draft = _Draft(default="fsdp" if fsdp else "replicate")
    split = False
    for k, leaf in enumerate(setup.leaves):
        role = leaf.role
        if role is None:
            continue
        size = leaf.shape[role.axis]
        if size % model:
            rest = "left to FSDP over 'data'" if fsdp else "replicated"
            draft.repairs.append(
                f"{leaf.label}: {_KIND[role.kind]} over dim {role.axis} ({size}) does not "
                f"divide over model={model}; {rest}"
            )
            continue
        comment = _comment(setup, role)
        data_axis = None
        if fsdp and data > 1:
            data_axis = _data_axis(leaf, role, data, model)
            if data_axis is None:
                part = [s // model if a == role.axis else s for a, s in enumerate(leaf.shape)]
                past = " past the stacked layer axes" if min(role.inner) else ""
                draft.repairs.append(
                    f"{leaf.label}: no dim of its part on each 'model' device, {part}{past}, "
                    f"is a multiple of {data}, the size of 'data'; replicated over 'data'"
                )
            else:
                comment += "; FSDP over 'data'"
        expr = _expression(len(leaf.shape), role, data_axis, data, model)
        draft.ruled[k] = (comment, expr)
        split = split or role.kind in ("column", "row")
    if not split:
        return f"no column- or row-parallel weight divides over model={model}"
    if fsdp:
        draft.repairs += _fsdp_repairs(setup, data, model, lambda leaf: leaf.role is None)
    if data > 1:
        draft.batch = _batch(data, model)
    return draft


def _has_experts(setup: _Setup) -> bool:
    """Whether the step's jaxpr shows stacked experts (`StepProfile.experts`), or a
    weight stacked over different axes, which the expert families name."""
    return bool(setup.profile.experts or setup.profile.ambiguous_experts)


def _expert_axes(setup: _Setup) -> dict[int, int]:
    """Each leaf (by its place in `setup.leaves`) stacked over experts, and its expert
    axis: a weight whose matmuls batch or group over one of its axes
    (`StepProfile.experts`: `einsum`, `vmap`, `ragged_dot`), and a sibling of its
    that is no matmul's operand (the same module's bias) with that axis's size on the
    same axis."""
    by_index = {leaf.index: k for k, leaf in enumerate(setup.leaves)}
    operands = {matmul.leaf for matmul in setup.profile.matmuls}
    found: dict[int, int] = {}
    for index, axis in setup.profile.experts.items():
        k = by_index.get(index)
        if k is None:
            continue
        found[k] = axis
        weight = setup.leaves[k]
        parent, size = weight.segments[:-1], weight.shape[axis]
        for j, other in enumerate(setup.leaves):
            sibling = j not in found and other.segments[:-1] == parent and other.parameter
            sibling = sibling and other.index not in operands
            if sibling and len(other.shape) > axis and other.shape[axis] == size:
                found[j] = axis
    return found


def _ambiguous_experts(setup: _Setup) -> list[str]:
    """A line for each weight whose matmuls stack it over different axes: which is
    the experts' is not known, so no expert family splits it."""
    by_index = {leaf.index: leaf for leaf in setup.leaves}
    lines = []
    for index, axes in sorted(setup.profile.ambiguous_experts.items()):
        leaf = by_index.get(index)
        if leaf is not None:
            dims = " and ".join(f"{a} ({leaf.shape[a]})" for a in axes)
            lines.append(
                f"{leaf.label}: its matmuls stack it over dims {dims}, so which holds the "
                "experts is ambiguous; replicated"
            )
    return lines


def _expert_parallel(setup: _Setup, data: int, model: int) -> _Draft | str:
    """Experts split over `data`, each device its own (MaxText's `ep-as-dp`): every
    leaf stacked over experts split along its expert axis, the rest whole."""
    if data == 1:
        return "'data' has one device: nothing to split"
    comment = "expert-parallel: each device its own experts"
    return _experts_split(setup, _Draft(batch=_batch(data, model)), "data", data, "*", comment)


def _data_expert(setup: _Setup, data: int, experts: int) -> _Draft | str:
    """Experts on an axis of their own: every leaf stacked over experts split along its
    expert axis over `expert`, copied over `data`; the batch over both axes."""
    comment = "expert-parallel over 'expert': each device its share"
    lead = "* " if data > 1 else ""
    draft = _Draft(batch="b ... -> b* ...")
    return _experts_split(setup, draft, "expert", experts, str(experts), comment, lead)


def _experts_split(
    setup: _Setup,
    draft: _Draft,
    axis_name: str,
    size: int,
    modifier: str,
    comment: str,
    lead: str = "",
) -> _Draft | str:
    """`draft` with every leaf stacked over experts split along its expert axis by
    `modifier` (over `axis_name`, of `size` devices), after `lead` (`"* "`: copied
    over `data` first); a leaf whose experts do not divide is repaired, named."""
    stacked = _expert_axes(setup)
    ambiguous = _ambiguous_experts(setup)
    if not stacked:
        return "; ".join(["no stacked experts are known", *ambiguous]) if ambiguous else _NO_EXPERTS
    draft.repairs.extend(ambiguous)
    for k, axis in sorted(stacked.items()):
        leaf = setup.leaves[k]
        if leaf.shape[axis] % size:
            draft.repairs.append(
                f"{leaf.label}: its {leaf.shape[axis]} experts (dim {axis}) do not divide over "
                f"{axis_name}={size}; replicated"
            )
            continue
        names = [f"{'_' * (i + 1)}" for i in range(len(leaf.shape))]
        names[axis] = "e"
        rhs = [n + modifier if i == axis else n for i, n in enumerate(names)]
        draft.ruled[k] = (comment, f"{' '.join(names)} -> {lead}{' '.join(rhs)}")
    if not draft.ruled:
        return "; ".join([f"no stacked experts divide over {axis_name}={size}", *draft.repairs])
    return draft


def _sequence_names(setup: _Setup) -> tuple[frozenset[str], frozenset[str]]:
    """The names of the activations' sequence axes, and of the keys' and values'.

    Attention's matmuls of two activations show them (`StepProfile.attention_free`
    and `attention_contracted`): an axis the weighted sum contracts is the values'
    sequence, and its name the keys' too; an axis of either matmul left free, named
    otherwise, is the queries' sequence. A name found only at such places from the
    front, of the same size, on other activations (the residual stream's) is a
    sequence too. The batch's names are neither."""
    profile = setup.profile

    def names(labels: dict[int, frozenset[int]]) -> set[str]:
        found: set[str] = set()
        for k, axes in labels.items():
            items = setup.named[k][0]
            found.update(n for n in (items[a] for a in axes) if isinstance(n, str))
        return found

    keys = names(profile.attention_contracted) - setup.batch_names
    queries = names(profile.attention_free) - keys - setup.batch_names
    places = {
        (i, shape[i]) for items, shape in setup.named for i, n in enumerate(items) if n in queries
    }
    at: dict[str, set[tuple[int, int]]] = {}  # each name's places, and its axes' sizes
    for items, shape in setup.named:
        for i, n in enumerate(items):
            if isinstance(n, str):
                at.setdefault(n, set()).add((i, shape[i]))
    # a name every one of whose places is a sequence's: a feature axis of the same size
    # (an `embed` as long as the sequence) also sits elsewhere, and is not one
    found = {n for n, where in at.items() if where <= places} | queries
    return frozenset(found - keys - setup.batch_names), frozenset(keys)


def _context(setup: _Setup, data: int, context: int, fsdp: bool) -> _Draft | str:
    """Context parallelism: the activations' sequence split over `context`, the keys
    and values whole (gathered in each layer); the parameters copied (`fsdp=False`)
    or split by FSDP over `data`; the batch over `data`."""
    if context == 1:
        return "'context' has one device: nothing to split"
    sequence, _ = _sequence_names(setup)
    lengths = sorted(
        {shape[i] for items, shape in setup.named for i, n in enumerate(items) if n in sequence}
    )
    short = [n for n in lengths if n % context]
    if short:
        return f"the sequence ({short[0]}) does not divide over context={context}"
    return _fsdp(setup, data, context) if fsdp else _Draft(batch=_batch(data, context))


def _pipelined(setup: _Setup) -> dict[int, Pipelined]:
    """The leaves (by their place in `setup.leaves`) that `eqshard.pipeline` runs over
    the mesh axis the pipeline family lays out, `stage`."""
    by_index = {leaf.index: k for k, leaf in enumerate(setup.leaves)}
    return {
        by_index[index]: how
        for index, how in setup.profile.pipelined.items()
        if index in by_index and how.axis == STAGE
    }


def _pipeline_data(setup: _Setup, data: int, stages: int) -> _Draft | str:
    """Pipeline stages x data: every stacked layer leaf `eqshard.pipeline` runs split
    over `stage` along its layer axis (GPipe's first, the circular schedule's second),
    copied over `data`; the batch over `data`."""
    if stages == 1:
        return "'stage' has one device: nothing to split"
    draft = _Draft(batch=_batch(data, stages))
    for k, how in sorted(_pipelined(setup).items()):
        leaf = setup.leaves[k]
        rows = how.batch // how.microbatches
        if how.batch_axis == "data" and rows % data:
            return (
                f"each of the {how.microbatches} microbatches has {rows} rows, which do not "
                f"divide over data={data} (the pipeline's batch_axis)"
            )
        axis = how.depth - 1  # the layers' axis: GPipe's first, circular's second
        size = leaf.shape[axis]
        if how.schedule == "circular" and size != stages:
            return (
                f"the circular schedule's stack ({leaf.label}) has {size} stages, not "
                f"stage={stages}"
            )
        if how.schedule == "circular" and how.microbatches < stages:
            return f"{how.microbatches} microbatches, fewer than stage={stages}"
        if size % stages:
            return f"{leaf.label}: its {size} layers do not divide over stage={stages}"
        names = [f"{'_' * (i + 1)}" for i in range(len(leaf.shape))]
        names[axis] = "l"
        rhs = [f"{n}{stages}" if i == axis else n for i, n in enumerate(names)]
        comment = f"pipeline stage: each stage its layers ({how.schedule})"
        # copied over `data` (`*`), even of one device: the rules plan on other counts
        draft.ruled[k] = (comment, f"{' '.join(names)} -> * {' '.join(rhs)}")
    return draft


@dataclasses.dataclass(frozen=True)
class Family:
    """One strategy of the candidate space: a row of `FAMILIES`, so that a new one
    (experts, sequence, pipeline stages) is one more row, not more code here.

    - `name`: how tables and spec files name it (`"fsdp x tensor"`).
    - `description`: the written spec's comment on it.
    - `build`: its draft on a `(data, model)` mesh, or why it has none there.
    - `meshes`: which factorizations of the device count it is tried on: `"data"`
        (all devices on `data`), `"model"` (all on `model`), or `"both"` (every
        `data x model`, the tensor degree the smaller first).
    - `splits_batch`: whether the batch is split over `data`.
    - `same_as`: for a two-dimensional family, the one-dimensional families it equals
        where `model`, then `data`, has one device (`None`: it equals none there).
    - `applies`: whether the model has what the family splits (stacked experts, a
        sequence); one that does not apply makes no candidate, and is listed as
        dropped (with `lacks`) only where `strategies` names it.
    - `axis`: the name of its second mesh axis: `"model"`, `"expert"`, `"context"`
        or `"stage"`.
    - `batch_over_both`: whether the batch is split over both axes.
    """

    name: str
    description: str
    build: Callable[[_Setup, int, int], _Draft | str]
    meshes: Literal["data", "model", "both"]
    splits_batch: bool = True
    same_as: tuple[str | None, str | None] | None = None
    applies: Callable[[_Setup], bool] = lambda setup: True
    axis: Literal["model", "expert", "context", "stage"] = "model"
    batch_over_both: bool = False
    lacks: str = "the model has nothing it splits"


_NO_EXPERTS = (
    "the step's jaxpr shows no stacked experts: no weight that a matmul batches over "
    "(an einsum over the experts, vmap over their stack) or that jax.lax.ragged_dot "
    "groups by"
)
_NO_SEQUENCE = "the step's attention takes no named queries and keys: no sequence to split"
_NO_PIPELINE = "the step runs no eqshard.pipeline over the mesh axis 'stage'"

FAMILIES: tuple[Family, ...] = (
    Family(
        "data parallel",
        "data parallelism: every leaf whole on every device, the batch split over 'data'",
        _data_parallel,
        "data",
    ),
    Family(
        "fsdp",
        "FSDP (ZeRO-3): each leaf split over 'data' along its largest dim that 'data' "
        "divides, the batch split over 'data'",
        _fsdp,
        "data",
    ),
    Family(
        "zero-1",
        "ZeRO-1: the parameters whole on every device, their optimizer state split over "
        "'data' as FSDP would split them, the batch split over 'data'",
        _zero_1,
        "data",
    ),
    Family(
        "expert parallel",
        "expert parallelism over 'data' (ep-as-dp): the experts' stacked weights split "
        "by expert, each device its own; the batch split over 'data', the tokens handed "
        "to their experts by all-to-all",
        _expert_parallel,
        "data",
        applies=_has_experts,
        lacks=_NO_EXPERTS,
    ),
    Family(
        "megatron",
        "Megatron tensor parallelism: column- and row-parallel pairs found in the step's "
        "jaxpr, the vocabulary and the embedding split over 'model'; the batch whole on "
        "every device",
        lambda setup, d, m: _tensor(setup, d, m, fsdp=False),
        "model",
        splits_batch=False,
    ),
    Family(
        "data x tensor",
        "data x tensor parallelism: Megatron's split over 'model', each leaf copied over "
        "'data', the batch split over 'data'",
        lambda setup, d, m: _tensor(setup, d, m, fsdp=False),
        "both",
        same_as=("data parallel", "megatron"),
    ),
    Family(
        "fsdp x tensor",
        "FSDP x tensor parallelism: Megatron's split over 'model', each leaf also split "
        "over 'data' by FSDP, the batch split over 'data'",
        lambda setup, d, m: _tensor(setup, d, m, fsdp=True),
        "both",
        same_as=("fsdp", "megatron"),
    ),
    Family(
        "data x expert",
        "expert parallelism on an axis of its own: the experts' stacked weights split "
        "over 'expert', copied over 'data'; the batch split over both axes, and in the "
        "experts' buffers the groups over 'data', so the all-to-alls stay within 'expert'",
        _data_expert,
        "both",
        same_as=("data parallel", "expert parallel"),
        applies=_has_experts,
        lacks=_NO_EXPERTS,
        axis="expert",
        batch_over_both=True,
    ),
    Family(
        "context parallel",
        "context parallelism: the activations' sequence split over 'context', the keys "
        "and values gathered whole in each layer; every leaf whole on every device, the "
        "batch split over 'data'",
        lambda setup, d, m: _context(setup, d, m, fsdp=False),
        "both",
        same_as=("data parallel", None),
        applies=lambda setup: bool(_sequence_names(setup)[0]),
        lacks=_NO_SEQUENCE,
        axis="context",
    ),
    Family(
        "fsdp x context",
        "FSDP x context parallelism: the activations' sequence split over 'context', the "
        "keys and values gathered whole in each layer; each leaf split over 'data' by "
        "FSDP, the batch split over 'data'",
        lambda setup, d, m: _context(setup, d, m, fsdp=True),
        "both",
        same_as=("fsdp", "context parallel"),
        applies=lambda setup: bool(_sequence_names(setup)[0]),
        lacks=_NO_SEQUENCE,
        axis="context",
    ),
    Family(
        "pipeline x data",
        "pipeline stages x data parallelism: the layers eqshard.pipeline runs split over "
        "'stage', each stage its own, copied over 'data'; the rest whole; the batch split "
        "over 'data'",
        _pipeline_data,
        "both",
        same_as=("data parallel", None),
        applies=lambda setup: bool(_pipelined(setup)),
        lacks=_NO_PIPELINE,
        axis="stage",
    ),
)
"""The candidate space, in the order its candidates come."""

STRATEGIES = tuple(family.name for family in FAMILIES)
"""The strategies' names, in the order their candidates come."""

_FAMILY = {family.name: family for family in FAMILIES}


def _meshes(families: Sequence[Family], devices: int) -> list[tuple[Family, int, int]]:
    """Each family's factorizations `(family, data, model)`, in order."""
    divisors = [m for m in range(1, devices + 1) if devices % m == 0]
    found: list[tuple[Family, int, int]] = []
    for family in families:
        if family.meshes == "data":
            found.append((family, devices, 1))
        elif family.meshes == "model":
            found.append((family, 1, devices))
        else:
            found += [(family, devices // m, m) for m in divisors]
    return found


def _same_as(family: Family, data: int, model: int) -> str | None:
    """Why a two-dimensional family on a mesh with an axis of size 1 is another."""
    if family.same_as is None:
        return None
    over_data, over_model = family.same_as
    if model == 1 and over_data is not None:
        axis = family.axis
        return f"the same layout as {_name(over_data, data, 1)}: nothing is split over {axis!r}"
    if data == 1 and over_model is not None:
        other = _FAMILY[over_model]
        on = _name(over_model, *((model, 1) if other.meshes == "data" else (1, model)), other.axis)
        return f"the same layout as {on}: 'data' has one device"
    return None


def families_named(names: Sequence[str] | None) -> tuple[Family, ...]:
    """The families `names` names (every one for `None`), in `FAMILIES`' order.

    **Raises:** `EqshardError` for a name that is none of them, naming them all.
    """
    if names is None:
        return FAMILIES
    if isinstance(names, str):
        names = [part.strip() for part in names.split(",")]
    unknown = [n for n in names if n not in _FAMILY]
    if unknown or not names:
        what = f"{unknown[0]!r} is no strategy" if unknown else "no strategy is named"
        raise EqshardError(f"{what}; the strategies are {', '.join(map(repr, STRATEGIES))}")
    return tuple(family for family in FAMILIES if family.name in names)


# --------------------------------------------------------------------------- #
# Writing and checking the rules.
# --------------------------------------------------------------------------- #


def _written(setup: _Setup, draft: _Draft) -> list[Rule]:
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


def _gives(setup: _Setup, draft: _Draft, rules: list[Rule]) -> bool:
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


def _checked(
    setup: _Setup, candidate: Candidate, splits_batch: bool
) -> tuple[Any, Any, str | None]:
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
    planned = make_plan(setup.planned_for, candidate.rules, devices=setup.devices)
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


def _activation_fault(setup: _Setup, candidate: Candidate) -> str | None:
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


def _batch_fault(setup: _Setup, data: int) -> str | None:
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
    setup = _setup(step, model, args, devices)
    kept: list[Candidate] = []
    dropped: list[tuple[str, str]] = []
    seen: dict[Any, str] = {}
    applying = [family for family in families if family.applies(setup)]
    if strategies is not None:  # a family asked for by name says why it made none
        dropped += [(f.name, f.lacks) for f in families if f not in applying]
    for family, data, model_size in _meshes(applying, devices):
        title = _name(family.name, data, model_size, family.axis)
        reason = _same_as(family, data, model_size)
        splits_batch = family.splits_batch
        if reason is None and splits_batch:
            reason = _batch_fault(setup, data * model_size if family.batch_over_both else data)
        built: _Draft | str = (
            reason if reason is not None else family.build(setup, data, model_size)
        )
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


def _expert_names(setup: _Setup) -> frozenset[str]:
    """The activations' names on the axes a stacked experts' matmul batches over
    (`StepProfile.expert_labels`), and never on another axis a matmul shows."""
    found: set[str] = set()
    for k, positions in setup.profile.expert_labels.items():
        items = setup.named[k][0]
        for position in positions:
            n = items[position]
            if isinstance(n, str):
                found.add(n)
    return frozenset(found)


def _over_model(setup: _Setup, draft: _Draft) -> frozenset[str]:
    """The activations' names that label the output axis of a column- or
    vocab-parallel weight this draft splits over `model` (`StepProfile.labels`), and
    never another axis: Megatron keeps those activations split, as the weight makes
    them (the logits by vocabulary), rather than gathering them whole."""
    split = {setup.leaves[k].index for k in draft.ruled}
    kinds = {i: role.kind for i, role in setup.roles.items()}
    found: set[str] = set()
    other: set[str] = set()
    for k, (items, _) in enumerate(setup.named):
        labelled = {axis: weight for weight, axis in setup.profile.labels.get(k, ())}
        for position, n in enumerate(items):
            if not isinstance(n, str):
                continue
            weight = labelled.get(position - len(items))
            if weight in split and kinds.get(weight) in ("column", "vocab"):
                found.add(n)
            elif weight is not None:
                other.add(n)
    return frozenset(found - other - setup.batch_names)


def _activation_dims(
    setup: _Setup, family: Family, draft: _Draft, model: int
) -> dict[str, str | None]:
    """The rules' `"dims"` for the names the model gives its activations: the batch's
    over `data` (over both axes for `data x expert`), the experts' over the axis that
    splits the experts (else whole), the groups in the experts' buffers over `data`
    (whole where `data` splits the experts), the sequence over `context`, a
    column-parallel output over `model`; every other name whole."""
    # a name on the experts' axis is the experts' (a buffer's leading axis may have
    # the batch's size)
    batch = setup.batch_names - _expert_names(setup) if family.splits_batch else frozenset()
    if family.axis == "expert":
        experts = _expert_names(setup)
        groups = _expert_groups(setup, experts)
        return {
            n: "*" if n in batch else "expert" if n in experts else "data" if n in groups else None
            for n in setup.activations
        }
    if family.axis == "context":
        sequence, _ = _sequence_names(setup)
        return {
            n: "data" if n in batch else "context" if n in sequence else None
            for n in setup.activations
        }
    over_model = _over_model(setup, draft) if model > 1 and family.axis == "model" else frozenset()
    experts = _expert_names(setup)
    if family.name == "expert parallel":  # each device its experts, the groups whole
        over_data = batch | experts
    else:  # every expert on every device, each device its groups in the buffers
        over_data = batch | (_expert_groups(setup, experts) if family.splits_batch else set())
    return {
        n: "data" if n in over_data else "model" if n in over_model else None
        for n in setup.activations
    }


def _expert_groups(setup: _Setup, experts: frozenset[str]) -> frozenset[str]:
    """The names beside an expert name on one activation (the experts' buffers) whose
    axis has the batch's size: the groups, split over `data` on a `data x expert`
    mesh while the experts are split over `expert`."""
    sizes = {shape[0] for _, shape in setup.batch if shape}
    found: set[str] = set()
    for items, shape in setup.named:
        if any(n in experts for n in items if isinstance(n, str)):
            found.update(
                n
                for n, size in zip(items, shape)
                if isinstance(n, str) and n not in experts and size in sizes
            )
    return frozenset(found - setup.batch_names - experts)


def _estimated(setup: _Setup, family: Family, candidate: Candidate, plan: Any) -> Estimated:
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
    optimizer = [plan_for(arg, plan).plan for arg in setup.built]
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


def _candidate(setup: _Setup, family: Family, data: int, model: int, draft: _Draft) -> Candidate:
    strategy = family.name
    axis = family.axis
    mesh = (("data", data), (axis, model))
    comment = f"{strategy} on data={data} x {axis}={model} ({setup.devices} devices): "
    comment += family.description + "."
    comment += _portable_text(family, model)
    dims = _activation_dims(setup, family, draft, model)
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
        source=_SOURCE,
        mesh=_portable_mesh(family, model),
        batch=parse(draft.batch),
        optimizer=optimizer,
        comment=comment,
    )
    return Candidate(strategy, mesh, rules, tuple(draft.repairs))
