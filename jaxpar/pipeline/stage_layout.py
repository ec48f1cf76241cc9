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

from typing import Any

import numpy as np

from jaxpar.pipeline.checks import check_schedule
from jaxpar.pipeline.schedules import Schedule
from jaxpar.train.state_layout import permute_blocks


def stage_order(schedule: Schedule) -> tuple[int, ...]:
    """The virtual stage at each block of the stage layout: ``placement[s][c]`` at block ``s * v + c``."""
    return tuple(vs for row in schedule.placement for vs in row)


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
    return permute_blocks(params, stage_order(schedule), "params")


def from_stage_layout(tree: Any, schedule: Schedule) -> Any:
    """The inverse of :func:`to_stage_layout`: stage layout -> model order (for gradients, checkpoints, export).

    Raises:
      TypeError: ``schedule`` is not a Schedule.
      ValueError: a leaf whose leading axis is not divisible by ``num_stages * num_chunks``.
    """
    check_schedule(schedule, "from_stage_layout")
    order = stage_order(schedule)
    return permute_blocks(tree, tuple(int(i) for i in np.argsort(order)), "tree")


__all__ = ["from_stage_layout", "stage_order", "to_stage_layout"]
