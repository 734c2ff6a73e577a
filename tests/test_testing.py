"""`eqshard.testing`: equivalence per device count, golden layouts, and the pytest
plugin, each count in a worker process of its own."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import eqshard
from eqshard.testing import assert_equivalent, assert_layouts

ROOT = Path(__file__).parent.parent
GPT = "examples/gpt_stacked.py"
GPT_SPEC = ROOT / "examples" / "specs" / "gpt.eqshard.json"
MEGATRON = {"eqshard": 1, "rules": [{"path": "layers.*.weight", "expr": "o i -> o i*"}]}


@pytest.mark.slow  # compiles in worker processes
def test_the_stacked_gpt_trains_as_unsharded_and_gathers_no_parameter():
    assert_equivalent(
        f"{GPT}:build",
        GPT_SPEC,  # declares its mesh: data x model 4
        f"{GPT}:loss",
        f"{GPT}:batch",
        device_counts=(8,),
        optimizer=f"{GPT}:optimizer",
        max_communication={"all-gather": 0, "all-to-all": 0},
    )


def test_the_stacked_gpt_layouts_match_the_golden_file():
    assert_layouts(
        f"{GPT}:build", GPT_SPEC, golden=ROOT / "tests/golden/gpt.json", device_counts=(8, 64)
    )


def test_a_difference_names_the_leaf_the_count_and_the_largest_difference():
    import harness_models as m

    with pytest.raises(AssertionError) as caught:  # tolerance 0: the last bits differ
        assert_equivalent(
            m.build, eqshard.load(MEGATRON), m.loss, m.batch, device_counts=(8,), rtol=0, atol=0
        )
    text = str(caught.value)
    assert text.startswith("on 8 devices, ")
    assert "  gradients layers.0.weight (float32): " in text
    assert "  loss (float32): 1 of 1 elements; the largest difference " in text
    assert "(rtol 0, atol 0; passes with rtol " in text
    assert "\nthe smallest tolerances that pass every leaf on 8 devices: rtol=" in text


@pytest.mark.slow  # compiles in worker processes
def test_over_the_communication_budget_names_the_collectives():
    import harness_models as m

    with pytest.raises(AssertionError) as caught:  # row parallel: an all-reduce per layer
        assert_equivalent(
            m.build,
            eqshard.load(MEGATRON),
            m.loss,
            m.batch,
            device_counts=(2,),
            optimizer=m.optimizer,
            max_communication={"all-reduce": 0},
        )
    text = str(caught.value)
    assert text.startswith("on 2 devices, the step's all-reduces move ")
    assert "over the budget of 0 (" in text
    assert "differ" not in text  # the values themselves agree


def _golden_project(tmp_path: Path, expr: str) -> None:
    (tmp_path / "spec.eqshard.json").write_text(
        json.dumps({"eqshard": 1, "rules": [{"path": "layers.*.weight", "expr": expr}]})
    )


@pytest.mark.slow  # golden files across counts
def test_golden_layouts_are_written_then_a_changed_spec_names_the_leaf(tmp_path, monkeypatch):
    import harness_models as m

    golden = tmp_path / "golden" / "mlp.json"
    _golden_project(tmp_path, "o i -> o* i")
    spec = tmp_path / "spec.eqshard.json"
    with pytest.raises(AssertionError, match=r"no golden layouts yet; run `pytest --eqshard-upd"):
        assert_layouts(m.build, spec, golden=golden, device_counts=(2,))
    monkeypatch.setenv("EQSHARD_UPDATE", "1")
    assert_layouts(m.build, spec, golden=golden, device_counts=(2,))
    monkeypatch.delenv("EQSHARD_UPDATE")
    recorded = json.loads(golden.read_text())["layouts"]["2"]
    assert recorded["leaves"]["layers.1.weight"] == {
        "expression": "o i -> o* i",
        "partition_spec": "P('m0', None)",
        "shape": [32, 32],
        "dtype": "float32",
        "bytes_per_device": 16 * 32 * 4,
    }
    assert_layouts(m.build, spec, golden=golden, device_counts=(2,))  # unchanged: passes

    _golden_project(tmp_path, "o i -> o i*")  # a changed expression
    with pytest.raises(AssertionError) as caught:
        assert_layouts(m.build, spec, golden=golden, device_counts=(2,))
    text = str(caught.value)
    assert text.startswith(f"layouts differ from {golden} (golden -> now); if the change is")
    assert "  ~ layers.0.weight\n      expression: 'o i -> o* i' -> 'o i -> o i*'\n" in text
    assert "      partition_spec: \"P('m0', None)\" -> \"P(None, 'm0')\"\n" in text

    spec.write_text(
        json.dumps({"eqshard": 1, "rules": [{"path": "layer.*.weight", "expr": "o i -> o* i"}]})
    )
    with pytest.raises(AssertionError) as caught:  # a rule that stops matching
        assert_layouts(m.build, spec, golden=golden, device_counts=(2,))
    assert "      bytes_per_device: 2048 -> 4096" in str(caught.value)


@pytest.mark.slow  # `assert_layouts` lays out in a worker process
def test_golden_layouts_are_written_through_a_symbolic_link(tmp_path, monkeypatch):
    import harness_models as m

    _golden_project(tmp_path, "o i -> o* i")
    (tmp_path / "shared").mkdir()
    target = tmp_path / "shared" / "mlp.json"
    target.write_text("{}")
    golden = tmp_path / "golden.json"
    golden.symlink_to(Path("shared") / "mlp.json")
    monkeypatch.setenv("EQSHARD_UPDATE", "1")
    assert_layouts(m.build, tmp_path / "spec.eqshard.json", golden=golden, device_counts=(2,))
    assert golden.is_symlink()
    assert os.readlink(golden) == os.path.join("shared", "mlp.json")
    assert json.loads(target.read_text())["layouts"]["2"]["mesh"]
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["mlp.json"]


def test_callables_must_be_importable_by_name(tmp_path):
    def build():
        return None

    with pytest.raises(
        eqshard.EqshardError,
        match=r"`build` \(test_testing:test_callables_.*inside a function or is a lambda; each device count runs in a new process",
    ):
        assert_layouts(build, "x -> x*", golden=tmp_path / "g.json")
    # a module pytest imported with --import-mode=importlib: no process can import it
    path = tmp_path / "test_mine.py"
    path.write_text("def build():\n    return None\n")
    loader = importlib.util.spec_from_file_location("tests.test_mine", path)
    assert loader is not None
    assert loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    with pytest.raises(eqshard.EqshardError) as caught:
        assert_layouts(module.build, "x -> x*", golden=tmp_path / "g.json")
    assert str(caught.value).startswith(
        "`build` (tests.test_mine:build): a new process cannot import module 'tests.test_mine' "
        f"from {path} by that name (pytest's --import-mode=importlib"
    )
    assert "or pass 'path/to/file.py:build'" in str(caught.value)


def test_bad_arguments_are_refused_before_any_process_starts(tmp_path):
    import harness_models as m

    plan = eqshard.plan(m.build(), "... -> * ...")
    with pytest.raises(eqshard.EqshardError, match="`spec` is a `Plan`, which holds this process"):
        assert_layouts(m.build, plan, golden=tmp_path / "g.json")
    with pytest.raises(
        eqshard.EqshardError, match=r"`mesh` {'a': '\*', 'b': '\*'}: at most one axis may be '\*'"
    ):
        assert_layouts(m.build, "x", mesh={"a": "*", "b": "*"}, golden=tmp_path / "g.json")
    with pytest.raises(eqshard.EqshardError, match="'all-gathers' is not a collective kind"):
        assert_equivalent(m.build, "x", m.loss, m.batch, max_communication={"all-gathers": 0})
    with pytest.raises(
        eqshard.EqshardError, match=r"write MODULE:CALLABLE, e\.g\. 'mypkg\.model:loss'"
    ):
        assert_equivalent(m.build, "x", "harness_models.loss", m.batch)


@pytest.mark.slow  # runs pytest on a user's project in a subprocess
def test_a_user_project_in_ten_lines_with_the_plugin(tmp_path):
    (tmp_path / "mymodel.py").write_text(
        "import equinox as eqx, jax\n\n"
        "def build():\n    return eqx.nn.Linear(8, 4, key=jax.random.key(0))\n"
    )
    (tmp_path / "test_spec.py").write_text(
        textwrap.dedent(
            """\
            import sys
            from eqshard.testing import assert_layouts

            def test_spec_layouts():
                assert "jax" not in sys.modules  # the plugin and the harness start no JAX
                assert_layouts("mymodel:build", "o ... -> o* ...", golden="golden/mymodel.json", device_counts=(2,))
                assert "jax" not in sys.modules
            """
        )
    )
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    update = subprocess.run(
        [*run, "--eqshard-update"], capture_output=True, text=True, cwd=tmp_path
    )
    assert update.returncode == 0, update.stdout + update.stderr
    golden = json.loads((tmp_path / "golden" / "mymodel.json").read_text())
    assert golden["layouts"]["2"]["leaves"]["weight"]["partition_spec"] == "P('m0', None)"
    compare = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path)
    assert compare.returncode == 0, compare.stdout + compare.stderr
    off = subprocess.run(
        [*run, "-p", "no:eqshard", "--eqshard-update"], capture_output=True, text=True, cwd=tmp_path
    )
    assert off.returncode == 4  # pytest's usage error: the option is the plugin's
    assert "unrecognized arguments: --eqshard-update" in off.stderr


def test_leaves_compare_within_their_dtype_tolerance_complex_and_bfloat16_included():
    import jax.numpy as jnp

    from eqshard.testing._worker import _compare

    one = jnp.ones((2, 3), jnp.bfloat16)
    assert _compare("loss", one * 1.0078125, one, None, None) == []  # 1 ulp: within 1.6e-2
    [bf16] = _compare("loss", one * 1.25, one, None, None)
    assert (bf16["dtype"], bf16["count"], bf16["difference"]) == ("bfloat16", 6, 0.25)
    z = jnp.full((2,), 1 + 1j, jnp.complex64)
    [imaginary] = _compare("gradients", z + 4j, z, None, None)  # the imaginary part counts
    assert (imaginary["sharded"], imaginary["unsharded"]) == ("(1+5j)", "(1+1j)")
    assert imaginary["difference"] == 4.0
    [exact] = _compare("state", jnp.arange(3), jnp.arange(3).at[1].set(7), None, None)
    assert (exact["count"], exact["index"]) == (1, [1])


def test_counts_callables_and_methods_are_taken_as_written():
    import functools

    import harness_models as m

    from eqshard._process._usercode import user_callable
    from eqshard.testing._processes import device_counts
    from eqshard.testing._references import callable_reference

    assert device_counts(8, "x", None) == (8,)
    assert device_counts([2, 8], "x", None) == (2, 8)
    with pytest.raises(eqshard.EqshardError, match=r"`device_counts` is a device count or a seq"):
        device_counts("8", "x", None)
    reference = callable_reference(m.Factory.build, "build")
    assert reference == "harness_models:Factory.build"
    assert user_callable(reference, "`build`", "build", "", None)[1] is m.Factory.build
    with pytest.raises(eqshard.EqshardError, match=r"`build` is a functools.partial, which"):
        callable_reference(functools.partial(m.build), "build")


@pytest.mark.slow  # `assert_layouts` lays out in a worker process
def test_a_suite_that_sets_xla_flags_still_tests_any_count(monkeypatch, tmp_path):
    import harness_models as m

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    monkeypatch.setenv("EQSHARD_UPDATE", "1")
    assert_layouts(m.build, "o ... -> o* ...", golden=tmp_path / "g.json", device_counts=(4,))
    assert '"4": {\n   "mesh": {"m0": 4}' in (tmp_path / "g.json").read_text()


@pytest.mark.slow  # compiles in worker processes
def test_a_stateful_model_trains_as_unsharded_on_4_and_8_devices():
    import harness_models as m

    assert_equivalent(  # the loss, gradients, new state, one SGD step, its momentum
        m.build_stateful,
        eqshard.load(m.NET_SPEC),
        m.loss_stateful,
        m.batch_stateful,
        device_counts=(4, 8),
        optimizer=m.optimizer_stateful,
        max_communication={"all-to-all": 0, "collective-permute": 0},
    )


@pytest.mark.slow  # compiles in worker processes
def test_a_wrong_state_update_is_named_by_its_layer():
    import harness_models as m

    with pytest.raises(AssertionError) as caught:  # the running mean, times 4 devices
        assert_equivalent(
            m.build_stateful,
            eqshard.load(m.NET_SPEC),
            m.loss_stateful_scaled_by_devices,
            m.batch_stateful,
            device_counts=(4,),
        )
    first, leaf, smallest = str(caught.value).split("\n")
    assert first == "on 4 devices, 1 leaf differs from the unsharded run:"
    assert leaf.startswith(
        "  new state bn.batch_state_index.0 (float32): 16 of 16 elements; the largest difference "
    )
    assert "(rtol 1e-05, atol 1e-06; passes with rtol 3 or atol " in leaf  # 4x: a bug
    assert smallest.startswith(
        "the smallest tolerances that pass every leaf on 4 devices: rtol=3 (with each "
        "dtype's default atol) or atol="
    )


@pytest.mark.slow  # compiles in worker processes
def test_a_loss_of_the_wrong_shape_for_the_build_says_which_is_expected():
    import harness_models as m

    from eqshard.testing._worker import _check_loss

    stateful, batch = m.build_stateful(), m.batch_stateful()
    expected = (
        r"`build\(\)` returns a model and its state \(as `eqx.nn.make_with_state` does\), "
        r"so `loss` is called as `loss\(model, state, batch\)` and returns "
        r"`\(value, new_state\)`; this one {}\. Write it as Equinox's BatchNorm example "
        r"does \(https://docs.kidger.site/equinox/examples/stateful/\):\n"
        r"    def loss\(model, state, batch\):\n"
    )
    with pytest.raises(eqshard.EqshardError, match=expected.format(r"returns a float32\[\] array")):
        _check_loss(m.loss_stateful_without_state, "m:loss", stateful, batch, True)
    with pytest.raises(eqshard.EqshardError, match=r"`loss` \(m:loss\): `build\(\)` returns the "):
        _check_loss(m.loss_stateful, "m:loss", m.build(), m.batch(), False)
    with pytest.raises(eqshard.EqshardError) as caught:  # a stateless loss, through a worker
        assert_equivalent(
            m.build_stateful, "... -> * ...", m.loss, m.batch_stateful, device_counts=(2,)
        )
    assert re.match(
        "`loss` \\(harness_models:loss\\): " + expected.format(r"takes \(model, batch\)"),
        str(caught.value),
    )
    assert str(caught.value).endswith("        return jnp.mean((out - y) ** 2), state")


def test_the_tolerance_message_shows_the_smallest_rtol_and_atol_that_pass():
    import numpy as np

    from eqshard.testing._equivalence import failure_text
    from eqshard.testing._tolerances import Needed
    from eqshard.testing._worker import _compare

    def result(got, want, rtol=None, atol=None):  # as a worker answers
        needed = Needed()
        found = _compare("gradients", got, want, rtol, atol, needed)
        return {"differences": found, "needed": dataclasses.asdict(needed), "over_budget": []}

    w = {"w": np.array([1.0, 2.0, 4.0], np.float32)}
    w_off = {"w": np.array([1.0, 2.0001, 4.0], np.float32)}
    w_near = {"w": np.array([1.0, 2.00003, 4.0], np.float32)}
    text = failure_text({4: result(w_off, w), 8: result(w_near, w)}, None, None)
    # 4 devices: |d| = 9.98974e-05, so rtol >= (|d| - 1e-6) / 2 = 4.9449e-05 and atol >=
    # |d| - 1e-5 * 2 = 7.98974e-05, each rounded up to three digits; 8 devices: 3.00407e-05
    assert text == (
        "on 4 devices, 1 leaf differs from the unsharded run:\n"
        "  gradients w (float32): 1 of 3 elements; the largest difference 9.99e-05 at [1]: "
        "sharded 2.0000998973846436, unsharded 2.0 (rtol 1e-05, atol 1e-06; passes with "
        "rtol 4.95e-05 or atol 7.99e-05)\n"
        "on 8 devices, 1 leaf differs from the unsharded run:\n"
        "  gradients w (float32): 1 of 3 elements; the largest difference 3e-05 at [1]: "
        "sharded 2.000030040740967, unsharded 2.0 (rtol 1e-05, atol 1e-06; passes with "
        "rtol 1.46e-05 or atol 1.01e-05)\n"
        "the smallest tolerances that pass every leaf on 4 and 8 devices: rtol=4.95e-05 (with "
        "each dtype's default atol) or atol=7.99e-05 (with each dtype's default rtol); loosen "
        "them only where a difference is expected: see `assert_equivalent`'s docstring"
    )
    sharded = float(np.float32(2.0001))  # what is printed passes; a digit less does not
    assert np.isclose(sharded, 2, 4.95e-05, 1e-6)
    assert not np.isclose(sharded, 2, 4.94e-05, 1e-6)
    assert np.isclose(sharded, 2, 1e-5, 7.99e-05)
    assert not np.isclose(sharded, 2, 1e-5, 7.98e-05)
    zero = {"b": np.array([0.0, 1.0], np.float32), "n": np.arange(2)}
    zero_off = {"b": np.array([3e-6, 1.0], np.float32), "n": np.arange(2)}
    assert failure_text({2: result(zero_off, zero, 0.0, 0.0)}, 0.0, 0.0).endswith(
        "(rtol 0, atol 0; passes with atol 3.01e-06; no rtol: an unsharded value is 0)\n"
        "the smallest tolerance that passes every leaf on 2 devices: atol=3.01e-06 (with "
        "rtol=0); no rtol does (an unsharded value is 0); loosen them only where a "
        "difference is expected: see `assert_equivalent`'s docstring"
    )
    ints = {"b": np.array([0.0, 1.0], np.float32), "n": np.arange(2) + 1}
    assert failure_text({2: result(ints, zero)}, None, None).endswith(
        "\nno tolerance passes every leaf on 2 devices: integer leaves differ"
    )


@pytest.mark.slow  # golden files across counts
def test_golden_layouts_record_a_models_state_under_its_layers(tmp_path, monkeypatch):
    import harness_models as m

    golden = tmp_path / "net.json"
    spec = tmp_path / "net.eqshard.json"
    spec.write_text(json.dumps(m.NET_SPEC))
    monkeypatch.setenv("EQSHARD_UPDATE", "1")
    assert_layouts(m.build_stateful, spec, golden=golden, device_counts=(4,))
    monkeypatch.delenv("EQSHARD_UPDATE")
    leaves = json.loads(golden.read_text())["layouts"]["4"]["leaves"]
    assert list(leaves)[-3:] == [
        "bn.batch_counter",
        "bn.batch_state_index.0",
        "bn.batch_state_index.1",
    ]
    assert leaves["bn.batch_state_index.0"] == {
        "expression": "c -> c*",
        "partition_spec": "P('m0')",
        "shape": [16],
        "dtype": "float32",
        "bytes_per_device": 16,
    }
    spec.write_text(json.dumps({**m.NET_SPEC, "rules": m.NET_SPEC["rules"][::2]}))  # no state rule
    with pytest.raises(AssertionError) as caught:
        assert_layouts(m.build_stateful, spec, golden=golden, device_counts=(4,))
    assert (
        "  ~ bn.batch_state_index.0\n      expression: 'c -> c*' -> 'input_size -> input_size*'"
        in str(caught.value)
    )


@pytest.mark.slow  # compiles in worker processes
def test_a_spec_files_rules_name_the_activations_in_the_workers(tmp_path):
    named = tmp_path / "named.eqshard.json"
    named.write_text(json.dumps({"eqshard": 1, "dims": {"hidden": "*"}}))
    assert_equivalent(
        "harness_models:build_named",
        named,
        "harness_models:loss_named",
        "harness_models:batch_named",
        device_counts=(8,),
    )
    unnamed = tmp_path / "unnamed.eqshard.json"
    unnamed.write_text(json.dumps({"eqshard": 1}))
    with pytest.raises(eqshard.EqshardError, match=r"'hidden'"):
        assert_equivalent(
            "harness_models:build_named",
            unnamed,
            "harness_models:loss_named",
            "harness_models:batch_named",
            device_counts=(8,),
        )


@pytest.mark.slow  # compiles in worker processes
def test_a_spec_files_batch_lays_out_the_batch_and_the_budgets_step(tmp_path):
    import harness_models as m

    spec = tmp_path / "whole.eqshard.json"  # replicated parameters, a whole batch on each device
    spec.write_text(json.dumps({"eqshard": 1, "batch": "... -> * ..."}))
    # with every device computing the whole step, nothing is reduced or gathered (split
    # over 2 devices, the gradients would be all-reduced); and data parallel cannot
    # split 8 rows over 3 devices, where the file's "batch" needs not
    assert_equivalent(
        m.build,
        spec,
        m.loss,
        m.batch,
        device_counts=(2, 3),
        optimizer=m.optimizer,
        max_communication={"all-reduce": 0, "all-gather": 0},
    )
    with pytest.raises(AssertionError) as caught:  # `batch=` wins over the file's
        assert_equivalent(
            m.build,
            spec,
            m.loss,
            m.batch,
            device_counts=(2,),
            batch="b ... -> b* ...",
            max_communication={"all-reduce": 0},
        )
    assert str(caught.value).startswith("on 2 devices, the step's all-reduces move ")
    with pytest.raises(eqshard.EqshardError) as refused:
        assert_equivalent(
            m.build, spec, m.loss, m.batch, device_counts=(3,), batch="b ... -> b* ..."
        )
    assert "the batch cannot be laid out by 'b ... -> b* ...' (`batch=`)" in str(refused.value)
