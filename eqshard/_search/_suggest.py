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

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._cost._driver import unplaced
from .._cost._hardware import memory_size
from .._cost._targets import compile_target
from .._errors import EqshardError, whole_number
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
    "Ranked",  # `eqshard.Ranked` and `eqshard.Suggestion` are read from here
    "Suggestion",
    "memory_limit",
    "placement",
    "rank",
    "suggest",
]


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
                    found[k] = cost_one(step, model, args, c.rules, on_devices, where)
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
