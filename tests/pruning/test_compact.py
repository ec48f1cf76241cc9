"""jaxpar/pruning/compact.py, compaction (jp.pruning.compact / compact_opt_state / compact_state): the smaller
dense model computes what the masked model computes, on one device and on data=2 x fsdp=2 x tensor=2; the
optimizer state follows its weights; training continues through the normal step; bad input is refused.

The masked reference is the original model applied to ``params * mask``, the mask broadcast in the test (numpy,
axes found from the logical names) from the group masks; the compacted model is applied with its new config.
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
from jaxpar.models import GPT, MLP

from helpers import MLP_FEATURES, assert_tree_close, gpt_batch, max_rel_err

from .test_structure import TRANSFORMS, other_names
from .test_structured import (MLP_GROUPS, MLP_HIDDEN, TINY, gpt_names, leaf_names, np_groups, np_param_mask,
                              pruned_leaves, pruned_run, random_params)

MLP_MODEL = MLP(hidden=MLP_HIDDEN, num_classes=10)


def mlp_init(model=MLP_MODEL):
    return lambda rng: model.init(rng, jnp.zeros((1, MLP_FEATURES), jnp.float32))["params"]


@functools.cache
def mlp_names():
    return jax.eval_shape(mlp_init(), jax.random.key(0))


def masks_for(params, names, sparsity, distribution, **kw):
    tx = jp.pruning.structured_pruning(jp.pruning.one_shot(sparsity, 0), distribution, axis_names=names, **kw)
    _, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    return jax.device_get(state.masks)


def masked(params, names, masks, chains):
    """``params * mask`` (numpy); ``chains``: ``{mask module: modules of its chain}``."""
    out = jax.tree.map(np.array, params)
    for first, modules in chains.items():
        for axis, mask in masks[first].items():
            mask = np.asarray(mask).reshape(-1, np.shape(mask)[-1])
            for path, g, lay in np_groups(names, modules, axis):
                leaf = functools.reduce(lambda t, k: t[k], path[:-1], out)
                leaf[path[-1]] = leaf[path[-1]] * np_param_mask(leaf[path[-1]].shape, g, lay, mask)
    return out


def logits_on(apply, params, x, mesh, names):
    """``apply(params, x)`` jitted with the params placed by their logical names on ``mesh``."""
    params = jax.device_put(params, jp.sharding.named_shardings(names, mesh))
    with jp.sharding.use(mesh):
        return np.asarray(jax.jit(apply)(params, x))


def rounded(n, m):
    return -(-n // m) * m


GPT_CASES = [(0.5, "global", "2x2x2"), (0.75, "uniform", "1dev"),
             pytest.param(0.25, "global", "1dev", marks=pytest.mark.slow),
             pytest.param(0.5, "uniform", "1dev", marks=pytest.mark.slow),
             pytest.param(0.75, "global", "2x2x2", marks=pytest.mark.slow),
             pytest.param(0.25, "uniform", "2x2x2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("sparsity,distribution,layout", GPT_CASES)
def test_compacted_gpt_logits_equal_masked_logits(sparsity, distribution, layout, mesh_factory, np_rng):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2) if layout == "2x2x2" else mesh_factory()
    params = random_params(gpt_names(), seed=7)
    masks = masks_for(params, gpt_names(), sparsity, distribution)
    if layout == "2x2x2":   # compact sharded params
        params = jax.device_put(params, jp.sharding.named_shardings(gpt_names(), mesh))
    new_params, cfg = jp.pruning.compact(params, masks, TINY, multiple_of=2)
    kept = {a: int(masks["blocks"][a].sum(-1).max()) for a in ("mlp", "heads")}
    assert (cfg.num_heads, cfg.d_mlp, cfg.head_dim) == (rounded(kept["heads"], 2), rounded(kept["mlp"], 2),
                                                        TINY.head_dim)
    assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(new_params)) < TINY.num_params()
    tokens = gpt_batch(np_rng, 4, TINY)["inputs"]
    ref = np.asarray(GPT(TINY).apply(masked(jax.device_get(params), gpt_names(), masks, {"blocks": {("blocks",)}}),
                                     tokens))
    got = logits_on(GPT(cfg).apply, jax.device_get(new_params), tokens, mesh,
                    jax.eval_shape(GPT(cfg).init, jax.random.key(0)))
    valid = slice(0, TINY.vocab_size)   # padded vocabulary entries hold a large negative constant
    assert max_rel_err(got[..., valid], ref[..., valid]) <= 1e-5
    assert np.max(np.abs(ref[..., valid])) > 1.0


MLP_CASES = [(0.3, "uniform", "1dev"), (0.6, "global", "2x2x2"),
             pytest.param(0.6, "uniform", "1dev", marks=pytest.mark.slow),
             pytest.param(0.85, "global", "1dev", marks=pytest.mark.slow),
             pytest.param(0.3, "global", "2x2x2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("sparsity,distribution,layout", MLP_CASES)
def test_compacted_mlp_logits_equal_masked_logits(sparsity, distribution, layout, mesh_factory, np_rng):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2) if layout == "2x2x2" else mesh_factory()
    params = random_params(mlp_names(), seed=8)
    masks = masks_for(params, mlp_names(), sparsity, distribution, groups=MLP_GROUPS)
    new_params, model = jp.pruning.compact(params, masks, MLP_MODEL, multiple_of=2)
    # A layer global pruning emptied (its groups hold fewer weights) keeps one padding neuron, rounded up to 2.
    assert model.hidden == (rounded(max(1, int(masks["dense_0"]["mlp"].sum())), 2), MLP_HIDDEN[1],
                            rounded(max(1, int(masks["dense_2"]["mlp"].sum())), 2))
    x = np_rng.normal(size=(8, MLP_FEATURES)).astype(np.float32)
    chains = {"dense_0": {("dense_0",), ("dense_1",)}, "dense_2": {("dense_2",), ("head",)}}
    ref = np.asarray(MLP_MODEL.apply({"params": masked(params, mlp_names(), masks, chains)}, x))
    got = logits_on(lambda p, x: model.apply({"params": p}, x), jax.device_get(new_params), x, mesh,
                    jax.eval_shape(mlp_init(model), jax.random.key(0)))
    assert max_rel_err(got, ref) <= 1e-5


# ----------------------------------------------------------------------- optimizer state, training on

def kept_groups(x, g, lay, mask):
    """The slices of ``x`` along group axis ``g`` where ``mask [layers, groups]`` is True, per layer."""
    x = np.moveaxis(np.asarray(x), (lay, g), (0, 1))
    return [x[l][np.asarray(mask)[l]] for l in range(x.shape[0])]


@pytest.mark.slow  # ~25 s; the fast set compacts and trains on in tests/models/test_protocol.py; .ci/run runs it
def test_compact_state_keeps_adamw_moments_and_training_continues():
    """Prune (global, one-shot at step 2), train 3 steps, compact onto the same 2x2x2 mesh; AdamW's mu and nu
    of every kept group move with it; 3 more steps of the compacted model give the losses the masked model
    gives, and padding groups stay exactly zero."""
    run = pruned_run()
    mesh, tx, step, state, batches = run["mesh"], run["tx"], run["step"], run["state"], run["batches"]
    new, cfg = jp.pruning.compact_state(state, TINY, tx, mesh=mesh)
    assert cfg.num_heads % 2 == 0 and cfg.d_mlp % 2 == 0 and cfg.num_heads < TINY.num_heads
    old_masks = jax.device_get(jp.pruning.group_masks(state.opt_state))
    new_masks = jax.device_get(jp.pruning.group_masks(new.opt_state))
    old_adam, new_adam = jax.device_get(state.opt_state[0][0]), jax.device_get(new.opt_state[0][0])
    new_names = jax.eval_shape(GPT(cfg).init, jax.random.key(0))
    for axis in ("mlp", "heads"):
        assert np.array_equal(new_masks["blocks"][axis].sum(-1), old_masks["blocks"][axis].sum(-1))
        for (path, g, lay), (_, g2, lay2) in zip(np_groups(gpt_names(), {("blocks",)}, axis),
                                                 np_groups(new_names, {("blocks",)}, axis)):
            for moment in ("mu", "nu"):
                old = kept_groups(getattr(old_adam, moment)["blocks"][path[-1]], g, lay, old_masks["blocks"][axis])
                got = kept_groups(getattr(new_adam, moment)["blocks"][path[-1]], g2, lay2, new_masks["blocks"][axis])
                assert all(np.array_equal(a, b) for a, b in zip(got, old)), (moment, path)
    assert new.params["blocks"]["up_kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    # The compacted state owns its buffers (also the leaves compaction leaves alone: embeddings, counts), so
    # donating it leaves the original state readable.
    pointers = lambda tree: {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)
                             for s in x.addressable_shards}
    assert not pointers(new) & pointers(state)
    host = lambda st: jax.device_get(jax.tree.map(
        lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, st))
    before = host(state)
    step2 = jp.train.make_train_step(GPT(cfg).loss, tx, mesh=mesh, donate=True)
    for t in range(3, 6):
        state, ref = step(state, batches[t])
        donated, (new, got) = new, step2(new, batches[t])
        assert all(x.is_deleted() for x in jax.tree.leaves(donated.params))
        assert max_rel_err(got["loss"], ref["loss"]) <= 1e-5, t
    assert_tree_close(host(run["state"]), before, rtol=0.0, what="the state compacted, after donations")
    params = jax.device_get(new.params)
    for path, off in pruned_leaves(params, new_masks, new_names).items():
        assert np.all(functools.reduce(lambda d, k: d[k], path, params)[off] == 0.0), path


def test_compact_opt_state_of_a_plain_adam_state():
    params = random_params(mlp_names(), seed=9)
    masks = masks_for(params, mlp_names(), 0.5, "uniform", groups=MLP_GROUPS)
    opt = optax.adam(1e-3)
    state = opt.init(params)
    state = jax.tree.map(lambda x: x + 1.0 if x.ndim else x, state)   # moments that differ per weight:
    state = (state[0]._replace(mu=jax.tree.map(lambda p: p * 3.0, params)),) + tuple(state[1:])
    new = jp.pruning.compact_opt_state(state, params, masks, MLP_MODEL)
    new_params, _ = jp.pruning.compact(params, masks, MLP_MODEL)
    keep = np.flatnonzero(masks["dense_0"]["mlp"])
    assert np.array_equal(np.asarray(new[0].mu["dense_0"]["kernel"]), 3.0 * params["dense_0"]["kernel"][:, keep])
    assert np.array_equal(np.asarray(new[0].mu["dense_1"]["kernel"]), 3.0 * params["dense_1"]["kernel"][keep])
    assert jax.tree.map(jnp.shape, new[0].mu) == jax.tree.map(jnp.shape, new_params)
    with pytest.raises(ValueError, match="path names no param"):
        jp.pruning.compact_opt_state({"extra": np.zeros_like(params["dense_0"]["kernel"])}, params, masks, MLP_MODEL)


def test_compact_rejects_bad_input():
    params = random_params(gpt_names(), seed=1)
    masks = masks_for(params, gpt_names(), 0.5, "uniform")
    with pytest.raises(TypeError, match="GPTConfig"):
        jp.pruning.compact(params, masks, {"num_heads": 8})
    with pytest.raises(TypeError, match="masks_or_state"):
        jp.pruning.compact(params, {"blocks": {"mlp": np.ones((3, 64), np.float32)}}, TINY)
    with pytest.raises(ValueError, match="multiple_of"):
        jp.pruning.compact(params, masks, TINY, multiple_of=0)
    with pytest.raises(ValueError, match="has shape"):
        jp.pruning.compact(params, {"blocks": {"mlp": np.ones((3, 32), bool)}}, TINY)
    with pytest.raises(ValueError, match="cannot be pruned"):
        jp.pruning.compact(params, {"blocks": {"kv": np.ones((3, 4), bool)}}, TINY)
    with pytest.raises(ValueError, match="no group of this model"):
        jp.pruning.compact(params, {"head": {"mlp": np.ones(64, bool)}}, TINY)
    with pytest.raises(ValueError, match="do not match the config"):
        jp.pruning.compact(params, masks, TINY.__class__(**{**TINY.__dict__, "d_mlp": 128}))
    with pytest.raises(ValueError, match="dense_1/mlp, which is no group"):   # dense_1 outputs embed
        mlp_params = random_params(mlp_names(), seed=2)
        jp.pruning.compact(mlp_params, {"dense_1": {"mlp": np.ones(128, bool)}}, MLP_MODEL)


# --------------------------------------------------------------------- Adafactor's factored moments

def np_factored_axes(shape):
    """``(d1, d0)``: the second-largest and largest axes, which optax's factored second moment reduces
    (optax ``_src/factorized.py``: ``v_row`` lacks ``d0``, ``v_col`` lacks ``d1``)."""
    order = np.argsort(shape)
    return int(order[-2]), int(order[-1])


def np_adafactor(g, p, v_row, v_col, v, count, lr, min_dim):
    """One ``optax.adafactor(lr, min_dim_size_to_factor=min_dim)`` update of one leaf, in numpy (float64): the
    factored RMS scaling (Shazeer & Stern 2018, decay ``1 - (count + 1) ** -0.8``), clipping by block RMS 1,
    the learning rate times the param's block RMS (at least 1e-3), descent."""
    g, p = np.asarray(g, np.float64), np.asarray(p, np.float64)
    decay = 1.0 - (count + 1.0) ** -0.8
    gsq = g * g + 1e-30
    d1, d0 = np_factored_axes(p.shape) if p.ndim >= 2 else (None, None)
    if p.ndim >= 2 and p.shape[d1] >= min_dim:
        row = decay * np.asarray(v_row, np.float64) + (1 - decay) * gsq.mean(d0)
        col = decay * np.asarray(v_col, np.float64) + (1 - decay) * gsq.mean(d1)
        row_factor = (row / row.mean(d1 - 1 if d1 > d0 else d1, keepdims=True)) ** -0.5
        u = g * np.expand_dims(row_factor, d0) * np.expand_dims(col ** -0.5, d1)
    else:
        u = g * (decay * np.asarray(v, np.float64) + (1 - decay) * gsq) ** -0.5
    u = u / max(1.0, np.sqrt(np.mean(u * u)))
    return -lr * max(np.sqrt(np.mean(p * p)), 1e-3) * u


def restrict(x, cuts, removed=None):
    """``x`` (a param, or a factored moment of it with the param axis ``removed`` reduced away) at the kept
    groups only; ``cuts``: ``[(group axis, layers axis or None, bool mask [layers or 1, groups])]`` on the param's
    axes (every layer keeps the same count: uniform pruning)."""
    x = np.asarray(x)
    for g, lay, mask in cuts:
        if removed is not None:
            if g == removed:
                continue   # the moment averages over the group axis: nothing to cut
            g, lay = g - (g > removed), None if lay is None else lay - (lay > removed)
        if lay is None:
            x = np.take(x, np.flatnonzero(mask[0]), axis=g)
        else:
            parts = [np.take(np.take(x, l, axis=lay), np.flatnonzero(mask[l]), axis=g - (g > lay))
                     for l in range(x.shape[lay])]
            x = np.stack(parts, axis=lay)
    return x


def leaf_cuts(names, masks, chains):
    """``{param path: cuts}`` (for :func:`restrict`) from the group masks; ``chains``: ``{mask module: modules}``."""
    out = {}
    for first, modules in chains.items():
        for axis, mask in masks[first].items():
            mask = np.asarray(mask).reshape(-1, np.shape(mask)[-1])
            for path, g, lay in np_groups(names, modules, axis):
                out.setdefault(path, []).append((g, lay, mask))
    return out


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_compacted_adafactor_step_equals_the_restricted_dense_step(model):
    """Adafactor (factored second moments on every kernel: min_dim_size_to_factor=4) run 2 steps on the dense
    model, then compacted: its state has tx.init(new_params)'s shapes, and one more step on the compacted model
    equals numpy's Adafactor step on the dense state restricted to the kept groups (v_row / v_col cut along the
    param axes they keep; the MLP's square dense_0 kernel swaps them, as its largest axis changes)."""
    if model == "gpt":
        names, config, kw, chains = gpt_names(), TINY, {}, {"blocks": {("blocks",)}}
    else:
        names, config, kw = mlp_names(), MLP_MODEL, dict(groups=MLP_GROUPS)
        chains = {"dense_0": {("dense_0",), ("dense_1",)}, "dense_2": {("dense_2",), ("head",)}}
    params = random_params(names, seed=12)
    masks = masks_for(params, names, 0.25, "uniform", **kw)
    tx, min_dim, lr = optax.adafactor(1e-2, min_dim_size_to_factor=4), 4, 1e-2
    rng = np.random.default_rng(13)
    noise = lambda tree: jax.tree.map(lambda x: rng.normal(size=np.shape(x)).astype(np.float32), tree)
    state = tx.init(params)
    for _ in range(2):
        _, state = jax.jit(tx.update)(noise(params), state, params)
    kernels = [x for p, x in jax.tree_util.tree_flatten_with_path(state[0].v_row)[0] if "kernel" in p[-1].key]
    assert len(kernels) == 4 and all(np.size(x) > 1 for x in kernels)   # every kernel factored
    new_params, new_config = jp.pruning.compact(params, masks, config)
    new_state = jp.pruning.compact_opt_state(state, params, masks, config)
    assert jax.tree.map(jnp.shape, new_state) == jax.tree.map(jnp.shape, tx.init(new_params))
    grads = noise(new_params)
    got, _ = jax.jit(tx.update)(grads, new_state, new_params)
    cuts = leaf_cuts(names, masks, chains)
    dense = jax.device_get(state[0])
    count = int(dense.count)
    at = lambda tree, path: functools.reduce(lambda t, k: t[k], path, tree)
    for path in leaf_names(names):
        c = cuts.get(path, [])
        p = restrict(at(params, path), c)
        assert np.array_equal(np.asarray(at(new_params, path)), p), path   # uniform: no padding groups
        v_row, v_col, v = at(dense.v_row, path), at(dense.v_col, path), at(dense.v, path)
        if np.size(v_row) > 1:   # factored: the moments that lack each param axis, on the new shape's axes
            d1, d0 = np_factored_axes(np.shape(at(params, path)))
            lacking = {d0: restrict(v_row, c, removed=d0), d1: restrict(v_col, c, removed=d1)}
            e1, e0 = np_factored_axes(p.shape)
            v_row, v_col = lacking[e0], lacking[e1]
        else:
            v = restrict(v, c)
        ref = np_adafactor(at(grads, path), p, v_row, v_col, v, count, lr, min_dim)
        assert max_rel_err(np.asarray(at(got, path)), ref) <= 1e-5, path
    if model == "mlp":
        assert np.shape(dense.v_row["dense_0"]["kernel"]) == (MLP_FEATURES,)   # rows: features (square kernel)
        assert np.shape(new_state[0].v_row["dense_0"]["kernel"]) == (new_config.hidden[0],)   # now: hidden units


def test_compact_opt_state_refuses_factored_moments_it_cannot_carry():
    """out_kernel [layers, heads, kv, embed] = (2, 8, 4, 32) factors (heads, embed); with 2 heads left its two
    largest axes are (kv, embed): the statistics do not carry over."""
    params = random_params(gpt_names(), seed=14)
    masks = masks_for(params, gpt_names(), 0.75, "uniform")
    state = optax.adafactor(1e-2, min_dim_size_to_factor=2).init(params)
    with pytest.raises(ValueError, match=r"out_kernel.*re-initialise"):
        jp.pruning.compact_opt_state(state, params, masks, TINY)


# -------------------------------------------------------------------------- boxed params, multiple_of

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
    match = (r"multiple_of has unknown keys \['(mpl|head)'\]; its keys are the group axes \('mlp', 'heads', 'experts'\)"
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


# ------------------------------------------------------------------------------------ another model's

def test_names_of_the_compacted_model_may_differ_along_mlp_and_heads_only():
    """Training continues after compaction with the transform built from the original names: sizes along mlp and
    heads may differ (the compacted model), no other axis."""
    params = random_params(gpt_names(), seed=5)
    small, cfg = jp.pruning.compact(params, masks_for(params, gpt_names(), 0.5, "uniform"), TINY)
    for kind, make in TRANSFORMS.items():
        tx = make(gpt_names())
        updates, _ = tx.update(jax.tree.map(jnp.zeros_like, small), tx.init(small), small)
        assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, small), kind


def test_compaction_with_another_models_state_names_the_leaf():
    params, other = random_params(gpt_names(), seed=6), random_params(other_names(), seed=7)
    masks = masks_for(params, gpt_names(), 0.5, "uniform")
    with pytest.raises(ValueError, match=r"mask blocks/\w+ has shape \(3, "):
        jp.pruning.compact(params, masks_for(other, other_names(), 0.5, "uniform"), TINY)
    with pytest.raises(ValueError, match=r"mask blocks/\w+ has shape \(3, "):
        jp.pruning.param_masks(params, masks_for(other, other_names(), 0.5, "uniform"), gpt_names())
    for opt in (optax.adam(1e-3), optax.adafactor(1e-3, min_dim_size_to_factor=4)):
        with pytest.raises(ValueError, match=r"\[0\]\.\w+\['blocks'\]\['\w+'\] .*param blocks/\w+ of shape \(2, .*"
                                             r"optimizer state of these params"):
            jp.pruning.compact_opt_state(opt.init(other), params, masks, TINY)
    # a state of these params compacts (leaves of another shape are only refused for another model)
    state = optax.adafactor(1e-3).init(params)
    new = jp.pruning.compact_opt_state(state, params, masks, TINY)
    assert np.shape(new[0].v["blocks"]["up_kernel"])[-1] == TINY.d_mlp // 2
