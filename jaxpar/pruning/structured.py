"""The ``structured_pruning`` optax transformation: magnitude pruning of whole MLP neurons and attention heads."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpar.pruning import select
from jaxpar.pruning.groups import (PRUNABLE_AXES, Chains, GroupPlan, check_axes, expand, group_plans,
                                   group_sumsq, lookup, nest)
from jaxpar.pruning.schedules import SparsitySchedule, as_schedule
from jaxpar.pruning.paths import flat_update

STRUCTURED_DISTRIBUTIONS = ("uniform", "global")


class StructuredPruningState(NamedTuple):
    """State of :func:`structured_pruning` (arrays only: it jits, shards and checkpoints).

    Attributes:
      count: int32 scalar, the number of updates seen: the step the sparsity schedules are evaluated at.
      masks: ``{module...: {axis: bool [*stacked, groups]}}`` (True = kept), one array per group kind and module,
        e.g. ``{"blocks": {"mlp": bool [layers, d_mlp], "heads": bool [layers, num_heads]}}`` for the GPT.
        ``jp.train.init_state`` shards each along the param axes it runs along (``heads``/``mlp`` over tensor).
    """
    count: jax.Array
    masks: Any


def _schedules(sparsity, axes) -> dict[str, SparsitySchedule]:
    if isinstance(sparsity, Mapping):
        if not sparsity:
            raise ValueError("sparsity={} names no axis; give e.g. {'mlp': 0.5, 'heads': 0.5}")
        return {a: as_schedule(s) for a, s in sparsity.items()}
    return {a: as_schedule(sparsity) for a in check_axes(PRUNABLE_AXES if axes is None else axes)}


def structured_pruning(sparsity: float | SparsitySchedule | Mapping[str, float | SparsitySchedule],
                       distribution: str = "uniform", *, axis_names: Any = None, axes: Sequence[str] | None = None,
                       groups: Chains | None = None) -> optax.GradientTransformation:
    """Structured magnitude pruning (whole MLP neurons, attention heads) as an optax transformation.

    Chained **after** the optimizer, as :func:`jaxpar.pruning.magnitude_pruning`:
    ``optax.chain(optax.adamw(lr), structured_pruning(polynomial_sparsity(0.5, 0, 1000, frequency=100),
    axis_names=jax.eval_shape(init_fn, rng)))``. Its unit is a **group**: one entry of a logical axis in every
    leaf coupled through it. For the GPT an MLP neuron (``mlp``) is a column of ``up_kernel``, its ``up_bias``
    entry and a row of ``down_kernel``; an attention head (``heads``) is its slice of ``qkv_kernel`` (q, k and v)
    and of ``out_kernel``. For the Llama an MLP neuron couples a column of ``gate_kernel`` and ``up_kernel`` and a
    row of ``down_kernel`` (SwiGLU); a query head is its slice of ``q_kernel`` and of ``out_kernel``, pruned
    within its key/value group (``k_kernel`` / ``v_kernel`` stay whole). Groups come from the logical names that
    also shard the params:

    * only ``mlp`` and ``heads`` entries are removed, never ``embed``;
    * the leaves of one module (same parent path: the GPT's ``blocks``) holding the axis are coupled, when no
      other module holds that axis name;
    * heads next to ``kv_heads`` leaves (grouped-query attention) are pruned within their key/value group, every
      group keeping the same number, so the compacted model has as many key/value heads as before
      (:func:`jaxpar.pruning.compact_state` keeps at least two query heads per group, so this transform can go
      on with the compacted model);
    * chains across modules are given by ``groups``: the digits MLP's hidden layer 0 is
      ``groups={"mlp": [("dense_0", "dense_1")]}`` (``dense_0``'s kernel columns and bias, ``dense_1``'s kernel
      rows). Once ``groups`` names an axis, modules outside its chains stay dense for that axis;
    * anything else whose coupling is not clear raises (below); nothing is cut on a guess.

    Each stacked ``layers`` slice has its own groups: masks are ``[layers, groups]``.

    **Score**: a group's L2 norm, ``sqrt(sum of squares of all its weights)`` over every coupled leaf (the
    Frobenius norm of the group; Torch-Pruning's group-level magnitude importance, Fang et al. 2023,
    "DepGraph", sec. 3.3, aggregates the coupled parameters' norms into one group score the same way; Li et
    al. 2017, "Pruning Filters for Efficient ConvNets", sec. 3.1, rank a single filter by its L1 norm).
    The L2 norm is chosen because it adds up across leaves and shards as plain sums of squares (a group's
    score is one all-reduce of partial sums, whatever the sharding of its leaves), and it is the norm that
    decoupled weight decay shrinks. As the unstructured transform does, the score is taken on the values the
    params are about to take (``params + updates``). Scores are reductions over each leaf's non-group axes:
    no kernel is gathered; the top-k runs on the small ``[layers, groups]`` scores by exact bisection
    (:mod:`jaxpar.pruning.select`: ties go to the lower index).

    Every update returns ``where(mask, updates, -params)`` per leaf, so a pruned group lands on exactly 0.0 and
    stays there under momentum, Adam moments and decoupled weight decay; at a refresh
    (``schedule.refresh(count)``) a pruned group may come back if its would-be norm ranks among the kept.

    Args:
      sparsity: the fraction of groups removed: a schedule (:func:`polynomial_sparsity`,
        :func:`constant_sparsity`, :func:`one_shot`), a number (constant from step 0, refresh every 100 steps),
        or a dict ``{axis: schedule or number}`` (its keys are then the pruned axes), e.g.
        ``{"mlp": 0.5, "heads": 0.25}``.
      distribution: per group kind (``mlp`` and ``heads`` are ranked separately: a head and a neuron hold
        different numbers of weights, so their norms do not compare):
        ``"uniform"``: every stacked slice (layer) of every group plan removes ``round(sparsity * groups)``,
        keeping at least one; grouped-query heads (the Llama: query heads sharing a key/value head, see
        :mod:`jaxpar.pruning.groups`) remove ``round(sparsity * H / G)`` in each of the ``G`` key/value groups;
        ``"global"``: one threshold over all layers (and chains) of the kind; the kind's total count is exact,
        layers may keep different numbers (:func:`jaxpar.pruning.compact` pads them to one count).
        ERK is refused: it sets per-tensor densities from a layer's fan-in and fan-out, while all groups of
        a kind in a layer have one shape, so there is nothing for it to weigh.
        Both keep **at least one group** (head, hidden unit) in every stacked slice (layer) of every group
        plan, so no layer is cut off: global pruning first keeps each slice's highest-scoring group (ties to
        the lower index), then ranks the rest globally; its count is ``max(round((1 - sparsity) * groups),
        number of slices)``, so at high sparsity (e.g. 0.99) it keeps more than asked. Torch-Pruning likewise
        never removes a layer's last channel. Grouped-query heads count each key/value group as a slice here
        (each keeps its top query head first); key/value groups that keep different numbers are padded to one
        count by :func:`jaxpar.pruning.compact`.
      axis_names: the params' logical names, ``jax.eval_shape(init_fn, rng)`` (Flax-boxed) or
        ``jp.sharding.logical_specs`` of it. Required (the groups are read from them): ``init`` raises without.
      axes: the pruned axes, a subset of ``("mlp", "heads")`` (default both); ignored with a dict ``sparsity``.
      groups: explicit chains across modules, ``{axis: [(module, module, ...), ...]}``, modules as key paths
        ``"dense_0"`` or ``"encoder/dense_0"``.

    Returns:
      An ``optax.GradientTransformation`` with :class:`StructuredPruningState`; updates keep their dtype
      (promoted to the param dtype if wider, so ``params + updates`` is exactly 0.0).

    Raises:
      ValueError: (here) an unknown distribution or ``"erk"``; a sparsity outside [0, 1); an axis other than
        ``mlp``/``heads`` (``embed`` included); (at ``init``) no ``axis_names``; heads pruned where every query
        head has its own key/value head; an axis name held by several
        modules without a chain in ``groups``; a chain naming a module that lacks the axis or sits in two
        chains; coupled leaves whose group sizes or stacked axes differ; a leaf holding the axis twice; no
        group found; names not matching the params (structure, or a boxed leaf's shape along an axis other than
        ``mlp``/``heads``: the names of another model); (at ``update``) ``params`` missing; a state whose masks do not fit these params' groups
        (another model's state), naming the mask.
      TypeError: a sparsity that is neither a number nor a schedule; ``groups`` not a dict of chains.
    """
    if distribution == "erk":
        raise ValueError("distribution='erk' has no meaning for structured pruning: ERK weighs tensors by fan-in "
                         "and fan-out, while every group of a kind in a layer has one shape; use 'uniform' or "
                         "'global' (per group kind)")
    if distribution not in STRUCTURED_DISTRIBUTIONS:
        raise ValueError(f"distribution={distribution!r} is unknown; use one of {STRUCTURED_DISTRIBUTIONS}")
    schedules = _schedules(sparsity, axes)
    kinds = check_axes(tuple(schedules))

    def plans_of(params) -> list[GroupPlan]:
        plans = group_plans(params, axis_names, kinds, groups)
        if not plans:
            raise ValueError(f"structured_pruning found no leaf with the logical axes {kinds} in the params; check "
                             "axis_names (jax.eval_shape(init_fn, rng)) or the axes pruned")
        for p in plans:
            if p.segments == p.size > 1:
                raise ValueError(f"{p.name}: each of its {p.size} query heads has its own key/value head (num_kv_heads "
                                 "== num_heads), and query heads are pruned only within their key/value group, so "
                                 "none can be: prune axes=('mlp',), or give the model fewer key/value heads (a "
                                 "model compacted from one with more query heads per group: compact it with "
                                 "jp.pruning.compact_state, which keeps two per group, or pass multiple_of={'heads': "
                                 "2 * num_kv_heads} to compact and compact_opt_state)")
        return plans

    def init_fn(params):
        plans = plans_of(params)
        return StructuredPruningState(jnp.zeros((), jnp.int32), nest([p.key for p in plans],
                                                                 [jnp.ones(p.mask_shape, bool) for p in plans]))

    def update_fn(updates, state: StructuredPruningState, params=None):
        flat_u, treedef, flat_p = flat_update("structured_pruning", updates, params)
        plans = plans_of(params)
        masks = _check_state(state, plans)
        for kind in kinds:
            of_kind = [p for p in plans if p.axis_name == kind]
            if of_kind:   # a kind the model lacks (the MLP has no heads) has nothing to refresh
                masks.update(_refresh_kind(schedules[kind], distribution, state.count, of_kind, flat_p, flat_u,
                                           masks))
        out = list(flat_u)
        for plan in plans:
            for m in plan.members:
                dtype = jnp.promote_types(flat_u[m.index].dtype, flat_p[m.index].dtype)
                out[m.index] = jnp.where(expand(masks[plan.key], m), out[m.index].astype(dtype),
                                         -flat_p[m.index].astype(dtype))
        new_masks = nest([p.key for p in plans], [masks[p.key] for p in plans])
        return treedef.unflatten(out), StructuredPruningState(optax.safe_increment(state.count), new_masks)

    return optax.GradientTransformation(init_fn, update_fn)


def carried_minimum(plan: GroupPlan) -> int:
    """The fewest groups per segment that a model compacted from ``plan`` must keep for
    :func:`structured_pruning` to run on it: 2 query heads per key/value group where the plan has 2 or more (a
    model whose every query head has its own key/value head cannot have a head pruned within its group, so the
    transform refuses it), else 1."""
    return 2 if plan.segments > 1 and plan.size // plan.segments >= 2 else 1


def _check_state(state: Any, plans: list[GroupPlan]) -> dict:
    """The state's masks by plan key; ValueError naming the mask when the state is not this model's."""
    if not isinstance(state, StructuredPruningState):
        raise ValueError(f"structured_pruning's update got a state of type {type(state).__name__}; pass the state "
                         "its init returned (tx.init(params))")
    want = {p.key: p.mask_shape for p in plans}
    got = {tuple(k): jnp.shape(m) for k in _mask_keys(state.masks) if (m := lookup(state.masks, k)) is not None}
    for key in sorted(set(want) | set(got)):
        if got.get(key) != want.get(key):
            raise ValueError(f"structured_pruning state mask {'/'.join(key)} has shape {got.get(key)} but these "
                             f"params' groups need {want.get(key)} (None: absent): the state belongs to other params "
                             "or axis_names; build it with tx.init(params) for these params")
    return {key: lookup(state.masks, key) for key in want}


def _refresh_kind(schedule, distribution, count, plans, flat_p, flat_u, masks) -> dict:
    """The masks of one group kind after this step: refreshed where the schedule says so."""
    old = [masks[p.key] for p in plans]
    leaves = tuple(sorted({m.index for p in plans for m in p.members}))

    def refresh():
        candidates = {i: flat_p[i].astype(jnp.float32) + flat_u[i].astype(jnp.float32) for i in leaves}
        new = _select(candidates, schedule(count), plans=tuple(plans), distribution=distribution)
        return [select.like(n, o) for n, o in zip(new, old)]

    due = schedule.refresh(count)
    try:        # outside jit decide in Python: an eager lax.cond would compile both branches every call
        new = refresh() if bool(due) else old
    except jax.errors.ConcretizationTypeError:
        new = jax.lax.cond(due, refresh, lambda: old)
    return {p.key: m for p, m in zip(plans, new)}


def scores(candidates: Mapping[int, jax.Array], plan: GroupPlan) -> jax.Array:
    """Sum of squares of every group's weights (the squared L2 norm: same ranking), float32 ``[*stacked, groups]``."""
    return sum(group_sumsq(candidates[m.index], m) for m in plan.members)


@functools.partial(jax.jit, static_argnames=("plans", "distribution"))
def _select(candidates: dict[int, jax.Array], sparsity: jax.Array, *, plans: tuple[GroupPlan, ...],
            distribution: str) -> list[jax.Array]:
    """Keep masks ``[*stacked, groups]`` for one kind's plans, from the candidates (params + updates).

    Selection runs on the scores split by segment, ``[*stacked, segments, groups // segments]`` (one segment
    unless the plan is grouped-query heads), so "per slice" means per segment of a stacked slice."""
    bits = [_segment_view(select.magnitude_bits(scores(candidates, p)), p) for p in plans]
    if distribution == "global":   # every slice's (segment's) top group is kept first (a layer never empties)
        total, slices = sum(b.size for b in bits), sum(b.size // b.shape[-1] for b in bits)
        top = select.top_k_per_slice(bits, [(b.ndim - 1,) for b in bits], [jnp.ones((), jnp.int32)] * len(bits))
        bits = [jnp.where(t, select.SENTINEL, b) for t, b in zip(top, bits)]
        keep = jnp.maximum(jnp.round((1.0 - sparsity) * total).astype(jnp.int32), slices)
        masks = select.top_k_pooled(bits, keep)
    else:
        keep = [jnp.maximum(1, jnp.round((1.0 - sparsity) * (p.size // p.segments))).astype(jnp.int32)
                for p in plans]
        masks = select.top_k_per_slice(bits, [(b.ndim - 1,) for b in bits], keep)
    return [m.reshape(p.mask_shape) for m, p in zip(masks, plans)]


def _segment_view(bits: jax.Array, plan: GroupPlan) -> jax.Array:
    """``bits [*stacked, groups]`` as ``[*stacked, segments, groups // segments]`` (replicated first on an Explicit
    mesh, where splitting a sharded axis by reshape is not defined; these are small score arrays)."""
    if select._explicit_spec(bits) is not None:
        bits = jax.reshard(bits, jax.sharding.PartitionSpec())
    return bits.reshape(plan.segment_shape)


# ------------------------------------------------------------------------------------------- inspection

def _find(tree: Any) -> list[StructuredPruningState]:
    is_state = lambda x: isinstance(x, StructuredPruningState)
    return [x for x in jax.tree.leaves(tree, is_leaf=is_state) if is_state(x)]


def group_masks(opt_state: Any) -> dict:
    """The group masks held in ``opt_state`` (or a ``TrainState``; anywhere inside chains and wrappers).

    Returns:
      ``{module...: {axis: bool [*stacked, groups]}}``, True = kept (sharded like the state).

    Raises:
      ValueError: no :class:`StructuredPruningState` inside, or more than one.
    """
    found = _find(opt_state)
    if len(found) != 1:
        raise ValueError(f"found {len(found)} structured_pruning states; expected exactly one (chain "
                         "structured_pruning(...) once after the optimizer)")
    return found[0].masks


def param_masks(params: Any, masks: Any, axis_names: Any, groups: Chains | None = None) -> Any:
    """Group masks broadcast to the params: a tree with the params' structure, bool arrays where a leaf belongs
    to a pruned group (True = kept), None elsewhere. ``masks`` is :func:`group_masks`' dict (or a state).

    Raises:
      ValueError: as :func:`jaxpar.pruning.groups.group_plans`; a mask whose shape differs from its group's.
    """
    if _find(masks):
        masks = group_masks(masks)
    keys = _mask_keys(masks)
    plans = [p for p in group_plans(params, axis_names, tuple(dict.fromkeys(k[-1] for k in keys)), groups)
             if p.key in keys]
    flat, treedef = jax.tree.flatten(params)
    out: list[Any] = [None] * len(flat)
    for plan in plans:
        if jnp.shape(lookup(masks, plan.key)) != plan.mask_shape:
            raise ValueError(f"mask {plan.name} has shape {jnp.shape(lookup(masks, plan.key))}; these params' groups "
                             f"have {plan.mask_shape}: pass the masks of these params")
        for m in plan.members:
            e = expand(jnp.asarray(lookup(masks, plan.key)), m)
            out[m.index] = e if out[m.index] is None else out[m.index] & e
    return treedef.unflatten(out)


def _mask_keys(masks: Any, prefix: tuple = ()) -> list[tuple]:
    if not isinstance(masks, Mapping):
        return [prefix]
    return [k for name, sub in masks.items() for k in _mask_keys(sub, (*prefix, str(name)))]
