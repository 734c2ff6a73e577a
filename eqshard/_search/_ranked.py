"""What `eqshard.suggest` gives: `Ranked` (its table, as text, rich and JSON), a
`Suggestion` per candidate, `Progress` as the compiles go, and `ranked`, which orders
the candidates by their figures."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

from .._cost._hardware import HARDWARE, seconds_text
from .._fit import mesh_text
from .._report import as_text, human_bytes

if TYPE_CHECKING:
    from rich.table import Table

    from .._cost._results import Cost
    from .._cost._targets import CompileTarget
    from .._specfile._model import Rules
    from ._candidates import Candidate

__all__ = [
    "GIVEN",
    "HBM",
    "WIDTH",
    "Progress",
    "Ranked",
    "Suggestion",
    "communication",
    "name_of",
    "out_of_memory",
    "ranked",
    "where_text",
]

HBM = "the chip's HBM"  # where the limit comes from with a target and no max_memory
GIVEN = "max_memory"  # where it comes from when the user gives one

_ERROR_CHARACTERS = 300  # of a failure's message, in the table's caption
WIDTH = 200  # characters of `str(ranked)`: the table's lines, as the command line prints them


_OUT_OF_MEMORY = re.compile(
    r"RESOURCE_EXHAUSTED: Ran out of memory .*?required for (?P<what>[\w ]+?) "
    r"\((?P<needs>[0-9.]+\w?)\) exceeds available (?P<memory>\w+) \((?P<has>[0-9.]+\w?)\)"
)


def out_of_memory(error: str) -> str | None:
    """`no: the compiler ran out of HBM: HLO temporaries need 154.09G of 95.74G` for a
    candidate the target's compiler refused for its memory (XLA:TPU does), else
    `None`."""
    found = _OUT_OF_MEMORY.search(error)
    if found is None:
        return None
    return (
        f"no: the compiler ran out of {found['memory']}: {found['what']} need "
        f"{found['needs']} of {found['has']}"
    )


def name_of(candidate: Candidate) -> str:
    """`fsdp x tensor (data=4 x model=2)`: a candidate, in messages and lists."""
    return f"{candidate.strategy} ({mesh_text(candidate.mesh)})"


def communication(found: Cost) -> dict[str, int]:
    """What one step moves on each device, by the mesh axes its collectives run over
    (`"data"`, `"model"`, `"data+model"`; `"-"` for none), every kind together."""
    moved: dict[str, int] = {}
    for c in found.collectives:
        axes = "+".join(c.axes) or "-"
        moved[axes] = moved.get(axes, 0) + c.total_bytes
    return moved


def _bytes(n: int) -> str:

    return human_bytes(n)


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far `eqshard.suggest` has come, as `progress=` is told: at the start of each
    pass of compiles, as each candidate of it is compiled (or fails), and at its end.
    `str(progress)` is the line the command line shows.

    **Attributes:**

    - `done`: the candidates of this pass compiled so far (failures included).
    - `total`: those this pass may compile; the estimates may rule some out on the way.
    - `where`: what they compile for (`"8 devices"`, `"v5e:2x4 (8 devices)"`, or XLA:CPU's
        simulated devices, ranking them first for a TPU slice).
    - `candidate`: the one just compiled, by name; `None` at the start and the end.
    - `finished`: whether the pass has ended (`done` is then how many it compiled).
    - `deferred`: whether the pass leaves those it did not compile to be ranked, not
        ruled out: for a TPU slice on few cores, the first pass compiles in the
        estimates' order until one fits, and XLA:CPU ranks the rest against it.
    """

    done: int
    total: int
    where: str
    candidate: str | None = None
    finished: bool = False
    deferred: bool = False

    def __str__(self) -> str:
        some = "1 candidate" if self.total == 1 else f"{self.total} candidates"
        if self.finished:
            left = self.total - self.done
            if not left:
                return f"compiled {'the' if self.total == 1 else 'all'} {some} on {self.where}"
            if self.deferred:
                return (
                    f"compiled {self.done} of {some} on {self.where}, in the estimates' "
                    f"order until one fit; the other {left} left to rank against it"
                )
            return (
                f"compiled {self.done} of {some} on {self.where}; the other {left} ruled out "
                "by their estimates"
            )
        if self.candidate is None:
            return f"compiling {some} on {self.where}"
        return f"compiled {self.done} of {some} on {self.where} (the last: {self.candidate})"


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One candidate, costed: a row of `eqshard.suggest`'s table.

    **Attributes:**

    - `candidate`: the strategy, its mesh, its `Rules` as generated, and the leaves
        replicated because their split did not divide (`candidate.repairs`).
    - `cost`: the `eqshard.results.Cost` it was ranked by; `None` where it failed to compile.
    - `fits`: whether its peak is within `limit` (always, without a limit).
    - `over`: where it does not fit, its peak over the limit (`1.96` for 1.96x).
    - `error`: why it could not be costed, else `None`.
    - `limit`: the memory limit per device it was held to, in bytes, if any.
    - `proxy`: for a TPU target, XLA:CPU's `Cost` of it on as many simulated devices,
        where it was compiled there only to be ranked (see "Ranked before compiled"
        on `eqshard.suggest`); else `None`.
    - `guess`: the estimate in seconds it was ranked by before it was compiled (the
        proxy's roofline, else `candidate.estimated`'s), where it has one.

    Its figures are the compiler's where `cost` is set; else only
    `candidate.estimated`'s exact bytes held (and what `proxy` says) are known, and
    `fits` is `False` (unknown is never a fit).
    """

    candidate: Candidate
    cost: Cost | None = None
    fits: bool = False
    over: float | None = None
    error: str | None = None
    limit: int | None = None
    proxy: Cost | None = None
    guess: float | None = None

    @property
    def figures(self) -> str:
        """Whose figures the row shows: `"compiled"` (the compiler's), `"XLA:CPU"`
        (a TPU target's candidate compiled only by XLA:CPU), `"estimated"` (not
        compiled: exact bytes held, the rest estimated), or `"failed"`."""
        if self.cost is not None:
            return "compiled"
        if self.error is not None:
            return "failed"
        return "XLA:CPU" if self.proxy is not None else "estimated"

    @property
    def strategy(self) -> str:
        return self.candidate.strategy

    @property
    def mesh(self) -> tuple[tuple[str, int], ...]:
        return self.candidate.mesh

    @property
    def name(self) -> str:
        """The strategy and its mesh: `fsdp x tensor (data=4 x model=2)`."""
        return name_of(self.candidate)

    @property
    def seconds(self) -> float | None:
        """The roofline estimate of one step it was ranked by (`cost.estimate()`: on
        the target's chip, else an H100), or `None` where it was not costed."""
        return None if self.cost is None else self.cost.estimate().seconds

    @property
    def rules(self) -> Rules:
        """The candidate's `Rules`, whose comment also names the strategy and what it
        costs: what `eqshard.dump(suggestion.rules, path)` (and `eqshard suggest
        --write`) writes. They lay the model out exactly as it was costed."""
        rules = self.candidate.rules
        if self.cost is None:
            return rules
        note = self.summary()
        return dataclasses.replace(
            rules, comment=f"{rules.comment} {note}" if rules.comment else note
        )

    def summary(self) -> str:
        """One sentence of what it costs, for the written file's comment."""
        if self.cost is None:
            return f"{self.name}: not costed: {self.error}"
        c = self.cost
        memory = c.memory
        held = f"parameters {_bytes(memory.parameters)}"
        if memory.state:
            held += f", state {_bytes(memory.state)}"
        if memory.optimizer:
            held += f", optimizer state {_bytes(memory.optimizer)}"
        limit = "" if self.limit is None else f" (limit {_bytes(self.limit)})"
        moved = ", ".join(f"{axes} {_bytes(n)}" for axes, n in communication(c).items())
        estimate = c.estimate()
        return (
            f"Suggested by eqshard suggest: {self.name} on {where_text(c.devices, c.target)}, "
            f"compiled by {c.compiler}: it needs {_bytes(memory.peak)} per device"
            f"{limit}, {held}; it moves {moved or 'nothing'} per step; estimate on "
            f"{estimate.hardware.name}: {seconds_text(estimate.seconds)} (a roofline, "
            f"never a measurement). Repaired leaves: {len(self.candidate.repairs)}."
        )

    def to_json(self) -> dict[str, Any]:
        """The suggestion as JSON: the candidate, its figures (bytes per device,
        seconds), and the `Rules` as the spec file's document."""
        entry: dict[str, Any] = {
            "strategy": self.strategy,
            "mesh": [[name, size] for name, size in self.mesh],
            "fits": self.fits,
            "over": self.over,
            "error": self.error,
            "repairs": list(self.candidate.repairs),
        }
        entry["figures"] = self.figures
        figures = self.candidate.estimated
        if figures is not None:
            entry["estimated"] = {
                "arguments": figures.arguments,
                "parameters": figures.parameters,
                "state": figures.state,
                "optimizer": figures.optimizer,
                "batch": figures.batch,
                "gradients": figures.gradients,
                "activations": figures.activations,
                "peak": figures.peak,
                "communication": [
                    {"axes": axes.split("+"), "bytes": n}
                    for axes, n in figures.communication().items()
                ],
                "seconds": self.guess,
            }
        if self.proxy is not None and self.cost is None:  # what XLA:CPU ranked it by
            entry["proxy"] = {
                "compiler": self.proxy.compiler,
                "communication": [
                    {"axes": [] if axes == "-" else axes.split("+"), "bytes": n}
                    for axes, n in communication(self.proxy).items()
                ],
            }
        if self.cost is not None:
            memory, estimate = self.cost.memory, self.cost.estimate()
            entry.update(
                peak=memory.peak,
                parameters=memory.parameters,
                state=memory.state,
                optimizer=memory.optimizer,
                communication=[
                    {"axes": [] if axes == "-" else axes.split("+"), "bytes": n}
                    for axes, n in communication(self.cost).items()
                ],
                estimate={"hardware": estimate.hardware.name, "seconds": estimate.seconds},
                compiler=self.cost.compiler,
            )
        entry["rules"] = self.rules.to_json()
        return entry


def where_text(devices: int, target: str | None) -> str:
    """`8 devices`, or `v5p:4x4x4 (64 devices)`."""
    return f"{devices} devices" if target is None else f"{target} ({devices} devices)"


@dataclasses.dataclass(frozen=True)
class Ranked(Sequence[Suggestion]):
    """The candidates of `eqshard.suggest`, best first.

    Those that fit come first, by their estimate. Then come those that do not, by how
    far over the limit they are. Then come those that failed to compile.

    `print(ranked)` shows the table (plain text, for logs). In a rich console or
    notebook it renders as one. `ranked[0]` is the first row. `ranked.best` is the best
    that fits (`None` when nothing does). `to_json()` gives the same to machines.

    **Attributes:**

    - `suggestions`: every `Suggestion`, in order.
    - `dropped`: `(name, reason)` of each candidate not ranked (see "Dropped
        candidates").
    - `devices`, `target`: where they were compiled for: a device count of simulated
        devices, or a TPU slice (and its count).
    - `compiler`: whose figures these are (`"XLA:CPU, 8 simulated devices"`).
    - `hardware`: the profile the estimates are on: the target's chip, else an H100.
    - `limit`, `limit_from`: the memory limit per device in bytes, and where it comes
        from (`"max_memory"`, or `"the chip's HBM"`); `None` without one.
    - `exhaustive`: whether every candidate was compiled; else those the estimates
        ruled out are listed with their figures marked `estimated`.

    !!! info "Dropped candidates"

        `dropped` holds those the generator dropped: a split that does not divide and
        cannot be repaired. It also holds those that failed to compile, with their
        error.
    """

    suggestions: tuple[Suggestion, ...]
    dropped: tuple[tuple[str, str], ...] = ()
    devices: int = 0
    target: str | None = None
    compiler: str = ""
    hardware: str = HARDWARE["h100"].name
    limit: int | None = None
    limit_from: str | None = None
    exhaustive: bool = True

    @overload
    def __getitem__(self, index: int) -> Suggestion: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Suggestion]: ...

    def __getitem__(self, index: int | slice) -> Suggestion | Sequence[Suggestion]:
        return self.suggestions[index]

    def __len__(self) -> int:
        return len(self.suggestions)

    def __iter__(self) -> Iterator[Suggestion]:
        return iter(self.suggestions)

    @property
    def best(self) -> Suggestion | None:
        """The fastest candidate that fits, or `None` when none does."""
        return next((s for s in self.suggestions if s.fits and s.cost is not None), None)

    @property
    def _on_cpu(self) -> bool:
        """Whether XLA:CPU compiled these (its peak is no accelerator's)."""
        return self.compiler.startswith("XLA:CPU") if self.compiler else self.target is None

    def __rich__(self) -> Table:
        from rich.table import Table
        from rich.text import Text

        on_cpu = self._on_cpu  # XLA:CPU's peak, not an accelerator's
        peak = "peak (XLA:CPU) / device" if on_cpu else "peak / device"
        if self.limit is not None:
            peak += f" (limit {_bytes(self.limit)})"
        chip = "H100" if self.target is None else self.hardware
        title = (
            f"eqshard suggest: {len(self)} candidates on {where_text(self.devices, self.target)}"
        )
        table = Table(title=Text(title), title_justify="left", caption_justify="left")
        table.add_column("#", justify="right")
        table.add_column("strategy", no_wrap=True)
        table.add_column("mesh", no_wrap=True)
        table.add_column(peak, justify="right")
        table.add_column("fits", no_wrap=True)
        table.add_column("communication / step")
        table.add_column(f"estimate ({chip})", justify="right")
        table.add_column("repairs", justify="right")
        table.add_column("figures", no_wrap=True)
        place = 0
        for s in self.suggestions:
            repairs = str(len(s.candidate.repairs))
            if s.cost is not None:
                place += 1
                moved = communication(s.cost)
                row = [
                    str(place),
                    s.strategy,
                    mesh_text(s.mesh),
                    _bytes(s.cost.memory.peak),
                    self._fits_text(s),
                    "\n".join(f"{axes} {_bytes(n)}" for axes, n in moved.items()) or "none",
                    seconds_text(s.cost.estimate().seconds),
                    repairs,
                    s.figures,
                ]
            elif s.error is not None:
                verdict = out_of_memory(s.error) or "failed"
                row = [
                    "-",
                    s.strategy,
                    mesh_text(s.mesh),
                    "-",
                    verdict,
                    "-",
                    "-",
                    repairs,
                    "failed",
                ]
            else:
                row = ["-", s.strategy, mesh_text(s.mesh), *self._guessed(s), repairs, s.figures]
            table.add_row(*(Text(cell) for cell in row))
        table.caption = Text("\n".join(self._notes()))
        return table

    def _guessed(self, s: Suggestion) -> list[str]:
        """A row not compiled for its target: the arguments' bytes (exact, a lower
        bound of the peak), whether it fits (unknown unless the arguments alone are
        over), and the estimated communication and seconds, marked `~`."""
        figures = s.candidate.estimated
        if figures is None:
            return ["-", "unknown: not compiled", "-", "-"]
        held = _bytes(figures.arguments)
        if s.over is not None and self.limit is not None:
            fits = f"no: its arguments alone need {held} of {_bytes(self.limit)}"
        else:
            fits = "unknown: not compiled"
        moved = communication(s.proxy) if s.proxy is not None else figures.communication()
        text = "\n".join(f"~{axes} {_bytes(n)}" for axes, n in moved.items()) or "none"
        guess = "-" if s.guess is None else "~" + seconds_text(s.guess)
        return [f">= {held}", fits, text, guess]

    def _fits_text(self, s: Suggestion) -> str:
        if self.limit is None:
            return "yes (no limit)"
        if s.fits or s.cost is None:
            return "yes"
        peak = s.cost.memory.peak
        return f"no: needs {_bytes(peak)} of {_bytes(self.limit)}: {peak / self.limit:.2f}x"

    def _notes(self) -> list[str]:
        """The lines under the table: whose figures, the limit, the verdict, and each
        candidate that was dropped or failed."""
        notes = [
            f"compiled by {self.compiler or 'nothing: no candidate was compiled'}; estimates "
            f"are rooflines on {self.hardware}, never measurements"
        ]
        if self.limit is None:
            whose = "XLA:CPU's peak is XLA:CPU's, not an accelerator's, so " if self._on_cpu else ""
            notes.append(
                f"no memory limit: {whose}every candidate counts as fitting; give max_memory "
                "(--max-memory) to rule some out"
            )
        else:
            limit = _bytes(self.limit)
            source = f"{HBM}, {limit}" if self.limit_from == HBM else f"{limit} (given)"
            bound = ", by XLA:CPU's peak" if self._on_cpu else ""
            notes.append(f"max memory: {source} per device{bound}")
        unknown = next(
            (s.cost.unknown_text() for s in self.suggestions if s.cost and not s.cost.known), None
        )
        if unknown is not None:  # the same loops in every candidate: it is the step's
            notes.append(f"estimates are per trip of a loop, not per step: {unknown}")
        promoted = next((s.cost.promoted for s in self.suggestions if s.cost), None)
        if promoted is not None:
            notes.append(promoted)
        notes.append(self._compiled_note())
        best = self.best
        fitting = sum(s.fits and s.cost is not None for s in self.suggestions)
        if best is None:
            notes.append("nothing fits")
        else:
            notes.append(f"{fitting} of {len(self)} fit; the best: {best.name}")
        for name, reason in self.dropped:
            brief = " ".join(reason.split())  # one line: a message may hold a table
            if len(brief) > _ERROR_CHARACTERS:
                brief = brief[: _ERROR_CHARACTERS - 1] + "…"
            notes.append(f"dropped: {name}: {brief}")
        return notes

    def _compiled_note(self) -> str:
        """How many candidates were compiled, and what the others' figures are."""
        compiled = sum(s.cost is not None or s.error is not None for s in self.suggestions)
        if self.exhaustive or compiled == len(self):
            return f"compiled all {len(self)} candidates"
        guessed = len(self) - compiled
        proxied = sum(s.proxy is not None and s.cost is None for s in self.suggestions)
        how = (
            f"{proxied} of them ranked by XLA:CPU's figures, the rest estimated"
            if proxied
            else "estimated"
        )
        return (
            f"compiled {compiled} of {len(self)} candidates; the other {guessed} were ruled out "
            f"before compiling ({how}: bytes held exact, '>=' the peak's lower bound, '~' a "
            "guess): slower than the best by their estimate, or their arguments alone over "
            "the limit; exhaustive=True (--exhaustive) compiles every one"
        )

    def __str__(self) -> str:
        return as_text(self, WIDTH)

    def to_json(self) -> dict[str, Any]:
        """The ranking as JSON: where it was compiled, the limit, each suggestion in
        order (`Suggestion.to_json`), and the dropped candidates."""
        best = self.best
        return {
            "devices": self.devices,
            "target": self.target,
            "compiler": self.compiler,
            "hardware": self.hardware,
            "max_memory": None
            if self.limit is None
            else {"bytes": self.limit, "from": self.limit_from},
            "best": None if best is None else self.suggestions.index(best),
            "exhaustive": self.exhaustive,
            "suggestions": [s.to_json() for s in self.suggestions],
            "dropped": [{"name": name, "reason": reason} for name, reason in self.dropped],
        }


def ranked(
    candidates: Sequence[Candidate],
    results: Sequence[Cost | str | None],
    devices: int,
    on: CompileTarget | None,
    limit: int | None,
    limit_from: str | None,
    dropped: Sequence[tuple[str, str]] = (),
    *,
    guesses: Sequence[float | None] | None = None,
    proxies: Sequence[Cost | None] | None = None,
    exhaustive: bool = True,
    compiler: str = "",
) -> Ranked:
    """The `Ranked` of the candidates: `results` holds each one's `Cost`, why it
    failed, or `None` where it was not compiled (`guesses` and `proxies` then say
    what it was ranked by). Those compiled that fit go first by their estimate (then
    their peak, then the generator's order); then those not compiled, by their
    guess; then those compiled that do not fit, by how far over they are; then those
    whose arguments alone are over the limit; then the failures in the generator's
    order."""
    fitting, guessed, over, beyond, failed = [], [], [], [], []
    for i, (candidate, result) in enumerate(zip(candidates, results)):
        guess = None if guesses is None else guesses[i]
        proxy = None if proxies is None else proxies[i]
        if isinstance(result, str):
            failed.append(Suggestion(candidate, error=result, limit=limit, guess=guess))
            continue
        if result is None:
            figures = candidate.estimated
            held = None if figures is None or limit is None else figures.arguments / limit
            row = Suggestion(candidate, limit=limit, proxy=proxy, guess=guess)
            if held is not None and held > 1:
                beyond.append(((held, i), dataclasses.replace(row, over=held)))
            else:
                guessed.append(((guess is None, guess or 0.0, i), row))
            continue
        peak = result.memory.peak
        seconds = result.estimate().seconds
        if limit is None or peak <= limit:
            fitting.append(
                ((seconds, peak, i), Suggestion(candidate, result, True, limit=limit, guess=guess))
            )
        else:
            ratio = peak / limit
            over.append(
                (
                    (ratio, seconds, i),
                    Suggestion(candidate, result, False, ratio, None, limit, guess=guess),
                )
            )
    order = [s for group in (fitting, guessed, over, beyond) for _, s in sorted(group)]
    order += failed
    found = next((r.compiler for r in results if r is not None and not isinstance(r, str)), "")
    if not found:  # none compiled to say whose: the target's, else the one given
        found = (
            on.compiler if on is not None else compiler or f"XLA:CPU, {devices} simulated devices"
        )
    return Ranked(
        tuple(order),
        tuple(dropped) + tuple((s.name, s.error or "") for s in failed),
        devices,
        None if on is None else on.name,
        found,
        (HARDWARE["h100"] if on is None else on.hardware).name,
        limit,
        limit_from,
        exhaustive,
    )
