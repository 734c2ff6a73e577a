"""The one place eqshard reads JAX's or Equinox's internals.

Each accessor either returns what it was asked for or raises an `EqshardError`
that names the JAX (or Equinox) version and what was not where eqshard looks for
it: never a default that would make a figure or a layout silently wrong. Where a
caller has a fallback that keeps every value right (the CPU random-number
lowering, the jaxpr tools `init` uses to choose it), it catches the error and warns
with a `VersionWarning`, once per process.

`tests/test_compat.py` checks every accessor on the installed JAX, and
`tests/test_layers.py` that no other module names `jax._src` or an Equinox private.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ._errors import EqshardError
from ._warnings import VersionWarning, warn

__all__ = [
    "LARGE",
    "MemoryStats",
    "VersionWarning",
    "backends_started",
    "dce_jaxpr",
    "exclude_from_tracebacks",
    "filter_jit_compile",
    "filter_jit_donation",
    "filter_jit_lower",
    "hide_eqshard_frames",
    "is_transposed",
    "memory_stats",
    "missing",
    "module_cost_analysis",
    "param",
    "sharding_type_error",
    "subjaxprs",
    "unrolled_threefry",
    "version",
]


def version(package: str = "jax") -> str:
    """The installed version of `package`, as `importlib.metadata` has it."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a checkout
        module = importlib.import_module(package)
        return str(getattr(module, "__version__", "unknown"))


def missing(what: str, package: str = "jax") -> EqshardError:
    return EqshardError(
        f"eqshard cannot read {what} on {package} {version(package)}: it is not where "
        f"eqshard looks for it. Install a {package} version eqshard supports "
        "(pyproject.toml's bounds), or report this with the version."
    )


_WARNED: set[str] = set()


def warn_once(error: EqshardError, fallback: str) -> None:
    """Warns once per process that `error`'s internal is missing and what eqshard
    does instead."""
    text = f"{error} Meanwhile eqshard {fallback}."
    if text not in _WARNED:
        _WARNED.add(text)
        warn([VersionWarning(f"jax {version()}", text)])


# JAX's runtime ---------------------------------------------------------------------


def backends_started() -> bool:
    """Whether JAX has started its backends, after which the device count is fixed.

    **Raises:** `EqshardError` where this JAX keeps no `backends_are_initialized`.
    """
    try:
        bridge = importlib.import_module("jax._src.xla_bridge")
        started = bridge.backends_are_initialized
    except (ImportError, AttributeError):
        raise missing("whether its backends have started (xla_bridge)") from None
    return bool(started())


def exclude_from_tracebacks(path: str) -> None:
    """Hides the frames of the files under `path` from the tracebacks JAX filters,
    as Equinox hides its own (`jax._src.traceback_util.register_exclusion`).

    **Raises:** `EqshardError` where this JAX keeps no `register_exclusion`.
    """
    try:
        util = importlib.import_module("jax._src.traceback_util")
        register = util.register_exclusion
    except (ImportError, AttributeError):
        raise missing("its traceback filter (traceback_util.register_exclusion)") from None
    register(path)


def sharding_type_error() -> type[Exception]:
    """JAX's error for an operation that a mesh's Explicit axes cannot type, such as a
    matmul that contracts a split dim with no `out_sharding` (`core.ShardingTypeError`).

    **Raises:** `EqshardError` where this JAX keeps it elsewhere.
    """
    try:
        found = importlib.import_module("jax._src.core").ShardingTypeError
    except (ImportError, AttributeError):
        raise missing("its error for Explicit axes (core.ShardingTypeError)") from None
    return found


@functools.cache
def hide_eqshard_frames() -> None:
    """Hides eqshard's own frames from the tracebacks JAX filters, as Equinox hides
    its own, once per process: a user whose step fails inside `eqshard.jit` sees
    their own file and line, not eqshard's. A JAX that keeps no traceback filter is
    warned of once, and the frames stay."""
    try:
        exclude_from_tracebacks(os.path.dirname(os.path.abspath(__file__)))
    except EqshardError as error:
        warn_once(error, "shows its own frames in JAX's tracebacks")


# Equinox ---------------------------------------------------------------------------


def filter_jit_donation(step: Any) -> tuple[bool, bool] | None:
    """Whether an `eqx.filter_jit` step donates its first argument and the rest;
    `None` for anything that is not one.

    **Raises:** `EqshardError` for an `eqx.filter_jit` step whose donation is not
    where this Equinox kept it.
    """
    import equinox as eqx

    wrapper: Any = type(eqx.filter_jit(_identity))
    if not isinstance(step, wrapper):
        return None
    try:
        return bool(step.donate_first), bool(step.donate_rest)
    except AttributeError:
        raise missing("an eqx.filter_jit step's donation", "equinox") from None


def _identity(x: Any) -> Any:
    return x


def filter_jit_lower(step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What `step.lower(*args, **kwargs)` gives for an `eqx.filter_jit` step, Equinox's
    `Lowered` (whose `compile()` gives Equinox's compiled step), with each
    `jax.ShapeDtypeStruct` among the arguments traced as an array of its shape, dtype
    and sharding, as `jax.jit(...).lower` traces one: Equinox's own `lower` holds it
    static. The arguments go through Equinox's own preprocessing, each abstract leaf
    standing in for itself as an empty NumPy array, swapped back before lowering.

    **Raises:** `EqshardError` where this Equinox keeps a step's preprocessing, its
    `jax.jit` or its `Lowered` elsewhere.
    """
    import jax
    import numpy as np

    stand_ins: dict[int, tuple[Any, Any]] = {}

    def stand_in(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        held = np.empty((0,), np.int8)  # an array to Equinox: traced
        stand_ins[id(held)] = (held, x)
        return held

    def back(x: Any) -> Any:
        found = stand_ins.get(id(x))
        return found[1] if found is not None and found[0] is x else x

    args, kwargs = jax.tree_util.tree_map(stand_in, (args, kwargs))
    try:
        jit = importlib.import_module("equinox._jit")
        lowered_type = importlib.import_module("equinox._compile_utils").Lowered
        preprocess, postprocess = jit._preprocess, jit._postprocess
        info = (
            step._signature,
            step._dynamic_fun,
            step._static_fun,
            step.donate_first,
            step.donate_rest,
        )
        cached = step._cached
    except (ImportError, AttributeError):
        raise missing("how an eqx.filter_jit step lowers", "equinox") from None
    donated, kept, static = preprocess(info, args, kwargs, return_static=True)
    donated, kept = jax.tree_util.tree_map(back, (donated, kept))
    return lowered_type(cached.lower(donated, kept, static), info, preprocess, postprocess)


def filter_jit_compile(lowered: Any, options: dict[str, Any] | None) -> Any:
    """Equinox's `Lowered` compiled, with XLA's `options` for this compile where any:
    Equinox before 0.13.2 takes none in its `compile()`, so there the JAX program it
    holds is compiled with them and wrapped as Equinox wraps it.

    **Raises:** `EqshardError` where this Equinox keeps its `Compiled` elsewhere.
    """
    if not options:
        return lowered.compile()
    try:
        return lowered.compile(options)
    except TypeError:  # Equinox 0.13.1: `compile(self)`
        try:
            compiled_type = importlib.import_module("equinox._compile_utils").Compiled
            inner = lowered.lowered.compile(compiler_options=options)
            return compiled_type(inner, lowered.info, lowered.preprocess, lowered.postprocess)
        except (ImportError, AttributeError):
            raise missing("how a lowered eqx.filter_jit step compiles", "equinox") from None


# The compiler's memory analysis ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """A compiled program's memory analysis, in bytes per device. `peak` is `None`
    where the compiler does not report one (XLA:CPU before JAX 0.9)."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    host_arguments: int
    host_outputs: int
    host_aliased: int
    peak: int | None


_REQUIRED = {
    "arguments": "argument_size_in_bytes",
    "outputs": "output_size_in_bytes",
    "aliased": "alias_size_in_bytes",
    "temporaries": "temp_size_in_bytes",
    "host_arguments": "host_argument_size_in_bytes",
    "host_outputs": "host_output_size_in_bytes",
    "host_aliased": "host_alias_size_in_bytes",
}


def module_cost_analysis(compiled: Any) -> dict[str, Any]:
    """XLA's HLO cost analysis of a compiled program's optimized module, for a compiler
    that reports none of its own (XLA:GPU compiling without a GPU answers
    `GetCostAnalysis is not supported`): the same `HloCostAnalysis`, run by the CPU
    client over the accelerator's module (`_jax.hlo_module_cost_analysis`).

    **Raises:** `EqshardError` where this JAX keeps no such function, or the compiled
    program no module.
    """
    try:
        bridge = importlib.import_module("jax._src.xla_bridge")
        analyse = importlib.import_module("jax._src.lib")._jax.hlo_module_cost_analysis
        modules = compiled.runtime_executable().hlo_modules()
    except (ImportError, AttributeError):
        raise missing("its HLO cost analysis (_jax.hlo_module_cost_analysis)") from None
    found = analyse(bridge.get_backend("cpu"), modules[0])
    if isinstance(found, list):
        found = found[0] if found else {}
    return dict(found or {})


def memory_stats(analysis: Any) -> MemoryStats:
    """`compiled.memory_analysis()` as `MemoryStats`.

    **Raises:** `EqshardError` where the compiler gave no analysis, or one without
    a field eqshard reads (the peak may be missing: it is then unknown).
    """
    if analysis is None:
        raise EqshardError(
            f"the compiler gave no memory analysis (jax {version()}): eqshard cannot "
            "know this program's memory."
        )
    values: dict[str, int] = {}
    for name, field in _REQUIRED.items():
        value = getattr(analysis, field, None)
        if value is None:
            raise missing(f"the compiler's memory analysis field `{field}`")
        values[name] = int(value)
    peak = getattr(analysis, "peak_memory_in_bytes", None)
    return MemoryStats(**values, peak=None if peak is None else int(peak))


# Jaxprs ----------------------------------------------------------------------------


def param(eqn: Any, key: str) -> Any:
    """The parameter `key` of a jaxpr equation.

    **Raises:** `EqshardError` naming the primitive and this JAX where it has none.
    """
    params = getattr(eqn, "params", None)
    if not isinstance(params, Mapping) or key not in params:
        name = getattr(getattr(eqn, "primitive", None), "name", repr(eqn))
        raise missing(f"the `{key}` parameter of a `{name}` equation")
    return params[key]


def is_transposed(eqn: Any) -> bool:
    """Whether a jaxpr equation belongs to a gradient's transposed computation (JAX
    writes `transpose(...)` into the name stack of those).

    **Raises:** `EqshardError` where this JAX's equations carry no name stack.
    """
    try:
        stack = eqn.source_info.name_stack
    except AttributeError:
        raise missing("a jaxpr equation's name stack") from None
    return "transpose(" in str(stack)


def dce_jaxpr(jaxpr: Any) -> Any:
    """`jaxpr` without the equations its outputs do not need.

    **Raises:** `EqshardError` where this JAX keeps no `dce_jaxpr`.
    """
    try:
        pe = importlib.import_module("jax._src.interpreters.partial_eval")
        dce: Callable[..., tuple[Any, Any]] = pe.dce_jaxpr
    except (ImportError, AttributeError):
        raise missing("its jaxpr dead-code eliminator (partial_eval.dce_jaxpr)") from None
    pruned, _ = dce(jaxpr, [True] * len(jaxpr.outvars))
    return pruned


def subjaxprs(jaxpr: Any) -> Iterator[Any]:
    """The jaxprs nested in `jaxpr`'s equations (a `scan`'s body, a `cond`'s branches).

    **Raises:** `EqshardError` where this JAX keeps no `core.subjaxprs`.
    """
    try:
        core = importlib.import_module("jax._src.core")
        nested: Callable[[Any], Iterator[Any]] = core.subjaxprs
    except (ImportError, AttributeError):
        raise missing("the jaxprs nested in a jaxpr (core.subjaxprs)") from None
    return nested(jaxpr)


# Random numbers without temporaries on CPU -----------------------------------------
#
# JAX lowers its threefry hash as a rolled `while` loop on CPU (five iterations of
# four rounds; it compiles faster) and unrolled everywhere else. The loop's state is
# two `uint32` arrays the size of the output, double-buffered: about 3x the bytes of
# every random array, alive at once (`temp_size_in_bytes`). Unrolled, XLA fuses the
# hash into the elementwise loop that writes the output, and the temporaries vanish;
# the values are the same bits, since both lowerings compute the same function.
#
# Random arrays of `LARGE` elements and more are lowered unrolled within
# `unrolled_threefry()`. Smaller ones (the keys `jax.random.split` makes) keep the
# rolled loop: they cost no memory to speak of, and XLA 0.12 compiles chains of
# unrolled hashes (a key split, then a split of that) very slowly. The table is the
# process's: while the block runs, another thread's CPU `jit` lowers large random
# arrays unrolled too, which changes no value either.

LARGE = 64  # elements; `split(key, n)` hashes 2n
_THREEFRY = ("jax._src.random.threefry2x32", "jax._src.prng")  # where JAX has kept it
_LOCK = threading.RLock()


def _threefry_rules() -> tuple[dict[Any, Any], Any, Any]:
    """JAX's CPU lowering table, the threefry primitive, and its unrolled rule."""
    try:
        mlir = importlib.import_module("jax._src.interpreters.mlir")
        table = mlir._platform_specific_lowerings["cpu"]
        default = mlir._lowerings
    except (ImportError, AttributeError, KeyError, TypeError):
        raise missing("its CPU lowering table (mlir._platform_specific_lowerings)") from None
    for module in _THREEFRY:
        try:
            primitive = importlib.import_module(module).threefry2x32_p
        except (ImportError, AttributeError):
            continue
        if primitive in table and primitive in default:
            unrolled = getattr(default[primitive], "rule", None)
            if callable(unrolled) and dataclasses.is_dataclass(table[primitive]):
                return table, primitive, unrolled
    raise missing("the threefry primitive's CPU lowering rules")


def unrolled_threefry() -> contextlib.AbstractContextManager[None]:
    """A context within which `jit` lowers threefry over `LARGE` elements or more
    unrolled on CPU, as it does on GPU and TPU.

    **Raises:** `EqshardError`, when called rather than when entered, where this JAX
    keeps its lowering rules elsewhere.
    """
    return _swapped(*_threefry_rules())


@contextlib.contextmanager
def _swapped(table: dict[Any, Any], primitive: Any, unrolled: Any) -> Iterator[None]:
    with _LOCK:
        rolled = table[primitive]

        def rule(ctx: Any, *args: Any, **params: Any) -> Any:
            large = math.prod(ctx.avals_out[0].shape) >= LARGE
            return (unrolled if large else rolled.rule)(ctx, *args, **params)

        table[primitive] = dataclasses.replace(rolled, rule=rule)
        try:
            yield
        finally:
            table[primitive] = rolled
