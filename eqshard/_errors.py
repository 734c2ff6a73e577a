"""The one error hierarchy of eqshard.

Every error eqshard raises on a user's input is an `EqshardError`, which is a
`ValueError`. Errors about an expression are `ExpressionError`s: they quote the
expression, put a caret under the fault, then state the rule and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["EqshardError", "ExpressionError", "Problem", "SpecError", "UnreadableError"]


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
    """

    where: str
    message: str
    detail: str = ""  # more lines to show under the message, such as a caret picture

    def __str__(self) -> str:
        line = f"{self.where}: {self.message}"
        return f"{line}\n{self.detail}" if self.detail else line


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
