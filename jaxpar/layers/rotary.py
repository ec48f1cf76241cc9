"""Rotary position embedding (RoPE, Su et al. 2021) of query and key heads."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.layers import attention as cp

STATIC_ANGLES = 1 << 22
"""The most angles (positions x ``K // 2``) :func:`rope` computes at trace time, as constants, when the positions and
frequencies are known then (4 Mi: 16 MiB each of float32 sines and cosines; more are computed in the program)."""


def rope(x_BLHK: jax.Array, base: float, offset: jax.Array | int = 0, freq: Any = None,
         positions_BL: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, eq. 34), rotating halves of the head dim; float32 angles.
    Row ``l`` of ``x_BLHK`` is position ``offset + l`` (``offset``: an int, an int32 scalar, e.g. a decode step's,
    or an int32 ``[B]`` of per-row offsets, e.g. left-padded prompts'), or ``positions_BL[:, l]`` when given
    (int ``[B, L]`` or ``[1, L]``: packed documents, each counting from 0).
    ``freq``: the ``K // 2`` inverse frequencies (default ``base ** (-i / (K // 2))``; e.g. Llama 3's scaled ones).

    Raises:
      ValueError: an odd head size ``K``, or ``positions_BL`` not ``[B, L]`` / ``[1, L]`` for ``x_BLHK``'s B and L."""
    B, L, K = x_BLHK.shape[0], x_BLHK.shape[1], x_BLHK.shape[-1]
    half = K // 2
    if K % 2:
        raise ValueError(f"rope rotates halves of the head dim, so it must be even: x_BLHK has shape {x_BLHK.shape}")
    if positions_BL is not None and (jnp.ndim(positions_BL) != 2 or jnp.shape(positions_BL)[1] != L
                                     or jnp.shape(positions_BL)[0] not in (1, B)):
        raise ValueError(f"positions_BL has shape {jnp.shape(positions_BL)}; rope needs one position per token of "
                         f"x_BLHK {x_BLHK.shape}: [B, L] = [{B}, {L}] (or [1, {L}] shared by the rows)")
    if positions_BL is None and isinstance(offset, int) and offset == 0 and cp.positions(L) is not None:
        positions_BL = cp.positions(L)[None]   # a sequence sharded over a context axis: the zigzag slots' positions
    sin_cos = _static_sin_cos(L, half, base, offset, freq, positions_BL)
    if sin_cos is None:
        freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half) if freq is None else jnp.asarray(freq, jnp.float32)
        if positions_BL is None:
            pos_BL = jnp.arange(L, dtype=jnp.float32)[None, :] + jnp.reshape(jnp.asarray(offset, jnp.float32), (-1, 1))
        else:
            pos_BL = positions_BL.astype(jnp.float32)
        angle = pos_BL[..., None] * freq          # [B or 1, L, K / 2]
        sin_cos = jnp.sin(angle), jnp.cos(angle)
    sin, cos = (t[:, :, None, :] for t in sin_cos)
    x1, x2 = x_BLHK[..., :half].astype(jnp.float32), x_BLHK[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BLHK.dtype)


def _static_sin_cos(L: int, half: int, base: float, offset: Any, freq: Any, positions_BL: Any):
    """``(sin, cos)``, numpy float32 ``[B or 1, L, half]``, where the positions (``offset`` a Python int, or numpy
    ``positions_BL``) and the frequencies (None or numpy) are known at trace time and there are at most
    :data:`STATIC_ANGLES` angles; else None. The angles are rounded to float32 as the traced path rounds them, their
    sines and cosines taken in float64. Why: computed in the program, XLA:CPU fuses sin and cos into the rotation's
    loops and evaluates them once per element of ``x`` (every batch row and head): 7% of a Llama train step on CPU
    (``benchmarks/README.md``)."""
    if positions_BL is None and isinstance(offset, (int, np.integer)):
        pos = np.arange(L, dtype=np.int64)[None] + int(offset)
    elif isinstance(positions_BL, np.ndarray):
        pos = positions_BL
    else:
        return None
    if not (freq is None or isinstance(freq, (np.ndarray, list, tuple))) or pos.size * half > STATIC_ANGLES:
        return None
    if freq is None:
        freq = np.float64(base) ** (-np.arange(half, dtype=np.float64) / half)
    angle = pos.astype(np.float32)[..., None] * np.asarray(freq, np.float32)    # float32 products, as traced
    return np.sin(angle.astype(np.float64)).astype(np.float32), np.cos(angle.astype(np.float64)).astype(np.float32)


__all__ = ["rope", "STATIC_ANGLES"]
