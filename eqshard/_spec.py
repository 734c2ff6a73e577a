"""Spec trees: where each array leaf of a model gets its expression.

Every spec source ends in the same place: one expression (or `None`) per leaf of
the model, in the order of `jax.tree_util.tree_leaves(model)`. The sources:

- `eqshard.field(expr)` metadata on the model's own classes, with jaxtyping
  annotations giving short forms their left side (`spec(model)`);
- a spec tree, which may be a prefix of the model, as `in_shardings` is for
  `jax.jit`: a single expression or `None` stands for a whole subtree;
- a resolver, such as the `Rules` of a JSON spec file, with a `resolve(model)`
  method that returns a spec tree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, Union, runtime_checkable

import equinox as eqx
import jax
from jax.tree_util import GetAttrKey, keystr
from jaxtyping import PyTree

from ._annotation import Annotation, complete, contradiction, field_annotations
from ._errors import EqshardError, ExpressionError, Problem, SpecError
from ._expression import Expression, parse

__all__ = [
    "FROM_FIELDS",
    "LeafSpec",
    "Resolved",
    "Resolver",
    "SpecLeaf",
    "field",
    "is_array_like",
    "is_resolver",
    "is_spec_leaf",
    "leaf_specs",
    "spec",
    "walk_fields",
]

_METADATA_KEY = "eqshard"

SpecLeaf = Union[Expression, str, None]


@runtime_checkable
class Resolver(Protocol):
    """A spec source that resolves against a model, such as `eqshard.Rules`.

    `__eqshard_resolve__(model)` returns one spec leaf (an expression, its text, or
    `None`) for each leaf of `jax.tree_util.tree_leaves(model)`, in that order. The
    dunder name keeps a model or spec tree that happens to have a `resolve` method
    from being taken for a resolver.
    """

    def __eqshard_resolve__(self, model: Any) -> Sequence[SpecLeaf]: ...


def is_resolver(spec: object) -> bool:
    """Whether `spec` is a resolver (judged by its type, as dunder methods are)."""
    return hasattr(type(spec), "__eqshard_resolve__")


class _FromFields:
    def __repr__(self) -> str:
        return "eqshard.FROM_FIELDS"


FROM_FIELDS: Any = _FromFields()
"""The default spec of `apply` and `plan`: the expressions of `eqshard.field`s."""


def is_spec_leaf(x: object) -> bool:
    """Whether `x` is a leaf of a spec tree: an expression, its text, or `None`."""
    return x is None or isinstance(x, (Expression, str))


def is_array_like(x: object) -> bool:
    """An array leaf: a JAX or NumPy array, or an abstract `jax.ShapeDtypeStruct`."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def field(expr: str | Expression, **field_kwargs: Any) -> Any:
    """A field of an `eqx.Module` that carries an einshard expression.

    **Example:**

    ```python
    class MLP(eqx.Module):
        w1: Float[Array, "x y"] = eqshard.field("x y -> x y*")
        w2: Float[Array, "y z"] = eqshard.field("y* z")   # the short form
    ```

    The short form takes its left side from the field's jaxtyping annotation:
    `"y* z"` on `Float[Array, "y z"]` is `"y z -> y* z"`. Annotated dims that the
    short form does not name, and dims with no name (`3`, `_`, `...`, `*batch`), are
    never split. On a field that holds a list, tuple, dict or module, the expression
    applies to every array under it that has no expression of its own.

    **Arguments:**

    - `expr`: an einshard expression, full or short form.
    - `**field_kwargs`: anything `eqx.field` takes: `converter`, `default`,
        `metadata`, ... (`static=True` is refused: a static field holds no arrays).

    **Returns:**

    A dataclass field, as `eqx.field` returns.

    **Raises:**

    `eqshard.ExpressionError` when `expr` is not a valid expression, and
    `eqshard.EqshardError` for `static=True`.
    """
    expression = parse(expr)
    if field_kwargs.get("static"):
        raise EqshardError(
            f"`eqshard.field({str(expression)!r}, static=True)`: a static field holds "
            "no arrays to shard; drop `static=True`, or use `eqx.field`"
        )
    metadata = dict(field_kwargs.pop("metadata", None) or {})
    metadata[_METADATA_KEY] = expression
    return eqx.field(metadata=metadata, **field_kwargs)


# --------------------------------------------------------------------------- #
# One walk over the model: each leaf's path, field expression and annotation.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class LeafSpec:
    """What is known of one leaf of a model."""

    path: tuple[Any, ...]
    leaf: Any
    expr: Expression | None = None
    owner: str | None = None  # "Class.field" of the innermost field holding the leaf
    annotation: Annotation | None = None  # that field's jaxtyping annotation

    @property
    def where(self) -> str:
        return keystr(self.path) or "the model itself"

    @property
    def label(self) -> str:
        """`.blocks[0].w (Block.w)`: the key path, and the field that holds the leaf."""
        return f"{self.where} ({self.owner})" if self.owner else self.where


_flatten_one = jax.tree_util.default_registry.flatten_one_level_with_keys


def _walk_fields(
    node: Any,
    path: tuple[Any, ...],
    expr: Expression | None,
    owner: str | None,
    annotation: Annotation | None,
    out: list[LeafSpec],
) -> None:
    flat = _flatten_one(node)
    if flat is None:
        out.append(LeafSpec(path, node, expr, owner, annotation))
        return
    children, _ = flat
    if isinstance(node, eqx.Module):
        cls = type(node)
        fields = cls.__dataclass_fields__
        annotations = field_annotations(cls)
        for key, child in children:
            name = key.name if isinstance(key, GetAttrKey) else ""
            f = fields.get(name)
            if f is None:
                _walk_fields(child, (*path, key), expr, owner, annotation, out)
                continue
            own = f.metadata.get(_METADATA_KEY)
            _walk_fields(
                child,
                (*path, key),
                own if own is not None else expr,
                f"{cls.__name__}.{name}",
                annotations.get(name),
                out,
            )
    else:
        for key, child in children:
            _walk_fields(child, (*path, key), expr, owner, annotation, out)


def _complete(item: LeafSpec, problems: list[Problem]) -> Expression | None:
    """The leaf's expression, completed from and checked against its annotation."""
    expr = item.expr
    if expr is None:
        return None
    where = item.label
    annotation = item.annotation
    if not expr.is_complete:
        if annotation is None:
            problems.append(
                Problem(
                    where,
                    f"the short form {str(expr)!r} needs a left side, and the field has "
                    "no jaxtyping annotation such as Float[Array, 'x y'] to take it from; "
                    "write the full form 'x y -> ...'",
                )
            )
            return None
        try:
            return complete(expr, annotation)
        except ExpressionError as error:
            problems.append(Problem(where, _one_line(error), error.picture))
            return None
    if annotation is not None:
        why = contradiction(expr, annotation)
        if why is not None:
            problems.append(Problem(where, f"{str(expr)!r}: {why}"))
            return None
    return expr


def _one_line(error: ExpressionError) -> str:
    return f"{error.expression!r}: {error.rule}"


# --------------------------------------------------------------------------- #
# Spec trees against the model's structure.
# --------------------------------------------------------------------------- #


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    flat = _flatten_one(node)
    return None if flat is None else list(flat[0])


def _mismatch(spec: Any, model: Any, path: tuple[Any, ...] = ()) -> Problem | None:
    """The first place where `spec` is not a prefix of `model`'s structure."""
    if is_spec_leaf(spec):
        return None
    spec_children, model_children = _children(spec), _children(model)
    where = keystr(path) or "the root"
    if spec_children is None:
        return Problem(
            where,
            _not_a_spec_leaf(spec),
        )
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
            "`eqshard.spec(model)` and `eqx.tree_at`",
        )
    spec_keys = [keystr((k,)) for k, _ in spec_children]
    model_keys = [keystr((k,)) for k, _ in model_children]
    if spec_keys != model_keys:
        missing = [k for k in model_keys if k not in spec_keys]
        extra = [k for k in spec_keys if k not in model_keys]
        detail = (
            "; ".join(
                part
                for part in [
                    f"the model has {', '.join(missing)} that the spec lacks" if missing else "",
                    f"the spec has {', '.join(extra)} that the model lacks" if extra else "",
                ]
                if part
            )
            or f"the children differ: spec {spec_keys}, model {model_keys}"
        )
        return Problem(where, detail)
    for (key, spec_child), (_, model_child) in zip(spec_children, model_children):
        found = _mismatch(spec_child, model_child, (*path, key))
        if found is not None:
            return found
    return Problem(where, "the spec's structure differs from the model's here")


def _not_a_spec_leaf(x: Any) -> str:
    return (
        f"the spec holds {type(x).__name__} {x!r}; a spec leaf is an expression, its text, or None"
    )


def _describe(x: Any) -> str:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{dtype}{list(shape)}"
    return type(x).__name__


def _broadcast(spec: Any, model: Any, model_treedef: Any) -> list[SpecLeaf]:
    """One spec leaf per model leaf, from a spec tree that is a prefix of the model."""
    if is_spec_leaf(spec):
        return [spec] * model_treedef.num_leaves
    spec_leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_spec_leaf)
    if treedef == model_treedef:  # a full spec tree: one spec leaf per model leaf
        return spec_leaves
    try:
        subtrees = treedef.flatten_up_to(model)
    except (ValueError, TypeError):
        problem = _mismatch(spec, model) or Problem("the root", "the structures differ")
        raise SpecError([problem], "the spec does not match the model's structure") from None
    result: list[SpecLeaf] = []
    for spec_leaf, subtree in zip(spec_leaves, subtrees):
        result.extend([spec_leaf] * jax.tree_util.tree_structure(subtree).num_leaves)
    return result


@dataclasses.dataclass
class Resolved:
    """A model's leaves, flattened, each with its complete expression (or `None`).

    Key paths, owners and annotations come from a walk over the model's fields,
    which is made only when something needs them: the `eqshard.field` source, a
    short form, or an error message.
    """

    model: Any
    leaves: list[Any]
    treedef: Any
    exprs: list[Expression | None]
    _fields: list[LeafSpec] | None = None

    @property
    def fields(self) -> list[LeafSpec]:
        if self._fields is None:
            self._fields = walk_fields(self.model)
        return self._fields

    def where(self, index: int) -> str:
        """`.path (Class.field)` of leaf `index`, for messages."""
        return self.fields[index].label


def walk_fields(model: Any) -> list[LeafSpec]:
    """Each leaf of `model` with its path, field expression, owner and annotation."""
    items: list[LeafSpec] = []
    _walk_fields(model, (), None, None, None, items)
    return items


def leaf_specs(model: Any, spec: Any = FROM_FIELDS) -> Resolved:
    """Every leaf of `model` with its complete, checked expression.

    **Raises:** `SpecError` listing every leaf whose expression is malformed or
    contradicts its annotation, or naming the first path where `spec` does not
    match the model's structure.
    """
    leaves, treedef = jax.tree_util.tree_flatten(model)
    resolved = Resolved(model, leaves, treedef, [None] * len(leaves))
    problems: list[Problem] = []
    if spec is FROM_FIELDS:
        for i, item in enumerate(resolved.fields):
            if item.expr is not None and is_array_like(item.leaf):
                resolved.exprs[i] = _complete(item, problems)
    else:
        if is_resolver(spec):
            spec_leaves = list(spec.__eqshard_resolve__(model))
            if len(spec_leaves) != len(leaves):
                raise EqshardError(
                    f"{type(spec).__name__} resolved {len(spec_leaves)} spec leaves for a "
                    f"model of {len(leaves)} leaves; a resolver gives one per leaf"
                )
        else:
            spec_leaves = _broadcast(spec, model, treedef)
        short = False
        for i, leaf_spec in enumerate(spec_leaves):
            if leaf_spec is None or not is_array_like(leaves[i]):
                continue
            if not isinstance(leaf_spec, (str, Expression)):
                problems.append(
                    Problem(
                        resolved.where(i),
                        _not_a_spec_leaf(leaf_spec),
                    )
                )
                continue
            try:
                expr = parse(leaf_spec)
            except ExpressionError as error:
                problems.append(Problem(resolved.where(i), _one_line(error), error.picture))
                continue
            short = short or not expr.is_complete
            resolved.exprs[i] = expr
        if short:  # short forms take their left side from the fields' annotations
            for i, item in enumerate(resolved.fields):
                expr = resolved.exprs[i]
                if expr is not None and not expr.is_complete:
                    resolved.exprs[i] = _complete(dataclasses.replace(item, expr=expr), problems)
    if problems:
        raise SpecError(problems)
    return resolved


def spec(
    model: PyTree[Any],
    rules: Resolver | None = None,
) -> PyTree[Expression | None]:
    """The spec tree of a model: its structure, with an expression per array leaf.

    **Example:**

    ```python
    spec = eqshard.spec(model)   # from the eqshard.field annotations
    spec = eqx.tree_at(lambda s: s.head.weight, spec, "v d -> v* d",
                       is_leaf=lambda x: x is None)
    model = eqshard.apply(model, spec)
    ```

    **Arguments:**

    - `model`: an Equinox model or any pytree, concrete or abstract (from
        `eqx.filter_eval_shape`, with `jax.ShapeDtypeStruct` leaves).
    - `rules`: optionally, a resolver such as the `Rules` of a JSON spec file.

    **Returns:**

    A pytree with the model's structure. Each array leaf's place holds its complete
    `Expression` (short forms get their left side from the annotation), or `None`
    where no field gives one; every other leaf's place holds `None`. Since `None` is
    an empty subtree to JAX, pass `is_leaf=lambda x: x is None` to `eqx.tree_at`
    when replacing one.

    **Raises:**

    `eqshard.SpecError` listing each faulty field by key path and `Class.field`.
    """
    resolved = leaf_specs(model, FROM_FIELDS if rules is None else rules)
    return jax.tree_util.tree_unflatten(resolved.treedef, resolved.exprs)
