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

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from jaxtyping import PyTree

from .._cost._driver import compiler_label, unplaced
from .._cost._hardware import memory_size
from .._cost._targets import compile_target
from .._errors import EqshardError, UsageError, whole_number
from .._process._pickles import pickled
from .._sharding import device_tuple
from ._candidates import candidates
from ._policy import TOLERANCE, search
from ._pool import cost_one, in_workers
from ._ranked import GIVEN, HBM, Progress, Ranked, Suggestion

if TYPE_CHECKING:
    from .._cost._results import Cost
    from .._cost._targets import CompileTarget
    from .._sharding import Devices
    from ._candidates import Candidate
    from ._pool import Answered, Found, Wanted

__all__ = [
    "Ranked",  # `eqshard.results.Ranked` and `eqshard.results.Suggestion` are read from here
    "Suggestion",
    "memory_limit",
    "placement",
    "rank",
    "suggest",
]


class Placed(NamedTuple):
    """Where `suggest`'s candidates compile: the device count, the TPU slice (if any),
    and this process's devices to compile on here (`None`: simulated, in workers)."""

    size: int
    target: CompileTarget | None
    devices: tuple[Any, ...] | None


def placement(
    devices: Devices, simulate: int | None, target: str | None, *, stacklevel: int = 3
) -> Placed:
    """Where the candidates compile: `devices=` (this process's: a count, the first
    that many, or a list), `simulate=` (a count of simulated devices) or `target=`.

    A count `devices=n` over this process's devices keeps its old meaning, simulated
    devices, with a `DeprecationWarning` pointing `stacklevel` frames up.

    **Raises:** `UsageError` for `devices` with `simulate`; `EqshardError` for a
    target with either, for none of the three, or a count that is no whole number;
    what `compile_target` raises for the slice.
    """
    if devices is not None and simulate is not None:
        raise UsageError(
            f"`devices={devices!r}` (this process's devices) and `simulate={simulate!r}` "
            "(devices it does not have) are both given: pass one of them"
        )
    if target is not None:
        given = next(
            (
                f"{k}={v!r}"
                for k, v in (("devices", devices), ("simulate", simulate))
                if v is not None
            ),
            None,
        )
        if given is not None:
            raise EqshardError(
                f"`{given}` and `target={target!r}` are both given; the slice has its "
                "devices: give one of them"
            )
        on = compile_target(target)
        return Placed(len(on.devices), on, None)
    if devices is None and simulate is None:
        raise EqshardError(
            "give `simulate=` (how many simulated devices to compile each candidate on, "
            "in worker processes), `devices=` (this process's devices, to compile on here) "
            "or `target=` (a TPU slice, such as 'v5p:4x4x4')"
        )
    if simulate is not None:
        return Placed(whole_number(simulate, "`simulate`"), None, None)
    if not isinstance(devices, (int, np.integer)):
        listed = device_tuple(devices)
        return Placed(len(listed), None, listed)
    n = whole_number(devices, "`devices`")
    import jax

    here = jax.local_devices()
    if n > len(here):
        warnings.warn(
            f"`devices={n}` means {n} of this process's devices, and it has {len(here)}: "
            f"pass `simulate={n}` to lay out (or compile) for {n} devices it does not have",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        return Placed(n, None, None)
    return Placed(n, None, tuple(here[:n]))


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


def rank(
    candidates: Sequence[Candidate],
    step: Any,
    model: Any,
    *args: Any,
    devices: Devices = None,
    simulate: int | None = None,
    target: str | None = None,
    max_memory: int | str | None = None,
    workers: int | None = None,
    dropped: Sequence[tuple[str, str]] = (),
    exhaustive: bool = False,
    tolerance: float = TOLERANCE,
    progress: Callable[[Progress], None] | None = None,
) -> Ranked:
    """Costs the candidates by compiling the user's step under their rules, and ranks
    them: those the estimates cannot rule out, or every one with `exhaustive`.

    **Example:**

    ```python
    ranked = rank(candidates, step, model, opt_state, batch, simulate=8, max_memory="16GiB")
    print(ranked)          # the table
    ranked.best.rules      # the fastest that fits
    ```

    **Arguments:**

    - `candidates`: the `Candidate`s to cost.
    - `step`, `model`, `*args`: as for `eqshard.cost`, concrete or abstract: they
        travel to the workers abstract, once per worker.
    - `devices`: compile each candidate here, on this process's devices: a count (the
        first that many) or a list.
    - `simulate`: or in workers, on this many simulated CPU devices (XLA:CPU, whose
        peak is what XLA:CPU allocates: `Memory.peak`).
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

    `UsageError` for `devices` with `simulate`; `EqshardError` for a `target` with
    either, or none of the three, for `devices` with `workers`, for a
    `max_memory` that is no size, for a `target` that is no TPU slice (`UsageError`
    without libtpu), and when the step or its arguments cannot cross to a worker (a
    worker's own trouble, such as a step module it cannot import, too). A candidate
    that fails to compile is no error: it is listed with its message.
    """
    n, on, listed = placement(devices, simulate, target)
    limit, limit_from = memory_limit(max_memory, on)
    if workers is not None:
        workers = whole_number(workers, "`workers`", 0)
    if listed is not None and workers:
        raise EqshardError(
            f"`devices` are this process's devices and `workers={workers}` compiles in "
            f"worker processes: worker processes cannot hold them; pass `simulate={n}` to "
            f"compile on {n} simulated devices in workers, or leave `workers` out"
        )
    if workers == 0 or listed is not None:
        on_devices = listed if listed is not None else n

        def compile_here(
            chosen: Sequence[Candidate], where: str | None, wanted: Wanted, answered: Answered
        ) -> Found:
            found: list[Cost | str | None] = [None] * len(chosen)
            for k, c in enumerate(chosen):
                if wanted is None or wanted(k, found):
                    found[k] = cost_one(step, model, args, c.rules, on_devices, where)
                    if answered is not None:
                        answered(k)
            return found

        if listed is None:  # a count, compiled on this process's first devices
            import jax

            listed = tuple(jax.local_devices()[:n])
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
            compiler=compiler_label(listed, n),  # where none compiles to say whose
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


def suggest(
    model: PyTree[Any],
    *args: PyTree[Any],
    step: Callable[..., Any],
    devices: Devices = None,
    simulate: int | None = None,
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
    ranked = eqshard.suggest(model, opt_state, batch, step=step, simulate=64, max_memory="80GB")
    print(ranked)                                  # strategy, mesh, memory, fits, ...
    ranked[0].rules                                # a Rules, with a comment per rule
    ranked[0].cost                                 # the Cost it was ranked by
    eqshard.dump(ranked[0].rules, "best.eqshard.json")
    ```

    **Arguments:**

    - `model`: the model, concrete or abstract (`eqx.filter_eval_shape`).
    - `*args`: the step's other arguments (`eqx.nn.State`, optimizer state, batch).
    - `step`: the training step, called as `step(model, *args)`, as `eqshard.cost` takes it.
    - `devices`: this process's devices to compile on, here: a count (the first n) or a list.
    - `simulate`: or a count of simulated XLA:CPU devices to compile on, in workers.
    - `target`: or a TPU slice (`"v5p:4x4x4"`), compiled for by XLA:TPU through libtpu.
    - `max_memory`: memory per device, bytes or a size (`"80GB"`); by default the chip's HBM.
    - `workers`: compile workers at once (by default one per core); `0` compiles here.
    - `exhaustive`: compile every candidate, none ruled out by its estimate.
    - `strategies`: the strategies to try (`["fsdp", "data x tensor"]`); by default all.
    - `tolerance`: how near the best compiled one an estimate must be to compile (0.02).
    - `progress`: called with a `Progress` as each pass of compiles starts, goes and ends.

    **Returns:**

    A `Ranked`, best first: those that fit by their roofline estimate (on the target's
    chip, else an H100), then those not compiled, those that do not fit, and the failures.

    **Raises:**

    - `eqshard.UsageError`: `devices` with `simulate`, or a `target` without libtpu.
    - `eqshard.EqshardError`: a `target` with either or none of the three, a
        `max_memory` that is no size, a `target` that is no TPU slice, an unknown
        strategy, or a step or arguments that cannot be sent to a worker.

    A `devices=n` over this process's device count keeps its old meaning, `simulate=n`,
    with a `DeprecationWarning`. The [suggest guide](../suggest-and-diff.md) says which
    compiler runs where, how the estimates rule candidates out, and what the workers do.
    """
    n, on, listed = placement(devices, simulate, target)
    kept, dropped = candidates(step, model, *args, devices=n, strategies=strategies)
    return rank(
        kept,
        step,
        model,
        *args,
        devices=listed,
        simulate=None if listed is not None or on is not None else n,
        target=target,
        max_memory=max_memory,
        workers=workers,
        dropped=dropped,
        exhaustive=exhaustive,
        tolerance=tolerance,
        progress=progress,
    )
