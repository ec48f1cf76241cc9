"""Tokens/s of ``jp.data.grain_batches`` (tokenize on the fly, shuffle, pack, place) against the main job's step.

    python benchmarks/grain_data.py [--batch 32] [--seq 128] [--steps 10] [--batches 40] [--layers 4] [--d-model 128]

Prints one JSON object. The documents are the paragraphs of the main job's corpus (CPython's pydoc topics,
``jp.data.default_text``), tokenized per character in the pipeline's own ``.map`` (cut to ``seq + 1`` tokens for
first-fit packing, which never splits a document). Measured in one process, one after the other:

* ``main_job``: the main job's train step (``benchmarks/train_step.py``'s char GPT on one device, batch
  ``--batch`` x ``--seq``), median over ``--steps`` steps: training tokens/s;
* ``grain_first_fit`` / ``grain_concat_then_split``: ``--batches`` global batches from ``grain_batches`` (placed on
  the device, ready), after 3 warm-up batches: row tokens/s, and ``fill`` (the fraction of real targets);
* ``packed_step``: the same train step on packed batches (segment ids, positions, loss mask), tokens/s.

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


def time_steps(step, state, batch_fn, n: int) -> list[float]:
    times = []
    for t in range(n):
        batch = batch_fn(t)
        start = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - start)
    return times


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
    state, step, _ = build(dict(data=1), {}, args.batch, args.seq, corpus,
                           model_args=dict(num_layers=args.layers, d_model=args.d_model))
    main_s = statistics.median(time_steps(step, state, lambda t: corpus.batch(0, t + 1, args.batch, args.seq),
                                          args.steps))
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "batch": args.batch, "seq": args.seq,
           "results": {"main_job": {"ms_per_step": 1e3 * main_s, "tokens_per_s": tokens / main_s}}}
    packed = None
    for packing in ("first_fit", "concat_then_split"):
        seconds, fill, packed = time_pipeline(pipeline(corpus, args, packing, mesh), args.batches)
        out["results"][f"grain_{packing}"] = {"ms_per_batch": 1e3 * seconds / args.batches,
                                              "tokens_per_s": tokens * args.batches / seconds, "fill": round(fill, 4)}
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, max_seq_len=args.seq, num_layers=args.layers,
                          d_model=args.d_model))
    tx = optax.adamw(1e-3)
    packed_step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
    packed_state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    packed_state, m = packed_step(packed_state, packed)   # compile
    packed_s = statistics.median(time_steps(packed_step, packed_state, lambda t: packed, args.steps))
    out["results"]["packed_step"] = {"ms_per_step": 1e3 * packed_s, "tokens_per_s": tokens / packed_s}
    main_tps = out["results"]["main_job"]["tokens_per_s"]
    out["ratios"] = {f"grain_{p}_over_main_job": out["results"][f"grain_{p}"]["tokens_per_s"] / main_tps
                     for p in ("first_fit", "concat_then_split")}
    out["ratios"]["packed_step_over_main_job"] = out["results"]["packed_step"]["tokens_per_s"] / main_tps
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
