"""The candidates of `eqshard suggest`: Megatron's pairs found in the step's jaxpr
(never from names), every strategy on every factorization of the devices, repairs
and drops with their reasons, readable rules that load back to the same layouts,
and the demo's strategies reproduced device by device.

Nothing here compiles: the steps are traced to jaxprs, and plans are made for
device counts (abstract meshes), or on the suite's 8 CPU devices."""

import dataclasses
import json
import runpy
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
import stateful_cost_model
from jaxtyping import Array, Float
from optimizer_state_oracle import blocks

import eqshard
from eqshard._demo import _model as _demo_model, _run as _demo
from eqshard._fields import leaf_name
from eqshard._paths._globs import readable_rules
from eqshard._plan import plan_faults
from eqshard._search._candidates import Candidate, candidates
from eqshard._search._profile import tensor_roles

EXAMPLES = Path(__file__).parent.parent / "examples"


def _abstract_state(optimizer, model):
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return jax.eval_shape(optimizer.init, params)


@pytest.fixture(scope="module")
def gpt() -> dict[str, Any]:
    """The stacked GPT of examples/gpt_stacked.py, abstract, with its AdamW state."""
    ns = runpy.run_path(str(EXAMPLES / "gpt_stacked.py"), run_name="not_main")
    model = eqx.filter_eval_shape(ns["build"])
    return {**ns, "model": model, "opt_state": _abstract_state(ns["optimizer"](), model)}


@pytest.fixture(scope="module")
def llama() -> dict[str, Any]:
    """The Llama-3-8B-shaped model of examples/llama_8b.py, abstract (8 billion
    parameters, no memory)."""
    ns = runpy.run_path(str(EXAMPLES / "llama_8b.py"), run_name="not_main")
    model = eqx.filter_eval_shape(ns["build"])
    return {**ns, "model": model, "opt_state": _abstract_state(ns["optimizer"](), model)}


def _tokens(batch: int, seq: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)


def _roles(step, model, *args) -> dict[str, tuple[str, int, tuple[str, ...]]]:
    """Each leaf that has a role: its kind, its axis split over 'model' and its
    partners, by dotted path."""
    paths = [leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
    return {
        paths[i]: (role.kind, role.axis, tuple(paths[j] for j in role.partners))
        for i, role in tensor_roles(step, model, *args).items()
    }


QKV = (
    "blocks.attn.query_proj.weight",
    "blocks.attn.key_proj.weight",
    "blocks.attn.value_proj.weight",
)
GPT_ROLES = {
    "embed.weight": ("embedding", 0, ()),
    **dict.fromkeys(QKV, ("column", 1, ("blocks.attn.output_proj.weight",))),
    "blocks.attn.output_proj.weight": ("row", 2, QKV),
    "blocks.up.weight": ("column", 1, ("blocks.down.weight",)),
    "blocks.up.bias": ("bias", 1, ("blocks.up.weight",)),
    "blocks.down.weight": ("row", 2, ("blocks.up.weight",)),
    "unembed.weight": ("vocab", 0, ()),
}


# --------------------------------------------------------------------------- #
# Megatron's pairs, from the jaxpr.
# --------------------------------------------------------------------------- #


def test_the_stacked_gpt_pairs_come_from_its_jaxpr(gpt):
    """Attention's query, key and value feed its output projection through the
    attention's own matmuls; the MLP's up feeds down through a GELU. The blocks are
    stacked and scanned: each split axis is the leaf's own, past the layer axis. The
    position table is looked up by `arange`, not by the batch, and LayerNorms and the
    row-parallel bias have no role."""
    roles = _roles(gpt["step"], gpt["model"], gpt["opt_state"], _tokens(8, 16))
    assert roles == GPT_ROLES


def test_the_gradient_makes_no_pairs(gpt):
    """The step's jaxpr also holds the gradient, whose transposed matmuls run from
    the unembedding back to every weight; only the forward pass counts, so the
    training step and the loss alone give the same roles."""
    loss = gpt["loss"]
    forward = _roles(lambda model, tokens: loss(model, tokens), gpt["model"], _tokens(8, 16))
    assert forward == GPT_ROLES


def test_the_llama_pairs(llama):
    """Grouped-query attention (`jax.nn.dot_product_attention`) and a SwiGLU MLP,
    32 layers stacked, scanned and rematerialised (`jax.checkpoint`)."""
    roles = _roles(llama["step"], llama["model"], llama["opt_state"], _tokens(16, 2048))
    qkv = ("layers.q.weight", "layers.k.weight", "layers.v.weight")
    gate_up = ("layers.gate.weight", "layers.up.weight")
    assert roles == {
        "embed.weight": ("embedding", 0, ()),
        **dict.fromkeys(qkv, ("column", 1, ("layers.o.weight",))),
        "layers.o.weight": ("row", 2, qkv),
        **dict.fromkeys(gate_up, ("column", 1, ("layers.down.weight",))),
        "layers.down.weight": ("row", 2, gate_up),
        "head.weight": ("vocab", 0, ()),
    }


def _mlp_step(optimizer):
    @eqx.filter_jit
    def step(model, state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, state = optimizer.update(grads, state)
        return eqx.apply_updates(model, updates), state, loss

    return step


def test_an_mlp_pairs_its_first_two_layers_and_splits_the_last_over_its_outputs():
    optimizer = optax.adam(1e-3)
    mlp = eqx.filter_eval_shape(lambda: eqx.nn.MLP(16, 16, 64, 2, key=jax.random.key(0)))
    state = _abstract_state(optimizer, mlp)
    roles = _roles(_mlp_step(optimizer), mlp, state, jax.ShapeDtypeStruct((8, 16), jnp.float32))
    assert roles == {
        "layers.0.weight": ("column", 0, ("layers.1.weight",)),
        "layers.0.bias": ("bias", 0, ("layers.0.weight",)),
        "layers.1.weight": ("row", 1, ("layers.0.weight",)),
        "layers.2.weight": ("vocab", 0, ()),
        "layers.2.bias": ("bias", 0, ("layers.2.weight",)),
    }


@jax.custom_vjp
def _matmul(w, x):
    return w @ x


def _matmul_forward(w, x):
    return w @ x, (w, x)


def _matmul_backward(saved, g):
    w, x = saved
    return jnp.outer(g, x), w.T @ g


_matmul.defvjp(_matmul_forward, _matmul_backward)


class Misnamed(eqx.Module):
    """Names that say the opposite of what the layers do: `up` is declared first and
    runs second, `down` runs first (through a `custom_vjp` matmul), and `embed` is
    the last linear layer."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear
    embed: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.up = eqx.nn.Linear(64, 16, key=k1)
        self.down = eqx.nn.Linear(16, 64, key=k2)
        self.embed = eqx.nn.Linear(16, 10, key=k3)

    def __call__(self, x):
        hidden = jax.nn.relu(_matmul(self.down.weight, x) + self.down.bias)
        return self.embed(self.up(hidden))


def test_names_are_not_used():
    model = eqx.filter_eval_shape(Misnamed, jax.random.key(0))

    def step(model, x):
        return eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)))(model)

    assert _roles(step, model, jax.ShapeDtypeStruct((4, 16), jnp.float32)) == {
        "down.weight": ("column", 0, ("up.weight",)),
        "down.bias": ("bias", 0, ("down.weight",)),
        "up.weight": ("row", 1, ("down.weight",)),
        "embed.weight": ("vocab", 0, ()),
        "embed.bias": ("bias", 0, ("embed.weight",)),
    }


LAYERS = 3


class Looped(eqx.Module):
    """Stacked weights taken by index in a `while_loop`, through a `cond` and a
    `checkpoint`: declared output first, so the leaf order is not the order of use."""

    w_out: Float[Array, "layer d h"]
    w_in: Float[Array, "layer h d"]
    head: Float[Array, "v d"]

    def __call__(self, x):
        def body(carry):
            i, x = carry
            h = jax.checkpoint(lambda x: jnp.tanh(self.w_in[i] @ x))(x)
            y = jax.lax.cond(
                i % 2 == 0, lambda h: self.w_out[i] @ h, lambda h: self.w_out[i] @ (2 * h), h
            )
            return i + 1, x + y

        _, x = jax.lax.while_loop(lambda c: c[0] < LAYERS, body, (0, x))
        return self.head @ x


def test_loops_conditionals_and_checkpoints_are_followed():
    f32 = jnp.float32
    model = eqx.filter_eval_shape(
        lambda: Looped(jnp.zeros((LAYERS, 8, 16)), jnp.zeros((LAYERS, 16, 8)), jnp.zeros((10, 8)))
    )

    def evaluate(model, x):  # a while_loop has no reverse-mode gradient
        return jnp.sum(jax.vmap(model)(x))

    assert _roles(evaluate, model, jax.ShapeDtypeStruct((4, 8), f32)) == {
        "w_in": ("column", 1, ("w_out",)),
        "w_out": ("row", 2, ("w_in",)),
        "head": ("vocab", 0, ()),
    }


def test_a_step_that_cannot_be_traced_is_named():
    mlp = eqx.filter_eval_shape(lambda: eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0)))

    def broken_step(model, x):
        return model(x[:, :3])  # the MLP takes 4 features

    with pytest.raises(
        eqshard.EqshardError,
        match=r"cannot trace the step test_a_step_that_cannot_be_traced_is_named.<locals>"
        r".broken_step to find its tensor-parallel pairs: it raised TypeError",
    ):
        candidates(broken_step, mlp, jax.ShapeDtypeStruct((2, 4), jnp.float32), devices=8)


# --------------------------------------------------------------------------- #
# The strategies.
# --------------------------------------------------------------------------- #


def _planned_for(model: Any, args: tuple[Any, ...]) -> Any:
    state = next((a for a in args if isinstance(a, eqx.nn.State)), None)
    return model if state is None else (model, state)


def _plans_cleanly(candidate: Candidate, model: Any, devices: int) -> Any:
    """The candidate's plan on `devices` (a count: no devices), which must have no
    problem and no warning, on its declared mesh."""
    planned = plan_faults(model, candidate.rules, devices=devices)
    assert planned.problems == [], candidate.name
    assert planned.warnings == [], candidate.name
    mesh = planned.plan.mesh
    assert mesh is not None
    assert tuple(zip(mesh.axis_names, mesh.axis_sizes)) == candidate.mesh
    # the declared mesh scales with the device count ("*", `None`), the tensor degree fixed
    model_size = dict(candidate.mesh)["model"]
    megatron = candidate.strategy == "megatron"
    assert candidate.rules.mesh == (
        (("data", 1), ("model", None)) if megatron else (("data", None), ("model", model_size))
    )
    assert candidate.rules.comment is not None
    assert candidate.rules.comment.startswith(f"{candidate.strategy} on data=")
    return planned.plan


def _names(kept: list[Candidate]) -> list[str]:
    return [c.name for c in kept]


SAME_AS_DP_8 = "the same layout as data parallel on data=8, model=1: nothing is split over 'model'"
SAME_AS_FSDP_8 = "the same layout as fsdp on data=8, model=1: nothing is split over 'model'"
SAME_AS_MEGATRON_8 = "the same layout as megatron on data=1, model=8: 'data' has one device"


def test_the_gpt_candidates_on_8_devices(gpt):
    args = (gpt["opt_state"], _tokens(8, 16))
    kept, dropped = candidates(gpt["step"], gpt["model"], *args, devices=8)
    assert _names(kept) == [
        "data parallel on data=8, model=1",
        "fsdp on data=8, model=1",
        "zero-1 on data=8, model=1",
        "megatron on data=1, model=8",
        "data x tensor on data=4, model=2",
        "data x tensor on data=2, model=4",
        "fsdp x tensor on data=4, model=2",
        "fsdp x tensor on data=2, model=4",
    ]
    assert dropped == [
        ("data x tensor on data=8, model=1", SAME_AS_DP_8),
        ("data x tensor on data=1, model=8", SAME_AS_MEGATRON_8),
        ("fsdp x tensor on data=8, model=1", SAME_AS_FSDP_8),
        ("fsdp x tensor on data=1, model=8", SAME_AS_MEGATRON_8),
    ]
    for candidate in kept:
        assert candidate.repairs == ()
        _plans_cleanly(candidate, gpt["model"], 8)
    by = {c.name: c.rules for c in kept}
    dp, fsdp, zero = (by[f"{s} on data=8, model=1"] for s in ("data parallel", "fsdp", "zero-1"))
    assert (dp.default, dp.rules, str(dp.batch), dp.optimizer) == (
        "replicate",
        (),
        "b ... -> b* ...",
        None,
    )
    assert (fsdp.default, fsdp.rules, str(fsdp.batch)) == ("fsdp", (), "b ... -> b* ...")
    assert zero.optimizer is not None
    assert (zero.default, zero.optimizer.default, zero.optimizer.rules) == ("replicate", "fsdp", ())
    assert str(by["megatron on data=1, model=8"].batch) == "... -> * ..."
    assert str(by["data x tensor on data=2, model=4"].batch) == "b ... -> b* ... 4"
    fsdp_tensor = by["fsdp x tensor on data=2, model=4"]
    assert fsdp_tensor.default == "fsdp"
    assert [(r.path, str(r.expr)) for r in fsdp_tensor.rules] == [
        ("embed.weight", "v d -> d* v4"),
        ("**.output_proj.weight", "... o i -> ... o* i4"),
        ("**.*_proj.weight", "... o i -> ... i* o4"),  # data on the input, model on the output
        ("**.up.weight", "... o i -> ... i* o4"),
        ("**.up.bias", "... o -> ... o4*"),  # one dim over both axes
        ("**.down.weight", "... o i -> ... o i4*"),  # 128 / 4 = 32, the largest that 2 divides
        ("unembed.weight", "v d -> d* v4"),
    ]
    # the names the GPT gives its activations: the batch axis follows the batch, and
    # the logits' vocabulary stays split where the unembedding is split over 'model'
    assert dp.dims == {"batch": "data", "seq": None, "embed": None, "vocab": None}
    megatron = {**dict.fromkeys(dp.dims), "vocab": "model"}
    assert dict(by["megatron on data=1, model=8"].dims) == megatron
    assert fsdp_tensor.comment is not None
    assert (
        "The activations' axes: seq whole, embed whole, batch over 'data', vocab over 'model'."
        in fsdp_tensor.comment
    )


def test_the_gpt_candidates_on_64_devices_repair_what_does_not_divide(gpt):
    """On 64 devices the attention's 32 features do not split 64 ways: Megatron
    replicates its four weights and names each; the MLP, the vocabulary and the
    embedding still split, so it is kept."""
    args = (gpt["opt_state"], _tokens(64, 16))
    kept, dropped = candidates(gpt["step"], gpt["model"], *args, devices=64)
    plans = {c.name: _plans_cleanly(c, gpt["model"], 64) for c in kept}
    assert _names(kept) == [
        "data parallel on data=64, model=1",
        "fsdp on data=64, model=1",
        "zero-1 on data=64, model=1",
        "megatron on data=1, model=64",
        *(f"data x tensor on data={64 // m}, model={m}" for m in (2, 4, 8, 16, 32)),
        *(f"fsdp x tensor on data={64 // m}, model={m}" for m in (2, 4, 8, 16, 32)),
    ]
    assert [name for name, _ in dropped] == [
        "data x tensor on data=64, model=1",
        "data x tensor on data=1, model=64",
        "fsdp x tensor on data=64, model=1",
        "fsdp x tensor on data=1, model=64",
    ]
    megatron = next(c for c in kept if c.strategy == "megatron")
    assert megatron.repairs == tuple(
        f"{path} float32[2, 32, 32]: {kind} over dim {axis} (32) does not divide over "
        "model=64; replicated"
        for path, kind, axis in [
            *((p, "column-parallel", 1) for p in QKV),
            ("blocks.attn.output_proj.weight", "row-parallel", 2),
        ]
    )
    assert megatron.rules.comment is not None
    assert megatron.rules.comment.endswith("4 leaves did not divide and were replicated.")
    specs = dict(
        zip(
            [leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(gpt["model"])[0]],
            plans["megatron on data=1, model=64"].flat_shardings,
        )
    )
    assert specs["blocks.attn.query_proj.weight"].is_fully_replicated
    assert specs["blocks.up.weight"].spec == jax.sharding.PartitionSpec(None, "model", None)
    # FSDP alone: what no dim of divides 64 ways is replicated, and named
    fsdp = next(c for c in kept if c.strategy == "fsdp")
    assert len(fsdp.repairs) == 12
    assert fsdp.repairs[:2] == (
        "pos.weight float32[16, 32]: no dim of [16, 32] is a multiple of 64, the size of "
        "'data'; replicated over 'data'",
        "blocks.norm1.weight float32[2, 32]: no dim of [2, 32] is a multiple of 64, the size "
        "of 'data'; replicated over 'data'",
    )
    assert not any(line.startswith(("embed.", "blocks.up.")) for line in fsdp.repairs)


def test_the_llama_candidates_on_64_devices(llama):
    """Abstractly, 8 billion parameters: a batch of 16 does not split over 32 or 64
    devices of 'data', so those candidates are dropped, saying so."""
    args = (llama["opt_state"], _tokens(16, 2048))
    kept, dropped = candidates(llama["step"], llama["model"], *args, devices=64)
    for candidate in kept:
        _plans_cleanly(candidate, llama["model"], 64)
        assert candidate.repairs == ()
    assert _names(kept) == [
        "megatron on data=1, model=64",
        *(f"data x tensor on data={64 // m}, model={m}" for m in (4, 8, 16, 32)),
        *(f"fsdp x tensor on data={64 // m}, model={m}" for m in (4, 8, 16, 32)),
    ]
    batch = "the batch's leading dim does not split over data={}: argument 3 has shape [16, 2049]"
    assert dropped == [
        ("data parallel on data=64, model=1", batch.format(64)),
        ("fsdp on data=64, model=1", batch.format(64)),
        ("zero-1 on data=64, model=1", batch.format(64)),
        ("data x tensor on data=64, model=1", SAME_AS_DP_8.replace("8", "64")),
        ("data x tensor on data=32, model=2", batch.format(32)),
        ("data x tensor on data=1, model=64", SAME_AS_MEGATRON_8.replace("8", "64")),
        ("fsdp x tensor on data=64, model=1", SAME_AS_FSDP_8.replace("8", "64")),
        ("fsdp x tensor on data=32, model=2", batch.format(32)),
        ("fsdp x tensor on data=1, model=64", SAME_AS_MEGATRON_8.replace("8", "64")),
    ]
    rules = kept[0].rules  # Megatron: q, k and v share no glob that spares o, gate, up, down
    to_o, to_down = (
        "column-parallel: feeds layers.o.weight",
        "column-parallel: feeds layers.down.weight",
    )
    assert [(r.path, str(r.expr), r.comment) for r in rules.rules] == [
        ("embed.weight", "v d -> v* d", "vocab-parallel embedding: looked up by the batch"),
        ("**.q.weight", "... o i -> ... o* i", to_o),
        ("**.k.weight", "... o i -> ... o* i", to_o),
        ("**.v.weight", "... o i -> ... o* i", to_o),
        (
            "**.o.weight",
            "... o i -> ... o i*",
            "row-parallel: fed by layers.q.weight, layers.k.weight, layers.v.weight; one "
            "all-reduce over 'model'",
        ),
        ("**.gate.weight", "... o i -> ... o* i", to_down),
        ("**.up.weight", "... o i -> ... o* i", to_down),
        (
            "**.down.weight",
            "... o i -> ... o i*",
            "row-parallel: fed by layers.gate.weight, layers.up.weight; one all-reduce over 'model'",
        ),
        (
            "head.weight",
            "v d -> v* d",
            "vocab-parallel: split over its outputs, which feed no other weight",
        ),
    ]


def test_repairs_and_drops_say_what_and_why():
    """A hidden size of 12 on 8 devices: Megatron has nothing that divides (dropped),
    nor has FSDP or ZeRO-1, while 4 x 2 and 2 x 4 split the pair; FSDP x tensor
    names the leaves FSDP replicates."""
    optimizer = optax.adam(1e-3)
    mlp = eqx.filter_eval_shape(lambda: eqx.nn.MLP(12, 10, 12, 1, key=jax.random.key(0)))
    args = (_abstract_state(optimizer, mlp), jax.ShapeDtypeStruct((8, 12), jnp.float32))
    kept, dropped = candidates(_mlp_step(optimizer), mlp, *args, devices=8)
    assert _names(kept) == [
        "data parallel on data=8, model=1",
        "data x tensor on data=4, model=2",
        "data x tensor on data=2, model=4",
        "fsdp x tensor on data=4, model=2",
        "fsdp x tensor on data=2, model=4",
    ]
    assert dropped == [
        ("fsdp on data=8, model=1", "no leaf has a dim that divides over data=8"),
        (
            "zero-1 on data=8, model=1",
            "no parameter has a dim that divides over data=8, to split its moments",
        ),
        ("megatron on data=1, model=8", "no column- or row-parallel weight divides over model=8"),
        ("data x tensor on data=8, model=1", SAME_AS_DP_8),
        ("data x tensor on data=1, model=8", SAME_AS_MEGATRON_8),
        ("fsdp x tensor on data=8, model=1", SAME_AS_FSDP_8),
        ("fsdp x tensor on data=1, model=8", SAME_AS_MEGATRON_8),
    ]
    by = {c.name: c for c in kept}
    for c in kept:
        _plans_cleanly(c, mlp, 8)
    assert [(r.path, str(r.expr)) for r in by["data x tensor on data=2, model=4"].rules.rules] == [
        ("layers.0.weight", "o i -> * o4 i"),
        ("layers.0.bias", "o -> * o4"),
        ("layers.1.weight", "o i -> * o i4"),
    ]
    assert by["fsdp x tensor on data=4, model=2"].repairs == (
        "layers.0.bias float32[12]: no dim of its part on each 'model' device, [6], is a "
        "multiple of 4, the size of 'data'; replicated over 'data'",
        "layers.1.weight float32[10, 12]: no dim of its part on each 'model' device, [10, 6], "
        "is a multiple of 4, the size of 'data'; replicated over 'data'",
        "layers.1.bias float32[10]: no dim of [10] is a multiple of 4, the size of 'data'; "
        "replicated over 'data'",
    )
    # a batch of 12 does not split over 8 devices of 'data'
    odd = (args[0], jax.ShapeDtypeStruct((12, 12), jnp.float32))
    kept, dropped = candidates(_mlp_step(optimizer), mlp, *odd, devices=8)
    assert dropped[0] == (
        "data parallel on data=8, model=1",
        "the batch's leading dim does not split over data=8: argument 3 has shape [12, 12]",
    )
    assert _names(kept) == [
        f"{strategy} on data={data}, model={model}"
        for strategy in ("data x tensor", "fsdp x tensor")
        for data, model in ((4, 2), (2, 4))
    ]


def test_a_stateful_model_without_pairs_has_no_tensor_candidates():
    """A convolution, a BatchNorm and one linear head: no weight feeds another, so
    the tensor strategies are dropped, saying why; the state's leaves are laid out
    with the model's."""
    model, state = eqx.filter_eval_shape(stateful_cost_model.build)
    opt_state = _abstract_state(stateful_cost_model.optimizer(), model)
    batch = (
        jax.ShapeDtypeStruct((16, 3, 8, 8), jnp.float32),
        jax.ShapeDtypeStruct((16, 8), jnp.float32),
    )
    kept, dropped = candidates(stateful_cost_model.step, model, state, opt_state, batch, devices=8)
    assert _names(kept) == [
        "data parallel on data=8, model=1",
        "fsdp on data=8, model=1",
        "zero-1 on data=8, model=1",
    ]
    no_pairs = "the step's jaxpr shows no column- and row-parallel pair of weights"
    assert dropped[0] == ("megatron on data=1, model=8", no_pairs)
    assert dropped[1:] == [
        ("data x tensor on data=8, model=1", SAME_AS_DP_8),
        ("data x tensor on data=4, model=2", no_pairs),
        ("data x tensor on data=2, model=4", no_pairs),
        ("data x tensor on data=1, model=8", SAME_AS_MEGATRON_8),
        ("fsdp x tensor on data=8, model=1", SAME_AS_FSDP_8),
        ("fsdp x tensor on data=4, model=2", no_pairs),
        ("fsdp x tensor on data=2, model=4", no_pairs),
        ("fsdp x tensor on data=1, model=8", SAME_AS_MEGATRON_8),
    ]
    for candidate in kept:
        _plans_cleanly(candidate, (model, state), 8)


# --------------------------------------------------------------------------- #
# Readable rules, and their round trip.
# --------------------------------------------------------------------------- #


def test_the_rules_are_few_globs_with_a_comment_each(gpt):
    kept, _ = candidates(gpt["step"], gpt["model"], gpt["opt_state"], _tokens(8, 16), devices=8)
    megatron = next(c for c in kept if c.strategy == "megatron")
    row = "row-parallel: fed by {}; one all-reduce over 'model'"
    assert [(r.path, str(r.expr), r.comment) for r in megatron.rules.rules] == [
        ("embed.weight", "v d -> v* d", "vocab-parallel embedding: looked up by the batch"),
        ("**.output_proj.weight", "... o i -> ... o i*", row.format(", ".join(QKV))),
        # after the rule that takes output_proj, one glob for query, key and value
        (
            "**.*_proj.weight",
            "... o i -> ... o* i",
            "column-parallel: feeds blocks.attn.output_proj.weight",
        ),
        ("**.up.weight", "... o i -> ... o* i", "column-parallel: feeds blocks.down.weight"),
        (
            "**.up.bias",
            "... o -> ... o*",
            "column-parallel bias of blocks.up.weight: split as its output",
        ),
        ("**.down.weight", "... o i -> ... o i*", row.format("blocks.up.weight")),
        (
            "unembed.weight",
            "v d -> v* d",
            "vocab-parallel: split over its outputs, which feed no other weight",
        ),
    ]
    for candidate in kept:  # at most one rule per (role, expression) group
        groups = {(r.comment, str(r.expr)) for r in candidate.rules.rules}
        assert len(candidate.rules.rules) == len(groups), candidate.name


def test_readable_rules_merge_indices_and_siblings_and_shorten():
    paths = [
        (*("blocks", str(i)), *part)
        for i in range(3)
        for part in (("attn", "q", "weight"), ("attn", "k", "weight"), ("attn", "o", "weight"))
    ] + [("mlp", "layers", "0", "weight"), ("mlp", "layers", "1", "weight"), ("norm", "weight")]
    q_and_k = [i for i, p in enumerate(paths) if p[-2] in ("q", "k")]
    o = [i for i, p in enumerate(paths) if p[-2] == "o"]
    # indices merged; the outputs' rule comes first, so a glob over the attention's
    # weights then takes only q and k; layers 0 and 1 differ in an index alone
    assert readable_rules(paths, [q_and_k, o, [9], [10]]) == [
        ("**.o.weight", 1),
        ("**.attn.*.weight", 0),
        ("**.layers.0.weight", 2),
        ("**.layers.1.weight", 3),
    ]
    assert readable_rules(paths, [[9, 10, 11]]) == [("**.layers.*.weight", 0), ("norm.weight", 0)]
    # a rule is never widened onto another group's leaf to be shorter
    assert readable_rules(paths, [[9], [10]]) == [
        ("**.layers.0.weight", 0),
        ("**.layers.1.weight", 1),
    ]


def _specs(plan: Any) -> list[Any]:
    return [None if s is None else s.spec for s in plan.flat_shardings]


def _same_layouts(a: Any, b: Any) -> None:
    assert a.mesh is not None
    assert b.mesh is not None
    assert tuple(a.mesh.axis_names) == tuple(b.mesh.axis_names)
    assert tuple(a.mesh.axis_sizes) == tuple(b.mesh.axis_sizes)
    assert _specs(a) == _specs(b)
    assert _specs(a.optimizer) == _specs(b.optimizer)


@pytest.mark.parametrize("devices", [8, 64])
def test_every_candidate_loads_back_to_its_layouts(gpt, llama, tmp_path, devices):
    cases = [(gpt, _tokens(devices, 16))]
    if devices == 64:
        cases.append((llama, _tokens(16, 2048)))
    for ns, batch in cases:
        kept, _ = candidates(ns["step"], ns["model"], ns["opt_state"], batch, devices=devices)
        for k, candidate in enumerate(kept):
            path = tmp_path / f"{k}.eqshard.json"
            eqshard.dump(candidate.rules, path)
            document = json.loads(path.read_text())
            assert document["comment"] == candidate.rules.comment
            assert all("comment" in rule for rule in document["rules"])
            for loaded in (eqshard.load(path), eqshard.load(candidate.rules.to_json())):
                before = plan_faults(ns["model"], candidate.rules, devices=devices).plan
                after = plan_faults(ns["model"], loaded, devices=devices)
                assert after.problems == [], candidate.name
                _same_layouts(before, after.plan)
                assert loaded.batch == candidate.rules.batch
                assert loaded.comment == candidate.rules.comment
                assert [(r.path, r.expr, r.comment) for r in loaded.rules] == [
                    (r.path, r.expr, r.comment) for r in candidate.rules.rules
                ]


# --------------------------------------------------------------------------- #
# The demo's strategies, reproduced.
# --------------------------------------------------------------------------- #

DEMO = {
    "data parallel on data=8, model=1": "data-parallel",
    "fsdp on data=8, model=1": "fsdp",
    "zero-1 on data=8, model=1": "zero-1",
    "megatron on data=1, model=8": "megatron",
    "data x tensor on data=2, model=4": "2d",
}


def _blocks_of(plan: Any, model: Any) -> list[Any]:
    leaves = [x for x in jax.tree_util.tree_leaves(model) if isinstance(x, jax.ShapeDtypeStruct)]
    found = []
    for section in (plan, plan.optimizer):
        shardings = [s for s in section.flat_shardings if s is not None]
        assert len(shardings) == len(leaves)
        found += [blocks(s, x.shape) for s, x in zip(shardings, leaves)]
    return found


def test_the_demos_strategies_are_reproduced_device_by_device():
    """The generator's data parallel, FSDP, ZeRO-1, Megatron and 2D (data x tensor on
    2 x 4) candidates on 8 devices lay out every parameter, every optimizer state
    leaf and the batch as examples/specs/demo/*.eqshard.json do, block for block on
    each device. The meshes are written differently (the files' `"*"` and the
    one-axis meshes `[["data", "*"]]`, `[["model", "*"]]`; here always `data` x
    `model`) and the same devices hold the same blocks. Megatron's `up.bias`, split
    in the files by hand, is found here as the bias added to `up`'s output; the
    position table (looked up by `arange`) stays whole in both."""
    model = eqx.filter_eval_shape(_demo_model.build)
    opt_state = jax.eval_shape(
        _demo_model.adamw_init, eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    )
    batch = jax.ShapeDtypeStruct((_demo_model.BATCH, _demo_model.SEQ + 1), jnp.int32)
    kept, _ = candidates(_demo.make_step(), model, opt_state, batch, devices=8)
    by = {c.name: c for c in kept}
    devices = jax.devices()[:8]
    for name, demo_name in DEMO.items():
        ours = eqshard.plan(model, by[name].rules, devices=devices)
        theirs = eqshard.plan(model, eqshard.load(_demo.spec_path(demo_name)), devices=devices)
        assert _blocks_of(ours, model) == _blocks_of(theirs, model), name
        shape = batch.shape
        ours_batch = eqshard.expression.sharding(str(by[name].rules.batch), shape, mesh=ours.mesh)
        theirs_batch = eqshard.expression.sharding(
            _demo.batch_expression(theirs), shape, mesh=theirs.mesh
        )
        assert blocks(ours_batch, shape) == blocks(theirs_batch, shape), name


def test_rules_that_would_lay_out_wrongly_are_never_handed_out(gpt, monkeypatch):
    """The nets under the generator: rules whose globs would give a leaf another
    expression are replaced by one literal rule per leaf, and a candidate whose
    rules do not plan is dropped with the planner's own words."""
    from eqshard._search import _candidates, _families

    args = (gpt["opt_state"], _tokens(8, 16))

    def one_glob_for_all(paths, groups):
        return [("**", 0)] if groups else []

    monkeypatch.setattr(_candidates, "readable_rules", one_glob_for_all)
    kept, _ = candidates(gpt["step"], gpt["model"], *args, devices=8)
    megatron = next(c for c in kept if c.strategy == "megatron")
    assert [r.path for r in megatron.rules.rules] == [
        "embed.weight",
        *QKV,
        "blocks.attn.output_proj.weight",
        "blocks.up.weight",
        "blocks.up.bias",
        "blocks.down.weight",
        "unembed.weight",
    ]
    _plans_cleanly(megatron, gpt["model"], 8)

    monkeypatch.undo()
    real = _families._expression

    def model_axis_first(rank, role, data_axis, data, model):
        if data > 1 and data_axis is None:  # data x tensor: 'model' before 'data'
            return real(rank, role, None, 1, model) + f" {data}"
        return real(rank, role, data_axis, data, model)

    monkeypatch.setattr(_families, "_expression", model_axis_first)
    kept, dropped = candidates(gpt["step"], gpt["model"], *args, devices=8)
    reasons = dict(dropped)
    assert "data x tensor on data=2, model=4" not in _names(kept)
    assert reasons["data x tensor on data=2, model=4"].startswith(
        "its rules do not plan: embed.weight (Embedding.weight), unembed.weight "
        "(Linear.weight): float32[64, 32] 'v d -> v* d 2' does not fit the mesh "
        "('data': 2, 'model': 4)"
    )


class _Named(eqx.Module):
    """Its weights' annotations and its activations share the dim name `embed`."""

    w1: Float[Array, "hidden embed"]
    w2: Float[Array, "embed hidden"]

    def __init__(self):
        self.w1, self.w2 = jnp.zeros((64, 32)), jnp.zeros((32, 64))

    def __call__(self, x):
        x = _named_input(x)
        return jnp.tanh(x @ self.w1.T) @ self.w2.T


class _Unannotated(eqx.Module):
    """The same, with no dim names on its weights."""

    w1: jax.Array
    w2: jax.Array

    __init__ = _Named.__init__
    __call__ = _Named.__call__


@jax.jit  # traced once, then cached: suggest must still see the names it gives
def _named_input(x):
    return eqshard.constrain(x, ("batch", "embed"))


_NAMED_OPTIMIZER = optax.adam(1e-3)


def _named_step(model, opt_state, x):
    grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    updates, opt_state = _NAMED_OPTIMIZER.update(grads, opt_state, model)
    return eqx.apply_updates(model, updates), opt_state


def _named_candidates(cls: type[eqx.Module] = _Named):
    model = eqx.filter_eval_shape(cls)
    opt_state = jax.eval_shape(_NAMED_OPTIMIZER.init, model)
    x = jax.ShapeDtypeStruct((8, 32), jnp.float32)
    return candidates(_named_step, model, opt_state, x, devices=8)


def test_activation_names_are_found_however_the_step_was_traced_before():
    _named_input(jnp.zeros((8, 32)))  # cached with no rules active
    first, _ = _named_candidates(_Unannotated)
    with eqshard.use(eqshard.load({"eqshard": 1, "dims": {"batch": None, "embed": None}})):
        again, _ = _named_candidates(_Unannotated)  # rules active outside are not inside
    for kept in (first, again):
        assert kept[0].name == "data parallel on data=8, model=1"
        assert kept[0].rules.dims == {"batch": "data", "embed": None}


def test_dims_that_would_lay_out_parameters_drop_the_candidate_saying_why():
    kept, dropped = _named_candidates()
    assert "fsdp on data=8, model=1" not in _names(kept)  # never kept with w1, w2 whole
    reasons = dict(dropped)
    assert reasons["fsdp on data=8, model=1"] == (
        'its "dims", which map the names the step gives its activations, would lay out '
        "w1, w2 too, whose annotations name the same dims; name the activations' axes "
        "apart from the parameters' dims to have it generated"
    )


def test_an_8_layer_mlp_is_written_in_at_most_half_as_many_rules_as_leaves(tmp_path):
    """Issue 31: layers that alternate column- and row-parallel roles are written
    with alternatives (`layers.{0,2,4,6}.weight`), not one rule per leaf, and the
    written rules load back to the same layouts."""
    optimizer = optax.adam(1e-3)
    mlp = eqx.filter_eval_shape(lambda: eqx.nn.MLP(64, 64, 128, 8, key=jax.random.key(0)))
    leaves = sum(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(mlp))
    assert leaves == 18  # 9 linear layers
    args = (_abstract_state(optimizer, mlp), jax.ShapeDtypeStruct((64, 64), jnp.float32))
    kept, _ = candidates(_mlp_step(optimizer), mlp, *args, devices=8)
    assert "megatron on data=1, model=8" in _names(kept)
    for k, candidate in enumerate(kept):
        assert len(candidate.rules.rules) <= leaves // 2, candidate.name
        path = tmp_path / f"{k}.eqshard.json"
        eqshard.dump(candidate.rules, path)
        loaded = eqshard.load(path)
        before = plan_faults(mlp, candidate.rules, devices=8).plan
        after = plan_faults(mlp, loaded, devices=8)
        assert after.problems == [], candidate.name
        _same_layouts(before, after.plan)
    by = {c.name: c for c in kept}
    assert [
        (r.path, str(r.expr), r.comment) for r in by["megatron on data=1, model=8"].rules.rules
    ][:2] == [
        (
            "layers.{0,2,4,6}.weight",
            "o i -> o* i",
            "column-parallel: feeds layers.{1,3,5,7}.weight",
        ),
        (
            "layers.{0,2,4,6}.bias",
            "o -> o*",
            "column-parallel bias of layers.{0,2,4,6}.weight: split as its output",
        ),
    ]


def test_the_candidate_space_is_a_table_of_families_and_a_search_may_name_some(gpt):
    from eqshard._search._families import FAMILIES, STRATEGIES, Family

    assert tuple(f.name for f in FAMILIES) == STRATEGIES
    assert all(isinstance(f, Family) for f in FAMILIES)
    args = (gpt["opt_state"], _tokens(8, 16))
    every, _ = candidates(gpt["step"], gpt["model"], *args, devices=8)
    some, dropped = candidates(
        gpt["step"], gpt["model"], *args, devices=8, strategies=["data x tensor", "fsdp"]
    )
    assert [c.strategy for c in some] == ["fsdp", "data x tensor", "data x tensor"]
    assert [c.rules.to_json() for c in some] == [
        c.rules.to_json() for c in every if c.strategy in ("fsdp", "data x tensor")
    ]
    assert all(name.startswith("data x tensor on ") for name, _ in dropped)
    # one string, separated by commas, as the command line passes it
    (zero,), _ = candidates(gpt["step"], gpt["model"], *args, devices=8, strategies="zero-1")
    assert zero.strategy == "zero-1"
    with pytest.raises(eqshard.EqshardError, match="'fsdp2' is no strategy; the strategies are"):
        candidates(gpt["step"], gpt["model"], *args, devices=8, strategies=["fsdp2"])


@pytest.mark.slow  # compiles the step twice on 8 simulated devices
def test_tensor_candidates_keep_activations_split_where_megatron_splits_them(gpt):
    """The logits the vocab-parallel unembedding makes are named ("batch", "seq",
    "vocab"): the tensor candidates map "vocab" to 'model' (the jaxpr walk sees the
    named value hold that weight's output axis), the residual stream's names whole;
    and XLA:CPU's compile of the step moves fewer bytes over 'model' so than with
    the logits gathered whole."""
    args = (gpt["opt_state"], _tokens(8, 16))
    kept, _ = candidates(gpt["step"], gpt["model"], *args, devices=8)
    for c in kept:
        tensor = dict(c.mesh)["model"] > 1
        assert c.rules.dims["vocab"] == ("model" if tensor else None), c.name
        assert (c.rules.dims["seq"], c.rules.dims["embed"]) == (None, None), c.name
    chosen = next(c for c in kept if c.strategy == "data x tensor")
    whole = dataclasses.replace(chosen.rules, dims={**chosen.rules.dims, "vocab": None})
    split, gathered = (
        eqshard.cost(gpt["model"], *args, step=gpt["step"], spec=rules, devices=8)
        for rules in (chosen.rules, whole)
    )
    assert split.bytes_by_axes().get(("all-reduce", ("model",)), 0) > 0
    moved = {
        k: sum(n for (_, axes), n in c.bytes_by_axes().items() if axes == ("model",))
        for k, c in (("split", split), ("gathered", gathered))
    }
    assert moved["split"] < moved["gathered"]
    assert split.estimate().seconds < gathered.estimate().seconds
