"""`eqshard demo`: one small GPT, trained under each parallelism strategy.

The model is built from `eqx.nn` modules (`Embedding`, `LayerNorm`,
`MultiheadAttention`, `Linear`); its blocks are stacked with `eqx.filter_vmap` and
run with `jax.lax.scan`. It is trained with AdamW for a few steps on a fixed batch
of deterministic random tokens (next-token prediction), once unsharded on one device
as the reference, then once per spec file in `demo_specs/` (a link to
`examples/specs/demo/`): data parallel, ZeRO-1 (parameters replicated, the AdamW
moments split over `data` by the file's `"optimizer"` section), FSDP-style, Megatron
tensor parallel, and 2D. Each run lays out the model and the optimizer state by the
spec's plan (the state by its optimizer section, where it has one), the batch
over the mesh's `data` axis, and keeps every layout through the step; `eqshard.cost`
compiles the same step over the same layouts to say what it holds and moves per
device. The table compares them, final loss against the reference's.

Three more rows train variants of the same GPT (`_model.Variant`), each against
its own unsharded run: `expert-parallel`, a GPT whose MLPs are 8 experts (`MOE`),
each device holding its own expert; `context-parallel`, the GPT on sequences of 128
(`LONG`), each device holding a quarter of each sequence; and `pipeline`, a 4-layer
GPT whose layers `eqshard.parallel.pipeline` runs in 4 stages of 8 microbatches
(`PIPELINE`), each stage's devices holding its layer.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._activations import use
from .._apply import apply
from .._arguments import batch_sharding, data_parallel
from .._cost._driver import cost
from .._cost._results import Cost
from .._errors import EqshardError, UnreadableError
from .._fit import mesh_text
from .._plan import Plan, plan
from .._problems import Problem
from .._report import human_bytes
from .._specfile._model import BatchRules, Rules
from .._specfile._read import load
from .._step import jit
from ._model import (
    GPT,
    GPT_VARIANT,
    LAYERS,
    LONG,
    MOE,
    PIPELINE,
    AdamState,
    Variant,
    adamw_init,
    adamw_update,
    build,
    loss,
    tokens,
)

__all__ = [
    "SPECS",
    "STRATEGIES",
    "TOLERANCE",
    "VARIANTS",
    "Outcome",
    "batch_expression",
    "communication",
    "demo_devices",
    "fits",
    "main",
    "make_step",
    "per_step",
    "reference",
    "run",
    "spec_path",
    "table",
    "to_json",
    "variant_of",
]


SPECS = Path(__file__).parent.parent / "demo_specs"
"""The strategies' spec files: `eqshard/demo_specs`, a link to `examples/specs/demo`."""

STRATEGIES = (
    "data-parallel",
    "zero-1",
    "fsdp",
    "megatron",
    "2d",
    "expert-parallel",
    "context-parallel",
    "pipeline",
)
"""The strategies the demo runs by default, in order: `SPECS / f"{name}.eqshard.json"`."""

VARIANTS: dict[str, Variant] = {
    "expert-parallel": MOE,
    "context-parallel": LONG,
    "pipeline": PIPELINE,
}
"""The strategies that train a variant of the GPT, and which; the others train the
GPT itself (`GPT_VARIANT`), as does a user's own spec file."""


def variant_of(name: str) -> Variant:
    """The model a strategy (or a user's spec file, by its path) trains."""
    return VARIANTS.get(name, GPT_VARIANT)


TOLERANCE = 1e-5
"""The largest relative difference from the unsharded losses that counts as equal.

Not exact equality: a sharded step sums the same numbers in another order (partial
sums on each device, then a collective), so its float32 results differ from the
unsharded ones in the last bits, and AdamW carries such differences into the next
steps. Over the default 8 steps on 8 CPU devices they stay within 3e-6 (measured);
1e-5 leaves room for other backends' reduction orders (both runs use the highest
matmul precision), and is far below what a wrong layout (a missing all-reduce, a
misplaced shard) does to a loss: 1e-2 or more.
"""


def make_step() -> Callable[..., Any]:
    """The training step, `step(model, state, batch) -> (loss, model, state)`, under
    `eqshard.jit`: it names no plan, and under `eqshard.use(plan)` every leaf leaves
    it laid out as it came in, the program `eqshard.cost` compiles for that plan.

    **Example:**

    ```python
    step = make_step()
    with eqshard.use(p):
        value, model, state = step(model, state, batch)
    ```

    **Returns:**

    The step.
    """

    @jit
    def step(model: GPT, state: AdamState, batch: Int[Array, "batch seq_plus_1"]):
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, state = adamw_update(grads, state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return value, model, state

    return step


def spec_path(name: str) -> Path:
    """The spec file of a strategy: `"fsdp"` is `SPECS / "fsdp.eqshard.json"`, and
    anything else is taken as a path to the user's own spec for the demo's model.

    **Example:**

    ```python
    spec_path("megatron").name   # 'megatron.eqshard.json'
    ```

    **Arguments:**

    - `name`: one of `STRATEGIES`, or a path.

    **Returns:**

    The file's path (not checked to exist: `eqshard.load` says so).
    """
    return SPECS / f"{name}.eqshard.json" if name in STRATEGIES else Path(name)


def batch_expression(p: Plan) -> str:
    """How the batch is laid out under a plan: as its spec file's `"batch"` says (an
    expression, or a section's rule for the batch's one array, whose path is empty, else
    its default; `eqshard.cost` lays it out so too); else its leading dim split over a mesh axis
    named `data` when the spec's mesh starts with one (as `eqshard.cost` lays out a
    batch by default), else a full copy on every device.

    **Example:**

    ```python
    batch_expression(plan(model, load(spec_path("2d"))))   # 'b ... -> b2 ... 4'
    ```

    **Arguments:**

    - `p`: the plan of the model.

    **Returns:**

    An einshard expression for the batch.
    """
    declared = p.spec.batch if isinstance(p.spec, Rules) else None
    if isinstance(declared, BatchRules):  # the demo's batch is one array: the empty path
        section = declared
        rule = section.rule_for(())
        declared = rule.expr if rule is not None else section.default
        if declared == "error":
            raise EqshardError(
                f"{section.where('$')}: no rule lays out the demo's batch, one array whose "
                "path is empty, and the default is \"error\"; add a rule for '**'"
            )
        if declared == "replicate":
            return "... -> * ..."
    if declared is not None:
        return str(declared)
    if p.mesh is not None and p.mesh_is_given and p.mesh.axis_names[0] == "data":
        return data_parallel(p)
    return "... -> * ..."


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One training run of the demo.

    - `name`: the strategy (`"fsdp"`), the spec file's name for a user's spec, or
        `"unsharded"`.
    - `losses`: the loss of each step.
    - `model`, `state`: the trained model and AdamW state, laid out as the plan says.
    - `plan`: the model's plan (`None` unsharded), and `batch`, the batch's
        expression.
    - `cost`: what `eqshard.cost` says of one step (`None` unsharded).
    - `seconds_per_step`: the mean of the steps after the first, measured on
        accelerators only (`None` on CPU devices, whose timings say nothing of them).
    - `skipped`: why the strategy did not run on these devices, else `None`.
    - `variant`: the model it trained (`GPT_VARIANT`, `MOE`, `LONG`).
    """

    name: str
    losses: tuple[float, ...] = ()
    model: Any = None
    state: Any = None
    plan: Plan | None = None
    batch: str | None = None
    cost: Cost | None = None
    seconds_per_step: float | None = None
    skipped: str | None = None
    variant: Variant = GPT_VARIANT

    def difference(self, reference: Outcome) -> float:
        """The largest relative difference of this run's losses from `reference`'s."""
        return max(
            (abs(a - b) / max(abs(b), 1e-30) for a, b in zip(self.losses, reference.losses)),
            default=math.inf,
        )

    def agrees(self, reference: Outcome) -> bool:
        """Whether every loss equals the reference's, within `TOLERANCE`."""
        return len(self.losses) == len(reference.losses) and (
            self.difference(reference) <= TOLERANCE
        )


Progress = Callable[[str, int, float], None]
"""`progress(name, steps_done, loss)`, called after every step."""


def _train(
    name: str,
    step: Callable[..., Any],
    model: Any,
    state: AdamState,
    batch: Array,
    steps: int,
    progress: Progress | None,
    timed: bool,
) -> tuple[tuple[float, ...], Any, AdamState, float | None]:
    losses: list[float] = []
    started = 0.0
    for i in range(steps):
        if i == 1:  # after the first step, which compiled it
            started = time.perf_counter()
        value, model, state = step(model, state, batch)
        losses.append(float(value))  # waits for the step
        if progress is not None:
            progress(name, i + 1, losses[-1])
    seconds = (time.perf_counter() - started) / (steps - 1) if timed and steps > 1 else None
    return tuple(losses), model, state, seconds


def reference(
    steps: int,
    devices: Sequence[Any],
    progress: Progress | None = None,
    variant: Variant = GPT_VARIANT,
) -> Outcome:
    """The unsharded run: the model, the optimizer state and the batch on `devices[0]`.

    **Example:**

    ```python
    ref = reference(5, jax.devices())
    ref.losses   # five floats, the first about log(VOCAB)
    ```

    **Arguments:**

    - `steps`: how many training steps.
    - `devices`: the devices of the sharded runs; the first runs this one.
    - `progress`: called after every step.
    - `variant`: the model to train; by default the GPT.

    **Returns:**

    An `Outcome` named `"unsharded"` (`unsharded_label(variant)` for a variant).
    """
    label = unsharded_label(variant)
    with jax.default_device(devices[0]), jax.default_matmul_precision("highest"):
        model = _built(variant)
        state = adamw_init(eqx.filter(model, eqx.is_array))
        losses, model, state, seconds = _train(
            label,
            make_step(),
            model,
            state,
            jnp.asarray(tokens(variant=variant)),
            steps,
            progress,
            devices[0].platform != "cpu",
        )
    return Outcome(label, losses, model, state, seconds_per_step=seconds, variant=variant)


def unsharded_label(variant: Variant) -> str:
    """How the unsharded run of `variant` is named: `"unsharded"` for the GPT."""
    return "unsharded" if variant.key == GPT_VARIANT.key else f"unsharded {variant.key}"


def _built(variant: Variant) -> GPT:
    return build(sizes=variant.sizes, names=variant.names, heads=variant.heads)


def run(
    spec: str | Path,
    steps: int,
    devices: Sequence[Any],
    progress: Progress | None = None,
    *,
    name: str | None = None,
    variant: Variant | None = None,
) -> Outcome:
    """Trains the demo's model under one spec file and says what a step costs.

    The model and its AdamW state are placed by the spec's plan on `devices`, the
    batch by `batch_expression`; the step keeps every layout, and `eqshard.cost`
    compiles it over the same layouts.

    **Example:**

    ```python
    out = run(spec_path("fsdp"), 5, jax.devices())
    out.cost.memory.parameters   # bytes per device
    ```

    **Arguments:**

    - `spec`: the spec file.
    - `steps`: how many training steps.
    - `devices`: the devices to run on.
    - `progress`: called after every step.
    - `name`: the strategy's name; by default the file's, without `.eqshard.json`.
    - `variant`: the model to train; by default the strategy's (`variant_of`).

    **Returns:**

    An `Outcome`.

    **Raises:**

    `eqshard.SpecError` when the file cannot be read or does not lay out the model
    on these devices; `eqshard.ExpressionError` when the batch does not divide over
    them.
    """
    label = name or _label(Path(spec))
    variant = variant_of(label) if variant is None else variant
    rules = load(spec)
    with jax.default_device(devices[0]), jax.default_matmul_precision("highest"):
        model = _built(variant)
        state = adamw_init(eqx.filter(model, eqx.is_array))
        p = plan(model, rules, devices=devices)
        expr = batch_expression(p)
        batch = tokens(variant=variant)
        placed = jax.device_put(batch, batch_sharding(batch.shape, expr, p))
        model, state = apply(model, p), apply(state, p)
        step = make_step()
        summary = cost(model, state, placed, step=step, spec=p, batch=expr)
        with use(p):  # the program `cost` compiled for this plan
            losses, model, state, seconds = _train(
                label, step, model, state, placed, steps, progress, devices[0].platform != "cpu"
            )
    return Outcome(label, losses, model, state, p, expr, summary, seconds, variant=variant)


def per_step(c: Cost) -> dict[tuple[str, tuple[str, ...]], int]:
    """The bytes each device moves in one step, by (collective, mesh axes).

    `eqshard.cost` counts a collective in the body of the scan over the layers once
    per layer (`Collective.count`, from the loop's trip count).

    **Example:**

    ```python
    per_step(run(spec_path("data-parallel"), 1, devices).cost)
    # {('all-reduce', ('data',)): ...}: the gradients, summed over 'data'
    ```

    **Arguments:**

    - `c`: the `Cost` of the demo's step.

    **Returns:**

    Bytes per device, by `(kind, axes)`.
    """
    return dict(sorted(c.bytes_by_axes().items()))


def communication(c: Cost) -> str:
    """`per_step` as text: one line per (collective, mesh axes), `none` when the step
    moves nothing."""
    lines = [
        f"{kind} over {','.join(axes) or 'all'}: {human_bytes(total)}"
        for (kind, axes), total in per_step(c).items()
    ]
    return "\n".join(lines) or "none"


def _mesh_text(p: Plan | None) -> str:
    if p is None or p.mesh is None:
        return "-"
    return mesh_text(zip(p.mesh.axis_names, p.mesh.axis_sizes))


def table(
    outcomes: Sequence[Outcome],
    ref: Outcome,
    devices: Sequence[Any],
    refs: Mapping[str, Outcome] | None = None,
) -> Any:
    """The strategies side by side, as a rich table.

    **Example:**

    ```python
    console.print(table([run(spec_path("fsdp"), 5, devices)], reference(5, devices), devices))
    ```

    **Arguments:**

    - `outcomes`: the sharded runs.
    - `ref`: the unsharded run.
    - `devices`: the devices they ran on.
    - `refs`: the unsharded run of each variant of the GPT (`Variant.key`), for the
        rows that train one.

    **Returns:**

    A `rich.table.Table`.
    """
    from rich.table import Table

    timed = devices[0].platform != "cpu"
    n = len(devices)
    table = Table(
        title=f"{len(ref.losses)} AdamW steps on {n} {devices[0].platform.upper()} devices",
        title_justify="left",
        caption=(
            "Bytes per device of the parameters and the AdamW state, from each spec's "
            "plan (the state's by its optimizer section, where it has one: ZeRO-1 splits "
            "the moments and gathers the updated parameters); communication per device "
            "and step, from the collectives of the "
            "step as eqshard.cost compiles it (those in the scan over the layers, once "
            f"per layer). = unsharded: every step's loss within {TOLERANCE:g} "
            "(relative) of the unsharded run's, with the largest difference. "
            f"expert-parallel trains {MOE.title}, context-parallel {LONG.title}, "
            f"pipeline {PIPELINE.title}, each against its own unsharded run."
            + (
                ""
                if timed
                else " No step times: simulated CPU devices say nothing of accelerators."
            )
        ),
        caption_justify="left",
    )
    for column in ("strategy", "mesh", "batch"):
        table.add_column(column)
    for column in ("params / device", "optimizer / device"):
        table.add_column(column, justify="right")
    table.add_column("communication / step")
    table.add_column("final loss", justify="right")
    table.add_column("= unsharded")
    if timed:
        table.add_column("ms / step (measured)", justify="right")
    arrays = jax.tree_util.tree_leaves(eqx.filter(ref.model, eqx.is_array))
    params = sum(a.nbytes for a in arrays)
    optimizer = sum(a.nbytes for a in jax.tree_util.tree_leaves(ref.state))

    def ms(o: Outcome) -> str:
        return "-" if o.seconds_per_step is None else f"{1000 * o.seconds_per_step:.2f}"

    extra = [ms(ref)] if timed else []
    table.add_row(
        "unsharded",
        "1 device",
        "whole",
        human_bytes(params),
        human_bytes(optimizer),
        "none",
        f"{ref.losses[-1]:.6f}",
        "(reference)",
        *extra,
    )
    for o in outcomes:
        name = f"{o.name}\n({o.variant.short})" if o.variant.short else o.name
        if o.skipped is not None or o.cost is None:
            gaps = ["-"] * (len(table.columns) - 2)
            table.add_row(name, *gaps[:4], f"skipped: {o.skipped}", *gaps[4:])
            continue
        batch = "split over data" if o.batch != "... -> * ..." else "whole"
        against = _reference_of(o, ref, refs)
        verdict = (
            f"yes ({o.difference(against):.0e})"
            if o.agrees(against)
            else f"NO ({o.difference(against):.1e})"
        )
        table.add_row(
            name,
            _mesh_text(o.plan),
            batch,
            human_bytes(o.cost.memory.parameters),
            human_bytes(o.cost.memory.optimizer),
            communication(o.cost),
            f"{o.losses[-1]:.6f}",
            verdict,
            *([ms(o)] if timed else []),
        )
    return table


def _reference_of(o: Outcome, ref: Outcome, refs: Mapping[str, Outcome] | None) -> Outcome:
    """The unsharded run `o` is compared with: its variant's, else `ref`."""
    if o.variant.key == GPT_VARIANT.key or refs is None:
        return ref
    return refs[o.variant.key]


def demo_devices(count: int | None = None) -> list[Any]:
    """The devices the demo runs on: the first `count` of JAX's; by default all of
    them, or the simulated CPU devices where JAX has one accelerator, which would
    shard nothing.

    **Example:**

    ```python
    demo_devices(4)   # the first 4 of jax.devices()
    ```

    **Arguments:**

    - `count`: how many devices, or `None` for the default.

    **Returns:**

    A list of devices.

    **Raises:**

    `eqshard.EqshardError` when JAX has fewer than `count` devices.
    """
    devices = jax.devices()
    if count is None and len(devices) == 1 and devices[0].platform != "cpu":
        devices = jax.devices("cpu")  # one accelerator shards nothing: show it on CPUs
    if count is not None:
        if len(devices) < count:
            raise EqshardError(f"asked for {count} devices, but JAX started with {len(devices)}")
        devices = devices[:count]
    return list(devices)


def main(
    console: Any,
    *,
    spec: str | None = None,
    steps: int = 8,
    devices: int | None = None,
    emit: Callable[[Any], None] | None = None,
) -> int:
    """Runs the demo and prints the strategy table (or hands `emit` the results).

    **Example:**

    ```python
    main(rich.console.Console(), spec="fsdp", steps=3)
    ```

    **Arguments:**

    - `console`: a rich console to print on.
    - `spec`: one strategy of `STRATEGIES`, or a path to a spec file for the demo's
        model; by default every strategy.
    - `steps`: how many AdamW steps each run trains.
    - `devices`: how many of JAX's devices to use (see `demo_devices`).
    - `emit`: where the results go as one JSON-able document, instead of the
        progress bar and the table (the command line's `--format json`).

    **Returns:**

    0 when every strategy that ran trained to the unsharded losses, else 1.

    **Raises:**

    `eqshard.UnreadableError` when `spec` names no strategy and no file;
    `eqshard.SpecError` (or `eqshard.ExpressionError`) when it does not fit these
    devices (see `fits`). Strategies run by default that do not fit are shown as
    skipped; `eqshard.EqshardError` when JAX has fewer devices than `devices`.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    chosen = demo_devices(devices)
    if spec is not None and spec not in STRATEGIES and not Path(spec).is_file():
        raise UnreadableError(
            [
                Problem(
                    spec,
                    f"no such strategy or file; the strategies are {', '.join(STRATEGIES)}, "
                    "or give the path of a spec file for the demo's model",
                )
            ],
            "unreadable",
        )
    skipped: dict[str, str] = {}  # the strategies that do not fit these devices, and why
    for name in STRATEGIES if spec is None else (spec,):
        try:
            fits(spec_path(name), chosen, variant_of(name))
        except EqshardError as error:
            if spec is not None:
                raise
            problems = getattr(error, "problems", None)
            skipped[name] = problems[0].message if problems else str(error).splitlines()[0]
    names = [n for n in (STRATEGIES if spec is None else (spec,)) if n not in skipped]
    bar = Progress(
        TextColumn("{task.description:>16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        console=console,
        disable=emit is not None,
    )
    if emit is None:
        console.print(
            f"eqshard demo: a {LAYERS}-layer GPT (eqx.nn, stacked and scanned), AdamW, "
            f"{steps} steps on {len(chosen)} {chosen[0].platform.upper()} devices"
        )
    labels = {name: _label(spec_path(name)) for name in names}
    variants = list({variant_of(name).key: variant_of(name) for name in names}.values())
    variants = [v for v in variants if v.key != GPT_VARIANT.key]
    tasks = {
        label: bar.add_task(label, total=steps, loss="compiling")
        for label in (
            unsharded_label(GPT_VARIANT),
            *labels.values(),
            *map(unsharded_label, variants),
        )
    }

    def progress(name: str, done: int, value: float) -> None:
        bar.update(tasks[name], completed=done, loss=f"loss {value:.4f}")

    with bar:
        ref = reference(steps, chosen, progress)
        refs = {v.key: reference(steps, chosen, progress, v) for v in variants}
        outcomes = {
            name: run(spec_path(name), steps, chosen, progress, variant=variant_of(name))
            for name in names
        }
    ordered = [
        outcomes[name]
        if name in outcomes
        else Outcome(name, skipped=skipped[name], variant=variant_of(name))
        for name in (STRATEGIES if spec is None else (spec,))
    ]
    ok = all(o.agrees(_reference_of(o, ref, refs)) for o in outcomes.values())
    if emit is not None:
        emit(to_json(ordered, ref, chosen, refs))
    else:
        console.print(table(ordered, ref, chosen, refs))
        console.print(
            "every strategy trains to the unsharded losses"
            if ok
            else "MISMATCH: a strategy's losses differ from the unsharded run's"
        )
    return 0 if ok else 1


def fits(spec: str | Path, devices: Sequence[Any], variant: Variant = GPT_VARIANT) -> Plan:
    """Checks, without computing anything, that a spec file lays out the demo's model
    and its batch on `devices`.

    **Example:**

    ```python
    fits(spec_path("2d"), jax.devices()[:2])   # raises: 'model' needs 4 devices
    ```

    **Arguments:**

    - `spec`: the spec file.
    - `devices`: the devices.
    - `variant`: the model; by default the GPT.

    **Returns:**

    The plan of the abstract model.

    **Raises:**

    `eqshard.SpecError` when the file cannot be read or does not lay out the model;
    `eqshard.ExpressionError` when the batch does not split over the `data` axis.
    """
    model = eqx.filter_eval_shape(_built, variant)
    p = plan(model, load(spec), devices=devices)
    batch_sharding((variant.rows, variant.sizes.seq + 1), batch_expression(p), p)
    return p


def _label(spec: Path) -> str:
    """A strategy's name: its spec file's, without `.eqshard.json`."""
    return spec.name.removesuffix(".json").removesuffix(".eqshard")


def to_json(
    outcomes: Sequence[Outcome],
    ref: Outcome,
    devices: Sequence[Any],
    refs: Mapping[str, Outcome] | None = None,
) -> dict[str, Any]:
    """The results as one JSON-able document: `ok`, the devices, the tolerance, the
    unsharded losses, and for each strategy its mesh, bytes per device,
    communication, losses and whether they equal the unsharded ones (or why it was
    skipped)."""

    def entry(o: Outcome) -> dict[str, Any]:
        if o.skipped is not None or o.cost is None or o.plan is None:
            return {"strategy": o.name, "model": o.variant.title, "skipped": o.skipped}
        against = _reference_of(o, ref, refs)
        return {
            "strategy": o.name,
            "model": o.variant.title,
            "mesh": dict(zip(o.plan.mesh.axis_names, o.plan.mesh.axis_sizes))
            if o.plan.mesh is not None
            else None,
            "batch": o.batch,
            "parameter_bytes_per_device": o.cost.memory.parameters,
            "optimizer_bytes_per_device": o.cost.memory.optimizer,
            "communication": [
                {"kind": kind, "axes": list(axes), "bytes": total}
                for (kind, axes), total in per_step(o.cost).items()
            ],
            "losses": list(o.losses),
            "unsharded_losses": list(against.losses),
            "equals_unsharded": o.agrees(against),
            "relative_difference": o.difference(against),
            "seconds_per_step": o.seconds_per_step,
        }

    return {
        "ok": all(o.agrees(_reference_of(o, ref, refs)) for o in outcomes if o.skipped is None),
        "devices": len(devices),
        "platform": devices[0].platform,
        "tolerance": TOLERANCE,
        "unsharded": {"losses": list(ref.losses), "seconds_per_step": ref.seconds_per_step},
        "strategies": [entry(o) for o in outcomes],
    }
