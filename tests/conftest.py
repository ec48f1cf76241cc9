"""Test setup: 8 simulated host CPU devices, set before jax is imported; a persistent compilation cache.

``XLA_FLAGS`` must hold ``--xla_force_host_platform_device_count=8`` before the first ``import jax`` anywhere
in the process, so this module sets it at import time (pytest imports conftest.py before any test module).
"""

from __future__ import annotations

import os
import pathlib

_REPO = pathlib.Path(__file__).resolve().parents[1]
_FLAG = "--xla_force_host_platform_device_count=8"
_existing = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _existing:
    os.environ["XLA_FLAGS"] = f"{_existing} {_FLAG}".strip()

import jax  # noqa: E402  (after XLA_FLAGS on purpose)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", str(_REPO / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

NUM_DEVICES = 8


def pytest_collection_modifyitems(config, items):
    """Fails loudly (once) if the device count is wrong, instead of a confusing error in every test."""
    del config, items
    if jax.device_count() < NUM_DEVICES and jax.devices()[0].platform == "cpu":
        raise pytest.UsageError(
            f"expected {NUM_DEVICES} host CPU devices, got {jax.device_count()}: jax was imported before "
            "tests/conftest.py could set XLA_FLAGS (e.g. by a plugin); run pytest from the repository root")


@pytest.fixture(scope="session")
def devices():
    """All 8 devices; skips where fake CPU devices are impossible (e.g. a single real accelerator)."""
    devs = jax.devices()
    if len(devs) < NUM_DEVICES:
        pytest.skip(f"needs {NUM_DEVICES} devices, have {len(devs)} {devs[0].platform} device(s)")
    return devs[:NUM_DEVICES]


@pytest.fixture(scope="session")
def mesh_factory():
    """``mesh_factory(data=, pipe=, fsdp=, tensor=)``: a jaxpar mesh over the first ``prod(sizes)`` devices.

    ``mesh_factory()`` (all sizes 1) is the single-device reference mesh. Skips the test when there are fewer
    devices than the mesh needs (only possible off CPU, e.g. on a single real GPU).
    """
    import jaxpar as jp
    cache = {}

    def make(data: int = 1, pipe: int = 1, fsdp: int = 1, tensor: int = 1):
        key = (data, pipe, fsdp, tensor)
        if key not in cache:
            n = data * pipe * fsdp * tensor
            available = jax.devices()
            if len(available) < n:
                pytest.skip(f"needs {n} devices, have {len(available)} {available[0].platform} device(s)")
            cache[key] = jp.make_mesh(data=data, pipe=pipe, fsdp=fsdp, tensor=tensor, devices=available[:n])
        return cache[key]
    return make


@pytest.fixture
def np_rng():
    return np.random.default_rng(1234)
