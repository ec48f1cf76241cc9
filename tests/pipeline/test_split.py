"""jaxpar/pipeline/split.py: the real B/W split of the backward (B: input gradients, W: weight gradients), checked
from the compiled actions' ``cost_analysis`` FLOPs and against ``jax.vjp``. Run with ``-s`` to see the ratios."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close

import jaxpar as jp
from jaxpar.pipeline import split as split_lib
from jaxpar.pipeline.stash import backward_leaves, forward_and_stash, pullback_from_stash, residual_plan

from .common import GPT_STEP_SEED, gpt


def wide_mlp(params, x_BSD):
    """Two residual tanh-MLP layers (the user's kind of stage, wider so that matmuls dominate)."""
    for i in range(params["w_in"].shape[0]):
        x_BSD = x_BSD + jnp.tanh(x_BSD @ params["w_in"][i] + params["b_in"][i]) @ params["w_out"][i]
    return x_BSD


def _compiled(fn, *args):
    """``(compiled executable, its FLOPs from cost_analysis)``."""
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    return compiled, float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def split_figures(stage_fn, params, x):
    """FLOPs of the compiled fused backward, B and W as the interpreter calls them (stash='residuals'), and
    the compiled B and W's results against ``jax.vjp``."""
    rng = np.random.default_rng(3)
    g = rng.normal(size=x.shape).astype(np.float32)
    plan, split = residual_plan(stage_fn, params, x), split_lib.split_plan(stage_fn, params, x)
    res = jax.jit(lambda p, x: forward_and_stash(stage_fn, "residuals", p, x, plan)[1])(params, x)
    leaves = lambda p, x, res: backward_leaves(stage_fn, "residuals", p, x, res, plan)[1]
    fused = lambda p, x, res, g: pullback_from_stash(stage_fn, "residuals", p, x, res, plan)(g)
    b = lambda p, x, res, g: split_lib.backward_input(split, p, x, leaves(p, x, res), g)
    w = lambda p, x, res, carry: split_lib.backward_weight(split, p, x, leaves(p, x, res), carry)
    _, fused_flops = _compiled(fused, params, x, res, g)
    b_exe, b_flops = _compiled(b, params, x, res, g)
    dx, carry, b_dparams = b_exe(params, x, res, g)
    w_exe, w_flops = _compiled(w, params, x, res, carry)
    ref_dparams, ref_dx = jax.jit(lambda p, x, g: jax.vjp(stage_fn, p, x)[1](g))(params, x, g)   # plain jax
    dparams = jax.tree.map(jnp.add, b_dparams, w_exe(params, x, res, carry))   # B's part (on g) plus W's
    assert_tree_close((dparams, dx), (ref_dparams, ref_dx), rtol=1e-6, what="split backward")
    return {"fused": fused_flops, "B": b_flops, "W": w_flops, "carry": [tuple(c.shape) for c in split.carry_structs]}


def _check_split(name, figures):
    ratio_bw, ratio_w = (figures["B"] + figures["W"]) / figures["fused"], figures["W"] / figures["fused"]
    print(f"\n[{name}] FLOPs fused {figures['fused']:.4g}, B {figures['B']:.4g}, W {figures['W']:.4g}: (B+W)/fused "
          f"{ratio_bw:.3f}, W/fused {ratio_w:.3f}; B->W carry {figures['carry']}")
    assert ratio_bw <= 1.1 and ratio_w <= 0.6, figures
    assert ratio_w >= 0.3, figures           # W really holds the weight-gradient matmuls


def test_split_backward_is_real_on_a_user_stage():
    rng = np.random.default_rng(0)
    params = {"w_in": (0.2 * rng.normal(size=(2, 64, 256))).astype(np.float32),
              "b_in": (0.1 * rng.normal(size=(2, 256))).astype(np.float32),
              "w_out": (0.1 * rng.normal(size=(2, 256, 64))).astype(np.float32)}
    _check_split("mlp stage", split_figures(wide_mlp, params, rng.normal(size=(8, 16, 64)).astype(np.float32)))


@jax.custom_vjp
def _clip_grad(w):
    return w


_clip_grad.defvjp(lambda w: (w, None), lambda _, g: (jnp.clip(g, -0.05, 0.05),))


@jax.custom_vjp
def _shift_grad(w):
    return w


_shift_grad.defvjp(lambda w: (w, None), lambda _, g: (2.0 * g + 0.01,))   # affine in the cotangent


def _shifted_weight_stage(params, x_BSD):
    w = _shift_grad(params["w"])
    return jnp.tanh(x_BSD @ w) @ w


def _clipped_weight_stage(params, x_BSD):
    """A weight used twice whose gradient passes a nonlinear custom_vjp rule (a clip of its cotangent)."""
    w = _clip_grad(params["w"])
    return jnp.tanh(x_BSD @ w) @ w


def _reshaped_output_stage(params, x_BSD):
    """The output is a reshape of a matmul (as the GPT's blocks): g reaches the weight gradient as a view."""
    h = jnp.tanh(x_BSD @ params["w1"])
    return (h.reshape(-1, h.shape[-1]) @ params["w2"]).reshape(x_BSD.shape)


@pytest.mark.parametrize("stage_fn,finished", [(_clipped_weight_stage, False), (_shifted_weight_stage, False),
                                               (_reshaped_output_stage, True)],
                         ids=["nonlinear-custom-vjp", "affine-custom-vjp", "reshaped-output"])
def test_split_keeps_g_off_w_only_where_exact(stage_fn, finished):
    """B's part (the products on g) plus W's is jax.vjp's gradient. Where the equations after the products are
    not linear in the cotangents (a clip in a custom_vjp rule), g is handed to W instead; where the output is a
    view of a matmul, neither g nor its view is."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, 8, 16)).astype(np.float32)
    g = rng.normal(size=x.shape).astype(np.float32)
    params = {"w": (0.3 * rng.normal(size=(16, 16))).astype(np.float32)} if stage_fn is not _reshaped_output_stage else {
        "w1": (0.3 * rng.normal(size=(16, 32))).astype(np.float32),
        "w2": (0.3 * rng.normal(size=(32, 16))).astype(np.float32)}
    split = split_lib.split_plan(stage_fn, params, x)
    leaves = jax.tree.leaves(jax.vjp(stage_fn, params, x)[1])
    dx, carry, b_part = split_lib.backward_input(split, params, x, leaves, g)
    w_part = split_lib.backward_weight(split, params, x, leaves, carry)
    ref_dparams, ref_dx = jax.vjp(stage_fn, params, x)[1](g)     # plain jax
    assert_tree_close((jax.tree.map(jnp.add, b_part, w_part), dx), (ref_dparams, ref_dx), rtol=1e-6,
                      what="B part + W part")
    carried = [tuple(c.shape) for c in split.carry_structs]
    assert any(split.b_grads) == finished, split.b_grads
    assert ((x.shape in carried or (32, 16) in carried) != finished), carried


@pytest.mark.slow   # five compiles of two GPT blocks (~20 s)
def test_split_backward_is_real_on_the_gpt_stage(mesh_factory):
    """Two GPT blocks (attention, MLP, LayerNorms under jax.checkpoint): random parameters of the init's shapes."""
    import flax.linen as nn
    model = gpt(2)
    mesh = mesh_factory()
    with jp.sharding.use(mesh):
        boxed = jax.eval_shape(model.init, jax.random.key(GPT_STEP_SEED))
    shapes = nn.meta.unbox(boxed)["blocks"]
    rng = np.random.default_rng(2)
    blocks = jax.tree.map(lambda a: (0.2 * rng.normal(size=a.shape)).astype(a.dtype), shapes)
    x = rng.normal(size=(4, 16, model.cfg.d_model)).astype(np.float32)
    with jp.sharding.use(mesh):
        _check_split("GPT stage, 2 blocks", split_figures(model.stage, blocks, x))


def test_split_warns_when_layers_run_in_a_scan():
    """A lax.scan over layers is one equation computing dx and dW together: the split says W gets none of it."""
    def scanned(params, x_BSD):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x_BSD, params["w"])[0]
    rng = np.random.default_rng(6)
    params = {"w": (0.3 * rng.normal(size=(2, 16, 16))).astype(np.float32)}
    with pytest.warns(UserWarning, match=r"runs scan, which the B/W split cannot look inside.*scan_layers=False"):
        split_lib.split_plan(scanned, params, rng.normal(size=(4, 8, 16)).astype(np.float32))
