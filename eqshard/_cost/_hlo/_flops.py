"""The FLOPs of the matrix products in an HLO module (`flops`): `dot`, a `reduce`
XLA rewrote a product into, `convolution` (counting only the taps that meet the
input, as XLA does), cuBLAS and cuDNN calls and Pallas kernels' own estimates; and
of them, those inside a loop whose trip count depends on values
(`value_dependent_flops`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ._calls import runs, value_dependent
from ._parse import Array, Instruction, Module, Shape, unreadable

__all__ = ["flops", "value_dependent_flops"]


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
        raise unreadable(instruction, "a matrix product's sum over a tuple of arrays")
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
            raise unreadable(instruction, f"the `{target}` call has no dot_dimension_numbers")
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
        raise unreadable(
            instruction,
            f"the call `{target}` looks like a matrix product, and eqshard does not know its "
            f"FLOPs (it reads `dot`, `convolution`, {', '.join(_GEMMS)} and "
            f"{', '.join(_CONVOLUTIONS)})",
        )
    return 0  # a kernel without an estimate (LAPACK): XLA's own analysis counts none either


def _json(instruction: Instruction) -> object:
    """An instruction's backend config, read as JSON where it is JSON, else None."""
    text = instruction.backend_config
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
        raise unreadable(instruction, f"its dim_labels `{labels}` do not label its kernel")
    features = kernel.dims[kernel_labels.index("o")]
    every = 2 * math.prod(out.dims) * math.prod(kernel.dims) // max(features, 1)
    window = instruction.attributes.get("window")
    if lhs is None or window is None:
        return every
    spatial = sorted(c for c in kernel_labels if c.isdigit())
    if len(lhs_labels) != len(lhs.dims) or len(out_labels) != len(out.dims):
        raise unreadable(instruction, f"its dim_labels `{labels}` do not label its operands")
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
            raise unreadable(instruction, f"its window's `{item}` has not {rank} dims")
        if name == "pad":
            pads = [tuple(int(v) for v in part.split("_")) for part in parts]
            fields["pad"] = [(lo, hi) for lo, hi in pads]
        elif name in fields or name == "size":
            fields[name] = [int(v) for v in parts]
        elif name != "rhs_reversal":
            raise unreadable(instruction, f"its window has `{item}`, which eqshard does not read")
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
        raise unreadable(where, "a matrix product's operand or result is a tuple")
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
