"""Building a model straight into its shards."""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqshard
from eqshard._init import _compiled, _groups
from eqshard._rng_lowering import unrolled_threefry


class Block(eqx.Module):
    """An attention block of `eqx.nn` modules, with dropout and layer norm."""

    attn: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = eqx.nn.MultiheadAttention(4, 32, key=k1)
        self.norm = eqx.nn.LayerNorm(32)
        self.up = eqx.nn.Linear(32, 128, key=k2)
        self.down = eqx.nn.Linear(128, 32, key=k3)
        self.dropout = eqx.nn.Dropout(0.25)


RULES = eqshard.load(
    {
        "eqshard": 1,
        "rules": [
            {"path": "**.*_proj.weight", "expr": "... o i -> ... o* i"},
            {"path": "**.up.weight", "expr": "... o i -> ... o* i"},
            {"path": "**.up.bias", "expr": "... o -> ... o*"},
            {"path": "**.down.weight", "expr": "... o i -> ... o i*"},
        ],
    }
)


def _stacked():
    return eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 2))


@pytest.mark.parametrize(
    "factory",
    [functools.partial(Block, jax.random.key(0)), _stacked],
    ids=["block", "stacked blocks"],
)
def test_init_equals_build_then_apply(factory):
    built = eqshard.init(factory, RULES)
    expected = eqshard.apply(factory(), RULES)
    for a, b in zip(jax.tree_util.tree_leaves(built), jax.tree_util.tree_leaves(expected)):
        if eqx.is_array(b):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit for bit
        else:
            assert a == b
    assert type(built.dropout.p) is float  # not an array, as under jax.jit(out_shardings=...)
    assert built.dropout.p == 0.25
    x = jnp.ones((2, 8, 32) if factory is _stacked else (8, 32))
    if factory is not _stacked:
        out = eqx.filter_jit(lambda m, x: m.attn(x, x, x))(built, x)
        np.testing.assert_allclose(out, expected.attn(x, x, x), rtol=1e-5, atol=1e-6)


def test_no_device_holds_more_of_a_leaf_than_its_shard():
    def factory():
        return eqx.nn.MLP(256, 256, 512, 2, key=jax.random.key(0))

    spec = eqshard.load({"eqshard": 1, "rules": [{"path": "**.weight", "expr": "o i -> o* i"}]})
    plan = eqshard.plan(eqx.filter_eval_shape(factory), spec)
    leaves = plan.resolved.leaves
    shard = {i: s.shard_shape(leaves[i].shape) for i, s in enumerate(plan.flat_shardings) if s}
    groups = _groups(list(leaves))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
    assert [i for group in groups for i in group] == arrays
    for group in groups:  # the programs `init` runs, one per group of leaves
        compiled = _compiled(factory, plan, group)
        analysis = compiled.memory_analysis()
        assert analysis is not None
        shards = [int(np.prod(shard[i])) for i in group]
        # per device: its shards of the group alone (and a few bytes of a tuple table)
        assert 4 * sum(shards) <= analysis.output_size_in_bytes < 4 * sum(shards) + 256
        # no random-number temporaries (rolled, they are 3x the group's shards): the
        # hash is fused into the loop that writes each output; a few keys remain
        assert analysis.temp_size_in_bytes < 4096 < 4 * max(shards)
        # and no buffer of the program, temporaries included, is larger than a shard
        sizes = [
            int(np.prod([int(d) for d in dims.split(",")]))
            for dims in re.findall(r"\w+\[(\d+(?:,\d+)*)\]", compiled.as_text())
        ]
        assert max(sizes) <= max(shards)
    assert max(int(np.prod(shard[i])) for i in arrays) < 512**2  # every weight is split


def test_unrolled_threefry_is_scoped_and_changes_no_value():
    def uniform(n):
        return jax.random.uniform(jax.random.key(3), (256, 256), maxval=n)

    def temp(compiled):
        analysis = compiled.memory_analysis()
        assert analysis is not None
        return analysis.temp_size_in_bytes

    with unrolled_threefry() as took_effect:
        assert took_effect  # JAX still keeps its rules where `_rng_lowering` looks
        unrolled = jax.jit(functools.partial(uniform, 1.0)).lower().compile()
    assert temp(unrolled) < 1024
    # outside the block, the user's programs lower as JAX lowers them (rolled on CPU)
    rolled = jax.jit(functools.partial(uniform, 1.0)).lower().compile()
    assert temp(rolled) >= 2 * 256 * 256 * 4
    assert np.array_equal(np.asarray(unrolled()), np.asarray(rolled()))


def test_init_names_a_factory_that_cannot_be_traced():
    with pytest.raises(eqshard.EqshardError, match="`factory` takes no arguments"):
        eqshard.init(lambda key: eqx.nn.Linear(2, 2, key=key))  # type: ignore[misc]
