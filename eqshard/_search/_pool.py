"""`suggest`'s compile workers: each candidate costed with `eqshard.cost` in a pool
of worker processes (`_process/_workers.py`'s `pool_answers`, the one protocol), as
many as the cores hold compiles (`THREADS_PER_COMPILE`). Each worker starts JAX once
(or loads libtpu once), receives the step and the abstract model and arguments once,
then takes the candidates one at a time from a shared queue until none are left; a
candidate that fails to compile, or whose worker dies, is answered with its error."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from .._cost._driver import cost, portable
from .._errors import EqshardError, whole_number
from .._process._pickles import pickled, unpickled
from .._process._workers import (
    Worker,
    pool_answers,
    serve_each,
    start_serving,
    without_device_count,
)
from ._ranked import name_of, where_text

if TYPE_CHECKING:
    from .._cost._results import Cost
    from .._sharding import Devices
    from .._specfile._model import Rules
    from ._candidates import Candidate

    Wanted: TypeAlias = Callable[[int, Sequence[Cost | str | None]], bool] | None
    Found: TypeAlias = list[Cost | str | None]
    Answered: TypeAlias = Callable[[int], None] | None
    CompileEach: TypeAlias = Callable[[Sequence[Candidate], str | None, Wanted, Answered], Found]

__all__ = [
    "THREADS_PER_COMPILE",
    "compile_in_workers",
    "cost_one",
    "in_workers",
    "pool_size",
]


def _cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def in_workers(
    inputs: Mapping[str, Any], devices: int, workers: int | None, quiet: bool = True
) -> _InWorkers:
    """`search`'s way to compile: in pools of worker processes (`compile_in_workers`),
    which get the step's inputs as `inputs` says; `quiet`, their stderr kept to
    themselves (said where one dies)."""
    return _InWorkers(inputs, devices, workers, quiet)


class _InWorkers:
    """Compiles candidates in worker pools; `prepare(target, n, head)` starts the
    target's workers ahead where the cores hold them beside XLA:CPU's pool, so they
    load the compiler and read the inputs while it compiles, the first of them
    compiling `head` at once."""

    def __init__(
        self, inputs: Mapping[str, Any], devices: int, workers: int | None, quiet: bool
    ) -> None:
        self.inputs, self.devices, self.workers = inputs, devices, workers
        self.quiet = quiet
        self.warm: dict[str | None, list[Worker]] = {}
        self.ahead: dict[str | None, tuple[Worker, Candidate]] = {}

    def prepare(self, target: str | None, candidates: int, head: Candidate) -> bool:
        """Where the cores hold XLA:CPU's pool for `candidates` and a `target` compile
        beside it, starts `target`'s workers, the first compiling `head` at once, and
        says so; else starts nothing (on 2 cores the 8B's search took 77 s with both
        at once, against 64 s one after the other)."""
        cpu = pool_size(candidates, None, self.workers)
        if _cores() < cpu + THREADS_PER_COMPILE["XLA:TPU"]:
            return False
        first = {"inputs": dict(self.inputs), "devices": self.devices, "target": target}
        started = []
        for k in range(pool_size(candidates, target, self.workers)):
            worker = start_serving(_ENTRY, without_device_count(os.environ), quiet=self.quiet)
            if k == 0:  # compiled as soon as the worker has read the inputs
                worker.ask({**first, **_request(head)}, _TIMEOUT_SECONDS)
                self.ahead[target] = (worker, head)
            else:
                worker.ask(first, _TIMEOUT_SECONDS)
            started.append(worker)
        self.warm[target] = started
        return True

    def close(self) -> None:
        """Stops the workers started ahead and not used (a pass before them failed)."""
        for started in self.warm.values():
            for worker in started:
                worker.stop()
        self.warm.clear()
        self.ahead.clear()

    def __call__(
        self, chosen: Sequence[Candidate], where: str | None, wanted: Wanted, answered: Answered
    ) -> Found:
        warm = self.warm.pop(where, [])
        ahead: dict[Worker, int] = {}
        if where in self.ahead:  # its first worker compiling a candidate since it started
            worker, head = self.ahead.pop(where)
            held = [k for k, c in enumerate(chosen) if c is head]
            if held:
                ahead[worker] = held[0]
        try:
            return compile_in_workers(
                chosen,
                self.inputs,
                self.devices,
                where,
                self.workers,
                wanted=wanted,
                warm=warm,
                ahead=ahead,
                quiet=self.quiet,
                answered=answered,
            )
        finally:
            for worker in warm:
                worker.stop()


def cost_one(
    step: Any, model: Any, args: Sequence[Any], rules: Rules, devices: Devices, target: str | None
) -> Cost | str:
    """`eqshard.cost` of one candidate, or why it failed."""
    import jax

    where: dict[str, Any] = {}  # this process's devices, else a count simulated in a worker
    if not target:
        more = isinstance(devices, int) and devices > len(jax.devices())
        where = {"simulate": devices} if more else {"devices": devices}
    try:
        return cost(
            model,
            *args,
            step=step,
            spec=rules,
            target=target,
            compile_for="costing",  # cheaper, with the same figures (tests/test_cost.py)
            **where,
        )
    except Exception as error:  # a candidate that does not compile is listed, not fatal
        return _error_text(error)


def _error_text(error: BaseException) -> str:
    """An error as a failed candidate's reason: eqshard's own by their message (which
    names the step and the spec), anything else with its class."""
    text = str(error).strip()
    if not text:  # a reason is never empty
        return f"{type(error).__name__}, with no message"
    if isinstance(error, EqshardError):
        return text
    return f"{type(error).__name__}: {text}"


_TIMEOUT_SECONDS = 3600.0  # each candidate's compile, in a worker

# The cores one compile keeps busy, by compiler: XLA:TPU's own threads use about 1.8
# (measured on a Llama ranking, issue 31), XLA:CPU's about 1; a pool larger than the
# cores over this only makes each compile slower.
THREADS_PER_COMPILE = {"XLA:TPU": 1.8, "XLA:CPU": 1.0}


def pool_size(candidates: int, target: str | None, workers: int | None = None) -> int:
    """How many compile workers `compile_in_workers` starts for `candidates`: `workers`
    where given, else as many as the cores hold compiles (`THREADS_PER_COMPILE`), at
    least one, never more than the candidates."""
    if not workers:
        threads = THREADS_PER_COMPILE["XLA:CPU" if target is None else "XLA:TPU"]
        workers = max(1, int(_cores() // threads))
    return max(1, min(workers, candidates))


def compile_in_workers(
    candidates: Sequence[Candidate],
    inputs: Mapping[str, Any],
    devices: int,
    target: str | None,
    workers: int | None = None,
    *,
    wanted: Wanted = None,
    warm: Sequence[Worker] = (),
    ahead: Mapping[Worker, int] | None = None,
    quiet: bool = True,
    answered: Answered = None,
) -> Found:
    """Each candidate's `Cost`, or why it failed, compiled in worker processes; `None`
    for one never compiled because `wanted(k, found_so_far)` said no, when asked as a
    worker came free (by default every one is wanted). `warm` workers were started
    ahead and sent the inputs (`_InWorkers.prepare`); `ahead` those of them already
    compiling a candidate, by its index, whose answer is its result.

    `pool_size` workers start at once (by default as many as the cores hold
    compiles), each starting JAX or libtpu and building the step once, then take the
    candidates one at a time from one queue (`pool_answers`), so a slow compile holds
    one worker while the others take the rest. `inputs` says how a worker gets the
    step and its arguments, once: `{"pickle": ...}`, pickled (`pickled`), or
    `{"build": "MODULE:FUNCTION", "request": {...}}`, a function that builds them
    from the request (the command line's, which imports the user's modules by name).
    A worker that ends without an answer (killed, out of memory, past its time)
    fails the candidate it was compiling, with that message, and a fresh worker takes
    the next; an error it answers (its inputs cannot be read or built) is raised here.
    `quiet` keeps what the workers write on stderr (XLA's warnings) off this
    process's, and in the failure of a worker that dies; `answered(k)` is called as
    candidate `k` is done.
    """
    if not candidates:
        return []
    where = where_text(devices, target)
    read: dict[int, Cost | str] = {}

    def still_wanted(k: int, answers: Sequence[Any]) -> bool:
        assert wanted is not None
        for j, answer in enumerate(answers):
            if answer is not None and j not in read:
                read[j] = _read_answer(answer)
        return wanted(k, [read.get(j) for j in range(len(answers))])

    answers = pool_answers(
        [_request(c) for c in candidates],
        _ENTRY,
        pool_size(len(candidates), target, workers),
        first={"inputs": dict(inputs), "devices": devices, "target": target},
        env=without_device_count(os.environ),
        timeout=_TIMEOUT_SECONDS,
        doing=[f"costing {name_of(c)} on {where}" for c in candidates],
        hint="Cost the candidate with `eqshard.cost` in this process to see why",
        wanted=None if wanted is None else still_wanted,
        warm=warm,
        ahead=ahead,
        quiet=quiet,
        answered=answered,
    )
    return [
        None if answer is None else read[k] if k in read else _read_answer(answer)
        for k, answer in enumerate(answers)
    ]


def _request(candidate: Candidate) -> dict[str, str]:
    """What a compile worker is asked for one candidate: its rules, pickled."""
    return {"rules": pickled(candidate.rules, "the candidate's rules", "report it as a bug")}


def _read_answer(answer: Any) -> Cost | str:
    """A compile worker's answer: the `Cost`, or why the candidate failed."""
    if isinstance(answer, EqshardError):  # its worker ended without answering
        return str(answer)
    if answer.get("cost") is None:
        return str(answer["error"]) or "its worker answered an error with no message"
    return unpickled(answer["cost"], "the cost")


_ENTRY = "eqshard._search._pool:_worker"


def _worker() -> int:
    """A worker's entry (`compile_in_workers`): costs one candidate per request."""
    return serve_each(_Costing())


class _Costing:
    """A compile worker's requests (`serve_each`): its first carries the step's
    inputs, which it reads once (JAX started, the step built), and each one a
    candidate's rules, which it costs."""

    def __init__(self) -> None:
        self.inputs: tuple[Any, Any, tuple[Any, ...]] | None = None
        self.devices = 0
        self.target: str | None = None

    def __call__(self, request: Mapping[str, Any]) -> dict[str, str]:
        if "inputs" in request:
            self.inputs = _costs_here(request)
            self.devices = whole_number(request["devices"], "devices")
            self.target = request.get("target")
        if self.inputs is None:
            raise EqshardError("a compile worker's first request carries the step's inputs")
        if "rules" not in request:  # started ahead (`_InWorkers.prepare`): ready
            return {"ready": "yes"}
        step, model, args = self.inputs
        rules = unpickled(request["rules"], "the candidate's rules")
        found = cost_one(step, model, args, rules, self.devices, self.target)
        if isinstance(found, str):
            return {"error": found}
        return {"cost": pickled(portable(found), "the cost", "report it as a bug")}


def _costs_here(request: Mapping[str, Any]) -> tuple[Any, Any, tuple[Any, ...]]:
    """The step and its arguments in a compile worker, JAX not yet started: JAX
    started on the request's devices (or for its target), then the inputs read."""
    import jax

    target = request.get("target")
    devices = whole_number(request["devices"], "devices")
    jax.config.update("jax_platforms", "cpu")
    if target is None:
        jax.config.update("jax_num_cpu_devices", devices)
    step, model, args = _inputs(request["inputs"])
    started = len(jax.devices())  # the step's module may have started JAX with its own count
    if target is None and started < devices:
        raise EqshardError(
            f"costing the candidates on {devices} devices needs {devices} simulated devices, "
            f"but JAX started with {started}: the step's modules set that count "
            "(jax.config.update('jax_num_cpu_devices', ...)); leave the count to eqshard"
        )
    return step, model, args


def _inputs(entry: Mapping[str, Any]) -> tuple[Any, Any, tuple[Any, ...]]:
    """The step, the model and the other arguments, as the request carries them:
    pickled, or built by the function it names."""
    import importlib

    if "pickle" in entry:
        step, model, args = unpickled(entry["pickle"], "the step or its arguments")
        return step, model, tuple(args)
    module, _, function = str(entry["build"]).partition(":")
    step, model, args = getattr(importlib.import_module(module), function)(entry["request"])
    return step, model, tuple(args)
