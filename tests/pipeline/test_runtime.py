"""jaxpar/pipeline/functional.py: ``jp.pipeline.value_and_grad`` and ``apply`` on a mesh: one stage without
shard_map, a bfloat16 model, and the errors they raise at the API boundary, before tracing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_scalar_close, assert_tree_close

import jaxpar as jp

from .common import MESHES, SCHEDULES, check_parity, head_loss, make_problem, mlp_block, place, reference


def test_bfloat16_runs_close_to_float32(mesh_factory):
    """A bfloat16 model (params, activations, loss in bf16) runs; its numbers are close to float32's."""
    p, m = 2, 4
    mesh = mesh_factory(**MESHES["d2p2t2"])
    stage, head, x, t = make_problem(p, m, seed=5)
    bf16 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, jp.pipeline.one_f_one_b(p, m), mesh=mesh)
    loss, grads = f(*place(mesh, *bf16((stage, head, x, t))))
    assert loss.dtype == jnp.float32 and all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
    ref_loss, ref_grads = reference(stage, head, x, t)
    assert_scalar_close(loss, ref_loss, rtol=2e-2, what="bf16 loss")   # bf16 keeps 8 bits of mantissa
    assert_tree_close(jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_grads, rtol=5e-2, what="bf16 grads")


def test_one_stage_runs_without_shard_map(mesh_factory):
    """p=1 (a mesh whose pipe axis has size 1) is plain microbatching, beside data, fsdp and tensor."""
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    stage, head, x, t = make_problem(1, 4, seed=6)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, jp.pipeline.one_f_one_b(1, 4), mesh=mesh)
    check_parity(f(*place(mesh, stage, head, x, t)), reference(stage, head, x, t), "1f1b p=1 m=4 d2f2t2")


# ----------------------------------------------------------------------------------------------- errors

def _f(mesh, p=2, m=2, schedule="1f1b", stage_fn=mlp_block, loss_fn=head_loss, **kw):
    return jp.pipeline.value_and_grad(stage_fn, loss_fn, SCHEDULES[schedule](p, m), mesh=mesh, **kw)


def test_errors_at_the_api_boundary(mesh_factory):
    mesh = mesh_factory(**MESHES["d2p2t2"])
    stage, head, x, t = make_problem(2, 2)
    with pytest.raises(ValueError, match=r"the mesh has pipe=2 but schedule '1f1b' has num_stages=4"):
        _f(mesh, p=4, m=4)
    with pytest.raises(ValueError, match=r"no 'pipe' axis"):
        jp.pipeline.value_and_grad(mlp_block, head_loss, jp.pipeline.gpipe(2, 2),
                                   mesh=jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,)))
    with pytest.raises(TypeError, match=r"schedule must be a jp.pipeline.Schedule"):
        jp.pipeline.value_and_grad(mlp_block, head_loss, "1f1b", mesh=mesh)
    with pytest.raises(ValueError, match=r"forward-only; use jp.pipeline.apply"):
        jp.pipeline.value_and_grad(mlp_block, head_loss, jp.pipeline.gpipe(2, 2).forward_only(), mesh=mesh)
    with pytest.raises(ValueError, match=r"stash='all'"):
        _f(mesh, stash="all")
    f = _f(mesh)
    bad_stage = {**stage, "w_in": stage["w_in"][:1]}
    with pytest.raises(ValueError, match=r"stage_params\['w_in'\] has shape \(1, 16, 32\): every leaf needs a "
                                         r"leading axis of exactly num_stages = 2"):
        f(bad_stage, head, x, t)
    with pytest.raises(ValueError, match=r"batch 7 is not divisible by num_microbatches = 2"):
        f(stage, head, x[:7], t[:7])
    with pytest.raises(ValueError, match=r"microbatch 3 \(batch 6 / 2 microbatches\) is not divisible by data\*fsdp "
                                         r"= 2; use a batch that is a multiple of 4"):
        f(stage, head, x[:6], t[:6])
    with pytest.raises(ValueError, match=r"targets has shape \(4, 4, 8\); its leading axis must be x's batch \(8\)"):
        f(stage, head, x, t[:4])
    shrink = lambda params, x: mlp_block(params, x)[:, :2]
    with pytest.raises(ValueError, match=r"stage_fn maps a microbatch float32\[4, 4, 16\] to float32\[4, 2, 16\]: "
                                         r"a pipeline stage must keep the activation's shape"):
        _f(mesh, stage_fn=shrink)(stage, head, x, t)
    with pytest.raises(ValueError, match=r"loss_fn\(head_params, y_mb, targets_mb\) must return a float scalar"):
        _f(mesh, loss_fn=lambda h, y, t: y)(stage, head, x, t)
    with pytest.raises(ValueError, match=r"1F1B needs num_microbatches >= num_stages"):
        _f(mesh, p=2, m=1)
    apply = jp.pipeline.apply(mlp_block, jp.pipeline.gpipe(2, 2), mesh=mesh)
    with pytest.raises(ValueError, match=r"batch 5 is not divisible by num_microbatches = 2"):
        apply(stage, x[:5])


def test_interleaved_stage_params_error(mesh_factory):
    mesh = mesh_factory(**MESHES["d2p2t2"])
    stage, head, x, t = make_problem(2, 4)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, jp.pipeline.interleaved_1f1b(2, 4, 2), mesh=mesh)
    with pytest.raises(ValueError, match=r"stage_params\['b_in'\] has shape \(2, 32\): every leaf needs a "
                                         r"leading axis of exactly num_stages \* num_chunks = 4"):
        f(stage, head, x, t)


def _stage(w, x):
    return jnp.tanh(x @ w)


def _loss(head, y, t):
    return jnp.mean((y @ head - t) ** 2)


@pytest.fixture
def pipe2(mesh_factory):
    mesh = mesh_factory(data=4, pipe=2)
    rng = np.random.default_rng(5)
    f = jp.pipeline.value_and_grad(_stage, _loss, jp.pipeline.one_f_one_b(2, 2), mesh=mesh)
    w = rng.normal(size=(2, 8, 8)).astype(np.float32)
    head = rng.normal(size=(8,)).astype(np.float32)
    return f, w, head, rng, mesh


def test_value_and_grad_needs_a_floating_x(pipe2):
    f, w, head, rng, mesh = pipe2
    x = rng.integers(0, 5, (16, 8)).astype(np.int32)
    with pytest.raises(TypeError, match="x has dtype int32: it must be a floating array .*differentiates with "
                                        "respect to x"):
        f(w, head, x, rng.normal(size=(16,)).astype(np.float32))


def test_value_and_grad_needs_one_array_x(pipe2):
    f, w, head, rng, mesh = pipe2
    x = rng.normal(size=(16, 8)).astype(np.float32)
    with pytest.raises(TypeError, match=r"x must be one array \[batch, \.\.\.\] .*got tuple"):
        f(w, head, (x, x), rng.normal(size=(16,)).astype(np.float32))
    apply = jp.pipeline.apply(_stage, jp.pipeline.one_f_one_b(2, 2), mesh=mesh)
    with pytest.raises(TypeError, match=r"x must be one array \[batch, \.\.\.\] .*got dict"):
        apply(w, {"x": x})
