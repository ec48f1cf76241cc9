"""Metric loggers (JSONL, TensorBoard), throughput / MFU accounting, and the experts' load from carried state.
Only process 0 writes.

MFU: ``mfu(tokens_per_s, flops_per_token, peak_flops(device))``; ``peak_flops`` is a GPU's datasheet dense
bf16 figure (H100, H200, A100) or, on a CPU, a measured large matmul.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar._optional import require
from jaxpar.layers import moe
from jaxpar.tools import datasheets as _datasheets


class MetricsWriter:
    """Writes scalar metrics per step to ``<dir>/metrics.jsonl`` and TensorBoard events in ``<dir>/tb``.

    Each JSONL line is ``{"step": int, "split": str, <name>: float, ...}``; lines are flushed as written.
    In multi-process runs only process 0 writes; other processes' calls are no-ops.

    ``resume_step``: the run continues from a checkpoint at this step, so rows of later steps (written by
    the interrupted run after that checkpoint) and a torn last line are dropped from ``metrics.jsonl``,
    and TensorBoard purges its events after that step: the files then hold one trajectory.
    """

    def __init__(self, directory: str | Path, tensorboard: bool = True, resume_step: int | None = None):
        self.active = jax.process_index() == 0
        self.directory = Path(directory)
        self._tb = None
        if not self.active:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            _drop_rows_after(self.directory / "metrics.jsonl", resume_step)
        self._jsonl = open(self.directory / "metrics.jsonl", "a", encoding="utf-8", buffering=1)
        if tensorboard:
            SummaryWriter = require("tensorboardX", "MetricsWriter(tensorboard=True)").SummaryWriter
            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(str(self.directory / "tb"), purge_step=purge)

    def write(self, step: int, metrics: dict[str, Any], split: str = "train") -> None:
        if not self.active:
            return
        row = {"step": int(step), "split": split, **{k: float(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(f"{split}/{k}", float(v), int(step))

    def close(self) -> None:
        if not self.active:
            return
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _drop_rows_after(path: Path, step: int) -> None:
    """Rewrites a metrics.jsonl keeping the complete rows of steps <= ``step`` (atomically, by rename)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a killed process
            continue
        if isinstance(row, dict) and row.get("step", step + 1) <= step:
            kept.append(line + "\n")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# Dense bf16 tensor-core peak, FLOP/s per GPU, by device-kind pattern, in match order: read from the one GPU table
# (:mod:`jaxpar.tools.datasheets`, which names the NVIDIA datasheets).
GPU_PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = tuple((d.kind, d.bf16_flops) for d in _datasheets.DATASHEETS)


def datasheet_peak_flops(device_kind: str) -> float | None:
    """The table's dense bf16 peak (FLOP/s) for a GPU ``device_kind`` (e.g. ``"NVIDIA H100 80GB HBM3"``), or None."""
    row = _datasheets.for_device_kind(device_kind)
    return None if row is None else row.bf16_flops


# Per-GPU figures for planning runs (``jaxpar.plan``), by name (aliases included): memory capacity (bytes), HBM
# bandwidth and link bandwidths per GPU per direction (bytes/s), dense bf16 / fp8 FLOP/s; ``kind`` looks the row
# up again in :func:`datasheet_peak_flops`. Read from :mod:`jaxpar.tools.datasheets` (sources there); only the
# GPUs of multi-host systems (an InfiniBand figure) are planning targets.
GPU_DATASHEETS: dict[str, dict[str, Any]] = {
    name: dict(kind=d.kind, memory_bytes=d.memory_bytes, hbm_bytes_per_s=d.hbm_bytes_per_s,
               nvlink_bytes_per_s=d.nvlink_bytes_per_s, infiniband_bytes_per_s=d.infiniband_bytes_per_s,
               bf16_flops=d.bf16_flops, fp8_flops=d.fp8_flops, source=d.source)
    for d in _datasheets.DATASHEETS if d.infiniband_bytes_per_s is not None for name in (d.name, *d.aliases)
}


def measure_matmul_flops(n: int = 2048, dtype: Any = jnp.float32, repeats: int = 5,
                         device: jax.Device | None = None) -> float:
    """Achieved FLOP/s of an ``[n, n] @ [n, n]`` matmul on ``device`` (default: the first device): ``2 n^3``
    FLOPs over the fastest of ``repeats`` timed runs (after one compile-and-warm-up run). On a CPU this stands
    for the peak: XLA:CPU's matmuls are its fastest kernels, and no datasheet figure applies to a shared host.

    Raises:
      ValueError: ``n`` or ``repeats`` below 1.
    """
    if not (isinstance(n, int) and n >= 1 and isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"need int n >= 1 and repeats >= 1, got {n=}, {repeats=}")
    device = device or jax.devices()[0]
    a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), dtype), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best


@functools.lru_cache(maxsize=None)
def _measured_peak(platform: str, kind: str) -> float:
    device = next(d for d in jax.devices() if d.platform == platform and d.device_kind == kind)
    return measure_matmul_flops(device=device)


def peak_flops(device: jax.Device | None = None, measure: bool = True) -> float | None:
    """Peak FLOP/s of one device, for MFU: a GPU's datasheet dense bf16 figure (:data:`GPU_PEAK_BF16_FLOPS`);
    otherwise (CPU, or a GPU not in the table) a measured float32 2048^3 matmul (:func:`measure_matmul_flops`,
    measured once per device kind and cached), or None when ``measure`` is False.
    """
    device = device or jax.devices()[0]
    if device.platform == "gpu" or device.platform == "cuda":
        table = datasheet_peak_flops(device.device_kind)
        if table is not None:
            return table
    return _measured_peak(device.platform, device.device_kind) if measure else None


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_device: float, num_devices: int = 1) -> float:
    """Model FLOPs utilisation (Chowdhery et al. 2022, app. B): ``tokens_per_s * flops_per_token`` over
    ``num_devices * peak_flops_per_device`` (a fraction, 0.5 = 50%). ``flops_per_token`` counts the model's
    training FLOPs (e.g. ``GPTConfig.flops_per_token(seq_len)``), not recomputation.

    Raises:
      ValueError: a non-positive peak or device count, or negative throughput / FLOPs.
    """
    if not peak_flops_per_device or peak_flops_per_device <= 0 or num_devices < 1:
        raise ValueError(f"need peak_flops_per_device > 0 and num_devices >= 1, got {peak_flops_per_device}, "
                         f"{num_devices}")
    if tokens_per_s < 0 or flops_per_token < 0:
        raise ValueError(f"need tokens_per_s >= 0 and flops_per_token >= 0, got {tokens_per_s}, {flops_per_token}")
    return tokens_per_s * flops_per_token / (num_devices * peak_flops_per_device)


class Throughput:
    """Tokens per second and MFU over a sliding window of completed steps.

    MFU (Chowdhery et al. 2022, app. B) = achieved model FLOP/s / peak FLOP/s of all devices, with model
    FLOPs per token from the caller (e.g. ``GPTConfig.flops_per_token``). ``peak_flops_per_device`` is in
    FLOP/s (e.g. :func:`peak_flops`); when it is None MFU is not reported.
    """

    def __init__(self, tokens_per_step: int, flops_per_token: float = 0.0,
                 peak_flops_per_device: float | None = None, window: int = 20):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak = peak_flops_per_device * jax.device_count() if peak_flops_per_device else None
        self.window, self._times = window, []

    def tick(self) -> dict[str, float]:
        """Call once per completed step; returns ``{"tokens_per_s", ["mfu"]}`` (empty until two ticks)."""
        self._times.append(time.perf_counter())
        self._times = self._times[-(self.window + 1):]
        if len(self._times) < 2:
            return {}
        dt = (self._times[-1] - self._times[0]) / (len(self._times) - 1)
        out = {"tokens_per_s": self.tokens_per_step / dt}
        if self.peak and self.flops_per_token:
            out["mfu"] = mfu(out["tokens_per_s"], self.flops_per_token, self.peak)
        return out


# ------------------------------------------------------------------------------------- mixture of experts



def _router_collections(tree: Any) -> list[dict]:
    """Every dict under the MoE router's carried key (``moe_router``, :data:`jaxpar.layers.moe.ROUTER`) that holds a
    ``load``, in a nested tree of dicts / lists / tuples, in order."""
    found = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key == moe.ROUTER.key and isinstance(value, dict) and "load" in value:
                found.append(value)
            else:
                found += _router_collections(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            found += _router_collections(value)
    return found


def expert_load_metrics(carried: Any, per_layer: bool = False) -> dict[str, jax.Array]:
    """The experts' load after a step, from every MoE router collection in ``carried`` (any model).

    Reads each ``moe_router`` dict's ``load`` (routed choices per expert, ``[..., E]``: one row per MoE layer,
    e.g. ``[N, E]`` for ``N`` stacked layers) and ``dropped`` (choices dropped by capacity, ``[...]``) wherever the
    tree holds them (``state.carried`` of ``jp.train.init_state``; the values are the step's global counts, over
    every microbatch and replica). Traceable: call it eagerly or under ``jax.jit``.

    Returns:
      float32 scalars: ``expert_load_{i}``, the fraction of the routed choices that went to expert ``i``, mean
      over layers (uniform routing gives ``1/E`` each); ``max_mean_load``, ``max_i load_i / mean_i load_i`` per
      layer, mean over layers (1 is perfect balance, ``E`` all on one expert; the MaxVio of Wang et al. 2024,
      arXiv 2408.15664, plus 1); ``moe_choices``, the routed choices per layer, mean over layers (tokens x k);
      with ``dropped`` leaves ``moe_dropped_fraction``, dropped over routed choices, mean over layers; with
      ``per_layer`` also each layer's ``expert_load_l{layer}_{i}`` and ``moe_choices_l{layer}`` (layers in the
      order the tree flattens). A layer that routed nothing yet (before the first step) gives NaN fractions.
      Empty when ``carried`` holds no router collection.

    Raises:
      ValueError: collections with different expert counts.
    """
    collections = _router_collections(carried)
    if not collections:
        return {}
    counts = {c["load"].shape[-1] for c in collections}
    if len(counts) != 1:
        raise ValueError(f"the carried tree holds MoE router collections of {sorted(counts)} experts; "
                         "expert_load_metrics averages over layers of one expert count: pass one model's subtree")
    experts = counts.pop()
    load = jnp.concatenate([jnp.reshape(c["load"], (-1, experts)).astype(jnp.float32) for c in collections])
    total = load.sum(-1)
    fraction = load / total[:, None]                                    # [layers, E]
    out = {f"expert_load_{i}": fraction[:, i].mean() for i in range(experts)}
    out["max_mean_load"] = (load.max(-1) / load.mean(-1)).mean()
    out["moe_choices"] = total.mean()
    if all("dropped" in c for c in collections):
        dropped = jnp.concatenate([jnp.reshape(c["dropped"], (-1,)).astype(jnp.float32) for c in collections])
        out["moe_dropped_fraction"] = (dropped / total).mean()
    if per_layer:
        for layer in range(load.shape[0]):
            out.update({f"expert_load_l{layer}_{i}": fraction[layer, i] for i in range(experts)})
            out[f"moe_choices_l{layer}"] = total[layer]
    return out


def expert_load_rows(rows: list[dict[str, Any]]) -> tuple[list[int], Any]:
    """The per-expert load of metrics rows (metrics.jsonl's, with :func:`expert_load_metrics`' keys):
    ``(steps, load)``, ``load`` a numpy ``[steps, E]`` array of fractions, rows without the keys skipped."""
    keys = sorted((k for r in rows for k in r if re.fullmatch(r"expert_load_\d+", k)), key=lambda k: int(k[12:]))
    keys = list(dict.fromkeys(keys))
    picked = [r for r in rows if keys and all(k in r for k in keys)]
    return [int(r["step"]) for r in picked], np.asarray([[r[k] for k in keys] for r in picked], np.float64)


__all__ = ["GPU_DATASHEETS", "MetricsWriter", "Throughput", "expert_load_metrics", "expert_load_rows",
           "measure_matmul_flops", "mfu", "peak_flops", "read_jsonl"]
