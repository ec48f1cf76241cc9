"""Sliding-window attention (:mod:`jaxpar.layers.sliding_window`): every backend against a dense masked softmax
written here (key ``j`` visible from query ``i`` iff ``j <= i`` and ``i - j < window``, Hugging Face's
``sliding_window_causal_mask_function``), the work the window lets the kernels skip, and bad windows refused.

Tolerance (docs/architecture.md, "Tests"): per leaf max|got - ref| <= 1e-5 * max|ref|.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close

import jaxpar as jp
from jaxpar.layers import attention as cp
from jaxpar.layers import sliding_window as sw


def windowed_attention(q, k, v, window, segment_ids=None):
    """Dense ``softmax(q k^T / sqrt(K) + mask) v``: query ``i`` sees key ``j`` iff ``j <= i``, ``i - j < window``
    (None: no bound) and, with segment ids, the same segment; key head ``h // (H // G)`` for query head ``h``."""
    B, L, H, K = q.shape
    k, v = (jnp.repeat(t, H // t.shape[2], axis=2) for t in (k, v))
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    visible = jnp.asarray((j <= i) & ((i - j < window) if window is not None else True))[None, None]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    s = jnp.einsum("bqhk,bshk->bhqs", q, k, precision="highest") / np.sqrt(K)
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqs,bshk->bqhk", p, v, precision="highest")


def _inputs(seed, B, L, H, G, K):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, L, G, K)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.sort(rng.integers(0, 2, size=(B, L)), axis=1), jnp.int32)
    return q, k, v, seg, jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32)


CASES = [(1, 2, False), (3, 2, True), (5, 3, False)]   # (window, query blocks, packed)


def test_blocked_and_xla_windows_match_dense_reference():
    """Output and gradients of the ``"blocked"`` kernel (block counts that do and do not divide the sequence,
    packed segments) and the ``"xla"`` backend, windows 1, 3 and 5 on a sequence of 11 (one compiled program)."""
    q, k, v, seg, cot = _inputs(43, 2, 11, 2, 2, 4)

    def every_case(q, k, v):
        grad = lambda f: jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) * cot), argnums=(0, 1, 2))(q, k, v)
        got = {}
        for window, num_blocks, packed in CASES:
            s = seg if packed else None
            got[window, "reference"] = grad(lambda q, k, v: windowed_attention(q, k, v, window, s))
            for name in ("blocked", "xla"):
                got[window, name] = grad(lambda q, k, v: cp.BACKENDS[name](q, k, v, s, num_blocks=num_blocks,
                                                                           window=window))
        return got

    got = jax.jit(every_case)(q, k, v)
    for window, _, _ in CASES:
        for name in ("blocked", "xla"):
            assert_tree_close(got[window, name], got[window, "reference"], what=f"{name} window={window}")
    # a window as long as the sequence is full causal attention
    np.testing.assert_allclose(cp.causal(q, k, v, window=11), cp.causal(q, k, v), rtol=0, atol=0)


def test_bad_window_is_refused():
    q = jnp.zeros((1, 4, 1, 2))
    for bad in (0, -3, 2.0, True, "4", np.array([4])):
        with pytest.raises(ValueError, match="sliding window must be a positive Python int"):
            cp.causal(q, q, q, window=bad)
