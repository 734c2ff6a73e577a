"""The data of a spec file: `Rule` and `Rules`, and the batch's layout (an expression,
or `BatchRules`: rules over the batch's own paths).

`Rules` is what `load` gives and `dump` writes: path rules, a default, dims, a
declared mesh, the batch's layout and an optimizer section, each checked when it is
made. It is a resolver, ready for any model: how rules resolve against a model is
`_rules.py`, which knows them by their shape and imports nothing from here;
`Rules.match` and `Rules.__eqshard_resolve__` import it when called.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping, Sequence
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Literal

from .._errors import EqshardError, ExpressionError
from .._expression import Expression, is_logical_name, is_name, parse
from .._fit import MeshShape, declared_sizes
from .._fsdp import FSDP, FSDP_WORD
from .._layout import device_count_of
from .._logical import AxisRule, axis_rules
from .._paths._grammar import parse as parse_path
from .._paths._match import PathIndex
from .._problems import Problem
from ._schema import VERSION

if TYPE_CHECKING:
    from .._protocol import Resolution, Target
    from .._rules import Match

__all__ = [
    "BATCH_DEFAULTS",
    "INDIVISIBLE",
    "MEMORY_KINDS",
    "PARAMETER",
    "BatchRules",
    "Named",
    "Rule",
    "Rules",
    "batch_expression",
    "unmapped_dim",
]

PARAMETER = "parameter"
"""The optimizer section's default: each state leaf takes its parameter's layout."""


@dataclasses.dataclass(frozen=True)
class Named:
    """A rule's `"dims"`: the dims of the leaves it matches, named as a jaxtyping
    annotation names them (`Named("... hidden embed")`), each laid out by the file's
    `"dims"` as an annotated leaf with those names would be.

    **Attributes:**

    - `text`: the dims as written: logical names (`embed`, `dim1`), `_` for a dim with no name
        (whole), and at most one `...` (any number of dims, such as a stacked layer
        axis: whole), separated by spaces.
    - `items`: one per dim: its name, `None` for `_`, or `...`.

    **Raises:** `ExpressionError`, with a caret under the offending token, for text
    that is not such dims, or names a dim twice.
    """

    text: str
    items: tuple[str | EllipsisType | None, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise EqshardError(
                f"a rule's `dims` is text such as '... hidden embed', not {self.text!r}"
            )
        object.__setattr__(self, "items", _named_items(self.text))
        object.__setattr__(self, "text", " ".join(self.text.split()))

    @property
    def names(self) -> tuple[str, ...]:
        """The dim names it uses, in order."""
        return tuple(item for item in self.items if isinstance(item, str))

    def __str__(self) -> str:
        return self.text


def _named_items(text: str) -> tuple[str | EllipsisType | None, ...]:
    """The dims of a rule's `"dims"` text (see `Named`)."""
    items: list[str | EllipsisType | None] = []
    for found in re.finditer(r"\S+", text):
        token, at = found.group(), found.start()
        if token == "...":
            if ... in items:
                rule = "a second '...': at most one '...' stands for the dims no name covers"
                raise ExpressionError(text, at, rule, length=3)
            items.append(...)
        elif token == "_":
            items.append(None)
        elif is_logical_name(token):
            if token in items:
                rule = f"{token!r} is named twice; name each dim once, or write '_' for a dim"
                raise ExpressionError(text, at, rule + " with no name", length=len(token))
            items.append(token)
        else:
            rule = (
                f"{token!r} is not a dim: write names (a letter or '_', then letters, '_', "
                "digits, '-' or '.'), '_' for a dim with no name, and at most one '...', "
                "separated by spaces"
            )
            raise ExpressionError(text, at, rule, length=len(token))
    if not items:
        rule = "no dims: name each dim of the leaf ('hidden embed'), '...' for leading dims"
        raise ExpressionError(text, 0, rule, length=max(1, len(text)))
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One path rule of a spec file.

    **Attributes:**

    - `path`: a rule path (`blocks.*.attn.query_proj.weight`, `**.*_proj.weight`,
        `_weights['w[0,0] 16x0e']`).
    - `expr`: the expression a matching leaf gets, or `"fsdp"` (given as the word or as
        `eqshard.FSDP`): each matching leaf's own FSDP expression; or, for a rule that
        names dims (a file's `"dims": "... hidden embed"`), a `Named`: each matching
        leaf is laid out by the `Rules`' `dims`, as a leaf with the jaxtyping
        annotation `"... hidden embed"` would be.
    - `comment`: the rule's comment, if any.
    - `index`: its place in the file's `rules` list.
    - `memory`: where the matching leaves are held: `"device"` (the devices' own memory)
        or `"pinned_host"` (host memory, as a `NamedSharding`'s memory kind); `None` for
        the default, the device.
    """

    path: str
    expr: Expression | Literal["fsdp"] | Named
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
        elif not isinstance(self.expr, Named):
            object.__setattr__(self, "expr", parse(self.expr))


_DEFAULTS = ("replicate", "error", FSDP_WORD)

MEMORY_KINDS = ("device", "pinned_host")
"""The memory kinds a rule may name: the devices' own memory, or pinned host memory."""

BATCH_DEFAULTS = ("replicate", "error")
"""The words a batch section's `default` may be, beside a complete expression."""

INDIVISIBLE = ("error", "replicate")
"""What a batch leaf gets whose layout does not divide it: an error, or a whole copy."""


@dataclasses.dataclass(frozen=True)
class BatchRules:
    """How a training step's batch is laid out, leaf by leaf: rules over the batch's
    own paths (a spec file's `"batch"` section), for `eqshard.jit`, `eqshard.cost`,
    `eqshard check --step` and `eqshard.testing`.

    **Example:**

    ```python
    batch = eqshard.BatchRules(
        rules=(eqshard.Rule("{nodes,edges}", eqshard.expression.parse("b ... -> b* ...")),),
        default="replicate",            # per-graph leaves: whole on every device
    )
    step = eqshard.jit(train_step, batch=batch)
    ```

    **Attributes:**

    - `rules`: `Rule`s with complete expressions, or dims by name (`Named`, laid out
        by the file's `dims` and `logical_axis_rules` on its mesh), tried in order: the
        first whose path matches a leaf's path within its argument lays it out (see
        "Paths").
    - `default`: what a leaf no rule matches gets: a complete expression,
        `"replicate"`, `"error"`, or `None`: data parallel, as with no batch layout.
    - `indivisible`: what a leaf gets whose layout does not divide its dims over the
        devices: `"error"` (the default), or `"replicate"` (a whole copy, named in an
        `eqshard.IndivisibleBatchWarning`).
    - `comment`: free text for the reader, or `None`.
    - `source`: the file, for messages (a `Rules`' own).

    **Raises:**

    `eqshard.EqshardError` for a rule that is not a `Rule` or names a memory kind, or
    a `default` or `indivisible` not listed above; `eqshard.ExpressionError`, with a
    caret, for an expression that is not complete.

    !!! info "Paths"

        A batch leaf's path is within its argument, as eqshard names leaves: `nodes`
        for `graph.nodes` (a `NamedTuple`'s or a dataclass's attribute), `x` for
        `batch["x"]`, `0` for `batch[0]`. An argument that is one array has the
        empty path, which `**` matches. A scalar is whole on every device.
    """

    rules: tuple[Rule, ...] = ()
    default: Expression | str | None = None
    indivisible: Literal["error", "replicate"] = "error"
    comment: str | None = None
    source: str = "<rules>"

    def __post_init__(self) -> None:
        if isinstance(self.rules, (str, Rule)) or not isinstance(self.rules, Sequence):
            raise EqshardError(
                f"`BatchRules.rules` is a tuple of `eqshard.Rule`, not {self.rules!r}"
            )
        numbered = []
        for i, rule in enumerate(self.rules):
            if not isinstance(rule, Rule):
                raise EqshardError(f"`BatchRules.rules[{i}]` is an `eqshard.Rule`, not {rule!r}")
            if not isinstance(rule.expr, (Expression, Named)):
                raise EqshardError(
                    f"`BatchRules.rules[{i}]` ({rule.path!r}) lays out batch leaves by a "
                    "complete expression such as 'b ... -> b* ...', or by dims by name, not "
                    f"{str(rule.expr)!r}: 'fsdp' lays out parameters"
                )
            if rule.memory is not None:
                raise EqshardError(
                    f"`BatchRules.rules[{i}]` ({rule.path!r}) names the memory kind "
                    f"{rule.memory!r}; a batch is laid out in the devices' memory: drop it"
                )
            if isinstance(rule.expr, Expression):
                batch_expression(rule.expr)
            numbered.append(rule if rule.index == i else dataclasses.replace(rule, index=i))
        object.__setattr__(self, "rules", tuple(numbered))
        default = self.default
        if isinstance(default, str) and default not in BATCH_DEFAULTS and "->" not in default:
            raise EqshardError(
                "`BatchRules.default` is a complete expression such as 'b ... -> b* ...', "
                f"'replicate', 'error', or None (data parallel), not {default!r}"
            )
        if default is not None and default not in BATCH_DEFAULTS:
            object.__setattr__(self, "default", batch_expression(default))
        if self.indivisible not in INDIVISIBLE:
            raise EqshardError(
                "`BatchRules.indivisible` is 'error' or 'replicate' (a whole copy on every "
                f"device), not {self.indivisible!r}"
            )
        if self.comment is not None and not isinstance(self.comment, str):
            raise EqshardError(f"`BatchRules.comment` is text for the reader, not {self.comment!r}")

    @property
    def section(self) -> str:
        """Where these rules sit in their file: `"$.batch"`."""
        return "$.batch"

    def where(self, json_path: str) -> str:
        """`file::$.batch...`: `json_path` (`"$.rules[2]"`) within the section, in messages."""
        return f"{self.source}::{self.section}{json_path[1:]}"

    def rule_for(self, segments: Sequence[str]) -> Rule | None:
        """The first rule whose path matches a leaf's path (its segments), or `None`."""
        position = _batch_index(tuple(rule.path for rule in self.rules)).first(segments)
        return None if position is None else self.rules[position]

    def to_json(self) -> dict[str, Any]:
        """The file's `"batch"` section that loads back to these rules."""
        section: dict[str, Any] = {}
        if self.comment is not None:
            section["comment"] = self.comment
        if self.default is not None:
            section["default"] = str(self.default)
        section["indivisible"] = self.indivisible
        section["rules"] = [
            {
                "path": r.path,
                ("dims" if isinstance(r.expr, Named) else "expr"): str(r.expr),
                **({"comment": r.comment} if r.comment else {}),
            }
            for r in self.rules
        ]
        return section


@functools.lru_cache(maxsize=64)
def _batch_index(paths: tuple[str, ...]) -> PathIndex:
    """The index of a batch section's rule paths, as `_rules.py` indexes a file's."""
    return PathIndex(list(paths))


@dataclasses.dataclass(frozen=True, eq=False)
class Rules:
    """The rules of a spec file: a resolver, ready for any model.

    Pass it wherever eqshard takes a spec: `eqshard.apply(model, rules)`,
    `eqshard.plan(model, rules)`, `eqshard.spec_tree(model, rules)`.

    **Attributes:**

    - `rules`: a tuple of `Rule`.
    - `default`: what a leaf no rule or dim matches gets: `"replicate"`, `"error"` or
        `"fsdp"`.
    - `devices`: the device count the file was written for, or `None`.
    - `dims`: dim name to a modifier, a mesh axis name, a tuple of them (the dim split
        over each, the major first), or `None` for a whole dim (see "Dims").
    - `logical_axis_rules`: Flax's and MaxText's ordered table, `(name, axes)` pairs
        (`axes` a mesh axis, a tuple of them, or `None`), resolved as they resolve it;
        or `None` (see "Dims").
    - `source`: the file name, for messages.
    - `mesh`: the declared mesh: each axis's name and size (`None` for the one `"*"`
        axis); or `None`. The optimizer section shares its file's.
    - `batch`: how the step's batch is laid out: a complete `Expression` for every
        leaf, or `BatchRules`, leaf by leaf (see "The batch").
    - `optimizer`: the file's `"optimizer"` section, itself a `Rules` (see "The
        optimizer section").
    - `section`: where these rules sit in their file: `"$"`, or `"$.optimizer"` for that
        section.
    - `comment`: the file's or the section's `"comment"`, free text for the reader, or
        `None`.

    How `dims` and `logical_axis_rules` lay out named dims, and how they differ, is in
    the guide "Coming from Flax, MaxText or plain JAX"; the batch's rules in "Spec
    files and the schema"; the optimizer section in "Activations, optimizer state and
    host memory".
    """

    rules: tuple[Rule, ...] = ()
    default: Literal["replicate", "error", "fsdp", "parameter"] = "replicate"
    devices: int | None = None
    dims: Mapping[str, str | tuple[str, ...] | None] = dataclasses.field(default_factory=dict)
    source: str = "<rules>"
    mesh: tuple[tuple[str, int | None], ...] | None = None
    batch: Expression | BatchRules | None = None
    optimizer: Rules | None = None
    section: str = "$"
    comment: str | None = None
    logical_axis_rules: Sequence[Sequence[Any]] | None = None  # last: positions unchanged

    def __post_init__(self) -> None:
        if self.comment is not None and not isinstance(self.comment, str):
            raise EqshardError(f"`Rules.comment` is text for the reader, not {self.comment!r}")
        object.__setattr__(self, "dims", _dims_of(self.dims))
        if self.logical_axis_rules is not None:
            table = axis_rules(self.logical_axis_rules, "`Rules.logical_axis_rules`")
            object.__setattr__(
                self,
                "logical_axis_rules",
                tuple((rule.name, rule.axes or None) for rule in table),
            )
        if self.devices is not None:
            device_count_of(self.devices, "`Rules.devices`")
        for name, size in self.mesh or ():
            if size is not None:
                device_count_of(size, f"the size of `Rules.mesh`'s axis {name!r}")
        if self.default not in (*_DEFAULTS, PARAMETER):
            raise EqshardError(
                "`Rules.default` is 'replicate', 'error' or 'fsdp' (or, for the optimizer "
                "state, 'parameter'), not " + repr(self.default)
            )
        if isinstance(self.batch, BatchRules):
            if self.batch.source != self.source:  # the section's faults name this file
                object.__setattr__(
                    self, "batch", dataclasses.replace(self.batch, source=self.source)
                )
        elif self.batch is not None:
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
            if self.optimizer.mesh is None and self.mesh is not None:  # the file's mesh
                section = dataclasses.replace(self.optimizer, mesh=self.mesh)
                object.__setattr__(self, "optimizer", section)
            if self.optimizer.logical_axis_rules is None and self.logical_axis_rules:
                section = dataclasses.replace(
                    self.optimizer, logical_axis_rules=self.logical_axis_rules
                )
                object.__setattr__(self, "optimizer", section)
        tabled = {name for name, _ in self.logical_axis_rules or ()}
        batch_rules = self.batch.rules if isinstance(self.batch, BatchRules) else ()
        placed = [("$", r) for r in self.rules] + [("$.batch", r) for r in batch_rules]
        for at, rule in placed:  # a typo must never silently leave a dim whole
            if isinstance(rule.expr, Named):
                for name in rule.expr.names:
                    if name not in self.dims and name not in tabled:
                        where = self.at(f"{at}.rules[{rule.index}].dims")
                        unmapped = unmapped_dim(self.at("$.dims"), name, bool(tabled))
                        raise EqshardError(f"{where}: {unmapped}")

    @property
    def axis_rules(self) -> tuple[AxisRule, ...]:
        """The table the dims are placed by: `dims`' entries of mesh axes first (their
        `index` -1), then `logical_axis_rules` in order (see "Dims")."""
        return _axis_rules_of(self)

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
        sizes = declared_sizes(self.mesh, devices)
        if sizes is None:
            fixed = math.prod(size for _, size in self.mesh if size is not None)
            star = any(size is None for _, size in self.mesh)
            need = f"a multiple of {fixed}" if star else str(fixed)
            return None, [
                Problem(
                    self.where("$.mesh"),
                    f"the mesh {_mesh_text(self.mesh)} needs {need} devices, and the spec "
                    f'is laid out on {devices}; use {need} devices, or change "mesh"',
                    file=self.source,
                )
            ]
        return MeshShape(names, sizes), []

    def to_json(self) -> dict[str, Any]:
        """The document of a spec file that loads back to these rules (without
        `"$schema"`, which says where the file's schema is: `dump` adds it)."""
        document: dict[str, Any] = {"eqshard": VERSION}
        if self.comment is not None:
            document["comment"] = self.comment
        if self.devices is not None:
            document["devices"] = self.devices
        document["default"] = self.default
        document["rules"] = _rules_json(self)
        if self.dims:
            document["dims"] = _dims_json(self.dims)
        if self.logical_axis_rules is not None:
            document["logical_axis_rules"] = [
                [name, None if axes is None else list(axes)]
                for name, axes in self.logical_axis_rules
            ]
        if self.mesh is not None:
            document["mesh"] = [[name, "*" if size is None else size] for name, size in self.mesh]
        if isinstance(self.batch, BatchRules):
            document["batch"] = self.batch.to_json()
        elif self.batch is not None:
            document["batch"] = str(self.batch)
        if self.optimizer is not None:
            section = self.optimizer
            document["optimizer"] = {
                **({"comment": section.comment} if section.comment is not None else {}),
                "default": section.default,
                "rules": _rules_json(section),
            }
            if section.dims:
                document["optimizer"]["dims"] = _dims_json(section.dims)
        return document


@functools.lru_cache(maxsize=64)
def _axis_rules_of(rules: Rules) -> tuple[AxisRule, ...]:
    """`Rules.axis_rules`, made once per `Rules` (compared by identity)."""
    first = [
        AxisRule(name, (value,) if isinstance(value, str) else value or (), -1)
        for name, value in rules.dims.items()
        if value is None or isinstance(value, tuple) or is_name(value)
    ]
    return (*first, *axis_rules(rules.logical_axis_rules or ()))


def _dims_of(dims: Any) -> dict[str, str | tuple[str, ...] | None]:
    """`Rules.dims` as held: a dict, each list of mesh axes a tuple.

    **Raises:** `EqshardError` for a value that is none of what `dims` maps to."""
    if not isinstance(dims, Mapping):
        raise EqshardError(f"`Rules.dims` maps dim names to their layouts, not {dims!r}")
    held: dict[str, str | tuple[str, ...] | None] = {}
    for name, value in dims.items():
        if isinstance(value, (list, tuple)) and all(isinstance(a, str) for a in value):
            held[name] = tuple(value)
        elif value is None or isinstance(value, str):
            held[name] = value
        else:
            raise EqshardError(
                f"`Rules.dims[{name!r}]` is a shard modifier ('2', '*'), a mesh axis, a list "
                f"of mesh axes, or None (whole), not {value!r}"
            )
    return held


def _dims_json(dims: Mapping[str, str | tuple[str, ...] | None]) -> dict[str, Any]:
    """`dims` as a spec file writes them: a tuple of mesh axes as a list."""
    return {name: list(v) if isinstance(v, tuple) else v for name, v in dims.items()}


def unmapped_dim(dims: str, name: str, table: bool = False) -> str:
    """What is wrong with a rule's `"dims"` that names `name`, which the `"dims"` at
    the JSON path `dims` (`"$.dims"`) do not map, nor the file's `"logical_axis_rules"`
    where it has them (`table`): a typo would leave the dim whole."""
    if table:
        return (
            f"`{name}`, which neither {dims} nor $.logical_axis_rules maps; map it in one "
            "of them or fix the name"
        )
    return f"`{name}`, which {dims} does not map; map it in {dims} or fix the name"


def _rules_json(rules: Rules) -> list[dict[str, Any]]:
    """The `"rules"` of a spec file's document: each rule's path, expression (or
    named dims), memory kind and comment."""
    return [
        {
            "path": r.path,
            ("dims" if isinstance(r.expr, Named) else "expr"): str(r.expr),
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


def _mesh_text(mesh: Sequence[tuple[str, int | None]]) -> str:
    """A declared mesh as text: `('data': *, 'model': 2)`."""
    return "(" + ", ".join(f"{n!r}: {'*' if s is None else s}" for n, s in mesh) + ")"
