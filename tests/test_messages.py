"""Errors a person can read: problems grouped by message in at most `MAX_LINES`
lines, unused rules shown where the leaves are, and rules given for an optimizer
state told to use the model's plan. Every text is pinned here."""

import ast
import importlib
import json
import pickle
import re
import warnings
from pathlib import Path

import equinox as eqx
import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqshard
from eqshard import SpecError, UnusedRuleWarning
from eqshard._problems import MAX_LINES, problem_lines
from eqshard._rules import looks_like_state
from eqshard.resolvers import Problem

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "specs" / "transformer.eqshard.json"
TRANSFORMER = f"{ROOT / 'examples' / 'transformer.py'}:build"

# Hundreds of faulty leaves, and four distinct faults among them: on 8 devices a
# weight of 20 rows does not split, a bias is not 2-D, `o3*` needs a multiple of 3
# devices, and `i2` uses 2 of the 8.
MANY = 200
MIXED_RULES = {
    "eqshard": 1,
    "rules": [
        {"path": "0.weight", "expr": "o i -> o i2"},
        {"path": "1.bias", "expr": "o i -> o* i"},
        {"path": "*.weight", "expr": "o i -> o* i"},
        {"path": "*.bias", "expr": "o -> o3*"},
    ],
}
MODEL_FILE = f"""
import equinox as eqx
import jax


def build():
    return [eqx.nn.Linear(12, 20, key=jax.random.key(0)) for _ in range({MANY})]
"""


def _layers(sizes):
    return eqx.filter_eval_shape(
        lambda: [eqx.nn.Linear(12, size, key=jax.random.key(0)) for size in sizes]
    )


def _mixed_lines() -> list[str]:
    """The grouped text of MIXED_RULES on MANY layers: each fault once, in the order
    of its first leaf, with its first three leaves named and the others counted."""
    rank = (
        "float32[20] 'o i -> o* i': the left side names 2 axes, but the array has 1 "
        "(shape (20,)); name one axis per dimension, or use '...' for the rest"
    )
    return [
        "0.weight (Linear.weight): float32[20, 12] 'o i -> o i2': i2 shards need 2 devices, 8 "
        "are given; add '*' to an element to take the rest, or a standalone '*' to replicate",
        "    o i -> o i2",
        "           ^^^^",
        f"0.bias (Linear.bias), 2.bias (Linear.bias), 3.bias (Linear.bias) and {MANY - 4} more: "
        "float32[20] 'o -> o3*': the starred counts o3* need a multiple of 3 devices, and 8 are "
        "left for them (8 are given); change the starred counts",
        "    o -> o3*",
        "         ^^^",
        f"1.weight (Linear.weight), 2.weight (Linear.weight), 3.weight (Linear.weight) and "
        f"{MANY - 4} more: float32[20, 12] 'o i -> o* i': axis 'o' (dimension 0 of shape (20, "
        "12)) has size 20, which does not split into 8 equal shards; choose a count that "
        "divides 20",
        "    o i -> o* i",
        "           ^^",
        f"1.bias (Linear.bias): {rank}",
        "    o i -> o* i",
        "    ^^^",
    ]


def test_hundreds_of_faulty_leaves_print_one_line_per_distinct_fault():
    model = _layers([20] * MANY)
    with pytest.raises(SpecError) as info:
        eqshard.plan(model, eqshard.load(MIXED_RULES))
    error = info.value
    # every problem is kept, in model order
    assert len(error.problems) == 2 * MANY
    assert [p.where.partition(" ")[0] for p in error.problems] == [
        f"{i}.{leaf}" for i in range(MANY) for leaf in ("weight", "bias")
    ]
    # the text names each distinct fault once, with its first places and a count
    assert str(error).splitlines() == [f"{2 * MANY} problems in the spec:"] + [
        f"  {line}" for line in _mixed_lines()
    ]


def test_the_text_stays_under_the_line_cap_and_counts_what_it_leaves_out():
    sizes = list(range(20, 120))  # 100 leaves; the 88 sizes 8 does not divide each fail alike
    model = _layers(sizes)
    with pytest.raises(SpecError) as info:
        eqshard.plan(model, "o i -> o* i")
    error = info.value
    failing = [size for size in sizes if size % 8]
    # a weight's and a bias's faults for each failing size, and a bias's rank for the others
    assert len(error.problems) == len(failing) + len(sizes)
    lines = str(error).splitlines()
    assert len(lines) <= MAX_LINES
    assert lines[1] == (
        "  0.weight (Linear.weight): float32[20, 12] 'o i -> o* i': axis 'o' (dimension 0 of "
        "shape (20, 12)) has size 20, which does not split into 8 equal shards; choose a count "
        "that divides 20"
    )
    shown = [line for line in lines if not line.startswith("      ")][1:-1]
    assert len(shown) == (len(lines) - 2) // 3  # a line and a caret picture for each fault
    left = len(error.problems) - len(shown)
    assert lines[-1] == (
        f"  ... and {left} more problems ({left} different messages): `error.problems` lists "
        "every one"
    )


def test_problem_lines_group_by_message_and_detail():
    problems = [
        Problem("a", "same"),
        Problem("b", "other", "    x\n    ^"),
        Problem("c", "same"),
        Problem("d", "other", "    y\n    ^"),  # another picture: another group
        Problem("e", "same"),
        Problem("f", "same"),
    ]
    assert problem_lines(problems) == [
        "a, c, e and 1 more: same",
        "b: other",
        "    x",
        "    ^",
        "d: other",
        "    y",
        "    ^",
    ]
    assert problem_lines(problems, limit=4, more="see all") == [
        "a, c, e and 1 more: same",
        "... and 2 more problems (2 different messages): see all",
    ]


def test_check_groups_hundreds_of_faults_and_json_keeps_every_one(run_cli, tmp_path):
    (tmp_path / "many_layers.py").write_text(MODEL_FILE)
    spec = tmp_path / "mixed.eqshard.json"
    spec.write_text(json.dumps(MIXED_RULES))
    model = f"{tmp_path / 'many_layers.py'}:build"
    text = run_cli("check", spec, "--model", model)
    assert text.code == 1
    lines = text.out.splitlines()
    end = lines.index(f"{spec} on 8 devices: {2 * MANY} problem(s)")
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{MANY * 2} array leaves"))
    assert lines[start + 1 : end] == _mixed_lines()

    result = run_cli("check", spec, "--model", model, "--format", "json")
    assert result.code == 1
    (check,) = json.loads(result.out)["checks"]
    assert len(check["problems"]) == 2 * MANY


def test_validate_and_load_errors_are_grouped_and_capped(run_cli, tmp_path):
    spec = tmp_path / "bad.eqshard.json"
    rules = [{"path": f"a{k}", "expr": "a -> b"} for k in range(50)]
    rules += [{"path": f"c{k}", "expr": f"a -> c{k + 1}"} for k in range(20)]  # 20 pictures
    spec.write_text(json.dumps({"eqshard": 1, "rules": rules}))
    same = (
        "axis 'b' is on the right but not on the left; add it to the left, or drop its name to "
        "replicate instead"
    )
    result = run_cli("validate", spec)
    assert result.code == 1
    lines = result.out.splitlines()
    assert lines[:3] == [
        f"{spec}::$.rules[0].expr, {spec}::$.rules[1].expr, {spec}::$.rules[2].expr and 47 "
        f"more: {same}",
        "    a -> b",
        "         ^",
    ]
    assert len(lines) == MAX_LINES
    assert (
        lines[-1] == "... and 8 more problems (8 different messages): --format json lists every one"
    )
    # the same problems raised through `check`: capped, and pointing at --format json
    result = run_cli("check", spec, "--model", TRANSFORMER)
    assert result.code == 1
    lines = result.err.splitlines()
    assert lines[0] == f"eqshard check: error: {spec} is not a valid eqshard spec:"
    assert len(lines) <= MAX_LINES
    assert lines[-1] == (
        "  ... and 9 more problems (9 different messages): --format json lists every one"
    )
    result = run_cli("check", spec, "--model", TRANSFORMER, "--format", "json")
    assert len(json.loads(result.out)["error"]["problems"]) == 70


@pytest.fixture
def typo(tmp_path):
    """The example spec file with one rule path mistyped: `**.upp.weight`."""
    path = tmp_path / "typo.eqshard.json"
    path.write_text(EXAMPLE.read_text().replace('"**.up.weight"', '"**.upp.weight"'))
    return path


TYPO = (
    "rule '**.upp.weight' matched no leaf of the model; did you mean '**.up.weight', which "
    "matches blocks.0.up.weight, blocks.1.up.weight?"
)


def test_check_shows_an_unused_rule_right_under_the_table(run_cli, typo):
    result = run_cli("check", typo, "--model", TRANSFORMER)
    assert result.code == 0  # the documented contract: a warning, not a failure
    lines = result.out.splitlines()
    bottom = next(i for i, line in enumerate(lines) if line.startswith("└"))
    assert lines[bottom + 1] == f"warning: {typo}::$.rules[4]: {TYPO}"
    # the rows of the leaves it was meant for say so, in the table
    flagged = [line for line in lines if "(warning: $.rules[4])" in line]
    assert [line.split("│")[1].strip() for line in flagged] == [
        "blocks.0.up.weight",
        "blocks.1.up.weight",
    ]
    assert all(re.search(r"│ default \(warning: \$\.rules\[4\]\) +│", line) for line in flagged)
    assert lines[-2:] == [f"{typo} on 8 devices: ok, with 1 warning (an error under --strict)", ""]

    result = run_cli("check", typo, "--model", TRANSFORMER, "--format", "json")
    assert result.code == 0
    (check,) = json.loads(result.out)["checks"]
    assert check["warnings"] == [
        {
            "kind": "UnusedRuleWarning",
            "where": f"{typo}::$.rules[4]",
            "file": str(typo),
            "path": "$.rules[4]",
            "message": TYPO,
            "rule": "**.upp.weight",
            "did_you_mean": ["**.up.weight", "**.weight", "**.output_proj.weight"],
            "leaves": ["blocks.0.up.weight", "blocks.1.up.weight"],
        }
    ]
    assert check["notes"] == [f"{typo}::$.rules[4]: {TYPO}"]

    result = run_cli("check", typo, "--model", TRANSFORMER, "--strict")
    assert result.code == 1
    assert f"{typo}::$.rules[4]: {TYPO} (--strict)" in result.out.splitlines()


def test_a_rule_that_earlier_rules_shadow_names_them():
    rules = eqshard.load(
        {
            "eqshard": 1,
            "rules": [
                {"path": "**.weight", "expr": "o i -> o* i"},
                {"path": "layers.1.weight", "expr": "o i -> o i*"},
            ],
        }
    )
    model = eqx.filter_eval_shape(eqx.nn.MLP, 8, 8, 16, 1, key=jax.random.key(0))
    with pytest.warns(UnusedRuleWarning) as caught:
        eqshard.plan(model, rules)
    assert str(caught[0].message) == (
        "<mapping>::$.rules[1]: rule 'layers.1.weight' matches layers.1.weight, and gives none "
        "its expression: an earlier rule matches each first ($.rules[0] matches "
        "layers.1.weight); move this rule before it, or drop it"
    )


STATE_HINT = (
    "this tree looks like an optimizer state built from the model (it holds optax's "
    "ScaleByAdamState), and a spec file's rules are written for the model: lay the state out "
    "with the model's plan, `plan = eqshard.plan(model, rules)` then "
    "`eqshard.apply(opt_state, plan)`"
)


def test_rules_given_for_an_optax_state_say_to_pass_the_models_plan():
    model = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    state = optax.adamw(1e-3).init(eqx.filter(model, eqx.is_array))
    rules = eqshard.load(
        {
            "eqshard": 1,
            "rules": [
                {"path": "layers.0.weight", "expr": "o i -> o* i"},
                {"path": "layers.1.weight", "expr": "o i -> o i*"},
            ],
        }
    )
    with pytest.warns(UnusedRuleWarning) as caught:
        eqshard.apply(state, rules)
    warning = caught[0].message
    assert isinstance(warning, UnusedRuleWarning)
    assert str(warning) == "\n".join(
        [
            "<mapping>::$.rules: 2 rules gave no leaf of this tree its expression:",
            "  $.rules[0]: rule 'layers.0.weight' matched no leaf of this tree",
            "  $.rules[1]: rule 'layers.1.weight' matched no leaf of this tree",
            STATE_HINT[0].upper() + STATE_HINT[1:],
        ]
    )
    assert "of the model" not in str(warning)
    assert [str(p) for p in warning.problems] == [
        f"<mapping>::$.rules[0]: rule 'layers.0.weight' matched no leaf of this tree; {STATE_HINT}",
        f"<mapping>::$.rules[1]: rule 'layers.1.weight' matched no leaf of this tree; {STATE_HINT}",
    ]
    # what it says to do works, without a warning
    plan = eqshard.plan(model, rules)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        placed = eqshard.apply(state, plan)
    assert placed[0].mu.layers[0].weight.sharding.spec == P("m0", None)
    assert placed[0].nu.layers[1].weight.sharding.spec == P(None, "m0")

    # under "default": "error", each leaf's problem says the same
    strict = eqshard.load({"eqshard": 1, "default": "error", "rules": []})
    with pytest.raises(SpecError) as info:
        eqshard.apply(state, strict)
    assert info.value.problems[0].message.endswith(f"; {STATE_HINT}")


def test_what_looks_like_an_optimizer_state():
    model = eqx.filter_eval_shape(eqx.nn.MLP, 8, 8, 16, 1, key=jax.random.key(0))
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    attention = eqx.filter_eval_shape(
        lambda: eqx.nn.MultiheadAttention(
            2, 8, use_query_bias=True, use_key_bias=True, use_value_bias=True,
            use_output_bias=True, key=jax.random.key(0),
        )
    )  # fmt: skip
    # a model: its projections are alike, but they are the fields of a module
    assert looks_like_state(model) is None
    assert looks_like_state(attention) is None
    assert looks_like_state([params, params]) is None  # a list of alike subtrees
    # twin towers of a model count no steps
    assert looks_like_state({"encoder": params, "decoder": params}) is None
    state = {"m": params, "v": params, "step": jax.ShapeDtypeStruct((), "int32")}
    assert looks_like_state(state) == STATE_HINT.replace(
        "it holds optax's ScaleByAdamState", "its subtrees m and v have the same paths and shapes"
    )


# --------------------------------------------------------------------------- #
# Every error eqshard raises is public.
# --------------------------------------------------------------------------- #

PACKAGE = ROOT / "eqshard"


def _modules_with_classes() -> list[str]:
    """The eqshard modules that define a class (not `__main__`, which runs the
    command line)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py":
            continue
        if any(isinstance(node, ast.ClassDef) for node in ast.walk(ast.parse(path.read_text()))):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def test_every_error_eqshard_defines_is_public():
    errors = {
        cls
        for name in _modules_with_classes()
        for cls in vars(importlib.import_module(name)).values()
        if isinstance(cls, type) and issubclass(cls, eqshard.EqshardError)
    }
    assert {eqshard.StepError, eqshard.ModelError, eqshard.UsageError} <= errors
    for cls in errors:
        assert getattr(eqshard, cls.__name__) is cls, cls
        assert cls.__name__ in eqshard.__all__, cls
        assert cls.__module__ == "eqshard", cls  # tracebacks show `eqshard.StepError`
        if issubclass(cls, SpecError):
            error = cls([Problem("w", "a fault")])
        elif issubclass(cls, (eqshard.ExpressionError, eqshard.PathError)):
            error = cls("a b", 2, "a fault")
        else:
            error = cls("a fault")
        again = pickle.loads(pickle.dumps(error))  # found again by its public name
        assert (type(again), str(again)) == (cls, str(error))


def test_every_error_and_warning_a_docstring_names_exists():
    named = {
        found
        for path in PACKAGE.rglob("*.py")
        for found in re.findall(r"\beqshard\.([A-Z]\w*(?:Error|Warning))\b", path.read_text())
    }
    assert {"StepError", "SpecError"} <= named
    assert sorted(name for name in named if not hasattr(eqshard, name)) == []
