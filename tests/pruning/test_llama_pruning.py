"""Structured pruning of grouped-query attention (the Llama, and a GQA model written here): query heads are
pruned within their key/value group, every group keeping the same number; MLP neurons couple SwiGLU's gate,
up and down; compaction gives a smaller dense Llama with the same key/value heads, computing what the masked
model computes; training continues on a mesh; the compacted Llama loads in ``transformers``.

The reference masks come from numpy (group norms over the leaves the test finds from the logical names,
then the top heads of each key/value group, ties to the lower index); the reference logits from the original
model applied to ``params * mask``, the mask broadcast in numpy.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from jaxpar.models import Llama, LlamaConfig, hf

from helpers import SMALL_LLAMA, gpt_batch, max_rel_err

from .test_compact import logits_on, masked, masks_for
from .test_structured import np_groups, np_keep, np_norms, pruned_leaves, random_params

G = SMALL_LLAMA.num_kv_heads
PER = SMALL_LLAMA.num_heads // G   # query heads per key/value group
BLOCKS = {"blocks": {("blocks",)}}
pytestmark = pytest.mark.filterwarnings("ignore:the Llama's 2 key/value heads are replicated")   # tensor=2 meshes


@functools.cache
def llama_names(cfg=SMALL_LLAMA):
    return jax.eval_shape(Llama(cfg).init, jax.random.key(0))


def np_gqa_keep(params, names, modules, sparsity, distribution):
    """The reference head masks ``[layers, H]``: each key/value group of ``PER`` consecutive query heads is a row
    of ``np_keep`` (its own top heads under uniform; under global every group's top head first, then pooled)."""
    norms = np_norms(params, np_groups(names, modules, "heads"))
    rows = np_keep(norms.reshape(-1, PER), sparsity, distribution)
    return rows.reshape(norms.shape)


@pytest.mark.parametrize("sparsity,distribution", [(0.25, "uniform"), (0.6, "uniform"), (0.5, "global"),
                                                   pytest.param(0.8, "global", marks=pytest.mark.slow)])
def test_llama_masks_match_numpy_reference(sparsity, distribution):
    params = random_params(llama_names(), seed=21)
    masks = masks_for(params, llama_names(), sparsity, distribution)
    assert set(masks["blocks"]) == {"heads", "mlp"}
    heads = masks["blocks"]["heads"]
    assert np.array_equal(heads, np_gqa_keep(params, llama_names(), {("blocks",)}, sparsity, distribution))
    mlp = np_keep(np_norms(params, np_groups(llama_names(), {("blocks",)}, "mlp")), sparsity, distribution)
    assert np.array_equal(masks["blocks"]["mlp"], mlp)
    # the MLP group holds gate, up and down; the heads group q and out (never k or v)
    paths = lambda axis: {p[-1] for p, _, _ in np_groups(llama_names(), {("blocks",)}, axis)}
    assert paths("mlp") == {"gate_kernel", "up_kernel", "down_kernel"}
    assert paths("heads") == {"q_kernel", "out_kernel"}
    per_group = heads.reshape(SMALL_LLAMA.num_layers, G, PER).sum(-1)
    if distribution == "uniform":
        assert np.all(per_group == max(1, round((1 - sparsity) * PER)))
    assert np.all(per_group >= 1)


LLAMA_CASES = [(0.5, "uniform", "1dev"), (0.6, "global", "2x2x2"),
               pytest.param(0.25, "global", "1dev", marks=pytest.mark.slow),
               pytest.param(0.75, "uniform", "2x2x2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("sparsity,distribution,layout", LLAMA_CASES)
def test_compacted_llama_logits_equal_masked_logits(sparsity, distribution, layout, mesh_factory, np_rng):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2) if layout == "2x2x2" else mesh_factory()
    params = random_params(llama_names(), seed=22)
    masks = masks_for(params, llama_names(), sparsity, distribution)
    if layout == "2x2x2":
        params = jax.device_put(params, jp.sharding.named_shardings(llama_names(), mesh))
    new_params, cfg = jp.pruning.compact(params, masks, SMALL_LLAMA, multiple_of=2)
    per_group = int(masks["blocks"]["heads"].reshape(-1, PER).sum(-1).max())   # G=2: any count gives an even total
    assert (cfg.num_kv_heads, cfg.num_heads, cfg.head_dim) == (G, G * per_group, SMALL_LLAMA.head_dim)
    assert cfg.d_mlp == -(-int(masks["blocks"]["mlp"].sum(-1).max()) // 2) * 2
    assert cfg.num_heads <= SMALL_LLAMA.num_heads and cfg.d_mlp < SMALL_LLAMA.d_mlp   # global may keep a full group
    assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(new_params)) < SMALL_LLAMA.num_params()
    tokens = gpt_batch(np_rng, 4, SMALL_LLAMA)["inputs"]
    ref = np.asarray(Llama(SMALL_LLAMA).apply(masked(jax.device_get(params), llama_names(), masks, BLOCKS), tokens))
    got = logits_on(Llama(cfg).apply, jax.device_get(new_params), tokens, mesh, llama_names(cfg))
    valid = slice(0, SMALL_LLAMA.vocab_size)
    assert max_rel_err(got[..., valid], ref[..., valid]) <= 1e-5
    assert np.max(np.abs(ref[..., valid])) > 0.1


# slow set: a lighter sibling stays in the fast set (the README's 10-minute budget)
@pytest.mark.slow
def test_compacted_llama_trains_on_and_loads_in_transformers(tmp_path, mesh_factory):
    """AdamW + one-shot uniform pruning at step 1 on data=2 x tensor=2; compact_state (heads a multiple of
    tensor=2 by default) continues with the losses the masked model gives; padding heads stay zero; the
    compacted Llama saved by jp.models.hf.save loads in transformers with the same logits."""
    mesh = mesh_factory(data=2, tensor=2)
    names = llama_names()
    prune = jp.pruning.structured_pruning(jp.pruning.one_shot(0.5, step=1),
                                          "uniform", axis_names=names)
    tx = optax.chain(optax.adamw(3e-3, weight_decay=0.1), prune)
    model = Llama(SMALL_LLAMA)
    state = jp.train.init_state(model.init, tx, jax.random.key(3), mesh=mesh)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, donate=False)
    rng = np.random.default_rng(23)
    batches = [gpt_batch(rng, 4, SMALL_LLAMA) for _ in range(5)]
    for t in range(2):
        state, _ = step(state, batches[t])
    new, cfg = jp.pruning.compact_state(state, SMALL_LLAMA, tx, mesh=mesh)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.d_mlp) == (G * PER // 2, G, SMALL_LLAMA.d_mlp // 2)
    step2 = jp.train.make_train_step(Llama(cfg).loss, tx, mesh=mesh, donate=False)
    for t in range(2, 5):
        state, ref = step(state, batches[t])
        new, got = step2(new, batches[t])
        assert max_rel_err(got["loss"], ref["loss"]) <= 1e-5, t
    masks = jax.device_get(jp.pruning.group_masks(new.opt_state))
    params = jax.device_get(new.params)
    for path, off in pruned_leaves(params, masks, llama_names(cfg)).items():
        assert np.all(functools.reduce(lambda d, k: d[k], path, params)[off] == 0.0), path

    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf.save(Llama(cfg), params, tmp_path / "hf")
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert (ref_model.config.num_attention_heads, ref_model.config.num_key_value_heads) == (cfg.num_heads, G)
    tokens = batches[0]["inputs"]
    with torch.no_grad():
        want = ref_model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    got = np.asarray(Llama(cfg).apply(params, tokens))[..., :SMALL_LLAMA.vocab_size]
    assert max_rel_err(got, want) <= 1e-5


# two query heads per key/value group: pruning one leaves a group of one, which compact_state must not give
GQA_4_2 = LlamaConfig(vocab_size=61, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32, d_mlp=64, max_seq_len=8)


def gqa_4_2_tx(sparsity=0.5):
    prune = jp.pruning.structured_pruning(jp.pruning.one_shot(sparsity, 0), "uniform", axis_names=llama_names(GQA_4_2))
    return optax.chain(optax.adamw(3e-3, weight_decay=0.1), prune)


def test_compact_state_keeps_two_query_heads_per_kv_group_for_the_transform_it_carries(mesh_factory):
    """4 query heads on 2 key/value heads, heads sparsity 0.5: the masks keep one query head per group (a
    different one per layer). compact_state keeps two per group (the pruned one as zero padding, still masked),
    so the compacted Llama is again grouped-query attention that the carried transform accepts (compact_state
    builds tx.init of it), where a group of one would be refused (compact alone goes down to one per group)."""
    tx, mesh = gqa_4_2_tx(), mesh_factory()
    params = random_params(llama_names(GQA_4_2), seed=27)
    heads = np.array([[True, False, False, True], [False, True, True, False]])   # [layers, H]: one per group
    mlp = np.random.default_rng().random((2, 64)) < 0.5
    adam, prune = tx.init(params)
    opt_state = (adam, prune._replace(masks={"blocks": {"heads": heads, "mlp": mlp}}))
    state = jp.train.TrainState(jnp.zeros((), jnp.int32), params, opt_state, jax.random.key(0))
    new, cfg = jp.pruning.compact_state(state, GQA_4_2, tx, mesh=mesh)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.d_mlp) == (4, 2, int(mlp.sum(-1).max()))
    got = jax.device_get(jp.pruning.group_masks(new.opt_state))
    assert np.array_equal(got["blocks"]["heads"], heads)   # the padding heads stay pruned
    params = jax.device_get(new.params)
    off = pruned_leaves(params, {"blocks": {"heads": heads}}, llama_names(cfg))
    assert off and all(np.all(functools.reduce(lambda d, k: d[k], path, params)[o] == 0.0) for path, o in off.items())


@pytest.mark.slow
def test_gqa_with_two_query_heads_per_group_trains_compacts_and_trains_on(mesh_factory):
    """The whole run on data=2 x tensor=2: one-shot uniform pruning of half the heads and neurons, two steps,
    compact_state, and the compacted model's losses equal the masked model's for three more steps."""
    mesh, tx = mesh_factory(data=2, tensor=2), gqa_4_2_tx()
    state = jp.train.init_state(Llama(GQA_4_2).init, tx, jax.random.key(6), mesh=mesh)
    step = jp.train.make_train_step(Llama(GQA_4_2).loss, tx, mesh=mesh, donate=False)
    rng = np.random.default_rng()
    batches = [gpt_batch(rng, 4, GQA_4_2) for _ in range(5)]
    for t in range(2):
        state, _ = step(state, batches[t])
    assert jax.device_get(jp.pruning.group_masks(state.opt_state))["blocks"]["heads"].reshape(-1, 2).sum(-1).max() == 1
    new, cfg = jp.pruning.compact_state(state, GQA_4_2, tx, mesh=mesh)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.d_mlp) == (4, 2, 32)
    step2 = jp.train.make_train_step(Llama(cfg).loss, tx, mesh=mesh, donate=False)
    for t in range(2, 5):
        state, ref = step(state, batches[t])
        new, got = step2(new, batches[t])
        assert max_rel_err(got["loss"], ref["loss"]) <= 1e-5, t


# -------------------------------------------------------------------- a GQA model written by the user


class UserGQA(nn.Module):
    """One unstacked grouped-query attention layer (no rotary), with its own names: ``wq [D, H, K]``,
    ``wk``/``wv [D, G, K]`` named ``kv_heads``, ``wo [H, K, D]``."""
    heads: int = 6
    kv_heads: int = 3
    d: int = 12
    k: int = 4

    @nn.compact
    def __call__(self, x_BLD):
        init = nn.initializers.normal(0.3)
        p = lambda name, shape, names: self.param(name, nn.with_logical_partitioning(init, names), shape)
        q = jnp.einsum("bld,dhk->blhk", x_BLD, p("wq", (self.d, self.heads, self.k), ("embed", "heads", "kv")))
        k, v = (jnp.einsum("bld,dgk->blgk", x_BLD, p(n, (self.d, self.kv_heads, self.k), ("embed", "kv_heads", "kv")))
                for n in ("wk", "wv"))
        rep = self.heads // self.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        att = jax.nn.softmax(jnp.einsum("blhk,bmhk->bhlm", q, k) / np.sqrt(self.k), axis=-1)
        out = jnp.einsum("bhlm,bmhk->blhk", att, v)
        return jnp.einsum("blhk,hkd->bld", out, p("wo", (self.heads, self.k, self.d), ("heads", "kv", "embed")))


class UserGQAModel:
    """The model protocol's parts compaction needs (``init``, ``replace``) around :class:`UserGQA`."""

    def __init__(self, module: UserGQA):
        self.module = module

    def init(self, rng):
        return self.module.init(rng, jnp.zeros((1, 2, self.module.d)))["params"]

    def replace(self, sizes):
        (key, heads), = sizes.items()
        assert key == ("heads",)
        return UserGQAModel(self.module.clone(heads=heads))


def test_user_gqa_model_prunes_heads_within_kv_groups_and_compacts(np_rng):
    model = UserGQAModel(UserGQA())
    names = jax.eval_shape(model.init, jax.random.key(0))
    params = random_params(names, seed=24)
    masks = masks_for(params, names, 0.5, "uniform", axes=("heads",))
    heads = masks["heads"]   # top-level module: the key is the axis alone
    norms = np_norms(params, np_groups(names, {()}, "heads"))
    assert np.array_equal(heads, np_keep(norms.reshape(3, 2), 0.5, "uniform").reshape(-1))
    assert heads.reshape(3, 2).sum(-1).tolist() == [1, 1, 1]
    new_params, new_model = jp.pruning.compact(params, masks, model)
    assert new_model.module.heads == 3 and new_params["wk"].shape == params["wk"].shape
    x = np_rng.normal(size=(2, 5, 12)).astype(np.float32)
    ref = UserGQA().apply({"params": _masked_top(params, heads)}, x)
    got = new_model.module.apply({"params": new_params}, x)
    assert max_rel_err(np.asarray(got), np.asarray(ref)) <= 1e-5


def _masked_top(params, heads):
    """``params`` with the pruned heads' ``wq`` and ``wo`` slices zeroed (numpy)."""
    out = jax.tree.map(np.array, params)
    out["wq"] = out["wq"] * heads[None, :, None]
    out["wo"] = out["wo"] * heads[:, None, None]
    return out


# ---------------------------------------------------------------------------------------------- errors


def test_gqa_pruning_rejects_what_it_cannot_prune():
    mha = LlamaConfig(vocab_size=61, num_layers=1, num_heads=4, num_kv_heads=4, d_model=32, d_mlp=64, max_seq_len=8)
    names = llama_names(mha)
    params = random_params(names, seed=25)
    with pytest.raises(ValueError, match=r"own key/value head.*axes=\('mlp',\)"):
        masks_for(params, names, 0.5, "uniform")
    assert set(masks_for(params, names, 0.5, "uniform", axes=("mlp",))["blocks"]) == {"mlp"}

    P = jax.sharding.PartitionSpec   # a pytree model: 4 key/value heads cannot group 6 query heads
    rng = np.random.default_rng(26)
    bad = {"wq": rng.normal(size=(12, 6, 4)), "wk": rng.normal(size=(12, 4, 4)), "wo": rng.normal(size=(6, 4, 12))}
    specs = {"wq": P("embed", "heads", "kv"), "wk": P("embed", "kv_heads", "kv"), "wo": P("heads", "kv", "embed")}
    with pytest.raises(ValueError, match="hold 4 kv_heads, which does not divide them"):
        masks_for(bad, specs, 0.5, "uniform", axes=("heads",))
    with pytest.raises(ValueError, match="multiple of num_kv_heads=2"):
        Llama(SMALL_LLAMA).replace({("blocks", "heads"): 3})
    with pytest.raises(ValueError, match="blocks/mlp .* and blocks/heads"):
        Llama(SMALL_LLAMA).replace({("head", "mlp"): 3})


# ------------------------------------------------------------------------ unstructured: ERK and N:M


def np_erk(shapes, sparsity):
    """RigL's ERK densities written out (Evci et al. 2020, sec. 3): density ``eps * sum(s) / prod(s)`` per 2-D
    ``(fan_in, fan_out)``, ``eps`` for the overall target, layers above 1 made dense and ``eps`` solved again."""
    raw = np.array([sum(s) / np.prod(s) for s in shapes])
    size = np.array([np.prod(s) for s in shapes], float)
    dense = np.zeros(len(shapes), bool)
    while True:
        eps = ((1 - sparsity) * size.sum() - size[dense].sum()) / (raw[~dense] * size[~dense]).sum()
        grow = ~dense & (eps * raw > 1)
        if not grow.any():
            return np.where(dense, 1.0, eps * raw)
        dense |= grow


def run_magnitude(mesh, names, params, **kw):
    tx = jp.pruning.magnitude_pruning(axis_names=names, **kw)
    params = jax.device_put(params, jp.sharding.named_shardings(names, mesh))
    with jax.set_mesh(mesh):
        _, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    return jax.device_get(jp.pruning.masks(state))


def test_llama_erk_and_2_4_pruning_match_references_sharded(mesh_factory):
    """ERK at 0.8 and 2:4 on the Llama's kernels (q, k, v, out, gate, up, down per layer, the head): per-layer
    densities equal RigL's ERK written out; every group of 4 along the input axis keeps its 2 largest
    magnitudes; masks on fsdp=2 x tensor=2 equal the one-device masks bitwise. Norm scales and the
    embedding stay dense."""
    names = llama_names()
    params = random_params(names, seed=27)
    N = SMALL_LLAMA.num_layers
    D, H, K, F = SMALL_LLAMA.d_model, SMALL_LLAMA.num_heads, SMALL_LLAMA.head_dim, SMALL_LLAMA.d_mlp
    fans = {"q_kernel": (D, H * K), "k_kernel": (D, G * K), "v_kernel": (D, G * K), "out_kernel": (H * K, D),
            "gate_kernel": (D, F), "up_kernel": (D, F), "down_kernel": (F, D)}
    vocab = params["head"]["kernel"].shape[1]
    shapes = [fans[k] for _ in range(N) for k in fans] + [(D, vocab)]
    erk = [run_magnitude(mesh_factory(**layout), names, params, sparsity=jp.pruning.one_shot(0.8, 0),
                         distribution="erk") for layout in ({}, dict(fsdp=2, tensor=2))]
    for a, b in zip(jax.tree.leaves(erk[0]), jax.tree.leaves(erk[1])):
        assert np.array_equal(a, b)
    erk = erk[0]
    got = [erk["blocks"][k][l].mean() for l in range(N) for k in fans] + [erk["head"]["kernel"].mean()]
    assert np.all(np.abs(np.array(got) - np_erk(shapes, 0.8)) <= 1.0 / np.array([np.prod(s) for s in shapes]))
    assert erk["embed"]["embedding"] is None and erk["head"]["norm_scale"] is None

    nm = run_magnitude(mesh_factory(fsdp=2, tensor=2), names, params, n_m=(2, 4))
    for k, axis in {"q_kernel": 1, "k_kernel": 1, "v_kernel": 1, "gate_kernel": 1, "up_kernel": 1,
                    "down_kernel": 1}.items():
        w, m = np.moveaxis(np.abs(params["blocks"][k]), axis, -1), np.moveaxis(nm["blocks"][k], axis, -1)
        w = w.reshape(*w.shape[:-1], -1, 4)
        want = np.zeros(w.shape, bool)
        np.put_along_axis(want, np.argsort(-w, axis=-1, kind="stable")[..., :2], True, axis=-1)
        assert np.array_equal(m.reshape(want.shape), want), k
    out = nm["blocks"]["out_kernel"].reshape(N, H * K, D)   # reduction over (heads, kv), flattened
    assert np.all(out.reshape(N, -1, 4, D).sum(-2) == 2)
