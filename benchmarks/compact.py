"""Structured pruning + compaction vs dense vs unstructured pruning at the same parameter count, in one run.

    python benchmarks/compact.py [--steps 200] [--batch 32] [--seq 128] [--rounds 10] [--sparsity 0.5]

The char-GPT of ``experiments/charlm.py`` (4 layers, d=128, 4 heads, d_mlp=512) on CPython's help text,
data=2 x fsdp=2 x tensor=2, AdamW as the main job uses it. Three trainings of ``--steps`` steps, same data:

* ``dense``;
* ``structured``: ``jp.pruning.structured_pruning`` of ``--sparsity`` of the MLP neurons and of the heads in every
  layer (uniform; Zhu & Gupta's cubic ramp from steps/4 to 3*steps/4), then ``jp.pruning.compact_state``;
* ``unstructured``: ``jp.pruning.magnitude_pruning`` (uniform, same ramp) at the sparsity whose non-zero count
  equals the compacted model's parameter count.

Prints one JSON object: validation loss of each (mean over 32 validation batches, nats/char), parameter counts and
bytes, and the median ms of a train and an eval step of the dense and compacted models (and the unstructured
one, which keeps the dense shapes), timed side by side in interleaved rounds on the 2x2x2 mesh and on 1 device.
Machines here are noisy: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import flax.linen as nn  # noqa: E402
import optax  # noqa: E402

import jaxpar as jp  # noqa: E402
from jaxpar.models import GPT, GPTConfig  # noqa: E402
from jaxpar.pruning.paths import make_plans  # noqa: E402


def optimizer(args, names, pruning=None):
    tx = jp.optim.adamw(3e-3, total_steps=args.steps, warmup_steps=min(100, args.steps // 8), weight_decay=0.1,
                        clip_norm=1.0, axis_names=names)
    return tx if pruning is None else optax.chain(tx, pruning)


def train(args, model, tx, mesh, corpus):
    state = jp.train.init_state(model.init, tx, jax.random.key(0), mesh=mesh)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
    batch = lambda t: corpus.batch(0, t, args.batch, args.seq)
    return jp.loop.run(step, state, batch, 0, args.steps).state


def val_loss(args, model, state, mesh, corpus):
    evaluate = jp.train.make_eval_step(model.loss, mesh=mesh)
    return jp.loop.mean_metrics(evaluate, state, [corpus.batch(0, i, args.batch, args.seq, "val") for i in range(32)])["loss"]


def ms(fn):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return 1e3 * (time.perf_counter() - start)


def step_times(args, runs, mesh, corpus):
    """Median train- and eval-step ms per run (model, tx, state) on ``mesh``, interleaved over rounds."""
    batch = corpus.batch(0, args.steps, args.batch, args.seq)
    calls = {}
    for name, (model, tx, state) in runs.items():
        target = jp.train.abstract_state(model.init, tx, mesh=mesh)
        state = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), state, target)
        train_step = jp.train.make_train_step(model.loss, tx, mesh=mesh, donate=False)
        eval_step = jp.train.make_eval_step(model.loss, mesh=mesh)
        calls[name] = {"train_ms": lambda s=train_step, st=state: s(st, batch)[1],
                       "eval_ms": lambda s=eval_step, st=state: s(st, batch)}
        for fn in calls[name].values():
            ms(fn)   # compile
    times = {name: {k: [] for k in fns} for name, fns in calls.items()}
    for _ in range(args.rounds):
        for name, fns in calls.items():
            for k, fn in fns.items():
                times[name][k].append(ms(fn))
    return {name: {k: round(statistics.median(v), 2) for k, v in t.items()} for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--sparsity", type=float, default=0.5)
    args = ap.parse_args()
    corpus = jp.data.CharCorpus.load()
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2)
    cfg = GPTConfig(vocab_size=corpus.vocab_size, max_seq_len=args.seq)
    model = GPT(cfg)
    names = jax.eval_shape(model.init, jax.random.key(0))
    ramp = jp.pruning.polynomial_sparsity(args.sparsity, args.steps // 4, 3 * args.steps // 4, frequency=20)
    small_cfg = dataclasses.replace(cfg, num_heads=round(cfg.num_heads * (1 - args.sparsity)),
                                    d_mlp=round(cfg.mlp_dim * (1 - args.sparsity)), head_dim=cfg.head_dim)
    plans = [p for p in make_plans(nn.meta.unbox(names), names) if p is not None]
    prunable = sum(math.prod(p.shape) for p in plans)
    unstructured_sparsity = (cfg.num_params() - small_cfg.num_params()) / prunable

    out = {"model": {"num_layers": cfg.num_layers, "d_model": cfg.d_model, "num_heads": cfg.num_heads,
                     "d_mlp": cfg.mlp_dim, "steps": args.steps, "batch": [args.batch, args.seq],
                     "mesh": jp.describe(mesh), "jax": jax.__version__}}
    dense_tx = optimizer(args, names)
    dense = train(args, model, dense_tx, mesh, corpus)
    s_tx = optimizer(args, names, jp.pruning.structured_pruning(ramp, "uniform", axis_names=names))
    masked = train(args, model, s_tx, mesh, corpus)
    small_state, got_cfg = jp.pruning.compact_state(masked, cfg, s_tx, mesh=mesh)
    assert (got_cfg.num_heads, got_cfg.mlp_dim) == (small_cfg.num_heads, small_cfg.mlp_dim), got_cfg
    small = GPT(got_cfg)
    u_ramp = dataclasses.replace(ramp, final=unstructured_sparsity)
    u_tx = optimizer(args, names, jp.pruning.magnitude_pruning(u_ramp, "uniform", axis_names=names))
    unstructured = train(args, model, u_tx, mesh, corpus)
    report = jp.pruning.sparsity_report(unstructured.params, axis_names=names)

    nbytes = lambda s: sum(x.nbytes for x in jax.tree.leaves(s.params))
    out["val_loss"] = {"dense": val_loss(args, model, dense, mesh, corpus),
                       "structured (masked)": val_loss(args, model, masked, mesh, corpus),
                       "structured (compacted)": val_loss(args, small, small_state, mesh, corpus),
                       "unstructured": val_loss(args, model, unstructured, mesh, corpus)}
    out["params"] = {"dense": cfg.num_params(), "compacted": got_cfg.num_params(),
                     "unstructured_nonzero": report["all"]["size"] - report["all"]["zeros"],
                     "unstructured_kernel_sparsity": round(report["prunable"]["sparsity"], 4)}
    out["param_bytes"] = {"dense": nbytes(dense), "compacted": nbytes(small_state), "unstructured": nbytes(unstructured)}
    runs = {"dense": (model, dense_tx, dense), "compacted": (small, s_tx, small_state),
            "unstructured": (model, u_tx, unstructured)}
    one = jp.make_mesh(data=1, devices=jax.devices()[:1])
    for label, m in (("2x2x2", mesh), ("1 device", one)):
        t = step_times(args, runs, m, corpus)
        t["speedup (dense / compacted)"] = {k: round(t["dense"][k] / t["compacted"][k], 3) for k in t["dense"]}
        out[f"step_ms {label}"] = t
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
