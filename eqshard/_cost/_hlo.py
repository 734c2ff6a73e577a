"""Reading a compiled HLO module's text (`compiled.as_text()`): pure text, no JAX.

`parse` turns the text into computations of instructions, each with its shape,
opcode, operands (by name) and attributes, and a symbol table of every
instruction's shape, since compiled texts often print an operand by name only
(XLA:TPU's `all-reduce(%fusion)`). On that:

- `collectives`: every collective with the bytes it moves on each device, its
  device groups (from every notation XLA writes them in) and how many times one
  run of the program runs it;
- `flops`: the FLOPs of the matrix products one device runs (`dot`,
  `convolution`, cuBLAS and cuDNN calls);
- `runs`: how many times one run of the entry runs each computation: a `while`
  body its trip count (`trip_count`), a `conditional` only its heaviest branch,
  anything else once per call site.

What it does not know (a collective's name, a notation of device groups, a dtype,
a matrix-product call) is an `EqshardError` that names it and its line: a figure
is never a silent zero.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Union

from .._errors import EqshardError

__all__ = [
    "DTYPE_BITS",
    "KINDS",
    "Array",
    "CollectiveOp",
    "Computation",
    "Instruction",
    "Module",
    "collectives",
    "flops",
    "loop_name",
    "parse",
    "runs",
    "trip_count",
    "value_dependent",
    "value_dependent_flops",
]

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

# Bits per element of every primitive type XLA's text writes (xla_data.proto's
# PrimitiveType, by its lower-case name). A token or an opaque handle carries no
# data. How an array of a type narrower than a byte is stored: see `Array.bits`.
DTYPE_BITS: dict[str, int] = {
    "pred": 8,
    "s1": 1,
    "u1": 1,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "f4e2m1fn": 4,
    "f6e2m3fn": 6,
    "f6e3m2fn": 6,
    "f8e3m4": 8,
    "f8e4m3": 8,
    "f8e4m3b11fnuz": 8,
    "f8e4m3fn": 8,
    "f8e4m3fnuz": 8,
    "f8e5m2": 8,
    "f8e5m2fnuz": 8,
    "f8e8m0fnu": 8,
    "token": 0,
    "opaque": 0,
}


@dataclasses.dataclass(frozen=True)
class Array:
    """An array shape: its dtype, its dims (a bounded dynamic dim, `<=8`, by its
    bound) and the bits each element takes in memory.

    `bits` follows XLA (`ShapeUtil::ByteSizeOf`): a layout that names an element
    size (`s4[8]{0:E(4)}`, as XLA:CPU and XLA:TPU lay out every array of a type
    narrower than a byte) packs the elements to it; a layout without one stores an
    element in whole bytes; a shape printed without a layout is taken as packed,
    as compiled programs store it. Tiles of a TPU layout (`T(8,128)`) pad small
    arrays in memory; the bytes counted are the array's own, not its tiles'.
    """

    dtype: str
    dims: tuple[int, ...]
    bits: int

    @property
    def bytes(self) -> int:
        """Its elements at `bits` each, rounded up to a whole byte per array."""
        return -(-math.prod(self.dims) * self.bits // 8)


Shape = Union[Array, tuple["Shape", ...]]


def shape_bytes(shape: Shape) -> int:
    """The bytes of an array, or of every array in a tuple."""
    if isinstance(shape, Array):
        return shape.bytes
    return sum(shape_bytes(part) for part in shape)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction: `%name = shape opcode(operands), attributes`.

    `operands` are names (an operand printed with its shape, `f32[4]{0} %x`, by
    its name too); `attributes` maps each `key=` to its text, whole
    (`replica_groups`, `calls`, `backend_config`, `metadata`, ...); `line` is its
    line in the text, from 1.
    """

    name: str
    shape: Shape
    opcode: str
    operands: tuple[str, ...]
    attributes: Mapping[str, str]
    line: int
    text: str

    @property
    def op_name(self) -> str:
        """Where XLA records it comes from (`metadata={op_name="..."}`), or ""."""
        found = re.search(r'op_name="((?:[^"\\]|\\.)*)"', self.attributes.get("metadata", ""))
        return found.group(1) if found else ""


@dataclasses.dataclass(frozen=True)
class Computation:
    """A computation: its instructions in order, the last one its root where no
    instruction is marked `ROOT`."""

    name: str
    instructions: tuple[Instruction, ...]
    root: str


@dataclasses.dataclass(frozen=True)
class Module:
    """A parsed HLO module: its computations by name, the entry's name, every
    instruction by name (XLA names them uniquely in a module), and its device
    count (`num_partitions` times `replica_count`, 0 where the text does not say)."""

    computations: Mapping[str, Computation]
    entry: str
    instructions: Mapping[str, Instruction]
    devices: int

    def shape(self, name: str, user: Instruction) -> Shape:
        """The shape of the instruction `name`, which `user` reads."""
        if name not in self.instructions:
            raise _unreadable(user, f"its operand %{name} is defined nowhere in the text")
        return self.instructions[name].shape


def _unreadable(instruction: Instruction, what: str) -> EqshardError:
    line = instruction.text.strip()
    if len(line) > 300:
        line = line[:299] + "…"
    return EqshardError(
        f"eqshard cannot read line {instruction.line} of the compiled HLO: {what}; the "
        "figures would be wrong without it, so none are given. Please report it to eqshard "
        f"with the line:\n  {line}"
    )


_HEADER = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"\s*(?P<opcode>[a-z][a-z0-9\-]*)\(")
_COMMENT = re.compile(r"/\*.*?\*/")


def parse(text: str, devices: int = 0) -> Module:
    """Reads a compiled HLO module's text (`compiled.as_text()`).

    **Example:**

    ```python
    module = parse(jax.jit(f).lower(x).compile().as_text())
    module.computations[module.entry].instructions[0].opcode    # "parameter"
    ```

    **Arguments:**

    - `text`: the module's text.
    - `devices`: the device count where the text does not say (its `HloModule`
        line's `num_partitions` and `replica_count`).

    **Returns:**

    A `Module`.

    **Raises:**

    `EqshardError` naming the line where a shape has a dtype eqshard does not know,
    or a line it cannot read at all.
    """
    computations: dict[str, Computation] = {}
    instructions: dict[str, Instruction] = {}
    entry = ""
    current: list[Instruction] | None = None
    name, root = "", ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("HloModule"):
            devices = _device_count(line) or devices
            continue
        if current is None:
            header = _HEADER.match(line)
            if header is not None:
                current, name, root = [], header["name"], ""
                if header["entry"]:
                    entry = name
            elif _INSTRUCTION.match(line):
                where = Instruction("", (), "", (), {}, number, line)
                raise _unreadable(where, "it is an instruction outside any computation")
            continue
        if line.strip() == "}":
            computations[name] = Computation(
                name, tuple(current), root or (current[-1].name if current else "")
            )
            current = None
            continue
        if not line.strip():
            continue
        instruction, is_root = _instruction(line, number)
        if is_root:
            root = instruction.name
        current.append(instruction)
        instructions[instruction.name] = instruction
    if not entry and computations:
        entry = next(reversed(computations))  # XLA prints the entry last
    return Module(computations, entry, instructions, devices)


def _device_count(header: str) -> int:
    partitions = re.search(r"\bnum_partitions=(\d+)", header)
    replicas = re.search(r"\breplica_count=(\d+)", header)
    return (int(partitions.group(1)) if partitions else 1) * (
        int(replicas.group(1)) if replicas else 1
    )


def _instruction(line: str, number: int) -> tuple[Instruction, bool]:
    """The instruction on a line, and whether it is its computation's `ROOT`."""
    found = _INSTRUCTION.match(line)
    bare = Instruction("", (), "", (), {}, number, line)
    if found is None:
        raise _unreadable(bare, "it is not an instruction `%name = shape opcode(operands)`")
    rest = _COMMENT.sub("", found["rest"])
    bare = dataclasses.replace(bare, name=found["name"])
    shape, at = _shape(rest, 0, bare)
    opcode = _OPCODE.match(rest, at)
    if opcode is None:
        raise _unreadable(bare, "no opcode follows its shape")
    close = _closing(rest, opcode.end() - 1)
    if close < 0:
        raise _unreadable(bare, "its operand list is not closed")
    operands = tuple(
        _operand_name(part) for part in _split(rest[opcode.end() : close]) if part.strip()
    )
    attributes = _attributes(rest[close + 1 :])
    instruction = Instruction(
        found["name"], shape, opcode["opcode"], operands, attributes, number, line
    )
    return instruction, bool(found["root"])


def _operand_name(text: str) -> str:
    """`%x` or `f32[4]{0} %x` → `x`; a literal (`constant(0)`'s `0`) as written."""
    last = text.strip().split()[-1] if text.strip() else ""
    return last[1:] if last.startswith("%") else last


_ARRAY = re.compile(r"\s*(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")


def _shape(text: str, at: int, where: Instruction) -> tuple[Shape, int]:
    """The shape that starts at `text[at]`, and where it ends."""
    while at < len(text) and text[at] == " ":
        at += 1
    if text.startswith("(", at):
        parts: list[Shape] = []
        at += 1
        while True:
            while at < len(text) and text[at] in " ,":
                at += 1
            if text.startswith(")", at):
                return tuple(parts), at + 1
            if at >= len(text):
                raise _unreadable(where, "its tuple shape is not closed")
            part, at = _shape(text, at, where)
            parts.append(part)
    found = _ARRAY.match(text, at)
    if found is None:
        raise _unreadable(where, f"its shape {text[at : at + 40]!r} is not one eqshard reads")
    dtype = found["dtype"]
    if dtype not in DTYPE_BITS:
        raise _unreadable(
            where,
            f"the dtype `{dtype}` is not one eqshard knows (it knows {', '.join(DTYPE_BITS)})",
        )
    dims = []
    for dim in found["dims"].split(","):
        dim = dim.strip().removeprefix("<=")
        if not dim:
            continue
        if not dim.isdigit():
            raise _unreadable(where, f"the dim `{dim}` of its shape has no size eqshard can read")
        dims.append(int(dim))
    at = found.end()
    bits = DTYPE_BITS[dtype]
    if text.startswith("{", at):
        end = _closing(text, at)
        layout = text[at + 1 : end]
        element = re.search(r"E\((\d+)\)", layout.partition(":")[2])
        bits = int(element.group(1)) if element else -(-bits // 8) * 8
        at = end + 1
    return Array(dtype, tuple(dims), bits), at


_OPEN = {"(": ")", "[": "]", "{": "}"}


def _scan(text: str, at: int = 0) -> Iterator[tuple[int, str, int]]:
    """Each character of `text` from `at` that is outside quotes, with its index and
    the depth of brackets around it."""
    depth, quote, i = 0, "", at
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        else:
            yield i, c, depth
            depth += (c in _OPEN) - (c in ")]}")
        i += 1


def _closing(text: str, at: int) -> int:
    """The index of the bracket that closes the one at `text[at]`, or -1."""
    return next((i for i, c, depth in _scan(text, at) if c in ")]}" and depth == 1), -1)


def _split(text: str) -> list[str]:
    """`text` cut at its commas outside brackets and quotes."""
    parts, begin = [], 0
    for i, c, depth in _scan(text):
        if c == "," and depth == 0:
            parts.append(text[begin:i])
            begin = i + 1
    parts.append(text[begin:])
    return parts


def _attributes(text: str) -> dict[str, str]:
    """`, key=value, key=value` → `{key: value}`. The mesh notation's
    `device_ids=(...)` stays with its `replica_groups`."""
    found: dict[str, str] = {}
    last = ""
    for part in _split(text):
        key, equals, value = part.strip().partition("=")
        if not equals:
            continue
        if key == "device_ids" and last == "replica_groups":
            found[last] += f", {part.strip()}"
            continue
        found[key] = value
        last = key
    return found


# Call graph -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call site: the callee, the times it runs per run of the caller, and the
    branches it is one of (a conditional's), if any."""

    callee: str
    times: int
    branches: tuple[str, ...] = ()


_CALLEES = ("calls", "to_apply", "called_computations")
_NOT_CALLING = ("async-update", "async-done")  # they name the `async-start`'s computation


def _names(value: str) -> list[str]:
    """`%a` or `{%a, %b}` → `["a", "b"]`."""
    return [n.strip().lstrip("%") for n in value.strip().strip("{}").split(",") if n.strip()]


def _calls(module: Module, instruction: Instruction) -> list[_Call]:
    """The computations an instruction calls, with how often."""
    a = instruction.attributes
    if instruction.opcode == "while":
        trips = trip_count(module, instruction)
        times = trips if trips is not None else 1
        return [_Call(_names(a["body"])[0], times), _Call(_names(a["condition"])[0], times + 1)]
    if instruction.opcode == "conditional":
        if "branch_computations" in a:
            branches = tuple(_names(a["branch_computations"]))
        else:
            branches = tuple(_names(a["true_computation"]) + _names(a["false_computation"]))
        return [_Call(b, 1, branches) for b in branches]
    if instruction.opcode in _NOT_CALLING:
        return []
    return [_Call(name, 1) for key in _CALLEES if key in a for name in _names(a[key])]


def trip_count(module: Module, loop: Instruction) -> int | None:
    """A `while` loop's trip count, where it is known: XLA:CPU and XLA:GPU write it
    in the loop's backend config (`known_trip_count`); XLA:TPU does not, and it is
    read from the loop as XLA's own analysis reads it: the condition compares an
    element of the loop's tuple with a constant, the loop starts it at a constant
    and the body adds a constant to it (`jax.lax.scan` and `fori_loop` loops).
    None for a loop whose trip count depends on values."""
    found = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', _config(loop))
    if found:
        return int(found.group(1))
    condition = module.computations.get(_names(loop.attributes.get("condition", ""))[0])
    body = module.computations.get(_names(loop.attributes.get("body", ""))[0])
    if condition is None or body is None or not loop.operands:
        return None
    compare = _operation(module, module.instructions.get(condition.root))
    if compare is None or compare.opcode != "compare" or len(compare.operands) != 2:
        return None
    direction = compare.attributes.get("direction", "")
    left, right = compare.operands
    if _element(module, right) is not None:  # `n > i`: read as `i < n`
        left, right = right, left
        direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
    index, bound = _element(module, left), _constant(right)
    if index is None or bound is None:
        return None
    start = _constant(_element_of(module, _source(module, loop.operands[0]), index))
    update = _operation(module, _element_of(module, module.instructions.get(body.root), index))
    if start is None or update is None or update.opcode not in ("add", "subtract"):
        return None
    counter, step_at = update.operands
    if update.opcode == "add" and _element(module, counter) != index:
        counter, step_at = step_at, counter
    step = _constant(step_at)
    if _element(module, counter) != index or step is None or step == 0:
        return None
    return _trips(start, bound, step if update.opcode == "add" else -step, direction)


@dataclasses.dataclass(frozen=True)
class _Operation:
    """What an instruction computes from what: a fusion of one operation (XLA:CPU's
    `wrapped_compare`) as that operation of the fusion's operands."""

    opcode: str
    operands: tuple[Instruction | None, ...]
    attributes: Mapping[str, str]


def _operation(module: Module, instruction: Instruction | None) -> _Operation | None:
    if instruction is None:
        return None
    if instruction.opcode != "fusion":
        direct = tuple(_source(module, o) for o in instruction.operands)
        return _Operation(instruction.opcode, direct, instruction.attributes)
    fused = module.computations.get(_names(instruction.attributes.get("calls", ""))[0])
    root = module.instructions.get(fused.root) if fused is not None else None
    if root is None:
        return None
    sources: list[Instruction | None] = []
    for name in root.operands:
        inner = module.instructions.get(name)
        if inner is not None and inner.opcode == "parameter":
            number = int(inner.operands[0])
            outer = instruction.operands[number] if number < len(instruction.operands) else ""
            sources.append(_source(module, outer))
        else:
            sources.append(_source(module, name))
    return _Operation(root.opcode, tuple(sources), root.attributes)


def _trips(start: int, bound: int, step: int, direction: str) -> int | None:
    """How many times `i = start; while i <direction> bound: i += step` runs."""
    if direction in ("LT", "LE") and step > 0:
        span = bound - start + (1 if direction == "LE" else 0)
        return max(0, -(-span // step))
    if direction in ("GT", "GE") and step < 0:
        span = start - bound + (1 if direction == "GE" else 0)
        return max(0, -(-span // -step))
    if direction == "NE" and (bound - start) % step == 0 and (bound - start) // step >= 0:
        return (bound - start) // step
    return None


_PASS_THROUGH = ("copy", "bitcast", "convert", "copy-done", "copy-start", "reshape")


def _source(module: Module, name: str) -> Instruction | None:
    """The instruction whose value `name` holds, through copies, bitcasts and
    conversions, and through an element of a tuple built in the same text."""
    seen = 0
    instruction = module.instructions.get(name)
    while instruction is not None and seen < 64:
        seen += 1
        if instruction.opcode in _PASS_THROUGH and instruction.operands:
            instruction = module.instructions.get(instruction.operands[0])
        elif instruction.opcode == "get-tuple-element":
            tuple_ = _source(module, instruction.operands[0])
            index = int(instruction.attributes.get("index", "-1"))
            if tuple_ is None or tuple_.opcode != "tuple" or not 0 <= index < len(tuple_.operands):
                return instruction
            instruction = module.instructions.get(tuple_.operands[index])
        else:
            return instruction
    return instruction


def _element(module: Module, instruction: Instruction | None) -> int | None:
    """k, where `instruction` is element k of its computation's parameter."""
    if instruction is None or instruction.opcode != "get-tuple-element":
        return None
    tuple_ = module.instructions.get(instruction.operands[0])
    if tuple_ is None or tuple_.opcode != "parameter":
        return None
    return int(instruction.attributes.get("index", "-1"))


def _element_of(module: Module, tuple_: Instruction | None, index: int) -> Instruction | None:
    """What element `index` of a `tuple` instruction holds."""
    if tuple_ is None or tuple_.opcode != "tuple" or not 0 <= index < len(tuple_.operands):
        return None
    return _source(module, tuple_.operands[index])


def _constant(instruction: Instruction | None) -> int | None:
    """The value of an integer scalar `constant`, else None."""
    if instruction is None or instruction.opcode != "constant" or len(instruction.operands) != 1:
        return None
    value = instruction.operands[0]
    return int(value) if re.fullmatch(r"-?\d+", value) else None


def _config(instruction: Instruction) -> str:
    return instruction.attributes.get("backend_config", "")


def runs(module: Module, weigh: Callable[[Computation], float]) -> dict[str, int]:
    """How many times one run of the entry runs each computation.

    A `while` body runs its trip count (`trip_count`) times per run of its
    caller (once where the count depends on values: a lower bound), a
    `conditional` only the branch whose weight is the largest (the first of
    equals; a computation's weight is `weigh` of it plus its callees', counted by
    these same rules), anything else once per call site.

    **Arguments:**

    - `module`: the parsed module.
    - `weigh`: what one run of a computation's own instructions costs (its FLOPs,
        its bytes of one kind of collective).

    **Returns:**

    Runs by computation name; computations that never run are left out.
    """
    calls = {
        name: [call for i in c.instructions for call in _calls(module, i)]
        for name, c in module.computations.items()
    }
    order = _callees_first(module.entry, calls)
    total: dict[str, float] = {}
    for name in order:
        own = weigh(module.computations[name]) if name in module.computations else 0.0
        branch_groups: dict[tuple[str, ...], float] = {}
        for call in calls.get(name, []):
            if call.branches:
                heaviest = branch_groups.get(call.branches, 0.0)
                branch_groups[call.branches] = max(heaviest, total[call.callee])
            else:
                own += call.times * total[call.callee]
        total[name] = own + sum(branch_groups.values())
    counts: dict[str, int] = {module.entry: 1}
    for name in reversed(order):  # callers first
        times = counts.get(name, 0)
        if not times:
            continue
        for call in calls.get(name, []):
            if call.branches and call.callee != max(call.branches, key=lambda b: total[b]):
                continue
            counts[call.callee] = counts.get(call.callee, 0) + times * call.times
    return {name: n for name, n in counts.items() if n}


def _callees_first(entry: str, calls: Mapping[str, list[_Call]]) -> list[str]:
    """The computations reachable from `entry`, each after every one it calls."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1: being visited, 2: done
    stack: list[tuple[str, int]] = [(entry, 0)]
    while stack:
        name, index = stack.pop()
        if index == 0:
            if state.get(name):
                continue  # done, or a cycle, which HLO cannot have
            state[name] = 1
        callees = calls.get(name, [])
        if index < len(callees):
            stack.append((name, index + 1))
            if not state.get(callees[index].callee):
                stack.append((callees[index].callee, 0))
        else:
            state[name] = 2
            order.append(name)
    return order


# Collectives -----------------------------------------------------------------


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
    """

    kind: str
    bytes: int
    groups: tuple[tuple[int, ...], ...]
    source: str
    count: int
    line: int
    loop: str | None = None


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
        raise _unreadable(
            instruction,
            f"`{opcode}` moves data between devices point to point, which eqshard does not count",
        )
    if _LOOKS_COLLECTIVE.search(opcode):
        raise _unreadable(
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
            raise _unreadable(
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
            chain = _chain(instruction)
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
                _groups(instruction, module.devices),
                instruction.op_name or _caller_source(module, computation.name),
                0,
                instruction.line,
            )
            found.append((computation.name, op))
    for chain, piece in pieces.items():
        if chain not in started:
            raise _unreadable(
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


def value_dependent(module: Module) -> dict[str, str]:
    """The computations that run inside a `while` loop whose trip count depends on
    values (neither XLA nor the loop's own counter says it: an adaptive ODE
    solver's steps, a fixed-point iteration), each with that loop (the outermost
    such, as `loop_name` gives it). What they hold runs an unknown number of times
    per step: `runs` counts it once per trip of that loop."""
    calls = {
        name: [(i, call) for i in c.instructions for call in _calls(module, i)]
        for name, c in module.computations.items()
    }
    found: dict[str, str] = {}
    stack: list[tuple[str, str | None]] = [(module.entry, None)]
    seen: set[tuple[str, str | None]] = set()
    while stack:
        name, loop = stack.pop()
        if (name, loop) in seen:
            continue
        seen.add((name, loop))
        if loop is not None:
            found.setdefault(name, loop)
        for instruction, call in calls.get(name, []):
            inner = loop
            unknown = instruction.opcode == "while" and trip_count(module, instruction) is None
            if inner is None and unknown:
                inner = loop_name(instruction)
            stack.append((call.callee, inner))
    return found


def loop_name(loop: Instruction) -> str:
    """A `while` loop as messages name it: `while.3 (jit(step)/while), line 120`."""
    source = f" ({loop.op_name})" if loop.op_name else ""
    return f"{loop.name}{source}, line {loop.line}"


def _chain(instruction: Instruction) -> str | None:
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
        if any(call.callee == computation for call in _calls(module, i))
    ]
    return callers[0].op_name if len(callers) == 1 else ""


# Device groups ----------------------------------------------------------------


def _groups(instruction: Instruction, devices: int) -> tuple[tuple[int, ...], ...]:
    """A collective's device groups, from any of XLA's notations:

    - explicit: `replica_groups={{0,1},{2,3}}`; `{}` is every device in one group;
    - iota: `replica_groups=[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`: the ids 0..n-1
        reshaped to the dims after `<=`, transposed by `T(...)`, and cut into the
        groups of the dims before it;
    - mesh: `replica_groups=mesh['x'=2,'y'=4] {'y'}` (with `, device_ids=(...)`
        where the mesh's devices are not in order, by an iota or a list): the
        devices that differ along the named axes, or sub-axes (`'y':(2)2`);
    - `source_target_pairs={{0,1},{1,0}}`: each pair, a group of two.
    """
    a = instruction.attributes
    if "source_target_pairs" in a:
        return tuple(tuple(p) for p in _nested(a["source_target_pairs"], instruction))
    if "replica_groups" not in a:
        return (tuple(range(devices)),) if devices else ()
    text = a["replica_groups"].strip()
    if text.startswith("mesh["):
        return _mesh_groups(text, instruction)
    if text.startswith("{"):
        groups = tuple(tuple(g) for g in _nested(text, instruction))
        if groups:
            return groups
        if not devices:
            raise _unreadable(
                instruction,
                "`replica_groups={}` means every device, and the text does not say how many "
                "(no `num_partitions` on its `HloModule` line)",
            )
        return (tuple(range(devices)),)
    if text.startswith("["):
        ids = _iota(text, instruction)
        return tuple(tuple(int(i) for i in row) for row in ids)
    raise _unreadable(instruction, f"the device groups `{text}` are in no notation eqshard knows")


def _nested(text: str, where: Instruction) -> list[list[int]]:
    """`{{0,1},{2,3}}` → `[[0, 1], [2, 3]]`."""
    if not re.fullmatch(r"\{\s*(\{[\d,\s]*\}\s*,?\s*)*\}", text.strip()):
        raise _unreadable(where, f"the device groups `{text}` are in no notation eqshard knows")
    inner = text.strip()[1:-1]
    return [
        [int(i) for i in g.split(",") if i.strip()] for g in re.findall(r"\{([\d,\s]*)\}", inner)
    ]


_IOTA = re.compile(r"\[(?P<shape>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")


def _iota(text: str, where: Instruction) -> list[list[int]]:
    """`[2,4]<=[8]` and `[4,2]<=[2,4]T(1,0)`: rows of the iota, reshaped to the
    dims after `<=`, transposed, then cut into the dims before it (the first dim
    the groups, the rest one group)."""
    found = _IOTA.fullmatch(text)
    if found is None:
        raise _unreadable(where, f"the device groups `{text}` are in no notation eqshard knows")
    shape = [int(d) for d in found["shape"].split(",")]
    ids = _transposed(
        list(range(math.prod(shape))),
        [int(d) for d in found["reshape"].split(",")],
        [int(p) for p in found["perm"].split(",")] if found["perm"] else None,
        where,
    )
    size = math.prod(shape[1:])
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _transposed(
    ids: list[int], dims: list[int], perm: list[int] | None, where: Instruction
) -> list[int]:
    """`ids` as an array of `dims`, transposed by `perm`, flattened row-major."""
    if math.prod(dims) != len(ids) or (perm is not None and sorted(perm) != list(range(len(dims)))):
        raise _unreadable(where, "its device groups' iota does not fit its dims")
    if perm is None:
        return list(ids)
    strides = [math.prod(dims[k + 1 :]) for k in range(len(dims))]
    out_dims = [dims[p] for p in perm]
    result = []
    for flat in range(len(ids)):
        index, rest = 0, flat
        for k in reversed(range(len(out_dims))):
            rest, coordinate = divmod(rest, out_dims[k])
            index += coordinate * strides[perm[k]]
        result.append(ids[index])
    return result


_MESH = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\](?:\s*,\s*device_ids=\((?P<ids>[^)]*\)?)\))?\s*\{(?P<over>[^}]*)\}"
)
_MESH_AXIS = re.compile(r"\s*'(?P<name>[^']*)'\s*=\s*(?P<size>\d+)\s*")
_OVER = re.compile(r"\s*'(?P<name>[^']*)'(?::\((?P<pre>\d+)\)(?P<size>\d+))?\s*")


def _mesh_groups(text: str, where: Instruction) -> tuple[tuple[int, ...], ...]:
    """Groups from the mesh notation: `mesh['x'=2,'y'=4] {'y'}` is, for each device
    of a row-major (2, 4) grid (in `device_ids` order where given), the devices
    that differ from it along `y` only. A sub-axis `'y':(2)2` is the part of `y` of
    size 2 after a major part of size 2 (Shardy's notation): `y` = 2 x 2 x 1."""
    found = _MESH.fullmatch(text)
    unknown = f"the device groups `{text}` are in no notation eqshard knows"
    if found is None:
        raise _unreadable(where, unknown)
    names, sizes = [], []
    for item in found["axes"].split(","):
        axis = _MESH_AXIS.fullmatch(item)
        if axis is None:
            raise _unreadable(where, unknown)
        names.append(axis["name"])
        sizes.append(int(axis["size"]))
    count = math.prod(sizes)
    ids = list(range(count))
    if found["ids"]:
        listed = found["ids"].strip()
        if listed.startswith("["):
            iota = re.fullmatch(r"\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?", listed)
            if iota is None:
                raise _unreadable(where, unknown)
            dims = [int(d) for d in iota["dims"].split(",")]
            perm = [int(p) for p in iota["perm"].split(",")] if iota["perm"] else None
            ids = _transposed(ids, dims, perm, where)
        elif re.fullmatch(r"[\d,\s]+", listed):
            ids = [int(i) for i in listed.split(",")]
        else:
            raise _unreadable(where, unknown)
        if len(ids) != count:
            raise _unreadable(where, "its mesh's device ids do not fill the mesh")
    # each axis the groups run over (or a sub-axis of) split in three: the part
    # before (major), the part they run over, the part after
    over: dict[str, tuple[int, int]] = {}  # axis: (size before, size of the part)
    for item in found["over"].split(",") if found["over"].strip() else []:
        axis = _OVER.fullmatch(item)
        if axis is None or axis["name"] not in names or axis["name"] in over:
            raise _unreadable(where, unknown)
        size = sizes[names.index(axis["name"])]
        pre, part = (int(axis["pre"]), int(axis["size"])) if axis["pre"] else (1, size)
        if size % (pre * part):
            raise _unreadable(where, unknown)
        over[axis["name"]] = (pre, part)
    parts: list[tuple[str, int, bool]] = []  # (axis, size, in the group), major first
    for name, size in zip(names, sizes):
        if name in over:
            pre, part = over[name]
            parts += [(name, pre, False), (name, part, True), (name, size // (pre * part), False)]
        else:
            parts.append((name, size, False))
    # device id of each grid position, then grouped: the positions that differ
    # only in the named parts, ordered as the groups name them
    dims = [size for _, size, _ in parts]
    inner = [k for k, (_, _, grouped) in enumerate(parts) if grouped]
    inner.sort(key=lambda k: list(over).index(parts[k][0]))  # in the order the groups name
    outer = [k for k, (_, _, grouped) in enumerate(parts) if not grouped]
    flat = _transposed(ids, dims, outer + inner, where)
    size = math.prod(dims[k] for k in inner)
    return tuple(tuple(flat[i : i + size]) for i in range(0, len(flat), size))


# FLOPs -------------------------------------------------------------------------

_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_CONVOLUTIONS = {  # cuDNN's calls: (the forward output, the kernel), by where they are
    "__cudnn$convForward": ("result", 1),
    "__cudnn$convBiasActivationForward": ("result", 1),
    "__cudnn$convBackwardInput": (0, 1),
    "__cudnn$convBackwardFilter": (1, "result"),
}
_LOOKS_MATRIX = re.compile(r"gemm|matmul|cublas|cudnn|conv", re.IGNORECASE)


def _flops(module: Module, instruction: Instruction) -> int:
    """The FLOPs of one run of an instruction that multiplies matrices (2 per
    multiply-add), 0 for any other."""
    opcode = instruction.opcode
    if opcode == "dot":
        lhs = _array(module.shape(instruction.operands[0], instruction), instruction)
        contracted = _dims(instruction.attributes.get("lhs_contracting_dims", "{}"))
        return (
            2
            * math.prod(_array(instruction.shape, instruction).dims)
            * math.prod(lhs.dims[d] for d in contracted)
        )
    if opcode == "reduce" and instruction.op_name.rsplit("/", 1)[-1] == "dot_general":
        # a matrix product XLA rewrote as a multiply and a sum (XLA:TPU's
        # `multiply_reduce_fusion` of a matrix-vector product): 2 per product summed
        summed = module.shape(instruction.operands[0], instruction)
        if isinstance(summed, Array):
            return 2 * math.prod(summed.dims)
        raise _unreadable(instruction, "a matrix product's sum over a tuple of arrays")
    if opcode == "convolution":
        lhs = _array(module.shape(instruction.operands[0], instruction), instruction)
        kernel = _array(module.shape(instruction.operands[1], instruction), instruction)
        out = _array(instruction.shape, instruction)
        return _convolution_flops(out, kernel, instruction, lhs)
    if opcode != "custom-call":
        return 0
    target = instruction.attributes.get("custom_call_target", "").strip('"')
    config = _json(instruction)
    estimate = _find(config, "cost_estimate")  # a Pallas kernel's, as XLA counts it
    if isinstance(estimate, dict) and str(estimate.get("flops", "")).isdigit():
        return int(estimate["flops"])
    if target in _GEMMS:
        numbers = _find(config, "dot_dimension_numbers")
        if numbers is None:
            raise _unreadable(instruction, f"the `{target}` call has no dot_dimension_numbers")
        lhs = _array(module.shape(instruction.operands[0], instruction), instruction)
        out = _array(_first(instruction.shape), instruction)
        contracted = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
        return 2 * math.prod(out.dims) * math.prod(lhs.dims[d] for d in contracted)
    if target in _CONVOLUTIONS:
        out_at, kernel_at = _CONVOLUTIONS[target]

        def at(where: str | int) -> Array:
            if where == "result":
                return _array(_first(instruction.shape), instruction)
            return _array(module.shape(instruction.operands[int(where)], instruction), instruction)

        return _convolution_flops(at(out_at), at(kernel_at), instruction)
    if _LOOKS_MATRIX.search(target):
        raise _unreadable(
            instruction,
            f"the call `{target}` looks like a matrix product, and eqshard does not know its "
            f"FLOPs (it reads `dot`, `convolution`, {', '.join(_GEMMS)} and "
            f"{', '.join(_CONVOLUTIONS)})",
        )
    return 0  # a kernel without an estimate (LAPACK): XLA's own analysis counts none either


def _json(instruction: Instruction) -> object:
    """An instruction's backend config, read as JSON where it is JSON, else None."""
    text = _config(instruction)
    if not text.startswith("{"):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _convolution_flops(
    out: Array, kernel: Array, instruction: Instruction, lhs: Array | None = None
) -> int:
    """2 per multiply-add: each output element sums its window over the kernel's
    input features, counting only the taps that land on the input itself, as XLA's
    own cost analysis does: not those on padding, nor on the holes an `lhs_dilate`
    puts between input elements (XLA:TPU writes a batched `dot` as a convolution
    whose window of `size=8x4 lhs_dilate=8x4` meets one input element in 32 taps).
    Without a `window` (a cuDNN call), every tap: 2 x output elements x kernel
    elements / output features."""
    labels = instruction.attributes.get("dim_labels", "")
    lhs_labels, _, rest = labels.partition("_")
    kernel_labels, _, out_labels = rest.partition("->")
    if "o" not in kernel_labels or len(kernel_labels) != len(kernel.dims):
        raise _unreadable(instruction, f"its dim_labels `{labels}` do not label its kernel")
    features = kernel.dims[kernel_labels.index("o")]
    every = 2 * math.prod(out.dims) * math.prod(kernel.dims) // max(features, 1)
    window = instruction.attributes.get("window")
    if lhs is None or window is None:
        return every
    spatial = sorted(c for c in kernel_labels if c.isdigit())
    if len(lhs_labels) != len(lhs.dims) or len(out_labels) != len(out.dims):
        raise _unreadable(instruction, f"its dim_labels `{labels}` do not label its operands")
    fields = _window(window, len(spatial), instruction)
    taps = 1
    for k, label in enumerate(spatial):
        taps *= _real_taps(
            lhs.dims[lhs_labels.index(label)],
            out.dims[out_labels.index(label)],
            kernel.dims[kernel_labels.index(label)],
            {name: values[k] for name, values in fields.items()},
        )
    inputs = kernel.dims[kernel_labels.index("i")] if "i" in kernel_labels else 1
    positions = math.prod(out.dims[out_labels.index(label)] for label in spatial)
    return 2 * (math.prod(out.dims) // max(positions, 1)) * taps * inputs


def _window(text: str, rank: int, instruction: Instruction) -> dict[str, list[Any]]:
    """A convolution's `window={size=3x3 stride=2x2 pad=1_1x0_1 lhs_dilate=2x2 ...}`,
    one value per spatial dim of each field (defaults where it is not written)."""
    fields: dict[str, list[Any]] = {
        "stride": [1] * rank,
        "pad": [(0, 0)] * rank,
        "lhs_dilate": [1] * rank,
        "rhs_dilate": [1] * rank,
    }
    for item in text.strip().strip("{}").split():
        name, _, value = item.partition("=")
        parts = value.split("x")
        if len(parts) != rank:
            raise _unreadable(instruction, f"its window's `{item}` has not {rank} dims")
        if name == "pad":
            pads = [tuple(int(v) for v in part.split("_")) for part in parts]
            fields["pad"] = [(lo, hi) for lo, hi in pads]
        elif name in fields or name == "size":
            fields[name] = [int(v) for v in parts]
        elif name != "rhs_reversal":
            raise _unreadable(instruction, f"its window has `{item}`, which eqshard does not read")
    return fields


def _real_taps(size: int, outputs: int, window: int, at: Mapping[str, Any]) -> int:
    """Along one spatial dim: the (output position, window tap) pairs whose tap
    lands on an input element, neither on padding nor between dilated elements.
    Tap `j` of output `o` is at `o * stride + j * rhs_dilate - pad_low` of the
    dilated input, whose elements sit at the multiples of `lhs_dilate` below
    `(size - 1) * lhs_dilate + 1`; counted per tap in O(lhs_dilate)."""
    stride, (low, _), dilate, spread = at["stride"], at["pad"], at["lhs_dilate"], at["rhs_dilate"]
    last = (size - 1) * dilate  # the dilated input's last element
    period = dilate // math.gcd(stride, dilate)  # outputs between two that meet an element
    count = 0
    for j in range(window):
        offset = j * spread - low
        first = max(0, -(offset // stride))  # ceil(-offset / stride), at least 0
        final = min(outputs - 1, (last - offset) // stride)
        hit = next(
            (
                o
                for o in range(first, min(first + period, final + 1))
                if (o * stride + offset) % dilate == 0
            ),
            None,
        )
        if hit is not None:
            count += (final - hit) // period + 1
    return count


def _array(shape: Shape, where: Instruction) -> Array:
    if not isinstance(shape, Array):
        raise _unreadable(where, "a matrix product's operand or result is a tuple")
    return shape


def _first(shape: Shape) -> Shape:
    """A call's result: the first element of a (result, workspace) tuple."""
    return shape[0] if isinstance(shape, tuple) and shape else shape


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.strip("{} ").split(",") if d.strip()]


def _find(config: object, key: str) -> Any:
    """The first value of `key` anywhere in a JSON document."""
    if isinstance(config, dict):
        if key in config:
            return config[key]
        values: Iterable[object] = config.values()
    elif isinstance(config, list):
        values = config
    else:
        return None
    for value in values:
        found = _find(value, key)
        if found is not None:
            return found
    return None


def flops(module: Module) -> int:
    """The FLOPs of the matrix products one run of the module does on each device:
    `dot` (2 x result elements x contracted elements), a `reduce` of a matrix
    product XLA rewrote as a multiply and a sum (XLA:TPU's matrix-vector products: 2
    x the elements summed), `convolution` (2 x output
    elements x the window's taps that meet the input, neither padding nor the holes
    of a dilated input, x input features) and cuBLAS and cuDNN calls, each
    as many times as `runs` says it runs when computations are weighed by these
    FLOPs (a loop by its trip count, a `cond` or `switch` by its heaviest branch).
    Elementwise work is not counted (XLA's own analysis counts a FLOP per element
    of it)."""
    own = {
        name: sum(_flops(module, i) for i in c.instructions)
        for name, c in module.computations.items()
    }
    counts = runs(module, lambda c: own[c.name])
    return sum(own[name] * n for name, n in counts.items() if name in own)


def value_dependent_flops(module: Module) -> int:
    """Of `flops`, those that run inside a `while` loop whose trip count depends on
    values (`value_dependent`), once per trip of it: how many times they run per
    step is not known."""
    own = {
        name: sum(_flops(module, i) for i in c.instructions)
        for name, c in module.computations.items()
    }
    counts = runs(module, lambda c: own[c.name])
    loops = value_dependent(module)
    return sum(own[name] * n for name, n in counts.items() if name in own and name in loops)
