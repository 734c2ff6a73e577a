"""Checkpoints that restore straight into shards, on any device count, from
Equinox's files and through Orbax."""

import errno
import io
import json
import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dtype_round_trip import round_trip

import eqshard
from eqshard import EqshardError

ocp = pytest.importorskip("orbax.checkpoint")

RULES = eqshard.load(
    {
        "eqshard": 1,
        "rules": [
            {"path": "**.layers.0.weight", "expr": "o i -> o* i"},
            {"path": "**.layers.0.bias", "expr": "o -> o*"},
            {"path": "**.layers.1.weight", "expr": "o i -> o i*"},
        ],
    }
)
OTHER = "... -> * ..."  # another layout: everything replicated


def _build():
    return eqx.nn.MLP(16, 16, 64, 1, key=jax.random.key(0))


def _optimizer():
    return optax.adam(1e-2)


def _trained_state():
    """A model and Adam state on 8 devices, one step in, so the moments are not zero."""
    model = _build()
    plan = eqshard.plan(model, RULES)
    model = eqshard.apply(model, plan)
    state = eqshard.apply(_optimizer().init(eqx.filter(model, eqx.is_array)), plan)
    grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(jnp.ones((4, 16))) ** 2))(model)
    updates, state = _optimizer().update(grads, state)
    return eqx.apply_updates(model, updates), state


def _like():
    return eqx.filter_eval_shape(
        lambda: (_build(), _optimizer().init(eqx.filter(_build(), eqx.is_array)))
    )


def _assert_identical(restored, saved):
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(saved)):
        if eqx.is_array(b):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit for bit


def _assert_in_shards(tree, plan_like):
    """Every device holds exactly its shard of every leaf, and nothing more."""
    for leaf, target in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(plan_like)):
        if isinstance(target, jax.ShapeDtypeStruct):
            assert leaf.sharding.is_equivalent_to(target.sharding, leaf.ndim)
            for shard in leaf.addressable_shards:
                assert shard.data.shape == target.sharding.shard_shape(leaf.shape)


@pytest.mark.parametrize("n", [8, 4])
@pytest.mark.parametrize("layout", ["same", "other"])
def test_restore_an_equinox_file_into_shards(tmp_path, n, layout):
    saved = _trained_state()
    eqx.tree_serialise_leaves(tmp_path / "state.eqx", saved)
    devices = jax.devices()[:n]
    model_like = eqx.filter_eval_shape(_build)
    plan = eqshard.plan(model_like, RULES if layout == "same" else OTHER, devices=devices)
    restored = eqshard.restore(tmp_path / "state.eqx", _like(), plan)
    _assert_identical(restored, saved)
    _assert_in_shards(restored, eqshard.abstract(_like(), plan))
    model, state = restored
    assert len(model.layers[0].weight.sharding.device_set) == n
    if layout == "same":
        assert model.layers[0].weight.sharding.shard_shape((64, 16)) == (64 // n, 16)
        assert state[0].mu.layers[0].weight.sharding == model.layers[0].weight.sharding
    assert model.activation is jax.nn.relu  # non-array leaves as in `like`


def test_a_file_that_does_not_match_like_names_the_leaf(tmp_path):
    eqx.tree_serialise_leaves(tmp_path / "model.eqx", _build())
    wider = eqx.filter_eval_shape(lambda: eqx.nn.MLP(16, 16, 32, 1, key=jax.random.key(0)))
    with pytest.raises(
        EqshardError,
        match=r"layers\.0\.weight \(Linear\.weight\): the file holds float32\[64, 16\] here, and `like` has float32\[32, 16\]",
    ):
        eqshard.restore(tmp_path / "model.eqx", wider, OTHER)
    as_f16 = jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, jnp.float16) if isinstance(x, jax.ShapeDtypeStruct) else x
        ),
        eqx.filter_eval_shape(_build),
    )
    with pytest.raises(
        EqshardError, match="holds float32\\[64, 16\\] here, and `like` has float16"
    ):
        eqshard.restore(tmp_path / "model.eqx", as_f16, OTHER)
    with pytest.raises(EqshardError, match="fewer leaves than `like`"):
        eqshard.restore(tmp_path / "model.eqx", _like(), OTHER)
    eqx.tree_serialise_leaves(tmp_path / "state.eqx", _trained_state())
    with pytest.raises(EqshardError, match="the file holds more leaves than `like`"):
        eqshard.restore(tmp_path / "state.eqx", eqx.filter_eval_shape(_build), OTHER)


def test_typed_keys_are_refused_with_the_workaround(tmp_path):
    like = {"key": jax.eval_shape(lambda: jax.random.key(0)), "w": jnp.ones(8)}
    with pytest.raises(EqshardError, match=r"jax\.random\.wrap_key_data"):
        eqshard.restore(tmp_path / "x.eqx", like, OTHER)


def _orbax_round_trip(tmp_path, state, like, plan):
    arrays, _ = eqx.partition(state, eqx.is_array)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", arrays)
        checkpointer.wait_until_finished()
        target = eqshard.abstract(eqx.filter(like, eqx.is_array_like), plan)
        return checkpointer.restore(tmp_path / "ckpt", target), target


@pytest.mark.parametrize("n", [4, 2])
def test_orbax_restores_an_8_device_save_on_fewer_devices(tmp_path, n):
    saved = _trained_state()
    plan = eqshard.plan(eqx.filter_eval_shape(_build), RULES, devices=jax.devices()[:n])
    restored, target = _orbax_round_trip(tmp_path, saved, _like(), plan)
    _assert_identical(restored, eqx.filter(saved, eqx.is_array))
    _assert_in_shards(restored, target)


@pytest.mark.parametrize(
    "optimizer",
    [
        optax.masked(optax.adam(1e-2), lambda p: jax.tree_util.tree_map(lambda x: x.ndim == 2, p)),
        optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    ],
    ids=["masked", "MultiSteps"],
)
def test_orbax_round_trips_masked_and_multisteps_states(tmp_path, optimizer):
    model = _build()
    plan = eqshard.plan(model, RULES)
    params = eqx.filter(model, eqx.is_array)
    state = eqshard.apply(optimizer.init(params), plan)
    like = jax.eval_shape(optimizer.init, params)
    restored, target = _orbax_round_trip(tmp_path, state, like, plan)
    _assert_identical(restored, eqx.filter(state, eqx.is_array))
    _assert_in_shards(restored, target)


# --------------------------------------------------------------------------- #
# Every dtype, bit for bit; 64-bit leaves; leaves that cannot be read.
# --------------------------------------------------------------------------- #

DTYPE_ROUND_TRIP = Path(__file__).parent / "dtype_round_trip.py"
SMALL_TYPES = {
    "bfloat16",
    "bool",
    "complex64",
    "float16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "int4",
    "uint4",
}


def test_restore_every_dtype_bit_for_bit_into_shards(tmp_path):
    # bfloat16 and the float8 and int4 types are ml_dtypes types, which NumPy saves as
    # raw bytes ('<V2', '<V1') or as a code it cannot read back ('<f1'); every shard of
    # every leaf is checked on every device, byte for byte (`dtype_round_trip.py`)
    names = round_trip(tmp_path)
    assert set(names) >= SMALL_TYPES
    newer = {"float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "float4_e2m1fn", "int2", "uint2"}
    assert {name for name in newer if hasattr(jnp, name)} <= set(names)


@pytest.mark.slow  # a fresh interpreter: imports JAX and compiles
def test_restore_every_64_bit_dtype_under_x64_and_refuse_it_in_32_bit_mode(tmp_path, run_python):
    # `-c`, so that the process imports the eqshard this one does, from the working directory
    run = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    done = run_python(["-c", run, str(DTYPE_ROUND_TRIP), str(tmp_path)])
    assert done.returncode == 0, done.stderr
    assert {"float64", "int64", "uint64", "complex128"} <= set(json.loads(done.stdout))
    like = eqx.filter_eval_shape(lambda: {"step": jnp.zeros(4, int), "w": jnp.zeros(4)})
    with pytest.raises(
        EqshardError,
        match=re.escape(
            "step: the file holds int64[4] here, and JAX runs with 32-bit types, so placing it "
            "would change its values; cast it (`x.astype(np.int32)`) or enable `jax_enable_x64`"
        ),
    ):
        eqshard.restore(tmp_path / "wide.eqx", like, OTHER)


def test_a_numpy_64_bit_leaf_is_refused_in_the_words_of_apply(tmp_path):
    saved = {"w": np.arange(4) * 2**40}
    eqx.tree_serialise_leaves(tmp_path / "wide.eqx", saved)
    with pytest.raises(EqshardError) as applying:
        eqshard.apply(saved, OTHER)
    rule = re.search(r"JAX runs with 32-bit types.*", str(applying.value))
    assert rule is not None
    assert "cast it (`x.astype(np.int32)`)" in rule.group()
    for like in (saved, eqx.filter_eval_shape(lambda: saved)):  # as saved, or abstract
        with pytest.raises(
            EqshardError,
            match=r"^w: the file holds int64\[4\] here, and " + re.escape(rule.group()),
        ):
            eqshard.restore(tmp_path / "wide.eqx", like, OTHER)


def test_a_leaf_that_cannot_be_read_keeps_its_cause_and_path(tmp_path, monkeypatch):
    eqx.tree_serialise_leaves(tmp_path / "lr.eqx", {"lr": jnp.ones(3)})
    with pytest.raises(
        EqshardError,
        match=r"^lr: cannot read the saved float: ValueError: can only convert an array of size 1",
    ) as caught:
        eqshard.restore(tmp_path / "lr.eqx", {"lr": 0.1}, OTHER)
    assert isinstance(caught.value.__cause__, ValueError)

    class Failing(io.BufferedReader):
        def readinto(self, buffer):  # the disk fails while the data is read
            raise OSError(errno.EIO, "Input/output error")

    eqx.tree_serialise_leaves(tmp_path / "model.eqx", _build())
    monkeypatch.setattr(
        "eqshard._checkpoint.open", lambda *a: Failing(io.FileIO(*a)), raising=False
    )
    with pytest.raises(
        EqshardError,
        match=r"^layers\.0\.weight \(Linear\.weight\): cannot read its float32\[64, 16\] data: "
        r"OSError: \[Errno 5\] Input/output error",
    ) as caught:
        eqshard.restore(tmp_path / "model.eqx", eqx.filter_eval_shape(_build), OTHER)
    assert isinstance(caught.value.__cause__, OSError)
    (tmp_path / "cut.eqx").write_bytes((tmp_path / "model.eqx").read_bytes()[:-10])
    monkeypatch.undo()
    with pytest.raises(
        EqshardError, match=r"^layers\.1\.bias \(Linear\.bias\): the file ends inside this array"
    ) as caught:
        eqshard.restore(tmp_path / "cut.eqx", eqx.filter_eval_shape(_build), OTHER)
    assert isinstance(caught.value.__cause__, EOFError)


def _pair(dtype):
    """(blocks, head), `blocks` a list: inside `(model, opt_state)` the head's path is
    `0.1.weight`, which is also `blocks[1].weight`'s path in the model."""
    keys = jax.random.split(jax.random.key(3), 3)
    model = (
        [eqx.nn.Linear(16, 16, key=keys[0]), eqx.nn.Linear(16, 16, key=keys[1])],
        eqx.nn.Linear(16, 16, key=keys[2]),
    )
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if eqx.is_array(x) else x, model)


_PAIR_SPEC = eqshard.load(
    {
        "eqshard": 1,
        "rules": [
            {"path": "0.0.weight", "expr": "o i -> o* i"},
            {"path": "0.0.bias", "expr": "o -> o*"},
            {"path": "0.1.weight", "expr": "o i -> o* i"},
            {"path": "1.weight", "expr": "o i -> o i*"},
        ],
    }
)


@pytest.mark.slow  # Orbax saves and restores, per dtype
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_readme_recipes_keep_every_planned_layout(tmp_path, dtype):
    from optimizer_state_oracle import expected_shardings

    optimizer = optax.adamw(1e-3)

    def build():
        model = _pair(dtype)
        return model, optimizer.init(eqx.filter(model, eqx.is_array))

    model = _pair(dtype)
    plan = eqshard.plan(model, _PAIR_SPEC)
    params = eqx.filter(model, eqx.is_array)
    opt_state = optimizer.init(params)
    model = eqshard.apply(model, plan)
    opt_state = eqshard.apply(opt_state, plan)
    grads = jax.tree_util.tree_map(lambda x: jnp.ones_like(x) / 3, params)
    _, opt_state = optimizer.update(grads, opt_state, params)  # moments that are not zero
    opt_state = eqshard.apply(opt_state, plan)
    want_model = [s for s in plan.flat_shardings if s is not None]
    want_state = expected_shardings(optimizer, opt_state, params, plan)
    assert want_model[4].spec == jax.sharding.PartitionSpec(None, "m0")  # the head

    def assert_planned(pair):
        got_model = [x.sharding for x in jax.tree_util.tree_leaves(pair[0])]
        assert got_model == want_model
        for leaf, want in zip(jax.tree_util.tree_leaves(pair[1]), want_state):
            assert leaf.sharding == want if want is not None else leaf.sharding.is_fully_replicated

    path = tmp_path / "state.eqx"
    eqx.tree_serialise_leaves(path, (model, opt_state))
    like = eqx.filter_eval_shape(build)
    restored = eqshard.restore(path, like, plan)  # README: "Checkpoints"
    assert_planned(restored)
    _assert_identical(restored, (model, opt_state))
    target = eqshard.abstract(  # README: the Orbax target
        eqx.filter(like, lambda x: isinstance(x, jax.ShapeDtypeStruct)), plan
    )
    assert_planned(target)
    built = eqshard.init(lambda: build()[0], plan)  # README: "init"
    assert [x.sharding for x in jax.tree_util.tree_leaves(built)] == want_model
    assert jax.tree_util.tree_leaves(built)[4].dtype == dtype


def test_a_model_cast_since_its_plan_keeps_its_own_dtypes(tmp_path):
    model = _build()
    plan = eqshard.plan(model, RULES)  # made for float32
    half = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if eqx.is_array(x) else x, model)
    target = eqshard.abstract(half, plan)  # the Orbax target of the bfloat16 model
    for leaf, sharding in zip(
        jax.tree_util.tree_leaves(target), [s for s in plan.flat_shardings if s is not None]
    ):
        assert leaf.dtype == jnp.bfloat16
        assert leaf.sharding == sharding
    eqx.tree_serialise_leaves(tmp_path / "half.eqx", half)
    restored = eqshard.restore(tmp_path / "half.eqx", eqx.filter_eval_shape(lambda: half), plan)
    _assert_identical(restored, half)
    _assert_in_shards(restored, plan.abstract)


class _Cached(eqx.Module):
    """A KV cache made without `eqx.nn.make_with_state`: its marker is new at each build."""

    mlp: eqx.nn.MLP
    cache: eqx.nn.StateIndex

    def __init__(self):
        self.mlp = _build()
        self.cache = eqx.nn.StateIndex(jnp.zeros((4, 16)))


def _cached_state(build):
    return build(), _optimizer().init(eqx.filter(build(), eqx.is_array))  # two builds


@pytest.mark.parametrize("plan_from", ["like's model", "another build"])
def test_restore_lays_out_the_moments_of_another_build(tmp_path, plan_from):
    from optimizer_state_oracle import blocks

    model = _Cached()
    plan = eqshard.plan(model, RULES)
    model = eqshard.apply(model, plan)
    opt_state = eqshard.apply(_optimizer().init(eqx.filter(model, eqx.is_array)), plan)
    eqx.tree_serialise_leaves(tmp_path / "state.eqx", (model, opt_state))
    like = eqx.filter_eval_shape(_cached_state, _Cached)
    if plan_from == "like's model":
        plan = eqshard.plan(like[0], RULES)
    restored = eqshard.restore(tmp_path / "state.eqx", like, plan)
    _assert_identical(restored, (model, opt_state))
    planned = [s for s in plan.flat_shardings if s is not None]
    assert sum(not s.is_fully_replicated for s in planned) == 3
    for part in (restored[0], restored[1][0].mu, restored[1][0].nu):
        arrays = [x for x in jax.tree_util.tree_leaves(part) if eqx.is_array(x)]
        assert len(arrays) == len(planned)
        for leaf, sharding in zip(arrays, planned):  # device by device, not a full copy
            assert blocks(leaf.sharding, leaf.shape) == blocks(sharding, leaf.shape)


def test_restore_refuses_the_optimizer_state_of_another_model(tmp_path):
    deeper = lambda: eqx.nn.MLP(16, 16, 64, 2, key=jax.random.key(0))  # noqa: E731
    saved = (_build(), _optimizer().init(eqx.filter(deeper(), eqx.is_array)))
    eqx.tree_serialise_leaves(tmp_path / "state.eqx", saved)
    like = eqx.filter_eval_shape(lambda: saved)
    with pytest.raises(
        eqshard.SpecError,
        match=r"1\.0\.mu, 1\.0\.nu: a MLP that is not shaped like the plan's model \(its static "
        r"field depth is 2, the model's 1\), so its leaves would be replicated where the plan "
        r"splits the model's; build it as the model the plan was made from",
    ):
        eqshard.restore(tmp_path / "state.eqx", like, eqshard.plan(like[0], RULES))
