"""Bad input found by an adversarial tester: each is a clear error before tracing (or accepted, where a value of
another numeric type or a boxed params tree means the same), never a raw traceback from deep inside."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from helpers import SMALL_GPT
from jaxpar.models import GPT, GPTConfig

PLAN_GPT = GPTConfig(vocab_size=61, num_layers=2, num_heads=2, d_model=32, max_seq_len=16, remat="full",
                     scan_layers=True)


# ------------------------------------------------------------------------------------------------ the planner

def test_plan_subprocess_timeout_is_a_runtime_error_naming_the_fix():
    # 16 devices > the 8 of this process: planning needs the subprocess, which cannot start jax in 10 ms
    with pytest.raises(RuntimeError, match=r"did not finish within timeout=0.01 s; raise timeout="):
        jp.plan.plan(PLAN_GPT, dict(data=16), global_batch=16, seq_len=16, gpus_per_host=16, timeout=0.01)


@pytest.mark.parametrize("timeout", [-1, 0, math.nan, math.inf, "10", True])
def test_plan_rejects_bad_timeouts_up_front(no_compiling, timeout):
    with pytest.raises(ValueError, match=r"timeout=.* must be a positive finite number of seconds"):
        jp.plan.plan(PLAN_GPT, dict(data=8), global_batch=8, seq_len=16, timeout=timeout)


@pytest.mark.parametrize("fraction", [np.float32(0.5), np.float64(0.5), 0.5])
def test_memory_fraction_takes_any_real_number_type(fraction):
    got = jp.plan.estimate(PLAN_GPT, dict(data=np.int64(8)), global_batch=np.int32(8), seq_len=np.int64(16),
                           memory_fraction=fraction, gpus_per_host=np.int32(8), grad_accum_steps=np.int8(1))
    assert type(got["available_bytes"]) is float
    assert got["available_bytes"] == jp.plan.gpu("h100-80gb").memory_bytes * 0.5


@pytest.mark.parametrize("fraction", [np.float32(0.0), np.float32(np.nan), True, "0.5"])
def test_memory_fraction_still_refuses_values_outside_the_range(no_compiling, fraction):
    with pytest.raises(ValueError, match=r"memory_fraction=.* must be a number in \(0, 1\]"):
        jp.plan.estimate(PLAN_GPT, dict(data=8), global_batch=8, seq_len=16, memory_fraction=fraction)


def test_global_batch_refuses_a_bool(no_compiling):
    with pytest.raises(ValueError, match="global_batch=True must be a positive int"):
        jp.plan.estimate(PLAN_GPT, dict(data=1), global_batch=True, seq_len=16, num_devices=1)


def test_schedule_with_pipe_1_names_both_fixes(no_compiling):
    with pytest.raises(ValueError, match=r"schedule='1f1b' was given but the mesh has pipe=1 .*: pass "
                                         r"schedule=None, or a mesh with pipe > 1 and a schedule of that many stages"):
        jp.plan.estimate(PLAN_GPT, dict(data=8), global_batch=16, seq_len=16, schedule=jp.pipeline.one_f_one_b(1, 2))
    with pytest.raises(ValueError, match=r"was given but the mesh has pipe=1 .*: pass schedule=None, or a mesh with pipe=2"):
        jp.plan.plan(PLAN_GPT, dict(data=8), global_batch=16, seq_len=16, schedule=jp.pipeline.one_f_one_b(2, 2))


# ----------------------------------------------------------------------------------------- the pipeline runtime

def _stage(w, x):
    return jnp.tanh(x @ w)


def _loss(head, y, t):
    return jnp.mean((y @ head - t) ** 2)


@pytest.fixture
def pipe2(mesh_factory):
    mesh = mesh_factory(data=4, pipe=2)
    rng = np.random.default_rng(5)
    f = jp.pipeline.value_and_grad(_stage, _loss, jp.pipeline.one_f_one_b(2, 2), mesh=mesh)
    w = rng.normal(size=(2, 8, 8)).astype(np.float32)
    head = rng.normal(size=(8,)).astype(np.float32)
    return f, w, head, rng, mesh


def test_value_and_grad_needs_a_floating_x(pipe2):
    f, w, head, rng, mesh = pipe2
    x = rng.integers(0, 5, (16, 8)).astype(np.int32)
    with pytest.raises(TypeError, match="x has dtype int32: it must be a floating array .*differentiates with "
                                        "respect to x"):
        f(w, head, x, rng.normal(size=(16,)).astype(np.float32))


def test_value_and_grad_needs_one_array_x(pipe2):
    f, w, head, rng, mesh = pipe2
    x = rng.normal(size=(16, 8)).astype(np.float32)
    with pytest.raises(TypeError, match=r"x must be one array \[batch, \.\.\.\] .*got tuple"):
        f(w, head, (x, x), rng.normal(size=(16,)).astype(np.float32))
    apply = jp.pipeline.apply(_stage, jp.pipeline.one_f_one_b(2, 2), mesh=mesh)
    with pytest.raises(TypeError, match=r"x must be one array \[batch, \.\.\.\] .*got dict"):
        apply(w, {"x": x})


def test_float_tokens_into_a_gpt_pipeline_name_the_dtype(mesh_factory):
    model = GPT(dataclasses.replace(SMALL_GPT, d_model=32, num_heads=4, head_dim=0))
    mesh = mesh_factory(data=4, pipe=2)
    pipeline = jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, jp.pipeline.one_f_one_b(2, 2))
    tx = optax.sgd(0.1)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh, pipeline=pipeline)
    step = jp.train.make_train_step(pipeline, tx, mesh=mesh)
    rng = np.random.default_rng(2)
    batch = {"inputs": rng.normal(size=(8, 16)).astype(np.float32),
             "targets": rng.integers(0, SMALL_GPT.vocab_size, (8, 16)).astype(np.int32)}
    with pytest.raises(TypeError, match=r"batch\['inputs'\] has dtype float32.*token ids must be integers"):
        step(state, batch)


# ------------------------------------------------------------------------------------------------- compaction

TINY = GPTConfig(vocab_size=61, num_layers=2, num_heads=8, d_model=32, d_mlp=64, max_seq_len=16)


def _kept_mlp(seed: int, keep: int = 16):
    """Per layer, ``keep`` random mlp neurons (sorted) and the bool [layers, d_mlp] mask keeping them."""
    rng = np.random.default_rng(seed)
    index = np.stack([np.sort(rng.choice(TINY.d_mlp, keep, replace=False)) for _ in range(TINY.num_layers)])
    mask = np.zeros((TINY.num_layers, TINY.d_mlp), bool)
    np.put_along_axis(mask, index, True, axis=1)
    return index, {"blocks": {"mlp": mask}}


@pytest.mark.parametrize("multiple_of", [{"mpl": 2}, {"mlp": 2, "head": 2}, {"mlp": 0}])
def test_compact_rejects_unknown_or_bad_multiple_of(multiple_of):
    boxed = GPT(TINY).init(jax.random.key(0))
    _, masks = _kept_mlp(0)
    match = (r"multiple_of has unknown keys \['(mpl|head)'\]; its keys are the group axes \('mlp', 'heads'\)"
             if set(multiple_of) - {"mlp"} else "must be a positive int")
    with pytest.raises(ValueError, match=match):
        jp.pruning.compact(boxed, masks, TINY, multiple_of=multiple_of)


def test_compact_unboxes_boxed_params_as_init_state_does():
    boxed = GPT(TINY).init(jax.random.key(1))
    box = lambda x: isinstance(x, nn.Partitioned)
    assert any(box(x) for x in jax.tree.leaves(boxed, is_leaf=box))
    index, masks = _kept_mlp(1)
    new, cfg = jp.pruning.compact(boxed, masks, TINY, multiple_of={"mlp": 2})
    assert cfg.mlp_dim == 16 and cfg.num_heads == TINY.num_heads
    # the reference: each layer's leaves gathered by hand along their mlp axis (numpy, no jaxpar code)
    for (path, b), got in zip(jax.tree_util.tree_flatten_with_path(boxed, is_leaf=box)[0], jax.tree.leaves(new)):
        raw = np.asarray(b.value if box(b) else b)
        names = tuple(b.names) if box(b) else ()
        if "mlp" in names:
            axis = names.index("mlp") - 1       # within one layer (names[0] is "layers")
            want = np.stack([np.take(raw[l], index[l], axis=axis) for l in range(TINY.num_layers)])
        else:
            want = raw
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=jax.tree_util.keystr(path))
