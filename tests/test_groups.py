"""A dim over several mesh axes: a group on the left side, `"(a b) c -> a2 c b4"`.

The oracle is JAX itself: a group lays out an array device by device as the
`PartitionSpec` entry of the same axes in the same order, `P(("a", "b"), "c")`, on the
same mesh, whether the group's axes are next to each other on the mesh or not, and
in the mesh's order or not."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard
from eqshard import ExpressionError


def _blocks(sharding, shape):
    """Each device's block, as (start, stop) per dim."""
    return {
        d: tuple(
            (s.start or 0, size if s.stop is None else s.stop) for s, size in zip(index, shape)
        )
        for d, index in sharding.devices_indices_map(shape).items()
    }


@pytest.mark.parametrize(
    ("text", "canonical", "lhs"),
    [
        ("(a b) c -> a2 c b4", "(a b) c -> a2 c b4", (("a", "b"), "c")),
        ("( a  b ) c -> a2 c b4", "(a b) c -> a2 c b4", (("a", "b"), "c")),
        ("(a) b -> a2 b4", "a b -> a2 b4", ("a", "b")),  # a group of one is its name
        ("... (s f) -> ... f2 s4", "... (s f) -> ... f2 s4", (..., ("s", "f"))),
        ("(a b c) -> b2 c2 a2", "(a b c) -> b2 c2 a2", (("a", "b", "c"),)),
        # quoted names: digits and '-' that no count can be read into
        ("'dim1' 'row-alias' -> 'dim1'2 'row-alias'4*", None, ("dim1", "row-alias")),
        ("('x0' 'x1') -> 'x1'2 'x0'4", None, (("x0", "x1"),)),
        ("'a' -> 'a'2", "a -> a2", ("a",)),  # a plain name needs no quotes
    ],
)
def test_a_group_or_a_quoted_name_parses_and_prints_back(text, canonical, lhs):
    canonical = canonical or text
    expr = eqshard.expression.parse(text)
    assert str(expr) == canonical
    assert expr.lhs == lhs
    assert eqshard.expression.parse(str(expr)) == expr
    assert hash(eqshard.expression.parse(canonical)) == hash(expr)


@pytest.mark.parametrize(
    ("text", "shape", "spec"),
    [
        # adjacent, in the mesh's order: one dim over both axes
        ("(a b) c -> a2 b4 c", (16, 3), (("a", "b"), "c")),
        # not adjacent: c's axis between them
        ("(a b) c -> a2 c b4", (16, 3), (("a", "b"), "c")),
        # against the mesh's order: the second axis is the major one
        ("(f s) e -> s2 e f4", (16, 3), (("f", "s"), "e")),
        # with a replication element and a star
        ("(a b) -> a2 2 b*", (8,), (("a", "b"),)),
    ],
)
def test_a_group_is_the_partition_spec_of_its_axes_device_by_device(text, shape, spec):
    lay = eqshard.expression.layout(text, shape, 8)
    assert lay.spec == spec
    got = eqshard.expression.sharding(text, shape)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(lay.mesh_shape), lay.mesh_axes)
    assert _blocks(got, shape) == _blocks(NamedSharding(mesh, P(*spec)), shape)


def test_the_major_axis_of_a_group_is_its_first_name():
    """On the row-major mesh (s2, f4), `(f s)` puts block `2 * f + s` on device
    `(s, f)`: counted by hand."""
    got = _blocks(eqshard.expression.sharding("(f s) e -> s2 e f4", (16, 3)), (16, 3))
    devices = jax.devices()
    for s, f in itertools.product(range(2), range(4)):
        block = 2 * f + s
        assert got[devices[4 * s + f]] == ((2 * block, 2 * block + 2), (0, 3))


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_on_the_users_mesh_a_group_is_written_with_its_mesh_axes(kind):
    mesh = jax.make_mesh((2, 2, 2), ("data", "tensor", "fsdp"), axis_types=(kind,) * 3)
    s = eqshard.expression.sharding("(f d) t -> d2 t2 f2", (8, 4), mesh=mesh)
    assert s.spec == P(("fsdp", "data"), "tensor")
    assert _blocks(s, (8, 4)) == _blocks(NamedSharding(mesh, P(("fsdp", "data"), "tensor")), (8, 4))


def test_shards_count_a_groups_axes():
    assert eqshard.expression.layout("(a b) c -> a2 c2 b2", (8, 4), 8).shards == (4, 2)


@pytest.mark.parametrize(
    ("text", "shape", "column", "length", "rule"),
    [
        (
            "(a b) c -> a2 c b4",
            (12, 3),
            0,
            5,
            "the group (a b) (dimension 0 of shape (12, 3)) has size 12, which does not split "
            "into a2 x b4 = 8 equal shards; choose counts whose product divides 12",
        ),
        (
            "c (a b) -> a2 c b4",
            (3,),
            0,
            7,
            "the left side names 2 axes, but the array has 1 (shape (3,)); name one axis per "
            "dimension, or use '...' for the rest",
        ),
    ],
)
def test_a_group_that_does_not_divide_is_named_with_a_caret(text, shape, column, length, rule):
    with pytest.raises(ExpressionError) as info:
        eqshard.expression.layout(text, shape, 8)
    assert (info.value.position, info.value.length, info.value.rule) == (column, length, rule)


def test_a_group_that_does_not_fit_the_users_mesh_says_so():
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(ExpressionError, match="does not fit the mesh"):
        eqshard.expression.sharding("(a b) -> a2 b4", (8,), mesh=mesh)
