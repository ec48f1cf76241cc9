"""Test setup: 8 simulated host CPU devices, set before jax is imported; a persistent compilation cache.

``XLA_FLAGS`` must hold ``--xla_force_host_platform_device_count=8`` before the first ``import jax`` anywhere
in the process, so this module sets it at import time (pytest imports conftest.py before any test module).
It also pins ``JAX_PLATFORMS=cpu`` (unless the caller set ``JAX_PLATFORMS``), so on a machine with a GPU
the sharded tests still run on 8 CPU devices instead of skipping or running on one GPU; the subprocesses
the tests start inherit both variables. Fewer than 8 devices is a usage error, never a skip.
"""

from __future__ import annotations

import os
import pathlib

_REPO = pathlib.Path(__file__).resolve().parents[1]
_FLAG = "--xla_force_host_platform_device_count=8"
# The tests' programs are tiny, so compiling dominates their time, and most of a CPU compile is LLVM optimising
# the generated code. Level 0 halves the suite's CPU time (measured: 88 -> 41 CPU-s on test_train.py plus
# models/test_generation.py). It changes only the machine code of the fusions; the HLO passes (sharding, fusion,
# collectives) and so every program the structure tests read, are the same; the last bits of float results may
# differ (LLVM fuses multiply-adds at its default level 3). A caller's own level is kept: .ci/run gives the slow set
# level 3, and XLA_FLAGS=--xla_backend_optimization_level=3 reproduces the default's digits (the parity lines).
_CODEGEN_FLAG = "--xla_backend_optimization_level=0"
_existing = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _existing:
    _existing = f"{_existing} {_FLAG}".strip()
if "xla_backend_optimization_level" not in _existing:
    _existing = f"{_existing} {_CODEGEN_FLAG}"
os.environ["XLA_FLAGS"] = _existing
_PLATFORMS_GIVEN = "JAX_PLATFORMS" in os.environ
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # an explicit JAX_PLATFORMS is kept (and must give 8 devices)

import jax  # noqa: E402  (after XLA_FLAGS on purpose)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", str(_REPO / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

NUM_DEVICES = 8


# The files whose fast cases take longest (GPT steps' compiles, subprocesses), longest first by measured CPU time:
# scripts/test.sh hands whole files to two workers in collection order (--dist loadfile --no-loadscope-reorder), so
# these start first and the last file a worker takes is a short one. Without this, xdist starts the files with the
# most tests first, and a long file with few tests can run alone at the end.
LONG_FILES = ("test_attention.py", "test_compiled_structure.py", "test_train.py", "test_parity.py",
              "models/test_layers.py", "test_checkpoint.py", "test_precision.py", "test_placement.py",
              "models/test_protocol.py", "test_optim.py", "pipeline/test_interpreter.py", "models/test_generation.py",
              "models/test_llama.py", "models/test_nnx_bridge.py", "test_sharding.py", "test_model_init.py",
              "pipeline/test_model.py", "models/test_batched_generation.py", "test_prune_experiments.py",
              "test_readme.py")


def _long_files_first(items) -> None:
    """Sorts ``items`` in place: the LONG_FILES in their order, then the other files by number of tests (most
    first, as xdist orders them by default); the order within a file is kept."""
    tests_dir = pathlib.Path(__file__).resolve().parent
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    counts: dict = {}
    for item in items:
        counts[item.path] = counts.get(item.path, 0) + 1

    def key(item):
        try:
            name = item.path.resolve().relative_to(tests_dir).as_posix()
        except ValueError:          # a test file outside tests/ (given on the command line)
            name = str(item.path)
        return rank.get(name, len(rank)), -counts[item.path], name
    items.sort(key=key)


def pytest_collection_modifyitems(config, items):
    """Fails loudly (once) unless there are 8 devices, instead of a confusing error (or a skip) in every test;
    orders the files for the two workers (:func:`_long_files_first`)."""
    del config
    _long_files_first(items)
    if jax.device_count() < NUM_DEVICES:
        raise pytest.UsageError(
            f"expected {NUM_DEVICES} devices, got {jax.device_count()} {jax.devices()[0].platform} device(s) "
            f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r}, XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}): either "
            "jax was imported before tests/conftest.py could set XLA_FLAGS (e.g. by a plugin; run pytest from the "
            "repository root), or JAX_PLATFORMS names a platform with fewer devices (unset it: the tests pin cpu)")
    if not _PLATFORMS_GIVEN and jax.devices()[0].platform != "cpu":
        raise pytest.UsageError(
            f"the tests pin JAX_PLATFORMS=cpu, but jax runs on {jax.devices()[0].platform}: jax was imported (and "
            "configured) before tests/conftest.py; run pytest from the repository root")


@pytest.fixture(scope="session")
def devices():
    """The 8 devices (conftest guarantees them: fewer is a usage error at collection)."""
    return jax.devices()[:NUM_DEVICES]


@pytest.fixture(scope="session")
def mesh_factory():
    """``mesh_factory(data=, pipe=, fsdp=, tensor=, context=)``: a jaxpar mesh over the first ``prod(sizes)`` devices.

    ``mesh_factory()`` (all sizes 1) is the single-device reference mesh.
    """
    import jaxpar as jp
    cache = {}

    def make(data: int = 1, pipe: int = 1, fsdp: int = 1, tensor: int = 1, context: int = 1):
        key = (data, pipe, fsdp, tensor, context)
        if key not in cache:
            n = data * pipe * fsdp * tensor * context
            cache[key] = jp.make_mesh(data=data, pipe=pipe, fsdp=fsdp, tensor=tensor, context=context,
                                      devices=jax.devices()[:n])
        return cache[key]
    return make


@pytest.fixture
def np_rng():
    return np.random.default_rng(1234)


@pytest.fixture
def no_compiling(monkeypatch):
    """Fails the test if the planner gets as far as building (tracing) a step or starting a subprocess."""
    import jaxpar as jp

    def refuse(*args, **kwargs):
        raise AssertionError("the planner started building a step: the error should have come first")
    monkeypatch.setattr(jp.plan.planner, "build_step", refuse)
    monkeypatch.setattr(jp.plan.planner, "_plan_in_subprocess", refuse)


@pytest.fixture
def mesh(mesh_factory):
    """The suite's 3-D mesh, data=2 x fsdp=2 x tensor=2 (a test file may define its own ``mesh``)."""
    return mesh_factory(data=2, fsdp=2, tensor=2)


@pytest.fixture(scope="session")
def adam_mlp():
    """``(init_fn, loss_fn, mesh, tx, batch)``: the suite's MLP on data=2 x fsdp=4 with ``optax.adam(1e-3)`` and a
    batch of 16 (nothing placed or compiled: tests build their own states and steps)."""
    import optax
    from helpers import mlp_batch, mlp_parts
    import jaxpar as jp
    init_fn, loss_fn = mlp_parts()
    mesh, tx = jp.make_mesh(data=2, fsdp=4, devices=jax.devices()[:8]), optax.adam(1e-3)
    return init_fn, loss_fn, mesh, tx, mlp_batch(np.random.default_rng(0), 16)
