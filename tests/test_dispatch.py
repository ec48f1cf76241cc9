"""A user's own loop never queues more than two steps on a multi-device CPU mesh (no rendezvous abort).

The bound is checked on outputs whose completion the test controls, so the check does not depend on how fast
the machine runs a step: a :class:`HeldOutput` is unfinished until something waits for it
(``block_until_ready``), as a step that takes forever would be. Real steps cannot be held that way: a step
held by a host callback occupies one of XLA:CPU's executor threads (as many as the machine has cores), which
stalls every other computation, and jaxlib 0.10 makes the next dispatch wait for a computation with a host
callback, which bounds the steps whether jaxpar does or not. A second test checks that the train and eval
steps reach the bound with their metrics as the outputs it waits for.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp

POLLS = 1000  # an output asked this often without being waited for finishes, so a polling bound fails, not hangs


class HeldOutput(jax.Array):
    """An output that finishes only when waited for; it records the wait."""

    def __init__(self, waits: list, index: int):
        self.waits, self.index, self.finished, self.polls = waits, index, False, 0

    def is_ready(self) -> bool:
        self.polls += 1
        if self.polls > POLLS:
            self.finished = True
        return self.finished

    def is_deleted(self) -> bool:
        return False

    def block_until_ready(self) -> "HeldOutput":
        self.waits.append(self.index)
        self.finished = True
        return self


def test_bounded_waits_before_each_dispatch_for_the_call_two_back(mesh_factory):
    """Dispatch ``t`` happens after call ``t - 2`` has finished and while call ``t - 1`` still runs; only the
    tracked outputs (not e.g. the state the next call donates) are waited for."""
    mesh = mesh_factory(data=2)
    jp.dispatch.wait_all()   # nothing of earlier tests in flight
    waits, metrics, states, finished_at_dispatch = [], [], [], []

    def call(t):
        finished_at_dispatch.append([m.finished for m in metrics])
        return HeldOutput(waits, -1), HeldOutput(waits, t)   # (state, metrics)

    for t in range(6):
        state, m = jp.dispatch.bounded(mesh, lambda: call(t), lambda out: out[1])
        states.append(state)
        metrics.append(m)
        assert finished_at_dispatch[t] == [k < t - 1 for k in range(t)], (
            f"when call {t} was dispatched, calls finished: {finished_at_dispatch[t]}; want calls 0..{t - 2} "
            f"finished (at most {jp.dispatch.MAX_IN_FLIGHT} in flight) and call {t - 1} running")
    assert waits == [0, 1, 2, 3] and max(m.polls for m in metrics) < POLLS, (waits, [m.polls for m in metrics])
    jp.dispatch.wait_all()
    assert waits == [0, 1, 2, 3, 4, 5] and not any(s.finished for s in states)


def test_train_and_eval_steps_dispatch_through_the_bound(mesh_factory, np_rng, monkeypatch):
    """Every call of a train or eval step on a multi-device CPU mesh goes through ``jp.dispatch.bounded``, which
    waits for the call's metrics (a train step's state is donated to the next call, so it is not waited for)."""
    mesh = mesh_factory(data=8)
    tx = optax.sgd(0.1)
    state = jp.train.init_state(lambda r: {"w": jax.random.normal(r, (4, 2))}, tx, 0, mesh=mesh)
    loss = lambda params, batch, rng: (jnp.mean((batch["x"] @ params["w"]) ** 2), {})
    step, evaluate = jp.train.make_train_step(loss, tx, mesh=mesh), jp.train.make_eval_step(loss, mesh=mesh)
    batch = {"x": np_rng.normal(size=(8, 4)).astype(np.float32)}
    seen, bounded = [], jp.dispatch.bounded

    def recording(on_mesh, call, track=lambda out: out):
        out = bounded(on_mesh, call, track)
        seen.append((on_mesh, out, track(out)))
        return out
    monkeypatch.setattr(jp.dispatch, "bounded", recording)
    for _ in range(2):
        state, metrics = step(state, batch)
        assert seen[-1][0] is mesh and seen[-1][1][0] is state
        assert {id(x) for x in jax.tree.leaves(seen[-1][2])} == {id(x) for x in jax.tree.leaves(metrics)}
    out = evaluate(state, batch)
    assert len(seen) == 3 and seen[-1][0] is mesh and seen[-1][2] is out
    jp.dispatch.wait_all()
    assert np.isfinite(float(out["loss"]))


def test_only_multi_device_cpu_meshes_are_bounded(mesh_factory):
    """A single device has no rendezvous; dispatch there (and on accelerators) is left unbounded."""
    assert jp.dispatch.needs_bound(mesh_factory(data=2))
    assert not jp.dispatch.needs_bound(mesh_factory())


LATE_PARTICIPANT = """
import os, sys, time
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jaxpar  # noqa: F401  (its rendezvous limit, unless XLA_FLAGS sets one)
import jax, jax.numpy as jnp
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P
late = float(sys.argv[1])
def slow(i):   # device 1's thread reaches the all-reduce `late` seconds after device 0's
    if int(i) == 1:
        time.sleep(late)
    return i
def body(x):
    i = io_callback(slow, jax.ShapeDtypeStruct((), jnp.int32), jax.lax.axis_index("data"))
    return jax.lax.psum(x + i.astype(x.dtype), "data")
mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))
print("RESULT", f(jnp.arange(2.0)).tolist())
"""


def test_import_lengthens_xla_cpus_rendezvous_limit_unless_set(monkeypatch):
    """``import jaxpar`` adds XLA:CPU's rendezvous termination flag (900 s) while the backends have not started;
    a value the user set, or started backends, leave ``XLA_FLAGS`` alone."""
    from jaxpar import _compat
    from jaxpar.train import _dispatch
    monkeypatch.setattr(_compat, "backends_initialized", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert _dispatch.lengthen_cpu_rendezvous_timeout()
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2",
                                               "--xla_cpu_collective_call_terminate_timeout_seconds=900"]
    assert not _dispatch.lengthen_cpu_rendezvous_timeout()                       # once
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_call_terminate_timeout_seconds=5")
    assert not _dispatch.lengthen_cpu_rendezvous_timeout()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_collective_call_terminate_timeout_seconds=5"
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(_compat, "backends_initialized", lambda: True)
    assert not _dispatch.lengthen_cpu_rendezvous_timeout() and "XLA_FLAGS" not in os.environ


@pytest.mark.slow   # a device thread 65 s late (sleeping: no CPU)
def test_a_participant_late_past_xlas_default_limit_is_waited_for():
    """XLA:CPU aborts a collective whose last thread arrives over 60 s after the first (20 s before its warning plus
    the 40 s termination limit; measured: 30 s late with the limit at 2 s aborts). After ``import jaxpar`` a thread
    65 s late is waited for, as a starved thread on a loaded machine must be, and the result is right."""
    out = subprocess.run([sys.executable, "-c", LATE_PARTICIPANT, "65"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT [2.0]" in out.stdout and "unstuck" in out.stderr
