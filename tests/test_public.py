"""The public face of the package: what `help(eqshard)` and `dir(eqshard)` list, the
names that moved to namespaces, how long a docstring and a module may be, and what
importing it costs."""

import importlib
import inspect
import pickle
import pydoc
import subprocess
import sys
from pathlib import Path

import pytest

import eqshard

PACKAGE = Path(eqshard.__file__).parent


def _public():
    """Every public object: the top level's, each namespace's and `eqshard.testing`'s."""
    found = {f"eqshard.{name}": getattr(eqshard, name) for name in eqshard.__all__}
    for namespace in eqshard._NAMESPACES:
        module = getattr(eqshard, namespace)
        found |= {f"eqshard.{namespace}.{name}": getattr(module, name) for name in module.__all__}
    return found


def test_every_public_name_is_listed_and_resolves():
    assert set(eqshard._LAZY) <= set(eqshard.__all__)  # every lazily imported name
    assert set(eqshard.__all__) <= set(dir(eqshard))
    for name in eqshard.__all__:
        assert getattr(eqshard, name) is not None, name
    for name in ("apply", "plan", "constrain", "cost", "init", "restore", "report", "FSDP"):
        assert name in eqshard.__all__


def test_the_top_level_is_what_a_training_script_needs():
    # about 30 names: the verbs, the spec's types and the errors; the rest in namespaces
    assert len(eqshard.__all__) <= 36
    assert set(dir(eqshard)) == {*eqshard.__all__, *eqshard._NAMESPACES, "__version__"}
    for namespace in eqshard._NAMESPACES:
        module = getattr(eqshard, namespace)
        assert module is importlib.import_module(f"eqshard.{namespace}")
        assert not set(module.__all__) & set(eqshard.__all__), namespace  # one home each
    # one placing verb family, one spec word family
    assert {"apply", "constrain"} <= set(eqshard.__all__)
    assert not {"shard", "sharding"} & set(eqshard.__all__)
    assert [name for name in eqshard.__all__ if "spec" in name.lower()] == [
        "Spec",
        "SpecError",
        "spec_tree",
    ]


@pytest.mark.parametrize("name", sorted(eqshard._MOVED))
def test_a_moved_name_still_works_and_says_where_it_lives(name):
    namespace = eqshard._MOVED[name]
    moved = getattr(importlib.import_module(f"eqshard.{namespace}"), name)
    with pytest.warns(
        DeprecationWarning, match=rf"`eqshard.{name}` is now `eqshard.{namespace}.{name}`"
    ):
        old = getattr(eqshard, name)
    assert old is moved
    with pytest.warns(DeprecationWarning, match=namespace):  # again: not cached away
        assert getattr(eqshard, name) is moved


def test_from_imports_of_moved_names_warn_too():
    code = "from eqshard import Cost"
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "`eqshard.Cost` is now `eqshard.results.Cost`" in done.stderr


def test_shard_is_apply_for_one_array():
    import jax.numpy as jnp

    x = jnp.arange(32.0).reshape(4, 8)
    with pytest.warns(
        DeprecationWarning, match=r"`eqshard.shard\(x, expr\)` is now `eqshard.apply"
    ):
        shard = eqshard.shard  # pyright: ignore[reportAttributeAccessIssue]
    old, new = shard(x, "x y -> x y*"), eqshard.apply(x, "x y -> x y*")
    assert old.sharding.devices_indices_map(x.shape) == new.sharding.devices_indices_map(x.shape)


def test_version_warning_is_public_and_an_eqshard_warning():
    assert issubclass(eqshard.VersionWarning, eqshard.EqshardWarning)
    assert eqshard.VersionWarning.__module__ == "eqshard"
    from eqshard import _compat

    assert _compat.VersionWarning is eqshard.VersionWarning


def test_unused_rules_pickle_by_their_public_home():
    rule = eqshard.resolvers.UnusedRule(0, "layers.*.weight", "matched nothing")
    assert pickle.loads(pickle.dumps(rule)) == rule  # under filterwarnings=error: no shim


def _words(obj) -> int:
    return len((inspect.getdoc(obj) or "").split())


def test_no_public_docstring_is_longer_than_equinox_would_write():
    # Equinox's longest (`Module`) is 333 words; the essays live in the guides
    long = {name: _words(obj) for name, obj in _public().items() if _words(obj) > 400}
    assert long == {}


def test_no_module_does_several_rooms_worth_of_jobs():
    lines = {
        str(path.relative_to(PACKAGE)): len(path.read_text().splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert {path: n for path, n in lines.items() if n > 800} == {}


def test_help_lists_the_lazy_names_too():
    text = pydoc.render_doc(eqshard, renderer=getattr(pydoc, "plaintext"))  # noqa: B009
    for name in ("apply(", "plan(", "cost(", "restore(", "class Plan", "class Rules"):
        assert name in text, name


def test_importing_eqshard_starts_no_jax():
    code = "import sys, eqshard; eqshard.load({'eqshard': 1}); print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
