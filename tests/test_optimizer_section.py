"""The optimizer state's own layout: a spec file's `"optimizer"` section, or
`plan(..., optimizer=)`; ZeRO-1 and ZeRO-2; which model-shaped subtrees take it;
every consumer following it."""

import json
import warnings
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from optimizer_state_oracle import blocks, expected_shardings, parameters_of

import eqshard
from eqshard._cli import _check

ZERO_1 = {
    "eqshard": 1,
    "mesh": [["data", "*"]],
    "default": "replicate",
    "optimizer": {"rules": [{"path": "**", "expr": "fsdp"}]},
}


def _model():
    return eqx.nn.MLP(16, 16, 64, 1, key=jax.random.key(0))


def _rows(shape, k, n=8):
    """The blocks of a leaf whose dim 0 is split over `n` devices in order."""
    size = shape[0] // n
    return {d: ((d * size, (d + 1) * size), *((0, m) for m in shape[1:])) for d in range(k)}


def test_zero_1_from_a_file_splits_the_moments_and_replicates_the_parameters():
    model = _model()
    plan = eqshard.plan(model, eqshard.load(ZERO_1))
    assert plan.mesh is not None
    assert dict(zip(plan.mesh.axis_names, plan.mesh.axis_sizes)) == {"data": 8}
    params = eqx.filter(model, eqx.is_array)
    optimizer = optax.adam(1e-3)
    state = eqshard.apply(optimizer.init(params), plan)
    model = eqshard.apply(model, plan)
    for leaf in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)):
        assert leaf.sharding.is_fully_replicated
    mu, nu = state[0].mu, state[0].nu
    # (64, 16): rows over 'data', device k holds rows 8k to 8k+8, bit for bit
    weight = mu.layers[0].weight
    assert blocks(weight.sharding, weight.shape) == _rows((64, 16), 8)
    assert blocks(nu.layers[0].bias.sharding, (64,)) == _rows((64,), 8)
    # (16, 64): FSDP splits its largest dim, the last
    assert mu.layers[1].weight.sharding.spec == P(None, "data")
    assert state[0].count.sharding.is_fully_replicated
    # every leaf as optax's own map says: its parameter's section layout
    want = expected_shardings(optimizer, state, params, plan.optimizer)
    for leaf, sharding in zip(jax.tree_util.tree_leaves(state), want):
        if sharding is None:
            assert leaf.sharding.is_fully_replicated
        else:
            assert blocks(leaf.sharding, leaf.shape) == blocks(sharding, leaf.shape)
            assert not leaf.sharding.is_fully_replicated
    values = jax.tree_util.tree_leaves(optimizer.init(params))
    for got, expected in zip(jax.tree_util.tree_leaves(state), values):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


OPTIMIZERS = {
    "adamw with a mask": lambda: optax.adamw(
        1e-3, mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim == 2, p)
    ),
    "MultiSteps": lambda: optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
    "chain(clip, sgd with momentum)": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.sgd(1e-3, momentum=0.9)
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_state_leaf_takes_its_parameters_section_layout(name):
    model = _model()
    plan = eqshard.plan(model, eqshard.load(ZERO_1))
    params = eqx.filter(model, eqx.is_array)
    optimizer = OPTIMIZERS[name]()
    state = optimizer.init(params)
    laid_out = eqshard.abstract(state, plan)
    want = expected_shardings(optimizer, state, params, plan.optimizer)
    names = [row.path for row in eqshard.report(model, plan).rows]
    rows = eqshard.report(state, plan).rows
    owners = parameters_of(optimizer, state, params)
    for leaf, sharding, row, i in zip(jax.tree_util.tree_leaves(laid_out), want, rows, owners):
        if sharding is None:
            assert leaf.sharding.is_fully_replicated
            continue
        assert leaf.sharding == sharding
        assert not leaf.sharding.is_fully_replicated
        assert row.origin == f"$.optimizer.rules[0] (fsdp) for parameter {names[i]}"
    assert sum(s is not None for s in want) >= 4


def test_the_section_from_python_takes_any_spec_source():
    model = _model()
    by_fsdp = eqshard.plan(model, "... -> * ...", optimizer=eqshard.FSDP)
    assert by_fsdp.optimizer.partition_specs.layers[0].weight == P("m0", None)
    assert by_fsdp.partition_specs.layers[0].weight == P()
    one_rule = eqshard.Rules(
        (eqshard.Rule("layers.0.weight", eqshard.expression.parse("o i -> o i*")),),
        default="parameter",
    )
    plan = eqshard.plan(model, eqshard.load(_MEGATRON), optimizer=one_rule)
    # the rule's parameter gets the rule; the others follow their parameters
    assert plan.optimizer.partition_specs.layers[0].weight == P(None, "m0")
    assert plan.partition_specs.layers[0].weight == P("m0", None)
    assert plan.optimizer.partition_specs.layers[1].weight == plan.partition_specs.layers[1].weight
    assert plan.optimizer.follows is not None
    assert plan.optimizer.follows[:4] == (False, True, True, True)
    rows = {row.path: row.origin for row in eqshard.report(model, plan.optimizer).rows}
    assert rows["layers.0.weight"] == "$.rules[0]"
    assert rows["layers.1.weight"] == "the parameter's ($.rules[1])"
    # a spec tree: `None` follows the parameter
    tree = eqx.tree_at(
        lambda s: s.layers[1].bias, eqshard.spec_tree(model), "o -> o*", is_leaf=lambda x: x is None
    )
    plan = eqshard.plan(model, eqshard.load(_MEGATRON), optimizer=tree)
    assert plan.optimizer.partition_specs.layers[1].bias == P("m0")
    assert plan.optimizer.partition_specs.layers[0].weight == P("m0", None)
    # without a section, the optimizer's layouts are the parameters'
    plain = eqshard.plan(model, eqshard.load(_MEGATRON))
    assert plain.optimizer is plain


_MEGATRON = {
    "eqshard": 1,
    "rules": [
        {"path": "layers.0.weight", "expr": "o i -> o* i"},
        {"path": "layers.1.weight", "expr": "o i -> o i*"},
    ],
}


def test_one_mesh_fits_the_parameters_and_the_section():
    model = {"w": jnp.ones((16, 16))}
    plan = eqshard.plan(model, {"w": "o i -> o* i"}, optimizer={"w": "o i -> o2 i4"})
    # the parameters alone would share a mesh of one axis; the section needs two
    assert plan.mesh is not None
    assert tuple(plan.mesh.axis_sizes) == (2, 4)
    assert plan.optimizer.mesh is plan.mesh
    got = plan.optimizer.shardings["w"]
    want = eqshard.expression.sharding("o i -> o2 i4", (16, 16))
    assert blocks(got, (16, 16)) == blocks(want, (16, 16))
    assert blocks(plan.shardings["w"], (16, 16)) == blocks(
        eqshard.expression.sharding("o i -> o* i", (16, 16)), (16, 16)
    )


class TrainState(eqx.Module):
    model: Any
    opt_state: Any


class NamedTrainState(NamedTuple):
    model: Any
    opt_state: Any


def test_the_model_takes_the_parameters_layouts_and_the_optimizer_state_the_sections():
    model = _model()
    plan = eqshard.plan(model, eqshard.load(ZERO_1))
    state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    split, whole = P("data", None), P()
    for tree, get in (
        ((model, state), lambda t: (t[0], t[1])),
        (TrainState(model, state), lambda t: (t.model, t.opt_state)),
        ({"model": model, "opt": [state]}, lambda t: (t["model"], t["opt"][0])),
    ):
        laid_model, laid_state = get(eqshard.abstract(tree, plan))
        assert laid_model.layers[0].weight.sharding.spec == whole
        assert laid_state[0].mu.layers[0].weight.sharding.spec == split
        assert laid_state[0].nu.layers[0].weight.sharding.spec == split
    # the rule is structural: a NamedTuple is an optimizer state, as optax's are,
    # so a model held in one takes the section's layouts
    laid = eqshard.abstract(NamedTrainState(model, state), plan)
    assert laid.model.layers[0].weight.sharding.spec == split
    # the model's arrays, filtered, at the root: the parameters'
    params = eqshard.abstract(eqx.filter(model, eqx.is_array), plan)
    assert params.layers[0].weight.sharding.spec == whole


def test_restore_and_abstract_keep_every_planned_layout(tmp_path):
    model = _model()
    plan = eqshard.plan(model, eqshard.load(ZERO_1))
    optimizer = optax.adamw(1e-3)
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    model, state = eqshard.apply((model, state), plan)
    path = tmp_path / "state.eqx"
    eqx.tree_serialise_leaves(path, (model, state))
    like = eqx.filter_eval_shape(lambda: (model, state))
    restored = eqshard.restore(path, like, plan)
    target = eqshard.abstract(like, plan)
    arrays = lambda tree: jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))  # noqa: E731
    targets = [x for x in jax.tree_util.tree_leaves(target) if hasattr(x, "sharding")]
    assert len(targets) == len(arrays(restored)) == len(arrays((model, state)))
    for got, placed, want in zip(arrays(restored), arrays((model, state)), targets):
        assert got.sharding == placed.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(placed))
    assert restored[1][0].mu.layers[0].weight.sharding.spec == P("data", None)
    assert restored[0].layers[0].weight.sharding.is_fully_replicated


def _loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def test_a_zero_2_step_keeps_every_layout_with_one_trace_and_equals_the_unsharded():
    model = _model()
    plan = eqshard.plan(model, eqshard.load(ZERO_1))
    optimizer = optax.adam(1e-2)
    x = jax.random.normal(jax.random.key(1), (8, 16))
    traces = []

    @eqx.filter_jit
    def step(model, state, x, keep):
        traces.append(1)
        grads = eqx.filter_grad(_loss)(model, x)
        if keep is not None:  # ZeRO-2: the gradients in the moments' layouts
            grads = eqshard.constrain(grads, keep.optimizer)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        if keep is None:
            return model, state, grads
        return eqshard.constrain(model, keep), eqshard.constrain(state, keep), grads

    want_model, want_state = model, optimizer.init(eqx.filter(model, eqx.is_array))
    got_model, got_state = eqshard.apply((want_model, want_state), plan)
    before = jax.tree_util.tree_leaves((eqx.filter(got_model, eqx.is_array), got_state))
    grads = None
    for _ in range(2):
        want_model, want_state, _ = step(want_model, want_state, x, None)
        got_model, got_state, grads = step(got_model, got_state, x, plan)
    assert grads is not None
    assert len(traces) == 2  # once unsharded, once sharded: the layouts are kept
    after = jax.tree_util.tree_leaves((eqx.filter(got_model, eqx.is_array), got_state))
    for a, b in zip(before, after):
        assert blocks(a.sharding, a.shape) == blocks(b.sharding, b.shape)
    assert blocks(grads.layers[0].weight.sharding, (64, 16)) == _rows((64, 16), 8)
    for got, want in zip(
        jax.tree_util.tree_leaves((eqx.filter(got_model, eqx.is_array), got_state)),
        jax.tree_util.tree_leaves((eqx.filter(want_model, eqx.is_array), want_state)),
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_cost_shows_the_all_gather_zero_1_costs():
    model = _model()
    optimizer = optax.adam(1e-2)
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)

    def costed(spec):
        plan = eqshard.plan(model, eqshard.load(spec))

        def step(model, state, x):
            grads = eqx.filter_grad(_loss)(model, x)
            updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
            model = eqx.apply_updates(model, updates)
            return eqshard.constrain(model, plan), eqshard.constrain(state, plan)

        return eqshard.cost(model, state, x, step=step, spec=plan)

    zero_1, data_parallel = costed(ZERO_1), costed({**ZERO_1, "optimizer": {}})
    whole = sum(a.nbytes for a in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))
    assert zero_1.memory.parameters == data_parallel.memory.parameters == whole
    assert data_parallel.memory.optimizer == 2 * whole + 4
    assert (zero_1.memory.optimizer - 4) * 8 == 2 * whole
    moved = zero_1.bytes_by_axes()
    assert moved[("all-gather", ("data",))] == whole  # the updated parameters
    assert ("all-gather", ("data",)) not in data_parallel.bytes_by_axes()


def test_faults_of_the_section_name_it():
    model = _model()
    with pytest.raises(eqshard.EqshardError, match=r'has an "optimizer" section, and `optimizer='):
        eqshard.plan(model, eqshard.load(ZERO_1), optimizer=eqshard.FSDP)
    with pytest.raises(eqshard.EqshardError, match=r'"default": "parameter" is for the optimizer'):
        eqshard.plan(model, eqshard.Rules(default="parameter"))
    with pytest.raises(eqshard.SpecError) as caught:
        eqshard.plan(model, "... -> * ...", optimizer="o i -> o* i")
    text = str(caught.value)
    assert "the optimizer state of layers.0.bias (Linear.bias): float32[64] 'o i -> o* i'" in text
    assert "the optimizer state of layers.1.bias (Linear.bias): float32[16] 'o i -> o* i'" in text
    assert "layers.0.weight" not in text  # 'o i -> o* i' fits both weights
    section = {**ZERO_1, "optimizer": {"rules": [{"path": "layers.9.weight", "expr": "fsdp"}]}}
    with pytest.warns(eqshard.UnusedRuleWarning) as found:
        eqshard.plan(model, eqshard.load(section))
    assert found[0].message.where == "<mapping>::$.optimizer.rules[0]"  # type: ignore[union-attr]


def test_the_file_round_trips_and_validate_checks_the_section(tmp_path, run_cli):
    rules = eqshard.load(
        {
            **ZERO_1,
            "rules": [{"path": "layers.0.bias", "expr": "o -> o*", "memory": "pinned_host"}],
            "optimizer": {"default": "replicate", "rules": [{"path": "**", "expr": "fsdp"}]},
        }
    )
    path = tmp_path / "zero.eqshard.json"
    eqshard.dump(rules, path)
    again = eqshard.load(path)
    assert again.to_json() == rules.to_json()
    assert again.rules[0].memory == "pinned_host"
    assert again.optimizer is not None
    assert (again.optimizer.default, again.optimizer.section) == ("replicate", "$.optimizer")
    bad = tmp_path / "bad.eqshard.json"
    bad.write_text(
        json.dumps(
            {
                "eqshard": 1,
                "rules": [{"path": "a", "expr": "x -> x*", "memory": "host"}],
                "optimizer": {
                    "default": "follow",
                    "rules": [{"path": "**", "expr": "x y ->"}, {"path": "**", "expr": "fsdp"}],
                    "dims": {"embed": "2x"},
                },
            }
        )
    )
    result = run_cli("validate", str(bad), "--format", "json")
    assert result.code == 1
    (checked,) = json.loads(result.out)["files"]
    found = {(p["path"], p["message"]) for p in checked["problems"]}
    assert ("$.rules[0].memory", _MEMORY) in found
    assert ("$.optimizer.default", _DEFAULT) in found
    paths = {path for path, _ in found}
    assert paths >= {"$.optimizer.rules[0].expr", "$.optimizer.rules[1].path"}
    assert "$.optimizer.dims.embed" in paths


_MEMORY = "'host' is not a memory kind: 'device' (the default) or 'pinned_host' (host memory)"
_DEFAULT = (
    "'follow' is not a default of the optimizer section: 'parameter' (each state leaf takes "
    "its parameter's layout), 'replicate' or 'fsdp'"
)


def test_check_resolves_the_section_with_the_file():
    model = eqx.filter_eval_shape(_model)
    section = {
        **ZERO_1,
        "optimizer": {"rules": [{"path": "layers.*.weight", "expr": "o i -> o3 i"}]},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (result,) = _check.check(eqshard.load(section), model, [8])
    assert [problem.where for problem in result.problems] == [
        "the optimizer state of layers.0.weight (Linear.weight)",
        "the optimizer state of layers.1.weight (Linear.weight)",
    ]


@pytest.mark.slow  # compiles in worker processes
def test_assert_equivalent_passes_on_zero_1():
    import harness_models as m

    from eqshard.testing import assert_equivalent

    # the loss, the gradients and one AdamW step, its moments split over 'data'
    assert_equivalent(
        m.build, eqshard.load(ZERO_1), m.loss, m.batch, device_counts=(8,), optimizer=m.optimizer
    )
