"""`eqshard.targets.suggest_targets`: what if the step ran on this slice, or that one?

`suggest` is run once per TPU slice, each ranking as `suggest(..., target=t)` gives
it; `TargetRow` keeps, per slice, its best `Suggestion` (or `None`), how many fit,
and why none did, and `Targets` shows the rows as one table. The command line's
`eqshard suggest --targets` builds the same from the rankings its workers answer
(`Targets.of`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from jaxtyping import PyTree

from .._cost._hardware import seconds_text
from .._errors import EqshardError
from .._fit import mesh_text
from .._report import as_text, human_bytes
from ._policy import TOLERANCE, sharing_proxies
from ._ranked import WIDTH, Progress, Ranked, Suggestion, out_of_memory
from ._suggest import placement, suggest

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["TargetRow", "Targets", "suggest_targets", "target_names"]


@dataclasses.dataclass(frozen=True)
class TargetRow:
    """One slice of `eqshard.targets.suggest_targets`: a row of its table.

    **Attributes:**

    - `target`: the TPU slice, as given (`"v5e:4x4"`).
    - `best`: the fastest candidate that fits there, or `None` when none does.
    - `fitting`: how many candidates fit.
    - `why`: why none fits (`None` where one does).
    - `ranked`: the whole ranking on the slice, as `eqshard.suggest` gives it.
    """

    target: str
    best: Suggestion | None
    fitting: int
    why: str | None
    ranked: Ranked

    @classmethod
    def of(cls, target: str, ranked: Ranked) -> TargetRow:
        """The row of one slice's ranking."""
        best = ranked.best
        fitting = sum(s.fits and s.cost is not None for s in ranked)
        return cls(target, best, fitting, None if best is not None else _why(ranked), ranked)

    def to_json(self) -> dict[str, Any]:
        """The row as JSON: the slice, its device count, the best (`Suggestion.to_json`)
        or `null`, the count that fit and why none did, and the whole ranking."""
        return {
            "target": self.target,
            "devices": self.ranked.devices,
            "best": None if self.best is None else self.best.to_json(),
            "fitting": self.fitting,
            "candidates": len(self.ranked),
            "why": self.why,
            "ranking": self.ranked.to_json(),
        }


def _why(ranked: Ranked) -> str:
    """Why nothing fits on a ranking's slice, in a line."""
    if not ranked.suggestions:
        reason = ranked.dropped[0][1] if ranked.dropped else "the generator made none"
        return f"every candidate was dropped; the first: {' '.join(reason.split())}"
    costed = [s for s in ranked if s.cost is not None]
    beyond = [s for s in ranked if s.cost is None and s.over is not None]
    if not costed and beyond:  # not compiled: their arguments alone are over the limit
        closest = min(beyond, key=lambda s: s.over or 0.0)
        held = closest.candidate.estimated.arguments if closest.candidate.estimated else 0
        return (
            f"the closest, {closest.name}, needs at least {human_bytes(held)} (its arguments "
            f"alone) of {human_bytes(ranked.limit or 0)} per device: {closest.over:.2f}x"
        )
    if not costed:
        first = ranked.suggestions[0].error or ""
        return out_of_memory(first) or f"no candidate compiled: {' '.join(first.split())}"
    closest = min(costed, key=lambda s: s.cost.memory.peak if s.cost else 0)
    peak = closest.cost.memory.peak if closest.cost else 0
    limit = ranked.limit or 0
    return (
        f"the closest, {closest.name}, needs {human_bytes(peak)} of "
        f"{human_bytes(limit)} per device: {peak / max(limit, 1):.2f}x"
    )


@dataclasses.dataclass(frozen=True)
class Targets(Sequence[TargetRow]):
    """The best spec per TPU slice, from `eqshard.targets.suggest_targets`: one `TargetRow`
    per slice, in the order given.

    `print(targets)` shows the table (plain text). In a rich console or notebook it
    renders as one. `targets.fitting` lists the rows where something fits, and
    `to_json()` gives the same to machines.
    """

    rows: tuple[TargetRow, ...]

    @classmethod
    def of(cls, targets: Sequence[str], rankings: Sequence[Ranked]) -> Targets:
        """The rows of the rankings, one per slice, in order."""
        return cls(tuple(TargetRow.of(t, r) for t, r in zip(targets, rankings, strict=True)))

    def __getitem__(self, index: int) -> TargetRow:  # type: ignore[override]
        return self.rows[index]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[TargetRow]:
        return iter(self.rows)

    @property
    def fitting(self) -> tuple[TargetRow, ...]:
        """The rows where a candidate fits."""
        return tuple(row for row in self.rows if row.best is not None)

    def __rich__(self) -> Table:
        from rich.table import Table
        from rich.text import Text

        title = f"eqshard suggest: the best spec on each of {len(self)} targets"
        table = Table(title=Text(title), title_justify="left", caption_justify="left")
        table.add_column("target", no_wrap=True)
        table.add_column("devices", justify="right")
        table.add_column("best", no_wrap=True)
        table.add_column("mesh", no_wrap=True)
        table.add_column("peak / device", justify="right")
        table.add_column("limit", justify="right")
        table.add_column("estimate (its chip)", justify="right")
        table.add_column("fit")
        for row in self.rows:
            ranked, best = row.ranked, row.best
            limit = "-" if ranked.limit is None else human_bytes(ranked.limit)
            fit = f"{row.fitting} of {len(ranked)}"
            if best is None or best.cost is None:
                cells = [row.target, str(ranked.devices), "nothing fits", "-", "-", limit]
                cells += ["-", f"{fit}: {row.why}"]
            else:
                cells = [row.target, str(ranked.devices), best.strategy, mesh_text(best.mesh)]
                cells += [human_bytes(best.cost.memory.peak), limit]
                cells += [seconds_text(best.cost.estimate().seconds), fit]
            table.add_row(*(Text(cell) for cell in cells))
        notes = [
            "each target ranked as `eqshard suggest --target` ranks it: the best is the fastest "
            "that fits, by a roofline estimate on that target's chip, never a measurement"
        ]
        compilers = sorted({r.ranked.compiler for r in self.rows if r.ranked.compiler})
        if compilers:
            notes.append(f"compiled by {'; '.join(compilers)}")
        table.caption = Text("\n".join(notes))
        return table

    def __str__(self) -> str:
        return as_text(self, WIDTH)

    def to_json(self) -> dict[str, Any]:
        """The rows as JSON (`TargetRow.to_json`), in order."""
        return {"targets": [row.to_json() for row in self.rows]}


def target_names(targets: str | Sequence[str]) -> tuple[str, ...]:
    """The slices of `targets`: a sequence of names, or one string of them separated
    by commas (`"v5e:4x4,v6e:4x4"`), each stripped.

    **Raises:** `EqshardError` for no slice, an empty name, or one named twice.
    """
    names = targets.split(",") if isinstance(targets, str) else list(targets)
    if not all(isinstance(name, str) for name in names):
        raise EqshardError("`targets` must be TPU slices' names, such as ['v5e:4x4', 'v6e:4x4']")
    found = tuple(name.strip() for name in names)
    if not found or any(not name for name in found):
        raise EqshardError(
            f"`targets` {targets!r} names an empty slice: give names such as v5e:4x4,v6e:4x4"
        )
    twice = sorted({name for name in found if found.count(name) > 1})
    if twice:
        raise EqshardError(f"`targets` names {', '.join(twice)} twice: name each slice once")
    return found


def suggest_targets(
    model: PyTree[Any],
    *args: PyTree[Any],
    step: Callable[..., Any],
    targets: str | Sequence[str],
    max_memory: int | str | None = None,
    workers: int | None = None,
    exhaustive: bool = False,
    tolerance: float = TOLERANCE,
    progress: Callable[[Progress], None] | None = None,
) -> Targets:
    """The best spec on each of several TPU slices: `eqshard.suggest` on each, side
    by side.

    **Example:**

    ```python
    found = eqshard.targets.suggest_targets(
        model, opt_state, batch, step=step, targets=["v5e:4x4", "v5p:4x4x4", "v6e:4x4"]
    )
    print(found)                                   # target, best, memory, estimate, fit
    found[0].best                                  # a Suggestion, or None
    found[0].why                                   # why nothing fits there, else None
    ```

    **Arguments:**

    - `model`: the model, concrete or abstract (`eqx.filter_eval_shape`).
    - `*args`: the rest of the step's arguments, as `eqshard.suggest` takes them.
    - `step`: the training step, called as `step(model, *args)`.
    - `targets`: the TPU slices, a list of names or one string separated by commas.
    - `max_memory`: device memory per device on every slice; by default each chip's HBM.
    - `workers`: worker processes that compile at once, as for `eqshard.suggest`.
    - `exhaustive`: compile every candidate on every slice, as for `eqshard.suggest`.
    - `tolerance`: as for `eqshard.suggest`.
    - `progress`: as for `eqshard.suggest`: each slice's passes in turn.

    **Returns:**

    A `Targets`: one `TargetRow` per slice, in order, each with the best it found
    there exactly as `eqshard.suggest(..., target=slice)` picks it.

    **Raises:**

    - `eqshard.EqshardError`: `targets` names no slice, one twice, or one that is no
        TPU slice (every name is checked before anything compiles); what
        `eqshard.suggest` raises.
    - `eqshard.UsageError`: no libtpu.
    """
    names = target_names(targets)
    for name in names:  # every name checked before the first slice compiles
        placement(None, None, name)
    with sharing_proxies():  # XLA:CPU ranks a candidate once for slices of one size
        rankings = [
            suggest(
                model,
                *args,
                step=step,
                target=name,
                max_memory=max_memory,
                workers=workers,
                exhaustive=exhaustive,
                tolerance=tolerance,
                progress=progress,
            )
            for name in names
        ]
    return Targets.of(names, rankings)
