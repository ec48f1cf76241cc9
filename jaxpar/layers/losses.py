"""The token-level loss of a language model: softmax cross-entropy, and the guard against token ids
outside the vocabulary."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """Per-token softmax cross-entropy ``[B, L]``: ``logsumexp(logits) - logits[target]``.

    The target logit is taken by a one-hot contraction, not a gather: the numbers are those of
    ``optax.softmax_cross_entropy_with_integer_labels`` (a sum of one value and zeros is exact), and it
    partitions over a vocab-sharded axis inside ``shard_map`` over ``pipe``, where XLA's SPMD partitioner
    aborts on the gather (jax 0.10.2, operand sharded over a batch axis and the gathered axis).
    """
    one_hot_BLV = jax.nn.one_hot(targets_BL, logits_BLV.shape[-1], dtype=logits_BLV.dtype)
    return jax.nn.logsumexp(logits_BLV, axis=-1) - jnp.sum(logits_BLV * one_hot_BLV, axis=-1)


def _nan_where_invalid(ids: jax.Array, vocab_size: int, dtype: Any = jnp.float32) -> jax.Array:
    """1 where ``0 <= id < vocab_size``, NaN elsewhere: multiplied in, an out-of-range id makes the loss and
    every gradient NaN instead of a finite, silently wrong loss (``jnp.take`` wraps negative ids)."""
    return jnp.where((ids >= 0) & (ids < vocab_size), jnp.ones((), dtype), jnp.asarray(jnp.nan, dtype))


def check_token_ids(name: str, ids: Any, vocab_size: int) -> None:
    """Raises ValueError unless host array ``ids`` holds integers in ``[0, vocab_size)`` (naming the first bad one)."""
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name} has dtype {ids.dtype}; token ids must be integers (e.g. np.int32)")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name} holds token id {int(ids[where])} at index {where} ({int(bad.sum())} ids out of "
                         f"range); ids must lie in [0, vocab_size={vocab_size}): encode with the corpus' "
                         f"vocabulary or raise the model config's vocab_size")


__all__ = ["check_token_ids", "cross_entropy"]
