"""jaxpar/pipeline/builders.py: GPipe, 1F1B, interleaved 1F1B (virtual stages), ZB-H1, ZB-V and DualPipeV tables,
their figures over grids of (p, m), and the builders' argument checks."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

import jaxpar as jp
from jaxpar.pipeline import B, F, gpipe, one_f_one_b
from jaxpar.pipeline.analysis import timing
from jaxpar.pipeline.schedules import v_shape
from jaxpar.pipeline.table import ACTIVATIONS, COTANGENTS, NEXT, PREV, SELF, control_table

P = jp.pipeline


# ------------------------------------------------------------------------------------------ GPipe, 1F1B

GRID = [(p, m) for p in range(1, 7) for m in range(1, 17)]


BUILDERS = {name: functools.partial(jp.pipeline.build, name) for name in ("gpipe", "1f1b")}


def _valid_for(name, p, m):
    return name == "gpipe" or m >= p


@pytest.mark.parametrize("name", list(BUILDERS))
def test_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1(name):
    """Computed from the table (idle slots / all slots, unit-cost actions), over a grid of (p, m)."""
    checked = 0
    for p, m in GRID:
        if not _valid_for(name, p, m):
            continue
        s = BUILDERS[name](p, m)
        assert s.num_ticks == 2 * (m + p - 1), (name, p, m)
        assert s.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (name, p, m, str(s))
        checked += 1
    assert checked >= 50


def test_stash_gpipe_holds_every_microbatch_1f1b_holds_p_minus_s():
    for p, m in GRID:
        assert gpipe(p, m).peak_stash == (m,) * p
        if m >= p:
            assert one_f_one_b(p, m).peak_stash == tuple(p - s for s in range(p)), (p, m)


def test_receive_slots():
    """Unit-cost GPipe and 1F1B consume every activation and cotangent the tick after it arrives, except the
    loss cotangents GPipe's last stage keeps from its forwards until its backwards."""
    for p, m in [(2, 2), (4, 8), (4, 16), (3, 5)]:
        g, f = gpipe(p, m).recv_slots, one_f_one_b(p, m).recv_slots
        assert g == ((0, 1),) + ((1, 1),) * (p - 2) + ((1, m),), (p, m, g)
        assert f == ((0, 1),) + ((1, 1),) * (p - 1), (p, m, f)


def test_1f1b_phases_follow_narayanan():
    """Stage s: p-1-s warm-up forwards, then alternating F/B, then the remaining backwards."""
    p, m = 4, 8
    s = one_f_one_b(p, m)
    for stage in range(p):
        order = [row[stage] for row in s.table if row[stage] is not None]
        warm = p - 1 - stage
        assert order[:warm] == [F(j) for j in range(warm)]
        steady = order[warm:warm + 2 * (m - warm)]
        assert steady[0::2] == [F(j) for j in range(warm, m)] and steady[1::2] == [B(j) for j in range(m - warm)]
        assert order[warm + 2 * (m - warm):] == [B(j) for j in range(m - warm, m)]


def test_gpipe_runs_all_forwards_first():
    s = gpipe(3, 5)
    for stage in range(3):
        kinds = [row[stage].kind for row in s.table if row[stage] is not None]
        assert kinds == ["F"] * 5 + ["B"] * 5


def test_builder_errors():
    with pytest.raises(ValueError, match=r"1F1B needs num_microbatches >= num_stages, got 2 microbatches for 4"):
        one_f_one_b(4, 2)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="must be a positive int"):
            gpipe(bad, 4)
        with pytest.raises(ValueError, match="must be a positive int"):
            one_f_one_b(2, bad)


def gpipe_reference(p: int, m: int) -> tuple:
    """GPipe's table from its definition: F(j) on stage s at tick j + s, B(j) at (m + p - 1) + j + (p - 1 - s)."""
    table = [[None] * p for _ in range(2 * (m + p - 1))]
    for s in range(p):
        for j in range(m):
            table[j + s][s] = F(j)
            table[m + p - 1 + j + p - 1 - s][s] = B(j)
    return tuple(tuple(row) for row in table)


def test_gpipe_with_numpy_sizes_matches_its_definition():
    for p, m in [(1, 3), (3, 2), (2, 5)]:
        assert P.gpipe(np.int8(p), np.uint16(m)).table == gpipe_reference(p, m)


# --------------------------------------------------------------------------------------- interleaved 1F1B

def test_interleaved_bubble_ticks_and_stash_over_a_grid():
    """Unit-cost ticks: ``2 (v m + p - 1)`` ticks, bubble ``(p-1)/(v m + p - 1)`` (Narayanan et al. 2021, sec.
    2.2.2: v times below 1F1B's), peak stash ``2 (p-1-s) + (v-1) p + 1`` chunk-microbatches on device ``s``."""
    checked = 0
    for p in range(1, 6):
        for v in range(2, 5):
            for m in range(p, 17, p):
                s = jp.pipeline.interleaved_1f1b(p, m, v)
                assert s.num_ticks == 2 * (v * m + p - 1), (p, m, v)
                assert s.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
                want = tuple(min(2 * (p - 1 - st) + (v - 1) * p + 1, m * v) for st in range(p))
                assert s.peak_stash == want, (p, m, v, s.peak_stash)
                checked += 1
    assert checked > 100
    s, one = jp.pipeline.interleaved_1f1b(4, 8, 2), jp.pipeline.one_f_one_b(4, 8)
    assert s.bubble_fraction == pytest.approx(3 / 19) and s.bubble_fraction < one.bubble_fraction
    assert s.peak_stash == (11, 9, 7, 5)                      # torch's Interleaved1F1B at (4, 8, 2): the same
    assert jp.pipeline.interleaved_1f1b(4, 8, 1).table == one.table


def test_interleaved_places_chunks_round_robin_and_follows_megatron_order():
    s = jp.pipeline.interleaved_1f1b(2, 4, 2)
    assert s.placement == ((0, 2), (1, 3)) and s.num_virtual_stages == 4
    # device 0's forwards: microbatches in rounds of p = 2, chunk 0 then chunk 1
    fwd = [a for row in s.table if (a := row[0]) is not None and a.kind == "F"]
    assert fwd == [F(0, 0), F(1, 0), F(0, 1), F(1, 1), F(2, 0), F(3, 0), F(2, 1), F(3, 1)]
    bwd = [a for row in s.table if (a := row[0]) is not None and a.kind == "B"]
    assert bwd == [B(0, 1), B(1, 1), B(0, 0), B(1, 0), B(2, 1), B(3, 1), B(2, 0), B(3, 0)]
    # a forward on virtual stage 2 (device 0, chunk 1) runs after virtual stage 1 (device 1, chunk 0)
    when = s.ticks()
    assert when[("F", 0, 2)] > when[("F", 0, 1)] > when[("F", 0, 0)]
    fo = s.forward_only()
    assert not fo.has_backward and fo.num_chunks == 2 and fo.placement == s.placement


def test_interleaved_errors():
    with pytest.raises(ValueError, match=r"multiple of num_stages .* got 6 microbatches for 4 stages; use "
                                         r"num_microbatches = 8"):
        jp.pipeline.interleaved_1f1b(4, 6, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"num_chunks=.* must be a positive int"):
            jp.pipeline.interleaved_1f1b(2, 4, bad)


# ------------------------------------------------------------------------------------------ zero bubble

def test_zb_h1_ticks_memory_and_bubble_over_a_grid():
    """ZB-H1 with F = B = W = one tick: ``3 m + p - 1`` ticks; every stage holds at most ``p`` microbatches from
    F to W (1F1B's peak); its bubble is below 1F1B's with B = 2 (input and weight gradients in one action)."""
    for p in range(1, 7):
        for m in range(p, 17):
            s = jp.pipeline.zero_bubble(p, m)
            assert s.split_backward and s.num_ticks == 3 * m + p - 1, (p, m, s.num_ticks)
            assert max(s.peak_stash) <= max(jp.pipeline.one_f_one_b(p, m).peak_stash) == p, (p, m, s.peak_stash)
            zb, one = timing(s, {"F": 1, "B": 1, "W": 1}), timing(jp.pipeline.one_f_one_b(p, m))   # 1F1B: B = 2
            assert zb.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
            assert one.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
            assert p == 1 or zb.bubble < one.bubble
    s = jp.pipeline.zero_bubble(4, 8)
    one = timing(jp.pipeline.one_f_one_b(4, 8)).bubble
    print(f"\nZB-H1 p=4 m=8: bubble {s.bubble_fraction:.3f} (1F1B, B=2: {one:.3f}), peak stash {s.peak_stash}, "
          f"B->W stash {s.peak_wstash}")
    # stage s defers its W's by s microbatches: the last stage's W(0) comes after its B(p-1)
    when = s.ticks()
    assert when[("W", 0, 3)] > when[("B", 3, 3)] and when[("W", 0, 0)] == when[("B", 0, 0)] + 1


def test_zb_v_placement_ticks_and_memory():
    """ZB-V: device s holds virtual stages s and 2p-1-s; the loss is on device 0; the turn on the last device is
    a local hand-off; activations go down and up in the same tick. With F = B = W = one tick and p <= 4:
    ``6 m + p - 1`` ticks; peak stash 2p chunk-microbatches per device, i.e. p microbatches of a stage's layers:
    1F1B's peak."""
    for p in range(1, 5):
        for m in range(p, 17):
            s = jp.pipeline.zero_bubble_v(p, m)
            assert s.num_ticks == 6 * m + p - 1, (p, m, s.num_ticks)
            assert max(s.peak_stash) <= 2 * p and max(s.peak_stash) / 2 <= max(jp.pipeline.one_f_one_b(p, m).peak_stash)
    p, m = 4, 8
    s = jp.pipeline.zero_bubble_v(p, m)
    assert s.placement == ((0, 7), (1, 6), (2, 5), (3, 4)) and s.location(2 * p - 1) == (0, 1)
    arrive = control_table(s).actions.arrive_buffer
    assert (arrive[:, p - 1, SELF] == ACTIVATIONS).any() and (arrive[:, p - 1, SELF] == COTANGENTS).any()
    assert (arrive[:, 0, SELF] == COTANGENTS).any()              # the loss cotangent, on device 0
    both = [t for t in range(s.num_ticks) if (arrive[t, :, PREV] == ACTIVATIONS).any()
            and (arrive[t, :, NEXT] == ACTIVATIONS).any()]
    assert both, "no tick sends activations both down and up"
    print(f"\nZB-V p=4 m=8: {s.num_ticks} ticks, bubble {s.bubble_fraction:.3f}, peak stash {s.peak_stash}, "
          f"B->W stash {s.peak_wstash}")


def test_zero_bubble_errors():
    """(Every builder's non-integer sizes: test_builders_still_refuse_non_integers below.)"""
    with pytest.raises(ValueError, match=r"dualpipe_v needs num_microbatches >= 2 \* num_stages .* got 7 microbatches "
                                         r"for 4 stages; use num_microbatches >= 8"):
        jp.pipeline.dualpipe_v(4, 7)
    with pytest.raises(ValueError, match=r"zero_bubble needs num_microbatches >= num_stages, got 2 microbatches "
                                         r"for 4 stages"):
        jp.pipeline.zero_bubble(4, 2)
    with pytest.raises(ValueError, match=r"zero_bubble_v needs num_microbatches >= num_stages"):
        jp.pipeline.zero_bubble_v(4, 3)
    with pytest.raises(ValueError, match=r"num_stages=0 must be a positive int"):
        jp.pipeline.zero_bubble_v(0, 3)


# ------------------------------------------------------------------------------------------ DualPipeV

# torch 2.13's ScheduleDualPipeV(...).pipeline_order at p=4, m=8, each rank's actions as str() writes them
# (tests/pipeline/test_analysis.py generates it again where torch is installed): the reference order.
TORCH_DUALPIPEV_4_8 = [
    "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 (0F7;7B3)OVERLAP_F_B (7F4;0B0)OVERLAP_F_B 7B4 "
    "(7F5;0B1)OVERLAP_F_B 7B5 (7F6;0B2)OVERLAP_F_B 7B6 (7F7;0B3)OVERLAP_F_B 7B7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
    "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 (1F6;6B2)OVERLAP_F_B (6F4;1B0)OVERLAP_F_B "
    "(1F7;6B3)OVERLAP_F_B (6F5;1B1)OVERLAP_F_B 6B4 (6F6;1B2)OVERLAP_F_B 6B5 (6F7;1B3)OVERLAP_F_B 6B6 1B4 6I7 1I5 6W7 "
    "1I6 1W5 1I7 1W6 1W7",
    "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 (2F5;5B1)OVERLAP_F_B (5F4;2B0)OVERLAP_F_B (2F6;5B2)OVERLAP_F_B "
    "(5F5;2B1)OVERLAP_F_B (2F7;5B3)OVERLAP_F_B (5F6;2B2)OVERLAP_F_B 5B4 (5F7;2B3)OVERLAP_F_B 5B5 2B4 5B6 2I5 5I7 2I6 "
    "2W5 2I7 5W7 2W6 2W7",
    "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 (4F4;3B0)OVERLAP_F_B (3F5;4B1)OVERLAP_F_B (4F5;3B1)OVERLAP_F_B "
    "(3F6;4B2)OVERLAP_F_B (4F6;3B2)OVERLAP_F_B (3F7;4B3)OVERLAP_F_B (4F7;3B3)OVERLAP_F_B 4B4 3B4 4B5 3B5 4I6 3I6 4I7 "
    "3I7 4W6 3W6 4W7 3W7"]


def test_dualpipe_v_is_torchs_order():
    """DualPipeV at p=4, m=8 is torch's ScheduleDualPipeV order placed at the earliest ticks: the same table, the V
    placement; the steady state fuses the forward of one chunk with the full backward of the other."""
    s = jp.pipeline.dualpipe_v(4, 8)
    ref = jp.pipeline.from_actions([row.split() for row in TORCH_DUALPIPEV_4_8], name="torch")
    assert s.table == ref.table and s.placement == ref.placement == v_shape(4) and s.num_ticks == 34
    fused = [(st, a) for row in s.table for st, a in enumerate(row) if a is not None and a.kind == "FB"]
    assert len(fused) == 5 + 6 + 7 + 7 and all(a.chunk != a.backward.chunk for _, a in fused)
    when = s.ticks()
    full = [(j, v) for k, j, v in when if k == "B" and ("W", j, v) not in when]
    assert s.split_backward and 0 < len(full) < 2 * 4 * 8          # full and split backwards mixed
    print(f"\n{s}")


def test_dualpipe_v_bubble_and_stash_over_a_grid():
    """With F = B (input gradient) = W = 1, a full backward 2 and an FB 3, every device idles
    ``(p-1)(F&B + B - 3W) = 2 (p-1)`` (DeepSeek-AI 2024, sec. 3.2.1; the DualPipe README's bubble formula, B the
    full backward), whatever ``m``; the peak stash is at most ``2p + 1`` chunk-microbatches (ZB-V: ``2p``)."""
    for p in range(1, 6):
        for m in range(2 * p, 2 * p + 7):
            s = jp.pipeline.dualpipe_v(p, m)
            t = timing(s, {"F": 1, "B": 1, "W": 1})
            assert t.work == 2 * m * p * 3 and t.makespan - t.work / p == 2 * (p - 1), (p, m, t.makespan)
            assert max(s.peak_stash) <= 2 * p + 1, (p, m, s.peak_stash)
    s = jp.pipeline.dualpipe_v(4, 8)
    assert s.peak_stash == (8, 8, 8, 9) and s.peak_wstash == (1, 2, 3, 4)
    assert timing(s, {"F": 1, "B": 1, "W": 1}).bubble == pytest.approx(6 / 54)


# -------------------------------------------------------------------------------- every builder's arguments

# every registered schedule (interleaved with a numpy chunk count)
ALL_BUILDERS = {name: functools.partial(P.build, name, **({"num_chunks": np.int16(2)} if name == "interleaved" else {}))
                for name in P.SCHEDULES}


@pytest.mark.parametrize("name", list(ALL_BUILDERS))
def test_builders_take_numpy_integers(name):
    p, m = 2, 4
    got = ALL_BUILDERS[name](np.int64(p), np.int32(m))
    assert type(got.num_stages) is int and type(got.num_microbatches) is int and type(got.num_chunks) is int
    assert (got.num_stages, got.num_microbatches) == (p, m)
    assert got.table == ALL_BUILDERS[name](p, m).table


@pytest.mark.parametrize("bad", [0, -3, 2.0, np.float64(2.0), True, np.int64(0), "2", None], ids=repr)
def test_builders_still_refuse_non_integers(bad):
    for name, build in ALL_BUILDERS.items():
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
                                                 r"at least 6000001 ticks"),
           (lambda: P.dualpipe_v(2, 10 ** 7), r"dualpipe_v\(num_stages=2, num_microbatches=10000000\): a table of "
                                              r"at least 20000001 ticks")]


@pytest.mark.parametrize("build,match", TOO_BIG, ids=[str(i) for i in range(len(TOO_BIG))])
def test_builders_bound_the_table_size(build, match):
    with pytest.raises(ValueError, match=match + r".*MAX_TABLE_ENTRIES\); use fewer stages or fewer, larger "
                                                 r"microbatches"):
        build()


# ----------------------------------------------------------------------------------------------- the registry

def test_build_covers_every_registered_name_and_refuses_an_unknown_one():
    """``jp.pipeline.build(name, p, m)`` is the registered builder's table for every name of ``SCHEDULES`` (the
    command lines' names among them); an unknown name or option is refused naming what is valid."""
    assert {"gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"} <= set(P.SCHEDULES)
    for name, builder in P.SCHEDULES.items():
        got = P.build(name, 2, 4)
        assert isinstance(got, P.Schedule) and (got.num_stages, got.num_microbatches) == (2, 4), name
        assert got.table == builder(2, 4).table, name
    assert P.build("interleaved", 2, 8, num_chunks=4).table == P.interleaved_1f1b(2, 8, 4).table
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'; use one of \['1f1b', 'dualpipev', "
                                         r"'gpipe', 'interleaved', 'zb', 'zbv'\]"):
        P.build("pipedream", 2, 4)
    with pytest.raises(TypeError, match=r"schedule 'gpipe' \(gpipe\) takes no option num_chunks; its options: none"):
        P.build("gpipe", 2, 4, num_chunks=2)
    with pytest.raises(ValueError, match=r"1F1B needs num_microbatches >= num_stages"):
        P.build("1f1b", 4, 2)
