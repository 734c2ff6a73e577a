"""Hardware profiles and the roofline estimate of a step on them: no JAX.

A profile holds peak dense FLOP/s by dtype, memory bandwidth and the bandwidth of
one interconnect link, each from its vendor's datasheet (`source`). `roofline`
turns a step's FLOPs, bytes accessed and collectives into seconds: never a
measurement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import NamedTuple

from ._errors import EqshardError

__all__ = ["HARDWARE", "Estimate", "Hardware", "Moved", "hardware_profile", "roofline"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A named hardware profile for a roofline estimate, with its source."""

    name: str
    flops: dict[str, float]  # peak dense FLOP/s by parameter dtype
    memory_bandwidth: float  # bytes/s
    interconnect_bandwidth: float  # bytes/s, per device, one direction
    source: str


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "NVIDIA H100 SXM5",
        {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12},  # f32 as TF32
        3.35e12,
        450e9,  # NVLink 4: 900 GB/s both directions
        "NVIDIA H100 Tensor Core GPU datasheet (dense, without sparsity)",
    ),
    "tpu-v5e": Hardware(
        "Google Cloud TPU v5e",
        {"bfloat16": 197e12, "float32": 197e12 / 4},
        819e9,
        200e9,  # ICI: 1,600 Gbit/s per chip
        "Google Cloud TPU v5e documentation (system architecture)",
    ),
}


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A roofline estimate of one step, in seconds: never a measurement."""

    hardware: Hardware
    compute: float
    memory: float
    communication: float

    @property
    def seconds(self) -> float:
        """Compute or memory, whichever bounds the step, plus communication (no
        overlap assumed)."""
        return max(self.compute, self.memory) + self.communication


class Moved(NamedTuple):
    """What one collective moves in one step: its kind, its bytes on each device
    (times the runs), and how many devices each of its groups holds."""

    kind: str
    bytes: int
    group_size: int


def hardware_profile(hardware: str | Hardware) -> Hardware:
    """`hardware` itself, or the profile of that name in `HARDWARE`.

    **Raises:**

    `EqshardError` for a name with no profile, listing the profiles.
    """
    if isinstance(hardware, Hardware):
        return hardware
    if hardware not in HARDWARE:
        raise EqshardError(
            f"no hardware profile {hardware!r}; the profiles are "
            f"{', '.join(map(repr, HARDWARE))}, or pass an `eqshard.Hardware`"
        )
    return HARDWARE[hardware]


def roofline(
    hardware: Hardware, flops: float, bytes_accessed: float, dtype: str, moved: Iterable[Moved]
) -> Estimate:
    """A roofline estimate of one step on `hardware`.

    **Example:**

    ```python
    roofline(HARDWARE["h100"], 2e12, 1e9, "bfloat16", [Moved("all-reduce", 2**20, 8)])
    ```

    **Arguments:**

    - `hardware`: the profile.
    - `flops`: the FLOPs one device runs, at the profile's peak for `dtype` (its
        lowest peak where it has none for `dtype`).
    - `bytes_accessed`: the bytes one device reads and writes, at its memory
        bandwidth.
    - `dtype`: the parameters' dtype, by NumPy's name.
    - `moved`: the step's collectives, each over one link as a ring runs it: an
        all-reduce moves 2 (n-1)/n of its bytes, a collective-permute or a
        collective-broadcast all of them, any other (n-1)/n, for groups of n.

    **Returns:**

    An `Estimate`.
    """
    peak = hardware.flops.get(dtype, min(hardware.flops.values()))
    total = 0.0
    for m in moved:
        n = max(m.group_size, 1)
        whole = m.kind in ("collective-permute", "collective-broadcast")
        factor = 2 * (n - 1) / n if m.kind == "all-reduce" else 1.0 if whole else (n - 1) / n
        total += m.bytes * factor
    return Estimate(
        hardware,
        flops / peak,
        bytes_accessed / hardware.memory_bandwidth,
        total / hardware.interconnect_bandwidth,
    )
