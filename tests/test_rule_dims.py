"""Rules that name dims: `{"path": ..., "dims": "... hidden embed"}`, laid out through
the file's `"dims"` as a jaxtyping annotation with those names would be."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float

import eqshard
from eqshard._specfile._model import Named, Rule, Rules

DIMS = {"hidden": "model", "embed": None}


def _mlp():
    return eqx.nn.MLP(16, 16, 32, 1, key=jax.random.key(0))  # layers.0.weight: (32, 16)


def _stacked():
    keys = jax.random.split(jax.random.key(1), 3)
    return eqx.filter_vmap(lambda k: eqx.nn.MLP(16, 16, 32, 1, key=k))(keys)  # (3, 32, 16)


class Annotated(eqx.Module):
    w: Float[Array, "hidden embed"]
    v: Float[Array, "embed hidden"]


def _doc(rules, model=4, dims=DIMS, **more):
    return {
        "eqshard": 1,
        "mesh": [["data", "*"], ["model", model]],
        "dims": dims,
        "rules": rules,
        **more,
    }


def _write(tmp_path, document, name="spec.eqshard.json"):
    path = tmp_path / name
    path.write_text(json.dumps(document))
    return path


def _blocks(plan, leaf):
    """Each device's block of `leaf` under the plan's sharding of it."""
    shardings = jax.tree_util.tree_leaves(plan.shardings)
    leaves = jax.tree_util.tree_leaves(plan.abstract)
    return {
        d.id: idx
        for d, idx in shardings[leaf].devices_indices_map(tuple(leaves[leaf].shape)).items()
    }


def _spec(plan, leaf):
    return jax.tree_util.tree_leaves(plan.partition_specs, is_leaf=lambda x: x is None)[leaf]


UP = {"path": "layers.0.weight", "dims": "hidden embed", "comment": "column-parallel"}
DOWN = {"path": "layers.1.weight", "dims": "embed hidden", "comment": "row-parallel"}


def test_a_dims_rule_lays_out_as_its_expression_rule_and_as_an_annotation(tmp_path):
    mlp = _mlp()
    named = eqshard.plan(mlp, eqshard.load(_write(tmp_path, _doc([UP, DOWN]))))
    expr = eqshard.plan(
        mlp,
        eqshard.load(
            _write(
                tmp_path,
                _doc(
                    [
                        {"path": "layers.0.weight", "expr": "o i -> * o4 i"},
                        {"path": "layers.1.weight", "expr": "o i -> * o i4"},
                    ]
                ),
                "expr.eqshard.json",
            )
        ),
    )
    annotated_model = Annotated(jnp.ones((32, 16)), jnp.ones((16, 32)))
    annotated = eqshard.plan(annotated_model, eqshard.load(_write(tmp_path, _doc([]), "a.json")))
    for leaf, twin in ((0, 0), (2, 1)):  # layers.0.weight is w, layers.1.weight is v
        assert _blocks(named, leaf) == _blocks(expr, leaf)
        assert _blocks(named, leaf) == _blocks(annotated, twin)
        assert _spec(named, leaf) == _spec(annotated, twin)
    assert _spec(named, 0) == jax.sharding.PartitionSpec("model", None)
    assert _spec(named, 2) == jax.sharding.PartitionSpec(None, "model")
    assert _spec(named, 1) == jax.sharding.PartitionSpec()  # the biases: the default
    named_exprs = jax.tree_util.tree_leaves(named.expressions)
    annotated_exprs = jax.tree_util.tree_leaves(annotated.expressions)
    assert str(named_exprs[0]) == str(annotated_exprs[0]) == "hidden embed -> 2 hidden4 embed"
    report = {row.path: row.origin for row in eqshard.report(mlp, named).rows}
    assert report["layers.0.weight"] == "$.rules[0]"
    assert report["layers.1.weight"] == "$.rules[1]"


@pytest.mark.parametrize("dims", ["... hidden embed", "hidden embed", "_ hidden embed"])
def test_a_dims_rule_lays_out_a_stack_of_layers(tmp_path, dims):
    stacked = _stacked()
    rule = {"path": "layers.0.weight", "dims": dims}
    named = eqshard.plan(stacked, eqshard.load(_write(tmp_path, _doc([rule]))))
    expr_rule = {"path": "layers.0.weight", "expr": "... o i -> * ... o4 i"}
    expr = eqshard.plan(stacked, eqshard.load(_write(tmp_path, _doc([expr_rule]), "e.json")))
    assert _blocks(named, 0) == _blocks(expr, 0)
    assert _spec(named, 0) == jax.sharding.PartitionSpec(None, "model", None)


def test_changing_the_model_axis_alone_changes_the_layout(tmp_path):
    mlp = _mlp()
    for size in (2, 4):
        spec = _write(tmp_path, _doc([UP], model=size), f"m{size}.json")
        blocks = _blocks(eqshard.plan(mlp, eqshard.load(spec)), 0)
        rows = {(idx[0].start, idx[0].stop) for idx in blocks.values()}
        assert rows == {(k * 32 // size, (k + 1) * 32 // size) for k in range(size)}
        assert all(idx[1] == slice(None) for idx in blocks.values())
        assert len(blocks) == 8  # each block on 8 // size devices: the data axis


def test_apply_keeps_the_values_bit_for_bit(tmp_path):
    mlp = _mlp()
    spec = _write(tmp_path, _doc([UP, DOWN]))
    placed = eqshard.apply(mlp, spec)
    plan = eqshard.plan(mlp, eqshard.load(spec))
    for before, after, want in zip(
        jax.tree_util.tree_leaves(mlp),
        jax.tree_util.tree_leaves(placed),
        jax.tree_util.tree_leaves(plan.shardings),
    ):
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before), strict=True)
        assert after.sharding.is_equivalent_to(want, after.ndim)
    stacked = _stacked()
    rule = {"path": "**.weight", "dims": "... hidden embed"}
    placed = eqshard.apply(stacked, _write(tmp_path, _doc([rule]), "s.json"))
    for before, after in zip(jax.tree_util.tree_leaves(stacked), jax.tree_util.tree_leaves(placed)):
        assert np.asarray(after).tobytes() == np.asarray(before).tobytes()


@pytest.mark.skipif(
    jax.__version_info__ < (0, 10), reason="host memory needs JAX 0.10 (eqshard refuses it before)"
)
def test_whole_dims_replicate_and_memory_is_kept():
    rules = eqshard.load(
        _doc(
            [{"path": "layers.0.weight", "dims": "embed _", "memory": "pinned_host"}],
            dims={"embed": None},
        )
    )
    matches, problems = rules.match(_mlp())
    assert problems == []
    assert matches[0].source == "rule"
    assert matches[0].place == "$.rules[0]"
    assert matches[0].memory == "pinned_host"
    assert str(matches[0].expr) == "embed _ -> * embed _"
    plan = eqshard.plan(_mlp(), rules)
    assert _spec(plan, 0) == jax.sharding.PartitionSpec()
    assert all(idx == (slice(None), slice(None)) for idx in _blocks(plan, 0).values())


BAD = [
    (
        {"path": "layers.0.weight", "dims": "hidden embed", "expr": "o i -> o* i"},
        "$.rules[0]",
        "the rule has both 'expr' and 'dims'; keep one",
    ),
    ({"path": "layers.0.weight"}, "$.rules[0]", "missing key 'expr' or 'dims'"),
    (
        {"path": "layers.0.weight", "dims": "hidden, embed"},
        "$.rules[0].dims",
        "'hidden,' is not a dim",
    ),
    (
        {"path": "layers.0.weight", "dims": "... hidden ... embed"},
        "$.rules[0].dims",
        "a second '...'",
    ),
    (
        {"path": "layers.0.weight", "dims": "hidden hidden"},
        "$.rules[0].dims",
        "'hidden' is named twice",
    ),
    (
        {"path": "layers.0.weight", "dims": "hiden embed"},
        "$.rules[0].dims",
        "`hiden`, which $.dims does not map; map it in $.dims or fix the name",
    ),
]


@pytest.mark.parametrize(("rule", "where", "message"), BAD)
def test_a_bad_dims_rule_is_refused_at_its_json_path(tmp_path, run_cli, rule, where, message):
    spec = _write(tmp_path, _doc([rule]))
    with pytest.raises(eqshard.SpecError) as info:
        eqshard.load(spec)
    assert [(p.where, message in p.message) for p in info.value.problems] == [
        (f"{spec}::{where}", True)
    ]
    assert where in str(info.value)
    result = run_cli("validate", spec)
    assert result.code == 1
    assert f"{spec}::{where}: " in result.out
    assert message in result.out
    assert "Traceback" not in result.out + result.err


def test_a_name_the_optimizer_sections_dims_do_not_map_is_refused(tmp_path):
    section = {"dims": {"embed": "*"}, "rules": [{"path": "**.weight", "dims": "hidden embed"}]}
    spec = _write(tmp_path, _doc([UP], optimizer=section))
    with pytest.raises(eqshard.SpecError, match=r"\$\.optimizer\.rules\[0\]\.dims") as info:
        eqshard.load(spec)
    assert "`hidden`, which $.optimizer.dims does not map" in str(info.value)


def test_a_rank_mismatch_is_a_problem_naming_the_leaf_and_the_rule(tmp_path):
    rule = {"path": "layers.0.weight", "dims": "hidden embed _"}
    rules = eqshard.load(_write(tmp_path, _doc([rule])))
    matches, problems = rules.match(_mlp())
    assert matches[0].expr is None
    assert len(problems) == 1
    assert problems[0].where.startswith("layers.0.weight")
    assert f"{rules.source}::$.rules[0] names 3 dims" in problems[0].message
    with pytest.raises(eqshard.SpecError) as info:
        eqshard.plan(_mlp(), rules)
    assert "layers.0.weight" in str(info.value)
    assert "$.rules[0] names 3 dims ('hidden embed _'), and this leaf has 2" in str(info.value)


def test_rules_made_in_python_refuse_an_unmapped_name_and_bad_text():
    with pytest.raises(eqshard.EqshardError, match=r"`hiden`, which \$\.dims does not map"):
        Rules((Rule("**.weight", Named("hiden embed")),), dims=DIMS)
    with pytest.raises(eqshard.EqshardError, match="is not a dim"):
        Named("hidden 2")
    rules = Rules((Rule("**.weight", Named("...  hidden embed")),), dims=DIMS)
    assert rules.rules[0].expr == Named("... hidden embed")


def test_a_dims_rule_round_trips(tmp_path):
    document = _doc([UP, {"path": "layers.1.weight", "expr": "o i -> o i*"}])
    rules = eqshard.load(_write(tmp_path, document))
    out = tmp_path / "out.eqshard.json"
    eqshard.dump(rules, out)
    written = json.loads(out.read_text())
    assert written["rules"][0] == UP
    assert written["rules"][1] == {"path": "layers.1.weight", "expr": "o i -> o i*"}
    again = eqshard.load(out)
    assert again.rules == rules.rules
    assert again.to_json() == rules.to_json()


def test_a_dims_rule_of_the_optimizer_section_uses_the_sections_dims(tmp_path):
    optax = pytest.importorskip("optax")
    mlp = _mlp()
    section = {
        "dims": {"hidden": "data"},
        "rules": [{"path": "layers.0.weight", "dims": "hidden _"}],
    }
    plan = eqshard.plan(mlp, eqshard.load(_write(tmp_path, _doc([UP], optimizer=section))))
    state = optax.adam(1e-3).init(eqx.filter(mlp, eqx.is_array))
    rows = {row.path: row for row in eqshard.report(state, plan).rows}
    assert rows["0.mu.layers.0.weight"].partition_spec == "P('data', None)"
    assert (rows["0.mu.layers.0.weight"].origin or "").startswith("$.optimizer.rules[0]")
    assert rows["0.nu.layers.1.weight"].partition_spec == "P()"  # its parameter's layout
    assert _spec(plan, 0) == jax.sharding.PartitionSpec("model", None)  # the file's dims
