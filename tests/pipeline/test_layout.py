"""jaxpar/pipeline/stage_layout.py: the stage layout of stacked layers, and the training state in it: built by
``init_state(..., pipeline=)``, stepped without moving weights over ``pipe``, checkpointed in model order and
restored under any schedule or ``pipe`` size.

The reference for "model order" is independent of jaxpar's layout code: the stage layout of interleaved 1F1B
at p=2, v=2 is written out here (blocks hold virtual stages 0, 2, 1, 3: Narayanan et al. 2021, sec. 2.2), and
the staged run is compared with the plain (no pipeline) step of jaxpar's sequential GPT loss. Run with ``-s``
to see the figures.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import SMALL_GPT, assert_scalar_close, assert_tree_close, gpt_batch

import jaxpar as jp
from jaxpar.models import GPT

from .common import GPT_STEP_SEED, MESHES, gpt_step_parity, permutes_outside_loops

P = jp.pipeline


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


def test_to_stage_layout_needs_a_schedule():
    with pytest.raises(TypeError, match=r"to_stage_layout takes a jp.pipeline.Schedule, got str 'il'"):
        P.to_stage_layout({"w": np.zeros((4, 2))}, "il")


# ------------------------------------------------------------------------------ the state in the stage layout

SEED = 23


INTERLEAVED_ORDER = [0, 2, 1, 3]     # interleaved_1f1b(2, m, 2): stage 0 holds virtual stages 0, 2; stage 1: 1, 3


def gpt4() -> GPT:
    return GPT(dataclasses.replace(SMALL_GPT, d_model=32, num_heads=4, head_dim=0, num_layers=4))


def optimizer(model: GPT) -> optax.GradientTransformation:
    """AdamW (moments mirror the params) and magnitude pruning (masks mirror the kernels), masks set at step 0."""
    names = jax.eval_shape(model.init, jax.random.key(0))
    return optax.chain(jp.optim.adamw(3e-3, total_steps=20, axis_names=names),
                       jp.pruning.magnitude_pruning(jp.pruning.one_shot(0.5, 0), axis_names=names))


def pipeline(model: GPT, schedule, **kwargs):
    return jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, schedule, **kwargs)


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def blocks_of(state):
    """``(params['blocks'], every optimizer-state subtree of the blocks: mu, nu, masks)`` on the host."""
    opt = jax.tree_util.tree_flatten_with_path(host(state.opt_state))[0]
    return host(state.params["blocks"]), {jax.tree_util.keystr(p): x for p, x in opt if "['blocks']" in
                                          jax.tree_util.keystr(p)}


def assert_bits_equal(got, want, what):
    got, want = jax.tree_util.tree_flatten_with_path(host(got))[0], jax.tree_util.tree_flatten_with_path(host(want))[0]
    assert [p for p, _ in got] == [p for p, _ in want], what
    for (path, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, jax.tree_util.keystr(path))
        assert np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8)), f"{what}{jax.tree_util.keystr(path)} differs"


def state_arrays(state):
    """The state's arrays, typed keys as their key data (to compare bits)."""
    return (state.step, state.params, state.opt_state, jax.random.key_data(state.rng))


@pytest.mark.slow  # ~55 s: three layouts, a checkpoint each; .ci/run runs it
def test_interleaved_checkpoint_restores_under_1f1b_and_without_pipeline(mesh_factory, tmp_path):
    """Interleaved 1F1B (p=2, v=2) on data=2 x pipe=2 x tensor=2, state in its stage layout: 3 steps equal the
    plain step's (loss 1e-5 relative, params/opt_state 1e-5 of the max per leaf); the staged leaves (params,
    AdamW moments, pruning masks) are the model-order ones in blocks 0, 2, 1, 3. Saved, the checkpoint holds
    model order: it restores bit-identically into the interleaved state, and into a 1F1B (pipe=2) and a
    no-pipeline (pipe=1) state equal to the saved state in model order; one more step from each gives the same
    loss (1e-5 relative)."""
    model, mesh, flat_mesh = gpt4(), mesh_factory(data=2, pipe=2, tensor=2), mesh_factory(data=2, tensor=2)
    tx = optimizer(model)
    il, ofob = pipeline(model, jp.pipeline.interleaved_1f1b(2, 4, 2)), pipeline(model, jp.pipeline.one_f_one_b(2, 4))
    state = jp.train.init_state(model.init, tx, SEED, mesh=mesh, pipeline=il)
    ref = jp.train.init_state(model.init, tx, SEED, mesh=flat_mesh)
    assert state.layout is not None and ref.layout is None
    il_step = jp.train.make_train_step(il, tx, mesh=mesh, donate=False)
    flat_step = jp.train.make_train_step(model.loss, tx, mesh=flat_mesh, donate=False)
    batches = [gpt_batch(np.random.default_rng(SEED + t), 16, model.cfg) for t in range(4)]
    errs = []
    for t in range(3):
        (state, m_il), (ref, m_ref) = il_step(state, batches[t]), flat_step(ref, batches[t])
        errs.append(assert_scalar_close(m_il["loss"], m_ref["loss"], what=f"step {t} loss"))
    model_order = jp.train.to_model_order(state)
    staged, unstaged, ref_blocks = blocks_of(state), blocks_of(model_order), blocks_of(ref)
    reorder = lambda tree: jax.tree.map(lambda a: a[INTERLEAVED_ORDER], tree)   # 1 layer per virtual stage
    assert set(staged[1]) == set(ref_blocks[1]) and len(staged[1]) == 2 * 11 + 4   # mu, nu of 11 leaves; 4 masks
    assert_bits_equal(staged, reorder(unstaged), "staged leaves vs model order")
    # model order against the plain step, to 2e-4 of each leaf's max (masks exactly): AdamW divides each
    # element's moment by its own sqrt(nu), so a 1e-7 gradient difference on a near-zero gradient moves that
    # element by up to lr (measured 6e-5 of the max after 3 steps), and later gradients (so mu, nu) follow.
    assert_tree_close(unstaged[1], ref_blocks[1], rtol=2e-4, what="optimizer state in model order")
    assert_tree_close(host(model_order.params), host(ref.params), rtol=2e-4, what="params in model order")
    assert all(np.array_equal(unstaged[1][k], ref_blocks[1][k]) for k in unstaged[1] if "masks" in k)

    with jp.checkpoint.CheckpointManager(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(3, state, force=True)
        back = ckpt.restore(target=jp.train.abstract_state(model.init, tx, mesh=mesh, pipeline=il))
        on_1f1b = ckpt.restore(target=jp.train.abstract_state(model.init, tx, mesh=mesh, pipeline=ofob))
        on_flat = ckpt.restore(target=jp.train.abstract_state(model.init, tx, mesh=flat_mesh))
    assert back.layout == state.layout and on_1f1b.layout is None and on_flat.layout is None
    assert_bits_equal(state_arrays(back), state_arrays(state), "interleaved round trip")
    assert_bits_equal(state_arrays(on_1f1b), state_arrays(model_order), "restored under 1F1B")
    assert_bits_equal(state_arrays(on_flat), state_arrays(model_order), "restored without pipeline")
    ofob_step = jp.train.make_train_step(ofob, tx, mesh=mesh, donate=False)
    losses = {"interleaved": il_step(back, batches[3])[1]["loss"], "1f1b": ofob_step(on_1f1b, batches[3])[1]["loss"],
              "no pipeline": flat_step(on_flat, batches[3])[1]["loss"]}
    for name in ("1f1b", "no pipeline"):
        errs.append(assert_scalar_close(losses[name], losses["interleaved"], what=f"step 4 loss, {name}"))
    print(f"\n[stage-layout checkpoint] losses step 4 {({k: float(v) for k, v in losses.items()})}, max rel err "
          f"{max(errs):.2e}")


@pytest.mark.slow  # ~16 s: three pipelined steps compiled; .ci/run runs it
def test_steps_refuse_a_state_in_another_layout(mesh_factory):
    """A staged state is refused (ValueError, before tracing) by a pipeline of another schedule, by a plain
    loss's train and eval steps and by ``params_layout='model'``; a model-order state by
    ``params_layout='stage'``."""
    model, mesh = gpt4(), mesh_factory(data=2, pipe=2, tensor=2)
    tx = optax.sgd(0.1)
    il = pipeline(model, jp.pipeline.interleaved_1f1b(2, 4, 2))
    staged = jp.train.init_state(model.init, tx, SEED, mesh=mesh, pipeline=il)
    plain = jp.train.init_state(model.init, tx, SEED, mesh=mesh)
    batch = gpt_batch(np.random.default_rng(SEED), 16, model.cfg)
    cases = {"zbv": (pipeline(model, jp.pipeline.zero_bubble_v(2, 4)), staged, "another pipeline"),
             "model": (pipeline(model, il.schedule, params_layout="model"), staged, "params_layout='model'"),
             "stage": (pipeline(model, il.schedule, params_layout="stage"), plain, "model order")}
    for name, (grad_fn, state, words) in cases.items():
        with pytest.raises(ValueError, match=words):
            jp.train.make_train_step(grad_fn, tx, mesh=mesh).lower(state, batch)
    flat = mesh_factory(data=2, tensor=2)
    with pytest.raises(ValueError, match="to_model_order"):
        jp.train.make_eval_step(model.loss, mesh=flat).lower(staged, batch)
    with pytest.raises(ValueError, match="to_model_order"):
        jp.train.make_train_step(model.loss, tx, mesh=flat).lower(staged, batch)
    assert jp.train.to_model_order(staged).layout is None
    with pytest.raises(TypeError, match="pipeline"):
        jp.train.init_state(model.init, tx, SEED, mesh=mesh, pipeline=il.schedule)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["interleaved", "zbv"])
def test_default_state_moves_no_weight_over_pipe(name, mesh_factory):
    """The compiled GPT train step (data=2 x pipe=2 x tensor=2) from ``init_state(..., pipeline=)``: no
    collective-permute or all-to-all outside the tick loop (the loop's permutes carry activations and
    cotangents); from a model-order state the same step permutes weights in and gradients back outside it."""
    model, mesh = gpt4(), mesh_factory(data=2, pipe=2, tensor=2)
    tx = optimizer(model)
    schedule = {"interleaved": jp.pipeline.interleaved_1f1b(2, 4, 2), "zbv": jp.pipeline.zero_bubble_v(2, 4)}[name]
    pl = pipeline(model, schedule)
    batch = gpt_batch(np.random.default_rng(SEED), 16, model.cfg)
    step = jp.train.make_train_step(pl, tx, mesh=mesh)
    counts = {}
    for layout, kwargs in (("stage", {"pipeline": pl}), ("model", {})):
        state = jp.train.abstract_state(model.init, tx, mesh=mesh, **kwargs)
        outside, inside = permutes_outside_loops(step.lower(state, jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)).compile().as_text())
        counts[layout] = (len(outside), inside)
    print(f"\n[{name} permutes outside/inside the tick loop] {counts}")
    assert counts["stage"][0] == 0 and counts["stage"][1] >= 1, counts
    assert counts["model"][0] > 0, counts


@pytest.mark.slow
def test_interleaved_gpt_params_held_in_stage_layout(mesh_factory):
    """``params_layout='stage'``: the state holds the stage layout (``init_state(..., pipeline=pipeline)``);
    the same step in model order, checked through ``from_stage_layout``; and no weight crosses ``pipe`` in the
    step: the compiled step has no collective-permute or all-to-all outside the tick loop (the loop's one
    permute moves the activations and cotangents). (In model order, the same step permutes the weights in and
    the gradients back: measured 22 collective-permutes outside the loop.)"""
    step, state, batch = gpt_step_parity(jp.pipeline.interleaved_1f1b(2, 4, 2), mesh_factory(**MESHES["d2p2t2"]),
                                         GPT_STEP_SEED + 3, "stage")
    outside, inside = permutes_outside_loops(step.lower(state, batch).compile().as_text())
    assert not outside and inside >= 1, (outside[:3], inside)
