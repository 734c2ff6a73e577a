"""A collective's device groups, from every notation XLA writes them in
(`device_groups`): explicit lists, iotas, the mesh notation with its sub-axes, and
a collective-permute's source-target pairs.
"""

from __future__ import annotations

import math
import re

from ._parse import Instruction, unreadable

__all__ = ["device_groups"]


def device_groups(instruction: Instruction, devices: int) -> tuple[tuple[int, ...], ...]:
    """A collective's device groups, from any of XLA's notations:

    - explicit: `replica_groups={{0,1},{2,3}}`; `{}` is every device in one group;
    - iota: `replica_groups=[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`: the ids 0..n-1
        reshaped to the dims after `<=`, transposed by `T(...)`, and cut into the
        groups of the dims before it;
    - mesh: `replica_groups=mesh['x'=2,'y'=4] {'y'}` (with `, device_ids=(...)`
        where the mesh's devices are not in order, by an iota or a list): the
        devices that differ along the named axes, or sub-axes (`'y':(2)2`);
    - `source_target_pairs={{0,1},{1,0}}`: each pair, a group of two.
    """
    a = instruction.attributes
    if "source_target_pairs" in a:
        return tuple(tuple(p) for p in _nested(a["source_target_pairs"], instruction))
    if "replica_groups" not in a:
        return (tuple(range(devices)),) if devices else ()
    text = a["replica_groups"].strip()
    if text.startswith("mesh["):
        return _mesh_groups(text, instruction)
    if text.startswith("{"):
        groups = tuple(tuple(g) for g in _nested(text, instruction))
        if groups:
            return groups
        if not devices:
            raise unreadable(
                instruction,
                "`replica_groups={}` means every device, and the text does not say how many "
                "(no `num_partitions` on its `HloModule` line)",
            )
        return (tuple(range(devices)),)
    if text.startswith("["):
        ids = _iota(text, instruction)
        return tuple(tuple(int(i) for i in row) for row in ids)
    raise unreadable(instruction, f"the device groups `{text}` are in no notation eqshard knows")


def _nested(text: str, where: Instruction) -> list[list[int]]:
    """`{{0,1},{2,3}}` → `[[0, 1], [2, 3]]`."""
    if not re.fullmatch(r"\{\s*(\{[\d,\s]*\}\s*,?\s*)*\}", text.strip()):
        raise unreadable(where, f"the device groups `{text}` are in no notation eqshard knows")
    inner = text.strip()[1:-1]
    return [
        [int(i) for i in g.split(",") if i.strip()] for g in re.findall(r"\{([\d,\s]*)\}", inner)
    ]


_IOTA = re.compile(r"\[(?P<shape>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")


def _iota(text: str, where: Instruction) -> list[list[int]]:
    """`[2,4]<=[8]` and `[4,2]<=[2,4]T(1,0)`: rows of the iota, reshaped to the
    dims after `<=`, transposed, then cut into the dims before it (the first dim
    the groups, the rest one group)."""
    found = _IOTA.fullmatch(text)
    if found is None:
        raise unreadable(where, f"the device groups `{text}` are in no notation eqshard knows")
    shape = [int(d) for d in found["shape"].split(",")]
    ids = _transposed(
        list(range(math.prod(shape))),
        [int(d) for d in found["reshape"].split(",")],
        [int(p) for p in found["perm"].split(",")] if found["perm"] else None,
        where,
    )
    size = math.prod(shape[1:])
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _transposed(
    ids: list[int], dims: list[int], perm: list[int] | None, where: Instruction
) -> list[int]:
    """`ids` as an array of `dims`, transposed by `perm`, flattened row-major."""
    if math.prod(dims) != len(ids) or (perm is not None and sorted(perm) != list(range(len(dims)))):
        raise unreadable(where, "its device groups' iota does not fit its dims")
    if perm is None:
        return list(ids)
    strides = [math.prod(dims[k + 1 :]) for k in range(len(dims))]
    out_dims = [dims[p] for p in perm]
    result = []
    for flat in range(len(ids)):
        index, rest = 0, flat
        for k in reversed(range(len(out_dims))):
            rest, coordinate = divmod(rest, out_dims[k])
            index += coordinate * strides[perm[k]]
        result.append(ids[index])
    return result


_MESH = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\](?:\s*,\s*device_ids=\((?P<ids>[^)]*\)?)\))?\s*\{(?P<over>[^}]*)\}"
)
_MESH_AXIS = re.compile(r"\s*'(?P<name>[^']*)'\s*=\s*(?P<size>\d+)\s*")
_OVER = re.compile(r"\s*'(?P<name>[^']*)'(?::\((?P<pre>\d+)\)(?P<size>\d+))?\s*")


def _mesh_groups(text: str, where: Instruction) -> tuple[tuple[int, ...], ...]:
    """Groups from the mesh notation: `mesh['x'=2,'y'=4] {'y'}` is, for each device
    of a row-major (2, 4) grid (in `device_ids` order where given), the devices
    that differ from it along `y` only. A sub-axis `'y':(2)2` is the part of `y` of
    size 2 after a major part of size 2 (Shardy's notation): `y` = 2 x 2 x 1."""
    found = _MESH.fullmatch(text)
    unknown = f"the device groups `{text}` are in no notation eqshard knows"
    if found is None:
        raise unreadable(where, unknown)
    names, sizes = [], []
    for item in found["axes"].split(","):
        axis = _MESH_AXIS.fullmatch(item)
        if axis is None:
            raise unreadable(where, unknown)
        names.append(axis["name"])
        sizes.append(int(axis["size"]))
    count = math.prod(sizes)
    ids = list(range(count))
    if found["ids"]:
        listed = found["ids"].strip()
        if listed.startswith("["):
            iota = re.fullmatch(r"\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?", listed)
            if iota is None:
                raise unreadable(where, unknown)
            dims = [int(d) for d in iota["dims"].split(",")]
            perm = [int(p) for p in iota["perm"].split(",")] if iota["perm"] else None
            ids = _transposed(ids, dims, perm, where)
        elif re.fullmatch(r"[\d,\s]+", listed):
            ids = [int(i) for i in listed.split(",")]
        else:
            raise unreadable(where, unknown)
        if len(ids) != count:
            raise unreadable(where, "its mesh's device ids do not fill the mesh")
    # each axis the groups run over (or a sub-axis of) split in three: the part
    # before (major), the part they run over, the part after
    over: dict[str, tuple[int, int]] = {}  # axis: (size before, size of the part)
    for item in found["over"].split(",") if found["over"].strip() else []:
        axis = _OVER.fullmatch(item)
        if axis is None or axis["name"] not in names or axis["name"] in over:
            raise unreadable(where, unknown)
        size = sizes[names.index(axis["name"])]
        pre, part = (int(axis["pre"]), int(axis["size"])) if axis["pre"] else (1, size)
        if size % (pre * part):
            raise unreadable(where, unknown)
        over[axis["name"]] = (pre, part)
    parts: list[tuple[str, int, bool]] = []  # (axis, size, in the group), major first
    for name, size in zip(names, sizes):
        if name in over:
            pre, part = over[name]
            parts += [(name, pre, False), (name, part, True), (name, size // (pre * part), False)]
        else:
            parts.append((name, size, False))
    # device id of each grid position, then grouped: the positions that differ
    # only in the named parts, ordered as the groups name them
    dims = [size for _, size, _ in parts]
    inner = [k for k, (_, _, grouped) in enumerate(parts) if grouped]
    inner.sort(key=lambda k: list(over).index(parts[k][0]))  # in the order the groups name
    outer = [k for k, (_, _, grouped) in enumerate(parts) if not grouped]
    flat = _transposed(ids, dims, outer + inner, where)
    size = math.prod(dims[k] for k in inner)
    return tuple(tuple(flat[i : i + size]) for i in range(0, len(flat), size))
