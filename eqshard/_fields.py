"""Fields: `eqshard.field`, the walk over a model's fields, and `FROM_FIELDS`.

`eqshard.field(expr)` stores an expression in a field's metadata. `walk_fields`
visits every leaf of a model once, with its key path, the expression of the
innermost field that gives one, that field's `Class.field` name and its jaxtyping
annotation. `FROM_FIELDS`, the default spec, is the resolver that reads them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import equinox as eqx
import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from ._annotation import Annotation, StateValue, contradiction, field_annotations, state_value
from ._errors import EqshardError, PathError
from ._expression import Expression, parse
from ._paths._grammar import quoted_key
from ._paths._names import name, segments
from ._problems import Problem
from ._protocol import Resolution, Target

__all__ = [
    "FROM_FIELDS",
    "FromFields",
    "LeafInfo",
    "StateIndexInfo",
    "field",
    "is_array_like",
    "is_stateful_pair",
    "key_paths",
    "marker_keys",
    "state_leaf_names",
    "state_markers",
    "walk_fields",
]

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

    **Arguments:**

    - `expr`: an einshard expression, full or short form (see "The short form").
    - `**field_kwargs`: anything `eqx.field` takes: `converter`, `default`, `metadata`,
        ... (`static=True` is refused: a static field holds no arrays).

    **Returns:**

    A dataclass field, as `eqx.field` returns.

    **Raises:**

    - `eqshard.ExpressionError`: `expr` is not a valid expression.
    - `eqshard.EqshardError`: `static=True`.

    !!! info "The short form"

        The short form takes its left side from the field's jaxtyping annotation:
        `"y* z"` on `Float[Array, "y z"]` is `"y z -> y* z"`. Annotated dims that the
        short form does not name are never split. Nor are dims with no name (`3`, `_`,
        `...`, `*batch`).

    !!! info "Containers"

        On a field that holds a list, tuple, dict or module, the expression applies to
        every array under it that has no expression of its own.
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


@dataclasses.dataclass(frozen=True)
class StateIndexInfo:
    """What a model says of one `eqx.nn.StateIndex`: its key path in the model, and
    what the field holding it says of the state's leaves (the expression of an
    `eqshard.field` above it, `Class.field`, and its `StateIndex[...]` annotation)."""

    path: tuple[Any, ...]
    expr: Expression | None
    owner: str
    value: StateValue | None


@dataclasses.dataclass
class _Walk:
    """What one walk collects besides the leaves: what the model says of each
    `eqx.nn.StateIndex` (by marker), and the leaves of each `eqx.nn.State`, which
    are named and annotated from that once the whole tree has been walked."""

    out: list[LeafInfo]
    indices: dict[Any, StateIndexInfo]
    pending: list[tuple[int, int, Any, tuple[Any, ...], int]]


def _walk(
    node: Any,
    path: tuple[Any, ...],
    expr: Expression | None,
    owner: str | None,
    annotation: Annotation | None,
    walk: _Walk,
) -> None:
    if isinstance(node, eqx.nn.State):
        _walk_state(node, path, walk)
        return
    flat = _flatten_one(node)
    if flat is None:
        walk.out.append(LeafInfo(path, node, expr, owner, annotation))
        return
    children, _ = flat
    names = getattr(node, "_fields", None) if isinstance(node, tuple) else None
    if names is not None:
        # A NamedTuple (an optax state): name each field by its own name. Some JAX
        # releases give every field the first one's key (jax-ml/jax#39297).
        children = [(GetAttrKey(name), child) for name, (_, child) in zip(names, children)]
    if not isinstance(node, eqx.Module):
        for key, child in children:
            _walk(child, (*path, key), expr, owner, annotation, walk)
        return
    cls = type(node)
    fields = cls.__dataclass_fields__
    annotations = field_annotations(cls)
    for key, child in children:
        name = key.name if isinstance(key, GetAttrKey) else ""
        f = fields.get(name)
        if f is None:
            _walk(child, (*path, key), expr, owner, annotation, walk)
            continue
        own = f.metadata.get(_METADATA_KEY)
        here = own if own is not None else expr
        label = f"{cls.__name__}.{name}"
        if isinstance(child, eqx.nn.StateIndex):  # what its state's leaves are
            info = StateIndexInfo((*path, key), here, label, state_value(cls, name))
            walk.indices[child.marker] = info
        _walk(child, (*path, key), here, label, annotations.get(name), walk)


def _walk_state(node: Any, path: tuple[Any, ...], walk: _Walk) -> None:
    """An `eqx.nn.State`: each stored value is walked under the path its marker
    says (`eqx.nn.make_with_state` writes the model's class and the index's path,
    `'Net.bn.ema_state_index'`), or its position; `_finish_states` renames it by its
    `StateIndex`'s path in the model, where the walk met the model."""
    children, markers = _flatten_one(node)  # pyright: ignore[reportGeneralTypeIssues]
    for (key, child), marker in zip(children, markers):
        keys = marker_keys(marker) or (key,)
        start = len(walk.out)
        _walk(child, (*path, *keys), None, None, None, walk)
        walk.pending.append((start, len(walk.out), marker, path, len(keys)))


def _finish_states(walk: _Walk) -> None:
    """Names each state leaf by its `StateIndex`'s path in the model, then its place
    in the stored value, and gives it what the index's field says (see
    `StateIndexInfo`)."""
    for start, end, marker, base, length in walk.pending:
        info = walk.indices.get(marker)
        if info is None:
            continue
        # The marker's path where it has one: the same name wherever the state is.
        keys = marker_keys(marker) or info.path
        for i in range(start, end):
            item = walk.out[i]
            rest = item.path[len(base) + length :]
            annotation = None if info.value is None else info.value.annotation(rest)
            walk.out[i] = LeafInfo(
                (*base, *keys, *rest), item.leaf, info.expr, info.owner, annotation
            )


_CLASS = re.compile(r"[^\W\d]\w*")
_ATTRIBUTE = re.compile(r"\.([^\W\d]\w*)")
_INDEX = re.compile(r"\[(\d+)\]")


def marker_keys(marker: object) -> tuple[Any, ...] | None:
    """The key path in a `StateIndex` marker: `'Net.blocks[0].bn.ema_state_index'`
    (the model's class, then `jax.tree_util.keystr` of the index's path, as
    `eqx.nn.make_with_state` writes it) -> `(GetAttrKey('blocks'), SequenceKey(0),
    ...)`; `None` for a marker that is not such a text."""
    if not isinstance(marker, str) or (head := _CLASS.match(marker)) is None:
        return None
    keys: list[Any] = []
    at = head.end()
    while at < len(marker):
        if (found := _ATTRIBUTE.match(marker, at)) is not None:
            keys.append(GetAttrKey(found[1]))
        elif (found := _INDEX.match(marker, at)) is not None:
            keys.append(SequenceKey(int(found[1])))
        else:
            try:
                key, end = quoted_key(marker, at)
            except PathError:
                return None
            keys.append(DictKey(key))
            at = end
            continue
        at = found.end()
    return tuple(keys) or None


def state_markers(tree: Any) -> set[Any]:
    """The markers of every `eqx.nn.StateIndex` in `tree`."""
    return {
        x.marker
        for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_index)
        if isinstance(x, eqx.nn.StateIndex)
    }


def _is_index(x: Any) -> bool:
    return isinstance(x, eqx.nn.StateIndex)


def is_stateful_pair(tree: Any) -> bool:
    """`(model, state)`, as `eqx.nn.make_with_state` returns them: a State whose
    every value has its `StateIndex` in the model."""
    if not (type(tree) in (tuple, list) and len(tree) == 2 and isinstance(tree[1], eqx.nn.State)):
        return False
    _, markers = _flatten_one(tree[1])  # pyright: ignore[reportGeneralTypeIssues]
    return set(markers) <= state_markers(tree[0])


def _walk_root(tree: Any, walk: _Walk) -> None:
    """`tree` from its root; a `(model, state)` pair as one model."""
    if is_stateful_pair(tree):
        _walk(tree[0], (), None, None, None, walk)
        _walk(tree[1], (), None, None, None, walk)
    else:
        _walk(tree, (), None, None, None, walk)


def walk_fields(model: Any, context: Any = None) -> list[LeafInfo]:
    """Every leaf of `model`, in `jax.tree_util.tree_leaves` order, with what its
    fields say of it.

    A leaf of an `eqx.nn.State` is named by the path of its `StateIndex` in the
    model, then its place in the stored value (`bn.ema_state_index.0`, BatchNorm's
    running mean), and takes what the model's field holding that index says (its
    annotation gives the dims). A `(model, state)` pair is named as one stateful
    model: the model's leaves by their paths in the model, the state's as above.
    `context`, the model a tree was built from, says this of a state given on its
    own; without the model, a state's leaves are named by their markers' paths
    (as `eqx.nn.make_with_state` writes them), else by position.
    """
    walk = _Walk([], {}, [])
    if context is not None and _has_state(model):
        _walk_root(context, _Walk([], walk.indices, []))
    _walk_root(model, walk)
    _finish_states(walk)
    return walk.out


def state_leaf_names(model: Any) -> list[tuple[str, ...]]:
    """The segments of the leaves `model`'s `eqx.nn.State` will hold, as far as the
    model's fields say: each `StateIndex`'s path, then each item its annotation
    names (`bn.ema_state_index.0`, `.1`), or up to 8 items where it says nothing.
    For a plan made from the model alone, which meets the state only later."""
    walk = _Walk([], {}, [])
    _walk_root(model, walk)
    names: list[tuple[str, ...]] = []
    for info in walk.indices.values():
        base = segments(info.path)
        below = None if info.value is None else info.value.leaves()
        if below is None:
            below = ((), *((str(k),) for k in range(8)))
        names += [(*base, *rest) for rest in below]
    return names


def _has_state(tree: Any) -> bool:
    return any(
        isinstance(x, eqx.nn.State)
        for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, eqx.nn.State))
    )


def key_paths(tree: Any, context: Any = None) -> list[tuple[Any, ...]]:
    """Each leaf's key path, as eqshard names it: JAX's, except where `walk_fields`
    names leaves otherwise (under an `eqx.nn.State`, whose children JAX keys by
    position, and in a `(model, state)` pair)."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    if is_stateful_pair(tree) or any(
        isinstance(key, FlattenedIndexKey) for path in paths for key in path
    ):
        return [item.path for item in walk_fields(tree, context)]
    return paths


class FromFields:
    """The resolver that reads `eqshard.field` expressions; use the `FROM_FIELDS` value.

    A full-form expression must agree with its field's jaxtyping annotation; short
    forms are completed from it, as for every spec source.
    """

    def __eqshard_resolve__(self, model: Any, target: Target) -> Resolution:
        fields = walk_fields(model, target.context)  # for any device count
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
        return "eqshard.resolvers.FROM_FIELDS"

    def __reduce__(self) -> str:
        return "FROM_FIELDS"  # pickles as a reference: one value in every process


FROM_FIELDS: Any = FromFields()
"""The default spec of `apply` and `plan`: the expressions of `eqshard.field`s."""
