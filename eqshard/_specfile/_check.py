"""Checking a spec file's document: every fault, each at its JSON path.

The schema is checked first, with jsonschema (`iter_errors`: each fault as
`<file>::<JSON path>: <message>`, in words of the spec-file format rather than the
schema's); then what the schema cannot say: every expression and rule path parses,
a rule's dims by name name each dim once and are all mapped by the `"dims"` beside
its rules, no rule repeats a path, each dim's modifier reads, and the declared mesh agrees
with the device count. `load` checks a file this way before it makes `Rules`, and
`dump` checks what it would write, so it never writes a file that does not load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jsonschema.exceptions import ValidationError

from .._errors import ExpressionError, PathError
from .._expression import is_name, parse
from .._fsdp import FSDP_WORD
from .._layout import MAX_DEVICES
from .._paths._grammar import parse as parse_path
from .._problems import Problem, in_file
from ._model import Named, batch_expression, unmapped_dim
from ._schema import VERSION, validator

__all__ = ["document_problems"]


_COUNT = f"a whole number from 1 to {MAX_DEVICES}, the most devices a JAX sharding can describe"


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
    if keyword == "oneOf" and len(path) in (2, 3) and path[-2:-1] == ["rules"]:
        if not isinstance(instance, dict):  # as the schema's type error says it, once
            return Problem(where, f"{instance!r} is not of type 'object'")
        one = (
            "a complete einshard expression ('b ... -> b* ...') or its leaves' dims by name "
            "('batch length')"
            if path[:1] == ["batch"]
            else f"an einshard expression (or {FSDP_WORD!r}) or its leaves' dims by name "
            "('... hidden embed')"
        )
        if "expr" in instance and "dims" in instance:
            return Problem(where, f"the rule has both 'expr' and 'dims'; keep one: {one}")
        return Problem(where, f"missing key 'expr' or 'dims': a rule has one, {one}")
    if keyword in ("pattern", "type") and path[-1:] == ["dims"] and path[-3:-2] == ["rules"]:
        return _named_problem(where, instance)
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
    if path[:1] == ["batch"]:  # the batch section's own keys
        if keyword == "pattern" and path[-1:] == ["expr"]:
            return _batch_problem(where, instance)
        if keyword == "anyOf" and path == ["batch", "default"]:
            return _batch_default_problem(where, instance)
        if keyword == "enum" and path == ["batch", "indivisible"]:
            return Problem(
                where,
                f"{instance!r} is not what a batch leaf gets whose layout does not divide it: "
                "'error' (the default: an error naming the leaf) or 'replicate' (a whole copy "
                "on every device)",
            )
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
    if keyword == "pattern" and len(path) == 3 and path[0] == "mesh" and path[2] == 0:
        return Problem(where, f"{instance!r} is not a mesh axis name: write letters and '_'")
    if keyword == "anyOf" and len(path) == 3 and path[0] == "mesh" and path[2] == 1:
        return Problem(
            where,
            f"{instance!r} is not a mesh axis size: {_COUNT}, or '*' for what the device "
            "count leaves",
        )
    if path == ["devices"] and keyword in ("type", "minimum", "maximum"):
        return Problem(where, f"{instance!r} is not a device count: {_COUNT}")
    if "propertyNames" in error.schema_path:
        return Problem(
            where,
            f"dim name {instance!r} is not a logical name: a letter or '_', then letters, "
            "'_', digits, '-' or '.'",
        )
    if keyword == "anyOf" and path[:1] == ["dims"]:
        return Problem(
            where,
            f"{instance!r} is neither a shard modifier ('2', '*', '2*'), the name of a "
            "mesh axis, a list of them (the major first), nor null (a whole dim)",
        )
    if path[:1] == ["logical_axis_rules"]:
        return _table_problem(where, path, instance)
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


def _named_problem(where: str, instance: Any) -> Problem:
    """What is wrong with a rule's `"dims"`: not text, or not dims by name (with a
    caret under the offending token)."""
    if not isinstance(instance, str):
        return Problem(
            where,
            f"{instance!r} is not of type 'string'; name the leaf's dims, such as "
            "'... hidden embed'",
        )
    try:
        Named(instance)
    except ExpressionError as bad:
        return Problem.from_error(where, bad)
    return Problem(where, f"{instance!r} is not dims by name, such as '... hidden embed'")


def _batch_problem(where: str, instance: Any) -> Problem:
    """What is wrong with a file's `"batch"` or a batch rule's `"expr"`: neither text
    nor a section, or no complete expression (with a caret under the fault)."""
    if not isinstance(instance, str):
        return Problem(
            where,
            f"{instance!r} is neither an einshard expression, such as 'b ... -> b* ...' or "
            "'... -> * ...', nor a section of batch rules, such as "
            '{"rules": [{"path": "nodes", "expr": "n ... -> n* ..."}]}',
        )
    try:
        batch_expression(instance)
    except ExpressionError as bad:
        return Problem.from_error(where, bad)
    return Problem(where, f"{instance!r} is not an einshard expression")


def _batch_default_problem(where: str, instance: Any) -> Problem:
    """What is wrong with a batch section's `"default"`: a malformed or short
    expression (with a caret), or no default at all."""
    if isinstance(instance, str) and ("->" in instance or len(instance.split()) > 1):
        try:
            batch_expression(instance)
        except ExpressionError as bad:
            return Problem.from_error(where, bad)
    return Problem(
        where,
        f"{instance!r} is not a default of the batch section: 'replicate' (a whole copy on "
        "every device), 'error', or a complete expression such as 'b ... -> b* ...'; leave "
        "it out for data parallel",
    )


def _order(path: Sequence[Any]) -> list[tuple[int, int, str]]:
    """Sorts JSON paths in document order: `$.rules[2]` before `$.rules[10]`."""
    return [(1, c, "") if isinstance(c, int) else (0, 0, str(c)) for c in path]


def document_problems(document: Any, name: str) -> list[Problem]:
    """Every fault of a spec file's document, in document order: the schema's, then
    what it cannot say. Each problem's `file` is `name`."""
    orders: dict[Problem, list[tuple[int, int, str]]] = {}
    for error in validator().iter_errors(document):  # once, where two schema rules say it
        orders.setdefault(_schema_problem(name, error), _order(error.absolute_path))
    found = [(order, problem) for problem, order in orders.items()]
    if isinstance(document, dict):
        found += _rule_problems(document, name, {p.where for _, p in found})
    return [in_file(problem, name) for _, problem in sorted(found, key=lambda pair: pair[0])]


def _rule_problems(
    document: dict[str, Any], name: str, schema_paths: set[str]
) -> list[tuple[list[tuple[int, int, str]], Problem]]:
    """What the schema cannot say: each expression and path parses, and no path
    repeats (`a.b` and `a['b']` are one path), in the file's rules and in its
    optimizer and batch sections."""
    table = document.get("logical_axis_rules")
    tabled = (
        {rule[0] for rule in table if isinstance(rule, list) and rule and isinstance(rule[0], str)}
        if isinstance(table, list)
        else set()
    )
    problems = _rules_problems(document, name, schema_paths, [], tabled)
    section = document.get("optimizer")
    if isinstance(section, dict):
        problems += _rules_problems(section, name, schema_paths, ["optimizer"], tabled)
    batch = document.get("batch")
    where = f"{name}::$.batch"
    if isinstance(batch, str) and where not in schema_paths:
        try:
            batch_expression(batch)
        except ExpressionError as bad:
            problems.append((_order(["batch"]), Problem.from_error(where, bad)))
    if isinstance(batch, dict):  # its rules as the file's are: paths, repeats, expressions
        # its rules' dims by name are the file's dims and table's
        problems += _rules_problems(
            {**batch, "dims": document.get("dims")}, name, schema_paths, ["batch"], tabled
        )
        default = batch.get("default")
        where = f"{name}::$.batch.default"
        if isinstance(default, str) and "->" in default and where not in schema_paths:
            try:
                batch_expression(default)
            except ExpressionError as bad:
                problems.append((_order(["batch", "default"]), Problem.from_error(where, bad)))
    problems += _mesh_problems(document, name)
    return problems


def _rules_problems(
    document: Mapping[str, Any], name: str, schema_paths: set[str], at: list[str], tabled: set[str]
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
        problems += _named_problems(
            rule, document.get("dims"), tabled, name, schema_paths, [*at, "rules", i]
        )
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
            if is_name(modifier):
                continue  # a logical axis: checked against the mesh it is laid out on
            try:
                parse(f"x{modifier}")
            except ExpressionError as bad:
                problem = Problem(where, f"{modifier[:24]!r}: {bad.rule}")
                problems.append((_order([*at, "dims", dim]), problem))
    return problems


def _table_problem(where: str, path: list[Any], instance: Any) -> Problem:
    """What is wrong with a rule of `"logical_axis_rules"`, as the schema found it."""
    pair = (
        'a rule is a pair, a logical name and its mesh axes, such as ["embed", '
        '["fsdp", "sequence"]] or ["norm", null]'
    )
    if len(path) == 1:
        return Problem(where, f"{_short(instance)} is not a list of rules: {pair}")
    if len(path) == 2:
        return Problem(where, f"{_short(instance)} is not a rule: {pair}")
    if path[2] == 0:
        return Problem(
            where,
            f"{instance!r} is not a logical name: a letter or '_', then letters, '_', digits, "
            "'-' or '.'",
        )
    return Problem(
        where,
        f"{_short(instance)} is not a mesh axis, a list of mesh axes (each once, the major "
        "first), nor null (a whole dim)",
    )


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _named_problems(
    rule: Mapping[str, Any],
    dims: Any,
    tabled: set[str],
    name: str,
    schema_paths: set[str],
    at: list[Any],
) -> list[tuple[list[tuple[int, int, str]], Problem]]:
    """What the schema cannot say of a rule's `"dims"` (the rule at `at`): it names
    each dim once, with one `...` at most, and every name is a key of the `"dims"`
    beside its rules (the file's, or its section's) or a name of the file's
    `"logical_axis_rules"` (`tabled`)."""
    text = rule.get("dims")
    prefix = "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in at)
    where = f"{name}::${prefix}.dims"
    if not isinstance(text, str) or where in schema_paths:
        return []
    order = _order([*at, "dims"])
    try:
        named = Named(text)
    except ExpressionError as bad:
        return [(order, Problem.from_error(where, bad))]
    mapped = dims if isinstance(dims, dict) else {}
    section = [] if at[:1] == ["batch"] else at[:-2]  # a batch rule's dims are the file's
    place = "$" + "".join(f".{key}" for key in section) + ".dims"
    return [
        (order, Problem(where, unmapped_dim(place, dim, bool(tabled))))
        for dim in named.names
        if dim not in mapped and dim not in tabled
    ]


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
