"""Causal attention over a sequence sharded on a mesh axis: context parallelism (CP).

The rules in context map the logical ``seq`` axis of activations to a mesh axis (``jp.sharding.DEFAULT_RULES``:
``context``). Where that axis has more than one device, :func:`causal` runs inside ``jax.shard_map`` manual over
it (the other axes stay automatic, so batch, heads and tensor parallelism compose): every device keeps its own
queries and meets the keys and values of the whole sequence one block at a time, folding each block into
running softmax statistics (the online softmax of Milakov & Gimelshein 2018, sec. 3). Two strategies:

* ``"ring"``: the K/V blocks travel round the devices with ``ppermute``, ``context - 1`` hops, each sent
  before the block in hand is computed so transfer and compute can overlap (Liu et al. 2023, "Ring Attention
  with Blockwise Transformers", sec. 3);
* ``"all_gather"``: one ``all_gather`` of K and V, then the same blocks (the context parallelism of the Llama 3
  paper, Dubey et al. 2024, sec. 3.3.2).

Causal load balance: with a ``"contiguous"`` layout device ``i`` holds chunk ``i`` and the last device does most of
the work. The ``"zigzag"`` layout cuts the sequence into ``2 * context`` chunks and gives device ``i`` chunks ``i``
and ``2 * context - 1 - i`` (Megatron-core's CP split; Brandon et al. 2023, "Striped Attention", sec. 3): every
device then computes ``2 * context + 1`` blocks of ``(L / 2C)^2`` scores, and no block wholly above the diagonal
is ever computed. :func:`to_zigzag` / :func:`from_zigzag` reorder per-token arrays (inputs, targets, positions,
masks; outputs back); :func:`shard_sequence` reorders a batch, :func:`positions` gives the original positions
of the slots; :func:`work_per_device` counts each device's blocks.

One kernel serves every path: with the ``seq`` axis unsharded (``context == 1``) the kernel's only step is the
device's own keys, attended in query blocks that skip the keys above the diagonal (:func:`causal_attention`, the
models' ``"blocked"`` attention). :data:`BACKENDS` names every way to attend: ``"blocked"``, ``"xla"`` and
``"cudnn"`` on one device's sequence (:data:`ONE_DEVICE`, ``GPTConfig.attention``), ``"ring"`` and
``"all_gather"`` over a context axis (:data:`STRATEGIES`); :func:`attend` picks one from a model's config.

Every backend takes ``window=`` (sliding-window attention by position, :mod:`jaxpar.layers.sliding_window`):
the blocked kernel and the context strategies leave out the keys and ring steps outside every query's window.

Shape legend: B batch, L sequence (the whole one; ``n`` on one device), H query heads, G key/value heads (``H``
a multiple of ``G``: grouped-query attention), K head dim.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

from jaxpar.layers.attention_blocks import (empty_block as _empty, merge as _merge, partial_block as _partial,
                                            visible as _visible, whole as _whole)
from jaxpar.layers.sliding_window import (check_window, chunk_positions, devices_seeing, first_key, near, query_blocks,
                                          ring_steps, window_blocks)
from jaxpar.sharding.names import CONTEXT, PIPE, SEQ, Rules

STRATEGIES = ("ring", "all_gather")     # how K/V reach every device: ppermute hops, or one all_gather
LAYOUTS = ("zigzag", "contiguous")      # which chunks of the sequence a device holds


# ---------------------------------------------------------------------------------------------- the mesh axis

def context_axis() -> tuple[str | None, int]:
    """``(mesh axis, size)`` the logical ``seq`` axis maps to under the mesh and rules in context; ``(None, 1)``
    where there is no mesh or rules in context, ``seq`` maps to nothing, or its axis has one device.

    Raises:
      ValueError: rules that map ``seq`` to several mesh axes (context parallelism runs over one).
    """
    mesh, rules = jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules()
    if _manual_context(mesh):   # inside a shard_map manual over it (a pipeline's stages): rules no longer name it
        return CONTEXT, mesh.shape[CONTEXT]
    if mesh.empty or not rules:
        return None, 1
    axes = Rules(rules).mesh_axes(SEQ)
    if len(axes) > 1:
        raise ValueError(f"the rules map 'seq' to mesh axes {axes}; context parallelism shards the sequence "
                         "over one mesh axis: map 'seq' to 'context' (jp.sharding.DEFAULT_RULES)")
    if not axes or axes[0] not in mesh.shape or mesh.shape[axes[0]] == 1:
        return None, 1
    return axes[0], mesh.shape[axes[0]]


def _manual(mesh: Any, axis: str) -> bool:
    """Whether the trace is inside a ``shard_map`` manual over the mesh axis ``axis`` of size > 1."""
    return (not mesh.empty and axis in mesh.axis_names and mesh.shape[axis] > 1
            and dict(zip(mesh.axis_names, mesh.axis_types))[axis] == AxisType.Manual)


def _manual_context(mesh: Any) -> bool:
    """Whether the trace is inside a ``shard_map`` manual over a ``context`` axis of size > 1."""
    return _manual(mesh, CONTEXT)


def _in_pipeline_stages(mesh: Any) -> bool:
    """Whether the trace is inside a pipeline's stages: a ``shard_map`` manual over ``pipe`` (size > 1), where
    the stages run different actions at one tick, each in a ``lax.switch`` branch only some devices take
    (:mod:`jaxpar.pipeline.interpreter`). The mesh in context says it: nothing is passed beside the trace."""
    return _manual(mesh, PIPE)


def check_in_stages(context_attention: str, context: int, in_stages: bool) -> None:
    """Raises ValueError for ``context_attention="ring"`` over a context axis of ``context > 1`` devices inside
    pipeline stages (``in_stages``: :func:`causal` reads it from the mesh in context; an entry point passes
    whether it pipelines). The ring's ``ppermute`` would run in a branch only some stages take at a tick, and
    XLA:CPU's collective-permute waits for every device of the program, so the ticks would mix."""
    if context > 1 and context_attention == "ring" and in_stages:
        raise ValueError(
            "context_attention='ring' inside pipeline stages (a mesh with pipe > 1 and context > 1): the ring's "
            "ppermute would run inside the actions, which the stages take at different ticks, and XLA:CPU's "
            "collective-permute waits for every device (the ticks would mix). Use context_attention='all_gather' "
            "with a pipeline (GPTConfig/LlamaConfig.context_attention, or this function's argument); the ring "
            "without one")


def _check(seq_len: int, context: int, layout: str, strategy: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; use one of {LAYOUTS}")
    if strategy not in STRATEGIES:
        raise ValueError(f"context_attention={strategy!r}; use one of {STRATEGIES}")
    parts = 2 * context if layout == "zigzag" else context
    if seq_len % parts:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {parts} (the {layout} layout cuts it into "
            f"{'2 x ' if layout == 'zigzag' else ''}context={context} chunks); use a sequence length that is a "
            f"multiple of {parts}, or a smaller context axis")


# ----------------------------------------------------------------------------------------- the zigzag layout

def zigzag_order(seq_len: int, context: int) -> np.ndarray:
    """The original position of each slot of the zigzag layout (int ``[seq_len]``): device ``i`` holds chunks ``i``
    and ``2 * context - 1 - i`` of ``seq_len / (2 * context)`` tokens each, in that order.

    Raises:
      ValueError: ``seq_len`` not divisible by ``2 * context``.
    """
    _check(seq_len, context, "zigzag", "ring")
    c = seq_len // (2 * context)
    chunks = [j for i in range(context) for j in (i, 2 * context - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def to_zigzag(x: jax.Array, context: int, axis: int = 1) -> jax.Array:
    """Reorders ``x``'s sequence ``axis`` (length ``L``, divisible by ``2 * context``) into the zigzag layout:
    ``to_zigzag(x)[..., s, ...] == x[..., zigzag_order(L, context)[s], ...]`` (reshapes and a reverse, no gather).
    ``context == 1`` returns ``x``."""
    if context == 1:
        return x
    axis = axis % x.ndim
    L = x.shape[axis]
    _check(L, context, "zigzag", "ring")
    y = x.reshape(*x.shape[:axis], 2, context, L // (2 * context), *x.shape[axis + 1:])
    first = jax.lax.index_in_dim(y, 0, axis, keepdims=False)
    second = jnp.flip(jax.lax.index_in_dim(y, 1, axis, keepdims=False), axis)
    return jnp.stack([first, second], axis + 1).reshape(x.shape)


def from_zigzag(x: jax.Array, context: int, axis: int = 1) -> jax.Array:
    """The inverse of :func:`to_zigzag`: a per-token output in the zigzag layout back in the original order."""
    if context == 1:
        return x
    axis = axis % x.ndim
    L = x.shape[axis]
    _check(L, context, "zigzag", "ring")
    y = x.reshape(*x.shape[:axis], context, 2, L // (2 * context), *x.shape[axis + 1:])
    first = jax.lax.index_in_dim(y, 0, axis + 1, keepdims=False)
    second = jnp.flip(jax.lax.index_in_dim(y, 1, axis + 1, keepdims=False), axis)
    return jnp.stack([first, second], axis).reshape(x.shape)


def shard_sequence(batch: dict, keys: tuple[str, ...] = ("inputs", "targets", "segment_ids", "positions",
                                                         "loss_mask")) -> dict:
    """A batch with its per-token entries in the zigzag layout for the context axis in context: every leaf of rank
    >= 2 of the entries named in ``keys`` (``[B, L, ...]``) reordered along axis 1 (:func:`to_zigzag`), other
    entries kept. Where the sequence is not sharded (:func:`context_axis` size 1) the batch itself is returned.
    The model then takes each token's original position from :func:`positions` (or from a reordered
    ``"positions"`` entry, packed documents).

    Raises:
      ValueError: a sequence length not divisible by ``2 * context``.
    """
    _, context = context_axis()
    if context == 1:
        return batch
    move = lambda t: jax.tree.map(lambda a: to_zigzag(a, context) if jnp.ndim(a) >= 2 else a, t)
    return {k: move(v) if k in keys else v for k, v in batch.items()}


def positions(seq_len: int) -> np.ndarray | None:
    """Each slot's original position (int32 ``[seq_len]``) when the sequence is sharded over a context axis (the
    zigzag layout :func:`shard_sequence` gives); None where it is not. Models read it where they would use
    ``arange(seq_len)``: learned position tables and rotary angles follow the original token order. Inside a
    ``shard_map`` manual over the context axis (a pipeline stage), ``seq_len`` is the device's own length and the
    result is its slots' positions (traced, from ``axis_index``).

    Raises:
      ValueError: ``seq_len`` not divisible by ``2 * context``.
    """
    _, context = context_axis()
    if context == 1:
        return None
    if _manual_context(jax.sharding.get_abstract_mesh()):   # this device's two chunks of a longer sequence
        c, i = seq_len // 2, jax.lax.axis_index(CONTEXT)
        return jnp.concatenate([i * c + jnp.arange(c), (2 * context - 1 - i) * c + jnp.arange(c)]).astype(jnp.int32)
    return zigzag_order(seq_len, context).astype(np.int32)


def work_per_device(context: int, layout: str = "zigzag") -> dict[str, np.ndarray]:
    """The attention blocks :func:`causal` computes on each device, in units of one ``(L / 2C) x (L / 2C)`` block
    of scores (``L / C`` query rows of the contiguous layout count as two such rows): ``"computed"`` (float
    ``[context]``: every score the kernel evaluates, masked or not) and ``"unmasked"`` (the query-key pairs at or
    below the diagonal among them; the useful FLOPs). The zigzag layout: ``2C + 1`` computed and ``2C`` unmasked on
    every device; the contiguous one: device ``i`` computes ``4i + 4`` and ``4i + 2`` of them.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; use one of {LAYOUTS}")
    if layout == "zigzag":   # step 0: two diagonal blocks and one full one; then two full blocks a step
        computed = np.full(context, 3.0 + 2 * (context - 1))
        return {"computed": computed, "unmasked": computed - 1.0}
    i = np.arange(context, dtype=float)   # chunk i is 2 units long: its diagonal (4 computed, 2 unmasked), i full chunks
    return {"computed": 4 * i + 4, "unmasked": 4 * i + 2}


# ---------------------------------------------------------------------------------------------- the kernel
#
# One online softmax (Milakov & Gimelshein 2018, alg. 3) serves "blocked", "ring" and "all_gather" ("xla" and
# "cudnn" are jax's own kernels): a device's queries are cut into blocks, each block meets key blocks one at a
# time, and the partial outputs with their row maxima and sums are merged. Step 0 is the device's own keys,
# attended causally in query blocks that skip the keys above the diagonal; context parallelism adds one key block
# per other device (:func:`_kernel`). With one device there is no other step: every query block meets all its
# keys in one block, where the online softmax is the softmax itself, so the block is normalised in place (jax's
# softmax and its JVP) and nothing is merged.

def _rows(x, start, stop):
    return None if x is None else x[:, start:stop]


def _join(blocks):
    return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=1)


def _own_keys(q, k, v, seg, bounds, whole: bool, window: int | None = None, pos=None):
    """Step 0: query block ``[s, e)`` against the keys ``[f, e)`` of the same local sequence, causally (the block
    skipping of FlashAttention, Dao et al. 2022, sec. 3.1, without its tiling of keys): ``f = 0``, or with a
    ``window`` the first slot within it (:func:`~jaxpar.layers.sliding_window.first_key`: the keys before it are
    never computed), the window masked by the slots' positions ``pos`` (int ``[n]``). A list of outputs
    (``whole``) or of ``(o, m, l)`` partials, one per block."""
    block, out = _whole if whole else _partial, []
    for s, e in bounds:
        f = first_key(s, window)
        close = None if window is None else near(pos[s:e], pos[f:e], window)
        vis = _visible(_rows(seg, s, e), _rows(seg, f, e), s - f, e - s, e - f, q.ndim, close)
        out.append(block(q[:, s:e], k[:, f:e], v[:, f:e], vis))
    return out


def _kernel(q_BnHK, k_BnGK, v_BnGK, seg_Bn, *, axis: str | None = None, context: int = 1, strategy: str = "ring",
            layout: str = "contiguous", num_blocks: int = 1, window: int | None = None):
    """One device's causal attention: its ``n`` local queries against its own keys (step 0), then, inside a
    ``shard_map`` manual over ``axis`` (``context > 1``), against the K/V block of every other device whose keys
    some query sees (:func:`~jaxpar.layers.sliding_window.ring_steps`: with a ``window``, the others are skipped).
    ``context == 1`` takes keys and values with the queries' ``H`` heads and cuts the queries into ``num_blocks``
    blocks (more with a window: :func:`~jaxpar.layers.sliding_window.window_blocks`); over a context axis K/V
    keep their ``G`` heads (only they travel) and the queries are grouped instead."""
    if context == 1:
        L = q_BnHK.shape[1]
        bounds = query_blocks(L, window_blocks(L, num_blocks, window))
        return _join(_own_keys(q_BnHK, k_BnGK, v_BnGK, seg_Bn, bounds, True, window, np.arange(L))) \
            .astype(q_BnHK.dtype)
    B, n, H, K = q_BnHK.shape
    G = k_BnGK.shape[2]
    q = q_BnHK.reshape(B, n, G, H // G, K)
    zig = layout == "zigzag"
    me = jax.lax.axis_index(axis)
    pos = chunk_positions(me, n, context, layout, window)
    # Zigzag: rows [0, n/2) are chunk `me` (its diagonal), rows [n/2, n) chunk 2C-1-me (chunk `me` wholly below
    # them, then their diagonal): each chunk's query blocks (one, or about a window each) over the local keys,
    # their partials joined per chunk.
    chunk = n // 2 if zig else n
    per = query_blocks(chunk, window_blocks(chunk, 1, window, min_rows=1))   # one block a row at most, as ever
    own = _own_keys(q, k_BnGK, v_BnGK, seg_Bn, [(o + s, o + e) for o in range(0, n, chunk) for s, e in per], False,
                    window, pos)
    accs = [tuple(_join(list(x)) for x in zip(*own[i:i + len(per)])) for i in range(0, len(own), len(per))]
    kv = jnp.stack([k_BnGK, v_BnGK])          # one transfer of K and V per hop
    if strategy == "all_gather":
        every_kv = jax.lax.all_gather(kv, axis)
        every_seg = None if seg_Bn is None else jax.lax.all_gather(seg_Bn, axis)
    held_kv, held_seg, held_step = kv, seg_Bn, 0
    for step in ring_steps(n * context, context, layout, window):   # steps nobody's window reaches are skipped
        src = (me - step) % context
        if strategy == "ring":   # the next block travels while this one is computed
            hop = [(j, (j + step - held_step) % context) for j in range(context)]
            held_kv = jax.lax.ppermute(held_kv, axis, hop)
            held_seg = None if seg_Bn is None else jax.lax.ppermute(held_seg, axis, hop)
            held_step = step
        else:
            held_kv = jax.lax.dynamic_index_in_dim(every_kv, src, 0, keepdims=False)
            held_seg = None if seg_Bn is None else jax.lax.dynamic_index_in_dim(every_seg, src, 0, keepdims=False)
        branches = [functools.partial(f, zig=zig, window=window) for f in (_above, _below)]
        branch = (src < me).astype(jnp.int32)   # 1: the source device's first chunk lies below all of this one's rows
        seeing = devices_seeing(n * context, context, layout, window, step)
        if window is not None and not seeing.all():   # devices whose queries see none of these keys compute nothing
            branch = jnp.where(jnp.asarray(seeing)[me], branch, 2)
            branches.append(functools.partial(_unseen, zig=zig))
        blks = jax.lax.switch(branch, branches, q, held_kv, seg_Bn, held_seg, pos,
                              chunk_positions(src, n, context, layout, window))
        accs = [_merge(a, b) for a, b in zip(accs, blks)]
    return _join([o / l[..., None] for o, _, l in accs]).reshape(B, n, H, K).astype(q_BnHK.dtype)


def _below(q, kv, seg_q, seg_k, pos_q, pos_k, zig: bool, window: int | None):
    """Source chunk(s) from a device before this one: every local row sees the source's first chunk (zigzag: its
    second chunk lies above every local row); contiguous: the source's whole chunk. With a window, the keys
    within it by position (``pos_q``, ``pos_k``: int ``[n]``)."""
    n = q.shape[1]
    c = kv.shape[2] // 2 if zig else kv.shape[2]
    close = None if window is None else near(pos_q, pos_k[:c], window)
    o, m, l = _partial(q, kv[0][:, :c], kv[1][:, :c], _visible(seg_q, _rows(seg_k, 0, c), None, n, c, 5, close))
    if not zig:
        return [(o, m, l)]
    h = n // 2
    return [(o[:, :h], m[:, :h], l[:, :h]), (o[:, h:], m[:, h:], l[:, h:])]


def _unseen(q, *_, zig: bool):
    """Source chunks no local query sees (outside every window): nothing computed, an empty partial a chunk."""
    return [_empty(q[:, :q.shape[1] // 2]), _empty(q[:, q.shape[1] // 2:])] if zig else [_empty(q)]


def _above(q, kv, seg_q, seg_k, pos_q, pos_k, zig: bool, window: int | None):
    """Source chunk(s) from a device after this one: zigzag: only the local second chunk's rows see them, both
    of them (with a window, those within it by position); contiguous: nothing is visible."""
    if not zig:
        return [_empty(q)]
    h = q.shape[1] // 2
    close = None if window is None else near(pos_q[h:], pos_k, window)
    return [_empty(q[:, :h]),
            _partial(q[:, h:], kv[0], kv[1], _visible(_rows(seg_q, h, 2 * h), seg_k, None, h, 2 * h, 5, close))]


# ------------------------------------------------------------------------------------------------ backends

def causal_attention(q_BLHK: jax.Array, k_BLHK: jax.Array, v_BLHK: jax.Array, num_blocks: int = 2,
                     segment_ids_BL: jax.Array | None = None, window: int | None = None) -> jax.Array:
    """Causal softmax attention ``softmax(q k^T / sqrt(K) + mask) v`` (Vaswani et al. 2017, eq. 1), ``[B, L, H, K]``,
    on one device: the ``"blocked"`` backend, the kernel's case of a single device.

    The queries are cut into ``num_blocks`` contiguous blocks; block ``i`` (rows ``[s_i, e_i)``) attends to keys
    ``[0, e_i)`` only, so the fully masked blocks above the diagonal are never computed (the block skipping of
    FlashAttention, Dao et al. 2022, sec. 3.1, without its tiling of keys): logits, softmax and their gradients
    cost ``(n + 1) / (2 n)`` of full attention. The logits and the softmax are float32, the probabilities are
    cast to ``v``'s dtype for the second product, and the output has ``q``'s dtype, as in
    ``jax.nn.dot_product_attention``'s XLA path. Plain einsums and a softmax: it runs (and shards over batch
    and heads) on any backend.

    ``segment_ids_BL`` (int ``[B, L]``, optional): packed documents; a query attends only to the keys of its own
    segment (same id), so no attention crosses documents. Every query sees at least itself (the diagonal), so
    padding (any id, e.g. 0) never gives an all-masked, NaN row.

    ``window`` (a positive int, or None: full causal): sliding-window attention, key ``j`` visible from query
    ``i`` iff ``i - j < window`` besides ``j <= i`` (:mod:`jaxpar.layers.sliding_window`). The queries are then
    cut into blocks of about a quarter window (:func:`~jaxpar.layers.sliding_window.window_blocks`) and block
    ``[s, e)`` meets keys ``[max(0, s - window + 1), e)`` only: the keys wholly outside the window are never
    computed, and attention costs about ``1.25 L window`` scores instead of ``L^2 / 2``.

    Raises:
      ValueError: ``window`` not a positive int or None.
    """
    return _kernel(q_BLHK, k_BLHK, v_BLHK, segment_ids_BL, num_blocks=num_blocks, window=check_window(window))


def _fused(q_BLHK, k_BLHK, v_BLHK, segment_ids_BL, *, implementation: str, window: int | None = None, **_):
    """``jax.nn.dot_product_attention`` (``"xla"``, or ``"cudnn"``: cuDNN flash attention) with the causal mask and
    ``local_window_size=(window - 1, 0)``: the same window (XLA masks the scores; cuDNN takes a window length)."""
    window = check_window(window)
    mask = None if segment_ids_BL is None else (
        segment_ids_BL[:, None, :, None] == segment_ids_BL[:, None, None, :])   # [B, 1, Q, S]: same document
    return jax.nn.dot_product_attention(q_BLHK, k_BLHK, v_BLHK, mask=mask, is_causal=True,
                                        local_window_size=None if window is None else (window - 1, 0),
                                        implementation=implementation)


def _over_context(q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, *, strategy: str, layout: str, window: int | None = None,
                  **_):
    """The kernel inside a ``shard_map`` manual over the context axis (or as it is, already inside one)."""
    axis, context = context_axis()
    window = check_window(window)
    body = lambda q, k, v, s: _kernel(q, k, v, s, axis=axis, context=context, strategy=strategy, layout=layout,
                                      window=window)
    if _manual_context(jax.sharding.get_abstract_mesh()):   # local arrays already
        return body(q_BLHK, k_BLGK, v_BLGK, segment_ids_BL)
    spec = P(None, axis)
    if segment_ids_BL is None:
        return jax.shard_map(lambda q, k, v: body(q, k, v, None), in_specs=(spec,) * 3, out_specs=spec,
                             axis_names={axis})(q_BLHK, k_BLGK, v_BLGK)
    return jax.shard_map(body, in_specs=(spec,) * 4, out_specs=spec, axis_names={axis})(
        q_BLHK, k_BLGK, v_BLGK, segment_ids_BL)


# The backend table: name -> fn(q_BLHK, k, v, segment_ids_BL, *, num_blocks, layout, window) -> [B, L, H, K]. The
# one-device backends (ONE_DEVICE) take keys and values with the queries' H heads; the context strategies take the
# G heads. window: None (full causal) or a positive int (sliding window, jaxpar.layers.sliding_window).
BACKENDS = {
    "blocked": lambda q, k, v, s, *, num_blocks=2, window=None, **_: causal_attention(q, k, v, num_blocks, s, window),
    "xla": functools.partial(_fused, implementation="xla"),
    "cudnn": functools.partial(_fused, implementation="cudnn"),
    "ring": functools.partial(_over_context, strategy="ring"),
    "all_gather": functools.partial(_over_context, strategy="all_gather"),
}
ONE_DEVICE = ("blocked", "xla", "cudnn")   # GPTConfig/LlamaConfig.attention


def causal(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, segment_ids_BL: jax.Array | None = None, *,
           context_attention: str = "ring", layout: str = "contiguous", num_blocks: int = 2,
           window: int | None = None) -> jax.Array:
    """Causal softmax attention ``softmax(q k^T / sqrt(K) + mask) v`` (Vaswani et al. 2017, eq. 1) that shards
    the sequence over the mesh axis the rules map ``seq`` to (:func:`context_axis`).

    Args:
      q_BLHK: queries ``[B, L, H, K]`` (any float dtype; logits and softmax are float32, the output has q's dtype).
      k_BLGK, v_BLGK: keys and values ``[B, L, G, K]``, ``H`` a multiple of ``G`` (grouped-query attention:
        query head ``h`` uses key head ``h // (H // G)``; the K/V heads travel, never repeated copies).
      segment_ids_BL: int ``[B, L]`` or None: packed documents; a query attends only to keys of its own segment.
      context_attention: ``"ring"`` or ``"all_gather"`` (see the module docstring).
      layout: ``"contiguous"`` (the sequence in its own order: correct, but the last device does most of the
        causal work) or ``"zigzag"`` (the sequence as :func:`to_zigzag` orders it: balanced; the caller
        reorders inputs, positions and targets, e.g. with :func:`shard_sequence`).
      num_blocks: the single-device path's query blocks (``context == 1``).
      window: None (full causal) or a positive int: sliding-window attention by the tokens' positions (in the
        original order, whatever the layout; :mod:`jaxpar.layers.sliding_window`). Keys outside every query's
        window are skipped: key blocks on one device, ring steps over the context axis
        (:func:`~jaxpar.layers.sliding_window.ring_steps`: the zigzag layout keeps far more of them than the
        contiguous one, since every device holds an early and a late chunk).

    Returns:
      ``[B, L, H, K]`` in q's dtype, in the layout of the inputs.

    Raises:
      ValueError: an unknown strategy or layout; ``L`` not divisible by ``2 * context`` (zigzag) or ``context``;
        ``H`` not a multiple of ``G``; shapes that disagree (segment ids included); ``window`` not a positive int
        or None.

    The zigzag layout is a promise about the inputs: they must have been reordered by :func:`shard_sequence` (or
    :func:`to_zigzag`) inside the traced loss, where the mesh is in context; inputs in their own order with
    ``layout="zigzag"`` give wrong attention (nothing can detect it). The default ``"contiguous"`` is always
    correct, only unbalanced.
    """
    if q_BLHK.ndim != 4 or k_BLGK.shape != v_BLGK.shape or k_BLGK.shape[:2] != q_BLHK.shape[:2] \
            or k_BLGK.shape[3] != q_BLHK.shape[3] or q_BLHK.shape[2] % k_BLGK.shape[2]:
        raise ValueError(f"causal attention takes q [B, L, H, K] and k, v [B, L, G, K] with H a multiple of G; got "
                         f"q {tuple(q_BLHK.shape)}, k {tuple(k_BLGK.shape)}, v {tuple(v_BLGK.shape)}")
    if segment_ids_BL is not None and tuple(segment_ids_BL.shape) != tuple(q_BLHK.shape[:2]):
        raise ValueError(f"segment_ids {tuple(segment_ids_BL.shape)} must be [B, L] = {tuple(q_BLHK.shape[:2])}, the "
                         "queries' batch and sequence")
    window = check_window(window)
    axis, context = context_axis()
    mesh = jax.sharding.get_abstract_mesh()
    manual = _manual_context(mesh)   # already inside a shard_map over it: local arrays
    _check(q_BLHK.shape[1] * (context if manual else 1), context, layout, context_attention)
    check_in_stages(context_attention, context, _in_pipeline_stages(mesh))
    if context == 1:
        reps = q_BLHK.shape[2] // k_BLGK.shape[2]
        k, v = (jnp.repeat(t, reps, axis=2) if reps > 1 else t for t in (k_BLGK, v_BLGK))
        return BACKENDS["blocked"](q_BLHK, k, v, segment_ids_BL, num_blocks=num_blocks, window=window)
    return BACKENDS[context_attention](q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, layout=layout, window=window)


def _backend(cfg: Any, dtype: Any, segments: bool) -> str:
    """The backend ``cfg`` asks for here: ``cfg.context_attention`` with the sequence over a context axis, else
    ``cfg.attention``; raises where it cannot run."""
    if context_axis()[1] > 1:
        if cfg.attention == "cudnn":
            raise ValueError("attention='cudnn' cannot shard the sequence over the context axis (cuDNN's kernel sees "
                             "one device's keys); set GPTConfig/LlamaConfig attention='blocked', which runs "
                             f"context_attention={cfg.context_attention!r} over it, or use a mesh with context=1")
        return cfg.context_attention
    if segments and cfg.attention == "cudnn":
        raise ValueError("segment ids (packed documents) need attention='blocked' or 'xla': jaxpar's attention='cudnn' "
                         "path takes no per-document mask; set GPTConfig/LlamaConfig attention='blocked'")
    # the mesh's devices, not the process's: compile-only GPU devices (jp.plan.gpu_target) on a CPU machine count
    mesh_device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = jax.devices()[0].platform if mesh_device is None else mesh_device.platform
    if cfg.attention == "cudnn" and (platform != "gpu" or dtype not in (jnp.float16, jnp.bfloat16)):
        raise ValueError(f"attention='cudnn' (cuDNN flash attention) needs a GPU and float16/bfloat16 compute; got "
                         f"{platform} devices and {jnp.dtype(dtype).name} compute: use a bf16 policy "
                         "(jp.precision.Policy.from_string('mixed_bf16')) on a GPU, or attention='blocked'")
    return cfg.attention


def attend(cfg: Any, q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array,
           segment_ids_BL: jax.Array | None = None, expand: Any = None, window: int | None = None) -> jax.Array:
    """Causal attention by ``cfg.attention`` (a GPTConfig or LlamaConfig) from :data:`BACKENDS`; float16 is taken
    in float32.

    ``segment_ids_BL`` (int ``[B, L]``, optional): attention stays within each segment (packed documents), on the
    ``"blocked"`` and ``"xla"`` paths. ``expand``: the model's ``[B, L, G, K] -> [B, L, H, K]`` of keys and values
    (grouped-query heads), applied here on one device's sequence; with the sequence sharded over a context axis
    (:func:`jaxpar.layers.attention.context_axis`), the ``G`` heads go to :func:`jaxpar.layers.attention.causal` (zigzag layout,
    ``cfg.context_attention``), which repeats them locally. ``window``: None (full causal) or a positive int, the
    sliding window of this layer (key ``j`` visible from query ``i`` iff ``j <= i`` and ``i - j < window``, by
    position; every backend; :mod:`jaxpar.layers.sliding_window`).

    Raises:
      ValueError: ``"cudnn"`` off a GPU or in float32; ``"cudnn"`` with segment ids or a context axis; ``window``
        not a positive int or None.
    """
    window = check_window(window)
    dtype = q_BLHK.dtype
    name = _backend(cfg, dtype, segment_ids_BL is not None)
    # fp16 attention logits overflow easily, and XLA:CPU cannot lower f16 dot_product_attention: take attention in
    # float32, except in cuDNN's kernel.
    up = (lambda t: t.astype(jnp.float32)) if dtype == jnp.float16 and name != "cudnn" else (lambda t: t)
    if name not in ONE_DEVICE:
        return causal(up(q_BLHK), up(k_BLGK), up(v_BLGK), segment_ids_BL, context_attention=name,
                      layout="zigzag", window=window).astype(dtype)
    k_BLHK, v_BLHK = (k_BLGK, v_BLGK) if expand is None else (expand(k_BLGK), expand(v_BLGK))
    a_BLHK = BACKENDS[name](up(q_BLHK), up(k_BLHK), up(v_BLHK), segment_ids_BL, num_blocks=cfg.attention_blocks,
                            window=window)
    return a_BLHK.astype(dtype)


__all__ = ["BACKENDS", "LAYOUTS", "ONE_DEVICE", "attend", "STRATEGIES", "causal", "check_in_stages", "context_axis",
           "from_zigzag", "positions", "shard_sequence", "to_zigzag", "work_per_device", "zigzag_order"]
