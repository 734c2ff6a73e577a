"""A model's plan, applied to any tree made of the model: the model, its optimizer state.

Optimizer states are not model-shaped. Adam's moments follow
`eqx.filter(model, eqx.is_array)`, `optax.masked` and `multi_transform` put
`MaskedNode`s (empty subtrees) where leaves are masked, `MultiSteps` keeps an
accumulator beside the inner state, and Adafactor keeps factored moments at the
parameters' paths with other shapes. So a leaf is matched by key path: one whose
path ends with a parameter's path (the longest such) and has its shape gets that
parameter's sharding; every other array leaf (step counts, factored moments) is
replicated, and its origin says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jaxtyping import PyTree

from ._errors import EqshardError, Problem
from ._expression import Expression
from ._fields import is_array_like
from ._paths import segments
from ._plan import Plan, Planned, Unspecified, make_plan
from ._resolve import Resolved
from ._sharding import AnyMesh, Device

__all__ = ["REPLICATED", "plan_for"]

REPLICATED = "replicated: no parameter here"
"""The origin of a leaf of a tree that no parameter of the plan's model matches."""


def _same_structure(tree: Any, given: Plan) -> list[Problem] | None:
    """`None` when `tree` is not shaped like the plan's model; else the leaves whose
    shapes differ from the model's."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    resolved = given.resolved
    if treedef != resolved.treedef:
        return None
    return [
        Problem(
            resolved.where(i),
            f"the plan was made for shape {tuple(old.shape)}, and this leaf has "
            f"{tuple(new.shape)}; make the plan from this model",
        )
        for i, (new, old, sharding) in enumerate(zip(leaves, resolved.leaves, given.flat_shardings))
        if sharding is not None and tuple(getattr(new, "shape", ())) != tuple(old.shape)
    ]


def _by_parameter(tree: Any, given: Plan) -> Planned:
    """`given`'s shardings for each leaf of `tree` whose path ends with a parameter's
    path and has its shape; a full copy for every other array leaf."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    model = given.resolved
    leaves = [leaf for _, leaf in flat]
    exprs: list[Expression | None] = [None] * len(flat)
    origins: list[str | None] = [None] * len(flat)
    shardings: list[Any] = [None] * len(flat)
    replicated = given.replicated()
    matched = unmatched = 0
    for i, (path, leaf) in enumerate(flat):
        if not is_array_like(leaf):
            continue
        segs = segments(path)
        found = _parameter(segs, tuple(leaf.shape), given)
        if found is None:
            shardings[i], origins[i] = replicated, REPLICATED
            unmatched += len(leaf.shape) > 0
            continue
        j, parameter = found
        shardings[i], exprs[i] = given.flat_shardings[j], model.exprs[j]
        origins[i] = f"parameter {'.'.join(parameter)}"
        matched += 1
    problems = []
    if not matched and unmatched:
        problems.append(
            Problem(
                "the root",
                f"the plan was made for a model of {len(model.leaves)} leaves, and no leaf of "
                "this tree ends with one of its parameters' paths and shapes; make the plan "
                "from the model this tree was built from",
            )
        )
    resolved = Resolved(tree, leaves, treedef, exprs, origins, set())
    derived = Plan(given.mesh, resolved, shardings, given.devices, given.mesh_is_given)
    return Planned(derived, problems, [])


def _parameter(
    segs: tuple[str, ...], shape: tuple[int, ...], given: Plan
) -> tuple[int, tuple[str, ...]] | None:
    """The parameter whose path is the longest suffix of `segs`, if it has `shape`."""
    for k in range(len(segs)):
        j = given.by_path.get(segs[k:])
        if j is not None:
            if tuple(given.resolved.leaves[j].shape) == shape:
                return j, segs[k:]
            return None
    return None


def plan_for(
    tree: PyTree[Any],
    spec: Any,
    *,
    mesh: AnyMesh | None = None,
    devices: Sequence[Device] | None = None,
    unspecified: Unspecified = "replicate",
) -> Planned:
    """The plan that lays out `tree`. For a spec, `make_plan(tree, spec, ...)`. For a
    `Plan`: the plan itself when `tree` is shaped like its model, else the plan
    applied by key path (an optimizer state built from the model).
    """
    if not isinstance(spec, Plan):
        return make_plan(tree, spec, mesh=mesh, devices=devices, unspecified=unspecified)
    if devices is not None or mesh is not None:
        raise EqshardError(
            f"`{'devices' if devices is not None else 'mesh'}=` is given with a `Plan`, "
            "which has its mesh already; pass one or the other"
        )
    same = _same_structure(tree, spec)
    if same is not None:
        return Planned(spec, same, [])
    return _by_parameter(tree, spec)
