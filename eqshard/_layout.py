"""Layout: from an expression, a shape and a device count to a mesh and a spec.

This module is pure: it knows nothing of JAX devices or of models, so it is the
single place where einshard's semantics live, and it is cheap to test.

einshard's rules, which `layout` follows to the device:

1. Each element of the right side, in order, is one mesh axis (`...` adds none).
2. An element's size is its count, times a common ratio `r` if it has a star.
3. The fixed counts are taken first; the starred elements share what is left, so
   `r ** (number of stars) == devices / prod(fixed) / prod(starred counts)`.
4. Devices fill the mesh in row-major order, and each array axis is split over the
   mesh axis of the same name. Unnamed elements replicate.

And eqshard's one extension: an array axis written as a group on the left, `(a b)`, is
split over the mesh axes of each of its names, the first the major one, as a
`PartitionSpec` entry `("a", "b")` splits it.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

from ._errors import EqshardError, whole_number
from ._expression import Element, Expression, item_text, parse

__all__ = [
    "MAX_DEVICES",
    "MAX_ELEMENTS",
    "Layout",
    "axes_of",
    "device_count_of",
    "integer_root",
    "layout",
    "shape_of",
]

MAX_DEVICES = 2**31 - 1
"""The most devices a plan is made for without devices (`devices=` a count): XLA's
shardings count devices in 32 bits."""


def device_count_of(value: object, what: str) -> int:
    """`value` if it is a whole number of devices, from 1 to `MAX_DEVICES`.

    **Raises:** `EqshardError` naming `what`: what `whole_number` says, or that JAX's
    shardings count no more devices.
    """
    count = whole_number(value, what)
    if count > MAX_DEVICES:
        raise EqshardError(
            f"{what} is {count}, more than {MAX_DEVICES}, the most devices a JAX sharding "
            "can describe (it counts them in 32 bits)"
        )
    return count


MAX_ELEMENTS = 32
"""The most elements a right side may have: one mesh axis each, and JAX allows 32."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the shards of one array go: a mesh, and how each array axis uses it.

    **Attributes:**

    - `mesh_shape`: the size of each mesh axis, in the order of the right side.
    - `mesh_axes`: the name of each mesh axis: the element's own name, or `_<i>` for the
        i-th element of the right side when it is a standalone replication element. `_0`
        can never clash with an axis name, which has no digits.
    - `spec`: for each array dimension, the mesh axis it is split over, the mesh axes
        of a group (a tuple, the major first), or `None` for the dimensions that `...`
        stands for: a `PartitionSpec`'s entries on the layout's own mesh.
    """

    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    spec: tuple[str | tuple[str, ...] | None, ...]

    @property
    def shards(self) -> tuple[int, ...]:
        """How many pieces each array dimension is cut into."""
        sizes = dict(zip(self.mesh_axes, self.mesh_shape))
        return tuple(math.prod(sizes[axis] for axis in axes_of(entry)) for entry in self.spec)


def axes_of(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes of one entry of a spec, the major first: none for `None`."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else entry


def integer_root(value: int, degree: int) -> int | None:
    """The integer `r` with `r ** degree == value`, or `None` if there is none.

    Exact, unlike `value ** (1 / degree)`: `integer_root(64, 3) == 4`.
    """
    lo, hi = 1, max(1, value)
    while lo <= hi:
        mid = (lo + hi) // 2
        power = mid**degree
        if power == value:
            return mid
        if power < value:
            lo = mid + 1
        else:
            hi = mid - 1
    return None


def _product_text(elements: Sequence[Element]) -> str:
    """`"a2 x b4 = 8"`: the elements with a count, and the product of their counts."""
    counted = [element for element in elements if element.count > 1] or list(elements)
    total = math.prod(element.count for element in counted)
    if len(counted) == 1:
        return str(counted[0])
    return f"{' x '.join(str(element) for element in counted)} = {total}"


def _rhs_span(expr: Expression) -> tuple[int, int]:
    first = expr.span_of_rhs(0)
    last = expr.span_of_rhs(len(expr.rhs) - 1)
    return (first[0], last[1])


def _lhs_span(expr: Expression) -> tuple[int, int] | None:
    if not expr.lhs_spans:
        return None
    return (expr.lhs_spans[0][0], expr.lhs_spans[-1][1])


def _ratio(expr: Expression, n_devices: int) -> int:
    """The common factor of the starred elements (1 where there are none)."""
    elements = [item for item in expr.rhs if isinstance(item, Element)]
    fixed = [element for element in elements if not element.star]
    starred = [element for element in elements if element.star]
    n_fixed = math.prod(element.count for element in fixed)
    span = _rhs_span(expr)
    devices = f"{n_devices} {'is' if n_devices == 1 else 'are'} given"

    if not starred:
        if n_fixed == n_devices:
            return 1
        if n_fixed == 1:
            need = f"no element has a count or a star, so 1 device is used, and {devices}"
        else:
            need = f"{_product_text(fixed)} shards need {n_fixed} devices, {devices}"
        if n_fixed < n_devices and n_devices % n_fixed == 0:
            hint = "add '*' to an element to take the rest, or a standalone '*' to replicate"
        else:
            hint = f"choose counts whose product is {n_devices}, or use '*' to take a share"
        raise expr.error(f"{need}; {hint}", span)

    if n_devices % n_fixed:
        raise expr.error(
            f"the fixed counts {_product_text(fixed)} need a multiple of {n_fixed} "
            f"devices, {devices}; change the fixed counts, or make them starred",
            span,
        )
    left = n_devices // n_fixed
    n_starred = math.prod(element.count for element in starred)
    if left % n_starred:
        raise expr.error(
            f"the starred counts {_product_text(starred)} need a multiple of "
            f"{n_starred} devices, and {left} are left for them ({devices}); "
            "change the starred counts",
            span,
        )
    quotient = left // n_starred
    ratio = integer_root(quotient, len(starred))
    if ratio is None:
        power = {2: "square", 3: "cube"}.get(len(starred), f"{len(starred)}th power")
        raise expr.error(
            f"the {len(starred)} starred elements grow by one common factor, so the "
            f"{left} devices left for them must be {n_starred} x a {power}; "
            f"{quotient} is not a {power}. Use fewer '*', or fixed counts",
            span,
        )
    return ratio


def shape_of(shape: object) -> tuple[int, ...]:
    """`shape` as a tuple of sizes, or an `EqshardError` that says what it is instead."""
    try:
        sizes = tuple(shape)  # type: ignore[arg-type]
        if all(operator.index(size) >= 0 for size in sizes):
            return tuple(operator.index(size) for size in sizes)
    except TypeError:
        pass
    raise EqshardError(f"a shape is a sequence of sizes such as (4, 8), not {shape!r}")


def _check_rank(expr: Expression, lhs: tuple, shape: tuple[int, ...]) -> None:
    named = len(lhs) - (1 if ... in lhs else 0)
    if ... in lhs:
        if len(shape) >= named:
            return
        rule = (
            f"the left side names {named} axes besides '...', but the array has "
            f"{len(shape)} (shape {shape}); name at most {len(shape)}"
        )
    else:
        if len(shape) == named:
            return
        rule = (
            f"the left side names {named} {'axis' if named == 1 else 'axes'}, but the "
            f"array has {len(shape)} (shape {shape}); name one axis per dimension, or "
            "use '...' for the rest"
        )
        if named < len(shape):  # as in a stack of layers, whose axis comes first
            rhs = " ".join(item_text(item) for item in expr.rhs)
            lhs_text = " ".join(item_text(item) for item in lhs)
            rule += f" (for a stack of layers: '... {lhs_text} -> ... {rhs}')"
    raise expr.error(rule, _lhs_span(expr))


def layout(expr: str | Expression, shape: Sequence[int], n_devices: int) -> Layout:
    """The layout of an array of `shape` under `expr` on `n_devices` devices.

    **Example:**

    ```python
    layout(parse("a b -> 2 a2* b*"), (4, 8), 16)
    # Layout(mesh_shape=(2, 4, 2), mesh_axes=('_0', 'a', 'b'), spec=('a', 'b'))
    ```

    **Arguments:**

    - `expr`: a complete expression (not the short form), as text or parsed.
    - `shape`: the array's shape.
    - `n_devices`: how many devices the expression must use, all of them.

    **Returns:**

    A `Layout`.

    **Raises:**

    - `ExpressionError`: the expression is in short form, its rank does not match
        `shape`, the device count does not work out, or a dimension does not divide by
        its number of shards. A caret marks the fault.
    """
    expr = parse(expr)
    shape = shape_of(shape)
    if expr.lhs is None:
        raise expr.error(
            "this is the short form, with no left side; give the axis names as "
            f"'<names> -> {expr}', or take them from a jaxtyping annotation"
        )
    _check_rank(expr, expr.lhs, shape)
    whole_number(n_devices, "the device count")
    elements = sum(1 for item in expr.rhs if item is not ...)
    if elements > MAX_ELEMENTS:
        raise expr.error(
            f"the right side has {elements} elements, and a JAX mesh has at most "
            f"{MAX_ELEMENTS} axes; merge counts (write '8' for '2 2 2')",
            _rhs_span(expr),
        )
    ratio = _ratio(expr, n_devices)

    mesh_shape: list[int] = []
    mesh_axes: list[str] = []
    axis_of: dict[str, tuple[int, int]] = {}
    for index, item in enumerate(expr.rhs):
        if item is ...:
            continue
        size = item.count * (ratio if item.star else 1)
        axis = item.name if item.name is not None else f"_{index}"
        if item.name is not None:
            axis_of[item.name] = (index, size)
        mesh_shape.append(size)
        mesh_axes.append(axis)

    spec: list[str | tuple[str, ...] | None] = []
    items: list[str | tuple[str, ...] | None] = [None if i is ... else i for i in expr.lhs]
    spans: list[tuple[int, int] | None] = list(expr.lhs_spans) or [None] * len(expr.lhs)
    if ... in expr.lhs:
        at = expr.lhs.index(...)
        items[at : at + 1] = [None] * (len(shape) - len(expr.lhs) + 1)
        spans[at : at + 1] = [None] * (len(shape) - len(expr.lhs) + 1)
    for dim, (item, size, span) in enumerate(zip(items, shape, spans)):
        if item is None:
            spec.append(None)
            continue
        if isinstance(item, str):
            index, shards = axis_of[item]
            if size % shards:
                raise expr.error(
                    f"axis {item!r} (dimension {dim} of shape {shape}) has size {size}, "
                    f"which does not split into {shards} equal shards; choose a count "
                    f"that divides {size}",
                    expr.span_of_rhs(index),
                )
            spec.append(item)
            continue
        shards = math.prod(axis_of[name][1] for name in item)
        if size % shards:
            parts = " x ".join(f"{name}{axis_of[name][1]}" for name in item)
            raise expr.error(
                f"the group {item_text(item)} (dimension {dim} of shape {shape}) has size "
                f"{size}, which does not split into {parts} = {shards} equal shards; "
                f"choose counts whose product divides {size}",
                span,
            )
        spec.append(item)
    return Layout(tuple(mesh_shape), tuple(mesh_axes), tuple(spec))
