"""jaxpar/pruning/structured.py, structured magnitude pruning (jp.pruning.structured_pruning): groups, scores and masks
against a numpy reference, sharded without gathers, zero stays zero under AdamW, checkpoint round trip, errors.

The numpy reference finds each leaf's group axis from its logical names (as the test's own code, not
jaxpar's), computes every group's L2 norm from the full arrays, and keeps the top ones (ties to the lower
index).
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
from jaxpar.models import GPT, GPTConfig, MLP

from helpers import assert_tree_close, gpt_batch, mlp_parts

TINY = GPTConfig(vocab_size=61, num_layers=2, num_heads=8, d_model=32, d_mlp=64, max_seq_len=16)
MLP_HIDDEN = (64, 128, 32)
MLP_GROUPS = {"mlp": [("dense_0", "dense_1"), ("dense_2", "head")]}   # written out: checks MLP.prune_groups too


@functools.cache
def gpt_names():
    return jax.eval_shape(GPT(TINY).init, jax.random.key(0))


def random_params(names, seed: int):
    """Fresh random params (normal, a random scale per leaf: about 0.2 for matrices, which keeps the tiny models'
    activations of order one, and 1 for vectors) of the boxed ``names`` tree; never zeros."""
    rng = np.random.default_rng(seed)
    box = lambda x: isinstance(x, nn.LogicallyPartitioned)
    leaves, treedef = jax.tree.flatten(names, is_leaf=box)
    matrix = lambda b: len([n for n in b.names if n != "layers"]) >= 2
    return treedef.unflatten([rng.normal(scale=rng.uniform(0.5, 2.0) * (0.2 if matrix(b) else 1.0),
                                         size=b.value.shape).astype(np.float32) for b in leaves])


def leaf_names(names):
    """``{path: logical names}`` of a boxed tree (read in the test from the boxes)."""
    box = lambda x: isinstance(x, nn.LogicallyPartitioned)
    flat = jax.tree_util.tree_flatten_with_path(names, is_leaf=box)[0]
    return {tuple(k.key for k in p): tuple(b.names) for p, b in flat}


def np_groups(names, modules, axis):
    """The leaves of ``modules`` holding ``axis``: ``[(path, group axis, layers axis or None)]``."""
    return [(p, n.index(axis), n.index("layers") if "layers" in n else None)
            for p, n in leaf_names(names).items() if p[:-1] in modules and axis in n]


def np_norms(params, members):
    """Per group, the L2 norm of all its weights: ``[layers, groups]`` (``[1, groups]`` unstacked)."""
    total = 0.0
    for path, g, lay in members:
        x = np.asarray(functools.reduce(lambda t, k: t[k], path, params), np.float64)
        x = np.moveaxis(x, (lay, g), (0, 1)) if lay is not None else np.moveaxis(x, g, 0)[None]
        total = total + np.sum(x.reshape(x.shape[0], x.shape[1], -1) ** 2, axis=-1)
    return np.sqrt(total)


def np_keep(norms, sparsity, distribution):
    """Top groups by norm (ties to the lower index), per row (uniform, at least 1) or pooled (global: every row's
    top group first, then the others by norm up to ``max(round((1 - sparsity) * size), rows)``)."""
    if distribution == "global":
        rows, size = norms.shape
        out = np.zeros(norms.shape, bool)
        out[np.arange(rows), np.argmax(norms, axis=1)] = True   # argmax: the first (lowest) index of ties
        keep = max(round((1 - sparsity) * norms.size), rows)
        flat = np.where(out, np.inf, norms).reshape(-1)
        out.reshape(-1)[np.lexsort((np.arange(flat.size), -flat))[:keep]] = True
        return out
    keep = max(1, round((1 - sparsity) * norms.shape[1]))
    out = np.zeros(norms.shape, bool)
    for r, row in enumerate(norms):
        out[r, np.lexsort((np.arange(row.size), -row))[:keep]] = True
    return out


def np_param_mask(shape, g, lay, mask):
    """A ``[layers, groups]`` group mask broadcast to a leaf of ``shape`` (group axis g, layers axis lay)."""
    out = np.ones(shape, bool)
    idx = np.indices(shape)
    rows = idx[lay] if lay is not None else np.zeros(shape, int)
    return out & mask[rows, idx[g]]


def prune_once(params, names, sparsity, distribution, **kw):
    tx = jp.pruning.structured_pruning(jp.pruning.one_shot(sparsity, 0), distribution, axis_names=names, **kw)
    _, state = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    return jax.device_get(state.masks)


# ------------------------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("distribution", ["uniform", "global"])
@pytest.mark.parametrize("sparsity", [0.25, 0.6])
def test_gpt_masks_match_numpy_reference(sparsity, distribution):
    params = random_params(gpt_names(), seed=3)
    masks = prune_once(params, gpt_names(), sparsity, distribution)
    for axis in ("mlp", "heads"):
        ref = np_keep(np_norms(params, np_groups(gpt_names(), {("blocks",)}, axis)), sparsity, distribution)
        assert np.array_equal(masks["blocks"][axis], ref), axis
    if distribution == "global":   # layers keep different counts (what compaction pads)
        assert len(set(masks["blocks"]["mlp"].sum(-1))) > 1


@pytest.mark.parametrize("distribution", ["uniform", "global"])
def test_every_layer_keeps_a_group_at_sparsity_099(distribution):
    """At sparsity 0.99 every layer keeps at least one head and one MLP unit (its top-scoring one), as
    Torch-Pruning keeps a layer's last channel; global keeps one per layer, uniform one per layer; the masks
    equal the numpy reference; the MLP's two chains each keep one unit; compaction then runs."""
    params = random_params(gpt_names(), seed=15)
    masks = prune_once(params, gpt_names(), 0.99, distribution)
    for axis in ("mlp", "heads"):
        norms = np_norms(params, np_groups(gpt_names(), {("blocks",)}, axis))
        assert np.array_equal(masks["blocks"][axis].sum(-1), [1] * TINY.num_layers), axis
        assert np.array_equal(np.argmax(masks["blocks"][axis], -1), np.argmax(norms, -1)), axis
        assert np.array_equal(masks["blocks"][axis], np_keep(norms, 0.99, distribution)), axis
    new_params, cfg = jp.pruning.compact(params, masks, TINY)
    assert (cfg.num_heads, cfg.d_mlp) == (1, 1)
    init, _ = mlp_parts(MLP_HIDDEN)
    names = jax.eval_shape(init, jax.random.key(0))
    params = random_params(names, seed=16)
    masks = prune_once(params, names, 0.99, distribution, groups=MLP_GROUPS)
    for first, chain in (("dense_0", {("dense_0",), ("dense_1",)}), ("dense_2", {("dense_2",), ("head",)})):
        norms = np_norms(params, np_groups(names, chain, "mlp"))[0]
        assert np.flatnonzero(masks[first]["mlp"]).tolist() == [int(np.argmax(norms))], first


def test_mlp_chains_match_numpy_reference():
    init, _ = mlp_parts(MLP_HIDDEN)
    names = jax.eval_shape(init, jax.random.key(0))
    params = random_params(names, seed=4)
    assert MLP(hidden=MLP_HIDDEN).prune_groups() == MLP_GROUPS
    masks = prune_once(params, names, 0.5, "uniform", groups=MLP_GROUPS)
    assert set(masks) == {"dense_0", "dense_2"}
    for first, chain in (("dense_0", {("dense_0",), ("dense_1",)}), ("dense_2", {("dense_2",), ("head",)})):
        members = np_groups(names, chain, "mlp")
        assert len(members) == 3          # kernel columns, bias entries, next kernel's rows
        ref = np_keep(np_norms(params, members), 0.5, "uniform")[0]
        assert np.array_equal(masks[first]["mlp"], ref), first


def test_update_is_sharded_without_gathers_and_matches_one_device(mesh_factory):
    """On data=2 x fsdp=2 x tensor=2 the compiled update has no all-gather, the masks equal the 1-device ones
    and live along their params' tensor axis."""
    params_host = random_params(gpt_names(), seed=5)
    tx = jp.pruning.structured_pruning(0.5, "global", axis_names=gpt_names())
    ref = prune_once(params_host, gpt_names(), 0.5, "global")
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    params = jax.device_put(params_host, jp.sharding.named_shardings(gpt_names(), mesh))
    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(params)
        update = jax.jit(tx.update).lower(params, state, params).compile()
    updates, new = update(jax.tree.map(jnp.zeros_like, params), state, params)
    hlo = update.as_text()
    assert "all-gather" not in hlo and "all-reduce" in hlo
    for axis in ("mlp", "heads"):
        assert np.array_equal(np.asarray(new.masks["blocks"][axis]), ref["blocks"][axis])
    assert all(np.all(np.asarray(x) == np.asarray(p)) for x, p in zip(jax.tree.leaves(params_host),
                                                                      jax.tree.leaves(params)))


# ---------------------------------------------------------------------------- zero stays zero; checkpoint

def pruned_leaves(params, masks, names):
    """``{path: bool array}`` True at weights of pruned groups (the numpy reference broadcast)."""
    out = {}
    for axis in masks["blocks"]:
        for path, g, lay in np_groups(names, {("blocks",)}, axis):
            x = functools.reduce(lambda t, k: t[k], path, params)
            off = ~np_param_mask(np.shape(x), g, lay, np.asarray(masks["blocks"][axis]))
            out[path] = out.get(path, np.zeros(np.shape(x), bool)) | off
    return out


@functools.cache
def pruned_run():
    """AdamW (momentum, weight decay on every leaf) and one-shot global pruning at step 2 of the tiny GPT on
    data=2 x fsdp=2 x tensor=2, run for 3 steps; shared with test_compact.py (one compile of the step)."""
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8])
    prune = jp.pruning.structured_pruning(jp.pruning.one_shot(0.5, step=2), "global", axis_names=gpt_names())
    tx = optax.chain(optax.adamw(1e-2, weight_decay=0.1), prune)
    state = jp.train.init_state(GPT(TINY).init, tx, jax.random.key(0), mesh=mesh)
    step = jp.train.make_train_step(GPT(TINY).loss, tx, mesh=mesh, donate=False)
    rng = np.random.default_rng(11)
    batches = [gpt_batch(rng, 8, TINY) for _ in range(9)]
    for t in range(3):
        state, _ = step(state, batches[t])
    return dict(mesh=mesh, tx=tx, step=step, state=state, batches=batches)


def test_pruned_groups_stay_zero_under_adamw_and_round_trip_a_checkpoint(tmp_path):
    """After pruning at step 2, five more AdamW steps: pruned groups stay exactly 0.0, kept weights move, masks
    stay fixed; then a jp.checkpoint round trip restores the same state, and a step from it agrees."""
    run = pruned_run()
    mesh, tx, step, state, batches = run["mesh"], run["tx"], run["step"], run["state"], run["batches"]
    model = GPT(TINY)
    masks = jax.device_get(jp.pruning.group_masks(state.opt_state))
    assert 0 < sum(int((~m).sum()) for m in jax.tree.leaves(masks))
    for t in range(3, 8):
        before = jax.device_get(state.params)
        state, metrics = step(state, batches[t])
        params = jax.device_get(state.params)
        for path, off in pruned_leaves(params, masks, gpt_names()).items():
            value = functools.reduce(lambda d, k: d[k], path, params)
            old = functools.reduce(lambda d, k: d[k], path, before)
            assert np.all(value[off] == 0.0), f"step {t}: {path} revived"
            assert np.any(value[~off] != old[~off]), f"step {t}: {path}'s kept weights did not move"
        now = jax.device_get(jp.pruning.group_masks(state.opt_state))
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(masks)))
    assert np.isfinite(float(metrics["loss"]))
    # Checkpoint round trip through jp.checkpoint, restored onto the abstract state; the next step agrees.
    ckpt = jp.checkpoint.CheckpointManager(tmp_path / "ckpt")
    ckpt.save(8, state)
    ckpt.wait()
    restored = ckpt.restore(target=jp.train.abstract_state(model.init, tx, mesh=mesh))
    ckpt.close()
    assert isinstance(jp.pruning.group_masks(restored.opt_state), dict)
    assert_tree_close(restored.opt_state, state.opt_state, rtol=0.0, what="restored opt_state")
    assert_tree_close(restored.params, state.params, rtol=0.0, what="restored params")
    restored, _ = step(restored, batches[8])
    state, _ = step(state, batches[8])
    assert_tree_close(restored.params, state.params, rtol=0.0, what="a step after the restore")


# -------------------------------------------------------------------------------------------- bad input

def test_bad_input_raises_clear_errors():
    names = gpt_names()
    params = nn.meta.unbox(names)
    with pytest.raises(ValueError, match="erk"):
        jp.pruning.structured_pruning(0.5, "erk", axis_names=names)
    with pytest.raises(ValueError, match="unknown"):
        jp.pruning.structured_pruning(0.5, "layerwise", axis_names=names)
    with pytest.raises(ValueError, match="'embed' is never pruned"):
        jp.pruning.structured_pruning(0.5, axes=("embed",), axis_names=names)
    with pytest.raises(ValueError, match="axis_names"):
        jp.pruning.structured_pruning(0.5).init(params)
    with pytest.raises(ValueError, match=r"sparsity=1\.0"):
        jp.pruning.structured_pruning(1.0, axis_names=names)
    with pytest.raises(TypeError, match="sparsity"):
        jp.pruning.structured_pruning("half", axis_names=names)
    with pytest.raises(ValueError, match="needs the params"):
        tx = jp.pruning.structured_pruning(0.5, axis_names=names)
        tx.update(params, tx.init(params))
    init, _ = mlp_parts(MLP_HIDDEN)
    mlp_names = jax.eval_shape(init, jax.random.key(0))
    mlp_params = nn.meta.unbox(mlp_names)
    cases = [(dict(), "appears in several modules"),   # no chains: the MLP's coupling is not clear
             (dict(groups={"mlp": [("dense_0", "dense_9")]}), "holds no leaf"),
             (dict(groups={"mlp": [("dense_0", "dense_1"), ("dense_1", "dense_2")]}), "in two 'mlp' chains"),
             (dict(groups={"mlp": [("dense_0", "dense_2")]}), "disagree on its size"),   # 64 vs 32 neurons
             (dict(groups={"heads": [("dense_0",)]}), "not pruned here")]
    for kw, match in cases:
        tx = jp.pruning.structured_pruning(0.5, axes=("mlp",), axis_names=mlp_names, **kw)
        with pytest.raises((ValueError, TypeError), match=match):
            tx.init(mlp_params)
    with pytest.raises(ValueError, match="no leaf with the logical axes"):
        tx = jp.pruning.structured_pruning(0.5, axes=("heads",), axis_names=mlp_names, groups=None)
        tx.init(mlp_params)
    with pytest.raises(TypeError, match="groups"):
        jp.pruning.structured_pruning(0.5, axes=("mlp",), axis_names=mlp_names, groups=[("dense_0",)]).init(mlp_params)
