"""Communication once per step: the pipelined GPT step reduces parameter gradients over the batch axes after
the tick loop, never inside it (read from the compiled HLO), and the fsdp gather options match one device.

The HLO reader is ``benchmarks/pipeline_comm.py``'s :func:`collectives` (the benchmark prints the full
evidence: collectives inside/outside the loop, replica groups, executed bytes, before/after).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import SMALL_GPT, assert_scalar_close, assert_tree_close, gpt_batch, load_script

import jaxpar as jp
from jaxpar.models import GPT

comm = load_script("benchmarks/pipeline_comm.py", "pipeline_comm")

CFG = dataclasses.replace(SMALL_GPT, num_layers=2, d_model=32, num_heads=4, head_dim=0)
SEED = 5


def _step(mesh, m, **kwargs):
    model, tx = GPT(CFG), optax.sgd(0.1, momentum=0.9)
    pipe = jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, jp.pipeline.one_f_one_b(2, m), **kwargs)
    return model, tx, jp.train.make_train_step(pipe, tx, mesh=mesh, donate=False)


def _grad_reductions_in_loop(mesh, m, **kwargs):
    model, tx, step = _step(mesh, m, **kwargs)
    state = jp.train.init_state(model.init, tx, SEED, mesh=mesh)
    hlo = step.lower(state, gpt_batch(np.random.default_rng(SEED), 4 * m, CFG)).compile().as_text()
    colls = comm.collectives(hlo, mesh)
    assert any(c["where"] == "loop" for c in colls), "no collective found in the tick loop: the HLO reader is broken"
    return comm.summarize(colls)


@pytest.mark.slow  # ~18 s; test_fsdp_gather_options checks the same on fsdp meshes; .ci/run runs it
def test_no_gradient_reduction_inside_tick_loop(mesh_factory):
    """data=2 x pipe=2 x tensor=2: the old path (GSPMD inside each B) has batch-axis gradient all-reduces in the
    while body; the default path has none there (only a scalar loss-weight psum) and one after the loop."""
    mesh = mesh_factory(data=2, pipe=2, tensor=2)
    old = _grad_reductions_in_loop(mesh, 4, grad_reduce="action")
    new = _grad_reductions_in_loop(mesh, 4)
    assert old["grad_in_loop"] > 0, old["by_kind"]
    assert new["grad_in_loop"] == 0, new["by_kind"]
    assert new["batch_bytes_executed_in_loop"] <= 8 * 10, new["by_kind"]   # scalars only (10 ticks)
    assert any(k.startswith("outside all-reduce over data") for k in new["by_kind"]), new["by_kind"]


@pytest.mark.slow
@pytest.mark.parametrize("gather,axes", [("step", {"data": 2}), ("action", {"data": 2}), ("step", {"tensor": 2})],
                         ids=["step-d2p2f2", "action-d2p2f2", "step-p2f2t2"])
def test_fsdp_gather_options(gather, axes, mesh_factory):
    """data=2 x pipe=2 x fsdp=2 (and pipe=2 x fsdp=2 x tensor=2): no gradient reduction in the loop
    (reduce-scatter over fsdp after it; the weights' all-gathers inside the loop only with 'action'), and one
    step equals the single-device step."""
    mesh = mesh_factory(pipe=2, fsdp=2, **axes)
    r = _grad_reductions_in_loop(mesh, 4, fsdp_gather=gather)
    assert r["grad_in_loop"] == 0, r["by_kind"]
    assert any(k.startswith("outside reduce-scatter over fsdp") for k in r["by_kind"]), r["by_kind"]
    gathers_in_loop = any(k.startswith("loop all-gather over fsdp") for k in r["by_kind"])
    assert gathers_in_loop == (gather == "action"), r["by_kind"]

    model, tx, step = _step(mesh, 4, fsdp_gather=gather)
    state = jp.train.init_state(model.init, tx, SEED, mesh=mesh)
    batch = gpt_batch(np.random.default_rng(SEED + 1), 16, CFG)
    params = jax.device_put(jax.device_get(state.params), jax.devices()[0])
    (loss, _), grads = jax.jit(jax.value_and_grad(model.loss, has_aux=True))(params, batch)
    new_state, metrics = step(state, batch)
    assert_scalar_close(metrics["loss"], jax.device_get(loss), what=f"{gather} loss")
    trace = next(s for s in jax.tree.leaves(new_state.opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
                 if isinstance(s, optax.TraceState)).trace
    assert_tree_close(trace, jax.device_get(grads), what=f"{gather} grads")


def test_fsdp_gather_bad_value():
    model = GPT(CFG)
    with pytest.raises(ValueError, match="fsdp_gather"):
        jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, jp.pipeline.one_f_one_b(2, 4),
                             fsdp_gather="once")


def test_grad_reduce_is_a_validated_option():
    """``Pipeline.grad_reduce`` takes 'step' or 'action' and refuses anything else, naming both."""
    model = GPT(CFG)
    make = lambda v: jp.pipeline.Pipeline.from_model(model, jp.pipeline.one_f_one_b(2, 4), grad_reduce=v)
    assert make("action").grad_reduce == "action" and make("step").grad_reduce == "step"
    with pytest.raises(ValueError, match=r"Pipeline.grad_reduce='once'; use 'step' .* or 'action'"):
        make("once")
