"""The command line under bad input: literal text, one JSON document, fixed exit codes.

Each test here failed before the fix it guards. The README's promises point here.
"""

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import pytest

from eqshard import EqshardError
from eqshard._cli._main import main
from eqshard._process._usercode import abstract_model

VALID = json.dumps({"eqshard": 1, "rules": [{"path": "**.w", "expr": "a -> a*"}]})
INVALID = json.dumps({"eqshard": 1, "rules": [{"path": "**.w", "expr": "a -> b"}]})

MODEL = """
import asyncio
import jax.numpy as jnp

print("a model that talks on stdout")

def build():
    print("and again")
    return {KEY: jnp.ones(8)}

def cancelled():
    raise asyncio.CancelledError("stop")
"""


def _model(tmp_path: Path, key: str = "w") -> Path:
    path = tmp_path / "talking_model.py"
    path.write_text(MODEL.replace("KEY", repr(key)))
    return path


def _file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_model_raising_a_base_exception_exits_2_without_a_traceback(run_cli, tmp_path):
    spec = _file(tmp_path, "s.json", VALID)
    result = run_cli("check", spec, "--model", f"{_model(tmp_path)}:cancelled")
    assert result.code == 2
    assert "cancelled() raised CancelledError: stop" in result.err
    assert "Traceback" not in result.err


def test_markup_and_escape_sequences_are_printed_literally(run_cli, tmp_path):
    spec = _file(tmp_path, "[bold]spec[red].json", VALID)
    model = _model(tmp_path, key="[/red]\x1b[31mw")
    result = run_cli("check", spec, "--model", f"{model}:build", "--device-counts", "8")
    assert result.code == 0, result.err
    assert "[bold]spec[red].json on 8 devices: ok" in result.out
    assert "\x1b" not in result.out
    assert "\\x1b[31mw" in result.out  # the key's escape sequence, shown as text
    result = run_cli("validate", spec)
    assert result.out == f"ok: {spec} (1 rule)\n"


def test_json_output_is_one_document_when_the_model_prints(run_cli, tmp_path):
    spec = _file(tmp_path, "s.json", VALID)
    result = run_cli("check", spec, "--model", f"{_model(tmp_path)}:build", "--format", "json")
    assert result.code == 0
    assert json.loads(result.out)["ok"] is True
    assert "a model that talks on stdout" in result.err


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["check", "MISSING", "--model", "x:y", "--format", "json"], 2, "cannot read it"),
        (["check", "SPEC", "--model", "nope", "--format", "json"], 2, "write MODULE:CALLABLE"),
        (["check", "SPEC", "--format", "json"], 2, "the following arguments are required"),
        (["validate", "--format", "json"], 2, "the following arguments are required"),
    ],
)
def test_json_output_is_one_document_on_every_error(run_cli, tmp_path, args, code, message):
    spec = _file(tmp_path, "s.json", VALID)
    args = [
        str(spec) if a == "SPEC" else str(tmp_path / "missing.json") if a == "MISSING" else a
        for a in args
    ]
    result = run_cli(*args)
    assert result.code == code
    document = json.loads(result.out)
    assert document["ok"] is False
    assert message in document["error"]["message"]
    assert message in result.err


def test_file_names_with_double_colons_keep_their_json_path(run_cli, tmp_path):
    spec = _file(tmp_path, "odd::name.json", INVALID)
    result = run_cli("validate", spec, "--format", "json")
    [problem] = json.loads(result.out)["files"][0]["problems"]
    assert (problem["file"], problem["path"]) == (str(spec), "$.rules[0].expr")


def test_json_output_is_json_under_a_non_utf8_stdout(tmp_path):
    spec = _file(tmp_path, "café.json", INVALID)
    result = subprocess.run(
        [sys.executable, "-m", "eqshard", "validate", str(spec), "--format", "json"],
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": "latin-1"},
        timeout=60,
    )
    assert result.returncode == 1
    document = json.loads(result.stdout.decode("ascii"))
    assert document["files"][0]["file"] == str(spec)


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        raise io.UnsupportedOperation("no file descriptor")


@pytest.mark.parametrize(("text", "code"), [(VALID, 0), (INVALID, 1)])
def test_a_closed_pipe_does_not_change_the_exit_code(tmp_path, monkeypatch, text, code):
    spec = _file(tmp_path, "s.json", text)
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["validate", str(spec), str(spec)]) == code
    assert main(["validate", str(spec), "--format", "json"]) == code


def test_a_reader_that_goes_away_gets_the_same_exit_code(tmp_path):
    spec = _file(tmp_path, "s.json", INVALID)
    command = [sys.executable, "-m", "eqshard", "validate", *[str(spec)] * 200]
    for _ in range(3):
        reader = subprocess.Popen(
            ["head", "-c", "1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL
        )
        writer = subprocess.run(command, stdout=reader.stdin, stderr=subprocess.PIPE, timeout=60)
        assert reader.stdin is not None
        reader.stdin.close()
        reader.wait(timeout=10)
        assert writer.returncode == 1
        assert b"Traceback" not in writer.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--devices", "512"], "more than 64 simulated devices: the demo compiles"),
        (["show", "a -> a*", "--shape", "8", "--devices", "\u0668"], "is not a whole number"),
        (
            ["check", "s.json", "--model", "m:b", "--device-counts", "\u0664"],
            "is not a whole number",
        ),
    ],
)
def test_device_counts_are_capped_and_ascii(run_cli, args, message):
    result = run_cli(*args)
    assert result.code == 2
    assert message in result.err


def test_cli_survives_unprintable_text_and_odd_models(run_cli, tmp_path):
    spec = tmp_path / "s.eqshard.json"
    spec.write_text('{"eqshard": 1, "rules": [{"path": "w", "expr": "\\ud800 -> a"}]}')
    result = run_cli("validate", spec)
    assert result.code == 1
    assert "\\ud800" in result.out  # the lone surrogate, escaped rather than fatal
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(0)\n")
    ok = tmp_path / "ok.json"
    ok.write_text('{"eqshard": 1}')
    for model, message in [
        (f"{exits}:build", "raised SystemExit"),
        ("builtins:print", "holds no arrays"),
    ]:
        result = run_cli("check", ok, "--model", model)
        assert result.code == 2, result.out
        assert message in result.err
    json_py = tmp_path / "json.py"
    json_py.write_text("import jax.numpy as jnp\ndef build():\n    return {'w': jnp.ones(8)}\n")
    result = run_cli("check", ok, "--model", f"{json_py}:build", "--format", "json")
    assert result.code == 0, result.err
    assert [leaf["path"] for leaf in json.loads(result.out)["checks"][0]["leaves"]] == ["w"]
    result = run_cli("show", "a -> a*", "--shape", "8", "--devices", "99999999")
    assert result.code == 2
    assert "more than 4096 simulated devices" in result.err


# --------------------------------------------------------------------------- #
# The model a `--model MODULE:CALLABLE` names, as check loads it.
# --------------------------------------------------------------------------- #

MODEL_FILE = """
import asyncio
import equinox as eqx
import jax

print("the model file talks")

def build():
    print("so does build")
    return eqx.nn.Linear(4, 4, key=jax.random.key(0))

def cancelled():
    raise asyncio.CancelledError("stop")

def exits():
    raise GeneratorExit("done")
"""


def test_check_models_that_print_or_raise_base_exceptions(tmp_path: Path, capsys):
    path = tmp_path / "model_file.py"
    path.write_text(MODEL_FILE)
    model = abstract_model(f"{path}:build")
    assert isinstance(model, eqx.nn.Linear)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "the model file talks" in captured.err
    assert str(tmp_path) in sys.path  # its sibling modules import
    for name, raised in [("cancelled", "CancelledError: stop"), ("exits", "GeneratorExit: done")]:
        with pytest.raises(EqshardError, match=f"{name}\\(\\) raised {raised}"):
            abstract_model(f"{path}:{name}")
    assert issubclass(asyncio.CancelledError, BaseException)


def test_check_names_a_model_file_that_is_not_python(tmp_path: Path):
    text = tmp_path / "model.txt"
    text.write_text("build = None")
    with pytest.raises(EqshardError, match=r"'.*model\.txt' is not a Python file"):
        abstract_model(f"{text}:build")
