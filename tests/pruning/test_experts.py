"""Structured pruning of whole experts: selection by router load or weight norm, compaction of the expert stack
with the router's columns and carried state, the compacted model computing what the model whose router never
selects the removed experts computes (the removed experts' tokens re-routed to the kept ones), training on.

References: numpy (expert norms, top-k over the kept experts' logits, a loop over experts); the "masked" model is
the original one with the removed experts' selection bias at -inf (they are never chosen; nothing else changes).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from jaxpar.layers.moe import MoEConfig, moe_mlp, router_state
from jaxpar.models import Llama, LlamaConfig

from helpers import assert_scalar_close, max_rel_err

E, KEEP = 8, 6
pytestmark = pytest.mark.filterwarnings("ignore:the Llama's 2 key/value heads are replicated")   # tensor=2 mesh


@dataclasses.dataclass(frozen=True)
class OneMoE:
    """A model written here: one unstacked MoE layer over tokens ``[T, D]`` (the protocol's ``init``, ``apply``,
    ``replace``), its router state in the params as ``model.init`` of jaxpar's decoder holds it."""
    moe: MoEConfig
    d_model: int = 16
    d_ff: int = 8

    def init(self, rng):
        D, F, n = self.d_model, self.d_ff, self.moe.num_experts
        k = jax.random.split(rng, 4)
        box = lambda key, shape, names: nn.LogicallyPartitioned(jax.random.normal(key, shape) / np.sqrt(shape[-2]),
                                                                names)
        return {"moe": {"router_kernel": box(k[0], (D, n), ("embed", None)),
                        "experts_gate_kernel": box(k[1], (n, D, F), ("experts", "embed", "expert_mlp")),
                        "experts_up_kernel": box(k[2], (n, D, F), ("experts", "embed", "expert_mlp")),
                        "experts_down_kernel": box(k[3], (n, F, D), ("experts", "expert_mlp", "embed")),
                        "moe_router": router_state(self.moe)}}

    def apply(self, params, h_TD):
        w = {k: v for k, v in params["moe"].items() if k != "moe_router"}
        return moe_mlp(self.moe, w, h_TD, params["moe"]["moe_router"])[0]

    def replace(self, sizes):
        (key, n), = sizes.items()
        assert key == ("moe", "experts"), sizes
        return dataclasses.replace(self, moe=dataclasses.replace(self.moe, num_experts=n))


def masked(params, masks, where=("blocks",)):
    """``params`` whose router never selects the removed experts: their selection bias at -inf."""
    out = jax.tree.map(lambda x: x, params)
    node = out
    for k in where:
        node = node[k]
    keep = np.asarray(functools.reduce(lambda m, k: m[k], where, masks)["experts"])
    node["moe_router"] = {**node["moe_router"], "bias": jnp.where(keep, node["moe_router"]["bias"], -jnp.inf)}
    return out


def np_swiglu(h, g, u, d):
    a = h @ g
    return (a / (1 + np.exp(-a)) * (h @ u)) @ d


def test_experts_pruned_by_norm_compact_and_reroute(np_rng):
    """Fast: the 6 of 8 experts with the largest weight norm are kept (numpy's ranking); the compacted layer
    equals a numpy loop over the kept experts, top-2 over their unchanged logits (the masked model: slow set)."""
    model = OneMoE(MoEConfig(num_experts=E, experts_per_token=2, bias_update_rate=1e-3))
    names = jax.eval_shape(model.init, jax.random.key(0))
    params = jax.tree.map(lambda s: (np_rng.standard_normal(s.shape) / 4).astype(np.float32), nn.meta.unbox(names))
    params["moe"]["moe_router"] = router_state(model.moe)      # bias 0
    w = params["moe"]
    norms = sum(np.sum(w[f"experts_{p}_kernel"].astype(np.float64) ** 2, axis=(1, 2)) for p in ("gate", "up", "down"))
    keep = np.sort(np.argsort(-norms, kind="stable")[:KEEP])
    masks = jp.pruning.select_experts(params, names, KEEP, by="norm")
    assert np.array_equal(np.flatnonzero(masks["moe"]["experts"]), keep)

    new_params, new_model = jp.pruning.compact(params, masks, model)
    assert new_model.moe.num_experts == KEEP
    assert new_params["moe"]["router_kernel"].shape == (16, KEEP)
    assert new_params["moe"]["moe_router"]["bias"].shape == (KEEP,)
    h = np_rng.standard_normal((32, 16)).astype(np.float32)
    got = np.asarray(jax.jit(new_model.apply)(new_params, h))

    logits = h @ w["router_kernel"][:, keep]                   # the kept experts' logits, as before
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :2]
    ref = np.zeros_like(h)
    for t in range(len(h)):
        p = np.exp(logits[t, top[t]] - logits[t, top[t]].max())
        for j, weight in zip(top[t], p / p.sum()):
            e = keep[j]
            ref[t] += weight * np_swiglu(h[t], w["experts_gate_kernel"][e], w["experts_up_kernel"][e],
                                         w["experts_down_kernel"][e])
    assert max_rel_err(got, ref) < 1e-5
    pruned_first = ~np.isin(np.argsort(-(h @ w["router_kernel"]), axis=-1)[:, 0], keep)
    assert pruned_first.any()                                   # some tokens' first choice was removed: re-routed


def test_expert_compaction_refuses_what_the_router_cannot_keep():
    """Fast (shapes only): masks keeping different counts per layer or per routing group, counts the routing
    cannot take, a dense model given experts, and keep outside [1, E]."""
    cfg = LlamaConfig(vocab_size=32, num_layers=2, num_heads=2, d_model=16, d_mlp=16, max_seq_len=8,
                      moe=MoEConfig(num_experts=E, experts_per_token=2, num_groups=2, topk_groups=1,
                                    router="sigmoid", bias_update_rate=1e-3))
    params = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), nn.meta.unbox(jax.eval_shape(Llama(cfg).init,
                                                                                          jax.random.key(0))))
    uneven = np.ones((2, E), bool)
    uneven[0, :2] = False
    uneven[1, :1] = False
    with pytest.raises(ValueError, match="different layers"):
        jp.pruning.compact(params, {"blocks": {"experts": uneven}}, cfg)
    one_group = np.ones((2, E), bool)
    one_group[:, :2] = False                                    # both removed from routing group 0
    with pytest.raises(ValueError, match="per routing group"):
        jp.pruning.compact(params, {"blocks": {"experts": one_group}}, cfg)
    with pytest.raises(ValueError, match="multiple of 2"):
        Llama(cfg).replace({("blocks", "experts"): 5})
    with pytest.raises(ValueError, match="per routing group"):
        Llama(cfg).replace({("blocks", "experts"): 2})          # one expert per group: no top-2 group score
    with pytest.raises(ValueError, match="experts_per_token"):
        Llama(dataclasses.replace(cfg, moe=MoEConfig(num_experts=E))).replace({("blocks", "experts"): 1})
    with pytest.raises(ValueError, match="dense"):
        Llama(dataclasses.replace(cfg, moe=None)).replace({("blocks", "experts"): 4})
    names = jax.eval_shape(Llama(cfg).init, jax.random.key(0))
    with pytest.raises(ValueError, match="keep=9"):
        jp.pruning.select_experts(params, names, 9, by="norm")
    with pytest.raises(ValueError, match="multiple of 2"):
        jp.pruning.select_experts(params, names, 5, by="norm", groups=2)
    with pytest.raises(ValueError, match="zero"):               # a fresh router state has counted nothing
        jp.pruning.select_experts(jax.tree.map(np.zeros_like, params), names, 6)


# ---------------------------------------------------------------------------------------------- slow

def moe_llama(**moe):
    return LlamaConfig(vocab_size=61, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32, d_mlp=32,
                       max_seq_len=16, moe=MoEConfig(num_experts=E, experts_per_token=2, bias_update_rate=1e-3,
                                                     **moe))


def tokens(np_rng, cfg, batch=8):
    t = jnp.asarray(np_rng.integers(0, cfg.vocab_size, (batch, cfg.max_seq_len)), jnp.int32)
    return {"inputs": t, "targets": jnp.roll(t, -1, axis=1)}


@pytest.mark.slow
@pytest.mark.parametrize("router,by", [("softmax", "load"), ("sigmoid", "norm")])
def test_compacted_moe_llama_logits_equal_masked(router, by, np_rng):
    """A MoE Llama (softmax top-2 without a bias, Mixtral / Qwen3-MoE; or DeepSeek-V3's sigmoid with 2 routing
    groups, the top one eligible, and a trained-like selection bias) pruned 8 -> 6 per layer: the compacted model's logits equal
    the masked model's; measured on the same batch, its load on the kept experts is the masked model's, the
    removed experts' choices (which the unpruned model made) now go to kept ones, tokens x k in every layer."""
    groups = 2 if router == "sigmoid" else 1
    cfg = moe_llama(router=router, num_groups=groups, topk_groups=1)
    model = Llama(cfg)
    names = jax.eval_shape(model.init, jax.random.key(0))
    params = nn.meta.unbox(model.init(jax.random.key(int(np_rng.integers(1 << 30)))))
    if router == "sigmoid":   # a softmax router's bias would meet probabilities rescaled by the pruning (compact)
        params["blocks"]["moe_router"]["bias"] = jnp.asarray(1e-2 * np_rng.standard_normal((2, E)), jnp.float32)
    batch = tokens(np_rng, cfg)
    load = jp.pruning.measure_expert_load(model.loss, params, batch)["blocks"]["moe_router"]["load"]
    choices = batch["inputs"].size * 2
    assert np.all(np.asarray(load).sum(-1) == choices)
    masks = jp.pruning.select_experts(params, names, KEEP, by=by, load={"blocks": {"moe_router": {"load": load}}},
                                      groups=groups)
    kept = masks["blocks"]["experts"]
    if by == "load":   # per layer the 6 largest counts, ties to the lower index
        ref = np.zeros_like(kept)
        for layer, row in enumerate(np.asarray(load)):
            ref[layer, np.argsort(-row, kind="stable")[:KEEP]] = True
        assert np.array_equal(kept, ref)
    assert np.all(kept.reshape(2, groups, -1).sum(-1) == KEEP // groups)
    new_params, new_cfg = jp.pruning.compact(params, masks, cfg)
    assert new_cfg.moe.num_experts == KEEP and new_cfg.num_params() < cfg.num_params()
    small, ref_params = Llama(new_cfg), masked(params, masks)
    V = cfg.vocab_size
    got = jax.jit(small.apply)(new_params, batch["inputs"])[..., :V]
    ref = jax.jit(model.apply)(ref_params, batch["inputs"])[..., :V]
    assert max_rel_err(got, ref) < 1e-5
    assert not np.allclose(ref, jax.jit(model.apply)(params, batch["inputs"])[..., :V], atol=1e-4)   # pruning shows
    new_load = np.asarray(jp.pruning.measure_expert_load(small.loss, new_params, batch)["blocks"]["moe_router"]["load"])
    masked_load = np.asarray(jp.pruning.measure_expert_load(model.loss, ref_params, batch)["blocks"]["moe_router"]["load"])
    assert np.all(masked_load[~kept] == 0) and np.all(new_load.sum(-1) == choices)
    assert np.array_equal(new_load, masked_load[kept].reshape(2, KEEP))
    assert np.asarray(load)[~kept].sum() > 0                    # choices of removed experts, now re-routed


@pytest.mark.slow
def test_compact_state_of_moe_llama_trains_on_expert_parallel_mesh(mesh_factory, np_rng):
    """Two AdamW steps of a MoE Llama (DeepSeek-V3's sigmoid router, aux-free bias) on data=2 x fsdp=2 x tensor=2 with its experts split over fsdp (expert
    parallel 2), experts selected by the carried load, ``compact_state``: the router state and Adam's moments
    are gathered with the experts, the first step of the compacted state has the masked model's loss, the loss
    falls, and the new carried load counts tokens x k over the 6 experts."""
    cfg = moe_llama(router="sigmoid")   # its aux-free bias moves each step; sigmoid scores keep it exact (compact)
    model = Llama(cfg)
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    rules = jp.sharding.expert_parallel_rules(mesh, 2)
    names = jax.eval_shape(model.init, jax.random.key(0))
    tx = optax.adamw(1e-2)
    state = jp.train.init_state(model.init, tx, jax.random.key(3), mesh=mesh, rules=rules)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, rules=rules, donate=False)
    batches = [tokens(np_rng, cfg) for _ in range(3)]
    batches.append(batches[2])                                  # the loss falls on the batch it trained on
    for b in batches[:2]:
        state, _ = step(state, b)
    masks = jp.pruning.select_experts(state.params, names, KEEP, load=state.carried)
    new, new_cfg = jp.pruning.compact_state(state, cfg, tx, mesh=mesh, rules=rules, masks=masks)
    kept = masks["blocks"]["experts"]
    assert new.carried["blocks"]["moe_router"]["load"].shape == (2, KEEP)
    np.testing.assert_array_equal(new.carried["blocks"]["moe_router"]["bias"],
                                  np.asarray(state.carried["blocks"]["moe_router"]["bias"])[kept].reshape(2, KEEP))
    mu = lambda s: s.opt_state[0].mu["blocks"]["router_kernel"]
    np.testing.assert_array_equal(mu(new), np.asarray(mu(state)).transpose(0, 2, 1)[kept].reshape(2, KEEP, -1)
                                  .transpose(0, 2, 1))
    small = Llama(new_cfg)
    small_step = jp.train.make_train_step(small.loss, tx, mesh=mesh, rules=rules, donate=False)
    evaluate = jp.train.make_eval_step(model.loss, mesh=mesh, rules=rules)
    ref_state = state.replace(carried=masked(state.carried, masks))
    losses = []
    for b in batches[2:]:
        new, metrics = small_step(new, b)
        losses.append(float(metrics["loss"]))
    assert_scalar_close(losses[0], evaluate(ref_state, batches[2])["loss"], rtol=1e-5, what="first compacted step")
    assert losses[1] < losses[0]
    np.testing.assert_array_equal(np.asarray(new.carried["blocks"]["moe_router"]["load"]).sum(-1),
                                  batches[0]["inputs"].size * 2)


@pytest.mark.slow   # transformers' Mixtral built, saved, loaded, compacted and saved again: ~20 s
def test_compacted_mixtral_equals_transformers_mixtral_of_the_kept_experts(tmp_path):
    """A transformers ``MixtralForCausalLM`` of 8 experts, read by ``hf.load``, pruned to 6 experts per layer by
    weight norm (the ranking recomputed from the torch weights) and compacted: its logits equal those of a
    ``MixtralForCausalLM`` of 6 experts built in torch from the kept experts' weights and router rows, and
    ``hf.save`` of the compacted model reads back in transformers as that model."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from jaxpar.models import hf
    fields = dict(vocab_size=61, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  intermediate_size=24, max_position_embeddings=64, num_experts_per_tok=2, eos_token_id=None,
                  bos_token_id=None, pad_token_id=None)
    torch.manual_seed(5)
    ref = T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=E, **fields)).eval()
    with torch.no_grad():   # transformers' 0.02 init leaves the router near uniform: pruning would barely show
        for name, p in ref.named_parameters():
            if ".mlp." in name:
                p.normal_(0.0, 0.3)
    ref.save_pretrained(tmp_path / "eight")
    model, params = hf.load(str(tmp_path / "eight"))
    names = jax.eval_shape(model.init, jax.random.key(0))
    masks = jp.pruning.select_experts(params, names, KEEP, by="norm")
    state = ref.state_dict()
    keep = []
    for layer in range(2):
        experts = f"model.layers.{layer}.mlp.experts."
        norms = sum(state[experts + k].double().square().sum((1, 2)).numpy() for k in ("gate_up_proj", "down_proj"))
        keep.append(np.sort(np.argsort(-norms, kind="stable")[:KEEP]))
    assert np.array_equal(masks["blocks"]["experts"], np.stack([np.isin(np.arange(E), k) for k in keep]))
    small_params, small_cfg = jp.pruning.compact(params, masks, model.cfg)
    small = type(model)(small_cfg)

    six = T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=KEEP, **fields)).eval()
    cut = {k: v[torch.as_tensor(keep[int(k.split(".")[2])])] if ".mlp." in k else v for k, v in state.items()}
    six.load_state_dict(cut)
    tokens = np.random.default_rng(6).integers(0, 61, (2, 12))
    with torch.no_grad():
        want = six(torch.as_tensor(tokens)).logits.numpy()
        before = ref(torch.as_tensor(tokens)).logits.numpy()
    got = np.asarray(jax.jit(small.apply)(small_params, jnp.asarray(tokens, jnp.int32)))[..., :61]
    assert max_rel_err(got, want) < 1e-5 and max_rel_err(before, want) > 1e-3
    hf.save(small, small_params, str(tmp_path / "six"))
    reread = T.AutoModelForCausalLM.from_pretrained(tmp_path / "six").eval()
    assert reread.config.num_local_experts == KEEP
    with torch.no_grad():
        assert max_rel_err(reread(torch.as_tensor(tokens)).logits.numpy(), want) < 1e-5
