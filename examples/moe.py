"""A mixture of experts of `eqx.nn` parts, trained with its experts split over the
devices (expert parallelism over `data`, as MaxText's `ep-as-dp`).

The experts' two `eqx.nn.Linear`s are stacked with `eqx.filter_vmap`: weights of
`(experts, out, in)`. A router picks each token's top two experts, and each expert
takes at most `capacity` tokens of each group (a sequence), GShard's routing. Each
group's slots are computed where the group is, then handed to the experts by a change
of layout, from split by group to split by expert (`eqshard.constrain` on
`("batch", ...)`, then on `("expert", ...)`), which XLA makes one all-to-all; the
experts' outputs come back the same way. Written as one einsum from the tokens to the
experts, XLA:TPU gathers every token to every device instead. The model names its
activations' axes (`"batch"`, `"seq"`, `"expert"`, `"embed"`, and `"group"` for the
groups in the experts' buffers). Two spec files lay it out:

- `specs/moe.eqshard.json` maps `"batch"` and `"expert"` to `data` (expert
    parallelism over data, MaxText's `ep-as-dp`): each device holds its own expert and
    its own groups;
- `specs/moe.data_expert.eqshard.json` declares a `data x expert` mesh: the experts
    split over `expert`, the batch over both axes, and in the experts' buffers the
    groups over `data`, so the all-to-alls run within each `expert` group of devices.

    python examples/moe.py      # trains 3 steps under each spec and unsharded, compares
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

SPEC = Path(__file__).parent / "specs" / "moe.eqshard.json"
DATA_EXPERT = Path(__file__).parent / "specs" / "moe.data_expert.eqshard.json"


class Sizes(NamedTuple):
    """The model's sizes: 8 experts, each token routed to 2."""

    vocab: int = 64
    dim: int = 32
    hidden: int = 64
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 2.0
    batch: int = 8
    seq: int = 16


SIZES = Sizes()


def capacity(sizes: Sizes) -> int:
    """How many tokens of one group (a sequence) each expert takes at most."""
    return math.ceil(sizes.top_k * sizes.seq * sizes.capacity_factor / sizes.experts)


class Experts(eqx.Module):
    """Top-k routing with a capacity, and the experts' MLPs, stacked."""

    router: eqx.nn.Linear
    up: eqx.nn.Linear  # stacked: weight (experts, hidden, dim)
    down: eqx.nn.Linear  # stacked: weight (experts, dim, hidden)
    top_k: int = eqx.field(static=True)
    capacity: int = eqx.field(static=True)

    def __init__(self, sizes: Sizes, key):
        k_router, k_up, k_down = jax.random.split(key, 3)
        self.router = eqx.nn.Linear(sizes.dim, sizes.experts, use_bias=False, key=k_router)
        ups = jax.random.split(k_up, sizes.experts)
        downs = jax.random.split(k_down, sizes.experts)
        self.up = eqx.filter_vmap(lambda k: eqx.nn.Linear(sizes.dim, sizes.hidden, key=k))(ups)
        self.down = eqx.filter_vmap(lambda k: eqx.nn.Linear(sizes.hidden, sizes.dim, key=k))(downs)
        self.top_k, self.capacity = sizes.top_k, capacity(sizes)

    def __call__(self, x: Float[Array, "group seq dim"]) -> Float[Array, "group seq dim"]:
        groups, seq, _ = x.shape
        experts = self.router.weight.shape[0]
        probs = jax.nn.softmax(jnp.einsum("gsd,ed->gse", x, self.router.weight), axis=-1)
        # the top k by repeated argmax: elementwise work and reductions keep each group
        # on its devices (`lax.top_k` would gather the router's output first)
        picks, left = [], probs
        for _ in range(self.top_k):
            pick = jax.nn.one_hot(jnp.argmax(left, axis=-1), experts, dtype=x.dtype)
            picks.append(pick)
            left = jnp.where(pick > 0, -jnp.inf, left)
        chosen = jnp.stack(picks, axis=2)  # (group, seq, k, expert)
        gates = jnp.einsum("gske,gse->gsk", chosen, probs)
        # each pick's place in its expert's buffer: first choices first, in token order;
        # a pick past the capacity is dropped (its token skips this expert)
        order = chosen.transpose(0, 2, 1, 3).reshape(groups, self.top_k * seq, experts)
        position = jnp.cumsum(order, axis=1).astype(jnp.int32) - 1
        kept = order * (position < self.capacity)
        slots = jax.nn.one_hot(position, self.capacity, dtype=x.dtype) * kept[..., None]
        slots = slots.reshape(groups, self.top_k, seq, experts, self.capacity)
        slots = slots.transpose(0, 2, 1, 3, 4)  # (group, seq, k, expert, capacity)
        dispatch = slots.sum(axis=2)
        combine = jnp.einsum("gsk,gskec->gsec", gates, slots)
        # each group's slots computed where the group is, then handed to the experts:
        # a change of layout from groups to experts, which XLA makes one all-to-all
        up_bias, down_bias = self.up.bias, self.down.bias
        assert up_bias is not None
        assert down_bias is not None
        local = jnp.einsum("gsec,gsd->gecd", dispatch, x)
        local = eqshard.constrain(local, ("batch", None, None, "embed"))
        buffer = ("expert", "group", None, "embed")  # each expert's slots, by group
        tokens = eqshard.constrain(local.transpose(1, 0, 2, 3), buffer)
        up = jnp.einsum("egcd,efd->egcf", tokens, self.up.weight)
        h = jax.nn.gelu(up + up_bias[:, None, None, :])
        out = jnp.einsum("egcf,edf->egcd", h, self.down.weight) + down_bias[:, None, None, :]
        out = eqshard.constrain(out, buffer)
        back = eqshard.constrain(out.transpose(1, 0, 2, 3), ("batch", None, None, "embed"))
        y = jnp.einsum("gsec,gecd->gsd", combine, back)
        return eqshard.constrain(y, ("batch", "seq", "embed"))


class MoE(eqx.Module):
    """An embedding, one mixture-of-experts layer with a residual, and a head."""

    embed: eqx.nn.Embedding
    experts: Experts
    head: eqx.nn.Linear

    def __init__(self, sizes: Sizes = SIZES, key=None):
        keys = jax.random.split(jax.random.key(0) if key is None else key, 3)
        self.embed = eqx.nn.Embedding(sizes.vocab, sizes.dim, key=keys[0])
        self.experts = Experts(sizes, keys[1])
        self.head = eqx.nn.Linear(sizes.dim, sizes.vocab, key=keys[2])

    def __call__(self, tokens: Int[Array, "batch seq"]) -> Float[Array, "batch seq vocab"]:
        x = eqshard.constrain(jax.vmap(jax.vmap(self.embed))(tokens), ("batch", "seq", "embed"))
        x = x + self.experts(x)
        return jax.vmap(jax.vmap(self.head))(x)


def build(sizes: Sizes = SIZES) -> MoE:
    return MoE(sizes)


def loss(model: MoE, tokens: Int[Array, "batch seq_plus_1"]) -> Float[Array, ""]:
    logp = jax.nn.log_softmax(model(tokens[:, :-1]))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def optimizer() -> optax.GradientTransformation:
    return optax.adam(1e-2)


def batch(sizes: Sizes = SIZES) -> Int[Array, "batch seq_plus_1"]:
    return jnp.zeros((sizes.batch, sizes.seq + 1), jnp.int32)


@eqshard.jit
def step(model: MoE, opt_state: Any, tokens: Int[Array, "batch seq_plus_1"]):
    value, grads = eqx.filter_value_and_grad(loss)(model, tokens)
    updates, opt_state = optimizer().update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return value, eqx.apply_updates(model, updates), opt_state


def main(steps: int = 3, spec: Path = SPEC) -> dict[str, Any]:
    """Trains `steps` steps sharded by `spec` and unsharded; returns both losses and
    the plan."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, SIZES.vocab, batch().shape))
    with jax.default_matmul_precision("highest"):
        model = build()
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
    main(spec=SPEC)
    main(spec=DATA_EXPERT)
