"""Parse and `sharding` throughput, cold and cached, and against einshard.

Run: `python benchmarks/bench_expression.py [--json PATH]` (8 simulated CPU devices).
Every number comes from this one run and is printed beside its ratio; `--json` also
writes them to PATH, for `benchmarks/report.py`. The einshard column appears where
einshard is installed (it needs Python 3.12 or newer).
"""

import argparse
import itertools
import json
import time

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import eqshard
from eqshard._expression import _parse_text
from eqshard._sharding import cached_sharding, mesh

try:
    import einshard  # pyright: ignore[reportMissingImports]
except ImportError:
    einshard = None


def per_call(fn, items, repeat=5):
    """The best, over `repeat` runs, of the mean seconds per call of `fn` over `items`."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for item in items:
            fn(item)
        best = min(best, (time.perf_counter() - start) / len(items))
    return best


def fresh_parse(text):
    _parse_text.cache_clear()
    return eqshard.expression.parse(text)


def fresh_sharding(case):
    cached_sharding.cache_clear()
    mesh.cache_clear()
    _parse_text.cache_clear()
    return eqshard.expression.sharding(*case)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    args = parser.parse_args()
    texts = [
        f"x y -> {first} {second}"
        for a, b in itertools.product(["", "2", "*", "2*", "8"], ["", "4", "*", "8"])
        for first, second in [(f"x{a}", f"y{b}"), (f"y{b}", f"x{a}")]
    ]
    cases = []
    for text in texts:
        try:
            eqshard.expression.sharding(text, (64, 64))
            cases.append((text, (64, 64)))
        except eqshard.EqshardError:
            pass
    valid = [text for text, _ in cases]

    rows = []
    parse_cold = per_call(fresh_parse, valid)
    parse_hot = per_call(eqshard.expression.parse, valid * 200)
    rows.append(("parse, cold (cache cleared)", parse_cold, None))
    rows.append(("parse, cached", parse_hot, parse_cold / parse_hot))

    shard_cold = per_call(fresh_sharding, cases)
    shard_hot = per_call(lambda case: eqshard.expression.sharding(*case), cases * 200)
    rows.append(("sharding, cold (caches cleared)", shard_cold, None))
    rows.append(("sharding, cached", shard_hot, shard_cold / shard_hot))
    theirs = None
    if einshard is not None:
        make_sharding = einshard.make_sharding
        theirs = per_call(lambda case: make_sharding(case[0], n_dims=2), cases)
        rows.append(("einshard.make_sharding (no cache)", theirs, None))

    print(f"jax {jax.__version__}, {len(jax.devices())} CPU devices, {len(cases)} expressions\n")
    print(f"{'what':40} {'per call':>12}  ratio")
    for what, seconds, ratio in rows:
        text = "" if ratio is None else f"{ratio:8.0f}x faster than cold"
        print(f"{what:40} {seconds * 1e6:10.2f}us  {text}")
    print()
    print(f"sharding cold / parse cold:           {shard_cold / parse_cold:8.1f}x")
    if theirs is not None:
        print(f"einshard.make_sharding / eqshard cold:   {theirs / shard_cold:8.2f}x")
        print(f"einshard.make_sharding / eqshard cached: {theirs / shard_hot:8.0f}x")
    else:
        print("einshard is not installed here; install it (Python >= 3.12) for that column")
    if args.json:
        found = {"expressions": len(cases), "parse_cold": parse_cold, "parse_cached": parse_hot}
        found.update(sharding_cold=shard_cold, sharding_cached=shard_hot, einshard=theirs)
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
