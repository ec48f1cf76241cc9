"""jaxpar/pipeline/actions.py: a user's own schedule as per-stage action lists (``from_actions``), in jaxpar's
action strings and in torch's, and the errors for lists that are not a schedule."""

from __future__ import annotations

import numpy as np
import pytest

import jaxpar as jp
from jaxpar.pipeline import Action, B, F, W
from jaxpar.pipeline.schedules import v_shape

from .test_schedules import ONE_F_ONE_B_2_2

P = jp.pipeline


def test_from_actions_jaxpar_strings_match_the_builder():
    """1F1B at p=2, m=2 written by hand as lists (jaxpar's strings, Actions, and ordered or timed)."""
    ref = jp.pipeline.one_f_one_b(2, 2)
    lists = [["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]]
    assert jp.pipeline.from_actions(lists).table == ref.table
    assert jp.pipeline.from_actions([[F(0), F(1), B(0), B(1)], [F(0), B(0), F(1), B(1)]]).table == ref.table
    timed = [[str(r[s]) if r[s] is not None else None for r in ref.table] for s in range(2)]
    assert jp.pipeline.from_actions(timed, timed=True).table == ref.table
    # chunks in jaxpar's form (F0.1: chunk 1), placed round-robin
    il = jp.pipeline.interleaved_1f1b(2, 2, 2)
    lists = [[str(r[s]) for r in il.table if r[s] is not None] for s in range(2)]
    got = jp.pipeline.from_actions(lists)
    assert got.num_chunks == 2 and got.placement == ((0, 2), (1, 3)) and got.table == il.table


def test_from_actions_torch_strings_read_the_placement():
    """Torch's form names virtual stages: a stage holding 0 and 3 (p=2) is the V placement."""
    zbv = jp.pipeline.zero_bubble_v(2, 2)
    lists = [[f"{zbv.virtual_stage(s, r[s].chunk)}{'I' if r[s].kind == 'B' else r[s].kind}{r[s].microbatch}"
              for r in zbv.table if r[s] is not None] for s in range(2)]
    got = jp.pipeline.from_actions(lists, name="v")
    assert got.placement == v_shape(2) and got.split_backward and got.table == zbv.table


def test_from_actions_reads_fused_actions_and_mixed_backwards():
    """DualPipeV's table (FBs; full and split backwards mixed) written as lists in jaxpar's form ('F3.1+B1', the
    V placement given) and in torch's ('(4F3;3B1)OVERLAP_F_B' as ScheduleDualPipeV writes it, 'I' for a B with a
    W, 'B' for a full one) gives the table back."""
    s = jp.pipeline.dualpipe_v(2, 4)
    when = s.ticks()

    def torch_str(st, a):
        vs = lambda x: s.virtual_stage(st, x.chunk)
        if a.kind == "FB":
            return f"({vs(a)}F{a.microbatch};{vs(a.backward)}B{a.backward.microbatch})OVERLAP_F_B"
        kind = "I" if a.kind == "B" and ("W", a.microbatch, vs(a)) in when else a.kind
        return f"{vs(a)}{kind}{a.microbatch}"
    ours = [[str(r[st]) for r in s.table if r[st] is not None] for st in range(2)]
    theirs = [[torch_str(st, r[st]) for r in s.table if r[st] is not None] for st in range(2)]
    assert any("+" in a for a in ours[0]) and any(a.endswith("OVERLAP_F_B") for a in theirs[1])
    assert {a[1] for a in theirs[0] if a[0].isdigit()} >= {"B", "I", "W"}
    assert jp.pipeline.from_actions(ours, placement=v_shape(2)).table == s.table
    got = jp.pipeline.from_actions(theirs)
    assert got.table == s.table and got.placement == v_shape(2)


BAD = [([["F0", "X1"], ["F0"]], r"stage 0, entry 1: 'X1' is not an action"),
       ([["F0", "B0"], ["0F0", "1B0"]], r"mix jaxpar \('F3.1'\) and torch \('4F3'\) action strings"),
       ([["0F0", "0B0", "0W0"], ["1F0", "1I0", "1W0"]], r"stage 0, entry 2: 0W0 has no matching 0I0: .* or write a "
                                                       r"full backward as B \(0B0\) with no W"),
       ([["0F0", "1F0"], ["1B0", "0B0"]], r"a virtual stage appears in the lists of two stages"),
       ([["0F0", "1F0"], ["2B0"]], r"the stages name different numbers of virtual stages \(\[2, 1\]\)"),
       ([["B0", "F0"], ["F0", "B0"]], r"the action orders deadlock at tick 0 \(stage 0: B0 waits for F0 of virtual "
                                      r"stage 0, B0 of virtual stage 1; stage 1: F0 waits for F0 of virtual stage 0\)"),
       ([["F0", "B0"], ["F0"]], r"stage 0: B0 waits for B0 of virtual stage 1 \(in no stage's list\)"),
       ([["F0", "B0"], ["F0", "B0", "B0"]], r"B0 on stage 1 appears twice"),
       ("F0", r"one list of actions per stage")]


@pytest.mark.parametrize("lists,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_from_actions_rejects(lists, match):
    with pytest.raises(ValueError, match=match):
        jp.pipeline.from_actions(lists)


def test_from_actions_checks_every_microbatch_runs():
    with pytest.raises(ValueError, match=r"B1 never runs on stage 0; every microbatch needs one B per stage and chunk"):
        jp.pipeline.from_actions([["F0", "B0"], ["F0", "B0"]], num_microbatches=2)


def test_from_actions_timed_lists_are_validated_as_given():
    with pytest.raises(ValueError, match=r"F0 on stage 1 at tick 0 needs F0 of stage 0 at an earlier tick"):
        jp.pipeline.from_actions([["F0", None, None, "B0"], ["F0", "B0"]], timed=True)


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
                                                    r"kind 'X'; the kinds are \('F', 'B', 'W', 'FB'\)"),
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
                                                     r"every microbatch and virtual stage; add 0W0, or write a full "
                                                     r"backward as B \(0B0\) with no W"),
    (dict(actions=[["0F0", "0I0", "0W0"], ["1F0", "1I0"]]), r"stage 1, entry 1: 1I0 has no matching 1W0"),
    (dict(actions=[["0F0", "0I0", "0W0"], ["1F0", "1W0"]]), r"stage 1, entry 1: 1W0 has no matching 1I0"),
    (dict(actions=[["0F0", "0I0", "0W0"], ["1F0", "1B0", "1W0"]]), r"stage 1, entry 2: 1W0 has no matching 1I0"),
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
