"""`eqshard.jit` against the floor, `eqx.filter_jit`, on 8 CPU devices.

Run: `python benchmarks/bench_jit.py [--json PATH]`. Every number comes from this
one run; `--json` also writes them to PATH, for `benchmarks/report.py`.

For each model, three steps run the same AdamW update on the same placed model,
optimizer state and batch, under an FSDP plan:

- the floor: `eqx.filter_jit(step)`, the step as written for one device;
- the old pattern: `eqx.filter_jit` of the step ending in
  `eqshard.constrain(model, plan)` (and the optimizer state's), under `jax.set_mesh`;
- `eqshard.jit(step)` under `eqshard.use(plan)`: the plan's layouts pinned on the
  inputs and outputs.

Each is called in rounds, the three interleaved, every call waited on; the table
gives the median seconds per call, its ratio to the floor, and how many times each
step was traced over all its calls (once is the aim).

Then a fresh `eqshard.jit(step)` is called three times as a drop-in for
`eqx.filter_jit` is: its first call given the model, optimizer state and batch not yet
placed, fresh from their constructors, each later call the last one's outputs. The
line gives the seconds of those three calls against the same three from placed
arguments (`eqshard.apply` first, inside the time), and the step's traces and compiles (`jax_log_compiles`) in each: one is
the aim, whatever the first call's placement.

Models: (a) `eqx.nn.MLP(16, 16, 32, 2)`, 6 arrays, where a call is mostly dispatch;
(b) the demo's GPT (`eqshard demo`), 4 stacked blocks of `eqx.nn` layers, a real step.
"""

import argparse
import json
import logging
import statistics
import time

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax

import eqshard
from eqshard._demo._model import build, loss as gpt_loss, tokens


def mlp_case():
    model = eqx.nn.MLP(16, 16, 32, 2, key=jax.random.key(0))
    x = jnp.asarray(np.random.RandomState(0).randn(64, 16).astype(np.float32))

    def loss(model, batch):
        return jnp.mean((jax.vmap(model)(batch) - batch) ** 2)

    return "eqx.nn.MLP(16, 16, 32, 2)", model, loss, x


def gpt_case():
    return "GPT of the demo", build(), gpt_loss, tokens()


def steps(loss, plan):
    optimizer = optax.adamw(1e-3)
    traces = {"floor": 0, "old pattern": 0, "eqshard.jit": 0}

    def body(model, opt_state, batch):
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    @eqx.filter_jit
    def floor(model, opt_state, batch):
        traces["floor"] += 1
        return body(model, opt_state, batch)

    @eqx.filter_jit
    def old(model, opt_state, batch):
        traces["old pattern"] += 1
        model, opt_state, value = body(model, opt_state, batch)
        return eqshard.constrain(model, plan), eqshard.constrain(opt_state, plan), value

    @eqshard.jit
    def new(model, opt_state, batch):
        traces["eqshard.jit"] += 1
        return body(model, opt_state, batch)

    return optimizer, {"floor": floor, "old pattern": old, "eqshard.jit": new}, traces


def bench(name, model, loss, batch, rounds, calls):
    spec = eqshard.load({"eqshard": 1, "mesh": [["data", "*"]], "default": "fsdp", "rules": []})
    plan = eqshard.plan(model, spec)
    first = {
        label: first_calls(model, loss, batch, plan, placed)
        for label, placed in (("unplaced", False), ("placed", True))
    }
    optimizer, fns, traces = steps(loss, plan)
    state = eqshard.apply(optimizer.init(eqx.filter(model, eqx.is_array)), plan)
    model = eqshard.apply(model, plan)
    batch = jax.device_put(batch, eqshard.expression.sharding("b ... -> b* ...", batch.shape))
    times = {label: [] for label in fns}
    assert isinstance(plan.mesh, jax.sharding.Mesh)  # the spec file's, on these devices
    with jax.set_mesh(plan.mesh), eqshard.use(plan):
        for fn in fns.values():  # compile each once
            jax.block_until_ready(fn(model, state, batch))
        for _ in range(rounds):
            for label, fn in fns.items():
                start = time.perf_counter()
                out = [fn(model, state, batch) for _ in range(calls)]
                jax.block_until_ready(out)
                times[label].append((time.perf_counter() - start) / calls)
    floor = statistics.median(times["floor"])
    arrays = len(jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))
    print(f"\n{name}: {arrays} arrays, {rounds} rounds of {calls} calls")
    print(f"  {'step':<14} {'per call':>12} {'x floor':>8} {'traces':>7}")
    for label in fns:
        t = statistics.median(times[label])
        print(f"  {label:<14} {t * 1e6:>10.1f}us {t / floor:>8.3f} {traces[label]:>7}")
    print(f"  {'first 3 calls':<14} {'seconds':>12} {'x placed':>8} {'traces':>7} {'compiles':>8}")
    for label, (seconds, traced, compiled) in first.items():
        ratio = seconds / first["placed"][0]
        print(f"  {label:<14} {seconds:>11.2f}s {ratio:>8.3f} {traced:>7} {compiled:>8}")
    return {
        "arrays": arrays,
        "rounds": rounds,
        "calls": calls,
        "seconds": {label: statistics.median(times[label]) for label in fns},
        "traces": dict(traces),
        "first_calls": {
            label: {"seconds": seconds, "traces": traced, "compiles": compiled}
            for label, (seconds, traced, compiled) in first.items()
        },
    }


class _Compiles(logging.Handler):
    """Counts the compiles of programs named `name` that `jax_log_compiles` logs."""

    def __init__(self, name):
        super().__init__(logging.DEBUG)
        self.name, self.count = name, 0

    def emit(self, record):
        if record.getMessage().startswith(f"Compiling jit({self.name})"):
            self.count += 1


def first_calls(model, loss, batch, plan, placed):
    """Three calls of a fresh `eqshard.jit` step, the first given the arguments as
    their constructors made them, or placed first by `eqshard.apply` (inside the time):
    (seconds, traces, compiles)."""
    optimizer, fns, traces = steps(loss, plan)
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    counted = _Compiles("new")
    loggers = [logging.getLogger(n) for n in ("jax._src.interpreters.pxla", "jax._src.dispatch")]
    for logger in loggers:  # counted here, not printed
        logger.addHandler(counted)
        logger.propagate = False
    try:
        with jax.log_compiles(True), eqshard.use(plan):
            start = time.perf_counter()
            if placed:
                model, state = eqshard.apply((model, state), plan)
            for _ in range(3):
                model, state, _ = fns["eqshard.jit"](model, state, batch)
            jax.block_until_ready((model, state))
            seconds = time.perf_counter() - start
    finally:
        for logger in loggers:
            logger.removeHandler(counted)
            logger.propagate = True
    return seconds, traces["eqshard.jit"], counted.count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    args = parser.parse_args()
    print(
        f"eqshard.jit against eqx.filter_jit; JAX {jax.__version__}, {len(jax.devices())} CPU devices"
    )
    results = {}
    for case, rounds, calls in ((mlp_case, 15, 200), (gpt_case, 9, 5)):
        name, *rest = case()
        results[name] = bench(name, *rest, rounds=rounds, calls=calls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
