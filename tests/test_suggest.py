"""`eqshard.suggest`'s ranking: candidates costed by compiling the user's step, in
worker processes, ranked by their estimate within a memory limit.

The candidates are made by hand here (the demo's spec files, small `Rules`); the
generator has its own tests. `tests/suggest_model.py` holds the models, importable
by name in the workers.
"""

import dataclasses
import importlib.util
import json
import time
from pathlib import Path

import equinox as eqx
import jax
import pytest
import suggest_model as models

import eqshard
import eqshard._search._candidates
import eqshard._search._pool as pool
from eqshard._fit import mesh_text
from eqshard._process._pickles import pickled
from eqshard._report import human_bytes
from eqshard._search._candidates import Candidate
from eqshard._search._policy import proxy_guess
from eqshard._search._ranked import Progress, Suggestion, communication, name_of, ranked
from eqshard._search._suggest import rank

TESTS = Path(__file__).parent
DEMO = TESTS.parent / "examples" / "specs" / "demo"
MODULE = TESTS / "suggest_model.py"
BUDGET = 640 * 1024  # rules data parallel out for the stacked GPT: it needs 1.3x that

# the demo's spec files, as the generator would name them, with the GPT's activations'
# names mapped onto each mesh (the example's model names them; the files do not)
STRATEGIES = {
    "data-parallel": ("data parallel", (("data", 8),)),
    "zero-1": ("zero-1", (("data", 8),)),
    "fsdp": ("fsdp", (("data", 8),)),
    "2d": ("data x tensor", (("data", 2), ("model", 4))),
}


def _abstract(build, optimizer, batch):
    model = eqx.filter_eval_shape(build)
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return model, jax.eval_shape(optimizer().init, params), eqx.filter_eval_shape(batch)


def _demo_candidate(name: str, repairs: tuple[str, ...] = ()) -> Candidate:
    strategy, mesh = STRATEGIES[name]
    rules = eqshard.load(DEMO / f"{name}.eqshard.json")
    axes = {axis for axis, _ in mesh}
    dims = {
        "batch": "data" if "data" in axes else None,
        "seq": None,
        "embed": None,
        "vocab": "model" if "model" in axes else None,
    }
    return Candidate(strategy, mesh, dataclasses.replace(rules, dims=dims), repairs)


FSDP_REPAIRS = ("pos.weight: replicated, as its dims do not divide by 8 (a made-up repair)",)
UNMAPPED = Candidate(  # its rules map none of the names the model's activations carry
    "data parallel (no dims)", (("data", 8),), eqshard.load(DEMO / "data-parallel.eqshard.json")
)


@pytest.fixture(scope="module")
def gpt():
    return _abstract(models.build, models.optimizer, models.batch)


@pytest.fixture(scope="module")
def gpt_ranked(gpt):
    candidates = [
        _demo_candidate(name, FSDP_REPAIRS if name == "fsdp" else ()) for name in STRATEGIES
    ]
    return rank([*candidates, UNMAPPED], models.step, *gpt, simulate=8, max_memory=BUDGET)


def _cost(s: Suggestion) -> eqshard.results.Cost:
    assert s.cost is not None, s.error
    return s.cost


def _peak(s: Suggestion) -> int:
    return _cost(s).memory.peak


@pytest.mark.slow  # ranks the GPT's candidates (the `gpt_ranked` fixture)
def test_the_limit_rules_data_parallel_out_and_the_rest_rank_by_estimate(gpt_ranked):
    ranked = gpt_ranked
    assert (ranked.limit, ranked.limit_from, ranked.devices) == (BUDGET, "max_memory", 8)
    assert ranked.compiler == "XLA:CPU, 8 simulated devices"
    by_strategy = {s.strategy: s for s in ranked}
    assert len(by_strategy) == len(ranked) == 5
    data_parallel = by_strategy["data parallel"]
    assert not data_parallel.fits
    assert data_parallel.over == pytest.approx(_peak(data_parallel) / BUDGET)
    assert data_parallel.over > 1
    costed = [s for s in ranked if s.cost is not None]
    for s in costed:
        assert s.fits == (_peak(s) <= BUDGET), s.name
    fitting = [s for s in costed if s.fits]
    over = [s for s in costed if not s.fits]
    assert fitting, "nothing fits the budget"
    assert list(ranked) == [*fitting, *over, by_strategy["data parallel (no dims)"]]
    assert [s.seconds for s in fitting] == sorted(s.seconds for s in fitting)
    assert [s.over for s in over] == sorted(s.over for s in over)
    assert ranked[0] is ranked.best is fitting[0]
    assert ranked.best.seconds == ranked.best.cost.estimate("h100").seconds


@pytest.mark.slow  # ranks the GPT's candidates (the `gpt_ranked` fixture)
def test_a_candidate_that_fails_to_compile_is_listed_with_its_error(gpt_ranked):
    failed = gpt_ranked[-1]
    assert failed.candidate is UNMAPPED
    assert failed.cost is None
    assert not failed.fits
    assert "`eqshard.constrain` cannot lay out (..., 'seq', 'embed')" in failed.error
    assert "names 'seq', which $.dims does not map" in failed.error
    assert gpt_ranked.dropped == (("data parallel (no dims) (data=8)", failed.error),)


@pytest.mark.slow  # ranks the GPT's candidates (the `gpt_ranked` fixture)
def test_the_table_is_plain_text_with_every_column(gpt_ranked):
    text = str(gpt_ranked)
    assert "\x1b" not in text
    lines = text.splitlines()
    assert lines[0].rstrip() == "eqshard suggest: 5 candidates on 8 devices"
    header = next(line for line in lines if "strategy" in line)
    for column in ("#", "mesh", "peak (XLA:CPU) / device (limit 640.0 KiB)", "fits"):
        assert column in header
    for column in ("communication / step", "estimate (H100)", "repairs", "figures"):
        assert column in header
    rows = [line for line in lines if line.startswith("│ ") and line[2] != " "]
    names = [row.split("│")[2].strip() for row in rows]
    assert names == [s.strategy for s in gpt_ranked]
    for row, s in zip(rows, gpt_ranked):
        cells = [cell.strip() for cell in row.split("│")[1:-1]]
        repairs = str(len(s.candidate.repairs))
        if s.cost is None:
            assert cells == ["-", s.strategy, "data=8", "-", "failed", "-", "-", repairs, "failed"]
            continue
        moved = communication(s.cost)
        first = next(iter(moved))
        assert cells[2] == " x ".join(f"{axis}={size}" for axis, size in s.mesh)
        assert cells[3] == human_bytes(_peak(s))
        assert cells[5] == f"{first} {human_bytes(moved[first])}"
        assert cells[7] == repairs
        assert cells[8] == "compiled"  # hand-made candidates have no estimate: all compiled
        if s.fits:
            assert cells[4] == "yes"
        else:
            need = f"no: needs {human_bytes(_peak(s))} of 640.0 KiB: {_peak(s) / BUDGET:.2f}x"
            assert cells[4] == need
    notes = "\n".join(line.rstrip() for line in lines)
    assert "max memory: 640.0 KiB (given) per device, by XLA:CPU's peak" in notes
    assert f"; the best: {gpt_ranked.best.name}" in notes
    assert "dropped: data parallel (no dims) (data=8): `eqshard.constrain` cannot lay" in notes


@pytest.mark.slow  # a suggest ranking, compiles in worker processes
def test_the_best_rules_written_load_back_to_the_same_layouts_and_check_agrees(
    gpt, gpt_ranked, tmp_path, run_cli
):
    best = gpt_ranked.best
    path = tmp_path / "best.eqshard.json"
    eqshard.dump(best.rules, path)
    loaded = eqshard.load(path)
    comment = str(loaded.comment)
    assert comment.startswith(best.candidate.rules.comment)
    assert f"Suggested by eqshard suggest: {best.name} on 8 devices" in comment
    assert [r.comment for r in loaded.rules] == [r.comment for r in best.candidate.rules.rules]
    model = gpt[0]
    written = eqshard.plan(model, loaded, devices=8)
    costed = eqshard.plan(model, best.candidate.rules, devices=8)
    assert written.mesh == costed.mesh
    same = jax.tree_util.tree_leaves(written.partition_specs)
    assert same == jax.tree_util.tree_leaves(costed.partition_specs)
    same = jax.tree_util.tree_leaves(written.optimizer.partition_specs)
    assert same == jax.tree_util.tree_leaves(costed.optimizer.partition_specs)

    example = TESTS.parent / "examples" / "gpt_stacked.py"
    done = run_cli(
        *("check", path, "--device-counts", 8, "--format", "json"),
        *("--model", f"{example}:build", "--step", f"{example}:step"),
        *("--optimizer", f"{example}:optimizer", "--make-batch", f"{example}:batch"),
    )
    assert done.code == 0, done.err
    found = json.loads(done.out)["checks"][0]["cost"]
    assert found["peak"] == best.cost.memory.peak
    assert found["optimizer"] == best.cost.memory.optimizer
    by_axes = {(e["kind"], tuple(e["axes"])): e["bytes"] for e in found["communication"]}
    assert by_axes == best.cost.bytes_by_axes()


def _mlp_candidates() -> list[Candidate]:
    megatron = eqshard.load(
        {
            "eqshard": 1,
            "mesh": [["model", "*"]],
            "batch": "... -> * ...",
            "rules": [
                {"path": "layers.0.weight", "expr": "o i -> o* i", "comment": "column"},
                {"path": "layers.0.bias", "expr": "o -> o*"},
                {"path": "layers.1.weight", "expr": "o i -> o i*", "comment": "row"},
            ],
        }
    )
    data = [["data", "*"]]
    return [
        Candidate("data parallel", (("data", 8),), eqshard.load({"eqshard": 1, "mesh": data})),
        Candidate(
            "fsdp", (("data", 8),), eqshard.load({"eqshard": 1, "mesh": data, "default": "fsdp"})
        ),
        Candidate("megatron", (("model", 8),), megatron),
    ]


@pytest.mark.slow  # a suggest ranking, compiles in worker processes
def test_workers_and_this_process_give_the_same_costs():
    mlp = _abstract(models.mlp_build, models.mlp_optimizer, models.mlp_batch)
    candidates = _mlp_candidates()
    here = rank(candidates, models.mlp_step, *mlp, devices=8, workers=0)
    there = rank(candidates, models.mlp_step, *mlp, simulate=8, workers=2, max_memory="75GiB")
    assert (there.limit, here.limit) == (75 * 2**30, None)
    assert [s.name for s in here] == [s.name for s in there]
    for a, b in zip(here, there):
        x, y = _cost(a), _cost(b)
        assert x.memory == y.memory, a.name
        assert x.bytes_by_axes() == y.bytes_by_axes(), a.name
        assert (x.flops, x.bytes_accessed) == (y.flops, y.bytes_accessed)
        assert (a.fits, b.fits) == (True, True)
    text = str(here)
    assert text.count("yes (no limit)") == 3
    assert "no memory limit: XLA:CPU's peak is XLA:CPU's, not an accelerator's, so every" in text
    assert "3 of 3 fit; the best:" in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"simulate": 8, "target": "v5e:2x4"}, r"`simulate=8` and `target='v5e:2x4'` are both"),
        ({"devices": 8, "simulate": 8}, r"`devices=8` \(this process's devices\) and `simulate"),
        ({"devices": 8, "workers": 2}, r"worker processes cannot hold them; pass `simulate=8`"),
        ({}, r"give `simulate=` \(how many simulated devices"),
        ({"simulate": 8, "max_memory": "lots"}, r"'lots' is not a memory size: write a byte"),
        ({"simulate": 8, "workers": -1}, r"`workers`"),
        ({"devices": 8, "workers": 0, "tolerance": 1.0}, r"`tolerance` is a fraction from 0"),
        ({"devices": 8, "workers": 0, "tolerance": -0.1}, r"to below 1, such as 0.05, not -0.1"),
    ],
)
def test_rank_refuses_what_it_cannot_do(kwargs, message):
    with pytest.raises(eqshard.EqshardError, match=message):
        rank(_mlp_candidates(), models.mlp_step, object(), **kwargs)


def test_a_spec_file_keeps_its_comments_through_load_and_dump(tmp_path):
    document = {
        "eqshard": 1,
        "comment": "the file's",
        "rules": [{"path": "a", "expr": "x -> x*", "comment": "the rule's"}],
        "optimizer": {"comment": "the section's", "default": "fsdp"},
    }
    rules = eqshard.load(document)
    eqshard.dump(rules, tmp_path / "a.json")
    again = eqshard.load(tmp_path / "a.json")
    for each in (rules, again):
        assert each.optimizer is not None
        assert (each.comment, each.optimizer.comment) == ("the file's", "the section's")
    assert again.rules[0].comment == "the rule's"


# --------------------------------------------------------------------------- #
# The command line, with the generator replaced by the hand-made candidates.
# --------------------------------------------------------------------------- #


def _generate(chosen):
    def candidates(step, model, *args, devices, strategies=None):
        assert (devices, strategies) == (8, None)
        return chosen, [("fsdp x tensor (data=1 x model=8)", "made up: it does not divide")]

    return candidates


def _suggest(run_cli, *extra, step="mlp_step"):
    return run_cli(
        *("suggest", "--simulate", 8, "--model", f"{MODULE}:mlp_build"),
        *("--step", f"{MODULE}:{step}", "--optimizer", f"{MODULE}:mlp_optimizer"),
        *("--make-batch", f"{MODULE}:mlp_batch"),
        *extra,
    )


@pytest.mark.slow  # a suggest ranking, compiles in worker processes
def test_cli_writes_the_best_and_check_on_it_reports_the_ranking_s_figures(
    run_cli, monkeypatch, tmp_path
):
    monkeypatch.setattr(
        eqshard._search._candidates, "candidates", _generate(_mlp_candidates()), False
    )
    path = tmp_path / "best.eqshard.json"
    done = _suggest(
        run_cli, "--write", path, "--format", "json", "--max-memory", "16GiB", "--exhaustive"
    )
    assert done.code == 0, done.err
    ranked = json.loads(done.out)
    assert ranked["exhaustive"] is True
    assert {s["figures"] for s in ranked["suggestions"]} == {"compiled"}
    assert ranked["written"] == str(path)
    assert ranked["max_memory"] == {"bytes": 16 * 2**30, "from": "max_memory"}
    assert ranked["dropped"] == [
        {"name": "fsdp x tensor (data=1 x model=8)", "reason": "made up: it does not divide"}
    ]
    best = ranked["suggestions"][ranked["best"]]
    loaded = eqshard.load(path)
    assert loaded.to_json() == eqshard.load(best["rules"]).to_json()
    chosen = next(c for c in _mlp_candidates() if c.strategy == best["strategy"])
    model = eqx.filter_eval_shape(models.mlp_build)
    written = eqshard.plan(model, loaded, devices=8).partition_specs
    costed = eqshard.plan(model, chosen.rules, devices=8).partition_specs
    assert jax.tree_util.tree_leaves(written) == jax.tree_util.tree_leaves(costed)

    check = run_cli(
        *(
            "check",
            path,
            "--device-counts",
            8,
            "--format",
            "json",
            "--model",
            f"{MODULE}:mlp_build",
        ),
        *("--step", f"{MODULE}:mlp_step", "--optimizer", f"{MODULE}:mlp_optimizer"),
        *("--make-batch", f"{MODULE}:mlp_batch"),
    )
    assert check.code == 0, check.err
    found = json.loads(check.out)["checks"][0]["cost"]
    assert found["peak"] == best["peak"]
    moved: dict[str, int] = {}
    for entry in found["communication"]:
        axes = "+".join(entry["axes"]) or "-"
        moved[axes] = moved.get(axes, 0) + entry["bytes"]
    assert moved == {"+".join(e["axes"]) or "-": e["bytes"] for e in best["communication"]}


def test_cli_exits_1_when_nothing_fits_and_writes_nothing(run_cli, monkeypatch, tmp_path):
    monkeypatch.setattr(
        eqshard._search._candidates, "candidates", _generate(_mlp_candidates()[:1]), False
    )
    path = tmp_path / "best.eqshard.json"
    done = _suggest(run_cli, "--max-memory", "1kB", "--write", path, "--workers", 1)
    assert done.code == 1, done.err
    assert "no: needs" in done.out
    assert "nothing fits" in done.out
    assert f"nothing fits: {path} not written" in done.out
    assert not path.exists()


@pytest.mark.slow  # a suggest run in a worker process
def test_cli_exits_2_when_no_candidate_compiles(run_cli, monkeypatch):
    monkeypatch.setattr(
        eqshard._search._candidates, "candidates", _generate(_mlp_candidates()[:1]), False
    )
    done = _suggest(run_cli, "--workers", 1, step="failing_step")
    assert done.code == 2
    assert (
        "eqshard suggest: error: no candidate could be compiled; the first one's error:" in done.err
    )
    assert "it raised ValueError: no step here" in done.err


def test_cli_exits_2_when_every_candidate_is_dropped(run_cli, monkeypatch):
    monkeypatch.setattr(eqshard._search._candidates, "candidates", _generate([]), False)
    done = _suggest(run_cli, "--workers", 1)
    assert done.code == 2
    assert done.err.strip().splitlines() == [
        "eqshard suggest: building the model and the candidates on 8 devices",  # progress
        "eqshard suggest: error: every candidate was dropped; the first: made up: it does "
        "not divide",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--model", "nope:build", "--step", "nope:step", "--make-batch", "nope:batch"),
            "eqshard suggest: error: --model 'nope:build': cannot import 'nope'",
        ),
        (
            ("--model", "m:b", "--step", "m:s", "--make-batch", "m:b", "--max-memory", "lots"),
            "argument --max-memory: 'lots' is not a memory size: write a byte count",
        ),
        (
            ("--model", "m:b", "--step", "m:s", "--make-batch", "m:b", "--target", "v5e:2x4"),
            "argument --target: not allowed with argument --simulate",
        ),
        (("--model", "m:b", "--step", "m:s"), "--step needs --make-batch MODULE:CALLABLE"),
        (
            (
                *("--model", f"{MODULE}:mlp_build", "--step", f"{MODULE}:mlp_step"),
                *("--optimizer", f"{MODULE}:mlp_optimizer", "--make-batch", f"{MODULE}:mlp_batch"),
                *("--strategies", "fsdp,fsdp2"),
            ),
            "'fsdp2' is no strategy; the strategies are 'data parallel', 'fsdp', 'zero-1'",
        ),
        (
            ("--model", "m:b", "--step", "m:s", "--make-batch", "m:b", "--tolerance", "5%"),
            "argument --tolerance: '5%' is not a fraction from 0 to below 1, such as 0.05",
        ),
    ],
)
def test_cli_bad_input_exits_2_with_the_message(run_cli, args, message):
    done = run_cli("suggest", "--simulate", 8, *args)
    assert done.code == 2
    assert message in done.err
    assert "Traceback" not in done.err


@pytest.mark.slow  # ranks the GPT's candidates (the `gpt_ranked` fixture)
def test_suggest_beats_the_demo_strategies_within_the_budget(gpt, gpt_ranked, tmp_path):
    from eqshard.testing import assert_equivalent

    ranked = eqshard.suggest(*gpt, step=models.step, simulate=8, max_memory=BUDGET)
    best = ranked.best
    assert best is not None
    assert best.fits
    assert best.seconds <= gpt_ranked.best.seconds
    path = tmp_path / "best.eqshard.json"
    eqshard.dump(best.rules, path)
    example = TESTS.parent / "examples" / "gpt_stacked.py"
    assert_equivalent(
        f"{example}:build",
        path,
        f"{example}:loss",
        f"{example}:batch",
        device_counts=(8,),
        optimizer=f"{example}:optimizer",
    )


def test_a_worker_that_dies_fails_its_candidates_and_the_ranking_goes_on():
    mlp = _abstract(models.mlp_build, models.mlp_optimizer, models.mlp_batch)
    ranked = rank(_mlp_candidates()[:2], models.dying_step, *mlp, simulate=8, workers=1)
    assert [s.cost for s in ranked] == [None, None]
    for s in ranked:  # each in a worker of its own: the first's died with it
        assert f"costing {s.name} on 8 devices: its process ended (exit code 3)" in str(s.error)
        # its stderr was kept from this process's, and its end says why it died
        assert "the last it wrote on stderr:\n" in str(s.error)
        assert "F0000 the compiler's last words\n" in str(s.error)
    assert ranked.best is None
    assert "nothing fits" in str(ranked)


@pytest.mark.slow  # compiles for a TPU slice, in a worker process
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler comes with libtpu (eqshard[tpu])",
)
def test_on_a_tpu_slice_the_limit_is_the_chip_s_hbm():
    mlp = _abstract(models.mlp_build, models.mlp_optimizer, models.mlp_batch)
    ranked = rank(
        _mlp_candidates()[:2], models.mlp_step, *mlp, target="v5e:2x4", workers=1, exhaustive=True
    )
    assert (ranked.limit, ranked.limit_from, ranked.devices) == (16 << 30, "the chip's HBM", 8)
    assert ranked.compiler.startswith("XLA:TPU (libtpu ")
    assert ranked.hardware == "Google Cloud TPU v5e"
    for s in ranked:
        assert _cost(s).target == "v5e:2x4"
        assert s.fits
        assert s.seconds == _cost(s).estimate("tpu-v5e").seconds
    text = str(ranked)
    assert "eqshard suggest: 2 candidates on v5e:2x4 (8 devices)" in text
    assert "peak / device (limit 16.0 GiB)" in text
    assert "estimate (Google Cloud TPU v5e)" in text
    assert "max memory: the chip's HBM, 16.0 GiB per device" in [
        line.rstrip() for line in text.splitlines()
    ]


def test_a_candidate_the_compiler_refuses_for_its_memory_says_so():
    error = (
        "`eqshard.cost` cannot trace and compile the step: it raised JaxRuntimeError: "
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (154.09G) exceeds available HBM (95.74G)."
    )
    found = ranked([_demo_candidate("fsdp")], [error], 8, None, None, None)
    assert found.best is None
    assert found[0].error == error
    assert "no: the compiler ran out of HBM: HLO temporaries need 154.09G of 95.74G" in str(found)


@pytest.mark.slow  # ranks the GPT's candidates (the `gpt_ranked` fixture)
def test_zero1_is_ranked_by_the_program_that_trains(gpt, gpt_ranked):
    """The stacked GPT's step names no plan; under ZeRO-1 the program that trains
    (`eqshard.jit`'s) gathers every updated parameter whose moments are split:
    its all-gathers over 'data' move exactly those parameters' bytes."""
    zero1 = next(s for s in gpt_ranked if s.strategy == "zero-1")
    model = gpt[0]
    p = eqshard.plan(model, zero1.candidate.rules, devices=8)
    params = jax.tree_util.tree_leaves(model)  # in the order of the plan's leaves
    split = sum(
        x.size * x.dtype.itemsize
        for x, s in zip(params, p.optimizer.flat_shardings, strict=True)
        if s is not None and not s.is_fully_replicated
    )
    gathered = _cost(zero1).bytes_by_axes().get(("all-gather", ("data",)), 0)
    assert split > 0
    assert gathered == split
    data_parallel = next(s for s in gpt_ranked if s.strategy == "data parallel")
    assert ("all-gather", ("data",)) not in _cost(data_parallel).bytes_by_axes()


# --------------------------------------------------------------------------- #
# `--write` checked first, and `--targets`: the best on each slice.
# --------------------------------------------------------------------------- #


def _never_generate(step, model, *args, devices):
    raise AssertionError("candidates were generated before the options were checked")


@pytest.mark.parametrize("where", ["folder", "missing folder", "empty"])
def test_cli_refuses_a_bad_write_target_before_compiling(run_cli, monkeypatch, tmp_path, where):
    monkeypatch.setattr(eqshard._search._candidates, "candidates", _never_generate, False)
    path = {
        "folder": str(tmp_path),
        "missing folder": str(tmp_path / "nowhere" / "best.eqshard.json"),
        "empty": "",
    }[where]
    start = time.monotonic()
    done = _suggest(run_cli, "--write", path)
    assert time.monotonic() - start < 10  # a compile takes longer; nothing was compiled
    assert done.code == 2, done.err
    assert f"eqshard suggest: error: --write {path!r}: not written: " in done.err
    assert "--write names the spec file to write, such as best.eqshard.json" in done.err
    assert "Traceback" not in done.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--targets", "v5e:2x2", "--simulate", 8), "argument --simulate: not allowed with"),
        (("--targets", "v5e:2x2", "--target", "v5e:2x4"), "not allowed with argument --targets"),
        (("--targets", "v5e:2x2,,v5e:2x4"), "'v5e:2x2,,v5e:2x4' names an empty slice"),
        (("--targets", "v5e:2x2,v5e:2x2"), "'v5e:2x2,v5e:2x2' names v5e:2x2 twice"),
        (("--targets", "v5e:2x2", "--write", "best.json"), "--write writes one slice's best"),
    ],
)
def test_cli_targets_refuses_what_it_cannot_do(run_cli, monkeypatch, args, message):
    monkeypatch.setattr(eqshard._search._candidates, "candidates", _never_generate, False)
    done = run_cli(
        *("suggest", "--model", f"{MODULE}:mlp_build", "--step", f"{MODULE}:mlp_step"),
        *("--optimizer", f"{MODULE}:mlp_optimizer", "--make-batch", f"{MODULE}:mlp_batch"),
        *args,
    )
    assert done.code == 2, done.err
    assert message in done.err


def test_suggest_targets_refuses_bad_names_before_compiling():
    with pytest.raises(eqshard.EqshardError, match=r"names v5e:2x2 twice"):
        eqshard.targets.suggest_targets(object(), step=models.mlp_step, targets="v5e:2x2,v5e:2x2")
    with pytest.raises(eqshard.EqshardError, match=r"`target='a100:8'`: eqshard describes"):
        eqshard.targets.suggest_targets(
            object(), step=models.mlp_step, targets=["v5e:2x2", "a100:8"]
        )


def _sized(step, model, *args, devices, strategies=None):
    """The MLP's hand-made candidates, on `devices`."""
    chosen = [
        dataclasses.replace(c, mesh=tuple((axis, devices) for axis, _ in c.mesh))
        for c in _mlp_candidates()
    ]
    return chosen, []


SLICES = ("v5e:2x2", "v5e:2x4")


@pytest.mark.slow  # compiles for two TPU slices, in worker processes
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler comes with libtpu (eqshard[tpu])",
)
def test_cli_targets_gives_suggest_s_best_per_slice_and_says_where_nothing_fits(
    run_cli, monkeypatch
):
    monkeypatch.setattr(eqshard._search._candidates, "candidates", _sized, False)
    mlp = _abstract(models.mlp_build, models.mlp_optimizer, models.mlp_batch)
    done = run_cli(
        *("suggest", "--model", f"{MODULE}:mlp_build", "--step", f"{MODULE}:mlp_step"),
        *("--optimizer", f"{MODULE}:mlp_optimizer", "--make-batch", f"{MODULE}:mlp_batch"),
        *("--targets", ",".join(SLICES), "--workers", 1, "--exhaustive"),
    )
    assert done.code == 0, done.err
    lines = done.out.splitlines()
    assert "eqshard suggest: the best spec on each of 2 targets" in lines[0]
    progress = done.err.splitlines()  # each slice's compiles, as lines (not a terminal)
    assert (
        progress[0]
        == f"eqshard suggest: building the model and the candidates for {', '.join(SLICES)}"
    )
    for target, n in zip(SLICES, (4, 8)):
        assert f"eqshard suggest: compiled all 3 candidates on {target} ({n} devices)" in progress
    for target in SLICES:
        best = eqshard.suggest(
            *mlp, step=models.mlp_step, target=target, workers=1, exhaustive=True
        ).best
        assert best is not None
        row = next(line for line in lines if f" {target} " in line)
        assert f" {best.strategy} " in row, row
        assert "3 of 3" in row, row

    nothing = run_cli(
        *("suggest", "--model", f"{MODULE}:mlp_build", "--step", f"{MODULE}:mlp_step"),
        *("--optimizer", f"{MODULE}:mlp_optimizer", "--make-batch", f"{MODULE}:mlp_batch"),
        *("--targets", SLICES[0], "--workers", 1, "--max-memory", "1kB"),
    )
    assert nothing.code == 1, nothing.err
    assert "nothing fits" in nothing.out
    assert "0 of 3: the closest," in nothing.out
    found = eqshard.targets.suggest_targets(
        *mlp, step=models.mlp_step, targets=SLICES[:1], max_memory="1kB", workers=1
    )
    (row,) = found
    assert (row.target, row.best, row.fitting) == (SLICES[0], None, 0)
    assert row.why is not None
    assert "needs" in row.why
    assert "of 1000 B per device" in row.why
    assert found.to_json()["targets"][0]["best"] is None


@pytest.mark.parametrize(
    ("cores", "candidates", "target", "workers", "expected"),
    [
        (16, 20, None, None, 16),  # XLA:CPU: a compile a core
        (16, 20, "v5e:2x4", None, 8),  # XLA:TPU: about 1.8 cores a compile
        (16, 5, None, None, 5),  # never more than the candidates
        (1, 20, "v5e:2x4", None, 1),  # at least one
        (16, 20, None, 3, 3),  # `workers=` overrides
    ],
)
def test_the_pool_is_sized_to_the_compiler_s_threads(
    cores, candidates, target, workers, expected, monkeypatch
):
    monkeypatch.setattr(pool, "_cores", lambda: cores)
    assert pool.pool_size(candidates, target, workers) == expected


@pytest.mark.slow  # compiles in worker processes
def test_two_workers_cost_every_candidate_once_in_order():
    mlp = _abstract(models.mlp_build, models.mlp_optimizer, models.mlp_batch)
    candidates = _mlp_candidates()
    inputs = {"pickle": pickled((models.mlp_step, mlp[0], mlp[1:]), "the step", "")}
    results = pool.compile_in_workers(candidates * 2, inputs, 8, None, 2)
    here = [rank([c], models.mlp_step, *mlp, devices=8, workers=0)[0] for c in candidates]
    for found, suggestion in zip(results, here * 2):
        assert found is not None
        assert not isinstance(found, str), found
        assert found.memory == _cost(suggestion).memory, suggestion.name


# --------------------------------------------------------------------------- #
# Ranked before compiled: estimates first, then only what they cannot rule out.
# --------------------------------------------------------------------------- #


def _pruned_and_exhaustive(build, optimizer, batch, step, **where):
    inputs = _abstract(build, optimizer, batch)
    pruned = eqshard.suggest(*inputs, step=step, **where)
    full = eqshard.suggest(*inputs, step=step, exhaustive=True, **where)
    return pruned, full


def _agrees_with_the_exhaustive_search(pruned, full):
    """The pruned search's best is the exhaustive one's, each row it compiled has the
    same figures, and each row it did not is marked so and never fits."""
    assert (pruned.exhaustive, full.exhaustive) == (False, True)
    assert all(s.figures == "compiled" for s in full)
    assert pruned.best is not None
    assert full.best is not None
    assert pruned.best.name == full.best.name
    assert pruned.best.rules.to_json() == full.best.rules.to_json()
    by_name = {s.name: s for s in full}
    assert sorted(s.name for s in pruned) == sorted(by_name)
    compiled = [s for s in pruned if s.cost is not None]
    for s in pruned:
        twin = _cost(by_name[s.name])
        if s.cost is not None:
            assert s.figures == "compiled"
            assert s.cost.memory == twin.memory, s.name
            assert s.cost.collectives == twin.collectives, s.name
        else:
            assert s.figures in ("estimated", "XLA:CPU"), s.name
            assert not s.fits
            assert s.candidate.estimated is not None
            assert s.candidate.estimated.parameters == twin.memory.parameters, s.name
    fitting = [s for s in compiled if s.fits]  # first, before any row not compiled
    assert list(pruned)[: len(fitting)] == fitting
    return compiled


@pytest.mark.slow  # two suggest runs on the MLP, in worker processes
def test_the_estimates_hold_exactly_the_bytes_the_compiler_counts_and_rule_out_the_certain():
    # 40,000 bytes: data parallel's arguments alone (50,564) are over, found without
    # compiling it; the exhaustive search compiles it and finds it over too, and the
    # candidates that split the weights fit (the stacked GPT's activations outweigh
    # data parallel's arguments on every candidate: no limit below them fits any)
    limit = 40_000
    pruned, full = _pruned_and_exhaustive(
        models.mlp_build,
        models.mlp_optimizer,
        models.mlp_batch,
        models.mlp_step,
        simulate=8,
        max_memory=limit,
    )
    _agrees_with_the_exhaustive_search(pruned, full)
    for s in full:
        figures, memory = s.candidate.estimated, _cost(s).memory
        assert figures is not None
        held = (figures.parameters, figures.optimizer, figures.state, figures.gradients)
        assert held == (memory.parameters, memory.optimizer, memory.state, memory.gradients)
        assert figures.arguments == memory.arguments, s.name  # XLA:CPU's own count
        assert figures.arguments <= memory.peak, s.name  # a lower bound of the peak
    (data_parallel,) = [s for s in pruned if s.strategy == "data parallel"]
    assert data_parallel.cost is None
    assert data_parallel.candidate.estimated is not None
    assert data_parallel.candidate.estimated.arguments == 50_564
    assert data_parallel.over == pytest.approx(50_564 / limit)
    assert _cost(next(s for s in full if s.strategy == "data parallel")).memory.peak > limit
    text = str(pruned)
    assert "no: its arguments alone need 49.4 KiB of 39.1 KiB" in text
    assert " >= 49.4 KiB " in text
    assert "exhaustive=True (--exhaustive) compiles every one" in text
    assert "compiled all" in str(full)
    row = pruned.to_json()["suggestions"][pruned.suggestions.index(data_parallel)]
    assert (row["figures"], row["estimated"]["arguments"]) == ("estimated", 50_564)


@pytest.mark.slow  # two suggest runs on 64 simulated devices, in worker processes
def test_the_pruned_search_picks_the_exhaustive_best_for_the_gpt_on_64_devices():
    pruned, full = _pruned_and_exhaustive(
        models.build,
        models.optimizer,
        models.batch64,
        models.step,
        simulate=64,
        max_memory=BUDGET,
    )
    compiled = _agrees_with_the_exhaustive_search(pruned, full)
    assert len(compiled) < len(full)


@pytest.mark.slow  # compiles for a TPU slice, XLA:CPU first, in worker processes
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler comes with libtpu (eqshard[tpu])",
)
def test_the_pruned_search_picks_the_exhaustive_best_for_a_llama_on_a_tpu_slice():
    pruned, full = _pruned_and_exhaustive(
        models.llama_build,
        models.llama_optimizer,
        models.llama_batch,
        models.llama_step,
        target="v5e:2x4",
    )
    compiled = _agrees_with_the_exhaustive_search(pruned, full)
    assert len(compiled) < len(full)
    # the rows not compiled for the slice were ranked by XLA:CPU's figures (the
    # estimates alone rule none of them out against the first that fits)
    assert {s.figures for s in pruned if s.cost is None} == {"XLA:CPU"}
    assert all(s.proxy is not None and s.proxy.target is None for s in pruned if s.cost is None)


def test_xla_cpu_s_guess_halves_promoted_collectives_and_takes_the_smaller_memory_term():
    """`proxy_guess` on made-up figures: a bfloat16 step's collectives count half
    (XLA:CPU moved them as float32), and its memory term is the smaller of
    XLA:CPU's and the layouts' estimate; every change makes the guess faster."""
    from eqshard._cost._hardware import HARDWARE
    from eqshard._cost._results import Collective
    from eqshard._search._estimate import Estimated

    h100 = HARDWARE["h100"]
    moved = [Collective("all-reduce", 2**30, ("data",), "made up", 1, 8)]
    proxy = eqshard.results.Cost(
        memory=None,  # pyright: ignore[reportArgumentType]
        collectives=moved,
        flops=1e12,
        bytes_accessed=4e10,
        mesh=None,
        devices=8,
        dtype="bfloat16",
        compiler="XLA:CPU, 8 simulated devices",
    )
    figures = Estimated(0, 0, 0, 0, 0, 0, (), 1e12, 1e10, "bfloat16")
    found = proxy.estimate(h100)
    guess = proxy_guess(proxy, figures, h100)
    layouts = figures.estimate(h100).memory
    assert layouts < found.memory
    assert guess == pytest.approx(max(found.compute, layouts) + found.communication / 2)
    as_float32 = dataclasses.replace(proxy, dtype="float32")
    assert proxy_guess(as_float32, None, h100) == pytest.approx(found.seconds)


@pytest.mark.slow  # compiles in worker processes
def test_compile_workers_compile_only_the_candidates_still_wanted():
    mlp = _abstract(models.mlp_build, models.mlp_optimizer, models.mlp_batch)
    candidates = _mlp_candidates()
    inputs = {"pickle": pickled((models.mlp_step, mlp[0], mlp[1:]), "the step", "")}
    asked: list[tuple[int, int]] = []

    def wanted(k, found):
        asked.append((k, sum(f is not None for f in found)))
        return k != 1  # the second is never wanted

    results = pool.compile_in_workers(candidates, inputs, 8, None, 1, wanted=wanted)
    assert results[1] is None
    assert all(r is not None and not isinstance(r, str) for k, r in enumerate(results) if k != 1)
    # one worker: each later candidate is asked about once the earlier ones answered
    assert asked[0] == (0, 0)
    assert (2, 1) in asked


def test_progress_is_told_as_each_pass_starts_as_each_candidate_compiles_and_as_it_ends():
    mlp = _abstract(models.mlp_build, models.mlp_optimizer, models.mlp_batch)
    chosen = _mlp_candidates()[:2]
    heard: list[Progress] = []
    ranked = rank(chosen, models.mlp_step, *mlp, devices=8, workers=0, progress=heard.append)
    assert len(ranked) == 2
    first, second = (f"{c.strategy} ({mesh_text(c.mesh)})" for c in chosen)
    assert heard == [
        Progress(0, 2, "8 devices"),
        Progress(1, 2, "8 devices", first),
        Progress(2, 2, "8 devices", second),
        Progress(2, 2, "8 devices", finished=True),
    ]
    assert [str(p) for p in heard] == [
        "compiling 2 candidates on 8 devices",
        f"compiled 1 of 2 candidates on 8 devices (the last: {first})",
        f"compiled 2 of 2 candidates on 8 devices (the last: {second})",
        "compiled all 2 candidates on 8 devices",
    ]
    ruled_out = Progress(1, 3, "v5e:2x4 (8 devices)", finished=True)
    assert str(ruled_out) == (
        "compiled 1 of 3 candidates on v5e:2x4 (8 devices); the other 2 ruled out by their "
        "estimates"
    )
    deferred = Progress(1, 3, "v5e:2x4 (8 devices)", finished=True, deferred=True)
    assert str(deferred) == (
        "compiled 1 of 3 candidates on v5e:2x4 (8 devices), in the estimates' order until one "
        "fit; the other 2 left to rank against it"
    )


@pytest.mark.slow  # `python -m eqshard suggest` twice, each with its worker processes
def test_cli_keeps_the_workers_stderr_out_of_its_output_unless_verbose(run_python):
    """What the workers write on fd 2 (XLA's C++ warnings; here the step's) is kept
    from the command's output; `--verbose` shows it on stderr. The progress is told
    on stderr, a line each where stderr is no terminal; the table alone is on stdout."""
    command = [
        *("-m", "eqshard", "suggest", "--simulate", "2", "--workers", "1"),
        *("--model", f"{MODULE}:mlp_build", "--step", f"{MODULE}:noisy_step"),
        *("--optimizer", f"{MODULE}:mlp_optimizer", "--make-batch", f"{MODULE}:mlp_batch"),
        *("--strategies", "fsdp"),
    ]
    for verbose in (False, True):
        done = run_python([*command, *(["--verbose"] if verbose else [])])
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith("eqshard suggest: 1 candidates on 2 devices")
        assert models.NOISE not in done.stdout
        assert (models.NOISE in done.stderr) is verbose, done.stderr[-3000:]
        progress = [line for line in done.stderr.splitlines() if line.startswith("eqshard")]
        assert progress == [
            "eqshard suggest: building the model and the candidates on 2 devices",
            "eqshard suggest: compiling 1 candidate on 2 devices",
            "eqshard suggest: compiled 1 of 1 candidate on 2 devices (the last: fsdp "
            "(data=2 x model=1))",
            "eqshard suggest: compiled the 1 candidate on 2 devices",
        ]


def test_suggest_s_help_names_every_strategy_of_the_table(run_cli, monkeypatch):
    """`--strategies`'s help is made from the families' table, so it never goes stale."""
    from eqshard._search._families import FAMILIES

    monkeypatch.setenv("COLUMNS", "10000")  # no line broken at a name's hyphen
    result = run_cli("suggest", "--help")
    assert result.code == 0
    text = " ".join(result.out.split())  # argparse wraps the help's lines
    missing = [f.name for f in FAMILIES if f.name not in text]
    assert missing == []


def test_devices_over_this_process_s_count_is_simulate_with_a_deprecation_warning():
    """`devices=n` beyond this process's devices keeps its old meaning, `simulate=n`."""
    from eqshard._search._suggest import placement

    with pytest.warns(DeprecationWarning, match=r"`devices=16` means 16 of this process's"):
        placed = placement(16, None, None, stacklevel=2)
    assert (placed.size, placed.target, placed.devices) == (16, None, None)
    assert placement(None, 16, None) == (16, None, None)
    assert placement(4, None, None).devices == tuple(jax.local_devices()[:4])


def test_cli_devices_is_the_old_spelling_of_simulate(run_cli, monkeypatch):
    heard = []

    def candidates(step, model, *args, devices, strategies=None):
        heard.append(devices)
        return [], []

    monkeypatch.setattr(eqshard._search._candidates, "candidates", candidates, False)
    done = run_cli(
        *("suggest", "--devices", 4, "--model", f"{MODULE}:mlp_build"),
        *("--step", f"{MODULE}:mlp_step", "--optimizer", f"{MODULE}:mlp_optimizer"),
        *("--batch", f"{MODULE}:mlp_batch"),
    )
    assert "eqshard suggest: --devices 4 is deprecated: pass --simulate 4" in done.err
    assert heard == [4]


def test_a_ranking_names_the_compiler_of_the_devices_it_compiled_on():
    """Compiled here on a GPU, the ranking says XLA:GPU and the chip, never XLA:CPU's
    simulated devices (a stand-in GPU device: the suite runs on CPU)."""
    from eqshard._cost._driver import compiler_label

    class Gpu:
        platform = "gpu"
        device_kind = "NVIDIA H100"

    assert compiler_label((Gpu(),), 1) == "XLA:GPU (NVIDIA H100), 1 device"
    assert compiler_label(None, 8) == "XLA:CPU, 8 simulated devices"
    assert compiler_label(tuple(jax.local_devices()[:2]), 2) == "XLA:CPU, 2 simulated devices"
    label = compiler_label((Gpu(),), 1)
    found = ranked([_demo_candidate("fsdp")], [None], 1, None, None, None, compiler=label)
    assert found.compiler == "XLA:GPU (NVIDIA H100), 1 device"
    text = str(found)
    assert "compiled by XLA:GPU (NVIDIA H100), 1 device" in text
    assert "XLA:CPU" not in text


def test_slices_of_one_size_share_xla_cpu_s_figures_of_each_candidate():
    """Within `sharing_proxies` (as `suggest_targets` and `--targets` run), a second
    slice of as many devices ranks the candidates by the figures XLA:CPU gave for the
    first: no candidate is compiled twice by XLA:CPU. Outside it, each search compiles
    its own."""
    import types

    from eqshard._cost._hardware import HARDWARE
    from eqshard._search._policy import search, sharing_proxies

    mlp = _abstract(models.mlp_build, models.mlp_optimizer, models.mlp_batch)
    candidates = _mlp_candidates()
    here = rank(candidates, models.mlp_step, *mlp, devices=8, workers=0)
    costs = {s.name: _cost(s) for s in here}
    asked: list[tuple[str | None, list[str]]] = []

    def compile_each(chosen, where, wanted, answered):
        found = []
        names = []
        for k, c in enumerate(chosen):
            if wanted is None or wanted(k, found):
                names.append(name_of(c))
                found.append(costs[name_of(c)])
            else:
                found.append(None)
        asked.append((where, names))
        return found

    def on(name: str):
        return types.SimpleNamespace(name=name, hardware=HARDWARE["tpu-v5e"])

    def searched(name: str):
        return search(candidates, compile_each, 8, on(name), None, None, proxy=True)  # pyright: ignore[reportArgumentType]

    with sharing_proxies():
        first, second = searched("v5e:2x4"), searched("v5p:2x2x2")
    cheap = [names for where, names in asked if where is None]
    assert cheap[0]  # the first slice's XLA:CPU pass compiled
    assert cheap[1:] == []  # the second's asked XLA:CPU for nothing
    assert [s.name for s in first] == [s.name for s in second]
    assert [s.proxy for s in first] == [s.proxy for s in second]
    asked.clear()
    searched("v5e:2x4")
    assert [names for where, names in asked if where is None] == [cheap[0]]


def test_cli_help_gives_suggest_s_default_tolerance(run_cli):
    from eqshard._search._policy import TOLERANCE

    done = run_cli("suggest", "--help")
    assert done.code == 0
    assert f"(default {TOLERANCE})" in " ".join(done.out.split())


@pytest.mark.slow  # two searches for a TPU slice, in worker processes
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler comes with libtpu (eqshard[tpu])",
)
def test_where_the_cores_hold_both_the_target_compiles_the_front_runner_at_once(monkeypatch):
    """With cores for XLA:CPU's pool and an XLA:TPU compile beside it, the slice's
    first worker compiles the estimates' front-runner while XLA:CPU ranks; the search
    ranks the same and each compiled row has the same figures as one pass after the
    other (on 2 cores, with one worker each: the target first, then XLA:CPU), and
    picks the same best."""
    import eqshard._search._pool as pool

    heads = []
    prepare = pool._InWorkers.prepare

    def spy(self, target, candidates, head):
        started = prepare(self, target, candidates, head)
        heads.append(self.ahead.get(target))
        return started

    monkeypatch.setattr(pool._InWorkers, "prepare", spy)
    inputs = _abstract(models.llama_build, models.llama_optimizer, models.llama_batch)
    monkeypatch.setattr(pool, "_cores", lambda: 4)
    some = ["data parallel", "fsdp", "data x tensor"]  # a front-runner and rivals, fewer compiles
    ahead = eqshard.suggest(
        *inputs, step=models.llama_step, target="v5e:2x4", workers=1, strategies=some
    )
    monkeypatch.setattr(pool, "_cores", lambda: 2)
    after = eqshard.suggest(
        *inputs, step=models.llama_step, target="v5e:2x4", workers=1, strategies=some
    )
    assert heads[0] is not None  # a worker and the front-runner it compiled at once
    assert heads[1] is None
    assert sorted(s.name for s in ahead) == sorted(s.name for s in after)
    assert ahead.best is not None
    assert after.best is not None
    assert ahead.best.name == after.best.name
    compiled = {s.name: s.cost for s in ahead if s.cost is not None}
    for b in after:  # the head start may compile one more: the front-runner
        if b.cost is not None:
            assert compiled[b.name].memory == b.cost.memory, b.name
            assert compiled[b.name].bytes_by_axes() == b.cost.bytes_by_axes(), b.name
    assert name_of(heads[0][1]) in compiled


def test_on_few_cores_the_target_compiles_first_and_xla_cpu_ranks_only_what_could_win():
    """One pass after the other (no `prepare`, as on 2 cores): the target compiles the
    estimates' front-runner first; XLA:CPU then ranks only the candidates whose
    estimate could beat its compiled figure by more than the tolerance; the target
    compiles no one twice. Where the target refuses every candidate (nothing fits),
    it compiles each once, as exhaustive does, and XLA:CPU nothing."""
    import types

    from eqshard._cost._hardware import HARDWARE
    from eqshard._search._policy import TOLERANCE, search

    mlp = _abstract(models.mlp_build, models.mlp_optimizer, models.mlp_batch)
    candidates, _ = eqshard._search._candidates.candidates(models.mlp_step, *mlp, devices=8)
    costs = {
        s.name: _cost(s)
        for s in rank(candidates, models.mlp_step, *mlp, devices=8, workers=0, exhaustive=True)
    }
    v5e = HARDWARE["tpu-v5e"]
    guess = {name_of(c): c.estimated.estimate(v5e).seconds for c in candidates if c.estimated}
    assert len(guess) == len(candidates) > 2
    asked: list[tuple[str | None, list[str]]] = []

    def compiler(refuses: bool):
        def compile_each(chosen, where, wanted, answered):
            found, names = [], []
            for k, c in enumerate(chosen):
                if wanted is None or wanted(k, found):
                    names.append(name_of(c))
                    refused = refuses and where is not None
                    found.append("RESOURCE_EXHAUSTED: made up" if refused else costs[name_of(c)])
                else:
                    found.append(None)
            asked.append((where, names))
            return found

        return compile_each

    on = types.SimpleNamespace(name="v5e:2x4", hardware=v5e, compiler="XLA:TPU, made up")
    ranked_ = search(candidates, compiler(False), 8, on, None, None, proxy=True)  # pyright: ignore[reportArgumentType]
    first = min(guess, key=lambda name: guess[name])
    assert asked[0] == ("v5e:2x4", [first])
    best = costs[first].estimate(v5e).seconds
    ratio = min(1.0, best / guess[first])
    could_win = {n for n, g in guess.items() if n != first and g * ratio * (1 - TOLERANCE) < best}
    cpu = [names for where, names in asked if where is None]
    assert cpu == ([sorted(could_win, key=lambda n: guess[n])] if could_win else [])
    on_target = [n for where, names in asked if where for n in names]
    assert len(on_target) == len(set(on_target))
    for s in ranked_:
        assert (s.figures == "XLA:CPU") == (s.name in could_win and s.cost is None), s.name

    asked.clear()
    refused = search(candidates, compiler(True), 8, on, None, None, proxy=True)  # pyright: ignore[reportArgumentType]
    assert [where for where, names in asked if names] == ["v5e:2x4"]
    assert asked[0][1] == sorted(
        guess, key=lambda n: (guess[n], [name_of(c) for c in candidates].index(n))
    )
    assert refused.best is None
    assert all(s.error == "RESOURCE_EXHAUSTED: made up" for s in refused)
