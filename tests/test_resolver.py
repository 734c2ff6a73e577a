"""The resolver protocol: every spec source resolves the same way, for a target."""

import dataclasses
import json
import pickle
import subprocess
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jaxtyping import Array, Float

import eqshard
from eqshard import EqshardError, SpecError


class Pair(eqx.Module):
    w: Float[Array, "o i"] = eqshard.field("o* i")
    b: Float[Array, " o"] = eqshard.field("o -> o*")


def _pair() -> Pair:
    return Pair(jnp.ones((8, 4)), jnp.ones(8))


@dataclasses.dataclass(frozen=True)
class Recording:
    """A user's resolver: one expression for every leaf, remembering its targets."""

    expr: str
    seen: list = dataclasses.field(default_factory=list)

    def __eqshard_resolve__(self, model, target):
        self.seen.append(target)
        return eqshard.resolvers.Resolution([self.expr] * len(jax.tree_util.tree_leaves(model)))


def test_a_users_resolver_is_given_the_target():
    resolver = Recording("... -> * ...")
    placed = eqshard.apply(_pair(), resolver, devices=jax.devices()[:4])
    assert resolver.seen == [eqshard.resolvers.Target(devices=4)]
    assert placed.w.sharding.is_fully_replicated
    assert len(placed.w.sharding.device_set) == 4
    assert isinstance(resolver, eqshard.resolvers.Resolver)


def test_resolvers_report_problems_and_plan_raises_them_with_every_other_fault():
    class Complaining:
        def __eqshard_resolve__(self, model, target):
            return eqshard.resolvers.Resolution(
                ["o i -> o* i", "x -> x0"],
                problems=[eqshard.resolvers.Problem("somewhere", "the resolver is unhappy")],
            )

    with pytest.raises(SpecError) as info:
        eqshard.plan(_pair(), Complaining())
    assert [(p.where, p.message.split(":")[0]) for p in info.value.problems] == [
        ("somewhere", "the resolver is unhappy"),
        ("b (Pair.b)", "'x -> x0'"),
    ]


def test_a_resolver_that_breaks_the_protocol_is_named():
    class Short:
        def __eqshard_resolve__(self, model, target):
            return eqshard.resolvers.Resolution([None])

    with pytest.raises(EqshardError, match="Short resolved 1 spec leaves for a model of 2 leaves"):
        eqshard.plan(_pair(), Short())


@pytest.mark.parametrize(
    "spec",
    [eqshard.resolvers.FROM_FIELDS, "... -> * ...", {"w": "o i -> o* i", "b": None}],
    ids=["fields", "one expression", "spec tree"],
)
def test_every_source_resolves_through_one_path(spec):
    model = {"w": jnp.ones((8, 4)), "b": jnp.ones(8)} if isinstance(spec, dict) else _pair()
    p = eqshard.plan(model, spec)
    assert [str(e) for e in jax.tree_util.tree_leaves(p.expressions)] == (
        ["o i -> o* i"]
        if isinstance(spec, dict)
        else ["o i -> o* i", "o -> o*"]
        if spec is eqshard.resolvers.FROM_FIELDS
        else ["... -> * ..."] * 2
    )


def test_from_fields_and_rules_pickle():
    assert (
        pickle.loads(pickle.dumps(eqshard.resolvers.FROM_FIELDS)) is eqshard.resolvers.FROM_FIELDS
    )
    rules = eqshard.load({"eqshard": 1, "rules": [{"path": "w", "expr": "o i -> o* i"}]})
    again = pickle.loads(pickle.dumps(rules))
    assert again.rules == rules.rules
    assert str(eqshard.plan(_pair(), again).expressions.w) == "o i -> o* i"


def test_rules_check_their_device_count_as_a_problem():
    rules = eqshard.load(
        {"eqshard": 1, "devices": 4, "rules": [{"path": "w", "expr": "o i -> o* i"}]}
    )
    resolution = rules.__eqshard_resolve__(_pair(), eqshard.resolvers.Target(8))
    assert [p.where for p in resolution.problems] == ["<mapping>::$.devices"]
    assert not hasattr(rules, "resolve")  # the old entry point is gone


def test_unused_rules_are_warnings_that_name_the_file_and_rule():
    rules = eqshard.load({"eqshard": 1, "rules": [{"path": "**.nowhere", "expr": "a -> a*"}]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eqshard.plan(_pair(), rules)
    [warning] = caught
    assert isinstance(warning.message, eqshard.UnusedRuleWarning)
    assert warning.message.where == "<mapping>::$.rules[0]"
    assert str(warning.message) == (
        "<mapping>::$.rules[0]: rule '**.nowhere' matched no leaf of the model"
    )
    assert warning.filename == __file__


def test_expressions_cannot_be_built_unvalidated():
    expr = eqshard.expression.parse("a b -> a b*")
    with pytest.raises(EqshardError, match="is not a valid einshard expression"):
        eqshard.expression.Expression(expr.lhs, expr.rhs, text="garbage")
    with pytest.raises(EqshardError, match="is not a valid einshard expression"):
        dataclasses.replace(expr, lhs=("a",))
    with pytest.raises(EqshardError, match="is not a valid einshard expression"):
        eqshard.expression.Expression(
            ("a", "a"), (eqshard.expression.Element("a"), eqshard.expression.Element("a"))
        )
    built = eqshard.expression.Expression(expr.lhs, expr.rhs)
    assert built == expr
    assert built.text == "a b -> a b*"
    assert pickle.loads(pickle.dumps(expr)).rhs_spans == expr.rhs_spans


def test_leaves_have_one_name_everywhere():
    model = eqx.nn.MLP(4, 4, 6, 1, key=jax.random.key(0))
    with pytest.raises(SpecError) as info:
        eqshard.plan(model, "o ... -> o* ...")
    assert [p.where for p in info.value.problems] == [
        "layers.0.weight (Linear.weight)",
        "layers.0.bias (Linear.bias)",
        "layers.1.weight (Linear.weight)",
        "layers.1.bias (Linear.bias)",
    ]
    assert eqshard.Rules().match(model)[0][0].path == "layers.0.weight"
    odd = {"": jnp.ones(3), "a.b": {"c": jnp.ones(3)}}
    with pytest.raises(SpecError) as info:
        eqshard.plan(odd, "x -> x*")
    assert [p.where for p in info.value.problems] == ["['']", "['a.b'].c"]


def test_the_spec_file_layer_imports_no_jax(tmp_path):
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"eqshard": 1, "rules": [{"path": "**.w", "expr": "a -> a*"}]}))
    code = f"""
import sys
for name in ("jax", "jaxlib", "equinox", "jaxtyping", "numpy"):
    sys.modules[name] = None   # importing any of them now fails
import eqshard
from eqshard._cli._main import main
rules = eqshard.load({str(spec)!r})
eqshard.dump(rules, {str(tmp_path / "out.json")!r})
assert eqshard.load({str(tmp_path / "out.json")!r}).rules == rules.rules
sys.exit(main(["validate", {str(spec)!r}]))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"ok: {spec} (1 rule)\n"
