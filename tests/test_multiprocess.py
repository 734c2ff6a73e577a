"""eqshard on JAX's multi-controller runtime: two processes over loopback."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "multiprocess_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes, each starts JAX's distributed runtime and Orbax
def test_apply_and_orbax_across_two_processes(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    results = sorted(
        (json.loads(out.strip().splitlines()[-1]) for out, _ in outputs), key=lambda r: r["process"]
    )
    for r in results:
        assert r["devices"] == 8
        assert r["local_devices"] == 4
        assert r["mesh"] == {"m0": 8}
        assert r["local_ok"] is True
        assert abs(r["loss"] - r["expected"]) <= 1e-5 * abs(r["expected"])
        # restored through Orbax in another layout: no process holds a whole leaf,
        # and each one's shards equal the saved values bit for bit
        assert r["orbax_addressable"] is False
        assert r["orbax_ok"] is True
        assert r["orbax_layout"] is True
    # devices fill the mesh in jax.devices() order: process 0's four hold rows 0..15
    # of the (32, 16) weight, process 1's rows 16..31
    assert results[0]["shards"] == [[i, [4 * i, 0]] for i in range(4)]
    assert results[1]["shards"] == [[i, [4 * i, 0]] for i in range(4, 8)]
