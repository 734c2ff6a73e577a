"""A small DINOv3-style vision transformer of `eqx.nn` modules, for `Cost.explain`'s
tests and the worked example of docs/cost.md: a patch embedding (a convolution whose
stride is the patch), a class token and register tokens, pre-norm blocks whose
attention has one FUSED qkv projection that the model splits into q, k and v,
LayerScale, an MLP, a final norm and a head."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

DIM, HEADS, DEPTH, IMAGE, PATCH, REGISTERS, CLASSES = 64, 4, 2, 32, 8, 4, 10
TOKENS = 1 + REGISTERS + (IMAGE // PATCH) ** 2  # the class token, the registers, the patches


class LayerScale(eqx.Module):
    """A learned scale per channel of a residual branch (CaiT, DINOv2, DINOv3)."""

    gamma: Float[Array, " dim"]

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        return x * self.gamma


class Attention(eqx.Module):
    """Self-attention whose queries, keys and values come from one fused projection."""

    qkv: eqx.nn.Linear  # dim -> 3 * dim: q, k and v side by side
    proj: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        seq, dim = x.shape
        q, k, v = jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1)  # the fused qkv, split
        q, k, v = (t.reshape(seq, self.heads, dim // self.heads) for t in (q, k, v))
        logits = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim // self.heads)
        out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(logits, axis=-1), v)
        return jax.vmap(self.proj)(out.reshape(seq, dim))  # the output projection


class Block(eqx.Module):
    """A pre-norm block: attention and an MLP, each scaled by LayerScale."""

    norm1: eqx.nn.LayerNorm
    attn: Attention
    ls1: LayerScale
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    ls2: LayerScale

    def __init__(self, key: Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(DIM)
        qkv, proj = eqx.nn.Linear(DIM, 3 * DIM, key=k1), eqx.nn.Linear(DIM, DIM, key=k2)
        self.attn = Attention(qkv, proj, HEADS)
        self.ls1 = LayerScale(jnp.full(DIM, 1e-5))
        self.norm2 = eqx.nn.LayerNorm(DIM)
        self.mlp = eqx.nn.MLP(DIM, DIM, 4 * DIM, 1, activation=jax.nn.gelu, key=k3)
        self.ls2 = LayerScale(jnp.full(DIM, 1e-5))

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        x = x + self.ls1(self.attn(jax.vmap(self.norm1)(x)))
        return x + self.ls2(jax.vmap(self.mlp)(jax.vmap(self.norm2)(x)))


class ViT(eqx.Module):
    """Patches, a class token and registers, `DEPTH` blocks, a norm and a head that
    reads the class token."""

    patch_embed: eqx.nn.Conv2d
    cls_token: Float[Array, "1 dim"]
    registers: Float[Array, "registers dim"]
    pos_embed: Float[Array, "tokens dim"]
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key: Array):
        keys = jax.random.split(key, DEPTH + 4)
        self.patch_embed = eqx.nn.Conv2d(3, DIM, PATCH, stride=PATCH, key=keys[0])
        self.cls_token = 0.02 * jax.random.normal(keys[1], (1, DIM))
        self.registers = 0.02 * jax.random.normal(keys[2], (REGISTERS, DIM))
        self.pos_embed = 0.02 * jax.random.normal(keys[3], (TOKENS, DIM))
        self.blocks = [Block(k) for k in keys[4:]]
        self.norm = eqx.nn.LayerNorm(DIM)
        self.head = eqx.nn.Linear(DIM, CLASSES, key=keys[-1])

    def __call__(self, image: Float[Array, "3 height width"]) -> Float[Array, " classes"]:
        patches = self.patch_embed(image).reshape(DIM, -1).T  # (patches, dim)
        x = jnp.concatenate([self.cls_token, self.registers, patches]) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[0]))


def build() -> ViT:
    """The ViT, abstract (`eqx.filter_eval_shape`): enough for `eqshard.cost`."""
    return eqx.filter_eval_shape(ViT, jax.random.key(0))


SPEC = {
    "eqshard": 1,
    "mesh": [["data", 2], ["model", 4]],
    "default": "replicate",
    "rules": [
        {"path": "blocks.*.attn.qkv.weight", "expr": "o i -> * o4 i", "comment": "fused qkv"},
        {"path": "blocks.*.attn.qkv.bias", "expr": "o -> * o4"},
        {"path": "blocks.*.attn.proj.weight", "expr": "o i -> * o i4", "comment": "row-parallel"},
    ],
}
"""Data x tensor parallelism: the fused qkv's output dim split over `model`, the
output projection's input dim too (row-parallel), the images over `data`."""
