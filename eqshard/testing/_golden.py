"""`assert_layouts`: every leaf's layout, per device count, against a golden file."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import EqshardError
from .._specfile import write_atomically
from ._plugin import update_requested
from ._processes import TIMEOUT_SECONDS, device_counts, mesh_template, run_in_one_process
from ._references import callable_reference, spec_reference

if TYPE_CHECKING:  # JAX only for the type: the harness starts none
    from .._plan import Spec

__all__ = ["GOLDEN_VERSION", "assert_layouts"]

GOLDEN_VERSION = 1
_FIELDS = ("expression", "partition_spec", "shape", "dtype", "bytes_per_device", "origin")
"""What a golden file records of each leaf; `origin` only where FSDP replicated it."""
_SHOWN = 20  # changed leaves shown per device count


def assert_layouts(
    build: Callable[[], Any] | str,
    spec: Spec,
    *,
    golden: str | Path,
    devices: Sequence[int] | None = None,
    mesh: Mapping[str, int | str] | None = None,
    timeout: float = TIMEOUT_SECONDS,
) -> None:
    """Asserts that every leaf's layout, on each device count, is the one a golden
    file in the user's repository records.

    **Example:**

    ```python
    from eqshard.testing import assert_layouts

    def test_spec_layouts():
        assert_layouts(mypkg.model.build, "specs/model.eqshard.json",
                       golden="tests/golden/model.json", devices=(8, 64))
    ```

    `pytest --eqshard-update` (or `EQSHARD_UPDATE=1`) writes the file instead of
    comparing: run it once to create it, and again when a change is intended; the
    file's diff then shows what changed. The model is only built abstractly, once,
    in a fresh process, and laid out on each count without devices (an abstract
    mesh), so a count may be 65,536.

    **Arguments:**

    - `build`: `build()` returns the model, or a stateful model and its state
        (`eqx.nn.make_with_state(Net)(key)`), importable by name (as for
        `assert_equivalent`). A state's leaves are recorded under the names of
        their layers (`bn.batch_state_index.0`).
    - `spec`: as for `assert_equivalent`.
    - `golden`: the golden file (JSON): for each count, the mesh, and each leaf's
        expression, `PartitionSpec`, shape, dtype and bytes per device (and, for
        a leaf FSDP replicated, the origin that says why).
    - `devices`, `mesh`, `timeout`: as for `assert_equivalent`.

    **Raises:**

    `AssertionError` listing, for each count, the leaves whose layout changed (each
    field, golden -> now), the leaves added and the leaves gone; or saying that the
    golden file is missing. `eqshard.EqshardError` when the golden file is not one,
    and for bad arguments.
    """
    template = mesh_template(mesh)
    counts = device_counts(devices, spec, template)
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
    recorded = _read(path)
    lines = []
    for count, layouts in now.items():
        lines += _changes(count, recorded.get(count), layouts)
    for count in recorded.keys() - now.keys():
        lines.append(f"{count} devices: in the golden file, no longer tested")
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


def _read(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise EqshardError(f"{path}: cannot read the golden layouts: {error}") from None
    if not (
        isinstance(document, dict)
        and document.get("eqshard_golden") == GOLDEN_VERSION
        and isinstance(document.get("layouts"), dict)
    ):
        raise EqshardError(
            f"{path}: not an eqshard golden file (version {GOLDEN_VERSION}); rewrite it with "
            "`pytest --eqshard-update`"
        )
    return document["layouts"]


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
            f"      {field}: {before[name].get(field)!r} -> {layout.get(field)!r}"
            for field in _FIELDS
            if before[name].get(field) != layout.get(field)
        ]
        if fields:
            changed.append(f"  ~ {name}\n" + "\n".join(fields))
    changed += [f"  - {name} (no longer in the model)" for name in before if name not in after]
    lines += changed[:_SHOWN]
    if len(changed) > _SHOWN:
        lines.append(f"  ... and {len(changed) - _SHOWN} more leaves")
    if not lines:
        return []
    return [f"on {count} devices, mesh {now['mesh']}:", *lines]
