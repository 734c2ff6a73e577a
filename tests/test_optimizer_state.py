"""The whole training state from one spec: optimizer states laid out like their
parameters, stacked layers, and `report`."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jaxtyping import Array, Float
from optimizer_state_oracle import blocks, expected_shardings, parameters_of

import eqshard
from eqshard import SpecError

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
    "prefix-masked adam": lambda model: optax.masked(optax.adam(1e-3), _every_other_subtree),
}


def _every_other_subtree(params):
    """A prefix mask: every other child of the root, masked whole."""
    children, treedef = jax.tree_util.tree_flatten(params, is_leaf=lambda x: x is not params)
    return jax.tree_util.tree_unflatten(treedef, [k % 2 == 0 for k in range(len(children))])


def _assert_laid_out_as(laid_out, expected):
    leaves = jax.tree_util.tree_leaves(laid_out)
    assert len(leaves) == len(expected)
    for k, (leaf, want) in enumerate(zip(leaves, expected)):
        if want is None:
            assert leaf.sharding.is_fully_replicated, (k, leaf)
        else:
            assert leaf.sharding == want, (k, leaf.sharding, want)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_moment_has_its_parametersblocks(name):
    model = _model()
    plan = eqshard.plan(model, eqshard.load(RULES))
    params = eqx.filter(model, eqx.is_array)
    optimizer = OPTIMIZERS[name](model)
    state = eqshard.apply(optimizer.init(params), plan)
    expected = expected_shardings(optimizer, state, params, plan)
    _assert_laid_out_as(state, expected)
    for leaf, want in zip(jax.tree_util.tree_leaves(state), expected):
        if want is not None:  # device by device, the parameter's blocks
            assert blocks(leaf.sharding, leaf.shape) == blocks(want, leaf.shape)
    report = eqshard.report(state, plan)
    names = [row.path for row in eqshard.report(model, plan).rows]
    for row, leaf, i, want in zip(
        report.rows,
        jax.tree_util.tree_leaves(state),
        parameters_of(optimizer, state, params),
        expected,
    ):
        if want is not None:
            assert row.origin == f"parameter {names[i]}"
        elif i >= 0:  # Adafactor's factored moments
            assert row.origin == (
                f"replicated: its shape {leaf.shape} is not parameter {names[i]}'s "
                f"{jax.tree_util.tree_leaves(params)[i].shape}"
            )
        else:  # step counts
            assert row.origin == "replicated: no parameter here"
    assert sum(want is not None for want in expected) >= (
        2 if name in ("masked adam", "adafactor", "lion", "prefix-masked adam") else 4
    )
    assert report.bytes_per_device == sum(
        math.prod((want or leaf.sharding).shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf, want in zip(jax.tree_util.tree_leaves(state), expected)
    )


def _linears(key, *shapes):
    keys = jax.random.split(key, len(shapes))
    return [eqx.nn.Linear(i, o, key=k) for (o, i), k in zip(shapes, keys)]


def test_a_model_inside_a_pair_keeps_its_own_layouts():
    # (blocks, head) with `blocks` a list: inside (model, opt_state) the head's path
    # is `0.1.weight`, which is also the path of `blocks[1].weight` in the model.
    blocks = _linears(jax.random.key(0), (16, 16), (16, 16))
    head = _linears(jax.random.key(1), (16, 16))[0]
    model = (blocks, head)
    spec = eqx.tree_at(
        lambda s: (s[0][1].weight, s[1].weight),
        eqshard.spec_tree(model),
        ("o i -> o* i", "o i -> o i*"),
        is_leaf=lambda x: x is None,
    )
    plan = eqshard.plan(model, spec)
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    laid_out = eqshard.abstract((model, opt_state), plan)
    assert laid_out[0][1].weight.sharding == plan.shardings[1].weight
    assert laid_out[0][1].weight.sharding.spec == jax.sharding.PartitionSpec(None, "m0")
    assert laid_out[0][0][1].weight.sharding.spec == jax.sharding.PartitionSpec("m0", None)
    assert laid_out[1][0].mu[1].weight.sharding == plan.shardings[1].weight
    assert laid_out[1][0].nu[0][1].weight.sharding == plan.shardings[0][1].weight


class VAE(eqx.Module):
    weight: Float[Array, "o i"]
    mu: eqx.nn.Linear

    def __init__(self, key):
        self.weight = jax.random.normal(key, (16, 16))
        self.mu = eqx.nn.Linear(16, 16, key=key)


def test_a_submodule_named_like_an_optimizer_field_does_not_lend_its_layout():
    model = VAE(jax.random.key(0))
    spec = eqshard.load(
        {
            "eqshard": 1,
            "rules": [
                {"path": "weight", "expr": "o i -> o* i"},
                {"path": "mu.weight", "expr": "o i -> o i*"},
            ],
        }
    )
    plan = eqshard.plan(model, spec)
    optimizer = optax.adam(1e-3)
    state = eqshard.apply(optimizer.init(eqx.filter(model, eqx.is_array)), plan)
    # Adam's first moment of `weight` is at `0.mu.weight`, which ends with `mu.weight`.
    assert state[0].mu.weight.sharding == plan.shardings.weight
    assert state[0].mu.weight.sharding.spec == jax.sharding.PartitionSpec("m0", None)
    assert state[0].mu.mu.weight.sharding == plan.shardings.mu.weight
    assert state[0].nu.weight.sharding == plan.shardings.weight


def test_a_kept_parameters_moment_is_kept_not_given_another_layout():
    model = {"a": {"w": jnp.ones((16, 8))}, "w": jnp.ones((16, 8))}
    plan = eqshard.plan(model, {"a": {"w": None}, "w": "a b -> a* b"}, unspecified="keep")
    state: Any = optax.adam(1e-3).init(model)
    before = state[0].mu["a"]["w"].sharding
    placed = eqshard.apply(state, plan)
    assert placed[0].mu["a"]["w"].sharding == before  # kept where it was
    assert placed[0].mu["a"]["w"] is state[0].mu["a"]["w"]
    assert placed[0].mu["w"].sharding == plan.shardings["w"]
    rows = {row.path: row.origin for row in eqshard.report(state, plan).rows}
    assert rows["0.mu.a.w"] == "kept, as parameter a.w is"


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
        eqshard.resolvers.FROM_FIELDS,
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
    spec = eqx.tree_at(lambda s: s.w, eqshard.spec_tree(stack), "o i -> o* i")
    with pytest.raises(SpecError) as info:
        eqshard.plan(stack, spec)
    assert "for a stack of layers: '... o i -> ... o* i'" in str(info.value)
    fixed = eqx.tree_at(lambda s: s.w, eqshard.spec_tree(stack), "... o i -> ... o* i")
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


# Random models whose names and shapes collide with each other and with the
# optimizers' own field names, so that any matching by key path would go wrong.
_NAMES = ("weight", "mu", "nu", "v", "trace", "count", "0", "1")
_SHAPES = ((16,), (8,), (16, 8), (8, 16), (4,))


class Node(eqx.Module):
    weight: Any
    mu: Any
    extra: Any


def _leaf_layouts(shape):
    """Expressions that fit `shape` on 8 devices."""
    layouts = ["... -> * ..."]
    if shape[0] % 8 == 0:
        layouts.append("a ... -> a* ...")
    if len(shape) == 2 and shape[1] % 8 == 0:
        layouts.append("a b -> a b*")
    return layouts


@st.composite
def _layouts(draw, depth=0):
    """A tree of `(shape, expression)` leaves, floats and `None`s in dicts, lists and
    modules, with colliding names."""
    if depth >= 3 or draw(st.integers(0, 3)) == 0:
        kind = draw(st.integers(0, 9))
        if kind == 0:
            return None
        if kind == 1:
            return 0.5  # a non-array leaf, like Dropout.p
        shape = draw(st.sampled_from(_SHAPES))
        return (shape, draw(st.sampled_from(_leaf_layouts(shape))))
    container = draw(st.integers(0, 2))
    child = _layouts(depth + 1)
    if container == 0:
        keys = draw(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=3, unique=True))
        return {key: draw(child) for key in keys}
    if container == 1:
        return [draw(child) for _ in range(draw(st.integers(1, 3)))]
    return Node(draw(child), draw(child), draw(child))


def _is_layout(x):
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)


_RANDOM_OPTIMIZERS = [
    "adam",
    "adamw with a mask",
    "masked adam",
    "multi_transform",
    "adafactor",
    "MultiSteps",
    "lion",
    "prefix-masked adam",
]


@settings(max_examples=30, deadline=None)
@given(_layouts(), st.sampled_from(_RANDOM_OPTIMIZERS), st.integers(0, 2**31 - 1))
def test_random_trees_with_colliding_names_follow_optax_s_own_map(layouts, name, seed):
    rng = np.random.default_rng(seed)
    model = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.standard_normal(x[0]), jnp.float32) if _is_layout(x) else x,
        layouts,
        is_leaf=_is_layout,
    )
    spec = jax.tree_util.tree_map(
        lambda x: x[1] if _is_layout(x) else None, layouts, is_leaf=_is_layout
    )
    if not any(eqx.is_array(x) for x in jax.tree_util.tree_leaves(model)):
        return
    plan = eqshard.plan(model, spec)
    params = eqx.filter(model, eqx.is_array)
    optimizer = OPTIMIZERS[name](model)
    state = optimizer.init(params)
    expected = expected_shardings(optimizer, state, params, plan)
    _assert_laid_out_as(eqshard.abstract(state, plan), expected)
    # the model itself, and filtered, inside a training state
    pair = eqshard.abstract((model, state), plan)
    assert [getattr(x, "sharding", None) for x in jax.tree_util.tree_leaves(pair[0])] == list(
        plan.flat_shardings
    )
    _assert_laid_out_as(pair[1], expected)
    filtered = eqshard.abstract((params, state), plan)[0]
    assert [x.sharding for x in jax.tree_util.tree_leaves(filtered)] == [
        s for s in plan.flat_shardings if s is not None
    ]


def test_a_plan_keeps_none_of_the_models_arrays_alive():
    import gc

    def live(shape):
        return sum(x.shape == shape for x in jax.live_arrays())

    model = eqx.nn.Linear(24, 40, key=jax.random.key(0))  # shapes no other test uses
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    plan = eqshard.plan(model, eqshard.load(RULES_FOR_LINEAR))
    derived = eqshard.report((model, opt_state), plan)  # a plan for the whole state

    @eqx.filter_jit
    def step(x, plan):  # a plan as a static argument, held in the jit cache
        return eqshard.constrain(x, plan)

    step(model, plan)
    assert live((40, 24)) == 3  # the weight and its two moments
    del model, opt_state
    gc.collect()
    assert live((40, 24)) == 0
    assert plan.abstract.weight.shape == (40, 24)
    assert plan.abstract.weight.sharding.spec == jax.sharding.PartitionSpec("m0", None)
    assert derived.rows[0].path == "0.weight"


RULES_FOR_LINEAR = {"eqshard": 1, "rules": [{"path": "weight", "expr": "o i -> o* i"}]}


def test_a_prefix_mask_that_masks_whole_subtrees_follows_optax_s_own_map():
    keys = jax.random.split(jax.random.key(0), 3)
    model = (
        [eqx.nn.Linear(16, 16, key=keys[0]), eqx.nn.Linear(16, 8, key=keys[1])],
        eqx.nn.Linear(8, 16, key=keys[2]),
    )
    params = eqx.filter(model, eqx.is_array)
    spec = jax.tree_util.tree_map(
        lambda x: "a ... -> a* ..." if x.shape[0] % 8 == 0 else None, params
    )
    plan = eqshard.plan(model, spec)
    # a prefix of the parameters: blocks[1] and the head masked as whole subtrees
    optimizer = optax.masked(optax.adam(1e-3), ([True, False], False))
    state = optimizer.init(params)
    holes = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    assert sum(isinstance(x, optax.MaskedNode) for x in holes) == 4  # 2 subtrees, in mu and nu
    expected = expected_shardings(optimizer, state, params, plan)
    assert sum(want is not None for want in expected) == 4  # blocks[0]'s moments
    _assert_laid_out_as(eqshard.abstract(state, plan), expected)
    _assert_laid_out_as(eqshard.abstract((model, state), plan)[1], expected)
