"""jaxpar/pipeline/interpreter.py: one tick loop runs every table (GPipe, 1F1B, interleaved, zero bubble, DualPipeV,
random and irregular ones) with the sequential single-device reference's loss and gradients, the forward-only table
too, and within the memory its schedule promises (from the compiled program).

The reference and tolerance: tests/pipeline/common.py. Run with ``-s`` to see the errors reached.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close

import jaxpar as jp
from jaxpar.pipeline import B, F, Schedule
from jaxpar.pipeline.schedules import dependencies, v_shape

from .common import (BUILD, MESHES, SCHEDULES, check_parity, head_loss, make_problem, mlp_block, on_one_device,
                     pipeline_benchmark, place, reference, run_user_stage, sequential)


# (stages, microbatches) -> mesh per schedule: p=2 beside data=2 and tensor=2; p=4 beside data=2 or tensor=2,
# alternating so that both schedules run on both p=4 meshes.
CASES = [(2, 2, "gpipe", "d2p2t2"), (2, 2, "1f1b", "d2p2t2"), (2, 8, "gpipe", "d2p2t2"), (2, 8, "1f1b", "d2p2t2"),
         (4, 4, "gpipe", "d2p4"), (4, 4, "1f1b", "p4t2"), (4, 8, "gpipe", "p4t2"), (4, 8, "1f1b", "d2p4"),
         (4, 16, "gpipe", "d2p4"), (4, 16, "1f1b", "p4t2")]


# p=2 at m=8 and p=4 at m=16 run in the slow set (fast-set time): their fast siblings are the same schedule on the
# same mesh at m=2 (p=2) and at m=4 and m=8 (p=4).
SLOW_MICROBATCHES = {(2, 8), (4, 16)}


@pytest.mark.parametrize("p,m,schedule,mesh_name", [
    pytest.param(*case, marks=[pytest.mark.slow] if case[:2] in SLOW_MICROBATCHES else []) for case in CASES],
    ids=[f"{s}-p{p}-m{m}-{n}" for p, m, s, n in CASES])
def test_value_and_grad_matches_sequential_reference(p, m, schedule, mesh_name, mesh_factory):
    mesh = mesh_factory(**MESHES[mesh_name])
    stage, head, x, t = make_problem(p, m)
    ref = reference(stage, head, x, t)
    args = place(mesh, stage, head, x, t)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, SCHEDULES[schedule](p, m), mesh=mesh)
    loss, (g_stage, g_head, g_x) = f(*args)
    check_parity((loss, (g_stage, g_head, g_x)), ref, f"{schedule} p={p} m={m} {mesh_name}")
    # gradients come back with their inputs' shardings
    assert jax.tree.map(lambda g: g.sharding, g_stage) == jax.tree.map(lambda a: a.sharding, args[0])
    assert g_x.sharding == args[2].sharding and g_x.sharding.spec[0] == ("data", "fsdp")
    assert loss.dtype == jnp.float32 and g_x.dtype == jnp.float32


def random_schedule(p: int, m: int, seed: int) -> Schedule:
    """A valid but irregular table: each tick every stage runs a random ready action, or idles (1 in 5)."""
    rng, done, table = random.Random(seed), {}, []
    todo = [{(k, j) for k in "FB" for j in range(m)} for _ in range(p)]

    def ready(s, k, j):
        deps = [("F", j, s - 1)] if k == "F" and s else []
        deps += [("F", j, s)] + ([("B", j, s + 1)] if s < p - 1 else []) if k == "B" else []
        return all(d in done for d in deps)

    while any(todo):
        row = []
        for s in range(p):
            options = sorted(a for a in todo[s] if ready(s, *a))
            pick = rng.choice(options) if options and rng.random() > 0.2 else None
            row.append(pick)
        for s, a in enumerate(row):
            if a is not None:
                todo[s].discard(a)
                done[(a[0], a[1], s)] = len(table)
        table.append(tuple(None if a is None else (F if a[0] == "F" else B)(a[1]) for a in row))
    return Schedule(f"random{seed}", p, m, table)


def test_any_valid_table_runs(mesh_factory):
    """One interpreter for every table: an irregular random schedule gives the same numbers."""
    p, m = 4, 6
    sched = random_schedule(p, m, seed=3)
    assert max(sched.peak_stash) > 1 and max(c for _, c in sched.recv_slots) > 1, str(sched)
    mesh = mesh_factory(**MESHES["d2p4"])
    stage, head, x, t = make_problem(p, m, seed=2)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, sched, mesh=mesh)
    check_parity(f(*place(mesh, stage, head, x, t)), reference(stage, head, x, t), f"random table p={p} m={m}")


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


def test_apply_matches_sequential_forward(mesh_factory):
    p, m = 2, 4
    mesh = mesh_factory(**MESHES["d2p2t2"])
    stage, head, x, t = make_problem(p, m, seed=4)
    stage_p, _, x_p, _ = place(mesh, stage, head, x, t)
    y = jp.pipeline.apply(mlp_block, jp.pipeline.one_f_one_b(p, m), mesh=mesh)(stage_p, x_p)
    ref = on_one_device(sequential, stage, x)
    assert y.sharding == x_p.sharding
    print(f"apply p=2 m=4: {assert_tree_close(y, ref, what='apply'):.2e}")


# ---------------------------------------------------------------------------------------- interleaved 1F1B

INTERLEAVED = [pytest.param(2, 4, 2, "d2p2t2", id="p2-m4-v2-d2p2t2"),
               pytest.param(4, 8, 2, "d2p4", id="p4-m8-v2-d2p4", marks=pytest.mark.slow),
               pytest.param(4, 8, 2, "p4t2", id="p4-m8-v2-p4t2", marks=pytest.mark.slow),
               pytest.param(2, 8, 4, "d2p2t2", id="p2-m8-v4-d2p2t2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("p,m,v,mesh_name", INTERLEAVED)
def test_interleaved_user_stage_matches_sequential_reference(p, m, v, mesh_name, mesh_factory):
    sched = jp.pipeline.interleaved_1f1b(p, m, v)
    got, ref = run_user_stage(sched, mesh_factory(**MESHES[mesh_name]), seed=p + v)
    check_parity(got, ref, f"interleaved p={p} m={m} v={v} {mesh_name}")


def test_interleaved_apply_matches_sequential_forward(mesh_factory):
    sched = jp.pipeline.interleaved_1f1b(2, 4, 2)
    mesh = mesh_factory(**MESHES["d2p2t2"])
    stage, head, x, t = make_problem(4, 4, seed=9)
    stage_p, _, x_p, _ = place(mesh, jp.pipeline.to_stage_layout(stage, sched), head, x, t)
    y = jp.pipeline.apply(mlp_block, sched, mesh=mesh)(stage_p, x_p)
    print(f"interleaved apply: {assert_tree_close(y, on_one_device(sequential, stage, x), what='apply'):.2e}")


# ------------------------------------------------------------------------------------------ zero bubble

ZB_CASES = [pytest.param("zb", 2, 4, "d2p2t2", id="zb-p2-m4-d2p2t2"),
            pytest.param("zb", 4, 8, "d2p4", id="zb-p4-m8-d2p4", marks=pytest.mark.slow),
            pytest.param("zb", 4, 8, "p4t2", id="zb-p4-m8-p4t2", marks=pytest.mark.slow),
            pytest.param("zbv", 2, 4, "d2p2t2", id="zbv-p2-m4-d2p2t2"),
            pytest.param("zbv", 4, 8, "d2p4", id="zbv-p4-m8-d2p4", marks=pytest.mark.slow),
            pytest.param("zbv", 4, 8, "p4t2", id="zbv-p4-m8-p4t2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,p,m,mesh_name", ZB_CASES)
def test_zero_bubble_user_stage_matches_sequential_reference(name, p, m, mesh_name, mesh_factory):
    got, ref = run_user_stage(BUILD[name](p, m), mesh_factory(**MESHES[mesh_name]), seed=11 + p)
    check_parity(got, ref, f"{name} p={p} m={m} {mesh_name}")


# ------------------------------------------------------------------------------------------ DualPipeV

DUALPIPE_V_CASES = [pytest.param(2, 4, "d2p2t2", id="p2-m4-d2p2t2"),
                    pytest.param(4, 8, "d2p4", id="p4-m8-d2p4", marks=pytest.mark.slow)]


@pytest.mark.parametrize("p,m,mesh_name", DUALPIPE_V_CASES)
def test_dualpipe_v_user_stage_matches_sequential_reference(p, m, mesh_name, mesh_factory):
    """DualPipeV's fused FB ticks (a forward and a full backward in one branch, two messages a tick), its full
    and split backwards, beside data=2: the sequential reference's loss and every gradient."""
    sched = jp.pipeline.dualpipe_v(p, m)
    assert any(a is not None and a.kind == "FB" for row in sched.table for a in row)
    got, ref = run_user_stage(sched, mesh_factory(**MESHES[mesh_name]), seed=31 + p)
    check_parity(got, ref, f"dualpipev p={p} m={m} {mesh_name}")


def test_zero_bubble_v_apply_matches_sequential_forward(mesh_factory):
    """The forward-only table of the V placement: down the devices and back up, the output on device 0."""
    sched = jp.pipeline.zero_bubble_v(2, 4)
    mesh = mesh_factory(**MESHES["d2p2t2"])
    stage, head, x, t = make_problem(4, 4, seed=17)
    stage_p, _, x_p, _ = place(mesh, jp.pipeline.to_stage_layout(stage, sched), head, x, t)
    y = jp.pipeline.apply(mlp_block, sched, mesh=mesh)(stage_p, x_p)
    print(f"zb-v apply: {assert_tree_close(y, on_one_device(sequential, stage, x), what='apply'):.2e}")


# ---------------------------------------------------------------------------------------------- memory

@pytest.mark.slow  # four compiles; benchmarks/pipeline_memory.py and memory.py report the same figures; .ci/run runs it
def test_memory_1f1b_stash_grows_with_stages_not_microbatches(devices):
    """Compiled temp memory at p=4 for m = 8, 16, 32 (microbatch size fixed), less the g_x accumulator.

    GPipe stashes all m microbatches: its activation part grows by at least the stash of 24 microbatches
    from m=8 to m=32. 1F1B stashes at most p: its activation part stays within one microbatch's stash. At
    m=16, 1F1B's activation part is at most half of GPipe's. From p=2 to p=4, 1F1B's grows (2 more slots).
    """
    bench = pipeline_benchmark()
    rows = {(s, m): bench.measure(s, 4, m) for s in ("gpipe", "1f1b") for m in (8, 16, 32)}
    for (s, m), r in sorted(rows.items()):
        print(f"p=4 {s:5s} m={m:2d}: temp {r['temp_bytes'] / 2**20:6.2f} MiB, activation part "
              f"{r['activation_bytes'] / 2**20:6.2f} MiB, stash slots {r['stash_slots']}")
    act = {k: r["activation_bytes"] for k, r in rows.items()}
    one = rows[("1f1b", 8)]["microbatch_activation_bytes"]
    # one microbatch's stash in this model: 2 layers x (x, 4x hidden, 4x tanh') >= 10 activations
    per_mb = (act[("gpipe", 32)] - act[("gpipe", 8)]) / 24
    assert per_mb >= 10 * one, per_mb / one
    assert max(act[("1f1b", m)] for m in (8, 16, 32)) - min(act[("1f1b", m)] for m in (8, 16, 32)) < per_mb
    assert act[("1f1b", 16)] <= 0.5 * act[("gpipe", 16)], (act[("1f1b", 16)], act[("gpipe", 16)])
    p2 = bench.measure("1f1b", 2, 8)
    print(f"p=2 1f1b  m= 8: activation part {p2['activation_bytes'] / 2**20:6.2f} MiB")
    assert act[("1f1b", 8)] - p2["activation_bytes"] >= 1.5 * per_mb


@pytest.mark.slow  # six compiles (~22 s); benchmarks/pipeline_memory.py prints the same table
def test_zero_bubble_v_memory_within_1f1b(devices):
    """Every schedule at p=4, m=16, the same model and microbatch size: ZB-V's peak stash per device is no more
    than 1F1B's, in (microbatch x 1/p of the layers) units and in compiled bytes (the stash buffers, and the
    whole activation part of the compiled temporaries); 1F1B keeps at most 0.36 of GPipe's activation part.
    DualPipeV holds one chunk-microbatch more than ZB-V on its last device (9 stash slots: 9/8 of ZB-V's stash
    bytes), and its activation part stays within 1.15 of 1F1B's (measured 1.09; ZB-V 0.98)."""
    rows = {r["schedule"]: r for r in pipeline_benchmark().schedule_table(4, 16)}
    for name, r in rows.items():
        print(f"{name:12s} peak stash (layer units) {max(r['peak_stash_layers']):4.1f}  stash "
              f"{r['stash_bytes'] / 2**20:5.2f} MiB  activation part {r['activation_bytes'] / 2**20:5.2f} MiB  "
              f"over 1F1B {r['activation_over_1f1b']:.3f}  over GPipe {r['activation_over_gpipe']:.3f}")
    zbv, ofob = rows["zbv"], rows["1f1b"]
    assert max(zbv["peak_stash_layers"]) <= max(ofob["peak_stash_layers"])
    assert zbv["stash_bytes"] <= ofob["stash_bytes"], (zbv["stash_bytes"], ofob["stash_bytes"])
    assert zbv["activation_bytes"] <= ofob["activation_bytes"], (zbv["activation_bytes"], ofob["activation_bytes"])
    assert ofob["activation_over_gpipe"] <= 0.36
    dual = rows["dualpipev"]
    assert max(dual["peak_stash"]) == 9 and dual["stash_bytes"] * 8 == zbv["stash_bytes"] * 9
    assert zbv["activation_bytes"] < dual["activation_bytes"] <= 1.15 * ofob["activation_bytes"]
