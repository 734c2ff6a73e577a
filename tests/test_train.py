"""A real training step under `eqx.filter_jit`, sharded and not, on eqx.nn modules."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqshard

VOCAB, DIM, HEADS, HIDDEN, SEQ, BATCH = 32, 16, 8, 64, 8, 4


class Block(eqx.Module):
    """Embedding, attention, MLP and an output head, pre-norm: all eqx.nn modules."""

    embed: eqx.nn.Embedding
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=keys[0])
        self.norm1 = eqx.nn.LayerNorm(DIM)
        self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=keys[1])
        self.norm2 = eqx.nn.LayerNorm(DIM)
        self.mlp = eqx.nn.MLP(DIM, DIM, HIDDEN, 1, activation=jax.nn.gelu, key=keys[2])
        self.head = eqx.nn.Linear(DIM, VOCAB, key=keys[3])

    def __call__(self, tokens, activations=None):
        """Logits for `tokens`; `activations` optionally constrains the residual stream."""
        x = jax.vmap(self.embed)(tokens)
        y = jax.vmap(self.norm1)(x)
        x = x + self.attn(y, y, y)
        if activations is not None:
            x = eqshard.constrain(x, activations)
        x = x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))
        return jax.vmap(self.head)(x)


def block(key):
    return Block(key)


def megatron_spec(model):
    """Heads, MLP units, the vocabulary and the embedding split over all devices:
    third-party leaves given expressions with `eqx.tree_at`."""
    return eqx.tree_at(
        lambda s: (
            s.attn.query_proj.weight,
            s.attn.key_proj.weight,
            s.attn.value_proj.weight,
            s.attn.output_proj.weight,
            s.mlp.layers[0].weight,
            s.mlp.layers[0].bias,
            s.mlp.layers[1].weight,
            s.head.weight,
        ),
        eqshard.spec_tree(model),
        ("o i -> o* i",) * 3
        + ("o i -> o i*", "o i -> o* i", "o -> o*", "o i -> o i*", "v d -> v* d"),
        is_leaf=lambda x: x is None,
    )


def loss(model, tokens, targets, activations=None):
    logits = jax.vmap(lambda t: model(t, activations))(tokens)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


@eqx.filter_jit
def step(model, tokens, targets, activations=None, spec=None):
    value, grads = eqx.filter_value_and_grad(loss)(model, tokens, targets, activations)
    updates = jax.tree_util.tree_map(lambda g: -0.1 * g, grads)
    model = eqx.apply_updates(model, updates)
    if spec is not None:
        model = eqshard.constrain(model, spec)  # the parameters keep their layouts
    return value, model


def compiled_text(fn, model, *args):
    """The compiled HLO of `fn(model, *args)`."""
    params, static = eqx.partition(model, eqx.is_array)
    return (
        jax.jit(lambda p, *a: fn(eqx.combine(p, static), *a))
        .lower(params, *args)
        .compile()
        .as_text()
        or ""
    )


@pytest.fixture(scope="module")
def data():
    key = jax.random.key(1)
    tokens = jax.random.randint(key, (BATCH, SEQ), 0, VOCAB)
    return tokens, jnp.roll(tokens, -1, axis=1)


def _arrays(model):
    return jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))


@pytest.mark.slow  # trains sharded and unsharded and compares
@pytest.mark.parametrize("activations", [None, "s d -> s d*"])
def test_sharded_step_matches_unsharded(data, activations):
    tokens, targets = data
    model = block(jax.random.key(0))
    spec = megatron_spec(model)
    sharded = eqshard.apply(model, spec)

    loss_ref, updated_ref = step(model, tokens, targets, activations)
    plan = eqshard.plan(model, spec)
    loss_sharded, updated = step(sharded, tokens, targets, activations, plan)

    np.testing.assert_allclose(float(loss_sharded), float(loss_ref), rtol=1e-6)
    for got, want in zip(_arrays(updated), _arrays(updated_ref)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # the updated parameters keep the layouts they came in with
    for got, placed in zip(_arrays(updated), _arrays(sharded)):
        assert got.sharding.is_equivalent_to(placed.sharding, got.ndim)
    assert updated.attn.query_proj.weight.sharding.shard_shape((DIM, DIM)) == (DIM // 8, DIM)


def test_megatron_mlp_has_one_all_reduce_and_no_weight_gather():
    mlp = eqx.nn.MLP(DIM, DIM, HIDDEN, 1, key=jax.random.key(0))
    spec = eqx.tree_at(
        lambda s: (s.layers[0].weight, s.layers[0].bias, s.layers[1].weight),
        eqshard.spec_tree(mlp),
        ("o i -> o* i", "o -> o*", "o i -> o i*"),
        is_leaf=lambda x: x is None,
    )
    sharded = eqshard.apply(mlp, spec)
    x = jnp.ones((BATCH, DIM))
    forward = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    hlo = compiled_text(lambda m, x: jax.vmap(m)(x), sharded, x)
    assert hlo.count("all-reduce(") == 1
    assert "all-gather(" not in hlo
    np.testing.assert_allclose(
        np.asarray(forward(sharded, x)), np.asarray(forward(mlp, x)), rtol=1e-5, atol=1e-6
    )
    # replicated weights need no collective at all
    replicated = eqshard.apply(mlp, "... -> * ...")
    assert "all-reduce(" not in compiled_text(lambda m, x: jax.vmap(m)(x), replicated, x)


def test_activation_constraint_changes_the_compiled_step(data):
    tokens, targets = data
    sharded = eqshard.apply(block(jax.random.key(0)), "... -> * ...")
    free = compiled_text(lambda m, t, y: loss(m, t, y), sharded, tokens, targets)
    pinned = compiled_text(lambda m, t, y: loss(m, t, y, "s d -> s d*"), sharded, tokens, targets)
    # replicated weights and no constraint: no communication; the constraint splits d
    assert "all-gather(" not in free
    assert "all-reduce(" not in free
    assert "all-gather(" in pinned or "all-reduce(" in pinned or "all-to-all(" in pinned


def test_constrain_a_model_outside_jit_places_it():
    model = block(jax.random.key(0))
    spec = megatron_spec(model)
    placed = eqshard.constrain(model, spec)
    applied = eqshard.apply(model, spec)
    for got, want in zip(_arrays(placed), _arrays(applied)):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
