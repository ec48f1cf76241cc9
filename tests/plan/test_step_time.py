"""jaxpar/plan/step_time.py: a scheduled GPU program replayed kernel by kernel, collectives by NCCL's cost model."""

from __future__ import annotations

import math

import pytest

from jaxpar.plan import step_time

_PEAKS = step_time.Peaks(bf16_flops=1e15, fp8_flops=2e15, hbm_bytes_per_s=1e12, nvlink_bytes_per_s=4e11,
                         infiniband_bytes_per_s=5e10)

# Scheduled as XLA:GPU prints it: a gather started before a bf16 GEMM fusion and finished after it, an
# fp8 GEMM fusion, then a synchronous all-reduce over devices {0..3} and {4..7} (two hosts of 4 when host_of says
# so), all inside a loop of 3 trips.
_MODULE = """HloModule s

%mm (a: bf16[4096,4096], b: bf16[4096,4096]) -> bf16[4096,4096] {
  %a = bf16[4096,4096]{1,0} parameter(0)
  %b = bf16[4096,4096]{1,0} parameter(1)
  ROOT %d = bf16[4096,4096]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%mm8 (a: f8e4m3fn[4096,4096], b: f8e5m2[4096,4096]) -> bf16[4096,4096] {
  %a = f8e4m3fn[4096,4096]{1,0} parameter(0)
  %b = f8e5m2[4096,4096]{1,0} parameter(1)
  ROOT %d = bf16[4096,4096]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], bf16[4096,4096])) -> (s32[], bf16[4096,4096]) {
  %p = (s32[], bf16[4096,4096]{1,0}) parameter(0)
  %a = bf16[4096,4096]{1,0} get-tuple-element(%p), index=1
  %w = bf16[512,4096]{1,0} constant({...})
  %ag = ((bf16[512,4096]{1,0}), bf16[4096,4096]{1,0}) all-gather-start(%w), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %f = bf16[4096,4096]{1,0} fusion(%a, %a), kind=kCustom, calls=%mm
  %agd = bf16[4096,4096]{1,0} all-gather-done(%ag)
  %a8 = f8e4m3fn[4096,4096]{1,0} parameter(1)
  %b8 = f8e5m2[4096,4096]{1,0} parameter(2)
  %g = bf16[4096,4096]{1,0} fusion(%a8, %b8), kind=kCustom, calls=%mm8
  %r = f32[1024,1024]{1,0} parameter(3)
  %ar = f32[1024,1024]{1,0} all-reduce(%r), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], bf16[4096,4096]{1,0}) tuple(%i, %a)
}

%cond (p: (s32[], bf16[4096,4096])) -> pred[] {
  %p = (s32[], bf16[4096,4096]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: (s32[], bf16[4096,4096])) -> (s32[], bf16[4096,4096]) {
  %x = (s32[], bf16[4096,4096]{1,0}) parameter(0)
  ROOT %w = (s32[], bf16[4096,4096]{1,0}) while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_replay_hides_async_gathers_behind_kernels_and_exposes_synchronous_collectives():
    n = 4096
    mm = max(2 * n ** 3 / 1e15, 3 * n * n * 2 / 1e12)                        # compute-bound at the bf16 peak
    mm8 = max(2 * n ** 3 / 2e15, (n * n + n * n + n * n * 2) / 1e12)        # fp8 peak, or its bytes
    for hosts, link, spanned in (([0] * 8, 4e11, 1), ([0] * 4 + [1] * 4, 4e11, 1), ([0, 1] * 4, 5e10, 2)):
        payload, inter = 1024 * 1024 * 4, 2 * (spanned - 1)                  # f32[1024,1024] over groups of 4
        ring = (8.4 + (6 - inter) * 3.4 + inter * 9.6) * 1e-6 + payload * 6 / (4 * link)
        tree = 2 * ((4 / spanned - 1) * 28 + math.log2(spanned) * 50) * 1e-6 + 2 * payload / link
        reduce = min(ring, tree)
        two_hosts = len(set(hosts)) == 2                                      # the gather spans every device
        gather = ((8.4 + (7 - two_hosts) * 3.4 + two_hosts * 9.6) * 1e-6
                  + n * n * 2 * 7 / (8 * (5e10 if two_hosts else 4e11)))
        assert step_time.collective_seconds("all-reduce", payload, 4, spanned, _PEAKS) == pytest.approx(reduce)
        r = step_time.scheduled_time(_MODULE, {"fsdp": 8}, hosts, _PEAKS)
        assert (gather < mm) != two_hosts and r["compute_s"] == pytest.approx(3 * (mm + mm8))
        assert r["fp8_gemm_s"] == pytest.approx(3 * mm8) and r["gemm_s"] == r["compute_s"]
        # the gather hidden behind the bf16 GEMM where NVLink carries it, the all-reduce never
        assert r["step_s"] == pytest.approx(3 * (max(mm, gather) + mm8 + reduce))
        assert r["comm_s"] == pytest.approx(3 * (gather + reduce))
        kind = "infiniband" if spanned > 1 else "nvlink"
        assert r["comm_s_by"][f"all-reduce/fsdp/{kind}"] == pytest.approx(3 * reduce)
    with pytest.raises(ValueError, match="host_of has 4 entries"):
        step_time.scheduled_time(_MODULE, {"fsdp": 8}, [0] * 4, _PEAKS)


def test_pipeline_bubble_is_the_schedules_idle_share_of_the_kernels_and_the_parts_add_up_to_the_step():
    host_of = [0, 1] * 4                               # the all-reduce crosses hosts: some communication exposed
    plain = step_time.scheduled_time(_MODULE, {"fsdp": 8}, host_of, _PEAKS)
    r = step_time.scheduled_time(_MODULE, {"fsdp": 8}, host_of, _PEAKS, bubble_fraction=0.3)
    assert plain["bubble_s"] == 0.0 and plain["busy_s"] == plain["compute_s"]
    assert r["bubble_s"] == pytest.approx(0.3 * r["compute_s"]) and r["exposed_comm_s"] > 0
    assert r["busy_s"] + r["exposed_comm_s"] + r["bubble_s"] == pytest.approx(r["step_s"])
    with pytest.raises(ValueError, match=r"bubble_fraction=1.0 must lie in \[0, 1\)"):
        step_time.scheduled_time(_MODULE, {"fsdp": 8}, host_of, _PEAKS, bubble_fraction=1.0)


def _gpu_target_or_skip(hosts: int = 1):
    from jaxpar.plan import targets
    try:
        targets.check_cuda_plugin()
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"compiling for a GPU target needs the jax CUDA plugin (the gpu extra): {e}")
    return targets.gpu_target("h100", hosts=hosts)


@pytest.fixture(scope="module")
def gpu_steps():
    """The optimized H100 HLO of one small GPT train step under a bf16 policy and under bf16 with fp8 dots (FSDP
    over 2 hosts x 4 GPUs)."""
    import jax.numpy as jnp

    from jaxpar.models import GPTConfig
    from jaxpar.plan import planner
    from jaxpar.precision.policy import Policy
    from jaxpar.train import step as train
    target = _gpu_target_or_skip(hosts=2)
    mesh = target.mesh(data=2, fsdp=8)
    cfg = GPTConfig(d_model=256, num_layers=2, num_heads=4, vocab_size=1024, max_seq_len=256, positions="rotary",
                    scan_layers=True, dtype=jnp.bfloat16)
    out = {}
    for name, dot in (("bf16", None), ("fp8", "fp8")):
        model, tx, step, _ = planner.build_step(cfg, mesh)
        state = train.abstract_state(model.init, tx, mesh=mesh, policy=Policy(jnp.float32, jnp.bfloat16,
                                                                               jnp.float32, dot=dot))
        out[name] = step.lower(state, planner.batch_structs(32, 256)).compile().as_text()
    return target, mesh, out, cfg.num_params()


@pytest.mark.slow
def test_fp8_step_counts_the_flops_of_the_bf16_step_on_gpu_hlo(gpu_steps):
    from jaxpar import _hlo
    from jaxpar.plan import gpu_program
    target, mesh, text, num_params = gpu_steps
    stats = {k: _hlo.analyze(t, dict(mesh.shape)) for k, t in text.items()}
    assert stats["fp8"].flops == pytest.approx(stats["bf16"].flops, rel=0.01)
    fp8 = gpu_program.dots(text["fp8"])
    assert fp8["fp8_dots"] > 0 and fp8["fp8_triton_gemms"] + fp8["fp8_cublaslt_gemms"] == fp8["fp8_dots"]
    assert gpu_program.dots(text["bf16"])["fp8_dots"] == 0
    # the gradients reduce-scattered once per step: at most float32 bytes of every parameter (counting an async
    # start's (operands, results) tuple gave 9 times the operands on 8 devices)
    grads = sum(r["bytes"] for r in gpu_program.collectives(text["bf16"], dict(mesh.shape))
                if r["kind"] == "reduce-scatter")
    assert 0 < grads <= 4 * num_params
    host_of = [d.process_index for d in mesh.devices.flat]
    times = {k: step_time.scheduled_time(t, dict(mesh.shape), host_of, target) for k, t in text.items()}
    assert all(r["unknown_trip_counts"] == 0 and r["step_s"] >= r["compute_s"] > 0 for r in times.values())
    assert times["fp8"]["fp8_gemm_s"] > 0 == times["bf16"]["fp8_gemm_s"]
    assert any(k.endswith("/infiniband") for k in times["bf16"]["comm_s_by"])   # data spans the two hosts
