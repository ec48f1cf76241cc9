"""The blocks of causal softmax attention that :mod:`jaxpar.layers.attention`'s kernel assembles: the scores and
their masks, a query block that meets all its keys at once (:func:`whole`, with its backward pass written out), and
the partial results of one key block among several with their online-softmax merge (:func:`partial_block`,
:func:`merge`). Shapes as there: B batch, Q a block's queries, S its keys, H query heads, G key/value heads, R
query heads per key/value head, K head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

NEG = jnp.finfo(jnp.float32).min / 2    # a finite "minus infinity" for masked scores (no inf - inf = NaN)

# The two products per query layout: [B, Q, H, K] against keys and values with the queries' heads (scores
# [B, H, Q, S]), or grouped queries [B, Q, G, R, K] against the G key/value heads themselves (scores
# [B, Q, G, R, S]: grouped-query attention that never repeats K and V).
PRODUCTS = {4: ("bqhk,bshk->bhqs", "bhqs,bshk->bqhk"), 5: ("bqgrk,bsgk->bqgrs", "bqgrs,bsgk->bqgrk")}


def visible(seg_q_BQ, seg_k_BS, diagonal: int | None, q_len: int, k_len: int, rank: int, near_QS=None):
    """Which keys each query of a block sees, broadcastable to the scores of a rank-``rank`` query block
    (:data:`PRODUCTS`), or None (all): key ``j`` at or before query ``i`` counted from ``diagonal`` (a block on the
    diagonal, ``j <= diagonal + i``; None: every key precedes every query), within the sliding window where
    ``near_QS`` (bool ``[Q, S]``, :func:`~jaxpar.layers.sliding_window.near`) is given and, with segment ids (int
    ``[B, Q]`` and ``[B, S]``), in the query's own segment."""
    vis = None
    if diagonal is not None:
        vis = jnp.arange(k_len)[None, :] <= jnp.arange(diagonal, diagonal + q_len)[:, None]
    if near_QS is not None:
        vis = near_QS if vis is None else vis & near_QS
    if seg_q_BQ is not None:
        same = seg_q_BQ[:, :, None] == seg_k_BS[:, None, :]
        vis = same if vis is None else vis[None] & same
    if vis is None or (rank == 4 and vis.ndim == 2):   # [Q, S] broadcasts over batch and heads as it is
        return vis
    vis = vis if vis.ndim == 3 else vis[None]
    return vis[:, None] if rank == 4 else vis[:, :, None, None, :]


def scores(q, k, visible):
    """Float32 ``q k^T / sqrt(K)`` (Vaswani et al. 2017, eq. 1), masked scores set to a finite minimum."""
    s = jnp.einsum(PRODUCTS[q.ndim][0], q, k, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(q.shape[-1]))
    return s if visible is None else jnp.where(visible, s, NEG)


@jax.custom_vjp
def whole(q_BQHK, k_BSHK, v_BSHK, visible):
    """A query block that meets all its keys in this one block: the softmax, its probabilities cast to ``v``'s
    dtype for the second product (the output has ``v``'s dtype, as ``jax.nn.dot_product_attention``'s XLA path).

    Its backward pass is written out (:func:`whole_bwd`) rather than derived: the same gradients as automatic
    differentiation of this forward pass, with every product in the orientation XLA:CPU runs as a library GEMM
    (the derived ``dV`` and ``dK`` products contract the probabilities' query axis, which XLA:CPU ran through
    Eigen at a fraction of the rate: the Llama's benchmark step 1.3-4% faster in four in-process A/Bs,
    ``benchmarks/ab.py``). Forward-mode differentiation (``jax.jvp``) is therefore not defined through it, as for
    fused attention kernels (cuDNN's, FlashAttention); ``attention="xla"`` keeps it."""
    return whole_fwd(q_BQHK, k_BSHK, v_BSHK, visible)[0]


def whole_fwd(q, k, v, visible):
    """:func:`whole`'s output and the residuals its backward pass reads: ``(q, k, v, P)``."""
    p = jax.nn.softmax(scores(q, k, visible), axis=-1)    # [B, H, Q, S] float32; 0 where masked
    return jnp.einsum(PRODUCTS[4][1], p.astype(v.dtype), v), (q, k, v, p)


def whole_bwd(res, do_BQHK):
    """The softmax attention backward pass (as FlashAttention's, Dao et al. 2022, alg. 4, without its tiling):
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(P * dP))`` (the softmax's own VJP; zero where masked,
    since ``P`` is there in every row that sees a key, as every row of the kernel does: its own),
    ``dQ = dS K / sqrt(K)``, ``dK = dS^T Q / sqrt(K)``; float32 inside, each gradient in its input's dtype."""
    q, k, v, p = res
    f32 = jnp.float32
    dp = jnp.einsum("bqhk,bshk->bhqs", do_BQHK, v, preferred_element_type=f32)
    ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) * (1.0 / math.sqrt(q.shape[-1]))
    dq = jnp.einsum("bhqs,bshk->bqhk", ds, k.astype(f32))
    dk = jnp.einsum("bhqs,bqhk->bshk", ds, q.astype(f32))
    dv = jnp.einsum("bhqs,bqhk->bshk", p.astype(v.dtype), do_BQHK, preferred_element_type=f32)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


whole.defvjp(whole_fwd, whole_bwd)


def partial_block(q_BQGRK, k_BSGK, v_BSGK, visible):
    """One key block of several: the unnormalised output, row max and row sum ``(o [B,Q,G,R,K], m [B,Q,G,R],
    l [B,Q,G,R])``, float32."""
    s = scores(q_BQGRK, k_BSGK, visible)
    m = jax.lax.stop_gradient(s.max(-1))    # the softmax does not depend on it: no gradient through the max
    p = jnp.exp(s - m[..., None])
    if visible is not None:
        p = jnp.where(visible, p, 0.0)      # a row with nothing visible contributes nothing (l = 0)
    o = jnp.einsum(PRODUCTS[5][1], p.astype(v_BSGK.dtype), v_BSGK, preferred_element_type=jnp.float32)
    return o, m, p.sum(-1)


def empty_block(q_BQGRK):
    """The ``(o, m, l)`` of no keys seen yet (zeros, ``NEG``, zeros), varying over the manual axes as ``q`` does."""
    shape = q_BQGRK.shape[:-1]
    zero = q_BQGRK[..., 0].astype(jnp.float32) * 0.0      # derived from q: it varies over the manual axes as q does
    return zero[..., None] * jnp.zeros(q_BQGRK.shape[-1:], jnp.float32), zero + NEG, zero.reshape(shape)


def merge(acc, blk):
    """Folds a block into running ``(o, m, l)`` (the online softmax: Milakov & Gimelshein 2018, alg. 3)."""
    (o1, m1, l1), (o2, m2, l2) = acc, blk
    m = jnp.maximum(m1, m2)
    a, b = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return o1 * a[..., None] + o2 * b[..., None], m, l1 * a + l2 * b


__all__ = ["NEG", "PRODUCTS", "empty_block", "merge", "partial_block", "scores", "visible", "whole", "whole_bwd",
           "whole_fwd"]
