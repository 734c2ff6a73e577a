"""Faults as data: `Problem`, and the text a list of them makes.

Resolvers, `plan_faults` and the spec-file layer collect `Problem`s, each naming its
place (a leaf's dotted path, or `file::$.json.path`), so one pass finds every
independent fault. At the edge, `problem_lines` groups them by message, so a model
of any size gets at most `MAX_LINES` lines: `SpecError` and the command line both
show them this way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = [
    "MAX_LINES",
    "NAMED",
    "Pictured",
    "Problem",
    "in_file",
    "named",
    "problem_lines",
    "problem_of",
]


class Pictured(Protocol):
    """An error that shows its fault with a caret: an `ExpressionError` or a
    `PathError`."""

    @property
    def rule(self) -> str:
        """The rule that was broken, and how to fix it, without the picture."""
        ...

    @property
    def picture(self) -> str:
        """The text, indented, with a caret line under the fault."""
        ...


@dataclasses.dataclass(frozen=True)
class Problem:
    """One fault, found while checking a spec against a model or a file.

    **Attributes:**

    - `where`: the leaf's key path (`.blocks[3].attn.query_proj.weight`), a class field
        (`MLP.w1`), or a file and JSON path (`spec.json::$.rules[2].expr`).
    - `message`: what is wrong, and how to fix it.
    - `detail`: more lines to show under the message, such as a caret picture.
    - `file`: the spec file, when `where` is `file::$.json.path` (a file name may itself
        hold `::`).
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
    def from_error(cls, where: str, error: Pictured, context: str = "") -> Problem:
        """The problem an `ExpressionError` (or a `PathError`) makes at `where`:
        `context`, the rule that was broken, and the caret picture under it."""
        message = f"{context}: {error.rule}" if context else error.rule
        return cls(where, message, error.picture)


def in_file(problem: Problem, file: str) -> Problem:
    """`problem`, marked as being in `file` when its `where` is `file::...`."""
    if problem.file is None and problem.where.startswith(f"{file}::"):
        return dataclasses.replace(problem, file=file)
    return problem


def problem_of(entry: Mapping[str, Any]) -> Problem:
    """The problem a `Problem.to_json()` or `dataclasses.asdict(problem)` entry describes."""
    return Problem(entry["where"], entry["message"], entry.get("detail") or "", entry.get("file"))


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
