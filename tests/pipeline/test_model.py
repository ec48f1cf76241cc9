"""jaxpar/pipeline/staged_model.py: ``Pipeline`` in the train step, ``make_train_step(Pipeline(...), ...)`` with the GPT
on data=2 x pipe=2 x tensor=2 under every schedule, and its errors.

The GPT is given as its three parts (``Pipeline(model.embed, model.stage, model.head_loss, schedule)``); one step
reproduces the single-device float32 loss, gradients and update (tied and untied embeddings, with gradient
accumulation), and five AdamW steps reproduce the pipe=1 run. Run with ``-s`` to see the errors reached.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SMALL_GPT, SMALL_GPT_VARIANT, assert_scalar_close, assert_tree_close, gpt_batch, gpt_pipeline

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig

from .common import BUILD, GPT_STEP_SEED, MESHES, NARROW, gpt_step_parity, trace_of


SEED = 23


MESH = {"data": 2, "pipe": 2, "tensor": 2}


CASES = {  # model config, schedule, microbatches, grad_accum_steps
    "tied-1f1b-m4": (dataclasses.replace(SMALL_GPT, **NARROW), jp.pipeline.one_f_one_b, 4, 1),
    "untied-rotary-scan-gpipe-m2-accum2": (dataclasses.replace(SMALL_GPT_VARIANT, **NARROW), jp.pipeline.gpipe, 2, 2),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if "gpipe" in c else []) for c in CASES])
def test_pipelined_step_matches_single_device(case, mesh_factory):
    cfg, schedule, m, accum = CASES[case]
    model, tx = GPT(cfg), optax.sgd(0.1, momentum=0.9)
    batch = gpt_batch(np.random.default_rng(SEED), 16, cfg)

    mesh = mesh_factory(**MESH)
    state = jp.train.init_state(model.init, tx, SEED, mesh=mesh)
    # stacked layers are split over pipe: stage s holds its own layers (no data moves at the reshape)
    assert all(a.sharding.spec[0] == "pipe" for a in jax.tree.leaves(state.params["blocks"]))

    # the reference: plain JAX and optax on one device (init is layout independent: tests/test_parity.py)
    params = jax.device_put(jax.device_get(state.params), jax.devices()[0])
    (loss, aux), grads = jax.jit(jax.value_and_grad(model.loss, has_aux=True))(params, batch)
    new_params = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
    loss, aux, grads, new_params = jax.device_get((loss, aux, grads, new_params))

    shardings = jax.tree.map(lambda x: x.sharding, state)
    step = jp.train.make_train_step(jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, schedule(2, m)),
                                    tx, mesh=mesh, grad_accum_steps=accum)
    new_state, metrics = step(state, batch)
    assert jax.tree.map(lambda x: x.sharding, new_state) == shardings, "the step changed the state's layout"
    errs = {"loss": assert_scalar_close(metrics["loss"], loss, what=f"{case} loss"),
            "grads": assert_tree_close(trace_of(new_state.opt_state), grads, what=f"{case} grads"),
            "params": assert_tree_close(new_state.params, new_params, what=f"{case} params")}
    assert float(metrics["weight"]) == float(aux["weight"]) == batch["targets"].size
    print(f"\n[pipeline step] {case}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))


@pytest.mark.slow  # heavy (subprocesses or several compiles); .ci/run runs it
def test_five_adamw_steps_pipe2_match_pipe1(mesh_factory):
    """GPT with 4 layers (2 per stage), 1F1B over 4 microbatches, AdamW: losses per step and final params.

    Tolerances: the losses stay within the parity tolerance 1e-5. The params after 5 AdamW steps are compared
    at 2e-4 * max|param|: Adam divides each gradient entry by its own running RMS, so an entry whose gradient
    is tiny turns a float-rounding difference of the gradient (from the different reduction order) into a
    visible difference of the update. (Measured at XLA's level 3: pipe=2 1.3e-4 and the plain data=8 layout, no
    pipeline, 6.0e-5 from the single device after the same 5 steps, with XLA:CPU's loops running the reductions,
    jaxpar's CPU compile option; 3.4e-5 and 4.6e-5 with YNNPACK running them, XLA's default. Both leave the
    losses within 1e-5.)
    """
    cfg = GPTConfig(vocab_size=61, num_layers=4, num_heads=4, d_model=32, max_seq_len=16)
    model, tx = GPT(cfg), optax.adamw(3e-3)
    batches = [gpt_batch(np.random.default_rng(SEED + 1), 16, cfg)] * 5    # one batch: the loss must fall

    def train(state, mesh, pipeline):
        step = jp.train.make_train_step(pipeline or model.loss, tx, mesh=mesh, donate=False)
        losses = []
        for b in batches:
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
        return losses, jax.device_get(state.params)

    mesh, one = mesh_factory(**MESH), mesh_factory()
    state = jp.train.init_state(model.init, tx, SEED, mesh=mesh)
    ref_state = jax.device_put(state, jax.sharding.NamedSharding(one, jax.sharding.PartitionSpec()))
    ref_losses, ref_params = train(ref_state, one, None)
    losses, params = train(state, mesh, gpt_pipeline(model, jp.pipeline.one_f_one_b(2, 4)))
    assert ref_losses[-1] < ref_losses[0]
    loss_err = max(assert_scalar_close(g, r, what=f"step {i} loss") for i, (g, r) in enumerate(zip(losses, ref_losses)))
    param_err = assert_tree_close(params, ref_params, rtol=2e-4, what="params after 5 AdamW steps")
    print(f"\n[pipe=2 vs pipe=1, 5 AdamW steps] loss {loss_err:.2e}, params {param_err:.2e}")


def test_loss_scale_reaches_the_backward(mesh_factory):
    """The train step's loss scale multiplies the pipelined gradients (it enters at the loss cotangent), for a
    model given as three plain functions (an embedding matrix, tanh layers, a squared-error head)."""
    mesh = mesh_factory(**MESH)
    rng = np.random.default_rng(SEED)
    params = {"emb": rng.normal(size=(8, 16)).astype(np.float32), "head": rng.normal(size=(16,)).astype(np.float32),
              "layers": rng.normal(size=(4, 16, 16)).astype(np.float32) / 4}
    pipeline = jp.pipeline.Pipeline(
        lambda p, x: x @ p["emb"], lambda w, x: jax.lax.fori_loop(0, w.shape[0], lambda i, x: jnp.tanh(x @ w[i]), x),
        lambda p, y, t: (jnp.mean(jnp.square(y @ p["head"] - t)), None), jp.pipeline.one_f_one_b(2, 2),
        stage_key="layers")
    ctx = jp.grads.Context(mesh)
    batch = {"inputs": rng.normal(size=(8, 8)).astype(np.float32), "targets": rng.normal(size=(8,)).astype(np.float32)}
    pipeline.check_mesh(mesh)
    pipeline.check(params, batch, ctx)
    with jp.sharding.use(mesh):
        run = jax.jit(lambda p, b, s: pipeline(p, b, None, s, ctx))
        (l1, aux, g1), (l8, _, g8) = run(params, batch, 1.0), run(params, batch, 8.0)
    assert float(l1) == float(l8) and aux == {}
    assert_tree_close(g8, jax.tree.map(lambda g: 8 * g, g1), what="scaled grads")
    ref_loss, ref_grads = jax.value_and_grad(lambda p: pipeline.head_loss_fn(p, jax.lax.fori_loop(
        0, 4, lambda i, x: jnp.tanh(x @ p["layers"][i]), batch["inputs"] @ p["emb"]), batch["targets"])[0])(params)
    assert_scalar_close(l1, ref_loss, what="three-part loss")
    assert_tree_close(g1, ref_grads, what="three-part grads")


INTERLEAVED_GPT_CASES = [pytest.param(2, 4, 2, "d2p2t2", id="p2-m4-v2-d2p2t2", marks=pytest.mark.slow),   # notebook 03 checks it fast
             pytest.param(4, 8, 2, "d2p4", id="p4-m8-v2-d2p4", marks=pytest.mark.slow),
             pytest.param(2, 8, 4, "d2p2t2", id="p2-m8-v4-d2p2t2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("p,m,v,mesh_name", INTERLEAVED_GPT_CASES)
def test_interleaved_gpt_train_step_matches_single_device(p, m, v, mesh_name, mesh_factory):
    gpt_step_parity(jp.pipeline.interleaved_1f1b(p, m, v), mesh_factory(**MESHES[mesh_name]), GPT_STEP_SEED + p * v)


ZERO_BUBBLE_GPT_CASES = [pytest.param("zb", 2, 4, "d2p2t2", id="zb-p2-m4-d2p2t2", marks=pytest.mark.slow),
             pytest.param("zbv", 2, 4, "d2p2t2", id="zbv-p2-m4-d2p2t2", marks=pytest.mark.slow),
             pytest.param("zb", 4, 8, "d2p4", id="zb-p4-m8-d2p4", marks=pytest.mark.slow),
             pytest.param("zbv", 4, 8, "d2p4", id="zbv-p4-m8-d2p4", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,p,m,mesh_name", ZERO_BUBBLE_GPT_CASES)
def test_zero_bubble_gpt_train_step_matches_single_device(name, p, m, mesh_name, mesh_factory):
    gpt_step_parity(BUILD[name](p, m), mesh_factory(**MESHES[mesh_name]), GPT_STEP_SEED + 5 * p)


# ----------------------------------------------------------------------------------------------- errors

# ~30 s each (compiles): slow; the user-stage case in test_interpreter.py (p2-m4) is the fast sibling
DUALPIPE_V_GPT_CASES = [pytest.param(2, 4, "d2p2t2", id="p2-m4-d2p2t2", marks=pytest.mark.slow),
                        pytest.param(4, 8, "d2p4", id="p4-m8-d2p4", marks=pytest.mark.slow)]


@pytest.mark.parametrize("p,m,mesh_name", DUALPIPE_V_GPT_CASES)
def test_dualpipe_v_gpt_train_step_matches_single_device(p, m, mesh_name, mesh_factory):
    """The GPT through make_train_step(Pipeline(...)) under DualPipeV beside data=2: loss, gradients, update."""
    gpt_step_parity(jp.pipeline.dualpipe_v(p, m), mesh_factory(**MESHES[mesh_name]), GPT_STEP_SEED + 7 * p)


@pytest.fixture(scope="module")
def refused(mesh_factory):
    """``(model, tx, mesh, state)``: the GPT's state on data=2 x pipe=2 x tensor=2, built (compiled) once for the
    tests of refused inputs, whose steps raise before they run (so nothing is donated)."""
    mesh, model, tx = mesh_factory(**MESH), GPT(SMALL_GPT), optax.sgd(0.1)
    return model, tx, mesh, jp.train.init_state(model.init, tx, SEED, mesh=mesh)


def test_errors(refused):
    model, tx, mesh, state = refused
    with pytest.raises(ValueError, match=r"the mesh has pipe=2 but the step's gradient function does not pipeline"):
        jp.train.make_train_step(model.loss, tx, mesh=mesh)
    with pytest.raises(ValueError, match=r"the mesh has pipe=2 but schedule '1f1b' has num_stages=4"):
        jp.train.make_train_step(gpt_pipeline(model, jp.pipeline.one_f_one_b(4, 4)), tx, mesh=mesh)
    with pytest.raises(TypeError, match=r"make_train_step needs a loss_fn\(params, batch, rng\) -> \(loss, aux\) or "
                                        r"a jp.grads.GradFn"):
        jp.train.make_train_step(jp.pipeline.gpipe(2, 2), tx, mesh=mesh)
    with pytest.raises(ValueError, match=r"forward-only"):
        gpt_pipeline(model, jp.pipeline.gpipe(2, 2).forward_only())

    pipeline, ctx = gpt_pipeline(model, jp.pipeline.gpipe(2, 4)), jp.grads.Context(mesh)
    with jp.sharding.use(mesh):
        boxed = jax.eval_shape(model.init, jax.random.key(0))
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), nn.meta.unbox(boxed))
    three = {**params, "blocks": jax.tree.map(lambda a: np.concatenate([a, a[:1]]), params["blocks"])}
    with pytest.raises(ValueError, match=r"its layers axis is not divisible by num_stages = 2"):
        pipeline.check(three, gpt_batch(np.random.default_rng(0), 16), ctx)
    with pytest.raises(ValueError, match=r"microbatch 3 \(batch 12 / 4 microbatches\) is not divisible by "
                                         r"data\*fsdp = 2; use a batch that is a multiple of 8"):
        jp.train.make_train_step(pipeline, tx, mesh=mesh)(state, gpt_batch(np.random.default_rng(0), 12))
    with pytest.raises(ValueError, match=r"batch 6 is not divisible by num_microbatches = 4.*one of the "
                                         r"grad_accum_steps = 2"):
        jp.train.make_train_step(pipeline, tx, mesh=mesh, grad_accum_steps=2)(
            state, gpt_batch(np.random.default_rng(0), 12))
    with pytest.raises(ValueError, match=r"'layers' dimension \(3\) is not divisible by pipe = 2"):
        jp.train.init_state(GPT(GPTConfig(**{**SMALL_GPT.__dict__, "num_layers": 3})).init, tx, SEED, mesh=mesh)
    widen = jp.pipeline.Pipeline(model.embed, lambda p, x: jnp.concatenate([x, x], -1), model.head_loss,
                                 jp.pipeline.gpipe(2, 4))
    with pytest.raises(ValueError, match=r"stage_fn maps a microbatch float32\[4, 16, 64\] to float32\[4, 16, 128\]"):
        widen.check(params, gpt_batch(np.random.default_rng(0), 16), ctx)


def test_float_tokens_into_a_gpt_pipeline_name_the_dtype(refused):
    model, tx, mesh, state = refused
    pipeline = jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, jp.pipeline.one_f_one_b(2, 2))
    # the pipeline's own check (any embed_fn); by default the GPT's check_batch would raise first (test_gpt)
    step = jp.train.make_train_step(pipeline, tx, mesh=mesh, check_batch=None)
    rng = np.random.default_rng(2)
    batch = {"inputs": rng.normal(size=(8, 16)).astype(np.float32),
             "targets": rng.integers(0, SMALL_GPT.vocab_size, (8, 16)).astype(np.int32)}
    with pytest.raises(TypeError, match=r"batch\['inputs'\] has dtype float32.*token ids must be integers"):
        step(state, batch)


def test_pipeline_refuses_packed_batches(refused):
    """Packed documents' entries are not carried through the stages yet: a clear error, not attention across
    documents."""
    model, tx, mesh, state = refused
    pipe = gpt_pipeline(model, jp.pipeline.gpipe(2, 2))
    step = jp.train.make_train_step(pipe, tx, mesh=mesh)
    batch = gpt_batch(np.random.default_rng(0), 4, SMALL_GPT)
    batch["segment_ids"] = np.ones_like(batch["inputs"])
    with pytest.raises(ValueError, match="segment_ids.*pipeline"):
        step(state, batch)
