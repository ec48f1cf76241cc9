"""Metric loggers (JSONL, TensorBoard) and throughput / MFU accounting. Only process 0 writes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import jax

from jaxpar._optional import require


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


class Throughput:
    """Tokens per second and MFU over a sliding window of completed steps.

    MFU (Chowdhery et al. 2022, app. B) = achieved model FLOP/s / peak FLOP/s of all devices, with model
    FLOPs per token from the caller (e.g. ``GPTConfig.flops_per_token``). ``peak_flops_per_device`` is in
    FLOP/s; when it is None (e.g. on CPU, where no peak is known) MFU is not reported.
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
            out["mfu"] = out["tokens_per_s"] * self.flops_per_token / self.peak
        return out
