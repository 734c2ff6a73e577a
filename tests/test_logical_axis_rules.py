"""Flax's and MaxText's `logical_axis_rules`, pasted into a spec file, lay out a
Llama-shaped and a Mixtral-shaped parameter set and their activations exactly as
MaxText does, device by device, on eleven 8-device settings of its twelve mesh axes.

The oracle is tests/peers/: MaxText's own rules and mesh axes (base.yml, and
llama2-7b.yml's merge), its parameters' and activations' logical names from its model
code, and the spec each gets from Flax's resolution and MaxText's size-1 handling, as
their code has it (`tests/peers/maxtext_expected.json`, each row citing its source).
The layouts compared here are `NamedSharding(mesh, that spec)` on MaxText's mesh."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

import eqshard

PEERS = Path(__file__).parent / "peers"
EXPECTED = json.loads((PEERS / "maxtext_expected.json").read_text())
AXES: list[str] = EXPECTED["mesh_axes"]


def _spec(rules: str, setting: str, model: str) -> dict[str, Any]:
    """A spec file of MaxText's rules and mesh, a rule per parameter naming its dims as
    MaxText's model code names them."""
    mesh = EXPECTED["settings"][setting]["mesh"]
    params = EXPECTED["models"][model]["params"]
    return {
        "eqshard": 1,
        "mesh": [[axis, mesh[axis]] for axis in AXES],
        "logical_axis_rules": EXPECTED["rule_sets"][rules]["rules"],
        "rules": [
            {"path": _key(path), "dims": " ".join(n or "_" for n in leaf["names"])}
            for path, leaf in params.items()
        ],
    }


def _key(path: str) -> str:
    return path.replace("/", "__")


def _oracle_mesh(setting: str) -> Mesh:
    """MaxText's mesh: every axis of `mesh_axes`, size-1 ones included, over the
    devices in order (eqshard builds a declared mesh row-major over them)."""
    mesh = EXPECTED["settings"][setting]["mesh"]
    return Mesh(np.array(jax.devices()[:8]).reshape([mesh[a] for a in AXES]), tuple(AXES))


def _blocks(sharding: Any, shape: tuple[int, ...]) -> dict[Any, Any]:
    return {
        d: tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape))
        for d, index in sharding.devices_indices_map(shape).items()
    }


def _want(row: dict[str, Any], mesh: Mesh) -> NamedSharding:
    entries = [tuple(e) if isinstance(e, list) else e for e in row["maxtext"]]
    return NamedSharding(mesh, P(*entries))


CASES = sorted({(r["rules"], r["setting"], r["model"]) for r in EXPECTED["expected"]})


@pytest.mark.parametrize(("rules", "setting", "model"), CASES, ids=["-".join(c) for c in CASES])
def test_maxtexts_rules_lay_out_its_parameters_and_activations_as_maxtext_does(
    rules, setting, model
):
    rows = [
        r
        for r in EXPECTED["expected"]
        if (r["rules"], r["setting"], r["model"]) == (rules, setting, model)
    ]
    spec = eqshard.load(_spec(rules, setting, model))
    oracle = _oracle_mesh(setting)
    params = {
        _key(path): jnp.zeros(leaf["shape"])
        for path, leaf in EXPECTED["models"][model]["params"].items()
    }
    placed = eqshard.apply(params, spec)
    checked = 0
    for row in rows:
        shape = tuple(row["shape"])
        if row["kind"] == "param":
            got = placed[_key(row["path"])].sharding
        else:
            with eqshard.use(spec):
                got = eqshard.constrain(jnp.zeros(shape), tuple(row["names"])).sharding
        assert _blocks(got, shape) == _blocks(_want(row, oracle), shape), row
        checked += 1
    assert checked == len(rows) > 0


def test_a_size_one_axis_claimed_first_leaves_a_later_dim_whole():
    """Issue 39's case, as MaxText resolves it: the batch's rule claims `expert`, of
    size 1, so the sequence's rule, which names `expert` too, cannot claim its dim,
    which stays whole; applied one name at a time, the rules would split it over
    `context`."""
    rules = eqshard.load(
        {
            "eqshard": 1,
            "mesh": [["data", 1], ["fsdp", 4], ["context", 2], ["expert", 1]],
            "logical_axis_rules": [
                ["activation_batch", ["data", "fsdp", "expert"]],
                ["activation_length", ["context", "expert"]],
            ],
        }
    )
    x = jnp.zeros((8, 16, 4))
    with eqshard.use(rules):
        got = eqshard.constrain(x, ("activation_batch", "activation_length", None))
    mesh = Mesh(
        np.array(jax.devices()[:8]).reshape(1, 4, 2, 1), ("data", "fsdp", "context", "expert")
    )
    want = NamedSharding(mesh, P("fsdp", None, None))
    assert _blocks(got.sharding, x.shape) == _blocks(want, x.shape)


class Block(eqx.Module):
    """Annotated leaves: their dims named as MaxText names them."""

    kernel: Float[Array, "embed mlp"]
    out: Float[Array, "mlp embed"]
    scale: Float[Array, " norm"]
    table: Float[Array, "dim1 embed"]


def _block() -> Block:
    return Block(jnp.ones((8, 16)), jnp.ones((16, 8)), jnp.ones((8,)), jnp.ones((4, 8)))


def test_annotations_and_dims_beside_the_table():
    """`dims` wins for the names it maps (here `embed`, over two axes in the order
    given, against the mesh's order); the table places the rest in its order, with
    its fallback for `mlp` once `tensor` is taken; `check` says which rule placed
    each dim."""
    rules = eqshard.load(
        {
            "eqshard": 1,
            "mesh": [["data", 2], ["fsdp", 2], ["tensor", 2]],
            "dims": {"embed": ["fsdp", "data"]},
            "logical_axis_rules": [
                ["dim1", "tensor"],
                ["mlp", "tensor"],
                ["mlp", "data"],
                ["norm", None],
            ],
        }
    )
    block = _block()
    p = eqshard.plan(block, rules)
    mesh = p.mesh
    assert mesh is not None
    want = {
        "kernel": P(("fsdp", "data"), "tensor"),
        "out": P("tensor", ("fsdp", "data")),
        "scale": P(),
        "table": P("tensor", ("fsdp", "data")),
    }
    for name, spec in want.items():
        leaf = getattr(block, name)
        got = getattr(p.shardings, name)
        assert _blocks(got, leaf.shape) == _blocks(NamedSharding(mesh, spec), leaf.shape), name
    origins = dict(zip(["kernel", "out", "scale", "table"], p.resolved.origins))
    assert origins["kernel"] == "dims (embed: $.dims; mlp: $.logical_axis_rules[1] (tensor))"
    assert origins["scale"] == "dims (norm: $.logical_axis_rules[3] (whole))"
    assert origins["table"] == "dims (dim1: $.logical_axis_rules[0] (tensor); embed: $.dims)"


def test_a_rule_that_falls_back_when_its_axis_is_taken():
    """Flax's docstring example: `features` finds `X` taken by `batch` and is whole;
    `batch`'s own fallback `Z` is never read."""
    rules = eqshard.Rules(
        logical_axis_rules=[("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z")],
        mesh=(("X", 2), ("Y", 2), ("Z", 2)),
    )
    x = jnp.zeros((4, 3, 4, 6))
    with eqshard.use(rules):
        got = eqshard.constrain(x, ("batch", "length", "heads", "features"))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("X", "Y", "Z"))
    assert _blocks(got.sharding, x.shape) == _blocks(
        NamedSharding(mesh, P("X", None, "Y")), x.shape
    )


def test_a_table_naming_an_axis_the_mesh_lacks_warns():
    rules = eqshard.load(
        {
            "eqshard": 1,
            "mesh": [["fsdp", 8]],
            "logical_axis_rules": [["embed", ["fsdp", "sequence"]], ["mlp", "tensor"]],
        }
    )
    with pytest.warns(
        eqshard.MeshWarning,
        match=r"names the mesh axes 'sequence', 'tensor', which the mesh \('fsdp'\) lacks",
    ):
        p = eqshard.plan(_block(), rules)
    block = _block()  # as MaxText: the missing axes dropped
    assert p.mesh is not None
    want = NamedSharding(p.mesh, P("fsdp", None))
    assert _blocks(p.shardings.kernel, block.kernel.shape) == _blocks(want, block.kernel.shape)


def test_the_table_round_trips_through_dump_and_load(tmp_path):
    table = [["batch", ["data", "fsdp"]], ["embed", "fsdp"], ["norm", None], ["dim1", []]]
    rules = eqshard.load({"eqshard": 1, "logical_axis_rules": table, "dims": {"e-2": ["a", "b"]}})
    path = tmp_path / "t.eqshard.json"
    eqshard.dump(rules, path)
    again = eqshard.load(path)
    assert again.logical_axis_rules == (
        ("batch", ("data", "fsdp")),
        ("embed", ("fsdp",)),
        ("norm", None),
        ("dim1", None),
    )
    assert again.dims == {"e-2": ("a", "b")}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("embed", r"`Rules.logical_axis_rules` is a list of \(logical name, mesh axes\) pairs"),
        ([("embed",)], r"`Rules.logical_axis_rules`\[0\] is a \(logical name, mesh axes\) pair"),
        ([("embed", 3)], r"`Rules.logical_axis_rules`\[0\] \('embed'\) maps it to 3"),
    ],
)
def test_a_bad_table_in_python_is_named(table, message):
    with pytest.raises(eqshard.EqshardError, match=message):
        eqshard.Rules(logical_axis_rules=table)


NAMED_MODULE = """
import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

import eqshard


class Mlp(eqx.Module):
    wi: Float[Array, "embed mlp"]
    wo: Float[Array, "mlp embed"]

    def __call__(self, x):
        x = eqshard.constrain(x, ("activation_batch", "activation_embed"))
        h = eqshard.constrain(x @ self.wi, ("activation_batch", "activation_mlp"))
        return h @ self.wo


def build():
    return Mlp(jnp.ones((16, 32)) / 16, jnp.ones((32, 16)) / 32)


def batch():
    return jnp.ones((8, 16))


def step(model, x):
    return jnp.mean(model(x) ** 2)
"""

TABLE = {
    "eqshard": 1,
    "mesh": [["data", 2], ["fsdp", 2], ["tensor", 2]],
    "logical_axis_rules": [
        ["activation_batch", ["data", "fsdp"]],
        ["activation_mlp", "tensor"],
        ["embed", "fsdp"],
        ["mlp", "tensor"],
    ],
}


def test_check_says_which_rule_placed_each_dim_of_each_leaf_and_activation(run_cli, tmp_path):
    module = tmp_path / "named.py"
    module.write_text(NAMED_MODULE)
    spec = tmp_path / "table.eqshard.json"
    spec.write_text(json.dumps(TABLE))
    args = [
        "--model",
        f"{module}:build",
        "--step",
        f"{module}:step",
        "--make-batch",
        f"{module}:batch",
    ]
    result = run_cli("check", spec, *args, "--device-counts", "8", "--format", "json")
    assert result.code == 0, result.err
    (check,) = json.loads(result.out)["checks"]
    origins = {leaf["path"]: leaf["origin"] for leaf in check["leaves"]}
    assert origins["wi"] == (
        "dims (embed: $.logical_axis_rules[2] (fsdp); mlp: $.logical_axis_rules[3] (tensor))"
    )
    activations = {tuple(a["names"]): a for a in check["cost"]["activations"]}
    hidden = activations[("activation_batch", "activation_mlp")]
    assert hidden["partition_spec"] == "P(('data', 'fsdp'), 'tensor')"
    assert hidden["placed"] == (
        "activation_batch: $.logical_axis_rules[0] (data, fsdp); "
        "activation_mlp: $.logical_axis_rules[1] (tensor)"
    )
    embedded = activations[("activation_batch", "activation_embed")]
    assert embedded["placed"].endswith("activation_embed: whole (no rule)")
    text = run_cli("check", spec, *args, "--device-counts", "8")
    assert (
        "activation ('activation_batch', 'activation_mlp') [8, 32]: P(('data', 'fsdp'), 'tensor'), activation_batch: $.logical_axis_rules[0] (data, fsdp); activation_mlp: $.logical_axis_rules[1] (tensor)"
        in text.out
    )


def test_maxtexts_batch_on_data_fsdp_tensor_is_laid_out_by_its_logical_names():
    """MaxText's most common setting, data x fsdp x tensor: its batch (`inputs`,
    `input_data_sharding_logical_axes`) split over data and fsdp together, as MaxText
    splits it, by a batch rule that names its dims."""
    setting = "data2_fsdp2_tensor2"
    (row,) = [
        r
        for r in EXPECTED["expected"]
        if r["setting"] == setting
        and r["path"] == "inputs"
        and r["rules"] == "base"
        and r["model"] == "llama"
    ]
    spec = _spec("base", setting, "llama")
    spec["batch"] = {"rules": [{"path": "**", "dims": " ".join(row["names"])}]}
    rules = eqshard.load(spec)
    params = {
        _key(path): jnp.zeros(leaf["shape"])
        for path, leaf in EXPECTED["models"]["llama"]["params"].items()
    }
    tokens = jnp.zeros(tuple(row["shape"]), jnp.int32)
    plan = eqshard.plan(params, rules)
    with eqshard.use(plan):
        lowered = eqshard.jit(lambda p, t: t.sum()).lower(params, tokens)
    got = lowered.in_shardings[-1]
    want = _want(row, _oracle_mesh(setting))
    assert row["maxtext"][0] == ["data", "fsdp"]
    assert _blocks(got, tokens.shape) == _blocks(want, tokens.shape)


def test_a_batch_rule_naming_a_dim_no_entry_maps_is_refused():
    with pytest.raises(
        eqshard.SpecError,
        match=r"\$\.batch\.rules\[0\]\.dims: `tokens`, which neither \$\.dims nor \$\.logical_axis_rules maps",
    ):
        eqshard.load(
            {
                "eqshard": 1,
                "logical_axis_rules": [["batch", "data"]],
                "batch": {"rules": [{"path": "**", "dims": "batch tokens"}]},
            }
        )
