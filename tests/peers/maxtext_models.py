"""A Llama-shaped and a Mixtral-shaped parameter set, named as MaxText names them, and activations.

Each leaf has MaxText's path (as `get_abstract_state` names it, cf. MaxText's own
`tests/utils/sharding_info/*/logical_shardings.json`), a small shape, and the logical names
MaxText's model code gives it, at commit `maxtext_rules.MAXTEXT_COMMIT`; `source` names the
file and line (under `src/maxtext/`).

Base.yml's settings that shape them: `scan_layers: true` (line 387) stacks the layers and
`param_scan_axis: 1` (line 388) puts the stack at dimension 1, named "layers"
(`layers/nnx_scan.py` line 76 inserts it at `min(param_scan_axis, len(names))`; Linen's
`nn.scan` with `metadata_params={nn.PARTITION_NAME: "layers"}`, `layers/decoders.py`
line 677, the same); `fused_qkv: false`, `fused_mlp: false` (lines 466-467: separate query,
key and value kernels and `wi_0`, `wi_1`); `mlp_activations: ["silu", "linear"]` (line 187: two
`wi_*`); `logits_via_embedding: false` (line 190: a `logits_dense` kernel);
`ici_context_autoregressive_parallelism: 1` (the attention kernels are named, not
`(None, None, None)`).
"""

from __future__ import annotations

from typing import Final, NamedTuple

import flax_rules


class Leaf(NamedTuple):
    """A parameter or an activation: its shape, its logical names, where MaxText names them."""

    path: str
    shape: tuple[int, ...]
    names: tuple[flax_rules.Name, ...]
    source: str


BATCH: Final = 8
LENGTH: Final = 32
EMBED: Final = 64
MLP: Final = 128
HEADS: Final = 8
KV_HEADS: Final = 8
HEAD_DIM: Final = 16  # MaxText's "kv" and "kv_head_dim"
VOCAB: Final = 256
LAYERS: Final = 2
EXPERTS: Final = 8
MOE_MLP: Final = 128

_ATT = "layers/attentions.py"


def _attention_params(prefix: str) -> tuple[Leaf, ...]:
    return (
        Leaf(
            f"{prefix}/pre_self_attention_layer_norm/scale",
            (EMBED, LAYERS),
            ("norm", "layers"),
            "models/llama2.py:71, models/mixtral.py:66 (RMSNorm kernel_axes), layers/normalizations.py:63",
        ),
        Leaf(
            f"{prefix}/self_attention/query/kernel",
            (EMBED, LAYERS, HEADS, HEAD_DIM),
            ("embed", "layers", "q_heads", "kv"),
            f"{_ATT}:680 (init_query_w), layers/linears.py:185",
        ),
        Leaf(
            f"{prefix}/self_attention/key/kernel",
            (EMBED, LAYERS, KV_HEADS, HEAD_DIM),
            ("embed", "layers", "kv_heads", "kv_head_dim"),
            f"{_ATT}:722 (init_kv_w)",
        ),
        Leaf(
            f"{prefix}/self_attention/value/kernel",
            (EMBED, LAYERS, KV_HEADS, HEAD_DIM),
            ("embed", "layers", "kv_heads", "kv_head_dim"),
            f"{_ATT}:722 (init_kv_w)",
        ),
        Leaf(
            f"{prefix}/self_attention/out/kernel",
            (HEADS, LAYERS, HEAD_DIM, EMBED),
            ("heads", "layers", "kv", "embed"),
            f"{_ATT}:813 (init_out_w)",
        ),
        Leaf(
            f"{prefix}/post_self_attention_layer_norm/scale",
            (EMBED, LAYERS),
            ("norm", "layers"),
            "models/llama2.py:111, models/mixtral.py:103",
        ),
    )


def _outer_params() -> tuple[Leaf, ...]:
    return (
        Leaf(
            "token_embedder/embedding",
            (VOCAB, EMBED),
            ("vocab", "embed_vocab"),
            "layers/embeddings.py:136 (Embed)",
        ),
        Leaf(
            "decoder/decoder_norm/scale",
            (EMBED,),
            ("norm",),
            "layers/decoders.py:797-799, layers/nnx_decoders.py:414-418",
        ),
        Leaf(
            "decoder/logits_dense/kernel",
            (EMBED, VOCAB),
            ("embed_vocab", "vocab"),
            "layers/decoders.py:835, layers/nnx_decoders.py:427",
        ),
    )


LLAMA_PARAMS: Final[tuple[Leaf, ...]] = (
    *_outer_params(),
    *_attention_params("decoder/layers"),
    Leaf(
        "decoder/layers/mlp/wi_0/kernel",
        (EMBED, LAYERS, MLP),
        ("embed", "layers", "mlp"),
        "layers/linears.py:511-518 (MlpBlock)",
    ),
    Leaf(
        "decoder/layers/mlp/wi_1/kernel",
        (EMBED, LAYERS, MLP),
        ("embed", "layers", "mlp"),
        "layers/linears.py:511-518 (MlpBlock)",
    ),
    Leaf(
        "decoder/layers/mlp/wo/kernel",
        (MLP, LAYERS, EMBED),
        ("mlp", "layers", "embed"),
        "layers/linears.py:536 (MlpBlock)",
    ),
)

MIXTRAL_PARAMS: Final[tuple[Leaf, ...]] = (
    *_outer_params(),
    *_attention_params("decoder/layers"),
    Leaf(
        "decoder/layers/MoeBlock_0/gate/kernel",
        (EMBED, LAYERS, EXPERTS),
        ("embed", "layers", None),
        "models/mixtral.py:114 (kernel_axes=('embed', None)), layers/moe.py:316 (GateLogit)",
    ),
    Leaf(
        "decoder/layers/MoeBlock_0/wi_0",
        (EXPERTS, LAYERS, EMBED, MOE_MLP),
        ("exp", "layers", "embed_moe", "mlp_moe"),
        "layers/moe.py:472, 582 (RoutedMoE)",
    ),
    Leaf(
        "decoder/layers/MoeBlock_0/wi_1",
        (EXPERTS, LAYERS, EMBED, MOE_MLP),
        ("exp", "layers", "embed_moe", "mlp_moe"),
        "layers/moe.py:472, 592 (RoutedMoE)",
    ),
    Leaf(
        "decoder/layers/MoeBlock_0/wo",
        (EXPERTS, LAYERS, MOE_MLP, EMBED),
        ("exp", "layers", "mlp_moe", "embed_moe"),
        "layers/moe.py:473, 602 (RoutedMoE)",
    ),
)

_BSE = (BATCH, LENGTH, EMBED)

_COMMON_ACTIVATIONS: Final[tuple[Leaf, ...]] = (
    Leaf(
        "inputs",
        (BATCH, LENGTH),
        ("activation_embed_and_logits_batch", "activation_norm_length"),
        "configs/base.yml:641 (input_data_sharding_logical_axes), utils/sharding.py:43",
    ),
    Leaf(
        "embedded",
        _BSE,
        ("activation_embed_and_logits_batch", "activation_length", "activation_embed"),
        "layers/embeddings.py:160-170 (Embed.__call__)",
    ),
    Leaf(
        "decoder_layer",
        _BSE,
        ("activation_batch", "activation_norm_length", "activation_embed"),
        "models/llama2.py:61, models/mixtral.py:124 (activation_axis_names)",
    ),
    Leaf(
        "attention_inputs",
        _BSE,
        ("activation_batch_attn", "activation_input_length_attn", "activation_embed_attn"),
        f"{_ATT}:146 (input_axis_names), common/common_types.py:35-46",
    ),
    Leaf(
        "query",
        (BATCH, LENGTH, HEADS, HEAD_DIM),
        (
            "activation_kv_batch",
            "activation_length_attn",
            "activation_kv_heads",
            "activation_kv_head_dim",
        ),
        f"{_ATT}:143 (query_axis_names)",
    ),
    Leaf(
        "key",
        (BATCH, LENGTH, KV_HEADS, HEAD_DIM),
        (
            "activation_kv_batch",
            "activation_length_attn",
            "activation_kv_heads",
            "activation_kv_head_dim",
        ),
        f"{_ATT}:144 (key_axis_names)",
    ),
    Leaf(
        "value",
        (BATCH, LENGTH, KV_HEADS, HEAD_DIM),
        (
            "activation_kv_batch",
            "activation_length_attn",
            "activation_kv_heads",
            "activation_kv_head_dim",
        ),
        f"{_ATT}:145 (value_axis_names)",
    ),
    Leaf(
        "attention_out",
        (BATCH, LENGTH, HEADS, HEAD_DIM),
        ("activation_batch_attn", "activation_length_attn", "activation_heads", "activation_kv"),
        f"{_ATT}:147 (out_axis_names)",
    ),
    Leaf(
        "logits",
        (BATCH, LENGTH, VOCAB),
        ("activation_embed_and_logits_batch", "activation_length", "activation_vocab"),
        "layers/decoders.py:808 (apply_output_head)",
    ),
)

LLAMA_ACTIVATIONS: Final[tuple[Leaf, ...]] = (
    *_COMMON_ACTIVATIONS,
    Leaf(
        "mlp_intermediate",
        (BATCH, LENGTH, MLP),
        ("activation_batch", "activation_length", "activation_mlp"),
        "models/llama2.py:192, layers/linears.py:490",
    ),
)

MIXTRAL_ACTIVATIONS: Final[tuple[Leaf, ...]] = (
    *_COMMON_ACTIVATIONS,
    Leaf(
        "moe_inputs",
        _BSE,
        ("activation_batch", "activation_norm_length", None),
        "layers/moe.py:1617-1621 (input_partition_pspec; batch > 1, so activation_batch)",
    ),
    Leaf(
        "moe_gate_logits",
        (BATCH, LENGTH, EXPERTS),
        ("activation_batch", "activation_norm_length", None),
        "layers/moe.py:1626 (gate_logits_pspec)",
    ),
    Leaf(
        "moe_output",
        _BSE,
        ("activation_batch", "activation_norm_length", "activation_embed"),
        "layers/moe.py:1696-1702 (output_pspec)",
    ),
)

MODELS: Final[dict[str, tuple[tuple[Leaf, ...], tuple[Leaf, ...]]]] = {
    "llama": (LLAMA_PARAMS, LLAMA_ACTIVATIONS),
    "mixtral": (MIXTRAL_PARAMS, MIXTRAL_ACTIVATIONS),
}
