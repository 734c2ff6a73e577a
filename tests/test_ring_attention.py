"""Ring attention (issue 32): with the sequence split over a mesh axis it equals plain
attention, forward and backward, causal or not; with no rules it is plain attention;
and the compiled step passes keys and values round the ring by exactly n - 1
collective-permutes each, of the hand-counted block, gathering nothing."""

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqshard
from eqshard import EqshardError, SpecError
from eqshard._ring_attention import _attention, ring_attention

NAMES = ("batch", "seq", "heads", None)
SHAPE = (2, 32, 4, 8)  # batch, seq, heads, head_dim
CONTEXT = {"batch": None, "seq": "context", "heads": None}
CASES = {  # mesh, dims, the layout of q and of the output
    "context 8": ([["context", 8]], CONTEXT, P(None, "context")),
    "data 2, context 4": (
        [["data", 2], ["context", 4]],
        {"batch": "data", "seq": "context", "heads": None},
        P("data", "context"),
    ),
    "context 4, heads over model 2": (
        [["context", 4], ["model", 2]],
        {"batch": None, "seq": "context", "heads": "model"},
        P(None, "context", "model"),
    ),
}


def _rules(mesh, dims):
    return eqshard.load({"eqshard": 1, "mesh": mesh, "dims": dims})


def _qkv(shape=SHAPE, dtype=jnp.float32):
    return tuple(
        jax.random.normal(key, shape, dtype) for key in jax.random.split(jax.random.key(0), 3)
    )


def _loss(attend, causal):
    def loss(q, k, v):
        o = attend(q, k, v, causal=causal)
        return jnp.sum(o * jnp.cos(o))  # not a plain sum: its gradient differs per position

    return loss


def _plain(q, k, v, *, causal):
    return _attention(q, k, v, causal=causal, scale=1 / np.sqrt(q.shape[-1]))


def _primitives(jaxpr):
    """The names of every primitive of a jaxpr, sub-jaxprs included."""
    found = set()
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found |= _primitives(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found |= _primitives(sub)
    return found


# --------------------------------------------------------------------------- #
# Equal to plain attention.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_with_the_sequence_split_it_equals_plain_attention_forward_and_backward(case, causal):
    mesh, dims, layout = CASES[case]
    q, k, v = _qkv()
    with jax.default_matmul_precision("highest"):
        want = _plain(q, k, v, causal=causal)
        want_grads = jax.grad(_loss(_plain, causal), argnums=(0, 1, 2))(q, k, v)
        with eqshard.use(_rules(mesh, dims)):
            jaxpr = jax.make_jaxpr(lambda q, k, v: ring_attention(q, k, v, NAMES))(q, k, v)
            got = eqx.filter_jit(ring_attention)(q, k, v, NAMES, causal=causal)
            grads = eqx.filter_jit(jax.grad(_loss(ring_attention, causal), argnums=(0, 1, 2)))(
                q, k, v
            )
    assert "shard_map" in _primitives(jaxpr.jaxpr)
    assert isinstance(got.sharding, NamedSharding)
    assert got.sharding.spec == layout
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for found, expected in zip(grads, want_grads):
        np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-6)


def test_rules_given_to_it_a_scale_and_bfloat16_keep_it_equal():
    rules = eqshard.Rules(
        (), dims={"b": None, "s": "context", "h": None}, mesh=(("context", 4), ("data", 2))
    )
    q, k, v = _qkv(dtype=jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        want = _attention(q, k, v, causal=True, scale=0.5)
        got = jax.jit(
            lambda q, k, v: ring_attention(
                q, k, v, ("b", "s", "h", None), causal=True, scale=0.5, rules=rules
            )
        )(q, k, v)
    assert got.dtype == jnp.bfloat16
    assert isinstance(got.sharding, NamedSharding)
    assert got.sharding.spec == P(None, "context")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2)


def test_a_sequence_of_one_position_per_device_masks_every_future_block_without_nan():
    q, k, v = _qkv((1, 8, 1, 4))
    with jax.default_matmul_precision("highest"), eqshard.use(_rules([["context", 8]], CONTEXT)):
        got = jax.jit(lambda q, k, v: ring_attention(q, k, v, NAMES, causal=True))(q, k, v)
    np.testing.assert_allclose(got, _plain(q, k, v, causal=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[:, 0], v[:, 0], rtol=1e-6)  # the first sees only itself


# --------------------------------------------------------------------------- #
# Plain attention where the sequence is whole.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_with_no_rules_it_is_plain_attention_bit_for_bit(causal):
    q, k, v = _qkv()
    jaxpr = jax.make_jaxpr(lambda q, k, v: ring_attention(q, k, v, causal=causal))(q, k, v)
    assert not {"shard_map", "ppermute"} & _primitives(jaxpr.jaxpr)
    np.testing.assert_array_equal(
        ring_attention(q, k, v, causal=causal), _plain(q, k, v, causal=causal)
    )
    f = jax.jit(lambda q, k, v: ring_attention(q, k, v, causal=causal))
    g = jax.jit(lambda q, k, v: _plain(q, k, v, causal=causal))
    np.testing.assert_array_equal(f(q, k, v), g(q, k, v))


def test_rules_that_leave_the_sequence_whole_give_plain_attention():
    q, k, v = _qkv()
    with eqshard.use(
        _rules([["data", 2], ["model", 4]], {"batch": "data", "seq": None, "heads": "model"})
    ):
        jaxpr = jax.make_jaxpr(lambda q, k, v: ring_attention(q, k, v, NAMES))(q, k, v)
        got = jax.jit(lambda q, k, v: ring_attention(q, k, v, NAMES))(q, k, v)
    assert not {"shard_map", "ppermute"} & _primitives(jaxpr.jaxpr)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(got, _plain(q, k, v, causal=False), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- #
# Its permutes, counted in the compiled step.
# --------------------------------------------------------------------------- #


def _splits(case) -> tuple[int, int, int]:
    """How many blocks the case's rules split the batch, the sequence and the heads into."""
    mesh, dims, _ = CASES[case]
    sizes: dict[str, int] = {str(name): int(size) for name, size in mesh}
    batch, seq, heads = (sizes.get(dims[name] or "", 1) for name in ("batch", "seq", "heads"))
    return batch, seq, heads


def _moved(case, *, backward):
    mesh, dims, _ = CASES[case]
    b, s, h = (f"{name}{n}" if n > 1 else name for name, n in zip("bsh", _splits(case)))
    batch = f"b s h d -> {b} {s} {h} d"  # q, k and v enter as the rules lay them out
    q = jax.ShapeDtypeStruct(SHAPE, jnp.float32)

    def forward(model, q, k, v):
        return jnp.sum(ring_attention(q, k, v, NAMES, causal=True))

    def gradient(model, q, k, v):
        value, grads = jax.value_and_grad(_loss(ring_attention, True), argnums=(0, 1, 2))(q, k, v)
        return value, sum(jnp.sum(g) for g in grads)

    step = gradient if backward else forward
    found = eqshard.cost((), q, q, q, step=step, spec=_rules(mesh, dims), batch=batch)
    assert found.batch == batch
    return found.collectives


def _hand(case):
    """What each device sends in one turn of the ring: its block of k (or of v),
    (batch / its split, seq / n, heads / its split, head_dim) float32s."""
    splits = _splits(case)
    b, s, h, d = SHAPE
    return (b // splits[0]) * (s // splits[1]) * (h // splits[2]) * d * 4


@pytest.mark.parametrize(
    ("case", "n", "hand"),
    [("context 8", 8, 2 * 4 * 4 * 8 * 4), ("data 2, context 4", 4, 1 * 8 * 4 * 8 * 4)],
)
def test_the_forward_passes_k_and_v_round_the_ring_in_n_minus_1_permutes_each(case, n, hand):
    assert _hand(case) == hand == 1024
    permutes = [
        (c.kind, c.bytes, c.count, c.axes, c.group_size, c.loop)
        for c in _moved(case, backward=False)
        if c.kind != "all-reduce"  # the loss's sum
    ]
    assert permutes == [("collective-permute", hand, n - 1, ("context",), 2, None)] * 2


def test_the_gradient_passes_them_back_round_the_ring_and_gathers_nothing():
    hand = _hand("context 4, heads over model 2")
    assert hand == 2 * 8 * 2 * 8 * 4
    moved = _moved("context 4, heads over model 2", backward=True)
    permutes = [
        (c.bytes, c.count, c.axes, "transpose" in c.source)
        for c in moved
        if c.kind == "collective-permute"
    ]
    # forward: k and v; backward: the same two, and their cotangents, back round the ring
    assert sorted(permutes) == sorted(
        [(hand, 3, ("context",), False)] * 2 + [(hand, 3, ("context",), True)] * 2
    )
    assert {c.kind for c in moved} <= {"collective-permute", "all-reduce"}, moved


# --------------------------------------------------------------------------- #
# Errors.
# --------------------------------------------------------------------------- #


def test_a_sequence_split_over_two_mesh_axes_is_refused():
    q, k, v = _qkv()
    rules = _rules([["data", 2], ["context", 4]], {"batch": None, "seq": "*", "heads": None})
    with pytest.raises(
        EqshardError,
        match=r"^`eqshard.parallel.ring_attention` lays out q, float32\[2, 32, 4, 8\], as \('batch', "
        r"'seq', 'heads', None\), which splits the sequence \('seq'\) over mesh axes "
        r"\['data', 'context'\]: the ring runs over one mesh axis; map that name to one "
        r"mesh axis in the rules' `dims`",
    ):
        ring_attention(q, k, v, NAMES, rules=rules)


def test_a_split_head_dim_is_refused():
    q, k, v = _qkv()
    rules = _rules([["context", 4], ["model", 2]], CONTEXT | {"d": "model"})
    with pytest.raises(
        EqshardError, match=r"which splits head_dim \('d'\) over mesh axes \['model'\]: each score"
    ):
        ring_attention(q, k, v, ("batch", "seq", "heads", "d"), rules=rules)


def test_a_sequence_the_mesh_axis_does_not_divide_is_refused():
    q, k, v = _qkv((2, 12, 4, 8))
    with pytest.raises(SpecError, match=r"has size 12, which does not split into 8 equal shards"):
        ring_attention(q, k, v, NAMES, rules=_rules([["context", 8]], CONTEXT))


@pytest.mark.parametrize(
    ("shapes", "names", "message"),
    [
        (
            [(32, 4, 8)] * 3,
            NAMES,
            r"^`eqshard.parallel.ring_attention` takes q, k and v of rank 4, \(batch, seq, heads, "
            r"head_dim\), and q is float32\[32, 4, 8\]; add the missing axes",
        ),
        (
            [SHAPE, SHAPE, (2, 32, 2, 8)],
            NAMES,
            r"^`eqshard.parallel.ring_attention` takes v shaped as q, \[2, 32, 4, 8\], and v is "
            r"\[2, 32, 2, 8\]; repeat grouped keys and values over the heads first",
        ),
        (
            [SHAPE] * 3,
            (..., "seq", "heads", None),
            r"names q's axes as \(Ellipsis, 'seq', 'heads', None\): give four names",
        ),
    ],
    ids=["rank", "shape", "names"],
)
def test_bad_shapes_and_names_are_refused(shapes, names, message):
    q, k, v = (jnp.zeros(shape) for shape in shapes)
    with pytest.raises(EqshardError, match=message):
        ring_attention(q, k, v, names)


def test_inside_eqshard_jit_on_a_mesh_of_explicit_axes_it_equals_plain_attention():
    """A plan on the user's Explicit mesh (`jax.make_mesh`'s default from JAX 0.9):
    the step's body keeps those axes, so ring attention's `shard_map` over that mesh
    runs, and equals plain attention."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((8,), ("context",), axis_types=(AxisType.Explicit,))
    model = eqx.nn.Linear(8, 24, key=jax.random.key(1))  # head_dim -> q, k, v
    x = _qkv()[0]

    def step(model, x):
        q, k, v = jnp.split(jax.vmap(jax.vmap(jax.vmap(model)))(x), 3, axis=-1)
        return ring_attention(q, k, v, NAMES, causal=True)

    def plain(model, x):
        q, k, v = jnp.split(jax.vmap(jax.vmap(jax.vmap(model)))(x), 3, axis=-1)
        return _plain(q, k, v, causal=True)

    p = eqshard.plan(model, _rules([["context", 8]], CONTEXT), mesh=mesh)
    with jax.default_matmul_precision("highest"):
        want = plain(model, x)
        with eqshard.use(p):
            got = eqshard.jit(step, batch="b s h d -> b s* h d")(eqshard.apply(model, p), x)
    assert isinstance(got.sharding, NamedSharding)
    assert got.sharding.mesh.axis_types == (AxisType.Explicit,)  # an output: replicated
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_explain_names_the_rings_permutes_and_no_pipeline():
    """Each permute of the ring is ring attention's, not a pipeline's (a permute in a
    loop is a pipeline's only where the step runs `eqshard.parallel.pipeline`)."""
    mesh, dims, _ = CASES["context 8"]
    q = jax.ShapeDtypeStruct(SHAPE, jnp.float32)

    def forward(model, q, k, v):
        return jnp.sum(ring_attention(q, k, v, NAMES, causal=True))

    b, s, h = (f"{name}{n}" if n > 1 else name for name, n in zip("bsh", _splits("context 8")))
    batch = f"b s h d -> {b} {s} {h} d"
    found = eqshard.cost((), q, q, q, step=forward, spec=_rules(mesh, dims), batch=batch)
    permutes = [e for e in found.explain() if e.collective.kind == "collective-permute"]
    assert len(permutes) == 2  # k's and v's, 7 turns each
    for e in permutes:
        assert e.collective.count == 7
        assert e.reason == (
            "ring attention passes each device's block of keys and values to the next over "
            "`context`, once a turn of the ring"
        )
