"""The call graph of an HLO module: which computations each instruction calls
(`calls_of`), a `while` loop's trip count (`trip_count`, written by XLA or read from
the loop), how many times one run of the entry runs each computation (`runs`), and
the computations inside a loop whose trip count depends on values
(`value_dependent`, each with its loop as `loop_name` names it).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

from ._parse import Computation, Instruction, Module

__all__ = ["Call", "calls_of", "loop_name", "runs", "trip_count", "value_dependent"]


@dataclasses.dataclass(frozen=True)
class Call:
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


def calls_of(module: Module, instruction: Instruction) -> list[Call]:
    """The computations an instruction calls, with how often."""
    a = instruction.attributes
    if instruction.opcode == "while":
        trips = trip_count(module, instruction)
        times = trips if trips is not None else 1
        return [Call(_names(a["body"])[0], times), Call(_names(a["condition"])[0], times + 1)]
    if instruction.opcode == "conditional":
        if "branch_computations" in a:
            branches = tuple(_names(a["branch_computations"]))
        else:
            branches = tuple(_names(a["true_computation"]) + _names(a["false_computation"]))
        return [Call(b, 1, branches) for b in branches]
    if instruction.opcode in _NOT_CALLING:
        return []
    return [Call(name, 1) for key in _CALLEES if key in a for name in _names(a[key])]


def trip_count(module: Module, loop: Instruction) -> int | None:
    """A `while` loop's trip count, where it is known: XLA:CPU and XLA:GPU write it
    in the loop's backend config (`known_trip_count`); XLA:TPU does not, and it is
    read from the loop as XLA's own analysis reads it: the condition compares an
    element of the loop's tuple with a constant, the loop starts it at a constant
    and the body adds a constant to it (`jax.lax.scan` and `fori_loop` loops).
    None for a loop whose trip count depends on values."""
    found = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', loop.backend_config)
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
        name: [call for i in c.instructions for call in calls_of(module, i)]
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


def _callees_first(entry: str, calls: Mapping[str, list[Call]]) -> list[str]:
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


def value_dependent(module: Module) -> dict[str, str]:
    """The computations that run inside a `while` loop whose trip count depends on
    values (neither XLA nor the loop's own counter says it: an adaptive ODE
    solver's steps, a fixed-point iteration), each with that loop (the outermost
    such, as `loop_name` gives it). What they hold runs an unknown number of times
    per step: `runs` counts it once per trip of that loop."""
    calls = {
        name: [(i, call) for i in c.instructions for call in calls_of(module, i)]
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
