"""A user's own schedule as per-stage action lists, ``compare``, and jaxpar's tables beside torch's own.

The torch comparison builds ``torch.distributed.pipelining``'s ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble`` at (p=4, m=8, v=2) (their ``pipeline_order``
needs no process group: the stages are stand-ins carrying the attributes the constructors read), reads each
rank's order through :func:`jaxpar.pipeline.from_actions` (torch's own action strings) and times both sides
with one cost model: every F, B (full or input-gradient) and W one tick, a dependency at a strictly earlier
tick. Run with ``-s`` to see the table.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from test_pipeline_runtime import MESHES, check_parity
from test_pipeline_interleaved import run_user_stage

import jaxpar as jp
from jaxpar.pipeline import B, F
from jaxpar.pipeline.analysis import timing
from jaxpar.pipeline.schedules import dependencies, v_shape

UNIT = {"F": 1, "B": 1, "W": 1}


# ------------------------------------------------------------------------------------------ from_actions

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


BAD = [([["F0", "X1"], ["F0"]], r"stage 0, entry 1: 'X1' is not an action"),
       ([["F0", "B0"], ["0F0", "1B0"]], r"mix jaxpar \('F3.1'\) and torch \('4F3'\) action strings"),
       ([["0F0", "0B0", "0W0"], ["1F0", "1I0", "1W0"]], r"stage 0, entry 1: 0B0: a table with W actions writes its "
                                                       r"input-gradient backwards as I"),
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


def random_split_table(p: int, m: int, seed: int) -> list[list[str]]:
    """A valid but irregular V-placed split table as torch strings: every tick each stage runs a random ready
    action of its two virtual stages (or idles, 1 in 5)."""
    rng, done, lists = random.Random(seed), set(), [[] for _ in range(p)]
    held = v_shape(p)
    todo = [{(k, j, vs) for k in "FBW" for j in range(m) for vs in held[s]} for s in range(p)]
    while any(todo):
        picks = []
        for s in range(p):
            ready = sorted(a for a in todo[s] if all(d in done for d in dependencies(*a, 2 * p)))
            pick = rng.choice(ready) if ready and rng.random() > 0.2 else None
            picks.append(pick)
            lists[s].append(None if pick is None else f"{pick[2]}{'I' if pick[0] == 'B' else pick[0]}{pick[1]}")
        for s, a in enumerate(picks):
            if a is not None:
                todo[s].discard(a)
                done.add(a)
    return lists


def test_a_users_irregular_split_v_table_runs(mesh_factory):
    """One interpreter for every table: an irregular V-placed table with split backwards, given as torch
    strings, runs and matches the sequential reference."""
    sched = jp.pipeline.from_actions(random_split_table(2, 3, seed=5), name="random-v", timed=True)
    assert sched.placement == v_shape(2) and max(sched.peak_wstash) > 1, str(sched)
    got, ref = run_user_stage(sched, mesh_factory(**MESHES["d2p2t2"]), seed=21)
    check_parity(got, ref, "random split V table p=2 m=3")


# ---------------------------------------------------------------------------------------------- compare

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


def _torch_orders(p: int, m: int, v: int):
    pytest.importorskip("torch")
    from torch.distributed.pipelining import schedules as ts

    def stages(indices):   # stand-ins for PipelineStage: the attributes the schedule constructors read
        return [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, stage_index=i, is_first=i == 0,
                                is_last=i == p * v - 1, submod=None) for i in indices]
    out = {}
    for cls, local in [(ts.ScheduleInterleaved1F1B, [0, p]), (ts.ScheduleInterleavedZeroBubble, [0, p]),
                       (ts.ScheduleZBVZeroBubble, [0, 2 * p - 1])]:
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
        [jp.pipeline.interleaved_1f1b(p, m, v), jp.pipeline.zero_bubble_v(p, m), jp.pipeline.zero_bubble(p, m)], UNIT)}
    t = torch_rows
    assert round(t["ScheduleInterleaved1F1B"]["bubble"], 3) == 0.158 and t["ScheduleInterleaved1F1B"]["peak_stash"] == (
        11, 9, 7, 5)
    for name in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"):
        assert round(t[name]["bubble"], 3) == 0.059 and t[name]["peak_stash"] == (8,) * 4, (name, t[name])
    pairs = [("ScheduleInterleaved1F1B", "interleaved_1f1b"), ("ScheduleInterleavedZeroBubble", "zb-v"),
             ("ScheduleZBVZeroBubble", "zb-v")]
    lines = []
    for theirs, mine in pairs:
        a, b = t[theirs], ours[mine]
        lines.append(f"{theirs:30s} bubble {a['bubble']:.3f} peak {a['peak_stash']} | jaxpar {mine:16s} bubble "
                     f"{b['bubble']:.3f} peak {b['peak_stash']}")
        assert b["bubble"] <= a["bubble"] + 1e-12 and max(b["peak_stash"]) <= max(a["peak_stash"]), lines[-1]
    print("\n" + "\n".join(lines) + f"\njaxpar zb-h1 (1 chunk): bubble {ours['zb-h1']['bubble']:.3f}, peak "
          f"{ours['zb-h1']['peak_stash']} microbatches of L/p layers")
