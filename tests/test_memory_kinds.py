"""State in host memory: a rule's `"memory": "pinned_host"`, the shardings that carry
it, `apply`, `init` and `restore` placing there, a training step that moves the
optimizer state to the device for its update and back, and `cost`, `report` and
`check --max-memory` telling device bytes from host bytes.

JAX 0.10.2's CPU devices have `pinned_host` memory, so all of it runs here."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqshard
import eqshard._plan
from eqshard._cli import _check

needs_host_memory = pytest.mark.skipif(
    jax.__version_info__ < eqshard._plan.HOST_MEMORY_JAX,
    reason=f"host memory needs JAX 0.10; this is {jax.__version__} (test_old_jax_refuses_host_memory)",
)

OFFLOAD = {
    "eqshard": 1,
    "mesh": [["data", "*"]],
    "default": "replicate",
    "optimizer": {"rules": [{"path": "**", "expr": "fsdp", "memory": "pinned_host"}]},
}
HOST_BIAS = {
    "eqshard": 1,
    "rules": [{"path": "layers.1.bias", "expr": "o -> o*", "memory": "pinned_host"}],
}


def _model():
    return eqx.nn.MLP(16, 16, 64, 1, key=jax.random.key(0))


def _kinds(tree):
    return [
        x.sharding.memory_kind for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))
    ]


@needs_host_memory
def test_cpu_devices_offer_pinned_host_memory():
    kinds = {memory.kind for memory in jax.devices()[0].addressable_memories()}
    assert {"device", "pinned_host"} <= kinds


@needs_host_memory
def test_the_plans_shardings_carry_the_rules_memory_kind():
    model = _model()
    plan = eqshard.plan(model, eqshard.load(HOST_BIAS))
    assert plan.shardings.layers[1].bias.memory_kind == "pinned_host"
    assert plan.shardings.layers[1].bias.spec == jax.sharding.PartitionSpec("m0")
    assert plan.shardings.layers[0].bias.memory_kind == "device"
    abstract = eqshard.plan(model, eqshard.load(HOST_BIAS), simulate=16)  # no devices
    assert abstract.shardings.layers[1].bias.memory_kind == "pinned_host"
    leaf = plan.abstract.layers[1].bias
    assert leaf.sharding.memory_kind == "pinned_host"


@needs_host_memory
def test_apply_init_and_restore_place_in_host_memory(tmp_path):
    rules = eqshard.load(HOST_BIAS)
    model = _model()
    placed = eqshard.apply(model, rules)
    assert _kinds(placed) == ["device", "device", "device", "pinned_host"]
    for got, want in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(model)):
        if eqx.is_array(got):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    built = eqshard.init(functools.partial(eqx.nn.MLP, 16, 16, 64, 1, key=jax.random.key(0)), rules)
    assert _kinds(built) == ["device", "device", "device", "pinned_host"]
    plan = eqshard.plan(model, eqshard.load(OFFLOAD))
    optimizer = optax.adam(1e-3)
    state = eqshard.apply(optimizer.init(eqx.filter(model, eqx.is_array)), plan)
    assert _kinds(state) == ["device"] + ["pinned_host"] * 8  # the count stays on the device
    path = tmp_path / "state.eqx"
    eqx.tree_serialise_leaves(path, (placed, state))
    like = eqx.filter_eval_shape(lambda: (model, state))
    restored = eqshard.restore(path, like, plan)
    assert _kinds(restored[1]) == ["device"] + ["pinned_host"] * 8
    assert eqshard.abstract(like, plan)[1][0].mu.layers[0].weight.sharding.memory_kind == (
        "pinned_host"
    )


def _loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def _offload_step(optimizer, plan, traces):
    """The README's step: the optimizer state moved to the device for the update,
    and back to where the plan holds it by `constrain`."""

    @eqx.filter_jit
    def step(model, opt_state, x):
        traces.append(1)
        value, grads = eqx.filter_value_and_grad(_loss)(model, x)
        opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return eqshard.constrain(model, plan), eqshard.constrain(opt_state, plan), value

    return step


@pytest.mark.slow  # trains on host and on device and compares
@needs_host_memory
def test_the_host_offload_step_equals_the_on_device_one():
    model = _model()
    optimizer = optax.adamw(1e-2)
    x = eqshard.apply(jax.random.normal(jax.random.key(1), (8, 16)), "b ... -> b* ...")
    results = {}
    for name, spec in (("pinned_host", OFFLOAD), ("device", _on_device(OFFLOAD))):
        plan = eqshard.plan(model, eqshard.load(spec))
        traces = []
        step = _offload_step(optimizer, plan, traces)
        placed = eqshard.apply(model, plan)
        opt_state = eqshard.apply(optimizer.init(eqx.filter(model, eqx.is_array)), plan)
        values = []
        for _ in range(3):
            placed, opt_state, value = step(placed, opt_state, x)
            values.append(float(value))
        assert len(traces) == 1
        assert _kinds(opt_state) == ["device"] + [name] * 8  # the count stays on the device
        assert values[-1] < values[0]
        results[name] = (placed, opt_state)
    for got, want in zip(
        jax.tree_util.tree_leaves(eqx.filter(results["pinned_host"], eqx.is_array)),
        jax.tree_util.tree_leaves(eqx.filter(results["device"], eqx.is_array)),
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # bit for bit


def _on_device(spec):
    section = {"rules": [{"path": "**", "expr": "fsdp"}]}
    return {**spec, "optimizer": section}


@needs_host_memory
def test_a_sharding_constraint_leaves_the_memory_kind_so_constrain_moves_it():
    host = eqshard.plan(
        {"w": jnp.ones(8)},
        eqshard.load(
            {**HOST_BIAS, "rules": [{"path": "w", "expr": "a -> a*", "memory": "pinned_host"}]}
        ),
    )
    sharding = host.shardings["w"]
    # JAX 0.10: `with_sharding_constraint` keeps a value's memory kind as it is
    kept = jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, sharding))(jnp.ones(8))
    assert kept.sharding.memory_kind == "device"
    moved = jax.jit(lambda x: eqshard.constrain({"w": x * 2}, host))(jnp.ones(8))
    assert moved["w"].sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(moved["w"]), np.full(8, 2.0, np.float32))


@needs_host_memory
def test_jax_refuses_to_compute_on_host_and_device_values_together():
    plan = eqshard.plan(_model(), eqshard.load(HOST_BIAS))
    model = eqshard.apply(_model(), plan)
    with pytest.raises(ValueError, match=r"memory_space of all inputs passed to `add` must be"):
        eqx.filter_jit(_loss)(model, jnp.ones((8, 16)))


@needs_host_memory
def test_cost_report_and_check_tell_device_bytes_from_host_bytes():
    model = _model()
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    figures = {}
    for name, spec in (("host", OFFLOAD), ("device", _on_device(OFFLOAD))):
        plan = eqshard.plan(model, eqshard.load(spec))

        def step(model, opt_state, x):
            grads = eqx.filter_grad(_loss)(model, x)
            opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
            updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            model = eqx.apply_updates(model, updates)
            return eqshard.constrain(model, plan), eqshard.constrain(opt_state, plan)  # noqa: B023

        figures[name] = eqshard.cost(model, opt_state, x, step=step, spec=plan).memory
    host, device = figures["host"], figures["device"]
    moments = host.optimizer - 4  # the step count stays on the device
    assert host.optimizer == device.optimizer  # bytes per device, wherever they are held
    assert host.host == moments
    assert device.host == device.host_arguments == device.host_outputs == 0
    assert host.host_arguments == host.host_outputs == moments
    assert host.arguments == device.arguments - moments  # device memory only
    assert host.outputs == device.outputs - moments
    assert host.peak < device.peak

    report = eqshard.report(opt_state, eqshard.plan(model, eqshard.load(OFFLOAD)))
    assert [row.memory_kind for row in report.rows] == [None] + ["pinned_host"] * 8
    assert report.host_bytes_per_device == moments
    text = str(report)
    assert "memory" in text.splitlines()[1]
    assert f"{eqshard._report.human_bytes(moments)} of it in host memory" in text
    assert "memory" not in str(eqshard.report(model, eqshard.plan(model))).splitlines()[1]

    # --max-memory is compared with device bytes: the host-held leaves do not count
    on_host = eqshard.load(
        {"eqshard": 1, "rules": [{"path": "**", "expr": "... -> * ...", "memory": "pinned_host"}]}
    )
    parameters = sum(a.nbytes for a in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))
    abstract = eqx.filter_eval_shape(_model)
    (fits,) = _check.check(on_host, abstract, [8], max_memory=parameters // 2)
    assert fits.problems == []
    assert fits.max_memory is not None
    assert fits.max_memory["needed"] == 0
    (does_not,) = _check.check(
        eqshard.load({"eqshard": 1}), abstract, [8], max_memory=parameters // 2
    )
    assert "it does not fit" in does_not.problems[0].message


@pytest.mark.slow  # compiles in worker processes
@needs_host_memory
def test_assert_equivalent_passes_on_host_offload():
    import harness_models as m

    from eqshard.testing import assert_equivalent

    # the parameters of one layer and the AdamW moments in host memory: the harness
    # moves them to the device to compute, as a host-offload step does
    spec = {
        **OFFLOAD,
        "rules": [{"path": "layers.0.*", "expr": "... -> * ...", "memory": "pinned_host"}],
    }
    assert_equivalent(
        m.build, eqshard.load(spec), m.loss, m.batch, device_counts=(2, 8), optimizer=m.optimizer
    )


def test_old_jax_refuses_host_memory(monkeypatch):
    monkeypatch.setattr(eqshard._plan, "HOST_MEMORY_JAX", (99, 0))
    with pytest.raises(
        eqshard.EqshardError,
        match=r'^a rule holds leaves in host memory \("memory": \'pinned_host\'\), and this is '
        r"JAX .*; use JAX 0\.10 or later, or leave \"memory\" out of the rule$",
    ):
        eqshard.plan(_model(), eqshard.load(HOST_BIAS))
    assert eqshard.plan(_model(), eqshard.load({"eqshard": 1})).mesh is not None
