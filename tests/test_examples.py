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


@pytest.mark.slow  # trains sharded and unsharded and compares
def test_gpt_stacked_trains_sharded_as_unsharded(gpt_stacked):
    result = gpt_stacked["main"](steps=2)
    assert len(result["losses"]) == len(result["reference"]) == 2
    np.testing.assert_allclose(result["losses"], result["reference"], rtol=1e-5)
    assert result["collectives"]["all-reduce"] >= 1
    assert tuple(result["plan"].mesh.axis_names) == ("data", "model")


def test_gpt_spec_file_is_valid(run_cli):
    result = run_cli("validate", EXAMPLES / "specs" / "gpt.eqshard.json")
    assert result.code == 0, result.out + result.err
    assert "ok" in result.out


@pytest.mark.slow  # compiles the stacked GPT's step
def test_the_cost_of_the_stacked_gpt_is_what_megatron_implies(gpt_stacked):
    ns = gpt_stacked
    model = eqx.filter_eval_shape(ns["build"])
    optimizer = ns["optimizer"]()
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    state = jax.eval_shape(optimizer.init, params)
    rules = eqshard.load(ns["SPEC"])
    c = eqshard.cost(model, state, ns["batch"](), step=ns["step"], spec=rules, devices=8)
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
