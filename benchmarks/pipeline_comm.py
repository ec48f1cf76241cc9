"""Batch-axis communication of the pipelined GPT train step, read from its compiled HLO, and its step time.

    python benchmarks/pipeline_comm.py [--microbatches 4 16] [--meshes dpt dpf] [--time] [--paths step action]

Prints one JSON object. For each mesh (``dpt``: data=2 x pipe=2 x tensor=2; ``dpf``: data=2 x pipe=2 x fsdp=2),
each number of microbatches ``m`` and each communication path, the GPT train step
(``jp.train.make_train_step(Pipeline(model.embed, model.stage, model.head_loss, one_f_one_b(2, m)), sgd)``,
4 layers, d_model 64, microbatch of 8 rows x 16 tokens) is compiled and its optimized HLO read
(:func:`collectives`, through :func:`jaxpar._hlo.collective_sites`):

* every collective (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute), whether it runs
  inside the pipeline's tick loop (a ``while`` body, or a computation called from one) or outside, the mesh
  axes its replica groups span (device ``i`` of a group is ``mesh.devices.flat[i]``), its bytes (the larger
  of its operand and result: a reduce-scatter is counted by what it reduces, an all-gather by what it
  gathers) and its executed bytes per step, op bytes times the trip counts of the loops around it (a
  collective inside a ``lax.switch`` branch of the tick is counted on every tick: an upper bound);
* ``grad_in_loop``: the non-scalar all-reduces / reduce-scatters over a batch axis (``data``, ``fsdp``) inside
  a loop, that is the per-microbatch gradient reductions the step-once path removes (scalar loss and
  metric reductions are left out: they may stay in the loop).

Paths (:class:`jaxpar.pipeline.Pipeline`'s ``grad_reduce`` and ``fsdp_gather`` options):
``action`` is ``grad_reduce='action'`` (``shard_map`` manual over ``pipe`` only: GSPMD reduces the
data-parallel gradient inside every backward action), ``step`` the default ``grad_reduce='step'`` with
``fsdp_gather='step'``, ``step-action`` with ``fsdp_gather='action'``. ``--time`` also times each step side by side (:func:`time_side_by_side`: interleaved rounds, ratios to
``action`` per round).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig
from jaxpar._hlo import collective_sites

CFG = GPTConfig(vocab_size=61, num_layers=4, num_heads=4, d_model=64, max_seq_len=16)
MICROBATCH_ROWS = 8
MESHES = {"dpt": {"data": 2, "pipe": 2, "tensor": 2}, "dpf": {"data": 2, "pipe": 2, "fsdp": 2}}
PATHS = {"action": {"grad_reduce": "action"}, "step": {"fsdp_gather": "step"}, "step-action": {"fsdp_gather": "action"}}


def collectives(hlo: str, mesh) -> list[dict]:
    """Every collective of a compiled module (:func:`jaxpar._hlo.collective_sites`): op, where (``loop`` /
    ``outside``), mesh axes, replica groups, bytes, executed bytes per step, whether its result is a scalar."""
    return [{"op": c.kind, "where": "loop" if c.loop_depth else "outside", "axes": "+".join(c.axes),
             "groups": str(c.groups[:4]), "bytes": c.bytes, "executed_bytes": c.bytes * c.runs, "scalar": c.scalar}
            for c in collective_sites(hlo, dict(mesh.shape))]


def summarize(colls: list[dict]) -> dict:
    """Per (where, op, axes): count, bytes and executed bytes; and the in-loop batch-axis gradient reductions."""
    table: dict[str, dict] = {}
    for c in colls:
        k = f"{c['where']} {c['op']} over {c['axes'] or '-'}"
        t = table.setdefault(k, {"count": 0, "bytes": 0, "executed_bytes": 0, "groups": c["groups"]})
        t["count"] += 1
        t["bytes"] += c["bytes"]
        t["executed_bytes"] += c["executed_bytes"]
    batch = lambda c: any(a in c["axes"].split("+") for a in ("data", "fsdp"))
    grad_in_loop = [c for c in colls if c["where"] == "loop" and batch(c) and not c["scalar"]
                    and c["op"] in ("all-reduce", "reduce-scatter")]
    return {"by_kind": dict(sorted(table.items())),
            "grad_in_loop": len(grad_in_loop),
            "batch_bytes_executed": sum(c["executed_bytes"] for c in colls if batch(c)),
            "batch_bytes_executed_in_loop": sum(c["executed_bytes"] for c in colls if batch(c) and c["where"] == "loop")}


def build(mesh_name: str, m: int, path: str, devices=None):
    """``(step, state, batch, mesh)`` of the GPT step on a named mesh with ``m`` microbatches and a path."""
    mesh = jp.make_mesh(**MESHES[mesh_name], devices=devices or jax.devices()[:8])
    model, tx = GPT(CFG), optax.sgd(0.1)
    pipe = jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, jp.pipeline.one_f_one_b(2, m),
                                **PATHS[path])
    step = jp.train.make_train_step(pipe, tx, mesh=mesh, donate=False)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    rng = np.random.default_rng(0)
    shape = (MICROBATCH_ROWS * m, CFG.max_seq_len)
    batch = {k: rng.integers(0, CFG.vocab_size, shape, dtype=np.int32) for k in ("inputs", "targets")}
    return step, state, batch, mesh


def step_hlo(mesh_name: str, m: int, path: str) -> tuple[str, object]:
    """The optimized HLO text of the compiled step and its mesh."""
    step, state, batch, mesh = build(mesh_name, m, path)
    return step.lower(state, batch).compile().as_text(), mesh


def time_side_by_side(programs: dict, rounds: int = 7) -> dict:
    """Step seconds of each ``{path: (step, state, batch)}``, timed in interleaved rounds (one step of each path
    per round, after 2 warm-up steps each) so that all paths see the same load: per path the median, and per
    path the median over rounds of its time over the ``action`` path's in the same round."""
    for step, state, batch in programs.values():
        for _ in range(2):
            jax.block_until_ready(step(state, batch))
    times = {path: [] for path in programs}
    for _ in range(rounds):
        for path, (step, state, batch) in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(state, batch))
            times[path].append(time.perf_counter() - t0)
    out = {path: {"step_seconds": float(np.median(t))} for path, t in times.items()}
    if "action" in times:
        for path, t in times.items():
            out[path]["over_action"] = float(np.median(np.array(t) / np.array(times["action"])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args()
    out = {"jax": jax.__version__, "config": dataclasses.asdict(CFG), "microbatch_rows": MICROBATCH_ROWS,
           "load": os.getloadavg(), "results": {}}
    for mesh_name in args.meshes:
        for m in args.microbatches:
            programs = {}
            for path in args.paths:
                if path == "step-action" and "fsdp" not in MESHES[mesh_name]:
                    continue
                step, state, batch, mesh = build(mesh_name, m, path)
                hlo = step.lower(state, batch).compile().as_text()
                r = summarize(collectives(hlo, mesh))
                out["results"][f"{mesh_name} m={m} {path}"] = r
                programs[path] = (step, state, batch)
                print(f"# {mesh_name} m={m} {path}: grad_in_loop {r['grad_in_loop']}", flush=True)
            if args.time:
                for path, r in time_side_by_side(programs).items():
                    out["results"][f"{mesh_name} m={m} {path}"].update(r)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
