"""`eqshard check --target` (a step compiled for a TPU slice by XLA:TPU, on this
CPU machine), `--max-memory` from the chip's HBM, and how the batch is laid out:
`--batch`, a spec file's `"batch"`, the default.

The checks run in this process (`run_cli`, on its 8 CPU devices); one runs the
command line as a user does, every slice in one worker.
"""

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from test_cli_cost import MEGATRON, MODULE, _step_args  # an MLP, its step, a Megatron spec

EXAMPLES = Path(__file__).parent.parent / "examples" / "specs"

# The demo's GPT (eqshard demo) and its AdamW, trained as the demo trains it.
DEMO = """
import jax
import jax.numpy as jnp

from eqshard._demo._run import make_step
from eqshard._demo._model import GPT, adamw_init, tokens


def build():
    return GPT(jax.random.key(0))


class AdamW:
    init = staticmethod(adamw_init)


def optimizer():
    return AdamW()


def batch():
    return jnp.asarray(tokens())


step = make_step()
"""

HBM = 16 << 30  # a TPU v5e chip's


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    (folder / "targetmodel.py").write_text(MODULE)
    (folder / "demostep.py").write_text(DEMO)
    spec = folder / "megatron.eqshard.json"
    spec.write_text(json.dumps(MEGATRON))
    return str(spec), str(folder / "targetmodel.py"), str(folder / "demostep.py")


def _check(run_cli, *args) -> tuple[Any, list[dict[str, Any]]]:
    """The run, and its checks as `--format json` gives them (none on an error)."""
    result = run_cli("check", *args, "--format", "json")
    return result, json.loads(result.out).get("checks", [])


# --------------------------------------------------------------------------- #
# --target: compiled by XLA:TPU for a slice, its memory held against the HBM.
# --------------------------------------------------------------------------- #

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler comes with libtpu (eqshard[tpu])",
)


@needs_libtpu
def test_a_step_compiled_for_a_slice_names_its_compiler_and_fits_the_chips_hbm(run_cli, files):
    spec, module, _ = files
    result, checks = _check(run_cli, spec, *_step_args(module), "--target", "v5e:2x4")
    assert result.code == 0, result.err
    (found,) = checks
    assert (found["target"], found["devices"], found["ok"]) == ("v5e:2x4", 8, True)
    cost = found["cost"]
    assert cost["compiler"].startswith("XLA:TPU (libtpu ")
    assert (cost["target"], cost["memory_per_device"], cost["fits"]) == ("v5e:2x4", HBM, True)
    assert cost["estimate"]["hardware"] == "Google Cloud TPU v5e"
    assert cost["peak"] == cost["peak_lower_bound"] > cost["parameters"] + cost["optimizer"]
    assert cost["batch"] == "b ... -> b* ..."  # the default: no mesh, so every device
    assert found["max_memory"] == {
        "bytes": HBM,
        "from": "the chip's HBM",
        "needed": cost["peak"],
        "fits": True,
    }
    # Megatron: an eighth of layers.0 and layers.1.weight per device; layers.1.bias whole
    assert cost["parameters"] == (64 * 256 // 8 + 256 // 8 + 256 * 64 // 8 + 64) * 4


@needs_libtpu
def test_the_text_says_whose_figures_and_whose_memory_limit(run_cli, files):
    spec, module, _ = files
    result = run_cli("check", spec, *_step_args(module), "--target", "v5e:2x4")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert f"{spec} on v5e:2x4 (8 devices)" in lines[0]
    (cost,) = [line for line in lines if line.startswith("cost: ")]
    assert cost.startswith("cost: parameters 16.4 KiB, optimizer 32.8 KiB, peak ")  # exact: no >=
    assert "; estimate on a Google Cloud TPU v5e: " in cost
    (compiled,) = [line for line in lines if line.startswith("compiled by ")]
    assert compiled.startswith("compiled by XLA:TPU (libtpu ")
    assert compiled.endswith(") for v5e:2x4; the batch laid out by 'b ... -> b* ...'")
    (memory,) = [line for line in lines if line.startswith("max memory: ")]
    assert memory.startswith(
        "max memory: the chip's HBM, 16 GiB per device (no --max-memory given); the step needs "
    )
    assert memory.endswith(": it fits")
    assert f"{spec} on v5e:2x4 (8 devices): ok" in lines


@needs_libtpu
def test_an_explicit_max_memory_wins_over_the_hbm(run_cli, files):
    spec, module, _ = files
    args = [spec, *_step_args(module), "--target", "v5e:2x4", "--max-memory", "100KB"]
    result, checks = _check(run_cli, *args)
    assert result.code == 1
    (found,) = checks
    peak = found["cost"]["peak"]
    assert peak > 100_000
    assert found["max_memory"] == {
        "bytes": 100_000,
        "from": "--max-memory",
        "needed": peak,
        "fits": False,
    }
    assert found["cost"]["fits"] is True  # the chip's HBM would hold it
    size = f"{peak / 1024:.1f} KiB"
    message = (
        f"the step needs {size} per device on v5e:2x4 (8 devices), more than --max-memory "
        "97.7 KiB: it does not fit"
    )
    assert found["problems"] == [{"where": spec, "message": message}]
    text = run_cli("check", *args)
    assert text.code == 1
    assert f"{spec}: {message}" in text.out.splitlines()
    assert (
        f"max memory: --max-memory 97.7 KiB per device (the chip's HBM, 16 GiB); the step "
        f"needs {size}: it does not fit"
    ) in text.out.splitlines()


@needs_libtpu
def test_max_memory_holds_the_compilers_own_peak(run_cli, files):
    """XLA:TPU's own peak is not the sum of the arguments, outputs and temporaries
    it allocates (above it with JAX 0.10's libtpu, below it with JAX 0.12's); a
    limit between the two is judged by the compiler's peak (it was by their sum)."""
    spec, module, _ = files
    _, (found,) = _check(run_cli, spec, *_step_args(module), "--target", "v5e:2x4")
    cost = found["cost"]
    allocated = cost["arguments"] + cost["outputs"] + cost["temporaries"]
    peak = cost["peak"]
    assert peak == cost["reported_peak"] != allocated
    limit = (allocated + peak) // 2
    fits = peak <= limit  # the compiler's peak is the smaller of the two
    args = [spec, *_step_args(module), "--target", "v5e:2x4", "--max-memory", str(limit)]
    result, (bounded,) = _check(run_cli, *args)
    assert result.code == (0 if fits else 1)
    assert bounded["max_memory"] == {
        "bytes": limit,
        "from": "--max-memory",
        "needed": peak,
        "fits": fits,
    }


@needs_libtpu
def test_layouts_on_a_slice_hold_the_parameters_against_the_hbm(run_cli, files):
    spec, module, _ = files
    result, checks = _check(run_cli, spec, "--model", f"{module}:build", "--target", "v5e:4x4")
    assert result.code == 0, result.err
    (found,) = checks
    assert (found["devices"], found["target"], found["cost"]) == (16, "v5e:4x4", None)
    assert found["max_memory"] == {
        "bytes": HBM,
        "from": "the chip's HBM",
        "needed": found["bytes_per_device"],
        "fits": True,
    }


@needs_libtpu
def test_devices_with_a_target_must_be_the_slices_count(run_cli, files):
    spec, module, _ = files
    args = [spec, "--model", f"{module}:build", "--target", "v5e:2x4"]
    result = run_cli("check", *args, "--device-counts", 16)
    assert result.code == 2
    assert result.err == (
        "eqshard check: error: --device-counts 16 and --target v5e:2x4: the slice has 8 devices, "
        "and its check is made on all of them; leave --device-counts out with --target (the slice "
        "sets the count)\n"
    )
    as_json = run_cli("check", *args, "--device-counts", 16, "--format", "json")
    assert as_json.code == 2
    assert json.loads(as_json.out)["ok"] is False
    result = run_cli("check", *args, "--device-counts", 8)
    assert result.code == 0, result.err


def test_a_target_without_libtpu_exits_2_with_the_install_hint(run_cli, files, monkeypatch):
    from importlib import metadata

    from eqshard._cost._targets import compile_target

    real = metadata.version

    def without_libtpu(name):
        if name == "libtpu":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    spec, module, _ = files
    monkeypatch.setattr(metadata, "version", without_libtpu)
    compile_target.cache_clear()
    try:
        result = run_cli("check", spec, *_step_args(module), "--target", "v5e:2x4")
    finally:
        compile_target.cache_clear()
    assert result.code == 2
    assert result.out == ""
    assert result.err == (
        "eqshard check: error: `target='v5e:2x4'` compiles with the TPU compiler, which "
        "comes with libtpu; install it with `pip install 'eqshard[tpu]'` (libtpu for this "
        "JAX), or leave `target` out to compile with XLA:CPU\n"
    )


@pytest.mark.slow  # compiles for a TPU slice, several, in a worker
@needs_libtpu
def test_several_slices_in_one_worker(run_python, files):
    spec, module, _ = files
    command = ["-m", "eqshard", "check", spec, *_step_args(module)]
    result = run_python([*command, "--target", "v5e:2x4", "v5e:4x4", "--format", "json"])
    assert result.returncode == 0, result.stderr
    checks = json.loads(result.stdout)["checks"]
    assert [(c["target"], c["devices"], c["ok"]) for c in checks] == [
        ("v5e:2x4", 8, True),
        ("v5e:4x4", 16, True),
    ]
    assert all(c["cost"]["compiler"].startswith("XLA:TPU") for c in checks)
    assert checks[1]["cost"]["parameters"] < checks[0]["cost"]["parameters"]


# --------------------------------------------------------------------------- #
# The batch: --batch beats the spec file's "batch", which beats the default.
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def demo_specs(tmp_path_factory):
    """The demo's Megatron spec as shipped (its batch whole), and without "batch"."""
    folder = tmp_path_factory.mktemp("demo")
    shipped = EXAMPLES / "demo" / "megatron.eqshard.json"
    document = json.loads(shipped.read_text("utf-8"))
    assert document["batch"] == "... -> * ..."
    del document["batch"]
    without = folder / "megatron-default-batch.eqshard.json"
    without.write_text(json.dumps(document))
    return str(shipped), str(without)


@pytest.mark.slow  # compiles for a TPU slice, twice
def test_a_whole_batch_spares_megatron_the_gathers_a_split_batch_costs(run_cli, files, demo_specs):
    _, _, demo = files
    shipped, without = demo_specs
    result, checks = _check(run_cli, shipped, without, *_step_args(demo), "--device-counts", 8)
    assert result.code == 0, result.err
    whole, split = (check["cost"] for check in checks)
    assert whole["batch"] == "... -> * ..."  # the file's "batch"
    assert split["batch"] == "b ... -> b8 ..."  # the default: over the mesh's first axis
    # whole: each device computes its heads and units of the whole batch, and sums
    # them over 'model' after attention and after the MLP; split over 'model' (the
    # only axis), the same weights meet a split batch: XLA gathers activations and
    # moves them between devices, besides the sums
    assert {(e["kind"], tuple(e["axes"])) for e in whole["communication"]} == {
        ("all-reduce", ("model",))
    }
    assert {(e["kind"], tuple(e["axes"])) for e in split["communication"]} == {
        ("all-gather", ("model",)),
        ("all-reduce", ("model",)),
        ("all-to-all", ("model",)),
    }
    same = ("parameters", "optimizer", "gradients")  # only the batch changed
    assert [whole[key] for key in same] == [split[key] for key in same]
    # --batch beats the file's "batch"
    args = [shipped, *_step_args(demo), "--device-counts", 8, "--batch", "b ... -> b8 ..."]
    result, (given,) = _check(run_cli, *args)
    assert result.code == 0, result.err
    assert given["cost"]["communication"] == split["communication"]
    assert given["cost"]["batch"] == "b ... -> b8 ..."


def test_a_bad_batch_spec_is_refused_before_any_work(run_cli, files):
    spec, module, _ = files
    result = run_cli("check", spec, *_step_args(module), "--batch", "b ... -> c ...")
    assert result.code == 1
    assert result.err == (
        "eqshard check: error: --batch 'b ... -> c ...': bad einshard expression:\n"
        "    b ... -> c ...\n"
        "             ^\n"
        "axis 'c' is on the right but not on the left; add it to the left, or drop its name "
        "to replicate instead\n"
    )
    result = run_cli("check", spec, "--model", f"{module}:build", "--batch", "... -> * ...")
    assert result.code == 2
    assert "--batch is for the step: name it with --step" in result.err


def test_validate_shows_a_bad_batch_with_its_json_path_and_a_caret(run_cli, tmp_path):
    path = tmp_path / "short.eqshard.json"
    path.write_text(json.dumps({"eqshard": 1, "batch": "b*   ..."}))
    result = run_cli("validate", path)
    assert result.code == 1
    assert result.out.splitlines() == [
        f"{path}::$.batch: a batch's arrays have no annotation to complete a short form: "
        "write both sides, such as 'b ... -> b* ...' (the leading dim split over every "
        "device) or '... -> * ...' (a whole copy on every device)",
        "    b*   ...",
        "    ^^^^^^^^",
    ]
    path.write_text(json.dumps({"eqshard": 1, "batch": "b ... -> b0 ..."}))
    result = run_cli("validate", "--format", "json", path)
    assert result.code == 1
    (problem,) = json.loads(result.out)["files"][0]["problems"]
    assert problem == {
        "where": f"{path}::$.batch",
        "file": str(path),
        "path": "$.batch",
        "message": "a count of 0 is not allowed; counts start at 1",
        "detail": "    b ... -> b0 ...\n              ^",
    }
