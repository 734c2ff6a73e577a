"""Every code block of README.md and of the documentation (docs/) runs in the test
suite, through Sybil. Each document is read on its own, as a reader reads a page:

- `python` blocks run in order, in one namespace per document (`>>>` blocks are
    doctests, their output compared);
- `console` blocks run each `$ eqshard ...` line (as `python -m eqshard`, from the
    repository's root) and compare what it prints with the lines under it;
- `json` blocks parse; a spec file (one with `"eqshard"`) is loaded by
    `eqshard.load`, so the schema and every rule are checked, and written to
    `model.eqshard.json` in the document's working directory (a fresh temporary
    one each), as a reader would save it;
- `yaml` blocks (pre-commit) name hooks that `.pre-commit-hooks.yaml` defines;
- any other block fails, unless `<!-- skip: next "why" -->` comes before it: none
    is skipped silently, and each skip shows its reason in the test report.

`pytest -n auto` (pytest-xdist) runs the suite in a process per core, at most
`MAX_WORKERS`, each test file in one process (`--dist loadfile`, in pyproject.toml),
so a file's fixtures are built once.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)  # as tests/conftest.py: before JAX starts

from sybil import Example, Sybil  # noqa: E402
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser  # noqa: E402
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer  # noqa: E402

ROOT = Path(__file__).parent

# Each test process holds JAX with 8 simulated devices, and many tests start worker
# processes or XLA:TPU compiles (about 1.8 cores each) of their own: past 4 test
# processes, more only share the same cores and memory.
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's, where it is installed
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many test processes `-n auto` starts: one per core, at most `MAX_WORKERS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


_RUN = ("python", "console", "json", "yaml")


def _console(example: Example) -> None:
    """Runs each `$ ` line and compares its output with the lines under it."""
    blocks = re.split(r"^\$ ", str(example.parsed), flags=re.MULTILINE)[1:]
    if not blocks:
        raise AssertionError("a console block with no `$ ` line")
    for block in blocks:
        command, _, expected = block.partition("\n")
        argv = shlex.split(command)
        if argv[0] != "eqshard":  # nothing else runs from the docs: skip it, named
            raise AssertionError(f"$ {command}: a console block runs `eqshard` commands only")
        argv = [sys.executable, "-m", "eqshard", *argv[1:]]
        env = {**os.environ, "COLUMNS": "100", "TERM": "dumb", "NO_COLOR": "1"}
        run = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
        got = [line.rstrip() for line in (run.stdout + run.stderr).rstrip().splitlines()]
        want = [line.rstrip() for line in expected.rstrip().splitlines()]
        if got != want:
            raise AssertionError(
                f"$ {command}\nprinted:\n"
                + "\n".join(got)
                + f"\n{example.path} shows:\n"
                + "\n".join(want)
            )


def _json(example: Example) -> None:
    document = json.loads(str(example.parsed))
    if isinstance(document, dict) and "eqshard" in document:
        import eqshard

        eqshard.load(document)
        Path("model.eqshard.json").write_text(str(example.parsed))


def _yaml(example: Example) -> None:
    defined = set(re.findall(r"^- id: (\S+)$", (ROOT / ".pre-commit-hooks.yaml").read_text(), re.M))
    named = set(re.findall(r"\bid: (\S+)", str(example.parsed)))
    if not named or not named <= defined:
        raise AssertionError(f"hooks {sorted(named - defined)} are not in .pre-commit-hooks.yaml")


class _Named:
    """A parser for one language's fenced blocks, evaluated by `evaluate`."""

    def __init__(self, language: str, evaluate: Any) -> None:
        self.lexer = FencedCodeBlockLexer(language=re.escape(language))
        self.evaluate = evaluate

    def __call__(self, document: Any) -> Any:
        for region in self.lexer(document):
            region.parsed = region.lexemes["source"]
            region.evaluator = self.evaluate
            yield region


class _Unrun:
    """Blocks in a language nothing runs: each fails unless a skip names why."""

    lexer = FencedCodeBlockLexer(language=r"(?!(?:" + "|".join(_RUN) + r")$)[^\n]*")

    def __call__(self, document: Any) -> Any:
        for region in self.lexer(document):
            language = region.lexemes.get("language") or "(no language)"

            def fail(example: Example, language: str = language) -> None:
                raise AssertionError(
                    f"{example.path}:{example.line}: a `{language}` block that nothing runs; "
                    'run it (python, console, json, yaml) or put <!-- skip: next "why" --> '
                    "before it"
                )

            region.evaluator = fail
            yield region


def _setup(namespace: dict[str, Any]) -> None:
    """A document's blocks run in a fresh temporary directory, as a reader's would."""
    namespace["__document_dirs__"] = (os.getcwd(), tempfile.mkdtemp(prefix="eqshard-readme-"))
    os.chdir(namespace["__document_dirs__"][1])


def _teardown(namespace: dict[str, Any]) -> None:
    cwd, directory = namespace["__document_dirs__"]
    os.chdir(cwd)
    shutil.rmtree(directory, ignore_errors=True)


pytest_collect_file = Sybil(
    parsers=[
        PythonCodeBlockParser(),
        _Named("console", _console),
        _Named("json", _json),
        _Named("yaml", _yaml),
        _Unrun(),
        SkipParser(),
    ],
    patterns=["README.md", "docs/*.md", "docs/*/*.md"],
    excludes=["*/README.md"],  # the package's design notes are not this README
    setup=_setup,
    teardown=_teardown,
).pytest()
