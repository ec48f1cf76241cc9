"""Bad input to the schedule API (builders, ``Schedule``, ``from_actions``, ``timing``/``compare``, the stage
layout): each a TypeError/ValueError in plain Python, before any tracing, naming the value and the fix."""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest

import jaxpar as jp
from jaxpar.pipeline import Action, B, F, Schedule, W, checks, schedules
from jaxpar.pipeline.analysis import compiled_temp_bytes, lockstep_time, timing

P = jp.pipeline

# 1F1B at p=2, m=2 written out: stage 0 runs F0 F1 . B0 . B1, stage 1 . F0 B0 F1 B1 .
ONE_F_ONE_B_2_2 = ((F(0), None), (F(1), F(0)), (None, B(0)), (B(0), F(1)), (None, B(1)), (B(1), None))


def gpipe_reference(p: int, m: int) -> tuple:
    """GPipe's table from its definition: F(j) on stage s at tick j + s, B(j) at (m + p - 1) + j + (p - 1 - s)."""
    table = [[None] * p for _ in range(2 * (m + p - 1))]
    for s in range(p):
        for j in range(m):
            table[j + s][s] = F(j)
            table[m + p - 1 + j + p - 1 - s][s] = B(j)
    return tuple(tuple(row) for row in table)


# ------------------------------------------------------------------------------ a Schedule where one is needed

def test_timing_and_friends_need_a_schedule():
    with pytest.raises(TypeError, match=r"timing takes a jp.pipeline.Schedule, got str '1f1b'; build one with a "
                                        r"builder \(e.g. jp.pipeline.one_f_one_b"):
        timing("1f1b")
    with pytest.raises(TypeError, match=r"lockstep_time takes a jp.pipeline.Schedule, got str 'zb'"):
        lockstep_time("zb")
    with pytest.raises(TypeError, match=r"compiled_temp_bytes takes a jp.pipeline.Schedule, got int 4"):
        compiled_temp_bytes(4, None, None, layers={}, head={}, x=None, targets=None, mesh=None)
    with pytest.raises(TypeError, match=r"timing takes a jp.pipeline.Schedule, got list .*a list of schedules "
                                        r"goes to jp.pipeline.compare"):
        timing([P.gpipe(2, 2)])


def test_compare_needs_a_list_of_schedules():
    s = P.one_f_one_b(2, 2)
    with pytest.raises(TypeError, match=r"compare takes a list of jp.pipeline.Schedule objects, got one Schedule "
                                        r"\('1f1b'\); pass \[schedule\]"):
        P.compare(s)
    with pytest.raises(TypeError, match=r"compare takes a list of jp.pipeline.Schedule objects, got str '1f1b'"):
        P.compare("1f1b")
    with pytest.raises(TypeError, match=r"compare takes a list of jp.pipeline.Schedule objects, got int 3"):
        P.compare(3)
    with pytest.raises(TypeError, match=r"got str 'gpipe' at index 1; build it with a builder"):
        P.compare([s, "gpipe"])
    rows = P.compare((x for x in [s]))                 # any iterable of schedules
    assert [r["name"] for r in rows] == ["1f1b"]


def test_check_schedule_names_the_caller():
    """The check ``to_stage_layout`` / ``from_stage_layout`` use (through jaxpar.pipeline.checks)."""
    with pytest.raises(TypeError, match=r"to_stage_layout takes a jp.pipeline.Schedule, got str 'il'"):
        checks.check_schedule("il", "to_stage_layout")


def test_to_stage_layout_needs_a_schedule():
    with pytest.raises(TypeError, match=r"to_stage_layout takes a jp.pipeline.Schedule, got str 'il'"):
        P.to_stage_layout({"w": np.zeros((4, 2))}, "il")


# ------------------------------------------------------------------------------------------------ costs

BAD_COST_VALUES = [float("nan"), float("inf"), -float("inf"), -1, 0, 0.0, True, "1", None, np.float64("nan")]


@pytest.mark.parametrize("value", BAD_COST_VALUES, ids=repr)
def test_costs_must_be_finite_and_positive(value):
    s = P.gpipe(2, 2)
    match = rf"costs\['B'\]={re.escape(repr(value))}: a cost must be a finite positive number"
    with pytest.raises(ValueError, match=match):
        timing(s, {"F": 1, "B": value})
    with pytest.raises(ValueError, match=match):
        P.compare([s], {"F": 1, "B": value})
    with pytest.raises(ValueError, match=match):
        lockstep_time(s, {"F": 1, "B": value})


def test_costs_reject_unknown_keys_and_non_mappings():
    s = P.gpipe(2, 2)
    for key in ("X", "I", "f", 0):
        with pytest.raises(ValueError, match=rf"costs has unknown key {re.escape(repr(key))}; the keys are the action "
                                             r"kinds \('F', 'B', 'W'\)"):
            P.compare([s], {"F": 1, "B": 2, key: 1})
    with pytest.raises(TypeError, match=r"costs must be a dict of per-action costs like \{'F': 1, 'B': 2, 'W': 1\}, "
                                        r"got list \[1, 2\]"):
        timing(s, [1, 2])
    # an unused kind with a valid cost is fine; a used kind missing is named
    assert timing(s, {"F": 1, "B": 2, "W": 5}).makespan == timing(s, {"F": 1, "B": 2}).makespan
    with pytest.raises(ValueError, match=r"the table runs B actions; give 'B' a positive cost"):
        timing(s, {"F": 1})


def test_numpy_costs_are_numbers():
    """gpipe(2, 1) with F = 1, B = 2 by hand: F0 on stage 0 over [0, 1), on stage 1 over [1, 2); B0 on stage 1
    over [2, 4), on stage 0 over [4, 6): makespan 6, work 6, bubble 1 - 6 / (2 * 6)."""
    rng = random.Random(3)
    f, b = rng.uniform(0.5, 2), rng.uniform(0.5, 2)
    for cost in ({"F": np.float32(f), "B": np.float64(b)}, {"F": f, "B": b}):
        t = timing(P.gpipe(2, 1), cost)
        assert t.makespan == pytest.approx(2 * float(np.float32(f)) + 2 * b, rel=1e-6)
        assert t.bubble == pytest.approx(0.5, rel=1e-6)
    t = timing(P.gpipe(2, 1), {"F": np.int64(1), "B": np.int32(2)})
    assert (t.makespan, t.work, t.bubble) == (6.0, 6.0, 0.5)


# -------------------------------------------------------------------------------------------- builders

BUILDERS = {"gpipe": lambda p, m: P.gpipe(p, m), "one_f_one_b": lambda p, m: P.one_f_one_b(p, m),
            "interleaved_1f1b": lambda p, m: P.interleaved_1f1b(p, m, np.int16(2)),
            "zero_bubble": lambda p, m: P.zero_bubble(p, m), "zero_bubble_v": lambda p, m: P.zero_bubble_v(p, m)}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_builders_take_numpy_integers(name):
    p, m = 2, 4
    got = BUILDERS[name](np.int64(p), np.int32(m))
    assert type(got.num_stages) is int and type(got.num_microbatches) is int and type(got.num_chunks) is int
    assert (got.num_stages, got.num_microbatches) == (p, m)
    assert got.table == BUILDERS[name](p, m).table


def test_gpipe_with_numpy_sizes_matches_its_definition():
    for p, m in [(1, 3), (3, 2), (2, 5)]:
        assert P.gpipe(np.int8(p), np.uint16(m)).table == gpipe_reference(p, m)


@pytest.mark.parametrize("bad", [0, -3, 2.0, np.float64(2.0), True, np.int64(0), "2", None], ids=repr)
def test_builders_still_refuse_non_integers(bad):
    for name, build in BUILDERS.items():
        with pytest.raises(ValueError, match=rf"num_stages={re.escape(repr(bad))} must be a positive int"):
            build(bad, 4)
    with pytest.raises(ValueError, match=rf"num_chunks={re.escape(repr(bad))} must be a positive int"):
        P.interleaved_1f1b(2, 4, bad)


TOO_BIG = [(lambda: P.gpipe(10 ** 6, 1), r"gpipe\(num_stages=1000000, num_microbatches=1\): a table of at least "
                                          r"1000001 ticks x 1000000 stages = 1,000,001,000,000 entries exceeds the "
                                          r"bound of 10,000,000"),
           (lambda: P.gpipe(1, 10 ** 9), r"gpipe\(num_stages=1, num_microbatches=1000000000\): a table of at least "
                                         r"2000000000 ticks x 1 stages"),
           (lambda: P.one_f_one_b(10 ** 4, 10 ** 4), r"one_f_one_b\(num_stages=10000, num_microbatches=10000\)"),
           (lambda: P.interleaved_1f1b(8, 10 ** 6, 2), r"interleaved_1f1b\(num_stages=8, num_microbatches=1000000, "
                                                       r"num_chunks=2\): a table of at least 4000007 ticks x 8"),
           (lambda: P.zero_bubble(4, 10 ** 6), r"zero_bubble\(num_stages=4, num_microbatches=1000000\): a table of at "
                                               r"least 3000003 ticks"),
           (lambda: P.zero_bubble_v(2, 10 ** 6), r"zero_bubble_v\(num_stages=2, num_microbatches=1000000\): a table of "
                                                 r"at least 6000001 ticks")]


@pytest.mark.parametrize("build,match", TOO_BIG, ids=[str(i) for i in range(len(TOO_BIG))])
def test_builders_bound_the_table_size(build, match):
    with pytest.raises(ValueError, match=match + r".*MAX_TABLE_ENTRIES\); use fewer stages or fewer, larger "
                                                 r"microbatches"):
        build()


def test_the_bound_is_on_ticks_times_stages(monkeypatch):
    """GPipe on one stage has exactly 2 m ticks: at a bound of 100 entries m = 50 builds, m = 51 does not; a
    hand-written Schedule and from_actions obey the same bound."""
    monkeypatch.setattr(schedules, "MAX_TABLE_ENTRIES", 100)
    assert P.gpipe(1, 50).num_ticks == 100
    with pytest.raises(ValueError, match=r"a table of at least 102 ticks x 1 stages = 102 entries exceeds the bound "
                                         r"of 100"):
        P.gpipe(1, 51)
    table = [(F(0), None), (None, F(0)), (None, B(0)), (B(0), None)] + [(None, None)] * 47
    with pytest.raises(ValueError, match=r"schedule 'big': a table of 51 ticks x 2 stages = 102 entries exceeds"):
        Schedule("big", 2, 1, table)
    with pytest.raises(ValueError, match=r"from_actions \(11 lists, the longest of 2 entries\): a table of at least "
                                         r"11 ticks x 11 stages = 121 entries"):
        P.from_actions([["F0", "B0"]] * 11)
    with pytest.raises(ValueError, match=r"a table of 51 ticks x 2 stages"):
        P.from_actions([["F0"] + [None] * 50, ["F0"]], timed=True)


def test_schedule_takes_numpy_sizes_and_refuses_float_actions():
    s = Schedule("np", np.int64(2), np.int32(2), ONE_F_ONE_B_2_2, num_chunks=np.int8(1))
    assert (type(s.num_stages), type(s.num_microbatches), type(s.num_chunks)) == (int, int, int)
    assert s.placement == ((0,), (1,)) and s.peak_stash == (2, 1)
    with pytest.raises(ValueError, match=r"schedule 'f': tick 0 stage 0 holds Action\(kind='F', microbatch=0.0, "
                                         r"chunk=0\); its microbatch and chunk must be ints >= 0"):
        Schedule("f", 1, 1, [(F(0.0),), (B(0),)])
    with pytest.raises(ValueError, match=r"Schedule.num_microbatches=1.0 must be a positive int"):
        Schedule("f", 1, 1.0, [(F(0),), (B(0),)])


# ---------------------------------------------------------------------------------------- from_actions

def test_from_actions_takes_numpy_integers():
    lists = [[F(np.int64(0)), F(1), B(np.int32(0)), B(1)], ["F0", "B0", "F1", "B1"]]
    got = P.from_actions(lists, num_microbatches=np.int64(2))
    assert got.table == ONE_F_ONE_B_2_2 and type(got.num_microbatches) is int
    assert all(type(a.microbatch) is int for row in got.table for a in row if a is not None)


OK = [["F0", "B0"], ["F0", "B0"]]
BAD_LISTS = [
    (dict(actions=OK, placement=((0,), (0,))), r"placement=\(\(0,\), \(0,\)\) does not place each virtual stage "
                                               r"0..2\*num_chunks-1 exactly once over the 2 stages; give 2 rows"),
    (dict(actions=OK, placement=((0, 1), (2,))), r"placement=\(\(0, 1\), \(2,\)\) does not place each virtual stage"),
    (dict(actions=OK, placement=((0,), (1,), (2,))), r"does not place each virtual stage .* over the 2 stages"),
    (dict(actions=OK, placement=((0.0,), (1,))), r"placement=\(\(0.0,\), \(1,\)\) does not place"),
    (dict(actions=OK, placement=5), r"placement=5 is not a table of virtual stages; give 2 rows \(one per stage\)"),
    (dict(actions=[[Action("X", 0), "B0"], OK[1]]), r"stage 0, entry 0: Action\(kind='X', microbatch=0, chunk=0\) has "
                                                    r"kind 'X'; the kinds are \('F', 'B', 'W'\)"),
    (dict(actions=[["F0", "X0"], OK[1]]), r"stage 0, entry 1: 'X0' is not an action"),
    (dict(actions=[["F0", "4X0"], OK[1]]), r"stage 0, entry 1: '4X0' is not an action"),
    (dict(actions=[[F(0), B(0.5)], OK[1]]), r"stage 0, entry 1: Action\(kind='B', microbatch=0.5, chunk=0\) has "
                                            r"microbatch=0.5; it must be an int >= 0"),
    (dict(actions=[[F(1.0), B(0)], OK[1]]), r"stage 0, entry 0: .* has microbatch=1.0; it must be an int >= 0"),
    (dict(actions=[[F(0, 1.5)], ["F0"]]), r"stage 0, entry 0: .* has chunk=1.5; it must be an int >= 0"),
    (dict(actions=[[F(-1), B(-1)], OK[1]]), r"stage 0, entry 0: .* has microbatch=-1; it must be an int >= 0"),
    (dict(actions=[[F(True), B(0)], OK[1]]), r"has microbatch=True; it must be an int >= 0"),
    (dict(actions=OK, num_microbatches=0), r"num_microbatches=0 must be a positive int, or None \(the largest "
                                           r"microbatch the lists name, plus one\)"),
    (dict(actions=OK, num_microbatches=-2), r"num_microbatches=-2 must be a positive int"),
    (dict(actions=OK, num_microbatches=1.0), r"num_microbatches=1.0 must be a positive int"),
    (dict(actions=OK, num_microbatches=True), r"num_microbatches=True must be a positive int"),
    (dict(actions=[["F0", "F99999999999", "B0"], OK[1]]), r"stage 0, entry 1: F99999999999 names microbatch "
                                                          r"99999999999, but stage 0 lists 2 forwards of chunk 0: "
                                                          r"number the microbatches 0..m-1"),
    (dict(actions=[[F(0), B(10 ** 15)], OK[1]]), r"stage 0, entry 1: B1000000000000000 names microbatch "
                                                 r"1000000000000000, but stage 0 lists 1 forward of chunk 0"),
    (dict(actions=[["0F0", "0I0"], ["1F0", "1I0"]]), r"stage 0, entry 1: 0I0 has no matching 0W0: a split backward "
                                                     r"needs both I \(input gradient\) and W \(weight gradient\) for "
                                                     r"every microbatch and virtual stage; add 0W0, or write full "
                                                     r"backwards as B \(0B0\) throughout"),
    (dict(actions=[["0F0", "0I0", "0W0"], ["1F0", "1I0"]]), r"stage 1, entry 1: 1I0 has no matching 1W0"),
    (dict(actions=[["0F0", "0I0", "0W0"], ["1F0", "1W0"]]), r"stage 1, entry 1: 1W0 has no matching 1I0"),
    (dict(actions=[["0F0", "0I0", "0W0"], ["1F0", "1B0"]]), r"stage 1, entry 1: 1B0: .* these lists mix full "
                                                            r"backwards \(B\) with split ones \(I and W\): use one "
                                                            r"kind for the whole table"),
    (dict(actions=[["0F0", "5F0"], ["1F0", "2F0"]]), r"the lists name virtual stages \[0, 1, 2, 5\]; with 2 stages "
                                                     r"of 2 chunks they must be 0..3"),
    (dict(actions=[]), r"one list of actions per stage"),
    (dict(actions=7), r"one list of actions per stage"),
]


@pytest.mark.parametrize("kwargs,match", BAD_LISTS, ids=[str(i) for i in range(len(BAD_LISTS))])
def test_from_actions_rejects_bad_input(kwargs, match):
    kwargs = dict(kwargs)
    with pytest.raises(ValueError, match=match):
        P.from_actions(kwargs.pop("actions"), **kwargs)


def test_from_actions_torch_split_backward_with_every_pair_is_accepted():
    """The I/W pairing check passes a complete split table: p = 1 holding virtual stages 0 and 1 (both chunks)."""
    lists = [["0F0", "1F0", "1I0", "1W0", "0I0", "0W0"]]
    got = P.from_actions(lists)
    assert got.split_backward and got.placement == ((0, 1),)
    assert got.table == ((F(0, 0),), (F(0, 1),), (B(0, 1),), (W(0, 1),), (B(0, 0),), (W(0, 0),))


def test_bad_input_raises_before_any_tracing(monkeypatch):
    """None of these checks reach jax: a tracing entry point patched to fail is never called."""
    import jax
    def boom(*a, **k):
        raise AssertionError("traced")
    monkeypatch.setattr(jax, "jit", boom)
    monkeypatch.setattr(jax, "eval_shape", boom)
    for call in (lambda: timing("1f1b"), lambda: P.compare([P.gpipe(2, 2)], {"F": math.nan, "B": 1}),
                 lambda: P.gpipe(10 ** 6, 1), lambda: P.from_actions(OK, num_microbatches=0),
                 lambda: compiled_temp_bytes("x", None, None, layers={}, head={}, x=None, targets=None, mesh=None)):
        with pytest.raises((TypeError, ValueError)):
            call()
