"""A loop whose trip count depends on values (an adaptive solver, a fixed-point
iteration): what runs in it is counted once per trip and named unknown, in `cost`,
`check` and the harness's budgets, never as a step's whole figure."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqshard
from eqshard.testing import assert_equivalent

MODEL = eqx.filter_eval_shape(lambda: eqx.nn.MLP(64, 64, 256, 1, key=jax.random.key(0)))
X = jax.ShapeDtypeStruct((64, 64), jnp.float32)
MEGATRON = {
    "eqshard": 1,
    "rules": [
        {"path": "layers.0.weight", "expr": "o i -> o* i"},
        {"path": "layers.0.bias", "expr": "o -> o*"},
        {"path": "layers.1.weight", "expr": "o i -> o i*"},
    ],
}
PER_TRIP_FLOPS = (2 * 64 * 64 * 256 + 2 * 64 * 256 * 64) // 8  # one trip, an eighth each


def until_small(model, x):
    def go_on(carry):
        i, h = carry
        return (i < 10) & (jnp.mean(h) < 1e6)

    def once(carry):
        i, h = carry
        return i + 1, jax.vmap(model)(h)

    return jnp.mean(jax.lax.while_loop(go_on, once, (0, x))[1])


def ten_times(model, x):
    return jnp.mean(jax.lax.fori_loop(0, 10, lambda i, h: jax.vmap(model)(h), x))


def test_a_loop_of_unknown_trips_is_named_and_counted_per_trip():
    c = eqshard.cost(MODEL, X, step=until_small, spec=eqshard.load(MEGATRON))
    assert not c.known
    (loop,) = c.loops
    assert loop.startswith("while")
    assert ", line " in loop
    inside = [k for k in c.collectives if k.loop is not None]
    assert inside, "Megatron's all-reduces run in the loop"
    assert all(k.loop == loop for k in inside)
    assert c.loop_flops == PER_TRIP_FLOPS
    text = c.unknown_text()
    assert text is not None
    assert text.startswith(f"unknown: the trips of {loop}, whose trip count depends on values")
    assert f"{len(inside)} collective" in text
    assert f"{PER_TRIP_FLOPS:,} FLOPs are counted once, per trip" in text


def test_a_loop_of_known_trips_is_counted_in_full():
    c = eqshard.cost(MODEL, X, step=ten_times, spec=eqshard.load(MEGATRON))
    assert c.known
    assert c.loops == ()
    assert c.unknown_text() is None
    assert all(k.loop is None for k in c.collectives)
    assert c.flops == 10 * PER_TRIP_FLOPS
    assert max(k.count for k in c.collectives) == 10


def test_check_says_what_it_cannot_know(run_cli, tmp_path):
    module = tmp_path / "loopmodel.py"
    module.write_text(
        "import equinox as eqx, jax, jax.numpy as jnp\n"
        "from test_loops import until_small as step\n"
        "def build():\n"
        "    return eqx.nn.MLP(64, 64, 256, 1, key=jax.random.key(0))\n"
        "def batch():\n"
        "    return jnp.zeros((64, 64))\n"
    )
    spec = tmp_path / "megatron.eqshard.json"
    eqshard.dump(eqshard.load(MEGATRON), spec)
    result = run_cli(
        "check",
        spec,
        "--model",
        f"{module}:build",
        "--step",
        f"{module}:step",
        "--make-batch",
        f"{module}:batch",
        "--devices",
        8,
    )
    assert result.code == 0, result.err
    (line,) = [x for x in result.out.splitlines() if x.startswith("cost: ")]
    assert " per step and trip; " in line
    assert "(unknown: the trips of while" in line


@pytest.mark.slow  # compiles in worker processes
def test_a_budget_never_passes_on_a_loop_of_unknown_trips():
    import harness_models as m

    with pytest.raises(AssertionError) as caught:
        assert_equivalent(
            m.build,
            eqshard.load(
                {"eqshard": 1, "rules": [{"path": "layers.1.weight", "expr": "o i -> o i*"}]}
            ),
            m.looped_loss,
            m.batch,
            device_counts=(2,),
            max_communication={"all-reduce": 10**12},
        )
    text = str(caught.value)
    assert "on 2 devices, the step's all-reduces run in while" in text
    assert "whose trip count depends on values: what they move per step is not known, " in text
    assert "so the budget of 1,000,000,000,000 bytes cannot be met" in text
