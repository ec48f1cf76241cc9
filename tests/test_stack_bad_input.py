"""Bad input to the training stack, found by an adversarial pass: each raises a clear error before tracing
(or at trace time, for a gradient function's output) instead of crashing inside jax, optax or orbax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from helpers import mlp_batch, mlp_parts


@pytest.fixture(scope="module")
def setup():
    init_fn, loss_fn = mlp_parts()
    mesh, tx = jp.make_mesh(data=2, fsdp=4, devices=jax.devices()[:8]), optax.adam(1e-3)
    return init_fn, loss_fn, mesh, tx, mlp_batch(np.random.default_rng(0), 16)


def test_donated_state_is_refused_by_save_and_sparsity_report(setup, tmp_path):
    """jaxlib 0.10's CPU client segfaults when a compiled function meets a donated array: refuse first."""
    init_fn, loss_fn, mesh, tx, batch = setup
    ckpt = jp.checkpoint.CheckpointManager(tmp_path, max_to_keep=2)
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    ckpt.save(1, state)
    ckpt.wait()
    new, _ = jp.train.make_train_step(loss_fn, tx, mesh=mesh)(state, batch)   # donates state
    with pytest.raises(ValueError, match="donated"):
        ckpt.save(2, state)
    with pytest.raises(ValueError, match="donated"):
        jp.pruning.sparsity_report(state.params)
    with pytest.raises(TypeError, match=r"state leaf .*\['junk'\] is a object"):
        ckpt.save(2, new.replace(params={**new.params, "junk": object()}))
    assert ckpt.save(2, new, force=True), "a failed save must not block its step"
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    ckpt.close()


def test_state_that_does_not_fit_the_step(setup):
    init_fn, loss_fn, mesh, tx, batch = setup
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False)
    with pytest.raises(ValueError, match="opt_state does not have the structure this step's tx gives"):
        jp.train.make_train_step(loss_fn, optax.sgd(0.1, momentum=0.9), mesh=mesh)(state, batch)
    with pytest.raises(TypeError, match="policy must be a jp.precision.Policy or None, got 'mixed_bf16'"):
        step(state.replace(policy="mixed_bf16"), batch)
    with pytest.raises(TypeError, match="state must be a jp.train.TrainState"):
        step(state.params, batch)
    with pytest.raises(TypeError, match=r"use step.lower\(state, batch\)"):
        step(state, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch))
    with pytest.raises(TypeError, match="check_batch must be a function"):
        jp.train.make_train_step(loss_fn, tx, mesh=mesh, check_batch=3)


def test_gradient_function_outputs_are_checked(setup):
    init_fn, _, mesh, tx, batch = setup
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)

    class NoTuple(jp.grads.GradFn):
        def __call__(self, params, batch, rng, scale, ctx):
            return 1.0

    class VectorLoss(jp.grads.GradFn):
        def __call__(self, params, batch, rng, scale, ctx):
            return jnp.ones(3), {}, params

    class WrongGrads(jp.grads.GradFn):
        def __call__(self, params, batch, rng, scale, ctx):
            return jnp.float32(0.0), {}, {"x": jnp.zeros(())}

    for fn, pattern in [(NoTuple(), r"must return \(loss, aux, grads\)"), (VectorLoss(), r"loss must be a floating "
                        r"scalar"), (WrongGrads(), r"returned grads of structure")]:
        with pytest.raises(ValueError, match=pattern):
            jp.train.make_train_step(fn, tx, mesh=mesh, donate=False)(state, batch)
    bare = lambda p, b, r: jnp.float32(1.0) + 0 * jax.tree.leaves(p)[0].sum()
    with pytest.raises(ValueError, match=r"loss_fn must return \(loss, aux\).*e.g. return loss, \{\}; got a bare array"):
        jp.train.make_train_step(bare, tx, mesh=mesh, donate=False)(state, batch)


@pytest.mark.parametrize("args, pattern", [((16, 0, 1), "grad_accum_steps=0"), ((16, 1, 0), "microbatches=0"),
                                           ((16.0, 1, 1), "batch_size=16.0"), ((True, 1, 1), "batch_size=True"),
                                           ((16, -1, 1), "grad_accum_steps=-1")])
def test_check_batch_size_arguments(setup, args, pattern):
    mesh = setup[2]
    with pytest.raises(ValueError, match=pattern):
        jp.grads.check_batch_size(args[0], mesh, jp.sharding.DEFAULT_RULES, args[1], args[2])
