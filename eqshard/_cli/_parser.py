"""The command line's arguments: `parser()` builds the argparse parser, one small
function per command, with the options several commands share defined once
(`--format`, `--traceback`, `--max-memory`, and the user's code: `--model`,
`--step`, `--optimizer`, `--batch`). It imports no JAX and names no command's
code: `_main.py` runs the command `args.command` names.

Bad usage is raised as `BadUsage` (never printed here), so that `--format json`
can answer it in JSON.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import EqshardError, whole_number
from .._search._strategy_names import STRATEGY_NAMES

__all__ = [
    "MAX_DEMO_DEVICES",
    "MAX_DEMO_STEPS",
    "MAX_SIMULATED",
    "BadUsage",
    "parser",
]

MAX_SIMULATED = 4096  # simulated CPU devices to draw on, or compile a step on
MAX_DEMO_DEVICES = 64  # the demo compiles and runs a step on each: XLA:CPU's limit on 2 cores
MAX_DEMO_STEPS = 1000  # each strategy trains this many steps on one fixed batch


class BadUsage(Exception):
    """argparse's complaint, or options that do not go together, raised rather than
    printed, so `--format json` can answer it in JSON. Its text is printed as it
    is, and the command line exits with 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise BadUsage(f"{self.format_usage()}{self.prog}: error: {message}")


class _Renamed(argparse.Action):
    """An old spelling of an option: it still works, stored where the new one's value
    goes, with a one-line notice on stderr naming the new spelling (`new`)."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        sys.stderr.write(
            f"{parser.prog}: {option_string} {values} is deprecated: pass {self.new} {values}\n"
        )
        setattr(namespace, self.dest, values)


# Argument types ----------------------------------------------------------------


def _whole(minimum: int) -> Callable[[str], int]:
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


def _at_most(limit: int, what: str) -> Callable[[str], int]:
    """An argparse type: a whole number from 1 to `limit`."""

    def convert(text: str) -> int:
        value = _positive(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{text!r} is more than {limit} {what}")
        return value

    return convert


_device_count = _at_most(MAX_SIMULATED, "simulated devices")
_demo_devices = _at_most(
    MAX_DEMO_DEVICES, "simulated devices: the demo compiles and runs a training step on each"
)


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


def _slices(text: str) -> list[str]:
    """An argparse type: TPU slices separated by commas, each named once."""
    names = [name.strip() for name in text.split(",")]
    if any(not name for name in names):
        raise argparse.ArgumentTypeError(
            f"{text!r} names an empty slice: write slices separated by commas, such as "
            "v5e:4x4,v6e:4x4"
        )
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} names {', '.join(twice)} twice")
    return names


# Options several commands share ------------------------------------------------

_TRACEBACK_HELP = (
    "on an error, print the whole Python traceback (eqshard's frames too, and a "
    "worker's), not only the message and the user's frames; EQSHARD_TRACEBACK=1 in "
    "the environment does the same (JAX's own frames stay hidden unless "
    "JAX_TRACEBACK_FILTERING=off)"
)


def _common() -> _Parser:
    """What every command takes, before its name or after: `--traceback`."""
    common = _Parser(add_help=False)
    # SUPPRESS: a command's parser must not reset what was given before its name
    common.add_argument(
        "--traceback", action="store_true", default=argparse.SUPPRESS, help=_TRACEBACK_HELP
    )
    return common


def _format_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=["text", "json"], default="text")


def _max_memory_option(parser: argparse.ArgumentParser, text: str) -> None:
    parser.add_argument("--max-memory", type=_memory_size, metavar="SIZE", help=text)


def _user_code_options(
    parser: argparse.ArgumentParser, *, step: str, batch: str, required: bool = False
) -> None:
    """`--model`, `--step`, `--optimizer` and `--make-batch`: the user's code, named
    `MODULE:CALLABLE`, as `check`, `suggest` and `diff` take it; `required` makes
    the step so (and its batch, checked by `_commands.step_options`, as the old
    spelling `--batch MODULE:CALLABLE` may give it). `--batch` is the batch's layout."""
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
    parser.add_argument("--make-batch", metavar=code, help=batch)
    parser.add_argument(
        "--batch",
        metavar="EXPR",
        help="the batch's layout, an einshard expression for each of its arrays (check "
        f"only); {code} here is the deprecated spelling of --make-batch",
    )


# One function per command ------------------------------------------------------

_Add = Callable[..., argparse.ArgumentParser]  # a command's parser, made with `--traceback`


def _show(add: _Add) -> None:
    show = add(
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


def _demo(add: _Add) -> None:
    demo = add(
        "demo",
        help="train a small GPT under each parallelism strategy and compare them",
        description=(
            "Train a small GPT (eqx.nn modules, its layers stacked and scanned) with "
            "AdamW for a few steps, unsharded and then under each spec file of "
            "examples/specs/demo: data parallel, FSDP-style, Megatron tensor parallel, "
            "2D (data x model), and expert parallelism, context parallelism and pipeline "
            "stages on a mixture-of-experts, a long-sequence and a pipelined variant of "
            "the GPT. Print, for each, the bytes per device of the "
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
    _format_option(demo)


def _validate(add: _Add) -> None:
    validate = add(
        "validate",
        help="check spec files against the schema and the expression syntax",
        description=(
            "Check spec files against the eqshard schema and the einshard syntax. No "
            "model is needed, and nothing is imported. Exit 0 when every file is "
            "valid, 1 when any is invalid, 2 when one cannot be read."
        ),
    )
    validate.add_argument("files", nargs="+", metavar="FILE")
    _format_option(validate)


def _check(add: _Add) -> None:
    check = add(
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
        "host, which holds one batch in memory; --batch EXPR is its layout",
    )
    check.add_argument(
        "--batch-spec",
        metavar="EXPR",
        help="deprecated: the batch's layout is --batch EXPR ('b ... -> b* ...' splits the "
        "leading dim over every device, '... -> * ...' gives each device a whole copy; "
        'default: the spec file\'s "batch", else the leading dim over the first axis of '
        "its mesh, else over every device)",
    )
    check.add_argument(
        "--target",
        nargs="+",
        metavar="SLICE",
        help="TPU slices to check on, as jax.experimental.topologies names them, e.g. "
        "v5e:4x4 or v5p:8x8x16: each on its devices, the step (with --step) compiled "
        "for them by XLA:TPU on this machine (libtpu: pip install 'eqshard[tpu]'), "
        "--max-memory by default the chip's HBM; --device-counts, if given, must be the "
        "slice's count",
    )
    _max_memory_option(
        check,
        "device memory per device, e.g. 80GB or 16GiB: a check that needs more (the "
        "step's peak, or without --step the parameters; leaves held in host memory, "
        '"memory": "pinned_host", are not counted) does not fit (default with --target: '
        "the chip's HBM)",
    )
    counts = check.add_mutually_exclusive_group()
    counts.add_argument(
        "--device-counts",
        type=_layout_count,
        nargs="+",
        metavar="N",
        help="device counts to check, each on simulated devices (default: the file's "
        f'"devices", or 8); any count for layouts, at most {MAX_SIMULATED} with --step',
    )
    counts.add_argument(
        "--simulate",
        type=_layout_count,
        metavar="N",
        help="one device count to check on simulated devices: --device-counts N",
    )
    counts.add_argument(
        "--devices",
        type=_layout_count,
        nargs="+",
        metavar="N",
        help="deprecated: --device-counts N [N ...]",
    )
    check.add_argument(
        "--strict", action="store_true", help="a rule that matches nothing is an error"
    )
    _format_option(check)


def _explain(add: _Add) -> None:
    explain = add(
        "explain",
        help="say why each collective of the step moves what it moves, by leaf and line",
        description=(
            "Compile the training step under one spec file, as check --step does (on "
            '--simulate N devices with XLA:CPU, default the file\'s "devices" or 8, or '
            "for a --target slice with XLA:TPU), and print each collective it runs, the "
            "most bytes first: its bytes per step and mesh axes, the line of the step "
            "that traced it, the leaves whose layouts it moves, and why (a gradient "
            "summed, a split weight gathered before use, a matmul's output summed over "
            "its split contracting dim, a split array sliced across its parts, ...). "
            "Exit 0 when each has a reason, 1 when the spec is at fault or eqshard "
            "cannot tell why one moves, 2 for bad usage or a step that does not compile."
        ),
    )
    explain.add_argument("file", metavar="FILE")
    _user_code_options(
        explain,
        step="the training step, as check takes it (step(model, opt_state, batch) with "
        "--optimizer, else step(model, batch)); compiled, never run",
        batch="what returns the step's batch; traced abstractly",
        required=True,
    )
    where = explain.add_mutually_exclusive_group()
    where.add_argument(
        "--simulate",
        type=_device_count,
        metavar="N",
        help=f"compile on N simulated devices with XLA:CPU (at most {MAX_SIMULATED})",
    )
    where.add_argument(
        "--target",
        metavar="SLICE",
        help="compile for a TPU slice (v5e:2x4) or GPUs (h100:8), deviceless",
    )
    explain.add_argument(
        "--top",
        type=_positive,
        metavar="K",
        help="show the K collectives that move the most bytes (default: every one)",
    )
    _format_option(explain)


def _suggest(add: _Add) -> None:
    suggest = add(
        "suggest",
        help="find the fastest spec that fits, by compiling the step under the strategies",
        description=(
            "Build the model, the optimizer state and the batch abstractly, generate the "
            "candidate specs (each strategy of --strategies, on every mesh of the device "
            "count), estimate "
            "each (the bytes it holds exactly, the rest from its layouts and the step), "
            "compile the training step under those the estimates cannot rule out (every "
            "one with --exhaustive) in worker processes (on --simulate N devices with "
            "XLA:CPU, or for a TPU slice with XLA:TPU, XLA:CPU ranking them first), and "
            "print them ranked: those compiled that fit --max-memory (by default, with "
            "--target, the chip's HBM; without either, every one) fastest first by a "
            "roofline estimate, then those not compiled, marked estimated, then the "
            "others, with how far over they are. --write saves the best as a spec file (its path "
            "is checked before anything compiles). With --targets, the best on each slice "
            "in one table. Exit 0 "
            "when a candidate fits (with --targets, on some slice), 1 when none does, 2 "
            "for bad input (a model, step or batch that cannot be built, a --write path "
            "that cannot be written, or a step that no candidate can compile)."
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
        "--simulate",
        dest="devices",  # the request's count of simulated devices
        type=_device_count,
        metavar="N",
        help="compile each candidate on N simulated CPU devices, in worker processes (at "
        f"most {MAX_SIMULATED})",
    )
    where.add_argument(
        "--devices",
        action=_Renamed,
        new="--simulate",
        type=_device_count,
        metavar="N",
        help="deprecated: --simulate N",
    )
    where.add_argument(
        "--target",
        metavar="SLICE",
        help="compile each candidate for a TPU slice, e.g. v5p:4x4x4, with XLA:TPU on this "
        "machine (libtpu: pip install 'eqshard[tpu]')",
    )
    where.add_argument(
        "--targets",
        type=_slices,
        metavar="SLICE,SLICE,...",
        help="what if: rank the candidates on each TPU slice, e.g. v5e:4x4,v5p:4x4x4,v6e:4x4, "
        "and print the best per slice in one table, with why nothing fits where nothing "
        "does; not with --write (write the chosen slice's with --target)",
    )
    _max_memory_option(
        suggest,
        "device memory per device, e.g. 80GB or 75GiB (default with --target: the "
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
    suggest.add_argument(
        "--exhaustive",
        action="store_true",
        help="compile every candidate; by default those the estimates rule out (slower "
        "than the best by their estimate, or over the limit by their arguments alone) are "
        "listed with their estimated figures, not compiled",
    )
    suggest.add_argument(
        "--tolerance",
        type=_fraction,
        metavar="F",
        help="compile a candidate while its estimate is within this fraction of the best "
        "compiled one's (default 0.02); smaller is faster and riskier",
    )
    suggest.add_argument(
        "--strategies",
        type=_strategies,
        metavar="NAME,NAME,...",
        help="the strategies to try, e.g. 'fsdp,data x tensor' (default: every one: "
        f"{', '.join(STRATEGY_NAMES)}; a family the step gives nothing to split, such as "
        "expert parallel without stacked experts, makes no candidate)",
    )
    suggest.add_argument(
        "--verbose",
        action="store_true",
        help="show on stderr what the worker processes write there (XLA's warnings, the "
        "step's prints), and the progress as plain lines; by default it is kept from the "
        "output, and a candidate whose worker died is listed with the end of it",
    )
    _format_option(suggest)


def _fraction(text: str) -> float:
    """`--tolerance`: a fraction from 0 to below 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a fraction from 0 to below 1, such as 0.05"
        )
    return value


def _strategies(text: str) -> list[str]:
    """`--strategies`: names separated by commas (each checked by the generator)."""
    return [part.strip() for part in text.split(",")]


def _diff(add: _Add) -> None:
    diff = add(
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
        "--simulate",
        dest="devices",  # the request's count of simulated devices
        type=_layout_count,
        metavar="N",
        help="lay out (and with --step compile) on N simulated devices (default: A's "
        f'"devices", else B\'s, else 8); at most {MAX_SIMULATED} with --step',
    )
    on.add_argument(
        "--devices",
        action=_Renamed,
        new="--simulate",
        type=_layout_count,
        metavar="N",
        help="deprecated: --simulate N",
    )
    on.add_argument("--target", metavar="SLICE", help="a TPU slice, e.g. v5e:4x4: its device count")
    _format_option(diff)


def _schema(add: _Add) -> None:
    add("schema", help="print the JSON Schema of spec files")


_COMMANDS = (
    _show,
    _demo,
    _validate,
    _check,
    _explain,
    _suggest,
    _diff,
    _schema,
)  # in --help's order


def parser() -> argparse.ArgumentParser:
    """The `eqshard` command line's parser: `args.command` names the command,
    and `--traceback`, where given, is `args.traceback`."""
    common = _common()
    parser = _Parser(
        prog="eqshard",
        parents=[common],
        description="Declare, check and apply how an Equinox model is sharded.",
        epilog=(
            "Exit codes: 0 success; 1 a spec, expression or check is at fault; 2 bad "
            "usage, an unreadable file, the user's code (a model, step or batch that "
            "cannot be imported, built or compiled), or a bug in eqshard. An error in "
            "the user's code is printed with the user's frames (file, line and source "
            "line), eqshard's and JAX's left out; --traceback, or EQSHARD_TRACEBACK=1 "
            "in the environment, prints the whole Python traceback of any error."
        ),
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in _COMMANDS:
        command(functools.partial(commands.add_parser, parents=[common]))
    return parser
