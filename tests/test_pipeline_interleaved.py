"""Interleaved 1F1B (virtual stages): the table, the stage layout, and parity on the one interpreter.

Parity (DESIGN.md): loss and every gradient per leaf max|got - ref| <= 1e-5 * max|ref| against an
independent reference written in the tests: plain ``jax.value_and_grad`` of the sequential model on one
device in float32 (``test_pipeline_runtime.reference`` for a user's stage function; ``model.loss`` for the
GPT). The reference's stage parameters are in model order; the pipeline gets them through
``to_stage_layout`` and its gradients come back through ``from_stage_layout``. Run with ``-s`` to see the
errors reached.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import optax
import pytest
from helpers import SMALL_GPT, assert_scalar_close, assert_tree_close, gpt_batch, gpt_pipeline
from test_pipeline_runtime import MESHES, check_parity, head_loss, make_problem, mlp_block, on_one_device, place
from test_pipeline_runtime import reference as sequential_reference
from test_pipeline_runtime import sequential

import jaxpar as jp
from jaxpar.models import GPT
from jaxpar.pipeline import B, F, Schedule

SEED = 41
NARROW = {"d_model": 32, "num_heads": 4, "head_dim": 0}    # the suite's small GPT, narrower: compile time is the cost


# ---------------------------------------------------------------------------------------------- tables

def test_interleaved_bubble_ticks_and_stash_over_a_grid():
    """Unit-cost ticks: ``2 (v m + p - 1)`` ticks, bubble ``(p-1)/(v m + p - 1)`` (Narayanan et al. 2021, sec.
    2.2.2: v times below 1F1B's), peak stash ``2 (p-1-s) + (v-1) p + 1`` chunk-microbatches on device ``s``."""
    checked = 0
    for p in range(1, 6):
        for v in range(2, 5):
            for m in range(p, 17, p):
                s = jp.pipeline.interleaved_1f1b(p, m, v)
                assert s.num_ticks == 2 * (v * m + p - 1), (p, m, v)
                assert s.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
                want = tuple(min(2 * (p - 1 - st) + (v - 1) * p + 1, m * v) for st in range(p))
                assert s.peak_stash == want, (p, m, v, s.peak_stash)
                checked += 1
    assert checked > 100
    s, one = jp.pipeline.interleaved_1f1b(4, 8, 2), jp.pipeline.one_f_one_b(4, 8)
    assert s.bubble_fraction == pytest.approx(3 / 19) and s.bubble_fraction < one.bubble_fraction
    assert s.peak_stash == (11, 9, 7, 5)                      # torch's Interleaved1F1B at (4, 8, 2): the same
    assert jp.pipeline.interleaved_1f1b(4, 8, 1).table == one.table


def test_interleaved_places_chunks_round_robin_and_follows_megatron_order():
    s = jp.pipeline.interleaved_1f1b(2, 4, 2)
    assert s.placement == ((0, 2), (1, 3)) and s.num_virtual_stages == 4
    # device 0's forwards: microbatches in rounds of p = 2, chunk 0 then chunk 1
    fwd = [a for row in s.table if (a := row[0]) is not None and a.kind == "F"]
    assert fwd == [F(0, 0), F(1, 0), F(0, 1), F(1, 1), F(2, 0), F(3, 0), F(2, 1), F(3, 1)]
    bwd = [a for row in s.table if (a := row[0]) is not None and a.kind == "B"]
    assert bwd == [B(0, 1), B(1, 1), B(0, 0), B(1, 0), B(2, 1), B(3, 1), B(2, 0), B(3, 0)]
    # a forward on virtual stage 2 (device 0, chunk 1) runs after virtual stage 1 (device 1, chunk 0)
    when = s.ticks()
    assert when[("F", 0, 2)] > when[("F", 0, 1)] > when[("F", 0, 0)]
    fo = s.forward_only()
    assert not fo.has_backward and fo.num_chunks == 2 and fo.placement == s.placement


def test_interleaved_errors():
    with pytest.raises(ValueError, match=r"multiple of num_stages .* got 6 microbatches for 4 stages; use "
                                         r"num_microbatches = 8"):
        jp.pipeline.interleaved_1f1b(4, 6, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"num_chunks=.* must be a positive int"):
            jp.pipeline.interleaved_1f1b(2, 4, bad)


def test_validator_names_chunk_and_virtual_stage():
    """A chunked table that breaks a dependency: the message names tick, stage, chunk and virtual stage."""
    # p=2, v=2, m=1: virtual stage 2 (stage 0 chunk 1) runs before virtual stage 1 (stage 1 chunk 0)
    table = [(F(0, 0), None), (F(0, 1), F(0, 0)), (None, F(0, 1)), (None, B(0, 1)), (B(0, 1), None),
             (None, B(0, 0)), (B(0, 0), None)]
    with pytest.raises(ValueError, match=r"F0\.1 on stage 0 \(chunk 1, virtual stage 2\) at tick 1 needs F0 of "
                                         r"stage 1 \(chunk 0, virtual stage 1\) at an earlier tick, but that runs "
                                         r"at tick 1"):
        Schedule("bad", 2, 1, table, num_chunks=2)
    good = [(F(0, 0), None), (None, F(0, 0)), (F(0, 1), None), (None, F(0, 1)), (None, B(0, 1)), (B(0, 1), None),
            (None, B(0, 0)), (B(0, 0), None)]
    assert Schedule("ok", 2, 1, good, num_chunks=2).num_ticks == 8
    with pytest.raises(ValueError, match=r"placement \(\(0, 2\), \(1, 2\)\) does not hold each virtual stage "
                                         r"0\.\.3 exactly once"):
        Schedule("bad", 2, 1, good, num_chunks=2, placement=((0, 2), (1, 2)))
    with pytest.raises(ValueError, match=r"placement \(\(0, 1, 2\), \(3,\)\) is not 2 rows of 2 entries"):
        Schedule("bad", 2, 1, good, num_chunks=2, placement=((0, 1, 2), (3,)))
    with pytest.raises(ValueError, match=r"B0\.1 never runs on stage 1 \(chunk 1, virtual stage 3\)"):
        Schedule("bad", 2, 1, good[:4] + [(None, None)] + good[5:], num_chunks=2)


def test_stage_layout_round_trip_and_identity():
    rng = np.random.default_rng(0)
    tree = {"w": rng.normal(size=(8, 3, 2)), "b": rng.normal(size=(8,))}
    for sched in (jp.pipeline.gpipe(4, 4), jp.pipeline.one_f_one_b(2, 4)):
        assert jp.pipeline.to_stage_layout(tree, sched) is tree and jp.pipeline.from_stage_layout(tree, sched) is tree
    blocks = lambda a, k: [a[i * k:(i + 1) * k] for i in range(len(a) // k)]
    # round-robin p=2, v=2: stage 0 holds virtual stages 0 and 2, stage 1 holds 1 and 3 (2 layers each)
    il = jp.pipeline.interleaved_1f1b(2, 4, 2)
    out = jp.pipeline.to_stage_layout(tree, il)
    want = blocks(tree["w"], 2)
    np.testing.assert_array_equal(out["w"], np.concatenate([want[0], want[2], want[1], want[3]]))
    # the V placement p=2: stage 0 holds 0 and 3, stage 1 holds 1 and 2
    zbv = jp.pipeline.zero_bubble_v(2, 4)
    np.testing.assert_array_equal(jp.pipeline.to_stage_layout(tree, zbv)["b"],
                                  np.concatenate([tree["b"][0:2], tree["b"][6:8], tree["b"][2:4], tree["b"][4:6]]))
    for sched in (il, zbv, jp.pipeline.interleaved_1f1b(2, 8, 4)):
        back = jp.pipeline.from_stage_layout(jp.pipeline.to_stage_layout(tree, sched), sched)
        jax.tree.map(np.testing.assert_array_equal, back, tree)
    with pytest.raises(ValueError, match=r"params\['w'\] has shape \(6, 2\): its leading \(layers\) axis must "
                                         r"divide into the schedule's 4 virtual stages"):
        jp.pipeline.to_stage_layout({"w": np.zeros((6, 2))}, il)


# ---------------------------------------------------------------------------------- user stage function

INTERLEAVED = [pytest.param(2, 4, 2, "d2p2t2", id="p2-m4-v2-d2p2t2"),
               pytest.param(4, 8, 2, "d2p4", id="p4-m8-v2-d2p4", marks=pytest.mark.slow),
               pytest.param(4, 8, 2, "p4t2", id="p4-m8-v2-p4t2", marks=pytest.mark.slow),
               pytest.param(2, 8, 4, "d2p2t2", id="p2-m8-v4-d2p2t2", marks=pytest.mark.slow)]


def run_user_stage(schedule, mesh, seed=0, stash="residuals"):
    """The user's residual MLP over ``V`` virtual stages through ``jp.pipeline.value_and_grad``; returns the
    pipeline's (loss, grads in model order) and the sequential reference's."""
    m, V = schedule.num_microbatches, schedule.num_virtual_stages
    stage, head, x, t = make_problem(V, m, seed=seed)
    ref = sequential_reference(stage, head, x, t)
    args = place(mesh, jp.pipeline.to_stage_layout(stage, schedule), head, x, t)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, schedule, mesh=mesh, stash=stash)
    loss, (g_stage, g_head, g_x) = f(*args)
    assert jax.tree.map(lambda g: g.sharding, g_stage) == jax.tree.map(lambda a: a.sharding, args[0])
    return (loss, (jp.pipeline.from_stage_layout(jax.device_get(g_stage), schedule), g_head, g_x)), ref


@pytest.mark.parametrize("p,m,v,mesh_name", INTERLEAVED)
def test_interleaved_user_stage_matches_sequential_reference(p, m, v, mesh_name, mesh_factory):
    sched = jp.pipeline.interleaved_1f1b(p, m, v)
    got, ref = run_user_stage(sched, mesh_factory(**MESHES[mesh_name]), seed=p + v)
    check_parity(got, ref, f"interleaved p={p} m={m} v={v} {mesh_name}")


@pytest.mark.slow
def test_interleaved_stash_inputs_matches(mesh_factory):
    got, ref = run_user_stage(jp.pipeline.interleaved_1f1b(2, 4, 2), mesh_factory(**MESHES["d2p2t2"]), seed=7,
                              stash="inputs")
    check_parity(got, ref, "interleaved p=2 m=4 v=2 stash=inputs")


def test_interleaved_apply_matches_sequential_forward(mesh_factory):
    sched = jp.pipeline.interleaved_1f1b(2, 4, 2)
    mesh = mesh_factory(**MESHES["d2p2t2"])
    stage, head, x, t = make_problem(4, 4, seed=9)
    stage_p, _, x_p, _ = place(mesh, jp.pipeline.to_stage_layout(stage, sched), head, x, t)
    y = jp.pipeline.apply(mlp_block, sched, mesh=mesh)(stage_p, x_p)
    print(f"interleaved apply: {assert_tree_close(y, on_one_device(sequential, stage, x), what='apply'):.2e}")


def test_interleaved_stage_params_error(mesh_factory):
    mesh = mesh_factory(**MESHES["d2p2t2"])
    stage, head, x, t = make_problem(2, 4)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, jp.pipeline.interleaved_1f1b(2, 4, 2), mesh=mesh)
    with pytest.raises(ValueError, match=r"stage_params\['b_in'\] has shape \(2, 32\): every leaf needs a "
                                         r"leading axis of exactly num_stages \* num_chunks = 4"):
        f(stage, head, x, t)


# ------------------------------------------------------------------------------- the GPT, train step

def gpt(num_layers: int) -> GPT:
    return GPT(dataclasses.replace(SMALL_GPT, **NARROW, num_layers=num_layers))


def trace_of(opt_state):
    """The momentum trace of optax.sgd(momentum) after one step from zeros: exactly the step's gradient."""
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
                if isinstance(s, optax.TraceState)).trace


def gpt_step_parity(schedule, mesh, seed, params_layout="model"):
    """One ``make_train_step(Pipeline(...))`` step of the GPT with ``V`` layers (one per virtual stage) against
    plain JAX on one device: loss, gradients (the momentum trace), updated params (all in model order)."""
    model, tx = gpt(schedule.num_virtual_stages), optax.sgd(0.1, momentum=0.9)
    batch = gpt_batch(np.random.default_rng(seed), 16, model.cfg)
    pipeline = gpt_pipeline(model, schedule, params_layout=params_layout)
    state = jp.train.init_state(model.init, tx, SEED, mesh=mesh, pipeline=None if params_layout == "model" else pipeline)
    to_model = (lambda t: t) if params_layout == "model" else pipeline.from_stage_layout
    params = jax.device_put(to_model(jax.device_get(state.params)), jax.devices()[0])
    (loss, _), grads = jax.jit(jax.value_and_grad(model.loss, has_aux=True))(params, batch)
    new_params = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
    step = jp.train.make_train_step(pipeline, tx, mesh=mesh)
    new_state, metrics = step(state, batch)
    what = f"{schedule.name} p={schedule.num_stages} m={schedule.num_microbatches} v={schedule.num_chunks}"
    errs = {"loss": assert_scalar_close(metrics["loss"], loss, what=f"{what} loss"),
            "grads": assert_tree_close(to_model(jax.device_get(trace_of(new_state.opt_state))), jax.device_get(grads),
                                       what=f"{what} grads"),
            "params": assert_tree_close(to_model(jax.device_get(new_state.params)), jax.device_get(new_params),
                                        what=f"{what} params")}
    print(f"\n[{what} {params_layout} layout] " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    return step, new_state, batch


GPT_CASES = [pytest.param(2, 4, 2, "d2p2t2", id="p2-m4-v2-d2p2t2"),
             pytest.param(4, 8, 2, "d2p4", id="p4-m8-v2-d2p4", marks=pytest.mark.slow),
             pytest.param(2, 8, 4, "d2p2t2", id="p2-m8-v4-d2p2t2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("p,m,v,mesh_name", GPT_CASES)
def test_interleaved_gpt_train_step_matches_single_device(p, m, v, mesh_name, mesh_factory):
    gpt_step_parity(jp.pipeline.interleaved_1f1b(p, m, v), mesh_factory(**MESHES[mesh_name]), SEED + p * v)


def _permutes_outside_loops(hlo: str) -> tuple[list[str], int]:
    """``(collective-permute / all-to-all lines outside while bodies, the count inside them)`` of HLO text."""
    bodies = {b.lstrip("%") for b in re.findall(r"body=(%?[\w.\-]+)", hlo)}
    outside, inside = [], 0
    for comp in re.split(r"\n(?=\S[^\n]*\{\n)", hlo):
        hits = [line.strip() for line in comp.splitlines()
                if re.search(r"(collective-permute|all-to-all)(-start)?\(", line)]
        header = comp.splitlines()[0] if comp else ""
        if any(re.match(rf"%?{re.escape(b)}\b", header) for b in bodies):
            inside += len(hits)
        else:
            outside += hits
    return outside, inside


@pytest.mark.slow
def test_interleaved_gpt_params_held_in_stage_layout(mesh_factory):
    """``params_layout='stage'``: the state holds the stage layout (``init_state(..., pipeline=pipeline)``);
    the same step in model order, checked through ``from_stage_layout``; and no weight crosses ``pipe`` in the
    step: the compiled step has no collective-permute or all-to-all outside the tick loop (the loop's one
    permute moves the activations and cotangents). (In model order, the same step permutes the weights in and
    the gradients back: measured 22 collective-permutes outside the loop.)"""
    step, state, batch = gpt_step_parity(jp.pipeline.interleaved_1f1b(2, 4, 2), mesh_factory(**MESHES["d2p2t2"]),
                                         SEED + 3, "stage")
    outside, inside = _permutes_outside_loops(step.lower(state, batch).compile().as_text())
    assert not outside and inside >= 1, (outside[:3], inside)
