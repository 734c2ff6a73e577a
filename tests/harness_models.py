"""Models for `eqshard.testing`'s own tests: top-level functions, so the harness's
worker processes import them by name (`harness_models:build`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float


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
