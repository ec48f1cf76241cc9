"""Routed experts' compute and expert parallelism: the experts' SwiGLU on the token choices routed to them, on one
device or with the experts split over mesh axes (:mod:`jaxpar.layers.moe` routes; this module moves and computes).

**Grouped matmuls** (dropless): the choices sorted by expert and ``jax.lax.ragged_dot`` over the experts' stacked
weights with the group sizes (MegaBlocks, Gale et al. 2022; MaxText's ``layers/moe.py``). On XLA:CPU (jax 0.10.2)
``ragged_dot`` lowers to one dense ``dot`` of a block-masked copy of the rows ``[R, E * D]`` against the weights
flattened ``[E * D, F]``: exact, E times the FLOPs of the grouped product (GPUs today: a dense fallback too,
marin#7012). Rows past the groups' total come back 0; its gradient reaches both operands.

**Capacity buffers** (GShard, Lepikhin et al. 2020): each expert holds ``capacity`` slots per group of tokens (a
sequence); a kept choice is written to its slot of a dense ``[groups, E, C, D]`` buffer, the experts run as
batched matmuls, and each choice reads its slot back (a dropped choice reads 0).

**Expert parallelism** folds the experts onto token (batch, context) mesh axes (``Rules.mesh_axes('experts')``:
each device holds ``E / EP`` experts and its own rows of tokens). Inside ``jax.shard_map`` manual over the token
axes, the expert axes and the expert-tensor axis (``expert_mlp``, each expert's hidden dim split as Megatron
splits the MLP: its partial outputs are summed over it after the down projection), two dispatches:

* ``"ring"`` (MaxText's ring of experts, marin's default): all-gather the tokens and their routing over the expert
  axes, compute the local experts' choices, ``psum_scatter`` the weighted outputs back to the tokens' devices.
* ``"all_to_all"``: ``jax.lax.all_to_all`` of each device's choices to their experts' devices and back; dropless,
  each destination's buffer holds every local choice (the worst case: all to one device); in capacity mode the
  GShard buffers ``[groups, E, C, D]`` split by expert.

Axes already manual when the layer is traced (a pipeline's stages) are used as they are: their arrays are local.
Inside such a region the layer opens no nested ``shard_map`` (Shardy rejects a nested partial-manual one's
backward), and where the token or expert axes it would need are not all manual there it refuses (GSPMD's
collectives inside a pipeline's per-stage branches deadlock the idle stages).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxpar import _compat
from jaxpar.sharding.names import BATCH, EXPERT_MLP, EXPERTS, SEQ, Rules, axes_entry
from jaxpar.sharding.rules import DEFAULT_RULES

DISPATCHES = ("ring", "all_to_all")
"""Expert-parallel dispatches (module docstring)."""


# ------------------------------------------------------------------------------------------ local experts

def _swiglu_grouped(x_RD: jax.Array, sizes_E: jax.Array, wg_EDF, wu_EDF, wd_EFD) -> jax.Array:
    """``[R, D]`` rows sorted by expert (``sizes_E`` rows for each, int32, total <= R) through their expert's
    SwiGLU ``(silu(x Wg) * (x Wu)) Wd`` with ``jax.lax.ragged_dot``; rows past the total give 0."""
    gate = jax.lax.ragged_dot(x_RD, wg_EDF, sizes_E)
    up = jax.lax.ragged_dot(x_RD, wu_EDF, sizes_E)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, wd_EFD, sizes_E)


def _dropless_rows(x_TD: jax.Array, token_R: jax.Array, expert_R: jax.Array, wg_EDF, wu_EDF, wd_EFD) -> jax.Array:
    """Row ``r`` of the result ``[R, D]``: expert ``expert_R[r]``'s SwiGLU of token ``x_TD[token_R[r]]``; a row whose
    expert is outside ``[0, E)`` (another device's expert) gives 0. Sorts by expert, :func:`_swiglu_grouped`,
    unsorts."""
    E = wg_EDF.shape[0]
    mine = (expert_R >= 0) & (expert_R < E)
    key = jnp.where(mine, expert_R, E)                      # other devices' choices sort last, outside every group
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=E + 1)[:E].astype(jnp.int32)
    out = _swiglu_grouped(x_TD[token_R[order]], sizes, wg_EDF, wu_EDF, wd_EFD)
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return jnp.where(mine[:, None], out[unsort], 0)


def _swiglu_buffers(x_GECD: jax.Array, wg_EDF, wu_EDF, wd_EFD) -> jax.Array:
    """Capacity buffers ``[..., E, C, D]`` through each expert's SwiGLU as batched matmuls (an empty slot, 0,
    gives 0: no biases)."""
    gate = jnp.einsum("...ecd,edf->...ecf", x_GECD, wg_EDF)
    up = jnp.einsum("...ecd,edf->...ecf", x_GECD, wu_EDF)
    return jnp.einsum("...ecf,efd->...ecd", jax.nn.silu(gate) * up, wd_EFD)


def _buffers_in(x_TD: jax.Array, token_R: jax.Array, slot_R: jax.Array, size: int) -> jax.Array:
    """``[size, D]`` flat capacity buffers: token ``x_TD[token_R[r]]`` at ``slot_R[r]`` (-1: nowhere), zeros
    elsewhere."""
    where = jnp.where(slot_R >= 0, slot_R, size)            # out of bounds: dropped by the scatter
    return jnp.zeros((size, x_TD.shape[-1]), x_TD.dtype).at[where].set(x_TD[token_R], mode="drop")


def _buffers_out(out_SD: jax.Array, slot_R: jax.Array) -> jax.Array:
    """Each row's output read back from its flat buffer slot (``-1``: 0)."""
    where = jnp.where(slot_R >= 0, slot_R, out_SD.shape[0])
    return out_SD.at[where].get(mode="fill", fill_value=0)


def _combine(rows_RD: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """The tokens' outputs ``[T, D]`` float32: each token's ``k`` choice rows (row ``t * k + j``) weighted."""
    T, k = weights_TK.shape
    return jnp.einsum("tk,tkd->td", weights_TK, rows_RD.reshape(T, k, -1).astype(jnp.float32))


def _capacity_slot(expert_TK: jax.Array, slot_TK: jax.Array, group_rows: int, experts: int, capacity: int):
    """Flat buffer slots ``[T * k]`` of ``[T / group_rows, experts, capacity]`` buffers: ``(group, expert, slot)`` of
    each choice whose expert is in ``[0, experts)`` and whose slot is below ``capacity``, else -1."""
    group = (jnp.arange(expert_TK.shape[0], dtype=jnp.int32) // group_rows)[:, None]
    keep = (expert_TK >= 0) & (expert_TK < experts) & (slot_TK >= 0) & (slot_TK < capacity)
    return jnp.where(keep, (group * experts + expert_TK) * capacity + slot_TK, -1).reshape(-1)


# ------------------------------------------------------------------------------------------ dispatches

def _local_experts(w: tuple, num_experts: int, ep_axes: tuple[str, ...], n: int) -> tuple:
    """The expert weights of this device's experts: as they are when they arrive split, else its slice."""
    if w[0].shape[0] == num_experts // n or n == 1:
        return w
    first = jax.lax.axis_index(ep_axes) * (num_experts // n)
    return tuple(jax.lax.dynamic_slice_in_dim(x, first, num_experts // n, 0) for x in w)


def _ring(x_TD, expert_TK, weights_TK, slot_TK, w, *, ep_axes, n, capacity, group_rows):
    """Ring dispatch (module docstring); ``n`` devices over ``ep_axes``. Returns this device's tokens' outputs
    ``[T, D]`` float32 (partial over an expert-tensor axis)."""
    if ep_axes:
        gather = lambda a: _compat.all_gather_16bit_safe(a, ep_axes)
        x_TD, expert_TK, weights_TK = gather(x_TD), gather(expert_TK), gather(weights_TK)
        slot_TK = None if slot_TK is None else gather(slot_TK)
    E_loc = w[0].shape[0]
    local = expert_TK - (jax.lax.axis_index(ep_axes) * E_loc if ep_axes else 0)
    T, k = expert_TK.shape
    token = jnp.repeat(jnp.arange(T, dtype=jnp.int32), k)
    if slot_TK is None:
        rows = _dropless_rows(x_TD, token, local.reshape(-1), *w)
    else:
        flat = _capacity_slot(local, slot_TK, group_rows, E_loc, capacity)
        size = T // group_rows * E_loc * capacity
        out = _swiglu_buffers(_buffers_in(x_TD, token, flat, size).reshape(-1, E_loc, capacity, x_TD.shape[-1]), *w)
        rows = _buffers_out(out.reshape(size, -1), flat)
    y = _combine(rows, weights_TK)
    return jax.lax.psum_scatter(y, ep_axes, scatter_dimension=0, tiled=True) if ep_axes else y


def _all_to_all(x_TD, expert_TK, weights_TK, slot_TK, w, *, ep_axes, n, capacity, group_rows):
    """All-to-all dispatch (module docstring). Returns this device's tokens' outputs ``[T, D]`` float32."""
    T, k = expert_TK.shape
    D, E_loc = x_TD.shape[-1], w[0].shape[0]
    swap = (lambda a: jax.lax.all_to_all(a, ep_axes, 0, 0, tiled=True)) if ep_axes else (lambda a: a)
    token = jnp.repeat(jnp.arange(T, dtype=jnp.int32), k)
    if slot_TK is not None:   # GShard: the [groups, E, C, D] buffers, split by expert to the experts' devices
        flat = _capacity_slot(expert_TK, slot_TK, group_rows, n * E_loc, capacity)
        G, size = T // group_rows, T // group_rows * n * E_loc * capacity
        buf = _buffers_in(x_TD, token, flat, size).reshape(G, n, E_loc, capacity, D).transpose(1, 0, 2, 3, 4)
        out = swap(_swiglu_buffers(swap(buf), *w)).transpose(1, 0, 2, 3, 4)
        return _combine(_buffers_out(out.reshape(size, D), flat), weights_TK)
    # dropless: every choice to its expert's device, in a buffer per destination sized for all R of them
    R = T * k
    dest, local = jnp.divmod(expert_TK.reshape(-1), E_loc)
    slot = jnp.take_along_axis(jnp.cumsum(jax.nn.one_hot(dest, n, dtype=jnp.int32), axis=0) - 1, dest[:, None],
                               axis=1)[:, 0]
    sent = jnp.zeros((n, R, D), x_TD.dtype).at[dest, slot].set(x_TD[token])
    sent_expert = jnp.full((n, R), E_loc, jnp.int32).at[dest, slot].set(local)   # E_loc: an empty row
    got, got_expert = swap(sent), swap(sent_expert)
    rows = _dropless_rows(got.reshape(n * R, D), jnp.arange(n * R, dtype=jnp.int32), got_expert.reshape(-1), *w)
    back = swap(rows.reshape(n, R, D))
    return _combine(back[dest, slot], weights_TK)


# --------------------------------------------------------------------------------------- the manual region

def manual_axes(mesh: Any) -> set[str]:
    """The mesh axes of size > 1 the trace is manual over (inside ``jax.shard_map``: a pipeline's stages)."""
    return set() if mesh is None or mesh.empty else {
        a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual and mesh.shape[a] > 1}


def _manual_axis_names(mesh: Any) -> tuple[str, ...]:
    """Every mesh axis the trace is manual over, whatever its size."""
    return () if mesh.empty else tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual)


def _split(rules: Rules, name: str | tuple, mesh: Any) -> tuple[str, ...]:
    return tuple(a for a in rules.mesh_axes(name, mesh) if mesh.shape[a] > 1)


def current_rules(rules: Any = None) -> Rules:
    """``rules``, else the logical rules jaxpar traces under (``nn.logical_axis_rules``), else the defaults."""
    return Rules(rules if rules is not None else (nn.get_logical_axis_rules() or DEFAULT_RULES))


def expert_axes(mesh: Any, rules: Any = None) -> tuple[str, ...]:
    """The mesh axes (size > 1) the ``experts`` dim is split over under ``rules`` (:func:`current_rules`)."""
    return () if mesh is None or mesh.empty else _split(current_rules(rules), EXPERTS, mesh)


def check_expert_parallel(num_experts: int, mesh: Any, rules: Any = None, token_names: tuple = (BATCH, SEQ)) -> int:
    """The expert-parallel size: the product of the sizes of :func:`expert_axes`.

    Raises:
      ValueError: the experts' axes are not among the token axes (the batch's and the sequence's: experts fold
        onto the devices that hold tokens), or ``num_experts`` is not divisible by the expert-parallel size.
    """
    axes = expert_axes(mesh, rules)
    if not axes:
        return 1
    tokens = {a for name in token_names for a in current_rules(rules).mesh_axes(name, mesh)}
    if not set(axes) <= tokens:
        raise ValueError(f"the rules split the experts over mesh axes {axes}, but tokens are split over "
                         f"{tuple(sorted(tokens))}: expert parallelism folds onto the batch (or sequence) axes; map "
                         "'experts' to some of those (jp.sharding.expert_parallel_rules)")
    n = math.prod(mesh.shape[a] for a in axes)
    if num_experts % n:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {n} (mesh axes "
                         f"{axes}): choose an expert-parallel size dividing the experts")
    return n


def _check_whole_groups(T: int, group_rows: int | None, axes: list, mesh: Any) -> None:
    """Capacity mode over ``[T, D]`` tokens split over mesh ``axes``: every device's rows must be whole groups (its
    buffers are per group), else ValueError naming the sizes and the fixes."""
    shards = math.prod(mesh.shape[a] for a in axes)
    rows = group_rows or T
    if shards > 1 and (T % shards or (T // shards) % rows):
        raise ValueError(f"MoE capacity mode counts slots per sequence of {rows} rows, but the {T} [T, D] tokens are "
                         f"split {shards} ways over mesh axes {axes} ({T / shards:g} rows a device): every device "
                         "must hold whole sequences; pass the tokens as [B, L, D], or a seq_len dividing "
                         f"{T // shards if T % shards == 0 else 'T / devices'}, or use dropless routing "
                         "(capacity_factor=None)")


def dispatch(x: jax.Array, expert: jax.Array, weights: jax.Array, slot: jax.Array | None, w: tuple, *,
             num_experts: int, capacity: int = 0, group_rows: int | None = None, how: str = "ring",
             mesh: Any = None, rules: Any = None) -> jax.Array:
    """The routed experts' weighted outputs of every token, under whatever expert parallelism the rules give.

    Args:
      x: tokens ``[T, D]`` or ``[B, L, D]`` (compute dtype), rows over the batch axes (and ``L`` over context).
      expert: ``[..., k]`` int32 chosen experts of each token. weights: ``[..., k]`` float32 their weights.
      slot: ``[..., k]`` int32 capacity slot of each choice (GShard priority, :func:`jaxpar.layers.moe.capacity_slots`),
        or None: dropless.
      w: the routed experts' ``(gate [E, D, F], up [E, D, F], down [E, F, D])`` weights.
      num_experts: E. capacity: slots per expert per group (capacity mode). group_rows: consecutive rows of a
        ``[T, D]`` input forming one group (a ``[B, L, D]`` input: its rows of each sequence); None: all.
      how: one of :data:`DISPATCHES`. mesh, rules: default the abstract mesh and rules jaxpar traces under.

    Returns:
      ``x``'s shape, float32.

    Raises:
      ValueError: an unknown ``how``; :func:`check_expert_parallel`'s errors; inside a manual region (a pipeline's
        stages) whose manual axes leave some of the token or expert axes automatic.
    """
    if how not in DISPATCHES:
        raise ValueError(f"dispatch={how!r}; use one of {DISPATCHES}")
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    rules = current_rules(rules)
    n = check_expert_parallel(num_experts, mesh, rules) if not mesh.empty else 1
    ep = expert_axes(mesh, rules)
    manual = manual_axes(mesh)
    three_d = x.ndim == 3
    lead = (lambda a: _split(rules, a, mesh)) if not mesh.empty else (lambda a: ())
    batch, seq, etp = lead(BATCH), lead(SEQ), lead(EXPERT_MLP)
    new = [a for a in (*batch, *seq, *ep) if a not in manual]
    if new and manual:
        # Inside another manual region (a pipeline's stages) a nested partial-manual shard_map fails Shardy's
        # verifier in the backward, and leaving these axes to GSPMD puts its collectives inside the region's
        # per-stage branches, where idle stages never join them (a rendezvous that times out and aborts).
        raise ValueError(f"the MoE layer runs inside a region manual over {sorted(manual)} (a pipeline's stages) "
                         f"but its token or expert axes {new} are not manual there: the pipeline must be manual over "
                         "the batch axes too (jp.pipeline.Pipeline is, unless its stage function takes an rng or "
                         "grad_reduce='action'); use a stage function without rng, or no expert parallelism and no "
                         "batch split inside the pipeline")
    opened = sorted(set(new) | ({*etp} - manual), key=mesh.axis_names.index) if new else []
    if slot is not None and not three_d:
        _check_whole_groups(x.shape[0], group_rows, [a for a in opened if a in (*batch, *seq)], mesh)
    summed = tuple(a for a in etp if a in opened or a in manual)   # expert-tensor axes holding partial outputs

    def body(x, expert, weights, slot, *w):
        # a 16-bit input the devices share over a manual axis: its gradient summed in float32 (XLA:CPU aborts on
        # a 16-bit reduction inside a partial-manual region; _compat.vary_16bit_safe)
        every = _manual_axis_names(jax.sharding.get_abstract_mesh())
        x, *w = (_compat.vary_16bit_safe(a, every) for a in (x, *w))
        shape = x.shape
        rows = shape[1] if three_d else (group_rows or math.prod(shape[:-1]))
        kw = dict(ep_axes=ep, n=n, capacity=capacity, group_rows=rows)
        fn = _ring if how == "ring" else _all_to_all
        flat = lambda a: None if a is None else a.reshape(-1, a.shape[-1])
        y = fn(x.reshape(-1, shape[-1]), flat(expert), flat(weights), flat(slot),
               _local_experts(w, num_experts, ep, n), **kw)
        return (jax.lax.psum(y, summed) if summed else y).reshape(shape)

    if not opened:
        return body(x, expert, weights, slot, *w)
    keep = lambda axes: axes_entry(tuple(a for a in axes if a in opened))
    tok = (P(keep(batch), keep(seq), None) if three_d else P(keep((*batch, *seq)), None))
    E_, F_ = keep(ep), keep(etp)
    w_specs = (P(E_, None, F_), P(E_, None, F_), P(E_, F_, None))
    if slot is None:
        f = jax.shard_map(lambda x, e, g, *w: body(x, e, g, None, *w), in_specs=(tok, tok, tok, *w_specs),
                          out_specs=tok, axis_names=set(opened))
        return f(x, expert, weights, *w)
    f = jax.shard_map(body, in_specs=(tok,) * 4 + w_specs, out_specs=tok, axis_names=set(opened))
    return f(x, expert, weights, slot, *w)


__all__ = ["DISPATCHES", "check_expert_parallel", "current_rules", "dispatch", "expert_axes", "manual_axes"]
