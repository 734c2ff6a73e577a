"""The whole training state from one spec: optimizer states laid out like their
parameters, stacked layers, and `report`."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import Array, Float

import eqshard
from eqshard import SpecError
from eqshard._paths import segments

RULES = {
    "eqshard": 1,
    "rules": [
        {"path": "layers.0.weight", "expr": "o i -> o* i"},
        {"path": "layers.0.bias", "expr": "o -> o*"},
        {"path": "layers.1.weight", "expr": "o i -> o i*"},
    ],
}


def _model():
    return eqx.nn.MLP(16, 16, 64, 1, key=jax.random.key(0))


def _blocks(sharding, shape):
    return {
        d.id: tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(i, shape))
        for d, i in sharding.devices_indices_map(tuple(shape)).items()
    }


def _weights_only(model):
    return jax.tree_util.tree_map(lambda x: eqx.is_array(x) and x.ndim == 2, model)


OPTIMIZERS = {
    "adam": lambda model: optax.adam(1e-3),
    "adamw with a mask": lambda model: optax.adamw(1e-3, mask=_weights_only(model)),
    "masked adam": lambda model: optax.masked(optax.adam(1e-3), _weights_only(model)),
    "multi_transform": lambda model: optax.multi_transform(
        {"w": optax.adam(1e-3), "b": optax.sgd(1e-3, momentum=0.9)},
        # a callable: a tree of labels that is an eqx.Module would be called by optax
        lambda params: jax.tree_util.tree_map(lambda m: "w" if m else "b", _weights_only(params)),
    ),
    "adafactor": lambda model: optax.adafactor(1e-3, min_dim_size_to_factor=8),
    "chain(clip, adamw)": lambda model: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
    ),
    "lion": lambda model: optax.lion(1e-3),
    "MultiSteps": lambda model: optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
}


def _parameter_of(path, params):
    """The parameter whose path ends `path`, if it has the same shape: what a moment
    must be laid out like."""
    segs = segments(path)
    for k in range(len(segs)):
        if segs[k:] in params:
            return params[segs[k:]]
    return None


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_moment_has_its_parameters_blocks(name):
    model = _model()
    plan = eqshard.plan(model, eqshard.load(RULES))
    params = {
        segments(path): (leaf.shape, sharding)
        for (path, leaf), sharding in zip(
            jax.tree_util.tree_flatten_with_path(model)[0], plan.flat_shardings
        )
        if sharding is not None
    }
    optimizer = OPTIMIZERS[name](model)
    state = eqshard.apply(optimizer.init(eqx.filter(model, eqx.is_array)), plan)
    report = eqshard.report(state, plan)
    followed = expected_bytes = 0
    for (path, leaf), row in zip(jax.tree_util.tree_flatten_with_path(state)[0], report.rows):
        parameter = _parameter_of(path, params)
        if parameter is not None and parameter[0] == leaf.shape:
            assert _blocks(leaf.sharding, leaf.shape) == _blocks(parameter[1], leaf.shape), path
            assert row.origin == f"parameter {'.'.join(segments(path)[-3:])}"
            shards = math.prod(parameter[1].shard_shape(leaf.shape))
            expected_bytes += shards * leaf.dtype.itemsize
            followed += leaf.ndim > 0 and leaf.sharding.num_devices == 8
        else:  # step counts, factored moments
            assert leaf.sharding.is_fully_replicated, path
            assert row.origin == "replicated: no parameter here"
            expected_bytes += leaf.nbytes
    assert followed >= (2 if name in ("masked adam", "adafactor") else 3)
    assert report.bytes_per_device == expected_bytes


def test_a_jitted_step_keeps_every_layout_with_one_trace():
    model = _model()
    plan = eqshard.plan(model, eqshard.load(RULES))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    model = eqshard.apply(model, plan)
    state = eqshard.apply(optimizer.init(eqx.filter(model, eqx.is_array)), plan)
    before = jax.tree_util.tree_map(lambda x: x.sharding, (eqx.filter(model, eqx.is_array), state))
    x, y = jax.random.normal(jax.random.key(1), (8, 16)), jnp.zeros((8, 16))
    traces = []

    @eqx.filter_jit
    def step(model, state, x, y):
        traces.append(1)
        grads = eqx.filter_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return eqshard.constrain(model, plan), eqshard.constrain(state, plan)

    for _ in range(3):
        model, state = step(model, state, x, y)
    leaves = jax.tree_util.tree_leaves((eqx.filter(model, eqx.is_array), state))
    for leaf, sharding in zip(leaves, jax.tree_util.tree_leaves(before)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    assert len(traces) == 1


class Layer(eqx.Module):
    w: Float[Array, "o i"] = eqshard.field("o* i")
    b: Float[Array, " o"] = eqshard.field("o*")

    def __init__(self, key):
        self.w = jax.random.normal(key, (16, 16)) / 4
        self.b = jnp.zeros(16)

    def __call__(self, x):
        return jax.nn.relu(self.w @ x + self.b)


def _stack():
    return eqx.filter_vmap(Layer)(jax.random.split(jax.random.key(0), 3))


@pytest.mark.parametrize(
    "spec",
    [
        eqshard.FROM_FIELDS,
        eqshard.load({"eqshard": 1, "dims": {"o": "*"}}),
        eqshard.load(
            {"eqshard": 1, "rules": [{"path": "w", "expr": "o*"}, {"path": "b", "expr": "o*"}]}
        ),
    ],
    ids=["annotations", "dims", "short forms in rules"],
)
def test_stacked_layers_split_the_dims_their_annotations_name(spec):
    stack = _stack()
    plan = eqshard.plan(stack, spec)
    assert plan.partition_specs.w == jax.sharding.PartitionSpec(None, "m0", None)
    assert plan.partition_specs.b == jax.sharding.PartitionSpec(None, "m0")
    placed = eqshard.apply(stack, plan)

    def run(stack, x):
        def body(x, layer):
            return layer(x), None

        params, static = eqx.partition(stack, eqx.is_array)
        return jax.lax.scan(lambda x, p: body(x, eqx.combine(p, static)), x, params)[0]

    x = jnp.ones(16)
    np.testing.assert_allclose(eqx.filter_jit(run)(placed, x), run(stack, x), rtol=1e-5)
    state = eqshard.apply(optax.adam(1e-3).init(eqx.filter(stack, eqx.is_array)), plan)
    assert state[0].mu.w.sharding == placed.w.sharding


def test_a_full_form_that_names_too_few_axes_suggests_the_ellipsis():
    stack = _stack()
    spec = eqx.tree_at(lambda s: s.w, eqshard.spec(stack), "o i -> o* i")
    with pytest.raises(SpecError) as info:
        eqshard.plan(stack, spec)
    assert "for a stack of layers: '... o i -> ... o* i'" in str(info.value)
    fixed = eqx.tree_at(lambda s: s.w, eqshard.spec(stack), "... o i -> ... o* i")
    assert eqshard.plan(stack, fixed).partition_specs.w == jax.sharding.PartitionSpec(
        None, "m0", None
    )


def test_report_shows_where_every_leaf_goes():
    model = _model()
    plan = eqshard.plan(model, eqshard.load(RULES))
    text = str(eqshard.report(model, plan))
    assert "layers.0.weight" in text
    assert "o i -> o* i" in text
    assert "$.rules[0]" in text
    assert "... -> * ..." in text  # layers.1.bias, by the default
    assert "default" in text
    report = eqshard.report(model, plan)
    assert report.total_bytes == sum(
        x.nbytes for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    )
    assert report.bytes_per_device == (64 * 16 + 64 + 16 * 64) * 4 // 8 + 16 * 4
    assert f"each device holds {eqshard._report.human_bytes(report.bytes_per_device)}" in text
    assert report.to_json()["bytes_per_device"] == report.bytes_per_device


def test_errors_never_print_a_whole_plan():
    model = _model()
    plan = eqshard.plan(model, eqshard.load(RULES))
    assert repr(plan) == "Plan(mesh=Mesh('m0': 8, axis_types=(Auto,)), leaves=4)"
    with pytest.raises(SpecError) as info:
        eqshard.plan({"a": jnp.ones(8)}, {"a": plan})
    assert len(str(info.value)) < 300
    assert "the spec holds Plan Plan(mesh=" in str(info.value)


def test_named_tuple_fields_keep_their_own_names():
    state = optax.adam(1e-3).init({"w": jnp.zeros((8, 4))})
    plan = eqshard.plan(
        state, eqshard.load({"eqshard": 1, "rules": [{"path": "0.nu.w", "expr": "o i -> o* i"}]})
    )
    assert plan.resolved.paths == ["0.count", "0.mu.w", "0.nu.w"]
    assert plan.partition_specs[0].nu["w"] == jax.sharding.PartitionSpec("m0", None)
