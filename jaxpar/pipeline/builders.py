"""Schedule builders: GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1 and ZB-V, DualPipeV, each a plain-Python table.

Every builder returns a :class:`~jaxpar.pipeline.schedules.Schedule` (validated on construction) that the one
interpreter runs. Costs in the docstrings count unit-cost ticks (every ``F``, ``B`` and ``W`` one tick, a
dependency at a strictly earlier tick): the table's own timing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from jaxpar.pipeline.checks import builder_sizes
from jaxpar.pipeline.schedules import (FB, Action, B, F, Placement, Schedule, W, dependencies, place_in_order,
                                       round_robin, v_shape)


def _zero_bubble_sizes(name: str, num_stages, num_microbatches, actions: int) -> tuple[int, int]:
    """A zero-bubble builder's sizes ``(p, m)``: :func:`~jaxpar.pipeline.checks.builder_sizes` (``actions`` per
    microbatch and chunk), then ``m >= p`` (a zero-bubble table needs a microbatch per stage)."""
    p, m, _ = builder_sizes(name, num_stages, num_microbatches, actions=actions)
    if m < p:
        raise ValueError(f"{name} needs num_microbatches >= num_stages, got {m} microbatches for {p} stages; use "
                         f"num_microbatches >= {p}")
    return p, m


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019, sec. 2.2): all forwards, then all backwards.

    ``F(j)`` runs on stage ``s`` at tick ``j + s``; ``B(j)`` at tick ``(m + p - 1) + j + (p - 1 - s)``. Every
    stage stashes all ``m`` microbatches; ``2 (m + p - 1)`` ticks; bubble ``(p - 1) / (m + p - 1)``.

    Args:
      num_stages: ``p >= 1``.
      num_microbatches: ``m >= 1``.

    Raises:
      ValueError: a size that is not a positive integer (any integral type, numpy's too; not a bool), or a
        table over :data:`~jaxpar.pipeline.schedules.MAX_TABLE_ENTRIES` (``num_ticks * num_stages``).
    """
    num_stages, num_microbatches, _ = builder_sizes("gpipe", num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    fwd = m + p - 1
    table = [[None] * p for _ in range(2 * fwd)]
    for s in range(p):
        for j in range(m):
            table[j + s][s] = F(j)
            table[fwd + j + (p - 1 - s)][s] = B(j)
    return Schedule("gpipe", p, m, table)


def _one_f_one_b_order(p: int, m: int, s: int) -> list[Action]:
    """Stage ``s``'s action order: ``p-1-s`` warm-up forwards, then F/B pairs, then the remaining backwards."""
    warmup = min(p - 1 - s, m)
    order = [F(j) for j in range(warmup)]
    for j in range(m - warmup):
        order += [F(warmup + j), B(j)]
    return order + [B(j) for j in range(m - warmup, m)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B, PipeDream-Flush (Narayanan et al. 2021, sec. 2.2, fig. 4 top; Fan et al. 2021, DAPPLE).

    Stage ``s`` runs ``p - 1 - s`` warm-up forwards, then alternates one forward and one backward (the
    steady state), then drains the remaining backwards (cool-down); each action is placed at the earliest
    tick its dependencies allow. Same ``2 (m + p - 1)`` ticks and bubble ``(p - 1) / (m + p - 1)`` as GPipe,
    but stage ``s`` stashes at most ``p - s`` microbatches instead of ``m``.

    Args:
      num_stages: ``p >= 1``.
      num_microbatches: ``m >= p``.

    Raises:
      ValueError: a size that is not a positive integer, or a table over
        :data:`~jaxpar.pipeline.schedules.MAX_TABLE_ENTRIES`; ``num_microbatches < num_stages`` (the warm-up alone
        needs ``p - 1`` microbatches in flight, so the steady state never forms: use :func:`gpipe`).
    """
    num_stages, num_microbatches, _ = builder_sizes("one_f_one_b", num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    if m < p:
        raise ValueError(f"1F1B needs num_microbatches >= num_stages, got {m} microbatches for {p} stages: the "
                         f"warm-up alone keeps {p - 1} in flight. Use num_microbatches >= {p} (more is better: "
                         f"bubble (p-1)/(m+p-1)), or jp.pipeline.gpipe")
    return place_in_order("1f1b", m, [_one_f_one_b_order(p, m, s) for s in range(p)])


def _interleaved_order(p: int, m: int, v: int, s: int) -> list[Action]:
    """Megatron's per-device order (Narayanan et al. 2021, sec. 2.2.2): microbatches in rounds of ``p``; the
    ``k``-th forward is microbatch ``(k // (p v)) p + k % p`` of chunk ``(k // p) % v``, backwards the same with
    the chunks reversed; ``2 (p - 1 - s) + (v - 1) p`` warm-up forwards, then F/B pairs, then the backwards."""
    total = m * v
    mb = lambda k: (k // (p * v)) * p + k % p
    fwd = [F(mb(k), (k // p) % v) for k in range(total)]
    bwd = [B(mb(k), v - 1 - (k // p) % v) for k in range(total)]
    warmup = min(2 * (p - 1 - s) + (v - 1) * p, total)
    order = fwd[:warmup]
    for k in range(total - warmup):
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[total - warmup:]


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2.2): ``num_chunks`` virtual stages per device.

    The model's ``p v`` virtual stages are placed round-robin (device ``s`` holds ``s, s + p, s + 2p, ...``:
    with ``L`` layers, chunk ``c`` of device ``s`` is layers ``(c p + s) L/(p v)`` to ``(c p + s + 1) L/(p v) - 1``);
    every device follows Megatron's order (:func:`_interleaved_order`), each action at the earliest tick its
    dependencies allow. With unit-cost ticks: ``2 (v m + p - 1)`` ticks, bubble ``(p - 1) / (v m + p - 1)``
    (``v`` times smaller than 1F1B's), at a peak stash of ``2 (p - 1 - s) + (v - 1) p + 1`` chunk-microbatches
    on device ``s`` (more than 1F1B's ``p - s`` microbatches of ``v`` chunks on the last devices, less on the
    first). ``num_chunks=1`` is 1F1B.

    Args:
      num_stages: ``p >= 1``.
      num_microbatches: ``m``, a multiple of ``p`` (Megatron's requirement: microbatches go in rounds of ``p``).
      num_chunks: ``v >= 1`` (default 2, the fewest that interleave).

    Raises:
      ValueError: a size that is not a positive integer, a table over
        :data:`~jaxpar.pipeline.schedules.MAX_TABLE_ENTRIES`, or ``m`` not a multiple of ``p``.
    """
    num_stages, num_microbatches, num_chunks = builder_sizes("interleaved_1f1b", num_stages, num_microbatches,
                                                             num_chunks)
    p, m, v = num_stages, num_microbatches, num_chunks
    if m % p:
        raise ValueError(f"interleaved 1F1B needs num_microbatches to be a multiple of num_stages (Megatron's "
                         f"schedule runs microbatches in rounds of p), got {m} microbatches for {p} stages; use "
                         f"num_microbatches = {p * max(1, round(m / p))}")
    if v == 1:
        return place_in_order("interleaved_1f1b", m, [_one_f_one_b_order(p, m, s) for s in range(p)])
    orders = [_interleaved_order(p, m, v, s) for s in range(p)]
    return place_in_order("interleaved_1f1b", m, orders, v, round_robin(p, v))


# --------------------------------------------------------------------------------------- zero bubble

def _list_schedule(name: str, p: int, m: int, placement: Placement, cap: list[int],
                   priority: Callable[[Action, int], tuple]) -> Schedule:
    """Greedy list scheduling with split backwards: at every tick each stage runs its best ready action.

    Ready: every dependency ran at an earlier tick, and the action's microbatch is the next one of its kind on
    its chunk (microbatches keep their order). An ``F`` is ready only while fewer than ``cap[s]``
    (microbatch, chunk) pairs are in flight on stage ``s`` (``F`` run, ``W`` not yet): the stash bound. Among
    ready actions the smallest ``priority(action, vstage)`` runs.
    """
    v_count = len(placement[0])
    num_v = p * v_count
    done: dict[tuple[str, int, int], int] = {}
    nxt = [{(k, c): 0 for k in "FBW" for c in range(v_count)} for _ in range(p)]
    in_flight, table = [0] * p, []
    while len(done) < 3 * m * num_v:
        row: list[Action | None] = [None] * p
        for s in range(p):
            ready = []
            for (k, c), j in nxt[s].items():
                vs = placement[s][c]
                if j < m and all(d in done for d in dependencies(k, j, vs, num_v)) and (
                        k != "F" or in_flight[s] < cap[s]):
                    ready.append((priority(Action(k, j, c), vs), Action(k, j, c)))
            row[s] = min(ready)[1] if ready else None
        if not any(row):
            raise AssertionError(f"{name}: the list scheduler is stuck at tick {len(table)}")  # a builder bug
        for s, a in enumerate(row):
            if a is not None:
                done[(a.kind, a.microbatch, placement[s][a.chunk])] = len(table)
                nxt[s][(a.kind, a.chunk)] += 1
                in_flight[s] += {"F": 1, "B": 0, "W": -1}[a.kind]
        table.append(tuple(row))
    return Schedule(name, p, m, table, v_count, placement)


def _zb_h1_order(p: int, m: int, s: int) -> list[Action]:
    """Stage ``s``'s ZB-H1 order: 1F1B's ``p - s`` forwards, then per microbatch ``j``: ``B(j)``, the ``W`` of
    microbatch ``j - s`` (stage ``s`` defers its ``W``\\ s by ``s``), the next ``F``; then the deferred ``W``\\ s."""
    warm = min(p - s, m)
    order = [F(j) for j in range(warm)]
    for j in range(m):
        order += [B(j)] + ([W(j - s)] if j >= s else []) + ([F(warm + j)] if warm + j < m else [])
    return order + [W(j) for j in range(max(m - s, 0), m)]


def zero_bubble(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 3.1): the backward split into ``B``
    (input gradient) and ``W`` (weight gradient), the ``W``\\ s filling the bubbles, at 1F1B's peak memory.

    Stage ``s`` runs 1F1B's order of ``F``\\ s and ``B``\\ s with each ``W`` right after a ``B``, deferred by
    ``s`` microbatches (:func:`_zb_h1_order`), each action at the earliest tick its dependencies allow: the
    later stages keep the ``B`` chain running and do their ``W``\\ s at the end. Every stage then holds at most
    ``p`` microbatches from ``F`` to ``W`` (1F1B's peak, on its first stage). With ``F = B = W =`` one tick:
    ``3 m + p - 1`` ticks, bubble ``(p - 1) / (3 m + p - 1)``, against 1F1B's ``(p - 1) / (m + p - 1)`` when its
    ``B`` (input and weight gradients) costs 2 (the paper's ``(p-1)(T_F + T_B - T_W)`` against
    ``(p-1)(T_F + T_B + T_W)``).

    Args:
      num_stages: ``p >= 1``.
      num_microbatches: ``m >= p``.

    Raises:
      ValueError: a size that is not a positive integer, a table over
        :data:`~jaxpar.pipeline.schedules.MAX_TABLE_ENTRIES`, or ``m < p``.
    """
    p, m = _zero_bubble_sizes("zero_bubble", num_stages, num_microbatches, actions=3)
    return place_in_order("zb-h1", m, [_zb_h1_order(p, m, s) for s in range(p)])


def zero_bubble_v(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", sec. 3; torch's
    ``ScheduleZBVZeroBubble``): two chunks per device in the V placement (:func:`~jaxpar.pipeline.schedules.v_shape`:
    device ``s`` holds virtual stages ``s`` and ``2p - 1 - s``; the loss is on device 0), split backwards.

    Built by greedy list scheduling (:func:`_list_schedule`): at every tick a device runs a ready ``B`` first,
    else an ``F`` while fewer than ``2p`` chunk-microbatches are in flight on it (``F`` run, ``W`` not yet: 1F1B's
    peak stash, ``p`` microbatches of both chunks), else a pending ``W``; among those, the lowest microbatch,
    then the later virtual stage. With ``F = B = W =`` one tick and ``p <= 4`` this takes ``6 m + p - 1`` ticks
    (bubble ``(p - 1) / (6 m + p - 1)``, torch's at ``p = 4, m = 8``); up to ``p = 8`` (checked to ``m = 24``) at
    most 4 ticks more. Peak stash ``2p`` chunk-microbatches on every device.

    Arguments (``num_stages = p >= 1``, ``num_microbatches = m >= p``) and errors as for :func:`zero_bubble`.
    """
    p, m = _zero_bubble_sizes("zero_bubble_v", num_stages, num_microbatches, actions=6)
    rank = {"B": 0, "F": 1, "W": 2}
    return _list_schedule("zb-v", p, m, v_shape(p), [2 * p] * p,
                          lambda a, vs: (rank[a.kind], a.microbatch, -vs))


# ------------------------------------------------------------------------------------------ DualPipeV

class _Order:
    """One stage's action list as DualPipeV writes it: microbatches counted per (kind, chunk), a queue of the
    ``W``\\ s owed by input-only ``B``\\ s."""

    def __init__(self):
        self.actions: list[Action] = []
        self.next: dict[tuple[str, int], int] = {}
        self.owed: list[Action] = []

    def _take(self, kind: str, chunk: int) -> int:
        j = self.next.get((kind, chunk), 0)
        self.next[(kind, chunk)] = j + 1
        return j

    def f(self, chunk: int) -> None:
        self.actions.append(F(self._take("F", chunk), chunk))

    def b(self, chunk: int, split: bool = False) -> None:
        """A ``B``: a full backward, or (``split``) the input gradient with its ``W`` owed."""
        j = self._take("B", chunk)
        self.actions.append(B(j, chunk))
        self.owed += [W(j, chunk)] if split else []

    def fb(self, f_chunk: int, b_chunk: int) -> None:
        self.actions.append(FB(self._take("F", f_chunk), f_chunk, self._take("B", b_chunk), b_chunk))

    def w(self) -> None:
        """The oldest owed ``W``, if any."""
        if self.owed:
            self.actions.append(self.owed.pop(0))


def _dualpipe_v_order(p: int, m: int, s: int) -> list[Action]:
    """Stage ``s``'s DualPipeV order (chunk 0 is virtual stage ``s``, chunk 1 is ``2p - 1 - s``), in the eight
    steps of DeepSeek's ``DualPipeV`` and torch's ``ScheduleDualPipeV._calculate_single_rank_operations``:
    forwards of chunk 0; pairs of forwards; zero-bubble ``B W F`` of chunk 1; the steady state of fused
    ``FB``\\ s (forward of one chunk, full backward of the other; the last stage's first pair unfused); full
    ``B``\\ s of chunk 1 with ``FB``\\ s; the backwards of both chunks, the later half split (input gradient, its
    ``W`` deferred); ``W B`` of chunk 0; the remaining ``W``\\ s."""
    o = _Order()
    for _ in range(2 * (p - s - 1)):
        o.f(0)
    for _ in range(s + 1):
        o.f(0)
        o.f(1)
    for _ in range(p - s - 1):
        o.b(1, split=True)
        o.w()
        o.f(1)
    for i in range(m - 2 * p + s + 1):
        if i == 0 and s == p - 1:          # not fused: a smaller bubble on the last stage
            o.f(0)
            o.b(1)
        else:
            o.fb(0, 1)
        o.fb(1, 0)
    for _ in range(p - s - 1):
        o.b(1)
        o.fb(1, 0)
    split = False
    for i in range(s + 1):                 # the second half of the backwards split (zero bubble)
        split = split or (i == (s + 1) // 2 and s % 2 == 1)
        o.b(1, split)
        split = split or (i == (s + 1) // 2 and s % 2 == 0)
        o.b(0, split)
    for _ in range(p - s - 1):
        o.w()
        o.b(0, split)
    for _ in range(s + 1):
        o.w()
    if o.owed:
        raise AssertionError(f"dualpipe_v: stage {s} still owes {o.owed}")     # a builder bug
    return o.actions


def dualpipe_v(num_stages: int, num_microbatches: int) -> Schedule:
    """DualPipeV: DualPipe (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 3.2.1, fig. 4-5) "cut in half"
    onto ``p`` devices, as DeepSeek's ``DualPipeV`` (github.com/deepseek-ai/DualPipe) and torch's
    ``ScheduleDualPipeV``: the V placement of ZB-V (:func:`~jaxpar.pipeline.schedules.v_shape`: stage ``s`` holds
    virtual stages ``s`` and ``2p - 1 - s``; the loss is on stage 0), with the forward of one microbatch and the
    full backward of another fused in one tick as an ``FB`` action (:func:`~jaxpar.pipeline.schedules.FB`)
    through the steady state, so a device's forward and backward computations (and their sends) run together.

    Each stage follows DualPipeV's order (:func:`_dualpipe_v_order`: the same per-stage orders as torch's), each
    entry at the earliest tick its dependencies allow: torch's order gives the same table. It mixes full
    backwards (in the ``FB``\\ s and the steady state) with split ones (a ``B`` for the input gradient and a
    later ``W``) in the warm-up and the cool-down, where the ``W``\\ s fill the bubbles. With ``F = B = W = 1``
    (a full backward 2, an ``FB`` 3; :func:`jaxpar.pipeline.analysis.timing`) every device idles ``(p - 1)
    (F&B + B - 3W) = 2 (p - 1)`` units, DualPipe's bubble formula (``B`` the full backward), whatever ``m``: at
    ``p = 4, m = 8`` 34 ticks, bubble 6/54 = 0.111 (ZB-V 0.059, 1F1B with ``B = 2`` 0.273), peak stash ``(8,
    8, 8, 9)`` chunk-microbatches (:meth:`~jaxpar.pipeline.schedules.Schedule.peak_stash`; ZB-V 8 on every
    device), i.e. up to ``p + 1/2`` microbatches of a stage's layers. The cost model has no communication,
    which is what the fused ticks are for (DeepSeek overlaps an ``FB``'s all-to-all and pipeline sends with its
    compute); the interpreter runs an ``FB`` as one branch holding both computations.

    Args:
      num_stages: ``p >= 1`` (devices; the model is ``2p`` virtual stages).
      num_microbatches: ``m >= 2p`` (one in flight per virtual stage before the fused steady state).

    Raises:
      ValueError: a size that is not a positive integer (any integral type, numpy's too; not a bool), a table
        over :data:`~jaxpar.pipeline.schedules.MAX_TABLE_ENTRIES`, or ``num_microbatches < 2 * num_stages``.
    """
    p, m, _ = builder_sizes("dualpipe_v", num_stages, num_microbatches, actions=2)
    if m < 2 * p:
        raise ValueError(f"dualpipe_v needs num_microbatches >= 2 * num_stages (one microbatch per virtual stage of "
                         f"the V before the fused steady state), got {m} microbatches for {p} stages; use "
                         f"num_microbatches >= {2 * p}")
    return place_in_order("dualpipev", m, [_dualpipe_v_order(p, m, s) for s in range(p)], 2, v_shape(p))



# ------------------------------------------------------------------------------------------ the registry

SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb": zero_bubble, "zbv": zero_bubble_v,
    "dualpipev": dualpipe_v}
"""Every schedule by the name the command lines use: ``name -> builder(num_stages, num_microbatches, **options)``.
Adding a schedule is adding its builder here; :func:`build` and every entry point read this table."""


def build(name: str, num_stages: int, num_microbatches: int, **options: Any) -> Schedule:
    """The schedule ``name`` (a key of :data:`SCHEDULES`) for ``num_stages`` stages and ``num_microbatches``
    microbatches: ``SCHEDULES[name](num_stages, num_microbatches, **options)``.

    Args:
      name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb"`` (ZB-H1), ``"zbv"`` (ZB-V) or ``"dualpipev"``.
      num_stages, num_microbatches: the builder's ``p`` and ``m``.
      **options: the builder's own keyword arguments, e.g. ``num_chunks`` of ``"interleaved"``.

    Raises:
      ValueError: an unknown name (the valid names are listed); the builder's own refusals of the sizes.
      TypeError: an option the builder does not take (its options are listed).

    Example:
      ``jp.pipeline.build("interleaved", 2, 8, num_chunks=2)`` is ``jp.pipeline.interleaved_1f1b(2, 8, 2)``.
    """
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; use one of {sorted(SCHEDULES)} "
                         "(jp.pipeline.SCHEDULES), or build a table with jp.pipeline.from_actions")
    builder = SCHEDULES[name]
    takes = [p for p in inspect.signature(builder).parameters][2:]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise TypeError(f"schedule {name!r} ({builder.__name__}) takes no option {', '.join(unknown)}; its options: "
                        f"{takes or 'none'}")
    return builder(num_stages, num_microbatches, **options)


__all__ = ["SCHEDULES", "build", "dualpipe_v", "gpipe", "interleaved_1f1b", "one_f_one_b", "zero_bubble",
           "zero_bubble_v"]
