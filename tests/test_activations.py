"""Activations by logical name: `eqshard.use(rules)` and `eqshard.constrain(x, names)`,
through the same `dims` and mesh as the parameters. Checked device by device, in the
jaxpr, in the compiled step and in `cost`."""

import json
import runpy
import threading
from pathlib import Path

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

import eqshard
from eqshard import EqshardError, SpecError

EXAMPLES = Path(__file__).parent.parent / "examples"
MESH = [["data", "*"], ["model", 4]]
DIMS = {"batch": "data", "seq": None, "embed": "model"}
NAMES = ("batch", "seq", "embed")


def _rules(dims=DIMS, mesh=MESH, name="acts.eqshard.json", folder=None):
    document = {"eqshard": 1, "dims": dims, **({"mesh": mesh} if mesh else {})}
    if folder is None:
        return eqshard.load(document)
    path = folder / name
    path.write_text(json.dumps(document))
    return eqshard.load(path)


def _x(shape=(8, 16, 32)):
    return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)


def _blocks(sharding, shape):
    """{device id: block bounds}: what every device holds."""
    return {
        device.id: tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(i, shape))
        for device, i in sharding.devices_indices_map(tuple(shape)).items()
    }


def _constraints(jaxpr):
    """The shardings of every sharding constraint in a jaxpr, sub-jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            found.append(eqn.params["sharding"])
        for value in eqn.params.values():  # the sub-jaxprs: of pjit, scan, cond, ...
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _constraints(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += _constraints(sub)
    return found


# --------------------------------------------------------------------------- #
# Names to shardings, device by device.
# --------------------------------------------------------------------------- #


class Annotated(eqx.Module):
    w: Float[Array, "embed mlp"]


def test_names_split_over_the_declared_mesh_the_parameters_use():
    rules = _rules(DIMS | {"mlp": "model", "embed": None})
    params = eqshard.plan(Annotated(jnp.ones((32, 64))), rules)
    x = _x()
    with eqshard.use(rules):
        placed = eqshard.constrain(x, ("batch", "seq", "mlp"))
    assert placed.sharding.mesh is params.mesh  # one cached Mesh for both
    assert placed.sharding.spec == P("data", None, "model")
    # device i of the row-major (data 2, model 4) mesh: batch block i // 4, last dim i % 4
    assert _blocks(placed.sharding, x.shape) == {
        i: ((i // 4 * 4, i // 4 * 4 + 4), (0, 16), (i % 4 * 8, i % 4 * 8 + 8)) for i in range(8)
    }
    for shard in placed.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[shard.index])


def test_inside_jit_a_name_constrains_and_none_and_dots_leave_axes_free():
    rules = _rules()

    def f(x):
        return eqshard.constrain(x, (..., None, "embed")) * 2

    with eqshard.use(rules):
        jaxpr = jax.make_jaxpr(f)(_x((2, 8, 16, 32)))
        out = jax.jit(lambda x: eqshard.constrain(x, NAMES) + 1)(_x())
    (sharding,) = _constraints(jaxpr.jaxpr)
    assert sharding.spec == P(P.UNCONSTRAINED, P.UNCONSTRAINED, P.UNCONSTRAINED, "model")
    assert dict(sharding.mesh.shape) == {"data": 2, "model": 4}
    assert out.sharding.spec == P("data", None, "model")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_x()) + 1)


def test_under_vmap_the_dots_stand_for_no_axis_and_the_batch_is_left_free():
    with eqshard.use(_rules()):
        jaxpr = jax.make_jaxpr(jax.vmap(lambda v: eqshard.constrain(v, (..., "seq", "embed"))))(
            _x()
        )
    (sharding,) = _constraints(jaxpr.jaxpr)
    assert sharding.spec == P(P.UNCONSTRAINED, None, "model")


def test_modifiers_split_over_every_device_on_the_mesh_or_their_own():
    x = _x()
    with eqshard.use(_rules({"batch": "*", "seq": None, "embed": None})):
        on_mesh = eqshard.constrain(x, NAMES)
    assert on_mesh.sharding.spec == P(("data", "model"), None, None)
    with eqshard.use(_rules({"batch": "*", "seq": None, "embed": None}, mesh=None)):
        alone = eqshard.constrain(x, NAMES)
    expected = eqshard.expression.sharding("batch seq embed -> batch* seq embed", x.shape)
    assert _blocks(alone.sharding, x.shape) == _blocks(expected, x.shape)
    assert _blocks(on_mesh.sharding, x.shape) == _blocks(expected, x.shape)


def test_the_users_mesh_wins_and_explicit_axes_are_resharded():
    x = _x()
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(auto), eqshard.use(_rules()):
        placed = eqshard.constrain(x, NAMES)
        inside = jax.jit(lambda v: eqshard.constrain(v, NAMES) * 1)(x)
    assert placed.sharding == NamedSharding(auto, P("data", None, "model"))
    assert inside.sharding.spec == P("data", None, "model")
    assert _blocks(inside.sharding, x.shape) == _blocks(placed.sharding, x.shape)

    explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    seen = {}

    def f(v):
        y = eqshard.constrain(v, (None, "seq", "embed"))  # the free axis keeps 'data'
        seen["spec"] = jax.typeof(y).sharding.spec
        return y

    with jax.set_mesh(explicit), eqshard.use(_rules()):
        held = jax.device_put(x, NamedSharding(explicit, P("data")))
        out = jax.jit(f)(held)
    assert seen["spec"] == P("data", None, "model")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))


# --------------------------------------------------------------------------- #
# No rules, `use`, `rules=`.
# --------------------------------------------------------------------------- #


def test_without_rules_names_change_nothing():
    x = _x()
    assert eqshard.constrain(x, NAMES) is x
    jaxpr = jax.make_jaxpr(lambda v: eqshard.constrain(v, ("anything", "goes", None)))(x)
    assert _constraints(jaxpr.jaxpr) == []
    with eqshard.use(_rules()), eqshard.use(None):
        assert eqshard.constrain(x, NAMES) is x


def test_use_nests_restores_the_outer_rules_and_is_per_thread():
    outer, inner = _rules(), _rules({"batch": None, "seq": None, "embed": "model"})
    x = _x()

    def spec():
        return eqshard.constrain(x, NAMES).sharding.spec

    with eqshard.use(outer) as given:
        assert given is outer
        with eqshard.use(inner):
            assert spec() == P(None, None, "model")
        assert spec() == P("data", None, "model")
        with pytest.raises(RuntimeError, match="inside"), eqshard.use(inner):
            raise RuntimeError("inside")
        assert spec() == P("data", None, "model")
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(eqshard.constrain(x, NAMES)))
        thread.start()
        thread.join()
        assert elsewhere[0] is x  # another thread has no rules
    assert eqshard.constrain(x, NAMES) is x


def test_rules_given_to_constrain_win_over_the_active_ones():
    with eqshard.use(_rules()):
        placed = eqshard.constrain(_x(), NAMES, rules=_rules({"batch": "model"} | DIMS))
    assert placed.sharding.spec == P("data", None, "model")
    other = _rules({"batch": None, "seq": None, "embed": "data"})
    with eqshard.use(_rules()):
        assert eqshard.constrain(_x(), NAMES, rules=other).sharding.spec == P(None, None, "data")


def test_a_jitted_step_is_traced_again_under_other_rules():
    traces = []

    @eqx.filter_jit
    def f(x):
        traces.append(None)
        return eqshard.constrain(x, NAMES) + 1

    x = _x()
    assert not isinstance(f(x).sharding, NamedSharding)
    with eqshard.use(_rules()):
        assert f(x).sharding.spec == P("data", None, "model")
        count = len(traces)
        f(x)
        assert len(traces) == count  # the same rules: the cached trace
        compiled = jax.jit(lambda v: eqshard.constrain(v, NAMES)).lower(x).compile()
    assert not isinstance(f(x).sharding, NamedSharding)  # no rules: as first traced
    assert compiled(x).sharding.spec == P("data", None, "model")  # compiled: keeps them


def test_use_takes_a_plan_and_shares_its_devices():
    rules = _rules(DIMS | {"mlp": "model", "embed": None})
    devices = jax.devices()[4:]  # a declared mesh on the plan's own devices
    params = eqshard.plan(Annotated(jnp.ones((32, 64))), rules, devices=devices)
    with eqshard.use(params):
        out = jax.jit(lambda v: eqshard.constrain(v, ("batch", "seq", "mlp")))(
            jax.device_put(_x((4, 16, 32)), params.replicated())
        )
    assert out.sharding.mesh is params.mesh
    assert set(out.sharding.device_set) == set(devices)
    assert params.mesh is not None
    assert dict(params.mesh.shape) == {"data": 1, "model": 4}


# --------------------------------------------------------------------------- #
# Errors, with their exact text.
# --------------------------------------------------------------------------- #


def test_an_unknown_name_names_it_and_the_files_dims(tmp_path):
    rules = _rules(folder=tmp_path)
    with pytest.raises(SpecError) as info, eqshard.use(rules):
        eqshard.constrain(_x(), ("batch", "sequence", "embed"))
    source = str(tmp_path / "acts.eqshard.json")
    assert str(info.value) == (
        f"`eqshard.constrain` cannot lay out ('batch', 'sequence', 'embed') by {source}:\n"
        f"  {source}::$.dims: ('batch', 'sequence', 'embed') of float32[8, 16, 32] names "
        "'sequence', which $.dims does not map (it maps 'batch', 'seq', 'embed'); map "
        "'sequence' there to a mesh axis, a shard modifier ('*', '4') or null (the dim "
        "whole), or write None for that axis to leave it free"
    )
    assert info.value.problems[0].json_path == "$.dims"
    with pytest.raises(SpecError, match="names 'sequence', which"), eqshard.use(rules):
        jax.jit(lambda v: eqshard.constrain(v, ("batch", "sequence", "embed")))(_x())


def test_two_dims_on_one_mesh_axis_name_both():
    rules = _rules({"batch": "data", "seq": "data", "embed": "model"})
    with pytest.raises(SpecError) as info:
        eqshard.constrain(_x(), NAMES, rules=rules)
    assert str(info.value).splitlines()[1] == (
        "  ('batch', 'seq', 'embed') of float32[8, 16, 32]: <mapping>::$.dims.batch, "
        "$.dims.seq, $.dims.embed map both 'batch' and 'seq' of this array to the mesh "
        "axis 'data'; a mesh axis splits one dim of an array"
    )
    with pytest.raises(SpecError, match=r"'batch' names 2 axes, and <mapping>::\$\.dims\.batch"):
        eqshard.constrain(_x(), ("batch", "batch", None), rules=rules)


@pytest.mark.parametrize(
    ("names", "dims", "mesh", "message"),
    [
        (
            ("batch", "seq"),
            DIMS,
            MESH,
            r"^`eqshard.constrain` names 2 axes of x, \('batch', 'seq'\), and x is "
            r"float32\[8, 16, 32\], of 3; name each axis, with None for one left free, or "
            r"start with \.\.\. for the axes in front$",
        ),
        (
            ("batch", ..., "embed"),
            DIMS,
            MESH,
            r"names the axes of x as \('batch', \.\.\., 'embed'\): each is a dim name \(a letter "
            r"or '_', then letters, '_', digits, '-' or '\.', such as 'embed'\), None \(the axis "
            r"left free\), or \.\.\. \(the axes in front, left free; only first\)$",
        ),
        (("batch", "seq", "1d"), DIMS, MESH, r"left free; not '1d'\)$"),
        (
            NAMES,
            {"batch": "tensor", "seq": None, "embed": None},
            MESH,
            r"maps 'batch' to the mesh axis 'tensor', and the mesh has the axes 'data', "
            "'model'; name one of them",
        ),
        (
            NAMES,
            DIMS,
            None,
            r"maps 'batch' to the mesh axis 'data', and there is no mesh; declare \"mesh\"",
        ),
        (
            NAMES,
            {"batch": "data", "seq": "2", "embed": None},
            MESH,
            "map dims of this array to mesh axes, and other dims of it to shard modifiers",
        ),
        (
            NAMES,
            {"batch": "3*", "seq": None, "embed": None},
            MESH,
            r"'batch seq embed -> batch3\* seq embed', from <mapping>::\$\.dims: ",
        ),
    ],
)
def test_names_that_cannot_be_laid_out_say_why(names, dims, mesh, message):
    with pytest.raises(EqshardError, match=message):
        eqshard.constrain(_x(), names, rules=_rules(dims, mesh))


def test_use_takes_plans_and_rules_only():
    with pytest.raises(
        EqshardError,
        match=r"^`eqshard.use` \(and `constrain`'s `rules=`\) take an `eqshard.Plan`, the `eqshard.Rules` of a spec file \(`eqshard.load\(path\)`\), or None \(no rules\), not str$",
    ):
        eqshard.use("model.eqshard.json")  # pyright: ignore[reportArgumentType]
    x = _x()
    with eqshard.use(eqshard.plan(x, "a b c -> a* b c")):  # no "dims": names mean nothing
        assert eqshard.constrain(x, ("batch", None, None)) is x
    with pytest.raises(EqshardError, match=r"^`rules=` lays out an array whose axes are named"):
        eqshard.constrain(_x(), "a b c -> a* b c", rules=_rules())


# --------------------------------------------------------------------------- #
# `null` in dims: whole, for parameters too.
# --------------------------------------------------------------------------- #


def test_a_null_dim_is_whole_for_parameters_and_the_schema_takes_it(run_cli, tmp_path):
    both = eqshard.plan(Annotated(jnp.ones((32, 64))), _rules({"embed": None, "mlp": "model"}))
    assert str(both.expressions.w) == "embed mlp -> 2 mlp4 embed"
    alone = eqshard.plan(Annotated(jnp.ones((32, 64))), _rules({"embed": None}, mesh=None))
    assert str(alone.expressions.w) == "embed mlp -> * embed mlp"
    assert eqshard.load(_rules({"embed": None}).to_json()).dims == {"embed": None}
    _rules(folder=tmp_path)
    result = run_cli("validate", tmp_path / "acts.eqshard.json")
    assert result.code == 0, result.out + result.err


# --------------------------------------------------------------------------- #
# The stacked GPT, its blocks and logits named: losses, compiled step, cost.
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def gpt():
    return runpy.run_path(str(EXAMPLES / "gpt_stacked.py"), run_name="not_main")


def _gpt_spec(folder, **dims):
    """examples/specs/gpt.eqshard.json with some of its dims changed."""
    document = json.loads((EXAMPLES / "specs" / "gpt.eqshard.json").read_text())
    document["dims"] = document["dims"] | dims
    path = folder / "gpt.eqshard.json"
    path.write_text(json.dumps(document))
    return path


@pytest.mark.slow  # trains sharded and unsharded and compares
def test_whole_logits_train_as_unsharded_and_gather_in_the_compiled_step(gpt, tmp_path):
    result = gpt["main"](steps=2, spec=_gpt_spec(tmp_path, vocab=None))
    np.testing.assert_allclose(result["losses"], result["reference"], rtol=1e-5)
    # the spec file's own dims (vocab-parallel logits) compile to no all-gather: the
    # whole logits are gathered over 'model'
    assert result["collectives"]["all-gather"] >= 1


@pytest.mark.slow  # compiles the GPT's step under each rule set
def test_cost_sees_the_names_of_a_spec_files_rules(gpt):
    model = eqx.filter_eval_shape(gpt["build"])
    optimizer = gpt["optimizer"]()
    state = jax.eval_shape(
        optimizer.init, eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    )
    rules = eqshard.load(gpt["SPEC"])
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def moved(spec):
        step = gpt["make_step"](optimizer)
        return eqshard.cost(
            model, state, gpt["batch"](), step=step, spec=spec, mesh=mesh
        ).bytes_by_axes()

    names_unused = moved(eqshard.spec_tree(model, rules))  # a spec tree: no rules active
    assert moved(rules) == names_unused  # Megatron's layout is what XLA chose anyway
    whole = eqshard.load(rules.to_json() | {"dims": {**rules.dims, "vocab": None}})
    gathered = moved(whole)
    # each 'model' device gathers its data shard's logits: 4 x 16 x 64 float32
    assert gathered[("all-gather", ("model",))] == 4 * 16 * 64 * 4
    assert ("all-gather", ("model",)) not in names_unused


@pytest.mark.slow  # `check --step` compiles the stacked GPT's step, twice
def test_check_step_sees_the_names(run_cli, tmp_path):
    module = str(EXAMPLES / "gpt_stacked.py")
    step = ["--model", f"{module}:build", "--step", f"{module}:step"]
    step += ["--optimizer", f"{module}:optimizer", "--make-batch", f"{module}:batch"]
    spec = _gpt_spec(tmp_path, vocab=None)
    result = run_cli("check", spec, *step, "--device-counts", "8", "--format", "json")
    assert result.code == 0, result.out + result.err
    [check] = json.loads(result.out)["checks"]
    kinds = {(c["kind"], tuple(c["axes"])) for c in check["cost"]["communication"]}
    assert ("all-gather", ("model",)) in kinds
    document = json.loads(spec.read_text())
    del document["dims"]["vocab"]
    spec.write_text(json.dumps(document))
    result = run_cli("check", spec, *step, "--device-counts", "8")
    assert result.code == 1, result.out + result.err
    assert "names 'vocab', which $.dims does not map" in result.out + result.err
