"""What crosses into the harness's worker processes: callables by name, specs by
file or by pickle.

Each device count runs in a fresh process, which imports the user's `build`,
`loss`, `batch` and `optimizer` again, so each must be importable by name:
`module:qualname`, or `path/to/file.py:qualname`. A function defined where no new
process can find it (inside another function, in `__main__`, in a test module that
pytest imported with `--import-mode=importlib`) is refused here, with the fix.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from pathlib import Path
from typing import Any

from .._errors import EqshardError
from .._process._pickles import pickled
from .._specfile._read import read_path

__all__ = ["callable_reference", "spec_reference"]


def callable_reference(obj: Any, what: str) -> str:
    """`obj` as `module:qualname` (or `file.py:qualname`), checked importable by
    that name from a new process.

    **Arguments:**

    - `obj`: a callable, or its reference as a string (`"mypkg.model:build"`,
        `"models/gpt.py:build"`), which is taken as written.
    - `what`: the argument's name, for messages (`"build"`).

    **Raises:**

    `eqshard.EqshardError` saying why a new process cannot import it, and how to
    name it instead.
    """
    if isinstance(obj, str):
        module, sep, name = obj.rpartition(":")
        if not (sep and module and name):
            raise EqshardError(
                f"`{what}={obj!r}`: write MODULE:CALLABLE, e.g. 'mypkg.model:{what}' or "
                f"'models/model.py:{what}'"
            )
        return obj
    if not callable(obj):
        raise EqshardError(
            f"`{what}` must be a callable or its 'module:qualname', not {type(obj).__name__}"
        )
    if isinstance(obj, functools.partial):
        raise EqshardError(
            f"`{what}` is a functools.partial, which a new process cannot import by name; "
            f"define a top-level function that calls it, and pass that (or 'mypkg.model:{what}')"
        )
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    label = f"`{what}` ({module}:{qualname})"
    fix = (
        f"each device count runs in a new process, which imports `{what}` by name: define "
        f"it at the top level of an importable module and pass it (or 'mypkg.model:{what}'), "
        f"or pass 'path/to/file.py:{what}'"
    )
    if not module or not qualname or "<" in qualname:
        raise EqshardError(f"{label} is defined inside a function or is a lambda; {fix}")
    if module == "__main__":
        raise EqshardError(f"{label} is defined in the script being run (`__main__`); {fix}")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    origin = found.origin if found is not None else None
    source = _source_file(obj)
    if origin is None or (source is not None and not _same_file(origin, source)):
        where = f" from {source}" if source else ""
        raise EqshardError(
            f"{label}: a new process cannot import module {module!r}{where} by that name "
            "(pytest's --import-mode=importlib imports test modules under names no other "
            f"process can import); {fix}"
        )
    return f"{module}:{qualname}"


def _source_file(obj: Any) -> str | None:
    try:
        return inspect.getsourcefile(inspect.unwrap(obj))
    except (TypeError, ValueError):
        return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def spec_reference(spec: Any) -> dict[str, str]:
    """`spec` as the worker's request carries it: `{"file": PATH}` for a spec file's
    path, else `{"pickle": BASE64}` (an expression, `Rules`, `FROM_FIELDS`, a spec
    tree of picklable leaves), as `eqshard._process._pickles.pickled` writes it.

    **Raises:**

    `eqshard.EqshardError` for a `Plan` (it holds this process's devices) and for a
    spec that cannot be pickled.
    """
    if isinstance(spec, os.PathLike):
        return {"file": str(Path(spec).resolve())}
    read_path(spec)  # a `str` that names a file is refused, as everywhere
    if type(spec).__name__ == "Plan" and type(spec).__module__ == "eqshard._plan":
        raise EqshardError(
            "`spec` is a `Plan`, which holds this process's devices and cannot cross into "
            "the worker processes; pass the spec the plan was made from (a spec file as a `pathlib.Path`, "
            "`Rules`, an expression, `eqshard.resolvers.FROM_FIELDS`)"
        )
    fix = "pass a spec file as a `pathlib.Path`, `Rules`, an expression or `eqshard.resolvers.FROM_FIELDS`"
    return {"pickle": pickled(spec, "`spec`", fix)}
