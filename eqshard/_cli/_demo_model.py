"""The demo's model and optimizer: a small GPT of `eqx.nn` modules, stacked and
scanned, and a minimal AdamW. `examples/gpt_stacked.py` trains the same GPT, at
smaller `Sizes` and with its activations named.

The blocks are stacked with `eqx.filter_vmap` and run with `jax.lax.scan`; the model
is trained on deterministic random tokens (next-token prediction). AdamW is written
here in a few lines, since optax is not one of eqshard's dependencies;
`tests/test_demo.py` checks it against `optax.adamw`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._constrain import constrain

__all__ = [
    "B1",
    "B2",
    "BATCH",
    "DEMO",
    "DIM",
    "EPS",
    "GPT",
    "HEADS",
    "HIDDEN",
    "LAYERS",
    "LEARNING_RATE",
    "SEQ",
    "VOCAB",
    "WEIGHT_DECAY",
    "AdamState",
    "Block",
    "Sizes",
    "adamw_init",
    "adamw_update",
    "build",
    "loss",
    "tokens",
]

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH = 128, 64, 8, 256, 2, 16, 16
"""The model's sizes: each divides by 8 (the Megatron split needs HEADS to), BATCH by 16."""


class Sizes(NamedTuple):
    """A GPT's sizes: the vocabulary, the embedding, the attention heads, the MLP's
    hidden width, the stacked layers, and the longest sequence."""

    vocab: int = VOCAB
    dim: int = DIM
    heads: int = HEADS
    hidden: int = HIDDEN
    layers: int = LAYERS
    seq: int = SEQ


DEMO = Sizes()
"""The demo's sizes."""


class Block(eqx.Module):
    """One pre-norm transformer block: causal self-attention, then a GELU MLP. With
    `names`, it names its residual stream `(..., "seq", "embed")`
    (`eqshard.constrain`), which the active rules' `"dims"` lay out."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    names: bool = eqx.field(static=True)

    def __init__(self, key: Array, sizes: Sizes = DEMO, names: bool = False):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(sizes.dim)
        self.attn = eqx.nn.MultiheadAttention(sizes.heads, sizes.dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(sizes.dim)
        self.up = eqx.nn.Linear(sizes.dim, sizes.hidden, key=k2)
        self.down = eqx.nn.Linear(sizes.hidden, sizes.dim, key=k3)
        self.names = names

    def __call__(
        self, x: Float[Array, "seq embed"], mask: Bool[Array, "seq seq"]
    ) -> Float[Array, "seq embed"]:
        if self.names:
            x = constrain(x, (..., "seq", "embed"))  # laid out by the active rules
        y = jax.vmap(self.norm1)(x)
        x = x + self.attn(y, y, y, mask=mask)
        y = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(y)))


class GPT(eqx.Module):
    """Token and position embeddings, `sizes.layers` stacked blocks, a LayerNorm,
    logits."""

    embed: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    blocks: Block  # stacked: every array leaf has a leading axis of `sizes.layers`
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, key: Array, sizes: Sizes = DEMO, names: bool = False):
        k_embed, k_pos, k_blocks, k_unembed = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(sizes.vocab, sizes.dim, key=k_embed)
        self.pos = eqx.nn.Embedding(sizes.seq, sizes.dim, key=k_pos)
        keys = jax.random.split(k_blocks, sizes.layers)
        self.blocks = eqx.filter_vmap(lambda k: Block(k, sizes, names))(keys)
        self.norm = eqx.nn.LayerNorm(sizes.dim)
        self.unembed = eqx.nn.Linear(sizes.dim, sizes.vocab, use_bias=False, key=k_unembed)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        n = tokens.shape[0]
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.pos)(jnp.arange(n))
        causal = jnp.tril(jnp.ones((n, n), dtype=bool))
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x: Float[Array, "seq embed"], block_params: Any) -> tuple[Array, None]:
            block = eqx.combine(block_params, static)  # one layer's slice of the stack
            return block(x, causal), None

        x, _ = jax.lax.scan(layer, x, params)
        return jax.vmap(lambda v: self.unembed(self.norm(v)))(x)


def build(seed: int = 0, sizes: Sizes = DEMO, names: bool = False) -> GPT:
    """The demo's model, with GPT-2's initialisation: weights N(0, 0.02), biases 0,
    LayerNorm scales 1.

    `eqx.filter_eval_shape` gives the structure without computing anything, and
    NumPy gives the values, as a checkpoint would: on a CPU, eqx.nn's own
    initialisers take seconds, compiling one random kernel per leaf.

    **Example:**

    ```python
    model = build()
    model.blocks.attn.query_proj.weight.shape   # (LAYERS, DIM, DIM)
    ```

    **Arguments:**

    - `seed`: the seed of the values.
    - `sizes`: the model's sizes; by default the demo's.
    - `names`: whether each block names its residual stream (`Block`).

    **Returns:**

    A `GPT`, on JAX's default device.
    """
    rng = np.random.default_rng(seed)

    def init(path: Any, leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf  # not an array: a dropout rate, a flag
        *_, owner, name = jax.tree_util.keystr(path, simple=True, separator=".").split(".")
        if name == "bias":
            value = np.zeros(leaf.shape)
        elif owner.startswith("norm"):
            value = np.ones(leaf.shape)
        else:
            value = rng.normal(0.0, 0.02, leaf.shape)
        return jnp.asarray(value.astype(leaf.dtype))

    shapes = eqx.filter_eval_shape(GPT, jax.random.key(seed), sizes, names)
    return jax.tree_util.tree_map_with_path(init, shapes)


def tokens(seed: int = 1) -> Int[np.ndarray, "batch seq_plus_1"]:
    """The fixed batch: `BATCH` rows of `SEQ + 1` deterministic random token ids; the
    model reads the first `SEQ` of each row and predicts the next token."""
    return np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)


def loss(model: GPT, batch: Int[Array, "batch seq_plus_1"]) -> Float[Array, ""]:
    """Next-token cross-entropy, averaged over the batch and the positions."""
    logp = jax.nn.log_softmax(jax.vmap(model)(batch[:, :-1]))
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))


class AdamState(NamedTuple):
    """The state of the demo's AdamW: the step count and the two moments, each
    shaped like the model's arrays, so eqshard lays them out by structure."""

    steps: Array
    mu: Any
    nu: Any


LEARNING_RATE, B1, B2, EPS, WEIGHT_DECAY = 1e-2, 0.9, 0.999, 1e-8, 1e-4


def adamw_init(params: Any) -> AdamState:
    """A minimal AdamW for the demo (optax is not a dependency of eqshard): the state
    of `optax.adamw` without its mask, zero moments and a zero count.

    **Example:**

    ```python
    state = adamw_init(eqx.filter(model, eqx.is_array))
    ```

    **Arguments:**

    - `params`: the model's arrays (`eqx.filter(model, eqx.is_array)`).

    **Returns:**

    An `AdamState`.
    """
    zeros = jax.tree.map(jnp.zeros_like, params)
    return AdamState(jnp.zeros((), jnp.int32), zeros, zeros)


def adamw_update(grads: Any, state: AdamState, params: Any) -> tuple[Any, AdamState]:
    """One step of the demo's minimal AdamW: `optax.adamw(LEARNING_RATE, B1, B2, EPS,
    weight_decay=WEIGHT_DECAY)`'s update, every array decayed.

    **Example:**

    ```python
    updates, state = adamw_update(grads, state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    ```

    **Arguments:**

    - `grads`: the gradients, shaped like `params`.
    - `state`: the `AdamState` of the previous step.
    - `params`: the model's arrays, for the weight decay.

    **Returns:**

    The updates, shaped like `params`, and the new state.
    """
    count = state.steps + 1
    mu = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, state.nu, grads)
    unbias1 = 1 - B1 ** count.astype(jnp.float32)
    unbias2 = 1 - B2 ** count.astype(jnp.float32)

    def update(m: Array, v: Array, p: Array) -> Array:
        adam = (m / unbias1) / (jnp.sqrt(v / unbias2) + EPS)
        return -LEARNING_RATE * (adam + WEIGHT_DECAY * p)

    return jax.tree.map(update, mu, nu, params), AdamState(count, mu, nu)
