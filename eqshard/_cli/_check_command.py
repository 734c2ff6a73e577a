"""`eqshard check` from the command line, in named steps: its options checked
(`step_options`, `--batch`, `--device-counts`), the files loaded and what each is checked on
(`_planned`: device counts or TPU slices), the checks run (`_run_in_workers`, in
fresh processes, or `_run_here`, in this process where JAX is already imported),
and the results printed (`_print_result`, then a summary table) or emitted as one
JSON document. The checks themselves are `_check.py`'s, their text
`_check_table.py`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._errors import EqshardError
from ._commands import deprecated_option, in_workers, step_options, use_devices
from ._output import EVERY_ONE, console, emit_json, out, safe, styled
from ._parser import MAX_SIMULATED

if TYPE_CHECKING:
    from .._specfile._model import Rules
    from ._check import CheckResult

__all__ = ["check_command", "run_checks"]


@dataclasses.dataclass(frozen=True)
class _Planned:
    """A spec file as the user named it, its rules, and the device counts (or TPU
    slices, as `"v5e:4x4"`) to check it on."""

    source: str
    rules: Rules
    counts: list[int | str]


def check_command(args: argparse.Namespace) -> int:
    """`eqshard check`: exit 0 when every check is ok, else 1.

    **Raises:** `BadUsage` for options that do not go together; `EqshardError` for
    a `--batch` or a device count that cannot be; what loading a file,
    building the user's code or a worker raises (`SpecError`, `ModelError`,
    `StepError`).
    """
    results = run_checks("check", args)
    ok = all(r.ok for r in results)
    if args.format == "json":
        emit_json({"ok": ok, "checks": [r.to_json() for r in results]})
        return 0 if ok else 1
    shown = console()
    for result in results:
        _print_result(shown, result)
    if len(results) > 1:
        from ._check_table import summary_table

        shown.print(summary_table(results))
    return 0 if ok else 1


def run_checks(command: str, args: argparse.Namespace) -> list[CheckResult]:
    """The checks `args` ask for (`check`'s options), in workers or here, for
    `eqshard check` and `eqshard explain` (`command`, the name its errors give)."""
    step_options(command, args)
    batch_spec = _batch_spec(args.batch)
    args.device_counts = _device_counts(args)
    targets = list(dict.fromkeys(args.target or []))
    planned = _planned(args, targets)
    if in_workers():
        return _run_in_workers(args, planned, batch_spec)
    return _run_here(args, planned, targets, batch_spec)


def _device_counts(args: argparse.Namespace) -> list[int] | None:
    """`--device-counts`, else `--simulate` (one count), else the deprecated
    `--devices` (with its notice on stderr)."""
    if args.devices is not None:
        counts = " ".join(map(str, args.devices))
        deprecated_option("check", f"--devices {counts}", f"--device-counts {counts}")
        return list(args.devices)
    if args.simulate is not None:
        return [args.simulate]
    return args.device_counts


def _batch_spec(text: str | None) -> str | None:
    """`--batch`, the layout, checked (a complete expression) before any worker starts."""
    from .._errors import ExpressionError
    from .._specfile._model import batch_expression  # no JAX

    if text is None:
        return None
    try:
        return str(batch_expression(text))
    except ExpressionError as error:
        raise EqshardError(f"--batch {text!r}: {error}") from None


def _planned(args: argparse.Namespace, targets: Sequence[str]) -> list[_Planned]:
    """Each file given, loaded once, with what to check it on: the TPU slices, else
    `--device-counts`, else the file's `"devices"`, else 8; a step compiles on at most
    `MAX_SIMULATED` simulated devices."""
    from .._specfile._read import load

    planned = []
    for source in dict.fromkeys(args.files):
        rules = load(source)
        simulated: list[int] = args.device_counts or [rules.devices or 8]
        if not targets and args.step is not None and max(simulated) > MAX_SIMULATED:
            given = "--device-counts" if args.device_counts else f'{source} says "devices":'
            raise EqshardError(
                f"{given} {max(simulated)}: --step compiles the step on simulated devices, "
                f"up to {MAX_SIMULATED}, or with --target on a TPU slice's, any number; "
                "without --step, layouts are checked on any count"
            )
        counts: list[int | str] = [*targets] if targets else [*simulated]
        planned.append(_Planned(source, rules, counts))
    return planned


def _run_in_workers(
    args: argparse.Namespace, planned: Sequence[_Planned], batch_spec: str | None
) -> list[CheckResult]:
    """The checks in fresh processes, each with a JAX of its own
    (`_check_workers.check_in_processes`)."""
    from ._check_workers import check_in_processes

    return check_in_processes(
        [(p.source, p.counts) for p in planned],
        args.model,
        strict=args.strict,
        step=args.step,
        optimizer=args.optimizer,
        batch=args.make_batch,
        max_memory=args.max_memory,
        batch_spec=batch_spec,
        devices=args.device_counts,
    )


def _run_here(
    args: argparse.Namespace,
    planned: Sequence[_Planned],
    targets: Sequence[str],
    batch_spec: str | None,
) -> list[CheckResult]:
    """The checks in this process, whose JAX is already imported: the model (and
    the step's inputs) built once, every file checked on every count."""
    counted = [n for p in planned for n in p.counts if isinstance(n, int)]
    most = max(counted, default=1)
    compiling = args.step is not None and bool(counted)  # layouts alone need no devices
    if compiling:
        use_devices(most)
    import jax

    from .._process._usercode import abstract_model, step_inputs
    from ._check import check, check_slices

    if targets:
        check_slices(targets, args.device_counts)
    if compiling and len(jax.devices()) < most:
        raise EqshardError(
            f"checking on {most} devices needs {most} simulated devices, "
            f"but JAX started with {len(jax.devices())} (is XLA_FLAGS setting a device "
            "count?)"
        )
    modules: dict[str, Any] = {}  # each of the user's files imported once
    model = abstract_model(args.model, modules=modules)
    step = None
    if args.step is not None:
        step = step_inputs(model, args.step, str(args.make_batch), args.optimizer, modules=modules)
    results = []
    for p in planned:
        results += check(
            p.rules,
            model,
            p.counts,
            strict=args.strict,
            step=step,
            max_memory=args.max_memory,
            batch=batch_spec,
        )
    return results


def _print_result(shown: Any, result: CheckResult) -> None:
    """One check as text: its table, its warnings right under it (where they are
    seen), the leaves' summary, the step's cost, the memory, the problems and the
    verdict."""
    from .._problems import problem_lines
    from .._report import stage_lines
    from ._check import devices_text
    from ._check_table import (
        activation_lines,
        compiler_line,
        cost_line,
        explained_lines,
        memory_line,
        result_table,
        warning_lines,
    )

    shown.print(result_table(result))
    for line in warning_lines(result):
        shown.print(styled(safe(line), "bold yellow"), soft_wrap=True)
    out(_leaves_line(result))
    for line in stage_lines(result.rows):
        out(f"stages over 'stage': {line}")
    if result.cost is not None:
        out(cost_line(result.cost))
        out(compiler_line(result.cost))
        for line in activation_lines(result.cost):
            out(line)
        for line in explained_lines(result.cost):
            out(line)
    memory = memory_line(result)
    if memory is not None:
        out(memory)
    for line in problem_lines(result.problems, more=EVERY_ONE):
        out(line)
    verdict = "ok" if result.ok else f"{len(result.problems)} problem(s)"
    if result.ok and result.warnings:
        count = len(result.warnings)
        verdict += f", with {count} warning{'s' * (count != 1)} (an error under --strict)"
    out(f"{result.source} on {devices_text(result.devices, result.target)}: {verdict}\n")


def _leaves_line(result: CheckResult) -> str:
    """How many leaves each source laid out, and what a device holds."""
    from .._fsdp import is_fsdp_replicated
    from .._report import human_bytes

    coverage = result.coverage
    total = result.bytes_per_device
    whole = sum(is_fsdp_replicated(row.origin) for row in result.rows)
    return (
        f"{len(result.rows)} array leaves: {coverage['rules']} by rules, "
        f"{coverage['dims']} by dims, {coverage['default']} by the default"
        + (f", {coverage['none']} by none" if coverage["none"] else "")
        + (f" ({whole} replicated by FSDP: no dim to split)" if whole else "")
        + ("" if total is None else f"; each device holds {human_bytes(total)}")
    )
