"""A model's plan, applied to any tree made of the model: the model, its optimizer state.

A leaf gets a parameter's sharding only where it sits in a subtree that has the
structure of the plan's model, at that parameter's position, with its shape. Such
a subtree may be the model itself inside a bigger tree (`(model, opt_state)`),
`eqx.filter(model, eqx.is_array)` (with `None` where leaves were filtered out), or
an optimizer's copy of it: Adam's moments, `MultiSteps`' accumulators, the inner
states of `optax.masked` and `multi_transform` (with `optax.MaskedNode` where a
leaf or a whole subtree is masked). This is the correspondence
`optax.tree_map_params` gives. Nothing is guessed from key paths, so no leaf ever
takes the layout of a parameter whose name merely ends like its own.

Every other array leaf is replicated, and its origin says why: a leaf in no such
subtree (step counts, custom state), or one whose shape differs from its
parameter's (Adafactor's factored moments). A leaf whose parameter the plan keeps
where it is (`unspecified="keep"`) is kept too.

**Which section.** A plan has two sets of shardings per parameter: the
parameters' and the optimizer state's (`Plan.optimizer`; the same where the spec
has no optimizer section). A model-shaped subtree inside an optimizer state takes
the optimizer's: one that has a `NamedTuple` among its ancestors, as every optax
state is (`ScaleByAdamState`, `TraceState`, `MultiStepsState`, `MaskedState`),
and so is the demo's `AdamState`. Any other takes the parameters': the tree's
root itself, and one reached through tuples, lists, dicts, dataclasses and
`eqx.Module`s only (`(model, opt_state)`, a training state holding the model,
`eqx.filter(model, eqx.is_array)`). The rule is the tree's structure alone, so a
training state of one's own holds the model in anything but a `NamedTuple`.
Gradients are model-shaped at the root: `constrain(grads, plan.optimizer)` gives
them the optimizer state's layouts (ZeRO-2).

**Builds of one model.** Structures are compared up to the markers of
`eqx.nn.StateIndex`es: each index gets a new one whenever it is constructed (a KV
cache built without `eqx.nn.make_with_state`), so two builds of one model (two calls
of its constructor, or `eqx.filter_eval_shape` of it and a concrete call) differ in
nothing else. Each index's marker is read as its place in the tree compared, and each
`eqx.nn.State`'s keys as the places of their indexes; so a plan made from one build
lays out every other, and the states that go with them, while trees whose indexes
are shared differently, or whose states hold other indexes, still differ.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
from jaxtyping import PyTree

from ._expression import Expression
from ._fields import (
    is_array_like,
    is_stateful_pair,
    leaf_name,
    state_leaf_names,
    state_markers,
)
from ._paths._match import match
from ._plan import Plan, Planned, Unspecified, as_plan, plan_faults
from ._problems import Problem
from ._protocol import is_resolver
from ._resolve import Resolved, abstract_leaves
from ._sharding import AnyMesh, Device
from ._specfile._model import Rules
from ._warnings import EqshardWarning, UnusedRule, UnusedRuleWarning, unused_message

__all__ = ["REPLICATED", "derived_plan", "plan_for_outputs", "unmatched_copies"]

REPLICATED = "replicated: no parameter here"
"""The origin of a leaf that sits in no subtree shaped like the plan's model."""

_flatten_one = jax.tree_util.default_registry.flatten_one_level
_flatten_with_keys = jax.tree_util.default_registry.flatten_one_level_with_keys


def _masked_node_type() -> type | None:
    optax = sys.modules.get("optax")  # without optax imported, no state holds its nodes
    return getattr(optax, "MaskedNode", None)


def _is_hole(x: Any) -> bool:
    """`None` or `optax.MaskedNode`: where a filtered or masked copy of the model has
    nothing."""
    return x is None or type(x) is _masked_node_type()


def _is_marked(x: Any) -> bool:
    return isinstance(x, (eqx.nn.StateIndex, eqx.nn.State))


@dataclasses.dataclass(frozen=True)
class _Place:
    """A `StateIndex`'s marker as structures are compared: the key path, in the tree
    compared, of the first index that holds it (see the module's notes)."""

    path: tuple[Any, ...]


def _unmarked(tree: Any) -> Any:
    """`tree` with each `eqx.nn.StateIndex`'s marker replaced by its `_Place` in
    `tree`, and each key of an `eqx.nn.State` that is the marker of an index in
    `tree` by that index's `_Place` (a key of no index here is kept); `tree` itself
    where it holds no index. Two builds of one model are equal in this form, and two
    trees that differ in anything but markers are not."""
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_marked)[0]
    places: dict[Any, _Place] = {}
    for path, x in found:
        if isinstance(x, eqx.nn.StateIndex):
            places.setdefault(x.marker, _Place(tuple(path)))
    if not places:
        return tree

    def rename(x: Any) -> Any:
        if isinstance(x, eqx.nn.StateIndex):
            renamed = object.__new__(eqx.nn.StateIndex)
            object.__setattr__(renamed, "marker", places[x.marker])
            object.__setattr__(renamed, "init", x.init)
            return renamed
        if isinstance(x, eqx.nn.State):
            values, markers = x.tree_flatten()
            keys = tuple(places.get(m, m) for m in markers)
            return eqx.nn.State.tree_unflatten(keys, values)
        return x

    return jax.tree_util.tree_map(rename, tree, is_leaf=_is_marked)


def _holds_markers(tree: Any) -> bool:
    """Whether `tree` holds an `eqx.nn.StateIndex` or an `eqx.nn.State`."""
    return any(_is_marked(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_marked))


class _Model:
    """A part of the plan's model, as a template to match subtrees against: the
    whole model, or in a `(model, state)` plan each of the two; `offset` is the
    index of its first leaf among the plan's. Where it holds `StateIndex`es, a
    subtree with other markers is matched in the `_unmarked` form of both."""

    def __init__(self, tree: Any, offset: int = 0) -> None:
        self.tree, self.offset = tree, offset
        self.root = None if _flatten_one(tree) is None else type(tree)
        # Flattened with holes as leaves, the model and an exact copy of it with
        # holes anywhere a leaf was have equal structures: one C-speed comparison.
        flat, self.with_holes = jax.tree_util.tree_flatten(tree, is_leaf=_is_hole)
        count = iter(range(offset, offset + len(flat)))
        self.index_with_holes = [None if _is_hole(leaf) else next(count) for leaf in flat]
        self.unmarked: Any = None
        if self.root is not None and _holds_markers(tree):
            self.unmarked = _unmarked(tree)
            self.unmarked_with_holes = jax.tree_util.tree_structure(self.unmarked, is_leaf=_is_hole)

    def match(self, node: Any) -> list[int | None] | None:
        """The plan's index of each leaf of `node` (`None` where the model has no
        leaf there), when `node` has this part's structure; else `None`."""
        if self.root is None:  # the model is one array: so is any leaf
            return [self.offset] if _flatten_one(node) is None else None
        if type(node) is not self.root:
            return None
        flat, structure = jax.tree_util.tree_flatten(node, is_leaf=_is_hole)
        if structure == self.with_holes:
            return [j for leaf, j in zip(flat, self.index_with_holes) if not _is_hole(leaf)]
        model = self.tree
        if self.unmarked is not None:  # another build of the model
            node, model = _unmarked(node), self.unmarked
            flat, structure = jax.tree_util.tree_flatten(node, is_leaf=_is_hole)
            if structure == self.unmarked_with_holes:
                return [j for leaf, j in zip(flat, self.index_with_holes) if not _is_hole(leaf)]
        out: list[int | None] = []
        indices = iter(range(self.offset, 1 << 62))
        return out if _match(node, model, indices, out) else None


def _templates(given: Plan) -> list[_Model]:
    """The parts of the plan's model that subtrees are matched against."""
    tree = given.resolved.model
    if not is_stateful_pair(tree):
        return [_Model(tree)]
    size = len(jax.tree_util.tree_leaves(tree[0]))
    return [_Model(tree), _Model(tree[0]), _Model(tree[1], size)]


def _match(node: Any, model: Any, indices: Iterator[int], out: list[int | None]) -> bool:
    """Appends the model index of each leaf of `node` to `out` (drawing the model's
    leaf indices, in order, from `indices`), if `node` has the structure of the
    model's subtree `model`, holes allowed; `False` where it does not."""
    model_children = _flatten_one(model)
    if model_children is None:  # a leaf of the model
        j = next(indices)
        children = _flatten_one(node)
        if children is None:
            out.append(j)
        return children is None or not children[0]  # not a subtree where a leaf is
    if _is_hole(node):  # filtered or masked: no leaves here
        for _ in jax.tree_util.tree_leaves(model):
            next(indices)
        return True
    if not model_children[0]:  # no leaf of the model here: no parameter either
        out.extend([None] * len(jax.tree_util.tree_leaves(node)))
        return True
    children = _flatten_one(node)
    if children is None or type(node) is not type(model):
        return False
    (these, aux), (theirs, model_aux) = children, model_children
    if len(these) != len(theirs) or aux != model_aux:
        return False
    return all(_match(child, part, indices, out) for child, part in zip(these, theirs))


def is_optimizer_state(node: Any) -> bool:
    """Whether a model-shaped subtree under `node` belongs to an optimizer state: a
    `NamedTuple`, as optax's states are (see the module's notes)."""
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


class _Correspondence(NamedTuple):
    """For each leaf of a tree: the plan's index of its parameter (`None` where it
    has none) and whether it sits in an optimizer state; and each `eqx.nn.State`
    in no model-shaped subtree, with the index of its first leaf."""

    positions: list[int | None]
    in_optimizer: list[bool]
    states: list[tuple[int, Any]]


def _correspondence(tree: Any, templates: list[_Model]) -> _Correspondence:
    """The plan's index of each leaf of `tree`, from its subtrees that have the
    structure of the model (or of a template); `None` for leaves in no such subtree.
    Also each `eqx.nn.State` in no such subtree, with the index of its first leaf:
    the plan's spec lays those out."""
    out: list[int | None] = []
    inside: list[bool] = []
    states: list[tuple[int, Any]] = []

    def visit(node: Any, in_optimizer: bool) -> None:
        for template in templates:
            found = template.match(node)
            if found is not None:
                out.extend(found)
                inside.extend([in_optimizer] * len(found))
                return
        if isinstance(node, eqx.nn.State):
            states.append((len(out), node))
            count = len(jax.tree_util.tree_leaves(node))
            out.extend([None] * count)
            inside.extend([in_optimizer] * count)
            return
        children = _flatten_one(node)
        if children is None:
            out.append(None)
            inside.append(in_optimizer)
            return
        below = in_optimizer or is_optimizer_state(node)
        for child in children[0]:
            visit(child, below)

    visit(tree, False)
    return _Correspondence(out, inside, states)


def unmatched_copies(tree: Any, given: Plan) -> list[Problem]:
    """A problem for each subtree of `tree` that is an instance of the plan's model's
    class, where that is a class of its own (not a tuple, list, dict or
    `eqx.nn.State`), and does not have the model's structure: a copy of another
    model, whose leaves the module's rule replicates, where the plan may split them.
    Each names the subtree, the first place it differs from the model, and the fix.
    `restore` refuses these rather than replicate an optimizer state in silence."""
    templates = _templates(given)
    roots = {
        t.root
        for t in templates
        if t.root is not None
        and not issubclass(t.root, (tuple, list, dict))
        and t.root is not eqx.nn.State
    }
    if not roots:
        return []
    problems: list[Problem] = []

    def visit(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, eqx.nn.State) or any(t.match(node) is not None for t in templates):
            return
        if type(node) in roots:
            template = next(t for t in templates if t.root is type(node))
            model = template.tree if template.unmarked is None else template.unmarked
            where, why = _difference(_unmarked(node), model, ()) or ((), "its structure")
            at = "" if not where else f" at {leaf_name(where)}"
            problems.append(
                Problem(
                    leaf_name(path),
                    f"a {type(node).__name__} that is not shaped like the plan's model "
                    f"({why}{at}), so its leaves would be replicated where the plan splits "
                    "the model's; build it as the model the plan was made from (any build "
                    "of it will do), or make the plan from this model",
                )
            )
            return
        children = _flatten_with_keys(node)
        if children is None:
            return
        names = getattr(type(node), "_fields", None) if isinstance(node, tuple) else None
        for k, (key, child) in enumerate(children[0]):
            # a NamedTuple's fields by their names (some JAX releases key them all alike)
            visit(child, (*path, jax.tree_util.GetAttrKey(names[k]) if names else key))

    visit(tree, ())
    return problems


def _difference(node: Any, model: Any, path: tuple[Any, ...]) -> tuple[tuple[Any, ...], str] | None:
    """The first place where `node` does not have the structure of `model`, holes
    allowed (as `_match` compares them), and what differs there; `None` where nothing
    does."""
    if _is_hole(node):
        return None
    below = _flatten_with_keys(model)
    children = _flatten_with_keys(node)
    if below is None:
        if children is not None and children[0]:
            return path, f"a {type(node).__name__} where the model has a leaf"
        return None
    if not jax.tree_util.tree_leaves(model):  # no leaf of the model here: anything goes
        return None
    if children is None:
        return path, f"a leaf where the model has a {type(model).__name__}"
    if type(node) is not type(model):
        return path, f"a {type(node).__name__} where the model has a {type(model).__name__}"
    keys = [key for key, _ in children[0]]
    model_keys = [key for key, _ in below[0]]
    if keys != model_keys:
        return path, f"children {_keys(keys)} where the model has {_keys(model_keys)}"
    if children[1] != below[1]:
        return path, _static_difference(node, model)
    for (key, child), (_, part) in zip(children[0], below[0]):
        found = _difference(child, part, (*path, key))
        if found is not None:
            return found
    return None


def _static_difference(node: Any, model: Any) -> str:
    """What differs between two nodes of one class with the same children: a static
    field of a dataclass (`eqx.Module`), named with both values, else the node's data."""
    if isinstance(node, eqx.nn.StateIndex):  # markers compared as `_Place`s
        return "a StateIndex shared with another place where the model's is not, or not shared"
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            ours, theirs = getattr(node, f.name, None), getattr(model, f.name, None)
            try:
                same = bool(ours == theirs)
            except Exception:  # an array, or an `==` that will not say
                same = ours is theirs
            if f.metadata.get("static") and not same:
                return f"its static field {f.name} is {_short(ours)}, the model's {_short(theirs)}"
    return "node data other than the model's"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _keys(keys: list[Any]) -> str:
    shown = ", ".join(leaf_name((key,)) for key in keys[:6])
    return f"[{shown}{', ...' * (len(keys) > 6)}]"


def _described(model: Any) -> str:
    """`a GPT of 42 leaves`, or `one array`, for messages."""
    if _flatten_one(model) is None:
        return "one array"
    count = len(jax.tree_util.tree_leaves(model))
    return f"a {type(model).__name__} of {count} {'leaf' if count == 1 else 'leaves'}"


def _same_structure(tree: Any, given: Plan) -> Planned | None:
    """`None` when `tree` is not shaped like the plan's model. Else the plan, with a
    problem for each leaf whose shape differs from the model's; where dtypes differ
    (the model cast to bfloat16 since), or `tree` is another build of the model (its
    `StateIndex` markers differ), the plan's shardings with `tree`'s own leaves and
    structure, so that `abstract`, `init` and `restore` give back what the tree holds."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    resolved = given.resolved
    rebuilt = treedef != resolved.treedef  # another build: other markers
    if rebuilt and not (
        _holds_markers(resolved.model)
        and jax.tree_util.tree_structure(_unmarked(tree))
        == jax.tree_util.tree_structure(_unmarked(resolved.model))
    ):
        return None
    problems = []
    retyped = False
    for i, (new, old, sharding) in enumerate(zip(leaves, resolved.leaves, given.flat_shardings)):
        if sharding is None:
            continue
        if tuple(getattr(new, "shape", ())) != tuple(old.shape):
            problems.append(
                Problem(
                    resolved.where(i),
                    f"the plan was made for shape {tuple(old.shape)}, and this leaf has "
                    f"{tuple(new.shape)}; make the plan from this model",
                )
            )
        elif getattr(new, "dtype", None) != old.dtype or _weak(new) != _weak(old):
            retyped = True
    if not (rebuilt or retyped):
        return Planned(given, problems, [], len(leaves))
    own = dataclasses.replace(
        resolved,
        model=tree,
        leaves=leaves,
        treedef=treedef,
        _fields=None,
        failed=set(resolved.failed),
    )
    own.forget_values()
    return Planned(dataclasses.replace(given, resolved=own), problems, [], len(leaves))


def _weak(x: Any) -> bool:
    return bool(getattr(x, "weak_type", False))


def _by_structure(tree: Any, given: Plan) -> Planned:
    """`given`'s shardings for each leaf of `tree` at a parameter's position in a
    subtree shaped like the plan's model, with that parameter's shape; a full copy
    for every other array leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    model = given.resolved
    positions, in_optimizer, states = _correspondence(tree, _templates(given))
    assert len(positions) == len(leaves)  # both in `tree_leaves` order
    exprs: list[Expression | None] = [None] * len(leaves)
    origins: list[str | None] = [None] * len(leaves)
    shardings: list[Any] = [None] * len(leaves)
    replicated = given.replicated()
    matched = unmatched = 0
    names = model.paths
    first_state = (
        len(jax.tree_util.tree_leaves(model.model[0]))
        if is_stateful_pair(model.model)
        else len(leaves) + len(model.leaves)
    )
    for i, (leaf, j) in enumerate(zip(leaves, positions)):
        if not is_array_like(leaf):
            continue
        parameter = None if j is None else model.leaves[j]
        if parameter is None or not is_array_like(parameter):
            shardings[i], origins[i] = replicated, REPLICATED
            unmatched += len(leaf.shape) > 0
            continue
        assert j is not None
        name = f"{'state' if j >= first_state else 'parameter'} {names[j]}"
        if tuple(leaf.shape) != tuple(parameter.shape):  # in the model's structure
            shardings[i] = replicated
            origins[i] = (
                f"replicated: its shape {tuple(leaf.shape)} is not {name}'s "
                f"{tuple(parameter.shape)}"
            )
            continue
        section = given.optimizer if in_optimizer[i] else given
        shardings[i], exprs[i] = section.flat_shardings[j], section.resolved.exprs[j]
        if section.follows is not None and not section.follows[j]:
            origins[i] = f"{section.resolved.origins[j] or 'the optimizer section'} for {name}"
        else:
            origins[i] = name if shardings[i] is not None else f"kept, as {name} is"
        matched += 1
    problems = []
    warnings: list[EqshardWarning] = []
    for start, state in states:
        found = _state_plan(state, given)
        problems += found.problems
        warnings += found.warnings
        end = start + len(found.shardings)
        shardings[start:end] = found.shardings
        exprs[start:end] = found.exprs
        origins[start:end] = found.origins
        matched += any(s is not None for s in found.shardings) or bool(found.problems)
    if not matched and unmatched:
        problems.append(
            Problem(
                "the root",
                f"the plan was made for {_described(model.model)}, and no subtree of this "
                "tree has its structure and shapes; make the plan from the model this tree "
                "was built from",
            )
        )
    resolved = Resolved(
        *abstract_leaves(tree, leaves, treedef), exprs, origins, set(), context=model.model
    )
    # the tree's own plan: its shardings are final, whichever section gave them
    derived = dataclasses.replace(
        given, resolved=resolved, flat_shardings=shardings, section=None, follows=None
    )
    return Planned(derived, problems, warnings, matched)


class _StateLayout(NamedTuple):
    shardings: list[Any]
    exprs: list[Expression | None]
    origins: list[str | None]
    problems: list[Problem]
    warnings: list[EqshardWarning]


def _state_plan(state: Any, given: Plan) -> _StateLayout:
    """The layout of the model's `eqx.nn.State`, from the spec the plan was made
    from: its leaves are named by their `StateIndex`'s path in the model
    (`bn.ema_state_index.0`), which rules match, and their annotations come from
    the model's fields, which `dims` use. The layouts must fit the plan's mesh.

    A state of another model is refused. A spec tree, which has no place for the
    state, replicates it, and says so. Of the rules that match no state leaf, only
    those the model's plan let pass as written for the state are warned about
    here; the rest were checked against the model."""
    model = given.resolved.model
    count = len(jax.tree_util.tree_leaves(state))
    markers = _flatten_one(state)[1]  # pyright: ignore[reportOptionalSubscript]
    foreign = [m for m in markers if m not in state_markers(model)]
    if foreign:
        shown = ", ".join(repr(m) if isinstance(m, str) else "an index" for m in foreign[:3])
        problem = Problem(
            "the state",
            f"this eqx.nn.State holds values of StateIndexes that are not in the plan's "
            f"model ({shown}{', ...' * (len(foreign) > 3)}); lay it out with the plan of "
            "the model it was made with",
        )
        return _StateLayout([None] * count, [None] * count, [None] * count, [problem], [])
    spec = given.spec
    if not (is_resolver(spec) or isinstance(spec, (str, Expression))):
        why = (
            "replicated: a spec tree has no place for the state; make the plan from "
            "`(model, state)` with a spec tree of both, or from rules"
        )
        replicated = given.replicated()
        leaves = jax.tree_util.tree_leaves(state)
        return _StateLayout(
            [replicated if is_array_like(x) else None for x in leaves],
            [None] * count,
            [why if is_array_like(x) else None for x in leaves],
            [],
            [],
        )
    if given.mesh_is_given:
        where: dict[str, Any] = {"mesh": given.mesh}
    else:
        where = {"devices": given.devices, "fit_onto": given.mesh}
    spec = _without_section(spec)  # the optimizer section's paths name parameters
    found = plan_faults(state, spec, unspecified=given.unspecified, context=model, **where)
    names = state_leaf_names(model)
    warnings: list[EqshardWarning] = []
    for warning in found.warnings:
        if isinstance(warning, UnusedRuleWarning):
            for_state = [
                UnusedRule(rule.index, rule.path, unused_message(rule.path, "the state"))
                for rule in warning.unused
                if any(match(rule.path, name) for name in names)
            ]
            if for_state:
                warnings.append(UnusedRuleWarning(warning.source, for_state, "", "the state"))
    sub = found.plan
    return _StateLayout(
        list(sub.flat_shardings),
        list(sub.resolved.exprs),
        list(sub.resolved.origins),
        found.problems,
        warnings,
    )


def _without_section(spec: Any) -> Any:
    """`spec`, without its optimizer section where it is a spec file's `Rules`
    with one."""
    if isinstance(spec, Rules) and spec.optimizer is not None:
        return _rules_alone(spec)
    return spec


@functools.lru_cache(maxsize=64)
def _rules_alone(rules: Rules) -> Rules:
    """`rules` without its optimizer section, made once per `Rules` (they hash by
    identity), so its path index is built once too."""
    return dataclasses.replace(rules, optimizer=None)


def derived_plan(
    tree: PyTree[Any],
    spec: Any,
    *,
    mesh: AnyMesh | None = None,
    devices: Sequence[Device] | int | None = None,
    unspecified: Unspecified = "replicate",
) -> Planned:
    """The plan that lays out `tree`, collecting its faults. For a `Plan`: the plan
    itself when `tree` is shaped like its model, else the plan applied by structure
    (a training state or an optimizer state built from the model; see the module's
    notes). Any other spec is planned for `tree` (`plan_faults`).
    """
    if not isinstance(spec, Plan):
        return plan_faults(tree, spec, mesh=mesh, devices=devices, unspecified=unspecified)
    spec = as_plan(tree, spec, mesh=mesh, devices=devices)  # as it is, given alone
    same = _same_structure(tree, spec)
    if same is not None:
        return same
    return _by_structure(tree, spec)


def plan_for_outputs(tree: PyTree[Any], given: Plan) -> Planned:
    """The plan that lays out a step's output `tree` by `given`'s structure, as
    `derived_plan` does, except that a tree is built from the model only where its shapes
    say so too: a leaf at a parameter's place with another shape (the scalar a
    one-array model's step returns, a slice of a parameter) is replicated, as any
    other output, not refused. Problems remain for an `eqx.nn.State` the plan cannot
    lay out."""
    same = _same_structure(tree, given)
    if same is not None and not same.problems:
        return same
    return _by_structure(tree, given)
