"""jaxpar's GPT or Llama train step against the same model in PyTorch (eager and ``torch.compile``), one device.

    python benchmarks/vs_pytorch.py [--model gpt|llama] [--rounds 7] [--steps-per-round 5] [--batch 32] [--seq 128]

Needs torch (``pip install '.[bench]'``; ``--model llama`` also transformers). ``--model gpt`` (the default): the
model is the main job's (``experiments/charlm.py`` defaults:
4 layers, d=128, 4 heads, the 103-character vocabulary padded to 128, learned positions, tied embeddings,
pre-LN, GELU tanh, float32), the optimizer ``jp.optim.adamw`` (global-norm clipping 1.0, AdamW b2=0.95 with
weight decay 0.1 on the weight matrices, warm-up + cosine) and its PyTorch transcription
(``benchmarks/torch_gpt.py``, ``torch.optim.AdamW`` with its defaults otherwise). Both models start from the
same weights (jaxpar's init copied into torch) and see the same batches, so the losses of the first steps are
printed side by side as a check that they compute the same thing.

``--model llama``: ``jaxpar.models.Llama`` at the same scale (4 layers, d=128, 4 query heads, ``--kv-heads`` 2
key/value heads, SwiGLU width 384, untied embeddings, rotary theta 10000) against Hugging Face ``transformers``'
``LlamaForCausalLM`` built from jaxpar's weights through ``jaxpar.models.hf.save`` (``torch_llama.py``,
``attn_implementation="sdpa"``, float32), the same optimizer recipe (decay on the blocks' weight matrices).

Timing: after warm-up (``--check-steps`` + ``--warmup-steps`` untimed steps: compilation, and torch's first
CPU steps, which are slow), ``--rounds`` rounds; in each round every implementation runs
``--steps-per-round`` steps on pre-built batches, in turn (interleaved, so background load hits them alike),
and its round time / steps is one sample. The JSON gives per implementation the median ms/step with min and
max over rounds, tokens/s (batch * seq / median), and ratios of tokens/s to PyTorch eager and to
``torch.compile`` (the median of per-round ratios, with min-max). PyTorch uses ``torch.set_num_threads`` =
the CPU count (``--threads``); XLA:CPU uses its own pool over all cores. jaxpar runs on one device
(``jax.devices()[0]``) whatever ``XLA_FLAGS`` says. The JSON records the 1-minute load average before and
after: on a machine shared with other work, wall-clock figures of multi-threaded runs mostly measure the
contention (PyTorch's OpenMP threads suffer most). For a load-robust comparison of the work each does, run
both on one thread and count CPU time::

    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false python benchmarks/vs_pytorch.py --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxpar as jp  # noqa: E402
import torch_gpt  # noqa: E402
from model_module import load_model_module  # noqa: E402
from jaxpar.models import GPT, GPTConfig, Llama, LlamaConfig  # noqa: E402

TOTAL_STEPS, WARMUP = 1000, 10   # the schedule's length (only its shape matters here)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def make_model(args, corpus, module=None):
    """The jaxpar model benchmarked: the GPT (of ``module``, another ``gpt.py``, when given) or the Llama."""
    shared = dict(vocab_size=corpus.vocab_size, num_layers=args.layers, num_heads=args.heads,
                  d_model=args.d_model, max_seq_len=args.seq)
    if args.model == "llama":
        return Llama(LlamaConfig(num_kv_heads=args.kv_heads, **shared))
    gpt, config = (module.GPT, module.GPTConfig) if module else (GPT, GPTConfig)
    return gpt(config(**shared))


def build_jaxpar(model, lr: float):
    """``(run(batches) -> last loss, state params at init (host numpy), param count)`` of jaxpar on one device."""
    mesh = jp.make_mesh(data=1, devices=jax.devices()[:1])
    names = jax.eval_shape(model.init, jax.random.key(0))
    tx = jp.optim.adamw(lr, total_steps=TOTAL_STEPS, warmup_steps=WARMUP, axis_names=names)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    init_params = jax.tree.map(np.asarray, state.params)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
    holder = [state]

    def run(batches):
        for b in batches:
            holder[0], metrics = step(holder[0], b)
        return float(metrics["loss"])

    return run, init_params, sum(x.size for x in jax.tree.leaves(init_params))


def build_torch(model, init_params, lr: float, compile_: bool):
    torch = torch_gpt.torch_module()
    if isinstance(model, Llama):
        import torch_llama
        module, hf_model = torch_llama.build(model, init_params)
        opt, sched = torch_gpt.make_optimizer(hf_model, lr, TOTAL_STEPS, WARMUP, decay_prefix="model.layers.")
        model = module
    else:
        model = torch_gpt.build(model.cfg)
        torch_gpt.load_jaxpar_params(model, init_params)
        opt, sched = torch_gpt.make_optimizer(model, lr, TOTAL_STEPS, WARMUP)
    count = torch_gpt.num_params(model)
    fwd = torch.compile(model) if compile_ else model

    def run(batches):
        for b in batches:
            loss = torch_gpt.train_step(fwd, opt, sched, b["inputs"], b["targets"])
        return float(loss.detach())

    return run, count


def as_torch(batch):
    torch = torch_gpt.torch_module()
    return {k: torch.from_numpy(np.asarray(v, np.int64)) for k, v in batch.items()}


def _median_min_max(xs):
    return statistics.median(xs), min(xs), max(xs)


def measure(args) -> dict:
    torch = torch_gpt.torch_module()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    corpus = jp.data.CharCorpus.load()
    if args.model_module and args.model == "llama":
        raise ValueError("--model-module replaces jaxpar/models/gpt.py: use it with --model gpt")
    model = make_model(args, corpus, load_model_module(args.model_module) if args.model_module else None)
    first = args.check_steps + args.warmup_steps
    batches = [corpus.batch(0, t, args.batch, args.seq) for t in range(first + args.rounds * args.steps_per_round)]
    jax_run, init_params, jax_count = build_jaxpar(model, args.lr)
    impls = {"jaxpar": jax_run}
    c = model.cfg   # HF's checkpoint drops jaxpar's vocabulary padding rows (the table's, and an untied head's)
    padding = (c.padded_vocab - c.vocab_size) * c.d_model * (1 if c.tie_embeddings else 2) if args.model == "llama" else 0
    counts = {"jaxpar": jax_count - padding}
    for name, comp in (("torch_eager", False), ("torch_compile", True)):
        if comp and args.no_compile:
            continue
        impls[name], counts[name] = build_torch(model, init_params, args.lr, comp)
    if len(set(counts.values())) != 1:
        raise RuntimeError(f"parameter counts differ: {counts}")
    # Warm-up doubles as the equivalence check: the first steps' losses from the same weights and batches.
    losses = {name: [] for name in impls}
    for t in range(args.check_steps):
        for name, run in impls.items():
            b = batches[t] if name == "jaxpar" else as_torch(batches[t])
            losses[name].append(run([b]))
    for name, run in impls.items():  # more warm-up: torch's first steps on CPU are slow (kernel selection)
        if first > args.check_steps:
            run(batches[args.check_steps:first] if name == "jaxpar" else
                [as_torch(b) for b in batches[args.check_steps:first]])
    samples = {name: [] for name in impls}
    for r in range(args.rounds):
        chunk = batches[first + r * args.steps_per_round: first + (r + 1) * args.steps_per_round]
        for name, run in impls.items():
            bs = chunk if name == "jaxpar" else [as_torch(b) for b in chunk]
            start = CLOCKS[args.clock]()
            run(bs)
            samples[name].append((CLOCKS[args.clock]() - start) / len(bs))
    return {**report(args, model.cfg, counts, losses, samples), "clock": args.clock,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "model_module": args.model_module or f"jaxpar.models.{args.model}",
            "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}


def report(args, cfg, counts, losses, samples) -> dict:
    torch = torch_gpt.torch_module()
    tokens = args.batch * args.seq
    results = {}
    for name, ts in samples.items():
        med, lo, hi = _median_min_max(ts)
        results[name] = {"ms_per_step": round(1e3 * med, 2), "ms_min_max": [round(1e3 * lo, 2), round(1e3 * hi, 2)],
                         "tokens_per_s": round(tokens / med), "first_losses": [round(x, 5) for x in losses[name]]}
    ratios = {}
    for ref in ("torch_eager", "torch_compile"):
        if ref in samples:
            per_round = [b / a for a, b in zip(samples["jaxpar"], samples[ref])]   # jaxpar tokens/s over ref's
            med, lo, hi = _median_min_max(per_round)
            ratios[f"jaxpar_over_{ref}"] = {"median": round(med, 3), "min_max": [round(lo, 3), round(hi, 3)]}
    return {"machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
            "model": {"name": args.model, "num_layers": cfg.num_layers, "d_model": cfg.d_model,
                      "num_heads": cfg.num_heads, **({"num_kv_heads": cfg.num_kv_heads, "d_mlp": cfg.d_mlp}
                                                     if args.model == "llama" else {}),
                      "vocab": f"{cfg.vocab_size} padded to {cfg.padded_vocab}", "seq": args.seq},
            "param_counts": counts, **({"param_counts_note": "jaxpar's without its vocabulary padding rows"}
                                       if args.model == "llama" else {}), "batch": args.batch, "seq": args.seq, "rounds": args.rounds,
            "steps_per_round": args.steps_per_round, "results": results, "tokens_per_s_ratios": ratios}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["gpt", "llama"], default="gpt",
                    help="gpt: against the PyTorch GPT (torch_gpt.py); llama: against transformers' LlamaForCausalLM")
    ap.add_argument("--kv-heads", type=int, default=2, help="--model llama: key/value heads (divides --heads)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--check-steps", type=int, default=3, help="warm-up steps whose losses are compared")
    ap.add_argument("--warmup-steps", type=int, default=5, help="untimed steps after the checked ones")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--model-module", default=None,
                    help="another version of jaxpar/models/gpt.py to benchmark (e.g. a copy from before a change)")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu: this process's CPU time (robust to other load with one thread)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    out = measure(parse(argv))
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
