"""Models for tests/test_suggest.py that worker processes import by name.

`rank` sends the step to its workers with cloudpickle, which sends a module's
functions by name: this module is `suggest_model` there too (the workers have the
suite's `sys.path`, `tests/` among it). The stacked GPT is examples/gpt_stacked.py,
run in this module's name, so its functions are found here by name.
"""

import os
import runpy
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

EXAMPLE = Path(__file__).parent.parent / "examples" / "gpt_stacked.py"
_GPT = runpy.run_path(str(EXAMPLE), run_name=__name__)
# every function by name here (the model's classes live in eqshard._demo._model, which
# workers import by name; a class a worker cannot find by name is sent by value, rebuilt
# there by eqshard's pickler with its fields: tests/test_workers.py)
globals().update({name: value for name, value in _GPT.items() if not name.startswith("__")})
GPT = _GPT["GPT"]
build = _GPT["build"]
step = _GPT["step"]
optimizer = _GPT["optimizer"]
batch = _GPT["batch"]
loss = _GPT["loss"]


def mlp_build() -> eqx.nn.MLP:
    """A small MLP: quick to compile on 8 devices."""
    return eqx.nn.MLP(32, 32, 64, 1, key=jax.random.key(0))


def mlp_optimizer() -> optax.GradientTransformation:
    return optax.adam(1e-3)


def mlp_batch() -> jax.Array:
    return jnp.zeros((16, 32))


@eqx.filter_jit
def mlp_step(model, opt_state, x):
    def loss_fn(m):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    value, grads = eqx.filter_value_and_grad(loss_fn)(model)
    params = eqx.filter(model, eqx.is_array)
    updates, opt_state = mlp_optimizer().update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, value


def failing_step(model, opt_state, x):
    raise ValueError("no step here")


def dying_step(model, opt_state, x):
    os.write(2, b"F0000 the compiler's last words\n")
    os._exit(3)  # as a compiler killed for its memory would: no answer


NOISE = "W0000 00:00:00.0 noise.cc:1] what XLA's C++ writes on fd 2"


def noisy_step(model, opt_state, x):
    """`mlp_step`, writing on fd 2 as XLA's C++ does, wherever it is traced."""
    os.write(2, (NOISE + "\n").encode())
    return mlp_step(model, opt_state, x)


# examples/llama_8b.py, run in this module's name as the GPT is: its classes are found
# here by name, and a small one is built from them
_LLAMA = runpy.run_path(str(EXAMPLE.parent / "llama_8b.py"), run_name=__name__)
Llama, Layer = _LLAMA["Llama"], _LLAMA["Layer"]
LLAMA_SIZES = _LLAMA["Sizes"](
    vocab=512, dim=128, heads=4, kv_heads=2, hidden=256, layers=4, batch=16, sequence=64
)


def llama_build():
    """A Llama-shaped model, small: its layers stacked and scanned, in bfloat16."""
    return _LLAMA["build"](LLAMA_SIZES)


def llama_optimizer() -> optax.GradientTransformation:
    return _LLAMA["optimizer"]()


def llama_batch() -> jax.Array:
    return _LLAMA["batch"](LLAMA_SIZES)


def llama_step(model, opt_state, tokens):
    return _LLAMA["step"](model, opt_state, tokens)


def batch64() -> jax.Array:
    """The GPT's batch with 64 rows: one per device on 64 devices."""
    tokens = batch()
    return jnp.zeros((64, *tokens.shape[1:]), tokens.dtype)
