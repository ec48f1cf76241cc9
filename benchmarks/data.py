"""Data loading against training, side by side in one run: is the loader ever the bottleneck?

    python benchmarks/data.py [--tokens DIR] [--batch 32] [--seq 1024] [--calls 100] [--steps 20]

Prints one JSON object:

* ``token_file``: ``jp.data.TokenFile.batch`` (random windows, one process) at ``--batch x --seq`` (32 x 1024):
  median ms per call over ``--calls`` steps, tokens/s, and the same for ``order="epoch"``;
* ``main_job``: the main job's train step (experiments/charlm.py's GPT, 4 layers, d_model 128, batch 32 x 128, on
  data=2 x fsdp=2 x tensor=2) run through ``jp.loop.run`` for ``--steps`` steps on batches of the same token
  file: ms per step, training tokens/s, and the loop's data time (the ``batch_fn`` calls, timed inside the loop)
  per step and as a fraction of the step time;
* ``token_file_over_training``: TokenFile tokens/s over the main job's training tokens/s (the issue asks >= 20);

``--tokens`` is a token directory from experiments/prepare_tokens.py; by default CPython's ``pydoc_data.topics``
text is prepared into a temporary one (byte-level BPE, 1024 ids). Machines here are noisy: the ratios within one
run are what counts. The grain path with packing has its own script, ``benchmarks/grain_data.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import jaxpar as jp  # noqa: E402
from jaxpar.data import prepare as tokens  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import build  # noqa: E402

MAIN_JOB = dict(sizes=dict(data=2, fsdp=2, tensor=2), batch=32, seq=128, model=dict(num_layers=4, d_model=128))
TINY_JOB = dict(sizes=dict(data=2, fsdp=2, tensor=2), batch=8, seq=16, model=dict(num_layers=1, d_model=32,
                                                                                   num_heads=2))


def prepare_default(out: Path, vocab: int = 1024) -> Path:
    """CPython's pydoc topics text as a token directory (byte-level BPE of ``vocab`` ids) in ``out``."""
    text = out / "pydoc.txt"
    text.write_text(jp.data.default_text())
    tokens.prepare([text], out / "tokens", train_bpe_vocab=vocab, workers=1, progress=False)
    return out / "tokens"


def time_batches(file: jp.data.TokenFile, batch: int, seq: int, calls: int, order: str) -> dict:
    """Median ms of ``file.batch`` over ``calls`` consecutive steps, and tokens/s."""
    times = []
    for t in range(calls):
        start = time.perf_counter()
        file.batch(0, t, batch, seq, order=order)
        times.append(time.perf_counter() - start)
    ms = 1e3 * statistics.median(times)
    return {"batch": batch, "seq": seq, "calls": calls, "ms_per_batch": ms, "tokens_per_s": batch * seq / ms * 1e3}


def time_main_job(corpus: jp.data.TokenCorpus, job: dict, steps: int) -> dict:
    """The main job's step through ``jp.loop.run`` for ``steps`` steps after a compile step: wall time per step and
    the time its ``batch_fn`` (TokenFile batches) took, measured inside the loop."""
    state, step, _ = build(job["sizes"], {}, job["batch"], job["seq"], corpus, model_args=job["model"])
    data_s = []

    def batch_fn(t):
        start = time.perf_counter()
        batch = corpus.batch(0, t, job["batch"], job["seq"])
        data_s.append(time.perf_counter() - start)
        return batch

    start = time.perf_counter()
    result = jp.loop.run(step, state, batch_fn, 1, 1 + steps)
    jax.block_until_ready(result.state)
    step_s = (time.perf_counter() - start) / steps
    data = sum(data_s) / steps
    return {"mesh": job["sizes"], "batch": job["batch"], "seq": job["seq"], "model": job["model"], "steps": steps,
            "ms_per_step": 1e3 * step_s, "training_tokens_per_s": job["batch"] * job["seq"] / step_s,
            "data_ms_per_step": 1e3 * data, "data_fraction_of_step": data / step_s}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=None, help="a token directory (default: pydoc topics, BPE 1024)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a 1-layer model at batch 8 x 16 (smoke test)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.tokens) if args.tokens else prepare_default(Path(tmp))
        corpus = jp.data.TokenCorpus(directory)
        out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "tokens": str(args.tokens or "pydoc"),
               "train_tokens": len(corpus.train),
               "token_file": {order: time_batches(corpus.train, args.batch, args.seq, args.calls, order)
                              for order in ("random", "epoch")},
               "main_job": time_main_job(corpus, TINY_JOB if args.tiny else MAIN_JOB, args.steps)}
    out["token_file_over_training"] = (out["token_file"]["random"]["tokens_per_s"]
                                       / out["main_job"]["training_tokens_per_s"])
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
