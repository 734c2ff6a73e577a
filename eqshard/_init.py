"""`init`: build a model straight into its shards, never whole on one device.

The model is first built abstractly (`eqx.filter_eval_shape`). That gives its structure,
its non-array leaves and the plan. Then the array leaves are built in groups, one
`jax.jit` each with `out_shardings`. XLA's SPMD partitioner splits the computation,
random-number generation included (JAX's partitionable threefry). So each device
computes and holds only its shards, and XLA drops the rest of the factory as dead code.

Each group is lowered with threefry unrolled on CPU (`_compat.unrolled_threefry`), so
its program holds no random-number temporaries. JAX's rolled CPU lowering keeps about 3x
every random leaf's shard alive; one `jit` for the whole model then peaks at about 2.3
times the model's bytes. A group whose leaves need a matrix product, a reduction or
another op whose rounding depends on fusion is lowered as JAX lowers it, as the recipe
is. So its values are the recipe's.

Non-array leaves (functions, Python floats such as `Dropout.p`, static fields) never
pass through `jit`. So they come back exactly as the factory makes them. The arrays that
closures capture are left as dead tracers by the abstract build. They are built by one
more `jit` (replicated), or are the model's own leaves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.core
import numpy as np

from ._compat import dce_jaxpr, subjaxprs, unrolled_threefry, warn_once
from ._derive import derived_plan
from ._errors import EqshardError, SpecError
from ._fields import FROM_FIELDS, leaf_name
from ._plan import Plan, Spec, Unspecified, placing
from ._problems import Problem
from ._sharding import AnyMesh, Devices, placement
from ._values import unplaceable

__all__ = ["init", "initializer"]

Model = TypeVar("Model")


def _is_array(x: object) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def initializer(factory: Callable[[], Any], plan: Plan) -> Any:
    """The jitted function that builds `factory()`'s array leaves in `plan`'s shardings.

    It returns the array part of the model (`eqx.partition(model, eqx.is_array)[0]`),
    in one program, lowered as JAX lowers it: the usual recipe, which
    `benchmarks/bench_init.py` compares `init` with (`init` builds groups of leaves,
    its random numbers lowered unrolled on CPU).
    """
    flat = [
        (s if s is not None else plan.replicated()) if _is_array(leaf) else None
        for leaf, s in zip(plan.resolved.leaves, plan.flat_shardings)
    ]
    out_shardings = jax.tree_util.tree_unflatten(plan.resolved.treedef, flat)

    def arrays() -> Any:
        return eqx.filter(factory(), eqx.is_array)

    return jax.jit(arrays, out_shardings=out_shardings)


def init(
    factory: Callable[[], Model],
    spec: Spec = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    unspecified: Unspecified = "replicate",
) -> Model:
    """Builds a model straight into its shards: no device ever holds a whole leaf it
    should hold only a shard of.

    **Example:**

    ```python
    model = eqshard.init(functools.partial(GPT, cfg, key=key), rules, mesh=mesh)
    ```

    **Arguments:**

    - `factory`: a function of no arguments that builds the model; pure JAX, traced twice.
    - `spec`: anything `eqshard.apply` takes, a `Plan` included.
    - `mesh`: as for `eqshard.plan`.
    - `devices`: else, this process's devices: a list, or a count (the first that
        many); by default all of `jax.devices()`.
    - `unspecified`: as for `eqshard.plan`.

    **Returns:**

    The model, its array leaves placed as the spec says, every other leaf exactly as
    `factory` makes it (see the guide).

    **Raises:**

    - `eqshard.SpecError`: lists every leaf that cannot be laid out, and every 64-bit
        NumPy leaf under 32-bit JAX, which would be cast.
    - `eqshard.EqshardError`: `factory` fails to trace, saying why; or the mesh is a
        `jax.sharding.AbstractMesh`.

    The guide "Init and checkpoints" says more: the factory, what comes back, random
    numbers and float maths, and the errors.
    """
    wide: dict[int, str] = {}

    def traced() -> Any:
        # The factory's own leaves, before `eval_shape` makes them abstract: a NumPy
        # array is still one here, and `jit` would cast a 64-bit one. Such a leaf
        # leaves abstract and uncast (a cast can overflow, and warn).
        leaves, treedef = jax.tree_util.tree_flatten(factory())
        for i, leaf in enumerate(leaves):
            why = None
            if isinstance(leaf, (np.ndarray, np.generic)):
                why = unplaceable(leaf, "`eqshard.init`")
            if why is not None:
                wide[i] = why
                leaves[i] = jax.ShapeDtypeStruct(
                    leaf.shape, jax.dtypes.canonicalize_dtype(leaf.dtype)
                )
        return jax.tree_util.tree_unflatten(treedef, leaves)

    try:
        abstract = eqx.filter_eval_shape(traced)
    except Exception as error:
        raise EqshardError(
            f"`eqshard.init` traces `factory` to build the model abstractly, and it raised "
            f"{type(error).__name__}: {error}; `factory` takes no arguments and is pure "
            "JAX (use functools.partial(MyModel, ..., key=key))"
        ) from error
    planned = derived_plan(
        abstract,
        spec,
        mesh=mesh,
        devices=placement(devices, what="`eqshard.init`"),
        unspecified=unspecified,
    )
    plan = planned.plan
    refused = [Problem(plan.resolved.where(i), why) for i, why in wide.items()]
    if planned.problems or refused:
        headline = "`eqshard.init` cannot place these leaves" if refused else None
        raise SpecError(planned.problems + refused, headline)
    plan = placing(plan, "`eqshard.init`")
    leaves = list(plan.resolved.leaves)
    for group in _groups(leaves):
        for i, array in zip(group, _compiled(factory, plan, group)()):
            leaves[i] = array
    model = jax.tree_util.tree_unflatten(plan.resolved.treedef, leaves)
    holders = traced_closures(model)
    if holders:
        values = iter(_closed_over(factory, plan, leaves, holders))
        _Captured(lambda _: next(values)).walk(model)
    return model


class _Captured:
    """Walks a model's objects, its closures included, to the arrays they capture.

    It goes into lists, tuples, dicts, `eqx.Module`s and other objects' attributes,
    static fields included, and into functions (their closure cells and defaults),
    `functools.partial`s and bound methods, and calls `visit` on every tracer it meets,
    once each, in an order that depends only on the model's structure. Where `visit`
    returns another value, it puts that value in the tracer's place (mutable holders
    in place; tuples, partials and bound methods rebuilt). `where` names the leaf (its
    key path) holding each tracer.
    """

    def __init__(self, visit: Callable[[Any], Any]) -> None:
        self.visit = visit
        self.where: list[str] = []
        self._memo: dict[int, tuple[Any, Any]] = {}

    def walk(self, tree: Any) -> Any:
        return self._one(tree, (), True)

    def _one(self, x: Any, path: tuple[Any, ...], named: bool) -> Any:
        seen = self._memo.get(id(x))
        if seen is not None:
            return seen[1]
        self._memo[id(x)] = (x, x)  # a cycle meets `x` as it is
        new = self._into(x, path, named)
        self._memo[id(x)] = (x, new)
        return new

    def _into(self, x: Any, path: tuple[Any, ...], named: bool) -> Any:
        keys = jax.tree_util
        if isinstance(x, _TRACER):
            self.where.append(leaf_name(path))
            return self.visit(x)
        if x is None or isinstance(x, _ATOMIC):
            return x
        if isinstance(x, list):
            for i, item in enumerate(x):
                x[i] = self._one(item, (*path, keys.SequenceKey(i)) if named else path, named)
            return x
        if isinstance(x, tuple):
            items = [
                self._one(item, (*path, keys.SequenceKey(i)) if named else path, named)
                for i, item in enumerate(x)
            ]
            if all(a is b for a, b in zip(items, x)):
                return x
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        if isinstance(x, dict):
            for k in list(x):
                x[k] = self._one(x[k], (*path, keys.DictKey(k)) if named else path, named)
            return x
        if isinstance(x, types.FunctionType):
            for cell in x.__closure__ or ():
                try:
                    held = cell.cell_contents
                except ValueError:  # a cell not yet filled
                    continue
                new = self._one(held, path, False)
                if new is not held:
                    cell.cell_contents = new
            if x.__defaults__:
                x.__defaults__ = self._one(x.__defaults__, path, False)
            if x.__kwdefaults__:
                self._one(x.__kwdefaults__, path, False)
            return x
        if isinstance(x, functools.partial):
            func = self._one(x.func, path, False)
            args = self._one(x.args, path, False)
            self._one(x.keywords, path, False)
            if func is not x.func or args is not x.args:
                x.__setstate__((func, args, x.keywords, vars(x) or None))  # pyright: ignore[reportAttributeAccessIssue]
            return x
        if isinstance(x, types.MethodType):
            func, owner = self._one(x.__func__, path, False), self._one(x.__self__, path, False)
            if func is x.__func__ and owner is x.__self__:
                return x
            return types.MethodType(func, owner)
        attributes = getattr(x, "__dict__", None)
        if isinstance(attributes, dict):
            module = named and isinstance(x, eqx.Module)
            names = [f.name for f in dataclasses.fields(x)] if module else list(attributes)
            for k in names:
                if k in attributes:
                    held = attributes[k]
                    where = (*path, keys.GetAttrKey(k)) if module else path
                    new = self._one(held, where, module)
                    if new is not held:
                        attributes[k] = new
        return x


_TRACER = jax.core.Tracer
_ATOMIC = (
    jax.ShapeDtypeStruct,
    jax.Array,
    np.ndarray,
    np.generic,
    str,
    bytes,
    int,
    float,
    complex,
    type,
    types.ModuleType,
    types.BuiltinFunctionType,
    types.CodeType,
)


def traced_closures(tree: Any) -> list[str]:
    """The leaves of `tree` (by key path) that hold a tracer: a closure, or another
    non-array leaf, over an array that `eqx.filter_eval_shape` or `jit` traced, and
    that is dead outside it. A leaf is named once for each tracer it holds."""
    walk = _Captured(lambda tracer: tracer)
    walk.walk(tree)
    return walk.where


def _closed_over(
    factory: Callable[[], Any], plan: Plan, leaves: list[Any], holders: list[str]
) -> list[Any]:
    """The arrays the model's closures capture, concrete, in `_Captured`'s order.

    `factory` is traced once more, by a `jit` whose outputs are the tracers its
    closures hold, replicated: a closure over one of the model's own array leaves gets
    that leaf, as `init` built it (the same array, as in an eager build), and
    nothing is computed twice.
    """
    sources: list[tuple[bool, int]] = []

    def captured() -> list[Any]:
        model = factory()
        index = {id(leaf): i for i, leaf in enumerate(jax.tree_util.tree_leaves(model))}
        found: list[Any] = []
        _Captured(lambda tracer: found.append(tracer) or tracer).walk(
            eqx.filter(model, eqx.is_array, inverse=True)
        )
        sources.clear()
        outputs = []
        for tracer in found:
            if id(tracer) in index:
                sources.append((True, index[id(tracer)]))
            else:
                sources.append((False, len(outputs)))
                outputs.append(tracer)
        return outputs

    try:
        outputs = jax.jit(captured, out_shardings=plan.replicated())()
    except Exception as error:
        raise EqshardError(
            f"{', '.join(dict.fromkeys(holders))}: `eqshard.init` builds the arrays this "
            f"closure captures with `jit`, and that raised {type(error).__name__}: {error}; "
            "keep the array in a field of the module instead of a closure"
        ) from error
    if len(sources) != len(holders):
        raise EqshardError(
            f"{', '.join(dict.fromkeys(holders))}: this closure captures {len(holders)} "
            f"traced arrays when `factory` is traced abstractly, and {len(sources)} under "
            "`jit`; `factory` must build the same model each time it is called"
        )
    return [leaves[i] if leaf else outputs[i] for leaf, i in sources]


_GROUP_BYTES = 1 << 27


def _groups(leaves: list[Any]) -> list[list[int]]:
    """The array leaves in groups built by one `jit` each, in model order.

    Each `jit` computes only its group (XLA drops the rest of the factory as dead
    code), so only one group's program, and its temporaries where a JAX keeps any,
    is alive at a time. A group holds at most `max(largest leaf, all / 16, 128 MiB)`
    bytes: few programs to compile (one for a small model), each small enough that
    compiling it costs little memory.
    """
    sizes = {
        i: math.prod(leaf.shape) * leaf.dtype.itemsize
        for i, leaf in enumerate(leaves)
        if _is_array(leaf)
    }
    if not sizes:
        return []
    budget = max(max(sizes.values()), sum(sizes.values()) // 16, _GROUP_BYTES)
    groups: list[list[int]] = [[]]
    held = 0
    for i, size in sizes.items():
        if groups[-1] and held + size > budget:
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += size
    return groups


def _initializer(factory: Callable[[], Any], plan: Plan, group: list[int]) -> Any:
    """The jitted function that builds the leaves `group` of `factory()`, in order."""
    shardings = [plan.flat_shardings[i] or plan.replicated() for i in group]

    def arrays() -> list[Any]:
        leaves = jax.tree_util.tree_leaves(factory())
        return [leaves[i] for i in group]

    return jax.jit(arrays, out_shardings=shardings)


def _compiled(factory: Callable[[], Any], plan: Plan, group: list[int]) -> Any:
    """`_initializer` compiled, its random numbers lowered without temporaries, unless
    the group's leaves are computed with maths whose rounding depends on fusion.

    A group whose leaves (the part of `factory` they need) hold a matrix product, a
    convolution, a reduction, a cumulative op, a sort or a linear solve is lowered as
    JAX lowers it, as the recipe is: with the hash unrolled, XLA fuses the draws into
    such ops and may sum in another order (`eqx.nn.SpectralNorm`'s power iterations
    over its weight's draw differ by 6e-8). Its random numbers keep their temporaries.
    """
    traced = _initializer(factory, plan, group).trace()
    if _reorders(traced.jaxpr):
        return traced.lower().compile()
    try:
        unrolled = unrolled_threefry()
    except EqshardError as error:
        warn_once(error, "lowers init's random numbers as JAX does, with their temporaries")
        return traced.lower().compile()
    with unrolled:
        return traced.lower().compile()


_REORDERING = {
    "dot_general",
    "conv_general_dilated",
    "ragged_dot",
    "ragged_dot_general",
    "sort",
    "fft",
    "cholesky",
    "lu",
    "qr",
    "svd",
    "eig",
    "eigh",
    "triangular_solve",
    "tridiagonal_solve",
}


def _reorders(closed: Any) -> bool:
    """Whether the part of `closed` its outputs need holds an op whose float
    arithmetic XLA may order otherwise when a draw is fused into it. Errs towards
    yes: where this JAX keeps its jaxpr tools elsewhere, every group is lowered as
    JAX lowers it (more memory, the same values), with a `VersionWarning`."""
    try:
        jaxpr = dce_jaxpr(closed.jaxpr)

        def any_in(jaxpr: Any) -> bool:
            for eqn in jaxpr.eqns:
                name = eqn.primitive.name
                prefixed = name.startswith(("reduce_", "cum", "arg"))
                if name in _REORDERING or (prefixed and name != "reduce_precision"):
                    return True
            return any(any_in(sub) for sub in subjaxprs(jaxpr))

        return any_in(jaxpr)
    except EqshardError as error:
        warn_once(error, "lowers init's random numbers as JAX does, with their temporaries")
        return True
