"""Layouts without devices: `devices=` a count plans on an `AbstractMesh`.

A plan for a count gives every leaf the `PartitionSpec`, mesh and bytes per
device of the plan on that many real devices (checked on 8 and 6 here, device by
device), so `eqshard check` and golden files need no simulated devices; placing
or compiling with it is refused, saying what to pass instead.
"""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P
from llama_model import COLUMNS, DIM, HIDDEN, LAYERS, LLAMA_SPEC, ROWS, VOCAB, build

import eqshard
from eqshard import EqshardError
from eqshard._demo._model import build as build_demo
from eqshard._plan import plan_faults
from eqshard._report import leaf_rows

ROOT = Path(__file__).parent.parent
SPECS = ROOT / "examples" / "specs"
TRANSFORMER = f"{ROOT / 'examples' / 'transformer.py'}:build"
GPT = f"{ROOT / 'examples' / 'gpt_stacked.py'}:build"
LLAMA = f"{Path(__file__).parent / 'llama_model.py'}:build"

# Specs that lay out, misfit their mesh, name the wrong device count, leave rules
# unused and leaves unmatched: what each says must not depend on devices.
FAULTY = {
    "eqshard": 1,
    "devices": 4,
    "mesh": [["data", 2], ["model", "*"]],
    "default": "error",
    "rules": [
        {"path": "**.up.weight", "expr": "o i -> o4 i2"},
        {"path": "**.attn.query_proj.weight", "expr": "o i -> o* i"},
        {"path": "**.attn.nothing.weight", "expr": "o i -> o* i"},
        {"path": "embed.weight", "expr": "v d -> v d 3"},
    ],
}
DISAGREEING = {
    "eqshard": 1,
    "rules": [
        {"path": "**.up.weight", "expr": "o i -> o2 i4"},
        {"path": "**.down.weight", "expr": "o i -> o4 i2"},
    ],
}


def _pairs(tmp_path):
    """(spec file, model) pairs: the repository's spec files, and faulty ones."""
    for name, spec in (("faulty", FAULTY), ("disagreeing", DISAGREEING)):
        (tmp_path / f"{name}.eqshard.json").write_text(json.dumps(spec))
    return [
        (SPECS / "transformer.eqshard.json", TRANSFORMER),
        (SPECS / "gpt.eqshard.json", GPT),
        *((path, "eqshard._demo._model:build") for path in sorted((SPECS / "demo").glob("*.json"))),
        *((path, TRANSFORMER) for path in sorted((ROOT / "tests/specs/valid").glob("*.json"))),
        (tmp_path / "faulty.eqshard.json", TRANSFORMER),
        (tmp_path / "disagreeing.eqshard.json", TRANSFORMER),
    ]


def _lay_out_on_devices(monkeypatch):
    """From here on, `eqshard check` lays out as it did before: on the first n real
    devices, not on an abstract mesh."""
    import eqshard._plan

    abstract = eqshard._plan.plan_faults
    meshes = []  # each plan's mesh, to show that they had devices

    def on_devices(model, spec, *, devices=None, **kwargs):
        if isinstance(devices, int):
            devices = jax.devices()[:devices]
        planned = abstract(model, spec, devices=devices, **kwargs)
        meshes.append(planned.plan.mesh)
        return planned

    monkeypatch.setattr(eqshard._plan, "plan_faults", on_devices)
    return meshes


def test_check_says_the_same_with_devices_and_without(run_cli, tmp_path, monkeypatch):
    pairs = _pairs(tmp_path)
    abstract = []
    for spec, model in pairs:
        result = run_cli("check", spec, "--model", model, "--device-counts", 8, "--format", "json")
        abstract.append((result.code, json.loads(result.out)))
    assert {code for code, _ in abstract} == {0, 1}  # some fit, some do not
    faulty = abstract[-2][1]["checks"][0]
    assert len(faulty["problems"]) >= 4
    assert faulty["warnings"]
    assert abstract[-1][1]["checks"][0]["warnings"][0]["message"].startswith(
        "the layouts group the devices in ways that disagree"
    )
    meshes = _lay_out_on_devices(monkeypatch)
    for (spec, model), (code, document) in zip(pairs, abstract):
        result = run_cli("check", spec, "--model", model, "--device-counts", 8, "--format", "json")
        assert (result.code, json.loads(result.out)) == (code, document), spec
    assert len(meshes) == len(pairs)
    assert all(isinstance(m, Mesh) for m in meshes)


def _leaf_specs(plan):
    return [s.spec for s in plan.flat_shardings if s is not None]


@pytest.mark.parametrize(
    ("spec", "build_model"),
    [
        (SPECS / "demo" / "2d.eqshard.json", build_demo),
        (SPECS / "demo" / "megatron.eqshard.json", build_demo),
        (SPECS / "demo" / "fsdp.eqshard.json", build_demo),
        (SPECS / "transformer.eqshard.json", None),
    ],
)
def test_an_abstract_plan_gives_every_device_the_blocks_a_concrete_one_does(spec, build_model):
    if build_model is None:
        import runpy

        build_model = runpy.run_path(TRANSFORMER.rsplit(":", 1)[0])["build"]
    model = eqx.filter_eval_shape(build_model)
    rules = eqshard.load(spec)
    concrete = eqshard.plan(model, rules, devices=jax.devices())
    abstract = eqshard.plan(model, rules, simulate=8)
    assert isinstance(concrete.mesh, Mesh)
    assert isinstance(abstract.mesh, AbstractMesh)
    assert list(concrete.mesh.devices.flat) == jax.devices()  # einshard's device i
    assert abstract.mesh.axis_names == concrete.mesh.axis_names
    assert abstract.mesh.axis_sizes == concrete.mesh.axis_sizes
    assert abstract.mesh.axis_types == concrete.mesh.axis_types  # Auto alike
    assert _leaf_specs(abstract) == _leaf_specs(concrete)
    leaves = jax.tree_util.tree_leaves(model)
    for leaf, a, c in zip(leaves, abstract.flat_shardings, concrete.flat_shardings):
        if c is None or a is None:
            assert a is c
            continue
        on_devices = NamedSharding(concrete.mesh, a.spec)  # the abstract spec, placed
        assert on_devices.devices_indices_map(leaf.shape) == c.devices_indices_map(leaf.shape)
        assert a.shard_shape(leaf.shape) == c.shard_shape(leaf.shape)
    assert leaf_rows(abstract) == leaf_rows(concrete)


def test_without_a_shared_mesh_each_expression_keeps_its_own_abstract_mesh():
    # On 6 devices, (2, 3) and (3, 2) splits share no mesh: 2 does not divide 3.
    tree = {"a": jnp.zeros((6, 6)), "b": jnp.zeros((6, 6))}
    spec = {"a": "x y -> x2 y3", "b": "x y -> x3 y2"}
    concrete = plan_faults(tree, spec, devices=jax.devices()[:6]).plan
    abstract = plan_faults(tree, spec, devices=6).plan
    assert concrete.mesh is None
    assert abstract.mesh is None
    for a, c in zip(abstract.flat_shardings, concrete.flat_shardings):
        assert a is not None
        assert c is not None
        assert isinstance(a.mesh, AbstractMesh)
        assert a.mesh.shape == c.mesh.shape
        assert a.spec == c.spec
    assert isinstance(abstract.replicated().mesh, AbstractMesh)
    placed = eqshard.apply(tree, abstract)  # on the first 6 devices, as `devices=6`
    for name, x in placed.items():
        assert x.sharding == concrete.shardings[name]


def test_a_llama_shaped_model_on_65536_devices():
    model = eqx.filter_eval_shape(build)  # 8 billion parameters, abstract
    plan = eqshard.plan(model, eqshard.load(LLAMA_SPEC), simulate=65536)
    assert plan.devices == 65536
    assert plan.mesh == AbstractMesh(
        (4096, 16), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto)
    )
    specs = plan.partition_specs
    for name in COLUMNS:
        assert getattr(specs.layers, name).weight == P(None, "model", "data")
    for name in ROWS:
        assert getattr(specs.layers, name).weight == P(None, "data", "model")
    assert specs.embed.weight == specs.head.weight == P("model", "data")
    assert specs.layers.attention_norm.weight == P()  # replicated
    rows = {row.path: row for row in eqshard.report(model, plan).rows}
    assert rows["layers.q.weight"].bytes_per_device == LAYERS * DIM * DIM * 2 // 65536  # bf16
    assert rows["layers.down.weight"].bytes_per_device == LAYERS * HIDDEN * DIM * 2 // 65536
    assert rows["embed.weight"].bytes_per_device == VOCAB // 16 * DIM // 4096 * 2
    assert rows["norm.weight"].bytes_per_device == DIM * 2
    assert rows["embed.weight"].partition_spec == "P('model', 'data')"
    abstract = eqshard.abstract(model, plan)
    assert abstract.layers.up.weight.sharding == plan.shardings.layers.up.weight
    assert abstract.layers.up.weight.sharding.shard_shape((LAYERS, HIDDEN, DIM)) == (32, 896, 1)


@pytest.mark.slow  # a fresh interpreter: imports JAX and compiles
def test_check_on_65536_devices_from_the_command_line(run_python, tmp_path):
    spec = tmp_path / "llama.eqshard.json"
    spec.write_text(json.dumps(LLAMA_SPEC))
    command = ["-m", "eqshard", "check", spec, "--model", LLAMA, "--device-counts", "8", "65536"]
    result = run_python([*map(str, command), "--format", "json"])
    assert result.returncode == 1, result.stderr  # on 8 devices, 'model' 16 does not fit
    eight, many = json.loads(result.stdout)["checks"]
    assert eight["problems"][0]["message"].startswith(
        "the mesh ('data': *, 'model': 16) needs a multiple of 16 devices"
    )
    assert many["ok"]
    assert many["devices"] == 65536
    assert not many["problems"]
    leaves = {leaf["path"]: leaf for leaf in many["leaves"]}
    assert leaves["layers.q.weight"]["partition_spec"] == "P(None, 'model', 'data')"
    assert leaves["layers.q.weight"]["bytes_per_device"] == LAYERS * DIM * DIM * 2 // 65536
    assert many["bytes_per_device"] == sum(leaf["bytes_per_device"] for leaf in leaves.values())


def test_an_abstract_plan_serves_jit_where_a_mesh_is_set():
    model = eqx.nn.Linear(8, 16, key=jax.random.key(0))
    rules = eqshard.load({"eqshard": 1, "rules": [{"path": "weight", "expr": "o i -> o2 i4"}]})
    plan = eqshard.plan(model, rules, simulate=8)
    assert plan.partition_specs.weight == P("m0", "m1")
    mesh = jax.make_mesh((2, 4), ("m0", "m1"), axis_types=(AxisType.Auto,) * 2)

    @jax.jit
    def step(model):
        return eqshard.constrain(jax.tree.map(lambda x: 2 * x, model), plan)

    with jax.set_mesh(mesh):
        doubled = step(model)
        copied = jax.jit(lambda m: m, out_shardings=plan.shardings)(model)
    want = NamedSharding(mesh, P("m0", "m1"))
    assert doubled.weight.sharding.is_equivalent_to(want, 2)
    assert copied.weight.sharding.is_equivalent_to(want, 2)
    assert jnp.array_equal(doubled.weight, 2 * model.weight)


_LINEAR_RULES = {"eqshard": 1, "rules": [{"path": "weight", "expr": "o i -> o* i"}]}


def _linear():
    return eqx.nn.Linear(8, 16, key=jax.random.key(0))


@pytest.mark.parametrize(
    ("what", "call"),
    [
        ("apply", lambda plan, path: eqshard.apply(_linear(), plan)),
        ("constrain", lambda plan, path: eqshard.constrain(_linear(), plan)),
        ("init", lambda plan, path: eqshard.init(_linear, plan)),
        ("restore", lambda plan, path: eqshard.restore(path, _linear(), plan)),
        (
            "cost",
            lambda plan, path: eqshard.cost(
                _linear(),
                jnp.ones((8, 8)),
                step=eqx.filter_jit(lambda model, x: jax.vmap(model)(x).sum()),
                spec=plan,
            ),
        ),
    ],
)
def test_placing_with_a_plan_for_a_count_uses_the_first_n_devices(what, call, tmp_path):
    eqx.tree_serialise_leaves(tmp_path / "linear.eqx", _linear())
    rules = eqshard.load(_LINEAR_RULES)
    counted = eqshard.plan(_linear(), rules, simulate=4)
    on_devices = eqshard.plan(_linear(), rules, devices=jax.devices()[:4])
    result = call(counted, tmp_path / "linear.eqx")
    if what == "cost":  # what it compiled for: 4 devices, split as on those devices
        assert result.devices == 4
        assert result.memory.parameters == call(on_devices, None).memory.parameters
        return
    assert result.weight.sharding == on_devices.shardings.weight
    assert np.array_equal(np.asarray(result.weight), np.asarray(_linear().weight))


def test_a_count_is_a_whole_number_a_sharding_can_describe():
    for count, message in [
        (0, r"`simulate` is a whole number from 1, not 0"),
        (True, r"`simulate` is a whole number from 1, not True"),
        (2**31, r"`simulate` is 2147483648, more than 2147483647, the most devices a JAX"),
    ]:
        with pytest.raises(EqshardError, match=f"^{message}"):
            eqshard.plan(_linear(), "... -> * ...", simulate=count)
    with pytest.raises(EqshardError, match=r"^`devices` is a list of JAX devices, .* or a device"):
        eqshard.plan(_linear(), "... -> * ...", devices=2.0)  # pyright: ignore
    sharding = eqshard.expression.sharding("a b -> a2* b", (65536 * 2, 16), simulate=65536)
    assert sharding.mesh == AbstractMesh((65536, 1), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    assert sharding.shard_shape((65536 * 2, 16)) == (2, 16)


def test_check_refuses_a_count_no_sharding_can_describe(run_cli, tmp_path):
    spec = tmp_path / "llama.eqshard.json"
    spec.write_text(json.dumps(LLAMA_SPEC))
    result = run_cli("check", spec, "--model", LLAMA, "--device-counts", 2**31)
    assert result.code == 2
    assert (
        "argument --device-counts: '2147483648' is more than 2147483647 devices, the most a JAX "
        "sharding can describe"
    ) in result.err
