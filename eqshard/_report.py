"""Per-leaf tables: where each leaf of a model goes, and what it costs per device."""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Mapping
from typing import Any

from jaxtyping import PyTree
from rich.table import Table
from rich.text import Text

from ._derive import derived_plan
from ._errors import SpecError
from ._fields import FROM_FIELDS, is_array_like
from ._plan import Plan, Spec, Unspecified
from ._sharding import AnyMesh, Devices, placement

__all__ = [
    "LeafRow",
    "Report",
    "as_text",
    "device_bytes_per_device",
    "host_bytes_per_device",
    "human_bytes",
    "leaf_rows",
    "leaf_table",
    "memory_kind",
    "report",
    "spec_text",
    "stage_layers",
    "stage_lines",
    "total_bytes_per_device",
]


@dataclasses.dataclass(frozen=True)
class LeafRow:
    """One array leaf, as a row of a report.

    - `path`: the leaf's dotted path.
    - `expression`: its complete expression, `None` where it has none.
    - `partition_spec`: its `PartitionSpec` on the plan's mesh, `None` for a leaf
        kept where it is or not laid out.
    - `bytes_per_device`: what one device holds of it, `None` where it could not be
        laid out.
    - `origin`: where its expression came from (`"$.rules[2]"`, `"dims"`,
        `"default"`, `"Linear.weight"`), when the spec says.
    - `memory_kind`: where each device's part is held, where that is not the
        device's own memory: `"pinned_host"`; else `None`.
    - `stages`: for a stack of layers split over the mesh axis `"stage"` (pipeline
        stages: its first axis, or its second under a first of rounds), the layers
        each stage holds, stage by stage, counted in the stack's order; else `None`.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    expression: str | None
    partition_spec: str | None = None
    bytes_per_device: int | None = None
    total_bytes: int = 0
    origin: str | None = None
    memory_kind: str | None = None
    stages: tuple[tuple[int, ...], ...] | None = None

    @property
    def on_host(self) -> bool:
        """Whether its part is held in host memory, not the device's."""
        return self.memory_kind is not None


def as_text(renderable: Any, width: int) -> str:
    """A rich table (or anything rich prints) as plain text `width` columns wide, with
    no markup or emoji read into it: how every result's `str` is written."""
    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO(), markup=False, emoji=False)
    console.print(renderable)
    return console.export_text().rstrip() + "\n"


def spec_text(spec: Any) -> str:
    """A PartitionSpec as `P(None, 'm0')`, the same on every JAX version."""
    return f"P({', '.join(repr(axis) for axis in spec)})"


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * getattr(dtype, "itemsize", 0)


def leaf_rows(plan: Plan) -> list[LeafRow]:
    """A row for every array leaf of the plan, in model order; leaves that could not
    be laid out have no bytes per device."""
    resolved = plan.resolved
    paths = None
    rows = []
    for i, (leaf, sharding) in enumerate(zip(resolved.leaves, plan.flat_shardings)):
        if not is_array_like(leaf):
            continue
        if paths is None:
            paths = resolved.paths
        shape = tuple(leaf.shape)
        expr = resolved.exprs[i]
        if sharding is not None:
            per_device: int | None = _nbytes(tuple(sharding.shard_shape(shape)), leaf.dtype)
        elif i in resolved.failed:
            per_device = None
        else:  # kept where it is
            per_device = _nbytes(shape, leaf.dtype)
        rows.append(
            LeafRow(
                path=paths[i],
                shape=shape,
                dtype=str(leaf.dtype),
                expression=None if expr is None else str(expr),
                partition_spec=None if sharding is None else spec_text(sharding.spec),
                bytes_per_device=per_device,
                total_bytes=_nbytes(shape, leaf.dtype),
                origin=resolved.origins[i],
                memory_kind=memory_kind(sharding),
                stages=stage_layers(shape, sharding),
            )
        )
    return rows


STAGE = "stage"
"""The mesh axis whose devices hold pipeline stages (`eqshard.parallel.pipeline`'s `axis`)."""


def stage_layers(shape: tuple[int, ...], sharding: Any) -> tuple[tuple[int, ...], ...] | None:
    """The layers each stage holds of a stack split over `STAGE`: on its first axis,
    stage `k` of `S` holds layers `[k L / S, (k + 1) L / S)`; on its second, under a
    first axis of rounds left whole (`(rounds, stages, ...)`, the circular
    schedule's), layer `r n + j` for each round `r` and each `j` of its part of the
    `n`. `None` for any other leaf."""
    if sharding is None or STAGE not in sharding.mesh.axis_names:
        return None
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    count = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes))[STAGE]
    if not shape or count == 1:
        return None
    if spec[0] == STAGE:
        per = shape[0] // count
        return tuple(tuple(range(k * per, (k + 1) * per)) for k in range(count))
    if len(shape) > 1 and spec[0] is None and spec[1] == STAGE:
        rounds, n = shape[0], shape[1]
        per = n // count
        return tuple(
            tuple(r * n + k * per + j for r in range(rounds) for j in range(per))
            for k in range(count)
        )
    return None


def stage_lines(rows: list[LeafRow]) -> list[str]:
    """One line per stack split into pipeline stages: which layers each stage holds,
    `blocks (8 layers, 6 leaves): stage 0 holds layers 0-1; stage 1 holds 2-3; ...`."""
    groups: dict[tuple[str, tuple[tuple[int, ...], ...]], list[str]] = {}
    for row in rows:
        if row.stages is not None:  # one line per stack: by its module, then its layout
            top = row.path.split(".")[0]
            groups.setdefault((top, tuple(map(tuple, row.stages))), []).append(row.path)
    lines = []
    for (_, stages), paths in groups.items():
        prefix = _common_prefix(paths)
        layers = sum(len(held) for held in stages)
        held = "; ".join(
            f"stage {k} holds {'layers ' if k == 0 else ''}{_ranges(held)}"
            for k, held in enumerate(stages)
        )
        leaves = f"{len(paths)} leaves" if len(paths) != 1 else "1 leaf"
        lines.append(f"{prefix} ({layers} layers, {leaves}): {held}")
    return lines


def _common_prefix(paths: list[str]) -> str:
    parts = [path.split(".") for path in paths]
    common = []
    for segments in zip(*parts):
        if len(set(segments)) != 1:
            break
        common.append(segments[0])
    if len(paths) == 1 or not common:
        return paths[0] if len(paths) == 1 else "the stacked leaves"
    return ".".join(common)


def _ranges(indices: tuple[int, ...]) -> str:
    """`0-1`, `0, 4`, or runs: `0-7, 32-39, 64-71, ... (64 layers)` past four runs."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    text = [f"{a}-{b}" if b > a else str(a) for a, b in runs]
    if len(text) > 4:
        return ", ".join(text[:3]) + f", ... ({len(indices)} layers)"
    return ", ".join(text)


def memory_kind(sharding: Any) -> str | None:
    """A sharding's memory kind where it is not the device's own (`"pinned_host"`),
    else `None`."""
    kind = getattr(sharding, "memory_kind", None)
    return None if kind in (None, "device") else kind


def total_bytes_per_device(rows: list[LeafRow]) -> int | None:
    """What one device holds (with even shards every device holds the same), in its
    own memory and in host memory, or `None` when a leaf could not be laid out."""
    sizes = [row.bytes_per_device for row in rows]
    return None if None in sizes else sum(size or 0 for size in sizes)


def device_bytes_per_device(rows: list[LeafRow]) -> int | None:
    """What one device holds in its own memory (not in host memory), or `None` when
    a leaf could not be laid out: what a memory limit is compared with."""
    return total_bytes_per_device([row for row in rows if not row.on_host])


def host_bytes_per_device(rows: list[LeafRow]) -> int:
    """What is held in host memory for one device (`"pinned_host"` leaves)."""
    return sum(row.bytes_per_device or 0 for row in rows if row.on_host)


def human_bytes(n: int) -> str:
    """`1536` -> `'1.5 KiB'`."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    value, i = float(n), 0
    while value >= 1024 and i < len(units) - 1:
        value, i = value / 1024, i + 1
    return f"{n} B" if i == 0 else f"{value:.1f} {units[i]}"


def leaf_table(
    rows: list[LeafRow], *, title: str | None = None, flags: Mapping[str, str] | None = None
) -> Table:
    """A rich table: path, shape, dtype, expression, where it came from, the
    PartitionSpec, and bytes per device. User text is shown literally. `flags`
    marks leaves by path: the text goes after their `from`, in the warnings' style."""
    table = Table(title=None if title is None else Text(title), title_justify="left")
    for name in ("leaf", "shape", "dtype", "expression", "from", "spec"):
        table.add_column(name)
    table.add_column("per device", justify="right")
    kinds = any(row.on_host for row in rows)  # a column only where it says something
    if kinds:
        table.add_column("memory")
    for row in rows:
        table.add_row(
            Text(row.path),
            str(list(row.shape)),
            row.dtype,
            Text(row.expression) if row.expression else Text("replicated", style="dim"),
            _origin(row, flags),
            row.partition_spec
            or Text("-" if row.bytes_per_device is None else "kept", style="dim"),
            "-" if row.bytes_per_device is None else human_bytes(row.bytes_per_device),
            *([row.memory_kind or Text("device", style="dim")] if kinds else []),
        )
    return table


def _origin(row: LeafRow, flags: Mapping[str, str] | None) -> Text:
    flag = None if flags is None else flags.get(row.path)
    if flag is None:
        return Text(row.origin or "")
    return Text(f"{row.origin or ''} ({flag})".lstrip(), style="bold yellow")


@dataclasses.dataclass(frozen=True)
class Report:
    """Where every array leaf of a tree goes, and what one device holds of it.

    `print(report)` shows the table. In a rich console or notebook it renders as one.
    `to_json()` gives the same to machines.

    **Attributes:**

    - `rows`: one `LeafRow` per array leaf, in tree order.
    - `total_bytes`: the bytes of every array leaf, whole.
    - `bytes_per_device`: what one device holds, in its own memory and in host memory
        (`None` if a leaf is not laid out).
    - `host_bytes_per_device`: of that, what is held in host memory (`"pinned_host"`).
    """

    rows: list[LeafRow]
    title: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(row.total_bytes for row in self.rows)

    @property
    def bytes_per_device(self) -> int | None:
        return total_bytes_per_device(self.rows)

    @property
    def host_bytes_per_device(self) -> int:
        return host_bytes_per_device(self.rows)

    def __rich__(self) -> Table:
        table = leaf_table(self.rows, title=self.title)
        per_device, host = self.bytes_per_device, self.host_bytes_per_device
        table.caption = f"{len(self.rows)} array leaves, {human_bytes(self.total_bytes)} in all" + (
            "" if per_device is None else f"; each device holds {human_bytes(per_device)}"
        )
        if host and per_device is not None:
            table.caption += f", {human_bytes(host)} of it in host memory"
        for line in stage_lines(self.rows):
            table.caption += f"\nstages over {STAGE!r}: {line}"
        table.caption_justify = "left"
        return table

    def __str__(self) -> str:
        return as_text(self, 160)

    def to_json(self) -> dict[str, Any]:
        return {
            "leaves": [dataclasses.asdict(row) for row in self.rows],
            "total_bytes": self.total_bytes,
            "bytes_per_device": self.bytes_per_device,
            "host_bytes_per_device": self.host_bytes_per_device,
            "stages": stage_lines(self.rows),
        }


def report(
    tree: PyTree[Any],
    spec: Spec = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    simulate: int | None = None,
    unspecified: Unspecified = "replicate",
) -> Report:
    """The per-leaf table of where a model or an optimizer state goes.

    **Example:**

    ```python
    plan = eqshard.plan(model, rules)
    print(eqshard.report(model, plan))
    print(eqshard.report(opt_state, plan))    # moments follow their parameters
    ```

    **Arguments:**

    - `tree`: a model, an optimizer state built from it, or any pytree; concrete or
        abstract.
    - `spec`: anything `eqshard.apply` takes, a `Plan` included.
    - `mesh`, `devices`, `simulate`, `unspecified`: as for `eqshard.plan`.

    **Returns:**

    A `Report`: a row per array leaf, with the totals (see "The rows").

    **Raises:**

    - `eqshard.SpecError`: lists every leaf that cannot be laid out.
    - `eqshard.UsageError`: both `devices` and `simulate` are given.

    !!! info "The rows"

        Each array leaf's row gives its dotted path, shape, dtype, and expression (or
        "replicated"). It gives where the expression came from: a rule, a field, the
        parameter whose layout an optimizer moment follows, the optimizer section's rule
        and its parameter, or "replicated: no parameter here". It gives the leaf's
        `PartitionSpec` and the bytes one device holds. Where its memory kind is not the
        device's, it gives it (`"pinned_host"`). The totals say what of them is in host
        memory.
    """
    placed = placement(devices, simulate, what="`eqshard.report`", was_simulated=True)
    planned = derived_plan(tree, spec, mesh=mesh, devices=placed, unspecified=unspecified)
    if planned.problems:
        raise SpecError(planned.problems)
    return Report(leaf_rows(planned.plan))
