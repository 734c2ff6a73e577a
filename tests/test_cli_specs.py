"""`eqshard validate`, `check` and `schema`, run as a user runs them."""

import json
from pathlib import Path

import pytest

import eqshard

ROOT = Path(__file__).parent.parent
SPECS = Path(__file__).parent / "specs"
EXAMPLE = ROOT / "examples" / "specs" / "transformer.eqshard.json"
MODEL = f"{ROOT / 'examples' / 'transformer.py'}:build"


def _run(run_python, *args):
    result = run_python(["-m", "eqshard", *map(str, args)])
    assert "Traceback" not in result.stderr, result.stderr
    return result


def test_validate_valid_files(run_python):
    files = [*sorted((SPECS / "valid").glob("*.json")), EXAMPLE]
    result = _run(run_python, "validate", *files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        f"ok: {SPECS / 'valid' / 'full.eqshard.json'} (3 rules)",
        f"ok: {SPECS / 'valid' / 'minimal.eqshard.json'} (0 rules)",
        f"ok: {SPECS / 'valid' / 'unicode.eqshard.json'} (1 rule)",
        f"ok: {EXAMPLE} (7 rules)",
    ]


def test_validate_reports_file_and_json_path(run_python):
    path = SPECS / "invalid" / "expressions.eqshard.json"
    result = _run(run_python, "validate", SPECS / "valid" / "minimal.eqshard.json", path)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[1] == (
        f"{path}::$.rules[0].expr: axis 'z' is on the right but not on the left; add it to "
        "the left, or drop its name to replicate instead"
    )
    assert lines[2:4] == ["    x y -> x z", "             ^"]
    assert f"{path}::$.rules[1].expr: a count of 0 is not allowed; counts start at 1" in lines


def test_validate_json_format(run_python):
    path = SPECS / "invalid" / "structure.eqshard.json"
    result = _run(
        run_python, "validate", "--format", "json", path, SPECS / "valid" / "full.eqshard.json"
    )
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False
    assert [f["ok"] for f in report["files"]] == [False, True]
    first = report["files"][0]["problems"][0]
    assert first == {
        "file": str(path),
        "path": "$",
        "message": "unknown key 'model'; the keys here are '$schema', 'eqshard', 'comment', 'devices', 'default', 'rules', 'dims'",
    }
    assert len(report["files"][0]["problems"]) == 10


def test_validate_unreadable_file_exits_2(run_python, tmp_path):
    result = _run(run_python, "validate", tmp_path / "nope.json")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"{tmp_path / 'nope.json'}: cannot read it: No such file or directory"
    )


def test_validate_broken_json_exits_1_with_line_and_column(run_python):
    path = SPECS / "invalid" / "broken.eqshard.json"
    result = _run(run_python, "validate", path)
    assert result.returncode == 1
    assert (
        result.stdout.strip()
        == f"{path}::line 4, column 37: invalid JSON: Expecting property name enclosed in double quotes"
    )


def test_check_example_on_several_device_counts(run_python):
    result = _run(run_python, "check", EXAMPLE, "--model", MODEL, "--devices", "2", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"{EXAMPLE} on 2 devices: ok" in out
    assert f"{EXAMPLE} on 8 devices: ok" in out
    assert (
        "│ blocks.1.up.weight               │ [256, 64] │ float32 │ o i -> o* i                 │ $.rules[4] │    8.0 KiB │"
        in out
    )
    assert (
        "│ unembed.w                        │ [256, 64] │ float32 │ vocab embed -> vocab* embed │ dims       │    8.0 KiB │"
        in out
    )
    assert (
        "28 array leaves: 14 by rules, 1 by dims, 13 by the default; each device holds 123.2 KiB"
        in out
    )


def test_check_fails_where_dims_do_not_divide(run_python):
    result = _run(run_python, "check", EXAMPLE, "--model", MODEL, "--devices", "6")
    assert result.returncode == 1
    assert (
        ".blocks[0].up.weight (Linear.weight): float32[256, 64] 'o i -> o* i': axis 'o' (dimension 0 "
        "of shape (256, 64)) has size 256, which does not split into 6 equal shards; choose a "
        "count that divides 256"
    ) in result.stdout.splitlines()
    assert f"{EXAMPLE} on 6 devices: 15 problem(s)" in result.stdout


@pytest.fixture
def spec_file(tmp_path):
    def write(document):
        path = tmp_path / "spec.eqshard.json"
        path.write_text(json.dumps(document))
        return path

    return write


def test_check_strict_unused_rule_and_default_error(run_python, spec_file):
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
    result = _run(run_python, "check", path, "--model", MODEL)
    assert result.returncode == 1
    assert (
        f"warning: {path}::$.rules[1]: rule '**.nowhere' matched no leaf of the model"
        in result.stdout
    )
    assert (
        "embed.weight: no rule or dim matches this leaf, and "
        f'{path} says "default": "error"; add a rule for \'embed.weight\', or set "default": "replicate"'
    ) in result.stdout.splitlines()

    path = spec_file({"eqshard": 1, "rules": [{"path": "**.nowhere", "expr": "a -> a*"}]})
    relaxed = _run(run_python, "check", path, "--model", MODEL)
    assert relaxed.returncode == 0
    strict = _run(run_python, "check", path, "--model", MODEL, "--strict")
    assert strict.returncode == 1
    assert (
        f"{path}::$.rules[0]: rule '**.nowhere' matched no leaf of the model (--strict)"
        in strict.stdout
    )


def test_check_device_count_that_does_not_fit(run_python, spec_file):
    path = spec_file(
        {"eqshard": 1, "devices": 8, "rules": [{"path": "**.up.weight", "expr": "o i -> o2 i4"}]}
    )
    result = _run(
        run_python, "check", path, "--model", MODEL, "--devices", "8", "4", "--format", "json"
    )
    assert result.returncode == 1
    checks = json.loads(result.stdout)["checks"]
    assert [c["devices"] for c in checks] == [8, 4]
    assert [c["ok"] for c in checks] == [True, False]
    messages = [p["message"] for p in checks[1]["problems"]]
    assert (
        messages[0]
        == 'the spec was written for 8 devices, and this check runs on 4; change "devices", or drop it to allow any count'
    )
    assert "o2 x i4 = 8 shards need 8 devices, 4 are given" in messages[1]
    assert checks[0]["coverage"] == {"rules": 2, "dims": 0, "default": 26}
    assert checks[0]["bytes_per_device"] == sum(
        leaf["bytes_per_device"] for leaf in checks[0]["leaves"]
    )


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("nope", "--model 'nope': write MODULE:CALLABLE"),
        ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
        (f"{ROOT / 'examples' / 'transformer.py'}:nothing", "has no callable 'nothing'"),
    ],
)
def test_check_bad_model_argument(run_python, model, message):
    result = _run(run_python, "check", EXAMPLE, "--model", model)
    assert result.returncode == 1
    assert message in result.stderr


def test_check_model_that_fails_is_reported_without_a_traceback(run_python, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def build(:\n")
    result = _run(run_python, "check", EXAMPLE, "--model", f"{broken}:build")
    assert result.returncode == 1
    assert "raised SyntaxError" in result.stderr
    failing = tmp_path / "failing.py"
    failing.write_text("def build():\n    raise RuntimeError('no weights here')\n")
    result = _run(run_python, "check", EXAMPLE, "--model", f"{failing}:build")
    assert result.returncode == 1
    assert "build() raised RuntimeError: no weights here" in result.stderr


def test_schema_command_prints_the_schema(run_python):
    result = _run(run_python, "schema")
    assert result.returncode == 0
    assert json.loads(result.stdout) == eqshard.schema()


def test_pre_commit_hook_is_declared():
    text = (ROOT / ".pre-commit-hooks.yaml").read_text()
    assert "- id: eqshard-validate" in text
    assert "entry: eqshard validate" in text
    assert r"files: \.eqshard\.json$" in text


def test_training_script_applies_the_example_spec(run_python):
    result = run_python([str(ROOT / "examples" / "transformer.py")])
    assert result.returncode == 0, result.stderr
    losses = [
        float(line.split()[-1]) for line in result.stdout.splitlines() if line.startswith("step")
    ]
    assert len(losses) == 5
    assert losses[-1] < losses[0]
    assert result.stdout.splitlines()[-4:] == [
        "blocks[0].up.weight (256, 64): each device holds (32, 64)",
        "its Adam moment (256, 64): each device holds (32, 64)",
        "unembed.w (from dims) (256, 64): each device holds (32, 64)",
        "norm.weight (default) (64,): each device holds (64,)",
    ]
