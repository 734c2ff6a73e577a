"""The demo's model and optimizer: a small GPT of `eqx.nn` modules, stacked and
scanned, and a minimal AdamW. `examples/gpt_stacked.py` trains the same GPT, at
smaller `Sizes` and with its activations named.

The blocks are stacked with `eqx.filter_vmap` and run with `jax.lax.scan`; the model
is trained on deterministic random tokens (next-token prediction). AdamW is written
here in a few lines, since optax is not one of eqshard's dependencies;
`tests/test_demo.py` checks it against `optax.adamw`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._constrain import constrain
from .._pipeline import pipeline

__all__ = [
    "B1",
    "B2",
    "BATCH",
    "DEMO",
    "DIM",
    "EPS",
    "GPT",
    "GPT_VARIANT",
    "HEADS",
    "HIDDEN",
    "LAYERS",
    "LEARNING_RATE",
    "LONG",
    "MOE",
    "PIPELINE",
    "SEQ",
    "VOCAB",
    "WEIGHT_DECAY",
    "AdamState",
    "Block",
    "Experts",
    "Sizes",
    "Variant",
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
    hidden width, the stacked layers, and the longest sequence; with `experts`, each
    layer's MLP is that many experts (`Experts`), each token routed to one; with
    `microbatches`, the layers run by `eqshard.parallel.pipeline` in that many microbatches."""

    vocab: int = VOCAB
    dim: int = DIM
    heads: int = HEADS
    hidden: int = HIDDEN
    layers: int = LAYERS
    seq: int = SEQ
    experts: int = 0
    capacity_factor: float = 2.0
    microbatches: int = 0


DEMO = Sizes()
"""The demo's sizes."""


class Variant(NamedTuple):
    """One model the demo trains.

    - `key`: its short name (`"moe"`); `short`: how a table row names it (`""` for
        the GPT itself); `title`: a sentence's name for it.
    - `sizes`: its sizes; `rows`: the batch's rows.
    - `names`: whether its blocks name their residual stream; `heads`: their
        queries, keys and values too (`Block`).
    """

    key: str
    short: str
    title: str
    sizes: Sizes
    rows: int
    names: bool = False
    heads: bool = False


GPT_VARIANT = Variant("gpt", "", f"a {LAYERS}-layer GPT", DEMO, BATCH)
"""The demo's GPT, which the five classic strategies train."""

MOE = Variant(
    "moe",
    "8 experts",
    f"a {LAYERS}-layer GPT whose MLPs are 8 experts (top-1 routing)",
    DEMO._replace(experts=8),
    BATCH,
    names=True,
)
"""The GPT with a mixture of experts in each layer, for expert parallelism."""

LONG = Variant(
    "long",
    "seq 128",
    f"a {LAYERS}-layer GPT on sequences of 128",
    DEMO._replace(seq=128),
    4,
    names=True,
    heads=True,
)
"""The GPT on sequences 8 times as long and a quarter of the rows, for context
parallelism."""

PIPELINE = Variant(
    "pipeline",
    "4 layers, 8 microbatches",
    "a 4-layer GPT whose layers run in pipeline stages, 8 microbatches",
    DEMO._replace(layers=4, microbatches=8),
    BATCH,
)
"""The GPT with 4 layers run by `eqshard.parallel.pipeline`, for pipeline stages."""


class Experts(eqx.Module):
    """A mixture of experts (Switch routing): each token goes to its top expert, which
    takes at most `capacity` tokens of its group (a row of the batch); the experts'
    MLPs stacked. It runs on the whole batch, `(group, seq, embed)`, so that with
    `names` each group's slots are computed where the group is, named `("batch", None,
    None, "embed")`, then handed to the experts, named `("expert", None, None,
    "embed")`: a layout that splits `"expert"` makes that change one all-to-all."""

    router: eqx.nn.Linear
    up: eqx.nn.Linear  # stacked: weight (experts, hidden, dim)
    down: eqx.nn.Linear  # stacked: weight (experts, dim, hidden)
    capacity: int = eqx.field(static=True)
    names: bool = eqx.field(static=True)

    def __init__(self, key: Array, sizes: Sizes, names: bool):
        k_router, k_up, k_down = jax.random.split(key, 3)
        n = sizes.experts
        self.router = eqx.nn.Linear(sizes.dim, n, use_bias=False, key=k_router)
        ups, downs = jax.random.split(k_up, n), jax.random.split(k_down, n)
        self.up = eqx.filter_vmap(lambda k: eqx.nn.Linear(sizes.dim, sizes.hidden, key=k))(ups)
        self.down = eqx.filter_vmap(lambda k: eqx.nn.Linear(sizes.hidden, sizes.dim, key=k))(downs)
        self.capacity = math.ceil(sizes.seq * sizes.capacity_factor / n)
        self.names = names

    def _named(self, x: Array, names: tuple[Any, ...]) -> Array:
        return constrain(x, names) if self.names else x

    def __call__(self, x: Float[Array, "group seq embed"]) -> Float[Array, "group seq embed"]:
        probs = jax.nn.softmax(jnp.einsum("gsd,ed->gse", x, self.router.weight), axis=-1)
        pick = jax.nn.one_hot(jnp.argmax(probs, axis=-1), probs.shape[-1], dtype=x.dtype)
        position = jnp.cumsum(pick, axis=1).astype(jnp.int32) - 1  # its place in the buffer
        kept = pick * (position < self.capacity)  # past the capacity: dropped
        slots = jax.nn.one_hot(position, self.capacity, dtype=x.dtype) * kept[..., None]
        local = self._named(jnp.einsum("gsec,gsd->gecd", slots, x), ("batch", None, None, "embed"))
        buffer = ("expert", None, None, "embed")
        tokens = self._named(local.transpose(1, 0, 2, 3), buffer)  # to the experts
        assert self.up.bias is not None
        assert self.down.bias is not None
        h = jnp.einsum("egcd,efd->egcf", tokens, self.up.weight) + self.up.bias[:, None, None]
        out = jnp.einsum("egcf,edf->egcd", jax.nn.gelu(h), self.down.weight)
        out = self._named(out + self.down.bias[:, None, None], buffer)
        back = self._named(out.transpose(1, 0, 2, 3), ("batch", None, None, "embed"))
        gate = jnp.sum(probs * kept, axis=-1)  # the top expert's probability, 0 if dropped
        return jnp.einsum("gsec,gecd->gsd", slots, back) * gate[..., None]


class Block(eqx.Module):
    """One pre-norm transformer block: causal self-attention, then a GELU MLP (or,
    with `sizes.experts`, `Experts`). With `names`, it names its activations' axes
    (`eqshard.constrain`), which the active rules' `"dims"` lay out: the residual
    stream `(..., "seq", "embed")`; with `heads` too, the queries `(...,
    "inner_seq", "heads", None)` and the keys and values `(..., "kv_seq", "heads",
    None)`."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear | None
    down: eqx.nn.Linear | None
    experts: Experts | None
    names: bool = eqx.field(static=True)
    heads: bool = eqx.field(static=True)

    def __init__(self, key: Array, sizes: Sizes = DEMO, names: bool = False, heads: bool = False):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(sizes.dim)
        self.attn = eqx.nn.MultiheadAttention(sizes.heads, sizes.dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(sizes.dim)
        if sizes.experts:
            self.up = self.down = None
            self.experts = Experts(k2, sizes, names)
        else:
            self.up = eqx.nn.Linear(sizes.dim, sizes.hidden, key=k2)
            self.down = eqx.nn.Linear(sizes.hidden, sizes.dim, key=k3)
            self.experts = None
        self.names, self.heads = names, heads

    def _heads(self, q: Array, k: Array, v: Array) -> tuple[Array, Array, Array]:
        """The queries, keys and values, each (seq, heads, head_dim), named."""
        q = constrain(q, (..., "inner_seq", "heads", None))
        kv = (..., "kv_seq", "heads", None)
        return q, constrain(k, kv), constrain(v, kv)

    def __call__(
        self, x: Float[Array, "seq embed"], mask: Bool[Array, "seq seq"]
    ) -> Float[Array, "seq embed"]:
        if self.names:
            x = constrain(x, (..., "seq", "embed"))  # laid out by the active rules
        y = jax.vmap(self.norm1)(x)
        heads = self._heads if self.heads else None
        x = x + self.attn(y, y, y, mask=mask, process_heads=heads)
        if self.names:
            x = constrain(x, (..., "seq", "embed"))
        y = jax.vmap(self.norm2)(x)
        assert self.up is not None, "a block of experts runs on the batch (`batched`)"
        assert self.down is not None
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(y)))

    def batched(
        self, x: Float[Array, "batch seq embed"], mask: Bool[Array, "seq seq"]
    ) -> Float[Array, "batch seq embed"]:
        """The block of experts on the whole batch: attention per row, the experts on
        every row's tokens at once."""
        assert self.experts is not None
        residual = ("batch", "seq", "embed")
        if self.names:
            x = constrain(x, residual)
        y = jax.vmap(jax.vmap(self.norm1))(x)
        x = x + jax.vmap(lambda y: self.attn(y, y, y, mask=mask))(y)
        if self.names:
            x = constrain(x, residual)
        return x + self.experts(jax.vmap(jax.vmap(self.norm2))(x))


class GPT(eqx.Module):
    """Token and position embeddings, `sizes.layers` stacked blocks, a LayerNorm,
    logits."""

    embed: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    blocks: Block  # stacked: every array leaf has a leading axis of `sizes.layers`
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear
    microbatches: int = eqx.field(static=True)

    def __init__(self, key: Array, sizes: Sizes = DEMO, names: bool = False, heads: bool = False):
        k_embed, k_pos, k_blocks, k_unembed = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(sizes.vocab, sizes.dim, key=k_embed)
        self.pos = eqx.nn.Embedding(sizes.seq, sizes.dim, key=k_pos)
        keys = jax.random.split(k_blocks, sizes.layers)
        self.blocks = eqx.filter_vmap(lambda k: Block(k, sizes, names, heads))(keys)
        self.microbatches = sizes.microbatches
        self.norm = eqx.nn.LayerNorm(sizes.dim)
        self.unembed = eqx.nn.Linear(sizes.dim, sizes.vocab, use_bias=False, key=k_unembed)

    def __call__(self, tokens: Int[Array, "*batch seq"]) -> Float[Array, "*batch seq vocab"]:
        """The logits of one sequence, or of a batch of them (a batch of rows runs
        each row on its own, but for a block of experts, which takes the whole batch,
        and for layers in pipeline stages, which take it in microbatches)."""
        if tokens.ndim == 2 and self.blocks.experts is None and not self.microbatches:
            return jax.vmap(self)(tokens)
        n = tokens.shape[-1]
        x = jnp.vectorize(self.embed, signature="()->(d)")(tokens) + jax.vmap(self.pos)(
            jnp.arange(n)
        )
        causal = jnp.tril(jnp.ones((n, n), dtype=bool))
        if self.microbatches:  # the one line that runs the layers in stages
            rows = lambda block, x: jax.vmap(lambda row: block(row, causal))(x)  # noqa: E731
            # each row (a sequence) is its own: the weights' gradients summed once
            x = pipeline(rows, self.blocks, x, microbatches=self.microbatches, batch_axis="data")
        else:
            params, static = eqx.partition(self.blocks, eqx.is_array)

            def layer(x: Float[Array, "*batch seq embed"], p: Any) -> tuple[Array, None]:
                block = eqx.combine(p, static)  # one layer's slice of the stack
                return (block.batched(x, causal) if x.ndim == 3 else block(x, causal)), None

            x, _ = jax.lax.scan(layer, x, params)
        return jnp.vectorize(lambda v: self.unembed(self.norm(v)), signature="(d)->(v)")(x)


def build(seed: int = 0, sizes: Sizes = DEMO, names: bool = False, heads: bool = False) -> GPT:
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
    - `heads`: whether each block names its queries, keys and values too.

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

    shapes = eqx.filter_eval_shape(GPT, jax.random.key(seed), sizes, names, heads)
    return jax.tree_util.tree_map_with_path(init, shapes)


def tokens(seed: int = 1, variant: Variant = GPT_VARIANT) -> Int[np.ndarray, "batch seq_plus_1"]:
    """The fixed batch: `variant.rows` rows (`BATCH`) of `seq + 1` (`SEQ + 1`)
    deterministic random token ids; the model reads the first `seq` of each row and
    predicts the next token."""
    shape = (variant.rows, variant.sizes.seq + 1)
    return np.random.default_rng(seed).integers(0, VOCAB, shape).astype(np.int32)


def loss(model: GPT, batch: Int[Array, "batch seq_plus_1"]) -> Float[Array, ""]:
    """Next-token cross-entropy, averaged over the batch and the positions."""
    logp = jax.nn.log_softmax(model(batch[:, :-1]))
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
