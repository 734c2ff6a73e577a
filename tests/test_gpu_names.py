"""GPU targets' names and descriptions, without JAX's CUDA plugin: what `target=`
takes, what it refuses, and what it says where the plugin is missing."""

from importlib import metadata

import pytest

import eqshard
from eqshard._cost import _gpu
from eqshard._cost._gpu import gpu_target, is_gpu_name


@pytest.mark.parametrize(
    ("name", "gpu"),
    [("h100", True), ("h100:8", True), ("H200:2x8", True), ("a100:4", True), ("v5e:2x4", False)],
)
def test_a_gpu_is_told_from_a_tpu_slice_by_its_name(name, gpu):
    assert is_gpu_name(name) is gpu


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("a100:8", r"eqshard describes these GPUs to XLA: 'h100:8', 'h200:8' \(a GPU, then"),
        ("h100:0", r"hosts and GPUs per host are counts, at least 1"),
    ],
)
def test_what_eqshard_cannot_describe_is_refused(name, message):
    gpu_target.cache_clear()
    with pytest.raises(eqshard.EqshardError, match=message):
        gpu_target(name)


def test_without_the_plugin_the_error_says_how_to_install_it(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_gpu.metadata, "version", missing)
    gpu_target.cache_clear()
    try:
        with pytest.raises(eqshard.UsageError, match=r"pip install 'jax\[cuda12\]'") as raised:
            gpu_target("h100:8")
    finally:
        gpu_target.cache_clear()
    assert isinstance(raised.value, ModuleNotFoundError)


def test_a_field_an_older_plugin_does_not_know_is_left_out():
    description = (
        "gpu_device_info {\n"
        "  core_count: 132\n"
        "  device_interconnect_info {\n"
        "    active_links: 18\n"
        "  }\n"
        "  collective_memory_granularity: 2097152\n"
        "}\n"
        'platform_name: "CUDA"\n'
    )
    without = _gpu._without_field(description, "collective_memory_granularity")
    assert "collective_memory_granularity" not in without
    assert "active_links: 18" in without
    without = _gpu._without_field(without, "device_interconnect_info")
    assert without == 'gpu_device_info {\n  core_count: 132\n}\nplatform_name: "CUDA"\n'


@pytest.mark.parametrize("gpu", sorted(_gpu.GPUS))
def test_each_gpu_has_a_description_and_a_profile(gpu):
    from importlib import resources

    spec_file, profile = _gpu.GPUS[gpu]
    text = resources.files("eqshard._cost").joinpath("gpu_specs", spec_file).read_text()
    assert "Licensed under the Apache License" in text  # as openxla/xla ships it
    assert 'platform_name: "CUDA"' in text
    assert profile in eqshard.targets.HARDWARE


def test_a_plugin_that_did_not_load_says_how_to_start_jax(monkeypatch):
    from jax.experimental import topologies

    def refused(**_):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", refused)
    with pytest.raises(eqshard.UsageError, match=r'jax.config.update\("jax_platforms", "cpu"\)'):
        _gpu._devices("h100:8", "gpu_device_info {}\n", "1x1x8")
