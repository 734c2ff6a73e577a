"""What the step's jaxpr shows, read once (`step_profile`): each leaf's Megatron role,
each weight's matmuls, the step's FLOPs, the named activations' labels, the experts'
stacks, attention's axes and the pipelined stacks, for the candidates of every family
and their estimates. The walk that finds them is `_jaxpr_walk.py`'s, whose docstring
says how."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from .._compat import param
from .._errors import step_error
from .._process._usercode import with_user_frames
from ._jaxpr_walk import NOTHING, Matmul, Pipelined, Role, Value, Walk, ragged_numbers, shape_of

__all__ = [
    "Matmul",
    "Pipelined",
    "Role",
    "StepProfile",
    "abstract_leaf",
    "step_profile",
    "tensor_roles",
]


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """What the step's jaxpr shows, for Megatron's roles and for estimates.

    - `roles`: each leaf's `Role`, by its index in the model's leaves.
    - `matmuls`: each weight's matrix products in the forward pass.
    - `flops`: the FLOPs of every matrix product of the step (forward and
        gradient), whole, each times the lengths of the scans around it.
    - `labels`: for each activation the model names (by its index in what
        `_activations.recording` records), the weights whose output axes it holds:
        `(weight, axis)`, the axis counted from the end (`-1` the last).
    - `experts`: each weight stacked over experts, each applied to its own tokens, and
        its expert axis: the axis of a `dot_general` batched over it, matched with an
        activation's (an `einsum` over the experts, or `vmap` over their stack), or a
        ragged dot's group axis (`jax.lax.ragged_dot`, the rhs's).
    - `expert_labels`: for each named activation such a matmul takes, the axes (from
        the end) it batches over: the named axes that run along the experts.
    - `attention_free`: for each named activation that is an operand of a matmul of
        two named activations (attention's scores, of the queries and the keys as
        named), the axes (from the end) that the matmul neither contracts nor batches
        over: the queries' sequence and the keys'.
    - `attention_contracted`: for each named activation that is an operand of a
        matmul of two activations (the scores, or the weighted sum of the values), the
        axes (from the end) it contracts: the values' sequence (and the queries' and
        keys' features).
    - `pipelined`: each leaf of the model that `eqshard.parallel.pipeline` runs as a stack of
        layers (its marker, `_pipeline.MARKED`), and how.
    - `ambiguous_experts`: each weight whose matmuls stack it over different axes, and
        those axes: which is the experts' is not known, and it is in neither.
    """

    roles: dict[int, Role]
    matmuls: tuple[Matmul, ...]
    flops: float
    labels: dict[int, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
    experts: dict[int, int] = dataclasses.field(default_factory=dict)
    expert_labels: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    attention_free: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    attention_contracted: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    pipelined: dict[int, Pipelined] = dataclasses.field(default_factory=dict)
    ambiguous_experts: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)


def _is_abstract_array(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def abstract_leaf(x: Any) -> Any:
    """An array leaf as a `jax.ShapeDtypeStruct` (no sharding); anything else as it is."""
    if isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def tensor_roles(step: Callable[..., Any], model: Any, *args: Any) -> dict[int, Role]:
    """The Megatron role of each of the model's leaves that has one, from the step's
    jaxpr (see the module docstring): `step_profile(...).roles`.

    **Example:**

    ```python
    roles = tensor_roles(step, eqx.filter_eval_shape(build), opt_state, batch)
    roles[3]    # Role(kind='column', axis=1, inner=(1, 2), ...): by leaf index
    ```
    """
    return step_profile(step, model, *args).roles


def step_profile(step: Callable[..., Any], model: Any, *args: Any) -> StepProfile:
    """The step's jaxpr, read once: each leaf's Megatron role (see the module
    docstring), each weight's matrix products and the step's FLOPs.

    **Example:**

    ```python
    profile = step_profile(step, eqx.filter_eval_shape(build), opt_state, batch)
    profile.roles[3]    # Role(kind='column', axis=1, inner=(1, 2), ...): by leaf index
    profile.flops       # every matrix product of the step, whole
    ```

    **Arguments:**

    - `step`: the training step, called as `step(model, *args)`; an
        `eqx.filter_jit` function is traced through what it wraps.
    - `model`, `*args`: as `eqshard.cost` takes them, concrete or abstract.

    **Returns:**

    A `StepProfile`: its `roles` by a leaf's index in `jax.tree_util.tree_leaves(model)`.

    **Raises:**

    `eqshard.StepError` when the step cannot be traced, with its error as the cause.
    """
    fn = getattr(step, "__wrapped__", step)
    model = jax.tree_util.tree_map(abstract_leaf, model)
    args = tuple(jax.tree_util.tree_map(abstract_leaf, arg) for arg in args)
    dynamic, static = eqx.partition([model, *args], _is_abstract_array)

    def run(dynamic: Any) -> Any:
        everything = eqx.combine(dynamic, static)
        return eqx.filter(fn(*everything), eqx.is_array)

    try:
        closed = jax.make_jaxpr(run)(dynamic)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # the user's step (SystemExit too): named, with its cause
        name = getattr(fn, "__qualname__", type(fn).__name__)
        failed = step_error(
            f"cannot trace the step {name} to find its tensor-parallel pairs: it raised "
            f"{type(error).__name__}: {error}",
            error,
        )
        raise with_user_frames(failed, error) from error
    leaves = jax.tree_util.tree_leaves(model)
    at = [i for i, leaf in enumerate(leaves) if _is_abstract_array(leaf)]
    values = [
        Value(view=(at[k], tuple(range(len(var.aval.shape))))) if k < len(at) else Value(data=True)
        for k, var in enumerate(closed.jaxpr.invars)
    ]
    walk = Walk()
    walk.run(closed.jaxpr, [NOTHING] * len(closed.consts), values)
    return StepProfile(
        walk.roles(),
        tuple(walk.matmuls),
        _flops(closed.jaxpr, 1),
        walk.labels,
        {leaf: next(iter(axes)) for leaf, axes in walk.experts.items() if len(axes) == 1},
        {k: frozenset(v) for k, v in walk.expert_labels.items()},
        {k: frozenset(v) for k, v in walk.attention_free.items()},
        {k: frozenset(v) for k, v in walk.attention_contracted.items()},
        walk.pipelined,
        {leaf: tuple(axes) for leaf, axes in walk.experts.items() if len(axes) > 1},
    )


def _flops(jaxpr: Jaxpr, trips: int) -> float:
    """The FLOPs of every `dot_general` and ragged dot in `jaxpr` and the jaxprs it
    calls, each times the lengths of the scans around it (a `while` loop and each
    branch of a `cond` count once: an upper bound there). A ragged dot counts each of
    the lhs's rows once, by its own group's matrix (not what a compiler that writes it
    dense computes)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("dot_general", "ragged_dot_general"):
            ragged = name == "ragged_dot_general"
            if ragged:
                dot = ragged_numbers(eqn)
                lc, groups = dot.contracting[0], dot.grouped_output
            else:
                (lc, _), _ = param(eqn, "dimension_numbers")
                groups = False
            shape = shape_of(eqn.invars[0])
            contracted = int(np.prod([shape[a] for a in lc], dtype=np.int64))
            out = int(np.prod(shape_of(eqn.outvars[0]), dtype=np.int64))
            # a ragged contraction's output holds a matrix per group, each of its rows'
            per = shape_of(eqn.outvars[0])[0] if groups else 1
            total += 2.0 * out * contracted * trips / per
            continue
        inner = trips * int(param(eqn, "length")) if name == "scan" else trips
        for sub in _subjaxprs(eqn):
            total += _flops(sub, inner)
    return total


def _subjaxprs(eqn: Any) -> list[Jaxpr]:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                found.append(item)
    return found
