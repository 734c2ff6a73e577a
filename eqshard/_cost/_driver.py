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
them (what each compiler's peak is: `_results.py`'s `PEAK_RULES`). More
devices than this process has are costed in a worker (`_process/_workers.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh

from .._activations import recording_laid_out
from .._arguments import abstract_array, batch_layout
from .._compat import filter_jit_donation
from .._errors import EqshardError, StepError
from .._expression import Expression
from .._layout import device_count_of
from .._pipeline import recording as recording_pipelines
from .._plan import Plan, Spec, as_plan, placing
from .._process._usercode import with_user_frames
from .._sharding import AnyMesh, Device, device_count
from .._specfile._model import BatchRules, Rules
from .._step import Donate, Step
from ._compile import (
    Held,
    compile_step,
    costing_options,
    parse_hlo,
    read_collectives,
    read_memory,
)
from ._hlo._calls import value_dependent
from ._hlo._flops import flops, value_dependent_flops
from ._results import Cost
from ._targets import CompileTarget, compile_target

__all__ = ["cost", "portable", "unplaced"]


def cost(
    model: Any,
    *args: Any,
    step: Any,
    spec: Spec,
    batch: str | Expression | BatchRules | None = None,
    mesh: AnyMesh | None = None,
    devices: int | Sequence[Device] | None = None,
    target: str | None = None,
    compile_for: Literal["running", "costing"] = "running",
) -> Cost:
    """Compiles the user's step under a spec, without running it, and reads what one
    step costs on each device: its memory, its collectives by mesh axes and the FLOPs
    of its matrix products, from which `Cost.estimate` gives a roofline estimate on a
    hardware profile. The step is compiled as `eqshard.jit` compiles it: with the same
    input and output layouts.

    **Example:**

    ```python
    c = eqshard.cost(model, opt_state, batch, step=train_step, spec=rules, devices=8)
    c.memory.parameters, c.memory.optimizer, c.memory.peak    # bytes per device
    [(k.kind, k.bytes, k.axes) for k in c.collectives]        # "all-reduce", ...
    c.flops                                                   # per device
    c.estimate("h100").seconds                                # a roofline estimate

    # a stateful model: the step takes its eqx.nn.State after the model
    c = eqshard.cost(model, state, opt_state, batch, step=step, spec=plan)
    c.memory.state                                            # bytes per device
    ```

    **Arguments:**

    - `model`: the model, concrete or abstract (`eqx.filter_eval_shape`).
    - `*args`: the rest of the step's arguments, concrete or abstract: the model's
        `eqx.nn.State`, an optimizer state, the batch (see "How the arguments are laid out").
    - `step`: the training step, called as `step(model, *args)`: an `eqx.filter_jit`
        function (its donation is kept), an `eqshard.jit` one, or a plain one.
    - `spec`: anything `eqshard.apply` takes, a `Plan` included: a plan made for the model,
        or for `(model, state)`.
    - `batch`: the complete expression that lays out every array leaf of the batch
        (`"b ... -> b* ..."`), or `eqshard.BatchRules`, leaf by leaf; without it, see
        "How the arguments are laid out".
    - `mesh`, `devices`: as for `eqshard.plan`; `devices` may be a count, more than this
        process has (see "More devices than this process has").
    - `target`: a TPU slice (`"v5e:4x4"`) to compile for with XLA:TPU, on this machine,
        without a TPU (see "On a TPU target").
    - `compile_for`: `"costing"` compiles with less optimisation of the generated code,
        for the same figures in less time (see "Compiled only to be costed").

    **Returns:**

    A `Cost`.

    **Raises:**

    - `eqshard.SpecError`: the spec does not lay out the model, its state, the optimizer
        state or a batch leaf (naming the leaf, its shape and the batch's rule).
    - `eqshard.ExpressionError`: `batch` is malformed or a short form.
    - `eqshard.EqshardError`: the step cannot be costed as asked (see "Errors").

    !!! info "How the arguments are laid out"

        The model's `eqx.nn.State` (a stateful model's, such as BatchNorm's running
        statistics) is laid out by the plan, as `eqshard.apply(state, plan)` does, and
        counted as `memory.state`. With a spec and a state among `args`, the plan is made
        for `(model, state)`, so that one mesh fits both; a plan made for `(model,
        state)` lays out both, and the step still takes the model alone first.

        An argument built from the model (an optimizer state: it holds subtrees shaped
        like the model) is laid out by the model's plan, its optimizer section where it
        has one, as `eqshard.apply(opt_state, plan)` does.

        The array leaves of the other arguments (the batch) are laid out by `batch`, a
        complete expression: `"b ... -> b* ..."` splits their leading dim over every
        device, `"... -> * ..."` gives each device a whole copy; or by `BatchRules`,
        each leaf by its path within its argument. Given, it lays out every batch leaf. Without it, a leaf already placed on the plan's devices (a
        `jax.Array`, or a `jax.ShapeDtypeStruct` carrying a sharding, whose
        `NamedSharding`'s mesh holds the plan's devices in the plan's order) keeps its
        sharding; the others (an array on one device, as `jnp.asarray` makes it, on
        other devices, or abstract without a sharding) are laid out by the spec file's
        `"batch"` (`Rules.batch`, an expression or a section of rules, also where `spec`
        is a `Plan` made from `Rules`), else
        data parallel: their leading dim split over the first axis of a mesh the user
        or the spec file gives (the data axis, by convention), else over every device.

    !!! info "Activations"

        A spec file's rules (or a plan made from them) are active while the step is
        traced, as under `eqshard.use`: activations the model names
        (`eqshard.constrain(x, ("batch", "embed"))`) are laid out by its `"dims"`, on the
        plan's mesh, and costed so.

    !!! info "More devices than this process has"

        `devices=n` is the first `n` devices of this process; where it has fewer, `n`
        simulated CPU devices in a new process: the step and the abstract arguments
        travel there with cloudpickle (the `eqshard[cost]` extra), so a laptop can ask
        for 64.

    !!! info "On a TPU target"

        `target` names a slice as `jax.experimental.topologies` names it (`"v5e:4x4"`,
        `"v5p:4x4x4"`, `"v6e:2x2"`, `"v4:2x2x1"`); the `eqshard[tpu]` extra installs
        libtpu. The step is compiled by XLA:TPU for that slice's devices, on this
        machine, without a TPU. The mesh is laid over the slice's devices in their
        order, with `mesh=`'s axis names and sizes where it is given, else the spec's.
        Memory is then the TPU compiler's own, `memory_per_device` the chip's HBM, and
        `estimate()` runs on the chip's profile. JAX cannot compile for a GPU without
        one: leave `target` out there.

    !!! info "Compiled only to be costed"

        With `compile_for="costing"` the step is compiled with options that spend less
        time on the machine code it would run (`Cost.compiler_options` names them):
        on XLA:CPU `xla_backend_optimization_level=0` and
        `xla_llvm_disable_expensive_passes=true`, about 0.6x the compile time. They
        change nothing `cost` reads: the partitioned HLO (its collectives and FLOPs)
        and the buffer assignment (its memory) come before that code generation, and
        the tests check every figure equal to the default compile's. On XLA:TPU and a
        GPU no option measured cheaper with the same figures: none is passed there.
        The compiled program is never run, so its speed does not matter.

    !!! failure "Errors"

        `eqshard.SpecError` when the spec does not lay out the model, its
        `eqx.nn.State`, the optimizer state or a batch leaf. `eqshard.ExpressionError`
        (with a caret) when `batch` is malformed or a short form.
        `eqshard.EqshardError`:

        - for a `target` that is no TPU slice, or without libtpu (saying how to
            install it); for a `compile_for` other than `"running"` or `"costing"`;
        - when the step cannot be traced or compiled, naming the step, the device
            count and the spec, with the step's or JAX's error as its cause (the
            command line exits 2 for it, as for a model that cannot be built);
        - when the mesh is a `jax.sharding.AbstractMesh`;
        - when more devices are asked for than this process has and cloudpickle is
            not installed;
        - when the compiled program holds a collective, a notation of device groups, a
            dtype or a matrix-product call that eqshard cannot read, naming it and its
            line: a figure is never a silent zero.
    """
    if compile_for not in ("running", "costing"):
        raise EqshardError(
            f"`compile_for` is 'running' (compiled as the step runs) or 'costing' "
            f"(compiled only to be costed), not {compile_for!r}"
        )
    batch = batch_layout(batch)  # checked here, with a caret, before anything is compiled
    on: CompileTarget | None = None
    if target is not None:
        on, mesh, devices = _on_target(target, spec, mesh, devices)
    elif isinstance(devices, int):  # a count, which `True` or `-1` is not
        count = device_count_of(devices, "`devices`")
        if count > len(jax.devices()):
            return _in_a_process_of_its_own(step, model, args, spec, batch, count, compile_for)
        devices = jax.devices()[:count]
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
        failed = StepError(
            f"`eqshard.cost` cannot trace and compile the step {name} on {n} devices under "
            f"{_spec_name(spec)}: it raised {type(error).__name__}: {error}"
        )
        raise with_user_frames(failed, error) from error
    held = Held()
    for i, argument in enumerate(lowered.arguments):
        if argument.plan is not None:  # the model, its state, an optimizer state
            held.count(argument.plan, "parameters" if i == 0 else "optimizer")
    module = parse_hlo(compiled.text, p.mesh)
    dtypes = [row.dtype for row in held.parameters]
    return Cost(
        memory=read_memory(held, compiled, platform),
        collectives=read_collectives(module, p.mesh),
        flops=float(flops(module)),
        bytes_accessed=float(compiled.costs.get("bytes accessed", 0.0)),
        mesh=p.mesh,
        devices=n,
        dtype=max(set(dtypes), key=dtypes.count) if dtypes else "float32",
        compiler=on.compiler if on is not None else f"XLA:CPU, {n} simulated devices",
        compiler_options=compiled.options,
        target=None if on is None else on.name,
        hardware=None if on is None else on.hardware,
        memory_per_device=None if on is None else on.memory_per_device,
        batch=lowered.batch,
        loops=tuple(sorted(set(value_dependent(module).values()))),
        loop_flops=float(value_dependent_flops(module)),
        pipelines=tuple(pipelines),
        activations=tuple(activations),
    )


def _on_target(
    target: str, spec: Any, mesh: AnyMesh | None, devices: Any
) -> tuple[CompileTarget, AnyMesh | None, Sequence[Device] | None]:
    """The TPU slice `target`, and the `mesh=` or `devices=` that lay the step out on
    its devices: the user's mesh, its axes over the slice's devices in their order;
    else the slice's devices, all of them."""
    if devices is not None:
        raise EqshardError(
            f"`devices=` and `target={target!r}` are both given; the slice has its devices "
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
        return "tpu"
    devices = getattr(p.mesh, "devices", None)
    first = np.asarray(devices).flat[0] if devices is not None else jax.devices()[0]
    return str(first.platform)


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

    from .._process._workers import (
        pickled,
        start_worker,
        unpickled,
        without_device_count,
        worker_answer,
    )

    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        raise EqshardError(
            f"the cost on {devices} devices needs {devices} devices, and this process has "
            f"{len(jax.devices())}: eqshard compiles in a process of its own that has them, "
            "which needs cloudpickle (`pip install 'eqshard[cost]'`); or run `eqshard check "
            "SPEC --model ... --step ...`, which starts one per device count"
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
    from .._process._workers import pickled, unpickled

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
        devices=devices,
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
