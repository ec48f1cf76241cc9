"""jax/plan.py (jp.plan): AOT planning on simulated meshes (memory, FLOPs, collectives by axis, fit, errors)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar as jp
from jaxpar import _hlo as plan_hlo
from jaxpar.models import GPTConfig


TINY = GPTConfig(vocab_size=61, num_layers=2, num_heads=2, d_model=32, max_seq_len=16, remat="full",
                 scan_layers=True)


def test_plan_memory_equals_the_step_that_runs(mesh_factory, np_rng):
    sizes = dict(data=2, fsdp=2, tensor=2)
    planned = jp.plan.plan(TINY, sizes, global_batch=8, seq_len=16)
    assert planned.label == "XLA:CPU compilation" and planned.fits
    mesh = mesh_factory(**sizes)
    model, tx, step, _ = jp.plan.build_step(TINY, mesh)   # donating, as planned
    state = jp.train.init_state(model.init, tx, jax.random.key(0), mesh=mesh, policy=jp.plan.policy_of(TINY))
    tokens = np_rng.integers(0, TINY.vocab_size, (8, 17)).astype(np.int32)
    batch = jp.train.shard_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
    param_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))
    compiled = step.lower(state, batch).compile()
    new_state, metrics = compiled(state, batch)          # the program whose memory is compared runs
    assert np.isfinite(float(metrics["loss"])) and int(new_state.step) == 1
    m = compiled.memory_analysis()
    assert planned.memory["compiled_bytes"] == (m.argument_size_in_bytes + m.output_size_in_bytes
                                                - m.alias_size_in_bytes + m.temp_size_in_bytes)
    assert planned.memory["params_bytes"] == param_bytes
    assert 0.3 < planned.memory["ratio"] < 3
    assert planned.flops["hlo"] > planned.flops["cost_analysis"] * 0.99 > 0   # loop bodies by trip count
    assert set(planned.collectives) <= set(plan_hlo.COLLECTIVES)
    assert planned.time["step_s"] > 0 and 0 < planned.time["mfu"] < 1


def test_does_not_fit_gives_a_message_not_a_crash():
    cfg = GPTConfig(vocab_size=61, num_layers=2, num_heads=2, d_model=32, max_seq_len=16)
    p = jp.plan.plan(cfg, dict(data=8), global_batch=8, seq_len=16, memory_fraction=1e-6)
    assert not p.fits
    assert p.advice.startswith("does not fit: ") and "GiB needed per device" in p.advice and "try remat='full'" in p.advice
    assert p.advice in p.report()


HUGE = GPTConfig(vocab_size=32000, num_layers=80, num_heads=64, d_model=8192, max_seq_len=2048, remat="full",
                 scan_layers=True, dtype=jnp.bfloat16)


def _check_huge_advice(needed, advice):
    gib = 2 ** 30
    state = HUGE.num_params() * (4 + 4 + 8 + 2) / gib  # f32 params, grads, 2 moments, a bf16 compute copy
    assert needed / gib > state > 1000
    assert advice.startswith(f"does not fit: {needed / gib:.1f} GiB needed per device, {0.9 * 80e9 / gib:.1f} "
                             "available; try ")
    assert "fsdp=8, data=1" in advice and "more devices" in advice


def test_huge_model_does_not_fit_with_advice():
    est = jp.plan.estimate(HUGE, dict(data=8), global_batch=8, seq_len=2048)
    assert not est["fits"]
    _check_huge_advice(est["needed_bytes"], est["advice"])


@pytest.mark.slow   # ~7 CPU-s (the 80-layer step compiled); fast siblings: test_huge_model_does_not_fit_with_advice
def test_huge_model_plan_does_not_fit_with_advice():   # (the same advice), test_does_not_fit_gives_a_message_not_a_crash
    p = jp.plan.plan(HUGE, dict(data=8), global_batch=8, seq_len=2048)
    assert not p.fits
    _check_huge_advice(p.needed_bytes, p.advice)
    assert p.advice in p.report()


@pytest.mark.slow
def test_plan_64_devices_in_a_subprocess():
    cfg = GPTConfig(vocab_size=61, num_layers=2, num_heads=8, d_model=64, max_seq_len=16, remat="full",
                    scan_layers=True, dtype=jnp.bfloat16)
    p = jp.plan.plan(cfg, dict(data=2, fsdp=4, tensor=8), global_batch=16, seq_len=16)
    assert p.mesh == dict(data=2, pipe=1, fsdp=4, context=1, tensor=8) and p.memory["compiled_bytes"] > 0
    assert "tensor" in p.collectives["all-reduce"]


# ------------------------------------------------------------------------------------------------ hosts

def test_host_split_is_the_hybrid_mesh_split():
    # 3 hosts of 8: tensor (2) inside, fsdp=3 cannot share a host of 8 with it, data=4 fills the rest
    per, across = jp.plan.host_split(dict(data=4, pipe=1, fsdp=3, tensor=2), 8)
    assert per == dict(data=4, pipe=1, fsdp=1, context=1, tensor=2)
    assert across == dict(data=1, pipe=1, fsdp=3, context=1, tensor=1)
    per, across = jp.plan.host_split(dict(data=2, pipe=2, fsdp=8, tensor=2), 8)
    assert per == dict(data=1, pipe=1, fsdp=4, context=1, tensor=2)
    assert across == dict(data=2, pipe=2, fsdp=2, context=1, tensor=1)
    assert jp.plan.host_split(dict(data=2, pipe=1, fsdp=1, tensor=2), 8)[1] == dict(data=1, pipe=1, fsdp=1, context=1,
                                                                                    tensor=1)


def test_planning_mesh_puts_hosts_across_data():
    mesh = jp.plan.planning_mesh(dict(data=2, pipe=1, fsdp=2, tensor=2), gpus_per_host=4)
    host = np.vectorize(lambda d: d.id // 4)(mesh.devices)   # simulated hosts: 4 consecutive devices
    assert dict(mesh.shape) == dict(data=2, pipe=1, fsdp=2, context=1, tensor=2)
    assert (host[0] == host[0].flat[0]).all() and (host[1] == host[1].flat[0]).all()   # data=0 on one host, 1 on another
    assert host[0].flat[0] != host[1].flat[0]


def test_collectives_across_hosts_are_timed_on_infiniband():
    p = jp.plan.plan(TINY, dict(data=2, fsdp=2, tensor=2), global_batch=8, seq_len=16, gpus_per_host=4)
    assert p.hosts["across_hosts"] == dict(data=2, pipe=1, fsdp=1, context=1, tensor=1)
    spec = jp.plan.gpu("h100-80gb")
    ring = {"all-reduce": lambda g: 2 * (g - 1) / g, "all-gather": lambda g: (g - 1) / g,
            "reduce-scatter": lambda g: (g - 1) / g, "collective-permute": lambda g: 1.0}
    group = {"data": 2, "fsdp": 2, "tensor": 2, "data+fsdp": 4, "fsdp+tensor": 4, "data+tensor": 4,
             "data+fsdp+tensor": 8}
    expected = {}
    for kind, by_axes in p.collectives.items():
        for axes, nbytes in by_axes.items():
            link = spec.infiniband_bytes_per_s if "data" in axes else spec.nvlink_bytes_per_s
            expected[axes] = expected.get(axes, 0.0) + ring[kind](group[axes]) * nbytes / link
    assert "data" in expected and "tensor" in expected
    assert p.time["comm_s_by_axes"] == pytest.approx(expected, rel=1e-9)


# ----------------------------------------------------------------------------------------------- errors

TINY4 = GPTConfig(vocab_size=61, num_layers=4, num_heads=2, d_model=32, max_seq_len=16, remat="full",
                  scan_layers=True)


BAD_INPUTS = [   # (mesh_shape, plan kwargs, exception, message)
    (dict(data=8), dict(num_devices=16), ValueError, "multiplies to 8, not the 16 devices"),
    (dict(data=8), dict(num_devices=0), ValueError, "num_devices=0 must be a positive int"),
    (dict(data=0), {}, ValueError, "data=0 must be a positive int"),
    (dict(data=-8), {}, ValueError, "data=-8 must be a positive int"),
    (dict(data=8.0), {}, ValueError, "data=8.0 must be a positive int"),
    (dict(dat=8), {}, ValueError, r"unknown axes \['dat'\]"),
    ((8, 1, 1), {}, ValueError, "one size per axis"),
    (dict(data=8), dict(device="tpu-v5"), ValueError, "device='tpu-v5' is not in the datasheet table"),
    (dict(data=8), dict(global_batch=12), ValueError, r"global_batch=12 must be a positive int multiple of .* = 8$"),
    (dict(data=8), dict(global_batch=0), ValueError, "global_batch=0 must be a positive int multiple"),
    (dict(data=4, pipe=2), dict(schedule="1f1b-4"), ValueError, "not a jp.pipeline.Schedule"),
    (dict(data=4, pipe=2), dict(schedule=("one_f_one_b", 2, 4)), ValueError, "not a jp.pipeline.Schedule"),
    (dict(data=4, pipe=2), {}, ValueError, "pipe=2 needs a pipeline schedule"),
    (dict(data=8), dict(seq_len=0), ValueError, "seq_len=0 must be a positive int"),
    (dict(data=8), dict(seq_len=-16), ValueError, "seq_len=-16 must be a positive int"),
    (dict(data=8), dict(seq_len=32), ValueError, "exceeds GPTConfig.max_seq_len 16"),
    (dict(data=2, tensor=4), {}, ValueError, "num_heads 2 is not divisible by tensor=4"),
    (dict(data=12), {}, ValueError, "12 devices are not whole hosts of gpus_per_host=8"),
    (dict(data=4, tensor=2), dict(gpus_per_host=0), ValueError, "gpus_per_host=0 must be a positive int"),
    (dict(data=8), dict(grad_accum_steps=0), ValueError, "grad_accum_steps=0 must be a positive int"),
    (dict(data=8), dict(memory_fraction=0.0), ValueError, r"memory_fraction=0.0 must be a number in \(0, 1\]"),
    (dict(data=8), dict(memory_fraction=1.5), ValueError, r"memory_fraction=1.5 must be a number in \(0, 1\]"),
    (dict(data=2 ** 20), dict(global_batch=2 ** 20), ValueError, "at most 8192"),
]


@pytest.mark.parametrize("mesh_shape, kwargs, exc, match", BAD_INPUTS)
def test_bad_inputs_raise_before_compiling(no_compiling, mesh_shape, kwargs, exc, match):
    kwargs = dict(dict(global_batch=8, seq_len=16), **kwargs)
    with pytest.raises(exc, match=match):
        jp.plan.plan(TINY, mesh_shape, **kwargs)
    with pytest.raises(exc, match=match):
        jp.plan.estimate(TINY, mesh_shape, **kwargs)


def test_bad_models_and_schedules_raise_before_compiling(no_compiling):
    with pytest.raises(TypeError, match="model_config must be a model of the protocol .* got dict"):
        jp.plan.plan(dict(d_model=32), dict(data=8), global_batch=8, seq_len=16)
    with pytest.raises(ValueError, match="tensor=16 would span hosts of 8 GPUs"):
        jp.plan.plan(GPTConfig(num_heads=16, d_model=256, num_layers=2), dict(tensor=16), global_batch=8, seq_len=16)
    with pytest.raises(ValueError, match="tensor=8 would span hosts of 4 GPUs"):
        jp.plan.plan(GPTConfig(num_heads=8, d_model=64, num_layers=2), dict(tensor=8), global_batch=8, seq_len=16,
                     gpus_per_host=4)
    with pytest.raises(ValueError, match="tensor=3 would span hosts of 8 GPUs"):
        jp.plan.plan(GPTConfig(num_heads=3, d_model=48, num_layers=2), dict(data=2, tensor=3), global_batch=8,
                     seq_len=16)
    with pytest.raises(ValueError, match=r"4 stages x 1 chunks; it needs num_stages = pipe = 2"):
        jp.plan.plan(TINY4, dict(data=4, pipe=2), global_batch=16, seq_len=16, schedule=jp.pipeline.gpipe(4, 4))
    with pytest.raises(ValueError, match=r"num_layers \(2\) divisible by 4"):   # zbv: 2 chunks a stage
        jp.plan.plan(TINY, dict(data=4, pipe=2), global_batch=16, seq_len=16, schedule=jp.pipeline.zero_bubble_v(2, 2))
    # data x fsdp x microbatches = 2 x 2 x 4 = 16 rows: a batch of 8 cannot be split
    with pytest.raises(ValueError, match=r"grad_accum_steps x microbatches x data x fsdp = 1 x 4 x 2 x 2 = 16"):
        jp.plan.plan(TINY4, dict(data=2, pipe=2, fsdp=2), global_batch=8, seq_len=16,
                     schedule=jp.pipeline.one_f_one_b(2, 4))


def test_plan_subprocess_timeout_is_a_runtime_error_naming_the_fix():
    # 16 devices > the 8 of this process: planning needs the subprocess, which cannot start jax in 10 ms
    with pytest.raises(RuntimeError, match=r"did not finish within timeout=0.01 s; raise timeout="):
        jp.plan.plan(TINY, dict(data=16), global_batch=16, seq_len=16, gpus_per_host=16, timeout=0.01)


@pytest.mark.parametrize("timeout", [-1, 0, math.nan, math.inf, "10", True])
def test_plan_rejects_bad_timeouts_up_front(no_compiling, timeout):
    with pytest.raises(ValueError, match=r"timeout=.* must be a positive finite number of seconds"):
        jp.plan.plan(TINY, dict(data=8), global_batch=8, seq_len=16, timeout=timeout)


@pytest.mark.parametrize("fraction", [np.float32(0.5), np.float64(0.5), 0.5])
def test_memory_fraction_takes_any_real_number_type(fraction):
    got = jp.plan.estimate(TINY, dict(data=np.int64(8)), global_batch=np.int32(8), seq_len=np.int64(16),
                           memory_fraction=fraction, gpus_per_host=np.int32(8), grad_accum_steps=np.int8(1))
    assert type(got["available_bytes"]) is float
    assert got["available_bytes"] == jp.plan.gpu("h100-80gb").memory_bytes * 0.5


@pytest.mark.parametrize("fraction", [np.float32(0.0), np.float32(np.nan), True, "0.5"])
def test_memory_fraction_still_refuses_values_outside_the_range(no_compiling, fraction):
    with pytest.raises(ValueError, match=r"memory_fraction=.* must be a number in \(0, 1\]"):
        jp.plan.estimate(TINY, dict(data=8), global_batch=8, seq_len=16, memory_fraction=fraction)


def test_global_batch_refuses_a_bool(no_compiling):
    with pytest.raises(ValueError, match="global_batch=True must be a positive int"):
        jp.plan.estimate(TINY, dict(data=1), global_batch=True, seq_len=16, num_devices=1)


def test_schedule_with_pipe_1_names_both_fixes(no_compiling):
    with pytest.raises(ValueError, match=r"schedule='1f1b' was given but the mesh has pipe=1 .*: pass "
                                         r"schedule=None, or a mesh with pipe > 1 and a schedule of that many stages"):
        jp.plan.estimate(TINY, dict(data=8), global_batch=16, seq_len=16, schedule=jp.pipeline.one_f_one_b(1, 2))
    with pytest.raises(ValueError, match=r"was given but the mesh has pipe=1 .*: pass schedule=None, or a mesh with pipe=2"):
        jp.plan.plan(TINY, dict(data=8), global_batch=16, seq_len=16, schedule=jp.pipeline.one_f_one_b(2, 2))


LONG = GPTConfig(vocab_size=61, num_layers=2, num_heads=2, d_model=32, max_seq_len=1024, scan_layers=True)


def test_context_counts_in_the_estimate():
    """Splitting a long sequence over a context axis: the analytic activations per device fall by the context
    size (the tokens) and by the zigzag kernel's smaller key count; a sequence the zigzag split cannot cut is
    refused before compiling."""
    one, two = (jp.plan.estimate(LONG, dict(data=2, context=c), global_batch=2, seq_len=1024) for c in (1, 2))
    assert two["memory"]["activations"] < 0.6 * one["memory"]["activations"]
    assert "context" in two["time"]["comm_s_by_axis"] and "context" not in one["time"]["comm_s_by_axis"]
    with pytest.raises(ValueError, match=r"seq_len 1022 is not divisible by 2 x context = 4"):
        jp.plan.estimate(LONG, dict(data=4, context=2), global_batch=8, seq_len=1022)


# ~10 CPU-s (a compile); fast siblings: test_plan_memory_equals_the_step_that_runs (the plan's collectives by axis),
# test_attention.py::test_hlo_ring_passes_kv_round_the_ring[4] (the ring's K/V collective-permutes over context)
@pytest.mark.slow
def test_context_counts_in_the_compiled_plan():
    """The compiled plan of a mesh with a context axis holds the K/V ring's collective-permutes over it."""
    planned = jp.plan.plan(LONG, dict(data=4, context=2), global_batch=8, seq_len=1024, num_devices=8)
    assert planned.collectives["collective-permute"]["context"] > 0, planned.collectives


def test_estimate_takes_a_model_and_a_tx():
    """A model of the protocol stands for its config, and ``tx`` replaces the default AdamW: plain SGD keeps no
    optimizer state, AdamW two moments of the params' bytes."""
    import optax
    sizes, kw = dict(data=2, fsdp=2, tensor=2), dict(global_batch=8, seq_len=16)
    default = jp.plan.estimate(TINY, sizes, **kw)
    assert jp.plan.estimate(jp.models.GPT(TINY), sizes, **kw) == default
    sgd = jp.plan.estimate(jp.models.GPT(TINY), sizes, tx=optax.sgd(0.1), **kw)
    assert sgd["memory"]["opt_state"] == 0 < default["memory"]["opt_state"]
    assert math.isclose(default["memory"]["opt_state"], 2 * default["memory"]["params"], rel_tol=0.01)
    assert {k: v for k, v in sgd["memory"].items() if k != "opt_state"} == \
        {k: v for k, v in default["memory"].items() if k != "opt_state"}


def test_a_llama_is_planned_like_any_decoder():
    """Not only the GPT: the planner builds the step of the model a LlamaConfig builds (its state holds the Llama's
    params)."""
    cfg = jp.models.LlamaConfig(vocab_size=61, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32, d_mlp=64,
                                max_seq_len=16)
    model, _, _, state = jp.plan.build_step(cfg, jp.plan.planning_mesh(dict(data=2, fsdp=2, tensor=2), 8))
    assert isinstance(model, jp.models.Llama) and "k_kernel" in state.params["blocks"]
    est = jp.plan.estimate(cfg, dict(data=2, fsdp=2, tensor=2), global_batch=8, seq_len=16)
    assert est["memory"]["params"] > 0 and est["fits"]
