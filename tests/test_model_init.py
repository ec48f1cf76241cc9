"""What an init gives the state: a Linen model with ``nn.BatchNorm`` (``batch_stats`` beside ``params``), written
as Flax's ImageNet example writes it, trained with its statistics in ``TrainState.model_state``.

The reference is plain Linen on one device (``model.apply(..., mutable=["batch_stats"])`` and an optax update in
``jax.jit``, no jaxpar) from the same init key.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from tests.helpers import assert_scalar_close, assert_tree_close

SGD = optax.sgd(0.02, momentum=0.9)   # 0.05 makes this net chaotic by step 20: f32 rounding grows to 2%


class BNMLP(nn.Module):
    """Dense -> BatchNorm -> relu, twice, then a classifier; no partitioning names."""
    hidden: int = 512
    momentum: float = 0.9

    @nn.compact
    def __call__(self, x, train: bool):
        for _ in range(2):
            x = nn.Dense(self.hidden, use_bias=False)(x)   # BatchNorm removes a bias: its gradient is zero
            x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=self.momentum)(x))
        return nn.Dense(10)(x)


def init_fn(key, model=BNMLP()):
    return model.init(key, jnp.zeros((1, 64)), train=False)


def loss_fn(params, batch, rng, model_state, model=BNMLP()):
    logits, updates = model.apply({**params, **model_state}, batch["x"], train=True, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}, updates


def eval_loss(params, batch, rng, model_state, model=BNMLP()):
    logits = model.apply({**params, **model_state}, batch["x"], train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def reference(tx, batches):
    variables = jax.device_put(init_fn(jax.random.split(jax.random.key(0))[0]), jax.devices()[0])
    params, stats = {"params": variables["params"]}, {"batch_stats": variables["batch_stats"]}
    opt_state = tx.init(params)

    @jax.jit
    def step(params, stats, opt_state, batch):
        (loss, (_, stats)), grads = jax.value_and_grad(
            lambda p: (lambda o: (o[0], o[1:]))(loss_fn(p, batch, None, stats)), has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss
    losses = []
    for batch in batches:
        params, stats, opt_state, loss = step(params, stats, opt_state, batch)
        losses.append(loss)
    return losses, params, stats


def batches(n, batch_size=64, seed=8):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(1.0, 2.0, size=(batch_size, 64)).astype(np.float32),
             "y": rng.integers(0, 10, batch_size).astype(np.int32)} for _ in range(n)]


def train(mesh, data, state=None, grad_accum_steps=1):
    state = state or jp.train.init_state(init_fn, SGD, 0, mesh=mesh, report=False)
    step = jp.train.make_train_step(loss_fn, SGD, mesh=mesh, grad_accum_steps=grad_accum_steps)
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return state, losses


def test_linen_batch_stats_live_in_the_model_state_and_match_one_device_on_data8(mesh_factory):
    data = batches(20)
    state, losses = train(mesh_factory(data=8), data)
    ref_losses, ref_params, ref_stats = reference(SGD, data)
    assert set(state.params) == {"params"} and set(state.model_state) == {"batch_stats"}
    for k, (got, want) in enumerate(zip(losses, ref_losses)):
        assert_scalar_close(got, want, what=f"loss at step {k}")
    worst = assert_tree_close(state.params, ref_params, what="params")
    assert_tree_close(state.model_state, ref_stats, what="batch statistics")
    mean = state.model_state["batch_stats"]["BatchNorm_0"]["mean"]
    print(f"Linen BatchNorm, 20 steps on data=8: worst param error {worst:.2e}; running mean moved from 0 to "
          f"max|.| {float(jnp.max(jnp.abs(mean))):.3f}")
    assert float(jnp.max(jnp.abs(mean))) > 0.1


def test_linen_eval_reads_the_running_statistics_on_digits(mesh_factory):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    mesh = mesh_factory(data=8)
    tx = optax.adam(3e-3)
    model = BNMLP(hidden=128)
    state = jp.train.init_state(lambda k: init_fn(k, model), tx, 0, mesh=mesh, report=False)
    step = jp.train.make_train_step(lambda *a: loss_fn(*a, model=model), tx, mesh=mesh)
    for k in range(120):
        rows = order[(k * 128) % 1536:(k * 128) % 1536 + 128]
        state, _ = step(state, {"x": x[rows], "y": y[rows]})
    test = {"x": x[order[1536:1792]], "y": y[order[1536:1792]]}
    eval_acc = float(jp.train.make_eval_step(lambda *a: eval_loss(*a, model=model), mesh=mesh)(state, test)["accuracy"])
    train_acc = float(jp.train.make_eval_step(lambda *a: loss_fn(*a, model=model), mesh=mesh)(state, test)["accuracy"])
    print(f"digits, held-out accuracy: running statistics {eval_acc:.3f}, batch statistics (train mode) {train_acc:.3f}")
    assert eval_acc >= train_acc and eval_acc > 0.9


def test_linen_model_state_restores_on_fsdp4_and_continues(mesh_factory, tmp_path):
    data = batches(8, seed=9)
    whole, _ = train(mesh_factory(data=8), data)
    half, _ = train(mesh_factory(data=8), data[:4])
    with jp.checkpoint.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(4, half, force=True)
        ckpt.wait()
        restored = ckpt.restore(4, target=jp.train.abstract_state(init_fn, SGD, mesh=mesh_factory(data=2, fsdp=4)))
    assert restored.params["params"]["Dense_1"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    resumed, _ = train(mesh_factory(data=2, fsdp=4), data[4:], state=restored)
    assert_tree_close(resumed.params, whole.params, what="params")
    assert_tree_close(resumed.model_state, whole.model_state, what="batch statistics")


def test_accumulation_passes_the_statistics_through_the_microbatches(mesh_factory):
    """With grad_accum_steps=2 the statistics update once per microbatch, in order: the reference runs the two
    strided halves of the batch one after the other."""
    data = batches(1, batch_size=64, seed=10)
    state, _ = train(mesh_factory(data=4), data, grad_accum_steps=2)
    variables = init_fn(jax.random.split(jax.random.key(0))[0])
    stats = {"batch_stats": variables["batch_stats"]}
    for j in range(2):
        half = jax.tree.map(lambda a: a[j::2], data[0])
        stats = loss_fn({"params": variables["params"]}, half, None, stats)[2]
    assert_tree_close(state.model_state, stats, what="batch statistics after accumulation")


def test_a_stateful_loss_with_the_wrong_form_is_named(mesh_factory):
    mesh = mesh_factory(data=2)
    state = jp.train.init_state(init_fn, SGD, 0, mesh=mesh, report=False)
    three = jp.train.make_train_step(lambda p, b, r: (jnp.zeros(()), {}), SGD, mesh=mesh)
    with pytest.raises(TypeError, match=r"has a model state loss_fn\(params, batch, rng, model_state\) -> \(loss, "
                                        r"aux, new_model_state\)"):
        three(state, batches(1)[0])
    two = jp.train.make_train_step(lambda p, b, r, s: eval_loss(p, b, r, s), SGD, mesh=mesh)
    with pytest.raises(ValueError, match=r"must return \(loss, aux, new_model_state\)"):
        two(state, batches(1)[0])
