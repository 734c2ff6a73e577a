"""The candidate space of `eqshard suggest`: `FAMILIES`, one row per strategy (its
name, its description, how it builds its draft on a `data x` second-axis mesh, the
factorizations it is tried on, whether it applies to the step), and the helpers its
builders share (the expressions of Megatron's roles, FSDP's repairs, the experts'
and the pipeline's splits). A new strategy is one more row.

The data strategies take `model = 1`, Megatron `data = 1`, and the two-dimensional
ones every other factorization; where a two-dimensional one has an axis of size 1 it
is the same layout as a one-dimensional one, and is dropped saying so (`same_as`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

from .._errors import EqshardError
from .._fsdp import Over, fsdp_leaf, is_fsdp_replicated
from .._report import STAGE
from .._specfile._model import Rules
from ._dims import sequence_names
from ._profile import Pipelined, Role
from ._setup import SOURCE, Draft, Leaf, Setup
from ._strategy_names import STRATEGY_NAMES

__all__ = [
    "FAMILIES",
    "STRATEGIES",
    "Family",
    "candidate_name",
    "families_named",
    "meshes",
    "same_as",
]


def candidate_name(strategy: str, data: int, model: int, axis: str = "model") -> str:
    return f"{strategy} on data={data}, {axis}={model}"


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


def _data_axis(leaf: Leaf, role: Role, data: int, model: int) -> int | None:
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


def _comment(setup: Setup, role: Role) -> str:
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


def _batch(data: int, model: int) -> str:
    """The batch's leading dim over `data`, which takes the devices `model` leaves (its
    `*`), copied over `model`: `"b ... -> b* ... 4"`, or `"b ... -> b* ..."`."""
    return "b ... -> b* ..." + (f" {model}" if model > 1 else "")


def _fsdp_repairs(setup: Setup, data: int, model: int, only: Callable[[Leaf], bool]) -> list[str]:
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


def _fsdp_splits_something(setup: Setup, data: int, only: Callable[[Leaf], bool]) -> bool:
    split = Over(data, "data")
    return any(
        not is_fsdp_replicated(fsdp_leaf(leaf.shape, leaf.info.annotation, split)[1])
        for leaf in setup.leaves
        if only(leaf)
    )


def _data_parallel(setup: Setup, data: int, model: int) -> Draft | str:
    return Draft(batch=_batch(data, model))


def _fsdp(setup: Setup, data: int, model: int) -> Draft | str:
    if data == 1:
        return "'data' has one device: nothing to split"
    if not _fsdp_splits_something(setup, data, lambda leaf: True):
        return f"no leaf has a dim that divides over data={data}"
    repairs = _fsdp_repairs(setup, data, model, lambda leaf: True)
    return Draft(default="fsdp", batch=_batch(data, model), repairs=repairs)


def _zero_1(setup: Setup, data: int, model: int) -> Draft | str:
    def parameter(leaf: Leaf) -> bool:
        return leaf.parameter

    if data == 1:
        return "'data' has one device: nothing to split"
    if not _fsdp_splits_something(setup, data, parameter):
        return f"no parameter has a dim that divides over data={data}, to split its moments"
    section = Rules(
        default="fsdp",
        source=SOURCE,
        section="$.optimizer",
        comment="Every optimizer state leaf of every parameter, split over 'data' as FSDP "
        "would split the parameter.",
    )
    repairs = [
        line.replace("; replicated over 'data'", "; its optimizer state replicated over 'data'")
        for line in _fsdp_repairs(setup, data, model, parameter)
    ]
    return Draft(optimizer=section, batch=_batch(data, model), repairs=repairs)


def _tensor(setup: Setup, data: int, model: int, fsdp: bool) -> Draft | str:
    """Megatron over `model`: each leaf with a role split along its axis, replicated
    over `data` (`fsdp=False`) or split by FSDP over it too."""
    if model == 1:
        return "'model' has one device: nothing to split"
    if not setup.pairs:
        return "the step's jaxpr shows no column- and row-parallel pair of weights"
    draft = Draft(default="fsdp" if fsdp else "replicate")
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


def _has_experts(setup: Setup) -> bool:
    """Whether the step's jaxpr shows stacked experts (`StepProfile.experts`), or a
    weight stacked over different axes, which the expert families name."""
    return bool(setup.profile.experts or setup.profile.ambiguous_experts)


def _expert_axes(setup: Setup) -> dict[int, int]:
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


def _ambiguous_experts(setup: Setup) -> list[str]:
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


def _expert_parallel(setup: Setup, data: int, model: int) -> Draft | str:
    """Experts split over `data`, each device its own (MaxText's `ep-as-dp`): every
    leaf stacked over experts split along its expert axis, the rest whole."""
    if data == 1:
        return "'data' has one device: nothing to split"
    comment = "expert-parallel: each device its own experts"
    return _experts_split(setup, Draft(batch=_batch(data, model)), "data", data, "*", comment)


def _data_expert(setup: Setup, data: int, experts: int) -> Draft | str:
    """Experts on an axis of their own: every leaf stacked over experts split along its
    expert axis over `expert`, copied over `data`; the batch over both axes."""
    comment = "expert-parallel over 'expert': each device its share"
    lead = "* " if data > 1 else ""
    draft = Draft(batch="b ... -> b* ...")
    return _experts_split(setup, draft, "expert", experts, str(experts), comment, lead)


def _experts_split(
    setup: Setup,
    draft: Draft,
    axis_name: str,
    size: int,
    modifier: str,
    comment: str,
    lead: str = "",
) -> Draft | str:
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


def _context(setup: Setup, data: int, context: int, fsdp: bool) -> Draft | str:
    """Context parallelism: the activations' sequence split over `context`, the keys
    and values whole (gathered in each layer); the parameters copied (`fsdp=False`)
    or split by FSDP over `data`; the batch over `data`."""
    if context == 1:
        return "'context' has one device: nothing to split"
    sequence, _ = sequence_names(setup)
    lengths = sorted(
        {shape[i] for items, shape in setup.named for i, n in enumerate(items) if n in sequence}
    )
    short = [n for n in lengths if n % context]
    if short:
        return f"the sequence ({short[0]}) does not divide over context={context}"
    return _fsdp(setup, data, context) if fsdp else Draft(batch=_batch(data, context))


def _pipelined(setup: Setup) -> dict[int, Pipelined]:
    """The leaves (by their place in `setup.leaves`) that `eqshard.parallel.pipeline` runs over
    the mesh axis the pipeline family lays out, `stage`."""
    by_index = {leaf.index: k for k, leaf in enumerate(setup.leaves)}
    return {
        by_index[index]: how
        for index, how in setup.profile.pipelined.items()
        if index in by_index and how.axis == STAGE
    }


def _pipeline_data(setup: Setup, data: int, stages: int) -> Draft | str:
    """Pipeline stages x data: every stacked layer leaf `eqshard.parallel.pipeline` runs split
    over `stage` along its layer axis (GPipe's first, the circular schedule's second),
    copied over `data`; the batch over `data`."""
    if stages == 1:
        return "'stage' has one device: nothing to split"
    draft = Draft(batch=_batch(data, stages))
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
    build: Callable[[Setup, int, int], Draft | str]
    meshes: Literal["data", "model", "both"]
    splits_batch: bool = True
    same_as: tuple[str | None, str | None] | None = None
    applies: Callable[[Setup], bool] = lambda setup: True
    axis: Literal["model", "expert", "context", "stage"] = "model"
    batch_over_both: bool = False
    lacks: str = "the model has nothing it splits"


_NO_EXPERTS = (
    "the step's jaxpr shows no stacked experts: no weight that a matmul batches over "
    "(an einsum over the experts, vmap over their stack) or that jax.lax.ragged_dot "
    "groups by"
)
_NO_SEQUENCE = "the step's attention takes no named queries and keys: no sequence to split"
_NO_PIPELINE = "the step runs no eqshard.parallel.pipeline over the mesh axis 'stage'"

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
        applies=lambda setup: bool(sequence_names(setup)[0]),
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
        applies=lambda setup: bool(sequence_names(setup)[0]),
        lacks=_NO_SEQUENCE,
        axis="context",
    ),
    Family(
        "pipeline x data",
        "pipeline stages x data parallelism: the layers eqshard.parallel.pipeline runs split over "
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

if STRATEGIES != STRATEGY_NAMES:  # the command line's help lists `STRATEGY_NAMES`
    raise ImportError(
        f"eqshard's strategy table names {STRATEGIES}, but `_strategy_names.py` lists "
        f"{STRATEGY_NAMES}: list each family there, in the table's order"
    )

_FAMILY = {family.name: family for family in FAMILIES}


def meshes(families: Sequence[Family], devices: int) -> list[tuple[Family, int, int]]:
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


def same_as(family: Family, data: int, model: int) -> str | None:
    """Why a two-dimensional family on a mesh with an axis of size 1 is another."""
    if family.same_as is None:
        return None
    over_data, over_model = family.same_as
    if model == 1 and over_data is not None:
        same = candidate_name(over_data, data, 1)
        return f"the same layout as {same}: nothing is split over {family.axis!r}"
    if data == 1 and over_model is not None:
        other = _FAMILY[over_model]
        on = candidate_name(
            over_model, *((model, 1) if other.meshes == "data" else (1, model)), other.axis
        )
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
