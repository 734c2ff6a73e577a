import os

import jax

# Every test sees 8 CPU devices. This must happen before JAX starts a backend;
# other device counts run in subprocesses (see the `run_python` fixture).
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

TESTS = Path(__file__).parent


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
