"""JSON spec files: the schema, `load`, path and dimension rules, and `dump`.

A spec file is data: loading one parses JSON and checks it, and never imports a
module or runs code. The schema (`schemas/eqshard.schema.json`, also shipped in
the package) is checked with jsonschema first; then every expression is parsed,
so each fault is reported as `<file>::<JSON path>: <message>`, all at once.

How a leaf gets its expression, in order:

1. **rules**: the first rule whose `path` matches the leaf's dotted path;
2. **dims**: for a leaf no rule matched, whose field has a jaxtyping annotation
   naming a dim in `dims`: the annotation's dims in order, each with its
   modifier (`{"mlp": "*"}` on `Float[Array, "embed mlp"]` gives
   `"embed mlp -> embed mlp*"`);
3. **default**: `"replicate"` (a full copy on every device) or `"error"`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.resources
import json
import os
import re
import stat
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from ._annotation import complete
from ._errors import EqshardError, ExpressionError, Problem, SpecError, UnreadableError
from ._expression import Expression, parse
from ._paths import dotted, match, segments
from ._spec import LeafSpec, is_array_like, is_spec_leaf, walk_fields

__all__ = ["MAX_BYTES", "Match", "Rule", "Rules", "UnusedRuleWarning", "dump", "load", "schema"]

_SEGMENT = re.compile(r"[^.*\s]+")  # a literal path segment, as the schema has it

MAX_BYTES = 1 << 20
"""Spec files larger than this (1 MiB) are refused unread."""

VERSION = 1


class UnusedRuleWarning(UserWarning):
    """A rule of a spec file matched no leaf of the model."""


UnusedRuleWarning.__module__ = "eqshard"

_REPLICATE = parse("... -> * ...")
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _user_stacklevel() -> int:
    """The `stacklevel` that points a warning at the first caller outside eqshard."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


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

    - `path`: a dotted glob (`blocks.*.attn.query_proj.weight`, `**.up.weight`).
    - `expr`: the expression a matching leaf gets.
    - `comment`: the rule's comment, if any.
    - `index`: its place in the file's `rules` list.
    """

    path: str
    expr: Expression
    comment: str | None = None
    index: int = 0


@dataclasses.dataclass(frozen=True)
class Match:
    """How one leaf got its expression.

    - `path`: the leaf's dotted path.
    - `expr`: its expression: under `"default": "replicate"`, leaves nothing else
        matched get `"... -> * ..."`; `None` under `"default": "error"` and for leaves
        that are not arrays.
    - `source`: `"rule"`, `"dims"`, `"default"`, or `"none"` for leaves that are not
        arrays.
    - `rule`: the index of the matching rule when `source` is `"rule"`.
    """

    path: str
    expr: Expression | None
    source: Literal["rule", "dims", "default", "none"]
    rule: int | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Rules:
    """The rules of a spec file, ready to resolve against a model.

    Pass it wherever eqshard takes a spec: `eqshard.apply(model, rules)`,
    `eqshard.plan(model, rules)`, `eqshard.spec(model, rules)`.

    **Fields:** `rules` (a tuple of `Rule`), `default` (`"replicate"` or `"error"`),
    `devices` (the device count the file was written for, or `None`), `dims` (dim
    name to modifier), and `source` (the file name, for messages).
    """

    rules: tuple[Rule, ...] = ()
    default: Literal["replicate", "error"] = "replicate"
    devices: int | None = None
    dims: Mapping[str, str] = dataclasses.field(default_factory=dict)
    source: str = "<rules>"

    def where(self, json_path: str) -> str:
        return f"{self.source}::{json_path}"

    def match(self, model: Any) -> tuple[list[Match], list[Problem]]:
        """How each leaf of `model` gets its expression, and what went wrong.

        The problems are: leaves no rule or dim matches under `"default": "error"`,
        and dims-derived expressions that do not fit their annotation.
        """
        flat, _ = jax.tree_util.tree_flatten_with_path(model)
        fields = walk_fields(model) if self.dims else None
        fallback = _REPLICATE if self.default == "replicate" else None
        matches: list[Match] = []
        problems: list[Problem] = []
        for i, (path, leaf) in enumerate(flat):
            segs = segments(path)
            name = ".".join(segs)
            if not is_array_like(leaf):
                matches.append(Match(name, None, "none"))
                continue
            rule = self._first_match(segs)
            if rule is not None:
                matches.append(Match(name, rule.expr, "rule", rule.index))
                continue
            expr = self._from_dims(fields[i] if fields else None, problems)
            if expr is not None:
                matches.append(Match(name, expr, "dims"))
                continue
            if self.default == "error":
                problems.append(
                    Problem(
                        name,
                        f"no rule or dim matches this leaf, and {self.source} says "
                        f'"default": "error"; add a rule for {name!r}, or set '
                        '"default": "replicate"',
                    )
                )
            matches.append(Match(name, fallback, "default"))
        return matches, problems

    @functools.cached_property
    def _by_tail(self) -> tuple[dict[int, dict[tuple[str, ...], list[int]]], list[int]]:
        """The rules indexed by their literal tail (the segments after their last
        wildcard), by tail length; and the rules that end in a wildcard."""
        by_tail: dict[int, dict[tuple[str, ...], list[int]]] = {}
        always: list[int] = []
        for position, rule in enumerate(self.rules):
            parts = rule.path.split(".")
            k = len(parts)
            while k > 0 and parts[k - 1] not in ("*", "**"):
                k -= 1
            tail = tuple(parts[k:])
            if tail:
                by_tail.setdefault(len(tail), {}).setdefault(tail, []).append(position)
            else:
                always.append(position)
        return by_tail, always

    def _first_match(self, segs: tuple[str, ...]) -> Rule | None:
        """The first rule that matches: only rules whose literal tail ends the path
        are tried, so a leaf costs a few look-ups however many rules there are."""
        by_tail, always = self._by_tail
        candidates = list(always)
        for length, table in by_tail.items():
            if length <= len(segs):
                candidates.extend(table.get(segs[len(segs) - length :], ()))
        for position in sorted(candidates):
            if match(self.rules[position].path, segs):
                return self.rules[position]
        return None

    def _from_dims(self, item: LeafSpec | None, problems: list[Problem]) -> Expression | None:
        if item is None or item.annotation is None:
            return None
        annotation = item.annotation
        names = [d for d in annotation.items if isinstance(d, str)]
        if not any(d in self.dims for d in names):
            return None
        short = " ".join(f"{d}{self.dims.get(d, '')}" for d in names)
        try:
            return complete(parse(short), annotation)
        except ExpressionError as error:
            dims = ", ".join(f"$.dims.{d}" for d in names if d in self.dims)
            problems.append(
                Problem(
                    item.label,
                    f"from {self.source}::{dims}: {error.rule}",
                    error.picture,
                )
            )
            return None

    def unused(self, matches: Sequence[Match]) -> list[Rule]:
        """The rules that matched no array leaf."""
        used = {m.rule for m in matches if m.source == "rule"}
        return [rule for rule in self.rules if rule.index not in used]

    def __eqshard_resolve__(self, model: Any) -> list[Expression | None]:
        """One expression per leaf of `model`; warns of rules that matched nothing."""
        matches, problems = self.match(model)
        if problems:
            raise SpecError(problems)
        for rule in self.unused(matches):
            warnings.warn(
                f"{self.where(f'$.rules[{rule.index}]')}: rule {rule.path!r} matched no "
                "leaf of the model",
                UnusedRuleWarning,
                stacklevel=_user_stacklevel(),
            )
        return [m.expr for m in matches]

    def resolve(self, model: Any) -> Any:
        """The spec tree of `model` under these rules; warns of rules that matched nothing.

        **Raises:** `eqshard.SpecError` for unmatched leaves under `"default":
        "error"` and for dims that do not fit.
        """
        treedef = jax.tree_util.tree_structure(model)
        return jax.tree_util.tree_unflatten(treedef, self.__eqshard_resolve__(model))

    def to_json(self) -> dict[str, Any]:
        """The document of a spec file that loads back to these rules."""
        document: dict[str, Any] = {"$schema": _schema()["$id"], "eqshard": VERSION}
        if self.devices is not None:
            document["devices"] = self.devices
        document["default"] = self.default
        document["rules"] = [
            {"path": r.path, "expr": str(r.expr), **({"comment": r.comment} if r.comment else {})}
            for r in self.rules
        ]
        if self.dims:
            document["dims"] = dict(self.dims)
        return document


# --------------------------------------------------------------------------- #
# Loading.
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


def _read(path: Path, name: str) -> Any:
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise UnreadableError(
                [Problem(name, "it is not a regular file (a directory, pipe or device)")],
                "unreadable",
            )
        with path.open("rb") as file:
            data = file.read(MAX_BYTES + 1)
    except (OSError, ValueError) as error:
        why = getattr(error, "strerror", None) or error
        raise UnreadableError([Problem(name, f"cannot read it: {why}")], "unreadable") from None
    if len(data) > MAX_BYTES:
        raise UnreadableError(
            [Problem(name, f"the file is over the {MAX_BYTES}-byte limit for spec files")],
            "refused",
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UnreadableError(
            [Problem(name, f"it is not UTF-8 (byte {error.start})")], "unreadable"
        ) from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        where = f"{name}::line {error.lineno}, column {error.colno}"
        raise SpecError([Problem(where, f"invalid JSON: {error.msg}")], "invalid") from None
    except RecursionError:
        raise SpecError([Problem(name, "the JSON nests too deeply to read")], "invalid") from None
    except _DuplicateKey as error:
        raise SpecError(
            [Problem(name, f"the key {error.args[0]!r} appears twice in one object; keep one")],
            "invalid",
        ) from None
    except ValueError as error:
        raise SpecError([Problem(name, str(error))], "invalid") from None


def _schema_problem(name: str, error: ValidationError) -> Problem:
    where = f"{name}::{error.json_path}"
    instance, keyword = error.instance, error.validator
    path = list(error.absolute_path)
    if keyword == "pattern" and path[-1:] == ["expr"] and isinstance(instance, str):
        try:
            parse(instance)
        except ExpressionError as bad:
            return Problem(where, bad.rule, bad.picture)
    if keyword == "pattern" and path[-1:] == ["path"]:
        return Problem(
            where,
            f"{instance!r} is not a path pattern: segments are separated by '.', and each "
            "is a name, an index, a key, '*' or '**', with no spaces",
        )
    if "propertyNames" in error.schema_path:
        return Problem(where, f"dim name {instance!r} is not an einshard name (letters and '_')")
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


def _order(path: Sequence[Any]) -> list[tuple[int, int, str]]:
    """Sorts JSON paths in document order: `$.rules[2]` before `$.rules[10]`."""
    return [(1, c, "") if isinstance(c, int) else (0, 0, str(c)) for c in path]


def _check(document: Any, name: str) -> list[Problem]:
    found = [
        (_order(error.absolute_path), _schema_problem(name, error))
        for error in _validator().iter_errors(document)
    ]
    if isinstance(document, dict):
        found += _check_rules(document, name, {p.where for _, p in found})
    return [problem for _, problem in sorted(found, key=lambda pair: pair[0])]


def _check_rules(
    document: dict[str, Any], name: str, schema_paths: set[str]
) -> list[tuple[list[tuple[int, int, str]], Problem]]:
    """What the schema cannot say: each expression parses, and no path repeats."""
    problems: list[tuple[list[tuple[int, int, str]], Problem]] = []
    rules = document.get("rules")
    seen: dict[str, int] = {}
    for i, rule in enumerate(rules if isinstance(rules, list) else []):
        if not isinstance(rule, dict):
            continue
        expr = rule.get("expr")
        where = f"{name}::$.rules[{i}].expr"
        if isinstance(expr, str) and where not in schema_paths:
            try:
                parse(expr)
            except ExpressionError as bad:
                problems.append(
                    (_order(["rules", i, "expr"]), Problem(where, bad.rule, bad.picture))
                )
        path = rule.get("path")
        if isinstance(path, str):
            if path in seen:
                problem = Problem(
                    f"{name}::$.rules[{i}].path",
                    f"this rule can never match: $.rules[{seen[path]}] has the same path "
                    f"{path!r} and comes first; remove one",
                )
                problems.append((_order(["rules", i, "path"]), problem))
            seen.setdefault(path, i)
    return problems


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
        problems = _check(document, name)
    except RecursionError:
        problems = [Problem(name, "the document nests too deeply to check")]
    if problems:
        raise SpecError(problems, f"{name} is not a valid eqshard spec")
    rules = tuple(
        Rule(rule["path"], parse(rule["expr"]), rule.get("comment"), i)
        for i, rule in enumerate(document.get("rules", []))
    )
    return Rules(
        rules=rules,
        default=document.get("default", "replicate"),
        devices=None if document.get("devices") is None else int(document["devices"]),
        dims=dict(document.get("dims", {})),
        source=name,
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

    `eqshard.SpecError` when a leaf's path cannot be written as a rule path (a dict
    key holding '.', '*' or white space).
    """
    if devices is not None and (
        isinstance(devices, bool) or not isinstance(devices, int) or devices < 1
    ):
        raise EqshardError(f"`devices` is a whole number from 1, not {devices!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise EqshardError(f"`eqshard.dump` writes to a path, not {type(path).__name__}")
    if isinstance(spec_or_rules, Rules):
        rules = spec_or_rules
        if devices is not None:
            rules = dataclasses.replace(rules, devices=devices)
    else:
        flat, _ = jax.tree_util.tree_flatten_with_path(spec_or_rules, is_leaf=is_spec_leaf)
        found: list[Rule] = []
        problems: list[Problem] = []
        for key_path, leaf in flat:
            if leaf is None:
                continue
            segs = segments(key_path)
            bad = [s for s in segs if not _SEGMENT.fullmatch(s)]
            if bad or not isinstance(leaf, (str, Expression)):
                why = (
                    f"the key {bad[0]!r} cannot be written in a rule path"
                    if bad
                    else f"{type(leaf).__name__} is not an expression"
                )
                problems.append(Problem(dotted(key_path) or "the root", why))
                continue
            # `**` also matches no segment: the rule covers the leaf, or the whole
            # subtree that a prefix spec gives one expression.
            found.append(Rule(".".join([*segs, "**"]), parse(leaf), None, len(found)))
        if problems:
            raise SpecError(problems, "cannot write this spec as a spec file")
        rules = Rules(tuple(found), devices=devices)
    text = json.dumps(rules.to_json(), indent=2, ensure_ascii=False) + "\n"
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as error:
        raise EqshardError(f"cannot write {os.fspath(path)}: {error.strerror or error}") from None
