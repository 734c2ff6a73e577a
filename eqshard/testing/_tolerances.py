"""The default tolerances of `assert_equivalent`, per dtype."""

from __future__ import annotations

__all__ = ["TOLERANCES"]

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
