"""A causal transformer of `eqx.nn` parts for long sequences, trained under sequence
parallelism (Megatron-SP) or context parallelism, chosen by the spec file alone.

The model names its activations' axes, and the spec file's `"dims"` maps the names
to mesh axes, so the model code is the same under every layout:

- `"seq"`: the sequence of the residual stream, where the norms, the residual adds and
    the embeddings are computed;
- `"inner_seq"`: the sequence inside attention and the MLP (queries, the heads'
    outputs, the MLP's hidden units);
- `"kv_seq"`: the sequence of the keys and values;
- `"batch"`, `"embed"`, `"heads"` and `"hidden"` as usual. The weights' dims use the
    same names (the rules' `"dims"`), so the tensor degree lives in the mesh alone.

`specs/long_context.sp.eqshard.json` is Megatron-SP over `model`: `heads` and
`hidden` split (Megatron's column- and row-parallel pairs), and `seq` split over
`model` too, so the norms and the residual stream are split by sequence between the
tensor-parallel regions; `inner_seq` and `kv_seq` are whole. XLA gathers the
sequence before each region and reduce-scatters after it, where plain Megatron
all-reduces.

`specs/long_context.cp.eqshard.json` is context parallelism over `context`: `seq`
and `inner_seq` split (each device its own queries), `kv_seq` whole, so XLA gathers
the keys and values over `context` in each layer. With `Sizes(ring=True)` the model
calls `eqshard.parallel.ring_attention` instead, which keeps the keys and values split and
passes them round the ring with `ppermute`.

    python examples/long_context.py     # trains 3 steps under each spec and unsharded
"""

import math
from pathlib import Path
from typing import Any, NamedTuple

import jax

if __name__ == "__main__":  # before JAX starts: 8 simulated CPU devices
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

import eqshard

SPECS = Path(__file__).parent / "specs"
SEQUENCE_PARALLEL = SPECS / "long_context.sp.eqshard.json"
CONTEXT_PARALLEL = SPECS / "long_context.cp.eqshard.json"

RESIDUAL = ("batch", "seq", "embed")


class Sizes(NamedTuple):
    """The model's sizes: sequences 8 times as many as the batch is long."""

    vocab: int = 64
    dim: int = 32
    heads: int = 4
    hidden: int = 64
    layers: int = 2
    batch: int = 4
    seq: int = 32
    ring: bool = False  # attention by `eqshard.parallel.ring_attention`


SIZES = Sizes()


def _each(layer: Any, x: Array) -> Array:
    """`layer` on each token of a `(batch, seq, ...)` array."""
    return jax.vmap(jax.vmap(layer))(x)


class Attention(eqx.Module):
    """Causal multi-head attention, its projections `eqx.nn.Linear`s."""

    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    ring: bool = eqx.field(static=True)

    def __init__(self, sizes: Sizes, key):
        keys = jax.random.split(key, 4)
        dim = sizes.dim
        self.q, self.k, self.v, self.o = (
            eqx.nn.Linear(dim, dim, use_bias=False, key=k) for k in keys
        )
        self.heads, self.ring = sizes.heads, sizes.ring

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        batch, seq, dim = x.shape

        def heads(linear: eqx.nn.Linear, names: tuple) -> Array:
            y = _each(linear, x).reshape(batch, seq, self.heads, dim // self.heads)
            return eqshard.constrain(y, names)

        q = heads(self.q, ("batch", "inner_seq", "heads", None))
        if self.ring:  # keys and values stay split, passed round the ring
            k = heads(self.k, ("batch", "inner_seq", "heads", None))
            v = heads(self.v, ("batch", "inner_seq", "heads", None))
            out = eqshard.parallel.ring_attention(
                q, k, v, ("batch", "inner_seq", "heads", None), causal=True
            )
        else:
            k = heads(self.k, ("batch", "kv_seq", "heads", None))
            v = heads(self.v, ("batch", "kv_seq", "heads", None))
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dim // self.heads)
            future = jnp.arange(seq)[:, None] < jnp.arange(seq)[None, :]
            weights = jax.nn.softmax(jnp.where(future, -jnp.inf, scores), axis=-1)
            out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        out = eqshard.constrain(out, ("batch", "inner_seq", "heads", None))
        return _each(self.o, out.reshape(batch, seq, dim))


class MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, sizes: Sizes, key):
        k_up, k_down = jax.random.split(key)
        self.up = eqx.nn.Linear(sizes.dim, sizes.hidden, key=k_up)
        self.down = eqx.nn.Linear(sizes.hidden, sizes.dim, key=k_down)

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        h = eqshard.constrain(jax.nn.gelu(_each(self.up, x)), ("batch", "inner_seq", "hidden"))
        return _each(self.down, h)


class Block(eqx.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    norm1: eqx.nn.LayerNorm
    attention: Attention
    norm2: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, sizes: Sizes, key):
        k_attention, k_mlp = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(sizes.dim)
        self.attention = Attention(sizes, k_attention)
        self.norm2 = eqx.nn.LayerNorm(sizes.dim)
        self.mlp = MLP(sizes, k_mlp)

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        x = x + eqshard.constrain(self.attention(_each(self.norm1, x)), RESIDUAL)
        return x + eqshard.constrain(self.mlp(_each(self.norm2, x)), RESIDUAL)


class LongContext(eqx.Module):
    """Token and position embeddings, the blocks, a final norm and a head."""

    embed: eqx.nn.Embedding
    position: eqx.nn.Embedding
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, sizes: Sizes = SIZES, key=None):
        keys = jax.random.split(jax.random.key(0) if key is None else key, 3 + sizes.layers)
        self.embed = eqx.nn.Embedding(sizes.vocab, sizes.dim, key=keys[0])
        self.position = eqx.nn.Embedding(sizes.seq, sizes.dim, key=keys[1])
        self.blocks = [Block(sizes, k) for k in keys[3:]]
        self.norm = eqx.nn.LayerNorm(sizes.dim)
        self.head = eqx.nn.Linear(sizes.dim, sizes.vocab, use_bias=False, key=keys[2])

    def __call__(self, tokens: Int[Array, "batch seq"]) -> Float[Array, "batch seq vocab"]:
        positions = jax.vmap(self.position)(jnp.arange(tokens.shape[1]))
        x = eqshard.constrain(_each(self.embed, tokens) + positions, RESIDUAL)
        for block in self.blocks:
            x = eqshard.constrain(block(x), RESIDUAL)
        return _each(self.head, _each(self.norm, x))


def build(sizes: Sizes = SIZES) -> LongContext:
    return LongContext(sizes)


def loss(model: LongContext, tokens: Int[Array, "batch seq_plus_1"]) -> Float[Array, ""]:
    logp = jax.nn.log_softmax(model(tokens[:, :-1]))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def optimizer() -> optax.GradientTransformation:
    return optax.adam(1e-2)


def batch(sizes: Sizes = SIZES) -> Int[Array, "batch seq_plus_1"]:
    return jnp.zeros((sizes.batch, sizes.seq + 1), jnp.int32)


@eqshard.jit
def step(model: LongContext, opt_state: Any, tokens: Int[Array, "batch seq_plus_1"]):
    value, grads = eqx.filter_value_and_grad(loss)(model, tokens)
    updates, opt_state = optimizer().update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return value, eqx.apply_updates(model, updates), opt_state


def main(steps: int = 3, spec: Path = CONTEXT_PARALLEL, sizes: Sizes = SIZES) -> dict[str, Any]:
    """Trains `steps` steps laid out by `spec` and unsharded; returns both losses, the
    plan and the trained model."""
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, sizes.vocab, batch(sizes).shape))
    with jax.default_matmul_precision("highest"):
        model = build(sizes)
        opt_state = optimizer().init(eqx.filter(model, eqx.is_array))
        reference, ref_model, ref_state = [], model, opt_state
        for _ in range(steps):
            value, ref_model, ref_state = step(ref_model, ref_state, tokens)
            reference.append(float(value))
        plan = eqshard.plan(model, eqshard.load(spec), devices=8)  # the first 8 devices
        with eqshard.use(plan):
            model, opt_state = eqshard.apply(model, plan), eqshard.apply(opt_state, plan)
            losses = []
            for _ in range(steps):
                value, model, opt_state = step(model, opt_state, tokens)
                losses.append(float(value))
    for i, (a, b) in enumerate(zip(losses, reference)):
        print(f"{spec.name} step {i}: loss {a:.6f} (unsharded {b:.6f})")
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    return {"losses": losses, "reference": reference, "plan": plan, "model": model}


if __name__ == "__main__":
    main(spec=SEQUENCE_PARALLEL)
    main(spec=CONTEXT_PARALLEL)
