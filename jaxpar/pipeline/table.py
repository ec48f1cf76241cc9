"""The control-table compiler: a :class:`~jaxpar.pipeline.schedules.Schedule` turned into the interpreter's program.

The interpreter (:mod:`jaxpar.pipeline.interpreter`) scans over ticks; at tick ``t`` stage ``s`` reads entry
``[t, s]`` of every array of the :class:`Actions` below: its action kind, the microbatch, and the buffer
slots it reads and writes. The slots come from the schedule's buffer lifetimes
(:meth:`Schedule.lifetimes`), coloured per stage so that the number of slots is each buffer's peak overlap
(:meth:`Schedule.peak_stash`, :meth:`Schedule.recv_slots`). Every stage allocates the largest stage's
count, as SPMD runs one program on all stages.

Schedule validation (dependencies, every action once) is :mod:`jaxpar.pipeline.schedules`' job; this
module assumes a valid table.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxpar.pipeline.schedules import Interval, Schedule

# Action kinds: the branch indices of the interpreter's ``lax.switch``.
IDLE, FWD, FWD_LAST, BWD = range(4)   # idle; F; F on the last stage (also the loss); B


class Actions(NamedTuple):
    """What each (tick, stage) does: every field is int32 ``[num_ticks, num_stages]``.

    ``*_write`` slots receive what arrives at that tick (when the matching ``*_on`` flag is 1); a slot read
    at tick ``t`` may be written again at tick ``t`` (the interpreter reads before it writes).
    """
    kind: np.ndarray         # IDLE, FWD, FWD_LAST or BWD
    microbatch: np.ndarray   # the microbatch the action works on (0 when idle)
    stash_slot: np.ndarray   # F writes its residuals to this stash slot; B reads its residuals from it
    act_read: np.ndarray     # activation slot F reads its input from (stages > 0)
    act_write: np.ndarray    # activation slot the activation arriving at this tick is written to
    act_on: np.ndarray       # 1 where an activation arrives at this tick
    cot_read: np.ndarray     # cotangent slot B reads its output cotangent from
    cot_write: np.ndarray    # cotangent slot the cotangent arriving (last stage: computed) at this tick goes to
    cot_on: np.ndarray       # 1 where a cotangent arrives at this tick


class BufferSizes(NamedTuple):
    """Slots of each buffer every stage allocates: the maximum over stages of the table's counts, at least 1."""
    stash: int
    activations: int
    cotangents: int


class ControlTable(NamedTuple):
    """The interpreter's program: ``actions`` (named int32 ``[num_ticks, num_stages]`` arrays) and ``sizes``."""
    actions: Actions
    sizes: BufferSizes


def _colour(intervals: list[Interval]) -> dict[Interval, int]:
    """Slot of each interval, greedily in order of start tick (optimal: uses exactly the peak overlap)."""
    slot_of: dict[Interval, int] = {}
    busy: dict[int, int] = {}                       # slot -> tick it frees at
    for iv in sorted(intervals, key=lambda i: (i.start, i.stop)):
        free = [k for k, stop in busy.items() if stop <= iv.start]
        k = min(free) if free else len(busy)
        busy[k] = iv.stop
        slot_of[iv] = k
    return slot_of


# buffer -> (the Actions field its reader reads, the field its writer writes, the on-flag field or None)
_BUFFER_FIELDS = {"stash": ("stash_slot", "stash_slot", None), "activations": ("act_read", "act_write", "act_on"),
                  "cotangents": ("cot_read", "cot_write", "cot_on")}


def control_table(schedule: Schedule) -> ControlTable:
    """Compiles a valid F/B ``schedule`` (one chunk per stage) into the interpreter's :class:`ControlTable`.

    Returns:
      ``ControlTable(actions, sizes)``: ``actions`` int32 ``[schedule.num_ticks, schedule.num_stages]`` per
      field (see :class:`Actions`); ``sizes`` the slots of the stash, activation and cotangent buffers.
    """
    p = schedule.num_stages
    arrays = {name: np.zeros((schedule.num_ticks, p), np.int32) for name in Actions._fields}
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is not None:
                arrays["kind"][t, s] = BWD if a.kind == "B" else (FWD_LAST if s == p - 1 else FWD)
                arrays["microbatch"][t, s] = a.microbatch
    sizes = {}
    for name, intervals in schedule.lifetimes().items():
        read, write, on = _BUFFER_FIELDS[name]
        used = 0
        for s in range(p):
            for iv, k in _colour([iv for iv in intervals if iv.stage == s]).items():
                arrays[write][iv.start, s], arrays[read][iv.stop, s] = k, k
                if on is not None:
                    arrays[on][iv.start, s] = 1
                used = max(used, k + 1)
        sizes[name] = max(used, 1)
    return ControlTable(Actions(**arrays), BufferSizes(**sizes))
