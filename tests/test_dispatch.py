"""A user's own loop never queues more than two steps on a multi-device CPU mesh (no rendezvous abort).

The steps below hold a host callback that blocks until a gate opens (or 1 s passes), so a step cannot finish
early however fast or slow the machine is: the check is on what must have finished when ``step`` returns,
not on timing. Unbounded asynchronous dispatch returns from every call at once with nothing finished.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxpar as jp


def _gated_loss(gate: threading.Event):
    def wait(x):
        gate.wait(1.0)
        return x

    def loss_fn(params, batch, rng):
        x = jax.pure_callback(wait, jax.ShapeDtypeStruct(batch["x"].shape, batch["x"].dtype), batch["x"])
        return jnp.mean((x @ params["w"]) ** 2), {}
    return loss_fn


def _setup(mesh_factory, np_rng):
    mesh = mesh_factory(data=8)
    tx = optax.sgd(0.1)
    state = jp.train.init_state(lambda r: {"w": jax.random.normal(r, (4, 2))}, tx, 0, mesh=mesh)
    batch = {"x": np_rng.normal(size=(8, 4)).astype(np.float32)}
    return mesh, tx, state, batch


def test_train_step_user_loop_keeps_at_most_two_in_flight(mesh_factory, np_rng):
    mesh, tx, state, batch = _setup(mesh_factory, np_rng)
    gate = threading.Event()
    step = jp.train.make_train_step(_gated_loss(gate), tx, mesh=mesh)
    gate.set()
    state, _ = step(state, batch)   # compile with the gate open
    jp.dispatch.wait_all()
    gate.clear()
    history = []
    for _ in range(5):
        state, metrics = step(state, batch)
        history.append(metrics["loss"])
        # Step t+1 may run while the caller works; step t-1 must be finished before step t+1 is dispatched.
        assert all(m.is_ready() for m in history[:-2]), [m.is_ready() for m in history]
    gate.set()
    assert np.isfinite(float(history[-1]))


def test_eval_step_user_loop_keeps_at_most_two_in_flight(mesh_factory, np_rng):
    mesh, _, state, batch = _setup(mesh_factory, np_rng)
    gate = threading.Event()
    evaluate = jp.train.make_eval_step(_gated_loss(gate), mesh=mesh)
    gate.set()
    evaluate(state, batch)
    jp.dispatch.wait_all()
    gate.clear()
    history = [evaluate(state, batch)["loss"] for _ in range(4)]
    assert all(m.is_ready() for m in history[:-2]), [m.is_ready() for m in history]
    gate.set()


def test_only_multi_device_cpu_meshes_are_bounded(mesh_factory):
    """A single device has no rendezvous; dispatch there (and on accelerators) is left unbounded."""
    assert jp.dispatch.needs_bound(mesh_factory(data=2))
    assert not jp.dispatch.needs_bound(mesh_factory())
