"""The training stack's layers: gradient functions (``jp.grads``), the step over them, lowering from shapes.

* a step built from ``jp.grads.value_and_grad(loss_fn)`` (and ``jp.grads.accumulate`` of it) gives results
  identical to one built from the plain ``loss_fn`` (and ``grad_accum_steps``), bit for bit;
* ``jp.grads.accumulate`` against a plain-JAX weighted mean over strided microbatches;
* ``step.lower(abstract_state, abstract_batch)`` with ``jax.ShapeDtypeStruct`` leaves compiles the GPT's step on
  data=2 x fsdp=2 x tensor=2 without allocating a state, and its program equals the one lowered from arrays;
* the policy travels on the state: a step built once follows the policy of the state it is given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from helpers import SMALL_GPT, assert_scalar_close, assert_tree_close, gpt_batch, gpt_parts

SEED = 5
MESH = dict(data=2, fsdp=2, tensor=2)


def _run(step, state, batch):
    new_state, metrics = step(state, batch)
    return jax.device_get((new_state.params, new_state.opt_state, metrics))


@pytest.mark.parametrize("accum", [1, 2])
def test_grad_fn_step_equals_loss_fn_step(mesh_factory, accum):
    init_fn, loss_fn = gpt_parts(SMALL_GPT)
    mesh, tx = mesh_factory(**MESH), optax.adamw(1e-3)
    batch = gpt_batch(np.random.default_rng(SEED), 16, SMALL_GPT)
    state = jp.train.init_state(init_fn, tx, SEED, mesh=mesh)
    plain = _run(jp.train.make_train_step(loss_fn, tx, mesh=mesh, grad_accum_steps=accum, donate=False),
                 state, batch)
    grad_fn = jp.grads.accumulate(jp.grads.value_and_grad(loss_fn), accum)
    assert isinstance(grad_fn, jp.grads.GradFn)
    built = _run(jp.train.make_train_step(grad_fn, tx, mesh=mesh, donate=False), state, batch)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(built)):
        np.testing.assert_array_equal(a, b)


def test_accumulate_is_the_weighted_mean_over_strided_microbatches():
    """Written out in plain JAX: microbatch j = rows j::k, weight = its count of positive targets."""
    rng = np.random.default_rng(SEED)
    w = rng.normal(size=(6, 3)).astype(np.float32)
    x = rng.normal(size=(12, 6)).astype(np.float32)
    y = rng.normal(size=(12, 3)).astype(np.float32)
    y[0::3] = -1.0                      # microbatch 0 has weight 0: it must not count (nor give NaN)

    def loss_fn(p, b, rng):
        mask = (b["y"] > 0).astype(jnp.float32)
        n = mask.sum()
        loss = jnp.where(n > 0, jnp.sum(mask * (b["x"] @ p - b["y"]) ** 2) / jnp.where(n > 0, n, 1.0), 0.0)
        return loss, {"weight": n, "mean_x": b["x"].mean()}

    k = 3
    totals, grads_sum, weights, mean_x = 0.0, np.zeros_like(w), 0.0, 0.0
    for j in range(k):
        b = {"x": x[j::k], "y": y[j::k]}
        (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(w, b, None)
        totals += float(aux["weight"]) * float(loss)
        grads_sum += float(aux["weight"]) * np.asarray(g)
        mean_x += float(aux["weight"]) * float(aux["mean_x"])
        weights += float(aux["weight"])
    mesh = jp.make_mesh(data=1, devices=jax.devices()[:1])
    ctx = jp.grads.Context(mesh)
    fn = jp.grads.accumulate(jp.grads.value_and_grad(loss_fn), k)
    with jp.sharding.use(mesh):
        loss, aux, grads = jax.jit(lambda p, b: fn(p, b, jax.random.key(0), jnp.float32(1.0), ctx))(
            w, {"x": x, "y": y})
    assert weights > 0 and float(aux["weight"]) == weights
    assert_scalar_close(loss, totals / weights, what="accumulated loss")
    assert_scalar_close(aux["mean_x"], mean_x / weights, what="weighted aux")
    assert_tree_close(grads, grads_sum / weights, what="accumulated grads")


def test_lower_from_abstract_state_and_batch_compiles_the_gpt(mesh_factory):
    init_fn, loss_fn = gpt_parts(SMALL_GPT)
    mesh, tx = mesh_factory(**MESH), optax.adamw(1e-3)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh)
    abstract = jp.train.abstract_state(init_fn, tx, mesh=mesh)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    shapes = {k: jax.ShapeDtypeStruct((16, SMALL_GPT.max_seq_len), jnp.int32) for k in ("inputs", "targets")}
    lowered = step.lower(abstract, shapes)
    compiled = lowered.compile()
    assert compiled.memory_analysis() is not None
    # the same program as lowered from a real state and batch
    state = jp.train.init_state(init_fn, tx, SEED, mesh=mesh)
    real = step.lower(state, gpt_batch(np.random.default_rng(SEED), 16, SMALL_GPT))
    assert lowered.as_text() == real.as_text()
    # abstract inputs are checked as real ones are
    with pytest.raises(ValueError, match=r"batch 6 is not divisible by data\*fsdp = 4"):
        step.lower(abstract, {k: jax.ShapeDtypeStruct((6, 8), jnp.int32) for k in ("inputs", "targets")})
    with pytest.raises(TypeError, match=r"abstract inputs need shardings"):
        step.lower(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), abstract), shapes)
    with pytest.raises(TypeError, match=r"use step.lower\(state, batch\)"):
        step(abstract, gpt_batch(np.random.default_rng(SEED), 16, SMALL_GPT))


@pytest.mark.slow  # heavy (subprocesses or several compiles); .ci/run runs it
def test_the_policy_travels_on_the_state(mesh_factory):
    """One step built once: a float32 state computes in float32, a mixed_bf16 state in bfloat16 (its loss
    differs from the float32 one by bf16 rounding, not 0), and the restore target carries the policy."""
    init_fn, loss_fn = gpt_parts(SMALL_GPT)
    mesh, tx = mesh_factory(**MESH), optax.sgd(0.1)
    batch = gpt_batch(np.random.default_rng(SEED), 16, SMALL_GPT)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False)
    policy = jp.precision.Policy.from_string("mixed_bf16")
    f32 = jp.train.init_state(init_fn, tx, SEED, mesh=mesh)
    bf16 = jp.train.init_state(init_fn, tx, SEED, mesh=mesh, policy=policy)
    assert f32.policy is None and bf16.policy == policy
    assert jp.train.abstract_state(init_fn, tx, mesh=mesh, policy=policy).policy == policy
    hlo = step.lower(bf16, batch).as_text()
    assert "bf16" in hlo and "bf16" not in step.lower(f32, batch).as_text()
    l32, l16 = float(step(f32, batch)[1]["loss"]), float(step(bf16, batch)[1]["loss"])
    assert 0 < abs(l32 - l16) < 3e-2 * abs(l32), (l32, l16)
    new = step(bf16, batch)[0]
    assert new.policy == policy and all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.params))
