"""The command line under bad input: literal text, one JSON document, fixed exit codes.

Each test here failed before the fix it guards. The README's promises point here.
"""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eqshard._cli._main import main

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
    result = run_cli("check", spec, "--model", f"{model}:build", "--devices", "8")
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
        (["check", "s.json", "--model", "m:b", "--devices", "\u0664"], "is not a whole number"),
    ],
)
def test_device_counts_are_capped_and_ascii(run_cli, args, message):
    result = run_cli(*args)
    assert result.code == 2
    assert message in result.err
