"""`eqshard validate`, `check` and `schema`.

They run in this process (`run_cli`); one `check` runs as a user runs it, in a
subprocess. `check` is read through `--format json`; the text format is pinned
only in its headline lines.
"""

import json
import runpy
from pathlib import Path

import jax
import pytest

import eqshard

ROOT = Path(__file__).parent.parent
SPECS = Path(__file__).parent / "specs"
EXAMPLE = ROOT / "examples" / "specs" / "transformer.eqshard.json"
MODEL = f"{ROOT / 'examples' / 'transformer.py'}:build"

# The array leaves of the example transformer, in model order.
BLOCK = [
    "norm1.weight",
    "norm1.bias",
    "attn.query_proj.weight",
    "attn.key_proj.weight",
    "attn.value_proj.weight",
    "attn.output_proj.weight",
    "norm2.weight",
    "norm2.bias",
    "up.weight",
    "up.bias",
    "down.weight",
    "down.bias",
]
RULED = [  # the leaves of a block that the example's rules split
    "attn.query_proj.weight",
    "attn.key_proj.weight",
    "attn.value_proj.weight",
    "attn.output_proj.weight",
    "up.weight",
    "up.bias",
    "down.weight",
]
LEAVES = [
    "embed.weight",
    *(f"blocks.{i}.{leaf}" for i in range(2) for leaf in BLOCK),
    "norm.weight",
    "norm.bias",
    "unembed.w",
]


def _check_json(run_cli, *args):
    """`eqshard check --format json`: the exit code and the parsed report."""
    result = run_cli("check", *args, "--format", "json")
    assert result.err == ""
    return result.code, json.loads(result.out)


def test_validate_valid_files(run_cli):
    files = [*sorted((SPECS / "valid").glob("*.json")), EXAMPLE]
    result = run_cli("validate", *files)
    assert result.code == 0, result.out + result.err
    assert result.out.splitlines() == [
        f"ok: {SPECS / 'valid' / 'full.eqshard.json'} (3 rules)",
        f"ok: {SPECS / 'valid' / 'minimal.eqshard.json'} (0 rules)",
        f"ok: {SPECS / 'valid' / 'unicode.eqshard.json'} (1 rule)",
        f"ok: {EXAMPLE} (7 rules)",
    ]


def test_validate_reports_file_and_json_path(run_cli):
    path = SPECS / "invalid" / "expressions.eqshard.json"
    result = run_cli("validate", SPECS / "valid" / "minimal.eqshard.json", path)
    assert result.code == 1
    lines = result.out.splitlines()
    assert lines[1] == (
        f"{path}::$.rules[0].expr: axis 'z' is on the right but not on the left; add it to "
        "the left, or drop its name to replicate instead"
    )
    assert lines[2:4] == ["    x y -> x z", "             ^"]
    assert f"{path}::$.rules[1].expr: a count of 0 is not allowed; counts start at 1" in lines


def test_validate_json_format(run_cli):
    path = SPECS / "invalid" / "structure.eqshard.json"
    result = run_cli("validate", "--format", "json", path, SPECS / "valid" / "full.eqshard.json")
    assert result.code == 1
    report = json.loads(result.out)
    assert report["ok"] is False
    assert [f["ok"] for f in report["files"]] == [False, True]
    first = report["files"][0]["problems"][0]
    assert first == {
        "where": f"{path}::$",
        "file": str(path),
        "path": "$",
        "message": "unknown key 'model'; the keys here are '$schema', 'eqshard', 'comment', 'devices', 'mesh', 'default', 'rules', 'dims', 'logical_axis_rules', 'batch', 'optimizer'",
    }
    assert len(report["files"][0]["problems"]) == 10


def test_validate_unreadable_file_exits_2(run_cli, tmp_path):
    result = run_cli("validate", tmp_path / "nope.json")
    assert result.code == 2
    assert (
        result.err.strip() == f"{tmp_path / 'nope.json'}: cannot read it: No such file or directory"
    )


def test_validate_broken_json_exits_1_with_line_and_column(run_cli):
    path = SPECS / "invalid" / "broken.eqshard.json"
    result = run_cli("validate", path)
    assert result.code == 1
    with pytest.raises(json.JSONDecodeError) as python:  # its words change with Python
        json.loads(path.read_text())
    fault = python.value
    assert result.out.strip() == (
        f"{path}::line {fault.lineno}, column {fault.colno}: invalid JSON: {fault.msg}"
    )


def test_check_example_as_a_user_runs_it(run_python):
    result = run_python(
        ["-m", "eqshard", "check", str(EXAMPLE), "--model", MODEL, "--device-counts", "2", "8"]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stdout.splitlines()
    assert f"{EXAMPLE} on 2 devices: ok" in lines
    assert f"{EXAMPLE} on 8 devices: ok" in lines
    summary = "28 array leaves: 14 by rules, 1 by dims, 13 by the default; each device holds"
    assert f"{summary} 292.0 KiB" in lines
    assert f"{summary} 123.2 KiB" in lines
    header = next(line for line in lines if line.startswith("┃"))
    assert [cell.strip() for cell in header.strip("┃").split("┃")] == [
        "leaf",
        "shape",
        "dtype",
        "expression",
        "from",
        "spec",
        "per device",
    ]


def test_check_example_on_several_device_counts(run_cli):
    code, report = _check_json(run_cli, EXAMPLE, "--model", MODEL, "--device-counts", "2", "8")
    assert code == 0
    assert report["ok"] is True
    two, eight = report["checks"]
    assert [two["devices"], eight["devices"]] == [2, 8]
    assert [two["bytes_per_device"], eight["bytes_per_device"]] == [299008, 126208]
    for check in (two, eight):
        assert check["file"] == str(EXAMPLE)
        assert (check["ok"], check["problems"], check["notes"]) == (True, [], [])
        assert check["coverage"] == {"rules": 14, "dims": 1, "default": 13, "none": 0}
        assert [leaf["path"] for leaf in check["leaves"]] == LEAVES
        assert check["bytes_per_device"] == sum(
            leaf["bytes_per_device"] for leaf in check["leaves"]
        )
    leaves = {leaf["path"]: leaf for leaf in eight["leaves"]}
    assert leaves["blocks.1.up.weight"] == {
        "path": "blocks.1.up.weight",
        "shape": [256, 64],
        "dtype": "float32",
        "expression": "o i -> o* i",
        "partition_spec": "P('m0', None)",
        "bytes_per_device": 8192,
        "total_bytes": 65536,
        "origin": "$.rules[4]",
        "memory_kind": None,
        "stages": None,
    }
    assert leaves["unembed.w"] == {
        "path": "unembed.w",
        "shape": [256, 64],
        "dtype": "float32",
        "expression": "vocab embed -> vocab* embed",
        "partition_spec": "P('m0', None)",
        "bytes_per_device": 8192,
        "total_bytes": 65536,
        "origin": "dims",
        "memory_kind": None,
        "stages": None,
    }
    assert leaves["norm.weight"] == {
        "path": "norm.weight",
        "shape": [64],
        "dtype": "float32",
        "expression": "... -> * ...",
        "partition_spec": "P()",
        "bytes_per_device": 256,
        "total_bytes": 256,
        "origin": "default",
        "memory_kind": None,
        "stages": None,
    }
    assert leaves["blocks.0.attn.output_proj.weight"]["partition_spec"] == "P(None, 'm0')"
    assert {leaf["path"]: leaf["bytes_per_device"] for leaf in two["leaves"]}[
        "blocks.1.up.weight"
    ] == 32768


def test_check_fails_where_dims_do_not_divide(run_cli):
    code, report = _check_json(run_cli, EXAMPLE, "--model", MODEL, "--device-counts", "6")
    assert code == 1
    (check,) = report["checks"]
    assert check["ok"] is False
    # every leaf that a rule or the dims split fails on 6 devices, in model order
    failing = [f"blocks.{i}.{leaf}" for i in range(2) for leaf in BLOCK if leaf in RULED]
    failing.append("unembed.w")
    assert len(failing) == 15
    assert [p["where"].partition(" (")[0] for p in check["problems"]] == failing
    assert check["problems"][4] == {
        "where": "blocks.0.up.weight (Linear.weight)",
        "message": "float32[256, 64] 'o i -> o* i': axis 'o' (dimension 0 of shape (256, 64)) "
        "has size 256, which does not split into 6 equal shards; choose a count that divides 256",
        "detail": "    o i -> o* i\n           ^^",
    }
    assert check["problems"][-1] == {
        "where": "unembed.w (Unembed.w)",
        "message": "float32[256, 64] 'vocab embed -> vocab* embed': axis 'vocab' (dimension 0 "
        "of shape (256, 64)) has size 256, which does not split into 6 equal shards; choose "
        "a count that divides 256",
        "detail": "    vocab embed -> vocab* embed\n                   ^^^^^^",
    }
    # the leaves the default replicates are laid out all the same
    for leaf in check["leaves"]:
        laid_out = leaf["path"] not in failing
        assert (leaf["partition_spec"] is not None) == laid_out, leaf
        assert (leaf["bytes_per_device"] is not None) == laid_out, leaf
    assert check["bytes_per_device"] is None

    text = run_cli("check", EXAMPLE, "--model", MODEL, "--device-counts", "6")
    assert text.code == 1
    # one line for each distinct message, naming where it was found
    assert (
        "blocks.0.up.weight (Linear.weight), blocks.1.up.weight (Linear.weight): float32[256, 64] "
        "'o i -> o* i': axis 'o' (dimension 0 of shape (256, 64)) has size 256, which does not "
        "split into 6 equal shards; choose a count that divides 256"
    ) in text.out.splitlines()
    assert f"{EXAMPLE} on 6 devices: 15 problem(s)" in text.out.splitlines()


@pytest.fixture
def spec_file(tmp_path):
    def write(document):
        path = tmp_path / "spec.eqshard.json"
        path.write_text(json.dumps(document))
        return path

    return write


def test_check_strict_unused_rule_and_default_error(run_cli, spec_file):
    path = spec_file(
        {
            "eqshard": 1,
            "devices": 8,
            "default": "error",
            "rules": [
                {"path": "**.up.weight", "expr": "o i -> o* i"},
                {"path": "**.nowhere", "expr": "a -> a*"},
            ],
        }
    )
    code, report = _check_json(run_cli, path, "--model", MODEL)
    assert code == 1
    (check,) = report["checks"]
    assert check["notes"] == [f"{path}::$.rules[1]: rule '**.nowhere' matched no leaf of the model"]
    unmatched = [leaf for leaf in LEAVES if not leaf.endswith("up.weight")]
    assert [{**p, "where": p["where"].split(" (")[0]} for p in check["problems"]] == [
        {
            "where": leaf,
            "message": f'no rule or dim matches this leaf, and {path} says "default": "error"; '
            'add a rule whose path matches it, or set "default": "replicate"',
        }
        for leaf in unmatched
    ]
    # the leaves the rule matched are laid out all the same
    laid_out = [leaf for leaf in check["leaves"] if leaf["partition_spec"] is not None]
    assert [(leaf["path"], leaf["origin"], leaf["partition_spec"]) for leaf in laid_out] == [
        ("blocks.0.up.weight", "$.rules[0]", "P('m0', None)"),
        ("blocks.1.up.weight", "$.rules[0]", "P('m0', None)"),
    ]

    text = run_cli("check", path, "--model", MODEL)
    assert text.code == 1
    lines = text.out.splitlines()
    assert f"warning: {path}::$.rules[1]: rule '**.nowhere' matched no leaf of the model" in lines
    # 26 leaves with one message: one line, three of them named
    assert (
        "embed.weight (Embedding.weight), blocks.0.norm1.weight (LayerNorm.weight), "
        "blocks.0.norm1.bias (LayerNorm.bias) and 23 more: no rule or dim matches this leaf, "
        f'and {path} says "default": "error"; add a rule whose path matches it, or set '
        '"default": "replicate"'
    ) in lines
    assert f"{path} on 8 devices: 26 problem(s)" in lines

    path = spec_file({"eqshard": 1, "rules": [{"path": "**.nowhere", "expr": "a -> a*"}]})
    code, relaxed = _check_json(run_cli, path, "--model", MODEL)
    assert code == 0
    assert relaxed["checks"][0]["problems"] == []
    assert relaxed["checks"][0]["notes"] == [
        f"{path}::$.rules[0]: rule '**.nowhere' matched no leaf of the model"
    ]
    code, strict = _check_json(run_cli, path, "--model", MODEL, "--strict")
    assert code == 1
    assert strict["checks"][0]["notes"] == strict["checks"][0]["warnings"] == []
    assert strict["checks"][0]["problems"] == [
        {
            "where": f"{path}::$.rules[0]",
            "file": str(path),
            "path": "$.rules[0]",
            "message": "rule '**.nowhere' matched no leaf of the model (--strict)",
        }
    ]
    text = run_cli("check", path, "--model", MODEL, "--strict")
    assert text.code == 1
    assert (
        f"{path}::$.rules[0]: rule '**.nowhere' matched no leaf of the model (--strict)"
        in text.out.splitlines()
    )


def test_check_device_count_that_does_not_fit(run_cli, spec_file):
    path = spec_file(
        {"eqshard": 1, "devices": 8, "rules": [{"path": "**.up.weight", "expr": "o i -> o2 i4"}]}
    )
    code, report = _check_json(run_cli, path, "--model", MODEL, "--device-counts", "8", "4")
    assert code == 1
    checks = report["checks"]
    assert [c["devices"] for c in checks] == [8, 4]
    assert [c["ok"] for c in checks] == [True, False]
    mismatch = (
        "float32[256, 64] 'o i -> o2 i4': o2 x i4 = 8 shards need 8 devices, 4 are given; "
        "choose counts whose product is 4, or use '*' to take a share"
    )
    caret = "    o i -> o2 i4\n           ^^^^^"
    assert checks[1]["problems"] == [
        {
            "where": f"{path}::$.devices",
            "file": str(path),
            "path": "$.devices",
            "message": 'the spec was written for 8 devices, and it is laid out on 4; use 8 devices, or change "devices" (or drop it to allow any count)',
        },
        *(
            {"where": f"blocks.{i}.up.weight (Linear.weight)", "message": mismatch, "detail": caret}
            for i in (0, 1)
        ),
    ]
    for check in checks:
        assert check["coverage"] == {"rules": 2, "dims": 0, "default": 26, "none": 0}
    assert checks[0]["bytes_per_device"] == sum(
        leaf["bytes_per_device"] for leaf in checks[0]["leaves"]
    )
    up = [leaf for leaf in checks[0]["leaves"] if leaf["path"].endswith("up.weight")]
    assert [(leaf["partition_spec"], leaf["bytes_per_device"]) for leaf in up] == [
        ("P('m0', 'm1')", 8192)
    ] * 2
    # on 4 devices only the two leaves that need 8 are not laid out
    not_laid_out = [
        leaf["path"] for leaf in checks[1]["leaves"] if leaf["bytes_per_device"] is None
    ]
    assert not_laid_out == ["blocks.0.up.weight", "blocks.1.up.weight"]
    assert checks[1]["bytes_per_device"] is None


def test_check_lays_out_on_more_devices_than_jax_started_with(run_cli):
    # JAX is up in this process with 8 devices; layouts need none.
    assert len(jax.devices()) == 8  # started, whatever ran before
    code, report = _check_json(run_cli, EXAMPLE, "--model", MODEL, "--device-counts", "16", "65536")
    assert code == 1  # 65536 does not divide the example's 256 columns
    sixteen, many = report["checks"]
    assert sixteen["ok"]
    assert sixteen["devices"] == 16
    leaves = {leaf["path"]: leaf for leaf in sixteen["leaves"]}
    assert leaves["blocks.0.up.weight"]["partition_spec"] == "P('m0', None)"
    assert leaves["blocks.0.up.weight"]["bytes_per_device"] == 256 * 64 * 4 // 16
    assert {p["where"] for p in many["problems"]} >= {"blocks.0.up.weight (Linear.weight)"}


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("nope", "--model 'nope': write MODULE:CALLABLE"),
        ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
        (f"{ROOT / 'examples' / 'transformer.py'}:nothing", "has no callable 'nothing'"),
    ],
)
def test_check_bad_model_argument(run_cli, model, message):
    result = run_cli("check", EXAMPLE, "--model", model)
    assert result.code == 2  # the README: a model that cannot be built exits 2
    assert message in result.err


def test_check_model_that_fails_is_reported_without_a_traceback(run_cli, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def build(:\n")
    result = run_cli("check", EXAMPLE, "--model", f"{broken}:build")
    assert result.code == 2
    assert "raised SyntaxError" in result.err
    failing = tmp_path / "failing.py"
    failing.write_text("def build():\n    raise RuntimeError('no weights here')\n")
    result = run_cli("check", EXAMPLE, "--model", f"{failing}:build")
    assert result.code == 2
    assert "build() raised RuntimeError: no weights here" in result.err


def test_schema_command_prints_the_schema(run_cli):
    result = run_cli("schema")
    assert result.code == 0
    assert json.loads(result.out) == eqshard.schema()


def test_pre_commit_hook_is_declared():
    text = (ROOT / ".pre-commit-hooks.yaml").read_text()
    assert "- id: eqshard-validate" in text
    assert "entry: eqshard validate" in text
    assert r"files: \.eqshard\.json$" in text


@pytest.mark.slow  # runs the example training script
def test_training_script_applies_the_example_spec(capsys):
    runpy.run_path(str(ROOT / "examples" / "transformer.py"), run_name="__main__")
    out = capsys.readouterr().out
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 5
    assert losses[-1] < losses[0]
    assert out.splitlines()[-4:] == [
        "blocks[0].up.weight (256, 64): each device holds (32, 64)",
        "its Adam moment (256, 64): each device holds (32, 64)",
        "unembed.w (from dims) (256, 64): each device holds (32, 64)",
        "norm.weight (default) (64,): each device holds (64,)",
    ]


def test_check_counts_old_and_new_spellings(run_cli):
    """`--device-counts` and `--simulate` are the counts; `--devices LIST`, the old
    spelling, still works and says so in one line on stderr."""
    new = run_cli(
        "check", EXAMPLE, "--model", MODEL, "--device-counts", "2", "8", "--format", "json"
    )
    assert new.err == ""
    one = run_cli("check", EXAMPLE, "--model", MODEL, "--simulate", "2", "--format", "json")
    assert one.err == ""
    assert [c["devices"] for c in json.loads(one.out)["checks"]] == [2]
    old = run_cli("check", EXAMPLE, "--model", MODEL, "--devices", "2", "8", "--format", "json")
    assert old.err == "eqshard check: --devices 2 8 is deprecated: pass --device-counts 2 8\n"
    assert json.loads(old.out) == json.loads(new.out)
    both = run_cli("check", EXAMPLE, "--model", MODEL, "--simulate", "2", "--device-counts", "8")
    assert both.code == 2
    assert "not allowed with argument" in both.err


def test_check_batch_old_and_new_spellings(run_cli):
    """`--batch EXPR` is the layout and `--make-batch MODULE:CALLABLE` the builder;
    `--batch MODULE:CALLABLE` and `--batch-spec EXPR` still work, each with a notice."""
    from eqshard._cli._commands import batch_options
    from eqshard._cli._parser import parser

    def read(*args):
        args = parser().parse_args(["check", "s.json", "--model", "m:b", "--step", "m:s", *args])
        batch_options("check", args)
        return args.make_batch, args.batch

    assert read("--make-batch", "m:batch", "--batch", "b ... -> b* ...") == (
        "m:batch",
        "b ... -> b* ...",
    )
    assert read("--batch", "m:batch", "--batch-spec", "b ... -> b* ...") == (
        "m:batch",
        "b ... -> b* ...",
    )
    result = run_cli("check", EXAMPLE, "--model", MODEL, "--batch", "m:batch")
    assert result.code == 2
    assert result.err.splitlines()[0] == (
        "eqshard check: --batch m:batch is deprecated: pass --make-batch m:batch (--batch is "
        "the layout)"
    )
    assert "--make-batch is for the step: name it with --step" in result.err
    result = run_cli("check", EXAMPLE, "--model", MODEL, "--step", "m:s")
    assert result.code == 2
    assert "--step needs --make-batch MODULE:CALLABLE" in result.err
    spec = run_cli("check", EXAMPLE, "--model", MODEL, "--batch-spec", "b ... -> b* ...")
    assert spec.err.splitlines()[0] == (
        "eqshard check: --batch-spec is deprecated: pass --batch 'b ... -> b* ...'"
    )
    both = run_cli("check", EXAMPLE, "--model", MODEL, "--batch", "m:b", "--make-batch", "m:b")
    assert both.code == 2
    assert "--make-batch and --batch m:b both name the batch's builder" in both.err
