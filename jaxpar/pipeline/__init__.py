"""Pipeline parallelism: schedules as data, one shard_map interpreter, the pipelined gradient function.

* :mod:`jaxpar.pipeline.schedules`: the ``Schedule`` data model (actions per tick and stage, chunks and their
  placement), validation and analysis.
* :mod:`jaxpar.pipeline.builders`: ``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``, ``zero_bubble`` (ZB-H1),
  ``zero_bubble_v`` (ZB-V) and ``dualpipe_v`` (DualPipeV, with fused ``FB`` actions) tables; ``SCHEDULES``, the
  registry of them by name, and ``build(name, num_stages, num_microbatches, **options)``.
* :mod:`jaxpar.pipeline.actions`: ``from_actions``, a user's own schedule as per-stage action lists (torch's
  CSV form too); :mod:`jaxpar.pipeline.analysis`: ``compare``, ``timing`` and ``lockstep_time``
  with per-action costs, ``compiled_temp_bytes``.
* :mod:`jaxpar.pipeline.stage_layout`: ``to_stage_layout`` / ``from_stage_layout`` of stacked stage parameters.
* :mod:`jaxpar.pipeline.table`: the control-table compiler (a schedule -> named ``[ticks, stages]`` arrays).
* :mod:`jaxpar.pipeline.interpreter` (with :mod:`~jaxpar.pipeline.stash` and :mod:`~jaxpar.pipeline.split`, the
  B/W split of a backward): the ``shard_map`` body that executes any table, wrapped in its ``shard_map`` by
  :mod:`jaxpar.pipeline.shard_map`; :mod:`jaxpar.pipeline.checks`: argument checks before tracing.
* :mod:`jaxpar.pipeline.functional`: ``value_and_grad`` and ``apply`` run any valid table over the ``pipe`` axis.
* :mod:`jaxpar.pipeline.staged_model`: ``Pipeline``, a model as three parts: the gradient function of
  ``jp.train.make_train_step``.
"""

from jaxpar.pipeline.analysis import compare, compiled_temp_bytes, lockstep_time, timing
from jaxpar.pipeline.builders import (SCHEDULES, build, dualpipe_v, gpipe, interleaved_1f1b, one_f_one_b, zero_bubble,
                                      zero_bubble_v)
from jaxpar.pipeline.actions import from_actions
from jaxpar.pipeline.stage_layout import from_stage_layout, to_stage_layout
from jaxpar.pipeline.staged_model import Pipeline
from jaxpar.pipeline.functional import apply, value_and_grad
from jaxpar.pipeline.schedules import FB, Action, B, F, Schedule, W, round_robin, v_shape, validate

__all__ = ["Action", "B", "F", "FB", "Pipeline", "SCHEDULES", "Schedule", "W", "apply", "build", "compare",
           "compiled_temp_bytes",
           "dualpipe_v", "from_actions",
           "from_stage_layout", "gpipe", "interleaved_1f1b", "lockstep_time", "one_f_one_b", "round_robin", "timing",
           "to_stage_layout", "v_shape",
           "validate", "value_and_grad", "zero_bubble", "zero_bubble_v"]
