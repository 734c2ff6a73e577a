"""Why each collective of a compiled step moves what it moves (`explain`), from the
HLO's dataflow (`_hlo/_dataflow.py`) and the names of the step's argument leaves: a
gradient summed over the batch's axes, a split weight gathered before use (and
sliced after), a matmul's output summed over its split contracting dim (in the
backward pass, its input's gradient over its split output dim), a gather or a
reduction over a split dim, an activation gathered for a split weight's matmul, a
split array sliced across its parts (and its slices' gradients joined), a matmul's
output moved for a matmul that needs it laid out otherwise, an all-gather made of an
all-reduce (each device's part written into zeros), a pipeline's activations passed
on; else "eqshard cannot tell". No JAX is imported here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from ._hlo._collectives import CollectiveOp
from ._hlo._dataflow import GATHERS, PRODUCTS, REDUCES, Flow
from ._hlo._parse import Instruction, Module
from ._results import UNKNOWN, Collective, Explained, brief_source

__all__ = ["argument_index", "explain"]

_RING = "eqshard/_ring_attention.py"  # `eqshard.parallel.ring_attention`'s permutes


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
    is_caller: Callable[[str], bool] = lambda file: False,
    pipelined: bool = False,
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
    - `is_caller`: whether a frame is the caller's of the compile (`cost`'s own):
        no frame from it outwards traced the step, so none is named.
    - `pipelined`: whether the step runs `eqshard.parallel.pipeline`, whose loop
        passes activations from stage to stage with permutes.

    **Returns:**

    A tuple of `Explained`, in the order of `found`.
    """
    flow = Flow(module)
    why = _Why(module, flow, inputs, outputs, parameters, is_user, is_caller, pipelined)
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
        is_caller: Callable[[str], bool],
        pipelined: bool,
    ) -> None:
        self.module, self.flow, self.inputs = module, flow, inputs
        self.outputs, self.parameters, self.is_user = outputs, parameters, is_user
        self.is_caller, self.pipelined = is_caller, pipelined

    def traced_by(self, instruction: Instruction, file: str) -> bool:
        """Whether a frame of `file` (eqshard's own, such as `_RING`) traced it."""
        return any(
            frame.file.replace("\\", "/").endswith(file) for frame in self.module.stack(instruction)
        )

    def where(self, instruction: Instruction | None) -> tuple[str, int]:
        """The user's frame that traced `instruction`, or `("", 0)`."""
        if instruction is None:
            return "", 0
        for frame in self.module.stack(instruction):  # innermost first
            if frame.file and self.is_caller(frame.file):
                break
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
        finished = self.flow.finished(c)  # XLA:TPU's async collective fusion's end
        if finished is not None:
            done = [finished.name]
        return [(o, done[0] if done else c.name) for o in c.operands[:1]]

    def sliced(
        self, parts: list[tuple[str, str]], instruction: Instruction
    ) -> tuple[tuple[str, ...], str]:
        """The leaves a sliced value is, or is made of (a matmul's weight, a bias
        added to its output), and the value in words."""
        pieces = [self.leaf(self.flow.part_of(operand)) for operand, _ in parts]
        leaves = tuple(dict.fromkeys(n for n in pieces if n))
        if leaves:
            return leaves, ", ".join(f"`{n}`" for n in leaves)
        found: list[str] = []
        products: list[Instruction] = []
        for operand, _ in parts:
            part = self.flow.part_of(operand)
            for name in part.operands if part is not None else ():
                origin = self.flow.origin(name)
                if origin is not None and self.flow.holds(origin, PRODUCTS):
                    products.append(origin)
                    found += self.weights(origin)
                elif (leaf := self.leaf(origin)) is not None:
                    found.append(leaf)
        if not products:
            return (), self.value(instruction)
        file, line = self.where(products[0])
        at = f" at {file}:{line}" if file else ""
        names = ", ".join(f"`{w}`" for w in self.weights(products[0]))
        of = f" of {names}" if names else ""
        return tuple(dict.fromkeys(found)), f"the output of the matmul{of}{at}"

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
        if c.kind == "collective-permute" and in_loop and self.pipelined:
            return (), "the pipeline passes activations to the next stage"
        if c.kind == "collective-permute" and in_loop and self.traced_by(instruction, _RING):
            return (), (
                f"ring attention passes each device's block of keys and values to the next "
                f"over {axes}, once a turn of the ring"
            )
        if c.kind in ("all-reduce", "reduce-scatter"):
            return self.summed(instruction, parts, axes)
        if c.kind in ("collective-permute", "all-to-all") and _slices(c.source):
            leaves, what = self.sliced(parts, instruction)
            return leaves, (
                f"{what} is split over {axes} and the step slices it across the split's "
                "boundaries (a fused qkv cut into q, k, v): its parts move between devices"
            )
        if c.kind in ("collective-permute", "all-to-all") and _joins(c.source):
            products = [p for _, r in parts if r for p in self.flow.products_fed(r)]
            # the forward matmul's weight, or the parameter whose gradient it makes
            leaves = tuple(
                dict.fromkeys(w for p in products for w in self.weights(p) or self.fed(p.name))
            )
            names = ", ".join(f"`{n}`" for n in leaves)
            into = f"the gradient of the output of the matmul of {names}" if names else "one array"
            return leaves, (
                f"in the backward pass, the gradients of slices are joined into {into}, "
                f"split over {axes} across the slices' boundaries (the transpose of a fused "
                "qkv's cut): its parts move between devices"
            )
        if c.kind in ("collective-permute", "all-to-all") and (
            moved := self.resharded(parts, axes)
        ):
            return moved
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
            products = [p for _, result in parts if result for p in self.flow.products_fed(result)]
            if products:  # an activation gathered for a matmul with a split weight
                return self.gathered_activation(products[0], axes)
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

    def resharded(
        self, parts: list[tuple[str, str]], axes: str
    ) -> tuple[tuple[str, ...], str] | None:
        """A matmul's output (or a part of it, or its sum over a split contracting
        dim) moved between devices for another matmul, which needs it laid out
        otherwise (8 kv heads on a 16-way axis: each device's part of a head moves
        to the devices whose heads it is); `None` where it is not."""
        made: list[Instruction] = []
        for operand, _ in parts:
            part = self.flow.part_of(operand)
            if part is not None and part.opcode in ("all-reduce", "all-reduce-done"):
                part = self.flow.part_of(part.operands[0]) if part.operands else None
            product = self.flow.product(part)
            if product is None:
                return None
            made.append(product)
        used = [p for _, result in parts if result for p in self.flow.products_fed(result)]
        if not made or not used:
            return None
        file, line = self.where(made[0])
        weights = self.weights(made[0])
        of = " of " + ", ".join(f"`{w}`" for w in weights) if weights else ""
        at = f" at {file}:{line}" if file else ""
        file, line = self.where(used[0])
        into = f" at {file}:{line}" if file else ""
        backward = "in the backward pass, " if "transpose(" in made[0].op_name else ""
        use = "the backward pass of " if "transpose(" in used[0].op_name else ""
        return weights, (
            f"{backward}the output of the matmul{of}{at} is laid out otherwise than "
            f"{use}the matmul{into} needs it: XLA moves its parts between devices over {axes}"
        )

    def summed(
        self, instruction: Instruction, parts: list[tuple[str, str]], axes: str
    ) -> tuple[tuple[str, ...], str]:
        """Why an all-reduce or a reduce-scatter sums what it sums, part by part (a
        tuple collective combines several): gradients; a matmul's output over its
        split contracting dim; a gather, or a reduction, over a split dim."""
        fed: list[str] = []
        products: dict[tuple[bool, str], list[Instruction]] = {}
        leaves: list[str] = []
        reasons: list[str] = []
        how = _COMBINES.get(self.flow.reducer(instruction), "combined")
        joined: list[str] = []  # updates, each device's part written into zeros
        gathered: list[str] = []  # parameters, so
        for operand, result in parts:
            written = self.flow.joined(operand)
            if written is not None:
                feeds = self.fed(result) if result else []
                own = self.leaf(self.flow.origin(written.name)) or self.leaf(
                    self.flow.part_of(written.name)
                )
                if feeds:
                    joined += feeds
                    continue
                if own is not None:
                    gathered.append(own)
                    continue
            product = self.flow.product(self.flow.origin(operand))
            if product is not None and self.weights(product):
                # a matmul with a parameter makes an activation (or, in the backward
                # pass, its gradient), never a parameter's gradient: not `fed`
                products.setdefault(self.matmul_key(product), []).append(product)
                continue
            feeds = self.fed(result) if result else []
            if feeds:
                fed += feeds
            elif product is not None:
                products.setdefault(self.matmul_key(product), []).append(product)
            elif (padded := self.flow.product(self.flow.part_of(operand))) is not None:
                # a matmul's output padded or sliced first (XLA:TPU pads what it scatters)
                products.setdefault(self.matmul_key(padded), []).append(padded)
            elif (found := self.part(operand, axes, how)) is not None:
                leaves += found[0]
                reasons.append(found[1])
            else:
                return (), self.unknown(instruction)
        for group in products.values():
            found = self.products_summed(group, axes, how)
            leaves += found[0]
            reasons.append(found[1])
        if gathered:
            gathered = list(dict.fromkeys(gathered))
            names = ", ".join(f"`{p}`" for p in gathered)
            verb, it = ("is", "it") if len(gathered) == 1 else ("are", "them")
            reasons.insert(
                0,
                f"{names} {verb} split over {axes} and the step uses {it} whole: gathered "
                f"before use, each device writing its part into zeros and the parts {how} "
                f"over {axes}, an all-gather made of an all-reduce",
            )
        if joined:
            joined = list(dict.fromkeys(joined))
            names = ", ".join(f"`{p}`" for p in joined)
            which = "update" if len(joined) == 1 else "updates"
            verb = "is" if len(joined) == 1 else "are"
            reasons.insert(
                0,
                f"the {which} of {names} {verb} made split over {axes}, and the model holds "
                f"{'it' if len(joined) == 1 else 'them'} whole: each device writes its part "
                f"into zeros and the parts are {how} over {axes}, an all-gather made of an "
                "all-reduce",
            )
        if fed:
            fed = list(dict.fromkeys(fed))
            names = ", ".join(f"`{p}`" for p in fed)
            which, verb = ("gradient", "is") if len(fed) == 1 else ("gradients", "are")
            reasons.insert(0, f"the {which} of {names} {verb} {how} over {axes}")
        found = fed + joined + gathered + leaves
        return tuple(dict.fromkeys(found)), "; ".join(dict.fromkeys(reasons))

    def matmul_key(self, product: Instruction) -> tuple[bool, str]:
        """Matmuls told apart in words: the backward pass's or not, and their line."""
        file, line = self.where(product)
        return "transpose(" in product.op_name, f"{file}:{line}" if file else ""

    def part(self, operand: str, axes: str, how: str) -> tuple[tuple[str, ...], str] | None:
        """Why one part of a reducing collective is reduced where it is neither a
        gradient nor a matmul's output: a gather from, or a reduction over, a dim
        split over `axes`; `(leaves, reason)`, or `None` where eqshard cannot tell."""
        holders = [self.flow.origin(operand), self.flow.part_of(operand)]
        found = [
            (at, held)
            for at in holders
            if at is not None and (held := self.flow.inner(at, (*GATHERS, *REDUCES)))
        ]
        if not found:
            return None
        holder, held = found[0]
        fn, backward = _function(held.op_name)
        file, line = self.where(held)
        at = f" at {file}:{line}" if file else ""
        sources = [s.name for s in self.flow.feeding(holder, held)]
        named = [self.leaf(self.flow.origin(s)) for s in sources]
        leaves = tuple(dict.fromkeys(n for n in named if n is not None))
        if named and all(named):  # leaves themselves, not an activation made of them
            what = ", ".join(f"`{n}`" for n in leaves)
        else:
            what, leaves = self.activation(sources)
        if held.opcode in GATHERS:
            by = f"`{fn}`" if fn else "a gather"
            return leaves, (
                f"{by}{at} gathers from {what}, split over {axes} along the dim it indexes: "
                f"each device gathers what it holds, {how} over {axes}"
            )
        kind = _REDUCED.get(self.flow.reducer(held), "reduction")
        if backward:
            of = f" in the backward pass of `{fn}`" if fn else " in the backward pass"
        else:
            of = f" in `{fn}`" if fn else ""
        return leaves, (
            f"the {kind}{of}{at} runs over a dim of {what} split over {axes}: each device "
            f"reduces its part, {how} over {axes}"
        )

    def products_summed(
        self, products: list[Instruction], axes: str, how: str
    ) -> tuple[tuple[str, ...], str]:
        """Matmuls' outputs (of one line) summed over their split contracting dim; in
        the backward pass, with weights among their operands, their inputs' gradients."""
        backward, at = self.matmul_key(products[0])
        at = f" at {at}" if at else ""
        weights = tuple(dict.fromkeys(w for p in products for w in self.weights(p)))
        many = len(products) > 1
        matmul = "matmuls" if many else "matmul"
        verb = "are" if many else "is"
        if not backward:
            outputs = "outputs" if many else "output"
            return weights, (
                f"the {outputs} of the {matmul}{at} {verb} {how} over {axes}: "
                f"{'their' if many else 'its'} contracting dim is split"
            )
        if weights:
            names = ", ".join(f"`{w}`" for w in weights)
            gradients = "gradients of the inputs" if many else "gradient of the input"
            return weights, (
                f"in the backward pass, the {gradients} of the {matmul} of {names}{at} {verb} "
                f"{how} over {axes}: {'each' if many else 'the'} matmul's output dim, which "
                "the backward contracts, is split"
            )
        outputs = "outputs" if many else "output"
        return weights, (
            f"in the backward pass, the {outputs} of the {matmul}{at} {verb} {how} over "
            f"{axes}: the dim {'they contract' if many else 'it contracts'} is split"
        )

    def weights(self, product: Instruction) -> tuple[str, ...]:
        """The model's parameters among a matmul's operands (through a scan's stack;
        not the batch)."""
        found = []
        inner = self.flow.inner(product, PRODUCTS) or product  # a fused matmul's own operands
        for operand in inner.operands:
            for at in (self.flow.origin(operand), self.flow.part_of(operand)):
                name = self.leaf(at)
                if name is not None:
                    found.append(name)
                    break
        return tuple(dict.fromkeys(n for n in found if n in self.parameters))

    def activation(self, names: list[str]) -> tuple[str, tuple[str, ...]]:
        """An activation in words (`an activation of the matmul at f.py:3`), and the
        weights of the matmul it comes from."""
        products = [p for n in names for p in self.flow.products_behind(n)]
        if not products:
            return "an activation", ()
        file, line = self.where(products[0])
        weights = self.weights(products[0])
        of = " of " + ", ".join(f"`{w}`" for w in weights) if weights else ""
        at = f" at {file}:{line}" if file else ""
        return f"an activation from the matmul{of}{at}", weights

    def gathered_activation(self, product: Instruction, axes: str) -> tuple[tuple[str, ...], str]:
        """An activation gathered whole for a matmul, with a weight split over the same
        axes (XLA moved the activation rather than the weight)."""
        file, line = self.where(product)
        at = f" at {file}:{line}" if file else ""
        weights = self.weights(product)
        backward = "the backward pass of " if "transpose(" in product.op_name else ""
        if weights:
            names = ", ".join(f"`{w}`" for w in weights)
            return weights, (
                f"an activation split over {axes} is gathered whole for {backward}the matmul"
                f"{at} with {names}, split over {axes} too: XLA moves the activation, not "
                "the weight"
            )
        return (), (
            f"an activation split over {axes} is gathered whole for {backward}the matmul{at}"
        )

    def unknown(self, instruction: Instruction) -> str:
        source = brief_source(instruction.op_name) or "an op XLA does not name"
        return f"{UNKNOWN} which leaf: its data comes from {source}"


_COMBINES = {
    "add": "summed",
    "maximum": "combined by max",
    "minimum": "combined by min",
    "multiply": "multiplied",
}
_REDUCED = {"add": "sum", "maximum": "max", "minimum": "min", "multiply": "product"}
_WRAPPERS = re.compile(
    r"^(?:jvp|vmap|transpose|jit|pjit|remat|checkpoint|custom_jvp_call|"
    r"custom_vjp_call|closed_call)\("
)
_PLACES = {"", "while", "body", "cond", "closed_call", "branch"}


def _function(op_name: str) -> tuple[str, bool]:
    """The innermost function an op's name names, and whether it is the backward
    pass: `jit(step)/transpose(jvp(jit(log_softmax)))/reduce_sum` is
    `("log_softmax", True)`; `""` where only the step is named."""
    backward = "transpose(" in op_name
    for part in reversed(op_name.split("/")[1:-1]):
        name = part
        while (stripped := _WRAPPERS.sub("", name)) != name:
            name = stripped
        name = name.strip("()")
        if name not in _PLACES:
            return name, backward
    return "", backward


def _joins(source: str) -> bool:
    """Whether an op name is the backward pass's join of slices (a `concatenate`
    under `transpose(...)`: a split's transpose)."""
    return "transpose(" in source and source.rsplit("/", 1)[-1] == "concatenate"


def _slices(source: str) -> bool:
    """Whether an op name is a slice's or a split's (`jit(step)/split`)."""
    last = source.rsplit("/", 1)[-1]
    return last in ("split", "slice", "dynamic_slice") or last.startswith("split")
