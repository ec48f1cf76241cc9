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

    The default frequencies are computed once on the host (float64, rounded to float32) and used by both paths,
    positions known at trace time (sines and cosines as constants) and traced ones (a decode step's offset), so a
    prefill and the decode steps after it rotate by the same angles.

    Raises:
      ValueError: ``x_BLHK`` not 4-D or of an odd head size ``K``; ``positions_BL`` not ``[B, L]`` / ``[1, L]`` for
        ``x_BLHK``'s B and L; ``offset`` neither a scalar nor ``[B]`` / ``[1]``; ``freq`` not ``K // 2`` values; a
        ``base`` that is not a finite number > 0."""
    if jnp.ndim(x_BLHK) != 4:
        raise ValueError(f"rope takes x_BLHK of shape [B, L, H, K]; got shape {jnp.shape(x_BLHK)}")
    B, L, K = x_BLHK.shape[0], x_BLHK.shape[1], x_BLHK.shape[-1]
    half = K // 2
    if K % 2:
        raise ValueError(f"rope rotates halves of the head dim, so it must be even: x_BLHK has shape {x_BLHK.shape}")
    if jnp.ndim(offset) > 1 or (jnp.ndim(offset) == 1 and jnp.shape(offset)[0] not in (1, B)):
        raise ValueError(f"offset has shape {jnp.shape(offset)}; rope takes one offset, or one per row of x_BLHK "
                         f"({B}): a scalar or [{B}]")
    if freq is not None and jnp.shape(freq) != (half,):
        raise ValueError(f"freq has shape {jnp.shape(freq)}; rope needs K // 2 = {half} inverse frequencies")
    if freq is None:
        if not isinstance(base, (int, float, np.integer, np.floating)) or not np.isfinite(base) or base <= 0:
            raise ValueError(f"base={base!r}: the rotary base must be a finite number > 0 (e.g. 10000.0)")
        freq = default_freq(base, half)
    if positions_BL is not None and (jnp.ndim(positions_BL) != 2 or jnp.shape(positions_BL)[1] != L
                                     or jnp.shape(positions_BL)[0] not in (1, B)):
        raise ValueError(f"positions_BL has shape {jnp.shape(positions_BL)}; rope needs one position per token of "
                         f"x_BLHK {x_BLHK.shape}: [B, L] = [{B}, {L}] (or [1, {L}] shared by the rows)")
    if positions_BL is None and isinstance(offset, int) and offset == 0 and cp.positions(L) is not None:
        positions_BL = cp.positions(L)[None]   # a sequence sharded over a context axis: the zigzag slots' positions
    sin_cos = _static_sin_cos(L, half, base, offset, freq, positions_BL)
    if sin_cos is None:
        freq = jnp.asarray(freq, jnp.float32)
        if positions_BL is None:
            pos_BL = jnp.arange(L, dtype=jnp.float32)[None, :] + jnp.reshape(jnp.asarray(offset, jnp.float32), (-1, 1))
        else:
            pos_BL = positions_BL.astype(jnp.float32)
        angle = pos_BL[..., None] * freq          # [B or 1, L, K / 2]
        sin_cos = jnp.sin(angle), jnp.cos(angle)
    sin, cos = (t[:, :, None, :] for t in sin_cos)
    x1, x2 = x_BLHK[..., :half].astype(jnp.float32), x_BLHK[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BLHK.dtype)


def default_freq(base: float, half: int) -> np.ndarray:
    """The ``half`` inverse frequencies ``base ** (-i / half)`` of RoPE (Su et al. 2021, eq. 15 with
    ``theta_i = base ** (-2 (i - 1) / d)``), float64 rounded to float32 ``[half]``."""
    return (np.float64(base) ** (-np.arange(half, dtype=np.float64) / half)).astype(np.float32)


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
    angle = pos.astype(np.float32)[..., None] * np.asarray(freq, np.float32)    # float32 products, as traced
    return np.sin(angle.astype(np.float64)).astype(np.float32), np.cos(angle.astype(np.float64)).astype(np.float32)


__all__ = ["STATIC_ANGLES", "default_freq", "rope"]
