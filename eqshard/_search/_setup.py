"""What every candidate of `eqshard suggest` is built from: the step traced once
(`setup_of`: the model's leaves with their roles from the step's profile, the batch's
leaves, the names the model gives its activations) and a candidate's `Draft`, before
its rules are written."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np

from .._activations import recording
from .._arguments import is_built  # a batch is what `cost` (and `eqshard.jit`) take for one
from .._derive import derived_plan
from .._fields import LeafInfo, is_array_like, leaf_name, walk_fields
from .._paths._names import segments
from .._pipeline import marking
from .._plan import plan_faults
from .._specfile._model import Rules
from ._profile import Role, StepProfile, abstract_leaf, step_profile

__all__ = ["SOURCE", "Draft", "Leaf", "Setup", "setup_of"]

SOURCE = "<candidate>"  # the source the candidates' rules name


@dataclasses.dataclass(frozen=True)
class Leaf:
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
class Setup:
    """What every candidate is built from: the leaves with their roles, the batch's
    leaves, and what the rules are planned for."""

    planned_for: Any
    leaves: tuple[Leaf, ...]
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


def setup_of(step: Callable[..., Any], model: Any, args: Sequence[Any], devices: int) -> Setup:
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
        Leaf(
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
    whole = plan_faults(planned_for, "... -> * ...", devices=devices).plan
    batch: list[tuple[str, tuple[int, ...]]] = []
    batch_bytes: list[int] = []
    built: list[Any] = []
    for k, arg in enumerate(args):
        if isinstance(arg, eqx.nn.State):
            continue
        if is_built(derived_plan(arg, whole)):
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
    return Setup(
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


@dataclasses.dataclass
class Draft:
    """A candidate before its rules are written: each ruled leaf's (comment,
    expression), the default, the optimizer section, the batch, the repairs."""

    ruled: dict[int, tuple[str, str]] = dataclasses.field(default_factory=dict)
    default: Literal["replicate", "fsdp"] = "replicate"
    optimizer: Rules | None = None
    batch: str = "... -> * ..."
    repairs: list[str] = dataclasses.field(default_factory=list)
