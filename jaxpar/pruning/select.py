"""Mask selection on sharded arrays: exact top-k by bisection on counts, N:M groups, ERK densities.

Nothing here sorts or gathers a tensor. Magnitudes are compared through their float32 bit patterns (for
non-negative floats the int32 bit pattern orders like the value), so a bisection over the 31-bit range finds the
exact k-th largest magnitude in 31 passes, each pass a count ``sum(bits >= t)`` that GSPMD reduces across
shards (an all-reduce of one integer per tensor). Ties at the threshold are broken by flat index (the key is
``(magnitude, reversed index)``, bisected lexicographically: about 20 more passes), so every pool keeps exactly
its target count, even for bf16 weights with many equal magnitudes.
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
_THRESHOLD_ITERS = 31          # ceil(log2(SENTINEL + 1)): the bisection range [0, SENTINEL + 1)


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


def _search(count_ge, targets: list[jax.Array], shapes: list[tuple[int, ...]], index_bound: int):
    """Per pool, the largest key ``(t, r)`` (lexicographic) with ``count_ge(t, r) >= target``.

    ``count_ge(ts, rs)`` counts, per pool, the weights whose key ``(bits, rank)`` is ``>= (t, r)``; ranks are
    distinct within a pool and lie in ``[0, index_bound)``. The first 31 rounds bisect the magnitude key ``t``
    (with ``r = 0`` the count is ``count(bits >= t)``), the rest bisect ``r`` among the ties at ``t``. Because
    ranks are distinct the final count is exactly the target. One ``fori_loop``, one count per round.
    """
    rank_iters = max(1, math.ceil(math.log2(index_bound + 1)))
    zeros = [jnp.zeros(s, jnp.int32) for s in shapes]
    carry = (zeros, [jnp.full(s, SENTINEL + 1, jnp.int32) for s in shapes],
             zeros, [jnp.full(s, index_bound + 1, jnp.int32) for s in shapes])
    half = lambda lo, hi: lo + jax.lax.shift_right_logical(hi - lo, 1)

    def body(i, carry):
        t_lo, t_hi, r_lo, r_hi = carry
        first = i < _THRESHOLD_ITERS
        t_mid = [jnp.where(first, half(l, h), l) for l, h in zip(t_lo, t_hi)]
        r_mid = [jnp.where(first, 0, half(l, h)) for l, h in zip(r_lo, r_hi)]
        ok = [c >= k for c, k in zip(count_ge(t_mid, r_mid), targets)]
        pick = lambda cond, new, old: [jnp.where(c, n, o) for c, n, o in zip(cond, new, old)]
        return (pick([o & first for o in ok], t_mid, t_lo), pick([~o & first for o in ok], t_mid, t_hi),
                pick([o & ~first for o in ok], r_mid, r_lo), pick([~o & ~first for o in ok], r_mid, r_hi))

    t, _, r, _ = jax.lax.fori_loop(0, _THRESHOLD_ITERS + rank_iters, body, carry)
    return t, r


def _at_least(bits: jax.Array, rank: jax.Array, t: jax.Array, r: jax.Array) -> jax.Array:
    return (bits > t) | ((bits == t) & (rank >= r))


def top_k_per_slice(bits: list[jax.Array], axes: list[tuple[int, ...]], keep: list[jax.Array]) -> list[jax.Array]:
    """Per leaf and per slice (reducing over ``axes``), a mask of exactly ``keep`` largest keys.

    Ties go to the lower flat index.

    Args:
      bits: int32 keys (:func:`magnitude_bits`, possibly raised to :data:`SENTINEL`).
      axes: per leaf, the axes a slice spans (the others are batch axes: stacked layers).
      keep: per leaf, an int32 count broadcastable to the slice counts ``(keepdims)``.
    """
    shapes = [tuple(1 if a in ax else n for a, n in enumerate(b.shape)) for b, ax in zip(bits, axes)]
    ranks = [b.size - 1 - flat_index(b) for b in bits]
    count_ge = lambda ts, rs: [jnp.sum(_at_least(b, q, t, r), axis=ax, keepdims=True, dtype=jnp.int32)
                               for b, q, t, r, ax in zip(bits, ranks, ts, rs, axes)]
    targets = [jnp.broadcast_to(k, s) for k, s in zip(keep, shapes)]
    t, r = _search(count_ge, targets, shapes, max(b.size for b in bits))
    return [_at_least(*args) for args in zip(bits, ranks, t, r)]


def top_k_pooled(bits: list[jax.Array], keep: jax.Array) -> list[jax.Array]:
    """Masks keeping exactly ``keep`` largest keys over all leaves together (one global threshold).

    Ties go to the earlier leaf, then the lower flat index.
    """
    total, offset, ranks = sum(b.size for b in bits), 0, []
    for b in bits:
        ranks.append(total - 1 - offset - flat_index(b))
        offset += b.size
    count_ge = lambda ts, rs: [sum(jnp.sum(_at_least(b, q, ts[0], rs[0]), dtype=jnp.int32)
                                   for b, q in zip(bits, ranks))]
    (t,), (r,) = _search(count_ge, [keep], [()], total)
    return [_at_least(b, q, t, r) for b, q in zip(bits, ranks)]


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
    """Erdos-Renyi-Kernel scale of a tensor: ``sum(shape) / prod(shape)`` (Evci et al. 2020, sec. 3).

    Pass a dense layer as its 2-D ``(fan_in, fan_out)`` (:attr:`jaxpar.pruning.paths.LeafPlan.erk_shape`), a conv
    kernel as its full shape.
    """
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

    Each shape is one layer, scaled by ``sum(shape) / prod(shape)``: give a dense layer as its 2-D
    ``(fan_in, fan_out)`` (what ``magnitude_pruning`` uses: :attr:`jaxpar.pruning.paths.LeafPlan.erk_shape`), a conv
    kernel as its full shape. Returns a float64 numpy array of one density in (0, 1] per shape; tensors that would
    exceed density 1 are dense and the rest rescaled. Raises ValueError for a sparsity outside [0, 1) or an empty shape list.
    """
    if not 0.0 <= float(sparsity) < 1.0:
        raise ValueError(f"sparsity={sparsity!r} must lie in [0, 1)")
    shapes = [tuple(int(n) for n in s) for s in shapes]
    if not shapes or any(not s or math.prod(s) == 0 for s in shapes):
        raise ValueError(f"shapes={shapes} must be a non-empty list of non-empty shapes")
    return np.asarray(erk_from_raw([erk_raw(s) for s in shapes], [math.prod(s) for s in shapes], sparsity),
                      np.float64)
