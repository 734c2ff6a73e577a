"""Reading a spec file: `load`.

A spec file is data: loading one reads at most `MAX_BYTES` of UTF-8 JSON (a
repeated key or a `NaN` refused), checks it (`document_problems`, every fault at
once), and never imports a module or runs code. Nothing here imports JAX, so
`eqshard validate` in a pre-commit hook starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._errors import EqshardError, SpecError, UnreadableError
from .._expression import parse
from .._problems import Problem
from ._check import document_problems
from ._model import PARAMETER, BatchRules, Named, Rule, Rules

__all__ = ["MAX_BYTES", "is_regular", "load", "read_path"]

MAX_BYTES = 1 << 20
"""Spec files larger than this (1 MiB) are refused unread."""


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _cannot_read(name: str, message: str, headline: str = "unreadable") -> UnreadableError:
    return UnreadableError([Problem(name, message, file=name)], headline)


def _invalid(name: str, message: str, where: str | None = None) -> SpecError:
    return SpecError([Problem(where or name, message, file=name)], "invalid")


def is_regular(path: Path) -> bool:
    """Whether `path` is a regular file (following links); `False` where it is not
    there. Raises `OSError` and `ValueError` (a NUL byte) as `os.stat` does."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except FileNotFoundError:
        return False


def _read(path: Path, name: str) -> Any:
    try:
        regular = is_regular(path)
        if not regular and path.exists():
            raise _cannot_read(name, "it is not a regular file (a directory, pipe or device)")
        with path.open("rb") as file:
            data = file.read(MAX_BYTES + 1)
    except (OSError, ValueError) as error:
        if isinstance(error, UnreadableError):
            raise
        why = getattr(error, "strerror", None) or error
        raise _cannot_read(name, f"cannot read it: {why}") from None
    if len(data) > MAX_BYTES:
        raise _cannot_read(
            name, f"the file is over the {MAX_BYTES}-byte limit for spec files", "refused"
        )
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is allowed, and ignored
    except UnicodeDecodeError as error:
        raise _cannot_read(name, f"it is not UTF-8 (byte {error.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        where = f"{name}::line {error.lineno}, column {error.colno}"
        raise _invalid(name, f"invalid JSON: {error.msg}", where) from None
    except RecursionError:
        raise _invalid(name, "the JSON nests too deeply to read") from None
    except _DuplicateKey as error:
        message = f"the key {error.args[0]!r} appears twice in one object; keep one"
        raise _invalid(name, message) from None
    except ValueError as error:
        raise _invalid(name, str(error)) from None


def load(source: str | os.PathLike[str] | Mapping[str, Any]) -> Rules:
    """Loads and checks a spec file.

    **Example:**

    ```python
    rules = eqshard.load("model.eqshard.json")
    model = eqshard.apply(model, rules)
    ```

    **Arguments:**

    - `source`: a path to a JSON spec file (at most 1 MiB), or an already-parsed
        mapping. A spec file is data: loading it never imports or runs anything.

    **Returns:**

    An `eqshard.Rules`.

    **Raises:**

    - `eqshard.SpecError`: lists every fault at once, one line each, as
        `<file>::$.rules[2].expr: <message>`; broken JSON names its line and column.
    - `eqshard.UnreadableError` (a `SpecError`): the file cannot be read, is not UTF-8,
        or is over the size limit.
    """
    if isinstance(source, Mapping):
        name, document = "<mapping>", source
    elif isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        document = _read(Path(name), name)
    else:
        raise EqshardError(f"`eqshard.load` takes a path or a mapping, not {type(source).__name__}")
    try:
        problems = document_problems(document, name)
    except RecursionError:
        problems = [Problem(name, "the document nests too deeply to check")]
    if problems:
        raise SpecError(problems, f"{name} is not a valid eqshard spec")
    section = document.get("optimizer")
    optimizer = None
    if section is not None:
        optimizer = Rules(
            rules=_rules_of(section),
            default=section.get("default", PARAMETER),
            dims=dict(section.get("dims", {})),
            source=name,
            section="$.optimizer",
            comment=section.get("comment"),
        )
    return Rules(
        rules=_rules_of(document),
        default=document.get("default", "replicate"),
        devices=None if document.get("devices") is None else int(document["devices"]),
        dims=dict(document.get("dims", {})),
        logical_axis_rules=document.get("logical_axis_rules"),
        source=name,
        mesh=None
        if document.get("mesh") is None
        else tuple((n, None if size == "*" else int(size)) for n, size in document["mesh"]),
        batch=_batch_of(document.get("batch"), name),
        optimizer=optimizer,
        comment=document.get("comment"),
    )


def _batch_of(section: Any, name: str) -> Any:
    """A checked document's `"batch"`: an expression, `BatchRules`, or `None`."""
    if section is None or isinstance(section, str):
        return None if section is None else parse(section)
    return BatchRules(
        rules=_rules_of(section),
        default=section.get("default"),
        indivisible=section.get("indivisible", "error"),
        comment=section.get("comment"),
        source=name,
    )


def _rules_of(document: Mapping[str, Any]) -> tuple[Rule, ...]:
    """The `Rule`s of a checked document's (or optimizer section's) `"rules"`."""
    return tuple(
        Rule(
            rule["path"],
            rule["expr"] if "expr" in rule else Named(rule["dims"]),
            rule.get("comment"),
            i,
            rule.get("memory"),
        )
        for i, rule in enumerate(document.get("rules", []))
    )


def read_path(spec: Any) -> Any:
    """A spec as every function that lays something out takes it: a path
    (`pathlib.Path`, any `os.PathLike`) is its spec file's `Rules`, read by `load`;
    anything else is itself. A `str` is an expression, never a file name.

    **Raises:** `EqshardError` for a `str` that names a JSON file (saying to pass a
    `pathlib.Path`), or what `load` raises for a file that cannot be read.
    """
    if isinstance(spec, os.PathLike):
        return load(spec)
    if isinstance(spec, str) and spec.rstrip().endswith(".json"):
        raise EqshardError(
            f"the spec {spec!r} is a `str`, which eqshard reads as an einshard expression, "
            f"and it names a JSON file; pass a spec file as a `pathlib.Path` "
            f"(`Path({spec!r})`) or read it with `eqshard.load({spec!r})`"
        )
    return spec
