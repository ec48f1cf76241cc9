"""jaxpar/train/carried.py: a carried feature defined here, in a test file, with no code in jaxpar/ naming it, is
carried by the step through gradient accumulation, a 1F1B pipeline and a checkpoint restored onto another mesh.

The feature: statistics of the target ids the model has trained on, in four declared collections, one per rule a
step must combine differently over microbatches and batch shards: a running count of non-zero targets (``sum``:
each microbatch gives its increment), the largest id seen (``max``), an exponential moving average of the
mean id (``mean``), and a balance of the ids (``sum`` with an ``update``: the step's global count of each id,
and a bias stepped by ``rate * sign(mean count - count)`` as DeepSeek-V3's router bias). The reference is numpy
over the whole batch of each step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_scalar_close, assert_tree_close, gpt_batch

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig

carried = jp.train.carried
SEEN = carried.declare_carried("test_tokens_seen", "sum", what="a count of non-zero targets",
                               attribute="tokens_seen", fix="build the state with the counting model").key
LARGEST = carried.declare_carried("test_largest_id", "max", what="the largest target id seen").key
EMA = carried.declare_carried("test_mean_id_ema", "mean", what="an EMA of the mean target id").key
DECAY = 0.9
RATE = 0.25


def balance_update(old: dict, total: dict) -> dict:
    """The next balance from the old one and the step's summed counts (``total``): the counts replace the load,
    the bias steps towards the ids counted less than the mean; the rate is kept (its increment is 0)."""
    load = total["load"]
    step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return {"load": load, "bias": old["bias"] + old["rate"] * step, "rate": old["rate"]}


BALANCE = carried.declare_carried("test_id_balance", "sum", what="a per-id count and bias",
                                  update=balance_update).key


def init_stats() -> dict:
    """The feature's state, kept in the params under the declared keys (at any depth: here under ``stats``)."""
    zero, zeros = jnp.zeros((), jnp.float32), jnp.zeros((C,), jnp.float32)
    balance = {"load": zeros, "bias": zeros, "rate": jnp.full((), RATE, jnp.float32)}
    return {"stats": {SEEN: {"n": zero}, LARGEST: {"id": zero}, EMA: {"id": zero}, BALANCE: balance}}


def with_stats(loss: jax.Array, params: dict, targets: jax.Array) -> jax.Array:
    """``loss`` unchanged; the new values of the statistics, from the targets this call sees, as their cotangents."""
    old, t = params["stats"], targets.astype(jnp.float32)
    new = {SEEN: {"n": jnp.sum(targets != 0).astype(jnp.float32)},           # sum: the increment
           LARGEST: {"id": jnp.maximum(old[LARGEST]["id"], jnp.max(t))},
           EMA: {"id": DECAY * old[EMA]["id"] + (1 - DECAY) * jnp.mean(t)}}
    counts = jnp.sum(jax.nn.one_hot(targets.reshape(-1) % C, C, dtype=jnp.float32), axis=0)
    new[BALANCE] = {"load": counts, "bias": counts, "rate": jnp.zeros((), jnp.float32)}   # increments, summed
    return carried.overwrite(loss, old, new)


def reference_stats(batches: list) -> dict:
    """numpy: the statistics after one step per batch."""
    seen, largest, ema, bias, load = 0.0, 0.0, 0.0, np.zeros(C), np.zeros(C)
    for b in batches:
        t = np.asarray(b["targets"], np.float64)
        seen, largest, ema = seen + np.sum(t != 0), max(largest, t.max()), DECAY * ema + (1 - DECAY) * t.mean()
        load = np.bincount(np.asarray(b["targets"]).reshape(-1) % C, minlength=C).astype(np.float64)
        bias = bias + RATE * np.sign(load.mean() - load)
    return {SEEN: {"n": seen}, LARGEST: {"id": largest}, EMA: {"id": ema},
            BALANCE: {"load": load, "bias": bias, "rate": RATE}}


def check_stats(state, batches, what):
    got = jax.device_get(state.carried["stats"])
    want = reference_stats(batches)
    for key in (SEEN, LARGEST):   # integers below 2**24: float32 holds them exactly
        name = next(iter(want[key]))
        assert float(got[key][name]) == want[key][name], (what, key, got[key], want[key])
    assert_scalar_close(got[EMA]["id"], want[EMA]["id"], rtol=1e-6, what=f"{what}: EMA of the mean id")
    for name in ("load", "bias", "rate"):   # counts and multiples of RATE = 1/4: exact in float32
        np.testing.assert_array_equal(got[BALANCE][name], want[BALANCE][name], err_msg=f"{what}: balance {name}")


# ------------------------------------------------------------------------------ a small model, accumulation

D, C = 8, 11


def linear_init(key):
    return {"w": jax.random.normal(key, (D, C), jnp.float32) / np.sqrt(D), **init_stats()}


def linear_loss(params, batch, rng):
    logits = batch["x"] @ params["w"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return with_stats(loss, params, batch["targets"]), {}


def plain_loss(params, batch, rng):   # the same model without the feature
    return linear_loss({**params, **init_stats()}, batch, rng)


def linear_batches(seed, n, rows=16):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(rows, D)).astype(np.float32), "targets": rng.integers(0, C, rows, dtype=np.int32)}
            for _ in range(n)]


def train(init_fn, loss_fn, tx, mesh, batches, state=None, **kwargs):
    state = state or jp.train.init_state(init_fn, tx, 0, mesh=mesh, report=False)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False, **kwargs)
    for b in batches:
        state, metrics = step(state, b)
    return state, metrics


def test_carried_feature_under_accumulation_equals_numpy_and_leaves_the_update_alone():
    mesh = jp.make_mesh(data=2, devices=jax.devices()[:2])
    batches, tx = linear_batches(0, 2), optax.sgd(0.1)
    state, metrics = train(linear_init, linear_loss, tx, mesh, batches, grad_accum_steps=4)
    check_stats(state, batches, "accumulation over 4 microbatches")
    assert set(state.params) == {"w"}                              # out of the params, never seen by the optimizer
    assert float(state.tokens_seen["stats"][SEEN]["n"]) == reference_stats(batches)[SEEN]["n"]   # its attribute
    plain, plain_metrics = train(lambda k: {"w": linear_init(k)["w"]}, plain_loss, tx, mesh, batches,
                                 grad_accum_steps=4)
    assert_tree_close(state.params, plain.params, rtol=0.0, what="params beside the carried feature")
    assert float(metrics["loss"]) == float(plain_metrics["loss"])


@pytest.mark.slow   # ~10 s: two meshes and an orbax save and restore
def test_carried_feature_restored_onto_another_mesh_continues(tmp_path):
    batches, tx = linear_batches(1, 3), optax.adam(1e-2)
    mesh_a, mesh_b = jp.make_mesh(data=2, devices=jax.devices()[:2]), jp.make_mesh(data=4, devices=jax.devices()[4:])
    state, _ = train(linear_init, linear_loss, tx, mesh_a, batches[:1])
    with jp.checkpoint.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state, force=True)
        ckpt.wait()
        target = jp.train.abstract_state(linear_init, tx, mesh=mesh_b)
        restored = ckpt.restore(target=target)
        assert_tree_close(restored.carried, state.carried, rtol=0.0, what="restored carried state")
        assert all(x.sharding.mesh == mesh_b for x in jax.tree.leaves(restored.carried))
        with pytest.raises(ValueError, match="holds a count of non-zero targets that the target lacks"):
            ckpt.restore(target=jp.train.abstract_state(lambda k: {"w": linear_init(k)["w"]}, tx, mesh=mesh_b))
    restored, _ = train(linear_init, linear_loss, tx, mesh_b, batches[1:], state=restored)
    check_stats(restored, batches, "restored on data=4 and trained on")


# ------------------------------------------------------------------------------------ the GPT, 1F1B pipeline

class CountingGPT:
    """The GPT with the feature: its params hold the statistics, its loss and pipeline head report them."""
    stage_key = "blocks"

    def __init__(self, cfg: GPTConfig):
        self.gpt = GPT(cfg)

    def init(self, key):
        return {**self.gpt.init(key), **init_stats()}

    def loss(self, params, batch, rng=None):
        loss, aux = self.gpt.loss(params, batch, rng)
        return with_stats(loss, params, batch["targets"]), aux

    def embed(self, params, tokens):
        return self.gpt.embed(params, tokens)

    def stage(self, blocks, x):
        return self.gpt.stage(blocks, x)

    def head_loss(self, params, x, targets):
        loss, aux = self.gpt.head_loss(params, x, targets)
        return with_stats(loss, params, targets), aux


@pytest.mark.slow   # ~40 s: the GPT through a 1F1B pipeline on data=2 x pipe=2 and on one device
def test_carried_feature_through_a_1f1b_pipeline_equals_one_device():
    cfg = GPTConfig(vocab_size=61, num_layers=2, num_heads=4, d_model=32, max_seq_len=16)
    model, tx = CountingGPT(cfg), optax.sgd(0.1)
    rng = np.random.default_rng(2)
    batches = [gpt_batch(rng, 8, cfg) for _ in range(2)]
    for b in batches:
        b["targets"][b["targets"] < 8] = 0   # zeros the counter skips
    mesh = jp.make_mesh(data=2, pipe=2, devices=jax.devices()[:4])
    pipe = jp.pipeline.Pipeline.from_model(model, jp.pipeline.one_f_one_b(2, 4))
    state, metrics = train(model.init, pipe, tx, mesh, batches)
    check_stats(state, batches, "1F1B, 4 microbatches over data=2 x pipe=2")
    one = jp.make_mesh(data=1, devices=jax.devices()[:1])
    ref, ref_metrics = train(model.init, model.loss, tx, one, batches)
    check_stats(ref, batches, "one device")
    assert_scalar_close(metrics["loss"], ref_metrics["loss"], rtol=1e-5, what="pipelined loss")
    assert_tree_close(state.params, ref.params, rtol=1e-4, what="pipelined params after two steps")


# ------------------------------------------------------------------------ declarations a step cannot carry

@pytest.fixture
def registry(monkeypatch):
    """Declarations made in a test vanish after it (the registry is process-wide)."""
    monkeypatch.setattr(jp.protocol, "_CARRIED", dict(jp.protocol._CARRIED))


def test_bad_declarations_are_refused_when_declared(registry):
    for key in (3, ""):
        with pytest.raises(TypeError, match="non-empty str"):
            carried.declare_carried(key, "sum")
    with pytest.raises(TypeError, match="Python identifier"):
        carried.declare_carried("test_bad_attr", "sum", attribute="not an identifier")
    with pytest.raises(ValueError, match="reads '_overwrite_with_gradient' already"):
        carried.declare_carried("test_second_fp8", "max", attribute="fp8")
    with pytest.raises(TypeError, match="update=3 .* use None or a function"):
        carried.declare_carried("test_bad_update", "sum", update=3)
    with pytest.raises(ValueError, match="declare it without update"):
        carried.declare_carried("test_loss_update", "last", through="loss", update=balance_update)
    assert "test_second_fp8" not in jp.protocol._CARRIED


def test_state_refuses_an_int_leaf_and_an_attribute_shadowing_a_field_before_tracing(registry):
    mesh, tx = jp.make_mesh(data=1, devices=jax.devices()[:1]), optax.sgd(0.1)
    key = carried.declare_carried("test_int_count", "sum").key
    with pytest.raises(TypeError, match=r"\['test_int_count'\]\['n'\] is int32: .* float array"):
        jp.train.abstract_state(lambda k: {"w": jnp.ones(2), key: {"n": jnp.zeros((), jnp.int32)}}, tx, mesh=mesh)
    carried.declare_carried("test_shadow", "sum", attribute="step")   # would turn replace(step=...) into carried
    with pytest.raises(ValueError, match="attribute='step', a TrainState field"):
        jp.train.abstract_state(lambda k: {"w": jnp.ones(2)}, tx, mesh=mesh)


def test_checkpoint_mismatch_without_a_declared_fix_still_says_what_to_do(registry):
    key = carried.declare_carried("test_no_fix", "sum").key
    saved = {f"['carried']['{key}']['n']", "['params']['w']"}
    for a, b, word in ((saved, {"['params']['w']"}, "hold"), ({"['params']['w']"}, saved, "lack")):
        with pytest.raises(ValueError, match=f"from an init function whose params {word} the carried key '{key}'"):
            carried.check_checkpoint(a, b, "checkpoint step 1")
