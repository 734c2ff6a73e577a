"""Reading compiled HLO: the corpus of real texts in `tests/hlo/` against the
expectations written by hand beside each, the five findings of issue 21, and the
errors for what eqshard cannot read."""

import dataclasses
import json
from pathlib import Path

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import pytest

import eqshard
from eqshard._cost._compile import read_collectives
from eqshard._cost._hlo._calls import trip_count
from eqshard._cost._hlo._collectives import KINDS, collectives
from eqshard._cost._hlo._flops import _real_taps, flops
from eqshard._cost._hlo._parse import DTYPE_BITS, parse

CORPUS = Path(__file__).parent / "hlo"
EXPECTATIONS = sorted(CORPUS.glob("*/*.json"))
MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _text(name: str) -> str:
    return (CORPUS / name).read_text()


def _module(body: str, header: str = "HloModule m, num_partitions=8") -> str:
    """A module of one entry computation around `body`'s lines."""
    return f"{header}\n\nENTRY %main () -> f32[] {{\n{body}\n}}\n"


# The corpus ------------------------------------------------------------------


def test_the_corpus_has_every_target_and_an_expectation_beside_each_text():
    texts = sorted(CORPUS.glob("*/*.hlo"))
    assert [t.with_suffix(".json") for t in texts] == EXPECTATIONS
    assert {t.parent.name for t in texts} == {
        "cpu-jax0.8.1",
        "cpu-jax0.10.2",
        "cpu-jax0.12.0.1",
        "tpu-jax0.10.2",
        "tpu-jax0.12.0.1",
    }
    assert sum(t.stat().st_size for t in CORPUS.glob("*/*")) < 700_000  # two TPU releases


def _key(kind, nbytes, count, groups=None, axes=None):
    if axes is not None:
        return (kind, nbytes, count, tuple(sorted(axes)))
    return (kind, nbytes, count, frozenset(frozenset(g) for g in groups or ()))


@pytest.mark.parametrize("expected", EXPECTATIONS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_corpus_text_reads_as_its_expectation(expected):
    want = json.loads(expected.read_text())
    text = expected.with_suffix(".hlo").read_text()
    module = parse(text)
    assert module.devices == 8
    read = collectives(module)
    by_axes = {  # entries whose exact groups are the partitioner's choice
        c["kind"] for c in want["collectives"] if "groups" not in c
    }
    found = sorted(
        (
            _key(c.kind, c.bytes, c.count, axes=_axes(c.groups))
            if c.kind in by_axes
            else _key(c.kind, c.bytes, c.count, groups=c.groups)
            for c in read
        ),
        key=repr,
    )
    assert found == sorted(
        (
            _key(c["kind"], c["bytes"], c["count"], c.get("groups"), c.get("axes"))
            for c in want["collectives"]
        ),
        key=repr,
    )
    assert flops(module) == want["flops"]
    # the driver names the same groups by the mesh's axes, and agrees on the bytes
    named = read_collectives(text, MESH)
    assert [(c.kind, c.bytes, c.count) for c in named] == [(c.kind, c.bytes, c.count) for c in read]
    assert all(c.axes == _axes(o.groups) for c, o in zip(named, read))


def _axes(groups):
    varying = set()
    for group in groups:
        for axis, name in ((0, "data"), (1, "model")):
            if len({divmod(i, 4)[axis] for i in group}) > 1:
                varying.add(name)
    return tuple(name for name in ("data", "model") if name in varying)


# XLA's cost analysis counts a loop's body once and every branch of a
# conditional, so it is compared only where there are neither
STRAIGHT = [p for p in EXPECTATIONS if not {"loops", "branches"} & set(json.loads(p.read_text()))]


@pytest.mark.parametrize("expected", STRAIGHT, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_matrix_flops_agree_with_the_compilers_own_count_without_loops(expected):
    # XLA also counts a FLOP per element of elementwise work, which eqshard leaves out
    want = json.loads(expected.read_text())
    counted = flops(parse(expected.with_suffix(".hlo").read_text()))
    assert counted <= want["xla_flops"]
    if counted:
        assert want["xla_flops"] - counted < 0.02 * want["xla_flops"]


@pytest.mark.parametrize(
    ("f", "shapes"),
    [
        (jnp.dot, [(48, 32), (32, 24)]),
        (jnp.dot, [(64, 32), (32,)]),
        (lambda a, b: jnp.einsum("bij,bjk->bik", a, b), [(3, 5, 7), (3, 7, 11)]),
        (
            lambda x, k: jax.lax.conv_general_dilated(
                x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
            ),
            [(2, 9, 9, 8), (3, 3, 8, 16)],
        ),
        (
            lambda x, k: jax.lax.conv_general_dilated(
                x,
                k,
                (2, 2),
                "VALID",
                feature_group_count=4,
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
            ),
            [(2, 9, 9, 8), (3, 3, 2, 16)],
        ),
    ],
)
def test_flops_of_products_equal_the_compilers_own_count(f, shapes):
    compiled = jax.jit(f).lower(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]).compile()
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    assert costs is not None
    assert flops(parse(compiled.as_text() or "")) == costs["flops"]


@pytest.mark.parametrize(
    "name",
    [
        "cpu-jax0.10.2/scan_replicated.hlo",
        "cpu-jax0.10.2/nested.hlo",
        "cpu-jax0.8.1/nested.hlo",
        "cpu-jax0.12.0.1/nested.hlo",
    ],
)
def test_a_loops_trip_count_is_read_from_the_loop_where_xla_does_not_write_it(name):
    # XLA:TPU writes no `known_trip_count`: eqshard reads the count from the loop
    # (its counter, start, step and bound), and on XLA:CPU's loops it must agree
    # with the count XLA writes
    module = parse(_text(name))
    loops = [i for i in module.instructions.values() if i.opcode == "while"]
    assert loops
    for loop in loops:
        written = trip_count(module, loop)
        assert written is not None
        bare = {k: v for k, v in loop.attributes.items() if k != "backend_config"}
        unwritten = type(loop)(**{**loop.__dict__, "attributes": bare})
        assert trip_count(module, unwritten) == written


# The five findings -------------------------------------------------------------


def test_a_reduce_scatter_counts_its_operand_not_the_shard_it_returns():
    # FSDP's gradient: the whole 256 x 512 float32 gradient on each device,
    # reduced and scattered over 8 devices; its result is one eighth of it
    found = read_collectives(_text("cpu-jax0.10.2/fsdp.hlo"), MESH)
    scattered = [c for c in found if c.kind == "reduce-scatter"]
    assert [c.bytes for c in scattered] == [256 * 512 * 4] * 2
    assert all(c.axes == ("data", "model") and c.group_size == 8 for c in scattered)


def test_an_async_start_counts_its_result_once():
    # XLA:TPU's collective-permute-start returns (operand, result, context...) and
    # its all-to-all-start ((operands), result, context...): each moves its result
    found = read_collectives(_text("tpu-jax0.10.2/collectives.hlo"), MESH)
    assert sorted((c.kind, c.bytes) for c in found) == sorted(
        (kind, 256 * 512 * 4) for kind in KINDS[:5]
    )
    # XLA:GPU's all-gather-start returns (operand, result): the result only
    text = _module(
        "  %p = f32[1,8]{1,0} parameter(0)\n"
        "  %ags = (f32[1,8]{1,0}, f32[2,8]{1,0}) all-gather-start(f32[1,8]{1,0} %p), "
        "channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, "
        "use_global_device_ids=true\n"
        "  ROOT %agd = f32[2,8]{1,0} all-gather-done((f32[1,8]{1,0}, f32[2,8]{1,0}) %ags)"
    )
    [gathered] = read_collectives(text, MESH)
    assert (gathered.kind, gathered.bytes, gathered.axes) == ("all-gather", 2 * 8 * 4, ("model",))
    # an all-reduce-start returns the all-reduce's own result
    text = _module(
        "  %p = bf16[64]{0} parameter(0)\n"
        "  %ars = bf16[64]{0} all-reduce-start(%p), channel_id=1, replica_groups={}, "
        "use_global_device_ids=true, to_apply=%add\n"
        "  ROOT %ard = bf16[64]{0} all-reduce-done(%ars)"
    )
    [reduced] = read_collectives(text, MESH)
    assert (reduced.kind, reduced.bytes, reduced.axes) == ("all-reduce", 128, ("data", "model"))


def test_an_async_collective_fusion_of_xla_tpu_counts_once_at_its_start():
    # XLA:TPU repeats an async all-gather (one `chain_id`) in its start, its
    # steps and its done; each weight of the FSDP step is gathered once
    found = read_collectives(_text("tpu-jax0.10.2/fsdp.hlo"), MESH)
    assert sorted((c.kind, c.bytes, c.count) for c in found) == [
        ("all-gather", 256 * 512 * 4, 1),
        ("all-gather", 256 * 512 * 4, 1),
        ("reduce-scatter", 256 * 512 * 4, 1),
        ("reduce-scatter", 256 * 512 * 4, 1),
    ]
    assert "chain_id" in _text("tpu-jax0.10.2/fsdp.hlo")


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [
        ("f8e4m3fnuz[10]{0}", 10),
        ("f8e4m3b11fnuz[10]{0}", 10),
        ("f8e8m0fnu[10]{0}", 10),
        ("f4e2m1fn[10]{0:E(4)}", 5),
        ("s4[3]{0:E(4)}", 2),  # 12 bits, rounded up per array
        ("s4[3]", 2),  # no layout: as compiled programs pack it
        ("s4[3]{0}", 3),  # a layout without an element size: a byte each
        ("u2[2,3]{1,0:E(2)}", 2),
        ("pred[3]{0}", 3),
        ("bf16[3]{0}", 6),
        ("c64[2]{0}", 16),
        ("c128[2]{0}", 32),
        ("(s4[4]{0:E(4)}, f32[2]{0}, token[])", 2 + 8),
        ("f32[<=8,2]{1,0}", 64),  # a bounded dynamic dim by its bound
        ("f32[16,16]{1,0:T(8,128)S(1)}", 1024),  # TPU tiles pad memory, not data
    ],
)
def test_dtype_sizes_come_from_a_table_and_sub_byte_arrays_are_packed(shape, nbytes):
    line = f"  %a = {shape} all-gather(%x), replica_groups={{}}, dimensions={{0}}"
    text = _module("  %x = f32[1]{0} parameter(0)\n" + line)
    [gathered] = read_collectives(text, MESH)
    assert gathered.bytes == nbytes


def test_the_dtype_table_has_every_primitive_type_of_this_xla():
    from jax._src.lib import xla_client  # pyright: ignore[reportPrivateImportUsage]

    names = {n.lower() for n in dir(xla_client.PrimitiveType) if n.isupper()}
    names -= {"primitive_type_invalid", "tuple"}  # no array has these
    names = {"opaque" if n == "opaque_type" else n for n in names}
    assert names <= set(DTYPE_BITS)
    assert DTYPE_BITS["s4"] == 4
    assert DTYPE_BITS["f8e4m3fnuz"] == 8


def test_every_narrow_dtype_of_xla_tpu_reads_at_its_own_size():
    # XLA:TPU gathers 4-bit types packed two to a byte and 8-bit floats as they
    # are (the digits of `f8e4m3fnuz` once made it 105 bytes an element)
    found = read_collectives(_text("tpu-jax0.10.2/dtypes.hlo"), MESH)
    elements = 4 * 2 * 5
    assert sorted(c.bytes for c in found) == sorted(
        [elements // 2] * 3 + [elements] * 8 + [2 * elements] + [elements]
    )


class _Stacked(eqx.Module):
    weights: jax.Array  # (layers, width, width)


def test_a_scan_over_stacked_layers_counts_every_layer_on_every_device():
    model = _Stacked(jnp.zeros((6, 64, 64)))
    x = jnp.zeros((16, 64))

    def step(model, x):
        def loss(model):
            def layer(x, w):
                return jnp.tanh(x @ w), None

            return jnp.sum(jax.lax.scan(layer, x, model.weights)[0] ** 2)

        return jax.grad(loss)(model)

    c = eqshard.cost(model, x, step=step, spec="... -> * ...", batch="... -> * ...", devices=8)
    # each device runs all 6 layers, forward (x @ w) and backward (dx, dw)
    assert c.flops == 6 * 3 * 2 * 16 * 64 * 64  # 2.36 MFLOP, not 0.40


class _Switched(eqx.Module):
    weight: jax.Array  # (width, width)


def test_a_switch_counts_its_most_expensive_branch_not_every_branch():
    model = _Switched(jnp.zeros((64, 64)))
    index = jnp.zeros((), jnp.int32)
    x = jnp.zeros((64, 64))

    def step(model, index, x):
        def branch(k):
            def run(w, x):
                for _ in range(1 + (k == 5)):  # branch 5 runs two products
                    x = jnp.tanh(x @ w)
                return x

            return run

        return jax.lax.switch(index, [branch(k) for k in range(8)], model.weight, x)

    c = eqshard.cost(model, index, x, step=step, spec="... -> * ...", devices=8)
    # the batch is split over 8 devices: each runs 8 rows through branch 5's two
    # products, not the products of all 8 branches
    assert c.flops == 2 * 2 * 8 * 64 * 64


def test_a_switch_counts_of_each_kind_the_branch_that_moves_the_most():
    found = read_collectives(_text("cpu-jax0.10.2/switch.hlo"), MESH)
    assert sorted((c.kind, c.bytes, c.count, c.axes) for c in found) == [
        ("all-gather", 4 * 16 * 64 * 4, 1, ("model",)),
        ("all-reduce", 16 * 64 * 4, 1, ("model",)),
    ]


_GEMM = (
    "  %gemm = (f32[16,32]{1,0}, s8[4194304]{0}) custom-call(f32[16,64]{1,0} %a, "
    'f32[64,32]{1,0} %b), custom_call_target="__cublas$gemm", backend_config={'
    '"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":{'
    '"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
    '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},'
    '"alpha_imag":0,"epilogue":"DEFAULT"}}'
)
_CONVOLUTION = (
    "  %conv = (f32[1,8,8,16]{3,2,1,0}, u8[0]{0}) custom-call(%x, %k), "
    "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, "
    'custom_call_target="__cudnn$convForward", backend_config={"cudnn_conv_backend_config":{}}'
)


def test_xla_gpus_cublas_and_cudnn_calls_count_as_the_products_they_are():
    # XLA:GPU's cost analysis counts none of them: eqshard reads their shapes
    # (lines as XLA:GPU writes them; no GPU text is in the corpus yet)
    operands = (
        "  %a = f32[16,64]{1,0} parameter(0)\n  %b = f32[64,32]{1,0} parameter(1)\n"
        "  %x = f32[1,8,8,4]{3,2,1,0} parameter(2)\n  %k = f32[3,3,4,16]{3,2,1,0} parameter(3)\n"
    )
    module = parse(_module(operands + _GEMM + "\n" + _CONVOLUTION))
    assert flops(module) == 2 * 16 * 32 * 64 + 2 * (8 * 8 * 16) * (3 * 3 * 4)


def test_a_pallas_kernel_counts_its_own_cost_estimate():
    module = parse(_text("tpu-jax0.10.2/kernel.hlo"))
    assert any(
        i.attributes.get("custom_call_target") == '"tpu_custom_call"'
        for i in module.instructions.values()
    )
    assert flops(module) == 2 * 256 * 128 * 256


# What eqshard cannot read ------------------------------------------------------


_ADD = "  %x = f32[8]{0} parameter(0)\n"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            "  %y = f32[8]{0} all-reduce-scatter(%x), replica_groups={}",
            r"line 5 of the compiled HLO: the collective `all-reduce-scatter` is not one "
            r"eqshard knows \(it knows all-reduce, all-gather, reduce-scatter, "
            r"collective-permute, all-to-all, ragged-all-to-all, collective-broadcast, their "
            r"async `-start`/`-done` pairs and `async-start`\); the figures would be wrong "
            r"without it, so none are given\. Please report it to eqshard with the line:\n"
            r"  %y = f32\[8\]\{0\} all-reduce-scatter",
        ),
        (
            "  %y = f32[8]{0} collective-gather(%x), replica_groups={}",
            r"line 5 .*the collective `collective-gather` is not one eqshard knows",
        ),
        (
            "  %y = f32[8]{0} all-reduce(%x), replica_groups=ring[8], to_apply=%add",
            r"line 5 .*: the device groups `ring\[8\]` are in no notation eqshard knows",
        ),
        (
            "  %y = f32[8]{0} all-reduce(%x), replica_groups=[2,4]<=[9], to_apply=%add",
            r"line 5 .*: its device groups' iota does not fit its dims",
        ),
        (
            "  %y = f32[8]{0} all-gather(%x), replica_groups=mesh['a'=2,'b'=4] {'c'}, "
            "dimensions={0}",
            r"line 5 .*: the device groups `mesh\['a'=2,'b'=4\] \{'c'\}` are in no notation",
        ),
        (
            "  %y = f9e9[8]{0} all-reduce(%x), replica_groups={}, to_apply=%add",
            r"line 5 .*: the dtype `f9e9` is not one eqshard knows \(it knows pred, s1, u1, ",
        ),
        (
            "  %y = f32[8]{0} reduce-scatter(%z), replica_groups={}, dimensions={0}",
            r"line 5 .*: its operand %z is defined nowhere in the text",
        ),
        (
            "  %y = (f32[8]{0}, u32[]) send(%x, %t), channel_id=2",
            r"line 5 .*: `send` moves data between devices point to point, which eqshard does "
            r"not count",
        ),
        (
            '  %y = f32[8]{0} custom-call(%x, %x), custom_call_target="__onednn$matmul"',
            r"line 5 .*: the call `__onednn\$matmul` looks like a matrix product, and eqshard "
            r"does not know its FLOPs",
        ),
        (
            "  %y = f32[?,8]{1,0} all-reduce(%x), replica_groups={}, to_apply=%add",
            r"line 5 .*: the dim `\?` of its shape has no size eqshard can read",
        ),
    ],
)
def test_what_eqshard_cannot_read_is_an_error_naming_it_and_its_line(line, message):
    text = _module(_ADD + line)
    with pytest.raises(eqshard.EqshardError, match=message):
        _read(text)


def _read(text):
    module = parse(text)
    return collectives(module), flops(module)


def test_replica_groups_of_every_device_need_the_device_count():
    text = "ENTRY %main () -> f32[] {\n" + _ADD + "  %y = f32[8]{0} all-reduce(%x), "
    text += "replica_groups={}, to_apply=%add\n}\n"
    with pytest.raises(eqshard.EqshardError, match=r"`replica_groups=\{\}` means every device"):
        collectives(parse(text))
    [op] = collectives(parse(text, devices=4))
    assert op.groups == ((0, 1, 2, 3),)


def test_an_instruction_outside_any_computation_is_an_error():
    # a computation header eqshard did not recognise would hide its collectives
    text = "HloModule m\n\n%main = f32[8]{0} all-reduce(%x), replica_groups={}\n"
    with pytest.raises(eqshard.EqshardError, match=r"line 3 .*an instruction outside any comp"):
        parse(text)


# libtpu 0.0.50.1 (JAX 0.12) on a v5p offloads `take_along_axis`'s gather to the
# SparseCores: their computations end with an attribute after the closing brace. These
# lines are its own, trimmed; before, eqshard stopped at the first such `}`.
SPARSECORE = """HloModule m, num_partitions=4

%called_computation.1 (param_0.46: f32[16,2048,8016], param_1.63: s32[32768]) -> f32[32768] {
  %param_1.63 = s32[32768]{0:T(1024)} parameter(1)
  %param_0.46 = f32[16,2048,8016]{1,2,0:T(8,128)} parameter(0)
  ROOT %gather.3 = f32[32768]{0:T(1024)} fusion(%param_0.46, %param_1.63), kind=kCustom, calls=%f
}, execution_thread="sparsecore"

%called_computation (param_0.48: f32[16,2048,8016], param_1.67: s32[32768]) -> f32[32768] {
  %param_0.48 = f32[16,2048,8016]{1,2,0:T(8,128)} parameter(0)
  %param_1.67 = s32[32768]{0:T(1024)} parameter(1)
  %start = ((f32[16,2048,8016]{1,2,0:T(8,128)}, s32[32768]{0:T(1024)}), f32[32768]{0:T(1024)}, u32[]{:S(8)}) call-start(%param_0.48, %param_1.67), async_execution_thread="sparsecore", to_apply=%called_computation.1
  ROOT %done = f32[32768]{0:T(1024)} call-done(%start)
}, execution_thread="sparsecore"

ENTRY %main.2_spmd (param: f32[16,2048,8016], param.1: s32[32768]) -> f32[] {
  %param = f32[16,2048,8016]{1,2,0:T(8,128)} parameter(0)
  %param.1 = s32[32768]{0:T(1024)} parameter(1)
  %sum = f32[]{:T(128)} constant(0)
  ROOT %all-reduce = f32[]{:T(128)} all-reduce(%sum), channel_id=1, replica_groups=mesh['data'=4] {'data'}, use_global_device_ids=true, to_apply=%add
}
"""


def test_a_sparsecore_computation_ends_with_its_execution_thread_and_the_rest_reads():
    module = parse(SPARSECORE, devices=4)
    assert list(module.computations) == [
        "called_computation.1",
        "called_computation",
        "main.2_spmd",
    ]
    assert module.entry == "main.2_spmd"
    assert [i.opcode for i in module.computations["called_computation"].instructions][2:] == [
        "call-start",
        "call-done",
    ]
    (op,) = collectives(module)
    assert (op.kind, op.bytes, op.groups) == ("all-reduce", 4, ((0, 1, 2, 3),))


def test_a_piece_of_an_async_collective_fusion_without_its_start_is_an_error():
    text = _text("tpu-jax0.10.2/fsdp.hlo").replace('"AsyncCollectiveStart"', '"Elsewhere"')
    with pytest.raises(eqshard.EqshardError, match=r"async collective fusion \(chain_id=0\)"):
        collectives(parse(text))


def test_a_cost_and_so_a_budget_never_passes_on_what_it_could_not_read(monkeypatch):
    # `eqshard.testing`'s `max_communication` checks the collectives of `cost`:
    # a compiled step eqshard cannot read fails `cost` before any budget is met
    from eqshard._cost import _driver

    unknown = _module(_ADD + "  ROOT %y = f32[8]{0} all-gather-scatter(%x), replica_groups={}")
    real = _driver.compile_step  # the real analyses, and a text eqshard cannot read
    monkeypatch.setattr(
        _driver,
        "compile_step",
        lambda lowered, options=None: dataclasses.replace(real(lowered, options), text=unknown),
    )
    model = _Switched(jnp.zeros((8, 8)))
    with pytest.raises(eqshard.EqshardError, match="the collective `all-gather-scatter`"):
        eqshard.cost(model, jnp.zeros((8, 8)), step=lambda m, x: m.weight @ x, spec="... -> * ...")


# Device groups -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("notation", "groups"),
    [
        ("replica_groups={{0,1},{2,3}}", [[0, 1], [2, 3]]),
        ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=[4,2]<=[2,2,2]T(0,2,1)", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("replica_groups=mesh['x'=2,'y'=4] {'y'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=mesh['x'=2,'y'=4] {'y','x'}", [[0, 4, 1, 5, 2, 6, 3, 7]]),
        ("replica_groups=mesh['x'=2,'y'=4] {'y':(2)2}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("replica_groups=mesh['x'=2,'y'=4] {'y':(1)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) "
            "{'axis_0':(2)2}",
            [[0, 1], [2, 3], [4, 5], [6, 7]],
        ),
        (
            "replica_groups=mesh['a'=2,'b'=4], device_ids=(7,6,5,4,3,2,1,0) {'a'}",
            [[7, 3], [6, 2], [5, 1], [4, 0]],
        ),
        ("source_target_pairs={{0,1},{1,0}}", [[0, 1], [1, 0]]),
    ],
)
def test_every_device_group_notation_reads_as_its_groups(notation, groups):
    line = f"  %y = f32[8]{{0}} all-reduce(%x), channel_id=1, {notation}, to_apply=%add"
    if notation.startswith("source"):
        line = f"  %y = f32[8]{{0}} collective-permute(%x), channel_id=1, {notation}"
    [op] = collectives(parse(_module(_ADD + line)))
    assert [list(g) for g in op.groups] == groups


def test_the_three_notations_of_one_resharding_read_alike():
    # JAX 0.8 writes an iota, 0.10 a mesh with device ids and a sub-axis, 0.12 the
    # user's axis names with a sub-axis: the same groups
    read = {
        version: sorted(
            (c.kind, c.bytes, frozenset(map(frozenset, c.groups)))
            for c in collectives(parse(_text(f"cpu-jax{version}/notations.hlo")))
        )
        for version in ("0.8.1", "0.10.2", "0.12.0.1")
    }
    assert read["0.8.1"] == read["0.10.2"] == read["0.12.0.1"]
    texts = {v: _text(f"cpu-jax{v}/notations.hlo") for v in ("0.8.1", "0.10.2", "0.12.0.1")}
    assert "<=[2,4]T(1,0)" in texts["0.8.1"]
    assert "device_ids=(" in texts["0.10.2"]
    assert ":(2)2}" in texts["0.10.2"]
    assert "mesh['data'=2,'model'=4]" in texts["0.12.0.1"]


def test_a_collective_in_a_branch_that_never_wins_is_left_out_and_nested_loops_multiply():
    text = """\
HloModule m, num_partitions=8

%small (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%p), replica_groups={}, to_apply=%add
}

%large (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  %ag = f32[16]{0} all-gather(%q), replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %ar2 = f32[16]{0} all-reduce(%ag), replica_groups={}, to_apply=%add
}

ENTRY %main (x: f32[4], i: s32[]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %c = f32[4]{0} conditional(%i, %x, %x), branch_computations={%small, %large}
}
"""
    found = collectives(parse(text))
    assert [(c.kind, c.bytes, c.line) for c in found] == [
        ("all-gather", 64, 10),
        ("all-reduce", 64, 11),  # the large branch's, not the small one's too
    ]


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    size=st.integers(1, 12),
    window=st.integers(1, 6),
    stride=st.integers(1, 4),
    dilate=st.integers(1, 4),
    spread=st.integers(1, 3),
    low=st.integers(0, 5),
    high=st.integers(0, 5),
)
def test_the_taps_that_meet_the_input_agree_with_counting_each(
    size, window, stride, dilate, spread, low, high
):
    """A convolution's real taps along one dim, counted per tap in closed form,
    equal those counted one (output, tap) pair at a time."""
    dilated = (size - 1) * dilate + 1
    outputs = max(0, (dilated + low + high - ((window - 1) * spread + 1)) // stride + 1)
    at = {"stride": stride, "pad": (low, high), "lhs_dilate": dilate, "rhs_dilate": spread}
    one_by_one = sum(
        1
        for o in range(outputs)
        for j in range(window)
        if 0 <= o * stride + j * spread - low < dilated
        and (o * stride + j * spread - low) % dilate == 0
    )
    assert _real_taps(size, outputs, window, at) == one_by_one


def _conv(**kwargs):
    return lambda x, k: jax.lax.conv_general_dilated(
        x, k, dimension_numbers=("NHWC", "HWIO", "NHWC"), **kwargs
    )


@pytest.mark.parametrize(
    ("f", "shapes", "hand"),
    [
        (  # XLA:TPU writes it as a convolution of window 8x4, lhs_dilate=8x4
            lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k),
            [(8, 4, 128, 64), (8, 4, 128, 64)],
            2 * 8 * 4 * 128 * 128 * 64,
        ),
        (
            lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k),
            [(16, 64, 32), (16, 64, 32)],
            2 * 16 * 64 * 64 * 32,
        ),
        # XLA:TPU writes these as a multiply and a sum (`multiply_reduce_fusion`)
        (jnp.dot, [(64, 32), (32,)], 2 * 64 * 32),
        (lambda a, b: jnp.dot(b, a), [(64, 32), (64,)], 2 * 64 * 32),
        (_conv(window_strides=(1, 1), padding="SAME"), [(2, 9, 9, 8), (3, 3, 8, 16)], None),
        (
            _conv(window_strides=(1, 1), padding=((2, 1), (1, 2)), lhs_dilation=(2, 2)),
            [(2, 5, 5, 8), (3, 3, 8, 16)],
            None,
        ),
        (
            _conv(window_strides=(2, 2), padding="VALID", feature_group_count=4),
            [(2, 9, 9, 8), (3, 3, 2, 16)],
            None,
        ),
    ],
)
def test_tpu_products_count_as_the_compiler_and_the_hand_count(f, shapes, hand):
    """XLA:TPU's own cost analysis, and a hand count where there is one, against
    eqshard's reading of the same program: a convolution's taps that meet the
    input, and a matrix-vector product XLA:TPU writes as a multiply and a sum."""
    pytest.importorskip("libtpu", reason="the TPU compiler comes with libtpu")
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from eqshard._cost._targets import compile_target

    device = compile_target("v5e:2x4").devices[:1]
    whole = NamedSharding(Mesh(np.array(device), ("d",)), PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=whole) for s in shapes]
    compiled = jax.jit(f).lower(*args).compile()
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    assert costs is not None
    counted = flops(parse(compiled.as_text() or ""))
    if hand is not None:
        assert counted == hand
    # XLA counts a sum of n products as n multiplies and n - 1 adds (eqshard 2n, as
    # for a `dot`), and elementwise work besides
    assert 0.98 * counted <= costs["flops"] < 1.01 * counted
