"""The control-table compiler: a :class:`~jaxpar.pipeline.schedules.Schedule` turned into the interpreter's program.

The interpreter (:mod:`jaxpar.pipeline.interpreter`) scans over ticks; at tick ``t`` stage ``s`` reads entry
``[t, s]`` of every array of the :class:`Actions` below: its action kind, the microbatch and chunk, and the
buffer slots it reads and writes. The slots come from the schedule's buffer lifetimes
(:meth:`Schedule.lifetimes`), coloured per stage so that the number of slots is each buffer's peak overlap
(:meth:`Schedule.peak_stash`, :meth:`Schedule.recv_slots`; with split backwards the B-only leaves and the
carry to ``W`` share the stash's slots). Every stage
allocates the largest stage's count, as SPMD runs one program on all stages.

**Routing.** Every action produces at most one array of the activation's shape, its *message*: an ``F`` its
output activation (on the last virtual stage: the loss cotangent), a ``B`` its input cotangent. At every
tick each stage hands its message to both neighbours (two ``ppermute``\\ s, ``s -> s + 1`` and
``s -> s - 1`` modulo ``p``, over the pairs the table uses; one when ``p = 2``) and keeps it itself; the
``arrive_*`` fields then say, per source (:data:`SOURCES`: the previous stage, the next stage, this stage),
which receive buffer the message goes to, if any, and in which slot. So sends run in both directions in
one tick, and a virtual stage handing off to another on the same stage (the V placement's turn on the last
stage, or the loss cotangent) is a local write.

**Fused actions.** A table with ``FB`` entries (DualPipeV) runs two actions on a stage in one tick: the ``F``
is described by the usual fields, its ``B`` by :class:`Fused` (``Actions.fused``; ``None`` for every other table,
so their programs are unchanged). Such a ``B``'s input cotangent is a second message, handed round like the
first on a second channel with its own ``arrive_*`` fields.

Schedule validation (dependencies, every action once) is :mod:`jaxpar.pipeline.schedules`' job; this
module assumes a valid table.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import numpy as np

from jaxpar.pipeline.schedules import Interval, Schedule



class Kind(enum.IntEnum):
    """What a (tick, stage) runs, as the table encodes it (:attr:`Actions.kind`) and the interpreter dispatches it.

    The interpreter keys its actions by kind (``{Kind.FWD: fwd, ...}``) and :func:`switch_branches` orders them
    by value into ``lax.switch``'s list, so no list order ties the compiler to the interpreter.
    """
    IDLE = 0        # nothing this tick
    FWD = 1         # F on a virtual stage before the last
    FWD_LAST = 2    # F on the last virtual stage: also the loss, its gradient and the loss cotangent
    BWD = 3         # a fused B: input and weight gradients
    BWD_INPUT = 4   # a split B (its W is elsewhere in the table): the input gradient only
    BWD_WEIGHT = 5  # W: the weight gradient of a split B
    FWD_BWD = 6     # FB: F on a virtual stage before the last, and a fused B (the :class:`Fused` fields) in one tick
    FWD_LAST_BWD = 7  # FB whose F is on the last virtual stage (also the loss), and a fused B


def _named(kind: Kind, branch: Callable) -> Callable:
    """``branch`` traced under ``jax.named_scope("pipeline_<kind>")``, so profiles and HLO dumps name the action."""
    def run(*args):
        with jax.named_scope(f"pipeline_{kind.name.lower()}"):
            return branch(*args)
    return run


def switch_branches(branches: Mapping[Kind, Callable]) -> list[Callable]:
    """``lax.switch``'s branch list from ``{Kind: branch}``: entry ``k`` is the branch of ``Kind(k)``, up to the
    largest kind given (a table that uses the list holds no larger one); a kind below it that is not given gets
    the ``Kind.IDLE`` branch (required). Each branch runs under the named scope ``pipeline_<kind>`` (e.g.
    ``pipeline_fwd``, ``pipeline_bwd_weight``)."""
    return [_named(k if k in branches else Kind.IDLE, branches.get(k, branches[Kind.IDLE]))
            for k in Kind if k <= max(branches)]

# Message sources (the last axis of the ``arrive_*`` fields) and receive buffers (their values).
PREV, NEXT, SELF = range(3)
SOURCES = ("prev", "next", "self")
NO_BUFFER, ACTIVATIONS, COTANGENTS = range(3)


class Fused(NamedTuple):
    """The ``B`` of each ``FB`` entry (zeros elsewhere), and the second message channel: its input cotangent.
    Shapes as in :class:`Actions`."""
    microbatch: np.ndarray    # the fused B's microbatch
    chunk: np.ndarray         # its chunk (where its parameter gradient is added)
    first: np.ndarray         # 1 where its virtual stage is 0 (it writes d input)
    stash_slot: np.ndarray    # the stash slot it reads (and, with split backwards, the bstash slot)
    arrive_buffer: np.ndarray  # per source: NO_BUFFER or COTANGENTS, for a fused B's message received
    arrive_slot: np.ndarray    # per source: its slot


class Actions(NamedTuple):
    """What each (tick, stage) does: int32 ``[num_ticks, num_stages]`` fields, the ``arrive_*`` fields
    ``[num_ticks, num_stages, 3]`` (one entry per source in :data:`SOURCES`); ``fused``: :class:`Fused` for a
    table with ``FB`` entries, else ``None``.

    Arrivals at tick ``t`` are written after the action of tick ``t`` read its slots, so a slot read at tick
    ``t`` may be written again at tick ``t``.
    """
    kind: np.ndarray          # a :class:`Kind`
    microbatch: np.ndarray    # the microbatch the action works on (0 when idle)
    chunk: np.ndarray         # the chunk (index into the stage's stacked chunk parameters; 0 when idle)
    first: np.ndarray         # 1 where the action's virtual stage is 0: F reads the input, B writes d input
    stash_slot: np.ndarray    # F writes its stash to this slot; B (and W) read it
    bstash_slot: np.ndarray   # split backwards: F writes what only B reads to this slot; B reads it
    wstash_slot: np.ndarray   # split B writes what W needs to this slot; W reads it
    act_read: np.ndarray      # activation slot F reads its input from (virtual stages > 0)
    cot_read: np.ndarray      # cotangent slot B reads its output cotangent from
    arrive_buffer: np.ndarray  # per source: NO_BUFFER, ACTIVATIONS or COTANGENTS
    arrive_slot: np.ndarray    # per source: the slot of that buffer the message is written to
    fused: Fused | None = None


class BufferSizes(NamedTuple):
    """Slots of each buffer every stage allocates: the maximum over stages of the table's counts, at least 1.

    With split backwards ``bstash`` and ``wstash`` are one shared buffer with the stash's slots (``bstash ==
    wstash == stash``; see :func:`_stash_at_backward`)."""
    stash: int
    bstash: int
    wstash: int
    activations: int
    cotangents: int


class ControlTable(NamedTuple):
    """The interpreter's program: ``actions`` (:class:`Actions`), ``sizes`` (:class:`BufferSizes`), and the
    ``ppermute`` pairs of the two sends: ``to_next`` (``s -> s + 1 mod p``) and ``to_prev`` (``s -> s - 1``),
    only those the table uses (``to_prev`` is empty when ``p = 2``: the one send reaches both neighbours)."""
    actions: Actions
    sizes: BufferSizes
    to_next: tuple[tuple[int, int], ...]
    to_prev: tuple[tuple[int, int], ...]


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


def _source(p: int, sender: int, receiver: int) -> int:
    if sender == receiver:
        return SELF
    if (sender + 1) % p == receiver:
        return PREV
    if (sender - 1) % p == receiver:
        return NEXT
    raise AssertionError(f"virtual stages on stages {sender} and {receiver} are not neighbours")  # a placement bug


def _kinds(schedule: Schedule, arrays: dict[str, np.ndarray], fused: dict[str, np.ndarray] | None) -> None:
    """The kind, microbatch, chunk and first fields (an ``FB``'s ``F`` in ``arrays``, its ``B`` in ``fused``). A
    ``B`` with a ``W`` of its own computes the input gradient only; one without is a full backward."""
    last, when = schedule.num_virtual_stages - 1, schedule.ticks()
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is None:
                continue
            v = schedule.virtual_stage(s, a.chunk)
            split = ("W", a.microbatch, v) in when
            arrays["kind"][t, s] = {"F": Kind.FWD_LAST if v == last else Kind.FWD, "W": Kind.BWD_WEIGHT,
                                    "B": Kind.BWD_INPUT if split else Kind.BWD,
                                    "FB": Kind.FWD_LAST_BWD if v == last else Kind.FWD_BWD}[a.kind]
            arrays["microbatch"][t, s], arrays["chunk"][t, s], arrays["first"][t, s] = a.microbatch, a.chunk, v == 0
            if a.kind == "FB":
                b = a.backward
                fused["microbatch"][t, s], fused["chunk"][t, s] = b.microbatch, b.chunk
                fused["first"][t, s] = schedule.virtual_stage(s, b.chunk) == 0


def _sender(schedule: Schedule, buffer: str, iv: Interval) -> int:
    """The stage whose message fills a receive interval: virtual stage ``v - 1`` (activations) or ``v + 1``
    (cotangents; the last virtual stage's own loss cotangent)."""
    v = schedule.virtual_stage(iv.stage, iv.chunk)
    if buffer == "activations":
        return schedule.location(v - 1)[0]
    return iv.stage if v == schedule.num_virtual_stages - 1 else schedule.location(v + 1)[0]


def control_table(schedule: Schedule) -> ControlTable:
    """Compiles a valid ``schedule`` (any chunks, placement, fused or split backwards) into a :class:`ControlTable`.

    Returns:
      ``ControlTable(actions, sizes, to_next, to_prev)``; see :class:`Actions` for the fields.
    """
    p, T = schedule.num_stages, schedule.num_ticks
    new = lambda names: {name: np.zeros((T, p, 3) if name.startswith("arrive") else (T, p), np.int32)
                         for name in names}
    arrays = new(Actions._fields[:-1])
    fb = {(t, s) for t, row in enumerate(schedule.table) for s, a in enumerate(row) if a is not None and a.kind == "FB"}
    fused = new(Fused._fields) if fb else None
    _kinds(schedule, arrays, fused)
    lifetimes, sizes, used = schedule.lifetimes(), {}, set()
    for name in ("stash", "bstash", "wstash"):
        field, count = f"{name}_slot", 0
        for s in range(p):
            for iv, k in _colour([iv for iv in lifetimes[name] if iv.stage == s]).items():
                arrays[field][iv.start, s] = k
                if (iv.stop, s) not in fb:
                    arrays[field][iv.stop, s] = k
                elif name == "stash":                    # an FB's B reads its stash (and bstash) slot
                    fused["stash_slot"][iv.stop, s] = k
                count = max(count, k + 1)
        sizes[name] = max(count, 1)
    last = schedule.num_virtual_stages - 1
    for name, buffer, read in (("activations", ACTIVATIONS, "act_read"), ("cotangents", COTANGENTS, "cot_read")):
        count = 0
        for s in range(p):
            for iv, k in _colour([iv for iv in lifetimes[name] if iv.stage == s]).items():
                sender = _sender(schedule, name, iv)
                src = _source(p, sender, s)
                second = buffer == COTANGENTS and schedule.virtual_stage(s, iv.chunk) < last and (iv.start, sender) in fb
                arrive = fused if second else arrays                       # sent by an FB's B: the second channel
                arrive["arrive_buffer"][iv.start, s, src], arrive["arrive_slot"][iv.start, s, src] = buffer, k
                arrays[read][iv.stop, s] = k
                used.add((src, s))
                count = max(count, k + 1)
        sizes[name] = max(count, 1)
    _stash_at_backward(schedule, arrays, sizes, fb)
    to_next = tuple(((s - 1) % p, s) for s in range(p) if (PREV, s) in used)
    to_prev = tuple(((s + 1) % p, s) for s in range(p) if (NEXT, s) in used)
    return ControlTable(Actions(**arrays, fused=None if fused is None else Fused(**fused)), BufferSizes(**sizes),
                        to_next, to_prev)


def _stash_at_backward(schedule: Schedule, arrays: dict[str, np.ndarray], sizes: dict[str, int],
                       fb: set[tuple[int, int]]) -> None:
    """With split backwards the stash interval runs from ``F`` to ``W``: its ``B`` reads the same slot. The
    B-only leaves (``bstash``, ``F`` to ``B``) and ``B``'s carry to ``W`` (``wstash``, ``B`` to ``W``) share
    one buffer (:class:`jaxpar.pipeline.stash.SharedSlots`) with the stash's slots: a (microbatch, chunk) keeps
    its stash slot in all three from its ``F`` to its ``W``. (An ``FB``'s ``B``, ``fb``'s (tick, stage), reads
    :attr:`Fused.stash_slot`, set with its interval.)"""
    if not schedule.split_backward:
        return
    when = schedule.ticks()
    for (kind, j, v), t in when.items():
        s, _ = schedule.location(v)
        if kind == "B" and (t, s) not in fb:
            arrays["stash_slot"][t, s] = arrays["stash_slot"][when[("F", j, v)], s]
    arrays["bstash_slot"][:] = arrays["wstash_slot"][:] = arrays["stash_slot"]
    sizes["bstash"] = sizes["wstash"] = sizes["stash"]
