"""Copy MaxText's own sharding goldens into tests/peers/maxtext_goldens.json.

MaxText checks in, under `tests/utils/sharding_info/<model>/<topology>/slice_1/<rule>/`, what its
`tests/utils/sharding_dump.py` printed for a model on a compile-only TPU topology:
`logical_shardings.json` (each parameter's logical names), `named_shardings.json` (the
`NamedSharding` it got: Linen's `get_abstract_state`, through Flax's
`nn.logical_to_mesh_sharding`, so size-1 mesh axes stay) and `input_shardings.json` (each
activation constrained by `maybe_shard_with_name` with `debug_sharding`: logical names and the
spec after `remove_size_one_mesh_axis`). `tests/unit/sharding_compare_test.py` holds MaxText
to them.

This script reads them from a bare clone of MaxText at `maxtext_rules.MAXTEXT_COMMIT` (the
mirror the `fetch` tool makes, or `--git-dir`), with the rules each used (base.yml's; or
`custom_mesh_and_rule/<name>.yml`'s, which replace them), and writes one case per parameter
(the optimizer state's copies left out) and per activation whose logical names were logged.
It needs PyYAML and git; the JSON it writes needs neither.

Run: `python tests/peers/extract_maxtext_goldens.py [--git-dir DIR]`.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import maxtext_rules
import yaml

OUT = Path(__file__).with_name("maxtext_goldens.json")
GOLDENS = "tests/utils/sharding_info"
CUSTOM_RULES = "src/maxtext/configs/custom_mesh_and_rule"
DEFAULT_GIT_DIR = "/work/.mirror/AI-Hypercomputer+maxtext/repo"


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", git_dir, *args], capture_output=True, text=True, check=True
    ).stdout


def _show(git_dir: str, path: str) -> str:
    return _git(git_dir, "show", f"{maxtext_rules.MAXTEXT_COMMIT}:{path}")


def _rule_set(rule_dir: str) -> str:
    """The rules a golden folder used: "base", or the custom file its name starts with."""
    name = rule_dir.removeprefix("rule_")
    if name == "default" or name.startswith("default_"):
        return "base"
    return name.split("_")[0]


def _parse_spec(text: str) -> list[Any] | None:
    """`P('fsdp', None)` as a list; None where it holds what JSON cannot (UNCONSTRAINED)."""
    if not (text.startswith("P(") and text.endswith(")")):
        raise ValueError(f"not a PartitionSpec: {text}")
    try:
        value = ast.literal_eval(text[1:] if text != "P()" else "()")
    except ValueError:
        return None
    value = value if isinstance(value, tuple) else (value,)
    return [list(v) if isinstance(v, tuple) else v for v in value]


def extract(git_dir: str) -> dict[str, Any]:
    """The goldens of every folder, as data."""
    files = _git(
        git_dir, "ls-tree", "-r", "--name-only", maxtext_rules.MAXTEXT_COMMIT, GOLDENS
    ).split()
    folders = sorted({f.rsplit("/", 1)[0] for f in files})
    rule_sets: dict[str, Any] = {}
    goldens: dict[str, Any] = {}
    cases: list[dict[str, Any]] = []
    for folder in folders:
        rules_name = _rule_set(folder.rsplit("/", 1)[1])
        if rules_name not in rule_sets:
            if rules_name == "base":
                rule_sets["base"] = {"source": "src/maxtext/configs/base.yml", "rules": None}
            else:
                path = f"{CUSTOM_RULES}/{rules_name}.yml"
                config = yaml.safe_load(_show(git_dir, path))
                rule_sets[rules_name] = {
                    "source": path,
                    "mesh_axes": config["mesh_axes"],
                    "rules": config["logical_axis_rules"],
                }
        logical = json.loads(_show(git_dir, f"{folder}/logical_shardings.json"))
        named = json.loads(_show(git_dir, f"{folder}/named_shardings.json"))
        mesh: dict[str, int] = {}
        for path, entry in named.items():
            mesh = mesh or {a: entry["mesh"]["shape"][a] for a in entry["mesh"]["axis_names"]}
            if not path.startswith(".params/") or path not in logical:
                continue
            cases.append(
                {
                    "golden": folder,
                    "kind": "param",
                    "path": path,
                    "shape": entry["shape"],
                    "names": logical[path]["partition_spec"],
                    "expected": entry["partition_spec"],
                }
            )
        inputs = json.loads(_show(git_dir, f"{folder}/input_shardings.json"))
        for item in inputs["Activation Sharding Dump"]:
            ((key, entry),) = item.items()
            if entry["logic_axes"] == "Unknown":
                continue
            names = ast.literal_eval(entry["logic_axes"])
            expected = _parse_spec(entry["PartitionSpec"])
            if expected is None:
                continue
            cases.append(
                {
                    "golden": folder,
                    "kind": "activation",
                    "path": key,
                    "names": list(names) if isinstance(names, tuple) else [names],
                    "expected": expected,
                }
            )
        goldens[folder] = {"rules": rules_name, "mesh": mesh}
    return {
        "generated_by": "python tests/peers/extract_maxtext_goldens.py",
        "maxtext": {
            "repo": maxtext_rules.MAXTEXT_REPO,
            "commit": maxtext_rules.MAXTEXT_COMMIT,
            "goldens": GOLDENS,
            "made_by": "tests/utils/sharding_dump.py",
            "checked_by": "tests/unit/sharding_compare_test.py",
        },
        "rule_sets": rule_sets,
        "goldens": goldens,
        "cases": cases,
    }


def render(data: dict[str, Any]) -> str:
    """JSON with one case per line."""
    head = {k: v for k, v in data.items() if k != "cases"}
    text = json.dumps(head, indent=1)
    rows = ",\n".join("  " + json.dumps(case) for case in data["cases"])
    return text[:-2] + ',\n "cases": [\n' + rows + "\n ]\n}\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Copy MaxText's sharding goldens.")
    parser.add_argument("--git-dir", default=DEFAULT_GIT_DIR, help="a clone of MaxText")
    args = parser.parse_args(argv)
    text = render(extract(args.git_dir))
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
