"""The public face of the package: what `help(eqshard)` and `dir(eqshard)` list,
and what importing it costs."""

import pydoc
import subprocess
import sys

import eqshard


def test_every_public_name_is_listed_and_resolves():
    assert set(eqshard._LAZY) <= set(eqshard.__all__)  # every lazily imported name
    assert set(eqshard.__all__) <= set(dir(eqshard))
    for name in eqshard.__all__:
        assert getattr(eqshard, name) is not None, name
    for name in ("apply", "plan", "constrain", "cost", "init", "restore", "report", "FSDP"):
        assert name in eqshard.__all__


def test_help_lists_the_lazy_names_too():
    text = pydoc.render_doc(eqshard, renderer=getattr(pydoc, "plaintext"))  # noqa: B009
    for name in ("apply(", "plan(", "cost(", "restore(", "class Plan", "class Rules"):
        assert name in text, name


def test_importing_eqshard_starts_no_jax():
    code = "import sys, eqshard; eqshard.load({'eqshard': 1}); print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
