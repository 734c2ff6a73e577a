"""The differential corpus: eqshard's figures against the compiler's own and hand
counts, for real `eqx.nn` models under each strategy, on XLA:CPU and on XLA:TPU
(`v5e:2x4` and `v5p:2x2x2`, through libtpu).

For every cell: the FLOPs eqshard reads from the compiled program against XLA's own
`cost_analysis()` (which also counts elementwise work, so it may be larger, by the
optimizer's and the activations' few FLOPs per element); the peak against XLA's own
`memory_analysis()` and its parts (on XLA:CPU at least its arguments, outputs and
temporaries, which its own peak leaves out; XLA:TPU's own); the data-parallel gradient all-reduce and ZeRO-1's all-gather
against hand counts of the parameters' bytes. `python tests/test_differential.py`
prints the table the cost page shows.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqshard
from eqshard._fields import leaf_name

OPTIMIZER = optax.adam(1e-3)
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
TARGETS = ("v5e:2x4", "v5p:2x2x2")  # XLA:TPU for 8 devices of two generations
COMPILERS = [
    None,
    *(
        pytest.param(
            t, marks=[pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu"), pytest.mark.slow]
        )
        for t in TARGETS
    ),
]  # the TPU compiles are slow: `-m "not slow"` keeps XLA:CPU's column


def _mlp() -> Any:
    return eqx.nn.MLP(64, 64, 256, 1, key=jax.random.key(0))


def _mlp_loss(model: Any, x: Any) -> Any:
    return jnp.mean(jax.vmap(model)(x) ** 2)


def _attention() -> Any:
    return eqx.nn.MultiheadAttention(4, 64, key=jax.random.key(0))


def _attention_loss(model: Any, x: Any) -> Any:
    return jnp.mean(jax.vmap(lambda s: model(s, s, s))(x) ** 2)


def _conv() -> Any:
    return eqx.nn.Conv2d(8, 16, 3, padding=1, key=jax.random.key(0))


def _conv_loss(model: Any, x: Any) -> Any:
    return jnp.mean(jax.vmap(model)(x) ** 2)


def _wide_mlp() -> Any:
    return eqx.nn.MLP(64, 64, 1024, 4, key=jax.random.key(0))


class UNet(eqx.Module):
    """A small UNet of `eqx.nn.Conv2d` layers: a convolution, a half-resolution one
    between an average pool and an upsampling, and one over the skip and the upsampled
    maps together. On a big batch its activations are most of what a step holds."""

    down: eqx.nn.Conv2d
    middle: eqx.nn.Conv2d
    up: eqx.nn.Conv2d

    def __init__(self, key: Any) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.down = eqx.nn.Conv2d(3, 16, 3, padding=1, key=k1)
        self.middle = eqx.nn.Conv2d(16, 16, 3, padding=1, key=k2)
        self.up = eqx.nn.Conv2d(32, 3, 3, padding=1, key=k3)

    def __call__(self, x: Any) -> Any:  # x: (3, 32, 32)
        skip = jax.nn.relu(self.down(x))
        pooled = skip.reshape(16, 16, 2, 16, 2).mean(axis=(2, 4))
        middle = jax.nn.relu(self.middle(pooled))
        upsampled = jnp.repeat(jnp.repeat(middle, 2, axis=1), 2, axis=2)
        return self.up(jnp.concatenate([skip, upsampled]))


class LlamaBlock(eqx.Module):
    """A Llama-shaped block of `eqx.nn` parts: RMSNorm, attention, RMSNorm, SwiGLU."""

    attn_norm: eqx.nn.RMSNorm
    attn: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key: Any) -> None:
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.attn_norm = eqx.nn.RMSNorm(64)
        self.attn = eqx.nn.MultiheadAttention(4, 64, key=k1)
        self.mlp_norm = eqx.nn.RMSNorm(64)
        self.gate = eqx.nn.Linear(64, 128, use_bias=False, key=k2)
        self.up = eqx.nn.Linear(64, 128, use_bias=False, key=k3)
        self.down = eqx.nn.Linear(128, 64, use_bias=False, key=k4)

    def __call__(self, x: Any) -> Any:  # x: (seq, 64)
        h = jax.vmap(self.attn_norm)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.mlp_norm)(x)
        gated = jax.nn.silu(jax.vmap(self.gate)(h)) * jax.vmap(self.up)(h)
        return x + jax.vmap(self.down)(gated)


MODELS = {  # build, loss, the batch's shape
    "MLP": (_mlp, _mlp_loss, (64, 64)),
    "attention": (_attention, _attention_loss, (8, 32, 64)),
    "convolution": (_conv, _conv_loss, (8, 8, 16, 16)),
    "Llama block": (lambda: LlamaBlock(jax.random.key(0)), _mlp_loss, (8, 32, 64)),
    # activations dominate: XLA:CPU's temporaries are several times its arguments
    "wide MLP": (_wide_mlp, _mlp_loss, (4096, 64)),
    "UNet": (lambda: UNet(jax.random.key(0)), _conv_loss, (64, 3, 32, 32)),
}
# the strategies each activation-heavy model is costed under (the others: all)
ACTIVATION_HEAVY = {"wide MLP": ("FSDP",), "UNet": ("data parallel",)}

# The matrix products of one step by hand, on each of 8 devices (the batch split
# over 'data' in every strategy): forward, the weights' gradients, and the
# gradients of the activations the weights need (not of the batch).
HAND_FLOPS = {
    # 64 rows: 64 -> 256 -> 64, forward and weight gradients; the hidden layer's
    # gradient once
    "MLP": (2 * (2 * 64 * 64 * 256 + 2 * 64 * 256 * 64) + 2 * 64 * 64 * 256) // 8,
    # 8 x 32 tokens of 64, 4 heads of 16: four projections forward and their weights'
    # gradients; scores and mix forward, and their four gradients; the output
    # projection's input gradient
    "attention": (
        2 * 4 * 2 * 256 * 64 * 64
        + 2 * 2 * 8 * 4 * 32 * 32 * 16
        + 4 * 2 * 8 * 4 * 32 * 32 * 16
        + 2 * 256 * 64 * 64
    )
    // 8,
    # 3x3 over 16x16 padded by 1: 46 taps meet the input along each dim (48 less the
    # two on padding); forward and the kernel's gradient, 8 input channels to 16
    "convolution": 2 * (2 * 8 * 16 * 46 * 46 * 8) // 8,
    # the attention above, with the input gradients of its query, key and value
    # projections too (the first RMSNorm's scale needs them); SwiGLU 64 -> 128 -> 64:
    # three products forward and their weights' gradients, the gated hidden's
    # gradient, and the two input gradients the second RMSNorm's scale needs
    "Llama block": (
        2 * 4 * 2 * 256 * 64 * 64
        + 2 * 2 * 8 * 4 * 32 * 32 * 16
        + 4 * 2 * 8 * 4 * 32 * 32 * 16
        + 2 * 256 * 64 * 64
        + 3 * 2 * 256 * 64 * 64
        + 2 * 3 * 2 * 256 * 64 * 128
        + 2 * 256 * 128 * 64
        + 2 * 2 * 256 * 64 * 128
    )
    // 8,
    # 4,096 rows: 64 -> 1024 -> 1024 -> 1024 -> 1024 -> 64, forward and the weights'
    # gradients; every layer's input gradient but the first's
    "wide MLP": (
        2 * 2 * 4096 * (64 * 1024 + 3 * 1024 * 1024 + 1024 * 64)
        + 2 * 4096 * (3 * 1024 * 1024 + 1024 * 64)
    )
    // 8,
    # 64 images, 3x3 convolutions padded by 1: 94 taps along each dim at 32 (96 less
    # two on padding), 46 at 16; 3 -> 16, 16 -> 16 at half resolution, 32 -> 3:
    # forward and the kernels' gradients, the last two's input gradients
    "UNet": (
        2 * (2 * 64 * 16 * 3 * 94 * 94 + 2 * 64 * 16 * 16 * 46 * 46 + 2 * 64 * 3 * 32 * 94 * 94)
        + 2 * 64 * 16 * 16 * 46 * 46
        + 2 * 64 * 3 * 32 * 94 * 94
    )
    // 8,
}
STRATEGIES = {
    "data parallel": {"mesh": [["data", "*"]], "default": "replicate"},
    "FSDP": {"mesh": [["data", "*"]], "default": "fsdp"},
    "ZeRO-1": {"mesh": [["data", "*"]], "default": "replicate", "optimizer": {"default": "fsdp"}},
}


def _step(loss: Any) -> Any:
    def step(model: Any, opt_state: Any, x: Any) -> Any:
        value, grads = eqx.filter_value_and_grad(loss)(model, x)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    return step


def _cell(model_name: str, strategy: str, target: str | None) -> dict[str, Any]:
    """One cell: eqshard's figures and the compiler's, side by side."""
    build, loss, shape = MODELS[model_name]
    model = eqx.filter_eval_shape(build)
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(OPTIMIZER.init, params)
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    rules = eqshard.load({"eqshard": 1, **STRATEGIES[strategy]})
    step = _step(loss)
    c = eqshard.cost(model, opt_state, x, step=step, spec=rules, target=target, devices=None)
    # the same program, compiled here, for the compiler's own figures
    if target is None:
        p = eqshard.plan(model, rules)
    else:
        from eqshard._cost._targets import compile_target

        p = eqshard.plan(model, rules, devices=compile_target(target).devices)
    with eqshard.use(p):
        compiled = eqshard.jit(step).lower(model, opt_state, x).compile()
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    assert costs is not None
    parameter_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    split = sum(
        x.size * x.dtype.itemsize
        for x, s in zip(jax.tree_util.tree_leaves(model), p.optimizer.flat_shardings)
        if s is not None and not s.is_fully_replicated
    )
    matrices = sum(
        x.size * x.dtype.itemsize
        for x, s in zip(jax.tree_util.tree_leaves(model), p.optimizer.flat_shardings)
        if s is not None and not s.is_fully_replicated and sum(d > 1 for d in x.shape) >= 2
    )
    memory = compiled.memory_analysis()
    paths = jax.tree_util.tree_leaves_with_path(params)
    return {
        "leaf_bytes": {leaf_name(path): x.size * x.dtype.itemsize for path, x in paths},
        "split_matrices": matrices,
        "cost": c,
        "xla_flops": float(costs["flops"]),
        "xla_peak": memory.peak_memory_in_bytes,
        # what the compiler allocates for the step: arguments, outputs less those
        # aliased to arguments, and temporaries
        "xla_allocated": memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes,
        "xla_temporaries": memory.temp_size_in_bytes,
        "xla_held": memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes,
        "parameter_bytes": parameter_bytes,
        "split_bytes": split,
    }


# Tensor parallel, for the MLP: the hidden layer split column- then row-wise, over
# every device (Megatron, the batch whole) or over 'model' beside 'data' (2D)
TENSOR = {
    "Megatron": {
        "mesh": [["model", "*"]],
        "batch": "... -> * ...",
        "default": "replicate",
        "rules": [
            {"path": "layers.0.weight", "expr": "o i -> o* i"},
            {"path": "layers.0.bias", "expr": "o -> o*"},
            {"path": "layers.1.weight", "expr": "o i -> o i*"},
        ],
    },
    "2D": {
        "mesh": [["data", "*"], ["model", 4]],
        "default": "replicate",
        "rules": [
            {"path": "layers.0.weight", "expr": "o i -> * o4 i"},
            {"path": "layers.0.bias", "expr": "o -> * o4"},
            {"path": "layers.1.weight", "expr": "o i -> * o i4"},
        ],
    },
}
STRATEGIES.update(TENSOR)
CELLS = [
    (model, strategy)
    for model in MODELS
    for strategy in ACTIVATION_HEAVY.get(model, STRATEGIES)
    if strategy not in TENSOR or model == "MLP"
]


@pytest.mark.parametrize("target", COMPILERS)
@pytest.mark.parametrize(
    ("model_name", "strategy"),
    [  # `-m "not slow"` keeps the MLPs' rows
        pytest.param(*cell, marks=() if cell[0] in ("MLP", "wide MLP") else pytest.mark.slow)
        for cell in CELLS
    ],
)
def test_each_cell_agrees_with_the_compiler_and_the_hand_count(model_name, strategy, target):
    cell = _cell(model_name, strategy, target)
    c = cell["cost"]
    assert c.known
    # FLOPs: the matrix products of the program, at most what XLA counts (it adds
    # the elementwise work: Adam's update, the activations'); XLA:CPU runs the hand
    # count, XLA:TPU may run more (a convolution of few channels on padding it
    # writes out: 1.57x for this one)
    assert 0 < c.flops <= cell["xla_flops"]
    if target is None:
        assert c.flops == HAND_FLOPS[model_name]
    else:
        assert HAND_FLOPS[model_name] <= c.flops <= 1.6 * HAND_FLOPS[model_name]
    # memory: the compiler's own peak, kept as it reports it; the peak, at least what
    # XLA:CPU allocates (its own is its arguments and outputs, without its
    # temporaries), and XLA:TPU's own (its temporaries are not what is live at once:
    # 0 on v5e, where its peak is far above its arguments and outputs, and more than
    # its peak on v5p)
    assert c.memory.reported_peak == cell["xla_peak"]
    if target is None:
        assert c.memory.peak == max(cell["xla_peak"], cell["xla_allocated"])
        assert c.memory.peak >= cell["xla_allocated"]
        assert c.memory.peak_includes.startswith("arguments + outputs + temporaries") == (
            cell["xla_peak"] < cell["xla_allocated"]
        )
    else:
        assert c.memory.peak == cell["xla_peak"] >= cell["xla_held"]
        assert c.memory.peak_includes == "XLA:TPU's own peak (reported_peak)"
    if model_name in ACTIVATION_HEAVY and target is None:  # what these cells are for
        assert cell["xla_temporaries"] > 2 * cell["xla_peak"]
    moved = c.bytes_by_axes()
    if strategy == "data parallel":  # every gradient summed over 'data', and the loss
        summed = sum(
            n for (kind, _), n in moved.items() if kind in ("all-reduce", "reduce-scatter")
        )
        assert cell["parameter_bytes"] <= summed <= cell["parameter_bytes"] + 16
        assert not [k for k in moved if k[0] == "all-gather"]
    if strategy == "Megatron":  # the row-parallel output summed over 'model', no gather
        assert set(moved) == {("all-reduce", ("model",))}
        assert not [k for k in moved if k[0] == "all-gather"]
    if strategy == "ZeRO-1":  # each updated parameter gathered whole from its parts
        gathered = moved.get(("all-gather", ("data",)), 0)
        if target is None:
            assert gathered == cell["split_bytes"] > 0
        else:  # XLA:TPU may update a small vector whole on every device instead
            assert cell["split_matrices"] <= gathered <= cell["split_bytes"]
    _explained_as_by_hand(c, cell, strategy, target)


def _explained_as_by_hand(c: Any, cell: dict[str, Any], strategy: str, target: str | None):
    """`explain` against the hand analysis of each strategy: every collective has a
    reason; every parameter's gradient is summed over `data` where the parameters are
    copied over it; a ZeRO-1 gather brings back one parameter's whole update, and an
    FSDP gather one parameter before use (its bytes, on XLA:CPU, the parameter's
    own); Megatron sums the row-parallel layer's output over `model`."""
    explained = c.explain()
    assert [e for e in explained if not e.known] == []
    sizes = cell["leaf_bytes"]
    summed = {
        leaf
        for e in explained
        if e.collective.kind in ("all-reduce", "reduce-scatter") and "gradient" in e.reason
        for leaf in e.leaves
    }
    if strategy in ("data parallel", "ZeRO-1", "2D"):
        assert summed == set(sizes)
    gathers = [e for e in explained if e.collective.kind == "all-gather" and e.leaves]
    if strategy == "ZeRO-1":
        assert {leaf for e in gathers for leaf in e.leaves} <= set(sizes)
        for e in gathers:
            (leaf,) = e.leaves
            assert e.reason.startswith(f"the update of `{leaf}` is made split over `data`")
            assert target is not None or e.collective.bytes == sizes[leaf]
    if strategy == "FSDP":  # a parameter gathered, or an activation for its matmul
        for e in gathers:
            if not set(e.leaves) <= set(sizes):
                continue  # the batch, gathered whole
            (leaf,) = e.leaves
            if e.reason.startswith("an activation split over `data` is gathered whole"):
                assert f"with `{leaf}`, split over `data` too" in e.reason
                continue
            assert e.reason == (
                f"`{leaf}` is split over `data` and the step uses it whole: gathered before use"
            )
            assert target is not None or e.collective.bytes == sizes[leaf]
    if strategy == "Megatron" and target is None:
        (e,) = explained
        assert e.leaves == ("layers.1.weight",)
        assert e.reason.endswith("is summed over `model`: its contracting dim is split")


def _table() -> str:
    """The corpus as the cost page shows it, from one run."""
    rows = [
        "| model | strategy | compiler | FLOPs (eqshard) | FLOPs (XLA) | peak (eqshard) | XLA's own peak | temporaries | all-reduce | all-gather |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model_name, strategy in CELLS:
        for target in (None, *TARGETS) if HAS_LIBTPU else (None,):
            cell = _cell(model_name, strategy, target)
            c = cell["cost"]
            kinds = {}
            for (kind, _), n in c.bytes_by_axes().items():
                kinds[kind] = kinds.get(kind, 0) + n
            rows.append(
                f"| {model_name} | {strategy} | {'XLA:CPU' if target is None else 'XLA:TPU ' + target} "
                f"| {c.flops:,.0f} | {cell['xla_flops']:,.0f} | {c.memory.peak:,} "
                f"| {cell['xla_peak']:,} | {cell['xla_temporaries']:,} "
                f"| {kinds.get('all-reduce', 0):,} | {kinds.get('all-gather', 0):,} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    print(_table())


# -- loops: a scan over stacked layers against the same layers unrolled ----------------

LAYERS = 4


def _stack() -> Any:
    """`LAYERS` blocks of `eqx.nn.Linear(64, 64)`, stacked by `eqx.filter_vmap`."""
    keys = jax.random.split(jax.random.key(0), LAYERS)
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(64, 64, key=k))(keys)


def _scanned(stack: Any, x: Any) -> Any:
    params, static = eqx.partition(stack, eqx.is_array)

    def layer(h, p):
        return jax.nn.tanh(jax.vmap(eqx.combine(p, static))(h)), None

    return jnp.mean(jax.lax.scan(layer, x, params)[0] ** 2)


def _unrolled(stack: Any, x: Any) -> Any:
    params, static = eqx.partition(stack, eqx.is_array)
    for i in range(LAYERS):
        p = jax.tree_util.tree_map(lambda a, i=i: a[i], params)
        x = jax.nn.tanh(jax.vmap(eqx.combine(p, static))(x))
    return jnp.mean(x**2)


@pytest.mark.parametrize("target", COMPILERS)
@pytest.mark.parametrize("strategy", ["data parallel", "FSDP"])
def test_a_scan_counts_as_its_layers_unrolled(strategy, target):
    """XLA counts a loop's body once: eqshard multiplies it by the trip count. The
    scan's body is the same every trip, so it also takes the first layer's input
    gradient, which the unrolled layers skip: one product more, by hand. Data
    parallel, both move the same bytes; FSDP, the scan gathers each layer again in
    its backward trip, where the unrolled program keeps what it gathered."""
    model = eqx.filter_eval_shape(_stack)
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    rules = eqshard.load({"eqshard": 1, **STRATEGIES[strategy]})

    def step(loss: Any) -> Any:
        return lambda m, x: eqx.filter_value_and_grad(loss)(m, x)

    scanned = eqshard.cost(model, x, step=step(_scanned), spec=rules, target=target)
    unrolled = eqshard.cost(model, x, step=step(_unrolled), spec=rules, target=target)
    product = 2 * 64 * 64 * 64 // 8  # one (64, 64) x (64, 64) product, on 8 devices
    # forward, the weights' gradients and the hidden layers' gradients
    assert unrolled.flops == (LAYERS * 2 + LAYERS - 1) * product
    assert scanned.known
    assert scanned.flops == LAYERS * 3 * product
    assert any(k.count == LAYERS for k in scanned.collectives) or strategy == "data parallel"
    if strategy == "data parallel":
        assert scanned.bytes_by_axes() == unrolled.bytes_by_axes()
    else:  # the scan gathers each layer again for its backward trip; unrolled, XLA keeps it
        gather = ("all-gather", ("data",))
        once = unrolled.bytes_by_axes()[gather]
        assert once < scanned.bytes_by_axes()[gather] <= 2 * once
