"""The transformer of examples/long_context.py, sequences 8 times as long as its
batch, under sequence parallelism (Megatron-SP) and context parallelism (issue 32):
each trains as unsharded, and each moves exactly the collectives counted by hand,
per mesh axis."""

import importlib.util
import runpy
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqshard

EXAMPLE = Path(__file__).parent.parent / "examples" / "long_context.py"


@pytest.fixture(scope="module")
def example():
    return runpy.run_path(str(EXAMPLE), run_name="long_context_example")


def _moved(example, spec, **where):
    """`(kind, bytes, axes, backward)` of each gather and scatter one step runs."""
    sizes = example["SIZES"]
    model = eqx.filter_eval_shape(example["build"])
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(example["optimizer"]().init, params)
    tokens = jax.ShapeDtypeStruct((sizes.batch, sizes.seq + 1), jnp.int32)
    with jax.default_matmul_precision("highest"):
        found = eqshard.cost(
            model, opt_state, tokens, step=example["step"], spec=eqshard.load(spec), **where
        )
    return [
        (c.kind, c.bytes, c.axes, "transpose" in c.source)
        for c in found.collectives
        if c.kind in ("all-gather", "reduce-scatter", "all-to-all")
    ]


def _residual(example) -> int:
    """The bytes of the residual stream on one `data` device, whole: 2 sequences of
    32 tokens of 32 floats. A gather over `model` (or `context`) of a sequence split
    4 ways brings it whole."""
    sizes = example["SIZES"]
    return sizes.batch // 2 * sizes.seq * sizes.dim * 4


def test_under_context_parallelism_it_trains_as_unsharded(example):
    sizes = example["SIZES"]
    assert sizes.seq == 8 * sizes.batch
    found = example["main"](steps=3, spec=example["CONTEXT_PARALLEL"])
    np.testing.assert_allclose(found["losses"], found["reference"], rtol=1e-5)
    assert dict(found["plan"].mesh.shape) == {"data": 2, "context": 4}
    weight = found["model"].blocks[0].attention.q.weight
    assert weight.sharding.is_fully_replicated


def test_under_sequence_parallelism_it_trains_as_unsharded_each_device_its_heads(example):
    found = example["main"](steps=3, spec=example["SEQUENCE_PARALLEL"])
    np.testing.assert_allclose(found["losses"], found["reference"], rtol=1e-5)
    assert dict(found["plan"].mesh.shape) == {"data": 2, "model": 4}
    block = found["model"].blocks[0]
    # the query projection column-parallel: device d holds head d % 4's 8 rows
    q = block.attention.q.weight
    for device, index in q.sharding.devices_indices_map(q.shape).items():
        head = jax.devices().index(device) % 4
        assert index == (slice(8 * head, 8 * head + 8), slice(None)), index
    o = block.attention.o.weight  # row-parallel: its columns
    for device, index in o.sharding.devices_indices_map(o.shape).items():
        head = jax.devices().index(device) % 4
        assert index == (slice(None), slice(8 * head, 8 * head + 8)), index
    assert block.norm1.weight.sharding.is_fully_replicated


def test_context_parallel_gathers_the_keys_and_values_over_context_and_nothing_else(example):
    """Each layer gathers its keys and its values over `context`, whole for its 2
    sequences (a residual's bytes: 4 heads of 8 floats are 32); nothing is gathered
    over `data`. The gradient of the gathers is one sum over `context` per layer (K's
    and V's together), which XLA:CPU writes as an all-reduce."""
    hand = _residual(example)
    assert hand == 8192
    layers = example["SIZES"].layers
    found = _moved(example, example["CONTEXT_PARALLEL"], devices=8)
    assert found == [("all-gather", hand, ("context",), False)] * (2 * layers)


def test_sequence_parallel_gathers_the_sequence_before_each_region_on_xla_cpu(example):
    """Before attention and before the MLP, each layer gathers its residual stream's
    sequence over `model`; XLA:CPU sums the row-parallel outputs with an all-reduce
    and slices, where XLA:TPU reduce-scatters (the test below)."""
    hand = _residual(example)
    layers = example["SIZES"].layers
    found = _moved(example, example["SEQUENCE_PARALLEL"], devices=8)
    forward = [entry for entry in found if not entry[-1]]
    assert forward == [("all-gather", hand, ("model",), False)] * (2 * layers)
    assert all(axes == ("model",) for _, _, axes, _ in found)


@pytest.mark.slow  # compiles the step for a TPU slice
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler comes with libtpu (eqshard[tpu])",
)
def test_sequence_parallel_on_a_tpu_slice_gathers_and_reduce_scatters_over_model(example):
    """Megatron-SP as the paper draws it: per layer and region, one all-gather of the
    sequence before it and one reduce-scatter after it, over `model`, each of the
    residual's bytes; the gradient the same, reversed."""
    hand = _residual(example)
    layers = example["SIZES"].layers
    found = _moved(example, example["SEQUENCE_PARALLEL"], target="v5e:2x4")
    forward = sorted(entry for entry in found if not entry[-1])
    assert forward == sorted(
        [("all-gather", hand, ("model",), False)] * (2 * layers)
        + [("reduce-scatter", hand, ("model",), False)] * (2 * layers)
    )
    assert all(axes == ("model",) and n == hand for _, n, axes, _ in found)


def _abstract(example, sizes=None):
    sizes = example["SIZES"] if sizes is None else sizes
    model = eqx.filter_eval_shape(example["build"], sizes)
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(example["optimizer"]().init, params)
    return model, opt_state, jax.ShapeDtypeStruct((sizes.batch, sizes.seq + 1), jnp.int32)


def _layouts(plan) -> list:
    """Each leaf's mesh and `PartitionSpec`: the same pair, the same devices' blocks."""
    return [(dict(s.mesh.shape), tuple(s.spec)) for s in plan.flat_shardings]


def test_suggest_finds_the_sequence_in_the_attention_and_writes_the_spec_by_hand(example):
    """Attention's matmuls show which names are the queries' sequence (`inner_seq`),
    the keys' and values' (`kv_seq`, kept whole), and the residual stream's (`seq`, at
    the same place, of the same length): the `context parallel` candidate on `data=2
    x context=4` is `specs/long_context.cp.eqshard.json`, leaf by leaf and name by
    name."""
    from eqshard._search._candidates import candidates

    model, opt_state, tokens = _abstract(example)
    kept, dropped = candidates(example["step"], model, opt_state, tokens, devices=8)
    names = [c.name for c in kept]
    for name in (
        "context parallel on data=4, context=2",
        "context parallel on data=1, context=8",
        "fsdp x context on data=2, context=4",
        "fsdp x context on data=4, context=2",
    ):
        assert name in names
    assert (
        "fsdp x context on data=1, context=8",
        "the same layout as context parallel on data=1, context=8: 'data' has one device",
    ) in dropped
    (found,) = [c for c in kept if c.name == "context parallel on data=2, context=4"]
    hand = eqshard.load(example["CONTEXT_PARALLEL"])
    assert found.rules.dims == hand.dims
    assert found.rules.to_json()["mesh"] == hand.to_json()["mesh"]
    assert str(found.rules.batch) == str(hand.batch)
    assert _layouts(eqshard.plan(model, found.rules, devices=8)) == _layouts(
        eqshard.plan(model, hand, devices=8)
    )
    assert not [c for c in kept if "expert" in c.strategy]  # no stacked experts


def test_the_fsdp_x_context_spec_suggest_writes_trains_as_unsharded(example, tmp_path):
    from eqshard._search._candidates import candidates

    model, opt_state, tokens = _abstract(example)
    kept, _ = candidates(
        example["step"], model, opt_state, tokens, devices=8, strategies=["fsdp x context"]
    )
    (found,) = [c for c in kept if c.name == "fsdp x context on data=2, context=4"]
    path = tmp_path / "fsdp_context.eqshard.json"
    eqshard.dump(found.rules, path)
    trained = example["main"](steps=2, spec=path)
    np.testing.assert_allclose(trained["losses"], trained["reference"], rtol=1e-5)
    up = trained["model"].blocks[0].mlp.up.weight  # (64, 32): split over data by FSDP
    assert up.addressable_shards[0].data.shape == (32, 32)


def test_with_ring_attention_it_trains_as_unsharded_and_never_gathers_the_keys(example):
    """`Sizes(ring=True)` calls `eqshard.parallel.ring_attention`: under the same spec the keys
    and values stay split, and each layer passes its blocks round the 4 `context`
    devices, 3 times each way: a device's block is 2 sequences x 8 tokens x 32 floats."""
    sizes = example["Sizes"](ring=True)
    found = example["main"](steps=3, spec=example["CONTEXT_PARALLEL"], sizes=sizes)
    np.testing.assert_allclose(found["losses"], found["reference"], rtol=1e-5)
    model, opt_state, tokens = _abstract(example, sizes)
    with jax.default_matmul_precision("highest"):
        cost = eqshard.cost(
            model,
            opt_state,
            tokens,
            step=example["step"],
            spec=eqshard.load(example["CONTEXT_PARALLEL"]),
            devices=8,
        )
    block = sizes.batch // 2 * sizes.seq // 4 * sizes.dim * 4
    assert block == 2048
    ring = [
        (c.bytes, c.count, c.axes, "transpose" in c.source)
        for c in cost.collectives
        if c.kind == "collective-permute" and "ppermute" in c.source
    ]
    forward = [(block, 3, ("context",), False)] * (2 * sizes.layers)
    assert ring == forward + [(block, 3, ("context",), True)] * (2 * sizes.layers)
    assert not [c for c in cost.collectives if c.kind in ("all-gather", "all-to-all")]


def test_a_feature_as_long_as_the_sequence_is_not_taken_for_it():
    """A pooled `("batch", "embed")` activation puts `embed` where the sequence sits
    elsewhere, at the sequence's length (16 = 16): a name found anywhere else than a
    sequence's place is not a sequence, so the context family leaves `embed` whole
    (mapped to `context` too, the spec would map two names of the residual stream to
    one mesh axis)."""
    import optax

    from eqshard._search._candidates import candidates

    T = D = 16

    class Model(eqx.Module):
        wq: jax.Array
        wk: jax.Array
        wv: jax.Array
        head: jax.Array

        def __call__(self, x):
            x = eqshard.constrain(x, ("batch", "seq", "embed"))
            b = x.shape[0]
            q = eqshard.constrain(
                (x @ self.wq).reshape(b, T, 2, 8), ("batch", "inner_seq", "heads", None)
            )
            k = eqshard.constrain(
                (x @ self.wk).reshape(b, T, 2, 8), ("batch", "kv_seq", "heads", None)
            )
            v = eqshard.constrain(
                (x @ self.wv).reshape(b, T, 2, 8), ("batch", "kv_seq", "heads", None)
            )
            s = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
            x = x + jnp.einsum("bhqk,bkhd->bqhd", s, v).reshape(b, T, D)
            pooled = eqshard.constrain(x.mean(1), ("batch", "embed"))
            return (pooled @ self.head)[:, 0]

    def loss(model, data):
        x, y = data
        return jnp.mean((model(x) - y) ** 2)

    optimizer = optax.sgd(1e-3)

    def step(model, state, data):
        grads = jax.grad(loss)(model, data)
        updates, state = optimizer.update(grads, state)
        return eqx.apply_updates(model, updates), state

    square = jnp.zeros((D, D))
    model = eqx.filter_eval_shape(lambda: Model(square, square, square, jnp.zeros((D, 1))))
    state = jax.eval_shape(optimizer.init, model)
    data = (jax.ShapeDtypeStruct((8, T, D), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32))
    kept, _ = candidates(step, model, state, data, devices=8, strategies=["context parallel"])
    assert kept
    for candidate in kept:
        assert candidate.rules.dims["seq"] == candidate.rules.dims["inner_seq"] == "context"
        assert candidate.rules.dims["embed"] is None
        assert candidate.rules.dims["kv_seq"] is None
