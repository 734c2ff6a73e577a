"""Write tests/peers/maxtext_expected.json: every (rules, setting, model leaf) and its spec.

Only the oracles make it (`maxtext_rules`, over `flax_rules`): no eqshard, no JAX. Run
`python tests/peers/generate.py` to write the file, `--check` to fail where it differs.

Each row of `expected`:

- `rules`: "base" (base.yml's rules) or "llama2-7b" (with llama2-7b.yml's `norm` rule);
- `setting`, `model`, `kind` ("param" or "activation"), `path`, `shape`, `names`;
- `flax`: Flax's `nn.logical_to_mesh_axes`, as a `PartitionSpec` holds it (size-1 axes kept:
  MaxText's Linen parameters and `nn.with_logical_constraint`);
- `maxtext`: MaxText's `sharding.logical_to_mesh_axes` (size-1 axes dropped: activations and
  the NNX model's parameters);
- `divisible`: whether each dimension divides by the product of its mesh axes' sizes.

A spec entry is null (whole), a mesh axis, or a list of mesh axes (major to minor).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import flax_rules
import maxtext_models
import maxtext_rules
import maxtext_settings

OUT = Path(__file__).with_name("maxtext_expected.json")

RULE_SETS: Mapping[str, tuple[flax_rules.Rules, str, tuple[str, ...]]] = {
    "base": (
        maxtext_rules.LOGICAL_AXIS_RULES,
        "src/maxtext/configs/base.yml lines 532-638",
        ("llama", "mixtral"),
    ),
    "llama2-7b": (
        maxtext_rules.LLAMA2_7B_LOGICAL_AXIS_RULES,
        "base.yml's rules merged with src/maxtext/configs/models/llama2-7b.yml line 29",
        ("llama",),
    ),
}


def _json_spec(spec: Sequence[flax_rules.Entry]) -> list[Any]:
    out: list[Any] = []
    for entry in spec:
        if isinstance(entry, flax_rules.Unconstrained):
            raise ValueError("UNCONSTRAINED has no JSON form here")
        out.append(list(entry) if isinstance(entry, tuple | list) else entry)
    return out


def _divisible(
    shape: Sequence[int], spec: Sequence[flax_rules.Entry], mesh: Mapping[str, int]
) -> bool:
    for size, entry in zip(shape, spec):
        if entry is None or isinstance(entry, flax_rules.Unconstrained):
            axes: Sequence[str] = ()
        else:
            axes = (entry,) if isinstance(entry, str) else entry
        if size % math.prod(mesh[a] for a in axes):
            return False
    return True


def table() -> dict[str, Any]:
    """The whole file, as data."""
    rows: list[dict[str, Any]] = []
    for rules_name, (rules, _, models) in RULE_SETS.items():
        for setting in maxtext_settings.SETTINGS:
            mesh = setting.mesh_shape()
            for model in models:
                params, activations = maxtext_models.MODELS[model]
                for kind, leaves in (("param", params), ("activation", activations)):
                    for leaf in leaves:
                        flax = maxtext_rules.flax_partition_spec(leaf.names, rules)
                        spec = maxtext_rules.maxtext_partition_spec(leaf.names, mesh, rules)
                        rows.append(
                            {
                                "rules": rules_name,
                                "setting": setting.name,
                                "model": model,
                                "kind": kind,
                                "path": leaf.path,
                                "shape": list(leaf.shape),
                                "names": list(leaf.names),
                                "flax": _json_spec(flax),
                                "maxtext": _json_spec(spec),
                                "divisible": _divisible(leaf.shape, spec, mesh),
                            }
                        )
    return {
        "generated_by": "python tests/peers/generate.py",
        "maxtext": {"repo": maxtext_rules.MAXTEXT_REPO, "commit": maxtext_rules.MAXTEXT_COMMIT},
        "flax": {"repo": flax_rules.FLAX_REPO, "commit": flax_rules.FLAX_COMMIT},
        "mesh_axes": list(maxtext_rules.MESH_AXES),
        "rule_sets": {
            name: {"source": source, "rules": [[n, _json_value(v)] for n, v in rules]}
            for name, (rules, source, _) in RULE_SETS.items()
        },
        "settings": {
            s.name: {"description": s.description, "ici": dict(s.ici), "mesh": s.mesh_shape()}
            for s in maxtext_settings.SETTINGS
        },
        "models": {
            model: {
                kind: {
                    leaf.path: {
                        "shape": list(leaf.shape),
                        "names": list(leaf.names),
                        "source": leaf.source,
                    }
                    for leaf in leaves
                }
                for kind, leaves in (("params", params), ("activations", activations))
            }
            for model, (params, activations) in maxtext_models.MODELS.items()
        },
        "expected": rows,
    }


def _json_value(value: flax_rules.RuleValue) -> Any:
    return list(value) if isinstance(value, tuple | list) else value


def render(data: Mapping[str, Any]) -> str:
    """JSON with one row of `expected` per line, so a diff shows which rows changed."""
    head = {k: v for k, v in data.items() if k != "expected"}
    text = json.dumps(head, indent=1)
    rows = ",\n".join("  " + json.dumps(row) for row in data["expected"])
    return text[:-2] + ',\n "expected": [\n' + rows + "\n ]\n}\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write tests/peers/maxtext_expected.json.")
    parser.add_argument("--check", action="store_true", help="fail where the file differs")
    args = parser.parse_args(argv)
    text = render(table())
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python tests/peers/generate.py", file=sys.stderr)
            return 1
        print(f"{OUT.name} is up to date")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
