"""The compiled step, and what `cost` reads of it.

`compile_step` is the one place a lowered step is compiled (`Compiled`: its HLO text
and XLA's analyses), with the cheaper options of `COSTING_OPTIONS` where it is
compiled only to be costed; `read_collectives` reads the HLO text's collectives (`_hlo/`)
with the mesh axes their device groups run over; `read_memory` splits XLA's memory
analysis into device and host memory beside the bytes the layouts hold (`Held`, by
part: parameters, state, optimizer).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._compat import memory_stats, module_cost_analysis
from .._errors import EqshardError
from .._fields import is_array_like
from .._plan import Plan
from .._report import LeafRow, leaf_rows, memory_kind
from .._sharding import AnyMesh
from .._step import Lowered
from ._hlo._collectives import CollectiveOp, collectives
from ._hlo._parse import Module, parse
from ._results import Collective, Memory

__all__ = [
    "COSTING_OPTIONS",
    "Compiled",
    "Held",
    "as_collectives",
    "compile_step",
    "costing_options",
    "parse_hlo",
    "read_collectives",
    "read_memory",
]

# A step compiled only to be costed (`cost(..., compile_for="costing")`) is compiled
# with less optimisation of its generated code, per compiler: options that leave every
# figure `cost` reads as it is (the HLO after SPMD partitioning, its collectives and
# FLOPs, and the buffer assignment that memory is read from) and only spend less time
# in the backend's code generation. XLA:CPU: 0.60-0.65x the compile time, with the
# same peak, arguments, outputs, temporaries, FLOPs and collectives in 24 of 24 pairs
# (issue 31); `tests/test_cost.py` checks them equal for MLP steps under data
# parallel, FSDP and Megatron rules and for the stacked GPT. XLA:TPU: none, so a TPU
# step compiles as it runs: on `v5e:2x4`, `xla_backend_optimization_level=0` gave the
# same figures in 0.95x the time for an FSDP MLP step with AdamW (0.41 s against
# 0.43 s, medians of 7) and 1.01x for the stacked GPT (2.32 s against 2.30 s,
# medians of 3), and `xla_llvm_disable_expensive_passes` 0.94x for the MLP (medians
# of 3): within a shared machine's noise. A GPU: none (not measured).
# Values as XLA's options are typed (`"true"` is no bool to it).
COSTING_OPTIONS: dict[str, dict[str, bool | int]] = {
    "cpu": {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True},
}


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What `cost` reads of a compiled step: its HLO text, XLA's memory analysis
    and its cost analysis (one dict); and the bytes per device of its arguments and
    outputs in host memory, from their shardings."""

    text: str
    memory: Any
    costs: dict[str, Any]
    host_arguments: int = 0
    host_outputs: int = 0
    options: tuple[str, ...] = ()


def costing_options(platform: str) -> dict[str, bool | int]:
    """The compiler options for a step compiled only to be costed on `platform`'s
    compiler (`"cpu"`, `"tpu"`, `"gpu"`): `COSTING_OPTIONS`' entry, else none."""
    return dict(COSTING_OPTIONS.get(platform, {}))


def compile_step(lowered: Lowered, options: dict[str, bool | int] | None = None) -> Compiled:
    """Compiles a step lowered by `eqshard.jit` for the devices its arguments are laid
    out on (the target: XLA:CPU for simulated devices, an accelerator's compiler for
    its own), with `options` for this compile only (`costing_options`), and keeps
    what `cost` reads."""
    compiled = lowered.compile(dict(options) if options else None)
    costs = _first(compiled.cost_analysis())
    if not costs:  # XLA:GPU compiling for GPUs it does not have reports none
        costs = module_cost_analysis(compiled)
    return Compiled(
        compiled.as_text() or "",
        compiled.memory_analysis(),
        costs,
        _host_bytes(lowered.abstract),
        _host_bytes(getattr(compiled, "out_info", ())),
        tuple(f"{name}={str(value).lower()}" for name, value in sorted((options or {}).items())),
    )


def _host_bytes(tree: Any) -> int:
    """The bytes per device of the arrays of `tree` (abstract, with shardings) held
    in host memory."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        sharding = getattr(x, "sharding", None)
        if memory_kind(sharding) is not None and hasattr(x, "shape"):
            shard = sharding.shard_shape(tuple(x.shape))  # pyright: ignore[reportOptionalMemberAccess]
            total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def _first(costs: Any) -> dict[str, Any]:
    """A cost analysis as one dict (some JAX releases give a list of them)."""
    if isinstance(costs, list):
        costs = costs[0] if costs else {}
    return dict(costs or {})


def parse_hlo(text: str, mesh: AnyMesh | None) -> Module:
    """A compiled program's HLO text, parsed (`replica_groups={}`: the mesh's devices
    where the text does not count them)."""
    return parse(text, devices=mesh.size if mesh is not None else 0)


def read_collectives(hlo: str | Module, mesh: AnyMesh | None) -> list[Collective]:
    """The collectives of a compiled program (its HLO text, or the text parsed), as
    `_hlo._collectives.collectives` reads them, each with the mesh axes its groups
    run over."""
    module = hlo if isinstance(hlo, Module) else parse_hlo(hlo, mesh)
    return as_collectives(collectives(module), mesh)


def as_collectives(ops: list[CollectiveOp], mesh: AnyMesh | None) -> list[Collective]:
    """`_hlo`'s collectives as `Cost` holds them, each with its mesh axes."""
    return [
        Collective(
            op.kind,
            op.bytes,
            _axes(op.groups, mesh),
            op.source,
            op.count,
            max((len(g) for g in op.groups), default=1),
            op.loop,
        )
        for op in ops
    ]


def _axes(groups: tuple[tuple[int, ...], ...], mesh: AnyMesh | None) -> tuple[str, ...]:
    """The mesh axes along which a collective's devices differ (its groups' ids are
    positions in the mesh's devices, row-major)."""
    if mesh is None or not groups:
        return ()
    shape = tuple(mesh.axis_sizes)
    if any(not 0 <= i < mesh.size for group in groups for i in group):
        raise EqshardError(
            f"a collective of the compiled step runs over devices {list(groups)}, and the mesh "
            f"has {mesh.size}; please report it to eqshard"
        )
    varying: set[int] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.array(group, dtype=int), shape)).T
        varying |= {a for a in range(len(shape)) if len(set(coords[:, a].tolist())) > 1}
    return tuple(name for a, name in enumerate(mesh.axis_names) if a in varying)


class Held:
    """The rows of what the step's arguments hold, by part: the model's parameters,
    its `eqx.nn.State`, the optimizer state."""

    def __init__(self) -> None:
        self.parameters: list[LeafRow] = []
        self.state: list[LeafRow] = []
        self.optimizer: list[LeafRow] = []

    def count(self, laid_out: Plan, part: str) -> None:
        """Adds the rows of `laid_out` to `part`, and those in an `eqx.nn.State` to
        `state`: a row per array leaf, in the order of `_in_state`'s flags."""
        rows = leaf_rows(laid_out)
        flags = _in_state(laid_out.resolved.model)
        assert len(rows) == len(flags)
        for row, in_state in zip(rows, flags):
            getattr(self, "state" if in_state else part).append(row)


def _in_state(tree: Any) -> list[bool]:
    """For each array leaf of `tree`, in order, whether it is in an `eqx.nn.State`."""
    flags = []
    is_state = lambda x: isinstance(x, eqx.nn.State)  # noqa: E731
    for part in jax.tree_util.tree_leaves(tree, is_leaf=is_state):
        if is_state(part):
            flags += [True] * sum(map(is_array_like, jax.tree_util.tree_leaves(part)))
        elif is_array_like(part):
            flags.append(False)
    return flags


def _bytes(rows: Any) -> int:
    """What one device holds of `rows` (a leaf not laid out counts nothing)."""
    return sum(row.bytes_per_device or 0 for row in rows)


def read_memory(held: Held, compiled: Compiled, platform: str) -> Memory:
    """The step's memory per device: the layouts' bytes by part, and XLA's memory
    analysis split into device and host memory, read as `platform`'s compiler (`"cpu"`,
    `"tpu"`, `"gpu"`) reports it (see `Memory`, whose `peak` follows the compiler)."""
    stats = memory_stats(compiled.memory)
    arguments = stats.arguments
    outputs = stats.outputs - stats.aliased
    host_arguments = stats.host_arguments
    host_outputs = stats.host_outputs - stats.host_aliased
    reported = stats.peak
    if not (host_arguments or host_outputs):  # counted with the device's: take them out
        host_arguments, host_outputs = compiled.host_arguments, compiled.host_outputs
        arguments, outputs = arguments - host_arguments, outputs - host_outputs
        if reported is not None:
            reported -= host_arguments + host_outputs
    every = [*held.parameters, *held.state, *held.optimizer]
    return Memory(
        parameters=_bytes(held.parameters),
        state=_bytes(held.state),
        optimizer=_bytes(held.optimizer),
        gradients=_bytes(
            row for row in held.parameters if jax.numpy.issubdtype(row.dtype, jax.numpy.inexact)
        ),
        arguments=max(arguments, 0),
        outputs=max(outputs, 0),
        temporaries=stats.temporaries,
        host=_bytes(row for row in every if row.on_host),
        host_arguments=max(host_arguments, 0),
        host_outputs=max(host_outputs, 0),
        reported_peak=None if reported is None else max(int(reported), 0),
        platform=platform,
    )
