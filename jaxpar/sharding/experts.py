"""Expert parallelism's mesh form: the routed experts folded onto the batch mesh axes.

jaxpar adds no mesh axis for experts. The experts dimension of the expert weights carries the logical name
``experts`` (:data:`jaxpar.sharding.names.EXPERTS`), which :data:`jaxpar.sharding.rules.DEFAULT_RULES` leaves
whole (every device holds every expert). Expert parallelism of size ``E`` maps ``experts`` to batch mesh axes
(``data``, ``fsdp``) whose sizes multiply to ``E``, as torchtitan borrows expert ranks from FSDP and Megatron-core
"folds" its expert grid onto the data-parallel ranks (Liu et al. 2025, "MoE Parallel Folding", arXiv 2504.14960).
Why folding rather than a sixth axis (MaxText's ``expert``): the mesh does not change when ``E`` grows, so the
dense layers' placement, the global batch and every other program are those of ``E = 1`` by construction; the
price is that ``E`` must be a product of batch-axis sizes.
"""

from __future__ import annotations

import math

from jax.sharding import Mesh

from jaxpar._validate import positive_int
from jaxpar.sharding.names import DATA, EXPERTS, FSDP, Rules
from jaxpar.sharding.rules import DEFAULT_RULES, batch_axes

FOLD_AXES: tuple[str, ...] = (DATA, FSDP)
"""The mesh axes experts may fold onto, in mesh order: the batch axes that are data parallel."""


def expert_fold_choices(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict[int, tuple[str, ...]]:
    """Each expert-parallel size ``rules`` and ``mesh`` allow, with the batch mesh axes it folds onto.

    The candidates are the batch axes (those the rules' batch name maps to, present in ``mesh``) among
    :data:`FOLD_AXES`, in order of preference: ``fsdp`` alone, ``data`` alone, then ``data`` x ``fsdp``. The
    inner axis comes first because its links are the faster ones (``jp.make_mesh`` puts ``fsdp`` inside ``data``)
    and a dispatch crosses them every MoE layer. A size two candidates share keeps the preferred one; size 1 (no
    expert parallelism) is always allowed, with no axes.

    Returns:
      ``{size: axes}``, e.g. ``{1: (), 2: ('fsdp',), 4: ('data',), 8: ('data', 'fsdp')}`` on data=4 x fsdp=2.
    """
    present = [a for a in batch_axes(rules, mesh) if a in FOLD_AXES]
    ordered = [a for a in FOLD_AXES if a in present]
    candidates = [(a,) for a in reversed(ordered)] + ([tuple(ordered)] if len(ordered) > 1 else [])
    choices: dict[int, tuple[str, ...]] = {1: ()}
    for axes in candidates:
        choices.setdefault(math.prod(mesh.shape[a] for a in axes), axes)
    return choices


def expert_parallel_rules(mesh: Mesh, expert_parallel: int, rules: Rules = DEFAULT_RULES) -> Rules:
    """``rules`` with the routed experts split ``expert_parallel`` ways over batch mesh axes of ``mesh``.

    The rule ``(experts, axes)`` is put first (a first rule wins, so an expert weight ``[experts, embed, ...]``
    gives ``fsdp`` to its experts when ``fsdp`` is among ``axes``, and its ``embed`` dimension stays whole on that
    axis; otherwise ``embed`` keeps its FSDP split) and any other ``experts`` rule is dropped. ``axes`` is the
    preferred fold of that size (:func:`expert_fold_choices`). No other rule changes, so every dense parameter,
    activation and the batch keep the placement of ``expert_parallel=1``.

    Args:
      mesh: the device mesh (its axis sizes decide which sizes are possible).
      expert_parallel: how many ways the experts are split; 1: ``Rules(rules)`` unchanged.
      rules: the logical rules to extend.

    Returns:
      A :class:`jaxpar.sharding.names.Rules`.

    Raises:
      ValueError: ``expert_parallel`` is not a positive int, or no product of batch-axis sizes equals it (the
        message names the sizes that work and the mesh change that would allow it).
    """
    expert_parallel = positive_int("expert_parallel", expert_parallel, " (1: every device holds every expert)")
    rules = Rules(rules)
    if expert_parallel == 1:
        return rules
    choices = expert_fold_choices(mesh, rules)
    if expert_parallel not in choices:
        raise ValueError(_no_fold_message(mesh, rules, expert_parallel, choices))
    return Rules(((EXPERTS, choices[expert_parallel]), *(r for r in rules if r[0] != EXPERTS)))


def _no_fold_message(mesh: Mesh, rules: Rules, size: int, choices: dict[int, tuple[str, ...]]) -> str:
    """Why ``size`` has no fold, which sizes have one, and how to change the mesh for it."""
    present = [a for a in FOLD_AXES if a in batch_axes(rules, mesh)]
    sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in present) or "none"
    works = sorted(choices)
    alternatives = f"{', '.join(map(str, works[:-1]))} or {works[-1]}" if len(works) > 1 else "1"
    devices = math.prod(mesh.shape[a] for a in present)
    if FSDP in present and devices % size == 0:
        fix = f", or set fsdp={size} (data={devices // size}: the same devices, so the same global batch)"
    else:
        fix = (f"; expert parallelism folds onto the batch axes {'/'.join(FOLD_AXES)}, so it must divide their "
               f"{devices} devices")
    return (f"expert_parallel={size} but the batch axes are {sizes}: choose {alternatives}{fix}")


__all__ = ["FOLD_AXES", "expert_fold_choices", "expert_parallel_rules"]
