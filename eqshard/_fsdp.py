"""FSDP: every leaf split along one dim over the data axis, with no rule per shape.

`"default": "fsdp"` and `"expr": "fsdp"` in spec files, and `eqshard.FSDP` in
Python, give each array leaf an ordinary complete expression, so the plan, the
report, `check`, the golden files and the cost all show the concrete one:

- the split count is the size of the mesh axis named `data` on the target's mesh
  (else its first axis), and the other axes replicate; without a mesh, it is every
  device (`d*`);
- the split dim is the largest whose size the count divides, the last of equals;
  where the leaf's field has a jaxtyping annotation that names fewer dims than the
  leaf has (layers stacked with `eqx.filter_vmap`), only the dims it names may
  split, so a stacked layer axis never does;
- a scalar, or a leaf with no such dim, is replicated, and its origin says why.

The choice depends on the shape, the annotation and the mesh only: the same model
on the same devices always gets the same expressions. This module imports no JAX
(the spec-file layer knows the word), except where `FSDP` walks a model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._expression import Expression, parse
from ._protocol import Resolution

if TYPE_CHECKING:
    from ._annotation import Annotation  # jaxtyping: not for the spec-file layer
    from ._protocol import Target

__all__ = ["FSDP", "FSDP_WORD", "Fsdp", "Over", "fsdp_leaf", "is_fsdp_replicated", "over"]

FSDP_WORD = "fsdp"
"""The word a spec file writes for FSDP, as a rule's `expr` or as `"default"`."""

_REPLICATE = parse("... -> * ...")
_REPLICATED = f"{FSDP_WORD}: replicated, "


@dataclasses.dataclass(frozen=True)
class Over:
    """What FSDP splits a leaf over.

    - `count`: how many pieces: the data axis's size, or every device.
    - `axis`: the data axis's name, or `None` without a mesh.
    - `before`, `after`: the sizes of the mesh axes before and after it (those of
        size 1 left out), each replicating.
    """

    count: int
    axis: str | None = None
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()


def over(target: Target) -> Over:
    """What FSDP splits over on `target`: its mesh's axis named `data`, else the
    mesh's first axis; without a mesh, every device."""
    mesh = target.mesh
    if mesh is None:
        return Over(target.devices)
    names = tuple(str(name) for name in mesh.axis_names)
    sizes = tuple(int(size) for size in mesh.axis_sizes)
    at = names.index("data") if "data" in names else 0
    return Over(
        sizes[at],
        names[at],
        tuple(s for s in sizes[:at] if s > 1),
        tuple(s for s in sizes[at + 1 :] if s > 1),
    )


def _first_candidate(annotation: Annotation | None, ndim: int) -> int:
    """The first dim FSDP may split: past the leading dims that an annotation naming
    fewer dims than the leaf has does not name (stacked layers)."""
    if annotation is None or ... in annotation.items:
        return 0
    return max(0, ndim - len(annotation.items))


def _text(rank: int, k: int, split: Over) -> str:
    """The expression that splits dim `k` of `rank` over `split`, the other dims
    whole: `... d -> ... d*`, `d ... -> d2 ... 4`, `... d _ -> ... d* _`."""
    if k == 0 and rank > 1:
        lhs = ["d", "..."]
    else:
        lhs = ["...", "d", *("_" * (j + 1) for j in range(rank - k - 1))]
    element = "d*" if split.axis is None else f"d{split.count}"
    rhs = [
        *map(str, split.before),
        *(element if item == "d" else item for item in lhs),
        *map(str, split.after),
    ]
    return f"{' '.join(lhs)} -> {' '.join(rhs)}"


@functools.lru_cache(maxsize=4096)
def _choose(shape: tuple[int, ...], first: int, split: Over) -> tuple[Expression, str]:
    if not shape:
        return _REPLICATE, f"{_REPLICATED}a scalar"
    fits = [k for k in range(first, len(shape)) if shape[k] % split.count == 0]
    if not fits:
        past = ""
        if first:
            axes = "axis" if first == 1 else f"{first} axes"
            past = f" past the stacked layer {axes}"
        size = "" if split.axis is None else f", the size of {split.axis!r}"
        why = f"no dim of {list(shape)}{past} is a multiple of {split.count}{size}"
        return _REPLICATE, _REPLICATED + why
    k = max(fits, key=lambda k: (shape[k], k))  # the largest; the last of equals
    return parse(_text(len(shape), k, split)), FSDP_WORD


def fsdp_leaf(
    shape: Sequence[int], annotation: Annotation | None, split: Over
) -> tuple[Expression, str]:
    """FSDP's complete expression for a leaf of `shape` (its field's annotation, if
    any), and how its origin says so: `"fsdp"`, or `"fsdp: replicated, <why>"`."""
    shape = tuple(int(size) for size in shape)
    return _choose(shape, _first_candidate(annotation, len(shape)), split)


def is_fsdp_replicated(origin: str | None) -> bool:
    """Whether a leaf's origin says that FSDP replicated it (no dim it could split)."""
    return origin is not None and _REPLICATED in origin


class Fsdp:
    """The resolver of FSDP in Python; use the `FSDP` value."""

    def __eqshard_resolve__(self, model: Any, target: Target) -> Resolution:
        from ._fields import is_array_like, walk_fields

        fields = walk_fields(model, target.context)
        split = over(target)
        exprs: list[Expression | None] = []
        origins: list[str | None] = []
        for item in fields:
            if not is_array_like(item.leaf):
                exprs.append(None)
                origins.append(None)
                continue
            expr, origin = fsdp_leaf(item.leaf.shape, item.annotation, split)
            exprs.append(expr)
            origins.append(origin)
        return Resolution(exprs, origins=origins, fields=fields)

    def __repr__(self) -> str:
        return "eqshard.FSDP"

    def __reduce__(self) -> str:
        return "FSDP"  # pickles as a reference: one value in every process


FSDP: Any = Fsdp()
"""FSDP (ZeRO-3) as a spec: every array leaf split along one dim over the data axis.

**Example:**

```python
plan = eqshard.plan(model, eqshard.FSDP)
model = eqshard.apply(model, eqshard.FSDP, mesh=jax.make_mesh((2, 4), ("data", "model")))
```

**Arguments:**

Pass it wherever eqshard takes a spec: `plan`, `apply`, `init`, `report`, `cost`,
`eqshard.testing`'s harness (it pickles as a reference). The spec file's
`"default": "fsdp"` (and a rule's `"expr": "fsdp"`) say the same.

**Returns:**

A resolver: for a model and a device count (and mesh), one complete expression per array
leaf (see "How each leaf is split").

**Raises:**

Nothing of its own: any layout it gives fits the target's mesh.

!!! info "How each leaf is split"

    Each leaf gets an ordinary complete expression, shown by `plan.expressions`,
    `eqshard.report` and `eqshard check`:

    - It is split over the mesh axis named `data`, else the mesh's first axis, and
        replicated over the other axes. Without a mesh, it is split over every device.
    - It is split along its largest dim whose size that count divides, the last of
        equals. Its field's jaxtyping annotation may name fewer dims than it has (layers
        stacked with `eqx.filter_vmap`). Then it is split along one the annotation
        names, so a stacked layer axis is never split. Without an annotation, every dim
        may be.
    - A scalar, or a leaf with no such dim, is replicated (`"... -> * ..."`). Its origin
        says why: `fsdp: replicated, no dim of [3, 5] is a multiple of 8`.

    The choice depends on each leaf's shape and annotation and on the mesh alone. So the
    same model on the same devices always gets the same expressions.
"""
