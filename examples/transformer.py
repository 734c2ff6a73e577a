"""A small transformer, sharded Megatron-style by a JSON spec file, trained with optax.

Run: `python examples/transformer.py` (8 simulated CPU devices when no
accelerator is present). It loads `specs/transformer.eqshard.json`, places the
model and its optax state with `eqshard.apply`, and trains a few steps.

Check the spec from the command line, without an accelerator:

    eqshard validate examples/specs/transformer.eqshard.json
    eqshard check examples/specs/transformer.eqshard.json \\
        --model examples/transformer.py:build --devices 1 2 4 8
"""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

import eqshard

SPEC = Path(__file__).parent / "specs" / "transformer.eqshard.json"
VOCAB, DIM, HEADS, HIDDEN, DEPTH, SEQ = 256, 64, 8, 256, 2, 16


class Unembed(eqx.Module):
    """The output projection, annotated: the spec's "dims" split its vocabulary."""

    w: Float[Array, "vocab embed"]

    def __init__(self, key):
        self.w = jax.random.normal(key, (VOCAB, DIM)) / DIM**0.5

    def __call__(self, x: Float[Array, " embed"]) -> Float[Array, " vocab"]:
        return self.w @ x


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(DIM)
        self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.norm2 = eqx.nn.LayerNorm(DIM)
        self.up = eqx.nn.Linear(DIM, HIDDEN, key=k2)
        self.down = eqx.nn.Linear(HIDDEN, DIM, key=k3)

    def __call__(self, x: Float[Array, "seq embed"]) -> Float[Array, "seq embed"]:
        y = jax.vmap(self.norm1)(x)
        x = x + self.attn(y, y, y)
        y = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(y)))


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    unembed: Unembed

    def __init__(self, key):
        keys = jax.random.split(key, DEPTH + 2)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=keys[0])
        self.blocks = [Block(k) for k in keys[1:-1]]
        self.norm = eqx.nn.LayerNorm(DIM)
        self.unembed = Unembed(keys[-1])

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(lambda v: self.unembed(self.norm(v)))(x)


def build() -> Transformer:
    """What `eqshard check --model examples/transformer.py:build` builds, abstractly."""
    return Transformer(jax.random.key(0))


def loss(model: Transformer, tokens: Int[Array, "batch seq"]) -> Float[Array, ""]:
    logits = jax.vmap(model)(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def main() -> None:
    import optax

    rules = eqshard.load(SPEC)
    model = eqshard.apply(build(), rules)
    optimizer = optax.adamw(1e-2)
    opt_state = eqshard.apply(optimizer.init(eqx.filter(model, eqx.is_array)), rules)

    @eqx.filter_jit
    def step(model, opt_state, tokens):
        value, grads = eqx.filter_value_and_grad(loss)(model, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        # keep every layout through the step, for the model and the optimizer state
        return value, eqshard.constrain(model, rules), eqshard.constrain(opt_state, rules)

    tokens = jax.random.randint(jax.random.key(1), (8, SEQ + 1), 0, VOCAB)
    for i in range(5):
        value, model, opt_state = step(model, opt_state, tokens)
        print(f"step {i}: loss {float(value):.4f}")
    for name, array in [
        ("blocks[0].up.weight", model.blocks[0].up.weight),
        ("its Adam moment", opt_state[0].mu.blocks[0].up.weight),
        ("unembed.w (from dims)", model.unembed.w),
        ("norm.weight (default)", model.norm.weight),
    ]:
        print(f"{name} {array.shape}: each device holds {array.sharding.shard_shape(array.shape)}")


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # CPU only: simulated devices when no accelerator
    main()
