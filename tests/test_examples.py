"""The examples run and check what they claim, and their spec files are valid."""

import runpy
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest

import eqshard

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(scope="module")
def gpt_stacked() -> dict[str, Any]:
    """The namespace of examples/gpt_stacked.py, imported, not run as a script."""
    return runpy.run_path(str(EXAMPLES / "gpt_stacked.py"), run_name="not_main")


def test_gpt_stacked_trains_sharded_as_unsharded(gpt_stacked):
    result = gpt_stacked["main"](steps=2)
    assert len(result["losses"]) == len(result["reference"]) == 2
    np.testing.assert_allclose(result["losses"], result["reference"], rtol=1e-5)
    assert result["collectives"]["all-reduce"] >= 1
    assert tuple(result["plan"].mesh.axis_names) == ("data", "model")


def test_count_collectives_counts_async_starts_once_and_finds_loop_bodies(gpt_stacked):
    hlo = """\
%body.1 (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar = f32[4]{0} all-reduce(f32[4]{0} %x), replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %t = (s32[], f32[4]) tuple(%i, %ar)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]) while(%init), condition=%cond.1, body=%body.1
  %all-reduce-start.2 = f32[4]{0} all-reduce-start(f32[4]{0} %a), to_apply=%add
  %all-reduce-done.2 = f32[4]{0} all-reduce-done(f32[4]{0} %all-reduce-start.2)
  %ag = (f32[8]{0}, f32[8]{0}) all-gather(f32[4]{0} %a, f32[4]{0} %b), dimensions={0}
  ROOT %cp = f32[4]{0} collective-permute(f32[4]{0} %all-reduce-done.2), source_target_pairs={{0,1}}
}
"""
    count = gpt_stacked["count_collectives"]
    assert count(hlo) == {
        "all-reduce": 2,
        "all-gather": 1,
        "reduce-scatter": 0,
        "collective-permute": 1,
        "all-to-all": 0,
    }
    assert count(hlo, in_loops=True)["all-reduce"] == 1
    assert sum(count(hlo, in_loops=True).values()) == 1


def test_gpt_spec_file_is_valid(run_cli):
    result = run_cli("validate", EXAMPLES / "specs" / "gpt.eqshard.json")
    assert result.code == 0, result.out + result.err
    assert "ok" in result.out


def test_the_cost_of_the_stacked_gpt_is_what_megatron_implies(gpt_stacked):
    ns = gpt_stacked
    model = eqx.filter_eval_shape(ns["build"])
    optimizer = ns["optimizer"]()
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    state = jax.eval_shape(optimizer.init, params)
    rules = eqshard.load(ns["SPEC"])
    c = eqshard.cost(ns["step"], model, state, ns["batch"](), spec=rules, devices=8)
    moved = c.bytes_by_axes()
    # activations over `model` (the row-parallel layers), gradients over `data`
    assert set(moved) == {("all-reduce", ("data",)), ("all-reduce", ("model",))}
    assert 0 < moved[("all-reduce", ("data",))] <= c.memory.parameters + 64
    assert c.memory.optimizer == 2 * c.memory.parameters + 4  # AdamW's two moments
    assert c.estimate("h100").seconds > 0


def test_the_llama_spec_file_is_the_examples_spec():
    from llama_model import LLAMA_SPEC

    on_disk = eqshard.load(EXAMPLES / "specs" / "llama.eqshard.json")
    assert on_disk.rules == eqshard.load(LLAMA_SPEC).rules
    assert on_disk.mesh == eqshard.load(LLAMA_SPEC).mesh
