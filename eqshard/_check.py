"""`eqshard check`: resolve a spec file against an abstract model, on N devices.

Nothing here touches device memory: the model is built with
`eqx.filter_eval_shape`, and each device count is a subset of simulated devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
from rich.table import Table

from ._errors import EqshardError, Problem
from ._plan import make_plan
from ._report import LeafRow, leaf_rows, leaf_table, total_bytes_per_device
from ._specfile import Rules

__all__ = ["CheckResult", "abstract_model", "check", "result_table"]


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What `check` found for one device count."""

    source: str
    devices: int
    rows: list[LeafRow]
    problems: list[Problem]
    notes: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bytes_per_device(self) -> int | None:
        return total_bytes_per_device(self.rows)

    @property
    def coverage(self) -> dict[str, int]:
        """How many array leaves rules, dims and the default each gave an expression."""
        return _coverage(self.rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.source,
            "devices": self.devices,
            "ok": self.ok,
            "leaves": [dataclasses.asdict(row) for row in self.rows],
            "bytes_per_device": self.bytes_per_device,
            "coverage": self.coverage,
            "problems": [p.to_json() for p in self.problems],
            "notes": self.notes,
        }


def _coverage(rows: Sequence[LeafRow]) -> dict[str, int]:
    """How many array leaves rules, dims and the default gave an expression, and how
    many got none (under `"default": "error"`, or where a dim did not fit)."""
    counts = {"rules": 0, "dims": 0, "default": 0, "none": 0}
    for row in rows:
        if row.expression is None:
            key = "none"
        elif (row.origin or "").startswith("$.rules"):
            key = "rules"
        else:
            key = row.origin or "default"
        counts[key] = counts.get(key, 0) + 1
    return counts


class ModelError(EqshardError):
    """The model named by `--model` cannot be imported or built (exit code 2)."""

    exit_code = 2


def _import(target: str, module_name: str) -> Any:
    """Imports the user's module: a dotted name, or a `.py` file whose folder is
    appended to `sys.path` (so its sibling modules import, and never shadow the
    standard library)."""
    try:
        if not (module_name.endswith(".py") or "/" in module_name or os.sep in module_name):
            return importlib.import_module(module_name)
        path = Path(module_name)
        if not path.is_file():
            raise ModelError(f"--model {target!r}: there is no file {module_name!r}")
        if path.suffix != ".py":
            raise ModelError(
                f"--model {target!r}: {module_name!r} is not a Python file; name a .py "
                "file or a dotted module"
            )
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.append(folder)
        name = f"_eqshard_model_{path.stem}"  # never shadows a module such as `json`
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ModelError(f"--model {target!r}: cannot load {module_name!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    except EqshardError:
        raise
    except KeyboardInterrupt:
        raise
    except ImportError as error:
        raise ModelError(f"--model {target!r}: cannot import {module_name!r}: {error}") from None
    except BaseException as error:  # the user's module failed: report, don't crash
        raise ModelError(
            f"--model {target!r}: importing {module_name!r} raised {type(error).__name__}: {error}"
        ) from None


def abstract_model(target: str) -> Any:
    """Builds `MODULE:CALLABLE` abstractly. MODULE is a dotted module name or a `.py` file.

    This is the one place where eqshard imports user code, and only because the
    user named it on the command line; a spec file never does.
    """
    module_name, sep, attribute = target.rpartition(":")
    if not sep or not module_name or not attribute:
        raise ModelError(
            f"--model {target!r}: write MODULE:CALLABLE, e.g. 'mypkg.model:build' or "
            "'model.py:build', where CALLABLE() returns the model"
        )
    # The user's code may print: keep stdout for eqshard's own output (JSON, tables).
    with contextlib.redirect_stdout(sys.stderr):
        module = _import(target, module_name)
        factory = getattr(module, attribute, None)
        if not callable(factory):
            raise ModelError(f"--model {target!r}: {module_name} has no callable {attribute!r}")
        try:
            model = eqx.filter_eval_shape(factory)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # the user's code failed: report, don't crash
            raise ModelError(
                f"--model {target!r}: {attribute}() raised {type(error).__name__}: {error}"
            ) from None
    if not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree_util.tree_leaves(model)):
        raise ModelError(
            f"--model {target!r}: {attribute}() returned {type(model).__name__}, which holds "
            "no arrays; name a callable that builds the model"
        )
    return model


def check(
    rules: Rules, model: Any, device_counts: Sequence[int], *, strict: bool = False
) -> list[CheckResult]:
    """Lays out `model` under `rules` on each device count; collects every fault.

    Every leaf that can be laid out is, so one run reports every independent fault:
    expressions that do not fit, the file's device count, unmatched leaves under
    `"default": "error"`, and (with `strict`) rules that match nothing.
    """
    results = []
    for n in device_counts:
        planned = make_plan(model, rules, devices=jax.devices()[:n])
        problems = list(planned.problems)
        notes = []
        for problem in (p for warning in planned.warnings for p in warning.problems):
            if strict:
                problems.append(Problem(problem.where, f"{problem.message} (--strict)"))
            else:
                notes.append(str(problem))
        rows = leaf_rows(planned.plan)
        results.append(CheckResult(rules.source, n, rows, problems, notes))
    return results


def result_table(result: CheckResult) -> Table:
    """The per-leaf table of one check."""
    return leaf_table(result.rows, title=f"{result.source} on {result.devices} devices")
