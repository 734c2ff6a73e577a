"""A worker's error, carried back: `error_entry` (what the worker says of it: its
class, message, notes with the user's frames, traceback, and the error pickled where
it can be) and `rebuilt_error` (the same class raised here, with its notes, and the
worker's traceback as its cause, `WorkerTraceback`)."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import traceback
from collections.abc import Mapping
from typing import Any

from .._errors import EqshardError, ModelError, SpecError, UnreadableError
from .._problems import problem_of
from ._pickles import pickled, unpickled
from ._usercode import with_user_frames

__all__ = ["WorkerTraceback", "error_entry", "rebuilt_error"]


class WorkerTraceback(Exception):
    """The traceback of an error raised in a worker process, as text: the cause
    (`__cause__`) of the error `rebuilt_error` raises here, so that a traceback
    printed here shows the worker's frames too."""

    def __str__(self) -> str:
        return f'\n"""\n{self.args[0] if self.args else ""}"""'


def rebuilt_error(entry: Mapping[str, Any]) -> BaseException:
    """A worker's error, as this process raises it (`_rebuilt`), with the worker's
    notes (where in the user's code it was raised) and its traceback as its cause
    (`WorkerTraceback`)."""
    error = _rebuilt(entry)
    notes = entry.get("notes")
    for note in notes if isinstance(notes, list) else []:
        if str(note) not in getattr(error, "__notes__", ()):
            error.add_note(str(note))
    if entry.get("traceback"):
        error.__cause__ = WorkerTraceback(str(entry["traceback"]))
    return error


def _rebuilt(entry: Mapping[str, Any]) -> BaseException:
    """The error itself where it was pickled and unpickles here (the user's own
    exception classes and JAX's included); else eqshard's errors and Python's own
    as the same class (so the command line prints the same message and picks the
    same exit code), anything else as an exception of the same name."""
    if "pickle" in entry:
        with contextlib.suppress(Exception):
            error = unpickled(str(entry["pickle"]), "the error")
            if isinstance(error, Exception) and str(error) == str(entry["message"]):
                return error
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
    """What the worker says of an error (the exit code as `eqshard._cli._main`
    chooses it): its class, its message, its notes, where in the user's code it was
    raised among them (`with_user_frames`), and its traceback as text."""
    with contextlib.suppress(Exception):  # an error that takes no note
        with_user_frames(error)
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
    with contextlib.suppress(Exception):  # a user's note that is not text is left out
        entry["notes"] = [note for note in getattr(error, "__notes__", ()) if isinstance(note, str)]
    with contextlib.suppress(Exception):  # a user's exception that cannot be formatted
        entry["traceback"] = "".join(traceback.format_exception(error))
    with contextlib.suppress(Exception):  # what cannot be pickled is rebuilt by name
        entry["pickle"] = pickled(error, "the error", "")
    return entry
