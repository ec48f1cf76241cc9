"""The ``magnitude_pruning`` optax transformation, its state, and inspection helpers."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar._tree import key_path
from jaxpar.train._jit import check_live
from jaxpar.pruning import select
from jaxpar.pruning.schedules import SparsitySchedule, as_schedule, constant_sparsity
from jaxpar.pruning.paths import LeafPlan, Path, ReductionAxes, flat_update, make_plans

DISTRIBUTIONS = ("uniform", "global", "erk")


class MagnitudePruningState(NamedTuple):
    """State of :func:`magnitude_pruning` (optax style: arrays only, so it jits, shards and checkpoints).

    Attributes:
      count: int32 scalar, the number of updates seen: the step the sparsity schedule is evaluated at.
      masks: a tree with the params' structure: a bool mask of the param's shape (True = kept) for every
        pruned leaf, None for the others. ``jp.train.init_state`` gives each mask its param's sharding.
    """
    count: jax.Array
    masks: Any


def _check_n_m(n_m) -> tuple[int, int]:
    ok = (isinstance(n_m, (tuple, list)) and len(n_m) == 2
          and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in n_m)
          and 0 < n_m[0] < n_m[1])
    if not ok:
        raise ValueError(f"n_m={n_m!r} must be a pair (N, M) of ints with 0 < N < M, e.g. (2, 4)")
    return int(n_m[0]), int(n_m[1])


def _schedule_for(sparsity, n_m: tuple[int, int] | None) -> SparsitySchedule:
    if n_m is None:
        if sparsity is None:
            raise ValueError("sparsity is required without n_m: a number in [0, 1) or a schedule such as "
                             "jp.pruning.polynomial_sparsity(0.9, begin_step, end_step)")
        return as_schedule(sparsity)
    target = 1.0 - n_m[0] / n_m[1]
    if sparsity is None:
        return constant_sparsity(target)
    schedule = as_schedule(sparsity)
    if abs(schedule.final - target) > 1e-6 or schedule.initial > schedule.final:
        raise ValueError(
            f"n_m={n_m} prunes to sparsity 1 - N/M = {target:g}, but the sparsity schedule goes from "
            f"{schedule.initial:g} to {schedule.final:g}; omit sparsity or make its final value {target:g}")
    return schedule


def magnitude_pruning(sparsity: float | SparsitySchedule | None = None, distribution: str = "uniform",
                      n_m: tuple[int, int] | None = None, prunable: Callable[[Path], bool] | None = None, *,
                      axis_names: Any = None, reduction_axes: ReductionAxes = None) -> optax.GradientTransformation:
    """Magnitude pruning as an optax transformation, chained **after** the optimizer.

    ``optax.chain(optax.adamw(lr), magnitude_pruning(polynomial_sparsity(0.9, 0, 1000, frequency=100)))``.
    ``update(updates, state, params)`` needs ``params``. At a mask refresh (``sparsity.refresh(count)``) it
    ranks every pruned weight by ``|params + updates|`` (the value it is about to take) and keeps the largest;
    it always returns ``where(mask, updates, -params)``: a newly pruned weight lands on exactly 0.0, and a
    pruned weight keeps getting ``-params`` = 0, so no later update (momentum, Adam moments, decoupled
    weight decay) revives it. Between refreshes masks are fixed; at a refresh a pruned weight can come back if
    its would-be magnitude ranks among the kept ones.

    The state update is a pure function of ``(updates, state, params)``, so inside
    ``jp.precision.loss_scaling`` a skipped step discards it and prunes nothing.

    Sharded params are never gathered nor sorted: each tensor's (or the global) threshold is the exact k-th
    largest magnitude found by bisection on counts, which GSPMD reduces across shards; ties are broken by flat
    index, so counts are exact. N:M groups are formed by a reshape of the reduction axes, local to each shard
    when the per-shard reduction length is divisible by M.

    Args:
      sparsity: fraction of pruned weights: a schedule (:func:`polynomial_sparsity` (Zhu & Gupta 2017, eq. 1),
        :func:`constant_sparsity`, :func:`one_shot`) or a plain number (constant from step 0, masks refreshed
        every 100 steps). With ``n_m`` it may be omitted (``1 - N/M``) or its final value must be ``1 - N/M``.
      distribution: how sparsity is spread over tensors:
        ``"uniform"``: every pruned tensor at the target;
        ``"global"``: one magnitude threshold over all pruned weights (raw magnitudes); the overall count is
        exact;
        ``"erk"``: Erdos-Renyi-Kernel densities ``eps * (fan_in + fan_out) / (fan_in * fan_out)``, ``eps``
        solved for the overall target, tensors that would exceed density 1 made dense and ``eps`` solved again
        over the rest (Evci et al. 2020, "Rigging the lottery", sec. 3; RigL's ``get_sparsities``); overall
        count exact up to rounding each layer's count (less than one weight per layer). ``fan_in`` is the
        product of the reduction axes (below) and ``fan_out`` of the other non-``layers`` axes: the 2-D matrix
        the kernel multiplies by (``[embed, heads, 3, kv]`` is ``embed`` by ``heads * 3 * kv``); an unnamed
        2-D kernel is ``(fan_in, fan_out)``; an unnamed kernel of more than two axes without
        ``reduction_axes`` uses ``sum(shape) / prod(shape)`` over its axes (RigL's rule for conv kernels).
        For uniform and ERK a stacked ``[layers, ...]`` kernel is one tensor per layer (per-layer counts);
        for global it joins the one pool.
      n_m: ``(N, M)``: keep the N largest of every M consecutive weights along each kernel's reduction (input)
        axes (Mishra et al. 2021, 2:4 for sparse tensor cores). While the schedule is below ``1 - N/M``,
        each tensor keeps its N:M survivors plus the largest others (gradual N:M); at ``1 - N/M`` the mask
        is exactly N:M. Only with ``distribution="uniform"``.
      prunable: ``prunable(path) -> bool`` on the param path (a tuple of key names such as
        ``("blocks", "up_kernel")``). Default: floating kernels with at least two non-``layers`` axes whose
        name holds none of ``bias``, ``scale``, ``norm``, ``embedding``.
      axis_names: logical axis names of the params: ``jax.eval_shape(init_fn, rng)`` (Flax-boxed) or
        ``jp.sharding.logical_specs`` of it. They tell stacked ``layers`` / ``stage`` axes (batch axes) and
        the reduction axes: the non-batch axes before a trailing ``embed`` axis (``[heads, kv, embed]``,
        ``[mlp, embed]``), else the first non-batch axis (``[embed, mlp]``). Without names, axis 0 of a 2-D
        ``(in, out)`` kernel, no batch axes.
      reduction_axes: override: a tuple of axes for every pruned kernel, or ``f(path, shape) -> axes | None``
        (None: the default rule). Used by N:M and as ERK's ``fan_in``.

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`MagnitudePruningState`; updates keep their
      dtype (promoted to the param dtype if that is wider, so ``params + updates`` is exactly 0.0).

    Raises:
      ValueError: (here) a sparsity outside [0, 1), an unknown distribution, bad ``n_m``, ``n_m`` with a
        sparsity other than ``1 - N/M`` or with global/ERK, no sparsity without ``n_m``; (at ``init``) no
        prunable parameter, ``axis_names`` not matching the params, a reduction size not divisible by M, an
        N:M kernel whose reduction axes are unknown; (at ``update``) ``params`` missing, a state whose masks
        do not fit these params (another model's state), naming the leaf.
      TypeError: ``sparsity`` neither a number nor a schedule; ``prunable`` not callable.
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution={distribution!r} is unknown; use one of {DISTRIBUTIONS}")
    if n_m is not None:
        n_m = _check_n_m(n_m)
        if distribution != "uniform":
            raise ValueError(f"n_m={n_m} fixes every tensor's sparsity at 1 - N/M, so distribution="
                             f"{distribution!r} has nothing to distribute; use distribution='uniform'")
    schedule = _schedule_for(sparsity, n_m)
    if prunable is not None and not callable(prunable):
        raise TypeError(f"prunable={prunable!r} must be a callable prunable(path: tuple[str, ...]) -> bool")

    def plans_of(params):
        plans = make_plans(params, axis_names, prunable, reduction_axes, n_m)
        if not any(plans):
            raise ValueError("magnitude_pruning found no prunable parameter (default: floating kernels with at "
                             "least two non-layers axes); pass prunable=lambda path: ... to choose some")
        return plans

    def init_fn(params):
        plans = plans_of(params)
        leaves, treedef = jax.tree.flatten(params)
        masks = [jnp.ones_like(p, dtype=bool) if plan else None for p, plan in zip(leaves, plans)]
        return MagnitudePruningState(count=jnp.zeros((), jnp.int32), masks=treedef.unflatten(masks))

    def update_fn(updates, state: MagnitudePruningState, params=None):
        flat_u, treedef, flat_p = flat_update("magnitude_pruning", updates, params)
        plans = plans_of(params)
        flat_m = _check_state(state, params, plans)
        chosen = [i for i, plan in enumerate(plans) if plan]
        old = [flat_m[i] for i in chosen]

        def refresh():   # the values the params are about to take; only computed at a refresh
            candidates = [flat_p[i].astype(jnp.float32) + flat_u[i].astype(jnp.float32) for i in chosen]
            new = _select(candidates, schedule(state.count), plans=tuple(plans[i] for i in chosen),
                          distribution=distribution, n_m=n_m)
            return [select.like(m, o) for m, o in zip(new, old)]

        due = schedule.refresh(state.count)
        try:        # outside jit decide in Python: an eager lax.cond would compile both branches every call
            new_masks = refresh() if bool(due) else old
        except jax.errors.ConcretizationTypeError:
            new_masks = jax.lax.cond(due, refresh, lambda: old)
        out_u, out_m = list(flat_u), list(flat_m)
        for i, mask in zip(chosen, new_masks):
            dtype = jnp.promote_types(flat_u[i].dtype, flat_p[i].dtype)
            out_u[i] = jnp.where(mask, flat_u[i].astype(dtype), -flat_p[i].astype(dtype))
            out_m[i] = mask
        return treedef.unflatten(out_u), MagnitudePruningState(optax.safe_increment(state.count),
                                                               treedef.unflatten(out_m))

    return optax.GradientTransformation(init_fn, update_fn)


def _check_state(state: Any, params: Any, plans: list[LeafPlan | None]) -> list:
    """The state's masks in the params' flattening order; ValueError naming the leaf when the state is not for
    these params (another model's state: other structure, or a mask of another shape or where none belongs)."""
    fix = "the state belongs to other params or another prunable=/axis_names: build it with tx.init(params)"
    if not isinstance(state, MagnitudePruningState):
        raise ValueError(f"magnitude_pruning's update got a state of type {type(state).__name__}; pass the state its "
                         "init returned (tx.init(params))")
    try:   # flattened up to the params' structure, a None mask (a leaf not pruned) comes out as None
        flat_m = jax.tree.structure(params).flatten_up_to(state.masks)
    except (ValueError, TypeError):
        raise ValueError(f"magnitude_pruning state masks do not have the params' tree structure: {fix}") from None
    for (kpath, p), m, plan in zip(jax.tree_util.tree_flatten_with_path(params)[0], flat_m, plans):
        want = tuple(jnp.shape(p)) if plan else None
        got = None if m is None else tuple(jnp.shape(m))
        if got != want:
            raise ValueError(f"magnitude_pruning state mask of {key_path(kpath)} has shape "
                             f"{got} but this param needs {want} (None: not pruned): {fix}")
    return flat_m


@functools.partial(jax.jit, static_argnames=("plans", "distribution", "n_m"))
def _select(candidates: list[jax.Array], sparsity: jax.Array, *, plans: tuple[LeafPlan, ...], distribution: str,
            n_m: tuple[int, int] | None) -> list[jax.Array]:
    """Keep masks for the candidates (the values the pruned params are about to take).

    Jitted with the static plan so that eager (un-jitted) updates reuse one compilation for every step.
    """
    bits = [select.magnitude_bits(c) for c in candidates]
    if n_m is not None:
        bits = [jnp.where(select.top_n_in_groups(b, plan.reduction_axes, *n_m), select.SENTINEL, b)
                for b, plan in zip(bits, plans)]
    if distribution == "global":
        total = sum(math.prod(plan.shape) for plan in plans)
        if total > 2 ** 31 - 2:
            raise ValueError(f"distribution='global' pools {total} weights; int32 counts hold fewer than 2**31: "
                             "use 'uniform' or 'erk', or exclude tensors with prunable=")
        return select.top_k_pooled(bits, _round((1.0 - sparsity) * total))
    if distribution == "erk":
        density = select.erk_from_raw([select.erk_raw(p.erk_shape) for p in plans],
                                      [p.slice_size * p.num_slices for p in plans], sparsity)
        densities = [density[i] for i in range(len(plans))]
    else:
        densities = [1.0 - sparsity] * len(plans)
    keep = [_round(d * plan.slice_size) for d, plan in zip(densities, plans)]
    if n_m is not None:
        keep = [jnp.maximum(k, plan.slice_size // n_m[1] * n_m[0]) for k, plan in zip(keep, plans)]
    return select.top_k_per_slice(bits, [plan.core_axes for plan in plans], keep)


def _round(x: jax.Array) -> jax.Array:
    return jnp.round(x).astype(jnp.int32)


# ------------------------------------------------------------------------------------------- inspection

def _find_states(opt_state: Any) -> list[MagnitudePruningState]:
    is_state = lambda x: isinstance(x, MagnitudePruningState)
    return [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]


def masks(opt_state: Any) -> Any:
    """The pruning masks held in ``opt_state`` (anywhere inside a chain or a wrapper such as loss scaling).

    Returns:
      A tree with the params' structure: bool arrays (True = kept), sharded like the params, for pruned
      leaves and None for the others.

    Raises:
      ValueError: ``opt_state`` holds no :class:`MagnitudePruningState`, or more than one.
    """
    found = _find_states(opt_state)
    if len(found) != 1:
        raise ValueError(f"opt_state holds {len(found)} magnitude_pruning states; expected exactly one "
                         "(chain magnitude_pruning(...) once after the optimizer)")
    return found[0].masks


@jax.jit
def _count_zeros(leaves: list[jax.Array]) -> list[jax.Array]:
    return [jnp.sum(x == 0, dtype=jnp.int32) for x in leaves]


def _stats(zeros: int, size: int) -> dict[str, float | int]:
    return {"size": size, "zeros": zeros, "sparsity": zeros / size if size else 0.0}


def sparsity_report(params: Any, prunable: Callable[[Path], bool] | None = None, axis_names: Any = None) -> dict:
    """Fraction of exact zeros per tensor and in total; counts reduce over shards (nothing is gathered).

    The sparsity of a pruned model is ``report["prunable"]["sparsity"]``: the exact zeros among the elements
    of the leaves the pruning prunes (given the same ``prunable`` / ``axis_names`` as :func:`magnitude_pruning`;
    by default the kernels, never biases, norms or embeddings), as ``torch.nn.utils.prune`` users and the
    pruning literature (Zhu & Gupta 2017) report global sparsity over the weights to prune. It is 0.0 for a
    freshly initialised model and the target after pruning to it. ``report["all"]`` counts every floating
    leaf, including those never pruned (biases and norm offsets start at zero, so it is above 0 before any
    pruning): it gives the number of nonzero parameters, not the pruning's sparsity.

    Args:
      params: a tree of arrays (sharded or not).
      prunable, axis_names: as for :func:`magnitude_pruning`: which tensors count as prunable.

    Returns:
      ``{"tensors": {path: {"shape", "size", "zeros", "sparsity", "prunable"}}, "prunable": {"size", "zeros",
      "sparsity"}, "all": {...}}``: an entry per floating leaf (pruned or not), the summary over the prunable
      leaves, and the summary over every floating leaf; ``path`` joins key names with ``/``; sizes and counts
      are Python ints, sparsities Python floats (0.0 for an empty summary).

    Raises:
      ValueError: ``params`` holds a donated (deleted) array; ``axis_names`` not matching ``params``.
    """
    check_live(params)
    plans = make_plans(params, axis_names, prunable)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    floating = [i for i, (_, x) in enumerate(flat) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    counts = _count_zeros([flat[i][1] for i in floating])
    tensors, totals = {}, {True: [0, 0], False: [0, 0]}
    for i, zeros in zip(floating, jax.device_get(counts)):
        path, x = flat[i]
        size, zeros = int(np.prod(jnp.shape(x))), int(zeros)
        name = key_path(path)
        tensors[name] = {"shape": tuple(jnp.shape(x)), **_stats(zeros, size), "prunable": plans[i] is not None}
        totals[plans[i] is not None][0] += zeros
        totals[plans[i] is not None][1] += size
    everything = [totals[True][0] + totals[False][0], totals[True][1] + totals[False][1]]
    return {"tensors": tensors, "prunable": _stats(*totals[True]), "all": _stats(*everything)}

