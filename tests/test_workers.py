"""Worker processes: one protocol for `check`, the harness and `cost` (the parent's
`sys.path`, errors rebuilt as the same class, timeouts as `EqshardError`s), and
workers that die with their parent."""

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqshard
from eqshard._cli._check_workers import check_in_processes
from eqshard._cost import _driver as _cost
from eqshard._process._workers import pool_answers, start_serving, start_worker, worker_answer
from eqshard.testing import assert_layouts

# A user's own module, importable only through a folder the test puts on `sys.path`.
USER_MODULE = """
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

OPTIMIZER = optax.adam(1e-3)


def build():
    return eqx.nn.MLP(8, 8, 32, 1, key=jax.random.key(0))


def batch():
    return jnp.zeros((16, 8))


def loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


@eqx.filter_jit
def step(model, state, x):  # cloudpickle sends it by value, and `loss` by name
    value, grads = eqx.filter_value_and_grad(loss)(model, x)
    updates, state = OPTIMIZER.update(grads, state)
    return eqx.apply_updates(model, updates), state, value


class StepError(Exception):
    pass


def failing_step(model, state, x):
    raise StepError("no step here")


def slow_build():
    time.sleep(600)
    return build()


def slow_step(model, state, x):
    time.sleep(600)
    return step(model, state, x)


def sleep():
    print("asleep", file=sys.stderr, flush=True)
    time.sleep(600)
"""
PARAMETER_BYTES = (8 * 32 + 32 + 32 * 8 + 8) * 4


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`eqshard_user_steps`, a module in a folder on `sys.path` (in this process only)."""
    (tmp_path / "eqshard_user_steps.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "eqshard_user_steps", raising=False)
    yield importlib.import_module("eqshard_user_steps")
    sys.modules.pop("eqshard_user_steps", None)


def _arguments(module):
    model = eqx.filter_eval_shape(module.build)
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return (
        model,
        jax.eval_shape(module.OPTIMIZER.init, params),
        jax.ShapeDtypeStruct((16, 8), jnp.float32),
    )


@pytest.mark.slow  # compiles in worker processes
def test_a_step_in_the_users_own_module_costs_on_more_devices(user_module):
    model, state, batch = _arguments(user_module)
    c = eqshard.cost(model, state, batch, step=user_module.step, spec="... -> * ...", simulate=16)
    assert c.devices == 16
    assert c.mesh is not None
    assert c.mesh.size == 16
    assert c.memory.parameters == PARAMETER_BYTES
    [((kind, axes), moved)] = c.bytes_by_axes().items()  # the gradients, over all 16
    assert kind == "all-reduce"
    assert set(axes) == set(c.mesh.axis_names)
    assert PARAMETER_BYTES <= moved <= PARAMETER_BYTES + 64


@pytest.mark.slow  # compiles in worker processes
def test_the_cost_workers_errors_come_back_as_the_same_class(user_module):
    model, state, batch = _arguments(user_module)
    spec = eqshard.load(
        {"eqshard": 1, "rules": [{"path": "layers.0.weight", "expr": "o i -> o32 i"}]}
    )
    with pytest.raises(eqshard.SpecError) as raised:
        eqshard.cost(model, state, batch, step=user_module.step, spec=spec, simulate=16)
    [problem] = raised.value.problems
    assert problem.where == "layers.0.weight (Linear.weight)"
    assert problem.message == (
        "float32[32, 8] 'o i -> o32 i': o32 shards need 32 devices, 16 are given; choose "
        "counts whose product is 16, or use '*' to take a share"
    )
    assert problem.detail == "    o i -> o32 i\n           ^^^^^"  # its caret
    assert str(raised.value).startswith("1 problem in the spec:\n  layers.0.weight (Linear")
    with pytest.raises(
        eqshard.EqshardError,
        match=r"^`eqshard.cost` cannot trace and compile the step failing_step on 16 devices "
        r"under the expression '\.\.\. -> \* \.\.\.': it raised StepError: no step here\n",
    ):  # the user's own error, named
        eqshard.cost(
            model, state, batch, step=user_module.failing_step, spec="... -> * ...", simulate=16
        )


@pytest.mark.parametrize("work", ["check", "harness", "cost"])
def test_a_worker_past_its_timeout_is_stopped_with_an_eqshard_error(
    work, user_module, tmp_path, monkeypatch
):
    if work == "check":
        spec = tmp_path / "spec.eqshard.json"
        spec.write_text(json.dumps({"eqshard": 1, "rules": []}))
        with pytest.raises(
            eqshard.EqshardError, match=r"^checking on 2 devices took longer than 0.5 s"
        ):
            check_in_processes([(str(spec), [2])], "eqshard_user_steps:slow_build", timeout=0.5)
    elif work == "harness":
        with pytest.raises(
            eqshard.EqshardError, match=r"^laying out on 2 devices took longer than 0.5 s"
        ):
            assert_layouts(
                "eqshard_user_steps:slow_build",
                "... -> * ...",
                golden=tmp_path / "golden.json",
                device_counts=(2,),
                timeout=0.5,
            )
    else:
        monkeypatch.setattr(_cost, "_TIMEOUT_SECONDS", 0.5)
        model, state, batch = _arguments(user_module)
        with pytest.raises(
            eqshard.EqshardError, match=r"^compiling the step on 16 devices took longer than 0.5 s"
        ):
            eqshard.cost(
                model, state, batch, step=user_module.slow_step, spec="... -> * ...", simulate=16
            )


PARENT = """
import os, sys, time
sys.path[:] = {path!r}
from eqshard._process._workers import start_worker

worker = start_worker({{}}, "eqshard_user_steps:sleep")
print(worker.pid, flush=True)
if {exit_at_once!r}:
    os._exit(0)  # gone before the worker has even started Python
time.sleep(600)
"""


def _alive(pid):
    """Whether process `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.mark.slow  # starts and kills worker processes
@pytest.mark.parametrize("ending", ["SIGKILL", "SIGTERM", "exit at once"])
def test_a_worker_dies_with_its_parent(ending, user_module):
    code = PARENT.format(path=sys.path, exit_at_once=ending == "exit at once")
    with subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as parent:
        assert parent.stdout is not None
        assert parent.stderr is not None
        pid = int(parent.stdout.readline())
        try:
            if ending != "exit at once":  # the worker runs `sleep` when its parent is killed
                assert select.select([parent.stderr], [], [], 60)[0], "the worker did not start"
                assert parent.stderr.readline() == "asleep\n"
                parent.send_signal(getattr(signal, ending))
            parent.wait(60)
            for _ in range(600):  # a bound for a hang, not a timing
                if not _alive(pid):
                    break
                time.sleep(0.1)
            assert not _alive(pid), f"the worker {pid} outlived its parent ({ending})"
        finally:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
            parent.kill()


# A pool's worker (`serve_each`): answers which request it was and which process
# answered it; request 0 waits until the last request has been answered elsewhere.
POOL_MODULE = """
import os
import time
from pathlib import Path

from eqshard._process._workers import serve, serve_each, tell


def main():
    return serve_each(answer)


def telling():  # tells three events, writes on fd 2 as XLA's C++ does, then answers
    def handle(request):
        for n in range(3):
            tell({"n": n})
        os.write(2, b"W0000 a C++ warning\\n")
        return "done"

    return serve(handle)


def answer(request):
    marker = Path(request["marker"]) if "marker" in request else None
    if request.get("wait"):  # held until the last request is done, by another worker
        for _ in range(1200):  # a bound for a hang, not a timing
            if marker.exists():
                break
            time.sleep(0.05)
    if request.get("die"):
        os.write(2, b"F0000 out of memory\\n")
        os._exit(5)  # as a compiler killed for its memory would: no answer
    if request.get("raise"):
        raise KeyError("no such request")
    time.sleep(request.get("sleep", 0))
    if request.get("last"):
        marker.write_text("done")
    print("noise on stdout", flush=True)  # goes to stderr, not into the answers
    return {"i": request["i"], "pid": os.getpid(), "first": "shared" in request}
"""


@pytest.fixture
def pool_module(tmp_path, monkeypatch):
    """`eqshard_pool_worker`, a module in a folder on `sys.path`."""
    (tmp_path / "eqshard_pool_worker.py").write_text(POOL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "eqshard_pool_worker:main"


def _pool(entry, requests, workers, timeout=120.0, **options):
    return pool_answers(
        requests,
        entry,
        workers,
        first={"shared": True},
        timeout=timeout,
        doing=[f"request {r['i']}" for r in requests],
        hint="Try it alone.",
        **options,
    )


@pytest.mark.slow  # starts worker processes
def test_a_pool_answers_every_request_once_in_order_and_a_free_worker_takes_the_rest(
    pool_module, tmp_path
):
    marker = str(tmp_path / "marker")
    requests = [{"i": i, "marker": marker} for i in range(9)]
    requests[0]["wait"] = True  # holds its worker until request 8 is answered
    requests[8]["last"] = True
    answers = _pool(pool_module, requests, 2)
    assert [a["i"] for a in answers] == list(range(9))  # each once, in the requests' order
    slow = answers[0]["pid"]
    others = {a["pid"] for a in answers[1:]}
    assert len(others) == 1  # one worker took all the rest
    assert slow not in others
    assert [a["first"] for a in answers].count(True) == 2  # the shared part once per worker


@pytest.mark.slow  # starts worker processes
def test_a_worker_that_dies_fails_only_its_request_and_a_fresh_one_goes_on(pool_module):
    requests = [{"i": i} for i in range(6)]
    requests[2]["die"] = True
    answers = _pool(pool_module, requests, 2)
    error = answers[2]
    assert isinstance(error, eqshard.ModelError)
    assert str(error).startswith("request 2: its process ended (exit code 5) without an answer")
    assert str(error).endswith("Try it alone.")
    assert [a["i"] for a in answers[:2] + answers[3:]] == [0, 1, 3, 4, 5]
    assert len({a["pid"] for a in answers[:2] + answers[3:]}) <= 3  # two, and one fresh
    assert [a["first"] for a in answers if isinstance(a, dict)].count(True) >= 2


@pytest.mark.slow  # starts worker processes
def test_quiet_workers_keep_their_stderr_and_one_that_dies_is_said_with_its_end(pool_module, capfd):
    requests = [{"i": i} for i in range(4)]
    requests[1]["die"] = True
    answered = []
    answers = _pool(pool_module, requests, 2, quiet=True, answered=answered.append)
    assert sorted(answered) == [0, 1, 2, 3]  # each once, as it was answered
    error = answers[1]
    assert isinstance(error, eqshard.ModelError)
    assert str(error).startswith("request 1: its process ended (exit code 5) without an answer")
    assert "; the last it wrote on stderr:\n" in str(error)
    assert "\nF0000 out of memory\n" in str(error)
    assert str(error).endswith("Try it alone.")
    assert [a["i"] for a in answers if isinstance(a, dict)] == [0, 2, 3]
    written = capfd.readouterr().err
    assert "noise on stdout" not in written  # what the workers wrote, kept from this process
    assert "F0000 out of memory" not in written


@pytest.mark.slow  # starts a worker process
def test_a_worker_tells_its_events_as_it_works_and_each_arrives_before_its_answer(
    pool_module, capfd
):
    heard = []
    worker = start_worker(
        {}, pool_module.replace(":main", ":telling"), quiet=True, events=heard.append
    )
    assert worker_answer(worker, 120.0, "telling", "")["result"] == "done"
    assert heard == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert "W0000 a C++ warning" not in capfd.readouterr().err
    assert worker.last_words() == "W0000 a C++ warning"


@pytest.mark.slow  # starts worker processes
def test_a_pool_stops_a_request_past_its_timeout_and_raises_an_answered_error(pool_module):
    answers = _pool(pool_module, [{"i": 0, "sleep": 600}, {"i": 1}], 1, timeout=2.0)
    assert isinstance(answers[0], eqshard.ModelError)
    assert str(answers[0]).startswith("request 0 took longer than 2 s, and was stopped")
    assert answers[1]["i"] == 1  # a fresh worker took it
    with pytest.raises(KeyError, match="no such request"):  # the same class
        _pool(pool_module, [{"i": 0}, {"i": 1, "raise": True}, {"i": 2}], 2)


def test_a_serving_worker_answers_each_request_in_turn(pool_module):
    worker = start_serving(pool_module)
    try:
        for i in range(3):
            worker.ask({"i": i}, 120.0)
            assert worker.answer(f"request {i}", "")["result"]["i"] == i
        worker.ask({"i": 3, "raise": True}, 120.0)
        with pytest.raises(KeyError):
            worker.answer("request 3", "")
        assert worker.running  # an answered error: it still serves
        worker.ask({"i": 4}, 120.0)
        assert worker.answer("request 4", "")["result"]["i"] == 4
    finally:
        worker.stop()
    assert not worker.running


# --------------------------------------------------------------------------- #
# A user's script: its model classes live in `__main__`, which cloudpickle sends by
# value. Each Equinox class must rebuild, in the worker, as a pytree of its fields.
# --------------------------------------------------------------------------- #

SCRIPT = '''
"""python script.py DEVICES MODE: a user's script, its model classes its own."""

import json
import sys

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))

import equinox as eqx
import jax.numpy as jnp
import optax

import eqshard


class Block(eqx.Module):  # an __init__ of its own, a static field
    weight: jax.Array
    bias: jax.Array
    activation: str = eqx.field(static=True)

    def __init__(self, size, key, activation="relu"):
        self.weight = jax.random.normal(key, (size, size)) / size
        self.bias = jnp.zeros(size)
        self.activation = activation

    def __call__(self, x):
        y = self.weight @ x + self.bias
        return jax.nn.relu(y) if self.activation == "relu" else jnp.tanh(y)


class Scaled(eqx.Module):
    scale: float = eqx.field(static=True, default=2.0, kw_only=True)

    def scaled(self, x):
        return self.scale * x


class Net(Scaled):  # the dataclass's __init__, a base of the script's, nested Blocks
    blocks: list
    head: jax.Array
    names: dict = eqx.field(static=True, default_factory=dict)
    tag: str = eqx.field(static=True, default="")

    def __post_init__(self):
        self.tag = f"{len(self.blocks)} blocks"

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return super().scaled(self.head @ x)


OPTIMIZER = optax.adam(1e-3)


def build():
    keys = jax.random.split(jax.random.key(0), 3)
    blocks = [Block(64, keys[0]), Block(64, keys[1], "tanh")]
    return Net(blocks=blocks, head=jax.random.normal(keys[2], (8, 64)))


def loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def step(model, state, x):
    value, grads = eqx.filter_value_and_grad(loss)(model, x)
    updates, state = OPTIMIZER.update(grads, state)
    return eqx.apply_updates(model, updates), state, value


if sys.argv[2] == "pickle":  # the model, its classes, and what they give here
    from eqshard._process._pickles import pickled

    net = build()
    here = {
        "structure": str(jax.tree_util.tree_structure(net)),
        "shapes": [list(leaf.shape) for leaf in jax.tree_util.tree_leaves(net)],
        "output": net(jnp.ones(64)).tolist(),
    }
    print(json.dumps({"here": here, "pickle": pickled((net, Net, Block), "the model", "")}))
    raise SystemExit(0)

model = eqx.filter_eval_shape(build)
params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
state = jax.eval_shape(OPTIMIZER.init, params)
batch = jax.ShapeDtypeStruct((32, 64), jnp.float32)
where = {"devices": 16} if len(jax.devices()) >= 16 else {"simulate": 16}  # here, or a worker
c = eqshard.cost(model, state, batch, step=step, spec=eqshard.FSDP, **where)
found = {
    "devices": c.devices,
    "memory": [c.memory.parameters, c.memory.optimizer, c.memory.peak],
    "flops": c.flops,
    "collectives": sorted([k.kind, k.bytes, list(k.axes)] for k in c.collectives),
}
if sys.argv[2] == "suggest":
    ranked = eqshard.suggest(
        model, state, batch, step=step, devices=4, workers=1, strategies="fsdp,data parallel"
    )
    found["best"] = None if ranked.best is None else ranked.best.name
    found["ranked"] = len(ranked)
    found["errors"] = [s.error for s in ranked if s.error is not None]
print(json.dumps(found))
'''

# the other side: the script's model and classes read back in a fresh process
REBUILT = """
import json
import sys

import jax
import jax.numpy as jnp

from eqshard._process._pickles import unpickled

net, Net, Block = unpickled(json.load(sys.stdin)["pickle"], "the model")
made = Net(blocks=[Block(64, jax.random.key(0))], head=jnp.ones((8, 64)))
print(json.dumps({
    "structure": str(jax.tree_util.tree_structure(net)),
    "shapes": [list(leaf.shape) for leaf in jax.tree_util.tree_leaves(net)],
    "output": net(jnp.ones(64)).tolist(),
    "jitted": jax.jit(lambda m, x: m(x))(net, jnp.ones(64)).tolist(),
    "classes": [type(net) is Net, type(net.blocks[0]) is Block],
    "made": [made.scale, made.names, made.tag, made.blocks[0].activation],
}))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _ran(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow  # two fresh interpreters
def test_a_script_s_module_classes_rebuild_in_another_process_with_their_fields(run_python, script):
    sent = run_python([str(script), "1", "pickle"])
    there = _ran(run_python(["-c", REBUILT], stdin=sent.stdout))
    here = _ran(sent)["here"]
    assert there["structure"] == here["structure"]  # static fields among the aux data
    assert "'tanh'" in there["structure"]
    assert there["shapes"] == here["shapes"] == [[64, 64], [64], [64, 64], [64], [8, 64]]
    assert there["output"] == here["output"]
    assert there["jitted"] == pytest.approx(here["output"], rel=1e-6)
    assert there["classes"] == [True, True]  # one class each, however often it is met
    assert there["made"] == [2.0, {}, "1 blocks", "relu"]  # its defaults and methods


@pytest.mark.slow  # compiles in worker processes, from two fresh interpreters
def test_a_script_s_model_costs_on_more_devices_and_suggest_ranks_it(run_python, script):
    """`cost(simulate=16)` beyond the script's one device compiles in a worker, which
    rebuilds the script's classes with their fields: the same figures as on 16
    devices in the script's own process; and `suggest`'s workers rank it."""
    in_a_worker = _ran(run_python([str(script), "1", "suggest"]))
    here = _ran(run_python([str(script), "16", "cost"]))
    assert in_a_worker["errors"] == []
    assert in_a_worker["ranked"] == 2
    assert in_a_worker["best"] is not None
    del in_a_worker["errors"], in_a_worker["ranked"], in_a_worker["best"]
    assert in_a_worker == here
    assert here["devices"] == 16
    assert here["memory"][0] > 0
