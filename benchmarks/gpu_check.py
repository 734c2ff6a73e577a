"""What a real GPU says of eqshard's figures: run on one lent GPU, never in CI.

Run: `python benchmarks/gpu_check.py [--json PATH]` on a machine with one NVIDIA GPU.
Every number comes from this one run; `--json` writes them to PATH.

1. **Memory.** For each model's AdamW step, the step is compiled ahead of time for
   the GPU (XLA's autotuner off, so that compiling allocates nothing the step then
   seems to hold), its arguments placed, and the device's own allocator read
   (`memory_stats()`: `bytes_in_use` before the step, `peak_bytes_in_use` after
   it). Beside that: XLA:GPU's memory analysis (arguments, outputs, aliased,
   temporaries, its own peak) and `eqshard.cost`'s `peak`, `peak_includes` and
   `compiler`, on the same GPU. The allocator's peak less what was in use before
   the step, plus the arguments, is what the step held at once: the figure a peak
   rule for XLA:GPU must match.
2. **Runtime errors.** An `eqx.error_if` that fires inside `eqshard.jit` on the GPU
   raises `EquinoxRuntimeError` with the user's message, as `eqx.filter_jit` does.
3. **Speed.** The same placed step under `eqshard.jit` and under `eqx.filter_jit`,
   called in interleaved rounds: median seconds per call and their ratio.
4. **Without the GPU.** Each model's step costed for this GPU as a target
   (`target="h200:1"`, XLA:GPU from XLA's description, no device used) beside the
   same step compiled for the GPU itself (autotuned, as a user's step is): memory
   analysis, FLOPs and collectives, side by side.

Each part runs in a process of its own (`--part`), so that XLA's flags for one
(the autotuner off, for part 1) do not reach the others.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if "--part=memory" in sys.argv:  # compiling then allocates nothing the step seems to hold
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0"

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqshard

MODELS = {  # name: (in, width, depth, rows): the largest holds about 13 GB at once
    "mlp-1024x4096x4": (1024, 4096, 4, 8192),
    "mlp-2048x8192x6": (2048, 8192, 6, 16384),
}


def _arguments(name: str):
    size, width, depth, rows = MODELS[name]
    model = eqx.nn.MLP(size, size, width, depth, key=jax.random.key(0))
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    x = jax.random.normal(jax.random.key(1), (rows, size))
    return model, opt_state, x, optimizer


def _step(optimizer):
    def step(model, opt_state, x):
        def loss(m):
            return jnp.mean((jax.vmap(m)(x) - x) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    return step


def memory(name: str) -> dict:
    model, opt_state, x, optimizer = _arguments(name)
    step = _step(optimizer)
    spec = "... -> * ..."  # one GPU: every leaf whole
    found: dict = {"model": name}
    cost = eqshard.cost(model, opt_state, x, step=step, spec=spec, devices=1)
    found["eqshard"] = {
        "compiler": cost.compiler,
        "peak": cost.memory.peak,
        "peak_includes": cost.memory.peak_includes,
        "reported_peak": cost.memory.reported_peak,
        "arguments": cost.memory.arguments,
        "outputs": cost.memory.outputs,
        "temporaries": cost.memory.temporaries,
    }
    plan = eqshard.plan(model, spec, devices=jax.devices()[:1])
    placed = eqshard.apply((model, opt_state, x), plan)
    with eqshard.use(plan):
        compiled = eqshard.jit(step).lower(*placed).compile()
        analysis = compiled.memory_analysis()
        found["xla"] = {
            key: getattr(analysis, key, None)
            for key in (
                "argument_size_in_bytes",
                "output_size_in_bytes",
                "alias_size_in_bytes",
                "temp_size_in_bytes",
                "generated_code_size_in_bytes",
                "peak_memory_in_bytes",
            )
        }
        device = jax.devices()[0]
        jax.block_until_ready(placed)
        before = device.memory_stats() or {}
        out = compiled(*placed)
        jax.block_until_ready(out)
        after = device.memory_stats() or {}
    found["allocator"] = {
        "bytes_in_use_before": before.get("bytes_in_use"),
        "peak_bytes_in_use_before": before.get("peak_bytes_in_use"),
        "peak_bytes_in_use_after": after.get("peak_bytes_in_use"),
        "bytes_in_use_after": after.get("bytes_in_use"),
    }
    arguments = found["xla"]["argument_size_in_bytes"] or 0
    if after.get("peak_bytes_in_use") and before.get("bytes_in_use") is not None:
        held = after["peak_bytes_in_use"] - before["bytes_in_use"] + arguments
        grew = after["peak_bytes_in_use"] > (before.get("peak_bytes_in_use") or 0)
        found["step_held_at_once"] = held if grew else None  # None: unknown
    return found


def runtime_error() -> dict:
    def check(x):
        return eqx.error_if(x, x.sum() > 0, "the sum is positive")

    x = jnp.ones(8)
    texts = {}
    for name, jitted in (
        ("filter_jit", eqx.filter_jit(check)),
        ("eqshard.jit", eqshard.jit(check)),
    ):
        eqx.clear_caches()  # error_if's own jitted check keeps the stack of its first trace
        jax.clear_caches()
        try:
            jax.block_until_ready(jitted(x))
            texts[name] = "no error"
        except Exception as error:  # what each raises, by class and text
            texts[name] = f"{type(error).__module__}.{type(error).__qualname__}: {error}"
    return texts


def speed(name: str, rounds: int = 30) -> dict | None:
    if name != next(iter(MODELS)):
        return None  # the first model only
    model, opt_state, x, optimizer = _arguments(name)
    step = _step(optimizer)
    plan = eqshard.plan(model, "... -> * ...", devices=jax.devices()[:1])
    placed = eqshard.apply((model, opt_state, x), plan)
    floor = eqx.filter_jit(step)
    with eqshard.use(plan):
        ours = eqshard.jit(step)
        for f in (floor, ours):
            jax.block_until_ready(f(*placed))
        times = {"filter_jit": [], "eqshard.jit": []}
        for _ in range(rounds):
            for label, f in (("filter_jit", floor), ("eqshard.jit", ours)):
                start = time.perf_counter()
                jax.block_until_ready(f(*placed))
                times[label].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": name,
        "median_s": medians,
        "ratio": medians["eqshard.jit"] / medians["filter_jit"],
    }


def deviceless(name: str) -> dict:
    model, opt_state, x, optimizer = _arguments(name)
    model, opt_state, x = (
        eqx.filter_eval_shape(lambda t: t, tree) for tree in (model, opt_state, x)
    )
    step = _step(optimizer)
    spec = "... -> * ..."
    kind = jax.devices()[0].device_kind.lower()
    target = "h200:1" if "h200" in kind else "h100:1"
    found: dict = {"model": name, "target": target}
    for label, on in (("target", target), ("gpu", None)):
        if on is None:  # the GPU itself, autotuned
            c = eqshard.cost(model, opt_state, x, step=step, spec=spec, devices=1)
        else:  # XLA:GPU from the GPU's description, the device unused
            c = eqshard.cost(model, opt_state, x, step=step, spec=spec, target=on)
        found[label] = {
            "compiler": c.compiler,
            "arguments": c.memory.arguments,
            "outputs": c.memory.outputs,
            "temporaries": c.memory.temporaries,
            "reported_peak": c.memory.reported_peak,
            "peak": c.memory.peak,
            "flops": c.flops,
            "bytes_accessed": c.bytes_accessed,
        }
    return found


PARTS = {"memory": memory, "deviceless": deviceless, "speed": speed}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--any-device", action="store_true", help="run on a CPU too (a dry run)")
    parser.add_argument("--part", choices=[*PARTS, "runtime_error"], help="run one part only")
    args = parser.parse_args()
    device = jax.devices()[0]
    results: dict = {
        "jax": jax.__version__,
        "device": f"{device.platform}: {device.device_kind}",
    }
    if device.platform != "gpu" and not args.any_device:
        sys.exit(f"gpu_check needs a GPU; this process has {device.platform}")
    if args.part:  # one part, in this process: its JSON on stdout's last line
        if args.part == "runtime_error":
            found: object = runtime_error()
        else:
            found = [PARTS[args.part](name) for name in MODELS]
        print(json.dumps(found, default=str))
        return
    for part in ("memory", "deviceless", "runtime_error", "speed"):
        run = subprocess.run(
            [
                sys.executable,
                __file__,
                f"--part={part}",
                *(["--any-device"] if args.any_device else []),
            ],
            capture_output=True,
            text=True,
        )
        lines = run.stdout.strip().splitlines()
        try:
            results[part] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            results[part] = {"error": run.stderr[-3000:]}
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
