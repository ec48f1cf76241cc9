"""Mixed-precision policies and loss scaling (jaxpar/precision.py) and their use in the train step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig
from jaxpar.precision import DynamicLossScale, NoOpLossScale, Policy, StaticLossScale, loss_scaling

from helpers import mlp_batch, mlp_parts

F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)


# ----------------------------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text, want", [
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("params=f32,compute=f16", (F32, F16, F16)),          # output follows compute
    ("compute=bf16", (F32, BF16, BF16)),                  # params default f32
    ("params=bf16", (BF16, BF16, BF16)),                  # compute follows params
    ("p=float16, o=float32", (F16, F16, F32)),
    ("bf16", (BF16, BF16, BF16)),                         # a bare dtype sets all three (as jmp)
    ("float32", (F32, F32, F32)),
    ("f16", (F16, F16, F16)),
    ("mixed_bf16", (F32, BF16, F32)),
    ("mixed_fp16", (F32, F16, F32)),
    ("PARAMS=Float32,Compute=BFloat16", (F32, BF16, BF16)),
])
def test_policy_from_string(text, want):
    policy = Policy.from_string(text)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == want
    assert Policy.from_string(str(policy)) == policy


@pytest.mark.parametrize("text, match", [
    ("", "empty"), ("   ", "empty"), ("params=float64", "unknown dtype"), ("int8", "unknown dtype"),
    ("weights=f32", "unknown policy key"), ("params=f32,bogus", "unknown policy key"),
])
def test_policy_from_string_errors(text, match):
    with pytest.raises(ValueError, match=match):
        Policy.from_string(text)


def test_policy_casts_floating_leaves_only():
    tree = {"w": jnp.ones(3, jnp.float32), "i": jnp.arange(3), "b": jnp.array([True]), "s": 1.5}
    out = Policy.from_string("mixed_bf16").cast_to_compute(tree)
    assert out["w"].dtype == BF16 and out["i"].dtype == tree["i"].dtype
    assert out["b"].dtype == jnp.bool_ and out["s"] == 1.5


# ------------------------------------------------------------------------------------- bf16 in the step

def _gpt(dtype):
    return GPT(GPTConfig(vocab_size=61, num_layers=2, num_heads=4, d_model=64, max_seq_len=32, dtype=dtype))


def _gpt_batch(seed=0, b=8, length=32):
    rng = np.random.default_rng(seed)
    return {"inputs": rng.integers(0, 61, (b, length), dtype=np.int32),
            "targets": rng.integers(0, 61, (b, length), dtype=np.int32)}


def test_bf16_step_computes_dots_in_bf16_and_keeps_f32_state(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    policy = Policy.from_string("mixed_bf16")
    model, tx = _gpt(jnp.bfloat16), optax.adam(1e-3)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh, policy=policy)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, policy=policy)
    text = step.lower(state, _gpt_batch()).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    bf16_dots = [d for d in dots if re.search(r"tensor<[0-9x]*bf16>.*tensor<[0-9x]*bf16>", d)]
    assert dots and len(bf16_dots) >= 0.8 * len(dots), f"{len(bf16_dots)} of {len(dots)} dots take bf16 operands"
    state, metrics = step(state, _gpt_batch())
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == F32
    assert np.isfinite(float(metrics["loss"]))


def _residual_bytes(model, params, batch):
    def residuals(p):
        return jax.vjp(lambda q: model.loss(q, batch)[0], p)[1]
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(residuals, params)))


def test_bf16_saves_residual_memory():
    batch = _gpt_batch(b=16, length=32)
    f32_model, bf16_model = _gpt(jnp.float32), _gpt(jnp.bfloat16)
    params = jax.tree.map(lambda x: x.value, f32_model.init(jax.random.key(0)),
                          is_leaf=lambda x: hasattr(x, "value"))
    f32_bytes = _residual_bytes(f32_model, params, batch)
    bf16_bytes = _residual_bytes(bf16_model, Policy.from_string("mixed_bf16").cast_to_compute(params), batch)
    print(f"vjp residuals: f32 {f32_bytes} B, bf16 {bf16_bytes} B ({1 - bf16_bytes / f32_bytes:.1%} less)")
    assert bf16_bytes <= 0.65 * f32_bytes


def test_fp16_step_runs_on_cpu_with_dynamic_scaling(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    policy = Policy.from_string("mixed_fp16")
    model = _gpt(jnp.float16)
    tx = loss_scaling(optax.adam(1e-3), DynamicLossScale(initial_scale=2.0 ** 10))
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh, policy=policy)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, policy=policy)
    state, metrics = step(state, _gpt_batch())
    assert float(metrics["loss_scale"]) == 2.0 ** 10 and float(metrics["skipped"]) == 0.0
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))


def test_small_updates_move_f32_master_weights(mesh_factory):
    """Updates below bf16's resolution (2**-8 relative) accumulate in the f32 master weights."""
    mesh = mesh_factory(fsdp=8)
    policy = Policy.from_string("mixed_bf16")
    init_fn = lambda rng: {"w": jnp.ones((64, 8), jnp.float32)}
    loss_fn = lambda p, b, r: (jnp.sum(p["w"] * b["x"][:, :, None].mean(0)), {})
    tx = optax.sgd(1e-5)
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh, policy=policy)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, policy=policy)
    batch = {"x": np.ones((8, 64), np.float32)}
    for _ in range(100):
        state, _ = step(state, batch)
    w = np.asarray(state.params["w"])
    assert w.dtype == np.float32
    np.testing.assert_allclose(w, 1.0 - 100 * 1e-5, rtol=1e-5)  # f32 rounding of 100 subtractions
    assert jnp.asarray(1.0 - 1e-5, jnp.bfloat16) == 1.0  # a single update is invisible in bf16


def test_bf16_params_keep_f32_optimizer_moments(mesh_factory):
    mesh = mesh_factory(fsdp=8)
    policy = Policy.from_string("bf16")
    init_fn, loss_fn = mlp_parts()
    tx = optax.adam(1e-3)
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh, policy=policy)
    assert all(x.dtype == BF16 for x in jax.tree.leaves(state.params))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert moments and all(x.dtype == F32 for x in moments)
    abstract = jp.train.abstract_state(init_fn, tx, mesh=mesh, policy=policy)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), state)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, policy=policy)
    state, _ = step(state, mlp_batch(np.random.default_rng(0), 16))
    assert all(x.dtype == BF16 for x in jax.tree.leaves(state.params))
    assert all(x.dtype == F32 for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)


# ------------------------------------------------------------------------------------------- loss scales

def _sharded_params(mesh):
    sharding = NamedSharding(mesh, P("fsdp", "tensor"))
    rng = np.random.default_rng(0)
    return {"w": jax.device_put(rng.normal(size=(16, 8)).astype(np.float32), sharding),
            "b": jax.device_put(rng.normal(size=(8,)).astype(np.float32), NamedSharding(mesh, P("tensor")))}


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_nonfinite_gradient_on_one_shard_skips_the_step(mesh_factory, bad):
    mesh = mesh_factory(fsdp=4, tensor=2)
    params = _sharded_params(mesh)
    tx = loss_scaling(optax.adam(1e-2), DynamicLossScale(initial_scale=2.0 ** 8))
    state = jax.jit(tx.init)(params)
    update = jax.jit(tx.update)
    good = jax.tree.map(lambda p: p * 0.5, params)
    _, state = update(good, state, params)                      # one finite step: Adam moments non-zero
    g = np.asarray(good["w"]).copy()
    g[15, 7] = bad                                               # lives on a single device's shard
    grads = {"w": jax.device_put(g, params["w"].sharding), "b": good["b"]}
    assert sum(not np.isfinite(np.asarray(s.data)).all() for s in grads["w"].addressable_shards) == 1
    updates, new_state = update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    for got, ref in zip(jax.tree.leaves((new_params, new_state.inner_state)),
                        jax.tree.leaves((params, state.inner_state))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert float(new_state.scale) == 2.0 ** 7 and bool(new_state.skipped) and int(new_state.num_skipped) == 1


def test_train_step_skips_nonfinite_step_and_reports_it(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    init_fn, loss_fn = mlp_parts()
    tx = loss_scaling(optax.adamw(1e-2), DynamicLossScale(initial_scale=2.0 ** 8))
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False)
    batch = mlp_batch(np.random.default_rng(0), 16)
    batch["x"][3, 5] = np.inf
    new, metrics = step(state, batch)
    assert float(metrics["skipped"]) == 1.0 and float(metrics["loss_scale"]) == 2.0 ** 8
    for got, ref in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert float(jp.precision.loss_scale(new.opt_state)) == 2.0 ** 7


def test_scale_never_drops_below_min_scale_even_after_jit_round_trip(mesh_factory):
    mesh = mesh_factory(fsdp=4, tensor=2)
    params = _sharded_params(mesh)
    tx = loss_scaling(optax.sgd(0.1), DynamicLossScale(initial_scale=2.0 ** 4, min_scale=2.0))
    state = jax.jit(tx.init)(params)
    bad = jax.tree.map(lambda p: p * jnp.inf, params)
    update = jax.jit(tx.update)
    for _ in range(30):
        _, state = update(bad, state, params)
    assert float(state.scale) == 2.0 and int(state.num_skipped) == 30
    state = jax.device_put(jax.device_get(state))                # through host memory and back
    _, state = jax.jit(tx.update)(bad, state, params)
    assert float(state.scale) == 2.0 and float(state.min_scale) == 2.0


@pytest.mark.parametrize("dtype, cap", [(jnp.float32, 2.0 ** 24), (jnp.float16, 65504.0)])
def test_growth_stays_finite_and_capped(mesh_factory, dtype, cap):
    mesh = mesh_factory(fsdp=4, tensor=2)
    params = _sharded_params(mesh)
    tx = loss_scaling(optax.sgd(1e-3), DynamicLossScale(initial_scale=1.0, growth_interval=1, growth_factor=10.0,
                                                        max_scale=2.0 ** 24, dtype=dtype))
    state = jax.jit(tx.init)(params)
    assert state.scale.dtype == jnp.dtype(dtype)
    update = jax.jit(tx.update)
    grads = jax.tree.map(lambda p: p * 1e-3, params)
    seen = []
    for _ in range(100):
        _, state = update(grads, state, params)
        seen.append(float(state.scale))
    assert all(np.isfinite(seen)) and max(seen) <= cap
    assert seen[0] == 10.0 and seen[-1] == cap      # grew by 10x per step, then held at the cap


def test_static_and_noop_scales(mesh_factory):
    mesh = mesh_factory(fsdp=4, tensor=2)
    params = _sharded_params(mesh)
    grads = jax.tree.map(lambda p: p * 0.25, params)
    ref, _ = optax.sgd(1.0).update(grads, optax.sgd(1.0).init(params), params)
    for ls, scale in [(StaticLossScale(128.0), 128.0), (NoOpLossScale(), 1.0)]:
        tx = loss_scaling(optax.sgd(1.0), ls)
        state = tx.init(params)
        scaled = jax.tree.map(lambda g: g * scale, grads)
        updates, state = jax.jit(tx.update)(scaled, state, params)
        for u, r in zip(jax.tree.leaves(updates), jax.tree.leaves(ref)):
            np.testing.assert_allclose(np.asarray(u), np.asarray(r), rtol=1e-6)
        assert float(jp.precision.loss_scale(state)) == scale


def test_loss_scale_config_errors():
    with pytest.raises(ValueError, match="min_scale"):
        DynamicLossScale(initial_scale=0.5, min_scale=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScale(backoff_factor=2.0)
    with pytest.raises(ValueError, match="positive"):
        StaticLossScale(0.0)
    with pytest.raises(TypeError, match="loss_scale"):
        loss_scaling(optax.sgd(1.0), 128.0)


def test_clipping_acts_on_unscaled_gradients(mesh_factory):
    mesh = mesh_factory(fsdp=4, tensor=2)
    params = _sharded_params(mesh)
    grads = jax.tree.map(lambda p: p * 0.01, params)              # norm well under 1: no clipping
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    tx = loss_scaling(inner, StaticLossScale(2.0 ** 12))
    updates, _ = jax.jit(tx.update)(jax.tree.map(lambda g: g * 2.0 ** 12, grads), tx.init(params), params)
    for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(u), -np.asarray(g), rtol=1e-6)
