"""One meaning per argument across the API: `devices=` is this process's devices (a
count or a list) everywhere, `simulate=` a count of devices it does not have, a spec file comes in as a `pathlib.Path` (a `str` is always an
expression), `step=` is a keyword wherever it is taken, and `dir(eqshard)` lists
the API only."""

import inspect
import json
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
import suggest_model as models

import eqshard
import eqshard.testing

COLUMNS = "... o i -> ... o* i"  # every weight split by its rows
MODEL = models.mlp_build  # eqx.nn.MLP(32, 32, 64, 1): weights and biases, 64 and 32 wide


def _spec_file(folder: Path, name: str, expr: str) -> Path:
    """A spec file for the MLP: its weights laid out by `expr`, the rest replicated."""
    path = folder / f"{name}.eqshard.json"
    rules = {"rules": [{"path": "layers.*.weight", "expr": expr}], "default": "replicate"}
    path.write_text(json.dumps({"eqshard": 1, **rules}))
    return path


@pytest.fixture
def spec_files(tmp_path):
    return _spec_file(tmp_path, "columns", COLUMNS), _spec_file(tmp_path, "rows", "o i -> o i*")


def _mlp():
    return eqx.nn.MLP(16, 16, 32, 2, use_bias=False, use_final_bias=False, key=jax.random.key(0))


def _layouts(tree):
    """Each array leaf's devices and their blocks, by device id."""
    return [
        {d.id: idx for d, idx in x.sharding.devices_indices_map(x.shape).items()}
        for x in jax.tree_util.tree_leaves(tree)
        if isinstance(x, jax.Array)
    ]


def test_a_plan_made_for_a_count_applies_on_the_first_n_devices():
    model = _mlp()
    counted = eqshard.plan(model, COLUMNS, simulate=4)
    assert counted.devices == 4
    assert isinstance(counted.mesh, jax.sharding.AbstractMesh)
    placed = eqshard.apply(model, counted)
    direct = eqshard.apply(model, COLUMNS, devices=4)
    assert _layouts(placed) == _layouts(direct)
    arrays = jax.tree_util.tree_leaves(eqx.filter(placed, eqx.is_array))
    assert {d for x in arrays for d in x.sharding.device_set} == set(jax.devices()[:4])
    for a, b in zip(arrays, jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))):
        assert a is not b
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_a_plan_for_more_devices_than_this_process_has_says_so():
    model = _mlp()
    counted = eqshard.plan(model, COLUMNS, simulate=16)
    with pytest.raises(eqshard.EqshardError, match=r"`devices=16`, the first 16 .* there are 8"):
        eqshard.apply(model, counted)


@pytest.mark.slow  # compiles the step twice
def test_init_and_cost_take_a_plan_made_for_a_count(spec_files):
    columns, _ = spec_files
    counted = eqshard.plan(eqx.filter_eval_shape(MODEL), columns, simulate=8)
    model = eqshard.init(MODEL, counted)
    assert _layouts(model) == _layouts(eqshard.apply(MODEL(), columns, devices=8))
    x = models.mlp_batch()
    opt_state = models.mlp_optimizer().init(eqx.filter(model, eqx.is_array))
    step = models.mlp_step
    from_count = eqshard.cost(model, opt_state, x, step=step, spec=counted)
    from_file = eqshard.cost(model, opt_state, x, step=step, spec=columns, devices=8)
    assert from_count.memory == from_file.memory
    assert from_count.collectives == from_file.collectives


def test_a_path_is_a_spec_file_everywhere_and_a_str_is_an_expression(spec_files):
    columns, rows = spec_files
    model = MODEL()
    loaded = eqshard.plan(model, eqshard.load(columns))
    assert eqshard.plan(model, columns).partition_specs == loaded.partition_specs
    assert _layouts(eqshard.apply(model, columns)) == _layouts(eqshard.apply(model, loaded))
    with pytest.raises(eqshard.EqshardError, match=r"is a `str`, .* as a `pathlib.Path`"):
        eqshard.plan(model, str(columns))
    found = eqshard.diff(model, columns, rows, devices=8)
    assert found.a.endswith("columns.eqshard.json")
    assert not found.same


@pytest.mark.slow  # a suggest ranking: compiles every candidate
def test_diff_and_suggest_take_devices_as_a_list_too(spec_files):
    model = MODEL()
    a, b = spec_files
    counted = eqshard.diff(model, a, b, devices=8)
    listed = eqshard.diff(model, a, b, devices=jax.devices())
    assert [c.path for c in listed.changes] == [c.path for c in counted.changes]
    opt_state = models.mlp_optimizer().init(eqx.filter(model, eqx.is_array))
    batch, step = models.mlp_batch(), models.mlp_step
    ranked = eqshard.suggest(model, opt_state, batch, step=step, devices=jax.devices()[:4])
    best = ranked.best
    assert best is not None
    assert best.cost is not None
    assert best.cost.devices == 4
    with pytest.raises(eqshard.EqshardError, match="worker processes cannot hold them"):
        eqshard.suggest(model, opt_state, batch, step=step, devices=jax.devices()[:4], workers=2)


@pytest.mark.parametrize("function", [eqshard.cost, eqshard.suggest, eqshard.diff])
def test_step_is_a_keyword_wherever_it_is_taken(function):
    step = inspect.signature(function).parameters["step"]
    assert step.kind is inspect.Parameter.KEYWORD_ONLY


def test_the_spec_tree_function_has_a_name_of_its_own():
    model = _mlp()
    tree = eqshard.spec_tree(model, COLUMNS)
    assert str(tree.layers[0].weight) == COLUMNS
    with pytest.warns(DeprecationWarning, match="`eqshard.spec` is now `eqshard.spec_tree`"):
        assert eqshard.spec is eqshard.spec_tree  # pyright: ignore[reportAttributeAccessIssue]


def test_dir_lists_the_api_only():
    listed = dir(eqshard)
    assert set(listed) == {*eqshard.__all__, *eqshard._NAMESPACES, "__version__"}
    for private in ("importlib", "Any", "TYPE_CHECKING", "sys", "warnings", "_errors"):
        assert private not in listed


def test_every_devices_argument_takes_a_count_or_a_list():
    for function in (
        eqshard.plan,
        eqshard.apply,
        eqshard.init,
        eqshard.restore,
        eqshard.cost,
        eqshard.suggest,
        eqshard.diff,
        eqshard.expression.sharding,
    ):
        annotation = str(inspect.signature(function).parameters["devices"].annotation)
        assert "int" in annotation or "Devices" in annotation, function.__name__
        assert annotation != "int | None", function.__name__


# `devices=` and `simulate=`: the agreed vocabulary ------------------------------

SIXTEEN = (
    "`devices=16` means 16 of this process's devices, and it has 8: pass `simulate=16` to "
    "lay out (or compile) for 16 devices it does not have"
)


def _ids(plan):
    return [d.id for d in plan.mesh.devices.flat]


def test_devices_is_this_process_s_devices_in_plan():
    model = _mlp()
    by_count = eqshard.plan(model, COLUMNS, devices=4)
    assert by_count.devices == tuple(jax.devices()[:4])
    assert isinstance(by_count.mesh, jax.sharding.Mesh)
    assert _ids(by_count) == [d.id for d in jax.devices()[:4]]
    chosen = [jax.devices()[i] for i in (7, 5, 3, 1)]
    by_list = eqshard.plan(model, COLUMNS, devices=chosen)
    assert by_list.devices == tuple(chosen)
    assert _ids(by_list) == [7, 5, 3, 1]


def test_simulate_lays_out_on_an_abstract_mesh():
    model = _mlp()
    simulated = eqshard.plan(model, COLUMNS, simulate=4)
    assert simulated.devices == 4
    assert isinstance(simulated.mesh, jax.sharding.AbstractMesh)
    assert simulated.partition_specs == eqshard.plan(model, COLUMNS, devices=4).partition_specs
    big = eqshard.expression.sharding("a b -> a* b", (64, 4), simulate=64)
    assert isinstance(big.mesh, jax.sharding.AbstractMesh)
    assert big.mesh.size == 64
    assert isinstance(
        eqshard.expression.sharding("a b -> a* b", (8, 4), devices=8).mesh, jax.sharding.Mesh
    )
    assert eqshard.report(model, COLUMNS, simulate=16).bytes_per_device is not None
    [weight, *_] = jax.tree_util.tree_leaves(eqshard.abstract(model, COLUMNS, simulate=16))
    assert isinstance(weight.sharding.mesh, jax.sharding.AbstractMesh)
    assert weight.sharding.mesh.size == 16


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("`eqshard.plan`", lambda m: eqshard.plan(m, COLUMNS, devices=4, simulate=4)),
        (
            "`eqshard.expression.sharding`",
            lambda m: eqshard.expression.sharding("a -> a*", (8,), devices=2, simulate=2),
        ),
        ("`eqshard.report`", lambda m: eqshard.report(m, COLUMNS, devices=4, simulate=4)),
        ("`eqshard.abstract`", lambda m: eqshard.abstract(m, COLUMNS, devices=4, simulate=4)),
        ("`eqshard.constrain`", lambda m: eqshard.constrain(m, COLUMNS, devices=4, simulate=4)),
        (
            "`eqshard.cost`",
            lambda m: eqshard.cost(m, step=lambda m: m, spec=COLUMNS, devices=4, simulate=4),
        ),
    ],
)
def test_devices_and_simulate_together_are_a_usage_error(name, call):
    with pytest.raises(
        eqshard.UsageError,
        match=rf"^{name} takes `devices=` \(this process's devices\) or `simulate=` \(a count "
        r"of devices it does not have, laid out abstractly\), not both; pass one$",
    ):
        call(_mlp())


@pytest.mark.parametrize(
    "call",
    [
        lambda m: eqshard.plan(m, COLUMNS, devices=16),
        lambda m: eqshard.expression.sharding("a b -> a* b", (16, 4), devices=16),
        lambda m: eqshard.report(m, COLUMNS, devices=16),
        lambda m: eqshard.abstract(m, COLUMNS, devices=16),
    ],
)
def test_devices_beyond_this_process_keeps_the_old_meaning_with_a_warning(call):
    with pytest.warns(DeprecationWarning, match="simulate=16") as caught:
        found = call(_mlp())
    assert [str(w.message) for w in caught] == [SIXTEEN]
    assert caught[0].filename == __file__  # pointed at the caller
    mesh = found.mesh if hasattr(found, "mesh") else None
    if isinstance(found, eqshard.Plan):
        assert found.devices == 16
        assert isinstance(mesh, jax.sharding.AbstractMesh)


def test_placing_takes_this_process_s_devices_only():
    model = _mlp()
    with pytest.raises(eqshard.EqshardError, match=r"pass at most 8, or lay out .* simulate=16\)`"):
        eqshard.apply(model, COLUMNS, devices=16)
    placed = eqshard.apply(model, COLUMNS, devices=2)
    assert {d.id for d in placed.layers[0].weight.sharding.device_set} == {0, 1}
    w = eqshard.apply(np.ones((8, 4), np.float32), "a b -> a* b", devices=[jax.devices()[3]])
    assert {d.id for d in w.sharding.device_set} == {3}


def test_constrain_with_simulate_lays_out_inside_jit_only():
    x = np.ones((8, 4), np.float32)

    @jax.jit
    def f(x):
        return eqshard.constrain(x, "a b -> a* b", simulate=8)

    assert np.array_equal(np.asarray(f(x)), x)
    with pytest.raises(eqshard.EqshardError, match=r"made for `simulate=8` devices"):
        eqshard.constrain(x, "a b -> a* b", simulate=8)


def test_every_function_that_lays_out_takes_simulate():
    for function in (
        eqshard.plan,
        eqshard.expression.sharding,
        eqshard.report,
        eqshard.abstract,
        eqshard.constrain,
        eqshard.cost,
    ):
        simulate = inspect.signature(function).parameters["simulate"]
        assert simulate.kind is inspect.Parameter.KEYWORD_ONLY, function.__name__
        assert simulate.default is None


# eqshard.testing: `device_counts=`, `make_batch` and `batch=` ----------------


def test_testing_takes_device_counts_and_the_old_devices_with_a_warning():
    from eqshard.testing._processes import device_counts

    assert device_counts((1, 2, 8), None, None) == (1, 2, 8)
    assert device_counts(4, None, None) == (4,)
    with pytest.warns(DeprecationWarning, match="device_counts") as caught:
        assert device_counts(None, None, None, (2, 8)) == (2, 8)
    assert [str(w.message) for w in caught] == [
        "`devices=(2, 8)` as the counts to test is deprecated: pass `device_counts=(2, 8)` "
        "(each count runs in a worker with that many simulated devices)"
    ]
    with pytest.raises(eqshard.UsageError, match=r"^`device_counts=` and `devices=` are both"):
        device_counts((2,), None, None, (2,))
    for function in (eqshard.testing.assert_equivalent, eqshard.testing.assert_layouts):
        parameters = inspect.signature(function).parameters
        assert parameters["device_counts"].kind is inspect.Parameter.KEYWORD_ONLY


def test_testing_s_batch_is_the_layout_and_make_batch_the_builder():
    from eqshard.testing._equivalence import batch_arguments

    def build_batch():
        return None

    parameters = list(inspect.signature(eqshard.testing.assert_equivalent).parameters)
    assert parameters[:4] == ["build", "spec", "loss", "make_batch"]
    assert batch_arguments(build_batch, "b ... -> b* ...", None) == (
        build_batch,
        "b ... -> b* ...",
    )
    with pytest.warns(DeprecationWarning, match="make_batch") as caught:
        assert batch_arguments(None, build_batch, None) == (build_batch, None)
    assert str(caught[0].message) == (
        "passing the batch's builder as `batch=` is deprecated: pass it as `make_batch=` "
        "(`batch=` is the batch's layout, such as 'b ... -> b* ...')"
    )
    with pytest.warns(DeprecationWarning, match="make_batch"):
        assert batch_arguments(None, "mypkg.model:batch", None) == ("mypkg.model:batch", None)
    with pytest.warns(DeprecationWarning, match="batch_spec") as caught:
        found = batch_arguments(build_batch, None, "b ... -> b* ...")
    assert found == (build_batch, "b ... -> b* ...")
    assert str(caught[0].message) == (
        "`batch_spec=` is deprecated: pass the batch's layout as `batch=`"
    )
    with pytest.raises(eqshard.UsageError, match=r"^`batch=` and `batch_spec=` are both given"):
        batch_arguments(build_batch, "... -> * ...", "b ... -> b* ...")
    with pytest.raises(eqshard.UsageError, match=r"^`make_batch` and a builder as `batch=`"):
        batch_arguments(build_batch, build_batch, None)
    with pytest.raises(eqshard.UsageError, match=r"^`assert_equivalent` needs `make_batch`"):
        batch_arguments(None, None, None)
