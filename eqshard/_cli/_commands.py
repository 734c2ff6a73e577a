"""The commands `show`, `demo`, `validate`, `schema`, `suggest` and `diff`, each a
function of the parsed arguments that returns the exit code (`check`, the largest,
has `_check_command.py`), and what they share: `use_devices` (the device count,
fixed before JAX starts), `in_workers` (whether the work runs in worker
processes) and `step_options` (`--step` and the options that belong to it).

What goes wrong is raised, never printed: `_main.py` says it and picks the exit
code. JAX is imported only by a command that needs it.
"""

from __future__ import annotations

import argparse
import os
import sys

from .._errors import EqshardError, SpecError, UnreadableError
from ._output import EVERY_ONE, console, emit_json, err, out, progress
from ._parser import MAX_SIMULATED, BadUsage

__all__ = [
    "batch_options",
    "demo",
    "deprecated_option",
    "diff",
    "in_workers",
    "schema",
    "show",
    "step_options",
    "suggest",
    "use_devices",
    "validate",
]


def use_devices(count: int | None) -> None:
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


def in_workers() -> bool:
    """Whether `check`, `suggest` and `diff` run in worker processes: when nothing
    in this process has imported JAX (the command line itself, which imports it
    only there), so each worker gets a JAX started for it, and a model may set its
    own device count. A program that imported JAX first (eqshard used as a library,
    the tests) keeps its JAX and its configuration, and the work runs in it."""
    return "jax" not in sys.modules


def deprecated_option(command: str, old: str, new: str) -> None:
    """The one-line notice, on stderr, that an old spelling still works."""
    err(f"eqshard {command}: {old} is deprecated: pass {new}")


def _is_builder(text: str) -> bool:
    """Whether `--batch TEXT` names the batch's builder (`MODULE:CALLABLE`, the old
    meaning) rather than a layout: a colon and no arrow, which no expression has."""
    return ":" in text and "->" not in text


def batch_options(command: str, args: argparse.Namespace) -> None:
    """`--make-batch` (the builder) and `--batch` (the layout) as the user meant
    them: `--batch MODULE:CALLABLE` and `--batch-spec EXPR`, the old spellings, moved
    to their new places with a notice each.

    **Raises:** `BadUsage` for an old spelling given with its new one, or a layout
    where the command takes none.
    """
    if args.batch is not None and _is_builder(args.batch):
        if args.make_batch is not None:
            raise BadUsage(
                f"eqshard {command}: error: --make-batch and --batch {args.batch} both name "
                "the batch's builder; pass --make-batch alone"
            )
        deprecated_option(
            command, f"--batch {args.batch}", f"--make-batch {args.batch} (--batch is the layout)"
        )
        args.make_batch, args.batch = args.batch, None
    old = getattr(args, "batch_spec", None)
    if old is not None:
        if args.batch is not None:
            raise BadUsage(
                f"eqshard {command}: error: --batch and --batch-spec both give the batch's "
                "layout; pass --batch alone"
            )
        deprecated_option(command, "--batch-spec", f"--batch {old!r}")
        args.batch, args.batch_spec = old, None
    if args.batch is not None and not hasattr(args, "batch_spec"):
        raise BadUsage(
            f"eqshard {command}: error: --batch {args.batch!r} is a batch layout, which "
            f"{command} does not take; name the batch's builder with --make-batch "
            "MODULE:CALLABLE"
        )


def step_options(command: str, args: argparse.Namespace, *others: str) -> None:
    """`--make-batch`, `--batch`, `--optimizer` and the `others` (option names)
    belong to `--step`, which needs `--make-batch` (`batch_options` read first).

    **Raises:** `BadUsage` naming the option given without `--step`, or `--step`
    without `--make-batch`.
    """
    batch_options(command, args)
    for option in ("--make-batch", "--batch", "--optimizer", *others):
        if args.step is None and getattr(args, option[2:].replace("-", "_"), None) is not None:
            raise BadUsage(
                f"eqshard {command}: error: {option} is for the step: name it with --step"
            )
    if args.step is not None and args.make_batch is None:
        raise BadUsage(
            f"eqshard {command}: error: --step needs --make-batch MODULE:CALLABLE, where "
            "CALLABLE() returns the step's batch"
        )


def show(args: argparse.Namespace) -> int:
    """`eqshard show`: the blocks of an array of `--shape` under an expression."""
    use_devices(args.devices)
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
    describe(str(expr), args.shape, sharding(expr, args.shape), console())
    return 0


def demo(args: argparse.Namespace) -> int:
    """`eqshard demo`: the GPT trained under each strategy (`_demo.py`)."""
    use_devices(args.devices)
    from .._demo._run import main as run_demo

    return run_demo(
        console(),
        spec=args.spec,
        steps=args.steps,
        devices=args.devices,
        emit=emit_json if args.format == "json" else None,
    )


def validate(args: argparse.Namespace) -> int:
    """`eqshard validate`: each file read and checked, without JAX."""
    from .._problems import problem_lines
    from .._specfile._read import load

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
                for line in problem_lines(error.problems, more=EVERY_ONE):
                    (err if unreadable else out)(line)
            continue
        count = len(rules.rules)
        report.append({"file": name, "ok": True, "rules": count, "problems": []})
        if args.format == "text":
            out(f"ok: {name} ({count} rule{'s' * (count != 1)})")
    if args.format == "json":
        emit_json({"ok": code == 0, "files": report})
    return code


def schema(args: argparse.Namespace) -> int:
    """`eqshard schema`: the JSON Schema of spec files."""
    from .._specfile._schema import schema as spec_schema

    emit_json(spec_schema())
    return 0


def _step_request(args: argparse.Namespace) -> dict[str, object]:
    """What a worker needs to build the model and the step's inputs, and where."""
    names = ("model", "step", "optimizer", "devices", "target")
    return {"batch": args.make_batch, **{name: getattr(args, name) for name in names}}


def _writable(path: str) -> None:
    """`--write PATH` checked before anything compiles (`check_writable`, as `dump`
    checks it).

    **Raises:** `BadUsage` naming the path, what is wrong with it and the fix.
    """
    from .._specfile._write import check_writable

    try:
        check_writable(path)
    except EqshardError as error:
        raise BadUsage(
            f"eqshard suggest: error: --write {path!r}: {error}; --write names the spec file "
            "to write, such as best.eqshard.json, in a folder that exists"
        ) from None


def _suggest_targets(args: argparse.Namespace) -> int:
    """`eqshard suggest --targets`: the best on each slice, in one table."""
    if args.write is not None:
        raise BadUsage(
            "eqshard suggest: error: --write writes one slice's best, and --targets ranks "
            "several: choose the slice, then run `eqshard suggest --target SLICE --write FILE`"
        )
    from ._suggest_diff import run

    request = {
        **_step_request(args),
        "targets": args.targets,
        "max_memory": args.max_memory,
        "workers": args.workers,
        "exhaustive": args.exhaustive,
        "tolerance": args.tolerance,
        "strategies": args.strategies,
        "verbose": args.verbose,
    }
    starting = f"building the model and the candidates for {', '.join(args.targets)}"
    with progress("eqshard suggest", starting, plain=args.verbose) as show:
        found = run("targets", request, here=not in_workers(), progress=show)
    if args.format == "json":
        emit_json({"ok": bool(found.fitting), **found.to_json()})
    else:
        console().print(found)
    if all(s.error is not None for row in found for s in row.ranked):  # every one failed
        first = found[0]
        err(
            "eqshard suggest: error: no candidate could be compiled on any target; on "
            f"{first.target}: {first.why}"
        )
        return 2
    return 0 if found.fitting else 1


def suggest(args: argparse.Namespace) -> int:
    """`eqshard suggest`: the candidates ranked (`_suggest_diff.run`), the best
    written with `--write` (its path checked first); with `--targets`, the best on
    each slice."""
    step_options("suggest", args)
    if args.write is not None and args.targets is None:
        _writable(args.write)
    if args.targets is not None:
        return _suggest_targets(args)
    from ._suggest_diff import run

    request = {
        **_step_request(args),
        "max_memory": args.max_memory,
        "workers": args.workers,
        "exhaustive": args.exhaustive,
        "tolerance": args.tolerance,
        "strategies": args.strategies,
        "verbose": args.verbose,
    }
    where = args.target or f"{args.devices} devices"
    starting = f"building the model and the candidates on {where}"
    with progress("eqshard suggest", starting, plain=args.verbose) as show:
        ranked = run("suggest", request, here=not in_workers(), progress=show)
    best = ranked.best
    written = None
    if args.write is not None and best is not None:
        from .._specfile._write import dump

        dump(best.rules, args.write)
        written = args.write
    if args.format == "json":
        emit_json({"ok": best is not None, **ranked.to_json(), "written": written})
    else:
        console().print(ranked)
        if written is not None:
            out(f"wrote {written}: {best.name if best else ''}")
        elif args.write is not None:
            out(f"nothing fits: {args.write} not written")
    if ranked.suggestions and all(s.error is not None for s in ranked):  # every one failed
        err(
            "eqshard suggest: error: no candidate could be compiled; the first one's error: "
            + (ranked.suggestions[0].error or "")
        )
        return 2
    if not ranked.suggestions:  # every candidate dropped: the model, step or batch's doing
        reason = ranked.dropped[0][1] if ranked.dropped else "the generator made none"
        err(f"eqshard suggest: error: every candidate was dropped; the first: {reason}")
        return 2
    return 0 if best is not None else 1


def diff(args: argparse.Namespace) -> int:
    """`eqshard diff`: the leaves two spec files lay out differently
    (`_suggest_diff.run`)."""
    from .._specfile._read import load  # no JAX: a file that does not load is said at once

    step_options("diff", args)
    a, b = load(args.a), load(args.b)
    if args.step is not None and args.target is None:
        count = args.devices or a.devices or b.devices or 8
        if count > MAX_SIMULATED:
            raise EqshardError(
                f"{count} devices: --step compiles the step on simulated devices, up to "
                f"{MAX_SIMULATED}, or with --target on a TPU slice's, any number"
            )
    from ._suggest_diff import run

    found = run("diff", {**_step_request(args), "a": args.a, "b": args.b}, here=not in_workers())
    if args.format == "json":
        emit_json({"ok": True, **found.to_json()})
    else:
        for line in found.lines():
            out(line)
    return 0 if found.same else 1
