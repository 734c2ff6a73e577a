"""Builds of one model: a plan made from one build (abstract or concrete) lays out
every other, `eqx.nn.StateIndex`es included, whose markers are new at each build."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from optimizer_state_oracle import blocks

import eqshard
from eqshard import SpecError

RULES = eqshard.load(
    {
        "eqshard": 1,
        "rules": [
            {"path": "attn.weight", "expr": "o i -> o* i"},
            {"path": "head.weight", "expr": "o i -> o i*"},
            {"path": "cache.init", "expr": "t d -> t d*"},
            {"path": "cache", "expr": "t d -> t d*"},  # the state's value, in a pair
        ],
    }
)


class Cached(eqx.Module):
    """A KV cache as transformer-flows' TarFlow holds one: an `eqx.nn.StateIndex`
    made in `__init__`, without `eqx.nn.make_with_state`."""

    attn: eqx.nn.Linear
    head: eqx.nn.Linear
    cache: eqx.nn.StateIndex

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attn = eqx.nn.Linear(16, 16, key=k1)
        self.head = eqx.nn.Linear(16, 16, key=k2)
        self.cache = eqx.nn.StateIndex(jnp.zeros((4, 16)))


def _build():
    return Cached(jax.random.key(0))


def _assert_laid_out(tree, plan, count=5):
    """Each array leaf holds, device by device, the block the plan gives its place."""
    arrays = [x for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x)]
    planned = [s for s in plan.flat_shardings if s is not None][:count]
    assert len(arrays) == len(planned) == count
    for leaf, sharding in zip(arrays, planned):
        assert blocks(leaf.sharding, leaf.shape) == blocks(sharding, leaf.shape)
    split = [s for s in planned if not s.is_fully_replicated]
    assert len(split) == count - 2  # the plan splits: a full copy would not pass


def test_a_plan_from_an_abstract_build_lays_out_a_model_holding_a_state_index():
    plan = eqshard.plan(eqx.filter_eval_shape(_build), RULES)
    applied = eqshard.apply(_build(), plan)
    _assert_laid_out(applied, plan)
    built = eqshard.init(_build, plan)
    _assert_laid_out(built, plan)
    target = eqshard.abstract(eqx.filter_eval_shape(_build), plan)
    _assert_laid_out(jax.tree_util.tree_map(jnp.zeros_like, target), plan)
    concrete = eqshard.plan(_build(), RULES)  # and the other way round
    _assert_laid_out(eqshard.init(_build, concrete), concrete)


def test_the_moments_of_another_build_take_the_plan_s_layouts():
    optimizer = optax.adam(1e-2)
    plan = eqshard.plan(_build(), RULES)
    state = eqshard.apply(optimizer.init(eqx.filter(_build(), eqx.is_array)), plan)
    _assert_laid_out(state[0].mu, plan)
    _assert_laid_out(state[0].nu, plan)


class Twice(eqx.Module):
    a: eqx.nn.StateIndex
    b: eqx.nn.StateIndex

    def __init__(self, shared):
        self.a = eqx.nn.StateIndex(jnp.zeros((8, 16)))
        self.b = self.a if shared else eqx.nn.StateIndex(jnp.zeros((8, 16)))


def test_builds_whose_indexes_are_shared_otherwise_are_not_alike():
    plan = eqshard.plan(Twice(shared=True), "t d -> t d*")
    alike = eqshard.apply(Twice(shared=True), plan)  # another build
    assert isinstance(alike.b.init, jax.Array)
    assert not alike.b.init.sharding.is_fully_replicated
    with pytest.raises(SpecError, match="no subtree of this tree has its structure"):
        eqshard.apply(Twice(shared=False), plan)


def test_a_pair_with_its_state_is_laid_out_by_the_plan_of_another_build():
    def pair():
        model = _build()
        return model, eqx.nn.State(model)

    plan = eqshard.plan(pair(), RULES)
    _assert_laid_out(eqshard.apply(pair(), plan), plan, count=6)
