"""Step time of the char-GPT train step under several layouts and model options, side by side in one run.

    python benchmarks/train_step.py [--steps 20] [--batch 32] [--seq 128]

Prints one JSON object: per configuration the median ms/step over ``--steps`` timed steps (after one
compile step), tokens/s, and the ratio to the first configuration. Machines here are noisy: compare the
ratios within one run, not absolute times across runs. Configurations are interleaved in rounds so that
background load affects them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import optax  # noqa: E402

import jaxpar as jp  # noqa: E402
from jaxpar.models import GPT, GPTConfig  # noqa: E402

CONFIGS = {
    "1 device": (dict(data=1), {}),
    "data=8": (dict(data=8), {}),
    "fsdp=8": (dict(data=1, fsdp=8), {}),
    "data=2 fsdp=2 tensor=2": (dict(data=2, fsdp=2, tensor=2), {}),
    "2x2x2 scan_layers": (dict(data=2, fsdp=2, tensor=2), dict(scan_layers=True)),
    "2x2x2 remat=full": (dict(data=2, fsdp=2, tensor=2), dict(remat="full")),
}


def build(sizes, options, batch, seq, corpus):
    devices = jax.devices()[: sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("tensor", 1)]
    mesh = jp.make_mesh(**sizes, devices=devices)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, max_seq_len=seq, **options))
    tx = optax.adamw(1e-3)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
    state, m = step(state, corpus.batch(0, 0, batch, seq))
    jax.block_until_ready(m)
    return [state, step]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    corpus = jp.data.CharCorpus.load()
    runs = {name: build(sizes, opts, args.batch, args.seq, corpus) for name, (sizes, opts) in CONFIGS.items()}
    times = {name: [] for name in runs}
    for t in range(args.steps):
        for name, run in runs.items():
            batch = corpus.batch(0, t + 1, args.batch, args.seq)
            start = time.perf_counter()
            run[0], m = run[1](run[0], batch)
            jax.block_until_ready(m)
            times[name].append(time.perf_counter() - start)
    first = statistics.median(times[next(iter(times))])
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "batch": args.batch, "seq": args.seq,
           "results": {name: {"ms_per_step": 1e3 * statistics.median(ts),
                              "tokens_per_s": args.batch * args.seq / statistics.median(ts),
                              "ratio_to_first": statistics.median(ts) / first} for name, ts in times.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
