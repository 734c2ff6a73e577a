import json
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

import eqshard
from eqshard import SpecError


def _index_map(sharding, shape):
    """{device id: block bounds}: what every device holds."""
    return {
        device.id: tuple(
            (s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape)
        )
        for device, index in sharding.devices_indices_map(tuple(shape)).items()
    }


class MLP(eqx.Module):
    scale: float
    w1: Float[Array, "x y"] = eqshard.field("x y -> x y*")
    w2: Float[Array, "y z"] = eqshard.field("y* z")

    def __init__(self, key):
        self.scale = 2.0
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (16, 32))
        self.w2 = jax.random.normal(k2, (32, 8))


def test_apply_places_every_leaf_as_einshard_would():
    model = MLP(jax.random.key(0))
    before = jax.tree_util.tree_map(np.asarray, model)
    sharded = eqshard.apply(model)
    for name, expr in [("w1", "x y -> x y*"), ("w2", "y z -> y* z")]:
        array = getattr(sharded, name)
        expected = eqshard.expression.sharding(expr, array.shape)
        assert _index_map(array.sharding, array.shape) == _index_map(expected, array.shape)
        np.testing.assert_array_equal(np.asarray(array), getattr(before, name))
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(
                np.asarray(shard.data), getattr(before, name)[shard.index]
            )
    assert sharded.scale == 2.0
    # the input is untouched: still on one device, same values
    assert model.w1.sharding.device_set == {jax.devices()[0]}
    np.testing.assert_array_equal(np.asarray(model.w1), before.w1)
    assert sharded is not model


def test_one_shared_mesh_and_readable_specs():
    plan = eqshard.plan(MLP(jax.random.key(0)))
    assert plan.mesh is not None
    assert dict(plan.mesh.shape) == {"m0": 8}
    assert plan.shardings.w1.mesh is plan.mesh
    assert plan.shardings.w2.mesh is plan.mesh
    assert (plan.partition_specs.w1, plan.partition_specs.w2) == (P(None, "m0"), P("m0", None))
    assert plan.shardings.scale is None


def test_spec_forms_single_prefix_and_full():
    model = {"a": jnp.ones((8, 4)), "b": {"c": jnp.ones(8), "d": jnp.ones((2, 8))}}
    plan = eqshard.plan(model, "... -> * ...")
    assert jax.tree_util.tree_leaves(plan.partition_specs) == [P(), P(), P()]  # full copies
    plan = eqshard.plan(model, {"a": "r c -> r* c", "b": "... x -> ... x*"})
    assert plan.partition_specs == {"a": P("m0", None), "b": {"c": P("m0"), "d": P(None, "m0")}}
    plan = eqshard.plan(
        model, {"a": None, "b": {"c": eqshard.expression.parse("x -> x*"), "d": None}}
    )
    assert plan.partition_specs == {"a": P(), "b": {"c": P("m0"), "d": P()}}


def test_none_replicates_by_default_and_keep_leaves_it_alone():
    x = jnp.arange(8.0)
    out = eqshard.apply({"x": x}, {"x": None})
    assert out["x"].sharding.is_fully_replicated
    assert out["x"].sharding.device_set == set(jax.devices())
    kept = eqshard.apply({"x": x, "y": x}, {"x": None, "y": "a -> a*"}, unspecified="keep")
    assert kept["x"] is x
    assert kept["y"].sharding.shard_shape((8,)) == (1,)
    with pytest.raises(
        eqshard.EqshardError, match="`unspecified` must be 'replicate' or 'keep', not 'sideways'"
    ):
        eqshard.apply({"x": x}, None, unspecified="sideways")  # type: ignore[arg-type]


def test_arrays_already_in_place_are_not_copied():
    sharded = eqshard.apply(MLP(jax.random.key(0)))
    again = eqshard.apply(sharded)
    assert again.w1 is sharded.w1
    assert again.w2 is sharded.w2


def test_non_array_leaves_pass_through():
    model = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    model = eqx.tree_at(lambda m: m.layers[0].weight, model, np.ones((8, 4), np.float32))
    out = eqshard.apply(model, "... -> * ...")
    assert out.activation is model.activation
    assert out.final_activation is model.final_activation
    assert isinstance(out.layers[0].weight, jax.Array)  # NumPy leaves are placed too
    assert out.layers[0].weight.sharding.is_fully_replicated


def test_devices_subset():
    devices = jax.devices()[2:6]
    sharded = eqshard.apply(MLP(jax.random.key(0)), devices=devices)
    assert sharded.w1.sharding.device_set == set(devices)
    assert sharded.w1.sharding.shard_shape((16, 32)) == (16, 8)


def test_all_faults_are_reported_at_once():
    model = eqx.nn.MLP(6, 4, 12, 1, key=jax.random.key(0))
    spec = eqx.tree_at(
        lambda s: (s.layers[0].weight, s.layers[0].bias, s.layers[1].weight, s.layers[1].bias),
        eqshard.spec_tree(model),
        ("o i -> o* i", "o i -> o i*", "o i -> o i2", "o -> o3*"),
        is_leaf=lambda x: x is None,
    )
    with pytest.raises(SpecError) as info:
        eqshard.apply(model, spec)
    problems = info.value.problems
    assert [(p.where, p.message) for p in problems] == [
        (
            "layers.0.weight (Linear.weight)",
            "float32[12, 6] 'o i -> o* i': axis 'o' (dimension 0 of shape (12, 6)) has size 12, which does not split into 8 equal shards; choose a count that divides 12",
        ),
        (
            "layers.0.bias (Linear.bias)",
            "float32[12] 'o i -> o i*': the left side names 2 axes, but the array has 1 (shape (12,)); name one axis per dimension, or use '...' for the rest",
        ),
        (
            "layers.1.weight (Linear.weight)",
            "float32[4, 12] 'o i -> o i2': i2 shards need 2 devices, 8 are given; add '*' to an element to take the rest, or a standalone '*' to replicate",
        ),
        (
            "layers.1.bias (Linear.bias)",
            "float32[4] 'o -> o3*': the starred counts o3* need a multiple of 3 devices, and 8 are left for them (8 are given); change the starred counts",
        ),
    ]
    # each line is followed by the expression, with a caret under the fault
    assert str(info.value).split("\n")[:4] == [
        "4 problems in the spec:",
        f"  layers.0.weight (Linear.weight): {problems[0].message}",
        "      o i -> o* i",
        "             ^^",
    ]
    assert next(p.where for p in info.value.problems) == "layers.0.weight (Linear.weight)"


def test_abstract_models_plan_but_do_not_apply():
    abstract = eqx.filter_eval_shape(MLP, jax.random.key(0))
    assert eqshard.plan(abstract).partition_specs.w2 == P("m0", None)
    with pytest.raises(
        SpecError,
        match=r"(?s)cannot place these leaves:\n  w1 \(MLP.w1\), w2 \(MLP.w2\): is abstract .*places "
        "concrete arrays",
    ):
        eqshard.apply(abstract)


def test_plan_shardings_build_a_model_straight_into_its_shards():
    abstract = eqx.filter_eval_shape(MLP, jax.random.key(0))
    plan = eqshard.plan(abstract)
    build = jax.jit(
        lambda key: eqx.filter(MLP(key), eqx.is_array),
        out_shardings=eqx.filter(
            plan.shardings, lambda s: s is not None, is_leaf=lambda s: s is None
        ),
    )
    built = build(jax.random.key(0))
    assert built.w1.sharding.is_equivalent_to(plan.shardings.w1, 2)
    # the same values, up to how XLA fuses the sampling under jit
    np.testing.assert_allclose(
        np.asarray(built.w1), np.asarray(MLP(jax.random.key(0)).w1), rtol=1e-6
    )


# --------------------------------------------------------------------------- #
# The shared mesh keeps every layout: property test on 8 devices.
# --------------------------------------------------------------------------- #

_ELEMENT = st.sampled_from(["", "2", "4", "*", "2*"])
_EXTRA = st.sampled_from([None, "2", "*", "2*"])


@st.composite
def _expression(draw):
    a, b, extra = draw(_ELEMENT), draw(_ELEMENT), draw(_EXTRA)
    right = [f"a{a}", f"b{b}"]
    if draw(st.booleans()):
        right.reverse()
    if extra:
        right.insert(draw(st.integers(0, 2)), extra)
    return f"a b -> {' '.join(right)}"


def _fits(expr):
    try:
        eqshard.expression.sharding(expr, (16, 16))
    except eqshard.ExpressionError:
        return False
    return True


@given(st.lists(_expression().filter(_fits), min_size=1, max_size=6))
@settings(max_examples=60, deadline=None)
def test_shared_mesh_keeps_every_layout(exprs):
    model = [jax.ShapeDtypeStruct((16, 16), jnp.float32) for _ in exprs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", eqshard.MeshWarning)  # groupings may disagree
        plan = eqshard.plan(model, exprs)
    assert plan.mesh is not None  # 8 is a power of two
    for expr, sharding in zip(exprs, plan.shardings):
        assert sharding.mesh is plan.mesh
        assert _index_map(sharding, (16, 16)) == _index_map(
            eqshard.expression.sharding(expr, (16, 16)), (16, 16)
        ), expr


_TWELVE = """
import jax, json
jax.config.update("jax_num_cpu_devices", 12)
import jax.numpy as jnp, eqshard
model = [jax.ShapeDtypeStruct((12, 12), jnp.float32)] * 3
exprs = ["a b -> a2 b6", "a b -> a3 b4", "a b -> a4 b3"]
def blocks(s):
    return sorted((d.id, str(i)) for d, i in s.devices_indices_map((12, 12)).items())
plan = eqshard.plan(model, exprs)
same = [blocks(s) == blocks(eqshard.expression.sharding(e, (12, 12))) for e, s in zip(exprs, plan.shardings)]
shared = eqshard.plan(model[:1] * 2, ["a b -> a2 b6", "a b -> a2* b"])
print(json.dumps({"mesh": plan.mesh is None, "same": same, "meshes": len({s.mesh for s in plan.shardings}),
                  "shared": dict(shared.mesh.shape)}))
"""


@pytest.mark.slow  # a fresh interpreter: imports JAX and compiles
def test_no_shared_mesh_on_12_devices_falls_back_to_one_mesh_per_expression(run_python):
    result = run_python(["-c", _TWELVE])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "mesh": True,
        "same": [True, True, True],
        "meshes": 3,
        "shared": {"m0": 2, "m1": 6},
    }


def test_placed_arrays_outlive_their_sources():
    # CPU arrays are placed from a view of their buffer; JAX keeps it alive and safe.
    x = jax.device_put(jnp.arange(64 * 48, dtype=jnp.float32).reshape(64, 48), jax.devices()[0])
    y = jax.device_put(jnp.arange(64.0), jax.devices()[0])
    expected = (np.asarray(x).copy(), np.asarray(y).copy())
    placed = eqshard.apply({"x": x, "y": y}, {"x": "r c -> r* c", "y": "r -> r*"})
    donated = jax.jit(lambda a: a * 3, donate_argnums=0)(x)
    y.delete()
    del donated
    np.testing.assert_array_equal(np.asarray(placed["x"]), expected[0])
    np.testing.assert_array_equal(np.asarray(placed["y"]), expected[1])
    # and the placed arrays can themselves be donated to a step
    out = jax.jit(lambda a: a + 1, donate_argnums=0)(placed["x"])
    np.testing.assert_array_equal(np.asarray(out), expected[0] + 1)


def test_the_shared_mesh_works_with_set_mesh_and_shard_map():
    model = MLP(jax.random.key(0))
    plan = eqshard.plan(model)
    sharded = eqshard.apply(model)
    x = jnp.ones((4, 16))
    expected = np.asarray(jax.nn.relu(x @ model.w1) @ model.w2)
    assert isinstance(plan.mesh, jax.sharding.Mesh)
    with jax.set_mesh(plan.mesh):
        out = jax.jit(lambda w1, w2, x: jax.nn.relu(x @ w1) @ w2)(sharded.w1, sharded.w2, x)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)

    def local(w1, w2, x):  # each device: its columns of w1, its rows of w2, then sum
        return jax.lax.psum(jax.nn.relu(x @ w1) @ w2, "m0")

    specs = plan.partition_specs
    out = jax.shard_map(local, mesh=plan.mesh, in_specs=(specs.w1, specs.w2, P()), out_specs=P())(
        sharded.w1, sharded.w2, x
    )
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


def test_keys_and_weakly_typed_leaves_keep_their_types():
    model = {
        "key": jax.device_put(jax.random.key(0), jax.devices()[0]),
        "keys": jax.device_put(jax.random.split(jax.random.key(1), 8), jax.devices()[0]),
        "scale": jax.device_put(jnp.asarray(0.5), jax.devices()[0]),
        "w": jnp.ones((8, 8)),
    }
    placed = eqshard.apply(
        model, {"key": None, "keys": "k -> k*", "scale": None, "w": "a b -> a b*"}
    )
    assert placed["key"].dtype == model["key"].dtype
    assert jnp.issubdtype(placed["keys"].dtype, jax.dtypes.prng_key)
    assert placed["keys"].sharding.shard_shape((8,)) == (1,)
    np.testing.assert_array_equal(
        jax.random.key_data(placed["keys"]), jax.random.key_data(model["keys"])
    )
    assert placed["scale"].weak_type
    assert (placed["scale"] * jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16


def test_a_plan_lays_out_another_tree_by_structure_or_refuses_it():
    plan = eqshard.plan({"a": jnp.ones(8), "b": jnp.ones(8)}, {"a": "x -> x*", "b": None})
    with pytest.raises(
        SpecError,
        match=r"the root: the plan was made for a dict of 2 leaves, and no subtree of this "
        r"tree has its structure and shapes; make the plan from the model this tree was "
        r"built from",
    ):
        eqshard.constrain({"a": jnp.ones(8), "c": jnp.ones(8)}, plan)  # keys differ
    placed = eqshard.constrain(
        {"step": jnp.ones(8), "copies": [{"a": jnp.ones(8), "b": jnp.ones(8)}]}, plan
    )
    assert placed["copies"][0]["a"].sharding == plan.shardings["a"]
    assert placed["copies"][0]["b"].sharding.is_fully_replicated
    assert placed["step"].sharding.is_fully_replicated


def test_apply_places_everything_in_one_device_put(monkeypatch):
    calls = []
    device_put = jax.device_put

    def counting(*args, **kwargs):
        calls.append(args)
        return device_put(*args, **kwargs)

    monkeypatch.setattr(jax, "device_put", counting)
    model = eqx.nn.MLP(8, 8, 16, 3, key=jax.random.key(0))
    eqshard.apply(model, "... -> * ...")
    assert len(calls) == 1
    assert len(calls[0][0]) == 8  # every weight and bias, in one batch


def test_apply_refuses_what_it_cannot_place_faithfully():
    with pytest.raises(
        SpecError, match=r"ids: is a NumPy int64 array, and JAX runs with 32-bit types"
    ):
        eqshard.apply({"ids": np.array([2**40 + 1, 3] * 4, np.int64)}, {"ids": "a -> a*"})
    with pytest.raises(SpecError, match=r"  w: is traced: .*use `eqshard.constrain"):
        jax.jit(lambda m: eqshard.apply(m, "a -> a*"))({"w": jnp.ones(8)})
    with pytest.raises(SpecError, match=r"  s: JAX cannot place it"):
        eqshard.apply({"s": np.array(["a", "b"] * 4)}, "a -> a*")


def test_a_full_copy_compares_equal_however_it_was_made():
    model = {"w": jnp.ones((8, 4)), "b": jnp.ones(8)}
    plan = eqshard.plan(model, "... -> * ...")
    placed = eqshard.apply(model, plan)
    traced = jax.jit(lambda m: eqshard.constrain(m, plan))(model)
    for leaf in (placed["w"], placed["b"], traced["w"], traced["b"]):
        assert leaf.sharding == plan.replicated()
    state = eqshard.apply(optax.adam(1e-3).init(model), plan)  # a step count: a full copy
    assert state[0].count.sharding == placed["w"].sharding


def test_devices_is_a_count_or_a_list_everywhere():
    model = {"w": jnp.ones((8, 4))}
    four = jax.devices()[:4]
    by_count = eqshard.apply(model, "a b -> a* b", devices=4)
    by_list = eqshard.apply(model, "a b -> a* b", devices=four)
    assert by_count["w"].sharding == by_list["w"].sharding
    assert set(by_count["w"].sharding.device_set) == set(four)
    assert eqshard.apply(model["w"], "a b -> a* b", devices=4).sharding.device_set == set(four)
    built = eqshard.init(lambda: model, "a b -> a* b", devices=4, unspecified="keep")
    assert built["w"].sharding == by_list["w"].sharding
    assert eqshard.plan(model, "a b -> a* b", devices=4).partition_specs == {"w": P("m0", None)}
    with pytest.raises(
        eqshard.EqshardError,
        match=r"`eqshard.apply` places arrays on `devices=16`, the first 16 of `jax.devices\(\)`, "
        r"and there are 8; pass at most 8, or lay out for devices this process does not "
        r"have with `eqshard.plan\(model, spec, simulate=16\)`",
    ):
        eqshard.apply(model, "a b -> a* b", devices=16)


def test_the_spec_tree_of_a_plan_is_that_of_its_spec():
    model = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    rules = eqshard.load({"eqshard": 1, "rules": [{"path": "**.weight", "expr": "o i -> o* i"}]})
    plan = eqshard.plan(model, rules)
    assert eqshard.spec_tree(model, plan) == eqshard.spec_tree(model, rules)
    assert str(eqshard.spec_tree(model, plan).layers[0].weight) == "o i -> o* i"
    abstract = eqshard.plan(model, eqshard.FSDP, simulate=64)  # laid out for 64, not 8
    assert eqshard.spec_tree(model, abstract) == abstract.expressions


def test_a_count_across_processes_is_every_device(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # as under jax.distributed
    with pytest.raises(
        eqshard.EqshardError,
        match=r"^`eqshard.apply` places arrays on `devices=4`, and this is one of 2 processes, "
        r"which hold 8 devices together: every process places onto the same devices, so "
        r"pass them all \(`devices=8`\), a list of devices, or a `jax.sharding.Mesh`$",
    ):
        eqshard.apply({"w": jnp.ones((8, 4))}, "a b -> a* b", devices=4)


# --------------------------------------------------------------------------- #
# Placing never changes a value, never aliases a mutable input, and reports
# every fault of every kind at once.
# --------------------------------------------------------------------------- #

BIG = 2**40 + 1


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.complex128])
def test_64_bit_numpy_is_refused_everywhere_it_could_be_cast(dtype):
    x = np.array([BIG, 3] * 4, dtype)
    held = {np.int64: "int32", np.float64: "float32", np.complex128: "complex64"}[dtype]
    for place in (
        lambda: eqshard.apply(x, "a -> a*"),
        lambda: eqshard.constrain(x, "a -> a*"),
        lambda: eqshard.constrain({"x": x}, {"x": "a -> a*"}),
        lambda: eqshard.apply({"x": x}, {"x": "a -> a*"}),
    ):
        with pytest.raises(eqshard.EqshardError, match=rf"cast it \(`x.astype\(np.{held}\)`\)"):
            place()


@pytest.mark.parametrize("shape", [(8, 8), (256, 256)])
def test_placed_values_never_alias_a_writeable_numpy_input(shape):
    x = np.zeros(shape, np.float32)
    placed = [
        eqshard.apply(x, "a b -> a* b"),
        eqshard.apply(x, "a b -> * a b"),
        eqshard.apply({"x": x}, {"x": "a b -> a b*"})["x"],
        eqshard.constrain({"x": x}, {"x": "a b -> a* b"})["x"],
        eqshard.apply({"x": x}, {"x": "a b -> 8 a b"}, devices=jax.devices()[:8])["x"],
    ]
    x[0, 0], x[-1, -1] = 5, 7  # the user writes into their array afterwards
    for y in placed:
        np.testing.assert_array_equal(np.asarray(y), np.zeros(shape, np.float32))


def test_constrain_with_a_plan_for_other_shapes_names_the_leaf():
    model = eqx.nn.MLP(4, 4, 16, 1, key=jax.random.key(0))
    other = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight),
        model,
        (jnp.ones((8, 4)), jnp.ones(8), jnp.ones((4, 8))),
    )
    p = eqshard.plan(model, "... -> * ...")
    with pytest.raises(SpecError) as info:
        eqshard.constrain(other, p)
    assert [str(problem) for problem in info.value.problems] == [
        "layers.0.weight (Linear.weight): the plan was made for shape (16, 4), and this leaf "
        "has (8, 4); make the plan from this model",
        "layers.0.bias (Linear.bias): the plan was made for shape (16,), and this leaf has "
        "(8,); make the plan from this model",
        "layers.1.weight (Linear.weight): the plan was made for shape (4, 16), and this leaf "
        "has (4, 8); make the plan from this model",
    ]
    with pytest.raises(SpecError, match="the plan was made for shape"):
        eqx.filter_jit(lambda m: eqshard.constrain(m, p))(other)


def test_parse_layout_and_placement_faults_are_reported_together():
    tree = {
        "bad_text": jnp.ones(8),
        "does_not_fit": jnp.ones(6),
        "int64": np.ones(8, np.int64),
        "fine": jnp.ones(8),
    }
    spec = {"bad_text": "a -> a0", "does_not_fit": "a -> a*", "int64": "a -> a*", "fine": "a -> a*"}
    with pytest.raises(SpecError) as info:
        eqshard.apply(tree, spec)
    assert [p.where for p in info.value.problems] == ["bad_text", "does_not_fit", "int64"]
