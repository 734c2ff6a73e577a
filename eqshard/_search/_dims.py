"""The names a candidate's `"dims"` map: which of the names the step gives its
activations (traced under `_activations.recording`) are the sequence's, the
experts', their groups' and a split weight's output, from the step's profile, never
from the names; and `activation_dims`, each name's mesh axis for a family."""

from __future__ import annotations

from typing import Protocol

from ._setup import Draft, Setup

__all__ = ["activation_dims", "expert_names", "over_model", "sequence_names"]


class Splitting(Protocol):
    """What `activation_dims` reads of a family (`_families.Family`)."""

    @property
    def name(self) -> str: ...
    @property
    def axis(self) -> str: ...
    @property
    def splits_batch(self) -> bool: ...


def sequence_names(setup: Setup) -> tuple[frozenset[str], frozenset[str]]:
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


def expert_names(setup: Setup) -> frozenset[str]:
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


def over_model(setup: Setup, draft: Draft) -> frozenset[str]:
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


def activation_dims(
    setup: Setup, family: Splitting, draft: Draft, model: int
) -> dict[str, str | None]:
    """The rules' `"dims"` for the names the model gives its activations: the batch's
    over `data` (over both axes for `data x expert`), the experts' over the axis that
    splits the experts (else whole), the groups in the experts' buffers over `data`
    (whole where `data` splits the experts), the sequence over `context`, a
    column-parallel output over `model`; every other name whole."""
    # a name on the experts' axis is the experts' (a buffer's leading axis may have
    # the batch's size)
    batch = setup.batch_names - expert_names(setup) if family.splits_batch else frozenset()
    if family.axis == "expert":
        experts = expert_names(setup)
        groups = _expert_groups(setup, experts)
        return {
            n: "*" if n in batch else "expert" if n in experts else "data" if n in groups else None
            for n in setup.activations
        }
    if family.axis == "context":
        sequence, _ = sequence_names(setup)
        return {
            n: "data" if n in batch else "context" if n in sequence else None
            for n in setup.activations
        }
    by_model = over_model(setup, draft) if model > 1 and family.axis == "model" else frozenset()
    experts = expert_names(setup)
    if family.name == "expert parallel":  # each device its experts, the groups whole
        over_data = batch | experts
    else:  # every expert on every device, each device its groups in the buffers
        over_data = batch | (_expert_groups(setup, experts) if family.splits_batch else set())
    return {
        n: "data" if n in over_data else "model" if n in by_model else None
        for n in setup.activations
    }


def _expert_groups(setup: Setup, experts: frozenset[str]) -> frozenset[str]:
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
