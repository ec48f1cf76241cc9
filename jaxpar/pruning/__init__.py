"""Magnitude pruning as optax transformations on sharded parameters.

* Schedules (Zhu & Gupta 2017, eq. 1): :func:`polynomial_sparsity`, :func:`constant_sparsity`,
  :func:`one_shot`; pure functions of the step, so one compiled step serves every step.
* Distributions over tensors: ``uniform``, ``global`` (one threshold), ``erk`` (Evci et al. 2020).
* Structure: unstructured, or N:M along each kernel's reduction axes (Mishra et al. 2021).
* :func:`magnitude_pruning`: the optax transformation, chained after the optimizer; :func:`masks` and
  :func:`sparsity_report` for inspection.

Modules: ``schedules`` (sparsity vs step), ``structure`` (which leaves, layer and reduction axes, from logical
names), ``select`` (exact top-k by bisection on counts, N:M groups, ERK), ``transform`` (the optax
transformation).
"""

from jaxpar.pruning.schedules import SparsitySchedule, constant_sparsity, one_shot, polynomial_sparsity
from jaxpar.pruning.select import erk_densities
from jaxpar.pruning.structure import BATCH_AXIS_NAMES, LeafPlan, make_plans
from jaxpar.pruning.transform import (DISTRIBUTIONS, MagnitudePruningState, magnitude_pruning, masks,
                                      sparsity_report)

__all__ = ["BATCH_AXIS_NAMES", "DISTRIBUTIONS", "LeafPlan", "MagnitudePruningState", "SparsitySchedule",
           "constant_sparsity", "erk_densities", "magnitude_pruning", "make_plans", "masks", "one_shot",
           "polynomial_sparsity", "sparsity_report"]
