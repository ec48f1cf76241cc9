"""jaxpar/train/_jit.py: a step compiled on a mesh follows its inputs' shardings and refuses arrays donated to an
earlier call (jaxlib 0.10's CPU client can segfault on them) with a clear error; on CPU devices it compiles with
YNNPACK for dots only (reductions in XLA's loops), unless ``XLA_FLAGS`` says otherwise."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mlp_batch, mlp_parts

import jaxpar as jp
from jaxpar import _hlo
from jaxpar.train import _jit


def test_reusing_a_donated_state_is_a_clear_error(mesh):
    init_fn, loss_fn = mlp_parts()
    tx = optax.sgd(0.1)
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh)
    batch = mlp_batch(np.random.default_rng(0), 16)
    new, _ = step(state, batch)
    with pytest.raises(ValueError, match="donated"):
        step(state, batch)
    step(new, batch)  # the returned state works


def test_a_state_in_another_layout_is_accepted_by_the_same_step(mesh_factory):
    init_fn, loss_fn = mlp_parts()
    tx = optax.sgd(0.1)
    a, b = mesh_factory(data=2, fsdp=2, tensor=2), mesh_factory(fsdp=8)
    step = jp.train.make_train_step(loss_fn, tx, mesh=a, donate=False)
    batch = mlp_batch(np.random.default_rng(0), 16)
    ref, _ = step(jp.train.init_state(init_fn, tx, 0, mesh=a), batch)
    got, _ = step(jp.train.init_state(init_fn, tx, 0, mesh=b), batch)
    for x, y in zip(jax.tree.leaves(got.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def _ynn_fused_ops(hlo: str) -> set[str]:
    """The opcodes inside the computations that YNNPACK fusions call, in an optimized CPU module's text (read with
    jaxpar's one HLO reader)."""
    comps, _ = _hlo.parse_module(hlo)
    called = {c for instrs in comps.values() for i in instrs if '"__ynn_fusion"' in i.attrs
              for _, c in _hlo.callees(i)}
    return {i.opcode for c in called for i in comps.get(c, [])}


def test_cpu_steps_run_reductions_in_xla_loops_and_dots_in_ynnpack():
    """A step of a model defined here (an RMSNorm before a projection, a softmax loss): its dots are YNNPACK
    fusions, and no YNNPACK fusion holds a reduction (norm statistics, softmax, the loss), which XLA:CPU's
    default would fuse there; the step's loss equals a plain jax.grad of the same loss computed here."""
    def init_fn(rng):
        k1, k2 = jax.random.split(rng)
        return {"w": jax.random.normal(k1, (128, 128)) * 0.1, "v": jax.random.normal(k2, (128, 16)) * 0.1}

    def loss_fn(params, batch, rng=None):
        x = batch["x"] * jax.lax.rsqrt(jnp.mean(batch["x"] ** 2, -1, keepdims=True) + 1e-6)
        logits = jnp.tanh(x @ params["w"]) @ params["v"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1)), {}

    tx = optax.sgd(0.1)
    mesh = jp.make_mesh(data=1, devices=jax.devices()[:1])
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((64, 128)).astype(np.float32), "y": rng.integers(0, 16, 64).astype(np.int32)}
    hlo = step.lower(state, batch).compile().as_text()
    ops = _ynn_fused_ops(hlo)
    assert "dot" in ops and "reduce" not in ops, ops
    assert _jit.compiler_options(mesh) == _jit.CPU_COMPILER_OPTIONS
    params = jax.tree.map(np.asarray, state.params)
    _, metrics = step(state, batch)
    want = loss_fn(params, {k: jnp.asarray(v) for k, v in batch.items()})[0]
    np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-6)


def test_cpu_compile_option_yields_to_xla_flags_and_other_platforms(mesh, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=individual_dot,reduce")
    assert _jit.compiler_options(mesh) is None       # the user's setting stands
    monkeypatch.delenv("XLA_FLAGS")
    gpu_mesh = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="gpu")]))
    assert _jit.compiler_options(gpu_mesh) is None   # XLA's defaults off CPU
    assert _jit.compiler_options(mesh) == _jit.CPU_COMPILER_OPTIONS
