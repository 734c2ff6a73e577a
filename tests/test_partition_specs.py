"""JAX's own layouts as spec leaves: a `PartitionSpec` on the plan's mesh, or a
`NamedSharding`. The oracle is JAX: each leaf is laid out device by device as
`jax.device_put(x, NamedSharding(mesh, spec))` lays it out, and the expression it is
written as says the same."""

from __future__ import annotations

import itertools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


def _mesh(shape=(4, 2), names=("data", "model"), kind=AxisType.Auto):
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def _blocks(sharding, shape):
    return sharding.devices_indices_map(tuple(shape))


@pytest.mark.parametrize(
    ("mesh_shape", "names", "spec", "shape", "expression"),
    [
        ((4, 2), ("data", "model"), P("data", None), (8, 4), "data a -> data4 2 a"),
        ((4, 2), ("data", "model"), P(None, "model"), (8, 4), "a model -> 4 model2 a"),
        ((4, 2), ("data", "model"), P(("data", "model")), (16,), "(data model) -> data4 model2"),
        ((4, 2), ("data", "model"), P(("model", "data")), (16,), "(model data) -> data4 model2"),
        ((4, 2), ("data", "model"), P(), (8, 4), "a b -> 8 a b"),
        ((4, 2), ("data", "model"), P(), (), "... -> 8 ..."),
        # MaxText's embed over fsdp and expert, with tensor between them
        (
            (2, 2, 2),
            ("fsdp", "tensor", "expert"),
            P(("fsdp", "expert"), "tensor"),
            (8, 4),
            "(fsdp expert) tensor -> fsdp2 tensor2 expert2",
        ),
        # size-1 axes, as MaxText's mesh has many
        (
            (1, 8, 1),
            ("data", "fsdp", "tensor"),
            P("fsdp", "tensor"),
            (8, 4),
            "fsdp tensor -> fsdp8 tensor",
        ),
        # a mesh axis name that is no einshard name
        ((4, 2), ("x0", "x1"), P("x1", "x0"), (8, 8), "'x1' 'x0' -> 'x0'4 'x1'2"),
        ((4, 2), ("x 0", "x1"), P("x1", "x 0"), (8, 8), "b a -> a4 b2"),
    ],
)
def test_a_partition_spec_is_laid_out_as_jax_lays_it_out(
    mesh_shape, names, spec, shape, expression
):
    mesh = _mesh(mesh_shape, names)
    x = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape)
    p = eqshard.plan(x, spec, mesh=mesh)
    assert str(p.expressions) == expression
    placed = eqshard.apply(x, p)
    want = jax.device_put(x, NamedSharding(mesh, spec))
    assert _blocks(placed.sharding, shape) == _blocks(want.sharding, shape)
    np.testing.assert_array_equal(np.asarray(placed), np.asarray(x))
    # written as the expression, it is the same layout again
    again = eqshard.apply(x, expression, mesh=mesh)
    assert _blocks(again.sharding, shape) == _blocks(want.sharding, shape)


def test_a_spec_tree_mixes_expressions_partition_specs_and_named_shardings():
    mesh = _mesh()
    model = eqx.nn.MLP(16, 16, 32, 2, key=jax.random.key(0))
    spec = jax.tree_util.tree_map(lambda _: None, model)
    spec = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight, m.layers[2].weight),
        spec,
        (P("model", None), P("model"), NamedSharding(mesh, P(None, "model")), "o i -> o i* "),
        is_leaf=lambda x: x is None,
    )
    placed = eqshard.apply(model, spec, mesh=mesh)
    for got, want in [
        (placed.layers[0].weight, P("model", None)),
        (placed.layers[0].bias, P("model")),
        (placed.layers[1].weight, P(None, "model")),
        (placed.layers[1].bias, P()),
    ]:
        expected = NamedSharding(mesh, want)
        assert _blocks(got.sharding, got.shape) == _blocks(expected, got.shape)
    p = eqshard.plan(model, spec, mesh=mesh)
    assert p.resolved.origins[0] == "P('model', None)"
    rows = {row.path: row for row in eqshard.report(model, p).rows}
    assert rows["layers.1.weight"].origin == "NamedSharding(P(None, 'model') on data=4 x model=2)"
    assert str(rows["layers.1.weight"].expression) == "a model -> 4 model2 a"


def test_named_shardings_give_the_plan_their_mesh():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("data", "model"))
    w = jnp.arange(64.0).reshape(8, 8)
    s = NamedSharding(mesh, P("model", "data"))
    p = eqshard.plan(w, s)
    assert p.mesh == mesh  # its devices, in its order
    placed = eqshard.apply(w, p)
    assert _blocks(placed.sharding, w.shape) == _blocks(s, w.shape)


@pytest.mark.parametrize(
    ("spec", "mesh", "message"),
    [
        (
            P("q"),
            True,
            r"splits dim 0 over the mesh axis 'q', and the mesh has the axes 'data', 'model'; name one of them",
        ),
        (
            P("data", "data"),
            True,
            r"splits dims 0 and 1 over the mesh axis 'data'; a mesh axis splits one dim",
        ),
        (P(None, None, None), True, r"has 3 entries, and the leaf has 2 dims"),
        (P(P.UNCONSTRAINED), True, r"leaves dim 0 UNCONSTRAINED: the compiler chooses its layout"),
        (
            P(("data", "model")),
            True,
            r"splits dim 0 \(size 4 of shape \(4, 6\)\) over data=4 x model=2: 8 blocks, which do not divide it",
        ),
        (P("data"), False, r"names mesh axes, and the plan has no mesh; pass `mesh=`"),
    ],
)
def test_a_bad_partition_spec_is_named_with_its_leaf(spec, mesh, message):
    model = eqx.nn.Linear(6, 4, key=jax.random.key(0))
    tree = eqx.tree_at(
        lambda m: m.weight,
        jax.tree_util.tree_map(lambda _: None, model),
        spec,
        is_leaf=lambda x: x is None,
    )
    with pytest.raises(eqshard.SpecError, match=r"weight \(Linear\.weight\): P\(.*\) " + message):
        eqshard.plan(model, tree, mesh=_mesh() if mesh else None)


def test_named_shardings_on_two_meshes_or_another_mesh_are_refused():
    a, b = _mesh(), _mesh((2, 4))
    w = jnp.ones((8, 8))
    with pytest.raises(eqshard.EqshardError, match=r"the spec's NamedShardings are on 2 meshes"):
        eqshard.plan((w, w), (NamedSharding(a, P("data")), NamedSharding(b, P("data"))))
    with pytest.raises(
        eqshard.SpecError, match=r"is on another mesh than the plan's \(data=2 x model=4\)"
    ):
        eqshard.plan(w, NamedSharding(a, P("data")), mesh=b)
    with pytest.raises(
        eqshard.EqshardError, match=r"`devices=` is given, and the spec's NamedShardings hold"
    ):
        eqshard.plan(w, NamedSharding(a, P("data")), devices=8)


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_constrain_takes_a_partition_spec_inside_jit(kind):
    mesh = _mesh(kind=kind)

    @jax.jit
    def f(x):
        return eqshard.constrain(x * 2, P(None, ("model", "data")))

    with jax.set_mesh(mesh):
        y = f(jnp.ones((4, 8)))
    assert _blocks(y.sharding, y.shape) == _blocks(
        NamedSharding(mesh, P(None, ("model", "data"))), y.shape
    )


@pytest.mark.skipif(jax.__version_info__ < (0, 10), reason="host memory kinds: JAX 0.10")
def test_a_named_shardings_memory_kind_is_the_leafs():
    mesh = _mesh()
    w = jnp.ones((8, 8))
    placed = eqshard.apply(w, NamedSharding(mesh, P("data"), memory_kind="pinned_host"))
    assert placed.sharding.memory_kind == "pinned_host"


# The JAX tutorial's MLP ("Distributed arrays and automatic parallelization"), trained
# by a script of PartitionSpecs: its params are a list of (W, b), W split by columns
# over `model`, the batch by rows over `batch`.


def _init(key: Any, sizes: list[int]) -> list[tuple[jax.Array, jax.Array]]:
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for layer, (n_in, n_out) in zip(keys, itertools.pairwise(sizes)):
        k1, k2 = jax.random.split(layer)
        params.append(
            (jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in), jax.random.normal(k2, (n_out,)))
        )
    return params


def _loss(params: Any, batch: Any) -> Any:
    inputs, targets = batch
    outputs = inputs
    for w, b in params:
        outputs = jnp.dot(inputs, w) + b
        inputs = jnp.maximum(outputs, 0)
    return jnp.mean(jnp.sum((outputs - targets) ** 2, axis=-1))


def _train_step(params: Any, batch: Any) -> Any:
    grads = jax.grad(_loss)(params, batch)
    return [(w - 0.1 * dw, b - 0.1 * db) for (w, b), (dw, db) in zip(params, grads)]


def test_a_script_of_partition_specs_trains_unchanged_under_apply_and_jit():
    mesh = _mesh((4, 2), ("batch", "model"))
    params = _init(jax.random.key(0), [16, 32, 32, 8])
    specs = [(P(None, "model"), P("model")) for _ in params]
    x = jax.random.normal(jax.random.key(1), (16, 16))
    y = jax.random.normal(jax.random.key(2), (16, 8))
    batch_spec = (P("batch", None), P("batch", None))
    with jax.default_matmul_precision("highest"):
        # the script as written for JAX
        want = jax.device_put(
            params, jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)
        )
        data = jax.device_put((x, y), tuple(NamedSharding(mesh, s) for s in batch_spec))
        step = jax.jit(_train_step)
        for _ in range(3):
            want = step(want, data)
        # the same specs, given to eqshard
        plan = eqshard.plan(params, specs, mesh=mesh)
        got = eqshard.apply(params, plan)
        for g, s in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(specs)):
            assert _blocks(g.sharding, g.shape) == _blocks(NamedSharding(mesh, s), g.shape)
        with eqshard.use(plan):
            sharded = eqshard.jit(_train_step, batch="b f -> b4 f 2")
            for _ in range(3):
                got = sharded(got, (x, y))
    for g, w, s in zip(
        jax.tree_util.tree_leaves(got),
        jax.tree_util.tree_leaves(want),
        jax.tree_util.tree_leaves(specs),
    ):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
        assert _blocks(g.sharding, g.shape) == _blocks(NamedSharding(mesh, s), g.shape)


def test_a_plan_of_partition_specs_is_dumped_as_expressions_that_load_back(tmp_path):
    mesh = _mesh()
    model = eqx.nn.MLP(16, 16, 32, 2, key=jax.random.key(0))
    spec = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[1].weight),
        jax.tree_util.tree_map(lambda _: None, model),
        (P("model", None), P(None, ("data", "model"))),
        is_leaf=lambda x: x is None,
    )
    p = eqshard.plan(model, spec, mesh=mesh)
    path = tmp_path / "ported.eqshard.json"
    eqshard.dump(p, path)
    text = path.read_text()
    assert '"expr": "model a -> 4 model2 a"' in text
    assert '"expr": "a (data model) -> data4 model2 a"' in text
    again = eqshard.plan(model, eqshard.load(path))  # on the file's mesh, no mesh= given
    shapes = [np.shape(leaf) for leaf in jax.tree_util.tree_leaves(model)]
    for got, want, shape in zip(again.flat_shardings, p.flat_shardings, shapes):
        assert (got is None) == (want is None)  # the activations, functions: no sharding
        if got is not None and want is not None:
            assert _blocks(got, shape) == _blocks(want, shape)
    with pytest.raises(eqshard.SpecError, match=r"dump the plan made with it"):
        eqshard.dump(spec, tmp_path / "tree.eqshard.json")
