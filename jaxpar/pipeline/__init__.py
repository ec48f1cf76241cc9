"""Pipeline parallelism: schedules as data (GPipe, 1F1B), one shard_map interpreter, the pipelined gradient function.

* :mod:`jaxpar.pipeline.schedules`: ``Schedule`` tables, validation and analysis; ``gpipe``, ``one_f_one_b``.
* :mod:`jaxpar.pipeline.table`: the control-table compiler (a schedule -> named ``[ticks, stages]`` arrays).
* :mod:`jaxpar.pipeline.interpreter` (with :mod:`~jaxpar.pipeline.stash`): the ``shard_map`` body that executes
  any table; :mod:`jaxpar.pipeline.checks`: argument checks before tracing.
* :mod:`jaxpar.pipeline.runtime`: ``value_and_grad`` and ``apply`` run any valid table over the ``pipe`` axis.
* :mod:`jaxpar.pipeline.model`: ``Pipeline``, a model as three parts: the gradient function of ``jp.train.make_train_step``.
"""

from jaxpar.pipeline.model import Pipeline
from jaxpar.pipeline.runtime import apply, value_and_grad
from jaxpar.pipeline.schedules import Action, B, F, Schedule, W, gpipe, one_f_one_b, validate

__all__ = ["Action", "B", "F", "Pipeline", "Schedule", "W", "apply", "gpipe", "one_f_one_b",
           "validate", "value_and_grad"]
