"""Two mixtures of experts of `eqx.nn` parts, written as models in the wild write them
(no `eqshard.constrain`), for tests/test_expert_forms.py:

- `ragged`: Qwen3-MoE's dropless layer, megablox style: a router picks each token's
    top k experts, the picks are sorted by expert, and the experts, a SwiGLU stacked
    with `eqx.filter_vmap` (weights of `(experts, out, in)`), are applied to the
    sorted rows with `jax.lax.ragged_dot`, `group_sizes` rows each;
- `gshard`: GShard's layer, its arrays raw as Mesh-TensorFlow's: a router of
    `(experts, dim)`, one weight of `(experts, dim, hidden)` and one of `(experts,
    hidden, dim)`; each token's top k picks dispatched to a capacity per expert and
    group by a one-hot mask, and the experts contracted by `einsum`
    (`"gecd,edh->gech"`).

`ragged_build` and `gshard_build` build them at examples/moe.py's sizes, and its
`loss`, `optimizer` and `batch` serve both; `step` is its step, not jitted.
"""

import math
import runpy
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_MOE = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "moe.py"), run_name=__name__)
Sizes, SIZES, capacity = _MOE["Sizes"], _MOE["SIZES"], _MOE["capacity"]
loss, optimizer, batch = _MOE["loss"], _MOE["optimizer"], _MOE["batch"]


class SwiGLU(eqx.Module):
    """One expert: `down(silu(gate(x)) * up(x))`."""

    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim: int, hidden: int, key):
        k_gate, k_up, k_down = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(dim, hidden, use_bias=False, key=k_gate)
        self.up = eqx.nn.Linear(dim, hidden, use_bias=False, key=k_up)
        self.down = eqx.nn.Linear(hidden, dim, use_bias=False, key=k_down)

    def __call__(self, x: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class RaggedExperts(eqx.Module):
    """Qwen3-MoE's dropless layer: top-k routing, the picks sorted by expert, the
    stacked SwiGLU applied to each expert's rows by `jax.lax.ragged_dot`."""

    router: eqx.nn.Linear
    experts: SwiGLU  # stacked: gate.weight (experts, hidden, dim)
    top_k: int = eqx.field(static=True)

    def __init__(self, sizes: Any, key):
        k_router, k_experts = jax.random.split(key)
        self.router = eqx.nn.Linear(sizes.dim, sizes.experts, use_bias=False, key=k_router)
        keys = jax.random.split(k_experts, sizes.experts)
        self.experts = eqx.filter_vmap(lambda k: SwiGLU(sizes.dim, sizes.hidden, k))(keys)
        self.top_k = sizes.top_k

    def __call__(self, x: Float[Array, "tokens dim"]) -> Float[Array, "tokens dim"]:
        tokens, dim = x.shape
        experts = self.router.weight.shape[0]
        probs = jax.nn.softmax(x @ self.router.weight.T, axis=-1)
        weights, picks = jax.lax.top_k(probs, self.top_k)  # (tokens, k)
        weights = weights / weights.sum(axis=-1, keepdims=True)  # Qwen3's norm_topk_prob
        flat = picks.reshape(-1)  # (tokens * k,): each pick's expert
        order = jnp.argsort(flat, stable=True)  # the picks sorted by expert
        rows = x[order // self.top_k]  # each pick's token, in that order
        group_sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)

        def applied(rows: Array, linear: eqx.nn.Linear) -> Array:
            # the stacked (experts, out, in) weight as ragged_dot's (experts, in, out)
            return jax.lax.ragged_dot(rows, jnp.swapaxes(linear.weight, 1, 2), group_sizes)

        mlp = self.experts
        h = jax.nn.silu(applied(rows, mlp.gate)) * applied(rows, mlp.up)
        out = applied(h, mlp.down)  # (tokens * k, dim), sorted by expert
        unsorted = jnp.zeros_like(out).at[order].set(out)  # back in the picks' order
        return jnp.einsum("tkd,tk->td", unsorted.reshape(tokens, self.top_k, dim), weights)


class GShardExperts(eqx.Module):
    """GShard's layer: top-k routing with a capacity per group, a one-hot dispatch
    mask and einsums over one `(experts, dim, hidden)` weight."""

    router: Float[Array, "experts dim"]  # beside the experts, and no expert stack
    w_in: Float[Array, "experts dim hidden"]
    w_out: Float[Array, "experts hidden dim"]
    top_k: int = eqx.field(static=True)
    capacity: int = eqx.field(static=True)

    def __init__(self, sizes: Any, key):
        k_router, k_in, k_out = jax.random.split(key, 3)
        shape = (sizes.experts, sizes.dim)
        self.router = jax.random.normal(k_router, shape) / math.sqrt(sizes.dim)
        shape = (sizes.experts, sizes.dim, sizes.hidden)
        self.w_in = jax.random.normal(k_in, shape) / math.sqrt(sizes.dim)
        shape = (sizes.experts, sizes.hidden, sizes.dim)
        self.w_out = jax.random.normal(k_out, shape) / math.sqrt(sizes.hidden)
        self.top_k, self.capacity = sizes.top_k, capacity(sizes)

    def __call__(self, x: Float[Array, "group seq dim"]) -> Float[Array, "group seq dim"]:
        groups, seq, _ = x.shape
        experts = self.w_in.shape[0]
        probs = jax.nn.softmax(jnp.einsum("gsd,ed->gse", x, self.router), axis=-1)
        gates, picks = jax.lax.top_k(probs, self.top_k)  # (group, seq, k)
        chosen = jax.nn.one_hot(picks, experts, dtype=x.dtype)  # (group, seq, k, expert)
        # each pick's slot in its expert's buffer, first choices first; past the
        # capacity it is dropped
        order = chosen.transpose(0, 2, 1, 3).reshape(groups, self.top_k * seq, experts)
        position = jnp.cumsum(order, axis=1).astype(jnp.int32) - 1
        kept = order * (position < self.capacity)
        slots = jax.nn.one_hot(position, self.capacity, dtype=x.dtype) * kept[..., None]
        slots = slots.reshape(groups, self.top_k, seq, experts, self.capacity)
        slots = slots.transpose(0, 2, 1, 3, 4)  # (group, seq, k, expert, capacity)
        dispatch = slots.sum(axis=2)  # the one-hot mask (group, seq, expert, capacity)
        combine = jnp.einsum("gsk,gskec->gsec", gates, slots)
        tokens = jnp.einsum("gsec,gsd->gecd", dispatch, x)
        h = jax.nn.gelu(jnp.einsum("gecd,edh->gech", tokens, self.w_in))
        out = jnp.einsum("gech,ehd->gecd", h, self.w_out)
        return jnp.einsum("gsec,gecd->gsd", combine, out)


class MoE(eqx.Module):
    """An embedding, a norm, one mixture-of-experts layer with a residual, a head."""

    embed: eqx.nn.Embedding
    norm: eqx.nn.RMSNorm
    moe: RaggedExperts | GShardExperts
    head: eqx.nn.Linear

    def __init__(self, kind: str, sizes: Any = SIZES, key=None):
        keys = jax.random.split(jax.random.key(0) if key is None else key, 3)
        self.embed = eqx.nn.Embedding(sizes.vocab, sizes.dim, key=keys[0])
        self.norm = eqx.nn.RMSNorm(sizes.dim)
        layer = RaggedExperts if kind == "ragged" else GShardExperts
        self.moe = layer(sizes, keys[1])
        self.head = eqx.nn.Linear(sizes.dim, sizes.vocab, key=keys[2])

    def __call__(self, tokens: Int[Array, "batch seq"]) -> Float[Array, "batch seq vocab"]:
        x = jax.vmap(jax.vmap(self.embed))(tokens)
        h = jax.vmap(jax.vmap(self.norm))(x)
        if isinstance(self.moe, RaggedExperts):
            batch, seq, dim = h.shape
            x = x + self.moe(h.reshape(batch * seq, dim)).reshape(batch, seq, dim)
        else:
            x = x + self.moe(h)
        return jax.vmap(jax.vmap(self.head))(x)


def step(model: MoE, opt_state: Any, tokens: Int[Array, "batch seq_plus_1"]):
    value, grads = eqx.filter_value_and_grad(loss)(model, tokens)
    updates, opt_state = optimizer().update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return value, eqx.apply_updates(model, updates), opt_state


def ragged_build() -> MoE:
    return MoE("ragged")


def gshard_build() -> MoE:
    return MoE("gshard")
