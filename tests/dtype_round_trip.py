"""Every dtype JAX holds, saved by `eqx.tree_serialise_leaves` and read back by
`eqshard.restore` into shards, compared bit for bit device by device.

Imported by `test_checkpoint.py` (32-bit types), and run there as a script in a
process of its own with `jax_enable_x64` (`dtype_round_trip.py DIR`), which also
writes 64-bit leaves to `DIR/wide.eqx` for the 32-bit test process to refuse.
"""

import json
import sys
import warnings
from pathlib import Path

SHAPE = (8, 16)
LAYOUT = "a b -> a2 b4"


def held_dtypes():
    """Every dtype `jax.numpy` names that JAX holds as it is in this process, once
    each (64-bit types only under `jax_enable_x64`; float6 types, which XLA:CPU
    cannot hold, left out)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    found = {}
    for name in dir(jnp):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                dtype = np.dtype(getattr(jnp, name))
                held = jax.device_put(np.zeros(2, dtype)).dtype
        except Exception:
            continue
        if dtype.kind not in "OSUM" and held == dtype:
            found[dtype.name] = dtype
    return [found[name] for name in sorted(found)]


def values(dtype, rng):
    """A NumPy array of `SHAPE` and `dtype` with varied bit patterns: every pattern
    of a float type (NaNs and infinities included), any value of an integer type."""
    import jax.numpy as jnp
    import numpy as np

    if dtype == np.bool_:
        return rng.integers(0, 2, SHAPE).astype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        drawn = np.uint64 if info.min == 0 else np.int64
        return rng.integers(info.min, info.max, SHAPE, drawn, endpoint=True).astype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        part = np.dtype(f"u{dtype.itemsize // 2}")
        bits = rng.integers(0, np.iinfo(part).max, (SHAPE[0], 2 * SHAPE[1]), dtype=part)
        return bits.view(dtype)
    width = jnp.finfo(dtype).bits  # float4_e2m1fn: 4 bits in a byte
    bits = rng.integers(0, 2**width, SHAPE, dtype=np.dtype(f"u{dtype.itemsize}"))
    return bits.view(dtype)


def round_trip(directory):
    """Saves a tree with a JAX array of every held dtype (and NumPy arrays of
    bfloat16 and float8_e5m2, which NumPy writes as raw bytes and as a code it
    cannot read back), restores it into shards on 8 devices, and checks every shard
    on every device, bit for bit. Returns the dtypes' names."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqshard

    rng = np.random.default_rng(0)
    saved = {dtype.name: jax.device_put(values(dtype, rng)) for dtype in held_dtypes()}
    saved["numpy_bfloat16"] = values(np.dtype(jnp.bfloat16), rng)
    saved["numpy_float8_e5m2"] = values(np.dtype(jnp.float8_e5m2), rng)
    path = Path(directory) / "dtypes.eqx"
    eqx.tree_serialise_leaves(path, saved)
    plan = eqshard.plan(saved, LAYOUT)
    restored = eqshard.restore(path, eqx.filter_eval_shape(lambda: saved), plan)
    for name, array in restored.items():
        expected = np.asarray(saved[name])
        assert array.dtype == expected.dtype, name
        target = plan.shardings[name]
        assert array.sharding.is_equivalent_to(target, 2), name
        where = target.devices_indices_map(SHAPE)
        assert {shard.device for shard in array.addressable_shards} == set(where), name
        for shard in array.addressable_shards:
            assert shard.index == where[shard.device], name
            held = np.asarray(shard.data)
            assert held.shape == (SHAPE[0] // 2, SHAPE[1] // 4), name
            assert held.tobytes() == expected[shard.index].tobytes(), (name, shard.device)
    return sorted(name for name in saved if not name.startswith("numpy_"))


def main():
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", True)
    import equinox as eqx
    import jax.numpy as jnp

    directory = Path(sys.argv[1])
    names = round_trip(directory)
    wide = {"w": jnp.arange(4.0) * 1e300, "step": jnp.arange(4) * 2**40}
    eqx.tree_serialise_leaves(directory / "wide.eqx", wide)
    print(json.dumps(names))


if __name__ == "__main__":
    main()
