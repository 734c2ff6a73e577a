"""`eqshard.cost` for GPUs this machine does not have, compiled by XLA:GPU through
JAX's CUDA plugin: where the plugin and `ptxas` are installed (`pip install
'jax[cuda12]'`), else skipped. `benchmarks/gpu_check.py` checks the same figures
against a real GPU's compile."""

import importlib.util

import jax
import pytest
from target_models import arguments as _arguments, step as _step

import eqshard
from eqshard._cost._targets import compile_target

if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
    pytest.skip("XLA:GPU comes with JAX's CUDA plugin (jax[cuda12])", allow_module_level=True)
try:
    compile_target("h100:8")
except eqshard.UsageError as error:  # no ptxas here
    pytest.skip(str(error), allow_module_level=True)

FSDP = eqshard.load({"eqshard": 1, "mesh": [["data", "*"]], "default": "fsdp"})


def test_a_step_compiled_for_gpus_reports_xla_gpus_figures():
    model, opt_state, x = _arguments()
    c = eqshard.cost(model, opt_state, x, step=_step, spec=FSDP, target="h100:8")
    gpus = compile_target("h100:8")
    assert c.compiler.startswith("XLA:GPU (NVIDIA H100 80GB HBM3, no GPU: jax-cuda1")
    assert c.target == "h100:8"
    assert c.devices == 8
    assert isinstance(c.mesh, jax.sharding.Mesh)
    assert tuple(c.mesh.devices.flat) == gpus.devices  # in the topology's order
    assert c.memory_per_device == 84_942_979_072  # as XLA's description of the H100 says
    assert c.hardware is eqshard.targets.HARDWARE["h100"]
    assert c.memory.platform == "gpu"
    assert c.memory.peak == c.memory.reported_peak  # XLA:GPU's own (benchmarks/gpu_check.py)
    assert c.memory.autotuned is False  # no GPU to time kernels on: said beside the peak
    assert "compiled with no GPU and so not autotuned" in c.memory.peak_includes
    # the program `eqshard.jit` trains with, compiled for the same devices: the same figures
    p = eqshard.plan(model, FSDP, devices=list(gpus.devices))
    with eqshard.use(p):
        compiled = eqshard.jit(_step).lower(model, opt_state, x).compile()
    analysis = compiled.memory_analysis()
    assert c.memory.arguments == analysis.argument_size_in_bytes
    assert c.memory.temporaries == analysis.temp_size_in_bytes
    assert c.memory.reported_peak == analysis.peak_memory_in_bytes
    # FSDP over 8: the weights gathered, the gradients scattered, over `data`
    kinds = {k.kind for k in c.collectives}
    assert {"all-gather", "reduce-scatter"} <= kinds or "all-reduce" in kinds
    assert all(k.axes == ("data",) for k in c.collectives)


def test_xla_gpus_flops_are_the_steps_flops():
    """The HLO reader counts XLA:GPU's matmuls (its own kernels or cuBLAS calls): the
    step's FLOPs, as XLA:CPU's program has them, within what each compiler's own
    rewrites of the products change (0.55% more on XLA:GPU here, which splits some
    products into batched ones)."""
    model, opt_state, x = _arguments()
    on_gpu = eqshard.cost(model, opt_state, x, step=_step, spec=FSDP, target="h100:8")
    on_cpu = eqshard.cost(model, opt_state, x, step=_step, spec=FSDP, devices=8)
    assert on_cpu.flops > 0
    assert abs(on_gpu.flops - on_cpu.flops) <= 0.01 * on_cpu.flops
    assert on_gpu.bytes_accessed > 0  # XLA's cost analysis of XLA:GPU's module


def test_several_hosts_of_gpus():
    gpus = compile_target("h200:2x4")
    assert len(gpus.devices) == 8
    assert {d.process_index for d in gpus.devices} == {0, 1}
    assert gpus.memory_per_device == 151_397_597_184
    assert gpus.compiler.startswith("XLA:GPU (NVIDIA H200 141GB HBM3e, no GPU: ")


@pytest.mark.slow  # compiles candidates in worker processes
def test_suggest_ranks_on_gpus_by_xla_gpus_figures():
    model, opt_state, x = _arguments()
    ranked = eqshard.suggest(
        model, opt_state, x, step=_step, target="h100:8", strategies=["fsdp", "data parallel"]
    )
    assert ranked.compiler.startswith("XLA:GPU (NVIDIA H100 80GB HBM3, no GPU: ")
    compiled = [s for s in ranked.suggestions if s.cost is not None]
    assert compiled
    for s in compiled:
        assert s.cost is not None
        assert s.cost.memory.platform == "gpu"
        assert s.cost.memory_per_device == 84_942_979_072
