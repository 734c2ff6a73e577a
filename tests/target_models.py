"""The step that the target tests compile, for a TPU slice (`test_targets.py`) and for
GPUs (`test_gpu_targets.py`): an `eqx.nn.MLP`'s AdamW step over abstract arguments."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

OPTIMIZER = optax.adamw(1e-3)


def model():
    return eqx.nn.MLP(256, 256, 1024, 2, key=jax.random.key(0))


@eqx.filter_jit
def step(model, opt_state, x):
    grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state


def arguments():
    """The model, its optimizer state and a batch of 64 rows, all abstract."""
    abstract = eqx.filter_eval_shape(model)
    params = eqx.filter(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = eqx.filter_eval_shape(OPTIMIZER.init, params)
    return abstract, opt_state, jax.ShapeDtypeStruct((64, 256), jnp.float32)
