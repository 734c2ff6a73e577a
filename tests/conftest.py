from __future__ import annotations

import os

import jax

# Every test sees 8 CPU devices. This must happen before JAX starts a backend;
# other device counts run in subprocesses (see the `run_python` fixture).
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

TESTS = Path(__file__).parent

# Seconds of setup and call per test file, printed after the run beside a rough
# expectation (about 2.5 times what each took on a 2-core machine). Time is a
# benchmark's business (benchmarks/): a slow or loaded machine never fails the suite.
EXPECTED_SECONDS = {
    "README.md": 40.0,  # every code block, Orbax and a compiled step included
    "tests/test_demo.py": 100.0,  # 9 compiles: 5 training steps and 4 of eqshard.cost
    "tests/test_testing.py": 60.0,  # worker processes: each imports JAX and compiles
    "tests/test_cli.py": 50.0,
    "tests/test_suggest.py": 75.0,  # about 15 compiles, in worker processes
}
DEFAULT_EXPECTED_SECONDS = 30.0

_seconds_per_file: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when in ("setup", "call"):
        _seconds_per_file[report.nodeid.partition("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds_per_file:
        return
    write = terminalreporter.write_line
    terminalreporter.section("seconds per test file (setup + call), never a failure")
    for file, seconds in sorted(_seconds_per_file.items(), key=lambda item: -item[1])[:10]:
        expected = EXPECTED_SECONDS.get(file, DEFAULT_EXPECTED_SECONDS)
        note = "  (slower than expected: a loaded machine?)" if seconds > expected else ""
        write(f"{seconds:7.2f}  {file}{note}")


def _run_python(args, *, python=sys.executable, stdin=None, env=None, timeout=300):
    """Runs a Python subprocess with a clean JAX environment, and returns it."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    full_env.update(env or {})
    return subprocess.run(
        [python, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )


def _probe(impl, n_devices, cases, *, python=sys.executable):
    """Where each block goes for each `(expression, shape)`, on `n_devices` devices."""
    result = _run_python(
        [str(TESTS / "layout_probe.py"), impl, str(n_devices)],
        python=python,
        stdin=json.dumps(cases),
    )
    if result.returncode != 0:
        raise AssertionError(f"probe failed:\n{result.stderr}")
    return json.loads(result.stdout)


@pytest.fixture(scope="session")
def run_python():
    """`run_python(args, python=..., stdin=..., env=...)`: a subprocess, not checked."""
    return _run_python


@pytest.fixture(scope="session")
def probe():
    """`probe(impl, n_devices, cases)`: the blocks of each case, from a subprocess."""
    return _probe


@dataclasses.dataclass(frozen=True)
class CliResult:
    """What one in-process run of the command line returned and printed."""

    code: int
    out: str
    err: str


@pytest.fixture
def run_cli(capsys):
    """`run_cli(*args)`: runs `eqshard *args` in this process, on its 8 CPU devices.

    It returns the exit code with stdout and stderr. A `--devices N` that differs
    from 8 reaches the command as asked; `show` and `demo` cannot honour it here.
    No run may end in a traceback (an uncaught exception fails the test) or in
    eqshard's "internal error" message.
    """

    from eqshard._cli._main import main

    def run(*args: object) -> CliResult:
        capsys.readouterr()  # only this run's output
        try:
            code = main([str(arg) for arg in args])
        except SystemExit as exit:  # argparse's usage errors
            code = 0 if exit.code is None else exit.code if isinstance(exit.code, int) else 1
        out, err = capsys.readouterr()
        assert "internal error" not in err, err
        return CliResult(code, out, err)

    return run
