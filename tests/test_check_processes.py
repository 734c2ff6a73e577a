"""`eqshard check` as a user runs it: the layouts of every count in one worker
process (a step, each count in a worker of its own: tests/test_cli_cost.py).

Each test runs `python -m eqshard check` in a subprocess (about 2 s);
`run_cli` checks in this process, as before.
"""

import json
from pathlib import Path

import pytest

from eqshard._cli._check import CheckResult, check
from eqshard._process._usercode import abstract_model
from eqshard._specfile._read import load

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "specs" / "transformer.eqshard.json"
MODEL = f"{ROOT / 'examples' / 'transformer.py'}:build"

OWN_COUNT = """
import os

import jax

jax.config.update("jax_num_cpu_devices", 16)  # its own count, before JAX starts

import jax.numpy as jnp
from helper_mod import width

print("a model that talks on stdout")
os.write(1, b"and below Python too\\n")


def build():
    return {"w": jnp.zeros((width, 4)), "b": jnp.zeros(4)}
"""

FAILING = """
print("a model that talks on stdout")


def build():
    raise RuntimeError("no weights here")
"""


def _check(run_python, *args):
    return run_python(["-m", "eqshard", "check", *map(str, args), "--format", "json"])


@pytest.mark.slow  # `python -m eqshard check` in a fresh interpreter, then its worker
def test_a_model_that_sets_its_own_device_count(run_python, tmp_path):
    (tmp_path / "helper_mod.py").write_text("width = 32\n")
    model = tmp_path / "own_count.py"
    model.write_text(OWN_COUNT)
    spec = tmp_path / "spec.eqshard.json"
    spec.write_text(json.dumps({"eqshard": 1, "rules": [{"path": "w", "expr": "a b -> a* b"}]}))
    result = _check(run_python, spec, "--model", f"{model}:build", "--device-counts", 2, 16)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # the one document: the model printed to stderr
    assert result.stderr.count("a model that talks on stdout") == 1  # built once for both
    assert result.stderr.count("and below Python too") == 1
    assert report["ok"] is True
    assert [c["devices"] for c in report["checks"]] == [2, 16]
    for c in report["checks"]:
        leaves = {leaf["path"]: leaf for leaf in c["leaves"]}
        assert leaves["w"]["partition_spec"] == "P('m0', None)"
        assert leaves["w"]["bytes_per_device"] == 32 * 4 * 4 // c["devices"]
        assert leaves["b"]["partition_spec"] == "P()"


@pytest.mark.slow  # `python -m eqshard check` in a fresh interpreter, then its worker
def test_a_model_that_fails_exits_2_with_one_document(run_python, tmp_path):
    model = tmp_path / "failing.py"
    model.write_text(FAILING)
    result = _check(run_python, EXAMPLE, "--model", f"{model}:build", "--device-counts", 2)
    assert result.returncode == 2
    document = json.loads(result.stdout)
    assert document["ok"] is False
    message = "build() raised RuntimeError: no weights here"
    assert message in document["error"]["message"]
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "a model that talks on stdout" in result.stderr


@pytest.mark.slow  # `python -m eqshard check` in a fresh interpreter, then its worker
def test_in_process_and_in_processes_agree(run_cli, run_python):
    args = [
        "check",
        EXAMPLE,
        "--model",
        MODEL,
        "--device-counts",
        "2",
        "6",
        "8",
        "--format",
        "json",
    ]
    here = run_cli(*args)
    there = run_python(["-m", "eqshard", *map(str, args)])
    assert (there.returncode, here.code) == (1, 1), there.stderr  # 6 does not divide 256
    assert json.loads(there.stdout) == json.loads(here.out)
    assert "Traceback" not in there.stderr


def test_results_come_back_equal_from_json():
    [result] = check(load(EXAMPLE), abstract_model(MODEL), [6])
    assert result.problems  # 6 does not divide 256: problems with carets
    assert result.rows[0].shape == (256, 64)  # JSON gives a list back
    assert CheckResult.from_json(result.to_json()) == result
    assert CheckResult.from_json(json.loads(json.dumps(result.to_json()))) == result
