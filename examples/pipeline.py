"""A deep stack of `eqx.nn` layers, trained with its layers split into pipeline stages.

The 8 residual MLP layers are stacked with `eqx.filter_vmap`. The model runs them
with `eqshard.parallel.pipeline`, where a plain model would call `jax.lax.scan`: the one-line
change. The spec file splits the stack's layer axis over the mesh axis `stage`, so
each of 4 stages holds 2 layers, and the batch over `data`. `pipeline` cuts the
batch into 8 microbatches and runs them through the stages, one `collective-permute`
between neighbours per step of its loop. Each layer computes each row on its own, so
the model passes `batch_axis="data"`: the weights' gradients are summed over `data`
once per step. With no `stage` axis it is the plain scan.

- `specs/pipeline.gpipe.eqshard.json`: GPipe. Stage `s` holds layers `2s` and `2s +
    1`.
- `specs/pipeline.circular.eqshard.json`: the circular schedule. The layers are
    stacked `(rounds, stages)` = `(2, 4)`, stage `s` holds layers `s` and `s + 4`, and
    each microbatch goes round the stages twice.

    python examples/pipeline.py     # trains 3 steps under each schedule and unsharded
"""

from pathlib import Path
from typing import Any, Literal, NamedTuple

import jax

if __name__ == "__main__":  # before JAX starts: 8 simulated CPU devices
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float

import eqshard

SPECS = Path(__file__).parent / "specs"
GPIPE = SPECS / "pipeline.gpipe.eqshard.json"
CIRCULAR = SPECS / "pipeline.circular.eqshard.json"


class Sizes(NamedTuple):
    """8 layers in 4 stages, a batch of 16 in 8 microbatches."""

    features: int = 16
    dim: int = 32
    hidden: int = 64
    layers: int = 8
    stages: int = 4
    batch: int = 16
    microbatches: int = 8
    schedule: Literal["gpipe", "circular"] = "gpipe"
    batch_axis: str | None = "data"  # each row on its own: see eqshard.parallel.pipeline


SIZES = Sizes()


class Layer(eqx.Module):
    """A pre-norm residual MLP, on each row of a microbatch."""

    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, sizes: Sizes, key):
        k_up, k_down = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(sizes.dim)
        self.up = eqx.nn.Linear(sizes.dim, sizes.hidden, key=k_up)
        self.down = eqx.nn.Linear(sizes.hidden, sizes.dim, key=k_down)

    def __call__(self, x: Float[Array, "rows dim"]) -> Float[Array, "rows dim"]:
        return x + jax.vmap(lambda v: self.down(jax.nn.gelu(self.up(self.norm(v)))))(x)


class Deep(eqx.Module):
    """An input projection, the stacked layers, and a head."""

    project: eqx.nn.Linear
    blocks: Layer  # stacked: (layers, ...), or (rounds, stages, ...) for "circular"
    head: eqx.nn.Linear
    microbatches: int = eqx.field(static=True)
    schedule: str = eqx.field(static=True)
    batch_axis: str | None = eqx.field(static=True)

    def __init__(self, sizes: Sizes = SIZES, key=None):
        keys = jax.random.split(jax.random.key(0) if key is None else key, 3)
        self.project = eqx.nn.Linear(sizes.features, sizes.dim, key=keys[0])
        layers = jax.random.split(keys[1], sizes.layers)
        if sizes.schedule == "circular":  # layer r * stages + s on stage s
            layers = layers.reshape(sizes.layers // sizes.stages, sizes.stages)
            self.blocks = eqx.filter_vmap(eqx.filter_vmap(lambda k: Layer(sizes, k)))(layers)
        else:
            self.blocks = eqx.filter_vmap(lambda k: Layer(sizes, k))(layers)
        self.head = eqx.nn.Linear(sizes.dim, 1, key=keys[2])
        self.microbatches, self.schedule = sizes.microbatches, sizes.schedule
        self.batch_axis = sizes.batch_axis

    def __call__(self, x: Float[Array, "batch features"]) -> Float[Array, " batch"]:
        x = jax.vmap(self.project)(x)
        # a plain model: `jax.lax.scan` over the stacked layers; here, in stages
        x = eqshard.parallel.pipeline(
            lambda layer, x: layer(x),
            self.blocks,
            x,
            microbatches=self.microbatches,
            schedule=self.schedule,  # pyright: ignore[reportArgumentType]
            batch_axis=self.batch_axis,  # the layers compute each row on its own
        )
        return jax.vmap(self.head)(x)[:, 0]


def build(sizes: Sizes = SIZES) -> Deep:
    return Deep(sizes)


def build_circular() -> Deep:
    return Deep(SIZES._replace(schedule="circular"))


Batch = tuple[Float[Array, "batch features"], Float[Array, " batch"]]


def batch(sizes: Sizes = SIZES) -> Batch:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(sizes.batch, sizes.features)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(np.sin(x.sum(axis=1)).astype(np.float32))


def loss(model: Deep, data: Batch) -> Float[Array, ""]:
    x, y = data
    return jnp.mean((model(x) - y) ** 2)


def optimizer() -> optax.GradientTransformation:
    return optax.adam(1e-3)


@eqshard.jit
def step(model: Deep, opt_state: Any, data: Batch):
    value, grads = eqx.filter_value_and_grad(loss)(model, data)
    updates, opt_state = optimizer().update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return value, eqx.apply_updates(model, updates), opt_state


def main(steps: int = 3, spec: Path = GPIPE) -> dict[str, Any]:
    """Trains `steps` steps laid out by `spec` and with the plain scan; returns both
    losses, the plan and both trained models."""
    schedule = "circular" if spec == CIRCULAR else "gpipe"
    data = batch()
    with jax.default_matmul_precision("highest"):
        model = build(SIZES._replace(schedule=schedule))
        opt_state = optimizer().init(eqx.filter(model, eqx.is_array))
        reference, ref_model, ref_state = [], model, opt_state
        for _ in range(steps):  # no rules: `pipeline` is the plain scan
            value, ref_model, ref_state = step(ref_model, ref_state, data)
            reference.append(float(value))
        plan = eqshard.plan(model, eqshard.load(spec), devices=8)  # the first 8 devices
        with eqshard.use(plan):
            model, opt_state = eqshard.apply(model, plan), eqshard.apply(opt_state, plan)
            losses = []
            for _ in range(steps):
                value, model, opt_state = step(model, opt_state, data)
                losses.append(float(value))
    for i, (a, b) in enumerate(zip(losses, reference)):
        print(f"{spec.name} step {i}: loss {a:.6f} (plain scan {b:.6f})")
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    return {
        "losses": losses,
        "reference": reference,
        "plan": plan,
        "model": model,
        "reference_model": ref_model,
    }


if __name__ == "__main__":
    main(spec=GPIPE)
    main(spec=CIRCULAR)
