"""Magnitude pruning as optax transformations on sharded parameters, and compaction to a smaller dense model.

Unstructured (masks of single weights):

* Schedules (Zhu & Gupta 2017, eq. 1): :func:`polynomial_sparsity`, :func:`constant_sparsity`,
  :func:`one_shot`; pure functions of the step, so one compiled step serves every step.
* Distributions over tensors: ``uniform``, ``global`` (one threshold), ``erk`` (Evci et al. 2020).
* Structure: unstructured, or N:M along each kernel's reduction axes (Mishra et al. 2021).
* :func:`magnitude_pruning`: the optax transformation, chained after the optimizer; :func:`masks` and
  :func:`sparsity_report` for inspection.

Structured (whole MLP neurons and attention heads, which XLA can then drop: a smaller dense model runs faster and
holds less memory, where unstructured zeros need sparse kernels that XLA lacks):

* :func:`structured_pruning`: the optax transformation, with the same schedules; groups read from the params'
  logical axis names (``mlp``, ``heads``; never ``embed``), coupled within a module or along explicit
  ``groups=`` chains; scored by the group's L2 norm; ``uniform`` or ``global`` per group kind;
  :func:`group_masks` and :func:`param_masks` for inspection.
* :func:`compact` (``(params, masks_or_state, config) -> (new_params, new_config)``), :func:`compact_opt_state`
  and :func:`compact_state` (a ``TrainState`` onto a mesh): the pruned groups removed, every stacked layer padded
  to one count (a multiple of the tensor axis), the optimizer state gathered by the same indices.

Experts (whole experts of a mixture of experts, :mod:`jaxpar.pruning.experts`):

* :func:`select_experts`: per layer, the experts to keep by router load (``state.carried`` or
  :func:`measure_expert_load` on batches) or by weight norm (:func:`expert_scores`); :func:`compact` /
  :func:`compact_state` (``masks=``) remove the rest with their router columns and router state, the router's top-k
  then running over the kept experts.

Modules: ``schedules`` (sparsity vs step), ``structure`` (which leaves, layer and reduction axes, from logical
names), ``select`` (exact top-k by bisection on counts, N:M groups, ERK), ``transform`` (the unstructured
transformation), ``groups`` (coupled groups from logical names), ``structured`` (the structured transformation),
``compact`` (compaction), ``experts`` (expert groups and their selection).
"""

from jaxpar.pruning.compact import Compaction, compact, compact_opt_state, compact_state
from jaxpar.pruning.experts import EXPERT_SCORES, expert_scores, measure_expert_load, select_experts
from jaxpar.pruning.schedules import SparsitySchedule, constant_sparsity, one_shot, polynomial_sparsity
from jaxpar.pruning.select import erk_densities
from jaxpar.pruning.structured import (STRUCTURED_DISTRIBUTIONS, StructuredPruningState, group_masks, param_masks,
                                       structured_pruning)
from jaxpar.pruning.transform import (DISTRIBUTIONS, MagnitudePruningState, magnitude_pruning, masks,
                                      sparsity_report)

__all__ = ["Compaction", "DISTRIBUTIONS", "EXPERT_SCORES", "MagnitudePruningState", "STRUCTURED_DISTRIBUTIONS", "SparsitySchedule",
           "StructuredPruningState", "compact", "compact_opt_state", "compact_state", "constant_sparsity",
           "erk_densities", "expert_scores", "group_masks", "magnitude_pruning", "masks", "measure_expert_load", "one_shot", "param_masks",
           "polynomial_sparsity", "select_experts", "sparsity_report", "structured_pruning"]
