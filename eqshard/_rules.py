"""Rules against a model: how each leaf of a model gets its expression from a spec file.

How a leaf gets its expression, in order:

1. **rules**: the first rule whose `path` matches the leaf's dotted path (found
   through a `PathIndex`, so rules that cannot match cost nothing); a rule that
   names dims (`"dims": "... hidden embed"`) gives what `dims` give a leaf with
   that annotation (`dims_expression`), and a leaf of another rank a problem;
2. **dims**: for a leaf no rule matched, whose field has a jaxtyping annotation
   naming a dim in `dims`: the annotation's dims in order, each with its
   modifier (`{"mlp": "*"}` on `Float[Array, "embed mlp"]` gives
   `"embed mlp -> embed mlp*"`);
3. **default**: `"replicate"` (a full copy on every device), `"error"`, or
   `"fsdp"`.

A rule's `"expr": "fsdp"` and `"default": "fsdp"` give each leaf its own FSDP
expression (`_fsdp.py`), over the target's mesh; its origin says so:
`"$.rules[3] (fsdp)"`, `"default (fsdp: replicated, no dim of [3] is a multiple of 8)"`.

The rules themselves are data of the spec-file layer (`_specfile.Rules`, which
imports no JAX); this module knows them only by their shape (`RuleSet`) and imports
nothing of that layer. `Rules.match` and `Rules.__eqshard_resolve__` call in here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from types import EllipsisType
from typing import Any, Literal, Protocol

import equinox as eqx
import jax
import numpy as np

from ._annotation import Annotation, complete, for_rank
from ._errors import ExpressionError
from ._expression import Expression, is_name, name_text, parse
from ._fields import (
    LeafInfo,
    is_array_like,
    is_stateful_pair,
    key_paths,
    leaf_name,
    state_leaf_names,
    walk_fields,
)
from ._fit import declared_sizes
from ._fsdp import FSDP_WORD, Over, fsdp_leaf, over
from ._logical import AxisRule, Placed, place
from ._paths._closest import Guesses
from ._paths._match import PathIndex, match
from ._paths._names import segments
from ._problems import Problem, named
from ._protocol import Resolution, Target
from ._sharding import device_tuple
from ._warnings import (
    EqshardWarning,
    MeshWarning,
    UnusedRule,
    UnusedRuleWarning,
    unused_message,
)

__all__ = [
    "MESH_REFUSED",
    "Match",
    "MeshRefused",
    "NamedDims",
    "PathRule",
    "RuleSet",
    "dims_expression",
    "is_axis",
    "match_rules",
    "resolve_rules",
]

_REPLICATE = parse("... -> * ...")


class MeshRefused:
    """What `dims` give a leaf whose dims they map to mesh axes where the spec declares
    a mesh that the device count refuses: no expression, and no problem of the leaf's
    own, as the mesh's own problem (`__eqshard_mesh__`, at `$.mesh`) says what is wrong
    and how to fix it. `MESH_REFUSED` is the one value."""

    def __repr__(self) -> str:
        return "MESH_REFUSED"


MESH_REFUSED = MeshRefused()


class NamedDims(Protocol):
    """What the matcher reads of a rule's `"dims"` (`_specfile.Named`): the dims of
    the leaves it matches, by name, as a jaxtyping annotation names them."""

    @property
    def text(self) -> str: ...  # "... hidden embed"
    @property
    def items(self) -> tuple[str | EllipsisType | None, ...]: ...  # a name, None (`_`), ...


class PathRule(Protocol):
    """What the matcher reads of a path rule (`_specfile.Rule`)."""

    @property
    def path(self) -> str: ...
    @property
    def expr(self) -> Expression | str | NamedDims: ...  # or "fsdp", or dims by name
    @property
    def index(self) -> int: ...
    @property
    def memory(self) -> str | None: ...


class RuleSet(Protocol):
    """What the matcher reads of a spec file's rules (`_specfile.Rules`, or its
    optimizer section)."""

    @property
    def rules(self) -> Sequence[PathRule]: ...
    @property
    def default(self) -> str: ...  # "replicate", "error", "fsdp" or "parameter"
    @property
    def devices(self) -> int | None: ...
    @property
    def dims(self) -> Mapping[str, str | tuple[str, ...] | None]: ...
    @property
    def logical_axis_rules(self) -> Sequence[Sequence[Any]] | None: ...  # held as pairs
    @property
    def axis_rules(self) -> tuple[AxisRule, ...]: ...  # dims' mesh axes, then the table
    @property
    def source(self) -> str: ...
    @property
    def section(self) -> str: ...
    @property
    def mesh(self) -> Sequence[tuple[str, int | None]] | None: ...  # the declared mesh
    def where(self, json_path: str) -> str: ...
    def at(self, json_path: str) -> str: ...


@dataclasses.dataclass(frozen=True)
class Match:
    """How one leaf got its expression.

    **Attributes:**

    - `path`: the leaf's dotted path.
    - `expr`: its expression (see "Expressions").
    - `source`: `"rule"`, `"dims"`, `"default"`, or `"none"` for leaves that are not
        arrays.
    - `rule_index`: the index in the file's `rules` of the matching rule, when `source`
        is `"rule"`.
    - `fsdp`: for an expression FSDP chose, `"fsdp"`, or `"fsdp: replicated, <why>"`
        (see "FSDP"); else `None`.
    - `memory`: the memory kind the matching rule names (`"pinned_host"`), else `None`
        (the device's).
    - `section`: where the rules sit in their file: `"$"`, or `"$.optimizer"`.
    - `placed`: under `logical_axis_rules`, which rule placed each named dim
        (`"embed: $.logical_axis_rules[4], mlp: whole (no rule)"`); else `None`.

    !!! info "Expressions"

        Under `"default": "replicate"`, leaves nothing else matched get
        `"... -> * ..."`. `expr` is `None` under `"default": "error"`, and for leaves
        that are not arrays.

    !!! info "FSDP"

        FSDP chose the expression for a rule's `"fsdp"`, or under `"default": "fsdp"`.
        `"fsdp: replicated, <why>"` marks a leaf it could not split.
    """

    path: str
    expr: Expression | None
    source: Literal["rule", "dims", "default", "none"]
    rule_index: int | None = None
    fsdp: str | None = None
    memory: str | None = None
    section: str = "$"
    placed: str | None = None

    @property
    def place(self) -> str | None:
        """`"$.rules[2]"`, `"dims"` or `"default"` (in the optimizer section
        `"$.optimizer.rules[2]"`, `"$.optimizer.dims"`, `"$.optimizer.default"`):
        what gave the expression."""
        if self.source == "rule":
            return f"{self.section}.rules[{self.rule_index}]"
        if self.source == "none":
            return None
        return self.source if self.section == "$" else f"{self.section}.{self.source}"

    @property
    def origin(self) -> str | None:
        """Where the expression came from: the `place`, with how FSDP chose it where
        it did (`"default (fsdp)"`)."""
        place = self.place
        how = self.fsdp or self.placed
        return place if how is None or place is None else f"{place} ({how})"


@functools.lru_cache(maxsize=64)
def _index(rules: RuleSet) -> PathIndex:
    return PathIndex([rule.path for rule in rules.rules])


def _from_dims(
    rules: RuleSet, item: LeafInfo | None, mesh: Any
) -> tuple[Expression | Problem | MeshRefused | None, str | None]:
    """The expression `dims` give a leaf, from its annotation (see `dims_expression`),
    and which rule placed each dim (`placing`)."""
    if item is None or item.annotation is None:
        return None, None
    annotation = for_rank(item.annotation, len(getattr(item.leaf, "shape", ())))
    found = dims_expression(rules, annotation, item.label, mesh)
    return found, placing(rules, annotation, mesh) if isinstance(found, Expression) else None


def _from_rule_dims(
    rules: RuleSet, rule: PathRule, named: NamedDims, label: str, leaf: Any, mesh: Any
) -> Expression | Problem | MeshRefused:
    """The expression a rule's `"dims"` gives a leaf: what `dims` give a leaf whose
    jaxtyping annotation names its dims so (see `dims_expression`); whole where
    `dims` maps none of them."""
    shape = tuple(getattr(leaf, "shape", ()))
    annotation = _rule_annotation(rules, rule, named, leaf)
    count = sum(1 for item in annotation.items if item is not ...)
    if count > len(shape) or (... not in annotation.items and count != len(shape)):
        return Problem(
            label,
            f"{rules.where(f'$.rules[{rule.index}]')} names {count} dims ({named.text!r}), "
            f"and this leaf has {len(shape)} {shape}; name one dim per axis, with '...' "
            "for leading dims the rule does not name",
        )
    expr = dims_expression(rules, annotation, label, mesh)
    return _REPLICATE if expr is None else expr


def _rule_annotation(rules: RuleSet, rule: PathRule, named: NamedDims, leaf: Any) -> Annotation:
    """The annotation a rule's `"dims"` stands for, on a leaf of `leaf`'s rank."""
    text = f"{rules.at(f'$.rules[{rule.index}]')}.dims {named.text!r}"
    return for_rank(Annotation(text, named.text, named.items), len(getattr(leaf, "shape", ())))


def placing(rules: RuleSet, annotation: Annotation, mesh: Any) -> str | None:
    """Under `logical_axis_rules`, which rule placed each named dim of `annotation`,
    for reports: `"embed: $.logical_axis_rules[4], mlp: $.dims, norm: whole (no
    rule)"`; `None` without a table."""
    if not rules.logical_axis_rules:
        return None
    placed = placed_dims(rules, annotation, mesh)
    if placed is None:
        return None
    named = [d for d in annotation.items if d is not ...]
    parts = []
    for name, where in zip(named, placed):
        if not isinstance(name, str):
            continue
        if where.rule is None:
            parts.append(f"{name}: whole (no rule)")
        elif where.rule.index < 0:
            parts.append(f"{name}: {rules.at('$.dims')}")
        else:
            kept = ", ".join(where.axes) or "whole"
            dropped = f", {' '.join(where.dropped)} dropped" if where.dropped else ""
            parts.append(f"{name}: $.logical_axis_rules[{where.rule.index}] ({kept}{dropped})")
    return "; ".join(parts) or None


def is_axis(mapped: str | None) -> bool:
    """Whether a value of `dims` names a mesh axis (a logical axis), rather than
    being a shard modifier (`"*"`, `"4"`) or `None` (JSON `null`: the dim is whole)."""
    return mapped is not None and is_name(mapped)


def dims_expression(
    rules: RuleSet, annotation: Annotation, label: str, mesh: Any, noun: str = "leaf"
) -> Expression | Problem | MeshRefused | None:
    """The expression `dims` give the array `label` whose dims `annotation` names:
    modifiers in the annotation's order, or logical axes laid out in the order of
    `mesh`'s axes; a dim mapped to `None` (JSON `null`) and a dim `dims` leaves out
    are whole. `None` where `dims` maps none of its dims. A parameter's annotation
    and an activation's names (`eqshard.constrain(x, ("batch", "embed"))`) go
    through here alike; `noun` names the array in messages ("leaf", "array").
    `MESH_REFUSED` where a dim is mapped to a mesh axis and the spec's declared mesh
    does not fit the device count."""
    names = [d for d in annotation.items if isinstance(d, str)]
    mapped = {d: rules.dims[d] for d in names if d in rules.dims}
    tabled = {rule.name for rule in rules.axis_rules if rule.index >= 0}.intersection(names)
    if not mapped and not tabled:
        return None
    where = ", ".join(f"{rules.at('$.dims')}.{d}" for d in mapped)
    logical = {d: axes for d, axes in mapped.items() if axes is not None and _on_mesh(axes)}
    if logical or tabled:
        alone = all(m is None or d in logical for d, m in mapped.items())
        single = {d: axis for d, axis in logical.items() if isinstance(axis, str)}
        if tabled or len(single) < len(logical):  # the ordered table, or a dim over several
            placed = _placed(rules, annotation, label, logical, alone, mesh, noun)
            if isinstance(placed, (Problem, MeshRefused)):
                return placed
            try:
                return parse(placed)
            except ExpressionError as error:
                return Problem.from_error(label, error, f"from {rules.source}")
        short = _logical(rules, label, single, alone, mesh, noun)
        if isinstance(short, (Problem, MeshRefused)):
            return short
    else:  # modifiers in the annotation's order; only whole dims: replicated
        whole = all(m is None for m in mapped.values())
        short = " ".join(
            ["*"] * whole + [f"{name_text(d)}{rules.dims.get(d) or ''}" for d in names]
        )
    try:
        return complete(parse(short), annotation)
    except ExpressionError as error:
        return Problem.from_error(label, error, f"from {rules.source}::{where}")


def _on_mesh(mapped: str | tuple[str, ...] | None) -> bool:
    """Whether a value of `dims` splits its dim over mesh axes (a name, or a tuple of
    them), rather than being a shard modifier or whole."""
    return isinstance(mapped, tuple) or is_axis(mapped)


def _mesh_sizes(
    rules: RuleSet,
    label: str,
    logical: Mapping[str, str | tuple[str, ...]],
    alone: bool,
    mesh: Any,
    noun: str,
) -> dict[str, int] | Problem | MeshRefused:
    """The mesh's axis sizes, once `dims`' mesh axes for one array are checked: every
    dim of it mapped the same way, a mesh to lay it out on, each axis on that mesh, and
    no axis splitting two dims."""
    where = ", ".join(f"{rules.at('$.dims')}.{d}" for d in logical)
    if not alone:
        return Problem(
            label,
            f"{rules.source}::{where} map dims of this {noun} to mesh axes, and other dims "
            f"of it to shard modifiers; map every dim of one {noun} the same way",
        )
    if isinstance(mesh, MeshRefused):
        return mesh
    if mesh is None:
        dim, axes = next(iter(logical.items()), (None, None))
        what = (
            f"{rules.where('$.dims')}.{dim} maps {dim!r} to the mesh axis {axes!r}, and"
            if dim is not None
            else f"{rules.where('$.logical_axis_rules')} maps this {noun}'s dims to mesh axes, and"
        )
        return Problem(
            label, f'{what} there is no mesh; declare "mesh" in {rules.source}, or pass `mesh=`'
        )
    sizes = {str(n): int(s) for n, s in zip(mesh.axis_names, mesh.axis_sizes)}
    by_axis: dict[str, str] = {}
    for dim, mapped in logical.items():
        for axis in (mapped,) if isinstance(mapped, str) else mapped:
            if axis not in sizes:
                return Problem(
                    label,
                    f"{rules.where('$.dims')}.{dim} maps {dim!r} to the mesh axis {axis!r}, "
                    f"and the mesh has the axes {', '.join(map(repr, sizes))}; name one of them",
                )
            if axis in by_axis:
                return Problem(
                    label,
                    f"{rules.source}::{where} map both {by_axis[axis]!r} and {dim!r} of this "
                    f"{noun} to the mesh axis {axis!r}; a mesh axis splits one dim of "
                    f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}",
                )
            by_axis[axis] = dim
    return sizes


def _logical(
    rules: RuleSet, label: str, logical: dict[str, str], alone: bool, mesh: Any, noun: str
) -> str | Problem | MeshRefused:
    """The short form that splits each dim over its mesh axis, in the mesh's order,
    and replicates over the other axes."""
    sizes = _mesh_sizes(rules, label, logical, alone, mesh, noun)
    if not isinstance(sizes, dict):
        return sizes
    by_axis = {axis: dim for dim, axis in logical.items()}
    return " ".join(
        f"{name_text(by_axis[axis])}{size}" if axis in by_axis else str(size)
        for axis, size in sizes.items()
    )


def placed_dims(rules: RuleSet, annotation: Annotation, mesh: Any) -> tuple[Placed, ...] | None:
    """Where `dims` and `logical_axis_rules` put each dim of `annotation` (`...`
    left out) on `mesh`, the table's way (`_logical.place`); `None` where neither
    names a dim of it, or there is no mesh to say."""
    names = [d for d in annotation.items if d is not ...]
    if (
        mesh is None
        or isinstance(mesh, MeshRefused)
        or not any(rule.name in names for rule in rules.axis_rules)
    ):
        return None
    sizes = {str(n): int(s) for n, s in zip(mesh.axis_names, mesh.axis_sizes)}
    return place([d if isinstance(d, str) else None for d in names], rules.axis_rules, sizes)


def _placed(
    rules: RuleSet,
    annotation: Annotation,
    label: str,
    logical: Mapping[str, str | tuple[str, ...]],
    alone: bool,
    mesh: Any,
    noun: str,
) -> str | Problem | MeshRefused:
    """The complete expression that lays each dim out where `placed_dims` puts it: a
    dim over one mesh axis named on it, a dim over several a group of its own names
    for them (`('embed.fsdp' 'embed.sequence')`), the mesh's other axes replication
    counts (those of size 1 left out), whole dims named at the end."""
    sizes = _mesh_sizes(rules, label, logical, alone, mesh, noun)
    if not isinstance(sizes, dict):
        return sizes
    placed = placed_dims(rules, annotation, mesh)
    assert placed is not None  # the mesh is there, and a rule names a dim
    taken = {d for d in annotation.items if isinstance(d, str)}
    lhs: list[str] = []
    on_axis: dict[str, str] = {}
    whole: list[str] = []
    at = iter(placed)
    for item in annotation.items:
        if item is ...:
            lhs.append("...")
            continue
        axes = next(at).axes
        if item is None or not axes:
            name = item if item is not None else _fresh(taken, "_")
            lhs.append(name_text(name))
            whole.append(name)
        elif len(axes) == 1:
            lhs.append(name_text(item))
            on_axis[axes[0]] = item
        else:
            parts = [_fresh(taken, f"{item}.{axis}") for axis in axes]
            lhs.append(f"({' '.join(map(name_text, parts))})")
            on_axis.update(zip(axes, parts))
    rhs: list[str] = []
    copies = 1
    for axis, size in sizes.items():
        if axis in on_axis:
            rhs += [str(copies)] if copies > 1 else []
            rhs.append(f"{name_text(on_axis[axis])}{size}")
            copies = 1
        else:
            copies *= size
    rhs += [str(copies)] if copies > 1 else []
    rhs += [name_text(name) for name in whole] + (["..."] if "..." in lhs else [])
    return f"{' '.join(lhs)} -> {' '.join(rhs) or '...'}"


def _fresh(taken: set[str], name: str) -> str:
    """`name`, or it with `_` added until no other name of the array has it; taken now."""
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def match_rules(
    rules: RuleSet, model: Any, target: Target | None = None
) -> tuple[list[Match], list[Problem]]:
    """How each leaf of `model` gets its expression under `rules`, and what went wrong.

    The problems are: leaves no rule or dim matches under `"default": "error"`,
    and dims-derived expressions that do not fit their annotation (those leaves get
    `None`).
    """
    context = None if target is None else target.context
    flat = list(zip(key_paths(model, context), jax.tree_util.tree_leaves(model)))
    fsdp = rules.default == FSDP_WORD or any(rule.expr == FSDP_WORD for rule in rules.rules)
    named = any(not isinstance(rule.expr, (Expression, str)) for rule in rules.rules)
    tabled = bool(rules.dims or rules.logical_axis_rules)
    fields = walk_fields(model, context) if tabled or fsdp or named else None
    fallback = _REPLICATE if rules.default == "replicate" else None  # "parameter": none
    section = rules.section
    index = _index(rules)
    mesh = None if target is None else target.mesh
    declared = rules.mesh
    if target is not None and mesh is None and declared is not None:
        refused = declared_sizes(declared, target.devices) is None
        mesh = MESH_REFUSED if refused else None  # refused: the mesh's own problem says so

    @functools.cache
    def split() -> Over:  # what FSDP splits over, once, where a leaf needs it
        return over(target or Target(len(device_tuple(None))))

    def by_fsdp(i: int, leaf: Any) -> tuple[Expression, str]:
        return fsdp_leaf(leaf.shape, fields[i].annotation if fields else None, split())

    matches: list[Match] = []
    problems: list[Problem] = []
    unmatched: list[int] = []
    for i, (path, leaf) in enumerate(flat):
        name = leaf_name(path)
        if not is_array_like(leaf):
            matches.append(Match(name, None, "none", section=section))
            continue
        position = index.first(segments(path))
        if position is not None:
            rule = rules.rules[position]
            if isinstance(rule.expr, Expression):
                expr, how = rule.expr, None
            elif isinstance(rule.expr, str):  # "fsdp"
                expr, how = by_fsdp(i, leaf)
            else:  # dims by name, laid out through `dims`
                label = fields[i].label if fields else name
                found = _from_rule_dims(rules, rule, rule.expr, label, leaf, mesh)
                if isinstance(found, (Problem, MeshRefused)):
                    if isinstance(found, Problem):
                        problems.append(found)
                    matches.append(
                        Match(name, None, "rule", rule.index, None, rule.memory, section)
                    )
                    continue
                by = placing(rules, _rule_annotation(rules, rule, rule.expr, leaf), mesh)
                matches.append(
                    Match(name, found, "rule", rule.index, None, rule.memory, section, by)
                )
                continue
            matches.append(Match(name, expr, "rule", rule.index, how, rule.memory, section))
            continue
        expr, by = _from_dims(rules, fields[i] if fields else None, mesh)
        if isinstance(expr, (Problem, MeshRefused)):
            if isinstance(expr, Problem):
                problems.append(expr)
            matches.append(Match(name, None, "dims", section=section))
            continue
        if expr is not None:
            matches.append(Match(name, expr, "dims", section=section, placed=by))
            continue
        if rules.default == FSDP_WORD:
            expr, how = by_fsdp(i, leaf)
            matches.append(Match(name, expr, "default", fsdp=how, section=section))
            continue
        if rules.default == "error":
            unmatched.append(i)
        matches.append(Match(name, fallback, "default", section=section))
    if unmatched:
        fields = fields or walk_fields(model, context)
        state = looks_like_state(model)
        message = (
            f"no rule or dim matches this leaf, and {rules.source} says "
            '"default": "error"; add a rule whose path matches it, or set '
            '"default": "replicate"'
        )
        if state is not None:
            message += f"; {state}"
        problems += [Problem(fields[i].label, message) for i in unmatched]
    return matches, problems


def looks_like_state(tree: Any) -> str | None:
    """Why `tree` looks like an optimizer state built from a model, and how to lay
    it out: with the model's plan. `None` when it does not.

    It does when it holds optax's state classes (`ScaleByAdamState`), or when all
    its arrays of one dimension or more lie in two or more subtrees with the same
    paths and shapes, as Adam's `mu` and `nu` do, that are fields of something
    other than an `eqx.Module` and not items of a list (a model's layers are).
    """
    kinds: dict[tuple[Any, ...], type] = {}

    def visit(path: Any, node: Any) -> bool:
        kinds[tuple(path)] = type(node)
        return False

    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=visit, is_leaf_takes_path=True)[0]
    optax = {k.__name__: None for k in kinds.values() if k.__module__.partition(".")[0] == "optax"}
    names = [n for n in optax if n not in ("EmptyState", "MaskedNode")] or list(optax)
    if names:
        why = f"it holds optax's {' and '.join(names[:2])}{' and more' * (len(names) > 2)}"
    else:
        why = _twins(flat, kinds)
    if why is None:
        return None
    return (
        f"this tree looks like an optimizer state built from the model ({why}), and "
        "a spec file's rules are written for the model: lay the state out with the "
        "model's plan, `plan = eqshard.plan(model, rules)` then "
        "`eqshard.apply(opt_state, plan)`"
    )


def _twins(flat: list[tuple[Any, Any]], kinds: dict[tuple[Any, ...], type]) -> str | None:
    """`its subtrees mu and nu have the same paths and shapes`, when every array of
    one dimension or more lies in such subtrees, and an integer scalar (a step
    count) lies beside them: twin towers of a model (an encoder and a decoder, a
    teacher and a student) count no steps (see `looks_like_state`)."""
    arrays = [
        (tuple(path), tuple(leaf.shape))
        for path, leaf in flat
        if is_array_like(leaf) and len(getattr(leaf, "shape", ())) > 0
    ]
    counts = [
        leaf
        for _, leaf in flat
        if is_array_like(leaf)
        and not getattr(leaf, "shape", ())
        and np.issubdtype(np.dtype(leaf.dtype), np.integer)
    ]
    if not arrays or not counts:
        return None
    for depth in range(1, min(len(path) for path, _ in arrays)):
        groups: dict[tuple[Any, ...], list[tuple[tuple[str, ...], tuple[int, ...]]]] = {}
        for path, shape in arrays:
            groups.setdefault(path[:depth], []).append((segments(path[depth:]), shape))
        if any(
            isinstance(prefix[-1], jax.tree_util.SequenceKey)
            or issubclass(kinds.get(prefix[:-1], object), eqx.Module)
            for prefix in groups
        ):
            continue
        alike: dict[tuple[Any, ...], list[str]] = {}
        for prefix, content in groups.items():
            alike.setdefault(tuple(content), []).append(leaf_name(prefix))
        if all(len(found) > 1 and len(content) > 1 for content, found in alike.items()):
            found = max(alike.values(), key=len)
            more = f" and {len(found) - 2} more" if len(found) > 2 else ""
            return f"its subtrees {found[0]} and {found[1]}{more} have the same paths and shapes"
    return None


def resolve_rules(rules: RuleSet, model: Any, target: Target) -> Resolution:
    """The `Resolution` of `rules` for `model` on `target`: the expression of each
    leaf, problems (unmatched leaves under `"default": "error"`, dims that do not
    fit, a device count other than the file's), and a warning for each rule that
    matched nothing."""
    matches, problems = match_rules(rules, model, target)
    if rules.devices is not None and rules.devices != target.devices:
        problems.append(
            Problem(
                rules.where("$.devices"),
                f"the spec was written for {rules.devices} devices, and it is laid out on "
                f'{target.devices}; use {rules.devices} devices, or change "devices" (or '
                "drop it to allow any count)",
                file=rules.source,
            )
        )
    used = {m.rule_index for m in matches if m.source == "rule"}
    unused = [rule for rule in rules.rules if rule.index not in used]
    if unused:
        unused = _not_for_the_state(unused, model)
    follows = rules.default == "parameter"  # a leaf the default gives nothing follows
    warnings: list[EqshardWarning] = []
    if unused:
        warnings.append(_unused_warning(rules, unused, model, matches))
    lacking = _absent_axes(rules, target.mesh)
    if lacking is not None:
        warnings.append(lacking)
    return Resolution(
        [m.expr for m in matches],
        problems,
        warnings,
        failed=frozenset(
            i
            for i, m in enumerate(matches)
            if m.expr is None
            and (m.source in ("dims", "rule") or (m.source == "default" and not follows))
        ),
        origins=[m.origin for m in matches],
        memory=[m.memory for m in matches] if any(m.memory for m in matches) else None,
    )


def _absent_axes(rules: RuleSet, mesh: Any) -> MeshWarning | None:
    """A warning naming the mesh axes `logical_axis_rules` name and the mesh lacks: as
    MaxText reads them (size 1), they split nothing, which a typo would do too."""
    if not rules.logical_axis_rules or mesh is None or isinstance(mesh, MeshRefused):
        return None
    names = set(mesh.axis_names)
    lacking = list(
        dict.fromkeys(
            a for _, axes in rules.logical_axis_rules for a in axes or () if a not in names
        )
    )
    if not lacking:
        return None
    return MeshWarning(
        rules.where("$.logical_axis_rules"),
        f"names the mesh axes {', '.join(map(repr, lacking))}, which the mesh "
        f"({', '.join(map(repr, mesh.axis_names))}) lacks: they split nothing, as MaxText "
        'reads an axis it lacks (size 1); declare them in "mesh" with size 1, or fix the '
        "names",
    )


def _not_for_the_state(unused: list[PathRule], model: Any) -> list[PathRule]:
    """The rules of `unused` that no leaf of the model's `eqx.nn.State` will match
    either. A plan made from the model alone meets its state only later, so a rule
    written for the state (`bn.ema_state_index.*`) is not unused here: it is checked
    when the plan lays the state out (`_derive`). A `(model, state)` pair has its
    state's leaves: nothing is excused."""
    if is_stateful_pair(model):
        return unused
    names = state_leaf_names(model)
    if not names:
        return unused
    return [rule for rule in unused if not any(match(rule.path, name) for name in names)]


_GUESSES = 20
"""How many unused rules get a "did you mean": one guess costs a pass over the
leaves, and a message shows a few rules, not thousands."""


def _unused_warning(
    rules: RuleSet, unused: list[PathRule], model: Any, matches: list[Match]
) -> UnusedRuleWarning:
    """The warning for the rules that gave no leaf its expression: each rule's
    closest rule path that matches leaves (a typo's fix), or the earlier rule that
    took its leaves; and, for a tree that looks like an optimizer state, to use the
    model's plan."""
    flat = list(zip(key_paths(model), jax.tree_util.tree_leaves(model)))
    arrays = [i for i, (_, leaf) in enumerate(flat) if is_array_like(leaf)]
    paths = [segments(flat[i][0]) for i in arrays]
    state = looks_like_state(model)
    tree = "the model" if state is None else "this tree"
    unused_at = {rule.index for rule in unused}
    taking: dict[int, list[int]] = {}  # the leaves each unused rule matches
    index = _index(rules)  # every rule, by position; built once per `Rules`
    for i, path in zip(arrays, paths):
        for position in index.all(path):
            if rules.rules[position].index in unused_at:
                taking.setdefault(rules.rules[position].index, []).append(i)
    found = []
    guesses = 0
    guesser: Guesses | None = None
    for rule in unused:
        taken = taking.get(rule.index)
        if taken:
            earlier = matches[taken[0]].place
            leaves = tuple(matches[i].path for i in taken)
            message = (
                f"rule {rule.path!r} matches {named(leaves)}, and gives none its expression: "
                f"an earlier rule matches each first ({earlier} matches "
                f"{matches[taken[0]].path}); move this rule before it, or drop it"
            )
            found.append(UnusedRule(rule.index, rule.path, message, (), leaves))
            continue
        message = unused_message(rule.path, tree)
        guesses += 1
        if state is not None or guesses > _GUESSES:  # a state's paths; or enough guesses
            found.append(UnusedRule(rule.index, rule.path, message))
            continue
        if guesser is None:
            guesser = Guesses(paths)
        close = guesser.closest(rule.path)
        if not close:
            found.append(UnusedRule(rule.index, rule.path, message))
            continue
        best, at = close[0]
        leaves = tuple(matches[arrays[k]].path for k in at)
        message += f"; did you mean {best!r}, which matches {named(leaves)}?"
        suggestions = tuple(text for text, _ in close)
        found.append(UnusedRule(rule.index, rule.path, message, suggestions, leaves))
    return UnusedRuleWarning(rules.source, found, state or "", tree, rules.section)
