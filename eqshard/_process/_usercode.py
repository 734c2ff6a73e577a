"""The user's code, named `MODULE:CALLABLE`: imported, called, and built abstractly.

The command line's `--model`, `--step`, `--make-batch` and `--optimizer`, `eqshard
suggest`'s and `diff`'s, and the harness's callables sent to its workers by name
all come here. This is the one place where eqshard imports user code, and only
because the user named it; a spec file never does. What the user's code raises is a
`ModelError` (exit code 2) naming the option and the callable, and what it prints
goes to stderr, so eqshard's own output (JSON, tables) stays clean.

The error the user's code raised stays the `ModelError`'s cause (`raise ... from
error`), and a note (`add_note`) names where, in the user's code, it was raised:
each of the user's frames as `file:line, in function` and its source line, with
eqshard's, the standard library's and installed packages' (JAX's) frames left out
(`user_frames`, `with_user_frames`). The note is text, so it survives a worker's
answer (`_workers.error_entry`), and the command line prints it under the message.
Where JAX is imported, eqshard's own frames are hidden from the tracebacks JAX
filters, as Equinox hides its own (`_compat.exclude_from_tracebacks`).

- `user_callable` imports the callable a `MODULE:CALLABLE` names (a dotted module
    or a `.py` file, each file imported once per `modules`), and `call` runs the
    user's code;
- `abstract_model` builds the model with `eqx.filter_eval_shape` (no device
    memory), and `step_inputs` the step's other arguments (`StepInputs`: the
    optimizer's state and the batch, abstract);
- `user_frames` is the text of the user's frames in an error or its causes, and
    `with_user_frames` adds it to an error as a note.

It imports JAX only when a model or a step is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
import re
import site
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .._compat import hide_eqshard_frames
from .._errors import EqshardError, ModelError

__all__ = [
    "MAX_FRAMES",
    "StepInputs",
    "abstract_model",
    "call",
    "step_inputs",
    "user_callable",
    "user_frames",
    "with_user_frames",
]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # eqshard itself
MAX_FRAMES = 10  # the user's frames a note shows, the innermost ones
_HEADER = "in the user's code (most recent call last):"
_Error = TypeVar("_Error", bound=BaseException)


if "jax" in sys.modules:  # else when this module first imports JAX
    hide_eqshard_frames()


@functools.cache
def _library_folders() -> tuple[str, ...]:
    """The folders whose frames are not the user's: eqshard's, the standard
    library's and every site-packages."""
    paths = sysconfig.get_paths()
    folders = {_PACKAGE, *(paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib"))}
    with contextlib.suppress(AttributeError):  # an old virtualenv's `site` has neither
        folders.update(site.getsitepackages())
        folders.add(site.getusersitepackages())
    return tuple(sorted({os.path.realpath(folder) for folder in folders if folder}))


@functools.lru_cache(maxsize=1024)
def _is_users(filename: str) -> bool:
    """Whether a frame's file is the user's: a real file (not `<frozen ...>` nor
    code made by `exec`) outside eqshard, the standard library and installed
    packages."""
    if not filename or (filename.startswith("<") and filename.endswith(">")):
        return False
    path = os.path.realpath(filename)
    if {"site-packages", "dist-packages"} & set(Path(path).parts):
        return False
    return not any(
        path == folder or path.startswith(folder + os.sep) for folder in _library_folders()
    )


def _causes(error: BaseException) -> Iterator[BaseException]:
    """`error`, then its cause, its cause's cause, and so on (`raise ... from`)."""
    seen: set[int] = set()
    each: BaseException | None = error
    while each is not None and id(each) not in seen:
        seen.add(id(each))
        yield each
        each = each.__cause__


def _places(error: BaseException) -> list[traceback.FrameSummary]:
    """The user's frames in `error`'s traceback below the first frame of a library
    (eqshard, JAX): the user's code eqshard called, not the user's code that called
    eqshard, outermost first; for a `SyntaxError` in the user's file, the line it
    points at last."""
    every = traceback.extract_tb(error.__traceback__)
    called = next((i for i, f in enumerate(every) if not _is_users(f.filename)), len(every))
    frames = [f for f in every[called:] if _is_users(f.filename)]
    if isinstance(error, SyntaxError):  # raised by the compiler: no frame of the user's
        filename, number = error.filename, error.lineno
        if filename and number and _is_users(filename):
            line = (error.text or "").strip("\n")
            frames.append(traceback.FrameSummary(filename, number, "", line=line))
    return frames


def user_frames(error: BaseException) -> str | None:
    """Where, in the user's code, `error` was raised, as a few lines of text: a
    header, then each of the user's frames as `file:line, in function` above its
    source line, innermost last (at most `MAX_FRAMES`, the innermost).

    The frames are those of the first of `error` and its causes (`__cause__`) that
    has any, below the first frame of eqshard or a library (the user's code they
    called, not the code that called them); frames of eqshard, of the standard
    library and of installed packages (JAX, Equinox) are left out. `None` where no
    error of the chain passed through the user's code.
    """
    for each in _causes(error):
        frames = _places(each)
        if not frames:
            continue
        lines = [_HEADER]
        if len(frames) > MAX_FRAMES:
            lines.append(f"  ... {len(frames) - MAX_FRAMES} outer frames of the user's code")
            frames = frames[-MAX_FRAMES:]
        for frame in frames:
            lines.append(
                f"  {frame.filename}:{frame.lineno}" + f", in {frame.name}" * bool(frame.name)
            )
            if frame.line:
                lines.append(f"    {frame.line.strip()}")
        return "\n".join(lines)
    return None


def with_user_frames(error: _Error, cause: BaseException | None = None) -> _Error:
    """`error`, with `user_frames` of `cause` (by default of `error` and its causes)
    added as a note, unless there are none or it has that note already."""
    text = user_frames(error if cause is None else cause)
    if text is not None and text not in getattr(error, "__notes__", ()):
        error.add_note(text)
    return error


def _import_user_module(
    target: str, module_name: str, option: str = "--model", modules: dict[str, Any] | None = None
) -> Any:
    """Imports the user's module: a dotted name, or a `.py` file whose folder is
    appended to `sys.path` (so its sibling modules import, and never shadow the
    standard library). A file already in `modules` is not run again."""
    try:
        if not (module_name.endswith(".py") or "/" in module_name or os.sep in module_name):
            return importlib.import_module(module_name)
        path = Path(module_name)
        if not path.is_file():
            raise ModelError(f"{option} {target!r}: there is no file {module_name!r}")
        if path.suffix != ".py":
            raise ModelError(
                f"{option} {target!r}: {module_name!r} is not a Python file; name a .py "
                "file or a dotted module"
            )
        key = str(path.resolve())
        if modules is not None and key in modules:
            return modules[key]
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.append(folder)
        name = f"_eqshard_model_{path.stem}"  # never shadows a module such as `json`
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ModelError(f"{option} {target!r}: cannot load {module_name!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        if modules is not None:
            modules[key] = module
        return module
    except EqshardError:
        raise
    except KeyboardInterrupt:
        raise
    except ImportError as error:
        raised = ModelError(f"{option} {target!r}: cannot import {module_name!r}: {error}")
        raise with_user_frames(raised, error) from error
    except BaseException as error:  # the user's module failed: report, don't crash
        raised = ModelError(
            f"{option} {target!r}: importing {module_name!r} raised {type(error).__name__}: {error}"
        )
        raise with_user_frames(raised, error) from error


def user_callable(
    target: str, option: str, example: str, returns: str, modules: dict[str, Any] | None
) -> tuple[str, Callable[..., Any]]:
    """The callable `MODULE:CALLABLE` names, with its name; its module imported
    with stdout sent to stderr."""
    module_name, sep, attribute = target.rpartition(":")
    if not sep or not module_name or not attribute:
        raise ModelError(
            f"{option} {target!r}: write MODULE:CALLABLE, e.g. 'mypkg.model:{example}' or "
            f"'model.py:{example}', where {returns}"
        )
    # The user's code may print: keep stdout for eqshard's own output (JSON, tables).
    with contextlib.redirect_stdout(sys.stderr):
        module = _import_user_module(target, module_name, option, modules)
    factory: Any = module
    for name in attribute.split("."):  # a qualname: `Factory.build` names a method
        factory = getattr(factory, name, None)
    if not callable(factory):
        raise ModelError(f"{option} {target!r}: {module_name} has no callable {attribute!r}")
    return attribute, factory


def call(
    option: str,
    target: str,
    what: str,
    fn: Callable[[], Any],
    keep: tuple[type[BaseException], ...] = (),
) -> Any:
    """`fn()`, with what the user's code raises (but `keep`) as a `ModelError`, and
    what it prints on stderr.

    **Raises:** `ModelError` naming `option`, `target` and `what` raised what,
    caused by it (`__cause__`) and noting where in the user's code
    (`with_user_frames`).
    """
    with contextlib.redirect_stdout(sys.stderr):
        try:
            return fn()
        except KeyboardInterrupt:
            raise
        except keep:
            raise
        except BaseException as error:  # the user's code failed: report, don't crash
            raised = ModelError(
                f"{option} {target!r}: {what} raised {type(error).__name__}: {error}"
            )
            raise with_user_frames(raised, error) from error


def abstract_model(target: str, *, modules: dict[str, Any] | None = None) -> Any:
    """Builds `MODULE:CALLABLE` abstractly. MODULE is a dotted module name or a `.py` file.

    With `step_inputs`, this is the one place where eqshard imports user code, and
    only because the user named it on the command line; a spec file never does. A
    `.py` file in
    `modules` (imported by an earlier call given the same dictionary) is not run again.
    """
    attribute, factory = user_callable(
        target, "--model", "build", "CALLABLE() returns the model", modules
    )
    import equinox as eqx
    import jax

    hide_eqshard_frames()
    model = call("--model", target, f"{attribute}()", lambda: eqx.filter_eval_shape(factory))
    if not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree_util.tree_leaves(model)):
        raise ModelError(
            f"--model {target!r}: {attribute}() returned {type(model).__name__}, which holds "
            "no arrays; name a callable that builds the model"
        )
    return model


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The user's training step and the arguments after the model, abstract:
    `(opt_state, batch)` with an optimizer, else `(batch,)`; for a stateful model
    (`--model` builds `(model, state)`), `(state, opt_state, batch)` or
    `(state, batch)`. `target` is the `--step` text, for messages."""

    step: Callable[..., Any]
    args: tuple[Any, ...]
    target: str


def step_inputs(
    model: Any,
    step: str,
    batch: str,
    optimizer: str | None = None,
    *,
    modules: dict[str, Any] | None = None,
) -> StepInputs:
    """Imports `--step`, `--make-batch` and `--optimizer` (each `MODULE:CALLABLE`, as
    for `abstract_model`) and builds the batch and the optimizer's state of the
    abstract `model` abstractly (no device memory). A `batch()` that needs concrete
    values (`np.asarray` of a JAX array) is run once on the host instead. For a
    stateful model, `(model, state)`, the optimizer's state is built from the
    model's parameters, and the step takes the state after the model."""
    from .._fields import is_stateful_pair

    hide_eqshard_frames()
    _, fn = user_callable(
        step,
        "--step",
        "step",
        "CALLABLE is the training step, step(model, opt_state, batch)",
        modules,
    )
    name, make_batch = user_callable(
        batch, "--make-batch", "batch", "CALLABLE() returns the step's batch", modules
    )
    batch_value = _abstract_batch(batch, name, make_batch)
    stateful = is_stateful_pair(model)
    states: tuple[Any, ...] = (model[1],) if stateful else ()
    args: tuple[Any, ...] = (*states, batch_value)
    if optimizer is not None:
        name, make = user_callable(
            optimizer, "--optimizer", "optimizer", "CALLABLE() returns an optax optimizer", modules
        )
        opt = call("--optimizer", optimizer, f"{name}()", make)
        init = getattr(opt, "init", None)
        if not callable(init):
            raise ModelError(
                f"--optimizer {optimizer!r}: {name}() returned {type(opt).__name__}, which has "
                "no init; name a callable that returns an optax optimizer"
            )
        parameters = model[0] if stateful else model
        state = _optimizer_state(
            StepInputs(fn, (*states, batch_value), step), parameters, optimizer, name, init
        )
        args = (*states, state, batch_value)
    return StepInputs(fn, args, step)


# What JAX says of two trees whose structures differ (`jax.tree.map`, optax's updates).
_STRUCTURE = re.compile(
    r"pytree|tree structure|mismatch|is not a prefix|expected (none|list|tuple|dict), got", re.I
)


def _optimizer_state(
    step: StepInputs, model: Any, optimizer: str, name: str, init: Callable[..., Any]
) -> Any:
    """The optimizer's state, abstract, as the step takes it: `init` of the model's
    arrays (`eqx.filter(model, eqx.is_array)`, as Equinox's examples build it), or,
    where the model holds arrays that are not inexact (an int counter, a bool mask:
    `eqx.filter_grad` gives them no gradient, so an optax state built for them does
    not fit the gradients), of its inexact arrays (`eqx.is_inexact_array`). There
    the step is traced abstractly with each state, in that order, and the first it
    does not refuse for a tree's structure is used; what else it raises, compiling
    it says. `step.args` are the step's other arguments: the model's state, if any,
    and the batch.

    **Raises:** `ModelError` naming `--optimizer` where the step refuses both, or
    `init` raises.
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    def abstract(x: Any) -> bool:
        return isinstance(x, jax.ShapeDtypeStruct)

    def inexact(x: Any) -> bool:
        return abstract(x) and jnp.issubdtype(x.dtype, jnp.inexact)

    arrays = eqx.filter(model, abstract)
    kinds = [("eqx.is_array", arrays)]
    if not all(map(inexact, jax.tree_util.tree_leaves(arrays))):
        kinds.append(("eqx.is_inexact_array", eqx.filter(model, inexact)))
    *states, batch = step.args
    made, refused = [], []
    for kind, params in kinds:
        made.append(f"`{name}().init(eqx.filter(model, {kind}))`")
        state = call(
            "--optimizer", optimizer, made[-1], functools.partial(jax.eval_shape, init, params)
        )
        if len(kinds) == 1:  # every array is inexact: one state
            return state
        error = _raised(step.step, model, *states, state, batch)
        if error is None or not _STRUCTURE.search(str(error)):
            return state
        refused.append(f"{type(error).__name__}: {_brief(error)}")
    raised = (
        f"with each it raised {refused[0]}"
        if refused[0] == refused[1]
        else f"with the first it raised {refused[0]}; with the second, {refused[1]}"
    )
    raise ModelError(
        f"--optimizer {optimizer!r}: the step {step.target!r} takes neither optimizer state "
        f"eqshard builds, {made[0]} nor {made[1]}: {raised}\nwrite the step to update the "
        "parameters of one of them, as `optimizer.update(grads, opt_state, eqx.filter(model, "
        "eqx.is_inexact_array))` with `grads` from `eqx.filter_grad`"
    )


def _raised(fn: Callable[..., Any], *args: Any) -> BaseException | None:
    """What `fn(*args)` raises when traced abstractly (nothing is compiled nor run),
    if anything; what it prints goes to stderr."""
    import equinox as eqx

    with contextlib.redirect_stdout(sys.stderr):
        try:
            eqx.filter_eval_shape(fn, *args)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # the user's code: said, never a crash
            return error
    return None


def _brief(error: BaseException, limit: int = 400) -> str:
    """An error's message on one line, cut at `limit` characters."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _abstract_batch(target: str, name: str, make_batch: Callable[[], Any]) -> Any:
    """`make_batch()`, abstract: traced with `eqx.filter_eval_shape` (no memory), or,
    where it needs concrete values (`np.asarray` of a JAX array, a Python `if` on
    one), run once on the host and its arrays made abstract."""
    import equinox as eqx
    import jax

    needs_values = (
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerArrayConversionError,
        jax.errors.TracerIntegerConversionError,
        jax.errors.NonConcreteBooleanIndexError,
    )
    try:
        return call(
            "--make-batch",
            target,
            f"{name}()",
            lambda: eqx.filter_eval_shape(make_batch),
            needs_values,
        )
    except needs_values:
        pass
    try:
        host = jax.devices("cpu")[0]
    except RuntimeError:  # JAX started without its CPU backend: its default device
        host = jax.devices()[0]
    with jax.default_device(host):
        value = call(
            "--make-batch",
            target,
            f"{name}() (run on the host, as it needs concrete values: it calls NumPy on a "
            "JAX array, or branches on one)",
            make_batch,
        )
    return eqx.filter_eval_shape(lambda value: value, value)
