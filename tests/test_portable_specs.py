"""The specs `eqshard suggest` writes survive a change of device count.

Every candidate's rules name the mesh axis that scales with the device count `"*"`
(`data`, or `model` for Megatron), the tensor-parallel degree fixed: the rules
generated for 8 devices plan on 16 and 64 and lay out every leaf, every optimizer
state leaf and the batch there device by device as the candidate of the same
strategy and model-axis size generated for that count does. Where a split would not
divide on the new count (Megatron's 32-wide attention over 64 devices), planning
there names the leaf, as the planner always does: nothing is replicated silently.

Nothing here compiles but the command-line run, which is marked slow: plans are made
for device counts (abstract meshes)."""

import json
import re
import runpy
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqshard
from eqshard._plan import plan_faults
from eqshard._search._candidates import Candidate, _normal, candidates
from eqshard._search._families import STRATEGIES

# the GPT has no stacked experts, its `eqx.nn.MultiheadAttention` names no queries or
# keys, which the context families split by, and it runs no `eqshard.parallel.pipeline`
GPT_STRATEGIES = [
    s
    for s in STRATEGIES
    if s
    not in (
        "expert parallel",
        "data x expert",
        "context parallel",
        "fsdp x context",
        "pipeline x data",
    )
]

EXAMPLES = Path(__file__).parent.parent / "examples"
TESTS = Path(__file__).parent
MODULE = TESTS / "suggest_model.py"
ROWS = 64  # the batch's rows: it splits over 'data' on 8, 16 and 64 devices


@pytest.fixture(scope="module")
def gpt() -> dict[str, Any]:
    """The stacked GPT of examples/gpt_stacked.py, abstract, with its AdamW state and
    a batch of token ids, and its candidates generated for 8, 16 and 64 devices."""
    ns = runpy.run_path(str(EXAMPLES / "gpt_stacked.py"), run_name="not_main")
    model = eqx.filter_eval_shape(ns["build"])
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(ns["optimizer"]().init, params)
    batch = jax.ShapeDtypeStruct((ROWS, ns["SEQ"] + 1), jnp.int32)
    generated = {
        n: candidates(ns["step"], model, opt_state, batch, devices=n)[0] for n in (8, 16, 64)
    }
    return {**ns, "model": model, "batch": batch, "generated": generated}


def _key(candidate: Candidate) -> tuple[str, int]:
    """A candidate's strategy and the size of its 'model' axis: what stays fixed."""
    model = dict(candidate.mesh)["model"]
    return (candidate.strategy, 0 if candidate.strategy == "megatron" else model)


def _layouts(model: Any, rules: eqshard.Rules, devices: int, batch: Any) -> tuple[Any, ...]:
    """The rules' plan on `devices` (no devices), which must have no problem and no
    warning: its mesh, and every leaf's, optimizer state leaf's and the batch's
    layout as the devices see it (`_normal`, the candidates' own check)."""
    planned = plan_faults(model, rules, devices=devices)
    assert planned.problems == []
    assert planned.warnings == []
    plan = planned.plan
    assert plan.mesh is not None
    mesh = tuple(zip(plan.mesh.axis_names, plan.mesh.axis_sizes))
    assert rules.batch is not None
    on_batch = eqshard.expression.sharding(str(rules.batch), batch.shape, mesh=plan.mesh)
    return (
        mesh,
        tuple(map(_normal, plan.flat_shardings)),
        tuple(map(_normal, plan.optimizer.flat_shardings)),
        _normal(on_batch),
    )


def test_every_strategy_declares_star_and_keeps_its_layout_on_8_devices(gpt):
    kept = gpt["generated"][8]
    assert {c.strategy for c in kept} == set(GPT_STRATEGIES)
    for candidate in kept:
        data, model = dict(candidate.mesh)["data"], dict(candidate.mesh)["model"]
        assert data * model == 8
        rules = candidate.rules
        if candidate.strategy == "megatron":
            assert rules.mesh == (("data", 1), ("model", None)), candidate.name
            assert str(rules.batch) == "... -> * ..."
        else:
            assert rules.mesh == (("data", None), ("model", model)), candidate.name
            assert str(rules.batch) == "b ... -> b* ..." + (f" {model}" if model > 1 else "")
        texts = [str(rule.expr) for rule in rules.rules]
        # no count spells the scaling axis: each expression has one '*' and only the
        # tensor degree as a count (Megatron: no count at all)
        for text in texts:
            assert text.count("*") == 1, (candidate.name, text)
            counts = {int(c) for c in "".join(ch if ch.isdigit() else " " for ch in text).split()}
            assert counts <= ({model} if candidate.strategy != "megatron" else set()), text
        # on the run's own count the `*` rules give what the fixed counts gave
        layouts = _layouts(gpt["model"], rules, 8, gpt["batch"])
        assert layouts[0] == candidate.mesh
    by = {c.name: c.rules for c in kept}
    assert [str(r.expr) for r in by["data x tensor on data=2, model=4"].rules][:3] == [
        "v d -> * v4 d",
        "... o i -> * ... o i4",
        "... o i -> * ... o4 i",
    ]
    assert [str(r.expr) for r in by["fsdp x tensor on data=2, model=4"].rules][3:5] == [
        "... o i -> ... i* o4",  # 'data' on the input, the major axis
        "... o -> ... o4*",  # one dim over both axes
    ]
    assert [str(r.expr) for r in by["megatron on data=1, model=8"].rules][:2] == [
        "v d -> v* d",
        "... o i -> ... o i*",
    ]
    # the same layouts as the fixed counts gave, device by device
    fixed = eqshard.load(
        {
            "eqshard": 1,
            "mesh": [["data", 2], ["model", 4]],
            "rules": [
                {"path": r.path, "expr": re.sub(r"4\*", "8", str(r.expr)).replace("*", "2")}
                for r in by["fsdp x tensor on data=2, model=4"].rules
            ],
            "default": "fsdp",
            "batch": "b ... -> b2 ... 4",
        }
    )
    assert _layouts(gpt["model"], fixed, 8, gpt["batch"]) == _layouts(
        gpt["model"], by["fsdp x tensor on data=2, model=4"], 8, gpt["batch"]
    )


@pytest.mark.parametrize("devices", [16, 64])
def test_the_rules_for_8_devices_plan_on_more_as_those_generated_there(gpt, devices):
    """Each candidate for 8 devices, planned on `devices`, lays everything out as the
    candidate of its strategy and model-axis size generated for `devices` does; only
    Megatron on 64, whose attention (32 wide) does not split 64 ways, does not plan:
    its problems name those leaves, and the candidate generated there repairs them."""
    there = {_key(c): c for c in gpt["generated"][devices]}
    compared = []
    for candidate in gpt["generated"][8]:
        other = there[_key(candidate)]
        assert dict(other.mesh)["model"] == (
            devices if candidate.strategy == "megatron" else dict(candidate.mesh)["model"]
        )
        planned = plan_faults(gpt["model"], candidate.rules, devices=devices)
        if planned.problems:  # the split does not divide there: the planner says so
            assert (candidate.strategy, devices) == ("megatron", 64), candidate.name
            assert other.repairs  # generated there, the attention is replicated
            text = " ".join(str(p) for p in planned.problems)
            assert "blocks.attn.output_proj.weight" in text
            assert "does not split into 64 equal shards" in text
            continue
        ours = _layouts(gpt["model"], candidate.rules, devices, gpt["batch"])
        theirs = _layouts(gpt["model"], other.rules, devices, gpt["batch"])
        assert ours[0] == other.mesh, candidate.name
        assert ours == theirs, candidate.name
        compared.append(candidate.strategy)
    expected = GPT_STRATEGIES if devices == 16 else [s for s in GPT_STRATEGIES if s != "megatron"]
    assert sorted(set(compared)) == sorted(expected)
    assert len(compared) == len(gpt["generated"][8]) - (devices == 64)


def test_each_written_file_declares_star_and_plans_on_16_and_64(gpt, tmp_path):
    """The file `eqshard.dump` writes for each candidate (the best among them), read
    back with `eqshard.load`: its mesh says `"*"`, and it plans on 16 and 64 devices
    as the rules in memory do."""
    for k, candidate in enumerate(gpt["generated"][8]):
        path = tmp_path / f"{k}.eqshard.json"
        eqshard.dump(candidate.rules, path)
        document = json.loads(path.read_text())
        model = dict(candidate.mesh)["model"]
        if candidate.strategy == "megatron":
            assert document["mesh"] == [["data", 1], ["model", "*"]]
        else:
            assert document["mesh"] == [["data", "*"], ["model", model]]
            assert document["batch"].startswith("b ... -> b* ...")
        loaded = eqshard.load(path)
        for devices in (16, 64):
            if candidate.strategy == "megatron" and devices == 64:
                assert plan_faults(gpt["model"], loaded, devices=devices).problems
                continue
            assert _layouts(gpt["model"], loaded, devices, gpt["batch"]) == _layouts(
                gpt["model"], candidate.rules, devices, gpt["batch"]
            ), candidate.name


@pytest.mark.slow  # a suggest ranking: compiles each candidate in worker processes
def test_suggest_writes_a_spec_that_check_passes_on_16_and_64_devices(run_cli, tmp_path):
    path = tmp_path / "best.eqshard.json"
    done = run_cli(
        *("suggest", "--simulate", 8, "--model", f"{MODULE}:build"),
        *("--step", f"{MODULE}:step", "--optimizer", f"{MODULE}:optimizer"),
        *("--make-batch", f"{MODULE}:batch", "--write", path, "--format", "json"),
    )
    assert done.code == 0, done.err
    ranked = json.loads(done.out)
    best = ranked["suggestions"][ranked["best"]]
    document = json.loads(path.read_text())
    assert ["data", "*"] in document["mesh"] or ["model", "*"] in document["mesh"], document
    assert str(path) == ranked["written"]
    check = run_cli(
        *("check", path, "--model", f"{MODULE}:build", "--device-counts", 16, 64, "--strict"),
        *("--format", "json"),
    )
    assert check.code == 0, (best["strategy"], check.err, check.out)
    checks = json.loads(check.out)["checks"]
    assert len(checks) == 2
