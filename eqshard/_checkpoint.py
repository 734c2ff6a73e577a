"""Checkpoints: restoring straight into shards, from Equinox's files; targets for Orbax.

`eqx.tree_deserialise_leaves(path, like=sharded)` returns every leaf whole on one
device. `restore` reads the same file, written by `eqx.tree_serialise_leaves`,
with Equinox's own traversal (a `filter_spec` per leaf), and places each leaf as
the plan says while it reads: one leaf at a time, read in one pass, so the host
holds about one leaf and no device ever holds more of a leaf than its shard
(`jax.make_array_from_callback`). Orbax restores into `abstract(tree, plan)`.
"""

from __future__ import annotations

import ast
import functools
import os
from typing import Any, BinaryIO, NamedTuple, TypeVar, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._derive import derived_plan, unmatched_copies
from ._errors import EqshardError, SpecError
from ._fields import FROM_FIELDS, is_array_like
from ._init import traced_closures
from ._plan import Plan, Spec, Unspecified, placing
from ._sharding import AnyMesh, Devices, placement
from ._values import narrowed

__all__ = ["abstract", "restore"]

M = TypeVar("M", bound=eqx.Module)  # a model keeps its type; any other tree is Any


def abstract(
    tree: PyTree[Any],
    spec: Spec = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    simulate: int | None = None,
    unspecified: Unspecified = "replicate",
) -> PyTree[Any]:
    """`tree` with a `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` at each array
    leaf.

    **Example:**

    ```python
    plan = eqshard.plan(model, rules)
    state = (eqx.filter(model, eqx.is_array), opt_state)
    restored = checkpointer.restore(path, eqshard.abstract(state, plan))   # Orbax
    ```

    **Arguments:**

    - `tree`: a model, an optimizer state, or a whole training state; concrete or
        abstract (`eqx.filter_eval_shape`).
    - `spec`: anything `eqshard.apply` takes. A `Plan` made for the model lays out the
        optimizer state by structure, as `apply(opt_state, plan)` does.
    - `mesh`, `devices`, `simulate`, `unspecified`: as for `eqshard.plan`.
        `simulate=n` lays out on an abstract mesh: give devices for a target to
        restore into.

    **Returns:**

    The same tree, every array leaf abstract and carrying its sharding, every other leaf
    unchanged: what Orbax's `restore` and `jax.jit`'s `out_shardings` take.

    **Raises:**

    - `eqshard.SpecError`: lists every leaf that cannot be laid out.
    - `eqshard.UsageError`: both `devices` and `simulate` are given.
    """
    placed = placement(devices, simulate, what="`eqshard.abstract`", was_simulated=True)
    planned = derived_plan(tree, spec, mesh=mesh, devices=placed, unspecified=unspecified)
    if planned.problems:
        raise SpecError(planned.problems)
    return planned.plan.abstract


class _Header(NamedTuple):
    """What a `.npy` header says: the shape, the order, and the dtype as written
    (`descr`), with the dtype NumPy reads it as (`None` where it cannot)."""

    shape: tuple[int, ...]
    fortran: bool
    descr: Any
    dtype: np.dtype | None


def _exactly(file: BinaryIO, count: int) -> bytes:
    data = file.read(count)
    if len(data) != count:
        raise EOFError("the file ends inside an array's header")
    return data


def _header(file: BinaryIO, where: str) -> _Header:
    """The next array's header. Read by hand, not by `np.lib.format`: NumPy cannot
    read back every header it writes (`jnp.save` writes float8_e5m2 as `'<f1'`)."""
    try:
        major, _ = np.lib.format.read_magic(file)
        length = int.from_bytes(_exactly(file, 2 if major == 1 else 4), "little")
        text = _exactly(file, length).decode("latin1" if major < 3 else "utf-8")
        header = ast.literal_eval(text)
        shape, fortran, descr = header["shape"], header["fortran_order"], header["descr"]
        if not (
            isinstance(shape, tuple)
            and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(fortran, bool)
        ):
            raise ValueError(f"the header {text.strip()!r} is not one NumPy writes")
    except (ValueError, EOFError, OSError, SyntaxError, TypeError, KeyError) as error:
        raise EqshardError(
            f"{where}: the file has no array here ({type(error).__name__}: {error}); it holds "
            "fewer leaves than `like`, or was not written by `eqx.tree_serialise_leaves` "
            "from a tree like it"
        ) from error
    try:
        dtype = np.lib.format.descr_to_dtype(descr)
    except (TypeError, ValueError):
        dtype = None
    return _Header(shape, fortran, descr, dtype)


def _dtype_on_disk(header: _Header, want: np.dtype) -> np.dtype | None:
    """The dtype of the array, read as `want` where the file holds `want`: NumPy
    writes the types of ml_dtypes (bfloat16, the float8 types, int4...) as raw bytes
    (`'<V2'`), or as a code it cannot read (`'<f1'`), which only `like` can name."""
    if header.dtype == want or header.descr == np.lib.format.dtype_to_descr(want):
        return want
    return header.dtype


def _host(file: BinaryIO, shape: tuple[int, ...], dtype: np.dtype, fortran: bool) -> np.ndarray:
    """The leaf's data, read in one pass into a buffer of its own: the disk's fastest
    path, and the host holds one leaf at a time."""
    data = np.empty(shape, dtype, order="F" if fortran else "C")
    # its bytes, as unsigned bytes: Python's buffers cannot describe ml_dtypes' types
    view = memoryview(data.reshape(-1, order="A").view(np.uint8))  # pyright: ignore[reportArgumentType]
    read = 0
    while read < len(view):
        count = file.readinto(view[read:])  # type: ignore[attr-defined]
        if not count:
            raise EOFError("the file ends inside this array")
        read += count
    return data


def _read(file: BinaryIO, like: Any, *, sharding: Any, where: str) -> Any:
    """One leaf: its header checked against `like`, then placed in shards."""
    header = _header(file, where)
    shape = header.shape
    want = np.dtype(like.dtype)
    dtype = _dtype_on_disk(header, want)
    wide = None if dtype is None or dtype.kind not in "biufc" else narrowed(dtype)
    if wide is not None:
        raise EqshardError(f"{where}: the file holds {dtype}{list(shape)} here, and {wide}")
    if shape != tuple(like.shape) or dtype != want:
        held = header.descr if dtype is None or dtype.kind == "V" else dtype
        raise EqshardError(
            f"{where}: the file holds {held}{list(shape)} here, and `like` has "
            f"{want}{list(like.shape)}; restore with the `like` it was saved from"
        )
    try:
        data = _host(file, shape, want, header.fortran)
    except EOFError as error:
        raise EqshardError(f"{where}: {error}; the file is cut short") from error
    except (OSError, ValueError, TypeError, MemoryError) as error:
        raise EqshardError(
            f"{where}: cannot read its {want}{list(shape)} data: {type(error).__name__}: {error}"
        ) from error
    try:
        if sharding is None:
            return jnp.asarray(np.array(data))
        if sharding.is_fully_addressable:
            # `data` is this leaf's own buffer, which nothing else can write: JAX's host
            # path splits it into the shards in one pass, and no device gets the rest.
            return jax.device_put(data, sharding)
        return jax.make_array_from_callback(shape, sharding, lambda index: data[index])
    except (TypeError, ValueError, RuntimeError) as error:
        raise EqshardError(
            f"{where}: JAX cannot place its {want}{list(shape)} data: "
            f"{type(error).__name__}: {error}"
        ) from error


def _other(file: BinaryIO, like: Any, *, where: str) -> Any:
    """A leaf `restore` does not place (a Python number, a NumPy scalar, a function),
    read as Equinox reads it, and named when it cannot be."""
    try:
        return eqx.default_deserialise_filter_spec(file, like)
    except Exception as error:
        raise EqshardError(
            f"{where}: cannot read the saved {type(like).__name__}: {type(error).__name__}: {error}"
        ) from error


@overload
def restore(
    path: str | os.PathLike[str],
    like: M,
    spec: Spec = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    unspecified: Unspecified = "replicate",
) -> M: ...


@overload
def restore(
    path: str | os.PathLike[str],
    like: Any,
    spec: Spec = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    unspecified: Unspecified = "replicate",
) -> Any: ...


def restore(
    path: str | os.PathLike[str],
    like: Any,
    spec: Spec = FROM_FIELDS,
    *,
    mesh: AnyMesh | None = None,
    devices: Devices = None,
    unspecified: Unspecified = "replicate",
) -> Any:
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
    - `like`: a tree of the saved structure (the model, or the whole training state),
        concrete or abstract (from `eqx.filter_eval_shape`, say).
    - `spec`: anything `eqshard.apply` takes (see "The optimizer state").
    - `mesh`, `devices`: as for `eqshard.apply`: the layout to restore into, on any
        device count, whatever the count it was saved from.
    - `unspecified`: as for `eqshard.plan`.

    **Returns:**

    `like`'s structure with every saved leaf restored (see "What comes back").

    **Raises:**

    - `eqshard.SpecError`: the spec does not lay out `like`.
    - `eqshard.EqshardError`: the file does not match `like`, or cannot be read, or
        `like` cannot be restored into (see "Errors").

    !!! info "The optimizer state"

        With a `Plan` made for the model, the optimizer state in `like` gets its
        parameters' layouts, or its optimizer section's. That is what
        `eqshard.apply(opt_state, plan)` gives them, in their memory kinds.

    !!! info "What comes back"

        Array leaves are placed in their shardings, bit for bit as saved, whatever their
        dtype: bfloat16, the float8 types, int4, bool, complex. NumPy writes some of
        these as raw bytes, which `like` names. Each device is given only its shard, and
        the host holds about one leaf at a time. Python scalars come back as saved,
        other leaves as in `like`.

    !!! info "Errors"

        `eqshard.EqshardError` names the leaf at fault. It is raised when:

        - the file does not match `like` (shape, dtype, or count of leaves);
        - `like` holds a closure over a traced array (from `eqx.filter_eval_shape`:
            restore into a concrete `like`);
        - `like` holds a 64-bit array and JAX runs with 32-bit types;
        - a leaf cannot be read (with the cause);
        - `like` holds typed PRNG keys, which Equinox cannot serialise;
        - the mesh is a `jax.sharding.AbstractMesh`.

    !!! note "Across hosts"

        Equinox's format is written from fully addressable arrays, so it is saved by one
        process. Across hosts, save and restore with Orbax into `eqshard.abstract`.
    """
    planned = derived_plan(
        like,
        spec,
        mesh=mesh,
        devices=placement(devices, what="`eqshard.restore`"),
        unspecified=unspecified,
    )
    # never a silent copy where the plan splits: a copy of another model is refused
    unmatched = unmatched_copies(like, spec) if isinstance(spec, Plan) else []
    if planned.problems or unmatched:
        raise SpecError(planned.problems + unmatched)
    p = placing(planned.plan, "`eqshard.restore`")
    dead = traced_closures(like)
    if dead:
        raise EqshardError(
            f"{', '.join(dict.fromkeys(dead))}: `like` holds a closure over an array that "
            "`eqx.filter_eval_shape` traced (a tracer, dead outside it), and the file does not "
            "hold that array; restore into a concrete `like` (`eqshard.init(factory, plan)` "
            "builds one in its shards), or keep the array in a field of the module"
        )
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
            specs.append(functools.partial(_other, where=resolved.where(i)))
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
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from cause.__cause__
        raise EqshardError(f"{name}: cannot read a saved leaf: {error}") from error
    return restored
