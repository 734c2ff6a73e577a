"""`assert_equivalent`: the sharded step computes what the unsharded one does."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._errors import EqshardError, whole_number
from ._processes import TIMEOUT_SECONDS, device_counts, mesh_template, run_per_count
from ._references import callable_reference, spec_reference

__all__ = ["COLLECTIVE_KINDS", "assert_equivalent"]

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)
_SHOWN = 10  # differing leaves shown per device count


def assert_equivalent(
    build: Callable[[], Any] | str,
    spec: Any,
    loss: Callable[[Any, Any], Any] | str,
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
    """Asserts that the sharded model computes what the unsharded one does: the
    loss, the gradients and one optimizer step, on each device count.

    **Example:**

    ```python
    from eqshard.testing import assert_equivalent

    def test_spec_is_equivalent():
        assert_equivalent(mypkg.model.build, "specs/model.eqshard.json",
                          mypkg.model.loss, mypkg.model.batch,
                          devices=(1, 2, 8), optimizer=mypkg.model.optimizer)
    ```

    Each device count runs in a fresh Python process with that many simulated CPU
    devices. It builds the model and the batch, runs one jitted step (loss and
    gradients with `eqx.filter_value_and_grad`, then the optimizer's update) on one
    device, then the same step with the model and its optimizer state placed by the
    spec and the batch split over the data axis, and compares every leaf.

    **Arguments:**

    - `build`: `build()` returns the model.
    - `spec`: anything `eqshard.apply` takes that can cross into another process: a
        spec file's path (its declared mesh is used), `Rules`, an expression,
        `eqshard.FROM_FIELDS`.
    - `loss`: `loss(model, batch)` returns a scalar.
    - `batch`: `batch()` returns a batch.
    - `devices`: the device counts. By default the spec's own: its file's
        `"devices"`, else counts its mesh fits, else 1, 2 and 8.
    - `optimizer`: `optimizer()` returns an optax optimizer; without one, the loss
        and gradients are compared.
    - `mesh`: a mesh template for each count, `{"data": "*", "model": 4}` (`"*"`:
        the rest of the devices), instead of the spec's own mesh.
    - `batch_spec`: the expression of every batch leaf. By default data parallel:
        the leading dim split over the mesh's first axis (else over every device);
        `"... -> * ..."` replicates the batch.
    - `rtol`, `atol`: the tolerance for every leaf; by default per dtype, from
        `eqshard.testing.TOLERANCES` (float32: 1e-5 and 1e-6). Integer leaves must be
        equal.
    - `max_communication`: bytes per collective kind (`"all-gather"`,
        `"all-reduce"`, `"reduce-scatter"`, `"collective-permute"`, `"all-to-all"`)
        that the compiled step may move on each device, summed over the step, from
        `eqshard.cost`. `{"all-gather": 0}` asserts that no parameter is gathered.
        A collective in a loop counts once per trip where XLA knows the trip count
        (`jax.lax.scan`), else once; every branch of a `cond` counts.
    - `build`, `loss`, `batch` and `optimizer` are imported again in each process:
        pass them as top-level functions of an importable module (or as
        `"mypkg.model:build"`, `"path/to/file.py:build"`).
    - `timeout`: seconds per device count.

    **Raises:**

    `AssertionError` naming each leaf that differs, its device count, and the
    largest difference; or each collective kind over its budget, with its largest
    operations. `eqshard.EqshardError` for arguments that cannot cross into the
    worker processes, and when the user's code fails there, saying what raised.
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
    lines = []
    for n in dict.fromkeys(counts):
        lines += _differences(n, results[n]["differences"])
        lines += _over_budget(n, results[n]["over_budget"])
    if lines:
        raise AssertionError("\n".join(lines))


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
    lines = [f"on {n} devices, {len(found)} leaves differ from the unsharded run:"]
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
            f"atol {d['atol']:g})"
        )
    if len(found) > _SHOWN:
        lines.append(f"  ... and {len(found) - _SHOWN} more")
    return lines


def _over_budget(n: int, over: list[dict[str, Any]]) -> list[str]:
    lines = []
    for o in over:
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
