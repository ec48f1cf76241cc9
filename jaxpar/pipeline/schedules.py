"""Pipeline schedules as data: a table of actions per (tick, stage), its validation and its analysis.

A :class:`Schedule` says what every stage does at every tick: ``F(microbatch, chunk)`` (forward),
``B(microbatch, chunk)`` (backward: input and weight gradients together), ``W(microbatch, chunk)`` (a
separate weight-gradient pass, for zero-bubble tables) or ``None`` (idle). Chunk ``c`` on stage ``s`` is the
virtual stage ``v = c * num_stages + s`` (Narayanan et al. 2021, sec. 2.2.2, interleaved stages); a
non-interleaved table has one chunk. Plain Python builds and checks a table; one interpreter
(:mod:`jaxpar.pipeline.interpreter`, through :mod:`jaxpar.pipeline.table`'s control table) executes any
valid table; the same table gives the bubble fraction, the peak number of stashed activations and the
receive-buffer sizes.

Timing model (what the validator enforces): every action takes one tick; a value an action produces
(an activation sent forward, a cotangent sent backward) can be used from the next tick on, so a dependency
must sit at a strictly earlier tick.

Buffer model (what the analysis counts, and what the runtime allocates):

* **stash**: stage ``s`` keeps what its backward needs (vjp residuals, or the stage input when
  recomputing) for microbatch ``j`` from its ``F(j)`` to its ``B(j)`` (to its ``W(j)`` when the table has
  ``W``s);
* **activation receive slots**: the input of ``F(j)`` on virtual stage ``v > 0`` waits in a slot from the
  tick the previous virtual stage produced it until the ``F`` that reads it;
* **cotangent receive slots**: the output cotangent of ``B(j)`` waits from the tick the next virtual stage's
  ``B(j)`` produced it; on the last virtual stage it is the loss cotangent, computed by its ``F(j)``.

A buffer written at tick ``t0`` and read at tick ``t1`` occupies a slot over ``[t0, t1)``: a slot read at
tick ``t`` may be written again at tick ``t`` (the runtime reads before it writes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

KINDS = ("F", "B", "W")


class Action(NamedTuple):
    """One unit of work: ``kind`` is ``'F'``, ``'B'`` or ``'W'``; ``microbatch`` and ``chunk`` count from 0."""
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def F(microbatch: int, chunk: int = 0) -> Action:
    """The forward pass of ``microbatch`` through ``chunk`` of a stage."""
    return Action("F", microbatch, chunk)


def B(microbatch: int, chunk: int = 0) -> Action:
    """The backward pass (input and weight gradients) of ``microbatch`` through ``chunk`` of a stage."""
    return Action("B", microbatch, chunk)


def W(microbatch: int, chunk: int = 0) -> Action:
    """The weight-gradient pass of ``microbatch`` (a table that has ``W``s has one for every ``B``)."""
    return Action("W", microbatch, chunk)


class Interval(NamedTuple):
    """A buffer slot in use on ``stage`` over ticks ``[start, stop)``, for ``(microbatch, chunk)``."""
    stage: int
    start: int
    stop: int
    microbatch: int
    chunk: int


def _max_overlap(intervals: Sequence[Interval]) -> int:
    events = sorted([(iv.start, 1) for iv in intervals] + [(iv.stop, -1) for iv in intervals])
    live = peak = 0
    for _, delta in events:          # at equal ticks, -1 sorts before +1: a slot read at t is free at t
        live += delta
        peak = max(peak, live)
    return peak


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``table[tick][stage]`` is an :class:`Action` or ``None`` (idle).

    Attributes:
      name: a label (``'gpipe'``, ``'1f1b'``, ...).
      num_stages: pipeline stages ``p`` (the mesh's ``pipe`` size that runs it).
      num_microbatches: microbatches ``m`` the global batch is split into.
      table: ``num_ticks`` rows of ``num_stages`` entries.
      num_chunks: model chunks per stage (1 unless interleaved).

    Raises:
      ValueError: (from construction) a malformed table or one that breaks a dependency, misses an action
        or repeats one; the message names the tick, stage and action.
    """
    name: str
    num_stages: int
    num_microbatches: int
    table: tuple[tuple[Action | None, ...], ...]
    num_chunks: int = 1

    def __post_init__(self):
        object.__setattr__(self, "table", tuple(tuple(row) for row in self.table))
        validate(self)

    # ------------------------------------------------------------------------------------------ analysis
    @property
    def num_ticks(self) -> int:
        """Rows of the table: the schedule's length in unit-cost ticks."""
        return len(self.table)

    @property
    def has_backward(self) -> bool:
        """False for a forward-only table (inference), True for a training table."""
        return any(a is not None and a.kind == "B" for row in self.table for a in row)

    @property
    def bubble_fraction(self) -> float:
        """Idle (tick, stage) slots over all slots, every action costing one tick.

        For GPipe and 1F1B with ``p`` stages and ``m`` microbatches this is ``(p-1)/(m+p-1)``.
        """
        idle = sum(a is None for row in self.table for a in row)
        return idle / (self.num_ticks * self.num_stages)

    def lifetimes(self) -> dict[str, tuple[Interval, ...]]:
        """The buffer intervals of the table: ``{'stash', 'activations', 'cotangents'}`` -> intervals.

        See the module docstring for what each buffer holds and when its slot is in use.
        """
        p, v_last = self.num_stages, self.num_stages * self.num_chunks - 1
        when = _tick_index(self)
        split_w = any(key[0] == "W" for key in when)
        out: dict[str, list[Interval]] = {"stash": [], "activations": [], "cotangents": []}
        for (kind, j, v), t in when.items():
            s, c = v % p, v // p
            if kind == "F" and self.has_backward:
                free = when[("W" if split_w else "B", j, v)]
                out["stash"].append(Interval(s, t, free, j, c))
            if kind == "F" and v > 0:
                out["activations"].append(Interval(s, when[("F", j, v - 1)], t, j, c))
            if kind == "B":
                src = when[("F", j, v)] if v == v_last else when[("B", j, v + 1)]
                out["cotangents"].append(Interval(s, src, t, j, c))
        return {k: tuple(sorted(v)) for k, v in out.items()}

    def _per_stage_peak(self, buffer: str) -> tuple[int, ...]:
        ivs = self.lifetimes()[buffer]
        return tuple(_max_overlap([iv for iv in ivs if iv.stage == s]) for s in range(self.num_stages))

    @property
    def peak_stash(self) -> tuple[int, ...]:
        """Per stage, the most microbatches (times chunks) whose backward state is held at once.

        GPipe: ``m`` on every stage. 1F1B: ``p - s`` on stage ``s`` (independent of ``m``).
        """
        return self._per_stage_peak("stash")

    @property
    def recv_slots(self) -> tuple[tuple[int, int], ...]:
        """Per stage, ``(activation slots, cotangent slots)``: the receive buffers the runtime allocates.

        The last stage's cotangent slots hold the loss cotangents its ``F``s compute until its ``B``s.
        """
        return tuple(zip(self._per_stage_peak("activations"), self._per_stage_peak("cotangents")))

    def forward_only(self) -> Schedule:
        """The forward-only table of the same ``(p, m)`` (for inference): ``F(j)`` on stage ``s`` at tick ``j+s``."""
        return _forward_table(self.num_stages, self.num_microbatches, f"{self.name}/forward")

    def __str__(self) -> str:
        """A text Gantt chart, one line per stage, e.g. ``s0 | F0 F1 .  B0 ...``."""
        width = max([len(str(a)) for row in self.table for a in row if a is not None] + [1])
        lines = [(f"{self.name}: {self.num_stages} stages, {self.num_microbatches} microbatches, "
                  f"{self.num_ticks} ticks, bubble {self.bubble_fraction:.3f}")]
        for s in range(self.num_stages):
            cells = [(str(row[s]) if row[s] is not None else ".").ljust(width) for row in self.table]
            lines.append(f"s{s} | " + " ".join(cells))
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------- validation

def _tick_index(schedule: Schedule) -> dict[tuple[str, int, int], int]:
    """``(kind, microbatch, virtual stage) -> tick``, assuming a valid table."""
    p = schedule.num_stages
    return {(a.kind, a.microbatch, a.chunk * p + s): t
            for t, row in enumerate(schedule.table) for s, a in enumerate(row) if a is not None}


def _check_shape(schedule: Schedule) -> None:
    for name in ("num_stages", "num_microbatches", "num_chunks"):
        value = getattr(schedule, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Schedule.{name}={value!r} must be a positive int")
    if not schedule.table:
        raise ValueError(f"schedule {schedule.name!r} has an empty table")
    for t, row in enumerate(schedule.table):
        if len(row) != schedule.num_stages:
            raise ValueError(f"schedule {schedule.name!r}: tick {t} has {len(row)} entries; every row needs one "
                             f"per stage ({schedule.num_stages})")
        for s, a in enumerate(row):
            if a is None:
                continue
            if not isinstance(a, Action) or a.kind not in KINDS:
                raise ValueError(f"schedule {schedule.name!r}: tick {t} stage {s} holds {a!r}; use F(mb, chunk), "
                                 "B(mb, chunk), W(mb, chunk) or None")
            if not (0 <= a.microbatch < schedule.num_microbatches and 0 <= a.chunk < schedule.num_chunks):
                raise ValueError(f"schedule {schedule.name!r}: tick {t} stage {s}: {a} is out of range (microbatches "
                                 f"0..{schedule.num_microbatches - 1}, chunks 0..{schedule.num_chunks - 1})")


def _check_once(schedule: Schedule) -> dict[tuple[str, int, int], int]:
    """Every action exactly once; returns the tick index."""
    p, seen = schedule.num_stages, {}
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is None:
                continue
            key = (a.kind, a.microbatch, a.chunk * p + s)
            if key in seen:
                raise ValueError(f"schedule {schedule.name!r}: {a} on stage {s} appears twice (ticks {seen[key]} "
                                 f"and {t}); each action must run exactly once")
            seen[key] = t
    kinds = {"F", "B", "W"} & {k[0] for k in seen}
    if "W" in kinds and "B" not in kinds:
        raise ValueError(f"schedule {schedule.name!r} has W actions but no B actions")
    for kind in sorted(kinds | {"F"}):
        for j in range(schedule.num_microbatches):
            for v in range(p * schedule.num_chunks):
                if (kind, j, v) not in seen:
                    raise ValueError(f"schedule {schedule.name!r}: {Action(kind, j, v // p)} never runs on stage "
                                     f"{v % p}; every microbatch needs one {kind} per stage and chunk")
    return seen


def _check_order(schedule: Schedule, when: dict[tuple[str, int, int], int]) -> None:
    p, v_last = schedule.num_stages, schedule.num_stages * schedule.num_chunks - 1
    for (kind, j, v), t in when.items():
        if kind == "F":
            needs = [("F", j, v - 1)] if v > 0 else []
        elif kind == "B":
            needs = [("F", j, v)] + ([("B", j, v + 1)] if v < v_last else [])
        else:
            needs = [("B", j, v)]
        for dep in needs:
            if when[dep] >= t:
                a, d = Action(kind, j, v // p), Action(dep[0], j, dep[2] // p)
                raise ValueError(
                    f"schedule {schedule.name!r}: {a} on stage {v % p} at tick {t} needs {d} of stage "
                    f"{dep[2] % p} at an earlier tick, but that runs at tick {when[dep]}")


def validate(schedule: Schedule) -> None:
    """Checks a table: shape, ranges, every action exactly once, every dependency at an earlier tick.

    Dependencies: ``F(j)`` of virtual stage ``v`` after ``F(j)`` of ``v-1``; ``B(j)`` of ``v`` after ``F(j)``
    of ``v`` and after ``B(j)`` of ``v+1``; ``W(j)`` after ``B(j)`` of the same ``v``. A table without ``B``s is
    a forward-only (inference) table.

    Raises:
      ValueError: naming the first offending tick, stage and action.
    """
    _check_shape(schedule)
    _check_order(schedule, _check_once(schedule))


# ---------------------------------------------------------------------------------------------- builders

def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")


def _forward_table(p: int, m: int, name: str) -> Schedule:
    table = [[None] * p for _ in range(m + p - 1)]
    for s in range(p):
        for j in range(m):
            table[j + s][s] = F(j)
    return Schedule(name, p, m, table)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019, sec. 2.2): all forwards, then all backwards.

    ``F(j)`` runs on stage ``s`` at tick ``j + s``; ``B(j)`` at tick ``(m + p - 1) + j + (p - 1 - s)``. Every
    stage stashes all ``m`` microbatches; ``2 (m + p - 1)`` ticks; bubble ``(p - 1) / (m + p - 1)``.

    Args:
      num_stages: ``p >= 1``.
      num_microbatches: ``m >= 1``.

    Raises:
      ValueError: a size that is not a positive int.
    """
    _check_sizes(num_stages, num_microbatches)
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


def _greedy_ticks(name: str, p: int, m: int, orders: list[list[Action]]) -> Schedule:
    """Places each stage's ordered actions at the earliest tick their dependencies allow."""
    done: dict[tuple[str, int, int], int] = {}
    pos, table = [0] * p, []
    while any(pos[s] < len(orders[s]) for s in range(p)):
        row: list[Action | None] = [None] * p
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            a = orders[s][pos[s]]
            deps = [("F", a.microbatch, s - 1)] if a.kind == "F" and s > 0 else []
            if a.kind == "B":
                deps = [("F", a.microbatch, s)] + ([("B", a.microbatch, s + 1)] if s < p - 1 else [])
            if all(d in done for d in deps):
                row[s] = a
        for s, a in enumerate(row):
            if a is not None:
                done[(a.kind, a.microbatch, s)] = len(table)
                pos[s] += 1
        if not any(row):
            raise AssertionError(f"{name}: deadlock in the action orders {orders}")  # a builder bug
        table.append(tuple(row))
    return Schedule(name, p, m, table)


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
      ValueError: a size that is not a positive int; ``num_microbatches < num_stages`` (the warm-up alone
        needs ``p - 1`` microbatches in flight, so the steady state never forms: use :func:`gpipe`).
    """
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    if m < p:
        raise ValueError(f"1F1B needs num_microbatches >= num_stages, got {m} microbatches for {p} stages: the "
                         f"warm-up alone keeps {p - 1} in flight. Use num_microbatches >= {p} (more is better: "
                         f"bubble (p-1)/(m+p-1)), or jp.pipeline.gpipe")
    return _greedy_ticks("1f1b", p, m, [_one_f_one_b_order(p, m, s) for s in range(p)])


__all__ = ["Action", "B", "F", "Interval", "Schedule", "W", "gpipe", "one_f_one_b", "validate"]
