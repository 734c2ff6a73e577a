"""einshard's 2-layer MLP example, as an annotated Equinox model.

`w1` is split by columns and `w2` by rows ("1-D tensor parallelism"): each device
computes its slice of the hidden layer, and one all-reduce sums the partial outputs.

Run: `python examples/mlp_tensor_parallel.py` (8 simulated CPU devices when no
accelerator is present).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

import eqshard


class MLP(eqx.Module):
    w1: Float[Array, "x y"] = eqshard.field("x y -> x y*")
    w2: Float[Array, "y z"] = eqshard.field("y* z")  # short form: "y z -> y* z"

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (128, 256)) / 128**0.5
        self.w2 = jax.random.normal(k2, (256, 64)) / 256**0.5

    def __call__(self, x: Float[Array, "b x"]) -> Float[Array, "b z"]:
        return jax.nn.relu(x @ self.w1) @ self.w2


def main() -> None:
    model = MLP(jax.random.key(42))
    x = jax.random.normal(jax.random.key(0), (8, 128))

    sharded = eqshard.apply(model)
    spec = eqshard.spec_tree(model)
    print(f"{len(jax.devices())} devices; layouts:")
    for name in ("w1", "w2"):
        array = getattr(sharded, name)
        print(f"  {name} {array.shape}: {getattr(spec, name)}")
        print(
            f"     spec {array.sharding.spec}, each device holds {array.sharding.shard_shape(array.shape)}"
        )

    forward = eqx.filter_jit(lambda m, x: m(x))
    expected = forward(model, x)
    got = forward(sharded, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    print(
        f"sharded output equals the unsharded one: max |diff| = {float(jnp.max(jnp.abs(got - expected))):.1e}"
    )

    hlo = jax.jit(lambda m, x: m(x)).lower(sharded, x).compile().as_text() or ""
    print(
        f"compiled program: {hlo.count('all-reduce(')} all-reduce, "
        f"{hlo.count('all-gather(')} all-gather"
    )


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # CPU only: simulated devices when no accelerator
    main()
