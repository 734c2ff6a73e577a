"""Nothing lost, nothing changed, nothing raw: what bad input could break before.

Each test here failed before the fix it guards.
"""

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqshard
from eqshard import EqshardError, ExpressionError, SpecError, UnreadableError
from eqshard._process._usercode import abstract_model

BIG = 2**40 + 1


# --------------------------------------------------------------------------- #
# Values: placing never changes one, and never aliases a mutable input.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.complex128])
def test_64_bit_numpy_is_refused_everywhere_it_could_be_cast(dtype):
    x = np.array([BIG, 3] * 4, dtype)
    held = {np.int64: "int32", np.float64: "float32", np.complex128: "complex64"}[dtype]
    for place in (
        lambda: eqshard.shard(x, "a -> a*"),
        lambda: eqshard.constrain(x, "a -> a*"),
        lambda: eqshard.constrain({"x": x}, {"x": "a -> a*"}),
        lambda: eqshard.apply({"x": x}, {"x": "a -> a*"}),
    ):
        with pytest.raises(EqshardError, match=rf"cast it \(`x.astype\(np.{held}\)`\)"):
            place()


@pytest.mark.parametrize("shape", [(8, 8), (256, 256)])
def test_placed_values_never_alias_a_writeable_numpy_input(shape):
    x = np.zeros(shape, np.float32)
    placed = [
        eqshard.shard(x, "a b -> a* b"),
        eqshard.shard(x, "a b -> * a b"),
        eqshard.apply({"x": x}, {"x": "a b -> a b*"})["x"],
        eqshard.constrain({"x": x}, {"x": "a b -> a* b"})["x"],
        eqshard.apply({"x": x}, {"x": "a b -> 8 a b"}, devices=jax.devices()[:8])["x"],
    ]
    x[0, 0], x[-1, -1] = 5, 7  # the user writes into their array afterwards
    for y in placed:
        np.testing.assert_array_equal(np.asarray(y), np.zeros(shape, np.float32))


def test_read_only_views_and_jax_arrays_are_placed_with_their_values():
    base = np.arange(32, dtype=np.float32).reshape(8, 4)
    x = base.view()
    x.flags.writeable = False  # read-only, but its base is not
    y = eqshard.shard(x, "a b -> a* b")
    base[0, 0] = 100
    np.testing.assert_array_equal(np.asarray(y), np.arange(32).reshape(8, 4))
    z = eqshard.shard(jnp.asarray(base), "a b -> a* b")
    np.testing.assert_array_equal(np.asarray(z), base)


def test_shard_refuses_abstract_arrays():
    with pytest.raises(EqshardError, match=r"is abstract \(a jax.ShapeDtypeStruct\)"):
        eqshard.shard(jax.ShapeDtypeStruct((8,), jnp.float32), "a -> a*")  # pyright: ignore[reportArgumentType]


def test_constrain_with_a_plan_for_other_shapes_names_the_leaf():
    model = eqx.nn.MLP(4, 4, 16, 1, key=jax.random.key(0))
    other = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight),
        model,
        (jnp.ones((8, 4)), jnp.ones(8), jnp.ones((4, 8))),
    )
    p = eqshard.plan(model, "... -> * ...")
    with pytest.raises(SpecError) as info:
        eqshard.constrain(other, p)
    assert [str(problem) for problem in info.value.problems] == [
        "layers.0.weight (Linear.weight): the plan was made for shape (16, 4), and this leaf "
        "has (8, 4); make the plan from this model",
        "layers.0.bias (Linear.bias): the plan was made for shape (16,), and this leaf has "
        "(8,); make the plan from this model",
        "layers.1.weight (Linear.weight): the plan was made for shape (4, 16), and this leaf "
        "has (4, 8); make the plan from this model",
    ]
    with pytest.raises(SpecError, match="the plan was made for shape"):
        eqx.filter_jit(lambda m: eqshard.constrain(m, p))(other)


def test_every_independent_fault_is_reported_at_once():
    tree = {
        "bad_text": jnp.ones(8),
        "does_not_fit": jnp.ones(6),
        "int64": np.ones(8, np.int64),
        "fine": jnp.ones(8),
    }
    spec = {"bad_text": "a -> a0", "does_not_fit": "a -> a*", "int64": "a -> a*", "fine": "a -> a*"}
    with pytest.raises(SpecError) as info:
        eqshard.apply(tree, spec)
    assert [p.where for p in info.value.problems] == ["bad_text", "does_not_fit", "int64"]


# --------------------------------------------------------------------------- #
# Files: dump writes whole files that load, or nothing.
# --------------------------------------------------------------------------- #

RULES = {"eqshard": 1, "rules": [{"path": "**.w", "expr": "a -> a*"}]}


@pytest.fixture
def existing(tmp_path: Path) -> Path:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(RULES))
    return path


def _untouched(path: Path) -> None:
    assert json.loads(path.read_text()) == RULES
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_dump_of_a_lone_surrogate_writes_nothing(existing: Path):
    rules = eqshard.load({"eqshard": 1, "rules": [{"path": "**.w\udc80", "expr": "a -> a*"}]})
    with pytest.raises(EqshardError, match=r"not written: .* a lone surrogate"):
        eqshard.dump(rules, existing)
    _untouched(existing)


def test_dump_is_atomic_when_the_disk_fails(existing: Path, monkeypatch: pytest.MonkeyPatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(EqshardError, match=r"cannot write .*: No space left on device"):
        eqshard.dump(eqshard.load(RULES), existing)
    _untouched(existing)


def test_dump_keeps_the_files_permissions(existing: Path):
    existing.chmod(0o640)
    eqshard.dump(eqshard.load(RULES), existing, devices=8)
    assert eqshard.load(existing).devices == 8
    assert existing.stat().st_mode & 0o777 == 0o640


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_dump_refuses_a_fifo_without_hanging(tmp_path: Path):
    fifo = tmp_path / "spec.json"
    os.mkfifo(fifo)
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("dump hung on a FIFO"))
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        with pytest.raises(EqshardError, match="is not a regular file"):
            eqshard.dump(eqshard.load(RULES), fifo)
        with pytest.raises(UnreadableError, match="is not a regular file"):
            eqshard.load(fifo)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    ("spec", "devices", "message"),
    [
        (RULES, 2**21, r"\$\.devices: 2097152 is greater than the maximum of 1048576"),
        (
            eqshard.Rules(
                (
                    eqshard.Rule("w", eqshard.parse("a -> a*")),
                    eqshard.Rule("w", eqshard.parse("a -> a2*"), index=1),
                )
            ),
            None,
            r"\$\.rules\[1\]\.path: this rule can never match: \$\.rules\[0\] has the same path",
        ),
    ],
    ids=["devices over the maximum", "paths that print alike"],
)
def test_dump_never_writes_a_file_load_would_reject(existing: Path, spec, devices, message):
    source = spec if isinstance(spec, eqshard.Rules) else eqshard.load(spec)
    with pytest.raises(SpecError, match=message):
        eqshard.dump(source, existing, devices=devices)
    _untouched(existing)


# --------------------------------------------------------------------------- #
# Errors that were raw.
# --------------------------------------------------------------------------- #


def test_counts_of_thousands_of_digits_are_expression_errors():
    with pytest.raises(ExpressionError, match="a count of 5000 digits is more devices"):
        eqshard.parse("a -> a" + "9" * 5000)
    with pytest.raises(SpecError) as info:
        eqshard.load(
            {
                "eqshard": 1,
                "rules": [{"path": "w", "expr": "a -> a" + "9" * 5000}],
                "dims": {"mlp": "9" * 5000 + "*"},
            }
        )
    assert [p.where for p in info.value.problems] == [
        "<mapping>::$.dims.mlp",
        "<mapping>::$.rules[0].expr",
    ]


def test_a_rule_needs_a_path_and_a_path_has_no_nul(tmp_path: Path):
    with pytest.raises(EqshardError, match=r"`Rule\.path` is a dotted glob"):
        eqshard.Rule(None, "a -> a*")  # type: ignore[arg-type]
    with pytest.raises(UnreadableError, match=r"cannot read it: .*embedded null (byte|character)"):
        eqshard.load(str(tmp_path / "a\0b.json"))
    with pytest.raises(EqshardError, match=r"cannot write .*embedded null (byte|character)"):
        eqshard.dump(eqshard.load(RULES), str(tmp_path / "a\0b.json"))


# --------------------------------------------------------------------------- #
# Messages.
# --------------------------------------------------------------------------- #


def test_an_empty_key_is_named_not_the_root():
    with pytest.raises(SpecError) as info:
        eqshard.plan({"": jnp.ones(6)}, "a -> a*")
    assert info.value.problems[0].where == "['']"


def test_a_byte_order_mark_is_read_as_utf8(tmp_path: Path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(RULES).encode())
    assert eqshard.load(path).rules[0].path == "**.w"


def test_a_directory_is_named_once(tmp_path: Path):
    with pytest.raises(UnreadableError) as info:
        eqshard.load(tmp_path)
    assert str(info.value) == (
        f"unreadable:\n  {tmp_path}: it is not a regular file (a directory, pipe or device)"
    )


def test_file_problems_know_their_file_even_when_its_name_has_double_colons(tmp_path: Path):
    path = tmp_path / "a::b.json"
    path.write_text(json.dumps({"eqshard": 1, "rules": [{"path": "w", "expr": "a -> b"}]}))
    with pytest.raises(SpecError) as info:
        eqshard.load(path)
    [problem] = info.value.problems
    assert (problem.file, problem.json_path) == (str(path), "$.rules[0].expr")


MODEL_FILE = """
import asyncio
import equinox as eqx
import jax

print("the model file talks")

def build():
    print("so does build")
    return eqx.nn.Linear(4, 4, key=jax.random.key(0))

def cancelled():
    raise asyncio.CancelledError("stop")

def exits():
    raise GeneratorExit("done")
"""


def test_check_models_that_print_or_raise_base_exceptions(tmp_path: Path, capsys):
    path = tmp_path / "model_file.py"
    path.write_text(MODEL_FILE)
    model = abstract_model(f"{path}:build")
    assert isinstance(model, eqx.nn.Linear)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "the model file talks" in captured.err
    assert str(tmp_path) in sys.path  # its sibling modules import
    for name, raised in [("cancelled", "CancelledError: stop"), ("exits", "GeneratorExit: done")]:
        with pytest.raises(EqshardError, match=f"{name}\\(\\) raised {raised}"):
            abstract_model(f"{path}:{name}")
    assert issubclass(asyncio.CancelledError, BaseException)


def test_check_names_a_model_file_that_is_not_python(tmp_path: Path):
    text = tmp_path / "model.txt"
    text.write_text("build = None")
    with pytest.raises(EqshardError, match=r"'.*model\.txt' is not a Python file"):
        abstract_model(f"{text}:build")
