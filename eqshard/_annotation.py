"""jaxtyping annotations: the left side of short-form expressions.

A field annotated `Float[Array, "out in"]` names its axes `out` and `in`. The
short form `"out* in"` takes its left side from there. The rules:

- a named dim (`x`, `#x`) is the axis `x`;
- a fixed, symbolic or anonymous dim (`3`, `x+1`, `_`) has no name the right side
  could use, so it is never split;
- a variadic dim (`...`, `*batch`, `#*batch`) is `...`: never split;
- a named dim the short form leaves out is never split either, so
  `Float[Array, "batch seq d"]` with `"d*"` splits `d` alone;
- a name on the right that the annotation lacks is an error.

A full-form expression on an annotated field must agree with the annotation:
the same names in the same places.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import typing
from collections.abc import Sequence
from types import EllipsisType

from jaxtyping import AbstractArray

from ._expression import Element, Expression, LeftItem, is_logical_name, item_text

__all__ = [
    "Annotation",
    "StateValue",
    "annotation_of",
    "complete",
    "field_annotations",
    "for_rank",
    "state_value",
]

# One item per annotated dimension: a name, None (no usable name) or ... (variadic).
DimItem = typing.Union[str, None, EllipsisType]


@dataclasses.dataclass(frozen=True)
class Annotation:
    """The dims of a jaxtyping array annotation, as the left side of an expression.

    - `text`: the annotation as written, e.g. `Float[Array, 'out in']`.
    - `dim_str`: its dimension string, e.g. `'out in'`.
    - `items`: one per dim: its name, `None` when it has no usable name, or `...`.
        A name used twice, as in the square `"n n"`, cannot say which dim is meant,
        so both dims count as unnamed.
    - `repeated`: those names.
    """

    text: str
    dim_str: str
    items: tuple[DimItem, ...]
    repeated: frozenset[str] = frozenset()


def _dim_item(index: int, dim: object, variadic: int | None) -> DimItem:
    if index == variadic:
        return ...
    name = getattr(dim, "name", None)  # named dims have one; fixed, symbolic and `_` don't
    if isinstance(name, str) and is_logical_name(name):
        return name
    return None


def annotation_of(hint: object) -> Annotation | None:
    """The jaxtyping array annotation in `hint`, looking inside `list[...]`,
    `tuple[...]`, `dict[..., ...]` and `Optional[...]`; `None` if there is none or
    more than one kind."""
    if isinstance(hint, type) and issubclass(hint, AbstractArray):
        dtype = hint.dtype.__name__
        array = getattr(hint.array_type, "__name__", "Array").rsplit(".")[-1]
        name = f"{dtype}[{array}, {hint.dim_str!r}]"
        items = [_dim_item(i, dim, hint.index_variadic) for i, dim in enumerate(hint.dims)]
        named = [item for item in items if isinstance(item, str)]
        repeated = frozenset(n for n in named if named.count(n) > 1)
        items = tuple(None if item in repeated else item for item in items)
        return Annotation(name, hint.dim_str, items, repeated)
    found = {annotation_of(arg) for arg in typing.get_args(hint)} - {None}
    if len(found) == 1:
        return found.pop()
    return None


@functools.cache
def _hints(cls: type) -> dict[str, object]:
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception:  # one unresolvable annotation: resolve the others one by one
        return {f.name: _resolve_one(cls, f.type) for f in dataclasses.fields(cls)}


@functools.cache
def field_annotations(cls: type) -> dict[str, Annotation]:
    """The jaxtyping annotation of each field of a dataclass that has one. Cached."""
    result = {}
    for name, hint in _hints(cls).items():
        annotation = annotation_of(hint)
        if annotation is not None:
            result[name] = annotation
    return result


@dataclasses.dataclass(frozen=True)
class StateValue:
    """What an `eqx.nn.StateIndex` field says of the value it holds: `one` array
    (`StateIndex[Float[Array, "c"]]`), a `tuple` of items, one annotation each
    (`StateIndex[tuple[Float[Array, "u"], Float[Array, "v"]]]`), or a tuple of
    `each` the same (`StateIndex[tuple[Float[Array, "c"], ...]]`)."""

    kind: typing.Literal["one", "tuple", "each"]
    items: tuple[Annotation | None, ...]

    def annotation(self, rest: Sequence[object]) -> Annotation | None:
        """The annotation of the leaf at `rest` (its keys below the index) in the
        value; `None` where the field says nothing of it."""
        if self.kind == "one":
            return self.items[0] if not rest else None
        if len(rest) != 1 or not isinstance(position := getattr(rest[0], "idx", None), int):
            return None
        if self.kind == "each":
            return self.items[0]
        return self.items[position] if position < len(self.items) else None

    def leaves(self) -> tuple[tuple[str, ...], ...] | None:
        """The segments below the index of each leaf the value holds, where the
        field says how many (`()` for one array, `("0",), ("1",)` for a pair);
        `None` for a tuple of any length."""
        if self.kind == "one":
            return ((),)
        if self.kind == "tuple":
            return tuple((str(k),) for k in range(len(self.items)))
        return None


@functools.cache
def state_value(cls: type, name: str) -> StateValue | None:
    """What the `eqx.nn.StateIndex` field `name` of `cls` says of its value (see
    `StateValue`); `None` when its annotation says nothing. Cached."""
    from equinox.nn import StateIndex

    def inside(hint: object) -> object | None:
        if typing.get_origin(hint) is StateIndex:
            args = typing.get_args(hint)
            return args[0] if args else None
        for arg in typing.get_args(hint):  # Optional[StateIndex[...]]
            found = inside(arg)
            if found is not None:
                return found
        return None

    value = inside(_hints(cls).get(name))
    if value is None:
        return None
    if typing.get_origin(value) is not tuple:
        return StateValue("one", (annotation_of(value),))
    args = typing.get_args(value)
    if len(args) == 2 and args[1] is Ellipsis:
        return StateValue("each", (annotation_of(args[0]),))
    return StateValue("tuple", tuple(annotation_of(item) for item in args))


def _resolve_one(cls: type, hint: object) -> object:
    """One annotation, evaluated in its class's module if it is a string; else `None`.

    These are the user's own annotations, from their source, as
    `typing.get_type_hints` would evaluate them.
    """
    if not isinstance(hint, str):
        return hint
    module = sys.modules.get(cls.__module__)
    try:
        return eval(hint, dict(vars(module)) if module else {}, dict(vars(cls)))
    except Exception:
        return None


def for_rank(annotation: Annotation, ndim: int) -> Annotation:
    """`annotation` for a leaf of `ndim` dims: a stack of layers (`eqx.filter_vmap`)
    puts axes in front that the annotation does not name; they are never split."""
    extra = ndim - len(annotation.items)
    if extra <= 0 or ... in annotation.items:
        return annotation
    return dataclasses.replace(annotation, items=(None,) * extra + annotation.items)


def _fresh_names(taken: set[str], count: int) -> list[str]:
    """Names for dims that have none: `_`, `__`, ... that are not taken."""
    names = []
    candidate = "_"
    while len(names) < count:
        if candidate not in taken:
            names.append(candidate)
        candidate += "_"
    return names


@functools.lru_cache(maxsize=4096)
def complete(expr: Expression, annotation: Annotation) -> Expression:
    """Gives a short-form expression its left side from `annotation`.

    **Returns:** a complete expression with the same layout as the short form,
    whose dims without a usable name are named `_`, `__`, ... and left whole.

    **Raises:** `ExpressionError` when a name on the right is not in the annotation,
    or `...` is on the right but the annotation has no variadic dim. Cached.
    """
    items = annotation.items
    names = {item for item in items if isinstance(item, str)}
    for index, item in enumerate(expr.rhs):
        if isinstance(item, Element) and item.name in annotation.repeated:
            raise expr.error(
                f"the annotation {annotation.text} names {item.name!r} twice, so the "
                "short form cannot say which to split; write the full form",
                expr.span_of_rhs(index),
            )
        if isinstance(item, Element) and item.name is not None and item.name not in names:
            raise expr.error(
                f"axis {item.name!r} is on the right but not in the annotation "
                f"{annotation.text}; name the annotation's dims ({annotation.dim_str!r})",
                expr.span_of_rhs(index),
            )
        if item is ... and ... not in items:
            raise expr.error(
                f"'...' is on the right, but the annotation {annotation.text} has no "
                "'...' or '*name' dims for it to stand for",
                expr.span_of_rhs(index),
            )
    unnamed = sum(1 for item in items if item is None)
    fresh = iter(_fresh_names(names | annotation.repeated, unnamed))
    lhs: list[LeftItem] = [next(fresh) if item is None else item for item in items]
    written = {item.name for item in expr.rhs if isinstance(item, Element)}
    rhs = list(expr.rhs)
    rhs += [Element(name) for name in lhs if isinstance(name, str) and name not in written]
    if ... in lhs and ... not in rhs:
        rhs.append(...)
    # Built from the canonical text, so that later errors put their caret in the right place.
    return Expression(tuple(lhs), tuple(rhs))


def contradiction(expr: Expression, annotation: Annotation) -> str | None:
    """Why a full-form expression disagrees with the annotation, or `None`."""
    lhs = expr.lhs
    if lhs is None:
        return None

    def spelled(items: Sequence[LeftItem | None]) -> str:
        return " ".join("_" if i is None else item_text(i) for i in items)

    if ... in lhs or ... in annotation.items:
        return None
    agree = len(lhs) == len(annotation.items) and all(  # a group's names are the mesh's
        want is None or want == got or isinstance(got, tuple)
        for want, got in zip(annotation.items, lhs)
    )
    if agree:
        return None
    return (
        f"its left side '{spelled(lhs)}' contradicts the annotation {annotation.text}; "
        f"name the axes as the annotation does ('{spelled(annotation.items)}'), or "
        "write the short form (the right side alone)"
    )
