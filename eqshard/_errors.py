"""The one error hierarchy of eqshard.

Every error eqshard raises on a user's input is an `EqshardError`, which is a
`ValueError`. Errors about an expression are `ExpressionError`s: they quote the
expression, put a caret under the fault, then state the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "EqshardError",
    "EqshardWarning",
    "ExpressionError",
    "MeshWarning",
    "Problem",
    "SpecError",
    "StepError",
    "UnreadableError",
    "UnusedRuleWarning",
    "in_file",
    "warn",
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
        shown = _printable(self.expression)
        start, end = self.position, self.position + self.length
        return (
            f"    {shown}\n"
            f"    {' ' * _display_width(shown[:start])}"
            f"{'^' * _display_width(shown[start:end], 1)}"
        )

    def __reduce__(self):
        return (
            _rebuild_expression_error,
            (self.expression, self.position, self.rule, self.length),
        )


ExpressionError.__module__ = "eqshard"


def _rebuild_expression_error(expression: str, position: int, rule: str, length: int):
    return ExpressionError(expression, position, rule, length=length)


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


@dataclasses.dataclass(frozen=True)
class Problem:
    """One fault, found while checking a spec against a model or a file.

    - `where`: the leaf's key path (`.blocks[3].attn.query_proj.weight`), a class
        field (`MLP.w1`), or a file and JSON path (`spec.json::$.rules[2].expr`).
    - `message`: what is wrong, and how to fix it.
    - `detail`: more lines to show under the message, such as a caret picture.
    - `file`: the spec file, when `where` is `file::$.json.path` (a file name may
        itself hold `::`).
    """

    where: str
    message: str
    detail: str = ""
    file: str | None = None

    def to_json(self) -> dict[str, str]:
        """The problem for machines: `where` and `message`, and `file`, `path` (its
        JSON path) and `detail` where it has them."""
        entry = {"where": self.where}
        path = self.json_path
        if path is not None and self.file is not None:
            entry.update(file=self.file, path=path)
        entry["message"] = self.message
        if self.detail:
            entry["detail"] = self.detail
        return entry

    @property
    def json_path(self) -> str | None:
        """The `$.json.path` part of `where`, for a problem in a file."""
        if self.file is None or not self.where.startswith(f"{self.file}::"):
            return None
        return self.where[len(self.file) + 2 :]

    def __str__(self) -> str:
        line = f"{self.where}: {self.message}"
        return f"{line}\n{self.detail}" if self.detail else line

    @classmethod
    def from_error(cls, where: str, error: ExpressionError, context: str = "") -> Problem:
        """The problem an `ExpressionError` makes at `where`: `context`, the rule
        that was broken, and the caret picture under it."""
        message = f"{context}: {error.rule}" if context else error.rule
        return cls(where, message, error.picture)


def in_file(problem: Problem, file: str) -> Problem:
    """`problem`, marked as being in `file` when its `where` is `file::...`."""
    if problem.file is None and problem.where.startswith(f"{file}::"):
        return dataclasses.replace(problem, file=file)
    return problem


class SpecError(EqshardError):
    """Every fault found in one spec, raised once.

    **Attributes:**

    - `problems`: a list of `eqshard.Problem`, one per fault, in model order.
    """

    problems: list[Problem]

    def __init__(self, problems: Sequence[Problem], headline: str | None = None):
        self.problems = list(problems)
        count = len(self.problems)
        headline = headline or f"{count} problem{'s' * (count != 1)} in the spec"
        self.headline = headline
        lines = [f"{headline}:"]
        for problem in self.problems:
            lines += [f"  {line}" for line in str(problem).split("\n")]
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return (type(self), (self.problems, self.headline))


SpecError.__module__ = "eqshard"


class UnreadableError(SpecError):
    """A spec file that cannot be read: missing, unreadable, too large, or not UTF-8."""


UnreadableError.__module__ = "eqshard"


class StepError(EqshardError):
    """The user's step cannot be traced or compiled under a spec: the user's code
    failed, not the spec, so the command line exits with 2, as for a model that
    cannot be built."""

    exit_code = 2


class EqshardWarning(UserWarning):
    """Base class of eqshard's warnings: a fault that does not stop the work.

    **Attributes:**

    - `where`: the leaf's dotted path or `file::$.json.path`, as in a `Problem`.
    - `message`: what is wrong, and how to fix it.
    """

    where: str
    message: str

    def __init__(self, where: str, message: str):
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}")

    @property
    def problems(self) -> list[Problem]:
        """The same faults as `Problem`s, one per place, for `check --strict`."""
        return [Problem(self.where, self.message)]

    def __reduce__(self) -> Any:
        return (type(self), (self.where, self.message))


EqshardWarning.__module__ = "eqshard"


class UnusedRuleWarning(EqshardWarning):
    """Rules of a spec file that matched no leaf of the model: one warning per plan.

    **Attributes:** `source` (the file), `unused` (each rule's index and path),
    besides `where` and `message`.
    """

    source: str
    unused: list[tuple[int, str]]

    def __init__(self, source: str, unused: Sequence[tuple[int, str]]):
        self.source = source
        self.unused = list(unused)
        (first, path), count = self.unused[0], len(self.unused)
        if count == 1:
            super().__init__(f"{source}::$.rules[{first}]", _unused_message(path))
            return
        shown = ", ".join(f"$.rules[{i}] {p!r}" for i, p in self.unused[:3])
        more = f", and {count - 3} more" if count > 3 else ""
        super().__init__(
            f"{source}::$.rules",
            f"{count} rules matched no leaf of the model: {shown}{more}",
        )

    @property
    def problems(self) -> list[Problem]:
        return [
            Problem(f"{self.source}::$.rules[{i}]", _unused_message(p), file=self.source)
            for i, p in self.unused
        ]

    def __reduce__(self) -> Any:
        return (type(self), (self.source, self.unused))


def _unused_message(path: str) -> str:
    return f"rule {path!r} matched no leaf of the model"


UnusedRuleWarning.__module__ = "eqshard"


class MeshWarning(EqshardWarning):
    """The layouts of a plan group the devices in ways that disagree, so they share
    only a mesh with more axes than any one of them needs."""


MeshWarning.__module__ = "eqshard"

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def warn(found: Iterable[EqshardWarning]) -> None:
    """Issues each warning, pointed at the first caller outside eqshard."""
    found = list(found)
    if not found:
        return
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    for warning in found:
        warnings.warn(warning, stacklevel=level + 1)


def whole_number(value: object, what: str, minimum: int = 1) -> int:
    """`value` if it is a whole number (an `int`, not a `bool`) of at least `minimum`.

    **Raises:** `EqshardError` naming `what`, e.g. "`devices` is a whole number from
    1, not 2.5".
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EqshardError(f"{what} is a whole number from {minimum}, not {value!r}")
    return value
