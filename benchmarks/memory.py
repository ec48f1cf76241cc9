"""Compiled per-device memory of the GPT train step per layout and precision, beside an analytic estimate.

    python benchmarks/memory.py [--batch 32] [--seq 128] [--microbatches 4] [--precisions f32 bf16]

Compiles (never runs) ``jp.train.make_train_step`` of the main job's GPT with ``jp.optim.adamw`` on 8
simulated devices for: DP (``data=8``), FSDP (``fsdp=8``), TP (``data=2 x tensor=4``), and every registered
pipeline schedule (``jp.pipeline.SCHEDULES``: ``data=4 x pipe=2``, ``--microbatches``; chunked ones with
their default 2 chunks), each in float32 and mixed bfloat16 (``Policy "mixed_bf16"``: float32
params and optimizer state, bfloat16 compute). Prints one JSON row per (layout, precision):

* ``measured_bytes``: from ``compile().memory_analysis()``: arguments + outputs - aliased (the donated state)
  + temporaries, per device;
* ``analytic_bytes`` and its parts, per device: the estimate of :mod:`jaxpar.plan.memory` (params, gradients,
  optimizer state, the bf16 compute copy, activations by the GPT's remat setting), the one formula the
  library's planner (``jp.plan.plan``) uses too;
* ``ratio = measured / analytic``;
* ``vjp_residual_bytes`` (layouts without a pipeline): what ``jax.vjp`` of the unsharded loss keeps at the
  per-device batch, the activations autodiff really saves (for TP an upper bound: heads are not split).

Gaps outside 0.8-1.25 come from what the estimate leaves out: XLA's transient buffers (a backward holds the
gradient of one activation while it computes the next; the largest are the ``[B, H, L, L]`` attention
gradients), the batch arguments and metrics, buffers XLA does not reuse across the pipeline's loop, and the
pipeline's receive buffers and gradient accumulators. The README's table discusses the measured gaps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxpar as jp  # noqa: E402
from jaxpar.models import GPT, GPTConfig  # noqa: E402
from jaxpar.plan import memory as plan_memory  # noqa: E402

PLAIN_LAYOUTS = {"DP": dict(data=8), "FSDP": dict(data=1, fsdp=8), "TP": dict(data=2, tensor=4)}
PIPE_MESH = dict(data=4, pipe=2)
PRECISIONS = {"f32": None, "bf16": "mixed_bf16"}


def schedules(num_stages: int, num_microbatches: int) -> dict:
    """Every registered schedule (``jp.pipeline.SCHEDULES``, chunked ones with their default 2 chunks) that can
    run these sizes (``dualpipev`` needs ``num_microbatches >= 2 * num_stages``; one that refuses is left out)."""
    out = {}
    for name in jp.pipeline.SCHEDULES:
        try:
            out[name] = jp.pipeline.build(name, num_stages, num_microbatches)
        except ValueError:
            continue
    return out


def measured(compiled) -> dict:
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {"measured_bytes": int(total), "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes)}


def analytic(cfg: GPTConfig, state, mesh, batch: int, seq: int, policy, schedule=None) -> dict:
    """The estimate of ``jaxpar.plan.memory`` (the library's one formula), per device, in bytes. ``policy`` is
    read from ``state.policy``; the argument is kept for callers that pass the policy name."""
    del policy
    parts = plan_memory.estimate(cfg, state, mesh, batch, seq, schedule)
    return {"analytic_bytes": int(sum(parts.values())), "analytic_parts": {k: int(v) for k, v in parts.items()}}


def compile_step(cfg: GPTConfig, sizes: dict, policy_name, batch: int, seq: int, schedule=None):
    """``(compiled step, abstract state, mesh)`` of the GPT train step on the layout ``sizes``."""
    n = math.prod(sizes.values())
    mesh = jp.make_mesh(**sizes, devices=jax.devices()[:n])
    model = GPT(cfg)
    policy = None if policy_name is None else jp.precision.Policy.from_string(policy_name)
    names = jax.eval_shape(model.init, jax.random.key(0))
    tx = jp.optim.adamw(1e-3, total_steps=1000, warmup_steps=10, axis_names=names)
    grad_fn = model.loss if schedule is None else jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss,
                                                                       schedule)
    state = jp.train.abstract_state(model.init, tx, mesh=mesh, policy=policy)
    step = jp.train.make_train_step(grad_fn, tx, mesh=mesh)
    b = {k: jax.ShapeDtypeStruct((batch, seq), np.int32) for k in ("inputs", "targets")}
    return step.lower(state, b).compile(), state, mesh


def vjp_residual_bytes(cfg: GPTConfig, rows: int, seq: int, policy_name) -> int:
    """Bytes of what ``jax.vjp`` of the (unsharded) GPT loss keeps for the backward pass at ``rows`` sequences:
    the activations autodiff actually saves, to set beside the analytic ``A`` (``jax.eval_shape``: nothing runs)."""
    model = GPT(cfg)
    params = jax.tree.map(lambda b: b.value, jax.eval_shape(model.init, jax.random.key(0)),
                          is_leaf=lambda b: hasattr(b, "value"))
    if policy_name is not None:
        params = jp.precision.Policy.from_string(policy_name).cast_to_compute(params)
    batch = {k: jax.ShapeDtypeStruct((rows, seq), np.int32) for k in ("inputs", "targets")}
    res = jax.eval_shape(lambda p, b: jax.vjp(lambda q: model.loss(q, b)[0], p)[1], params, batch)
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(res)))


def row(cfg, layout, sizes, precision, args, schedule=None) -> dict:
    compiled, state, mesh = compile_step(cfg, sizes, PRECISIONS[precision], args.batch, args.seq, schedule)
    out = {"layout": layout, "mesh": sizes, "precision": precision, **measured(compiled),
           **analytic(cfg, state, mesh, args.batch, args.seq, PRECISIONS[precision], schedule)}
    if schedule is None:
        rows = args.batch // (mesh.shape["data"] * mesh.shape["fsdp"])
        out["vjp_residual_bytes"] = vjp_residual_bytes(cfg, rows, args.seq, PRECISIONS[precision])
    if schedule is not None:
        out["peak_stash"] = max(schedule.peak_stash)
    out["ratio"] = round(out["measured_bytes"] / out["analytic_bytes"], 3)
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    ap.add_argument("--layouts", nargs="+", default=None, help="a subset of DP FSDP TP and schedule names")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    cfg = GPTConfig(vocab_size=103, num_layers=args.layers, d_model=args.d_model, num_heads=args.heads,
                    max_seq_len=args.seq)
    rows = []
    scheds = schedules(PIPE_MESH["pipe"], args.microbatches)
    wanted = args.layouts or [*PLAIN_LAYOUTS, *scheds]
    for precision in args.precisions:
        for layout in wanted:
            if layout in PLAIN_LAYOUTS:
                rows.append(row(cfg, layout, PLAIN_LAYOUTS[layout], precision, args))
            else:
                rows.append(row(cfg, f"pipe {layout}", PIPE_MESH, precision, args, scheds[layout]))
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
           "batch": args.batch, "seq": args.seq, "microbatches": args.microbatches, "rows": rows}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
