"""The step as one object: `eqshard.jit`, `eqx.filter_jit` whose compiled program
takes and gives the active plan's layouts.

It is built on `eqx.filter_jit`, which traces, compiles, donates, lowers and raises an
`eqx.error_if` that fired; eqshard only supplies the layouts. Before each call, the
step's arguments are laid out by structure (`_arguments.lay_out_arguments`), and each
leaf not yet in its layout (fresh from a constructor, or a batch placed elsewhere) is
moved there as `eqshard.apply` moves it. `jax.jit` takes a committed array's sharding
as its input's, so those are the compiled program's input layouts. Inside the traced
function the plan is active (`eqshard.use`), and the outputs are held to their layouts,
by structure (`_derive.plan_for_outputs`), by a constraint at its end: their structure
is known only once it is traced.

One `eqx.filter_jit` is made per plan; `jax.jit` keeps its cache, so a step is traced
and compiled once per plan and per structure of its arguments. Called under another
plan, it is traced again, for that plan. With no plan it is `eqx.filter_jit` itself.

The body is traced on the plan's mesh as it is, as the user's own `jax.jit` traces it,
so their `jax.shard_map` over that mesh runs. On a mesh of Explicit axes, where JAX
refuses an operation of the body (plain `eqx.nn` layers split Megatron-style contract a
split dim with no `out_sharding`), the same trace calls the body again with those axes
made Auto, as `jax.sharding.auto_axes` runs a function. The step's inputs and outputs
keep the plan's shardings and axis types.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, Generic, Literal, ParamSpec, TypeVar, overload

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from . import _compat
from ._activations import Active, active, using
from ._arguments import Argument, Batches, abstract_array, batch_layout, lay_out_arguments
from ._constrain import constrained
from ._derive import plan_for_outputs
from ._errors import EqshardError, SpecError
from ._expression import Expression
from ._plan import Plan, Spec, as_plan, placing
from ._problems import Problem
from ._sharding import AnyMesh
from ._specfile._model import BatchRules, Rules
from ._values import source_for

__all__ = ["Compiled", "Donate", "Lowered", "Step", "jit"]

Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]

_DONATE = ("all", "all-except-first", "warn", "warn-except-first", "none")

_ARRAYS = (jax.Array, np.ndarray, np.generic)  # what `eqx.is_array` holds an array

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _is_traced(x: object) -> bool:
    """A leaf `lower` traces: an array, or an abstract one."""
    return isinstance(x, (*_ARRAYS, jax.ShapeDtypeStruct))


def _is_array(x: object) -> bool:
    """A leaf a call traces, as `eqx.filter_jit` traces it."""
    return isinstance(x, _ARRAYS)


# -- the traced function ------------------------------------------------------------


@functools.cache
def _explicit_refusals() -> tuple[type[Exception], ...]:
    """JAX's error for an operation its Explicit axes cannot type: the body is then
    called again on Auto axes. Where this JAX keeps it elsewhere, no error: every body
    on an Explicit mesh runs on Auto axes, as before eqshard ran it on Explicit ones."""
    try:
        return (_compat.sharding_type_error(),)
    except EqshardError as error:
        _compat.warn_once(error, "runs every step's body on Auto axes")
        return ()


def _auto(mesh: AnyMesh | None) -> Any:
    """The abstract mesh with `mesh`'s Explicit axes made Auto, for the step's body;
    `None` where it has none."""
    if mesh is None:
        return None
    explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit]
    if not explicit:
        return None
    return mesh.abstract_mesh.update_axis_types(dict.fromkeys(explicit, AxisType.Auto))


def _to_auto(tree: Any) -> Any:
    """`tree`'s arrays as values of the Auto abstract mesh in effect (as
    `jax.sharding.auto_axes` converts its inputs): their layouts stay as they are."""
    return jax.tree_util.tree_map(
        lambda x: jax.sharding.reshard(x, PartitionSpec()) if isinstance(x, jax.Array) else x,
        tree,
    )


@dataclasses.dataclass
class _Context:
    """One plan a step runs under: the plan, what is active while it is traced, and
    the `eqx.filter_jit` of the body. `auto`: the body runs with the mesh's Explicit
    axes made Auto (JAX refused it on them once)."""

    plan: Plan
    active: Active
    auto: bool
    jitted: Any = None


def _body(fn: Callable[..., Any], context: _Context) -> Callable[..., Any]:
    """The function `eqx.filter_jit` traces: the step with the plan active, its
    outputs held to the plan's layouts."""
    p = context.plan
    auto = _auto(p.mesh)
    name = getattr(fn, "__qualname__", type(fn).__name__)

    def traced(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The body on the plan's axes as they are; where JAX refuses it on Explicit
        axes, called again in the same trace on Auto ones (nothing ran, so nothing was
        donated). Where the mesh has no Explicit axes, JAX's error is the user's."""
        refused = None
        if auto is None or not context.auto:
            try:
                return fn(*args, **kwargs)
            except _explicit_refusals() as error:
                if auto is None:
                    raise
                refused = error
            context.auto = True  # later traces (other shapes) go to Auto axes at once
        try:
            with jax.sharding.use_abstract_mesh(auto):
                args, kwargs = _to_auto((args, kwargs))
                return fn(*args, **kwargs)
        except Exception as error:
            if refused is not None:
                error.add_note(
                    "eqshard traced the step's body on Auto axes since, on the plan's "
                    f"Explicit axes, JAX refused it: {refused}"
                )
            raise

    @functools.wraps(fn)  # `eqx.filter_jit` binds, and names the program, as `fn`
    def run(*args: Any, **kwargs: Any) -> Any:
        with using(context.active):
            out = traced(args, kwargs)
            targets = _outputs(out, p, name)
        leaves, treedef = jax.tree_util.tree_flatten(out)
        held = [k for k, x in enumerate(leaves) if _is_array(x) and targets[k] is not None]
        values = constrained([leaves[k] for k in held], [targets[k] for k in held])
        for k, value in zip(held, values):
            leaves[k] = value
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return run


def _outputs(out: Any, p: Plan, name: str) -> list[Any]:
    """The sharding of each leaf of a step's output, by structure (see the module's
    notes): anything that holds nothing of the model's, replicated."""
    planned = plan_for_outputs(out, p)
    if planned.problems and planned.matched:
        raise SpecError(
            [dataclasses.replace(q, where=f"output {q.where}") for q in planned.problems],
            f"the step {name} returns a tree built from the model that the plan cannot lay out",
        )
    return list(planned.plan.flat_shardings)


# -- the arguments' layouts ---------------------------------------------------------


@dataclasses.dataclass
class _Laid:
    """The arguments laid out for one placement of the batch leaves already placed."""

    targets: list[Any]  # one per traced leaf: its layout, or `None` (left as it is)
    arguments: list[Argument]
    batches: Batches


@dataclasses.dataclass
class _Layout:
    """For one plan and one structure of the arguments: the context it runs in, the
    traced leaves of the batch, and the layouts for each placement of those already
    placed."""

    context: _Context
    static: tuple[Any, ...]
    batch: frozenset[int]  # positions, among the traced leaves, of the batch's
    laid: dict[tuple[Any, ...], _Laid]


_TRACED = object()  # a traced leaf's place among the static ones
_GIVEN = object()  # the spec given to `jit`, in a layout's key
_CACHED = 256  # layouts kept per step, the oldest dropped first


def _active_of(p: Plan) -> Active:
    rules = p.spec if isinstance(p.spec, Rules) else None
    return Active(rules, p.mesh if p.mesh_is_given else None, p.devices, p)


def _placed(x: Any) -> Any:
    """A batch leaf's own sharding, where it is a `NamedSharding` (the data loader's
    layout, which it may keep); else `None`."""
    s = getattr(x, "sharding", None)
    return s if isinstance(s, NamedSharding) else None


def _sorted(
    traced: list[Any], targets: list[Any], batch: frozenset[int]
) -> tuple[list[int], list[int]]:
    """The traced leaves to move into their layouts before the call, and those placed
    otherwise. Moved: a leaf not yet placed (a NumPy array, or a JAX array left
    uncommitted, as a model fresh from its constructor is), a batch leaf committed to
    other devices or another layout (a loader's `jax.device_put(x, jax.devices()[0])`:
    the batch is new each step, so moving it is the step's own work), and a leaf in a
    layout equal in its blocks (rewrapped: `jax.jit` keys its cache by the sharding).
    So the first call traces and compiles the program that every later call, given the
    first's placed outputs, runs. A leaf of the model committed elsewhere is placed
    otherwise."""
    moved: list[int] = []
    misplaced: list[int] = []
    for i, (x, target) in enumerate(zip(traced, targets)):
        if target is None:
            continue
        have = getattr(x, "sharding", None)
        if have is target or have == target:
            continue
        if (
            have is None
            or i in batch
            or not getattr(x, "committed", True)
            or have.is_equivalent_to(target, np.ndim(x))
        ):
            moved.append(i)
        else:
            misplaced.append(i)
    return moved, misplaced


def _brief(s: Any) -> str:
    if isinstance(s, NamedSharding):  # written the same on every JAX
        spec = ", ".join(map(repr, s.spec))
        return f"P({spec}) on {dict(zip(s.mesh.axis_names, s.mesh.axis_sizes))}"
    return type(s).__name__


def _argument_name(path: Any, names: list[str]) -> str:
    """`params` `.layers[0].weight` for a key path into `(args, kwargs)`."""
    if len(path) >= 2 and getattr(path[0], "idx", None) == 0:
        i = getattr(path[1], "idx", 0)
        head = names[i] if i < len(names) else f"argument {i}"
        return f"{head} {jax.tree_util.keystr(tuple(path[2:]))}".rstrip()
    return jax.tree_util.keystr(tuple(path[1:]))


# -- the step -----------------------------------------------------------------------


class Step(Generic[_P, _T]):
    """A step compiled by `eqshard.jit`: called as the function it wraps.

    **Attributes:**

    - `__wrapped__`: the function.
    - `donate`: as given to `eqshard.jit`.
    - `spec`: the spec given to `eqshard.jit`, or `None`: the active plan.
    - `batch`: the batch's expression, its `BatchRules`, or `None`.
    """

    def __init__(
        self,
        fn: Callable[_P, _T],
        *,
        donate: Donate = "none",
        spec: Spec = None,
        batch: str | Expression | BatchRules | None = None,
        plan: Plan | None = None,
    ) -> None:
        if plan is not None:  # its name before 0.2
            warnings.warn(
                "`Step(fn, plan=...)` is now `Step(fn, spec=...)`, which takes any spec",
                DeprecationWarning,
                stacklevel=2,
            )
            if spec is not None:
                raise EqshardError("`spec=` and `plan=` are both given; pass `spec=` alone")
            spec = plan
        if not callable(fn):
            raise EqshardError(f"`eqshard.jit` takes a function, not {type(fn).__name__}")
        if donate not in _DONATE:
            raise EqshardError(
                f"`donate={donate!r}` is not one of eqx.filter_jit's: "
                + ", ".join(map(repr, _DONATE))
            )
        functools.update_wrapper(self, fn)
        self.__wrapped__ = fn
        self.donate: Donate = donate
        self.spec = spec
        self.batch = batch_layout(batch)
        self._plain = eqx.filter_jit(fn, donate=donate)
        try:
            self._signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin, or a callable with no signature
            self._signature = None
        self._layouts: dict[Any, _Layout] = {}
        self._contexts: dict[Plan, _Context] = {}

    def __repr__(self) -> str:
        name = getattr(self.__wrapped__, "__qualname__", repr(self.__wrapped__))
        return f"eqshard.jit({name}, donate={self.donate!r})"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return functools.partial(self, instance)

    def __reduce__(self) -> Any:  # to a worker process: a plan holds this one's devices
        spec = None if isinstance(self.spec, Plan) else self.spec
        return (_rebuilt, (self.__wrapped__, self.donate, spec, self.batch))

    @property
    def plan(self) -> Spec:
        """Deprecated: the spec the step was made with is `spec`."""
        warnings.warn("`Step.plan` is now `Step.spec`", DeprecationWarning, stacklevel=2)
        return self.spec

    def __call__(self, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        on = self._on()
        if on is None:
            return self._plain(*args, **kwargs)
        bound, named = self._bound(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((bound, named))
        traced = [x for x in leaves if _is_array(x)]
        layout, laid = self._layout(on, bound, named, leaves, treedef, traced, _is_array)
        moved = self._into(leaves, treedef, traced, laid.targets, layout.batch)
        if moved is not None:
            bound, named = moved
        try:
            return layout.context.jitted(*bound, **named)
        except eqx.EquinoxRuntimeError as error:
            error.__traceback__ = None  # as eqx.filter_jit: the message holds the stacks
            raise

    def lower(self, /, *args: Any, **kwargs: Any) -> Lowered:
        """The step lowered for the active plan (or `spec=`) by `eqx.filter_jit`'s own
        `lower`, over concrete or abstract arguments (`jax.ShapeDtypeStruct`s, such as
        `eqx.filter_eval_shape` gives), without running it: `.compile()` it, read its
        text, or its `cost_analysis()` and `memory_analysis()`.

        **Raises:** `eqshard.EqshardError` when no plan is active and none was given.
        """
        on = self._on()
        if on is None:
            raise EqshardError(
                "`lower` lays the step out by a plan, and none is active: call it inside "
                "`with eqshard.use(plan):`, or make the step with `eqshard.jit(fn, spec=plan)`"
            )
        bound, named = self._bound(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((bound, named))
        traced = [x for x in leaves if _is_traced(x)]
        layout, laid = self._layout(on, bound, named, leaves, treedef, traced, _is_traced)
        abstract = [
            jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=target)
            for x, target in zip(traced, laid.targets)
        ]
        values = iter(abstract)
        leaves = [next(values) if _is_traced(x) else x for x in leaves]
        bound, named = jax.tree_util.tree_unflatten(treedef, leaves)
        lowered = _compat.filter_jit_lower(layout.context.jitted, bound, named)
        return Lowered(lowered, laid, layout.batch, abstract, self)

    # -- internals

    def _on(self) -> Any:
        """What lays the step out now: `spec=`, else the active plan, else the active
        rules (`Active`); `None` where there is none."""
        if self.spec is not None:
            return _GIVEN
        found = active()
        if found is None:
            return None
        return found.plan if found.plan is not None else found

    def _bound(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if kwargs and self._signature is not None:
            bound = self._signature.bind(*args, **kwargs)
            return bound.args, bound.kwargs
        return args, kwargs

    def _layout(
        self,
        on: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        treedef: Any,
        traced: list[Any],
        is_traced: Callable[[object], bool],
    ) -> tuple[_Layout, _Laid]:
        """The layout of arguments of this structure under `on`, made on the first
        call that needs it, and the arguments laid out for the batch's placement."""
        if isinstance(on, Plan) and isinstance(on.devices, int):
            on = placing(on, "`eqshard.jit`")  # made for a count: its first n devices
        static = tuple(_TRACED if is_traced(x) else x for x in leaves)
        key = (on, treedef, static, tuple(np.shape(x) for x in traced))
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= _CACHED:  # static arguments that change every call
                self._layouts.pop(next(iter(self._layouts)))
            context = self._context(on, args)
            laid = self._laid(context.plan, args, kwargs, static)
            kinds = [a.kind for a in laid.arguments for _ in a.shardings]  # per leaf
            traced_kinds = [kind for kind, x in zip(kinds, static) if x is _TRACED]
            batch = frozenset(k for k, kind in enumerate(traced_kinds) if kind == "batch")
            placed = tuple(_placed(traced[i]) for i in sorted(batch))
            layout = self._layouts[key] = _Layout(context, static, batch, {placed: laid})
            return layout, laid
        placed = tuple(_placed(traced[i]) for i in sorted(layout.batch))
        laid = layout.laid.get(placed)
        if laid is None:  # the batch is placed otherwise than at the first call
            laid = layout.laid[placed] = self._laid(layout.context.plan, args, kwargs, static)
        return layout, laid

    def _context(self, on: Any, args: tuple[Any, ...]) -> _Context:
        """The context of the plan `on` is (one per plan), or of the plan of the step's
        first argument, the model, by `spec=` or the active rules."""
        if isinstance(on, Plan):
            context = self._contexts.get(on)
            if context is None:
                context = self._contexts[on] = self._made(on, _active_of(on))
            return context
        if not args:
            raise EqshardError(
                "a step laid out by a spec (`eqshard.use(rules)`, or `spec=` other than a "
                "`Plan`) takes the plan of its first argument, the model, and this step was "
                "called with none; pass `eqshard.use(plan)` or `spec=plan`"
            )
        model = jax.tree_util.tree_map(abstract_array, args[0])
        rest = jax.tree_util.tree_map(abstract_array, args[1:])
        if on is _GIVEN:
            p = placing(as_plan(model, self.spec, args=rest), "`eqshard.jit`")
            return self._made(p, _active_of(p))
        p = as_plan(model, on.rules, mesh=on.mesh, devices=on.devices, args=rest)
        return self._made(p, dataclasses.replace(on, plan=p))

    def _made(self, p: Plan, on: Active) -> _Context:
        context = _Context(p, on, auto=not _explicit_refusals())
        context.jitted = eqx.filter_jit(_body(self.__wrapped__, context), donate=self.donate)
        return context

    def _laid(self, p: Plan, args: Any, kwargs: Any, static: tuple[Any, ...]) -> _Laid:
        names = self._names(len(args))
        # in the order `jax.tree_util.tree_flatten((args, kwargs))` visits them
        pairs = [*zip(names, args), *((f"`{k}`", kwargs[k]) for k in sorted(kwargs))]
        arguments, batches = lay_out_arguments(p, pairs, self.batch)
        flat = [s for argument in arguments for s in argument.shardings]
        assert len(flat) == len(static)
        targets = [s for s, x in zip(flat, static) if x is _TRACED]
        return _Laid(targets, arguments, batches)

    def _names(self, count: int) -> list[str]:
        """The positional arguments' names, as messages give them."""
        params = [] if self._signature is None else list(self._signature.parameters.values())
        names = []
        for i in range(count):
            if i < len(params) and params[i].kind in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            ):
                names.append(f"`{params[i].name}`")
            else:
                names.append(f"argument {i}")
        return names

    def _misplaced(
        self, targets: list[Any], args: Any, kwargs: Any, traced: list[Any], at: list[int]
    ) -> EqshardError:
        """The error for arguments placed otherwise than the plan lays them out."""
        paths = [
            path
            for (path, leaf) in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
            if _is_array(leaf)
        ]
        names = self._names(len(args))
        problems = [
            Problem(
                f"the step's {_argument_name(paths[i], names)}",
                f"is placed as {_brief(traced[i].sharding)}, and the plan lays it out as "
                f"{_brief(targets[i])}; place the tree with `eqshard.apply(tree, plan)` "
                "once, before the loop",
            )
            for i in at
        ]
        name = getattr(self.__wrapped__, "__qualname__", "the step")
        return SpecError(problems, f"{name} is called with arrays placed otherwise than its plan")

    def _into(
        self,
        leaves: list[Any],
        treedef: Any,
        traced: list[Any],
        targets: list[Any],
        batch: frozenset[int],
    ) -> Any:
        """The arguments, `leaves` of `treedef`, with every traced leaf in its layout
        (see `_sorted`), moved in one `jax.device_put` as `eqshard.apply` moves them;
        `None` where every leaf is in its layout already.

        **Raises:** `SpecError` naming each leaf placed otherwise."""
        moved, misplaced = _sorted(traced, targets, batch)
        if misplaced:
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            raise self._misplaced(targets, args, kwargs, traced, misplaced)
        if not moved:
            return None
        positions = [k for k, x in enumerate(leaves) if _is_array(x)]
        chosen = [targets[i] for i in moved]
        sources = [source_for(traced[i], target) for i, target in zip(moved, chosen)]
        leaves = list(leaves)
        for i, x in zip(moved, jax.device_put(sources, chosen)):
            leaves[positions[i]] = x
        return jax.tree_util.tree_unflatten(treedef, leaves)


def _rebuilt(fn: Any, donate: Donate, spec: Any, batch: str | BatchRules | None) -> Step:
    return Step(fn, donate=donate, spec=spec, batch=batch)


class Lowered:
    """A step lowered by `Step.lower`: `jax.stages.Lowered`'s methods, and
    `compile()`, which gives a `Compiled` called as the step is."""

    def __init__(
        self, lowered: Any, laid: _Laid, batch: frozenset[int], abstract: list[Any], step: Step
    ) -> None:
        self.lowered = lowered  # `eqx.filter_jit`'s own
        self.abstract = abstract  # the traced leaves, abstract, with their input shardings
        self._laid = laid
        self._batch = batch
        self._step = step

    @property
    def in_shardings(self) -> list[Any]:
        """The program's input sharding for each traced leaf of the arguments."""
        return list(self._laid.targets)

    @property
    def arguments(self) -> list[Argument]:
        """How each argument is laid out (see `Argument`)."""
        return list(self._laid.arguments)

    @property
    def batch(self) -> str | None:
        """The expression that laid out a batch leaf, or the place of the batch rules
        that did (`model.eqshard.json::$.batch`); `None` where none was laid out."""
        return self._laid.batches.used

    def __getattr__(self, name: str) -> Any:  # `cost_analysis`, `compiler_ir`, ...
        return getattr(self.lowered.lowered, name)

    def as_text(self, *args: Any, **kwargs: Any) -> str:
        return self.lowered.lowered.as_text(*args, **kwargs)

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Compiled:
        """Compiles it; `compiler_options` as `jax.stages.Lowered.compile` takes them
        (XLA's debug options by name, for this compile only)."""
        compiled = _compat.filter_jit_compile(self.lowered, compiler_options)
        return Compiled(compiled, self._laid.targets, self._batch, self._step)


class Compiled:
    """A compiled step: called as the step is, with arrays of the shapes it was
    lowered for (its non-array arguments are those it was lowered with, whatever a
    call passes, as for `eqx.filter_jit`'s compiled steps), with
    `jax.stages.Compiled`'s `as_text()`, `cost_analysis()` and `memory_analysis()`."""

    def __init__(
        self, compiled: Any, targets: list[Any], batch: frozenset[int], step: Step
    ) -> None:
        self.compiled = compiled  # `eqx.filter_jit`'s own
        self._targets = targets
        self._batch = batch
        self._step = step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled.compiled, name)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._step._bound(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        traced = [x for x in leaves if _is_array(x)]
        moved = self._step._into(leaves, treedef, traced, self._targets, self._batch)
        if moved is not None:
            args, kwargs = moved
        try:
            return self.compiled(*args, **kwargs)
        except eqx.EquinoxRuntimeError as error:
            error.__traceback__ = None
            raise


@overload
def jit(
    fn: Callable[_P, _T],
    *,
    donate: Donate = "none",
    spec: Spec = None,
    batch: str | Expression | BatchRules | None = None,
    plan: Plan | None = None,
) -> Step[_P, _T]: ...


@overload
def jit(
    *,
    donate: Donate = "none",
    spec: Spec = None,
    batch: str | Expression | BatchRules | None = None,
    plan: Plan | None = None,
) -> Callable[[Callable[_P, _T]], Step[_P, _T]]: ...


def jit(
    fn: Callable[_P, _T] | None = None,
    *,
    donate: Donate = "none",
    spec: Spec = None,
    batch: str | Expression | BatchRules | None = None,
    plan: Plan | None = None,
) -> Step[_P, _T] | Callable[[Callable[_P, _T]], Step[_P, _T]]:
    """`eqx.filter_jit`, with the plan's layouts pinned on the step's inputs and
    outputs.

    **Example:**

    ```python
    @eqshard.jit(donate="all")
    def step(model, opt_state, batch):
        grads = eqx.filter_grad(loss)(model, batch)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state

    with eqshard.use(plan):                 # any plan: fields, a spec tree, rules
        model, opt_state = eqshard.apply((model, opt_state), plan)
        for batch in batches:
            model, opt_state = step(model, opt_state, batch)
    ```

    **Arguments:**

    - `fn`: the step; as a decorator, leave it out.
    - `donate`: as for `eqx.filter_jit`: `"all"`, `"all-except-first"`, `"warn"`,
        `"warn-except-first"` or `"none"` (the default).
    - `spec`: what lays the step out, always: any spec, as `eqshard.plan` takes it (a
        `Plan`, rules, an expression, a spec tree), planned for the first argument;
        by default the active plan (`eqshard.use`). With neither, it is `eqx.filter_jit`.
    - `batch`: the batch's layout, for every batch leaf, placed or not: a complete
        expression such as `"b ... -> b* ..."`, or `eqshard.BatchRules`, leaf by leaf.
    - `plan`: deprecated; pass `spec=`.

    **Returns:**

    The step (a `eqshard.results.Step`), called as `fn` is; `step.lower(*args)` lowers it over
    concrete or abstract arguments.

    **Raises:**

    - `eqshard.EqshardError`: a `donate` eqx.filter_jit does not know, or a malformed
        `batch` (with a caret).
    - `eqshard.SpecError`, when called: an argument the plan cannot lay out (its shape
        differs from the model's, or the batch's layout cannot split it), or one
        already placed otherwise than the plan lays it out.
    - `eqx.EquinoxRuntimeError`, when called: an `eqx.error_if` fired, as under
        `eqx.filter_jit`.

    !!! info

        Each argument and output is laid out by structure, as `eqshard.apply(tree,
        plan)` lays out a tree built from the model: the model and its optimizer state
        as the plan says; an argument that holds nothing of the model's is the batch
        (by `batch`, else the spec file's `"batch"`, else data parallel); any other
        output replicated. The step is traced and compiled once per plan. Getting
        started's [Training](../index.md#training-eqshardjit) covers tracing on
        Explicit axes, the batch and lowering.
    """
    if plan is not None:
        warnings.warn(
            "`eqshard.jit(plan=...)` is now `eqshard.jit(spec=...)`, which takes any spec",
            DeprecationWarning,
            stacklevel=2,
        )
        if spec is not None:
            raise EqshardError("`spec=` and `plan=` are both given; pass `spec=` alone")
        spec = plan
    if fn is None:
        return functools.partial(jit, donate=donate, spec=spec, batch=batch)
    return Step(fn, donate=donate, spec=spec, batch=batch)
