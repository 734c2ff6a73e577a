"""One process of a two-process `jax.distributed` run over loopback.

Run as a script by `test_multiprocess.py`, never imported: `python
multiprocess_worker.py PORT PROCESS_ID`. Each process has 4 CPU devices; the
model is placed over all 8 with a spec file, then trained one step.
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
    print(
        json.dumps(
            {
                "process": jax.process_index(),
                "devices": len(jax.devices()),
                "local_devices": len(jax.local_devices()),
                "mesh": dict(mesh.shape),
                "shards": sorted(
                    [jax.devices().index(d), [s.start or 0 for s in i]]
                    for d, i in weight.sharding.addressable_devices_indices_map(
                        weight.shape
                    ).items()
                ),
                "local_ok": local_ok,
                "loss": float(value),
                "expected": expected,
            }
        )
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
