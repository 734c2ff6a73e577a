import shutil
import sys
from pathlib import Path

import pytest


def _eqshard(run_python, *args):
    return run_python(["-m", "eqshard", *args])


def test_show_draws_einshards_documented_picture(run_python):
    result = _eqshard(run_python, "show", "a b -> 2 a2* b*", "--shape", "4", "8", "--devices", "16")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "mesh        _0=2, a=4, b=2 (row-major over device ids)" in out
    assert "spec        P('a', 'b')" in out
    assert "per device  (1, 4): 8 blocks, each on 2 devices" in out
    # einshard's docs draw this block grid for the same expression on 16 devices.
    for row in ["CPU 0,8", "CPU 1,9", "CPU 2,10", "CPU 3,11", "CPU 6,14", "CPU 7,15"]:
        assert row in out
    assert "│ (3, 1) │ [3:4, 4:8]  │ CPU 7,15 │" in out


def test_show_three_dimensions_on_default_devices(run_python):
    result = _eqshard(run_python, "show", "a b c -> a2* b c*", "--shape", "4", "16", "8")
    assert result.returncode == 0, result.stderr
    assert "on 8 CPU devices" in result.stdout
    assert "│ (0, 0, 0) │ [0:1, 0:16, 0:4] │ CPU 0   │" in result.stdout


def test_show_zero_sized_dimension(run_python):
    result = _eqshard(run_python, "show", "a b -> a b*", "--shape", "0", "8", "--devices", "2")
    assert result.returncode == 0, result.stderr
    assert "per device  (0, 4)" in result.stdout


def test_show_bad_expression_exits_1_without_traceback(run_python):
    result = _eqshard(run_python, "show", "a b -> a c", "--shape", "4", "8")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "eqshard show: error: bad einshard expression:",
        "    a b -> a c",
        "             ^",
        "axis 'c' is on the right but not on the left; add it to the left, or drop its name to replicate instead",
    ]


def test_show_device_count_that_does_not_fit_exits_1(run_python):
    result = _eqshard(run_python, "show", "a b -> a2 b4", "--shape", "4", "8", "--devices", "6")
    assert result.returncode == 1
    assert "a2 x b4 = 8 shards need 8 devices, 6 are given" in result.stderr


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
def test_bad_usage_exits_2(run_python, args, message):
    result = _eqshard(run_python, *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_console_script(run_python):
    script = Path(sys.executable).parent / "eqshard"
    if not script.exists():
        script = shutil.which("eqshard")
    if script is None:
        pytest.skip("the eqshard console script is not installed in this environment")
    result = run_python(
        [
            "-c",
            "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))",
            str(script),
            "show",
            "x y -> x y*",
            "--shape",
            "4",
            "8",
            "--devices",
            "2",
        ]
    )
    assert result.returncode == 0, result.stderr
    assert "CPU 0" in result.stdout


def test_demo_trains_one_step_and_agrees(run_python):
    result = _eqshard(run_python, "demo", "--devices", "4")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "a transformer block on 4 CPU devices, tensor parallel (mesh {'m0': 4})" in out
    assert (
        "│ .attn.query_proj.weight  │ [64, 64]  │ float32 │ o i -> o* i │ P('m0', None) │    4.0 KiB │"
        in out
    )
    assert "parameters keep their layouts through the step: True" in out
    assert "sharded and unsharded agree" in out


def test_example_reproduces_einshards_mlp(run_python):
    example = Path(__file__).parent.parent / "examples" / "mlp_tensor_parallel.py"
    result = run_python([str(example)])
    assert result.returncode == 0, result.stderr
    assert "w1 (128, 256): x y -> x y*" in result.stdout
    assert "(None, 'm0'), each device holds (128, 32)" in result.stdout
    assert "('m0', None), each device holds (32, 64)" in result.stdout
    assert "compiled program: 1 all-reduce, 0 all-gather" in result.stdout
