"""A small GPT with stacked blocks, sharded Megatron-style on a ("data", "model") mesh.

The transformer blocks are one `Block` built for N keys with `eqx.filter_vmap`, so
every block leaf has a leading layer axis, and the model runs them with
`jax.lax.scan`. `specs/gpt.eqshard.json` lays the stacked leaves out (its `...`
keeps the layer axis whole), the model and its AdamW state are placed on a 2 x 4
Auto mesh set with `jax.set_mesh`, and a few training steps are checked against the
same steps unsharded. The model names its activations (`eqshard.constrain(x, (...,
"seq", "embed"))` in each block, the logits in `loss`), and the sharded step runs
under `eqshard.use(rules)`, so the spec file's `"dims"` lay them out; the unsharded
run has no rules active, and its names change nothing. The example prints the
per-leaf reports and the collectives of the compiled step.

Run: `python examples/gpt_stacked.py`: on 8 accelerators, or else on 8 simulated
CPU devices.

Check the spec from the command line, without an accelerator:

    eqshard validate examples/specs/gpt.eqshard.json
    eqshard check examples/specs/gpt.eqshard.json \\
        --model examples/gpt_stacked.py:build --devices 4 8 16
"""

import contextlib
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jaxtyping import Array, Bool, Float, Int

import eqshard

SPEC = Path(__file__).parent / "specs" / "gpt.eqshard.json"
VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH = 64, 32, 4, 128, 2, 16, 8
MESH_SHAPE, MESH_AXES = (2, 4), ("data", "model")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def simulate_cpu_devices(count: int = 8) -> None:
    """`count` simulated CPU devices, fixed before JAX starts its backends.

    It changes only the CPU backend, so accelerators are used where present. When
    JAX has already started (the test suite runs on its own 8 CPU devices), or
    XLA_FLAGS sets the count, the count is fixed and this does nothing. It runs only
    when this file is the script: `eqshard check` sets its own count, then imports
    the file.
    """
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    with contextlib.suppress(RuntimeError):  # raised when JAX's backends are already up
        jax.config.update("jax_num_cpu_devices", count)


class Block(eqx.Module):
    """One pre-norm transformer block: causal self-attention, then a GELU MLP."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key: Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(DIM)
        self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.norm2 = eqx.nn.LayerNorm(DIM)
        self.up = eqx.nn.Linear(DIM, HIDDEN, key=k2)
        self.down = eqx.nn.Linear(HIDDEN, DIM, key=k3)

    def __call__(
        self, x: Float[Array, "seq embed"], mask: Bool[Array, "seq seq"]
    ) -> Float[Array, "seq embed"]:
        x = eqshard.constrain(x, (..., "seq", "embed"))  # laid out by the active rules
        y = jax.vmap(self.norm1)(x)
        x = x + self.attn(y, y, y, mask=mask)
        y = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(y)))


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    blocks: Block  # stacked: every array leaf has a leading axis of LAYERS
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, key: Array):
        k_embed, k_pos, k_blocks, k_unembed = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k_embed)
        self.pos = eqx.nn.Embedding(SEQ, DIM, key=k_pos)
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(k_blocks, LAYERS))
        self.norm = eqx.nn.LayerNorm(DIM)
        self.unembed = eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=k_unembed)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        n = tokens.shape[0]
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.pos)(jnp.arange(n))
        causal = jnp.tril(jnp.ones((n, n), dtype=bool))
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x: Float[Array, "seq embed"], block_params: Any) -> tuple[Array, None]:
            block = eqx.combine(block_params, static)  # one layer's slice of the stack
            return block(x, causal), None

        x, _ = jax.lax.scan(layer, x, params)
        return jax.vmap(lambda v: self.unembed(self.norm(v)))(x)


def build(seed: int = 0) -> GPT:
    """The model, with GPT-2's initialisation: weights N(0, 0.02), biases 0 and
    LayerNorm scales 1. `eqshard check --model examples/gpt_stacked.py:build` builds
    it too, abstractly.

    `eqx.filter_eval_shape` gives the structure without computing anything, and
    NumPy gives the values, as a checkpoint would: on a CPU, eqx.nn's own
    initialisers take seconds, compiling one random kernel per leaf.
    """
    rng = np.random.default_rng(seed)

    def init(path: Any, leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf  # not an array: a dropout rate, a flag
        *_, owner, name = jax.tree_util.keystr(path, simple=True, separator=".").split(".")
        if name == "bias":
            value = np.zeros(leaf.shape)
        elif owner.startswith("norm"):
            value = np.ones(leaf.shape)
        else:
            value = rng.normal(0.0, 0.02, leaf.shape)
        return jnp.asarray(value.astype(leaf.dtype))

    return jax.tree_util.tree_map_with_path(init, eqx.filter_eval_shape(GPT, jax.random.key(seed)))


def loss(model: GPT, tokens: Int[Array, "batch seq"]) -> Float[Array, ""]:
    logits = eqshard.constrain(jax.vmap(model)(tokens[:, :-1]), ("batch", "seq", "vocab"))
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def decay_mask(params: GPT) -> GPT:
    """True on the weight matrices, which AdamW decays: the 2-D leaves, and in the
    stacked blocks the 3-D ones (2-D per layer). Biases and LayerNorms are left out."""
    mask = jax.tree.map(lambda x: x.ndim == 2, params)
    stacked = jax.tree.map(lambda x: x.ndim == 3, params.blocks)
    return eqx.tree_at(lambda m: m.blocks, mask, stacked)


def make_step(optimizer: optax.GradientTransformation, plan: Any = None):
    """One training step; with a plan, it keeps every layout through the step."""

    @eqx.filter_jit
    def step(model: GPT, opt_state: Any, tokens: Int[Array, "batch seq"]):
        value, grads = eqx.filter_value_and_grad(loss)(model, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        if plan is not None:
            model = eqshard.constrain(model, plan)
            opt_state = eqshard.constrain(opt_state, plan)
        return value, model, opt_state

    return step


def optimizer() -> optax.GradientTransformation:
    """AdamW, decaying the weight matrices only (`eqshard check --optimizer`)."""
    return optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask)


def batch() -> Int[Array, "batch seq"]:
    """A batch of token ids, shaped as training takes them (`eqshard check --batch`)."""
    return jnp.zeros((BATCH, SEQ + 1), jnp.int32)


step = make_step(optimizer())
"""The training step as `eqshard check --step examples/gpt_stacked.py:step` costs it."""


_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\("
)


def count_collectives(hlo_text: str, *, in_loops: bool = False) -> dict[str, int]:
    """How many instructions of each collective a compiled program's HLO text holds.

    `all-reduce(` and the async `all-reduce-start(` count once each (`-done` is not
    counted again). An instruction in a loop body, such as the scan over the layers,
    is counted once, though it runs once per iteration; `in_loops=True` counts only
    those written directly in a `while` loop's body.
    """
    bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", hlo_text))
    found: Counter[str] = Counter()
    computation = None
    for line in hlo_text.splitlines():
        if line[:1] not in ("", " ", "}"):  # a computation starts: `%name (...) -> ... {`
            computation = line.removeprefix("ENTRY ").split(" ", 1)[0].lstrip("%")
        match = _COLLECTIVE.match(line)
        if match and (not in_loops or computation in bodies):
            found[match.group(1)] += 1
    return {name: found[name] for name in COLLECTIVES}


def main(steps: int = 3, spec: str | Path = SPEC) -> dict[str, Any]:
    """Trains `steps` steps sharded and unsharded, checks that the losses agree, and
    prints the reports and the compiled step's collectives. `spec` is the spec file
    that lays out the parameters and the activations.

    **Returns:** `{"losses": [...], "reference": [...], "collectives": {...}, "plan": plan}`:
    the sharded and the unsharded losses, `count_collectives` of the compiled
    sharded step, and the plan.
    """
    devices = jax.devices()
    if len(devices) < 8:  # a single accelerator: run everything on the simulated CPUs
        devices = jax.devices("cpu")
    if len(devices) < 8:
        raise RuntimeError(
            f"this example needs 8 devices, and JAX has {len(devices)}: run it as a script, "
            "or call simulate_cpu_devices() before JAX starts"
        )
    mesh = jax.make_mesh(
        MESH_SHAPE, MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[:8]
    )
    adamw = optimizer()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (BATCH, SEQ + 1)))
    # exact float32 matmuls on accelerators too, so the two runs can be compared
    with jax.default_device(devices[0]), jax.default_matmul_precision("highest"):
        model = build()
        opt_state = adamw.init(eqx.filter(model, eqx.is_array))

        # The reference: the same model, data and optimizer, on one device.
        reference_step = make_step(adamw)
        ref_model, ref_state = model, opt_state
        reference = []
        for _ in range(steps):
            value, ref_model, ref_state = reference_step(ref_model, ref_state, tokens)
            reference.append(float(value))

        rules = eqshard.load(spec)
        # the mesh set here lays out the parameters, and the rules the activations
        with jax.set_mesh(mesh), eqshard.use(rules):
            plan = eqshard.plan(model, rules)  # on the mesh set above
            model = eqshard.apply(model, plan)
            opt_state = eqshard.apply(opt_state, plan)  # moments follow their parameters
            tokens_in_shards = eqshard.shard(
                tokens, "b s -> b2 s 4"
            )  # over 'data', whole on 'model'
            sharded_step = make_step(adamw, plan)
            # compiled once: its HLO is read for the collectives, and it runs the steps
            # (equinox types filter_jit's result as the function it wraps, without `lower`)
            lowered = sharded_step.lower(model, opt_state, tokens_in_shards)  # pyright: ignore[reportFunctionMemberAccess]
            compiled = lowered.compile()
            hlo = compiled.compiled.as_text() or ""  # equinox's Compiled wraps JAX's
            losses = []
            for i in range(steps):
                value, model, opt_state = compiled(model, opt_state, tokens_in_shards)
                losses.append(float(value))
                print(f"step {i}: loss {losses[-1]:.6f} (unsharded {reference[i]:.6f})")

    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    print(f"sharded losses equal the unsharded ones: max |diff| = {diff:.1e}\n")

    print(f"the plan's mesh, the one set with jax.set_mesh: {plan.mesh}")
    print(eqshard.report(model, plan))
    print("The AdamW state: its moments follow their parameters by path.")
    print(eqshard.report(opt_state, plan))

    collectives = count_collectives(hlo)
    in_loops = count_collectives(hlo, in_loops=True)
    print(
        "The compiled step holds "
        + ", ".join(
            f"{count} {name} ({in_loops[name]} in the scan's loops)"
            for name, count in collectives.items()
            if count
        )
        + " and no other collective."
    )
    print(
        "A Megatron layout sums partial activations over 'model': in the forward pass,\n"
        "one all-reduce after each row-parallel matmul (attention output, MLP down); in\n"
        "the backward pass, one after each column-parallel one (query/key/value, MLP up).\n"
        "The vocab-split embedding and logits add their own (the lookup, the softmax's max\n"
        "and sum, the target's logit). Data parallelism adds the all-reduce of the\n"
        "gradients over 'data'. An instruction in a loop body runs once per layer.\n"
    )
    return {"losses": losses, "reference": reference, "collectives": collectives, "plan": plan}


if __name__ == "__main__":
    simulate_cpu_devices()  # no import above starts JAX's backends
    main()
