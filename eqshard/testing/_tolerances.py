"""The tolerances of `assert_equivalent`: the defaults per dtype, and the smallest
that pass what a comparison found (no JAX: NumPy, imported when needed)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["TOLERANCES", "Needed", "smallest_passing"]

# (rtol, atol), compared as numpy.isclose does: |sharded - unsharded| <= atol +
# rtol * |unsharded|. A sharded step sums in another order than an unsharded one
# (partial sums per device, then an all-reduce), so its results differ in the last
# bits: a few units in the last place of each sum, which grow with its length. The
# defaults allow about 100 units in the last place (float32: 1e-5 relative), and an
# absolute floor for values that cancel to near zero. Integer and boolean leaves
# must be equal.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-12),
    "float32": (1e-5, 1e-6),
    "float16": (2e-3, 1e-4),
    "bfloat16": (1.6e-2, 1e-3),
    "complex128": (1e-10, 1e-12),
    "complex64": (1e-5, 1e-6),
}


@dataclasses.dataclass
class Needed:
    """The smallest tolerances that the leaves compared pass with: `rtol` with each
    leaf's `atol` as given, and `atol` with each leaf's `rtol` as given, rounded up
    to three significant digits. `no_rtol` says why no `rtol` passes them (and
    `no_tolerance` why no tolerance at all does)."""

    rtol: float = 0.0
    atol: float = 0.0
    no_rtol: str | None = None
    no_tolerance: str | None = None

    def include(self, other: Needed | Mapping[str, Any]) -> None:
        """Widens these to pass what `other` (or its `dataclasses.asdict`) passes too."""
        if isinstance(other, Mapping):
            other = Needed(**other)
        self.rtol = max(self.rtol, other.rtol)
        self.atol = max(self.atol, other.atol)
        self.no_rtol = self.no_rtol or other.no_rtol
        self.no_tolerance = self.no_tolerance or other.no_tolerance


def smallest_passing(got: Any, want: Any, rtol: float, atol: float) -> Needed:
    """The smallest tolerances with which `numpy.isclose(got, want, rtol, atol,
    equal_nan=True)` holds for every element: the smallest `rtol` with `atol` as
    given, and the smallest `atol` with `rtol` as given.

    **Arguments:**

    - `got`, `want`: NumPy arrays of one shape, float64 or complex128.
    - `rtol`, `atol`: the tolerances the comparison used.

    **Returns:**

    A `Needed`, each tolerance rounded up to three significant digits (so that the
    value printed passes), and checked with `numpy.isclose`.
    """
    import numpy as np

    got_nan, want_nan = np.isnan(got), np.isnan(want)
    if (got_nan != want_nan).any():
        return Needed(no_tolerance="a NaN in one run only")
    finite = np.isfinite(got) & np.isfinite(want)
    infinite = ~finite & ~(got_nan & want_nan)
    if (got[infinite] != want[infinite]).any():  # isclose: equal infinities only
        return Needed(no_tolerance="an infinity in one run only")
    g, w = got[finite], want[finite]
    difference, size = np.abs(g - w), np.abs(w)
    if not difference.size:
        return Needed()
    needed = Needed()
    over = difference > atol
    if over.any():
        if (size[over] == 0).any():
            needed.no_rtol = "an unsharded value is 0"
        else:
            with np.errstate(over="ignore"):
                least = float(np.max((difference[over] - atol) / size[over]))
            if math.isfinite(least):
                needed.rtol = _rounded_up(least, lambda r: np.isclose(g, w, r, atol).all())
            else:
                needed.no_rtol = "an unsharded value is too close to 0"
    least = float(np.max(difference - rtol * size))
    needed.atol = _rounded_up(max(least, 0.0), lambda a: np.isclose(g, w, rtol, a).all())
    return needed


def _rounded_up(least: float, passes: Callable[[float], Any]) -> float:
    """The smallest number of three significant digits that is at least `least` and
    `passes` (rounding error may need one more unit in the last digit)."""
    if least <= 0.0:
        return 0.0
    exponent = math.floor(math.log10(least)) - 2
    digits = math.ceil(least / 10.0**exponent)
    value = float(f"{digits}e{exponent}")
    for _ in range(1000):
        if value >= least and passes(value):
            break
        digits += 1
        value = float(f"{digits}e{exponent}")
    return value
