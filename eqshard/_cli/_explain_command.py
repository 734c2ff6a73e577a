"""`eqshard explain`: one spec file's step compiled as `eqshard check --step` compiles
it, and why each of its collectives moves what it moves (`Cost.explain`), as a table
or JSON."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ._check_command import run_checks
from ._output import console, emit_json, out, safe

__all__ = ["explain_command"]


def explain_command(args: argparse.Namespace) -> int:
    """`eqshard explain`: 0 when every collective has a reason, 1 when the spec is at
    fault (as `check`) or eqshard cannot tell why some collective moves.

    **Raises:** what `eqshard check --step` raises.
    """
    check = argparse.Namespace(
        **{
            **vars(args),
            "files": [args.file],
            "target": None if args.target is None else [args.target],
            "device_counts": None,
            "devices": None,
            "strict": False,
            "max_memory": None,
        }
    )
    (result,) = run_checks("explain", check)
    cost: Mapping[str, Any] = result.cost or {}
    found = list(cost.get("explanations", []))
    unknown = sum(not e["known"] for e in found)
    ok = result.ok and not unknown
    if args.format == "json":
        emit_json(
            {
                "ok": ok,
                "spec": result.source,
                "devices": result.devices,
                "target": result.target,
                "compiler": cost.get("compiler"),
                "problems": [p.to_json() for p in result.problems],
                "collectives": found,
            }
        )
        return 0 if ok else 1
    from .._problems import problem_lines
    from ._check import devices_text
    from ._check_table import cost_line

    if result.problems or not cost:
        for line in problem_lines(result.problems):
            out(line)
        return 1
    console().print(_table(found[: args.top]))
    out(cost_line(cost))
    if args.top is not None and len(found) > args.top:
        out(f"{len(found) - args.top} more collectives move fewer bytes (--top, or --format json)")
    where = devices_text(result.devices, result.target)
    said = f"{len(found) - unknown} of {len(found)} collectives explained"
    out(
        f"{result.source} on {where}: {said}"
        + (f"; {unknown} eqshard cannot tell" if unknown else "")
    )
    return 0 if ok else 1


def _table(found: list[Mapping[str, Any]]) -> Any:
    """The collectives, most bytes first: kind, bytes per step, axes, where, the leaves
    and why."""
    from rich.table import Table

    from .._report import human_bytes

    table = Table(title="why each byte moves", title_justify="left")
    for column in ("collective", "bytes/step", "axes", "where", "leaves", "why"):
        table.add_column(column, justify="right" if column == "bytes/step" else "left")
    for e in found:
        where = f"{e['file']}:{e['line']}" if e["file"] else ""
        table.add_row(
            e["kind"],
            human_bytes(e["bytes"]),
            ", ".join(e["axes"]),
            safe(where),
            safe(", ".join(e["leaves"])),
            safe(e["reason"]),
        )
    return table
