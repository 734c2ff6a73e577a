"""The names of `eqshard suggest`'s strategies, without JAX: the command line's help
lists them (`eqshard suggest --help`), and `_families.py` names its table's rows by
them, so that a row without its name here fails at import, and a name here without
its row too."""

from __future__ import annotations

__all__ = ["STRATEGY_NAMES"]

STRATEGY_NAMES = (
    "data parallel",
    "fsdp",
    "zero-1",
    "expert parallel",
    "megatron",
    "data x tensor",
    "fsdp x tensor",
    "data x expert",
    "context parallel",
    "fsdp x context",
    "pipeline x data",
)
"""Every family of `_families.FAMILIES`, in its order."""
