"""Why each collective of a compiled step moves what it moves (`explain`), from the
HLO's dataflow (`_hlo/_dataflow.py`) and the names of the step's argument leaves: a
gradient summed over the batch's axes, a split weight gathered before use (and
sliced after), a matmul's output summed over its split contracting dim, a pipeline's
activations passed on; else "eqshard cannot tell". No JAX is imported here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from ._hlo._collectives import CollectiveOp
from ._hlo._dataflow import PRODUCTS, Flow
from ._hlo._parse import Instruction, Module
from ._results import UNKNOWN, Collective, Explained

__all__ = ["argument_index", "explain"]


def argument_index(op_name: str) -> tuple[str, int] | None:
    """Which argument leaf an entry parameter is, from its op name as `eqx.filter_jit`
    lowers it: `("first", 2)` for `dynamic_nodonate['first'][2]` (the model's leaf 2),
    `("rest", 9)` for the other arguments' leaf 9; `None` for any other name."""
    found = re.search(r"\[\\?'(first|rest)\\?'\]\[(\d+)\]", op_name)
    return (found.group(1), int(found.group(2))) if found else None


def explain(
    module: Module,
    ops: Sequence[CollectiveOp],
    found: Sequence[Collective],
    inputs: Mapping[tuple[str, int], str],
    outputs: Sequence[str],
    parameters: Sequence[str],
    is_user: Callable[[str], bool],
) -> tuple[Explained, ...]:
    """An `Explained` for each collective.

    **Arguments:**

    - `module`: the compiled step's HLO, parsed.
    - `ops`, `found`: its collectives, as `_hlo` reads them and as `Cost` holds them
        (the same order).
    - `inputs`: the name of each argument leaf, by `argument_index`.
    - `outputs`: the path of each of the step's outputs (`1.0.layers.0.weight`).
    - `parameters`: the model's parameters' names (`layers.0.weight`).
    - `is_user`: whether a file is the user's (a frame to name).

    **Returns:**

    A tuple of `Explained`, in the order of `found`.
    """
    flow = Flow(module)
    why = _Why(module, flow, inputs, outputs, parameters, is_user)
    return tuple(why.explained(op, c) for op, c in zip(ops, found))


class _Why:
    def __init__(
        self,
        module: Module,
        flow: Flow,
        inputs: Mapping[tuple[str, int], str],
        outputs: Sequence[str],
        parameters: Sequence[str],
        is_user: Callable[[str], bool],
    ) -> None:
        self.module, self.flow, self.inputs = module, flow, inputs
        self.outputs, self.parameters, self.is_user = outputs, parameters, is_user

    def where(self, instruction: Instruction | None) -> tuple[str, int]:
        """The user's frame that traced `instruction`, or `("", 0)`."""
        if instruction is None:
            return "", 0
        for frame in self.module.stack(instruction):
            if frame.file and self.is_user(frame.file):
                return frame.file, frame.line
        return "", 0

    def leaf(self, instruction: Instruction | None) -> str | None:
        """The argument leaf an entry parameter holds, or `None`."""
        if instruction is None or instruction.opcode != "parameter":
            return None
        if self.flow.computation_of(instruction.name) != self.module.entry:
            return None
        index = argument_index(instruction.op_name)
        return self.inputs.get(index) if index is not None else None

    def fed(self, result: str) -> list[str]:
        """The parameters whose update (or optimizer state) `result` feeds."""
        reached = [self.outputs[k] for k in self.flow.outputs(result) if k < len(self.outputs)]
        return [p for p in self.parameters if any(o == p or o.endswith(f".{p}") for o in reached)]

    def parts(self, c: Instruction) -> list[tuple[str, str]]:
        """(operand, result) for each value a collective moves: a tuple collective's
        by `get-tuple-element`, an async one's result by its `-done`."""
        users = self.flow.users.get(c.name, [])
        if isinstance(c.shape, tuple) and not c.opcode.endswith("-start"):
            by_index = {}
            for user in users:
                if user.opcode == "get-tuple-element":
                    index = re.match(r"\s*(\d+)", user.attributes.get("index", ""))
                    if index:
                        by_index[int(index.group(1))] = user.name
            return [(o, by_index.get(k, "")) for k, o in enumerate(c.operands)]
        done = [u.name for u in users if u.opcode.endswith("-done")]
        return [(o, done[0] if done else c.name) for o in c.operands[:1]]

    def value(self, instruction: Instruction) -> str:
        """What a collective's first operand is a part of, in words."""
        part = self.flow.part_of(instruction.operands[0]) if instruction.operands else None
        if part is not None and self.flow.holds(part, PRODUCTS):
            file, line = self.where(part)
            return f"the output of the matmul at {file}:{line}" if file else "a matmul's output"
        return "a value"

    def explained(self, op: CollectiveOp, c: Collective) -> Explained:
        instruction = self.module.instructions.get(op.name)
        if instruction is None:
            return Explained(c, "", 0, (), f"{UNKNOWN} where its data comes from")
        file, line = self.where(instruction)
        parts = self.parts(instruction)
        origins = [self.flow.origin(operand) for operand, _ in parts]
        if not file:
            for origin in origins:
                file, line = self.where(origin)
                if file:
                    break
        if not file:  # a gathered parameter (JAX 0.12 keeps the parameter's metadata):
            file, line = self.used_at([result or instruction.name for _, result in parts])
        if not file:
            computation = self.flow.computation_of(instruction.name) or ""
            callers = self.flow.callers.get(computation, [])
            if len(callers) == 1:
                file, line = self.where(callers[0])
        axes = " and ".join(f"`{a}`" for a in c.axes) or "its devices"
        leaves, reason = self.reason(c, instruction, parts, origins, axes)
        return Explained(c, file, line, leaves, reason)

    def used_at(self, names: list[str], depth: int = 4) -> tuple[str, int]:
        """The user's line where the step first uses what `names` hold, past ops that
        record none (a copy, a bitcast), at most `depth` ops on; `("", 0)` if none."""
        frontier, seen = list(names), set(names)
        for _ in range(depth):
            later = []
            for name in frontier:
                for user in self.flow.users.get(name, []):
                    file, line = self.where(user)
                    if file:
                        return file, line
                    if user.name not in seen:
                        seen.add(user.name)
                        later.append(user.name)
            frontier = later
        return "", 0

    def reason(
        self,
        c: Collective,
        instruction: Instruction,
        parts: list[tuple[str, str]],
        origins: list[Instruction | None],
        axes: str,
    ) -> tuple[tuple[str, ...], str]:
        in_loop = self.flow.in_loop(self.flow.computation_of(instruction.name) or "")
        if c.kind == "collective-permute" and in_loop:
            return (), "the pipeline passes activations to the next stage"
        if c.kind in ("all-reduce", "reduce-scatter"):
            fed = list(dict.fromkeys(p for _, result in parts if result for p in self.fed(result)))
            if fed:
                names = ", ".join(f"`{p}`" for p in fed)
                which = "gradient" if len(fed) == 1 else "gradients"
                verb = "is" if len(fed) == 1 else "are"
                return tuple(fed), f"the {which} of {names} {verb} summed over {axes}"
            products = [o for o in origins if o is not None and self.flow.holds(o, PRODUCTS)]
            if products:
                file, line = self.where(products[0])
                at = f" at {file}:{line}" if file else ""
                weights = tuple(
                    dict.fromkeys(
                        name
                        for o in products[0].operands
                        if (name := self.leaf(self.flow.origin(o))) is not None
                    )
                )
                return weights, (
                    f"the output of the matmul{at} is summed over {axes}: its contracting "
                    "dim is split"
                )
        if c.kind in ("collective-permute", "all-to-all") and _slices(c.source):
            pieces = [self.leaf(self.flow.part_of(operand)) for operand, _ in parts]
            leaves = tuple(dict.fromkeys(n for n in pieces if n))
            names = ", ".join(f"`{n}`" for n in leaves) or self.value(instruction)
            return leaves, (
                f"{names} is split over {axes} and the step slices it across the split's "
                "boundaries (a fused qkv cut into q, k, v): its parts move between devices"
            )
        named = [self.leaf(o) for o in origins]
        if c.kind == "all-gather" and not (named and all(named)):  # a layer of a scanned stack
            named = [self.leaf(self.flow.part_of(operand)) for operand, _ in parts]
        if c.kind == "all-gather" and not (named and all(named)):
            fed = list(dict.fromkeys(p for _, result in parts if result for p in self.fed(result)))
            if fed:  # the update made split (ZeRO-1's split optimizer state), held whole
                names = ", ".join(f"`{p}`" for p in fed)
                return tuple(fed), (
                    f"the update of {names} is made split over {axes}, and the model holds "
                    "it whole: gathered after the update"
                )
        if named and all(named):
            leaves = tuple(dict.fromkeys(n for n in named if n))
            names = ", ".join(f"`{n}`" for n in leaves)
            if c.kind == "all-gather":
                reason = (
                    f"{names} is split over {axes} and the step uses it whole: gathered before use"
                )
                if any(self.flow.sliced(result) for _, result in parts if result):
                    reason += ", and the step slices it: all-gather before the slice"
                return leaves, reason
            return leaves, f"{c.kind} of {names} over {axes}"
        source = c.brief_source or "an op XLA does not name"
        return (), f"{UNKNOWN} which leaf: its data comes from {source}"


def _slices(source: str) -> bool:
    """Whether an op name is a slice's or a split's (`jit(step)/split`)."""
    last = source.rsplit("/", 1)[-1]
    return last in ("split", "slice", "dynamic_slice") or last.startswith("split")
