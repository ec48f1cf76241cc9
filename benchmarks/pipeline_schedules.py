"""Every pipeline schedule training the GPT beside the unpipelined step: loss curves, step time, lockstep cost.

    python benchmarks/pipeline_schedules.py [--steps 20] [--pipe 2] [--microbatches 8] [--rounds 3]

Prints one JSON object. A small GPT (4 layers, d_model 32, the test suite's size) trains ``--steps`` steps of
AdamW from the same init on the same batches (global batch 32) through ``jp.train.make_train_step`` of

* the plain step on one device (the reference), and on ``data=8`` (the data-parallel drift to compare with);
* ``Pipeline(model.embed, model.stage, model.head_loss, schedule)`` on ``data=8/pipe x pipe`` for each
  schedule: gpipe, 1f1b, interleaved (``v = 2``), zb (ZB-H1), zbv (ZB-V), dualpipev (DualPipeV: fused ``FB`` ticks
  cost ``F`` plus a full backward).

Per run: the loss curve, ``rel_diff_step1`` (``|loss - ref| / |ref|`` at the first step), ``max_rel_drift``
(the largest over the steps). Per schedule, from the table (:mod:`jaxpar.pipeline.analysis`, default costs
``F = 1``, ``B = 1`` and ``W = 1`` with split backwards, ``B = 2`` fused; an action of a ``v``-chunk table is
``1/v`` of a stage's work, so times are divided by ``v`` to be in full-stage forwards): ``ideal_time`` (each
action its own cost), ``lockstep_time`` (the interpreter runs one scan step per tick, so a tick lasts as long
as its slowest action) and their ratio, the cost-weighted bubble; and the median step time over ``--rounds``
interleaved rounds of ``--timed-steps`` steps (compiled beforehand). Simulated CPU devices: step times show
the interpreter's overheads more than a real pipeline's; say the machine's load beside them.
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

CFG = GPTConfig(vocab_size=61, num_layers=4, num_heads=4, d_model=32, max_seq_len=16, head_dim=0)
BATCH, SEED = 32, 41


def batches(steps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"inputs": rng.integers(0, CFG.vocab_size, (BATCH, CFG.max_seq_len), dtype=np.int32),
             "targets": rng.integers(0, CFG.vocab_size, (BATCH, CFG.max_seq_len), dtype=np.int32)}
            for _ in range(steps)]


def train(model, grad_fn, mesh, data: list[dict]) -> tuple[list[float], object]:
    """``len(data)`` steps from the same init; returns the losses and the compiled step (for timing)."""
    tx = optax.adamw(3e-3)
    state = jp.train.init_state(model.init, tx, SEED, mesh=mesh)
    step = jp.train.make_train_step(grad_fn, tx, mesh=mesh, donate=False)
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, (step, state)


def time_steps(runs: dict, batch: dict, rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each compiled step, the runs interleaved round by round."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (step, state) in runs.items():
            jax.block_until_ready(step(state, batch))
            t0 = time.perf_counter()
            for _ in range(steps):
                out = step(state, batch)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / steps)
    return {name: float(np.median(t)) for name, t in times.items()}


def table_figures(schedule) -> dict:
    t = jp.pipeline.timing(schedule)
    lock = jp.pipeline.analysis.lockstep_time(schedule)
    v = schedule.num_chunks
    return {"ticks": schedule.num_ticks, "bubble": round(t.bubble, 4), "ideal_time": t.makespan / v,
            "lockstep_time": lock / v, "lockstep_over_ideal": round(lock / t.makespan, 3)}


def drift(losses: list[float], ref: list[float]) -> dict:
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref)]
    return {"rel_diff_step1": rel[0], "max_rel_drift": max(rel), "losses": [round(x, 6) for x in losses]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pipe", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timed-steps", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=list(jp.pipeline.SCHEDULES), choices=list(jp.pipeline.SCHEDULES))
    args = ap.parse_args(argv)
    p, m = args.pipe, args.microbatches
    model = GPT(CFG)
    data = batches(args.steps)
    plain = lambda params, batch, rng: model.loss(params, batch)
    one = jp.make_mesh(data=1, devices=jax.devices()[:1])
    ref, _ = train(model, plain, one, data)
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "pipe": p, "microbatches": m,
           "global_batch": BATCH, "steps": args.steps, "load_before": os.getloadavg()[0], "reference": drift(ref, ref)}
    d8, run8 = train(model, plain, jp.make_mesh(data=8), data)
    out["data8"] = drift(d8, ref)
    runs, rows = {"pipe1_data8": run8}, {}
    mesh = jp.make_mesh(data=8 // p, pipe=p)
    for name in args.schedules:
        schedule = jp.pipeline.build(name, p, m)
        pipeline = jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, schedule)
        losses, runs[name] = train(model, pipeline, mesh, data)
        rows[name] = {**drift(losses, ref), **table_figures(schedule)}
    times = time_steps(runs, data[0], args.rounds, args.timed_steps)
    for name, row in rows.items():
        row["step_seconds"] = times[name]
    out.update(schedules=rows, pipe1_data8_step_seconds=times["pipe1_data8"], load_after=os.getloadavg()[0])
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
