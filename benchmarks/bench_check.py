"""`eqshard check` without `--step` on 16 to 65,536 devices, as a user runs it.

Run: `python benchmarks/bench_check.py [--quick] [--json PATH]` (`--quick` skips the
old way, which takes about a minute and a half). Every number comes from this one
run; `--json` also writes them to PATH, for `benchmarks/report.py`.

The model: `tests/llama_model.py`, Llama-3-8B-shaped (real `eqx.nn` modules, 32
stacked layers, 8 billion parameters, built with `eqx.filter_eval_shape`), under
its spec (FSDP over `data`, tensor parallel over `model` 16).

(a) Now: `python -m eqshard check SPEC --model ... --devices N --format json`,
    the whole command in a fresh process: Python, JAX, the worker that builds
    the model once and lays it out on an abstract mesh, the JSON. Best of 3.
(b) The old way: what each count's worker did before layouts were abstract, in
    a fresh process: start JAX on N simulated CPU devices, build the model, plan
    on `jax.devices()[:N]`, read each leaf's bytes per device, and exit (the
    parent waited for that). Once per count, stopped after 120 s. 65,536 is not
    run: on this 2-core machine XLA's CPU client dies creating its threads
    (`pthread_create() failed`) after about 3 minutes.

Peak memory is the largest resident set of the process and its workers.
"""

import argparse
import json
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parent.parent
MODEL = ROOT / "tests" / "llama_model.py"
COUNTS = (16, 4096, 16384, 65536)
OLD_COUNTS = (4096, 16384)
OLD_TIMEOUT = 120

# Runs a command and prints its wall time and the peak resident set of its
# process tree (the children it waited for, and theirs).
MEASURE = """
import json, resource, subprocess, sys, time
timeout = float(sys.argv[1])
start = time.perf_counter()
try:
    done = subprocess.run(sys.argv[2:], capture_output=True, text=True, timeout=timeout)
    found = {"code": done.returncode, "out": done.stdout, "err": done.stderr[-2000:]}
except subprocess.TimeoutExpired:
    found = {"code": None, "out": "", "err": f"stopped after {timeout:g} s"}
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "peak": peak, **found}))
"""

# The old worker's work for one count, on simulated devices.
OLD = """
import sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
import equinox as eqx
import runpy
import eqshard
from eqshard._plan import make_plan
from eqshard._report import leaf_rows
model = eqx.filter_eval_shape(runpy.run_path(sys.argv[2])["build"])
planned = make_plan(model, eqshard.load(sys.argv[3]), devices=jax.devices()[: int(sys.argv[1])])
rows = leaf_rows(planned.plan)
print(sum(row.bytes_per_device for row in rows))
"""


def measure(command: list[str], timeout: float = 600) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(timeout), *command],
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(done.stdout)
    if found["code"] not in (0, 1, None):
        raise SystemExit(f"{' '.join(command)} failed:\n{found['err']}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip the old way")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    args = parser.parse_args()
    quick = args.quick
    spec = runpy.run_path(str(MODEL))["LLAMA_SPEC"]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "llama.eqshard.json"
        path.write_text(json.dumps(spec))
        now: dict[int, dict] = {}
        for n in COUNTS:
            command = [sys.executable, "-m", "eqshard", "check", str(path)]
            command += ["--model", f"{MODEL}:build", "--devices", str(n), "--format", "json"]
            runs = [measure(command) for _ in range(3)]
            best = min(runs, key=lambda run: run["seconds"])
            (check,) = json.loads(best["out"])["checks"]
            now[n] = {**best, "bytes": check["bytes_per_device"], "ok": check["ok"]}
        old: dict[int, dict] = {}
        if not quick:
            for n in OLD_COUNTS:
                command = [sys.executable, "-c", OLD, str(n), str(MODEL), str(path)]
                found = measure(command, OLD_TIMEOUT)
                bytes_ = int(found["out"].split()[-1]) if found["code"] == 0 else None
                old[n] = {**found, "bytes": bytes_}
    print("eqshard check, Llama-3-8B-shaped model, without --step (one process each)\n")
    print(
        "| devices | now: seconds | now: peak memory | old way: seconds | old: peak | old / now |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for n in COUNTS:
        a = now[n]
        b = old.get(n)
        if b is None:
            then = "not run | - | -"
        elif b["code"] is None:  # stopped
            then = f"> {OLD_TIMEOUT} (stopped) | {b['peak'] / 2**20:.0f} MB | > {OLD_TIMEOUT / a['seconds']:.0f}x"
        else:
            assert b["bytes"] == a["bytes"], (n, b["bytes"], a["bytes"])  # the same layouts
            then = f"{b['seconds']:.1f} | {b['peak'] / 2**20:.0f} MB | {b['seconds'] / a['seconds']:.1f}x"
        print(f"| {n:,} | {a['seconds']:.2f} | {a['peak'] / 2**20:.0f} MB | {then} |")
    bytes_text = ", ".join(f"{n:,}: {now[n]['bytes']:,} B" for n in COUNTS)
    print(f"\nbytes per device ({bytes_text}); ok: {[now[n]['ok'] for n in COUNTS]}")
    if args.json:
        keep = ("seconds", "peak", "code", "bytes", "ok")
        results = {
            "now": {n: {k: run[k] for k in keep if k in run} for n, run in now.items()},
            "old": {n: {k: run[k] for k in keep if k in run} for n, run in old.items()},
            "old_timeout": OLD_TIMEOUT,
            "old_counts": list(OLD_COUNTS) if not quick else [],
        }
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
