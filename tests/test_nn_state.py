"""Stateful models: `eqx.nn.State` (BatchNorm's running statistics) named by its
layers, laid out by the model's plan, built by `init`, restored and trained."""

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness_models import NET_SPEC, Net
from jaxtyping import Array, Float

import eqshard
from eqshard._fields import key_paths, leaf_name

RULES = eqshard.load(NET_SPEC)


def _made(mode: Literal["ema", "batch"] = "batch"):
    return eqx.nn.make_with_state(Net)(jax.random.key(0), mode)


def _names(tree):
    return [leaf_name(path) for path in key_paths(tree)]


def test_state_leaves_are_named_by_their_layers():
    model, state = _made("ema")
    assert _names(state) == [
        "bn.ema_first_time_index",
        "bn.ema_state_index.0",  # the running mean
        "bn.ema_state_index.1",  # the running variance
    ]
    # A (model, state) pair is one stateful model: each named as in its own part.
    assert _names((model, state)) == [
        "conv.weight",
        "conv.bias",
        "bn.weight",
        "bn.bias",
        "bn.axis_name",
        "bn.inference",
        "head.weight",
        "head.bias",
        *_names(state),
    ]
    assert _names((model, state, 1))[-2:] == ["1.bn.ema_state_index.1", "2"]
    report = eqshard.report(state, eqshard.plan(model, RULES))
    assert [(row.path, row.origin) for row in report.rows] == [
        ("bn.ema_first_time_index", "default"),
        ("bn.ema_state_index.0", "$.rules[1]"),
        ("bn.ema_state_index.1", "$.rules[1]"),
    ]


def test_dims_reach_the_state_through_the_layers_annotations():
    model, state = _made()
    rules = eqshard.load({"eqshard": 1, "dims": {"input_size": "*"}})
    plan = eqshard.plan((model, state), rules)
    rows = {row.path: row for row in eqshard.report((model, state), plan).rows}
    # BatchNorm's `StateIndex[tuple[Float[Array, "input_size"], ...]]` names the dim.
    for name in ("bn.weight", "bn.batch_state_index.0", "bn.batch_state_index.1"):
        assert rows[name].expression == "input_size -> input_size*", name
        assert rows[name].origin == "dims"
    assert rows["bn.batch_counter"].expression == "... -> * ..."


def test_a_plan_from_the_model_lays_out_its_state():
    model, state = _made()
    plan = eqshard.plan(model, RULES)  # no warning: the state's rule is for its state
    placed = eqshard.apply(state, plan)
    counter, (mean, var) = (
        jax.tree_util.tree_leaves(placed)[:1],
        jax.tree_util.tree_leaves(placed)[1:],
    )
    assert counter[0].sharding.is_fully_replicated
    for leaf in (mean, var):
        assert leaf.sharding.spec == jax.sharding.PartitionSpec("m0")
        assert {d.id: i[0] for d, i in leaf.sharding.devices_indices_map((16,)).items()} == {
            k: slice(2 * k, 2 * k + 2) for k in range(8)
        }
    abstract = eqshard.abstract(state, plan)
    assert [x.sharding for x in jax.tree_util.tree_leaves(abstract)] == [
        x.sharding for x in jax.tree_util.tree_leaves(placed)
    ]
    np.testing.assert_array_equal(np.asarray(var), np.asarray(jax.tree_util.tree_leaves(state)[2]))


def test_a_plan_from_the_pair_lays_out_the_optimizer_state():
    model, state = _made()
    plan = eqshard.plan((model, state), RULES)
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    laid_out = eqshard.abstract(opt_state, plan)
    assert laid_out[0].mu.conv.weight.sharding == plan.shardings[0].conv.weight
    assert laid_out[0].nu.head.weight.sharding.spec == jax.sharding.PartitionSpec(None, "m0")
    assert laid_out[0].mu.bn.weight.sharding.spec == jax.sharding.PartitionSpec("m0")  # dims
    state_alone = eqshard.abstract(state, plan)
    assert (
        jax.tree_util.tree_leaves(state_alone)[1].sharding
        == jax.tree_util.tree_leaves(plan.shardings[1])[1]
    )


def test_init_builds_a_model_and_its_state_in_their_shards():
    model, state = eqshard.init(_made, RULES)
    want_model, want_state = _made()
    assert model.conv.weight.sharding == eqshard.plan(_made(), RULES).shardings[0].conv.weight
    mean = jax.tree_util.tree_leaves(state)[1]
    assert mean.sharding.spec == jax.sharding.PartitionSpec("m0")
    for got, want in zip(
        jax.tree_util.tree_leaves((model, state)),
        jax.tree_util.tree_leaves((want_model, want_state)),
    ):
        if eqx.is_array(want):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert model.bn.axis_name == "batch"  # non-array leaves as the factory makes them


def _loss(model, state, x, y):
    out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return jnp.mean((out - y) ** 2), state


def _step(optimizer, plan):
    @eqx.filter_jit
    def step(model, state, opt_state, x, y) -> Any:
        (value, state), grads = eqx.filter_value_and_grad(_loss, has_aux=True)(model, state, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        if plan is not None:
            model, state = eqshard.constrain((model, state), plan)
            opt_state = eqshard.constrain(opt_state, plan)
        return model, state, opt_state, value

    return step


@pytest.mark.slow  # trains sharded and unsharded and compares
def test_a_sharded_training_step_equals_the_unsharded_one(tmp_path):
    # SGD with momentum: Adam would turn the conv bias's gradient, zero up to the
    # last bits (BatchNorm takes the mean out), into whole steps of noise.
    optimizer = optax.sgd(1e-2, momentum=0.9)
    x = jax.random.normal(jax.random.key(1), (16, 3, 8, 8))
    y = jax.random.normal(jax.random.key(2), (16, 8))
    model, state = _made()
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    plan = eqshard.plan((model, state), RULES)
    sharded = [*eqshard.apply((model, state), plan), eqshard.apply(opt_state, plan)]
    xs, ys = eqshard.apply(x, "b ... -> b* ..."), eqshard.apply(y, "b ... -> b* ...")
    plain = [model, state, opt_state]
    for _ in range(2):
        *plain, loss = _step(optimizer, None)(plain[0], plain[1], plain[2], x, y)
        *sharded, sharded_loss = _step(optimizer, plan)(sharded[0], sharded[1], sharded[2], xs, ys)
        np.testing.assert_allclose(sharded_loss, loss, rtol=1e-5)
    arrays = eqx.filter((sharded, plain), eqx.is_array)
    for got, want in zip(
        jax.tree_util.tree_leaves(arrays[0]), jax.tree_util.tree_leaves(arrays[1])
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    # every leaf of the new state kept its layout: the running statistics split
    mean = jax.tree_util.tree_leaves(sharded[1])[1]
    assert mean.sharding.spec == jax.sharding.PartitionSpec("m0")
    assert not np.allclose(np.asarray(mean), 0)  # the batch statistics moved it

    # restored on 4 devices, straight into the plan's layouts there
    path = tmp_path / "state.eqx"
    eqx.tree_serialise_leaves(path, tuple(sharded))
    like = eqx.filter_eval_shape(
        lambda: (*_made(), optimizer.init(eqx.filter(_made()[0], eqx.is_array)))
    )
    four = eqshard.plan(like[:2], RULES, devices=jax.devices()[:4])
    restored = eqshard.restore(path, like, four)
    assert jax.tree_util.tree_leaves(restored[1])[1].sharding.num_devices == 4
    assert restored[2][0].trace.conv.weight.sharding == four.shardings[0].conv.weight
    arrays = eqx.filter((restored, tuple(sharded)), eqx.is_array)
    for got, want in zip(
        jax.tree_util.tree_leaves(arrays[0]), jax.tree_util.tree_leaves(arrays[1])
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("spec", ["... -> * ...", eqshard.resolvers.FROM_FIELDS])
def test_expressions_and_annotations_lay_out_the_state_too(spec):
    model, state = _made()
    placed = eqshard.apply(state, eqshard.plan(model, spec))
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree_util.tree_leaves(placed))


def _rules(*rules, **more):
    return eqshard.load({"eqshard": 1, "rules": [{"path": p, "expr": e} for p, e in rules], **more})


def test_a_state_rule_that_matches_nothing_is_a_warning():
    model, state = _made()
    typo = _rules(("bn.batch_state_index", "c -> c*"))  # no `.*`: the index, not its items
    with pytest.warns(eqshard.UnusedRuleWarning, match=r"'bn.batch_state_index' matched no leaf"):
        eqshard.plan((model, state), typo)  # the pair holds the state's leaves
    too_far = _rules(("bn.batch_state_index.2", "c -> c*"))  # a pair of statistics: .0, .1
    with pytest.warns(eqshard.UnusedRuleWarning, match=r"'bn.batch_state_index.2' matched no"):
        plan = eqshard.plan(model, too_far)  # the model alone: its annotation says two items
    fine = eqshard.plan(model, _rules(("bn.batch_state_index.1", "c -> c*")))  # no warning
    # Where the index's annotation does not say what it holds, a rule for its items
    # passes the model's plan, and is checked when the plan meets the state.
    model_of_any, state_of_three = eqx.nn.make_with_state(Unannotated)()
    plan_of_any = eqshard.plan(model_of_any, _rules(("index.5", "c -> c*")))
    with pytest.warns(eqshard.UnusedRuleWarning, match="'index.5' matched no leaf of the state"):
        eqshard.apply(state_of_three, plan_of_any)
    assert jax.tree_util.tree_leaves(eqshard.apply(state, fine))[2].sharding.spec == (
        jax.sharding.PartitionSpec("m0")
    )
    del plan


def test_a_state_made_without_make_with_state_is_named_by_its_layers_in_a_pair():
    unpacked = Net(jax.random.key(0))
    state = eqx.nn.State(unpacked)  # markers are objects, not paths
    model = eqx.nn.delete_init_state(unpacked)
    names = _names((model, state))
    assert names[-3:] == ["bn.batch_counter", "bn.batch_state_index.0", "bn.batch_state_index.1"]
    assert len(set(names)) == len(names)
    plan = eqshard.plan((model, state), RULES)
    assert jax.tree_util.tree_leaves(plan.shardings[1])[1].spec == jax.sharding.PartitionSpec("m0")
    alone = eqshard.apply(state, eqshard.plan(model, RULES))  # named through the model
    assert jax.tree_util.tree_leaves(alone)[1].sharding.spec == jax.sharding.PartitionSpec("m0")


def test_a_state_laid_out_by_the_models_plan_is_laid_out_as_in_the_pairs():
    model, state = _made()
    for spec in (
        eqshard.load({"eqshard": 1, "default": "fsdp"}),
        _rules(("conv.weight", "o ... -> o2 ... 4"), default="fsdp"),  # a (2, 4) mesh
    ):
        pair = eqshard.plan((model, state), spec)
        alone = eqshard.apply(state, eqshard.plan(model, spec))
        for got, want in zip(
            jax.tree_util.tree_leaves(alone), jax.tree_util.tree_leaves(pair.shardings[1])
        ):
            assert _blocks(got.sharding, got.shape) == _blocks(want, got.shape)

    own_mesh = _rules(("bn.*_state_index.*", "c -> 2 c4"))  # the model's layouts: one axis
    with pytest.raises(eqshard.SpecError, match=r"make the plan from `\(model, state\)`, so"):
        eqshard.apply(state, eqshard.plan(model, own_mesh))
    placed = eqshard.apply((model, state), eqshard.plan((model, state), own_mesh))[1]
    assert jax.tree_util.tree_leaves(placed)[1].sharding.spec == jax.sharding.PartitionSpec("m1")


class Unannotated(eqx.Module):
    index: eqx.nn.StateIndex

    def __init__(self):
        self.index = eqx.nn.StateIndex((jnp.zeros(8), jnp.zeros(8), jnp.zeros(8)))


def _blocks(sharding, shape):
    return {
        d.id: tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(i, shape))
        for d, i in sharding.devices_indices_map(tuple(shape)).items()
    }


class Other(eqx.Module):
    bn: eqx.nn.BatchNorm

    def __init__(self):
        self.bn = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")


def test_another_models_state_is_refused():
    model, _ = _made()
    _, other = eqx.nn.make_with_state(Other)()
    with pytest.raises(
        eqshard.SpecError,
        match=r"the state: this eqx.nn.State holds values of StateIndexes that are not in the "
        r"plan's model \('Other.bn.batch_counter', 'Other.bn.batch_state_index'\); lay it out "
        r"with the plan of the model it was made with",
    ):
        eqshard.apply(other, eqshard.plan(model, RULES))


def test_a_pairs_spec_tree_dumps_and_loads_to_the_same_layouts(tmp_path):
    model, state = _made()
    plan = eqshard.plan((model, state), RULES)
    eqshard.dump(eqshard.spec_tree((model, state), RULES), tmp_path / "net.eqshard.json")
    again = eqshard.plan((model, state), eqshard.load(tmp_path / "net.eqshard.json"))  # no warning
    assert again.flat_shardings == plan.flat_shardings


class Ring(eqx.Module):
    """Any number of buffers of one shape: `StateIndex[tuple[Float[Array, "c"], ...]]`."""

    index: eqx.nn.StateIndex[tuple[Float[Array, " c"], ...]]

    def __init__(self):
        self.index = eqx.nn.StateIndex((jnp.zeros(8), jnp.zeros(8), jnp.zeros(8)))


def test_a_state_annotated_as_a_tuple_of_any_length_gives_each_item_its_dims():
    model, state = eqx.nn.make_with_state(Ring)()
    rows = eqshard.report(
        state, eqshard.plan(model, eqshard.load({"eqshard": 1, "dims": {"c": "*"}}))
    ).rows
    assert [(row.path, row.expression) for row in rows] == [
        (f"index.{k}", "c -> c*") for k in range(3)
    ]


def test_a_pairs_plan_names_what_a_state_leaf_follows():
    model, state = _made()
    plan = eqshard.plan((model, state), RULES)
    rows = eqshard.report((model, state, 0), plan).rows
    assert {row.path: row.origin for row in rows}["1.bn.batch_state_index.0"] == (
        "state bn.batch_state_index.0"
    )
    assert {row.path: row.origin for row in rows}["0.conv.weight"] == "parameter conv.weight"
