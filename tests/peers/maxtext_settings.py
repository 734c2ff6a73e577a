"""Eleven 8-device settings of MaxText's ICI parallelism, and the mesh MaxText builds for each.

Each setting gives only the `ici_*_parallelism` values that differ from base.yml's (every one
1 but `ici_fsdp_parallelism: -1`, which takes what the other axes leave of the 8 devices);
`maxtext_rules.mesh_shape` turns it into the mesh over all twelve of `MESH_AXES`, size-1 axes
included, as `create_device_mesh` does.

At `MAXTEXT_COMMIT` base.yml's mesh has no "sequence" axis (`ici_sequence_parallelism` names
one that `mesh_axes` leaves out, so it is read and dropped): sequence parallelism is
`tensor_sequence` or `context`, so "fsdp x sequence" is `ici_tensor_sequence_parallelism` here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, NamedTuple

import maxtext_rules

NUM_DEVICES: Final = 8


class Setting(NamedTuple):
    """An ICI parallelism of MaxText on one 8-device slice."""

    name: str
    description: str
    ici: Mapping[str, int]

    def mesh_shape(self) -> dict[str, int]:
        """Every mesh axis of base.yml with its size on `NUM_DEVICES` devices."""
        return maxtext_rules.mesh_shape(NUM_DEVICES, self.ici)


SETTINGS: Final[tuple[Setting, ...]] = (
    Setting("fsdp8", "fsdp=8: base.yml's defaults", {}),
    Setting("fsdp4_context2", "fsdp x context", {"ici_context_parallelism": 2}),
    Setting(
        "fsdp4_tensor_sequence2",
        "fsdp x sequence (tensor_sequence: base.yml has no 'sequence' axis)",
        {"ici_tensor_sequence_parallelism": 2},
    ),
    Setting("fsdp4_expert2", "fsdp x expert", {"ici_expert_parallelism": 2}),
    Setting(
        "data2_fsdp2_tensor2",
        "data x fsdp x tensor",
        {"ici_data_parallelism": 2, "ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 2},
    ),
    Setting("tensor8", "tensor=8", {"ici_fsdp_parallelism": 1, "ici_tensor_parallelism": 8}),
    Setting("data8", "data=8", {"ici_fsdp_parallelism": 1, "ici_data_parallelism": 8}),
    Setting("fsdp4_tensor2", "fsdp x tensor", {"ici_tensor_parallelism": 2}),
    Setting(
        "expert4_tensor2",
        "expert x tensor",
        {"ici_fsdp_parallelism": 1, "ici_expert_parallelism": 4, "ici_tensor_parallelism": 2},
    ),
    Setting("fsdp4_stage2", "fsdp x stage (pipeline)", {"ici_pipeline_parallelism": 2}),
    Setting(
        "fsdp4_fsdp_transpose2", "fsdp x fsdp_transpose", {"ici_fsdp_transpose_parallelism": 2}
    ),
)
