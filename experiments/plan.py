"""Sweep GPU layouts of a GPT or Llama 3 train step (compiled for a GPU target or on simulated CPU devices).

Writes a ranked table, a plot and JSON.

Command::

    python experiments/plan.py --target h100 --hosts 8 --model llama3-8b
    python experiments/plan.py --model 7b --devices 64 --global-batch 256 --out-dir runs/plan7b
    python experiments/plan.py --model 1b --devices 16 --global-batch 64 --remat full none \\
        --schedules 1f1b interleaved zbv --microbatches 8
    python experiments/plan.py --target h100 --hosts 1 --model mixtral-8x7b --expert-parallel 8

A mixture of experts (``--model moe-tiny``, ``mixtral-8x7b``, ``qwen3-30b-a3b``) is planned with its experts folded
``--expert-parallel`` ways onto the batch axes; each plan's report adds its experts line
(:mod:`jaxpar.plan.experts`: all and active parameters, expert weights per device, the dispatch's bytes per step,
the experts' useful FLOPs and, on a GPU target, what ``ragged_dot`` compiled to), and its MFU counts the active
parameters.

``--target h100`` (``h200``, ``b200``, ``a100``; ``--device`` is an alias) compiles each chosen layout with XLA's
GPU compiler for ``--hosts`` x ``--gpus-per-host`` compile-only GPUs (``jp.plan.plan(..., target=)``: GPU memory,
collectives by dtype and async, fp8 GEMMs, attention kernel, a step time replayed from the GPU schedule) and
puts the same step's simulated-CPU memory beside it; it needs the jax CUDA plugin (``pip install
'jaxpar[gpu]'``). Without ``--target`` the layouts are compiled for simulated CPU devices only, their step
times from the H100 datasheet.

Every ``data x pipe x fsdp x tensor`` multiplying to ``--devices`` (``tensor`` dividing ``--gpus-per-host``;
``pipe > 1`` only with ``--schedules``), times every ``--remat`` choice and schedule, is checked by
``jp.plan.check_layout`` (layouts the model or batch cannot split, or schedules the pipeline cannot run, are
skipped and counted); each remaining one gets the analytic estimate ``jp.plan.estimate`` (no compilation);
the best ``--max-layouts`` of them by that estimate (fitting in memory first, then the shortest analytic step
time) are compiled by ``jp.plan.plan`` (one process: jax starts with ``--devices`` simulated CPU devices, in
hosts of ``--gpus-per-host``). Prints each plan, then the table ranked by the compiled roofline step time,
layouts that do not fit last, with their "does not fit: ..." advice; writes ``plan.json`` and ``plan.png``
(memory and estimated step time per layout) to ``--out-dir``. Expected: a few seconds per layout on a 2-core
CPU (65B on 1,024 devices: about 8 s); figures are XLA:CPU compilations (see ``jaxpar.plan``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

# GPT sizes (GELU MLP 4 d, rotary positions; tiny: a 61-symbol test model; 125m / 350m / 1.3b: benchmarks/gpu.py's,
# GPT-2's 50,257-token vocabulary) and Llama 3 (GQA with 8 key/value heads, SwiGLU, 128,256-token vocabulary,
# rope theta 500,000: Meta's Llama 3.1 8B / 70B configs).
MODELS = {
    "tiny": ("gpt", dict(d_model=64, num_layers=4, num_heads=4, vocab_size=61)),
    "125m": ("gpt", dict(d_model=768, num_layers=12, num_heads=12, vocab_size=50257)),
    "350m": ("gpt", dict(d_model=1024, num_layers=24, num_heads=16, vocab_size=50257)),
    "1.3b": ("gpt", dict(d_model=2048, num_layers=24, num_heads=16, vocab_size=50257)),
    "1b": ("gpt", dict(d_model=2048, num_layers=24, num_heads=16, vocab_size=32000)),
    "7b": ("gpt", dict(d_model=4096, num_layers=32, num_heads=32, vocab_size=32000)),
    "65b": ("gpt", dict(d_model=8192, num_layers=80, num_heads=64, vocab_size=32000)),
    "llama3-8b": ("llama", dict(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, d_mlp=14336,
                                vocab_size=128256, rope_theta=500000.0)),
    "llama3-70b": ("llama", dict(d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, d_mlp=28672,
                                 vocab_size=128256, rope_theta=500000.0)),
    # mixtures of experts (a Llama whose MLPs are routed SwiGLU experts, top-k, dropless): moe-tiny, a test
    # model; mixtral-8x7b (Mistral AI's config: 8 experts of width 14,336, top-2); qwen3-30b-a3b (Qwen's
    # Qwen3-30B-A3B sizes: 128 experts of width 768, top-8, head_dim 128; its q/k norms are the qwen3 family's)
    "moe-tiny": ("moe", dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_mlp=128, vocab_size=61,
                             experts=(8, 2, 32))),
    "mixtral-8x7b": ("moe", dict(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, d_mlp=14336,
                                 vocab_size=32000, rope_theta=1e6, experts=(8, 2, 14336))),
    "qwen3-30b-a3b": ("moe", dict(family="qwen3", d_model=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                                  head_dim=128, d_mlp=6144, vocab_size=151936, rope_theta=1e6,
                                  experts=(128, 8, 768))),
}


def model_config(name: str, seq_len: int, remat: str, dtype):
    """The config of ``MODELS[name]`` (scanned layers, bf16 compute) for sequences of ``seq_len``."""
    family, sizes = MODELS[name]
    if family == "moe":
        from jaxpar.layers.moe import MoEConfig
        from jaxpar.models.families import FamilyConfig
        from jaxpar.models.llama import LlamaConfig
        sizes = dict(sizes)
        E, k, width = sizes.pop("experts")
        moe = MoEConfig(num_experts=E, experts_per_token=k, expert_d_mlp=width)
        build = FamilyConfig if "family" in sizes else LlamaConfig
        return build(max_seq_len=seq_len, scan_layers=True, remat=remat, dtype=dtype, moe=moe, **sizes)
    if family == "llama":
        from jaxpar.models.llama import LlamaConfig
        return LlamaConfig(max_seq_len=seq_len, scan_layers=True, remat=remat, dtype=dtype, **sizes)
    from jaxpar.models import GPTConfig
    return GPTConfig(max_seq_len=seq_len, positions="rotary", scan_layers=True, remat=remat, dtype=dtype, **sizes)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="1b",
                    help="GPT size (tiny: test model; 125m, 350m, 1.3b, 1b, 7b, 65b), llama3-8b / llama3-70b, or a "
                         "mixture of experts: moe-tiny, mixtral-8x7b, qwen3-30b-a3b (sizes in MODELS)")
    ap.add_argument("--expert-parallel", type=int, default=1,
                    help="a mixture of experts' expert-parallel size: the experts folded onto the batch axes "
                         "(jp.sharding.expert_parallel_rules: fsdp, data or both); layouts it does not fold onto "
                         "are skipped; 1: every device holds every expert")
    ap.add_argument("--target", "--device", dest="target", default=None,
                    help="GPU target to compile for (h100, h200, b200, a100; old names h100-80gb, a100-80gb); "
                         "none: simulated CPU devices only, step times from the h100 datasheet")
    ap.add_argument("--hosts", type=int, default=None, help="hosts of the run: --devices is hosts x --gpus-per-host")
    ap.add_argument("--devices", type=int, default=None,
                    help="GPUs of the run (default: --hosts x --gpus-per-host, or 8)")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: 2 per device)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 8192 for llama3, "
                                                               "4096 for the mixtures of experts, else 2048)")
    ap.add_argument("--remat", nargs="+", default=["full"], choices=["none", "full", "dots"],
                    help="GPTConfig.remat choices to sweep: none, full (save each block's input), dots (save matmuls)")
    ap.add_argument("--schedules", nargs="*", default=[],
                    help="pipeline schedules (names of jp.pipeline.SCHEDULES, checked once jax has started) for "
                         "layouts with pipe > 1 (none: pipe stays 1); interleaved uses --chunks, zbv and dualpipev "
                         "2 chunks; a schedule the pipe size, microbatches or layers cannot run is "
                         "skipped for that layout")
    ap.add_argument("--max-context", type=int, default=8,
                    help="largest context-parallel size to sweep (the sequence split over devices inside a host; "
                         "1: no context parallelism)")
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches of a pipeline schedule")
    ap.add_argument("--chunks", type=int, default=2, help="virtual stages per device of --schedules interleaved")
    ap.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per node (NVLink domain)")
    ap.add_argument("--memory-fraction", type=float, default=0.9, help="part of GPU memory the run may use")
    ap.add_argument("--max-layouts", type=int, default=None,
                    help="compile at most this many layouts: the best by the analytic estimate (jp.plan.estimate, "
                         "no compilation): those that fit in memory by the analytic step time (compute with remat "
                         "and bubble, plus tensor/fsdp/data/pipe traffic over NVLink or InfiniBand), then those "
                         "that do not by the memory they need; default 12, with --target 3 (each a GPU and a CPU "
                         "compile)")
    ap.add_argument("--out-dir", default="runs/plan", help="where plan.json and plan.png go (the ranked table is printed)")
    args = ap.parse_args(argv)
    if args.hosts is not None and args.hosts < 1:
        ap.error(f"--hosts must be >= 1, got {args.hosts}")
    if args.devices is None:
        args.devices = args.hosts * args.gpus_per_host if args.hosts else 8
    elif args.hosts is not None and args.devices != args.hosts * args.gpus_per_host:
        ap.error(f"--devices {args.devices} is not --hosts {args.hosts} x --gpus-per-host {args.gpus_per_host}; "
                 "give one of them")
    args.global_batch = 2 * args.devices if args.global_batch is None else args.global_batch
    if args.seq_len is None:
        args.seq_len = {"llama": 8192, "moe": 4096}.get(MODELS[args.model][0], 2048)
    if args.max_layouts is None:
        args.max_layouts = 3 if args.target else 12
    if args.expert_parallel != 1 and MODELS[args.model][0] != "moe":
        ap.error(f"--expert-parallel {args.expert_parallel} needs a mixture of experts (--model moe-tiny, "
                 "mixtral-8x7b or qwen3-30b-a3b)")
    for flag in ("devices", "global_batch", "seq_len", "microbatches", "chunks", "gpus_per_host", "max_layouts",
                 "max_context", "expert_parallel"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.devices > args.gpus_per_host and args.devices % args.gpus_per_host:
        ap.error(f"--devices {args.devices} are not whole hosts of --gpus-per-host {args.gpus_per_host}; use a "
                 f"multiple of {args.gpus_per_host}")
    if not 0 < args.memory_fraction <= 1:
        ap.error(f"--memory-fraction must lie in (0, 1], got {args.memory_fraction}")
    return args, ap


def layouts(n: int, gpus_per_host: int, pipes: bool, max_context: int = 1) -> list[dict[str, int]]:
    """Mesh sizes multiplying to ``n``, tensor x context dividing ``gpus_per_host`` (both pass data inside every
    layer: NVLink), context at most ``max_context``."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    out = []
    for t, p, c in itertools.product(divisors, divisors if pipes else [1], divisors):
        if c > max_context or gpus_per_host % (t * c) or n % (t * p * c):
            continue
        for f in divisors:
            if (n // (t * p * c)) % f == 0:
                out.append(dict(data=n // (t * p * c * f), pipe=p, fsdp=f, context=c, tensor=t))
    return out


def schedule(jp, name: str, p: int, m: int, chunks: int):
    """The ``name`` schedule for ``p`` stages and ``m`` microbatches (ValueError where the builder refuses)."""
    return jp.pipeline.build(name, p, m, **({"num_chunks": chunks} if name == "interleaved" else {}))


def candidates(args, jp) -> tuple[list[tuple], dict[str, int]]:
    """``([(cfg, sizes, schedule)], {reason: layouts skipped})`` of every layout ``check_layout`` accepts."""
    import jax.numpy as jnp
    out, skipped = [], {}
    cfgs = {remat: model_config(args.model, args.seq_len, remat, jnp.bfloat16) for remat in args.remat}
    for sizes in layouts(args.devices, args.gpus_per_host, bool(args.schedules), args.max_context):
        for cfg in cfgs.values():
            for name in [None] if sizes["pipe"] == 1 else args.schedules:
                try:
                    sched = None if name is None else schedule(jp, name, sizes["pipe"], args.microbatches, args.chunks)
                    jp.plan.check_layout(cfg, sizes, args.global_batch, args.seq_len, sched, 1, args.gpus_per_host)
                    jp.plan.experts.check_experts(cfg, sizes, args.expert_parallel)
                except ValueError as e:
                    reason = str(e)
                    skipped[reason] = skipped.get(reason, 0) + 1
                    continue
                out.append((cfg, sizes, sched))
    return out, skipped


def prune(args, jp, cands: list[tuple]) -> list[tuple]:
    """The best ``--max-layouts`` candidates by ``jp.plan.estimate``: fitting ones by analytic step time, then the
    others by the memory they need."""
    scored = []
    for cfg, sizes, sched in cands:
        est = jp.plan.estimate(cfg, sizes, global_batch=args.global_batch, seq_len=args.seq_len, schedule=sched,
                               device=args.target or "h100", num_devices=args.devices, gpus_per_host=args.gpus_per_host,
                               memory_fraction=args.memory_fraction, expert_parallel=args.expert_parallel)
        # a layout that does not fit ranks by the memory it needs (the closest to fitting first)
        key = (False, est["time"]["step_s"]) if est["fits"] else (True, est["needed_bytes"])
        scored.append((key, (cfg, sizes, sched), est))
    scored.sort(key=lambda s: s[0])
    return [(*c, est) for _, c, est in scored[:args.max_layouts]]


def rank(plans):
    return sorted(plans, key=lambda p: (not p.fits, p.time["step_s"]))


def table(plans) -> str:
    """The ranked layouts; with a GPU target, ``GiB/dev`` is XLA:GPU's and ``CPU GiB`` the simulated-CPU figure."""
    head = (f"{'rank':>4} {'data':>4} {'pipe':>4} {'fsdp':>4} {'ctx':>4} {'tens':>4} {'remat':>5} {'sched':>11} {'est GiB':>8} "
            f"{'GiB/dev':>8} {'CPU GiB':>8} {'fits':>4} {'est ms':>9} {'step ms':>9} {'tok/s/GPU':>9} {'MFU':>6}")
    rows = [head]
    for i, p in enumerate(plans, 1):
        m, cpu = p.mesh, p.memory.get("cpu_compiled_bytes")
        tokens = p.time.get("tokens_per_s_per_gpu")
        rows.append(f"{i:>4} {m['data']:>4} {m['pipe']:>4} {m['fsdp']:>4} {m.get('context', 1):>4} {m['tensor']:>4} "
                    f"{p.model['remat']:>5} "
                    f"{p.schedule or '-':>11} {p.memory['analytic_bytes'] / 2**30:>8.3g} "
                    f"{p.needed_bytes / 2**30:>8.3g} {'-' if cpu is None else f'{cpu / 2**30:.3g}':>8} "
                    f"{'yes' if p.fits else 'no':>4} "
                    f"{p.analytic_time['step_s'] * 1e3:>9.3g} {p.time['step_s'] * 1e3:>9.4g} "
                    f"{'-' if tokens is None else f'{tokens:,.0f}':>9} {p.time['mfu']:>6.1%}")
    for i, p in enumerate(plans, 1):
        if not p.fits:
            rows.append(f"rank {i}: {p.advice}")
    return "\n".join(rows)


def plot(plans, path):
    from jaxpar.tools.plot import _figure  # matplotlib, imported only here
    fig, ax = _figure((max(6, len(plans) * 0.7), 4))
    names = [f"d{p.mesh['data']}p{p.mesh['pipe']}f{p.mesh['fsdp']}t{p.mesh['tensor']} {p.model['remat']}"
             + (f" {p.schedule}" if p.schedule else "") for p in plans]
    x = list(range(len(plans)))
    ax.bar(x, [p.needed_bytes / 2**30 for p in plans], color=["C0" if p.fits else "C3" for p in plans])
    ax.plot(x, [p.memory["analytic_bytes"] / 2**30 for p in plans], "k_", ms=14, label="analytic")
    available = plans[0].available_bytes / 2**30
    if max(p.needed_bytes for p in plans) / 2**30 > 0.1 * available:   # else the line would flatten the bars
        ax.axhline(available, color="k", ls="--", lw=1, label="available")
    compiler = "XLA:GPU" if plans[0].gpu else "XLA:CPU"
    ax.set_ylabel(f"compiled GiB / device ({compiler}; {available:.0f} available)")
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=7)
    ax.legend(fontsize=7, loc="upper left")
    ax2 = ax.twinx()
    ax2.plot(x, [p.time["step_s"] * 1e3 for p in plans], "o-", color="C1")
    ax2.set_ylabel("roofline step time (ms)", color="C1")
    ax.set_title("layouts ranked by roofline step time (red: does not fit)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> list:
    args, ap = parse(argv)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    from jaxpar.plan.planner import PLANNING_XLA_FLAGS   # imports no jax: the flags are read when jax starts
    os.environ["XLA_FLAGS"] = " ".join([*flags, *PLANNING_XLA_FLAGS,
                                        f"--xla_force_host_platform_device_count={args.devices}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.target is not None:   # compile what a jaxpar GPU run compiles: its overlap flags, read once at start
        from jaxpar.tools import gpu as gpu_defaults
        gpu_defaults.apply_gpu_defaults(platform="gpu")
    if "jax" in sys.modules and len(sys.modules["jax"].devices("cpu")) < args.devices:
        ap.error(f"jax is already running with fewer than {args.devices} CPU devices; run this script in a fresh "
                 "process")
    import jaxpar as jp
    unknown = [s for s in args.schedules if s not in jp.pipeline.SCHEDULES]
    if unknown:   # the registry needs jax, which starts only after the device count is set above
        ap.error(f"argument --schedules: invalid choice: {unknown[0]!r} (choose from "
                 f"{', '.join(map(repr, jp.pipeline.SCHEDULES))})")
    target = None
    if args.target is not None:
        from jaxpar.plan import targets
        if args.target.lower() not in targets.target_names():
            ap.error(f"--target: {args.target!r} is not a GPU target; use one of {targets.target_names()}")
        try:
            target = jp.plan.gpu_target(args.target, hosts=max(1, args.devices // args.gpus_per_host),
                                        gpus_per_host=min(args.devices, args.gpus_per_host))
        except (ImportError, RuntimeError) as e:
            ap.error(f"--target {args.target}: {e}")
    cands, skipped = candidates(args, jp)
    for reason, count in skipped.items():
        print(f"skipped {count} layout(s): {reason}")
    if not cands:
        ap.error(f"no layout of {args.devices} devices passes the checks (see the reasons above); change "
                 "--devices, --global-batch, --microbatches or --schedules")
    chosen = prune(args, jp, cands)
    print(f"compiling {len(chosen)} of {len(cands)} layouts (best by the analytic estimate: fitting first, then "
          "analytic step time)", flush=True)
    plans = []
    for cfg, sizes, sched, _ in chosen:
        try:
            p = jp.plan.plan(cfg, sizes, global_batch=args.global_batch, seq_len=args.seq_len, schedule=sched,
                             num_devices=args.devices, gpus_per_host=args.gpus_per_host,
                             memory_fraction=args.memory_fraction, target=target, compare_cpu=target is not None,
                             expert_parallel=args.expert_parallel)
        except Exception as e:  # noqa: BLE001  one layout's compiler failure must not end the sweep
            print(f"layout {sizes} remat={cfg.remat} schedule={getattr(sched, 'name', None)} failed to compile: "
                  f"{type(e).__name__}: {str(e)[:500]}", flush=True)
            continue
        print(p.report(), flush=True)
        plans.append(p)
    plans = rank(plans)
    print(table(plans))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps([p.to_dict() for p in plans], indent=1, default=str))
    if plans:
        try:
            print(f"wrote {out / 'plan.json'} and {plot(plans, out / 'plan.png')}")
        except ImportError as e:   # matplotlib is optional
            print(f"wrote {out / 'plan.json'}; plan.png skipped ({e})")
        best = plans[0]
        name = lambda p: (f"{' x '.join(f'{a}={s}' for a, s in p.mesh.items() if s > 1) or 'one device'}, "
                          f"remat={p.model['remat']}" + (f", schedule {p.schedule}" if p.schedule else ""))
        if best.fits:
            print(f"recommended: {name(best)}: step {best.time['step_s'] * 1e3:.4g} ms, MFU {best.time['mfu']:.1%}, "
                  f"{best.needed_bytes / 2**30:.3g} GiB/device")
        else:   # ranked fitting first: none fits, so no layout is recommended
            least = min(plans, key=lambda p: p.needed_bytes)
            print(f"no layout compiled fits on {args.devices} devices: the least memory is "
                  f"{least.needed_bytes / 2**30:.3g} GiB/device ({name(least)}); add devices (--devices), or shorten "
                  "--seq-len / --global-batch")
    return plans


if __name__ == "__main__":
    main()
