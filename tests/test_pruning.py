"""Magnitude pruning (jaxpar.pruning): one harness every configuration passes, then the method's guarantees.

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
from jaxpar.pruning.structure import make_plans

from helpers import assert_tree_close, mlp_batch, mlp_parts

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


# ------------------------------------------------------------------------ distributions and N:M structure

def prune_once(params, axis_names=None, **kwargs):
    """Masks of one refresh at step 0 with zero updates (so candidates are the params); not jitted."""
    tx = jp.pruning.magnitude_pruning(axis_names=axis_names, **kwargs)
    _, state = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    return jax.device_get(state.masks)


def random_tree(seed: int = 0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = {"a": (64, 128), "b": (128, 32), "c": (32, 10), "conv": (3, 3, 8, 16)}
    return {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in shapes.items()}


@pytest.mark.parametrize("sparsity", [0.5, 0.9, 0.95])
def test_global_and_erk_hit_the_target(sparsity):
    params = random_tree()
    total = sum(p.size for p in jax.tree.leaves(params))
    target_kept = round((1 - sparsity) * total)
    g = prune_once(params, sparsity=jp.pruning.one_shot(sparsity), distribution="global")
    assert sum(int(m.sum()) for m in jax.tree.leaves(g)) == target_kept
    threshold = min(np.abs(np.asarray(params[k]))[g[k]].min() for k in g)   # one threshold for all tensors
    assert all(np.all(np.abs(np.asarray(params[k]))[~g[k]] < threshold) for k in g)
    e = prune_once(params, sparsity=jp.pruning.one_shot(sparsity), distribution="erk")
    assert abs(sum(int(m.sum()) for m in jax.tree.leaves(e)) - target_kept) <= len(params) / 2
    u = prune_once(params, sparsity=jp.pruning.one_shot(sparsity))
    for k, m in u.items():
        assert int(m.sum()) == round((1 - sparsity) * m.size), k


def test_exact_counts_with_ties_and_bf16():
    """Heavy ties (bf16 and a small set of values): counts stay exact, ties broken by flat index."""
    rng = np.random.default_rng(3)
    params = {"a": jnp.asarray(rng.integers(-3, 4, size=(64, 48)), jnp.bfloat16),
              "b": jnp.asarray(rng.integers(-3, 4, size=(48, 40)), jnp.float32)}
    g = prune_once(params, sparsity=jp.pruning.one_shot(0.7), distribution="global")
    assert sum(int(m.sum()) for m in g.values()) == round(0.3 * (64 * 48 + 48 * 40))
    u = prune_once(params, sparsity=jp.pruning.one_shot(0.7))
    for k, m in u.items():
        assert int(m.sum()) == round(0.3 * m.size), k
        mag = np.abs(np.asarray(params[k], np.float32))
        t = mag[m].min()
        assert np.all(mag[~m] <= t) and np.all(m[mag > t])
        ties_kept = np.flatnonzero((mag == t).ravel() & m.ravel())
        ties_dropped = np.flatnonzero((mag == t).ravel() & ~m.ravel())
        assert ties_dropped.size == 0 or ties_kept.max() < ties_dropped.min()   # earlier indices win


def test_erk_densities_match_a_hand_computed_example():
    """Evci et al. 2020 sec. 3: density_i = eps * sum(shape_i) / prod(shape_i), dense-layer fix-up.

    Shapes (8,16), (16,16), (16,4), (3,3,4,8): sizes 128, 256, 64, 288 (736 weights); at sparsity 0.5 keep 368.
    sum(shape) = 24, 32, 20, 18, so eps = 368 / (24 + 32 + 20 + 18) = 3.915 would give (16,4) density
    3.915 * 20 / 64 = 1.22 > 1: it is made dense, and eps = (368 - 64) / (24 + 32 + 18) = 304 / 74 for the rest.
    """
    eps = 304 / 74
    expected = [eps * 24 / 128, eps * 32 / 256, 1.0, eps * 18 / 288]   # 0.7703, 0.5135, 1, 0.2568
    shapes = [(8, 16), (16, 16), (16, 4), (3, 3, 4, 8)]
    np.testing.assert_allclose(jp.pruning.erk_densities(shapes, 0.5), expected, rtol=1e-6)
    rng = np.random.default_rng(0)
    params = {f"t{i}": jnp.asarray(rng.normal(size=s), jnp.float32) for i, s in enumerate(shapes)}
    masks = prune_once(params, sparsity=jp.pruning.one_shot(0.5), distribution="erk")
    assert [int(masks[f"t{i}"].sum()) for i in range(4)] == [99, 131, 64, 74]   # round(density * size)
    np.testing.assert_allclose(jp.pruning.erk_densities([(10, 10)], 0.3), [0.7], rtol=1e-6)


def rigl_erk(layers: dict[str, tuple[int, ...]], sparsity: float) -> tuple[dict[str, float], set[str]]:
    """Reference: RigL's ``sparse_utils.get_sparsities`` ERK loop (Evci et al. 2020), in float64 numpy.

    ``layers`` maps a layer to the shape RigL's formula sees: a dense layer's 2-D ``(fan_in, fan_out)``, a conv
    kernel's full shape. ``eps`` is solved so the kept count is ``(1 - sparsity) * total``; while the largest
    ``eps * raw`` exceeds 1, the layers with the largest raw scale are made dense and ``eps`` is solved again.
    Returns the densities and the set of dense layers.
    """
    dense: set[str] = set()
    while True:
        rhs, divisor, raw = 0.0, 0.0, {}
        for name, shape in layers.items():
            n = float(np.prod(shape))
            if name in dense:
                rhs -= sparsity * n
            else:
                rhs += (1.0 - sparsity) * n
                raw[name] = float(np.sum(shape)) / n
                divisor += raw[name] * n
        eps = rhs / divisor
        max_raw = max(raw.values())
        if eps * max_raw <= 1.0:
            return {k: 1.0 if k in dense else eps * raw[k] for k in layers}, dense
        dense |= {k for k, v in raw.items() if v == max_raw}


def assert_counts(got: dict[str, int], layers: dict[str, tuple[int, ...]], density: dict[str, float]):
    """Kept counts are ``round(density * size)`` per layer; +-1 only where the product is within 0.02 of a .5."""
    for name, shape in layers.items():
        want = density[name] * float(np.prod(shape))
        near_half = abs(want - math.floor(want) - 0.5) < 0.02
        assert abs(got[name] - round(want)) <= (1 if near_half else 0), (
            f"{name}: kept {got[name]}, RigL's ERK keeps {want:.2f} of {int(np.prod(shape))}")


@pytest.mark.parametrize("sparsity", [0.9, 0.3])
def test_erk_on_the_default_gpt_matches_rigl_2d_views(sparsity):
    """The main job's GPT (4 layers, d=128): each stacked kernel's layer slice is one RigL layer, seen as the
    2-D matrix it multiplies by (qkv: embed x 3*heads*kv, out: heads*kv x embed). At 0.9: eps = 9.6 and qkv
    keeps 4915 a layer (the all-axes sum/prod gave 2038); at 0.3 the out kernels would exceed density 1 and are
    made dense (RigL's re-solve loop)."""
    cfg = GPTConfig(num_layers=4, num_heads=4, d_model=128, max_seq_len=128)     # experiments/charlm.py
    D, H, F, N = 128, 4, 512, 4
    fans = {"qkv_kernel": (D, 3 * H * (D // H)), "out_kernel": (H * (D // H), D),
            "up_kernel": (D, F), "down_kernel": (F, D)}
    layers = {f"{k}/{i}": fans[k] for k in KERNELS for i in range(N)}
    density, dense = rigl_erk(layers, sparsity)
    assert dense == ({f"out_kernel/{i}" for i in range(N)} if sparsity == 0.3 else set())
    init = lambda rng: GPT(cfg).init(rng)
    params = jax.tree.map(jnp.asarray, nn.meta.unbox(jax.jit(init)(jax.random.key(1))))
    masks = prune_once(params, jax.eval_shape(init, jax.random.key(1)),
                       sparsity=jp.pruning.one_shot(sparsity), distribution="erk")
    got = {}
    for k in KERNELS:
        mask = masks["blocks"][k]
        assert mask.shape[0] == N and mask[0].size == math.prod(fans[k])
        got |= {f"{k}/{i}": int(c) for i, c in enumerate(mask.reshape(N, -1).sum(1))}
    assert_counts(got, layers, density)
    if sparsity == 0.9:
        assert got["qkv_kernel/0"] == 4915 and got["out_kernel/0"] == 2458 and got["up_kernel/0"] == 6144


def test_erk_on_unnamed_kernels_matches_rigl():
    """A user model without names: 2-D (in, out) kernels, a conv kernel (RigL's rule: its full shape), and a 3-D
    ``[in, heads, head_dim]`` kernel whose input axis is given by ``reduction_axes=`` (2-D view in x heads*dim).
    At 0.9 the gate would exceed density 1 and is made dense; the re-solved eps then pushes the head (density
    0.88 at the first eps) over 1 too: RigL's loop needs both rounds."""
    rng = np.random.default_rng(5)
    shapes = {"inp": (64, 256), "attn": (256, 4, 16), "conv": (3, 3, 8, 16), "gate": (256, 2), "head": (96, 4)}
    params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    layers = {"inp": (64, 256), "attn": (256, 64), "conv": (3, 3, 8, 16), "gate": (256, 2), "head": (96, 4)}
    density, dense = rigl_erk(layers, 0.9)
    eps0 = 0.1 * sum(math.prod(v) for v in layers.values()) / sum(sum(v) for v in layers.values())
    assert dense == {"gate", "head"} and eps0 * 100 / 384 < 0.9          # head: (96 + 4) / (96 * 4)
    axes = lambda path, shape: (0,) if path == ("attn",) else None
    masks = prune_once(params, sparsity=jp.pruning.one_shot(0.9), distribution="erk", reduction_axes=axes)
    assert_counts({k: int(m.sum()) for k, m in masks.items()}, layers, density)


def groups(mask: np.ndarray, axes: tuple[int, ...], m: int) -> np.ndarray:
    moved = np.moveaxis(mask, axes, tuple(range(mask.ndim - len(axes), mask.ndim)))
    return moved.reshape(-1, m)


def test_reduction_axes_from_logical_names():
    plans = {p.name: p for p in make_plans(nn.meta.unbox(names()), names()) if p}
    assert set(plans) == {f"blocks/{k}" for k in KERNELS} | {"extra/kernel"}   # no norms, biases, embeddings
    assert plans["blocks/qkv_kernel"].reduction_axes == (1,)       # [layers, embed, heads, 3, kv]
    assert plans["blocks/out_kernel"].reduction_axes == (1, 2)     # [layers, heads, kv, embed]
    assert plans["blocks/up_kernel"].reduction_axes == (1,)        # [layers, embed, mlp]
    assert plans["blocks/down_kernel"].reduction_axes == (1,)      # [layers, mlp, embed]
    assert plans["extra/kernel"].reduction_axes == (0,)            # unnamed (in, out)
    assert all(plans[f"blocks/{k}"].batch_axes == (0,) for k in KERNELS)
    over = make_plans({"w": jnp.zeros((4, 8, 12))}, reduction_axes=lambda path, shape: (1, 2))
    assert over[0].reduction_axes == (1, 2)


def test_n_m_keeps_exactly_n_of_every_m_along_the_reduction_axes():
    params = jax.tree.map(jnp.asarray, host_init())
    masks = prune_once(params, names(), n_m=(2, 4))
    plans = {p.path: p for p in make_plans(params, names()) if p}
    for path, plan in plans.items():
        mask = masks[path[0]][path[1]]
        per_group = groups(mask, plan.reduction_axes, 4).sum(-1)
        assert np.all(per_group == 2), f"{plan.name}: groups keep {np.unique(per_group)}"
        value = np.abs(np.asarray(params[path[0]][path[1]]))
        g_val, g_mask = groups(value, plan.reduction_axes, 4), groups(mask, plan.reduction_axes, 4)
        assert np.all(g_val[g_mask].reshape(-1, 2).min(-1) >= g_val[~g_mask].reshape(-1, 2).max(-1)), plan.name
    # Gradual N:M: below 1 - N/M every group keeps at least N, and the tensor exactly its target.
    masks = prune_once(params, names(), sparsity=jp.pruning.polynomial_sparsity(0.5, 0, 4, initial=0.25), n_m=(2, 4))
    for path, plan in plans.items():
        mask = masks[path[0]][path[1]]
        assert groups(mask, plan.reduction_axes, 4).sum(-1).min() >= 2
        assert int(mask.sum()) == plan.num_slices * round(0.75 * plan.slice_size)


# ------------------------------------------------------------------------------ schedules and retracing

def test_polynomial_schedule_values_and_refresh_steps():
    s = jp.pruning.polynomial_sparsity(0.9, begin_step=2, end_step=10, initial=0.1, frequency=3)
    steps = np.arange(14)
    expected = [0.0, 0.0] + [0.9 + (0.1 - 0.9) * (1 - (t - 2) / 8) ** 3 for t in range(2, 11)] + [0.9] * 3
    np.testing.assert_allclose([float(s(t)) for t in steps], expected, rtol=1e-6)
    assert [int(t) for t in steps if s.refresh(t)] == [2, 5, 8, 10]     # grid steps, and always end_step
    assert [int(t) for t in range(300) if jp.pruning.constant_sparsity(0.5).refresh(t)] == [0, 100, 200]
    assert [int(t) for t in range(10) if jp.pruning.one_shot(0.5, step=4).refresh(t)] == [4]


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
