"""What the pipeline tests share: the user's stage function and its sequential single-device reference, the
narrow GPT's one-step parity, and the HLO and benchmark readers.

The stage function is the user's (a residual tanh MLP block with a Megatron-split hidden layer), not the
GPT's. Parity (docs/architecture.md, "Tests"): loss and all three gradients per leaf max|got - ref| <= 1e-5 * max|ref|, the
reference being plain ``jax.value_and_grad`` of the whole sequential model on one device in float32 (the
whole-batch mean loss, which equals the mean of the equal-size microbatch losses). The reference's stage
parameters are in model order; a pipeline with chunks gets them through ``to_stage_layout`` and its gradients
come back through ``from_stage_layout``. For the GPT the reference is ``model.loss`` on one device.
"""

from __future__ import annotations

import functools
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import SMALL_GPT, assert_scalar_close, assert_tree_close, gpt_batch, gpt_pipeline, load_script
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar as jp
from jaxpar import _hlo as plan_hlo
from jaxpar.models import GPT


# ------------------------------------------------------------------------------- the user's stage function

D, FF, S, C, MB = 16, 32, 4, 8, 4          # model width, hidden width, sequence, head outputs, microbatch rows


SCHEDULES = {name: functools.partial(jp.pipeline.build, name) for name in ("gpipe", "1f1b")}


MESHES = {"d2p2t2": {"data": 2, "pipe": 2, "tensor": 2}, "d2p4": {"data": 2, "pipe": 4},
          "p4t2": {"pipe": 4, "tensor": 2}}


STAGE_SPECS = {"w_in": P("pipe", None, "tensor"), "b_in": P("pipe", "tensor"), "w_out": P("pipe", "tensor", None)}


def mlp_block(params, x_BSD):
    """The user's stage: ``x + tanh(x @ w_in + b_in) @ w_out`` (hidden layer split over ``tensor``)."""
    h_BSF = jnp.tanh(x_BSD @ params["w_in"] + params["b_in"])
    h_BSF = jax.lax.with_sharding_constraint(h_BSF, P(None, None, "tensor"))
    return x_BSD + h_BSF @ params["w_out"]


def head_loss(head, y_BSD, t_BSC):
    return jnp.mean(jnp.square(y_BSD @ head["w"] + head["b"] - t_BSC))


def make_problem(p, m, seed=0):
    rng = np.random.default_rng(seed + 100 * p + m)
    normal = lambda *shape, scale=1.0: (scale * rng.normal(size=shape)).astype(np.float32)
    stage = {"w_in": normal(p, D, FF, scale=0.3), "b_in": normal(p, FF, scale=0.1),
             "w_out": normal(p, FF, D, scale=0.2)}
    head = {"w": normal(D, C, scale=0.3), "b": normal(C, scale=0.1)}
    return stage, head, normal(MB * m, S, D), normal(MB * m, S, C)


def sequential(stage, x):
    for s in range(stage["w_in"].shape[0]):
        x = mlp_block({k: v[s] for k, v in stage.items()}, x)
    return x


def on_one_device(fn, *args):
    """``jit(fn)(*args)`` on a single device (a 1-device mesh in context for the stage's constraint)."""
    device = jax.devices()[0]
    with jax.set_mesh(jp.make_mesh(devices=[device])):
        return jax.device_get(jax.jit(fn)(*jax.device_put(args, device)))


def reference(stage, head, x, t):
    """Sequential single-device float32: ``jax.value_and_grad`` of the whole model, no pipeline code."""
    loss = lambda stage, head, x: head_loss(head, sequential(stage, x), t)
    return on_one_device(jax.value_and_grad(loss, argnums=(0, 1, 2)), stage, head, x)


def place(mesh, stage, head, x, t):
    stage = {k: jax.device_put(v, NamedSharding(mesh, STAGE_SPECS[k])) for k, v in stage.items()}
    return stage, head, *jp.train.shard_batch((x, t), mesh)


def check_parity(got, ref, what):
    loss, grads = got
    ref_loss, ref_grads = ref
    errs = {"loss": assert_scalar_close(loss, ref_loss, what=f"{what} loss"),
            "g_stage": assert_tree_close(grads[0], ref_grads[0], what=f"{what} g_stage"),
            "g_head": assert_tree_close(grads[1], ref_grads[1], what=f"{what} g_head"),
            "g_x": assert_tree_close(grads[2], ref_grads[2], what=f"{what} g_x")}
    print(f"{what}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    return errs


def run_user_stage(schedule, mesh, seed=0, stash="residuals"):
    """The user's residual MLP over ``V`` virtual stages through ``jp.pipeline.value_and_grad``; returns the
    pipeline's (loss, grads in model order) and the sequential reference's."""
    m, V = schedule.num_microbatches, schedule.num_virtual_stages
    stage, head, x, t = make_problem(V, m, seed=seed)
    ref = reference(stage, head, x, t)
    args = place(mesh, jp.pipeline.to_stage_layout(stage, schedule), head, x, t)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, schedule, mesh=mesh, stash=stash)
    loss, (g_stage, g_head, g_x) = f(*args)
    assert jax.tree.map(lambda g: g.sharding, g_stage) == jax.tree.map(lambda a: a.sharding, args[0])
    return (loss, (jp.pipeline.from_stage_layout(jax.device_get(g_stage), schedule), g_head, g_x)), ref


BUILD = {name: functools.partial(jp.pipeline.build, name) for name in ("zb", "zbv")}


# ------------------------------------------------------------------------------------- the GPT, train step

GPT_STEP_SEED = 41


NARROW = {"d_model": 32, "num_heads": 4, "head_dim": 0}    # the suite's small GPT, narrower: compile time is the cost


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
    state = jp.train.init_state(model.init, tx, GPT_STEP_SEED, mesh=mesh,
                                pipeline=None if params_layout == "model" else pipeline)
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


def permutes_outside_loops(hlo: str) -> tuple[list[str], int]:
    """``(collective-permutes / all-to-alls outside every while loop, as "name in computation", the count inside
    loops)`` of a compiled module's text."""
    outside, inside = [], 0
    for comp, (instrs, depth) in plan_hlo.loop_depths(hlo).items():
        hits = [f"{i.name} in {comp}" for i in instrs
                if i.opcode.removesuffix("-start") in ("collective-permute", "all-to-all")]
        if depth:
            inside += len(hits)
        else:
            outside += hits
    return outside, inside


# ------------------------------------------------------------------------------------------- benchmarks

def pipeline_benchmark():
    return load_script("benchmarks/pipeline_memory.py", "pipeline_memory")
