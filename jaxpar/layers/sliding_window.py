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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: the most query blocks the ``"blocked"`` kernel cuts a windowed sequence into (each block is unrolled in the
#: program, so the count bounds compile time; beyond it a block's rows exceed the window and some masked scores
#: are computed)
MAX_WINDOW_BLOCKS = 32


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


def window_blocks(seq_len: int, num_blocks: int, window: int | None) -> int:
    """How many query blocks the single-device kernel uses: ``num_blocks``, raised with a window so that a block
    spans about ``window`` rows (at most :data:`MAX_WINDOW_BLOCKS`): a block of ``b`` rows then meets
    ``b + window - 1`` keys, and attention costs about ``2 * L * window`` scores instead of ``L^2 / 2``."""
    if window is None or window >= seq_len:
        return num_blocks
    return max(num_blocks, min(math.ceil(seq_len / window), MAX_WINDOW_BLOCKS))


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


def device_chunks(device: int, context: int, layout: str) -> tuple[int, ...]:
    """The chunks a device holds: ``(device,)`` of ``context`` chunks (contiguous), or ``(device, 2C - 1 - device)``
    of ``2C`` chunks (zigzag)."""
    return (device,) if layout == "contiguous" else (device, 2 * context - 1 - device)


def ring_steps(seq_len: int, context: int, layout: str, window: int | None) -> list[int]:
    """The context-parallel steps ``s`` in ``1 .. context - 1`` (device ``d`` meets the keys of device
    ``(d - s) % context``) in which some query of some device sees some key; the others are skipped.

    Contiguous layout: step ``s`` puts keys at least ``(s - 1) * L / C + 1`` positions before the queries (or after
    them), the same on every device, so only the first ``ceil((window - 1) / (L / C))`` steps run; a window of at
    most ``L / C + 1`` keeps step 1 alone. Zigzag layout: every device holds an early and a late chunk, and at step
    ``s`` the devices ``d >= s`` meet an early chunk ``s`` chunks before their early one, while the devices
    ``d < s`` meet a late chunk ``C - s`` chunks before their late one: both the first and the last steps stay
    (steps ``1`` and ``C - 1`` for any window), so far fewer steps are skipped than with the contiguous layout
    (with ``C = 2`` none).
    """
    parts = context if layout == "contiguous" else 2 * context
    chunk = seq_len // parts
    return [s for s in range(1, context)
            if any(_chunk_sees(a, b, chunk, window) for d in range(context)
                   for a in device_chunks(d, context, layout) for b in device_chunks((d - s) % context, context, layout))]


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


def layer_windows(cfg: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window: the ``window`` of every entry of ``cfg.layer_kinds()`` where the config
    defines it (the families with sliding windows), else None for all ``cfg.num_layers`` layers."""
    kinds = getattr(cfg, "layer_kinds", None)
    return tuple(k.window for k in kinds()) if kinds is not None else (None,) * cfg.num_layers


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


__all__ = ["MAX_WINDOW_BLOCKS", "cache_slots", "check_window", "device_chunks", "first_key", "keys_computed",
           "layer_windows", "query_blocks", "ring_steps", "ring_write", "slot_indices", "window_blocks"]
