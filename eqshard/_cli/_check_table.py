"""`eqshard check`'s results as text: a table per check, the lines under it, and
the checks side by side (rich tables, built only when printed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._cost._hardware import seconds_text
from .._problems import problem_of
from ._check import HBM, CheckResult, devices_text, limit_text, needed_text

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "activation_lines",
    "compiler_line",
    "cost_line",
    "explained_lines",
    "memory_line",
    "result_table",
    "summary_table",
    "warning_lines",
]


def result_table(result: CheckResult) -> Table:
    """The per-leaf table of one check. A leaf that an unused rule was likely meant
    for (the one its "did you mean" matches, or one an earlier rule took from it)
    has the warning in its `from` cell: `default (warning: $.rules[4])`."""
    from .._report import leaf_table

    flags: dict[str, str] = {}
    for entry in result.warnings:
        for leaf in entry.get("leaves", []):
            flags.setdefault(leaf, f"warning: {entry.get('path') or entry['where']}")
    title = f"{result.source} on {devices_text(result.devices, result.target)}"
    return leaf_table(result.rows, title=title, flags=flags)


def warning_lines(result: CheckResult, limit: int = 12) -> list[str]:
    """The warnings of one check, for right under its table: `warning: ` and each,
    grouped by message (`problem_lines`), in at most `limit` lines."""
    from .._problems import problem_lines

    problems = [problem_of(entry) for entry in result.warnings]
    more = "--format json lists every one"
    return [f"warning: {line}" for line in problem_lines(problems, limit=limit, more=more)]


def _communication(cost: Mapping[str, Any]) -> list[str]:
    """`all-reduce over data 514.0 KiB`, one per kind of collective and mesh axes."""
    from .._report import human_bytes

    return [
        f"{entry['kind']}{' over ' + '+'.join(entry['axes']) if entry['axes'] else ''} "
        f"{human_bytes(entry['bytes'])}"
        for entry in cost["communication"]
    ]


def cost_line(cost: Mapping[str, Any]) -> str:
    """One line of what a step costs: memory per device, communication per step,
    and the estimate on the target's chip, else an H100 (a `CheckResult.cost`)."""
    from .._report import human_bytes

    memory = f"parameters {human_bytes(cost['parameters'])}"
    if cost.get("state"):
        memory += f", state {human_bytes(cost['state'])}"
    if cost["optimizer"]:
        memory += f", optimizer {human_bytes(cost['optimizer'])}"
    if cost.get("host"):
        memory += f" ({human_bytes(cost['host'])} of it in host memory)"
    moved = ", ".join(_communication(cost)) or "no communication"
    peak = "peak" if cost.get("target") else "peak (XLA:CPU)"
    unknown = cost.get("unknown")
    per = "per step" if not unknown else "per step and trip"
    return (
        f"cost: {memory}, {peak} {human_bytes(cost['peak_lower_bound'])} per device; "
        f"{moved} {per}; estimate on {_chip(cost)}: {seconds_text(_estimate(cost))}"
        + ("" if not unknown else f" ({unknown})")
        + ("" if not cost.get("promoted") else f" ({cost['promoted']})")
        + ("" if not cost.get("pipeline") else f"; {cost['pipeline']}")
    )


def explained_lines(cost: Mapping[str, Any], top: int = 3) -> list[str]:
    """Why the `top` collectives that move the most bytes move them (`Cost.explain`):
    `why: all-reduce 4.0 KiB over data at model.py:12: the gradient of ...`; the rest
    counted."""
    found = cost.get("explained") or []
    lines = [f"why: {line}" for line in found[:top]]
    if len(found) > top:
        lines.append(f"why: {len(found) - top} more (`--format json`, or `Cost.explain()`)")
    return lines


def activation_lines(cost: Mapping[str, Any], limit: int = 12) -> list[str]:
    """Each named activation the step laid out, a line each, with the rule that placed
    each dim: `activation ('batch', 'embed') [16, 64]: P('data', None), batch:
    $.logical_axis_rules[0] (data); embed: whole (no rule)`; at most `limit`."""
    found = cost.get("activations") or []
    lines = [
        f"activation {tuple(a['names'])} {list(a['shape'])}: {a['partition_spec']}, {a['placed']}"
        for a in found[:limit]
    ]
    if len(found) > limit:
        lines.append(
            f"... and {len(found) - limit} more activations; --format json lists every one"
        )
    return lines


def _chip(cost: Mapping[str, Any]) -> str:
    """`an H100`, or the target's chip: `a Google Cloud TPU v5e`."""
    estimate = cost.get("estimate")
    if not cost.get("target") or not estimate:
        return "an H100"
    return f"a {estimate['hardware']}"


def _estimate(cost: Mapping[str, Any]) -> float:
    """The estimate's seconds: on the target's chip, else on an H100."""
    estimate = cost.get("estimate")
    return float(estimate["seconds"] if estimate else cost["estimate_h100_seconds"])


def compiler_line(cost: Mapping[str, Any]) -> str:
    """Whose figures a step's cost holds, and how its batch was laid out:
    `compiled by XLA:TPU (libtpu 0.0.42.1) for v5e:2x4; the batch laid out by
    'b ... -> b* ...'`."""
    line = f"compiled by {cost['compiler']}"
    if cost.get("target"):
        line += f" for {cost['target']}"
    batch = cost.get("batch")
    return line + (f"; the batch laid out by {batch!r}" if batch else "; no batch laid out")


def memory_line(result: CheckResult) -> str | None:
    """The memory limit of one check, where it has one, and whether it holds:
    `max memory: the chip's HBM, 16 GiB per device (no --max-memory given); the step
    needs 1.1 MiB: it fits`."""
    from .._report import human_bytes

    limit = result.max_memory
    if limit is None or limit.get("needed") is None:
        return None
    given = ""
    if limit["from"] == HBM:
        given = " (no --max-memory given)"
    elif result.cost is not None and result.cost.get("memory_per_device") is not None:
        hbm = limit_text({"bytes": result.cost["memory_per_device"], "from": HBM})
        given = f" ({hbm})"
    what = needed_text(result.cost, result.state_leaves)
    verdict = "it fits" if limit["fits"] else "it does not fit"
    return (
        f"max memory: {limit_text(limit)} per device{given}; {what} "
        f"{human_bytes(int(limit['needed']))}: {verdict}"
    )


def summary_table(results: Sequence[CheckResult]) -> Table:
    """The checks side by side: spec, devices (and the TPU slice), whether it fits,
    what the model holds per device (its parameters, and its `eqx.nn.State` and the
    optimizer state where there are, as the column's title says), the peak (what
    XLA:CPU allocates, or XLA:TPU's own on a slice: `Memory.peak_includes`),
    communication per step and the estimate on an H100, or on
    each slice's chip (the last three with a step to compile)."""
    from rich.table import Table
    from rich.text import Text

    from .._report import human_bytes

    table = Table(title=Text("the checks side by side"), title_justify="left")
    table.add_column("spec")
    table.add_column("devices", justify="right")
    table.add_column("fits")
    table.add_column(f"{_held_label(results)} / device", justify="right")
    on_slices = any(result.target for result in results)  # --target: every check is on one
    table.add_column("peak / device" if on_slices else "peak (XLA:CPU) / device", justify="right")
    table.add_column("communication / step")
    table.add_column("estimate (chip)" if on_slices else "estimate (H100)", justify="right")
    for result in results:
        cost = result.cost
        if cost is not None:
            held: int | None = cost["parameters"] + cost.get("state", 0) + cost["optimizer"]
        else:
            held = result.bytes_per_device
        problems = len(result.problems)
        table.add_row(
            Text(result.source),
            str(result.devices) if result.target is None else f"{result.devices} ({result.target})",
            "yes" if result.ok else f"no ({problems} problem{'s' * (problems != 1)})",
            "-" if held is None else human_bytes(held),
            "-" if cost is None else human_bytes(cost["peak_lower_bound"]),
            "-" if cost is None else "\n".join(_communication(cost)) or "none",
            "-" if cost is None else seconds_text(_estimate(cost)),
        )
    return table


def _held_label(results: Sequence[CheckResult]) -> str:
    """What the summary's bytes per device hold: `parameters`, with `+ state` for a
    stateful model and `+ optimizer` where a step's optimizer state is counted."""
    parts = ["parameters"]
    if any(result.state_leaves for result in results):
        parts.append("state")
    if any(result.cost is not None and result.cost["optimizer"] for result in results):
        parts.append("optimizer")
    return " + ".join(parts)
