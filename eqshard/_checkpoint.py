"""Checkpoints: restoring straight into shards, from Equinox's files; targets for Orbax.

`eqx.tree_deserialise_leaves(path, like=sharded)` returns every leaf whole on one
device. `restore` reads the same file, written by `eqx.tree_serialise_leaves`,
with Equinox's own traversal (a `filter_spec` per leaf), and places each leaf as
the plan says while it reads: one leaf at a time, read in one pass, so the host
holds about one leaf and no device ever holds more of a leaf than its shard
(`jax.make_array_from_callback`). Orbax restores into `abstract(tree, plan)`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any, BinaryIO

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._derive import plan_for
from ._errors import EqshardError, SpecError
from ._fields import FROM_FIELDS, is_array_like
from ._sharding import AnyMesh, Device

__all__ = ["abstract", "restore"]


def abstract(
    tree: PyTree[Any],
    spec: Any = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Sequence[Device] | None = None,
) -> PyTree[Any]:
    """`tree` with a `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` at each array leaf.

    **Example:**

    ```python
    plan = eqshard.plan(model, rules)
    state = (eqx.filter(model, eqx.is_array), opt_state)
    restored = checkpointer.restore(path, eqshard.abstract(state, plan))   # Orbax
    ```

    **Arguments:**

    - `tree`: a model, an optimizer state, or a whole training state; concrete or
        abstract (`eqx.filter_eval_shape`).
    - `spec`: anything `eqshard.apply` takes. A `Plan` made for the model lays out
        the optimizer state by structure, as `apply(opt_state, plan)` does.
    - `mesh`, `devices`: as for `eqshard.plan`.

    **Returns:**

    The same tree, every array leaf abstract and carrying its sharding, every other
    leaf unchanged: what Orbax's `restore` and `jax.jit`'s `out_shardings` take.

    **Raises:**

    `eqshard.SpecError` listing every leaf that cannot be laid out.
    """
    planned = plan_for(tree, spec, mesh=mesh, devices=devices)
    if planned.problems:
        raise SpecError(planned.problems)
    return planned.plan.abstract


def _header(file: BinaryIO, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    try:
        version = np.lib.format.read_magic(file)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(file)
        return np.lib.format.read_array_header_2_0(file)
    except (ValueError, EOFError, OSError) as error:
        raise EqshardError(
            f"{where}: the file has no array here ({error}); it holds fewer leaves than "
            "`like`, or was not written by `eqx.tree_serialise_leaves` from a tree like it"
        ) from None


def _host(file: BinaryIO, shape: tuple[int, ...], dtype: np.dtype, fortran: bool) -> np.ndarray:
    """The leaf's data, read in one pass into a buffer of its own: the disk's fastest
    path, and the host holds one leaf at a time."""
    data = np.empty(shape, dtype, order="F" if fortran else "C")
    view = memoryview(data.reshape(-1, order="A")).cast("B")  # pyright: ignore[reportArgumentType]
    read = 0
    while read < len(view):
        count = file.readinto(view[read:])  # type: ignore[attr-defined]
        if not count:
            raise EOFError("the file ends inside this array")
        read += count
    return data


def _read(file: BinaryIO, like: Any, *, sharding: Any, where: str) -> Any:
    """One leaf: its header checked against `like`, then placed in shards."""
    shape, fortran, dtype = _header(file, where)
    want = np.dtype(like.dtype)
    if want == jnp.bfloat16 and dtype == np.dtype("V2"):
        dtype = want  # jnp.save writes bfloat16 as raw 2-byte values
    if tuple(shape) != tuple(like.shape) or dtype != want:
        raise EqshardError(
            f"{where}: the file holds {dtype}{list(shape)} here, and `like` has "
            f"{want}{list(like.shape)}; restore with the `like` it was saved from"
        )
    try:
        data = _host(file, tuple(shape), dtype, fortran)
    except EOFError as error:
        raise EqshardError(f"{where}: {error}; the file is cut short") from None
    if sharding is None:
        return jnp.asarray(np.array(data))
    if sharding.is_fully_addressable:
        # `data` is this leaf's own buffer, which nothing else can write: JAX's host
        # path splits it into the shards in one pass, and no device gets the rest.
        return jax.device_put(data, sharding)
    return jax.make_array_from_callback(tuple(shape), sharding, lambda index: data[index])


def restore(
    path: str | os.PathLike[str],
    like: PyTree[Any],
    spec: Any = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Sequence[Device] | None = None,
) -> PyTree[Any]:
    """Reads a file written by `eqx.tree_serialise_leaves` straight into shards.

    **Example:**

    ```python
    eqx.tree_serialise_leaves("state.eqx", (model, opt_state))        # on 8 devices
    ...
    like = eqx.filter_eval_shape(lambda: (build(), optimizer.init(...)))
    model, opt_state = eqshard.restore("state.eqx", like, plan)       # on any count
    ```

    **Arguments:**

    - `path`: the file.
    - `like`: a tree of the saved structure, concrete or abstract (for example from
        `eqx.filter_eval_shape`): the model, or the whole training state.
    - `spec`: anything `eqshard.apply` takes. With a `Plan` made for the model, the
        optimizer state in `like` gets its parameters' layouts, as
        `eqshard.apply(opt_state, plan)` gives them.
    - `mesh`, `devices`: as for `eqshard.plan`: the layout to restore into, on any
        device count, whatever the count it was saved from.

    **Returns:**

    `like`'s structure with every saved leaf restored: array leaves placed in their
    shardings (each device is given only its shard, and the host holds about one
    leaf at a time), Python scalars as saved, other leaves as in `like`.

    **Raises:**

    `eqshard.SpecError` when the spec does not lay out `like`; `eqshard.EqshardError`
    naming the leaf when the file does not match `like` (shape, dtype, or count of
    leaves), or when `like` holds typed PRNG keys, which Equinox cannot serialise.

    Equinox's format is written from fully addressable arrays, so it is saved by one
    process; across hosts, save and restore with Orbax into `eqshard.abstract`.
    """
    planned = plan_for(like, spec, mesh=mesh, devices=devices)
    if planned.problems:
        raise SpecError(planned.problems)
    p = planned.plan
    resolved = p.resolved
    specs, targets = [], []
    for i, (leaf, sharding) in enumerate(zip(resolved.leaves, p.flat_shardings)):
        if is_array_like(leaf) and not isinstance(leaf, np.generic):
            if jnp.issubdtype(leaf.dtype, jax.dtypes.extended):
                raise EqshardError(
                    f"{resolved.where(i)}: a typed PRNG key ({leaf.dtype}); Equinox cannot "
                    "serialise these. Save `jax.random.key_data(key)` instead and rebuild "
                    "the key with `jax.random.wrap_key_data` after restoring"
                )
            specs.append(functools.partial(_read, sharding=sharding, where=resolved.where(i)))
            targets.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        else:
            specs.append(eqx.default_deserialise_filter_spec)
            targets.append(leaf)
    filter_spec = jax.tree_util.tree_unflatten(resolved.treedef, specs)
    target = jax.tree_util.tree_unflatten(resolved.treedef, targets)
    name = os.fspath(path)
    try:
        with open(name, "rb") as file:
            restored = eqx.tree_deserialise_leaves(file, target, filter_spec=filter_spec)
            if file.read(1):
                raise EqshardError(
                    f"{name}: the file holds more leaves than `like`; restore with the "
                    "`like` it was saved from"
                )
    except OSError as error:
        raise EqshardError(f"cannot read {name}: {error.strerror or error}") from None
    except EqshardError:
        raise
    except Exception as error:  # Equinox wraps what a leaf raised: find it
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, EqshardError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise EqshardError(f"{name}: cannot read a saved leaf: {error}") from None
    return restored
