"""Mixtures of experts in the shared decoder, against transformers: ``MixtralForCausalLM`` and
``Qwen3MoeForCausalLM`` built on tiny random configs here, loaded with ``jaxpar.models.hf.load`` (logits within
1e-4, greedy cached generation equal, ``hf.save`` read back by transformers equal), their config fields that
jaxpar does not compute refused, and one training step of a Llama with experts on data=2 x fsdp=2 x tensor=2
(and a 2-stage pipeline with the aux-loss-free bias) against the single-device step."""

from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers as T
from helpers import (SMALL_LLAMA, assert_hf_logits_and_save, assert_scalar_close, assert_tree_close, gpt_batch,
                     transformers_greedy)

import jaxpar as jp
from jaxpar.layers.moe import MoEConfig
from jaxpar.models import FamilyConfig, FamilyModel, Llama, hf
from jaxpar.models.hf.config import _arch
from jaxpar.models.hf.moe import check_save_moe, moe_config, moe_hf_config

V, SEQ = 97, 12
BASE = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            eos_token_id=None, bos_token_id=None, pad_token_id=None, num_experts_per_tok=2)
# name -> (transformers config class, model class, fields beyond BASE)
CASES = {
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_hidden_layers=2, intermediate_size=24,
                                                          num_local_experts=4)),
    "mixtral_tied_window": (T.MixtralConfig, T.MixtralForCausalLM, dict(
        num_hidden_layers=2, intermediate_size=16, num_local_experts=8, tie_word_embeddings=True, sliding_window=5,
        num_key_value_heads=4)),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(
        num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=16, num_experts=4, head_dim=16,
        norm_topk_prob=False)),
    "qwen3_moe_tied_norm": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(
        num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=12, num_experts=8, head_dim=8,
        norm_topk_prob=True, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}
FAST = ("mixtral", "qwen3_moe")


def hf_model(name: str, seed: int = 0):
    cfg_cls, model_cls, extra = CASES[name]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**BASE, **extra})).eval()
    with torch.no_grad():   # transformers' 0.02 init leaves the router's scores near uniform: a swapped expert,
        for pname, p in model.named_parameters():   # projection or router row would barely move the logits
            if "norm" in pname:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif ".mlp." in pname:
                p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module", params=[n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def loaded(request, tmp_path_factory):
    ref = hf_model(request.param)
    path = tmp_path_factory.mktemp("hf") / request.param
    ref.save_pretrained(path)
    model, params = hf.load(str(path))
    return request.param, ref, model, params


def test_logits_match_transformers_and_save_is_read_back(loaded, tmp_path):
    name, ref, model, params = loaded
    assert_hf_logits_and_save(name, ref, model, params, tmp_path / "out", V, SEQ)
    counted = sum(p.numel() for p in ref.parameters())
    assert dataclasses.replace(model.cfg, vocab_multiple=1).num_params() == counted
    moe = model.cfg.moe
    idle = (moe.num_experts - moe.experts_per_token) * 3 * model.cfg.d_model * moe.expert_d_mlp * model.cfg.num_layers
    assert model.cfg.active_params() == model.cfg.num_params() - idle
    # FLOPs count the k experts a token runs: E experts cost only their router columns more than k would
    k_only = dataclasses.replace(model.cfg, moe=dataclasses.replace(moe, num_experts=moe.experts_per_token))
    extra = model.cfg.flops_per_token(SEQ) - k_only.flops_per_token(SEQ)
    assert extra == 6 * model.cfg.num_layers * model.cfg.d_model * (moe.num_experts - moe.experts_per_token)


@pytest.mark.slow  # one compile of the cached decode per case: ~10 s each
def test_greedy_cached_generation_equals_transformers(loaded):
    name, ref, model, params = loaded
    prompts = [[int(t) for t in np.random.default_rng(2).integers(0, V, n)] for n in (7, 4)]
    new = 10
    for prompt in prompts:
        want = transformers_greedy(ref, prompt, new)
        got = model.generate(params, prompt, new, jax.random.key(0), temperature=0.0)
        assert got == want, (name, got, want)
    # left-padded prompts of different lengths in one batch: each row as when generated alone
    assert model.generate(params, prompts, new, jax.random.key(0), temperature=0.0) == [
        model.generate(params, p, new, jax.random.key(0), temperature=0.0) for p in prompts]


@pytest.mark.slow   # two loads and a step on 8 devices: ~20 s
def test_load_onto_a_mesh_with_experts_split_then_fine_tune_one_step(tmp_path, mesh_factory):
    """Each device's block of the experts (split over ``data`` by a rule before the defaults, their hidden dim over
    ``tensor``, ``embed`` over ``fsdp``) read by itself equals the single-device load, and a train state built
    from the loaded params (``hf.with_names``) takes a step whose loss is the single-device loss."""
    ref = hf_model("qwen3_moe")
    ref.save_pretrained(tmp_path / "ckpt")
    model, whole = hf.load(str(tmp_path / "ckpt"))
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    rules = (("experts", "data"),) + jp.sharding.DEFAULT_RULES
    _, sharded = hf.load(str(tmp_path / "ckpt"), mesh=mesh, rules=rules)
    experts = sharded["blocks"]["experts_gate_kernel"]
    assert experts.addressable_shards[0].data.shape == (2, 2, 16, 8), "[N, E/data, D/fsdp, F_e/tensor] per device"
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(sharded), jax.device_get(whole))
    batch = gpt_batch(np.random.default_rng(5), 8, model.cfg, seq_len=SEQ)
    want = model.loss(whole, batch)[0]
    state = jp.train.init_state(lambda rng: hf.with_names(model, sharded), optax.sgd(0.1), 0, mesh=mesh, rules=rules)
    state, metrics = jp.train.make_train_step(model.loss, optax.sgd(0.1), mesh=mesh, rules=rules)(state, batch)
    assert_scalar_close(metrics["loss"], want, what="fine-tuning step loss")
    tuned = jax.device_get(jp.train.to_model_order(state).params)   # the optimizer's params: no router state
    hf.save(model, tuned, str(tmp_path / "tuned"))
    back = type(ref).from_pretrained(tmp_path / "tuned").eval()
    tokens = np.asarray(batch["inputs"][:2])
    with torch.no_grad():
        theirs = back(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model.apply(tuned, jnp.asarray(tokens)))[..., :V], theirs, atol=1e-4)


@pytest.mark.slow   # ~10 s
def test_cached_decoding_of_a_capacity_model_is_dropless():
    """Capacity mode drops choices over a sequence's capacity in ``apply``; the cache's prefill and decode steps
    compute every token's k experts: ``apply``'s logits of the dropless config."""
    moe = MoEConfig(num_experts=4, experts_per_token=2, capacity_factor=0.5)
    model = Llama(dataclasses.replace(SMALL_LLAMA, moe=moe))
    dropless = Llama(dataclasses.replace(model.cfg, moe=dataclasses.replace(moe, capacity_factor=None)))
    params = nn.meta.unbox(model.init(jax.random.key(1)))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, SMALL_LLAMA.vocab_size, (2, 9)), jnp.int32)
    cache = model.init_cache(params, 2, 10)
    prefill, cache = jax.jit(model.decode_step)(params, tokens[:, :8], cache, jnp.int32(0))
    step, _ = jax.jit(model.decode_step)(params, tokens[:, 8], cache, jnp.int32(8))
    full, capped = dropless.apply(params, tokens), model.apply(params, tokens)
    np.testing.assert_allclose(prefill, full[:, 7], atol=1e-5)
    np.testing.assert_allclose(step, full[:, 8], atol=1e-5)
    assert float(jnp.abs(capped - full).max()) > 1e-3, "capacity 0.5 drops choices in apply"


def test_the_fused_expert_layout_loads_as_the_per_expert_one(tmp_path, mesh_factory):
    """``save_pretrained(save_original_format=False)`` writes the experts fused as transformers' modules hold them
    (``gate_up_proj [E, 2 F_e, D]``, ``down_proj [E, D, F_e]``); each device's block read from it (here the
    ``embed`` dim over fsdp, ``expert_mlp`` over tensor) equals the per-expert checkpoint's load."""
    ref = hf_model("mixtral")
    ref.save_pretrained(tmp_path / "split")
    ref.save_pretrained(tmp_path / "fused", save_original_format=False)
    from safetensors import safe_open
    with safe_open(tmp_path / "fused" / "model.safetensors", "np") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    _, split = hf.load(str(tmp_path / "split"))
    _, fused = hf.load(str(tmp_path / "fused"), mesh=mesh_factory(fsdp=2, tensor=2))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(fused), jax.device_get(split))


def test_a_router_bias_is_never_dropped_silently(tmp_path):
    """With the aux-loss-free bias (``bias_update_rate > 0``) the params must bring the router state (in
    ``TrainState.carried``) to ``apply`` and ``hf.save``, and a nonzero bias has no place in the checkpoint."""
    hf_model("qwen3_moe").save_pretrained(tmp_path / "ckpt")
    model, params = hf.load(str(tmp_path / "ckpt"))
    biased = dataclasses.replace(model.cfg, moe=dataclasses.replace(model.cfg.moe, bias_update_rate=1e-3))
    tuned = FamilyModel(biased)
    bare = {**params, "blocks": {k: v for k, v in params["blocks"].items() if k != "moe_router"}}
    with pytest.raises(ValueError, match="carried.merge"):
        jax.eval_shape(tuned.apply, bare, jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="carried.merge"):
        hf.save(tuned, bare, str(tmp_path / "bare"))
    router = {**params["blocks"]["moe_router"], "bias": params["blocks"]["moe_router"]["bias"].at[0, 1].set(1e-3)}
    with pytest.raises(ValueError, match="nonzero"):
        hf.save(tuned, {**params, "blocks": {**params["blocks"], "moe_router": router}}, str(tmp_path / "biased"))
    assert not (tmp_path / "bare").exists() and not (tmp_path / "biased").exists()


def _config(name: str, **fields) -> dict:
    cfg_cls, _, extra = CASES[name]
    out = cfg_cls(**{**BASE, **extra}).to_dict()
    out.update(fields)
    return out


@pytest.mark.parametrize("name, field, value, match", [
    ("mixtral", "router_jitter_noise", 0.1, "router_jitter_noise=0.1"),
    ("qwen3_moe", "mlp_only_layers", [1], r"mlp_only_layers=\[1\]"),
    ("qwen3_moe", "decoder_sparse_step", 2, "decoder_sparse_step=2"),
    ("qwen3_moe", "attention_bias", True, "attention_bias=True"),
])
def test_fields_that_change_the_computation_are_refused(name, field, value, match):
    with pytest.raises(ValueError, match=match):
        moe_config(_config(name, **{field: value}))


def test_config_mapping_reads_the_routing_and_refuses_deepseek_v3(tmp_path):
    mixtral = moe_config(_config("mixtral", output_router_logits=True, router_aux_loss_coef=0.02))
    assert (mixtral.family, mixtral.moe.num_experts, mixtral.moe.expert_d_mlp, mixtral.moe.norm_topk_prob) == (
        "mistral", 4, 24, True)
    assert mixtral.moe.load_balance_coef == pytest.approx(0.04)   # transformers' loss counts k choices per token
    qwen = moe_config(_config("qwen3_moe", num_local_experts=4, use_sliding_window=True, sliding_window=6))
    assert (qwen.family, qwen.moe.expert_d_mlp, qwen.moe.norm_topk_prob, qwen.moe.load_balance_coef) == (
        "qwen3", 16, False, 0.0)
    assert qwen.windows == (6, 6)   # Qwen3-MoE windows every layer
    for cfg in (mixtral, qwen):   # what save writes reads back as the same config
        assert moe_config(json.loads(json.dumps(moe_hf_config(cfg)))) == cfg
    deepseek = T.DeepseekV3Config(num_hidden_layers=2, hidden_size=32, vocab_size=V).to_dict()
    with pytest.raises(ValueError, match="MLA"):
        _arch(deepseek)
    (tmp_path / "config.json").write_text(json.dumps(deepseek))
    with pytest.raises(ValueError, match="multi-head latent attention"):
        hf.load(str(tmp_path))
    with pytest.raises(ValueError, match="shared_expert_gate"):
        _arch(T.Qwen2MoeConfig(num_hidden_layers=1).to_dict())


def test_params_counted_are_the_params_built_shared_experts_included():
    cfg = dataclasses.replace(SMALL_LLAMA, moe=MoEConfig(num_experts=4, experts_per_token=2, expert_d_mlp=32,
                                                         num_shared_experts=1))
    shapes = jax.eval_shape(Llama(cfg).init, jax.random.key(0))
    leaves = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(shapes))
    built = sum(int(np.prod(leaf.shape)) for path, leaf in leaves if "moe_router" not in jax.tree_util.keystr(path))
    assert built == cfg.num_params()
    assert cfg.num_params() - cfg.active_params() == cfg.num_layers * 2 * 3 * cfg.d_model * 32   # 2 idle experts


def test_configs_with_no_checkpoint_form_are_refused_on_save(tmp_path):
    cfg = FamilyConfig(family="qwen3", num_layers=1, d_model=32, num_heads=4, moe=MoEConfig(num_experts=4))
    for field, value in (("num_shared_experts", 1), ("capacity_factor", 1.25), ("router", "sigmoid")):
        with pytest.raises(ValueError, match=field):
            check_save_moe(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **{field: value})))
    with pytest.raises(ValueError, match="with moe"):
        hf.save(Llama(dataclasses.replace(SMALL_LLAMA, moe=MoEConfig(num_experts=4))), {}, str(tmp_path / "x"))
    with pytest.raises(ValueError, match="SwiGLU"):
        FamilyConfig(family="gemma3", moe=MoEConfig(num_experts=4))


# ------------------------------------------------------------------------- training parity (a Llama with experts)

MOE_LLAMA = dataclasses.replace(SMALL_LLAMA, num_layers=4, moe=MoEConfig(
    num_experts=4, experts_per_token=2, expert_d_mlp=32, load_balance_coef=0.01, z_loss_coef=0.001))


def _trace(opt_state):
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
                if isinstance(s, optax.TraceState)).trace


def _step(cfg, mesh, batch, pipeline: bool = False, rules=jp.sharding.DEFAULT_RULES):
    model, tx = Llama(cfg), optax.sgd(0.1, momentum=0.9)
    loss_fn = jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss,
                                   jp.pipeline.one_f_one_b(2, 4)) if pipeline else model.loss
    state = jp.train.init_state(model.init, tx, 5, mesh=mesh, pipeline=loss_fn if pipeline else None, rules=rules)
    new, metrics = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False, rules=rules)(state, batch)
    new = jp.train.to_model_order(new) if pipeline else new
    return new, metrics


@pytest.mark.slow   # two steps of a 4-layer Llama with experts: ~30 s
@pytest.mark.parametrize("layout", ["2x2x2", "2x2x2_ep4", "context2", "pipe2_bias"])
def test_moe_llama_step_matches_the_single_device_step(layout, mesh_factory):
    """data=2 x fsdp=2 x tensor=2 (auxiliary balance and z losses on; the experts' hidden dim split over tensor),
    the same with the experts split over data x fsdp (expert parallelism 4, ring dispatch), data=2 x fsdp=2 x
    context=2 (the ring attention's zigzag layout), and a 1F1B pipeline of 2 stages with the
    aux-loss-free bias instead (coefficients 0): the loss, every gradient (per leaf 1e-5 relative) and the
    router's carried load and bias equal the single-device step's."""
    cfg = MOE_LLAMA
    if layout == "pipe2_bias":
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, load_balance_coef=0.0, z_loss_coef=0.0,
                                                               bias_update_rate=1e-3))
    batch = gpt_batch(np.random.default_rng(4), 8, cfg)
    ref, ref_metrics = _step(cfg, mesh_factory(), batch)
    mesh = {"context2": mesh_factory(data=2, fsdp=2, context=2),
            "pipe2_bias": mesh_factory(data=2, pipe=2, tensor=2)}.get(layout, mesh_factory(data=2, fsdp=2, tensor=2))
    rules = ((("experts", ("data", "fsdp")),) if layout.endswith("ep4") else ()) + jp.sharding.DEFAULT_RULES
    new, metrics = _step(cfg, mesh, batch, pipeline=layout == "pipe2_bias", rules=rules)
    if layout.endswith("ep4"):   # each device holds one of the 4 experts (and half its hidden dim)
        assert new.params["blocks"]["experts_gate_kernel"].addressable_shards[0].data.shape == (4, 1, 64, 16)
    e_loss = assert_scalar_close(metrics["loss"], ref_metrics["loss"], what=f"{layout} loss")
    e_grads = assert_tree_close(_trace(new.opt_state), _trace(ref.opt_state), what=f"{layout} grads")
    e_carried = assert_tree_close(new.carried, ref.carried, what=f"{layout} router state")
    print(f"\n[{layout}] loss {e_loss:.2e}, grads {e_grads:.2e}, router state {e_carried:.2e} (relative)")
    load = np.asarray(jax.device_get(ref.carried["blocks"]["moe_router"]["load"]))
    assert np.all(load.sum(-1) == 8 * cfg.max_seq_len * 2), "every layer routes tokens x k choices (dropless)"
    if layout != "pipe2_bias":
        for key in ("moe_load_balance_loss", "moe_z_loss", "moe_dropped_fraction"):
            assert_scalar_close(metrics[key], ref_metrics[key], what=key)
        assert float(metrics["moe_load_balance_loss"]) > 0.5   # E * sum_i f_i P_i is 1 at uniform routing
    else:
        bias = np.asarray(jax.device_get(new.carried["blocks"]["moe_router"]["bias"]))
        # one update from zero: +gamma for an expert below the mean load, -gamma above it, 0 at it
        want = np.float32(1e-3) * np.sign(load.mean(-1, keepdims=True) - load)
        np.testing.assert_array_equal(bias, want)
        assert np.any(bias != 0)


def test_a_pipeline_stage_with_auxiliary_losses_and_compacting_the_mlp_of_a_moe_are_refused():
    model = Llama(dataclasses.replace(SMALL_LLAMA, moe=MoEConfig(num_experts=4, load_balance_coef=0.01)))
    with pytest.raises(ValueError, match="bias_update_rate"):
        model.stage({}, jnp.zeros((1, 2, SMALL_LLAMA.d_model)))
    with pytest.raises(ValueError, match="shared experts"):
        model.replace({("blocks", "mlp"): 64})


@pytest.mark.slow   # ~15 s
def test_scanned_and_rematerialised_layers_give_the_unrolled_loss_aux_and_grads():
    """The router statistics ride the layer scan's carry (remat="full" recomputes them): loss, aux metrics and
    gradients equal the unrolled layers'."""
    batch = gpt_batch(np.random.default_rng(7), 4, MOE_LLAMA)
    plain = Llama(MOE_LLAMA)
    params = nn.meta.unbox(plain.init(jax.random.key(2)))
    scanned = Llama(dataclasses.replace(MOE_LLAMA, scan_layers=True, remat="full"))
    (loss, aux), grads = jax.jit(jax.value_and_grad(plain.loss, has_aux=True))(params, batch)
    (s_loss, s_aux), s_grads = jax.jit(jax.value_and_grad(scanned.loss, has_aux=True))(params, batch)
    assert_scalar_close(s_loss, loss, what="loss")
    assert_tree_close(s_aux, aux, what="aux")
    assert_tree_close(s_grads, grads, what="grads")
