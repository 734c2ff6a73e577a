"""Per-leaf tables: where each leaf of a model goes, and what it costs per device."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.tree_util import keystr
from rich.table import Table

from ._plan import Plan

__all__ = [
    "LeafRow",
    "human_bytes",
    "leaf_rows",
    "leaf_table",
    "spec_text",
    "total_bytes_per_device",
]


@dataclasses.dataclass(frozen=True)
class LeafRow:
    """One array leaf, as a row of a report.

    `partition_spec` is `None` for a leaf kept where it is; `matched` says which
    rule of a spec file gave the expression (`None` outside `check`);
    `bytes_per_device` is `None` where the leaf could not be laid out.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    expression: str | None
    partition_spec: str | None = None
    bytes_per_device: int | None = None
    total_bytes: int = 0
    matched: str | None = None


def spec_text(spec: Any) -> str:
    """A PartitionSpec as `P(None, 'm0')`, the same on every JAX version."""
    return f"P({', '.join(repr(axis) for axis in spec)})"


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * getattr(dtype, "itemsize", 0)


def leaf_rows(plan: Plan) -> list[LeafRow]:
    """A row for every array leaf of the plan, in model order."""
    resolved = plan.resolved
    paths = None
    rows = []
    for i, (leaf, sharding) in enumerate(zip(resolved.leaves, plan.flat_shardings)):
        if not hasattr(leaf, "shape"):
            continue
        if paths is None:
            paths = jax_paths(resolved.model)
        shape = tuple(leaf.shape)
        shard = shape if sharding is None else tuple(sharding.shard_shape(shape))
        expr = resolved.exprs[i]
        rows.append(
            LeafRow(
                path=paths[i],
                shape=shape,
                dtype=str(leaf.dtype),
                expression=None if expr is None else str(expr),
                partition_spec=None if sharding is None else spec_text(sharding.spec),
                bytes_per_device=_nbytes(shard, leaf.dtype),
                total_bytes=_nbytes(shape, leaf.dtype),
            )
        )
    return rows


def jax_paths(model: Any) -> list[str]:
    """The key path of every leaf, as `jax.tree_util.keystr` writes it."""
    import jax

    return [keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(model)[0]]


def total_bytes_per_device(rows: list[LeafRow]) -> int | None:
    """What one device holds (with even shards every device holds the same), or
    `None` when a leaf could not be laid out."""
    sizes = [row.bytes_per_device for row in rows]
    return None if None in sizes else sum(size or 0 for size in sizes)


def human_bytes(n: int) -> str:
    """`1536` -> `'1.5 KiB'`."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    value, i = float(n), 0
    while value >= 1024 and i < len(units) - 1:
        value, i = value / 1024, i + 1
    return f"{n} B" if i == 0 else f"{value:.1f} {units[i]}"


def leaf_table(rows: list[LeafRow], *, title: str | None = None, matched: bool = False) -> Table:
    """A rich table: path, shape, dtype, expression, then the matched rule (with
    `matched`) or the PartitionSpec, and bytes per device."""
    table = Table(title=title, title_justify="left")
    middle = "matched" if matched else "spec"
    for name in ("leaf", "shape", "dtype", "expression", middle):
        table.add_column(name)
    table.add_column("per device", justify="right")
    for row in rows:
        table.add_row(
            row.path,
            str(list(row.shape)),
            row.dtype,
            row.expression or "[dim]replicated[/dim]",
            (row.matched or "") if matched else (row.partition_spec or "[dim]kept[/dim]"),
            "-" if row.bytes_per_device is None else human_bytes(row.bytes_per_device),
        )
    return table
