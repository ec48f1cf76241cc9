"""Pipeline schedules as data: a table of actions per (tick, stage), its validation and its analysis.

A :class:`Schedule` says what every stage (device on the ``pipe`` axis) does at every tick:
``F(microbatch, chunk)`` (forward), ``B(microbatch, chunk)`` (backward), ``W(microbatch, chunk)`` (a separate
weight-gradient pass, in zero-bubble tables), ``FB(mb, chunk, b_mb, b_chunk)`` (a forward and a full backward
fused in one tick, DualPipeV's overlapped pair: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 3.2.1)
or ``None`` (idle). A ``B`` without a ``W`` of the same microbatch and chunk computes the input and the weight
gradients together; with one (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 2) the ``B`` computes
the input gradient only and the ``W`` the weight gradient. Zero-bubble tables split every backward, DualPipeV
only some; an ``FB``'s backward is always full. An ``FB`` is its ``F`` and its ``B`` at the same tick for every
check and count below.

**Chunks and placement.** Each stage holds ``num_chunks`` model chunks (virtual stages; Narayanan et al. 2021,
sec. 2.2, interleaved stages). The model is the chain of ``num_stages * num_chunks`` virtual stages
``0 .. V-1``; ``placement[s][c]`` is the virtual stage that chunk ``c`` of stage ``s`` runs. The default is
round-robin, ``placement[s][c] = c * num_stages + s`` (:func:`round_robin`: chunk 0 goes down the stages,
then chunk 1 down again, ...); :func:`v_shape` is the V placement of ZB-V (stage ``s`` holds ``s`` and
``2p - 1 - s``: chunk 0 goes down, chunk 1 comes back up, the loss is on stage 0). A non-interleaved table
has one chunk. Activations flow from virtual stage ``v`` to ``v + 1`` and cotangents back, between the
stages holding them (the same stage: a local hand-off).

Plain Python builds and checks a table (:mod:`jaxpar.pipeline.builders` has the builders); one interpreter
(:mod:`jaxpar.pipeline.interpreter`, through :mod:`jaxpar.pipeline.table`'s control table) executes any
valid table; the same table gives the bubble fraction, the peak number of stashed activations and the
receive-buffer sizes.

Timing model (what the validator enforces): every action takes one tick; a value an action produces (an
activation sent forward, a cotangent sent backward) can be used from the next tick on, so a dependency
must sit at a strictly earlier tick. (:func:`jaxpar.pipeline.analysis.timing` re-times a table with
per-action costs.)

Buffer model (what the analysis counts, and what the runtime allocates):

* **stash**: stage ``s`` keeps what the backward of a chunk needs (vjp residuals, or the chunk's input when
  recomputing) for microbatch ``j`` from its ``F(j)`` to its ``B(j)``; when the table has ``W``\\ s, what the
  ``W(j)`` reads until the ``W(j)``, and the rest (**bstash**) until the ``B(j)``;
* **wstash** (tables with ``W``\\ s): what ``W(j)`` needs from ``B(j)`` (the cotangents inside the chunk), from
  ``B(j)`` to ``W(j)``;
* **activation receive slots**: the input of ``F(j)`` on virtual stage ``v > 0`` waits in a slot from the
  tick virtual stage ``v - 1`` produced it until the ``F`` that reads it;
* **cotangent receive slots**: the output cotangent of ``B(j)`` waits from the tick virtual stage ``v + 1``'s
  ``B(j)`` produced it; on the last virtual stage it is the loss cotangent, computed by its ``F(j)``.

A buffer written at tick ``t0`` and read at tick ``t1`` occupies a slot over ``[t0, t1)``: a slot read at
tick ``t`` may be written again at tick ``t`` (the runtime reads before it writes).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import NamedTuple

from jaxpar._validate import positive_int

KINDS = ("F", "B", "W", "FB")
Placement = tuple[tuple[int, ...], ...]


class Action(NamedTuple):
    """One unit of work: ``kind`` is ``'F'``, ``'B'``, ``'W'`` or ``'FB'``; ``microbatch`` and ``chunk`` count from 0.

    ``'FB'`` (:func:`FB`) is a forward and a full backward in one tick on one stage: ``microbatch`` and ``chunk``
    are its forward's, ``backward`` its ``B`` (another microbatch, usually another chunk). Every other kind
    leaves ``backward`` ``None``.
    """
    kind: str
    microbatch: int
    chunk: int = 0
    backward: Action | None = None

    def __str__(self) -> str:
        own = f"{'F' if self.kind == 'FB' else self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")
        return own + (f"+{self.backward}" if self.kind == "FB" else "")

    def __repr__(self) -> str:            # the three-field form unless it has a backward (an FB)
        back = "" if self.backward is None else f", backward={self.backward!r}"
        return f"Action(kind={self.kind!r}, microbatch={self.microbatch!r}, chunk={self.chunk!r}{back})"

    def parts(self) -> tuple[Action, ...]:
        """The single actions this entry runs: ``(F, B)`` for an ``FB``, else ``(self,)``."""
        if self.kind == "FB":
            return Action("F", self.microbatch, self.chunk), self.backward
        return (self,)


def F(microbatch: int, chunk: int = 0) -> Action:
    """The forward pass of ``microbatch`` through ``chunk`` of a stage."""
    return Action("F", microbatch, chunk)


def B(microbatch: int, chunk: int = 0) -> Action:
    """The backward pass of ``microbatch`` through ``chunk``: the input gradient only when the table has a ``W``
    of the same microbatch and chunk, else input and weight gradients (a full backward)."""
    return Action("B", microbatch, chunk)


def W(microbatch: int, chunk: int = 0) -> Action:
    """The weight-gradient pass of ``microbatch`` (its ``B`` then computes the input gradient only)."""
    return Action("W", microbatch, chunk)


def FB(microbatch: int, chunk: int, backward_microbatch: int, backward_chunk: int) -> Action:
    """The forward of ``microbatch`` on ``chunk`` and the full backward of ``backward_microbatch`` on
    ``backward_chunk``, fused in one tick on one stage (their computations are independent, so the compiler may
    overlap them): DualPipe's overlapped forward-and-backward chunk (DeepSeek-AI 2024, "DeepSeek-V3 Technical
    Report", sec. 3.2.1, fig. 4-5; torch's ``OVERLAP_F_B``). Written ``F3+B1.1`` (``str``).

    The backward is a full one (input and weight gradients): a table must hold no ``W`` of its microbatch and
    chunk. In the tick model the pair costs one tick; :func:`jaxpar.pipeline.analysis.timing` costs it ``F``
    plus a full ``B``.
    """
    return Action("FB", microbatch, chunk, Action("B", backward_microbatch, backward_chunk))


def _parts(row) -> list[tuple[int, Action]]:
    """``(stage, single action)`` of every action a table row runs (an ``FB`` gives its ``F`` and its ``B``)."""
    return [(s, part) for s, a in enumerate(row) if a is not None for part in a.parts()]


def round_robin(num_stages: int, num_chunks: int) -> Placement:
    """``placement[s][c] = c * num_stages + s``: interleaved stages (Narayanan et al. 2021, sec. 2.2.2)."""
    return tuple(tuple(c * num_stages + s for c in range(num_chunks)) for s in range(num_stages))


def v_shape(num_stages: int) -> Placement:
    """``placement[s] = (s, 2p - 1 - s)``: the V placement of ZB-V (Qi et al. 2024, "Pipeline Parallelism with
    Controllable Memory", sec. 3): chunk 0 goes down the stages, chunk 1 comes back up."""
    return tuple((s, 2 * num_stages - 1 - s) for s in range(num_stages))


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


def dependencies(kind: str, microbatch: int, vstage: int, num_vstages: int) -> list[tuple[str, int, int]]:
    """The ``(kind, microbatch, virtual stage)`` actions that must run at earlier ticks than this one.

    ``F(j)`` of ``v`` after ``F(j)`` of ``v - 1``; ``B(j)`` of ``v`` after ``F(j)`` of ``v`` and ``B(j)`` of
    ``v + 1``; ``W(j)`` of ``v`` after ``B(j)`` of ``v``.
    """
    j, v = microbatch, vstage
    if kind == "F":
        return [("F", j, v - 1)] if v > 0 else []
    if kind == "B":
        return [("F", j, v)] + ([("B", j, v + 1)] if v < num_vstages - 1 else [])
    return [("B", j, v)]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``table[tick][stage]`` is an :class:`Action` or ``None`` (idle).

    Attributes:
      name: a label (``'gpipe'``, ``'1f1b'``, ...).
      num_stages: pipeline stages ``p`` (the mesh's ``pipe`` size that runs it).
      num_microbatches: microbatches ``m`` the global batch is split into.
      table: ``num_ticks`` rows of ``num_stages`` entries.
      num_chunks: model chunks (virtual stages) per stage ``v`` (1 unless interleaved).
      placement: ``placement[s][c]``, the virtual stage chunk ``c`` of stage ``s`` runs: ``p`` rows of ``v``
        ints that together hold ``0 .. p*v - 1`` once each. ``None`` (the default): :func:`round_robin`.

    Raises:
      ValueError: (from construction) a malformed table or placement, or a table that breaks a dependency,
        misses an action or repeats one; the message names the tick, stage, chunk and action. Sizes may be
        any integral type (numpy's too); a table holds at most
        :data:`MAX_TABLE_ENTRIES` entries.
    """
    name: str
    num_stages: int
    num_microbatches: int
    table: tuple[tuple[Action | None, ...], ...]
    num_chunks: int = 1
    placement: Placement | None = None

    def __post_init__(self):
        _int_sizes(self)                     # numpy integer sizes become ints
        object.__setattr__(self, "table", tuple(tuple(row) for row in self.table))
        if self.placement is None and _sizes_ok(self):
            object.__setattr__(self, "placement", round_robin(self.num_stages, self.num_chunks))
        elif self.placement is not None:
            try:
                object.__setattr__(self, "placement", tuple(tuple(row) for row in self.placement))
            except TypeError:
                raise ValueError(f"schedule {self.name!r}: placement={self.placement!r} must be num_stages rows of "
                                 "num_chunks virtual-stage indices") from None
        validate(self)

    # ------------------------------------------------------------------------------------------ placement
    @property
    def num_virtual_stages(self) -> int:
        """``V = num_stages * num_chunks``: the length of the model's chain of virtual stages."""
        return self.num_stages * self.num_chunks

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """The virtual stage (index in the model's chain) that ``chunk`` of ``stage`` runs."""
        return self.placement[stage][chunk]

    def location(self, vstage: int) -> tuple[int, int]:
        """``(stage, chunk)`` holding virtual stage ``vstage``."""
        for s, row in enumerate(self.placement):
            if vstage in row:
                return s, row.index(vstage)
        raise ValueError(f"virtual stage {vstage} is not in 0..{self.num_virtual_stages - 1}")

    # ------------------------------------------------------------------------------------------ analysis
    @property
    def num_ticks(self) -> int:
        """Rows of the table: the schedule's length in unit-cost ticks."""
        return len(self.table)

    @property
    def has_backward(self) -> bool:
        """False for a forward-only table (inference), True for a training table."""
        return any(a.kind == "B" for row in self.table for _, a in _parts(row))

    @property
    def split_backward(self) -> bool:
        """True when the table has ``W`` actions (a ``B`` with a ``W`` of its own then computes the input gradient
        only; one without, as in DualPipeV, is a full backward)."""
        return any(a is not None and a.kind == "W" for row in self.table for a in row)

    @property
    def bubble_fraction(self) -> float:
        """Idle (tick, stage) slots over all slots, every action costing one tick.

        For GPipe and 1F1B with ``p`` stages and ``m`` microbatches this is ``(p-1)/(m+p-1)``. For per-action
        costs (a ``B`` that includes ``W`` costing 2), see :func:`jaxpar.pipeline.analysis.timing`.
        """
        idle = sum(a is None for row in self.table for a in row)
        return idle / (self.num_ticks * self.num_stages)

    def ticks(self) -> dict[tuple[str, int, int], int]:
        """``(kind, microbatch, virtual stage) -> tick`` of every action (an ``FB`` gives its ``F`` and ``B``)."""
        return _tick_index(self)

    def lifetimes(self) -> dict[str, tuple[Interval, ...]]:
        """The buffer intervals: ``{'stash', 'bstash', 'wstash', 'activations', 'cotangents'}`` -> intervals.

        See the module docstring for what each buffer holds and when its slot is in use; ``bstash`` and
        ``wstash`` are empty without ``W``\\ s. A (microbatch, chunk) without a ``W`` (a full backward) holds its
        stash from its ``F`` to its ``B``.
        """
        when, last = _tick_index(self), self.num_virtual_stages - 1
        split, backward = self.split_backward, self.has_backward     # each a pass over the table: once
        out: dict[str, list[Interval]] = {"stash": [], "bstash": [], "wstash": [], "activations": [],
                                          "cotangents": []}
        for (kind, j, v), t in when.items():
            s, c = self.location(v)
            if kind == "F" and backward:
                out["stash"].append(Interval(s, t, when.get(("W", j, v), when[("B", j, v)]), j, c))
            if kind == "F" and split:
                out["bstash"].append(Interval(s, t, when[("B", j, v)], j, c))
            if kind == "F" and v > 0:
                out["activations"].append(Interval(s, when[("F", j, v - 1)], t, j, c))
            if kind == "B":
                src = when[("F", j, v)] if v == last else when[("B", j, v + 1)]
                out["cotangents"].append(Interval(s, src, t, j, c))
            if kind == "W":
                out["wstash"].append(Interval(s, when[("B", j, v)], t, j, c))
        return {k: tuple(sorted(v)) for k, v in out.items()}

    def _per_stage_peak(self, buffer: str) -> tuple[int, ...]:
        ivs = self.lifetimes()[buffer]
        return tuple(_max_overlap([iv for iv in ivs if iv.stage == s]) for s in range(self.num_stages))

    @property
    def peak_stash(self) -> tuple[int, ...]:
        """Per stage, the most (microbatch, chunk) pairs whose backward state is held at once (from ``F`` to
        the ``B``, or to the ``W`` when the table has ``W``\\ s), in units of one chunk and one microbatch.

        GPipe: ``m`` on every stage. 1F1B: ``p - s`` on stage ``s`` (independent of ``m``).
        """
        return self._per_stage_peak("stash")

    @property
    def peak_wstash(self) -> tuple[int, ...]:
        """Per stage, the most (microbatch, chunk) pairs held between their ``B`` and ``W`` (0 without ``W``)."""
        return self._per_stage_peak("wstash")

    @property
    def recv_slots(self) -> tuple[tuple[int, int], ...]:
        """Per stage, ``(activation slots, cotangent slots)``: the receive buffers the runtime allocates.

        The last virtual stage's cotangent slots hold the loss cotangents its ``F``\\ s compute until its ``B``\\ s.
        """
        return tuple(zip(self._per_stage_peak("activations"), self._per_stage_peak("cotangents")))

    def forward_only(self) -> Schedule:
        """The forward-only table of the same stages, chunks and placement (for inference): each stage runs
        its ``F``\\ s in this table's order, each at the earliest tick its input allows (GPipe and 1F1B:
        ``F(j)`` on stage ``s`` at tick ``j + s``)."""
        orders = [[a for row in self.table for st, a in _parts(row) if st == s and a.kind == "F"]
                  for s in range(self.num_stages)]
        return place_in_order(f"{self.name}/forward", self.num_microbatches, orders, self.num_chunks,
                              self.placement)

    def __str__(self) -> str:
        """A text Gantt chart, one line per stage, e.g. ``s0 | F0 F1 .  B0 ...`` (``F3.1``: chunk 1)."""
        width = max([len(str(a)) for row in self.table for a in row if a is not None] + [1])
        lines = [(f"{self.name}: {self.num_stages} stages, {self.num_microbatches} microbatches, "
                  + (f"{self.num_chunks} chunks, " if self.num_chunks > 1 else "")
                  + f"{self.num_ticks} ticks, bubble {self.bubble_fraction:.3f}")]
        for s in range(self.num_stages):
            cells = [(str(row[s]) if row[s] is not None else ".").ljust(width) for row in self.table]
            lines.append(f"s{s} | " + " ".join(cells))
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------- validation

MAX_TABLE_ENTRIES = 10 ** 7
"""The most ``num_ticks * num_stages`` entries a schedule table may hold. Plain Python builds, validates and
analyses a table at about 5 microseconds an entry on one CPU core (a minute at the bound), and the control
table the runtime scans holds eleven ``[ticks, stages]`` int32 arrays (440 MB at the bound). Real runs sit far
below it: interleaved 1F1B at ``p = 128, m = 4096, v = 2`` is 2.1 million entries."""


def check_table_size(what: str, num_ticks: int, num_stages: int, at_least: bool = False) -> None:
    """Raises ValueError when ``num_ticks * num_stages`` exceeds :data:`MAX_TABLE_ENTRIES`, naming the sizes."""
    if num_ticks * num_stages > MAX_TABLE_ENTRIES:
        raise ValueError(f"{what}: a table of {'at least ' if at_least else ''}{num_ticks} ticks x {num_stages} "
                         f"stages = {num_ticks * num_stages:,} entries exceeds the bound of {MAX_TABLE_ENTRIES:,} "
                         "(jp.pipeline.schedules.MAX_TABLE_ENTRIES); use fewer stages or fewer, larger microbatches")


def is_index(value) -> bool:
    """Whether ``value`` is an int ``>= 0`` of any integral type (numpy's too), not a bool: a microbatch or chunk."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


_SIZES = ("num_stages", "num_microbatches", "num_chunks")


def _int_sizes(schedule: Schedule) -> None:
    """Makes ``schedule``'s integral sizes (numpy's too) plain ints, in place; leaves the rest for validation."""
    for name in _SIZES:
        value = getattr(schedule, name)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            object.__setattr__(schedule, name, int(value))


def _check_sizes(schedule: Schedule) -> None:
    for name in _SIZES:
        positive_int(f"Schedule.{name}", getattr(schedule, name))


def _sizes_ok(schedule: Schedule) -> bool:
    """Whether the sizes are positive ints (then the default placement can be built); :func:`validate` names a
    bad one."""
    try:
        _check_sizes(schedule)
    except ValueError:
        return False
    return True


def _check_table(schedule: Schedule) -> None:
    """Raises ValueError for a table over :data:`MAX_TABLE_ENTRIES` or an action whose microbatch or chunk is
    not an int ``>= 0`` (naming the tick, stage and action)."""
    if isinstance(schedule.num_stages, int):
        check_table_size(f"schedule {schedule.name!r}", len(schedule.table), schedule.num_stages)
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if isinstance(a, Action) and (a.kind == "FB") != isinstance(a.backward, Action):
                raise ValueError(f"schedule {schedule.name!r}: tick {t} stage {s} holds {a!r}; only an FB action has a "
                                 "backward, and it needs one: build it with jp.pipeline.FB(mb, chunk, b_mb, b_chunk)")
            parts = a.parts() if isinstance(a, Action) else ()
            if not all(is_index(x.microbatch) and is_index(x.chunk) for x in parts):
                raise ValueError(f"schedule {schedule.name!r}: tick {t} stage {s} holds {a!r}; its microbatch and "
                                 "chunk must be ints >= 0")


def _tick_index(schedule: Schedule) -> dict[tuple[str, int, int], int]:
    """``(kind, microbatch, virtual stage) -> tick``, assuming a valid table."""
    return {(a.kind, a.microbatch, schedule.placement[s][a.chunk]): t
            for t, row in enumerate(schedule.table) for s, a in _parts(row)}


def _check_placement(schedule: Schedule) -> None:
    p, v, pl = schedule.num_stages, schedule.num_chunks, schedule.placement
    fix = "give num_stages rows of num_chunks virtual-stage indices, together holding 0..p*v-1 once each"
    if len(pl) != p or any(len(row) != v for row in pl):
        raise ValueError(f"schedule {schedule.name!r}: placement {pl} is not {p} rows of {v} entries; {fix}")
    flat = [x for row in pl for x in row]
    if any(not isinstance(x, int) or isinstance(x, bool) for x in flat) or sorted(flat) != list(range(p * v)):
        raise ValueError(f"schedule {schedule.name!r}: placement {pl} does not hold each virtual stage 0..{p * v - 1} "
                         f"exactly once; {fix}")


def _check_shape(schedule: Schedule) -> None:
    _check_sizes(schedule)
    _check_placement(schedule)
    if not schedule.table:
        raise ValueError(f"schedule {schedule.name!r} has an empty table")
    for t, row in enumerate(schedule.table):
        if len(row) != schedule.num_stages:
            raise ValueError(f"schedule {schedule.name!r}: tick {t} has {len(row)} entries; every row needs one "
                             f"per stage ({schedule.num_stages})")
        for s, a in enumerate(row):
            if a is None:
                continue
            if (not isinstance(a, Action) or a.kind not in KINDS
                    or (a.kind == "FB" and a.backward.kind != "B")):
                raise ValueError(f"schedule {schedule.name!r}: tick {t} stage {s} holds {a!r}; use F(mb, chunk), "
                                 "B(mb, chunk), W(mb, chunk), FB(mb, chunk, b_mb, b_chunk) or None")
            if not all(0 <= x.microbatch < schedule.num_microbatches and 0 <= x.chunk < schedule.num_chunks
                       for x in a.parts()):
                raise ValueError(f"schedule {schedule.name!r}: tick {t} stage {s}: {a} is out of range (microbatches "
                                 f"0..{schedule.num_microbatches - 1}, chunks 0..{schedule.num_chunks - 1})")


def _where(schedule: Schedule, vstage: int) -> str:
    """``'stage s'``, with the chunk and virtual stage when the table has several chunks."""
    s, c = schedule.location(vstage)
    return f"stage {s}" + (f" (chunk {c}, virtual stage {vstage})" if schedule.num_chunks > 1 else "")


def _check_once(schedule: Schedule) -> dict[tuple[str, int, int], int]:
    """Every ``F`` and ``B`` exactly once, a ``W`` at most once, none for an ``FB``'s (full) backward; returns
    the tick index."""
    seen: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(schedule.table):
        for s, a in _parts(row):
            key = (a.kind, a.microbatch, schedule.placement[s][a.chunk])
            if key in seen:
                raise ValueError(f"schedule {schedule.name!r}: {a} on {_where(schedule, key[2])} appears twice (ticks "
                                 f"{seen[key]} and {t}); each action must run exactly once")
            seen[key] = t
    kinds = {"F", "B", "W"} & {k[0] for k in seen}
    if "W" in kinds and "B" not in kinds:
        raise ValueError(f"schedule {schedule.name!r} has W actions but no B actions")
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is not None and a.kind == "FB" and ("W", a.backward.microbatch, schedule.placement[s][
                    a.backward.chunk]) in seen:
                raise ValueError(f"schedule {schedule.name!r}: tick {t} stage {s}: {a} fuses a full backward, but the "
                                 f"table also has W{a.backward.microbatch} of its chunk; drop that W (an FB's B "
                                 "computes the weight gradient too)")
    for kind in sorted((kinds - {"W"}) | {"F"}):
        for j in range(schedule.num_microbatches):
            for v in range(schedule.num_virtual_stages):
                if (kind, j, v) not in seen:
                    s, c = schedule.location(v)
                    raise ValueError(f"schedule {schedule.name!r}: {Action(kind, j, c)} never runs on "
                                     f"{_where(schedule, v)}; every microbatch needs one {kind} per stage and chunk")
    return seen


def _check_order(schedule: Schedule, when: dict[tuple[str, int, int], int]) -> None:
    for (kind, j, v), t in when.items():
        for dep in dependencies(kind, j, v, schedule.num_virtual_stages):
            if when[dep] >= t:
                a, d = Action(kind, j, schedule.location(v)[1]), Action(dep[0], j, schedule.location(dep[2])[1])
                raise ValueError(
                    f"schedule {schedule.name!r}: {a} on {_where(schedule, v)} at tick {t} needs {d} of "
                    f"{_where(schedule, dep[2])} at an earlier tick, but that runs at tick {when[dep]}")


def validate(schedule: Schedule) -> None:
    """Checks a table: shape, ranges, placement, every action exactly once, every dependency at an earlier tick.

    Dependencies (:func:`dependencies`), over virtual stages ``v`` (placed by ``schedule.placement``): ``F(j)``
    of ``v`` after ``F(j)`` of ``v-1``; ``B(j)`` of ``v`` after ``F(j)`` of ``v`` and after ``B(j)`` of ``v+1``;
    ``W(j)`` after ``B(j)`` of the same ``v``. A table without ``B``\\ s is a forward-only (inference) table. A
    ``W`` is optional per microbatch and chunk (without one the ``B`` is a full backward); an ``FB`` is its ``F``
    and its ``B`` at the same tick, and its ``B`` has no ``W``.

    Raises:
      ValueError: naming the first offending tick, stage (chunk and virtual stage) and action; or a table of
        more than :data:`MAX_TABLE_ENTRIES` ``(tick, stage)`` entries.
    """
    _check_table(schedule)
    _check_shape(schedule)
    _check_order(schedule, _check_once(schedule))


# ------------------------------------------------------------------------------------ greedy placement

def place_in_order(name: str, num_microbatches: int, orders: Sequence[Sequence[Action]], num_chunks: int = 1,
                   placement: Placement | None = None) -> Schedule:
    """A table from each stage's ordered actions: each at the earliest tick its dependencies allow.

    ``orders[s]`` is stage ``s``'s actions in the order it runs them; at every tick each stage runs its next
    action if every dependency ran at an earlier tick (else it idles). This is how the 1F1B and interleaved
    builders time their action orders, and how a user's per-stage action lists become a table
    (:func:`jaxpar.pipeline.actions.from_actions`).

    Raises:
      ValueError: the orders deadlock (a stage's next action waits for one that never comes before it),
        naming each stuck stage's next action and what it waits for; or the table built is invalid.
    """
    p = len(orders)
    placement = round_robin(p, num_chunks) if placement is None else placement
    num_v = p * num_chunks
    done: dict[tuple[str, int, int], int] = {}
    pos, table = [0] * p, []
    while any(pos[s] < len(orders[s]) for s in range(p)):
        row: list[Action | None] = [None] * p
        for s in range(p):
            if pos[s] < len(orders[s]):
                a = orders[s][pos[s]]
                if all(d in done for d in _needs(a, placement[s], num_v)):
                    row[s] = a
        if not any(row):
            raise ValueError(_deadlock(name, len(table), orders, pos, placement, done))
        for s, a in _parts(row):
            done[(a.kind, a.microbatch, placement[s][a.chunk])] = len(table)
        pos = [k + (row[s] is not None) for s, k in enumerate(pos)]
        table.append(tuple(row))
    return Schedule(name, p, num_microbatches, table, num_chunks, placement)


def _needs(a: Action, chunks: Sequence[int], num_v: int) -> list[tuple[str, int, int]]:
    """The ``(kind, microbatch, virtual stage)`` actions an entry (each part of an ``FB``) waits for, on a stage
    whose chunks run the virtual stages ``chunks``."""
    return [d for x in a.parts() for d in dependencies(x.kind, x.microbatch, chunks[x.chunk], num_v)]


def _deadlock(name, tick, orders, pos, placement, done) -> str:
    """The message for orders that deadlock: each stuck stage's next action and what it waits for."""
    num_v = len(placement) * len(placement[0])
    listed = {(x.kind, x.microbatch, placement[s][x.chunk]) for s, order in enumerate(orders) for a in order
              for x in a.parts()}
    stuck = []
    for s, order in enumerate(orders):
        if pos[s] < len(order):
            a = order[pos[s]]
            waits = [f"{k}{j} of virtual stage {v}" + ("" if (k, j, v) in listed else " (in no stage's list)")
                     for k, j, v in _needs(a, placement[s], num_v)
                     if (k, j, v) not in done]
            stuck.append(f"stage {s}: {a} waits for " + ", ".join(waits))
    return (f"schedule {name!r}: the action orders deadlock at tick {tick} (" + "; ".join(stuck)
            + "); reorder them so that every dependency can run first, and list every action once")


__all__ = ["Action", "B", "F", "FB", "Interval", "MAX_TABLE_ENTRIES", "Placement", "Schedule", "W", "check_table_size",
           "dependencies", "is_index", "place_in_order", "round_robin", "v_shape", "validate"]
