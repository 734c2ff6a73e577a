"""A Llama-3-8B-shaped model of `eqx.nn` modules, its 32 layers stacked and scanned,
with a training step: for what a spec costs on TPU slices no one here has.

It is only ever built abstractly (`eqx.filter_eval_shape`): 8 billion bfloat16
parameters, no memory. `LLAMA_SPEC` (also `examples/specs/llama.eqshard.json`)
splits it FSDP over `data` and tensor parallel over `model` on any count of
devices that 16 divides.

    eqshard check examples/specs/llama.eqshard.json --model examples/llama_8b.py:build \\
        --step examples/llama_8b.py:step --make-batch examples/llama_8b.py:batch \\
        --optimizer examples/llama_8b.py:optimizer --target v5p:4x4x4

`benchmarks/bench_cost.py` costs it on `v5e:4x4` and `v5p:4x4x4` with the TPU
compiler, beside XLA:CPU's figures.
"""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int


class Sizes(NamedTuple):
    """The model's sizes: Llama 3 8B's by default (the tests build a small one)."""

    vocab: int = 128256
    dim: int = 4096
    heads: int = 32
    kv_heads: int = 8
    hidden: int = 14336
    layers: int = 32
    batch: int = 16
    sequence: int = 2048


SIZES = Sizes()
VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS, BATCH, SEQUENCE = SIZES


class Layer(eqx.Module):
    """One decoder layer: grouped-query attention and a SwiGLU MLP, pre-norm."""

    attention_norm: eqx.nn.RMSNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    kv_heads: int = eqx.field(static=True)

    def __init__(self, key, sizes: Sizes = SIZES):
        keys = jax.random.split(key, 7)
        dim, hidden, head = sizes.dim, sizes.hidden, sizes.dim // sizes.heads
        self.heads, self.kv_heads = sizes.heads, sizes.kv_heads
        self.attention_norm = eqx.nn.RMSNorm(dim, use_bias=False)
        self.q = eqx.nn.Linear(dim, sizes.heads * head, use_bias=False, key=keys[0])
        self.k = eqx.nn.Linear(dim, sizes.kv_heads * head, use_bias=False, key=keys[1])
        self.v = eqx.nn.Linear(dim, sizes.kv_heads * head, use_bias=False, key=keys[2])
        self.o = eqx.nn.Linear(sizes.heads * head, dim, use_bias=False, key=keys[3])
        self.mlp_norm = eqx.nn.RMSNorm(dim, use_bias=False)
        self.gate = eqx.nn.Linear(dim, hidden, use_bias=False, key=keys[4])
        self.up = eqx.nn.Linear(dim, hidden, use_bias=False, key=keys[5])
        self.down = eqx.nn.Linear(hidden, dim, use_bias=False, key=keys[6])

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        h = jax.vmap(self.attention_norm)(x)
        q = jax.vmap(self.q)(h).reshape(x.shape[0], self.heads, -1)
        k = jax.vmap(self.k)(h).reshape(x.shape[0], self.kv_heads, -1)
        v = jax.vmap(self.v)(h).reshape(x.shape[0], self.kv_heads, -1)
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + jax.vmap(self.o)(attended.reshape(x.shape[0], -1))
        h = jax.vmap(self.mlp_norm)(x)
        gated = jax.nn.silu(jax.vmap(self.gate)(h)) * jax.vmap(self.up)(h)
        return x + jax.vmap(self.down)(gated)


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    layers: Layer  # stacked: every leaf has a leading axis of LAYERS
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key, sizes: Sizes = SIZES):
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(sizes.vocab, sizes.dim, key=k_embed)
        keys = jax.random.split(k_layers, sizes.layers)
        self.layers = eqx.filter_vmap(lambda k: Layer(k, sizes))(keys)
        self.norm = eqx.nn.RMSNorm(sizes.dim, use_bias=False)
        self.head = eqx.nn.Linear(sizes.dim, sizes.vocab, use_bias=False, key=k_head)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(tokens)
        params, static = eqx.partition(self.layers, eqx.is_array)

        @jax.checkpoint  # keep one activation per layer; recompute the rest
        def layer(x, p):
            return eqx.combine(p, static)(x), None

        x, _ = jax.lax.scan(layer, x, params)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def build(sizes: Sizes = SIZES) -> Llama:
    """The model in bfloat16 (build it with `eqx.filter_eval_shape(build)`)."""
    model = Llama(jax.random.key(0), sizes)
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model
    )


def optimizer() -> optax.GradientTransformation:
    return optax.adamw(3e-4)


def batch(sizes: Sizes = SIZES) -> Int[Array, "batch seq_plus_1"]:
    return jnp.zeros((sizes.batch, sizes.sequence + 1), jnp.int32)


def loss(model: Llama, tokens: Int[Array, "batch seq_plus_1"]) -> Float[Array, ""]:
    logits = jax.vmap(model)(tokens[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


@eqx.filter_jit(donate="all-except-first")
def step(model: Llama, opt_state, tokens):
    value, grads = eqx.filter_value_and_grad(loss)(model, tokens)
    updates, opt_state = optimizer().update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


# Column-parallel weights (out, in) put `in` on `data` and `out` on `model`;
# row-parallel ones the other way round. The vocabulary is split over `model`.
COLUMN, ROW = "... o i -> ... i* o16", "... o i -> ... o* i16"
COLUMNS, ROWS = ("q", "k", "v", "gate", "up"), ("o", "down")
LLAMA_SPEC = {
    "eqshard": 1,
    "mesh": [["data", "*"], ["model", 16]],
    "default": "replicate",
    "rules": [
        *({"path": f"layers.{name}.weight", "expr": COLUMN} for name in COLUMNS),
        *({"path": f"layers.{name}.weight", "expr": ROW} for name in ROWS),
        {"path": "embed.weight", "expr": "v d -> d* v16"},
        {"path": "head.weight", "expr": "v d -> d* v16"},
    ],
}
