"""A user's own schedule, given as per-stage action lists (as torch's CSV schedules are), turned into a table.

:func:`from_actions` takes one list per stage (device) and returns a validated
:class:`~jaxpar.pipeline.schedules.Schedule`, which the one interpreter runs like any builder's table. An entry
is an :class:`~jaxpar.pipeline.schedules.Action`, ``None`` (idle), or a string in one of two forms:

* jaxpar's own, ``str(action)``: ``"F3"``, ``"B3"``, ``"W3"`` (chunk 0), ``"F3.1"`` (chunk 1); chunks are
  placed by ``placement`` (default round-robin);
* torch's (``torch.distributed.pipelining``'s ``_Action`` strings, e.g. a row of its CSV schedules):
  ``"<virtual stage><kind><microbatch>"``, e.g. ``"4F0"``, with kind ``F`` (forward), ``B`` (full backward),
  ``I`` (input-gradient backward) or ``W`` (weight gradient). The virtual stages a stage's list names are its
  chunks, in increasing order; that gives the placement (round-robin, V, or any other).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from jaxpar.pipeline.schedules import Action, Placement, Schedule, place_in_order, round_robin

_OURS = re.compile(r"^([FBW])(\d+)(?:\.(\d+))?$")
_TORCH = re.compile(r"^(\d+)([FBIW])(\d+)$")


def _parse(entry, s: int, i: int):
    """``('ours', Action) | ('torch', (vstage, kind, mb)) | ('idle', None)`` of one list entry."""
    if entry is None or (isinstance(entry, str) and entry.strip() in ("", "None")):
        return "idle", None
    if isinstance(entry, Action):
        return "ours", entry
    if isinstance(entry, str):
        text = entry.strip()
        if (m := _OURS.match(text)):
            return "ours", Action(m[1], int(m[2]), int(m[3] or 0))
        if (m := _TORCH.match(text)):
            return "torch", (int(m[1]), m[2], int(m[3]))
    raise ValueError(f"stage {s}, entry {i}: {entry!r} is not an action; use jp.pipeline.F/B/W(mb, chunk), None, a "
                     "string like 'F3' / 'F3.1' (jaxpar) or '4F3' / '4I3' / '4W3' / '4B3' (torch: virtual stage, "
                     "kind, microbatch)")


def _from_torch(parsed: list[list], split: bool) -> tuple[list[list], Placement]:
    """Torch-form entries -> jaxpar actions, the placement read from the virtual stages each stage names."""
    held = [sorted({e[0] for e in row if e is not None}) for row in parsed]
    if len({len(h) for h in held}) != 1 or not held[0]:
        raise ValueError(f"the stages name different numbers of virtual stages ({[len(h) for h in held]}); every "
                         "stage must hold the same number of chunks")
    flat = [x for h in held for x in h]
    if len(set(flat)) != len(flat):
        raise ValueError(f"a virtual stage appears in the lists of two stages (stages hold {held}); each virtual "
                         "stage runs on one stage")
    out = []
    for s, row in enumerate(parsed):
        acts = []
        for i, e in enumerate(row):
            if e is None:
                acts.append(None)
                continue
            vs, kind, mb = e
            if (kind == "B" and split) or (kind == "I" and not split):
                raise ValueError(f"stage {s}, entry {i}: {vs}{kind}{mb}: a table with W actions writes its input-"
                                 "gradient backwards as I, one without as B (full backward)")
            acts.append(Action("B" if kind == "I" else kind, mb, held[s].index(vs)))
        out.append(acts)
    return out, tuple(tuple(h) for h in held)


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
      ValueError: an entry that is not an action (naming stage and entry), both string forms in one table,
        an inconsistent placement, orders that deadlock, or a table the validator rejects (a dependency at
        a later tick, an action missing or repeated: naming tick, stage, chunk and action).
    """
    if isinstance(actions, (str, bytes)) or not all(isinstance(row, Sequence) and not isinstance(row, str)
                                                     for row in actions) or not actions:
        raise ValueError("actions must be one list of actions per stage, e.g. [['F0', 'B0'], ['F0', 'B0']]")
    parsed = [[_parse(e, s, i) for i, e in enumerate(row)] for s, row in enumerate(actions)]
    forms = {form for row in parsed for form, _ in row} - {"idle"}
    if len(forms) > 1:
        raise ValueError("the lists mix jaxpar ('F3.1') and torch ('4F3') action strings; use one form")
    rows = [[x for _, x in row] for row in parsed]
    if forms == {"torch"}:
        if placement is not None:
            raise ValueError("torch-form actions name their virtual stages; leave placement=None")
        split = any(e is not None and e[1] in "IW" for row in rows for e in row)
        rows, placement = _from_torch(rows, split)
    p = len(rows)
    num_chunks = len(placement[0]) if placement is not None else 1 + max(
        [a.chunk for row in rows for a in row if a is not None], default=0)
    placement = placement if placement is not None else round_robin(p, num_chunks)
    m = num_microbatches if num_microbatches is not None else 1 + max(
        [a.microbatch for row in rows for a in row if a is not None], default=0)
    if timed:
        ticks = max(len(row) for row in rows)
        table = [tuple(row[t] if t < len(row) else None for row in rows) for t in range(ticks)]
        return Schedule(name, p, m, table, num_chunks, placement)
    orders = [[a for a in row if a is not None] for row in rows]
    for s, order in enumerate(orders):
        for a in order:
            if not (0 <= a.chunk < num_chunks and 0 <= a.microbatch < m):
                raise ValueError(f"stage {s}: {a} is out of range (microbatches 0..{m - 1}, chunks "
                                 f"0..{num_chunks - 1})")
    return place_in_order(name, m, orders, num_chunks, placement)


__all__ = ["from_actions"]
