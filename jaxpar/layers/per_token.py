"""Per-token operands and the batch entries of packed documents.

:func:`tokens` shapes per-token values as matmul operands (2-D where the sequence is whole); the optional
batch entries of packed documents (:data:`PACKED_KEYS`: segment ids, positions, loss mask) are checked here,
once, for every model that takes them.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxpar.layers import attention as cp
from jaxpar.sharding.names import BATCH, SEQ


def tokens(x: jax.Array) -> jax.Array:
    """Matmul operand of per-token values ``[B, L, ...] -> [B * L, F]`` (``F`` the product of the rest): 2-D operands,
    which XLA:CPU's backward handles much better than 3-D. With the sequence sharded over a context axis
    (:func:`jaxpar.layers.attention.context_axis`) ``[B, L, F]`` instead: a flattened ``B * L`` axis cannot be tiled over
    the sequence's devices (GSPMD would gather it)."""
    B, L = x.shape[:2]
    return x.reshape(B, L, -1) if cp.context_axis()[1] > 1 else x.reshape(B * L, -1)


def token_names() -> tuple:
    """The logical names of :func:`tokens`' leading axes, for ``constrain(h, *token_names(), 'mlp')``."""
    return (BATCH, SEQ) if cp.context_axis()[1] > 1 else ((BATCH, SEQ),)


LM_KEYS = ("inputs", "targets")                         # a language model's batch: token ids and next-token ids
PACKED_KEYS = ("segment_ids", "positions", "loss_mask")   # the optional batch entries of packed documents
BATCH_KEYS = LM_KEYS + PACKED_KEYS                        # every per-token entry of a batch, each [B, L]


def check_packed_shapes(batch: dict) -> None:
    """Raises ValueError naming a packed entry (:data:`PACKED_KEYS`) whose shape is not ``batch["inputs"]``'s (static
    shapes: traceable)."""
    want = tuple(np.shape(batch["inputs"]))
    for key in PACKED_KEYS:
        if key in batch and tuple(np.shape(batch[key])) != want:
            raise ValueError(f"batch[{key!r}] has shape {tuple(np.shape(batch[key]))}, the inputs {want}: packed "
                             "documents' segment_ids, positions and loss_mask are [batch, seq] like the inputs")


def check_packed_entries(batch: dict, max_position: int | None = None) -> None:
    """Host-side check of a batch's packed-document entries (:data:`PACKED_KEYS`, each optional).

    ``segment_ids`` and ``positions`` must be integer arrays >= 0 shaped like ``batch["inputs"]`` (positions below
    ``max_position`` when given: a learned position table's size), ``loss_mask`` bool or numeric of that shape.
    Device (``jax.Array``) leaves are checked for shape and dtype only.

    Raises:
      ValueError: the first entry that breaks a rule, naming it, its shape or dtype or first bad value.
    """
    check_packed_shapes(batch)
    for key in PACKED_KEYS:
        if key not in batch:
            continue
        dtype = np.dtype(batch[key].dtype) if hasattr(batch[key], "dtype") else np.asarray(batch[key]).dtype
        if key == "loss_mask":
            if not (dtype == np.bool_ or np.issubdtype(dtype, np.number)):
                raise ValueError(f"batch['loss_mask'] has dtype {dtype}; it must be bool or numeric (1 keeps a target)")
            mask = np.asarray(batch[key]) if not isinstance(batch[key], jax.Array) else None
            if mask is not None and not (np.isfinite(mask) & (mask >= 0)).all():
                where = tuple(int(i) for i in np.argwhere(~(np.isfinite(mask) & (mask >= 0)))[0])
                raise ValueError(f"batch['loss_mask'] holds {mask[where]} at index {where}; loss weights must be finite "
                                 "and >= 0 (0 drops a target, 1 keeps it)")
            continue
        if not np.issubdtype(dtype, np.integer):
            raise ValueError(f"batch[{key!r}] has dtype {dtype}; {key} must be integers (e.g. np.int32)")
        if isinstance(batch[key], jax.Array):
            continue
        values = np.asarray(batch[key])
        limit = max_position if key == "positions" else None
        bad = (values < 0) | (values >= limit if limit is not None else False)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            bound = f"[0, max_seq_len={limit})" if limit is not None else ">= 0"
            raise ValueError(f"batch[{key!r}] holds {int(values[where])} at index {where}; {key} must be {bound}")


__all__ = ["BATCH_KEYS", "LM_KEYS", "PACKED_KEYS", "check_packed_entries", "check_packed_shapes", "token_names", "tokens"]
