"""What a spec costs: the compiled step's communication and memory, per device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqshard
from eqshard._cost._compile import read_collectives

OPTIMIZER = optax.adam(1e-3)
MODEL = eqx.filter_eval_shape(lambda: eqx.nn.MLP(256, 256, 1024, 1, key=jax.random.key(0)))
STATE = jax.eval_shape(
    OPTIMIZER.init, eqx.filter(MODEL, lambda x: isinstance(x, jax.ShapeDtypeStruct))
)
BATCH = jax.ShapeDtypeStruct((64, 256), jnp.float32)
MEGATRON = eqshard.load(
    {
        "eqshard": 1,
        "rules": [
            {"path": "layers.0.weight", "expr": "o i -> * o4 i"},
            {"path": "layers.0.bias", "expr": "o -> * o4"},
            {"path": "layers.1.weight", "expr": "o i -> * o i4"},
        ],
    }
)
PARAMETER_BYTES = (256 * 1024 + 1024 + 1024 * 256 + 256) * 4


@eqx.filter_jit(donate="all-except-first")
def step(model, state, x):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    updates, state = OPTIMIZER.update(grads, state)
    return eqx.apply_updates(model, updates), state, loss


def _cost(spec, batch, mesh=None, **kwargs):
    return eqshard.cost(
        MODEL,
        STATE,
        BATCH,
        step=step,
        spec=spec,
        batch=batch,
        mesh=mesh,
        devices=None if mesh else 8,
        **kwargs,
    )


def test_replicated_communicates_nothing():
    c = _cost("... -> * ...", "... -> * ...")
    assert c.collectives == []
    assert c.memory.parameters == PARAMETER_BYTES
    assert c.memory.optimizer == 2 * PARAMETER_BYTES + 4  # two moments and a count
    assert c.memory.peak >= c.memory.parameters + c.memory.optimizer


def test_data_parallel_all_reduces_the_gradients_over_every_device():
    c = _cost("... -> * ...", "b ... -> b* ...")
    [(kind, axes)] = c.bytes_by_axes()
    assert kind == "all-reduce"
    assert c.mesh is not None
    assert set(axes) == set(c.mesh.axis_names)
    assert PARAMETER_BYTES <= c.bytes_by_axes()[(kind, axes)] <= PARAMETER_BYTES + 64


def test_megatron_all_reduces_activations_over_the_model_axis():
    c = _cost(MEGATRON, "... -> * ...")
    moved = c.bytes_by_axes()
    assert {kind for kind, _ in moved} == {"all-reduce"}
    assert sum(moved.values()) < PARAMETER_BYTES / 8  # activations, far smaller than weights
    # each device holds a quarter of every split leaf, and all of layers.1.bias
    assert c.memory.parameters == (256 * 1024 // 4 + 1024 // 4 + 1024 * 256 // 4 + 256) * 4
    assert c.memory.optimizer == 2 * c.memory.parameters + 4


def test_two_dimensional_communicates_over_both_axes():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    c = _cost(MEGATRON, "b ... -> b2 ... 4", mesh)
    moved = c.bytes_by_axes()
    assert set(moved) == {("all-reduce", ("model",)), ("all-reduce", ("data",))}
    assert moved[("all-reduce", ("model",))] < moved[("all-reduce", ("data",))]
    # the gradients over `data` are the parameters as the layout splits them
    assert moved[("all-reduce", ("data",))] <= c.memory.parameters + 64
    estimate = c.estimate("h100")
    assert estimate.seconds > estimate.communication > 0
    assert c.estimate("tpu-v5e").seconds > estimate.seconds
    with pytest.raises(eqshard.EqshardError, match="no hardware profile 'a100'"):
        c.estimate("a100")


@pytest.mark.slow  # compiles in worker processes
def test_more_devices_than_the_process_has_compile_in_a_process_of_their_own():
    c = _cost_on(16)
    assert c.devices == 16
    assert c.mesh is not None
    assert c.mesh.size == 16
    # data parallel over 16: each device holds everything, and the gradients'
    # all-reduce runs over all 16
    assert c.memory.parameters == PARAMETER_BYTES
    [((kind, axes), moved)] = c.bytes_by_axes().items()
    assert kind == "all-reduce"
    assert set(axes) == set(c.mesh.axis_names)
    assert PARAMETER_BYTES <= moved <= PARAMETER_BYTES + 64
    p = eqshard.plan(MODEL, "... -> * ...")
    with pytest.raises(eqshard.EqshardError, match="a `Plan` holds this process's devices"):
        eqshard.cost(MODEL, STATE, BATCH, step=step, spec=p, simulate=16)


def _cost_on(n):
    return eqshard.cost(MODEL, STATE, BATCH, step=step, spec="... -> * ...", simulate=n)


@pytest.mark.slow  # compiles in worker processes
def test_devices_beyond_this_process_is_simulated_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="simulate=16") as caught:
        c = eqshard.cost(MODEL, STATE, BATCH, step=step, spec="... -> * ...", devices=16)
    assert [str(w.message) for w in caught] == [
        "`devices=16` means 16 of this process's devices, and it has 8: pass `simulate=16` to "
        "lay out (or compile) for 16 devices it does not have"
    ]
    assert c.devices == 16
    assert c.compiler == "XLA:CPU, 16 simulated devices"
    here = eqshard.cost(MODEL, STATE, BATCH, step=step, spec="... -> * ...", devices=2)
    assert here.devices == 2
    assert here.mesh is not None
    assert isinstance(here.mesh, Mesh)
    assert [d.id for d in here.mesh.devices.flat] == [0, 1]


@pytest.mark.parametrize(
    ("groups", "axes"),
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", ("model",)),
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", ("data",)),
        ("replica_groups=[2,4]<=[8]", ("model",)),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", ("data",)),
        ("replica_groups={}", ("data", "model")),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ("model",)),
        (
            "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
            ("model",),
        ),
    ],
)
def test_every_replica_group_notation_names_its_mesh_axes(groups, axes):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    line = (
        f"  %all-reduce.6 = (f32[32,32]{{1,0}}, f32[32]{{0}}) all-reduce(%a, %b), "
        f"channel_id=2, {groups}, use_global_device_ids=true, to_apply=%add, "
        f'metadata={{op_name="jit(step)/dot_general"}}'
    )
    [collective] = read_collectives(f"ENTRY %main () -> f32[] {{\n{line}\n}}", mesh)
    assert collective.kind == "all-reduce"
    assert collective.bytes == (32 * 32 + 32) * 4
    assert collective.axes == axes
    assert collective.source == "jit(step)/dot_general"


def test_a_collective_in_a_loop_counts_once_per_trip():
    hlo = """\
%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(%x, %y)
}

%inner (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar.1 = f32[4]{0} all-reduce(f32[4]{0} %x), replica_groups=[1,8]<=[8], to_apply=%add
}

%outer (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %w.2 = (s32[], f32[4]) while(%t), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"2"}}
  %ag.1 = f32[8]{0} all-gather(f32[1]{0} %y), replica_groups=[1,8]<=[8], dimensions={0}
}

%cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%unknown (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar.3 = f32[2]{0} all-reduce(f32[2]{0} %z), replica_groups=[1,8]<=[8], to_apply=%add
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %w.1 = (s32[], f32[4]) while(%init), condition=%cond, body=%outer, backend_config={"known_trip_count":{"n":"3"}}
  %w.3 = (s32[], f32[4]) while(%init), condition=%cond, body=%unknown
  %ar.2 = f32[4]{0} all-reduce(f32[4]{0} %a), replica_groups=[1,8]<=[8], to_apply=%add
}
"""
    found = [(c.kind, c.bytes, c.count, c.total_bytes) for c in read_collectives(hlo, None)]
    assert found == [
        ("all-reduce", 16, 6, 96),  # in the inner loop: 2 trips per trip of the outer's 3
        ("all-gather", 32, 3, 96),
        ("all-reduce", 8, 1, 8),  # a loop XLA knows no trip count of: counted once
        ("all-reduce", 16, 1, 16),
    ]


@pytest.mark.slow  # compiles the stacked GPT's step
def test_the_stacked_gpt_counts_its_scanned_collectives_per_layer():
    import runpy
    from pathlib import Path

    gpt = runpy.run_path(str(Path(__file__).parent.parent / "examples/gpt_stacked.py"))
    model = gpt["build"]()
    state = gpt["optimizer"]().init(eqx.filter(model, eqx.is_array))
    c = eqshard.cost(model, state, gpt["batch"](), step=gpt["step"], spec=eqshard.load(gpt["SPEC"]))
    looped = [x for x in c.collectives if "while" in x.source]
    assert looped
    assert {x.count for x in looped} == {gpt["LAYERS"]}
    assert all(x.count == 1 for x in c.collectives if "while" not in x.source)
    by_axes = c.bytes_by_axes()
    assert sum(by_axes.values()) == sum(x.bytes * x.count for x in c.collectives)


def test_a_step_that_cannot_be_traced_names_the_devices_and_the_spec(tmp_path):
    def broken(model, state, x):
        return model.layers[0].weight @ x  # (1024, 256) @ (64, 256)

    eqshard.dump(MEGATRON, tmp_path / "megatron.eqshard.json")
    rules = eqshard.load(tmp_path / "megatron.eqshard.json")
    with pytest.raises(
        eqshard.EqshardError,
        match=r"^`eqshard\.cost` cannot trace and compile the step .*\.broken on 8 devices under "
        r"the spec file .*megatron\.eqshard\.json: it raised TypeError: dot_general requires "
        r"contracting",
    ) as caught:
        eqshard.cost(MODEL, STATE, BATCH, step=broken, spec=rules, devices=8)
    assert isinstance(caught.value.__cause__, TypeError)  # JAX's own error, chained
    with pytest.raises(
        eqshard.EqshardError, match=r" on 4 devices under the expression '\.\.\. -> \* \.\.\.': "
    ):
        eqshard.cost(MODEL, STATE, BATCH, step=broken, spec="... -> * ...", devices=4)


# --------------------------------------------------------------------------- #
# The batch: `batch=`, a placement of its own, the spec file's "batch", the default.
# --------------------------------------------------------------------------- #

# Megatron on 8 devices (a 2 x 4 mesh): a batch split over every device makes the
# step gather the activations over m1 and sum the gradients over m0; a whole batch
# only sums the activations over m1.
SPLIT = {("all-gather", ("m1",)), ("all-reduce", ("m0",)), ("all-reduce", ("m1",))}
WHOLE = {("all-reduce", ("m1",))}


def _split():
    """The communication of the Megatron step with the batch split (the default)."""
    c = _megatron_cost(BATCH)
    moved = c.bytes_by_axes()
    assert set(moved) == SPLIT
    assert c.memory.parameters <= moved[("all-reduce", ("m0",))] <= c.memory.parameters + 64
    return moved


def _megatron_cost(x, **kw):
    spec = kw.pop("spec", MEGATRON)
    return eqshard.cost(MODEL, STATE, x, step=step, spec=spec, **kw)


def _placed(x, spec):
    p = eqshard.plan(MODEL, MEGATRON, devices=jax.devices())
    assert p.mesh is not None
    return jax.device_put(x, NamedSharding(p.mesh, spec))


@pytest.mark.slow  # compiles the step per batch layout
def test_a_batch_placed_on_the_plans_devices_keeps_its_sharding():
    x = jnp.arange(64 * 256, dtype=jnp.float32).reshape(64, 256)
    split = _split()  # the default
    whole = _megatron_cost(_placed(x, P()))
    assert set(whole.bytes_by_axes()) == WHOLE
    assert whole.batch is None  # no leaf was laid out by an expression
    abstract = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_placed(x, P()).sharding)
    assert _megatron_cost(abstract).bytes_by_axes() == whole.bytes_by_axes()
    assert _megatron_cost(_placed(x, P(("m0", "m1")))).bytes_by_axes() == split
    # `batch=` says otherwise: every leaf is laid out by it
    given = _megatron_cost(_placed(x, P()), batch="b ... -> b* ...")
    assert (given.bytes_by_axes(), given.batch) == (split, "b ... -> b* ...")


@pytest.mark.slow  # compiles the step per batch layout
def test_a_batch_on_one_device_or_on_other_devices_is_laid_out_by_the_default():
    split = _split()
    on_one = jnp.zeros((64, 256))  # on jax.devices()[0]
    c = _megatron_cost(on_one)
    assert (c.bytes_by_axes(), c.batch) == (split, "b ... -> b* ...")
    four = Mesh(np.array(jax.devices()[:4]), ("a",))
    elsewhere = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(four, P()))
    assert _megatron_cost(elsewhere).bytes_by_axes() == split
    # the plan's devices in another order: one program cannot take both orders
    reversed_mesh = Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("m0", "m1"))
    reordered = jax.ShapeDtypeStruct(
        (64, 256), jnp.float32, sharding=NamedSharding(reversed_mesh, P())
    )
    assert _megatron_cost(reordered).bytes_by_axes() == split


def test_the_spec_files_batch_lays_out_the_batch_unless_batch_is_given():
    split = _split()
    whole_batch = eqshard.load({**MEGATRON.to_json(), "batch": "... -> * ..."})
    assert whole_batch.batch == eqshard.expression.parse("... -> * ...")
    c = _megatron_cost(BATCH, spec=whole_batch)
    assert (set(c.bytes_by_axes()), c.batch) == (WHOLE, "... -> * ...")
    p = eqshard.plan(MODEL, whole_batch, devices=jax.devices())  # a plan made from Rules
    assert _megatron_cost(BATCH, spec=p).bytes_by_axes() == c.bytes_by_axes()
    c = _megatron_cost(BATCH, spec=whole_batch, batch="b ... -> b* ...")
    assert (c.bytes_by_axes(), c.batch) == (split, "b ... -> b* ...")
    # a batch placed by its user keeps its place over the file's "batch"
    x = jnp.zeros((64, 256))
    assert _megatron_cost(_placed(x, P(("m0", "m1"))), spec=whole_batch).bytes_by_axes() == split


def test_a_short_or_malformed_batch_is_refused_with_a_caret():
    with pytest.raises(eqshard.ExpressionError, match=r"(?s)    b\*\n    \^\^\na batch's arrays"):
        _megatron_cost(BATCH, batch="b*")
    with pytest.raises(eqshard.ExpressionError, match=r"a count of 0 is not allowed"):
        _megatron_cost(BATCH, batch="b ... -> b0 ...")
    with pytest.raises(eqshard.ExpressionError, match=r"a batch's arrays have no annotation"):
        eqshard.Rules(batch=eqshard.expression.parse("b*"))


def test_bfloat16_collectives_on_xla_cpu_are_named_as_its_float32_copies():
    """XLA:CPU moves a bfloat16 step's collectives as float32: twice XLA:TPU's bytes
    for a data-parallel MLP; `promoted` says so on XLA:CPU, and only there."""
    model = eqx.filter_eval_shape(
        lambda: eqx.nn.MLP(64, 64, 256, 1, key=jax.random.key(0), dtype=jnp.bfloat16)
    )
    x = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)

    def step(m, x):
        return eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2))(m)

    spec = eqshard.load({"eqshard": 1, "mesh": [["data", "*"]], "default": "replicate"})
    cpu = eqshard.cost(model, x, step=step, spec=spec)
    gradients = (64 * 256 + 256 + 256 * 64 + 64) * 2  # bfloat16
    assert cpu.bytes_by_axes() == {("all-reduce", ("data",)): 2 * gradients}
    assert cpu.memory.gradients == gradients  # bfloat16 is inexact: its gradients count
    assert cpu.promoted == (
        "XLA:CPU moves bfloat16 collectives as float32 copies: up to twice the bytes an "
        "accelerator moves (a TPU target shows its own)"
    )
    pytest.importorskip("libtpu", reason="the TPU compiler comes with libtpu")
    tpu = eqshard.cost(model, x, step=step, spec=spec, target="v5e:2x4")
    assert tpu.bytes_by_axes() == {("all-reduce", ("data",)): gradients}
    assert tpu.promoted is None


def _figures(c):
    """Every figure `cost` reads of the compiled program."""
    m = c.memory
    moved = [(k.kind, k.bytes, k.axes, k.count, k.group_size, k.loop) for k in c.collectives]
    memory = (m.arguments, m.outputs, m.temporaries, m.peak, m.reported_peak, m.host_arguments)
    return memory, moved, c.flops, c.loop_flops, c.bytes_accessed


CHEAPER = ("xla_backend_optimization_level=0", "xla_llvm_disable_expensive_passes=true")


@pytest.mark.parametrize(
    ("spec", "batch"),
    [
        ("... -> * ...", "b ... -> b* ..."),
        (eqshard.load({"eqshard": 1, "default": "fsdp"}), "b ... -> b* ..."),
        (MEGATRON, "... -> * ..."),
    ],
    ids=["data-parallel", "fsdp", "megatron"],
)
def test_a_step_compiled_only_to_be_costed_has_the_same_figures(spec, batch):
    default = _cost(spec, batch)
    costing = _cost(spec, batch, compile_for="costing")
    assert default.compiler_options == ()
    assert costing.compiler_options == CHEAPER
    assert costing.collectives  # each of these communicates
    assert _figures(costing) == _figures(default)


@pytest.mark.slow  # compiles the stacked GPT's step twice
def test_the_stacked_gpt_compiled_only_to_be_costed_has_the_same_figures():
    import runpy
    from pathlib import Path

    gpt = runpy.run_path(str(Path(__file__).parent.parent / "examples/gpt_stacked.py"))
    model = gpt["build"]()
    state = gpt["optimizer"]().init(eqx.filter(model, eqx.is_array))
    found = {
        how: eqshard.cost(
            model,
            state,
            gpt["batch"](),
            step=gpt["step"],
            spec=eqshard.load(gpt["SPEC"]),
            compile_for=how,
        )
        for how in ("running", "costing")
    }
    assert found["costing"].compiler_options == CHEAPER
    assert _figures(found["costing"]) == _figures(found["running"])


def test_compile_for_is_running_or_costing():
    with pytest.raises(eqshard.EqshardError, match=r"`compile_for` is 'running' .* not 'fast'"):
        _cost("... -> * ...", "b ... -> b* ...", compile_for="fast")


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (-1, r"`devices` is a whole number from 1, not -1"),  # was the first 7 devices
        (True, r"`devices` is a whole number from 1, not True"),  # was 1 device
        (0, r"`devices` is a whole number from 1, not 0"),
        (2**31, r"`devices` is 2147483648, more than 2147483647, the most devices"),
    ],
)
def test_a_device_count_is_a_whole_number_of_devices(devices, message):
    with pytest.raises(eqshard.EqshardError, match=message):
        eqshard.cost(MODEL, STATE, BATCH, step=step, spec="... -> * ...", devices=devices)


# Each compiler's peak, from its own figures: XLA:GPU's as an H200 gave them
# (benchmarks/gpu_check.py, JAX 0.11.2): arguments, outputs, temporaries, its own peak.
GPU_FIGURES = (4_564_017_156, 4_429_799_784, 4_026_537_496, 13_020_348_788)


@pytest.mark.parametrize(
    ("platform", "expected", "says"),
    [
        ("gpu", 13_020_348_788, "XLA:GPU's own peak (reported_peak)"),  # its own: what it held
        ("cpu", 13_020_354_436, "arguments + outputs + temporaries: XLA:CPU's own peak"),
        ("rocm", 13_020_354_436, "arguments + outputs + temporaries: XLA:ROCM's own peak"),
    ],
)
def test_each_compilers_peak_is_read_by_its_own_rule(platform, expected, says):
    arguments, outputs, temporaries, reported = GPU_FIGURES
    m = eqshard.results.Memory(
        parameters=0,
        state=0,
        optimizer=0,
        gradients=0,
        arguments=arguments,
        outputs=outputs,
        temporaries=temporaries,
        reported_peak=reported,
        platform=platform,
    )
    assert m.allocated == arguments + outputs + temporaries == 13_020_354_436
    assert m.peak == expected
    assert m.peak_includes.startswith(says)


def test_the_compiler_is_named_by_the_backend_used():
    """`Cost.compiler` names the platform and the kind of device it compiled for,
    "simulated" only for XLA:CPU's simulated devices (a GPU's devices faked here)."""
    from eqshard._cost._driver import compiler_label

    class _Gpu:
        platform = "gpu"
        device_kind = "NVIDIA H100 80GB HBM3"

    assert compiler_label([_Gpu()], 1) == "XLA:GPU (NVIDIA H100 80GB HBM3), 1 device"
    assert compiler_label([_Gpu()] * 2, 2) == "XLA:GPU (NVIDIA H100 80GB HBM3), 2 devices"
    assert compiler_label(jax.devices()[:1], 1) == "XLA:CPU, 1 device"
    assert compiler_label(jax.devices(), 8) == "XLA:CPU, 8 simulated devices"
    assert compiler_label(None, 16) == "XLA:CPU, 16 simulated devices"  # in a worker
