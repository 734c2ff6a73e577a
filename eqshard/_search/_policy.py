"""Which candidates `suggest` compiles: `search` rules out, without compiling, a
candidate whose arguments alone exceed the limit, ranks the rest by their estimate,
and compiles each for the target only while it could beat the best that fits, by
more than `tolerance` (`TOLERANCE`), or every one (`exhaustive`). For a TPU target,
the target compiles the estimates' front-runner first (the next, until one fits),
and XLA:CPU, on as many simulated devices, ranks only those the estimates cannot
rule out against it; where the cores hold both, XLA:CPU ranks every one while the
target compiles the front-runner."""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeGuard

from .._cost._hardware import HARDWARE
from .._errors import EqshardError
from ._ranked import Progress, Ranked, name_of, ranked, where_text

if TYPE_CHECKING:
    from .._cost._hardware import Hardware
    from .._cost._results import Cost
    from .._cost._targets import CompileTarget
    from ._candidates import Candidate
    from ._estimate import Estimated
    from ._pool import Answered, CompileEach, Found, Wanted

__all__ = ["TOLERANCE", "proxy_guess", "search", "sharing_proxies"]

TOLERANCE = 0.02
"""`suggest`'s default `tolerance`: a candidate is compiled while its estimate, times
the lowest ratio of compiled to estimated seconds seen (at most 1), times
`1 - tolerance`, is below the best compiled one's seconds.

The ratio follows, in each run, how far the guesses overstated what the target's
compiler found; the tolerance covers what one run has not yet seen. It is chosen from
how far XLA:CPU's corrected guesses overstated XLA:TPU's figures for the candidates
that lead (`benchmarks/bench_suggest.py`'s `overstated`): at most 1.9% on the Llama 8B
on `v5p:4x4x4`, where 0.05 compiled three candidates to pick the one 0.02 picks with
one."""

_SHARED: contextvars.ContextVar[dict[tuple[int, str], Cost | str] | None] = contextvars.ContextVar(
    "eqshard_shared_proxies", default=None
)


@contextlib.contextmanager
def sharing_proxies() -> Iterator[None]:
    """Within it, the searches share XLA:CPU's figures of each candidate on each count
    of devices: `suggest_targets` compiles a candidate once for slices of one size."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _key(candidate: Candidate, devices: int) -> tuple[int, str]:
    return devices, json.dumps(candidate.rules.to_json(), sort_keys=True)


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


class _Bar:
    """What the candidates compiled for the target say of the others: `best`, the
    seconds of the fastest that fits (`None` until one does), and `ratio`, the lowest
    of their compiled seconds over the seconds guessed for them (at most 1)."""

    def __init__(
        self,
        known: Sequence[tuple[float | None, Cost]],
        hardware: Hardware,
        limit: int | None,
        tolerance: float,
    ) -> None:
        self.best: float | None = None
        self.ratio = 1.0
        self.tolerance = tolerance
        for guess, cost in known:
            seconds = cost.estimate(hardware).seconds
            if guess:
                self.ratio = min(self.ratio, seconds / guess)
            if limit is None or cost.memory.peak <= limit:
                self.best = seconds if self.best is None else min(self.best, seconds)

    def could_win(self, guess: float | None) -> bool:
        """Whether a candidate guessed at `guess` seconds (`None`: no guess) could
        beat the best by more than the tolerance, its guess corrected by `ratio`."""
        if guess is None or self.best is None:
            return True
        return guess * self.ratio * (1 - self.tolerance) < self.best


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
    compiler: str = "",
) -> Ranked:
    """The `Ranked` of `candidates`, compiled by `compile_each(chosen, target, wanted,
    answered)` (in this process, or in workers: each chosen one's `Cost`, its error, or
    `None` where `wanted(k, found_so_far)` said no; `answered(k)` as each is done), each
    pass told to `progress` (`Progress`).

    Unless `exhaustive`, those whose arguments alone exceed `limit` are not compiled
    (their bytes are exact), and the rest are compiled in the order of their estimate
    (`candidate.estimated`'s roofline), each only while it could still beat the best
    that fits, by more than `tolerance` (`TOLERANCE`). For a TPU target with `proxy`,
    the front-runner is compiled first (the next, until one fits); XLA:CPU's figures
    on as many simulated devices (a compile of seconds where XLA:TPU takes tens) then
    correct the estimates of those that could still beat it. Where `compile_each`
    has a `prepare(target, n, head)` that starts the target's first worker on `head`
    beside XLA:CPU's pool (the cores hold both), XLA:CPU ranks every one meanwhile.

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
    guesses: list[float | None] = [
        None if c.estimated is None else c.estimated.estimate(hardware).seconds for c in candidates
    ]
    over = [
        limit is not None and c.estimated is not None and c.estimated.arguments > limit
        for c in candidates
    ]
    if exhaustive:
        found = _told(compile_each, progress, devices, target)(candidates, target, None, None)
        return ranked(
            candidates,
            found,
            devices,
            on,
            limit,
            limit_from,
            dropped,
            guesses=guesses,
            compiler=compiler,
        )
    open_ = sorted(
        (i for i in range(n) if not over[i]),
        key=lambda i: (guesses[i] is not None, guesses[i] or 0.0, i),
    )
    results: list[Cost | str | None] = [None] * n
    proxies: list[Cost | None] = [None] * n
    known: list[tuple[float | None, Cost]] = []  # compiled for the target, with their guesses

    def on_target(order: Sequence[int], rule: Callable[[int, _Bar], bool], first: bool) -> None:
        """Compiles `order` for the target, each while `rule(i, bar)` holds of those
        compiled so far; `first`, the pass that leaves the rest to be ranked."""

        def still(k: int, found: Sequence[Cost | str | None]) -> bool:
            now = [(guesses[order[j]], r) for j, r in enumerate(found) if _compiled(r)]
            return rule(order[k], _Bar([*known, *now], hardware, limit, tolerance))

        each = _told(compile_each, progress, devices, target, deferred=first)
        found = each([candidates[i] for i in order], target, still, None)
        for i, result in zip(order, found):
            results[i] = result
            if _compiled(result):
                known.append((guesses[i], result))

    def rank_on_cpu(chosen: Sequence[int], promising: Wanted) -> None:
        """XLA:CPU's figures of `chosen` on as many simulated devices, each while
        `promising(k, found)`; their guesses are then its (`proxy_guess`)."""
        shared = _SHARED.get()
        cache = {} if shared is None else shared
        keys = [_key(candidates[i], devices) for i in chosen]
        cheap: list[Cost | str | None] = [cache.get(key) for key in keys]
        left = [k for k, found in enumerate(cheap) if found is None]
        if left:  # those not compiled on this count for an earlier slice

            def promising_left(k: int, found: Sequence[Cost | str | None]) -> bool:
                return promising is None or promising(left[k], [*cheap, *found])

            each = _told(compile_each, progress, devices, target)
            fresh = each([candidates[chosen[k]] for k in left], None, promising_left, None)
            for k, found in zip(left, fresh):
                cheap[k] = found
                if found is not None:
                    cache[keys[k]] = found
        for i, found in zip(chosen, cheap):
            if _compiled(found):
                proxies[i] = found
                guesses[i] = proxy_guess(found, candidates[i].estimated, hardware)

    def could_win(i: int, bar: _Bar) -> bool:
        return bar.could_win(guesses[i])

    prepare = getattr(compile_each, "prepare", None)  # `_InWorkers`'s
    ranked_first = proxy and on is not None and len(open_) > 1
    try:
        if (
            ranked_first
            and prepare is not None
            and prepare(target, len(open_), candidates[open_[0]])
        ):
            # the cores hold both: the target's first worker compiles the estimates'
            # front-runner while XLA:CPU ranks them all against the best it has seen

            def promising(k: int, found: Sequence[Cost | str | None]) -> bool:
                seen = [r.estimate(hardware).seconds for r in found if _compiled(r)]
                guess = guesses[open_[k]]
                return guess is None or not seen or guess * (1 - tolerance) < min(seen)

            rank_on_cpu(open_, promising)
        elif ranked_first:
            # one after the other: the target first, in the estimates' order until one
            # fits (every one, where none does: as exhaustive compiles); then XLA:CPU
            # ranks only those the estimates cannot rule out against it
            on_target(open_, lambda i, bar: bar.best is None, first=True)
            bar = _Bar(known, hardware, limit, tolerance)
            if bar.best is not None:
                rank_on_cpu([i for i in open_ if results[i] is None and could_win(i, bar)], None)
        left = [i for i in open_ if results[i] is None]
        order = sorted(left, key=lambda i: (guesses[i] is not None, guesses[i] or 0.0, i))
        on_target(order, could_win, first=False)
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
            compiler=compiler,
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
    deferred: bool = False,
) -> CompileEach:
    """`compile_each`, each pass of it told to `progress`: its start (as it hands out
    its first candidate), each candidate compiled, its end. A pass for no target
    ranks a TPU target's candidates first (`search`'s `proxy`); a `deferred` pass
    leaves those it does not compile to be ranked (`Progress.deferred`)."""
    if progress is None:
        return compile_each
    tell = progress

    def told(chosen: Sequence[Candidate], where: str | None, wanted: Wanted, _: Answered) -> Found:
        if not chosen:
            return compile_each(chosen, where, wanted, None)
        on = where_text(devices, where)
        if where is None and target is not None:
            on = f"{devices} simulated devices with XLA:CPU, ranking them for {target}"
        done = 0
        started = False

        def start() -> None:
            nonlocal started
            if not started:
                started = True
                tell(Progress(0, len(chosen), on))

        def handed(k: int, found: Sequence[Cost | str | None]) -> bool:
            if wanted is not None and not wanted(k, found):
                return False
            start()
            return True

        def answered(k: int) -> None:
            nonlocal done
            done += 1
            tell(Progress(done, len(chosen), on, name_of(chosen[k])))

        if wanted is None:
            start()
        found = compile_each(chosen, where, None if wanted is None else handed, answered)
        compiled = sum(r is not None for r in found)
        tell(Progress(compiled, len(chosen), on, finished=True, deferred=deferred))
        return found

    return told
