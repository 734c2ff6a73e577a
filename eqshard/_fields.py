"""Fields: `eqshard.field`, the walk over a model's fields, and `FROM_FIELDS`.

`eqshard.field(expr)` stores an expression in a field's metadata. `walk_fields`
visits every leaf of a model once, with its key path, the expression of the
innermost field that gives one, that field's `Class.field` name and its jaxtyping
annotation. `FROM_FIELDS`, the default spec, is the resolver that reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
from jax.tree_util import GetAttrKey

from ._annotation import Annotation, contradiction, field_annotations
from ._errors import EqshardError, Problem
from ._expression import Expression, parse
from ._paths import name, segments
from ._resolver import Resolution, Target

__all__ = ["FROM_FIELDS", "FromFields", "LeafInfo", "field", "is_array_like", "walk_fields"]

_METADATA_KEY = "eqshard"


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


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """What the model's classes say of one of its leaves.

    - `path`: the leaf's JAX key path.
    - `leaf`: the leaf itself.
    - `expr`: the expression of the innermost `eqshard.field` above it, if any.
    - `owner`: `"Class.field"` of the innermost dataclass field holding the leaf.
    - `annotation`: that field's jaxtyping annotation, if it has one.
    """

    path: tuple[Any, ...]
    leaf: Any
    expr: Expression | None = None
    owner: str | None = None
    annotation: Annotation | None = None

    @property
    def where(self) -> str:
        """The leaf's dotted path, as spec files write it: `layers.0.weight`."""
        return leaf_name(self.path)

    @property
    def label(self) -> str:
        """`layers.0.weight (Linear.weight)`: the dotted path, and the field holding it."""
        return f"{self.where} ({self.owner})" if self.owner else self.where


def leaf_name(path: tuple[Any, ...]) -> str:
    """The name of a leaf (or node) in every message, report and `check`: its key
    path as a spec file's rule path writes it, which matches exactly that leaf
    (`layers.0.weight`). A key a dotted path cannot show as it is (empty, or holding
    '.', '*', white space, a bracket, a quote or a character `str.isprintable`
    refuses) is quoted as `repr` writes it: `params['a.b'].w`. The root is "the
    root"."""
    return name(segments(path)) if path else "the root"


_flatten_one = jax.tree_util.default_registry.flatten_one_level_with_keys


def _walk(
    node: Any,
    path: tuple[Any, ...],
    expr: Expression | None,
    owner: str | None,
    annotation: Annotation | None,
    out: list[LeafInfo],
) -> None:
    flat = _flatten_one(node)
    if flat is None:
        out.append(LeafInfo(path, node, expr, owner, annotation))
        return
    children, _ = flat
    names = getattr(node, "_fields", None) if isinstance(node, tuple) else None
    if names is not None:
        # A NamedTuple (an optax state): name each field by its own name. Some JAX
        # releases give every field the first one's key (jax-ml/jax#39297).
        children = [(GetAttrKey(name), child) for name, (_, child) in zip(names, children)]
    if not isinstance(node, eqx.Module):
        for key, child in children:
            _walk(child, (*path, key), expr, owner, annotation, out)
        return
    cls = type(node)
    fields = cls.__dataclass_fields__
    annotations = field_annotations(cls)
    for key, child in children:
        name = key.name if isinstance(key, GetAttrKey) else ""
        f = fields.get(name)
        if f is None:
            _walk(child, (*path, key), expr, owner, annotation, out)
            continue
        own = f.metadata.get(_METADATA_KEY)
        _walk(
            child,
            (*path, key),
            own if own is not None else expr,
            f"{cls.__name__}.{name}",
            annotations.get(name),
            out,
        )


def walk_fields(model: Any) -> list[LeafInfo]:
    """Every leaf of `model`, in `jax.tree_util.tree_leaves` order, with what its
    fields say of it."""
    out: list[LeafInfo] = []
    _walk(model, (), None, None, None, out)
    return out


class FromFields:
    """The resolver that reads `eqshard.field` expressions; use the `FROM_FIELDS` value.

    A full-form expression must agree with its field's jaxtyping annotation; short
    forms are completed from it, as for every spec source.
    """

    def __eqshard_resolve__(self, model: Any, target: Target) -> Resolution:
        del target  # field expressions hold for any device count
        fields = walk_fields(model)
        exprs: list[Expression | None] = []
        problems: list[Problem] = []
        failed: set[int] = set()
        for i, item in enumerate(fields):
            expr = item.expr if is_array_like(item.leaf) else None
            why = None
            if expr is not None and item.annotation is not None:
                why = contradiction(expr, item.annotation)
            if why is not None:
                problems.append(Problem(item.label, f"{str(expr)!r}: {why}"))
                failed.add(i)
                expr = None
            exprs.append(expr)
        return Resolution(
            exprs,
            problems,
            failed=frozenset(failed),
            origins=[item.owner if item.expr is not None else None for item in fields],
            fields=fields,
        )

    def __repr__(self) -> str:
        return "eqshard.FROM_FIELDS"

    def __reduce__(self) -> str:
        return "FROM_FIELDS"  # pickles as a reference: one value in every process


FROM_FIELDS: Any = FromFields()
"""The default spec of `apply` and `plan`: the expressions of `eqshard.field`s."""
