"""Evaluation and randomness: ``make_eval_step`` and the rng a ``loss_fn`` gets, against losses computed here.

The loss_fn is the suite's MLP classifier behind inverted dropout on its inputs
(``jax.random.bernoulli(rng, 0.5, x.shape)``), so the loss depends on the exact key it is given. The key is
derived in the test from the seed alone: ``jp.train.init_state`` splits ``jax.random.key(seed)`` into
``(init_key, state_rng)``; step ``t`` uses ``fold_in(state_rng, t)``; with ``grad_accum_steps=k``,
microbatch ``j`` (rows ``j::k``) uses ``fold_in(fold_in(state_rng, t), j)``. Parity as DESIGN.md "Tests": per
leaf ``max|got - ref| <= 1e-5 * max|ref|``. Run with ``-s`` to see the errors reached.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_scalar_close, assert_tree_close, max_rel_err, mlp_batch, mlp_parts

import jaxpar as jp

SEED = 17
LAYOUTS = {"1dev": {}, "data8": {"data": 8}, "fsdp8": {"fsdp": 8}, "tensor8": {"tensor": 8},
           "d2f2t2": {"data": 2, "fsdp": 2, "tensor": 2}}
init_fn, base_loss = mlp_parts()


def dropout_loss(params, batch, rng):
    """Inverted dropout (keep probability 0.5) on the inputs, then the MLP's cross-entropy."""
    keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
    x = jnp.where(keep, batch["x"] / 0.5, 0.0)
    return base_loss(params, {"x": x, "y": batch["y"]}, rng)


def keys(seed=SEED):
    """(init_key, state_rng) exactly as the docs of jp.train.init_state say: a split of key(seed)."""
    init_key, state_rng = jax.random.split(jax.random.key(seed))
    return init_key, state_rng


_LOSS = jax.jit(dropout_loss)
_VALUE_AND_GRAD = jax.jit(jax.value_and_grad(lambda p, b, r: dropout_loss(p, b, r)[0]))


def on_one_device(fn, *args):
    """``fn(*args)`` (fn jitted) with every argument on the first device: plain JAX, no mesh."""
    return jax.device_get(fn(*jax.device_put(args, jax.devices()[0])))


def ref_loss(params, batch, key):
    return on_one_device(_LOSS, params, batch, key)


def ref_loss_and_grads(params, batch, key, k=1):
    """Plain value_and_grad of the dropout loss; with k microbatches (rows j::k, key fold_in(key, j)) the mean
    of their losses and gradients (equal sizes: their weights are equal)."""
    out = [on_one_device(_VALUE_AND_GRAD, params, jax.tree.map(lambda a: a[j::k], batch),
                         key if k == 1 else jax.random.fold_in(key, j)) for j in range(k)]
    loss = np.mean([float(l) for l, _ in out])
    grads = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *[g for _, g in out])
    return loss, grads


def trace_of(opt_state):
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
                if isinstance(s, optax.TraceState)).trace


def test_state_rng_is_the_second_half_of_the_split_and_init_is_the_first():
    init_key, state_rng = keys()
    state = jp.train.init_state(init_fn, optax.sgd(0.1), SEED, mesh=jp.make_mesh(devices=jax.devices()[:1]))
    assert np.array_equal(jax.random.key_data(state.rng), jax.random.key_data(state_rng))
    params = on_one_device(jax.jit(lambda k: nn.meta.unbox(init_fn(k))), init_key)
    assert_tree_close(state.params, params, rtol=0.0, what="params from init_key")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eval_step_matches_the_loss_computed_here(layout, mesh_factory):
    """The eval loss and aux at step 0 and step 3 equal the dropout loss with fold_in(state_rng, step)."""
    mesh = mesh_factory(**LAYOUTS[layout])
    _, state_rng = keys()
    batch = mlp_batch(np.random.default_rng(SEED), 32)
    state = jp.train.init_state(init_fn, optax.sgd(0.1), SEED, mesh=mesh)
    params = jax.device_get(state.params)
    eval_step = jp.train.make_eval_step(dropout_loss, mesh=mesh)
    errs, losses = [], []
    for t in (0, 3):
        s = state.replace(step=jax.device_put(jnp.asarray(t, jnp.int32), state.step.sharding))
        got = eval_step(s, batch)
        loss, aux = ref_loss(params, batch, jax.random.fold_in(state_rng, t))
        errs.append(assert_scalar_close(got["loss"], loss, what=f"{layout} eval loss at step {t}"))
        assert float(got["weight"]) == float(aux["weight"]) == 32
        assert_scalar_close(got["accuracy"], aux["accuracy"], what=f"{layout} accuracy at step {t}")
        losses.append(float(got["loss"]))
    # the rng matters: another step is another dropout mask, hence another loss
    assert abs(losses[0] - losses[1]) > 1e-4 * abs(losses[0]), losses   # 10x the parity tolerance
    print(f"\n[eval {layout}] loss err {max(errs):.2e} (step 0 {losses[0]:.4f}, step 3 {losses[1]:.4f})")


TRAIN_LAYOUTS = {"1dev": {}, "data8": {"data": 8}, "d2f2t2": {"data": 2, "fsdp": 2, "tensor": 2}}


@pytest.mark.parametrize("k", [1, pytest.param(4, marks=pytest.mark.slow)])  # k=4: slow
def test_train_step_rng_per_step_and_per_microbatch(k, mesh_factory):
    """Two sgd steps: step t's loss and gradient are the dropout loss's with fold_in(state_rng, t), and with
    grad_accum_steps=k microbatch j gets fold_in(that key, j) (a distinct mask per microbatch); the same
    numbers on one device, data=8 and data2 x fsdp2 x tensor2."""
    _, state_rng = keys()
    rng = np.random.default_rng(SEED + k)
    batches = [mlp_batch(rng, 32), mlp_batch(rng, 32)]
    tx = optax.sgd(0.1, momentum=0.9)
    params = jax.device_get(jp.train.init_state(init_fn, tx, SEED, mesh=mesh_factory()).params)
    loss0, grads0 = ref_loss_and_grads(params, batches[0], jax.random.fold_in(state_rng, 0), k)
    params1 = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads0)   # sgd(0.1, momentum) from a zero trace
    loss1, _ = ref_loss_and_grads(params1, batches[1], jax.random.fold_in(state_rng, 1), k)

    # the test can tell the keys apart: no fold_in of the step, or one key for every microbatch, is another loss
    # (10x the parity tolerance on the loss; the gradient, where the mask enters directly, by far more)
    wrong = {"no step fold_in": ref_loss_and_grads(params, batches[0], state_rng, k)}
    if k > 1:
        same = [ref_loss_and_grads(params, jax.tree.map(lambda a: a[j::k], batches[0]),
                                   jax.random.fold_in(state_rng, 0)) for j in range(k)]
        wrong["same key per microbatch"] = (np.mean([l for l, _ in same]),
                                            jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *[g for _, g in same]))
    for what, (w_loss, w_grads) in wrong.items():
        assert abs(w_loss - loss0) > 1e-4 * abs(loss0), (what, loss0, w_loss)
        assert max(max_rel_err(a, b) for a, b in zip(jax.tree.leaves(w_grads), jax.tree.leaves(grads0))) > 1e-2, what

    losses, errs = {}, []
    for name, sizes in TRAIN_LAYOUTS.items():
        mesh = mesh_factory(**sizes)
        state = jp.train.init_state(init_fn, tx, SEED, mesh=mesh)
        step = jp.train.make_train_step(dropout_loss, tx, mesh=mesh, grad_accum_steps=k)
        new_state, metrics = step(state, batches[0])
        errs += [assert_scalar_close(metrics["loss"], loss0, what=f"{name} k={k} step 0 loss"),
                 assert_tree_close(trace_of(new_state.opt_state), grads0, what=f"{name} k={k} step 0 grads")]
        assert_tree_close(new_state.params, params1, what=f"{name} k={k} params after step 0")
        _, metrics1 = step(new_state, batches[1])
        errs.append(assert_scalar_close(metrics1["loss"], loss1, what=f"{name} k={k} step 1 loss"))
        losses[name] = (float(metrics["loss"]), float(metrics1["loss"]))
    for name, got in losses.items():       # equal across layouts, directly
        for t in (0, 1):
            assert_scalar_close(got[t], losses["1dev"][t], what=f"k={k} step {t}: {name} vs 1dev")
    print(f"\n[train rng k={k}] max err {max(errs):.2e}; losses {losses}")
