"""The oracles of tests/peers give the peers' own answers (see check_oracles.py)."""

from __future__ import annotations

from typing import Any

import check_oracles
import flax_rules
import haliax_rules
import pytest


@pytest.mark.parametrize("case", flax_rules.LINEN_CASES, ids=lambda c: c.id)
def test_flax_linen(case: flax_rules.LinenCase) -> None:
    assert check_oracles.check_linen_case(case) is None


@pytest.mark.parametrize("case", flax_rules.NNX_CASES, ids=lambda c: c.id)
def test_flax_nnx(case: flax_rules.NnxCase) -> None:
    assert check_oracles.check_nnx_case(case) is None


@pytest.mark.parametrize("case", haliax_rules.CASES, ids=lambda c: c.id)
def test_haliax(case: haliax_rules.HaliaxCase) -> None:
    assert check_oracles.check_haliax_case(case) is None


def test_maxtext_goldens() -> None:
    cases: list[Any] = list(check_oracles.golden_cases())
    assert len(cases) == 502
    faults = [f for f in (check_oracles.check_golden_case(*c) for c in cases) if f is not None]
    assert faults == []


def test_expected_table_is_current() -> None:
    assert check_oracles.check_expected_table() is None
