"""Terminal pictures of a layout: which device holds which block of an array."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ._report import spec_text

__all__ = ["Block", "blocks", "describe"]


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of an array and the devices that hold a copy of it.

    - `index`: the block's position in the grid of blocks, one number per dimension.
    - `bounds`: `(start, stop)` of the block along each dimension.
    - `devices`: the ids of the devices holding it, in increasing order.
    """

    index: tuple[int, ...]
    bounds: tuple[tuple[int, int], ...]
    devices: tuple[int, ...]


def blocks(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> list[Block]:
    """The blocks of an array of `shape` under `sharding`, in row-major block order."""
    shape = tuple(shape)
    holders: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        bounds = tuple(
            (s.start or 0, size if s.stop is None else s.stop) for s, size in zip(index, shape)
        )
        holders.setdefault(bounds, []).append(device.id)
    result = []
    for bounds, ids in sorted(holders.items()):
        index = tuple(start // max(1, stop - start) for start, stop in bounds)
        result.append(Block(index, bounds, tuple(sorted(ids))))
    return result


def _device_list(ids: Sequence[int], platform: str) -> str:
    return f"{platform.upper()} {','.join(map(str, ids))}"


def describe(
    expr: str,
    shape: Sequence[int],
    sharding: NamedSharding,
    console: Console,
) -> None:
    """Prints the layout of an array: its mesh, its spec, and a table of blocks.

    For one- and two-dimensional arrays it also draws JAX's own picture
    (`jax.debug.visualize_sharding`).
    """
    shape = tuple(shape)
    platform = next(iter(sharding.device_set)).platform
    mesh = ", ".join(f"{name}={size}" for name, size in sharding.mesh.shape.items())
    shard_shape = sharding.shard_shape(shape)
    n_blocks = len(blocks(sharding, shape))
    copies = len(sharding.device_set) // max(1, n_blocks)
    header = Text.assemble(
        ("expression  ", "bold"),
        (expr, "cyan"),
        "\n",
        ("shape       ", "bold"),
        f"{shape} on {len(sharding.device_set)} {platform.upper()} devices\n",
        ("mesh        ", "bold"),
        f"{mesh} (row-major over device ids)\n",
        ("spec        ", "bold"),
        f"{spec_text(sharding.spec)}\n",
        ("per device  ", "bold"),
        f"{shard_shape}: {n_blocks} block{'s' * (n_blocks != 1)}, each on "
        f"{copies} device{'s' * (copies != 1)}",
    )
    table = Table(title="which device holds which block", title_justify="left")
    table.add_column("block", justify="right")
    table.add_column("index range")
    table.add_column("devices")
    for block in blocks(sharding, shape):
        ranges = ", ".join(f"{start}:{stop}" for start, stop in block.bounds)
        table.add_row(str(block.index), f"[{ranges}]", _device_list(block.devices, platform))
    console.print(Group(header, Text(""), table))
    if 1 <= len(shape) <= 2 and 0 not in shape:
        console.print()
        jax.debug.visualize_sharding(shape, sharding, use_color=console.is_terminal)
