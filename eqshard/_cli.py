"""The `eqshard` command line. Nothing imports this module but `__main__`.

Exit codes: 0 success, 1 a spec or expression is at fault, 2 bad usage or an
unreadable file. A user never sees a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ._errors import EqshardError

__all__ = ["main"]


def _use_devices(count: int | None) -> None:
    """Fixes the device count before JAX starts its backends.

    With `count`, JAX runs on `count` simulated CPU devices. Without it, JAX uses
    the accelerators that are present, or 8 simulated CPU devices when there are none.
    """
    import jax

    if count is not None:
        jax.config.update("jax_platforms", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", count or 8)


def _console():
    """A rich console; wide when writing to a file or pipe, so tables are not cut."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more")
    return value


def _size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def _show(args: argparse.Namespace) -> int:
    _use_devices(args.devices)
    import jax

    from ._expression import parse
    from ._picture import describe
    from ._sharding import sharding

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

    return demo(_console())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
        type=_positive,
        metavar="N",
        help="simulate N CPU devices (default: the devices present, or 8 CPU devices)",
    )
    show.set_defaults(run=_show)

    demo = commands.add_parser(
        "demo",
        help="shard a transformer block and train it one step",
        description=(
            "Build a transformer block from eqx.nn modules, place it tensor parallel "
            "with eqshard.apply, and check one eqx.filter_jit training step against "
            "the unsharded one. Without --devices it uses the accelerators present, or "
            "8 simulated CPU devices when there are none."
        ),
    )
    demo.add_argument("--devices", type=_positive, metavar="N", help="simulate N CPU devices")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line and returns its exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except EqshardError as error:
        print(f"eqshard {args.command}: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"eqshard {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
