import pytest

import eqshard
from eqshard import ExpressionError
from eqshard._layout import integer_root


def _layout(text, shape, n):
    return eqshard.expression.layout(eqshard.expression.parse(text), shape, n)


@pytest.mark.parametrize(
    ("text", "shape", "n", "mesh_shape", "mesh_axes", "spec"),
    [
        # einshard's documented examples (docs/syntax.md, 16 devices).
        ("a b -> 2 a2 b4", (4, 8), 16, (2, 2, 4), ("_0", "a", "b"), ("a", "b")),
        (
            "a ... d -> 4 a2 ... d2",
            (4, 8, 20, 10),
            16,
            (4, 2, 2),
            ("_0", "a", "d"),
            ("a", None, None, "d"),
        ),
        (
            "a b c d -> 4 a2 b c d2",
            (4, 8, 20, 10),
            16,
            (4, 2, 1, 1, 2),
            ("_0", "a", "b", "c", "d"),
            ("a", "b", "c", "d"),
        ),
        ("a b -> * a2 b", (4, 8), 16, (8, 2, 1), ("_0", "a", "b"), ("a", "b")),
        ("a b -> 2 a2* b*", (4, 8), 16, (2, 4, 2), ("_0", "a", "b"), ("a", "b")),
        # einshard's own test table.
        ("... -> * ...", (2,), 1, (1,), ("_0",), (None,)),
        ("a -> 16 a", (2,), 16, (16, 1), ("_0", "a"), ("a",)),
        ("a b -> 2 a b*", (2, 8), 16, (2, 1, 8), ("_0", "a", "b"), ("a", "b")),
        ("a b -> * a* b*", (4, 4), 8, (2, 2, 2), ("_0", "a", "b"), ("a", "b")),
        ("... a -> 2 ... a*", (2, 8), 16, (2, 8), ("_0", "a"), (None, "a")),
        ("a b c -> a2* b2 c*", (4, 16, 8), 16, (4, 2, 2), ("a", "b", "c"), ("a", "b", "c")),
        # the seed's MLP.
        ("x y -> x y*", (128, 256), 8, (1, 8), ("x", "y"), ("x", "y")),
        ("y z -> y* z", (256, 64), 8, (8, 1), ("y", "z"), ("y", "z")),
        # the right side's order is the mesh's order.
        ("a b -> b2 a4", (8, 8), 8, (2, 4), ("b", "a"), ("a", "b")),
        # a scalar.
        ("... -> ...", (), 1, (), (), ()),
        ("... -> * ...", (), 4, (4,), ("_0",), ()),
        # exact roots where einshard's float root fails: 64 ** (1/3) != 4.
        ("a b c -> a* b* c*", (4, 4, 4), 64, (4, 4, 4), ("a", "b", "c"), ("a", "b", "c")),
        ("a b -> a* b*", (8, 8), 64, (8, 8), ("a", "b"), ("a", "b")),
    ],
)
def test_layout(text, shape, n, mesh_shape, mesh_axes, spec):
    lay = _layout(text, shape, n)
    assert (lay.mesh_shape, lay.mesh_axes, lay.spec) == (mesh_shape, mesh_axes, spec)


def test_shards_per_dimension():
    assert _layout("a b -> 2 a2* b*", (4, 8), 16).shards == (4, 2)
    assert _layout("a ... -> a* ...", (8, 3, 5), 4).shards == (4, 1, 1)


@pytest.mark.parametrize(
    ("value", "degree", "root"),
    [
        (64, 3, 4),
        (8, 3, 2),
        (1, 5, 1),
        (16, 2, 4),
        (125, 3, 5),
        (2**60, 3, 2**20),
        (12, 2, None),
        (63, 3, None),
        (65, 3, None),
    ],
)
def test_integer_root_is_exact(value, degree, root):
    assert integer_root(value, degree) == root


# (text, shape, devices, caret column, caret length, rule) -- the messages are pinned.
ERRORS = [
    (
        "a b -> a2 b4",
        (4, 8),
        6,
        7,
        5,
        "a2 x b4 = 8 shards need 8 devices, 6 are given; choose counts whose product is 6, or use '*' to take a share",
    ),
    (
        "a b -> a2 b2",
        (4, 8),
        8,
        7,
        5,
        "a2 x b2 = 4 shards need 4 devices, 8 are given; add '*' to an element to take the rest, or a standalone '*' to replicate",
    ),
    (
        "a -> a",
        (4,),
        2,
        5,
        1,
        "no element has a count or a star, so 1 device is used, and 2 are given; add '*' to an element to take the rest, or a standalone '*' to replicate",
    ),
    (
        "a b -> 4 a* b",
        (4, 8),
        6,
        7,
        6,
        "the fixed counts 4 need a multiple of 4 devices, 6 are given; change the fixed counts, or make them starred",
    ),
    (
        "a b -> a2* b4*",
        (8, 8),
        12,
        7,
        7,
        "the starred counts a2* x b4* = 8 need a multiple of 8 devices, and 12 are left for them (12 are given); change the starred counts",
    ),
    (
        "a b -> a* b*",
        (8, 8),
        8,
        7,
        5,
        "the 2 starred elements grow by one common factor, so the 8 devices left for them must be 1 x a square; 8 is not a square. Use fewer '*', or fixed counts",
    ),
    (
        "a b c -> a* b* c*",
        (8, 8, 8),
        16,
        9,
        8,
        "the 3 starred elements grow by one common factor, so the 16 devices left for them must be 1 x a cube; 16 is not a cube. Use fewer '*', or fixed counts",
    ),
    (
        "a b -> a b8",
        (4, 6),
        8,
        9,
        2,
        "axis 'b' (dimension 1 of shape (4, 6)) has size 6, which does not split into 8 equal shards; choose a count that divides 6",
    ),
    (
        "a b -> a* b",
        (6, 4),
        4,
        7,
        2,
        "axis 'a' (dimension 0 of shape (6, 4)) has size 6, which does not split into 4 equal shards; choose a count that divides 6",
    ),
    (
        "a b -> a b*",
        (4,),
        8,
        0,
        3,
        "the left side names 2 axes, but the array has 1 (shape (4,)); name one axis per dimension, or use '...' for the rest",
    ),
    (
        "a b ... -> a b* ...",
        (4,),
        8,
        0,
        7,
        "the left side names 2 axes besides '...', but the array has 1 (shape (4,)); name at most 1",
    ),
    (
        "a b*",
        (4, 4),
        8,
        0,
        4,
        "this is the short form, with no left side; give the axis names as '<names> -> a b*', or take them from a jaxtyping annotation",
    ),
]


@pytest.mark.parametrize(("text", "shape", "n", "column", "length", "rule"), ERRORS)
def test_layout_errors_are_pinned(text, shape, n, column, length, rule):
    with pytest.raises(ExpressionError) as info:
        _layout(text, shape, n)
    error = info.value
    assert (error.expression, error.position, error.length, error.rule) == (
        text,
        column,
        length,
        rule,
    )
    assert str(error).split("\n")[2] == " " * (4 + column) + "^" * length


def test_layout_takes_text_and_checks_the_shape():
    assert eqshard.expression.layout("a -> a*", (8,), 8).spec == ("a",)
    with pytest.raises(
        eqshard.EqshardError, match=r"a shape is a sequence of sizes such as \(4, 8\), not 8"
    ):
        eqshard.expression.sharding("a -> a*", 8)  # type: ignore[arg-type]
    with pytest.raises(eqshard.EqshardError, match=r"not \(4, -1\)"):
        eqshard.expression.layout("a b -> a b*", (4, -1), 8)


@pytest.mark.parametrize(
    ("count", "message"),
    [("8", "the device count is a whole number from 1, not '8'"), (8.0, "not 8.0")],
)
def test_a_device_count_that_is_not_an_int_is_an_eqshard_error(count, message):
    with pytest.raises(eqshard.EqshardError, match=message):
        eqshard.expression.layout("a -> a*", (8,), count)
