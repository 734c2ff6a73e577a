"""eqshard puts every block on the same device as einshard does.

Two checks: einshard's documented examples, whose device lists are written out
here from its docs; and, where an interpreter with einshard is available (set
`EQSHARD_EINSHARD_PYTHON`, as `.ci/run` does), a comparison with the einshard
package itself over every expression of a small grammar, on 1 to 16 devices.
"""

import itertools
import math
import os

import pytest

import eqshard
from eqshard._layout import layout


def _by_block(blocks):
    """{tuple of (start, stop): sorted device ids} from a probe result."""
    result = {}
    for device, bounds in blocks.items():
        result.setdefault(tuple(map(tuple, bounds)), []).append(int(device))
    return {bounds: sorted(ids) for bounds, ids in result.items()}


# einshard docs/syntax.md, on 16 devices, written as {block bounds: devices}.
DOCUMENTED = [
    (
        "a b -> * a2 b",
        (4, 8),
        {((0, 2), (0, 8)): [0, 2, 4, 6, 8, 10, 12, 14], ((2, 4), (0, 8)): [1, 3, 5, 7, 9, 11, 13, 15]},
    ),
    (
        "a b -> 2 a2* b*",
        (4, 8),
        {
            ((0, 1), (0, 4)): [0, 8], ((0, 1), (4, 8)): [1, 9],
            ((1, 2), (0, 4)): [2, 10], ((1, 2), (4, 8)): [3, 11],
            ((2, 3), (0, 4)): [4, 12], ((2, 3), (4, 8)): [5, 13],
            ((3, 4), (0, 4)): [6, 14], ((3, 4), (4, 8)): [7, 15],
        },
    ),
    (
        "a b -> 2 a2 b4",
        (4, 8),
        {
            ((0, 2), (0, 2)): [0, 8], ((0, 2), (2, 4)): [1, 9],
            ((0, 2), (4, 6)): [2, 10], ((0, 2), (6, 8)): [3, 11],
            ((2, 4), (0, 2)): [4, 12], ((2, 4), (2, 4)): [5, 13],
            ((2, 4), (4, 6)): [6, 14], ((2, 4), (6, 8)): [7, 15],
        },
    ),
]  # fmt: skip

# einshard's own test table: the shape of one shard.
SHARD_SHAPES = [
    ("a -> 16 a", (2,), (2,)),
    ("a b -> 2 a b*", (2, 8), (2, 1)),
    ("... a -> 2 ... a*", (2, 8), (2, 1)),
    ("a b c -> a2* b2 c*", (4, 16, 8), (1, 8, 4)),
]


def test_documented_examples_on_16_devices(probe):
    cases = [[expr, list(shape)] for expr, shape, _ in DOCUMENTED]
    cases += [[expr, list(shape)] for expr, shape, _ in SHARD_SHAPES]
    cases += [
        ["a ... d -> 4 a2 ... d2", [4, 8, 20, 10]],
        ["a b c d -> 4 a2 b c d2", [4, 8, 20, 10]],
    ]
    results = probe("eqshard", 16, cases)
    for (expr, _shape, expected), result in zip(DOCUMENTED, results):
        assert _by_block(result["blocks"]) == expected, expr
    for (expr, _shape, shard_shape), result in zip(SHARD_SHAPES, results[len(DOCUMENTED) :]):
        bounds = result["blocks"]["0"]
        assert tuple(stop - start for start, stop in bounds) == shard_shape, expr
    # '...' stands for the axes it replaces: both spellings give the same blocks.
    assert results[-1] == results[-2]


def test_documented_examples_on_8_devices(probe):
    # einshard's test table: 'a b -> * a* b*' on 8 devices gives (2, 2) shards.
    (result,) = probe("eqshard", 8, [["a b -> * a* b*", [4, 4]]])
    assert {tuple(tuple(b) for b in bounds) for bounds in result["blocks"].values()} == {
        ((0, 2), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (0, 2)), ((2, 4), (2, 4))
    }  # fmt: skip


# --------------------------------------------------------------------------- #
# Against the einshard package.
# --------------------------------------------------------------------------- #

DEVICE_COUNTS = [1, 2, 6, 8, 12, 16]
_MODIFIERS = ["", "2", "3", "*", "2*"]
_STANDALONE = [None, "2", "*", "2*", "3"]


def _grammar():
    """Every expression over axes a, b of a small grammar, with '...' variants."""
    for ma, mb in itertools.product(_MODIFIERS, repeat=2):
        for order in (("a", "b"), ("b", "a")):
            right = [f"{name}{ma if name == 'a' else mb}" for name in order]
            for extra in _STANDALONE:
                for at in range(len(right) + 1) if extra else [0]:
                    items = right[:at] + ([extra] if extra else []) + right[at:]
                    yield f"a b -> {' '.join(items)}", [48, 96]
    for right in ["* ...", "... 2*", "2 ... a*", "a* ...", "... a2*", "a2 ... *"]:
        left = "a ..." if "a" in right.split("...")[0] else "... a"
        if "a" not in right:
            left = "..."
        yield f"{left} -> {right}", [48, 4, 96]


def _einshard_python():
    python = os.environ.get("EQSHARD_EINSHARD_PYTHON")
    if not python:
        pytest.skip("set EQSHARD_EINSHARD_PYTHON to an interpreter with einshard (Python >= 3.12)")
    return python


@pytest.mark.parametrize("n_devices", DEVICE_COUNTS)
def test_same_blocks_as_the_einshard_package(n_devices, probe):
    python = _einshard_python()
    cases = [list(case) for case in _grammar()]
    ours = probe("eqshard", n_devices, cases)
    theirs = probe("einshard", n_devices, cases, python=python)
    agreed = 0
    for (expr, _shape), mine, other in zip(cases, ours, theirs):
        if "blocks" in other:
            # einshard accepted it, so eqshard must accept it and place it the same.
            assert "blocks" in mine, f"{expr} on {n_devices}: einshard accepts, eqshard says {mine}"
            assert _by_block(mine["blocks"]) == _by_block(other["blocks"]), f"{expr} on {n_devices}"
            agreed += 1
        else:
            # einshard rejected it: eqshard must reject it too, with a clear error.
            assert "ExpressionError" in mine.get("error", ""), (expr, n_devices, mine, other)
    assert agreed >= 20


def test_exact_roots_where_einshard_fails(probe):
    # einshard computes 64 ** (1/3) == 3.9999999999999996 and asserts on it.
    python = _einshard_python()
    cases = [["a b c -> a* b* c*", [4, 4, 4]]]
    (theirs,) = probe("einshard", 64, cases, python=python)
    assert theirs["error"].startswith("AssertionError")
    lay = layout(eqshard.expression.parse(cases[0][0]), (4, 4, 4), 64)
    assert lay.mesh_shape == (4, 4, 4)
    assert math.prod(lay.mesh_shape) == 64
