"""Predicted against published: the GPU planner's step time (XLA:GPU compile for compile-only H100s, the
scheduled program replayed by ``jaxpar.plan.step_time``) on the configurations public training reports give,
and the planner's table for GPT 125M / 1.3B and Llama 3 8B / 70B on 8 / 64 / 512 H100s.

Command (CPU only; needs the jax CUDA plugin, ``pip install 'jaxpar[gpu]'``)::

    python benchmarks/gpu_published.py --out runs/gpu_published.json            # the published rows
    python benchmarks/gpu_published.py --grid --out runs/gpu_grid.json          # the 4 models x 3 sizes table

Prints one JSON object per row as it finishes and writes them all to ``--out``. A published row holds the
predicted tokens/s per GPU and MFU, the published figures and ``ratio`` = predicted / published tokens/s per GPU.
The prediction is optimistic by construction (every kernel at the datasheet peak or HBM bandwidth; no
autotuning, launch gaps or NCCL/compute contention; ``jaxpar.plan.step_time``'s docstring), but it times the
program jaxpar compiles: its attention is XLA's (cuDNN's fused attention needs ``nvidia-cudnn-cu12``), whose
``[B, H, L, L]`` score passes at ``L = 8192`` the published runs' flash kernels do not make. MFU here is
``6 N`` per token (embeddings included) over the dense bf16 peak (989 TFLOP/s); MaxText's recipe counts
attention FLOPs too (its 51% is 45% in ``6 N`` terms).

Published rows (sources):

* torchtitan, Llama 3.1 8B on 8 H100 (one host), FSDP 8, sequence 8192, local batch 2, bf16: 5,762 tokens/s
  per GPU; with Float8 linears 8,532 (pytorch/torchtitan ``docs/performance.md``; their runs use
  ``torch.compile`` and selective activation checkpointing, jaxpar's plan full remat).
* MaxText, Llama 3 70B on 128 H100 (16 hosts), FSDP 8 within x 16 across hosts, per-device batch 2,
  sequence 8192, bf16: 15.563 s/step = 1,052 tokens/s per GPU, 51.2% MFU (NVIDIA DGX Cloud Benchmarking
  recipe "Maxtext Llama3 70B", README).

Both compile with jaxpar's GPU flags (``jp.tools.gpu.apply_gpu_defaults``: latency-hiding scheduler, combined and
pipelined collectives, loop double buffering), as a jaxpar run on GPUs does. The grid picks each cell's layout
as ``experiments/plan.py`` does (``jp.plan.estimate``: fitting first, then the analytic step time; remat full or
none) and compiles the best one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK_BF16 = 989e12
LLAMA3_8B = dict(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, d_mlp=14336, vocab_size=128256,
                 rope_theta=500000.0)
LLAMA3_70B = dict(d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, d_mlp=28672, vocab_size=128256,
                  rope_theta=500000.0)
PUBLISHED = [
    dict(name="torchtitan llama3.1-8b bf16 8xH100", model=LLAMA3_8B, hosts=1, mesh=dict(fsdp=8), batch=16,
         seq=8192, dot=None, tokens_per_s_per_gpu=5762, mfu=None,
         source="pytorch/torchtitan docs/performance.md"),
    dict(name="torchtitan llama3.1-8b fp8 8xH100", model=LLAMA3_8B, hosts=1, mesh=dict(fsdp=8), batch=16,
         seq=8192, dot="fp8", tokens_per_s_per_gpu=8532, mfu=None,
         source="pytorch/torchtitan docs/performance.md"),
    dict(name="maxtext llama3-70b bf16 128xH100", model=LLAMA3_70B, hosts=16, mesh=dict(fsdp=128), batch=256,
         seq=8192, dot=None, tokens_per_s_per_gpu=8192 * 256 / 15.563 / 128, mfu=0.512,
         source="NVIDIA DGX Cloud Benchmarking recipe 'Maxtext Llama3 70B' (README)"),
]
TINY = dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_mlp=128, vocab_size=128)
GRID_MODELS = ["125m", "1.3b", "llama3-8b", "llama3-70b"]
GRID_DEVICES = [8, 64, 512]


def llama(sizes: dict, seq: int, remat: str = "full"):
    import jax.numpy as jnp

    from jaxpar.models.llama import LlamaConfig
    return LlamaConfig(max_seq_len=seq, scan_layers=True, remat=remat, dtype=jnp.bfloat16, **sizes)


def published_row(row: dict) -> dict:
    """Plan one published configuration on its H100 topology; the prediction beside the published figures."""
    import jax.numpy as jnp

    import jaxpar as jp
    from jaxpar.precision.policy import Policy
    cfg = llama(row["model"], row["seq"])
    policy = Policy(jnp.float32, jnp.bfloat16, jnp.float32, dot=row["dot"])
    start = time.perf_counter()
    p = jp.plan.plan(cfg, row["mesh"], global_batch=row["batch"], seq_len=row["seq"], policy=policy,
                     target=jp.plan.gpu_target("h100", hosts=row["hosts"]), compare_cpu=False, timeout=3600)
    predicted = p.time["tokens_per_s_per_gpu"]
    return {"name": row["name"], "source": row["source"], "mesh": p.mesh, "batch": row["batch"], "seq": row["seq"],
            "gpu_gib_per_device": p.needed_bytes / 2**30, "step_s": p.time["step_s"],
            "compute_s": p.time["compute_s"], "gemm_s": p.time["gemm_s"], "exposed_comm_s": p.time["exposed_comm_s"],
            "predicted_tokens_per_s_per_gpu": predicted, "predicted_mfu": p.time["mfu"],
            "published_tokens_per_s_per_gpu": row["tokens_per_s_per_gpu"],
            "published_mfu_6n": row["tokens_per_s_per_gpu"] * 6 * cfg.num_params() / PEAK_BF16,
            "published_mfu_as_reported": row["mfu"], "ratio": predicted / row["tokens_per_s_per_gpu"],
            "fp8_dots": p.gpu["dots"]["fp8_dots"], "attention": p.gpu["attention"],
            "wall_s": time.perf_counter() - start}


def grid_row(model: str, devices: int, plan_cli) -> dict:
    """The layout ``experiments/plan.py`` recommends for ``model`` on ``devices`` H100s, compiled (GPU and CPU)."""
    start = time.perf_counter()
    hosts = max(1, devices // 8)
    plans = plan_cli.main(["--model", model, "--target", "h100", "--hosts", str(hosts), "--gpus-per-host",
                           str(min(8, devices)), "--max-layouts", "1", "--remat", "full", "none",
                           "--max-context", "1", "--out-dir", str(ROOT / "runs" / "gpu_grid" / f"{model}_{devices}")])
    if not plans:
        return {"model": model, "devices": devices, "error": "no layout compiled"}
    p = plans[0]
    return {"model": model, "devices": devices, "mesh": {a: s for a, s in p.mesh.items() if s > 1},
            "remat": p.model["remat"], "batch": p.global_batch, "seq": p.seq_len,
            "gpu_gib_per_device": p.needed_bytes / 2**30,
            "cpu_gib_per_device": (p.memory.get("cpu_compiled_bytes") or math.nan) / 2**30, "fits": p.fits,
            "step_s": p.time["step_s"], "tokens_per_s_per_gpu": p.time["tokens_per_s_per_gpu"], "mfu": p.time["mfu"],
            "wall_s": time.perf_counter() - start}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", action="store_true", help="the 4 models x 8/64/512 H100s table instead of the "
                                                        "published rows")
    ap.add_argument("--models", nargs="+", default=GRID_MODELS, help="grid models (experiments/plan.py names)")
    ap.add_argument("--devices", nargs="+", type=int, default=GRID_DEVICES, help="grid device counts")
    ap.add_argument("--out", default="runs/gpu_published.json", help="where the JSON rows go")
    ap.add_argument("--tiny", action="store_true", help="the published rows' layouts on one host with a tiny Llama "
                                                        "(a check of the script, seconds per row)")
    args = ap.parse_args(argv)
    most = max(args.devices) if args.grid else 8
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={most}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    import jax

    from jaxpar.tools import gpu as gpu_defaults
    gpu_defaults.apply_gpu_defaults(platform="gpu")   # the overlap flags a jaxpar GPU run compiles with
    jax.devices("cpu")   # start jax with the grid's largest device count before the sweeps set theirs
    rows = []
    if args.grid:
        import importlib.util
        spec = importlib.util.spec_from_file_location("experiments_plan", ROOT / "experiments" / "plan.py")
        plan_cli = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plan_cli)
        cells = [(m, d) for m in args.models for d in args.devices]
    else:
        tiny = dict(model=TINY, hosts=1, mesh=dict(fsdp=8), batch=16, seq=64)
        cells = [dict(r, **tiny) for r in PUBLISHED[:2]] if args.tiny else PUBLISHED   # bf16 and fp8
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for cell in cells:
        try:
            row = grid_row(*cell, plan_cli) if args.grid else published_row(cell)
        except Exception as e:  # noqa: BLE001  one configuration's failure must not end the table
            row = {"cell": str(cell if args.grid else cell["name"]), "error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
        out.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
