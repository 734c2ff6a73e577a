"""Flax's resolution of logical axis names to mesh axes, copied as an oracle, with Flax's own cases.

The functions below are pure-Python copies of Flax's code (google/flax, Apache License 2.0,
Copyright 2024 The Flax Authors; see http://www.apache.org/licenses/LICENSE-2.0), taken at
commit `FLAX_COMMIT`:

- `flax_logical_to_mesh_axes` is `flax/linen/spmd.py`'s `_logical_to_mesh_axes` (lines 65-111)
  and `logical_to_mesh_axes` (lines 114-158), what Linen and MaxText use;
- `flax_constraint_spec` is `with_logical_constraint` with `_with_sharding_constraint_one_fallback`
  (lines 206-269 of the same file): the spec a constraint is made with, or none;
- `nnx_var_pspec` is NNX's `flax/nnx/spmd.py` `get_var_pspec` (line 134) over
  `flax/core/spmd.py`'s `composite_rules` (line 135) and `from_sharding_rules` (line 153).

The only changes: JAX's pytree flattening is spelled out (`_leaves`), and
`jax.sharding.PartitionSpec.UNCONSTRAINED` is the sentinel `UNCONSTRAINED`, so nothing here
imports JAX. A spec is a plain tuple with one entry per dimension.

The cases are Flax's own assertions, copied from the test files named in each case (at
`FLAX_COMMIT`): `LINEN_CASES` (`tests/linen/partitioning_test.py`, and the docstring example of
`logical_to_mesh_axes`) and `NNX_CASES` (`tests/nnx/spmd_test.py`,
`tests/nnx/bridge/wrappers_test.py`). Only assertions about resolution are kept, not about
modules.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Final, Literal, NamedTuple

FLAX_REPO: Final = "google/flax"
FLAX_COMMIT: Final = "18f8f311c275d57f46d95e41b15aa97b454754c0"


class Unconstrained:
    """`jax.sharding.PartitionSpec.UNCONSTRAINED`: the dimension is left to the compiler."""

    def __repr__(self) -> str:
        return "UNCONSTRAINED"


class Unassigned:
    """Flax's `_UnassignedAxis`: a named dimension that no rule has claimed yet."""

    def __repr__(self) -> str:
        return "UnassignedAxis"

    def __bool__(self) -> bool:
        return False


UNCONSTRAINED: Final = Unconstrained()
UNASSIGNED: Final = Unassigned()

# A rule's value: a mesh axis, several (a tuple or list), None (whole), or UNCONSTRAINED.
RuleValue = str | tuple[str, ...] | list[str] | None | Unconstrained
Rules = Sequence[tuple[str, RuleValue]]
# A logical name per dimension: a name, None (whole) or UNCONSTRAINED.
Name = str | None | Unconstrained
# One entry per dimension of a resolved spec.
Entry = str | tuple[str, ...] | list[str] | None | Unconstrained
Fallback = Literal["AXIS_IS_UNSHARDED", "RAISE_ERROR", "NO_CONSTRAINT"]


def _leaves(tree: object) -> list[object]:
    """`jax.tree_util.tree_leaves` for the values a rule or a spec holds: None has no leaf."""
    if tree is None:
        return []
    if isinstance(tree, tuple | list):
        return [leaf for item in tree for leaf in _leaves(item)]
    return [tree]


def _mesh_assignment_free(new_assignment: object, existing_assignments: object) -> bool:
    """Flax's `_mesh_assignment_free`: no mesh axis of the rule is used by the array yet."""
    new = set(_leaves(new_assignment))
    existing = set(_leaves(existing_assignments))
    new.discard(UNCONSTRAINED)
    new.discard(None)
    return not existing.intersection(new)


def flax_logical_to_mesh_axes_unfilled(
    array_dim_names: Sequence[Name] | None, rules: Rules
) -> list[Entry | Unassigned] | None:
    """Flax's `_logical_to_mesh_axes`: `UNASSIGNED` where no rule claimed a named dimension."""
    if array_dim_names is None:
        return None
    axis_name_counts = collections.Counter(array_dim_names)
    dups = tuple(k for k, v in axis_name_counts.items() if v > 1 and isinstance(k, str))
    if dups:
        raise ValueError(f"Unsupported: Dimensions {dups} occur more than once in array names.")
    if not isinstance(rules, tuple | list):
        raise ValueError("Unknown axis rule specification type.")
    result: list[Entry | Unassigned] = [
        (UNASSIGNED if isinstance(name, str) else name) for name in array_dim_names
    ]
    for rule_model_name, rule_mesh_names in rules:
        if rule_model_name in array_dim_names:
            pos = list(array_dim_names).index(rule_model_name)
            if _mesh_assignment_free(rule_mesh_names, result) and result[pos] is UNASSIGNED:
                result[pos] = rule_mesh_names
    return result


def flax_logical_to_mesh_axes(
    array_dim_names: Sequence[Name] | None, rules: Rules
) -> tuple[Entry, ...] | None:
    """Flax's `logical_to_mesh_axes`: the spec of an array with these logical names.

    Rules are read in order; a rule claims its name's dimension when the dimension is still
    unclaimed and none of the rule's mesh axes is used by the array yet (a rule to None or to
    UNCONSTRAINED claims it too). A named dimension that no rule claims is whole (None).

    **Arguments:**

    - `array_dim_names`: a logical name, None or `UNCONSTRAINED` per dimension; or None.
    - `rules`: `(logical name, mesh axes)` pairs, in order of precedence.

    **Returns:** a tuple with one entry per dimension, or None for None.

    **Raises:** `ValueError` where a name occurs twice, or `rules` is not a tuple or list.
    """
    result = flax_logical_to_mesh_axes_unfilled(array_dim_names, rules)
    if result is None:
        return None
    return _filled(result)


def _filled(result: Sequence[Entry | Unassigned]) -> tuple[Entry, ...]:
    """Flax's `[None if x is _unassigned_axis else x for x in result]`."""
    return tuple(None if isinstance(x, Unassigned) else x for x in result)


def flax_constraint_spec(
    array_dim_names: Sequence[Name] | None,
    rules: Rules,
    fallback: Fallback = "AXIS_IS_UNSHARDED",
) -> tuple[Entry, ...] | None:
    """The spec Flax's `with_logical_constraint` constrains with, or None where it adds none.

    No rules, or no names, add no constraint. A name no rule claims is whole under
    `AXIS_IS_UNSHARDED`, raises under `RAISE_ERROR`, and drops the constraint under
    `NO_CONSTRAINT`.

    **Raises:** `ValueError` as `flax_logical_to_mesh_axes`, and where `RAISE_ERROR` meets a
    name that no rule claims.
    """
    if not rules or array_dim_names is None:
        return None
    mesh_axes = flax_logical_to_mesh_axes_unfilled(array_dim_names, rules)
    if mesh_axes is None:
        return None
    if fallback != "AXIS_IS_UNSHARDED" and any(x is UNASSIGNED for x in mesh_axes):
        if fallback == "RAISE_ERROR":
            raise ValueError(f"Axis names {array_dim_names} did not match a rule")
        return None
    return _filled(mesh_axes)


def nnx_composite_rules(rule1: Rules, rule2: Rules) -> Rules:
    """`flax/core/spmd.py`'s `composite_rules`: the context's rules, then a variable's own.

    **Raises:** `ValueError` where both give one name different values.
    """
    if not rule1 and not rule2:
        return ()
    if rule1 and not rule2:
        return rule1
    if rule2 and not rule1:
        return rule2
    rules = dict(rule1)
    for alias, value in rule2:
        if alias in rules and rules[alias] != value:
            raise ValueError(
                f"Inconsistent logical axis annotations for {alias}: {rules[alias]} vs {value}"
            )
        rules[alias] = value
    return tuple(rules.items())


def nnx_from_sharding_rules(sharding: Sequence[Name], sharding_rules: Rules) -> tuple[Entry, ...]:
    """`flax/core/spmd.py`'s `from_sharding_rules`: a dictionary look-up per dimension.

    The last rule of a name wins, no mesh axis is checked for reuse, and a name with no rule
    is kept as it is (read as a mesh axis of that name).
    """
    rules = dict(sharding_rules)
    return tuple(rules[str(s)] if (s and str(s) in rules) else s for s in sharding)


def nnx_var_pspec(
    sharding: Sequence[Name],
    context_rules: Rules = (),
    local_rules: Rules | None = None,
) -> tuple[Entry, ...]:
    """NNX's `get_var_pspec` for a variable with `out_sharding=sharding`.

    **Arguments:**

    - `sharding`: the variable's logical names.
    - `context_rules`: the rules of `nnx.logical_axis_rules` (or `set_logical_axis_rules`).
    - `local_rules`: the variable's `sharding_rules` metadata; None where it has none.
    """
    if context_rules or local_rules is not None:
        rules = nnx_composite_rules(context_rules, local_rules or ())
        return nnx_from_sharding_rules(sharding, rules)
    return tuple(sharding)


class LinenCase(NamedTuple):
    """One assertion of Flax about Linen's resolution of logical names."""

    id: str
    file: str
    test: str
    line: int  # of the assertion, in `file` at FLAX_COMMIT
    rules: Rules
    names: tuple[Name, ...] | None
    # "logical_to_mesh_axes", or "constraint": the spec `with_logical_constraint` passes on
    api: Literal["logical_to_mesh_axes", "constraint"]
    expected: tuple[Entry, ...] | None  # None under "constraint": no constraint is added
    raises: type[Exception] | None = None
    fallback: Fallback = "AXIS_IS_UNSHARDED"


class NnxCase(NamedTuple):
    """One assertion of Flax about NNX's resolution of a variable's `out_sharding`."""

    id: str
    file: str
    test: str
    line: int
    sharding: tuple[Name, ...]
    context_rules: Rules
    local_rules: Rules | None
    expected: tuple[Entry, ...]


_LINEN_TEST = "tests/linen/partitioning_test.py"
_AXIS_RULES_1: Rules = (("foo", "data"), ("bar", "model"), ("baz", None))
_AXIS_RULES_2: Rules = (("foo", "model"), ("bar", None), ("baz", "data"))
_P_RULES: Rules = (("foo", "model"), ("bar", "model"), ("baz", "data"))
_U = UNCONSTRAINED


def _param_case(
    n: int, line: int, rules: Rules, axes: tuple[Name, ...], expected: tuple[Entry, ...]
) -> LinenCase:
    return LinenCase(
        f"linen_cases_{n}",
        _LINEN_TEST,
        f"PartitioningTest.test_logical_to_mesh_axes_cases (parameters #{n})",
        line,
        rules,
        axes,
        "logical_to_mesh_axes",
        expected,
    )


LINEN_CASES: Final[tuple[LinenCase, ...]] = (
    LinenCase(
        "docstring_example",
        "flax/linen/spmd.py",
        "logical_to_mesh_axes docstring",
        143,
        (("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z")),
        ("batch", "length", "heads", "features"),
        "logical_to_mesh_axes",
        ("X", None, "Y", None),
    ),
    LinenCase(
        "none_or_unconstrained",
        _LINEN_TEST,
        "PartitioningTest.test_logical_to_mesh_axes_resolves_to_none_or_unconstrained",
        60,
        (("foo", None), ("bad", None), ("bar", _U), ("baz", _U)),
        ("foo", "bad", "bar", "baz"),
        "logical_to_mesh_axes",
        (None, None, _U, _U),
    ),
    LinenCase(
        "direct_rule",
        _LINEN_TEST,
        "PartitioningTest.test_logical_to_mesh_axes",
        70,
        _AXIS_RULES_1,
        ("foo", "bar"),
        "logical_to_mesh_axes",
        ("data", "model"),
    ),
    LinenCase(
        "repeated_none_and_unconstrained",
        _LINEN_TEST,
        "PartitioningTest.test_logical_to_mesh_axes",
        78,
        _AXIS_RULES_1,
        ("foo", _U, _U, None, None),
        "logical_to_mesh_axes",
        ("data", _U, _U, None, None),
    ),
    LinenCase(
        "rules_context",
        _LINEN_TEST,
        "PartitioningTest.test_logical_to_mesh_axes",
        86,
        _AXIS_RULES_1,
        ("foo", "bar"),
        "logical_to_mesh_axes",
        ("data", "model"),
    ),
    LinenCase(
        "nested_rules_context",
        _LINEN_TEST,
        "PartitioningTest.test_logical_to_mesh_axes",
        92,
        _AXIS_RULES_2,
        ("foo", "bar"),
        "logical_to_mesh_axes",
        ("model", None),
    ),
    LinenCase(
        "duplicated_logical_names",
        _LINEN_TEST,
        "PartitioningTest.test_logical_to_mesh_axes",
        99,
        _AXIS_RULES_1,
        ("foo", "foo", "baz"),
        "logical_to_mesh_axes",
        None,
        raises=ValueError,
    ),
    LinenCase(
        "priorities_1",
        _LINEN_TEST,
        "PartitioningTest.test_logical_to_mesh_axes_priorities",
        104,
        _P_RULES,
        ("foo", "bar", "baz"),
        "logical_to_mesh_axes",
        ("model", None, "data"),
    ),
    LinenCase(
        "priorities_2",
        _LINEN_TEST,
        "PartitioningTest.test_logical_to_mesh_axes_priorities",
        108,
        _P_RULES,
        ("bar", "foo", "baz"),
        "logical_to_mesh_axes",
        (None, "model", "data"),
    ),
    LinenCase(
        "priorities_3",
        _LINEN_TEST,
        "PartitioningTest.test_logical_to_mesh_axes_priorities",
        112,
        _P_RULES,
        ("baz", "bar", "foo"),
        "logical_to_mesh_axes",
        ("data", None, "model"),
    ),
    LinenCase(
        "priorities_unassigned",
        _LINEN_TEST,
        "PartitioningTest.test_logical_to_mesh_axes_priorities",
        116,
        _P_RULES,
        ("baz", "bar", "foo", "unassigned"),
        "logical_to_mesh_axes",
        ("data", None, "model", None),
    ),
    _param_case(
        0, 125, (("a", ("model", "data")), ("b", "data")), ("a", "b"), (("model", "data"), None)
    ),
    _param_case(
        1,
        130,
        (("a", ("model", "replica")), ("b", "data")),
        ("a", "b"),
        (("model", "replica"), "data"),
    ),
    _param_case(
        2,
        135,
        (("a", ("model", "replica")), ("b", ("data", "model"))),
        ("a", "b"),
        (("model", "replica"), None),
    ),
    _param_case(
        3,
        140,
        (("a", ("model", "replica")), ("b", "model")),
        ("a", "b", "c"),
        (("model", "replica"), None, None),
    ),
    _param_case(4, 144, (), ("a", "b", "c"), (None, None, None)),
    _param_case(5, 146, (("a", None), ("a", "model")), ("a", "b"), (None, None)),
    _param_case(
        6,
        151,
        (("baz", "data"), ("bar", None), ("foo", "model"), ("foo", "data")),
        ("baz", "bar", "foo"),
        ("data", None, "model"),
    ),
    _param_case(
        7,
        161,
        (("baz", "data"), ("foo", ("model", "emb"))),
        ("baz", _U, "foo"),
        ("data", _U, ("model", "emb")),
    ),
    LinenCase(
        "constraint_without_rules",
        _LINEN_TEST,
        "PartitioningTest.test_with_sharding_constraint",
        182,
        (),
        ("foo", "bar"),
        "constraint",
        None,
    ),
    LinenCase(
        "constraint_without_names",
        _LINEN_TEST,
        "PartitioningTest.test_with_sharding_constraint",
        185,
        _AXIS_RULES_1,
        None,
        "constraint",
        None,
    ),
    LinenCase(
        "constraint",
        _LINEN_TEST,
        "PartitioningTest.test_with_sharding_constraint",
        187,
        _AXIS_RULES_1,
        ("foo", "bar"),
        "constraint",
        ("data", "model"),
    ),
    LinenCase(
        "constraint_unconstrained",
        _LINEN_TEST,
        "PartitioningTest.test_with_sharding_constraint",
        191,
        _AXIS_RULES_1,
        ("foo", _U),
        "constraint",
        ("data", _U),
    ),
    LinenCase(
        "fallback_default",
        _LINEN_TEST,
        "PartitioningTest.test_with_sharding_constraint_fallback",
        200,
        _AXIS_RULES_1,
        ("foo", "not_recognized"),
        "constraint",
        ("data", None),
    ),
    LinenCase(
        "fallback_axis_is_unsharded",
        _LINEN_TEST,
        "PartitioningTest.test_with_sharding_constraint_fallback",
        209,
        _AXIS_RULES_1,
        ("foo", "not_recognized"),
        "constraint",
        ("data", None),
        fallback="AXIS_IS_UNSHARDED",
    ),
    LinenCase(
        "fallback_raise_error",
        _LINEN_TEST,
        "PartitioningTest.test_with_sharding_constraint_fallback",
        214,
        _AXIS_RULES_1,
        ("foo", "not_recognized"),
        "constraint",
        None,
        raises=ValueError,
        fallback="RAISE_ERROR",
    ),
    LinenCase(
        "fallback_no_constraint",
        _LINEN_TEST,
        "PartitioningTest.test_with_sharding_constraint_fallback",
        225,
        _AXIS_RULES_1,
        ("foo", "not_recognized"),
        "constraint",
        None,
        fallback="NO_CONSTRAINT",
    ),
)


NNX_CASES: Final[tuple[NnxCase, ...]] = (
    NnxCase(
        "context_and_variable_rules",
        "tests/nnx/spmd_test.py",
        "TestSPMD.test_logical_rules (Foo.w)",
        410,
        ("row-alias", "col-alias"),
        (("col-alias", "col"),),
        (("row-alias", "row"),),
        ("row", "col"),
    ),
    NnxCase(
        "no_rules_names_are_mesh_axes",
        "tests/nnx/bridge/wrappers_test.py",
        "TestCompatibility.test_linen_to_nnx_metadata (kernel)",
        178,
        ("in", "out"),
        (),
        None,
        ("in", "out"),
    ),
    NnxCase(
        "variable_rules_only",
        "tests/nnx/bridge/wrappers_test.py",
        "TestCompatibility.test_linen_to_nnx_metadata (bias)",
        187,
        ("out-alias",),
        (),
        (("out-alias", "out"),),
        ("out",),
    ),
)
