"""Careless and hostile input: always an EqshardError, never a traceback."""

import json
import os
import sys
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jaxtyping import Array, Float

import eqshard
from eqshard import Element, EqshardError, Expression


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: eqshard.sharding(["a -> a"], (8,)), "must be a string such as"),  # type: ignore[arg-type]
        (lambda: eqshard.sharding("a -> a*", (8,), devices=8.0), "not float"),  # type: ignore[arg-type]
        (
            lambda: eqshard.sharding("a -> a*", (8,), devices=[0, 1]),
            "holds 0, which is not a JAX device",
        ),
        (
            lambda: eqshard.layout("a -> a*", (8,), cast(Any, "8")),
            "the device count is a whole number from 1, not '8'",
        ),  # type: ignore[arg-type]
        (lambda: eqshard.layout("a -> a*", (8,), cast(Any, 8.0)), "not 8.0"),  # type: ignore[arg-type]
        (lambda: eqshard.sharding("a -> a " + "2 " * 33, (8,)), "a JAX mesh has at most 32 axes"),
        (lambda: Expression(("a",), ()), "is not a valid einshard expression"),
        (lambda: Expression(("a",), (Element("b", 8),)), "is not a valid einshard expression"),
        (lambda: Expression(("a",), (Element("a", 8), ...)), "is not a valid einshard expression"),
        (lambda: eqshard.dump({"w": "a -> a*"}, None), "writes to a path, not NoneType"),  # type: ignore[arg-type]
        (
            lambda: eqshard.dump({"w": "a -> a*"}, "x.json", devices=True),
            "whole number from 1, not True",
        ),
        (lambda: eqshard.load("a\0b"), "cannot read it"),
    ],
)
def test_bad_arguments_are_eqshard_errors(call, message):
    with pytest.raises(EqshardError, match=message):
        call()


def test_mesh_devices_are_accepted_in_row_major_order():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    s = eqshard.sharding("x -> x*", (8,), devices=mesh.devices)
    assert np.asarray(s.mesh.devices).ravel().tolist() == np.asarray(mesh.devices).ravel().tolist()


def test_hand_built_expressions_that_are_valid_are_accepted():
    expr = Expression(("a", "b"), (Element("a", 2, True), Element("b")))
    assert expr == eqshard.parse("a b -> a2* b")


def test_the_caret_lines_up_under_tabs_and_hides_control_characters():
    with pytest.raises(eqshard.ExpressionError) as info:
        eqshard.parse("a\tb -> a\x1b[2K c")
    lines = str(info.value).split("\n")
    assert lines[1] == "    a b -> a\ufffd[2K c"
    assert "\x1b" not in str(info.value)


def test_dump_to_a_directory_is_an_eqshard_error(tmp_path):
    with pytest.raises(EqshardError) as info:
        eqshard.dump({"w": "a -> a*"}, tmp_path)
    assert str(info.value) == f"not written: {tmp_path} is not a regular file (a directory or pipe)"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_special_files_are_refused_unread(tmp_path):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with pytest.raises(eqshard.UnreadableError, match="not a regular file"):
        eqshard.load(fifo)
    with pytest.raises(eqshard.UnreadableError, match="not a regular file"):
        eqshard.load(tmp_path)


def test_short_forms_survive_an_unresolvable_sibling_annotation():
    namespace = {"eqx": eqx, "eqshard": eqshard, "Float": Float, "Array": Array}
    code = (
        "from __future__ import annotations\n"
        "class M(eqx.Module):\n"
        "    other: NotImportedHere\n"
        "    w: Float[Array, 'x y'] = eqshard.field('x*')\n"
    )
    module = type(sys)("eqshard_test_forward_refs")
    module.__dict__.update(namespace)
    sys.modules[module.__name__] = module
    try:
        exec(compile(code, "<test>", "exec"), module.__dict__)
        model = module.M(jnp.ones(3), jnp.ones((8, 4)))
        assert str(eqshard.spec_tree(model).w) == "x y -> x* y"
    finally:
        del sys.modules[module.__name__]


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


def test_numpy_float32_leaves_are_placed():
    placed = eqshard.apply({"w": np.arange(8, dtype=np.float32)}, "a -> a*")
    np.testing.assert_array_equal(np.asarray(placed["w"]), np.arange(8, dtype=np.float32))
