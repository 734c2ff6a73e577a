"""`eqshard.restore` against reading the file's bytes once, and its peak memory.

Run: `python benchmarks/bench_restore.py [--gb 0.5] [--leaves 32] [--drop-caches]
[--json PATH]`. Every number comes from this one run; each case runs in a fresh
process, so its peak resident memory (`ru_maxrss`) is its own. `--json` also
writes the numbers to PATH, for `benchmarks/report.py`.

Cases, all on the same file written by `eqx.tree_serialise_leaves`:

- `read bytes`: read the whole file once into memory: the disk's floor;
- `eqx.tree_deserialise_leaves`: Equinox's own loader (every leaf whole, on one
  device);
- `np.load + device_put`: leaf by leaf, each to its sharding (12 lines by hand);
- `eqshard.restore`: straight into the shards a plan gives.

Memory is the growth of the process's peak resident set over the case, less the
restored arrays themselves where they live in host memory (CPU devices): the
overhead, against the largest leaf. On a GPU, the device's own
`peak_bytes_in_use` is printed too.

Leaves are split over all devices (`"... o -> ... o*"`): on CPU, 8 simulated
devices; on a GPU host, its one GPU. `--drop-caches` writes to
`/proc/sys/vm/drop_caches` before each case (root only), so each reads from disk.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _memory import reset_peak, rss  # benchmarks/_memory.py

CASES = ["read bytes", "eqx.tree_deserialise_leaves", "np.load + device_put", "eqshard.restore"]


def _setup():
    """JAX, with 8 simulated CPU devices where there is no accelerator."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)  # no effect on a GPU's devices
    return jax


def _like(n_leaves: int, rows: int, cols: int):
    import jax
    import jax.numpy as jnp

    return [jax.ShapeDtypeStruct((rows, cols), jnp.float32) for _ in range(n_leaves)]


def _write(path: str, n_leaves: int, rows: int, cols: int) -> None:
    import equinox as eqx
    import numpy as np

    rng = np.random.default_rng(0)
    leaves = [rng.standard_normal((rows, cols), dtype=np.float32) for _ in range(n_leaves)]
    eqx.tree_serialise_leaves(path, leaves)


def _case(name: str, path: str, n_leaves: int, rows: int, cols: int) -> dict:
    jax = _setup()
    import equinox as eqx
    import numpy as np

    import eqshard

    like = _like(n_leaves, rows, cols)
    plan = eqshard.plan(like, "... o -> ... o*")
    shardings = plan.flat_shardings
    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32)))  # start the backend
    reset_peak()
    base, _ = rss()
    start = time.perf_counter()
    if name == "read bytes":
        with open(path, "rb") as f:
            data = f.read()
        out = [len(data)]
    elif name == "eqx.tree_deserialise_leaves":
        out = eqx.tree_deserialise_leaves(path, like)
    elif name == "np.load + device_put":
        out = []
        with open(path, "rb") as f:
            for sharding in shardings:
                out.append(jax.device_put(np.load(f), sharding))
    else:
        out = eqshard.restore(path, like, plan)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    _, peak = rss()
    on_host = jax.devices()[0].platform == "cpu" and name != "read bytes"
    kept = n_leaves * rows * cols * 4 if on_host else 0  # the restored arrays themselves
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    device_peak = max((s.get("peak_bytes_in_use", 0) for s in stats), default=0)
    return {
        "seconds": seconds,
        "rss_growth": max(peak - base - kept, 0),
        "device_peak": device_peak,
        "platform": jax.devices()[0].platform,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=0.5)
    parser.add_argument("--leaves", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--drop-caches", action="store_true")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    args = parser.parse_args()
    cols = 1024
    rows = max(8, int(args.gb * 1e9 / 4 / cols / args.leaves) // 8 * 8)
    if args.case:
        print(json.dumps(_case(args.case, args.file, args.leaves, rows, cols)))
        return
    leaf_bytes = rows * cols * 4
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "state.eqx")
        _write(path, args.leaves, rows, cols)
        size = os.path.getsize(path)
        print(
            f"file: {size / 1e9:.2f} GB, {args.leaves} leaves of {leaf_bytes / 1e6:.1f} MB "
            f"(float32[{rows}, {cols}]); best of {args.repeat} per case, each in a fresh "
            f"process{', page cache dropped' if args.drop_caches else ''}"
        )
        results = {}
        for name in CASES:
            runs = []
            for _ in range(args.repeat):
                if args.drop_caches:
                    os.sync()
                    with open("/proc/sys/vm/drop_caches", "w") as f:
                        f.write("3\n")
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        *("--case", name, "--file", path),
                        *("--gb", str(args.gb), "--leaves", str(args.leaves)),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            results[name] = min(runs, key=lambda r: r["seconds"])
        floor = results["read bytes"]["seconds"]
        print(f"platform: {results['eqshard.restore']['platform']}")
        print(
            f"{'case':<30} {'seconds':>8} {'GB/s':>6} {'/ read':>7} {'host overhead':>14} "
            f"{'/ leaf':>7} {'device peak':>12}"
        )
        for name, r in results.items():
            print(
                f"{name:<30} {r['seconds']:8.3f} {size / 1e9 / r['seconds']:6.2f} "
                f"{r['seconds'] / floor:6.2f}x {r['rss_growth'] / 1e6:12.0f} MB "
                f"{r['rss_growth'] / leaf_bytes:6.2f}x {r['device_peak'] / 1e6:10.0f} MB"
            )
        if args.json:
            found = {"bytes": size, "leaves": args.leaves, "leaf_bytes": leaf_bytes}
            found.update(repeat=args.repeat, drop_caches=args.drop_caches, cases=results)
            with open(args.json, "w") as f:
                json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
