import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard
from eqshard import EqshardError, ExpressionError
from eqshard._constrain import shard as place_one  # deprecated for `apply`, tested until it goes
from eqshard._picture import blocks


def _holders(sharding, shape):
    """{block index: device ids} for an array of `shape`."""
    return {block.index: list(block.devices) for block in blocks(sharding, shape)}


def test_columns_split_over_all_devices():
    s = eqshard.expression.sharding("x y -> x y*", (4, 16))
    assert _holders(s, (4, 16)) == {(0, j): [j] for j in range(8)}
    assert s.shard_shape((4, 16)) == (4, 2)


def test_mesh_follows_the_right_side_order():
    # mesh (b: 2, a: 4), filled row-major: block (ai, bi) sits on device bi * 4 + ai.
    s = eqshard.expression.sharding("a b -> b2 a4", (8, 8))
    assert _holders(s, (8, 8)) == {
        (0, 0): [0], (1, 0): [1], (2, 0): [2], (3, 0): [3],
        (0, 1): [4], (1, 1): [5], (2, 1): [6], (3, 1): [7],
    }  # fmt: skip


def test_replication_axes():
    # mesh (_0: 2, a: 2, b: 1, _3: 2): a's halves on devices {0,1,4,5} and {2,3,6,7}.
    s = eqshard.expression.sharding("a b -> 2 a2 b 2", (4, 6))
    assert _holders(s, (4, 6)) == {(0, 0): [0, 1, 4, 5], (1, 0): [2, 3, 6, 7]}
    assert dict(s.mesh.shape) == {"_0": 2, "a": 2, "b": 1, "_3": 2}
    assert s.spec == P("a", "b")


def test_spec_and_mesh_are_readable():
    s = eqshard.expression.sharding("a b -> 2 a2* b*", (4, 8), devices=jax.devices()[:4])
    assert dict(s.mesh.shape) == {"_0": 2, "a": 2, "b": 1}
    assert s.spec == P("a", "b")
    assert all(kind == AxisType.Auto for kind in s.mesh.axis_types)


def test_device_subsets_and_order():
    devices = jax.devices()
    s = eqshard.expression.sharding("a -> a*", (8,), devices=devices[4:])
    assert _holders(s, (8,)) == {(0,): [4], (1,): [5], (2,): [6], (3,): [7]}
    s = eqshard.expression.sharding("a -> a*", (8,), devices=devices[::-1])
    assert [devices for _, devices in sorted(_holders(s, (8,)).items())] == [
        [7 - i] for i in range(8)
    ]


def test_devices_must_be_distinct_and_non_empty():
    devices = jax.devices()
    with pytest.raises(EqshardError, match=r"`devices` holds .* twice; list each device once"):
        eqshard.expression.sharding("a -> a*", (8,), devices=[devices[0], devices[0]])
    with pytest.raises(EqshardError, match=r"`devices` is empty"):
        eqshard.expression.sharding("a -> a*", (8,), devices=[])


def test_sharding_is_cached():
    a = eqshard.expression.sharding("a b -> a b*", (8, 8))
    assert eqshard.expression.sharding("a b -> a b*", (8, 8)) is a
    assert eqshard.expression.sharding("a b -> a b*", [8, 8], devices=jax.devices()) is a
    expr = eqshard.expression.parse("a b -> a b*")
    assert eqshard.expression.sharding(expr, (8, 8)) == a
    # one mesh object per mesh shape and devices
    assert eqshard.expression.sharding("c d -> c d*", (8, 8)).mesh.axis_names == ("c", "d")


def test_layout_errors_reach_sharding():
    with pytest.raises(
        ExpressionError, match="has size 6, which does not split into 8 equal shards"
    ):
        eqshard.expression.sharding("a b -> a b*", (8, 6))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint32, jnp.bool_])
def test_shard_keeps_values_bit_for_bit(dtype):
    x = jax.random.normal(jax.random.key(0), (8, 16)).astype(dtype)
    y = place_one(x, "a b -> a2 b*")
    assert y.dtype == x.dtype
    assert y.sharding == eqshard.expression.sharding("a b -> a2 b*", (8, 16))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[shard.index])


def test_shard_does_not_touch_its_input():
    x = jax.device_put(np.arange(64.0).reshape(8, 8), jax.devices()[0])
    before = np.asarray(x).copy()
    y = place_one(x, "a b -> a* b")
    assert x.sharding.device_set == {jax.devices()[0]}
    np.testing.assert_array_equal(np.asarray(x), before)
    assert y is not x


def test_shard_does_not_copy_an_array_already_in_place():
    y = place_one(np.arange(64, dtype=np.float32).reshape(8, 8), "a b -> a b*")
    assert place_one(y, "a b -> a b*") is y


def test_shard_numpy_input():
    x = np.arange(32, dtype=np.int32).reshape(4, 8)
    y = place_one(x, "a b -> * a b")
    assert len(y.addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(y), x)


def test_shard_refuses_tracers_and_non_arrays():
    with pytest.raises(EqshardError, match=r"use `eqshard.constrain\(x, expr\)` there"):
        jax.jit(lambda x: place_one(x, "a -> a*"))(jnp.ones(8))
    with pytest.raises(EqshardError, match="takes an array, not list"):
        place_one([1, 2], "a -> a*")  # type: ignore[arg-type]


def test_shard_refuses_abstract_arrays():
    with pytest.raises(EqshardError, match=r"is abstract \(a jax.ShapeDtypeStruct\)"):
        place_one(jax.ShapeDtypeStruct((8,), jnp.float32), "a -> a*")  # pyright: ignore[reportArgumentType]


def test_read_only_views_and_jax_arrays_are_placed_with_their_values():
    base = np.arange(32, dtype=np.float32).reshape(8, 4)
    x = base.view()
    x.flags.writeable = False  # read-only, but its base is not
    y = place_one(x, "a b -> a* b")
    base[0, 0] = 100
    np.testing.assert_array_equal(np.asarray(y), np.arange(32).reshape(8, 4))
    z = place_one(jnp.asarray(base), "a b -> a* b")
    np.testing.assert_array_equal(np.asarray(z), base)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: eqshard.expression.sharding(["a -> a"], (8,)), "must be a string such as"),  # type: ignore[arg-type]
        (lambda: eqshard.expression.sharding("a -> a*", (8,), devices=8.0), "not float"),  # type: ignore[arg-type]
        (
            lambda: eqshard.expression.sharding("a -> a*", (8,), devices=[0, 1]),
            "holds 0, which is not a JAX device",
        ),
        (
            lambda: eqshard.expression.sharding("a -> a " + "2 " * 33, (8,)),
            "a JAX mesh has at most 32 axes",
        ),
    ],
    ids=["not a string", "a float count", "not devices", "33 mesh axes"],
)
def test_bad_arguments_to_sharding_are_eqshard_errors(call, message):
    with pytest.raises(EqshardError, match=message):
        call()


def test_mesh_devices_are_accepted_in_row_major_order():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    s = eqshard.expression.sharding("x -> x*", (8,), devices=mesh.devices)
    assert np.asarray(s.mesh.devices).ravel().tolist() == np.asarray(mesh.devices).ravel().tolist()


def test_arrays_on_different_meshes_meet_in_jit():
    # Each expression has its own mesh; they share the device order, so jit accepts them.
    w1 = place_one(jnp.ones((16, 32)), "x y -> x y*")
    w2 = place_one(jnp.ones((32, 8)), "y z -> y* z")
    x = place_one(jnp.ones((4, 16)), "... -> * ...")
    out = jax.jit(lambda x, w1, w2: jax.nn.relu(x @ w1) @ w2)(x, w1, w2)
    np.testing.assert_allclose(np.asarray(out), np.full((4, 8), 16.0 * 32.0))


def test_constrain_inside_filter_jit():
    expr = "batch d -> batch* d"

    @eqx.filter_jit
    def f(x):
        return eqshard.constrain(x * 2, expr)

    x = jnp.arange(32.0).reshape(8, 4)
    out = f(x)
    assert out.sharding.is_equivalent_to(eqshard.expression.sharding(expr, (8, 4)), 2)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2)
    hlo = jax.jit(lambda x: eqshard.constrain(x * 2, expr)).lower(x).as_text()
    assert "sharding" in hlo


def test_constrain_outside_jit_places_the_value():
    y = eqshard.constrain(jnp.arange(8.0), "a -> a*")
    assert y.sharding.is_equivalent_to(eqshard.expression.sharding("a -> a*", (8,)), 1)


def test_inside_an_auto_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    w = place_one(jnp.ones((16, 32)), "x y -> x y*")
    with jax.set_mesh(mesh):
        out = jax.jit(lambda w: eqshard.constrain(w * 2, "x y -> x* y"))(w)
    np.testing.assert_array_equal(np.asarray(out), np.full((16, 32), 2.0))
    assert out.sharding.is_equivalent_to(eqshard.expression.sharding("x y -> x* y", (16, 32)), 2)


def test_constrain_under_explicit_axes_reshards_onto_that_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x: eqshard.constrain(x, "a b -> a* b"))(x)
    assert y.sharding == NamedSharding(mesh, P(("data", "model"), None))


@pytest.mark.slow  # a fresh interpreter: imports JAX and compiles
def test_no_assertions_under_python_O(run_python):
    code = """
import jax
jax.config.update("jax_num_cpu_devices", 4)
import eqshard
assert False, "asserts must be off here"
"""
    result = run_python(["-O", "-c", code + _UNDER_O])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ExpressionError"] * 5


_UNDER_O = """
for text, shape in [("a b -> a c", (4, 4)), ("a -> a0", (4,)), ("a b -> a2 b4", (4, 8)),
                    ("a b -> a b3", (4, 4)), ("a b -> a b*", (4,))]:
    try:
        eqshard.expression.sharding(text, shape)
    except eqshard.ExpressionError as error:
        print(type(error).__name__)
"""
