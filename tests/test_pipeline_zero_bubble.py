"""Zero-bubble schedules: ZB-H1 and ZB-V tables, the real B/W split of the backward, and parity.

Parity (DESIGN.md): loss and every gradient per leaf max|got - ref| <= 1e-5 * max|ref| against plain
``jax.value_and_grad`` of the sequential model on one device in float32 (written in the tests, no pipeline
code). The split is checked from the compiled actions' ``cost_analysis`` FLOPs. Run with ``-s`` to see the
errors and ratios reached.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close
from test_pipeline_interleaved import SEED, gpt, gpt_step_parity, run_user_stage
from test_pipeline_runtime import MESHES, check_parity, make_problem, mlp_block, on_one_device, place, sequential

import jaxpar as jp
from jaxpar.pipeline import split as split_lib
from jaxpar.pipeline.analysis import timing
from jaxpar.pipeline.stash import backward_leaves, forward_and_stash, pullback_from_stash, residual_plan
from jaxpar.pipeline.table import ACTIVATIONS, COTANGENTS, NEXT, PREV, SELF, control_table


# ---------------------------------------------------------------------------------------------- tables

def test_zb_h1_ticks_memory_and_bubble_over_a_grid():
    """ZB-H1 with F = B = W = one tick: ``3 m + p - 1`` ticks; every stage holds at most ``p`` microbatches from
    F to W (1F1B's peak); its bubble is below 1F1B's with B = 2 (input and weight gradients in one action)."""
    for p in range(1, 7):
        for m in range(p, 17):
            s = jp.pipeline.zero_bubble(p, m)
            assert s.split_backward and s.num_ticks == 3 * m + p - 1, (p, m, s.num_ticks)
            assert max(s.peak_stash) <= max(jp.pipeline.one_f_one_b(p, m).peak_stash) == p, (p, m, s.peak_stash)
            zb, one = timing(s, {"F": 1, "B": 1, "W": 1}), timing(jp.pipeline.one_f_one_b(p, m))   # 1F1B: B = 2
            assert zb.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
            assert one.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
            assert p == 1 or zb.bubble < one.bubble
    s = jp.pipeline.zero_bubble(4, 8)
    one = timing(jp.pipeline.one_f_one_b(4, 8)).bubble
    print(f"\nZB-H1 p=4 m=8: bubble {s.bubble_fraction:.3f} (1F1B, B=2: {one:.3f}), peak stash {s.peak_stash}, "
          f"B->W stash {s.peak_wstash}")
    # stage s defers its W's by s microbatches: the last stage's W(0) comes after its B(p-1)
    when = s.ticks()
    assert when[("W", 0, 3)] > when[("B", 3, 3)] and when[("W", 0, 0)] == when[("B", 0, 0)] + 1


def test_zb_v_placement_ticks_and_memory():
    """ZB-V: device s holds virtual stages s and 2p-1-s; the loss is on device 0; the turn on the last device is
    a local hand-off; activations go down and up in the same tick. With F = B = W = one tick and p <= 4:
    ``6 m + p - 1`` ticks; peak stash 2p chunk-microbatches per device, i.e. p microbatches of a stage's layers:
    1F1B's peak."""
    for p in range(1, 5):
        for m in range(p, 17):
            s = jp.pipeline.zero_bubble_v(p, m)
            assert s.num_ticks == 6 * m + p - 1, (p, m, s.num_ticks)
            assert max(s.peak_stash) <= 2 * p and max(s.peak_stash) / 2 <= max(jp.pipeline.one_f_one_b(p, m).peak_stash)
    p, m = 4, 8
    s = jp.pipeline.zero_bubble_v(p, m)
    assert s.placement == ((0, 7), (1, 6), (2, 5), (3, 4)) and s.location(2 * p - 1) == (0, 1)
    arrive = control_table(s).actions.arrive_buffer
    assert (arrive[:, p - 1, SELF] == ACTIVATIONS).any() and (arrive[:, p - 1, SELF] == COTANGENTS).any()
    assert (arrive[:, 0, SELF] == COTANGENTS).any()              # the loss cotangent, on device 0
    both = [t for t in range(s.num_ticks) if (arrive[t, :, PREV] == ACTIVATIONS).any()
            and (arrive[t, :, NEXT] == ACTIVATIONS).any()]
    assert both, "no tick sends activations both down and up"
    print(f"\nZB-V p=4 m=8: {s.num_ticks} ticks, bubble {s.bubble_fraction:.3f}, peak stash {s.peak_stash}, "
          f"B->W stash {s.peak_wstash}")


def test_zero_bubble_errors():
    with pytest.raises(ValueError, match=r"zero_bubble needs num_microbatches >= num_stages, got 2 microbatches "
                                         r"for 4 stages"):
        jp.pipeline.zero_bubble(4, 2)
    with pytest.raises(ValueError, match=r"zero_bubble_v needs num_microbatches >= num_stages"):
        jp.pipeline.zero_bubble_v(4, 3)
    with pytest.raises(ValueError, match=r"num_stages=0 must be a positive int"):
        jp.pipeline.zero_bubble_v(0, 3)


# ------------------------------------------------------------------------------------ the B / W split

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
        boxed = jax.eval_shape(model.init, jax.random.key(SEED))
    shapes = nn.meta.unbox(boxed)["blocks"]
    rng = np.random.default_rng(2)
    blocks = jax.tree.map(lambda a: (0.2 * rng.normal(size=a.shape)).astype(a.dtype), shapes)
    x = rng.normal(size=(4, 16, model.cfg.d_model)).astype(np.float32)
    with jp.sharding.use(mesh):
        _check_split("GPT stage, 2 blocks", split_figures(model.stage, blocks, x))


# ---------------------------------------------------------------------------------- user stage function

ZB_CASES = [pytest.param("zb", 2, 4, "d2p2t2", id="zb-p2-m4-d2p2t2"),
            pytest.param("zb", 4, 8, "d2p4", id="zb-p4-m8-d2p4", marks=pytest.mark.slow),
            pytest.param("zb", 4, 8, "p4t2", id="zb-p4-m8-p4t2", marks=pytest.mark.slow),
            pytest.param("zbv", 2, 4, "d2p2t2", id="zbv-p2-m4-d2p2t2"),
            pytest.param("zbv", 4, 8, "d2p4", id="zbv-p4-m8-d2p4", marks=pytest.mark.slow),
            pytest.param("zbv", 4, 8, "p4t2", id="zbv-p4-m8-p4t2", marks=pytest.mark.slow)]
BUILD = {"zb": jp.pipeline.zero_bubble, "zbv": jp.pipeline.zero_bubble_v}


@pytest.mark.parametrize("name,p,m,mesh_name", ZB_CASES)
def test_zero_bubble_user_stage_matches_sequential_reference(name, p, m, mesh_name, mesh_factory):
    got, ref = run_user_stage(BUILD[name](p, m), mesh_factory(**MESHES[mesh_name]), seed=11 + p)
    check_parity(got, ref, f"{name} p={p} m={m} {mesh_name}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zb", "zbv"])
def test_zero_bubble_stash_inputs_matches(name, mesh_factory):
    got, ref = run_user_stage(BUILD[name](2, 4), mesh_factory(**MESHES["d2p2t2"]), seed=13, stash="inputs")
    check_parity(got, ref, f"{name} p=2 m=4 stash=inputs")


def test_zero_bubble_v_apply_matches_sequential_forward(mesh_factory):
    """The forward-only table of the V placement: down the devices and back up, the output on device 0."""
    sched = jp.pipeline.zero_bubble_v(2, 4)
    mesh = mesh_factory(**MESHES["d2p2t2"])
    stage, head, x, t = make_problem(4, 4, seed=17)
    stage_p, _, x_p, _ = place(mesh, jp.pipeline.to_stage_layout(stage, sched), head, x, t)
    y = jp.pipeline.apply(mlp_block, sched, mesh=mesh)(stage_p, x_p)
    print(f"zb-v apply: {assert_tree_close(y, on_one_device(sequential, stage, x), what='apply'):.2e}")


# ------------------------------------------------------------------------------- the GPT, train step

GPT_CASES = [pytest.param("zb", 2, 4, "d2p2t2", id="zb-p2-m4-d2p2t2", marks=pytest.mark.slow),
             pytest.param("zbv", 2, 4, "d2p2t2", id="zbv-p2-m4-d2p2t2", marks=pytest.mark.slow),
             pytest.param("zb", 4, 8, "d2p4", id="zb-p4-m8-d2p4", marks=pytest.mark.slow),
             pytest.param("zbv", 4, 8, "d2p4", id="zbv-p4-m8-d2p4", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,p,m,mesh_name", GPT_CASES)
def test_zero_bubble_gpt_train_step_matches_single_device(name, p, m, mesh_name, mesh_factory):
    gpt_step_parity(BUILD[name](p, m), mesh_factory(**MESHES[mesh_name]), SEED + 5 * p)


def test_split_warns_when_layers_run_in_a_scan():
    """A lax.scan over layers is one equation computing dx and dW together: the split says W gets none of it."""
    def scanned(params, x_BSD):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x_BSD, params["w"])[0]
    rng = np.random.default_rng(6)
    params = {"w": (0.3 * rng.normal(size=(2, 16, 16))).astype(np.float32)}
    with pytest.warns(UserWarning, match=r"runs scan, which the B/W split cannot look inside.*scan_layers=False"):
        split_lib.split_plan(scanned, params, rng.normal(size=(4, 8, 16)).astype(np.float32))
