"""A small checkpointed training job for the checkpoint and multi-host tests: imported, or run as a script.

Script (also under ``python -m jaxpar.cli.launch -n 2``)::

    python tests/ckpt_worker.py --out DIR --steps 8 [--interval 1] [--mesh 2,2,2 [--mesh 1,8,1 ...]]
        [--precision fp16] [--pruning] [--check-resume-from K]
        [--block-after-checkpoint N | --await-sigterm-before-step K]

Trains ``tests/helpers.SMALL_GPT`` on step-indexed random tokens (``batch(step)``: each process builds only
its rows), resuming from ``DIR/ckpt`` when it holds a checkpoint, saving every ``--interval`` steps and on
SIGTERM (then exits 0). Process 0 writes ``DIR/metrics.jsonl`` (one row per step: loss, loss scale, ...);
every process writes ``DIR/rows_<process>.json`` (the batch rows it loaded). ``--check-resume-from K``
afterwards restores checkpoint K onto the same mesh, replays steps K.. and writes
``DIR/replay.json`` (the replayed losses), to check multi-process restore. Several ``--mesh`` run one job
per layout, one after the other, in ``DIR/mesh<data>x<fsdp>x<tensor>``.

Exact synchronisation points for the tests that signal the job (no sleeps, no polling): process 0 prints
a line ``SYNC <what>`` to stdout (flushed) at the point, and

* ``--block-after-checkpoint N``: right after checkpoint N is finalized on disk (``ckpt.wait()``), prints
  ``SYNC checkpoint N final`` and blocks (the test SIGKILLs it there);
* ``--await-sigterm-before-step K``: before building the batch of step K (0-based), prints
  ``SYNC awaiting SIGTERM before step K`` and blocks until the preemption handler has run for a SIGTERM
  (a chained handler writes to a pipe the job reads), then trains on: it stops after step K, saving
  checkpoint K + 1.

A blocked job exits with status 3 after ``HANG_GUARD`` seconds if nobody signals it (a hang guard only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))


@dataclasses.dataclass(frozen=True)
class Spec:
    """The job: mesh sizes, precision, loss scaling, pruning, checkpoint interval, a slow-down."""
    mesh: tuple[int, int, int] = (2, 2, 2)   # data, fsdp, tensor
    precision: str = "fp16"                   # "f32" or "fp16" (mixed_fp16 policy)
    pruning: bool = True                      # magnitude pruning chained after AdamW
    loss_scale: bool = True                   # dynamic loss scaling (outermost)
    batch_size: int = 16
    seed: int = 0
    interval: int = 1                         # checkpoint every this many steps
    optimizer: str = "adamw"                  # "adamw" (lr 3e-3) or "sgd" (lr 0.5: updates linear in the gradients)


_JOBS: dict = {}
HANG_GUARD = 600  # seconds a job blocked at a sync point waits for the test's signal before it gives up


def start_worker():
    """A worker process's start: 8 simulated CPU devices unless XLA_FLAGS says otherwise, ``jax.distributed`` from
    the launcher's environment, the tests' compilation cache. Returns the ``jax`` module."""
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    import jax

    import jaxpar as jp
    jp.initialize_distributed()
    jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))
    return jax


def sync(what: str) -> None:
    """Tells the test (reading stdout) that the job reached the point ``what`` (process 0 only). The line
    starts on a line of its own (a progress bar on stderr may have left a partial line in the pipe)."""
    import jax
    if jax.process_index() == 0:
        print(f"\nSYNC {what}", flush=True)


def sigterm_pipe() -> int:
    """Chains onto the installed SIGTERM handler (e.g. a ``PreemptionHandler``'s, which restores SIG_DFL
    for a second signal); returns a pipe fd that receives one byte per handled SIGTERM, so that
    ``os.read(fd, 1)`` returns exactly once the handler has run (a signal interrupts the read, Python runs
    the handler and retries it)."""
    handled, notify = os.pipe()
    installed = signal.getsignal(signal.SIGTERM)

    def chained(signum, frame):
        installed(signum, frame)
        os.write(notify, b"x")
    signal.signal(signal.SIGTERM, chained)
    return handled


def await_sigterm_after_logging(step: int) -> None:
    """Patches ``jp.loop.PreemptionHandler`` and ``jp.metrics.MetricsWriter.write`` so that a script run after
    this call (e.g. experiments/charlm.py through ``runpy``), once process 0 has logged training step ``step``,
    prints ``SYNC awaiting SIGTERM after logging step <step>`` and blocks until its handler ran on a SIGTERM."""
    import jax
    import jaxpar as jp
    handled = []

    class PreemptionHandler(jp.loop.PreemptionHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            handled.append(sigterm_pipe())
    jp.loop.PreemptionHandler = PreemptionHandler
    write = jp.metrics.MetricsWriter.write

    def write_then_await_sigterm(self, logged, metrics, split="train"):
        write(self, logged, metrics, split)
        if (logged, split) == (step, "train") and jax.process_index() == 0:
            sync(f"awaiting SIGTERM after logging step {step}")
            os.read(handled[0], 1)
    jp.metrics.MetricsWriter.write = write_then_await_sigterm


def _hang_guard(what: str) -> None:
    """Blocks the process until a signal ends it; exits 3 (fails the test) after HANG_GUARD seconds."""
    threading.Event().wait(HANG_GUARD)
    print(f"worker: nobody signalled me {what} within {HANG_GUARD} s", flush=True)
    os._exit(3)


def build(spec: Spec, mesh=None):
    """(mesh, init_fn, loss_fn, tx, policy) of the job; built once per configuration (see :func:`step_fn`)."""
    key = (spec.mesh, spec.precision, spec.pruning, spec.loss_scale, spec.optimizer, mesh)
    if key not in _JOBS:
        _JOBS[key] = _build(spec, mesh)
    return _JOBS[key]


def step_fn(spec: Spec, mesh=None):
    """The jitted train step of the job, made once per configuration so a process compiles it once."""
    key = ("step", spec.mesh, spec.precision, spec.pruning, spec.loss_scale, spec.optimizer, mesh)
    if key not in _JOBS:
        import jaxpar as jp
        mesh, _, loss_fn, tx, _ = build(spec, mesh)
        _JOBS[key] = jp.train.make_train_step(loss_fn, tx, mesh=mesh)  # the policy travels on the state
    return _JOBS[key]


def _build(spec: Spec, mesh=None):
    import jax

    import jaxpar as jp
    from helpers import gpt_parts

    data, fsdp, tensor = spec.mesh
    mesh = mesh or jp.make_mesh(data=data, fsdp=fsdp, tensor=tensor, devices=jax.devices()[:data * fsdp * tensor])
    init_fn, loss_fn = gpt_parts()
    policy = jp.precision.Policy.from_string("mixed_fp16") if spec.precision == "fp16" else None
    return mesh, init_fn, loss_fn, make_tx(spec, init_fn), policy


def make_tx(spec: Spec, init_fn):
    """The job's optimizer for the model ``init_fn`` initialises (the pruning reads its axis names)."""
    import jax
    import optax

    import jaxpar as jp
    tx = {"adamw": lambda: optax.adamw(3e-3), "sgd": lambda: optax.sgd(0.5)}[spec.optimizer]()
    if spec.pruning:  # the one line that adds magnitude pruning (its state is checkpointed like any other)
        tx = optax.chain(tx, jp.pruning.magnitude_pruning(
            jp.pruning.polynomial_sparsity(0.5, begin_step=0, end_step=6, frequency=2), distribution="global",
            axis_names=jax.eval_shape(init_fn, jax.random.key(0))))
    if spec.loss_scale:
        tx = jp.precision.loss_scaling(tx, jp.precision.DynamicLossScale(initial_scale=2.0 ** 15, growth_interval=3))
    return tx


def batch(spec: Spec, step: int, mesh) -> dict:
    """This process's rows of global batch ``step`` (random tokens drawn from ``(seed, step)``)."""
    import numpy as np

    import jaxpar as jp
    from helpers import gpt_batch
    full = gpt_batch(np.random.default_rng([spec.seed, step]), spec.batch_size)
    rows = jp.data.process_slice(spec.batch_size, mesh)
    return {k: v[rows] for k, v in full.items()}


def train(spec: Spec, out: str | Path, steps: int, mesh=None, *, block_after_checkpoint: int | None = None,
          await_sigterm_before_step: int | None = None):
    """Runs (or resumes) the job to ``steps``; returns ``(state, start_step, stopped_at)``.

    ``block_after_checkpoint`` / ``await_sigterm_before_step``: the sync points of the module docstring.
    """
    import jax

    import jaxpar as jp
    out = Path(out)
    step, (mesh, init_fn, _, tx, policy) = step_fn(spec, mesh), build(spec, mesh)
    ckpt = jp.checkpoint.CheckpointManager(out / "ckpt", max_to_keep=3, save_interval_steps=spec.interval)
    if block_after_checkpoint is not None:
        save = ckpt.save

        def save_then_block(n, *args, **kwargs):
            started = save(n, *args, **kwargs)
            if n == block_after_checkpoint:
                ckpt.wait()  # checkpoint n is finalized: renamed into place, listed, restorable
                sync(f"checkpoint {n} final")
                _hang_guard(f"after checkpoint {n}")
            return started
        ckpt.save = save_then_block
    state, start = jp.checkpoint.restore_or_init(
        ckpt, lambda: jp.train.init_state(init_fn, tx, jax.random.key(spec.seed), mesh=mesh, policy=policy),
        lambda: jp.train.abstract_state(init_fn, tx, mesh=mesh, policy=policy))
    writer = jp.metrics.MetricsWriter(out, tensorboard=False, resume_step=start)
    (out / f"rows_{jax.process_index()}.json").write_text(json.dumps(
        [jp.data.process_slice(spec.batch_size, mesh).start, jp.data.process_slice(spec.batch_size, mesh).stop]))

    with jp.loop.PreemptionHandler() as preemption:
        handled = sigterm_pipe() if await_sigterm_before_step is not None else None

        def batch_fn(t):
            if t == await_sigterm_before_step:
                sync(f"awaiting SIGTERM before step {t}")
                os.read(handled, 1)  # returns once the preemption handler has run
            return batch(spec, t, mesh)

        hooks = [jp.loop.Hook(lambda s, _, m: writer.write(s, m), every=1, needs_state=False),
                 jp.loop.checkpoint(ckpt, extras_fn=lambda s: {"data_step": s})]  # every interval, end, SIGTERM
        state = jp.loop.run(step, state, batch_fn, start, steps, hooks=hooks, preemption=preemption).state
    ckpt.close()
    writer.close()
    return state, start, preemption.stopped_at


def replay(spec: Spec, out: str | Path, start: int, steps: int, mesh=None) -> list[float]:
    """Restores checkpoint ``start`` and re-runs steps ``start .. steps-1``; returns their losses."""
    import jaxpar as jp
    step, (mesh, init_fn, _, tx, policy) = step_fn(spec, mesh), build(spec, mesh)
    ckpt = jp.checkpoint.CheckpointManager(Path(out) / "ckpt")
    state = ckpt.restore(start, target=jp.train.abstract_state(init_fn, tx, mesh=mesh, policy=policy))
    return [m["loss"] for _, m, state in jp.loop.run_steps(step, state, lambda t: batch(spec, t, mesh),
                                                           start, steps)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--interval", type=int, default=1)
    p.add_argument("--mesh", action="append", help="data,fsdp,tensor (default 2,2,2); repeat for several jobs")
    p.add_argument("--precision", default="fp16")
    p.add_argument("--pruning", action="store_true")
    p.add_argument("--no-loss-scale", action="store_true")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    p.add_argument("--check-resume-from", type=int, default=None)
    p.add_argument("--block-after-checkpoint", type=int, default=None)
    p.add_argument("--await-sigterm-before-step", type=int, default=None)
    a = p.parse_args(argv)
    jax = start_worker()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    layouts = [tuple(int(v) for v in m.split(",")) for m in (a.mesh or ["2,2,2"])]
    for layout in layouts:
        out = Path(a.out) if len(layouts) == 1 else Path(a.out) / ("mesh" + "x".join(map(str, layout)))
        spec = Spec(mesh=layout, precision=a.precision, pruning=a.pruning, loss_scale=not a.no_loss_scale,
                    interval=a.interval, optimizer=a.optimizer)
        _, start, stopped = train(spec, out, a.steps, block_after_checkpoint=a.block_after_checkpoint,
                                  await_sigterm_before_step=a.await_sigterm_before_step)
        if jax.process_index() == 0:
            print(f"worker: trained from step {start} to {stopped or a.steps}" +
                  (" (preempted)" if stopped else ""), flush=True)
        if a.check_resume_from is not None:
            losses = replay(spec, out, a.check_resume_from, a.steps)
            if jax.process_index() == 0:
                (out / "replay.json").write_text(json.dumps(losses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
