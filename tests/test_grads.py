"""jaxpar/train/grads.py: gradient functions (``jp.grads.value_and_grad``, ``accumulate``), the ``loss_fn`` output and
batch-size checks, and gradient accumulation (weighted means over strided microbatches).

* a step built from ``jp.grads.value_and_grad(loss_fn)`` (and ``jp.grads.accumulate`` of it) gives results
  identical to one built from the plain ``loss_fn`` (and ``grad_accum_steps``), bit for bit;
* ``jp.grads.accumulate`` against a plain-JAX weighted mean over strided microbatches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SMALL_GPT, assert_scalar_close, assert_tree_close, gpt_batch, gpt_parts, mlp_batch, mlp_parts

import jaxpar as jp


SEED = 5


MESH = dict(data=2, fsdp=2, tensor=2)


def _run(step, state, batch):
    new_state, metrics = step(state, batch)
    return jax.device_get((new_state.params, new_state.opt_state, metrics))


# accum=1: slow (~11 CPU-s, two GPT step compiles); fast sibling [2], the same comparison through accumulate
@pytest.mark.parametrize("accum", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_grad_fn_step_equals_loss_fn_step(mesh_factory, accum):
    init_fn, loss_fn = gpt_parts(SMALL_GPT)
    mesh, tx = mesh_factory(**MESH), optax.adamw(1e-3)
    batch = gpt_batch(np.random.default_rng(SEED), 16, SMALL_GPT)
    state = jp.train.init_state(init_fn, tx, SEED, mesh=mesh)
    plain = _run(jp.train.make_train_step(loss_fn, tx, mesh=mesh, grad_accum_steps=accum, donate=False),
                 state, batch)
    grad_fn = jp.grads.accumulate(jp.grads.value_and_grad(loss_fn), accum)
    assert isinstance(grad_fn, jp.grads.GradFn)
    built = _run(jp.train.make_train_step(grad_fn, tx, mesh=mesh, donate=False), state, batch)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(built)):
        np.testing.assert_array_equal(a, b)


def test_accumulate_is_the_weighted_mean_over_strided_microbatches():
    """Written out in plain JAX: microbatch j = rows j::k, weight = its count of positive targets."""
    rng = np.random.default_rng(SEED)
    w = rng.normal(size=(6, 3)).astype(np.float32)
    x = rng.normal(size=(12, 6)).astype(np.float32)
    y = rng.normal(size=(12, 3)).astype(np.float32)
    y[0::3] = -1.0                      # microbatch 0 has weight 0: it must not count (nor give NaN)

    def loss_fn(p, b, rng):
        mask = (b["y"] > 0).astype(jnp.float32)
        n = mask.sum()
        loss = jnp.where(n > 0, jnp.sum(mask * (b["x"] @ p - b["y"]) ** 2) / jnp.where(n > 0, n, 1.0), 0.0)
        return loss, {"weight": n, "mean_x": b["x"].mean()}

    k = 3
    totals, grads_sum, weights, mean_x = 0.0, np.zeros_like(w), 0.0, 0.0
    for j in range(k):
        b = {"x": x[j::k], "y": y[j::k]}
        (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(w, b, None)
        totals += float(aux["weight"]) * float(loss)
        grads_sum += float(aux["weight"]) * np.asarray(g)
        mean_x += float(aux["weight"]) * float(aux["mean_x"])
        weights += float(aux["weight"])
    mesh = jp.make_mesh(data=1, devices=jax.devices()[:1])
    ctx = jp.grads.Context(mesh)
    fn = jp.grads.accumulate(jp.grads.value_and_grad(loss_fn), k)
    with jp.sharding.use(mesh):
        loss, aux, grads = jax.jit(lambda p, b: fn(p, b, jax.random.key(0), jnp.float32(1.0), ctx))(
            w, {"x": x, "y": y})
    assert weights > 0 and float(aux["weight"]) == weights
    assert_scalar_close(loss, totals / weights, what="accumulated loss")
    assert_scalar_close(aux["mean_x"], mean_x / weights, what="weighted aux")
    assert_tree_close(grads, grads_sum / weights, what="accumulated grads")


def test_empty_microbatch_weight_zero_gives_finite_whole_batch_mean(mesh):
    """A fully masked microbatch (weight 0, mean 0/0) must not poison the accumulated step."""
    init_fn, _ = mlp_parts()
    from jaxpar.models import MLP
    model = MLP(hidden=(64, 128, 32))

    def masked_loss(params, batch, rng):
        logits = model.apply({"params": params}, batch["x"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        w = batch["mask"].sum()
        return (ce * batch["mask"]).sum() / w, {"weight": w}

    tx = optax.sgd(0.1)
    batch = mlp_batch(np.random.default_rng(1), 32)
    batch["mask"] = np.ones(32, np.float32)
    batch["mask"][0::4] = 0.0                        # microbatch 0 of 4 (rows 0::4) is empty
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step4 = jp.train.make_train_step(masked_loss, tx, mesh=mesh, grad_accum_steps=4, donate=False)
    step1 = jp.train.make_train_step(masked_loss, tx, mesh=mesh, donate=False)
    s4, m4 = step4(state, batch)
    s1, m1 = step1(state, batch)
    assert np.isfinite(float(m4["loss"]))
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(s4.params), jax.tree.leaves(s1.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_grad_accumulation_on_an_explicit_mesh_matches_auto(devices, np_rng):
    from jax.sharding import AxisType
    init_fn = lambda r: {"w": jax.random.normal(r, (16,))}
    loss_fn = lambda p, b, r: (jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), {})
    batch = {"x": np_rng.normal(size=(16, 16)).astype(np.float32), "y": np_rng.normal(size=16).astype(np.float32)}
    tx = optax.sgd(0.1)
    out = []
    for types in [(AxisType.Explicit,) * 4, (AxisType.Auto,) * 4]:
        mesh = jp.make_mesh(data=8, axis_types=types)
        state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
        state, metrics = jp.train.make_train_step(loss_fn, tx, mesh=mesh, grad_accum_steps=2)(state, batch)
        out.append((float(metrics["loss"]), np.asarray(state.params["w"])))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)
    np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-6)


# ----------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("bad, match", [
    (lambda loss, aux: loss, "must return \\(loss, aux\\)"),
    (lambda loss, aux: (jnp.stack([loss, loss]), aux), "floating scalar"),
    (lambda loss, aux: (loss, [1.0]), "aux must be a dict"),
    (lambda loss, aux: (loss, {"loss": 123.0}), "aux key 'loss' is not allowed"),
    (lambda loss, aux: (loss, {"per_example": jnp.ones(4)}), "must be scalars"),
])
def test_malformed_loss_fn_output(mesh, bad, match):
    init_fn, loss_fn = mlp_parts()
    tx = optax.sgd(0.1)
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(lambda p, b, r: bad(*loss_fn(p, b, r)), tx, mesh=mesh, donate=False)
    with pytest.raises(ValueError, match=match):
        step(state, mlp_batch(np.random.default_rng(0), 16))


def test_gradient_function_outputs_are_checked(adam_mlp):
    init_fn, _, mesh, tx, batch = adam_mlp
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)

    class NoTuple(jp.grads.GradFn):
        def __call__(self, params, batch, rng, scale, ctx):
            return 1.0

    class VectorLoss(jp.grads.GradFn):
        def __call__(self, params, batch, rng, scale, ctx):
            return jnp.ones(3), {}, params

    class WrongGrads(jp.grads.GradFn):
        def __call__(self, params, batch, rng, scale, ctx):
            return jnp.float32(0.0), {}, {"x": jnp.zeros(())}

    for fn, pattern in [(NoTuple(), r"must return \(loss, aux, grads\)"), (VectorLoss(), r"loss must be a floating "
                        r"scalar"), (WrongGrads(), r"returned grads of structure")]:
        with pytest.raises(ValueError, match=pattern):
            jp.train.make_train_step(fn, tx, mesh=mesh, donate=False)(state, batch)
    bare = lambda p, b, r: jnp.float32(1.0) + 0 * jax.tree.leaves(p)[0].sum()
    with pytest.raises(ValueError, match=r"loss_fn must return \(loss, aux\).*e.g. return loss, \{\}; got a bare array"):
        jp.train.make_train_step(bare, tx, mesh=mesh, donate=False)(state, batch)


def test_empty_batch(mesh):
    with pytest.raises(ValueError, match="batch 0 is empty"):
        jp.grads.check_batch_size(0, mesh, jp.sharding.DEFAULT_RULES)


@pytest.mark.parametrize("args, pattern", [((16, 0, 1), "grad_accum_steps=0"), ((16, 1, 0), "microbatches=0"),
                                           ((16.0, 1, 1), "batch_size=16.0"), ((True, 1, 1), "batch_size=True"),
                                           ((16, -1, 1), "grad_accum_steps=-1")])
def test_check_batch_size_arguments(adam_mlp, args, pattern):
    mesh = adam_mlp[2]
    with pytest.raises(ValueError, match=pattern):
        jp.grads.check_batch_size(args[0], mesh, jp.sharding.DEFAULT_RULES, args[1], args[2])
