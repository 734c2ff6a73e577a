"""What a spec costs: memory per device and communication of the user's own step.

The driver: `cost` lays out the model, its `eqx.nn.State` and its optimizer state by
the spec (abstractly: no device memory is spent), compiles the user's training step
over them (`_compile`, the one place a lowered step is compiled), and reads the
compiled program: its collectives and FLOPs from its HLO text (`_hlo.py`, pure
text), bytes accessed and XLA's memory analysis from the compiler, and a roofline
estimate on a hardware profile (`_hardware.py`). XLA's SPMD partitioner runs the
same on simulated CPU devices as on accelerators, so the communication is known from
a laptop; XLA:CPU reports hardly any temporaries, so the peak it gives is a lower
bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh

from .._compat import filter_jit_donation, memory_stats
from .._errors import EqshardError, StepError
from .._expression import Expression
from .._fields import is_array_like
from .._plan import Plan, Spec, plan
from .._report import LeafRow, leaf_rows, memory_kind
from .._sharding import AnyMesh, Device, device_count, on_devices
from .._specfile._file import Rules, batch_expression
from .._step import Donate, Lowered, Step, abstract_array, planned_for
from . import _hlo
from ._hardware import HARDWARE, Estimate, Hardware, Moved, hardware_profile, roofline
from ._targets import CompileTarget, compile_target

__all__ = ["HARDWARE", "Collective", "Cost", "Estimate", "Hardware", "Memory", "cost"]


def _axes(groups: tuple[tuple[int, ...], ...], mesh: AnyMesh | None) -> tuple[str, ...]:
    """The mesh axes along which a collective's devices differ (its groups' ids are
    positions in the mesh's devices, row-major)."""
    if mesh is None or not groups:
        return ()
    shape = tuple(mesh.axis_sizes)
    if any(not 0 <= i < mesh.size for group in groups for i in group):
        raise EqshardError(
            f"a collective of the compiled step runs over devices {list(groups)}, and the mesh "
            f"has {mesh.size}; please report it to eqshard"
        )
    varying: set[int] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.array(group, dtype=int), shape)).T
        varying |= {a for a in range(len(shape)) if len(set(coords[:, a].tolist())) > 1}
    return tuple(name for a, name in enumerate(mesh.axis_names) if a in varying)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the compiled step.

    - `kind`: `"all-reduce"`, `"all-gather"`, `"reduce-scatter"`,
        `"collective-permute"`, `"all-to-all"`, `"ragged-all-to-all"` or
        `"collective-broadcast"` (XLA's async `-start`/`-done` pairs count once).
    - `bytes`: what one run of it moves on each device: a reduce-scatter its
        operand, which each device contributes to the sum (its result is one
        device's part, n times smaller); an all-gather its result, what each
        device ends up holding; an all-reduce, a collective-permute and an
        all-to-all their result, the size of their operand (a tuple collective: all
        of them).
    - `axes`: the mesh axes its device groups run over.
    - `source`: where XLA records it comes from (the op's name in the step), whole:
        XLA names a combined collective by every op it combines, which can run to
        thousands of characters; tables show `brief_source`.
    - `count`: how many times one step runs it: more than once inside a loop whose
        trip count XLA knows, such as `jax.lax.scan` over stacked layers. In a loop
        whose trip count depends on values (`loop`), how many times one trip of it
        runs it: the runs per step are not known. Of the
        branches of a `cond` or `switch`, only the one that moves the most bytes of
        the collective's kind counts (so a budget per kind bounds every branch); a
        collective of the others is not listed.
    - `group_size`: how many devices each of its groups holds (a
        collective-permute's: 2, a source and a target).
    - `loop`: the `while` loop whose trip count depends on values that it runs in
        (`while.3 (jit(step)/while), line 120`), whose trips per step are not
        known; `None` where its runs per step are known.
    """

    kind: str
    bytes: int
    axes: tuple[str, ...]
    source: str
    count: int = 1
    group_size: int = 1
    loop: str | None = None

    @property
    def total_bytes(self) -> int:
        """`bytes` times `count`: what it moves on each device in one step; in a
        loop whose trip count depends on values (`loop`), in one trip of it."""
        return self.bytes * self.count

    @property
    def brief_source(self) -> str:
        """`source`, cut to at most `SOURCE_WIDTH` characters for a table (see
        `brief_source`)."""
        return brief_source(self.source)


SOURCE_WIDTH = 100  # characters of a collective's source that a table shows


def brief_source(source: str, width: int = SOURCE_WIDTH) -> str:
    """A collective's `source`, cut to at most `width` characters for a table.

    A collective XLA combined from several ops is named
    `jit(step)/while/body/(op1:op2:...)`; it is shown by the prefix they share, its
    first op and how many more it combines (`jit(step)/while/body/(op1 +11 more)`).
    What is still too long keeps its start (the transformations: `jit`, `jvp`,
    `while`) and its end (the module and the primitive), with `…` between.

    **Arguments:**

    - `source`: the op name, as `Collective.source` holds it.
    - `width`: the most characters to show (at least 3).

    **Returns:**

    `source` itself when it fits, else the cut text.
    """
    if len(source) <= width:
        return source
    prefix, ops = _combined(source)
    if len(ops) > 1:
        source = f"{prefix}({ops[0]} +{len(ops) - 1} more)"
        if len(source) <= width:
            return source
    head = (width - 1) // 2
    return f"{source[:head]}…{source[len(source) - (width - 1 - head) :]}"


def _combined(source: str) -> tuple[str, list[str]]:
    """`("jit(step)/", ["a/dot", "b/add"])` for `jit(step)/(a/dot:b/add)`, the name
    XLA gives a collective combined from several ops; `("", [source])` for others."""
    if not source.endswith(")"):
        return "", [source]
    depth, start = 0, len(source) - 1
    while start >= 0:  # the parenthesis that the last one closes
        depth += (source[start] == ")") - (source[start] == "(")
        if depth == 0:
            break
        start -= 1
    if start < 0 or (start > 0 and source[start - 1] != "/"):
        return "", [source]  # unbalanced, or a call such as `vmap(...)`
    ops, depth, begin = [], 0, start + 1
    for j in range(start + 1, len(source) - 1):
        depth += (source[j] == "(") - (source[j] == ")")
        if source[j] == ":" and depth == 0:
            ops.append(source[begin:j])
            begin = j + 1
    ops.append(source[begin:-1])
    return source[:start], ops


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device. `peak` is the compiler's own figure: XLA:TPU's for a TPU
    `target`, else XLA:CPU's, which is XLA:CPU's and no bound on another backend's
    (an H100 measured 1.00x of it for three MLP steps).

    - `parameters`: the model's array leaves, as the plan lays them out.
    - `state`: the leaves of its `eqx.nn.State` (BatchNorm's running statistics),
        as the plan lays them out; 0 for a model without one.
    - `optimizer`: the optimizer state's leaves, as the plan's optimizer section
        lays them out (by default, each moment as its parameter).
    - `gradients`: a gradient for each floating-point parameter, laid out as it is.
    - `arguments`, `outputs`, `temporaries`: device memory, from XLA's memory
        analysis of the compiled step (outputs less what is donated); arguments and
        outputs in host memory are not counted here.
    - `host`: of `parameters`, `state` and `optimizer`, the bytes held in host
        memory (a rule's `"memory": "pinned_host"`), not in the device's.
    - `host_arguments`, `host_outputs`: the step's arguments and outputs in host
        memory, per device: the compiler's own figures where it reports them apart
        (`host_argument_size_in_bytes`), else those of their shardings (XLA:CPU
        counts them among its arguments and outputs, and they are taken out there).
    - `reported_peak`: the compiler's own peak of device memory
        (`peak_memory_in_bytes` of its memory analysis), which is not the sum of the
        three above: XLA:TPU's was 46% above it for an FSDP Adam step with JAX 0.10's
        libtpu, and below it with JAX 0.12's, which reuses buffers; `None` where the
        compiler does not report one.

    `parameters`, `state` and `optimizer` count every byte wherever it is held;
    `peak`, and `eqshard check --max-memory`, count the device's memory only.
    """

    parameters: int
    state: int
    optimizer: int
    gradients: int
    arguments: int
    outputs: int
    temporaries: int
    host: int = 0
    host_arguments: int = 0
    host_outputs: int = 0
    reported_peak: int | None = None

    @property
    def peak(self) -> int:
        """The compiler's own peak of device memory where it reports one
        (`reported_peak`); else arguments, outputs and temporaries in device memory,
        as the compiled program allocates them."""
        if self.reported_peak is not None:
            return self.reported_peak
        return self.arguments + self.outputs + self.temporaries


@dataclasses.dataclass(frozen=True)
class Cost:
    """What one step of the user's training step costs, per device, under a spec.

    **Attributes:** `memory` (`Memory`), `collectives` (list of `Collective`),
    `flops` (the FLOPs of the matrix products one device runs per step, read from
    the compiled program: `dot`, `convolution`, cuBLAS and cuDNN calls, a loop's by
    its trip count, a `cond` or `switch` by its most expensive branch; elementwise
    work is not counted), `bytes_accessed` (per device, from XLA's cost analysis,
    which counts a loop's body once), `mesh`, `devices`, `dtype` (the parameters'
    dtype, for the estimate); `compiler`, whose figures these are (`"XLA:TPU (libtpu
    0.0.42.1)"` for a `target`, else `"XLA:CPU, 8 simulated devices"`), `target`
    (the TPU slice, or `None`), `hardware` (its chip's profile),
    `memory_per_device` (its HBM per device; `fits` compares the peak with it) and
    `batch` (the expression the batch's array leaves were laid out by, `None` where
    no leaf was: each kept its own placement, or the step takes no batch);
    `loops`, the `while` loops whose trip count depends on values (an adaptive ODE
    solver, a fixed-point iteration), and `loop_flops`, the FLOPs in them: what
    runs in them is counted once per trip (`Collective.loop`), so where `loops` is
    not empty the step's communication, FLOPs and estimate are unknown (`known` is
    `False`): the figures are those of one trip, and a budget never passes on them.
    """

    memory: Memory
    collectives: list[Collective]
    flops: float
    bytes_accessed: float
    mesh: AnyMesh | None
    devices: int
    dtype: str
    compiler: str = "XLA:CPU"
    target: str | None = None
    hardware: Hardware | None = None
    memory_per_device: int | None = None
    batch: str | None = None
    loops: tuple[str, ...] = ()
    loop_flops: float = 0.0

    @property
    def promoted(self) -> str | None:
        """Where the parameters are 16-bit floats and XLA:CPU compiled the step, what
        that means for its collectives: XLA:CPU moves them as float32 copies, up to
        twice the bytes an accelerator's compiler moves (a `target` shows XLA:TPU's
        own); else `None`."""
        if self.target is not None or self.dtype not in ("bfloat16", "float16"):
            return None
        return (
            f"XLA:CPU moves {self.dtype} collectives as float32 copies: up to twice the "
            "bytes an accelerator moves (a TPU target shows its own)"
        )

    @property
    def known(self) -> bool:
        """Whether every figure is known: no loop's trip count depends on values."""
        return not self.loops

    def unknown_text(self) -> str | None:
        """What is not known, for tables and messages; `None` where all is."""
        if not self.loops:
            return None
        inside = [c for c in self.collectives if c.loop is not None]
        which = "; ".join(self.loops)
        return (
            f"unknown: the trips of {which}, whose trip count depends on values; its "
            f"{len(inside)} collective{'s' * (len(inside) != 1)} and "
            f"{self.loop_flops:,.0f} FLOPs are counted once, per trip"
        )

    @property
    def fits(self) -> bool | None:
        """Whether the step's peak fits each device's memory, on a target whose
        memory is known; `None` without one (XLA:CPU's peak is no bound on an
        accelerator's)."""
        if self.memory_per_device is None:
            return None
        return self.memory.peak <= self.memory_per_device

    def bytes_by_axes(self) -> dict[tuple[str, tuple[str, ...]], int]:
        """Bytes moved per step, by (kind, mesh axes): comparable across backends,
        which combine collectives differently."""
        totals: dict[tuple[str, tuple[str, ...]], int] = {}
        for c in self.collectives:
            totals[(c.kind, c.axes)] = totals.get((c.kind, c.axes), 0) + c.total_bytes
        return totals

    def estimate(self, hardware: str | Hardware | None = None) -> Estimate:
        """A roofline estimate of one step on `hardware` (a name in `eqshard.HARDWARE`,
        such as `"h100"` or `"tpu-v5p"`, or a `Hardware`; by default the target's
        chip, else `"h100"`): FLOPs at peak, bytes at memory bandwidth, and each
        collective over one link (a ring: an all-reduce moves 2 (n-1)/n of its
        bytes)."""
        if hardware is None:
            hardware = self.hardware or "h100"
        moved = [Moved(c.kind, c.total_bytes, c.group_size) for c in self.collectives]
        return roofline(
            hardware_profile(hardware), self.flops, self.bytes_accessed, self.dtype, moved
        )


def _collectives(hlo: str | _hlo.Module, mesh: AnyMesh | None) -> list[Collective]:
    """The collectives of a compiled program (its HLO text, or the text parsed), as
    `_hlo.collectives` reads them, each with the mesh axes its groups run over."""
    module = hlo if isinstance(hlo, _hlo.Module) else _parse(hlo, mesh)
    return [
        Collective(
            op.kind,
            op.bytes,
            _axes(op.groups, mesh),
            op.source,
            op.count,
            max((len(g) for g in op.groups), default=1),
            op.loop,
        )
        for op in _hlo.collectives(module)
    ]


def _parse(text: str, mesh: AnyMesh | None) -> _hlo.Module:
    """A compiled program's HLO text, parsed (`replica_groups={}`: the mesh's devices
    where the text does not count them)."""
    return _hlo.parse(text, devices=mesh.size if mesh is not None else 0)


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """What `cost` reads of a compiled step: its HLO text, XLA's memory analysis
    and its cost analysis (one dict); and the bytes per device of its arguments and
    outputs in host memory, from their shardings."""

    text: str
    memory: Any
    costs: dict[str, Any]
    host_arguments: int = 0
    host_outputs: int = 0


def _compile(lowered: Lowered) -> _Compiled:
    """Compiles a step lowered by `eqshard.jit` for the devices its arguments are laid
    out on (the target: XLA:CPU for simulated devices, an accelerator's compiler for
    its own), and keeps what `cost` reads."""
    compiled = lowered.compile()
    return _Compiled(
        compiled.as_text() or "",
        compiled.memory_analysis(),
        _first(compiled.cost_analysis()),
        _host_bytes(lowered.abstract),
        _host_bytes(getattr(compiled, "out_info", ())),
    )


def _host_bytes(tree: Any) -> int:
    """The bytes per device of the arrays of `tree` (abstract, with shardings) held
    in host memory."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        sharding = getattr(x, "sharding", None)
        if memory_kind(sharding) is not None and hasattr(x, "shape"):
            shard = sharding.shard_shape(tuple(x.shape))  # pyright: ignore[reportOptionalMemberAccess]
            total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def _memory(held: _Held, compiled: _Compiled) -> Memory:
    """The step's memory per device: the layouts' bytes by part, and XLA's memory
    analysis split into device and host memory (see `Memory`)."""
    stats = memory_stats(compiled.memory)
    arguments = stats.arguments
    outputs = stats.outputs - stats.aliased
    host_arguments = stats.host_arguments
    host_outputs = stats.host_outputs - stats.host_aliased
    reported = stats.peak
    if not (host_arguments or host_outputs):  # counted with the device's: take them out
        host_arguments, host_outputs = compiled.host_arguments, compiled.host_outputs
        arguments, outputs = arguments - host_arguments, outputs - host_outputs
        if reported is not None:
            reported -= host_arguments + host_outputs
    every = [*held.parameters, *held.state, *held.optimizer]
    return Memory(
        parameters=_bytes(held.parameters),
        state=_bytes(held.state),
        optimizer=_bytes(held.optimizer),
        gradients=_bytes(
            row for row in held.parameters if np.issubdtype(np.dtype(row.dtype), np.inexact)
        ),
        arguments=max(arguments, 0),
        outputs=max(outputs, 0),
        temporaries=stats.temporaries,
        host=_bytes(row for row in every if row.on_host),
        host_arguments=max(host_arguments, 0),
        host_outputs=max(host_outputs, 0),
        reported_peak=None if reported is None else max(int(reported), 0),
    )


def cost(
    step: Any,
    model: Any,
    *args: Any,
    spec: Spec,
    batch: str | Expression | None = None,
    mesh: AnyMesh | None = None,
    devices: int | Sequence[Device] | None = None,
    target: str | None = None,
) -> Cost:
    """Compiles the user's step under a spec, without running it, and reads its cost.

    **Example:**

    ```python
    c = eqshard.cost(train_step, model, opt_state, batch, spec=rules, devices=8)
    c.memory.parameters, c.memory.optimizer, c.memory.peak    # bytes per device
    [(k.kind, k.bytes, k.axes) for k in c.collectives]        # "all-reduce", ...
    c.flops                                                   # per device
    c.estimate("h100").seconds                                # a roofline estimate

    # a stateful model: the step takes its eqx.nn.State after the model
    c = eqshard.cost(step, model, state, opt_state, batch, spec=plan)
    c.memory.state                                            # bytes per device
    ```

    **Arguments:**

    - `step`: the training step, as scripts write it: an `eqx.filter_jit` function
        (its donation is kept) or a plain one, called as `step(model, *args)`.
    - `model`: the model, concrete or abstract (`eqx.filter_eval_shape`).
    - `*args`: the rest of the step's arguments, concrete or abstract. The model's
        `eqx.nn.State` (a stateful model's, such as BatchNorm's running statistics)
        is laid out by the plan, as `eqshard.apply(state, plan)` does, and counted
        as `memory.state`. One built from the model (an optimizer state: it holds
        subtrees shaped like the model) is laid out by the model's plan, its
        optimizer section where it has one, as `eqshard.apply(opt_state, plan)`
        does; the array leaves of the others (the batch) by `batch`.
    - `spec`: anything `eqshard.apply` takes, a `Plan` included: a plan made for
        the model, or for `(model, state)` (it lays out both, and the step still
        takes the model alone first). With a spec and a state among `args`, the
        plan is made for `(model, state)`, so that one mesh fits both. A spec
        file's rules (or a plan made from them) are active while the step is
        traced, as under `eqshard.use`: activations the model names
        (`eqshard.constrain(x, ("batch", "embed"))`) are laid out by its `"dims"`,
        on the plan's mesh, and costed so.
    - `batch`: the expression of the other arguments' array leaves (the batch), a
        complete one: `"b ... -> b* ..."` splits their leading dim over every
        device, `"... -> * ..."` gives each device a whole copy. Given, it lays out
        every batch leaf. Without it, a leaf already placed on the plan's devices (a
        `jax.Array`, or a `jax.ShapeDtypeStruct` carrying a sharding, whose
        `NamedSharding`'s mesh holds the plan's devices in the plan's order) keeps
        its sharding; the others (an array on one device, as `jnp.asarray` makes it,
        on other devices, or abstract without a sharding) are laid out by the spec
        file's `"batch"` (`Rules.batch`, also where `spec` is a `Plan` made from
        `Rules`), else data parallel: their leading dim split over the first axis
        of a mesh the user or the spec file gives (the data axis, by convention),
        else over every device.
    - `mesh`, `devices`: as for `eqshard.plan`; `devices` may be a count: the first
        that many devices of this process, or, where it has fewer, that many
        simulated CPU devices in a new process (the step and the abstract arguments
        travel there with cloudpickle, the `eqshard[cost]` extra), so a laptop can
        ask for 64.
    - `target`: a TPU slice as `jax.experimental.topologies` names it (`"v5e:4x4"`,
        `"v5p:4x4x4"`, `"v6e:2x2"`, `"v4:2x2x1"`): the step is compiled by XLA:TPU
        for that slice's devices, on this machine, without a TPU (the `eqshard[tpu]`
        extra installs libtpu). The mesh is laid over the slice's devices in their
        order, with `mesh=`'s axis names and sizes where it is given, else the
        spec's. Memory is then the TPU compiler's own, `memory_per_device` the
        chip's HBM, and `estimate()` runs on the chip's profile. JAX cannot
        compile for a GPU without one: leave `target` out there.

    **Returns:**

    A `Cost`.

    **Raises:**

    `eqshard.SpecError` when the spec does not lay out the model, its
    `eqx.nn.State` or the optimizer state; `eqshard.ExpressionError` (with a caret)
    when `batch` is malformed or a short form, or does not lay out a batch leaf;
    `eqshard.EqshardError` for a `target` that is no TPU slice or without libtpu
    (saying how to install it), when the step cannot be traced or compiled (naming the
    step, the device count and the spec, with the step's or JAX's error as its
    cause; the command line exits 2 for it, as for a model that cannot be built),
    when the mesh is a `jax.sharding.AbstractMesh`, when more devices are asked
    for than this process has and cloudpickle is not installed, or when the
    compiled program holds a collective, a notation of device groups, a dtype or a
    matrix-product call that eqshard cannot read (naming it and its line: a figure
    is never a silent zero).
    """
    if batch is not None:  # checked here, with a caret, before anything is compiled
        batch = str(batch_expression(batch))
    on: CompileTarget | None = None
    if target is not None:
        on, mesh, devices = _on_target(target, spec, mesh, devices)
    elif isinstance(devices, int):
        if devices > len(jax.devices()):
            return _in_a_process_of_its_own(step, model, args, spec, batch, devices)
        devices = jax.devices()[:devices]
    abstract_model = jax.tree_util.tree_map(abstract_array, model)
    abstract_args = [jax.tree_util.tree_map(abstract_array, arg) for arg in args]
    if isinstance(spec, Plan):
        p = spec
    else:  # with the model's eqx.nn.State, one mesh fits both
        p = plan(planned_for(abstract_model, abstract_args, spec), spec, mesh=mesh, devices=devices)
    on_devices(p.mesh, "`eqshard.cost`", p.devices)
    fn = getattr(step, "__wrapped__", step)
    n = device_count(p.devices) if p.devices is not None else (p.mesh.size if p.mesh else 1)
    # The program `eqshard.jit` runs under this plan: the same input and output layouts.
    program = Step(fn, donate=_donation(step), plan=p, batch=batch)
    try:
        lowered = program.lower(abstract_model, *abstract_args)
        compiled = _compile(lowered)
    except (EqshardError, KeyboardInterrupt):
        raise
    except BaseException as error:  # the user's step (SystemExit too): named, with its cause
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise StepError(
            f"`eqshard.cost` cannot trace and compile the step {name} on {n} devices under "
            f"{_spec_name(spec)}: it raised {type(error).__name__}: {error}"
        ) from error
    held = _Held()
    for i, argument in enumerate(lowered.arguments):
        if argument.plan is not None:  # the model, its state, an optimizer state
            held.count(argument.plan, "parameters" if i == 0 else "optimizer")
    module = _parse(compiled.text, p.mesh)
    dtypes = [row.dtype for row in held.parameters]
    return Cost(
        memory=_memory(held, compiled),
        collectives=_collectives(module, p.mesh),
        flops=float(_hlo.flops(module)),
        bytes_accessed=float(compiled.costs.get("bytes accessed", 0.0)),
        mesh=p.mesh,
        devices=n,
        dtype=max(set(dtypes), key=dtypes.count) if dtypes else "float32",
        compiler=on.compiler if on is not None else f"XLA:CPU, {n} simulated devices",
        target=None if on is None else on.name,
        hardware=None if on is None else on.hardware,
        memory_per_device=None if on is None else on.memory_per_device,
        batch=lowered.batch,
        loops=tuple(sorted(set(_hlo.value_dependent(module).values()))),
        loop_flops=float(_hlo.value_dependent_flops(module)),
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


class _Held:
    """The rows of what the step's arguments hold, by part: the model's parameters,
    its `eqx.nn.State`, the optimizer state."""

    def __init__(self) -> None:
        self.parameters: list[LeafRow] = []
        self.state: list[LeafRow] = []
        self.optimizer: list[LeafRow] = []

    def count(self, laid_out: Plan, part: str) -> None:
        """Adds the rows of `laid_out` to `part`, and those in an `eqx.nn.State` to
        `state`: a row per array leaf, in the order of `_in_state`'s flags."""
        rows = leaf_rows(laid_out)
        flags = _in_state(laid_out.resolved.model)
        assert len(rows) == len(flags)
        for row, in_state in zip(rows, flags):
            getattr(self, "state" if in_state else part).append(row)


def _in_state(tree: Any) -> list[bool]:
    """For each array leaf of `tree`, in order, whether it is in an `eqx.nn.State`."""
    flags = []
    is_state = lambda x: isinstance(x, eqx.nn.State)  # noqa: E731
    for part in jax.tree_util.tree_leaves(tree, is_leaf=is_state):
        if is_state(part):
            flags += [True] * sum(map(is_array_like, jax.tree_util.tree_leaves(part)))
        elif is_array_like(part):
            flags.append(False)
    return flags


def _bytes(rows: Any) -> int:
    """What one device holds of `rows` (a leaf not laid out counts nothing)."""
    return sum(row.bytes_per_device or 0 for row in rows)


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
    step: Any, model: Any, args: tuple[Any, ...], spec: Any, batch: str | None, devices: int
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
        (step, unplaced(model), unplaced(args), spec),
        "the step, its arguments or the spec",
        "define the step at the top level of a module, or in the script being run",
    )
    request = {"devices": devices, "batch": batch, "work": work}
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
    step, model, args, spec = unpickled(request["work"], "the step, its arguments or the spec")
    started = len(jax.devices())  # the step's module may have started JAX with its own count
    if started < devices:
        raise EqshardError(
            f"compiling the step on {devices} devices needs {devices} simulated devices, "
            f"but JAX started with {started}: the step's modules set that count "
            "(jax.config.update('jax_num_cpu_devices', ...)); leave the count to eqshard"
        )
    found = cost(step, model, *args, spec=spec, batch=request["batch"], devices=devices)
    return pickled(portable(found), "the cost", "report it as a bug in eqshard")


def portable(found: Cost) -> Cost:
    """`found` with its mesh abstract: it holds no device, so it crosses to another
    process (a worker's answer)."""
    if found.mesh is None:
        return found
    return dataclasses.replace(found, mesh=found.mesh.abstract_mesh)


def _first(costs: Any) -> dict[str, Any]:
    """A cost analysis as one dict (some JAX releases give a list of them)."""
    if isinstance(costs, list):
        costs = costs[0] if costs else {}
    return dict(costs or {})


def _donation(step: Any) -> Donate:
    """The donation of a step as given to `cost`: an `eqshard.jit` step's own, an
    `eqx.filter_jit` step's (its donation flags), none for a plain function."""
    if isinstance(step, Step):
        return step.donate
    first, rest = filter_jit_donation(step) or (False, False)
    return "all" if first and rest else "all-except-first" if rest else "none"
