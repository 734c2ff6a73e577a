"""`eqshard check`: resolve a spec file against an abstract model, on N devices.

Nothing here touches device memory: the model is built with
`eqx.filter_eval_shape`. Layouts need no devices either: each device count is
laid out on an abstract mesh (`make_plan(..., devices=n)`), so 65,536 devices
cost what 8 do. Only a step to compile (`--step`) needs devices: a subset of
simulated devices.

The command line checks in worker processes (`check_in_processes`, which runs
`main_worker`), so the user's model is imported in a fresh Python, and what it
prints never mixes with the report: the layouts of every file and count in one
worker, which builds the model once; a step, each count in a worker of its own,
with a JAX started on that many simulated devices (a model that sets its own
device count at import works). This module imports JAX only when a check runs,
so the process that starts the workers never pays for it up front.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._errors import EqshardError, Problem, whole_number
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

__all__ = [
    "CheckResult",
    "ModelError",
    "StepInputs",
    "abstract_model",
    "check",
    "check_in_processes",
    "cost_line",
    "main_worker",
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
    `parameters`, `state` (the model's `eqx.nn.State`), `optimizer`, `gradients`
    and `peak_lower_bound` in bytes, `flops` and `bytes_accessed`, `communication`
    (a list of `{"kind", "axes", "bytes"}`, one per kind of collective and mesh
    axes) and `estimate_h100_seconds`.
    """

    source: str
    devices: int
    rows: list[LeafRow]
    problems: list[Problem]
    notes: list[str]
    cost: dict[str, Any] | None = None
    warnings: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    state_leaves: int = 0

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
            `problems` and `notes` (and `cost`, `warnings` and `state_leaves`, which
            may be missing), as
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
    device_counts: Sequence[int],
    *,
    strict: bool = False,
    step: StepInputs | None = None,
    max_memory: int | None = None,
) -> list[CheckResult]:
    """Lays out `model` under `rules` on each device count; collects every fault.

    Every leaf that can be laid out is, so one run reports every independent fault:
    expressions that do not fit, the file's device count, unmatched leaves under
    `"default": "error"`, and (with `strict`) rules that match nothing. The layouts
    are made for the count, abstractly, so a count may be more than this process
    has devices. With `step`, the plan is made on the first `n` of `jax.devices()`
    (the same layouts) and the step is compiled over the laid-out arguments
    (`eqshard.cost`), so each result has its cost. With `max_memory` (bytes per
    device), a check whose peak lower bound (without `step`: its parameters per
    device) is more has a problem.
    """
    import jax

    from ._fields import is_array_like, is_stateful_pair
    from ._plan import make_plan
    from ._report import leaf_rows, total_bytes_per_device

    state_leaves = 0
    if is_stateful_pair(model):
        state_leaves = sum(map(is_array_like, jax.tree_util.tree_leaves(model[1])))
    held = "the parameters and state take" if state_leaves else "the parameters alone take"
    results = []
    for n in device_counts:
        planned = make_plan(model, rules, devices=n if step is None else jax.devices()[:n])
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
            cost = _cost_entry(step, model, planned.plan, n)
        if max_memory is not None:
            if cost is not None:
                needed, what = cost["peak_lower_bound"], "the step needs at least"
            else:
                needed, what = total_bytes_per_device(rows), held
            if needed is not None and needed > max_memory:
                problems.append(_memory_problem(rules.source, n, needed, what, max_memory))
        results.append(
            CheckResult(rules.source, n, rows, problems, notes, cost, warnings, state_leaves)
        )
    return results


def _memory_problem(source: str, devices: int, needed: int, what: str, limit: int) -> Problem:
    from ._report import human_bytes

    bound = " (a lower bound)" if what.startswith("the step") else ""
    return Problem(
        source,
        f"{what} {human_bytes(needed)} per device on {devices} devices{bound}, more than "
        f"--max-memory {human_bytes(limit)}: it does not fit",
    )


def _cost_entry(step: StepInputs, model: Any, plan: Any, devices: int) -> dict[str, Any]:
    """`eqshard.cost` of the step on this plan, as `CheckResult.cost` holds it. A
    stateful model's step takes the model alone, then the state (in `step.args`):
    the plan, made for `(model, state)`, lays out both."""
    from ._cost import cost
    from ._fields import is_stateful_pair

    first = model[0] if is_stateful_pair(model) else model
    found = call(
        "--step",
        step.target,
        f"compiling the step on {devices} devices",
        lambda: cost(step.step, first, *step.args, spec=plan, devices=devices),
        keep=(EqshardError,),  # the spec's faults (the optimizer state's layout), as they are
    )
    memory = found.memory
    return {
        "parameters": memory.parameters,
        "state": memory.state,
        "optimizer": memory.optimizer,
        "gradients": memory.gradients,
        "peak_lower_bound": memory.peak,
        "flops": found.flops,
        "bytes_accessed": found.bytes_accessed,
        "communication": [
            {"kind": kind, "axes": list(axes), "bytes": size}
            for (kind, axes), size in sorted(found.bytes_by_axes().items())
        ],
        "estimate_h100_seconds": found.estimate("h100").seconds,
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
    title = f"{result.source} on {result.devices} devices"
    return leaf_table(result.rows, title=title, flags=flags)


def warning_lines(result: CheckResult, limit: int = 12) -> list[str]:
    """The warnings of one check, for right under its table: `warning: ` and each,
    grouped by message (`problem_lines`), in at most `limit` lines."""
    from ._errors import problem_lines

    problems = [problem_of(entry) for entry in result.warnings]
    more = "--format json lists every one"
    return [f"warning: {line}" for line in problem_lines(problems, limit=limit, more=more)]


def _seconds(value: float) -> str:
    """`4.4e-6` -> `'4.4 us'`."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


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
    and the estimate on an H100 (a `CheckResult.cost`)."""
    from ._report import human_bytes

    memory = f"parameters {human_bytes(cost['parameters'])}"
    if cost.get("state"):
        memory += f", state {human_bytes(cost['state'])}"
    if cost["optimizer"]:
        memory += f", optimizer {human_bytes(cost['optimizer'])}"
    moved = ", ".join(_communication(cost)) or "no communication"
    return (
        f"cost: {memory}, peak >= {human_bytes(cost['peak_lower_bound'])} per device; "
        f"{moved} per step; estimate on an H100: {_seconds(cost['estimate_h100_seconds'])}"
    )


def summary_table(results: Sequence[CheckResult]) -> Table:
    """The checks side by side: spec, devices, whether it fits, what the model holds
    per device (its parameters, and its `eqx.nn.State` and the optimizer state where
    there are, as the column's title says), the peak's lower bound, communication
    per step and the estimate on an H100 (the last three with a step to compile)."""
    from rich.table import Table
    from rich.text import Text

    from ._report import human_bytes

    table = Table(title=Text("the checks side by side"), title_justify="left")
    table.add_column("spec")
    table.add_column("devices", justify="right")
    table.add_column("fits")
    table.add_column(f"{_held_label(results)} / device", justify="right")
    table.add_column("peak >= / device", justify="right")
    table.add_column("communication / step")
    table.add_column("estimate (H100)", justify="right")
    for result in results:
        cost = result.cost
        if cost is not None:
            held: int | None = cost["parameters"] + cost.get("state", 0) + cost["optimizer"]
        else:
            held = result.bytes_per_device
        problems = len(result.problems)
        table.add_row(
            Text(result.source),
            str(result.devices),
            "yes" if result.ok else f"no ({problems} problem{'s' * (problems != 1)})",
            "-" if held is None else human_bytes(held),
            "-" if cost is None else human_bytes(cost["peak_lower_bound"]),
            "-" if cost is None else "\n".join(_communication(cost)) or "none",
            "-" if cost is None else _seconds(cost["estimate_h100_seconds"]),
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
    checks: Sequence[tuple[str, Sequence[int]]],
    model: str,
    *,
    strict: bool = False,
    step: str | None = None,
    optimizer: str | None = None,
    batch: str | None = None,
    max_memory: int | None = None,
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
    the others. The workers' stderr is this process's, so what the model prints,
    and its warnings, show as they come (once per worker).

    **Arguments:**

    - `checks`: each spec file's path, as the user wrote it (each worker loads it,
        and the results name it so), with the device counts to check it on.
    - `model`: `MODULE:CALLABLE`, as for `abstract_model`, imported by each worker
        with this process's `sys.path`.
    - `strict`: a rule that matches nothing is a problem rather than a note.
    - `step`, `optimizer`, `batch`: `MODULE:CALLABLE`s, as for `step_inputs`; with
        `step` (and `batch`), each worker compiles the step and its result has its
        cost.
    - `max_memory`: bytes per device, as for `check`.
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
    count (XLA_FLAGS, or the model, set a smaller one); `SpecError` when a spec
    file cannot be loaded.
    """
    request = {
        "model": model,
        "strict": strict,
        "step": step,
        "optimizer": optimizer,
        "batch": batch,
        "max_memory": max_memory,
    }
    each = list(dict.fromkeys((source, n) for source, counts in checks for n in counts))
    if step is None:
        results = _layouts_in_one_process(request, each, timeout)
    else:
        results = _steps_in_processes(request, each, timeout)
    return [results[source, n] for source, counts in checks for n in counts]


_Key = tuple[str, int]  # a spec file, and a device count to check it on


def _layouts_in_one_process(
    request: Mapping[str, Any], each: Sequence[_Key], timeout: float
) -> dict[_Key, CheckResult]:
    """Every file on every count, laid out abstractly by one worker."""
    wanted: dict[str, list[int]] = {}
    for source, n in each:
        wanted.setdefault(source, []).append(n)
    checks = [{"spec": source, "devices": counts} for source, counts in wanted.items()]
    worker = start_worker({**request, "checks": checks}, "eqshard._check:main_worker")
    from . import _report  # noqa: F401  (JAX, for the results' rows, while it runs)

    counts = ", ".join(map(str, dict.fromkeys(n for _, n in each)))
    found = _answer(f"checking on {counts} devices", worker, timeout)
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


def _answer(doing: str, worker: Worker, timeout: float) -> list[CheckResult]:
    """The worker's results, or its error raised here."""
    document = worker_answer(worker, timeout, doing, "Run the model's build in Python to see why")
    return [CheckResult.from_json(entry) for entry in document["result"]]


def main_worker() -> int:
    """Checks in this fresh process, for `check_in_processes`.

    `check_in_processes` runs it with `python -c`, after setting `sys.path` to its
    own; by hand, run `python -m eqshard._check`. It reads one JSON request from
    stdin, `{"checks": [{"spec": PATH, "devices": [N, ...]}, ...], "model":
    "MODULE:CALLABLE", "strict": BOOL}`, with optionally `"step"`, `"optimizer"`,
    `"batch"` (`MODULE:CALLABLE` or null) and `"max_memory"` (bytes or null). It
    loads the specs and builds the model abstractly, once. Without a step, it lays
    each spec out on each count abstractly, with no devices; with one, it first
    starts JAX on the largest count's simulated CPU devices (unless XLA_FLAGS sets
    a count; the model, imported after, may set its own), builds the step's
    arguments abstractly and compiles the step on each count. It writes one JSON
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
        (str(entry["spec"]), [whole_number(n, "devices") for n in entry["devices"]])
        for entry in request["checks"]
    ]
    most = max(n for _, counts in checks for n in counts)
    jax.config.update("jax_platforms", "cpu")  # never an accelerator another process holds
    compiling = request.get("step") is not None
    if compiling and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", most)
    specs = [load(source) for source, _ in checks]
    modules: dict[str, Any] = {}
    model = abstract_model(str(request["model"]), modules=modules)  # it may set its own count
    step = None
    if compiling:
        started = len(jax.devices())
        if started < most:
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
        )
    return results


if __name__ == "__main__":  # `python -m eqshard._check`: one worker
    from eqshard._check import main_worker as _main_worker  # the package's copy of this module

    raise SystemExit(_main_worker())
