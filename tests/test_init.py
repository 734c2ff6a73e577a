"""Building a model straight into its shards."""

import functools
import math
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqshard
from eqshard._init import _compiled, _groups


class Block(eqx.Module):
    """An attention block of `eqx.nn` modules, with dropout and layer norm."""

    attn: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = eqx.nn.MultiheadAttention(4, 32, key=k1)
        self.norm = eqx.nn.LayerNorm(32)
        self.up = eqx.nn.Linear(32, 128, key=k2)
        self.down = eqx.nn.Linear(128, 32, key=k3)
        self.dropout = eqx.nn.Dropout(0.25)


RULES = eqshard.load(
    {
        "eqshard": 1,
        "rules": [
            {"path": "**.*_proj.weight", "expr": "... o i -> ... o* i"},
            {"path": "**.up.weight", "expr": "... o i -> ... o* i"},
            {"path": "**.up.bias", "expr": "... o -> ... o*"},
            {"path": "**.down.weight", "expr": "... o i -> ... o i*"},
        ],
    }
)


def _stacked():
    return eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 2))


class CEMA(eqx.Module):
    """Float maths in a model's own init, as in Megalodon's CEMA: sigmoids, exps and
    logs of draws, a `linspace`, sums and a cumulative sum along dims that get split."""

    alpha: jax.Array
    theta: jax.Array
    gamma: jax.Array
    omega: jax.Array
    mix: jax.Array

    def __init__(self, key, d=128, n=16):
        k = jax.random.split(key, 5)
        self.alpha = jax.nn.sigmoid(jax.random.normal(k[0], (d, n)) * 0.2)
        freqs = jnp.exp(jnp.linspace(0.0, math.log(10000.0), n)) / d
        self.theta = jnp.log(freqs + jax.random.uniform(k[1], (d, n)) * 1e-3)
        g = jax.random.normal(k[2], (d, n, 2))
        self.gamma = g / jnp.sqrt(jnp.sum(g * g, axis=1, keepdims=True))
        self.omega = jnp.sum(jax.random.normal(k[3], (32, d, n)), axis=0)
        self.mix = jnp.cumsum(jnp.exp(-jnp.abs(jax.random.normal(k[4], (d, n)))), axis=1)


_cema = functools.partial(CEMA, jax.random.key(7))


SAME_SUMS = (0, 10)
"""The JAX whose XLA sums CEMA's draws in the same order in `init`'s programs (the
hash unrolled, a leaf in a program of its own) as in the recipe's; JAX 0.8 and 0.12
sum some in another order, so their sums differ in the last bits."""


def _recipe(factory, plan):
    """The usual recipe: the model's arrays in one `jit`, with the plan's shardings."""
    return jax.jit(lambda: eqx.filter(factory(), eqx.is_array), out_shardings=plan.shardings)()


def _assert_same_bits_and_shards(built, expected, exact=True):
    for a, b in zip(jax.tree_util.tree_leaves(built), jax.tree_util.tree_leaves(expected)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        assert a.dtype == b.dtype
        for x, y in zip(a.addressable_shards, b.addressable_shards):  # device by device
            assert x.device == y.device
            assert x.index == y.index
            if exact:
                assert np.asarray(x.data).tobytes() == np.asarray(y.data).tobytes()
            else:
                np.testing.assert_allclose(x.data, y.data, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("factory", "spec", "grouped"),
    [
        pytest.param(functools.partial(Block, jax.random.key(0)), RULES, False, id="block"),
        pytest.param(_stacked, RULES, False, id="stacked blocks", marks=pytest.mark.slow),
        pytest.param(_cema, "d ... -> d* ...", False, id="CEMA d8", marks=pytest.mark.slow),
        pytest.param(
            _cema,
            "d n ... -> d2 n4 ...",
            True,
            id="CEMA d2 n4, a program a leaf",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_init_equals_the_one_program_recipe_bit_for_bit(factory, spec, grouped, monkeypatch):
    if grouped:  # every leaf in a program of its own: still the same bits
        monkeypatch.setattr("eqshard._init._GROUP_BYTES", 0)
    plan = eqshard.plan(eqx.filter_eval_shape(factory), spec)
    built = eqshard.init(factory, plan)
    expected = _recipe(factory, plan)
    exact = factory is not _cema or jax.__version_info__[:2] == SAME_SUMS
    _assert_same_bits_and_shards(eqx.filter(built, eqx.is_array), expected, exact)
    if factory is _cema:
        return
    assert type(built.dropout.p) is float  # not an array, as under jax.jit(out_shardings=...)
    assert built.dropout.p == 0.25
    eager = factory()  # eqx.nn's initialisers: the same draws, within float rounding
    for a, b in zip(jax.tree_util.tree_leaves(built), jax.tree_util.tree_leaves(eager)):
        if eqx.is_array(b):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)
        else:
            assert a == b
    x = jnp.ones((2, 8, 32) if factory is _stacked else (8, 32))
    if factory is not _stacked:
        out = eqx.filter_jit(lambda m, x: m.attn(x, x, x))(built, x)
        np.testing.assert_allclose(out, eager.attn(x, x, x), rtol=1e-5, atol=1e-6)


class Scaled(eqx.Module):
    """GPT-2's init: normal draws times 0.02; and integer draws."""

    w: jax.Array
    ids: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w = jax.random.normal(k1, (64, 32)) * 0.02
        self.ids = jax.random.randint(k2, (64, 32), 0, 1000)


@pytest.mark.parametrize(
    "spec", ["... -> * ...", pytest.param("a b -> a2 b4", marks=pytest.mark.slow)]
)
def test_init_draws_what_an_eager_build_draws_and_may_round_its_float_maths_otherwise(spec):
    factory = functools.partial(Scaled, jax.random.key(1))
    eager = factory()
    built = eqshard.init(factory, spec)
    assert np.array_equal(np.asarray(built.ids), np.asarray(eager.ids))  # the same bits, any split
    # `normal(...) * 0.02` compiled as one program, which XLA may simplify, where eager
    # rounds the draw and then the product: values may differ in their last bit (the
    # documented caveat), never by more
    w, expected = np.asarray(built.w), np.asarray(eager.w)
    ulps = np.abs(w.view(np.int32).astype(np.int64) - expected.view(np.int32))
    assert ulps.max() <= 1
    assert np.array_equal(w, np.asarray(jax.jit(factory)().w))  # as the same maths compiled


def test_no_device_holds_more_of_a_leaf_than_its_shard():
    def factory():
        return eqx.nn.MLP(256, 256, 512, 2, key=jax.random.key(0))

    spec = eqshard.load({"eqshard": 1, "rules": [{"path": "**.weight", "expr": "o i -> o* i"}]})
    plan = eqshard.plan(eqx.filter_eval_shape(factory), spec)
    leaves = plan.resolved.leaves
    shard = {i: s.shard_shape(leaves[i].shape) for i, s in enumerate(plan.flat_shardings) if s}
    groups = _groups(list(leaves))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
    assert [i for group in groups for i in group] == arrays
    for group in groups:  # the programs `init` runs, one per group of leaves
        compiled = _compiled(factory, plan, group)
        analysis = compiled.memory_analysis()
        assert analysis is not None
        shards = [int(np.prod(shard[i])) for i in group]
        # per device: its shards of the group alone (and a few bytes of a tuple table)
        assert 4 * sum(shards) <= analysis.output_size_in_bytes < 4 * sum(shards) + 256
        # no random-number temporaries (rolled, they are 3x the group's shards): the
        # hash is fused into the loop that writes each output; a few keys remain
        assert analysis.temp_size_in_bytes < 4096 < 4 * max(shards)
        # and no buffer of the program, temporaries included, is larger than a shard
        sizes = [
            int(np.prod([int(d) for d in dims.split(",")]))
            for dims in re.findall(r"\w+\[(\d+(?:,\d+)*)\]", compiled.as_text())
        ]
        assert max(sizes) <= max(shards)
    assert max(int(np.prod(shard[i])) for i in arrays) < 512**2  # every weight is split


def test_init_names_a_factory_that_cannot_be_traced():
    with pytest.raises(eqshard.EqshardError, match="`factory` takes no arguments"):
        eqshard.init(lambda key: eqx.nn.Linear(2, 2, key=key))  # type: ignore[misc]


def _wide():
    """A model with NumPy 64-bit leaves, which JAX in 32-bit mode would cast."""
    return {
        "step": np.arange(4, dtype=np.int64) * 2**40,
        "scale": np.full(2, 1e300),
        "w": jnp.ones(8),
    }


_WIDE_UNDER_X64 = """
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, eqshard
built = eqshard.init(lambda: {"step": np.arange(4, dtype=np.int64) * 2**40, "scale": np.full(2, 1e300)}, "a -> a2 4")
assert built["step"].dtype == np.int64 and built["scale"].dtype == np.float64
assert np.array_equal(built["step"], np.arange(4) * 2**40) and (np.asarray(built["scale"]) == 1e300).all()
"""


def test_init_refuses_numpy_64_bit_leaves_as_apply_does(run_python):
    calls = []

    def factory():
        calls.append(1)
        return _wide()

    rule = (
        "is a NumPy {} array, and JAX runs with 32-bit types, so placing it would change its "
        "values; cast it (`x.astype(np.{})`) or enable `jax_enable_x64`"
    )
    with pytest.raises(eqshard.SpecError) as caught:
        eqshard.init(factory)
    assert str(caught.value).splitlines() == [
        "`eqshard.init` cannot place these leaves:",
        "  scale: " + rule.format("float64", "float32"),
        "  step: " + rule.format("int64", "int32"),
    ]
    assert len(calls) == 1  # found while `factory` was traced abstractly: built once
    with pytest.raises(eqshard.SpecError) as applying:
        eqshard.apply(_wide())
    assert str(applying.value).splitlines()[1:] == str(caught.value).splitlines()[1:]
    done = run_python(["-c", _WIDE_UNDER_X64])  # with `jax_enable_x64`, kept exactly
    assert done.returncode == 0, done.stderr


class Closures(eqx.Module):
    """Closures over arrays made in the constructor, as flowjax's flows hold them: a
    lambda, a function with a default, a static field, and a closure over a leaf."""

    w: jax.Array
    scale: Any
    shift: Any
    of_w: Any
    static: Any = eqx.field(static=True)

    def __init__(self, key):
        self.w = jax.random.normal(key, (16, 8))
        factor = jnp.arange(8.0) * 2
        offsets = (jnp.ones(8), 3)
        self.scale = lambda x: x * factor

        def shift(x, by=offsets):
            return x + by[0] * by[1]

        self.shift = shift
        w = self.w
        self.of_w = lambda x: w @ x
        self.static = functools.partial(lambda a, x: x - a, factor + 1)


def _rule(path, expr):
    return eqshard.load({"eqshard": 1, "rules": [{"path": path, "expr": expr}]})


def _no_tracer(tree):
    return eqshard._init.traced_closures(tree) == []  # pyright: ignore[reportAttributeAccessIssue]


def test_init_builds_the_arrays_closures_capture():
    factory = functools.partial(Closures, jax.random.key(0))
    eager = factory()
    built = eqshard.init(factory, _rule("w", "o i -> o* i"))
    assert _no_tracer(built)
    x = jnp.arange(8.0)
    for name in ["scale", "shift", "static"]:  # each once raised UnexpectedTracerError
        assert np.array_equal(getattr(built, name)(x), getattr(eager, name)(x)), name
    # a closure over a leaf of the model gets that leaf, in its shards, as eagerly
    assert built.of_w.__closure__[0].cell_contents is built.w
    np.testing.assert_allclose(built.of_w(x), eager.of_w(x), rtol=1e-6)
    out = eqx.filter_jit(lambda m, x: m.scale(m.of_w(x)[:8]))(built, x)
    np.testing.assert_allclose(out, eager.scale(eager.of_w(x)[:8]), rtol=1e-6)


def test_restore_refuses_a_like_whose_closures_hold_tracers(tmp_path):
    factory = functools.partial(Closures, jax.random.key(0))
    model = factory()
    eqx.tree_serialise_leaves(tmp_path / "m.eqx", model)
    like = eqx.filter_eval_shape(factory)
    with pytest.raises(eqshard.EqshardError) as caught:
        eqshard.restore(tmp_path / "m.eqx", like)
    message = str(caught.value)
    assert message.startswith("scale, shift, of_w, static: `like` holds a closure over an array")
    assert "restore into a concrete `like` (`eqshard.init(factory, plan)`" in message
    built = eqshard.init(factory)  # the concrete `like` it names
    restored = eqshard.restore(tmp_path / "m.eqx", built)
    assert _no_tracer(restored)
    assert np.array_equal(restored.scale(jnp.ones(8)), model.scale(jnp.ones(8)))


def _spectral(n_in=64, n_out=32):
    return eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
        eqx.nn.Linear(n_in, n_out, key=jax.random.key(0)), "weight", key=jax.random.key(1)
    )


@pytest.mark.parametrize(
    ("factory", "spec", "grouped"),
    [
        pytest.param(_spectral, "... -> * ...", False, id="replicated", marks=pytest.mark.slow),
        pytest.param(
            functools.partial(_spectral, 512, 256),
            _rule("**.layer.weight", "o i -> o* i"),
            False,
            id="weight split",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            functools.partial(_spectral, 512, 256),
            "... -> * ...",
            True,
            id="a program a leaf",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_init_equals_the_recipe_bit_for_bit_for_spectral_norm_state(
    factory, spec, grouped, monkeypatch
):
    # its power iterations multiply the weight's draw: with the hash unrolled, XLA fuses
    # the draw into them and the state `u`, `v` differed by up to 6e-8
    if grouped:
        monkeypatch.setattr("eqshard._init._GROUP_BYTES", 0)
    plan = eqshard.plan(eqx.filter_eval_shape(factory), spec)
    built = eqshard.init(factory, plan)
    _assert_same_bits_and_shards(eqx.filter(built, eqx.is_array), _recipe(factory, plan))
