"""Structured pruning of whole experts of a mixture of experts (:mod:`jaxpar.layers.moe`): which experts to remove,
and the groups compaction cuts.

An **expert group** is one index along the ``experts`` logical axis in every leaf of one MoE module (the decoder's
``blocks``): the expert's ``experts_gate_kernel`` / ``experts_up_kernel`` ``[*stacked, E, D, F_e]`` and
``experts_down_kernel [*stacked, E, F_e, D]`` slices (found by their logical names), its column of the router
kernel ``router_kernel [*stacked, D, E]`` (the layer's param name; its experts axis is deliberately unnamed so the
router is never split over the expert-parallel axes) and its entries of the carried router state
``moe_router/{bias, load} [*stacked, E]`` (:data:`jaxpar.layers.moe.ROUTER`, where the params hold it). Removing
expert ``e`` removes all of them at once, so the compacted router computes the kept experts' logits exactly as
before and its top-k runs over the kept experts: a token whose choice was a removed expert goes to its best kept
one (the removed experts' tokens are re-routed, never dropped). Sigmoid scores are per expert, so the compacted
router chooses exactly as the original one with the removed experts excluded; a softmax over the kept experts
raises each kept probability by the same per-token factor, which keeps the choices and the renormalised weights
(``norm_topk_prob``) but not the balance against a non-zero selection bias (:func:`jaxpar.pruning.compact`).

Selection (:func:`select_experts`) keeps, in every stacked layer, the ``keep`` experts with the highest score:

* ``by="load"``: the router load, the tokens routed to each expert: the carried ``moe_router/load`` (the last
  step's global counts, ``TrainState.carried``) or counts measured on batches (:func:`measure_expert_load`). An
  expert the router rarely picks contributes to few tokens. (Lu et al. 2024, "Not All Experts are Equal", arXiv
  2402.14800, search on calibration data for the kept set whose layer output is closest to the full layer's;
  counting the router's choices is the cheaper criterion, one pass with no search);
* ``by="norm"``: the expert's L2 norm over its gate, up and down weights (the group magnitude
  :func:`jaxpar.pruning.structured_pruning` uses for neurons and heads; it needs no data).

Every layer keeps the same count (the layers share one stacked shape; compaction never pads experts: a zero
expert would still be routed to). With DeepSeek-V3's group-limited routing (``MoEConfig.num_groups`` G > 1) each
routing group keeps ``keep / G`` experts, so the compacted model's contiguous groups are the old groups' kept
experts and its group scores (each group's top-2) are the old ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import protocol
from jaxpar._tree import key_names, key_path
from jaxpar.layers.moe import ROUTER, MoEConfig
from jaxpar.pruning.groups import GroupPlan, Member, _plan, group_sumsq, lookup, nest
from jaxpar.pruning.paths import checked_axis_names
from jaxpar.sharding.names import EXPERTS
from jaxpar.sharding.rules import STACKED_AXIS_NAMES

ROUTER_KERNEL = "router_kernel"
"""The router's kernel ``[*stacked, D, E]`` in an MoE module (:func:`jaxpar.layers.moe.param_shapes`' name)."""
ROUTER_STATE_LEAVES = ("bias", "load")
"""The entries of the carried router state that hold one value per expert (``dropped`` and ``rate`` do not)."""
EXPERT_SCORES = ("load", "norm")
"""The criteria :func:`select_experts` ranks experts by."""


def routing_groups(config: Any) -> int:
    """G, the routing groups of ``config``'s experts: ``config.moe.num_groups`` (also through a model's ``cfg``)
    when it is a :class:`jaxpar.layers.moe.MoEConfig`, else 1."""
    moe = getattr(config, "moe", None)
    if moe is None:
        moe = getattr(getattr(config, "cfg", None), "moe", None)
    return moe.num_groups if isinstance(moe, MoEConfig) else 1


def _is_weight(plan: GroupPlan, m: Member) -> bool:
    """Whether ``m`` is one of the experts' own weights (not the router's column or its state)."""
    return m.path[len(plan.modules[0])] not in (ROUTER_KERNEL, ROUTER.key)


def expert_plans(params: Any, axis_names: Any) -> list[GroupPlan]:
    """The expert groups of ``params`` (module docstring; ``axis_names`` as ``jax.eval_shape(model.init, rng)``
    gives them, with or without the carried state): one :class:`GroupPlan` per module holding leaves with the
    ``experts`` logical axis, its members the experts' weights, then the router kernel's columns, then the carried
    router state's ``bias`` / ``load`` where the params hold them (ordered by first leaf).

    Raises:
      ValueError: a module with experts but no ``router_kernel`` beside them, or one whose last axis is not the
        experts'; router state of another shape than ``[*stacked, E]``; coupled expert leaves that disagree on
        the experts' count or stacked axes; names not matching the params.
    """
    try:
        names_list = checked_axis_names(params, axis_names)
    except ValueError:   # params without the carried state model.init holds (TrainState.params)
        rest = protocol.split_carried(axis_names)[0]
        if rest is axis_names:
            raise
        names_list = checked_axis_names(params, rest)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    by_path = {key_names(p): (i, tuple(jnp.shape(x))) for i, (p, x) in enumerate(flat)}
    modules: dict[tuple, list] = {}
    for i, ((kpath, leaf), names) in enumerate(zip(flat, names_list)):
        if names is not None and EXPERTS in names:
            path = key_names(kpath)
            modules.setdefault(path[:-1], []).append((i, path, tuple(jnp.shape(leaf)), names))
    plans = []
    for module, leaves in modules.items():
        plan = _plan((module,), EXPERTS, leaves)
        where = f"the experts of {key_path(module) or '<top>'}"
        router = (*module, ROUTER_KERNEL)
        if router not in by_path:
            raise ValueError(f"{where} have no {ROUTER_KERNEL} beside them: removing an expert must also remove its "
                             f"router column (jaxpar.layers.moe's params: {ROUTER_KERNEL} [*stacked, D, E])")
        i, shape = by_path[router]
        names = names_list[i] or (None,) * len(shape)
        batch = tuple(a for a, n in enumerate(names) if n in STACKED_AXIS_NAMES)
        if shape[-1] != plan.size or tuple(shape[a] for a in batch) != plan.batch_shape:
            raise ValueError(f"{key_path(router)} has shape {shape}, but {where} are {plan.size} experts stacked "
                             f"{plan.batch_shape}: the router's last axis must be the experts'")
        extra = [Member(i, router, shape, len(shape) - 1, batch)]
        for leaf in ROUTER_STATE_LEAVES:
            path = (*module, ROUTER.key, leaf)
            if path in by_path:
                j, s = by_path[path]
                if s != plan.mask_shape:
                    raise ValueError(f"the router state {key_path(path)} has shape {s}; {where} need "
                                     f"{plan.mask_shape} (one entry per expert and stacked layer)")
                extra.append(Member(j, path, s, len(s) - 1, tuple(range(len(s) - 1))))
        plans.append(dataclasses.replace(plan, members=plan.members + tuple(extra)))
    return sorted(plans, key=lambda p: p.members[0].index)


# ------------------------------------------------------------------------------------------------ scores

def measure_expert_load(loss_fn: Callable, params: Any, batches: Any, held: Any = None) -> Any:
    """Tokens routed to each expert on ``batches``, read through the carried channel: the cotangent of a
    ``"sum"`` collection is its increment, which for the router state is the counts (:mod:`jaxpar.layers.moe`).

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)`` (a model's ``loss``).
      params: the params, holding the carried router state (``model.init``'s), or without it (``state.params``)
        with the carried tree in ``held`` (``state.carried``).
      batches: one batch, or a list of batches whose counts are summed.
      held: the carried tree when ``params`` lacks it (None: split from ``params``).

    Returns:
      The carried tree's structure with this data's counts: ``moe_router/load [*stacked, E]`` float32 holds each
      layer's tokens x k choices per expert (give it to :func:`select_experts` as ``load``).

    Raises:
      ValueError: params holding no carried state and no ``held``.
    """
    if held is None:
        params, held = protocol.split_carried(params)
    if held is None:
        raise ValueError("measure_expert_load reads the router counts through the carried router state, but the "
                         "params hold none: pass params from model.init (or a checkpoint) holding moe_router, or "
                         "state.params with held=state.carried")

    def loss(h, batch):
        out = loss_fn(protocol.merge_carried(params, h), batch)
        return out[0] if isinstance(out, tuple) else out

    counts = jax.jit(jax.grad(loss))
    batches = batches if isinstance(batches, (list, tuple)) else [batches]
    total = None
    for batch in batches:
        new = counts(held, batch)
        total = new if total is None else jax.tree.map(jnp.add, total, new)
    return total


def expert_scores(params: Any, axis_names: Any, by: str = "load", load: Any = None) -> dict:
    """Per expert group, the score of each expert: ``{plan key: float32 [*stacked, E]}`` (module docstring).

    ``by="load"`` reads ``moe_router/load`` at each MoE module's path in ``load`` (``state.carried``, or
    :func:`measure_expert_load`'s result), or in ``params`` when ``load`` is None; ``by="norm"`` sums the squares of
    each expert's weights (the squared L2 norm: the same ranking).

    Raises:
      ValueError: an unknown ``by``; no expert in the params; no router load found, or one that is zero everywhere
        in a layer (an untrained router state: measure the load on batches).
    """
    if by not in EXPERT_SCORES:
        raise ValueError(f"by={by!r}; rank experts by one of {EXPERT_SCORES}")
    plans = expert_plans(params, axis_names)
    if not plans:
        raise ValueError("no expert found: no param carries the logical axis 'experts' (a mixture of experts "
                         "built with jaxpar.layers.moe names its expert weights so); check axis_names")
    out = {}
    for plan in plans:
        if by == "norm":
            flat = jax.tree.leaves(params)
            out[plan.key] = sum(group_sumsq(flat[m.index], m) for m in plan.members if _is_weight(plan, m))
            continue
        source = params if load is None else load
        value = lookup(source, (*plan.modules[0], ROUTER.key, "load"))
        if value is None or tuple(jnp.shape(value)) != plan.mask_shape:
            raise ValueError(f"by='load' needs {key_path((*plan.modules[0], ROUTER.key, 'load'))} of shape "
                             f"{plan.mask_shape} in {'the params' if load is None else 'load'} (got "
                             f"{None if value is None else jnp.shape(value)}): pass load=state.carried or "
                             "load=jp.pruning.measure_expert_load(model.loss, params, batches)")
        value = np.asarray(jax.device_get(value), np.float32)
        if np.any(value.reshape(-1, plan.size).sum(-1) == 0):
            raise ValueError(f"the router load of {plan.name} is zero in some layer (no step has counted it): "
                             "measure it with jp.pruning.measure_expert_load(model.loss, params, batches)")
        out[plan.key] = jnp.asarray(value)
    return out


def select_experts(params: Any, axis_names: Any, keep: int, *, by: str = "load", load: Any = None,
                   groups: int = 1) -> dict:
    """Masks keeping, in every stacked layer, the ``keep`` experts with the highest score (module docstring);
    ties go to the lower expert index. The masks are :func:`jaxpar.pruning.compact`'s input.

    Args:
      params: the params (with or without the carried router state).
      axis_names: their logical names (``jax.eval_shape(model.init, rng)``).
      keep: E', the experts each layer keeps (``1 <= keep <= E``).
      by: ``"load"`` or ``"norm"`` (:func:`expert_scores`; ``load`` as there).
      groups: G, the routing groups (``MoEConfig.num_groups``; :func:`routing_groups` of the config): each keeps
        ``keep / G`` of its own experts.

    Returns:
      ``{module...: {"experts": bool [*stacked, E]}}``, True = kept (e.g. ``{"blocks": {"experts": [N, E]}}``).

    Raises:
      ValueError: ``keep`` outside ``[1, E]``, or not a multiple of ``groups``; as :func:`expert_scores`.
    """
    scores = expert_scores(params, axis_names, by, load)
    plans = {p.key: p for p in expert_plans(params, axis_names)}
    masks = []
    for key, score in scores.items():
        E = plans[key].size
        if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or not 1 <= keep <= E:
            raise ValueError(f"keep={keep!r} must be an int in [1, {E}] (the experts each layer keeps)")
        if groups < 1 or E % groups or keep % groups:
            raise ValueError(f"keep={keep} experts in {groups} routing groups of {E // max(groups, 1)}: each group "
                             f"keeps the same number, so keep must be a multiple of {groups}")
        # [*stacked, E] scores are small: ranked on the host, a stable sort sends ties to the lower index
        rows = np.asarray(jax.device_get(score), np.float64).reshape(-1, E // groups)
        top = np.argsort(-rows, axis=-1, kind="stable")[:, :keep // groups]
        mask = np.zeros(rows.shape, bool)
        np.put_along_axis(mask, top, True, axis=-1)
        masks.append(mask.reshape(score.shape))
    return nest(list(scores), masks)


def expert_indices(mask: np.ndarray, plan: GroupPlan, multiple: int, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """``(index, kept)`` for compaction: per stacked layer the kept experts' indices ascending, int32
    ``[*stacked, E']``, and all-True ``kept`` (experts are never padded).

    Raises:
      ValueError: layers keeping different counts, none, a count that is not a multiple of ``multiple`` (the
        expert-parallel size), or routing groups keeping different counts.
    """
    counts = mask.reshape(-1, plan.size).sum(-1)
    where = f"the expert masks of {plan.name}"
    if len(set(counts.tolist())) != 1:
        raise ValueError(f"{where} keep {sorted(set(counts.tolist()))} experts in different layers; compaction needs "
                         "one count (a padded zero expert would still be routed to): select the same number per "
                         "layer (jp.pruning.select_experts)")
    count = int(counts[0])
    if count < 1:
        raise ValueError(f"{where} keep no expert; keep at least experts_per_token")
    if count % multiple:
        raise ValueError(f"{where} keep {count} experts per layer, not a multiple of {multiple} (the mesh axes the "
                         f"rules split 'experts' over: the expert-parallel size); keep a multiple of {multiple}")
    if groups > 1:
        per_group = mask.reshape(-1, groups, plan.size // groups).sum(-1)
        if plan.size % groups or np.any(per_group != count // groups) or count % groups:
            raise ValueError(f"{where} keep {sorted(set(per_group.reshape(-1).tolist()))} experts per routing group "
                             f"({groups} groups): group-limited routing needs every group to keep count / groups, so "
                             "the compacted groups are the old ones; select with groups=num_groups")
    index = np.stack([np.flatnonzero(row) for row in mask.reshape(-1, plan.size)])
    index = index.reshape(*plan.batch_shape, count).astype(np.int32)
    return index, np.ones(index.shape, bool)


__all__ = ["EXPERT_SCORES", "ROUTER_KERNEL", "ROUTER_STATE_LEAVES", "expert_indices", "expert_plans",
           "expert_scores", "measure_expert_load", "routing_groups", "select_experts"]
