"""`eqshard.suggest`'s wall time: every candidate generated and compiled, ranked.

Run: `python benchmarks/bench_suggest.py [--only gpt8,gpt64,llama] [--workers N]
[--json PATH]`; `--json` also writes the numbers, and each ranking as
`ranked.to_json()` gives it, to PATH, for `benchmarks/report.py`.

- the stacked GPT of `examples/gpt_stacked.py` on 8 and on 64 simulated CPU
    devices (XLA:CPU), with AdamW, within a memory limit that rules data parallel
    out (640 KiB per device, as the tests use);
- the Llama-3-8B-shaped model of `examples/llama_8b.py` (abstract, bfloat16,
    AdamW, 256 sequences of 2,048 tokens: 4 per chip) on a TPU v5p:4x4x4 slice (64
    chips), compiled by XLA:TPU through libtpu on this CPU machine, within 95 GiB
    per chip (the v5p's HBM).

For each: the wall time of the whole search (tracing the step for its pairs,
generating, and compiling each candidate in worker processes, one per core unless
`--workers`), beside the wall time of one `eqshard.cost` of the best candidate in
this process times the number of candidates compiled (the search done one `cost`
after another), and their ratio; then the table.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp

import eqshard

# the examples as modules, importable by name in the worker processes
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import gpt_stacked
import llama_8b

GPT_BUDGET = 640 * 1024


def _inputs(ns, rows: int):
    model = eqx.filter_eval_shape(ns["build"])
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = eqx.filter_eval_shape(ns["optimizer"]().init, params)
    tokens = ns["batch"]()
    batch = jax.ShapeDtypeStruct((max(rows, tokens.shape[0]), *tokens.shape[1:]), jnp.int32)
    return model, opt_state, batch


def run(title: str, ns, rows: int, workers: int | None, **where) -> dict:
    model, opt_state, batch = _inputs(ns, rows)
    start = time.perf_counter()
    ranked = eqshard.suggest(model, opt_state, batch, step=ns["step"], workers=workers, **where)
    search = time.perf_counter() - start
    costed = [s for s in ranked if s.cost is not None]
    print(f"\n{title}: {len(ranked)} candidates ranked, {len(ranked.dropped)} dropped or failed")
    best = ranked.best
    one = None
    if best is not None:
        start = time.perf_counter()
        placed = {k: v for k, v in where.items() if k in ("devices", "target")}
        eqshard.cost(model, opt_state, batch, step=ns["step"], spec=best.rules, **placed)
        one = time.perf_counter() - start
        print(
            f"  wall time: suggest {search:.1f} s for {len(costed)} compiles; one cost of the "
            f"best in this process {one:.1f} s, so {len(costed)} one after another about "
            f"{one * len(costed):.1f} s: suggest takes {search / (one * len(costed)):.2f}x that"
        )
    else:
        print(f"  wall time: suggest {search:.1f} s for {len(costed)} compiles; nothing fits")
    print(ranked)
    found = ranked.to_json()
    for suggestion in found["suggestions"]:
        del suggestion["rules"]  # the spec files: long, and not what is timed
    return {
        "title": title,
        "search": search,
        "compiled": len(costed),
        "one_cost": one,
        "ranked": found,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="gpt8,gpt64,llama")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    args = parser.parse_args()
    only = set(args.only.split(","))
    print(f"jax {jax.__version__}, Python {sys.version.split()[0]}, {eqshard.__name__}")
    gpt, llama = vars(gpt_stacked), vars(llama_8b)
    results = {}
    if "gpt8" in only:
        results["gpt8"] = run(
            "stacked GPT, 8 devices", gpt, 8, args.workers, devices=8, max_memory=GPT_BUDGET
        )
    if "gpt64" in only:
        results["gpt64"] = run(
            "stacked GPT, 64 devices", gpt, 64, args.workers, devices=64, max_memory=GPT_BUDGET
        )
    if "llama" in only:
        results["llama"] = run(
            "Llama-3-8B-shaped, v5p:4x4x4",
            llama,
            256,
            args.workers,
            target="v5p:4x4x4",
            max_memory="95GiB",
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": args.workers, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
