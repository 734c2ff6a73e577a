"""The resolver protocol: how a spec source gives each leaf of a model its expression.

Every spec source is a resolver: the model's own `eqshard.field`s
(`FROM_FIELDS`), a spec tree, the `Rules` of a spec file, or a user's own object.
A resolver is asked for one `Target` (what the spec is resolved for: the device
count, and the user's mesh where there is one) and answers with a `Resolution`:
one spec leaf per leaf of the model, and the problems and warnings it found. It
raises nothing itself: `eqshard.plan` collects every problem of every stage and
raises them together.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, Union, runtime_checkable

from ._expression import Expression
from ._problems import Problem
from ._warnings import EqshardWarning

if TYPE_CHECKING:
    from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec


__all__ = [
    "Resolution",
    "Resolver",
    "SpecLeaf",
    "Target",
    "is_resolver",
    "is_spec_leaf",
]

SpecLeaf = Union[Expression, str, "PartitionSpec", "NamedSharding", None]
"""A leaf of a spec tree: an expression, its text, JAX's own layout (a `PartitionSpec`
on the plan's mesh, or a `NamedSharding`), or `None` (no expression)."""


def is_spec_leaf(x: object) -> bool:
    """Whether `x` is a leaf of a spec tree: an expression, its text, a `PartitionSpec`,
    a `NamedSharding`, or `None`."""
    if x is None or isinstance(x, (Expression, str)):
        return True
    sharding = sys.modules.get("jax.sharding")  # no JAX imported: no JAX layout either
    return sharding is not None and isinstance(x, (sharding.PartitionSpec, sharding.NamedSharding))


@dataclasses.dataclass(frozen=True)
class Target:
    """What a spec is resolved for.

    **Attributes:**

    - `devices`: how many devices the model is laid out on.
    - `mesh`: the user's mesh, where one is given (its axis names and sizes), else
        `None`.
    - `context`: the model the tree was built from, when the tree is part of its
        training state (an `eqx.nn.State` on its own); else `None`. It gives what the
        model's fields say of the state's leaves (`eqshard._fields.walk_fields`).
    """

    devices: int
    mesh: Mesh | AbstractMesh | None = None
    context: Any = None


@dataclasses.dataclass(frozen=True)
class Resolution:
    """A resolver's answer for one model and one `Target`.

    **Attributes:**

    - `exprs`: one spec leaf per leaf of `jax.tree_util.tree_leaves(model)`, in that
        order: an `Expression`, its text (full or short form), a `PartitionSpec` (on
        the target's mesh) or a `NamedSharding`, or `None`. Entries for leaves that are
        not arrays are ignored.
    - `problems`: every fault found, each naming its leaf or `file::$.json.path`.
    - `warnings`: faults that do not stop the work (a rule that matched nothing).
    - `failed`: the indices of leaves that a problem leaves without an expression. They
        are not laid out (and not replicated either).
    - `origins`: optionally, where each leaf's expression came from (`"$.rules[2]"`,
        `"dims"`, `"Linear.weight"`), for reports.
    - `fields`: optionally, the walk over the model's fields that the resolver made
        (`eqshard._fields.walk_fields`), so it is not made twice.
    - `memory`: optionally, each leaf's memory kind (`"pinned_host"`, `"device"`);
        `None` for the device's own memory.
    """

    exprs: Sequence[SpecLeaf]
    problems: Sequence[Problem] = ()
    warnings: Sequence[EqshardWarning] = ()
    failed: frozenset[int] = frozenset()
    origins: Sequence[str | None] | None = None
    fields: Sequence[Any] | None = None
    memory: Sequence[str | None] | None = None


@runtime_checkable
class Resolver(Protocol):
    """A spec source, such as `eqshard.Rules` or `eqshard.resolvers.FROM_FIELDS`.

    **Example:**

    ```python
    class Everything:
        def __init__(self, expr):
            self.expr = expr

        def __eqshard_resolve__(self, model, target):
            leaves = jax.tree_util.tree_leaves(model)
            return eqshard.resolvers.Resolution([self.expr] * len(leaves))

    model = eqshard.apply(model, Everything("... -> * ..."))
    ```

    **Methods:**

    - `__eqshard_resolve__(model, target)`: takes the model (concrete or abstract) and a
        `Target`, and returns a `Resolution`.
    - `__eqshard_mesh__(devices)`: optional; returns `(MeshShape | None, problems)`, the
        mesh the resolver is written for.

    !!! info "Writing a resolver"

        `__eqshard_resolve__` raises nothing for a fault in the spec: it reports it in
        `Resolution.problems`. The dunder name keeps a model or spec tree that happens
        to have a `resolve` method from being taken for a resolver. A resolver may
        declare the mesh it is written for, as `Rules` does for a spec file's `"mesh"`;
        it is used when the user gives no mesh. To cross a process boundary, a resolver
        must pickle: to a worker process of `eqshard check`, or `eqshard.cost` on more
        devices.
    """

    def __eqshard_resolve__(self, model: Any, target: Target) -> Resolution: ...


def is_resolver(spec: object) -> bool:
    """Whether `spec` is a resolver (judged by its type, as dunder methods are)."""
    return hasattr(type(spec), "__eqshard_resolve__")
