"""Which parameters are pruned, which of their axes are stacked layers, and their reduction (input) axes.

Parameters reach the optimizer unboxed (plain arrays), so logical axis names come in separately through
``axis_names``: the Flax-boxed tree of ``jax.eval_shape(init_fn, rng)`` or its logical ``PartitionSpec`` tree
(``jp.sharding.logical_specs``). Everything here is static (paths, shapes, names): a plan per leaf.

Rules (documented on :func:`jaxpar.pruning.magnitude_pruning`):

* batch axes: axes named ``layers`` or ``stage`` (stacked layers); each slice along them is one tensor.
* prunable by default: floating leaves with at least two non-batch axes whose name does not contain ``bias``,
  ``scale``, ``norm`` or ``embedding`` (so never norms, biases or embeddings).
* reduction axes (for N:M): with names, the non-batch axes before a trailing ``embed`` axis (an output
  projection such as ``[heads, kv, embed]`` or ``[mlp, embed]``), otherwise the first non-batch axis
  (``[embed, mlp]``, ``[embed, heads, 3, kv]``); without names, axis 0 of a 2-D ``(in, out)`` kernel.
* ERK's view of a layer slice (:attr:`LeafPlan.erk_shape`): the 2-D matrix ``(fan_in, fan_out)`` the kernel
  multiplies by, with the reduction axes folded into ``fan_in`` and the other non-batch axes into ``fan_out``
  (``[embed, heads, 3, kv]`` is ``(embed, heads * 3 * kv)``); where the reduction axes are unknown (an unnamed
  kernel of more than two dimensions, no ``reduction_axes=``) the slice's own shape, as RigL treats conv kernels.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpar._tree import key_names, key_path
from jaxpar.sharding.rules import NON_MATRIX_NAME_PARTS, STACKED_AXIS_NAMES, leaf_axis_names
from jaxpar.sharding.names import EMBED, HEADS, MLP

_RESIZED = (MLP, HEADS)   # the axes structured pruning's compaction shrinks (groups.PRUNABLE_AXES)
_MAX_SIZE = 2 ** 31 - 2  # int32 counts and flat indices (plus one) must fit

Path = tuple[str, ...]
ReductionAxes = Sequence[int] | Callable[[Path, tuple[int, ...]], Sequence[int] | None] | None


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one prunable leaf is pruned.

    Attributes:
      path: the leaf's key names, e.g. ``("blocks", "up_kernel")``.
      shape: its global shape.
      batch_axes: stacked-layer axes; every slice along them is pruned as its own tensor (uniform, ERK).
      reduction_axes: the input axes the kernel contracts over (N:M groups run along them; ERK's ``fan_in``),
        or None when they cannot be told (an unnamed kernel of more than two dimensions).
    """
    path: Path
    shape: tuple[int, ...]
    batch_axes: tuple[int, ...]
    reduction_axes: tuple[int, ...] | None

    @property
    def core_axes(self) -> tuple[int, ...]:
        return tuple(a for a in range(len(self.shape)) if a not in self.batch_axes)

    @property
    def slice_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.core_axes)

    @property
    def slice_size(self) -> int:
        return math.prod(self.slice_shape)

    @property
    def erk_shape(self) -> tuple[int, ...]:
        """The shape whose ``sum / prod`` is ERK's scale for one layer slice (Evci et al. 2020, sec. 3).

        ``(fan_in, fan_out)``: the product of the non-batch reduction axes and the product of the other
        non-batch axes, i.e. the 2-D matrix a dense layer multiplies by (RigL's ``get_sparsities_erdos_renyi``
        sees a dense layer as that matrix). The slice's own shape (``sum`` and ``prod`` over all its axes, as RigL
        does for conv kernels) when the reduction axes are unknown, the slice has fewer than two axes, or the
        reduction axes do not split its axes into two non-empty groups.
        """
        core = self.core_axes
        if self.reduction_axes is None or len(core) < 2:
            return self.slice_shape
        fan_in = [a for a in core if a in self.reduction_axes]
        fan_out = [a for a in core if a not in self.reduction_axes]
        if not fan_in or not fan_out:
            return self.slice_shape
        return (math.prod(self.shape[a] for a in fan_in), math.prod(self.shape[a] for a in fan_out))

    @property
    def num_slices(self) -> int:
        return math.prod(self.shape[a] for a in self.batch_axes)

    @property
    def name(self) -> str:
        return key_path(self.path)


def checked_axis_names(params: Any, axis_names: Any) -> list[tuple[str | None, ...] | None]:
    """``jp.sharding.leaf_axis_names(params, axis_names)``, after checking that Flax-boxed ``axis_names``
    (``jax.eval_shape(init_fn, rng)``) describe arrays of the params' shapes, except along the structurally
    prunable axes ``mlp`` and ``heads`` (whose sizes compaction changes: a compacted model keeps training with
    the transformation built from the original model's names).

    Raises:
      ValueError: a structure mismatch (``leaf_axis_names``), or a leaf whose boxed rank or size along another
        axis differs from the param's (names of another model or config), naming the leaf path.
    """
    names = leaf_axis_names(params, axis_names)
    box = lambda x: isinstance(x, nn.LogicallyPartitioned)
    if axis_names is not None and any(box(x) for x in jax.tree.leaves(axis_names, is_leaf=box)):
        boxes = jax.tree.structure(params).flatten_up_to(axis_names)   # one box (or bare shape) per param
        for (kpath, leaf), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], boxes):
            value = nn.meta.unbox(b)
            if not hasattr(value, "shape"):
                continue
            want, got, axes = tuple(value.shape), tuple(jnp.shape(leaf)), tuple(b.names) if box(b) else ()
            resized = lambda a: a < len(axes) and axes[a] in _RESIZED
            if len(want) != len(got) or any(w != g and not resized(a) for a, (w, g) in enumerate(zip(want, got))):
                raise ValueError(f"axis_names describe {key_path(kpath)} with shape "
                                 f"{want}, but the param has shape {got}: pass the axis_names of these params "
                                 "(jax.eval_shape(init_fn, rng) of their model)")
    return names


def flat_update(transform: str, updates: Any, params: Any) -> tuple[list, Any, list]:
    """``(flat updates, treedef, flat params)`` for a pruning transformation's ``update``, which needs the params.

    Raises:
      ValueError: ``params`` is None, naming ``transform`` and the call that passes them.
    """
    if params is None:
        raise ValueError(f"{transform} needs the params: call tx.update(updates, state, params)")
    flat_u, treedef = jax.tree.flatten(updates)
    return flat_u, treedef, treedef.flatten_up_to(params)


def default_prunable(path: Path, shape: tuple[int, ...], names: tuple | None) -> bool:
    """Weight kernels: at least two non-``layers`` axes, and not a bias, norm scale or embedding by name."""
    batch = sum(1 for n in (names or ()) if n in STACKED_AXIS_NAMES)
    leaf = path[-1].lower() if path else ""
    return len(shape) - batch >= 2 and not any(word in leaf for word in NON_MATRIX_NAME_PARTS)


def default_reduction_axes(shape: tuple[int, ...], names: tuple | None,
                           batch_axes: tuple[int, ...]) -> tuple[int, ...] | None:
    core = [a for a in range(len(shape)) if a not in batch_axes]
    if not core:
        return None
    if names is not None:
        if len(core) > 1 and names[core[-1]] == EMBED:
            return tuple(core[:-1])
        return (core[0],)
    return (0,) if len(shape) == 2 else None


def _override_axes(reduction_axes: ReductionAxes, path: Path, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    axes = reduction_axes(path, shape) if callable(reduction_axes) else reduction_axes
    if axes is None:
        return None
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, int) or not -len(shape) <= a < len(shape):
            raise ValueError(f"reduction_axes {axes} for {key_path(path)} of shape {shape}: axis {a!r} is not an "
                             f"axis of a rank-{len(shape)} array")
        out.append(a % len(shape))
    if len(set(out)) != len(out) or not out:
        raise ValueError(f"reduction_axes {axes} for {key_path(path)} must be distinct axes, at least one")
    return tuple(out)


def make_plans(params: Any, axis_names: Any = None, prunable: Callable[[Path], bool] | None = None,
               reduction_axes: ReductionAxes = None, n_m: tuple[int, int] | None = None) -> list[LeafPlan | None]:
    """One :class:`LeafPlan` per leaf of ``params`` (flattening order), None for leaves not pruned.

    Raises:
      ValueError: ``axis_names`` not matching the params (:func:`checked_axis_names`); with ``n_m``, a
        kernel whose reduction axes cannot be told (unnamed, more than 2-D: pass
        ``axis_names`` or ``reduction_axes``), include a stacked-layer axis, or whose reduction size is not
        divisible by M; a tensor of 2**31 or more elements.
    """
    plans = []
    names_list = checked_axis_names(params, axis_names)
    for (kpath, leaf), names in zip(jax.tree_util.tree_flatten_with_path(params)[0], names_list):
        path = key_names(kpath)
        shape = tuple(jnp.shape(leaf))
        floating = hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
        chosen = prunable(path) if prunable is not None else default_prunable(path, shape, names)
        if not (floating and chosen and math.prod(shape) > 0):
            plans.append(None)
            continue
        batch = tuple(a for a, n in enumerate(names or ()) if n in STACKED_AXIS_NAMES)
        axes = _override_axes(reduction_axes, path, shape) if reduction_axes is not None else None
        if axes is None:
            axes = default_reduction_axes(shape, names, batch)
        plan = LeafPlan(path, shape, batch, axes)
        if math.prod(shape) > _MAX_SIZE:
            raise ValueError(f"{plan.name} has {math.prod(shape)} elements; pruning supports tensors of fewer "
                             "than 2**31 elements (int32 counts); exclude it with prunable=")
        if n_m is not None:
            _check_n_m(plan, n_m)
        plans.append(plan)
    return plans


def _check_n_m(plan: LeafPlan, n_m: tuple[int, int]) -> None:
    m = n_m[1]
    if plan.reduction_axes is None:
        raise ValueError(
            f"{plan.name} has shape {plan.shape} and no logical axis names, so its reduction (input) axes for "
            f"N:M are unknown; pass axis_names=jax.eval_shape(init_fn, rng) or reduction_axes=")
    if set(plan.reduction_axes) & set(plan.batch_axes):
        raise ValueError(f"reduction_axes {plan.reduction_axes} of {plan.name} include a stacked-layer axis "
                         f"{plan.batch_axes}; N:M groups run along a kernel's input axes")
    size = math.prod(plan.shape[a] for a in plan.reduction_axes)
    if size % m:
        raise ValueError(
            f"{plan.name} has shape {plan.shape}: its reduction size {size} (axes {plan.reduction_axes}) is not "
            f"divisible by M={m} of n_m={tuple(n_m)}; exclude it with prunable= or pick M dividing {size}")
