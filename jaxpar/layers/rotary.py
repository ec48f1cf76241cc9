"""Rotary position embedding (RoPE, Su et al. 2021) of query and key heads."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.layers import attention as cp


def rope(x_BLHK: jax.Array, base: float, offset: jax.Array | int = 0, freq: Any = None,
         positions_BL: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, eq. 34), rotating halves of the head dim; float32 angles.
    Row ``l`` of ``x_BLHK`` is position ``offset + l`` (``offset``: an int, an int32 scalar, e.g. a decode step's,
    or an int32 ``[B]`` of per-row offsets, e.g. left-padded prompts'), or ``positions_BL[:, l]`` when given
    (int ``[B, L]``: packed documents, each counting from 0).
    ``freq``: the ``K // 2`` inverse frequencies (default ``base ** (-i / (K // 2))``; e.g. Llama 3's scaled ones)."""
    L, K = x_BLHK.shape[1], x_BLHK.shape[-1]
    half = K // 2
    if positions_BL is None and isinstance(offset, int) and offset == 0 and cp.positions(L) is not None:
        positions_BL = cp.positions(L)[None]   # a sequence sharded over a context axis: the zigzag slots' positions
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half) if freq is None else jnp.asarray(freq, jnp.float32)
    if positions_BL is None:
        pos_BL = jnp.arange(L, dtype=jnp.float32)[None, :] + jnp.reshape(jnp.asarray(offset, jnp.float32), (-1, 1))
    else:
        pos_BL = positions_BL.astype(jnp.float32)
    angle = pos_BL[..., None] * freq          # [B or 1, L, K / 2]
    sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    x1, x2 = x_BLHK[..., :half].astype(jnp.float32), x_BLHK[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BLHK.dtype)


__all__ = ["rope"]
