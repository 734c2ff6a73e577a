"""The one error hierarchy of eqshard.

Every error eqshard raises on a user's input is an `EqshardError`, which is a
`ValueError`. Errors about an expression are `ExpressionError`s: they quote the
expression, put a caret under the fault, then state the rule and the fix. A rule
path that cannot be read is a `PathError`, shown the same way. A `SpecError`
raises every `Problem` found in one spec at once. `StepError`, `ModelError` and
`UsageError` are faults of the user's code or of how eqshard was asked, which the
command line answers with exit code 2. Each class shows as `eqshard.<Name>` in a
traceback, as `eqshard` exports it. `whole_number` is the one check of a count
argument, raising an `EqshardError` that names it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TypeVar

from ._problems import MAX_LINES, Problem, problem_lines

__all__ = [
    "EqshardError",
    "ExpressionError",
    "ModelError",
    "PathError",
    "SpecError",
    "StepError",
    "UnreadableError",
    "UsageError",
    "joined",
    "step_error",
    "whole_number",
]


class EqshardError(ValueError):
    """Base class of every error eqshard raises on bad input.

    It is a `ValueError`, so `except ValueError` catches it too.
    """


EqshardError.__module__ = "eqshard"


class ExpressionError(EqshardError):
    """An einshard expression that is malformed, or that does not fit an array.

    **Attributes:**

    - `expression`: the expression text as the user wrote it.
    - `position`: the 0-based column of the fault in `expression`.
    - `length`: how many columns the fault spans (at least 1).
    - `rule`: the rule that was broken, and how to fix it, without the picture.

    The message shows the expression with a caret under the fault:

    ```
    bad einshard expression:
        a b -> a c
                 ^
    axis 'c' is on the right but not on the left; name it on both sides
    ```
    """

    expression: str
    position: int
    length: int
    rule: str

    def __init__(self, expression: str, position: int, rule: str, *, length: int = 1):
        position = max(0, min(position, len(expression)))
        self.expression = expression
        self.position = position
        self.length = max(1, length)
        self.rule = rule
        super().__init__(f"bad einshard expression:\n{self.picture}\n{_printable(rule)}")

    @property
    def picture(self) -> str:
        """The expression, indented, with a caret line under the fault.

        White space shows as one space and control characters as U+FFFD, so the
        caret lines up and nothing in the text can move the terminal's cursor.
        """
        return _caret_picture(self.expression, self.position, self.length)

    def __reduce__(self):
        return (
            _rebuild_expression_error,
            (self.expression, self.position, self.rule, self.length),
        )


ExpressionError.__module__ = "eqshard"


def _rebuild_expression_error(expression: str, position: int, rule: str, length: int):
    return ExpressionError(expression, position, rule, length=length)


class PathError(EqshardError):
    """A rule path that is not a path pattern.

    **Attributes:**

    - `path`: the rule path as the user wrote it.
    - `position`: the 0-based column of the fault in `path`.
    - `length`: how many columns the fault spans (at least 1).
    - `rule`: the rule that was broken, and how to fix it, without the picture.

    The message shows the path with a caret under the fault, as `ExpressionError`
    does:

    ```
    bad rule path:
        _weights.w[0,0] 16x0e
                  ^
    '[' opens a quoted key, ['...'] or ["..."]; ...
    ```
    """

    path: str
    position: int
    length: int
    rule: str

    def __init__(self, path: str, position: int, rule: str, *, length: int = 1):
        self.path = path
        self.position = max(0, min(position, len(path)))
        self.length = max(1, length)
        self.rule = rule
        super().__init__(f"bad rule path:\n{self.picture}\n{_printable(rule)}")

    @property
    def picture(self) -> str:
        """The path, indented, with a caret line under the fault (as
        `ExpressionError.picture`)."""
        return _caret_picture(self.path, self.position, self.length)

    def __reduce__(self):
        return (_rebuild_path_error, (self.path, self.position, self.rule, self.length))


PathError.__module__ = "eqshard"


def _rebuild_path_error(path: str, position: int, rule: str, length: int):
    return PathError(path, position, rule, length=length)


def _caret_picture(text: str, position: int, length: int) -> str:
    """`text`, indented, with a caret line under `length` columns from `position`."""
    shown = _printable(text)
    start, end = position, position + length
    return (
        f"    {shown}\n"
        f"    {' ' * _display_width(shown[:start])}"
        f"{'^' * _display_width(shown[start:end], 1)}"
    )


def _printable(text: str) -> str:
    import unicodedata

    return "".join(
        " " if c.isspace() else "\ufffd" if unicodedata.category(c) in ("Cc", "Cf", "Cs") else c
        for c in text
    )


def _display_width(text: str, minimum: int = 0) -> int:
    """Columns `text` takes in a terminal: wide East Asian letters take two."""
    import unicodedata

    width = sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)
    return max(minimum, width)


class SpecError(EqshardError):
    """Every fault found in one spec, raised once.

    Its text shows each distinct message once. It names the first few leaves the message
    was found at, and counts the others, in at most `MAX_LINES` lines.

    **Attributes:**

    - `problems`: a list of `eqshard.resolvers.Problem`, one per fault, in model order: every one,
        also those the text only counts.
    """

    problems: list[Problem]

    def __init__(self, problems: Sequence[Problem], headline: str | None = None):
        self.problems = list(problems)
        count = len(self.problems)
        headline = headline or f"{count} problem{'s' * (count != 1)} in the spec"
        self.headline = headline
        super().__init__(self.text())

    def text(self, more: str = "`error.problems` lists every one") -> str:
        """The headline and the problems, grouped by message (`problem_lines`), with
        `more` saying where to see every problem when some are only counted."""
        lines = problem_lines(self.problems, limit=MAX_LINES - 1, more=more)
        return "\n".join([f"{self.headline}:", *(f"  {line}" for line in lines)])

    def __reduce__(self):
        return (type(self), (self.problems, self.headline))


SpecError.__module__ = "eqshard"


class UnreadableError(SpecError):
    """A spec file that cannot be read: missing, unreadable, too large, or not UTF-8."""


UnreadableError.__module__ = "eqshard"


class StepError(EqshardError):
    """The user's step cannot be traced or compiled under a spec.

    The user's code failed, not the spec. So the command line exits with 2, as for a
    model that cannot be built. Where the step raised an exception of its own, the
    error is also of that exception's class, and shows it: a traceback ends
    `eqshard.StepError[ZeroDivisionError]: ...`, `except ZeroDivisionError` catches it,
    and the step's own exception is its `__cause__`.
    """

    exit_code = 2


StepError.__module__ = "eqshard"


E = TypeVar("E", bound="EqshardError")


def step_error(message: str, raised: BaseException) -> StepError:
    """A `StepError` saying `message` that is also of the class of what the user's step
    `raised`, where Python can make such a class (else a plain `StepError`)."""
    return joined(StepError, type(raised), message)


def joined(cls: type[E], kind: type[BaseException], message: str) -> E:
    """An error of `cls` that is also a `kind` (the user's own exception's class, or
    Python's `ModuleNotFoundError` for a missing package), shown as `cls[kind]`; a
    plain `cls` where `kind` is no `Exception` or Python cannot join the two."""
    try:
        return _joined_class(cls, kind)(message)
    except Exception:  # a class whose __init__ takes other arguments
        return cls(message)


@functools.cache
def _joined_class(cls: type[E], kind: type[BaseException]) -> type[E]:
    if not issubclass(kind, Exception) or issubclass(kind, EqshardError):
        return cls
    try:
        made: type[E] = type(  # pyright: ignore[reportAssignmentType]
            cls.__name__,
            (cls, kind),
            {
                "__module__": "eqshard",
                "__qualname__": f"{cls.__qualname__}[{kind.__qualname__}]",
                "__str__": BaseException.__str__,  # not KeyError's quoting, say
                "__reduce__": _reduce_joined,
                "joined": (cls, kind),
            },
        )
    except TypeError:  # bases Python cannot join (a final class, clashing layouts)
        return cls
    return made


def _reduce_joined(self: EqshardError) -> tuple[object, tuple[object, ...]]:
    cls, kind = getattr(type(self), "joined")  # noqa: B009
    return joined, (cls, kind, str(self))


class ModelError(EqshardError):
    """The user's code named `MODULE:CALLABLE` cannot be imported, built or run, or a
    worker running it gave no answer in time.

    That code is the command line's `--model`, `--step`, `--optimizer` or `--batch`, or
    a callable the harness sends to a worker. The command line exits with 2.
    """

    exit_code = 2


ModelError.__module__ = "eqshard"


class UsageError(EqshardError):
    """What was asked for cannot be done as asked.

    Options may contradict each other: `--devices 8` with `--target v5e:4x4`, whose
    slice has 16. Or a package it needs is not installed: libtpu, for a TPU target. The
    command line exits with 2, as for bad usage.
    """

    exit_code = 2


UsageError.__module__ = "eqshard"


def whole_number(value: object, what: str, minimum: int = 1) -> int:
    """`value` if it is a whole number (an `int`, not a `bool`) of at least `minimum`.

    **Raises:** `EqshardError` naming `what`, e.g. "`devices` is a whole number from
    1, not 2.5".
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EqshardError(f"{what} is a whole number from {minimum}, not {value!r}")
    return value
