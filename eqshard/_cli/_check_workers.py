"""`eqshard check` in worker processes: the user's model is imported in a fresh
Python, so what it prints never mixes with the report, and a step is compiled on as
many simulated devices as its count.

`check_in_processes` starts the workers (`_workers.start_worker`), each running
`main_worker` on one request: the layouts of every file and count in one worker,
which builds the model once; a step, each count in a worker of its own, with a JAX
started on that many simulated devices (a model that sets its own device count at
import works); TPU slices, every slice in one worker, which loads libtpu once and
builds the model (and the step's inputs) once. This module imports JAX only in a
worker, so the process that starts the workers never pays for it up front.

A worker that compiles a step writes which one to a note file while it does
(`check`'s `compiling`): where XLA aborts the worker's process (SIGABRT, as its
partitioner can on a layout it cannot partition), the error names the signal and
the spec it was compiling under, not the model's build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._errors import EqshardError, ModelError, whole_number
from .._process._usercode import abstract_model, step_inputs
from .._process._workers import Worker, serve, start_worker, worker_answer
from ._check import CheckResult, check, check_slices

__all__ = ["WORKERS", "WORKER_TIMEOUT_SECONDS", "check_in_processes", "main_worker"]

WORKER_TIMEOUT_SECONDS = 1800.0  # one device count: import, build abstractly, lay out
WORKERS = 4  # device counts checked at once, at most one per CPU core
_ENTRY = "eqshard._cli._check_workers:main_worker"  # what each worker runs


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
    note = _note_file()
    worker = start_worker({**request, "checks": checks, "note": note}, _ENTRY)
    from .. import _report  # noqa: F401  (JAX, for the results' rows, while it runs)

    counts = ", ".join(map(str, dict.fromkeys(n for _, n in each)))
    doing = f"checking on {counts}{' devices' * _all_counts(each)}"
    found = _answer(doing, worker, timeout, note)
    return dict(zip([(source, n) for source, ns in wanted.items() for n in ns], found))


def _steps_in_processes(
    request: Mapping[str, Any], each: Sequence[_Key], timeout: float
) -> dict[_Key, CheckResult]:
    """Each file and count, its step compiled by a worker of its own, up to
    `WORKERS` at once; the first error stops the rest."""
    at_once = max(1, min(WORKERS, os.cpu_count() or 1))
    results: dict[_Key, CheckResult] = {}
    for start in range(0, len(each), at_once):
        running = []
        for key in each[start : start + at_once]:
            note = _note_file()
            checks = [{"spec": key[0], "devices": [key[1]]}]
            running.append(
                (key, start_worker({**request, "checks": checks, "note": note}, _ENTRY), note)
            )
        try:
            if not results:  # JAX, for the results' rows, imported while the workers run
                from .. import _report  # noqa: F401
            for key, worker, note in running:
                (results[key],) = _answer(f"checking on {key[1]} devices", worker, timeout, note)
        finally:
            for _, worker, note in running:  # after an error, the rest are not needed
                worker.stop()
                _remove(note)
    return results


def _all_counts(each: Sequence[_Key]) -> bool:
    return all(isinstance(n, int) for _, n in each)


def _answer(doing: str, worker: Worker, timeout: float, note: str) -> list[CheckResult]:
    """The worker's results, or its error raised here; where it died of a signal while
    compiling a step (its `note` file names the step), a `ModelError` that says so."""
    try:
        document = worker_answer(
            worker, timeout, doing, "Run the model's build in Python to see why"
        )
    except ModelError as error:
        died = _died_compiling(doing, worker.process.returncode, _read(note))
        if died is None:
            raise
        raise died from error
    finally:
        _remove(note)
    return [CheckResult.from_json(entry) for entry in document["result"]]


# What a worker's death by a signal while it compiles most often means: the fix
_SIGNALS: dict[int, str] = {
    signal.SIGABRT: "XLA aborts where a check of its own fails, as its SPMD partitioner can "
    "for a layout it cannot partition (a convolution's input split over its height or "
    "width, say): try another layout in that spec, or report what XLA printed to JAX",
    signal.SIGKILL: "The system kills a process so when memory runs out: check fewer "
    "device counts at once, or on a machine with more memory",
    signal.SIGSEGV: "The compiler crashed: report what it printed to JAX",
}


def _died_compiling(doing: str, code: int | None, compiling: str) -> ModelError | None:
    """The error for a worker that ended with `code` while compiling `compiling` (the
    step, its spec and devices): `None` where it did not die of a signal then."""
    if code is None or code >= 0 or not compiling:
        return None
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    fix = _SIGNALS.get(
        -code, "Compile the step under that spec in Python (`eqshard.cost`) to see why"
    )
    if -code == signal.SIGABRT:
        return ModelError(
            f"{doing}: the compiler aborted ({name}, signal {-code}) while compiling "
            f"{compiling}, and its process died without an answer; what it printed is "
            f"above. {fix}"
        )
    return ModelError(
        f"{doing}: its process died of {name} (signal {-code}) while compiling {compiling}, "
        f"without an answer; what it printed is above. {fix}"
    )


def _note_file() -> str:
    """A fresh, empty file for a worker's note of the step it compiles."""
    handle, path = tempfile.mkstemp(prefix="eqshard-compiling-", suffix=".txt")
    os.close(handle)
    return path


def _noting(path: str | None) -> Callable[[str | None], None] | None:
    """In a worker, `check`'s `compiling`: what it compiles, written to `path` (the
    request's `"note"`) while it does, then nothing."""
    if path is None:
        return None

    def note(compiling: str | None) -> None:
        with open(path, "w", encoding="utf-8") as file:
            file.write(compiling or "")

    return note


def _read(path: str) -> str:
    """A worker's note: the step it was compiling, or empty."""
    with contextlib.suppress(OSError), open(path, encoding="utf-8") as file:
        return file.read().strip()
    return ""


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def main_worker() -> int:
    """Checks in this fresh process, for `check_in_processes`.

    `check_in_processes` runs it with `python -c`, after setting `sys.path` to its
    own; by hand, run `python -m eqshard._cli._check_workers`. It reads one JSON request from
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
    - `{"error": {"type", "message", "exit_code", "eqshard", "notes", "traceback"}}`:
        what was raised (its class name, its text, the command line's exit code for
        it, whether it is an `EqshardError`, its notes, the user's frames among
        them, and its traceback as text), with `headline` and `problems` for a
        `SpecError` (`_workers.error_entry`).

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

    from .._specfile._read import load

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
    compiling = _noting(request.get("note"))
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
            compiling=compiling,
        )
    return results


def _count_or_slice(entry: Any) -> int | str:
    """A request's device count, or a TPU slice's name, as given."""
    return entry if isinstance(entry, str) else whole_number(entry, "devices")


if __name__ == "__main__":  # `python -m eqshard._cli._check_workers`: one worker
    raise SystemExit(main_worker())
