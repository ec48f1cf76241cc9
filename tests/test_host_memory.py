"""jp.tools.cpu.reuse_host_memory: glibc keeps and reuses XLA:CPU's per-execution temporary buffer.

The effect is measured in fresh processes (the settings must precede JAX's backends): a jitted function whose
temporary buffer is larger than glibc's mmap limits faults in every page of it on every call without the
settings; with them most calls fault none (slow). The fast test checks the refusals in this process, whose backends started.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import warnings

import jax
import pytest

import jaxpar as jp
from jaxpar.tools import cpu

CHILD = r"""
import json, resource, sys
import jaxpar as jp
applied = jp.tools.cpu.reuse_host_memory("cpu").applied if sys.argv[1] == "reuse" else False
import jax, jax.numpy as jnp
f = jax.jit(lambda x: (jnp.sin(x[:, None] * x[None, :]) @ x).sum())    # a [N, N] float32 temporary: 100 MiB
x = jnp.linspace(0, 1, 5120, dtype=jnp.float32)
faults = []
for _ in range(40):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def test_refuses_after_backends_started_on_gpus_and_without_glibc(monkeypatch):
    jax.devices()   # started (the suite's conftest has already): the settings would no longer reach XLA's threads
    with pytest.warns(RuntimeWarning, match="after JAX's backends started"):
        got = cpu.reuse_host_memory("cpu")            # this process has run computations
    assert (got.applied, got.settings, got.reason) == (False, {}, "JAX's backends had started")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpu = cpu.reuse_host_memory("gpu")
        assert not gpu.applied and gpu.platform == "gpu" and "GPU" in gpu.reason
        monkeypatch.setattr(cpu, "_glibc", lambda: None)
        assert "not glibc" in cpu.reuse_host_memory("cpu").reason
    with pytest.raises(ValueError, match="platform"):
        cpu.reuse_host_memory("")
    assert cpu.ENVIRONMENT["MALLOC_ARENA_MAX"] == "1" and set(cpu.MALLOPT) == {"M_ARENA_MAX", "M_MMAP_MAX",
                                                                                "M_TRIM_THRESHOLD"}


@pytest.mark.slow
@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_most_calls_fault_no_pages_with_the_settings():
    def run(mode):
        out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    pages = 5120 * 5120 * 4 // 4096
    plain, reused = run("plain"), run("reuse")
    assert not plain["applied"] and reused["applied"]
    # without: glibc maps the buffer afresh for every call and every page faults. With: the freed buffer stays in the
    # heap and the next call takes it, except when a small block allocated between two calls has landed in it and
    # outlives the next call: then the heap grows by one buffer. Measured over 39 calls after the first, in 18
    # processes idle and with two busy loops: 0-9 such calls, often a few in a row, none on most calls.
    assert min(plain["faults"]) > 0.5 * pages, plain
    grown = [f for f in reused["faults"][1:] if f > 0.02 * pages]
    assert len(grown) <= len(reused["faults"][1:]) // 2, reused
    assert jp.tools.cpu.reuse_host_memory is cpu.reuse_host_memory


def test_entry_points_apply_it_when_asked_before_the_backends_start_and_never_after(monkeypatch):
    """experiments/*.py call ``experiment.reuse_cpu_host_memory()`` at start-up: with JAXPAR_REUSE_HOST_MEMORY=1 the
    settings in a fresh process, nothing (and no warning) in one whose backends started, as a notebook calling
    ``main`` twice; without it nothing (opt-in: the never-trimmed arena holds 3.6x the memory on 8 devices)."""
    from jaxpar import _compat
    from jaxpar.cli import experiment
    calls = []
    monkeypatch.setattr(experiment, "reuse_host_memory", lambda: calls.append(1))
    monkeypatch.setattr(_compat, "backends_initialized", lambda: False)
    monkeypatch.delenv("JAXPAR_REUSE_HOST_MEMORY", raising=False)
    experiment.reuse_cpu_host_memory()
    assert calls == []                                          # the default: off
    monkeypatch.setenv("JAXPAR_REUSE_HOST_MEMORY", "1")
    for started in (True, False):
        monkeypatch.setattr(_compat, "backends_initialized", lambda: started)
        experiment.reuse_cpu_host_memory()
    assert calls == [1]
    for script in ("charlm", "finetune", "digits", "prune_sweep"):
        text = open(os.path.join(os.path.dirname(__file__), "..", "experiments", f"{script}.py")).read()
        assert "experiment.reuse_cpu_host_memory()" in text, script
