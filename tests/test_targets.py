"""`eqshard.cost` on a TPU slice, compiled by XLA:TPU on this CPU machine (libtpu)."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from target_models import arguments as _arguments, step as _step

import eqshard
from eqshard._cost._targets import compile_target

pytest.importorskip("libtpu", reason="the TPU compiler comes with libtpu (eqshard[tpu])")

FSDP = eqshard.load({"eqshard": 1, "default": "fsdp"})


def test_a_step_compiled_for_a_tpu_slice_reports_the_tpu_compilers_figures():
    model, opt_state, x = _arguments()
    c = eqshard.cost(model, opt_state, x, step=_step, spec=FSDP, target="v5e:2x4")
    slice_ = compile_target("v5e:2x4")
    assert c.compiler.startswith("XLA:TPU (libtpu ")
    assert c.target == "v5e:2x4"
    assert c.devices == 8
    assert isinstance(c.mesh, jax.sharding.Mesh)
    assert tuple(c.mesh.devices.flat) == slice_.devices  # in their order
    assert {d.platform for d in c.mesh.devices.flat} == {"tpu"}
    assert c.memory_per_device == 16 << 30
    assert c.fits is True
    assert c.hardware is eqshard.targets.HARDWARE["tpu-v5e"]
    assert c.estimate().hardware.name == "Google Cloud TPU v5e"
    # FSDP: each device holds an eighth of every weight (they split by 8)...
    weights = sum(
        x.size * 4 for x in jax.tree_util.tree_leaves(model) if isinstance(x, jax.ShapeDtypeStruct)
    )
    assert c.memory.parameters < weights / 4
    # ... gathers the weights over the data axis, and the TPU reduce-scatters gradients
    kinds = {kind for kind, _ in c.bytes_by_axes()}
    assert "all-gather" in kinds
    # the peak is XLA:TPU's own, not the sum of arguments, outputs and temporaries
    # (which was all `cost` reported): above it with JAX 0.10's libtpu, below with 0.12's
    allocated = c.memory.arguments + c.memory.outputs + c.memory.temporaries
    assert c.memory.reported_peak is not None
    assert c.memory.peak == c.memory.reported_peak != allocated


@pytest.mark.slow  # compiles for a TPU slice
def test_the_users_mesh_is_laid_over_the_slices_devices():
    model, opt_state, x = _arguments()
    cpu_mesh = jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    c = eqshard.cost(model, opt_state, x, step=_step, spec=FSDP, target="v5e:2x4", mesh=cpu_mesh)
    assert isinstance(c.mesh, jax.sharding.Mesh)
    assert c.mesh.axis_names == ("data", "model")
    assert c.mesh.devices.shape == (2, 4)
    assert np.array_equal(
        np.vectorize(lambda d: d.id)(c.mesh.devices),
        np.array([d.id for d in compile_target("v5e:2x4").devices]).reshape(2, 4),
    )
    assert {axes for _, axes in c.bytes_by_axes()} <= {("data",), ("model",), ("data", "model")}


def test_a_v4_chip_shows_its_two_cores_as_devices_with_half_its_memory_each():
    slice_ = compile_target("v4:2x2x1")
    assert len(slice_.devices) == 8  # 4 chips, 2 cores each
    assert slice_.memory_per_device == 16 << 30


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("a100:8", r"eqshard describes these GPUs to XLA: 'h100:8', 'h200:8'"),
        ("v5e", r"is neither a TPU slice nor GPUs; write a slice as `jax.experimental"),
        ("v2:2x2", r"eqshard has no profile of TPU v2; the generations it knows are v4, v5e"),
        ("v5e:3x3", r"libtpu refuses the slice: .*not divisible"),
    ],
)
def test_what_is_no_slice_says_why(target, message):
    model, opt_state, x = _arguments()
    with pytest.raises(eqshard.EqshardError, match=message):
        eqshard.cost(model, opt_state, x, step=_step, spec=FSDP, target=target)


def test_devices_or_a_plan_with_a_target_are_refused():
    model, opt_state, x = _arguments()
    with pytest.raises(eqshard.EqshardError, match=r"`devices=` and `target='v5e:2x4'`"):
        eqshard.cost(model, opt_state, x, step=_step, spec=FSDP, target="v5e:2x4", devices=8)
    plan = eqshard.plan(model, FSDP)
    with pytest.raises(eqshard.EqshardError, match=r"pass the spec the plan was made from"):
        eqshard.cost(model, opt_state, x, step=_step, spec=plan, target="v5e:2x4")


def test_without_libtpu_the_error_says_how_to_install_it(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    compile_target.cache_clear()
    try:
        with pytest.raises(eqshard.UsageError, match=r"pip install 'eqshard\[tpu\]'") as raised:
            compile_target("v5e:2x2")
        assert isinstance(raised.value, ModuleNotFoundError)  # a missing package, as Python says
        assert type(raised.value).__qualname__ == "UsageError[ModuleNotFoundError]"
    finally:
        compile_target.cache_clear()


def test_eqshard_jit_compiles_for_a_slice_before_any_tpu():
    """The step as it trains, compiled for the slice from abstract arguments: a plan
    on the slice's devices, `use(plan)`, `eqshard.jit(step).lower(...).compile()`;
    its memory is what `cost(target=)` reports, which compiles the same program."""
    model, opt_state, x = _arguments()
    slice_ = compile_target("v5e:2x4")
    p = eqshard.plan(model, FSDP, devices=slice_.devices)
    with eqshard.use(p):
        compiled = eqshard.jit(_step).lower(model, opt_state, x).compile()
    assert "all-gather" in compiled.as_text()
    c = eqshard.cost(model, opt_state, x, step=_step, spec=FSDP, target="v5e:2x4")
    analysis = compiled.memory_analysis()
    assert analysis.argument_size_in_bytes == c.memory.arguments
    assert analysis.temp_size_in_bytes == c.memory.temporaries
    assert analysis.peak_memory_in_bytes == c.memory.peak


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("v5e:0x4", r"each dim of the grid is a count of chips, at least 1, and '0x4' has 0"),
        (
            "v5e:2x2x2",
            r"TPU v5e chips form a grid of 2 dims, and '2x2x2' has 3; write one such as 'v5e:2x2'",
        ),
        ("v5p:4x4", r"TPU v5p chips form a grid of 3 dims"),
        ("v5p:64x64x64", r"holds 262144 chips, and a TPU v5p pod holds at most 8960"),
    ],
)
def test_a_grid_no_slice_has_is_refused_before_libtpu_sees_it(target, message, monkeypatch):
    """libtpu 0.0.50 died with SIGFPE on `v5e:0x4`: such a grid never reaches it."""

    def no_libtpu(name):
        raise AssertionError(f"libtpu was handed {name!r}")

    monkeypatch.setattr(eqshard._cost._targets, "_libtpu", no_libtpu)
    with pytest.raises(eqshard.EqshardError, match=message):
        compile_target(target)


@pytest.mark.slow  # a fresh interpreter: imports JAX and compiles for a TPU slice
def test_the_users_environment_is_left_as_it_was():
    """`cost(target=)` sets libtpu's variables while libtpu starts, and leaves the
    environment exactly as it found it: a fresh process, as libtpu starts once."""
    script = textwrap.dedent(
        """
        import os
        before = dict(os.environ)
        import equinox as eqx, jax, jax.numpy as jnp
        import eqshard

        model = eqx.filter_eval_shape(lambda: eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0)))
        step = lambda m, x: jnp.mean(jax.vmap(m)(x))
        x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
        c = eqshard.cost(model, x, step=step, spec=eqshard.FSDP, target="v5e:2x4")
        print(c.compiler.split(" (")[0])
        after = dict(os.environ)
        print(sorted(k for k in {*before, *after} if before.get(k) != after.get(k)))
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-2:] == ["XLA:TPU", "[]"]


def test_a_tpu_step_compiled_only_to_be_costed_has_the_same_figures():
    """XLA:TPU gets no cheaper options (none measured cheaper with the same figures):
    the step compiles as it runs, and every figure is the default compile's."""
    model, opt_state, x = _arguments()
    found = {
        how: eqshard.cost(
            model, opt_state, x, step=_step, spec=FSDP, target="v5e:2x4", compile_for=how
        )
        for how in ("running", "costing")
    }
    assert found["costing"].compiler_options == ()
    assert found["costing"].compiler == found["running"].compiler
    for c in found.values():
        assert c.collectives
    figures = {
        how: (
            c.memory,
            [(k.kind, k.bytes, k.axes, k.count) for k in c.collectives],
            c.flops,
            c.bytes_accessed,
        )
        for how, c in found.items()
    }
    assert figures["costing"] == figures["running"]
