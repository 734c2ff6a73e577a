"""Resolving: from any spec source to one complete expression per array leaf.

One path for every source: the resolver gives spec leaves, each is parsed, and
each short form is completed from its field's jaxtyping annotation. Every problem
found on the way is collected, never raised, so `plan` can report them all at once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.core
import numpy as np
from jax.sharding import NamedSharding

from ._annotation import complete, for_rank
from ._errors import EqshardError, ExpressionError
from ._expression import Expression, parse
from ._fields import LeafInfo, is_array_like, leaf_name, walk_fields
from ._fsdp import FSDP_WORD
from ._partition import device_count, expression_of, is_jax_layout, same_mesh, text_of
from ._problems import Problem
from ._protocol import Resolver, Target, is_resolver
from ._spectree import SpecTree, not_a_spec_leaf
from ._warnings import EqshardWarning

__all__ = ["Resolved", "abstract_leaves", "resolve"]


def _abstract(x: Any) -> Any:
    """An array's shape, dtype, weak type and (for a placed array) sharding, without
    its buffer; any other leaf as it is."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        weak = getattr(x, "weak_type", False)  # a PRNG key array has none
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=weak)
    if isinstance(x, jax.core.Tracer):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x.aval, "weak_type", False))
    if isinstance(x, np.ndarray):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def abstract_leaves(tree: Any, leaves: list[Any], treedef: Any) -> tuple[Any, list[Any], Any]:
    """`tree`, its leaves and its treedef with every array leaf abstract
    (`jax.ShapeDtypeStruct`), as a `Resolved` holds them: a plan never keeps the
    user's arrays alive, nor holds them in a `jit` cache as a static argument."""
    abstract = [_abstract(x) for x in leaves]
    if all(a is x for a, x in zip(abstract, leaves)):
        return tree, leaves, treedef
    return jax.tree_util.tree_unflatten(treedef, abstract), abstract, treedef


@dataclasses.dataclass
class Resolved:
    """A model's leaves, flattened, each with its complete expression (or `None`).

    - `model`, `leaves`: the model and its leaves, every array abstract
        (`abstract_leaves`).

    - `exprs`: the complete expression of each leaf, `None` where there is none.
    - `origins`: where each came from, when the resolver says.
    - `failed`: the leaves a problem left without an expression.
    - `memory`: each leaf's memory kind where the resolver names any
        (`"pinned_host"`; `None` for the device's), else `None`.

    Key paths, owners and annotations come from a walk over the model's fields,
    made only when something needs them: `FROM_FIELDS`, a short form, or a message.
    """

    model: Any
    leaves: list[Any]
    treedef: Any
    exprs: list[Expression | None]
    origins: list[str | None]
    failed: set[int]
    _fields: list[LeafInfo] | None = None
    context: Any = None
    memory: list[str | None] | None = None

    def forget_values(self) -> None:
        """Holds the model's arrays abstract from now on (`abstract_leaves`)."""
        model, leaves, _ = abstract_leaves(self.model, self.leaves, self.treedef)
        if leaves is self.leaves:
            return
        self.model, self.leaves = model, leaves
        if self._fields is not None:
            self._fields = [
                LeafInfo(item.path, leaf, item.expr, item.owner, item.annotation)
                for item, leaf in zip(self._fields, leaves)
            ]

    @property
    def fields(self) -> list[LeafInfo]:
        if self._fields is None:
            self._fields = walk_fields(self.model, self.context)
        return self._fields

    def where(self, index: int) -> str:
        """`layers.0.weight (Linear.weight)`: leaf `index`'s name in messages."""
        return self.fields[index].label

    @functools.cached_property
    def paths(self) -> list[str]:
        """Every leaf's dotted path (made once)."""
        return [leaf_name(item.path) for item in self.fields]


def _completed(item: LeafInfo, expr: Expression) -> Expression | Problem:
    """A short form with its left side taken from the leaf's annotation."""
    if str(expr) == FSDP_WORD:  # the spec file's word, given to Python as text
        return Problem(
            item.label,
            f"{FSDP_WORD!r} is FSDP in a spec file only; here it would be a short form "
            "that names a dim 'fsdp'. For FSDP, pass `eqshard.FSDP` as the spec",
        )
    if item.annotation is None:
        return Problem(
            item.label,
            f"the short form {str(expr)!r} needs a left side, and the field has no "
            "jaxtyping annotation such as Float[Array, 'x y'] to take it from; write "
            "the full form 'x y -> ...'",
        )
    try:
        return complete(expr, for_rank(item.annotation, len(getattr(item.leaf, "shape", ()))))
    except ExpressionError as error:
        return Problem.from_error(item.label, error, repr(error.expression))


def _written(layout: Any, leaf: Any, target: Target) -> Expression | str:
    """JAX's own layout of `leaf` (a `PartitionSpec` on the target's mesh, or a
    `NamedSharding`) as the expression that lays it out the same way, or what is wrong."""
    shown = text_of(layout)
    if isinstance(layout, NamedSharding):
        mesh, spec = layout.mesh, layout.spec
        if target.mesh is not None and not same_mesh(mesh, target.mesh):
            return (
                f"{shown} is on another mesh than the plan's ("
                + " x ".join(
                    f"{n}={s}" for n, s in zip(target.mesh.axis_names, target.mesh.axis_sizes)
                )
                + "); give every leaf's sharding the plan's mesh, or write its PartitionSpec"
            )
    else:
        mesh, spec = target.mesh, layout
        if mesh is None:
            return (
                f"{shown} names mesh axes, and the plan has no mesh; pass `mesh=` (or "
                "use `jax.set_mesh`), or write the leaf as an einshard expression"
            )
    if device_count(mesh) != target.devices:
        return (
            f"{shown} is on a mesh of {device_count(mesh)} devices, and the plan lays out "
            f"{target.devices}; give the plan that mesh (`mesh=`)"
        )
    try:
        return expression_of(spec, mesh.axis_names, mesh.axis_sizes, np.shape(leaf))
    except EqshardError as error:
        return str(error)


def resolve(
    model: Any, spec: Any, target: Target
) -> tuple[Resolved, list[Problem], list[EqshardWarning]]:
    """Resolves, parses and completes `spec` for every leaf of `model`.

    **Returns:** the `Resolved` leaves, every problem found (resolver, parse,
    completion), and the resolver's warnings. Raises nothing for a fault in the
    spec; `EqshardError` only for a resolver that breaks the protocol.
    """
    leaves, treedef = jax.tree_util.tree_flatten(model)
    resolver: Resolver = spec if is_resolver(spec) else SpecTree(spec)
    resolution = resolver.__eqshard_resolve__(model, target)
    given = list(resolution.exprs)
    if len(given) != len(leaves):
        raise EqshardError(
            f"{type(resolver).__name__} resolved {len(given)} spec leaves for a model of "
            f"{len(leaves)} leaves; a resolver gives one per leaf"
        )
    origins = list(resolution.origins or [None] * len(leaves))
    memory = None if resolution.memory is None else list(resolution.memory)
    if memory is not None and len(memory) != len(leaves):
        raise EqshardError(
            f"{type(resolver).__name__} gave {len(memory)} memory kinds for a model of "
            f"{len(leaves)} leaves; a resolver gives one per leaf"
        )
    fields = None if resolution.fields is None else list(resolution.fields)
    resolved = Resolved(
        model,
        leaves,
        treedef,
        [None] * len(leaves),
        origins,
        set(resolution.failed),
        fields,
        target.context,
        memory,
    )
    problems = list(resolution.problems)
    for i, spec_leaf in enumerate(given):
        if spec_leaf is None or i in resolved.failed or not is_array_like(leaves[i]):
            continue
        if isinstance(spec_leaf, Expression):
            expr = spec_leaf
        elif is_jax_layout(spec_leaf):
            written = _written(spec_leaf, leaves[i], target)
            if isinstance(written, str):
                problems.append(Problem(resolved.where(i), written))
                resolved.failed.add(i)
                continue
            expr = written
            if origins[i] is None:
                origins[i] = text_of(spec_leaf)
            kind = getattr(spec_leaf, "memory_kind", None)
            if kind not in (None, "device"):  # a NamedSharding's memory is the leaf's
                held: list[str | None] = resolved.memory or [None] * len(leaves)
                held[i] = kind
                resolved.memory = held
        elif isinstance(spec_leaf, str):
            try:
                expr = parse(spec_leaf)
            except ExpressionError as error:
                problems.append(Problem.from_error(resolved.where(i), error, repr(spec_leaf)))
                resolved.failed.add(i)
                continue
        else:
            problems.append(Problem(resolved.where(i), not_a_spec_leaf(spec_leaf)))
            resolved.failed.add(i)
            continue
        if not expr.is_complete:
            done = _completed(resolved.fields[i], expr)
            if isinstance(done, Problem):
                problems.append(done)
                resolved.failed.add(i)
                continue
            expr = done
        resolved.exprs[i] = expr
    resolved.forget_values()
    return resolved, problems, list(resolution.warnings)
