"""Every name eqshard prints is a rule path that lays out exactly that leaf.

`leaf_name` names a leaf in every message, report and `check`; written as a spec
file's one rule path, it must match that leaf and no other, quoting included. Here
over random dict keys (spaces, dots, brackets, quotes, backslashes, `*`, empty,
digits, Unicode of every kind), through the files and calls a user makes, and over
the leaves of real models.
"""

import json
import tempfile
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import PartitionSpec as P
from jsonschema import Draft202012Validator

import eqshard
from eqshard._cli._check import check
from eqshard._fields import is_array_like, leaf_name, walk_fields
from eqshard._paths._grammar import parse
from eqshard._paths._match import PathIndex, match
from eqshard._paths._names import name, segments

# Characters a dict key may hold: what the path grammar reads specially, digits,
# letters, a combining mark, emoji, right-to-left text and marks, control and
# format characters, a line separator and a lone surrogate.
_KEY_CHARS = [
    " ", ".", "[", "]", "'", '"', "\\", "*", ",", "0", "7", "a", "Z", "_", "é", "\u0301",
    "😀", "👩", "\u200d", "💻", "\u05d0", "\u0627", "\u200f", "\u202e", "\n", "\t", "\x00", "\x1b",
    "\x7f", "\x85", "\u2028", "\ufeff", "\ud800", "\U0010ffff", "中",
]  # fmt: skip
_SOME_KEYS = ["", "*", "**", "0", "12", "['a']", "a.b", "w[0,0] 16x0e,32x0e", "the root"]
keys_ = st.one_of(
    st.text(st.sampled_from(_KEY_CHARS), max_size=6),
    st.text(max_size=4),
    st.sampled_from(_SOME_KEYS),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(keys_, min_size=1, max_size=5), st.data())
def test_name_and_parse_are_inverses(segs: list[str], data: Any) -> None:
    text = name(segs)
    assert parse(text) == tuple(segs)  # every segment literal, quoted or not
    assert match(text, segs)
    # and no other path: one that differs in a segment, or is longer or shorter
    other = list(segs)
    k = data.draw(st.integers(0, len(segs) - 1))
    other[k] = data.draw(keys_.filter(lambda key: key != segs[k]))
    for path in (other, segs[:-1], [*segs, data.draw(keys_)], data.draw(st.lists(keys_))):
        assert match(text, path) is (tuple(path) == tuple(segs))
    assert PathIndex(["**", text]).all(segs) == [0, 1]


def test_only_what_the_grammar_would_misread_is_quoted() -> None:
    plain = ["weight", "0", "12", "query_proj", "x-y", "a,b", "a\\b", "é", "中", "😀", "a:b"]
    assert name(plain) == ".".join(plain)
    quoted = ["", "*", "**", "a*", "a.b", "a b", "[", "]", "a[0]", "'", '"', "\n", "\x1b", "\u200f"]
    for seg in quoted:
        assert name(["w", seg]) == f"w[{seg!r}]"
    assert name(["\u200f"]) == "['\\u200f']"  # a terminal shows the mark, never obeys it
    assert name(["\x1b[31m"]) == "['\\x1b[31m']"


_SCHEMA = Draft202012Validator(eqshard.schema())


@settings(max_examples=300, deadline=None)
@given(st.lists(keys_, min_size=1, max_size=5))
def test_the_schema_allows_every_name(segs: list[str]) -> None:
    document = {"eqshard": 1, "rules": [{"path": name(segs), "expr": "a -> a*"}]}
    assert list(_SCHEMA.iter_errors(document)) == []


# --------------------------------------------------------------------------- #
# Through files, plans, reports and `check`, as a user meets them.
# --------------------------------------------------------------------------- #


class Holder(eqx.Module):
    table: dict
    items: list


_LEAF = jax.ShapeDtypeStruct((8,), jnp.float32)
nodes_ = st.recursive(
    st.just(_LEAF),
    lambda inner: st.one_of(
        st.dictionaries(keys_, inner, min_size=1, max_size=3),
        st.lists(inner, min_size=1, max_size=2),
    ),
    max_leaves=5,
)
models_ = st.builds(
    Holder,
    st.dictionaries(keys_, nodes_, min_size=1, max_size=3),
    st.lists(st.dictionaries(keys_, st.just(_LEAF), max_size=2), max_size=2),
)


def _rules(folder: Path, paths: list[str], expr: str, **more: Any) -> eqshard.Rules:
    """A spec file with one rule per path, written and loaded as a user would."""
    file = folder / "spec.eqshard.json"
    rules = [{"path": path, "expr": expr} for path in paths]
    file.write_text(json.dumps({"eqshard": 1, "rules": rules, **more}))
    return eqshard.load(file)


def _names(model: Any) -> list[str]:
    """The names of the array leaves of `model`."""
    flat = jax.tree_util.tree_flatten_with_path(model)[0]
    return [leaf_name(path) for path, leaf in flat if is_array_like(leaf)]


def _lays_out_each_leaf_by_its_name(model: Any, expr: str = "a -> a*") -> None:
    """For each leaf, a spec file whose one rule is the leaf's name gives that leaf,
    and no other, its expression; the report, `check` (as `--format json` prints
    it) and errors name every leaf the same way."""
    names = _names(model)
    assert len(set(names)) == len(names)
    with tempfile.TemporaryDirectory() as folder:
        for i, leaf_path in enumerate(names):
            plan = eqshard.plan(model, _rules(Path(folder), [leaf_path], expr))
            rows = eqshard.report(model, plan).rows
            assert [row.path for row in rows] == names
            assert [row.origin for row in rows] == [
                "$.rules[0]" if j == i else "default" for j in range(len(names))
            ]
            if expr == "a -> a*":  # float32[8] split over 8 devices: that leaf alone
                assert [row.bytes_per_device for row in rows] == [
                    4 if j == i else 32 for j in range(len(names))
                ]
        # every leaf by its own rule, in one file
        (result,) = check(_rules(Path(folder), names, expr), model, [8])
        leaves = json.loads(json.dumps(result.to_json()))["leaves"]
        assert [(leaf["path"], leaf["origin"]) for leaf in leaves] == [
            (leaf_path, f"$.rules[{i}]") for i, leaf_path in enumerate(names)
        ]
        # errors: the leaf's name, then the field that holds it
        (result,) = check(_rules(Path(folder), [], expr, default="error"), model, [8])
        fields = [item for item in walk_fields(model) if is_array_like(item.leaf)]
        assert [p.where for p in result.problems] == [
            f"{leaf_path} ({item.owner})" if item.owner else leaf_path
            for leaf_path, item in zip(names, fields, strict=True)
        ]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models_)
def test_each_leaf_of_a_model_with_any_keys_is_laid_out_by_its_name(model: Holder) -> None:
    _lays_out_each_leaf_by_its_name(model)


def _mlp() -> eqx.nn.MLP:
    return eqx.filter_eval_shape(lambda: eqx.nn.MLP(4, 8, 16, 2, key=jax.random.key(0)))


@pytest.mark.parametrize(
    "build",
    [
        _mlp,
        lambda: eqx.filter_eval_shape(
            lambda: eqx.nn.MultiheadAttention(2, 8, use_key_bias=True, key=jax.random.key(0))
        ),
        lambda: jax.eval_shape(optax.adamw(1e-3).init, eqx.filter(_mlp(), eqx.is_array)),
        lambda: jax.eval_shape(
            optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)).init,
            {"mlp": eqx.filter(_mlp(), eqx.is_array), "a b": jnp.ones(3)},
        ),
    ],
    ids=["MLP", "MultiheadAttention", "adamw state", "chained state, a key with a space"],
)
def test_each_leaf_of_a_real_model_is_laid_out_by_its_name(build) -> None:
    model = build()
    for path, _ in jax.tree_util.tree_flatten_with_path(model)[0]:
        assert parse(leaf_name(path)) == segments(path)
    _lays_out_each_leaf_by_its_name(model, "... -> * ...")


E3NN_MODEL = """
import equinox as eqx
import jax
import jax.numpy as jnp


class TensorProduct(eqx.Module):
    \"\"\"Like an e3nn-jax layer: weights kept under keys that describe their irreps.\"\"\"

    _weights: dict


def build():
    return TensorProduct(
        {
            "w[0,0] 16x0e,32x0e": jax.ShapeDtypeStruct((8,), jnp.float32),
            "w[1,1] 16x1o": jax.ShapeDtypeStruct((4, 8), jnp.float32),
        }
    )
"""


def test_the_e3nn_weight_from_the_issue(run_cli, tmp_path):
    namespace: dict[str, Any] = {}
    exec(E3NN_MODEL, namespace)
    model = namespace["build"]()
    name_ = "_weights['w[0,0] 16x0e,32x0e']"
    assert _names(model) == [name_, "_weights['w[1,1] 16x1o']"]
    spec = tmp_path / "e3nn.eqshard.json"
    spec.write_text(json.dumps({"eqshard": 1, "rules": [{"path": name_, "expr": "a -> a*"}]}))
    plan = eqshard.plan(model, eqshard.load(spec))
    assert jax.tree_util.tree_leaves(plan.partition_specs) == [P("m0"), P()]
    report = eqshard.report(model, plan)
    assert [(row.path, row.origin) for row in report.rows] == [
        (name_, "$.rules[0]"),
        ("_weights['w[1,1] 16x1o']", "default"),
    ]
    assert f"│ {name_} │" in str(report)
    assert run_cli("validate", spec).code == 0
    source = tmp_path / "e3nn_model.py"
    source.write_text(E3NN_MODEL)
    result = run_cli("check", spec, "--model", f"{source}:build", "--format", "json")
    assert result.code == 0, result.out + result.err
    (checked,) = json.loads(result.out)["checks"]
    assert [(leaf["path"], leaf["origin"]) for leaf in checked["leaves"]] == [
        (name_, "$.rules[0]"),
        ("_weights['w[1,1] 16x1o']", "default"),
    ]
