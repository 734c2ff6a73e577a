"""A small GPT with stacked blocks, sharded Megatron-style on a ("data", "model") mesh.

The model is the GPT that `eqshard demo` trains (`eqshard/_demo/_model.py`), at
smaller sizes and with its activations named. Its transformer blocks are one
`Block` built for N keys with `eqx.filter_vmap`, so every block leaf has a leading
layer axis, and the model runs them with `jax.lax.scan`. `specs/gpt.eqshard.json` lays the stacked leaves out (its `...`
keeps the layer axis whole), the model and its AdamW state are placed on a 2 x 4
Auto mesh set with `jax.set_mesh`, and a few training steps are checked against the
same steps unsharded. The model names its activations (`eqshard.constrain(x, (...,
"seq", "embed"))` in each block, the logits in `loss`), and the sharded step runs
under `eqshard.use(rules)`, so the spec file's `"dims"` lay them out; the unsharded
run has no rules active, and its names change nothing. The example prints the
per-leaf reports and the collectives of the compiled step, as `eqshard.cost` reads
them.

Run: `python examples/gpt_stacked.py`: on 8 accelerators, or else on 8 simulated
CPU devices.

Check the spec from the command line, without an accelerator:

    eqshard validate examples/specs/gpt.eqshard.json
    eqshard check examples/specs/gpt.eqshard.json \\
        --model examples/gpt_stacked.py:build --devices 4 8 16
"""

import contextlib
import os
from collections import Counter
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jaxtyping import Array, Float, Int

import eqshard
from eqshard._demo._model import GPT, Sizes, build as build_gpt

SPEC = Path(__file__).parent / "specs" / "gpt.eqshard.json"
SIZES = Sizes(vocab=64, dim=32, heads=4, hidden=128, layers=2, seq=16)
VOCAB, SEQ, LAYERS, BATCH = SIZES.vocab, SIZES.seq, SIZES.layers, 8
MESH_SHAPE, MESH_AXES = (2, 4), ("data", "model")


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


def build(seed: int = 0) -> GPT:
    """The model, with GPT-2's initialisation: weights N(0, 0.02), biases 0 and
    LayerNorm scales 1; each block names its residual stream `(..., "seq", "embed")`
    with `eqshard.constrain`. `eqshard check --model examples/gpt_stacked.py:build`
    builds it too, abstractly."""
    return build_gpt(seed, SIZES, names=True)


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


def make_step(optimizer: optax.GradientTransformation):
    """One training step. It names no plan: under `eqshard.use(plan)`, `eqshard.jit`
    keeps every layout of that plan through it; under none, it is `eqx.filter_jit`."""

    @eqshard.jit
    def step(model: GPT, opt_state: Any, tokens: Int[Array, "batch seq"]):
        value, grads = eqx.filter_value_and_grad(loss)(model, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return value, eqx.apply_updates(model, updates), opt_state

    return step


def optimizer() -> optax.GradientTransformation:
    """AdamW, decaying the weight matrices only (`eqshard check --optimizer`)."""
    return optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask)


def batch() -> Int[Array, "batch seq"]:
    """A batch of token ids, shaped as training takes them (`eqshard check --make-batch`)."""
    return jnp.zeros((BATCH, SEQ + 1), jnp.int32)


step = make_step(optimizer())
"""The training step as `eqshard check --step examples/gpt_stacked.py:step` costs it."""


def main(steps: int = 3, spec: str | Path = SPEC) -> dict[str, Any]:
    """Trains `steps` steps sharded and unsharded, checks that the losses agree, and
    prints the reports and the compiled step's collectives. `spec` is the spec file
    that lays out the parameters and the activations.

    **Returns:** `{"losses": [...], "reference": [...], "collectives": {...}, "plan": plan}`:
    the sharded and the unsharded losses, how many times one sharded step runs each
    kind of collective (`eqshard.cost`), and the plan.
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
        with jax.set_mesh(mesh):
            plan = eqshard.plan(model, rules)  # on the mesh set above
        # the plan lays out the parameters, its rules' "dims" the activations
        with jax.set_mesh(mesh), eqshard.use(plan):
            model = eqshard.apply(model, plan)
            opt_state = eqshard.apply(opt_state, plan)  # moments follow their parameters
            tokens_in_shards = eqshard.apply(
                tokens, "b s -> b2 s 4"
            )  # over 'data', whole on 'model'
            # what one step moves: the program eqshard.jit runs under this plan
            step_cost = eqshard.cost(
                model, opt_state, tokens_in_shards, step=reference_step, spec=plan
            )
            losses = []
            for i in range(steps):
                value, model, opt_state = reference_step(model, opt_state, tokens_in_shards)
                losses.append(float(value))
                print(f"step {i}: loss {losses[-1]:.6f} (unsharded {reference[i]:.6f})")

    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    print(f"sharded losses equal the unsharded ones: max |diff| = {diff:.1e}\n")

    print(f"the plan's mesh, the one set with jax.set_mesh: {plan.mesh}")
    print(eqshard.report(model, plan))
    print("The AdamW state: its moments follow their parameters by path.")
    print(eqshard.report(opt_state, plan))

    collectives: Counter[str] = Counter()  # how many times one step runs each kind
    in_loops: Counter[str] = Counter()
    for collective in step_cost.collectives:
        collectives[collective.kind] += collective.count
        if collective.count > 1:  # in the scan's loop: once per layer
            in_loops[collective.kind] += collective.count
    print(
        "One step runs "
        + ", ".join(
            f"{count} {kind} ({in_loops[kind]} of them in the scan over the layers)"
            for kind, count in collectives.items()
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
