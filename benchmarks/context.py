"""Context parallelism: per-device memory and step time of the GPT train step against the context size.

    python benchmarks/context.py [--memory-seq 4096] [--time-seq 1024] [--steps 5] [--contexts 1 2 4 8]

Two parts, one JSON row per context size and part, each with its ratio to context 1:

* ``memory``: the main job's GPT (4 layers, d_model 128, 4 heads, learned positions) at ``--memory-seq`` tokens,
  batch 1, on ``context`` simulated devices (mesh ``context=C``, nothing else): compiled per-device temporary
  bytes (``compile().memory_analysis().temp_size_in_bytes``; compiled, never run) for both strategies
  (``ring``, ``all_gather``), with the ratio to context 1 and to ``1 / context``;
* ``time``: one train step at ``--time-seq`` tokens on 8 devices (``data = 8 / C``, ``context = C``, the same
  global batch of 8 sequences): median wall time of ``--steps`` steps after a compile step (ring attention).
  On the 2-core CPU every simulated device shares the cores, so this measures the work and traffic the layout
  adds, not a speed-up (a GPU run would).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxpar as jp  # noqa: E402
from jaxpar.models import GPTConfig  # noqa: E402

MAIN = GPTConfig(vocab_size=103, num_layers=4, num_heads=4, d_model=128)   # the main job's GPT


def temp_bytes(cfg: GPTConfig, context: int, seq: int) -> int:
    model, tx = cfg.as_model(), optax.adamw(1e-3)
    mesh = jp.make_mesh(data=1, context=context, devices=jax.devices()[:context])
    state = jp.train.abstract_state(model.init, tx, mesh=mesh)
    batch = {k: jax.ShapeDtypeStruct((1, seq), np.int32) for k in ("inputs", "targets")}
    lowered = jp.train.make_train_step(model.loss, tx, mesh=mesh).lower(state, batch)
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def step_seconds(cfg: GPTConfig, context: int, seq: int, steps: int) -> float:
    model, tx = cfg.as_model(), optax.adamw(1e-3)
    mesh = jp.make_mesh(data=8 // context, context=context)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, cfg.vocab_size, (8, seq), dtype=np.int32) for k in ("inputs", "targets")}
    state, metrics = step(state, batch)   # compile
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--memory-seq", type=int, default=4096)
    ap.add_argument("--time-seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args(argv)
    rows = []
    for strategy in ("ring", "all_gather"):
        cfg = dataclasses.replace(MAIN, max_seq_len=args.memory_seq, context_attention=strategy)
        base = None
        for c in args.contexts:
            b = temp_bytes(cfg, c, args.memory_seq)
            base = base or b
            rows.append({"part": "memory", "strategy": strategy, "context": c, "seq": args.memory_seq,
                         "temp_bytes": b, "ratio_to_context_1": b / base, "ratio_to_1_over_context": b / base * c})
            print(json.dumps(rows[-1]), flush=True)
    cfg = dataclasses.replace(MAIN, max_seq_len=args.time_seq)
    base = None
    for c in args.contexts:
        s = step_seconds(cfg, c, args.time_seq, args.steps)
        base = base or s
        rows.append({"part": "time", "strategy": "ring", "context": c, "data": 8 // c, "seq": args.time_seq,
                     "step_s": s, "ratio_to_context_1": s / base})
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
