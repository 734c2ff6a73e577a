"""`assert_layouts`: every leaf's layout, per device count, against a golden file."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import EqshardError
from .._specfile._write import write_atomically
from ._plugin import update_requested
from ._processes import (
    TIMEOUT_SECONDS,
    device_counts as device_counts_of,
    mesh_template,
    run_in_one_process,
)
from ._references import callable_reference, spec_reference

if TYPE_CHECKING:  # JAX only for the type: the harness starts none
    from .._plan import Spec

__all__ = ["GOLDEN_VERSION", "assert_layouts"]

GOLDEN_VERSION = 2
"""The version written. Version 1 files are still read: they record no memory kind
and no optimizer state's layout, so a spec that now has one fails against them,
with the fix (`_unrecorded`)."""
_READ = (1, GOLDEN_VERSION)
_FIELDS = (
    "expression",
    "partition_spec",
    "shape",
    "dtype",
    "bytes_per_device",
    "memory",
    "origin",
)
"""What a golden file records of each leaf: `memory` only where it is not the
device's (`"pinned_host"`), `origin` only where FSDP replicated it; and
`"optimizer"`, the optimizer state's layout, only where it is not the leaf's own."""
_OPTIMIZER_FIELDS = ("expression", "partition_spec", "bytes_per_device", "memory", "origin")
"""What a golden file records of a leaf's optimizer state, where the spec's optimizer
section lays it out otherwise than the leaf (its shape and dtype are the leaf's)."""
_SHOWN = 20  # changed leaves shown per device count


def assert_layouts(
    build: Callable[[], Any] | str,
    spec: Spec,
    *,
    golden: str | Path,
    device_counts: int | Sequence[int] | None = None,
    mesh: Mapping[str, int | str] | None = None,
    timeout: float = TIMEOUT_SECONDS,
    devices: int | Sequence[int] | None = None,
) -> None:
    """Asserts that every leaf's layout, on each device count, is the one a golden file
    in the user's repository records.

    **Example:**

    ```python
    from pathlib import Path
    from eqshard.testing import assert_layouts

    def test_spec_layouts():
        assert_layouts(mypkg.model.build, Path("specs/model.eqshard.json"),
                       golden="tests/golden/model.json", device_counts=(8, 64))
    ```

    **Arguments:**

    - `build`: `build()` returns the model, or a stateful model and its state
        (`eqx.nn.make_with_state(Net)(key)`), importable by name (as for
        `assert_equivalent`).
    - `spec`: as for `assert_equivalent`.
    - `golden`: the golden file (JSON) (see the guide).
    - `device_counts`: the device counts, each laid out abstractly (so a count may be
        65,536); by default as for `assert_equivalent`.
    - `mesh`, `timeout`: as for `assert_equivalent`.
    - `devices`: the deprecated spelling of `device_counts`.

    **Raises:**

    - `AssertionError`: a leaf's layout changed, a leaf was added or is gone, or the
        golden file is missing or too old (see "Failures").
    - `eqshard.EqshardError`: the golden file is not one, or an argument is bad.

    !!! info "Failures"

        The `AssertionError` lists, for each count, the leaves whose layout changed:
        each field, golden -> now. A weight may have moved into or out of host memory,
        or an optimizer state may be split where it followed its parameter. It lists the
        leaves added and the leaves gone. It may instead say that the golden file is
        missing. Or it says that the file was written before golden files recorded
        memory kinds and optimizer states (version 1), while the spec now has them.

    The guide "Testing specs" says more: updating, what a golden file records and the
    failures.
    """
    template = mesh_template(mesh)
    counts = device_counts_of(device_counts, spec, template, devices)
    request = {
        "task": "layouts",
        "build": callable_reference(build, "build"),
        "spec": spec_reference(spec),
        "mesh": template,
    }
    results = run_in_one_process(request, counts, "laying out", timeout)
    now = {str(n): results[n] for n in dict.fromkeys(counts)}
    path = Path(golden)
    if update_requested():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, _golden_text(now).encode("ascii"))
        return
    if not path.exists():
        raise AssertionError(
            f"{path}: no golden layouts yet; run `pytest --eqshard-update` (or set "
            "EQSHARD_UPDATE=1) to write them, and commit the file"
        )
    version, recorded = _read(path)
    unrecorded = _unrecorded(now) if version < 2 else []
    if unrecorded:  # compare what the file records; the rest it cannot tell
        now = {count: _without_new_fields(layout) for count, layout in now.items()}
    lines = []
    for count, layouts in now.items():
        lines += _changes(count, recorded.get(count), layouts)
    for count in recorded.keys() - now.keys():
        lines.append(f"{count} devices: in the golden file, no longer tested")
    if unrecorded:
        also = ["and layouts differ from it (golden -> now):", *lines] if lines else []
        raise AssertionError(
            f"{path} is a golden file of version {version}, which records neither memory "
            "kinds nor optimizer states' layouts, and the spec now has them, so the file "
            "cannot tell whether they changed; if these layouts are intended, run "
            "`pytest --eqshard-update` (or set EQSHARD_UPDATE=1) to record them, and commit "
            "the file:\n" + "\n".join([*unrecorded, *also])
        )
    if lines:
        raise AssertionError(
            f"layouts differ from {path} (golden -> now); if the change is intended, run "
            "`pytest --eqshard-update` and commit the file:\n" + "\n".join(lines)
        )


def _golden_text(layouts: Mapping[str, Any]) -> str:
    """The golden file: JSON with one line per leaf, so that its diff in review
    shows each leaf that changed."""
    counts = []
    for count, layout in layouts.items():
        leaves = ",\n".join(
            f"    {json.dumps(name)}: {json.dumps(leaf)}" for name, leaf in layout["leaves"].items()
        )
        counts.append(
            f'  {json.dumps(count)}: {{\n   "mesh": {json.dumps(layout["mesh"])},\n'
            f'   "leaves": {{\n{leaves}\n   }}\n  }}'
        )
    body = ",\n".join(counts)
    return f'{{\n "eqshard_golden": {GOLDEN_VERSION},\n "layouts": {{\n{body}\n }}\n}}\n'


def _read(path: Path) -> tuple[int, dict[str, Any]]:
    """The golden file's version and its layouts, per count."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise EqshardError(f"{path}: cannot read the golden layouts: {error}") from None
    version = document.get("eqshard_golden") if isinstance(document, dict) else None
    if not (
        isinstance(document, dict)
        and version in _READ
        and not isinstance(version, bool)
        and isinstance(document.get("layouts"), dict)
    ):
        raise EqshardError(
            f"{path}: not an eqshard golden file (version {' or '.join(map(str, _READ))}); "
            "rewrite it with `pytest --eqshard-update`"
        )
    return version, document["layouts"]


def _unrecorded(now: Mapping[str, Any]) -> list[str]:
    """What a version 1 golden file cannot record of the layouts `now`: each leaf in
    host memory, and each optimizer state laid out otherwise than its leaf, per count."""
    lines = []
    for count, layout in now.items():
        found = []
        for name, leaf in layout["leaves"].items():
            if "memory" in leaf:
                found.append(f"  {name}: in host memory ({leaf['memory']!r})")
            state = leaf.get("optimizer")
            if state is not None:
                where = f", in host memory ({state['memory']!r})" if "memory" in state else ""
                found.append(
                    f"  {name}: its optimizer state {state['partition_spec']} "
                    f"({state['expression']!r}{where}), not the leaf's {leaf['partition_spec']}"
                )
        if found:
            lines.append(f"on {count} devices, mesh {layout['mesh']}:")
            lines += found[:_SHOWN]
            if len(found) > _SHOWN:
                lines.append(f"  ... and {len(found) - _SHOWN} more")
    return lines


def _without_new_fields(layout: Mapping[str, Any]) -> dict[str, Any]:
    """One count's layouts without what a version 1 golden file does not record."""
    leaves = {
        name: {key: value for key, value in leaf.items() if key not in ("memory", "optimizer")}
        for name, leaf in layout["leaves"].items()
    }
    return {**layout, "leaves": leaves}


def _changes(count: str, was: Any, now: Mapping[str, Any]) -> list[str]:
    if not isinstance(was, dict):
        return [f"{count} devices: not in the golden file"]
    lines = []
    if was.get("mesh") != now["mesh"]:
        lines.append(f"  mesh: {was.get('mesh')} -> {now['mesh']}")
    before, after = was.get("leaves", {}), now["leaves"]
    changed = []
    for name, layout in after.items():
        if name not in before:
            changed.append(f"  + {name}: {layout['expression']!r} (not in the golden file)")
            continue
        fields = [
            f"      {field}: {_shown(field, before[name].get(field))} -> "
            f"{_shown(field, layout.get(field))}"
            for field in _FIELDS
            if before[name].get(field) != layout.get(field)
        ]
        fields += _optimizer_changes(before[name], layout)
        if fields:
            changed.append(f"  ~ {name}\n" + "\n".join(fields))
    changed += [f"  - {name} (no longer in the model)" for name in before if name not in after]
    lines += changed[:_SHOWN]
    if len(changed) > _SHOWN:
        lines.append(f"  ... and {len(changed) - _SHOWN} more leaves")
    if not lines:
        return []
    return [f"on {count} devices, mesh {now['mesh']}:", *lines]


def _shown(field: str, value: Any) -> str:
    """A recorded value, as a change shows it: no memory kind is the device's."""
    return repr("device" if field == "memory" and value is None else value)


def _optimizer_changes(was: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """How a leaf's optimizer state's layout changed, field by field. Where a side
    records none, the state follows its leaf: its fields are the leaf's on that side
    (shown so: data parallel to ZeRO-1 reads `'P()' (the parameter's) -> "P('data')"`)."""
    before, after = was.get("optimizer"), now.get("optimizer")
    if before == after:
        return []
    lines = []
    for field in _OPTIMIZER_FIELDS:
        old, new = _state_field(was, before, field), _state_field(now, after, field)
        if old != new:
            lines.append(
                f"      optimizer {field}: {_shown(field, old)}{_follows(before)} -> "
                f"{_shown(field, new)}{_follows(after)}"
            )
    return lines


def _state_field(leaf: Mapping[str, Any], state: Mapping[str, Any] | None, field: str) -> Any:
    """A field of the leaf's optimizer state: its own, else the leaf's (no origin:
    the state's layout says nothing of why its parameter has it)."""
    if state is not None:
        return state.get(field)
    return None if field == "origin" else leaf.get(field)


def _follows(state: Mapping[str, Any] | None) -> str:
    return " (the parameter's)" if state is None else ""
