"""Per-device memory of pipelined training, read from the compiled program: GPipe vs 1F1B, and every schedule.

    python benchmarks/pipeline_memory.py [--stages 4] [--microbatches 8 16 32] [--stash residuals inputs]
                                         [--table-microbatches 16]

Prints one JSON object. For each schedule, stash mode and number of microbatches ``m`` (the microbatch size
held fixed: 8 rows of ``[32, 64]`` activations, 4 per device on a ``data=2 x pipe=p`` mesh), the compiled
``jp.pipeline.value_and_grad`` of a 2-layer tanh-MLP stage (``F = 4 D``) gives:

* ``temp_bytes``: ``compile().memory_analysis().temp_size_in_bytes`` (per device);
* ``batch_bytes``: the batch-sized buffers every rank holds whatever the schedule. The runtime reads the
  microbatched inputs and targets in place from the arguments (a ``[B/m, m, ...]`` view: not temporary
  memory), so it is the ``g_x`` accumulator, ``m`` activations of one microbatch;
* ``activation_bytes = temp_bytes - batch_bytes``: the stash, receive buffers and transients, the part the
  schedule decides;
* ``stash_slots``: the stash slots the runtime allocates (the table's peak over stages).

GPipe stashes every microbatch (``m`` slots), 1F1B at most ``p`` (stage 0), so 1F1B's activation part stays
flat in ``m`` while GPipe's grows linearly; ``1f1b_over_stages`` shows 1F1B's growing with ``p``.

``schedules``: one row per schedule (GPipe, 1F1B, interleaved 1F1B with ``v = 2``, ZB-H1, ZB-V, DualPipeV) at ``p = 4``,
``m = --table-microbatches``, the same model (``LAYERS_PER_STAGE * p`` layers, each virtual
stage its share) and microbatch size, from ``jp.pipeline.compare(..., stage_fn=...)``: ticks, bubble, peak
stash, ``temp_bytes`` and ``activation_bytes`` (as above), and ``stash_bytes``, what the stash buffers
hold (slots times the bytes one (microbatch, chunk) keeps, from the residual plan and the B/W split).
Takes about a minute on a 2-core CPU (compilation only).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np

import jaxpar as jp

MICROBATCH, SEQ, D, F, LAYERS_PER_STAGE, DATA = 8, 32, 64, 256, 2, 2
MEASURED = ("gpipe", "1f1b")   # the schedules whose memory is measured over microbatches and stash modes


def stage_fn(params, x_BLD):
    """``LAYERS_PER_STAGE`` residual tanh-MLP layers: ``x + tanh(x @ w1) @ w2``."""
    for i in range(params["w1"].shape[0]):
        x_BLD = x_BLD + jnp.tanh(x_BLD @ params["w1"][i]) @ params["w2"][i]
    return x_BLD


def loss_fn(head, y_BLD, t_BLD):
    return jnp.mean(jnp.square(y_BLD @ head["w"] - t_BLD))


def compile_program(schedule: str, stages: int, microbatches: int, stash: str = "residuals"):
    """The compiled ``jp.pipeline.value_and_grad`` of the benchmark model on a ``data=2 x pipe=stages`` mesh."""
    p, m = stages, microbatches
    mesh = jp.make_mesh(data=DATA, pipe=p, devices=jax.devices()[: DATA * p])
    zeros = lambda *shape: np.zeros(shape, np.float32)
    stage_params = {"w1": zeros(p, LAYERS_PER_STAGE, D, F), "w2": zeros(p, LAYERS_PER_STAGE, F, D)}
    x = zeros(MICROBATCH * m, SEQ, D)
    f = jp.pipeline.value_and_grad(stage_fn, loss_fn, jp.pipeline.build(schedule, p, m), mesh=mesh, stash=stash)
    return f.lower(stage_params, {"w": zeros(D, D)}, x, x).compile()


def measure(schedule: str, stages: int, microbatches: int, stash: str = "residuals") -> dict:
    """Compiles one pipelined value-and-grad and returns its per-device memory figures (bytes)."""
    p, m = stages, microbatches
    sched = jp.pipeline.build(schedule, p, m)
    temp = compile_program(schedule, p, m, stash).memory_analysis().temp_size_in_bytes
    act = MICROBATCH // DATA * SEQ * D * 4              # one microbatch activation on one device
    batch_bytes = m * act
    return {"schedule": schedule, "stash": stash, "stages": p, "microbatches": m, "temp_bytes": int(temp),
            "batch_bytes": batch_bytes, "activation_bytes": int(temp) - batch_bytes,
            "stash_slots": max(sched.peak_stash), "microbatch_activation_bytes": act}


def stash_bytes(schedule) -> int:
    """Bytes the stash buffers of ``schedule`` hold per device: slots times one (microbatch, chunk)'s leaves
    (held to W, B-only and B's carry to W sharing slots), from the residual plan and the split plan."""
    from jaxpar.pipeline.split import split_plan
    from jaxpar.pipeline.stash import SharedSlots, held_to_weight, residual_plan
    from jaxpar.pipeline.table import control_table
    rows = LAYERS_PER_STAGE // schedule.num_chunks
    one = {"w1": jax.ShapeDtypeStruct((rows, D, F), jnp.float32), "w2": jax.ShapeDtypeStruct((rows, F, D), jnp.float32)}
    x = jax.ShapeDtypeStruct((MICROBATCH // DATA, SEQ, D), jnp.float32)
    plan = residual_plan(stage_fn, one, x)
    split = split_plan(stage_fn, one, x) if schedule.split_backward else None
    held = held_to_weight("residuals", plan, split)
    nbytes = lambda structs: sum(int(np.prod(r.shape)) * np.dtype(r.dtype).itemsize for r in structs)
    kept = [r for r, h in zip(plan[1], held) if h]
    shared = SharedSlots(tuple(r for r, h in zip(plan[1], held) if not h), split.carry_structs if split else ())
    sizes = control_table(schedule).sizes
    return sizes.stash * nbytes(kept) + (sizes.bstash * nbytes(shared.buffer_structs()) if split else 0)


def schedule_table(stages: int, microbatches: int) -> list[dict]:
    """Every schedule at ``(stages, microbatches)`` through ``jp.pipeline.compare`` with the compiled memory."""
    p, m = stages, microbatches
    mesh = jp.make_mesh(data=DATA, pipe=p, devices=jax.devices()[: DATA * p])
    struct = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    layers = {"w1": struct(LAYERS_PER_STAGE * p, D, F), "w2": struct(LAYERS_PER_STAGE * p, F, D)}
    x = struct(MICROBATCH * m, SEQ, D)
    schedules = [jp.pipeline.build(name, p, m) for name in jp.pipeline.SCHEDULES]
    rows = jp.pipeline.compare(schedules, stage_fn=stage_fn, loss_fn=loss_fn, layers=layers, head={"w": struct(D, D)},
                               x=x, targets=x, mesh=mesh)
    batch_bytes = m * (MICROBATCH // DATA * SEQ * D * 4)
    for key, row, sched in zip(jp.pipeline.SCHEDULES, rows, schedules):
        row.update(schedule=key, activation_bytes=row["temp_bytes"] - batch_bytes, stash_bytes=stash_bytes(sched))
    by = {r["schedule"]: r for r in rows}
    for r in rows:
        r["activation_over_gpipe"] = round(r["activation_bytes"] / by["gpipe"]["activation_bytes"], 3)
        r["activation_over_1f1b"] = round(r["activation_bytes"] / by["1f1b"]["activation_bytes"], 3)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--growth-stages", type=int, nargs="*", default=[2, 4], help="1F1B rows at m=8 over p")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--stash", nargs="+", default=["residuals", "inputs"])
    ap.add_argument("--table-microbatches", type=int, default=16, help="m of the every-schedule table")
    args = ap.parse_args(argv)
    rows = [measure(s, args.stages, m, stash) for stash in args.stash for s in MEASURED for m in args.microbatches]
    ratio = {}
    for stash in args.stash:
        for m in args.microbatches:
            by = {r["schedule"]: r["activation_bytes"] for r in rows if r["stash"] == stash and r["microbatches"] == m}
            ratio[f"{stash}/m={m}"] = round(by["1f1b"] / by["gpipe"], 3)
    growth = [measure("1f1b", p, 8) for p in args.growth_stages]
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows,
           "activation_ratio_1f1b_over_gpipe": ratio, "1f1b_over_stages": growth,
           "schedules": schedule_table(args.stages, args.table_microbatches)}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
