"""Bounded asynchronous dispatch on CPU meshes, so that no user loop can abort XLA:CPU's collectives.

JAX dispatches asynchronously: ``step(state, batch)`` returns at once and a loop that never reads a result
queues many steps. On a mesh of several CPU devices (simulated with
``--xla_force_host_platform_device_count``, or gloo across processes) every collective is a rendezvous of
one thread per device, and XLA:CPU terminates the whole process (SIGABRT, "Termination timeout ... only 2
of them arrived on time") when a thread is more than its termination timeout (40 s in jaxlib 0.10) late.
When the CPU is shared with other work, threads of queued steps starve those of the running one and the
timeout is met (measured: the README example, unbounded, aborted in 3 of 6 runs beside 4 busy loops on 2
cores).

So every jitted computation jaxpar dispatches on a multi-device CPU mesh goes through :func:`bounded`: it
waits until fewer than :data:`MAX_IN_FLIGHT` earlier ones are unfinished before dispatching the next.
With ``MAX_IN_FLIGHT = 2`` step ``t+1`` is still dispatched while step ``t`` runs (the host prepares batches
and Python overhead overlaps), but nothing queues further. The bound is shared by all jaxpar steps in the
process (train, eval, pipeline), whoever writes the loop. On GPU and TPU, and on one CPU device, dispatch
is left unbounded.

Bounding what is queued removes the cause within one process, but not all starvation: a machine loaded by other
processes (a 1-minute load of 15 on 2 cores, memory reclaim stalling threads) kept two of an all-gather's four
device threads from arriving in time in one of a fresh user's runs (``charlm --model moe --expert-parallel
4``, step 3; the same command passed at a load of 9). XLA:CPU aborts when the last thread is more than 60 s late:
its 20 s "may be stuck" warning, then ``--xla_cpu_collective_call_terminate_timeout_seconds`` (40 s; measured:
at 2 s a thread 30 s late aborts; jaxlib 0.10.2 and later know the flag, and jaxpar needs 0.10.2). ``import jaxpar`` raises it to :data:`RENDEZVOUS_TERMINATE_S` (:func:`lengthen_cpu_rendezvous_timeout`)
when the backends have not started and the user set no value: a late thread is then waited for, and a real
deadlock still ends the process, after 15 minutes instead of one. XLA's "may be stuck" log after 20 s stays.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from jaxpar import _compat

MAX_IN_FLIGHT = 2
RENDEZVOUS_TERMINATE_S = 900
_TERMINATE_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"


def lengthen_cpu_rendezvous_timeout() -> bool:
    """Adds ``--xla_cpu_collective_call_terminate_timeout_seconds=900`` to ``XLA_FLAGS`` (module docstring) unless
    JAX's backends have started (the flags were read) or ``XLA_FLAGS`` already sets it (the user's value wins).
    Returns whether it added the flag. XLA:GPU and TPU do not read it."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _TERMINATE_FLAG in flags or _compat.backends_initialized():
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {_TERMINATE_FLAG}={RENDEZVOUS_TERMINATE_S}".strip()
    return True


_pending: collections.deque[list[jax.Array]] = collections.deque()
_lock = threading.Lock()


# at import (``import jaxpar`` imports this module through the train step), before anything starts jax's backends
lengthen_cpu_rendezvous_timeout()


def needs_bound(mesh: Mesh) -> bool:
    """Whether computations on ``mesh`` rendezvous over CPU threads (several CPU devices)."""
    return mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"


def _wait_until_below(limit: int) -> None:
    while True:
        with _lock:
            while _pending and all(x.is_deleted() or x.is_ready() for x in _pending[0]):
                _pending.popleft()
            if len(_pending) < limit:
                return
            oldest = _pending.popleft()
        jax.block_until_ready([x for x in oldest if not x.is_deleted()])


def bounded(mesh: Mesh, call: Callable[[], Any], track: Callable[[Any], Any] = lambda out: out) -> Any:
    """Runs ``call()`` (a jitted dispatch on ``mesh``) with at most :data:`MAX_IN_FLIGHT` unfinished.

    Args:
      mesh: the mesh the computation runs on; only multi-device CPU meshes are bounded.
      call: dispatches the computation and returns its outputs.
      track: picks the outputs whose readiness marks the computation finished (outputs that a later call
        will not donate, e.g. a train step's metrics).

    Returns:
      ``call()``'s outputs, unchanged (still asynchronous).
    """
    if not needs_bound(mesh):
        return call()
    _wait_until_below(MAX_IN_FLIGHT)
    out = call()
    leaves = [x for x in jax.tree.leaves(track(out)) if isinstance(x, jax.Array)]
    if leaves:
        with _lock:
            _pending.append(leaves)
    return out


def wait_all() -> None:
    """Blocks until every computation dispatched through :func:`bounded` has finished."""
    _wait_until_below(1)
