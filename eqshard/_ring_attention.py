"""Ring attention: attention whose sequence is split over a mesh axis (context
parallelism), with each device keeping its own block of queries.

`ring_attention(q, k, v, names)` looks up the layout the active rules give `q`, as
`eqshard.constrain(q, names)` would. Where that layout splits the sequence axis over
one mesh axis of n devices, it runs a `jax.shard_map` over the layout's mesh. Each
device holds one block of queries, keys and values. In n steps it scores its queries
against the key/value block it holds and folds the scores into an online (flash-style)
softmax: a running maximum, sum and output, in float32. Between steps it passes its
keys and values to the next device with `jax.lax.ppermute`, n - 1 times in all, so no
device ever holds the whole sequence. Under `causal=True` the mask is by global
position. Other axes split by the layout (the batch over `data`, the heads over
`model`) stay split and take no part in the ring. With no rules active, or a layout
that leaves the sequence whole, it is plain attention, so model code that calls it
runs anywhere.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array

from ._activations import Names, activation_sharding
from ._constrain import constrained
from ._errors import EqshardError
from ._plan import Plan
from ._sharding import AnyMesh
from ._specfile._model import Rules

__all__ = ["ring_attention"]


def ring_attention(
    q: Array,
    k: Array,
    v: Array,
    names: Names = ("batch", "seq", "heads", None),
    *,
    causal: bool = False,
    scale: float | None = None,
    rules: Rules | Plan | None = None,
    mesh: AnyMesh | None = None,
) -> Array:
    """Attention whose sequence is split over a mesh axis, its keys and values passed
    round a ring of devices (context parallelism).

    **Example:**

    ```python
    class Attention(eqx.Module):
        def __call__(self, x):                       # x: (batch, seq, embed)
            q, k, v = self.project(x)                # each (batch, seq, heads, head_dim)
            o = eqshard.parallel.ring_attention(q, k, v, ("batch", "seq", "heads", None), causal=True)
            ...

    rules = eqshard.load({"eqshard": 1, "mesh": [["data", 2], ["context", 4]],
                          "dims": {"batch": "data", "seq": "context", "heads": None}})
    with eqshard.use(rules):
        loss = step(model, batch)                    # each device holds seq / 4 of q, k, v
    ```

    **Arguments:**

    - `q`, `k`, `v`: the queries, keys and values, each (batch, seq, heads, head_dim).
    - `names`: the names of `q`'s four axes, as for `eqshard.constrain`; the second
        names the sequence.
    - `causal`: whether each position attends only to itself and the positions before.
    - `scale`: what the scores are multiplied by; by default `1 / sqrt(head_dim)`.
    - `rules`: the `eqshard.Rules` (or a plan made from them) that lay out `names`,
        rather than those of `eqshard.use`.
    - `mesh`: the mesh to lay out on, as for `eqshard.constrain`.

    **Returns:**

    `softmax(q kᵀ · scale) v`, masked where `causal`, with the shape and dtype of `q`.
    Scores, softmax and sums are in float32. Under rules that split the sequence, it is
    laid out as `q` is; with none, or a sequence left whole, it is plain attention.

    **Raises:**

    - `eqshard.EqshardError`: `q` is not of rank 4, `k` or `v` is not shaped as `q`,
        `names` is not four names, the sequence is split over two mesh axes, or the last
        axis (head_dim) is split.
    - `eqshard.SpecError`: as for `eqshard.constrain`, the rules do not map a name or
        the layout does not fit, such as a sequence that the mesh axis does not divide.

    !!! info "Cost"

        Each device sends its key and value blocks to the next one n - 1 times, where n
        is the size of the mesh axis that splits the sequence: one `collective-permute`
        each, in a loop of n - 1 trips (and as many back in the gradient). Under
        `causal=True` a device still scores the blocks wholly in its future, then masks
        them out, so every device does the same work.
    """
    _check(q, k, v, names)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    target = activation_sharding(q, names, rules, mesh=mesh)
    axis = None if target is None else _ring_axis(target, names, q)
    if target is None or axis is None:
        return _attention(q, k, v, causal=causal, scale=scale)
    spec = PartitionSpec(*(None if e is PartitionSpec.UNCONSTRAINED else e for e in target.spec))
    q, k, v = constrained([q, k, v], [NamedSharding(target.mesh, spec)] * 3)
    n = target.mesh.shape[axis]
    ring = functools.partial(_ring, axis=axis, n=n, causal=causal, scale=scale)
    run = jax.shard_map(ring, mesh=target.mesh, in_specs=(spec,) * 3, out_specs=spec)
    return run(q, k, v)


def _text(names: Sequence[Any]) -> str:
    return "(" + ", ".join(repr(n) for n in names) + ")"


def _check(q: Any, k: Any, v: Any, names: Names) -> None:
    shape = tuple(getattr(q, "shape", ()))
    if len(shape) != 4:
        raise EqshardError(
            f"`eqshard.parallel.ring_attention` takes q, k and v of rank 4, (batch, seq, heads, "
            f"head_dim), and q is {getattr(q, 'dtype', type(q).__name__)}{list(shape)}; "
            "add the missing axes (`q[None]` for one sequence, `q[:, :, None]` for one head)"
        )
    for label, x in (("k", k), ("v", v)):
        if tuple(getattr(x, "shape", ())) != shape:
            raise EqshardError(
                f"`eqshard.parallel.ring_attention` takes {label} shaped as q, {list(shape)}, and "
                f"{label} is {list(getattr(x, 'shape', ()))}; repeat grouped keys and values "
                "over the heads first"
            )
    if not isinstance(names, (tuple, list)) or len(names) != 4 or ... in names:
        raise EqshardError(
            f"`eqshard.parallel.ring_attention` names q's axes as {names!r}: give four names, "
            "(batch, seq, heads, head_dim), such as ('batch', 'seq', 'heads', None), "
            "each a dim name or None, with no ..."
        )


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _ring_axis(target: NamedSharding, names: Names, q: Any) -> str | None:
    """The one mesh axis that splits the sequence (of more than one device), or
    `None` where the sequence is whole."""
    spec = list(target.spec) + [None] * (4 - len(target.spec))
    sizes = target.mesh.shape
    seq = [a for a in _axes(spec[1]) if sizes[a] > 1]
    last = [a for a in _axes(spec[3]) if sizes[a] > 1]
    label = (
        f"`eqshard.parallel.ring_attention` lays out q, {q.dtype}{list(q.shape)}, as {_text(names)}"
    )
    if last:
        raise EqshardError(
            f"{label}, which splits head_dim ({names[3]!r}) over mesh axes {last}: each "
            "score sums over the whole head_dim; map that name to null in the rules' "
            "`dims`, or write None for it"
        )
    if len(seq) > 1:
        raise EqshardError(
            f"{label}, which splits the sequence ({names[1]!r}) over mesh axes {seq}: the "
            "ring runs over one mesh axis; map that name to one mesh axis in the rules' "
            "`dims` (such as 'context'), not a shard modifier that spans several"
        )
    return seq[0] if seq else None


def _attention(q: Array, k: Array, v: Array, *, causal: bool, scale: float) -> Array:
    """Plain attention, in float32: what the ring computes, and its reference."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        rows, cols = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
        s = jnp.where(cols <= rows, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
    return o.astype(q.dtype)


def _ring(q: Array, k: Array, v: Array, *, axis: str, n: int, causal: bool, scale: float) -> Array:
    """One device's block of the output, inside `shard_map`: its queries against every
    key/value block, which pass round the ring of `axis`'s `n` devices."""
    i = jax.lax.axis_index(axis)
    size = q.shape[1]
    rows = i * size + jnp.arange(size)[:, None]

    def block(step: Any, k: Array, v: Array) -> tuple[Array, Array, Array]:
        """The block's scores folded to a maximum, a sum and an output, per row."""
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
        if causal:
            cols = ((i - step) % n) * size + jnp.arange(size)[None, :]
            s = jnp.where(cols <= rows, s, -jnp.inf)
        m = jax.lax.stop_gradient(jnp.max(s, axis=-1))  # the result does not depend on it
        p = jnp.exp(s - _finite(m)[..., None])
        o = jnp.einsum("bhqk,bkhd->bhqd", p, v.astype(jnp.float32))
        return m, jnp.sum(p, axis=-1), o

    def merge(
        a: tuple[Array, Array, Array], b: tuple[Array, Array, Array]
    ) -> tuple[Array, Array, Array]:
        (ma, la, oa), (mb, lb, ob) = a, b
        m = jnp.maximum(ma, mb)
        ca, cb = jnp.exp(ma - _finite(m)), jnp.exp(mb - _finite(m))
        return m, la * ca + lb * cb, oa * ca[..., None] + ob * cb[..., None]

    perm = [(j, (j + 1) % n) for j in range(n)]

    def turn(carry: Any, step: Array) -> tuple[Any, None]:
        k, v, folded = carry
        k, v = jax.lax.ppermute((k, v), axis, perm)
        return (k, v, merge(folded, block(step, k, v))), None

    folded = block(0, k, v)  # its own block first: under `causal`, every row sees one key
    (_, _, (_, total, o)), _ = jax.lax.scan(turn, (k, v, folded), jnp.arange(1, n))
    return jnp.einsum("bhqd->bqhd", o / total[..., None]).astype(q.dtype)


def _finite(m: Array) -> Array:
    """A running maximum, with 0 for a row whose scores are all masked so far (-inf):
    its exponentials are then 0, not NaN."""
    return jnp.where(jnp.isfinite(m), m, 0.0)
