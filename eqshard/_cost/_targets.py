"""Compile targets: what `cost` compiles the step for, and whose figures it reports.

A TPU slice is compiled for by its own compiler, from any machine: with `libtpu`
installed (the `eqshard[tpu]` extra), `jax.experimental.topologies` describes a
slice such as `"v5e:4x4"` (its devices, in their order), and a step laid out on a
mesh of those devices is lowered and compiled by XLA:TPU on this CPU. Its memory
analysis is then the TPU compiler's own: exact for that compiler, not a bound.

A GPU target (`"h100:8"`) is compiled for by XLA:GPU the same way, through JAX's
CUDA plugin, with no GPU (`_gpu.py`). Without a target, `cost` compiles with XLA:CPU
on simulated CPU devices, whose communication is the SPMD partitioner's (the same
on every backend) and whose memory is XLA:CPU's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
from collections.abc import Iterator
from typing import Any

from .._errors import EqshardError, UsageError, joined
from ._gpu import gpu_target, is_gpu_name
from ._hardware import HARDWARE, Hardware

__all__ = ["CompileTarget", "compile_target"]

# `jax.experimental.topologies` names a slice by its generation and its chips' grid.
_TOPOLOGY = re.compile(r"(?P<generation>v\d+[a-z]*):(?P<grid>\d+(?:x\d+)*)")
_PROFILES = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e"}
# Each generation's chips are a 2-D grid (v5e, v6e) or a 3-D torus (v4, v5p), and a
# slice holds at most one pod's chips (Google Cloud's TPU pages). A grid outside
# these is refused here: libtpu, handed one, may end the process (a zero dim made
# libtpu 0.0.50 die with SIGFPE).
_DIMS = {"v4": 3, "v5e": 2, "v5p": 3, "v6e": 2}
_POD_CHIPS = {"v4": 4096, "v5e": 256, "v5p": 8960, "v6e": 256}

# libtpu looks for a TPU VM's metadata when it starts, and logs at length when it
# finds none: tell it there is none to find (only where the user has not said). It
# also takes a lock file, so that one process at a time drives a TPU; compiling for
# a slice drives none, so a second process (`eqshard check`'s worker, another
# check, a test run) may load it too. These are set only while libtpu starts
# (`_starting_libtpu`): the user's environment is left as it was, with nothing that
# libtpu or JAX set on starting it either.
_QUIET = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_WORKER_ID": "0",
    "TF_CPP_MIN_LOG_LEVEL": "3",
}


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """A TPU slice or GPUs to compile for, from any machine.

    - `name`: as given, `"v5e:4x4"`.
    - `devices`: the slice's devices, in `jax.experimental.topologies`' order: a mesh
        is laid over them in that order.
    - `hardware`: the chip's profile, for the roofline estimate.
    - `memory_per_device`: bytes of HBM each device has (a chip's, or its share
        where a chip shows each of its cores as a device, as v4's does).
    - `compiler`: which compiler's figures these are, with its version.
    - `platform`: `"tpu"` or `"gpu"`, whose peak rule reads its memory.
    """

    name: str
    devices: tuple[Any, ...]
    hardware: Hardware
    memory_per_device: int
    compiler: str
    platform: str = "tpu"


@functools.lru_cache(maxsize=32)
def compile_target(name: str) -> CompileTarget:
    """The TPU slice `name` (`"v5e:4x4"`, `"v5p:4x4x4"`, `"v6e:2x2"`, `"v4:2x2x1"`), or
    the GPUs `name` (`"h100:8"`, `"h200:2x8"`: hosts x GPUs).

    **Raises:**

    `EqshardError` for a name that is neither, for a slice libtpu refuses or a GPU
    the CUDA plugin refuses (with its reason); `UsageError` (an `EqshardError` the
    command line exits 2 for) where libtpu, the CUDA plugin or `ptxas` is not
    installed, with the command that installs it.
    """
    if isinstance(name, str) and is_gpu_name(name):
        gpus = gpu_target(name)
        hardware = HARDWARE[gpus.profile]
        return CompileTarget(
            name, gpus.devices, hardware, gpus.memory, gpus.compiler, platform="gpu"
        )
    found = _TOPOLOGY.fullmatch(name.strip()) if isinstance(name, str) else None
    if found is None:
        raise EqshardError(
            f"`target={name!r}` is neither a TPU slice nor GPUs; write a slice as "
            "`jax.experimental.topologies` names it, GENERATION:GRID, such as 'v5e:4x4', "
            "'v5p:4x4x4', 'v6e:2x2' or 'v4:2x2x1', or GPUs as 'h100:8'"
        )
    generation = found["generation"]
    if generation not in _PROFILES:
        raise EqshardError(
            f"`target={name!r}`: eqshard has no profile of TPU {generation}; the "
            f"generations it knows are {', '.join(_PROFILES)}"
        )
    _check_grid(name, generation, found["grid"])
    topologies, version = _libtpu(name)
    try:
        with _starting_libtpu():
            desc = topologies.get_topology_desc(topology_name=name, platform="tpu")
        devices = tuple(desc.devices)
    except Exception as error:  # libtpu's own refusal: a grid the generation has not
        raise EqshardError(
            f"`target={name!r}`: libtpu refuses the slice: {error}".rstrip()
        ) from None
    hardware = HARDWARE[_PROFILES[generation]]
    chips = len({tuple(getattr(d, "coords", (i,))) for i, d in enumerate(devices)})
    assert hardware.memory is not None
    per_device = hardware.memory * chips // len(devices)
    return CompileTarget(name, devices, hardware, per_device, f"XLA:TPU (libtpu {version})")


def _check_grid(name: str, generation: str, grid: str) -> None:
    """Refuses a grid of chips that `generation` cannot have, before libtpu sees it:
    a zero dim, the wrong number of dims, more chips than a pod holds."""
    dims = [int(d) for d in grid.split("x")]
    example = "x".join(["2"] * _DIMS[generation])
    if len(dims) != _DIMS[generation]:
        raise EqshardError(
            f"`target={name!r}`: TPU {generation} chips form a grid of {_DIMS[generation]} "
            f"dims, and {grid!r} has {len(dims)}; write one such as '{generation}:{example}'"
        )
    if min(dims) < 1:
        raise EqshardError(
            f"`target={name!r}`: each dim of the grid is a count of chips, at least 1, and "
            f"{grid!r} has {min(dims)}; write one such as '{generation}:{example}'"
        )
    chips = math.prod(dims)
    if chips > _POD_CHIPS[generation]:
        raise EqshardError(
            f"`target={name!r}` holds {chips} chips, and a TPU {generation} pod holds at most "
            f"{_POD_CHIPS[generation]}; a slice is at most one pod"
        )


@contextlib.contextmanager
def _starting_libtpu() -> Iterator[None]:
    """`_QUIET` set (where the user has not set them) while libtpu starts; then the
    environment exactly as it was, whatever libtpu and JAX set on starting it."""
    saved = dict(os.environ)
    for key, value in _QUIET.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in saved]:
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _libtpu(name: str) -> tuple[Any, str]:
    """`jax.experimental.topologies`, and libtpu's version, where libtpu is installed."""
    from importlib import metadata

    try:
        version = metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        raise joined(  # `except ModuleNotFoundError` catches it too
            UsageError,
            ModuleNotFoundError,
            f"`target={name!r}` compiles with the TPU compiler, which comes with libtpu; "
            "install it with `pip install 'eqshard[tpu]'` (libtpu for this JAX), or "
            "leave `target` out to compile with XLA:CPU",
        ) from None
    from jax.experimental import topologies

    return topologies, version
