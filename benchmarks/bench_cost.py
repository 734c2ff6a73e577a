"""`eqshard.cost` against a measured step: its memory lower bound and its estimate.

Run: `python benchmarks/bench_cost.py [--width 4096] [--depth 8] [--batch 8192]`.

On the devices at hand (a GPU host: its GPU; else 8 simulated CPU devices, where
timings mean nothing for accelerators), a data-parallel MLP training step with
Adam: what `eqshard.cost` says (peak memory lower bound, FLOPs, the roofline
estimate on the matching hardware profile) beside what the device reports
(`peak_bytes_in_use`) and the measured step time (median of 20, after warm-up).
"""

import argparse
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import optax

import eqshard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
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
    x = eqshard.shard(jnp.ones((args.batch, args.width), dtype), "b d -> b* d")
    c = eqshard.cost(step, model, state, x, spec="... -> * ...", devices=len(devices))
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


if __name__ == "__main__":
    main()
