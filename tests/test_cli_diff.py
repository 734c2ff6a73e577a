"""`eqshard diff` and `eqshard.diff`: the leaves two specs lay out differently, and
with a step what the change costs. Exit codes as diff(1)'s: 0 alike, 1 different,
2 trouble."""

import importlib.util
import json
from pathlib import Path

import equinox as eqx
import jax
import pytest
import suggest_model as models

import eqshard
from eqshard._search._diff import diff

TESTS = Path(__file__).parent
DEMO = TESTS.parent / "examples" / "specs" / "demo"
MEGATRON, TWO_D = DEMO / "megatron.eqshard.json", DEMO / "2d.eqshard.json"
DEMO_MODEL = "eqshard._demo._model:build"
MODULE = TESTS / "suggest_model.py"
STEP = (
    *("--step", f"{MODULE}:mlp_step", "--optimizer", f"{MODULE}:mlp_optimizer"),
    *("--make-batch", f"{MODULE}:mlp_batch"),
)


def _write(folder: Path, name: str, document: dict) -> Path:
    path = folder / name
    path.write_text(json.dumps(document))
    return path


def test_each_leaf_laid_out_differently_is_one_line_with_both_sides(run_cli):
    done = run_cli("diff", MEGATRON, TWO_D, "--model", DEMO_MODEL)
    assert done.code == 1, done.err
    lines = done.out.splitlines()
    assert lines[:3] == [
        "mesh: model=8 -> data=2 x model=4",
        "batch: '... -> * ...' -> (the default)",
        "embed.weight: 'v d -> v* d' P('model', None) -> 'v d -> * v4 d' P('model', None) "
        "(4.0 KiB -> 8.0 KiB per device)",
    ]
    assert (
        "blocks.down.weight: '... o i -> ... o i*' P(None, None, 'model') -> "
        "'... o i -> * ... o i4' P(None, None, 'model') (16.0 KiB -> 32.0 KiB per device)"
    ) in lines
    assert lines[-1] == "on 8 devices, 9 of 17 array leaves are laid out differently"
    assert len(lines) == 2 + 9 + 1


def test_the_same_spec_exits_0(run_cli):
    done = run_cli("diff", TWO_D, TWO_D, "--model", DEMO_MODEL, "--simulate", 16)
    assert done.code == 0, done.err
    assert done.out.splitlines() == [
        f"{TWO_D} and {TWO_D} lay out the 17 array leaves alike on 16 devices"
    ]


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="a TPU slice's devices come from libtpu (eqshard[tpu])",
)
def test_on_a_tpu_slice_the_layouts_are_on_its_devices(run_cli):
    done = run_cli("diff", MEGATRON, TWO_D, "--model", DEMO_MODEL, "--target", "v5e:4x4")
    assert done.code == 1, done.err
    last = "on v5e:4x4 (16 devices), 9 of 17 array leaves are laid out differently"
    assert done.out.splitlines()[-1] == last
    assert "mesh: model=16 -> data=4 x model=4" in done.out


def test_an_optimizer_section_s_changes_are_listed_by_their_parameter(run_cli):
    data_parallel, zero_1 = DEMO / "data-parallel.eqshard.json", DEMO / "zero-1.eqshard.json"
    done = run_cli("diff", data_parallel, zero_1, "--model", DEMO_MODEL, "--format", "json")
    assert done.code == 1, done.err
    found = json.loads(done.out)
    assert (found["ok"], found["same"], found["leaves"]) == (True, False, 17)
    assert {c["part"] for c in found["changes"]} == {"optimizer state"}
    assert len(found["changes"]) == 17
    up = next(c for c in found["changes"] if c["path"] == "blocks.up.weight")
    assert (up["a"]["partition_spec"], up["b"]["partition_spec"]) == (
        "P()",
        "P(None, 'data', None)",
    )
    assert (up["a"]["bytes_per_device"], up["b"]["bytes_per_device"]) == (131072, 16384)


def test_expressions_that_give_every_device_the_same_blocks_are_no_change(run_cli, tmp_path):
    rules = [{"path": "embed.weight", "expr": "v d -> v* d"}]
    a = _write(tmp_path, "a.json", {"eqshard": 1, "rules": rules})
    b = _write(tmp_path, "b.json", {"eqshard": 1, "rules": [{**rules[0], "expr": "v d -> v8 d"}]})
    done = run_cli("diff", a, b, "--model", DEMO_MODEL)
    assert done.code == 0, done.out
    # the same split on a mesh whose axes are named: only the mesh changes
    named = {"eqshard": 1, "mesh": [["data", 2], ["model", 4]]}
    c = _write(tmp_path, "c.json", {**named, "rules": [{**rules[0], "expr": "v d -> * v4 d"}]})
    d = _write(tmp_path, "d.json", {"eqshard": 1, "rules": [{**rules[0], "expr": "v d -> * v4 d"}]})
    done = run_cli("diff", c, d, "--model", DEMO_MODEL)
    assert done.code == 1, done.out
    assert done.out.splitlines() == [
        "mesh: data=2 x model=4 -> m0=2 x m1=4",
        "on 8 devices, 0 of 17 array leaves are laid out differently",
    ]


@pytest.mark.slow  # compiles the step under both specs
def test_with_a_step_it_shows_the_change_in_memory_and_communication(run_cli, tmp_path):
    data = [["data", "*"]]
    a = _write(tmp_path, "a.json", {"eqshard": 1, "mesh": data})
    b = _write(tmp_path, "b.json", {"eqshard": 1, "mesh": data, "default": "fsdp"})
    done = run_cli("diff", a, b, "--model", f"{MODULE}:mlp_build", *STEP)
    assert done.code == 1, done.err
    model = eqx.filter_eval_shape(models.mlp_build)
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(models.mlp_optimizer().init, params)
    batch = eqx.filter_eval_shape(models.mlp_batch)
    found = diff(model, a, b, opt_state, batch, step=models.mlp_step, devices=8)
    assert done.out.splitlines() == found.lines()
    cost_a = eqshard.cost(
        model, opt_state, batch, step=models.mlp_step, spec=eqshard.load(a), devices=8
    )
    assert found.costs is not None
    assert found.costs[0].memory == cost_a.memory
    assert found.costs[0].bytes_by_axes() == cost_a.bytes_by_axes()
    lines = found.lines()
    why_a = [line for line in lines if line.startswith("why, in A: ")]
    why_b = [line for line in lines if line.startswith("why, in B: ")]
    assert why_a
    assert why_b
    assert all("cannot tell" not in line for line in why_a)
    assert "are summed over `data`" in why_a[0]  # replicated: the gradients' all-reduce
    assert [f"why, in A: {line}" for line in found.costs[0].explain().lines(2)] == why_a
    memory, moved, estimate = [line for line in lines if not line.startswith("why, in ")][-3:]
    assert memory.startswith("memory per device: peak (XLA:CPU) ")
    assert ", parameters 16.4 KiB -> 2.0 KiB (-88%), optimizer 32.8 KiB -> 4.1 KiB (-87%)" in memory
    assert moved.startswith("communication per step: data ")
    assert estimate.startswith("estimate on NVIDIA H100 SXM5: ")
    assert estimate.endswith("(compiled by XLA:CPU, 8 simulated devices)")
    json_done = run_cli("diff", a, b, "--model", f"{MODULE}:mlp_build", *STEP, "--format", "json")
    costs = json.loads(json_done.out)["cost"]
    assert costs["a"]["peak"] == cost_a.memory.peak
    assert costs["b"]["optimizer"] == found.costs[1].memory.optimizer
    assert costs["a"]["explained"] == found.costs[0].explain().lines()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            (MEGATRON, "missing.json"),
            "eqshard diff: error: unreadable:\n  missing.json: cannot read",
        ),
        ((MEGATRON, TWO_D, "--model", "nope:build"), "--model 'nope:build': cannot import 'nope'"),
        (
            (MEGATRON, TWO_D, "--make-batch", "m:b"),
            "--make-batch is for the step: name it with --step",
        ),
        ((MEGATRON, TWO_D, "--step", "m:s"), "--step needs --make-batch MODULE:CALLABLE"),
        ((MEGATRON, TWO_D, "--devices", 3), f"{MEGATRON} does not lay the model out on 3 devices"),
        (
            (MEGATRON, TWO_D, "--devices", 8, "--target", "v5e:2x4"),
            "argument --target: not allowed with argument --devices",
        ),
    ],
)
def test_trouble_exits_2_with_the_message(run_cli, args, message):
    if "--model" not in args:
        args = (*args, "--model", DEMO_MODEL)
    done = run_cli("diff", *args)
    assert done.code == 2, (done.out, done.err)
    assert message in done.err
    assert "Traceback" not in done.err


def test_a_spec_that_does_not_lay_the_model_out_exits_2(run_cli, tmp_path):
    bad = _write(
        tmp_path,
        "bad.json",
        {"eqshard": 1, "rules": [{"path": "pos.weight", "expr": "s d -> s d3"}]},
    )
    done = run_cli("diff", MEGATRON, bad, "--model", DEMO_MODEL)
    assert done.code == 2
    assert f"eqshard diff: error: {bad} does not lay the model out on 8 devices:\n" in done.err
    assert "pos.weight (Embedding.weight): float32[16, 64] 's d -> s d3'" in done.err


def test_the_library_refuses_arguments_without_a_step():
    with pytest.raises(eqshard.EqshardError, match="arguments after the specs are the step's"):
        diff(object(), str(MEGATRON), str(TWO_D), object())


@pytest.mark.slow  # `python -m eqshard diff --step` in a fresh interpreter
def test_the_command_line_diffs_in_a_worker_of_its_own(run_python, tmp_path):
    data = [["data", "*"]]
    a = _write(tmp_path, "a.json", {"eqshard": 1, "mesh": data})
    b = _write(tmp_path, "b.json", {"eqshard": 1, "mesh": data, "default": "fsdp"})
    args = ("diff", a, b, "--model", f"{MODULE}:mlp_build", *STEP, "--simulate", 4)
    done = run_python(["-m", "eqshard", *map(str, args)])
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stdout.splitlines() if not line.startswith("why, in ")]
    assert lines[-4] == "on 4 devices, 4 of 4 array leaves are laid out differently"
    assert lines[-1].endswith("(compiled by XLA:CPU, 4 simulated devices)")
    why = [line for line in done.stdout.splitlines() if line.startswith("why, in ")]
    assert why  # explained in the worker, carried back with the costs
    assert all(" over data at " in line for line in why)
