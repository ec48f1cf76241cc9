"""What XLA:GPU makes of a mixture of experts' train step on 8 compile-only H100s (jp.plan.plan with target=, no
GPU needed): the expert-parallel dispatch's collectives over the expert axes equal the planner's formula
(jaxpar.plan.experts.dispatch_bytes), ``jax.lax.ragged_dot`` becomes dense Triton GEMMs over a masked ``[R, E_l D]``
expansion (E times the useful FLOPs, no grouped-GEMM kernel), and the capacity form is dense batched GEMMs over
its buffers (capacity_factor times the useful FLOPs, no ragged op).

Each case compiles a 2-layer MoE Llama step once (about 10 CPU-s): the slow set. Skipped without the jax CUDA
plugin, as tests/plan/test_gpu_structure.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxpar as jp
from jaxpar.layers.moe import MoEConfig
from jaxpar.models.llama import LlamaConfig
from jaxpar.plan import targets

try:
    targets.check_cuda_plugin()
except ImportError as e:
    pytest.skip(f"the gpu extra is not installed: {e}", allow_module_level=True)

BATCH, SEQ, D, F, E, K = 16, 128, 256, 256, 8, 2
GEMM_KERNELS = ("__triton_gemm", "__triton_nested_gemm_fusion")
CASES = {   # name: (dispatch, capacity_factor, mesh sizes, expert-parallel size)
    "ring dropless EP 8": ("ring", None, dict(data=8), 8),
    "all_to_all dropless EP 8": ("all_to_all", None, dict(data=8), 8),
    "ring capacity EP 8": ("ring", 1.25, dict(data=8), 8),
    "ring dropless EP 4, fsdp 2": ("ring", None, dict(data=4, fsdp=2), 4),   # 2 experts a device
}


pytestmark = pytest.mark.usefixtures("no_persistent_cache")   # compile-only programs (tests/plan/conftest.py)


def config(dispatch: str, capacity: float | None) -> LlamaConfig:
    moe = MoEConfig(num_experts=E, experts_per_token=K, expert_d_mlp=F, capacity_factor=capacity, dispatch=dispatch)
    return LlamaConfig(vocab_size=256, d_model=D, num_layers=2, num_heads=4, num_kv_heads=2, d_mlp=512,
                       max_seq_len=SEQ, dtype=jnp.bfloat16, moe=moe)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_moe_step_on_h100s(case):
    dispatch, capacity, sizes, ep = CASES[case]
    cfg = config(dispatch, capacity)
    plan = jp.plan.plan(cfg, sizes, global_batch=BATCH, seq_len=SEQ, expert_parallel=ep,
                        target=jp.plan.gpu_target("h100"))
    x = plan.experts
    # the dispatch's collectives over the expert axes: the formula's kinds and bytes (forward + backward)
    want: dict[str, float] = {}
    for phase in ("forward", "backward"):
        for kind, b in x["dispatch"][phase].items():
            want[kind] = want.get(kind, 0.0) + b
    got = x["compiled"]["dispatch"]
    assert set(want) == ({"all-gather", "reduce-scatter"} if dispatch == "ring" else {"all-to-all"})
    assert {k: got.get(k) for k in want} == want, (case, got, want)
    dots, useful = x["compiled"]["dots"], x["flops"]["useful"]
    assert dots["grouped_gemm_calls"] == []                  # no grouped-GEMM kernel anywhere
    forward = lambda rows: sum(r["flops"] for r in rows if not r["backward"])
    if capacity is None:
        assert dots["ragged"] and not dots["capacity"]
        # every ragged_dot is a dense GEMM kernel: E times the useful FLOPs, forward and in the whole step
        assert all(r["kernel"] in GEMM_KERNELS for r in dots["ragged"]), dots["ragged"]
        assert forward(dots["ragged"]) == x["flops"]["ragged_lowered"] == E * useful
        assert dots["ragged_flops"] == pytest.approx(3 * E * useful, rel=0.01)
        # the gate/up GEMM reads the masked expansion [R, E_l D]: R = every gathered choice, E_l experts a device
        rows = ep * x["tokens_per_device"] * K
        expansion = f"bf16[{int(rows)},{E // ep * D}]"
        assert any(expansion in r["operands"] for r in dots["ragged"] if not r["backward"]), (expansion, dots)
    else:
        assert dots["capacity"] and not dots["ragged"]
        assert all(r["kernel"] in GEMM_KERNELS for r in dots["capacity"]), dots["capacity"]
        assert forward(dots["capacity"]) == x["flops"]["capacity"] == capacity * useful
