"""Expert parallelism found by what the step does, not by its shape (issue 38): stacked
experts applied by `vmap` over their stack, by an `einsum` over the experts, or by
`jax.lax.ragged_dot` name the same expert axis of the same leaves, and suggest's expert
families split exactly those leaves along it. tests/moe_models.py holds a Qwen3-style
dropless MoE (`ragged_dot`) and a GShard-style one (`einsum`); each trains under its
candidate as it does unsharded on the suite's 8 CPU devices."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import moe_models
import numpy as np
import pytest
import suggest_model
from moe_models import SwiGLU

import eqshard
from eqshard._fields import leaf_name
from eqshard._search._candidates import Candidate, candidates
from eqshard._search._profile import step_profile

EXPERT_FAMILIES = ["expert parallel", "data x expert"]
EXPERTS = {
    "ragged": ("moe.experts.gate.weight", "moe.experts.up.weight", "moe.experts.down.weight"),
    "gshard": ("moe.w_in", "moe.w_out"),
}
BUILDS = {"ragged": moe_models.ragged_build, "gshard": moe_models.gshard_build}


def _abstract(build, sizes: Any = moe_models.SIZES) -> tuple[Any, Any, Any]:
    model = eqx.filter_eval_shape(build)
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(moe_models.optimizer().init, params)
    return model, opt_state, jax.ShapeDtypeStruct((sizes.batch, sizes.seq + 1), jnp.int32)


def _specs(rules: Any, model: Any) -> dict[str, tuple[Any, ...]]:
    """Each array leaf's partition spec under `rules` on 8 devices, trailing `None`s
    dropped, by dotted path."""
    plan = eqshard.plan(model, rules, devices=8)
    found = {}
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
    for path, sharding in zip(paths, plan.flat_shardings):
        if sharding is not None:
            spec = list(sharding.spec)
            while spec and spec[-1] is None:
                spec.pop()
            found[leaf_name(path)] = tuple(spec)
    return found


@pytest.fixture(scope="module", params=["ragged", "gshard"])
def found(request) -> tuple[str, Any, list[Candidate], list[tuple[str, str]]]:
    kind = request.param
    model, opt_state, tokens = _abstract(BUILDS[kind])
    kept, dropped = candidates(
        moe_models.step, model, opt_state, tokens, devices=8, strategies=EXPERT_FAMILIES
    )
    return kind, model, kept, dropped


def test_each_form_gets_both_expert_families(found):
    _, _, kept, dropped = found
    assert [c.name for c in kept] == [
        "expert parallel on data=8, model=1",
        "data x expert on data=4, expert=2",
        "data x expert on data=2, expert=4",
    ]
    assert [name for name, _ in dropped] == [  # each the same layout as another
        "data x expert on data=8, expert=1",
        "data x expert on data=1, expert=8",
    ]
    assert all(c.repairs == () for c in kept)


def test_the_candidates_split_exactly_the_expert_weights_by_their_expert_dim(found):
    kind, model, kept, _ = found
    for candidate in kept:
        _, (axis, _) = candidate.mesh
        over = "data" if candidate.strategy == "expert parallel" else axis
        specs = _specs(candidate.rules, model)
        split = {path: spec for path, spec in specs.items() if spec}
        assert split == dict.fromkeys(EXPERTS[kind], (over,)), candidate.name
        # the router, however it is held (a raw array beside the experts' for GShard),
        # is whole on every device
        assert specs["moe.router" if kind == "gshard" else "moe.router.weight"] == ()


def _stacked(form: str, experts: SwiGLU, x: jax.Array) -> jax.Array:
    """The stacked SwiGLU applied to `x` (each expert its own `(tokens, dim)` rows),
    as `form` writes it."""
    if form == "vmap":
        return eqx.filter_vmap(lambda mlp, rows: jax.vmap(mlp)(rows))(experts, x)
    if form == "einsum":
        gate = jnp.einsum("etd,ehd->eth", x, experts.gate.weight)
        up = jnp.einsum("etd,ehd->eth", x, experts.up.weight)
        return jnp.einsum("eth,edh->etd", jax.nn.silu(gate) * up, experts.down.weight)
    rows = x.reshape(-1, x.shape[-1])
    sizes = jnp.full((x.shape[0],), x.shape[1], jnp.int32)

    def dot(rows: jax.Array, linear: eqx.nn.Linear) -> jax.Array:
        return jax.lax.ragged_dot(rows, jnp.swapaxes(linear.weight, 1, 2), sizes)

    h = jax.nn.silu(dot(rows, experts.gate)) * dot(rows, experts.up)
    return dot(h, experts.down).reshape(x.shape)


@pytest.mark.parametrize("form", ["vmap", "einsum", "ragged_dot"])
def test_vmap_einsum_and_ragged_dot_name_the_same_expert_axis_of_the_same_leaves(form):
    def build() -> SwiGLU:
        keys = jax.random.split(jax.random.key(0), 4)
        return eqx.filter_vmap(lambda k: SwiGLU(16, 32, k))(keys)

    def step(experts: SwiGLU, x: jax.Array) -> Any:
        return eqx.filter_grad(lambda m: jnp.sum(_stacked(form, m, x) ** 2))(experts)

    experts = eqx.filter_eval_shape(build)
    x = jax.ShapeDtypeStruct((4, 6, 16), jnp.float32)
    profile = step_profile(step, experts, x)
    assert profile.experts == {0: 0, 1: 0, 2: 0}  # gate, up and down, by their first dim
    assert profile.ambiguous_experts == {}
    # each form applies each expert to its own rows: the same FLOPs, 7 matmuls of
    # 4 x 6 x 16 x 32 (3 forward; back, each weight's and the hidden units')
    assert profile.flops == 7 * 2 * 4 * 6 * 16 * 32


def test_a_weight_stacked_over_two_different_axes_is_named_not_split():
    class Stack(eqx.Module):
        w: jax.Array  # (4, 4, 8): applied with its first dim batched, then its second

    def step(model: Stack, x: jax.Array) -> Any:
        def loss(m: Stack) -> jax.Array:
            y = jnp.einsum("etd,edh->eth", x, m.w)
            return jnp.sum(jnp.einsum("etd,edh->eth", x, m.w.transpose(1, 0, 2)) * y)

        return eqx.filter_grad(loss)(model)

    model = Stack(jax.ShapeDtypeStruct((4, 4, 8), jnp.float32))  # pyright: ignore[reportArgumentType]
    x = jax.ShapeDtypeStruct((4, 3, 4), jnp.float32)
    assert step_profile(step, model, x).ambiguous_experts == {0: (0, 1)}
    kept, dropped = candidates(step, model, x, devices=4, strategies=EXPERT_FAMILIES)
    assert kept == []
    assert dropped[0] == (
        "expert parallel on data=4, model=1",
        "no stacked experts are known; w float32[4, 4, 8]: its matmuls stack it over dims "
        "0 (4) and 1 (4), so which holds the experts is ambiguous; replicated",
    )


def test_experts_that_do_not_divide_are_named():
    sizes = moe_models.SIZES._replace(batch=16)  # the batch divides, the 8 experts do not
    model, opt_state, tokens = _abstract(lambda: moe_models.MoE("gshard", sizes), sizes)
    kept, dropped = candidates(
        moe_models.step, model, opt_state, tokens, devices=16, strategies=["expert parallel"]
    )
    assert kept == []
    assert dropped == [
        (
            "expert parallel on data=16, model=1",
            "no stacked experts divide over data=16; moe.w_in float32[8, 32, 64]: its 8 "
            "experts (dim 0) do not divide over data=16; replicated; moe.w_out float32[8, 64, "
            "32]: its 8 experts (dim 0) do not divide over data=16; replicated",
        )
    ]


def test_a_dense_mlp_gets_no_expert_candidate_and_is_told_why():
    model = eqx.filter_eval_shape(suggest_model.mlp_build)
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(suggest_model.mlp_optimizer().init, params)
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    kept, dropped = candidates(
        suggest_model.mlp_step, model, opt_state, x, devices=8, strategies=EXPERT_FAMILIES
    )
    assert kept == []
    assert [name for name, _ in dropped] == EXPERT_FAMILIES
    assert dropped[0][1].startswith("the step's jaxpr shows no stacked experts")
    # asked for nothing by name, the search lists no expert family at all
    kept, dropped = candidates(suggest_model.mlp_step, model, opt_state, x, devices=8)
    assert not any(
        name.startswith(tuple(EXPERT_FAMILIES))
        for name in [c.name for c in kept] + [n for n, _ in dropped]
    )


def _trained(build, rules: Any, steps: int = 3) -> tuple[list[float], list[float], Any]:
    """`steps` steps of the model `build` gives, unsharded and under `rules` on the 8
    devices: both losses, and the sharded model."""
    sizes = moe_models.SIZES
    shape = (sizes.batch, sizes.seq + 1)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, sizes.vocab, shape))
    step = eqshard.jit(moe_models.step)

    def run(model: Any, opt_state: Any) -> tuple[list[float], Any]:
        losses = []
        for _ in range(steps):
            value, model, opt_state = step(model, opt_state, tokens)
            losses.append(float(value))
        return losses, model

    with jax.default_matmul_precision("highest"):
        model = build()
        opt_state = moe_models.optimizer().init(eqx.filter(model, eqx.is_array))
        reference, _ = run(model, opt_state)
        plan = eqshard.plan(model, rules, devices=8)
        with eqshard.use(plan):
            losses, model = run(eqshard.apply(model, plan), eqshard.apply(opt_state, plan))
    return losses, reference, model


@pytest.mark.slow  # compiles each MoE's step twice under each of 2 candidates
@pytest.mark.parametrize("name", ["expert parallel on data=8", "data x expert on data=2"])
def test_the_candidate_trains_as_unsharded_each_device_holding_its_experts(found, name):
    kind, _, kept, _ = found
    (candidate,) = [c for c in kept if c.name.startswith(name)]
    losses, reference, model = _trained(BUILDS[kind], candidate.rules)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    per_device = 1 if candidate.strategy == "expert parallel" else 2
    for path in EXPERTS[kind]:
        leaf = model
        for part in path.split("."):
            leaf = getattr(leaf, part)
        assert leaf.addressable_shards[0].data.shape[0] == per_device, path
