"""Which leaves ``jp.optim.adamw`` decays, with and without logical names, against sets written out by hand."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig

GPT_DECAYED = {"blocks/qkv_kernel", "blocks/out_kernel", "blocks/up_kernel", "blocks/down_kernel"}   # by hand


def _decayed(tx, params):
    """The leaves a step of ``tx`` decays, seen from outside: zero gradients, so only weight decay moves a leaf."""
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    flat = jax.tree_util.tree_flatten_with_path(updates)[0]
    return {"/".join(str(k.key) for k in path) for path, u in flat if bool(jnp.any(u != 0))}


@pytest.mark.parametrize("tie", [True, False])
def test_adamw_decays_gpt_block_matrices_with_and_without_names(tie):
    cfg = GPTConfig(vocab_size=11, num_layers=3, num_heads=2, d_model=8, max_seq_len=4, tie_embeddings=tie)
    names = jax.eval_shape(GPT(cfg).init, jax.random.key(0))
    params = nn.meta.unbox(GPT(cfg).init(jax.random.key(0)))
    params = jax.tree.map(lambda x: x + 0.5, params)   # no zero leaf (norm biases start at 0)
    make = lambda **kw: jp.optim.adamw(1e-2, total_steps=10, weight_decay=0.1, clip_norm=None, **kw)
    assert _decayed(make(axis_names=names), params) == GPT_DECAYED
    without = _decayed(make(), params)
    # the fallback cannot tell an untied [embed, vocab] unembedding from a matrix (documented)
    assert without == GPT_DECAYED | ({"head/kernel"} if not tie else set())


@dataclasses.dataclass(frozen=True)
class _Stacked:
    """A user's model with stacked layers: matrices [layers, d, d], a norm scale and a bias [layers, d]."""
    def init(self, rng):
        k = jax.random.split(rng, 3)
        box = lambda x, *n: nn.LogicallyPartitioned(x, n)
        return {"layers": {"w_q": box(jax.random.normal(k[0], (3, 4, 4)), "layers", "embed", "mlp"),
                           "w_o": box(jax.random.normal(k[1], (3, 4, 4)), "layers", "mlp", "embed"),
                           "norm_scale": box(jnp.ones((3, 4)), "layers", "embed"),
                           "out_bias": box(jnp.ones((3, 4)), "layers", "embed")},
                "readout": box(jax.random.normal(k[2], (4, 2)), "embed", None)}


def test_adamw_decays_a_stacked_user_model_with_and_without_names():
    model = _Stacked()
    names = jax.eval_shape(model.init, jax.random.key(0))
    params = nn.meta.unbox(model.init(jax.random.key(0)))
    want = {"layers/w_q", "layers/w_o", "readout"}
    tx = lambda **kw: jp.optim.adamw(1e-2, total_steps=10, clip_norm=None, **kw)
    assert _decayed(tx(axis_names=names), params) == want
    assert _decayed(tx(), params) == want


def test_decay_mask_is_optax_adamw_mask():
    """jaxpar's adamw is optax.adamw with the mask: the same update as optax's with the mask written out."""
    cfg = GPTConfig(vocab_size=11, num_layers=2, num_heads=2, d_model=8, max_seq_len=4)
    params = nn.meta.unbox(GPT(cfg).init(jax.random.key(1)))
    grads = jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(0).normal(size=x.shape), x.dtype), params)
    mask = jax.tree_util.tree_map_with_path(
        lambda p, x: "/".join(str(k.key) for k in p) in GPT_DECAYED, params)
    ours = jp.optim.adamw(1e-2, total_steps=10, weight_decay=0.1, clip_norm=None, warmup_steps=0, final_lr_ratio=1.0)
    ref = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 0, 10, end_value=1e-2), b1=0.9, b2=0.95,
                      weight_decay=0.1, mask=mask)
    got, _ = ours.update(grads, ours.init(params), params)
    want, _ = ref.update(grads, ref.init(params), params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
