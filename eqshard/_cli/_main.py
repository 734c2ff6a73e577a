"""The `eqshard` command line. Nothing imports this module but `__main__`.

Exit codes: 0 success, 1 a spec or expression is at fault, 2 bad usage or an
unreadable file. A user never sees a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .._errors import EqshardError, SpecError, UnreadableError, whole_number

__all__ = ["main"]


def _use_devices(count: int | None) -> None:
    """Fixes the device count before JAX starts its backends.

    With `count`, JAX runs on `count` simulated CPU devices. Without it, JAX uses
    the accelerators that are present, or 8 simulated CPU devices when there are none.
    When JAX's backends are already up (eqshard run in-process), this does nothing,
    and the callers report a device count that differs from the one asked for.
    """
    import jax

    from .._compat import backends_started

    if backends_started():
        return
    try:
        if count is not None:
            jax.config.update("jax_platforms", "cpu")
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            jax.config.update("jax_num_cpu_devices", count or 8)
    except RuntimeError:  # started after all, in a JAX that cannot tell us beforehand
        pass


def _text(text: str, style: str):
    from rich.text import Text

    return Text(text, style=style)


def _console():
    """A rich console that prints user text literally (no markup, no emoji codes);
    wide when writing to a file or pipe, so tables are not cut."""
    from rich.console import Console

    return Console(
        width=None if sys.stdout.isatty() else 200, markup=False, emoji=False, highlight=False
    )


def _safe(text: object) -> str:
    """`text` with every character a terminal could act on (escape sequences, other
    control characters) written as a Python escape; new lines are kept."""
    return "".join(
        c if c == "\n" or c.isprintable() else c.encode("unicode_escape").decode("ascii")
        for c in str(text)
    )


def _out(text: object = "") -> None:
    print(_safe(text))


def _err(text: object) -> None:
    print(_safe(text), file=sys.stderr)


def _whole(minimum: int):
    """An argparse type: a whole number of at least `minimum`."""

    def convert(text: str) -> int:
        if not (text.isascii() and text.isdigit()):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (digits 0-9)")
        try:
            return whole_number(int(text), repr(text), minimum)
        except EqshardError:
            raise argparse.ArgumentTypeError(f"{text!r} must be {minimum} or more") from None

    return convert


_positive, _size = _whole(1), _whole(0)

_EVERY_ONE = "--format json lists every one"  # where to see the problems text only counts

MAX_SIMULATED = 4096  # simulated CPU devices to draw on, or compile a step on
MAX_DEMO_DEVICES = 64  # the demo compiles and runs a step on each: XLA:CPU's limit on 2 cores
MAX_DEMO_STEPS = 1000  # each strategy trains this many steps on one fixed batch


def _at_most(limit: int, what: str):
    def convert(text: str) -> int:
        value = _positive(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{text!r} is more than {limit} {what}")
        return value

    return convert


_device_count = _at_most(MAX_SIMULATED, "simulated devices")


def _layout_count(text: str) -> int:
    """An argparse type: a device count to lay out on, abstractly."""
    from .._layout import MAX_DEVICES  # no JAX

    return _at_most(MAX_DEVICES, "devices, the most a JAX sharding can describe")(text)


def _memory_size(text: str) -> int:
    """An argparse type: bytes, as `80GB`, `16GiB`, `1.5TB` or a plain byte count."""
    from .._cost._hardware import memory_size  # no JAX

    try:
        return memory_size(text)
    except EqshardError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_demo_devices = _at_most(
    MAX_DEMO_DEVICES, "simulated devices: the demo compiles and runs a training step on each"
)


def _show(args: argparse.Namespace) -> int:
    _use_devices(args.devices)
    import jax

    from .._expression import parse
    from .._picture import describe
    from .._sharding import sharding

    expr = parse(args.expression)
    devices = jax.devices()
    if args.devices is not None and len(devices) != args.devices:
        raise EqshardError(
            f"asked for {args.devices} simulated devices, but JAX had already started "
            f"with {len(devices)}"
        )
    describe(str(expr), args.shape, sharding(expr, args.shape), _console())
    return 0


def _demo(args: argparse.Namespace) -> int:
    _use_devices(args.devices)
    from ._demo import main as demo

    return demo(
        _console(),
        spec=args.spec,
        steps=args.steps,
        devices=args.devices,
        emit=_emit_json if args.format == "json" else None,
    )


def _emit_json(payload: object) -> None:
    """One JSON document on stdout, in ASCII, so it is JSON whatever the terminal's
    encoding."""
    import json

    print(json.dumps(payload, indent=2, ensure_ascii=True))


def _validate(args: argparse.Namespace) -> int:
    from .._errors import problem_lines
    from .._specfile._file import load

    code, report = 0, []
    for name in args.files:
        try:
            rules = load(name)
        except SpecError as error:  # an UnreadableError too
            unreadable = isinstance(error, UnreadableError)
            code = 2 if unreadable else max(code, 1)
            problems = [p.to_json() for p in error.problems]
            report.append({"file": name, "ok": False, "problems": problems})
            if args.format == "text":
                for line in problem_lines(error.problems, more=_EVERY_ONE):
                    (_err if unreadable else _out)(line)
            continue
        count = len(rules.rules)
        report.append({"file": name, "ok": True, "rules": count, "problems": []})
        if args.format == "text":
            _out(f"ok: {name} ({count} rule{'s' * (count != 1)})")
    if args.format == "json":
        _emit_json({"ok": code == 0, "files": report})
    return code


def _check_in_processes() -> bool:
    """Whether `check` runs each device count in a process of its own: when nothing
    in this process has imported JAX (the command line itself, which imports it only
    here), so each count gets a JAX started for it, and a model may set its own
    device count. A program that imported JAX first (eqshard used as a library, the
    tests) keeps its JAX and its configuration, and the check runs in it."""
    return "jax" not in sys.modules


def _batch_spec(text: str | None) -> str | None:
    """`--batch-spec`, checked (a complete expression) before any worker starts."""
    from .._errors import ExpressionError
    from .._specfile._file import batch_expression  # no JAX

    if text is None:
        return None
    try:
        return str(batch_expression(text))
    except ExpressionError as error:
        raise EqshardError(f"--batch-spec {text!r}: {error}") from None


def _check_command(args: argparse.Namespace) -> int:
    from .._specfile._file import load

    for option, value in (
        ("--batch", args.batch),
        ("--optimizer", args.optimizer),
        ("--batch-spec", args.batch_spec),
    ):
        if args.step is None and value is not None:
            raise _UsageError(
                f"eqshard check: error: {option} is for the step: name it with --step"
            )
    if args.step is not None and args.batch is None:
        raise _UsageError(
            "eqshard check: error: --step needs --batch MODULE:CALLABLE, where CALLABLE() "
            "returns the step's batch"
        )
    batch_spec = _batch_spec(args.batch_spec)
    targets = list(dict.fromkeys(args.target or []))
    checks = []  # (file, its rules, its device counts, or the TPU slices to check on)
    for name in dict.fromkeys(args.files):
        rules = load(name)
        simulated: list[int] = args.devices or [rules.devices or 8]
        if not targets and args.step is not None and max(simulated) > MAX_SIMULATED:
            given = "--devices" if args.devices else f'{name} says "devices":'
            raise EqshardError(
                f"{given} {max(simulated)}: --step compiles the step on simulated devices, "
                f"up to {MAX_SIMULATED}, or with --target on a TPU slice's, any number; "
                "without --step, layouts are checked on any count"
            )
        counts: list[int | str] = [*targets] if targets else [*simulated]
        checks.append((name, rules, counts))
    results = []
    if _check_in_processes():
        from ._check_workers import check_in_processes

        results = check_in_processes(
            [(name, counts) for name, _, counts in checks],
            args.model,
            strict=args.strict,
            step=args.step,
            optimizer=args.optimizer,
            batch=args.batch,
            max_memory=args.max_memory,
            batch_spec=batch_spec,
            devices=args.devices,
        )
    else:
        counted = [n for _, _, counts in checks for n in counts if isinstance(n, int)]
        most = max(counted, default=1)
        if args.step is not None and counted:  # layouts alone need no devices, nor a slice
            _use_devices(most)
        import jax

        from .._process._usercode import abstract_model, step_inputs
        from ._check import check, check_slices

        if targets:
            check_slices(targets, args.devices)
        if args.step is not None and counted and len(jax.devices()) < most:
            raise EqshardError(
                f"checking on {most} devices needs {most} simulated devices, "
                f"but JAX started with {len(jax.devices())} (is XLA_FLAGS setting a device "
                "count?)"
            )
        modules: dict[str, object] = {}  # each of the user's files imported once
        model = abstract_model(args.model, modules=modules)
        step = None
        if args.step is not None:
            step = step_inputs(model, args.step, str(args.batch), args.optimizer, modules=modules)
        for _, rules, counts in checks:
            results += check(
                rules,
                model,
                counts,
                strict=args.strict,
                step=step,
                max_memory=args.max_memory,
                batch=batch_spec,
            )

    from .._errors import problem_lines
    from .._fsdp import is_fsdp_replicated
    from .._report import human_bytes
    from ._check import devices_text
    from ._check_table import (
        compiler_line,
        cost_line,
        memory_line,
        result_table,
        summary_table,
        warning_lines,
    )

    if args.format == "json":
        _emit_json({"ok": all(r.ok for r in results), "checks": [r.to_json() for r in results]})
        return 0 if all(r.ok for r in results) else 1
    console = _console()
    for result in results:
        console.print(result_table(result))
        for line in warning_lines(result):  # right under the table, where they are seen
            console.print(_text(_safe(line), "bold yellow"), soft_wrap=True)
        coverage = result.coverage
        total = result.bytes_per_device
        whole = sum(is_fsdp_replicated(row.origin) for row in result.rows)
        _out(
            f"{len(result.rows)} array leaves: {coverage['rules']} by rules, "
            f"{coverage['dims']} by dims, {coverage['default']} by the default"
            + (f", {coverage['none']} by none" if coverage["none"] else "")
            + (f" ({whole} replicated by FSDP: no dim to split)" if whole else "")
            + ("" if total is None else f"; each device holds {human_bytes(total)}")
        )
        if result.cost is not None:
            _out(cost_line(result.cost))
            _out(compiler_line(result.cost))
        memory = memory_line(result)
        if memory is not None:
            _out(memory)
        for line in problem_lines(result.problems, more=_EVERY_ONE):
            _out(line)
        verdict = "ok" if result.ok else f"{len(result.problems)} problem(s)"
        if result.ok and result.warnings:
            count = len(result.warnings)
            verdict += f", with {count} warning{'s' * (count != 1)} (an error under --strict)"
        _out(f"{result.source} on {devices_text(result.devices, result.target)}: {verdict}\n")
    if len(results) > 1:
        console.print(summary_table(results))
    return 0 if all(r.ok for r in results) else 1


def _step_options(command: str, args: argparse.Namespace) -> None:
    """`--batch` and `--optimizer` belong to `--step`, which needs `--batch`."""
    for option, value in (("--batch", args.batch), ("--optimizer", args.optimizer)):
        if args.step is None and value is not None:
            raise _UsageError(
                f"eqshard {command}: error: {option} is for the step: name it with --step"
            )
    if args.step is not None and args.batch is None:
        raise _UsageError(
            f"eqshard {command}: error: --step needs --batch MODULE:CALLABLE, where "
            "CALLABLE() returns the step's batch"
        )


def _step_request(args: argparse.Namespace) -> dict[str, object]:
    """What a worker needs to build the model and the step's inputs, and where."""
    names = ("model", "step", "batch", "optimizer", "devices", "target")
    return {name: getattr(args, name) for name in names}


def _suggest_command(args: argparse.Namespace) -> int:
    _step_options("suggest", args)
    from ._suggest_diff import run

    request = {**_step_request(args), "max_memory": args.max_memory, "workers": args.workers}
    ranked = run("suggest", request, here=not _check_in_processes())
    best = ranked.best
    written = None
    if args.write is not None and best is not None:
        from .._specfile._file import dump

        dump(best.rules, args.write)
        written = args.write
    costed = [s for s in ranked if s.cost is not None]
    if args.format == "json":
        _emit_json({"ok": best is not None, **ranked.to_json(), "written": written})
    else:
        _console().print(ranked)
        if written is not None:
            _out(f"wrote {written}: {best.name if best else ''}")
        elif args.write is not None:
            _out(f"nothing fits: {args.write} not written")
    if ranked.suggestions and not costed:
        _err(
            "eqshard suggest: error: no candidate could be compiled; the first one's error: "
            + (ranked.suggestions[0].error or "")
        )
        return 2
    if not ranked.suggestions:  # every candidate dropped: the model, step or batch's doing
        reason = ranked.dropped[0][1] if ranked.dropped else "the generator made none"
        _err(f"eqshard suggest: error: every candidate was dropped; the first: {reason}")
        return 2
    return 0 if best is not None else 1


def _diff_command(args: argparse.Namespace) -> int:
    from .._specfile._file import load  # no JAX: a file that does not load is said at once

    _step_options("diff", args)
    a, b = load(args.a), load(args.b)
    if args.step is not None and args.target is None:
        count = args.devices or a.devices or b.devices or 8
        if count > MAX_SIMULATED:
            raise EqshardError(
                f"{count} devices: --step compiles the step on simulated devices, up to "
                f"{MAX_SIMULATED}, or with --target on a TPU slice's, any number"
            )
    from ._suggest_diff import run

    found = run(
        "diff", {**_step_request(args), "a": args.a, "b": args.b}, here=not _check_in_processes()
    )
    if args.format == "json":
        _emit_json({"ok": True, **found.to_json()})
    else:
        for line in found.lines():
            _out(line)
    return 0 if found.same else 1


def _schema(args: argparse.Namespace) -> int:
    from .._specfile._file import schema

    _emit_json(schema())
    return 0


def _user_code_options(
    parser: argparse.ArgumentParser, *, step: str, batch: str, required: bool = False
) -> None:
    """`--model`, `--step`, `--optimizer` and `--batch`: the user's code, named
    `MODULE:CALLABLE`, as `check`, `suggest` and `diff` take it; `required` makes
    the step and its batch so."""
    code = "MODULE:CALLABLE"
    parser.add_argument(
        "--model",
        required=True,
        metavar=code,
        help="what builds the model, e.g. 'mypkg.model:build' or 'model.py:build'",
    )
    parser.add_argument("--step", required=required, metavar=code, help=step)
    parser.add_argument(
        "--optimizer",
        metavar=code,
        help="what returns the optax optimizer whose state the step takes",
    )
    parser.add_argument("--batch", required=required, metavar=code, help=batch)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="eqshard",
        description="Declare, check and apply how an Equinox model is sharded.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    show = commands.add_parser(
        "show",
        help="draw which device holds which block of an array",
        description=(
            "Draw which device holds which block of an array of SHAPE under an einshard "
            "expression. Without --devices it uses the accelerators present, or 8 "
            "simulated CPU devices when there are none."
        ),
    )
    show.add_argument("expression", metavar="EXPR", help="e.g. 'x y -> x y*'")
    show.add_argument(
        "--shape", type=_size, nargs="+", required=True, metavar="N", help="e.g. --shape 4 8"
    )
    show.add_argument(
        "--devices",
        type=_device_count,
        metavar="N",
        help="simulate N CPU devices (default: the devices present, or 8 CPU devices)",
    )
    show.set_defaults(run=_show)

    demo = commands.add_parser(
        "demo",
        help="train a small GPT under each parallelism strategy and compare them",
        description=(
            "Train a small GPT (eqx.nn modules, its layers stacked and scanned) with "
            "AdamW for a few steps, unsharded and then under each spec file of "
            "examples/specs/demo: data parallel, FSDP-style, Megatron tensor parallel "
            "and 2D (data x model). Print, for each, the bytes per device of the "
            "parameters and the optimizer state, the communication of one step (from "
            "eqshard.cost), the final loss, and whether the losses equal the unsharded "
            "ones. Without --devices it uses the accelerators present, or 8 simulated "
            "CPU devices when there are fewer than two. Exit 1 when a strategy's "
            "losses differ from the unsharded run's."
        ),
    )
    demo.add_argument(
        "--spec",
        metavar="NAME_OR_PATH",
        help="run one strategy: data-parallel, zero-1, fsdp, megatron or 2d, or a spec file of "
        "your own for the demo's model (default: each strategy)",
    )
    demo.add_argument(
        "--steps",
        type=_at_most(MAX_DEMO_STEPS, "steps"),
        default=8,
        metavar="K",
        help="AdamW steps per strategy (default: 8)",
    )
    demo.add_argument(
        "--devices",
        type=_demo_devices,
        metavar="N",
        help=f"simulate N CPU devices (at most {MAX_DEMO_DEVICES})",
    )
    demo.add_argument("--format", choices=["text", "json"], default="text")
    demo.set_defaults(run=_demo)

    validate = commands.add_parser(
        "validate",
        help="check spec files against the schema and the expression syntax",
        description=(
            "Check spec files against the eqshard schema and the einshard syntax. No "
            "model is needed, and nothing is imported. Exit 0 when every file is "
            "valid, 1 when any is invalid, 2 when one cannot be read."
        ),
    )
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.add_argument("--format", choices=["text", "json"], default="text")
    validate.set_defaults(run=_validate)

    check = commands.add_parser(
        "check",
        help="resolve spec files against a model, abstractly, on N devices",
        description=(
            "Build the model abstractly (no device memory), resolve each spec file's "
            "rules on N devices for each N given, abstractly (no devices either, so "
            "65536 take seconds), and print a per-leaf table with the totals per "
            "device. With --step, compile the training step on N simulated devices "
            f"(at most {MAX_SIMULATED}) over the laid-out arguments and print what it "
            "costs per device: memory, "
            "communication per step and an estimate on an H100; with --target, "
            "compile it for a TPU slice's devices with the TPU compiler (libtpu, on "
            "this machine, no TPU needed), whose memory is exact and is held against "
            "the chip's HBM. Several files, counts or slices are compared side by "
            "side. Exit 1 when a leaf is unmatched under "
            '"default": "error", a dim does not divide, the device count does not '
            "fit, a check needs more than --max-memory (with --target, by default, "
            "the chip's HBM), or (with --strict) a rule matched nothing."
        ),
    )
    check.add_argument("files", nargs="+", metavar="FILE")
    _user_code_options(
        check,
        step="the training step, called step(model, opt_state, batch) with --optimizer, "
        "else step(model, batch); when --model builds (model, state), as "
        "eqx.nn.make_with_state does, step(model, state, opt_state, batch) or "
        "step(model, state, batch); compiled (never run) to find its cost",
        batch="what returns the step's batch (needed with --step); traced abstractly, "
        "or, if it needs concrete values (np.asarray of a JAX array), run once on the "
        "host, which holds one batch in memory",
    )
    check.add_argument(
        "--batch-spec",
        metavar="EXPR",
        help="the einshard expression that lays out the step's batch (each of its "
        "arrays), both sides: 'b ... -> b* ...' splits the leading dim over every "
        "device, '... -> * ...' gives each device a whole copy, as tensor parallelism "
        'alone does (default: the spec file\'s "batch", else the leading dim over the '
        "first axis of its mesh, else over every device)",
    )
    check.add_argument(
        "--target",
        nargs="+",
        metavar="SLICE",
        help="TPU slices to check on, as jax.experimental.topologies names them, e.g. "
        "v5e:4x4 or v5p:8x8x16: each on its devices, the step (with --step) compiled "
        "for them by XLA:TPU on this machine (libtpu: pip install 'eqshard[tpu]'), "
        "--max-memory by default the chip's HBM; --devices, if given, must be the "
        "slice's count",
    )
    check.add_argument(
        "--max-memory",
        type=_memory_size,
        metavar="SIZE",
        help="device memory per device, e.g. 80GB or 16GiB: a check that needs more (the "
        "step's peak, or without --step the parameters; leaves held in host memory, "
        '"memory": "pinned_host", are not counted) does not fit (default with --target: '
        "the chip's HBM)",
    )
    check.add_argument(
        "--devices",
        type=_layout_count,
        nargs="+",
        metavar="N",
        help='device counts to check (default: the file\'s "devices", or 8); any count '
        f"for layouts, at most {MAX_SIMULATED} with --step",
    )
    check.add_argument(
        "--strict", action="store_true", help="a rule that matches nothing is an error"
    )
    check.add_argument("--format", choices=["text", "json"], default="text")
    check.set_defaults(run=_check_command)

    suggest = commands.add_parser(
        "suggest",
        help="find the fastest spec that fits, by compiling the step under each strategy",
        description=(
            "Build the model, the optimizer state and the batch abstractly, generate the "
            "candidate specs (data parallel, FSDP, ZeRO-1, Megatron tensor parallel, "
            "data x tensor and FSDP x tensor, on every mesh of the device count), compile "
            "the training step under each in worker processes (on N simulated devices "
            "with XLA:CPU, or for a TPU slice with XLA:TPU), and print them ranked: those "
            "that fit --max-memory (by default, with --target, the chip's HBM; without "
            "either, every one) fastest first by a roofline estimate, then the others, "
            "with how far over they are. --write saves the best as a spec file. Exit 0 "
            "when a candidate fits, 1 when none does, 2 for bad input (a model, step or "
            "batch that cannot be built, or a step that no candidate can compile)."
        ),
    )
    _user_code_options(
        suggest,
        step="the training step, as for check: step(model, opt_state, batch) with "
        "--optimizer, else step(model, batch)",
        batch="what returns the step's batch",
        required=True,
    )
    where = suggest.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--devices",
        type=_device_count,
        metavar="N",
        help=f"compile each candidate on N simulated CPU devices (at most {MAX_SIMULATED})",
    )
    where.add_argument(
        "--target",
        metavar="SLICE",
        help="compile each candidate for a TPU slice, e.g. v5p:4x4x4, with XLA:TPU on this "
        "machine (libtpu: pip install 'eqshard[tpu]')",
    )
    suggest.add_argument(
        "--max-memory",
        type=_memory_size,
        metavar="SIZE",
        help="device memory per device, e.g. 80GB or 75GiB (default with --target: the "
        "chip's HBM; without it, no limit)",
    )
    suggest.add_argument(
        "--write",
        metavar="FILE",
        help="write the best candidate that fits as a spec file, its comments naming the "
        "strategy and its cost",
    )
    suggest.add_argument(
        "--workers",
        type=_positive,
        metavar="N",
        help="worker processes that compile at once (default: one per core)",
    )
    suggest.add_argument("--format", choices=["text", "json"], default="text")
    suggest.set_defaults(run=_suggest_command)

    diff = commands.add_parser(
        "diff",
        help="list the leaves two spec files lay out differently, and with a step the cost",
        description=(
            "Lay the model out under both spec files, abstractly (no devices), on N "
            "devices or a TPU slice's, and print one line per leaf whose layout differs "
            "(what a device holds of it), with both expressions and PartitionSpecs, and "
            "the change of mesh and batch. With --step, compile the step under both and "
            "print the change in memory per device, communication per mesh axis and "
            "the estimate. Exit 0 when they lay everything out alike, 1 when they "
            "differ, 2 for trouble (a file, model or step that cannot be read or built), "
            "as diff(1) does."
        ),
    )
    diff.add_argument("a", metavar="A", help="the spec file before")
    diff.add_argument("b", metavar="B", help="the spec file after")
    _user_code_options(
        diff,
        step="the training step, as for check: compiled under both specs",
        batch="what returns the step's batch (with --step)",
    )
    on = diff.add_mutually_exclusive_group()
    on.add_argument(
        "--devices",
        type=_layout_count,
        metavar="N",
        help="the device count (default: A's \"devices\", else B's, else 8); at most "
        f"{MAX_SIMULATED} with --step",
    )
    on.add_argument("--target", metavar="SLICE", help="a TPU slice, e.g. v5e:4x4: its device count")
    diff.add_argument("--format", choices=["text", "json"], default="text")
    diff.set_defaults(run=_diff_command)

    schema = commands.add_parser("schema", help="print the JSON Schema of spec files")
    schema.set_defaults(run=_schema)
    return parser


class _UsageError(Exception):
    """argparse's complaint, raised rather than printed, so `--format json` can
    answer it in JSON."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(f"{self.format_usage()}{self.prog}: error: {message}")


class _PipeSafe:
    """A stream whose reader may go away (`eqshard check ... | head -c 1`): writes
    after that are dropped, so the command runs to its end and exits with its own
    code, whenever the pipe closes."""

    def __init__(self, stream):
        self._stream = stream
        self.closed_by_reader = False

    def write(self, text: str) -> int:
        if not self.closed_by_reader:
            try:
                self._stream.write(text)
                self._stream.flush()
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.closed_by_reader:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.closed_by_reader = True
        try:  # and the interpreter's last flush at exit must not fail either
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


_TROUBLE = ("suggest", "diff")  # commands whose 1 means an answer: any error is 2


def _exit_code(error: BaseException) -> int:
    if isinstance(error, (UnreadableError, OSError, _UsageError)):
        return 2
    if isinstance(getattr(error, "exit_code", None), int):  # a model that cannot be built
        return error.exit_code  # type: ignore[attr-defined]
    return 1 if isinstance(error, EqshardError) else 2


def _report(command: str, error: BaseException, as_json: bool) -> int:
    """Says what went wrong, on stderr (and as the JSON document on stdout with
    `--format json`), and returns the exit code."""
    code = 2 if command in _TROUBLE else _exit_code(error)
    if isinstance(error, (EqshardError, OSError, _UsageError)):
        text = error.text(_EVERY_ONE) if isinstance(error, SpecError) else error
        message = (
            str(error) if isinstance(error, _UsageError) else f"eqshard {command}: error: {text}"
        )
    else:  # a bug in eqshard: say so, without a traceback
        message = (
            f"eqshard {command}: internal error: {type(error).__name__}: {error}\n"
            "This is a bug in eqshard; please report it with the command that caused it."
        )
    _err(message)
    if as_json:
        problems = error.problems if isinstance(error, SpecError) else []
        _emit_json(
            {
                "ok": False,
                "error": {
                    "message": message,
                    "problems": [p.to_json() for p in problems],
                },
            }
        )
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line and returns its exit code.

    Exit codes: 0 success; 1 a spec, expression or check is at fault; 2 bad usage,
    an unreadable file, a model that cannot be built, or a bug. Nothing prints a
    traceback, and with `--format json` stdout holds one JSON document.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = any(
        a == "--format=json" or (a == "--format" and b == "json")
        for a, b in zip(argv, [*argv[1:], ""])
    )
    stdout = sys.stdout
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:  # never fail on text a terminal cannot show
            reconfigure(errors="backslashreplace")
    sys.stdout = _PipeSafe(stdout)
    command = argv[0] if argv else ""
    try:
        args = _parser().parse_args(argv)
        command = args.command
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except SystemExit as exit:  # --help, --version
        return exit.code if isinstance(exit.code, int) else 0
    except BaseException as error:
        return _report(command, error, as_json)
    finally:
        sys.stdout = stdout
