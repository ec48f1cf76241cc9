"""The training loop (``jp.loop``): when hooks fire, which state they see, the in-flight bound, preemption.

The state a hook sees is compared with an independent replay: the same model and batches stepped by a plain
Python loop over a separately built, non-donating train step.
"""

from __future__ import annotations

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from helpers import mlp_batch, mlp_parts

BATCH = 16


@pytest.fixture(scope="module")
def job(mesh_factory):
    """A small MLP on data=2 x fsdp=2 x tensor=2: (init state fn, donating step, batch_fn, replay(n) -> states)."""
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    init_fn, loss_fn = mlp_parts()
    tx = optax.adam(1e-2)
    init = lambda: jp.train.init_state(init_fn, tx, jax.random.key(3), mesh=mesh)
    batches = {}

    def batch_fn(t):  # fresh random data, the same batch for the same step
        if t not in batches:
            batches[t] = mlp_batch(np.random.default_rng([7, t]), BATCH)
        return batches[t]

    plain = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False)

    def replay(n):
        """[(host params, host metrics)] after steps 1..n of a plain loop."""
        state, out = init(), []
        for t in range(n):
            state, m = plain(state, batch_fn(t))
            out.append((jax.device_get(state.params), {k: float(v) for k, v in jax.device_get(m).items()}))
        return out
    return dict(init=init, step=jp.train.make_train_step(loss_fn, tx, mesh=mesh), batch_fn=batch_fn,
                replay=replay, abstract=lambda: jp.train.abstract_state(init_fn, tx, mesh=mesh))


def assert_params_equal(got, want, what):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(got))[0], jax.tree.leaves(want)):
        assert np.array_equal(g, w), f"{what}: {jax.tree_util.keystr(path)} differs"


# ------------------------------------------------------------------------------------------ scheduling

class FakeStep:
    """A step on host values: counts dispatches; the loop cannot tell it from a jitted step."""

    def __init__(self):
        self.dispatched = 0

    def __call__(self, state, batch):
        self.dispatched += 1
        return state + 1, {"loss": np.float32(batch)}


def test_hooks_fire_every_n_and_at_end():
    calls = []
    record = lambda name: (lambda step, state, m: calls.append((name, step, state, m["loss"])))
    hooks = [jp.loop.Hook(record("state4"), every=4, at_end=True),
             jp.loop.Hook(record("metrics3"), every=3, needs_state=False),
             jp.loop.Hook(record("end"), at_end=True),
             jp.loop.Hook(record("never"))]
    result = jp.loop.run(FakeStep(), 3, lambda t: 10 * t, 3, 11, hooks=hooks)
    assert result == jp.loop.LoopResult(11, 11, False)
    fired = lambda name: [(s, st, loss) for n, s, st, loss in calls if n == name]
    # step s = updates applied: call t (batch 10 t) leads to step t + 1; the fake state counts steps too
    assert fired("state4") == [(4, 4, 30.0), (8, 8, 70.0), (11, 11, 100.0)]
    assert fired("metrics3") == [(6, None, 50.0), (9, None, 80.0)]
    assert fired("end") == [(11, 11, 100.0)] and fired("never") == []
    calls.clear()
    assert jp.loop.run(FakeStep(), 5, lambda t: t, 5, 5, hooks=hooks) == jp.loop.LoopResult(5, 5, False)
    assert calls == []  # nothing to run: no hook fires


@pytest.mark.parametrize("max_in_flight", [1, 2, 3])
def test_at_most_max_in_flight_steps_outstanding(max_in_flight):
    step, delivered, outstanding = FakeStep(), [], []

    def deliver(s, _, m):
        delivered.append(s)

    def batch_fn(t):
        outstanding.append(step.dispatched - len(delivered))  # before dispatching call t
        return t
    sync = jp.loop.Hook(lambda s, state, m: outstanding.append(-1), every=5)  # a state hook: waits for all
    jp.loop.run(step, 0, batch_fn, 0, 12, hooks=[jp.loop.Hook(deliver, every=1, needs_state=False), sync],
                max_in_flight=max_in_flight)
    assert delivered == list(range(1, 13))  # every step's metrics, in order
    before = [n for n in outstanding if n >= 0]
    assert max(before) == max_in_flight - 1  # so at most max_in_flight after the dispatch, and no fewer
    assert outstanding[6] == 0  # right after the state hook at step 5 (call 5's dispatch): nothing pending


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="every=-1"):
        jp.loop.Hook(lambda s, st, m: None, every=-1)
    with pytest.raises(TypeError, match="callable"):
        jp.loop.Hook("save")
    with pytest.raises(TypeError, match="jp.loop.Hook"):
        jp.loop.run(FakeStep(), 0, lambda t: t, 0, 2, hooks=[lambda s, st, m: None])
    with pytest.raises(ValueError, match="stop=2 is before start=3"):
        jp.loop.run(FakeStep(), 0, lambda t: t, 3, 2)
    with pytest.raises(ValueError, match="max_in_flight=0"):
        jp.loop.run(FakeStep(), 0, lambda t: t, 0, 2, max_in_flight=0)
    with pytest.raises(TypeError, match="CheckpointManager"):
        jp.loop.checkpoint("runs/ckpt")


# ------------------------------------------------------------------------------- the state hooks see

def test_state_hooks_see_the_state_of_their_step(job):
    """Donating step, 2 steps in flight: the state an evaluation hook gets at step s (and the metrics with it)
    are those of a plain loop after s steps; the metrics hooks got every step's metrics before."""
    seen, logged = [], []
    keep = lambda step, state, m: seen.append((step, int(state.step), jax.device_get(state.params), dict(m),
                                               list(logged)))
    hooks = [jp.loop.Hook(lambda s, _, m: logged.append((s, m["loss"])), every=1, needs_state=False),
             jp.loop.Hook(keep, every=3, at_end=True)]
    result = jp.loop.run(job["step"], job["init"](), job["batch_fn"], 0, 7, hooks=hooks)
    ref = job["replay"](7)
    assert [s for s, *_ in seen] == [3, 6, 7]
    for step, state_step, params, metrics, logged_before in seen:
        assert state_step == step
        assert_params_equal(params, ref[step - 1][0], f"params the hook saw at step {step}")
        assert metrics == ref[step - 1][1]
        assert logged_before == [(s, ref[s - 1][1]["loss"]) for s in range(1, step + 1)]
    assert_params_equal(result.state.params, ref[-1][0], "the returned state")


def test_run_steps_yields_the_state_of_each_step(job):
    ref = job["replay"](4)
    got = [(t, m, int(state.step), jax.device_get(state.params))
           for t, m, state in jp.loop.run_steps(job["step"], job["init"](), job["batch_fn"], 0, 4)]
    assert [(t, s) for t, _, s, _ in got] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for t, metrics, _, params in got:
        assert metrics == ref[t][1]
        assert_params_equal(params, ref[t][0], f"params yielded with step {t}")


def test_evaluate_and_checkpoint_hooks(job, tmp_path):
    """Checkpoints every 2 steps and at the end hold the replayed states; each is saved after the metrics of
    every step up to it were delivered; evaluate reports the mean of eval_step over its batches."""
    ckpt = jp.checkpoint.CheckpointManager(tmp_path, max_to_keep=None, save_interval_steps=2)
    logged, saved, reports = [], [], []
    save = ckpt.save
    ckpt.save = lambda step, *a, **k: (saved.append((step, len(logged))), save(step, *a, **k))[1]
    eval_step = lambda state, batch: {"loss": state.step.astype(np.float32) + batch, "w": np.float32(2.0)}
    hooks = [jp.loop.Hook(lambda s, _, m: logged.append(s), every=1, needs_state=False),
             jp.loop.evaluate(eval_step, lambda s: [1.0, 2.0, 6.0][: 1 + s % 3],
                              lambda s, state, r: reports.append((s, r)), every=2),
             jp.loop.checkpoint(ckpt, lambda s: {"data_step": s})]
    jp.loop.run(job["step"], job["init"](), job["batch_fn"], 0, 5, hooks=hooks)
    assert ckpt.all_steps() == [2, 4, 5]  # finalized: the hook's finish waited for the last save
    assert saved == [(2, 2), (4, 4), (5, 5)]
    assert reports == [(2, {"loss": 5.0, "w": 2.0}), (4, {"loss": 5.5, "w": 2.0}), (5, {"loss": 8.0, "w": 2.0})]
    ref = job["replay"](5)
    for step in (2, 4, 5):
        state = ckpt.restore(step, target=job["abstract"]())
        assert int(state.step) == step and ckpt.restore_extras(step) == {"data_step": step}
        assert_params_equal(state.params, ref[step - 1][0], f"checkpoint {step}")


def _masked_token_loss(params, batch, rng):
    """Per-token softmax cross-entropy of ``x @ w`` over the ``mask``ed targets: (masked mean, {accuracy, weight})."""
    logits = batch["x"] @ params["w"]
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1)[..., 0]
    mask = batch["mask"].astype(jnp.float32)
    weight = mask.sum()
    mean = lambda v: jnp.where(weight > 0, (v * mask).sum() / jnp.maximum(weight, 1.0), 0.0)
    return mean(ce), {"accuracy": mean((logits.argmax(-1) == batch["y"]).astype(jnp.float32)), "weight": weight}


def test_mean_metrics_weights_batches_by_their_token_count(mesh_factory):
    """With ``weight`` (a token count) from the eval step, the reported loss and accuracy are those of every
    unmasked token of the batches (numpy on all of them at once), not the mean of per-batch means; a batch with
    no token counts for nothing; metrics that cannot be averaged are refused."""
    rng = np.random.default_rng()
    w = rng.normal(size=(6, 5)).astype(np.float32)
    state = jp.train.init_state(lambda r: {"w": jnp.asarray(w)}, optax.sgd(0.1), 0, mesh=mesh_factory())
    batches = []
    for kept in (0.05, 0.5, 1.0, 0.0, 0.3):   # fractions of targets kept: unequal token counts, one empty batch
        x = rng.normal(size=(4, 16, 6)).astype(np.float32)
        batches.append({"x": x, "y": rng.integers(0, 5, (4, 16), dtype=np.int32),
                        "mask": (rng.random((4, 16)) < kept).astype(np.int32)})
    batches[0]["mask"][0, 0] = 1   # at least one token
    got = jp.loop.mean_metrics(jp.train.make_eval_step(_masked_token_loss, mesh=mesh_factory()), state, batches)

    x, y, m = (np.concatenate([b[k].reshape(-1, *b[k].shape[2:]) for b in batches]) for k in ("x", "y", "mask"))
    logits = x.astype(np.float64) @ w.astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ce, keep = -np.take_along_axis(logp, y[:, None], -1)[:, 0], m > 0
    want = {"loss": ce[keep].mean(), "accuracy": (logits.argmax(-1) == y)[keep].mean(), "weight": keep.sum()}
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    per_batch = [c[k].mean() if k.any() else 0.0 for c, k in zip(ce.reshape(5, -1), keep.reshape(5, -1))]
    assert abs(np.mean(per_batch) - want["loss"]) > 1e-3, per_batch   # the inputs tell the two apart

    fixed = lambda rows: (lambda state, b: rows[b])
    with pytest.raises(ValueError, match="weight 0 in all"):
        jp.loop.mean_metrics(fixed([{"loss": 1.0, "weight": 0.0}] * 2), None, [0, 1])
    with pytest.raises(ValueError, match="batch 1 has weight -2"):
        jp.loop.mean_metrics(fixed([{"loss": 1.0, "weight": 3.0}, {"loss": 1.0, "weight": -2.0}]), None, [0, 1])
    with pytest.raises(ValueError, match="batch 1 returned metrics"):
        jp.loop.mean_metrics(fixed([{"loss": 1.0, "weight": 3.0}, {"loss": 1.0}]), None, [0, 1])


def test_preemption_stops_at_the_next_step_with_a_forced_save(job, tmp_path):
    """SIGTERM while batch 2 is built: call 2 still runs, then the loop stops at step 3: every metric
    delivered, checkpoint 3 saved although the interval is 0 and finalized, evaluation skipped there."""
    ckpt = jp.checkpoint.CheckpointManager(tmp_path, save_interval_steps=0)
    logged, evaluated = [], []

    def batch_fn(t):
        if t == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # handled before the next bytecode: the flag is set now
        return job["batch_fn"](t)
    hooks = [jp.loop.Hook(lambda s, _, m: logged.append(s), every=1, needs_state=False),
             jp.loop.Hook(lambda s, state, m: evaluated.append(s), every=1),
             jp.loop.checkpoint(ckpt)]
    with jp.loop.PreemptionHandler() as preemption:
        result = jp.loop.run(job["step"], job["init"](), batch_fn, 0, 8, hooks=hooks, preemption=preemption)
    assert result.preempted and result.step == 3 and preemption.stopped_at == 3
    assert logged == [1, 2, 3] and evaluated == [1, 2]
    assert ckpt.all_steps() == [3] and ckpt.restore_extras() == {"step": 3}
    ref = job["replay"](3)
    assert_params_equal(result.state.params, ref[2][0], "the state reached")
    assert_params_equal(ckpt.restore(target=job["abstract"]()).params, ref[2][0], "the preemption checkpoint")


class CountingData:
    """A user's data iterator (not jaxpar's): batch t is ``job["batch_fn"](t)``; its state is the next index."""

    def __init__(self, batch_fn, ahead: int = 0):
        self.batch_fn, self.next, self.ahead = batch_fn, 0, ahead

    def __call__(self, t):
        assert t == self.next - self.ahead, (t, self.next)
        self.next += 1
        return self.batch_fn(t)

    def get_state(self):
        return {"step": self.next, "kind": "counting"}

    def set_state(self, state):
        self.next = state["step"]


def test_checkpoint_saves_and_restores_the_data_state(job, tmp_path):
    """checkpoint(manager, data=) stores the iterator's state of the checkpoint's step (batches 0..step-1
    taken) in the same checkpoint; restore_data hands it back; an iterator ahead of the loop is refused."""
    ckpt = jp.checkpoint.CheckpointManager(tmp_path / "a", max_to_keep=None, save_interval_steps=2)
    data = CountingData(job["batch_fn"])
    jp.loop.run(job["step"], job["init"](), data, 0, 5, hooks=[jp.loop.checkpoint(ckpt, data=data)])
    for step in (2, 4, 5):
        assert ckpt.restore_extras(step) == {"step": step, "data": {"step": step, "kind": "counting"}}
    fresh = CountingData(job["batch_fn"])
    jp.loop.restore_data(ckpt, fresh, 4)
    assert fresh.next == 4
    ahead = CountingData(job["batch_fn"])
    ahead.next = ahead.ahead = 1          # one batch taken before the loop: its state is never the step's
    other = jp.checkpoint.CheckpointManager(tmp_path / "b", save_interval_steps=1)
    with pytest.raises(ValueError, match="data iterator is at batch 2 when checkpoint 1 is saved"):
        jp.loop.run(job["step"], job["init"](), ahead, 0, 2, hooks=[jp.loop.checkpoint(other, data=ahead)])
    with pytest.raises(ValueError, match="returned a 'data' entry"):
        jp.loop.run(job["step"], job["init"](), CountingData(job["batch_fn"]), 0, 1,
                    hooks=[jp.loop.checkpoint(other, lambda s: {"data": 1}, data=data)])
