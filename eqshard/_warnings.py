"""eqshard's warnings: faults that do not stop the work.

Every warning is an `EqshardWarning` that names its place as a `Problem` does, so
`check --strict` and `--format json` treat warnings and problems alike.
`UnusedRuleWarning` holds one `UnusedRule` per rule of a spec file that gave no leaf
its expression, each with its "did you mean". `warn` issues warnings pointed at
the user's code, the first caller outside eqshard.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from ._problems import NAMED, Problem

__all__ = [
    "EqshardWarning",
    "IndivisibleBatchWarning",
    "MeshWarning",
    "UnusedRule",
    "UnusedRuleWarning",
    "VersionWarning",
    "deprecated",
    "unused_message",
    "warn",
]


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

    **Attributes:**

    - `index`: its place in the file's `rules`.
    - `path`: its path pattern.
    - `message`: what happened to it, and how to fix it.
    - `suggestions`: rule paths that match leaves and are close to `path`, closest first
        (a typo's fix).
    - `leaves`: the dotted paths of the leaves the first suggestion matches; for a rule
        that earlier rules shadow, the leaves it matches.
    """

    index: int
    path: str
    message: str
    suggestions: tuple[str, ...] = ()
    leaves: tuple[str, ...] = ()


UnusedRule.__module__ = "eqshard.resolvers"


class UnusedRuleWarning(EqshardWarning):
    """Rules of a spec file that gave no leaf of the model its expression: one warning
    per plan.

    A rule whose path matches no leaf is most often a typo. The leaves it was written
    for fall to a broader rule, the dims or the default. Its message names the closest
    rule path that matches leaves, and those leaves.

    **Attributes:**

    - `source`: the file.
    - `unused`: one `UnusedRule` per rule.
    - `hint`: what the tree looks like, when it looks like an optimizer state rather
        than a model.
    - `section`: where the rules sit in the file: `"$"`, or `"$.optimizer"`.
    - `where`, `message`: as for every `EqshardWarning`.
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


UnusedRuleWarning.__module__ = "eqshard"


def unused_message(path: str, tree: str = "the model") -> str:
    """The message of a rule whose path matched no leaf of `tree`."""
    return f"rule {path!r} matched no leaf of {tree}"


class MeshWarning(EqshardWarning):
    """The layouts of a plan group the devices in ways that disagree.

    So they share only a mesh with more axes than any one of them needs.
    """


MeshWarning.__module__ = "eqshard"


class IndivisibleBatchWarning(EqshardWarning):
    """Batch leaves that a spec file's batch section left whole on every device, as its
    `"indivisible": "replicate"` says: their layouts do not divide them over the
    devices (a per-graph leaf of 3 graphs over 8 devices). One warning per step's
    layout, naming each leaf, its shape and the rule.

    **Attributes:**

    - `leaves`: `(where, message)` for each leaf: the step's argument and the leaf's
        path (`` `graph`.n_node ``), and its shape and rule.
    - `where`, `message`: as for every `EqshardWarning`; `where` is the section
        (`model.eqshard.json::$.batch`).
    """

    leaves: tuple[tuple[str, str], ...]

    def __init__(self, where: str, leaves: Sequence[tuple[str, str]]):
        self.leaves = tuple((place, text) for place, text in leaves)
        shown = "; ".join(f"{place} {text}" for place, text in self.leaves[:NAMED])
        more = len(self.leaves) - NAMED
        if more > 0:
            shown += f"; and {more} more: `warning.problems` lists every one"
        super().__init__(
            where,
            'batch leaves left whole on every device ("indivisible": "replicate"), as '
            f"their layouts do not divide them: {shown}",
        )

    @property
    def problems(self) -> list[Problem]:
        return [
            Problem(
                place,
                f'{text}: left whole on every device, as {self.where}\'s "indivisible": '
                '"replicate" says',
            )
            for place, text in self.leaves
        ]

    def __reduce__(self) -> Any:
        return (type(self), (self.where, self.leaves))


IndivisibleBatchWarning.__module__ = "eqshard"

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


class VersionWarning(EqshardWarning):
    """This JAX or Equinox keeps an internal elsewhere than eqshard knows.

    eqshard falls back to what keeps every value right (more memory, or a slower
    path), and says so once per process.
    """


VersionWarning.__module__ = "eqshard"


def deprecated(text: str) -> None:
    """Warns a `DeprecationWarning` saying `text` (the old spelling and the new),
    pointed at the first caller outside eqshard, as `warn` points its warnings."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(text, DeprecationWarning, stacklevel=level + 1)
