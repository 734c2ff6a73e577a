"""`eqshard.diff`: what changes between two specs, leaf by leaf, and what it costs.

Both specs lay the model out abstractly on the same device count (no devices, as
`eqshard check` without a step), and a leaf is listed when what a device holds of it
differs: its block on some device, its part's shape, or the memory it is held in.
Two expressions that give every device the same blocks (`"o* i"` and `"o8 i"` on 8
devices, or the same split on meshes named differently) are the same layout, and
are not listed. With a step, both specs are costed (`eqshard.cost`), and the change
in memory per device and in communication per mesh axis is shown too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._cost._hardware import seconds_text
from .._errors import EqshardError, SpecError
from .._fit import mesh_text

if TYPE_CHECKING:
    from jaxtyping import PyTree

    from .._cost._results import Cost
    from .._plan import Plan, Spec
    from .._report import LeafRow
    from .._sharding import Devices

__all__ = ["Diff", "LeafChange", "diff"]


@dataclasses.dataclass(frozen=True)
class LeafChange:
    """One leaf laid out differently by the two specs.

    **Attributes:**

    - `path`: the leaf's dotted path in the model.
    - `part`: `"parameters"`, or `"optimizer state"` for its optimizer state (its
        moments), where a spec has an optimizer section.
    - `a`, `b`: its row under each spec (`LeafRow`: expression, `PartitionSpec`, bytes
        per device, memory kind).
    """

    path: str
    part: str
    a: LeafRow
    b: LeafRow

    def line(self) -> str:
        """`blocks.up.weight: '... o i -> ... o i' P() -> '... o i -> ... o* i'
        P(None, 'model', None) (128.0 KiB -> 16.0 KiB per device)`."""
        from .._report import human_bytes

        def side(row: LeafRow) -> str:
            expression = "(no expression)" if row.expression is None else repr(row.expression)
            spec = row.partition_spec or "kept where it is"
            where = f" in {row.memory_kind}" if row.memory_kind else ""
            return f"{expression} {spec}{where}"

        def held(row: LeafRow) -> str:
            n = row.bytes_per_device
            return "?" if n is None else human_bytes(n)

        name = self.path if self.part == "parameters" else f"{self.part} of {self.path}"
        return (
            f"{name}: {side(self.a)} -> {side(self.b)} "
            f"({held(self.a)} -> {held(self.b)} per device)"
        )


@dataclasses.dataclass(frozen=True)
class Diff:
    """What changes from spec `a` to spec `b` on one model.

    `print(diff)` shows it, a line per change. `to_json()` gives the same to machines.

    **Attributes:**

    - `a`, `b`: the specs' names (a spec file's path).
    - `devices`, `target`: the device count both were laid out on, and the TPU slice, if
        any.
    - `mesh`: each spec's mesh, as text (`data=8`, `data=2 x model=4`).
    - `batch`: each spec file's `"batch"`, or `None` for the default.
    - `leaves`: how many array leaves the model has.
    - `changes`: each leaf (and optimizer state) laid out differently, in model order,
        the optimizer states after the parameters.
    - `costs`: with a step, each spec's `Cost`; else `None`.
    """

    a: str
    b: str
    devices: int
    target: str | None
    mesh: tuple[str, str]
    batch: tuple[str | None, str | None]
    leaves: int
    changes: tuple[LeafChange, ...]
    costs: tuple[Cost, Cost] | None = None

    @property
    def same(self) -> bool:
        """Whether both specs lay everything out alike: every leaf and optimizer
        state, the mesh and the batch."""
        return not self.changes and self.mesh[0] == self.mesh[1] and self.batch[0] == self.batch[1]

    def lines(self) -> list[str]:
        """The diff as text: the mesh and the batch where they change, a line per
        leaf, a summary, and with a step the change in memory and communication."""
        lines = []
        if self.mesh[0] != self.mesh[1]:
            lines.append(f"mesh: {self.mesh[0]} -> {self.mesh[1]}")
        if self.batch[0] != self.batch[1]:
            lines.append(f"batch: {_batch_text(self.batch[0])} -> {_batch_text(self.batch[1])}")
        lines += [change.line() for change in self.changes]
        where = f"{self.devices} devices"
        if self.target is not None:
            where = f"{self.target} ({where})"
        parameters = sum(c.part == "parameters" for c in self.changes)
        states = len(self.changes) - parameters
        if self.same:
            lines.append(
                f"{self.a} and {self.b} lay out the {self.leaves} array leaves alike on {where}"
            )
        else:
            summary = (
                f"on {where}, {parameters} of {self.leaves} array leaves are laid out differently"
            )
            lines.append(summary + (f", and the optimizer states of {states}" if states else ""))
        if self.costs is not None:
            lines += _cost_lines(*self.costs)
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_json(self) -> dict[str, Any]:
        """The diff as JSON: `same`, the specs, the meshes and batches, each change
        with both rows, and with a step both costs' figures."""
        document: dict[str, Any] = {
            "same": self.same,
            "a": self.a,
            "b": self.b,
            "devices": self.devices,
            "target": self.target,
            "mesh": {"a": self.mesh[0], "b": self.mesh[1]},
            "batch": {"a": self.batch[0], "b": self.batch[1]},
            "leaves": self.leaves,
            "changes": [
                {
                    "path": c.path,
                    "part": c.part,
                    "a": dataclasses.asdict(c.a),
                    "b": dataclasses.asdict(c.b),
                }
                for c in self.changes
            ],
            "cost": None,
        }
        if self.costs is not None:
            document["cost"] = {"a": _cost_json(self.costs[0]), "b": _cost_json(self.costs[1])}
        return document


def _batch_text(batch: str | None) -> str:
    return "(the default)" if batch is None else repr(batch)


def _cost_json(c: Cost) -> dict[str, Any]:
    from ._ranked import communication

    estimate = c.estimate()
    return {
        "peak": c.memory.peak,
        "parameters": c.memory.parameters,
        "state": c.memory.state,
        "optimizer": c.memory.optimizer,
        "communication": communication(c),
        "estimate": {"hardware": estimate.hardware.name, "seconds": estimate.seconds},
        "compiler": c.compiler,
        "batch": c.batch,
        "explained": c.explain().lines(),  # why each collective moves, most bytes first
    }


def _change(a: int, b: int) -> str:
    """`1.2 MiB -> 600.0 KiB (-50%)`."""
    from .._report import human_bytes

    text = f"{human_bytes(a)} -> {human_bytes(b)}"
    if a and a != b:
        text += f" ({(b - a) / a:+.0%})"
    return text


def _cost_lines(a: Cost, b: Cost) -> list[str]:
    """The change in memory per device, communication per mesh axis, and estimate."""
    from .._report import human_bytes
    from ._ranked import communication

    peak = "peak" if a.target else "peak (XLA:CPU)"
    memory = [f"{peak} {_change(a.memory.peak, b.memory.peak)}"]
    for part in ("parameters", "state", "optimizer"):
        x, y = getattr(a.memory, part), getattr(b.memory, part)
        if x or y:
            memory.append(f"{part} {_change(x, y)}")
    moved_a, moved_b = communication(a), communication(b)
    moved = []
    for axes in dict.fromkeys([*moved_a, *moved_b]):
        x, y = moved_a.get(axes), moved_b.get(axes)
        if x is None or y is None:
            x_text = "none" if x is None else human_bytes(x)
            y_text = "none" if y is None else human_bytes(y)
            moved.append(f"{axes} {x_text} -> {y_text}")
        else:
            moved.append(f"{axes} {_change(x, y)}")
    ea, eb = a.estimate(), b.estimate()
    return [
        f"memory per device: {', '.join(memory)}",
        f"communication per step: {', '.join(moved) or 'none in either'}",
        f"estimate on {ea.hardware.name}: {seconds_text(ea.seconds)} -> "
        f"{seconds_text(eb.seconds)} (compiled by {a.compiler})",
        *(f"why, in A: {line}" for line in a.explain().lines(_WHY)),
        *(f"why, in B: {line}" for line in b.explain().lines(_WHY)),
    ]


_WHY = 2  # the collectives of each spec that move the most bytes, explained


@functools.lru_cache(maxsize=4096)
def _blocks(
    sizes: tuple[int, ...], names: tuple[str, ...], spec: tuple[Any, ...], ndim: int
) -> bytes:
    """Which block of each array dimension each device holds, device by device in
    the mesh's row-major order (einshard's order): the layout itself, whatever the
    mesh's axes are called or how they are cut."""
    n = math.prod(sizes)
    coords = np.unravel_index(np.arange(n), sizes) if sizes else ()
    axis = {name: k for k, name in enumerate(names)}
    blocks = np.zeros((n, ndim), dtype=np.int64)
    for dim, entry in enumerate(spec[:ndim]):
        for name in () if entry is None else (entry,) if isinstance(entry, str) else entry:
            k = axis[name]
            blocks[:, dim] = blocks[:, dim] * sizes[k] + coords[k]
    return blocks.tobytes()


def _layout_key(sharding: Any, shape: tuple[int, ...]) -> Any:
    """What a device holds of a leaf under `sharding`, comparable across meshes: its
    part's shape, its blocks device by device, and its memory kind; `None` for a
    leaf with no sharding."""
    if sharding is None:
        return None
    from .._report import memory_kind

    mesh = sharding.mesh
    sizes, names = tuple(int(s) for s in mesh.axis_sizes), tuple(mesh.axis_names)
    return (
        tuple(sharding.shard_shape(shape)),
        _blocks(sizes, names, tuple(sharding.spec), len(shape)),
        memory_kind(sharding),
    )


def _laid_out(p: Plan) -> dict[str, tuple[LeafRow, Any]]:
    """Each array leaf's row and layout key, by path."""
    from .._fields import is_array_like
    from .._report import leaf_rows

    shardings = [s for leaf, s in zip(p.resolved.leaves, p.flat_shardings) if is_array_like(leaf)]
    return {row.path: (row, _layout_key(s, row.shape)) for row, s in zip(leaf_rows(p), shardings)}


def _changes(a: Plan, b: Plan, part: str) -> list[LeafChange]:
    laid_a, laid_b = _laid_out(a), _laid_out(b)
    return [
        LeafChange(path, part, row, laid_b[path][0])
        for path, (row, key) in laid_a.items()
        if path in laid_b and laid_b[path][1] != key
    ]


def _plan_mesh(p: Plan) -> str:
    if p.mesh is None:
        return "none shared (each leaf its own)"
    return mesh_text(zip(p.mesh.axis_names, (int(s) for s in p.mesh.axis_sizes)))


def _spec_name(spec: Any) -> str:
    from .._specfile._model import Rules

    if isinstance(spec, Rules):
        return spec.source
    return str(spec) if isinstance(spec, str) else type(spec).__name__


def diff(
    model: PyTree[Any],
    a: Spec,
    b: Spec,
    *args: PyTree[Any],
    step: Callable[..., Any] | None = None,
    devices: Devices = None,
    simulate: int | None = None,
    target: str | None = None,
) -> Diff:
    """What changes from spec `a` to spec `b`: the leaves laid out differently, and with
    a step, the change in memory per device and communication per step.

    **Example:**

    ```python
    d = eqshard.diff(model, Path("dp.eqshard.json"), Path("fsdp.eqshard.json"), simulate=8)
    print(d)             # a line per leaf laid out differently, with both sides
    d.same               # False
    d = eqshard.diff(model, a, b, opt_state, batch, step=step, simulate=8)
    d.costs              # (Cost of a, Cost of b)
    ```

    **Arguments:**

    - `model`: the model, concrete or abstract, or a `(model, state)` pair (both laid out).
    - `a`, `b`: the specs, as `eqshard.plan` takes them, but not a `Plan`.
    - `*args`: with `step`, its other arguments, as `eqshard.cost` takes them.
    - `step`: the training step, to cost both specs with `eqshard.cost`; `None` by default.
    - `devices`: this process's devices to lay out (and compile) on: a count or a list.
    - `simulate`: or a count of devices this process need not have: laid out abstractly.
    - `target`: or a TPU slice (`"v5e:4x4"`): its devices, compiled for by XLA:TPU.

    **Returns:**

    A `Diff`; `diff.same` when both lay out everything alike.

    **Raises:**

    - `eqshard.SpecError`: a spec does not lay the model out (the first's faults first).
    - `eqshard.UsageError`: `devices` with `simulate`.
    - `eqshard.EqshardError`: `args` without a step, a `target` with `devices` or
        `simulate`, or as `eqshard.cost` raises.

    With none of the three, the count is `a`'s spec file's `"devices"`, else `b`'s,
    else 8, simulated. A `devices=n` over this process's device count keeps its old
    meaning, `simulate=n`, with a `DeprecationWarning`. A stateful model's step takes
    the model alone first, and its state among `args`.
    """
    from .._fields import is_stateful_pair
    from .._plan import Plan, plan
    from .._specfile._model import Rules
    from .._specfile._read import read_path

    if args and step is None:
        raise EqshardError(
            "arguments after the specs are the step's: pass `step=` too, or leave them out"
        )
    specs = []
    for spec in (a, b):
        if isinstance(spec, Plan):
            raise EqshardError(
                "`eqshard.diff` lays both specs out on the same devices: pass the spec a "
                "`Plan` was made from, not the plan"
            )
        specs.append(read_path(spec))
    n, listed = _device_count(specs, devices, simulate, target)
    on = listed if listed is not None else n  # this process's devices, or a count, abstractly
    plans = []
    for spec in specs:
        try:
            plans.append(plan(model, spec, devices=on) if listed else plan(model, spec, simulate=n))
        except SpecError as error:  # which of the two, in the headline
            on_what = f"{n} devices" if target is None else target
            headline = f"{_spec_name(spec)} does not lay the model out on {on_what}"
            raise SpecError(error.problems, headline) from None
    changes = _changes(plans[0], plans[1], "parameters")
    if plans[0].section is not None or plans[1].section is not None:
        changes += _changes(plans[0].optimizer, plans[1].optimizer, "optimizer state")
    batch = tuple(
        None if not isinstance(spec, Rules) or spec.batch is None else str(spec.batch)
        for spec in specs
    )
    costs = None
    if step is not None:
        import jax

        from .._cost._driver import cost

        first = model[0] if is_stateful_pair(model) else model
        where: dict[str, Any] = {}  # this process's devices, else `n` simulated in a worker
        if target is None:
            here = listed or n <= len(jax.devices())
            where = {"devices": on} if here else {"simulate": n}
        costs = tuple(
            cost(first, *args, step=step, spec=spec, target=target, **where) for spec in specs
        )
    return Diff(
        _spec_name(specs[0]),
        _spec_name(specs[1]),
        n,
        target,
        (_plan_mesh(plans[0]), _plan_mesh(plans[1])),
        (batch[0], batch[1]),
        len(_laid_out(plans[0])),
        tuple(changes),
        None if costs is None else (costs[0], costs[1]),
    )


def _device_count(
    specs: Sequence[Any], devices: Devices, simulate: int | None, target: str | None
) -> tuple[int, tuple[Any, ...] | None]:
    """The count both specs are laid out on (the slice's, `devices`', `simulate`, the
    files' `"devices"`, the first's, or 8), and this process's devices where they are
    laid out on them."""
    if target is not None or devices is not None or simulate is not None:
        from ._suggest import placement

        n, _, listed = placement(devices, simulate, target, stacklevel=4)
        return n, listed
    declared = [getattr(spec, "devices", None) for spec in specs]
    return next((d for d in declared if d is not None), 8), None
