"""The package's rooms: imports point down the module map (eqshard/README.md), with
no cycle, counting every import: at module level, inside functions, and under
`TYPE_CHECKING`."""

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "eqshard"


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """The eqshard modules `name` imports anywhere in its text."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + [base] * bool(base))
            for alias in node.names:  # `from . import _report` names a module
                whole = f"{base}.{alias.name}"
                found.add(whole if whole in MODULES else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _cycle() -> list[str] | None:
    """One import cycle, as the modules around it, or `None`."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for other in sorted(GRAPH[name]):
            if state.get(other) == 1:
                return [*path[path.index(other) :], other]
            if other not in state and (found := visit(other)) is not None:
                return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(GRAPH):
        if name not in state and (found := visit(name)) is not None:
            return found
    return None


def test_the_imports_have_no_cycle():
    assert _cycle() is None, " -> ".join(_cycle() or [])


def test_the_rules_matcher_and_the_spec_file_layer_import_one_way():
    assert not {name for name in GRAPH["eqshard._rules"] if name.startswith("eqshard._specfile")}


def test_worker_processes_name_no_caller():
    folder = "eqshard._process."
    callers = {
        other
        for name, imported in GRAPH.items()
        if name.startswith(folder)
        for other in imported
        if not other.startswith(folder) and other.startswith(("eqshard._cli", "eqshard._search"))
    }
    assert not callers
    assert "_check" not in (PACKAGE / "_process" / "_workers.py").read_text().replace("_checks", "")


def test_nothing_imports_the_command_line_but_main():
    importers = {
        name
        for name, imported in GRAPH.items()
        if not name.startswith("eqshard._cli.")
        and any(other.startswith("eqshard._cli.") for other in imported)
    }
    assert importers == {"eqshard.__main__"}


def _private_reaches() -> list[str]:
    """Each place a module uses another module's private name: `from ._x import _y`
    where `_y` is not a module, or `_x._y` on a module it imported."""
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        modules: set[str] = set()  # the local names bound to eqshard modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("eqshard")
            ):
                for alias in node.names:
                    local = alias.asname or alias.name
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        is_module = any(module.endswith(f".{alias.name}") for module in GRAPH[name])
                        if is_module:
                            modules.add(local)
                        else:
                            found.append(
                                f"{name}: from {'.' * node.level}{node.module or ''} import {alias.name}"
                            )
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{name}: {node.value.id}.{node.attr}")
    return sorted(found)


def test_no_module_reaches_into_another_modules_private_names():
    assert _private_reaches() == []


# What runs without JAX: `eqshard validate`, `eqshard.load`, the pytest plugin. A
# folder here holds no module that imports JAX when it is imported.
WITHOUT_JAX = (
    "eqshard._errors",
    "eqshard._problems",
    "eqshard._warnings",
    "eqshard._expression",
    "eqshard._layout",
    "eqshard._fit",
    "eqshard._fsdp",
    "eqshard._paths.",
    "eqshard._specfile.",
    "eqshard._cost._hardware",
    "eqshard._cost._hlo.",
    "eqshard._cost._results",
    "eqshard.testing._plugin",
    "eqshard._search._strategy_names",  # the command line's help lists them
)


def test_what_runs_without_jax_imports_no_jax():
    names = [
        name
        for name in MODULES
        if any(name == m or (m.endswith(".") and name.startswith(m)) for m in WITHOUT_JAX)
    ]
    assert len(names) >= len(WITHOUT_JAX)
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'jax' not in sys.modules, name\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def _floors() -> dict[str, int]:
    """Each module's row in the module map's table (the package `testing/`, every
    module in it)."""
    floors: dict[str, int] = {}
    text = (PACKAGE / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and line.count("|") >= 4]
    for floor, row in enumerate(rows):
        cell = row.split("|")[2]
        for file in re.findall(r"`([\w/]+?)(?:\.py)?`", cell):
            if file.endswith("/"):
                folder = "eqshard." + file[:-1].replace("/", ".")
                for name in MODULES:
                    if name == folder or name.startswith(f"{folder}."):
                        floors[name] = floor
            else:
                floors[f"eqshard.{file}"] = floor
    return floors


def test_the_module_map_names_every_module_and_imports_point_down_it():
    floors = _floors()
    faces = {"eqshard", "eqshard.__main__"}  # the package's face, and `python -m eqshard`
    assert set(MODULES) - faces - set(floors) == set(), "modules the map does not name"
    upward = sorted(
        f"{name} -> {other}"
        for name, imported in GRAPH.items()
        if name not in faces
        for other in imported
        if other not in faces and floors[other] > floors[name]
    )
    assert upward == []


def test_only_compat_reads_jax_or_equinox_internals():
    readers = sorted(
        name
        for name, path in MODULES.items()
        if name != "eqshard._compat"
        and re.search(r"jax\._src|equinox\._|eqx\._|[.\"]\w+_size_in_bytes\b", path.read_text())
    )
    assert readers == []
