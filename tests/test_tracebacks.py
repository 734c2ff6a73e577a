"""Errors in the user's own code keep their cause and show the user's frames.

A `build()` that divides by zero, or a step whose model raises in `__call__`, is
said with the user's file, line and source line, eqshard's and JAX's frames left
out: by the command line as a user runs it (`python -m eqshard`, its work in
worker processes), in this process (`run_cli`), and by the library, whose error
keeps the user's as its `__cause__`. `--traceback` or `EQSHARD_TRACEBACK=1`
prints the whole traceback of any error.
"""

import importlib
import json
import pickle
import sys
import traceback
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqshard
from eqshard._cli import _main
from eqshard._process._usercode import abstract_model, call, user_frames

PACKAGE = str(Path(eqshard.__file__).parent)

USER_CODE = """\
import equinox as eqx
import jax
import jax.numpy as jnp


def helper():
    return 1 / 0


def build():
    return helper()


class Net(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        raise ValueError("bad input shape")


def build_net():
    return Net(jnp.ones((8, 4)))


def batch():
    return jnp.ones((16, 4))


def step(model, batch):
    return model(batch)
"""
DIVIDES = 7  # the line of `return 1 / 0`
CALLS_HELPER = 11  # `return helper()`
RAISES = 18  # `raise ValueError("bad input shape")`
CALLS_MODEL = 30  # `return model(batch)`

SPEC = json.dumps({"eqshard": 1, "rules": [{"path": "w", "expr": "a b -> a* b"}]})


@pytest.fixture
def user(tmp_path, monkeypatch):
    """The user's module as a file, `eqshard_traceback_user.py` (importable by
    name in this process and its workers), and a spec file beside it."""
    path = tmp_path / "eqshard_traceback_user.py"
    path.write_text(USER_CODE)
    (tmp_path / "spec.json").write_text(SPEC)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "eqshard_traceback_user", raising=False)
    yield path
    sys.modules.pop("eqshard_traceback_user", None)


def _names_the_users_frames(text, path, *lines):
    """Each `(line number, source)` of the user's file named in `text`, in order."""
    places = [text.index(f"{path}:{number}") for number, _ in lines]
    assert places == sorted(places), text
    for _, source in lines:
        assert f"    {source}\n" in text + "\n", text


BUILD_FRAMES = ((CALLS_HELPER, "return helper()"), (DIVIDES, "return 1 / 0"))
STEP_FRAMES = (
    (CALLS_MODEL, "return model(batch)"),
    (RAISES, 'raise ValueError("bad input shape")'),
)


def _check(run_python, user, *args, env=None):
    spec = user.parent / "spec.json"
    return run_python(["-m", "eqshard", "check", str(spec), *map(str, args)], env=env)


# The command line, as a user runs it: the work in worker processes -------------


@pytest.mark.slow  # a fresh interpreter: imports JAX and compiles
def test_a_build_that_raises_names_the_users_file_and_line(run_python, user):
    result = _check(run_python, user, "--model", f"{user}:build")
    assert result.returncode == 2, result.stderr
    err = result.stderr
    assert (
        f"eqshard check: error: --model '{user}:build': build() raised ZeroDivisionError: "
        "division by zero\nin the user's code (most recent call last):\n"
    ) in err
    _names_the_users_frames(err, user, *BUILD_FRAMES)
    assert "Traceback" not in err
    assert PACKAGE not in err  # no frame of eqshard
    assert "site-packages" not in err  # nor of JAX or Equinox


@pytest.mark.slow  # a fresh interpreter: imports JAX and compiles
def test_a_step_that_raises_in_the_models_call_names_the_users_lines(run_python, user):
    result = _check(
        run_python,
        user,
        *(
            "--model",
            f"{user}:build_net",
            "--step",
            f"{user}:step",
            "--make-batch",
            f"{user}:batch",
        ),
        *("--device-counts", "2"),
    )
    assert result.returncode == 2, result.stderr
    assert "raised ValueError: bad input shape\n" in result.stderr
    _names_the_users_frames(result.stderr, user, *STEP_FRAMES)
    assert "Traceback" not in result.stderr
    assert PACKAGE not in result.stderr


@pytest.mark.slow  # a fresh interpreter: imports JAX and compiles
@pytest.mark.parametrize("how", ["--traceback", "EQSHARD_TRACEBACK=1", "after the command"])
def test_the_whole_traceback_on_request(run_python, user, how):
    args = ["--model", f"{user}:build"]
    if how == "--traceback":
        command = ["-m", "eqshard", "--traceback", "check", str(user.parent / "spec.json"), *args]
        result = run_python(command)
    elif how == "after the command":
        result = _check(run_python, user, *args, "--traceback")
    else:
        result = _check(run_python, user, *args, env={"EQSHARD_TRACEBACK": "1"})
    assert result.returncode == 2, result.stderr
    err = result.stderr
    assert err.startswith("eqshard._process._worker_errors.WorkerTraceback: \n")  # the worker's
    # the worker's: the user's error, then the ModelError; then this process's
    assert err.count("Traceback (most recent call last):") == 3
    assert f'File "{user}", line {DIVIDES}, in helper' in err
    assert f"{PACKAGE}/_process/_usercode.py" in err  # eqshard's frames too
    assert err.rstrip().endswith(
        "eqshard check: error: --model "
        f"'{user}:build': build() raised ZeroDivisionError: division by zero"
    )


@pytest.mark.slow  # a fresh interpreter: imports JAX and compiles
def test_a_syntax_error_names_the_line_and_its_text(run_python, user):
    user.write_text("def build(:\n    return 1\n")
    result = _check(run_python, user, "--model", f"{user}:build")
    assert result.returncode == 2, result.stderr
    assert "raised SyntaxError" in result.stderr
    assert f"  {user}:1\n    def build(:\n" in result.stderr


def test_eqshards_own_errors_print_a_traceback_only_on_request(run_python, user):
    missing = user.parent / "missing.json"
    args = ["-m", "eqshard", "check", str(missing), "--model", f"{user}:build"]
    result = run_python(args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    result = run_python([*args, "--format", "json"], env={"EQSHARD_TRACEBACK": "1"})
    assert result.returncode == 2
    assert result.stderr.startswith("Traceback (most recent call last):")
    assert "eqshard.UnreadableError" in result.stderr
    document = json.loads(result.stdout)
    assert document["error"]["traceback"].startswith("Traceback (most recent call last):")
    assert "cannot read it" in document["error"]["message"]


# The command line in this process ------------------------------------------------


def test_in_process_the_users_frames_and_on_request_the_traceback(run_cli, user):
    spec = user.parent / "spec.json"
    result = run_cli("check", spec, "--model", f"{user}:build")
    assert result.code == 2
    _names_the_users_frames(result.err, user, *BUILD_FRAMES)
    assert "Traceback" not in result.err
    assert PACKAGE not in result.err
    step = (
        "--step",
        f"{user}:step",
        "--make-batch",
        f"{user}:batch",
        "--device-counts",
        "8",
    )  # JAX's
    result = run_cli("check", spec, "--model", f"{user}:build_net", *step)
    assert result.code == 2
    assert "raised ValueError: bad input shape\nin the user's code" in result.err
    _names_the_users_frames(result.err, user, *STEP_FRAMES)
    assert PACKAGE not in result.err
    result = run_cli("--traceback", "check", spec, "--model", f"{user}:build")
    assert result.code == 2
    assert "ZeroDivisionError: division by zero\n" in result.err
    assert "The above exception was the direct cause of the following exception" in result.err
    assert f'File "{user}", line {DIVIDES}, in helper' in result.err


def test_a_bug_in_eqshard_prints_its_traceback_on_request(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setitem(_main._COMMANDS, "schema", broken)
    assert _main.main(["schema"]) == 2
    err = capsys.readouterr().err
    assert "eqshard schema: internal error: RuntimeError: a bug\n" in err
    assert "its traceback (--traceback)" in err
    assert "Traceback" not in err
    assert _main.main(["schema", "--traceback"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert 'raise RuntimeError("a bug")' in err
    assert err.rstrip().endswith("with the command that caused it and the traceback above.")


# The library -----------------------------------------------------------------------


def test_the_users_error_is_the_cause_and_its_frames_a_note(user):
    with pytest.raises(eqshard.ModelError) as raised:
        abstract_model(f"{user}:build")
    error = raised.value
    assert isinstance(error.__cause__, ZeroDivisionError)
    assert str(error) == (
        f"--model '{user}:build': build() raised ZeroDivisionError: division by zero"
    )
    text = "".join(traceback.format_exception_only(error))
    _names_the_users_frames(text, user, *BUILD_FRAMES)
    assert PACKAGE not in text
    assert user_frames(error) == user_frames(error.__cause__)


def test_call_notes_a_user_function_of_any_file(tmp_path):
    def divides():
        return 1 / 0

    with pytest.raises(eqshard.ModelError) as raised:
        call("--make-batch", "here:divides", "divides()", divides)
    assert isinstance(raised.value.__cause__, ZeroDivisionError)
    [note] = raised.value.__notes__
    assert f"{__file__}:" in note
    assert "    return 1 / 0" in note


def _step_arguments(module):
    model = eqx.filter_eval_shape(module.build_net)
    return model, jax.ShapeDtypeStruct((16, 4), jnp.float32)


def test_cost_keeps_the_steps_error_as_its_cause(user):
    module = importlib.import_module("eqshard_traceback_user")
    model, batch = _step_arguments(module)
    with pytest.raises(eqshard.StepError) as raised:
        eqshard.cost(model, batch, step=module.step, spec="... -> * ...", devices=8)
    assert isinstance(raised.value.__cause__, ValueError)
    text = user_frames(raised.value)
    assert text is not None
    _names_the_users_frames(text, user, *STEP_FRAMES)
    [note] = raised.value.__notes__  # in this process too, the message shows them
    assert note == text


@pytest.mark.slow  # compiles in worker processes
def test_cost_in_a_worker_brings_the_users_frames_back(user):
    module = importlib.import_module("eqshard_traceback_user")
    model, batch = _step_arguments(module)
    with pytest.raises(eqshard.StepError) as raised:  # 16 devices: a worker of its own
        eqshard.cost(model, batch, step=module.step, spec="... -> * ...", simulate=16)
    error = raised.value
    text = "".join(traceback.format_exception_only(error))
    assert "it raised ValueError: bad input shape\nin the user's code" in text
    _names_the_users_frames(text, user, *STEP_FRAMES)
    assert PACKAGE not in text
    remote = str(error.__cause__)  # the worker's whole traceback, as its cause
    assert type(error.__cause__).__name__ == "WorkerTraceback"
    assert f'File "{user}", line {RAISES}, in __call__' in remote


def test_jax_tracebacks_leave_eqshards_frames_out():
    def layout(x):
        return eqshard.constrain(x, "a -> b")

    with pytest.raises(eqshard.ExpressionError) as raised:
        jax.jit(layout)(jnp.ones(8))
    files = [frame.filename for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert files[-1] == __file__  # the user's line that called eqshard, last
    assert not [name for name in files if name.startswith(PACKAGE)]


class _Refused(KeyError):  # a user's own exception, with KeyError's quoting of its text
    pass


def test_a_step_error_is_also_the_class_of_what_the_step_raised():
    def step(w):
        raise _Refused("no such layer")

    w = jnp.ones((8, 4))
    with pytest.raises(_Refused) as raised:  # `except` on the user's own class works
        eqshard.cost(w, step=step, spec="a b -> a* b", devices=8)
    error = raised.value
    assert isinstance(error, eqshard.StepError)
    assert isinstance(error, ValueError)  # and on eqshard's, which is a ValueError
    assert isinstance(error.__cause__, _Refused)
    shown = traceback.format_exception_only(error)[0]
    assert shown.startswith(f"eqshard.StepError[{_Refused.__qualname__}]: `eqshard.cost` cannot")
    assert "it raised _Refused: 'no such layer'" in shown  # the text unquoted: not KeyError's
    assert "'`eqshard.cost" not in shown
    again = pickle.loads(pickle.dumps(error))  # as a worker sends it back
    assert type(again) is type(error)
    assert str(again) == str(error)


class _TwoPart(Exception):  # an exception built from two arguments, not a message
    def __init__(self, layer, reason):
        super().__init__(f"{layer}: {reason}")


def test_a_step_error_of_a_class_built_otherwise_still_shows_it():
    def step(w):
        raise _TwoPart("layers.0", "refused")

    with pytest.raises(_TwoPart) as raised:
        eqshard.cost(jnp.ones((8, 4)), step=step, spec="a b -> a* b", devices=8)
    assert isinstance(raised.value, eqshard.StepError)
    assert "it raised _TwoPart: layers.0: refused" in str(raised.value)


def test_a_step_error_stays_plain_for_what_is_not_an_exception():
    def step(w):
        raise SystemExit(3)  # a BaseException: no `except Exception` should catch it

    with pytest.raises(eqshard.StepError) as raised:
        eqshard.cost(jnp.ones((8, 4)), step=step, spec="a b -> a* b", devices=8)
    assert type(raised.value) is eqshard.StepError
    assert isinstance(raised.value.__cause__, SystemExit)
