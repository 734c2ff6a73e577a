"""`Cost.explain()`: why each collective of a compiled step moves what it moves, on
real `eqx.nn` models and the 8 simulated CPU devices."""

import importlib.util
import inspect
import io
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
import rich.console
import vit_model
from jax.sharding import AxisType

import eqshard
from eqshard._cost._hlo._parse import parse
from eqshard._demo import _model as gpt_model, _run as demo_run

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


STRATEGIES = ("data-parallel", "zero-1", "fsdp", "megatron", "2d")


@pytest.fixture(scope="module")
def demo():
    """The demo's GPT costed under each of the five classic strategies (one compile
    each, shared by the tests below), and the names of its parameters."""
    model, state, tokens, run = _demo_gpt()
    step = run.make_step()
    costs = {
        name: eqshard.cost(
            model, state, tokens, step=step, spec=eqshard.load(run.SPECS / f"{name}.eqshard.json")
        )
        for name in STRATEGIES
    }
    names = {row["path"] for row in eqshard.report(model, "... -> * ...").to_json()["leaves"]}
    return costs, names


def _at(marker: str, path: str = gpt_model.__file__) -> str:
    """`file:line` of the line of `path` that holds `marker`, where this JAX records
    the user's lines; else `""` (JAX 0.8.1 records only the innermost frame)."""
    with open(path) as f:
        [line] = [k for k, text in enumerate(f, 1) if marker in text]
    return f"{path}:{line}" if STACKS else ""


ATTENTION = "x = x + self.attn(y, y, y"
MLP_LINE = "return x + jax.vmap(self.down)"
EMBEDDING = "x = jnp.vectorize(self.embed"
LOGITS = "return jnp.vectorize(lambda v: self.unembed"
SOFTMAX = "logp = jax.nn.log_softmax"
TARGETS = "return -jnp.mean(jnp.take_along_axis"


def _shape(e):
    """A collective as a hand analysis writes it: its kind, axes, line, leaves (as a
    set) and reason, with its lines (`at file:line`) left out and its leaves' names
    written `*`."""
    reason = re.sub(r" at \S+:\d+", "", e.reason)
    for leaf in e.leaves:
        reason = reason.replace(f"`{leaf}`", "`*`")
    reason = re.sub(r"`\*`(, `\*`)+", "`*`", reason)
    where = e.where if STACKS else ""  # JAX 0.8.1: the innermost frame's, whichever it is
    return e.collective.kind, e.collective.axes, where, frozenset(e.leaves), reason


QKV = frozenset(f"blocks.attn.{p}_proj.weight" for p in ("query", "key", "value"))
MODEL_SUMS = [  # Megatron's collectives over `model`, by hand (2-D has the same)
    (
        ATTENTION,
        QKV,
        "in the backward pass, the gradients of the inputs of the matmuls of `*` "
        "are summed over `model`: each matmul's output dim, which the backward contracts, is "
        "split",
    ),
    (
        ATTENTION,
        {"blocks.attn.output_proj.weight"},
        "the output of the matmul is summed over `model`: its contracting dim is split",
    ),
    (
        MLP_LINE,
        {"blocks.down.weight"},
        "the output of the matmul is summed over `model`: its contracting dim is split",
    ),
    (
        MLP_LINE,
        {"blocks.up.weight"},
        "in the backward pass, the gradient of the input of the "
        "matmul of `*` is summed over `model`: the matmul's output dim, which the backward "
        "contracts, is split",
    ),
    (
        LOGITS,
        {"unembed.weight"},
        "in the backward pass, the gradient of the input of the "
        "matmul of `*` is summed over `model`: the matmul's output dim, which the backward "
        "contracts, is split",
    ),
    (
        EMBEDDING,
        {"embed.weight"},
        "`eqx.nn.Embedding` gathers from `*`, split over `model` "
        "along the dim it indexes: each device gathers what it holds, summed over `model`",
    ),
    (
        SOFTMAX,
        {"unembed.weight"},
        "the max in `log_softmax` runs over a dim of an activation "
        "from the matmul of `*` split over `model`: each device reduces its part, combined by "
        "max over `model`",
    ),
    (
        SOFTMAX,
        {"unembed.weight"},
        "the sum in `log_softmax` runs over a dim of an activation "
        "from the matmul of `*` split over `model`: each device reduces its part, summed over "
        "`model`",
    ),
    (
        TARGETS,
        {"unembed.weight"},
        "`take_along_axis` gathers from an activation from the "
        "matmul of `*`, split over `model` along the dim it indexes: each device gathers what it "
        "holds, summed over `model`; the sum in the backward pass of `log_softmax` runs over a "
        "dim of an activation split over `model`: each device reduces its part, summed over "
        "`model`",
    ),
]


def _expected(table, kind="all-reduce", axes=("model",)):
    return {(kind, axes, _at(m), frozenset(leaves), why) for m, leaves, why in table}


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_collective_of_the_demo_gpt_is_explained_at_the_models_lines(demo, name):
    costs, _ = demo
    explained = list(costs[name].explain())
    assert explained
    assert [e.reason for e in explained if not e.known] == []
    model_file, step_file = gpt_model.__file__, demo_run.__file__
    for e in explained:
        assert e.file in ((model_file, step_file) if STACKS else ("", model_file, step_file))


def test_megatron_sums_activations_over_model_and_no_gradient(demo):
    """Megatron with a whole batch: no gradient is summed. Forward, the row-parallel
    layers' outputs (attention's output projection, the MLP's second layer); backward,
    the column-parallel layers' inputs' gradients (q, k, v, the MLP's first layer, the
    vocab-parallel logits); the vocab-parallel embedding's lookup; log_softmax's max and
    sum over the vocabulary split over `model`; the targets' logits picked from it."""
    costs, _ = demo
    found = {_shape(e) for e in costs["megatron"].explain()}
    assert found == _expected(MODEL_SUMS)
    assert not [e for e in costs["megatron"].explain() if e.reason.startswith("the gradient")]


def test_2d_sums_megatrons_activations_over_model_and_the_gradients_over_data(demo):
    costs, names = demo
    explained = list(costs["2d"].explain())
    over_model = {_shape(e) for e in explained if e.collective.axes == ("model",)}
    assert over_model == _expected(MODEL_SUMS)
    over_data = [e for e in explained if e.collective.axes == ("data",)]
    assert {leaf for e in over_data for leaf in e.leaves} == names
    for e in over_data:
        assert e.reason.startswith("the gradients of ")
        assert e.collective.kind == "all-reduce"


def test_data_parallel_and_zero1_sum_every_gradient_and_the_loss(demo):
    """Both sum every gradient over `data`, and the loss's sum over the batch with
    them; ZeRO-1 then gathers each parameter's update, made where its moments are."""
    costs, names = demo
    for name in ("data-parallel", "zero-1"):
        sums = [e for e in costs[name].explain() if e.collective.kind == "all-reduce"]
        gradients = {leaf for e in sums for leaf in e.leaves if e.reason.startswith("the grad")}
        assert gradients == names
        [loss] = [e for e in sums if "; the sum" in e.reason]
        assert _shape(loss)[2] == _at(TARGETS)
        assert _shape(loss)[4].endswith(
            "; the sum runs over a dim of an activation from the matmul of `*` split over "
            "`data`: each device reduces its part, summed over `data`"
        )
    gathers = [e for e in costs["zero-1"].explain() if e.collective.kind == "all-gather"]
    assert {leaf for e in gathers for leaf in e.leaves} == names
    assert {_shape(e)[4] for e in gathers} == {
        "the update of `*` is made split over `data`, and the model holds it whole: gathered "
        "after the update"
    }


def test_fsdp_gathers_weights_and_runs_the_mlp_on_gathered_activations(demo):
    """FSDP: each weight gathered where it is used, but XLA:CPU runs the MLP (whose
    weights are split on their hidden dim) as tensor parallelism over `data`: it gathers
    the activations instead, sums the second layer's output and the first layer's
    input's gradient, and the weights' gradients stay split. (An activation's gather
    is recorded at the line of the op that made it, which differs by JAX version; its
    reason names the matmul's line.)"""
    costs, names = demo
    explained = list(costs["fsdp"].explain())
    shapes = {(kind, axes, leaves, why) for kind, axes, _, leaves, why in map(_shape, explained)}
    up, down = frozenset({"blocks.up.weight"}), frozenset({"blocks.down.weight"})
    data = ("data",)
    assert {
        (
            "all-gather",
            data,
            up,
            "an activation split over `data` is gathered whole for the "
            "matmul with `*`, split over `data` too: XLA moves the activation, not the weight",
        ),
        (
            "all-gather",
            data,
            down,
            "an activation split over `data` is gathered whole for the "
            "backward pass of the matmul with `*`, split over `data` too: XLA moves the "
            "activation, not the weight",
        ),
        (
            "all-gather",
            data,
            frozenset(),
            "an activation split over `data` is gathered whole for the backward pass of the matmul",
        ),
        (
            "all-reduce",
            data,
            down,
            "the output of the matmul is summed over `data`: its contracting dim is split",
        ),
        (
            "all-reduce",
            data,
            up,
            "in the backward pass, the gradient of the input of the "
            "matmul of `*` is summed over `data`: the matmul's output dim, which the backward "
            "contracts, is split",
        ),
    } <= shapes
    for e in explained:
        if STACKS and e.reason.startswith("an activation"):
            assert f"the matmul at {_at(MLP_LINE)}" in e.reason
    used = {
        leaf
        for e in explained
        if "the step uses it whole: gathered before use" in e.reason
        for leaf in e.leaves
    }
    assert used == names - {"blocks.up.weight", "blocks.up.bias", "blocks.down.weight"}
    gradients = {leaf for e in explained if e.reason.startswith("the grad") for leaf in e.leaves}
    assert gradients == names - {"blocks.up.weight", "blocks.up.bias", "blocks.down.weight"}


@pytest.fixture(scope="module")
def vit():
    """The DINOv3-style ViT (tests/vit_model.py) under data x tensor parallelism: its
    fused qkv's output dim split over `model`, its output projection row-parallel,
    the images over `data`."""
    model = vit_model.build()
    images = jax.ShapeDtypeStruct((8, 3, vit_model.IMAGE, vit_model.IMAGE), jnp.float32)
    c = eqshard.cost(model, _state(model), images, step=step, spec=eqshard.load(vit_model.SPEC))
    return list(c.explain())


def test_a_vits_fused_qkv_cut_into_q_k_v_moves_its_parts_at_the_split(vit):
    """The fused qkv's output, split over `model` in four, is cut into q, k and v at
    thirds, which do not fall on the split's boundaries. XLA:CPU moves the parts with
    collective-permutes after the slice (no all-gather before it); the backward pass
    joins q's, k's and v's gradients back with all-to-alls. Each names the block's qkv
    weight at the line of the split."""
    split = _at("# the fused qkv, split", vit_model.__file__)
    cuts = [e for e in vit if "slices it across the split's boundaries" in e.reason]
    assert cuts
    for e in cuts:
        [block] = {leaf.split(".attn.")[0] for leaf in e.leaves}
        assert set(e.leaves) == {f"{block}.attn.qkv.weight", f"{block}.attn.qkv.bias"}
        assert e.where == split or not STACKS
        if e.collective.kind == "all-gather":  # the form another XLA may choose
            assert "all-gather before the slice" in e.reason
        else:
            assert e.collective.kind == "collective-permute"
            assert _shape(e)[4] == (
                "the output of the matmul of `*` is split over `model` and the step slices it "
                "across the split's boundaries (a fused qkv cut into q, k, v): its parts move "
                "between devices"
            )
    assert {leaf for e in cuts for leaf in e.leaves} >= {
        f"blocks.{k}.attn.qkv.weight" for k in range(vit_model.DEPTH)
    }
    joins = [e for e in vit if e.reason.startswith("in the backward pass, the gradients of slices")]
    assert {leaf for e in joins for leaf in e.leaves} == {
        f"blocks.{k}.attn.qkv.weight" for k in range(vit_model.DEPTH)
    }
    assert all(e.collective.kind == "all-to-all" for e in joins)
    assert all(e.where == split for e in joins) or not STACKS


def test_every_other_collective_of_the_vit_is_named(vit):
    """No collective is left unexplained: the output projection's output summed over
    `model` (row-parallel), the qkv's input's gradient summed in the backward pass,
    and every gradient with the loss summed over `data`."""
    assert [e.reason for e in vit if not e.known] == []
    projection = _at("# the output projection", vit_model.__file__)
    sums = {_shape(e)[2:] for e in vit if e.collective.axes == ("model",)}
    for k in range(vit_model.DEPTH):
        assert (
            projection,
            frozenset({f"blocks.{k}.attn.proj.weight"}),
            "the output of the matmul is summed over `model`: its contracting dim is split",
        ) in sums
    over_data = [e for e in vit if e.collective.axes == ("data",)]
    names = {
        row["path"] for row in eqshard.report(vit_model.build(), "... -> * ...").to_json()["leaves"]
    }
    assert {leaf for e in over_data for leaf in e.leaves} == names
    assert all(e.reason.startswith("the gradients of ") for e in over_data)


@pytest.mark.slow  # an XLA:TPU compile, through libtpu, for 32 chips
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler comes with libtpu (eqshard[tpu])",
)
def test_on_xla_tpu_a_vocab_split_embedding_s_lookup_is_summed_over_model():
    """The Llama example's spec splits `embed.weight`'s vocabulary over `model` (16
    ways, on `v5p:4x4x2`). XLA:TPU gathers each device's rows in one fusion and zeroes
    those it does not hold in another (a select by a mask of booleans), then sums the
    lookups over `model`: explain names the table, the line of the lookup and why,
    as it does on XLA:CPU."""
    import suggest_model

    Llama, spec = suggest_model.Llama, suggest_model._LLAMA["LLAMA_SPEC"]
    model = eqx.filter_eval_shape(suggest_model.llama_build)
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = eqx.filter_eval_shape(suggest_model.llama_optimizer().init, params)
    found = eqshard.cost(
        model,
        opt_state,
        suggest_model.llama_batch(),
        step=suggest_model.llama_step,
        spec=eqshard.load(spec),
        target="v5p:4x4x2",
    )
    table = [e for e in found.explain() if e.leaves == ("embed.weight",)]
    line = inspect.getsourcelines(Llama.__call__)[1] + 1  # `x = jax.vmap(self.embed)(tokens)`
    # the lookup, and its gradient summed over the split vocabulary (an all-reduce on
    # JAX 0.8's XLA:TPU, a reduce-scatter on later ones)
    lookups = [e for e in table if "gathers from" in e.reason]
    sums = [e for e in table if e not in lookups]
    assert [(e.collective.kind, e.collective.axes) for e in lookups] == [("all-reduce", ("model",))]
    assert [(e.collective.axes, e.reason) for e in sums] == [
        (("model",), "the gradient of `embed.weight` is summed over `model`")
    ]
    [lookup] = lookups
    why = (
        "gathers from `embed.weight`, split over `model` along the dim it indexes: each "
        "device gathers what it holds, summed over `model`"
    )
    if STACKS:
        assert lookup.where.endswith(f"llama_8b.py:{line}")
        assert lookup.reason == f"`eqx.nn.Embedding` at {lookup.where} {why}"
    else:  # JAX 0.8.1 records only the innermost frame outside JAX, whichever it is
        assert lookup.reason.startswith("`eqx.nn.Embedding`")
        assert lookup.reason.endswith(why)
