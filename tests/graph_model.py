"""A small NequIP-like message-passing network over a `jraph.GraphsTuple`, of
`eqx.nn` parts, for `tests/test_batch_rules.py`: imported there, and named by file
for `eqshard check --model/--step/--make-batch/--optimizer` and `eqshard.testing`.

The batch is 3 graphs in one `GraphsTuple`: 16 nodes with features, 88 edges (each
a radial basis of its length, and its sender and receiver), and per graph its node
count, edge count and energy (`globals`). Each interaction weighs a neighbour's
features by an MLP of the edge's radial basis, sums the messages at the receivers
(`jraph.segment_sum`) and updates the node; the readout sums atomic energies per
graph.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jraph
import numpy as np
import optax

NODES, EDGES, GRAPHS = 16, 88, 3
FEATURES, RADIAL = 8, 4
N_NODE, N_EDGE = (5, 5, 6), (30, 30, 28)


def graph(seed: int = 0) -> jraph.GraphsTuple:
    """3 graphs of 5, 5 and 6 nodes, each edge within its graph."""
    rng = np.random.default_rng(seed)
    senders, receivers, offset = [], [], 0
    for nodes, edges in zip(N_NODE, N_EDGE):
        senders.append(rng.integers(offset, offset + nodes, edges))
        receivers.append(rng.integers(offset, offset + nodes, edges))
        offset += nodes
    lengths = rng.uniform(0.5, 3.0, EDGES)
    centres = np.linspace(0.5, 3.0, RADIAL)
    radial = np.exp(-((lengths[:, None] - centres) ** 2))  # a Gaussian radial basis
    return jraph.GraphsTuple(
        nodes=jnp.asarray(rng.normal(size=(NODES, FEATURES)), jnp.float32),
        edges=jnp.asarray(radial, jnp.float32),
        senders=jnp.asarray(np.concatenate(senders), jnp.int32),
        receivers=jnp.asarray(np.concatenate(receivers), jnp.int32),
        n_node=jnp.asarray(N_NODE, jnp.int32),
        n_edge=jnp.asarray(N_EDGE, jnp.int32),
        globals=jnp.asarray(rng.normal(size=(GRAPHS, 1)), jnp.float32),
    )


class Interaction(eqx.Module):
    radial: eqx.nn.MLP
    mix: eqx.nn.Linear
    update: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.radial = eqx.nn.MLP(RADIAL, FEATURES, 16, 1, activation=jax.nn.silu, key=k1)
        self.mix = eqx.nn.Linear(FEATURES, FEATURES, key=k2)
        self.update = eqx.nn.Linear(FEATURES, FEATURES, key=k3)

    def __call__(self, h, g):
        weights = jax.vmap(self.radial)(g.edges)  # (edges, features)
        messages = weights * jax.vmap(self.mix)(h)[g.senders]
        summed = jraph.segment_sum(messages, g.receivers, num_segments=h.shape[0])
        return h + jax.nn.silu(jax.vmap(self.update)(summed))


class NequIPLike(eqx.Module):
    embed: eqx.nn.Linear
    interactions: list[Interaction]
    readout: eqx.nn.MLP

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(FEATURES, FEATURES, key=k1)
        self.interactions = [Interaction(k) for k in jax.random.split(k2, 2)]
        self.readout = eqx.nn.MLP(FEATURES, 1, 16, 1, activation=jax.nn.silu, key=k3)

    def __call__(self, g):
        """Each graph's energy."""
        h = jax.vmap(self.embed)(g.nodes)
        for layer in self.interactions:
            h = layer(h, g)
        atomic = jax.vmap(self.readout)(h)[:, 0]
        index = jnp.repeat(jnp.arange(GRAPHS), g.n_node, total_repeat_length=h.shape[0])
        return jraph.segment_sum(atomic, index, num_segments=GRAPHS)


def build():
    return NequIPLike(jax.random.key(0))


def batch():
    return graph()


def optimizer():
    return optax.adam(1e-2)


def loss(model, g):
    return jnp.mean((model(g) - g.globals[:, 0]) ** 2)


def step(model, opt_state, g):
    value, grads = eqx.filter_value_and_grad(loss)(model, g)
    updates, opt_state = optimizer().update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value
