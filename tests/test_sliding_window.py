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


def _output_and_grads(f, q, k, v, cotangent):
    """``(f(q, k, v), its gradients (q, k, v) against the cotangent)``: arrays compared leaf by leaf (a scalar sum
    would cancel)."""
    with_output = lambda out: (jnp.sum(out * cotangent), out)
    (_, out), grads = jax.value_and_grad(lambda q, k, v: with_output(f(q, k, v)), argnums=(0, 1, 2),
                                         has_aux=True)(q, k, v)
    return out, grads


def _inputs(seed, B, L, H, G, K):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, L, G, K)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.sort(rng.integers(0, 2, size=(B, L)), axis=1), jnp.int32)
    return q, k, v, seg, jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32)


CASES = [(1, 2, False), (3, 2, True), (5, 3, False)]   # (window, query blocks, packed)


def test_blocked_and_xla_windows_match_dense_reference():
    """Outputs of the ``"blocked"`` kernel (block counts that do and do not divide the sequence, packed segments)
    and the ``"xla"`` backend, windows 1, 3 and 5 on a sequence of 11, and their gradients with window 3 (one
    compiled program); a window as long as the sequence is full causal attention."""
    q, k, v, seg, cot = _inputs(43, 2, 11, 2, 2, 4)

    def every_case(q, k, v):
        got = {}
        for window, num_blocks, packed in CASES:
            s = seg if packed else None
            run = (lambda f: _output_and_grads(f, q, k, v, cot)) if window == 3 else (lambda f: f(q, k, v))
            got[window, "reference"] = run(lambda q, k, v: windowed_attention(q, k, v, window, s))
            for name in ("blocked", "xla"):
                got[window, name] = run(lambda q, k, v: cp.BACKENDS[name](q, k, v, s, num_blocks=num_blocks,
                                                                          window=window))
        got[11, "blocked"], got[11, "reference"] = cp.causal(q, k, v, window=11), cp.causal(q, k, v)
        return got

    got = jax.jit(every_case)(q, k, v)
    for window, name in got:
        if name != "reference":
            assert_tree_close(got[window, name], got[window, "reference"], what=f"{name} window={window}")


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
        grad = lambda f: _output_and_grads(f, q, k, v, cot)
        return {w: grad(lambda q, k, v: back(cp.causal(move(q), move(k), move(v), move(seg), window=w,
                                                        context_attention=strategy, layout=layout)))
                for w in windows}

    with jp.sharding.use(_mesh(C)):
        got = jax.jit(every_window)(q, k, v)
    for w in windows:
        ref = _output_and_grads(lambda q, k, v: windowed_attention(q, k, v, w, seg), q, k, v, cot)
        assert_tree_close(got[w], ref, what=f"window={w}")


@pytest.mark.slow
@pytest.mark.parametrize("C", [2, 4])
def test_ring_steps_outside_every_window_are_skipped(C):
    """Contiguous layout: a window of at most a device's share plus one keeps step 1 alone; zigzag: steps 1 and
    ``C - 1`` stay for any window of 2 or more; a window of 1 (each query sees itself) keeps no step. The compiled
    ring holds one K/V collective-permute per step kept."""
    L, n = 16 * C, 16
    assert sw.ring_steps(L, C, "contiguous", n + 1) == [1]
    assert sw.ring_steps(L, C, "contiguous", n + 2) == ([1, 2] if C > 2 else [1])
    assert sw.ring_steps(L, C, "contiguous", None) == list(range(1, C))
    assert sw.ring_steps(L, C, "zigzag", 2) == sorted({1, C - 1})
    assert sw.ring_steps(L, C, "zigzag", 1) == sw.ring_steps(L, C, "contiguous", 1) == []
    if C == 4:   # step 1: devices 1-3 meet the early chunk just before theirs; device 0's chunks 0 and 7 meet 3 and 4
        assert sw.devices_seeing(L, C, "zigzag", 2, 1).tolist() == [False, True, True, True]
    q = jnp.zeros((1, L, 2, 8), jnp.float32)
    for layout in cp.LAYOUTS:
        for window in (2, n + 1, None):
            mesh = _mesh(C)
            with jp.sharding.use(mesh):
                text = jax.jit(lambda q: cp.causal(q, q, q, window=window, layout=layout)).lower(q).compile().as_text()
            permutes = [s for s in jp.plan.hlo.collective_sites(text, dict(mesh.shape))
                        if s.kind == "collective-permute"]
            assert len(permutes) == len(sw.ring_steps(L, C, layout, window)), (layout, window, permutes)


def test_blocked_kernel_skips_the_keys_outside_the_window():
    """The compiled forward's dot FLOPs (HLO reader) are those of the scores the kernel claims to compute
    (:func:`~jaxpar.layers.sliding_window.keys_computed`: two products of ``K`` multiply-adds per score and head),
    a quarter of full causal attention's or less with window 8 on 1,024 tokens."""
    B, L, H, K = 1, 1024, 2, 4
    q = jnp.zeros((B, L, H, K), jnp.float32)
    flops = {w: jp.plan.hlo.analyze(jax.jit(lambda q, w=w: cp.causal_attention(q, q, q, window=w)).lower(q).compile()
                                    .as_text(), {}).flops for w in (None, 8)}
    for w, got in flops.items():
        assert got == 2 * 2 * K * B * H * sw.keys_computed(L, 2, w), (w, got)
    assert flops[8] < flops[None] / 4


def test_window_blocks_keep_at_least_the_minimum_rows_on_one_device():
    """One device's sequence: a block about a quarter window long, at most 32 blocks, none under 32 rows (below it
    the blocks' own work outweighs the skipped scores); over a context axis (``min_rows=1``) the quarter-window rule
    alone."""
    assert sw.MIN_WINDOW_BLOCK_ROWS == 32
    assert sw.window_blocks(128, 2, 64) == 4          # a quarter window would be 16 rows
    assert sw.window_blocks(128, 2, 8) == 4
    assert sw.window_blocks(4096, 2, 1024) == 16      # a quarter window, 256 rows
    assert sw.window_blocks(4096, 2, 64) == 32        # the cap, 128 rows each
    assert sw.window_blocks(48, 3, 8) == 3            # never fewer than asked for
    assert sw.window_blocks(128, 2, None) == 2 and sw.window_blocks(128, 2, 128) == 2
    assert sw.window_blocks(16, 1, 4, min_rows=1) == 16
    assert all(e - s >= 32 for s, e in sw.query_blocks(1000, sw.window_blocks(1000, 2, 16)))
