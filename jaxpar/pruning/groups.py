"""Groups of weights that are pruned together, found from the params' logical axis names.

A group is one index along a logical axis (``mlp``: an MLP neuron; ``heads``: an attention head) in every leaf
that is coupled through that axis: removing the neuron removes a column of the up-projection, its bias entry and
a row of the down-projection at once. Everything here is static (paths, shapes, names): a :class:`GroupPlan` per
group kind and module, plus the array helpers that score groups and broadcast their masks to the leaves.

Coupling rules (documented on :func:`jaxpar.pruning.structured_pruning`):

* only the axes in :data:`PRUNABLE_AXES` are ever pruned; ``embed`` (the residual stream every layer reads and
  writes) never is;
* leaves of one module (the same parent path, e.g. the GPT's ``blocks``) that hold the same axis name are
  coupled, automatically, when no other module holds that name;
* chains across modules (an MLP's ``dense_i -> dense_{i+1}``) are given explicitly by ``groups={axis: [(module,
  module, ...), ...]}``; once given for an axis, modules outside the chains stay dense for it;
* grouped-query attention (Ainslie et al. 2023): where the modules of a ``heads`` group also hold leaves named
  ``kv_heads`` (the Llama's ``k_kernel`` / ``v_kernel``, ``G`` key/value heads), the ``H`` query heads are split
  into ``G`` contiguous segments, query head ``h`` reading key/value head ``h // (H // G)``; a query head is pruned
  within its segment and every segment keeps the same number (:attr:`GroupPlan.segments`), so the compacted
  model is again grouped-query attention with ``G`` key/value heads. Key/value heads are never pruned;
* an axis name held by several modules and not chained is an error (its coupling is not clear), as is a leaf
  holding it twice, coupled leaves whose group sizes or stacked-layer axes differ, and ``kv_heads`` sizes that
  disagree or do not divide the number of heads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar._tree import key_names, key_path
from jaxpar.pruning.paths import Path, checked_axis_names
from jaxpar.sharding.rules import STACKED_AXIS_NAMES
from jaxpar.sharding.names import HEADS, KV_HEADS, MLP

PRUNABLE_AXES = (MLP, HEADS)   # logical axes whose entries can be removed; never "embed"
Chains = Mapping[str, Sequence[Sequence[str]]]
NO_NAMES = ("structured pruning finds its groups from the params' logical axis names: pass "
            "axis_names=jax.eval_shape(init_fn, rng) (Flax-boxed) or jp.sharding.logical_specs of it")


def check_axes(axes: Sequence[str]) -> tuple[str, ...]:
    """``axes`` as a tuple; ValueError unless they are distinct names from :data:`PRUNABLE_AXES`."""
    if isinstance(axes, str) or not isinstance(axes, Sequence) or not axes:
        raise ValueError(f"axes={axes!r} must be a non-empty tuple of logical axis names from {PRUNABLE_AXES}")
    bad = [a for a in axes if a not in PRUNABLE_AXES]
    if bad or len(set(axes)) != len(axes):
        raise ValueError(f"axes {tuple(axes)}: {bad or 'repeated names'} cannot be pruned; structured pruning "
                         f"removes entries of {PRUNABLE_AXES} only, each named once ('embed' is never pruned: it is "
                         "the residual stream every layer reads and writes)")
    return tuple(axes)


@dataclasses.dataclass(frozen=True)
class Member:
    """One leaf of a group.

    Attributes:
      index: the leaf's position in the params' flattening order.
      path: its key names, e.g. ``("blocks", "up_kernel")``.
      shape: its global shape.
      axis: the axis along which the group's entries lie.
      batch_axes: its stacked-layer axes (``layers`` / ``stage``), in the order of :attr:`GroupPlan.batch_shape`.
    """
    index: int
    path: Path
    shape: tuple[int, ...]
    axis: int
    batch_axes: tuple[int, ...]

    @property
    def positions(self) -> tuple[int, ...]:
        """The leaf axes a group mask ``[*batch_shape, size]`` runs along, in the mask's order."""
        return (*self.batch_axes, self.axis)


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One kind of group in one module (or chain of modules): e.g. the GPT's ``blocks`` heads.

    Attributes:
      modules: the module paths of the chain (one module for coupling within a module); the first names it.
      axis_name: the logical axis, ``"mlp"`` or ``"heads"``.
      size: groups per stacked slice (the axis' length).
      batch_shape: the stacked-layer sizes (``(num_layers,)`` for the GPT, ``()`` unstacked).
      members: the coupled leaves.
      segments: the axis is split into this many contiguous, equal segments that each keep the same number of
        groups: the ``G`` key/value groups of grouped-query attention for ``heads`` (1: no constraint).
    """
    modules: tuple[Path, ...]
    axis_name: str
    size: int
    batch_shape: tuple[int, ...]
    members: tuple[Member, ...]
    segments: int = 1

    @property
    def key(self) -> Path:
        """Where its mask lives in the masks dict: the first module's path, then the axis name."""
        return (*self.modules[0], self.axis_name)

    @property
    def name(self) -> str:
        return key_path(self.key)

    @property
    def mask_shape(self) -> tuple[int, ...]:
        return (*self.batch_shape, self.size)

    @property
    def segment_shape(self) -> tuple[int, ...]:
        """``(*batch_shape, segments, size // segments)``: a mask's shape split by segment."""
        return (*self.batch_shape, self.segments, self.size // self.segments)

    @property
    def group_weights(self) -> int:
        """Weights in one group (over all its leaves, one stacked slice)."""
        return sum(math.prod(m.shape) // (m.shape[m.axis] * math.prod(m.shape[a] for a in m.batch_axes))
                   for m in self.members)


def _module_path(path: str | Sequence[str]) -> Path:
    if isinstance(path, str):
        return tuple(p for p in path.split("/") if p)
    return tuple(str(p) for p in path)


def _holders(params: Any, names_list: list, axes: Sequence[str]) -> dict[str, dict[Path, list]]:
    """Per axis name, per module: ``(leaf index, path, shape, names)`` of the floating leaves holding it."""
    out: dict[str, dict[Path, list]] = {a: {} for a in axes}
    for i, ((kpath, leaf), names) in enumerate(zip(jax.tree_util.tree_flatten_with_path(params)[0], names_list)):
        if names is None or not (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)):
            continue
        path = key_names(kpath)
        for a in axes:
            if names.count(a) > 1:
                raise ValueError(f"{key_path(path)} has logical axes {names}: '{a}' appears twice, so which of its "
                                 f"axes a group runs along is not clear; name one of them differently")
            if a in names:
                out[a].setdefault(path[:-1], []).append((i, path, tuple(jnp.shape(leaf)), names))
    return out


def _plan(modules: tuple[Path, ...], axis_name: str, leaves: list) -> GroupPlan:
    """The plan of the coupled ``leaves``; ValueError when their group sizes or stacked axes disagree."""
    members, seen = [], None
    for i, path, shape, names in leaves:
        axis = names.index(axis_name)
        batch = tuple(a for a, n in enumerate(names) if n in STACKED_AXIS_NAMES)
        sig = (shape[axis], tuple(names[a] for a in batch), tuple(shape[a] for a in batch))
        if seen is not None and sig != seen[1]:
            raise ValueError(
                f"{key_path(path)} and {key_path(seen[0])} share the logical axis '{axis_name}' in "
                f"{' -> '.join(key_path(m) or '<top>' for m in modules)} but disagree on its size or stacked axes "
                f"({sig} vs {seen[1]}: size, stacked-axis names, sizes); their coupling is not clear: rename an axis "
                "or give groups= chains that match")
        seen = seen or (path, sig)
        members.append(Member(i, path, shape, axis, batch))
    return GroupPlan(modules, axis_name, seen[1][0], seen[1][2], tuple(members))


def _check_chains(groups: Chains | None, axes: Sequence[str]) -> dict[str, list[tuple[Path, ...]]]:
    if groups is None:
        return {}
    if not isinstance(groups, Mapping):
        raise TypeError(f"groups={groups!r} must be a dict {{axis name: [(module, module, ...), ...]}}, e.g. "
                        "{'mlp': [('dense_0', 'dense_1')]}")
    out = {}
    for axis, chains in groups.items():
        if axis not in axes:
            raise ValueError(f"groups names the axis {axis!r}, which is not pruned here (axes {tuple(axes)})")
        if isinstance(chains, str) or not all(isinstance(c, (tuple, list)) and c for c in chains):
            raise TypeError(f"groups[{axis!r}]={chains!r} must be a list of chains, each a tuple of module paths "
                            "such as ('dense_0', 'dense_1')")
        out[axis] = [tuple(_module_path(m) for m in chain) for chain in chains]
    return out


def group_plans(params: Any, axis_names: Any, axes: Sequence[str] = PRUNABLE_AXES,
                groups: Chains | None = None) -> list[GroupPlan]:
    """The :class:`GroupPlan` s of ``params`` for the given axes (see the module docstring for the rules).

    Args:
      params: the (unboxed) params or their shapes.
      axis_names: their logical names (``jax.eval_shape(init_fn, rng)``, Flax-boxed, or logical specs).
      axes: the logical axes to prune, a subset of :data:`PRUNABLE_AXES`.
      groups: explicit chains across modules, ``{axis: [(module, ...), ...]}`` (module paths as ``"a/b"``).

    Returns:
      The plans, ordered by axis (as in ``axes``) then by first leaf.

    Raises:
      ValueError: no ``axis_names``; an axis outside :data:`PRUNABLE_AXES`; an axis held by several modules with
        no chain for it; a chained module that does not hold the axis or sits in two chains; coupled leaves that
        disagree (group size, stacked axes); a leaf holding the axis twice; ``axis_names`` not matching the params
        (structure, or a boxed leaf's shape along an axis other than ``mlp``/``heads``).
    """
    if axis_names is None:
        raise ValueError(NO_NAMES)
    axes = check_axes(axes)
    chains = _check_chains(groups, axes)
    names_list = checked_axis_names(params, axis_names)
    holders = _holders(params, names_list, axes)
    kv_holders = _holders(params, names_list, (KV_HEADS,))[KV_HEADS] if HEADS in axes else {}
    plans = []
    for axis in axes:
        modules = holders[axis]
        if axis in chains:
            plans += _chain_plans(axis, chains[axis], modules)
        elif len(modules) > 1:
            raise ValueError(
                f"the logical axis '{axis}' appears in several modules ({', '.join(key_path(m) or '<top>' for m in modules)}); "
                f"which of them feed each other is not clear from the names: pass groups={{'{axis}': [('producer', "
                f"'consumer'), ...]}} (e.g. an MLP's ('dense_0', 'dense_1')), or leave '{axis}' out of the pruned axes")
        elif modules:
            (module, leaves), = modules.items()
            plans.append(_plan((module,), axis, leaves))
    plans = [_segmented(p, kv_holders) if p.axis_name == HEADS else p for p in plans]
    return sorted(plans, key=lambda p: (list(axes).index(p.axis_name), p.members[0].index))


def _segmented(plan: GroupPlan, kv_holders: dict[Path, list]) -> GroupPlan:
    """``plan`` with ``segments`` = the ``kv_heads`` size of its modules (grouped-query attention), if any."""
    sizes = {(path, shape[names.index(KV_HEADS)]) for m in plan.modules for _, path, shape, names in
             kv_holders.get(m, ())}
    if not sizes:
        return plan
    kv = {g for _, g in sizes}
    if len(kv) > 1:
        raise ValueError(f"the leaves {sorted(key_path(p) for p, _ in sizes)} next to the heads of {plan.name} "
                         f"disagree on the number of key/value heads ({sorted(kv)}); name them consistently")
    (g,) = kv
    if plan.size % g:
        raise ValueError(f"{plan.name} has {plan.size} query heads but its key/value leaves "
                         f"({sorted(key_path(p) for p, _ in sizes)}) hold {g} kv_heads, which does not divide them; "
                         "grouped-query attention needs num_heads to be a multiple of num_kv_heads")
    return dataclasses.replace(plan, segments=g)


def _chain_plans(axis: str, chains: list[tuple[Path, ...]], modules: dict[Path, list]) -> list[GroupPlan]:
    used: dict[Path, tuple[Path, ...]] = {}
    plans = []
    for chain in chains:
        leaves = []
        for m in chain:
            if m not in modules:
                raise ValueError(f"groups chain {tuple(map(key_path, chain))} for '{axis}': module {key_path(m)!r} "
                                 f"holds no leaf with the logical axis '{axis}' (modules that do: "
                                 f"{sorted(key_path(k) for k in modules)})")
            if m in used:
                raise ValueError(f"module {key_path(m)!r} is in two '{axis}' chains ({tuple(map(key_path, used[m]))} "
                                 f"and {tuple(map(key_path, chain))}); a module's axis belongs to one chain")
            used[m] = chain
            leaves += modules[m]
        plans.append(_plan(chain, axis, leaves))
    return plans


# --------------------------------------------------------------------------------------------- arrays

def group_sumsq(leaf: jax.Array, member: Member) -> jax.Array:
    """Per group, the sum of squares of this leaf's weights in it: float32 ``[*batch_shape, size]``.

    A reduction over the leaf's other axes only, so it runs sharded (GSPMD sums the partial sums of squares
    across the shards of those axes; no kernel is gathered).
    """
    pos = member.positions
    others = tuple(a for a in range(leaf.ndim) if a not in pos)
    s = jnp.sum(jnp.square(leaf.astype(jnp.float32)), axis=others)
    kept = sorted(pos)
    return jnp.transpose(s, [kept.index(p) for p in pos])


def expand(mask: jax.Array, member: Member) -> jax.Array:
    """A group mask ``[*batch_shape, size]`` broadcast to the member leaf's shape."""
    pos = member.positions
    order = sorted(range(len(pos)), key=lambda k: pos[k])
    return jax.lax.broadcast_in_dim(jnp.transpose(mask, order), member.shape, tuple(sorted(pos)))


def nest(keys: Sequence[Path], values: Sequence[Any]) -> dict:
    """``{module...: {axis: value}}``: the values nested by their keys (:attr:`GroupPlan.key`).

    Raises:
      ValueError: a key that is a prefix of another (a module named like an axis next to it).
    """
    out: dict = {}
    for key, value in zip(keys, values):
        node = out
        for k in key[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"group {key_path(key)}: its module path collides with another group's mask key")
        if key[-1] in node:
            raise ValueError(f"group {key_path(key)}: its mask key collides with a module of the same name")
        node[key[-1]] = value
    return out


def lookup(tree: Mapping, key: Path) -> Any:
    """``tree[key[0]][key[1]]...``, or None where a key is missing."""
    node = tree
    for k in key:
        if not isinstance(node, Mapping) or k not in node:
            return None
        node = node[k]
    return node
