"""`eqshard demo`: each strategy trains to the unsharded losses, holds what its spec
says, and the table reports it.

The eight strategies train once, two steps each, in this process on its 8 CPU
devices (`outcomes`); every test reads those runs. Three train variants of the GPT,
a mixture of experts, long sequences and layers in pipeline stages, each against its
own unsharded run (`refs`).
The command line itself runs in tests/test_cli.py.
"""

import dataclasses
import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from rich.console import Console

import eqshard
from eqshard._demo import _model as _demo_model, _run as _demo

STEPS = 2  # the second step's loss shows the first update


@pytest.fixture(scope="module")
def devices():
    return jax.devices()


@pytest.fixture(scope="module")
def reference(devices):
    return _demo.reference(STEPS, devices)


@pytest.fixture(scope="module")
def refs(devices):
    return {v.key: _demo.reference(STEPS, devices, variant=v) for v in _demo.VARIANTS.values()}


def _reference(name, reference, refs):
    variant = _demo.variant_of(name)
    return reference if variant.key == "gpt" else refs[variant.key]


@pytest.fixture(scope="module")
def outcomes(devices):
    return {name: _demo.run(_demo.spec_path(name), STEPS, devices) for name in _demo.STRATEGIES}


def _arrays(tree):
    return jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))


def _spec(leaf):
    """A leaf's PartitionSpec with one entry per dim (JAX drops trailing `None`s)."""
    spec = tuple(leaf.sharding.spec)
    return P(*spec, *[None] * (leaf.ndim - len(spec)))


@pytest.mark.slow  # the demo: trains every strategy (the `outcomes` fixture)
@pytest.mark.parametrize("name", _demo.STRATEGIES)
def test_each_strategy_trains_to_the_unsharded_losses(outcomes, reference, refs, name):
    outcome = outcomes[name]
    reference = _reference(name, reference, refs)
    assert len(outcome.losses) == STEPS
    np.testing.assert_allclose(outcome.losses, reference.losses, rtol=_demo.TOLERANCE)
    assert outcome.agrees(reference)
    assert reference.losses[1] < reference.losses[0]  # the step does train
    # and the trained parameters are the unsharded ones. Adam moves a parameter by
    # about the learning rate whatever the size of its gradient, so where a gradient
    # is near 0, a difference in its last bits can move it by as much: compare root
    # mean squares, which one such element barely moves. A wrong gradient moves
    # most parameters by the learning rate (1e-2).
    for got, want in zip(_arrays(outcome.model), _arrays(reference.model)):
        rms = float(np.sqrt(np.mean((np.asarray(got) - np.asarray(want)) ** 2)))
        assert rms < _demo_model.LEARNING_RATE / 100


@pytest.mark.slow  # the demo: trains every strategy (the `outcomes` fixture)
def test_a_different_loss_does_not_agree(outcomes, reference):
    outcome = outcomes["fsdp"]
    off = dataclasses.replace(outcome, losses=(outcome.losses[0], outcome.losses[1] * 1.0001))
    assert not off.agrees(reference)
    assert not dataclasses.replace(outcome, losses=outcome.losses[:1]).agrees(reference)


@pytest.mark.slow  # the demo: trains every strategy (the `outcomes` fixture)
def test_fsdp_holds_an_eighth_of_what_data_parallel_holds(outcomes, reference):
    dp, fsdp = outcomes["data-parallel"].cost, outcomes["fsdp"].cost
    assert dp is not None
    assert fsdp is not None
    whole = sum(a.nbytes for a in _arrays(reference.model))
    assert dp.memory.parameters == whole
    assert fsdp.memory.parameters * 8 == whole
    # the AdamW moments follow their parameters; the step count (int32) is replicated
    assert dp.memory.optimizer == 2 * whole + 4
    assert (fsdp.memory.optimizer - 4) * 8 == 2 * whole


@pytest.mark.slow  # the demo: trains every strategy (the `outcomes` fixture)
def test_data_parallel_replicates_everything_and_splits_the_batch(outcomes):
    outcome = outcomes["data-parallel"]
    assert outcome.batch == "b ... -> b8 ..."
    for leaf in _arrays(outcome.model) + _arrays(outcome.state):
        assert leaf.sharding.is_fully_replicated
    # per step, the gradients are summed over 'data', once: every layer's in the scan
    assert _demo.per_step(outcome.cost) == {
        ("all-reduce", ("data",)): sum(a.nbytes for a in _arrays(outcome.model)) + 4
    }


@pytest.mark.slow  # the demo: trains every strategy (the `outcomes` fixture)
def test_fsdp_splits_every_leaf_and_its_moments_over_data(outcomes):
    outcome = outcomes["fsdp"]
    assert outcome.batch == "b ... -> b8 ..."
    for tree in (outcome.model, outcome.state.mu, outcome.state.nu):
        for leaf in _arrays(tree):
            # "default": "fsdp": the largest dim, the last of equals, over 'data'
            dim = max(range(leaf.ndim), key=lambda k: (leaf.shape[k], k))
            assert _spec(leaf) == P(*[None] * dim, "data", *[None] * (leaf.ndim - dim - 1))
            assert leaf.sharding.shard_shape(leaf.shape)[dim] * 8 == leaf.shape[dim]
    assert _spec(outcome.model.embed.weight) == P("data", None)  # (vocab, dim)
    assert _spec(outcome.model.blocks.attn.query_proj.weight) == P(None, None, "data")
    weight = outcome.model.blocks.up.weight  # (layers, hidden, dim): hidden over devices
    rows = _demo_model.HIDDEN // 8
    for shard in weight.addressable_shards:
        start = rows * shard.device.id  # the mesh is every device, in order
        np.testing.assert_array_equal(
            np.asarray(shard.data), np.asarray(weight)[:, start : start + rows]
        )


@pytest.mark.slow  # the demo: trains every strategy (the `outcomes` fixture)
def test_zero_1_replicates_the_parameters_and_splits_the_moments(outcomes, reference):
    outcome, dp = outcomes["zero-1"], outcomes["data-parallel"]
    assert outcome.cost is not None
    assert dp.cost is not None
    assert outcome.batch == "b ... -> b8 ..."
    for leaf in _arrays(outcome.model):
        assert leaf.sharding.is_fully_replicated
    assert outcome.state.steps.sharding.is_fully_replicated
    for tree in (outcome.state.mu, outcome.state.nu):
        for leaf in _arrays(tree):
            # the optimizer section's "default": "fsdp": the largest dim over 'data'
            dim = max(range(leaf.ndim), key=lambda k: (leaf.shape[k], k))
            assert _spec(leaf) == P(*[None] * dim, "data", *[None] * (leaf.ndim - dim - 1))
    moment = outcome.state.mu.blocks.up.weight  # (layers, hidden, dim): hidden over devices
    rows = _demo_model.HIDDEN // 8
    for shard in moment.addressable_shards:
        start = rows * shard.device.id
        np.testing.assert_array_equal(
            np.asarray(shard.data), np.asarray(moment)[:, start : start + rows]
        )
    whole = sum(a.nbytes for a in _arrays(reference.model))
    assert outcome.cost.memory.parameters == dp.cost.memory.parameters == whole
    # an eighth of data parallel's moments; the step count (int32) is replicated
    assert (outcome.cost.memory.optimizer - 4) * 8 == dp.cost.memory.optimizer - 4
    # each device updates its eighth of every parameter: the step gathers them all
    moved = _demo.per_step(outcome.cost)
    assert moved[("all-gather", ("data",))] == whole
    assert ("all-gather", ("data",)) not in _demo.per_step(dp.cost)


@pytest.mark.slow  # the demo: trains every strategy (the `outcomes` fixture)
def test_megatron_splits_heads_units_and_vocabulary_over_model(outcomes):
    outcome = outcomes["megatron"]
    model, mesh = outcome.model, outcome.plan.mesh
    assert dict(zip(mesh.axis_names, mesh.axis_sizes)) == {"model": 8}
    assert outcome.batch == "... -> * ..."
    assert _spec(model.blocks.attn.query_proj.weight) == P(None, "model", None)
    assert _spec(model.blocks.attn.output_proj.weight) == P(None, None, "model")
    assert _spec(model.blocks.down.weight) == P(None, None, "model")
    assert _spec(model.embed.weight) == P("model", None)
    assert model.blocks.norm1.weight.sharding.is_fully_replicated
    assert model.blocks.down.bias.sharding.is_fully_replicated
    # device k holds head k (DIM // HEADS rows of each layer's query projection)
    query = model.blocks.attn.query_proj.weight
    rows = _demo_model.DIM // _demo_model.HEADS
    for shard in query.addressable_shards:
        k = shard.device.id
        np.testing.assert_array_equal(
            np.asarray(shard.data), np.asarray(query)[:, k * rows : (k + 1) * rows]
        )
    # the moments of a weight are laid out as the weight
    assert _spec(outcome.state.mu.blocks.attn.query_proj.weight) == P(None, "model", None)
    assert {axes for _, axes in _demo.per_step(outcome.cost)} == {("model",)}


@pytest.mark.slow  # the demo: trains every strategy (the `outcomes` fixture)
def test_2d_splits_over_model_and_copies_over_data(outcomes):
    outcome = outcomes["2d"]
    mesh = outcome.plan.mesh
    assert dict(zip(mesh.axis_names, mesh.axis_sizes)) == {"data": 2, "model": 4}
    assert outcome.batch == "b ... -> b2 ... 4"
    up = outcome.model.blocks.up.weight  # (layers, hidden, dim): hidden over 'model'
    assert _spec(up) == P(None, "model", None)
    rows = _demo_model.HIDDEN // 4
    for shard in up.addressable_shards:
        k = shard.device.id % 4  # devices 0-3 are data 0, 4-7 data 1: same blocks
        np.testing.assert_array_equal(
            np.asarray(shard.data), np.asarray(up)[:, k * rows : (k + 1) * rows]
        )
    kinds = _demo.per_step(outcome.cost)
    assert {axes for _, axes in kinds} == {("data",), ("model",)}


@pytest.mark.slow  # the demo: trains every strategy (the `outcomes` fixture)
def test_expert_parallel_gives_each_device_its_expert_and_moves_tokens_by_all_to_all(outcomes):
    """Each device holds its own expert of each layer, and a layer hands the tokens to
    their experts and back by one all-to-all each way, twice with the gradient: a
    device sends its 2 rows' slots of every expert, 8 experts x 2 rows x capacity 4
    (16 tokens x 2.0 / 8) x 64 floats, 16 KiB, in each of the 2 layers."""
    outcome = outcomes["expert-parallel"]
    assert outcome.variant is _demo_model.MOE
    up = outcome.model.blocks.experts.up.weight  # (layers, experts, hidden, dim)
    assert _spec(up) == P(None, "data", None, None)
    for shard in up.addressable_shards:
        k = shard.device.id
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(up)[:, k : k + 1])
    assert outcome.model.blocks.experts.router.weight.sharding.is_fully_replicated
    hand = 8 * (_demo_model.BATCH // 8) * 4 * _demo_model.DIM * 4
    assert hand == 16384
    moved = [(c.kind, c.bytes, c.count) for c in outcome.cost.collectives if c.kind != "all-reduce"]
    assert moved == [("all-to-all", hand, _demo_model.LAYERS)] * 4
    assert _demo.per_step(outcome.cost)[("all-to-all", ("data",))] == 4 * 2 * hand


@pytest.mark.slow  # the demo: trains every strategy (the `outcomes` fixture)
def test_context_parallel_splits_each_sequence_and_gathers_keys_and_values(outcomes):
    """Each device holds a quarter of its rows' sequences; each layer gathers its keys
    and its values over `context`, whole for its 2 rows: 2 x 128 x 64 floats."""
    outcome = outcomes["context-parallel"]
    assert outcome.variant is _demo_model.LONG
    assert outcome.batch == "b ... -> b* ... 4"
    for leaf in _arrays(outcome.model):
        assert leaf.sharding.is_fully_replicated
    hand = 2 * 128 * _demo_model.DIM * 4
    gathers = [
        (c.bytes, c.count, c.axes) for c in outcome.cost.collectives if c.kind == "all-gather"
    ]
    assert gathers == [(hand, _demo_model.LAYERS, ("context",))] * 2


@pytest.mark.slow  # the demo: trains every strategy (the `outcomes` fixture)
def test_pipeline_gives_each_stage_its_layer_and_permutes_microbatches(outcomes):
    """4 stages of one layer each, 8 microbatches of 2 rows, each row on its own
    `data` device: every step of the pipeline's loop (8 + 4 - 1 of them) passes one
    row's activations, 16 tokens x 64 floats, to the next stage."""
    outcome = outcomes["pipeline"]
    assert outcome.variant is _demo_model.PIPELINE
    up = outcome.model.blocks.up.weight  # (4 layers, hidden, dim)
    assert _spec(up) == P("stage", None, None)
    for shard in up.addressable_shards:
        k = shard.device.id // 2  # stage-major: devices 2k and 2k + 1 hold stage k
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(up)[k : k + 1])
    (stages,) = outcome.cost.pipelines
    assert (stages.stages, stages.microbatches, stages.iterations) == (4, 8, 11)
    assert stages.bubble == 3 / 11
    hand = 16 * _demo_model.DIM * 4
    forward = [
        (c.bytes, c.count)
        for c in outcome.cost.collectives
        if c.kind == "collective-permute" and "transpose" not in c.source and c.count > 1
    ]
    assert forward == [(hand, 11)]
    (passed,) = [
        e
        for e in outcome.cost.explain()
        if e.collective.kind == "collective-permute"
        and e.collective.count > 1
        and "transpose" not in e.collective.source
    ]
    assert passed.reason == "the pipeline passes activations to the next stage"


def test_a_spec_that_does_not_fit_is_named(devices):
    with pytest.raises(eqshard.SpecError, match=r"needs a multiple of 4 devices"):
        _demo.fits(_demo.spec_path("2d"), devices[:2])
    assert _demo.fits(_demo.spec_path("megatron"), devices[:4]).mesh is not None


@pytest.mark.slow  # the demo: trains every strategy (the `outcomes` fixture)
def test_the_table_and_the_json_report_every_strategy(outcomes, reference, refs, devices):
    ordered = list(outcomes.values())
    console = Console(file=io.StringIO(), width=250)
    console.print(_demo.table(ordered, reference, devices, refs))
    text = console.file.getvalue()  # pyright: ignore[reportAttributeAccessIssue]
    rows = {
        cells[0]: cells
        for cells in (
            [c.strip() for c in line.strip().strip("│").split("│")]
            for line in text.splitlines()
            if line.startswith("│")
        )
        if cells[0]
    }
    assert rows["unsharded"][3:5] == ["457.0 KiB", "914.0 KiB"]
    assert rows["fsdp"][1:5] == ["data=8", "split over data", "57.1 KiB", "114.3 KiB"]
    assert rows["zero-1"][1:5] == ["data=8", "split over data", "457.0 KiB", "114.3 KiB"]
    assert rows["zero-1"][5] == "all-gather over data: 457.0 KiB"
    assert rows["2d"][1] == "data=2 x model=4"
    assert all(rows[name][7].startswith("yes (") for name in _demo.STRATEGIES)
    assert "No step times: simulated CPU devices" in " ".join(text.split())

    assert rows["expert-parallel"][5] == "all-reduce over data: 202.5 KiB"
    assert rows["context-parallel"][1] == "data=2 x context=4"
    assert "(8 experts)" in text
    assert "(seq 128)" in text
    assert rows["pipeline"][1] == "stage=4 x data=2"

    report = _demo.to_json(ordered, reference, devices, refs)
    assert report["ok"] is True
    assert [s["strategy"] for s in report["strategies"]] == list(_demo.STRATEGIES)
    by_name = {s["strategy"]: s for s in report["strategies"]}
    fsdp, dp = by_name["fsdp"], by_name["data-parallel"]
    assert fsdp["parameter_bytes_per_device"] * 8 == dp["parameter_bytes_per_device"]
    assert (by_name["zero-1"]["optimizer_bytes_per_device"] - 4) * 8 == (
        dp["optimizer_bytes_per_device"] - 4
    )
    assert fsdp["seconds_per_step"] is None  # not measured on CPU devices
    moe = by_name["expert-parallel"]
    assert moe["model"] == _demo_model.MOE.title
    assert moe["unsharded_losses"] == list(refs["moe"].losses)
    # against the GPT's unsharded run, the MoE's losses are another model's
    assert not _demo.to_json(ordered, reference, devices)["ok"]


def test_the_minimal_adamw_is_optax_adamw():
    params = {"w": jnp.arange(6.0).reshape(2, 3) / 7, "b": jnp.array([0.5, -1.0])}
    ours = _demo_model.adamw_init(params)
    theirs_opt = optax.adamw(
        _demo_model.LEARNING_RATE,
        _demo_model.B1,
        _demo_model.B2,
        _demo_model.EPS,
        weight_decay=_demo_model.WEIGHT_DECAY,
    )
    theirs = theirs_opt.init(params)
    p_ours = p_theirs = params
    for i in range(3):
        grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)), p_ours)
        u_ours, ours = _demo_model.adamw_update(grads, ours, p_ours)
        u_theirs, theirs = theirs_opt.update(grads, theirs, p_theirs)
        p_ours, p_theirs = (
            optax.apply_updates(p_ours, u_ours),
            optax.apply_updates(p_theirs, u_theirs),
        )
        for a, b in zip(jax.tree.leaves(p_ours), jax.tree.leaves(p_theirs)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
