"""optax's own map from an optimizer state to its parameters, and the shardings it
implies: what a plan must give each leaf of a state, to check eqshard against."""

import jax
import optax

__all__ = ["blocks", "expected_shardings", "parameters_of"]


def blocks(sharding, shape):
    """Device id -> the block of `shape` it holds, as (start, stop) per dim: a
    layout device by device, whatever mesh or PartitionSpec writes it."""
    return {
        d.id: tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(i, shape))
        for d, i in sharding.devices_indices_map(tuple(shape)).items()
    }


def _is_masked(x):
    return isinstance(x, optax.MaskedNode)


def parameters_of(optimizer, state, params):
    """For each leaf of `state`, the index of the parameter (in `params`' leaves) it
    belongs to, or -1: optax's own map from a state to its parameters, from the
    optimizer's structure."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    index = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
    mapped = optax.tree_map_params(
        optimizer,
        lambda _, i: i,
        state,
        index,
        transform_non_params=lambda _: -1,
        is_leaf=_is_masked,
    )

    # Masked and filtered places are `MaskedNode`s (a leaf's, or a whole subtree's)
    # in the state, and `None`, the parameter's index or the subtree's indices in the
    # map: pair the map with the state's structure, holes as leaves, then drop them.
    def hole(x):
        return x is None or _is_masked(x)

    held, structure = jax.tree_util.tree_flatten(state, is_leaf=hole)
    found = structure.flatten_up_to(mapped)
    return [i for i, leaf in zip(found, held) if not hole(leaf)]


def expected_shardings(optimizer, state, params, plan):
    """What each leaf of `state` must be laid out as: its parameter's sharding where
    it has one and that parameter's shape, else a full copy."""
    shardings = [
        s
        for s, leaf in zip(plan.flat_shardings, plan.resolved.leaves)
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))
    ]
    model_leaves = jax.tree_util.tree_leaves(params)
    assert len(shardings) == len(model_leaves)
    expected = []
    for leaf, i in zip(jax.tree_util.tree_leaves(state), parameters_of(optimizer, state, params)):
        if i >= 0 and leaf.shape == model_leaves[i].shape:
            expected.append(shardings[i])
        else:
            expected.append(None)  # replicated
    return expected
