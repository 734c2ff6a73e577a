"""Which candidates `suggest` compiles: `search` rules out, without compiling, a
candidate whose arguments alone exceed the limit, ranks the rest by their estimate
(for a TPU target, by XLA:CPU's figures on as many simulated devices first), and
compiles each for the target only while it could beat the best that fits, by more
than `tolerance` (`TOLERANCE`), or every one (`exhaustive`)."""

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
        return ranked(
            candidates,
            results,
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
    try:
        proxies: list[Cost | None] = [None] * n
        if proxy and on is not None and len(open_) > 1:
            prepare = getattr(compile_each, "prepare", None)
            if prepare is not None:  # the target's workers start while XLA:CPU compiles,
                # the first compiling the estimates' front-runner for the target at once
                prepare(target, len(open_), candidates[open_[0]])

            # XLA:CPU's figures, while a candidate's estimate could beat the best of them
            def promising(k: int, found: Sequence[Cost | str | None]) -> bool:
                guess = guesses[open_[k]]
                seen = [r.estimate(hardware).seconds for r in found if _compiled(r)]
                return guess is None or not seen or guess * (1 - tolerance) < min(seen)

            shared = _SHARED.get()
            known = {} if shared is None else shared
            keys = [_key(candidates[i], devices) for i in open_]
            cheap: list[Cost | str | None] = [known.get(key) for key in keys]
            left = [k for k, found in enumerate(cheap) if found is None]
            if left:  # those not compiled on this count for an earlier slice
                seen = [r for r in cheap if _compiled(r)]

                def promising_left(k: int, found: Sequence[Cost | str | None]) -> bool:
                    return promising(left[k], [*seen, *found])

                fresh = compile_each(
                    [candidates[open_[k]] for k in left], None, promising_left, None
                )
                for k, found in zip(left, fresh):
                    cheap[k] = found
                    if found is not None:
                        known[keys[k]] = found
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
        on = where_text(devices, where)
        if where is None and target is not None:
            on = f"{devices} simulated devices with XLA:CPU, ranking them for {target}"
        done = 0

        def answered(k: int) -> None:
            nonlocal done
            done += 1
            tell(Progress(done, len(chosen), on, name_of(chosen[k])))

        tell(Progress(0, len(chosen), on))
        found = compile_each(chosen, where, wanted, answered)
        tell(Progress(sum(r is not None for r in found), len(chosen), on, finished=True))
        return found

    for name in ("prepare", "close"):  # `_InWorkers`'s, where it has them
        if hasattr(compile_each, name):
            setattr(told, name, getattr(compile_each, name))
    return told
