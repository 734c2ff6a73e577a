"""Runs the benchmarks and writes their tables into the documentation.

Run: `python benchmarks/report.py [--only NAME,...] [--render]`.

Every table of a benchmark's numbers in `docs/` sits between two markers,
`<!-- report:NAME -->` and `<!-- /report -->`. For each run named here, this
script runs the benchmark's exact command with `--json`, keeps what it wrote in
`benchmarks/results/RUN.json` together with the run's facts (the command, the
machine, the versions, the date, the wall time), and replaces each of its blocks
with a line naming that run and the table made from its numbers. Nothing in a
block is written by hand; the prose around the blocks must hold for any run.

- `--only bench_apply,bench_jit` runs those runs alone; the other blocks keep
  their numbers.
- `--render` runs nothing: it rewrites every block from `benchmarks/results/`.

The runs use arguments that finish in minutes on a shared 2-core machine; each
block's header says which were used.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from eqshard._search._ranked import out_of_memory  # the words `eqshard suggest` uses

ROOT = Path(__file__).parent.parent
RESULTS = Path(__file__).parent / "results"
MARKER = re.compile(
    r"^<!-- report:(?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- /report -->$", re.M | re.S
)
OPENING = re.compile(r"<!-- report:([^ ]*) -->")
CLOSING = "<!-- /report -->"
PACKAGES = ("jax", "jaxlib", "equinox", "libtpu")

Found = dict[str, Any]


class Block(NamedTuple):
    """A block of a page, made from a run's numbers."""

    page: str  # relative to the repository's root
    render: Callable[[Found], str]


class Run(NamedTuple):
    """One run of one benchmark, and the blocks its numbers fill."""

    name: str
    argv: tuple[str, ...]  # after `python`
    env: dict[str, str]
    blocks: dict[str, Block]

    def command(self) -> str:
        """The command as a reader types it, from the repository's root."""
        assignments = [f"{key}={value}" for key, value in self.env.items()]
        return " ".join([*assignments, "python", *map(shlex.quote, self.argv)])


# ---------------------------------------------------------------------------
# Numbers as text


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.2f} s"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us" if seconds < 1e-3 else _ms(seconds)


def _x(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.3g}x"


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MB"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# The tables, one renderer per block


def apply_table(found: Found) -> str:
    rows = []
    for name, title in (("a", "(a) 1,000 `Linear(8, 8)`"), ("b", "(b) 100 `Linear(480, 512)`")):
        r = found[name]
        rows.append(
            [
                f"{title}: {r['leaves']:,} leaves, {r['megabytes']:.1f} MB",
                _ms(r["floor"]),
                _ms(r["host_path"]),
                _ms(r["apply"]),
                _x(r["apply"] / r["floor"]),
                _x(r["apply"] / r["host_path"]),
                _ms(r["plan"]),
                "not installed" if r["einshard"] is None else _x(r["einshard"] / r["apply"]),
            ]
        )
    header = ["model", "floor", "host path", "`apply`", "`apply` / floor", "`apply` / host path"]
    header += ["of which `plan`", "einshard / `apply`"]
    c, d = found["c"], found["d"]
    extra = _table(
        ["what", "baseline", "eqshard", "ratio"],
        [
            [
                f"(c) `plan` on model (a), {c['leaves']:,} leaves, from 21 path rules "
                "(19 match nothing), against the same layouts as a spec tree",
                _ms(c["spec_tree"]),
                _ms(c["rules"]),
                _x(c["rules"] / c["spec_tree"]),
            ],
            [
                f"(d) Adam's state of model (a), {d['leaves']:,} leaves, "
                "`apply(opt_state, plan)` against the floor",
                _ms(d["floor"]),
                _ms(d["apply"]),
                _x(d["apply"] / d["floor"]),
            ],
        ],
    )
    return _table(header, rows) + "\n\n" + extra


def jit_table(found: Found) -> str:
    rows = []
    for name, r in found.items():
        s = r["seconds"]
        traces = ", ".join(str(r["traces"][label]) for label in s)
        first = r.get("first_calls")  # absent from runs before the column
        unplaced = placed = "unknown"
        if first is not None:
            f, p = first["unplaced"], first["placed"]
            unplaced = f"{f['seconds']:.2f} s, {f['traces']} trace, {f['compiles']} compile"
            placed = f"{p['seconds']:.2f} s ({_x(f['seconds'] / p['seconds'])})"
        rows.append(
            [
                f"{name}, {r['arrays']} arrays",
                _us(s["floor"]),
                _us(s["old pattern"]),
                _us(s["eqshard.jit"]),
                _x(s["eqshard.jit"] / s["floor"]),
                traces,
                unplaced,
                placed,
            ]
        )
    header = ["model", "floor", "old pattern", "`eqshard.jit`", "`eqshard.jit` / floor"]
    firsts = ["first 3 calls, unplaced", "placed by `apply` first (unplaced / placed)"]
    return _table([*header, "traces", *firsts], rows)


def _rules_case(name: str) -> str:
    """`5,000 x **.nameN.**` with its pattern as code; `none` for no extra rule."""
    if name == "0 extra rules":
        return "none"
    count, times, form = name.partition(" x ")
    return f"{count} x `{form}`" if times else name


def rules_table(found: Found) -> str:
    plan, index = found["plan"], found["index"]
    base = next(iter(plan.values()))
    base_index = next(iter(index.values()))
    rows = []
    for name, r in plan.items():
        later, first = r["later_calls"], r["first_call"]
        rows.append(
            [
                _rules_case(name),
                _x(index[name]["first"] / base_index["first"]),
                "stopped" if first is None else _ms(first),
                "-" if later is None else _ms(later),
                "-" if later is None else _x(later / base["later_calls"]),
            ]
        )
    header = ["rules that cannot match", "look-ups / none", "`plan`, first call"]
    header += ["`plan`, later calls", "later / none"]
    intro = (
        f"{found['leaves']:,} leaves. Look-ups: `PathIndex.first()` on every leaf's path, "
        "against the same with no extra rule."
    )
    return intro + "\n\n" + _table(header, rows)


def check_table(found: Found) -> str:
    rows = []
    timeout = found["old_timeout"]
    for n, now in found["now"].items():
        old = found["old"].get(n)
        if old is None:
            then = ["not run", "-"]
        elif old["code"] is None:
            then = [f"stopped after {timeout} s", _mb(old["peak"])]
        else:
            then = [f"{old['seconds']:.1f} s", _mb(old["peak"])]
        rows.append([f"{int(n):,}", f"{now['seconds']:.2f} s", _mb(now["peak"]), *then])
    header = ["devices", "`check`", "peak memory", "old way", "its peak memory"]
    return _table(header, rows)


def restore_table(found: Found) -> str:
    cases = found["cases"]
    floor = cases["read bytes"]["seconds"]
    rows = []
    for name, r in cases.items():
        rows.append(
            [
                "read the bytes once" if name == "read bytes" else f"`{name}`",
                f"{r['seconds']:.3f} s",
                f"{found['bytes'] / 1e9 / r['seconds']:.2f}",
                _x(r["seconds"] / floor),
                _mb(r["rss_growth"]),
                _x(r["rss_growth"] / found["leaf_bytes"]),
            ]
        )
    header = ["case", "time", "GB/s", "/ reading the bytes", "host memory over the run"]
    caches = "dropped before each case" if found["drop_caches"] else "warm (not dropped)"
    intro = (
        f"A {found['bytes'] / 1e9:.2f} GB file of {found['leaves']} leaves, best of "
        f"{found['repeat']}, each case in a fresh process; the page cache {caches}; "
        f"platform {cases['eqshard.restore']['platform']}."
    )
    return intro + "\n\n" + _table([*header, "/ largest leaf"], rows)


def init_table(found: Found) -> str:
    model = found["model_bytes"]
    rows = []
    for name, r in found["cases"].items():
        rows.append(
            [f"`{name}`", f"{r['seconds']:.2f} s", _mb(r["growth"]), _x(r["growth"] / model)]
        )
    w, depth = found["width"], found["depth"]
    intro = (
        f"`eqx.nn.MLP({w}, {w}, {w}, depth={depth})`, {model / 1e6:.0f} MB, on "
        f"{found['platform']}; `MALLOC_ARENA_MAX={found['malloc_arena_max']}`."
    )
    return intro + "\n\n" + _table(["case", "time", "peak growth", "/ model's bytes"], rows)


def expression_table(found: Found) -> str:
    rows = [
        ["`parse`, cold (cache cleared)", _us(found["parse_cold"]), "1.00x"],
        [
            "`parse`, cached",
            _us(found["parse_cached"]),
            _x(found["parse_cold"] / found["parse_cached"]),
        ],
        ["`sharding`, cold (caches cleared)", _us(found["sharding_cold"]), "1.00x"],
        [
            "`sharding`, cached",
            _us(found["sharding_cached"]),
            _x(found["sharding_cold"] / found["sharding_cached"]),
        ],
    ]
    if found["einshard"] is not None:
        rows.append(["`einshard.make_sharding`", _us(found["einshard"]), "-"])
    intro = f"{found['expressions']} expressions."
    if found["einshard"] is None:
        intro += " einshard is not installed in this environment (it needs Python 3.12)."
    return intro + "\n\n" + _table(["what", "per call", "cold / this"], rows)


def _refused(ranked: Found) -> tuple[int, int]:
    """Candidates the target's compiler refused for its memory, and other failures."""
    errors = [s["error"] for s in ranked["suggestions"] if s.get("error")]
    memory = sum(out_of_memory(e) is not None for e in errors)
    return memory, len(errors) - memory


def suggest_table(found: Found) -> str:
    rows = []
    for run in found["runs"].values():
        ranked = run["ranked"]
        memory, failed = _refused(ranked)
        compiled = f"{run['compiled']} of {len(ranked['suggestions'])}"
        if memory:
            compiled += f" (+{memory} the compiler ran out of HBM for)"
        if failed:
            compiled += f" (+{failed} failed)"
        limit = ranked["max_memory"]
        where = (
            f"{ranked['target']} (XLA:TPU)" if ranked["target"] else f"{ranked['devices']} devices"
        )
        search, full = run["search"], run["exhaustive"]
        looser = "; ".join(
            f"{t['search']:.1f} s, {t['compiled']} compiled, "
            f"{'same best' if t['same_best'] else '**another best**'}"
            for t in run.get("tolerances", [])
        )
        rows.append(
            [
                f"{run['title'].split(',')[0]}, {where}, within {_bytes(limit['bytes'])}",
                compiled,
                f"{search:.1f} s",
                looser or "-",
                f"{full:.1f} s ({run['exhaustive_compiled']} compiled)",
                _x(full / search),
                "yes" if run["same_best"] else "**no**",
                f"{run['kendall']:.2f} ({run['ranked_with']})",
                f"{run['overstated']:.1%}" if "overstated" in run else "-",
                f"{run['one_cost']:.1f} s" if run.get("one_cost") else "-",
            ]
        )
    others = {t["tolerance"] for run in found["runs"].values() for t in run.get("tolerances", [])}
    header = [
        "search",
        "compiled",
        "suggest",
        "suggest, tolerance " + ", ".join(map(str, sorted(others))),
        "exhaustive",
        "exhaustive / suggest",
        "same best",
        "rank agreement (Kendall's tau, candidates)",
        "estimates overstated the leaders by",
        "one cost of the best, in this process",
    ]
    workers = found["workers"] or "one per core"
    return f"Workers: {workers}.\n\n" + _table(header, rows)


def _seconds(t: float) -> str:
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if t >= size:
            return f"{t / size:.3g} {unit}"
    return f"{t:.3g} s"


def ranking(run_name: str) -> Callable[[Found], str]:
    """The ranking of one search, as a table: its figures are those `print(ranked)`
    shows, one row per candidate, in its order."""

    def render(found: Found) -> str:
        run = found["runs"][run_name]
        ranked = run["ranked"]
        limit = ranked["max_memory"]
        rows = []
        for number, s in enumerate(ranked["suggestions"], 1):
            mesh = " x ".join(f"{name}={size}" for name, size in s["mesh"])
            if s.get("error"):
                brief = out_of_memory(s["error"]) or "failed: " + s["error"].splitlines()[0]
                rows.append(["-", s["strategy"], mesh, "-", brief, "-", "-", "failed"])
                continue
            if s["figures"] != "compiled":  # ruled out before compiling: its estimates
                guess = s["estimated"]
                counted = s.get("proxy", guess)["communication"]  # XLA:CPU's, where it has one
                moved = "<br>".join(
                    f"~{'+'.join(c['axes']) or '-'} {_bytes(c['bytes'])}" for c in counted
                )
                fits = (
                    "unknown: not compiled"
                    if s["over"] is None
                    else f"no: its arguments alone {s['over']:.2f}x the limit"
                )
                seconds = "-" if guess["seconds"] is None else "~" + _seconds(guess["seconds"])
                held = f">= {_bytes(guess['arguments'])}"
                rows.append(["-", s["strategy"], mesh, held, fits, moved, seconds, s["figures"]])
                continue
            moved = "<br>".join(
                f"{'+'.join(c['axes']) or '-'} {_bytes(c['bytes'])}" for c in s["communication"]
            )
            fits = "yes" if s["fits"] else f"no: {s['over']:.2f}x the limit"
            estimate = _seconds(s["estimate"]["seconds"])
            rows.append(
                [
                    str(number),
                    s["strategy"],
                    mesh,
                    _bytes(s["peak"]),
                    fits,
                    moved,
                    estimate,
                    "compiled",
                ]
            )
        header = [
            "#",
            "strategy",
            "mesh",
            "peak / device",
            "fits",
            "moved / step",
            "estimate",
            "figures",
        ]
        where = f"{ranked['target']}, " if ranked["target"] else ""
        lines = [
            f"{len(ranked['suggestions'])} candidates on {where}{ranked['devices']} devices, "
            f"within {_bytes(limit['bytes'])} per device, compiled by {ranked['compiler']}. "
            f"The estimates are rooflines on {ranked['hardware']}, never measurements. "
            f"The search took {run['search']:.1f} s and compiled {run['compiled']} of them; "
            "a row not compiled shows its exact bytes held ('>='), the rest estimated ('~').",
            "",
            _table(header, rows),
        ]
        if ranked["dropped"]:
            lines += ["", "Dropped before compiling:", ""]
            lines += [f"- {d['name']}: {' '.join(d['reason'].split())}" for d in ranked["dropped"]]
        return "\n".join(lines)

    return render


RUNS = [
    Run("bench_apply", ("benchmarks/bench_apply.py",), {}, {
        "bench_apply": Block("docs/performance.md", apply_table),
    }),
    Run("bench_jit", ("benchmarks/bench_jit.py",), {}, {
        "bench_jit": Block("docs/performance.md", jit_table),
    }),
    Run("bench_rules", ("benchmarks/bench_rules.py",), {}, {
        "bench_rules": Block("docs/performance.md", rules_table),
    }),
    Run("bench_check", ("benchmarks/bench_check.py",), {}, {
        "bench_check": Block("docs/performance.md", check_table),
    }),
    Run("bench_restore", ("benchmarks/bench_restore.py", "--gb", "0.5"), {}, {
        "bench_restore": Block("docs/performance.md", restore_table),
    }),
    Run("bench_init", ("benchmarks/bench_init.py", "--depth", "8"), {"MALLOC_ARENA_MAX": "2"}, {
        "bench_init": Block("docs/performance.md", init_table),
    }),
    Run("bench_expression", ("benchmarks/bench_expression.py",), {}, {
        "bench_expression": Block("docs/performance.md", expression_table),
    }),
    Run("bench_suggest", ("benchmarks/bench_suggest.py", "--only", "gpt8,gpt64"), {}, {
        "bench_suggest": Block("docs/performance.md", suggest_table),
        "suggest-gpt8": Block("docs/suggest-and-diff.md", ranking("gpt8")),
    }),
    Run("bench_suggest_llama", ("benchmarks/bench_suggest.py", "--only", "llama"), {}, {
        "bench_suggest_llama": Block("docs/performance.md", suggest_table),
        "suggest-llama": Block("docs/suggest-and-diff.md", ranking("llama")),
    }),
    Run("bench_suggest_llama_v5e", ("benchmarks/bench_suggest.py", "--only", "llama_v5e"), {}, {
        "bench_suggest_llama_v5e": Block("docs/performance.md", suggest_table),
    }),
    # run by the newest JAX's Python: `PYTHON -m pip install -e '.[tpu]'`, then
    # `PYTHON benchmarks/report.py --only bench_suggest_llama_newest`
    Run("bench_suggest_llama_newest", ("benchmarks/bench_suggest.py", "--only", "llama"), {}, {
        "bench_suggest_llama_newest": Block("docs/performance.md", suggest_table),
    }),
]  # fmt: skip


# ---------------------------------------------------------------------------
# Running, and writing the pages


def machine() -> str:
    """The CPU's model and the cores this process may use."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return f"{model}, {cores} core{'s' * (cores != 1)}, {platform.system()}"


def versions() -> str:
    """Python's version and each package's that the numbers depend on."""
    found = [f"Python {platform.python_version()}"]
    for package in PACKAGES:
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


def execute(run: Run) -> Found:
    """Runs one benchmark, and returns its numbers with the facts of the run."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "found.json"
        argv = [sys.executable, *run.argv, "--json", str(path)]
        print(f"+ {run.command()}", flush=True)
        start = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, env={**os.environ, **run.env}, check=True)
        wall = time.perf_counter() - start
        numbers = json.loads(path.read_text())
    return {
        "run": {
            "command": run.command(),
            "machine": machine(),
            "versions": versions(),
            "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
            "wall_seconds": round(wall, 1),
        },
        "numbers": numbers,
    }


def header(facts: Found) -> str:
    """The line that heads a block: which run its numbers come from."""
    return (
        f"Run: `{facts['command']}` on {facts['machine']}; {facts['versions']}; "
        f"{facts['date']}; {facts['wall_seconds']:.0f} s in all."
    )


def blocks_of(text: str) -> list[str]:
    """The names of a page's report blocks, in order; `ValueError` where the markers
    are not well formed (one that does not close, one inside another, a stray
    closing marker, a name used twice)."""
    names: list[str] = []
    open_name: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        opening = OPENING.fullmatch(line.strip())
        if opening:
            if open_name is not None:
                raise ValueError(f"line {number}: report:{opening[1]} opens inside {open_name}")
            if not re.fullmatch(r"[\w-]+", opening[1]):
                raise ValueError(f"line {number}: {opening[1]!r} is not a block name")
            if opening[1] in names:
                raise ValueError(f"line {number}: report:{opening[1]} is used twice")
            open_name = str(opening[1])
            names.append(open_name)
        elif line.strip() == CLOSING:
            if open_name is None:
                raise ValueError(f"line {number}: {CLOSING} closes no block")
            open_name = None
    if open_name is not None:
        raise ValueError(f"report:{open_name} is not closed by {CLOSING}")
    return names


def write(page: Path, blocks: dict[str, str]) -> None:
    """Replaces the named blocks of a page."""
    text = page.read_text()
    present = blocks_of(text)
    missing = sorted(set(blocks) - set(present))
    if missing:
        raise SystemExit(f"{page}: no block for {', '.join(missing)}: add the markers first")

    def replace(found: re.Match[str]) -> str:
        name = found["name"]
        if name not in blocks:
            return found[0]
        return f"<!-- report:{name} -->\n{blocks[name].rstrip()}\n{CLOSING}"

    page.write_text(MARKER.sub(replace, text))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--only", help="the runs to run, by name: " + ", ".join(r.name for r in RUNS)
    )
    parser.add_argument("--render", action="store_true", help="run nothing; rewrite from results/")
    args = parser.parse_args()
    known = {run.name: run for run in RUNS}
    chosen = list(known) if args.only is None else args.only.split(",")
    unknown = [name for name in chosen if name not in known]
    if unknown:
        parser.error(f"no run named {', '.join(unknown)}; the runs: {', '.join(known)}")
    RESULTS.mkdir(exist_ok=True)
    if not args.render:
        for name in chosen:
            found = execute(known[name])
            (RESULTS / f"{name}.json").write_text(json.dumps(found, indent=1) + "\n")
    pages: dict[Path, dict[str, str]] = {}
    for run in RUNS:
        saved = RESULTS / f"{run.name}.json"
        if not saved.exists():
            print(f"no results for {run.name}: run `python benchmarks/report.py --only {run.name}`")
            continue
        found = json.loads(saved.read_text())
        for name, block in run.blocks.items():
            text = header(found["run"]) + "\n\n" + block.render(found["numbers"])
            pages.setdefault(ROOT / block.page, {})[name] = text
    for page, blocks in pages.items():
        write(page, blocks)
        print(f"wrote {len(blocks)} block{'s' * (len(blocks) != 1)} of {page.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
