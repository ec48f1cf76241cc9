"""jaxpar/pipeline/stash.py: what F keeps for B (``stash='residuals'`` or ``'inputs'``, which recomputes the
forward), and the stash buffers written and read in place in the compiled program."""

from __future__ import annotations

import pytest

import jaxpar as jp

from .common import BUILD, MESHES, SCHEDULES, check_parity, head_loss, make_problem, mlp_block, pipeline_benchmark
from .common import place, reference, run_user_stage


def test_stash_inputs_recomputes_and_matches(mesh_factory):
    p, m = 4, 8
    mesh = mesh_factory(**MESHES["d2p4"])
    stage, head, x, t = make_problem(p, m, seed=1)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, jp.pipeline.one_f_one_b(p, m), mesh=mesh, stash="inputs")
    check_parity(f(*place(mesh, stage, head, x, t)), reference(stage, head, x, t), "1f1b stash=inputs p=4 m=8")


@pytest.mark.slow
def test_interleaved_stash_inputs_matches(mesh_factory):
    got, ref = run_user_stage(jp.pipeline.interleaved_1f1b(2, 4, 2), mesh_factory(**MESHES["d2p2t2"]), seed=7,
                              stash="inputs")
    check_parity(got, ref, "interleaved p=2 m=4 v=2 stash=inputs")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zb", "zbv"])
def test_zero_bubble_stash_inputs_matches(name, mesh_factory):
    got, ref = run_user_stage(BUILD[name](2, 4), mesh_factory(**MESHES["d2p2t2"]), seed=13, stash="inputs")
    check_parity(got, ref, f"{name} p=2 m=4 stash=inputs")


@pytest.mark.parametrize("schedule,m", [("1f1b", 8), ("gpipe", 16)])
def test_stash_is_written_and_read_in_place(schedule, m, devices):
    """The compiled program never copies a stash buffer (``[slots, ...]``) after initialising it: F writes
    its slot in place and B reads its slot, whatever the other ticks do. (Threading the stash through the
    multi-way action switch made XLA copy every stash buffer at every tick.)"""
    bench = pipeline_benchmark()
    p = 4
    slots = max(SCHEDULES[schedule](p, m).peak_stash)
    text = bench.compile_program(schedule, p, m).as_text()
    local = bench.MICROBATCH // bench.DATA
    shapes = [f"f32[{slots},{local},{bench.SEQ},{n}]" for n in (bench.D, bench.F)]
    assert any(s in text for s in shapes), "the stash buffers were not found; has the benchmark model changed?"
    copies = [line.strip() for line in text.splitlines()
              if " copy(" in line and "broadcast" not in line and any(s + "{" in line for s in shapes)]
    assert not copies, copies[:3]
