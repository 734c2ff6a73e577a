"""eqshard's pytest plugin, registered by entry point (`pytest11`).

It adds `--eqshard-update`, which makes `eqshard.testing.assert_layouts` rewrite
its golden files instead of comparing. It imports nothing but this module when
pytest loads it, so it starts no JAX backend in anyone's test run; `-p no:eqshard`
turns it off.
"""

from __future__ import annotations

from typing import Any

__all__ = ["pytest_addoption", "pytest_configure", "update_requested"]

_update = False


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("eqshard")
    group.addoption(
        "--eqshard-update",
        action="store_true",
        default=False,
        help="rewrite the golden layout files of eqshard.testing.assert_layouts instead of "
        "comparing with them",
    )


def pytest_configure(config: Any) -> None:
    global _update
    _update = bool(config.getoption("eqshard_update", False))


def pytest_unconfigure(config: Any) -> None:
    global _update
    _update = False


def update_requested() -> bool:
    """Whether this run rewrites golden files: `pytest --eqshard-update`, or the
    environment variable `EQSHARD_UPDATE=1` (outside pytest)."""
    import os

    return _update or os.environ.get("EQSHARD_UPDATE") == "1"
