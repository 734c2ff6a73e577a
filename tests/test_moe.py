"""The mixture of experts of examples/moe.py under expert parallelism (issue 32):
it trains as unsharded, each device holding its own expert, and XLA:CPU moves the
dispatched tokens with all-to-alls of exactly the bytes counted by hand."""

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


def test_it_trains_as_unsharded_with_each_device_holding_its_own_expert(moe):
    found = moe["main"](steps=3)
    np.testing.assert_allclose(found["losses"], found["reference"], rtol=1e-5)
    experts = found["model"].experts
    sizes = moe["SIZES"]
    assert sizes.experts == len(jax.devices()) == 8
    for name in ("up", "down"):
        for leaf in (getattr(experts, name).weight, getattr(experts, name).bias):
            blocks = leaf.sharding.devices_indices_map(leaf.shape)
            for device, index in blocks.items():
                expert = jax.devices().index(device)
                assert index[0] == slice(expert, expert + 1), (name, device, index)
                assert all(i == slice(None) for i in index[1:])
            assert leaf.addressable_shards[0].data.shape[0] == 1


def test_the_dispatch_and_the_combine_are_all_to_alls_of_the_hand_counted_bytes(moe):
    sizes = moe["SIZES"]
    model = eqx.filter_eval_shape(moe["build"])
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(moe["optimizer"]().init, params)
    tokens = jax.ShapeDtypeStruct((sizes.batch, sizes.seq + 1), jnp.int32)
    spec = eqshard.load(moe["SPEC"])
    found = eqshard.cost(model, opt_state, tokens, step=moe["step"], spec=spec, devices=8)
    # each device sends its groups' slots of every expert: (experts, batch / 8 groups,
    # capacity, dim) float32, and receives its expert's slots of every group
    groups = sizes.batch // 8
    capacity = moe["capacity"](sizes)
    assert capacity == 8  # 2 picks x 16 tokens x 2.0 / 8 experts
    hand = sizes.experts * groups * capacity * sizes.dim * 4
    forward = {
        "dispatch": "jvp(gsec,gsd->egcd)",
        "combine": "jvp(gsec,egcd->gsd)",
    }
    for what, op in forward.items():
        moved = [
            c
            for c in found.collectives
            if c.kind == "all-to-all" and op in c.source and "transpose" not in c.source
        ]
        assert [(c.bytes, c.count, c.axes, c.group_size) for c in moved] == [
            (hand, 1, ("data",), 8)
        ], what
    # no token is gathered to every device on the way to the experts
    assert not [
        c
        for c in found.collectives
        if c.kind == "all-gather" and "transpose" not in c.source and "egcd" in c.source
    ]
