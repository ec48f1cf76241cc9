"""Optimizers for the experiments: AdamW with warm-up + cosine decay, and which leaves weight decay touches.

Which leaves decay is decided by what a leaf *is*, read from its logical axis names (the same names that
shard it), never from its leaf name: a model may call its matrices ``kernel``, ``qkv_kernel`` or ``w_in``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.sharding import rules as shd
from jaxpar.sharding.names import POSITION, SEQ, VOCAB

EMBEDDING_AXIS_NAMES = frozenset({VOCAB, SEQ, POSITION})    # a table indexed by token or position


def _decays(path, leaf, names: tuple | None) -> bool:
    if not jnp.issubdtype(leaf.dtype, jnp.floating):   # bfloat16 / float8 included (numpy does not count them)
        return False
    if names is not None:
        core = [n for n in names if n not in shd.STACKED_AXIS_NAMES]
        return len(core) >= 2 and not any(n in EMBEDDING_AXIS_NAMES for n in core)
    leaf_name = str(getattr(path[-1], "key", getattr(path[-1], "name", ""))).lower() if path else ""
    return np.ndim(leaf) >= 2 and not any(part in leaf_name for part in shd.NON_MATRIX_NAME_PARTS)


def decay_mask(params: Any, axis_names: Any = None) -> Any:
    """A tree of bools with the structure of ``params``: True where weight decay applies.

    With logical names (``axis_names``: the Flax-boxed ``jax.eval_shape(init_fn, rng)``, or a tree of logical
    ``PartitionSpec`` s; see :func:`jaxpar.sharding.leaf_axis_names`), a leaf decays when it is a matrix: at
    least two axes other than stacked ``layers``/``stage`` axes, none of them ``vocab`` or ``seq``. So every
    weight matrix decays (the GPT's ``qkv_kernel [layers, embed, heads, 3, kv]``, ``out_kernel``,
    ``up_kernel``, ``down_kernel``; an MLP's ``kernel``), and norm scales, biases (also when stacked as
    ``[layers, embed]``), token and position embedding tables and the ``[embed, vocab]`` unembedding do not.
    A leaf without names in an otherwise named tree is judged by the fallback.

    Fallback without names (``axis_names=None`` and a leaf without names): a floating leaf of rank >= 2 decays
    unless its name contains ``bias``, ``scale``, ``norm`` or ``embedding``
    (:data:`jaxpar.sharding.NON_MATRIX_NAME_PARTS`, the parts the pruning transforms skip too), so a stacked
    ``[layers, embed]`` norm scale or bias is not taken for a matrix by its rank. On the GPT (tied embeddings,
    the default) it decays the same leaves as the names do. What it cannot tell without names: an untied
    ``[embed, vocab]`` unembedding (the GPT's ``head/kernel``), which it decays, and a bias or scale whose name
    says neither (pass names for such a model).

    This follows the common practice of decaying matrices only (Loshchilov & Hutter 2019 decay all weights;
    GPT-2-style recipes exclude biases and norms). nanoGPT also decays its embeddings (every 2-D parameter,
    tied ``wte`` included); jaxpar does not, because an embedding row of a rare token would decay towards zero
    on every step while its gradient is almost always zero.

    Raises:
      ValueError: ``axis_names`` does not have the structure of ``params``.
    """
    names = shd.leaf_axis_names(params, axis_names)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    return jax.tree.unflatten(treedef, [_decays(path, leaf, n) for (path, leaf), n in zip(flat, names)])


def adamw(learning_rate: float, *, total_steps: int, warmup_steps: int = 0, weight_decay: float = 0.1,
          b1: float = 0.9, b2: float = 0.95, clip_norm: float | None = 1.0,
          final_lr_ratio: float = 0.1, axis_names: Any = None) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019) with linear warm-up then cosine decay, for the experiments.

    Weight decay applies to weight matrices only (:func:`decay_mask`, decided from ``axis_names`` when
    given: pass ``jax.eval_shape(init_fn, rng)``). ``clip_norm`` clips the global gradient norm first
    (Pascanu et al. 2013) when given. The learning rate rises linearly from 0 to ``learning_rate`` over
    ``warmup_steps``, then follows a cosine down to ``final_lr_ratio * learning_rate`` at ``total_steps``
    (``optax.warmup_cosine_decay_schedule``).

    Raises:
      TypeError: a hyperparameter that is not a number (e.g. a schedule: use ``optax.adamw`` for that).
      ValueError: a hyperparameter out of range (the message names it), or ``axis_names`` whose structure is
        not the params' (at ``init``).
    """
    numbers = dict(learning_rate=learning_rate, weight_decay=weight_decay, b1=b1, b2=b2,
                   final_lr_ratio=final_lr_ratio, clip_norm=0.0 if clip_norm is None else clip_norm)
    for name, value in numbers.items():
        if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
            raise TypeError(f"adamw {name}={value!r} must be a number (this adamw builds its own warm-up + cosine "
                            f"schedule; for a schedule of your own use optax.adamw(schedule, ...))")
    for name, value in dict(total_steps=total_steps, warmup_steps=warmup_steps).items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"adamw {name}={value!r} must be an int (steps)")
    if total_steps < 1 or warmup_steps < 0 or warmup_steps >= total_steps:
        raise ValueError(f"need total_steps >= 1 and 0 <= warmup_steps < total_steps, got "
                         f"{total_steps=}, {warmup_steps=}")
    ok = dict(learning_rate=learning_rate > 0, weight_decay=weight_decay >= 0, b1=0 <= b1 < 1, b2=0 <= b2 < 1,
              final_lr_ratio=0 <= final_lr_ratio <= 1, clip_norm=numbers["clip_norm"] >= 0)
    for name, value in numbers.items():
        if not ok[name] or not math.isfinite(value):
            raise ValueError(f"adamw {name}={value!r} is out of range: need learning_rate > 0, weight_decay >= 0, "
                             "0 <= b1, b2 < 1, 0 <= final_lr_ratio <= 1, clip_norm >= 0 or None (0/None: no clipping)")
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup_steps, total_steps, end_value=learning_rate * final_lr_ratio)
    opt = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay,
                      mask=lambda params: decay_mask(params, axis_names))
    return optax.chain(optax.clip_by_global_norm(clip_norm), opt) if clip_norm else opt


__all__ = ["adamw", "decay_mask"]
