"""What a spec costs: memory per device and communication of the user's own step.

The driver: `cost` lays out the model, its `eqx.nn.State` and its optimizer state by
the spec (abstractly: no device memory is spent), compiles the user's training step
over them as `eqshard.jit` compiles it (`_compile.py`, the one place a lowered step
is compiled), and reads the compiled program: its collectives and FLOPs from its HLO
text (`_hlo/`, pure text), bytes accessed and XLA's memory analysis from the
compiler, and a roofline estimate on a hardware profile (`_hardware.py`); what it
gives is `_results.py`'s `Cost`. XLA's SPMD partitioner runs the same on simulated
CPU devices as on accelerators, so the communication is known from a laptop;
XLA:CPU's own peak leaves out the temporaries it allocates, so `Memory.peak` counts
them (what each compiler's peak is: `_results.py`'s `PEAK_RULES`). `simulate=n` is
costed in a worker on n simulated XLA:CPU devices (`_process/_workers.py`).
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import PyTree

from .._activations import recording_laid_out
from .._arguments import abstract_array, batch_layout
from .._compat import filter_jit_donation
from .._errors import EqshardError, step_error
from .._expression import Expression
from .._fields import is_array_like, leaf_name
from .._pipeline import recording as recording_pipelines
from .._plan import Plan, Spec, as_plan, placing
from .._process._usercode import with_user_frames
from .._sharding import AnyMesh, Device, Devices, device_count, placement
from .._specfile._model import BatchRules, Rules
from .._step import Donate, Step
from ._compile import (
    Held,
    as_collectives,
    compile_step,
    costing_options,
    parse_hlo,
    read_memory,
)
from ._explain import explain
from ._hlo._calls import value_dependent
from ._hlo._collectives import collectives
from ._hlo._flops import flops, value_dependent_flops
from ._results import Cost
from ._targets import CompileTarget, compile_target

__all__ = ["compiler_label", "cost", "portable", "unplaced"]


def cost(
    model: PyTree[Any],
    *args: PyTree[Any],
    step: Callable[..., Any],
    spec: Spec,
    batch: str | Expression | BatchRules | None = None,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    simulate: int | None = None,
    target: str | None = None,
    compile_for: Literal["running", "costing"] = "running",
) -> Cost:
    """Compiles the user's step under a spec, without running it, and reads what one
    step costs on each device: memory, collectives by mesh axes, FLOPs, and a roofline
    estimate (`Cost.estimate`). The step is compiled as `eqshard.jit` compiles it.

    **Example:**

    ```python
    c = eqshard.cost(model, opt_state, batch, step=train_step, spec=rules)
    c.memory.parameters, c.memory.optimizer, c.memory.peak    # bytes per device
    [(k.kind, k.bytes, k.axes) for k in c.collectives]        # "all-reduce", ...
    c.flops                                                   # per device
    c.estimate("h100").seconds                                # a roofline estimate

    c = eqshard.cost(model, opt_state, batch, step=train_step, spec=rules, simulate=64)
    ```

    **Arguments:**

    - `model`: the model, concrete or abstract (`eqx.filter_eval_shape`).
    - `*args`: the rest of the step's arguments, concrete or abstract: the model's
        `eqx.nn.State`, an optimizer state, the batch.
    - `step`: the training step, called as `step(model, *args)`: an `eqx.filter_jit`
        function (its donation is kept), an `eqshard.jit` one, or a plain one.
    - `spec`: anything `eqshard.apply` takes, a `Plan` included.
    - `batch`: the layout of every batch leaf: a complete expression
        (`"b ... -> b* ..."`) or `eqshard.BatchRules`; by default as `eqshard.jit` does.
    - `mesh`: as for `eqshard.plan`.
    - `devices`: else, this process's devices: a list, or a count (the first that
        many); by default all of `jax.devices()`.
    - `simulate`: else, a count of simulated XLA:CPU devices to compile on, in a
        worker process (cloudpickle: the `eqshard[cost]` extra).
    - `target`: a TPU slice (`"v5e:4x4"`) to compile for with XLA:TPU, without a TPU.
    - `compile_for`: `"costing"` spends less time on machine code, for the same
        figures.

    **Returns:**

    A `Cost`; `Cost.compiler` names the compiler and the devices it compiled for.

    **Raises:**

    - `eqshard.SpecError`: the spec does not lay out the model, its state, the optimizer
        state or a batch leaf.
    - `eqshard.ExpressionError`: `batch` is malformed or a short form.
    - `eqshard.StepError`: the step cannot be traced or compiled.
    - `eqshard.UsageError`: `devices` and `simulate` are both given.
    - `eqshard.EqshardError`: the step cannot be costed as asked (an `AbstractMesh`, a
        `target` with `devices`, no cloudpickle, a program it cannot read).

    The guide "Cost and targets" says more: how the arguments are laid out,
    activations, simulated devices, TPU targets, `compile_for` and the errors.
    """
    if compile_for not in ("running", "costing"):
        raise EqshardError(
            f"`compile_for` is 'running' (compiled as the step runs) or 'costing' "
            f"(compiled only to be costed), not {compile_for!r}"
        )
    batch = batch_layout(batch)  # checked here, with a caret, before anything is compiled
    on: CompileTarget | None = None
    if target is not None:
        on, mesh, devices = _on_target(target, spec, mesh, devices, simulate)
    else:
        placed = placement(devices, simulate, what="`eqshard.cost`", was_simulated=True)
        if isinstance(placed, int):  # simulated: compiled in a worker that has them
            return _in_a_process_of_its_own(step, model, args, spec, batch, placed, compile_for)
        devices = placed
    abstract_model = jax.tree_util.tree_map(abstract_array, model)
    abstract_args = [jax.tree_util.tree_map(abstract_array, arg) for arg in args]
    if isinstance(spec, Plan):  # it has its devices: the command line's `--devices` aside
        mesh = devices = None
    p = as_plan(abstract_model, spec, mesh=mesh, devices=devices, args=abstract_args)
    p = placing(p, "`eqshard.cost`")  # a plan made for a count: the first n devices
    fn = getattr(step, "__wrapped__", step)
    n = device_count(p.devices) if p.devices is not None else (p.mesh.size if p.mesh else 1)
    # The program `eqshard.jit` runs under this plan: the same input and output layouts.
    program = Step(fn, donate=_donation(step), spec=p, batch=batch)
    try:
        with recording_pipelines() as pipelines, recording_laid_out() as activations:
            lowered = program.lower(abstract_model, *abstract_args)
        platform = _platform(p, on)
        options = costing_options(platform) if compile_for == "costing" else None
        compiled = compile_step(lowered, options)
    except (EqshardError, KeyboardInterrupt):
        raise
    except BaseException as error:  # the user's step (SystemExit too): named, with its cause
        name = getattr(fn, "__qualname__", type(fn).__name__)
        failed = step_error(
            f"`eqshard.cost` cannot trace and compile the step {name} on {n} devices under "
            f"{_spec_name(spec)}: it raised {type(error).__name__}: {error}",
            error,
        )
        raise with_user_frames(failed, error) from error
    held = Held()
    for i, argument in enumerate(lowered.arguments):
        if argument.plan is not None:  # the model, its state, an optimizer state
            held.count(argument.plan, "parameters" if i == 0 else "optimizer")
    module = parse_hlo(compiled.text, p.mesh)
    ops = collectives(module)
    found = as_collectives(ops, p.mesh)
    inputs, parameters = _argument_names(abstract_model, abstract_args, lowered.arguments)
    explained = explain(
        module,
        ops,
        found,
        inputs,
        _output_names(lowered),
        parameters,
        _is_user,
        _is_caller,
        pipelined=bool(pipelines),
    )
    dtypes = [row.dtype for row in held.parameters]
    return Cost(
        memory=dataclasses.replace(
            read_memory(held, compiled, platform),
            autotuned=on is None or on.platform != "gpu",  # a GPU target has no GPU to time
        ),
        collectives=found,
        flops=float(flops(module)),
        bytes_accessed=float(compiled.costs.get("bytes accessed", 0.0)),
        mesh=p.mesh,
        devices=n,
        dtype=max(set(dtypes), key=dtypes.count) if dtypes else "float32",
        compiler=on.compiler if on is not None else compiler_label(_devices_of(p), n),
        compiler_options=compiled.options,
        target=None if on is None else on.name,
        hardware=None if on is None else on.hardware,
        memory_per_device=None if on is None else on.memory_per_device,
        batch=lowered.batch,
        loops=tuple(sorted(set(value_dependent(module).values()))),
        loop_flops=float(value_dependent_flops(module)),
        pipelines=tuple(pipelines),
        activations=tuple(activations),
        explanations=explained,
    )


def _argument_names(
    model: Any, args: Sequence[Any], arguments: Sequence[Any]
) -> tuple[dict[tuple[str, int], str], list[str]]:
    """The name of each leaf of the step's arguments, by where `eqx.filter_jit`
    lowers it (`_explain.argument_index`): the model's by its path, the others' by
    their argument's part (`optimizer: 0.mu.layers.0.weight`, `batch`); and the
    model's array leaves' names."""
    names: dict[tuple[str, int], str] = {}
    parameters = []
    for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(model)[0]):
        names[("first", i)] = leaf_name(path)
        if is_array_like(leaf):
            parameters.append(leaf_name(path))
    for j, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(tuple(args))[0]):
        k = getattr(path[0], "idx", 0)
        kind = getattr(arguments[k + 1], "kind", "") if k + 1 < len(arguments) else ""
        label = (
            "state"
            if isinstance(args[k], eqx.nn.State)
            else {"built": "optimizer", "batch": "batch", "model": "model"}.get(kind, f"args[{k}]")
        )
        names[("rest", j)] = f"{label}: {leaf_name(path[1:])}" if path[1:] else label
    return names, parameters


def _output_names(lowered: Any) -> list[str]:
    """The path of each of the compiled step's outputs, in order; none where this JAX
    does not say its outputs' structure."""
    try:
        tree = lowered.out_tree
        paths = jax.tree_util.tree_flatten_with_path(
            jax.tree_util.tree_unflatten(tree, range(tree.num_leaves))
        )[0]
    except Exception:  # an `out_tree` that this JAX keeps elsewhere
        return []
    return [leaf_name(path) for path, _ in paths]


_EQSHARD = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DEMO = os.path.join(_EQSHARD, "_demo") + os.sep
_COST = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARIES = tuple(
    {os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "purelib", "platlib")}
)


def _is_user(file: str) -> bool:
    """Whether a traced frame's file is the user's: not eqshard's (but its demo's
    model and step, an application beside the library), not an installed package's,
    not the standard library's."""
    path = os.path.abspath(file)
    return not (
        file.startswith("<")
        or (path.startswith(_EQSHARD) and not path.startswith(_DEMO))
        or path.startswith(_LIBRARIES)
        or f"{os.sep}site-packages{os.sep}" in path
        or f"{os.sep}dist-packages{os.sep}" in path
    )


def _is_caller(file: str) -> bool:
    """Whether a traced frame is `cost`'s own (`_cost/`): the frames outer to it
    called `cost`, and traced none of the step."""
    return os.path.abspath(file).startswith(_COST)


def _on_target(
    target: str, spec: Any, mesh: AnyMesh | None, devices: Any, simulate: int | None = None
) -> tuple[CompileTarget, AnyMesh | None, Sequence[Device] | None]:
    """The TPU slice `target`, and the `mesh=` or `devices=` that lay the step out on
    its devices: the user's mesh, its axes over the slice's devices in their order;
    else the slice's devices, all of them."""
    if devices is not None or simulate is not None:
        given = "devices" if devices is not None else "simulate"
        raise EqshardError(
            f"`{given}=` and `target={target!r}` are both given; the slice has its devices "
            "(pass `mesh=` for axis names, or neither)"
        )
    if isinstance(spec, Plan):
        raise EqshardError(
            f"`spec` is a `Plan`, made on this process's devices, and `target={target!r}` "
            "lays the step out on the slice's: pass the spec the plan was made from"
        )
    on = compile_target(target)
    if mesh is None:
        return on, None, on.devices
    if mesh.size != len(on.devices):
        raise EqshardError(
            f"the mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))} holds {mesh.size} "
            f"devices, and the slice {target!r} has {len(on.devices)}; give it axes whose "
            f"sizes multiply to {len(on.devices)}"
        )
    grid = np.empty(len(on.devices), dtype=object)
    grid[:] = on.devices
    return on, Mesh(grid.reshape(mesh.axis_sizes), mesh.axis_names, mesh.axis_types), None


def _platform(p: Plan, on: CompileTarget | None) -> str:
    """The platform whose compiler compiles the step: the target's, else that of the
    plan's devices (`"cpu"` for simulated ones)."""
    if on is not None:
        return on.platform
    devices = getattr(p.mesh, "devices", None)
    first = np.asarray(devices).flat[0] if devices is not None else jax.devices()[0]
    return str(first.platform)


def compiler_label(devices: Sequence[Any] | None, n: int) -> str:
    """The compiler a step was compiled with here, and for what, by the devices'
    platform: `"XLA:GPU (NVIDIA H100 80GB HBM3), 1 device"`; `"XLA:CPU, 8 simulated
    devices"` for a count (`devices` is `None`) and for this process's CPU devices
    beyond one, which are XLA's simulated ones."""
    if not devices:
        return f"XLA:CPU, {n} simulated devices"
    first = devices[0]
    platform = str(getattr(first, "platform", "cpu"))
    count = f"{n} device{'s' * (n != 1)}"
    if platform == "cpu":
        return f"XLA:CPU, {n} simulated devices" if n > 1 else f"XLA:CPU, {count}"
    return f"XLA:{platform.upper()} ({first.device_kind}), {count}"


def _devices_of(p: Plan) -> list[Any]:
    """The plan's devices, else this process's first (a plan on no mesh)."""
    devices = getattr(p.mesh, "devices", None)
    return list(np.asarray(devices).flat) if devices is not None else jax.devices()[:1]


def _spec_name(spec: Any) -> str:
    """The spec, as a message names it: a spec file by its name, else by its type."""
    if isinstance(spec, Rules):
        named = not spec.source.startswith("<")  # "<mapping>": loaded from a dict
        return f"the spec file {spec.source}" if named else f"the `Rules` of a {spec.source[1:-1]}"
    if isinstance(spec, (str, Expression)):
        return f"the expression {str(spec)!r}"
    return f"a spec of type {type(spec).__name__}"


def unplaced(tree: Any) -> Any:
    """`tree` with every array abstract and without a sharding: nothing in it holds
    this process's devices, so it can cross to another process."""
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype)
            if isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)
            else x
        ),
        tree,
    )


_TIMEOUT_SECONDS = 3600.0  # compiling the step in a process of its own


def _in_a_process_of_its_own(
    step: Any,
    model: Any,
    args: tuple[Any, ...],
    spec: Any,
    batch: str | BatchRules | None,
    devices: int,
    compile_for: str = "running",
) -> Cost:
    """`cost` on `devices` simulated CPU devices, in a worker process that has them
    (`eqshard._process._workers.start_worker`: this process's `sys.path`, errors raised here
    as the same class); the step, the abstract arguments and the spec travel in the
    request with cloudpickle, the `Cost` in the answer."""
    import os

    from .._process._pickles import pickled, unpickled
    from .._process._workers import start_worker, without_device_count, worker_answer

    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        raise EqshardError(
            f"the cost on `simulate={devices}` devices is compiled in a process of its own "
            f"with {devices} simulated devices, which needs cloudpickle (`pip install "
            "'eqshard[cost]'`); or run `eqshard check SPEC --model ... --step ...`, which "
            "starts one per device count"
        ) from None
    if isinstance(spec, Plan):
        raise EqshardError(
            "a `Plan` holds this process's devices and cannot go to another process; "
            "pass the spec it was made from"
        )
    work = pickled(
        (step, unplaced(model), unplaced(args), spec, batch),
        "the step, its arguments or the spec",
        "define the step at the top level of a module, or in the script being run",
    )
    request = {"devices": devices, "work": work, "compile_for": compile_for}
    worker = start_worker(
        request, "eqshard._cost._driver:_worker", without_device_count(os.environ)
    )
    document = worker_answer(
        worker,
        _TIMEOUT_SECONDS,
        f"compiling the step on {devices} devices",
        f"Compile it on at most {len(jax.devices())} devices in this process to see why",
    )
    return unpickled(document["result"], "the cost")


def _worker() -> int:
    """The other side of `_in_a_process_of_its_own` (a worker's entry): `cost` on
    the request's device count, answered as `eqshard._process._workers.serve` answers: the
    `Cost`, pickled, or the error."""
    from .._process._workers import serve

    return serve(_cost_here)


def _cost_here(request: Any) -> str:
    """The worker's `cost`, JAX not yet started."""
    from .._errors import whole_number
    from .._process._pickles import pickled, unpickled

    devices = whole_number(request["devices"], "devices")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    step, model, args, spec, batch = unpickled(
        request["work"], "the step, its arguments or the spec"
    )
    started = len(jax.devices())  # the step's module may have started JAX with its own count
    if started < devices:
        raise EqshardError(
            f"compiling the step on {devices} devices needs {devices} simulated devices, "
            f"but JAX started with {started}: the step's modules set that count "
            "(jax.config.update('jax_num_cpu_devices', ...)); leave the count to eqshard"
        )
    found = cost(
        model,
        *args,
        step=step,
        spec=spec,
        batch=batch,
        devices=devices,  # this worker's own, simulated by XLA:CPU
        compile_for=request.get("compile_for", "running"),
    )
    return pickled(portable(found), "the cost", "report it as a bug in eqshard")


def portable(found: Cost) -> Cost:
    """`found` with its mesh abstract: it holds no device, so it crosses to another
    process (a worker's answer)."""
    if found.mesh is None:
        return found
    return dataclasses.replace(found, mesh=found.mesh.abstract_mesh)


def _donation(step: Any) -> Donate:
    """The donation of a step as given to `cost`: an `eqshard.jit` step's own, an
    `eqx.filter_jit` step's (its donation flags), none for a plain function."""
    if isinstance(step, Step):
        return step.donate
    first, rest = filter_jit_donation(step) or (False, False)
    return "all" if first and rest else "all-except-first" if rest else "none"
