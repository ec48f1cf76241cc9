"""jaxpar/pipeline/analysis.py: ``timing``, ``lockstep_time``, ``compare`` and ``compiled_temp_bytes``; their
argument checks; jaxpar's tables beside torch's own.

The torch comparison builds ``torch.distributed.pipelining``'s ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` at (p=4, m=8, v=2) (their
``pipeline_order`` needs no process group: the stages are stand-ins carrying the attributes the constructors
read), reads each rank's order through :func:`jaxpar.pipeline.from_actions` (torch's own action strings) and
times both sides with one cost model: every F, B (full or input-gradient) and W one tick, a dependency at a
strictly earlier tick (in a table with W's, a B without a W of its own, a full backward, two ticks; an FB
three). Run with ``-s`` to see the table.
"""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import numpy as np
import pytest

import jaxpar as jp
from jaxpar.pipeline import gpipe, one_f_one_b
from jaxpar.pipeline.analysis import compiled_temp_bytes, lockstep_time, timing

P = jp.pipeline


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
                                             r"kinds \('F', 'B', 'W', 'FB'\)"):
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


# ---------------------------------------------------------------------------------------------- compare

UNIT = {"F": 1, "B": 1, "W": 1}


def test_compare_rows_and_definitions():
    p, m = 4, 8
    scheds = [jp.pipeline.one_f_one_b(p, m), jp.pipeline.interleaved_1f1b(p, m, 2), jp.pipeline.zero_bubble(p, m),
              jp.pipeline.zero_bubble_v(p, m)]
    rows = {r["name"]: r for r in jp.pipeline.compare(scheds)}           # default costs: B = 2 where it holds W
    work = {"1f1b": 3 * m, "interleaved_1f1b": 3 * m * 2, "zb-h1": 3 * m, "zb-v": 3 * m * 2}
    for name, r in rows.items():   # 1 - work / (p T), work per stage given here
        assert r["bubble"] == pytest.approx(1 - work[name] / r["time"], abs=1e-12), name
    assert rows["1f1b"]["bubble"] == pytest.approx(3 / 11) and rows["1f1b"]["time"] == 33
    assert rows["interleaved_1f1b"]["bubble"] == pytest.approx(3 / 19)                 # (p-1)/(v m + p - 1)
    assert rows["zb-h1"]["bubble"] == pytest.approx(3 / 27) and rows["zb-h1"]["bubble"] < rows["1f1b"]["bubble"]
    assert rows["zb-v"]["bubble"] == pytest.approx(3 / 51) and rows["zb-v"]["bubble"] < rows["zb-h1"]["bubble"]
    assert rows["zb-v"]["peak_stash_layers"] == (4.0,) * 4 and max(rows["1f1b"]["peak_stash_layers"]) == 4.0
    assert rows["interleaved_1f1b"]["peak_stash"] == (11, 9, 7, 5) and rows["zb-v"]["peak_stash"] == (8,) * 4
    print("\n" + "\n".join(f"{n:18s} ticks {r['ticks']:3d} time {r['time']:5.1f} bubble {r['bubble']:.3f} peak stash "
                           f"{r['peak_stash']} ({r['peak_stash_layers']} x L/p layers)" for n, r in rows.items()))
    # unit costs on a fused table: its own ticks
    assert timing(jp.pipeline.one_f_one_b(p, m), UNIT).makespan == 22
    with pytest.raises(ValueError, match=r"the table runs W actions; give 'W' a positive cost"):
        jp.pipeline.compare([jp.pipeline.zero_bubble(2, 2)], costs={"F": 1, "B": 1})
    with pytest.raises(TypeError, match=r"compare takes jp.pipeline.Schedule objects"):
        jp.pipeline.compare(["1f1b"])


def test_compare_compiled_memory(mesh_factory):
    """``compare`` with a stage function and shapes: compiled temporary memory per device; GPipe (stashes every
    microbatch) above 1F1B (at most p) at m = 8; the shapes are required together."""
    import jax
    import jax.numpy as jnp
    stage = lambda prm, x: jnp.tanh(x @ prm["w"][0])
    loss = lambda head, y, t: jnp.mean((y - t) ** 2)
    s = jax.ShapeDtypeStruct
    shapes = {"layers": {"w": s((2, 32, 32), jnp.float32)}, "head": {}, "x": s((32, 8, 32), jnp.float32),
              "targets": s((32, 8, 32), jnp.float32), "mesh": mesh_factory(pipe=2)}
    rows = jp.pipeline.compare([gpipe(2, 8), one_f_one_b(2, 8)], stage_fn=stage, loss_fn=loss, **shapes)
    assert rows[0]["temp_bytes"] > rows[1]["temp_bytes"] > 0, rows
    with pytest.raises(ValueError, match=r"missing \['loss_fn'\]"):
        jp.pipeline.compare([gpipe(2, 8)], stage_fn=stage, **shapes)


def _torch_orders(p: int, m: int, v: int):
    pytest.importorskip("torch")
    from torch.distributed.pipelining import schedules as ts

    def stages(indices):   # stand-ins for PipelineStage: the attributes the schedule constructors read
        return [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, stage_index=i, is_first=i == 0,
                                is_last=i == p * v - 1, submod=None) for i in indices]
    out = {}
    for cls, local in [(ts.ScheduleInterleaved1F1B, [0, p]), (ts.ScheduleInterleavedZeroBubble, [0, p]),
                       (ts.ScheduleZBVZeroBubble, [0, 2 * p - 1]), (ts.ScheduleDualPipeV, [0, 2 * p - 1])]:
        order = cls(stages(local), m, loss_fn=lambda out, target: out).pipeline_order
        out[cls.__name__] = [[None if a is None else str(a) for a in order[r]] for r in range(p)]
    return out


def test_beside_torch_schedules():
    """torch's orders timed with the one cost model give its stated figures; jaxpar's tables are no worse on
    bubble at no more peak stash (ZB-H1 has one chunk; torch's interleaved zero-bubble has no jaxpar twin, so
    ZB-V, the other two-chunk zero-bubble table, stands beside it)."""
    p, m, v = 4, 8, 2
    torch_rows = {name: jp.pipeline.compare([jp.pipeline.from_actions(lists, name=name)], UNIT)[0]
                  for name, lists in _torch_orders(p, m, v).items()}
    ours = {r["name"]: r for r in jp.pipeline.compare(
        [jp.pipeline.interleaved_1f1b(p, m, v), jp.pipeline.zero_bubble_v(p, m), jp.pipeline.zero_bubble(p, m),
         jp.pipeline.dualpipe_v(p, m)], UNIT)}
    t = torch_rows
    assert round(t["ScheduleInterleaved1F1B"]["bubble"], 3) == 0.158 and t["ScheduleInterleaved1F1B"]["peak_stash"] == (
        11, 9, 7, 5)
    for name in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"):
        assert round(t[name]["bubble"], 3) == 0.059 and t[name]["peak_stash"] == (8,) * 4, (name, t[name])
    pairs = [("ScheduleInterleaved1F1B", "interleaved_1f1b"), ("ScheduleInterleavedZeroBubble", "zb-v"),
             ("ScheduleZBVZeroBubble", "zb-v"), ("ScheduleDualPipeV", "dualpipev")]
    lines = []
    for theirs, mine in pairs:
        a, b = t[theirs], ours[mine]
        lines.append(f"{theirs:30s} bubble {a['bubble']:.3f} peak {a['peak_stash']} | jaxpar {mine:16s} bubble "
                     f"{b['bubble']:.3f} peak {b['peak_stash']}")
        assert b["bubble"] <= a["bubble"] + 1e-12 and max(b["peak_stash"]) <= max(a["peak_stash"]), lines[-1]
    print("\n" + "\n".join(lines) + f"\njaxpar zb-h1 (1 chunk): bubble {ours['zb-h1']['bubble']:.3f}, peak "
          f"{ours['zb-h1']['peak_stash']} microbatches of L/p layers")


def test_dualpipe_v_beside_torchs_order():
    """DualPipeV at (p=4, m=8) under the one cost model: torch's ScheduleDualPipeV order (generated by torch, and
    as written out in test_builders.py) gives the same table, so the same figures: bubble 6/54 = 0.111 (every
    device idles (p-1)(F&B + B - 3W) = 6 of 54 units), peak stash (8, 8, 8, 9) chunk-microbatches, (1, 2, 3, 4)
    held from B to W. Beside it ZB-V (no fused actions; the cost model has no communication to overlap, which is
    what DualPipeV's fusion is for): bubble 3/51 = 0.059 at peak stash 8 everywhere."""
    from .test_builders import TORCH_DUALPIPEV_4_8
    p, m = 4, 8
    lists = _torch_orders(p, m, 2)["ScheduleDualPipeV"]
    assert [" ".join(row) for row in lists] == TORCH_DUALPIPEV_4_8
    theirs = jp.pipeline.from_actions(lists, name="ScheduleDualPipeV")
    ours = jp.pipeline.dualpipe_v(p, m)
    assert theirs.table == ours.table
    rows = {r["name"]: r for r in jp.pipeline.compare([theirs, ours, jp.pipeline.zero_bubble_v(p, m)], UNIT)}
    for name in ("ScheduleDualPipeV", "dualpipev"):
        r = rows[name]
        assert (r["time"], r["peak_stash"], r["peak_wstash"]) == (54, (8, 8, 8, 9), (1, 2, 3, 4)), (name, r)
        assert r["bubble"] == pytest.approx(6 / 54) and r["lockstep_time"] == 60
    assert rows["zb-v"]["bubble"] == pytest.approx(3 / 51) and rows["zb-v"]["peak_stash"] == (8,) * 4
    print("\n" + "\n".join(f"{n:18s} ticks {r['ticks']} time {r['time']:.0f} bubble {r['bubble']:.3f} peak stash "
                           f"{r['peak_stash']} B->W {r['peak_wstash']} lockstep {r['lockstep_time']:.0f}"
                           for n, r in rows.items()))


def test_fused_and_full_backward_costs():
    """An FB costs F plus its full backward unless 'FB' is given; in a table with W's a B without its own W is a
    full backward (B + W). By hand, p=1, one chunk, m=2: F0, F1+B0 (full), B1, W1 with F=1, B=2, W=3: times 1, 1 +
    (2 + 3), 2, 3."""
    s = jp.pipeline.from_actions([["F0", "F1+B0", "B1", "W1"]])
    assert [str(a) for row in s.table for a in row] == ["F0", "F1+B0", "B1", "W1"]
    t = timing(s, {"F": 1, "B": 2, "W": 3})
    assert (t.makespan, t.work) == (12, 12) and t.start[("B", 1, 0)] == 7 and t.start[("F", 1, 0)] == 1
    assert timing(s, {"F": 1, "B": 2, "W": 3, "FB": 4}).makespan == 10
    assert lockstep_time(s, {"F": 1, "B": 2, "W": 3}) == 12
