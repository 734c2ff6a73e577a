"""`assert_equivalent`: the sharded step computes what the unsharded one does."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._cost._hlo._collectives import KINDS
from .._errors import EqshardError, UsageError, whole_number
from .._warnings import deprecated
from ._processes import (
    TIMEOUT_SECONDS,
    device_counts as device_counts_of,
    mesh_template,
    run_per_count,
)
from ._references import callable_reference, spec_reference
from ._tolerances import Needed

if TYPE_CHECKING:  # JAX only for the type: the harness starts none
    from .._expression import Expression
    from .._plan import Spec

__all__ = ["COLLECTIVE_KINDS", "assert_equivalent"]

COLLECTIVE_KINDS = KINDS  # every kind `eqshard.cost` reads from the compiled step
_SHOWN = 10  # differing leaves shown per device count


def assert_equivalent(
    build: Callable[[], Any] | str,
    spec: Spec,
    loss: Callable[..., Any] | str,
    make_batch: Callable[[], Any] | str | None = None,
    *,
    device_counts: int | Sequence[int] | None = None,
    optimizer: Callable[[], Any] | str | None = None,
    mesh: Mapping[str, int | str] | None = None,
    batch: str | Expression | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    max_communication: Mapping[str, int] | None = None,
    timeout: float = TIMEOUT_SECONDS,
    devices: int | Sequence[int] | None = None,
    batch_spec: str | None = None,
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
                          device_counts=(1, 2, 8), optimizer=mypkg.model.optimizer)
    ```

    **Arguments:**

    - `build`: `build()` returns the model, or `(model, state)` as
        `eqx.nn.make_with_state` does; a top-level function or `"module:callable"`.
    - `spec`: anything `eqshard.apply` takes that can cross into another process.
    - `loss`: `loss(model, batch)` returns a scalar (`loss(model, state, batch)`
        returns `(value, state)` for a `(model, state)` build).
    - `make_batch`: `make_batch()` returns a batch.
    - `device_counts`: the device counts, each run in a worker with that many
        simulated devices; by default the spec file's `"devices"`, else counts its mesh
        fits, else 1, 2 and 8.
    - `optimizer`: `optimizer()` returns an optax optimizer; without one, the loss and
        gradients are compared.
    - `mesh`: a mesh template for each count, `{"data": "*", "model": 4}` (`"*"`: the
        rest of the devices), instead of the spec's own mesh.
    - `batch`: the batch's layout, an expression for every batch leaf; by default the
        spec file's `"batch"`, else data parallel.
    - `rtol`, `atol`: the tolerance for every leaf; by default per dtype, from
        `eqshard.testing.TOLERANCES`. Integer leaves must be equal.
    - `max_communication`: bytes per collective kind (`COLLECTIVE_KINDS`) that the
        compiled step may move on each device.
    - `timeout`: seconds per device count.
    - `devices`, `batch_spec`: deprecated spellings of `device_counts` and `batch`.

    **Raises:**

    - `AssertionError`: names each leaf that differs (with the smallest tolerances that
        pass), or each collective kind over its budget.
    - `eqshard.UsageError`: a deprecated spelling given with its new one, or no
        `make_batch`.
    - `eqshard.EqshardError`: arguments that cannot cross into the worker processes, a
        `loss` of the wrong shape for what `build` returns, or the user's code failing
        there.

    The guide "Testing specs" says more: what runs, the spec, stateful models,
    communication budgets and the failures.
    """
    make_batch, batch = batch_arguments(make_batch, batch, batch_spec)
    template = mesh_template(mesh)
    counts = device_counts_of(device_counts, spec, template, devices)
    request: dict[str, Any] = {
        "task": "equivalence",
        "build": callable_reference(build, "build"),
        "loss": callable_reference(loss, "loss"),
        "batch": callable_reference(make_batch, "make_batch"),
        "optimizer": None if optimizer is None else callable_reference(optimizer, "optimizer"),
        "spec": spec_reference(spec),
        "mesh": template,
        "batch_spec": None if batch is None else str(batch),
        "rtol": rtol,
        "atol": atol,
        "max_communication": _budget(max_communication),
    }
    results = run_per_count(request, counts, "testing equivalence", timeout)
    text = failure_text(results, rtol, atol)
    if text:
        raise AssertionError(text)


def _is_builder(batch: object) -> bool:
    """Whether `batch=` names the batch's builder, the old meaning: a callable, or
    `"module:callable"` (text with a colon and no arrow, which no expression is)."""
    if callable(batch):
        return True
    return isinstance(batch, str) and ":" in batch and "->" not in batch


def batch_arguments(
    make_batch: Callable[[], Any] | str | None, batch: Any, batch_spec: str | None
) -> tuple[Callable[[], Any] | str, str | Expression | None]:
    """`make_batch` and the batch's layout, from the arguments as given: a builder
    passed as `batch=` and `batch_spec=` are the deprecated spellings.

    **Raises:** `UsageError` for a spelling given with its new one, or no builder.
    """
    if batch is not None and _is_builder(batch):
        if make_batch is not None:
            raise UsageError(
                "`make_batch` and a builder as `batch=` are both given; pass the builder as "
                "`make_batch` alone (`batch=` is the batch's layout)"
            )
        deprecated(
            "passing the batch's builder as `batch=` is deprecated: pass it as `make_batch=` "
            "(`batch=` is the batch's layout, such as 'b ... -> b* ...')"
        )
        make_batch, batch = batch, None
    if batch_spec is not None:
        if batch is not None:
            raise UsageError(
                "`batch=` and `batch_spec=` are both given; pass the layout as `batch=` alone"
            )
        deprecated("`batch_spec=` is deprecated: pass the batch's layout as `batch=`")
        batch = batch_spec
    if make_batch is None:
        raise UsageError(
            "`assert_equivalent` needs `make_batch`, the callable (or 'module:callable') "
            "that returns a batch"
        )
    return make_batch, batch


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
