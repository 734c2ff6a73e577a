"""Running the harness's work on each device count, in processes of their own."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import EqshardError, ModelError, UsageError, whole_number
from .._process._usercode import with_user_frames
from .._process._workers import Worker, start_worker, without_device_count, worker_answer
from .._specfile._model import Rules
from .._specfile._read import read_path
from .._warnings import deprecated

__all__ = [
    "TIMEOUT_SECONDS",
    "MeshTemplate",
    "default_counts",
    "device_counts",
    "mesh_template",
    "run_in_one_process",
    "run_per_count",
]

MeshTemplate = Mapping[str, "int | str"]
TIMEOUT_SECONDS = 600.0
_ENTRY = "eqshard.testing._worker:main"


def mesh_template(mesh: Any) -> dict[str, int | str] | None:
    """A mesh template checked: axis names to sizes, one of them `"*"` at most (the
    rest of the devices)."""
    if mesh is None:
        return None
    if not isinstance(mesh, Mapping) or not mesh:
        raise EqshardError(
            f"`mesh` must be a mesh template such as {{'data': '*', 'model': 4}} (axis "
            f"names to sizes, '*' for the rest of the devices), not {mesh!r}"
        )
    template: dict[str, int | str] = {}
    for name, size in mesh.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise EqshardError(f"`mesh`: axis name {name!r} is not an identifier")
        if size != "*":
            size = whole_number(size, f"mesh axis {name!r}")
            if size < 1:
                raise EqshardError(f"`mesh`: axis {name!r} has size {size}; sizes are >= 1")
        template[name] = size
    if list(template.values()).count("*") > 1:
        raise EqshardError(f"`mesh` {mesh!r}: at most one axis may be '*'")
    return template


def device_counts(
    counts: Any, spec: Any, template: Mapping[str, int | str] | None, devices: Any = None
) -> tuple[int, ...]:
    """The device counts to test: `device_counts=` (a count or a sequence of counts),
    else the deprecated `devices=` of the same, else the spec's own (`default_counts`).

    **Raises:** `UsageError` for both given; `EqshardError` for what is no counts.
    """
    if devices is not None:
        if counts is not None:
            raise UsageError(
                "`device_counts=` and `devices=` are both given; pass the counts as "
                "`device_counts=` alone"
            )
        deprecated(
            f"`devices={devices!r}` as the counts to test is deprecated: pass "
            f"`device_counts={devices!r}` (each count runs in a worker with that many "
            "simulated devices)"
        )
        counts = devices
    if counts is None:
        return default_counts(spec, template)
    if isinstance(counts, int) and not isinstance(counts, bool):
        return (counts,)
    if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence):
        raise EqshardError(
            "`device_counts` is a device count or a sequence of them, such as (1, 2, 8), "
            f"not {counts!r}"
        )
    return tuple(counts)


def default_counts(spec: Any, template: Mapping[str, int | str] | None) -> tuple[int, ...]:
    """The device counts a spec is written for: its file's `"devices"`, else counts
    its mesh (the template, else the file's `"mesh"`) fits (the fixed axes' product,
    and twice that where one axis is `"*"`), else 1, 2 and 8."""
    rules = _rules(spec)
    if rules is not None and rules.devices is not None:
        return (rules.devices,)
    sizes: list[int | None] | None = None
    if template is not None:
        sizes = [None if size == "*" else int(size) for size in template.values()]
    elif rules is not None and rules.mesh is not None:
        sizes = [size for _, size in rules.mesh]
    if sizes is None:
        return (1, 2, 8)
    fixed = math.prod(size for size in sizes if size is not None)
    if None not in sizes:
        return (fixed,)
    return (1, 2, 8) if fixed == 1 else (fixed, 2 * fixed)


def _rules(spec: Any) -> Any:
    spec = read_path(spec)
    return spec if isinstance(spec, Rules) else None


def _counts(counts: Sequence[int]) -> list[int]:
    counts = [whole_number(n, "devices") for n in dict.fromkeys(counts)]
    if not counts or any(n < 1 for n in counts):
        raise EqshardError(f"`devices` must name device counts >= 1, not {list(counts)}")
    return counts


def _result(worker: Worker, what: str, timeout: float) -> Any:
    """The worker's `result`; the user's code's error as a `ModelError` naming `what`."""
    try:
        return worker_answer(worker, timeout, what, "Run the callables in Python to see why")[
            "result"
        ]
    except EqshardError:
        raise
    except Exception as error:  # the user's code raised, in the worker: kept as the cause
        failed = ModelError(f"{what}: {type(error).__name__}: {error}")
        raise with_user_frames(failed, error) from error


def run_per_count(
    request: Mapping[str, Any], counts: Sequence[int], doing: str, timeout: float
) -> dict[int, dict[str, Any]]:
    """Each count's `result`, its work run in a fresh process (up to one per CPU
    core at once); the first error, in the order of the counts, is raised here."""
    counts = _counts(counts)
    at_once = max(1, min(4, os.cpu_count() or 1))
    env = without_device_count(os.environ)
    results: dict[int, dict[str, Any]] = {}
    for start in range(0, len(counts), at_once):
        running: list[tuple[int, Worker]] = []
        try:
            for n in counts[start : start + at_once]:  # each started is stopped below
                running.append((n, start_worker({**request, "devices": n}, _ENTRY, env)))
            for n, worker in running:
                results[n] = _result(worker, f"{doing} on {n} devices", timeout)
        finally:
            for _, worker in running:
                worker.stop()
    return results


def run_in_one_process(
    request: Mapping[str, Any], counts: Sequence[int], doing: str, timeout: float
) -> dict[int, dict[str, Any]]:
    """Each count's `result`, from one fresh process given every count (work that
    needs no devices, such as layouts: `"devices"` is the list of counts, and the
    result one entry per count, in order)."""
    counts = _counts(counts)
    worker = start_worker({**request, "devices": counts}, _ENTRY)
    found = _result(worker, f"{doing} on {', '.join(map(str, counts))} devices", timeout)
    return dict(zip(counts, found))
