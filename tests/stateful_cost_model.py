"""A stateful model (a convolution, a BatchNorm, a head) and its training steps, in
Equinox's style, for `tests/test_nn_state_cost.py`: imported there, and named by
file for `eqshard check --model/--step/--make-batch/--optimizer`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax


class Net(eqx.Module):
    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(3, 16, 3, padding=1, key=k1)
        self.bn = eqx.nn.BatchNorm(16, axis_name="batch", mode="ema")
        self.head = eqx.nn.Linear(16, 8, key=k2)

    def __call__(self, x, state):
        x, state = self.bn(self.conv(x), state)
        return self.head(jax.nn.relu(x).mean(axis=(1, 2))), state


def build():
    return eqx.nn.make_with_state(Net)(jax.random.key(0))


def optimizer():
    return optax.adam(1e-3)


def batch():
    return jnp.zeros((16, 3, 8, 8)), jnp.zeros((16, 8))


def loss(model, state, x, y):
    out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return jnp.mean((out - y) ** 2), state


@eqx.filter_jit
def step(model, state, opt_state, batch):
    (value, state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, state, *batch)
    updates, opt_state = optimizer().update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), state, opt_state, value


@eqx.filter_jit
def sgd_step(model, state, batch):
    (value, state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, state, *batch)
    updates = jax.tree_util.tree_map(lambda g: -1e-2 * g, grads)
    return eqx.apply_updates(model, updates), state, value
