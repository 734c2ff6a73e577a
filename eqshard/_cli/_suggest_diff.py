"""`eqshard suggest` and `eqshard diff` from the command line: the user's model, step,
optimizer and batch, named by `MODULE:CALLABLE`, built as `eqshard check` builds
them (`_usercode.abstract_model`, `_usercode.step_inputs`: abstractly, no device memory).

The command line's own process imports no JAX before the work is done: each command
(`suggest --targets`: every slice in turn, `targets_here`) runs in one worker (`_workers.start_worker`), which starts JAX for its device count,
builds what the user named once, and answers the result pickled. `suggest`'s worker
asks the candidate generator for the candidates, then ranks them
(`_suggest.compile_in_workers`), each of its compile workers building the step's
inputs from the same names (`step_arguments`) once. Where JAX is already imported
(eqshard used as a library, the tests), the same work runs in this process.

`suggest` tells its progress (`_suggest.Progress`, as an event: its fields and its
line) to the caller's `progress`: from its worker through `_workers.tell`. The
workers' stderr (XLA's warnings) is kept from this process's, unless the request is
`"verbose"`; a worker that dies is said with the end of it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._errors import EqshardError, whole_number
from .._process._pickles import pickled, unpickled
from .._process._workers import (
    serve,
    start_worker,
    tell,
    without_device_count,
    worker_answer,
)

if TYPE_CHECKING:
    from .._process._usercode import StepInputs
    from .._search._diff import Diff
    from .._search._ranked import Progress, Ranked

    Told = Callable[[Progress], None] | None
    from .._search._what_if import Targets

__all__ = [
    "diff_here",
    "diff_worker",
    "event",
    "run",
    "step_arguments",
    "suggest_here",
    "suggest_worker",
    "targets_here",
    "targets_worker",
]

_TIMEOUT_SECONDS = 24 * 3600.0  # a whole command: its own compile workers time each candidate


def step_arguments(request: Mapping[str, Any]) -> tuple[Any, Any, tuple[Any, ...]]:
    """The step, the model (abstract; the model alone of a `(model, state)` build)
    and the step's other arguments (the state, the optimizer state, the batch),
    built from the request's `"model"`, `"step"`, `"batch"` and `"optimizer"`, as
    `eqshard check --step` builds them. A rank worker's `inputs` name it."""
    from .._fields import is_stateful_pair

    model, inputs = _built(request)
    if inputs is None:
        raise EqshardError("the request names no step")
    first = model[0] if is_stateful_pair(model) else model
    return inputs.step, first, inputs.args


def _built(request: Mapping[str, Any]) -> tuple[Any, StepInputs | None]:
    """The abstract model, and with a `"step"` the step and its other arguments."""
    from .._process._usercode import abstract_model, step_inputs

    modules: dict[str, Any] = {}  # each of the user's files imported once
    model = abstract_model(str(request["model"]), modules=modules)
    if request.get("step") is None:
        return model, None
    optimizer = request.get("optimizer")
    inputs = step_inputs(
        model,
        str(request["step"]),
        str(request["batch"]),
        None if optimizer is None else str(optimizer),
        modules=modules,
    )
    return model, inputs


def _names(request: Mapping[str, Any]) -> dict[str, Any]:
    return {key: request.get(key) for key in ("model", "step", "batch", "optimizer")}


def _start_jax(devices: int | None) -> None:
    """JAX on the CPU, with `devices` simulated devices where a count is given and
    JAX has not started yet (in a worker: never an accelerator another process
    holds); where it has (eqshard used as a library), its devices as they are."""
    import jax

    from .._compat import backends_started

    if backends_started():
        return
    jax.config.update("jax_platforms", "cpu")
    if devices is not None:
        jax.config.update("jax_num_cpu_devices", devices)


def suggest_here(request: Mapping[str, Any], progress: Told = None) -> Ranked:
    """`eqshard suggest` in this process: builds the step's inputs from the request's
    names, asks the generator for the candidates on the request's `"devices"` (or
    the `"target"` slice's), and ranks them in compile workers that build the same
    inputs by name, telling `progress` as they compile. `"max_memory"` is bytes or
    `None`, `"workers"` a count or `None`, `"exhaustive"` whether to compile every
    candidate, `"verbose"` whether the workers' stderr reaches this process's."""
    from .._search._policy import TOLERANCE, search
    from .._search._pool import in_workers
    from .._search._suggest import memory_limit, placement

    simulate, target = request.get("devices"), request.get("target")  # `--simulate N`
    n, on, _ = placement(None, simulate, target)
    _start_jax(None if target is not None else n)
    step, model, args = step_arguments(request)
    from .._search._candidates import candidates  # pyright: ignore[reportAttributeAccessIssue]

    kept, dropped = candidates(step, model, *args, devices=n, strategies=request.get("strategies"))
    limit, limit_from = memory_limit(request.get("max_memory"), on)
    inputs = {"build": "eqshard._cli._suggest_diff:step_arguments", "request": _names(request)}
    workers = request.get("workers")
    compile_each = in_workers(
        inputs,
        n,
        None if workers is None else whole_number(workers, "`--workers`"),
        quiet=not request.get("verbose", False),
    )
    exhaustive = bool(request.get("exhaustive", False))
    tolerance = request.get("tolerance")
    return search(
        kept,
        compile_each,
        n,
        on,
        limit,
        limit_from,
        dropped,
        exhaustive,
        proxy=True,
        tolerance=TOLERANCE if tolerance is None else float(tolerance),
        progress=progress,
    )


def event(progress: Progress) -> dict[str, Any]:
    """A `Progress` as the command line's display takes it, and a worker sends it
    (JSON): its fields, and its line as `"text"`."""
    return {**dataclasses.asdict(progress), "text": str(progress)}


def _tell(progress: Progress) -> None:
    """In a command's worker: `progress` sent to the command line (`_workers.tell`)."""
    tell(event(progress))


def suggest_worker() -> int:
    """A worker's entry: `suggest_here`, its progress told, answered pickled."""
    return serve(lambda request: pickled(suggest_here(request, _tell), "the ranking", "report it"))


def targets_here(request: Mapping[str, Any], progress: Told = None) -> Targets:
    """`eqshard suggest --targets` in this process: every slice of the request's
    `"targets"` (a list of names) checked first, then `suggest_here` on each in
    turn, the rows built as `eqshard.targets.suggest_targets` builds them."""
    from .._search._policy import sharing_proxies
    from .._search._suggest import placement
    from .._search._what_if import Targets, target_names

    names = target_names(request["targets"])
    for name in names:  # a bad name is said before the first slice compiles
        placement(None, None, name)
    with sharing_proxies():  # XLA:CPU ranks a candidate once for slices of one size
        rankings = [
            suggest_here({**request, "devices": None, "target": name}, progress) for name in names
        ]
    return Targets.of(names, rankings)


def targets_worker() -> int:
    """A worker's entry: `targets_here`, its progress told, answered pickled."""
    return serve(lambda request: pickled(targets_here(request, _tell), "the rankings", "report it"))


def diff_here(request: Mapping[str, Any]) -> Diff:
    """`eqshard diff` in this process: the request's `"a"` and `"b"` (spec files),
    `"model"`, and with `"step"` its `"batch"` and `"optimizer"`, on `"devices"` or
    the `"target"` slice."""
    from .._search._diff import diff
    from .._specfile._read import load

    devices, target = request.get("devices"), request.get("target")  # `--simulate N`
    a, b = load(str(request["a"])), load(str(request["b"]))
    n = devices if devices is not None else a.devices or b.devices or 8
    compiling = request.get("step") is not None and target is None
    _start_jax(n if compiling else None)
    if compiling:
        import jax

        if len(jax.devices()) < n:
            raise EqshardError(
                f"the diff's step compiles on {n} devices, which needs {n} simulated devices, "
                f"but JAX started with {len(jax.devices())} (is XLA_FLAGS setting a device "
                "count?)"
            )
    model, inputs = _built(request)
    if inputs is None:
        return diff(model, a, b, simulate=devices, target=target)
    return diff(model, a, b, *inputs.args, step=inputs.step, simulate=devices, target=target)


def diff_worker() -> int:
    """A worker's entry: `diff_here`, answered pickled (its costs' meshes abstract)."""
    return serve(lambda request: pickled(_portable(diff_here(request)), "the diff", "report it"))


def _portable(found: Diff) -> Diff:
    """`found` with no device in it, to cross to another process."""
    import dataclasses

    from .._cost._driver import portable

    if found.costs is None:
        return found
    return dataclasses.replace(found, costs=(portable(found.costs[0]), portable(found.costs[1])))


_COMMANDS = {  # each command's worker, what it answers, and what to try when it dies
    "suggest": (
        "eqshard._cli._suggest_diff:suggest_worker",
        "the ranking",
        "Run `eqshard check --step` on one spec file to see why",
    ),
    "targets": (
        "eqshard._cli._suggest_diff:targets_worker",
        "the rankings",
        "Run `eqshard suggest --target` on one slice to see why",
    ),
    "diff": (
        "eqshard._cli._suggest_diff:diff_worker",
        "the diff",
        "Run `eqshard check` on each file",
    ),
}


def run(
    command: str,
    request: Mapping[str, Any],
    here: bool,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> Any:
    """`suggest_here`, `targets_here` or `diff_here` (`command`: `"suggest"`,
    `"targets"` or `"diff"`), in this process (`here`), else in a worker process of
    its own, which starts JAX for it and answers the result pickled. `suggest`'s
    progress goes to `progress`, each as an `event`; its workers' stderr is kept
    from this process's unless the request is `"verbose"`."""
    if here and command == "diff":
        return diff_here(request)
    if here:
        told = None if progress is None else lambda p: progress(event(p))
        return (suggest_here if command == "suggest" else targets_here)(request, told)
    entry, what, hint = _COMMANDS[command]
    worker = start_worker(
        request,
        entry,
        without_device_count(os.environ),
        quiet=command != "diff" and not request.get("verbose", False),
        events=progress,
    )
    document = worker_answer(worker, _TIMEOUT_SECONDS, f"eqshard {command}", hint)
    return unpickled(document["result"], what)
