"""What `eqshard.cost` gives: `Cost`, what one step costs per device, holding its
`Memory` and its `Collective`s, and why each moves what it moves (`Explained`,
`Explanation`: `Cost.explain`); the text that tables and messages show of them
(`brief_source`, `Cost.unknown_text`); and the roofline estimate on a hardware
profile (`Cost.estimate`). No JAX is imported here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ._hardware import Estimate, Hardware, Moved, hardware_profile, roofline

if TYPE_CHECKING:
    from .._activations import NamedActivation
    from .._pipeline import Stages
    from .._sharding import AnyMesh

__all__ = [
    "PEAK_RULES",
    "SOURCE_WIDTH",
    "Collective",
    "Cost",
    "Explained",
    "Explanation",
    "Memory",
    "brief_source",
]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the compiled step: what it moves on each device, over which
    mesh axes, and how many times one step runs it.

    **Attributes:**

    - `kind`: `"all-reduce"`, `"all-gather"`, `"reduce-scatter"`,
        `"collective-permute"`, `"all-to-all"`, `"ragged-all-to-all"` or
        `"collective-broadcast"`.
    - `bytes`: what one run of it moves on each device (see "Bytes" below).
    - `axes`: the mesh axes its device groups run over.
    - `source`: where XLA records it comes from (the op's name in the step), whole.
    - `count`: how many times one step runs it (see "Counts" below).
    - `group_size`: how many devices each of its groups holds (a collective-permute's:
        2, a source and a target).
    - `loop`: the `while` loop whose trip count depends on values that it runs in, else
        `None`.

    !!! info "Bytes"

        A reduce-scatter moves its operand, which each device contributes to the sum.
        (Its result is one device's part, n times smaller.) An all-gather moves its
        result, what each device ends up holding. An all-reduce, a collective-permute
        and an all-to-all move their result, the size of their operand. For a tuple
        collective, that is all of its results. XLA's async `-start`/`-done` pairs count
        once.

    !!! info "Counts"

        `count` is more than one inside a loop whose trip count XLA knows, such as
        `jax.lax.scan` over stacked layers. A loop's trip count may depend on values
        (`loop`, named as `while.3 (jit(step)/while), line 120`). Inside one, `count` is
        how many times one trip of that loop runs it. The loop's trips per step, and so
        the collective's runs per step, are not known. Of the branches of a `cond` or
        `switch`, only the one that moves the most bytes of the collective's kind
        counts. So a budget per kind bounds every branch. A collective of the other
        branches is not listed.

    !!! info "Sources"

        XLA names a combined collective by every op it combines, which can run to
        thousands of characters. Tables show `brief_source`.
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


UNKNOWN = "eqshard cannot tell"  # the start of a reason eqshard could not find


@dataclasses.dataclass(frozen=True)
class Explained:
    """Why one collective of the compiled step moves what it moves.

    **Attributes:**

    - `collective`: the `Collective`.
    - `file`, `line`: the user's line that traced it (XLA's metadata records the
        Python stack; the innermost frame outside installed packages and eqshard, the
        demo's files counting as the user's, and inside the step `cost` traced), its
        operand's or its caller's where it has none of its own; `""` and 0 where none
        is recorded.
    - `leaves`: the argument leaves its data comes from or goes to: the model's by
        their dotted path (`layers.0.weight`), others by their argument
        (`optimizer: 0.mu.layers.0.weight`, `batch`).
    - `reason`: why, in words; it starts "eqshard cannot tell" where eqshard cannot.
    """

    collective: Collective
    file: str
    line: int
    leaves: tuple[str, ...]
    reason: str

    @property
    def where(self) -> str:
        """`file:line`, or `""` where no line is recorded."""
        return f"{self.file}:{self.line}" if self.file else ""

    @property
    def known(self) -> bool:
        """Whether eqshard found why (the reason is not "eqshard cannot tell")."""
        return not self.reason.startswith(UNKNOWN)

    def to_json(self) -> dict[str, Any]:
        """Its fields as JSON: the collective's `kind`, `bytes` per step (all its
        runs), `axes` and `count`, then `file`, `line`, `leaves`, `reason`, `known`."""
        c = self.collective
        return {
            "kind": c.kind,
            "bytes": c.total_bytes,
            "axes": list(c.axes),
            "count": c.count,
            "file": self.file,
            "line": self.line,
            "leaves": list(self.leaves),
            "reason": self.reason,
            "known": self.known,
        }


@dataclasses.dataclass(frozen=True)
class Explanation:
    """`Cost.explain()`: an `Explained` per collective, the most bytes first; iterated,
    indexed and printed as a table."""

    items: tuple[Explained, ...]

    def __iter__(self) -> Iterator[Explained]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Explained:
        return self.items[index]

    def lines(self, top: int | None = None) -> list[str]:
        """One line per collective (the `top` most bytes, else all): its kind, bytes
        per step and axes, where and why."""
        from .._report import human_bytes

        found = []
        for e in self.items[:top]:
            c = e.collective
            axes = ", ".join(c.axes) or "no axis"
            where = f" at {e.where}" if e.where else ""
            found.append(f"{c.kind} {human_bytes(c.total_bytes)} over {axes}{where}: {e.reason}")
        return found

    def __rich__(self) -> Any:
        from rich.table import Table

        from .._report import human_bytes

        table = Table(title="why each byte moves", title_justify="left")
        for column in ("collective", "bytes/step", "axes", "where", "why"):
            table.add_column(column, justify="right" if column == "bytes/step" else "left")
        for e in self.items:
            c = e.collective
            table.add_row(c.kind, human_bytes(c.total_bytes), ", ".join(c.axes), e.where, e.reason)
        return table

    def __str__(self) -> str:
        return "\n".join(self.lines())


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


# What `Memory.peak` is, per compiler (by the platform it compiles for), as its
# memory analysis was read by experiment (JAX 0.10.2, libtpu 0.0.42.1): XLA:CPU's
# `peak_memory_in_bytes` is its arguments and outputs less what is aliased, plus 8
# bytes, whatever the temporaries it allocates for the step (an `eqx.nn.MLP(64, 64,
# 1024, 4)` Adam step under FSDP on 4,096 rows: 9.97 MB reported, 31.5 MB of
# temporaries besides), so the peak is what it allocates; XLA:TPU's temporaries are
# not what is live at once (0 on v5e for that step, whose own peak is 29.8 MB for
# 9.98 MB of arguments and outputs; 834,816 B on v5p for a smaller MLP step whose own
# peak is 367,680 B), so the peak is its own. `tests/test_differential.py` checks both
# against the analysis' parts.
ALLOCATED = "allocated"  # at least the arguments, outputs and temporaries
REPORTED = "reported"  # the compiler's own peak
# XLA:GPU's own peak is arguments + outputs + temporaries (4 KB less, as it overlaps
# them), and what its allocator holds at once: 13,020,348,788 B reported, 13,020,355,584 B
# `peak_bytes_in_use` for an MLP's AdamW step on an H200 (JAX 0.11.2,
# benchmarks/gpu_check.py; 2.4% more for a smaller MLP). So it is taken as it is.
PEAK_RULES = {"cpu": ALLOCATED, "tpu": REPORTED, "gpu": REPORTED}  # any other: ALLOCATED


@dataclasses.dataclass(frozen=True)
class Memory:
    """What one step holds, in bytes per device: the layouts' own bytes by part, and the
    compiler's memory analysis of the compiled step.

    **Example:**

    ```python
    m = eqshard.cost(model, opt_state, batch, step=step, spec=rules).memory
    m.peak             # bytes per device, in device memory
    m.peak_includes    # 'arguments + outputs + temporaries: XLA:CPU's own peak ...'
    ```

    **Attributes:**

    - `parameters`: the model's array leaves, as the plan lays them out.
    - `state`: the leaves of its `eqx.nn.State` (BatchNorm's running statistics), as the
        plan lays them out; 0 for a model without one.
    - `optimizer`: the optimizer state's leaves, as the plan's optimizer section lays
        them out (by default, each moment as its parameter).
    - `gradients`: a gradient for each floating-point parameter, laid out as it is.
    - `arguments`, `outputs`, `temporaries`: device memory, from XLA's memory analysis
        of the compiled step (outputs less what is donated).
    - `host`: of `parameters`, `state` and `optimizer`, the bytes held in host memory (a
        rule's `"memory": "pinned_host"`), not in the device's.
    - `host_arguments`, `host_outputs`: the step's arguments and outputs in host memory.
    - `reported_peak`: the compiler's own peak of device memory (`peak_memory_in_bytes`
        of its memory analysis), or `None` where the compiler does not report one.
    - `platform`: the platform whose compiler compiled the step (`"cpu"`, `"tpu"`,
        `"gpu"`), which decides what `peak` is.
    - `autotuned`: `False` where XLA:GPU compiled for GPUs it does not have
        (`target="h100:8"`): it picks its kernels untimed, and a GPU's own compile
        may hold more at once (`peak_includes` says how much more was seen).

    `peak` is what the compiler allocates at once, as `peak_includes` says for the
    step: on XLA:CPU its arguments, outputs and temporaries (its own peak leaves the
    temporaries out), on XLA:TPU its own peak. XLA:CPU's peak is no bound on an
    accelerator's; a `target` gives XLA:TPU's. The guide "Cost and targets" gives the
    figures per compiler under "Memory".

    !!! info "Device and host memory"

        `parameters`, `state` and `optimizer` count every byte wherever it is held.
        `peak`, and `eqshard check --max-memory`, count the device's memory only.
        `arguments` and `outputs` leave out what is in host memory; `host_arguments` and
        `host_outputs` hold it. These are the compiler's own figures where it reports
        them apart (`host_argument_size_in_bytes`). Else they are those of their
        shardings: XLA:CPU counts them among its arguments and outputs, and they are
        taken out there.
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
    platform: str = "cpu"
    autotuned: bool = True

    @property
    def allocated(self) -> int:
        """The arguments, outputs (less what is donated) and temporaries the compiler
        allocates for the step in device memory, all at once."""
        return self.arguments + self.outputs + self.temporaries

    @property
    def peak(self) -> int:
        """The step's peak of device memory, as `peak_includes` says: XLA:TPU's and
        XLA:GPU's own peak; on XLA:CPU and any other compiler, at least `allocated`."""
        if self.reported_peak is None:
            return self.allocated
        if PEAK_RULES.get(self.platform, ALLOCATED) == REPORTED:
            return self.reported_peak
        return max(self.reported_peak, self.allocated)

    @property
    def peak_includes(self) -> str:
        """What `peak` is for this step, with its compiler, for tables and messages."""
        compiler = _COMPILERS.get(self.platform, f"XLA:{self.platform.upper()}")
        if self.reported_peak is None:
            return f"arguments + outputs + temporaries ({compiler} reports no peak)"
        if PEAK_RULES.get(self.platform, ALLOCATED) == REPORTED:
            if not self.autotuned:
                return (
                    f"{compiler}'s own peak (reported_peak), compiled with no GPU and so "
                    "not autotuned: an H100's and an H200's own compiles of two MLP steps "
                    "held 2% and 27% more (benchmarks/gpu_check.py)"
                )
            return f"{compiler}'s own peak (reported_peak)"
        if self.reported_peak >= self.allocated:
            return f"{compiler}'s own peak (reported_peak): its arguments + outputs + temporaries or more"
        return (
            f"arguments + outputs + temporaries: {compiler}'s own peak (reported_peak) "
            "leaves out temporaries"
        )


_COMPILERS = {"cpu": "XLA:CPU", "tpu": "XLA:TPU", "gpu": "XLA:GPU"}


@dataclasses.dataclass(frozen=True)
class Cost:
    """What one step of the user's training step costs, per device, under a spec, as
    `eqshard.cost` reads it from the compiled step.

    **Attributes:**

    - `memory`: a `Memory`, in bytes per device.
    - `collectives`: a list of `Collective`, each with its mesh axes and its count.
    - `flops`: the FLOPs of the matrix products one device runs per step (see "FLOPs").
    - `bytes_accessed`: per device, from XLA's cost analysis, which counts a loop's body
        once.
    - `mesh`, `devices`: the plan's mesh and its device count.
    - `dtype`: the parameters' dtype, for the estimate.
    - `compiler`: whose figures these are (`"XLA:TPU (libtpu 0.0.42.1)"` for a `target`,
        else `"XLA:CPU, 8 simulated devices"`).
    - `compiler_options`: the options it compiled the step with, `"name=value"`: empty
        as the step runs, the cheaper ones of `cost(..., compile_for="costing")`.
    - `target`: the TPU slice, or `None`.
    - `hardware`: the target's chip's profile, or `None`.
    - `memory_per_device`: the target's HBM per device (`fits` compares the peak with
        it), or `None`.
    - `batch`: the expression the batch's array leaves were laid out by, or where the
        batch rules that laid them out are (`model.eqshard.json::$.batch`); `None` where
        no leaf was (each kept its own placement, or the step takes no batch).
    - `loops`: the `while` loops whose trip count depends on values (an adaptive ODE
        solver, a fixed-point iteration).
    - `loop_flops`: of `flops`, those in `loops`, per trip.
    - `activations`: each activation the step names and a spec file's `dims` or
        `logical_axis_rules` lay out (`NamedActivation`: its names, shape, expression,
        `PartitionSpec`, and which rule placed each dim), once per names and shape.
    - `pipelines`: each `eqshard.parallel.pipeline` the step runs over a mesh axis of stages, as
        its trace recorded it (`Stages`: stages, microbatches, schedule and its
        `bubble`).
    - `explanations`: why each collective moves what it moves, in the order of
        `collectives` (`explain()` gives them the most bytes first).

    !!! info "FLOPs"

        Read from the compiled program: `dot`, `convolution`, cuBLAS and cuDNN calls, a
        loop's by its trip count, a `cond` or `switch` by its most expensive branch.
        Elementwise work is not counted.

    !!! warning "Loops whose trip count depends on values"

        What runs in `loops` is counted once per trip (`Collective.loop`). So where
        `loops` is not empty, the step's communication, FLOPs and estimate are unknown
        (`known` is `False`). The figures are those of one trip, and a budget never
        passes on them.
    """

    memory: Memory
    collectives: list[Collective]
    flops: float
    bytes_accessed: float
    mesh: AnyMesh | None
    devices: int
    dtype: str
    compiler: str = "XLA:CPU"
    compiler_options: tuple[str, ...] = ()
    target: str | None = None
    hardware: Hardware | None = None
    memory_per_device: int | None = None
    batch: str | None = None
    loops: tuple[str, ...] = ()
    loop_flops: float = 0.0
    pipelines: tuple[Stages, ...] = ()
    activations: tuple[NamedActivation, ...] = ()
    explanations: tuple[Explained, ...] = ()

    def explain(self) -> Explanation:
        """Why each collective moves what it moves: the user's line that traced it, the
        argument leaves its data comes from or goes to, and a reason, the most bytes
        first. Read from the compiled step when it was costed: nothing is compiled.

        **Example:**

        ```python
        for e in eqshard.cost(model, opt_state, x, step=step, spec="fsdp").explain():
            print(e.collective.kind, e.where, e.leaves, e.reason)
        ```

        **Returns:**

        An `Explanation`: an `Explained` per collective, printed as a table.
        """
        ranked = sorted(self.explanations, key=lambda e: -e.collective.total_bytes)
        return Explanation(tuple(ranked))

    @property
    def peak_per_stage(self) -> int | None:
        """Under a pipeline, the peak memory of each stage's devices: every stage runs
        the same program (SPMD), so it is the peak per device; `None` with no
        pipeline."""
        return self.memory.peak if self.pipelines else None

    def pipeline_text(self) -> str | None:
        """The pipelines, for tables and messages: the stages, the microbatches, the
        schedule, its bubble and the permutes between stages; `None` with none."""
        if not self.pipelines:
            return None
        from .._report import human_bytes

        parts = []
        for p in self.pipelines:
            moved = sum(
                c.total_bytes
                for c in self.collectives
                if c.kind == "collective-permute" and c.axes == (p.axis,)
            )
            rounds = f", {p.rounds} rounds" if p.schedule == "circular" else ""
            parts.append(
                f"pipeline over {p.axis!r}: {p.stages} stages of {p.layers // p.stages} "
                f"layers, {p.microbatches} microbatches, {p.schedule}{rounds}; bubble "
                f"{p.bubble:.1%} of each stage's time; {human_bytes(moved)} permuted over "
                f"{p.axis!r} per step; peak per stage {human_bytes(self.memory.peak)} (each "
                "runs the same program)"
            )
        return "; ".join(parts)

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
        """A roofline estimate of one step on `hardware` (a name in `eqshard.targets.HARDWARE`,
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
