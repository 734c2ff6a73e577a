"""GPU targets: a step compiled by XLA:GPU for GPUs this machine does not have.

JAX's CUDA plugin compiles without a GPU when it is handed the GPU's description,
XLA's own `GpuTargetConfigProto` (`gpu_specs/`, copied from openxla/xla), and a
topology of hosts and GPUs: `jax.experimental.topologies.get_topology_desc(platform=
"cuda", target_config=..., topology="1x1x8")` gives devices that compile and never
run. The plugin (`pip install 'jax[cuda12]'`, or `jax-cuda12-plugin` alone) needs
`ptxas` to compile, from a CUDA toolkit or `pip install nvidia-cuda-nvcc-cu12`; no
driver and no GPU.

A plugin older than the description may not know a field of it (JAX 0.10.2's does
not know `collective_memory_granularity`): the fields XLA added last are then left
out, one more each try, until it reads the rest.
"""

from __future__ import annotations

import functools
import re
from importlib import metadata, resources
from typing import Any, NamedTuple

from .._errors import EqshardError, UsageError, joined

__all__ = ["GPUS", "GpuTarget", "gpu_target", "is_gpu_name"]

# A GPU target's name, as `target=` takes it: the GPU, then how many: `h100:8` (one
# host of 8), `h100:2x8` (2 hosts of 8 each), or the GPU alone (one of it).
_NAME = re.compile(r"(?P<gpu>[a-z][a-z0-9]*)(?::(?:(?P<hosts>\d+)x)?(?P<per_host>\d+))?")
GPUS = {  # the name, its description in gpu_specs/, its profile in HARDWARE
    "h100": ("h100_sxm.txtpb", "h100"),
    "h200": ("h200.txtpb", "h200"),
}
_OTHER_GPUS = ("a100", "b200", "b300", "gb200", "h20", "l4", "l40", "mi300", "gpu", "cuda")
# Fields of XLA's GPU description, newest first, that an older plugin may not know
# (JAX 0.10.2's knows no `collective_memory_granularity`): left out, in this order,
# until the plugin reads it. None of them changes what XLA:GPU compiles.
_NEWER_FIELDS = (
    "collective_memory_granularity",
    "device_interconnect_info",
    "cub_version",
    "compile_time_toolkit_version",
    "dnn_version",
    "runtime_version",
    "driver_version",
)


def is_gpu_name(name: str) -> bool:
    """Whether `name` names a GPU rather than a TPU slice (`"h100:8"`, `"a100"`)."""
    found = _NAME.fullmatch(name.strip().lower())
    return found is not None and found["gpu"] in (*GPUS, *_OTHER_GPUS)


class GpuTarget(NamedTuple):
    """A GPU target's compile-only devices and what labels them."""

    devices: tuple[Any, ...]
    kind: str  # as the GPU's description names it: "NVIDIA H100 80GB HBM3"
    profile: str  # its key in `HARDWARE`
    memory: int  # bytes of one GPU's memory, as its description gives them
    compiler: str  # "XLA:GPU (NVIDIA H100 80GB HBM3, no GPU: jax-cuda12-plugin 0.10.2)"


@functools.lru_cache(maxsize=16)
def gpu_target(name: str) -> GpuTarget:
    """The GPU target `name` (`"h100:8"`, `"h200:2x8"`): its compile-only devices, in
    the topology's order, and its labels."""
    found = _NAME.fullmatch(name.strip().lower())
    if found is None or found["gpu"] not in GPUS:
        known = ", ".join(f"'{gpu}:8'" for gpu in GPUS)
        raise EqshardError(
            f"`target={name!r}`: eqshard describes these GPUs to XLA: {known} (a GPU, "
            "then how many on one host, or HOSTSxGPUS such as 'h100:2x8')"
        )
    hosts, per_host = int(found["hosts"] or 1), int(found["per_host"] or 1)
    if hosts < 1 or per_host < 1:
        raise EqshardError(
            f"`target={name!r}`: hosts and GPUs per host are counts, at least 1; write "
            "one such as 'h100:8' or 'h100:2x8'"
        )
    spec_file, profile = GPUS[found["gpu"]]
    description = resources.files("eqshard._cost").joinpath("gpu_specs", spec_file).read_text()
    plugin = _plugin(name)
    devices = _devices(name, description, f"1x{hosts}x{per_host}")
    memory = int(re.search(r"device_memory_size:\s*(\d+)", description)[1])  # pyright: ignore[reportOptionalSubscript]
    _check_ptxas(name, devices)
    kind = str(devices[0].device_kind)
    return GpuTarget(devices, kind, profile, memory, f"XLA:GPU ({kind}, no GPU: {plugin})")


def _plugin(name: str) -> str:
    """The CUDA plugin that is installed, as `jax-cuda12-plugin 0.10.2`."""
    for package in ("jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            return f"{package} {metadata.version(package)}"
        except metadata.PackageNotFoundError:
            continue
    raise joined(  # `except ModuleNotFoundError` catches it too
        UsageError,
        ModuleNotFoundError,
        f"`target={name!r}` compiles with XLA:GPU, which comes with JAX's CUDA plugin; "
        "install it with `pip install 'jax[cuda12]'` (or `jax-cuda12-plugin` and "
        "`nvidia-cuda-nvcc-cu12` alone: no GPU is needed), or leave `target` out to "
        "compile with XLA:CPU",
    )


def _devices(name: str, description: str, topology: str) -> tuple[Any, ...]:
    """The topology's compile-only devices, from the description; where the plugin
    cannot read it, again without the fields XLA added last (`_NEWER_FIELDS`), one
    more each time, since the plugin names the one it does not know only in its log."""
    from jax.experimental import topologies

    error: Exception | None = None
    for dropped in range(len(_NEWER_FIELDS) + 1):
        text = description
        for field in _NEWER_FIELDS[:dropped]:
            text = _without_field(text, field)
        try:
            desc = topologies.get_topology_desc(
                platform="cuda", target_config=text, topology=topology
            )
            return tuple(desc.devices)
        except Exception as raised:  # the plugin's refusal
            error = raised
            if "parse GpuTargetConfigProto" not in str(raised):
                break
    if "topology not implemented for cuda" in str(error):  # the plugin did not load
        raise UsageError(
            f"`target={name!r}`: JAX's CUDA plugin did not load in this process: JAX "
            "looked for a GPU when it started, found none, and left the plugin out. Start "
            'JAX with `jax.config.update("jax_platforms", "cpu")` (or set '
            "`JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`) before anything uses it; `eqshard check` "
            "and `suggest`'s workers do"
        ) from None
    raise EqshardError(
        f"`target={name!r}`: JAX's CUDA plugin refuses the GPU's description: {error}"
    ) from None


def _without_field(description: str, field: str) -> str:
    """`description` (text format) without the field `field`: its lines `field: value`
    and its blocks `field { ... }`."""
    lines, kept, depth = description.splitlines(keepends=True), [], 0
    for line in lines:
        stripped = line.strip()
        if depth:
            depth += stripped.count("{") - stripped.count("}")
            continue
        if re.match(rf"{field}\s*:", stripped):
            continue
        if re.match(rf"{field}\s*\{{", stripped):
            depth = stripped.count("{") - stripped.count("}")
            continue
        kept.append(line)
    return "".join(kept)


def _check_ptxas(name: str, devices: tuple[Any, ...]) -> None:
    """Compiles a sum on the first device, so that a missing `ptxas` is said here with
    its fix, not as the step's failure."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices[:1]), ("gpu",))
    x = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    try:
        jax.jit(jnp.sum).lower(x).compile()
    except Exception as error:
        if "PTX compilation provider" in str(error) or "ptxas" in str(error):
            raise joined(
                UsageError,
                ModuleNotFoundError,
                f"`target={name!r}`: XLA:GPU compiles to PTX, then with `ptxas`, which this "
                "machine lacks; install it with `pip install nvidia-cuda-nvcc-cu12` (or a "
                "CUDA toolkit on the PATH)",
            ) from None
        raise EqshardError(
            f"`target={name!r}`: XLA:GPU cannot compile even a sum for it: {error}"
        ) from None
