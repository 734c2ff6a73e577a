"""`Cost.explain()`: why each collective of a compiled step moves what it moves, on
real `eqx.nn` models and the 8 simulated CPU devices."""

import inspect
import io

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import rich.console
from jax.sharding import AxisType

import eqshard
from eqshard._cost._hlo._parse import parse

OPTIMIZER = optax.adam(1e-3)
D = 64
MLP = eqx.filter_eval_shape(lambda: eqx.nn.MLP(D, D, 256, 1, key=jax.random.key(0)))
WEIGHTS = ("layers.0.weight", "layers.1.weight")
PARAMETERS = ("layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias")
BATCH = jax.ShapeDtypeStruct((1024, D), jnp.float32)  # more rows than weights: FSDP gathers these
MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _records_stacks() -> bool:
    """Whether this JAX records each op's whole Python stack in the compiled HLO (JAX
    0.10 does); JAX 0.8.1 records only the innermost frame outside JAX, which for an
    `eqx.nn.Linear`'s matmul is Equinox's own, so no line of the user's is known."""
    text = jax.jit(lambda x: x * 2).lower(jnp.ones(2)).compile().as_text() or ""
    return "stack_frame_id" in text


STACKS = _records_stacks()


def _state(model):
    return jax.eval_shape(
        OPTIMIZER.init, eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    )


@eqx.filter_jit(donate="all-except-first")
def step(model, state, x):
    def loss(m):
        y = jax.vmap(m)(x)  # the model's matmuls
        return jnp.mean(y**2)

    value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, state = OPTIMIZER.update(grads, state)
    return eqx.apply_updates(model, updates), state, value


def _line(fn, marker):
    """The line of `fn`'s source (in this file) that holds `marker`."""
    lines, first = inspect.getsourcelines(fn)
    [found] = [first + k for k, text in enumerate(lines) if marker in text]
    return found


def _explain(model, spec, batch, **kwargs):
    c = eqshard.cost(model, _state(model), batch[0], step=step, spec=spec, batch=batch[1], **kwargs)
    return c, list(c.explain())


def test_fsdp_gathers_each_weight_where_the_step_uses_it_and_sums_its_gradient():
    fsdp = eqshard.load({"eqshard": 1, "default": "fsdp"})
    c, explained = _explain(MLP, fsdp, (BATCH, "b ... -> b* ..."), devices=8)
    assert len(explained) == len(c.collectives)
    gathers = [e for e in explained if e.collective.kind == "all-gather"]
    assert {leaf for e in gathers for leaf in e.leaves} >= set(WEIGHTS)
    line = _line(step, "# the model's matmuls")
    for e in gathers:
        [leaf] = e.leaves
        assert leaf in PARAMETERS
        if STACKS:
            assert (e.file, e.line) == (__file__, line)
        else:  # at most the nearest op of the user's that touches it
            assert e.file in ("", __file__)
        assert e.reason == (
            f"`{leaf}` is split over `{e.collective.axes[0]}` and the step uses it whole: "
            "gathered before use"
        )
    sums = [e for e in explained if e.collective.kind in ("all-reduce", "reduce-scatter")]
    assert {leaf for e in sums for leaf in e.leaves} == set(PARAMETERS)
    assert all("summed over" in e.reason for e in sums)


def test_data_parallel_sums_each_gradient():
    c, explained = _explain(MLP, "... -> * ...", (BATCH, "b ... -> b* ..."), devices=8)
    assert explained
    assert {e.collective.kind for e in explained} == {"all-reduce"}
    assert {leaf for e in explained for leaf in e.leaves} == set(PARAMETERS)
    for e in explained:
        assert e.leaves
        assert e.known
        assert "summed over `" in e.reason
        assert all(f"`{leaf}`" in e.reason for leaf in e.leaves)
    assert "gradients of `layers.0.weight`" in str(c.explain())
    console = rich.console.Console(width=200, record=True, file=io.StringIO())
    console.print(c.explain())
    assert "summed over" in console.export_text()


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __call__(self, x):
        h = jax.nn.relu(self.up(x))
        return self.down(h)  # the second matmul


MEGATRON = eqshard.load(
    {
        "eqshard": 1,
        "rules": [
            {"path": "up.weight", "expr": "o i -> * o4 i"},
            {"path": "up.bias", "expr": "o -> * o4"},
            {"path": "down.weight", "expr": "o i -> * o i4"},
        ],
    }
)


def test_megatron_sums_the_second_matmuls_output_over_the_model_axis():
    keys = jax.random.split(jax.random.key(0))
    block = eqx.filter_eval_shape(
        lambda: Block(eqx.nn.Linear(D, 256, key=keys[0]), eqx.nn.Linear(256, D, key=keys[1]))
    )
    _, explained = _explain(block, MEGATRON, (BATCH, "b ... -> b2 ... 4"), mesh=MESH)
    line = _line(Block.__call__, "# the second matmul")
    [activation] = [e for e in explained if e.collective.axes == ("model",)]
    assert activation.collective.kind == "all-reduce"
    if STACKS:
        assert (activation.file, activation.line) == (__file__, line)
        assert activation.reason == (
            f"the output of the matmul at {__file__}:{line} is summed over `model`: its "
            "contracting dim is split"
        )
    else:  # JAX 0.8.1 records the matmul at Equinox's Linear
        assert activation.file in ("", __file__)
        assert activation.reason == (
            "the output of the matmul is summed over `model`: its contracting dim is split"
        )
    assert activation.leaves == ("down.weight",)
    gradients = [e for e in explained if e.collective.axes == ("data",)]
    assert {leaf for e in gradients for leaf in e.leaves} == {
        "up.weight",
        "up.bias",
        "down.weight",
        "down.bias",
    }
    assert all("summed over `data`" in e.reason for e in gradients)


class Attention(eqx.Module):
    qkv: eqx.nn.Linear

    def __call__(self, x):
        wq, wk, wv = jnp.split(self.qkv.weight, 3)  # the fused qkv, cut
        q, k, v = x @ wq.T, x @ wk.T, x @ wv.T
        return jax.nn.softmax(q @ k.T, axis=-1) @ v


def test_a_fused_qkv_split_over_model_and_sliced_moves_its_parts():
    """XLA:CPU cuts the weight's rows split over `model` into q, k and v with
    collective-permutes of their parts, not with an all-gather before the slice. (JAX
    0.12's XLA:CPU also makes the weight's update split and gathers it back whole.)"""
    attention = eqx.filter_eval_shape(
        lambda: Attention(eqx.nn.Linear(D, 3 * D, key=jax.random.key(0)))
    )
    rules = eqshard.load(
        {
            "eqshard": 1,
            "rules": [
                {"path": "qkv.weight", "expr": "o i -> * o4 i"},
                {"path": "qkv.bias", "expr": "o -> * o4"},
            ],
        }
    )
    batch = jax.ShapeDtypeStruct((8, 16, D), jnp.float32)
    _, explained = _explain(attention, rules, (batch, "b ... -> b2 ... 4"), mesh=MESH)
    line = _line(Attention.__call__, "# the fused qkv, cut")
    permutes = [e for e in explained if e.collective.kind == "collective-permute"]
    assert permutes
    for e in [e for e in explained if e.collective.kind == "all-gather"]:
        assert e.leaves == ("qkv.weight",)
        assert e.reason.startswith("the update of `qkv.weight` is made split over `model`")
    for e in permutes:
        assert e.leaves == ("qkv.weight",)
        assert (e.file, e.line) == (__file__, line)
        assert e.reason.startswith(
            "`qkv.weight` is split over `model` and the step slices it across the split's "
            "boundaries"
        )


def test_the_parser_reads_each_instructions_python_stack():
    text = jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(3)).compile().as_text() or ""
    module = parse(text)
    stacks = [module.stack(i) for i in module.instructions.values()]
    assert any(frame.file == __file__ for stack in stacks for frame in stack)
    legacy = parse(
        "HloModule m\n\nENTRY %main (p: f32[2]) -> f32[2] {\n"
        '  ROOT %p = f32[2]{0} parameter(0), metadata={op_name="x" source_file="a.py" '
        "source_line=7}\n}\n"
    )
    [frame] = legacy.stack(legacy.instructions["p"])
    assert (frame.file, frame.line) == ("a.py", 7)


def test_zero1_gathers_each_update_made_on_the_split_optimizer_state():
    """ZeRO-1: the parameters whole, Adam's moments split over the devices. Each
    parameter's update is made on its part of the moments, then gathered back whole
    for the model's layout: each all-gather names the parameter it rebuilds."""
    zero1 = eqshard.load(
        {
            "eqshard": 1,
            "mesh": [["data", "*"]],
            "default": "replicate",
            "optimizer": {"rules": [{"path": "**", "expr": "fsdp"}], "default": "parameter"},
        }
    )
    _, explained = _explain(MLP, zero1, (BATCH, "b ... -> b8 ..."), devices=8)
    gathers = [e for e in explained if e.collective.kind == "all-gather"]
    assert gathers
    assert {leaf for e in gathers for leaf in e.leaves} == set(PARAMETERS)  # each divides by 8
    for e in gathers:
        names = ", ".join(f"`{leaf}`" for leaf in e.leaves)
        assert e.reason == (
            f"the update of {names} is made split over `data`, and the model holds it whole: "
            "gathered after the update"
        )


def _demo_gpt():
    from eqshard._demo import _model as gpt, _run as demo

    model = eqx.filter_eval_shape(gpt.build)
    state = eqx.filter_eval_shape(
        gpt.adamw_init, eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    )
    tokens = jax.ShapeDtypeStruct((gpt.BATCH, gpt.SEQ + 1), jnp.int32)
    return model, state, tokens, demo


def test_a_scanned_stacks_gradients_and_gathers_name_their_layers():
    """The demo's GPT, its blocks stacked and scanned (a `while` loop): data parallel
    sums every parameter's gradient, the blocks' inside the loop, each named; under
    FSDP each all-gather that names a leaf names one the plan splits, the blocks'
    among them."""
    model, state, tokens, demo = _demo_gpt()
    step = demo.make_step()
    rows = eqshard.report(model, "... -> * ...").to_json()["leaves"]
    names = {row["path"] for row in rows}
    dp = eqshard.load(demo.SPECS / "data-parallel.eqshard.json")
    explained = list(eqshard.cost(model, state, tokens, step=step, spec=dp).explain())
    assert not [e for e in explained if e.reason.startswith("eqshard cannot tell")]
    assert {leaf for e in explained for leaf in e.leaves} == names
    fsdp = eqshard.load(demo.SPECS / "fsdp.eqshard.json")
    split = {
        row["path"]
        for row in eqshard.report(model, fsdp).to_json()["leaves"]
        if row["bytes_per_device"] < row["total_bytes"]
    }
    gathered = {
        leaf
        for e in eqshard.cost(model, state, tokens, step=step, spec=fsdp).explain()
        if e.collective.kind == "all-gather"
        for leaf in e.leaves
    }
    assert gathered <= split
    assert {n for n in gathered if n.startswith("blocks.")}  # inside the scan's loop
