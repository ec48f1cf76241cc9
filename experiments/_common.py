"""Shared start-up for the experiment entry points: simulated CPU devices and device logging."""

from __future__ import annotations

import os


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
