"""Mask selection on sharded arrays: exact top-k by bisection on counts, N:M groups, ERK densities.

Nothing here sorts or gathers a tensor. Magnitudes are compared through their float32 bit patterns (for
non-negative floats the int32 bit pattern orders like the value), so a bisection over the 31-bit range finds the
exact k-th largest magnitude in 31 passes, each pass a count ``sum(bits >= t)`` that GSPMD reduces across
shards (an all-reduce of one integer per tensor). Ties at the threshold are broken by flat index (a second
bisection on an index bound), so every pool keeps exactly its target count even for bf16 weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

INF_BITS = 0x7F800000          # bit pattern of +inf: the largest magnitude
SENTINEL = INF_BITS + 1        # above every magnitude: marks weights that must be kept (N:M top-N)
_THRESHOLD_ITERS = 31          # ceil(log2(SENTINEL + 2)): the bisection range [0, SENTINEL + 2)


def magnitude_bits(x: jax.Array) -> jax.Array:
    """int32 keys ordered like ``|x|`` (float32 bit pattern); NaN counts as 0 (pruned first)."""
    mag = jnp.abs(x.astype(jnp.float32))
    mag = jnp.where(jnp.isnan(mag), 0.0, mag)
    return jax.lax.bitcast_convert_type(mag, jnp.int32)


def _explicit_spec(x: jax.Array):
    """The PartitionSpec of ``x`` when it lives on a mesh with Explicit axes (sharding in types), else None."""
    sharding = jax.typeof(x).sharding
    types = getattr(sharding.mesh, "axis_types", ())
    return sharding.spec if any(t == AxisType.Explicit for t in types) else None


def like(new: jax.Array, old: jax.Array) -> jax.Array:
    """``new`` with ``old``'s sharding type on Explicit meshes (``lax.cond`` branches must agree); else ``new``."""
    spec = _explicit_spec(old)
    if spec is None or _explicit_spec(new) == spec:
        return new
    return jax.reshard(new, spec)


def flat_index(x: jax.Array) -> jax.Array:
    """int32 row-major flat index of every element of ``x``, laid out like ``x`` (sharded where it is)."""
    spec = _explicit_spec(x)
    strides = np.cumprod((x.shape[1:] + (1,))[::-1])[::-1]
    idx = jnp.zeros(x.shape, jnp.int32) if spec is None else jnp.zeros(x.shape, jnp.int32, out_sharding=spec)
    for d, stride in enumerate(strides):
        if x.shape[d] > 1:
            idx = idx + jax.lax.broadcasted_iota(jnp.int32, x.shape, d, out_sharding=spec) * int(stride)
    return idx


def bisect(count_ge, targets: Sequence[jax.Array], lo: Sequence[jax.Array], hi: Sequence[jax.Array],
           iters: int) -> list[jax.Array]:
    """Elementwise the largest ``x`` in ``[lo, hi)`` with ``count_ge(x) >= target``.

    ``count_ge`` maps a list of int32 arrays to counts of the same shapes, non-increasing in ``x``; it must hold
    that ``count_ge(lo) >= target``. ``iters`` must be at least ``ceil(log2(max(hi - lo)))``.
    """
    def body(_, carry):
        lo, hi = carry
        mid = [l + (h - l) // 2 for l, h in zip(lo, hi)]
        ok = [c >= k for c, k in zip(count_ge(mid), targets)]
        return ([jnp.where(o, m, l) for o, m, l in zip(ok, mid, lo)],
                [jnp.where(o, h, m) for o, m, h in zip(ok, mid, hi)])
    return jax.lax.fori_loop(0, iters, body, (list(lo), list(hi)))[0]


def _count(pred: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    return jnp.sum(pred, axis=axes, keepdims=True, dtype=jnp.int32)


def _drop_ties(bits: list[jax.Array], thresholds: list[jax.Array], drops: list[jax.Array],
               axes: list[tuple[int, ...]]) -> list[jax.Array]:
    """Keep masks: ``bits > t``, plus the ties ``bits == t`` except the ``drop`` ties of largest flat index."""
    idx = [flat_index(b) for b in bits]
    ties = [b == t for b, t in zip(bits, thresholds)]

    def bounds():
        count_ge = lambda bs: [_count(tie & (i >= B), ax) for tie, i, B, ax in zip(ties, idx, bs, axes)]
        lo = [jnp.zeros_like(d) for d in drops]
        hi = [jnp.full_like(d, b.size + 1) for d, b in zip(drops, bits)]
        iters = max(math.ceil(math.log2(b.size + 1)) for b in bits)
        return bisect(count_ge, drops, lo, hi, iters)

    none = lambda: [jnp.full_like(d, b.size) for d, b in zip(drops, bits)]
    any_drop = jnp.any(jnp.stack([jnp.any(d > 0) for d in drops]))
    limits = jax.lax.cond(any_drop, bounds, none)
    return [(b > t) | (tie & (i < B)) for b, t, tie, i, B in zip(bits, thresholds, ties, idx, limits)]


def top_k_per_slice(bits: list[jax.Array], axes: list[tuple[int, ...]], keep: list[jax.Array]) -> list[jax.Array]:
    """Per leaf and per slice (reducing over ``axes``), a mask of exactly ``keep`` largest keys.

    Args:
      bits: int32 keys (:func:`magnitude_bits`, possibly raised to :data:`SENTINEL`).
      axes: per leaf, the axes a slice spans (the others are batch axes: stacked layers).
      keep: per leaf, an int32 count broadcastable to the slice counts ``(keepdims)``.
    """
    shapes = [tuple(1 if a in ax else n for a, n in enumerate(b.shape)) for b, ax in zip(bits, axes)]
    count_ge = lambda ts: [_count(b >= t, ax) for b, t, ax in zip(bits, ts, axes)]
    lo = [jnp.zeros(s, jnp.int32) for s in shapes]
    hi = [jnp.full(s, SENTINEL + 1, jnp.int32) for s in shapes]
    targets = [jnp.broadcast_to(k, s) for k, s in zip(keep, shapes)]
    t = bisect(count_ge, targets, lo, hi, _THRESHOLD_ITERS)
    drops = [c - k for c, k in zip(count_ge(t), targets)]
    return _drop_ties(bits, t, drops, axes)


def top_k_pooled(bits: list[jax.Array], keep: jax.Array) -> list[jax.Array]:
    """Masks keeping exactly ``keep`` largest keys over all leaves together (one global threshold).

    Ties at the threshold are kept in leaf order then flat-index order.
    """
    all_axes = [tuple(range(b.ndim)) for b in bits]
    total = lambda t: [sum(jnp.sum(b >= t[0], dtype=jnp.int32) for b in bits)]
    zero = jnp.zeros((), jnp.int32)
    t = bisect(total, [keep], [zero], [jnp.full((), SENTINEL + 1, jnp.int32)], _THRESHOLD_ITERS)[0]
    excess = total([t])[0] - keep
    eq = jnp.stack([jnp.sum(b == t, dtype=jnp.int32) for b in bits])
    after = jnp.cumsum(eq[::-1])[::-1] - eq                    # ties in later leaves
    drops = jnp.clip(excess - after, 0, eq)                     # drop ties from the last leaves first
    shape1 = lambda b: (1,) * b.ndim
    return _drop_ties(bits, [jnp.reshape(t, shape1(b)) for b in bits],
                      [jnp.reshape(drops[i], shape1(b)) for i, b in enumerate(bits)], all_axes)


def top_n_in_groups(bits: jax.Array, reduction_axes: tuple[int, ...], n: int, m: int) -> jax.Array:
    """Mask of the ``n`` largest of every ``m`` consecutive weights along the (flattened) reduction axes.

    The reduction axes are moved last (in order) and flattened row-major, then split into groups of ``m``:
    for ``[heads, kv, embed]`` with reduction ``(heads, kv)`` a group is ``m`` consecutive ``kv`` entries of
    one head, matching the ``[heads * kv, embed]`` matrix the model multiplies by. Ties go to the earlier
    weight, so every group keeps exactly ``n``. No sort: ranks by ``m`` pairwise comparisons.
    """
    nd, r = bits.ndim, len(reduction_axes)
    moved = jnp.moveaxis(bits, reduction_axes, tuple(range(nd - r, nd)))
    lead = moved.shape[:nd - r]
    size = math.prod(moved.shape[nd - r:])
    groups = moved.reshape(*lead, size // m, m)
    position = jnp.arange(m, dtype=jnp.int32)
    rank = jnp.zeros(groups.shape, jnp.int32)
    for j in range(m):
        other = groups[..., j:j + 1]
        rank = rank + ((other > groups) | ((other == groups) & (j < position))).astype(jnp.int32)
    keep = (rank < n).reshape(moved.shape)
    return jnp.moveaxis(keep, tuple(range(nd - r, nd)), reduction_axes)


def erk_raw(shape: Sequence[int]) -> float:
    """Erdos-Renyi-Kernel scale of a tensor: ``sum(shape) / prod(shape)`` (Evci et al. 2020, sec. 3)."""
    return float(sum(shape)) / float(math.prod(shape))


def erk_from_raw(raw: Sequence[float], sizes: Sequence[int], sparsity) -> jax.Array:
    """ERK densities (float32, one per entry) with overall density ``1 - sparsity`` over ``sizes`` weights.

    ``density_i = eps * raw_i``, ``eps`` chosen so ``sum_i density_i * size_i = (1 - sparsity) * sum(sizes)``;
    entries whose density would exceed 1 are made dense and ``eps`` is solved again over the rest, until none
    exceeds 1 (Evci et al. 2020, sec. 3 and their ``sparse_utils.get_sparsities``). ``sparsity`` may be traced.
    """
    raw = jnp.asarray(raw, jnp.float32)
    sizes = jnp.asarray(sizes, jnp.float32)
    keep = (1.0 - jnp.asarray(sparsity, jnp.float32)) * jnp.sum(sizes)

    def scale(dense):
        budget = keep - jnp.sum(jnp.where(dense, sizes, 0.0))
        denom = jnp.sum(jnp.where(dense, 0.0, raw * sizes))
        return jnp.where(denom > 0, budget / jnp.where(denom > 0, denom, 1.0), 0.0)

    dense = jnp.zeros(raw.shape, bool)
    for _ in range(len(raw)):          # the dense set only grows: len(raw) rounds reach the fixed point
        dense = dense | (scale(dense) * raw > 1.0)
    return jnp.where(dense, 1.0, scale(dense) * raw)


def erk_densities(shapes: Sequence[Sequence[int]], sparsity: float) -> np.ndarray:
    """ERK densities (Evci et al. 2020, sec. 3) of tensors of ``shapes`` at overall ``sparsity``.

    Returns a float64 numpy array of one density in (0, 1] per shape; tensors that would exceed density 1 are
    dense and the rest rescaled. Raises ValueError for a sparsity outside [0, 1) or an empty shape list.
    """
    if not 0.0 <= float(sparsity) < 1.0:
        raise ValueError(f"sparsity={sparsity!r} must lie in [0, 1)")
    shapes = [tuple(int(n) for n in s) for s in shapes]
    if not shapes or any(not s or math.prod(s) == 0 for s in shapes):
        raise ValueError(f"shapes={shapes} must be a non-empty list of non-empty shapes")
    return np.asarray(erk_from_raw([erk_raw(s) for s in shapes], [math.prod(s) for s in shapes], sparsity),
                      np.float64)
