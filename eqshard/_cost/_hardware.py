"""Hardware profiles and the roofline estimate of a step on them: no JAX.

A profile holds peak dense FLOP/s by dtype, memory bandwidth and the bandwidth of
one interconnect link, each from its vendor's datasheet (`source`). `roofline`
turns a step's FLOPs, bytes accessed and collectives into seconds: never a
measurement.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import NamedTuple

from .._errors import EqshardError

__all__ = [
    "HARDWARE",
    "Estimate",
    "Hardware",
    "Moved",
    "hardware_profile",
    "memory_size",
    "roofline",
    "seconds_text",
]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A named hardware profile for a roofline estimate, with its source.

    **Attributes:**

    - `flops`: peak dense FLOP/s of one chip, by the parameters' dtype.
    - `memory_bandwidth`: bytes/s of one chip's memory.
    - `interconnect_bandwidth`: bytes/s per chip, one direction.
    - `memory`: bytes of memory per chip (HBM), where the datasheet gives it.
    - `source`: the datasheet.
    """

    name: str
    flops: dict[str, float]
    memory_bandwidth: float
    interconnect_bandwidth: float
    source: str
    memory: int | None = None

    def __repr__(self) -> str:  # the name: the figures are in `HARDWARE`'s source
        return f"Hardware({self.name!r})"


_GIB = 1 << 30

HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "NVIDIA H100 SXM5",
        {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12},  # f32 as TF32
        3.35e12,
        450e9,  # NVLink 4: 900 GB/s both directions
        "NVIDIA H100 Tensor Core GPU datasheet (dense, without sparsity)",
        80 * _GIB,
    ),
    "h200": Hardware(
        "NVIDIA H200 SXM",
        {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12},  # as the H100's
        4.8e12,
        450e9,  # NVLink 4: 900 GB/s both directions
        "NVIDIA H200 Tensor Core GPU datasheet (dense, without sparsity)",
        141 * 10**9,
    ),
    "tpu-v4": Hardware(
        "Google Cloud TPU v4",
        {"bfloat16": 275e12, "float32": 275e12 / 4},
        1200e9,
        270e9,  # ICI: 6 links of 45 GB/s each way; the Cloud docs give no per-chip figure
        "Google Cloud TPU v4 documentation (system architecture); ICI from How to Scale "
        "Your Model (the JAX scaling book), part 2",
        32 * _GIB,
    ),
    "tpu-v5e": Hardware(
        "Google Cloud TPU v5e",
        {"bfloat16": 197e12, "float32": 197e12 / 4},
        819e9,
        200e9,  # ICI: 400 GB/s per chip, both directions
        "Google Cloud TPU v5e documentation (system architecture)",
        16 * _GIB,
    ),
    "tpu-v5p": Hardware(
        "Google Cloud TPU v5p",
        {"bfloat16": 459e12, "float32": 459e12 / 4},
        2765e9,
        600e9,  # ICI: 1,200 GB/s per chip, both directions
        "Google Cloud TPU v5p documentation (key specifications)",
        95 * _GIB,
    ),
    "tpu-v6e": Hardware(
        "Google Cloud TPU v6e (Trillium)",
        {"bfloat16": 918e12, "float32": 918e12 / 4},
        1638e9,
        400e9,  # ICI: 800 GB/s per chip, both directions
        "Google Cloud TPU v6e documentation (system architecture)",
        32 * _GIB,
    ),
}


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A roofline estimate of one step, in seconds: never a measurement.

    **Attributes:**

    - `hardware`: the profile it is made on.
    - `compute`: the seconds of the FLOPs at peak.
    - `memory`: the seconds of the bytes accessed at memory bandwidth.
    - `communication`: the seconds of the collectives over the interconnect.
    """

    hardware: Hardware
    compute: float
    memory: float
    communication: float

    @property
    def seconds(self) -> float:
        """Compute or memory, whichever bounds the step, plus communication (no
        overlap assumed)."""
        return max(self.compute, self.memory) + self.communication

    def __repr__(self) -> str:
        return (
            f"Estimate({self.seconds:.3g} s on {self.hardware.name}: compute "
            f"{self.compute:.3g} s, memory {self.memory:.3g} s, communication "
            f"{self.communication:.3g} s)"
        )


class Moved(NamedTuple):
    """What one collective moves in one step: its kind, its bytes on each device
    (times the runs), and how many devices each of its groups holds."""

    kind: str
    bytes: int
    group_size: int


def seconds_text(value: float) -> str:
    """Seconds, as a table shows them: `4.4e-6` -> `'4.4 us'`."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


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
            f"{', '.join(map(repr, HARDWARE))}, or pass an `eqshard.targets.Hardware`"
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


_MEMORY_UNITS = {
    "": 1,
    "B": 1,
    "kB": 1000,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
}
_MEMORY = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?) ?(?P<unit>[A-Za-z]*)", re.ASCII)


def memory_size(size: int | str) -> int:
    """Bytes, from a byte count or a size with a unit: `80GB`, `16GiB`, `1.5TB`.

    **Example:**

    ```python
    memory_size("75GiB")   # 80530636800
    ```

    **Arguments:**

    - `size`: a whole number of bytes, or text: a number and one of the units B,
        kB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024).

    **Returns:**

    The bytes, at least 1.

    **Raises:**

    `EqshardError` for anything else, saying how to write a size.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 1:
            raise EqshardError(f"{size!r} must be at least 1 byte")
        return size
    found = _MEMORY.fullmatch(size.strip()) if isinstance(size, str) else None
    unit = None if found is None else _MEMORY_UNITS.get(found["unit"])
    if found is None or unit is None or (not found["unit"] and "." in found["number"]):
        raise EqshardError(
            f"{size!r} is not a memory size: write a byte count or a number with a unit, "
            "e.g. 80GB or 16GiB (units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    count = round(float(found["number"]) * unit)
    if count < 1:
        raise EqshardError(f"{size!r} must be at least 1 byte")
    return count
