"""`eqshard demo`: a small transformer block, tensor parallel, trained one step.

It builds the block from `eqx.nn` modules, gives third-party leaves expressions
with `eqx.tree_at`, places it with `eqshard.apply`, and checks one
`eqx.filter_jit` training step against the same step unsharded.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

from ._apply import apply
from ._plan import plan
from ._report import human_bytes, leaf_rows, leaf_table, total_bytes_per_device
from ._resolve import spec as spec_of
from ._shard import constrain

__all__ = ["Block", "main", "megatron_spec"]


class Block(eqx.Module):
    """Embedding, attention, MLP and an output head, pre-norm."""

    embed: eqx.nn.Embedding
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, vocab: int, dim: int, heads: int, hidden: int, *, key: Any):
        keys = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=keys[1])
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, hidden, 1, activation=jax.nn.gelu, key=keys[2])
        self.head = eqx.nn.Linear(dim, vocab, key=keys[3])

    def __call__(self, tokens: jax.Array, activations: str | None = None) -> jax.Array:
        """Logits for `tokens`; `activations` optionally constrains the residual stream."""
        x = jax.vmap(self.embed)(tokens)
        y = jax.vmap(self.norm1)(x)
        x = x + self.attn(y, y, y)
        if activations is not None:
            x = constrain(x, activations)
        x = x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))
        return jax.vmap(self.head)(x)


def megatron_spec(model: Block) -> Any:
    """Heads, MLP units, the vocabulary and the embedding split over all devices."""
    return eqx.tree_at(
        lambda s: (
            s.attn.query_proj.weight,
            s.attn.key_proj.weight,
            s.attn.value_proj.weight,
            s.attn.output_proj.weight,
            s.mlp.layers[0].weight,
            s.mlp.layers[0].bias,
            s.mlp.layers[1].weight,
            s.head.weight,
        ),
        spec_of(model),
        ("o i -> o* i",) * 3
        + ("o i -> o i*", "o i -> o* i", "o -> o*", "o i -> o i*", "v d -> v* d"),
        is_leaf=lambda x: x is None,
    )


def _loss(model: Block, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(jax.vmap(model)(tokens))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


@eqx.filter_jit
def _step(model: Block, tokens: jax.Array, targets: jax.Array, keep: Any = None):
    loss, grads = eqx.filter_value_and_grad(_loss)(model, tokens, targets)
    model = eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))
    return loss, (model if keep is None else constrain(model, keep))


def main(console: Console) -> int:
    """Runs the demo and returns 0 when the sharded step matches, else 1."""
    devices = jax.devices()
    n = len(devices)
    dim = n * -(-64 // n)  # about 64, and divisible by the device count: any n works
    vocab = 4 * dim
    model = Block(vocab=vocab, dim=dim, heads=n, hidden=4 * dim, key=jax.random.key(0))
    spec = megatron_spec(model)
    sharded = apply(model, spec)
    p = plan(model, spec)

    console.print(
        f"[bold]eqshard demo[/bold]: a transformer block on {n} {devices[0].platform.upper()} "
        f"devices, tensor parallel (mesh {dict(p.mesh.shape) if p.mesh else 'per expression'})"
    )
    rows = leaf_rows(p)
    console.print(leaf_table(rows))
    total = sum(row.total_bytes for row in rows)
    console.print(
        f"parameters {human_bytes(total)}; each device holds "
        f"{human_bytes(total_bytes_per_device(rows) or 0)}\n"
    )

    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, vocab)
    targets = jnp.roll(tokens, -1, axis=1)
    loss_ref, ref = _step(model, tokens, targets)
    loss, updated = _step(sharded, tokens, targets, p)
    diffs = [
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(
            jax.tree_util.tree_leaves(eqx.filter(updated, eqx.is_array)),
            jax.tree_util.tree_leaves(eqx.filter(ref, eqx.is_array)),
        )
    ]
    kept = all(
        a.sharding.is_equivalent_to(b.sharding, a.ndim)
        for a, b in zip(
            jax.tree_util.tree_leaves(eqx.filter(updated, eqx.is_array)),
            jax.tree_util.tree_leaves(eqx.filter(sharded, eqx.is_array)),
        )
    )
    params, static = eqx.partition(sharded, eqx.is_array)
    hlo = (
        jax.jit(lambda q, t: jax.vmap(eqx.combine(q, static))(t))
        .lower(params, tokens)
        .compile()
        .as_text()
        or ""
    )
    ok = abs(float(loss) - float(loss_ref)) <= 1e-5 * abs(float(loss_ref)) and max(diffs) < 1e-4
    console.print(
        f"one eqx.filter_jit training step: loss {float(loss):.6f} sharded, {float(loss_ref):.6f} unsharded"
    )
    console.print(f"largest parameter difference after the update: {max(diffs):.1e}")
    console.print(f"parameters keep their layouts through the step: {kept}")
    console.print(
        f"the compiled forward pass communicates with {hlo.count('all-reduce(')} all-reduce(s) "
        f"and {hlo.count('all-gather(')} all-gather(s)"
    )
    console.print(
        "[green]sharded and unsharded agree[/green]" if ok and kept else "[red]MISMATCH[/red]"
    )
    return 0 if ok and kept else 1
