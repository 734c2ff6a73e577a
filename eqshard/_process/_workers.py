"""Worker processes: the one way to another process that `eqshard check`,
`eqshard.testing`, `eqshard.cost` and `eqshard suggest` share.

- `start_worker` starts a fresh Python process with this one's `sys.path`, which
    runs the entry point its caller names (`module:function`), reads one JSON
    request and answers one JSON document (`serve`), and dies when this process
    dies (`Worker`); `worker_answer` reads the answer, raising the worker's error
    here as the same class (`error_entry` writes it, `rebuilt_error` reads it),
    with its notes (where in the user's code it was raised: `_usercode.user_frames`)
    and, as its cause, the worker's traceback as text (`WorkerTraceback`, as
    `concurrent.futures` carries a process's), and a timeout as a `ModelError`;
- `start_serving` starts a worker that answers several requests in turn, one JSON
    line each (`serve_each`, until its stdin ends; `Worker.ask`, `Worker.answer`),
    and `pool_answers` hands a pool of them one request at a time from a shared
    queue, each worker taking the next as it finishes the last, a worker that dies
    failing only the request it held (a fresh one takes its place);
- a worker started `quiet` writes its stderr (XLA's warnings, the user's prints) to
    a file of its own rather than this process's stderr, and a worker that ends
    without an answer is said with the end of it; a worker started with `events`
    sends this process lines as it works (`tell`), on a pipe of their own;
- `_pickles.py`'s `pickled` and `unpickled` carry what JSON cannot (a step, abstract
    arguments, a spec) inside the request or the answer, as base64 text, and
    `_worker_errors.py` carries a worker's error back.

This module names no caller: each passes its own entry point. The user's code,
named `MODULE:CALLABLE`, is imported by `_usercode.py`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._errors import ModelError
from ._worker_errors import error_entry, rebuilt_error

__all__ = [
    "Worker",
    "pool_answers",
    "serve",
    "serve_each",
    "start_serving",
    "start_worker",
    "tell",
    "without_device_count",
    "worker_answer",
]


_LIFELINES: set[int] = set()  # this process's ends of its workers' lifelines


def _let_go_of_lifelines() -> None:
    """In a child forked from this process (without exec), its copies of the
    lifelines: closed, so that only this process keeps its workers alive."""
    for fd in list(_LIFELINES):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LIFELINES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_let_go_of_lifelines)


class Worker:
    """A worker process that `start_worker` started, with this process's end of
    its lifeline: a pipe whose other end the worker watches, and which closes when
    this process ends, however it ends (SIGKILL included). The worker then ends
    at once, rather than running on with no one to answer."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        lifeline: int,
        log: Any = None,
        listener: threading.Thread | None = None,
    ) -> None:
        self.process = process
        self._lifeline = lifeline
        self._log = log  # the file its stderr goes to, where it was started `quiet`
        self.quiet = log is not None  # its stderr is its own (`last_words`), not this process's
        self._said: str | None = None  # the end of the log, read as it was stopped
        self._listener = listener  # the thread reading its events, if it sends any
        self._read = b""  # what it has answered past the last whole line (`start_serving`'s)
        self._timeout = 0.0  # the seconds the last `ask` allows, from `deadline`
        self.deadline = 0.0  # when its answer to the last `ask` is due (`time.monotonic`)

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.process.pid

    @property
    def running(self) -> bool:
        """Whether the worker still runs (after `answer` raised: it answered an error,
        rather than ending or being stopped)."""
        return self.process.poll() is None

    def last_words(self) -> str:
        """The end of what it wrote on stderr, where it was started `quiet`: its last
        `LAST_LINES` lines, at most `LAST_CHARACTERS` characters; empty otherwise."""
        if self._said is not None:
            return self._said
        if self._log is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            size = os.fstat(self._log.fileno()).st_size
            data = os.pread(
                self._log.fileno(), LAST_CHARACTERS * 4, max(0, size - LAST_CHARACTERS * 4)
            )
            lines = data.decode("utf-8", "replace").strip().splitlines()[-LAST_LINES:]
            return "\n".join(lines)[-LAST_CHARACTERS:]
        return ""

    def fileno(self) -> int:
        """Its answers' end, for `select`."""
        if self.process.stdout is None:
            raise TypeError("a worker answers on a pipe: `start_worker` gives it one")
        return self.process.stdout.fileno()

    def ask(self, request: Mapping[str, Any], timeout: float) -> None:
        """Sends a worker that `start_serving` started one request (one JSON line,
        written by a thread of its own, so that a worker still starting never holds
        this process); `answer` reads its answer, due within `timeout` seconds."""
        line = (json.dumps(request, ensure_ascii=True) + "\n").encode("ascii")
        self._timeout = timeout
        self.deadline = time.monotonic() + timeout
        sink = self.process.stdin
        if sink is None:
            raise TypeError("`Worker.ask` needs a worker that `start_serving` started")

        def write() -> None:
            with contextlib.suppress(OSError, ValueError):  # it has ended, or been stopped
                sink.write(line)
                sink.flush()

        threading.Thread(target=write, name="eqshard-request", daemon=True).start()

    def answer(self, doing: str, hint: str) -> dict[str, Any]:
        """The answer to the last `ask`, `{"result": ...}`, waited for until its
        deadline; its `{"error": ...}` raised here as the same class (`rebuilt_error`),
        the worker still serving.

        **Raises:**

        The worker's error; `ModelError` when it takes longer than `ask` allowed, or
        ends without an answer (the worker has then ended, `running` is false).
        """
        fd = self.fileno()
        while b"\n" not in self._read:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.stop()
                raise _took_too_long(doing, self._timeout)
            data = os.read(fd, 1 << 16)
            if not data:  # it has ended
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(5)  # its exit code, not the signal `stop` sends
                self.stop()
                return _document(b"", self, doing, hint)
            self._read += data
        line, _, self._read = self._read.partition(b"\n")
        return _document(line, self, doing, hint)

    def stop(self) -> None:
        """Kills the worker if it still runs, reaps it, and closes the lifeline.
        Stopping a stopped worker does nothing."""
        if self.process.returncode is None:
            self.process.kill()
            with contextlib.suppress(OSError, ValueError):  # its requests' end, already closed
                self.process.communicate()
            self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError, ValueError):
                    pipe.close()
        if self._listener is not None:  # every event it sent, delivered before it is gone
            self._listener.join(5)
            self._listener = None
        if self._log is not None:
            self._said = self.last_words()
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None
        if self._lifeline >= 0:
            _LIFELINES.discard(self._lifeline)
            with contextlib.suppress(OSError):
                os.close(self._lifeline)
            self._lifeline = -1


LAST_LINES = 12  # of a quiet worker's stderr, in the message when it ends unanswered
LAST_CHARACTERS = 2000

_PROGRAM = """\
import sys
sys.path[:] = {path!r}
from eqshard._process._workers import _worker_main
raise SystemExit(_worker_main({lifeline}, {entry!r}, {main_thread!r}, {events}))
"""

_EVENTS = -1  # in a worker started with `events`: the pipe its `tell` writes to


def start_worker(
    request: Mapping[str, Any],
    entry: str,
    env: Mapping[str, str] | None = None,
    *,
    quiet: bool = False,
    events: Callable[[dict[str, Any]], None] | None = None,
) -> Worker:
    """A fresh Python process running `entry`, with this process's `sys.path`, so
    it imports what this one would (the user's modules, a folder a script added).

    The worker dies when this process dies, however it dies: it watches a pipe
    whose write end this process alone holds (no child inherits it), and ends when
    that closes, even before it has started; on Linux, where the main thread starts
    it, the kernel kills it too (`PR_SET_PDEATHSIG`). Ctrl-C reaches this process
    alone, which stops its workers.

    **Arguments:**

    - `request`: the worker's request, which `entry` reads as JSON from stdin.
    - `entry`: `module:function`, whose function answers one JSON document on
        stdout (`serve`) and returns the exit code.
    - `env`: the worker's environment; by default this process's.
    - `quiet`: its stderr (and its children's) goes to a file of its own, not to
        this process's stderr; `Worker.last_words` reads its end.
    - `events`: called, on a thread of this process, with each event the worker
        sends (`tell`), as it works; every one is delivered before `worker_answer`
        returns.

    **Returns:**

    The `Worker`; `worker_answer` reads its answer, and `Worker.stop` ends it.
    """
    with tempfile.TemporaryFile() as stdin:  # a file, not a pipe: nothing to feed or close
        stdin.write(json.dumps(request, ensure_ascii=True).encode("ascii"))
        stdin.seek(0)
        return _started(stdin, entry, env, quiet, events)


def start_serving(
    entry: str, env: Mapping[str, str] | None = None, *, quiet: bool = False
) -> Worker:
    """A fresh Python process running `entry`, as `start_worker` starts one (this
    process's `sys.path`, dying with it), that answers several requests in turn:
    `Worker.ask` sends one, `Worker.answer` reads its answer, and `Worker.stop`
    ends it; `pool_answers` keeps several busy.

    **Arguments:**

    - `entry`: `module:function`, whose function answers each JSON line read from
        stdin with one on stdout, until stdin ends (`serve_each`), and returns the
        exit code.
    - `env`: the worker's environment; by default this process's.
    - `quiet`: as for `start_worker`.
    """
    return _started(subprocess.PIPE, entry, env, quiet)


def _started(
    stdin: Any,
    entry: str,
    env: Mapping[str, str] | None,
    quiet: bool = False,
    events: Callable[[dict[str, Any]], None] | None = None,
) -> Worker:
    """`start_worker`'s and `start_serving`'s process, reading `stdin`."""
    read_end, write_end = os.pipe()  # neither is inherited by what this process runs
    heard, told = os.pipe() if events is not None else (-1, -1)
    _LIFELINES.add(write_end)
    program = _PROGRAM.format(
        path=sys.path,
        lifeline=read_end,
        entry=entry,
        main_thread=threading.current_thread() is threading.main_thread(),
        events=told,
    )
    log = tempfile.TemporaryFile() if quiet else None  # noqa: SIM115 (`Worker.stop` closes it)
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", program],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=log,
            env=None if env is None else dict(env),
            pass_fds=(read_end,) if told < 0 else (read_end, told),
            # Ctrl-C reaches this process alone, which stops the workers (killing a
            # worker halfway through starting Python or importing NumPy would
            # print tracebacks)
            start_new_session=True,
        )
    except BaseException:
        _LIFELINES.discard(write_end)
        os.close(write_end)
        if log is not None:
            log.close()
        if heard >= 0:
            os.close(heard)
        raise
    finally:
        os.close(read_end)  # the worker's ends: this process keeps none of them
        if told >= 0:
            os.close(told)
    listener = None
    if events is not None:
        listener = threading.Thread(
            target=_listen, args=(heard, events), name="eqshard-events", daemon=True
        )
        listener.start()
    return Worker(process, write_end, log, listener)


def _listen(heard: int, events: Callable[[dict[str, Any]], None]) -> None:
    """Hands `events` each line a worker `tell`s, until it ends."""
    with os.fdopen(heard, "rb") as lines:
        for line in lines:
            with contextlib.suppress(Exception):  # a display that fails stops no work
                event = json.loads(line)
                if isinstance(event, dict):
                    events(event)


def tell(event: Mapping[str, Any]) -> None:
    """In a worker started with `events` (`start_worker`), sends its parent `event`
    (JSON), which its `events` gets as it comes; elsewhere it does nothing."""
    if _EVENTS >= 0:
        with contextlib.suppress(OSError, TypeError, ValueError):  # the parent has gone
            os.write(_EVENTS, (json.dumps(event, ensure_ascii=True) + "\n").encode("ascii"))


def _worker_main(lifeline: int, entry: str, main_thread: bool, events: int = -1) -> int:
    """A worker's first steps, before anything slow: it dies with its parent, then
    runs `entry` (`start_worker`'s program calls it)."""
    global _EVENTS
    os.set_inheritable(lifeline, False)  # the worker's own children do not hold it
    if events >= 0:
        os.set_inheritable(events, False)
        _EVENTS = events
    if main_thread and sys.platform == "linux":
        # The kernel kills the worker when the thread that started it ends: only
        # the main thread, whose end is the process's, so it never fires early.
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    # If the parent has already gone, the pipe reads as ended at once.
    threading.Thread(target=_watch, args=(lifeline,), name="eqshard-lifeline", daemon=True).start()
    module, _, function = entry.partition(":")
    try:
        main = getattr(importlib.import_module(module), function)
    except BaseException as error:
        print(f"eqshard: a worker cannot start: {type(error).__name__}: {error}", file=sys.stderr)
        return 3
    return main()


def _watch(lifeline: int) -> None:
    """Waits for the parent's end of the lifeline to close, then ends this worker
    at once (nobody is left to answer)."""
    with contextlib.suppress(OSError):
        while os.read(lifeline, 1):
            pass
    os._exit(1)


def worker_answer(worker: Worker, timeout: float, doing: str, hint: str) -> dict[str, Any]:
    """The worker's answer, `{"result": ...}`; its `{"error": ...}` raised here as
    the same class (`rebuilt_error`). The worker has ended when this returns or
    raises.

    **Arguments:**

    - `worker`: what `start_worker` gave.
    - `timeout`: the seconds it may take.
    - `doing`: the work, with its device count, for messages ("checking on 8
        devices").
    - `hint`: what to try when the worker ends without answering.

    **Raises:**

    The worker's error; `ModelError` when the worker takes longer than `timeout`
    (saying what ran, on how many devices, for how long) or ends without an answer.
    """
    try:
        out, _ = worker.process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise _took_too_long(doing, timeout) from None
    finally:
        worker.stop()
    return _document(out, worker, doing, hint)


def _took_too_long(doing: str, timeout: float) -> ModelError:
    return ModelError(
        f"{doing} took longer than {timeout:g} s, and was stopped; does the user's "
        "code wait for something, or does it need a longer timeout?"
    )


def _document(out: bytes, worker: Worker, doing: str, hint: str) -> dict[str, Any]:
    """The answer `out` holds, `{"result": ...}`; its error raised as the same class;
    none (the worker ended without one) a `ModelError` saying how it ended."""
    try:
        document = json.loads(out)
    except ValueError:
        document = None
    if not isinstance(document, dict) or not ("result" in document or "error" in document):
        code = worker.process.returncode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        raise ModelError(
            f"{doing}: its process ended ({how}) without an answer; {_said(worker)} {hint}"
        )
    if "error" in document:
        raise rebuilt_error(document["error"])
    return document


def _said(worker: Worker) -> str:
    """What a worker that ended unanswered wrote on stderr, for the message: above,
    or (quiet) its last lines, or that it wrote nothing."""
    if not worker.quiet:
        return "what it printed is above."
    last = worker.last_words()
    if not last:
        return "it wrote nothing on stderr."
    return f"the last it wrote on stderr:\n{last}\n"


def pool_answers(
    requests: Sequence[Mapping[str, Any]],
    entry: str,
    workers: int,
    *,
    first: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float,
    doing: Sequence[str],
    hint: str,
    wanted: Callable[[int, Sequence[Any]], bool] | None = None,
    warm: Sequence[Worker] = (),
    ahead: Mapping[Worker, int] | None = None,
    quiet: bool = False,
    answered: Callable[[int], None] | None = None,
) -> list[Any]:
    """Each request's answer, from a pool of workers that take them from one queue:
    each worker starts once (`start_serving`), then is handed the next request as
    it answers the last, until none are left, so a slow request holds one worker
    and the others take the rest.

    **Arguments:**

    - `requests`: one per piece of work, handed out in order.
    - `entry`: the workers' `module:function`, which answers with `serve_each`.
    - `workers`: how many start at once (at most one per request).
    - `first`: what each worker's first request carries besides its own (the
        inputs every request shares, sent once per worker).
    - `env`: the workers' environment; by default this process's.
    - `timeout`: the seconds each request may take.
    - `doing`: each request's work, for messages ("costing fsdp (data=8) on 8
        devices").
    - `hint`: what to try when a worker ends without answering.
    - `wanted`: whether request `i` is still wanted, given the results so far (`None`
        where not answered yet): asked each time a worker is free, of the requests
        left in order; the first wanted one is handed out, and the pool ends when no
        request left is wanted and none is being answered. By default every one is.
    - `warm`: workers started before (`start_serving`) and already asked `first`
        alone, whose answer is read here before they take requests: they count
        towards `workers`, and a fresh one starts only past them.
    - `ahead`: those `warm` workers asked `first` with a request, by its index: each
        holds that request from the start, and its answer is the request's.
    - `quiet`: the workers' stderr each goes to a file of their own (`start_worker`).
    - `answered`: called with `i` as request `i` gets its result or fails.

    **Returns:**

    Each request's `result`, in the requests' order; `None` for a request never
    handed out (not wanted); where its worker ended without answering it (killed,
    out of memory) or took longer than `timeout`, the `ModelError` saying so: that
    request alone fails, and a fresh worker takes the next.

    **Raises:**

    An error a worker answers, as the same class (every worker is stopped).
    """
    results: list[Any] = [None] * len(requests)
    queue = list(range(len(requests)))
    busy: dict[Worker, int] = {}  # each worker, and the request it holds
    idle: list[Worker] = []  # started, and waiting for a request to be wanted
    started: list[Worker] = []

    def next_wanted() -> int | None:
        for k, i in enumerate(queue):
            if wanted is None or wanted(i, results):
                return queue.pop(k)
        return None

    def hand(worker: Worker | None) -> bool:
        """Hands `worker` (a fresh one where `None`) the next wanted request."""
        i = next_wanted()
        if i is None:
            if worker is not None:
                idle.append(worker)
            return False
        fresh = worker is None
        if worker is None:
            worker = start_serving(entry, env, quiet=quiet)
            started.append(worker)
        request = {**(first or {}), **requests[i]} if fresh else requests[i]
        worker.ask(request, timeout)
        busy[worker] = i
        return True

    try:
        started += warm
        for worker, i in (ahead or {}).items():  # compiling since it started
            queue.remove(i)
            busy[worker] = i
        for worker in warm:
            if worker in busy:
                continue
            worker.answer("starting a worker", hint)  # its inputs read: ready
            hand(worker)
        for _ in range(min(max(1, workers), len(requests)) - len(warm)):
            if not hand(None):
                break
        while busy:
            soonest = min(worker.deadline for worker in busy)
            ready = select.select(list(busy), [], [], max(0.0, soonest - time.monotonic()))[0]
            due = [worker for worker in busy if worker.deadline <= time.monotonic()]
            for worker in dict.fromkeys([*ready, *due]):
                i = busy.pop(worker)
                try:
                    results[i] = worker.answer(doing[i], hint)["result"]
                except ModelError as error:
                    if worker.running:  # it answered this error: raised here
                        raise
                    results[i] = error  # it ended without answering: this request fails
                    if answered is not None:
                        answered(i)
                    if queue and not idle:
                        hand(None)
                    continue
                if answered is not None:
                    answered(i)
                hand(worker)
            while idle and queue and hand(idle.pop()):  # an answer may want more
                pass
    finally:
        for worker in started:
            worker.stop()
    return results


def without_device_count(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for a worker that sets its own device count: XLA_FLAGS
    without a simulated device count (a test suite's conftest often sets one)."""
    env = dict(environ)
    flags = [
        flag
        for flag in env.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    return env


def serve(handle: Callable[[Mapping[str, Any]], Any]) -> int:
    """A worker's main: reads one JSON request from stdin and writes one JSON
    document to stdout, `{"result": handle(request)}` or `{"error": error_entry(...)}`;
    nothing else goes to stdout (what the user's code prints, from Python or C, goes
    to stderr).

    **Returns:**

    The exit code: 0 once it has answered, whatever the answer; 130 on Ctrl-C,
    without an answer. It never prints a traceback.
    """
    sys.stdout.flush()
    answer = os.fdopen(os.dup(1), "w", encoding="ascii")  # stdout, for the answer alone
    with contextlib.suppress(OSError):
        os.dup2(2, 1)  # anything else written to stdout, by Python or C, goes to stderr
    try:
        document: dict[str, Any] = {"result": handle(json.load(sys.stdin))}
    except KeyboardInterrupt:
        return 130
    except BaseException as error:  # whatever it is, an answer rather than a traceback
        document = {"error": error_entry(error)}
    with contextlib.suppress(OSError), answer:  # OSError: the reader has gone
        json.dump(document, answer, ensure_ascii=True)
    return 0


def serve_each(handle: Callable[[Mapping[str, Any]], Any]) -> int:
    """A worker's main for `start_serving`: answers each JSON line read from stdin
    with one JSON line on stdout, `{"result": handle(request)}` or `{"error":
    error_entry(...)}`, until stdin ends; as `serve`, nothing else goes to stdout.
    What `handle` keeps between requests (JAX started, the step built) is its own.

    **Returns:**

    The exit code: 0 once stdin has ended or the reader has gone; 130 on Ctrl-C,
    without an answer. It never prints a traceback.
    """
    sys.stdout.flush()
    answer = os.fdopen(os.dup(1), "w", encoding="ascii")  # stdout, for the answers alone
    with contextlib.suppress(OSError):
        os.dup2(2, 1)  # anything else written to stdout, by Python or C, goes to stderr
    with contextlib.suppress(OSError), answer:  # OSError: the reader has gone
        while line := sys.stdin.readline():
            try:
                document: dict[str, Any] = {"result": handle(json.loads(line))}
            except KeyboardInterrupt:
                return 130
            except BaseException as error:  # whatever it is, an answer rather than a traceback
                document = {"error": error_entry(error)}
            answer.write(json.dumps(document, ensure_ascii=True) + "\n")
            answer.flush()
    return 0
