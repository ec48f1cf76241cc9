"""jaxpar/plan/experts.py: the planner's mixture-of-experts figures against what jaxpar builds and compiles.

* parameter counts against the leaves of the model's own init (all experts, and k of them active);
* expert weights per device at expert-parallel 1/2/4/8 against the sharded state training builds on 8 devices;
* the dispatch's bytes over the expert axes against the collectives of the compiled MoE layer (forward and
  backward; ring and all-to-all, dropless and capacity mode), read through jaxpar's HLO reader;
* bad expert-parallel sizes refused before tracing.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar as jp
from jaxpar.layers.moe import MoEConfig, moe_mlp, param_axes, param_shapes
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.plan import experts

MOE = MoEConfig(num_experts=8, experts_per_token=2, expert_d_mlp=16)
CFG = LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_mlp=64, max_seq_len=16,
                  moe=MOE)
B, L, D, F = 8, 16, 32, 16        # the layer-alone cases: 128 tokens of width 32, experts of width 16


def _leaf_sizes(tree) -> dict[str, int]:
    """Elements per param name (summed over layers), the carried router state left out."""
    out: dict[str, int] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [getattr(k, "key", None) for k in path]
        if "moe_router" in keys:
            continue
        out[keys[-1]] = out.get(keys[-1], 0) + math.prod(x.shape)
    return out


def test_expert_params_and_their_memory_per_device_match_the_sharded_state():
    sizes = _leaf_sizes(nn.meta.unbox(jax.eval_shape(Llama(CFG).init, jax.random.key(0))))
    counts = experts.param_counts(CFG)
    routed = sum(v for k, v in sizes.items() if k.startswith("experts_"))
    assert counts["routed_experts"] == routed == 2 * 8 * 3 * D * F
    assert counts["router"] == sizes["router_kernel"] and counts["total"] == sum(sizes.values())
    assert counts["active"] == counts["total"] - routed + counts["active_routed"]
    assert counts["active_routed"] == routed * 2 // 8
    mesh = jp.make_mesh(data=2, fsdp=4)
    planned = experts.expert_memory(CFG, dict(mesh.shape))
    assert sorted(planned) == [1, 2, 4, 8]
    for ep, row in planned.items():
        state = jp.train.abstract_state(Llama(CFG).init, optax.sgd(0.1), mesh=mesh,
                                        rules=jp.sharding.expert_parallel_rules(mesh, ep))
        expert_leaves = {k: v for k, v in state.params["blocks"].items() if k.startswith("experts_")}
        measured = jp.plan.memory.sharded_bytes(expert_leaves)
        assert row["bytes"] == measured, (ep, row, measured)
        # params / EP, and embed over fsdp when fsdp is not an expert axis
        fsdp = 1 if "fsdp" in row["axes"] else 4
        assert measured == row["total_bytes"] / (ep * fsdp), (ep, row)
    # FLOPs: those of k experts a token; capacity mode capacity_factor times them (exact when the capacity
    # rounds evenly); ragged_dot as XLA lowers it E times them
    f = experts.moe_plan(dataclasses.replace(CFG, moe=dataclasses.replace(MOE, capacity_factor=1.25)),
                         dict(mesh.shape), global_batch=16, seq_len=16, expert_parallel=4)["flops"]
    assert f["useful"] == 2 * 6 * (16 * 16 / 8) * 2 * D * F    # 2 layers, 32 tokens a device, k = 2
    assert f["capacity"] == 1.25 * f["useful"] and f["ragged_lowered"] == 8 * f["useful"]
    with pytest.raises(ValueError, match="not divisible by expert_parallel=3"):
        experts.check_experts(CFG, dict(mesh.shape), 3)
    with pytest.raises(ValueError, match="choose 1 or 8"):
        experts.check_experts(CFG, dict(data=8), 4)
    with pytest.raises(ValueError, match="has no experts"):
        experts.check_experts(LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4), dict(fsdp=8), 2)


def compiled_layer(moe: MoEConfig, mesh, ep: int) -> str:
    """The compiled forward and backward of the MoE layer alone (float32) with the experts folded ``ep`` ways
    onto ``mesh``'s batch axes (the router kernel replicated, so only the dispatch moves data over them)."""
    rules = jp.sharding.expert_parallel_rules(mesh, ep).without_absent(mesh)
    rng = np.random.default_rng(0)
    spec = lambda k: P() if k == "router_kernel" else rules.spec(param_axes(moe)[k])
    w = {k: jax.device_put(rng.normal(size=s).astype(np.float32), NamedSharding(mesh, spec(k)))
         for k, s in param_shapes(moe, D, F).items()}
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    x, r = (jax.device_put(rng.normal(size=(B * L, D)).astype(np.float32), rows) for _ in range(2))

    def loss(w, x, r):     # a random projection of every output: no collective is folded away
        return jnp.sum(moe_mlp(moe, w, x, None, seq_len=L)[0] * r)
    with jp.sharding.use(mesh, rules):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(w, x, r).compile().as_text()


def check_dispatch(moe: MoEConfig, mesh, ep: int) -> tuple[dict, dict]:
    """``(compiled, predicted)`` payload bytes by kind over the expert axes; asserts they are equal, except
    that with the experts over every batch axis GSPMD may also gather the router statistics over them (one
    ``[B L, E]`` float32 array at most)."""
    sizes = dict(mesh.shape)
    axes = experts.expert_rules(sizes, ep).mesh_axes("experts")
    got = experts.dispatch_collectives(compiled_layer(moe, mesh, ep), sizes, axes)
    per_phase = experts.dispatch_bytes(moe, D, experts.tokens_per_device(sizes, B, L), ep, compute_bytes=4,
                                       group_len=L)
    want: dict[str, float] = {}
    for phase in per_phase.values():
        for kind, b in phase.items():
            want[kind] = want.get(kind, 0.0) + b
    every_batch_axis = set(axes) == {"data", "fsdp"}
    for kind, b in want.items():
        extra = got.get(kind, 0.0) - b
        assert extra == 0 or (every_batch_axis and 0 < extra <= B * L * MOE.num_experts * 4), (kind, got, want)
    return got, want


def test_ring_dispatch_bytes_match_the_compiled_layer():
    """Ring, EP 2 over fsdp on data=2 x fsdp=2: the all-gather and reduce-scatter bytes of the formula."""
    _, want = check_dispatch(MOE, jp.make_mesh(data=2, fsdp=2, devices=jax.devices()[:4]), 2)
    assert set(want) == {"all-gather", "reduce-scatter"} and want["all-gather"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["ring", "all_to_all"])
@pytest.mark.parametrize("capacity", [None, 1.25])
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_dispatch_bytes_match_the_compiled_layer(dispatch, capacity, ep):
    """Both dispatches, dropless and capacity mode, EP 2 (data), 4 (fsdp), 8 (data x fsdp) on data=2 x fsdp=4."""
    moe = MoEConfig(num_experts=8, experts_per_token=2, expert_d_mlp=F, capacity_factor=capacity, dispatch=dispatch)
    got, want = check_dispatch(moe, jp.make_mesh(data=2, fsdp=4), ep)
    assert want and all(got.get(k, 0) >= v > 0 for k, v in want.items())



@pytest.mark.slow  # one XLA:CPU compile of a 2-layer MoE Llama step (~10 CPU-s)
def test_plan_of_a_moe_llama_counts_active_flops_and_its_dispatch():
    """jp.plan.plan(..., expert_parallel=8) on data=8: the step's ring dispatch over data equals the formula for
    2 layers (GSPMD may add the router statistics' gather, experts being on every batch axis); the model FLOPs
    count the active parameters; the analytic step time has the dispatch's term."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, capacity_factor=1.25))
    plan = jp.plan.plan(cfg, dict(data=8), global_batch=16, seq_len=16, expert_parallel=8)
    x = plan.experts
    got = x["compiled"]["dispatch"]
    for kind in ("all-gather", "reduce-scatter"):
        want = x["dispatch"]["forward"][kind] + x["dispatch"]["backward"][kind]
        assert 0 <= got[kind] - want <= 2 * 16 * 16 * MOE.num_experts * 4, (kind, got, x["dispatch"])
    assert plan.flops["model"] == 6 * CFG.active_params() * 16 * 16 / 8 < 6 * CFG.num_params() * 16 * 16 / 8
    assert plan.analytic_time["comm_s_by_axis"]["experts"] > 0
    assert "experts: " in plan.report() and "EP 8" in plan.report()
