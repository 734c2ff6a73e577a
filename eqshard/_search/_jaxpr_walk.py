"""The walk of the step's forward pass: what each of the model's leaves is, found in
the step's jaxpr, never in names: Megatron's roles, the experts' stacks, the
matmuls, the named activations and the pipelined stacks (`_profile.py` reads them
into a `StepProfile`).

`_profile.step_profile` traces the user's training step (`jax.make_jaxpr` over the abstract
arguments, as `eqshard.cost` takes them) and follows each of the model's leaves
through the forward pass, into nested jaxprs (`jit`, `scan`, `while`, `cond`,
`checkpoint`, `custom_jvp_call`, `custom_vjp_call`). A leaf used as an operand of a
`dot_general` whose other operand is no leaf is a *weight*: the dot's dimension
numbers say which of its axes are contracted and which are its output, in the
leaf's own axes (a stacked layer's axis, scanned over or sliced away, is neither).

Each weight's output is followed through the operations that are not a weight's
matmul (elementwise ops, reshapes, reductions, attention's matmuls of two
activations) to the weight matmuls whose activation operand it reaches. Then, in
the order the forward pass runs them, greedily:

- a weight not yet assigned whose output reaches weights that are unassigned or
  row-parallel (and none that is column-parallel) is **column-parallel**: split
  over its output axis; the unassigned ones become **row-parallel**: split over
  their contracted axis, so the pair needs one all-reduce;
- a weight whose output reaches no other weight (the unembedding) is
  **vocab-parallel**: split over its output axis;
- a leaf looked up by a `gather` whose indices come from the step's arguments (an
  embedding) is split over the axis it is looked up along (vocab-parallel); a
  lookup by indices computed from constants (positions) reads the whole table
  every step and is left alone;
- a leaf added to a column- or vocab-parallel output along its output axis (the
  layer's bias) is split with it.

A ragged dot (`jax.lax.ragged_dot`: each group of the lhs's rows times its own
matrix of the rhs's stack) of a leaf and an activation is a weight's matmul too. A
weight's axis that a matmul batches over (a `dot_general`'s batch dim matched with
the activation's: an `einsum` over experts, or `vmap` over a stack) or groups by (a
ragged dot's group dim) is neither output nor contracted: the weight is a stack of
experts, each applied to its own tokens, and that axis is theirs, the same axis of
the same leaves whichever of the three forms applies them (`StepProfile.experts`).

Only the forward pass counts. The step's jaxpr also holds the gradient, whose
transposed matmuls run the weights backwards (the unembedding's gradient reaches
every weight before it); JAX names each of its operations `transpose(...)` in its
name stack, and they are skipped. The step is traced rather than a loss, since the
step is what the user gives and what `cost` compiles: the forward pass is the
forward pass of the step that runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal as JaxprLiteral

from .._activations import RECORDED
from .._compat import is_transposed, missing, param
from .._pipeline import MARKED

__all__ = [
    "NOTHING",
    "Matmul",
    "Pipelined",
    "Role",
    "Value",
    "Walk",
    "ragged_numbers",
    "shape_of",
]

Kind = Literal["column", "row", "vocab", "embedding", "bias"]


@dataclasses.dataclass(frozen=True)
class Role:
    """What a leaf is in Megatron's tensor parallelism, and which of its axes splits.

    - `kind`: `"column"` (split over its output axis; its output feeds `partners`),
        `"row"` (split over its contracted axis; fed by `partners`), `"vocab"` (a
        weight whose output feeds no other weight, split over its output axis),
        `"embedding"` (a lookup table, split over the axis it is looked up along),
        `"bias"` (added to `partners`' split output, split with it).
    - `axis`: the leaf's axis to split over the tensor-parallel mesh axis.
    - `inner`: the leaf's axes where it is used (a stacked layer's axes are not).
    - `output`, `contracted`: a weight's first output and first contracted axis.
    - `partners`: indices (into the model's leaves) of the leaves it is paired with.
    """

    kind: Kind
    axis: int
    inner: tuple[int, ...]
    output: int | None = None
    contracted: int | None = None
    partners: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Matmul:
    """A weight's matrix product in the forward pass, as one step runs it.

    - `leaf`: the weight's index (into the model's leaves).
    - `activation`, `output`: the bytes of its activation operand and of its
        output, whole (no device's share); a lookup (an embedding's `gather`) has
        no activation.
    - `source`: which value its activation operand is: matmuls of the same source
        read the same activation (query, key and value of one input).
    - `trips`: how many times one step runs it: the product of the lengths of the
        scans around it (a `while` loop counts once).
    """

    leaf: int
    activation: int
    output: int
    trips: int
    source: int = 0


@dataclasses.dataclass(frozen=True)
class Pipelined:
    """How `eqshard.parallel.pipeline` runs a stacked leaf: the stack's leading axes (`depth`:
    1 for GPipe's `(layers, ...)`, 2 for the circular schedule's `(rounds, stages,
    ...)`), the schedule, the microbatches, the mesh axis of the stages, the batch's
    (`batch_axis`, `None` if not given) and the rows of the input it cuts."""

    depth: int
    schedule: str
    microbatches: int
    axis: str
    batch_axis: str | None = None
    batch: int = 0


@dataclasses.dataclass(frozen=True)
class Value:
    """What the walk knows of one value of the jaxpr.

    - `view`: `(leaf, axes)` where the value is the model's leaf `leaf` seen through
        casts, transposes, slices and broadcasts: each axis's leaf axis, or `None`.
    - `sources`: the weights whose matmul output reaches it through operations that
        are not a weight's matmul.
    - `features`: `(weight, axis)`: which of its axes holds a weight's output axis.
    - `data`: whether it depends on the step's arguments other than the model.
    """

    view: tuple[int, tuple[int | None, ...]] | None = None
    sources: frozenset[int] = frozenset()
    features: tuple[tuple[int, int], ...] = ()
    data: bool = False


NOTHING = Value()

# Operations that show a leaf as it is, axis for axis (casts, copies, constraints).
_SAME = frozenset(
    {
        "convert_element_type",
        "copy",
        "copy_p",
        "reduce_precision",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
        "optimization_barrier",
    }
)
_BIAS_OPS = frozenset({"add", "sub", "add_any"})


def _join(a: Value, b: Value) -> Value:
    """What a loop's carry may hold: what either value holds (a view where they agree)."""
    return Value(
        a.view if a.view == b.view else None,
        a.sources | b.sources,
        tuple(f for f in a.features if f in b.features),
        a.data or b.data,
    )


def _merged(values: Sequence[Value]) -> Value:
    """A value computed from `values` by an operation that is not a weight's matmul."""
    sources: frozenset[int] = frozenset().union(*(v.sources for v in values))
    return Value(None, sources, (), any(v.data for v in values))


def _is_backward(eqn: Any) -> bool:
    """Whether `eqn` belongs to a gradient's transposed computation."""
    return is_transposed(eqn)


@dataclasses.dataclass(frozen=True)
class _Dot:
    """A matmul's dimension numbers, as `(lhs, rhs)` pairs: the contracted dims, the
    batch dims, the rhs's group dims (a ragged dot's stack of matrices, one per group
    of the lhs's rows) and whether the output leads with a dim of the groups (a ragged
    dot whose lhs is ragged along a contracted dim)."""

    contracting: tuple[tuple[int, ...], tuple[int, ...]]
    batch: tuple[tuple[int, ...], tuple[int, ...]]
    groups: tuple[int, ...] = ()
    grouped_output: bool = False


def ragged_numbers(eqn: Any) -> _Dot:
    """A `ragged_dot_general` equation's dimension numbers (its public
    `jax.lax.RaggedDotDimensionNumbers`).

    **Raises:** `EqshardError` where this JAX writes them otherwise.
    """
    numbers = param(eqn, "ragged_dot_dimension_numbers")
    if not isinstance(numbers, jax.lax.RaggedDotDimensionNumbers):
        raise missing("a `ragged_dot_general` equation's `RaggedDotDimensionNumbers`")
    (lc, rc), (lb, rb) = numbers.dot_dimension_numbers
    ragged = tuple(int(a) for a in numbers.lhs_ragged_dimensions)
    return _Dot(
        (tuple(lc), tuple(rc)),
        (tuple(lb), tuple(rb)),
        tuple(int(a) for a in numbers.rhs_group_dimensions),
        any(a in lc for a in ragged),
    )


@dataclasses.dataclass
class _Use:
    """How a weight is first used in a matmul."""

    outputs: tuple[int, ...]
    contracted: tuple[int, ...]
    inner: tuple[int, ...]


class Walk:
    """The abstract interpretation of the forward pass (see the module docstring)."""

    def __init__(self) -> None:
        self.order: list[int] = []  # weights, by their first matmul
        self.uses: dict[int, _Use] = {}
        self.edges: dict[int, dict[int, None]] = {}  # weight -> the weights it feeds
        self.lookups: dict[int, tuple[int, tuple[int, ...]]] = {}  # leaf -> (axis, inner)
        self.biases: dict[int, dict[int, tuple[int, tuple[int, ...]]]] = {}
        self.trips = 1  # the product of the lengths of the scans being walked
        self.matmuls: list[Matmul] = []  # a loop's body's, from its last walk only
        self.sources: dict[Any, int] = {}  # an activation's variable -> its number
        self.labels: dict[int, tuple[tuple[int, int], ...]] = {}  # see StepProfile.labels
        self.named_vars: dict[Any, int] = {}  # a named activation's variable -> its index
        self.experts: dict[int, dict[int, None]] = {}  # each stack's expert axes, in order
        self.expert_labels: dict[int, set[int]] = {}  # see StepProfile.expert_labels
        self.attention_free: dict[int, set[int]] = {}  # see StepProfile.attention_free
        self.attention_contracted: dict[int, set[int]] = {}  # and .attention_contracted
        self.pipelined: dict[int, Pipelined] = {}  # see StepProfile.pipelined

    def source(self, var: Any) -> int:
        """A number for the value `var` holds, the same each time it is read."""
        if isinstance(var, JaxprLiteral):
            return 0
        return self.sources.setdefault(var, len(self.sources) + 1)

    # ----------------------------------------------------------------- jaxprs
    def run(self, jaxpr: Jaxpr, consts: Sequence[Value], args: Sequence[Value]) -> list[Value]:
        env: dict[Any, Value] = {}
        for var, value in zip(jaxpr.constvars, consts):
            env[var] = value
        for var, value in zip(jaxpr.invars, args):
            env[var] = value

        def read(atom: Any) -> Value:
            return NOTHING if isinstance(atom, JaxprLiteral) else env.get(atom, NOTHING)

        for eqn in jaxpr.eqns:
            if _is_backward(eqn):
                continue  # the gradient: its values reach nothing of the forward pass
            ins = [read(atom) for atom in eqn.invars]
            outs = self.eqn(eqn, ins)
            for var, value in zip(eqn.outvars, outs):
                env[var] = value
        return [read(atom) for atom in jaxpr.outvars]

    def closed(self, closed: Any, args: Sequence[Value]) -> list[Value]:
        if isinstance(closed, ClosedJaxpr):
            return self.run(closed.jaxpr, [NOTHING] * len(closed.consts), args)
        return self.run(closed, [], args)

    # ----------------------------------------------------------------- equations
    def eqn(self, eqn: Any, ins: list[Value]) -> list[Value]:
        name = eqn.primitive.name
        n_out = len(eqn.outvars)
        handler = _HANDLERS.get(name)
        if handler is not None:
            return handler(self, eqn, ins)
        if name in _SAME:
            return [*ins[:n_out], *[_merged(ins)] * (n_out - len(ins))]
        inner = _inner_jaxpr(eqn)
        if inner is not None:
            return self.closed(inner, ins)
        if name in _BIAS_OPS:
            self._bias(eqn, ins)
        return [_merged(ins)] * n_out

    def _bias(self, eqn: Any, ins: list[Value]) -> None:
        """An addition: a leaf added along a weight's output axis, right after its
        matmul, is that weight's bias."""
        rank = len(eqn.outvars[0].aval.shape)
        for x, y in ((0, 1), (1, 0)):
            view = ins[y].view if y < len(ins) and x < len(ins) else None
            if view is None:
                continue
            leaf, axes = view
            if len(axes) != rank or len(_known(axes, range(rank))) != 1:
                continue  # only a vector along the output axis is a bias
            for weight, axis in ins[x].features:
                along = axes[axis]
                if along is not None and leaf != weight:
                    self.biases.setdefault(weight, {}).setdefault(leaf, (along, (along,)))

    def _dot_general(self, eqn: Any, ins: list[Value]) -> list[Value]:
        lhs, rhs = ins[0], ins[1]
        (lc, rc), (lb, rb) = param(eqn, "dimension_numbers")
        if lhs.view is None and rhs.view is None and lhs.data and rhs.data:
            self._attention(eqn, (lc, rc), (lb, rb))
        return self._matmul(eqn, ins, _Dot((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))))

    def _ragged_dot(self, eqn: Any, ins: list[Value]) -> list[Value]:
        """`jax.lax.ragged_dot`: each group of the lhs's rows (`group_sizes`, its third
        operand) times its own matrix of the rhs's stack, the rhs's group dim."""
        return self._matmul(eqn, ins, ragged_numbers(eqn))

    def _matmul(self, eqn: Any, ins: list[Value], dot: _Dot) -> list[Value]:
        """A matmul of a leaf and an activation: the leaf is a weight. Its axes that the
        matmul batches over (a `dot_general`'s batch dims, matched with the
        activation's) or groups by (a ragged dot's group dims) are a stack of experts,
        each applied to its own tokens: neither output nor contracted."""
        lhs, rhs = ins[0], ins[1]
        view = lhs.view or rhs.view
        if view is None or (lhs.view is not None and rhs.view is not None):
            return [_merged(ins)]  # two activations, or two leaves
        side = 0 if lhs.view is not None else 1
        activation = ins[1 - side]
        contracting = dot.contracting[side]
        stacked = (*dot.batch[side], *(dot.groups if side == 1 else ()))
        leaf, axes = view
        free = [a for a in range(len(axes)) if a not in contracting and a not in stacked]
        if leaf not in self.uses:
            self.order.append(leaf)
            self.uses[leaf] = _Use(
                _known(axes, free),
                _known(axes, contracting),
                tuple(sorted(_known(axes, [i for i in range(len(axes)) if i not in stacked]))),
            )
        for source in activation.sources:
            if source != leaf:
                self.edges.setdefault(source, {})[leaf] = None
        along = _known(axes, stacked)
        if along:  # batched or grouped over one of the weight's axes: a stack of experts
            self.experts.setdefault(leaf, {})[along[0]] = None
            other = eqn.invars[1 - side]
            index = None if isinstance(other, JaxprLiteral) else self.named_vars.get(other)
            theirs = dot.batch[1 - side]
            if index is not None and theirs:
                rank = len(shape_of(other))
                self.expert_labels.setdefault(index, set()).update(a - rank for a in theirs)
        operand = eqn.invars[1 - side]
        self.matmuls.append(
            Matmul(
                leaf,
                _nbytes(operand.aval),
                _nbytes(eqn.outvars[0].aval),
                self.trips,
                self.source(operand),
            )
        )
        # the output: a ragged contraction's groups, the batch dims, the lhs's free
        # dims, then the rhs's
        (lc, _), (lb, _) = dot.contracting, dot.batch
        lhs_free = len(eqn.invars[0].aval.shape) - len(lc) - len(lb)
        features: tuple[tuple[int, int], ...] = ()
        if free and axes[free[0]] is not None:
            at = dot.grouped_output + len(lb) + (0 if side == 0 else lhs_free)
            features = ((leaf, at),)
        data = activation.data or any(v.data for v in ins[2:])  # a ragged dot's groups
        return [Value(None, frozenset({leaf}), features, data)]

    def _attention(self, eqn: Any, contracting: Any, batch: Any) -> None:
        """A matmul of two activations (attention's scores, or its weighted sum): the
        named operands' axes it neither contracts nor batches over."""
        named = [
            None if isinstance(var, JaxprLiteral) else self.named_vars.get(var)
            for var in eqn.invars[:2]
        ]
        for side, index in enumerate(named):
            if index is None:
                continue
            rank = len(shape_of(eqn.invars[side]))
            if None not in named:  # the scores: queries and keys, each named
                skip = set(contracting[side]) | set(batch[side])
                free = {a - rank for a in range(rank) if a not in skip}
                self.attention_free.setdefault(index, set()).update(free)
            contracted = {a - rank for a in contracting[side]}
            self.attention_contracted.setdefault(index, set()).update(contracted)

    def _gather(self, eqn: Any, ins: list[Value]) -> list[Value]:
        operand, indices = ins[0], ins[1]
        out = _merged(ins)
        if operand.view is None or indices.view is not None:
            return [out]
        leaf, axes = operand.view
        numbers = param(eqn, "dimension_numbers")
        sizes = param(eqn, "slice_sizes")
        shape = eqn.invars[0].aval.shape
        looked = [a for a in numbers.start_index_map if sizes[a] < shape[a]]
        along = axes[looked[0]] if len(looked) == 1 else None
        if along is not None and indices.data:
            inner = tuple(sorted(_known(axes, range(len(axes)))))
            self.lookups.setdefault(leaf, (along, inner))
            self.matmuls.append(Matmul(leaf, 0, _nbytes(eqn.outvars[0].aval), self.trips))
        return [out]

    def _transpose(self, eqn: Any, ins: list[Value]) -> list[Value]:
        (x,) = ins
        perm = param(eqn, "permutation")
        view = None if x.view is None else (x.view[0], tuple(x.view[1][p] for p in perm))
        features = tuple((w, perm.index(a)) for w, a in x.features)
        return [Value(view, x.sources, features, x.data)]

    def _name(self, eqn: Any, ins: list[Value]) -> list[Value]:
        """A `checkpoint_name`, the identity: one eqshard puts on an activation the
        model names while `eqshard suggest` records (`_activations.marked`) says
        which weights' outputs the named axes hold."""
        label = str(param(eqn, "name"))
        if label.startswith(MARKED) and ins[0].view is not None:
            depth, schedule, microbatches, axis, batch_axis, batch = label[len(MARKED) :].split(":")
            found = Pipelined(
                int(depth), schedule, int(microbatches), axis, batch_axis or None, int(batch)
            )
            self.pipelined.setdefault(ins[0].view[0], found)
        if label.startswith(RECORDED):
            rank = len(shape_of(eqn.outvars[0]))
            found = tuple((weight, axis - rank) for weight, axis in ins[0].features)
            self.labels[int(label[len(RECORDED) :])] = found
            self.named_vars[eqn.outvars[0]] = int(label[len(RECORDED) :])
        return ins[:1]

    def _broadcast_in_dim(self, eqn: Any, ins: list[Value]) -> list[Value]:
        x = ins[0]
        dims = param(eqn, "broadcast_dimensions")
        rank = len(param(eqn, "shape"))
        out = _merged(ins)
        if x.view is not None:
            axes: list[int | None] = [None] * rank
            for i, d in enumerate(dims):
                axes[int(d)] = x.view[1][i]
            out = dataclasses.replace(out, view=(x.view[0], tuple(axes)))
        features = tuple((w, int(dims[a])) for w, a in x.features)
        return [dataclasses.replace(out, features=features)]

    def _reshape(self, eqn: Any, ins: list[Value]) -> list[Value]:
        """A reshape that only adds or drops axes of size 1 keeps the rest."""
        x = ins[0]
        before = tuple(eqn.invars[0].aval.shape)
        after = tuple(eqn.outvars[0].aval.shape)
        kept_before = [i for i, s in enumerate(before) if s != 1]
        kept_after = [i for i, s in enumerate(after) if s != 1]
        out = _merged(ins)
        if [before[i] for i in kept_before] != [after[i] for i in kept_after]:
            return [out]
        where = dict(zip(kept_before, kept_after))
        if x.view is not None:
            axes: list[int | None] = [None] * len(after)
            for i, j in where.items():
                axes[j] = x.view[1][i]
            out = dataclasses.replace(out, view=(x.view[0], tuple(axes)))
        features = tuple((w, where[a]) for w, a in x.features if a in where)
        return [dataclasses.replace(out, features=features)]

    def _squeeze(self, eqn: Any, ins: list[Value]) -> list[Value]:
        x = ins[0]
        dropped = {int(d) for d in param(eqn, "dimensions")}
        kept = [i for i in range(len(eqn.invars[0].aval.shape)) if i not in dropped]
        out = _merged(ins)
        if x.view is not None:
            out = dataclasses.replace(out, view=(x.view[0], tuple(x.view[1][i] for i in kept)))
        features = tuple((w, kept.index(a)) for w, a in x.features if a in kept)
        return [dataclasses.replace(out, features=features)]

    def _slice_view(self, ins: list[Value]) -> list[Value]:
        """A slice of a leaf is still the leaf, axis for axis (a stacked layer taken
        by index, a fused weight cut into parts)."""
        out = _merged(ins)
        return [dataclasses.replace(out, view=ins[0].view, features=ins[0].features)]

    def _slice(self, eqn: Any, ins: list[Value]) -> list[Value]:
        return self._slice_view(ins)

    def _dynamic_slice(self, eqn: Any, ins: list[Value]) -> list[Value]:
        return self._slice_view(ins)

    # ----------------------------------------------------------------- control flow
    def _scan(self, eqn: Any, ins: list[Value]) -> list[Value]:
        consts, carries = _scan_counts(eqn)
        body = param(eqn, "jaxpr")
        xs = [_sliced(v) for v in ins[consts + carries :]]
        carry = list(ins[consts : consts + carries])
        outer = self.trips
        self.trips = outer * int(param(eqn, "length"))
        try:
            outs = self._fixed_point(
                lambda c: self.closed(body, [*ins[:consts], *c, *xs]), carry, carries
            )
        finally:
            self.trips = outer
        return [*outs[:carries], *(_merged([v]) for v in outs[carries:])]

    def _while(self, eqn: Any, ins: list[Value]) -> list[Value]:
        cond_n = param(eqn, "cond_nconsts")
        body_n = param(eqn, "body_nconsts")
        body_consts = ins[cond_n : cond_n + body_n]
        carry = list(ins[cond_n + body_n :])
        return self._fixed_point(
            lambda c: self.closed(param(eqn, "body_jaxpr"), [*body_consts, *c]), carry, len(carry)
        )

    def _cond(self, eqn: Any, ins: list[Value]) -> list[Value]:
        found: list[Value] | None = None
        for branch in param(eqn, "branches"):
            outs = self.closed(branch, ins[1:])
            found = outs if found is None else [_join(a, b) for a, b in zip(found, outs)]
        index = ins[0]
        return [
            dataclasses.replace(v, data=v.data or index.data, view=None)
            for v in (found or [NOTHING] * len(eqn.outvars))
        ]

    def _fixed_point(
        self, body: Callable[[list[Value]], list[Value]], carry: list[Value], n: int
    ) -> list[Value]:
        """Runs a loop's body until its carry holds no more than it did: a weight's
        output reaches the next iteration's weights through the carry."""
        walked = len(self.matmuls)
        for _ in range(64):  # each round grows a finite set, or stops
            del self.matmuls[walked:]  # the body's matmuls, counted once
            outs = body(carry)
            grown = [_join(c, o) for c, o in zip(carry, outs[:n])]
            if grown == carry:
                return outs
            carry = grown
        del self.matmuls[walked:]
        return body(carry)

    # ----------------------------------------------------------------- the roles
    def roles(self) -> dict[int, Role]:
        """Each leaf's role, assigned greedily in the order of the forward pass."""
        found: dict[int, Role] = {}
        fed_by: dict[int, list[int]] = {}
        for weight in self.order:
            if weight in found:
                continue
            use = self.uses[weight]
            if not use.outputs:
                continue
            feeds = [c for c in self.edges.get(weight, {}) if c in self.uses and c != weight]
            if not feeds:
                found[weight] = Role("vocab", use.outputs[0], use.inner, *_io(use))
                continue
            if any(found.get(c) is not None and found[c].kind != "row" for c in feeds):
                continue  # it feeds a column-parallel weight, which wants it whole
            fresh = [c for c in feeds if c not in found and self.uses[c].contracted]
            if not fresh and not all(c in found for c in feeds):
                continue
            found[weight] = Role("column", use.outputs[0], use.inner, *_io(use), tuple(feeds))
            for consumer in feeds:
                fed_by.setdefault(consumer, []).append(weight)
            for consumer in fresh:
                cuse = self.uses[consumer]
                found[consumer] = Role("row", cuse.contracted[0], cuse.inner, *_io(cuse))
        for weight, feeders in fed_by.items():
            role = found.get(weight)
            if role is not None and role.kind == "row":
                found[weight] = dataclasses.replace(role, partners=tuple(feeders))
        for leaf, (axis, inner) in self.lookups.items():
            if leaf not in found:
                found[leaf] = Role("embedding", axis, inner)
        for weight, biases in self.biases.items():
            role = found.get(weight)
            if role is None or role.kind not in ("column", "vocab"):
                continue
            for leaf, (axis, inner) in biases.items():
                if leaf not in found and axis is not None:
                    found[leaf] = Role("bias", axis, inner, partners=(weight,))
        return found


_HANDLERS: dict[str, Callable[[Walk, Any, list[Value]], list[Value]]] = {
    "dot_general": Walk._dot_general,
    "ragged_dot_general": Walk._ragged_dot,
    "name": Walk._name,
    "gather": Walk._gather,
    "transpose": Walk._transpose,
    "broadcast_in_dim": Walk._broadcast_in_dim,
    "reshape": Walk._reshape,
    "squeeze": Walk._squeeze,
    "slice": Walk._slice,
    "dynamic_slice": Walk._dynamic_slice,
    "scan": Walk._scan,
    "while": Walk._while,
    "cond": Walk._cond,
}


def _known(axes: Sequence[int | None], positions: Any) -> tuple[int, ...]:
    """The leaf axes at `positions` of a view, those it has (not broadcast ones)."""
    found = (axes[p] for p in positions)
    return tuple(a for a in found if a is not None)


def _io(use: _Use) -> tuple[int | None, int | None]:
    return (
        use.outputs[0] if use.outputs else None,
        use.contracted[0] if use.contracted else None,
    )


def _sliced(value: Value) -> Value:
    """A scanned-over value, as the body sees one slice of it: its leading axis gone."""
    view = None if value.view is None else (value.view[0], value.view[1][1:])
    features = tuple((w, a - 1) for w, a in value.features if a > 0)
    return Value(view, value.sources, features, value.data)


_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _scan_counts(eqn: Any) -> tuple[int, int]:
    """A scan's number of constants and of carries: its `num_consts` and `num_carry`
    (JAX 0.10), or the sizes of the first two parts of its flat tree of inputs,
    `ft_in` = (consts, carry, xs) (JAX 0.12)."""
    if "num_consts" in eqn.params:
        return int(param(eqn, "num_consts")), int(param(eqn, "num_carry"))
    try:
        consts, carry, _ = param(eqn, "ft_in").elts
        return len(list(consts.vals)), len(list(carry.vals))
    except (AttributeError, TypeError, ValueError):
        raise missing("a scan's constants and carries (`ft_in` as consts, carry, xs)") from None


def _inner_jaxpr(eqn: Any) -> Any:
    """The jaxpr a call-like equation runs on its operands as they are (`jit`,
    `checkpoint`, `custom_jvp_call`, `custom_vjp_call`, ...), or `None`."""
    for key in _CALL_PARAMS:
        inner = eqn.params.get(key)
        jaxpr = inner.jaxpr if isinstance(inner, ClosedJaxpr) else inner
        if isinstance(jaxpr, Jaxpr) and len(jaxpr.invars) == len(eqn.invars):
            return inner
    return None


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def shape_of(var: Any) -> tuple[int, ...]:
    return tuple(var.aval.shape)
