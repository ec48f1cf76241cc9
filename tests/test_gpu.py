"""jp.gpu.apply_gpu_defaults: XLA overlap flags and matmul precision on GPU only; nothing changes on CPU.

No test here starts a GPU backend: the GPU case is forced through ``platform="gpu"`` in this (CPU) process,
where ``XLA_FLAGS`` is no longer read, and the flag names are checked by a CPU subprocess (XLA parses
every ``--xla_gpu_*`` flag on any platform and aborts on an unknown one).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

import jaxpar as jp
from jaxpar.tools import gpu

USER = "--xla_force_host_platform_device_count=8 --xla_gpu_all_gather_combine_threshold_bytes=1024"


@pytest.fixture
def precision_restored():
    before = jax.config.jax_default_matmul_precision
    yield
    jax.config.update("jax_default_matmul_precision", before)


def test_cpu_changes_nothing(monkeypatch, precision_restored):
    monkeypatch.setenv("XLA_FLAGS", USER)
    before = jax.config.jax_default_matmul_precision
    for platform in ("cpu", None):  # forced, and detected (conftest pins JAX_PLATFORMS=cpu)
        got = gpu.apply_gpu_defaults(platform, matmul_precision="bf16", collective_matmul=True)
        assert (got.platform, got.flags, got.kept, got.matmul_precision, got.applied) == ("cpu", {}, {}, None, False)
        assert os.environ["XLA_FLAGS"] == USER
        assert jax.config.jax_default_matmul_precision == before


def test_gpu_adds_missing_flags_and_keeps_the_users(monkeypatch, precision_restored):
    monkeypatch.setenv("XLA_FLAGS", USER)
    monkeypatch.setattr(jp._compat, "backends_initialized", lambda: False)  # as before any device use
    got = gpu.apply_gpu_defaults("gpu", collective_matmul=True)
    want = {"xla_gpu_enable_latency_hiding_scheduler": "true", "xla_gpu_threshold_for_windowed_einsum_mib": "0",
            "xla_gpu_multi_streamed_windowed_einsum": "true", "xla_gpu_all_reduce_combine_threshold_bytes": "134217728",
            "xla_gpu_reduce_scatter_combine_threshold_bytes": "67108864"}
    assert got.applied and want.items() <= got.flags.items()
    assert got.kept == {"xla_gpu_all_gather_combine_threshold_bytes": "1024"}
    final = gpu.parse_xla_flags(os.environ["XLA_FLAGS"])
    assert final["xla_gpu_all_gather_combine_threshold_bytes"] == "1024"   # the user's value wins
    assert final["xla_force_host_platform_device_count"] == "8"
    assert {k: final[k] for k in got.flags} == got.flags
    assert os.environ["XLA_FLAGS"].count("all_gather_combine_threshold") == 1
    assert got.matmul_precision is None  # default: JAX's precision left alone

    # collective matmul off by default; a second call adds nothing (everything is now set)
    monkeypatch.setenv("XLA_FLAGS", "")
    assert "xla_gpu_threshold_for_windowed_einsum_mib" not in gpu.apply_gpu_defaults("gpu").flags
    assert gpu.apply_gpu_defaults("gpu").flags == {}


@pytest.mark.parametrize("choice, value", [("tf32", "tensorfloat32"), ("fp32", "float32"), ("bf16", "bfloat16")])
def test_gpu_matmul_precision(monkeypatch, precision_restored, choice, value):
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(jp._compat, "backends_initialized", lambda: False)
    assert gpu.apply_gpu_defaults("cuda", matmul_precision=choice).matmul_precision == value
    assert jax.config.jax_default_matmul_precision == value


def test_errors(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(ValueError, match=r"matmul_precision='tf16': use one of default, tf32, fp32, bf16"):
        gpu.apply_gpu_defaults("gpu", matmul_precision="tf16")
    with pytest.warns(RuntimeWarning, match=r"after JAX's backends started"):  # true in this process
        assert gpu.apply_gpu_defaults("gpu").flags == {}
    assert os.environ["XLA_FLAGS"] == ""


def test_detect_platform_without_starting_jax(monkeypatch):
    assert gpu.detect_platform("CUDA") == gpu.detect_platform("rocm") == "gpu"
    assert gpu.detect_platform(environ={"JAX_PLATFORMS": "cuda,cpu"}) == "gpu"
    assert gpu.detect_platform(environ={"JAX_PLATFORMS": "cpu"}) == "cpu"
    monkeypatch.setattr(gpu, "_gpu_plugins", lambda: {"cuda"})
    monkeypatch.setattr(gpu.os.path, "exists", lambda p: p == "/dev/nvidiactl")
    assert gpu.detect_platform(environ={}) == "gpu"
    assert gpu.detect_platform(environ={"CUDA_VISIBLE_DEVICES": ""}) is None
    monkeypatch.setattr(gpu, "_gpu_plugins", lambda: set())
    assert gpu.detect_platform(environ={}) is None


def _run_with_flags(flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_every_flag_exists_in_this_xla():
    """A misspelt or removed flag aborts XLA at startup: all of ours start a process; a bogus one does not."""
    flags = " ".join(f"--{k}={v}" for k, v in gpu.gpu_flags(collective_matmul=True).items())
    ok = _run_with_flags(flags)
    assert ok.returncode == 0 and ok.stdout.strip() == "3.0", ok.stderr[-2000:]
    bad = _run_with_flags(flags + " --xla_gpu_enable_async_all_gather=true")  # removed from XLA in 2024
    assert bad.returncode != 0 and "Unknown flag" in bad.stderr
