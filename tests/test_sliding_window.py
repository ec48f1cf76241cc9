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


def _mesh(context):
    return jp.make_mesh(data=1, context=context, devices=jax.devices()[:context])


@pytest.mark.slow
@pytest.mark.parametrize("C", [2, 4])
@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("strategy", cp.STRATEGIES)
def test_context_windows_match_dense_reference(C, layout, strategy):
    """Output and gradients of :func:`causal` over a context axis with windows shorter than a zigzag chunk, about
    a chunk, about a device's share and longer, grouped-query heads and packed segments, against the reference in
    the original order."""
    L = 8 * C
    q, k, v, seg, cot = _inputs(C, 2, L, 4, 2, 4)
    move = (lambda t: cp.to_zigzag(t, C)) if layout == "zigzag" else (lambda t: t)
    back = (lambda t: cp.from_zigzag(t, C)) if layout == "zigzag" else (lambda t: t)
    windows = (1, 3, 4, 5, L // C + 2, L - 3)

    def every_window(q, k, v):
        grad = lambda f: jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) * cot), argnums=(0, 1, 2))(q, k, v)
        return {w: grad(lambda q, k, v: back(cp.causal(move(q), move(k), move(v), move(seg), window=w,
                                                        context_attention=strategy, layout=layout)))
                for w in windows}

    with jp.sharding.use(_mesh(C)):
        got = jax.jit(every_window)(q, k, v)
    for w in windows:
        ref = jax.value_and_grad(lambda q, k, v: jnp.sum(windowed_attention(q, k, v, w, seg) * cot),
                                 argnums=(0, 1, 2))(q, k, v)
        assert_tree_close(got[w], ref, what=f"window={w}")


@pytest.mark.slow
@pytest.mark.parametrize("C", [2, 4])
def test_ring_steps_outside_every_window_are_skipped(C):
    """Contiguous layout: a window of at most a device's share plus one keeps step 1 alone; zigzag: steps 1 and
    ``C - 1`` stay for any window. The compiled ring holds one K/V collective-permute per step kept."""
    L, n = 16 * C, 16
    assert sw.ring_steps(L, C, "contiguous", n + 1) == [1]
    assert sw.ring_steps(L, C, "contiguous", n + 2) == ([1, 2] if C > 2 else [1])
    assert sw.ring_steps(L, C, "contiguous", None) == list(range(1, C))
    assert sw.ring_steps(L, C, "zigzag", 1) == sorted({1, C - 1})
    q = jnp.zeros((1, L, 2, 8), jnp.float32)
    for layout in cp.LAYOUTS:
        for window in (1, n + 1, None):
            mesh = _mesh(C)
            with jp.sharding.use(mesh):
                text = jax.jit(lambda q: cp.causal(q, q, q, window=window, layout=layout)).lower(q).compile().as_text()
            permutes = [s for s in jp.plan.hlo.collective_sites(text, dict(mesh.shape))
                        if s.kind == "collective-permute"]
            assert len(permutes) == len(sw.ring_steps(L, C, layout, window)), (layout, window, permutes)
