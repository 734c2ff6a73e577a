"""`eqshard show` and `demo`, and the command line's usage errors.

Most tests run the command line in this process (`run_cli`, on its 8 CPU
devices); a few run it as a user does, in a subprocess: the console script, bad
usage under `python -m eqshard`, and the demo on 4 devices.
"""

import runpy
import shutil
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


def _cells(text):
    """The cells of each row of the rich tables in `text`, stripped."""
    return [
        [cell.strip() for cell in line.strip().strip("│").split("│")]
        for line in text.splitlines()
        if line.startswith("│")
    ]


def test_console_script_draws_einshards_documented_picture(run_python):
    beside = Path(sys.executable).parent / "eqshard"
    script = str(beside) if beside.exists() else shutil.which("eqshard")
    args = ["show", "a b -> 2 a2* b*", "--shape", "4", "8", "--devices", "16"]
    if script is not None:  # the script itself, in the clean environment of `run_python`
        call = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"
        result = run_python(["-c", call, script, *args])
    else:
        result = run_python(["-m", "eqshard", *args])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "shape       (4, 8) on 16 CPU devices" in out
    assert "mesh        _0=2, a=4, b=2 (row-major over device ids)" in out
    assert "spec        P('a', 'b')" in out
    assert "per device  (1, 4): 8 blocks, each on 2 devices" in out
    # einshard's docs draw this block grid for the same expression on 16 devices.
    assert _cells(out)[:8] == [
        ["(0, 0)", "[0:1, 0:4]", "CPU 0,8"],
        ["(0, 1)", "[0:1, 4:8]", "CPU 1,9"],
        ["(1, 0)", "[1:2, 0:4]", "CPU 2,10"],
        ["(1, 1)", "[1:2, 4:8]", "CPU 3,11"],
        ["(2, 0)", "[2:3, 0:4]", "CPU 4,12"],
        ["(2, 1)", "[2:3, 4:8]", "CPU 5,13"],
        ["(3, 0)", "[3:4, 0:4]", "CPU 6,14"],
        ["(3, 1)", "[3:4, 4:8]", "CPU 7,15"],
    ]
    assert "│ (3, 1) │ [3:4, 4:8]  │ CPU 7,15 │" in out
    if script is None:
        pytest.skip("the eqshard console script is not installed; ran `python -m eqshard`")


def test_show_three_dimensions_on_default_devices(run_cli):
    result = run_cli("show", "a b c -> a2* b c*", "--shape", "4", "16", "8")
    assert result.code == 0, result.err
    assert "shape       (4, 16, 8) on 8 CPU devices" in result.out
    assert "per device  (1, 16, 4): 8 blocks, each on 1 device" in result.out
    assert _cells(result.out)[0] == ["(0, 0, 0)", "[0:1, 0:16, 0:4]", "CPU 0"]
    assert _cells(result.out)[7] == ["(3, 0, 1)", "[3:4, 0:16, 4:8]", "CPU 7"]


def test_show_zero_sized_dimension(run_cli):
    result = run_cli("show", "a b -> a b*", "--shape", "0", "8", "--devices", "8")
    assert result.code == 0, result.err
    assert "per device  (0, 1): 8 blocks, each on 1 device" in result.out
    assert _cells(result.out)[-1] == ["(0, 7)", "[0:0, 7:8]", "CPU 7"]


def test_show_bad_expression_exits_1_without_traceback(run_cli):
    result = run_cli("show", "a b -> a c", "--shape", "4", "8")
    assert result.code == 1
    assert result.err.splitlines() == [
        "eqshard show: error: bad einshard expression:",
        "    a b -> a c",
        "             ^",
        "axis 'c' is on the right but not on the left; add it to the left, or drop its name to replicate instead",
    ]


def test_show_device_count_that_does_not_fit_exits_1(run_cli):
    result = run_cli("show", "a b -> a4 b4", "--shape", "4", "8")
    assert result.code == 1
    assert result.err.splitlines()[-1] == (
        "a4 x b4 = 16 shards need 16 devices, 8 are given; choose counts whose product "
        "is 8, or use '*' to take a share"
    )


def test_show_after_jax_started_reports_the_device_count_it_has(run_cli):
    # In a process whose JAX is up, `--devices` cannot change the count; it says so.
    result = run_cli("show", "a -> a*", "--shape", "8", "--devices", "2")
    assert result.code == 1
    assert result.err == (
        "eqshard show: error: asked for 2 simulated devices, but JAX had already started with 8\n"
    )
    assert run_cli("show", "a -> a*", "--shape", "8", "--devices", "8").code == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["show", "a -> a*"], "the following arguments are required: --shape"),
        (["show", "a -> a*", "--shape", "x"], "'x' is not a whole number"),
        (["show", "a -> a*", "--shape", "4", "--devices", "0"], "'0' must be 1 or more"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_usage_exits_2(run_cli, args, message):
    result = run_cli(*args)
    assert result.code == 2
    assert message in result.err
    assert result.err.startswith("usage: eqshard")


def test_python_m_eqshard_bad_usage_exits_2_without_traceback(run_python):
    result = run_python(["-m", "eqshard", "show", "a -> a*", "--shape", "x"])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        "eqshard show: error: argument --shape: 'x' is not a whole number (digits 0-9)"
    )


@pytest.mark.slow  # the demo: trains a strategy
def test_demo_trains_a_strategy_from_its_spec_file(run_python, tmp_path):
    """`python -m eqshard demo` as a user runs it, from another directory: it finds
    its spec files, trains FSDP on 4 simulated devices and prints the table."""
    run_elsewhere = (  # `python -m eqshard ...`, in the directory given first
        "import os, runpy, sys; os.chdir(sys.argv.pop(1)); "
        "runpy.run_module('eqshard', run_name='__main__', alter_sys=True)"
    )
    args = ["demo", "--spec", "fsdp", "--devices", "4", "--steps", "2"]
    result = run_python(["-c", run_elsewhere, str(tmp_path), *args])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "2 steps on 4 CPU devices" in out
    rows = {cells[0]: cells for cells in _cells(out) if cells[0]}
    assert rows["unsharded"][3:5] == ["457.0 KiB", "914.0 KiB"]
    # a quarter of the parameters and of the AdamW moments (and the step count)
    assert rows["fsdp"][1:5] == ["data=4", "split over data", "114.2 KiB", "228.5 KiB"]
    assert rows["fsdp"][7].startswith("yes (")
    assert "every strategy trains to the unsharded losses" in out


def test_demo_names_what_it_cannot_run(run_cli):
    result = run_cli("demo", "--spec", "ring-attention")
    assert result.code == 2
    assert "no such strategy or file; the strategies are data-parallel, zero-1, fsdp" in result.err
    result = run_cli("demo", "--spec", "2d", "--devices", "2")
    assert result.code == 1
    assert "needs a multiple of 4 devices" in result.err


def test_example_reproduces_einshards_mlp(capsys):
    runpy.run_path(str(EXAMPLES / "mlp_tensor_parallel.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "w1 (128, 256): x y -> x y*" in out
    assert "(None, 'm0'), each device holds (128, 32)" in out
    assert "('m0', None), each device holds (32, 64)" in out
    assert "compiled program: 1 all-reduce, 0 all-gather" in out
