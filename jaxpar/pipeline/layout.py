"""Model order and stage layout of stacked stage parameters.

A model's stacked stage parameters (``[L, ...]`` layers, or ``[V, ...]`` virtual stages) are in **model
order**: row ``i`` is layer ``i``. A schedule with ``v`` chunks per stage runs virtual stage
``schedule.placement[s][c]`` as chunk ``c`` of stage ``s``; the **stage layout** puts each stage's chunks
together, in chunk order, so that a contiguous split of the leading axis over ``pipe`` (what the logical
``layers`` rule gives) hands stage ``s`` exactly its own chunks: block ``s * v + c`` of the leading axis
(``V = p v`` blocks of ``L / V`` layers) is virtual stage ``placement[s][c]``.

For GPipe and 1F1B (one chunk) and any table whose stage layout is the model order, both conversions are
the identity (they return their argument), so code calls them unconditionally.

A training state in a stage layout records it: :class:`StateLayout` (``TrainState.layout``, built by
:func:`state_layout` through ``jp.train.init_state(..., pipeline=)``) names the staged params entry, the order
and every optimizer-state leaf that follows the layers; :func:`permute_state` moves them both ways (the
checkpoint manager saves model order and restores into any layout).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxpar.pipeline.checks import check_schedule
from jaxpar.pipeline.schedules import Schedule
from jaxpar.origins import update_origins   # the dependence walk that places optimizer state


def stage_order(schedule: Schedule) -> tuple[int, ...]:
    """The virtual stage at each block of the stage layout: ``placement[s][c]`` at block ``s * v + c``."""
    return tuple(vs for row in schedule.placement for vs in row)


def _permute(tree: Any, order: tuple[int, ...], what: str) -> Any:
    if order == tuple(range(len(order))):
        return tree
    index = np.asarray(order)

    def move(path, a):
        shape = np.shape(a)
        if not shape or shape[0] % len(order):
            raise ValueError(f"{what}{jax.tree_util.keystr(path)} has shape {shape}: its leading (layers) axis must "
                             f"divide into the schedule's {len(order)} virtual stages; use a number of layers that "
                             f"is a multiple of num_stages * num_chunks = {len(order)}")
        blocks = a.reshape(len(order), shape[0] // len(order), *shape[1:])
        return blocks[index].reshape(shape)
    return jax.tree_util.tree_map_with_path(move, tree)


def to_stage_layout(params: Any, schedule: Schedule) -> Any:
    """Stacked stage parameters in model order -> the stage layout of ``schedule``.

    Args:
      params: a pytree of arrays (numpy or jax, inside ``jit`` too) whose every leaf has a leading axis of
        ``L`` layers (or ``V`` virtual stages) in model order, ``L`` divisible by ``V = num_stages *
        num_chunks``: e.g. the GPT's ``params["blocks"]``, or the ``[V, ...]`` stage parameters of
        :func:`jaxpar.pipeline.value_and_grad`.
      schedule: the :class:`~jaxpar.pipeline.schedules.Schedule` that will run them.

    Returns:
      The same tree, every leaf's leading axis reordered so that block ``s * v + c`` (of ``V`` blocks of
      ``L / V`` rows) is virtual stage ``placement[s][c]``; shapes and dtypes unchanged. ``params`` itself when
      the layout is the model order (GPipe, 1F1B).

    Raises:
      TypeError: ``schedule`` is not a Schedule.
      ValueError: a leaf whose leading axis is not divisible by ``V``.
    """
    check_schedule(schedule, "to_stage_layout")
    return _permute(params, stage_order(schedule), "params")


def from_stage_layout(tree: Any, schedule: Schedule) -> Any:
    """The inverse of :func:`to_stage_layout`: stage layout -> model order (for gradients, checkpoints, export).

    Raises:
      TypeError: ``schedule`` is not a Schedule.
      ValueError: a leaf whose leading axis is not divisible by ``num_stages * num_chunks``.
    """
    check_schedule(schedule, "from_stage_layout")
    order = stage_order(schedule)
    return _permute(tree, tuple(int(i) for i in np.argsort(order)), "tree")


# ------------------------------------------------------------------------------ training states in stage layout

@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Which leaves of a training state are in a schedule's stage layout (a static, hashable record).

    Built by :func:`state_layout` (``jp.train.init_state(..., pipeline=pipeline)`` / ``abstract_state``) and
    kept in ``TrainState.layout``; None there means model order. Read by the pipeline's step (which then moves
    no weight over ``pipe``) and by the checkpoint manager (which saves model order).

    Attributes:
      stage_key: the params entry holding the stacked ``[layers, ...]`` stage params (every leaf under it is
        staged along its axis 0).
      order: :func:`stage_order` of the schedule: the virtual stage at each block of the stage layout.
      opt_leaves: ``(key path in opt_state, axis)`` of every optimizer-state leaf whose ``axis`` runs along
        the layers axis of a staged parameter (Adam's moments, accumulated gradients, pruning masks, a factored
        moment's row statistics), found from the optimizer's update (:func:`state_layout`), never by name.
    """
    stage_key: str
    order: tuple[int, ...]
    opt_leaves: tuple[tuple[str, int], ...]


def state_layout(stage_key: str, schedule: Schedule, tx: Any, param_shapes: Any, opt_shapes: Any,
                 mesh: Any) -> StateLayout | None:
    """The :class:`StateLayout` of a state whose params and optimizer state follow ``schedule``'s stage layout.

    An optimizer-state leaf is staged along axis ``k`` when its axis ``k`` is computed along axis 0 (layers) of
    a leaf of ``params[stage_key]``: found by tracing ``tx.update`` on shapes and following each state leaf
    back to the parameters it is computed from, axis by axis (the dependence walk that places optimizer state,
    :func:`jaxpar.sharding.opt_state_shardings`), so it holds for any optax transformation, ours included
    (``optax.tree_map_params`` cannot run jaxpar's pruning, whose init reads real shapes).

    Args:
      stage_key: the params entry of the stacked stage params.
      schedule: the schedule whose stage layout the state takes.
      tx: the (effective) optax transformation of the state.
      param_shapes, opt_shapes: the unboxed params and ``tx.init(params)`` as ``jax.ShapeDtypeStruct``\\ s.
      mesh: the mesh the update is traced under.

    Returns:
      None when the stage layout is the model order (one chunk per stage: GPipe, 1F1B, ZB-H1), else the layout.

    Raises:
      ValueError: ``stage_key`` not in the params; a stage leaf whose layers axis the schedule's virtual stages
        do not divide; ``tx.update`` cannot be traced on shapes (then which optimizer leaves follow the layers
        is unknown: keep the state in model order with ``Pipeline(..., params_layout='model')``).
    """
    order = stage_order(schedule)
    if order == tuple(range(len(order))):
        return None
    if not isinstance(param_shapes, dict) or stage_key not in param_shapes:
        raise ValueError(f"the pipeline's stage_key={stage_key!r} is not an entry of the params; name the entry "
                         "that holds the stacked [layers, ...] stage params")
    jax.eval_shape(lambda t: _permute(t, order, f"params[{stage_key!r}]"), param_shapes[stage_key])  # divisible
    flat = jax.tree_util.tree_flatten_with_path(param_shapes)[0]
    staged = {i: x.shape[0] for i, (path, x) in enumerate(flat) if _under(path, stage_key)}
    try:
        origins = update_origins(tx, param_shapes, opt_shapes, mesh)
    except Exception as e:  # noqa: BLE001  (a user's update that cannot run on shapes)
        raise ValueError(f"cannot trace tx.update on shapes ({type(e).__name__}: {e}), so which optimizer-state "
                         "leaves follow the stage params is unknown; keep the state in model order (init_state "
                         "without pipeline=, and Pipeline(..., params_layout='model'))") from e
    opt_leaves = []
    for (path, leaf), found in zip(jax.tree_util.tree_flatten_with_path(opt_shapes)[0], origins):
        axes = [k for i, dims in found.items() if i in staged for k, d in enumerate(dims)
                if d == 0 and np.shape(leaf)[k] == staged[i]]
        if axes:
            opt_leaves.append((jax.tree_util.keystr(path), min(axes)))
    return StateLayout(stage_key, order, tuple(opt_leaves))


def _under(path: tuple, key: str) -> bool:
    return bool(path) and isinstance(path[0], jax.tree_util.DictKey) and path[0].key == key


def _take_blocks(a: Any, order: tuple[int, ...], axis: int) -> Any:
    """``a`` with its ``axis`` cut into ``len(order)`` equal blocks, block ``j`` of the result block ``order[j]``."""
    n = np.shape(a)[axis]
    rows = n // len(order)
    index = (np.asarray(order)[:, None] * rows + np.arange(rows)).reshape(-1)
    return a[(slice(None),) * axis + (index,)]


def permute_state(params: Any, opt_state: Any, layout: StateLayout, *, inverse: bool = False) -> tuple[Any, Any]:
    """``(params, opt_state)`` from model order to ``layout`` (``inverse``: from ``layout`` to model order).

    Moves the leaves ``layout`` names (``params[layout.stage_key]`` along axis 0, ``layout.opt_leaves`` along
    their axes) by whole blocks of the layers axis; every other leaf is returned as is. Exact (a gather: no
    arithmetic), so a round trip is bit-identical. Works on numpy or jax arrays, inside ``jit`` too.
    """
    order = tuple(int(i) for i in np.argsort(layout.order)) if inverse else layout.order
    params = {**params, layout.stage_key: jax.tree.map(lambda a: _take_blocks(a, order, 0),
                                                       params[layout.stage_key])}
    axes = dict(layout.opt_leaves)

    def move(path, a):
        k = axes.get(jax.tree_util.keystr(path))
        return a if k is None else _take_blocks(a, order, k)
    return params, jax.tree_util.tree_map_with_path(move, opt_state)


# ------------------------------------------------------------- a TrainState between model order and a layout

def to_model_order(state: Any) -> Any:
    """``state`` with params and optimizer state in model order (``layout=None``); itself when already so.

    The inverse of :func:`to_layout`: exact (whole blocks of the layers axis move, no arithmetic). Arrays keep
    their shardings (the moved blocks cross ``pipe``: a one-off cost, e.g. when saving a checkpoint).
    """
    if state.layout is None:
        return state
    return _moved(state, state.layout, inverse=True).replace(layout=None)


def to_layout(state: Any, layout: StateLayout | None) -> Any:
    """A model-order ``state`` put in ``layout`` (from ``abstract_state(..., pipeline=).layout``); exact.

    Raises:
      ValueError: ``state`` is not in model order (take :func:`to_model_order` first).
    """
    if state.layout is not None:
        raise ValueError(f"to_layout needs a state in model order, got one in {state.layout!r}: pass "
                         "jp.train.to_model_order(state)")
    return state if layout is None else _moved(state, layout, inverse=False).replace(layout=layout)


def _moved(state: Any, layout: StateLayout, inverse: bool) -> Any:
    move = lambda p, o: permute_state(p, o, layout, inverse=inverse)
    leaves = jax.tree.leaves((state.params, state.opt_state))
    if leaves and all(isinstance(x, jax.Array) for x in leaves):
        shardings = jax.tree.map(lambda x: x.sharding, (state.params, state.opt_state))
        move = jax.jit(move, out_shardings=shardings)
    params, opt_state = move(state.params, state.opt_state)
    return state.replace(params=params, opt_state=opt_state)



__all__ = ["StateLayout", "from_stage_layout", "permute_state", "stage_order", "state_layout", "to_stage_layout"]
