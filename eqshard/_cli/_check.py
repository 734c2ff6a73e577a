"""`eqshard check`: resolve a spec file against an abstract model, on N devices.

Nothing here touches device memory: the model is built with
`eqx.filter_eval_shape` (`_usercode.abstract_model`). Layouts need no devices
either: each device count is laid out on an abstract mesh (`plan_faults(...,
devices=n)`), so 65,536 devices cost what 8 do. Only a step to compile (`--step`)
needs devices: a subset of simulated devices, or a TPU slice's (`--target
v5e:4x4`), which XLA:TPU compiles for on this machine through libtpu.

`check` gives a `CheckResult` per device count: the leaves' rows, every problem,
the warnings, and with a step its cost (`eqshard.cost`, as JSON). The command line
runs it in worker processes (`_check_workers.py`) and prints it as tables and
lines (`_check_table.py`). This module imports JAX only when a check runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import EqshardError
from .._problems import Problem, problem_of
from .._process._usercode import StepInputs, call
from .._specfile._model import Rules
from .._warnings import EqshardWarning

if TYPE_CHECKING:
    from .._cost._targets import CompileTarget
    from .._report import LeafRow

__all__ = [
    "HBM",
    "CheckResult",
    "check",
    "check_slices",
    "devices_text",
    "limit_text",
    "needed_text",
]


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What `check` found for one device count.

    `notes` are the warnings as text, one per place (a rule that gave no leaf its
    expression, layouts that group devices in ways that disagree), and `warnings`
    the same as data (`EqshardWarning.to_json()`: an unused rule's `rule`,
    `did_you_mean` and `leaves` too); under `strict` they are problems instead.

    `state_leaves` is how many of the last `rows` are the leaves of the model's
    `eqx.nn.State`, where `--model` builds `(model, state)`.

    `cost`, with a step to compile (`--step`), is what one step costs per device:
    `parameters`, `state` (the model's `eqx.nn.State`), `optimizer`, `gradients`,
    `host` (what of those is held in host memory), `host_arguments` and
    `host_outputs` (the step's, in host memory) and `peak` in bytes, device
    memory only (`peak_lower_bound`, the same figure, kept for earlier readers), with
    `reported_peak` (the compiler's own) and `peak_includes` (what `peak` counts, as
    `Memory.peak_includes` says: on XLA:CPU its arguments, outputs and temporaries,
    on XLA:TPU its own peak), `flops` and `bytes_accessed`, `communication`
    (a list of `{"kind", "axes", "bytes"}`, one per kind of collective and mesh
    axes), `estimate_h100_seconds` and `estimate` (`{"hardware", "seconds"}`, on
    the target's chip, else an H100); `compiler` (whose figures these are),
    `target`, `memory_per_device` (the chip's HBM) and `fits` (the peak within
    it; `None` without a target), and `batch` (the expression the batch was laid
    out by, or the place of the file's batch rules: `spec.json::$.batch`). What
    compiling the step warned of (batch leaves its rules left whole, batch rules
    that matched no leaf) joins `notes` and `warnings`.

    `target` is the TPU slice the check was made for (`--target`), whose device
    count is `devices`; `max_memory`, where there is a limit, is
    `{"bytes", "from", "needed", "fits"}`: the limit, where it comes from
    (`"--max-memory"`, or `"the chip's HBM"` with a target and no `--max-memory`),
    what the check needs per device in device memory (the step's peak, else the
    parameters and state not held in host memory), and whether that is within the
    limit.
    """

    source: str
    devices: int
    rows: list[LeafRow]
    problems: list[Problem]
    notes: list[str]
    cost: dict[str, Any] | None = None
    warnings: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    state_leaves: int = 0
    target: str | None = None
    max_memory: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bytes_per_device(self) -> int | None:
        from .._report import total_bytes_per_device

        return total_bytes_per_device(self.rows)

    @property
    def coverage(self) -> dict[str, int]:
        """How many array leaves rules, dims and the default each gave an expression."""
        return _coverage(self.rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.source,
            "devices": self.devices,
            "ok": self.ok,
            "leaves": [dataclasses.asdict(row) for row in self.rows],
            "bytes_per_device": self.bytes_per_device,
            "state_leaves": self.state_leaves,
            "coverage": self.coverage,
            "problems": [p.to_json() for p in self.problems],
            "notes": self.notes,
            "warnings": self.warnings,
            "cost": self.cost,
            "target": self.target,
            "max_memory": self.max_memory,
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> CheckResult:
        """The result that a `to_json()` document describes.

        `ok`, `bytes_per_device` and `coverage` follow from the rows and problems,
        so they are not read. A problem keeps its `file` where its entry has one:
        `to_json` writes it wherever the problem's `where` names the file (every
        problem `check` makes), and `_check_workers.main_worker` writes every problem whole, so
        the results it sends come back equal.

        **Arguments:**

        - `document`: a mapping with the keys `file`, `devices`, `leaves`,
            `problems` and `notes` (and `cost`, `warnings`, `state_leaves`, `target`
            and `max_memory`, which may be missing), as
            `to_json()` (or the worker) wrote them.

        **Returns:**

        A `CheckResult` equal to the one that was written.

        **Raises:**

        `KeyError`, `TypeError` or `ValueError` when `document` is not such a mapping.
        """
        return cls(
            source=str(document["file"]),
            devices=int(document["devices"]),
            rows=[_leaf_row(entry) for entry in document["leaves"]],
            problems=[problem_of(entry) for entry in document["problems"]],
            notes=[str(note) for note in document["notes"]],
            cost=None if document.get("cost") is None else dict(document["cost"]),
            warnings=[dict(entry) for entry in document.get("warnings") or []],
            state_leaves=int(document.get("state_leaves") or 0),
            target=None if document.get("target") is None else str(document["target"]),
            max_memory=None if document.get("max_memory") is None else dict(document["max_memory"]),
        )


def _leaf_row(entry: Mapping[str, Any]) -> LeafRow:
    """The row a `dataclasses.asdict(row)` entry describes (JSON makes its shape and
    its stages lists)."""
    from .._report import LeafRow

    names = {field.name for field in dataclasses.fields(LeafRow)}
    values = {key: value for key, value in entry.items() if key in names}
    values["shape"] = tuple(values["shape"])
    if values.get("stages") is not None:
        values["stages"] = tuple(tuple(held) for held in values["stages"])
    return LeafRow(**values)


def _coverage(rows: Sequence[LeafRow]) -> dict[str, int]:
    """How many array leaves rules, dims and the default gave an expression, and how
    many got none (under `"default": "error"`, or where a dim did not fit)."""
    counts = {"rules": 0, "dims": 0, "default": 0, "none": 0}
    for row in rows:
        if row.expression is None:
            key = "none"
        elif (row.origin or "").startswith("$.rules"):
            key = "rules"
        else:  # "dims", or "default" (and "default (fsdp)")
            key = (row.origin or "default").partition(" (")[0]
        counts[key] = counts.get(key, 0) + 1
    return counts


def check(
    rules: Rules,
    model: Any,
    device_counts: Sequence[int | str],
    *,
    strict: bool = False,
    step: StepInputs | None = None,
    max_memory: int | None = None,
    batch: str | None = None,
    compiling: Callable[[str | None], None] | None = None,
) -> list[CheckResult]:
    """Lays out `model` under `rules` on each device count; collects every fault.

    Every leaf that can be laid out is, so one run reports every independent fault:
    expressions that do not fit, the file's device count, unmatched leaves under
    `"default": "error"`, and (with `strict`) rules that match nothing. The layouts
    are made for the count, abstractly, so a count may be more than this process
    has devices. A TPU slice's name (`"v5e:4x4"`) among `device_counts` checks on
    its devices' count, and with `step` compiles for the slice with XLA:TPU. With
    `step`, the plan is made on the first `n` of `jax.devices()` (the same
    layouts) and the step is compiled over the laid-out arguments
    (`eqshard.cost`, the batch laid out by `batch`, else by the file's `"batch"`,
    else its default), so each result has its cost. With `max_memory` (bytes per
    device), or on a slice without it its chip's HBM, a check whose peak (without
    `step`: its parameters per device) is more has a problem; both count device
    memory only, not leaves a rule holds in host memory (`"pinned_host"`).
    `compiling`, where given, is told what step is compiled while it is (`"the step
    under spec.json on 8 devices"`), then `None`: a worker that dies meanwhile (XLA
    aborting it) is said to die compiling it (`_check_workers.py`).
    """
    import jax

    from .._fields import is_array_like, is_stateful_pair
    from .._plan import plan_faults
    from .._report import device_bytes_per_device, leaf_rows

    state_leaves = 0
    if is_stateful_pair(model):
        state_leaves = sum(map(is_array_like, jax.tree_util.tree_leaves(model[1])))
    results = []
    for entry in device_counts:
        if isinstance(entry, int):
            on, n = None, entry
        else:
            on = _slice(entry)
            n = len(on.devices)
        on_cpu = step is not None and on is None  # compiled here, on simulated devices
        planned = plan_faults(model, rules, devices=jax.devices()[:n] if on_cpu else n)
        problems = list(planned.problems)
        notes: list[str] = []
        warnings: list[dict[str, Any]] = []
        cost = None
        found = list(planned.warnings)
        if step is not None and not planned.problems:  # one that cannot be laid out: no step
            spec = rules if on is not None else planned.plan  # a slice plans on its devices
            target = None if on is None else on.name
            if compiling is not None:
                compiling(f"the step under {rules.source} on {devices_text(n, target)}")
            cost, warned = _cost_entry(step, model, spec, n, target, batch)
            found += warned  # the batch's: leaves its rules left whole, rules unused
            if compiling is not None:
                compiling(None)
        for warning in found:
            if strict:
                problems += [
                    Problem(p.where, f"{p.message} (--strict)", p.detail, p.file)
                    for p in warning.problems
                ]
            else:
                notes += [str(p) for p in warning.problems]
                warnings += warning.to_json()
        rows = leaf_rows(planned.plan)
        limit = _limit(max_memory, on)
        if limit is not None:
            needed = cost["peak"] if cost is not None else device_bytes_per_device(rows)
            if needed is not None:
                limit = {**limit, "needed": needed, "fits": needed <= limit["bytes"]}
                if not limit["fits"]:
                    where = devices_text(n, None if on is None else on.name)
                    what = needed_text(cost, state_leaves)
                    problems.append(_memory_problem(rules.source, where, needed, what, limit))
        results.append(
            CheckResult(
                rules.source,
                n,
                rows,
                problems,
                notes,
                cost,
                warnings,
                state_leaves,
                None if on is None else on.name,
                limit,
            )
        )
    return results


HBM = "the chip's HBM"  # where a check on a TPU slice takes its memory limit from


def _slice(name: str) -> CompileTarget:
    """The TPU slice `name`."""
    from .._cost._targets import compile_target

    return compile_target(name)


def check_slices(names: Sequence[str], devices: Sequence[int] | None = None) -> None:
    """Checks that each of `names` is a TPU slice this machine can compile for, and
    that `devices` (`--devices`, where given with `--target`) is its device count.

    **Raises:**

    `EqshardError` for a name that is no slice (as `eqshard.cost`'s `target=`);
    `UsageError` (exit code 2) where libtpu is not installed, or where `devices`
    holds another count than a slice's.
    """
    from .._errors import UsageError

    for name in names:
        on = _slice(name)
        if devices and set(devices) != {len(on.devices)}:
            given = " ".join(map(str, dict.fromkeys(devices)))
            raise UsageError(
                f"--device-counts {given} and --target {name}: the slice has {len(on.devices)} "
                "devices, and its check is made on all of them; leave --device-counts out with "
                "--target (the slice sets the count)"
            )


def _limit(max_memory: int | None, on: CompileTarget | None) -> dict[str, Any] | None:
    """The memory limit per device: `--max-memory`, else a slice's HBM, else none."""
    if max_memory is not None:
        return {"bytes": max_memory, "from": "--max-memory"}
    if on is not None:
        return {"bytes": on.memory_per_device, "from": HBM}
    return None


def devices_text(devices: int, target: str | None) -> str:
    """`8 devices`, or `v5e:2x4 (8 devices)` on a TPU slice."""
    return f"{devices} devices" if target is None else f"{target} ({devices} devices)"


def needed_text(cost: Mapping[str, Any] | None, state_leaves: int) -> str:
    """What a check's memory is: the step's peak (`Memory.peak`: XLA:TPU's own on a
    slice, else what XLA:CPU allocates), else what its parameters (and state) take."""
    if cost is not None:
        return "the step needs" if cost.get("target") else "the step needs, by XLA:CPU,"
    return "the parameters and state take" if state_leaves else "the parameters alone take"


def limit_text(limit: Mapping[str, Any]) -> str:
    """`--max-memory 74.5 GiB`, or `the chip's HBM, 16 GiB`."""
    from .._report import human_bytes

    size = human_bytes(int(limit["bytes"])).replace(".0 ", " ")
    return f"{HBM}, {size}" if limit["from"] == HBM else f"--max-memory {size}"


def _memory_problem(
    source: str, where: str, needed: int, what: str, limit: Mapping[str, Any]
) -> Problem:
    from .._report import human_bytes

    return Problem(
        source,
        f"{what} {human_bytes(needed)} per device on {where}, more than "
        f"{limit_text(limit)}: it does not fit",
    )


def _cost_entry(
    step: StepInputs, model: Any, spec: Any, devices: int, target: str | None, batch: str | None
) -> tuple[dict[str, Any], list[EqshardWarning]]:
    """`eqshard.cost` of the step under `spec` (a plan on this process's devices, or
    on a TPU `target` the rules), as `CheckResult.cost` holds it, and eqshard's
    warnings while it compiled (the batch's). A stateful model's step takes the
    model alone, then the state (in `step.args`): the plan, made for `(model,
    state)`, lays out both."""
    import warnings

    from .._cost._driver import cost
    from .._fields import is_stateful_pair

    first = model[0] if is_stateful_pair(model) else model
    count = devices if target is None else None  # a slice has its devices
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", EqshardWarning)
        found = call(
            "--step",
            step.target,
            f"compiling the step on {devices_text(devices, target)}",
            lambda: cost(
                first,
                *step.args,
                step=step.step,
                spec=spec,
                batch=batch,
                devices=count,
                target=target,
            ),
            keep=(EqshardError,),  # the spec's faults (the optimizer state's layout), as they are
        )
    ours = [w.message for w in caught if isinstance(w.message, EqshardWarning)]
    for w in caught:  # anything else, as it came
        if not isinstance(w.message, EqshardWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    memory = found.memory
    estimate = found.estimate()
    entry = {
        "parameters": memory.parameters,
        "state": memory.state,
        "optimizer": memory.optimizer,
        "gradients": memory.gradients,
        "host": memory.host,
        "host_arguments": memory.host_arguments,
        "host_outputs": memory.host_outputs,
        "arguments": memory.arguments,
        "outputs": memory.outputs,
        "temporaries": memory.temporaries,
        "reported_peak": memory.reported_peak,
        "peak": memory.peak,
        "peak_lower_bound": memory.peak,
        "peak_includes": memory.peak_includes,
        "flops": found.flops,
        "bytes_accessed": found.bytes_accessed,
        "communication": [
            {"kind": kind, "axes": list(axes), "bytes": size}
            for (kind, axes), size in sorted(found.bytes_by_axes().items())
        ],
        "estimate_h100_seconds": found.estimate("h100").seconds,
        "estimate": {"hardware": estimate.hardware.name, "seconds": estimate.seconds},
        "compiler": found.compiler,
        "target": found.target,
        "memory_per_device": found.memory_per_device,
        "fits": found.fits,
        "batch": found.batch,
        "unknown": found.unknown_text(),
        "promoted": found.promoted,
        "pipelines": [
            {
                "axis": p.axis,
                "stages": p.stages,
                "layers": p.layers,
                "microbatches": p.microbatches,
                "schedule": p.schedule,
                "rounds": p.rounds,
                "iterations": p.iterations,
                "bubble": p.bubble,
            }
            for p in found.pipelines
        ],
        "pipeline": found.pipeline_text(),
        "activations": [dataclasses.asdict(a) for a in found.activations],
        "explained": found.explain().lines(),  # why each collective moves, most bytes first
        "explanations": [e.to_json() for e in found.explain()],  # the same, as fields
    }
    return entry, ours
