"""Where a collective's data comes from and goes to, read from a module's dataflow
(`Flow`): its operand followed back through ops that only move or retype data
(`origin`: an entry parameter, a matrix product, ...), its result followed forward
to the entry's outputs through elementwise work (`outputs`), whether the step slices
it (`sliced`), and whether it runs in a `while` loop's body (`in_loop`). XLA:TPU's
fusions are read through: a fused collective's operand is the fusion's, its result
where the fusion (or its async chain's done) gives it.
"""

from __future__ import annotations

import re

from ._calls import calls_of
from ._collectives import chain_id
from ._parse import Array, Instruction, Module

__all__ = ["GATHERS", "PRODUCTS", "REDUCES", "Flow"]

PRODUCTS = ("dot", "convolution")
# Ops that move or retype their one operand's data and compute nothing.
_MOVES = {
    "bitcast",
    "bitcast-convert",
    "convert",
    "copy",
    "copy-start",
    "copy-done",
    "reshape",
    "transpose",
    "get-tuple-element",
    "all-gather-done",
    "all-reduce-done",
    "collective-permute-done",
}
# Ops past which a value is no longer the collective's data, elementwise: products,
# reductions and calls (a gradient feeds its update elementwise; an activation feeds
# a gradient only through a product or a sum over the batch).
_MIXES = {
    *PRODUCTS,
    "reduce",
    "reduce-window",
    "custom-call",
    "while",
    "call",
    "conditional",
}
GATHERS = ("gather",)
REDUCES = ("reduce", "reduce-window")
_SLICES = {"slice", "dynamic-slice"}
_COLLECTIVE = re.compile(r"all-|collective-|reduce-scatter")
_REDUCING = re.compile(r"all-reduce|reduce-scatter")
_STILL = _MOVES | {"parameter", "constant", "tuple"}  # what a fusion that moves holds


class Flow:
    """A module's dataflow: each instruction's users, and what fused computations
    hold."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self.users: dict[str, list[Instruction]] = {}
        self.callers: dict[str, list[Instruction]] = {}
        for instruction in module.instructions.values():
            for operand in instruction.operands:
                self.users.setdefault(operand, []).append(instruction)
            for call in calls_of(module, instruction):
                self.callers.setdefault(call.callee, []).append(instruction)

    def holds(self, instruction: Instruction, opcodes: set[str] | tuple[str, ...]) -> bool:
        """Whether `instruction` is one of `opcodes`, or a fusion that holds one."""
        return self.inner(instruction, opcodes) is not None

    def inner(
        self, instruction: Instruction, opcodes: set[str] | tuple[str, ...]
    ) -> Instruction | None:
        """`instruction` where it is one of `opcodes`; for a fusion, the one of them
        it holds nearest its root (a gather whose rows a fusion then sums: the sum);
        `None` where it holds none."""
        if instruction.opcode in opcodes:
            return instruction
        if instruction.opcode != "fusion":
            return None
        for call in calls_of(self.module, instruction):
            computation = self.module.computations.get(call.callee)
            if computation is None:
                continue
            by_name = {i.name: i for i in computation.instructions}
            frontier, seen = [computation.root], {computation.root}
            while frontier:
                later = []
                for name in frontier:
                    at = by_name.get(name)
                    found = self.inner(at, opcodes) if at is not None else None
                    if found is not None:
                        return found
                    for operand in at.operands if at is not None else ():
                        if operand not in seen:
                            seen.add(operand)
                            later.append(operand)
                frontier = later
        return None

    def product(self, instruction: Instruction | None) -> Instruction | None:
        """The matrix product whose output `instruction` is: itself, or for a fusion
        the product its root comes from through elementwise work only (XLA:TPU fuses
        a matmul with its neighbours: a bias added to its output is still its output,
        a sum of it over the batch is not); `None` where there is none."""
        if instruction is None or instruction.opcode in PRODUCTS:
            return instruction
        stack, seen = [instruction.name], {instruction.name}
        while stack:
            at = self.module.instructions.get(stack.pop())
            if at is None or at.opcode in _MIXES or _COLLECTIVE.search(at.opcode):
                continue
            if at.opcode == "tuple":  # several outputs: which is meant, `_element` says
                continue
            later = list(at.operands)
            if at.opcode == "fusion":  # on from its root, inside
                later = [
                    c.root
                    for call in calls_of(self.module, at)
                    if (c := self.module.computations.get(call.callee)) is not None
                ]
            for name in later:
                found = self.module.instructions.get(name)
                if found is not None and found.opcode in PRODUCTS:
                    return found
                if name not in seen and found is not None and found.opcode != "parameter":
                    seen.add(name)
                    stack.append(name)
        return None

    def products_behind(self, name: str, depth: int = 6) -> list[Instruction]:
        """The matrix products nearest behind `name`'s data: back through any op but
        a collective, at most `depth` ops back (a softmax's logits, past the
        subtraction of their max)."""
        found: list[Instruction] = []
        frontier, seen = [name], {name}
        for _ in range(depth):
            later = []
            for at in frontier:
                instruction = self.module.instructions.get(at)
                if instruction is None or instruction.opcode == "parameter":
                    continue
                if self.holds(instruction, PRODUCTS):
                    found.append(instruction)
                    continue
                if _COLLECTIVE.search(instruction.opcode):
                    continue
                for operand in instruction.operands:
                    if operand not in seen and self._is_computed(operand):
                        seen.add(operand)
                        later.append(operand)
            frontier = later
            if found:
                break
        return found

    def feeding(
        self, instruction: Instruction, held: Instruction, operand: int = 0
    ) -> list[Instruction]:
        """What feeds `held`'s operand number `operand` (by default the array a gather
        or a reduction reads): where `instruction` is `held`, that operand; where
        `instruction` is a fusion that holds it, the fusion's operands whose data
        reaches it there."""
        if instruction is held:
            name = held.operands[operand] if operand < len(held.operands) else ""
            found = self.module.instructions.get(name)
            return [found] if found is not None else []
        by_name = {}
        for call in calls_of(self.module, instruction):
            computation = self.module.computations.get(call.callee)
            by_name.update({i.name: i for i in computation.instructions} if computation else {})
        numbers: set[int] = set()
        stack = list(held.operands[operand : operand + 1])
        seen = set(stack)
        while stack:
            at = by_name.get(stack.pop())
            if at is None:
                continue
            if at.opcode == "parameter" and at.operands and at.operands[0].isdigit():
                numbers.add(int(at.operands[0]))
            for name in at.operands:
                if name not in seen:
                    seen.add(name)
                    stack.append(name)
        return [
            found
            for k in sorted(numbers)
            if k < len(instruction.operands)
            and (found := self.module.instructions.get(instruction.operands[k])) is not None
            and self._is_computed(found.name)
        ]

    def reducer(self, collective: Instruction) -> str:
        """The opcode that a reducing collective combines its parts with (`add`,
        `maximum`): its `to_apply` computation's root; "" where it has none."""
        name = collective.attributes.get("to_apply", "").strip().lstrip("%")
        computation = self.module.computations.get(name)
        root = self.module.instructions.get(computation.root) if computation else None
        return root.opcode if root is not None else ""

    def products_fed(self, name: str, depth: int = 8) -> list[Instruction]:
        """The matrix products that `name`'s data reaches, forward through ops that
        move it or work on it elementwise, and collectives that only move it (not past
        a reduction, a call, an all-reduce), at most `depth` ops on."""
        found: list[Instruction] = []
        frontier, seen = [name], {name}
        for _ in range(depth):
            later = []
            for at in frontier:
                for user in self.users.get(at, []):
                    if user.name in seen:
                        continue
                    seen.add(user.name)
                    if self.holds(user, PRODUCTS):
                        found.append(user)
                    elif not (self.holds(user, _MIXES) or _REDUCING.search(user.opcode)):
                        later.append(user.name)  # past a collective that only moves data
            frontier = later
        return found

    def _moves(self, instruction: Instruction) -> bool:
        """Whether it only moves or retypes one operand: a copy, a reshape, a
        fusion of one array that computes nothing."""
        if instruction.opcode in _MOVES:
            return True
        if instruction.opcode != "fusion":
            return False
        arrays = [o for o in instruction.operands if self._is_computed(o)]
        inner = [
            i
            for call in calls_of(self.module, instruction)
            if call.callee in self.module.computations
            for i in self.module.computations[call.callee].instructions
        ]
        return len(arrays) == 1 and all(i.opcode in _STILL for i in inner)

    def _is_computed(self, name: str) -> bool:
        found = self.module.instructions.get(name)
        return found is not None and found.opcode not in ("constant", "partition-id", "iota")

    def origin(self, name: str) -> Instruction | None:
        """The instruction `name`'s data comes from, past ops that only move it."""
        seen: set[str] = set()
        found = self.module.instructions.get(name)
        while found is not None and found.name not in seen:
            seen.add(found.name)
            called = self._called_with(found) or self._element(found)
            if called is not None:  # a fused collective's operand; a fusion's one output
                found = called
                continue
            if not self._moves(found):
                break
            arrays = [o for o in found.operands if self._is_computed(o)]
            found = self.module.instructions.get(arrays[0]) if arrays else None
        return found

    def _element_of(self, instruction: Instruction) -> tuple[Instruction | None, int]:
        """For a `get-tuple-element`, the tuple it reads and the index; else `(None, 0)`."""
        if instruction.opcode != "get-tuple-element" or not instruction.operands:
            return None, 0
        index = re.match(r"\s*(\d+)", instruction.attributes.get("index", ""))
        if index is None:
            return None, 0
        return self.module.instructions.get(instruction.operands[0]), int(index[1])

    def _element(self, instruction: Instruction) -> Instruction | None:
        """For a `get-tuple-element` of a fusion whose root is a tuple (XLA:TPU fuses
        several outputs into one: a bias's gradient beside an activation's), what
        the root holds at that index, inside the fused computation; else `None`."""
        fusion, k = self._element_of(instruction)
        if fusion is None or fusion.opcode != "fusion":
            return None
        calls = calls_of(self.module, fusion)
        computation = self.module.computations.get(calls[0].callee) if len(calls) == 1 else None
        root = self.module.instructions.get(computation.root) if computation else None
        if root is None or root.opcode != "tuple" or k >= len(root.operands):
            return None
        return self.module.instructions.get(root.operands[k])

    def joined(self, name: str) -> Instruction | None:
        """Where `name`'s data is each device's part written into zeros (a
        `dynamic-update-slice` into a broadcast 0: XLA makes an all-gather of an
        all-reduce so), the part written; else `None`."""
        at = self.origin(name)
        if at is not None and at.opcode == "fusion":  # written in a fusion: its root
            calls = calls_of(self.module, at)
            computation = self.module.computations.get(calls[0].callee) if calls else None
            at = self.module.instructions.get(computation.root) if computation else None
        if at is None or at.opcode != "dynamic-update-slice" or len(at.operands) < 2:
            return None
        base = self.origin(at.operands[0])
        while base is not None and base.opcode == "broadcast" and base.operands:
            base = self.origin(base.operands[0])
        zero = base is not None and base.opcode == "constant" and base.operands[:1] == ("0",)
        return self.module.instructions.get(at.operands[1]) if zero else None

    def part_of(self, name: str) -> Instruction | None:
        """What `name`'s data is a part of: past any op of one array that neither
        multiplies, sums nor calls (a slice, a pad, elementwise work), to an entry
        parameter, a product, a collective, ..."""
        seen: set[str] = set()
        found = self.module.instructions.get(name)
        while found is not None and found.name not in seen:
            seen.add(found.name)
            carried = self._carried(found) or self._called_with(found) or self._passed(found)
            if carried is not None:  # a scan's stacked array read in its body, or a call's
                found = carried
                continue
            arrays = [
                o
                for o in found.operands
                if self._is_computed(o) and not self._scalar(o) and not self._mask(o)
            ]
            if found.opcode == "dynamic-slice" and found.operands:  # its offsets aside
                arrays = found.operands[:1]
            if found.opcode in ("parameter", "constant") or len(arrays) != 1:
                break
            if self.holds(found, _MIXES) or _COLLECTIVE.search(found.opcode):
                break
            found = self.module.instructions.get(arrays[0])
        return found

    def _mask(self, name: str) -> bool:
        """Whether `name` is an array of booleans: a mask that selects or zeroes
        another array's values (a split table's lookup zeroes the rows a device does
        not hold), not data of its own."""
        found = self.module.instructions.get(name)
        return found is not None and isinstance(found.shape, Array) and found.shape.dtype == "pred"

    def _scalar(self, name: str) -> bool:
        """Whether `name` is one number (a loop's counter, a slice's offset)."""
        found = self.module.instructions.get(name)
        return found is not None and isinstance(found.shape, Array) and not found.shape.dims

    def _carried(self, instruction: Instruction) -> Instruction | None:
        """For a `get-tuple-element` of a `while` body's parameter, what the loop was
        given at that index (the body reads the loop-carried tuple); else `None`."""
        tuple_, k = self._element_of(instruction)
        if tuple_ is None or tuple_.opcode != "parameter":
            return None
        body = self.computation_of(tuple_.name) or ""
        for loop in self.callers.get(body, []):
            if loop.opcode == "while" and loop.attributes.get("body", "").lstrip("%") == body:
                given = self.module.instructions.get(loop.operands[0]) if loop.operands else None
                if given is not None and given.opcode == "tuple" and k < len(given.operands):
                    return self.module.instructions.get(given.operands[k])
        return None

    def _passed(self, instruction: Instruction) -> Instruction | None:
        """For a `get-tuple-element` of a `while` loop's result that its body passes
        on unchanged (a scan's stacked weights, carried to the backward pass), what
        the loop was given at that index; for one its body writes a slice of per trip
        (a scan's stacked output, a layer's weight saved for the backward pass), what
        it writes; else `None`."""
        loop, k = self._element_of(instruction)
        if loop is None or loop.opcode != "while" or not loop.operands:
            return None
        body = self.module.computations.get(loop.attributes.get("body", "").lstrip("%"))
        root = self.module.instructions.get(body.root) if body is not None else None
        if root is None or root.opcode != "tuple" or k >= len(root.operands):
            return None
        passed = self.origin(root.operands[k])
        written = self.inner(passed, ("dynamic-update-slice",)) if passed is not None else None
        if passed is not None and written is not None:  # a scan's output, a slice per trip
            updates = [u for u in self.feeding(passed, written, 1) if not self._scalar(u.name)]
            return updates[0] if len(updates) == 1 else None
        if passed is None or self._carried(passed) is None:
            return None
        at = re.match(r"\s*(\d+)", passed.attributes.get("index", ""))
        return self._carried(passed) if at is not None and int(at[1]) == k else None

    def _called_with(self, instruction: Instruction) -> Instruction | None:
        """For a parameter of a computation one `call` or one `fusion` calls (not the
        entry's, not a loop body's), the caller's operand at its number (XLA:TPU
        fuses a collective with its neighbours: its operand is the fusion's); else
        `None`."""
        if instruction.opcode != "parameter" or not instruction.operands:
            return None
        owner = self.computation_of(instruction.name)
        callers = [c for c in self.callers.get(owner or "", []) if c.opcode in ("call", "fusion")]
        if owner == self.module.entry or len(callers) != 1 or not instruction.operands[0].isdigit():
            return None
        number = int(instruction.operands[0])
        operands = callers[0].operands
        return self.module.instructions.get(operands[number]) if number < len(operands) else None

    def outputs(self, name: str) -> set[int]:
        """The positions of the entry's outputs that `name`'s data reaches through
        elementwise work (not past a product, a reduction or a call), out of the
        `while` loops that hold it (a scan's body: its loop-carried tuple, then the
        loop's result at the same index)."""
        entry = self.module.computations.get(self.module.entry)
        if entry is None:
            return set()
        roots = {c.name: c.root for c in self.module.computations.values()}
        found: set[int] = set()
        stack, seen = [name], {name}
        while stack:
            at = stack.pop()
            for user in self.users.get(at, []):
                owner = self.computation_of(user.name)
                if owner is not None and user.name == roots.get(owner):
                    places = (
                        {k for k, o in enumerate(user.operands) if o == at}
                        if user.opcode == "tuple"
                        else {0}
                    )
                    if owner == entry.name:
                        found |= places
                    else:  # a loop body's result, a fusion's: on past it, at the same places
                        for out in self._loop_results(owner, places) + self._fused_results(
                            owner, places
                        ):
                            if out.name not in seen:
                                seen.add(out.name)
                                stack.append(out.name)
                    continue
                if user.name in seen or self.holds(user, _MIXES):
                    continue
                seen.add(user.name)
                if isinstance(user.shape, tuple) and user.opcode not in ("tuple", "fusion"):
                    # a collective of several arrays (not an async `-start`, whose
                    # `-done` reads it whole): on only from this one's element
                    places = {k for k, o in enumerate(user.operands) if o == at}
                    for element in self.users.get(user.name, []):
                        index = re.match(r"\s*(\d+)", element.attributes.get("index", ""))
                        own = index is not None and int(index[1]) in places
                        if (
                            element.opcode == "get-tuple-element"
                            and own
                            and element.name not in seen
                        ):
                            seen.add(element.name)
                            stack.append(element.name)
                    if not user.opcode.endswith("-start"):
                        continue
                stack.append(user.name)
        return found

    def _loop_results(self, body: str, places: set[int]) -> list[Instruction]:
        """The `get-tuple-element`s at `places` of each `while` loop whose body is
        `body`."""
        found = []
        for loop in self.callers.get(body, []):
            if loop.opcode != "while" or loop.attributes.get("body", "").lstrip("%") != body:
                continue
            found += self._elements_at(loop.name, places)
        return found

    def _fused_results(self, fused: str, places: set[int]) -> list[Instruction]:
        """What the `fusion` that calls `fused` gives at `places` of its root: its
        `get-tuple-element`s there where the root is a tuple, else itself."""
        computation = self.module.computations.get(fused)
        root = self.module.instructions.get(computation.root) if computation else None
        found = []
        for fusion in self.callers.get(fused, []):
            if fusion.opcode != "fusion":
                continue
            if root is None or root.opcode != "tuple":
                found.append(fusion)
                continue
            found += self._elements_at(fusion.name, places)
        return found

    def _elements_at(self, name: str, places: set[int]) -> list[Instruction]:
        """The `get-tuple-element`s of `name` at `places`."""
        found = []
        for user in self.users.get(name, []):
            tuple_, k = self._element_of(user)
            if tuple_ is not None and tuple_.name == name and k in places:
                found.append(user)
        return found

    def finished(self, collective: Instruction) -> Instruction | None:
        """For a collective in XLA:TPU's async collective fusions (the pieces of one
        `chain_id`), the fusion whose computation ends it (its root the
        `AsyncCollectiveDone` custom call): the collective's result where the step
        goes on; else `None`."""
        chain = chain_id(collective)
        if chain is None:
            return None
        for piece in self.module.instructions.values():
            if piece.opcode != collective.opcode or chain_id(piece) != chain:
                continue
            owner = self.module.computations.get(self.computation_of(piece.name) or "")
            root = self.module.instructions.get(owner.root) if owner is not None else None
            done = (
                root is not None
                and root.opcode == "custom-call"
                and root.attributes.get("custom_call_target") == '"AsyncCollectiveDone"'
                and piece.name in root.operands
            )
            fusions = (
                [f for f in self.callers.get(owner.name, []) if f.opcode == "fusion"]
                if done and owner
                else []
            )
            if len(fusions) == 1:
                return fusions[0]
        return None

    def sliced(self, name: str) -> bool:
        """Whether the step slices `name`'s data (past ops that only move it): a
        `slice`, a `dynamic-slice`, or a fusion that holds one."""
        stack, seen = [name], {name}
        while stack:
            for user in self.users.get(stack.pop(), []):
                if self.holds(user, _SLICES):
                    return True
                if user.name not in seen and self._moves(user):
                    seen.add(user.name)
                    stack.append(user.name)
        return False

    def in_loop(self, computation: str) -> bool:
        """Whether `computation` runs in a `while` loop's body, called from it or
        from what it calls."""
        stack, seen = [computation], {computation}
        while stack:
            for caller in self.callers.get(stack.pop(), []):
                if caller.opcode == "while":
                    return True
                owner = self.computation_of(caller.name)
                if owner is not None and owner not in seen:
                    seen.add(owner)
                    stack.append(owner)
        return False

    def computation_of(self, name: str) -> str | None:
        """The computation that holds the instruction `name`."""
        if not hasattr(self, "_owners"):
            self._owners = {
                i.name: c.name for c in self.module.computations.values() for i in c.instructions
            }
        return self._owners.get(name)
