"""eqshard's resolution of logical axis rules (`eqshard._logical.place`) against the
peers' own answers: Flax's Linen test cases, MaxText's goldens, and the expected
table the oracles give on eleven 8-device MaxText settings. These compare which mesh
axes each dim gets; tests/test_logical_axis_rules.py compares layouts device by device."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import flax_rules
import haliax_rules
import pytest

from eqshard import EqshardError
from eqshard._logical import axis_rules, place

HERE = Path(__file__).parent
EXPECTED = json.loads((HERE / "maxtext_expected.json").read_text())
GOLDENS = json.loads((HERE / "maxtext_goldens.json").read_text())


def _entry(axes: tuple[str, ...]) -> Any:
    """A dim's axes as a `PartitionSpec` entry: None, an axis, or a list of them."""
    return None if not axes else axes[0] if len(axes) == 1 else list(axes)


def _entries(spec: Sequence[Any]) -> list[Any]:
    """Flax's entries written as `_entry` writes them (a one-axis list is its axis)."""
    out = []
    for e in spec:
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        out.append(_entry(axes))
    return out


def _plain(case: flax_rules.LinenCase) -> bool:
    """A case of resolution alone, with no UNCONSTRAINED (which JSON cannot say)."""
    values = [v for _, v in case.rules] + list(case.names or ())
    return (
        case.api == "logical_to_mesh_axes"
        and case.names is not None
        and not any(isinstance(v, flax_rules.Unconstrained) for v in values)
    )


@pytest.mark.parametrize(
    "case", [c for c in flax_rules.LINEN_CASES if _plain(c)], ids=lambda c: c.id
)
def test_flax_linens_own_cases(case: flax_rules.LinenCase) -> None:
    rules = axis_rules(case.rules)
    assert case.names is not None
    names = [n if isinstance(n, str) else None for n in case.names]
    if case.raises is not None:
        with pytest.raises(EqshardError, match="twice"):
            place(names, rules, {})
        return
    axes = {a for rule in rules for a in rule.axes}
    placed = place(names, rules, dict.fromkeys(axes, 2))  # no axis of size 1: Flax's answer
    assert case.expected is not None
    assert [_entry(p.axes) for p in placed] == _entries(case.expected)


def _maxtext(names: Sequence[str], mesh: Mapping[str, int], rules: Any) -> list[Any]:
    return [_entry(p.axes) for p in place(names, axis_rules(rules), mesh)]


def test_maxtexts_expected_table_on_eleven_settings() -> None:
    """Every row of the oracles' table: MaxText's spec, size-1 axes dropped."""
    rows = EXPECTED["expected"]
    assert len(rows) == 759
    faults = []
    for row in rows:
        rules = EXPECTED["rule_sets"][row["rules"]]["rules"]
        mesh = EXPECTED["settings"][row["setting"]]["mesh"]
        got = _maxtext(row["names"], mesh, rules)
        if got != _entries(row["maxtext"]):
            faults.append((row["setting"], row["path"], got, row["maxtext"]))
    assert faults == []


def test_maxtexts_own_goldens() -> None:
    """MaxText's goldens (tests/utils/sharding_info): its specs of three models' parameters
    and activations, under base.yml's rules and its custom ones. Where a golden keeps
    size-1 axes (Linen's parameters), dropping them changes no layout: compared without."""
    faults = []
    for case in GOLDENS["cases"]:
        golden = GOLDENS["goldens"][case["golden"]]
        rule_set = GOLDENS["rule_sets"][golden["rules"]]
        rules = (
            rule_set["rules"]
            if rule_set["rules"] is not None
            else EXPECTED["rule_sets"]["base"]["rules"]
        )
        mesh = golden["mesh"]
        want = [
            _entry(
                tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if mesh.get(a, 1) != 1)
            )
            for e in case["expected"]
        ]
        got = _maxtext(case["names"], mesh, rules)
        if got != want:
            faults.append((case["golden"], case["path"], got, want))
    assert len(GOLDENS["cases"]) == 502
    assert faults == []


def test_a_size_one_axis_claimed_first_keeps_a_later_rule_from_its_dim() -> None:
    """MaxText's case in issue 39: `expert` (size 1) is claimed by the batch's rule, so
    the sequence's rule that names it too cannot claim its dim, which stays whole."""
    rules = axis_rules(
        [
            ["activation_batch", ["data", "fsdp", "expert"]],
            ["activation_length", ["context", "expert"]],
        ]
    )
    mesh = {"data": 1, "fsdp": 4, "context": 2, "expert": 1}
    placed = place(["activation_batch", "activation_length"], rules, mesh)
    assert [p.axes for p in placed] == [("fsdp",), ()]
    assert placed[0].dropped == ("data", "expert")
    assert placed[1].rule is None


@pytest.mark.parametrize("case", haliax_rules.CASES, ids=lambda c: c.id)
def test_haliaxs_own_cases_device_by_device(case: haliax_rules.HaliaxCase) -> None:
    """Haliax's axis mapping (`dim2` to `data`, `dim3` to `model`, names with digits),
    as a table: each array named by Haliax's test is laid out as its expected spec is,
    device by device; the unmapped `dim1` stays whole, as in Haliax."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import eqshard

    rules = eqshard.Rules(
        logical_axis_rules=list(case.mapping.items()), mesh=(("data", 4), ("model", 2))
    )
    x = jnp.zeros((8,) * len(case.names))
    with eqshard.use(rules):
        got = eqshard.constrain(x, case.names)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    want = NamedSharding(mesh, P(*case.expected))
    assert got.sharding.devices_indices_map(x.shape) == want.devices_indices_map(x.shape)
