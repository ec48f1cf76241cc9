"""Tokens/s of ``jp.data.grain_batches`` (tokenize on the fly, shuffle, pack, place) against the main job's step.

    python benchmarks/grain_data.py [--batch 32] [--seq 128] [--steps 10] [--batches 40] [--layers 4] [--d-model 128]

Prints one JSON object. The documents are the paragraphs of the main job's corpus (CPython's pydoc topics,
``jp.data.default_text``), tokenized per character in the pipeline's own ``.map`` (cut to ``seq + 1`` tokens for
first-fit packing, which never splits a document). Measured in one process, one after the other:

* ``grain_first_fit`` / ``grain_concat_then_split``: ``--batches`` global batches from ``grain_batches`` (placed on
  the device, ready), after 3 warm-up batches: row tokens/s, and ``fill`` (the fraction of real targets);
* ``main_job``: the main job's train step (``benchmarks/train_step.py``'s char GPT on one device, batch
  ``--batch`` x ``--seq``), median over ``--steps`` steps: training tokens/s;
* ``packed_step``: the same train step on a packed batch (segment ids, positions, loss mask), timed in
  alternation with ``main_job``;
* ``packed_training_fed_by_grain``: that step fed by ``grain_batches`` through ``jp.loop.run`` (``--steps`` steps; the
  loop builds batch ``t + 1`` while step ``t`` runs): ``fed_by_grain_over_packed_step`` near 1 means the
  pipeline is not the bottleneck.

``ratios``: each grain path's tokens/s over the main job's, and the packed step's over the plain step's.
The pipeline would run beside training and share the CPU with it; the ratio says how much faster than the
step the pipeline is on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxpar as jp  # noqa: E402
from jaxpar._optional import require  # noqa: E402
from jaxpar.models import GPT, GPTConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import build  # noqa: E402


class CharTokenizer:
    """Characters -> int32 ids of the corpus vocabulary (the pipeline's on-the-fly tokenization), cut to ``limit``."""

    def __init__(self, chars: str, limit: int | None):
        self.lookup, self.limit = {c: i for i, c in enumerate(chars)}, limit

    def __call__(self, text: str) -> np.ndarray:
        text = text if self.limit is None else text[:self.limit]
        return np.fromiter(map(self.lookup.__getitem__, text), np.int32, len(text))


def pipeline(corpus, args, packing: str, mesh):
    grain = require("grain", "benchmarks/grain_data.py", extra="data")
    paragraphs = [p for p in jp.data.default_text().split("\n\n") if len(p) >= 2]
    limit = args.seq + 1 if packing == "first_fit" else None
    docs = grain.MapDataset.source(paragraphs).map(CharTokenizer(corpus.chars, limit))
    return jp.data.grain_batches(docs, global_batch=args.batch, mesh=mesh, seed=0, seq_len=args.seq, packing=packing)


def time_pipeline(batches, n: int) -> tuple[float, float, dict]:
    """(seconds for ``n`` batches after 3 warm-up ones, the fraction of real targets, the last batch)."""
    for t in range(3):
        jax.block_until_ready(batches(t))
    fill, start = [], time.perf_counter()
    for t in range(3, 3 + n):
        batch = jax.block_until_ready(batches(t))
        fill.append(float(np.asarray(batch["loss_mask"]).mean()))
    return time.perf_counter() - start, float(np.mean(fill)), batch


def time_step(step, state, batch) -> tuple[object, float]:
    """(the new state, seconds of one step on ``batch``, until its metrics are ready)."""
    start = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    return state, time.perf_counter() - start


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    args = ap.parse_args(argv)
    corpus = jp.data.CharCorpus.load()
    mesh = jp.make_mesh(data=1, devices=jax.devices()[:1])
    tokens = args.batch * args.seq
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "batch": args.batch, "seq": args.seq,
           "results": {}}
    packed = None
    for packing in ("first_fit", "concat_then_split"):
        seconds, fill, packed = time_pipeline(pipeline(corpus, args, packing, mesh), args.batches)
        out["results"][f"grain_{packing}"] = {"ms_per_batch": 1e3 * seconds / args.batches,
                                              "tokens_per_s": tokens * args.batches / seconds, "fill": round(fill, 4)}
    runs = {"main_job": build(dict(data=1), {}, args.batch, args.seq, corpus,
                              model_args=dict(num_layers=args.layers, d_model=args.d_model))[:2]}
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, max_seq_len=args.seq, num_layers=args.layers,
                          d_model=args.d_model))
    tx = optax.adamw(1e-3)
    packed_step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
    packed_state, m = packed_step(jp.train.init_state(model.init, tx, 0, mesh=mesh), packed)   # compile
    runs["packed_step"] = [packed_state, packed_step]
    batch_fns = {"main_job": lambda t: corpus.batch(0, t + 1, args.batch, args.seq), "packed_step": lambda t: packed}
    times = {name: [] for name in runs}
    for t in range(args.steps):            # interleaved, so that background load affects both alike
        for name, run in runs.items():
            run[0], seconds = time_step(run[1], run[0], batch_fns[name](t))
            times[name].append(seconds)
    for name, ts in times.items():
        out["results"][name] = {"ms_per_step": 1e3 * statistics.median(ts),
                                "tokens_per_s": tokens / statistics.median(ts)}
    # the packed step fed by grain_batches through jp.loop.run (the next batch is built while a step runs)
    feed = pipeline(corpus, args, "first_fit", mesh)
    state = jp.loop.run(packed_step, runs["packed_step"][0], feed, 0, 1).state       # warm-up
    start = time.perf_counter()
    jax.block_until_ready(jp.loop.run(packed_step, state, feed, 1, 1 + args.steps).state)
    seconds = (time.perf_counter() - start) / args.steps
    out["results"]["packed_training_fed_by_grain"] = {"ms_per_step": 1e3 * seconds, "tokens_per_s": tokens / seconds}
    main_tps = out["results"]["main_job"]["tokens_per_s"]
    out["ratios"] = {f"grain_{p}_over_main_job": out["results"][f"grain_{p}"]["tokens_per_s"] / main_tps
                     for p in ("first_fit", "concat_then_split")}
    out["ratios"]["packed_step_over_main_job"] = out["results"]["packed_step"]["tokens_per_s"] / main_tps
    out["ratios"]["fed_by_grain_over_packed_step"] = (out["results"]["packed_training_fed_by_grain"]["tokens_per_s"]
                                                      / out["results"]["packed_step"]["tokens_per_s"])
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
