import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jaxtyping import Array, Float, Int

import eqshard
from eqshard import EqshardError, ExpressionError, SpecError

is_none = lambda x: x is None  # noqa: E731


class MLP(eqx.Module):
    w1: Float[Array, "x y"] = eqshard.field("x y -> x y*")
    w2: Float[Array, "y z"] = eqshard.field("y* z")

    def __init__(self, key=None):
        k1, k2 = jax.random.split(jax.random.key(0) if key is None else key)
        self.w1 = jax.random.normal(k1, (16, 32))
        self.w2 = jax.random.normal(k2, (32, 8))


def test_fields_give_the_spec_tree():
    spec = eqshard.spec_tree(MLP())
    assert isinstance(spec, MLP)
    assert spec.w1 == eqshard.expression.parse("x y -> x y*")
    # the short form takes its left side from the annotation
    assert spec.w2 == eqshard.expression.parse("y z -> y* z")
    assert str(spec.w2) == "y z -> y* z"


def test_abstract_model_gives_the_same_spec():
    abstract = eqx.filter_eval_shape(MLP, jax.random.key(0))
    assert isinstance(abstract.w1, jax.ShapeDtypeStruct)
    assert eqshard.spec_tree(abstract) == eqshard.spec_tree(MLP())
    plan = eqshard.plan(abstract)
    assert plan.partition_specs.w1 == jax.sharding.PartitionSpec(None, "m0")


def test_field_takes_what_eqx_field_takes():
    class M(eqx.Module):
        w: Float[Array, "a b"] = eqshard.field("a* b", converter=jnp.asarray)
        n: int = eqx.field(static=True, default=3)
        b: Float[Array, " a"] = eqshard.field("a -> a*", default_factory=lambda: jnp.zeros(8))
        tagged: Float[Array, " a"] = eqshard.field("a*", metadata={"mine": 1}, default=None)
        dynamic: Float[Array, " a"] = eqshard.field("a*", static=False, default=None)

    m = M([[1.0] * 4] * 8)  # type: ignore[arg-type]
    assert isinstance(m.w, jax.Array)
    assert m.b.shape == (8,)
    field = M.__dataclass_fields__["tagged"]
    assert field.metadata["mine"] == 1
    spec = eqshard.spec_tree(m)
    assert str(spec.w) == "a b -> a* b"
    assert spec.tagged is None  # the field holds None: no leaf


def test_static_field_is_refused():
    with pytest.raises(
        EqshardError,
        match=re.escape("`eqshard.field('a*', static=True)`: a static field holds no arrays"),
    ):
        eqshard.field("a*", static=True)


def test_field_expression_is_parsed_at_class_definition():
    with pytest.raises(ExpressionError, match="axis 'c' is on the right but not on the left"):
        eqshard.field("a b -> a c")


def test_annotations_with_unnamed_and_variadic_dims():
    class M(eqx.Module):
        x: Float[Array, "*batch d 3"] = eqshard.field("d*")
        y: Float[Array, "... n _ m"] = eqshard.field("m* n ...")
        z: Float[Array, "#b d"] = eqshard.field("b2* d")
        w: Float[Array, "n n"] = eqshard.field("a b -> a* b")

    m = M(jnp.ones((2, 5, 16, 3)), jnp.ones((4, 8, 7, 16)), jnp.ones((8, 4)), jnp.ones((8, 8)))
    spec = eqshard.spec_tree(m)
    assert str(spec.x) == "... d _ -> d* _ ..."
    assert str(spec.y) == "... n _ m -> m* n ... _"
    assert str(spec.z) == "b d -> b2* d"
    plan = eqshard.plan(m)
    assert plan.shardings.x.shard_shape((2, 5, 16, 3)) == (2, 5, 2, 3)
    assert plan.shardings.y.shard_shape((4, 8, 7, 16)) == (4, 8, 7, 2)
    assert plan.shardings.z.shard_shape((8, 4)) == (1, 4)


def test_annotated_dims_left_out_of_the_short_form_stay_whole():
    class M(eqx.Module):
        w: Float[Array, "batch seq d"] = eqshard.field("d*")

    spec = eqshard.spec_tree(M(jnp.ones((2, 3, 8))))
    assert str(spec.w) == "batch seq d -> d* batch seq"


def _spec_problems(model):
    with pytest.raises(SpecError) as info:
        eqshard.spec_tree(model)
    return [f"{problem.where}: {problem.message}" for problem in info.value.problems]


def test_annotation_errors_name_the_class_and_field():
    class Bad(eqx.Module):
        a: Float[Array, "x y"] = eqshard.field("y x -> y x*")
        b: Float[Array, "x y"] = eqshard.field("q*")
        c: Array = eqshard.field("x*")
        d: Float[Array, "n n"] = eqshard.field("n*")
        e: Float[Array, "x y"] = eqshard.field("x ...")
        ok: Int[Array, " x"] = eqshard.field("x*")

    x = jnp.ones((4, 4))
    problems = _spec_problems(Bad(x, x, x, x, x, jnp.ones(8, int)))
    assert problems == [
        "a (Bad.a): 'y x -> y x*': its left side 'y x' contradicts the annotation Float[Array, 'x y']; name the axes as the annotation does ('x y'), or write the short form (the right side alone)",
        "b (Bad.b): 'q*': axis 'q' is on the right but not in the annotation Float[Array, 'x y']; name the annotation's dims ('x y')",
        "c (Bad.c): the short form 'x*' needs a left side, and the field has no jaxtyping annotation such as Float[Array, 'x y'] to take it from; write the full form 'x y -> ...'",
        "d (Bad.d): 'n*': the annotation Float[Array, 'n n'] names 'n' twice, so the short form cannot say which to split; write the full form",
        "e (Bad.e): 'x ...': '...' is on the right, but the annotation Float[Array, 'x y'] has no '...' or '*name' dims for it to stand for",
    ]


def test_spec_problems_show_the_caret():
    with pytest.raises(SpecError) as info:
        eqshard.plan({"a": jnp.ones(8)}, {"a": "x -> x0"})
    assert str(info.value).split("\n")[1:] == [
        "  a: 'x -> x0': a count of 0 is not allowed; counts start at 1",
        "      x -> x0",
        "            ^",
    ]


def test_nested_modules_lists_tuples_and_dicts():
    class Inner(eqx.Module):
        b: Float[Array, " o"]
        w: Float[Array, "o i"] = eqshard.field("o* i")

    class Outer(eqx.Module):
        blocks: list[Inner]
        pair: tuple[Inner, Inner]
        named: dict[str, Float[Array, "a b"]] = eqshard.field("a b*")
        stack: list[Float[Array, "a b"]] = eqshard.field("a b -> a* b")
        inherited: Inner = eqshard.field("... -> * ...")

    def inner():
        return Inner(jnp.ones(8), jnp.ones((8, 4)))

    model = Outer(
        [inner(), inner()],
        (inner(), inner()),
        {"k": jnp.ones((4, 8)), "j": jnp.ones((4, 8))},
        [jnp.ones((8, 2))],
        inner(),
    )
    spec = eqshard.spec_tree(model)
    assert str(spec.blocks[1].w) == "o i -> o* i"
    assert spec.blocks[1].b is None
    assert str(spec.pair[0].w) == "o i -> o* i"
    assert str(spec.named["j"]) == "a b -> a b*"
    assert str(spec.stack[0]) == "a b -> a* b"
    # an expression on a module-valued field reaches the leaves with none of their own
    assert str(spec.inherited.w) == "o i -> o* i"
    assert str(spec.inherited.b) == "... -> * ..."


def test_spec_tree_has_the_models_structure_and_non_array_leaves_are_none():
    model = eqx.nn.MLP(4, 4, 16, 1, key=jax.random.key(0))
    spec = eqshard.spec_tree(model)
    assert jax.tree_util.tree_structure(spec, is_leaf=is_none) == jax.tree_util.tree_structure(
        jax.tree_util.tree_map(lambda _: None, model), is_leaf=is_none
    )
    assert spec.activation is None
    assert spec.layers[0].weight is None


def test_tree_at_gives_third_party_modules_expressions():
    model = eqx.nn.MLP(4, 4, 16, 1, key=jax.random.key(0))
    spec = eqshard.spec_tree(model)
    spec = eqx.tree_at(
        lambda s: (s.layers[0].weight, s.layers[0].bias, s.layers[1].weight),
        spec,
        ("o i -> o* i", eqshard.expression.parse("o -> o*"), "o i -> o i*"),
        is_leaf=is_none,
    )
    plan = eqshard.plan(model, spec)
    assert plan.partition_specs.layers[0].weight == jax.sharding.PartitionSpec("m0", None)
    assert plan.partition_specs.layers[0].bias == jax.sharding.PartitionSpec("m0")
    assert plan.partition_specs.layers[1].weight == jax.sharding.PartitionSpec(None, "m0")
    assert plan.partition_specs.layers[1].bias == jax.sharding.PartitionSpec()
    assert plan.expressions.layers[0].weight == eqshard.expression.parse("o i -> o* i")


def test_structure_mismatch_names_the_first_differing_path():
    model = eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(0))
    other = eqx.nn.MLP(4, 4, 16, 1, key=jax.random.key(0))
    with pytest.raises(SpecError) as info:
        eqshard.plan(model, eqshard.spec_tree(other))
    assert str(info.value) == (
        "1 problem in the spec:\n  layers: the model has '2' that the spec lacks"
    )
    with pytest.raises(SpecError) as info:
        eqshard.plan({"a": jnp.ones(8), "b": jnp.ones(8)}, {"a": "x -> x*", "c": None})
    assert str(info.value).endswith(
        "the root: the model has 'b' that the spec lacks; the spec has 'c' that the model lacks"
    )
    with pytest.raises(SpecError) as info:
        eqshard.plan({"a": jnp.ones(8)}, {"a": ["x -> x*"]})
    assert str(info.value).endswith(
        "a: the spec has a list here, where the model has a leaf (float32[8]); put one expression or None here"
    )
    with pytest.raises(SpecError) as info:
        eqshard.plan({"a": jnp.ones(8)}, {"a": 3})
    assert str(info.value).endswith(
        "a: the spec holds int 3; a spec leaf is an expression, its text, a PartitionSpec, a NamedSharding, or None"
    )
    with pytest.raises(SpecError) as info:
        eqshard.plan([jnp.ones(8)], (None,))
    assert "the spec has a tuple here, where the model has a list" in str(info.value)


def test_bad_expression_text_in_a_spec_tree_names_the_leaf():
    with pytest.raises(SpecError) as info:
        eqshard.plan({"a": jnp.ones(8), "b": jnp.ones(8)}, {"a": "x -> x0", "b": "x -> y"})
    assert [f"{p.where}: {p.message}" for p in info.value.problems] == [
        "a: 'x -> x0': a count of 0 is not allowed; counts start at 1",
        "b: 'x -> y': axis 'y' is on the right but not on the left; add it to the left, or drop its name to replicate instead",
    ]


def test_short_forms_survive_an_unresolvable_sibling_annotation():
    namespace = {"eqx": eqx, "eqshard": eqshard, "Float": Float, "Array": Array}
    code = (
        "from __future__ import annotations\n"
        "class M(eqx.Module):\n"
        "    other: NotImportedHere\n"
        "    w: Float[Array, 'x y'] = eqshard.field('x*')\n"
    )
    module = type(sys)("eqshard_test_forward_refs")
    module.__dict__.update(namespace)
    sys.modules[module.__name__] = module
    try:
        exec(compile(code, "<test>", "exec"), module.__dict__)
        model = module.M(jnp.ones(3), jnp.ones((8, 4)))
        assert str(eqshard.spec_tree(model).w) == "x y -> x* y"
    finally:
        del sys.modules[module.__name__]
