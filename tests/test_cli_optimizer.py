"""`eqshard check --step --optimizer`: the optimizer state is built as the user's
step takes it, for a model that holds arrays no gradient reaches (an int counter)."""

import importlib.util
import json
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

MODULE = """
import equinox as eqx
import jax
import jax.numpy as jnp
import optax


class Counted(eqx.Module):
    linear: eqx.nn.Linear
    steps: jax.Array  # an int32 counter: an array, not a parameter

    def __init__(self, key):
        self.linear = eqx.nn.Linear(16, 8, key=key)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        return self.linear(x)


def build():
    return Counted(jax.random.key(0))


def optimizer():
    return optax.adam(1e-3)


def batch():
    return jnp.zeros((8, 16)), jnp.zeros((8, 8))


def loss(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _step(model, opt_state, batch, parameters):
    grads = eqx.filter_grad(loss)(model, batch)
    updates, opt_state = optimizer().update(grads, opt_state, eqx.filter(model, parameters))
    model = eqx.apply_updates(model, updates)
    return eqx.tree_at(lambda m: m.steps, model, model.steps + 1), opt_state


@eqx.filter_jit
def inexact_step(model, opt_state, batch):  # the state of the inexact arrays
    return _step(model, opt_state, batch, eqx.is_inexact_array)


@eqx.filter_jit
def array_step(model, opt_state, batch):  # adam's state has no room for the counter either
    return _step(model, opt_state, batch, eqx.is_array)


@eqx.filter_jit
def weights_step(model, opt_state, batch):  # the state of the weights alone: neither
    weights = lambda x: eqx.is_inexact_array(x) and x.ndim == 2
    grads = eqx.filter(eqx.filter_grad(loss)(model, batch), weights)
    updates, opt_state = optimizer().update(grads, opt_state, eqx.filter(model, weights))
    return eqx.apply_updates(model, updates), opt_state
"""

SPEC = {"eqshard": 1, "default": "replicate"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("optimizer")
    module = folder / "countedmodel.py"
    module.write_text(MODULE)
    spec = folder / "replicated.eqshard.json"
    spec.write_text(json.dumps(SPEC))
    return str(spec), str(module)


def _check(run_cli, files, step):
    spec, module = files
    return run_cli(
        "check",
        spec,
        "--model",
        f"{module}:build",
        "--step",
        f"{module}:{step}",
        "--optimizer",
        f"{module}:optimizer",
        "--make-batch",
        f"{module}:batch",
        "--device-counts",
        8,  # this process's count: JAX may start here
        "--format",
        "json",
    )


def _taken(module: str, step: str) -> list[Any]:
    """The states, of `eqx.is_array` and of `eqx.is_inexact_array`, that `step`
    traces with here: optax before 0.2.5 updates a state of another structure too."""
    spec = importlib.util.spec_from_file_location("countedmodel_here", module)
    assert spec is not None
    assert spec.loader is not None
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    model = eqx.filter_eval_shape(user.build)
    taken = []
    for kind in (eqx.is_array, eqx.is_inexact_array):
        params = eqx.filter(model, lambda x, kind=kind: kind(jnp.zeros((), x.dtype)))
        state = jax.eval_shape(optax.adam(1e-3).init, params)
        try:
            eqx.filter_eval_shape(getattr(user, step), model, state, user.batch())
        except ValueError:
            continue
        taken.append(state)
    return taken


def _bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("step", ["inexact_step", "array_step"])
def test_a_model_with_an_int_array_gets_the_state_of_its_inexact_arrays(run_cli, files, step):
    result = _check(run_cli, files, step)
    assert result.code == 0, result.err
    (check,) = json.loads(result.out)["checks"]
    assert check["ok"] is True
    linear = eqx.filter_eval_shape(eqx.nn.Linear, 16, 8, key=jax.random.key(0))
    inexact = jax.eval_shape(optax.adam(1e-3).init, linear)  # mu and nu, and adam's count
    taken = _taken(files[1], step)
    assert taken, "the step takes one of the two states"
    if len(taken) == 1:  # this optax refuses the other: the one the step takes
        assert _bytes(taken[0]) == _bytes(inexact)
    # the first the step takes, replicated: all of it on each device
    assert check["cost"]["optimizer"] == _bytes(taken[0])


def test_a_step_that_takes_neither_state_names_the_option_and_the_fix(run_cli, files):
    _, module = files
    if _taken(module, "weights_step"):
        pytest.skip("this optax (before 0.2.5) updates a state of another structure too")
    result = _check(run_cli, files, "weights_step")
    assert result.code == 2
    message = json.loads(result.out)["error"]["message"]
    assert message.startswith(
        f"eqshard check: error: --optimizer '{module}:optimizer': the step "
        f"'{module}:weights_step' takes neither optimizer state eqshard builds, "
        "`optimizer().init(eqx.filter(model, eqx.is_array))` nor "
        "`optimizer().init(eqx.filter(model, eqx.is_inexact_array))`: with each it raised "
        "ValueError: pytree structure error: different types at key path "
    )
    assert message.endswith(
        "\nwrite the step to update the parameters of one of them, as "
        "`optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))` "
        "with `grads` from `eqx.filter_grad`"
    )
    assert "Traceback" not in result.out + result.err
