"""Sharding: the device mesh, the logical-name rules, and where params, optimizer state and batches live.

* :mod:`jaxpar.sharding.mesh`: ``make_mesh`` over the axes ``AXES`` (data, pipe, fsdp, context, tensor), hybrid
  meshes over hosts, ``jax.distributed`` start-up.
* :mod:`jaxpar.sharding.rules`: the ``Rules`` of logical names, ``constrain``, named shardings, batch axes.
* :mod:`jaxpar.sharding.experts`: expert parallelism, the routed experts folded onto the batch axes.
* :mod:`jaxpar.sharding.params`: how params and model state are placed (path rules, the model's names, automatic
  FSDP) and the audit of activation names.
* :mod:`jaxpar.sharding.opt_state`: optimizer-state leaves placed along the parameter each follows.
* :mod:`jaxpar.sharding.batches`: global batches split over the batch axes and processes.
* :mod:`jaxpar.sharding.report`: where a state's bytes live, per leaf and per mesh axis.
"""

from jaxpar.sharding import mesh
from jaxpar.sharding.experts import expert_fold_choices, expert_parallel_rules
from jaxpar.sharding.report import LeafReport, ShardingReport, describe_params
from jaxpar.sharding.rules import (DEFAULT_RULES, NON_MATRIX_NAME_PARTS, STACKED_AXIS_NAMES, PathRules, Rules,
                                   batch_axes, batch_sharding, check_transformation, constrain, effective_rules,
                                   global_batch_rows, leaf_axis_names, logical_specs, named_shardings,
                                   opt_state_shardings, path_rules, process_batch_rows, replicated, resolve_names, use,
                                   use_for_init, validate_rules, without_absent_context)

__all__ = ["DEFAULT_RULES", "LeafReport", "NON_MATRIX_NAME_PARTS", "PathRules", "Rules", "STACKED_AXIS_NAMES",
           "ShardingReport", "batch_axes", "batch_sharding", "check_transformation", "constrain", "describe_params",
           "effective_rules", "expert_fold_choices", "expert_parallel_rules", "global_batch_rows", "leaf_axis_names",
           "logical_specs", "mesh", "named_shardings", "opt_state_shardings", "path_rules", "process_batch_rows",
           "replicated", "resolve_names", "use", "use_for_init", "validate_rules", "without_absent_context"]

import jaxpar._face as _face  # noqa: E402

_face.stands_for_module(__name__)   # this package stands where a module stood: patches through it reach the code
del _face
