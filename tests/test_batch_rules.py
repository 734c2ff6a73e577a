"""A batch laid out by rules: a spec file's `"batch"` section (and `eqshard.BatchRules`)
lays out a structured batch leaf by leaf, by its paths within its argument. A
`jraph.GraphsTuple` (16 nodes, 88 edges, 3 graphs) trains under the docs' FSDP spec
equal to the unsharded run, its nodes and edges split and its per-graph leaves
whole; a leaf the layout does not divide is refused, naming it, its shape and the
rule, or left whole with a warning, as the section says; `eqshard.cost`, `eqshard
check --step` and `eqshard.testing` lay the batch out by the same section."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqshard

jraph = pytest.importorskip("jraph")

import graph_model as gm  # noqa: E402  (it imports jraph)

MODULE = str(Path(__file__).parent / "graph_model.py")
FSDP = {"eqshard": 1, "mesh": [["data", "*"], ["model", 4]], "default": "fsdp"}  # docs/meshes.md
BY_RULES = {  # nodes and edges over every device; per-graph leaves whole
    "rules": [
        {"path": "{nodes,edges,senders,receivers}", "expr": "b ... -> b* ..."},
        {"path": "{n_node,n_edge,globals}", "expr": "... -> * ...", "comment": "per graph"},
    ],
}
LEFT_WHOLE = {"indivisible": "replicate"}  # data parallel where it divides, else whole
PER_GRAPH = ("globals", "n_node", "n_edge")


def _rules(batch: Any, **more: Any) -> eqshard.Rules:
    return eqshard.load({**FSDP, "batch": batch, **more})


def _arrays(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))]


def _batch_shardings(rules: eqshard.Rules, batch: Any = None) -> dict[str, Any]:
    """The sharding each leaf of the graph is laid out by, as `eqshard.jit` lays it out."""
    model = gm.build()
    opt_state = gm.optimizer().init(eqx.filter(model, eqx.is_array))
    g = gm.batch()
    plan = eqshard.plan(model, rules)
    with eqshard.use(plan):
        lowered = eqshard.jit(gm.step, batch=batch).lower(model, opt_state, g)
    (argument,) = [a for a in lowered.arguments if a.kind == "batch"]
    names = [leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(g)[0]]
    return dict(zip(names, argument.shardings))


def leaf_name(path: Any) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


# --------------------------------------------------------------------------- #
# Training: equal to the unsharded run, nodes and edges split, per-graph leaves whole
# --------------------------------------------------------------------------- #


@pytest.mark.slow  # trains the graph network three steps, unsharded and under each spec
@pytest.mark.parametrize("batch", [BY_RULES, LEFT_WHOLE], ids=["by rules", "left whole"])
def test_a_graph_trains_under_fsdp_and_batch_rules_equal_to_unsharded(batch):
    model, g, optimizer = gm.build(), gm.batch(), gm.optimizer()
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    plain = eqx.filter_jit(gm.step)
    want_model, want_state, want_losses = model, opt_state, []
    for _ in range(3):
        want_model, want_state, value = plain(want_model, want_state, g)
        want_losses.append(float(value))
    assert want_losses[2] < want_losses[0]  # it trains: the values compared move

    rules = _rules(batch)
    plan = eqshard.plan(model, rules)
    step = eqshard.jit(gm.step)
    got_losses = []
    with eqshard.use(plan), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_model, got_state = eqshard.apply((model, opt_state), plan)
        for _ in range(3):
            got_model, got_state, value = step(got_model, got_state, g)
            got_losses.append(float(value))
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for got, want in zip(_arrays((got_model, got_state)), _arrays((want_model, want_state))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got_model.embed.weight.sharding.shard_shape((8, 8)) == (8, 4)  # FSDP over data
    whole = [w.message for w in caught if isinstance(w.message, eqshard.IndivisibleBatchWarning)]
    assert len(whole) == (batch is LEFT_WHOLE)  # one warning, at the first trace


def test_batch_rules_split_nodes_and_edges_and_keep_per_graph_leaves_whole():
    g = gm.batch()
    found = _batch_shardings(_rules(BY_RULES))
    assert {name: s.shard_shape(getattr(g, name).shape) for name, s in found.items()} == {
        "nodes": (2, 8),  # 16 / 8
        "edges": (11, 4),  # 88 / 8
        "senders": (11,),
        "receivers": (11,),
        "globals": (3, 1),
        "n_node": (3,),
        "n_edge": (3,),
    }
    assert all(found[name].is_fully_replicated for name in PER_GRAPH)


def test_left_whole_splits_what_data_parallel_divides_and_names_the_rest():
    g = gm.batch()
    with pytest.warns(eqshard.IndivisibleBatchWarning) as caught:
        found = _batch_shardings(_rules(LEFT_WHOLE))
    shapes = {name: s.shard_shape(getattr(g, name).shape) for name, s in found.items()}
    assert (shapes["nodes"], shapes["edges"]) == ((8, 8), (44, 4))  # over data, 2
    assert all(found[name].is_fully_replicated for name in PER_GRAPH)
    (warning,) = [w.message for w in caught]
    assert isinstance(warning, eqshard.IndivisibleBatchWarning)
    assert warning.where == "<mapping>::$.batch"
    assert [place for place, _ in warning.leaves] == ["`g`.globals", "`g`.n_node", "`g`.n_edge"]
    assert "`g`.globals float32[3, 1] by data parallel ('b ... -> b2 ... 4')" in str(warning)
    assert [p.where for p in warning.problems] == ["`g`.globals", "`g`.n_node", "`g`.n_edge"]


def test_indivisible_error_names_the_leaf_its_shape_and_the_rule():
    split_all = {"rules": [{"path": "**", "expr": "b ... -> b* ..."}], "indivisible": "error"}
    with pytest.raises(eqshard.SpecError) as refused:
        _batch_shardings(_rules(split_all))
    text = str(refused.value)
    assert (
        "`g`.globals: the batch float32[3, 1] is laid out by <mapping>::$.batch.rules[0] " in text
    )
    assert "('b ... -> b* ...'), which does not divide it over 8 devices; " in text
    assert 'set "indivisible": "replicate" in <mapping>::$.batch to leave such a leaf whole' in text
    assert "`g`.n_node, `g`.n_edge: the batch int32[3]" in text  # one message, both named
    assert "has size 3, which does not split into 8 equal shards" in text
    assert "nodes" not in text  # 16 and 88 divide
    assert "edges" not in text
    # the default refuses them too: data parallel, which the section's default is
    with pytest.raises(eqshard.SpecError, match=r"`g`.globals: the batch float32\[3, 1\] is laid "
                       r"out by data parallel, the default of <mapping>::\$.batch "
                       r"\('b \.\.\. -> b2 \.\.\. 4'\), which does not divide it"):  # fmt: skip
        _batch_shardings(_rules({}))


def test_a_rule_that_does_not_fit_a_leaf_is_an_error_whatever_indivisible_says():
    wrong_rank = {"rules": [{"path": "nodes", "expr": "a b c -> a* b c"}], **LEFT_WHOLE}
    with pytest.raises(
        eqshard.SpecError,
        match=r"`g`.nodes: the batch float32\[16, 8\] cannot be laid out by "
        r"<mapping>::\$.batch.rules\[0\] \('a b c -> a\* b c'\); give it a rule that fits it: "
        r"the left side names 3 axes",
    ):
        _batch_shardings(_rules(wrong_rank))


def test_default_error_names_each_leaf_no_rule_matches():
    strict = {**BY_RULES, "rules": BY_RULES["rules"][:1], "default": "error"}
    with pytest.raises(eqshard.SpecError) as refused:
        _batch_shardings(_rules(strict))
    text = str(refused.value)
    for name, what in [("globals", "float32[3, 1]"), ("n_node", "int32[3]")]:
        assert (
            f"`g`.{name}: no rule of <mapping>::$.batch matches the batch leaf {name} ({what}), "
            f'and its "default" is "error"; add a rule whose path matches \'{name}\''
        ) in text


def test_an_unused_batch_rule_says_which_path_it_meant():
    typo = {"rules": [{"path": "nodez", "expr": "n ... -> n* ..."}], **LEFT_WHOLE}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _batch_shardings(_rules(typo))
    kinds = {type(w.message): w.message for w in caught}
    assert set(kinds) == {eqshard.IndivisibleBatchWarning, eqshard.UnusedRuleWarning}
    assert str(kinds[eqshard.UnusedRuleWarning]) == (
        "<mapping>::$.batch.rules[0]: rule 'nodez' matched no leaf of the batch; "
        "did you mean 'nodes', which matches nodes?"
    )


# --------------------------------------------------------------------------- #
# Paths within each argument; the Python form
# --------------------------------------------------------------------------- #


def test_paths_are_within_each_argument_dict_keys_indices_and_a_bare_array():
    model = eqx.nn.Linear(4, 4, key=jax.random.key(0))
    plan = eqshard.plan(model, eqshard.load(FSDP))
    rules = eqshard.BatchRules(
        rules=(
            eqshard.Rule("x", eqshard.expression.parse("b ... -> b* ...")),  # a dict's key
            eqshard.Rule("1", eqshard.expression.parse("... -> * ...")),  # a tuple's index
        ),
        default=eqshard.expression.parse(
            "b ... -> b2 ... 4"
        ),  # the rest: pair[0], and the bare array (path '')
    )

    def step(model, batch, pair, bare):
        return model.weight.sum() + batch["x"].sum() + pair[1].sum() + bare.sum()

    args = ({"x": jnp.ones((8, 4))}, (jnp.ones((8, 4)), jnp.ones((8, 4))), jnp.ones((8,)))
    with eqshard.use(plan):
        lowered = eqshard.jit(step, batch=rules).lower(model, *args)
    shapes = [
        [s.shard_shape(np.shape(x)) for s, x in zip(a.shardings, jax.tree_util.tree_leaves(arg))]
        for a, arg in zip(lowered.arguments[1:], args)
    ]
    assert shapes == [[(1, 4)], [(4, 4), (8, 4)], [(4,)]]
    assert lowered.batch == "<rules>::$.batch"


def test_batch_rules_in_python_win_over_the_files_and_are_checked():
    whole = eqshard.BatchRules(default="replicate")
    found = _batch_shardings(_rules(BY_RULES), batch=whole)
    assert all(s.is_fully_replicated for s in found.values())
    rules = eqshard.Rules(default="fsdp", batch=eqshard.BatchRules(), source="spec.json")
    assert isinstance(rules.batch, eqshard.BatchRules)
    assert rules.batch.where("$") == "spec.json::$.batch"
    with pytest.raises(eqshard.ExpressionError, match=r"a batch's arrays have no annotation"):
        eqshard.BatchRules(rules=(eqshard.Rule("nodes", eqshard.expression.parse("n*")),))
    with pytest.raises(eqshard.EqshardError, match=r"`BatchRules.rules\[0\]` \('nodes'\) lays "
                       r"out batch leaves by a complete expression such as 'b \.\.\. -> b\* "
                       r"\.\.\.', or by dims by name, not 'fsdp'"):  # fmt: skip
        eqshard.BatchRules(rules=(eqshard.Rule("nodes", "fsdp"),))
    with pytest.raises(eqshard.EqshardError, match=r"names the memory kind 'pinned_host'"):
        eqshard.BatchRules(
            rules=(eqshard.Rule("x", eqshard.expression.parse("b -> b*"), memory="pinned_host"),)
        )
    with pytest.raises(eqshard.EqshardError, match=r"`BatchRules.default` is a complete "
                       r"expression such as 'b \.\.\. -> b\* \.\.\.', 'replicate', 'error', "
                       r"or None \(data parallel\), not 'fsdp'"):  # fmt: skip
        eqshard.BatchRules(default="fsdp")
    with pytest.raises(eqshard.EqshardError, match=r"`BatchRules.indivisible` is 'error' or "
                       r"'replicate' \(a whole copy on every device\), not 'whole'"):  # fmt: skip
        eqshard.BatchRules(indivisible="whole")  # type: ignore[arg-type]
    with pytest.raises(eqshard.EqshardError, match=r"`batch=` is a complete expression such as "
                       r"'b \.\.\. -> b\* \.\.\.', or `eqshard.BatchRules` \(rules over the "
                       r"batch's paths\), not dict"):  # fmt: skip
        eqshard.jit(gm.step, batch={"rules": []})  # type: ignore[arg-type]


def test_the_demo_lays_its_one_array_out_by_a_batch_section():
    from eqshard._demo._run import batch_expression

    model = eqx.nn.Linear(4, 4, key=jax.random.key(0))
    every = {"rules": [{"path": "**", "expr": "b ... -> b* ..."}]}
    assert batch_expression(eqshard.plan(model, _rules(every))) == "b ... -> b* ..."
    assert batch_expression(eqshard.plan(model, _rules({"default": "replicate"}))) == (
        "... -> * ..."
    )
    assert batch_expression(eqshard.plan(model, _rules({}))) == "b ... -> b2 ... 4"
    with pytest.raises(eqshard.EqshardError, match=r"<mapping>::\$.batch: no rule lays out the "
                       r"demo's batch, one array whose path is empty"):  # fmt: skip
        batch_expression(eqshard.plan(model, _rules({"default": "error"})))


# --------------------------------------------------------------------------- #
# The file: load, dump, validate
# --------------------------------------------------------------------------- #


def test_a_batch_section_loads_and_dumps_back(tmp_path):
    document = {
        **FSDP,
        "batch": {
            "comment": "a jraph.GraphsTuple",
            "rules": BY_RULES["rules"],
            "default": "error",
            "indivisible": "replicate",
        },
    }
    rules = eqshard.load(document)
    assert isinstance(rules.batch, eqshard.BatchRules)
    assert [(r.path, str(r.expr), r.comment) for r in rules.batch.rules] == [
        ("{nodes,edges,senders,receivers}", "b ... -> b* ...", None),
        ("{n_node,n_edge,globals}", "... -> * ...", "per graph"),
    ]
    assert (rules.batch.default, rules.batch.indivisible) == ("error", "replicate")
    path = tmp_path / "graph.eqshard.json"
    eqshard.dump(rules, path)
    written = json.loads(path.read_text())
    assert written["batch"] == document["batch"]
    again = eqshard.load(path)
    assert again.to_json() == rules.to_json()
    assert isinstance(again.batch, eqshard.BatchRules)
    assert again.batch.source == str(path)
    # the expression form is as it was
    assert eqshard.load({"eqshard": 1, "batch": "... -> * ..."}).batch == eqshard.expression.parse(
        "... -> * ..."
    )
    section = eqshard.load({"eqshard": 1, "batch": {"default": "b ... -> b2 ..."}}).batch
    assert isinstance(section, eqshard.BatchRules)
    assert section.default == eqshard.expression.parse("b ... -> b2 ...")


BAD_SECTIONS = [
    (
        {"rules": [{"path": "nodes", "expr": "n* ..."}]},
        r"<mapping>::\$.batch.rules\[0\].expr: a batch's arrays have no annotation to complete "
        r"a short form: write both sides",
    ),
    (
        {"rules": [{"path": "nodes..x", "expr": "n ... -> n* ..."}]},
        r"<mapping>::\$.batch.rules\[0\].path: an empty segment",
    ),
    (
        {"rules": [{"path": "nodes", "expr": "n -> n* e"}]},
        r"<mapping>::\$.batch.rules\[0\].expr: axis 'e' is on the right but not on the left",
    ),
    (
        {"rules": [{"path": "nodes", "dims": "n"}]},
        r"<mapping>::\$.batch.rules\[0\].dims: `n`, which \$.dims does not map; map it in "
        r"\$.dims or fix the name",  # dims by name are the file's
    ),
    ({"rules": [{"path": "nodes"}]}, r"<mapping>::\$.batch.rules\[0\]: missing key 'expr'"),
    (
        {"rules": [{"path": "x", "expr": "... -> * ..."}, {"path": "['x']", "expr": "a -> a*"}]},
        r"<mapping>::\$.batch.rules\[1\].path: this rule can never match: \$.batch.rules\[0\] "
        r"has 'x', the same path, and comes first; remove one",
    ),
    (
        {"default": "fsdp"},
        r"<mapping>::\$.batch.default: 'fsdp' is not a default of the batch section: 'replicate' "
        r"\(a whole copy on every device\), 'error', or a complete expression such as "
        r"'b \.\.\. -> b\* \.\.\.'; leave it out for data parallel",
    ),
    ({"default": "b* ..."}, r"<mapping>::\$.batch.default: a batch's arrays have no annotation"),
    (
        {"indivisible": "whole"},
        r"<mapping>::\$.batch.indivisible: 'whole' is not what a batch leaf gets whose layout "
        r"does not divide it: 'error' \(the default: an error naming the leaf\) or 'replicate'",
    ),
    (
        {"rules": [], "optimizer": "x"},
        r"<mapping>::\$.batch: unknown key 'optimizer'; the keys here are 'comment', 'rules', "
        r"'default', 'indivisible'",
    ),
    (
        5,
        r"<mapping>::\$.batch: 5 is neither an einshard expression, such as 'b \.\.\. -> b\* "
        r"\.\.\.' or '\.\.\. -> \* \.\.\.', nor a section of batch rules",
    ),
]


@pytest.mark.parametrize(("section", "message"), BAD_SECTIONS)
def test_a_bad_batch_section_is_refused_at_its_json_path(section, message):
    with pytest.raises(eqshard.SpecError, match=message):
        eqshard.load({"eqshard": 1, "batch": section})


def test_validate_names_each_fault_of_the_batch_section(run_cli, tmp_path):
    path = tmp_path / "bad.eqshard.json"
    section = {"rules": [{"path": "nodes", "expr": "n* ..."}], "indivisible": "whole"}
    path.write_text(json.dumps({"eqshard": 1, "batch": section}))
    result = run_cli("validate", path)
    assert result.code == 1
    assert f"{path}::$.batch.indivisible: 'whole' is not what a batch leaf gets" in result.out
    assert f"{path}::$.batch.rules[0].expr: a batch's arrays have no annotation" in result.out


def test_the_schema_takes_a_section_as_the_loader_does():
    validator = eqshard._specfile._schema.validator()  # the schema alone, as editors use it
    good = {"eqshard": 1, "batch": {**BY_RULES, "default": "... -> * ...", **LEFT_WHOLE}}
    assert not list(validator.iter_errors(good))
    bad = {"eqshard": 1, "batch": {"rules": [{"path": "n", "expr": "fsdp"}], "default": 2}}
    assert {e.json_path for e in validator.iter_errors(bad)} == {
        "$.batch.rules[0].expr",
        "$.batch.default",
    }


# --------------------------------------------------------------------------- #
# cost, check --step and the harness lay the batch out by the section
# --------------------------------------------------------------------------- #


def _abstract() -> tuple[Any, Any, Any]:
    model = eqx.filter_eval_shape(gm.build)
    opt_state = jax.eval_shape(
        gm.optimizer().init, eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    )
    return model, opt_state, eqx.filter_eval_shape(gm.batch)


@pytest.mark.slow  # compiles the step twice
def test_cost_lays_the_batch_out_by_the_section():
    model, opt_state, g = _abstract()
    c = eqshard.cost(model, opt_state, g, step=gm.step, spec=_rules(BY_RULES), devices=8)
    assert c.batch == "<mapping>::$.batch"
    whole = eqshard.cost(model, opt_state, g, step=gm.step, spec=_rules("... -> * ..."), devices=8)
    graph_bytes = sum(np.prod(x.shape) * 4 for x in jax.tree_util.tree_leaves(g))
    per_graph = (3 * 1 + 3 + 3) * 4
    split = (graph_bytes - per_graph) // 8 + per_graph  # nodes and edges split 8 ways
    assert whole.memory.arguments - c.memory.arguments == graph_bytes - split
    # and by BatchRules given to `cost`, which win over the file's
    given = eqshard.cost(
        model,
        opt_state,
        g,
        step=gm.step,
        spec=_rules("... -> * ..."),
        devices=8,
        batch=eqshard.load({"eqshard": 1, "batch": BY_RULES}).batch,
    )
    assert given.memory.arguments == c.memory.arguments


def _spec_file(tmp_path: Path, batch: Any) -> Path:
    path = tmp_path / "graph.eqshard.json"
    path.write_text(json.dumps({**FSDP, "batch": batch}))
    return path


STEP_ARGS = [
    *("--model", f"{MODULE}:build", "--make-batch", f"{MODULE}:batch"),
    *("--step", f"{MODULE}:step", "--optimizer", f"{MODULE}:optimizer"),
]


@pytest.mark.slow  # `check --step` compiles the step
def test_check_step_lays_the_batch_out_by_the_section_and_names_leaves_left_whole(
    run_cli, tmp_path
):
    path = _spec_file(tmp_path, LEFT_WHOLE)
    result = run_cli("check", path, *STEP_ARGS, "--device-counts", "8", "--format", "json")
    assert result.code == 0, result.out + result.err
    (found,) = json.loads(result.out)["checks"]
    assert found["cost"]["batch"] == f"{path}::$.batch"
    whole = [w for w in found["warnings"] if w["kind"] == "IndivisibleBatchWarning"]
    assert [w["where"] for w in whole] == ["`g`.globals", "`g`.n_node", "`g`.n_edge"]
    assert "int32[3] by data parallel ('b ... -> b2 ... 4')" in whole[1]["message"]
    strict = run_cli("check", path, *STEP_ARGS, "--device-counts", "8", "--strict")
    assert strict.code == 1
    assert "`g`.n_node, `g`.n_edge: int32[3] by data parallel" in strict.out
    refused = run_cli("check", _spec_file(tmp_path, {}), *STEP_ARGS, "--device-counts", "8")
    assert refused.code == 1
    assert "`g`.globals: the batch float32[3, 1] is laid out by data parallel" in refused.err


@pytest.mark.slow  # worker processes, each compiling the step
def test_the_harness_lays_the_batch_out_by_the_section(tmp_path):
    from eqshard.testing import assert_equivalent

    path = _spec_file(tmp_path, BY_RULES)
    assert_equivalent(gm.build, path, gm.loss, gm.batch, device_counts=(8,), optimizer=gm.optimizer)
    with pytest.raises(eqshard.EqshardError) as refused:
        assert_equivalent(gm.build, _spec_file(tmp_path, {}), gm.loss, gm.batch, device_counts=(8,))
    assert f'the batch cannot be laid out by the "batch" of {path}' in str(refused.value)
    assert "batch().globals: the batch float32[3, 1] is laid out by data parallel" in str(
        refused.value
    )
