"""Pipeline stages: `eqshard.parallel.pipeline`, a drop-in for the `jax.lax.scan` over a stack
of layers that runs microbatches through stages held by the devices of one mesh axis.

The stages are a layout like any other. The stacked layers' leading axis is split
over a mesh axis (`"stage"`), by a rule or a logical dim, so each stage's devices
hold only its layers. `pipeline` then runs the layers in place, in SPMD, as MaxText's
pipeline does: a buffer with one slot per stage, split over `"stage"` like the
layers, holds the microbatch each stage is working on. Each iteration every stage
applies its layers to its slot (`jax.vmap` over the stages), then the buffer shifts
one stage down (`jnp.concatenate`), which XLA makes one `collective-permute` over
`"stage"` of one microbatch's activations. The gradient is JAX's: the transposed
scan runs the same shifts backwards. Other mesh axes (data, FSDP, tensor) are left
to the compiler, as everywhere else: the buffer's other axes are unconstrained.

Schedules:

- `"gpipe"`: stage `s` holds layers `[s K, (s + 1) K)` of a stack of `S K`; the
    microbatches enter one per iteration, `M + S - 1` iterations in all, `S - 1` of
    them part idle: the bubble, `(S - 1) / (M + S - 1)` of each stage's time.
- `"circular"`: the layers stacked `(R, S, ...)`, `R` rounds of `S` stages, layer
    `r S + s` on stage `s` (MaxText's circular pipeline). A microbatch goes round the
    stages `R` times; with `M >= S` microbatches the rounds follow each other with no
    gap, `R M + S - 1` iterations, the bubble `(S - 1) / (R M + S - 1)`.

Idle slots compute on a copy of the first microbatch, so a layer never sees values it
was not written for (zeros can make a norm divide by zero), and their results are
never read. With no mesh that splits `"stage"`, `pipeline` is the plain scan, in the
layers' order, so model code that calls it runs anywhere.

While `eqshard.cost` (or `suggest`) traces a step, each call records its schedule
(`recording`), so the cost can report the bubble.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._activations import active_mesh
from ._constrain import constrained
from ._errors import EqshardError, whole_number
from ._sharding import AnyMesh

__all__ = [
    "MARKED",
    "SCHEDULES",
    "Schedule",
    "Stages",
    "bubble",
    "marking",
    "pipeline",
    "recording",
]

Schedule = Literal["gpipe", "circular"]
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "circular")
"""The schedules `pipeline` runs."""


@dataclasses.dataclass(frozen=True)
class Stages:
    """One pipeline a step runs, as `pipeline` saw it while the step was traced:
    `eqshard.cost` gives them as `Cost.pipelines`.

    **Example:**

    ```python
    (stages,) = eqshard.cost(model, opt_state, batch, step=step, spec=rules).pipelines
    stages.bubble        # 3 / 11: 4 stages, 8 microbatches, GPipe
    ```

    **Attributes:**

    - `axis`: the mesh axis of the stages; `stages`: its size.
    - `microbatches`: how many; `rounds`: how many times a microbatch goes round the
        stages (1 for GPipe).
    - `schedule`: `"gpipe"` or `"circular"`.
    - `layers`: the stacked layers, all stages together.
    - `iterations`: how many steps of the pipeline's loop: `rounds x microbatches +
        stages - 1`.
    """

    axis: str
    stages: int
    microbatches: int
    rounds: int
    schedule: Schedule
    layers: int

    def __post_init__(self) -> None:
        for what in ("stages", "microbatches", "rounds", "layers"):
            whole_number(getattr(self, what), f"`Stages.{what}`")
        if self.schedule not in SCHEDULES:
            raise EqshardError(
                f"`Stages.schedule` is one of {', '.join(map(repr, SCHEDULES))}, not "
                f"{self.schedule!r}"
            )

    @property
    def iterations(self) -> int:
        """The steps of the pipeline's loop."""
        return self.rounds * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The fraction of each stage's time it waits, forward and backward alike."""
        return bubble(self.stages, self.microbatches, self.schedule, self.rounds)

    def picture(self) -> str:
        """The forward schedule as text: a row per stage, a column per step of the
        loop, each cell the microbatch the stage works on (and, for the circular
        schedule, its round as letters: `3b` is microbatch 3's second round, `3aa` its
        27th), `.` where it idles. The gradient runs the same steps backwards."""
        items = self.rounds * self.microbatches
        cells = []
        for s in range(self.stages):
            row = []
            for t in range(self.iterations):
                i = t - s
                if 0 <= i < items:
                    m, r = i % self.microbatches, i // self.microbatches
                    row.append(f"{m}{_round_letters(r)}" if self.rounds > 1 else str(m))
                else:
                    row.append(".")
            cells.append(row)
        width = max(len(str(self.iterations - 1)), *(len(c) for row in cells for c in row))
        labels = ["step", *(f"stage {s}" for s in range(self.stages))]
        label = max(map(len, labels))
        rows = [[str(t) for t in range(self.iterations)], *cells]
        return "\n".join(
            f"{name:<{label}} " + " ".join(f"{c:>{width}}" for c in row)
            for name, row in zip(labels, rows)
        )


def _round_letters(r: int) -> str:
    """Round `r` (from 0) as letters, as spreadsheets name columns: `a` to `z`, then
    `aa`, `ab`, ..."""
    letters = ""
    r += 1
    while r:
        r, digit = divmod(r - 1, 26)
        letters = "abcdefghijklmnopqrstuvwxyz"[digit] + letters
    return letters


def bubble(stages: int, microbatches: int, schedule: Schedule = "gpipe", rounds: int = 1) -> float:
    """The fraction of each stage's time in the schedule's bubble: `(S - 1) / (M + S -
    1)` for GPipe, `(S - 1) / (R M + S - 1)` for the circular schedule of `R` rounds.

    **Example:**

    ```python
    bubble(4, 8)                          # 3 / 11
    bubble(4, 8, "circular", rounds=2)    # 3 / 19
    ```

    **Arguments:**

    - `stages`: the stages, `S`.
    - `microbatches`: the microbatches, `M`.
    - `schedule`: `"gpipe"` or `"circular"`.
    - `rounds`: for the circular schedule, how many times a microbatch goes round.

    **Returns:**

    A fraction from 0 (no bubble) to 1.
    """
    if schedule == "gpipe":
        rounds = 1
    return (stages - 1) / (rounds * microbatches + stages - 1)


_RECORDING: contextvars.ContextVar[list[Stages] | None] = contextvars.ContextVar(
    "eqshard_pipelines", default=None
)
_MARKING: contextvars.ContextVar[bool] = contextvars.ContextVar("eqshard_marking", default=False)

MARKED = "eqshard.parallel.pipeline."
"""The prefix of the `checkpoint_name` each stacked layer leaf carries while `suggest`
traces a step (`marking`), then its stack's depth, schedule, microbatch count, stage
axis, batch axis and batch, `"eqshard.parallel.pipeline.1:gpipe:8:stage:data:16"`: how
`suggest`'s jaxpr walk finds the model's leaves a pipeline runs, and so which leaves
its pipeline family splits into stages."""


@contextlib.contextmanager
def marking() -> Iterator[None]:
    """Marks the stacked layers of each pipeline traced inside (`MARKED`)."""
    token = _MARKING.set(True)
    try:
        yield
    finally:
        _MARKING.reset(token)


@contextlib.contextmanager
def recording() -> Iterator[list[Stages]]:
    """Records each pipeline the code traced inside runs (`Stages`), for `cost`."""
    found: list[Stages] = []
    token = _RECORDING.set(found)
    try:
        yield found
    finally:
        _RECORDING.reset(token)


def pipeline(
    layer: Callable[[Any, Any], Any],
    layers: PyTree[Any],
    x: PyTree[Any],
    *,
    microbatches: int,
    schedule: Schedule = "gpipe",
    axis: str = "stage",
    batch_axis: str | None = None,
    mesh: AnyMesh | None = None,
) -> Any:
    """Runs `x` through a stack of layers, as `jax.lax.scan` would, with the stack's
    stages on the devices of a mesh axis and the batch in microbatches.

    **Example:**

    ```python
    class Model(eqx.Module):
        blocks: Block        # stacked by eqx.filter_vmap: every leaf (layers, ...)

        def __call__(self, x):                       # x: (batch, seq, embed)
            # was: params, static = eqx.partition(self.blocks, eqx.is_array)
            #      x, _ = jax.lax.scan(lambda x, p: (eqx.combine(p, static)(x), None), x, params)
            return eqshard.parallel.pipeline(lambda block, x: block(x), self.blocks, x, microbatches=8)
    ```

    with a spec that splits the layer axis over `stage`, such as the rule
    `{"path": "blocks.**", "expr": "l ... -> l* ..."}` on the mesh `[["stage", 4],
    ["data", "*"]]`.

    **Arguments:**

    - `layer`: `layer(one_layer, x) -> x`, applying one layer of the stack (the
        stack's structure, each array leaf without its stacked axes) to a microbatch.
    - `layers`: the stacked layers: a pytree (an Equinox module) whose array leaves
        have a leading axis of the layers, `(layers, ...)` for GPipe, or two,
        `(rounds, stages, ...)`, for the circular schedule.
    - `x`: the input, an array or a pytree of arrays with the batch leading.
    - `microbatches`: how many microbatches the batch is cut into; it must divide the
        batch. Microbatch `m` takes rows `m, m + M, m + 2M, ...`, so a batch split
        over `data` splits each microbatch the same way.
    - `schedule`: `"gpipe"` or `"circular"` (see the module's docs).
    - `axis`: the mesh axis that holds the stages.
    - `batch_axis`: the mesh axis the batch is split over (`"data"`), where each layer
        computes each row on its own: the weights' gradients are then summed over it
        once per step, not in every step of the loop (the guide "Pipeline stages").
    - `mesh`: the mesh; by default the active plan's (`eqshard.use`), the mesh of
        `jax.set_mesh`, or the active rules' declared mesh.

    **Returns:**

    What the plain scan returns: `x` after every layer, in the stack's order
    (row-major for the circular schedule's two axes).

    **Raises:**

    `eqshard.EqshardError` for a schedule it does not know, a microbatch count that
    does not divide the batch (or, under the circular schedule, is below the stage
    count), or a stack or microbatch that does not divide over its mesh axis.
    """
    if schedule not in SCHEDULES:
        raise EqshardError(
            f"`eqshard.parallel.pipeline` has no schedule {schedule!r}; the schedules are "
            f"{', '.join(map(repr, SCHEDULES))}"
        )
    params, static = eqx.partition(layers, eqx.is_array)
    leaves = jax.tree_util.tree_leaves(params)
    if not leaves:
        raise EqshardError(
            "`eqshard.parallel.pipeline` takes stacked layers, and these hold no array"
        )
    depth = 2 if schedule == "circular" else 1
    stack = _stack_shape(leaves, depth, schedule)
    microbatches = whole_number(microbatches, "`eqshard.parallel.pipeline`'s `microbatches`")
    batch = _batch_size(x)
    if batch % microbatches:
        raise EqshardError(
            f"`eqshard.parallel.pipeline` cuts a batch of {batch} into {microbatches} microbatches, "
            "which does not divide it; give a microbatch count that divides the batch"
        )
    found = active_mesh(mesh)
    stages = 1 if found is None or axis not in found.axis_names else found.shape[axis]

    def apply(x: Any, p: Any) -> tuple[Any, None]:
        return layer(eqx.combine(p, static), x), None

    if stages == 1:  # no pipeline mesh: the plain scan, in the stack's order
        if _MARKING.get():
            label = f"{MARKED}{depth}:{schedule}:{microbatches}:{axis}:{batch_axis or ''}:{batch}"
            params = jax.tree_util.tree_map(lambda a: checkpoint_name(a, label), params)
        flat = jax.tree_util.tree_map(lambda a: a.reshape(-1, *a.shape[depth:]), params)
        return jax.lax.scan(apply, x, flat)[0]
    assert found is not None
    n_layers = stack[0] * (stack[1] if depth == 2 else 1)
    if schedule == "circular":
        rounds = stack[0]
        if stack[1] != stages:
            raise EqshardError(
                f"`eqshard.parallel.pipeline`'s circular schedule takes layers stacked (rounds, "
                f"stages, ...), and these are stacked {list(stack)} on a mesh whose "
                f"{axis!r} has {stages} devices; stack them ({n_layers // stages}, {stages})"
            )
        if microbatches < stages:
            raise EqshardError(
                f"`eqshard.parallel.pipeline`'s circular schedule needs at least as many "
                f"microbatches as stages ({stages}), and is given {microbatches}"
            )
    else:
        rounds = 1
        if stack[0] % stages:
            raise EqshardError(
                f"`eqshard.parallel.pipeline` splits {stack[0]} stacked layers over {stages} stages "
                f"({axis!r}), which does not divide them"
            )
    record = _RECORDING.get()
    if record is not None:
        record.append(Stages(axis, stages, microbatches, rounds, schedule, n_layers))
    copies = 1 if batch_axis is None else dict(found.shape).get(batch_axis, 1)
    rows = batch // microbatches
    if copies > 1 and rows % copies:
        raise EqshardError(
            f"`eqshard.parallel.pipeline` splits each microbatch's {rows} rows over {batch_axis!r} "
            f"({copies} devices), which does not divide them; give fewer microbatches, "
            "or batch_axis=None"
        )

    def staged(mesh: AnyMesh, params: Any, x: Any) -> Any:
        """The pipeline on `mesh`, whose axes are Auto."""
        on = _Stage(mesh, axis, stages)
        if schedule == "circular":  # (rounds, stages, ...) -> (stages, rounds, ...)
            by_stage = jax.tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), params)
        else:  # (layers, ...) -> (stages, layers per stage, ...)
            by_stage = jax.tree_util.tree_map(
                lambda a: a.reshape(stages, a.shape[0] // stages, *a.shape[1:]), params
            )
        by_stage = on.split(by_stage)

        def stage(p: Any, x: Any, r: Any) -> Any:
            """One stage's work on its slot: its layers (GPipe), or its round's layer."""
            if schedule == "circular":
                return apply(x, jax.tree_util.tree_map(lambda a: a[r], p))[0]
            return jax.lax.scan(apply, x, p)[0]

        run = stage
        if copies > 1:  # each `batch_axis` device its rows, with its own copy of the layers
            assert batch_axis is not None
            by_stage = on.held(  # (stages, copies, ...): the copies over the batch's axis
                jax.tree_util.tree_map(
                    lambda a: jnp.broadcast_to(a[:, None], (a.shape[0], copies, *a.shape[1:])),
                    by_stage,
                ),
                axis,
                batch_axis,
            )
            run = functools.partial(_by_rows, stage, copies)
        cut = on.whole(_microbatches(x, microbatches))  # every leaf (M, batch / M, ...)
        every = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (stages, *a.shape)), cut)
        slots = on.split(jax.tree_util.tree_map(lambda a: a[:, 0], every))
        # each stage's own buffers, by microbatch: what it finished (`out`), and for the
        # circular schedule what came round to it (`back`); only the last stage's `out`
        # and the first stage's `back` are read
        out = back = on.split(every)
        index = jnp.arange(stages)

        def each(rows: Any, at: Any) -> Any:
            """Row `at[s]` of each stage's buffer `rows[s]`."""
            return jax.tree_util.tree_map(lambda b: jax.vmap(lambda b, i: b[i])(b, at), rows)

        def put(rows: Any, at: Any, values: Any) -> Any:
            return jax.tree_util.tree_map(
                lambda b, v: jax.vmap(lambda b, i, v: b.at[i].set(v))(b, at, v), rows, values
            )

        def step(carry: Any, t: Any) -> tuple[Any, None]:
            slots, out, back = carry
            # every stage's slot to the next stage; the last stage's comes round to the first
            rotated = on.split(jax.tree_util.tree_map(lambda a: jnp.roll(a, 1, axis=0), slots))
            if schedule == "circular":  # came round: item t - S, for its next round
                back = put(back, jnp.full_like(index, (t - stages) % microbatches), rotated)
            m = jnp.full_like(index, t % microbatches)
            fresh = each(every, m)
            if schedule == "circular":  # past the first round, what came round to it
                fresh = jax.tree_util.tree_map(
                    lambda a, b: jnp.where(t < microbatches, a, b), fresh, each(back, m)
                )
            slots = jax.tree_util.tree_map(  # the first stage takes the fresh microbatch
                lambda f, r: jnp.where((index == 0).reshape(-1, *[1] * (r.ndim - 1)), f, r),
                fresh,
                rotated,
            )
            rounds_now = jnp.clip((t - index) // microbatches, 0, rounds - 1)
            slots = on.split(jax.vmap(run)(by_stage, on.split(slots), rounds_now))
            out = put(out, (t - index) % microbatches, slots)  # each stage its own item's
            return (slots, out, back), None

        iterations = rounds * microbatches + stages - 1
        (_, out, _), _ = jax.lax.scan(step, (slots, out, back), jnp.arange(iterations))
        return _whole(jax.tree_util.tree_map(lambda a: a[stages - 1], out))

    if any(kind == AxisType.Explicit for kind in getattr(found, "axis_types", ())):
        # JAX's sharding-in-types mode: the pipeline runs on Auto axes inside (as
        # `eqshard.jit` runs a step), its result laid out as `x` is
        auto = found.update(axis_types=(AxisType.Auto,) * len(found.axis_names))
        specs = jax.tree_util.tree_map(lambda a: jax.typeof(a).sharding.spec, x)
        inside: Callable[..., Any] = jax.sharding.auto_axes(
            lambda p, y: staged(auto, p, y), out_sharding=specs
        )
        return inside(params, x)
    return staged(found, params, x)


def _by_rows(stage: Callable[..., Any], copies: int, p: Any, x: Any, r: Any) -> Any:
    """`stage` on each of `copies` parts of the slot's rows, each with its own copy of
    the layers (`p`: `(copies, ...)`), whose gradients stay apart until the copies are
    summed, once, outside the loop."""
    parts = jax.tree_util.tree_map(lambda a: a.reshape(copies, -1, *a.shape[1:]), x)
    out = jax.vmap(stage, in_axes=(0, 0, None))(p, parts, r)
    return jax.tree_util.tree_map(lambda a: a.reshape(-1, *a.shape[2:]), out)


class _Stage:
    """Holds a value's leading axes to mesh axes, the others left free."""

    def __init__(self, mesh: AnyMesh, axis: str, stages: int) -> None:
        self.mesh, self.axis, self.stages = mesh, axis, stages

    def split(self, tree: Any) -> Any:
        """The leading axis over the stages."""
        return self.held(tree, self.axis)

    def whole(self, tree: Any) -> Any:
        """The leading axis whole on every stage."""
        return self.held(tree, None)

    def held(self, tree: Any, *lead: str | None) -> Any:
        """The leading axes over `lead`'s mesh axes (`None`: whole), the rest free."""
        leaves, structure = jax.tree_util.tree_flatten(tree)
        free = PartitionSpec.UNCONSTRAINED
        shardings = [
            NamedSharding(
                self.mesh,  # pyright: ignore[reportArgumentType]
                PartitionSpec(*lead, *[free] * (a.ndim - len(lead))),
            )
            for a in leaves
        ]
        return jax.tree_util.tree_unflatten(structure, constrained(leaves, shardings))


def _stack_shape(leaves: list[Any], depth: int, schedule: str) -> tuple[int, ...]:
    shapes = {tuple(a.shape[:depth]) for a in leaves}
    if len(shapes) != 1 or any(a.ndim < depth for a in leaves):
        what = "a leading axis of layers" if depth == 1 else "two leading axes (rounds, stages)"
        raise EqshardError(
            f"`eqshard.parallel.pipeline`'s {schedule} schedule takes layers whose array leaves "
            f"all have {what}, and these lead with {sorted(shapes)}; stack them with "
            "eqx.filter_vmap"
        )
    return shapes.pop()


def _batch_size(x: Any) -> int:
    leaves = jax.tree_util.tree_leaves(x)
    scalars = [a for a in leaves if getattr(a, "ndim", 0) == 0]
    if scalars:
        raise EqshardError(
            "`eqshard.parallel.pipeline` takes an input whose arrays all lead with the batch, and "
            f"{len(scalars)} of its leaves {'is a scalar' if len(scalars) == 1 else 'are scalars'}"
            ", with no batch to cut into microbatches; pass such a value to the layer "
            "function by closure"
        )
    sizes = {a.shape[0] for a in leaves}
    if len(sizes) != 1:
        raise EqshardError(
            "`eqshard.parallel.pipeline` takes an input whose arrays all lead with the batch, and "
            f"these lead with {sorted(sizes)}"
        )
    return sizes.pop()


def _microbatches(x: Any, m: int) -> Any:
    """Every leaf `(batch, ...)` as `(m, batch / m, ...)`, microbatch `i` the rows `i,
    i + m, ...`: a batch split over `data` splits each microbatch so."""
    return jax.tree_util.tree_map(
        lambda a: jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1), x
    )


def _whole(done: Any) -> Any:
    """The microbatches `(m, batch / m, ...)` back as the batch, in its order."""
    return jax.tree_util.tree_map(
        lambda a: jnp.swapaxes(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:]), done
    )
