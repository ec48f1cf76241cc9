"""jaxpar/pipeline/schedules.py: ``Schedule`` and ``Action`` (the fused ``FB`` too), the table as data, and its
validator."""

from __future__ import annotations

import numpy as np
import pytest

import jaxpar as jp
from jaxpar.pipeline import FB, Action, B, F, Schedule, W, gpipe, one_f_one_b


def test_forward_only_table():
    s = one_f_one_b(4, 8).forward_only()
    assert not s.has_backward and s.num_ticks == 8 + 3
    assert s.bubble_fraction == pytest.approx(3 / 11)
    assert s.peak_stash == (0, 0, 0, 0) and s.recv_slots == ((0, 0), (1, 0), (1, 0), (1, 0))


def test_text_gantt():
    text = str(one_f_one_b(2, 2))
    assert text.splitlines()[1:] == ["s0 | F0 F1 .  B0 .  B1", "s1 | .  F0 B0 F1 B1 . "]


def test_hand_written_table_with_w_actions_and_chunks():
    """The table model goes beyond the two builders: split W actions and two chunks per stage validate."""
    table = [(F(0, 0), None), (None, F(0, 0)), (F(0, 1), None), (None, F(0, 1)), (None, B(0, 1)),
             (B(0, 1), W(0, 1)), (W(0, 1), B(0, 0)), (B(0, 0), W(0, 0)), (W(0, 0), None)]
    s = Schedule("zb-like", 2, 1, table, num_chunks=2)
    assert s.num_ticks == 9 and s.peak_stash == (2, 2)


# 1F1B at p=2, m=2 written out: stage 0 runs F0 F1 . B0 . B1, stage 1 . F0 B0 F1 B1 .
ONE_F_ONE_B_2_2 = ((F(0), None), (F(1), F(0)), (None, B(0)), (B(0), F(1)), (None, B(1)), (B(1), None))


def test_schedule_takes_numpy_sizes_and_refuses_float_actions():
    s = Schedule("np", np.int64(2), np.int32(2), ONE_F_ONE_B_2_2, num_chunks=np.int8(1))
    assert (type(s.num_stages), type(s.num_microbatches), type(s.num_chunks)) == (int, int, int)
    assert s.placement == ((0,), (1,)) and s.peak_stash == (2, 1)
    with pytest.raises(ValueError, match=r"schedule 'f': tick 0 stage 0 holds Action\(kind='F', microbatch=0.0, "
                                         r"chunk=0\); its microbatch and chunk must be ints >= 0"):
        Schedule("f", 1, 1, [(F(0.0),), (B(0),)])
    with pytest.raises(ValueError, match=r"Schedule.num_microbatches=1.0 must be a positive int"):
        Schedule("f", 1, 1.0, [(F(0),), (B(0),)])


# ------------------------------------------------------------------------------------------- validator

BAD_TABLES = [
    ([(F(0), None), (None, F(0)), (None, B(0))], r"B0 never runs on stage 0"),
    ([(F(0), None), (None, F(0)), (None, B(0)), (B(0), None), (F(0), None)], r"F0 on stage 0 appears twice"),
    ([(F(0), F(0)), (None, B(0)), (B(0), None)], r"F0 on stage 1 at tick 0 needs F0 of stage 0 at an earlier tick"),
    ([(F(0), None), (None, F(0)), (B(0), B(0))], r"B0 on stage 0 at tick 2 needs B0 of stage 1 at an earlier tick"),
    ([(F(0), None), (None, B(0)), (None, F(0)), (B(0), None)], r"B0 on stage 1 at tick 1 needs F0 of stage 1"),
    ([(F(0), None, None)], r"tick 0 has 3 entries; every row needs one per stage \(2\)"),
    ([(F(1), None)], r"F1 is out of range"),
    ([("F0", None)], r"holds 'F0'; use F\(mb, chunk\)"),
    ([], r"empty table"),
]


@pytest.mark.parametrize("table,match", BAD_TABLES)
def test_validator_rejects(table, match):
    with pytest.raises(ValueError, match=match):
        Schedule("bad", 2, 1, table)


def test_validator_rejects_w_before_b():
    table = [(F(0),), (W(0),), (B(0),)]
    with pytest.raises(ValueError, match=r"W0 on stage 0 at tick 1 needs B0 of stage 0"):
        Schedule("bad", 1, 1, table)


def test_validator_names_chunk_and_virtual_stage():
    """A chunked table that breaks a dependency: the message names tick, stage, chunk and virtual stage."""
    # p=2, v=2, m=1: virtual stage 2 (stage 0 chunk 1) runs before virtual stage 1 (stage 1 chunk 0)
    table = [(F(0, 0), None), (F(0, 1), F(0, 0)), (None, F(0, 1)), (None, B(0, 1)), (B(0, 1), None),
             (None, B(0, 0)), (B(0, 0), None)]
    with pytest.raises(ValueError, match=r"F0\.1 on stage 0 \(chunk 1, virtual stage 2\) at tick 1 needs F0 of "
                                         r"stage 1 \(chunk 0, virtual stage 1\) at an earlier tick, but that runs "
                                         r"at tick 1"):
        Schedule("bad", 2, 1, table, num_chunks=2)
    good = [(F(0, 0), None), (None, F(0, 0)), (F(0, 1), None), (None, F(0, 1)), (None, B(0, 1)), (B(0, 1), None),
            (None, B(0, 0)), (B(0, 0), None)]
    assert Schedule("ok", 2, 1, good, num_chunks=2).num_ticks == 8
    with pytest.raises(ValueError, match=r"placement \(\(0, 2\), \(1, 2\)\) does not hold each virtual stage "
                                         r"0\.\.3 exactly once"):
        Schedule("bad", 2, 1, good, num_chunks=2, placement=((0, 2), (1, 2)))
    with pytest.raises(ValueError, match=r"placement \(\(0, 1, 2\), \(3,\)\) is not 2 rows of 2 entries"):
        Schedule("bad", 2, 1, good, num_chunks=2, placement=((0, 1, 2), (3,)))
    with pytest.raises(ValueError, match=r"B0\.1 never runs on stage 1 \(chunk 1, virtual stage 3\)"):
        Schedule("bad", 2, 1, good[:4] + [(None, None)] + good[5:], num_chunks=2)


def test_fused_forward_and_backward():
    """FB(a, c1, b, c2): the F and the full B run in one tick; its parts count as actions for every check; a W
    is optional per (microbatch, chunk) (without one the B is full) but never for an FB's B."""
    a = FB(1, 0, 0, 0)
    assert str(a) == "F1+B0" and a.parts() == (F(1), B(0)) and a.kind == "FB" and a.backward == B(0)
    assert repr(F(2, 1)) == "Action(kind='F', microbatch=2, chunk=1)" and F(2, 1) == Action("F", 2, 1)
    s = Schedule("fb", 1, 2, [(F(0),), (a,), (B(1),), (W(1),)])        # B0 full, B1 split: mixed
    assert s.has_backward and s.split_backward and s.peak_stash == (1,) and s.bubble_fraction == 0   # B0 frees, F1 takes
    assert s.forward_only().table == ((F(0),), (F(1),)) and str(s).splitlines()[1] == "s0 | F0    F1+B0 B1    W1   "
    bad = [([(F(0),), (a,), (B(1),), (W(1),), (W(0),)], r"tick 1 stage 0: F1\+B0 fuses a full backward, but the "
                                                       r"table also has W0 of its chunk; drop that W"),
           ([(F(0),), (FB(1, 0, 1, 0),), (B(0),)], r"B1 on stage 0 at tick 1 needs F1 of stage 0 at an earlier tick"),
           ([(F(0),), (Action("FB", 1, 0, W(0)),), (B(1),)], r"holds .*FB.*; use F\(mb, chunk\), .*FB\(mb, chunk, "
                                                            r"b_mb, b_chunk\) or None"),
           ([(F(0),), (Action("FB", 1),), (B(0),), (B(1),)], r"only an FB action has a backward, and it needs one"),
           ([(F(0),), (FB(1, 0, 2, 0),), (B(1),)], r"F1\+B2 is out of range")]
    for table, match in bad:
        with pytest.raises(ValueError, match=match):
            Schedule("bad", 1, 2, table)


def test_public_names():
    assert jp.pipeline.gpipe is gpipe and jp.pipeline.one_f_one_b is one_f_one_b
    assert jp.pipeline.Schedule is Schedule
    assert callable(jp.pipeline.value_and_grad) and callable(jp.pipeline.apply)
