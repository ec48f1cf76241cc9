"""A user's own schedule, given as per-stage action lists (as torch's CSV schedules are), turned into a table.

:func:`from_actions` takes one list per stage (device) and returns a validated
:class:`~jaxpar.pipeline.schedules.Schedule`, which the one interpreter runs like any builder's table. An entry
is an :class:`~jaxpar.pipeline.schedules.Action`, ``None`` (idle), or a string in one of two forms:

* jaxpar's own, ``str(action)``: ``"F3"``, ``"B3"``, ``"W3"`` (chunk 0), ``"F3.1"`` (chunk 1), ``"F3+B1.1"`` (an
  ``FB``: forward of 3 on chunk 0 and full backward of 1 on chunk 1 in one tick); chunks are placed by
  ``placement`` (default round-robin);
* torch's (``torch.distributed.pipelining``'s ``_Action`` strings, e.g. a row of its CSV schedules):
  ``"<virtual stage><kind><microbatch>"``, e.g. ``"4F0"``, with kind ``F`` (forward), ``B`` (full backward),
  ``I`` (input-gradient backward) or ``W`` (weight gradient), and ``"(1F6;6B2)OVERLAP_F_B"`` (an ``FB``, as
  torch's ``ScheduleDualPipeV`` writes its overlapped forward and backward). The virtual stages a stage's list
  names are its chunks, in increasing order; that gives the placement (round-robin, V, or any other). Full
  (``B``) and split (an ``I`` and its ``W``) backwards may be mixed, as DualPipeV does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from jaxpar._validate import positive_int
from jaxpar.pipeline.checks import check_action, check_placement
from jaxpar.pipeline.schedules import (FB, Action, Placement, Schedule, check_table_size, place_in_order,
                                       round_robin)

_OURS = re.compile(r"^([FBW])(\d+)(?:\.(\d+))?$")
_OURS_FB = re.compile(r"^F(\d+)(?:\.(\d+))?\+B(\d+)(?:\.(\d+))?$")
_TORCH = re.compile(r"^(\d+)([FBIW])(\d+)$")
_TORCH_FB = re.compile(r"^\((\d+)F(\d+);(\d+)B(\d+)\)OVERLAP_F_B$")


def _parse(entry, s: int, i: int):
    """``('ours', Action) | ('torch', (vstage, kind, mb)) | ('idle', None)`` of one list entry."""
    if entry is None or (isinstance(entry, str) and entry.strip() in ("", "None")):
        return "idle", None
    if isinstance(entry, Action):
        return "ours", check_action(entry, f"stage {s}, entry {i}")
    if isinstance(entry, str):
        text = entry.strip()
        if (m := _OURS.match(text)):
            return "ours", Action(m[1], int(m[2]), int(m[3] or 0))
        if (m := _OURS_FB.match(text)):
            return "ours", FB(int(m[1]), int(m[2] or 0), int(m[3]), int(m[4] or 0))
        if (m := _TORCH.match(text)):
            return "torch", (int(m[1]), m[2], int(m[3]))
        if (m := _TORCH_FB.match(text)):
            return "torch", (int(m[1]), "FB", int(m[2]), int(m[3]), int(m[4]))
    raise ValueError(f"stage {s}, entry {i}: {entry!r} is not an action; use jp.pipeline.F/B/W(mb, chunk), None, a "
                     "string like 'F3' / 'F3.1' / 'F3+B1.1' (jaxpar) or '4F3' / '4I3' / '4W3' / '4B3' / '(1F6;6B2)OVERLAP_F_B' "
                     "(torch: virtual stage, kind, microbatch)")


def _from_torch(parsed: list[list], split: bool) -> tuple[list[list], Placement]:
    """Torch-form entries -> jaxpar actions, the placement read from the virtual stages each stage names."""
    held = [sorted({vs for e in row if e is not None for vs in e[0::3]}) for row in parsed]
    if len({len(h) for h in held}) != 1 or not held[0]:
        raise ValueError(f"the stages name different numbers of virtual stages ({[len(h) for h in held]}); every "
                         "stage must hold the same number of chunks")
    flat = [x for h in held for x in h]
    if len(set(flat)) != len(flat):
        raise ValueError(f"a virtual stage appears in the lists of two stages (stages hold {held}); each virtual "
                         "stage runs on one stage")
    if sorted(flat) != list(range(len(flat))):
        raise ValueError(f"the lists name virtual stages {sorted(flat)[:8]}{' ...' if len(flat) > 8 else ''}; "
                         f"with {len(held)} stages of {len(held[0])} chunks they must be 0..{len(flat) - 1}, "
                         "each on one stage")
    out = []
    for s, row in enumerate(parsed):
        acts = []
        for i, e in enumerate(row):
            if e is None:
                acts.append(None)
                continue
            vs, kind, mb = e[:3]
            if kind == "FB":
                acts.append(FB(mb, held[s].index(vs), e[4], held[s].index(e[3])))
            else:
                acts.append(Action("B" if kind == "I" else kind, mb, held[s].index(vs)))
        out.append(acts)
    if split:
        _check_split_pairs(parsed)
    return out, tuple(tuple(h) for h in held)


def _check_split_pairs(parsed: list[list]) -> None:
    """Raises ValueError unless every torch ``I`` has its ``W`` (same virtual stage and microbatch) and back."""
    listed = {(e[1], e[0], e[2]) for row in parsed for e in row if e is not None}
    for s, row in enumerate(parsed):
        for i, e in enumerate(row):
            if e is not None and e[1] in ("I", "W"):
                vs, kind, mb = e
                other = "W" if kind == "I" else "I"
                if (other, vs, mb) not in listed:
                    raise ValueError(f"stage {s}, entry {i}: {vs}{kind}{mb} has no matching {vs}{other}{mb}: a split "
                                     "backward needs both I (input gradient) and W (weight gradient) for every "
                                     f"microbatch and virtual stage; add {vs}{other}{mb}, or write a full backward "
                                     f"as B ({vs}B{mb}) with no W")


def from_actions(actions: Sequence[Sequence], *, num_microbatches: int | None = None, name: str = "custom",
                 placement: Placement | None = None, timed: bool = False) -> Schedule:
    """A :class:`~jaxpar.pipeline.schedules.Schedule` from each stage's list of actions.

    Args:
      actions: ``actions[s]`` is stage ``s``'s list: :class:`~jaxpar.pipeline.schedules.Action`\\ s, ``None``
        (idle), or strings (module docstring: ``"F3.1"`` or torch's ``"4F3"``; one form for the whole table).
      num_microbatches: ``m``; default: the largest microbatch named, plus one.
      name: the schedule's label.
      placement: for jaxpar-form entries, ``placement[s][c]`` (default round-robin); torch-form entries carry
        their virtual stages (the placement is read from them; passing one too is an error).
      timed: ``False`` (default): each list is the stage's order, and every action is placed at the earliest
        tick its dependencies allow (unit-cost ticks; ``None`` entries are skipped). ``True``: entry ``i`` runs
        at tick ``i`` (``None``: idle), as given.

    Returns:
      The validated table (any chunks, placement, fused or split backwards), for
      :func:`jaxpar.pipeline.value_and_grad` or ``jp.pipeline.Pipeline``.

    Raises:
      ValueError: an entry that is not an action (naming stage and entry: an unknown kind, a microbatch or
        chunk that is not an int >= 0), both string forms in one table, or an
        ``I`` without its ``W`` (or a ``W`` without its ``I``), ``num_microbatches`` not a positive integer, an
        inconsistent placement, a microbatch id beyond the forwards a stage lists (ids count 0..m-1), a table
        over :data:`~jaxpar.pipeline.schedules.MAX_TABLE_ENTRIES` entries, orders that deadlock, or a table the
        validator rejects (a dependency at a later tick, an action missing or repeated: naming tick, stage,
        chunk and action).
    """
    if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence) or not actions or not all(
            isinstance(row, Sequence) and not isinstance(row, str) for row in actions):
        raise ValueError("actions must be one list of actions per stage, e.g. [['F0', 'B0'], ['F0', 'B0']]")
    if num_microbatches is not None:
        num_microbatches = positive_int("num_microbatches", num_microbatches,
                                        ", or None (the largest microbatch the lists name, plus one)")
    longest = max(len(row) for row in actions)
    check_table_size(f"from_actions ({len(actions)} lists, the longest of {longest} entries)",
                     longest if timed else max(longest, len(actions)), len(actions), at_least=not timed)
    parsed = [[_parse(e, s, i) for i, e in enumerate(row)] for s, row in enumerate(actions)]
    forms = {form for row in parsed for form, _ in row} - {"idle"}
    if len(forms) > 1:
        raise ValueError("the lists mix jaxpar ('F3.1') and torch ('4F3') action strings; use one form")
    rows = [[x for _, x in row] for row in parsed]
    if forms == {"torch"}:
        if placement is not None:
            raise ValueError("torch-form actions name their virtual stages; leave placement=None")
        split = any(e is not None and e[1] in ("I", "W") for row in rows for e in row)
        rows, placement = _from_torch(rows, split)
    p = len(rows)
    if placement is not None:
        placement = check_placement(placement, p)
    num_chunks = len(placement[0]) if placement is not None else 1 + max(
        [x.chunk for row in rows for a in row if a is not None for x in a.parts()], default=0)
    placement = placement if placement is not None else round_robin(p, num_chunks)
    _check_microbatch_ids(rows)
    m = num_microbatches if num_microbatches is not None else 1 + max(
        [x.microbatch for row in rows for a in row if a is not None for x in a.parts()], default=0)
    if timed:
        ticks = max(len(row) for row in rows)
        table = [tuple(row[t] if t < len(row) else None for row in rows) for t in range(ticks)]
        return Schedule(name, p, m, table, num_chunks, placement)
    orders = [[a for a in row if a is not None] for row in rows]
    for s, order in enumerate(orders):
        for a in order:
            if not all(0 <= x.chunk < num_chunks and 0 <= x.microbatch < m for x in a.parts()):
                raise ValueError(f"stage {s}: {a} is out of range (microbatches 0..{m - 1}, chunks "
                                 f"0..{num_chunks - 1})")
    return place_in_order(name, m, orders, num_chunks, placement)


def _check_microbatch_ids(rows: list[list[Action | None]]) -> None:
    """Raises ValueError for a microbatch id that cannot be in a valid table: microbatches count ``0..m-1`` and
    each has one ``F`` on every stage and chunk, so an id is below the number of ``F``\\ s its stage lists for
    that chunk (this bounds ``m`` by the lists' length, however large an id is written)."""
    for s, row in enumerate(rows):
        forwards: dict[int, int] = {}
        for x in [x for a in row if a is not None for x in a.parts()]:
            forwards[x.chunk] = forwards.get(x.chunk, 0) + (x.kind == "F")
        for i, a in enumerate(row):
            for x in a.parts() if a is not None else ():
                if x.microbatch >= forwards.get(x.chunk, 0):
                    n = forwards.get(x.chunk, 0)
                    raise ValueError(f"stage {s}, entry {i}: {a} names microbatch {x.microbatch}, but stage {s} "
                                     f"lists {n} forward{'' if n == 1 else 's'} of chunk {x.chunk}: number the "
                                     "microbatches 0..m-1, each with one F (and B, W) on every stage and chunk")


__all__ = ["from_actions"]
