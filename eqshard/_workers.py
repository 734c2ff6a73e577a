"""Worker processes and the user's code: what `eqshard check` and `eqshard.testing`
share.

- `user_callable` imports the callable a `MODULE:CALLABLE` names (a dotted module
    or a `.py` file), and `call` runs the user's code with what it raises turned
    into a `ModelError` and what it prints sent to stderr;
- `start_worker` starts a fresh Python process with this one's `sys.path`, which
    reads one JSON request and answers one JSON document; `worker_answer` reads the
    answer, raising the worker's error here as the same class (`error_entry` writes
    it, `rebuilt_error` reads it).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ._errors import EqshardError, Problem, SpecError, UnreadableError

__all__ = [
    "ModelError",
    "call",
    "error_entry",
    "problem_of",
    "rebuilt_error",
    "serve",
    "start_worker",
    "user_callable",
    "worker_answer",
]


def problem_of(entry: Mapping[str, Any]) -> Problem:
    """The problem a `Problem.to_json()` or `dataclasses.asdict(problem)` entry describes."""
    return Problem(entry["where"], entry["message"], entry.get("detail") or "", entry.get("file"))


class ModelError(EqshardError):
    """The model named by `--model` (or the step, optimizer or batch named by
    `--step`, `--optimizer`, `--batch`) cannot be imported, built or compiled (exit
    code 2)."""

    exit_code = 2


def _import_user_module(
    target: str, module_name: str, option: str = "--model", modules: dict[str, Any] | None = None
) -> Any:
    """Imports the user's module: a dotted name, or a `.py` file whose folder is
    appended to `sys.path` (so its sibling modules import, and never shadow the
    standard library). A file already in `modules` is not run again."""
    try:
        if not (module_name.endswith(".py") or "/" in module_name or os.sep in module_name):
            return importlib.import_module(module_name)
        path = Path(module_name)
        if not path.is_file():
            raise ModelError(f"{option} {target!r}: there is no file {module_name!r}")
        if path.suffix != ".py":
            raise ModelError(
                f"{option} {target!r}: {module_name!r} is not a Python file; name a .py "
                "file or a dotted module"
            )
        key = str(path.resolve())
        if modules is not None and key in modules:
            return modules[key]
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.append(folder)
        name = f"_eqshard_model_{path.stem}"  # never shadows a module such as `json`
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ModelError(f"--model {target!r}: cannot load {module_name!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        if modules is not None:
            modules[key] = module
        return module
    except EqshardError:
        raise
    except KeyboardInterrupt:
        raise
    except ImportError as error:
        raise ModelError(f"{option} {target!r}: cannot import {module_name!r}: {error}") from None
    except BaseException as error:  # the user's module failed: report, don't crash
        raise ModelError(
            f"{option} {target!r}: importing {module_name!r} raised {type(error).__name__}: {error}"
        ) from None


def user_callable(
    target: str, option: str, example: str, returns: str, modules: dict[str, Any] | None
) -> tuple[str, Callable[..., Any]]:
    """The callable `MODULE:CALLABLE` names, with its name; its module imported
    with stdout sent to stderr."""
    module_name, sep, attribute = target.rpartition(":")
    if not sep or not module_name or not attribute:
        raise ModelError(
            f"{option} {target!r}: write MODULE:CALLABLE, e.g. 'mypkg.model:{example}' or "
            f"'model.py:{example}', where {returns}"
        )
    # The user's code may print: keep stdout for eqshard's own output (JSON, tables).
    with contextlib.redirect_stdout(sys.stderr):
        module = _import_user_module(target, module_name, option, modules)
    factory: Any = module
    for name in attribute.split("."):  # a qualname: `Factory.build` names a method
        factory = getattr(factory, name, None)
    if not callable(factory):
        raise ModelError(f"{option} {target!r}: {module_name} has no callable {attribute!r}")
    return attribute, factory


def call(
    option: str,
    target: str,
    what: str,
    fn: Callable[[], Any],
    keep: tuple[type[BaseException], ...] = (),
) -> Any:
    """`fn()`, with what the user's code raises (but `keep`) as a `ModelError`, and
    what it prints on stderr."""
    with contextlib.redirect_stdout(sys.stderr):
        try:
            return fn()
        except KeyboardInterrupt:
            raise
        except keep:
            raise
        except BaseException as error:  # the user's code failed: report, don't crash
            raise ModelError(
                f"{option} {target!r}: {what} raised {type(error).__name__}: {error}"
            ) from None


def start_worker(
    request: Mapping[str, Any],
    entry: str = "eqshard._check:main_worker",
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """A fresh Python process running `entry` (`module:function`, which reads
    `request` as JSON from stdin and answers one JSON document on stdout), with this
    process's `sys.path`, so it imports what this one would."""
    module, _, function = entry.partition(":")
    program = (
        "import sys\n"
        f"sys.path[:] = {sys.path!r}\n"
        "try:\n"
        f"    from {module} import {function} as main\n"
        "except BaseException as error:\n"
        "    print(f'eqshard: a worker cannot start: {type(error).__name__}: {error}',\n"
        "          file=sys.stderr)\n"
        "    raise SystemExit(3) from None\n"
        "raise SystemExit(main())\n"
    )
    with tempfile.TemporaryFile() as stdin:  # a file, not a pipe: nothing to feed or close
        stdin.write(json.dumps(request, ensure_ascii=True).encode("ascii"))
        stdin.seek(0)
        return subprocess.Popen(
            [sys.executable, "-c", program],
            stdin=stdin,
            stdout=subprocess.PIPE,
            env=None if env is None else dict(env),
            # Ctrl-C reaches this process alone, which stops the workers (killing a
            # worker halfway through starting Python or importing NumPy would
            # print tracebacks)
            start_new_session=True,
        )


def worker_answer(
    process: subprocess.Popen[bytes], timeout: float, doing: str, hint: str
) -> dict[str, Any]:
    """The worker's answer, `{"result": ...}`; its `{"error": ...}` raised here as
    the same class (`rebuilt_error`). `doing` names the work in messages ("checking
    on 8 devices"); `hint` says what to try when the worker dies without answering."""
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise ModelError(
            f"{doing} took longer than {timeout:g} s, and was stopped; "
            "does importing or building the model wait for something?"
        ) from None
    try:
        document = json.loads(out)
    except ValueError:
        document = None
    if not isinstance(document, dict) or not ("result" in document or "error" in document):
        code = process.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        raise ModelError(
            f"{doing}: its process ended ({how}) without an answer; what it printed is "
            f"above. {hint}"
        )
    if "error" in document:
        raise rebuilt_error(document["error"])
    return document


def rebuilt_error(entry: Mapping[str, Any]) -> BaseException:
    """A worker's error, as this process raises it: eqshard's errors and Python's
    own as the same class (so the command line prints the same message and picks
    the same exit code), anything else as an exception of the same name."""
    kind, message = str(entry["type"]), str(entry["message"])
    if kind in ("SpecError", "UnreadableError") and "problems" in entry:
        cls = UnreadableError if kind == "UnreadableError" else SpecError
        return cls([problem_of(p) for p in entry["problems"]], entry.get("headline"))
    if kind == "ModelError":
        return ModelError(message)
    if entry.get("eqshard"):
        error = EqshardError(message)
        if entry.get("exit_code") != 1:  # a subclass with an exit code of its own
            setattr(error, "exit_code", entry["exit_code"])  # noqa: B010
        return error
    builtin = getattr(builtins, kind, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception):
        with contextlib.suppress(Exception):
            return builtin(message)
    return type(kind if kind.isidentifier() else "Exception", (Exception,), {})(message)


def error_entry(error: BaseException) -> dict[str, Any]:
    """What the worker says of an error (the exit code as `eqshard._cli` chooses it)."""
    try:
        message = str(error)
    except Exception:  # a user's exception whose text cannot be had
        message = f"{type(error).__name__} (its message cannot be shown)"
    code = getattr(error, "exit_code", None)
    if not isinstance(code, int):
        plain = isinstance(error, EqshardError) and not isinstance(error, UnreadableError)
        code = 1 if plain else 2
    entry: dict[str, Any] = {
        "type": type(error).__name__,
        "message": message,
        "exit_code": code,
        "eqshard": isinstance(error, EqshardError),
    }
    if isinstance(error, SpecError):
        entry["headline"] = error.headline
        entry["problems"] = [dataclasses.asdict(p) for p in error.problems]
    return entry


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
