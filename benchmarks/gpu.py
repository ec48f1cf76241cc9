"""One GPU: jaxpar's GPT train step against the same GPT in PyTorch, in bf16, at ~125M, ~350M and ~1.3B parameters,
and jaxpar's fp8 policies (delayed and current scaling) beside its bf16.

    python benchmarks/gpu.py                 # on a machine with one NVIDIA GPU (about 5-8 minutes)
    python benchmarks/gpu.py --tiny          # CPU smoke test of the whole path at a tiny size (seconds)

Needs only jax, flax, optax, numpy and torch. Models (GPT-2/GPT-3 shapes, learned positions, tied embeddings,
vocabulary 50257 padded to 50304, sequence 1024): ``125M`` 12 layers x d=768 (12 heads), ``350M`` 24 x 1024
(16), ``1.3B`` 24 x 2048 (16); batch ``--batch`` sequences (default 16, 8, 8), synthetic uniform tokens.

* jaxpar: ``jp.train.make_train_step`` on a one-device mesh, ``Policy "mixed_bf16"`` (float32 params and
  AdamW state, bfloat16 compute), ``attention="cudnn"`` (cuDNN flash attention through
  ``jax.nn.dot_product_attention``; ``"blocked"`` off GPU), ``scan_layers=True`` (compile time);
* jaxpar fp8 (``--policies``, default all): the same step under ``"p=f32,c=bf16,o=f32,dot=fp8"`` (delayed scaling,
  ``jaxpar_fp8``) and ``dot=fp8_current`` (``jaxpar_fp8_current``): the attention projections and the MLP in
  fp8 (``jaxpar.precision.fp8``); the JSON gives each one's fp8 dots in the lowered step and its speed over bf16's;
* PyTorch: ``benchmarks/torch_gpt.py``'s module (``scaled_dot_product_attention``, causal) under
  ``torch.autocast(bfloat16)``, ``torch.compile``d, ``torch.optim.AdamW(fused=True)`` on CUDA, the same
  clipping and schedule.

Both are timed in the same process, in interleaved rounds of ``--steps`` steps after warm-up; JAX does not
preallocate GPU memory here (``XLA_PYTHON_CLIENT_PREALLOCATE=false``) so both fit. Per size the JSON gives
tokens/s (median over rounds, with min-max), MFU (``GPTConfig.flops_per_token`` x tokens/s over
``jp.metrics.peak_flops``: the datasheet dense bf16 figure on H100/H200/A100), and peak memory: PyTorch's
``torch.cuda.max_memory_allocated`` (reset per size), jaxpar's compiled ``memory_analysis`` (arguments +
temporaries) and the device's ``peak_bytes_in_use`` (for the whole process so far). ``--budget-s`` skips the
sizes left once the run has taken that long.

Predicted beside measured (each jaxpar run): the same train step's program compiled for the GPU, its scheduled
HLO replayed by ``jaxpar.plan.step_time.scheduled_time`` (kernels at the datasheet peaks, optimistic: its
docstring) and its ``memory_analysis`` (arguments + outputs - aliased + temporaries), beside the measured
median step time and the device's ``peak_bytes_in_use`` (for the whole process so far, so exact for the first
run only), with ``predicted / measured``. On a GPU the program is the one the run executes; off GPU (``--tiny``)
the same step is compiled for one compile-only H100 (``jp.plan.gpu_target``, needs the ``gpu`` extra) and its
prediction printed with the ratio ``"n/a off GPU"``. On a GPU the device's own ``GpuTargetConfigProto`` (what the
installed jaxlib compiles for) is saved to ``--target-config-dir`` (``benchmarks/results/<device_kind>.txtpb``)
and its differing lines against the shipped file counted, so the shipped one can be checked.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxpar as jp  # noqa: E402
import torch_gpt  # noqa: E402
from jaxpar import _compat  # noqa: E402
from jaxpar.models import GPT, GPTConfig  # noqa: E402
from jaxpar.plan import compiled_step, step_time, targets  # noqa: E402
from jaxpar.tools import datasheets  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

SIZES = {"125M": (12, 768, 12, 16), "350M": (24, 1024, 16, 8), "1.3B": (24, 2048, 16, 8)}  # layers, d, heads, batch
TINY = {"tiny": (2, 64, 2, 4)}
TOTAL_STEPS, WARMUP = 1000, 10


def config(size: str, tiny: bool, on_gpu: bool) -> tuple[GPTConfig, int]:
    layers, d, heads, batch = (TINY if tiny else SIZES)[size]
    cfg = GPTConfig(vocab_size=103 if tiny else 50257, num_layers=layers, d_model=d, num_heads=heads,
                    max_seq_len=32 if tiny else 1024, attention="cudnn" if on_gpu else "blocked", scan_layers=True)
    return cfg, batch


def batches(cfg: GPTConfig, batch: int, n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    shape = (batch, cfg.max_seq_len)
    return [{k: rng.integers(0, cfg.vocab_size, shape, dtype=np.int32) for k in ("inputs", "targets")}
            for _ in range(n)]


POLICIES = {"jaxpar": "mixed_bf16", "jaxpar_fp8": "p=f32,c=bf16,o=f32,dot=fp8",
            "jaxpar_fp8_current": "p=f32,c=bf16,o=f32,dot=fp8_current"}


class JaxRun:
    def __init__(self, cfg: GPTConfig, data: list[dict], policy: str = "mixed_bf16"):
        model = GPT(cfg)
        mesh = jp.make_mesh(data=1, devices=jax.devices()[:1])
        names = jax.eval_shape(model.init, jax.random.key(0))
        tx = jp.optim.adamw(3e-4, total_steps=TOTAL_STEPS, warmup_steps=WARMUP, axis_names=names)
        policy = jp.precision.Policy.from_string(policy)
        self.state = jp.train.init_state(model.init, tx, 0, mesh=mesh, policy=policy)
        self.step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
        self.data = [jp.train.shard_batch(b, mesh) for b in data]
        lowered = self.step.lower(self.state, self.data[0])
        self.fp8_dots = jp.fp8.fp8_dot_counts(lowered)
        self.compiled = lowered.compile()
        m = self.compiled.memory_analysis()
        self.compiled_bytes = int(m.argument_size_in_bytes + m.temp_size_in_bytes)
        self.num_params = sum(x.size for x in jax.tree.leaves(self.state.params))
        self.model, self.tx, self.policy = model, tx, policy

    def run(self, n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            self.state, metrics = self.step(self.state, self.data[i % len(self.data)])
        loss = float(metrics["loss"])
        self.last_loss = loss
        return time.perf_counter() - start


class TorchRun:
    def __init__(self, cfg: GPTConfig, data: list[dict], device: str, compile_: bool):
        torch = self.torch = torch_gpt.torch_module()
        self.device = device
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.model = torch_gpt.build(cfg, device)
        fused = {"fused": True} if device == "cuda" else {}
        self.opt, self.sched = torch_gpt.make_optimizer(self.model, 3e-4, TOTAL_STEPS, WARMUP, **fused)
        self.fwd = torch.compile(self.model) if compile_ else self.model
        self.data = [{k: torch.from_numpy(v.astype(np.int64)).to(device) for k, v in b.items()} for b in data]
        self.num_params = torch_gpt.num_params(self.model)

    def run(self, n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            b = self.data[i % len(self.data)]
            loss = torch_gpt.train_step(self.fwd, self.opt, self.sched, b["inputs"], b["targets"],
                                        autocast=(self.device, self.torch.bfloat16))
        self.last_loss = float(loss.detach())
        return time.perf_counter() - start

    def peak_bytes(self) -> int | None:
        return int(self.torch.cuda.max_memory_allocated()) if self.device == "cuda" else None


def program_prediction(compiled, spec) -> dict:
    """Predicted step seconds (the replayed schedule) and bytes per device (``memory_analysis``) of a program
    compiled for one GPU, whose figures ``spec`` gives (a datasheet row or a ``GpuTarget``)."""
    m = compiled.memory_analysis()
    replay = step_time.scheduled_time(compiled.as_text(), {"data": 1}, [0], spec)
    return {"step_s": replay["step_s"], "bytes": int(m.argument_size_in_bytes + m.output_size_in_bytes
                                                     - m.alias_size_in_bytes + m.temp_size_in_bytes)}


def h100_prediction(run: JaxRun, batch: int, seq: int) -> dict | str:
    """The same train step compiled for one compile-only H100 and predicted (off GPU), or why not."""
    try:
        target = targets.gpu_target("h100", hosts=1, gpus_per_host=1)
    except (ImportError, RuntimeError) as e:
        return f"n/a: {str(e)[:160]}"
    mesh = target.mesh(data=1)
    state = jp.train.abstract_state(run.model.init, run.tx, mesh=mesh, policy=run.policy)
    step = jp.train.make_train_step(run.model.loss, run.tx, mesh=mesh)
    return program_prediction(step.lower(state, compiled_step.batch_structs(batch, seq)).compile(), target)


def predicted_beside_measured(run: JaxRun, ms_per_step: float, on_gpu: bool, batch: int, seq: int) -> dict:
    """``predicted_ms_per_step``, ``predicted_bytes`` and their ratios to the measured ones (module docstring)."""
    device = jax.devices()[0]
    row = datasheets.for_device_kind(device.device_kind) if on_gpu else None
    if on_gpu and row is None:
        return {"predicted": f"n/a: no datasheet row for {device.device_kind!r}"}
    pred = program_prediction(run.compiled, row) if on_gpu else h100_prediction(run, batch, seq)
    if isinstance(pred, str):
        return {"predicted": pred}
    measured_bytes = (device.memory_stats() or {}).get("peak_bytes_in_use") if on_gpu else None
    out = {"predicted_on": row.name if on_gpu else "h100 (compile-only)",
           "predicted_ms_per_step": round(1e3 * pred["step_s"], 3), "predicted_bytes": pred["bytes"],
           "measured_process_peak_bytes": measured_bytes}
    if on_gpu:
        out["predicted_over_measured_time"] = round(1e3 * pred["step_s"] / ms_per_step, 3)
        out["predicted_over_measured_bytes"] = round(pred["bytes"] / measured_bytes, 3) if measured_bytes else None
    else:
        out["predicted_over_measured_time"] = out["predicted_over_measured_bytes"] = "n/a off GPU"
    return out


def save_target_config(directory: str) -> dict:
    """Writes the GPU's own ``GpuTargetConfigProto`` to ``<directory>/<device_kind>.txtpb``; returns its path and
    how many of its lines differ from the shipped file of the same GPU (None without one)."""
    device = jax.devices()[0]
    text = _compat.device_target_config(jax.devices()[:1])
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "".join(c if c.isalnum() else "_" for c in device.device_kind) + ".txtpb")
    with open(path, "w") as f:
        f.write(text)
    row = datasheets.for_device_kind(device.device_kind)
    shipped = targets.shipped_target_config(row.name) if row is not None and row.target_config else None
    differing = None if shipped is None else len(set(text.splitlines()) ^ set(shipped.splitlines()))
    return {"path": path, "shipped": None if shipped is None else row.target_config, "differing_lines": differing}


def measure(size: str, args, on_gpu: bool, peak: float) -> dict:
    cfg, batch = config(size, args.tiny, on_gpu)
    batch = args.batch or batch
    data = batches(cfg, batch, 4)
    runs = {k: JaxRun(cfg, data, POLICIES[k]) for k in ["jaxpar", *args.policies]}
    runs["torch"] = TorchRun(cfg, data, "cuda" if on_gpu else "cpu", not args.no_compile)
    for r in runs.values():
        r.run(args.warmup)
    times = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, r in runs.items():
            times[k].append(r.run(args.steps) / args.steps)
    tokens = batch * cfg.max_seq_len
    flops = cfg.flops_per_token(cfg.max_seq_len)
    out = {"params": {k: int(r.num_params) for k, r in runs.items()}, "batch": batch, "seq": cfg.max_seq_len,
           "flops_per_token": flops}
    for k, ts in times.items():
        med = statistics.median(ts)
        out[k] = {"ms_per_step": round(1e3 * med, 2), "tokens_per_s": round(tokens / med),
                  "tokens_per_s_min_max": [round(tokens / max(ts)), round(tokens / min(ts))],
                  "mfu": round(jp.metrics.mfu(tokens / med, flops, peak), 4), "last_loss": round(runs[k].last_loss, 4)}
    for k in runs:
        if k.startswith("jaxpar"):
            out[k]["compiled_bytes"], out[k]["fp8_dots"] = runs[k].compiled_bytes, runs[k].fp8_dots
            out[k].update(predicted_beside_measured(runs[k], out[k]["ms_per_step"], on_gpu, batch, cfg.max_seq_len))
        if k.startswith("jaxpar_fp8"):   # the same rounds, side by side
            out[f"{k}_over_bf16_tokens_per_s"] = round(statistics.median(
                [b / a for a, b in zip(times[k], times["jaxpar"])]), 3)
    stats = jax.devices()[0].memory_stats() or {}
    out["jaxpar"]["process_peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    out["torch"]["max_memory_allocated"] = runs["torch"].peak_bytes()
    out["jaxpar_over_torch_tokens_per_s"] = round(statistics.median(
        [b / a for a, b in zip(times["jaxpar"], times["torch"])]), 3)
    del runs
    gc.collect()
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: a smoke test of the whole path")
    ap.add_argument("--sizes", nargs="+", default=None, help=f"a subset of {list(SIZES)}")
    ap.add_argument("--batch", type=int, default=0, help="sequences per step (0: the size's default)")
    ap.add_argument("--steps", type=int, default=10, help="steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the sizes left after this many seconds")
    ap.add_argument("--no-compile", action="store_true", help="PyTorch eager instead of torch.compile")
    ap.add_argument("--target-config-dir", default=RESULTS,
                    help="where a GPU's own XLA target config is saved (<device_kind>.txtpb)")
    ap.add_argument("--policies", nargs="*", default=["jaxpar_fp8", "jaxpar_fp8_current"],
                    choices=[k for k in POLICIES if k != "jaxpar"], help="jaxpar's fp8 runs beside its bf16 one")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    if args.tiny:
        args.steps, args.rounds, args.warmup = min(args.steps, 2), min(args.rounds, 2), 1
    torch = torch_gpt.torch_module()
    on_gpu = not args.tiny and jax.devices()[0].platform == "gpu" and torch.cuda.is_available()
    if not args.tiny and not on_gpu:
        raise SystemExit("benchmarks/gpu.py needs a GPU visible to both jax and torch (or --tiny for a CPU smoke test)")
    device = jax.devices()[0]
    # --tiny: a small matmul stands in for the CPU peak (the smoke test checks the path, not the figure)
    peak = jp.metrics.measure_matmul_flops(n=256, repeats=2) if args.tiny else jp.metrics.peak_flops(device)
    start = time.perf_counter()
    out = {"device": device.device_kind, "jax": jax.__version__, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "peak_flops_per_device": peak, "results": {}, "skipped": [],
           "target_config": save_target_config(args.target_config_dir) if on_gpu else "n/a off GPU"}
    for size in (list(TINY) if args.tiny else args.sizes or list(SIZES)):
        if time.perf_counter() - start > args.budget_s:
            out["skipped"].append(size)
            continue
        out["results"][size] = measure(size, args, on_gpu, peak)
    out["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(out, indent=1))
    print_predicted(out)
    return out


def print_predicted(out: dict) -> None:
    """One line per jaxpar run: measured and predicted step time and memory, and their ratios."""
    print(f"{'size':6s} {'run':20s} {'ms meas':>9s} {'ms pred':>9s} {'pred/meas':>11s} {'GiB meas':>9s} "
          f"{'GiB pred':>9s} {'pred/meas':>11s}")
    gib = lambda b: f"{b / 2**30:9.3f}" if isinstance(b, (int, float)) else f"{'n/a':>9s}"
    for size, res in out["results"].items():
        for k, r in res.items():
            if k.startswith("jaxpar") and isinstance(r, dict):
                pred = r.get("predicted_ms_per_step")
                print(f"{size:6s} {k:20s} {r['ms_per_step']:9.2f} {pred if pred is not None else 'n/a':>9} "
                      f"{str(r.get('predicted_over_measured_time', r.get('predicted'))):>11.11s} "
                      f"{gib(r.get('measured_process_peak_bytes'))} {gib(r.get('predicted_bytes'))} "
                      f"{str(r.get('predicted_over_measured_bytes', '')):>11.11s}")


if __name__ == "__main__":
    main()
