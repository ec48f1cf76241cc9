"""jaxpar's train step against the same model in PyTorch (eager and ``torch.compile``), one device.

    python benchmarks/vs_pytorch.py [--model gpt|llama|qwen3|gemma3] [--rounds 7] [--steps-per-round 5]
                                    [--batch 32] [--seq 128]

Needs torch (``pip install '.[bench]'``; the transformers families also transformers). ``--model gpt`` (the
default): the model is the main job's (``experiments/charlm.py`` defaults:
4 layers, d=128, 4 heads, the 103-character vocabulary padded to 128, learned positions, tied embeddings,
pre-LN, GELU tanh, float32), the optimizer ``jp.optim.adamw`` (global-norm clipping 1.0, AdamW b2=0.95 with
weight decay 0.1 on the weight matrices, warm-up + cosine) and its PyTorch transcription
(``benchmarks/torch_gpt.py``, ``torch.optim.AdamW`` with its defaults otherwise). Both models start from the
same weights (jaxpar's init copied into torch) and see the same batches, so the losses of the first steps are
printed side by side as a check that they compute the same thing.

``--model llama|qwen3|gemma3``: transformers' own ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` /
``Gemma3ForCausalLM`` (``torch_hf.py``: ``attn_implementation="sdpa"``, float32) built at the same scale (4
layers, d=128, 4 query heads, ``--kv-heads`` 2, MLP width ``--d-mlp`` 384, vocabulary 103; the Llama untied,
Qwen3 and Gemma 3 tied, Gemma 3's layers alternating a ``--window`` 64 sliding window and global attention)
with transformers' random init, saved, and read by ``jaxpar.models.hf.load`` (so jaxpar trains the model the
checkpoint mapping gives), the same optimizer recipe (decay on the blocks' weight matrices).

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

(XLA:CPU's thunk executor still runs independent operations on a second thread with that flag: pin the process to
one core, ``taskset -c 0``, for a one-thread comparison.) The process first calls
``jp.tools.cpu.reuse_host_memory()`` (``--no-reuse-host-memory`` skips it), as a CPU training run should: glibc then
reuses XLA:CPU's per-step temporary buffer instead of mapping and faulting it in afresh each step (a third of
jaxpar's step time without it, ``benchmarks/README.md``); the setting is the process's, so PyTorch runs under it too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxpar as jp  # noqa: E402
import torch_gpt  # noqa: E402
import torch_hf  # noqa: E402
from model_module import load_model_module  # noqa: E402
from jaxpar.models import GPT, GPTConfig, hf  # noqa: E402

TOTAL_STEPS, WARMUP = 1000, 10   # the schedule's length (only its shape matters here)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


HF_FAMILIES = ("llama", "qwen3", "gemma3")


def make_model(args, corpus, module=None):
    """``(model, init_fn)``: the GPT (of ``module``, another ``gpt.py``, when given) and its ``init``; or, for
    ``--model llama|qwen3|gemma3``, the model ``jaxpar.models.hf.load`` reads from the transformers checkpoint
    in ``args.checkpoint`` and an init returning its loaded params with their logical names."""
    if args.model in HF_FAMILIES:
        model, params = hf.load(args.checkpoint, **jaxpar_overrides(args))
        named = hf.with_names(model, params)
        return model, lambda rng: named
    shared = dict(vocab_size=corpus.vocab_size, num_layers=args.layers, num_heads=args.heads,
                  d_model=args.d_model, max_seq_len=args.seq)
    gpt, config = (module.GPT, module.GPTConfig) if module else (GPT, GPTConfig)
    model = gpt(config(**shared))
    return model, model.init


def jaxpar_overrides(args) -> dict:
    """Config fields set on the loaded model (``--attention-blocks``), none by default."""
    return {} if args.attention_blocks is None else {"attention_blocks": args.attention_blocks}


def build_jaxpar(model, init_fn, lr: float):
    """``(run(batches) -> last loss, state params at init (host numpy), param count)`` of jaxpar on one device."""
    mesh = jp.make_mesh(data=1, devices=jax.devices()[:1])
    names = jax.eval_shape(init_fn, jax.random.key(0))
    tx = jp.optim.adamw(lr, total_steps=TOTAL_STEPS, warmup_steps=WARMUP, axis_names=names)
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    init_params = jax.tree.map(np.asarray, state.params)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
    holder = [state]

    def run(batches):
        for b in batches:
            holder[0], metrics = step(holder[0], b)
        return float(metrics["loss"])

    return run, init_params, sum(x.size for x in jax.tree.leaves(init_params))


def build_torch(args, model, init_params, lr: float, compile_: bool):
    torch = torch_gpt.torch_module()
    if args.model in HF_FAMILIES:
        module, hf_model = torch_hf.build(args.model, args.checkpoint)
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


def hf_sizes(args, vocab: int) -> dict:
    """The transformers config's sizes (:func:`torch_hf.hf_config`) from the command line."""
    return dict(vocab=vocab, layers=args.layers, d_model=args.d_model, heads=args.heads, kv_heads=args.kv_heads,
                d_mlp=args.d_mlp, head_dim=args.head_dim or args.d_model // args.heads, seq=args.seq,
                window=args.window)


def cpu_model() -> str:
    """The CPU's ``model name`` from ``/proc/cpuinfo`` (Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def threads() -> dict:
    """The thread counts each side runs with: cores this process may use, torch's intra- and inter-op pools,
    and XLA:CPU's (its Eigen pool covers the cores unless ``XLA_FLAGS`` says otherwise)."""
    torch = torch_gpt.torch_module()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    eigen_off = "--xla_cpu_multi_thread_eigen=false" in os.environ.get("XLA_FLAGS", "")
    return {"cores_usable": usable, "torch_intra_op": torch.get_num_threads(),
            "torch_inter_op": torch.get_num_interop_threads(), "xla_cpu_pool": 1 if eigen_off else usable,
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS")}


def as_torch(batch):
    torch = torch_gpt.torch_module()
    return {k: torch.from_numpy(np.asarray(v, np.int64)) for k, v in batch.items()}


def _median_min_max(xs):
    return statistics.median(xs), min(xs), max(xs)


def measure(args) -> dict:
    if args.model_module and args.model != "gpt":
        raise ValueError("--model-module replaces jaxpar/models/gpt.py: use it with --model gpt")
    if args.model in HF_FAMILIES and args.checkpoint is None:
        with tempfile.TemporaryDirectory() as d:
            return measure(argparse.Namespace(**{**vars(args), "checkpoint": d}))
    torch = torch_gpt.torch_module()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    corpus = jp.data.CharCorpus.load()
    if args.model in HF_FAMILIES:
        torch_hf.save_random(args.model, args.checkpoint, **hf_sizes(args, corpus.vocab_size))
    model, init_fn = make_model(args, corpus, load_model_module(args.model_module) if args.model_module else None)
    first = args.check_steps + args.warmup_steps
    batches = [corpus.batch(0, t, args.batch, args.seq) for t in range(first + args.rounds * args.steps_per_round)]
    jax_run, init_params, jax_count = build_jaxpar(model, init_fn, args.lr)
    impls = {"jaxpar": jax_run}
    c = model.cfg   # HF's checkpoint drops jaxpar's vocabulary padding rows (the table's, and an untied head's)
    padding = ((c.padded_vocab - c.vocab_size) * c.d_model * (1 if c.tie_embeddings else 2)
               if args.model in HF_FAMILIES else 0)
    counts = {"jaxpar": jax_count - padding}
    for name, comp in (("torch_eager", False), ("torch_compile", True)):
        if comp and args.no_compile:
            continue
        impls[name], counts[name] = build_torch(args, model, init_params, args.lr, comp)
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
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "jaxpar_overrides": jaxpar_overrides(args),
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
    hf_model = args.model in HF_FAMILIES
    return {"cpu_model": cpu_model(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "threads": threads(), "jax": jax.__version__, "torch": torch.__version__,
            "transformers": _version("transformers") if hf_model else None, "torch_threads": torch.get_num_threads(),
            "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
            "model": {"name": args.model, "num_layers": cfg.num_layers, "d_model": cfg.d_model,
                      "num_heads": cfg.num_heads, **({"num_kv_heads": cfg.num_kv_heads, "d_mlp": cfg.d_mlp,
                                                      "head_dim": cfg.head_dim, "tied": cfg.tie_embeddings,
                                                      "windows": list(getattr(cfg, "windows", ()))}
                                                     if hf_model else {}),
                      "vocab": f"{cfg.vocab_size} padded to {cfg.padded_vocab}", "seq": args.seq},
            "param_counts": counts, **({"param_counts_note": "jaxpar's without its vocabulary padding rows"}
                                       if hf_model else {}), "batch": args.batch, "seq": args.seq, "rounds": args.rounds,
            "steps_per_round": args.steps_per_round, "results": results, "tokens_per_s_ratios": ratios}


def _version(package: str) -> str:
    import importlib.metadata
    return importlib.metadata.version(package)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model, data and size options (shared with ``ab.py``)."""
    ap.add_argument("--model", choices=["gpt", *HF_FAMILIES], default="gpt",
                    help="gpt: against the PyTorch GPT (torch_gpt.py); llama, qwen3, gemma3: against transformers' "
                         "own LlamaForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM (torch_hf.py)")
    ap.add_argument("--kv-heads", type=int, default=2, help="transformers families: key/value heads (divides --heads)")
    ap.add_argument("--d-mlp", type=int, default=384, help="transformers families: gated-MLP width")
    ap.add_argument("--head-dim", type=int, default=0,
                    help="qwen3, gemma3: head size (0: d_model / heads; the Llama always has that)")
    ap.add_argument("--window", type=int, default=64, help="gemma3: the local layers' sliding window")
    ap.add_argument("--checkpoint", default=None,
                    help="transformers families: directory for the random checkpoint (default: a temporary one)")
    ap.add_argument("--attention-blocks", type=int, default=None,
                    help="transformers families: jaxpar's attention_blocks (default: the config's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--check-steps", type=int, default=3, help="warm-up steps whose losses are compared")
    ap.add_argument("--warmup-steps", type=int, default=5, help="untimed steps after the checked ones")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--model-module", default=None,
                    help="another version of jaxpar/models/gpt.py to benchmark (e.g. a copy from before a change)")
    ap.add_argument("--no-reuse-host-memory", dest="reuse_host_memory", action="store_false",
                    help="skip jp.tools.cpu.reuse_host_memory() (glibc then maps and faults in XLA:CPU's temporary "
                         "buffer afresh every step; it applies to both sides, one process)")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu: this process's CPU time (robust to other load with one thread)")
    return ap.parse_args(argv)


def run_and_print(measure_fn, args) -> dict:
    """``measure_fn(args)`` after ``reuse_host_memory()`` (unless ``args.reuse_host_memory`` is false), its JSON
    printed and returned (shared with ``ab.py``)."""
    # before any device use: XLA:CPU's worker threads take their malloc arena at their first allocation
    host = jp.tools.cpu.reuse_host_memory() if args.reuse_host_memory else None
    out = measure_fn(args)
    out["reuse_host_memory"] = None if host is None else (host.settings or host.reason)
    print(json.dumps(out, indent=1))
    return out


def main(argv=None) -> dict:
    return run_and_print(measure, parse(argv))


if __name__ == "__main__":
    main()
