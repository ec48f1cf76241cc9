"""Training states whose stacked stage parameters are permuted: the stage layout a pipeline schedule wants.

A pipeline with several chunks per stage keeps its stacked ``[layers, ...]`` parameters, and the optimizer
state that runs along them, permuted so that each stage's chunks sit on its own devices (the pipeline computes
the permutation: :func:`jaxpar.pipeline.stage_layout.stage_order`). The state records it as an opaque
:class:`StateLayout`; the step, the checkpoint manager and ``to_model_order`` apply it without knowing
pipelines.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxpar._tree import key_path
from jaxpar.sharding.opt_state import update_origins   # the dependence walk that places optimizer state


def permute_blocks(tree: Any, order: tuple[int, ...], what: str) -> Any:
    """``tree`` with every leaf's leading axis cut into ``len(order)`` equal blocks, block ``j`` of the result
    being block ``order[j]`` (exact: a gather). ``what`` names the tree in the error.

    Raises:
      ValueError: a leaf whose leading axis does not divide into ``len(order)`` blocks.
    """
    if order == tuple(range(len(order))):
        return tree
    index = np.asarray(order)

    def move(path, a):
        shape = np.shape(a)
        if not shape or shape[0] % len(order):
            raise ValueError(f"{what}{key_path(path, indexing=True)} has shape {shape}: its leading (layers) axis must "
                             f"divide into the schedule's {len(order)} virtual stages; use a number of layers that "
                             f"is a multiple of num_stages * num_chunks = {len(order)}")
        blocks = a.reshape(len(order), shape[0] // len(order), *shape[1:])
        return blocks[index].reshape(shape)
    return jax.tree_util.tree_map_with_path(move, tree)



# ------------------------------------------------------------------------------ training states in stage layout

@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Which leaves of a training state are in a schedule's stage layout (a static, hashable record).

    Built by :func:`state_layout` (through ``Pipeline.state_layout``, from ``jp.train.init_state(...,
    pipeline=pipeline)`` / ``abstract_state``) and
    kept in ``TrainState.layout``; None there means model order. Read by the pipeline's step (which then moves
    no weight over ``pipe``) and by the checkpoint manager (which saves model order).

    Attributes:
      stage_key: the params entry holding the stacked ``[layers, ...]`` stage params (every leaf under it is
        staged along its axis 0).
      order: the virtual stage at each block of the stage layout (the pipeline's ``stage_order``).
      opt_leaves: ``(key path in opt_state, axis)`` of every optimizer-state leaf whose ``axis`` runs along
        the layers axis of a staged parameter (Adam's moments, accumulated gradients, pruning masks, a factored
        moment's row statistics), found from the optimizer's update (:func:`state_layout`), never by name.
    """
    stage_key: str
    order: tuple[int, ...]
    opt_leaves: tuple[tuple[str, int], ...]

    def check_step(self, state: Any, grad_fn: Any, mesh: Any) -> None:
        """Raises ValueError unless the step's gradient function runs over ``pipe`` (``grad_fn.uses_pipe``: a
        pipeline, which reads the layout); any other would take the staged params for model order."""
        if not getattr(grad_fn, "uses_pipe", False):
            raise ValueError(f"the state's params are in a pipeline schedule's stage layout (state.layout="
                             f"{self!r}), which this step would read as model order: step it with the "
                             "jp.pipeline.Pipeline it was built for (make_train_step / make_eval_step(pipeline)), "
                             "or convert it first with jp.train.to_model_order(state)")


def state_layout(stage_key: str, order: tuple[int, ...], tx: Any, param_shapes: Any, opt_shapes: Any,
                 mesh: Any) -> StateLayout | None:
    """The :class:`StateLayout` of a state whose params and optimizer state follow a stage ``order``.

    An optimizer-state leaf is staged along axis ``k`` when its axis ``k`` is computed along axis 0 (layers) of
    a leaf of ``params[stage_key]``: found by tracing ``tx.update`` on shapes and following each state leaf
    back to the parameters it is computed from, axis by axis (the dependence walk that places optimizer state,
    :func:`jaxpar.sharding.opt_state_shardings`), so it holds for any optax transformation, ours included
    (``optax.tree_map_params`` cannot run jaxpar's pruning, whose init reads real shapes).

    Args:
      stage_key: the params entry of the stacked stage params.
      order: the virtual stage at each block of the layers axis (``jaxpar.pipeline.stage_layout.stage_order``).
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
    if order == tuple(range(len(order))):
        return None
    if not isinstance(param_shapes, dict) or stage_key not in param_shapes:
        raise ValueError(f"the pipeline's stage_key={stage_key!r} is not an entry of the params; name the entry "
                         "that holds the stacked [layers, ...] stage params")
    jax.eval_shape(lambda t: permute_blocks(t, order, f"params[{stage_key!r}]"), param_shapes[stage_key])  # divisible
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
            opt_leaves.append((key_path(path, indexing=True), min(axes)))
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
        k = axes.get(key_path(path, indexing=True))
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


__all__ = ["StateLayout", "permute_blocks", "permute_state", "state_layout", "to_layout", "to_model_order"]
