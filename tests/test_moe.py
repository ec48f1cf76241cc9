"""jaxpar/layers/moe.py and jaxpar/layers/expert_parallel.py: the mixture-of-experts layer against a reference
written here (a plain float32 loop over the experts, GShard's capacity as a loop over sequence positions), on one
device and with the experts split over 2, 4 and 8 simulated devices by both dispatches (ring, all-to-all),
composed with data, FSDP, expert-tensor and context parallelism: the loss (a random projection of the output
plus the auxiliary losses) and every gradient per leaf within 1e-5 relative.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SMALL_LLAMA, assert_scalar_close, assert_tree_close, run_isolated
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxpar as jp
from jaxpar import _hlo
from jaxpar.layers import expert_parallel
from jaxpar.layers.moe import MoEConfig, moe_mlp, param_axes, router_state
from jaxpar.models import Llama
from jaxpar.sharding.names import EXPERTS, Rules

D, F, B, L = 16, 8, 8, 8
ROUTING = {   # top-1 (Switch: the probability, not renormalised, which would make it 1 and leave the router only the
              # aux losses' gradient), top-2 (Mixtral / Qwen3-MoE), DeepSeek-V3 (sigmoid, groups, bias, scaling, shared)
    "top1": dict(num_experts=8, experts_per_token=1, norm_topk_prob=False, load_balance_coef=0.01, z_loss_coef=0.001),
    "top2": dict(num_experts=8, experts_per_token=2, load_balance_coef=0.01, z_loss_coef=0.001),
    "deepseek": dict(num_experts=8, experts_per_token=2, router="sigmoid", num_groups=4, topk_groups=2,
                     routed_scaling_factor=2.5, num_shared_experts=1, bias_update_rate=1e-3,
                     load_balance_coef=0.01),
}


# ------------------------------------------------------------------------------------------ the reference

def ref_choices(cfg: MoEConfig, w: dict, x_TD: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """numpy float64: each token's chosen experts ``[T, k]``, best first (selection scores plus bias, the top
    groups by the sum of their two best scores)."""
    logits = x_TD.astype(np.float64) @ np.asarray(w["router_kernel"], np.float64)
    if cfg.router == "softmax":
        s = np.exp(logits - logits.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
    else:
        s = 1 / (1 + np.exp(-logits))
    sel = s + bias
    T, E, G = sel.shape[0], cfg.num_experts, cfg.num_groups
    if G > 1:
        grouped = sel.reshape(T, G, E // G)
        group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
        best = np.argsort(-group_score, axis=-1, kind="stable")[:, :cfg.topk_groups]
        allowed = np.zeros((T, G), bool)
        np.put_along_axis(allowed, best, True, axis=-1)
        sel = np.where(np.repeat(allowed, E // G, axis=-1), sel, -np.inf)
    return np.argsort(-sel, axis=-1, kind="stable")[:, :cfg.experts_per_token]


def ref_kept(cfg: MoEConfig, choice_TK: np.ndarray, seq_len: int) -> np.ndarray:
    """GShard's capacity as a loop: per sequence, first choices before second, earlier positions first."""
    kept = np.ones(choice_TK.shape, bool)
    if cfg.capacity_factor is None:
        return kept
    C = math.ceil(cfg.capacity_factor * seq_len * cfg.experts_per_token / cfg.num_experts)
    for start in range(0, choice_TK.shape[0], seq_len):
        used = np.zeros(cfg.num_experts, int)
        for r in range(choice_TK.shape[1]):
            for t in range(start, start + seq_len):
                e = choice_TK[t, r]
                kept[t, r] = used[e] < C
                used[e] += 1
    return kept


def swiglu(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def ref_layer(cfg: MoEConfig, w: dict, x_TD, choice_TK: np.ndarray, kept_TK: np.ndarray):
    """Float32 JAX, differentiable in ``w`` and ``x``: the output ``[T, D]`` and the two auxiliary losses, the
    routing (choices, capacity) fixed as it is piecewise constant."""
    hp = jax.lax.Precision.HIGHEST
    logits = jnp.dot(x_TD, w["router_kernel"], precision=hp)
    scores = jax.nn.softmax(logits, -1) if cfg.router == "softmax" else jax.nn.sigmoid(logits)
    weights = jnp.take_along_axis(scores, jnp.asarray(choice_TK), axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    weights = weights * cfg.routed_scaling_factor
    y = jnp.zeros_like(x_TD)
    for e in range(cfg.num_experts):
        rows, ranks = np.nonzero((choice_TK == e) & kept_TK)
        if len(rows):
            out = swiglu(x_TD[rows], w["experts_gate_kernel"][e], w["experts_up_kernel"][e],
                         w["experts_down_kernel"][e])
            y = y.at[rows].add(weights[rows, ranks][:, None] * out)
    if cfg.num_shared_experts:
        y = y + swiglu(x_TD, w["shared_gate_kernel"], w["shared_up_kernel"], w["shared_down_kernel"])
    T, E = x_TD.shape[0], cfg.num_experts
    f = np.bincount(choice_TK.reshape(-1), minlength=E) / (T * cfg.experts_per_token)
    probs = scores if cfg.router == "softmax" else scores / scores.sum(-1, keepdims=True)
    balance = E * jnp.sum(f * probs.mean(0))
    z = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    return y, balance, z


# ------------------------------------------------------------------------------------------ the cases

class Case(NamedTuple):
    cfg: MoEConfig
    w: dict
    x: np.ndarray        # [B, L, D] float32
    proj: np.ndarray     # [D]
    state: dict          # the layer's moe_router collection


def make_case(routing: str, capacity: float | None, dispatch: str, seed: int = 0, *, num_experts: int = 8,
              dims: tuple[int, int, int, int] = (B, L, D, F)) -> Case:
    b, l, d, f = dims
    cfg = MoEConfig(**{**ROUTING[routing], "num_experts": num_experts}, expert_d_mlp=f, capacity_factor=capacity,
                    dispatch=dispatch)
    rng = np.random.default_rng(seed)
    w = {k: (rng.normal(size=shape) / np.sqrt(shape[-2])).astype(np.float32)
         for k, shape in jp.layers.moe.param_shapes(cfg, d, f).items()}
    state = router_state(cfg)
    if cfg.bias_update_rate:   # a bias that changes the selection (the weights never see it)
        state = {**state, "bias": jnp.asarray(rng.normal(size=cfg.num_experts) * 0.3, jnp.float32)}
    return Case(cfg, w, rng.normal(size=(b, l, d)).astype(np.float32), rng.normal(size=(d,)).astype(np.float32),
                state)


def reference(case: Case):
    """``(loss, grads of (w, x), counts, dropped)`` of the reference (dispatch plays no part: cached per case)."""
    key = (dataclasses.replace(case.cfg, dispatch="ring"), case.x.tobytes(), case.proj.tobytes(),
           np.asarray(case.state["bias"]).tobytes(), tuple(a.tobytes() for a in case.w.values()))
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(case)
    return _REFERENCES[key]


_REFERENCES: dict = {}


def _reference(case: Case):
    cfg, w, x, proj, state = case
    _, l, d = x.shape
    x_TD = x.reshape(-1, d)
    choice = ref_choices(cfg, w, x_TD, np.asarray(state["bias"], np.float64))
    kept = ref_kept(cfg, choice, l)

    def loss(w, x_TD):
        y, balance, z = ref_layer(cfg, w, x_TD, choice, kept)
        return jnp.mean(y @ proj) + cfg.load_balance_coef * balance + cfg.z_loss_coef * z

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, jnp.asarray(x_TD))
    counts = np.bincount(choice.reshape(-1), minlength=cfg.num_experts).astype(np.float32)
    return value, (grads[0], grads[1].reshape(x.shape)), counts, float(np.sum(~kept))


def layer_loss(cfg, proj, three_d):
    def loss(w, x, state):
        _, l, d = x.shape
        h = x if three_d else x.reshape(-1, d)
        y, stats = moe_mlp(cfg, w, h, state, seq_len=None if three_d else l)
        value = jnp.mean(y.reshape(-1, d) @ proj)
        return value + cfg.load_balance_coef * stats.load_balance_loss + cfg.z_loss_coef * stats.z_loss, stats
    return loss


def run_layer(case: Case, mesh=None, experts=(), three_d=False):
    """jaxpar's layer under ``mesh`` with the experts split over the mesh axes ``experts``: ``((loss, stats),
    grads of (w, x, state)), the compiled program's text``."""
    cfg, w, x, proj, state = case
    fn = jax.jit(jax.value_and_grad(layer_loss(cfg, proj, three_d), argnums=(0, 1, 2), has_aux=True))
    if mesh is None:
        compiled = fn.lower(w, x, state).compile()
        return compiled(w, x, state), compiled.as_text()
    rules = Rules((((EXPERTS, experts),) if experts else ()) + tuple(jp.sharding.DEFAULT_RULES)).without_absent(mesh)
    place = lambda tree, names: jax.device_put(tree, {k: NamedSharding(mesh, rules.spec(names[k])) for k in tree})
    w = place(w, param_axes(cfg))
    x = jax.device_put(x, NamedSharding(mesh, rules.spec(("batch", "seq", None))))
    with jp.sharding.use(mesh, rules):
        compiled = fn.lower(w, x, state).compile()
    return compiled(w, x, state), compiled.as_text()


def check_against_reference(case: Case, what: str, **layout) -> tuple[dict, str]:
    """Asserts the layer's loss, gradients, counts, dropped count and carried cotangent equal the reference's;
    returns the worst relative errors and the compiled program's text."""
    cfg = case.cfg
    ((value, stats), (gw, gx, gstate)), text = run_layer(case, **layout)
    ref_value, (ref_gw, ref_gx), counts, dropped = reference(case)
    errors = {"loss": assert_scalar_close(value, ref_value, rtol=1e-5, what=f"{what}: loss"),
              "grad w": assert_tree_close(gw, ref_gw, rtol=1e-5, what=f"{what}: weight gradients"),
              "grad x": assert_tree_close(gx, ref_gx, rtol=1e-5, what=f"{what}: input gradient")}
    np.testing.assert_array_equal(np.asarray(stats.counts), counts, err_msg=f"{what}: counts")
    assert float(stats.dropped) == dropped, (what, float(stats.dropped), dropped)
    if cfg.capacity_factor is None:
        assert float(np.sum(stats.counts)) == case.x.shape[0] * case.x.shape[1] * cfg.experts_per_token
        assert dropped == 0
    else:
        assert dropped > 0, f"{what}: the case drops no choice, so capacity is untested"
    # the carried collection's cotangent: this call's counts (summed by the step), its dropped count, rate 0
    np.testing.assert_array_equal(np.asarray(gstate["load"]), counts, err_msg=f"{what}: load cotangent")
    np.testing.assert_array_equal(np.asarray(gstate["bias"]), counts, err_msg=f"{what}: bias cotangent")
    assert float(gstate["dropped"]) == dropped and float(gstate["rate"]) == 0.0
    return errors, text


# ------------------------------------------------------------------------------------------ fast set

COLLECTIVES = {"ring": ("all-gather", "reduce-scatter"), "all_to_all": ("all-to-all",)}


@pytest.mark.parametrize("dispatch", ["ring", "all_to_all"])
def test_expert_parallel_layer_equals_the_loop_reference(dispatch):
    """One cheap case per dispatch: top-2 of 4 experts, capacity 1.0 (choices dropped), EP 2 over fsdp on
    data=2 x fsdp=2; the dispatch's collectives run over fsdp."""
    case = make_case("top2", 1.0, dispatch, num_experts=4, dims=(4, 4, 8, 4))
    mesh = jp.make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])
    _, text = check_against_reference(case, f"{dispatch}, EP 2", mesh=mesh, experts=("fsdp",))
    sites = _hlo.collective_sites(text, dict(mesh.shape))
    for kind in COLLECTIVES[dispatch]:
        assert any(s.kind == kind and s.axes == ("fsdp",) for s in sites), (dispatch, kind, sites)


def test_the_bias_changes_the_selection_and_not_the_weights():
    cfg, w, x, _, state = make_case("deepseek", None, "ring")
    h = jnp.asarray(x.reshape(-1, D))
    route = jax.jit(lambda bias: jp.layers.moe.route(cfg, w["router_kernel"], h, bias))
    with_bias, without = route(state["bias"]), route(jnp.zeros_like(state["bias"]))
    assert np.any(np.asarray(with_bias.expert) != np.asarray(without.expert)), "the bias changes the selection"
    np.testing.assert_array_equal(with_bias.expert, ref_choices(cfg, w, np.asarray(h), np.asarray(state["bias"])))
    scores = 1 / (1 + np.exp(-np.asarray(h, np.float64) @ w["router_kernel"]))   # the weights: the unbiased
    chosen = np.take_along_axis(scores, np.asarray(with_bias.expert), axis=-1)     # affinities of the choice
    want = cfg.routed_scaling_factor * chosen / chosen.sum(-1, keepdims=True)
    np.testing.assert_allclose(with_bias.weights, want, rtol=1e-6)


def test_router_update_steps_the_bias_towards_the_underloaded_experts():
    old = {"bias": jnp.array([[0.5, 0.0, -0.5, 0.0]]), "load": jnp.zeros((1, 4)), "dropped": jnp.zeros(1),
           "rate": jnp.array([0.25])}
    total = {"bias": jnp.array([[9.0, 1, 3, 3]]), "load": jnp.array([[9.0, 1, 3, 3]]), "dropped": jnp.array([2.0]),
             "rate": jnp.zeros(1)}
    new = jax.jit(jp.layers.moe.update_router)(old, total)   # mean load 4: 9 over, 1 and 3 under
    np.testing.assert_array_equal(new["bias"], [[0.25, 0.25, -0.25, 0.25]])
    np.testing.assert_array_equal(new["load"], total["load"])
    assert float(new["dropped"][0]) == 2.0 and float(new["rate"][0]) == 0.25


def test_capacity_priority_follows_the_tokens_positions_not_the_zigzag_layout():
    """Sequences of 16 in context parallelism's zigzag layout over 2 devices (positions from
    ``jaxpar.layers.attention.zigzag_order``) keep the choices the loop reference keeps in token order; counted in
    the layout's order they would not."""
    cfg = MoEConfig(num_experts=4, experts_per_token=2, capacity_factor=0.5)
    choice = np.argsort(np.random.default_rng(5).random((3, 16, 4)), axis=-1)[..., :2]   # distinct per token
    kept = ref_kept(cfg, choice.reshape(-1, 2), 16).reshape(choice.shape)
    order = jp.layers.attention.zigzag_order(16, 2)
    slots = jax.jit(lambda e: tuple(jp.layers.moe.capacity_slots(cfg, e, positions=p)[0] for p in (None, order)))
    by_layout, by_position = slots(choice[:, order])
    capacity = cfg.capacity(16)
    assert not np.array_equal(np.asarray(by_layout) < capacity, kept[:, order]), "the case tells the orders apart"
    np.testing.assert_array_equal(np.asarray(by_position) < capacity, kept[:, order])
    assert capacity == 4 and not kept.all()


def test_ragged_dot_and_its_gradients_on_this_jax():
    """``jax.lax.ragged_dot`` on this jax's CPU backend: rows past the groups give 0; both gradients equal a
    per-row gather of the expert weights."""
    k1, k2 = jax.random.split(jax.random.key(3))
    x, w = jax.random.normal(k1, (10, 4)), jax.random.normal(k2, (3, 4, 5))
    sizes = jnp.array([3, 0, 5], jnp.int32)
    group = np.array([0, 0, 0, 2, 2, 2, 2, 2, -1, -1])
    loss = lambda x, w: jnp.sum(jnp.sin(jax.lax.ragged_dot(x, w, sizes)))
    ref = lambda x, w: jnp.sum(jnp.sin(jnp.where((group >= 0)[:, None], jnp.einsum(
        "td,tdf->tf", x, w[np.maximum(group, 0)], precision=jax.lax.Precision.HIGHEST), 0)))
    (value, grads), (ref_value, ref_grads) = (jax.jit(jax.value_and_grad(f, (0, 1)))(x, w) for f in (loss, ref))
    assert_scalar_close(value, ref_value, rtol=1e-6, what="ragged_dot")
    assert_tree_close(grads, ref_grads, rtol=1e-6, what="its gradients")


def bf16_layer_grad(case: Case):
    """The bfloat16 layer's gradient of :func:`layer_loss` (no router state) with respect to ``(w, x)``."""
    loss = layer_loss(case.cfg, case.proj, False)
    return jax.jit(jax.grad(lambda w, x: loss(w, x, None)[0], argnums=(0, 1)))


def test_bf16_gradients_are_summed_in_float32_inside_the_dispatch_region():
    """A bfloat16 layer on data=2 x fsdp=2 x tensor=2, experts over fsdp (the dispatch's region is manual over
    data, fsdp and tensor, automatic over the rest): every reduction of its gradient in the region (the weights'
    sum over data, the tokens' over tensor, the gathered tokens' reduce-scatter over fsdp) sums in float32. A
    16-bit one there aborts XLA:CPU (``_compat.vary_16bit_safe``); the run itself: the slow test below. Lowered
    only."""
    case = make_case("top2", None, "ring", num_experts=4, dims=(4, 4, 8, 4))
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2)
    rules = ((EXPERTS, "fsdp"), *jp.sharding.DEFAULT_RULES)
    bf16 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), tree)
    with jp.sharding.use(mesh, rules):
        text = bf16_layer_grad(case).lower(bf16(case.w), bf16(case.x)).as_text()
    reductions = _hlo.stablehlo_reductions(text)
    assert {"all_reduce", "reduce_scatter"} <= {kind for kind, _ in reductions}, reductions
    assert all(dtype == "f32" for _, dtype in reductions), reductions


BF16_LAYER_DRIVER = """
import json
import jax, jax.numpy as jnp, numpy as np
import jaxpar as jp
from helpers import max_rel_err
from test_moe import Case, make_case, run_layer
LAYOUTS = {"data2, ring": (dict(data=2), (), "ring", None),
           "dp2-fsdp2-tp2, EP2 fsdp, all_to_all": (dict(data=2, fsdp=2, tensor=2), ("fsdp",), "all_to_all", None),
           "dp2-fsdp2-tp2, EP4, ring, capacity": (dict(data=2, fsdp=2, tensor=2), ("data", "fsdp"), "ring", 1.0)}
out = {}
for name, (sizes, experts, how, capacity) in LAYOUTS.items():
    case = make_case("top2", capacity, how, seed=3, num_experts=4)
    cast = lambda tree, dtype: jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16).astype(dtype), tree)
    mesh = jp.make_mesh(**sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])
    runs = {}
    for dtype in (jnp.float32, jnp.bfloat16):   # the same bf16-rounded values: the router chooses alike
        runs[dtype.__name__] = run_layer(case._replace(w=cast(case.w, dtype), x=cast(case.x, dtype)), mesh=mesh,
                                         experts=experts)[0]
    ((v32, s32), (gw32, gx32, _)), ((v16, s16), (gw16, gx16, _)) = runs["float32"], runs["bfloat16"]
    grads = max(map(max_rel_err, jax.tree.leaves((gw16, gx16)), jax.tree.leaves((gw32, gx32))))
    out[name] = {"loss": abs(float(v16) - float(v32)) / abs(float(v32)), "grads": grads, "dtype": str(gx16.dtype),
                 "same counts": bool(np.array_equal(s32.counts, s16.counts))}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow   # a subprocess of 6 compiles: ~40 s
def test_bf16_layer_runs_and_equals_float32_under_data_fsdp_tensor_and_expert_parallelism():
    """The bfloat16 layer's loss and gradients (in a subprocess: a 16-bit reduction in the dispatch's region aborted
    XLA:CPU) on data=2 (ring), data=2 x fsdp=2 x tensor=2 with EP 2 (all-to-all) and EP 4 (ring, capacity mode),
    from bf16-rounded weights and tokens, equal the float32 layer's on the same values within bf16 rounding."""
    result = run_isolated(BF16_LAYER_DRIVER)
    for name, r in result.items():
        print(f"BF16 {name}: loss {r['loss']:.2e}, grads {r['grads']:.2e}")
        assert r["same counts"] and r["dtype"] == "bfloat16", (name, r)
        assert r["loss"] <= 2e-2 and r["grads"] <= 3e-2, (name, r)   # bf16: 8 mantissa bits, sums rounded


BAD = [
    (dict(num_experts=4, experts_per_token=5), "experts_per_token=5 > num_experts=4"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0 must be None"),
    (dict(capacity_factor=-1.25), "capacity_factor=-1.25"),
    (dict(num_groups=4, topk_groups=5), "topk_groups=5 > num_groups=4"),
    (dict(num_experts=6, num_groups=4), "num_experts=6 is not divisible by num_groups=4"),
    (dict(router="relu"), "router='relu'"),
    (dict(dispatch="ragged"), "dispatch='ragged'"),
    (dict(load_balance_coef=-0.1), "load_balance_coef=-0.1 must be a finite number >= 0"),
    (dict(z_loss_coef=-1.0), "z_loss_coef=-1.0"),
    (dict(bias_update_rate=-1e-3), "bias_update_rate=-0.001"),
    (dict(num_experts=8, experts_per_token=4, num_groups=8, topk_groups=2), "raise topk_groups"),
    (dict(routed_scaling_factor=0), "routed_scaling_factor=0"),
    (dict(shared_d_mlp=8), "shared_d_mlp=8 without shared experts"),
    (dict(capacity_factor=float("nan")), "capacity_factor=nan"),
]


def test_numpy_scalars_are_numbers_too():
    cfg = MoEConfig(capacity_factor=np.float32(1.25), load_balance_coef=np.float64(1e-2), experts_per_token=np.int64(2))
    assert cfg.capacity(16) == 5   # ceil(1.25 * 16 * 2 / 8)


@pytest.mark.parametrize("kwargs, message", BAD)
def test_bad_configs_are_refused_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        MoEConfig(**kwargs)


def test_experts_not_divisible_by_the_expert_parallel_size_and_a_bias_without_its_mode_are_refused():
    mesh = jp.make_mesh(data=2, fsdp=4)
    rules = ((EXPERTS, ("data", "fsdp")), *jp.sharding.DEFAULT_RULES)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the expert-parallel size 8"):
        expert_parallel.check_expert_parallel(6, mesh, rules)
    with pytest.raises(ValueError, match="expert parallelism folds onto the batch"):
        expert_parallel.check_expert_parallel(8, jp.make_mesh(data=2, tensor=4), ((EXPERTS, "tensor"),
                                                                                    *jp.sharding.DEFAULT_RULES))
    assert expert_parallel.check_expert_parallel(8, mesh, rules) == 8
    with pytest.raises(ValueError, match="a router bias without the aux-free mode"):
        jp.layers.moe.check_router_bias(MoEConfig(), np.array([0, 0.1] + [0] * 6))
    case = make_case("top2", 1.0, "ring", num_experts=4, dims=(2, 4, 8, 4))   # capacity where a device holds
    region = jax.shard_map(lambda x: moe_mlp(case.cfg, case.w, x, None)[0], mesh=jp.make_mesh(context=8),
                           in_specs=P(None, "context"), out_specs=P(None, "context"))   # part of each sequence
    with pytest.raises(ValueError, match=r"manual over the sequence's mesh axes .* use dropless routing"):
        jax.eval_shape(region, jax.ShapeDtypeStruct((2, 8, 8), jnp.float32))


def test_a_stored_router_bias_without_the_aux_free_mode_is_refused_before_tracing():
    """A train state whose router bias is non-zero where its rate is 0 (``bias_update_rate=0``: a bias that would
    select experts and never move): the step refuses it on its first call, naming the layer, before the loss is
    traced; the same bias with a rate passes. A Llama with experts applied outside ``jit`` to params holding such a
    bias refuses them at its config."""
    model, tx = MoEStack(MoEConfig(num_experts=4, experts_per_token=2)), optax.sgd(0.1)
    state = jp.train.init_state(model.init, tx, 0, mesh=jp.make_mesh(devices=jax.devices()[:1]), report=False)
    router = state.carried["blocks"]["moe_router"]
    bad = {**router, "bias": router["bias"].at[1, 2].set(0.1)}
    traced = []
    step = jp.train.make_train_step(lambda p, b, rng=None: traced.append(1) or model.loss(p, b), tx,
                                    mesh=jp.make_mesh(devices=jax.devices()[:1]), donate=False)
    with pytest.raises(ValueError, match=r"a router bias without the aux-free mode: .*non-zero \(layers \[1\]\)"):
        step(state.replace(carried={"blocks": {"moe_router": bad}}), stack_batches(model, 0, 1)[0])
    assert not traced, "the step traced the loss before refusing the state"
    jp.train.carried.check_values({"blocks": {"moe_router": {**bad, "rate": router["rate"] + 1e-3}}})

    cfg = dataclasses.replace(SMALL_LLAMA, num_layers=1, moe=MoEConfig(num_experts=4))
    llama = Llama(cfg)
    shapes = nn.meta.unbox(jax.eval_shape(llama.init, jax.random.key(0)))
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    params["blocks"]["moe_router"]["bias"][0, 3] = -0.2
    with pytest.raises(ValueError, match="a router bias without the aux-free mode.*bias_update_rate is 0"):
        llama.apply(params, np.zeros((1, 4), np.int32))


# ------------------------------------------------------------------------------------------ the matrix

@pytest.mark.slow   # 6 compiles
@pytest.mark.parametrize("capacity", [None, 1.0])
@pytest.mark.parametrize("routing", list(ROUTING))
def test_one_device_layer_equals_the_loop_reference(routing, capacity):
    case = make_case(routing, capacity, "ring", seed=1)
    errors, _ = check_against_reference(case, f"one device, {routing}, capacity {capacity}")
    print(f"PARITY one device, {routing}, capacity {capacity}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))


LAYOUTS = {   # name: (mesh sizes, expert axes, [B, L, D] tokens with L over context)
    "dp2-fsdp2-tp2, EP2 fsdp": (dict(data=2, fsdp=2, tensor=2), ("fsdp",), False),
    "dp2-fsdp2-tp2, EP4 data x fsdp": (dict(data=2, fsdp=2, tensor=2), ("data", "fsdp"), False),
    "dp8, EP8": (dict(data=8), ("data",), False),
    "dp2-fsdp2-context2, EP4": (dict(data=2, fsdp=2, context=2), ("data", "fsdp"), True),
    "fsdp2-context2-tp2, EP4 fsdp x context": (dict(fsdp=2, context=2, tensor=2), ("fsdp", "context"), True),
}


@pytest.mark.slow   # ~60 compiles: every layout x dispatch x mode x routing
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dispatch", ["ring", "all_to_all"])
@pytest.mark.parametrize("capacity", [None, 1.0])
@pytest.mark.parametrize("routing", list(ROUTING))
def test_expert_parallel_matrix_equals_the_loop_reference(routing, capacity, dispatch, layout):
    sizes, experts, three_d = LAYOUTS[layout]
    case = make_case(routing, capacity, dispatch, seed=len(layout) + len(routing))
    mesh = jp.make_mesh(**sizes)
    what = f"{routing}, {'dropless' if capacity is None else f'capacity {capacity}'}, {dispatch}, {layout}"
    errors, _ = check_against_reference(case, what, mesh=mesh, experts=experts, three_d=three_d)
    print(f"PARITY {what}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))


# ------------------------------------------------------------------------- the layer in a model, trained

class MoEStack:
    """A model defined here: a linear embedding of float features, residual MoE MLP layers stacked under
    ``blocks`` (each with its ``moe_router`` collection), a linear head with cross-entropy."""
    stage_key = "blocks"

    def __init__(self, cfg: MoEConfig, layers: int = 2, d: int = 8, f: int = 4, features: int = 5, classes: int = 7):
        self.cfg, self.layers, self.d, self.f, self.features, self.classes = cfg, layers, d, f, features, classes

    def init(self, key):
        keys = jax.random.split(key, self.layers + 2)
        blocks = [jp.layers.moe.init_params(self.cfg, self.d, self.f, k) for k in keys[:self.layers]]
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *blocks)
        stacked["moe_router"] = jax.tree.map(lambda a: jnp.stack([a] * self.layers), router_state(self.cfg))
        return {"embed": jax.random.normal(keys[-2], (self.features, self.d)), "blocks": stacked,
                "head": jax.random.normal(keys[-1], (self.d, self.classes)) / np.sqrt(self.d)}

    def embed(self, params, inputs):
        return inputs @ params["embed"]

    def stage(self, blocks, x):
        def layer(x, block):
            block = dict(block)
            y, _ = moe_mlp(self.cfg, block, x, block.pop("moe_router"))
            return x + y, None
        return jax.lax.scan(layer, x, blocks)[0]

    def head_loss(self, params, x, targets):
        logits = x @ params["head"]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]), {}

    def loss(self, params, batch, rng=None):
        x = self.stage(params["blocks"], self.embed(params, batch["inputs"]))
        return self.head_loss(params, x, batch["targets"])


def stack_batches(model: MoEStack, seed: int, n: int, rows: int = 8, seq: int = 4) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"inputs": rng.normal(size=(rows, seq, model.features)).astype(np.float32),
             "targets": rng.integers(0, model.classes, (rows, seq), dtype=np.int32)} for _ in range(n)]


def train_stack(model, grad_fn, mesh, batches, **kwargs):
    """``(state, losses, the carried router state after each step)``."""
    tx = optax.sgd(0.1)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh, report=False, **kwargs.pop("init", {}))
    step = jp.train.make_train_step(grad_fn, tx, mesh=mesh, donate=False, **kwargs)
    losses, routers = [], []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
        routers.append(jax.device_get(state.carried["blocks"]["moe_router"]))
    return state, losses, routers


def check_routers(model, routers, batches):
    """The carried router state after each step against a hand computation: each step's global load adds up to
    every token's k choices in each layer, nothing is dropped when dropless (some are, with capacity), the bias
    is the previous one plus the rate times the sign of (mean load - load) of that step's load."""
    bias = np.zeros((model.layers, model.cfg.num_experts), np.float32)
    rate = np.float32(model.cfg.bias_update_rate)
    for router, batch in zip(routers, batches):
        load = router["load"]
        choices = batch["targets"].size * model.cfg.experts_per_token
        np.testing.assert_array_equal(load.sum(-1), [choices] * model.layers)
        assert np.all(router["rate"] == rate)
        assert np.all(router["dropped"] == 0) if model.cfg.capacity_factor is None else np.any(router["dropped"] > 0)
        bias = bias + rate * np.sign(load.mean(-1, keepdims=True) - load)
        np.testing.assert_array_equal(router["bias"], bias)
    assert np.any(routers[0]["bias"] != 0), "the bias moved"


@pytest.mark.slow   # ~10 s: the step with EP 2 and accumulation, and on one device
def test_router_state_through_the_step_with_expert_parallelism_and_accumulation_equals_one_device():
    model = MoEStack(MoEConfig(num_experts=4, experts_per_token=2, expert_d_mlp=4, bias_update_rate=0.1))
    batches = stack_batches(model, 4, 3)
    mesh = jp.make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])
    rules = ((EXPERTS, "fsdp"), *jp.sharding.DEFAULT_RULES)
    state, losses, routers = train_stack(model, model.loss, mesh, batches, rules=rules, grad_accum_steps=2,
                                         init={"rules": rules})
    one = jp.make_mesh(data=1, devices=jax.devices()[:1])
    ref, ref_losses, ref_routers = train_stack(model, model.loss, one, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_tree_close(state.params, ref.params, rtol=1e-5, what="params after two steps")
    check_routers(model, routers, batches)
    assert_tree_close(routers, ref_routers, rtol=0.0, what="router state")


@pytest.mark.slow   # ~15 s each: a 1F1B pipeline of 2 stages over data=2 x pipe=2, and one device
@pytest.mark.parametrize("capacity", [None, 1.0])
def test_moe_layers_in_a_1f1b_pipeline_equal_one_device(capacity):
    """Inside the stages (manual over pipe and data) each device runs every expert on its rows: the pipeline
    gathers the expert weights as any stage weight; the routers' counts are summed over microbatches and rows."""
    model = MoEStack(MoEConfig(num_experts=4, experts_per_token=2, expert_d_mlp=4, bias_update_rate=0.1,
                               capacity_factor=capacity))
    batches = stack_batches(model, 5, 3)
    mesh = jp.make_mesh(data=2, pipe=2, devices=jax.devices()[:4])
    pipe = jp.pipeline.Pipeline.from_model(model, jp.pipeline.one_f_one_b(2, 4))
    rules = ((EXPERTS, "data"), *jp.sharding.DEFAULT_RULES)   # the experts' weights split over data (EP 2)
    state, losses, routers = train_stack(model, pipe, mesh, batches, rules=rules, init={"rules": rules})
    one = jp.make_mesh(data=1, devices=jax.devices()[:1])
    ref, ref_losses, ref_routers = train_stack(model, model.loss, one, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_tree_close(state.params, ref.params, rtol=1e-5, what="pipelined params after two steps")
    check_routers(model, routers, batches)
    assert_tree_close(routers, ref_routers, rtol=0.0, what="pipelined router state")


@pytest.mark.slow   # one compile
@pytest.mark.parametrize("dispatch", ["ring", "all_to_all"])
def test_layer_inside_a_region_already_manual_over_its_axes_uses_them(dispatch):
    """Called inside a user's ``shard_map`` manual over data and fsdp, with rules still splitting the experts
    over fsdp: the layer opens no region of its own and dispatches over the manual fsdp axis, from the whole
    weights it is given; the loss and gradients equal the reference's."""
    case = make_case("top2", None, dispatch, seed=7)
    mesh = jp.make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])
    rules = ((EXPERTS, "fsdp"), *jp.sharding.DEFAULT_RULES)
    rows = P(("data", "fsdp"))

    def loss(w, x):
        def local(w, x):
            y, _ = moe_mlp(case.cfg, w, x.reshape(-1, D), None, seq_len=L)
            return jax.lax.psum(jnp.sum(y @ case.proj), ("data", "fsdp"))
        return jax.shard_map(local, in_specs=(P(), rows), out_specs=P())(w, x) / (B * L)

    with jp.sharding.use(mesh, rules):
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(case.w, case.x)
    no_aux = Case(dataclasses.replace(case.cfg, load_balance_coef=0.0, z_loss_coef=0.0), *case[1:])
    ref_value, ref_grads, *_ = reference(no_aux)
    assert_scalar_close(value, ref_value, rtol=1e-5, what=f"{dispatch} inside a manual region: loss")
    assert_tree_close(grads, ref_grads, rtol=1e-5, what=f"{dispatch} inside a manual region: gradients")


def test_layer_inputs_checked_whole_sequences_per_device_in_capacity_mode_and_capacity_capped(mesh_factory):
    """Found by an adversary: capacity mode over [T, D] tokens whose device shares are not whole sequences gave
    wrong outputs silently (ring, EP 4), a ZeroDivisionError or a gather TypeError; weights of another expert count
    ran; capacity_factor=1e308 overflowed while tracing. Now: named errors before compiling, and at most L slots
    per expert per sequence (an expert cannot receive more)."""
    from jaxpar.layers.moe import param_shapes
    rng = np.random.default_rng(0)
    cfg = MoEConfig(num_experts=8, experts_per_token=2, expert_d_mlp=6, capacity_factor=2.0)
    w = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in param_shapes(cfg, 8, 6).items()}
    x = jnp.asarray(rng.normal(size=(24, 8)), jnp.float32)
    mesh = mesh_factory(data=2, fsdp=4)
    rules = jp.sharding.expert_parallel_rules(mesh, 4)
    xs = jax.device_put(x, NamedSharding(mesh, rules.spec(("batch", None))))
    with jp.sharding.use(mesh, rules), pytest.raises(ValueError, match=r"sequence of 8 rows, but the 24 \[T, D\] "
                                                                         r"tokens are split 8 ways .*\(3 rows a device\)"):
        jax.jit(lambda w, x: moe_mlp(cfg, w, x, None, seq_len=8)[0]).lower(w, xs)
    for bad in (0, 5, True):
        with pytest.raises(ValueError, match=f"seq_len={bad!r} must be an int >= 1 dividing the 24 rows"):
            moe_mlp(cfg, w, x, None, seq_len=bad)
    six = {k: (v[:6] if k.startswith("experts_") else v) for k, v in w.items()}
    with pytest.raises(ValueError, match=r"experts_gate_kernel has shape \(6, 8, 6\): .*num_experts=8"):
        moe_mlp(cfg, six, x)
    with pytest.raises(ValueError, match=r"router_kernel has shape \(8, 6\)"):
        moe_mlp(cfg, {**w, "router_kernel": w["router_kernel"][:, :6]}, x)
    assert [MoEConfig(capacity_factor=f).capacity(16) for f in (1.0, 4.0, 1000.0, 1e308)] == [4, 16, 16, 16]
