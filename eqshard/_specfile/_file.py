"""The spec-file layer: the schema, reading, `load` and `dump`. It imports no JAX.

A spec file is data: loading one parses JSON and checks it, and never imports a
module or runs code. The schema (`schemas/eqshard.schema.json`, also shipped in
the package) is checked with jsonschema first; then every expression is parsed,
so each fault is reported as `<file>::<JSON path>: <message>`, all at once.
Because nothing here imports JAX, `eqshard validate` in a pre-commit hook starts
in a fraction of a second. How rules resolve against a model is `_rules.py`, which
knows them by their shape and imports nothing from here: `Rules.match` and
`Rules.__eqshard_resolve__` import it when called, and `dump` imports JAX only for
a spec tree.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.resources
import json
import math
import os
import re
import secrets
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from .._errors import (
    EqshardError,
    ExpressionError,
    PathError,
    Problem,
    SpecError,
    UnreadableError,
    in_file,
    whole_number,
)
from .._expression import Expression, parse
from .._fit import MeshShape
from .._fsdp import FSDP, FSDP_WORD
from .._paths._grammar import parse as parse_path

if TYPE_CHECKING:
    from .._protocol import Resolution, Target
    from .._rules import Match

__all__ = [
    "MAX_BYTES",
    "MEMORY_KINDS",
    "PARAMETER",
    "VERSION",
    "Rule",
    "Rules",
    "batch_expression",
    "document_problems",
    "dump",
    "load",
    "schema",
    "write_atomically",
]

PARAMETER = "parameter"
"""The optimizer section's default: each state leaf takes its parameter's layout."""

MAX_BYTES = 1 << 20
"""Spec files larger than this (1 MiB) are refused unread."""

VERSION = 1
"""The format version this eqshard reads and writes."""


@functools.cache
def _schema() -> dict[str, Any]:
    text = importlib.resources.files("eqshard").joinpath("eqshard.schema.json").read_text("utf-8")
    return json.loads(text)


def schema() -> dict[str, Any]:
    """The JSON Schema (Draft 2020-12) of eqshard spec files, as a new dict.

    **Example:** `json.dumps(eqshard.schema())`, or `eqshard schema` on the command line.
    """
    return copy.deepcopy(_schema())


@functools.cache
def _validator() -> Draft202012Validator:
    return Draft202012Validator(_schema())


@dataclasses.dataclass(frozen=True)
class Rule:
    """One path rule of a spec file.

    - `path`: a rule path (`blocks.*.attn.query_proj.weight`, `**.*_proj.weight`,
        `_weights['w[0,0] 16x0e']`).
    - `expr`: the expression a matching leaf gets, or `"fsdp"` (given as the word
        or as `eqshard.FSDP`): each matching leaf's own FSDP expression.
    - `comment`: the rule's comment, if any.
    - `index`: its place in the file's `rules` list.
    - `memory`: where the matching leaves are held: `"device"` (the devices' own
        memory) or `"pinned_host"` (host memory, as a `NamedSharding`'s memory
        kind); `None` for the default, the device.
    """

    path: str
    expr: Expression | Literal["fsdp"]
    comment: str | None = None
    index: int = 0
    memory: Literal["device", "pinned_host"] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise EqshardError(
                f"`Rule.path` is a dotted glob such as 'blocks.*.weight', not {self.path!r}"
            )
        parse_path(self.path)
        if self.memory is not None and self.memory not in MEMORY_KINDS:
            raise EqshardError(
                f"`Rule.memory` is one of {', '.join(map(repr, MEMORY_KINDS))}, not {self.memory!r}"
            )
        if self.expr is FSDP or (isinstance(self.expr, str) and self.expr == FSDP_WORD):
            object.__setattr__(self, "expr", FSDP_WORD)
        else:
            object.__setattr__(self, "expr", parse(self.expr))


_DEFAULTS = ("replicate", "error", FSDP_WORD)
_OPTIMIZER_DEFAULTS = (PARAMETER, "replicate", FSDP_WORD)

MEMORY_KINDS = ("device", "pinned_host")
"""The memory kinds a rule may name: the devices' own memory, or pinned host memory."""


@dataclasses.dataclass(frozen=True, eq=False)
class Rules:
    """The rules of a spec file: a resolver, ready for any model.

    Pass it wherever eqshard takes a spec: `eqshard.apply(model, rules)`,
    `eqshard.plan(model, rules)`, `eqshard.spec(model, rules)`.

    **Fields:** `rules` (a tuple of `Rule`), `default` (`"replicate"`, `"error"`
    or `"fsdp"`: what a leaf no rule or dim matches gets), `devices` (the device
    count the file was written for, or `None`), `dims` (dim name to a modifier, a
    mesh axis name, or `None` for a whole dim; for parameters by their annotations
    and for activations by `eqshard.constrain`'s names), `source` (the file name, for messages), and `mesh` (the
    declared mesh: each axis's name and size, `None` for the one `"*"` axis; or
    `None`), and `batch` (the complete `Expression` that `eqshard.cost` and
    `eqshard check --step` lay the step's batch out by, such as
    `"... -> * ..."` for a whole batch on every device; `None` for their default,
    the leading dim over the mesh's first axis), `optimizer` (the file's
    `"optimizer"` section, itself a `Rules` whose `default` may be `"parameter"`:
    how the optimizer state is laid out; `None` where the state follows the
    parameters), `section` (where these rules sit in their file: `"$"`, or
    `"$.optimizer"` for that section) and `comment` (the file's or the section's
    `"comment"`, free text for the reader, or `None`).

    As an optimizer spec (`eqshard.plan(model, spec, optimizer=rules)`), its paths
    name parameters, and `default="parameter"` gives each state leaf no rule or dim
    matches its parameter's layout.
    """

    rules: tuple[Rule, ...] = ()
    default: Literal["replicate", "error", "fsdp", "parameter"] = "replicate"
    devices: int | None = None
    dims: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    source: str = "<rules>"
    mesh: tuple[tuple[str, int | None], ...] | None = None
    batch: Expression | None = None
    optimizer: Rules | None = None
    section: str = "$"
    comment: str | None = None

    def __post_init__(self) -> None:
        if self.comment is not None and not isinstance(self.comment, str):
            raise EqshardError(f"`Rules.comment` is text for the reader, not {self.comment!r}")
        if self.default not in (*_DEFAULTS, PARAMETER):
            raise EqshardError(
                "`Rules.default` is 'replicate', 'error' or 'fsdp' (or, for the optimizer "
                "state, 'parameter'), not " + repr(self.default)
            )
        if self.batch is not None:
            object.__setattr__(self, "batch", batch_expression(self.batch))
        if self.optimizer is not None:
            if not isinstance(self.optimizer, Rules) or self.optimizer.optimizer is not None:
                raise EqshardError(
                    "`Rules.optimizer` is the `Rules` of the optimizer state, with no "
                    "optimizer section of its own"
                )
            if self.default == PARAMETER:
                raise EqshardError(
                    "`Rules.default` is 'parameter' in an optimizer section only; these rules "
                    "lay out the parameters: 'replicate', 'error' or 'fsdp'"
                )

    def where(self, json_path: str) -> str:
        """`file::$.json.path`: where a fault of this spec is, in messages (a path
        under `$` is taken within `section`)."""
        return f"{self.source}::{self.section}{json_path[1:]}"

    def at(self, json_path: str) -> str:
        """`json_path` (`"$.rules[2]"`) within the file: under `section`."""
        return f"{self.section}{json_path[1:]}"

    def match(self, model: Any, target: Target | None = None) -> tuple[list[Match], list[Problem]]:
        """How each leaf of `model` gets its expression, and what went wrong.

        The problems are: leaves no rule or dim matches under `"default": "error"`,
        and dims-derived expressions that do not fit their annotation (or, for
        logical axes, `target`'s mesh).
        """
        from .._rules import match_rules

        return match_rules(self, model, target)

    def __eqshard_resolve__(self, model: Any, target: Target) -> Resolution:
        from .._rules import resolve_rules

        return resolve_rules(self, model, target)

    def __eqshard_mesh__(self, devices: int) -> tuple[MeshShape | None, list[Problem]]:
        """The declared mesh on `devices` devices, or why there is none."""
        if self.mesh is None:
            return None, []
        names = tuple(name for name, _ in self.mesh)
        fixed = math.prod(size for _, size in self.mesh if size is not None)
        star = any(size is None for _, size in self.mesh)
        if devices % fixed if star else devices != fixed:
            need = f"a multiple of {fixed}" if star else str(fixed)
            return None, [
                Problem(
                    self.where("$.mesh"),
                    f"the mesh {_mesh_text(self.mesh)} needs {need} devices, and the spec "
                    f'is laid out on {devices}; use {need} devices, or change "mesh"',
                    file=self.source,
                )
            ]
        sizes = tuple(devices // fixed if size is None else size for _, size in self.mesh)
        return MeshShape(names, sizes), []

    def to_json(self) -> dict[str, Any]:
        """The document of a spec file that loads back to these rules."""
        document: dict[str, Any] = {"$schema": _schema()["$id"], "eqshard": VERSION}
        if self.comment is not None:
            document["comment"] = self.comment
        if self.devices is not None:
            document["devices"] = self.devices
        document["default"] = self.default
        document["rules"] = _rules_json(self)
        if self.dims:
            document["dims"] = dict(self.dims)
        if self.mesh is not None:
            document["mesh"] = [[name, "*" if size is None else size] for name, size in self.mesh]
        if self.batch is not None:
            document["batch"] = str(self.batch)
        if self.optimizer is not None:
            section = self.optimizer
            document["optimizer"] = {
                **({"comment": section.comment} if section.comment is not None else {}),
                "default": section.default,
                "rules": _rules_json(section),
            }
            if section.dims:
                document["optimizer"]["dims"] = dict(section.dims)
        return document


def _rules_json(rules: Rules) -> list[dict[str, Any]]:
    """The `"rules"` of a spec file's document: each rule's path, expression, memory
    kind and comment."""
    return [
        {
            "path": r.path,
            "expr": str(r.expr),
            **({"memory": r.memory} if r.memory else {}),
            **({"comment": r.comment} if r.comment else {}),
        }
        for r in rules.rules
    ]


def batch_expression(expr: str | Expression) -> Expression:
    """`expr` parsed as a batch's expression: complete, since a batch's arrays have
    no annotation to give a short form its left side.

    **Raises:** `ExpressionError`, with a caret, when `expr` is malformed or short.
    """
    parsed = parse(expr)
    if not parsed.is_complete:
        text = parsed.text or str(parsed)
        raise ExpressionError(
            text,
            0,
            "a batch's arrays have no annotation to complete a short form: write both "
            "sides, such as 'b ... -> b* ...' (the leading dim split over every device) "
            "or '... -> * ...' (a whole copy on every device)",
            length=len(text),
        )
    return parsed


# --------------------------------------------------------------------------- #
# Reading and checking.
# --------------------------------------------------------------------------- #


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


def _is_regular(path: Path) -> bool:
    """Whether `path` is a regular file (following links); `False` where it is not
    there. Raises `OSError` and `ValueError` (a NUL byte) as `os.stat` does."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except FileNotFoundError:
        return False


def _read(path: Path, name: str) -> Any:
    try:
        regular = _is_regular(path)
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


def _mesh_text(mesh: Sequence[tuple[str, int | None]]) -> str:
    return "(" + ", ".join(f"{n!r}: {'*' if s is None else s}" for n, s in mesh) + ")"


def _schema_problem(name: str, error: ValidationError) -> Problem:
    where = f"{name}::{error.json_path}"
    instance, keyword = error.instance, error.validator
    path = list(error.absolute_path)
    if keyword == "anyOf" and path[-1:] == ["expr"]:
        if not isinstance(instance, str):
            return Problem(
                where,
                f"{instance!r} is not of type 'string'; write an einshard expression such "
                f"as 'o i -> o* i', or {FSDP_WORD!r}",
            )
        try:
            parse(instance)
        except ExpressionError as bad:
            return Problem.from_error(where, bad)
        return Problem(where, f"{instance!r} is not an einshard expression, nor {FSDP_WORD!r}")
    if keyword == "pattern" and path[-1:] == ["path"]:
        if isinstance(instance, str):
            try:
                parse_path(instance)
            except PathError as bad:
                return Problem.from_error(where, bad)
        return Problem(
            where,
            f"{instance!r} is not a path pattern: segments are separated by '.', and each "
            "is a name, an index, a key, '*', '**', or a glob such as '*_proj' (a '*' "
            "inside a segment matches any run of its characters); a key holding '.', "
            "'*', white space, a bracket or a quote is written quoted, as eqshard names "
            "it: params['a b'].w",
        )
    if path == ["batch"] and keyword in ("pattern", "type"):
        return _batch_problem(where, instance)
    if path[:1] == ["optimizer"]:  # the section's keys are checked as the file's are
        path = path[1:]
        if keyword == "enum" and path == ["default"]:
            return Problem(
                where,
                f"{instance!r} is not a default of the optimizer section: 'parameter' (each "
                "state leaf takes its parameter's layout), 'replicate' or 'fsdp'",
            )
    if keyword == "enum" and path[-1:] == ["memory"]:
        return Problem(
            where,
            f"{instance!r} is not a memory kind: 'device' (the default) or 'pinned_host' "
            "(host memory)",
        )
    if "propertyNames" in error.schema_path:
        return Problem(where, f"dim name {instance!r} is not an einshard name (letters and '_')")
    if keyword == "anyOf" and path[:1] == ["dims"]:
        return Problem(
            where,
            f"{instance!r} is neither a shard modifier ('2', '*', '2*'), the name of a "
            "mesh axis, nor null (a whole dim)",
        )
    if keyword == "pattern" and path[:1] == ["dims"]:
        return Problem(
            where,
            f"{instance!r} is not a shard modifier: write a count, a star or both ('2', '*', '2*')",
        )
    if keyword == "additionalProperties" and isinstance(instance, dict):
        subschema = error.schema if isinstance(error.schema, dict) else {}
        allowed = list(subschema.get("properties", {}))
        extra = [k for k in instance if k not in allowed]
        return Problem(
            where,
            f"unknown key{'s' * (len(extra) > 1)} {', '.join(map(repr, extra))}; the keys "
            f"here are {', '.join(map(repr, allowed))}",
        )
    if keyword == "const" and path == ["eqshard"]:
        return Problem(
            where, f"unsupported version {instance!r}; this eqshard reads version {VERSION}"
        )
    if keyword == "required":
        missing = str(error.message).split("'")[1] if "'" in error.message else error.message
        hint = ' (the format version: "eqshard": 1)' if missing == "eqshard" else ""
        return Problem(where, f"missing key {missing!r}{hint}")
    return Problem(where, error.message)


def _batch_problem(where: str, instance: Any) -> Problem:
    """What is wrong with a file's `"batch"`: not text, or no complete expression
    (with a caret under the fault)."""
    if not isinstance(instance, str):
        return Problem(
            where,
            f"{instance!r} is not of type 'string'; write an einshard expression such as "
            "'b ... -> b* ...' or '... -> * ...'",
        )
    try:
        batch_expression(instance)
    except ExpressionError as bad:
        return Problem.from_error(where, bad)
    return Problem(where, f"{instance!r} is not an einshard expression")


def _order(path: Sequence[Any]) -> list[tuple[int, int, str]]:
    """Sorts JSON paths in document order: `$.rules[2]` before `$.rules[10]`."""
    return [(1, c, "") if isinstance(c, int) else (0, 0, str(c)) for c in path]


def document_problems(document: Any, name: str) -> list[Problem]:
    """Every fault of a spec file's document, in document order: the schema's, then
    what it cannot say. Each problem's `file` is `name`."""
    orders: dict[Problem, list[tuple[int, int, str]]] = {}
    for error in _validator().iter_errors(document):  # once, where two schema rules say it
        orders.setdefault(_schema_problem(name, error), _order(error.absolute_path))
    found = [(order, problem) for problem, order in orders.items()]
    if isinstance(document, dict):
        found += _rule_problems(document, name, {p.where for _, p in found})
    return [in_file(problem, name) for _, problem in sorted(found, key=lambda pair: pair[0])]


def _rule_problems(
    document: dict[str, Any], name: str, schema_paths: set[str]
) -> list[tuple[list[tuple[int, int, str]], Problem]]:
    """What the schema cannot say: each expression and path parses, and no path
    repeats (`a.b` and `a['b']` are one path)."""
    problems = _rules_problems(document, name, schema_paths, [])
    section = document.get("optimizer")
    if isinstance(section, dict):
        problems += _rules_problems(section, name, schema_paths, ["optimizer"])
    batch = document.get("batch")
    where = f"{name}::$.batch"
    if isinstance(batch, str) and where not in schema_paths:
        try:
            batch_expression(batch)
        except ExpressionError as bad:
            problems.append((_order(["batch"]), Problem.from_error(where, bad)))
    problems += _mesh_problems(document, name)
    return problems


def _rules_problems(
    document: Mapping[str, Any], name: str, schema_paths: set[str], at: list[str]
) -> list[tuple[list[tuple[int, int, str]], Problem]]:
    """What the schema cannot say of one list of rules and its dims (the file's, or
    those of the section at `at`, `["optimizer"]`): each expression and path parses,
    no path repeats (`a.b` and `a['b']` are one path), and each dim's modifier
    parses."""
    problems: list[tuple[list[tuple[int, int, str]], Problem]] = []
    prefix = "".join(f".{key}" for key in at)
    rules = document.get("rules")
    seen: dict[Any, tuple[int, str]] = {}
    for i, rule in enumerate(rules if isinstance(rules, list) else []):
        if not isinstance(rule, dict):
            continue
        expr = rule.get("expr")
        where = f"{name}::${prefix}.rules[{i}].expr"
        order = _order([*at, "rules", i, "expr"])
        if isinstance(expr, str) and where not in schema_paths and expr != FSDP_WORD:
            if expr.strip().lower() == FSDP_WORD:  # a short form naming a dim 'FSDP'
                message = f"{expr!r}: write {FSDP_WORD!r}, in lower case with no spaces, for FSDP"
                problems.append((order, Problem(where, message)))
            else:
                try:
                    parse(expr)
                except ExpressionError as bad:
                    problems.append((order, Problem.from_error(where, bad)))
        path = rule.get("path")
        where = f"{name}::${prefix}.rules[{i}].path"
        order = _order([*at, "rules", i, "path"])
        if isinstance(path, str) and where not in schema_paths:
            try:
                parsed = parse_path(path)
            except PathError as bad:
                problems.append((order, Problem.from_error(where, bad)))
                continue
            if parsed in seen:
                j, text = seen[parsed]
                same = f"the same path {path!r}" if text == path else f"{text!r}, the same path,"
                problem = Problem(
                    where,
                    f"this rule can never match: ${prefix}.rules[{j}] has {same} and comes "
                    "first; remove one",
                )
                problems.append((order, problem))
            seen.setdefault(parsed, (i, path))
    dims = document.get("dims")
    for dim, modifier in dims.items() if isinstance(dims, dict) else ():
        where = f"{name}::${prefix}.dims.{dim}"
        if isinstance(modifier, str) and where not in schema_paths:
            if _AXIS_NAME.fullmatch(modifier):
                continue  # a logical axis: checked against the mesh it is laid out on
            try:
                parse(f"x{modifier}")
            except ExpressionError as bad:
                problem = Problem(where, f"{modifier[:24]!r}: {bad.rule}")
                problems.append((_order([*at, "dims", dim]), problem))
    return problems


_AXIS_NAME = re.compile(r"[^\W\d]+")


def _mesh_problems(document: dict[str, Any], name: str) -> list[tuple[list[Any], Problem]]:
    """What the schema cannot say of `"mesh"`: names once, one `"*"` at most, and
    sizes that agree with `"devices"`."""
    mesh = document.get("mesh")
    if not isinstance(mesh, list) or not all(
        isinstance(axis, list) and len(axis) == 2 and isinstance(axis[0], str) for axis in mesh
    ):
        return []  # the schema has said what is wrong
    found: list[tuple[list[Any], Problem]] = []
    names = [axis[0] for axis in mesh]
    for i, axis_name in enumerate(names):
        if axis_name in names[:i]:
            message = f"the axis {axis_name!r} is named twice; name each mesh axis once"
            found.append((_order(["mesh", i]), Problem(f"{name}::$.mesh[{i}]", message)))
    stars = [i for i, axis in enumerate(mesh) if axis[1] == "*"]
    for i in stars[1:]:
        message = "a second '*': at most one axis takes what the device count leaves"
        found.append((_order(["mesh", i]), Problem(f"{name}::$.mesh[{i}][1]", message)))
    sizes = [axis[1] for axis in mesh if isinstance(axis[1], int)]
    devices = document.get("devices")
    if isinstance(devices, int) and len(sizes) + len(stars) == len(mesh):
        fixed = math.prod(sizes)
        if (stars and devices % fixed) or (not stars and devices != fixed):
            need = f"a multiple of {fixed}" if stars else str(fixed)
            message = f'the mesh needs {need} devices, and "devices" is {devices}; make them agree'
            found.append((_order(["mesh"]), Problem(f"{name}::$.mesh", message)))
    return found


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

    `eqshard.SpecError` listing every fault at once, one line each, as
    `<file>::$.rules[2].expr: <message>` (broken JSON names its line and column);
    `eqshard.UnreadableError` (a `SpecError`) when the file cannot be read, is not
    UTF-8, or is over the size limit.
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
        source=name,
        mesh=None
        if document.get("mesh") is None
        else tuple((n, None if size == "*" else int(size)) for n, size in document["mesh"]),
        batch=None if document.get("batch") is None else parse(document["batch"]),
        optimizer=optimizer,
        comment=document.get("comment"),
    )


def _rules_of(document: Mapping[str, Any]) -> tuple[Rule, ...]:
    """The `Rule`s of a checked document's (or optimizer section's) `"rules"`."""
    return tuple(
        Rule(rule["path"], rule["expr"], rule.get("comment"), i, rule.get("memory"))
        for i, rule in enumerate(document.get("rules", []))
    )


def dump(
    spec_or_rules: Any,
    path: str | os.PathLike[str],
    *,
    devices: int | None = None,
) -> None:
    """Writes a spec tree or `Rules` to a spec file that loads back to the same layouts.

    **Example:**

    ```python
    eqshard.dump(eqshard.spec(model), "model.eqshard.json")
    ```

    **Arguments:**

    - `spec_or_rules`: an `eqshard.Rules`, or a spec tree (as `eqshard.spec`
        returns, edited with `eqx.tree_at`, or a prefix of the model): each
        expression becomes the rule `<its path>.**`, which matches the leaf or
        every leaf of the subtree it stands for; `None` leaves are left to
        `"default": "replicate"`.
    - `path`: the file to write.
    - `devices`: the device count to record, if any (a `Rules` keeps its own).

    **Raises:**

    `eqshard.SpecError` when a leaf of a spec tree holds something other than an
    expression, or the file would not load back.
    """
    if devices is not None:
        whole_number(devices, "`devices`")
    if not isinstance(path, (str, os.PathLike)):
        raise EqshardError(f"`eqshard.dump` writes to a path, not {type(path).__name__}")
    if isinstance(spec_or_rules, Rules):
        rules = spec_or_rules
        if devices is not None:
            rules = dataclasses.replace(rules, devices=devices)
    else:
        rules = _rules_of_spec_tree(spec_or_rules, devices)
    target = os.fspath(path)
    document = rules.to_json()
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
    from .._paths._grammar import name, segments

    found: list[Rule] = []
    problems: list[Problem] = []
    # `None`s are empty subtrees: no leaves. Paths as eqshard names them (a state's
    # leaves by their layers, a `(model, state)` pair as one model).
    for key_path, leaf in zip(key_paths(tree), jax.tree_util.tree_leaves(tree)):
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


def write_atomically(path: Path, data: bytes) -> None:
    """Writes `data` to a new file beside `path`, then renames it over `path`: the
    file is either the old one or the new one, whole, even on a full disk. Where
    `path` is a symbolic link, the file it points to is written (the new file is
    made in that file's folder), and the link stays a link."""
    name = os.fspath(path)
    try:
        target = Path(os.path.realpath(path))  # through every link, to the file itself
        if target.is_symlink():
            raise EqshardError(f"not written: {name} is a symbolic link that leads to itself")
        if target.exists() and not _is_regular(target):
            raise EqshardError(f"not written: {name} is not a regular file (a directory or pipe)")
        # Made with mode 0o666, which the kernel masks with the umask, as for any new
        # file (reading the umask would race with other threads).
        temporary = str(target.parent / f".{target.name}.{secrets.token_hex(8)}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except (OSError, ValueError) as error:
        if isinstance(error, EqshardError):
            raise
        raise EqshardError(
            f"cannot write {name}: {getattr(error, 'strerror', None) or error}"
        ) from None
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
