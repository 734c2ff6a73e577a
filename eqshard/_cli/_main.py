"""The `eqshard` command line: `main` parses the arguments (`_parser.py`), runs the
command they name (`_commands.py`, `_check_command.py`), and says what went wrong.
Nothing imports this module but `__main__` (and the console script).

Exit codes: 0 success, 1 a spec or expression is at fault, 2 bad usage, an
unreadable file, the user's code or a bug in eqshard.

An error is printed as its message, without a traceback. Where the user's code
raised it (a `build()` that divides by zero, a step that fails), the message is
followed by the user's frames, each file and line with its source line, eqshard's,
the standard library's and JAX's left out (`_usercode.user_frames`), from this
process or from a worker. `--traceback` (before the command's name or after it),
or `EQSHARD_TRACEBACK=1` in the environment (read once, at import), prints the
whole Python traceback of any error instead, eqshard's own errors and its bugs
included, a worker's traceback as its cause.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import EqshardError, SpecError, UnreadableError
from .._process._usercode import with_user_frames
from ._check_command import check_command
from ._commands import demo, diff, schema, show, suggest, validate
from ._explain_command import explain_command
from ._output import EVERY_ONE, emit_json, err
from ._parser import BadUsage, parser

__all__ = ["TRACEBACK", "main"]

# EQSHARD_TRACEBACK=1 (any value but "", "0", "false", "no", "off"): every error's
# whole traceback, as --traceback prints it
TRACEBACK = os.environ.get("EQSHARD_TRACEBACK", "").strip().lower() not in (
    "",
    "0",
    "false",
    "no",
    "off",
)


_COMMANDS: dict[str, Callable[[Any], int]] = {
    "show": show,
    "demo": demo,
    "validate": validate,
    "check": check_command,
    "explain": explain_command,
    "suggest": suggest,
    "diff": diff,
    "schema": schema,
}


class _PipeSafe:
    """A stream whose reader may go away (`eqshard check ... | head -c 1`): writes
    after that are dropped, so the command runs to its end and exits with its own
    code, whenever the pipe closes."""

    def __init__(self, stream):
        self._stream = stream
        self.closed_by_reader = False

    def write(self, text: str) -> int:
        if not self.closed_by_reader:
            try:
                self._stream.write(text)
                self._stream.flush()
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.closed_by_reader:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.closed_by_reader = True
        try:  # and the interpreter's last flush at exit must not fail either
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


_TROUBLE = ("suggest", "diff")  # commands whose 1 means an answer: any error is 2


def _exit_code(error: BaseException) -> int:
    if isinstance(error, (UnreadableError, OSError, BadUsage)):
        return 2
    if isinstance(getattr(error, "exit_code", None), int):  # a model that cannot be built
        return error.exit_code  # type: ignore[attr-defined]
    return 1 if isinstance(error, EqshardError) else 2


def _message(command: str, error: BaseException, whole: bool) -> str:
    """What the command line says of `error`: its message; an error that is not
    eqshard's said to be a bug in eqshard; then its notes (where in the user's code
    it was raised: `with_user_frames`), unless the `whole` traceback shows them."""
    if isinstance(error, BadUsage):
        return str(error)
    if isinstance(error, (EqshardError, OSError)):
        text = error.text(EVERY_ONE) if isinstance(error, SpecError) else error
        message = f"eqshard {command}: error: {text}"
    else:
        message = (
            f"eqshard {command}: internal error: {type(error).__name__}: {error}\n"
            "This is a bug in eqshard; please report it with the command that caused it "
            + ("and the traceback above." if whole else "and its traceback (--traceback).")
        )
    if whole:
        return message
    notes = getattr(with_user_frames(error), "__notes__", ())
    return "\n".join([message, *(str(note) for note in notes)])


def _report(command: str, error: BaseException, as_json: bool, whole: bool) -> int:
    """Says what went wrong, on stderr (and as the JSON document on stdout with
    `--format json`), and returns the exit code. With `whole`, the whole
    traceback comes first."""
    code = 2 if command in _TROUBLE else _exit_code(error)
    message = _message(command, error, whole)
    text = "".join(traceback.format_exception(error)) if whole else None
    if text is not None:
        err(text.rstrip("\n"))
    err(message)
    if as_json:
        problems = error.problems if isinstance(error, SpecError) else []
        document: dict[str, Any] = {
            "message": message,
            "problems": [p.to_json() for p in problems],
        }
        if text is not None:
            document["traceback"] = text
        emit_json({"ok": False, "error": document})
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line and returns its exit code.

    Exit codes: 0 success; 1 a spec, expression or check is at fault; 2 bad usage,
    an unreadable file, a model that cannot be built, or a bug. No error prints a
    traceback but under `--traceback` or `EQSHARD_TRACEBACK=1`; one in the user's
    code prints the user's frames. With `--format json`, stdout holds one JSON
    document.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = any(
        a == "--format=json" or (a == "--format" and b == "json")
        for a, b in zip(argv, [*argv[1:], ""])
    )
    whole = TRACEBACK or "--traceback" in argv  # a usage error's traceback too
    stdout = sys.stdout
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:  # never fail on text a terminal cannot show
            reconfigure(errors="backslashreplace")
    sys.stdout = _PipeSafe(stdout)
    command = next((a for a in argv if not a.startswith("-")), "")  # till argparse says
    try:
        args = parser().parse_args(argv)
        command = args.command
        whole = whole or getattr(args, "traceback", False)  # `--trace`, as argparse reads it
        return _COMMANDS[command](args)
    except KeyboardInterrupt:
        return 130
    except SystemExit as exit:  # --help, --version
        return exit.code if isinstance(exit.code, int) else 0
    except BaseException as error:
        return _report(command, error, as_json, whole)
    finally:
        sys.stdout = stdout
