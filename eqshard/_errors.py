"""The one error hierarchy of eqshard.

Every error eqshard raises on a user's input is an `EqshardError`, which is a
`ValueError`. Errors about an expression are `ExpressionError`s: they quote the
expression, put a caret under the fault, then state the rule and the fix. A rule
path that cannot be read is a `PathError`, shown the same way.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "MAX_LINES",
    "EqshardError",
    "EqshardWarning",
    "ExpressionError",
    "MeshWarning",
    "ModelError",
    "PathError",
    "Problem",
    "SpecError",
    "StepError",
    "UnreadableError",
    "UnusedRule",
    "UnusedRuleWarning",
    "UsageError",
    "in_file",
    "named",
    "problem_lines",
    "problem_of",
    "unused_message",
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
    def from_error(
        cls, where: str, error: ExpressionError | PathError, context: str = ""
    ) -> Problem:
        """The problem an `ExpressionError` (or a `PathError`) makes at `where`:
        `context`, the rule that was broken, and the caret picture under it."""
        message = f"{context}: {error.rule}" if context else error.rule
        return cls(where, message, error.picture)


def in_file(problem: Problem, file: str) -> Problem:
    """`problem`, marked as being in `file` when its `where` is `file::...`."""
    if problem.file is None and problem.where.startswith(f"{file}::"):
        return dataclasses.replace(problem, file=file)
    return problem


MAX_LINES = 40
"""The most lines a list of problems takes as text, whatever the model's size."""

NAMED = 3
"""How many places a group of problems with one message names; the rest are counted."""


def named(places: Sequence[str], limit: int = NAMED) -> str:
    """The first `limit` of `places`, and a count of the rest: `a, b, c and 5 more`."""
    shown = ", ".join(places[:limit])
    return f"{shown} and {len(places) - limit} more" if len(places) > limit else shown


def problem_lines(
    problems: Sequence[Problem],
    *,
    limit: int = MAX_LINES,
    more: str = "`error.problems` lists every one",
) -> list[str]:
    """The problems as text, at most `limit` lines, however many there are.

    Problems with the same message and detail are one group: its message is shown
    once, after the first `NAMED` places it was found and a count of the others
    (`layers.0.weight (Linear.weight), layers.1.weight (Linear.weight),
    layers.2.weight (Linear.weight) and 157 more: float32[...] ...`). Groups come in
    the order of their first problem. When they do not all fit, the last line says
    how many problems (and distinct messages) are left out, then `more`: where to see
    every one.
    """
    groups: dict[tuple[str, str], list[str]] = {}
    for problem in problems:
        groups.setdefault((problem.message, problem.detail), []).append(problem.where)
    lines: list[str] = []
    entries = list(groups.items())
    for k, ((message, detail), places) in enumerate(entries):
        text = f"{named(places)}: {message}".split("\n")
        if detail:
            text += detail.split("\n")
        room = limit - len(lines) - (k + 1 < len(entries))
        if len(text) > room and lines:
            left = entries[k:]
            count = sum(len(found) for _, found in left)
            lines.append(
                f"... and {count} more problem{'s' * (count != 1)} ({len(left)} different "
                f"message{'s' * (len(left) != 1)}): {more}"
            )
            break
        lines += text[: max(1, room)]
    return lines


def problem_of(entry: Mapping[str, Any]) -> Problem:
    """The problem a `Problem.to_json()` or `dataclasses.asdict(problem)` entry describes."""
    return Problem(entry["where"], entry["message"], entry.get("detail") or "", entry.get("file"))


class SpecError(EqshardError):
    """Every fault found in one spec, raised once.

    Its text shows each distinct message once, naming the first few leaves it was
    found at and counting the others, in at most `MAX_LINES` lines.

    **Attributes:**

    - `problems`: a list of `eqshard.Problem`, one per fault, in model order: every
        one, also those the text only counts.
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
    """The user's step cannot be traced or compiled under a spec: the user's code
    failed, not the spec, so the command line exits with 2, as for a model that
    cannot be built."""

    exit_code = 2


class ModelError(EqshardError):
    """The user's code named `MODULE:CALLABLE` (the command line's `--model`,
    `--step`, `--optimizer` or `--batch`, or a callable the harness sends to a
    worker) cannot be imported, built or run, or a worker running it gave no answer
    in time (exit code 2)."""

    exit_code = 2


class UsageError(EqshardError):
    """What was asked for cannot be done as asked: options that contradict each
    other (`--devices 8` with `--target v5e:4x4`, whose slice has 16), or a package
    it needs that is not installed (libtpu, for a TPU target). The command line
    exits with 2, as for bad usage."""

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

    def to_json(self) -> list[dict[str, Any]]:
        """The warning for machines: one entry per place, as `Problem.to_json()`
        writes it, with `kind`, the warning's class name."""
        return [{"kind": type(self).__name__, **p.to_json()} for p in self.problems]

    def __reduce__(self) -> Any:
        return (type(self), (self.where, self.message))


EqshardWarning.__module__ = "eqshard"


@dataclasses.dataclass(frozen=True)
class UnusedRule:
    """One rule of a spec file that gave no leaf its expression.

    - `index`: its place in the file's `rules`.
    - `path`: its path pattern.
    - `message`: what happened to it, and how to fix it.
    - `suggestions`: rule paths that match leaves and are close to `path`, closest
        first (a typo's fix).
    - `leaves`: the dotted paths of the leaves the first suggestion matches; for a
        rule that earlier rules shadow, the leaves it matches.
    """

    index: int
    path: str
    message: str
    suggestions: tuple[str, ...] = ()
    leaves: tuple[str, ...] = ()


UnusedRule.__module__ = "eqshard"


class UnusedRuleWarning(EqshardWarning):
    """Rules of a spec file that gave no leaf of the model its expression: one
    warning per plan.

    A rule whose path matches no leaf is most often a typo, and the leaves it was
    written for fall to a broader rule, the dims or the default; its message names
    the closest rule path that matches leaves, and those leaves.

    **Attributes:** `source` (the file), `unused` (one `UnusedRule` per rule),
    `hint` (what the tree looks like, when it looks like an optimizer state rather
    than a model), `section` (where the rules sit in the file: `"$"`, or
    `"$.optimizer"`), besides `where` and `message`.
    """

    source: str
    unused: list[UnusedRule]
    hint: str
    section: str

    def __init__(
        self,
        source: str,
        unused: Sequence[UnusedRule | tuple[int, str]],
        hint: str = "",
        tree: str = "the model",
        section: str = "$",
    ):
        self.source = source
        self.section = section
        self.unused = [
            rule
            if isinstance(rule, UnusedRule)
            else UnusedRule(rule[0], rule[1], unused_message(rule[1]))
            for rule in unused
        ]
        self.hint = hint
        self.tree = tree
        first, count = self.unused[0], len(self.unused)
        if count == 1:
            where = f"{source}::{section}.rules[{first.index}]"
            super().__init__(where, self._with_hint(first.message))
            return
        lines = [f"{count} rules gave no leaf of {tree} its expression:"]
        lines += [
            f"  {section}.rules[{rule.index}]: {rule.message}" for rule in self.unused[:NAMED]
        ]
        if count > NAMED:
            lines.append(f"  and {count - NAMED} more: `warning.problems` lists every one")
        if hint:
            lines.append(hint[0].upper() + hint[1:])
        super().__init__(f"{source}::{section}.rules", "\n".join(lines))

    def _with_hint(self, message: str) -> str:
        return f"{message}; {self.hint}" if self.hint else message

    @property
    def problems(self) -> list[Problem]:
        return [
            Problem(
                f"{self.source}::{self.section}.rules[{rule.index}]",
                self._with_hint(rule.message),
                file=self.source,
            )
            for rule in self.unused
        ]

    def to_json(self) -> list[dict[str, Any]]:
        """Per rule, as `EqshardWarning.to_json`, with `rule` (its path pattern),
        `did_you_mean` (close rule paths that match leaves) and `leaves` (those the
        first one matches, or those earlier rules took from a shadowed rule)."""
        return [
            {
                **entry,
                "rule": rule.path,
                "did_you_mean": list(rule.suggestions),
                "leaves": list(rule.leaves),
            }
            for entry, rule in zip(super().to_json(), self.unused)
        ]

    def __reduce__(self) -> Any:
        return (type(self), (self.source, self.unused, self.hint, self.tree, self.section))


def unused_message(path: str, tree: str = "the model") -> str:
    """The message of a rule whose path matched no leaf of `tree`."""
    return f"rule {path!r} matched no leaf of {tree}"


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
