"""One process of a two-process `jax.distributed` run over loopback.

Run as a script by `test_multiprocess.py`, never imported: `python
multiprocess_worker.py PORT PROCESS_ID [CHECKPOINT_DIR]`. Each process has 4 CPU
devices; the model is placed over all 8 with a spec file, its loss is computed,
and with a directory it is saved with Orbax and restored in another layout.
"""

import json
import sys


def main() -> None:
    port, process_id = sys.argv[1], int(sys.argv[2])
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    import equinox as eqx
    import jax.numpy as jnp
    import numpy as np

    import eqshard

    rules = eqshard.load(
        {
            "eqshard": 1,
            "devices": 8,
            "rules": [
                {"path": "layers.0.weight", "expr": "o i -> o* i"},
                {"path": "layers.0.bias", "expr": "o -> o*"},
                {"path": "layers.1.weight", "expr": "o i -> o i*"},
            ],
        }
    )
    model = eqx.nn.MLP(16, 4, 32, 1, key=jax.random.key(0))  # the same on both processes
    sharded = eqshard.apply(model, rules)
    weight = sharded.layers[0].weight
    reference = np.asarray(model.layers[0].weight)
    local_ok = all(
        np.array_equal(np.asarray(shard.data), reference[shard.index])
        for shard in weight.addressable_shards
    )

    x = jnp.ones((8, 16))

    @eqx.filter_jit
    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    value = loss(sharded, x)
    mesh = eqshard.plan(model, rules).mesh
    assert mesh is not None  # 8 devices: one shared mesh
    expected = float(jnp.mean(jax.vmap(model)(x) ** 2))  # each process, on its own
    orbax = _orbax_round_trip(sys.argv[3], model, sharded) if len(sys.argv) > 3 else {}
    print(
        json.dumps(
            {
                "process": jax.process_index(),
                "devices": len(jax.devices()),
                "local_devices": len(jax.local_devices()),
                "mesh": dict(mesh.shape),
                "shards": sorted(
                    [jax.devices().index(d), [s.start or 0 for s in i or ()]]
                    for d, i in weight.sharding.addressable_devices_indices_map(
                        weight.shape
                    ).items()
                ),
                "local_ok": local_ok,
                "loss": float(value),
                "expected": expected,
                **orbax,
            }
        )
    )
    jax.distributed.shutdown()


def _orbax_round_trip(directory, model, sharded):
    """Save the sharded model with Orbax from both processes, restore it into
    `eqshard.abstract` with another layout, and compare each local shard."""
    import equinox as eqx
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    import eqshard

    arrays = eqx.filter(sharded, eqx.is_array)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(f"{directory}/ckpt", arrays)
        checkpointer.wait_until_finished()
        # another layout: the first weight by columns rather than rows
        other = eqshard.plan(
            model,
            eqshard.load(
                {"eqshard": 1, "rules": [{"path": "layers.0.weight", "expr": "o i -> o i*"}]}
            ),
        )
        target = eqshard.abstract(eqx.filter(model, eqx.is_array), other)
        restored = checkpointer.restore(f"{directory}/ckpt", target)
    saved = [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))]
    leaves = jax.tree_util.tree_leaves(restored)
    return {
        "orbax_addressable": any(leaf.is_fully_addressable for leaf in leaves),
        "orbax_ok": all(
            np.array_equal(np.asarray(shard.data), reference[shard.index])
            for leaf, reference in zip(leaves, saved)
            for shard in leaf.addressable_shards
        ),
        "orbax_layout": all(
            leaf.sharding.is_equivalent_to(t.sharding, leaf.ndim)
            for leaf, t in zip(leaves, jax.tree_util.tree_leaves(target))
        ),
    }


if __name__ == "__main__":
    main()
