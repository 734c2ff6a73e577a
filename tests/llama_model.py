"""A Llama-3-8B-shaped model (real `eqx.nn` modules, its 32 layers stacked), only
ever built abstractly (`eqx.filter_eval_shape`): 8 billion parameters, no memory.
Its spec, `LLAMA_SPEC`, splits it FSDP over `data` and tensor parallel over
`model` on any count of devices that 16 divides."""

import equinox as eqx
import jax

VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS = 128256, 4096, 32, 8, 14336, 32
HEAD = DIM // HEADS


class Layer(eqx.Module):
    attention_norm: eqx.nn.RMSNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 7)
        self.attention_norm = eqx.nn.RMSNorm(DIM, use_bias=False)
        self.q = eqx.nn.Linear(DIM, HEADS * HEAD, use_bias=False, key=keys[0])
        self.k = eqx.nn.Linear(DIM, KV_HEADS * HEAD, use_bias=False, key=keys[1])
        self.v = eqx.nn.Linear(DIM, KV_HEADS * HEAD, use_bias=False, key=keys[2])
        self.o = eqx.nn.Linear(HEADS * HEAD, DIM, use_bias=False, key=keys[3])
        self.mlp_norm = eqx.nn.RMSNorm(DIM, use_bias=False)
        self.gate = eqx.nn.Linear(DIM, HIDDEN, use_bias=False, key=keys[4])
        self.up = eqx.nn.Linear(DIM, HIDDEN, use_bias=False, key=keys[5])
        self.down = eqx.nn.Linear(HIDDEN, DIM, use_bias=False, key=keys[6])


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    layers: Layer  # stacked: every leaf has a leading axis of LAYERS
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k_embed)
        self.layers = eqx.filter_vmap(Layer)(jax.random.split(k_layers, LAYERS))
        self.norm = eqx.nn.RMSNorm(DIM, use_bias=False)
        self.head = eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=k_head)


def build() -> Llama:
    return Llama(jax.random.key(0))


# Column-parallel weights (out, in) put `in` on `data` and `out` on `model`;
# row-parallel ones the other way round. The vocabulary is split over `model`.
COLUMN, ROW = "... o i -> ... i* o16", "... o i -> ... o* i16"
COLUMNS, ROWS = ("q", "k", "v", "gate", "up"), ("o", "down")
LLAMA_SPEC = {
    "eqshard": 1,
    "mesh": [["data", "*"], ["model", 16]],
    "default": "replicate",
    "rules": [
        *({"path": f"layers.{name}.weight", "expr": COLUMN} for name in COLUMNS),
        *({"path": f"layers.{name}.weight", "expr": ROW} for name in ROWS),
        {"path": "embed.weight", "expr": "v d -> d* v16"},
        {"path": "head.weight", "expr": "v d -> d* v16"},
    ],
}
