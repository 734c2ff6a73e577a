"""Path rules that never match must cost (almost) nothing, on 8 CPU devices.

Run: `python benchmarks/bench_rules.py [--json PATH]`. Every number comes from this
one run; `--json` also writes them to PATH, for `benchmarks/report.py`.

The model: 100 blocks of 10 named leaves (`blocks.0.attn.query_proj.weight`, ...),
1,000 abstract `jax.ShapeDtypeStruct` leaves. Against it, 5,000 rules that match no
leaf, of each of three forms, `**.nameN.**`, `nameN.*` and `**.x*_N`, and all
15,000 together, each list followed by one rule that matches every leaf. Each
case is timed as the best of several runs, and compared with the same rule
alone (0 extra rules):

(a) `eqshard._paths._match.PathIndex`: building it from the patterns, then `first()` on
    the 1,000 leaf paths. Building is linear in the rules; the look-ups should
    not grow with them.
(b) `eqshard.plan(model, rules)` from a loaded spec file, the public path.
"""

import argparse
import json
import signal
import sys
import time
import warnings
from collections.abc import Callable

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp

import eqshard
from eqshard._paths._match import PathIndex
from eqshard._paths._names import segments

BLOCKS = 100
EXTRA = 5000
EXPR = "o i -> o* i"
PLAN_CAP_S = 5.0  # longer plan calls are stopped: rules still slow before the index
MATCHING = "blocks.*.**"  # the one rule that matches every leaf


def model_of(blocks: int) -> dict:
    leaf = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    proj = {"weight": leaf, "bias": leaf}
    block = {
        "attn": {f"{n}_proj": dict(proj) for n in ("query", "key", "value", "out")},
        "mlp": {"up": {"weight": leaf}, "down": {"weight": leaf}},
    }
    return {"blocks": [jax.tree_util.tree_map(lambda x: x, block) for _ in range(blocks)]}


def cases() -> dict[str, list[str]]:
    forms = {
        "**.nameN.**": [f"**.name{i}.**" for i in range(EXTRA)],
        "nameN.*": [f"name{i}.*" for i in range(EXTRA)],
        "**.x*_N": [f"**.x*_{i}" for i in range(EXTRA)],
    }
    every = [p for extra in forms.values() for p in extra]
    return {
        "0 extra rules": [MATCHING],
        **{f"{EXTRA:,} x {form}": [*extra, MATCHING] for form, extra in forms.items()},
        f"all {len(every):,} together": [*every, MATCHING],
    }


def best(fn: Callable[[], object], repeat: int, budget_s: float) -> float:
    """The least seconds of `fn()` over `repeat` runs, fewer once `budget_s` is spent."""
    times: list[float] = []
    spent = 0.0
    while len(times) < repeat and (not times or spent < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return min(times)


def _build_and_find(patterns: list[str], paths: list[tuple[str, ...]]) -> list[int | None]:
    index = PathIndex(patterns)
    return [index.first(s) for s in paths]


def _interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """The least seconds of each function over `rounds` rounds that run each once, so
    that the drift of a shared machine hits all cases alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def bench_index(paths: list[tuple[str, ...]], table: dict[str, list[str]]) -> dict[str, dict]:
    print(f"(a) PathIndex on {len(paths):,} leaf paths: build it, then first() on every path")
    print(
        f"    {'case':<28} {'build':>9}   {'first() on all':>14} {'ratio':>6}   {'both':>9} {'ratio':>6}"
    )
    indexes = {name: PathIndex(patterns) for name, patterns in table.items()}
    for name, index in indexes.items():  # only the last rule matches, and every leaf
        assert [index.first(s) for s in paths] == [len(index) - 1] * len(paths), name
    find = _interleaved(
        {name: lambda i=index: [i.first(s) for s in paths] for name, index in indexes.items()}, 30
    )
    build = _interleaved({name: lambda p=p: PathIndex(p) for name, p in table.items()}, 7)
    both = _interleaved(
        {name: lambda p=p: _build_and_find(p, paths) for name, p in table.items()}, 7
    )
    base = next(iter(table))
    for name in table:
        print(
            f"    {name:<28} {build[name] * 1e3:6.2f} ms   {find[name] * 1e3:11.2f} ms"
            f" {find[name] / find[base]:5.2f}x   {both[name] * 1e3:6.2f} ms {both[name] / both[base]:5.2f}x"
        )
    print()
    return {name: {"build": build[name], "first": find[name], "both": both[name]} for name in table}


class _Stopped(Exception):
    pass


def _capped(fn: Callable[[], object], cap_s: float) -> float | None:
    """The seconds of one `fn()`, or `None` if it was stopped after `cap_s`."""

    def stop(signum: int, frame: object) -> None:
        raise _Stopped

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, cap_s)
    start = time.perf_counter()
    try:
        fn()
        return time.perf_counter() - start
    except _Stopped:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def bench_plan(model: dict, table: dict[str, list[str]]) -> dict[str, dict]:
    leaves = len(jax.tree_util.tree_leaves(model))
    print(
        f"(b) eqshard.plan(model, eqshard.load(...)) on {leaves:,} leaves; a call is stopped after {PLAN_CAP_S:.0f} s"
    )
    print(f"    {'case':<28} {'first call':>10} {'ratio':>8}   {'later calls':>11} {'ratio':>8}")
    with warnings.catch_warnings():  # start JAX and make the mesh once, untimed
        warnings.simplefilter("ignore")
        eqshard.plan(
            model, eqshard.load({"eqshard": 1, "rules": [{"path": MATCHING, "expr": EXPR}]})
        )
    base_first = base_later = None
    results: dict[str, dict] = {}
    for name, patterns in table.items():
        rules = eqshard.load({"eqshard": 1, "rules": [{"path": p, "expr": EXPR} for p in patterns]})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first_s = _capped(lambda r=rules: eqshard.plan(model, r).mesh, PLAN_CAP_S)
            later_s = None
            if first_s is not None:
                later_s = best(lambda r=rules: eqshard.plan(model, r).mesh, 7, 3.0)
        if base_first is None:
            assert first_s is not None
            assert later_s is not None
            base_first, base_later = first_s, later_s
        print(f"    {name:<28} {_ms(first_s, base_first)}   {_ms(later_s, base_later)}")
        results[name] = {"first_call": first_s, "later_calls": later_s}
    print()
    return results


def _ms(seconds: float | None, base: float | None) -> str:
    if seconds is None or base is None:
        return f"{'stopped':>10} {f'> {PLAN_CAP_S / base:.0f}x' if base else '':>8}"
    return f"{seconds * 1e3:7.2f} ms {seconds / base:7.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, python {sys.version.split()[0]}\n")
    model = model_of(BLOCKS)
    flat, _ = jax.tree_util.tree_flatten_with_path(model)
    paths = [segments(path) for path, _ in flat]
    table = cases()
    index = bench_index(paths, table)
    plan = bench_plan(model, table)
    if args.json:
        leaves = len(paths)
        with open(args.json, "w") as f:
            json.dump({"leaves": leaves, "index": index, "plan": plan}, f, indent=1)


if __name__ == "__main__":
    main()
