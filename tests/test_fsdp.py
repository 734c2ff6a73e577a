"""FSDP in one word: `"default": "fsdp"`, a rule's `"expr": "fsdp"`, `eqshard.FSDP`.

Each leaf's layout is checked device by device: the block each device holds, by
its place in the plan's mesh, and its values against the input's."""

import json
import pickle
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P
from jaxtyping import Array, Float

import eqshard
from eqshard._demo import _model as _demo_model, _run as _demo
from eqshard.testing import assert_layouts

ROOT = Path(__file__).parent.parent


def _numbered(model):
    """`model` with distinct values in every array leaf, so a misplaced block shows."""

    def numbered(x):
        if not eqx.is_array(x):
            return x
        return jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) + x.size

    return jax.tree.map(numbered, model)


def _check_blocks(placed, original, mesh, dim, data_place):
    """Device `p` of `mesh` (row-major) holds piece `data_place(p)` of `dim` of
    `original`, all of every other dim, bit for bit; `dim=None`: all of it."""
    order = list(mesh.devices.flat)
    count = 1 + max(data_place(p) for p in range(len(order)))
    assert len(placed.addressable_shards) == len(order)
    for shard in placed.addressable_shards:
        want = [slice(None)] * original.ndim
        if dim is not None:
            size = original.shape[dim] // count
            part = data_place(order.index(shard.device))
            want[dim] = slice(part * size, (part + 1) * size)
        got = [s.indices(n) for s, n in zip(shard.index, original.shape)]
        assert got == [s.indices(n) for s, n in zip(want, original.shape)]
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(original)[tuple(want)])


def _layouts(plan):
    """Each array leaf's path: (its expression, where it came from)."""
    rows = eqshard.report(plan.resolved.model, plan).rows
    return {row.path: (row.expression, row.origin) for row in rows}


def test_mlp_without_a_mesh_splits_each_leaf_over_every_device():
    mlp = _numbered(eqx.nn.MLP(12, 3, 40, 2, key=jax.random.key(0)))
    plan = eqshard.plan(mlp, eqshard.FSDP)
    replicated = "fsdp: replicated, no dim of [3] is a multiple of 8"
    assert _layouts(plan) == {
        "layers.0.weight": ("d ... -> d* ...", "fsdp"),  # [40, 12]: 40 the only one
        "layers.0.bias": ("... d -> ... d*", "fsdp"),
        "layers.1.weight": ("... d -> ... d*", "fsdp"),  # [40, 40]: the last of equals
        "layers.1.bias": ("... d -> ... d*", "fsdp"),
        "layers.2.weight": ("... d -> ... d*", "fsdp"),  # [3, 40]
        "layers.2.bias": ("... -> * ...", replicated),  # [3]
    }
    placed = eqshard.apply(mlp, plan)
    assert plan.mesh is not None
    every = lambda p: p  # noqa: E731 - device p holds piece p
    for layer, dim in ((0, 0), (1, 1), (2, 1)):
        original = mlp.layers[layer]
        _check_blocks(placed.layers[layer].weight, original.weight, plan.mesh, dim, every)
    _check_blocks(placed.layers[0].bias, mlp.layers[0].bias, plan.mesh, 0, every)
    _check_blocks(placed.layers[2].bias, mlp.layers[2].bias, plan.mesh, None, every)
    # `init` builds straight into the same layouts
    built = eqshard.init(lambda: eqx.nn.MLP(12, 3, 40, 2, key=jax.random.key(0)), eqshard.FSDP)
    specs = jax.tree.leaves(plan.partition_specs, is_leaf=lambda x: isinstance(x, P))
    assert [a.sharding.spec for a in jax.tree.leaves(eqx.filter(built, eqx.is_array))] == specs
    # the same model and device count always give the same expressions
    assert _layouts(eqshard.plan(eqx.filter_eval_shape(lambda: mlp), eqshard.FSDP)) == _layouts(
        plan
    )


def test_attention_on_a_declared_data_by_model_mesh(tmp_path):
    spec = tmp_path / "fsdp.eqshard.json"
    mesh = [["data", 2], ["model", 4]]
    spec.write_text(json.dumps({"eqshard": 1, "mesh": mesh, "default": "fsdp"}))
    attention = eqx.nn.MultiheadAttention(
        2, 8, 5, 5, 5, qk_size=3, vo_size=3, use_query_bias=True, use_output_bias=True,
        key=jax.random.key(1),
    )  # fmt: skip
    attention = _numbered(attention)
    plan = eqshard.plan(attention, eqshard.load(spec))
    why = "default (fsdp: replicated, no dim of [5] is a multiple of 2, the size of 'data')"
    assert _layouts(plan) == {
        "query_proj.weight": ("... d -> ... d2 4", "default (fsdp)"),  # [6, 8]
        "query_proj.bias": ("... d -> ... d2 4", "default (fsdp)"),  # [6]
        "key_proj.weight": ("d ... -> d2 ... 4", "default (fsdp)"),  # [6, 5]
        "value_proj.weight": ("d ... -> d2 ... 4", "default (fsdp)"),  # [6, 5]
        "output_proj.weight": ("... d -> ... d2 4", "default (fsdp)"),  # [5, 6]
        "output_proj.bias": ("... -> * ...", why),  # [5]
    }
    assert plan.mesh is not None
    assert dict(zip(plan.mesh.axis_names, plan.mesh.axis_sizes)) == {"data": 2, "model": 4}
    placed = eqshard.apply(attention, plan)
    data = lambda p: p // 4  # noqa: E731 - 'data' is the major axis: devices 0-3, then 4-7
    _check_blocks(placed.query_proj.weight, attention.query_proj.weight, plan.mesh, 1, data)
    _check_blocks(placed.key_proj.weight, attention.key_proj.weight, plan.mesh, 0, data)
    _check_blocks(placed.query_proj.bias, attention.query_proj.bias, plan.mesh, 0, data)
    _check_blocks(placed.output_proj.bias, attention.output_proj.bias, plan.mesh, None, data)


def test_conv_and_a_scalar_on_the_users_mesh_with_data_as_the_minor_axis():
    conv = eqx.nn.Conv2d(16, 3, kernel_size=3, key=jax.random.key(2))  # weight [3, 16, 3, 3]
    model = _numbered({"conv": conv, "scale": jnp.float32(2.0)})
    mesh = jax.make_mesh((4, 2), ("model", "data"), axis_types=(AxisType.Explicit,) * 2)
    plan = eqshard.plan(model, eqshard.FSDP, mesh=mesh)
    assert _layouts(plan) == {
        "conv.weight": ("... d _ __ -> 4 ... d2 _ __", "fsdp"),
        "conv.bias": (  # [3, 1, 1]
            "... -> * ...",
            "fsdp: replicated, no dim of [3, 1, 1] is a multiple of 2, the size of 'data'",
        ),
        "scale": ("... -> * ...", "fsdp: replicated, a scalar"),
    }
    placed = eqshard.apply(model, plan)
    data = lambda p: p % 2  # noqa: E731 - 'data' is the minor axis
    _check_blocks(placed["conv"].weight, model["conv"].weight, mesh, 1, data)
    _check_blocks(placed["conv"].bias, model["conv"].bias, mesh, None, data)
    _check_blocks(placed["scale"], model["scale"], mesh, None, data)
    # a mesh with no 'data' axis: its first axis
    other = eqshard.plan(
        model,
        eqshard.FSDP,
        mesh=jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2),
    )
    assert _layouts(other)["conv.weight"] == ("... d _ __ -> ... d2 _ __ 4", "fsdp")


class Layer(eqx.Module):
    w: Float[Array, "o i"]
    b: Float[Array, " o"]
    odd: Float[Array, " n"]


def test_stacked_layers_never_split_the_layer_axis_and_ties_go_to_the_last_dim():
    def layer(k):
        return Layer(jnp.full((8, 8), k), jnp.full((8,), k), jnp.full((3,), k))

    stack = eqx.filter_vmap(layer)(jnp.arange(32.0))  # w [32, 8, 8]: 32 is the largest
    plan = eqshard.plan({"stack": stack, "cube": jnp.zeros((16, 16, 3))}, eqshard.FSDP)
    past = "fsdp: replicated, no dim of [32, 3] past the stacked layer axis is a multiple of 8"
    assert _layouts(plan) == {
        "cube": ("... d _ -> ... d* _", "fsdp"),  # [16, 16, 3]: the last of equals
        "stack.w": ("... d -> ... d*", "fsdp"),
        "stack.b": ("... d -> ... d*", "fsdp"),
        "stack.odd": ("... -> * ...", past),
    }
    # without the annotation, the layer axis is a dim like any other
    bare = eqshard.plan({"w": jnp.zeros((32, 8, 8))}, eqshard.FSDP)
    assert _layouts(bare) == {"w": ("d ... -> d* ...", "fsdp")}


def test_a_fsdp_rule_beside_ordinary_rules_and_the_default():
    mlp = eqx.nn.MLP(12, 3, 40, 2, key=jax.random.key(0))
    rules = eqshard.load(
        {
            "eqshard": 1,
            "rules": [
                {"path": "layers.2.*", "expr": "fsdp"},
                {"path": "**.bias", "expr": "... -> * ..."},
                {"path": "layers.0.weight", "expr": "o i -> o* i"},
            ],
        }
    )
    assert _layouts(eqshard.plan(mlp, rules)) == {
        "layers.0.weight": ("o i -> o* i", "$.rules[2]"),
        "layers.0.bias": ("... -> * ...", "$.rules[1]"),
        "layers.1.weight": ("... -> * ...", "default"),
        "layers.1.bias": ("... -> * ...", "$.rules[1]"),
        "layers.2.weight": ("... d -> ... d*", "$.rules[0] (fsdp)"),
        "layers.2.bias": (
            "... -> * ...",
            "$.rules[0] (fsdp: replicated, no dim of [3] is a multiple of 8)",
        ),
    }


def test_the_word_round_trips_and_is_checked(tmp_path, run_cli):
    rules = eqshard.Rules((eqshard.Rule("**.w", eqshard.FSDP),), default="fsdp")
    assert rules.rules[0].expr == "fsdp"
    eqshard.dump(rules, tmp_path / "out.eqshard.json")
    document = json.loads((tmp_path / "out.eqshard.json").read_text())
    assert (document["default"], document["rules"]) == ("fsdp", [{"path": "**.w", "expr": "fsdp"}])
    again = eqshard.load(tmp_path / "out.eqshard.json")
    assert (again.default, again.rules) == ("fsdp", rules.rules)
    assert run_cli("validate", tmp_path / "out.eqshard.json").code == 0

    bad = tmp_path / "bad.eqshard.json"
    bad.write_text(
        json.dumps({"eqshard": 1, "default": "shard", "rules": [{"path": "**", "expr": "FSDP"}]})
    )
    result = run_cli("validate", bad)
    assert result.code == 1
    assert f"{bad}::$.default: 'shard' is not one of ['replicate', 'error', 'fsdp']" in result.out
    assert f"{bad}::$.rules[0].expr: 'FSDP': write 'fsdp', in lower case" in result.out
    with pytest.raises(
        eqshard.EqshardError,
        match=r"`Rules.default` is 'replicate', 'error' or 'fsdp' \(or, for the optimizer "
        r"state, 'parameter'\), not 'shard'",
    ):
        eqshard.Rules(default="shard")  # pyright: ignore[reportArgumentType]
    with pytest.raises(eqshard.SpecError, match=r"For FSDP, pass `eqshard.FSDP` as the spec"):
        eqshard.plan({"w": jnp.zeros(8)}, "fsdp")


def test_check_shows_the_concrete_expressions(tmp_path, run_cli):
    spec = tmp_path / "fsdp.eqshard.json"
    spec.write_text(json.dumps({"eqshard": 1, "default": "fsdp"}))
    (tmp_path / "mlp.py").write_text(
        "import equinox as eqx, jax\n"
        "def build():\n"
        "    return eqx.nn.MLP(12, 3, 40, 2, key=jax.random.key(0))\n"
    )
    args = ("check", spec, "--model", f"{tmp_path / 'mlp.py'}:build", "--device-counts", "8")
    result = run_cli(*args, "--format", "json")
    assert result.code == 0, result.out
    (found,) = json.loads(result.out)["checks"]
    leaves = {leaf["path"]: (leaf["expression"], leaf["origin"]) for leaf in found["leaves"]}
    assert leaves["layers.0.weight"] == ("d ... -> d* ...", "default (fsdp)")  # [40, 12]
    assert leaves["layers.2.bias"] == (
        "... -> * ...",
        "default (fsdp: replicated, no dim of [3] is a multiple of 8)",
    )
    assert found["coverage"] == {"rules": 0, "dims": 0, "default": 6, "none": 0}
    text = run_cli(*args).out
    assert "6 array leaves: 0 by rules, 0 by dims, 6 by the default (1 replicated by FSDP: " in text


def test_default_fsdp_reproduces_the_demos_fsdp_strategy():
    """The demo's fsdp spec file says `"default": "fsdp"` (its training step equals
    the unsharded one in tests/test_demo.py); here, it holds what the rule it
    replaced, every leaf's last dim over 'data', held: an eighth of every leaf."""
    spec = eqshard.load(_demo.spec_path("fsdp"))
    assert (spec.default, spec.rules) == ("fsdp", ())
    model = eqx.filter_eval_shape(_demo_model.build)
    last_dim = eqshard.load(
        {
            "eqshard": 1,
            "mesh": [["data", "*"]],
            "default": "error",
            "rules": [{"path": "**", "expr": "... d -> ... d*"}],
        }
    )
    ours, theirs = eqshard.report(model, spec).rows, eqshard.report(model, last_dim).rows
    assert [row.bytes_per_device for row in ours] == [row.bytes_per_device for row in theirs]
    assert all((row.bytes_per_device or 0) * 8 == row.total_bytes for row in ours)
    assert all(row.origin == "default (fsdp)" for row in ours)


@pytest.mark.slow  # `assert_layouts` lays out in a worker process
def test_the_harness_records_which_leaves_fsdp_replicated(tmp_path, monkeypatch):
    assert pickle.loads(pickle.dumps(eqshard.FSDP)) is eqshard.FSDP
    assert repr(eqshard.FSDP) == "eqshard.FSDP"
    golden = tmp_path / "mlp.json"
    monkeypatch.setenv("EQSHARD_UPDATE", "1")
    assert_layouts("harness_models:build", eqshard.FSDP, golden=golden, device_counts=(16,))
    monkeypatch.delenv("EQSHARD_UPDATE")
    leaves = json.loads(golden.read_text())["layouts"]["16"]["leaves"]
    assert leaves["layers.2.weight"] == {  # [8, 32]
        "expression": "... d -> ... d*",
        "partition_spec": "P(None, 'm0')",
        "shape": [8, 32],
        "dtype": "float32",
        "bytes_per_device": 8 * 2 * 4,
    }
    assert leaves["layers.2.bias"]["expression"] == "... -> * ..."
    assert leaves["layers.2.bias"]["origin"] == (
        "fsdp: replicated, no dim of [8] is a multiple of 16"
    )
    assert_layouts("harness_models:build", eqshard.FSDP, golden=golden, device_counts=(16,))
