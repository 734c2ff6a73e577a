"""Spec trees: the model's structure with an expression (or JAX's own layout, a
`PartitionSpec` or a `NamedSharding`: `_partition.py`) at each array leaf.

A spec tree may be a prefix of the model, as `in_shardings` is for `jax.jit`: a
single expression or `None` stands for a whole subtree, and one expression stands
for the whole model. `SpecTree` is the resolver that broadcasts it to one spec
leaf per leaf of the model, or names the first place where the structures differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ._fields import leaf_name
from ._paths._names import segments
from ._problems import Problem
from ._protocol import Resolution, SpecLeaf, Target, is_spec_leaf

__all__ = ["SpecTree", "not_a_spec_leaf"]

_flatten_one = jax.tree_util.default_registry.flatten_one_level_with_keys


def not_a_spec_leaf(x: Any) -> str:
    """The message for a spec leaf that is none of what a spec leaf may be."""
    text = repr(x)
    if len(text) > 80:
        text = f"{text[:77]}..."
    return (
        f"the spec holds {type(x).__name__} {text}; a spec leaf is an expression, its text, "
        "a PartitionSpec, a NamedSharding, or None"
    )


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    flat = _flatten_one(node)
    return None if flat is None else list(flat[0])


def _describe(x: Any) -> str:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{dtype}{list(shape)}"
    return type(x).__name__


def _keys(children: list[tuple[Any, Any]]) -> list[str]:
    return [repr(segments((key,))[0]) for key, _ in children]


def _mismatch(spec: Any, model: Any, path: tuple[Any, ...] = ()) -> Problem | None:
    """The first place where `spec` is not a prefix of `model`'s structure."""
    if is_spec_leaf(spec):
        return None
    spec_children, model_children = _children(spec), _children(model)
    where = leaf_name(path)
    if spec_children is None:
        return Problem(where, not_a_spec_leaf(spec))
    if model_children is None:
        return Problem(
            where,
            f"the spec has a {type(spec).__name__} here, where the model has a leaf "
            f"({_describe(model)}); put one expression or None here",
        )
    if type(spec) is not type(model):
        return Problem(
            where,
            f"the spec has a {type(spec).__name__} here, where the model has a "
            f"{type(model).__name__}; build the spec from the model, e.g. with "
            "`eqshard.spec_tree(model)` and `eqx.tree_at`",
        )
    spec_keys, model_keys = _keys(spec_children), _keys(model_children)
    if spec_keys != model_keys:
        missing = [k for k in model_keys if k not in spec_keys]
        extra = [k for k in spec_keys if k not in model_keys]
        parts = [
            f"the model has {', '.join(missing)} that the spec lacks" if missing else "",
            f"the spec has {', '.join(extra)} that the model lacks" if extra else "",
        ]
        detail = "; ".join(part for part in parts if part)
        return Problem(where, detail or f"the keys differ: spec {spec_keys}, model {model_keys}")
    for (key, spec_child), (_, model_child) in zip(spec_children, model_children):
        found = _mismatch(spec_child, model_child, (*path, key))
        if found is not None:
            return found
    return Problem(where, "the spec's structure differs from the model's here")


@dataclasses.dataclass(frozen=True, eq=False)
class SpecTree:
    """The resolver of a spec tree, a prefix of one, or one expression for all."""

    tree: Any

    def __eqshard_resolve__(self, model: Any, target: Target) -> Resolution:
        del target  # a spec tree holds for any device count
        treedef = jax.tree_util.tree_structure(model)
        n = treedef.num_leaves
        if is_spec_leaf(self.tree):
            return Resolution([self.tree] * n)
        spec_leaves, spec_def = jax.tree_util.tree_flatten(self.tree, is_leaf=is_spec_leaf)
        if spec_def == treedef:  # a full spec tree: one spec leaf per model leaf
            return Resolution(spec_leaves)
        try:
            subtrees = spec_def.flatten_up_to(model)
        except (ValueError, TypeError):
            problem = _mismatch(self.tree, model) or Problem("the root", "the structures differ")
            return Resolution([None] * n, [problem], failed=frozenset(range(n)))
        exprs: list[SpecLeaf] = []
        for spec_leaf, subtree in zip(spec_leaves, subtrees):
            exprs.extend([spec_leaf] * jax.tree_util.tree_structure(subtree).num_leaves)
        return Resolution(exprs)
