"""`assert_equivalent`: the sharded step computes what the unsharded one does."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._cost._hlo._collectives import KINDS
from .._errors import EqshardError, whole_number
from ._processes import TIMEOUT_SECONDS, device_counts, mesh_template, run_per_count
from ._references import callable_reference, spec_reference
from ._tolerances import Needed

if TYPE_CHECKING:  # JAX only for the type: the harness starts none
    from .._plan import Spec

__all__ = ["COLLECTIVE_KINDS", "assert_equivalent"]

COLLECTIVE_KINDS = KINDS  # every kind `eqshard.cost` reads from the compiled step
_SHOWN = 10  # differing leaves shown per device count


def assert_equivalent(
    build: Callable[[], Any] | str,
    spec: Spec,
    loss: Callable[..., Any] | str,
    batch: Callable[[], Any] | str,
    *,
    devices: Sequence[int] | None = None,
    optimizer: Callable[[], Any] | str | None = None,
    mesh: Mapping[str, int | str] | None = None,
    batch_spec: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    max_communication: Mapping[str, int] | None = None,
    timeout: float = TIMEOUT_SECONDS,
) -> None:
    """Asserts that the sharded model computes what the unsharded one does: the loss,
    the gradients and one optimizer step, on each device count.

    **Example:**

    ```python
    from pathlib import Path
    from eqshard.testing import assert_equivalent

    def test_spec_is_equivalent():
        assert_equivalent(mypkg.model.build, Path("specs/model.eqshard.json"),
                          mypkg.model.loss, mypkg.model.batch,
                          devices=(1, 2, 8), optimizer=mypkg.model.optimizer)
    ```

    **Arguments:**

    - `build`: `build()` returns the model, or a stateful model and its state
        (`eqx.nn.make_with_state(Net)(key)` returns `(model, state)`); see "Callables".
    - `spec`: anything `eqshard.apply` takes that can cross into another process (see
        "The spec").
    - `loss`: `loss(model, batch)` returns a scalar; for a `(model, state)` build, see
        "Stateful models".
    - `batch`: `batch()` returns a batch.
    - `devices`: the device counts; by default the spec's own: its file's `"devices"`,
        else counts its mesh fits, else 1, 2 and 8.
    - `optimizer`: `optimizer()` returns an optax optimizer; without one, the loss and
        gradients are compared.
    - `mesh`: a mesh template for each count, `{"data": "*", "model": 4}` (`"*"`: the
        rest of the devices), instead of the spec's own mesh.
    - `batch_spec`: the expression of every batch leaf; by default the spec file's
        `"batch"` (see "The batch").
    - `rtol`, `atol`: the tolerance for every leaf; by default per dtype, from
        `eqshard.testing.TOLERANCES` (float32: 1e-5 and 1e-6). Integer leaves must be
        equal.
    - `max_communication`: bytes per collective kind that the compiled step may move on
        each device (see "Communication budgets").
    - `timeout`: seconds per device count.

    **Raises:**

    - `AssertionError`: names each leaf that differs, or each collective kind over its
        budget (see "Failures").
    - `eqshard.EqshardError`: arguments that cannot cross into the worker processes, a
        `loss` of the wrong shape for what `build` returns, or the user's code failing
        there (see "Failures").

    !!! info "What runs"

        Each device count runs in a fresh Python process with that many simulated CPU
        devices. It builds the model and the batch. It runs one jitted step on one
        device: loss and gradients with `eqx.filter_value_and_grad`, then the
        optimizer's update. Then it runs the same step with the model (and its state)
        and its optimizer state placed by the spec. The batch is laid out as
        `eqshard.jit` lays it out (see "The batch"). Then every leaf is compared. The
        optimizer state follows the spec's optimizer section, where it has one (ZeRO-1).
        Leaves a spec holds in host memory (`"memory": "pinned_host"`) are moved to the
        device inside each step, as a host-offload step moves them.

    !!! info "The spec"

        `spec` may be a spec file as a `pathlib.Path` (its declared mesh is used),
        `Rules`, an expression, or `eqshard.resolvers.FROM_FIELDS`. For a `(model, state)` build
        the plan is made from the pair, so it lays out the state too. Rules may name
        state leaves (`bn.batch_state_index.*`), and a spec tree is a pair.

    !!! info "Callables"

        `build`, `loss`, `batch` and `optimizer` are imported again in each process.
        Pass them as top-level functions of an importable module. Or pass them as
        strings: `"mypkg.model:build"`, `"path/to/file.py:build"`.

    !!! info "The batch"

        `batch_spec` lays out every batch leaf. By default it is the spec file's
        `"batch"` (`Rules.batch`: an expression, or a section of rules over the batch's
        paths), as `eqshard.cost` and `eqshard.jit` take it. Else the batch is data
        parallel: the leading dim split over the mesh's first axis (else over every
        device). `"... -> * ..."` replicates the batch.

    !!! info "Stateful models"

        A stateful model (BatchNorm's running statistics in an `eqx.nn.State`) is built
        as `eqx.nn.make_with_state` builds it. Its loss is written as in Equinox's
        BatchNorm example. `loss(model, state, batch)` returns `(value, new_state)`; its
        gradients are taken with `has_aux=True`. The new state is compared leaf by leaf
        too. Each leaf is named by its layer (`bn.batch_state_index.0`, the running
        mean):

        ```python
        def build():
            return eqx.nn.make_with_state(Net)(jax.random.key(0))   # (model, state)

        def loss(model, state, batch):
            x, y = batch
            out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None),
                                  out_axes=(0, None))(x, state)
            return jnp.mean((out - y) ** 2), state
        ```

    !!! info "Communication budgets"

        `max_communication` maps a collective kind to bytes. The kinds are
        `"all-gather"`, `"all-reduce"`, `"reduce-scatter"`, `"collective-permute"`,
        `"all-to-all"`, `"ragged-all-to-all"` and `"collective-broadcast"`
        (`COLLECTIVE_KINDS`). The bytes are summed over the step, as `eqshard.cost`
        counts them: a reduce-scatter by its operand, any other by its result. The batch
        is laid out as above. `{"all-gather": 0}` asserts that no parameter is gathered.

        A collective in a loop counts once per trip where XLA knows the trip count
        (`jax.lax.scan`), else once. Of a `cond`'s branches, the one that moves the most
        of each kind counts. The compiled program may hold a collective, a device-group
        notation or a dtype eqshard cannot read. Then the step fails with an
        `EqshardError` naming it: a budget never passes on what was not read.

    !!! info "Tolerances"

        A sharded step adds in another order than an unsharded one: partial sums on each
        device, then an all-reduce. So floats differ in their last bits, and the
        defaults allow for that. A failure prints, for each leaf and for the whole
        comparison, two values. One is the smallest `rtol` (with `atol` as given) that
        would pass. The other is the smallest `atol` (with `rtol` as given) that would
        pass. Loosening them is right for differences that are rounding, amplified:

        - Batch statistics reduced across devices (BatchNorm in a data-parallel step).
            The mean and variance are all-reduced, and the difference reaches every
            activation, gradient and running statistic after them. A deep BatchNorm
            ResNet's float32 gradients differ by about 3e-6.
        - A value that is zero up to rounding: the gradient of a bias just before a
            BatchNorm, which takes the mean out. Its relative difference means nothing,
            so it needs `atol`. A printed `rtol` of 1 or more says so.
        - An adaptive optimizer after a reduction. Adam's first step divides by
            `|g| + eps`. So a gradient near zero that differs in its last bits moves a
            parameter by a visible part of the learning rate (after
            `optax.clip_by_global_norm`'s all-reduced norm, say). The optimizer step
            here starts from the unsharded gradients, so the step's own differences are
            not amplified.

    !!! warning "Loosening hides real bugs"

        Where the difference is not rounding, loosening hides a real bug. A relative
        difference of 1e-3 or more, or one that grows with the device count, comes from
        what was computed, not from the order of a sum. Examples: statistics of each
        device's part of the batch only, a state update that depends on the device
        count, a leaf laid out with the wrong dims. Loosen to a small multiple of the
        printed smallest value, for the leaves that need it. Never loosen to a round
        1e-2.

    !!! info "Failures"

        For a leaf that differs, the `AssertionError` gives its device count, the
        largest difference and the smallest tolerances that would pass it. Then it gives
        those that would pass every leaf. For a collective kind over its budget, it
        gives its largest operations. For a `loss` of the wrong shape,
        `eqshard.EqshardError` says which shape is expected. When the user's code fails,
        it says what raised.
    """
    template = mesh_template(mesh)
    counts = device_counts(devices, spec, template)
    request: dict[str, Any] = {
        "task": "equivalence",
        "build": callable_reference(build, "build"),
        "loss": callable_reference(loss, "loss"),
        "batch": callable_reference(batch, "batch"),
        "optimizer": None if optimizer is None else callable_reference(optimizer, "optimizer"),
        "spec": spec_reference(spec),
        "mesh": template,
        "batch_spec": batch_spec,
        "rtol": rtol,
        "atol": atol,
        "max_communication": _budget(max_communication),
    }
    results = run_per_count(request, counts, "testing equivalence", timeout)
    text = failure_text(results, rtol, atol)
    if text:
        raise AssertionError(text)


def failure_text(
    results: Mapping[int, Mapping[str, Any]], rtol: float | None, atol: float | None
) -> str:
    """What `assert_equivalent` raises, from each device count's result (empty where
    everything agrees): each count's differing leaves, then the smallest tolerances
    that would pass every leaf on every count, then each collective over budget."""
    lines = []
    needed = Needed()
    for n, result in results.items():
        lines += _differences(n, result["differences"])
        needed.include(result["needed"])
    if lines:
        lines.append(_smallest(needed, sorted(results), rtol, atol))
    for n, result in results.items():
        lines += _over_budget(n, result["over_budget"])
    return "\n".join(lines)


def _budget(budget: Mapping[str, int] | None) -> dict[str, int] | None:
    if budget is None:
        return None
    checked = {}
    for kind, limit in budget.items():
        if kind not in COLLECTIVE_KINDS:
            raise EqshardError(
                f"`max_communication`: {kind!r} is not a collective kind; the kinds are "
                f"{', '.join(map(repr, COLLECTIVE_KINDS))}"
            )
        checked[kind] = whole_number(limit, f"max_communication[{kind!r}]", minimum=0)
    return checked


def _differences(n: int, found: list[dict[str, Any]]) -> list[str]:
    if not found:
        return []
    leaves = "1 leaf differs" if len(found) == 1 else f"{len(found)} leaves differ"
    lines = [f"on {n} devices, {leaves} from the unsharded run:"]
    for d in found[:_SHOWN]:
        where = f"{d['part']} {d['leaf']}" if d["leaf"] != d["part"] else d["part"]
        if "message" in d:
            lines.append(f"  {where}: {d['message']}")
            continue
        index = f"[{', '.join(map(str, d['index']))}]" if d["index"] else ""
        lines.append(
            f"  {where} ({d['dtype']}): {d['count']} of {d['size']} elements; the largest "
            f"difference {d['difference']:.3g} at {index or 'the scalar'}: sharded "
            f"{d['sharded']}, unsharded {d['unsharded']} (rtol {d['rtol']:g}, "
            f"atol {d['atol']:g}; {_passes_with(Needed(**d['needed']))})"
        )
    if len(found) > _SHOWN:
        lines.append(f"  ... and {len(found) - _SHOWN} more")
    return lines


def _passes_with(needed: Needed) -> str:
    """The smallest tolerances one leaf passes with, for its line."""
    if needed.no_tolerance is not None:
        return f"no tolerance passes it: {needed.no_tolerance}"
    if needed.no_rtol is not None:
        return f"passes with atol {needed.atol:.3g}; no rtol: {needed.no_rtol}"
    return f"passes with rtol {needed.rtol:.3g} or atol {needed.atol:.3g}"


def _smallest(needed: Needed, counts: list[int], rtol: float | None, atol: float | None) -> str:
    """The line that tells the user the smallest tolerances that pass the whole
    comparison, each with the other as given."""
    where = " and ".join(filter(None, [", ".join(map(str, counts[:-1])), str(counts[-1])]))
    if needed.no_tolerance is not None:
        return f"no tolerance passes every leaf on {where} devices: {needed.no_tolerance}"
    given_atol = "each dtype's default atol" if atol is None else f"atol={atol:g}"
    given_rtol = "each dtype's default rtol" if rtol is None else f"rtol={rtol:g}"
    loosen = "loosen them only where a difference is expected: see `assert_equivalent`'s docstring"
    with_atol = f"atol={needed.atol:.3g} (with {given_rtol})"
    if needed.no_rtol is not None:
        return (
            f"the smallest tolerance that passes every leaf on {where} devices: {with_atol}; "
            f"no rtol does ({needed.no_rtol}); {loosen}"
        )
    return (
        f"the smallest tolerances that pass every leaf on {where} devices: "
        f"rtol={needed.rtol:.3g} (with {given_atol}) or {with_atol}; {loosen}"
    )


def _over_budget(n: int, over: list[dict[str, Any]]) -> list[str]:
    lines = []
    for o in over:
        if "unknown" in o:
            lines.append(
                f"on {n} devices, the step's {o['kind']}s run in {'; '.join(o['unknown'])}, "
                "whose trip count depends on values: what they move per step is not known, "
                f"so the budget of {o['limit']:,} bytes cannot be met"
            )
            continue
        lines.append(
            f"on {n} devices, the step's {o['kind']}s move {o['bytes']:,} bytes per device, "
            f"over the budget of {o['limit']:,} ({o['count']} operations; the largest:)"
        )
        for op in o["ops"]:
            axes = ", ".join(op["axes"]) or "-"
            times = f" ({op['count']} runs)" if op["count"] > 1 else ""
            source = op.get("brief_source", op["source"]) or "?"  # the op's name, cut
            lines.append(f"  {op['bytes']:,} bytes{times} over ({axes}) from {source}")
    return lines
