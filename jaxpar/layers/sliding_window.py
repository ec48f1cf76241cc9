"""Sliding-window (local) causal attention: the mask, the work it lets the kernels skip, and the KV cache slots.

A window ``w`` restricts causal attention to the last ``w`` positions: key ``j`` is visible from query ``i`` iff
``j <= i`` and ``i - j < w`` (positions in the original token order, never slots of a reordered layout; with
segment ids also within the query's segment). This is Hugging Face's ``sliding_window_causal_mask_function``
(``kv_idx > q_idx - sliding_window``), as in Mistral (Jiang et al. 2023, "Mistral 7B", sec. 2) and Gemma 3's
local layers; ``None`` is full causal attention.

Everything here is static (numpy, Python ints): the window and the block bounds are known when tracing, so the
kernels in :mod:`jaxpar.layers.attention` leave out, rather than mask, the keys and ring steps no query can see.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

#: the most query blocks the ``"blocked"`` kernel cuts a windowed sequence into (each block is unrolled in the
#: program, so the count bounds compile time; beyond it a block's rows exceed the window and some masked scores
#: are computed)
MAX_WINDOW_BLOCKS = 32
#: the fewest query rows a window block is cut to (fewer blocks where the quarter-window rule would cut smaller ones):
#: each block is two products and a softmax of its own, and below this the per-block work costs more than the
#: skipped scores save (measured on XLA:CPU, ``benchmarks/README.md``: Gemma 3's step at sequence 128 and window
#: 64 took 3-5% less time in 4 blocks of 32 rows than in 8 of 16)
MIN_WINDOW_BLOCK_ROWS = 32


def check_window(window) -> int | None:
    """``window`` itself if it is None or a positive Python int; raises ValueError otherwise.

    Raises:
      ValueError: a bool, a non-integer (a float, a traced or numpy array) or an int < 1.
    """
    if window is None or (isinstance(window, (int, np.integer)) and not isinstance(window, bool) and window >= 1):
        return None if window is None else int(window)
    raise ValueError(f"window={window!r}: the sliding window must be a positive Python int (the number of most "
                     "recent positions a query sees, itself included; static, not traced) or None for full causal "
                     "attention")


def window_blocks(seq_len: int, num_blocks: int, window: int | None, min_rows: int = MIN_WINDOW_BLOCK_ROWS) -> int:
    """How many query blocks the kernel cuts ``seq_len`` rows into: ``num_blocks``, raised with a window so that a
    block spans about a quarter of the window (at most :data:`MAX_WINDOW_BLOCKS` blocks, and none of fewer than
    ``min_rows`` rows, :data:`MIN_WINDOW_BLOCK_ROWS` on one device's sequence): a block of ``b`` rows meets
    ``b + window - 1`` keys, so attention costs about ``L * 1.25 * window`` scores instead of ``L^2 / 2`` (the
    visible ones: about ``L * window``)."""
    if window is None or window >= seq_len:
        return num_blocks
    return max(num_blocks, min(math.ceil(4 * seq_len / window), MAX_WINDOW_BLOCKS, seq_len // min_rows))


def first_key(start: int, window: int | None) -> int:
    """The first key slot a query block starting at slot ``start`` can see: keys before it are more than
    ``window - 1`` slots back from every query of the block, so they are never computed. Safe in any layout whose
    slots keep the order of positions and never place two positions closer than their slots (the contiguous
    and zigzag layouts): position distances are then at least slot distances."""
    return 0 if window is None else max(0, start - window + 1)


def _chunk_sees(query_chunk: int, key_chunk: int, chunk: int, window: int | None) -> bool:
    """Whether any query of chunk ``query_chunk`` (``chunk`` positions each) sees any key of chunk ``key_chunk``."""
    if key_chunk > query_chunk:
        return False
    return window is None or key_chunk == query_chunk or (query_chunk - key_chunk - 1) * chunk + 1 < window


def near(pos_q_Q, pos_k_S, window: int | None):
    """Which keys lie within the window of each query by position (bool ``[Q, S]``; positions int ``[Q]``, ``[S]``,
    static or traced), or None without a window: ``pos_q - pos_k < window`` (causality is the caller's)."""
    return None if window is None else (pos_q_Q[:, None] - pos_k_S[None, :]) < window


def chunk_positions(device, n: int, context: int, layout: str, window: int | None):
    """The positions of a device's ``n`` slots over a context axis (int ``[n]``; ``device`` may be traced): its
    chunk (contiguous) or its two chunks (zigzag); None without a window (nothing needs them)."""
    if window is None:
        return None
    if layout == "contiguous":
        return device * n + jnp.arange(n)
    c = n // 2
    return jnp.concatenate([device * c + jnp.arange(c), (2 * context - 1 - device) * c + jnp.arange(c)])


def device_chunks(device: int, context: int, layout: str) -> tuple[int, ...]:
    """The chunks a device holds: ``(device,)`` of ``context`` chunks (contiguous), or ``(device, 2C - 1 - device)``
    of ``2C`` chunks (zigzag)."""
    return (device,) if layout == "contiguous" else (device, 2 * context - 1 - device)


def ring_steps(seq_len: int, context: int, layout: str, window: int | None) -> list[int]:
    """The context-parallel steps ``s`` in ``1 .. context - 1`` (device ``d`` meets the keys of device
    ``(d - s) % context``) in which some query of some device sees some key; the others are skipped.

    Contiguous layout: step ``s`` puts keys at least ``(s - 1) * L / C + 1`` positions before the queries (or after
    them), the same on every device, so only the steps with ``(s - 1) * L / C + 1 < window`` run: none for a window
    of 1, step 1 alone up to a window of ``L / C + 1``. Zigzag layout: every device holds an early and a late
    chunk, and at step ``s`` the devices ``d >= s`` meet an early chunk ``s`` chunks before their early one, while
    the devices ``d < s`` meet a late chunk ``C - s`` chunks before their late one: both the first and the last
    steps stay (steps ``1`` and ``C - 1`` for any window of 2 or more), so far fewer steps are skipped than with
    the contiguous layout (with ``C = 2`` none).
    """
    return [s for s in range(1, context) if devices_seeing(seq_len, context, layout, window, s).any()]


def devices_seeing(seq_len: int, context: int, layout: str, window: int | None, step: int) -> np.ndarray:
    """Whether some query of device ``d`` sees some key of device ``(d - step) % context`` (bool ``[context]``):
    at a step :func:`ring_steps` keeps, the devices marked False skip their compute (the keys still pass)."""
    chunk = seq_len // (context if layout == "contiguous" else 2 * context)
    return np.array([any(_chunk_sees(a, b, chunk, window) for a in device_chunks(d, context, layout)
                         for b in device_chunks((d - step) % context, context, layout)) for d in range(context)])


def query_blocks(length: int, num_blocks: int) -> list[tuple[int, int]]:
    """``(start, end)`` of ``num_blocks`` contiguous query blocks of ``length`` rows (at least 1, at most one a row)."""
    n = max(1, min(num_blocks, length))
    cuts = [round(i * length / n) for i in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def keys_computed(seq_len: int, num_blocks: int, window: int | None) -> int:
    """The query-key scores the single-device ``"blocked"`` kernel computes per batch row and head (masked ones
    included): block ``[s, e)`` meets keys ``[first_key(s), e)``."""
    return sum((e - s) * (e - first_key(s, window))
               for s, e in query_blocks(seq_len, window_blocks(seq_len, num_blocks, window)))


def cache_slots(max_len: int, window: int | None) -> int:
    """The KV cache length of a layer: ``window`` slots (a ring buffer, position ``p`` in slot ``p % window``) when
    the window is shorter than ``max_len``, else ``max_len``."""
    return max_len if window is None else min(max_len, window)


def slot_indices(pos: jax.Array, slots: int) -> jax.Array:
    """The token index each slot of a ring buffer of ``slots`` slots holds once the indices ``0 .. pos - 1`` were
    written in order, index ``t`` in slot ``t % slots`` (int32 ``[slots]``; negative: never written)."""
    s = jnp.arange(slots, dtype=jnp.int32)
    return pos - 1 - jnp.mod(pos - 1 - s, slots)


def ring_write(cache_BSGK: jax.Array, new_BLGK: jax.Array, pos: jax.Array) -> jax.Array:
    """The ring buffer ``cache_BSGK`` (``S`` slots) with the tokens of indices ``pos .. pos + L - 1`` written, index
    ``t`` in slot ``t % S``; of more than ``S`` new tokens only the last ``S`` are kept (the others would be
    overwritten at once). ``new_BLGK`` is cast to the cache's dtype."""
    S, L = cache_BSGK.shape[1], new_BLGK.shape[1]
    kept = min(L, S)
    slots = jnp.mod(pos + (L - kept) + jnp.arange(kept), S)
    return cache_BSGK.at[:, slots].set(new_BLGK[:, L - kept:].astype(cache_BSGK.dtype), unique_indices=True)


__all__ = ["MAX_WINDOW_BLOCKS", "cache_slots", "check_window", "chunk_positions", "device_chunks", "devices_seeing",
           "first_key", "keys_computed", "near", "query_blocks", "ring_steps", "ring_write", "slot_indices",
           "window_blocks"]
