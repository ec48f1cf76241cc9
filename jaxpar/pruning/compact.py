"""Compaction: a structurally pruned model as a smaller dense model (pruned neurons, heads and experts removed).

:func:`compact` turns params plus group masks (from :func:`jaxpar.pruning.structured_pruning`) into the params of a
smaller model and the config that runs it; :func:`compact_opt_state` gathers the optimizer state by the same
indices; :func:`compact_state` does both for a ``jp.train.TrainState`` and places the result on a mesh, so training
continues through ``jp.train.make_train_step``. Any model of the protocol (:mod:`jaxpar.protocol`:
``init``, ``replace``, optionally ``prune_groups``) is supported: the GPT (``GPTConfig``), the Llama (``LlamaConfig``), the MLP (an ``MLP``
module instance), or a user's model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar._tree import key_names, key_path
from jaxpar.sharding import rules as shd
from jaxpar.train import step as train
from jaxpar._validate import positive_int
from jaxpar import protocol
from jaxpar.pruning import experts
from jaxpar.pruning.groups import GroupPlan, Member, expand, group_plans, lookup, nest
from jaxpar.pruning.structured import StructuredPruningState, _find, _mask_keys, carried_minimum, group_masks
from jaxpar.sharding.names import EXPERTS, HEADS, MLP


# ------------------------------------------------------------------------------------------------ model

def _model(config: Any, params: Any) -> Any:
    """The protocol model of ``config`` (:func:`jaxpar.protocol.as_model`) with compaction's parts."""
    return protocol.require(protocol.as_model(config, params), ("init", "replace"), "compaction",
                            "; jaxpar's own: a jp.models.GPTConfig or a jp.models.MLP instance")


def _replaced(model: Any, sizes: dict) -> Any:
    """``model.replace(sizes)``, the smaller model's config; TypeError naming the part when it cannot be called
    so (e.g. a flax.struct / chex dataclass model, whose ``replace(**fields)`` is the dataclass')."""
    try:
        return model.replace(sizes)
    except TypeError as e:
        raise TypeError(f"compaction calls {type(model).__name__}.replace(sizes) with sizes {{group: kept count}} "
                        f"(the model protocol) and it raised: {e}. A flax.struct or chex dataclass model's replace "
                        "is the dataclass' replace(**fields): give the model an as_model() returning an object with "
                        "the protocol's replace(sizes)") from e


def _check_replaced(c: "Compaction", model: Any, params: Any) -> None:
    """The config ``replace`` returned builds params of the compacted shapes (ValueError naming the first leaf)."""
    name = f"{type(model).__name__}.replace(sizes)"
    new = protocol.as_model(c.config, params)
    if not callable(getattr(new, "init", None)):
        raise TypeError(f"{name} returned {c.config!r:.80}, which is neither a model nor a config with as_model(): "
                        "return the smaller model's config")
    want = jax.eval_shape(new.init, jax.random.key(0))
    if len(jax.tree.leaves(nn.meta.unbox(want))) != len(c.param_shapes):   # params without their carried state
        want = protocol.split_carried(want)[0]
    flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(want))[0]
    if len(flat) != len(c.param_shapes):
        raise ValueError(f"{name} returned a config whose params have {len(flat)} leaves, not {len(c.param_shapes)}")
    for i, (path, leaf) in enumerate(flat):
        if tuple(leaf.shape) != c.new_shape(i):
            raise ValueError(f"{name} returned a config whose {key_path(path, indexing=True)} has shape "
                             f"{tuple(leaf.shape)}, but the compacted params have {c.new_shape(i)}: replace must "
                             f"set the kept counts it is given ({ {'/'.join(k): v.shape[-1] for k, v in c.index.items()} })")


def _groups(model: Any) -> Any:
    prune_groups = getattr(model, "prune_groups", None)
    return prune_groups() if callable(prune_groups) else None


# ---------------------------------------------------------------------------------------------- indices

def _as_masks(masks_or_state: Any) -> dict:
    if _find(masks_or_state):
        masks_or_state = group_masks(masks_or_state)
    leaves = jax.tree.leaves(masks_or_state)
    if not isinstance(masks_or_state, Mapping) or not leaves or any(
            jnp.result_type(x) != jnp.bool_ for x in leaves):
        raise TypeError("masks_or_state must be a state holding a structured_pruning state (opt_state or "
                        "TrainState) or its group masks {module: {axis: bool [*stacked, groups]}} "
                        "(jp.pruning.group_masks)")
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), masks_or_state)


GROUP_AXES = (MLP, HEADS, EXPERTS)
"""The logical axes whose groups compaction removes: the keys ``multiple_of`` may hold."""


def _check_multiple_of(multiple_of: Any) -> None:
    """Raises ValueError unless ``multiple_of`` is an int >= 1 or a dict from :data:`GROUP_AXES` to such ints."""
    if isinstance(multiple_of, Mapping):
        unknown = [k for k in multiple_of if k not in GROUP_AXES]
        if unknown:
            raise ValueError(f"multiple_of has unknown keys {unknown!r}; its keys are the group axes {GROUP_AXES} "
                             "(e.g. multiple_of={'mlp': 2, 'heads': 2})")
    for key, m in multiple_of.items() if isinstance(multiple_of, Mapping) else [(None, multiple_of)]:
        positive_int("multiple_of" if key is None else f"multiple_of[{key!r}]", m, " (or a dict axis -> int), e.g. "
                     "the tensor axis size, so that the kept counts still divide over it")


def _multiple(multiple_of: Any, axis: str) -> int:
    return int(multiple_of.get(axis, 1) if isinstance(multiple_of, Mapping) else multiple_of)


def _unboxed(params: Any) -> Any:
    """``params`` with Flax-boxed leaves (``nn.Partitioned`` / ``nn.LogicallyPartitioned``, as ``model.init``
    returns) unboxed, as ``jp.train.init_state`` unboxes ``init_fn``'s output."""
    return nn.meta.unbox(params)


def _indices(mask: np.ndarray, multiple: int, minimum: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per stacked slice, the sorted indices kept (the kept groups, then the lowest pruned ones as padding up to
    one count for every slice: the largest kept, at least ``minimum``, rounded up to ``multiple``), and their
    masks."""
    size = mask.shape[-1]
    flat = mask.reshape(-1, size)
    count = min(size, -(-max(int(flat.sum(-1).max()), minimum) // multiple) * multiple)
    rows = []
    for row in flat:
        kept, pruned = np.flatnonzero(row), np.flatnonzero(~row)
        rows.append(np.sort(np.concatenate([kept, pruned[:count - len(kept)]])))
    index = np.stack(rows).reshape(*mask.shape[:-1], count).astype(np.int32)
    return index, np.take_along_axis(mask, index, axis=-1)


def _plan_indices(mask: np.ndarray, plan: GroupPlan, multiple: int,
                  minimum: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_indices` of a plan; grouped-query heads (``plan.segments`` key/value groups of ``H // G`` query heads)
    keep one count per group, the largest any group keeps (at least ``minimum``), rounded up so that ``G * count``
    is a multiple of ``multiple``; the indices stay ascending, so the kept query heads of group ``g`` are again the
    ``g``-th run of ``count`` heads (query head ``h`` reads key/value head ``h // count`` in the compacted model)."""
    if plan.segments == 1:
        return _indices(mask, multiple, minimum)
    g, per = plan.segments, plan.size // plan.segments
    index, kept = _indices(mask.reshape(plan.segment_shape), multiple // math.gcd(multiple, g), minimum)
    index = index + (np.arange(g, dtype=np.int32) * per)[:, None]
    return index.reshape(*plan.batch_shape, -1), kept.reshape(*plan.batch_shape, -1)


def _take(x: jax.Array, index: np.ndarray, member: Member) -> jax.Array:
    """``x`` gathered along ``member.axis`` by the per-slice ``index [*stacked, count]``."""
    pos = member.positions
    order = sorted(range(len(pos)), key=lambda k: pos[k])
    shape = [1] * x.ndim
    for k in order:
        shape[pos[k]] = index.shape[k]
    return jnp.take_along_axis(x, jnp.asarray(np.transpose(index, order).reshape(shape)), axis=member.axis)


@dataclasses.dataclass(frozen=True)
class Compaction:
    """The indices of one compaction (what :func:`compact` and :func:`compact_opt_state` apply).

    Attributes:
      plans: the compacted groups (their plans on the original params).
      index: per plan key, int32 ``[*stacked, count]``: the original group indices kept, ascending.
      kept: per plan key, bool ``[*stacked, count]``: False for the groups kept only as padding.
      config: the compacted model's config.
      param_shapes: the original params' shapes (flattening order).
    """
    plans: tuple[GroupPlan, ...]
    index: dict
    kept: dict
    config: Any
    param_shapes: tuple

    @classmethod
    def build(cls, params: Any, masks_or_state: Any, config: Any, multiple_of: Any = 1,
              carry: bool = False) -> "Compaction":
        """``carry``: the structured pruning transform goes on with the compacted model (:func:`compact_state`), so
        every plan keeps at least :func:`jaxpar.pruning.structured.carried_minimum` groups per segment."""
        _check_multiple_of(multiple_of)
        params = _unboxed(params)
        masks = _as_masks(masks_or_state)
        model = _model(config, params)
        names = _names_like(params, jax.eval_shape(model.init, jax.random.key(0)))
        keys = [tuple(k) for k in _mask_keys(masks)]
        axes = tuple(dict.fromkeys(k[-1] for k in keys if k[-1] != EXPERTS))
        plans = {p.key: p for p in group_plans(params, names, axes, _groups(model))} if axes else {}
        if any(k[-1] == EXPERTS for k in keys):
            plans.update((p.key, p) for p in experts.expert_plans(params, names))
        index, kept = {}, {}
        for key in keys:
            if key not in plans:
                raise ValueError(f"masks hold {key_path(key)}, which is no group of this model "
                                 f"({sorted(key_path(k) for k in plans)})")
            mask = lookup(masks, key)
            if mask.shape != plans[key].mask_shape:
                raise ValueError(f"mask {key_path(key)} has shape {mask.shape}; this model's groups have "
                                 f"{plans[key].mask_shape}: pass the masks of these params")
            if key[-1] == EXPERTS:
                index[key], kept[key] = experts.expert_indices(mask, plans[key], _multiple(multiple_of, EXPERTS),
                                                               experts.routing_groups(config))
                continue
            index[key], kept[key] = _plan_indices(mask, plans[key], _multiple(multiple_of, key[-1]),
                                                  carried_minimum(plans[key]) if carry else 1)
        new_config = _replaced(model, {k: v.shape[-1] for k, v in index.items()})
        shapes = tuple(tuple(jnp.shape(x)) for x in jax.tree.leaves(params))
        c = cls(tuple(plans[k] for k in keys), index, kept, new_config, shapes)
        _check_replaced(c, model, params)
        return c

    def members(self) -> dict[int, tuple[GroupPlan, Member]]:
        return {m.index: (p, m) for p in self.plans for m in p.members}

    def leaf(self, x: jax.Array, i: int, mask: bool, removed: int | None = None) -> jax.Array:
        """Leaf ``i`` (or a state leaf shaped like it) gathered along every group axis it holds.

        ``removed``: the state leaf is param ``i`` with this axis reduced away (a factored second moment); a group
        axis reduced away leaves nothing to cut, a stacked axis reduced away is refused (ValueError).
        """
        for plan, m in ((p, m) for p in self.plans for m in p.members if m.index == i):
            if removed is not None:
                if removed == m.axis:
                    continue
                if removed in m.batch_axes:
                    raise ValueError(f"a state leaf of {key_path(m.path)} averages over its stacked axis {removed}, "
                                     "whose slices keep different groups; compaction cannot cut it: re-initialise "
                                     "the optimizer state with tx.init(new_params)")
                shift = lambda a: a - (a > removed)
                m = dataclasses.replace(m, axis=shift(m.axis), batch_axes=tuple(map(shift, m.batch_axes)))
            x = _take(x, self.index[plan.key], m)
            if mask:
                new = dataclasses.replace(m, shape=tuple(x.shape))
                x = jnp.where(expand(jnp.asarray(self.kept[plan.key]), new), x, jnp.zeros((), x.dtype))
        return x

    def new_shape(self, i: int) -> tuple[int, ...]:
        """The compacted shape of param ``i``."""
        shape = list(self.param_shapes[i])
        for plan, m in ((p, m) for p in self.plans for m in p.members if m.index == i):
            shape[m.axis] = self.index[plan.key].shape[-1]
        return tuple(shape)

    def params(self, params: Any) -> Any:
        flat, treedef = jax.tree.flatten(params)
        touched = self.members()
        return treedef.unflatten([self.leaf(x, i, True) if i in touched else x for i, x in enumerate(flat)])

    def opt_state(self, opt_state: Any, params: Any) -> Any:
        return _compact_opt_state(self, opt_state, params)


def _names_like(params: Any, names: Any) -> Any:
    """The config's boxed ``names`` (``jax.eval_shape(init)``) for ``params``, which may lack the carried state
    ``init`` holds (``TrainState.params``: ``init_state`` moves it to ``TrainState.carried``).

    Raises:
      ValueError: params whose structure or shapes are not the config's, with or without the carried state.
    """
    got = jax.tree.map(lambda x: tuple(jnp.shape(x)), params)
    for candidate in (names, protocol.split_carried(names)[0]):
        want = jax.tree.map(lambda x: tuple(x.shape), nn.meta.unbox(candidate))
        if jax.tree.structure(want) == jax.tree.structure(got) and want == got:
            return candidate
    raise ValueError("params do not match the config: pass the config the params were built with (their "
                     f"shapes {got} vs the config's {jax.tree.map(lambda x: tuple(x.shape), nn.meta.unbox(names))})")


def _factored_axes(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(d1, d0)``: the axes of a param that optax's factored second moment (``optax.adafactor``,
    ``scale_by_factored_rms``) reduces, the second-largest and the largest axis as ``np.argsort(shape)`` orders
    them (optax ``_src/factorized.py``, ``_factored_dims``): ``FactoredState.v_row`` is the param's shape without
    ``d0``, ``v_col`` without ``d1``."""
    order = np.argsort(shape)
    return int(order[-2]), int(order[-1])


def _without(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return shape[:axis] + shape[axis + 1:]


def _compact_opt_state(c: Compaction, opt_state: Any, params: Any) -> Any:
    names_of = [key_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    paths = {names: i for i, names in enumerate(names_of)}
    touched = c.members()
    changed = {c.param_shapes[i] for i in touched}
    special = lambda x: isinstance(x, (StructuredPruningState, optax.FactoredState))

    def param_of(path) -> int | None:   # the param whose path ends the state leaf's path (the longest such)
        names = key_names(path)
        return next((paths[names[j:]] for j in range(len(names)) if names[j:] in paths), None)

    def one(path, x):
        i, shape = param_of(path), tuple(jnp.shape(x))
        if i is None:
            if shape in changed:
                raise ValueError(f"optimizer state leaf {key_path(path, indexing=True)} has the shape {shape} of a "
                                 "compacted param but its path names no param; compaction cannot tell how to cut "
                                 "it: re-initialise the optimizer state with tx.init(new_params)")
            return x
        if i not in touched or math.prod(shape) <= 1:   # untouched param; a scalar or size-1 placeholder
            return x
        if shape == c.param_shapes[i]:
            return c.leaf(x, i, False)
        raise ValueError(f"optimizer state leaf {key_path(path, indexing=True)} follows the compacted param "
                         f"{key_path(names_of[i])} of shape {c.param_shapes[i]} but has the shape {shape}; compaction "
                         "cuts leaves of their param's shape and optax's factored moments (FactoredState.v_row/v_col): "
                         "pass the optimizer state of these params, or re-initialise it with tx.init(new_params)")

    def factored(path, x: optax.FactoredState) -> optax.FactoredState:
        rows, treedef = jax.tree_util.tree_flatten_with_path(x.v_row)
        cols = treedef.flatten_up_to(x.v_col)
        new_rows, new_cols = [], []
        for (sub, r), col in zip(rows, cols):
            where = (*path, jax.tree_util.GetAttrKey("v_row"), *sub)
            i = param_of(where)
            shape = c.param_shapes[i] if i is not None else None
            if i not in touched or len(shape) < 2 or math.prod(jnp.shape(r)) <= 1:   # not factored: placeholders
                new_rows.append(r)
                new_cols.append(col)
                continue
            d1, d0 = _factored_axes(shape)
            if (tuple(jnp.shape(r)), tuple(jnp.shape(col))) != (_without(shape, d0), _without(shape, d1)):
                raise ValueError(f"FactoredState leaves {key_path(where, indexing=True)} (shapes {jnp.shape(r)}, "
                                 f"{jnp.shape(col)}) are not the factored moments of the param "
                                 f"{key_path(names_of[i])} of shape {shape}: pass the optimizer state of these params")
            stats = {d0: c.leaf(r, i, False, removed=d0), d1: c.leaf(col, i, False, removed=d1)}
            e1, e0 = _factored_axes(c.new_shape(i))
            if {e0, e1} != {d0, d1}:
                raise ValueError(f"after compaction optax's factored second moment of "
                                 f"{key_path(where, indexing=True)} would run over the axes {(e1, e0)} of the new shape "
                                 f"{c.new_shape(i)} instead of {(d1, d0)}; its statistics cannot be carried over: "
                                 "re-initialise the optimizer state with tx.init(new_params)")
            new_rows.append(stats[e0])   # v_row lacks the (new) largest axis, v_col the second largest
            new_cols.append(stats[e1])
        v = jax.tree_util.tree_map_with_path(lambda p, y: one((*path, jax.tree_util.GetAttrKey("v"), *p), y), x.v)
        return x._replace(v_row=treedef.unflatten(new_rows), v_col=treedef.unflatten(new_cols), v=v)

    def walk(path, x):
        if isinstance(x, StructuredPruningState):
            old = {k: lookup(x.masks, k) for k in _mask_keys(x.masks)}
            kept = [jnp.asarray(c.kept[k]) if k in c.kept else old[k] for k in old]
            return StructuredPruningState(x.count, nest(list(old), kept))
        if isinstance(x, optax.FactoredState):
            return factored(path, x)
        return one(path, x)
    return jax.tree_util.tree_map_with_path(walk, opt_state, is_leaf=special)


# ---------------------------------------------------------------------------------------------- public API

def compact(params: Any, masks_or_state: Any, config: Any, *, multiple_of: int | Mapping[str, int] = 1):
    """The smaller dense model a structured pruning leaves: pruned neurons and heads removed.

    Every stacked layer keeps the same number of groups of a kind (the GPT's layers share one shape): the
    largest number kept in any layer, rounded up to ``multiple_of`` (e.g. the ``tensor`` axis size, so the
    new ``num_heads`` and ``d_mlp`` still divide over it; capped at the original count). Layers that kept
    fewer get their lowest-index pruned groups back as padding, set to zero (the returned params are
    ``params * mask`` compacted), so the compacted model computes what the masked model computes: its logits
    equal ``model.apply(params * mask)``'s to float32 rounding. Pruned heads are removed whole: ``head_dim``
    is kept (``GPTConfig.head_dim``), so ``num_heads * head_dim`` may differ from ``d_model``. Grouped-query
    heads (the Llama) keep one count per key/value group (the largest any group keeps), so the compacted Llama
    has ``num_kv_heads`` key/value heads and ``num_kv_heads * count`` query heads; where that count is 1,
    :func:`structured_pruning` refuses the compacted model (nothing is left to prune within a group):
    :func:`compact_state` keeps at least 2, and ``multiple_of={'heads': 2 * num_kv_heads}`` keeps an even count here.

    Whole experts of a mixture of experts (masks ``{module: {"experts": bool [*stacked, E]}}``, from
    :func:`jaxpar.pruning.select_experts`) are removed with their router columns and carried router state
    (:mod:`jaxpar.pruning.experts`): every layer keeps the same experts' count, never padded, a multiple of
    ``multiple_of['experts']``; the compacted router's top-k runs over the kept experts (the removed experts' tokens
    go to their best kept ones). With sigmoid scores (DeepSeek-V3), or softmax scores without a selection bias and
    with renormalised top-k weights (``norm_topk_prob``: Mixtral, Qwen3-MoE), the compacted model computes what
    the model whose router never selects the removed experts computes. A softmax over fewer experts raises each
    kept probability by the removed experts' share of that token: with ``norm_topk_prob=False`` the weights grow
    so, and a non-zero selection bias (added to the probabilities) weighs less against them, which may change a
    choice the bias decided.

    Args:
      params: the model's params, with or without the carried state ``model.init`` holds (numpy or jax arrays,
        sharded or not); Flax-boxed params (``model.init``'s
        ``nn.Partitioned`` / ``nn.LogicallyPartitioned`` leaves) are unboxed first, as ``jp.train.init_state``
        does, and ``new_params`` comes back unboxed.
      masks_or_state: an optimizer state (or ``TrainState``) holding one :func:`structured_pruning` state, or
        its group masks ``{module: {axis: bool [*stacked, groups]}}`` (:func:`jaxpar.pruning.group_masks`).
      config: the model, or its config: anything :func:`jaxpar.models.as_model` turns into a model with the
        protocol's ``init`` and ``replace`` (and ``prune_groups`` for chains across modules): a
        ``jp.models.GPTConfig`` (groups ``blocks/mlp``, ``blocks/heads``), a ``jp.models.MLP`` instance (group
        ``dense_i/mlp``: hidden layer ``i`` whose kernel outputs ``mlp``, chained with the next layer, as
        ``MLP.prune_groups()`` names it for the transform), or a user's model.
      multiple_of: an int, or ``{axis: int}`` with axes among :data:`GROUP_AXES` (``'mlp'``, ``'heads'``,
        ``'experts'``; a missing axis is 1) (default 1). Experts are never padded: their kept count must be a
        multiple already.

    Returns:
      ``(new_params, new_config)``: the params (jax arrays; leaves outside pruned groups are returned as given)
      and the model's ``replace(sizes)``: ``dataclasses.replace(cfg, num_heads=..., d_mlp=...,
      head_dim=cfg.head_dim)`` for the GPT (the Llama likewise, its ``num_kv_heads`` kept), the MLP with its new ``hidden`` widths.

    Raises:
      TypeError: a config without the protocol's ``init`` or ``replace`` (the missing part is named);
        ``masks_or_state`` holding no structured pruning state or masks.
      ValueError: params not matching the config; a mask of a group the model lacks or of the wrong shape;
        ``multiple_of`` not a positive int, or a dict with a key that is not a group axis (naming the valid ones);
        expert masks keeping different counts in different layers or routing groups, or a count that is not a
        multiple of ``multiple_of['experts']`` (:func:`jaxpar.pruning.experts.expert_indices`).
    """
    params = _unboxed(params)
    c = Compaction.build(params, masks_or_state, config, multiple_of)
    return c.params(params), c.config


def compact_opt_state(opt_state: Any, params: Any, masks_or_state: Any, config: Any, *,
                      multiple_of: int | Mapping[str, int] = 1) -> Any:
    """The optimizer state gathered by the indices :func:`compact` uses for the same arguments.

    Every state leaf whose key path ends with a param's path and that has that param's shape (AdamW's ``mu``
    and ``nu``, momentum, accumulated gradients) is gathered like the param (kept moments move with their
    weights; padding groups keep theirs, which the masks hold at zero effect). optax's factored second moments
    (``optax.FactoredState`` of ``optax.adafactor``: ``v_row`` is the param without its largest axis, ``v_col``
    without its second largest, ties as ``np.argsort`` orders them) are gathered along the param axes they keep;
    a moment averaged over a group axis stays as it is (its mean still counts the removed groups, which compaction
    cannot undo); when the compacted shape's two largest axes are another pair, ``v_row`` and ``v_col`` swap as
    the new order asks. The structured pruning state's masks become the compacted masks (padding groups
    pruned); counts, scalars and size-1 placeholders are kept. So AdamW and Adafactor continue with their
    moments, bias correction and schedule position intact (rather than re-initialised, which would restart the
    bias correction and lose the second-moment estimates). The result is built for ``tx.init(new_params)``'s
    structure; a compacted param whose axes fall below Adafactor's ``min_dim_size_to_factor`` is not factored by
    ``tx.init`` any more (:func:`compact_state` checks the structure, this function cannot know the threshold).

    Raises:
      ValueError: as :func:`compact`; a state leaf of a compacted param's shape whose path names no param; a
        leaf whose path names a compacted param but whose shape is neither the param's, a factored moment's,
        nor a scalar or size-1 placeholder (an optimizer state of other params); a factored moment averaged over
        a stacked ``layers`` axis, or whose factored pair of axes changes; each cannot be cut safely:
        re-initialise the state with ``tx.init(new_params)``.
    """
    params = _unboxed(params)
    return Compaction.build(params, masks_or_state, config, multiple_of).opt_state(opt_state, params)


def _mesh_multiples(mesh, rules) -> dict[str, int]:
    """Per prunable axis, the product of the mesh axes the rules shard it over."""
    out = {}
    rules = shd.effective_rules(rules, mesh)
    for axis in GROUP_AXES:
        out[axis] = math.prod(mesh.shape[a] for a in rules.mesh_axes(axis, mesh))
    return out


def compact_state(state: Any, config: Any, tx: Any, *, mesh: jax.sharding.Mesh, rules: shd.Rules = shd.DEFAULT_RULES,
                  multiple_of: int | Mapping[str, int] | None = None, masks: Any = None):
    """Compacts a ``jp.train.TrainState`` (params and optimizer state) and places it on ``mesh``.

    The state's :func:`structured_pruning` masks give the groups; the result is laid out like
    ``jp.train.abstract_state(new_init_fn, tx, mesh=mesh, rules=rules, policy=state.policy)``, so
    ``jp.train.make_train_step(loss_fn, tx, mesh=mesh)`` of the new model continues training it. ``tx`` is the
    transformation the state was built with: once its sparsity schedule has ended (``polynomial_sparsity`` /
    ``one_shot`` after ``end_step``) its masks stay fixed, so padding groups stay zero; a schedule that still
    refreshes would prune the compacted model again at its target.

    Grouped-query heads keep at least two query heads per key/value group where the model had two or more: ``tx``
    goes on pruning query heads within their group, and refuses a model whose every query head has its own
    key/value head. So where the masks keep one query head per group (e.g. 4 query heads, 2 key/value heads and
    a heads sparsity of 0.5) the compacted model keeps two, one of them zero padding: its attention is no smaller,
    its MLP is; :func:`compact` alone goes down to one.

    Args:
      state: the ``TrainState``.
      config: the model or its config, as for :func:`compact`.
      tx: the optax transformation of the state.
      mesh, rules: where the compacted state goes.
      multiple_of: as for :func:`compact`; default: per axis, the product of the mesh axes the rules shard it
        over (``tensor`` for ``mlp`` and ``heads`` under the default rules; the expert-parallel axes for
        ``experts``).
      masks: the group masks to compact by (e.g. :func:`jaxpar.pruning.select_experts`'), instead of the state's
        :func:`structured_pruning` masks (None). The carried state (``state.carried``: the router's bias and load)
        is cut with the params.

    Returns:
      ``(new_state, new_config)``: ``new_state`` owns fresh buffers (no array is shared with ``state``, also for
      leaves compaction leaves unchanged), so either state can be donated to a jitted step and the other read.

    Raises:
      ValueError: as :func:`compact_opt_state`; a compacted state whose structure or leaf shapes and dtypes
        differ from ``tx.init`` of the compacted model (the leaf path is named).
    """
    multiple_of = _mesh_multiples(mesh, rules) if multiple_of is None else multiple_of
    # the carried state rides along inside the params (an expert's router state is cut with its weights)
    merged = protocol.merge_carried(state.params, state.carried)
    masks = state.opt_state if masks is None else masks
    c = Compaction.build(merged, masks, config, multiple_of, carry=True)
    params, carried = protocol.split_carried(c.params(merged))
    opt_state = c.opt_state(state.opt_state, merged)
    target = train.abstract_state(_model(c.config, merged).init, tx, mesh=mesh, rules=rules, policy=state.policy)
    new = state.replace(params=params, opt_state=opt_state, carried=carried)
    if jax.tree.structure(new) != jax.tree.structure(target):
        raise ValueError("the compacted state does not have the structure of tx.init of the compacted model: pass "
                         "the tx the state was built with (an optimizer that factors a param only above a size, "
                         "as optax.adafactor's min_dim_size_to_factor, may stop factoring a compacted one: "
                         "re-initialise its state with tx.init)")
    for (path, x), t in zip(jax.tree_util.tree_flatten_with_path(new)[0], jax.tree.leaves(target)):
        if (tuple(jnp.shape(x)), jnp.result_type(x)) != (tuple(t.shape), t.dtype):
            raise ValueError(f"compacted state leaf {key_path(path, indexing=True)} is {jnp.result_type(x)}"
                             f"{list(jnp.shape(x))} but tx.init of the compacted model makes it {t.dtype}"
                             f"{list(t.shape)}: pass the tx the state was built with")
    # may_alias=False: fresh buffers even for leaves compaction leaves alone, so donating either state into a
    # jitted step never deletes the other's arrays.
    return jax.tree.map(lambda x, t: jax.device_put(x, t.sharding, may_alias=False), new, target), c.config
