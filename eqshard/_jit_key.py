"""What eqshard sets up in JAX as soon as both are imported: the JAX user context
that keys `jit`'s cache by what `eqshard.use` made active, and eqshard's frames
hidden from JAX's filtered tracebacks (`_compat.hide_eqshard_frames`).

JAX counts every user context among the values of a trace's context, so one made
after a step was first traced changes that count, and the step's second call
misses the cache and traces again (a second compile of a training step). It is
therefore made as soon as eqshard and JAX are both imported: by `eqshard/__init__.py`
where JAX was imported first, else by `_sharding.py`, which every module that
places or lays out arrays imports; never while a step is being traced.
"""

from __future__ import annotations

from typing import Any

import jax

from ._compat import hide_eqshard_frames

__all__ = ["JIT_KEY"]

hide_eqshard_frames()

_make_user_context = getattr(jax, "make_user_context", None)

JIT_KEY: Any = None if _make_user_context is None else _make_user_context(None)
"""The active rules or plan as part of `jit`'s cache key (JAX's `make_user_context`,
made once: making one is not thread-safe, using it is); `None` on a JAX without it."""
