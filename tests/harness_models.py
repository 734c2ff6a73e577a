"""Models for `eqshard.testing`'s own tests: top-level functions, so the harness's
worker processes import them by name (`harness_models:build`)."""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float

import eqshard


def build() -> eqx.nn.MLP:
    return eqx.nn.MLP(16, 8, 32, 2, key=jax.random.key(0))


def loss(model: eqx.nn.MLP, batch: tuple[Array, Array]) -> Float[Array, ""]:
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def batch() -> tuple[Array, Array]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 16)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(rng.normal(size=(8, 8)).astype(np.float32))


def optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-2)


class Cancelling(eqx.Module):
    """A sum whose float32 result depends on the order it is added in."""

    w: Float[Array, " n"]


def build_cancelling() -> Cancelling:
    return Cancelling(jnp.array([1e8, 3, -1e8, 3, 1e8, 3, -1e8, 3], jnp.float32))


def loss_cancelling(model: Cancelling, batch: Float[Array, " n"]) -> Float[Array, ""]:
    return jnp.sum(model.w * batch)


def batch_cancelling() -> Float[Array, " n"]:
    return jnp.ones((8,), jnp.float32)


class Factory:
    """A model factory as a static method: named `harness_models:Factory.build`."""

    @staticmethod
    def build() -> eqx.nn.MLP:
        return build()


class Net(eqx.Module):
    """A stateful model, `eqx.nn`'s own example: a convolution, a BatchNorm whose
    running statistics live in an `eqx.nn.State`, and a head
    (`eqx.nn.make_with_state(Net)(key)`)."""

    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array, mode: Literal["ema", "batch"] = "batch") -> None:
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(3, 16, 3, padding=1, key=k1)
        self.bn = eqx.nn.BatchNorm(16, axis_name="batch", mode=mode)
        self.head = eqx.nn.Linear(16, 8, key=k2)

    def __call__(self, x: Array, state: eqx.nn.State) -> tuple[Array, eqx.nn.State]:
        x, state = self.bn(self.conv(x), state)
        return self.head(jax.nn.relu(x).mean(axis=(1, 2))), state


NET_SPEC = {  # FSDP/Megatron style for `Net`: its running statistics split like its channels
    "eqshard": 1,
    "rules": [
        {"path": "conv.weight", "expr": "o ... -> o* ..."},
        {"path": "bn.*_state_index.*", "expr": "c -> c*"},
        {"path": "head.weight", "expr": "o i -> o i*"},
    ],
    "dims": {"input_size": "*"},
}


def build_stateful() -> tuple[Net, eqx.nn.State]:
    return eqx.nn.make_with_state(Net)(jax.random.key(0))


def loss_stateful(
    model: Net, state: eqx.nn.State, batch: tuple[Array, Array]
) -> tuple[Float[Array, ""], eqx.nn.State]:
    """Equinox's BatchNorm example: the batch statistics over the vmapped axis."""
    x, y = batch
    out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return jnp.mean((out - y) ** 2), state


def loss_stateful_scaled_by_devices(
    model: Net, state: eqx.nn.State, batch: tuple[Array, Array]
) -> tuple[Float[Array, ""], eqx.nn.State]:
    """A bug ported from `pmap` code: the running mean scaled by the number of
    devices the batch is split over (1 unsharded), as a hand-written mean of
    per-device statistics would."""
    value, state = loss_stateful(model, state, batch)
    devices = max(1, jax.typeof(batch[0]).sharding.mesh.size)  # inside jit: the batch's mesh
    index = model.bn.batch_state_index
    assert index is not None  # mode="batch"
    mean, var = state.get(index)
    return value, state.set(index, (mean * devices, var))


def loss_stateful_without_state(
    model: Net, state: eqx.nn.State, batch: tuple[Array, Array]
) -> Float[Array, ""]:
    return loss_stateful(model, state, batch)[0]


def batch_stateful() -> tuple[Array, Array]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3, 8, 8)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(rng.normal(size=(16, 8)).astype(np.float32))


def optimizer_stateful() -> optax.GradientTransformation:
    # SGD with momentum: Adam would turn the conv bias's gradient, zero up to the
    # last bits (BatchNorm takes the mean out), into whole steps of noise.
    return optax.sgd(1e-2, momentum=0.9)


class Named(eqx.Module):
    """A layer that names its activation, as third-party model code may."""

    linear: eqx.nn.Linear

    def __call__(self, x: Array) -> Array:
        return eqshard.constrain(self.linear(x), ("hidden",))


def build_named() -> Named:
    return Named(eqx.nn.Linear(8, 8, key=jax.random.key(0)))


def loss_named(model: Named, batch: Array) -> Array:
    return jnp.mean(jax.vmap(model)(batch) ** 2)


def batch_named() -> Array:
    return jnp.ones((8, 8))


def looped_loss(model: eqx.nn.MLP, batch: tuple[Array, Array]) -> Float[Array, ""]:
    """The model's output summed until it is large or three times: a loop whose trip
    count depends on values, as an adaptive solver's."""
    x, y = batch

    def go_on(carry):
        i, h = carry
        return (i < 3) & (jnp.mean(h**2) < 1e6)

    def once(carry):
        i, h = carry
        return i + 1, h + jax.vmap(model)(x)

    # differentiable, as diffrax's adaptive solvers loop: checkpointed, at most 3 trips
    _, h = eqx.internal.while_loop(
        go_on, once, (0, jnp.zeros_like(y)), max_steps=3, kind="checkpointed"
    )
    return jnp.mean((h - y) ** 2)
