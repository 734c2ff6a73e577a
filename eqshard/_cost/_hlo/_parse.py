"""An HLO module's text, parsed: `parse` reads `compiled.as_text()` into a `Module`
of `Computation`s of `Instruction`s, each with its `Array` shape (or a tuple of
them), opcode, operands by name and attributes by key, and a symbol table of every
instruction's shape, and the Python stack XLA records for each instruction
(`Module.stack`). `DTYPE_BITS` holds every primitive type XLA writes;
`unreadable` is the error every module here raises for what it cannot read, naming
the line.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping
from typing import Union

from ..._errors import EqshardError

__all__ = [
    "DTYPE_BITS",
    "Array",
    "Computation",
    "Frame",
    "Instruction",
    "Module",
    "Shape",
    "parse",
    "shape_bytes",
    "unreadable",
]

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

    @property
    def source(self) -> tuple[str, int] | None:
        """The file and line its own metadata names (`source_file=`, `source_line=`),
        as older JAX releases record them; else `None`."""
        metadata = self.attributes.get("metadata", "")
        file = re.search(r'source_file="((?:[^"\\]|\\.)*)"', metadata)
        line = re.search(r"\bsource_line=(\d+)", metadata)
        return (file.group(1), int(line.group(1))) if file and line else None

    @property
    def stack_frame(self) -> int:
        """The id of its innermost frame in the module's `StackFrames` (0: none)."""
        found = re.search(r"\bstack_frame_id=(\d+)", self.attributes.get("metadata", ""))
        return int(found.group(1)) if found else 0

    @property
    def backend_config(self) -> str:
        """Its `backend_config` attribute's text, or "" where it has none."""
        return self.attributes.get("backend_config", "")


@dataclasses.dataclass(frozen=True)
class Computation:
    """A computation: its instructions in order, the last one its root where no
    instruction is marked `ROOT`."""

    name: str
    instructions: tuple[Instruction, ...]
    root: str


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame of the Python stack that traced an instruction."""

    file: str
    line: int
    function: str


@dataclasses.dataclass(frozen=True)
class Module:
    """A parsed HLO module: its computations by name, the entry's name, every
    instruction by name (XLA names them uniquely in a module), its device count
    (`num_partitions` times `replica_count`, 0 where the text does not say), and its
    stack frames by id (`StackFrames`, each with its file, line and function, from
    the `FileNames`, `FunctionNames` and `FileLocations` tables JAX has XLA print)."""

    computations: Mapping[str, Computation]
    entry: str
    instructions: Mapping[str, Instruction]
    devices: int
    frames: Mapping[int, tuple[Frame, int]] = dataclasses.field(default_factory=dict)

    def stack(self, instruction: Instruction) -> tuple[Frame, ...]:
        """The Python stack that traced `instruction`, innermost frame first; its
        metadata's own `source_file` and `source_line` where it has no frame id;
        empty where the text records neither."""
        found: list[Frame] = []
        at, seen = instruction.stack_frame, set()
        while at in self.frames and at not in seen:
            seen.add(at)
            frame, at = self.frames[at]
            found.append(frame)
        if not found and instruction.source is not None:
            found.append(Frame(*instruction.source, ""))
        return tuple(found)

    def shape(self, name: str, user: Instruction) -> Shape:
        """The shape of the instruction `name`, which `user` reads."""
        if name not in self.instructions:
            raise unreadable(user, f"its operand %{name} is defined nowhere in the text")
        return self.instructions[name].shape


def unreadable(instruction: Instruction, what: str) -> EqshardError:
    """The error for what eqshard cannot read on an instruction's line: `what`, the
    line number and the line itself (cut to 300 characters)."""
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
# a computation's end: `}`, or with attributes, as XLA:TPU ends a SparseCore's
# computations (`}, execution_thread="sparsecore"`)
_CLOSING = re.compile(r"^\s*\}\s*(,\s*\w+=.*)?$")


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
    tables: dict[str, dict[int, str]] = {}
    table: dict[int, str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("HloModule"):
            devices = _device_count(line) or devices
            continue
        if current is None and line.strip() in _TABLES:
            table = tables.setdefault(line.strip(), {})
            continue
        if current is None and table is not None:
            row = re.match(r"^(\d+) (.*)$", line)
            if row is not None:
                table[int(row.group(1))] = row.group(2)
                continue
            table = None
        if current is None:
            header = _HEADER.match(line)
            if header is not None:
                current, name, root = [], header["name"], ""
                if header["entry"]:
                    entry = name
            elif _INSTRUCTION.match(line):
                where = Instruction("", (), "", (), {}, number, line)
                raise unreadable(where, "it is an instruction outside any computation")
            continue
        if _CLOSING.match(line):
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
    return Module(computations, entry, instructions, devices, _frames(tables))


_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _frames(tables: dict[str, dict[int, str]]) -> dict[int, tuple[Frame, int]]:
    """Each stack frame by id: its frame and its parent's id (0: none). XLA prints a
    frame's parent one above its id (`parent_frame_id=1`: none; 2: frame 1)."""
    files = {k: _unquoted(v) for k, v in tables.get("FileNames", {}).items()}
    functions = {k: _unquoted(v) for k, v in tables.get("FunctionNames", {}).items()}
    locations: dict[int, Frame] = {}
    for k, v in tables.get("FileLocations", {}).items():
        fields = dict(re.findall(r"(\w+)=(\d+)", v))
        locations[k] = Frame(
            files.get(int(fields.get("file_name_id", 0)), ""),
            int(fields.get("line", 0)),
            functions.get(int(fields.get("function_name_id", 0)), ""),
        )
    frames: dict[int, tuple[Frame, int]] = {}
    for k, v in tables.get("StackFrames", {}).items():
        fields = dict(re.findall(r"(\w+)=(\d+)", v))
        location = locations.get(int(fields.get("file_location_id", 0)))
        if location is not None:
            frames[k] = (location, int(fields.get("parent_frame_id", 0)) - 1)
    return frames


def _unquoted(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


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
        raise unreadable(bare, "it is not an instruction `%name = shape opcode(operands)`")
    rest = _COMMENT.sub("", found["rest"])
    bare = dataclasses.replace(bare, name=found["name"])
    shape, at = _shape(rest, 0, bare)
    opcode = _OPCODE.match(rest, at)
    if opcode is None:
        raise unreadable(bare, "no opcode follows its shape")
    close = _closing(rest, opcode.end() - 1)
    if close < 0:
        raise unreadable(bare, "its operand list is not closed")
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
                raise unreadable(where, "its tuple shape is not closed")
            part, at = _shape(text, at, where)
            parts.append(part)
    found = _ARRAY.match(text, at)
    if found is None:
        raise unreadable(where, f"its shape {text[at : at + 40]!r} is not one eqshard reads")
    dtype = found["dtype"]
    if dtype not in DTYPE_BITS:
        raise unreadable(
            where,
            f"the dtype `{dtype}` is not one eqshard knows (it knows {', '.join(DTYPE_BITS)})",
        )
    dims = []
    for dim in found["dims"].split(","):
        dim = dim.strip().removeprefix("<=")
        if not dim:
            continue
        if not dim.isdigit():
            raise unreadable(where, f"the dim `{dim}` of its shape has no size eqshard can read")
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
