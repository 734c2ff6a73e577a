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
