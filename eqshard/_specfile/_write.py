"""Writing a spec file: `dump`, `write_atomically`, and `check_writable`.

`dump` writes `Rules`, or a spec tree as rules, to a file that loads back to the
same layouts: what it would write is checked as `load` checks a file, and written
whole or not at all (`write_atomically`, which golden files use too, and which
writes through symbolic links). Its `"$schema"` points editors at the project's own
copy of the schema by a relative path (`schema_reference`); eqshard itself never
reads or fetches it. `dump` imports JAX only for a spec tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import stat
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._errors import EqshardError, SpecError
from .._expression import Expression, parse
from .._layout import device_count_of
from .._problems import Problem
from ._check import document_problems
from ._model import Rule, Rules
from ._read import is_regular
from ._schema import SCHEMA_FILE, SCHEMA_FOLDER

__all__ = ["check_writable", "dump", "schema_reference", "write_atomically"]


def dump(
    spec_or_rules: Any,
    path: str | os.PathLike[str],
    *,
    devices: int | None = None,
) -> None:
    """Writes a spec tree or `Rules` to a spec file that loads back to the same layouts.

    **Example:**

    ```python
    eqshard.dump(eqshard.spec_tree(model), "model.eqshard.json")
    ```

    **Arguments:**

    - `spec_or_rules`: an `eqshard.Rules`, a spec tree (see "Spec trees"), or an
        `eqshard.Plan` (see "Plans").
    - `path`: the file to write (see "The schema").
    - `devices`: the device count to record, if any (a `Rules` keeps its own).

    **Raises:**

    - `eqshard.SpecError`: a leaf of a spec tree holds something other than an
        expression, or the file would not load back.

    !!! info "Spec trees"

        The spec tree is as `eqshard.spec_tree` returns it, edited with `eqx.tree_at`,
        or a prefix of the model. Each expression becomes the rule `<its path>.**`. It
        matches the leaf, or every leaf of the subtree it stands for. `None` leaves are
        left to `"default": "replicate"`.

    !!! info "Plans"

        A plan is written as a rule per leaf, its path and its expression (a
        `PartitionSpec` leaf's, as `report` shows it), with the plan's mesh where it is
        the user's, and its device count. So a script of `PartitionSpec`s becomes a spec
        file of expressions.

    !!! info "The schema"

        The file's `"$schema"` is the project's copy of the schema, where there is one
        (`schema_reference`). So editors check the file without a network. Else the file
        has none.
    """
    if devices is not None:
        device_count_of(devices, "`devices`")
    if not isinstance(path, (str, os.PathLike)):
        raise EqshardError(f"`eqshard.dump` writes to a path, not {type(path).__name__}")
    if hasattr(type(spec_or_rules), "__eqshard_rules__"):  # a `Plan`: its expressions
        spec_or_rules = spec_or_rules.__eqshard_rules__()
    if isinstance(spec_or_rules, Rules):
        rules = spec_or_rules
        if devices is not None:
            rules = dataclasses.replace(rules, devices=devices)
    else:
        rules = _rules_of_spec_tree(spec_or_rules, devices)
    target = os.fspath(path)
    document = rules.to_json()
    reference = schema_reference(target)
    if reference is not None:
        document = {"$schema": reference, **document}
    problems = document_problems(document, target)
    if problems:
        raise SpecError(problems, f"not written: {target} would not load back")
    try:
        data = (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError as error:
        raise EqshardError(
            f"not written: {target} would hold text that is not valid UTF-8 "
            f"({error.object[error.start : error.end]!r}, a lone surrogate); fix that key "
            "or expression"
        ) from None
    write_atomically(Path(target), data)


def _rules_of_spec_tree(tree: Any, devices: int | None = None) -> Rules:
    """A spec tree as path rules: each expression becomes `<its path>.**` (keys
    quoted where they must be, as `leaf_name` writes them).

    **Raises:** `SpecError` naming each leaf that holds something other than an
    expression.
    """
    import jax  # a spec tree is a pytree: this needs JAX

    from .._fields import key_paths, leaf_name
    from .._paths._names import name, segments

    found: list[Rule] = []
    problems: list[Problem] = []
    # `None`s are empty subtrees: no leaves. Paths as eqshard names them (a state's
    # leaves by their layers, a `(model, state)` pair as one model).
    for key_path, leaf in zip(key_paths(tree), jax.tree_util.tree_leaves(tree)):
        if isinstance(leaf, (jax.sharding.PartitionSpec, jax.sharding.NamedSharding)):
            problems.append(
                Problem(
                    leaf_name(key_path),
                    f"a {'NamedSharding' if isinstance(leaf, jax.sharding.NamedSharding) else 'PartitionSpec'} is written as an expression on a mesh, for a "
                    "leaf's rank: dump the plan made with it, "
                    "`eqshard.dump(eqshard.plan(model, spec, mesh=mesh), path)`",
                )
            )
            continue
        if not isinstance(leaf, (str, Expression)):
            problems.append(
                Problem(leaf_name(key_path), f"{type(leaf).__name__} is not an expression")
            )
            continue
        # `**` also matches no segment: the rule covers the leaf, or the whole
        # subtree that a prefix spec gives one expression.
        path = f"{name(segments(key_path))}.**" if key_path else "**"
        found.append(Rule(path, parse(leaf), None, len(found)))
    if problems:
        raise SpecError(problems, "cannot write this spec as a spec file")
    return Rules(tuple(found), devices=devices)


def schema_reference(path: str | os.PathLike[str]) -> str | None:
    """The `"$schema"` of a spec file written at `path`: the project's copy of the
    schema, `schemas/eqshard.schema.json` in the file's folder or the nearest folder
    above it, as a path relative to the file (a URI reference, such as
    `../schemas/eqshard.schema.json`); `None` where there is none.

    The search stops at the repository's root (the first folder holding `.git`), so
    a committed file never points outside its repository. A project keeps a copy
    with `eqshard schema > schemas/eqshard.schema.json`.
    """
    folder = Path(os.path.abspath(path)).parent
    for above in (folder, *folder.parents):
        found = above / SCHEMA_FOLDER / SCHEMA_FILE
        if _there(found, stat.S_ISREG):
            try:
                relative = os.path.relpath(found, folder)
            except ValueError:  # another drive, on Windows: no relative path
                return None
            return urllib.parse.quote(Path(relative).as_posix())
        if _there(above / ".git"):
            return None
    return None


def _there(path: Path, kind: Callable[[int], bool] = bool) -> bool:
    """Whether `path` is there (and of `kind`, a test of its mode); `False` where it
    cannot be seen, such as in a folder the user may not read."""
    try:
        return kind(path.stat().st_mode)
    except (OSError, ValueError):
        return False


def check_writable(path: str | os.PathLike[str]) -> Path:
    """The file a spec file written at `path` lands in (through every link), once it
    is known that one can be: `path` is not empty, is not a directory, pipe or link
    that leads to itself, and its folder exists. Nothing is written. `write_atomically`
    checks the same; `eqshard suggest --write` checks it before compiling anything.

    **Raises:** `EqshardError` naming `path` and what is wrong with it.
    """
    name = os.fspath(path)
    if not name:
        raise EqshardError("not written: the path is empty: name a file, such as best.eqshard.json")
    try:
        target = Path(os.path.realpath(path))  # through every link, to the file itself
        if target.is_symlink():
            raise EqshardError(f"not written: {name} is a symbolic link that leads to itself")
        if target.exists() and not is_regular(target):
            raise EqshardError(f"not written: {name} is not a regular file (a directory or pipe)")
        if not target.parent.is_dir():
            raise EqshardError(
                f"not written: {name} is in a folder that does not exist ({target.parent}): "
                "create the folder first, or name a file in one that exists"
            )
    except (OSError, ValueError) as error:
        if isinstance(error, EqshardError):
            raise
        raise _cannot_write(name, error) from None
    return target


def _cannot_write(name: str, error: BaseException) -> EqshardError:
    """The operating system's refusal to write `name`, in its own words."""
    return EqshardError(f"cannot write {name}: {getattr(error, 'strerror', None) or error}")


def write_atomically(path: Path, data: bytes) -> None:
    """Writes `data` to a new file beside `path`, then renames it over `path`: the
    file is either the old one or the new one, whole, even on a full disk. Where
    `path` is a symbolic link, the file it points to is written (the new file is
    made in that file's folder), and the link stays a link."""
    name = os.fspath(path)
    target = check_writable(path)
    try:
        # Made with mode 0o666, which the kernel masks with the umask, as for any new
        # file (reading the umask would race with other threads).
        temporary = str(target.parent / f".{target.name}.{secrets.token_hex(8)}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except (OSError, ValueError) as error:
        if isinstance(error, EqshardError):
            raise
        raise _cannot_write(name, error) from None
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        if target.exists():
            os.chmod(temporary, stat.S_IMODE(target.stat().st_mode))
        os.replace(temporary, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise EqshardError(f"cannot write {name}: {error.strerror or error}") from None
