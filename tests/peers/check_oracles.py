"""Check that every oracle here gives each peer's own expected answers; exit 1 where one fails.

Run `python tests/peers/check_oracles.py` (no pytest, no JAX, no eqshard). It checks:

- `flax_rules`: each of `LINEN_CASES` and `NNX_CASES` (Flax's tests);
- `haliax_rules`: each of `CASES` (Haliax's tests);
- `maxtext_rules`: each case of `maxtext_goldens.json` (MaxText's own sharding goldens: a
  parameter's spec is Flax's, size-1 axes kept; an activation's is MaxText's, size-1 axes
  dropped);
- that `maxtext_expected.json` is what `generate.py` writes now.

`tests/peers/test_oracles.py` runs the same checks under pytest.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import flax_rules
import generate
import haliax_rules
import maxtext_rules

GOLDENS = Path(__file__).with_name("maxtext_goldens.json")


def check_linen_case(case: flax_rules.LinenCase) -> str | None:
    """None where the oracle gives Flax's answer, else what differs."""
    try:
        if case.api == "logical_to_mesh_axes":
            got = flax_rules.flax_logical_to_mesh_axes(case.names, case.rules)
        else:
            got = flax_rules.flax_constraint_spec(case.names, case.rules, case.fallback)
    except Exception as error:
        if case.raises is not None and isinstance(error, case.raises):
            return None
        return f"{case.id}: raised {error!r}"
    if case.raises is not None:
        return f"{case.id}: gave {got}, Flax raises {case.raises.__name__}"
    if got != case.expected:
        return f"{case.id}: gave {got}, Flax expects {case.expected}"
    return None


def check_nnx_case(case: flax_rules.NnxCase) -> str | None:
    """None where the oracle gives Flax's answer, else what differs."""
    got = flax_rules.nnx_var_pspec(case.sharding, case.context_rules, case.local_rules)
    return None if got == case.expected else f"{case.id}: gave {got}, Flax expects {case.expected}"


def check_haliax_case(case: haliax_rules.HaliaxCase) -> str | None:
    """None where the oracle gives Haliax's answer, else what differs."""
    got = haliax_rules.haliax_pspec_for_axis(case.names, case.mapping)
    return (
        None if got == case.expected else f"{case.id}: gave {got}, Haliax expects {case.expected}"
    )


def golden_cases() -> Iterator[tuple[Mapping[str, Any], Mapping[str, Any], flax_rules.Rules]]:
    """Each case of `maxtext_goldens.json`, its golden folder, and the rules that folder used."""
    data = json.loads(GOLDENS.read_text())
    rule_sets = {
        name: maxtext_rules.LOGICAL_AXIS_RULES
        if name == "base"
        else maxtext_rules.lists_to_tuples(entry["rules"])
        for name, entry in data["rule_sets"].items()
    }
    for case in data["cases"]:
        golden = data["goldens"][case["golden"]]
        yield case, golden, rule_sets[golden["rules"]]


def check_golden_case(
    case: Mapping[str, Any], golden: Mapping[str, Any], rules: flax_rules.Rules
) -> str | None:
    """None where the oracle gives MaxText's golden spec, else what differs."""
    if case["kind"] == "param":
        spec = maxtext_rules.flax_partition_spec(case["names"], rules)
    else:
        spec = maxtext_rules.maxtext_partition_spec(case["names"], golden["mesh"], rules)
    got = [list(e) if isinstance(e, tuple) else e for e in spec]
    if got != case["expected"]:
        return f"{case['golden']} {case['path']}: gave {got}, MaxText's golden {case['expected']}"
    return None


def check_expected_table() -> str | None:
    """None where `maxtext_expected.json` is what `generate.py` writes now."""
    if generate.OUT.read_text() != generate.render(generate.table()):
        return f"{generate.OUT.name} is stale: run python tests/peers/generate.py"
    return None


def main() -> int:
    results: dict[str, list[str | None]] = {
        "Flax (Linen)": [check_linen_case(c) for c in flax_rules.LINEN_CASES],
        "Flax (NNX)": [check_nnx_case(c) for c in flax_rules.NNX_CASES],
        "Haliax": [check_haliax_case(c) for c in haliax_rules.CASES],
        "MaxText goldens": [check_golden_case(*c) for c in golden_cases()],
        "maxtext_expected.json": [check_expected_table()],
    }
    failed = 0
    for name, outcomes in results.items():
        faults = [f for f in outcomes if f is not None]
        failed += len(faults)
        print(f"{name}: {len(outcomes) - len(faults)}/{len(outcomes)} agree")
        for fault in faults:
            print(f"  {fault}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
