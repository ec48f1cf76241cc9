"""The training loop: a bound on steps in flight, hooks every n steps or at the end, a clean stop on preemption.

:func:`run` runs ``state, metrics = step_fn(state, batch_fn(t))`` for ``t = start .. stop-1`` and calls
:class:`Hook`\\ s, in the spirit of ``clu.periodic_actions``: an entry point is build -> ``run`` -> report,
with checkpoints (:func:`checkpoint`), evaluations (:func:`evaluate`), metric logs and progress bars
(``jaxpar.cli.experiment``) as hooks instead of an outer loop. :func:`run_steps` is the one-line generator for simple
loops.

Steps are counted as updates applied: call ``t`` (batch ``t``) returns the state of step ``t + 1``, which is
what ``state.step`` holds, what checkpoint ``t + 1`` stores and what a hook is called with.

Why hooks are of two kinds. The train step donates its input state (its buffers are reused), so the state of
step ``s`` exists only until step ``s + 1`` is dispatched; and pulling step ``s``'s metrics to the host waits
for step ``s`` to finish. A *state hook* (``needs_state=True``: checkpoints, evaluation) therefore runs right
after step ``s`` is dispatched, before step ``s + 1`` is: the loop waits there for the metrics of every step up
to ``s`` and hands the hook exactly the state step ``s``'s call returned. A *metrics hook*
(``needs_state=False``: logs, progress bars) runs when step ``s``'s metrics reach the host, up to
``max_in_flight - 1`` steps later, so the device is never idle waiting for a log line.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.train.checkpoint import CheckpointError, CheckpointManager
from jaxpar._validate import nonnegative_int, positive_int

HookFn = Callable[[int, Any, dict[str, float]], Any]


# ------------------------------------------------------------------------------------------ preemption

class PreemptionHandler:
    """Turns the first SIGTERM (a scheduler's preemption notice) into a request to stop cleanly.

    The first signal only sets a flag; the training loop sees it through :meth:`should_stop`, finishes the
    current step, saves and exits 0 (see :func:`run`). The handler then restores the default action,
    so a second signal terminates the process at once (a partly written checkpoint stays invisible:
    orbax finalizes atomically).

    In a multi-process run :meth:`should_stop` is a collective: every process calls it at the same step
    and all get the same answer (true if any process was signalled), so all stop at the same step.

    Use as a context manager, or call :meth:`close` to restore the previous handlers.

    Args:
      signals: the signals to catch (default SIGTERM).

    Raises:
      ValueError: when created outside the main thread (Python delivers signals to the main thread only).
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,)):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("PreemptionHandler must be created in the main thread (signals are delivered there)")
        self._event = threading.Event()
        self._previous = {s: signal.signal(s, self._handle) for s in signals}
        self.stopped_at: int | None = None

    def _handle(self, signum, frame) -> None:
        del frame
        self._event.set()
        signal.signal(signum, signal.SIG_DFL)
        if jax.process_index() == 0:
            print(f"received {signal.Signals(signum).name}: finishing the current step, saving a checkpoint and "
                  "exiting (send it again to exit at once)", file=sys.stderr, flush=True)

    @property
    def requested(self) -> bool:
        """Whether this process has received a signal (no communication)."""
        return self._event.is_set()

    def should_stop(self) -> bool:
        """Whether to stop now; a collective over processes in a multi-process run (call it in lockstep)."""
        local = self._event.is_set()
        if jax.process_count() == 1:
            return local
        flags = multihost_utils.process_allgather(np.asarray([int(local)], np.int32))
        return bool(np.asarray(flags).any())

    def close(self) -> None:
        """Restores the signal handlers that were installed before."""
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> "PreemptionHandler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------- hooks

@dataclasses.dataclass(frozen=True)
class Hook:
    """``fn(step, state, metrics)``, run every ``every`` steps and/or when the loop ends.

    Attributes:
      fn: called with ``step`` (int, updates applied), ``state`` (the state step ``step``'s call returned;
        None for a metrics hook) and ``metrics`` (that step's metrics as a dict of Python floats; hooks run in
        the order given and share the dict, so a hook may add entries, e.g. throughput, for later hooks).
        Its return value is ignored.
      every: run at the steps divisible by ``every`` (0: never periodically).
      at_end: also run at ``stop`` when the loop gets there.
      on_preemption: also run at the step where a preemption stops the loop (e.g. a checkpoint). There,
        state hooks without ``on_preemption`` do not run, so the process exits quickly.
      needs_state: True: a state hook (runs before the next step is dispatched, after the metrics of every
        step up to this one were delivered; a sync point); False: a metrics hook (gets ``state=None``, runs
        when the step's metrics reach the host, without holding up the device).
      finish: called once, without arguments, when :func:`run` ends (also on preemption or an error), after
        the last hook call: e.g. wait for an asynchronous save, close a progress bar.

    Raises:
      TypeError: ``fn`` or ``finish`` not callable. ValueError: ``every`` not an int >= 0.
    """
    fn: HookFn
    every: int = 0
    at_end: bool = False
    on_preemption: bool = False
    needs_state: bool = True
    finish: Callable[[], Any] | None = None

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Hook fn={self.fn!r} must be callable as fn(step, state, metrics)")
        nonnegative_int("Hook every", self.every, " (0: only at_end / on_preemption)")
        if self.finish is not None and not callable(self.finish):
            raise TypeError(f"Hook finish={self.finish!r} must be callable without arguments, or None")

    def due(self, step: int, stop: int, preempted: bool) -> bool:
        """Whether the hook runs at ``step`` of a loop ending at ``stop`` (``preempted``: it stops at ``step``)."""
        if preempted and self.needs_state:
            return self.on_preemption
        periodic = (self.every > 0 and step % self.every == 0) or (self.at_end and step == stop)
        return periodic or (preempted and self.on_preemption)


class LoopResult(NamedTuple):
    """What :func:`run` returns: the state reached, its step, and whether a preemption stopped the loop."""
    state: Any
    step: int
    preempted: bool


def checkpoint(manager: CheckpointManager, extras_fn: Callable[[int], dict] | None = None, *,
               data: Any = None) -> Hook:
    """A state hook saving checkpoint ``step`` of the state that has applied ``step`` updates.

    Saves every ``manager.save_interval_steps`` steps, at ``stop`` and at a preemption's step (forced, so
    ``save_interval_steps=0`` saves only those), after the metrics of every step up to it were delivered
    (a log written from them never misses steps a resumed run will not repeat), before the next step can
    donate the state's buffers. When the loop ends it waits until the last save is finalized.

    Args:
      manager: a :class:`jaxpar.train.checkpoint.CheckpointManager`.
      extras_fn: ``extras_fn(step) -> dict`` saved with checkpoint ``step`` (default ``{"step": step}``).
      data: a data iterator with ``get_state() -> dict`` (JSON-able) and ``set_state(dict)``, e.g.
        ``jp.data.grain_batches(...)`` or a grain ``DatasetIterator``: its state is saved under the extras' key
        ``"data"`` in the same checkpoint as the train state, so the two are written (and finalized
        atomically) together; :func:`restore_data` restores it. At a hook call the loop has taken batches
        ``0 .. step - 1`` only, so the state is that of the next batch, ``step``. ``get_state`` runs on every
        process at the same step (grain_batches gathers the processes' shard states there).

    Raises:
      TypeError: ``manager`` is not a CheckpointManager; ``extras_fn`` not callable; ``data`` without
        ``get_state`` and ``set_state``.
      ValueError (when saving): ``extras_fn`` returned a ``"data"`` entry too; a ``data`` state whose
        ``"step"`` is not the checkpoint's (batches taken ahead of the loop, e.g. prefetched by hand).
    """
    if not isinstance(manager, CheckpointManager):
        raise TypeError(f"manager must be a jp.checkpoint.CheckpointManager, got {type(manager).__name__}")
    if extras_fn is not None and not callable(extras_fn):
        raise TypeError(f"extras_fn={extras_fn!r} must be callable as extras_fn(step) -> dict")
    if data is not None and not (callable(getattr(data, "get_state", None))
                                 and callable(getattr(data, "set_state", None))):
        raise TypeError(f"data={type(data).__name__} must have get_state() and set_state(state) (e.g. "
                        "jp.data.grain_batches(...) or a grain DatasetIterator)")
    extras_fn = extras_fn or (lambda s: {"step": s})

    def extras(step: int) -> dict:
        out = extras_fn(step)
        if data is None:
            return out
        if isinstance(out, dict) and "data" in out:
            raise ValueError("extras_fn returned a 'data' entry, the key checkpoint(..., data=) saves the data "
                             "state under; rename it")
        state = data.get_state()
        if isinstance(state, dict) and "step" in state and state["step"] != step:
            raise ValueError(f"the data iterator is at batch {state['step']} when checkpoint {step} is saved; "
                             f"its state must be that of batch {step} (take batches only through the loop's "
                             "batch_fn, so a resume continues exactly)")
        return {**out, "data": state}
    # force: the interval is this hook's `every`; at the end and on preemption the step is saved whatever it is.
    save = lambda step, state, _: manager.save(step, state, extras(step), force=True)
    return Hook(save, every=manager.save_interval_steps, at_end=True, on_preemption=True, finish=manager.wait)


def restore_data(manager: CheckpointManager, data: Any, step: int | None = None) -> None:
    """Sets ``data``'s state to the one :func:`checkpoint` (``data=``) saved with checkpoint ``step``
    (default: the latest), so the batches continue exactly where that run's did.

    Raises:
      CheckpointError (a ValueError): no such checkpoint, or one saved without a data state.
      ValueError: the state does not fit ``data`` (``data.set_state``'s errors, e.g. another pipeline).
    """
    extras = manager.restore_extras(step)
    if not isinstance(extras, dict) or "data" not in extras:
        raise CheckpointError(f"checkpoint {step if step is not None else manager.latest_step()} in "
                              f"{str(manager.directory)!r} holds no data state: it was saved without "
                              "jp.loop.checkpoint(manager, data=...); start the data from the beginning instead")
    data.set_state(extras["data"])


def mean_metrics(eval_step: Callable[[Any, Any], dict], state: Any, batches: Iterable[Any]) -> dict[str, float]:
    """The mean over ``batches`` of each metric ``eval_step(state, batch)`` returns, as Python floats.

    When the metrics hold a ``weight`` (the number of targets a batch's means are over, e.g. its token count
    or the sum of its loss mask: the built-in models' losses return it and ``jp.train.make_eval_step`` passes
    it on), each metric is weighted by it, ``sum_b weight_b * metric_b / sum_b weight_b``: the mean over every
    target of the batches, as one batch holding them all would give, not the mean of per-batch means; the
    ``weight`` reported is the sum. A batch of weight 0 (every target masked) counts for nothing, even where
    its metrics are NaN. Without a ``weight`` every batch counts equally. The sums are float64 on the host.

    Raises:
      ValueError: ``batches`` is empty; batches whose metrics differ in their keys; a ``weight`` that is
        negative or not finite; weights that sum to 0 (no target to average over).
    """
    rows = [_host(eval_step(state, b)) for b in batches]
    if not rows:
        raise ValueError("no evaluation batches: pass at least one batch")
    return _weighted_means(rows)


def _weighted_means(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """:func:`mean_metrics` of per-batch metrics already on the host (a list of dicts of floats)."""
    keys = set(rows[0])
    for i, r in enumerate(rows):
        if set(r) != keys:
            raise ValueError(f"evaluation batch {i} returned metrics {sorted(r)}, batch 0 returned {sorted(keys)}; "
                             "every batch must return the same metrics")
    if "weight" not in keys:
        return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    w = np.asarray([r["weight"] for r in rows], np.float64)
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if bad.size:
        raise ValueError(f"evaluation batch {bad[0]} has weight {w[bad[0]]}; a weight counts targets (e.g. "
                         "tokens), finite and >= 0")
    if w.sum() == 0:
        raise ValueError(f"the {len(rows)} evaluation batches have weight 0 in all (every target masked): there "
                         "is nothing to average; pass batches with at least one target")
    out = {}
    for k in rows[0]:
        v = np.asarray([r[k] for r in rows], np.float64)
        out[k] = float(w.sum()) if k == "weight" else float(np.where(w > 0, v, 0.0) @ w / w.sum())
    return out


def evaluate(eval_step: Callable[[Any, Any], dict], batches: Callable[[int], Iterable[Any]],
             report: HookFn, *, every: int, at_end: bool = True) -> Hook:
    """A state hook evaluating the state of step ``s``: ``report(s, state, mean_metrics(eval_step, state,
    batches(s)))`` every ``every`` steps and at ``stop`` (``at_end``); not at a preemption's step. The metrics
    are weighted by the batches' ``weight`` when the eval step returns one (:func:`mean_metrics`).

    Args:
      eval_step: ``eval_step(state, batch) -> metrics`` (e.g. ``jp.train.make_eval_step(...)``).
      batches: ``batches(step)`` -> the evaluation batches at that step (e.g. more at the end).
      report: receives the step, the state and the mean metrics (write them, print them, keep them).
      every, at_end: as for :class:`Hook`.

    Raises:
      TypeError: ``batches`` or ``report`` not callable. (At a call) ValueError: as :func:`mean_metrics`.
    """
    if not callable(batches) or not callable(report):
        raise TypeError("evaluate needs batches(step) -> iterable of batches and report(step, state, metrics), "
                        f"both callables; got {batches!r}, {report!r}")
    return Hook(lambda step, state, _: report(step, state, mean_metrics(eval_step, state, batches(step))),
                every=every, at_end=at_end)


# ------------------------------------------------------------------------------------------------ loop

def _host(metrics: Any) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def _check_range(start: Any, stop: Any) -> None:
    for name, value in (("start", start), ("stop", stop)):
        nonnegative_int(name, value, " (a step: updates applied)")
    if stop < start:
        raise ValueError(f"stop={stop} is before start={start}; pass start <= stop")


def run(step_fn: Callable, state: Any, batch_fn: Callable[[int], Any], start: int, stop: int, *,
        hooks: Sequence[Hook] = (), preemption: PreemptionHandler | None = None,
        max_in_flight: int = 2) -> LoopResult:
    """Runs steps ``start .. stop-1`` (``state, metrics = step_fn(state, batch_fn(t))``) with hooks.

    Step ``t + 1`` is dispatched before step ``t``'s metrics are pulled to the host, but never more than
    ``max_in_flight`` steps are outstanding (XLA:CPU's collective rendezvous aborts when many steps with
    collectives are queued). Hooks run as :class:`Hook` describes: a state hook at step ``s`` gets the state
    step ``s``'s call returned, after the metrics hooks of every step up to ``s`` ran; a metrics hook gets
    step ``s``'s metrics when they arrive, in step order.

    After every step ``preemption.should_stop()`` is asked (a collective in a multi-process run); when it is
    true at step ``s``, the remaining metrics are delivered, the state hooks with ``on_preemption`` run at
    ``s`` (a :func:`checkpoint` saves step ``s``, forced), ``preemption.stopped_at = s``, the hooks' ``finish``
    run (the save is waited for) and the loop returns early; the caller then exits with status 0.

    Args:
      step_fn: ``step_fn(state, batch) -> (state, metrics)``, e.g. from ``jp.train.make_train_step``.
      state: the state at step ``start``.
      batch_fn: ``batch_fn(t)`` -> the batch of call ``t`` (step-indexed data), called just before it.
      start, stop: the steps the state is at before and after the loop (ints, ``0 <= start <= stop``).
      hooks: :class:`Hook`\\ s, run in the order given.
      preemption: a :class:`PreemptionHandler` (None: never stop early).
      max_in_flight: the most steps dispatched whose metrics are not yet on the host (>= 1).

    Returns:
      ``LoopResult(state, step, preempted)``: the state of ``step`` (``stop``, or the step a preemption
      stopped at; ``start`` when there was nothing to run, then no hook ran).

    Raises:
      ValueError: ``start``/``stop`` not ints with ``0 <= start <= stop``; ``max_in_flight < 1``.
      TypeError: a hook that is not a :class:`Hook`.
    """
    _check_range(start, stop)
    positive_int("max_in_flight", max_in_flight)
    for h in hooks:
        if not isinstance(h, Hook):
            raise TypeError(f"hooks must be jp.loop.Hook objects, got {type(h).__name__}: wrap a function as "
                            "jp.loop.Hook(fn, every=n)")
    try:
        return _loop(step_fn, state, batch_fn, start, stop, tuple(hooks), preemption, max_in_flight)
    finally:
        for h in hooks:
            if h.finish is not None:
                h.finish()


def _loop(step_fn, state, batch_fn, start, stop, hooks, preemption, max_in_flight) -> LoopResult:
    metrics_hooks = [h for h in hooks if not h.needs_state]
    state_hooks = [h for h in hooks if h.needs_state]
    pending: deque = deque()   # (step, device metrics) of dispatched steps not yet delivered

    def deliver(keep: int, preempted_at: int | None = None) -> dict[str, float] | None:
        """Pulls all but the newest ``keep`` pending metrics to the host and runs the metrics hooks."""
        metrics = None
        while len(pending) > keep:
            step, metrics = pending.popleft()
            metrics = _host(metrics)
            for h in metrics_hooks:
                if h.due(step, stop, step == preempted_at):
                    h.fn(step, None, metrics)
        return metrics

    for t in range(start, stop):
        state, metrics = step_fn(state, batch_fn(t))
        step = t + 1
        pending.append((step, metrics))
        preempted = preemption is not None and preemption.should_stop()
        due = [h for h in state_hooks if h.due(step, stop, preempted)]
        if due or preempted:
            host = deliver(0, step if preempted else None)  # every step up to here is logged first
            for h in due:
                h.fn(step, state, host)
        if preempted:
            preemption.stopped_at = step
            return LoopResult(state, step, True)
        deliver(max_in_flight - 1)
    deliver(0)
    return LoopResult(state, stop, False)


def run_steps(step_fn: Callable, state: Any, batch_fn: Callable[[int], Any], start: int,
              stop: int) -> Iterator[tuple[int, dict[str, float], Any]]:
    """Runs steps ``start .. stop-1`` and yields ``(t, host_metrics, state)`` after each, in order.

    ``state`` is the state call ``t`` returned (``state.step == t + 1``): the consumer may evaluate or save
    it, so step ``t + 1`` is dispatched only when the next item is asked for, and ``host_metrics`` (a dict of
    Python floats) waits for step ``t`` to finish. ``batch_fn(t + 1)`` is built while step ``t`` runs. For
    loops that keep the device busy while the host logs (and for checkpoints, evaluation, preemption), use
    :func:`run` with hooks.

    Raises:
      ValueError: ``start``/``stop`` not ints with ``0 <= start <= stop`` (at the first ``next``).
    """
    _check_range(start, stop)
    batch = batch_fn(start) if start < stop else None
    for t in range(start, stop):
        state, metrics = step_fn(state, batch)
        batch = batch_fn(t + 1) if t + 1 < stop else None
        yield t, _host(metrics), state


__all__ = ["Hook", "LoopResult", "PreemptionHandler", "checkpoint", "evaluate", "mean_metrics", "restore_data", "run",
           "run_steps"]
