"""A candidate's figures before it is compiled: exact bytes held, estimated the rest.

`suggest` compiles a candidate to know its peak memory and its collectives, and a
compile of a large model on XLA:TPU takes half a minute. Before any compile, each
candidate gets an `Estimated` from what is known without the compiler:

- **exact:** what each device holds of the parameters, the `eqx.nn.State`, the
    optimizer state and the batch (the plan's shard shapes), and of the gradients
    (the parameters' layouts);
- **estimated:** the activations the forward pass keeps for the gradient, the
    collectives per mesh axis, the FLOPs and the bytes accessed, from the layouts and
    the step's jaxpr (`_profile.step_profile`): the gradients of what is copied over
    `data` all-reduced over it, what is split over `data` gathered for use and its
    gradient scattered back, and Megatron's all-reduce over `model` after each
    row-parallel matmul and before each column-parallel one's gradient.

The arguments are a lower bound of the peak on every compiler, so a candidate whose
arguments alone exceed the memory limit certainly does not fit; everything else an
estimate says is a guess, and is shown as one (`Estimated.seconds` is a roofline of
guessed figures), never as what the compiler said.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._cost._hardware import Estimate, Hardware, Moved, roofline
from .._report import leaf_rows
from ._profile import Role, StepProfile

__all__ = ["Estimated", "HeldLeaf", "estimated"]


@dataclasses.dataclass(frozen=True)
class HeldLeaf:
    """An array leaf of the model (or its state), as the estimate sees it.

    - `index`: its index in the model's leaves, as the step's profile names it.
    - `role`: its Megatron role, if any.
    - `parameter`: a parameter of the model (its gradient is taken), not state.
    - `inexact`: of a floating dtype (it has a gradient).
    - `dtype`: its dtype's name.
    """

    index: int
    role: Role | None
    parameter: bool
    inexact: bool
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class Estimated:
    """A candidate's figures per device, before it is compiled.

    **Attributes:**

    - `parameters`, `state`, `optimizer`, `batch`, `gradients`: the bytes each device
        holds of them, exact (from the layouts).
    - `activations`: the bytes of the forward pass's matmul outputs each device keeps
        for the gradient: an estimate.
    - `collectives`: `(axes, kind, bytes, group size)` of each collective one step
        runs on each device: an estimate (`axes` as `"data"`, `"model"`).
    - `flops`, `bytes_accessed`: per device, estimates.
    - `dtype`: the parameters' most common dtype, whose peak FLOPs the estimate takes.
    """

    parameters: int
    state: int
    optimizer: int
    batch: int
    gradients: int
    activations: int
    collectives: tuple[tuple[str, str, int, int], ...]
    flops: float
    bytes_accessed: float
    dtype: str = "float32"

    @property
    def arguments(self) -> int:
        """What the step's arguments hold on each device: exact, and a lower bound of
        its peak on any compiler."""
        return self.parameters + self.state + self.optimizer + self.batch

    @property
    def peak(self) -> int:
        """The arguments, the gradients and the kept activations: an estimate."""
        return self.arguments + self.gradients + self.activations

    def communication(self) -> dict[str, int]:
        """The bytes one step moves on each device, by the mesh axes (estimated)."""
        moved: dict[str, int] = {}
        for axes, _, n, _ in self.collectives:
            moved[axes] = moved.get(axes, 0) + n
        return moved

    def estimate(self, hardware: Hardware) -> Estimate:
        """The roofline of these figures on `hardware`: a guess, never a measurement."""
        moved = [Moved(kind, n, group) for _, kind, n, group in self.collectives]
        return roofline(hardware, self.flops, self.bytes_accessed, self.dtype, moved)


def _axes(sharding: Any) -> set[str]:
    """The mesh axes of size above 1 that split a leaf."""
    if sharding is None:
        return set()
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes))
    found: set[str] = set()
    for entry in sharding.spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        found.update(name for name in names if sizes[name] > 1)
    return found


def estimated(
    plan: Any,
    leaves: Sequence[HeldLeaf],
    optimizer_plans: Sequence[Any],
    batch: Sequence[int],
    profile: StepProfile,
    mesh: Sequence[tuple[str, int]],
    *,
    splits_batch: bool,
    optimizer_apart: bool,
    spread: bool = False,
) -> Estimated:
    """The `Estimated` of one candidate.

    **Example:**

    ```python
    found = estimated(plan, leaves, [opt_plan], [batch_bytes], profile,
                      (("data", 4), ("model", 2)), splits_batch=True, optimizer_apart=False)
    found.arguments, found.peak, found.communication()
    ```

    **Arguments:**

    - `plan`: the candidate's `Plan` of the model (and its state), made on a count.
    - `leaves`: each array leaf of the plan, in order.
    - `optimizer_plans`: the plans of the step's arguments built from the model.
    - `batch`: the bytes of each batch leaf, whole.
    - `profile`: the step's jaxpr, read (`step_profile`).
    - `mesh`: `(("data", d), (axis, m))`, the second axis `"model"`, `"expert"` or
        `"context"`.
    - `splits_batch`: whether the batch is split over `data`.
    - `optimizer_apart`: whether the optimizer state has a layout of its own (ZeRO-1:
        split over `data` while the parameters are whole).
    - `spread`: whether the activations are split over the second axis too (by
        expert, or by sequence), so a leaf copied over it has its gradient summed
        over it as well.

    **Returns:**

    An `Estimated`.
    """
    sizes = dict(mesh)
    data, model = sizes.get("data", 1), sizes.get("model", 1)
    devices = int(np.prod([size for _, size in mesh]))
    ((second, across),) = [(n, size) for n, size in mesh if n != "data"] or [("model", 1)]
    rows = leaf_rows(plan)
    shardings = [
        s for leaf, s in zip(plan.resolved.leaves, plan.flat_shardings) if hasattr(leaf, "shape")
    ]
    assert len(rows) == len(leaves) == len(shardings)
    parameters = state = gradients = 0
    collectives: list[tuple[str, str, int, int]] = []
    by_leaf: dict[int, set[str]] = {}
    for i, (row, leaf, sharding) in enumerate(zip(rows, leaves, shardings)):
        held = row.bytes_per_device or 0
        axes = _axes(sharding)
        by_leaf[i] = axes
        if not leaf.parameter:
            state += held
            continue
        parameters += held
        if not leaf.inexact:
            continue
        gradients += held
        if spread and across > 1 and second not in axes:  # summed over the second axis too
            over = f"data+{second}" if data > 1 and "data" not in axes else second
            group = across * (data if "+" in over else 1)
            collectives.append((over, "all-reduce", held, group))
            if "+" in over:
                continue
        if data == 1:
            continue
        if "data" in axes:  # FSDP: gathered for use, its gradient scattered back
            collectives += [
                ("data", "all-gather", held * data, data),
                ("data", "reduce-scatter", held * data, data),
            ]
        elif optimizer_apart:  # ZeRO-1: the gradient scattered, the update gathered
            collectives += [
                ("data", "reduce-scatter", held, data),
                ("data", "all-gather", held, data),
            ]
        else:
            collectives.append(("data", "all-reduce", held, data))
    optimizer = sum(row.bytes_per_device or 0 for p in optimizer_plans for row in leaf_rows(p))
    share = (data if splits_batch else 1) * (across if spread else 1)
    held_batch = sum(-(-n // share) for n in batch)
    activations = 0
    grouped: set[tuple[int, int, int]] = set()
    index = {leaf.index: k for k, leaf in enumerate(leaves) if leaf.parameter}
    for m in profile.matmuls:
        k = index.get(m.leaf)
        role = None if k is None else leaves[k].role
        split = k is not None and "model" in by_leaf[k]
        column = split and role is not None and role.kind in ("column", "vocab")
        activations += m.output * m.trips // share // (model if column else 1)
        if not split or role is None or model == 1:
            continue
        if role.kind == "row" or (role.kind == "embedding" and m.activation == 0):
            collectives.append(("model", "all-reduce", m.output * m.trips // share, model))
        elif role.kind in ("column", "vocab") and m.activation:
            key = (m.activation, m.trips, m.source)
            if key not in grouped:  # matmuls of one activation: one all-reduce of its gradient
                grouped.add(key)
                collectives.append(("model", "all-reduce", m.activation * m.trips // share, model))
    flops = profile.flops / devices
    arguments = parameters + state + optimizer + held_batch
    bytes_accessed = 2.0 * arguments + 2.0 * gradients + 3.0 * activations
    dtypes = [leaf.dtype for leaf in leaves if leaf.parameter]
    return Estimated(
        parameters,
        state,
        optimizer,
        held_batch,
        gradients,
        activations,
        tuple(collectives),
        float(flops),
        float(bytes_accessed),
        max(set(dtypes), key=dtypes.count) if dtypes else "float32",
    )
