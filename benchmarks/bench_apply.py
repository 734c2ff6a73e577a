"""`eqshard.apply` against the floor and against einshard, on 8 CPU devices.

Run: `python benchmarks/bench_apply.py [--json PATH]`. Every number comes from this
one run; `--json` also writes them to PATH, for `benchmarks/report.py`.

- the floor: one `jax.device_put(leaves, shardings)` with the shardings already built;
- the host-path floor: the same call on NumPy views of the leaves, which is the
  path `apply` takes for arrays that live on one CPU device;
- `apply`: resolve the spec, lay out every leaf, then that one `device_put`;
- einshard: `einshard(x, expr)` for each leaf, where einshard is installed
  (Python >= 3.12).

(c) times `eqshard.plan` from 21 path rules of a spec file against the same
layouts given as a spec tree.

(d) places model (a)'s Adam state with the model's plan (`apply(opt_state, plan)`,
matched to the model by structure) against the floor for the same shardings.

Models: (a) 1,000 `eqx.nn.Linear(8, 8)`: 2,000 small leaves; (b) 100
`eqx.nn.Linear(480, 512)`: 200 leaves, about 98 MB.
"""

import argparse
import json
import statistics
import sys
import time
import warnings

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import numpy as np

import eqshard

try:
    from einshard import einshard  # pyright: ignore[reportMissingImports]
except ImportError:
    einshard = None


def model_of(count, n_in, n_out):
    keys = jax.random.split(jax.random.key(0), count)
    return [eqx.nn.Linear(n_in, n_out, key=k) for k in keys]


def _linear_spec(layer):
    spec = eqshard.spec_tree(layer)
    return eqx.tree_at(
        lambda s: (s.weight, s.bias),
        spec,
        ("o i -> o* i", "o -> o*"),
        is_leaf=lambda x: x is None,
    )


def timed(fn, repeat):
    """The median seconds of `fn()` (whose result is waited on) over `repeat` runs."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(name, model, spec, repeat):
    # Inputs start on one device, as freshly built or loaded parameters do.
    model = jax.tree_util.tree_map(lambda x: jax.device_put(x, jax.devices()[0]), model)
    jax.block_until_ready(model)
    plan = eqshard.plan(model, spec)
    leaves = jax.tree_util.tree_leaves(model)
    shardings = [s for s in plan.flat_shardings if s is not None]
    expressions = [str(e) for e in jax.tree_util.tree_leaves(plan.expressions)]
    n_bytes = sum(x.nbytes for x in leaves)

    # Warm up every path once: compile nothing later, fill no cache later.
    jax.block_until_ready(jax.device_put(leaves, shardings))
    jax.block_until_ready(eqshard.apply(model, spec))

    # Interleave the runs so that drift of the machine hits all columns alike.
    floor, host, ours, plan_only = [], [], [], []
    for _ in range(repeat):
        floor.append(timed(lambda: jax.device_put(leaves, shardings), 1))
        host.append(timed(lambda: jax.device_put([np.asarray(x) for x in leaves], shardings), 1))
        ours.append(timed(lambda: eqshard.apply(model, spec), 1))
        plan_only.append(timed(lambda: eqshard.plan(model, spec).mesh, 1))
    floor_s, host_s, ours_s, plan_s = (statistics.median(t) for t in (floor, host, ours, plan_only))
    theirs_s = None
    if einshard is not None:
        place = einshard
        theirs_s = timed(
            lambda: [place(x, e) for x, e in zip(leaves, expressions)], max(1, repeat // 3)
        )

    print(f"({name}) {len(leaves)} leaves, {n_bytes / 1e6:.1f} MB, {len(jax.devices())} devices")
    print(f"    floor, one device_put with shardings built  {floor_s * 1e3:9.2f} ms")
    print(f"    the same from NumPy views (the host path)   {host_s * 1e3:9.2f} ms")
    print(
        f"    eqshard.apply                               {ours_s * 1e3:9.2f} ms   {ours_s / floor_s:5.2f}x the floor, {ours_s / host_s:5.2f}x the host-path floor"
    )
    print(f"      of which eqshard.plan (spec -> shardings) {plan_s * 1e3:9.2f} ms")
    if theirs_s is not None:
        print(
            f"    einshard, one call per leaf                 {theirs_s * 1e3:9.2f} ms   {theirs_s / ours_s:5.1f}x slower than apply"
        )
    else:
        print("    einshard is not installed here (it needs Python >= 3.12)")
    print()
    return {
        "leaves": len(leaves),
        "megabytes": n_bytes / 1e6,
        "floor": floor_s,
        "host_path": host_s,
        "apply": ours_s,
        "plan": plan_s,
        "einshard": theirs_s,
    }


def bench_rules(model, spec, repeat):
    """Resolving path rules from a spec file, against the same spec as a tree."""
    decoys = [{"path": f"**.decoy{i}.weight", "expr": "o i -> o* i"} for i in range(19)]
    rules = eqshard.load(
        {
            "eqshard": 1,
            "rules": [
                *decoys,
                {"path": "**.weight", "expr": "o i -> o* i"},
                {"path": "**.bias", "expr": "o -> o*"},
            ],
        }
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", eqshard.UnusedRuleWarning)
        tree_s = timed(lambda: eqshard.plan(model, spec).mesh, repeat)
        rules_s = timed(lambda: eqshard.plan(model, rules).mesh, repeat)
    leaves = len(jax.tree_util.tree_leaves(model))
    print(f"(c) eqshard.plan on model (a), {leaves} leaves")
    print(f"    from a spec tree                            {tree_s * 1e3:9.2f} ms")
    print(
        f"    from 21 path rules (19 never match)         {rules_s * 1e3:9.2f} ms   {rules_s / tree_s:5.2f}x the spec tree"
    )
    print()
    return {"leaves": leaves, "spec_tree": tree_s, "rules": rules_s}


def bench_state(model, spec, repeat):
    """An optimizer state laid out by the model's plan, against the floor."""
    import optax

    plan = eqshard.plan(model, spec)
    state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    state = jax.tree_util.tree_map(lambda x: jax.device_put(x, jax.devices()[0]), state)
    leaves = jax.tree_util.tree_leaves(state)
    shardings = [x.sharding for x in jax.tree_util.tree_leaves(eqshard.abstract(state, plan))]
    jax.block_until_ready(jax.device_put(leaves, shardings))
    jax.block_until_ready(eqshard.apply(state, plan))
    floor, ours = [], []
    for _ in range(repeat):
        floor.append(timed(lambda: jax.device_put(leaves, shardings), 1))
        ours.append(timed(lambda: eqshard.apply(state, plan), 1))
    floor_s, ours_s = statistics.median(floor), statistics.median(ours)
    print(f"(d) Adam's state of model (a), {len(leaves)} leaves, by the model's plan")
    print(f"    floor, one device_put with shardings built  {floor_s * 1e3:9.2f} ms")
    print(
        f"    eqshard.apply(opt_state, plan)              {ours_s * 1e3:9.2f} ms   {ours_s / floor_s:5.2f}x the floor"
    )
    print()
    return {"leaves": len(leaves), "floor": floor_s, "apply": ours_s}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, python {sys.version.split()[0]}\n")
    small = model_of(1000, 8, 8)
    results = {"a": bench("a", small, [_linear_spec(layer) for layer in small], repeat=15)}
    results["c"] = bench_rules(small, [_linear_spec(layer) for layer in small], repeat=7)
    results["d"] = bench_state(small, [_linear_spec(layer) for layer in small], repeat=7)
    large = model_of(100, 480, 512)
    results["b"] = bench("b", large, [_linear_spec(layer) for layer in large], repeat=9)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
