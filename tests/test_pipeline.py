"""`eqshard.parallel.pipeline` (issue 33): the 8-layer stack of examples/pipeline.py on a
`stage=4 x data=2` mesh with 8 microbatches trains as the plain scan under GPipe and
the circular schedule, each device holding only its stage's layers; `cost` counts the
permutes over `stage` and gives the bubble; with no stage axis it is the scan."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqshard
from eqshard._pipeline import Stages, bubble
from eqshard._report import human_bytes

EXAMPLE = Path(__file__).parent.parent / "examples" / "pipeline.py"


@pytest.fixture(scope="module")
def example():
    return runpy.run_path(str(EXAMPLE), run_name="pipeline_example")


def _stage_of(device) -> int:
    """On `[["stage", 4], ["data", 2]]` over devices 0-7 in order: `d // 2`."""
    return jax.devices().index(device) // 2


def _close(a, b) -> None:
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


def _trained_alike(a, b, learning_rate: float = 1e-3) -> None:
    """Adam moves a parameter by about the learning rate whatever its gradient's size,
    so where a gradient is near 0 its last bits can move it by as much: compare root
    mean squares, which one such element barely moves (a wrong gradient moves most
    parameters by the learning rate)."""
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        rms = float(np.sqrt(np.mean((np.asarray(x) - np.asarray(y)) ** 2)))
        assert rms < learning_rate / 100, rms


def test_gpipe_trains_as_the_plain_scan_each_stage_holding_its_two_layers(example):
    found = example["main"](steps=3, spec=example["GPIPE"])
    np.testing.assert_allclose(found["losses"], found["reference"], rtol=1e-5)
    _trained_alike(eqx.filter(found["model"], eqx.is_array), found["reference_model"])
    assert dict(found["plan"].mesh.shape) == {"stage": 4, "data": 2}
    for leaf in jax.tree_util.tree_leaves(found["model"].blocks):  # (8, ...)
        blocks = leaf.sharding.devices_indices_map(leaf.shape)
        for device, index in blocks.items():
            s = _stage_of(device)
            assert index[0] == slice(2 * s, 2 * s + 2), (leaf.shape, index)
            assert all(i == slice(None) for i in index[1:])
        assert leaf.addressable_shards[0].data.shape[0] == 2
    assert found["model"].head.weight.sharding.is_fully_replicated


def test_circular_trains_as_the_plain_scan_stage_s_holding_layers_s_and_s_plus_4(example):
    found = example["main"](steps=3, spec=example["CIRCULAR"])
    np.testing.assert_allclose(found["losses"], found["reference"], rtol=1e-5)
    _trained_alike(eqx.filter(found["model"], eqx.is_array), found["reference_model"])
    for leaf in jax.tree_util.tree_leaves(found["model"].blocks):  # (2 rounds, 4 stages, ...)
        for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
            s = _stage_of(device)
            assert index[:2] == (slice(None), slice(s, s + 1)), (leaf.shape, index)


def _cost(example, spec, build="build"):
    model, opt_state, data = _abstract(example, build)
    with jax.default_matmul_precision("highest"):
        return eqshard.cost(
            model, opt_state, data, step=example["step"], spec=eqshard.load(spec), devices=8
        )


@pytest.mark.parametrize(
    ("schedule", "build", "rounds"), [("gpipe", "build", 1), ("circular", "build_circular", 2)]
)
def test_cost_counts_the_permutes_over_stage_and_gives_the_bubble(example, schedule, build, rounds):
    """Each step of the loop passes every stage's microbatch to the next: one permute
    of a microbatch's activations on one device, 2 rows / 2 `data` devices x 32
    floats; the loop runs `rounds x 8 + 4 - 1` steps. The gradient passes them back."""
    spec = example["GPIPE" if schedule == "gpipe" else "CIRCULAR"]
    found = _cost(example, spec, build)
    iterations = rounds * 8 + 3
    assert found.pipelines == (Stages("stage", 4, 8, rounds, schedule, 8),)
    (stages,) = found.pipelines
    assert stages.iterations == iterations
    assert stages.bubble == 3 / iterations
    assert stages.bubble == bubble(4, 8, schedule, rounds)
    hand = 1 * 32 * 4
    forward = [
        (c.bytes, c.count, c.axes)
        for c in found.collectives
        if c.kind == "collective-permute" and "transpose" not in c.source and c.count > 1
    ]
    assert forward == [(hand, iterations, ("stage",))]
    backward = [
        c
        for c in found.collectives
        if c.kind == "collective-permute" and "transpose" in c.source and c.count > 1
    ]
    assert backward
    assert all(c.axes == ("stage",) and c.count == iterations for c in backward)
    assert not [c for c in found.collectives if c.kind in ("all-gather", "all-to-all")]
    # docs/pipeline.md's hand count: a row each step forward, two permutes of it back
    # (the roll's gradient: stages 1-3 to the one before, and stage 0 round to 3), and
    # the last stage's results (8 microbatches of a row) to the first stage and back
    results = 8 * 1 * 32 * 4
    permutes = [c for c in found.collectives if c.kind == "collective-permute"]
    each = [(hand, iterations, False), (hand, iterations, True), (hand, iterations, True)]
    once = [(results, 1, False), (results, 1, True)]
    assert sorted((c.bytes, c.count, "transpose" in c.source) for c in permutes) == sorted(
        [*each, *once]
    )
    moved = 3 * iterations * hand + 2 * results
    assert found.bytes_by_axes()[("collective-permute", ("stage",))] == moved
    text = found.pipeline_text()
    assert text is not None
    assert f"{human_bytes(moved)} permuted over 'stage' per step" in text
    if schedule == "gpipe":
        page = (EXAMPLE.parent.parent / "docs" / "pipeline.md").read_text()
        assert f"3 x {iterations * hand} B + 2 x {results} B = {moved:,} B" in page
        assert f"the {human_bytes(moved)} `cost` gives" in page
    assert f"bubble {3 / iterations:.1%}" in text
    assert f"4 stages of 2 layers, 8 microbatches, {schedule}" in text
    assert found.peak_per_stage == found.memory.peak


def test_gpipe_bubble_is_stages_minus_one_over_microbatches_plus_stages_minus_one():
    for stages, microbatches in [(4, 8), (2, 2), (8, 32), (1, 4)]:
        want = (stages - 1) / (microbatches + stages - 1)
        assert bubble(stages, microbatches) == want
    assert bubble(4, 8, "circular", rounds=2) == 3 / 19
    assert bubble(4, 8, "gpipe", rounds=2) == 3 / 11  # GPipe has no rounds


def test_with_no_stage_axis_it_is_the_plain_scan_bit_for_bit(example):
    model = example["build"]()
    x = jax.vmap(model.project)(example["batch"]()[0])
    params, static = eqx.partition(model.blocks, eqx.is_array)

    def plain(x):
        return jax.lax.scan(lambda x, p: (eqx.combine(p, static)(x), None), x, params)[0]

    def piped(x):
        return eqshard.parallel.pipeline(lambda layer, x: layer(x), model.blocks, x, microbatches=8)

    np.testing.assert_array_equal(np.asarray(jax.jit(piped)(x)), np.asarray(jax.jit(plain)(x)))
    assert "scan" in str(jax.make_jaxpr(piped)(x))
    assert "while" not in str(jax.make_jaxpr(piped)(x)).replace("scan", "")
    # rules whose mesh has no `stage` axis: the plain scan too
    rules = eqshard.load({"eqshard": 1, "mesh": [["data", 8]], "batch": "b ... -> b* ..."})
    with eqshard.use(rules):
        np.testing.assert_array_equal(np.asarray(jax.jit(piped)(x)), np.asarray(plain(x)))


def _rules(mesh, expr):
    return eqshard.load(
        {"eqshard": 1, "mesh": mesh, "rules": [{"path": "blocks.**", "expr": expr}]}
    )


TENSOR = [  # each stage's MLP split Megatron-style over `model`, the rest copied
    {"path": "blocks.up.weight", "expr": "l o i -> l2 2 o2 i"},
    {"path": "blocks.up.bias", "expr": "l o -> l2 2 o2"},
    {"path": "blocks.down.weight", "expr": "l o i -> l2 2 o i2"},
    {"path": "blocks.**", "expr": "l ... -> l2 ... 4"},
]
FSDP = [  # each stage's weights split over `data` too, gathered for use
    {"path": "blocks.{up,down}.weight", "expr": "l o i -> l2 o i2 2"},
    {"path": "blocks.**", "expr": "l ... -> l2 ... 4"},
]


@pytest.mark.parametrize(
    ("rules", "spec"),
    [(TENSOR, ("stage", "model", None)), (FSDP, ("stage", None, "data"))],
    ids=["tensor", "fsdp"],
)
def test_stages_compose_with_tensor_parallelism_fsdp_and_data(example, rules, spec):
    """`stage=2 x data=2 x model=2`: each stage's layers split Megatron-style over
    `model`, or by FSDP over `data`, the batch over `data`: the loss and gradients
    are the plain scan's, and the up projection is split as the rules say."""
    model = example["build"](example["SIZES"]._replace(stages=2))
    data = example["batch"]()
    mesh = [["stage", 2], ["data", 2], ["model", 2]]
    batch = "b ... -> 2 b2 ... 2"
    spec_file = {"eqshard": 1, "mesh": mesh, "rules": rules, "batch": batch}
    grad = eqx.filter_jit(eqx.filter_value_and_grad(example["loss"]))
    with jax.default_matmul_precision("highest"):
        want, want_grads = grad(model, data)
        plan = eqshard.plan(model, eqshard.load(spec_file))
        placed = eqshard.apply(model, plan)
        assert tuple(placed.blocks.up.weight.sharding.spec) == spec
        with eqshard.use(plan):
            got, got_grads = grad(placed, eqshard.apply(data, batch))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    _close(got_grads, want_grads)


@pytest.mark.slow  # compiles in worker processes
def test_assert_equivalent_covers_a_pipelined_spec(example):
    from eqshard.testing import assert_equivalent

    assert_equivalent(
        f"{EXAMPLE}:build",
        example["GPIPE"],
        f"{EXAMPLE}:loss",
        f"{EXAMPLE}:batch",
        device_counts=(8,),
        optimizer=f"{EXAMPLE}:optimizer",
        max_communication={"all-gather": 0, "all-to-all": 0},
    )


def _layers(example):
    return example["build"]().blocks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"microbatches": 3}, r"cuts a batch of 16 into 3 microbatches, which does not divide"),
        (
            {"microbatches": 2.0},
            r"`eqshard.parallel.pipeline`'s `microbatches` is a whole number from 1, not 2\.0",
        ),
        ({"microbatches": "2"}, r"`microbatches` is a whole number from 1, not '2'"),
        ({"microbatches": True}, r"`microbatches` is a whole number from 1, not True"),
        ({"microbatches": 0}, r"`microbatches` is a whole number from 1, not 0"),
        ({"microbatches": 8, "schedule": "1f1b"}, r"has no schedule '1f1b'; the schedules are"),
        (
            {"microbatches": 8, "schedule": "circular"},
            r"circular schedule takes layers whose array leaves all have two leading axes",
        ),
    ],
)
def test_bad_arguments_are_named(example, kwargs, message):
    x = jnp.zeros((16, 32))
    with pytest.raises(eqshard.EqshardError, match=message):
        eqshard.parallel.pipeline(lambda layer, x: layer(x), _layers(example), x, **kwargs)


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ((4, 8.0, 1, 8), r"`Stages.microbatches` is a whole number from 1, not 8\.0"),
        ((0, 8, 1, 8), r"`Stages.stages` is a whole number from 1, not 0"),
        ((4, 8, "2", 8), r"`Stages.rounds` is a whole number from 1, not '2'"),
        ((4, 8, 1, True), r"`Stages.layers` is a whole number from 1, not True"),
    ],
)
def test_stages_counts_are_whole_numbers(counts, message):
    stages, microbatches, rounds, layers = counts
    with pytest.raises(eqshard.EqshardError, match=message):
        Stages("stage", stages, microbatches, rounds, "gpipe", layers)
    with pytest.raises(
        eqshard.EqshardError, match=r"`Stages.schedule` is one of 'gpipe', 'circular', not '1f1b'"
    ):
        Stages("stage", 4, 8, 1, "1f1b", 8)  # pyright: ignore[reportArgumentType]


def test_layers_that_do_not_divide_over_the_stages_are_named(example):
    blocks = jax.tree_util.tree_map(lambda a: a[:6], _layers(example))  # 6 layers, 4 stages
    rules = _rules([["stage", 4], ["data", 2]], "l ... -> l2 ... 4")
    with (
        eqshard.use(rules),
        pytest.raises(
            eqshard.EqshardError, match=r"splits 6 stacked layers over 4 stages \('stage'\)"
        ),
    ):
        eqshard.parallel.pipeline(
            lambda layer, x: layer(x), blocks, jnp.zeros((16, 32)), microbatches=8
        )


def test_circular_needs_as_many_microbatches_as_stages(example):
    blocks = example["build_circular"]().blocks
    rules = _rules([["stage", 4], ["data", 2]], "r s ... -> r s4 ... 2")

    def circular(layers, microbatches):
        return eqshard.parallel.pipeline(
            lambda layer, x: layer(x),
            layers,
            jnp.zeros((16, 32)),
            microbatches=microbatches,
            schedule="circular",
        )

    with eqshard.use(rules):
        with pytest.raises(eqshard.EqshardError, match=r"at least as many microbatches as"):
            circular(blocks, 2)
        flat = jax.tree_util.tree_map(lambda a: a.reshape(4, 2, *a.shape[2:]), blocks)
        with pytest.raises(eqshard.EqshardError, match=r"stack them \(2, 4\)"):
            circular(flat, 8)


def test_report_and_check_say_which_layers_each_stage_holds(example):
    gpipe = eqshard.report(example["build"](), eqshard.load(example["GPIPE"]))
    up = next(row for row in gpipe.rows if row.path == "blocks.up.weight")
    assert up.stages == ((0, 1), (2, 3), (4, 5), (6, 7))
    line = "blocks (8 layers, 6 leaves): stage 0 holds layers 0-1; stage 1 holds 2-3; "
    line += "stage 2 holds 4-5; stage 3 holds 6-7"
    assert gpipe.to_json()["stages"] == [line]
    assert f"stages over 'stage': {line}" in " ".join(str(gpipe).split()).replace("- ", "-")
    circular = eqshard.report(example["build_circular"](), eqshard.load(example["CIRCULAR"]))
    assert circular.to_json()["stages"] == [
        "blocks (8 layers, 6 leaves): stage 0 holds layers 0, 4; stage 1 holds 1, 5; "
        "stage 2 holds 2, 6; stage 3 holds 3, 7"
    ]
    assert next(r for r in circular.rows if r.path == "head.weight").stages is None
    check = [sys.executable, "-m", "eqshard", "check", str(example["GPIPE"])]
    check += ["--model", f"{EXAMPLE}:build", "--device-counts", "8"]
    found = subprocess.run(
        [*check, "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    (result,) = json.loads(found.stdout)["checks"]
    rows = {row["path"]: row for row in result["leaves"]}
    assert rows["blocks.down.bias"]["stages"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    text = subprocess.run(
        check,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "400"},
    ).stdout
    assert f"stages over 'stage': {line}" in text


def _abstract(example, build="build"):
    model = eqx.filter_eval_shape(example[build])
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(example["optimizer"]().init, params)
    sizes = example["SIZES"]
    data = (
        jax.ShapeDtypeStruct((sizes.batch, sizes.features), jnp.float32),
        jax.ShapeDtypeStruct((sizes.batch,), jnp.float32),
    )
    return model, opt_state, data


def test_suggest_splits_the_layers_the_pipeline_runs_and_its_spec_trains(example, tmp_path):
    """The step's jaxpr shows which leaves `eqshard.parallel.pipeline` runs: the `pipeline x
    data` family splits exactly those over `stage`, on each factorization whose stages
    divide the 8 layers and whose `data` divides each microbatch's rows; its spec
    trains as the plain scan."""
    from eqshard._search._candidates import candidates

    model, opt_state, data = _abstract(example)
    kept, dropped = candidates(example["step"], model, opt_state, data, devices=8)
    piped = {c.name: c for c in kept if c.strategy == "pipeline x data"}
    assert sorted(piped) == [
        "pipeline x data on data=1, stage=8",
        "pipeline x data on data=2, stage=4",
    ]
    # the model gives batch_axis="data": each microbatch's 2 rows must split over it
    assert (
        "pipeline x data on data=4, stage=2",
        "each of the 8 microbatches has 2 rows, which do not divide over data=4 (the "
        "pipeline's batch_axis)",
    ) in dropped
    found = piped["pipeline x data on data=2, stage=4"]
    plan = eqshard.plan(model, found.rules, devices=8)
    for row in eqshard.report(model, plan).rows:
        split = row.path.startswith("blocks.")
        assert (row.stages == ((0, 1), (2, 3), (4, 5), (6, 7))) is split, row
    path = tmp_path / "pipeline.eqshard.json"
    eqshard.dump(found.rules, path)
    trained = example["main"](steps=2, spec=path)
    np.testing.assert_allclose(trained["losses"], trained["reference"], rtol=1e-5)
    # the circular stack of 4 stages: only where 'stage' has 4 devices
    model, opt_state, data = _abstract(example, "build_circular")
    kept, dropped = candidates(
        example["step"], model, opt_state, data, devices=8, strategies=["pipeline x data"]
    )
    assert [c.name for c in kept] == ["pipeline x data on data=2, stage=4"]
    assert (
        "pipeline x data on data=1, stage=8",
        "the circular schedule's stack (blocks.norm.weight float32[2, 4, 32]) has 4 stages, "
        "not stage=8",
    ) in dropped


def test_suggest_compiles_and_ranks_the_pipeline_with_its_bubble(example):
    model, opt_state, data = _abstract(example)
    ranked = eqshard.suggest(
        model,
        opt_state,
        data,
        step=example["step"],
        devices=8,
        workers=0,
        strategies=["pipeline x data", "data parallel"],
        exhaustive=True,
    )
    rows = {s.name: s for s in ranked}
    piped = rows["pipeline x data (data=2 x stage=4)"]
    assert piped.figures == "compiled"
    assert piped.cost is not None
    assert piped.cost.pipelines == (Stages("stage", 4, 8, 1, "gpipe", 8),)
    permuted = piped.cost.bytes_by_axes().get(("collective-permute", ("stage",)), 0)
    assert permuted > 0


def test_the_picture_shows_each_stage_a_step_later_and_the_bubble_as_dots():
    gpipe = Stages("stage", 4, 8, 1, "gpipe", 8).picture().splitlines()
    assert len(gpipe) == 5  # the steps, then a row per stage
    assert gpipe[0].split()[1:] == [str(t) for t in range(11)]
    for s, row in enumerate(gpipe[1:]):
        cells = row.split()[2:]
        assert cells == ["."] * s + [str(m) for m in range(8)] + ["."] * (3 - s)
        assert cells.count(".") / len(cells) == 3 / 11  # the bubble, stage by stage
    circular = Stages("stage", 4, 8, 2, "circular", 8).picture().splitlines()
    last = circular[4].split()[2:]
    assert last[:4] == [".", ".", ".", "0a"]
    assert last[-1] == "7b"
    assert last.count(".") == 3


def test_the_picture_keeps_its_columns_for_any_count_of_stages_and_rounds():
    """Past 26 rounds a round is two letters (`aa` the 27th), and from stage 10 the
    labels are wider: every row keeps the same width and each cell its column."""
    stages, microbatches, rounds = 12, 12, 30
    lines = Stages("stage", stages, microbatches, rounds, "circular", 360).picture().splitlines()
    assert len(lines) == stages + 1
    assert len({len(line) for line in lines}) == 1  # every row as wide
    label = len("stage 11 ")
    assert [line[:label].rstrip() for line in lines] == ["step"] + [
        f"stage {s}" for s in range(stages)
    ]
    width = len("11ad")  # the widest cell: microbatch 11, round 30
    iterations = rounds * microbatches + stages - 1
    columns = [
        [line[label + (width + 1) * t : label + (width + 1) * t + width] for t in range(iterations)]
        for line in lines
    ]
    assert all(c == c.rjust(width) for row in columns for c in row)  # each in its column
    steps, *cells = [[c.strip() for c in row] for row in columns]
    assert steps == [str(t) for t in range(iterations)]
    for s, row in enumerate(cells):
        assert row[:s] == ["."] * s
        assert row[s : s + 2] == ["0a", "1a"]
        assert row[s + 26 * microbatches] == "0aa"  # the 27th round
        assert row[s + 29 * microbatches + 11] == "11ad"  # the 30th round's last
        assert row[s + rounds * microbatches :] == ["."] * (stages - 1 - s)


@pytest.mark.parametrize("batch_axis", ["data", None])
def test_with_batch_axis_the_weights_gradients_are_summed_over_data_once(example, batch_axis):
    """A layer of the example holds 32 + 32 + 64 x 32 + 64 + 32 x 64 + 32 floats, a
    stage 2 layers. With `batch_axis="data"` each `data` device runs its rows with its
    own copy of its stage's layers, summed once: one all-reduce of the stage's layers,
    the projection and head (16 x 32 + 32 + 32 + 1) and the loss. Without, XLA sums
    each layer's gradients in each of the loop's 11 steps."""
    layer = (32 + 32 + 64 * 32 + 64 + 32 * 64 + 32) * 4
    ends = (16 * 32 + 32 + 32 + 1) * 4
    sizes = example["SIZES"]._replace(batch_axis=batch_axis)
    model = eqx.filter_eval_shape(example["build"], sizes)
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(example["optimizer"]().init, params)
    _, _, data = _abstract(example)
    found = eqshard.cost(
        model, opt_state, data, step=example["step"], spec=eqshard.load(example["GPIPE"]), devices=8
    )
    over_data = sorted(
        (c.bytes, c.count)
        for c in found.collectives
        if c.kind == "all-reduce" and c.axes == ("data",)
    )
    if batch_axis == "data":
        assert over_data == [(2 * layer + ends + 4, 1)]
    else:
        assert over_data == sorted([(layer, 2 * 11), (ends + 4, 1)])


def test_batch_axis_needs_each_microbatch_to_split_over_it(example):
    rules = _rules([["stage", 4], ["data", 2]], "l ... -> l2 ... 4")
    with (
        eqshard.use(rules),
        pytest.raises(
            eqshard.EqshardError, match=r"splits each microbatch's 1 rows over 'data' \(2 devices\)"
        ),
    ):
        eqshard.parallel.pipeline(
            lambda layer, x: layer(x),
            _layers(example),
            jnp.zeros((16, 32)),
            microbatches=16,
            batch_axis="data",
        )


@pytest.mark.parametrize("batch_axis", [None, "data"])
def test_on_explicit_axes_it_runs_on_auto_axes_inside_and_equals_the_scan(example, batch_axis):
    """Under `jax.set_mesh` with Explicit axes (`jax.make_mesh`'s default from JAX
    0.9), the pipeline runs on Auto axes inside (`auto_axes`), its result laid out as
    its input: the scan's values and gradients."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    model = example["build"]()
    x = jax.vmap(model.project)(example["batch"]()[0])  # (16, 32)
    params, static = eqx.partition(model.blocks, eqx.is_array)

    def plain(params, x):
        return jax.lax.scan(lambda x, p: (eqx.combine(p, static)(x), None), x, params)[0]

    def piped(params, x):
        return eqshard.parallel.pipeline(
            lambda layer, x: layer(x),
            eqx.combine(params, static),
            x,
            microbatches=4,
            batch_axis=batch_axis,
        )

    mesh = jax.make_mesh((4, 2), ("stage", "data"), axis_types=(AxisType.Explicit,) * 2)
    held = jax.tree_util.tree_map(
        lambda a: jax.device_put(a, NamedSharding(mesh, P("stage"))), params
    )
    rows = jax.device_put(x, NamedSharding(mesh, P("data")))
    with jax.default_matmul_precision("highest"):
        want = plain(params, x)
        want_grads = jax.grad(lambda p, x: jnp.sum(plain(p, x) ** 2))(params, x)
        with jax.set_mesh(mesh):
            got = jax.jit(piped)(held, rows)
            grads = jax.jit(jax.grad(lambda p, x: jnp.sum(piped(p, x) ** 2)))(held, rows)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert tuple(got.sharding.spec)[:1] == ("data",)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
        # gradients up to about 5: sums in another order differ in the last bits
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_a_scalar_in_the_input_is_named_on_every_mesh(example):
    x = (jnp.zeros((16, 32)), jnp.zeros(()))
    with pytest.raises(eqshard.EqshardError, match=r"1 of its leaves is a scalar, with no batch"):
        eqshard.parallel.pipeline(lambda layer, x: x, _layers(example), x, microbatches=8)
