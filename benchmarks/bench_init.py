"""Peak memory of building a model into its shards: `eqshard.init` against the others.

Run: `MALLOC_ARENA_MAX=2 python benchmarks/bench_init.py [--depth 8] [--width 4096]
[--json PATH]`. Every number comes from this one run, each case in a fresh process
(so its peak is its own); `--json` also writes them to PATH, for
`benchmarks/report.py`. glibc's allocator keeps freed memory in per-thread arenas; the
benchmark pins it (MALLOC_ARENA_MAX=2, set for the children if you do not) so
that resident memory tracks what is in use.

The model is `eqx.nn.MLP(width, width, width, depth)` (depth 8, width 4096: about
576 MB of float32), every weight split over all devices (`"o i -> o* i"`), on 8
simulated CPU devices, where device memory is host memory: the peak resident-set
growth of each case, over the model's bytes, is what the devices held at most.
On a GPU host, the device's own `peak_bytes_in_use` is printed too.

- `eqshard.init`: one `jit` per group of leaves, each with `out_shardings`;
- `one jit, out_shardings`: the whole factory in one `jit` (the usual recipe);
- `build, then apply`: the model built whole on one device, then placed;
- `constants, one jit (floor)`: a program with no random numbers, writing a
  constant per leaf in its shards: what JAX's runtime adds to any `jit`.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from _memory import reset_peak, rss  # benchmarks/_memory.py

CASES = [
    "eqshard.init",
    "one jit, out_shardings",
    "build, then apply",
    "constants, one jit (floor)",
]


def _case(name: str, width: int, depth: int) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import equinox as eqx
    import numpy as np

    import eqshard
    from eqshard._init import initializer

    def factory():
        return eqx.nn.MLP(width, width, width, depth, key=jax.random.key(0))

    rules = eqshard.load({"eqshard": 1, "rules": [{"path": "**.weight", "expr": "o i -> o* i"}]})
    abstract = eqx.filter_eval_shape(factory)
    plan = eqshard.plan(abstract, rules)
    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32)))  # start the backend
    reset_peak()
    base, _ = rss()
    start = time.perf_counter()
    if name == "eqshard.init":
        model = eqshard.init(factory, plan)
    elif name == "one jit, out_shardings":
        arrays = initializer(factory, plan)()
        model = eqx.combine(arrays, eqx.filter(abstract, eqx.is_array, inverse=True))
    elif name == "build, then apply":
        model = eqshard.apply(factory(), plan)
    else:  # the floor: a program that only writes its outputs, no random numbers

        def constants():  # a different value per leaf, so XLA cannot share buffers
            leaves, treedef = jax.tree.flatten(abstract)
            return jax.tree.unflatten(
                treedef,
                [
                    jax.numpy.full(x.shape, i, x.dtype)
                    if isinstance(x, jax.ShapeDtypeStruct)
                    else x
                    for i, x in enumerate(leaves)
                ],
            )

        arrays = initializer(constants, plan)()
        model = eqx.combine(arrays, eqx.filter(abstract, eqx.is_array, inverse=True))
    jax.block_until_ready(eqx.filter(model, eqx.is_array))
    seconds = time.perf_counter() - start
    _, peak = rss()
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    model_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))
    return {
        "seconds": seconds,
        "growth": peak - base,
        "model_bytes": model_bytes,
        "device_peak": sum(s.get("peak_bytes_in_use", 0) for s in stats),
        "platform": jax.devices()[0].platform,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(args.case, args.width, args.depth)))
        return
    env = {**os.environ, "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")}
    results = {}
    for name in CASES:
        command = [sys.executable, __file__, "--case", name]
        command += ["--width", str(args.width), "--depth", str(args.depth)]
        out = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    model_bytes = results["eqshard.init"]["model_bytes"]
    platform = results["eqshard.init"]["platform"]
    print(
        f"eqx.nn.MLP({args.width}, {args.width}, {args.width}, depth={args.depth}): "
        f"{model_bytes / 1e6:.0f} MB; every weight split; {platform}; "
        f"MALLOC_ARENA_MAX={env['MALLOC_ARENA_MAX']}"
    )
    print(f"{'case':<26} {'seconds':>8} {'peak growth':>12} {'/ model':>8} {'device peak':>12}")
    for name, r in results.items():
        device = f"{r['device_peak'] / 1e6:9.0f} MB" if r["device_peak"] else "        -"
        print(
            f"{name:<26} {r['seconds']:8.2f} {r['growth'] / 1e6:9.0f} MB "
            f"{r['growth'] / model_bytes:7.2f}x {device:>12}"
        )
    if args.json:
        found = {"width": args.width, "depth": args.depth, "model_bytes": model_bytes}
        found.update(platform=platform, malloc_arena_max=env["MALLOC_ARENA_MAX"], cases=results)
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
