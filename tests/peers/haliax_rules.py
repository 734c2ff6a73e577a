"""Haliax's axis mappings (logical axis name -> mesh axes), copied as an oracle, with its cases.

Copied from stanford-crfm/haliax at commit `HALIAX_COMMIT` (Apache License 2.0, Copyright 2025
The Levanter Authors; see http://www.apache.org/licenses/LICENSE-2.0):
`src/haliax/partitioning.py`'s `pspec_for_axis` (line 668) over `physical_axis_name`
(line 630). A mapping is a dictionary: each axis looks up its name (`mapping.get(name, None)`),
an unmapped axis is whole, nothing orders or checks the look-ups (a mesh axis used twice
is JAX's `NamedSharding` to refuse), and there are no fallbacks.

`CASES` are the assertions of `tests/test_partitioning.py` at that commit about the spec of an
array with named axes (`resource_map` there maps dim2 to "data" and dim3 to "model").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple

HALIAX_REPO: Final = "stanford-crfm/haliax"
HALIAX_COMMIT: Final = "f41e7d40c63dc486b69c5d854270a9158fe3dd39"

PhysicalAxisSpec = str | Sequence[str]


def haliax_pspec_for_axis(
    names: Sequence[str], mapping: Mapping[str, PhysicalAxisSpec]
) -> tuple[PhysicalAxisSpec | None, ...]:
    """Haliax's `pspec_for_axis`: each axis name's mesh axes in `mapping`, or None."""
    return tuple(mapping.get(name, None) for name in names)


class HaliaxCase(NamedTuple):
    """One assertion of Haliax about the spec of named axes."""

    id: str
    test: str
    line: int
    mapping: Mapping[str, PhysicalAxisSpec]
    names: tuple[str, ...]
    expected: tuple[PhysicalAxisSpec | None, ...]


FILE: Final = "tests/test_partitioning.py"
_RESOURCE_MAP: Final[Mapping[str, PhysicalAxisSpec]] = {"dim2": "data", "dim3": "model"}

CASES: Final[tuple[HaliaxCase, ...]] = (
    HaliaxCase(
        "infer_named_axes",
        "test_infer_named_axes",
        50,
        _RESOURCE_MAP,
        ("dim1", "dim2", "dim3"),
        (None, "data", "model"),
    ),
    HaliaxCase(
        "pspec_for_named_axes",
        "test_pspec_for_named_axes",
        63,
        _RESOURCE_MAP,
        ("dim1", "dim2", "dim3"),
        (None, "data", "model"),
    ),
    HaliaxCase(
        "plain_array_axis_names",
        "test_pspec_for_plain_array_axis_names",
        78,
        _RESOURCE_MAP,
        ("dim2", "dim3"),
        ("data", "model"),
    ),
    HaliaxCase(
        "plain_array_axis_names_nested",
        "test_pspec_for_plain_array_axis_names_nested_module",
        92,
        _RESOURCE_MAP,
        ("dim2", "dim3"),
        ("data", "model"),
    ),
    HaliaxCase(
        "shard_outside_jit_x",
        "test_shard_with_axis_mapping_outside_pjit",
        188,
        _RESOURCE_MAP,
        ("dim1", "dim2"),
        (None, "data"),
    ),
    HaliaxCase(
        "shard_outside_jit_y",
        "test_shard_with_axis_mapping_outside_pjit",
        191,
        _RESOURCE_MAP,
        ("dim2", "dim3"),
        ("data", "model"),
    ),
    HaliaxCase(
        "shard_in_named_jit",
        "test_named_jit_works_without_axis_resources",
        212,
        _RESOURCE_MAP,
        ("dim1", "dim2"),
        (None, "data"),
    ),
    HaliaxCase(
        "shard_inside_jit_x",
        "test_shard_with_axis_mapping_inside_jit",
        240,
        _RESOURCE_MAP,
        ("dim1", "dim2"),
        (None, "data"),
    ),
    HaliaxCase(
        "shard_inside_jit_y",
        "test_shard_with_axis_mapping_inside_jit",
        241,
        _RESOURCE_MAP,
        ("dim2", "dim3"),
        ("data", "model"),
    ),
)
