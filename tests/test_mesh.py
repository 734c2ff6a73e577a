"""The user's own mesh: layouts written on it with its names, logical axes, and
a warning when layouts disagree. Checked device by device against `sharding`."""

import itertools
import json
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

import eqshard
from eqshard import EqshardError, SpecError


def _mesh(shape=(2, 4), names=("data", "model"), kind=AxisType.Auto, devices=None):
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape), devices=devices)


def _blocks(sharding, shape):
    """{device id: block bounds}: what every device holds."""
    return {
        device.id: tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(i, shape))
        for device, i in sharding.devices_indices_map(tuple(shape)).items()
    }


def _rank2_expressions(n=8):
    """Every valid expression of `a b` on `n` devices with counts, at most 3 elements."""
    parts = ["a", "b", "a2", "b2", "a4", "b4", "a8", "b8", "2", "4", "8", "a*", "b*", "*"]
    found = []
    for k in (1, 2, 3):
        for combo in itertools.permutations(parts, k):
            expr = f"a b -> {' '.join(combo)}"
            try:
                eqshard.expression.sharding(expr, (16, 16), devices=jax.devices()[:n])
            except EqshardError:
                continue
            found.append(expr)
    return found


# --------------------------------------------------------------------------- #
# Fitting, device by device.
# --------------------------------------------------------------------------- #


def test_layouts_on_the_users_mesh_keep_every_devices_blocks():
    mesh = _mesh()
    fits, misfits = [], []
    for expr in _rank2_expressions():
        try:
            on_mesh = eqshard.expression.sharding(expr, (16, 16), mesh=mesh)
        except eqshard.ExpressionError:
            misfits.append(expr)
            continue
        fits.append(expr)
        assert on_mesh.mesh is mesh
        einshard = eqshard.expression.sharding(expr, (16, 16), devices=list(mesh.devices.flat))
        assert _blocks(on_mesh, (16, 16)) == _blocks(einshard, (16, 16)), expr
    assert 0.5 < len(fits) / (len(fits) + len(misfits)) < 0.75  # about half to two thirds
    assert "a b -> a4 b2" in misfits
    assert eqshard.expression.sharding("a b -> a2 b4", (16, 16), mesh=mesh).spec == P(
        "data", "model"
    )
    assert eqshard.expression.sharding("a b -> a* b", (16, 16), mesh=mesh).spec == P(
        ("data", "model"), None
    )


def test_device_order_is_the_meshs_own():
    devices = np.array(jax.devices())[[7, 3, 5, 1, 6, 2, 4, 0]].reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    for expr in ["a b -> a2 b4", "a b -> b2 a4", "a b -> a* b", "a b -> 2 a b4"]:
        on_mesh = eqshard.expression.sharding(expr, (8, 8), mesh=mesh)
        expected = eqshard.expression.sharding(expr, (8, 8), devices=list(devices.flat))
        assert _blocks(on_mesh, (8, 8)) == _blocks(expected, (8, 8)), expr


def test_a_layout_that_does_not_fit_names_the_leaf_the_mesh_and_a_fix():
    model = {"w": jnp.ones((8, 8)), "v": jnp.ones((8, 6))}
    with pytest.raises(SpecError) as info:
        eqshard.plan(model, {"w": "a b -> a4 b2", "v": "a b -> a* b"}, mesh=_mesh())
    [problem] = info.value.problems
    assert problem.where == "w"
    assert problem.message == (
        "float32[8, 8] 'a b -> a4 b2' does not fit the mesh ('data': 2, 'model': 4): it "
        "cuts the device order into 4 blocks of 2, where the mesh's axes cut it into 2 "
        "blocks of 4; write 'a b -> b2 a4', the same counts in the mesh's order"
    )
    with pytest.raises(eqshard.ExpressionError, match="no order of these counts fits"):
        eqshard.expression.sharding("a b -> a2 b4", (8, 8), mesh=_mesh((8,), ("x",)))


def test_mesh_and_devices_and_plans_do_not_mix():
    model = {"w": jnp.ones(8)}
    with pytest.raises(
        EqshardError, match=r"`mesh=` and `devices=` \(or `simulate=`\) are both given"
    ):
        eqshard.apply(model, "a -> a*", mesh=_mesh(), devices=jax.devices())
    with pytest.raises(EqshardError, match=r"`mesh=` is a `jax\.sharding\.Mesh`"):
        eqshard.apply(model, "a -> a*", mesh=jax.devices())  # type: ignore[arg-type]
    p = eqshard.plan(model, "a -> a*")
    with pytest.raises(EqshardError, match="`mesh=` is given with a `Plan`"):
        eqshard.apply(model, p, mesh=_mesh())


def test_the_shared_mesh_counts_only_sharded_boundaries():
    model = [jnp.ones((8, 8))] * 2
    p = eqshard.plan(model, ["a b -> a2 2 2 b", "a b -> a2 b4"])
    assert p.mesh is not None
    assert dict(p.mesh.shape) == {"m0": 2, "m1": 4}
    for expr, sharding in zip(["a b -> a2 2 2 b", "a b -> a2 b4"], p.shardings):
        assert _blocks(sharding, (8, 8)) == _blocks(
            eqshard.expression.sharding(expr, (8, 8)), (8, 8)
        )


# --------------------------------------------------------------------------- #
# Layouts that disagree.
# --------------------------------------------------------------------------- #


def _disagreeing():
    model = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0), use_bias=False)
    spec = eqx.tree_at(
        lambda s: (s.layers[0].weight, s.layers[1].weight),
        eqshard.spec_tree(model),
        ("o i -> 2 o4 i", "o i -> o i4 2"),
        is_leaf=lambda x: x is None,
    )
    return model, spec


def test_disagreeing_groupings_warn_and_name_the_leaves():
    model, spec = _disagreeing()
    with pytest.warns(eqshard.MeshWarning) as caught:
        p = eqshard.plan(model, spec)
    assert p.mesh is not None
    assert tuple(p.mesh.shape.values()) == (2, 2, 2)
    [warning] = caught
    message = str(warning.message)
    assert "layers.0.weight (Linear.weight) ('o i -> 2 o4 i') as (2, 4)" in message
    assert "layers.1.weight (Linear.weight) ('o i -> o i4 2') as (4, 2)" in message
    with pytest.raises(SpecError) as info:
        eqshard.plan(model, spec, mesh=_mesh())
    assert [p.where for p in info.value.problems] == ["layers.1.weight (Linear.weight)"]


def test_agreeing_layouts_do_not_warn():
    model = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqshard.plan(
            model,
            eqx.tree_at(
                lambda s: s.layers[0].weight,
                eqshard.spec_tree(model),
                "o i -> o* i",
                is_leaf=lambda x: x is None,
            ),
        )


# --------------------------------------------------------------------------- #
# Training on the user's mesh.
# --------------------------------------------------------------------------- #


def _loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _megatron(model):
    return eqx.tree_at(
        lambda s: (s.layers[0].weight, s.layers[0].bias, s.layers[1].weight),
        eqshard.spec_tree(model),
        ("o i -> 2 o4 i", "o -> 2 o4", "o i -> 2 o i4"),
        is_leaf=lambda x: x is None,
    )


def test_a_step_under_set_mesh_of_auto_axes_runs_with_one_trace():
    mesh = _mesh()
    model = eqx.nn.MLP(8, 8, 32, 1, key=jax.random.key(0))
    x, y = jax.random.normal(jax.random.key(1), (16, 8)), jnp.ones((16, 8))
    optimizer = optax.adam(1e-2)
    traces = []

    @eqx.filter_jit
    def step(model, opt_state, x, y, plan):
        traces.append(plan is not None)
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state)
        return eqshard.constrain(eqx.apply_updates(model, updates), plan), opt_state, loss

    reference, ref_state = model, optimizer.init(eqx.filter(model, eqx.is_array))
    expected = []
    for _ in range(3):
        reference, ref_state, ref_loss = step(reference, ref_state, x, y, None)
        expected.append(ref_loss)
    with jax.set_mesh(mesh):
        plan = eqshard.plan(model, _megatron(model))
        assert plan.mesh is mesh
        sharded = eqshard.apply(model, plan)
        assert sharded.layers[0].weight.sharding == NamedSharding(mesh, P("model", None))
        x_sharded = eqshard.apply(x, "b d -> b2 d 4")
        assert x_sharded.sharding == NamedSharding(mesh, P("data", None))
        state = optimizer.init(eqx.filter(sharded, eqx.is_array))
        for ref_loss in expected:
            sharded, state, loss = step(sharded, state, x_sharded, y, plan)
            np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        assert sharded.layers[1].weight.sharding == NamedSharding(mesh, P(None, "model"))
    assert traces.count(True) == 1  # sharded: no retrace after the first step


@pytest.mark.slow  # trains on an explicit mesh (test_jit.py's Megatron MLP does too)
def test_a_data_parallel_step_on_an_explicit_mesh():
    mesh = _mesh(kind=AxisType.Explicit)
    model = eqx.nn.MLP(8, 8, 32, 1, key=jax.random.key(0))
    x, y = jax.random.normal(jax.random.key(1), (16, 8)), jnp.ones((16, 8))
    with jax.set_mesh(mesh):
        sharded = eqshard.apply(model, "... -> * ...")
        x_sharded = eqshard.apply(x, "b d -> b* d")
        assert jax.typeof(x_sharded).sharding.mesh.axis_types == (AxisType.Explicit,) * 2
        assert jax.typeof(x_sharded).sharding.spec == P(("data", "model"), None)
        grads = eqx.filter_jit(eqx.filter_grad(_loss))(sharded, x_sharded, y)
    reference = eqx.filter_grad(_loss)(model, x, y)
    np.testing.assert_allclose(grads.layers[0].weight, reference.layers[0].weight, rtol=1e-4)


def test_constrain_inside_jit_uses_the_abstract_mesh():
    mesh = _mesh()

    @jax.jit
    def f(x):
        return eqshard.constrain(x * 2, "a b -> a2 b4")

    with jax.set_mesh(mesh):
        y = f(jnp.ones((8, 8)))
    assert y.sharding == NamedSharding(mesh, P("data", "model"))


_ABSTRACT_RULES = eqshard.load(
    {
        "eqshard": 1,
        "rules": [{"path": "weight", "expr": "o i -> o* i"}, {"path": "bias", "expr": "o -> o*"}],
    }
)


def _linear():
    return eqx.nn.Linear(8, 16, key=jax.random.key(0))


@pytest.mark.parametrize(
    ("what", "call"),
    [
        ("apply", lambda m, path: eqshard.apply(jnp.ones((8, 16)), "a b -> a2 b4", mesh=m)),
        ("apply", lambda m, path: eqshard.apply(_linear(), _ABSTRACT_RULES, mesh=m)),
        ("constrain", lambda m, path: eqshard.constrain(_linear(), _ABSTRACT_RULES, mesh=m)),
        ("init", lambda m, path: eqshard.init(_linear, _ABSTRACT_RULES, mesh=m)),
        (
            "restore",
            lambda m, path: eqshard.restore(
                path, eqx.filter_eval_shape(_linear), _ABSTRACT_RULES, mesh=m
            ),
        ),
        (
            "cost",
            lambda m, path: eqshard.cost(
                _linear(),
                jnp.ones((8, 8)),
                step=eqx.filter_jit(lambda model, x: jax.vmap(model)(x).sum()),
                spec=_ABSTRACT_RULES,
                mesh=m,
            ),
        ),
    ],
)
def test_what_places_or_compiles_needs_a_concrete_mesh(what, call, tmp_path):
    eqx.tree_serialise_leaves(tmp_path / "linear.eqx", _linear())
    abstract = _mesh().abstract_mesh
    with pytest.raises(
        EqshardError,
        match=rf"^`eqshard\.{what}` needs a mesh with devices, and its mesh is a "
        r"`jax\.sharding\.AbstractMesh` \{'data': 2, 'model': 4\}, which has none .*; pass a "
        r"concrete `jax\.sharding\.Mesh`, such as `jax\.make_mesh\(\(2, 4\), \('data', 'model'\)\)`",
    ):
        call(abstract, tmp_path / "linear.eqx")
    with (
        jax.sharding.use_abstract_mesh(abstract),
        pytest.raises(EqshardError, match="needs a mesh"),
    ):
        call(None, tmp_path / "linear.eqx")  # the same, set as the context's mesh
    call(_mesh(), tmp_path / "linear.eqx")  # a concrete mesh of the same shape works


def test_an_abstract_mesh_still_plans_and_constrains_inside_jit():
    mesh = _mesh()
    abstract = mesh.abstract_mesh
    model = _linear()
    plan = eqshard.plan(model, _ABSTRACT_RULES, mesh=abstract)
    assert plan.mesh == abstract
    assert plan.partition_specs.weight == P(("data", "model"), None)
    assert eqshard.abstract(model, plan).weight.sharding.mesh == abstract
    assert eqshard.expression.sharding("a b -> a2 b4", (8, 16), mesh=abstract).spec == P(
        "data", "model"
    )

    @jax.jit
    def step(model, x):
        return eqshard.constrain(model, plan), eqshard.constrain(
            x * 2, "a b -> a2 b4", mesh=abstract
        )

    with jax.set_mesh(mesh):
        constrained, y = step(model, jnp.ones((8, 16)))
    assert constrained.weight.sharding.is_equivalent_to(
        NamedSharding(mesh, P(("data", "model"))), 2
    )
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "model")), 2)


# --------------------------------------------------------------------------- #
# Spec files: a declared mesh, and logical axes.
# --------------------------------------------------------------------------- #


class Block(eqx.Module):
    qkv: Float[Array, "embed heads"]
    out: Float[Array, "heads embed"]
    up: Float[Array, "embed mlp"]
    norm: Float[Array, " embed"]

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.qkv = jax.random.normal(k1, (16, 32))
        self.out = jax.random.normal(k2, (32, 16))
        self.up = jax.random.normal(k3, (16, 64))
        self.norm = jnp.ones(16)


LOGICAL = {
    "eqshard": 1,
    "mesh": [["data", "*"], ["model", 4]],
    "dims": {"heads": "model", "mlp": "model"},
}


def test_a_declared_mesh_is_built_and_logical_dims_use_its_names():
    rules = eqshard.load(LOGICAL)
    p = eqshard.plan(Block(jax.random.key(0)), rules)
    assert p.mesh is not None
    assert dict(p.mesh.shape) == {"data": 2, "model": 4}
    assert p.partition_specs.qkv == P(None, "model")
    assert p.partition_specs.out == P("model", None)
    assert p.partition_specs.norm == P()
    assert str(p.expressions.qkv) == "embed heads -> 2 heads4 embed"
    placed = eqshard.apply(Block(jax.random.key(0)), rules)
    assert placed.up.sharding == NamedSharding(p.mesh, P(None, "model"))
    on4 = eqshard.plan(Block(jax.random.key(0)), rules, devices=jax.devices()[:4])
    assert on4.mesh is not None
    assert dict(on4.mesh.shape) == {"data": 1, "model": 4}
    with pytest.raises(
        SpecError,
        match=r"::\$\.mesh: the mesh \('data': \*, 'model': 4\) needs a multiple of 4 devices, and the spec is laid out on 6",
    ):
        eqshard.plan(Block(jax.random.key(0)), rules, devices=jax.devices()[:6])


def test_the_users_mesh_wins_over_the_declared_one():
    mesh = _mesh((4, 2), ("data", "model"))
    p = eqshard.plan(Block(jax.random.key(0)), eqshard.load(LOGICAL), mesh=mesh)
    assert p.mesh is mesh
    assert str(p.expressions.qkv) == "embed heads -> 4 heads2 embed"


def test_logical_dims_need_a_mesh_and_one_dim_per_axis():
    no_mesh = eqshard.load({"eqshard": 1, "dims": {"heads": "model"}})
    with pytest.raises(SpecError) as info:
        eqshard.plan(Block(jax.random.key(0)), no_mesh)
    assert [p.where for p in info.value.problems] == ["qkv (Block.qkv)", "out (Block.out)"]
    assert "maps 'heads' to the mesh axis 'model', and there is no mesh" in str(info.value)
    both = eqshard.load({**LOGICAL, "dims": {"heads": "model", "embed": "model"}})
    with pytest.raises(SpecError) as info:
        eqshard.plan(Block(jax.random.key(0)), both)
    assert "map both 'embed' and 'heads' of this leaf to the mesh axis 'model'" in str(info.value)
    unknown = eqshard.load({**LOGICAL, "dims": {"heads": "tensor"}})
    with pytest.raises(SpecError, match="the mesh has the axes 'data', 'model'; name one"):
        eqshard.plan(Block(jax.random.key(0)), unknown)


REFUSED = (
    "the mesh ('data': *, 'model': 4) needs a multiple of 4 devices, and the spec is laid "
    'out on 6; use a multiple of 4 devices, or change "mesh"'
)


@pytest.mark.parametrize(
    "spec",
    [
        LOGICAL,
        {
            **LOGICAL,
            "dims": {"heads": "model", "embed": None},
            "rules": [{"path": "qkv", "dims": "embed heads"}],
        },
        {**LOGICAL, "optimizer": {"dims": {"heads": "model"}}},
    ],
    ids=["dims", "a rule's dims", "the optimizer section's dims"],
)
def test_a_mesh_the_device_count_refuses_is_the_one_problem(spec):
    """Its logical dims cannot be laid out, and were each a second problem: "there is no
    mesh; declare "mesh"", where the file declares one."""
    with pytest.raises(SpecError) as info:
        eqshard.plan(Block(jax.random.key(0)), eqshard.load(spec), devices=jax.devices()[:6])
    assert [(p.where, p.message) for p in info.value.problems] == [("<mapping>::$.mesh", REFUSED)]


def test_spec_tree_lays_logical_dims_out_on_the_declared_mesh():
    """As `plan` does: it said "there is no mesh; declare "mesh"" of a file declaring one,
    and of one the device count refuses, which is now the one problem."""
    tree = eqshard.spec_tree(Block(jax.random.key(0)), eqshard.load(LOGICAL))
    assert str(tree.qkv) == "embed heads -> 2 heads4 embed"
    refused = eqshard.load({**LOGICAL, "mesh": [["data", "*"], ["model", 3]]})
    with pytest.raises(SpecError) as info:
        eqshard.spec_tree(Block(jax.random.key(0)), refused)
    assert [p.where for p in info.value.problems] == ["<mapping>::$.mesh"]
    assert "needs a multiple of 3 devices, and the spec is laid out on 8" in str(info.value)


def test_check_says_only_that_the_mesh_does_not_fit(run_cli, tmp_path):
    spec = tmp_path / "logical.eqshard.json"
    spec.write_text(json.dumps(LOGICAL))
    model = tmp_path / "block_model.py"
    model.write_text(
        "import jax\nfrom test_mesh import Block\n\ndef build():\n    return Block(jax.random.key(0))\n"
    )
    result = run_cli("check", spec, "--model", f"{model}:build", "--device-counts", "6")
    assert result.code == 1, result.err
    assert [line for line in result.out.splitlines() if "::" in line] == [
        f"{spec}::$.mesh: {REFUSED}"
    ]
    assert "there is no mesh" not in result.out + result.err


def test_check_verifies_layouts_against_the_declared_mesh(run_cli, tmp_path):
    spec = tmp_path / "logical.eqshard.json"
    spec.write_text(json.dumps({**LOGICAL, "rules": [{"path": "up", "expr": "a b -> a4 b2"}]}))
    model = tmp_path / "block_model.py"
    model.write_text(
        "import jax\nfrom test_mesh import Block\n\ndef build():\n    return Block(jax.random.key(0))\n"
    )
    result = run_cli(
        "check", spec, "--model", f"{model}:build", "--device-counts", "8", "--format", "json"
    )
    assert result.code == 1, result.err
    [check] = json.loads(result.out)["checks"]
    assert [p["where"] for p in check["problems"]] == ["up (Block.up)"]
    assert "does not fit the mesh ('data': 2, 'model': 4)" in check["problems"][0]["message"]
    by_path = {leaf["path"]: leaf["partition_spec"] for leaf in check["leaves"]}
    assert by_path["qkv"] == "P(None, 'model')"
