"""`eqshard check`: resolve a spec file against an abstract model, on N devices.

Nothing here touches device memory: the model is built with
`eqx.filter_eval_shape`. Layouts need no devices either: each device count is
laid out on an abstract mesh (`make_plan(..., devices=n)`), so 65,536 devices
cost what 8 do. Only a step to compile (`--step`) needs devices: a subset of
simulated devices, or a TPU slice's (`--target v5e:4x4`), which XLA:TPU compiles
for on this machine through libtpu.

The command line checks in worker processes (`check_in_processes`, which runs
`main_worker`), so the user's model is imported in a fresh Python, and what it
prints never mixes with the report: the layouts of every file and count in one
worker, which builds the model once; a step, each count in a worker of its own,
with a JAX started on that many simulated devices (a model that sets its own
device count at import works); TPU slices, every slice in one worker, which loads
libtpu once and builds the model (and the step's inputs) once. This module imports
JAX only when a check runs, so the process that starts the workers never pays for
it up front.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._errors import EqshardError, Problem, whole_number
from ._hardware import seconds_text
from ._specfile import Rules
from ._workers import (
    ModelError,
    Worker,
    call,
    problem_of,
    serve,
    start_worker,
    user_callable,
    worker_answer,
)

if TYPE_CHECKING:
    from rich.table import Table

    from ._report import LeafRow
    from ._targets import CompileTarget

__all__ = [
    "CheckResult",
    "ModelError",
    "StepInputs",
    "abstract_model",
    "check",
    "check_in_processes",
    "check_slices",
    "compiler_line",
    "cost_line",
    "devices_text",
    "main_worker",
    "memory_line",
    "result_table",
    "step_inputs",
    "summary_table",
    "warning_lines",
]

WORKER_TIMEOUT_SECONDS = 1800.0  # one device count: import, build abstractly, lay out
WORKERS = 4  # device counts checked at once, at most one per CPU core


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
    memory only (`peak_lower_bound`, the same figure, a lower bound from XLA:CPU
    and exact from XLA:TPU), `flops` and `bytes_accessed`, `communication`
    (a list of `{"kind", "axes", "bytes"}`, one per kind of collective and mesh
    axes), `estimate_h100_seconds` and `estimate` (`{"hardware", "seconds"}`, on
    the target's chip, else an H100); `compiler` (whose figures these are),
    `target`, `memory_per_device` (the chip's HBM) and `fits` (the peak within
    it; `None` without a target), and `batch` (the expression the batch was laid
    out by).

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
        from ._report import total_bytes_per_device

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
        problem `check` makes), and `main_worker` writes every problem whole, so
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
    """The row a `dataclasses.asdict(row)` entry describes (JSON makes its shape a list)."""
    from ._report import LeafRow

    names = {field.name for field in dataclasses.fields(LeafRow)}
    values = {key: value for key, value in entry.items() if key in names}
    values["shape"] = tuple(values["shape"])
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


def abstract_model(target: str, *, modules: dict[str, Any] | None = None) -> Any:
    """Builds `MODULE:CALLABLE` abstractly. MODULE is a dotted module name or a `.py` file.

    With `step_inputs`, this is the one place where eqshard imports user code, and
    only because the user named it on the command line; a spec file never does. A
    `.py` file in
    `modules` (imported by an earlier call given the same dictionary) is not run again.
    """
    attribute, factory = user_callable(
        target, "--model", "build", "CALLABLE() returns the model", modules
    )
    import equinox as eqx
    import jax

    model = call("--model", target, f"{attribute}()", lambda: eqx.filter_eval_shape(factory))
    if not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree_util.tree_leaves(model)):
        raise ModelError(
            f"--model {target!r}: {attribute}() returned {type(model).__name__}, which holds "
            "no arrays; name a callable that builds the model"
        )
    return model


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The user's training step and the arguments after the model, abstract:
    `(opt_state, batch)` with an optimizer, else `(batch,)`; for a stateful model
    (`--model` builds `(model, state)`), `(state, opt_state, batch)` or
    `(state, batch)`. `target` is the `--step` text, for messages."""

    step: Callable[..., Any]
    args: tuple[Any, ...]
    target: str


def step_inputs(
    model: Any,
    step: str,
    batch: str,
    optimizer: str | None = None,
    *,
    modules: dict[str, Any] | None = None,
) -> StepInputs:
    """Imports `--step`, `--batch` and `--optimizer` (each `MODULE:CALLABLE`, as
    for `abstract_model`) and builds the batch and the optimizer's state of the
    abstract `model` abstractly (no device memory). A `batch()` that needs concrete
    values (`np.asarray` of a JAX array) is run once on the host instead. For a
    stateful model, `(model, state)`, the optimizer's state is built from the
    model's parameters, and the step takes the state after the model."""
    import equinox as eqx
    import jax

    from ._fields import is_stateful_pair

    _, fn = user_callable(
        step,
        "--step",
        "step",
        "CALLABLE is the training step, step(model, opt_state, batch)",
        modules,
    )
    name, make_batch = user_callable(
        batch, "--batch", "batch", "CALLABLE() returns the step's batch", modules
    )
    batch_value = _abstract_batch(batch, name, make_batch)
    stateful = is_stateful_pair(model)
    states: tuple[Any, ...] = (model[1],) if stateful else ()
    args: tuple[Any, ...] = (*states, batch_value)
    if optimizer is not None:
        name, make = user_callable(
            optimizer, "--optimizer", "optimizer", "CALLABLE() returns an optax optimizer", modules
        )
        opt = call("--optimizer", optimizer, f"{name}()", make)
        init = getattr(opt, "init", None)
        if not callable(init):
            raise ModelError(
                f"--optimizer {optimizer!r}: {name}() returned {type(opt).__name__}, which has "
                "no init; name a callable that returns an optax optimizer"
            )
        parameters = model[0] if stateful else model
        params = eqx.filter(parameters, lambda x: isinstance(x, jax.ShapeDtypeStruct))
        state = call(
            "--optimizer", optimizer, f"{name}().init(params)", lambda: jax.eval_shape(init, params)
        )
        args = (*states, state, batch_value)
    return StepInputs(fn, args, step)


def _abstract_batch(target: str, name: str, make_batch: Callable[[], Any]) -> Any:
    """`make_batch()`, abstract: traced with `eqx.filter_eval_shape` (no memory), or,
    where it needs concrete values (`np.asarray` of a JAX array, a Python `if` on
    one), run once on the host and its arrays made abstract."""
    import equinox as eqx
    import jax

    needs_values = (
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerArrayConversionError,
        jax.errors.TracerIntegerConversionError,
        jax.errors.NonConcreteBooleanIndexError,
    )
    try:
        return call(
            "--batch", target, f"{name}()", lambda: eqx.filter_eval_shape(make_batch), needs_values
        )
    except needs_values:
        pass
    try:
        host = jax.devices("cpu")[0]
    except RuntimeError:  # JAX started without its CPU backend: its default device
        host = jax.devices()[0]
    with jax.default_device(host):
        value = call(
            "--batch",
            target,
            f"{name}() (run on the host, as it needs concrete values: it calls NumPy on a "
            "JAX array, or branches on one)",
            make_batch,
        )
    return eqx.filter_eval_shape(lambda value: value, value)


def check(
    rules: Rules,
    model: Any,
    device_counts: Sequence[int | str],
    *,
    strict: bool = False,
    step: StepInputs | None = None,
    max_memory: int | None = None,
    batch: str | None = None,
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
    """
    import jax

    from ._fields import is_array_like, is_stateful_pair
    from ._plan import make_plan
    from ._report import device_bytes_per_device, leaf_rows

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
        planned = make_plan(model, rules, devices=jax.devices()[:n] if on_cpu else n)
        problems = list(planned.problems)
        notes: list[str] = []
        warnings: list[dict[str, Any]] = []
        for warning in planned.warnings:
            if strict:
                problems += [
                    Problem(p.where, f"{p.message} (--strict)", p.detail, p.file)
                    for p in warning.problems
                ]
            else:
                notes += [str(p) for p in warning.problems]
                warnings += warning.to_json()
        rows = leaf_rows(planned.plan)
        cost = None
        if step is not None and not planned.problems:  # one that cannot be laid out: no step
            spec = rules if on is not None else planned.plan  # a slice plans on its devices
            cost = _cost_entry(step, model, spec, n, None if on is None else on.name, batch)
        limit = _limit(max_memory, on)
        if limit is not None:
            needed = cost["peak"] if cost is not None else device_bytes_per_device(rows)
            if needed is not None:
                limit = {**limit, "needed": needed, "fits": needed <= limit["bytes"]}
                if not limit["fits"]:
                    where = devices_text(n, None if on is None else on.name)
                    what = _needed(cost, state_leaves)
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
    from ._targets import compile_target

    return compile_target(name)


def check_slices(names: Sequence[str], devices: Sequence[int] | None = None) -> None:
    """Checks that each of `names` is a TPU slice this machine can compile for, and
    that `devices` (`--devices`, where given with `--target`) is its device count.

    **Raises:**

    `EqshardError` for a name that is no slice (as `eqshard.cost`'s `target=`);
    `UsageError` (exit code 2) where libtpu is not installed, or where `devices`
    holds another count than a slice's.
    """
    from ._errors import UsageError

    for name in names:
        on = _slice(name)
        if devices and set(devices) != {len(on.devices)}:
            given = " ".join(map(str, dict.fromkeys(devices)))
            raise UsageError(
                f"--devices {given} and --target {name}: the slice has {len(on.devices)} "
                "devices, and its check is made on all of them; leave --devices out with "
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


def _needed(cost: Mapping[str, Any] | None, state_leaves: int) -> str:
    """What a check's memory is: the step's peak (a lower bound from XLA:CPU), else
    what its parameters (and state) take."""
    if cost is not None:
        return "the step needs" if cost.get("target") else "the step needs at least"
    return "the parameters and state take" if state_leaves else "the parameters alone take"


def _limit_text(limit: Mapping[str, Any]) -> str:
    """`--max-memory 74.5 GiB`, or `the chip's HBM, 16 GiB`."""
    from ._report import human_bytes

    size = human_bytes(int(limit["bytes"])).replace(".0 ", " ")
    return f"{HBM}, {size}" if limit["from"] == HBM else f"--max-memory {size}"


def _memory_problem(
    source: str, where: str, needed: int, what: str, limit: Mapping[str, Any]
) -> Problem:
    from ._report import human_bytes

    bound = " (a lower bound)" if what.endswith("at least") else ""
    return Problem(
        source,
        f"{what} {human_bytes(needed)} per device on {where}{bound}, more than "
        f"{_limit_text(limit)}: it does not fit",
    )


def _cost_entry(
    step: StepInputs, model: Any, spec: Any, devices: int, target: str | None, batch: str | None
) -> dict[str, Any]:
    """`eqshard.cost` of the step under `spec` (a plan on this process's devices, or
    on a TPU `target` the rules), as `CheckResult.cost` holds it. A stateful model's
    step takes the model alone, then the state (in `step.args`): the plan, made for
    `(model, state)`, lays out both."""
    from ._cost import cost
    from ._fields import is_stateful_pair

    first = model[0] if is_stateful_pair(model) else model
    count = devices if target is None else None  # a slice has its devices
    found = call(
        "--step",
        step.target,
        f"compiling the step on {devices_text(devices, target)}",
        lambda: cost(
            step.step, first, *step.args, spec=spec, batch=batch, devices=count, target=target
        ),
        keep=(EqshardError,),  # the spec's faults (the optimizer state's layout), as they are
    )
    memory = found.memory
    estimate = found.estimate()
    return {
        "parameters": memory.parameters,
        "state": memory.state,
        "optimizer": memory.optimizer,
        "gradients": memory.gradients,
        "host": memory.host,
        "host_arguments": memory.host_arguments,
        "host_outputs": memory.host_outputs,
        "peak": memory.peak,
        "peak_lower_bound": memory.peak,
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
    }


def result_table(result: CheckResult) -> Table:
    """The per-leaf table of one check. A leaf that an unused rule was likely meant
    for (the one its "did you mean" matches, or one an earlier rule took from it)
    has the warning in its `from` cell: `default (warning: $.rules[4])`."""
    from ._report import leaf_table

    flags: dict[str, str] = {}
    for entry in result.warnings:
        for leaf in entry.get("leaves", []):
            flags.setdefault(leaf, f"warning: {entry.get('path') or entry['where']}")
    title = f"{result.source} on {devices_text(result.devices, result.target)}"
    return leaf_table(result.rows, title=title, flags=flags)


def warning_lines(result: CheckResult, limit: int = 12) -> list[str]:
    """The warnings of one check, for right under its table: `warning: ` and each,
    grouped by message (`problem_lines`), in at most `limit` lines."""
    from ._errors import problem_lines

    problems = [problem_of(entry) for entry in result.warnings]
    more = "--format json lists every one"
    return [f"warning: {line}" for line in problem_lines(problems, limit=limit, more=more)]


def _communication(cost: Mapping[str, Any]) -> list[str]:
    """`all-reduce over data 514.0 KiB`, one per kind of collective and mesh axes."""
    from ._report import human_bytes

    return [
        f"{entry['kind']}{' over ' + '+'.join(entry['axes']) if entry['axes'] else ''} "
        f"{human_bytes(entry['bytes'])}"
        for entry in cost["communication"]
    ]


def cost_line(cost: Mapping[str, Any]) -> str:
    """One line of what a step costs: memory per device, communication per step,
    and the estimate on the target's chip, else an H100 (a `CheckResult.cost`)."""
    from ._report import human_bytes

    memory = f"parameters {human_bytes(cost['parameters'])}"
    if cost.get("state"):
        memory += f", state {human_bytes(cost['state'])}"
    if cost["optimizer"]:
        memory += f", optimizer {human_bytes(cost['optimizer'])}"
    if cost.get("host"):
        memory += f" ({human_bytes(cost['host'])} of it in host memory)"
    moved = ", ".join(_communication(cost)) or "no communication"
    peak = "peak" if cost.get("target") else "peak >="
    return (
        f"cost: {memory}, {peak} {human_bytes(cost['peak_lower_bound'])} per device; "
        f"{moved} per step; estimate on {_chip(cost)}: {seconds_text(_estimate(cost))}"
    )


def _chip(cost: Mapping[str, Any]) -> str:
    """`an H100`, or the target's chip: `a Google Cloud TPU v5e`."""
    estimate = cost.get("estimate")
    if not cost.get("target") or not estimate:
        return "an H100"
    return f"a {estimate['hardware']}"


def _estimate(cost: Mapping[str, Any]) -> float:
    """The estimate's seconds: on the target's chip, else on an H100."""
    estimate = cost.get("estimate")
    return float(estimate["seconds"] if estimate else cost["estimate_h100_seconds"])


def compiler_line(cost: Mapping[str, Any]) -> str:
    """Whose figures a step's cost holds, and how its batch was laid out:
    `compiled by XLA:TPU (libtpu 0.0.42.1) for v5e:2x4; the batch laid out by
    'b ... -> b* ...'`."""
    line = f"compiled by {cost['compiler']}"
    if cost.get("target"):
        line += f" for {cost['target']}"
    batch = cost.get("batch")
    return line + (f"; the batch laid out by {batch!r}" if batch else "; no batch laid out")


def memory_line(result: CheckResult) -> str | None:
    """The memory limit of one check, where it has one, and whether it holds:
    `max memory: the chip's HBM, 16 GiB per device (no --max-memory given); the step
    needs 1.1 MiB: it fits`."""
    from ._report import human_bytes

    limit = result.max_memory
    if limit is None or limit.get("needed") is None:
        return None
    given = ""
    if limit["from"] == HBM:
        given = " (no --max-memory given)"
    elif result.cost is not None and result.cost.get("memory_per_device") is not None:
        hbm = _limit_text({"bytes": result.cost["memory_per_device"], "from": HBM})
        given = f" ({hbm})"
    what = _needed(result.cost, result.state_leaves)
    verdict = "it fits" if limit["fits"] else "it does not fit"
    return (
        f"max memory: {_limit_text(limit)} per device{given}; {what} "
        f"{human_bytes(int(limit['needed']))}: {verdict}"
    )


def summary_table(results: Sequence[CheckResult]) -> Table:
    """The checks side by side: spec, devices (and the TPU slice), whether it fits,
    what the model holds per device (its parameters, and its `eqx.nn.State` and the
    optimizer state where there are, as the column's title says), the peak (a lower
    bound from XLA:CPU), communication per step and the estimate on an H100, or on
    each slice's chip (the last three with a step to compile)."""
    from rich.table import Table
    from rich.text import Text

    from ._report import human_bytes

    table = Table(title=Text("the checks side by side"), title_justify="left")
    table.add_column("spec")
    table.add_column("devices", justify="right")
    table.add_column("fits")
    table.add_column(f"{_held_label(results)} / device", justify="right")
    on_slices = any(result.target for result in results)  # --target: every check is on one
    table.add_column("peak / device" if on_slices else "peak >= / device", justify="right")
    table.add_column("communication / step")
    table.add_column("estimate (chip)" if on_slices else "estimate (H100)", justify="right")
    for result in results:
        cost = result.cost
        if cost is not None:
            held: int | None = cost["parameters"] + cost.get("state", 0) + cost["optimizer"]
        else:
            held = result.bytes_per_device
        problems = len(result.problems)
        table.add_row(
            Text(result.source),
            str(result.devices) if result.target is None else f"{result.devices} ({result.target})",
            "yes" if result.ok else f"no ({problems} problem{'s' * (problems != 1)})",
            "-" if held is None else human_bytes(held),
            "-" if cost is None else human_bytes(cost["peak_lower_bound"]),
            "-" if cost is None else "\n".join(_communication(cost)) or "none",
            "-" if cost is None else seconds_text(_estimate(cost)),
        )
    return table


def _held_label(results: Sequence[CheckResult]) -> str:
    """What the summary's bytes per device hold: `parameters`, with `+ state` for a
    stateful model and `+ optimizer` where a step's optimizer state is counted."""
    parts = ["parameters"]
    if any(result.state_leaves for result in results):
        parts.append("state")
    if any(result.cost is not None and result.cost["optimizer"] for result in results):
        parts.append("optimizer")
    return " + ".join(parts)


def check_in_processes(
    checks: Sequence[tuple[str, Sequence[int | str]]],
    model: str,
    *,
    strict: bool = False,
    step: str | None = None,
    optimizer: str | None = None,
    batch: str | None = None,
    max_memory: int | None = None,
    batch_spec: str | None = None,
    devices: Sequence[int] | None = None,
    timeout: float = WORKER_TIMEOUT_SECONDS,
) -> list[CheckResult]:
    """`check`, in fresh Python processes (`main_worker`).

    Without `step`, one process imports and builds the model once and lays out
    every file on every count, abstractly: a count costs no devices, so 65,536 of
    them take what 8 take. With `step`, each count is compiled in a process of its
    own that starts JAX on as many simulated CPU devices as its count, then
    imports and builds the model, so a count may be more than this process could
    simulate, and a model that sets `jax_num_cpu_devices` at import works; up to
    `WORKERS` run at once, and the first error, in the order of the checks, stops
    the others. TPU slices, with a step or without, are checked by one process,
    which loads libtpu once and builds the model (and the step's inputs) once: it
    compiles for each slice in turn, on no device of its own. The workers' stderr
    is this process's, so what the model prints, and its warnings, show as they
    come (once per worker).

    **Arguments:**

    - `checks`: each spec file's path, as the user wrote it (each worker loads it,
        and the results name it so), with the device counts (or TPU slices, such
        as `"v5e:4x4"`) to check it on.
    - `model`: `MODULE:CALLABLE`, as for `abstract_model`, imported by each worker
        with this process's `sys.path`.
    - `strict`: a rule that matches nothing is a problem rather than a note.
    - `step`, `optimizer`, `batch`: `MODULE:CALLABLE`s, as for `step_inputs`; with
        `step` (and `batch`), each worker compiles the step and its result has its
        cost.
    - `max_memory`: bytes per device, as for `check`.
    - `batch_spec`: the batch's expression, as `check`'s `batch`.
    - `devices`: the device counts the user gave with TPU slices, which must be
        each slice's (`check_slices`).
    - `timeout`: the seconds each worker may take.

    **Returns:**

    One `CheckResult` per file and count, in the order given, equal to what
    `check` gives for it (with `step`, in a process started with that many
    devices).

    **Raises:**

    What a worker raised, as the same class here: `ModelError` (exit code 2) when
    the model cannot be imported or built, and when a worker ends without an answer
    or takes longer than `timeout` ("checking on 8 devices took longer than 1800
    s"); `EqshardError` when, with `step`, JAX started with fewer devices than a
    count (XLA_FLAGS, or the model, set a smaller one), or a TPU slice is none;
    `UsageError` (exit code 2) as `check_slices` raises it; `SpecError` when a
    spec file cannot be loaded.
    """
    request = {
        "model": model,
        "strict": strict,
        "step": step,
        "optimizer": optimizer,
        "batch": batch,
        "max_memory": max_memory,
        "batch_spec": batch_spec,
        "given_devices": None if devices is None else list(devices),
    }
    each = list(dict.fromkeys((source, n) for source, counts in checks for n in counts))
    if step is None or any(isinstance(n, str) for _, n in each):
        results = _in_one_process(request, each, timeout)
    else:
        results = _steps_in_processes(request, each, timeout)
    return [results[source, n] for source, counts in checks for n in counts]


_Key = tuple[str, "int | str"]  # a spec file, and a device count (or a slice) to check it on


def _in_one_process(
    request: Mapping[str, Any], each: Sequence[_Key], timeout: float
) -> dict[_Key, CheckResult]:
    """Every file on every count, laid out abstractly by one worker; or on every
    TPU slice, compiled for by one worker."""
    wanted: dict[str, list[int | str]] = {}
    for source, n in each:
        wanted.setdefault(source, []).append(n)
    checks = [{"spec": source, "devices": counts} for source, counts in wanted.items()]
    worker = start_worker({**request, "checks": checks}, "eqshard._check:main_worker")
    from . import _report  # noqa: F401  (JAX, for the results' rows, while it runs)

    counts = ", ".join(map(str, dict.fromkeys(n for _, n in each)))
    found = _answer(f"checking on {counts}{' devices' * _all_counts(each)}", worker, timeout)
    return dict(zip([(source, n) for source, ns in wanted.items() for n in ns], found))


def _steps_in_processes(
    request: Mapping[str, Any], each: Sequence[_Key], timeout: float
) -> dict[_Key, CheckResult]:
    """Each file and count, its step compiled by a worker of its own, up to
    `WORKERS` at once; the first error stops the rest."""
    at_once = max(1, min(WORKERS, os.cpu_count() or 1))
    results: dict[_Key, CheckResult] = {}
    for start in range(0, len(each), at_once):
        running = [
            (
                key,
                start_worker(
                    {**request, "checks": [{"spec": key[0], "devices": [key[1]]}]},
                    "eqshard._check:main_worker",
                ),
            )
            for key in each[start : start + at_once]
        ]
        try:
            if not results:  # JAX, for the results' rows, imported while the workers run
                from . import _report  # noqa: F401
            for key, worker in running:
                (results[key],) = _answer(f"checking on {key[1]} devices", worker, timeout)
        finally:
            for _, worker in running:  # after an error, the rest are not needed
                worker.stop()
    return results


def _all_counts(each: Sequence[_Key]) -> bool:
    return all(isinstance(n, int) for _, n in each)


def _answer(doing: str, worker: Worker, timeout: float) -> list[CheckResult]:
    """The worker's results, or its error raised here."""
    document = worker_answer(worker, timeout, doing, "Run the model's build in Python to see why")
    return [CheckResult.from_json(entry) for entry in document["result"]]


def main_worker() -> int:
    """Checks in this fresh process, for `check_in_processes`.

    `check_in_processes` runs it with `python -c`, after setting `sys.path` to its
    own; by hand, run `python -m eqshard._check`. It reads one JSON request from
    stdin, `{"checks": [{"spec": PATH, "devices": [N, ...]}, ...], "model":
    "MODULE:CALLABLE", "strict": BOOL}` (a TPU slice's name, `"v5e:4x4"`, may stand
    for a count N), with optionally `"step"`, `"optimizer"`, `"batch"`
    (`MODULE:CALLABLE` or null), `"max_memory"` (bytes or null), `"batch_spec"`
    (the batch's expression or null) and `"given_devices"` (the user's counts, or
    null, for `check_slices`). It checks the slices first, then loads the specs
    and builds the model abstractly, once. Without a step, it lays each spec out
    on each count abstractly, with no devices; with one, it first starts JAX on the
    largest count's simulated CPU devices (unless XLA_FLAGS sets a count; the
    model, imported after, may set its own), builds the step's arguments
    abstractly and compiles the step on each count, or with XLA:TPU for each
    slice. It writes one JSON
    document to stdout, and nothing else goes there (what the model prints goes to
    stderr):

    - `{"result": [{...}, ...]}`: a `CheckResult` per spec and count, in order, as
        `to_json()` writes it but with each problem whole (`where`, `message`,
        `detail`, `file`), for `CheckResult.from_json`;
    - `{"error": {"type", "message", "exit_code", "eqshard"}}`: what was raised
        (its class name, its text, the command line's exit code for it, whether it
        is an `EqshardError`), with `headline` and `problems` for a `SpecError`.

    **Returns:**

    The exit code: 0 once it has answered, whatever the answer; 130 on Ctrl-C,
    without an answer. It never prints a traceback.
    """
    return serve(_answer_all)


def _answer_all(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        {**result.to_json(), "problems": [dataclasses.asdict(p) for p in result.problems]}
        for result in _check_all(request)
    ]


def _check_all(request: Mapping[str, Any]) -> list[CheckResult]:
    """The worker's checks, JAX not yet started."""
    import jax

    from ._specfile import load

    checks = [
        (str(entry["spec"]), [_count_or_slice(n) for n in entry["devices"]])
        for entry in request["checks"]
    ]
    most = max((n for _, counts in checks for n in counts if isinstance(n, int)), default=1)
    jax.config.update("jax_platforms", "cpu")  # never an accelerator another process holds
    slices = [n for _, counts in checks for n in counts if isinstance(n, str)]
    if slices:  # libtpu, once, before the model is imported: a missing one is said first
        given = request.get("given_devices")
        check_slices(slices, None if given is None else [whole_number(n, "devices") for n in given])
    compiling = request.get("step") is not None
    simulated = compiling and not slices  # a slice's devices are libtpu's, not simulated
    if simulated and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", most)
    specs = [load(source) for source, _ in checks]
    modules: dict[str, Any] = {}
    model = abstract_model(str(request["model"]), modules=modules)  # it may set its own count
    step = None
    if compiling:
        started = len(jax.devices())
        if simulated and started < most:
            raise EqshardError(
                f"checking on {most} devices needs {most} simulated devices, but JAX "
                f"started with {started}; XLA_FLAGS or the model's own "
                "jax.config.update('jax_num_cpu_devices', ...) set that count: leave the "
                "count to `eqshard check`, or check on at most that many devices"
            )
        step = step_inputs(
            model,
            str(request["step"]),
            str(request["batch"]),
            None if request.get("optimizer") is None else str(request["optimizer"]),
            modules=modules,
        )
    limit = request.get("max_memory")
    results: list[CheckResult] = []
    for rules, (_, counts) in zip(specs, checks):
        results += check(
            rules,
            model,
            counts,
            strict=bool(request["strict"]),
            step=step,
            max_memory=None if limit is None else whole_number(limit, "max_memory"),
            batch=None if request.get("batch_spec") is None else str(request["batch_spec"]),
        )
    return results


def _count_or_slice(entry: Any) -> int | str:
    """A request's device count, or a TPU slice's name, as given."""
    return entry if isinstance(entry, str) else whole_number(entry, "devices")


if __name__ == "__main__":  # `python -m eqshard._check`: one worker
    from eqshard._check import main_worker as _main_worker  # the package's copy of this module

    raise SystemExit(_main_worker())
