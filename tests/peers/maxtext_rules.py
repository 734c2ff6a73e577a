"""MaxText's mesh axes and logical axis rules, verbatim, and an oracle of how MaxText resolves them.

Taken from AI-Hypercomputer/maxtext at commit `MAXTEXT_COMMIT` (Apache License 2.0, Copyright
Google LLC; see https://www.apache.org/licenses/LICENSE-2.0). At that commit the configs live
in `src/maxtext/configs/` (no longer `MaxText/configs/`):

- `BASE_YML_MESH_AXES` is `mesh_axes` of `src/maxtext/configs/base.yml` (line 531), and
  `BASE_YML_LOGICAL_AXIS_RULES` its `logical_axis_rules` (lines 532-638), pasted as they are
  (YAML's flow lists are Python lists; the comments are base.yml's);
- `LOGICAL_AXIS_RULES` is what `pyconfig.HyperParameters` hands to Flax: the same rules with
  every list made a tuple (`_lists_to_tuples`, `src/maxtext/configs/pyconfig.py` line 211,
  applied at line 343), so a rule to `[]` is a rule to `()`;
- `LLAMA2_7B_LOGICAL_AXIS_RULES` is base.yml's rules merged with
  `src/maxtext/configs/models/llama2-7b.yml`'s `logical_axis_rules: [['norm', 'fsdp']]`
  (line 29) by `_merge_logical_axis_rules` (pyconfig.py line 166): the `norm` rule is dropped
  from its place and the model's appended at the end.

How MaxText resolves logical names (quoted in tests/peers/README.md):

- `src/maxtext/utils/sharding.py` line 362, `logical_to_mesh_axes(logical_names, mesh, rules)`:
  `nn.logical_to_mesh_axes(logical_names, rules=rules)` (Flax's resolution, with the
  `LOGICAL_AXIS_RULES` above), then `remove_size_one_mesh_axis(tensor_spec, mesh)` (line 182):
  every mesh axis of size 1, or not in the mesh at all (`mesh.shape.get(s, 1)`), is dropped
  (an axis alone becomes None, a tuple keeps its other axes, possibly none);
- activations (`create_sharding`, `maybe_shard_with_logical`) and parameters of the NNX model
  (`pure_nnx: true`, base.yml line 1310: `get_nnx_var_named_sharding_with_scan_axis`, line 265)
  go through it;
- parameters of the Linen model (`get_abstract_state`, `src/maxtext/utils/maxtext_utils.py`
  line 1878) go through Flax's `nn.logical_to_mesh_sharding` without that step, and
  `mixtral.py`'s decoder layer constrains with Flax's `nn.with_logical_constraint`: size-1 axes
  stay in those specs. Dropping an axis of size 1 changes no layout.

The mesh: `create_device_mesh` (maxtext_utils.py line 2154) takes each mesh axis's
`ici_*_parallelism` through the map copied in `ICI_PARALLELISM_KEYS` (line 2188, the same as
`src/maxtext/configs/types.py` line 4324) in the order of `mesh_axes`, and
`max_utils.fill_unspecified_mesh_axes` (`src/maxtext/utils/max_utils.py` line 461) turns the one
-1 into what the device count leaves; the `Mesh` then has every axis of `mesh_axes`, size-1
ones included (`get_mesh_from_config`, line 2438).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import flax_rules

MAXTEXT_REPO: Final = "AI-Hypercomputer/maxtext"
MAXTEXT_COMMIT: Final = "e591f30cbbf217ed67ef71263ec0538239f9c3b8"

# fmt: off
# src/maxtext/configs/base.yml line 531, verbatim
BASE_YML_MESH_AXES: Final[list[str]] = ['diloco', 'data', 'stage', 'fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'context_autoregressive', 'tensor', 'tensor_sequence', 'expert', 'autoregressive']

# src/maxtext/configs/base.yml lines 532-638, verbatim
BASE_YML_LOGICAL_AXIS_RULES: Final[list[list[Any]]] = [
                      ['circular_repeats', []],
                      # ==========================================
                      # Vocabulary Embedding
                      # ==========================================
                      # Vocab Activations
                      ['activation_embed_and_logits_batch', ['data', 'stage', 'fsdp', 'fsdp_transpose', 'expert']],
                      ['activation_embed_and_logits_batch_sequence', ['data', 'stage', 'fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']],
                      ['activation_vocab', ['tensor', 'tensor_sequence']],
                      ['activation_vocab', ['tensor']],
                      ['activation_vocab', 'tensor_sequence'],
                      # Vocab Weights
                      ['vocab', ['tensor', 'tensor_sequence', 'autoregressive']],
                      ['embed_vocab', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']],
                      # ==========================================
                      # Attention
                      # ==========================================
                      # Attention Activations
                      ['activation_batch_attn', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
                      ['activation_input_length_attn', ['tensor_sequence', 'context']],
                      ['activation_heads', ['tensor', 'tensor_sequence', 'autoregressive']],
                      ['activation_kv_heads', ['tensor', 'tensor_sequence']],
                      ['activation_length_attn', ['context', 'context_usp_ulysses']],
                      ['activation_q_length', ['context', 'context_usp_ulysses']],
                      ['activation_kv_length', []],
                      ['activation_embed_attn', ['tensor']],
                      ['activation_kv', ['tensor', 'tensor_sequence']],
                      ['activation_kv_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
                      ['activation_kv_head_dim', ['tensor', 'tensor_sequence']],
                      # Attention Weights
                      ['heads', ['tensor', 'tensor_sequence', 'autoregressive']],
                      ['q_heads', ['tensor', 'tensor_sequence', 'autoregressive']],
                      ['kv_heads', ['tensor', 'tensor_sequence', 'autoregressive']],
                      ['qkv', []],
                      ['kv', []],
                      ['kv_head_dim', []],
                      ['q_lora', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']],
                      ['q_lora', ['fsdp', 'context', 'context_usp_ulysses', 'expert']],
                      ["q_lora_up_proj", []],
                      ['kv_lora', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']],
                      ['kv_lora', ['fsdp', 'context', 'context_usp_ulysses', 'expert']],
                      ["kv_lora_up_proj", []],
                      # ==========================================
                      # Mixture of Experts (MoE)
                      # ==========================================
                      # MoE Activations
                      ['activation_batch_moe', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
                      ['activation_length_moe', ['context', 'context_usp_ulysses']],
                      ['activation_norm_length_moe', ['tensor_sequence', 'context', 'context_usp_ulysses']],
                      ['activation_embed_moe', ['tensor']],
                      ['activation_mlp_moe', ['tensor', 'tensor_sequence']],
                      ['activation_exp', ['expert']],
                      # MoE Weights
                      ['exp', 'expert'],
                      ['mlp_moe', ['fsdp_transpose', 'tensor', 'tensor_sequence', 'autoregressive']],
                      ['embed_moe', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses']],
                      ['embed_moe', ['fsdp', 'context', 'context_usp_ulysses']],
                      # ==========================================
                      # Standard MLP / Dense Layers / Model Structure
                      # ==========================================
                      # Dense Activations
                      ['activation_mlp', ['tensor', 'tensor_sequence']],
                      # Note activation batch and length also get used in vocab
                      ['activation_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
                      ['activation_length', ['context', 'context_usp_ulysses']],
                      ['activation_norm_length', ['tensor_sequence', 'context', 'context_usp_ulysses']],
                      ['activation_embed', ['tensor']],
                      ['activation_stage', 'stage'],
                      # General Weights
                      ['mlp', ['fsdp_transpose', 'tensor', 'tensor_sequence', 'autoregressive']],
                      # GDN (linear-attention) projections shard like 'mlp' during training; the
                      # vLLM serving config overrides this to match tpu-inference's ATTN_HEAD order.
                      ['gdn_head', ['fsdp_transpose', 'tensor', 'tensor_sequence', 'autoregressive']],
                      ['embed', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']],
                      ['embed', ['fsdp', 'context', 'context_usp_ulysses', 'expert']],
                      ['norm', ['tensor']],
                      ['layers', 'stage'],
                      ['diloco', 'diloco'],
                      ['engram_dim', ['tensor']],
                      ['dense_layers', []],
                      ['moe_layers', []],
                      ['local_layers', []],
                      ['mhc', []],
                      # ==========================================
                      # Inference(Prefill, Decode, Cache)
                      # ==========================================
                      ['prefill_activation_length', ['context', 'context_usp_ulysses']],
                      ['prefill_activation_norm_length', ['tensor_sequence', 'context', 'context_usp_ulysses']],
                      ['activation_prefill_kv_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
                      ['decode_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']],
                      ['decode_length', []],
                      ['cache_heads', ['autoregressive', 'tensor', 'tensor_sequence']],
                      ['paged_kv_heads', ['tensor']],
                      ['cache_batch_prefill', []],
                      ['cache_batch', []],
                      ['cache_heads_none', []],
                      ['cache_kv', []],
                      ['cache_sequence', []],
                      ['num_pages', []],
                      ['tokens_per_page', []],
                      ['paged_kv_head_dim_size', []],
                      # ==========================================
                      # Deprecated / Scheduled for Removal
                      # ==========================================
                      ['mlp_no_fsdp', ['tensor', 'tensor_sequence', 'autoregressive']],
                      ['exp_with_fsdp', 'fsdp'],
                  ]
# fmt: on

MESH_AXES: Final[tuple[str, ...]] = tuple(BASE_YML_MESH_AXES)


def lists_to_tuples(value: Any) -> Any:
    """`pyconfig._lists_to_tuples`: every list, at any depth, made a tuple."""
    return tuple(lists_to_tuples(x) for x in value) if isinstance(value, list) else value


def merge_logical_axis_rules(base_rules: Sequence[Any], new_rules: Sequence[Any]) -> list[Any]:
    """`pyconfig._merge_logical_axis_rules`: a model's rules replace every base rule of their names."""
    if not new_rules:
        return list(base_rules)
    new_rule_keys = {rule[0] for rule in new_rules}
    updated_rules = [rule for rule in base_rules if rule[0] not in new_rule_keys]
    updated_rules.extend(new_rules)
    return updated_rules


LOGICAL_AXIS_RULES: Final[flax_rules.Rules] = lists_to_tuples(BASE_YML_LOGICAL_AXIS_RULES)

# src/maxtext/configs/models/llama2-7b.yml line 29
LLAMA2_7B_YML_LOGICAL_AXIS_RULES: Final[list[list[Any]]] = [["norm", "fsdp"]]
LLAMA2_7B_LOGICAL_AXIS_RULES: Final[flax_rules.Rules] = lists_to_tuples(
    merge_logical_axis_rules(BASE_YML_LOGICAL_AXIS_RULES, LLAMA2_7B_YML_LOGICAL_AXIS_RULES)
)

# The config key of each mesh axis's ICI size: `create_device_mesh`'s `ici_map`
# (maxtext_utils.py line 2188). "sequence" and "model" are keys there, not axes of base.yml's mesh.
ICI_PARALLELISM_KEYS: Final[Mapping[str, str]] = {
    "diloco": "ici_diloco_parallelism",
    "data": "ici_data_parallelism",
    "stage": "ici_pipeline_parallelism",
    "fsdp": "ici_fsdp_parallelism",
    "fsdp_transpose": "ici_fsdp_transpose_parallelism",
    "sequence": "ici_sequence_parallelism",
    "context": "ici_context_parallelism",
    "context_usp_ulysses": "ici_context_usp_ulysses_parallelism",
    "context_autoregressive": "ici_context_autoregressive_parallelism",
    "tensor": "ici_tensor_parallelism",
    "tensor_sequence": "ici_tensor_sequence_parallelism",
    "model": "ici_tensor_parallelism",
    "expert": "ici_expert_parallelism",
    "autoregressive": "ici_autoregressive_parallelism",
}

# base.yml lines 672-684: every ICI size is 1 but fsdp's, -1 (what the device count leaves).
BASE_ICI_PARALLELISM: Final[Mapping[str, int]] = {
    "ici_diloco_parallelism": 1,
    "ici_data_parallelism": 1,
    "ici_fsdp_parallelism": -1,
    "ici_fsdp_transpose_parallelism": 1,
    "ici_sequence_parallelism": 1,
    "ici_context_parallelism": 1,
    "ici_context_usp_ulysses_parallelism": 1,
    "ici_context_autoregressive_parallelism": 1,
    "ici_tensor_parallelism": 1,
    "ici_tensor_sequence_parallelism": 1,
    "ici_autoregressive_parallelism": 1,
    "ici_pipeline_parallelism": 1,
    "ici_expert_parallelism": 1,
}


def fill_unspecified_mesh_axes(parallelism_vals: list[int], target_product: int) -> list[int]:
    """`max_utils.fill_unspecified_mesh_axes`: the one -1 becomes what `target_product` leaves.

    **Raises:** `ValueError` where more than one value is -1, or the product is not the target
    (MaxText asserts).
    """
    vals = list(parallelism_vals)
    if -1 in vals:
        if vals.count(-1) != 1:
            raise ValueError("at most one ICI parallelism may be -1")
        known = -math.prod(vals)
        if target_product % known:
            raise ValueError(f"{target_product} devices do not divide by {known}")
        vals[vals.index(-1)] = target_product // known
    if math.prod(vals) != target_product:
        raise ValueError(f"the ICI parallelism {vals} does not make {target_product} devices")
    return vals


def mesh_shape(
    num_devices: int, ici: Mapping[str, int] | None = None, mesh_axes: Sequence[str] = MESH_AXES
) -> dict[str, int]:
    """The mesh MaxText builds on one slice: each of `mesh_axes` with its size, size 1 included.

    **Arguments:**

    - `num_devices`: the devices of the slice.
    - `ici`: `ici_*_parallelism` values that differ from base.yml's.
    - `mesh_axes`: the mesh's axes, in order.
    """
    config = {**BASE_ICI_PARALLELISM, **(ici or {})}
    unknown = set(ici or {}) - set(BASE_ICI_PARALLELISM)
    if unknown:
        raise ValueError(f"not an ICI parallelism of base.yml: {sorted(unknown)}")
    sizes = fill_unspecified_mesh_axes(
        [config[ICI_PARALLELISM_KEYS[axis]] for axis in mesh_axes], num_devices
    )
    return dict(zip(mesh_axes, sizes))


def remove_size_one_mesh_axis(
    spec: Sequence[flax_rules.Entry], mesh_shape: Mapping[str, int]
) -> tuple[flax_rules.Entry, ...]:
    """`sharding.remove_size_one_mesh_axis`: every mesh axis of size 1 (or absent) dropped.

    (MaxText's also passes a None spec through as None.)
    """
    new_spec: list[flax_rules.Entry] = []
    for s in spec:
        if s is None or isinstance(s, flax_rules.Unconstrained):
            new_spec.append(s)
        elif isinstance(s, str):
            new_spec.append(None if mesh_shape.get(s, 1) == 1 else s)
        else:
            new_spec.append(tuple(i for i in s if mesh_shape.get(i, 1) != 1))
    return tuple(new_spec)


def canonical(spec: Sequence[flax_rules.Entry]) -> tuple[flax_rules.Entry, ...]:
    """The entries `jax.sharding.PartitionSpec(*spec)` keeps: `()` is None, `("x",)` is "x"."""
    out: list[flax_rules.Entry] = []
    for entry in spec:
        if isinstance(entry, tuple | list):
            out.append(None if not entry else entry[0] if len(entry) == 1 else tuple(entry))
        else:
            out.append(entry)
    return tuple(out)


def _resolve(
    names: Sequence[flax_rules.Name], rules: flax_rules.Rules
) -> tuple[flax_rules.Entry, ...]:
    spec = flax_rules.flax_logical_to_mesh_axes(names, rules)
    if spec is None:
        raise TypeError("`names` must be a sequence of logical names, not None")
    return spec


def flax_partition_spec(
    names: Sequence[flax_rules.Name], rules: flax_rules.Rules = LOGICAL_AXIS_RULES
) -> tuple[flax_rules.Entry, ...]:
    """The spec of Flax's `nn.logical_to_mesh_axes`, as a `PartitionSpec` holds it.

    What MaxText's Linen parameters (`get_abstract_state`) and `nn.with_logical_constraint`
    use: mesh axes of size 1 stay.
    """
    return canonical(_resolve(names, rules))


def maxtext_partition_spec(
    names: Sequence[flax_rules.Name],
    mesh_shape: Mapping[str, int],
    rules: flax_rules.Rules = LOGICAL_AXIS_RULES,
) -> tuple[flax_rules.Entry, ...]:
    """MaxText's `sharding.logical_to_mesh_axes`: Flax's resolution, then size-1 axes dropped.

    **Arguments:**

    - `names`: a logical name (or None) per dimension.
    - `mesh_shape`: each mesh axis's size (`mesh_shape(...)`).
    - `rules`: the logical axis rules; base.yml's by default.

    **Returns:** the entries of the `PartitionSpec` MaxText builds (`canonical`).

    **Raises:** `ValueError` where a name occurs twice (Flax's check).
    """
    return canonical(remove_size_one_mesh_axis(_resolve(names, rules), mesh_shape))
