"""`eqshard.suggest`: the fastest spec that fits, found by compiling the user's step.

`suggest` asks the candidate generator (`_candidates.py`) for every strategy on every
mesh of the device count, then `rank` costs each candidate with `eqshard.cost`: its
`Rules` as the spec, compiled by XLA:CPU on simulated devices, or for a TPU slice by
XLA:TPU through libtpu. Compiling is the slow part, so candidates are compiled in
worker processes (`_process/_workers.py`, the one protocol), as many as the cores hold
compiles (`THREADS_PER_COMPILE`). Each worker starts JAX once (or loads libtpu once),
receives the step and the abstract model and arguments once, then takes the candidates
one at a time from a shared queue until none are left; a candidate that fails to
compile, or whose worker dies, is listed with its error, and the others are ranked.

Those that fit the memory limit (`max_memory`, else the chip's HBM on a target) are
ranked by their roofline estimate (`Cost.estimate`, on the target's chip, else an
H100); the others follow, closest to the limit first, and the failures last.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard, overload

import numpy as np

from .._cost._driver import cost, portable, unplaced
from .._cost._hardware import HARDWARE, memory_size, seconds_text
from .._cost._targets import compile_target
from .._errors import EqshardError, whole_number
from .._fit import mesh_text
from .._process._workers import (
    Worker,
    pickled,
    pool_answers,
    serve_each,
    start_serving,
    unpickled,
    without_device_count,
)
from .._report import as_text, human_bytes
from .._sharding import device_tuple
from .._specfile._model import Rules
from ._candidates import Candidate, candidates

if TYPE_CHECKING:
    from rich.table import Table

    from .._cost._hardware import Hardware
    from .._cost._results import Cost
    from .._cost._targets import CompileTarget
    from .._sharding import Devices
    from ._estimate import Estimated

    Wanted: TypeAlias = Callable[[int, Sequence[Cost | str | None]], bool] | None
    Found: TypeAlias = list[Cost | str | None]
    Answered: TypeAlias = Callable[[int], None] | None
    CompileEach: TypeAlias = Callable[[Sequence[Candidate], str | None, Wanted, Answered], Found]

__all__ = [
    "TOLERANCE",
    "Progress",
    "Ranked",
    "Suggestion",
    "communication",
    "compile_in_workers",
    "in_workers",
    "memory_limit",
    "placement",
    "pool_size",
    "proxy_guess",
    "rank",
    "ranked",
    "search",
    "suggest",
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


def _name(candidate: Candidate) -> str:
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
    """

    done: int
    total: int
    where: str
    candidate: str | None = None
    finished: bool = False

    def __str__(self) -> str:
        some = "1 candidate" if self.total == 1 else f"{self.total} candidates"
        if self.finished:
            left = self.total - self.done
            if not left:
                return f"compiled {'the' if self.total == 1 else 'all'} {some} on {self.where}"
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
    - `cost`: the `eqshard.Cost` it was ranked by; `None` where it failed to compile.
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
        return _name(self.candidate)

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
            f"Suggested by eqshard suggest: {self.name} on {_where(c.devices, c.target)}, "
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


def _where(devices: int, target: str | None) -> str:
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

    def __rich__(self) -> Table:
        from rich.table import Table
        from rich.text import Text

        on_cpu = self.target is None  # XLA:CPU's peak, not an accelerator's
        peak = "peak (XLA:CPU) / device" if on_cpu else "peak / device"
        if self.limit is not None:
            peak += f" (limit {_bytes(self.limit)})"
        chip = "H100" if self.target is None else self.hardware
        title = f"eqshard suggest: {len(self)} candidates on {_where(self.devices, self.target)}"
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
            notes.append(
                "no memory limit: XLA:CPU's peak is XLA:CPU's, not an accelerator's, so every "
                "candidate counts as fitting; give max_memory (--max-memory) to rule some out"
            )
        else:
            limit = _bytes(self.limit)
            source = f"{HBM}, {limit}" if self.limit_from == HBM else f"{limit} (given)"
            bound = ", by XLA:CPU's peak" if self.target is None else ""
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


def placement(devices: Devices, target: str | None) -> tuple[int, CompileTarget | None]:
    """The device count the candidates are costed on, and the TPU slice, if any.

    **Raises:** `EqshardError` when both or neither are given, or `devices` is no
    whole number; what `compile_target` raises for the slice.
    """
    if target is not None:
        if devices is not None:
            raise EqshardError(
                f"`devices={devices!r}` and `target={target!r}` are both given; the slice has "
                "its devices: give one of them"
            )

        on = compile_target(target)
        return len(on.devices), on
    if devices is None:
        raise EqshardError(
            "give `devices=` (how many simulated devices to compile each candidate on) or "
            "`target=` (a TPU slice, such as 'v5p:4x4x4')"
        )
    listed = _listed(devices)
    if listed is not None:
        return len(listed), None
    return whole_number(devices, "`devices`"), None


def _listed(devices: Devices) -> tuple[Any, ...] | None:
    """`devices=` as a list of this process's devices, or `None` for a count."""
    if devices is None or isinstance(devices, (int, np.integer)):
        return None

    return device_tuple(devices)


def memory_limit(
    max_memory: int | str | None, on: CompileTarget | None
) -> tuple[int | None, str | None]:
    """The memory limit per device and where it comes from: `max_memory`, else the
    target chip's HBM per device, else none."""
    if max_memory is not None:
        return memory_size(max_memory), GIVEN
    if on is not None:
        return on.memory_per_device, HBM
    return None, None


def _cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def rank(
    candidates: Sequence[Candidate],
    step: Any,
    model: Any,
    *args: Any,
    devices: Devices = None,
    target: str | None = None,
    max_memory: int | str | None = None,
    workers: int | None = None,
    dropped: Sequence[tuple[str, str]] = (),
    exhaustive: bool = False,
    tolerance: float = 0.05,
    progress: Callable[[Progress], None] | None = None,
) -> Ranked:
    """Costs the candidates by compiling the user's step under their rules, and ranks
    them: those the estimates cannot rule out, or every one with `exhaustive`.

    **Example:**

    ```python
    ranked = rank(candidates, step, model, opt_state, batch, devices=8, max_memory="16GiB")
    print(ranked)          # the table
    ranked.best.rules      # the fastest that fits
    ```

    **Arguments:**

    - `candidates`: the `Candidate`s to cost.
    - `step`, `model`, `*args`: as for `eqshard.cost`, concrete or abstract: they
        travel to the workers abstract, once per worker.
    - `devices`: compile each candidate on this many simulated CPU devices
        (XLA:CPU, whose peak is what XLA:CPU allocates: `Memory.peak`).
    - `target`: or for this TPU slice (`"v5p:4x4x4"`), with XLA:TPU through libtpu.
    - `max_memory`: device memory per device: bytes, or a size such as `"80GB"` or
        `"75GiB"` (as `eqshard check --max-memory` reads it). By default the target
        chip's HBM; without a target there is no limit, and every candidate fits.
    - `workers`: how many worker processes compile at once (by default as many as
        the cores hold compiles, `pool_size`, at most one per candidate), each
        taking the next candidate as it finishes one; `0` costs every candidate in
        this process, one after another.
    - `dropped`: the candidates the generator dropped, `(name, reason)`, listed with
        the ranking's.
    - `exhaustive`: compile every candidate, rather than those that the estimates
        cannot rule out (see `eqshard.suggest`).
    - `tolerance`: how close to the best a candidate's estimate must come to be
        compiled (see `eqshard.suggest`).
    - `progress`: called with a `Progress` as the compiles go (see `eqshard.suggest`).

    **Returns:**

    A `Ranked`.

    **Raises:**

    `EqshardError` when `devices` and `target` are both given or neither is, for a
    `max_memory` that is no size, for a `target` that is no TPU slice (`UsageError`
    without libtpu), and when the step or its arguments cannot cross to a worker (a
    worker's own trouble, such as a step module it cannot import, too). A candidate
    that fails to compile is no error: it is listed with its message.
    """
    n, on = placement(devices, target)
    limit, limit_from = memory_limit(max_memory, on)
    if workers is not None:
        workers = whole_number(workers, "`workers`", 0)
    listed = _listed(devices)
    if listed is not None and workers:
        raise EqshardError(
            f"`devices` is a list of this process's devices and `workers={workers}`: worker "
            "processes cannot hold them; pass a count to compile in workers, or `workers=0`"
        )
    if workers == 0 or listed is not None:
        on_devices = listed if listed is not None else n

        def compile_here(
            chosen: Sequence[Candidate], where: str | None, wanted: Wanted, answered: Answered
        ) -> Found:
            found: list[Cost | str | None] = [None] * len(chosen)
            for k, c in enumerate(chosen):
                if wanted is None or wanted(k, found):
                    found[k] = _cost_one(step, model, args, c.rules, on_devices, where)
                    if answered is not None:
                        answered(k)
            return found

        return search(
            candidates,
            compile_here,
            n,
            on,
            limit,
            limit_from,
            dropped,
            exhaustive,
            tolerance=tolerance,
            progress=progress,
        )
    inputs = {
        "pickle": pickled(
            (step, unplaced(model), unplaced(args)),
            "the step or its arguments",
            "define the step at the top level of a module, or in the script being run "
            "(cloudpickle, `pip install 'eqshard[cost]'`, sends the script's by value)",
        )
    }
    return search(
        candidates,
        in_workers(inputs, n, workers),
        n,
        on,
        limit,
        limit_from,
        dropped,
        exhaustive,
        proxy=True,
        tolerance=tolerance,
        progress=progress,
    )


TOLERANCE = 0.05
"""`suggest`'s default `tolerance`: a candidate is compiled while its estimate, times
the lowest ratio of compiled to estimated seconds seen (at most 1), times
`1 - tolerance`, is below the best compiled one's seconds."""


def proxy_guess(proxy: Cost, figures: Estimated | None, hardware: Hardware) -> float:
    """The seconds XLA:CPU's figures of a candidate guess for an accelerator's step:
    its roofline on `hardware`, with two of XLA:CPU's habits taken out, each towards
    a faster guess (a candidate is then compiled rather than ruled out):

    - it moves 16-bit collectives as float32 copies (`Cost.promoted`), so where the
        parameters are 16-bit its collectives count half;
    - it fuses less than an accelerator's compiler, so its bytes accessed overstate
        theirs, and tensor-parallel programs' more than others' (measured on XLA:TPU):
        the memory term is the smaller of XLA:CPU's and the layouts' estimate.
    """
    found = proxy.estimate(hardware)
    communication = found.communication * (0.5 if proxy.promoted else 1.0)
    memory = found.memory
    if figures is not None:
        memory = min(memory, figures.estimate(hardware).memory)
    return max(found.compute, memory) + communication


def _compiled(result: Cost | str | None) -> TypeGuard[Cost]:
    return result is not None and not isinstance(result, str)


def in_workers(
    inputs: Mapping[str, Any], devices: int, workers: int | None, quiet: bool = True
) -> _InWorkers:
    """`search`'s way to compile: in pools of worker processes (`compile_in_workers`),
    which get the step's inputs as `inputs` says; `quiet`, their stderr kept to
    themselves (said where one dies)."""
    return _InWorkers(inputs, devices, workers, quiet)


class _InWorkers:
    """Compiles candidates in worker pools; `prepare(target)` starts the target's
    workers ahead, so they load the compiler and read the inputs while another pool
    compiles."""

    def __init__(
        self, inputs: Mapping[str, Any], devices: int, workers: int | None, quiet: bool
    ) -> None:
        self.inputs, self.devices, self.workers = inputs, devices, workers
        self.quiet = quiet
        self.warm: dict[str | None, list[Worker]] = {}

    def prepare(self, target: str | None, candidates: int) -> None:
        first = {"inputs": dict(self.inputs), "devices": self.devices, "target": target}
        started = []
        for _ in range(pool_size(candidates, target, self.workers)):
            worker = start_serving(_ENTRY, without_device_count(os.environ), quiet=self.quiet)
            worker.ask(first, _TIMEOUT_SECONDS)
            started.append(worker)
        self.warm[target] = started

    def close(self) -> None:
        """Stops the workers started ahead and not used (a pass before them failed)."""
        for started in self.warm.values():
            for worker in started:
                worker.stop()
        self.warm.clear()

    def __call__(
        self, chosen: Sequence[Candidate], where: str | None, wanted: Wanted, answered: Answered
    ) -> Found:
        warm = self.warm.pop(where, [])
        try:
            return compile_in_workers(
                chosen,
                self.inputs,
                self.devices,
                where,
                self.workers,
                wanted=wanted,
                warm=warm,
                quiet=self.quiet,
                answered=answered,
            )
        finally:
            for worker in warm:
                worker.stop()


def search(
    candidates: Sequence[Candidate],
    compile_each: CompileEach,
    devices: int,
    on: CompileTarget | None,
    limit: int | None,
    limit_from: str | None,
    dropped: Sequence[tuple[str, str]] = (),
    exhaustive: bool = False,
    *,
    proxy: bool = False,
    tolerance: float = TOLERANCE,
    progress: Callable[[Progress], None] | None = None,
) -> Ranked:
    """The `Ranked` of `candidates`, compiled by `compile_each(chosen, target, wanted,
    answered)` (in this process, or in workers: each chosen one's `Cost`, its error, or
    `None` where `wanted(k, found_so_far)` said no; `answered(k)` as each is done), each
    pass told to `progress` (`Progress`).

    Unless `exhaustive`, those whose arguments alone exceed `limit` are not compiled
    (their bytes are exact), and the rest are compiled in the order of their estimate
    (`candidate.estimated`'s roofline; for a TPU target with `proxy`, XLA:CPU's
    figures on as many simulated devices, a compile of seconds where XLA:TPU takes
    tens), each only while it could still beat the best that fits, by more than
    `tolerance` (`TOLERANCE`).

    **Raises:** `EqshardError` for a `tolerance` outside `[0, 1)`.
    """
    if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < 1):
        raise EqshardError(
            f"`tolerance` is a fraction from 0 (compile every candidate that could be "
            f"the best) to below 1, such as 0.05, not {tolerance!r}"
        )
    hardware = HARDWARE["h100"] if on is None else on.hardware
    target = None if on is None else on.name
    n = len(candidates)
    compile_each = _told(compile_each, progress, devices, target)
    guesses: list[float | None] = [
        None if c.estimated is None else c.estimated.estimate(hardware).seconds for c in candidates
    ]
    over = [
        limit is not None and c.estimated is not None and c.estimated.arguments > limit
        for c in candidates
    ]
    if exhaustive:
        results = compile_each(candidates, target, None, None)
        return ranked(candidates, results, devices, on, limit, limit_from, dropped, guesses=guesses)
    open_ = sorted(
        (i for i in range(n) if not over[i]),
        key=lambda i: (guesses[i] is not None, guesses[i] or 0.0, i),
    )
    try:
        proxies: list[Cost | None] = [None] * n
        if proxy and on is not None and len(open_) > 1:
            prepare = getattr(compile_each, "prepare", None)
            if prepare is not None:  # the target's workers start while XLA:CPU compiles
                prepare(target, len(open_))

            # XLA:CPU's figures, while a candidate's estimate could beat the best of them
            def promising(k: int, found: Sequence[Cost | str | None]) -> bool:
                guess = guesses[open_[k]]
                seen = [r.estimate(hardware).seconds for r in found if _compiled(r)]
                return guess is None or not seen or guess * (1 - tolerance) < min(seen)

            cheap = compile_each([candidates[i] for i in open_], None, promising, None)
            for i, found in zip(open_, cheap):
                if _compiled(found):
                    proxies[i] = found
                    guesses[i] = proxy_guess(found, candidates[i].estimated, hardware)
        order = sorted(open_, key=lambda i: (guesses[i] is not None, guesses[i] or 0.0, i))

        def wanted(k: int, found: Sequence[Cost | str | None]) -> bool:
            guess = guesses[order[k]]
            if guess is None:
                return True
            best, ratio = None, 1.0
            for j, result in enumerate(found):
                if not _compiled(result):
                    continue
                seconds = result.estimate(hardware).seconds
                seen = guesses[order[j]]
                if seen:
                    ratio = min(ratio, seconds / seen)
                if limit is None or result.memory.peak <= limit:
                    best = seconds if best is None else min(best, seconds)
            return best is None or guess * ratio * (1 - tolerance) < best

        results: list[Cost | str | None] = [None] * n
        chosen = compile_each([candidates[i] for i in order], target, wanted, None)
        for i, found in zip(order, chosen):
            results[i] = found
        return ranked(
            candidates,
            results,
            devices,
            on,
            limit,
            limit_from,
            dropped,
            guesses=guesses,
            proxies=proxies,
            exhaustive=False,
        )
    finally:
        close = getattr(compile_each, "close", None)
        if close is not None:  # the target's workers started ahead, if a pass failed
            close()


def _told(
    compile_each: CompileEach,
    progress: Callable[[Progress], None] | None,
    devices: int,
    target: str | None,
) -> CompileEach:
    """`compile_each`, each pass of it told to `progress`: its start, each candidate
    compiled, its end. A pass for no target ranks a TPU target's candidates first
    (`search`'s `proxy`)."""
    if progress is None:
        return compile_each
    tell = progress

    def told(chosen: Sequence[Candidate], where: str | None, wanted: Wanted, _: Answered) -> Found:
        if not chosen:
            return compile_each(chosen, where, wanted, None)
        on = _where(devices, where)
        if where is None and target is not None:
            on = f"{devices} simulated devices with XLA:CPU, ranking them for {target}"
        done = 0

        def answered(k: int) -> None:
            nonlocal done
            done += 1
            tell(Progress(done, len(chosen), on, _name(chosen[k])))

        tell(Progress(0, len(chosen), on))
        found = compile_each(chosen, where, wanted, answered)
        tell(Progress(sum(r is not None for r in found), len(chosen), on, finished=True))
        return found

    for name in ("prepare", "close"):  # `_InWorkers`'s, where it has them
        if hasattr(compile_each, name):
            setattr(told, name, getattr(compile_each, name))
    return told


def _cost_one(
    step: Any, model: Any, args: Sequence[Any], rules: Rules, devices: Devices, target: str | None
) -> Cost | str:
    """`eqshard.cost` of one candidate, or why it failed."""
    import jax

    where: dict[str, Any] = {}  # this process's devices, else a count simulated in a worker
    if not target:
        more = isinstance(devices, int) and devices > len(jax.devices())
        where = {"simulate": devices} if more else {"devices": devices}
    try:
        return cost(
            model,
            *args,
            step=step,
            spec=rules,
            target=target,
            compile_for="costing",  # cheaper, with the same figures (tests/test_cost.py)
            **where,
        )
    except Exception as error:  # a candidate that does not compile is listed, not fatal
        return _error_text(error)


def _error_text(error: BaseException) -> str:
    """An error as a failed candidate's reason: eqshard's own by their message (which
    names the step and the spec), anything else with its class."""
    text = str(error).strip()
    if not text:  # a reason is never empty
        return f"{type(error).__name__}, with no message"
    if isinstance(error, EqshardError):
        return text
    return f"{type(error).__name__}: {text}"


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
    compiler = next((r.compiler for r in results if r is not None and not isinstance(r, str)), "")
    if not compiler:
        compiler = on.compiler if on is not None else f"XLA:CPU, {devices} simulated devices"
    return Ranked(
        tuple(order),
        tuple(dropped) + tuple((s.name, s.error or "") for s in failed),
        devices,
        None if on is None else on.name,
        compiler,
        (HARDWARE["h100"] if on is None else on.hardware).name,
        limit,
        limit_from,
        exhaustive,
    )


_TIMEOUT_SECONDS = 3600.0  # each candidate's compile, in a worker

# The cores one compile keeps busy, by compiler: XLA:TPU's own threads use about 1.8
# (measured on a Llama ranking, issue 31), XLA:CPU's about 1; a pool larger than the
# cores over this only makes each compile slower.
THREADS_PER_COMPILE = {"XLA:TPU": 1.8, "XLA:CPU": 1.0}


def pool_size(candidates: int, target: str | None, workers: int | None = None) -> int:
    """How many compile workers `compile_in_workers` starts for `candidates`: `workers`
    where given, else as many as the cores hold compiles (`THREADS_PER_COMPILE`), at
    least one, never more than the candidates."""
    if not workers:
        threads = THREADS_PER_COMPILE["XLA:CPU" if target is None else "XLA:TPU"]
        workers = max(1, int(_cores() // threads))
    return max(1, min(workers, candidates))


def compile_in_workers(
    candidates: Sequence[Candidate],
    inputs: Mapping[str, Any],
    devices: int,
    target: str | None,
    workers: int | None = None,
    *,
    wanted: Wanted = None,
    warm: Sequence[Worker] = (),
    quiet: bool = True,
    answered: Answered = None,
) -> Found:
    """Each candidate's `Cost`, or why it failed, compiled in worker processes; `None`
    for one never compiled because `wanted(k, found_so_far)` said no, when asked as a
    worker came free (by default every one is wanted). `warm` workers were started
    ahead and sent the inputs (`_InWorkers.prepare`).

    `pool_size` workers start at once (by default as many as the cores hold
    compiles), each starting JAX or libtpu and building the step once, then take the
    candidates one at a time from one queue (`pool_answers`), so a slow compile holds
    one worker while the others take the rest. `inputs` says how a worker gets the
    step and its arguments, once: `{"pickle": ...}`, pickled (`pickled`), or
    `{"build": "MODULE:FUNCTION", "request": {...}}`, a function that builds them
    from the request (the command line's, which imports the user's modules by name).
    A worker that ends without an answer (killed, out of memory, past its time)
    fails the candidate it was compiling, with that message, and a fresh worker takes
    the next; an error it answers (its inputs cannot be read or built) is raised here.
    `quiet` keeps what the workers write on stderr (XLA's warnings) off this
    process's, and in the failure of a worker that dies; `answered(k)` is called as
    candidate `k` is done.
    """
    if not candidates:
        return []
    where = _where(devices, target)
    read: dict[int, Cost | str] = {}

    def still_wanted(k: int, answers: Sequence[Any]) -> bool:
        assert wanted is not None
        for j, answer in enumerate(answers):
            if answer is not None and j not in read:
                read[j] = _read_answer(answer)
        return wanted(k, [read.get(j) for j in range(len(answers))])

    answers = pool_answers(
        [
            {"rules": pickled(c.rules, "the candidate's rules", "report it as a bug in eqshard")}
            for c in candidates
        ],
        _ENTRY,
        pool_size(len(candidates), target, workers),
        first={"inputs": dict(inputs), "devices": devices, "target": target},
        env=without_device_count(os.environ),
        timeout=_TIMEOUT_SECONDS,
        doing=[f"costing {_name(c)} on {where}" for c in candidates],
        hint="Cost the candidate with `eqshard.cost` in this process to see why",
        wanted=None if wanted is None else still_wanted,
        warm=warm,
        quiet=quiet,
        answered=answered,
    )
    return [
        None if answer is None else read[k] if k in read else _read_answer(answer)
        for k, answer in enumerate(answers)
    ]


def _read_answer(answer: Any) -> Cost | str:
    """A compile worker's answer: the `Cost`, or why the candidate failed."""
    if isinstance(answer, EqshardError):  # its worker ended without answering
        return str(answer)
    if answer.get("cost") is None:
        return str(answer["error"]) or "its worker answered an error with no message"
    return unpickled(answer["cost"], "the cost")


_ENTRY = "eqshard._search._suggest:_worker"


def _worker() -> int:
    """A worker's entry (`compile_in_workers`): costs one candidate per request."""
    return serve_each(_Costing())


class _Costing:
    """A compile worker's requests (`serve_each`): its first carries the step's
    inputs, which it reads once (JAX started, the step built), and each one a
    candidate's rules, which it costs."""

    def __init__(self) -> None:
        self.inputs: tuple[Any, Any, tuple[Any, ...]] | None = None
        self.devices = 0
        self.target: str | None = None

    def __call__(self, request: Mapping[str, Any]) -> dict[str, str]:
        if "inputs" in request:
            self.inputs = _costs_here(request)
            self.devices = whole_number(request["devices"], "devices")
            self.target = request.get("target")
        if self.inputs is None:
            raise EqshardError("a compile worker's first request carries the step's inputs")
        if "rules" not in request:  # started ahead (`_InWorkers.prepare`): ready
            return {"ready": "yes"}
        step, model, args = self.inputs
        rules = unpickled(request["rules"], "the candidate's rules")
        found = _cost_one(step, model, args, rules, self.devices, self.target)
        if isinstance(found, str):
            return {"error": found}
        return {"cost": pickled(portable(found), "the cost", "report it as a bug")}


def _costs_here(request: Mapping[str, Any]) -> tuple[Any, Any, tuple[Any, ...]]:
    """The step and its arguments in a compile worker, JAX not yet started: JAX
    started on the request's devices (or for its target), then the inputs read."""
    import jax

    target = request.get("target")
    devices = whole_number(request["devices"], "devices")
    jax.config.update("jax_platforms", "cpu")
    if target is None:
        jax.config.update("jax_num_cpu_devices", devices)
    step, model, args = _inputs(request["inputs"])
    started = len(jax.devices())  # the step's module may have started JAX with its own count
    if target is None and started < devices:
        raise EqshardError(
            f"costing the candidates on {devices} devices needs {devices} simulated devices, "
            f"but JAX started with {started}: the step's modules set that count "
            "(jax.config.update('jax_num_cpu_devices', ...)); leave the count to eqshard"
        )
    return step, model, args


def _inputs(entry: Mapping[str, Any]) -> tuple[Any, Any, tuple[Any, ...]]:
    """The step, the model and the other arguments, as the request carries them:
    pickled, or built by the function it names."""
    import importlib

    if "pickle" in entry:
        step, model, args = unpickled(entry["pickle"], "the step or its arguments")
        return step, model, tuple(args)
    module, _, function = str(entry["build"]).partition(":")
    step, model, args = getattr(importlib.import_module(module), function)(entry["request"])
    return step, model, tuple(args)


def suggest(
    model: Any,
    *args: Any,
    step: Any,
    devices: Devices = None,
    target: str | None = None,
    max_memory: int | str | None = None,
    workers: int | None = None,
    exhaustive: bool = False,
    strategies: Sequence[str] | None = None,
    tolerance: float = TOLERANCE,
    progress: Callable[[Progress], None] | None = None,
) -> Ranked:
    """The fastest spec that fits, found by compiling the user's own step under the
    candidate strategies that estimates cannot rule out.

    **Example:**

    ```python
    ranked = eqshard.suggest(model, opt_state, batch, step=step, devices=64, max_memory="80GB")
    print(ranked)                                  # strategy, mesh, memory, fits, ...
    ranked[0].rules                                # a Rules, with a comment per rule
    ranked[0].cost                                 # the Cost it was ranked by
    eqshard.dump(ranked[0].rules, "best.eqshard.json")
    ```

    **Arguments:**

    - `model`: the model, concrete or abstract (`eqx.filter_eval_shape`).
    - `*args`: the rest of the step's arguments (its `eqx.nn.State`, the optimizer
        state, the batch), concrete or abstract.
    - `step`: the training step, as `eqshard.cost` takes it: called as
        `step(model, *args)`.
    - `devices`: a count of simulated CPU devices, or a list of this process's devices
        (see "Where candidates compile").
    - `target`: instead, a TPU slice (`"v5p:4x4x4"`) to compile for (see "Where
        candidates compile").
    - `max_memory`: device memory per device, bytes or a size (`"80GB"`, `"75GiB"`); by
        default the target chip's HBM.
    - `workers`: worker processes that compile at once; by default one per core, and `0`
        compiles in this process.
    - `exhaustive`: compile every candidate (see "Ranked before compiled").
    - `strategies`: the strategies to try, by name (`["fsdp", "data x tensor"]`, or one
        string separated by commas); by default every one.
    - `tolerance`: how close to the best compiled one a candidate's estimate must come
        to be compiled too: `0.05` (the default) compiles those whose estimate is within
        5% of it; smaller is faster and riskier (see "Ranked before compiled").
    - `progress`: called with a `Progress` at the start of each pass of compiles, as
        each candidate is compiled, and at its end (`print` shows each as a line).

    **Returns:**

    A `Ranked`, best first (see "The ranking").

    **Raises:**

    - `eqshard.EqshardError`: `devices` and `target` are both given or neither is,
        `max_memory` is no size, `target` is no TPU slice, `strategies` names one that
        is none, or the step or its arguments cannot be sent to a worker.
    - `eqshard.UsageError`: a `target` without libtpu.

    !!! info "Where candidates compile"

        With a count, each candidate is compiled by XLA:CPU in a worker, on that many
        simulated CPU devices. With a list of this process's devices, each is compiled
        here, for them (on a GPU, by its compiler). With a `target`, each is compiled
        for the slice's devices by XLA:TPU, through libtpu
        (`pip install 'eqshard[tpu]'`). What the workers write on stderr (XLA's
        warnings) is kept from this process's; a candidate whose worker died is
        listed with the last lines it wrote.

    !!! info "Memory"

        Without `max_memory` or a target, nothing is ruled out by memory, and the table
        says so.

    !!! info "The ranking"

        The candidates that fit come first, fastest first by their roofline estimate (on
        the target's chip, else an H100). Then come those that do not fit, with how far
        over the limit each is. Then come those that failed to compile, with their
        error. `ranked.dropped` lists the candidates dropped (a split that cannot be
        repaired) and those that failed, with the reasons.

    !!! info "Ranked before compiled"

        Compiling is the slow part: half a minute a candidate for an 8B model on
        XLA:TPU. So each candidate is first estimated without the compiler
        (`candidate.estimated`): the bytes each device holds of the parameters, the
        optimizer state, the `eqx.nn.State` and the batch exactly, from the layouts;
        the activations, collectives and FLOPs estimated from the layouts and the
        step's jaxpr. A candidate whose arguments alone exceed the memory limit
        cannot fit, and is not compiled. For a TPU target, the others are then
        compiled by XLA:CPU on as many simulated devices (seconds each, with the same
        SPMD partitioner), whose figures rank them better. Then they are compiled for
        the target in that order, each only while it could still be faster than the
        best compiled one that fits, by more than `tolerance`. The rows not compiled say so
        (`Suggestion.figures`): their bytes held are exact, the rest marked as
        estimates, and their fit is unknown, never assumed. `exhaustive=True`
        compiles every candidate.
    """
    n, _ = placement(devices, target)
    kept, dropped = candidates(step, model, *args, devices=n, strategies=strategies)
    return rank(
        kept,
        step,
        model,
        *args,
        devices=devices,
        target=target,
        max_memory=max_memory,
        workers=workers,
        dropped=dropped,
        exhaustive=exhaustive,
        tolerance=tolerance,
        progress=progress,
    )
