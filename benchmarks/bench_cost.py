"""`eqshard.cost` against a measured step, and on TPU slices against XLA:CPU.

Run: `python benchmarks/bench_cost.py [--width 4096] [--depth 4] [--batch 8192]`, and
`python benchmarks/bench_cost.py --targets v5e:4x4,v5p:4x4x4` for the second part.
`--json PATH` also writes the numbers to PATH, for `benchmarks/report.py`.

First part:

On the devices at hand (a GPU host: its GPU; else 8 simulated CPU devices, where
timings mean nothing for accelerators), a data-parallel MLP training step with
Adam: what `eqshard.cost` says (peak memory lower bound, FLOPs, the roofline
estimate on the matching hardware profile) beside what the device reports
(`peak_bytes_in_use`) and the measured step time (median of 20, after warm-up).

With `--targets`: the stacked GPT of `examples/gpt_stacked.py` under its spec file
and the Llama-3-8B-shaped model of `examples/llama_8b.py` (abstract, bfloat16,
AdamW) under `LLAMA_SPEC`, each compiled for each TPU slice by XLA:TPU (libtpu,
on this CPU machine) and for as many simulated CPU devices by XLA:CPU: the compile
time of each, the memory per device of each (and the slice's HBM, and whether it
fits), and the bytes moved per step by mesh axis.
"""

import argparse
import json
import statistics
import sys
import time

import jax

if "--targets" in sys.argv:  # compiled for TPU slices on this CPU machine: no TPU here
    jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import optax

import eqshard


def _gib(n: float) -> str:
    from eqshard._report import human_bytes

    return human_bytes(int(n))


def _by_axis(c) -> str:
    totals: dict[str, int] = {}
    for (kind, axes), size in c.bytes_by_axes().items():
        key = f"{kind} over {'+'.join(axes) or '-'}"
        totals[key] = totals.get(key, 0) + size
    return ", ".join(f"{key} {_gib(size)}" for key, size in sorted(totals.items()))


def compare_targets(targets: list[str]) -> list[dict]:
    """Each model on each slice, XLA:TPU beside XLA:CPU on as many devices."""
    from pathlib import Path

    # The examples as modules, importable by name in the worker processes that
    # compile on more CPU devices than this one has (they take this `sys.path`).
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    import gpt_stacked
    import llama_8b

    models = {
        "stacked GPT (examples/gpt_stacked.py)": (
            vars(gpt_stacked),
            eqshard.load(gpt_stacked.SPEC),
        ),
        "Llama-3-8B-shaped (examples/llama_8b.py)": (
            vars(llama_8b),
            eqshard.load(llama_8b.LLAMA_SPEC),
        ),
    }
    print(f"jax {jax.__version__}; XLA:TPU beside XLA:CPU, per device")
    results = []
    for title, (ns, spec) in models.items():
        model = eqx.filter_eval_shape(ns["build"])
        params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
        opt_state = eqx.filter_eval_shape(ns["optimizer"]().init, params)
        print(f"\n{title}")
        for target in targets:
            start = time.perf_counter()
            tpu = eqshard.cost(
                model, opt_state, _batch(ns, target), step=ns["step"], spec=spec, target=target
            )
            tpu_s = time.perf_counter() - start
            start = time.perf_counter()
            cpu = eqshard.cost(
                model,
                opt_state,
                _batch(ns, target),
                step=ns["step"],
                spec=spec,
                devices=tpu.devices,
            )
            cpu_s = time.perf_counter() - start
            mesh = dict(zip(tpu.mesh.axis_names, tpu.mesh.axis_sizes)) if tpu.mesh else {}
            assert tpu.memory_per_device is not None
            print(f"  {target} ({tpu.devices} chips, mesh {mesh}), {tpu.compiler}")
            print(
                f"    compile: XLA:TPU {tpu_s:.1f} s, XLA:CPU {cpu_s:.1f} s; parameters "
                f"{_gib(tpu.memory.parameters)}, optimizer {_gib(tpu.memory.optimizer)}"
            )
            print(
                f"    peak: XLA:TPU {_gib(tpu.memory.peak)} (arguments {_gib(tpu.memory.arguments)}, "
                f"outputs {_gib(tpu.memory.outputs)}, temporaries {_gib(tpu.memory.temporaries)}) "
                f"of {_gib(tpu.memory_per_device)} HBM: {'fits' if tpu.fits else 'does not fit'}; "
                f"XLA:CPU {_gib(cpu.memory.peak)}, {cpu.memory.peak / tpu.memory.peak:.2f}x"
            )
            print(f"    moved per step, XLA:TPU: {_by_axis(tpu)}")
            print(f"    moved per step, XLA:CPU: {_by_axis(cpu)}")
            print(
                f"    estimate on {tpu.estimate().hardware.name}: {tpu.estimate().seconds * 1e3:.1f} ms"
            )
            results.append(
                {
                    "model": title,
                    "target": target,
                    "devices": tpu.devices,
                    "mesh": mesh,
                    "compiler": tpu.compiler,
                    "compile_seconds": {"tpu": tpu_s, "cpu": cpu_s},
                    "parameters": tpu.memory.parameters,
                    "optimizer": tpu.memory.optimizer,
                    "peak": {"tpu": tpu.memory.peak, "cpu": cpu.memory.peak},
                    "memory_per_device": tpu.memory_per_device,
                    "fits": tpu.fits,
                    "moved": {"tpu": _axis_bytes(tpu), "cpu": _axis_bytes(cpu)},
                }
            )
    return results


def _axis_bytes(c) -> dict[str, int]:
    """Bytes moved per step and device, by collective kind and mesh axes."""
    totals: dict[str, int] = {}
    for (kind, axes), size in c.bytes_by_axes().items():
        key = f"{kind} over {'+'.join(axes) or '-'}"
        totals[key] = totals.get(key, 0) + size
    return totals


def _batch(ns, target: str):
    """The model's batch, with as many sequences as the slice has chips where it has
    fewer (each `data` device a whole sequence)."""
    tokens = ns["batch"]()
    chips = 1
    for size in target.partition(":")[2].split("x"):
        chips *= int(size)
    rows = max(tokens.shape[0], chips)
    return jax.ShapeDtypeStruct((rows, *tokens.shape[1:]), tokens.dtype)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--targets", default=None, help="TPU slices: v5e:4x4,v5p:4x4x4")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    args = parser.parse_args()
    if args.targets:
        found = compare_targets(args.targets.split(","))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"targets": found}, f, indent=1)
        return
    dtype = jnp.dtype(args.dtype)
    devices = jax.devices()
    gpu = devices[0].platform == "gpu"
    optimizer = optax.adam(1e-4)

    def build():
        model = eqx.nn.MLP(args.width, args.width, args.width, args.depth, key=jax.random.key(0))
        return jax.tree_util.tree_map(lambda x: x.astype(dtype) if eqx.is_array(x) else x, model)

    @eqx.filter_jit(donate="all-except-first")
    def step(model, state, x):
        def loss(m):
            return jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, state = optimizer.update(grads, state)
        return eqx.apply_updates(model, updates), state, value

    model = eqshard.init(build, "... -> * ...")
    state = eqshard.apply(optimizer.init(eqx.filter(model, eqx.is_array)), "... -> * ...")
    x = eqshard.apply(jnp.ones((args.batch, args.width), dtype), "b d -> b* d")
    c = eqshard.cost(model, state, x, step=step, spec="... -> * ...", devices=len(devices))
    for device in devices:
        device.memory_stats()  # touch, so the counters exist
    model, state, _ = step(model, state, x)
    jax.block_until_ready(model)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        model, state, value = step(model, state, x)
        jax.block_until_ready(value)
        times.append(time.perf_counter() - start)
    measured = statistics.median(times)
    peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in devices)
    profile = "h100" if gpu and "H100" in devices[0].device_kind else None
    print(
        f"{devices[0].device_kind} x {len(devices)}: MLP({args.width}, depth={args.depth}), "
        f"batch {args.batch}, {args.dtype}, Adam, data parallel"
    )
    print(
        f"  cost: parameters {c.memory.parameters / 1e6:.0f} MB, optimizer "
        f"{c.memory.optimizer / 1e6:.0f} MB, peak lower bound {c.memory.peak / 1e6:.0f} MB, "
        f"{c.flops / 1e9:.1f} GFLOP per device"
    )
    if peak:
        print(
            f"  device peak_bytes_in_use {peak / 1e6:.0f} MB: "
            f"{peak / c.memory.peak:.2f}x the lower bound"
        )
    print(f"  measured step: {measured * 1e3:.2f} ms (median of 20)")
    if profile:
        estimate = c.estimate(profile)
        print(
            f"  estimate on {estimate.hardware.name}: {estimate.seconds * 1e3:.2f} ms "
            f"(compute {estimate.compute * 1e3:.2f}, memory {estimate.memory * 1e3:.2f}, "
            f"communication {estimate.communication * 1e3:.2f}); measured / estimate "
            f"{measured / estimate.seconds:.2f}x"
        )
    else:
        print("  no hardware profile for these devices: simulated CPU timings say nothing")
    if args.json:
        found = {"device_kind": devices[0].device_kind, "devices": len(devices)}
        found.update(width=args.width, depth=args.depth, batch=args.batch, dtype=args.dtype)
        found.update(parameters=c.memory.parameters, optimizer=c.memory.optimizer)
        found.update(peak=c.memory.peak, flops=c.flops, measured=measured, device_peak=peak)
        if profile:
            found["estimate"] = c.estimate(profile).seconds
        with open(args.json, "w") as f:
            json.dump({"mlp": found}, f, indent=1)


if __name__ == "__main__":
    main()
