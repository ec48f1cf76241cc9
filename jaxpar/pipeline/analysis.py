"""Comparing schedules on the same work: per-action costs, bubble fractions, peak stash.

A table's own timing counts every action as one tick. To compare a table whose ``B`` computes input and
weight gradients together with one that splits them into ``B`` and ``W``, the actions get costs
(:func:`default_costs`: ``F = 1``, ``B = 1`` and ``W = 1`` with split backwards, ``B = 2`` where ``B``
includes ``W``) and the table is re-timed (:func:`timing`): each stage runs its actions in the table's
order, each as soon as the stage is free and every dependency has finished.

**Bubble fraction** (the definition used throughout): ``1 - work / (p * makespan)``, the idle share of the
``p`` stages' time from the first action's start to the last action's end, where ``work`` is the sum of the
costs of all actions. With unit costs it is :attr:`Schedule.bubble_fraction` of a table whose actions sit at
their earliest ticks.

The interpreter runs in lockstep (one ``lax.scan`` step per tick, every stage in step), so on hardware a tick
lasts as long as its slowest action; the cost-weighted timing is the schedule's own shape, not the
interpreter's step time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxpar.pipeline.checks import check_costs, check_schedule, check_schedule_list
from jaxpar.pipeline.schedules import Schedule, dependencies


def default_costs(schedule: Schedule) -> dict[str, float]:
    """``{'F': 1, 'B': 1, 'W': 1}`` for a table with split backwards, else ``{'F': 1, 'B': 2, 'W': 1}``.

    An ``FB`` costs its ``F`` plus its full backward unless ``costs`` gives ``'FB'`` (:func:`action_costs`)."""
    return {"F": 1.0, "B": 1.0 if schedule.split_backward else 2.0, "W": 1.0}


def action_costs(schedule: Schedule, costs: Mapping[str, float]) -> Callable[[int, Any], float]:
    """``cost(stage, action)`` of one table entry under per-kind ``costs`` (checked ones).

    ``F``, ``W``: their cost. ``B``: its cost; in a table with ``W``\\ s, a ``B`` without a ``W`` of its own is a
    full backward and costs ``B + W`` (DualPipeV mixes both). ``FB`` (a forward and a full backward in one tick,
    DeepSeek-AI 2024, sec. 3.2.1): ``costs['FB']`` when given (e.g. below ``F + B`` where the pair overlaps
    communication with compute), else ``F`` plus its full backward's cost.
    """
    when, split = schedule.ticks(), schedule.split_backward

    def cost(stage: int, a) -> float:
        if a.kind == "FB":
            return costs["FB"] if "FB" in costs else costs["F"] + cost(stage, a.backward)
        full = a.kind == "B" and split and ("W", a.microbatch, schedule.virtual_stage(stage, a.chunk)) not in when
        return costs[a.kind] + (costs["W"] if full else 0.0)
    return cost


class Timing(NamedTuple):
    """A table re-timed with per-action costs (:func:`timing`); times in cost units."""
    makespan: float                           # the last action's end (the first starts at 0)
    work: float                               # the sum of all actions' costs
    bubble: float                             # 1 - work / (num_stages * makespan)
    start: dict[tuple[str, int, int], float]  # (kind, microbatch, virtual stage) -> start time


def timing(schedule: Schedule, costs: Mapping[str, float] | None = None) -> Timing:
    """Re-times ``schedule`` with per-action ``costs`` (default :func:`default_costs`), keeping each stage's order.

    An action starts when its stage has finished its previous action and every dependency (the module
    docstring of :mod:`jaxpar.pipeline.schedules`) has finished.

    Args:
      schedule: a :class:`Schedule`.
      costs: ``{kind: cost}`` for kinds among ``'F'``, ``'B'``, ``'W'``, ``'FB'``: finite positive numbers (time
        units); every kind the table runs needs one (an ``FB`` runs an ``F`` and a ``B``; see
        :func:`action_costs` for how a full backward and an ``FB`` are costed).

    Raises:
      TypeError: ``schedule`` not a :class:`Schedule` (e.g. a builder's name), or ``costs`` not a mapping.
      ValueError: ``costs`` with a key that is not an action kind, a cost that is not a finite positive
        number (NaN, inf, 0, negative), or missing a kind the table uses.
    """
    check_schedule(schedule, "timing")
    costs = check_costs(costs)
    costs = dict(default_costs(schedule) if costs is None else costs)
    used = {x.kind for row in schedule.table for a in row if a is not None for x in a.parts()}
    for kind in sorted(used):
        if kind not in costs:
            raise ValueError(f"costs={costs}: the table runs {kind} actions; give {kind!r} a positive cost")
    cost, num_v = action_costs(schedule, costs), schedule.num_virtual_stages
    free, end, start, work = [0.0] * schedule.num_stages, {}, {}, 0.0
    for row in schedule.table:                        # tick order is a topological order of a valid table
        for s, a in enumerate(row):
            if a is None:
                continue
            keys = [(x.kind, x.microbatch, schedule.virtual_stage(s, x.chunk)) for x in a.parts()]
            t0 = max([free[s]] + [end[d] for key in keys for d in dependencies(*key, num_v)])
            free[s], work = t0 + cost(s, a), work + cost(s, a)
            for key in keys:                          # an FB's outputs are ready when the pair ends
                start[key], end[key] = t0, free[s]
    makespan = max(end.values())
    return Timing(makespan, work, 1.0 - work / (schedule.num_stages * makespan), start)


def lockstep_time(schedule: Schedule, costs: Mapping[str, float] | None = None) -> float:
    """The table's time when every stage runs in step, as the interpreter does (one ``lax.scan`` step per tick):
    each tick lasts as long as its slowest action, ``sum over ticks of max(cost of the tick's actions)``
    (costs as in :func:`timing`; a tick where every stage idles costs 0). Compare with :func:`timing`'s
    ``makespan``, the time when each action lasts its own cost: the ratio is what lockstep costs the table.

    Raises:
      TypeError, ValueError: as :func:`timing`.
    """
    check_schedule(schedule, "lockstep_time")
    timing(schedule, costs)                                  # validates the costs
    cost = action_costs(schedule, dict(default_costs(schedule) if costs is None else check_costs(costs)))
    return float(sum(max([cost(s, a) for s, a in enumerate(row) if a is not None], default=0.0)
                     for row in schedule.table))


_MEMORY_ARGS = ("loss_fn", "layers", "head", "x", "targets", "mesh")


def _stage_params(layers: Any, schedule: Schedule) -> Any:
    """Zeros of ``layers``' leaves reshaped ``[L, ...] -> [p v, L / (p v), ...]``: each virtual stage's rows."""
    V = schedule.num_virtual_stages
    def rows(a):
        L = a.shape[0] if a.ndim else 0
        if L == 0 or L % V:
            raise ValueError(f"compare: a layers leaf has leading axis {L}, not a multiple of {schedule.name!r}'s "
                             f"{V} virtual stages; give layers with a leading (layer) axis divisible by every "
                             "schedule's num_stages * num_chunks")
        return np.zeros((V, L // V, *a.shape[1:]), a.dtype)
    return jax.tree.map(rows, layers)


def compiled_temp_bytes(schedule: Schedule, stage_fn: Callable, loss_fn: Callable, *, layers: Any, head: Any,
                        x: Any, targets: Any, mesh: Any, stash: str = "residuals") -> int:
    """Compiled temporary memory per device (bytes) of ``jp.pipeline.value_and_grad`` under ``schedule``.

    ``compile().memory_analysis().temp_size_in_bytes`` of the program for zeros of the given shapes (arrays or
    ``ShapeDtypeStruct``\\ s): ``layers`` holds the model's ``L`` layers stacked on a leading axis, of which each
    virtual stage gets ``L / (p v)`` rows (``stage_fn`` must run every row it is given); ``head``, ``x``
    (``[B, ...]``) and ``targets`` as :func:`jaxpar.pipeline.value_and_grad` takes them; ``mesh``'s ``pipe``
    size must be ``schedule.num_stages``.

    Raises:
      TypeError: ``schedule`` not a :class:`Schedule`.
      ValueError: a ``layers`` leaf whose leading axis is not a multiple of ``p v``; and what
        ``value_and_grad`` raises (a mesh whose ``pipe`` size is not ``num_stages``, ...).
    """
    check_schedule(schedule, "compiled_temp_bytes")
    from jaxpar.pipeline.functional import value_and_grad
    zeros = lambda t: jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), t)
    f = value_and_grad(stage_fn, loss_fn, schedule, mesh=mesh, stash=stash)
    lowered = f.lower(_stage_params(layers, schedule), zeros(head), zeros(x), zeros(targets))
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def compare(schedules: Sequence[Schedule], costs: Mapping[str, float] | None = None, *,
            stage_fn: Callable | None = None, **memory: Any) -> list[dict]:
    """One row per schedule: its table's size, cost-weighted time and bubble, its peak stash and, given a stage
    function and shapes, its compiled temporary memory per device.

    Args:
      schedules: :class:`Schedule`\\ s (any builders', or :func:`jaxpar.pipeline.actions.from_actions`').
      costs: per-action costs for every schedule; default :func:`default_costs` of each (``B = 2`` where it
        includes ``W``, so fused and split tables compare on the same work).
      stage_fn: optional; with it, ``loss_fn``, ``layers``, ``head``, ``x``, ``targets`` and ``mesh`` (and
        optionally ``stash``) as keywords: each schedule's program is compiled (:func:`compiled_temp_bytes`;
        the same model and global batch for every schedule, so the microbatch size is ``B / m``).

    Returns:
      A list of dicts with keys ``name``, ``stages``, ``microbatches``, ``chunks``; ``ticks`` (the table's
      unit-tick length); ``time`` and ``bubble`` (:func:`timing`; the bubble fraction is ``1 - work / (p *
      makespan)``); ``peak_stash`` (per stage, the most (microbatch, chunk) pairs held from ``F`` to ``B``,
      or to ``W``); ``peak_stash_layers`` (the same in microbatches of ``1 / p`` of the model's layers, i.e.
      ``peak_stash / chunks``: 1F1B's ``p - s``; comparable across chunk counts); ``peak_wstash`` (per stage,
      the pairs held from ``B`` to ``W``); ``lockstep_time`` (:func:`lockstep_time`); with ``stage_fn``, ``temp_bytes`` (compiled temporary memory per
      device, bytes).

    Raises:
      TypeError: ``schedules`` one Schedule or a string rather than a list, an entry that is not a Schedule, or
        ``costs`` not a mapping.
      ValueError: a bad cost (:func:`timing`: an unknown key, a value that is not finite and positive, a kind
        a table runs missing); ``stage_fn`` given without one of the shapes (named), or an unknown keyword;
        what :func:`compiled_temp_bytes` raises.
    """
    schedules = check_schedule_list(schedules, "compare")
    check_costs(costs)
    if stage_fn is not None or memory:
        missing = [k for k in _MEMORY_ARGS if k not in memory] + (["stage_fn"] if stage_fn is None else [])
        unknown = sorted(set(memory) - set(_MEMORY_ARGS) - {"stash"})
        if missing or unknown:
            raise ValueError(f"compare: compiled memory needs stage_fn and {', '.join(_MEMORY_ARGS)} as keywords; "
                             f"missing {missing}, unknown {unknown}")
    rows = []
    for s in schedules:
        t = timing(s, costs)
        rows.append({"name": s.name, "stages": s.num_stages, "microbatches": s.num_microbatches,
                     "chunks": s.num_chunks, "ticks": s.num_ticks, "time": t.makespan, "bubble": t.bubble,
                     "peak_stash": s.peak_stash, "peak_stash_layers": tuple(x / s.num_chunks for x in s.peak_stash),
                     "peak_wstash": s.peak_wstash, "lockstep_time": lockstep_time(s, costs)})
        if stage_fn is not None:
            shapes = {k: v for k, v in memory.items() if k != "loss_fn"}
            rows[-1]["temp_bytes"] = compiled_temp_bytes(s, stage_fn, memory["loss_fn"], **shapes)
    return rows


__all__ = ["Timing", "action_costs", "compare", "compiled_temp_bytes", "default_costs", "lockstep_time", "timing"]
