"""Golden layouts (`eqshard.testing.assert_layouts`) record each leaf's memory kind
where it is not the device's, and its optimizer state's layout where the spec's
optimizer section gives it another: moving a weight into or out of host memory, or
data parallel becoming ZeRO-1, fails against a golden file written before, and a
version 1 golden file (which records neither) fails where it cannot tell."""

import json

import jax
import pytest

import eqshard._plan
from eqshard.testing import assert_layouts

needs_host_memory = pytest.mark.skipif(
    jax.__version_info__ < eqshard._plan.HOST_MEMORY_JAX,
    reason=f"host memory needs JAX 0.10; this is {jax.__version__} (test_old_jax_refuses_host_memory)",
)

BUILD = "harness_models:build"  # eqx.nn.MLP(16, 8, 32, 2): layers.0.weight is [32, 16]
SPLIT = {"path": "layers.0.weight", "expr": "o i -> o* i"}
DATA_PARALLEL = {"eqshard": 1, "mesh": [["data", "*"]], "default": "replicate", "rules": []}
ZERO_1 = {**DATA_PARALLEL, "optimizer": {"default": "fsdp"}}  # the moments split over 'data'


def _layouts(tmp_path, spec, golden):
    """`assert_layouts` on 2 devices, with `spec` written as a spec file."""
    path = tmp_path / "spec.eqshard.json"
    path.write_text(json.dumps(spec))
    assert_layouts(BUILD, path, golden=golden, device_counts=(2,))


def _update(tmp_path, spec, golden, monkeypatch):
    monkeypatch.setenv("EQSHARD_UPDATE", "1")
    _layouts(tmp_path, spec, golden)
    monkeypatch.delenv("EQSHARD_UPDATE")
    return json.loads(golden.read_text())


def _failure(tmp_path, spec, golden):
    with pytest.raises(AssertionError) as caught:
        _layouts(tmp_path, spec, golden)
    return str(caught.value)


@pytest.mark.slow  # golden files across counts
@needs_host_memory
def test_a_weight_moved_into_or_out_of_host_memory_names_the_leaf(tmp_path, monkeypatch):
    golden = tmp_path / "mlp.json"
    on_device = {"eqshard": 1, "rules": [SPLIT]}
    on_host = {"eqshard": 1, "rules": [{**SPLIT, "memory": "pinned_host"}]}
    recorded = _update(tmp_path, on_device, golden, monkeypatch)
    assert recorded["eqshard_golden"] == 2
    assert "memory" not in recorded["layouts"]["2"]["leaves"]["layers.0.weight"]

    text = _failure(tmp_path, on_host, golden)  # into host memory
    assert text.startswith(f"layouts differ from {golden} (golden -> now); if the change is")
    assert "on 2 devices, mesh {'m0': 2}:\n  ~ layers.0.weight\n      memory: 'device' -> " in text
    assert text.endswith("  ~ layers.0.weight\n      memory: 'device' -> 'pinned_host'")

    recorded = _update(tmp_path, on_host, golden, monkeypatch)
    assert recorded["layouts"]["2"]["leaves"]["layers.0.weight"] == {
        "expression": "o i -> o* i",
        "partition_spec": "P('m0', None)",
        "shape": [32, 16],
        "dtype": "float32",
        "bytes_per_device": 16 * 16 * 4,
        "memory": "pinned_host",
    }
    _layouts(tmp_path, on_host, golden)  # unchanged: passes
    text = _failure(tmp_path, on_device, golden)  # out of host memory
    assert text.endswith("  ~ layers.0.weight\n      memory: 'pinned_host' -> 'device'")


@pytest.mark.slow  # golden files across counts
def test_data_parallel_becoming_zero_1_names_each_split_state(tmp_path, monkeypatch):
    golden = tmp_path / "mlp.json"
    recorded = _update(tmp_path, DATA_PARALLEL, golden, monkeypatch)
    leaves = recorded["layouts"]["2"]["leaves"]
    assert not any("optimizer" in leaf for leaf in leaves.values())  # the state follows

    text = _failure(tmp_path, ZERO_1, golden)  # the parameters stay replicated
    assert text.startswith(f"layouts differ from {golden} (golden -> now); if the change is")
    assert (
        "  ~ layers.0.weight\n"
        "      optimizer expression: '... -> * ...' (the parameter's) -> 'd ... -> d2 ...'\n"
        "      optimizer partition_spec: 'P()' (the parameter's) -> \"P('data', None)\"\n"
        "      optimizer bytes_per_device: 2048 (the parameter's) -> 1024\n"
    ) in text
    assert "  ~ layers.2.bias\n" in text  # every leaf's moments: 6 leaves
    assert "\n      expression:" not in text  # the parameters stay as they were
    assert "\n      partition_spec:" not in text

    recorded = _update(tmp_path, ZERO_1, golden, monkeypatch)
    weight = recorded["layouts"]["2"]["leaves"]["layers.0.weight"]
    assert weight["partition_spec"] == "P()"
    assert weight["optimizer"] == {
        "expression": "d ... -> d2 ...",
        "partition_spec": "P('data', None)",
        "bytes_per_device": 1024,
    }
    assert golden.read_text().count("\n") == 10 + 6  # still one line per leaf
    _layouts(tmp_path, ZERO_1, golden)  # unchanged: passes
    text = _failure(tmp_path, DATA_PARALLEL, golden)  # and back
    assert (
        "      optimizer partition_spec: \"P('data', None)\" -> 'P()' (the parameter's)\n" in text
    )


@pytest.mark.slow  # golden files across counts
def test_a_version_1_golden_file_fails_where_it_cannot_tell(tmp_path, monkeypatch):
    golden = tmp_path / "mlp.json"
    recorded = _update(tmp_path, DATA_PARALLEL, golden, monkeypatch)
    golden.write_text(json.dumps({**recorded, "eqshard_golden": 1}))  # as eqshard wrote it
    _layouts(tmp_path, DATA_PARALLEL, golden)  # what it records still compares: passes

    text = _failure(tmp_path, ZERO_1, golden)
    assert text.startswith(
        f"{golden} is a golden file of version 1, which records neither memory kinds nor "
        "optimizer states' layouts, and the spec now has them, so the file cannot tell "
        "whether they changed; if these layouts are intended, run `pytest --eqshard-update` "
        "(or set EQSHARD_UPDATE=1) to record them, and commit the file:\n"
        "on 2 devices, mesh {'data': 2}:\n"
        "  layers.0.weight: its optimizer state P('data', None) ('d ... -> d2 ...'), not the "
        "leaf's P()\n"
    )
    assert "differ" not in text  # the parameters' layouts are the file's

    zero_1_split = {**ZERO_1, "rules": [{**SPLIT, "expr": "o i -> o i*"}]}
    text = _failure(tmp_path, zero_1_split, golden)  # and a change the file records
    assert (
        "\nand layouts differ from it (golden -> now):\non 2 devices, mesh {'data': 2}:\n" in text
    )
    assert "  ~ layers.0.weight\n      expression: '... -> * ...' -> 'o i -> o i*'\n" in text


@pytest.mark.slow  # golden files across counts
@needs_host_memory
def test_a_version_1_golden_file_fails_against_host_memory(tmp_path, monkeypatch):
    golden = tmp_path / "mlp.json"
    on_device = {"eqshard": 1, "rules": [SPLIT]}
    recorded = _update(tmp_path, on_device, golden, monkeypatch)
    golden.write_text(json.dumps({**recorded, "eqshard_golden": 1}))
    text = _failure(tmp_path, {"eqshard": 1, "rules": [{**SPLIT, "memory": "pinned_host"}]}, golden)
    assert text.startswith(f"{golden} is a golden file of version 1, which records neither ")
    assert text.endswith(
        "the file:\non 2 devices, mesh {'m0': 2}:\n  layers.0.weight: in host memory ('pinned_host')"
    )


def test_a_golden_file_of_another_version_is_refused(tmp_path):
    golden = tmp_path / "mlp.json"
    golden.write_text(json.dumps({"eqshard_golden": 3, "layouts": {}}))
    with pytest.raises(
        eqshard.EqshardError,
        match=r"mlp.json: not an eqshard golden file \(version 1 or 2\); rewrite it with `pytest",
    ):
        _layouts(tmp_path, DATA_PARALLEL, golden)
