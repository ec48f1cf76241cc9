"""Pipelines with randomness, evaluation and pruning: keys per microbatch and layer, the eval step through the
pipeline's forward-only table, magnitude pruning of stacked stage-sharded kernels.

References are written out here in plain JAX on one device. The key of the train step is derived from the
seed alone, as ``jp.train.init_state`` documents: ``state_rng = split(key(seed))[1]``, step ``t`` uses
``fold_in(state_rng, t)``; the pipeline's microbatch ``j`` (rows ``j::m``) gets ``fold_in(step key, j)`` and
layer ``l`` inside it ``fold_in(that, l)``. Parity as docs/architecture.md "Tests": per leaf ``max|got - ref| <= 1e-5 *
max|ref|``. Run with ``-s`` to see the errors reached.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SMALL_GPT, assert_scalar_close, assert_tree_close, gpt_batch, gpt_pipeline

import jaxpar as jp
from jaxpar.models import GPT

SEED = 29
D_IN, D, CLASSES, LAYERS, BATCH, M = 8, 16, 5, 4, 16, 4
KEEP = 0.75                      # dropout keep probability
MESH = {"data": 2, "pipe": 2}


# ------------------------------------------------------------------------- a user model with dropout

def init_fn(rng):
    k = jax.random.split(rng, 4)
    return {"embed": {"w": jax.random.normal(k[0], (D_IN, D)) / np.sqrt(D_IN)},
            "blocks": {"w": jax.random.normal(k[1], (LAYERS, D, D)) / np.sqrt(D),
                       "b": 0.1 * jax.random.normal(k[2], (LAYERS, D))},
            "head": {"w": jax.random.normal(k[3], (D, CLASSES)) / np.sqrt(D)}}


def embed_fn(params, x):
    return x @ params["embed"]["w"]


def layer(p, x, key):
    """A residual tanh layer behind inverted dropout: the output depends on the exact key."""
    h = jnp.tanh(x @ p["w"] + p["b"])
    return x + jnp.where(jax.random.bernoulli(key, KEEP, h.shape), h / KEEP, 0.0)


def stage_fn(blocks, x, keys):
    """Any number of stacked layers, layer ``l`` of the slice with ``keys[l]``."""
    return jax.lax.scan(lambda x, pk: (layer(pk[0], x, pk[1]), None), x, (blocks, keys))[0]


def head_loss_fn(params, y, labels):
    logp = jax.nn.log_softmax(y @ params["head"]["w"])
    return -jnp.take_along_axis(logp, labels[:, None], 1).mean(), {}


def data(rng):
    return {"inputs": rng.normal(size=(BATCH, D_IN)).astype(np.float32),
            "targets": rng.integers(0, CLASSES, (BATCH,), dtype=np.int32)}


def step_key(t=0):
    return jax.random.fold_in(jax.random.split(jax.random.key(SEED))[1], t)


def ref_loss(params, x, labels, key):
    """The sequential model on one microbatch: layer ``l`` with ``fold_in(key, l)``, written without jaxpar."""
    h = x @ params["embed"]["w"]
    for l in range(LAYERS):
        h = layer(jax.tree.map(lambda a: a[l], params["blocks"]), h, jax.random.fold_in(key, l))
    logp = jax.nn.log_softmax(h @ params["head"]["w"])
    return -jnp.take_along_axis(logp, labels[:, None], 1).mean()


_REF = jax.jit(jax.value_and_grad(ref_loss))


def reference(params, batch, key, mb_key=jax.random.fold_in):
    """Mean over the m strided microbatches (rows j::m, key ``mb_key(key, j)``) of the loss and gradient."""
    params, batch = jax.device_put((params, batch), jax.devices()[0])
    out = [_REF(params, batch["inputs"][j::M], batch["targets"][j::M], mb_key(key, j)) for j in range(M)]
    out = jax.device_get(out)
    return float(np.mean([l for l, _ in out])), jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *[g for _, g in out])


def trace_of(opt_state):
    """The momentum trace of optax.sgd(momentum) after one step from zero: exactly the step's gradient."""
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
                if isinstance(s, optax.TraceState)).trace


SCHEDULES = {name: functools.partial(jp.pipeline.build, name, 2, M) for name in ("gpipe", "1f1b", "interleaved", "zb")}
SLOW = {"gpipe", "zb", "1f1b"}   # slow only for the fast set's time budget (.ci/run runs them); gpipe and 1f1b
#  (~8 CPU-s): the fused B path that interleaved also runs (with chunks); zb: the split B/W with keys


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in SCHEDULES])
def test_dropout_in_stages_matches_the_sequential_model_with_the_same_keys(name, mesh_factory):
    """One sgd step of a pipeline whose stage function draws dropout masks: the loss and every gradient equal
    the sequential model's mean over microbatches j (rows j::m) with layer l on fold_in(fold_in(step key, j), l);
    keys that ignore the microbatch give another loss and gradient (the test tells the keys apart)."""
    mesh = mesh_factory(**MESH)
    tx = optax.sgd(0.1, momentum=0.9)
    state = jp.train.init_state(init_fn, tx, SEED, mesh=mesh)
    batch = data(np.random.default_rng(SEED))
    params = jax.device_get(state.params)
    loss, grads = reference(params, batch, step_key())
    wrong_loss, wrong_grads = reference(params, batch, step_key(), mb_key=lambda k, j: k)
    assert abs(wrong_loss - loss) > 1e-4 * abs(loss)
    assert max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(wrong_grads), jax.tree.leaves(grads))) > 1e-3

    pipeline = jp.pipeline.Pipeline(embed_fn, stage_fn, head_loss_fn, SCHEDULES[name](), stage_takes_rng=True)
    new_state, metrics = jp.train.make_train_step(pipeline, tx, mesh=mesh)(state, batch)
    e_loss = assert_scalar_close(metrics["loss"], loss, what=f"{name} loss")
    e_grad = assert_tree_close(trace_of(new_state.opt_state), grads, what=f"{name} grads")
    print(f"\n[pipeline dropout {name}] loss {e_loss:.2e}, grads {e_grad:.2e}")


def sequential_loss(params, batch, key):
    """The non-pipelined loss_fn of the same model: the whole stack in one stage_fn call, layer l on
    fold_in(key, l) (the derivation Pipeline documents)."""
    keys = jax.vmap(lambda l: jax.random.fold_in(key, l))(jnp.arange(LAYERS))
    return head_loss_fn(params, stage_fn(params["blocks"], embed_fn(params, batch["inputs"]), keys), batch["targets"])


@pytest.mark.slow  # two more step compiles; the fast tests above check the same keys against plain JAX
def test_pipelined_dropout_step_equals_the_accumulating_non_pipelined_step(mesh_factory):
    """Interleaved 1F1B over m microbatches (pipe=2) and make_train_step(sequential_loss, grad_accum_steps=m)
    on pipe=1 (data=2): the same loss and params after one step on the same params, batch and rng."""
    tx = optax.sgd(0.1, momentum=0.9)
    batch = data(np.random.default_rng(SEED + 3))
    out = []
    for mesh, grad_fn, accum in ((mesh_factory(**MESH), jp.pipeline.Pipeline(
            embed_fn, stage_fn, head_loss_fn, SCHEDULES["interleaved"](), stage_takes_rng=True), 1),
                                 (mesh_factory(data=2), sequential_loss, M)):
        state = jp.train.init_state(init_fn, tx, SEED, mesh=mesh)
        new_state, metrics = jp.train.make_train_step(grad_fn, tx, mesh=mesh, grad_accum_steps=accum)(state, batch)
        out.append(jax.device_get((metrics["loss"], new_state.params)))
    e_loss = assert_scalar_close(out[0][0], out[1][0], what="pipelined vs accumulating loss")
    e_params = assert_tree_close(out[0][1], out[1][1], what="pipelined vs accumulating params")
    print(f"\n[pipeline dropout vs accumulate] loss {e_loss:.2e}, params {e_params:.2e}")


@pytest.mark.slow  # an eval compile of its own; the fast set's budget is spent (.ci/run runs it)
def test_eval_through_the_pipeline_uses_the_train_keys(mesh_factory):
    """make_eval_step(Pipeline) at steps 0 and 3 (interleaved, forward-only table): the reference's mean
    microbatch loss with the train step's keys of that step."""
    mesh = mesh_factory(**MESH)
    state = jp.train.init_state(init_fn, optax.sgd(0.1), SEED, mesh=mesh)
    batch = data(np.random.default_rng(SEED + 1))
    params = jax.device_get(state.params)
    pipeline = jp.pipeline.Pipeline(embed_fn, stage_fn, head_loss_fn, SCHEDULES["interleaved"](),
                                    stage_takes_rng=True)
    eval_step = jp.train.make_eval_step(pipeline, mesh=mesh)
    for t in (0, 3):
        s = state.replace(step=jax.device_put(jnp.asarray(t, jnp.int32), state.step.sharding))
        e = assert_scalar_close(eval_step(s, batch)["loss"], reference(params, batch, step_key(t))[0],
                                what=f"eval loss at step {t}")
        print(f"\n[pipeline eval dropout] step {t}: loss err {e:.2e}")


GPT_CFG = dataclasses.replace(SMALL_GPT, d_model=32, num_heads=4, head_dim=0)   # 2 layers: 1 per stage
GPT_MESH = {"data": 2, "pipe": 2}


def pruning_tx(model):
    names = jax.eval_shape(model.init, jax.random.key(0))
    return optax.chain(optax.sgd(0.1), jp.pruning.magnitude_pruning(0.5, axis_names=names))


@pytest.fixture(scope="module")
def gpt_pipe2(mesh_factory):
    """The narrow GPT's state on data=2 x pipe=2 with sgd + magnitude_pruning(0.5) (shared: the
    tests that use it never donate it), its params on one device, and the model."""
    model = GPT(GPT_CFG)
    mesh = mesh_factory(**GPT_MESH)
    state = jp.train.init_state(model.init, pruning_tx(model), SEED, mesh=mesh)
    return model, mesh, state, jax.device_put(jax.device_get(state.params), jax.devices()[0])


def test_gpt_eval_loss_pipe2_equals_pipe1(gpt_pipe2):
    """The GPT's eval loss and token weight through the pipeline (data=2 x pipe=2, 1F1B over 4
    microbatches) equal those of the same params through the plain GPT loss on one device (pipe=1)."""
    model, mesh, state, params = gpt_pipe2
    batch = gpt_batch(np.random.default_rng(SEED), 16, GPT_CFG)
    loss, aux = jax.device_get(jax.jit(model.loss)(params, batch))
    got = jp.train.make_eval_step(gpt_pipeline(model, jp.pipeline.one_f_one_b(2, 4)), mesh=mesh)(state, batch)
    e = assert_scalar_close(got["loss"], loss, what="pipe=2 eval loss")
    assert float(got["weight"]) == float(aux["weight"]) == batch["targets"].size
    print(f"\n[gpt eval] pipe=2 vs the plain loss on one device: {e:.2e}")


def test_eval_step_rejects_a_grad_fn_that_cannot_evaluate(mesh_factory):
    with pytest.raises(TypeError, match="make_eval_step"):
        jp.train.make_eval_step(jp.grads.value_and_grad(lambda p, b, r: (p, {})), mesh=mesh_factory())


def at(tree, path):
    """The leaf of ``tree`` at a key path from ``tree_flatten_with_path``."""
    return functools.reduce(lambda t, k: t[k.key], path, tree)


def PRUNE_BATCH():
    return gpt_batch(np.random.default_rng(SEED + 2), 16, GPT_CFG)


def pruned_step(model, mesh, grad_fn, state, batch):
    """One train step of the pruning tx, not donating ``state``: (new params, new masks) on the host."""
    new_state, _ = jp.train.make_train_step(grad_fn, pruning_tx(model), mesh=mesh, donate=False)(state, batch)
    return jax.device_get((new_state.params, jp.pruning.masks(new_state.opt_state)))


@pytest.mark.slow  # fast-set time; .ci/run runs it
def test_magnitude_pruning_of_pipelined_gpt_keeps_the_top_half_per_layer(gpt_pipe2):
    """sgd chained with magnitude_pruning(0.5) on the GPT, one step with pipe=2 (1F1B, the stacked kernels and
    their masks split over pipe): each layer's kernel keeps exactly its largest half of |params - 0.1 * grads|
    (numpy top-k of the gradient computed on one device), pruned weights are exactly 0 and the params equal
    the reference update."""
    model, mesh, state, params = gpt_pipe2
    assert all(m.sharding.spec[0] == "pipe" for m in jax.tree.leaves(jp.pruning.masks(state.opt_state)["blocks"]))
    batch = PRUNE_BATCH()
    new_params, masks = pruned_step(model, mesh, gpt_pipeline(model, jp.pipeline.one_f_one_b(2, 4)), state, batch)
    grads = jax.jit(jax.grad(lambda p: model.loss(p, batch)[0]))(params)
    candidate = jax.device_get(jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    pruned = 0
    for path, mask in jax.tree_util.tree_flatten_with_path(masks)[0]:
        where = jax.tree_util.keystr(path)
        c = np.abs(at(candidate, path))
        rows = c.reshape(c.shape[0], -1) if path[0].key == "blocks" else c.reshape(1, -1)   # one tensor per layer
        ref = np.zeros(rows.shape, bool)
        np.put_along_axis(ref, np.argsort(-rows, axis=1)[:, : rows.shape[1] // 2], True, axis=1)
        assert np.array_equal(mask.reshape(rows.shape), ref), f"{where}: the mask is not the top half per layer"
        assert np.all(at(new_params, path)[~mask] == 0.0), f"{where}: a pruned weight is not 0"
        pruned += 1
    assert pruned >= 4   # the blocks' attention and MLP kernels at least
    ref_params = jax.tree.map(lambda c, m: c if m is None else np.where(m, c, 0.0), candidate, masks,
                              is_leaf=lambda x: x is None)
    e = assert_tree_close(new_params, ref_params, what="pipe=2 params")
    print(f"\n[pipeline pruning] {pruned} pruned leaves, masks = top half; params vs reference {e:.2e}")


@pytest.mark.slow  # a second mesh's compile; the fast test above already checks pipe=2 against the reference
def test_magnitude_pruning_pipe2_equals_pipe1(gpt_pipe2, mesh_factory):
    """The same step with pipe=1 (data=2, the plain GPT loss, same tx): the same masks and params as pipe=2."""
    model, mesh, state, _ = gpt_pipe2
    batch = PRUNE_BATCH()
    got = pruned_step(model, mesh, gpt_pipeline(model, jp.pipeline.one_f_one_b(2, 4)), state, batch)
    flat_mesh = mesh_factory(data=2)
    flat = jp.train.init_state(model.init, pruning_tx(model), SEED, mesh=flat_mesh)
    ref = pruned_step(model, flat_mesh, model.loss, flat, batch)
    assert jax.tree.structure(got[1]) == jax.tree.structure(ref[1])
    for (path, m2), m1 in zip(jax.tree_util.tree_flatten_with_path(got[1])[0], jax.tree.leaves(ref[1])):
        assert np.array_equal(m2, m1), f"{jax.tree_util.keystr(path)}: pipe=2 and pipe=1 masks differ"
    e = assert_tree_close(got[0], ref[0], what="pipe=2 vs pipe=1 params")
    print(f"\n[pipeline pruning] pipe=2 vs pipe=1: masks equal, params {e:.2e}")
