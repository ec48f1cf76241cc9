"""The GPT's attention options against an independent reference written here.

``causal_attention`` (query blocks that skip masked key blocks) is checked, forward and gradients, against a
plain full-matrix softmax attention in float32 with an explicit mask, for block counts that divide the
sequence and that do not; the ``attention`` options of the GPT give the same loss and gradients; bad options
raise before tracing. Tolerance: DESIGN.md's ``max|got - ref| <= 1e-5 * max|ref|`` per leaf.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_tree_close
from jaxpar.models import GPT, GPTConfig
from jaxpar.models.gpt import causal_attention


def ref_attention(q, k, v):
    """q, k, v [B, L, H, K] -> [B, L, H, K]: softmax(q k^T / sqrt(K)) v with query t seeing keys s <= t."""
    L, K = q.shape[1], q.shape[-1]
    s = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(K)
    s = jnp.where(np.tril(np.ones((L, L), bool)), s, -jnp.inf)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    return jnp.einsum("bhqs,bshk->bqhk", p / p.sum(-1, keepdims=True), v)


def _out_and_grads(f, q, k, v, ct):
    def run(q, k, v, ct):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(ct)
    return jax.jit(run)(q, k, v, ct)


@pytest.mark.parametrize("L,blocks", [(16, 2), (15, 4), (5, 8)])   # dividing, not dividing, more blocks than rows
def test_causal_attention_matches_reference(L, blocks, np_rng):
    q, k, v, ct = (jnp.asarray(np_rng.standard_normal((2, L, 3, 8)), jnp.float32) for _ in range(4))
    got = _out_and_grads(lambda *t: causal_attention(*t, num_blocks=blocks), q, k, v, ct)
    assert_tree_close(got, _out_and_grads(ref_attention, q, k, v, ct))


def test_causal_attention_bf16_keeps_dtype_and_is_close(np_rng):
    q, k, v = (jnp.asarray(np_rng.standard_normal((2, 16, 2, 8)), jnp.bfloat16) for _ in range(3))
    got = jax.jit(causal_attention)(q, k, v)
    assert got.dtype == jnp.bfloat16
    ref = ref_attention(*(t.astype(jnp.float32) for t in (q, k, v)))
    # bf16 inputs and probabilities: 8 mantissa bits, so ~1e-2 relative, not the f32 tolerance
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref))) <= 2e-2 * float(jnp.max(jnp.abs(ref)))


def test_gpt_attention_options_agree(np_rng):
    base = GPTConfig(vocab_size=37, vocab_multiple=64, num_layers=2, num_heads=2, d_model=16, max_seq_len=12)
    params = nn.meta.unbox(GPT(base).init(jax.random.key(0, impl="rbg")))
    params = jax.tree.map(lambda a: a + 0.1 * np_rng.standard_normal(a.shape).astype(np.float32), params)
    batch = {k: np_rng.integers(0, 37, (3, 12), dtype=np.int32) for k in ("inputs", "targets")}

    def loss_grad(cfg):
        return jax.jit(jax.value_and_grad(lambda p: GPT(cfg).loss(p, batch)[0]))(params)

    ref = loss_grad(dataclasses.replace(base, attention="xla"))
    for cfg in (base, dataclasses.replace(base, attention_blocks=3)):
        assert_tree_close(loss_grad(cfg), ref)


def test_attention_options_are_validated():
    with pytest.raises(ValueError, match="attention='flash'"):
        GPTConfig(attention="flash")
    with pytest.raises(ValueError, match="attention_blocks"):
        GPTConfig(attention_blocks=0)
    cfg = GPTConfig(vocab_size=37, vocab_multiple=64, num_layers=1, num_heads=2, d_model=16, max_seq_len=8,
                    attention="cudnn")
    params = nn.meta.unbox(jax.eval_shape(GPT(cfg).init, jax.random.key(0)))
    batch = {k: jax.ShapeDtypeStruct((2, 8), jnp.int32) for k in ("inputs", "targets")}
    if jax.devices()[0].platform != "gpu":
        with pytest.raises(ValueError, match="needs a GPU and float16/bfloat16"):
            jax.eval_shape(lambda p, b: GPT(cfg).loss(p, b), params, batch)
