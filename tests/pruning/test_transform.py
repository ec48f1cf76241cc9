"""jaxpar/pruning/transform.py, magnitude pruning: one harness every configuration passes, then the method's
guarantees.

The harness runs the ``magnitude_pruning`` transform alone (on fresh random updates, as an optimizer would give)
for two steps on a tiny GPT plus an unnamed kernel, on four layouts (1 device; fsdp=8; tensor=8; fsdp=8 on an
Explicit mesh), jitted and eager, and checks that masks are bit-identical to the single-device run, live with
the params' sharding, keep their dtypes, and survive an orbax checkpoint round trip with the saved params
sparse; on fsdp=8 the compiled update has no all-gather. ``jp.train`` integration (init_state shardings, a real
train step) is covered by the 50-step test.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig

from helpers import assert_tree_close, mlp_batch, mlp_parts

from .test_structured import gpt_names, random_params

TINY = GPTConfig(vocab_size=61, num_layers=2, num_heads=8, d_model=32, max_seq_len=16)
KERNELS = ("qkv_kernel", "out_kernel", "up_kernel", "down_kernel")


def init_fn(rng):
    """The tiny GPT's params plus one unnamed 2-D kernel (replicated; N:M along its axis 0)."""
    k_gpt, k_extra = jax.random.split(rng)
    return {**GPT(TINY).init(k_gpt), "extra": {"kernel": jax.random.normal(k_extra, (32, 16), jnp.float32)}}


@functools.cache
def names():
    return jax.eval_shape(init_fn, jax.random.key(0))


CONFIGS = {
    "uniform-polynomial": (dict(sparsity=jp.pruning.polynomial_sparsity(0.8, 0, 1), distribution="uniform"), 0.8),
    "global-float": (dict(sparsity=0.8, distribution="global"), 0.8),
    "erk-one-shot": (dict(sparsity=jp.pruning.one_shot(0.8, step=1), distribution="erk"), 0.8),
    "2:4-polynomial": (dict(sparsity=jp.pruning.polynomial_sparsity(0.5, 0, 1), n_m=(2, 4)), 0.5),
}
LAYOUTS = {"1dev": {}, "fsdp8": dict(fsdp=8), "tensor8": dict(tensor=8), "fsdp8-explicit": dict(fsdp=8)}
STEPS = 2


def make_mesh(layout: str):
    sizes = LAYOUTS[layout]
    n = math.prod(sizes.values()) if sizes else 1
    types = (AxisType.Explicit if layout.endswith("explicit") else AxisType.Auto,) * 4
    return jp.make_mesh(data=1, devices=jax.devices()[:n], axis_types=types, **sizes)


@functools.cache
def host_init():
    return jax.device_get(nn.meta.unbox(jax.jit(init_fn)(jax.random.key(0))))


def host_updates(step: int) -> list[np.ndarray]:
    """Fresh random updates (as an optimizer would give) for every param leaf."""
    rng = np.random.default_rng(100 + step)
    return [rng.normal(scale=0.05, size=np.shape(p)).astype(np.float32) for p in jax.tree.leaves(host_init())]


def abstract(tree):
    return jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), tree)


def flat_masks(masks) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(masks))[0]
    return {jax.tree_util.keystr(p): np.asarray(m) for p, m in flat}


def run(config: str, layout: str, use_jit: bool):
    """Runs the transform alone for STEPS updates on the layout; returns the params, state and mask history."""
    mesh = make_mesh(layout)
    prune = jp.pruning.magnitude_pruning(**CONFIGS[config][0], axis_names=names())
    params = jax.device_put(host_init(), jp.sharding.named_shardings(names(), mesh))
    history, update = [], prune.update
    with jax.set_mesh(mesh):
        state = prune.init(params)
        for t in range(STEPS):
            updates = jax.tree.unflatten(jax.tree.structure(params), [
                jax.device_put(u, p.sharding) for u, p in zip(host_updates(t), jax.tree.leaves(params))])
            if use_jit and t == 0:
                update = jax.jit(prune.update).lower(updates, state, params).compile()
            updates, new_state = update(updates, state, params)
            assert abstract(new_state) == abstract(state), "state shapes or dtypes changed"
            state, params = new_state, optax.apply_updates(params, updates)
            history.append(flat_masks(state.masks))
    return dict(update=update, params=params, state=state, history=history)


@functools.cache
def reference(config: str):
    out = run(config, "1dev", use_jit=True)
    return dict(params=jax.device_get(out["params"]), history=out["history"])


@pytest.mark.parametrize("use_jit", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["jit", "eager"])  # eager: slow
@pytest.mark.parametrize("layout", [l if l in ("1dev", "fsdp8") else pytest.param(l, marks=pytest.mark.slow)
                                    for l in LAYOUTS])  # tensor8 and explicit: slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_pruning_harness(config, layout, use_jit, tmp_path):
    ref = reference(config)
    got = run(config, layout, use_jit)
    target = CONFIGS[config][1]
    # Masks are bit-identical to the single-device run at every step (counts are exact integers).
    for t, (masks, ref_masks) in enumerate(zip(got["history"], ref["history"])):
        assert masks.keys() == ref_masks.keys()
        for key in masks:
            assert np.array_equal(masks[key], ref_masks[key]), f"step {t}: {key} differs from 1 device"
    assert_tree_close(got["params"], ref["params"], what="params after pruning")
    # Masks live with the params' sharding; pruned params are exactly zero.
    params, state = got["params"], got["state"]
    for path, mask in jax.tree_util.tree_flatten_with_path(state.masks)[0]:
        param = params
        for key in path:
            param = param[key.key]
        assert mask.dtype == jnp.bool_ and mask.sharding.is_equivalent_to(param.sharding, mask.ndim), path
        assert not np.any(np.asarray(param)[~np.asarray(mask)]), f"{path}: a pruned weight is not 0.0"
    assert state.count.dtype == jnp.int32 and int(state.count) == STEPS
    report = jp.pruning.sparsity_report(params, axis_names=names())
    assert report["prunable"]["sparsity"] == pytest.approx(target, abs=2e-3)
    if layout == "fsdp8" and use_jit:
        hlo = got["update"].as_text()
        assert "all-gather" not in hlo, "the pruning update gathers a parameter"
        assert "all-reduce" in hlo   # the per-shard counts are summed
    # Orbax round trip: the restored state has the same masks, the restored params are sparse.
    tree = {"params": params, "pruning": state}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", tree)
    checkpointer.wait_until_finished()
    target_tree = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    restored = checkpointer.restore(tmp_path / "ckpt", target_tree)
    assert isinstance(restored["pruning"], jp.pruning.MagnitudePruningState)
    assert flat_masks(restored["pruning"].masks).keys() == flat_masks(state.masks).keys()
    for key, mask in flat_masks(restored["pruning"].masks).items():
        assert np.array_equal(mask, flat_masks(state.masks)[key]), key
    assert jp.pruning.sparsity_report(restored["params"], axis_names=names())["prunable"] == report["prunable"]
    assert_tree_close(restored["params"], params, rtol=0.0, what="restored params")


# --------------------------------------------------------------------------------- stays pruned, 50 steps

OPTIMIZERS = {
    "sgd-momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
}


@pytest.mark.slow  # 50 steps; .ci/run runs it
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_pruned_weights_stay_exactly_zero_for_50_steps(optimizer, mesh_factory, np_rng):
    """A train step on a 2x2x2 mesh; pruning at step 5 (moments already built up), then 50 more steps."""
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    init, loss_fn = mlp_parts()
    prune = jp.pruning.magnitude_pruning(jp.pruning.one_shot(0.8, step=5), "global",
                                         axis_names=jax.eval_shape(init, jax.random.key(0)))
    tx = optax.chain(OPTIMIZERS[optimizer](), prune)
    state = jp.train.init_state(init, tx, jax.random.key(0), mesh=mesh)
    for path, mask in jax.tree_util.tree_flatten_with_path(jp.pruning.masks(state.opt_state))[0]:
        param = state.params[path[0].key][path[1].key]    # init_state gives each mask its param's sharding
        assert mask.sharding == param.sharding and mask.sharding.spec != jax.sharding.PartitionSpec(), path
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh)
    batches = [mlp_batch(np_rng, 16) for _ in range(56)]
    for t in range(6):
        state, _ = step(state, batches[t])
    masks = jax.device_get(jp.pruning.masks(state.opt_state))
    pruned = jax.tree.map(lambda m: ~m, masks)
    assert sum(int(p.sum()) for p in jax.tree.leaves(pruned)) > 0
    before = jax.device_get(state.params)
    for t in range(6, 56):
        state, metrics = step(state, batches[t])
        params = jax.device_get(state.params)
        for path, off in jax.tree_util.tree_flatten_with_path(pruned)[0]:
            value = params[path[0].key][path[1].key]
            assert np.all(value[off] == 0.0), f"{optimizer}: step {t}: {jax.tree_util.keystr(path)} revived"
        assert flat_masks(jp.pruning.masks(state.opt_state)).keys() == flat_masks(masks).keys()
    now = jax.device_get(jp.pruning.masks(state.opt_state))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(masks)))
    kept_moved = [np.any(params[p[0].key][p[1].key][m] != before[p[0].key][p[1].key][m])
                  for p, m in jax.tree_util.tree_flatten_with_path(masks)[0]]
    assert all(kept_moved) and np.isfinite(float(metrics["loss"]))


# ----------------------------------------------------------------------------- one refresh, random trees


def prune_once(params, axis_names=None, **kwargs):
    """Masks of one refresh at step 0 with zero updates (so candidates are the params); not jitted."""
    tx = jp.pruning.magnitude_pruning(axis_names=axis_names, **kwargs)
    _, state = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    return jax.device_get(state.masks)


def random_tree(seed: int = 0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = {"a": (64, 128), "b": (128, 32), "c": (32, 10), "conv": (3, 3, 8, 16)}
    return {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in shapes.items()}


# ------------------------------------------------------------------------------ schedules and retracing

def test_schedule_does_not_retrace():
    params = random_tree()
    tx = jp.pruning.magnitude_pruning(jp.pruning.polynomial_sparsity(0.9, 0, 6, frequency=2), "global")
    traces = []

    def update(updates, state, params):
        traces.append(1)
        return tx.update(updates, state, params)

    jitted, state = jax.jit(update), tx.init(params)
    sparsities = []
    for _ in range(8):
        updates, state = jitted(jax.tree.map(jnp.zeros_like, params), state, params)
        params = optax.apply_updates(params, updates)
        sparsities.append(jp.pruning.sparsity_report(params)["prunable"]["sparsity"])
    assert len(traces) == 1 and jitted._cache_size() == 1
    assert sparsities == sorted(sparsities) and sparsities[-1] == pytest.approx(0.9, abs=1e-4)


# ------------------------------------------------------------------------ composition and inspection

def test_skipped_loss_scaling_step_prunes_nothing():
    if not hasattr(jp.precision, "loss_scaling"):
        pytest.skip("jp.precision.loss_scaling is not available")
    params = random_tree()
    prune = jp.pruning.magnitude_pruning(jp.pruning.one_shot(0.5, step=0))
    tx = jp.precision.loss_scaling(optax.chain(optax.sgd(0.1), prune), jp.precision.StaticLossScale(1.0))
    state = tx.init(params)
    bad = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
    updates, state = jax.jit(tx.update)(bad, state, params)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    assert all(np.all(np.asarray(m)) for m in jax.tree.leaves(jp.pruning.masks(state)))
    grads = jax.tree.map(lambda p: 0.01 * p, params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    report = jp.pruning.sparsity_report(optax.apply_updates(params, updates))
    assert report["prunable"]["sparsity"] == pytest.approx(0.5, abs=1e-3)


def test_sparsity_report_and_masks_lookup():
    params = jax.tree.map(jnp.asarray, host_init())
    report = jp.pruning.sparsity_report(params, axis_names=names())
    tensors = report["tensors"]
    assert tensors["embed/embedding"]["prunable"] is False and tensors["blocks/up_kernel"]["prunable"] is True
    assert tensors["blocks/up_kernel"]["shape"] == (2, 32, 128) and tensors["blocks/up_kernel"]["zeros"] == 0
    assert report["all"]["size"] == sum(p.size for p in jax.tree.leaves(params))
    assert report["prunable"]["size"] == sum(t["size"] for t in tensors.values() if t["prunable"])
    with pytest.raises(ValueError, match="0 magnitude_pruning states"):
        jp.pruning.masks(optax.adam(1e-3).init(params))


def test_sparsity_report_counts_only_pruned_leaves_fresh_and_after_pruning():
    """Sparsity is measured over the leaves the pruning prunes: 0.0 on a fresh GPT (whose zero-initialised biases
    the "all" summary still counts), the target after one pruning update; references are numpy counts."""
    params = nn.meta.unbox(jax.jit(init_fn)(jax.random.key(3)))
    pruned_paths = {f"blocks/{k}" for k in KERNELS} | {"extra/kernel"}   # what the default rules prune
    by_name = lambda tree: {"/".join(jax.tree_util.keystr((k,), simple=True) for k in path): np.asarray(x)
                            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    flat = by_name(params)
    zeros = {name: int(np.sum(x == 0)) for name, x in flat.items()}
    assert sum(zeros[n] for n in flat if n not in pruned_paths) > 0   # zero biases exist before any pruning

    fresh = jp.pruning.sparsity_report(params, axis_names=names())
    assert {n for n, t in fresh["tensors"].items() if t["prunable"]} == pruned_paths
    assert fresh["prunable"] == {"size": sum(flat[n].size for n in pruned_paths), "zeros": 0, "sparsity": 0.0}
    assert fresh["all"]["zeros"] == sum(zeros.values()) and fresh["all"]["sparsity"] > 0
    assert fresh["tensors"]["blocks/up_bias"]["sparsity"] == 1.0   # per-leaf entries are kept

    tx = jp.pruning.magnitude_pruning(0.5, distribution="uniform", axis_names=names())
    updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    after = optax.apply_updates(params, updates)
    report = jp.pruning.sparsity_report(after, axis_names=names())
    flat_after = by_name(after)
    ref_zeros = sum(int(np.sum(flat_after[n] == 0)) for n in pruned_paths)
    ref_size = sum(flat_after[n].size for n in pruned_paths)
    assert report["prunable"]["zeros"] == ref_zeros and report["prunable"]["size"] == ref_size
    assert report["prunable"]["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert report["all"]["zeros"] == ref_zeros + sum(zeros[n] for n in flat if n not in pruned_paths)


# ---------------------------------------------------------------------------------------------- errors

def test_bad_input_raises_clear_errors():
    P = jp.pruning
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            P.magnitude_pruning(bad)
    with pytest.raises(ValueError, match="distribution"):
        P.magnitude_pruning(0.5, distribution="layerwise")
    with pytest.raises(ValueError, match="1 - N/M"):
        P.magnitude_pruning(0.6, n_m=(2, 4))
    with pytest.raises(ValueError, match="n_m"):
        P.magnitude_pruning(n_m=(4, 2))
    with pytest.raises(ValueError, match="distribution='uniform'"):
        P.magnitude_pruning(n_m=(2, 4), distribution="global")
    with pytest.raises(ValueError, match="sparsity is required"):
        P.magnitude_pruning()
    with pytest.raises(TypeError, match="schedule"):
        P.magnitude_pruning("0.5")
    with pytest.raises(ValueError, match="end_step"):
        P.polynomial_sparsity(0.9, begin_step=10, end_step=5)
    with pytest.raises(ValueError, match="frequency"):
        P.polynomial_sparsity(0.9, 0, 10, frequency=0)
    with pytest.raises(ValueError, match="begin_step"):
        P.constant_sparsity(0.5, begin_step=-1)
    with pytest.raises(ValueError, match="initial"):
        P.polynomial_sparsity(0.5, 0, 10, initial=0.8)
    with pytest.raises(ValueError, match="not divisible by M=4"):
        P.magnitude_pruning(n_m=(2, 4)).init({"w": jnp.zeros((6, 8))})
    with pytest.raises(ValueError, match="axis_names"):
        P.magnitude_pruning(n_m=(2, 4)).init({"w": jnp.zeros((4, 8, 8))})   # unnamed 3-D: axes unknown
    with pytest.raises(ValueError, match="no prunable"):
        P.magnitude_pruning(0.5).init({"bias": jnp.zeros((8,))})
    with pytest.raises(ValueError, match="structure"):
        P.magnitude_pruning(0.5, axis_names={"other": None}).init({"w": jnp.zeros((4, 8))})
    tx = P.magnitude_pruning(0.5)
    params = {"w": jnp.ones((4, 8))}
    with pytest.raises(ValueError, match="needs the params"):
        tx.update(params, tx.init(params))


def test_magnitude_update_with_a_state_of_other_prunable_leaves():
    params = random_params(gpt_names(), seed=3)
    tx = jp.pruning.magnitude_pruning(0.5, axis_names=gpt_names())
    state = jp.pruning.magnitude_pruning(0.5, axis_names=gpt_names(), prunable=lambda p: p[-1] == "up_kernel")
    with pytest.raises(ValueError, match=r"blocks/down_kernel has shape None but this param needs \(2, 64, 32\)"):
        tx.update(params, state.init(params), params)
