"""`eqshard._compat`, the one reader of JAX's and Equinox's internals: each accessor
works on the installed versions, and where an internal is gone it raises an
`EqshardError` naming the version (or, where a fallback keeps every value, warns)."""

import functools
import importlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqshard
from eqshard import _compat
from eqshard._compat import (
    VersionWarning,
    backends_started,
    dce_jaxpr,
    filter_jit_donation,
    is_transposed,
    memory_stats,
    param,
    subjaxprs,
    unrolled_threefry,
    version,
)

JAX = re.escape(f"jax {jax.__version__}")


def test_backends_started_once_jax_has_devices():
    jax.devices()
    assert backends_started() is True


def test_backends_started_names_the_version_where_jax_moved_it(monkeypatch):
    bridge = importlib.import_module("jax._src.xla_bridge")
    monkeypatch.delattr(bridge, "backends_are_initialized")
    with pytest.raises(eqshard.EqshardError, match=rf"whether its backends have started .* {JAX}"):
        backends_started()


@pytest.mark.parametrize(
    ("donate", "expected"),
    [
        ("all", (True, True)),
        ("all-except-first", (False, True)),
        ("warn", (True, True)),
        ("warn-except-first", (False, True)),
        ("none", (False, False)),
    ],
)
def test_filter_jit_donation_reads_equinox(donate, expected):
    step = eqx.filter_jit(lambda x: x, donate=donate)
    assert filter_jit_donation(step) == expected


def test_filter_jit_donation_of_anything_else_is_none():
    assert filter_jit_donation(lambda x: x) is None
    assert filter_jit_donation(jax.jit(lambda x: x)) is None


def _compiled():
    def f(x):
        return jnp.sin(x) @ x.T

    return jax.jit(f).lower(jax.ShapeDtypeStruct((64, 32), jnp.float32)).compile()


def test_memory_stats_are_the_compilers_figures():
    analysis = _compiled().memory_analysis()
    assert analysis is not None
    stats = memory_stats(analysis)
    assert stats.arguments == analysis.argument_size_in_bytes == 64 * 32 * 4
    assert stats.outputs == analysis.output_size_in_bytes == 64 * 64 * 4
    assert stats.temporaries == analysis.temp_size_in_bytes
    assert stats.aliased == analysis.alias_size_in_bytes == 0
    assert stats.host_arguments == analysis.host_argument_size_in_bytes
    assert stats.peak == getattr(analysis, "peak_memory_in_bytes", None)


def test_memory_stats_never_default_a_missing_field():
    class Partial:  # an analysis from a JAX that dropped a field
        argument_size_in_bytes = 8
        output_size_in_bytes = 8

    with pytest.raises(eqshard.EqshardError, match=rf"`alias_size_in_bytes` on {JAX}"):
        memory_stats(Partial())
    with pytest.raises(eqshard.EqshardError, match="gave no memory analysis"):
        memory_stats(None)


def _scan_eqn():
    def f(xs):
        return jax.lax.scan(lambda c, x: (c + x, c * x), 0.0, xs)

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3))
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    return eqn


def test_param_reads_a_parameter_and_names_a_missing_one():
    eqn = _scan_eqn()
    assert param(eqn, "length") == 3
    with pytest.raises(eqshard.EqshardError, match=rf"`no_such` parameter of a `scan` .* {JAX}"):
        param(eqn, "no_such")


def test_subjaxprs_finds_a_scans_body():
    jaxpr = jax.make_jaxpr(lambda xs: jax.lax.scan(lambda c, x: (c + x, c), 0.0, xs))(jnp.ones(3))
    nested = list(subjaxprs(jaxpr.jaxpr))
    assert len(nested) == 1
    assert "add" in [e.primitive.name for e in nested[0].eqns]


def test_dce_jaxpr_keeps_only_what_the_outputs_need():
    def f(x):
        _ = jnp.exp(x)  # needed by nothing
        return jnp.sin(x)

    jaxpr = jax.make_jaxpr(f)(1.0).jaxpr
    assert [e.primitive.name for e in jaxpr.eqns] == ["exp", "sin"]
    assert [e.primitive.name for e in dce_jaxpr(jaxpr).eqns] == ["sin"]


def test_is_transposed_tells_the_gradients_backward_pass():
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(jnp.ones((4, 4)), jnp.ones((2, 4))).jaxpr
    flags = [is_transposed(e) for e in jaxpr.eqns]
    assert any(flags)
    assert not all(flags)
    assert not is_transposed(jax.make_jaxpr(loss)(jnp.ones((4, 4)), jnp.ones((2, 4))).eqns[0])


def test_unrolled_threefry_is_scoped_and_changes_no_value():
    def uniform(n):
        return jax.random.uniform(jax.random.key(3), (256, 256), maxval=n)

    def temp(compiled):
        return memory_stats(compiled.memory_analysis()).temporaries

    with unrolled_threefry():
        unrolled = jax.jit(functools.partial(uniform, 1.0)).lower().compile()
    assert temp(unrolled) < 1024
    # outside the block, the user's programs lower as JAX lowers them (rolled on CPU)
    rolled = jax.jit(functools.partial(uniform, 1.0)).lower().compile()
    assert temp(rolled) >= 2 * 256 * 256 * 4
    assert np.array_equal(np.asarray(unrolled()), np.asarray(rolled()))


def test_init_without_the_lowering_table_warns_and_gives_the_same_values(monkeypatch):
    factory = functools.partial(eqx.nn.Linear, 64, 32, use_bias=False, key=jax.random.key(0))
    expected = factory()
    plan = eqshard.plan(jax.eval_shape(factory), "a b -> a b*")
    monkeypatch.setattr(_compat, "_THREEFRY", ("jax._src.moved_away",))  # a JAX that moved it
    monkeypatch.setattr(_compat, "_WARNED", set())
    with pytest.raises(eqshard.EqshardError, match=rf"threefry primitive's CPU lowering .* {JAX}"):
        unrolled_threefry()
    with pytest.warns(VersionWarning, match="with their temporaries"):
        model = eqshard.init(factory, plan)
    assert np.array_equal(np.asarray(model.weight), np.asarray(expected.weight))


def test_version_is_the_installed_one():
    assert version() == jax.__version__
    assert version("equinox") == eqx.__version__


def test_sharding_type_error_is_what_explicit_axes_raise():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    w = jax.device_put(
        jnp.ones((8, 8)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "d"))
    )
    x = jax.device_put(
        jnp.ones((8, 8)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "d"))
    )
    with jax.set_mesh(mesh), pytest.raises(_compat.sharding_type_error(), match="out_sharding"):
        jax.jit(lambda w, x: x @ w.T)(w, x)


def test_sharding_type_error_names_the_version_where_jax_moved_it(monkeypatch):
    monkeypatch.delattr(importlib.import_module("jax._src.core"), "ShardingTypeError")
    with pytest.raises(eqshard.EqshardError, match=rf"Explicit axes .* {JAX}"):
        _compat.sharding_type_error()


def test_filter_jit_lower_traces_abstract_arguments_as_equinox_lowers():
    """Equinox's own `Lowered`, over a `jax.ShapeDtypeStruct` (traced, with its
    sharding) and a static argument; compiled, it is called as the step is."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    step = eqx.filter_jit(lambda x, n: x * n, donate="all")
    abstract = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharding)
    lowered = _compat.filter_jit_lower(step, (abstract, 3), {})
    assert "stablehlo.multiply" in lowered.as_text()
    out = lowered.compile()(jnp.ones(4), 3)
    assert out.tolist() == [3.0] * 4


def test_filter_jit_lower_names_the_version_where_equinox_moved_it(monkeypatch):
    monkeypatch.delattr(importlib.import_module("equinox._jit"), "_preprocess")
    step = eqx.filter_jit(lambda x: x)
    with pytest.raises(eqshard.EqshardError, match=r"eqx\.filter_jit step lowers .* equinox \d"):
        _compat.filter_jit_lower(step, (jax.ShapeDtypeStruct((2,), jnp.float32),), {})


@pytest.mark.parametrize("options", [None, {"xla_llvm_disable_expensive_passes": True}])
def test_filter_jit_compile_takes_xlas_options_on_every_equinox(options):
    """With options, or none: Equinox before 0.13.2 takes none in `compile()`, and the
    JAX program it holds is compiled with them instead. Either way, Equinox's compiled
    step, called as the step is."""
    step = eqx.filter_jit(lambda x, n: x * n)
    lowered = _compat.filter_jit_lower(step, (jnp.ones(4), 3), {})
    compiled = _compat.filter_jit_compile(lowered, options)
    assert compiled(jnp.ones(4), 3).tolist() == [3.0] * 4
    assert "multiply" in compiled.compiled.as_text()
