"""`eqshard check --step`: what each spec costs per device and communicates per step.

Most tests check in this process (`run_cli`, on its 8 CPU devices); one runs the
command line as a user does, each device count in a worker process.
"""

import contextlib
import io
import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqshard
from eqshard._report import human_bytes

MODULE = """
import os
import signal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax


def build():
    return eqx.nn.MLP(64, 64, 256, 1, key=jax.random.key(0))


def optimizer():
    return optax.adam(1e-3)


def batch():
    return jnp.zeros((32, 64))


@eqx.filter_jit
def step(model, opt_state, x):
    def loss_fn(m):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    params = eqx.filter(model, eqx.is_array)
    updates, opt_state = optimizer().update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss


def failing_step(model, opt_state, x):
    raise ValueError("no step here")


def exiting_step(model, opt_state, x):
    raise SystemExit(3)  # a user's script that exits where it should not


class Stop(BaseException):
    pass


def stopping_step(model, opt_state, x):
    raise Stop("a BaseException of the user's own")


def rows():  # a batch whose activations outweigh the parameters
    return jnp.zeros((4096, 64))


def aborting_step(model, opt_state, x):  # a process death in the step's compile
    os.kill(os.getpid(), signal.SIGABRT)


def numpy_batch():  # NumPy on a JAX array: it needs values, not a trace
    return np.asarray(jnp.zeros((32, 64)))


def failing_numpy_batch():
    np.asarray(jnp.zeros((32, 64)))
    raise ValueError("no data here")


@eqx.filter_jit
def plain_step(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)
"""

REPLICATED = {"eqshard": 1, "default": "replicate"}
MEGATRON = {
    "eqshard": 1,
    "rules": [
        {"path": "layers.0.weight", "expr": "o i -> o* i"},
        {"path": "layers.0.bias", "expr": "o -> o*"},
        {"path": "layers.1.weight", "expr": "o i -> o i*"},
    ],
}
PARAMETER_BYTES = (64 * 256 + 256 + 256 * 64 + 64) * 4  # float32


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cost")
    module = folder / "costmodel.py"
    module.write_text(MODULE)
    specs = []
    for name, spec in (("replicated", REPLICATED), ("megatron", MEGATRON)):
        path = folder / f"{name}.eqshard.json"
        path.write_text(json.dumps(spec))
        specs.append(str(path))
    return specs, str(module)


def _step_args(module: str, step: str = "step") -> list[str]:
    return [
        "--model",
        f"{module}:build",
        "--step",
        f"{module}:{step}",
        "--optimizer",
        f"{module}:optimizer",
        "--make-batch",
        f"{module}:batch",
    ]


@pytest.fixture(scope="module")
def report(files):
    """Both specs, checked with the step on 8 devices, in this process, as JSON
    (once for the module: `run_cli` is a fixture of each test)."""
    from eqshard._cli._main import main

    specs, module = files
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        limits = ["--device-counts", "8", "--max-memory", "80GB", "--format", "json"]
        code = main(["check", *specs, *_step_args(module), *limits])
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue())


def test_replicated_communicates_only_the_gradient_all_reduce(report):
    replicated = report["checks"][0]
    assert replicated["ok"] is True
    assert replicated["problems"] == []
    cost = replicated["cost"]
    assert cost["parameters"] == PARAMETER_BYTES  # every device holds them all
    assert cost["gradients"] == PARAMETER_BYTES
    assert cost["optimizer"] == pytest.approx(2 * PARAMETER_BYTES, abs=64)  # adam: mu, nu
    assert cost["peak_lower_bound"] >= cost["parameters"] + cost["optimizer"]
    (moved,) = cost["communication"]  # the batch is split: the gradients are summed
    assert (moved["kind"], moved["axes"]) == ("all-reduce", ["m0"])
    assert moved["bytes"] == pytest.approx(PARAMETER_BYTES, abs=16)  # and the loss
    assert cost["flops"] > 0
    assert cost["estimate_h100_seconds"] > 0


def test_megatron_holds_an_eighth_of_the_parameters(report):
    replicated, megatron = (check["cost"] for check in report["checks"])
    assert report["checks"][1]["ok"] is True
    ratio = megatron["parameters"] / replicated["parameters"]
    assert ratio == pytest.approx(1 / 8, rel=0.05)  # layers.1.bias stays whole
    assert megatron["peak_lower_bound"] < replicated["peak_lower_bound"] / 4
    kinds = {entry["kind"] for entry in megatron["communication"]}
    assert kinds <= {"all-reduce", "all-gather", "reduce-scatter"}
    total = sum(entry["bytes"] for entry in megatron["communication"])
    assert total < PARAMETER_BYTES / 4  # activations move, not gradients


def test_text_shows_the_cost_and_the_specs_side_by_side(run_cli, files):
    specs, module = files
    result = run_cli("check", *specs, *_step_args(module), "--device-counts", 8)
    assert result.code == 0, result.out + result.err
    lines = result.out.splitlines()
    costs = [line for line in lines if line.startswith("cost: ")]
    assert len(costs) == 2
    assert costs[0].startswith("cost: parameters 129.2 KiB, optimizer 258.5 KiB, peak (XLA:CPU) ")
    assert "all-reduce over m0 129.3 KiB per step; estimate on an H100: " in costs[0]
    table = result.out[result.out.index("the checks side by side") :]
    for name in ("spec", "devices", "fits", "communication / step", "estimate (H100)"):
        assert name in table
    assert "parameters + optimizer / device" in table
    rows = [line for line in table.splitlines() if "eqshard.json" in line]
    assert len(rows) == 2
    assert "replicated.eqshard.json" in rows[0]
    assert "megatron.eqshard.json" in rows[1]
    assert all(" yes " in row for row in rows)
    assert "all-reduce over m0 129.3 KiB" in rows[0]


def test_more_than_max_memory_does_not_fit(run_cli, files):
    specs, module = files
    result = run_cli("check", specs[0], "--model", f"{module}:build", "--max-memory", "1KB")
    assert result.code == 1
    message = (
        f"{specs[0]}: the parameters alone take 129.2 KiB per device on 8 devices, more "
        "than --max-memory 1000 B: it does not fit"
    )
    assert message in result.out
    as_json = run_cli(
        "check", specs[0], "--model", f"{module}:build", "--max-memory", "1KB", "--format", "json"
    )
    assert as_json.code == 1
    (check,) = json.loads(as_json.out)["checks"]
    assert check["ok"] is False
    assert check["problems"] == [{"where": specs[0], "message": message.split(": ", 1)[1]}]


def test_max_memory_counts_the_temporaries_xla_cpu_allocates(run_cli, files):
    """XLA:CPU's own peak is its arguments and outputs: a step whose activations
    outweigh them needs its temporaries too, and a limit below the arguments and
    the temporaries does not fit (it did, by the compiler's own peak)."""
    specs, module = files
    args = _step_args(module)
    args[args.index(f"{module}:batch")] = f"{module}:rows"
    _, (found,) = _checks(run_cli("check", specs[0], *args, "--format", "json"))
    cost = found["cost"]
    allocated = cost["arguments"] + cost["outputs"] + cost["temporaries"]
    assert cost["peak"] == max(allocated, cost["reported_peak"]) == allocated
    assert cost["peak_includes"].startswith("arguments + outputs + temporaries: XLA:CPU's own")
    limit = cost["arguments"] + cost["temporaries"] - 1
    assert cost["reported_peak"] <= limit  # what the compiler's own peak passed
    result = run_cli("check", specs[0], *args, "--max-memory", limit)
    assert result.code == 1
    message = (
        f"{specs[0]}: the step needs, by XLA:CPU, {human_bytes(cost['peak'])} per device on "
        f"8 devices, more than --max-memory {human_bytes(limit).replace('.0 ', ' ')}: it does "
        "not fit"
    )
    assert message in result.out
    result, (bounded,) = _checks(
        run_cli("check", specs[0], *args, "--max-memory", limit, "--format", "json")
    )
    assert result.code == 1
    assert bounded["max_memory"] == {
        "bytes": limit,
        "from": "--max-memory",
        "needed": cost["peak"],
        "fits": False,
    }


def _checks(result):
    return result, json.loads(result.out)["checks"]


@pytest.mark.slow  # `python -m eqshard check --step` in a fresh interpreter
def test_a_worker_killed_while_compiling_names_the_signal_and_the_spec(run_python, files):
    """The step's compile ends the worker's process with SIGABRT, as XLA does where a
    check of its own fails (here the step kills its own process while it is traced):
    the error names the signal, and the spec and devices it was compiling under."""
    specs, module = files
    args = _step_args(module, "aborting_step")
    result = run_python(["-m", "eqshard", "check", specs[0], *args, "--device-counts", "8"])
    assert result.returncode == 2, result.stderr
    assert (
        "eqshard check: error: checking on 8 devices: the compiler aborted (SIGABRT, "
        f"signal 6) while compiling the step under {specs[0]} on 8 devices, and its "
        "process died without an answer; what it printed is above. XLA aborts where a "
        "check of its own fails, as its SPMD partitioner can for a layout it cannot "
        "partition"
    ) in result.stderr
    assert "Run the model's build" not in result.stderr


@pytest.mark.parametrize("size", ["12XB", "1.5", "GB", "-1GB", "0"])
def test_bad_max_memory_exits_2(run_cli, files, size):
    specs, module = files
    result = run_cli("check", specs[0], "--model", f"{module}:build", "--max-memory", size)
    assert result.code == 2
    assert "--max-memory" in result.err
    assert result.out == ""


def test_a_failing_step_and_a_missing_batch_exit_2(run_cli, files):
    specs, module = files
    result = run_cli("check", specs[0], *_step_args(module, "failing_step"))
    assert result.code == 2
    assert "raised ValueError: no step here" in result.err
    assert "Traceback" not in result.err
    result = run_cli("check", specs[0], "--model", f"{module}:build", "--step", f"{module}:step")
    assert result.code == 2
    assert "--step needs --make-batch" in result.err


@pytest.mark.parametrize(
    ("name", "raised"),
    [("exiting_step", "raised SystemExit: 3"), ("stopping_step", "raised Stop: a BaseException")],
)
@pytest.mark.parametrize("command", ["check", "suggest"])
def test_a_step_raising_a_base_exception_is_the_users_fault(run_cli, files, name, raised, command):
    """A step that raises `SystemExit` or another `BaseException` is named as the
    user's step, with exit 2: never an internal error of eqshard, nor an exit with
    the step's own code; in `suggest`'s compile workers too."""
    specs, module = files
    where = [specs[0]] if command == "check" else ["--devices", "2", "--workers", "1"]
    result = run_cli(command, *where, *_step_args(module, name))
    assert result.code == 2, result.err
    assert raised in result.err
    assert "internal error" not in result.err
    assert "bug in eqshard" not in result.err
    assert "Traceback" not in result.err


def test_cost_names_a_step_that_raises_a_base_exception():
    model = eqx.filter_eval_shape(lambda: eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0)))

    def exits(model, x):
        raise SystemExit(3)

    with pytest.raises(eqshard.EqshardError) as caught:
        eqshard.cost(model, jnp.zeros((8, 4)), step=exits, spec="... -> * ...")
    # the message itself; a note may name the user's frames below it
    assert re.search(
        r"cannot trace and compile the step .*exits .* it raised SystemExit: 3$",
        str(caught.value),
    )
    assert isinstance(caught.value.__cause__, SystemExit)


@pytest.mark.slow  # `python -m eqshard check --step` in a fresh interpreter
def test_worker_processes_carry_the_cost(run_python, files, report):
    specs, module = files
    command = ["-m", "eqshard", "check", specs[0], *_step_args(module)]
    result = run_python([*command, "--device-counts", "8", "--format", "json"])
    assert result.returncode == 0, result.stderr
    (check,) = json.loads(result.stdout)["checks"]
    expected = report["checks"][0]["cost"]
    seconds = expected["estimate_h100_seconds"]
    assert check["cost"]["estimate_h100_seconds"] == pytest.approx(seconds)
    assert {**check["cost"], "estimate_h100_seconds": seconds} == expected


@pytest.mark.parametrize("step", [None, "plain_step"])
def test_without_an_optimizer_the_column_holds_parameters_only(run_cli, files, step):
    specs, module = files
    with_step = (
        [] if step is None else ["--step", f"{module}:{step}", "--make-batch", f"{module}:batch"]
    )
    result = run_cli(
        "check", *specs, "--model", f"{module}:build", *with_step, "--device-counts", 8
    )
    assert result.code == 0, result.out + result.err
    table = result.out[result.out.index("the checks side by side") :]
    assert "parameters / device" in table
    assert "optimizer" not in table
    assert " 129.2 KiB " in table  # the replicated spec: every parameter, on every device


def test_a_batch_that_needs_values_runs_on_the_host(run_cli, files, report):
    specs, module = files
    args = _step_args(module)
    args[args.index(f"{module}:batch")] = f"{module}:numpy_batch"
    result = run_cli("check", specs[0], *args, "--device-counts", 8, "--format", "json")
    assert result.code == 0, result.err
    (check,) = json.loads(result.out)["checks"]
    assert check["cost"] == report["checks"][0]["cost"]  # the same batch, abstract or not
    args[args.index(f"{module}:numpy_batch")] = f"{module}:failing_numpy_batch"
    result = run_cli("check", specs[0], *args)
    assert result.code == 2
    raises = MODULE.splitlines().index('    raise ValueError("no data here")') + 1
    assert result.err == (
        f"eqshard check: error: --make-batch '{module}:failing_numpy_batch': failing_numpy_batch() "
        "(run on the host, as it needs concrete values: it calls NumPy on a JAX array, or "
        "branches on one) raised ValueError: no data here\n"
        "in the user's code (most recent call last):\n"  # where, in the user's file
        f"  {module}:{raises}, in failing_numpy_batch\n"
        '    raise ValueError("no data here")\n'
    )


def test_a_step_needs_as_many_devices_as_its_count(run_cli, files):
    # Layouts need no devices; compiling a step does: on 16, JAX here has 8, and
    # above MAX_SIMULATED no worker could simulate them.
    specs, module = files
    assert len(jax.devices()) == 8  # started, whatever ran before
    result = run_cli("check", specs[0], *_step_args(module), "--device-counts", 16)
    assert result.code == 1
    assert result.err == (
        "eqshard check: error: checking on 16 devices needs 16 simulated devices, but JAX "
        "started with 8 (is XLA_FLAGS setting a device count?)\n"
    )
    result = run_cli("check", specs[0], *_step_args(module), "--device-counts", 8, 65536)
    assert result.code == 1
    assert result.err == (
        "eqshard check: error: --device-counts 65536: --step compiles the step on simulated "
        "devices, up to 4096, or with --target on a TPU slice's, any number; without "
        "--step, layouts are checked on any count\n"
    )
    result = run_cli("check", specs[0], "--model", f"{module}:build", "--device-counts", 65536)
    assert result.code == 0, result.err
    assert f"{specs[0]} on 65536 devices: ok" in result.out


def test_check_says_why_each_byte_moves(run_cli, files, report):
    """The replicated spec's one all-reduce, explained in the JSON and under the cost
    line: the gradients of the MLP's four leaves, summed over the batch's axis, at the
    step's line in the user's module."""
    specs, module = files
    (why,) = report["checks"][0]["cost"]["explained"]
    line = MODULE.splitlines().index("        return jnp.mean(jax.vmap(m)(x) ** 2)") + 1
    assert why.startswith(f"all-reduce 129.3 KiB over m0 at {module}:{line}: the gradients of ")
    for leaf in ("layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"):
        assert leaf in why
    assert "summed over" in why
    result = run_cli("check", specs[0], *_step_args(module), "--device-counts", 8)
    assert result.code == 0, result.out + result.err
    shown = [text for text in result.out.splitlines() if text.startswith("why: ")]
    assert shown == [f"why: {why}"]


def test_explain_says_why_each_collective_moves_by_leaf_and_line(run_cli, files):
    """`eqshard explain`: under Megatron the one all-reduce is the row-parallel layer's
    output, summed over the mesh's axis at the MLP's line; JSON carries each
    collective's fields; `--top` keeps the most bytes and counts the rest."""
    specs, module = files
    done = run_cli("explain", specs[1], *_step_args(module), "--format", "json")
    assert done.code == 0, done.err
    found = json.loads(done.out)
    assert (found["ok"], found["devices"], found["compiler"][:7]) == (True, 8, "XLA:CPU")
    (summed,) = [c for c in found["collectives"] if c["kind"] == "all-reduce"]
    assert summed["leaves"] == ["layers.1.weight"]
    assert summed["reason"].endswith("is summed over `m0`: its contracting dim is split")
    assert summed["file"].endswith("costmodel.py")
    assert summed["line"] == 27
    assert summed["known"]
    assert summed["count"] == 1
    assert all(c["known"] for c in found["collectives"])
    text = run_cli("explain", specs[1], *_step_args(module), "--top", 1)
    assert text.code == 0, text.err
    assert "why each byte moves" in text.out
    assert "1 more collectives move fewer bytes" in text.out
    assert f"{specs[1]} on 8 devices: 2 of 2 collectives explained" in text.out


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ((), 2, "the following arguments are required: --step"),
        (("--simulate", 8, "--target", "v5e:2x4"), 2, "not allowed with argument"),
        (("--top", 0), 2, "argument --top"),
    ],
)
def test_explain_refuses_what_it_cannot_do(run_cli, files, args, code, message):
    specs, module = files
    base = ["--model", f"{module}:build"]
    if args:
        base = _step_args(module)
    done = run_cli("explain", specs[1], *base, *args)
    assert done.code == code
    assert message in done.err
