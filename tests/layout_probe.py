"""Prints which device holds which block, under eqshard or under einshard.

Run as a script, never imported by the tests: `python layout_probe.py IMPL N`, with
IMPL `eqshard` or `einshard` and N the number of simulated CPU devices. It reads a
JSON list of `[expression, shape]` pairs on standard input and prints, for each,
either `{"blocks": {device_id: [[start, stop], ...]}}` or `{"error": "..."}`.
The einshard side runs in an interpreter that has einshard (Python 3.12 or newer).
"""

import json
import os
import sys


def main() -> None:
    impl, n_devices = sys.argv[1], int(sys.argv[2])
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"
    import jax

    if impl == "einshard":
        import einshard  # pyright: ignore[reportMissingImports]

        make = lambda expr, shape: einshard.make_sharding(expr, n_dims=len(shape))  # noqa: E731
    else:
        import eqshard

        make = eqshard.expression.sharding

    assert len(jax.devices()) == n_devices
    results = []
    for expr, shape in json.load(sys.stdin):
        try:
            sharding = make(expr, tuple(shape))
            index_map = sharding.devices_indices_map(tuple(shape))
        except Exception as error:  # the probe records every failure, of any kind
            results.append({"error": f"{type(error).__name__}: {error}"})
            continue
        results.append(
            {
                "blocks": {
                    str(device.id): [
                        [s.start or 0, size if s.stop is None else s.stop]
                        for s, size in zip(index, shape)
                    ]
                    for device, index in index_map.items()
                }
            }
        )
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
