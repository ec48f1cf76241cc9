"""Shared start-up for the experiment entry points: simulated CPU devices and device logging."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path


def simulate_cpu_devices(n: int) -> None:
    """Asks XLA for ``n`` host CPU devices; must run before jax is imported. No effect on GPU/TPU devices."""
    if n > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={n}").strip()


def log_devices(mesh) -> None:
    import jax

    import jaxpar as jp
    if jax.process_index() == 0:
        print(f"jax {jax.__version__} | {jax.device_count()} devices "
              f"({jax.devices()[0].device_kind}) | mesh {jp.describe(mesh)}", flush=True)


def check_resumed_config(out_dir: str | Path, cfg, may_change: frozenset[str]) -> None:
    """Refuses to resume a run in ``out_dir`` whose saved ``config.json`` differs from ``cfg`` in a field
    outside ``may_change`` (the model, optimizer, data or seed): the checkpoint would silently continue the
    old run under new settings, or fail to restore."""
    saved_path = Path(out_dir) / "config.json"
    if not (Path(out_dir) / "checkpoints").is_dir() or not saved_path.is_file():
        return
    saved, now = json.loads(saved_path.read_text()), json.loads(json.dumps(dataclasses.asdict(cfg)))
    changed = sorted(k for k in now if k not in may_change and k in saved and saved[k] != now[k])
    if changed:
        diff = ", ".join(f"--{k.replace('_', '-')} {saved[k]!r} -> {now[k]!r}" for k in changed)
        raise SystemExit(f"{out_dir} holds checkpoints of a run with other settings ({diff}); resuming would "
                         f"continue that run: pass a new --out-dir for a new run, or delete {out_dir}/checkpoints")
