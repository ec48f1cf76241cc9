"""Packed documents in the shared layers (jaxpar/layers/) and the GPT / Llama losses (the pipeline's
refusal of packed batches: tests/pipeline/test_model.py).

References are written here: each document run through the model alone (a batch of one, positions from 0, no
segment ids), and the attention weights against a numpy softmax over the keys a query may see. Rows are packed
by hand (documents back to back, segment ids 1..n, 0 padding, positions restarting at each document), not by
jaxpar's pipeline.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SMALL_GPT, SMALL_GPT_VARIANT, SMALL_LLAMA, assert_scalar_close, assert_tree_close, gpt_batch

import jaxpar as jp
from jaxpar.layers.attention import attend as attention

L = 16


def pack_rows(docs_per_row: list[list[np.ndarray]], seq_len: int = L) -> dict[str, np.ndarray]:
    """Rows of documents (token arrays of length n: n - 1 input/target pairs each) packed back to back, padded."""
    batch = {k: np.zeros((len(docs_per_row), seq_len), np.int32)
             for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
    for r, docs in enumerate(docs_per_row):
        at = 0
        for s, doc in enumerate(docs, start=1):
            n = len(doc) - 1
            batch["inputs"][r, at:at + n], batch["targets"][r, at:at + n] = doc[:-1], doc[1:]
            batch["segment_ids"][r, at:at + n], batch["positions"][r, at:at + n] = s, np.arange(n)
            batch["loss_mask"][r, at:at + n] = 1
            at += n
        assert at <= seq_len
    return batch


def random_rows(rng: np.random.Generator, vocab: int) -> tuple[list[list[np.ndarray]], dict[str, np.ndarray]]:
    # documents of 6, 4 and 5 tokens (5 + 3 + 4 = 12 pairs, 4 padding), and 9 + 8 (8 + 7 = 15 pairs, 1 padding)
    lengths = [[6, 4, 5], [9, 8]]
    docs = [[rng.integers(0, vocab, n).astype(np.int32) for n in row] for row in lengths]
    return docs, pack_rows(docs)


def doc_loss_sum(model, params, doc: np.ndarray) -> float:
    """A document's summed next-token cross-entropy, the model run on it alone."""
    loss, aux = jax.jit(model.loss)(params, {"inputs": doc[None, :-1], "targets": doc[None, 1:]})
    return float(loss) * float(aux["weight"])


CONFIGS = {"gpt": SMALL_GPT, "gpt_rotary_untied_scan": SMALL_GPT_VARIANT, "llama": SMALL_LLAMA,
           "gpt_xla_attention": dataclasses.replace(SMALL_GPT, attention="xla", positions="rotary")}


# the fast set keeps the GPT; .ci/run runs the other variants too (a compile per document length)
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n != "gpt" else [])
                                  for n in CONFIGS])
def test_packed_loss_is_the_sum_of_each_documents_loss_alone(name):
    cfg = CONFIGS[name]
    model = cfg.as_model()
    params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, model.init(jax.random.key(3)),
                          is_leaf=lambda x: hasattr(x, "value"))
    rng = np.random.default_rng(11)
    docs, batch = random_rows(rng, cfg.vocab_size)
    loss_fn = jax.jit(model.loss)
    errs = []
    for r, row_docs in enumerate(docs):
        row = {k: v[r:r + 1] for k, v in batch.items()}
        loss, aux = loss_fn(params, row)
        assert float(aux["weight"]) == sum(len(d) - 1 for d in row_docs)
        ref = sum(doc_loss_sum(model, params, d) for d in row_docs)
        errs.append(assert_scalar_close(float(loss) * float(aux["weight"]), ref, rtol=1e-5,
                                        what=f"{name} row {r} summed loss"))
    # the whole batch: the masked mean over every unmasked target
    loss, aux = loss_fn(params, batch)
    total = sum(doc_loss_sum(model, params, d) for row in docs for d in row)
    errs.append(assert_scalar_close(float(loss), total / batch["loss_mask"].sum(), rtol=1e-5,
                                    what=f"{name} batch mean"))
    # the logits of each document's tokens are those of the document alone
    def packed_logits(params, batch):   # jitted: one compile, not a dispatch (and compile) per primitive
        x = model.embed(params, batch["inputs"], batch["positions"])
        return model.logits(params, model.stage(params["blocks"], x, batch["segment_ids"], batch["positions"]))
    logits = jax.jit(packed_logits)(params, batch)
    alone = jax.jit(model.apply)(params, docs[1][1][None, :-1])
    at = len(docs[1][0]) - 1
    V = cfg.vocab_size                                       # padded vocabulary entries are -1.7e38: leave them out
    errs.append(assert_tree_close(np.asarray(logits)[1, at:at + len(docs[1][1]) - 1, :V], np.asarray(alone)[0, :, :V],
                                  rtol=1e-5))
    print(f"\n[packed] {name}: row sums, batch mean, logits: " + ", ".join(f"{e:.1e}" for e in errs))


@pytest.mark.parametrize("impl", ["blocked", "xla"])
def test_attention_weights_across_documents_are_zero(impl):
    """With ``v`` the one-hot of the key index, the attention output is the weight matrix itself."""
    rng = np.random.default_rng(5)
    B, H, K = 2, 2, L                                              # head dim = L: v can be the one-hot of keys
    q, k = (jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32) for _ in range(2))
    v = jnp.broadcast_to(jnp.eye(L, dtype=jnp.float32)[None, :, None, :], (B, L, H, L))
    seg = np.array([[1] * 5 + [2] * 3 + [3] * 4 + [0] * 4, [1] * 8 + [2] * 7 + [0]], np.int32)
    cfg = dataclasses.replace(SMALL_GPT, attention=impl, attention_blocks=3)
    w = np.asarray(jax.jit(lambda q, k, v, s: attention(cfg, q, k, v, s))(q, k, v, jnp.asarray(seg)))
    # numpy reference: softmax over the keys of the query's own document up to itself
    logits = np.einsum("bqhk,bshk->bhqs", np.asarray(q, np.float64), np.asarray(k, np.float64)) / np.sqrt(K)
    visible = (seg[:, :, None] == seg[:, None, :]) & (np.arange(L)[None, :] <= np.arange(L)[:, None])[None]
    logits = np.where(visible[:, None], logits, -np.inf)
    ref = np.exp(logits - logits.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    got = w.transpose(0, 2, 1, 3)                                  # [B, H, Q, S]
    assert np.all(got[~np.broadcast_to(visible[:, None], got.shape)] == 0.0)
    np.testing.assert_allclose(got, ref, atol=1e-6)


def test_padding_only_rows_and_plain_batches():
    """An all-padding row (every target masked) gives a finite loss of 0 and zero gradients; a batch whose
    packing entries say "one document, nothing masked" gives the plain batch's loss and gradients."""
    model = jp.models.GPT(SMALL_GPT)
    params = jax.tree.map(lambda x: x.value, model.init(jax.random.key(0)), is_leaf=lambda x: hasattr(x, "value"))
    rng = np.random.default_rng(2)
    plain = gpt_batch(rng, 2, SMALL_GPT)
    grad = jax.jit(jax.value_and_grad(model.loss, has_aux=True))
    zeros = np.zeros((2, L), np.int32)
    empty = dict(plain, segment_ids=zeros, positions=zeros, loss_mask=zeros)
    (loss, aux), g = grad(params, empty)
    assert float(loss) == 0.0 and float(aux["weight"]) == 0.0
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(g))
    one_doc = dict(plain, segment_ids=np.ones((2, L), np.int32), loss_mask=np.ones((2, L), np.int32),
                   positions=np.tile(np.arange(L, dtype=np.int32), (2, 1)))
    (l1, _), g1 = grad(params, one_doc)
    (l0, _), g0 = grad(params, plain)
    assert_scalar_close(l1, l0, rtol=1e-6)
    assert_tree_close(g1, g0, rtol=1e-5)


# accum1 (~5 CPU-s, a step compile of its own) is slow: its fast sibling [gpt-accum2] runs the same packed batch
# through the same sharded step, its microbatches holding different numbers of targets
@pytest.mark.parametrize("accum", [pytest.param(1, marks=pytest.mark.slow), 2], ids=["accum1", "accum2"])
@pytest.mark.parametrize("cfg", [SMALL_GPT, pytest.param(SMALL_LLAMA, marks=pytest.mark.slow)], ids=["gpt", "llama"])
def test_packed_step_on_2x2x2_and_accumulation_match_one_device(cfg, accum, mesh_factory):
    """A packed batch's loss and gradients on data=2 x fsdp=2 x tensor=2 (with ``accum`` accumulation steps; with
    2 the microbatches hold different numbers of targets) equal jax.value_and_grad on one device."""
    model = cfg.as_model()
    rng = np.random.default_rng(23)
    rows = [[rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in rng.integers(2, 9, 3)] for _ in range(8)]
    rows[1], rows[6] = rows[1][:1], []                      # microbatch 0 (rows 0, 2, ...) and 1 differ in weight
    batch = pack_rows(rows)
    tx = optax.sgd(0.1, momentum=0.9)
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    state = jp.train.init_state(model.init, tx, 7, mesh=mesh)
    params = jax.device_get(state.params)
    (loss, aux), grads = jax.jit(jax.value_and_grad(model.loss, has_aux=True))(params, batch)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, grad_accum_steps=accum, donate=False,
                                    check_batch=model.check_batch)
    new_state, metrics = jax.device_get(step(state, batch))
    errs = [assert_scalar_close(metrics["loss"], loss, what=f"accum {accum} loss")]
    assert float(metrics["weight"]) == float(aux["weight"]) == batch["loss_mask"].sum()
    errs.append(assert_tree_close(new_state.opt_state[0].trace, grads, what=f"accum {accum} grads"))
    print(f"\n[packed 2x2x2] accum {accum}: loss, grads: " + ", ".join(f"{e:.1e}" for e in errs))


def test_bad_packed_batches_raise_clear_errors():
    model = jp.models.GPT(SMALL_GPT)
    rng = np.random.default_rng(0)
    batch = gpt_batch(rng, 2, SMALL_GPT)
    ok = np.ones((2, L), np.int32)
    cases = [({"segment_ids": ok[:, :-1]}, r"segment_ids.*shape \(2, 15\).*\(2, 16\)"),
             ({"segment_ids": ok.astype(np.float32)}, r"segment_ids.*float32.*integers"),
             ({"positions": ok * -1}, r"positions.*-1 at index \(0, 0\)"),
             ({"positions": ok * 16}, r"positions.*16.*max_seq_len=16"),
             ({"loss_mask": ok.astype(str)}, r"loss_mask.*bool or numeric"),
             ({"loss_mask": np.where(ok, np.nan, 0)}, r"loss_mask.*nan at index \(0, 0\).*finite and >= 0"),
             ({"loss_mask": -ok}, r"loss_mask.*-1 at index \(0, 0\).*finite and >= 0")]
    for extra, match in cases:
        with pytest.raises(ValueError, match=match):
            model.check_batch(dict(batch, **extra))
    model.check_batch(dict(batch, segment_ids=ok, positions=ok, loss_mask=ok.astype(bool)))
    with pytest.raises(ValueError, match="segment_ids.*shape"):   # at trace time too
        jax.eval_shape(model.loss, jax.eval_shape(model.init, jax.random.key(0)), dict(batch, segment_ids=ok[:1]))
    # on the device nothing reads them back: a negative learned position gives NaN (no wrap to the table's end)
    params = jax.tree.map(lambda x: x.value, model.init(jax.random.key(0)), is_leaf=lambda x: hasattr(x, "value"))
    wrapped = jax.device_put(dict(batch, positions=np.where(np.arange(L) == L - 1, -1, np.arange(L))[None].repeat(2, 0)
                                  .astype(np.int32)))
    assert np.isnan(float(jax.jit(model.loss)(params, wrapped)[0]))
    cudnn = dataclasses.replace(SMALL_GPT, attention="cudnn")
    q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="segment ids.*attention='blocked'"):
        attention(cudnn, q, q, q, jnp.ones((1, 4), jnp.int32))
