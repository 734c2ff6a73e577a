"""The harness's work for one device count, in a process of its own.

`main` reads one JSON request from stdin, starts JAX on that many simulated CPU
devices, imports the user's callables by name, and answers one JSON document on
stdout (`{"result": ...}` or `{"error": ...}`, as `eqshard check`'s workers do):

- `"task": "layouts"`: every array leaf's layout on each of the counts given, for
    golden files, made without devices (on abstract meshes);
- `"task": "equivalence"`: the unsharded and the sharded loss, gradients (and a
    stateful model's new state) and one optimizer step, compared leaf by leaf, with
    the smallest tolerances that pass them, and optionally the compiled step's
    communication against a budget.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import EqshardError, whole_number
from .._process._pickles import unpickled
from .._process._usercode import call, user_callable
from .._process._workers import serve
from ._tolerances import Needed

__all__ = ["main"]


def main() -> int:
    """Answers one request from stdin on stdout; see the module's docstring.

    **Returns:**

    The exit code, as `eqshard._process._workers.serve` gives it.
    """
    return serve(lambda request: _TASKS[request["task"]](request))


def _start(request: Mapping[str, Any]) -> int:
    """Starts JAX on the request's device count (simulated CPU devices)."""
    import jax

    devices = whole_number(request["devices"], "devices")
    jax.config.update("jax_platforms", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", devices)
    started = len(jax.devices())
    if started < devices:
        raise EqshardError(
            f"testing on {devices} devices needs {devices} simulated devices, but JAX "
            f"started with {started}: XLA_FLAGS or the user's code set that count; leave "
            "the count to eqshard.testing"
        )
    return devices


def _callable(request: Mapping[str, Any], what: str, modules: dict[str, Any]) -> Any:
    _, fn = user_callable(str(request[what]), f"`{what}`", what, f"`{what}` is importable", modules)
    return fn


def _spec(request: Mapping[str, Any]) -> Any:
    entry = request["spec"]
    if "file" in entry:
        from .._specfile._read import load

        return load(entry["file"])
    return unpickled(entry["pickle"], "`spec`")


def _target(request: Mapping[str, Any], devices: int, abstract: bool) -> dict[str, Any]:
    """`plan`'s `mesh=` (from the request's mesh template), else `devices=`: the first
    `devices` of this process, or, `abstract`, `simulate=`: their count, laid out on an
    abstract mesh."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from .._sharding import abstract_mesh

    template = request.get("mesh")
    if template is None:
        return {"simulate": devices} if abstract else {"devices": jax.devices()[:devices]}
    sizes = [int(size) if size != "*" else 0 for size in template.values()]
    fixed = math.prod(size for size in sizes if size)
    if devices % fixed:
        raise EqshardError(
            f"the mesh {template} needs a multiple of {fixed} devices, not {devices}; "
            "test on device counts the mesh fits"
        )
    sizes = [size or devices // fixed for size in sizes]
    if math.prod(sizes) != devices:
        raise EqshardError(f"the mesh {template} does not fit {devices} devices")
    if abstract:
        return {"mesh": abstract_mesh(tuple(sizes), tuple(template))}
    grid = np.array(jax.devices()[:devices]).reshape(sizes)
    return {"mesh": Mesh(grid, tuple(template))}


def _plan(model: Any, request: Mapping[str, Any], devices: int, abstract: bool = False) -> Any:
    from .._plan import plan

    spec = _spec(request)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layouts are compared, not warnings
        return plan(model, spec, **_target(request, devices, abstract))


def _layouts(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each count's layouts, made without devices: the model built once."""
    import equinox as eqx
    import jax

    counts = [whole_number(n, "devices") for n in request["devices"]]
    jax.config.update("jax_platforms", "cpu")  # never an accelerator another process holds
    modules: dict[str, Any] = {}
    build = _callable(request, "build", modules)
    model = call("`build`", request["build"], "build()", lambda: eqx.filter_eval_shape(build))
    return [_layout_entry(_plan(model, request, n, abstract=True)) for n in counts]


def _layout_entry(p: Any) -> dict[str, Any]:
    """One count's entry in a golden file: its mesh, and each leaf's layout.

    A leaf records its memory kind where it is not the device's (`"memory":
    "pinned_host"`), and, where the spec has an optimizer section that lays the
    leaf's optimizer state out otherwise than the leaf itself (ZeRO-1's moments
    split over 'data' beside replicated parameters, moments in host memory), that
    layout as `"optimizer"`: where the state follows its parameter, nothing is
    recorded, since the parameter's layout is the state's."""
    from .._report import leaf_rows

    mesh = dict(zip(p.mesh.axis_names, p.mesh.axis_sizes)) if p.mesh is not None else None
    section = {} if p.section is None else {row.path: row for row in leaf_rows(p.section)}
    leaves: dict[str, Any] = {}
    for row in leaf_rows(p):
        leaf = {"expression": row.expression, "partition_spec": row.partition_spec}
        leaf |= {"shape": list(row.shape), "dtype": row.dtype, **_placement(row)}
        state = section.get(row.path)
        if state is not None:
            own = {"expression": state.expression, "partition_spec": state.partition_spec}
            own |= _placement(state)
            if any(own.get(field) != leaf.get(field) for field in _OWN_LAYOUT):
                leaf["optimizer"] = own
        leaves[row.path] = leaf
    return {"mesh": mesh, "leaves": leaves}


_OWN_LAYOUT = ("expression", "partition_spec", "bytes_per_device", "memory")
"""What makes an optimizer state's layout its own, not its parameter's: where one
of these differs, the golden file records the state's layout."""


def _placement(row: Any) -> dict[str, Any]:
    """A leaf's bytes per device, its memory kind where it is not the device's, and,
    where FSDP could split no dim, its origin, which says why (a replicated leaf is
    then no surprise)."""
    from .._fsdp import is_fsdp_replicated

    return {
        "bytes_per_device": row.bytes_per_device,
        **({"memory": row.memory_kind} if row.memory_kind is not None else {}),
        **({"origin": row.origin} if is_fsdp_replicated(row.origin) else {}),
    }


def _equivalence(request: Mapping[str, Any]) -> dict[str, Any]:
    devices = _start(request)
    import equinox as eqx

    from .._activations import use
    from .._apply import apply
    from .._fields import is_stateful_pair

    modules: dict[str, Any] = {}
    build = _callable(request, "build", modules)
    loss = _callable(request, "loss", modules)
    make_batch = _callable(request, "batch", modules)
    optimizer = None
    if request.get("optimizer") is not None:
        make = _callable(request, "optimizer", modules)
        optimizer = call("`optimizer`", request["optimizer"], "optimizer()", make)

    built = call("`build`", request["build"], "build()", build)
    batch = call("`batch`", request["batch"], "batch()", make_batch)
    stateful = is_stateful_pair(built)  # (model, state): `loss(model, state, batch)`
    model = built[0] if stateful else built
    _check_loss(loss, str(request["loss"]), built, batch, stateful)
    opt_state = None
    if optimizer is not None:
        params = eqx.filter(model, eqx.is_array)
        opt_state = call(
            "`optimizer`",
            request["optimizer"],
            "optimizer().init(...)",
            lambda: optimizer.init(params),
        )
    gradient, update = _gradient(loss, stateful), _update(optimizer)
    want = gradient(built, batch)  # on one device: JAX's default placement
    if optimizer is not None:
        want += update(model, opt_state, want[1])

    p = _plan(built, request, devices)  # a (model, state) plan lays out both
    batch_layout, batch_from = _batch_layout(request.get("batch_spec"), p)
    placed = apply(built, p)
    placed_model = placed[0] if stateful else placed
    placed_opt_state = None if opt_state is None else apply(opt_state, p)
    placed_batch = _placed_batch(batch, batch_layout, batch_from, p)
    # A spec file's rules lay out the activations the model names, as under `use`.
    # The programs `eqshard.jit` runs under the plan: its layouts in and out.
    with use(p):
        got = gradient(placed, placed_batch)
        if optimizer is not None:  # from the same gradients: see `assert_equivalent`
            got += update(placed_model, placed_opt_state, apply(want[1], p))

    rtol, atol = request.get("rtol"), request.get("atol")
    parts = [part for part in _PARTS if stateful or part != _NEW_STATE]
    differences: list[dict[str, Any]] = []
    needed = Needed()
    for name, g, w in zip(parts, got, want):
        differences += _compare(name, g, w, rtol, atol, needed)
    result: dict[str, Any] = {
        "differences": differences,
        "needed": dataclasses.asdict(needed),
        "over_budget": [],
    }
    budget = request.get("max_communication")
    if budget:
        from .._cost._driver import cost

        rest = (placed_batch,) if opt_state is None else (placed_opt_state, placed_batch)
        step = _step(loss, optimizer, stateful)
        c = cost(placed, *rest, step=step, spec=p, batch=batch_layout)
        result["over_budget"] = _over_budget(c.collectives, budget)
    return result


_NEW_STATE = "new state"
_PARTS = (
    "loss",
    "gradients",
    _NEW_STATE,  # a stateful model's: what `loss` returns beside the value
    "parameters after one step",
    "optimizer state after one step",
)

_STATEFUL_LOSS = """\
    def loss(model, state, batch):
        x, y = batch
        out, state = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(x, state)
        return jnp.mean((out - y) ** 2), state"""


def _check_loss(loss: Any, reference: str, built: Any, batch: Any, stateful: bool) -> None:
    """Refuses a `loss` of the wrong shape for what `build()` returns, before any
    step is compiled: `loss(model, batch) -> value` for a model,
    `loss(model, state, batch) -> (value, state)` for a `(model, state)` pair."""
    import inspect

    import equinox as eqx
    import jax

    args = (*built, batch) if stateful else (built, batch)
    try:
        signature = inspect.signature(loss)
    except (TypeError, ValueError):  # a callable Python cannot read: its call will tell
        signature = None
    if signature is not None:
        try:
            signature.bind(*args)
        except TypeError:
            raise EqshardError(
                _wrong_loss(reference, stateful, f"takes ({', '.join(signature.parameters)})")
            ) from None
    called = "loss(model, state, batch)" if stateful else "loss(model, batch)"
    out = call("`loss`", reference, called, lambda: eqx.filter_eval_shape(loss, *args))

    def scalar(x: Any) -> bool:
        return isinstance(x, jax.ShapeDtypeStruct) and x.shape == ()

    if stateful:
        fits = (
            isinstance(out, (tuple, list))
            and len(out) == 2
            and scalar(out[0])
            and isinstance(out[1], eqx.nn.State)
        )
    else:
        fits = scalar(out)
    if not fits:
        raise EqshardError(_wrong_loss(reference, stateful, f"returns {_described(out)}"))


def _wrong_loss(reference: str, stateful: bool, what: str) -> str:
    if stateful:
        return (
            f"`loss` ({reference}): `build()` returns a model and its state (as "
            "`eqx.nn.make_with_state` does), so `loss` is called as "
            "`loss(model, state, batch)` and returns `(value, new_state)`; this one "
            f"{what}. Write it as Equinox's BatchNorm example does "
            "(https://docs.kidger.site/equinox/examples/stateful/):\n" + _STATEFUL_LOSS
        )
    return (
        f"`loss` ({reference}): `build()` returns the model alone, so `loss` is called as "
        f"`loss(model, batch)` and returns a scalar; this one {what}. A model with state "
        "(BatchNorm's running statistics) is built with its state: `build()` returns "
        "`eqx.nn.make_with_state(Model)(key)`, and `loss(model, state, batch)` returns "
        "`(value, new_state)`"
    )


def _described(out: Any) -> str:
    """What a loss returned, abstractly, for a message."""
    import jax

    if isinstance(out, jax.ShapeDtypeStruct):
        return f"a {out.dtype}{list(out.shape)} array"
    if isinstance(out, (tuple, list)):
        kinds = ", ".join(type(x).__name__ for x in out)
        return f"a {type(out).__name__} of {len(out)} ({kinds})"
    return f"a {type(out).__name__}"


def _on_device(tree: Any) -> Any:
    """`tree`'s arrays in device memory, inside `jit`: a spec may hold leaves in host
    memory (`"memory": "pinned_host"`), and JAX computes on one memory kind at a
    time, as a host-offload step does (`jax.device_put(x, jax.memory.Space.Device)`)."""
    import equinox as eqx
    import jax

    space = getattr(getattr(jax, "memory", None), "Space", None)
    if space is None:  # a JAX without memory spaces: nothing can be held elsewhere
        return tree
    arrays, rest = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, space.Device), rest)


def _gradient(loss: Callable[..., Any], stateful: bool) -> Callable[..., Any]:
    """`(loss, gradients)` of `loss(model, batch)`, or `(loss, gradients, new
    state)` of `loss(model, state, batch)` for a `(model, state)` pair, jitted by
    `eqshard.jit`: `eqx.filter_jit` with no plan active, the plan's layouts under one."""
    import equinox as eqx

    from .._step import jit

    if not stateful:

        @jit
        def gradient(model: Any, batch: Any) -> tuple[Any, ...]:
            return tuple(eqx.filter_value_and_grad(loss)(_on_device(model), batch))

        return gradient

    @jit
    def stateful_gradient(pair: Any, batch: Any) -> tuple[Any, ...]:
        model, state = _on_device(pair)
        (value, state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, state, batch)
        return value, grads, state

    return stateful_gradient


def _update(optimizer: Any) -> Callable[..., Any]:
    """`(parameters, state)` after one optimizer step from given gradients, jitted
    as `_gradient` is."""
    import equinox as eqx

    from .._step import jit

    @jit
    def update(model: Any, state: Any, grads: Any) -> tuple[Any, ...]:
        model, state, grads = _on_device((model, state, grads))
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    return update


def _step(loss: Callable[..., Any], optimizer: Any, stateful: bool) -> Callable[..., Any]:
    """The whole training step, as `eqshard.cost` compiles it for the budget: its
    first argument is the model, or the `(model, state)` pair."""
    import equinox as eqx

    def value_and_grad(built: Any, batch: Any) -> tuple[Any, Any, Any]:
        built = _on_device(built)
        if not stateful:
            value, grads = eqx.filter_value_and_grad(loss)(built, batch)
            return value, grads, None
        (value, state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(*built, batch)
        return value, grads, state

    if optimizer is None:

        @eqx.filter_jit
        def step(built: Any, batch: Any) -> Any:
            return value_and_grad(built, batch)

        return step

    @eqx.filter_jit
    def step_with_optimizer(built: Any, opt_state: Any, batch: Any) -> Any:
        value, grads, state = value_and_grad(built, batch)
        model = _on_device(built[0] if stateful else built)
        opt_state = _on_device(opt_state)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return value, eqx.apply_updates(model, updates), state, opt_state

    return step_with_optimizer


def _batch_layout(given: str | None, p: Any) -> tuple[Any, str]:
    """What the batch is laid out by, as `eqshard.cost` and `eqshard.jit` choose it
    (`eqshard._step.Batches`): `batch=`, else the spec file's `"batch"` (an
    expression or its rules: `Rules.batch`, the plan's spec), else data parallel over
    the mesh's first axis (or every device); and where it came from, for messages."""
    from .._arguments import data_parallel
    from .._specfile._model import Rules

    if given is not None:
        return given, "`batch=`"
    if isinstance(p.spec, Rules) and p.spec.batch is not None:
        return p.spec.batch, f'the "batch" of {p.spec.source}'
    return data_parallel(p), "data parallel, the default"


def _placed_batch(batch: Any, layout: Any, where: str, p: Any) -> Any:
    """The batch laid out by `layout` (from `_batch_layout`; `where` says where it
    came from), each array leaf as `eqshard.cost` lays it out."""
    import equinox as eqx
    import jax

    from .._arguments import Batches
    from .._problems import Problem, problem_lines
    from .._warnings import warn

    batches = Batches(layout, p)
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    problems: list[Problem] = []
    leaves = []
    for path, x in flat:
        if not eqx.is_array(x):
            leaves.append(x)
            continue
        found = batches.sharding(x, path, f"batch(){jax.tree_util.keystr(path)}")
        if isinstance(found, Problem):
            problems.append(found)
            continue
        leaves.append(jax.device_put(x, found))
    if problems:
        faults = "\n".join(f"  {line}" for line in problem_lines(problems))
        by = where if batches.rules is not None else f"{str(layout)!r} ({where})"
        raise EqshardError(
            f"the batch cannot be laid out by {by}:\n{faults}\npass `batch=` (an "
            'expression for every batch leaf, which wins over a spec file\'s "batch"; '
            "'... -> * ...' replicates it)"
        )
    warn(batches.warnings())
    return jax.tree_util.tree_unflatten(treedef, leaves)


def default_tolerance(dtype: Any) -> tuple[float, float]:
    """`(rtol, atol)` for a dtype: see `eqshard.testing.TOLERANCES`."""
    from ._tolerances import TOLERANCES

    return TOLERANCES.get(str(dtype), (0.0, 0.0))


def _compare(
    part: str,
    got: Any,
    want: Any,
    rtol: float | None,
    atol: float | None,
    needed: Needed | None = None,
) -> list[dict[str, Any]]:
    """Every leaf of `got` that differs from `want` beyond the tolerance, named as
    eqshard names leaves (a state's by its module: `bn.ema_state_index.0`), with
    the smallest tolerances it would pass with; `needed` is widened to pass every
    leaf, those that pass included."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .._fields import key_paths, leaf_name
    from ._tolerances import smallest_passing

    needed = Needed() if needed is None else needed
    got, want = eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array)
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    if got_def != want_def:
        needed.include(Needed(no_tolerance="the trees differ in structure"))
        return [
            {"part": part, "leaf": "", "message": "the sharded run's tree differs in structure"}
        ]
    found = []
    for path, g, w in zip(key_paths(want), got_leaves, want_leaves):
        name = leaf_name(path) if path else part
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            needed.include(Needed(no_tolerance="a leaf's shape or dtype differs"))
            found.append(
                {
                    "part": part,
                    "leaf": name,
                    "message": f"sharded {g.dtype}{list(g.shape)}, unsharded {w.dtype}{list(w.shape)}",
                }
            )
            continue
        r, a = default_tolerance(w.dtype)
        r = r if rtol is None else rtol
        a = a if atol is None else atol
        if jnp.issubdtype(w.dtype, jnp.inexact):  # bfloat16 and float8 included
            wide = np.complex128 if jnp.issubdtype(w.dtype, jnp.complexfloating) else np.float64
            g64, w64 = g.astype(wide), w.astype(wide)
            bad = ~np.isclose(g64, w64, rtol=r, atol=a, equal_nan=True)
            error = np.where(bad, np.abs(g64 - w64), 0.0)
            mine = smallest_passing(g64, w64, r, a)
        else:
            bad = g != w
            error = bad.astype(np.float64)
            mine = Needed(no_tolerance="integer leaves differ" if bad.any() else None)
        needed.include(mine)
        if not bad.any():
            continue
        worst = np.unravel_index(int(np.argmax(error)), bad.shape) if bad.shape else ()
        found.append(
            {
                "part": part,
                "leaf": name,
                "dtype": str(w.dtype),
                "count": int(bad.sum()),
                "size": int(bad.size),
                "index": [int(i) for i in worst],
                "sharded": repr(g[worst].item()),
                "unsharded": repr(w[worst].item()),
                "difference": float(error[worst]) if bad.shape else float(error),
                "rtol": r,
                "atol": a,
                "needed": dataclasses.asdict(mine),
            }
        )
    return found


def _over_budget(collectives: Any, budget: Mapping[str, int]) -> list[dict[str, Any]]:
    """The collective kinds whose bytes per step exceed the budget."""
    over = []
    for kind, limit in budget.items():
        mine = [c for c in collectives if c.kind == kind]
        moved = sum(c.total_bytes for c in mine)
        looped = sorted({c.loop for c in mine if c.loop is not None})
        if looped:  # what they move per step is not known: never within a budget
            over.append({"kind": kind, "limit": limit, "unknown": looped})
            continue
        if moved > limit:
            over.append(
                {
                    "kind": kind,
                    "bytes": moved,
                    "limit": limit,
                    "ops": [
                        {
                            "bytes": c.total_bytes,
                            "count": c.count,
                            "axes": list(c.axes),
                            "source": c.source,
                            "brief_source": c.brief_source,
                        }
                        for c in sorted(mine, key=lambda c: -c.total_bytes)[:5]
                    ],
                    "count": sum(c.count for c in mine),
                }
            )
    return over


_TASKS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "layouts": _layouts,
    "equivalence": _equivalence,
}

if __name__ == "__main__":
    raise SystemExit(main())
