"""The collectives of an HLO module (`collectives`): each one's kind (one of
`KINDS`), the bytes it moves on each device, its device groups and how many times
one run of the program runs it, as a `CollectiveOp`.
"""

from __future__ import annotations

import dataclasses
import re

from ._calls import calls_of, runs, value_dependent
from ._groups import device_groups
from ._parse import Computation, Instruction, Module, shape_bytes, unreadable

__all__ = ["KINDS", "CollectiveOp", "chain_id", "collectives"]

# The collectives eqshard counts, by XLA's opcode.
KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "ragged-all-to-all",
    "collective-broadcast",
)


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective of a module, as read from its text.

    - `kind`: one of `KINDS`.
    - `bytes`: what one run of it moves on each device: a reduce-scatter its
        operands, any other its results (see `_moved`).
    - `groups`: its device groups (a collective-permute's: its source-target
        pairs), as device ids: positions in the program's device assignment.
    - `source`: where XLA records it comes from (the op's name), or "".
    - `count`: how many times one run of the program runs it.
    - `line`: its line in the text.
    - `loop`: where it runs inside a `while` loop whose trip count depends on
        values (`value_dependent`), that loop, as `loop_name` gives it; then `count`
        is per trip of that loop, and the runs per step are not known. Else `None`.
    - `name`: its instruction's name in the text (`all-reduce.5`).
    """

    kind: str
    bytes: int
    groups: tuple[tuple[int, ...], ...]
    source: str
    count: int
    line: int
    loop: str | None = None
    name: str = ""


_ASYNC_PARTS = ("-done", "-update")
_LOOKS_COLLECTIVE = re.compile(  # not `ragged-dot`, a product
    r"^(all-|collective-|reduce-scatter|send|recv)|all-to-all|all-gather|all-reduce"
)


def _collective_kind(instruction: Instruction) -> str | None:
    """The kind of collective an instruction starts, if it does: `all-reduce` for
    `all-reduce` and `all-reduce-start`; None for anything else, for the `-done`
    (and `-update`) half of an async pair, which its start counts, and for a
    transfer to or from the host.

    Raises an `EqshardError` for an opcode that looks like a collective and is none
    eqshard knows, and for a point-to-point `send` or `recv` between devices."""
    opcode = instruction.opcode
    if opcode in KINDS:
        return opcode
    if opcode.endswith("-start") and opcode[: -len("-start")] in KINDS:
        return opcode[: -len("-start")]
    if any(opcode.endswith(part) and opcode[: -len(part)] in KINDS for part in _ASYNC_PARTS):
        return None
    if opcode in ("send", "recv", "send-done", "recv-done"):
        if instruction.attributes.get("is_host_transfer") == "true":
            return None  # to or from the host: no device moves it to another
        raise unreadable(
            instruction,
            f"`{opcode}` moves data between devices point to point, which eqshard does not count",
        )
    if _LOOKS_COLLECTIVE.search(opcode):
        raise unreadable(
            instruction,
            f"the collective `{opcode}` is not one eqshard knows (it knows "
            f"{', '.join(KINDS)}, their async `-start`/`-done` pairs and `async-start`)",
        )
    return None


def _moved(module: Module, instruction: Instruction, kind: str) -> int:
    """The bytes one run of a collective moves on each device.

    A reduce-scatter: its operands, which each device contributes to the reduction
    (its result is one device's part, n times smaller). An all-gather: its result,
    what each device ends up holding (its operand is one part). An all-reduce, a
    collective-permute and a collective-broadcast: their results, the size of
    their operands. An all-to-all sends every part of its operand to one device of
    its group and receives as many parts of the same size, so operand and result
    are the same size; it is counted by its result (a tuple form's: all of them).
    A ragged all-to-all by its result, the buffer it receives into: the sizes it
    sends are values, so this is an upper bound.

    An async start (`all-gather-start`, `collective-permute-start`,
    `all-to-all-start`, ...) counts once, by the same rule; its result is a tuple
    of (operands, results, context...), of which only the results count, except
    for `all-reduce-start`, whose result is the all-reduce's own."""
    if kind == "reduce-scatter":
        return sum(shape_bytes(module.shape(o, instruction)) for o in instruction.operands)
    shape = instruction.shape
    if instruction.opcode.endswith("-start") and instruction.opcode != "all-reduce-start":
        if not isinstance(shape, tuple) or len(shape) < 2:
            raise unreadable(
                instruction,
                f"`{instruction.opcode}` has no (operands, results, ...) tuple as its shape",
            )
        shape = shape[1]
    return shape_bytes(shape)


def collectives(module: Module) -> list[CollectiveOp]:
    """Every collective of a module that one run of it runs, in the order of the
    text.

    `count` is from `runs`, weighing each computation by its bytes of the
    collective's kind: in a `while` body, once per trip (`trip_count`);
    in a `conditional`, only those of the branch that moves the most bytes of
    their kind (so that a budget per kind bounds every branch). A collective that
    never runs (in a branch that moves fewer bytes of its kind than another) is
    left out.

    Two forms XLA:TPU writes are read as what they do: its all-reduce-scatter
    fusion (an all-reduce whose fused computation returns a dynamic slice of it)
    is a reduce-scatter; its async collective fusions repeat one collective (the
    same `chain_id`) in the start, each step and the done, and count once, at the
    start (the piece that feeds the `AsyncCollectiveStart` custom call).

    **Raises:**

    `EqshardError` naming the line of a collective or a device-group notation
    eqshard does not know, of a point-to-point `send` or `recv` between devices,
    or of a collective whose operand the text does not define.
    """
    found: list[tuple[str, CollectiveOp]] = []
    pieces: dict[str, Instruction] = {}  # a piece of each async collective fusion
    started: set[str] = set()  # the fusions whose start was found
    for computation in module.computations.values():
        starts = _async_fusion_starts(computation)
        root = next((i for i in computation.instructions if i.name == computation.root), None)
        for instruction in computation.instructions:
            kind = _collective_kind(instruction)
            if kind is None:
                continue
            chain = chain_id(instruction)
            if chain is not None:
                pieces.setdefault(chain, instruction)
                if instruction.name not in starts:
                    continue  # a step or the done of a fusion its start counts
                started.add(chain)
            if kind == "all-reduce" and _scatters(root, instruction):
                kind = "reduce-scatter"
            op = CollectiveOp(
                kind,
                _moved(module, instruction, kind),
                device_groups(instruction, module.devices),
                instruction.op_name or _caller_source(module, computation.name),
                0,
                instruction.line,
                name=instruction.name,
            )
            found.append((computation.name, op))
    for chain, piece in pieces.items():
        if chain not in started:
            raise unreadable(
                piece,
                f"it is a piece of an async collective fusion (chain_id={chain}) whose start "
                "(the piece that feeds `AsyncCollectiveStart`) eqshard did not find",
            )
    counts: dict[str, dict[str, int]] = {}
    for kind in {op.kind for _, op in found}:
        weights: dict[str, float] = {}
        for computation, op in found:
            if op.kind == kind:
                weights[computation] = weights.get(computation, 0.0) + op.bytes
        counts[kind] = runs(module, lambda c, w=weights: w.get(c.name, 0.0))
    result = []
    loops = value_dependent(module)
    for computation, op in found:
        count = counts[op.kind].get(computation, 0)
        if count:
            result.append(dataclasses.replace(op, count=count, loop=loops.get(computation)))
    return result


def chain_id(instruction: Instruction) -> str | None:
    """The `chain_id` XLA:TPU gives the pieces of one async collective fusion, or `None`."""
    found = re.search(
        r'\bchain_id="([^"]*)"', instruction.attributes.get("frontend_attributes", "")
    )
    return found.group(1) if found else None


def _async_fusion_starts(computation: Computation) -> set[str]:
    """The collectives of `computation` that feed XLA:TPU's `AsyncCollectiveStart`."""
    return {
        operand
        for i in computation.instructions
        if i.opcode == "custom-call"
        and i.attributes.get("custom_call_target") == '"AsyncCollectiveStart"'
        for operand in i.operands
    }


def _scatters(root: Instruction | None, all_reduce: Instruction) -> bool:
    """Whether a fused computation's root is a dynamic slice of this all-reduce:
    XLA:TPU's all-reduce-scatter fusion, a reduce-scatter."""
    return (
        root is not None
        and root.opcode == "dynamic-slice"
        and root.operands[:1] == (all_reduce.name,)
    )


def _caller_source(module: Module, computation: str) -> str:
    """The op name of the one instruction that calls `computation`, if one does."""
    callers = [
        i
        for i in module.instructions.values()
        if any(call.callee == computation for call in calls_of(module, i))
    ]
    return callers[0].op_name if len(callers) == 1 else ""
