"""The layers the GPT and the Llama share (one copy each): norms, activations, rotary positions, attention, and
the batch entries of packed documents (segment ids, positions, loss mask) with their checks.

Shape legend: :data:`jaxpar.models.SHAPE_LEGEND` (B batch, L sequence, H heads, K head dim, ...). Norms and
activations are rematerialised (``jax.checkpoint``): the backward pass saves their inputs only (see
:mod:`jaxpar.models.gpt`'s speed notes).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import attention as cp
from jaxpar.attention import causal_attention  # noqa: F401 (the models' single-device attention, public here)


@jax.checkpoint
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis with float32 statistics; returns ``x``'s dtype.

    Rematerialised in the backward pass: it saves only its input (in the compute dtype), not float32
    intermediates, which would otherwise be most of a bf16 model's saved activations.
    """
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


@jax.checkpoint
def gelu(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (Hendrycks & Gimpel 2016, sec. 2), ``jax.nn.gelu(approximate=True)``.

    Rematerialised like :func:`layer_norm`: the backward pass saves only the input and recomputes ``tanh``
    inside its own fused loop, so the forward pass is one elementwise pass instead of two (``tanh``, then the
    product), and no ``[tokens, mlp]`` tanh buffer is kept for the backward pass.
    """
    return jax.nn.gelu(x, approximate=True)


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


def tokens(x: jax.Array) -> jax.Array:
    """Matmul operand of per-token values ``[B, L, ...] -> [B * L, F]`` (``F`` the product of the rest): 2-D operands,
    which XLA:CPU's backward handles much better than 3-D. With the sequence sharded over a context axis
    (:func:`jaxpar.attention.context_axis`) ``[B, L, F]`` instead: a flattened ``B * L`` axis cannot be tiled over
    the sequence's devices (GSPMD would gather it)."""
    B, L = x.shape[:2]
    return x.reshape(B, L, -1) if cp.context_axis()[1] > 1 else x.reshape(B * L, -1)


def token_names() -> tuple:
    """The logical names of :func:`tokens`' leading axes, for ``constrain(h, *token_names(), 'mlp')``."""
    return ("batch", "seq") if cp.context_axis()[1] > 1 else (("batch", "seq"),)


def attention(cfg: Any, q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array,
              segment_ids_BL: jax.Array | None = None, expand: Any = None) -> jax.Array:
    """Causal attention by ``cfg.attention`` (a GPTConfig or LlamaConfig); float16 is taken in float32.

    ``segment_ids_BL`` (int ``[B, L]``, optional): attention stays within each segment (packed documents), on the
    ``"blocked"`` and ``"xla"`` paths. ``expand``: the model's ``[B, L, G, K] -> [B, L, H, K]`` of keys and values
    (grouped-query heads), applied here on one device's sequence; with the sequence sharded over a context axis
    (:func:`jaxpar.attention.context_axis`), the ``G`` heads go to :func:`jaxpar.attention.causal` (zigzag layout,
    ``cfg.context_attention``), which repeats them locally.

    Raises:
      ValueError: ``"cudnn"`` off a GPU or in float32; ``"cudnn"`` with segment ids or a context axis.
    """
    dtype = q_BLHK.dtype
    if cp.context_axis()[1] > 1:
        if cfg.attention == "cudnn":
            raise ValueError("attention='cudnn' cannot shard the sequence over the context axis (cuDNN's kernel sees "
                             "one device's keys); set GPTConfig/LlamaConfig attention='blocked', which runs "
                             f"context_attention={cfg.context_attention!r} over it, or use a mesh with context=1")
        up = (lambda t: t.astype(jnp.float32)) if dtype == jnp.float16 else (lambda t: t)
        return cp.causal(up(q_BLHK), up(k_BLGK), up(v_BLGK), segment_ids_BL, context_attention=cfg.context_attention,
                         layout="zigzag").astype(dtype)
    k_BLHK, v_BLHK = (k_BLGK, v_BLGK) if expand is None else (expand(k_BLGK), expand(v_BLGK))
    if segment_ids_BL is not None and cfg.attention == "cudnn":
        raise ValueError("segment ids (packed documents) need attention='blocked' or 'xla': jaxpar's attention='cudnn' "
                         "path takes no per-document mask; set GPTConfig/LlamaConfig attention='blocked'")
    platform = jax.devices()[0].platform
    if cfg.attention == "cudnn" and (platform != "gpu" or dtype not in (jnp.float16, jnp.bfloat16)):
        raise ValueError(f"attention='cudnn' (cuDNN flash attention) needs a GPU and float16/bfloat16 compute; got "
                         f"{platform} devices and {jnp.dtype(dtype).name} compute: use a bf16 policy "
                         "(jp.precision.Policy.from_string('mixed_bf16')) on a GPU, or attention='blocked'")
    if dtype == jnp.float16 and cfg.attention != "cudnn":
        # fp16 attention logits overflow easily, and XLA:CPU cannot lower f16 dot_product_attention:
        # take attention in float32.
        q_BLHK, k_BLHK, v_BLHK = (t.astype(jnp.float32) for t in (q_BLHK, k_BLHK, v_BLHK))
    if cfg.attention == "blocked":
        a_BLHK = causal_attention(q_BLHK, k_BLHK, v_BLHK, cfg.attention_blocks, segment_ids_BL)
    else:
        mask = None if segment_ids_BL is None else (
            segment_ids_BL[:, None, :, None] == segment_ids_BL[:, None, None, :])   # [B, 1, Q, S]: same document
        a_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BLHK, v_BLHK, mask=mask, is_causal=True,
                                              implementation=cfg.attention)
    return a_BLHK.astype(dtype)


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


@jax.checkpoint
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019, eq. 4) over the last axis with float32 statistics, as HF's
    ``LlamaRMSNorm``: ``scale * (x / sqrt(mean(x^2) + eps))`` (the normalised value in ``x``'s dtype first);
    rematerialised like :func:`layer_norm`."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)).astype(x.dtype)
    return (scale.astype(jnp.float32) * y.astype(jnp.float32)).astype(x.dtype)


@jax.checkpoint
def silu(x: jax.Array) -> jax.Array:
    """``x * sigmoid(x)`` (Elfwing et al. 2018), rematerialised like :func:`gelu`."""
    return jax.nn.silu(x)


# ------------------------------------------------------------- packed documents: the batch entries and their checks

PACKED_KEYS = ("segment_ids", "positions", "loss_mask")   # the optional batch entries of packed documents


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
