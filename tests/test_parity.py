"""Parity, the core test: every parallel layout reproduces the single-device float32 step.

For each model and layout, one training step under jaxpar (init_state + make_train_step on the layout's mesh)
is compared with a reference computed without jaxpar's step: ``jax.value_and_grad(loss_fn)`` on the params
fetched to the host and a plain optax ``tx.update``. Compared: the initial params (init must be layout
independent, exactly), the loss, the gradients (computed directly in the sharded layout, and as the momentum
trace the step leaves in its optimizer state), the metrics' grad norm, and the updated params.

Tolerance (docs/architecture.md, "Tests"): per leaf max|got - ref| <= 1e-5 * max|ref| (helpers.RTOL); elementwise rtol cannot
hold when the layout changes the reduction order. Run with ``-s`` to see the errors reached.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    SMALL_GPT,
    SMALL_GEMMA3,
    SMALL_GPT_VARIANT,
    SMALL_LLAMA,
    SMALL_QWEN3,
    assert_scalar_close,
    assert_tree_close,
    gpt_batch,
    gpt_parts,
    mlp_batch,
    mlp_parts,
)

import jaxpar as jp

SEED = 17
LR, MOMENTUM = 0.1, 0.9

LAYOUTS = {
    "data8": dict(data=8),
    "fsdp8": dict(data=1, fsdp=8),
    "tensor8": dict(data=1, tensor=8),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
}
MODELS = {
    "mlp": (mlp_parts, lambda rng: mlp_batch(rng, 32)),
    "gpt": (lambda: gpt_parts(SMALL_GPT), lambda rng: gpt_batch(rng, 16, SMALL_GPT)),
    "gpt_rotary_untied_scan": (lambda: gpt_parts(SMALL_GPT_VARIANT), lambda rng: gpt_batch(rng, 16, SMALL_GPT_VARIANT)),
    # GQA (8 query heads, 2 key/value heads), Llama 3 rope scaling, untied: the key/value heads stay replicated
    "llama": (lambda: gpt_parts(SMALL_LLAMA), lambda rng: gpt_batch(rng, 16, SMALL_LLAMA)),
    # q/k norms, head_dim 16 beside d_model / heads = 8 (jaxpar/models/families.py)
    "qwen3": (lambda: gpt_parts(SMALL_QWEN3), lambda rng: gpt_batch(rng, 16, SMALL_QWEN3)),
    # local (window 5 < 16) and global layers alternating, scanned by repeats of the pair; post-norms, GeGLU
    "gemma3": (lambda: gpt_parts(SMALL_GEMMA3), lambda rng: gpt_batch(rng, 16, SMALL_GEMMA3)),
}


def make_tx():
    # SGD with momentum: the step's updated params are params - LR * g, and the momentum trace after one step
    # is exactly the gradient the step used, so the step's own gradient can be read back from opt_state.
    return optax.sgd(LR, momentum=MOMENTUM)


def trace_of(opt_state):
    """The momentum trace (= the first step's gradient) inside optax.sgd's state."""
    traces = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
              if isinstance(s, optax.TraceState)]
    assert len(traces) == 1, opt_state
    return traces[0].trace


class Reference:
    """The single-device reference of one model: init on a 1-device mesh, then plain JAX and optax."""

    def __init__(self, name: str, ref_mesh):
        parts, make_batch = MODELS[name]
        self.init_fn, self.loss_fn = parts()
        self.batch = make_batch(np.random.default_rng(SEED))
        self.tx = make_tx()
        state = jp.train.init_state(self.init_fn, self.tx, SEED, mesh=ref_mesh)
        self.params = jax.device_get(state.params)                   # numpy, unsharded
        (loss, aux), grads = jax.jit(jax.value_and_grad(self.loss_fn, has_aux=True))(
            self.params, self.batch, jax.random.key(0))
        self.loss, self.aux, self.grads = jax.device_get((loss, aux, grads))
        updates, opt_state = self.tx.update(self.grads, self.tx.init(self.params), self.params)
        self.new_params = jax.device_get(optax.apply_updates(self.params, updates))
        self.grad_norm = float(np.sqrt(sum(np.sum(np.square(g.astype(np.float64)))
                                           for g in jax.tree.leaves(self.grads))))
        assert np.isfinite(self.loss) and self.grad_norm > 0


@pytest.fixture(scope="module")
def reference(mesh_factory):
    return functools.cache(lambda name: Reference(name, mesh_factory()))


def _assert_layout_is_used(state, layout):
    """Guards the test itself: outside data parallelism, some parameter must really be split."""
    split = [x for x in jax.tree.leaves(state.params) if x.addressable_shards[0].data.shape != x.shape]
    if layout == "data8":
        assert not split
    else:
        assert split, f"{layout}: no parameter is sharded"


# The GPTs run every layout in the slow set; the fast set keeps the GPT's 2x2x2 case and every layout of the MLP
# (the Llama's 2x2x2 case is slow too: its fast siblings are tests/test_attention.py's Llama over fsdp x context
# and tests/models/test_llama.py against transformers).
CASES = [pytest.param(model, layout, id=f"{model}-{layout}",
                      marks=[pytest.mark.slow] if (model != "mlp" and layout != "data2_fsdp2_tensor2")
                      or model in ("gpt_rotary_untied_scan", "llama", "qwen3", "gemma3")
                      else [])
         for model in MODELS for layout in LAYOUTS]


@pytest.mark.parametrize("model,layout", CASES)
def test_one_step_matches_single_device(model, layout, reference, mesh_factory):
    ref = reference(model)
    mesh = mesh_factory(**LAYOUTS[layout])
    state = jp.train.init_state(ref.init_fn, ref.tx, SEED, mesh=mesh)
    _assert_layout_is_used(state, layout)

    # init is layout independent, bit for bit
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), ref.params)

    # gradients computed directly in the sharded layout, under jaxpar's mesh + rules context
    batch = jp.train.shard_batch(ref.batch, mesh)
    with jp.sharding.use(mesh):
        (loss, _), grads = jax.jit(jax.value_and_grad(ref.loss_fn, has_aux=True))(
            state.params, batch, jax.random.key(0))
    errs = {"loss (direct)": assert_scalar_close(loss, ref.loss, what=f"{model}/{layout} direct loss"),
            "grads (direct)": assert_tree_close(grads, ref.grads, what=f"{model}/{layout} direct grads")}

    # one jaxpar training step (the input state is donated: nothing of it is read afterwards)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step = jp.train.make_train_step(ref.loss_fn, ref.tx, mesh=mesh)
    new_state, metrics = step(state, ref.batch)
    assert int(new_state.step) == 1
    assert jax.tree.map(lambda x: x.sharding, new_state) == shardings, "the step changed the state's layout"
    errs["loss (step)"] = assert_scalar_close(metrics["loss"], ref.loss, what=f"{model}/{layout} step loss")
    errs["grad_norm"] = assert_scalar_close(metrics["grad_norm"], ref.grad_norm, what=f"{model}/{layout} grad norm")
    for key in set(ref.aux) - {"weight"}:
        errs[key] = assert_scalar_close(metrics[key], ref.aux[key], what=f"{model}/{layout} {key}")
    np.testing.assert_equal(float(metrics["weight"]), float(ref.aux["weight"]))
    errs["grads (step)"] = assert_tree_close(trace_of(new_state.opt_state), ref.grads,
                                             what=f"{model}/{layout} step grads")
    errs["params"] = assert_tree_close(new_state.params, ref.new_params, what=f"{model}/{layout} params")
    print(f"\n[parity] {model:>22} {layout:>20}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))


# ------------------------------------------------------------------------------- gradient accumulation

ACCUM_MESH = dict(data=2, fsdp=2, tensor=2)


def _masked_loss(model):
    """Mean cross-entropy over the tokens where ``mask`` is 1; ``weight`` = the number of such tokens."""
    def loss_fn(params, batch, rng):
        del rng
        logits = model.apply(params, batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        mask = batch["mask"].astype(jnp.float32)
        weight = mask.sum()
        return (ce * mask).sum() / weight, {"weight": weight}
    return loss_fn


def _plain_reference(loss_fn, params, batch, tx):
    (loss, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch, jax.random.key(0))
    updates, _ = tx.update(grads, tx.init(params), params)
    return jax.device_get((loss, aux, grads, optax.apply_updates(params, updates)))


@pytest.mark.parametrize("cfg", [SMALL_GPT, pytest.param(SMALL_LLAMA, marks=pytest.mark.slow)], ids=["gpt", "llama"])
def test_grad_accumulation_matches_one_big_step(cfg, mesh_factory):
    """grad_accum_steps=4 on a batch of 32 is one step on the whole batch (GPT and Llama, data=2 x fsdp=2 x
    tensor=2)."""
    mesh = mesh_factory(**ACCUM_MESH)
    init_fn, loss_fn = gpt_parts(cfg)
    tx = make_tx()
    batch = gpt_batch(np.random.default_rng(SEED + 1), 32, cfg)
    state = jp.train.init_state(init_fn, tx, SEED, mesh=mesh)
    params = jax.device_get(state.params)
    loss, _, grads, new_params = _plain_reference(loss_fn, params, batch, tx)

    results = {}
    for k in (1, 4):
        step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, grad_accum_steps=k, donate=False)
        results[k] = jax.device_get(step(state, batch))
    errs = {}
    for k, (new_state, metrics) in results.items():
        errs[f"k={k} loss"] = assert_scalar_close(metrics["loss"], loss, what=f"accum {k} loss")
        errs[f"k={k} grads"] = assert_tree_close(trace_of(new_state.opt_state), grads, what=f"accum {k} grads")
        errs[f"k={k} params"] = assert_tree_close(new_state.params, new_params, what=f"accum {k} params")
        assert float(metrics["weight"]) == batch["targets"].size
    # and the two jaxpar steps agree with each other
    errs["k=4 vs k=1"] = assert_tree_close(results[4][0].params, results[1][0].params, what="accum 4 vs 1")
    print("\n[accum] " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))


@pytest.mark.slow  # the fast set keeps test_grad_accumulation_matches_one_big_step; .ci/run runs it
def test_grad_accumulation_weights_microbatches(mesh_factory):
    """With a masked-token loss whose token count differs between microbatches, accumulation weights each
    microbatch by its ``aux["weight"]`` and gives the whole-batch token mean, not the mean of the means."""
    mesh = mesh_factory(**ACCUM_MESH)
    steps = 4
    model = jp.models.GPT(SMALL_GPT)
    loss_fn = _masked_loss(model)
    tx = make_tx()
    rng = np.random.default_rng(SEED + 2)
    batch = gpt_batch(rng, 32, SMALL_GPT)
    # microbatch j holds rows j::steps; give each a very different mask density
    density = np.array([0.1, 0.35, 0.7, 1.0])[np.arange(32) % steps]
    mask = rng.random((32, SMALL_GPT.max_seq_len)) < density[:, None]
    mask[:, 0] = True                                    # no microbatch (or row) is empty
    batch["mask"] = mask.astype(np.int32)
    state = jp.train.init_state(model.init, tx, SEED, mesh=mesh)
    params = jax.device_get(state.params)
    loss, aux, grads, new_params = _plain_reference(loss_fn, params, batch, tx)

    # the test is sensitive: the unweighted mean of the microbatch means is far from the token mean
    micro = [jax.device_get(jax.jit(loss_fn)(params, jax.tree.map(lambda x: x[j::steps], batch), None)[0])
             for j in range(steps)]
    assert abs(np.mean(micro) - loss) > 1e-3 * abs(loss), (micro, loss)

    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, grad_accum_steps=steps)
    new_state, metrics = jax.device_get(step(state, batch))
    errs = {"loss": assert_scalar_close(metrics["loss"], loss, what="weighted accum loss"),
            "grads": assert_tree_close(trace_of(new_state.opt_state), grads, what="weighted accum grads"),
            "params": assert_tree_close(new_state.params, new_params, what="weighted accum params")}
    assert float(metrics["weight"]) == mask.sum() == float(aux["weight"])
    print("\n[weighted accum] " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
