"""Step time of the char-GPT train step under several layouts and model options, side by side in one run.

    python benchmarks/train_step.py [--steps 20] [--batch 32] [--seq 128] [--configs NAME ...]
                                    [--compare-module OLD_GPT.py]

Prints one JSON object: per configuration the median ms/step over ``--steps`` timed steps (after one
compile step), tokens/s, the ratio to the first configuration, and the validation loss (4 fixed batches)
after those ``--steps + 1`` training steps (``optax.adamw(1e-3)``, the same batches for every configuration).
Machines here are noisy: compare the ratios within one run, not absolute times across runs. Configurations
are interleaved in rounds so that background load affects them alike.

``--compare-module PATH`` loads another version of ``jaxpar/models/gpt.py`` (e.g. a copy saved before a
change) and adds a ``before: <name>`` row for every configuration, built from that module's ``GPT`` and
``GPTConfig``: the same step, layouts and batches, side by side with the current model.
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
import optax  # noqa: E402

import jaxpar as jp  # noqa: E402
from jaxpar.models import GPT, GPTConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_module import load_model_module  # noqa: E402

CONFIGS = {
    "1 device": (dict(data=1), {}),
    "data=8": (dict(data=8), {}),
    "fsdp=8": (dict(data=1, fsdp=8), {}),
    "data=2 fsdp=2 tensor=2": (dict(data=2, fsdp=2, tensor=2), {}),
    "2x2x2 scan_layers": (dict(data=2, fsdp=2, tensor=2), dict(scan_layers=True)),
    "2x2x2 remat=full": (dict(data=2, fsdp=2, tensor=2), dict(remat="full")),
}


def build(sizes, options, batch, seq, corpus, module=None, model_args=None):
    devices = jax.devices()[: sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("tensor", 1)]
    mesh = jp.make_mesh(**sizes, devices=devices)
    gpt, config = (GPT, GPTConfig) if module is None else (module.GPT, module.GPTConfig)
    model = gpt(config(vocab_size=corpus.vocab_size, max_seq_len=seq, **(model_args or {}), **options))
    tx = optax.adamw(1e-3)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
    state, m = step(state, corpus.batch(0, 0, batch, seq))
    jax.block_until_ready(m)
    return [state, step, jp.train.make_eval_step(model.loss, mesh=mesh)]


def val_loss(run, corpus, batch, seq, batches=4) -> float:
    """Mean loss of the trained state over ``batches`` fixed validation batches."""
    return sum(float(run[2](run[0], corpus.batch(1, i, batch, seq, split="val"))["loss"])
               for i in range(batches)) / batches


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--compare-module", default=None, help="a gpt.py file to run beside the current model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    args = ap.parse_args(argv)
    corpus = jp.data.CharCorpus.load()
    model_args = dict(num_layers=args.layers, d_model=args.d_model)
    runs = {}
    old = load_model_module(args.compare_module) if args.compare_module else None
    for name in args.configs:
        sizes, opts = CONFIGS[name]
        runs[name] = build(sizes, opts, args.batch, args.seq, corpus, model_args=model_args)
        if old is not None:
            runs[f"before: {name}"] = build(sizes, opts, args.batch, args.seq, corpus, old, model_args)
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
    for name in out["results"]:
        out["results"][name]["val_loss_after_steps"] = round(val_loss(runs[name], corpus, args.batch, args.seq), 5)
    if old is not None:
        out["after_over_before_ms_per_step"] = {
            name: statistics.median([a / b for a, b in zip(times[name], times[f"before: {name}"])])
            for name in args.configs}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
