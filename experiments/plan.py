"""Sweep GPU layouts of a GPT train step on simulated CPU devices: a ranked table, a plot and JSON.

Command::

    python experiments/plan.py --model 7b --devices 64 --global-batch 256 --out-dir runs/plan7b
    python experiments/plan.py --model 1b --devices 8 --global-batch 16 --remat full none

Every ``data x fsdp x tensor x pipe`` multiplying to ``--devices`` (``tensor`` dividing ``--gpus-per-host``;
``pipe`` only when ``--schedules`` are given), times every ``--remat`` choice and schedule, is compiled by
``jp.plan.plan`` (one process: jax starts with ``--devices`` simulated CPU devices). Prints the table ranked by
the roofline step time, layouts that do not fit last; writes ``plan.json`` and ``plan.png`` (memory and
estimated step time per layout) to ``--out-dir``. Expected: a few seconds per layout on a 2-core CPU (65B on
1,024 devices: about 8 s); figures are XLA:CPU compilations (see ``jaxpar.plan``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
from pathlib import Path

MODELS = {   # GPT sizes (GELU MLP 4 d, rotary positions, 32k vocabulary)
    "1b": dict(d_model=2048, num_layers=24, num_heads=16),
    "7b": dict(d_model=4096, num_layers=32, num_heads=32),
    "65b": dict(d_model=8192, num_layers=80, num_heads=64),
}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=list(MODELS) + ["tiny"], default="1b")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--remat", nargs="+", default=["full"], choices=["none", "full", "dots"])
    ap.add_argument("--schedules", nargs="*", default=[], choices=["gpipe", "1f1b"],
                    help="pipeline schedules for layouts with pipe > 1 (none: pipe stays 1)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--device", default="h100-80gb")
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument("--max-layouts", type=int, default=12, help="plan at most this many layouts")
    ap.add_argument("--out-dir", default="runs/plan")
    return ap.parse_args(argv)


def layouts(n: int, gpus_per_host: int, pipes: bool):
    """Mesh sizes multiplying to ``n``, tensor dividing ``gpus_per_host``, fewest tensor/pipe first."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    out = []
    for t, p in itertools.product(divisors, divisors if pipes else [1]):
        if gpus_per_host % t or n % (t * p):
            continue
        for f in divisors:
            if (n // (t * p)) % f == 0:
                out.append(dict(data=n // (t * p * f), pipe=p, fsdp=f, tensor=t))
    return out


def candidates(args, jp, GPTConfig):
    import jax.numpy as jnp
    base = MODELS.get(args.model, dict(d_model=64, num_layers=4, num_heads=4))
    vocab = 32000 if args.model != "tiny" else 61
    for sizes in layouts(args.devices, args.gpus_per_host, bool(args.schedules)):
        for remat in args.remat:
            cfg = GPTConfig(vocab_size=vocab, max_seq_len=args.seq_len, positions="rotary", scan_layers=True,
                            remat=remat, dtype=jnp.bfloat16, **base)
            scheds = [None] if sizes["pipe"] == 1 else [
                {"gpipe": jp.pipeline.gpipe, "1f1b": jp.pipeline.one_f_one_b}[s](sizes["pipe"], args.microbatches)
                for s in args.schedules]
            for sched in scheds:
                try:
                    jp.plan.check_layout(cfg, sizes, args.global_batch, args.seq_len, sched, 1, args.gpus_per_host)
                except ValueError:
                    continue
                yield cfg, sizes, sched


def rank(plans):
    return sorted(plans, key=lambda p: (not p.fits, p.time["step_s"]))


def table(plans) -> str:
    head = f"{'rank':>4} {'data':>4} {'pipe':>4} {'fsdp':>4} {'tens':>4} {'remat':>5} {'sched':>8} {'GiB/dev':>8} " \
           f"{'fits':>4} {'step ms':>9} {'MFU':>6}"
    rows = [head]
    for i, p in enumerate(plans, 1):
        m = p.mesh
        rows.append(f"{i:>4} {m['data']:>4} {m['pipe']:>4} {m['fsdp']:>4} {m['tensor']:>4} {p.model['remat']:>5} "
                    f"{p.schedule or '-':>8} {p.needed_bytes / 2**30:>8.2f} {'yes' if p.fits else 'no':>4} "
                    f"{p.time['step_s'] * 1e3:>9.1f} {p.time['mfu']:>6.1%}")
    return "\n".join(rows)


def plot(plans, path):
    from jaxpar.plot import _figure  # matplotlib, imported only here
    fig, ax = _figure((max(6, len(plans) * 0.7), 4))
    names = [f"d{p.mesh['data']}p{p.mesh['pipe']}f{p.mesh['fsdp']}t{p.mesh['tensor']} {p.model['remat']}" for p in plans]
    x = range(len(plans))
    ax.bar(x, [p.needed_bytes / 2**30 for p in plans], color=["C0" if p.fits else "C3" for p in plans])
    ax.axhline(plans[0].available_bytes / 2**30, color="k", ls="--", lw=1, label="available")
    ax.set_ylabel("compiled GiB / device (XLA:CPU)")
    ax.set_xticks(list(x), names, rotation=60, ha="right", fontsize=7)
    ax2 = ax.twinx()
    ax2.plot(list(x), [p.time["step_s"] * 1e3 for p in plans], "o-", color="C1")
    ax2.set_ylabel("estimated step time (ms)", color="C1")
    ax.set_title("layouts ranked by estimated step time (red: does not fit)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> list:
    args = parse(argv)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={args.devices}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "jax" in sys.modules and len(sys.modules["jax"].devices("cpu")) < args.devices:
        print(f"note: jax is already running with fewer than {args.devices} CPU devices; each plan runs in a "
              "subprocess", flush=True)
    import jaxpar as jp
    from jaxpar.models import GPTConfig
    plans = []
    for cfg, sizes, sched in itertools.islice(candidates(args, jp, GPTConfig), args.max_layouts):
        p = jp.plan.plan(cfg, sizes, global_batch=args.global_batch, seq_len=args.seq_len, schedule=sched,
                         device=args.device, num_devices=args.devices, gpus_per_host=args.gpus_per_host)
        print(p.report(), flush=True)
        plans.append(p)
    plans = rank(plans)
    print(table(plans))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps([p.to_dict() for p in plans], indent=1, default=str))
    if plans:
        print(f"wrote {out / 'plan.json'} and {plot(plans, out / 'plan.png')}")
    return plans


if __name__ == "__main__":
    main()
