"""Activations by logical name: `eqshard.use(rules)` and `constrain(x, names)`.

A model names its activations' axes (`eqshard.constrain(x, ("batch", "seq",
"embed"))`); the active rules (`eqshard.use(rules)`, or `rules=`) map the names
through their `dims`, exactly as a parameter's annotated dims are mapped
(`_rules.dims_expression`): to a mesh axis (a logical axis), a shard modifier
(`"*"`, `"4"`), or `null` (whole). The mesh is the user's (`mesh=`,
`jax.set_mesh`), else the rules' declared mesh, built by the same cached helper as
the plan's (`_sharding.mesh`), over the same devices, so activations and
parameters share one `Mesh`. With no rules active, names mean nothing and `x`
comes back unchanged, so model code that names its activations runs anywhere.

An axis named `None`, and the axes in front that a leading `...` stands for, are
left free: `PartitionSpec.UNCONSTRAINED` inside `jit` on Auto axes (the compiler
chooses), the value's own layout on Explicit axes (JAX allows no unconstrained
axis there), and whole when placing outside `jit`.

The active rules are a context variable, mirrored into a JAX user context where
JAX has one (`jax.make_user_context`), so that they are part of `jit`'s cache key,
as `jax.set_mesh`'s mesh is: a jitted step called under other rules is traced
again, and a compiled step keeps the rules it was traced under.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from types import EllipsisType
from typing import Any, Union

import jax
import jax.core
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ._annotation import Annotation
from ._errors import EqshardError, ExpressionError, SpecError
from ._expression import Expression, is_logical_name
from ._jit_key import JIT_KEY
from ._plan import Plan, declared_mesh
from ._problems import Problem
from ._rules import MeshRefused, dims_expression, placing
from ._sharding import (
    AnyMesh,
    Placement,
    as_placement,
    device_count,
    mesh as build_mesh,
    placed_sharding,
    sharding_on,
    user_mesh,
)
from ._specfile._model import Rules

__all__ = [
    "Active",
    "NamedActivation",
    "Names",
    "activation_sharding",
    "active",
    "active_mesh",
    "is_names",
    "recording",
    "recording_laid_out",
    "use",
]

Name = Union[str, None, EllipsisType]
Names = Sequence[Name]


@dataclasses.dataclass(frozen=True)
class Active:
    """What `eqshard.use` made active: a plan, or a spec file's rules, or both.

    - `rules`: the spec file's rules that lay out named activations (compared by
        identity, as `Rules` are); `None` for a plan made from another spec, whose
        names then mean nothing, as with no rules.
    - `mesh`: the plan's mesh, where it is the user's or the spec file's; else
        `None` (the mesh is chosen when an activation is constrained).
    - `devices`: the plan's devices (or device count), for a declared mesh; else
        `None` (`jax.devices()`).
    - `plan`: the plan given to `use`, which `eqshard.jit` pins on a step's inputs
        and outputs and `eqshard.constrain(tree)` lays a tree out by; `None` for
        rules alone.

    It is hashable: it is the value of the JAX user context that keys `jit`'s cache.
    """

    rules: Rules | None
    mesh: AnyMesh | None = None
    devices: Placement | None = None
    plan: Plan | None = None


_ACTIVE: contextvars.ContextVar[Active | None] = contextvars.ContextVar(
    "eqshard_active_rules", default=None
)

Recorded = list[tuple[tuple[Name, ...], tuple[int, ...]]]
_RECORDING: contextvars.ContextVar[Recorded | None] = contextvars.ContextVar(
    "eqshard_recorded_names", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[Recorded]:
    """Records the names a model gives its activations while no rules are active:
    each `constrain` call's names, one per axis (a leading `...` spelled out), with
    the array's shape. `eqshard suggest` traces the step under it to learn the names
    its candidates' `"dims"` must map. Rules made active outside are not active
    inside, and `jit` functions traced before trace again (where JAX keys `jit` by
    a user context)."""
    found: Recorded = []
    token, rules = _RECORDING.set(found), _ACTIVE.set(None)
    key = object()  # a `jit` traced before, with no rules or other rules, traces again
    try:
        with contextlib.nullcontext() if JIT_KEY is None else JIT_KEY(key):
            yield found
    finally:
        _ACTIVE.reset(rules)
        _RECORDING.reset(token)


@dataclasses.dataclass(frozen=True)
class NamedActivation:
    """An activation the rules laid out by its names, while a step was traced: what
    `eqshard.cost` and `eqshard check --step` report of it.

    **Attributes:** `names`, one per axis (`None` for a free one); `shape`;
    `expression`, its complete expression; `partition_spec`, as text; `placed`, which
    rule placed each named dim (`"batch: $.logical_axis_rules[0] (data); embed:
    $.dims"`), or `"$.dims"` where a file's `dims` alone did.
    """

    names: tuple[str | None, ...]
    shape: tuple[int, ...]
    expression: str
    partition_spec: str
    placed: str


_LAID_OUT: contextvars.ContextVar[list[NamedActivation] | None] = contextvars.ContextVar(
    "eqshard_laid_out", default=None
)


@contextlib.contextmanager
def recording_laid_out() -> Iterator[list[NamedActivation]]:
    """Records each activation the rules lay out by its names inside (once per names
    and shape), for `eqshard.cost`."""
    found: list[NamedActivation] = []
    token = _LAID_OUT.set(found)
    try:
        yield found
    finally:
        _LAID_OUT.reset(token)


RECORDED = "eqshard.activation."
"""The prefix of the `checkpoint_name` a recorded activation carries in the traced
step (`marked`), its index in the record after it: how `eqshard suggest`'s jaxpr
walk finds the value each recorded name labels."""


def marked(x: Any) -> Any:
    """While recording, `x` named for the jaxpr (`jax.ad_checkpoint.checkpoint_name`,
    the identity) as the last recorded activation; else `x` itself."""
    record = _RECORDING.get()
    if record is None or not record or not isinstance(x, jax.core.Tracer):
        return x
    return checkpoint_name(x, f"{RECORDED}{len(record) - 1}")


def active() -> Active | None:
    """The rules `eqshard.use` made active in this thread or task, if any."""
    return _ACTIVE.get()


def active_rules(rules: Rules | Plan | None) -> Active | None:
    """What lays out named activations: `rules` where given, else the active
    rules; `None` where neither holds a spec file's rules."""
    found = _of(rules) if rules is not None else _ACTIVE.get()
    return None if found is None or found.rules is None else found


def using(value: Active | None) -> contextlib.AbstractContextManager[Rules | None]:
    """`value` made active, as `eqshard.use` makes it (for `eqshard.jit`, which
    holds an `Active` already)."""
    return _using(value)


def _of(rules: Rules | Plan | None) -> Active | None:
    if rules is None:
        return None
    if isinstance(rules, Rules):
        return Active(rules)
    if isinstance(rules, Plan):
        named = rules.spec if isinstance(rules.spec, Rules) else None
        return Active(named, rules.mesh if rules.mesh_is_given else None, rules.devices, rules)
    raise EqshardError(
        "`eqshard.use` (and `constrain`'s `rules=`) take an `eqshard.Plan`, the "
        "`eqshard.Rules` of a spec file (`eqshard.load(path)`), or None (no rules), not "
        f"{type(rules).__name__}"
    )


def use(rules: Rules | Plan | None) -> contextlib.AbstractContextManager[Rules | None]:
    """Makes a spec file's rules lay out the activations a model names.

    Inside the block, `eqshard.constrain(x, ("batch", "seq", "embed"))` maps each name
    through the rules' `"dims"`, as parameters' annotated dims are mapped. It constrains
    `x` to that layout. Outside any block, such a call returns `x` unchanged, so model
    code that names its activations runs anywhere.

    **Example:**

    ```python
    rules = eqshard.load("model.eqshard.json")   # "dims": {"batch": "data", "embed": "model"}
    with eqshard.use(rules):
        model, opt_state, loss = step(model, opt_state, batch)
    ```

    **Arguments:**

    - `rules`: an `eqshard.Rules` (`eqshard.load(path)`), an `eqshard.Plan` made from
        one, or `None` for no rules inside the block. With a plan, the activations share
        its mesh (the user's or the spec file's) and devices.

    **Returns:**

    A context manager, which gives the rules in `as`.

    **Raises:**

    - `eqshard.EqshardError`: `rules` is not `Rules`, a plan made from them, or `None`.

    !!! info "When the rules hold"

        The rules hold when a step is traced. They are part of `jit`'s cache key, as the
        mesh of `jax.set_mesh` is. A jitted step called under other rules (or none) is
        traced again. A step compiled under one set of rules
        (`step.lower(...).compile()`) keeps them. Blocks nest. Leaving one, by an
        exception too, restores the outer rules. Each thread has its own.
    """
    return _using(_of(rules))


@contextlib.contextmanager
def _using(value: Active | None) -> Iterator[Rules | None]:
    token = _ACTIVE.set(value)
    try:
        with contextlib.nullcontext() if JIT_KEY is None else JIT_KEY(value):
            yield None if value is None else value.rules
    finally:
        _ACTIVE.reset(token)


def is_names(x: Any, spec: Any) -> bool:
    """Whether `constrain(x, spec)` names the axes of one array: a tuple or list of
    dim names, `None`s and a leading `...`, for an array."""
    return isinstance(spec, (tuple, list)) and hasattr(x, "shape") and hasattr(x, "dtype")


def _text(names: Names) -> str:
    inner = ", ".join("..." if n is ... else repr(n) for n in names)
    return f"({inner}{',' * (len(names) == 1)})"


def _checked(names: Names, shape: tuple[int, ...], dtype: Any) -> tuple[Name, ...]:
    """The names, one per axis of an array of `shape` (the axes `...` stands for as
    `...` each), or the error that says how to write them."""
    names = tuple(names)
    for i, n in enumerate(names):
        if n is ... and i == 0:
            continue
        if n is None or (isinstance(n, str) and is_logical_name(n)):
            continue
        where = "only first" if n is ... else f"not {n!r}"
        raise EqshardError(
            f"`eqshard.constrain` names the axes of x as {_text(names)}: each is a dim "
            "name (a letter or '_', then letters, '_', digits, '-' or '.', such as 'embed'), "
            f"None (the axis left free), or ... (the axes in front, left free; {where})"
        )
    named = names[1:] if names[:1] == (...,) else names
    if len(named) > len(shape) or (len(named) < len(shape) and names[:1] != (...,)):
        raise EqshardError(
            f"`eqshard.constrain` names {len(named)} axes of x, {_text(names)}, and x is "
            f"{dtype}{list(shape)}, of {len(shape)}; name each axis, with None for one "
            "left free, or start with ... for the axes in front"
        )
    return (...,) * (len(shape) - len(named)) + named


def _mesh(
    found: Active, mesh: AnyMesh | None, devices: Placement | None
) -> tuple[AnyMesh | None, Placement]:
    """The mesh activations are laid out on: `mesh=`, the plan's (`use(plan)`), the
    mesh of `jax.set_mesh`, else the rules' declared mesh, built as the plan builds
    it, on `devices=` (or the plan's devices, or every device); `None` where there
    is none. And the devices, for a layout on its own mesh."""
    placed = as_placement(devices if devices is not None else found.devices)
    on = user_mesh(mesh, devices) if mesh is not None else found.mesh
    if on is None and devices is None:
        on = user_mesh(None, None)  # the mesh of `jax.set_mesh`
    if on is not None or found.rules is None:
        return on, placed
    declared, problems = declared_mesh(found.rules, device_count(placed))
    if problems:
        raise SpecError(problems)
    if declared is None:
        return None, placed
    return build_mesh(declared.sizes, declared.names, placed), placed


def active_mesh(mesh: AnyMesh | None = None) -> AnyMesh | None:
    """The mesh activations are laid out on now: `mesh=`, else the active plan's, the
    mesh of `jax.set_mesh`, or the active rules' declared mesh (built as the plan
    builds it); `None` where there is none."""
    if mesh is not None:
        return user_mesh(mesh, None)
    found = active()
    if found is None:
        return user_mesh(None, None)
    return _mesh(found, None, None)[0]


def activation_sharding(
    x: Any,
    names: Names,
    rules: Rules | Plan | None = None,
    *,
    mesh: AnyMesh | None = None,
    devices: Placement | None = None,
) -> NamedSharding | None:
    """The sharding the rules give the array `x` whose axes `names` names, with its
    free axes `PartitionSpec.UNCONSTRAINED` (inside `jit`, on Auto axes), as they
    are (on Explicit axes) or whole (outside `jit`); `None` where no rules are
    active, or no name is mapped (nothing to constrain).

    **Raises:** `SpecError` naming the spec file's `$.dims` for a name it does not
    map, a name that splits two axes, two names on one mesh axis, and a layout that
    does not fit the array or the mesh; `EqshardError` for names that are not names
    or do not match `x`'s rank.
    """
    shape, dtype = tuple(x.shape), x.dtype
    items = _checked(names, shape, dtype)
    found = active_rules(rules)
    if found is None or found.rules is None:
        record = _RECORDING.get()
        if record is not None:
            record.append((items, shape))
        return None
    named = found.rules
    dims = named.dims
    source = named.source
    label = f"{_text(names)} of {dtype}{list(shape)}"
    headline = f"`eqshard.constrain` cannot lay out {_text(names)} by {source}"
    given = [n for n in items if isinstance(n, str)]
    tabled = {rule.name for rule in named.axis_rules if rule.index >= 0}
    unknown = list(dict.fromkeys(n for n in given if n not in dims))
    if unknown and not named.logical_axis_rules:  # with a table, as Flax: whole
        mapped = ", ".join(map(repr, dims)) or "nothing"
        raise SpecError(
            [
                Problem(
                    f"{source}::$.dims",
                    f"{label} names {n!r}, which $.dims does not map (it maps {mapped}); "
                    f"map {n!r} there to a mesh axis, a shard modifier ('*', '4') or null "
                    "(the dim whole), or write None for that axis to leave it free",
                    file=source,
                )
                for n in unknown
            ],
            headline,
        )
    twice = next(
        (n for n in given if given.count(n) > 1 and (dims.get(n) is not None or n in tabled)),
        None,
    )
    if twice is not None:
        raise SpecError(
            [
                Problem(
                    label,
                    f"{twice!r} names {given.count(twice)} axes, and {source}::"
                    f"{_split_by(named, twice)}; a dim is split once: give the other axes "
                    "names of their own, or None to leave them free",
                )
            ],
            headline,
        )
    if not given:
        return None
    on, placed = _mesh(found, mesh, devices)
    annotation = Annotation(_text(names), " ".join(map(str, given)), _items(items))
    expr = dims_expression(named, annotation, label, on, noun="array")
    if isinstance(expr, Problem):
        raise SpecError([expr], headline)
    if expr is None or isinstance(expr, MeshRefused):  # not reached: every name given is
        return None  # mapped, and `_mesh` raised the problem of a declared mesh refused
    target = _laid_out(expr, shape, on, placed, label, headline, source)
    found_so_far = _LAID_OUT.get()
    if found_so_far is not None:
        laid = NamedActivation(
            _items(items),
            shape,
            str(expr),
            "P(" + ", ".join(map(repr, target.spec)) + ")",
            placing(named, annotation, on) or f"{source}::$.dims",
        )
        if laid not in found_so_far:
            found_so_far.append(laid)
    return _free(x, target, [i for i, n in enumerate(items) if not isinstance(n, str)])


def _split_by(rules: Rules, name: str) -> str:
    """How `rules` split the dim `name`: `$.dims.embed splits it ('data')`, or the
    table's rules of it."""
    if name in rules.dims:
        return f"$.dims.{name} splits it ({rules.dims[name]!r})"
    found = [str(rule.index) for rule in rules.axis_rules if rule.name == name and rule.index >= 0]
    return f"$.logical_axis_rules[{', '.join(found)}] split it"


def _items(items: tuple[Name, ...]) -> tuple[str | None, ...]:
    """The names as an annotation's items: a free axis is an unnamed dim (whole)."""
    return tuple(n if isinstance(n, str) else None for n in items)


def _laid_out(
    expr: Expression,
    shape: tuple[int, ...],
    on: AnyMesh | None,
    placed: Placement,
    label: str,
    headline: str,
    source: str,
) -> NamedSharding:
    try:
        if on is not None:
            return sharding_on(expr, shape, on)
        return placed_sharding(expr, shape, None, placed)
    except ExpressionError as error:
        context = f"{str(expr)!r}, from {source}::$.dims"
        raise SpecError([Problem.from_error(label, error, context)], headline) from None


def _free(x: Any, target: NamedSharding, free: list[int]) -> NamedSharding:
    """`target` with the axes at `free` left free: unconstrained inside `jit` on Auto
    axes; on Explicit axes, as the value's type has them (where no named axis took
    their mesh axes); outside `jit`, whole, as `target` has them."""
    if not free or not isinstance(x, jax.core.Tracer):
        return target
    ndim = len(x.shape)
    spec = list(target.spec) + [None] * (ndim - len(target.spec))
    explicit = any(kind == AxisType.Explicit for kind in target.mesh.axis_types)
    if not explicit:
        for i in free:
            spec[i] = PartitionSpec.UNCONSTRAINED
        return NamedSharding(target.mesh, PartitionSpec(*spec))
    held = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()
    held = list(held) + [None] * (ndim - len(held))
    taken = {a for i, s in enumerate(spec) if i not in free for a in _axes(s)}
    for i in free:
        spec[i] = None if _axes(held[i]) & taken else held[i]
    return NamedSharding(target.mesh, PartitionSpec(*spec))


def _axes(entry: Any) -> set[str]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return set()
    return set(entry) if isinstance(entry, tuple) else {entry}
