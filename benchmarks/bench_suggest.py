"""`eqshard.suggest`'s wall time, pruned by its estimates beside exhaustive.

Run: `python benchmarks/bench_suggest.py [--only gpt8,gpt64,llama,llama_v5e] [--workers N]
[--json PATH]`; `--json` also writes the numbers, and each ranking as
`ranked.to_json()` gives it, to PATH, for `benchmarks/report.py`.

- the stacked GPT of `examples/gpt_stacked.py` on 8 and on 64 simulated CPU
    devices (XLA:CPU), with AdamW, within a memory limit that rules data parallel
    out (640 KiB per device, as the tests use);
- the Llama-3-8B-shaped model of `examples/llama_8b.py` (abstract, bfloat16,
    AdamW, 256 sequences of 2,048 tokens: 4 per chip) on a TPU v5p:4x4x4 slice (64
    chips), compiled by XLA:TPU through libtpu on this CPU machine, within 95 GiB
    per chip (the v5p's HBM);
- `llama_v5e`, only when named: the same model on a v5e:2x4 slice (8 chips), within
    each chip's 16 GiB, where memory is tight and most candidates do not fit.

For each, in one run: the wall time of the whole search as `suggest` runs it
(estimates first, then compiling only what they cannot rule out; at its default
`tolerance` and at 0.05, the default before) beside
`suggest(..., exhaustive=True)` (every candidate compiled), and their ratio; how many
candidates each compiled; whether both picked the same best; and the rank agreement of
the estimates the pruned search ranked by with the exhaustive search's compiled
figures, over every candidate both ranked (Kendall's tau: 1 is the same order, 0 no
better than chance); and how far those estimates overstated the compiled figures of
the candidates that lead (within 5% of the best), which the default tolerance must
cover (`overstated`). The floor: one `eqshard.cost` of the best in this process, times
the candidates the exhaustive search compiled. The GPT's searches take seconds, within
a shared machine's noise: each is run 3 times, interleaved, and the median kept.
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
from eqshard._search._policy import TOLERANCE
from eqshard.results import Ranked

# the examples as modules, importable by name in the worker processes
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import gpt_stacked
import llama_8b

GPT_BUDGET = 640 * 1024
REPEATS = 3  # the GPT's searches, each the median of 3: they take seconds, within noise


def _inputs(ns, rows: int):
    model = eqx.filter_eval_shape(ns["build"])
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = eqx.filter_eval_shape(ns["optimizer"]().init, params)
    tokens = ns["batch"]()
    batch = jax.ShapeDtypeStruct((max(rows, tokens.shape[0]), *tokens.shape[1:]), jnp.int32)
    return model, opt_state, batch


def kendall(first: list[float], second: list[float]) -> float:
    """Kendall's tau-a of two orders of the same items."""
    pairs = concordant = discordant = 0
    for i in range(len(first)):
        for j in range(i + 1, len(first)):
            a = (first[i] > first[j]) - (first[i] < first[j])
            b = (second[i] > second[j]) - (second[i] < second[j])
            pairs += 1
            concordant += a * b > 0
            discordant += a * b < 0
    return (concordant - discordant) / pairs if pairs else 1.0


TOLERANCES = (TOLERANCE, 0.05)  # suggest's default, and the one before it
LEADING = 0.05  # the candidates within this of the best, whose estimates must not hide them


def overstated(guessed: list[tuple[float, float]], best: float) -> float:
    """How far the estimates overstated the compiled seconds of the candidates within
    `LEADING` of the `best` (0 where none did): a tolerance below it can miss one."""
    leading = [(g, c) for g, c in guessed if c <= best * (1 + LEADING)]
    return max([0.0, *(1 - c / g for g, c in leading if g > 0)])


def _search(inputs, ns, workers, exhaustive, where, tolerance=TOLERANCE):
    start = time.perf_counter()
    found = eqshard.suggest(
        *inputs,
        step=ns["step"],
        workers=workers,
        exhaustive=exhaustive,
        tolerance=tolerance,
        **where,
    )
    return found, time.perf_counter() - start


def _median(runs: list[tuple[Ranked, float]]) -> tuple[Ranked, float]:
    """The search of median time of `runs` (each a result and its seconds)."""
    return sorted(runs, key=lambda run: run[1])[len(runs) // 2]


def run(title: str, ns, rows: int, workers: int | None, repeats: int = 1, **where) -> dict:
    """The searches side by side, each `repeats` times in turn (the median kept)."""
    inputs = _inputs(ns, rows)
    times: list[list[tuple[Ranked, float]]] = [[] for _ in range(len(TOLERANCES) + 1)]
    for _ in range(repeats):  # interleaved, so that a noisy spell falls on each alike
        times[0].append(_search(inputs, ns, workers, False, where))
        for k, tolerance in enumerate(TOLERANCES[1:], 1):
            times[k].append(_search(inputs, ns, workers, False, where, tolerance))
        times[-1].append(_search(inputs, ns, workers, True, where))
    pruned, pruned_seconds = _median(times[0])
    looser = [_median(each) for each in times[1:-1]]
    full, full_seconds = _median(times[-1])
    compiled = sum(s.cost is not None for s in pruned)
    costed = sum(s.cost is not None for s in full)
    print(f"\n{title}: {len(full)} candidates ranked, {len(full.dropped)} dropped or failed")
    seconds = {s.name: s.cost.estimate().seconds for s in full if s.cost is not None}
    guessed = [(s.guess, seconds[s.name]) for s in pruned if s.guess and s.name in seconds]
    agreement = kendall([g for g, _ in guessed], [c for _, c in guessed])
    over = overstated(guessed, min(seconds.values())) if seconds else 0.0
    same = (pruned.best and pruned.best.name) == (full.best and full.best.name)
    one = None
    if full.best is not None:
        start = time.perf_counter()
        placed = {k: v for k, v in where.items() if k in ("simulate", "target")}
        eqshard.cost(*inputs, step=ns["step"], spec=full.best.rules, **placed)
        one = time.perf_counter() - start
    floor = None if one is None else one * costed
    print(
        f"  suggest {pruned_seconds:.1f} s, {compiled} of {len(pruned)} compiled; "
        f"exhaustive {full_seconds:.1f} s, {costed} compiled: "
        f"{full_seconds / pruned_seconds:.2f}x the pruned search's time"
    )
    if floor is not None:
        print(
            f"  floor: one cost of the best in this process {one:.1f} s, times {costed}: "
            f"{floor:.1f} s; suggest takes {pruned_seconds / floor:.2f}x that"
        )
    others = []
    for tolerance, (found, seconds) in zip(TOLERANCES[1:], looser):
        agrees = (found.best and found.best.name) == (full.best and full.best.name)
        count = sum(s.cost is not None for s in found)
        others.append(
            {"tolerance": tolerance, "search": seconds, "compiled": count, "same_best": agrees}
        )
        print(
            f"  tolerance {tolerance}: suggest {seconds:.1f} s, {count} compiled, same best: "
            f"{'yes' if agrees else 'NO'}"
        )
    print(
        f"  same best: {'yes' if same else 'NO'} ({pruned.best.name if pruned.best else None}); "
        f"rank agreement of its estimates with the compiled figures over {len(guessed)} "
        f"candidates: Kendall's tau {agreement:.2f}; the estimates overstated the leaders' "
        f"compiled figures by at most {over:.1%}"
    )
    print(pruned)
    found = pruned.to_json()
    for suggestion in found["suggestions"]:
        del suggestion["rules"]  # the spec files: long, and not what is timed
    return {
        "title": title,
        "search": pruned_seconds,
        "compiled": compiled,
        "exhaustive": full_seconds,
        "exhaustive_compiled": costed,
        "same_best": same,
        "kendall": agreement,
        "overstated": over,
        "tolerances": others,
        "ranked_with": len(guessed),
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
            "stacked GPT, 8 devices",
            gpt,
            8,
            args.workers,
            REPEATS,
            simulate=8,
            max_memory=GPT_BUDGET,
        )
    if "gpt64" in only:
        results["gpt64"] = run(
            "stacked GPT, 64 devices",
            gpt,
            64,
            args.workers,
            REPEATS,
            simulate=64,
            max_memory=GPT_BUDGET,
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
    if "llama_v5e" in only:  # memory-tight: 16 GiB per chip (not in the default runs)
        results["llama_v5e"] = run(
            "Llama-3-8B-shaped, v5e:2x4", llama, 256, args.workers, target="v5e:2x4"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": args.workers, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
