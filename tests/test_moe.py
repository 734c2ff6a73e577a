"""The mixture of experts of examples/moe.py under expert parallelism (issue 32), over
`data` and on a `data x expert` mesh: it trains as unsharded, each device holding only
its own experts, and XLA:CPU moves the dispatched tokens with all-to-alls of exactly
the bytes counted by hand."""

import importlib.util
import runpy
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqshard

EXAMPLE = Path(__file__).parent.parent / "examples" / "moe.py"


@pytest.fixture(scope="module")
def moe():
    return runpy.run_path(str(EXAMPLE), run_name="moe_example")


def _each_device_holds_its_own_expert(experts, per_device: int = 1, data: int = 1) -> None:
    """Device `d` holds experts `[e * per_device, (e + 1) * per_device)`, where `e` is
    its place on the expert axis: `d` itself over `data` alone; `d % 4` on `data=2 x
    expert=4`, the same experts on both of the `data` axis's devices."""
    for name in ("up", "down"):
        for leaf in (getattr(experts, name).weight, getattr(experts, name).bias):
            blocks = leaf.sharding.devices_indices_map(leaf.shape)
            assert len(blocks) == 8
            for device, index in blocks.items():
                e = jax.devices().index(device) % (8 // data)
                assert index[0] == slice(e * per_device, (e + 1) * per_device), (name, index)
                assert all(i == slice(None) for i in index[1:])
            assert leaf.addressable_shards[0].data.shape[0] == per_device


def test_it_trains_as_unsharded_with_each_device_holding_its_own_expert(moe):
    found = moe["main"](steps=3)
    np.testing.assert_allclose(found["losses"], found["reference"], rtol=1e-5)
    assert moe["SIZES"].experts == len(jax.devices()) == 8
    _each_device_holds_its_own_expert(found["model"].experts)


def test_on_a_data_x_expert_mesh_it_trains_as_unsharded_each_device_its_two_experts(moe):
    found = moe["main"](steps=3, spec=moe["DATA_EXPERT"])
    np.testing.assert_allclose(found["losses"], found["reference"], rtol=1e-5)
    assert dict(found["plan"].mesh.shape) == {"data": 2, "expert": 4}
    _each_device_holds_its_own_expert(found["model"].experts, per_device=2, data=2)
    # the router, the embedding and the head whole on every device
    assert found["model"].head.weight.sharding.is_fully_replicated


@pytest.mark.slow  # compiles the step under each of 9 candidates
def test_suggest_splits_the_experts_within_a_budget_that_replicated_experts_exceed(moe, tmp_path):
    sizes = moe["SIZES"]
    model = eqx.filter_eval_shape(moe["build"])
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(moe["optimizer"]().init, params)
    tokens = jax.ShapeDtypeStruct((sizes.batch, sizes.seq + 1), jnp.int32)
    ranked = eqshard.suggest(
        model, opt_state, tokens, step=moe["step"], devices=8, workers=0, max_memory="300KiB"
    )
    best = ranked.best
    assert best is not None
    assert best.strategy == "expert parallel", str(ranked)
    for name in ("data parallel", "zero-1"):  # the experts whole on every device
        (replicated,) = [s for s in ranked if s.strategy == name]
        assert not replicated.fits, name
    rules = {(r.path, str(r.expr)) for r in best.rules.rules}
    assert ("**.up.weight", "e __ ___ -> e* __ ___") in rules
    assert best.rules.dims["expert"] == "data"
    # the written spec trains as unsharded, each device holding its own expert
    path = tmp_path / "best.eqshard.json"
    eqshard.dump(best.rules, path)
    found = moe["main"](steps=2, spec=path)
    np.testing.assert_allclose(found["losses"], found["reference"], rtol=1e-5)
    _each_device_holds_its_own_expert(found["model"].experts)


def _moved(moe, spec=None, kinds=("all-to-all", "all-gather"), **where):
    sizes = moe["SIZES"]
    model = eqx.filter_eval_shape(moe["build"])
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(moe["optimizer"]().init, params)
    tokens = jax.ShapeDtypeStruct((sizes.batch, sizes.seq + 1), jnp.int32)
    rules = eqshard.load(moe["SPEC"] if spec is None else spec)
    found = eqshard.cost(model, opt_state, tokens, step=moe["step"], spec=rules, **where)
    return [
        (c.kind, c.bytes, c.count, c.axes, c.group_size, "transpose" in c.source)
        for c in found.collectives
        if c.kind in kinds
    ]


def _hand(moe, itemsize: int = 4) -> int:
    """What each device sends in one all-to-all: its sequences' slots of every expert,
    (experts, batch / 8 sequences, capacity, dim), which is also what it receives: its
    expert's slots of every sequence."""
    sizes = moe["SIZES"]
    capacity = moe["capacity"](sizes)
    assert capacity == 8  # 2 picks x 16 tokens x 2.0 / 8 experts
    return sizes.experts * (sizes.batch // 8) * capacity * sizes.dim * itemsize


def test_the_tokens_go_to_their_experts_and_back_by_all_to_alls_of_the_hand_count(moe):
    hand = _hand(moe)
    assert hand == 8192
    # forward: to the experts and back; the gradient: the same two, reversed; nothing
    # gathers the tokens to every device
    assert _moved(moe, devices=8) == [
        ("all-to-all", hand, 1, ("data",), 8, False),
        ("all-to-all", hand, 1, ("data",), 8, False),
        ("all-to-all", hand, 1, ("data",), 8, True),
        ("all-to-all", hand, 1, ("data",), 8, True),
    ]


def test_on_data_x_expert_the_all_to_alls_stay_within_the_expert_axis(moe):
    """Each device holds one group of the 8 (the batch over both axes), so it sends
    the same 8 KiB as over `data` alone, to the 4 devices of its `expert` group. The
    gradients: the experts' all-reduced over `data` (2 experts' up and down, weights
    and biases, 2 x (64 x 32 + 64 + 32 x 64 + 32) floats), the rest over both axes
    (router 8 x 32, embedding 64 x 32, head 32 x 64 + 64, and the loss)."""
    hand = _hand(moe)
    kinds = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter")
    found = _moved(moe, moe["DATA_EXPERT"], kinds, devices=8)
    assert sorted(entry for entry in found if entry[0] == "all-to-all") == sorted(
        ("all-to-all", hand, 1, ("expert",), 4, backward) for backward in (False, False, True, True)
    )
    # the gradients' sums (whose source names the forward or the gradient, by version)
    assert sorted(entry[:5] for entry in found if entry[0] != "all-to-all") == sorted(
        [
            ("all-reduce", 2 * (64 * 32 + 64 + 32 * 64 + 32) * 4, 1, ("data",), 2),
            ("all-reduce", (8 * 32 + 64 * 32 + 32 * 64 + 64 + 1) * 4, 1, ("data", "expert"), 8),
        ]
    )


@pytest.mark.slow  # compiles the step for a TPU slice, twice
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler comes with libtpu (eqshard[tpu])",
)
def test_on_a_tpu_slice_the_same_all_to_alls_and_bfloat16_at_default_precision(moe):
    hand = _hand(moe)
    with jax.default_matmul_precision("highest"):
        assert sorted(_moved(moe, target="v5e:2x4")) == sorted(
            [
                ("all-to-all", hand, 1, ("data",), 8, backward)
                for backward in (False, False, True, True)
            ]
        )
    # the trap: at default precision XLA:TPU moves the forward tokens as bfloat16
    default = _moved(moe, target="v5e:2x4")
    forward = [entry for entry in default if not entry[-1]]
    assert forward == [("all-to-all", _hand(moe, itemsize=2), 1, ("data",), 8, False)] * 2


def _abstract(moe):
    sizes = moe["SIZES"]
    model = eqx.filter_eval_shape(moe["build"])
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(moe["optimizer"]().init, params)
    return model, opt_state, jax.ShapeDtypeStruct((sizes.batch, sizes.seq + 1), jnp.int32)


def test_suggest_writes_the_data_x_expert_spec_by_hand_and_it_trains(moe, tmp_path):
    """`suggest`'s `data x expert` family on `data=2 x expert=4` writes what
    `specs/moe.data_expert.eqshard.json` says: the same layout of every leaf, device
    by device, and the same names, so it trains as unsharded."""
    from eqshard._search._candidates import candidates

    model, opt_state, tokens = _abstract(moe)
    kept, dropped = candidates(moe["step"], model, opt_state, tokens, devices=8)
    names = [c.name for c in kept]
    assert "data x expert on data=4, expert=2" in names
    (found,) = [c for c in kept if c.name == "data x expert on data=2, expert=4"]
    assert (
        "data x expert on data=1, expert=8",
        ("the same layout as expert parallel on data=8, model=1: 'data' has one device"),
    ) in dropped
    assert found.rules.dims == {
        "batch": "*",
        "seq": None,
        "embed": None,
        "expert": "expert",
        "group": "data",
    }
    assert not [c for c in kept if "context" in c.strategy]  # no attention: no sequence
    hand = eqshard.plan(model, eqshard.load(moe["DATA_EXPERT"]), devices=8)
    written = eqshard.plan(model, found.rules, devices=8)
    assert _layouts(written) == _layouts(hand)
    path = tmp_path / "data_expert.eqshard.json"
    eqshard.dump(found.rules, path)
    trained = moe["main"](steps=2, spec=path)
    np.testing.assert_allclose(trained["losses"], trained["reference"], rtol=1e-5)
    _each_device_holds_its_own_expert(trained["model"].experts, per_device=2, data=2)


def _layouts(plan) -> list:
    """Each leaf's mesh and `PartitionSpec`: the same pair, the same devices' blocks."""
    return [(dict(s.mesh.shape), tuple(s.spec)) for s in plan.flat_shardings]
