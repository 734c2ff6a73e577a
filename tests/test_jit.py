"""`eqshard.jit`: one plain step, laid out by whichever plan is active, trains equal
to the unsharded run; every output leaf has exactly the plan's layout; each plan
traces once; and `cost` compiles the same program."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import eqshard

OPTIMIZER = optax.adam(1e-2)

# Each strategy as a real spec file for eqx.nn.MLP(16 -> 32 -> 32 -> 16):
# layers.0 (32, 16), layers.1 (32, 32), layers.2 (16, 32).
SPECS: dict[str, dict[str, Any]] = {
    "data parallel": {"mesh": [["data", "*"]], "default": "replicate", "rules": []},
    "zero-1": {
        "mesh": [["data", "*"]],
        "default": "replicate",
        "rules": [],
        "optimizer": {"default": "fsdp"},
    },
    "fsdp": {"mesh": [["data", "*"]], "default": "fsdp", "rules": []},
    "megatron": {
        "mesh": [["model", "*"]],
        "batch": "... -> * ...",
        "default": "replicate",
        "rules": [
            {"path": "layers.0.weight", "expr": "o i -> o* i"},
            {"path": "layers.0.bias", "expr": "o -> o*"},
            {"path": "layers.1.weight", "expr": "o i -> o i*"},
        ],
    },
    "2d": {
        "mesh": [["data", "*"], ["model", 2]],
        "default": "replicate",
        "rules": [
            {"path": "layers.0.weight", "expr": "o i -> * o2 i"},
            {"path": "layers.0.bias", "expr": "o -> * o2"},
            {"path": "layers.1.weight", "expr": "o i -> * o i2"},
        ],
    },
}


def _rules(name: str, tmp_path: Path) -> eqshard.Rules:
    path = tmp_path / f"{name.replace(' ', '-')}.eqshard.json"
    path.write_text(json.dumps({"eqshard": 1, **SPECS[name]}))
    return eqshard.load(path)


def _model() -> eqx.nn.MLP:
    return eqx.nn.MLP(16, 16, 32, 2, key=jax.random.key(0))


def _batch() -> tuple[jax.Array, jax.Array]:
    x = np.random.RandomState(0).randn(16, 16).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(np.tanh(x[:, ::-1]))


def _loss(model: Any, x: Any, y: Any) -> Any:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


TRACES: list[str] = []


def plain_step(model: Any, opt_state: Any, x: Any, y: Any) -> Any:
    """A training step as written for one device: it names no plan."""
    TRACES.append("plain")
    value, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


def constrained_step(model: Any, opt_state: Any, x: Any, y: Any) -> Any:
    """The same step, ending in `eqshard.constrain` with no spec: the active plan."""
    model, opt_state, value = plain_step(model, opt_state, x, y)
    return eqshard.constrain(model), eqshard.constrain(opt_state), value


def _leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))


def _train(step: Any, model: Any, opt_state: Any, steps: int = 3) -> Any:
    x, y = _batch()
    value = None
    for _ in range(steps):
        model, opt_state, value = step(model, opt_state, x, y)
    return model, opt_state, value


def _same_blocks(value: jax.Array, target: Any) -> bool:
    """Whether `value` is laid out as `target` says, device by device."""
    shape = value.shape
    return value.sharding.devices_indices_map(shape) == target.devices_indices_map(shape)


@pytest.mark.parametrize(
    "name",
    [  # `-m "not slow"` trains under data parallel and Megatron only
        pytest.param(name, marks=() if name in ("data parallel", "megatron") else pytest.mark.slow)
        for name in SPECS
    ],
)
def test_one_plain_step_trains_equal_under_every_plan(name, tmp_path):
    with jax.default_matmul_precision("highest"):
        model = _model()
        opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
        want = _train(eqx.filter_jit(plain_step), model, opt_state)

        p = eqshard.plan(model, _rules(name, tmp_path))
        step = eqshard.jit(plain_step)
        placed = eqshard.apply((model, opt_state), p)
        TRACES.clear()
        with eqshard.use(p):
            got = _train(step, *placed, steps=3)
    assert TRACES == ["plain"], "the step was traced more than once for one plan"
    for g, w in zip(_leaves(got), _leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)
    laid = eqshard.apply((got[0], got[1]), p)  # the plan's layouts of what came out
    for g, target in zip(_leaves(got[:2]), _leaves(laid)):
        assert _same_blocks(g, target.sharding), (name, g.sharding, target.sharding)
    assert got[2].sharding.is_fully_replicated


@pytest.mark.slow  # trains under every plan; the test above checks one trace too
def test_a_plan_made_for_a_count_trains_on_the_first_devices(tmp_path):
    """A plan made for 4 devices (`simulate=4`, no devices held) runs the step on the
    first 4 of `jax.devices()`, as `apply(..., devices=4)` places it, and trains as
    unsharded."""
    with jax.default_matmul_precision("highest"):
        model = _model()
        opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
        want = _train(eqx.filter_jit(plain_step), model, opt_state)
        p = eqshard.plan(model, _rules("data parallel", tmp_path), simulate=4)
        placed = eqshard.apply((model, opt_state), p)
        with eqshard.use(p):
            got = _train(eqshard.jit(plain_step), *placed, steps=3)
    for g, w in zip(_leaves(got), _leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)
        assert set(g.sharding.device_set) == set(jax.devices()[:4])


def test_each_plan_traces_the_step_once(tmp_path):
    model = _model()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    step = eqshard.jit(plain_step)
    plans = [eqshard.plan(model, _rules(n, tmp_path)) for n in ("data parallel", "fsdp")]
    TRACES.clear()
    for _ in range(2):
        for p in plans:
            with eqshard.use(p):
                _train(step, *eqshard.apply((model, opt_state), p), steps=2)
    assert TRACES == ["plain", "plain"]
    TRACES.clear()
    _train(step, model, opt_state, steps=2)  # no plan: eqx.filter_jit's own cache
    _train(step, model, opt_state, steps=1)
    assert TRACES == ["plain"]


@pytest.mark.slow  # a fresh interpreter: imports JAX and compiles
def test_the_old_pattern_traces_once(tmp_path):
    """A regression: `eqshard.constrain(model, plan)` at the end of an
    `eqx.filter_jit` step under `jax.set_mesh` traced twice, as the user context
    that keys `jit` by the active rules was made during the first trace. A fresh
    interpreter, as a user's script starts."""
    script = textwrap.dedent(
        """
        import jax
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
        import equinox as eqx, jax.numpy as jnp
        from jax.sharding import AxisType
        import eqshard

        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        jax.set_mesh(mesh)
        model = eqx.nn.MLP(16, 16, 32, 2, key=jax.random.key(0))
        rules = {"eqshard": 1, "rules": [{"path": "layers.*.weight", "expr": "o i -> o i*"}]}
        plan = eqshard.plan(model, eqshard.load(rules))
        model = eqshard.apply(model, plan)
        traces = []

        @eqx.filter_jit
        def step(model, x):
            traces.append(1)
            g = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)))(model)
            model = eqx.apply_updates(model, jax.tree_util.tree_map(lambda b: -0.1 * b, g))
            return eqshard.constrain(model, plan)

        @eqshard.jit
        def step2(model, x):
            traces.append(2)
            g = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)))(model)
            return eqx.apply_updates(model, jax.tree_util.tree_map(lambda b: -0.1 * b, g))

        x = jnp.ones((8, 16))
        for _ in range(3):
            model = step(model, x)
        with eqshard.use(plan):
            for _ in range(3):
                model = step2(model, x)
        print(traces)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[1, 2]"


def test_constrain_with_no_spec_follows_the_active_plan(tmp_path):
    model = _model()
    p = eqshard.plan(model, _rules("fsdp", tmp_path))
    with eqshard.use(p):
        laid = eqx.filter_jit(lambda m: eqshard.constrain(m))(model)
        placed = eqshard.constrain(model)  # outside jit: placed
    for a, b, target in zip(_leaves(laid), _leaves(placed), jax.tree_util.tree_leaves(p.shardings)):
        assert _same_blocks(a, target)
        assert _same_blocks(b, target)
    # with no plan active, the fields (none here: every leaf whole)
    whole = eqshard.constrain(model)
    assert all(leaf.sharding.is_fully_replicated for leaf in _leaves(whole))


def _cost_figures(c: eqshard.results.Cost) -> tuple[Any, ...]:
    m = c.memory
    return (
        sorted(c.bytes_by_axes().items()),
        (m.arguments, m.outputs, m.parameters, m.optimizer),
        c.flops,
    )


@pytest.mark.slow  # compiles and costs each strategy's step
@pytest.mark.parametrize("name", ["zero-1", "fsdp", "megatron"])
def test_cost_compiles_the_program_that_trains(name, tmp_path):
    """A plain step, the same step ending in `constrain`, and the step under
    `eqshard.jit` bound to another plan give the same figures under a spec."""
    model = _model()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    x, y = _batch()
    rules = _rules(name, tmp_path)
    other = eqshard.plan(model, _rules("data parallel", tmp_path))
    figures = {
        label: _cost_figures(eqshard.cost(model, opt_state, x, y, step=step, spec=rules))
        for label, step in [
            ("plain", plain_step),
            ("constrained", constrained_step),
            ("eqshard.jit", eqshard.jit(plain_step, spec=other)),
            ("eqx.filter_jit", eqx.filter_jit(plain_step)),
        ]
    }
    assert len(set(map(repr, figures.values()))) == 1, figures


def test_zero1_pays_its_all_gather_of_the_updated_parameters(tmp_path):
    """ZeRO-1 updates each parameter where its moments are split, then gathers it
    whole, as the plan holds the parameters: a hand count of the bytes."""
    model = _model()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    x, y = _batch()
    rules = _rules("zero-1", tmp_path)
    c = eqshard.cost(model, opt_state, x, y, step=plain_step, spec=rules)
    p = eqshard.plan(model, rules)
    split = [
        leaf.size * leaf.dtype.itemsize
        for leaf, s in zip(_leaves(model), jax.tree_util.tree_leaves(p.optimizer.shardings))
        if not s.is_fully_replicated
    ]
    assert split, "the optimizer section splits some moments"
    gathered = sum(k.total_bytes for k in c.collectives if k.kind == "all-gather")
    assert gathered == sum(split)
    assert all(k.axes == ("data",) for k in c.collectives if k.kind == "all-gather")
    dp = eqshard.cost(
        model, opt_state, x, y, step=plain_step, spec=_rules("data parallel", tmp_path)
    )
    assert not [k for k in dp.collectives if k.kind == "all-gather"]


def test_a_megatron_mlp_trains_on_a_mesh_of_explicit_axes():
    """`jax.make_mesh` gives Explicit axes: a row-parallel eqx.nn.Linear does not
    trace there under plain `jit`; under `eqshard.jit` the body runs Auto and the
    outputs keep the plan's layouts and axis types."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    model = _model()
    spec = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight),
        jax.tree_util.tree_map(lambda _: None, model),
        ("o i -> * o2 i", "o -> * o2", "o i -> * o i2"),
        is_leaf=lambda x: x is None,
    )
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    with jax.default_matmul_precision("highest"):
        want = _train(eqx.filter_jit(plain_step), model, opt_state)
        p = eqshard.plan(model, spec, mesh=mesh)
        placed_model, placed_state = eqshard.apply((model, opt_state), p)
        x, y = _batch()
        with jax.set_mesh(mesh), pytest.raises(Exception, match="out_sharding"):
            eqx.filter_jit(plain_step)(placed_model, placed_state, x, y)
        with jax.set_mesh(mesh), eqshard.use(p), _compiles() as compiled:
            got = _train(eqshard.jit(plain_step), placed_model, placed_state)
    assert compiled.count("plain_step") == 1  # refused on Explicit axes, in one trace
    for g, w in zip(_leaves(got), _leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)
    w0 = got[0].layers[0].weight
    assert w0.sharding.mesh.axis_types == (AxisType.Explicit,) * 2
    assert w0.sharding.spec == PartitionSpec("model", None)
    assert jax.typeof(w0).sharding.spec == PartitionSpec("model", None)


def test_donate_all_donates_the_model_and_the_optimizer_state(tmp_path):
    model = _model()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    p = eqshard.plan(model, _rules("fsdp", tmp_path))
    placed_model, placed_state = eqshard.apply((model, opt_state), p)
    x, y = _batch()
    step = eqshard.jit(plain_step, donate="all")
    with eqshard.use(p):
        compiled = step.lower(placed_model, placed_state, x, y).compile()
        new_model, new_state, _ = step(placed_model, placed_state, x, y)
    assert all(leaf.is_deleted() for leaf in _leaves((placed_model, placed_state)))
    assert not any(leaf.is_deleted() for leaf in _leaves((new_model, new_state)))
    aliased = compiled.memory_analysis().alias_size_in_bytes
    held = sum(leaf.addressable_shards[0].data.nbytes for leaf in _leaves((new_model, new_state)))
    assert aliased == held  # every buffer of the model and the state reused in place


def test_with_no_plan_it_is_eqx_filter_jit():
    model = _model()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    got = _train(eqshard.jit(plain_step), model, opt_state)
    want = _train(eqx.filter_jit(plain_step), model, opt_state)
    for g, w in zip(_leaves(got), _leaves(want)):
        assert np.array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(eqshard.EqshardError, match=r"eqshard\.use\(plan\)"):
        eqshard.jit(plain_step).lower(model, opt_state, *_batch())


@pytest.mark.parametrize(
    "kind", ["plan", "rules", "path", "fsdp", "expression", "spec tree", "partition specs"]
)
def test_spec_takes_every_kind_of_spec(kind, tmp_path):
    """`spec=` takes what `eqshard.plan` takes, planned for the first argument: the
    step's outputs take that plan's layouts, with no plan active."""
    model = _model()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    rules = _rules("fsdp", tmp_path)
    p = eqshard.plan(model, rules)
    spec = {
        "plan": p,
        "rules": rules,
        "path": tmp_path / "fsdp.eqshard.json",
        "fsdp": eqshard.FSDP,
        "expression": "... -> * ...",
        "spec tree": p.expressions,
        "partition specs": p.shardings,
    }[kind]
    want = p if kind not in ("fsdp", "expression") else eqshard.plan(model, spec)
    got = _train(eqshard.jit(plain_step, spec=spec), model, opt_state, steps=2)
    for g, target in zip(_leaves(got[0]), jax.tree_util.tree_leaves(want.shardings)):
        assert _same_blocks(g, target), kind


def test_plan_is_deprecated_for_spec(tmp_path):
    model = _model()
    p = eqshard.plan(model, _rules("fsdp", tmp_path))
    with pytest.warns(DeprecationWarning, match=r"eqshard\.jit\(spec=\.\.\.\)"):
        step = eqshard.jit(lambda m, x: jax.vmap(m)(x), plan=p)
    assert step.spec is p
    with pytest.warns(DeprecationWarning, match="spec="):
        decorated = eqshard.jit(plan=p)(lambda m: m)
    assert decorated.spec is p
    with (
        pytest.warns(DeprecationWarning, match="spec="),
        pytest.raises(eqshard.EqshardError, match="both"),
    ):
        eqshard.jit(plain_step, spec=p, plan=p)


def test_rules_alone_plan_the_first_argument(tmp_path):
    model = _model()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    rules = _rules("fsdp", tmp_path)
    p = eqshard.plan(model, rules)
    with eqshard.use(rules):
        got = _train(eqshard.jit(plain_step), *eqshard.apply((model, opt_state), p), steps=1)
    for g, target in zip(_leaves(got[0]), jax.tree_util.tree_leaves(p.shardings)):
        assert _same_blocks(g, target)


def test_lower_compiles_over_abstract_arguments(tmp_path):
    model = _model()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    p = eqshard.plan(model, _rules("fsdp", tmp_path))
    abstract = eqx.filter_eval_shape(lambda: (model, opt_state, *_batch()))
    with eqshard.use(p):
        lowered = eqshard.jit(plain_step).lower(*abstract)
    compiled = lowered.compile()
    assert "all-gather" in compiled.as_text()
    model_leaves = _leaves(model)
    for s, target in zip(lowered.in_shardings, jax.tree_util.tree_leaves(p.shardings)):
        assert s == target
    assert len(lowered.in_shardings) == len(model_leaves) + len(_leaves(opt_state)) + 2
    got = compiled(*eqshard.apply((model, opt_state), p), *_batch())
    assert _same_blocks(got[0].layers[1].weight, p.shardings.layers[1].weight)


# -- errors --------------------------------------------------------------------------


def test_an_argument_placed_otherwise_is_named(tmp_path):
    model = _model()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    p = eqshard.plan(model, _rules("fsdp", tmp_path))
    other = eqshard.plan(model, _rules("megatron", tmp_path))
    with eqshard.use(p), pytest.raises(eqshard.SpecError) as caught:
        _train(eqshard.jit(plain_step), eqshard.apply(model, other), eqshard.apply(opt_state, p))
    text = str(caught.value)
    assert "plain_step is called with arrays placed otherwise than its plan" in text
    assert "the step's `model` .layers[1].bias" in text  # layers[0].weight: the same blocks
    assert "is placed as P(" in text
    assert "eqshard.apply(tree, plan)" in text


def test_a_batch_the_layout_cannot_split_is_named_with_a_caret(tmp_path):
    model = _model()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    p = eqshard.plan(model, _rules("data parallel", tmp_path))
    x = jnp.ones((6, 16))  # 6 rows do not split over 8 devices
    with eqshard.use(p), pytest.raises(eqshard.SpecError) as caught:
        eqshard.jit(plain_step)(model, opt_state, x, x)
    text = str(caught.value)
    assert "the step's arguments cannot be laid out by the plan" in text
    assert "`x`, `y`: the batch float32[6, 16] cannot be laid out by 'b ... -> b8 ...'" in text
    assert "^" in text


def test_bad_arguments_to_jit():
    with pytest.raises(eqshard.EqshardError, match="`donate='some'` is not one of"):
        eqshard.jit(plain_step, donate="some")  # pyright: ignore[reportCallIssue, reportArgumentType]
    with pytest.raises(eqshard.ExpressionError, match=r"\^"):
        eqshard.jit(plain_step, batch="b ... -> b** ...")


def test_a_step_given_no_model_is_refused(tmp_path):
    model = _model()
    p = eqshard.plan(model, _rules("data parallel", tmp_path))
    with eqshard.use(p), pytest.raises(eqshard.SpecError, match="none is the plan's model"):
        eqshard.jit(lambda x: x * 2)(jnp.ones((8, 3)))


def test_outputs_that_hold_nothing_of_the_model_are_replicated(tmp_path):
    model = _model()
    p = eqshard.plan(model, _rules("fsdp", tmp_path))
    with eqshard.use(p):
        out = eqshard.jit(lambda m, x: (m, jax.vmap(m)(x)))(eqshard.apply(model, p), _batch()[0])
    assert out[1].sharding.is_fully_replicated
    assert isinstance(out[1].sharding, NamedSharding)


# -- what eqx.filter_jit does, eqshard.jit does too ------------------------------------


def test_keyword_only_arguments_take_their_own_layouts(tmp_path):
    """Keywords are laid out in the order `tree_flatten` visits them (sorted), not
    in the signature's: `x` (a batch) and `mask` (a vector) keep their own."""
    model = _model()
    p = eqshard.plan(model, _rules("fsdp", tmp_path))

    def step(model, *, x, mask):
        return (jax.vmap(model)(x) * mask).sum()

    x, mask = _batch()[0], jnp.ones(16)
    want = eqx.filter_jit(step)(model, x=x, mask=mask)
    with eqshard.use(p):
        got = eqshard.jit(step)(eqshard.apply(model, p), x=x, mask=mask)
        lowered = eqshard.jit(step).lower(model, x=x, mask=mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    assert lowered.cost_analysis() is not None  # jax's Lowered, forwarded


def test_a_module_that_constrains_itself_by_its_fields_runs_under_a_plan(tmp_path):
    """`constrain(tree)` follows the active plan only for the plan's model and what
    is built from it; a submodule (or a plain array) keeps its fields' meaning."""

    class Block(eqx.Module):
        w: jax.Array = eqshard.field("o i -> o* i")

        def __call__(self, x):
            return eqshard.constrain(self).w @ x

    class Net(eqx.Module):
        blocks: list

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x.sum()

    net = Net([Block(jnp.eye(16)), Block(2 * jnp.eye(16))])
    p = eqshard.plan(net, "... -> * ...")
    with eqshard.use(p):
        got = eqshard.jit(lambda n, x: n(x))(eqshard.apply(net, p), jnp.ones(16))
    assert float(got) == 32.0


def test_a_batch_committed_elsewhere_is_moved_as_jit_moves_an_uncommitted_one(tmp_path):
    """A loader's batch, committed to one device, runs the very program an uncommitted
    batch runs: the same layouts, the same values bit for bit, one compile."""
    model = _model()
    p = eqshard.plan(model, _rules("data parallel", tmp_path))
    x = _batch()[0]  # uncommitted: jax.jit would move it
    committed = jax.device_put(x, jax.devices()[0])  # a loader's
    step = eqshard.jit(lambda m, x: jax.vmap(m)(x))
    with eqshard.use(p), _compiles() as compiled:
        placed = eqshard.apply(model, p)
        got = step(placed, committed)
        want = step(placed, x)
    assert compiled.count("<lambda>") == 1
    assert got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not committed.is_deleted()


@contextlib.contextmanager
def _compiles() -> Iterator[list[str]]:
    """The names of the programs XLA compiles inside the block, as `jax_log_compiles`
    logs them."""
    names: list[str] = []

    class Compiles(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found = re.match(r"Compiling jit\((\S+?)\)", record.getMessage())
            if found:
                names.append(found.group(1))

    handler = Compiles(logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("jax._src.interpreters.pxla", "jax._src.dispatch")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            yield names
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


@pytest.mark.parametrize("placed", ["unplaced", "placed"])
def test_a_step_compiles_once_per_plan_however_its_first_arguments_are_placed(placed, tmp_path):
    """As a drop-in for `eqx.filter_jit`, the first call may get the model and its
    optimizer state fresh from their constructors: the step still traces and compiles
    once, not again when the second call gets the first's placed outputs."""
    model = _model()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    p = eqshard.plan(model, _rules("fsdp", tmp_path))
    if placed == "placed":
        model, opt_state = eqshard.apply((model, opt_state), p)
    TRACES.clear()
    with eqshard.use(p), _compiles() as compiled:
        _train(eqshard.jit(plain_step), model, opt_state, steps=3)
    assert TRACES == ["plain"]
    assert compiled.count("plain_step") == 1


def test_numpy_outputs_come_back_as_arrays(tmp_path):
    model = _model()
    p = eqshard.plan(model, _rules("data parallel", tmp_path))
    with eqshard.use(p):
        out = eqshard.jit(lambda m: (m, np.arange(3)))(eqshard.apply(model, p))
    assert isinstance(out[1], jax.Array)
    assert out[1].tolist() == [0, 1, 2]


def test_a_compiled_step_names_an_argument_placed_otherwise(tmp_path):
    model = _model()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    p = eqshard.plan(model, _rules("fsdp", tmp_path))
    other = eqshard.plan(model, _rules("megatron", tmp_path))
    x, y = _batch()
    with eqshard.use(p):
        compiled = eqshard.jit(plain_step).lower(model, opt_state, x, y).compile()
    with pytest.raises(eqshard.SpecError, match=r"the step's `model` \.layers\[1\]\.bias"):
        compiled(eqshard.apply(model, other), eqshard.apply(opt_state, p), x, y)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_a_step_with_the_users_own_shard_map_runs_and_is_costed_on_their_mesh(kind):
    """The user's `jax.shard_map` over their own mesh runs inside `eqshard.jit` and
    `cost` as under plain `jax.jit`: on Explicit axes the body is not switched to
    Auto ones, which `shard_map` would refuse as another mesh."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(kind,))
    model = eqx.nn.Linear(16, 16, key=jax.random.key(0))
    p = eqshard.plan(model, jax.tree_util.tree_map(lambda _: None, model), mesh=mesh)
    x = _batch()[0]

    def step(model: Any, x: Any) -> Any:
        squares = lambda y: jax.lax.psum(jnp.sum(y**2), "d")  # noqa: E731
        y = jax.vmap(model)(x)
        return jax.shard_map(
            squares, mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec()
        )(y)

    with jax.default_matmul_precision("highest"):
        want = jnp.sum(jax.vmap(model)(x) ** 2)
        with eqshard.use(p):
            got = eqshard.jit(step)(eqshard.apply(model, p), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    c = eqshard.cost(model, x, step=step, spec=p)
    assert [(k.kind, k.axes, k.bytes) for k in c.collectives] == [("all-reduce", ("d",), 4)]


@pytest.mark.parametrize(
    ("step", "shape"),
    [(lambda w: (w @ w).sum(), ()), (lambda w: w[:4], (4, 8)), (lambda w: w.T, (8, 8))],
    ids=["scalar", "slice", "transpose"],
)
def test_an_output_that_only_shares_a_one_array_models_structure_is_laid_out_as_any(step, shape):
    """The JAX tutorials' model is one array: every array a step returns then has the
    model's structure, and only its shape says whether it is built from the model. A
    scalar and a slice are replicated as any other output; an array of the model's
    shape takes its layout."""
    w = jnp.arange(64.0).reshape(8, 8)
    p = eqshard.plan(w, "a b -> a* b")
    with eqshard.use(p):
        got = eqshard.jit(step)(eqshard.apply(w, p))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(step(w)))
    assert got.shape == shape
    if shape == w.shape:
        assert _same_blocks(got, p.flat_shardings[0])
    else:
        assert got.sharding.is_fully_replicated
    c = eqshard.cost(w, step=step, spec="a b -> a* b")
    assert c.memory.parameters == w.nbytes // 8


def test_an_error_if_that_fires_raises_what_eqx_filter_jit_raises():
    """`eqx.error_if` inside the step: the same `EquinoxRuntimeError`, with the user's
    message and the stack inside the step, as under `eqx.filter_jit` (on one device:
    on several simulated ones, XLA:CPU's collectives wait on the device that raised,
    under `eqx.filter_jit` too)."""
    model = eqx.nn.Linear(8, 8, key=jax.random.key(0))
    p = eqshard.plan(model, eqshard.spec_tree(model), devices=1)
    x = jnp.ones((4, 8))

    def step(model: Any, x: Any) -> Any:
        y = jnp.sum(jax.vmap(model)(x))
        return eqx.error_if(y, jnp.isfinite(y), "the loss is finite, which this step refuses")

    raised = []
    with eqshard.use(p):
        for jit in (eqx.filter_jit, eqshard.jit):
            # Equinox caches `error_if`'s own jitted check, stack and all: a second step
            # reaching it unchanged would show the first one's stack, under filter_jit too
            eqx.clear_caches()
            jax.clear_caches()
            with pytest.raises(eqx.EquinoxRuntimeError, match="the loss is finite") as caught:
                jit(step)(eqshard.apply(model, p), x)
            raised.append(str(caught.value))
    assert raised[0] == raised[1]
    assert "test_jit.py" in raised[1]  # the user's frame inside the step


def test_a_step_made_with_plan_still_works_and_says_spec():
    model = eqx.nn.Linear(8, 8, key=jax.random.key(0))
    p = eqshard.plan(model, "... -> * ...")
    with pytest.warns(
        DeprecationWarning, match=r"`Step\(fn, plan=\.\.\.\)` is now `Step\(fn, spec"
    ):
        step = eqshard.results.Step(lambda m: m, plan=p)
    assert step.spec is p
    with pytest.warns(DeprecationWarning, match=r"`Step.plan` is now `Step.spec`"):
        assert step.plan is p
