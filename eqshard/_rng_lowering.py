"""Random numbers without temporaries on CPU: JAX's unrolled threefry lowering.

JAX lowers its threefry hash as a rolled `while` loop on CPU (five iterations of
four rounds; it compiles faster) and unrolled everywhere else. The loop's state is
two `uint32` arrays the size of the output, double-buffered: about 3x the bytes of
every random array, alive at once (`temp_size_in_bytes` in the compiled program's
memory analysis). Unrolled, XLA fuses the hash into the elementwise loop that
writes the output, and the temporaries vanish; the values are the same bits, since
both lowerings compute the same function.

`unrolled_threefry()` lowers random arrays of `LARGE` elements and more with the
unrolled rule for the duration of a `with` block. Smaller ones (the keys that
`jax.random.split` makes) keep the rolled loop: they cost no memory to speak of,
and XLA 0.12 compiles chains of unrolled hashes (a key split, then a split of
that) very slowly (a small block took minutes). It swaps a rule in
JAX's private lowering table, so it is defensive: when that table or the primitive
is not where this JAX keeps them, it does nothing, which costs memory but never
changes a value. `tests/test_init.py` checks that it still takes effect. The table
is the process's: while the block runs, another thread's CPU `jit` lowers large
random arrays unrolled too, which changes no value either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["LARGE", "unrolled_threefry"]

LARGE = 64  # elements; `split(key, n)` hashes 2n
_LOCK = threading.RLock()


def _rules() -> tuple[dict[Any, Any], Any, Any] | None:
    """JAX's CPU lowering table, the threefry primitive, and its unrolled rule."""
    try:
        mlir = importlib.import_module("jax._src.interpreters.mlir")
        table = mlir._platform_specific_lowerings["cpu"]
        default = mlir._lowerings
    except (ImportError, AttributeError, KeyError, TypeError):
        return None
    for module in ("jax._src.random.threefry2x32", "jax._src.prng"):
        try:
            primitive = importlib.import_module(module).threefry2x32_p
        except (ImportError, AttributeError):
            continue
        if primitive in table and primitive in default:
            unrolled = getattr(default[primitive], "rule", None)
            if callable(unrolled) and dataclasses.is_dataclass(table[primitive]):
                return table, primitive, unrolled
    return None


@contextlib.contextmanager
def unrolled_threefry() -> Iterator[bool]:
    """Within the block, `jit` lowers threefry over `LARGE` elements or more
    unrolled on CPU, as it does on GPU and TPU. Yields whether the swap took effect.
    """
    with _LOCK:
        found = _rules()
        if found is None:
            yield False
            return
        table, primitive, unrolled = found
        rolled = table[primitive]

        def rule(ctx: Any, *args: Any, **params: Any) -> Any:
            large = math.prod(ctx.avals_out[0].shape) >= LARGE
            return (unrolled if large else rolled.rule)(ctx, *args, **params)

        table[primitive] = dataclasses.replace(rolled, rule=rule)
        try:
            yield True
        finally:
            table[primitive] = rolled
