"""What a stateful model's step costs: `eqshard.cost` and `eqshard check --step` with
an `eqx.nn.State` (BatchNorm's running statistics) laid out by the plan, counted as
state, and named by its layers."""

import json
from pathlib import Path

import equinox as eqx
import jax
import pytest
import stateful_cost_model as net

import eqshard
from eqshard._cost._results import brief_source

MODULE = str(Path(__file__).parent / "stateful_cost_model.py")
MODEL, STATE = eqx.filter_eval_shape(net.build)
OPT_STATE = jax.eval_shape(
    net.optimizer().init, eqx.filter(MODEL, lambda x: isinstance(x, jax.ShapeDtypeStruct))
)
BATCH = eqx.filter_eval_shape(net.batch)
step, sgd_step = net.step, net.sgd_step

RULES = {
    "eqshard": 1,
    "rules": [
        {"path": "conv.weight", "expr": "o ... -> o* ..."},
        {"path": "bn.ema_state_index.*", "expr": "c -> c*"},
        {"path": "head.weight", "expr": "o i -> o i*"},
    ],
}
MEGATRON = {  # pure: no rule for the state, no dims: BatchNorm stays whole
    "eqshard": 1,
    "rules": [
        {"path": "conv.weight", "expr": "o ... -> o* ..."},
        {"path": "head.weight", "expr": "o i -> o i*"},
    ],
}
FSDP = {"eqshard": 1, "default": "fsdp"}
MODEL_BYTES = (16 * 3 * 3 * 3 + 16 + 16 + 16 + 8 * 16 + 8) * 4  # conv, bn, head, whole
STATE_NAMES = ["bn.ema_first_time_index", "bn.ema_state_index.0", "bn.ema_state_index.1"]


def _per_device(tree, plan) -> int:
    total = eqshard.report(tree, plan).bytes_per_device
    assert total is not None
    return total


def test_the_state_is_laid_out_by_the_plan_and_counted_as_state():
    rules = eqshard.load(RULES)
    of_the_pair = eqshard.plan((MODEL, STATE), rules)
    rows = eqshard.report(STATE, of_the_pair).rows
    assert [(row.path, row.partition_spec, row.bytes_per_device) for row in rows] == [
        ("bn.ema_first_time_index", "P()", 1),
        ("bn.ema_state_index.0", "P('m0')", 16 * 4 // 8),
        ("bn.ema_state_index.1", "P('m0')", 16 * 4 // 8),
    ]
    costs = [
        eqshard.cost(MODEL, STATE, OPT_STATE, BATCH, step=step, spec=rules, devices=8),
        eqshard.cost(MODEL, STATE, OPT_STATE, BATCH, step=step, spec=of_the_pair),
        eqshard.cost(MODEL, STATE, OPT_STATE, BATCH, step=step, spec=eqshard.plan(MODEL, rules)),
    ]
    for c in costs:  # bytes per device, exactly as the layouts give them
        assert c.memory.state == sum(row.bytes_per_device or 0 for row in rows) == 17
        assert c.memory.parameters == _per_device(MODEL, of_the_pair)
        assert c.memory.optimizer == _per_device(OPT_STATE, of_the_pair)  # moments, a count
        assert c.memory.gradients == c.memory.parameters
        assert c.memory.peak >= c.memory.parameters + c.memory.state + c.memory.optimizer
    assert costs[0].memory.parameters < MODEL_BYTES
    assert costs[0].memory == costs[1].memory == costs[2].memory
    assert costs[0].bytes_by_axes() == costs[1].bytes_by_axes() == costs[2].bytes_by_axes()


@pytest.mark.slow  # compiles the step under each spec
@pytest.mark.parametrize(
    ("spec", "batch", "gathered"),
    [
        # the batch split over the devices that split the weights: each weight is
        # gathered whole, and nothing else is
        (MEGATRON, None, [16 * 3 * 3 * 3 * 4, 8 * 16 * 4]),
        # the batch whole: FSDP's channels stay split through BatchNorm
        (FSDP, "... -> * ...", [8 * 16 * 4]),
    ],
    ids=["megatron", "fsdp"],
)
def test_a_pure_spec_gathers_no_state(spec, batch, gathered):
    plan = eqshard.plan((MODEL, STATE), eqshard.load(spec))  # as `check` makes it
    c = eqshard.cost(MODEL, STATE, OPT_STATE, BATCH, step=step, spec=plan, batch=batch)
    assert sorted(x.bytes for x in c.collectives if x.kind == "all-gather") == sorted(gathered)
    assert not [
        x.source for x in c.collectives if "BatchNorm" in x.source and x.kind != "all-reduce"
    ]
    assert c.memory.state == _per_device(STATE, plan)
    if spec is MEGATRON:
        assert c.memory.state == 1 + 2 * 16 * 4  # whole on every device
    else:
        assert c.memory.state == 1 + 2 * 16 * 4 // 8  # split as FSDP splits the parameters


def test_a_step_that_takes_the_pair_counts_its_state_as_state():
    def pair_step(pair, opt_state, batch):
        model, state = pair
        model, state, opt_state, value = step(model, state, opt_state, batch)
        return (model, state), opt_state, value

    rules = eqshard.load(RULES)
    c = eqshard.cost((MODEL, STATE), OPT_STATE, BATCH, step=pair_step, spec=rules, devices=8)
    plan = eqshard.plan((MODEL, STATE), rules)
    assert c.memory.state == 17
    assert c.memory.parameters == _per_device(MODEL, plan)
    assert c.memory.gradients == c.memory.parameters


def test_a_state_the_spec_cannot_lay_out_is_a_spec_error():
    rules = eqshard.load(
        {"eqshard": 1, "rules": [{"path": "bn.ema_state_index.0", "expr": "a b -> a* b"}]}
    )
    plan = eqshard.plan(MODEL, rules)  # the model's leaves are fine
    with pytest.raises(eqshard.SpecError, match=r"bn\.ema_state_index\.0"):
        eqshard.cost(MODEL, STATE, OPT_STATE, BATCH, step=step, spec=plan)


# A real name XLA gives an all-reduce it combined from the ops of a scanned GPT
# layer's backward pass (examples/gpt_stacked.py), its op list repeated to 3,000+.
_OPS = [
    "vmap(eqx.nn.LayerNorm)/reduce_sum",
    "eqx.nn.MultiheadAttention/vmap(eqx.nn.Linear)/dot_general",
    "vmap(eqx.nn.Linear)/reduce_sum",
]
_PREFIX = "jit(run)/transpose(jvp(vmap()))/while/body/closed_call/"
COMBINED = _PREFIX + "(" + ":".join(_OPS * 25) + ")"


def test_a_long_source_is_cut_for_tables():
    assert len(COMBINED) > 3000
    assert brief_source(COMBINED) == f"{_PREFIX}({_OPS[0]} +74 more)"
    short = "jit(run)/jvp(vmap(eqx.nn.Conv))/conv_general_dilated"
    assert brief_source(short) == short
    long = "jit(run)/" + "jvp(" * 40 + "vmap(eqx.nn.Linear)" + ")" * 40 + "/dot_general"
    cut = brief_source(long, width=60)
    assert len(cut) == 60
    assert cut == "jit(run)/jvp(jvp(jvp(jvp(jvp(…))))))))))))))))))/dot_general"
    # combined, and still too long: the short form, cut
    assert brief_source(_PREFIX + "(" + ":".join(_OPS) + ")", width=60) == _cut(
        f"{_PREFIX}({_OPS[0]} +2 more)", 60
    )


def _cut(text: str, width: int) -> str:
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


def test_the_harness_shows_the_cut_source_and_keeps_it_whole_in_json():
    from eqshard._cost._results import Collective
    from eqshard.testing._equivalence import _over_budget as lines
    from eqshard.testing._worker import _over_budget as document

    over = document([Collective("all-reduce", 4096, ("data",), COMBINED)], {"all-reduce": 0})
    (op,) = over[0]["ops"]
    assert op["source"] == COMBINED  # JSON: whole
    text = lines(8, json.loads(json.dumps(over)))
    assert text[1] == f"  4,096 bytes over (data) from {_PREFIX}({_OPS[0]} +74 more)"
    assert max(len(line) for line in text) < 200


def _files(tmp_path):
    specs = []
    for name, spec in (("rules", RULES), ("megatron", MEGATRON)):
        path = tmp_path / f"{name}.eqshard.json"
        path.write_text(json.dumps(spec))
        specs.append(str(path))
    return specs, MODULE


def _step_args(module: str, optimizer: bool = True) -> list[str]:
    args = ["--model", f"{module}:build", "--make-batch", f"{module}:batch"]
    if optimizer:
        return [*args, "--step", f"{module}:step", "--optimizer", f"{module}:optimizer"]
    return [*args, "--step", f"{module}:sgd_step"]


def test_check_step_names_the_state_by_its_layers(run_cli, tmp_path):
    specs, module = _files(tmp_path)
    result = run_cli("check", specs[0], *_step_args(module), "--format", "json")
    assert result.code == 0, result.out + result.err
    (found,) = json.loads(result.out)["checks"]
    rows = {row["path"]: row for row in found["leaves"]}
    assert [row["path"] for row in found["leaves"]][-3:] == STATE_NAMES
    assert found["state_leaves"] == 3
    assert rows["bn.ema_state_index.0"]["origin"] == "$.rules[1]"
    assert rows["bn.ema_state_index.0"]["partition_spec"] == "P('m0')"
    cost = found["cost"]
    state_bytes = sum(rows[name]["bytes_per_device"] for name in STATE_NAMES)
    assert cost["state"] == state_bytes == 17
    parameters = sum(row["bytes_per_device"] for row in found["leaves"][:-3])
    assert cost["parameters"] == parameters == found["bytes_per_device"] - 17
    plan = eqshard.plan((MODEL, STATE), eqshard.load(RULES))
    assert cost["optimizer"] == _per_device(OPT_STATE, plan)


@pytest.mark.slow  # `check --step` compiles the step
def test_check_step_text_shows_the_state(run_cli, tmp_path):
    specs, module = _files(tmp_path)
    result = run_cli("check", *specs, *_step_args(module), "--device-counts", "8")
    assert result.code == 0, result.out + result.err
    assert "│ bn.ema_state_index.0 " in result.out
    costs = [line for line in result.out.splitlines() if line.startswith("cost: ")]
    assert costs[0].startswith(
        "cost: parameters 504 B, state 17 B, optimizer 1012 B, peak (XLA:CPU) "
    )
    assert costs[1].startswith(
        "cost: parameters 504 B, state 129 B, optimizer 1012 B, peak (XLA:CPU) "
    )
    table = result.out[result.out.index("the checks side by side") :]
    assert "parameters + state + optimizer / device" in table
    assert " 1.5 KiB " in table  # 504 + 17 + 1012 bytes
    assert " 1.6 KiB " in table  # 504 + 129 + 1012 bytes


@pytest.mark.slow  # `check --step` compiles the step
def test_check_step_without_an_optimizer_passes_the_state(run_cli, tmp_path):
    specs, module = _files(tmp_path)
    result = run_cli("check", *specs, *_step_args(module, optimizer=False), "--device-counts", "8")
    assert result.code == 0, result.out + result.err
    costs = [line for line in result.out.splitlines() if line.startswith("cost: ")]
    assert costs[0].startswith("cost: parameters 504 B, state 17 B, peak (XLA:CPU) ")
    table = result.out[result.out.index("the checks side by side") :]
    assert "parameters + state / device" in table
    assert "optimizer" not in table
    assert " 521 B " in table  # 504 + 17 bytes
    assert " 633 B " in table  # 504 + 129 bytes


@pytest.mark.slow  # `python -m eqshard check --step` in a fresh interpreter
def test_check_step_in_worker_processes(run_python, tmp_path):
    specs, module = _files(tmp_path)
    command = ["-m", "eqshard", "check", specs[0], *_step_args(module), "--format", "json"]
    result = run_python(command)
    assert result.returncode == 0, result.stderr
    (found,) = json.loads(result.stdout)["checks"]
    assert [row["path"] for row in found["leaves"]][-3:] == STATE_NAMES
    assert (found["cost"]["parameters"], found["cost"]["state"]) == (504, 17)


def test_check_without_a_step_counts_the_state_with_the_parameters(run_cli, tmp_path):
    specs, module = _files(tmp_path)
    model = ["--model", f"{module}:build"]
    result = run_cli("check", *specs, *model, "--device-counts", "8", "--max-memory", "600B")
    assert result.code == 1
    assert (
        f"{specs[1]}: the parameters and state take 633 B per device on 8 devices, more than "
        "--max-memory 600 B: it does not fit"
    ) in result.out
    table = result.out[result.out.index("the checks side by side") :]
    assert "parameters + state / device" in table
    assert " 521 B " in table  # 504 + 17 bytes
