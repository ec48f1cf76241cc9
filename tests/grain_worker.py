"""A checkpointed training job on packed documents from ``jp.data.grain_batches``: imported, or run as a script.

Script (also under ``python -m jaxpar.cli.launch -n 2``)::

    python tests/grain_worker.py --out DIR --steps 8 [--mesh 2,2,2] [--model gpt|bigram] [--sigterm-before-step K]
    python tests/grain_worker.py --out DIR --steps 0 --finite-pass [--mesh 2,2,2]

Trains on random documents (:func:`documents`) packed into rows of 16 (a global batch of 16 rows in 8 shards),
resuming from ``DIR/ckpt`` (train state and data state) when it holds a checkpoint, saving every 2 steps, at
the end and on SIGTERM. ``--sigterm-before-step K``: process 0 sends itself SIGTERM while batch K is built, so
the run stops after step K + 1 (the preemption handler makes every process stop at the same step). Process 0
appends ``DIR/losses.jsonl`` (``{"step", "loss"}`` per step); every process appends ``DIR/rows_<process>.jsonl``
(``{"step", "rows": {row index: [inputs, targets, segment_ids, positions, loss_mask]}}``: the global-batch rows
its devices received, read back from the placed arrays). ``--finite-pass`` only iterates one pass over
:func:`finite_pass_documents` to its end, writing the rows the same way.

The models are defined here (not jaxpar's only): ``bigram`` (a [V, V] logit table, a masked cross-entropy of
its own) and ``gpt`` (``jp.models.GPT`` on ``helpers.SMALL_GPT``, which takes the packed entries itself).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

GLOBAL_BATCH, SEQ_LEN, NUM_SHARDS, VOCAB, SEED = 16, 16, 8, 61, 5


def documents(n: int = 240, seed: int = 0) -> list:
    """``n`` random documents of 2 .. 14 token ids in ``[0, VOCAB)``."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(2, 15))).astype(np.int32) for _ in range(n)]


def bigram_parts():
    """(init_fn, loss_fn) of a bigram model written here: logits = table[input token], masked mean CE."""
    import jax
    import jax.numpy as jnp
    import optax

    def init_fn(rng):
        return {"table": 0.1 * jax.random.normal(rng, (VOCAB, VOCAB), jnp.float32)}

    def loss_fn(params, batch, rng=None):
        del rng
        ce = optax.softmax_cross_entropy_with_integer_labels(params["table"][batch["inputs"]], batch["targets"])
        mask = batch["loss_mask"].astype(jnp.float32)
        weight = mask.sum()
        return (ce * mask).sum() / weight, {"weight": weight}
    return init_fn, loss_fn


def parts(model: str):
    import jaxpar as jp
    from helpers import SMALL_GPT
    if model == "bigram":
        return bigram_parts()
    gpt = jp.models.GPT(SMALL_GPT)
    return gpt.init, gpt.loss


def make_mesh(sizes):
    import jax

    import jaxpar as jp
    data, fsdp, tensor = sizes
    return jp.make_mesh(data=data, fsdp=fsdp, tensor=tensor, devices=jax.devices()[:data * fsdp * tensor])


def batches_for(mesh):
    import grain

    import jaxpar as jp
    return jp.data.grain_batches(grain.MapDataset.source(documents()), global_batch=GLOBAL_BATCH, mesh=mesh,
                                 seed=SEED, seq_len=SEQ_LEN, num_shards=NUM_SHARDS, num_packing_bins=3)


def loaded_rows(batch) -> dict[str, list]:
    """The rows of a placed global batch this process's devices hold: {row index: [each entry's row]}."""
    import numpy as np
    out: dict[str, list] = {}
    keys = sorted(batch)
    for shards in zip(*(batch[k].addressable_shards for k in keys)):
        start = shards[0].index[0].start or 0
        for i in range(shards[0].data.shape[0]):
            out[str(start + i)] = [np.asarray(s.data)[i].tolist() for s in shards]
    return out


def train(out: str | Path, steps: int, mesh_sizes=(2, 2, 2), model: str = "gpt",
          sigterm_before_step: int | None = None):
    """Runs (or resumes) the job to ``steps``; returns ``(start_step, stopped_at)``."""
    import jax
    import optax

    import jaxpar as jp
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh(mesh_sizes)
    init_fn, loss_fn = parts(model)
    tx = optax.sgd(0.5, momentum=0.9)
    ckpt = jp.checkpoint.CheckpointManager(out / "ckpt", max_to_keep=3, save_interval_steps=2)
    batches = batches_for(mesh)
    state, start = jp.checkpoint.restore_or_init(
        ckpt, lambda: jp.train.init_state(init_fn, tx, jax.random.key(SEED), mesh=mesh),
        lambda: jp.train.abstract_state(init_fn, tx, mesh=mesh))
    if start:
        jp.loop.restore_data(ckpt, batches, start)
    step_fn = jp.train.make_train_step(loss_fn, tx, mesh=mesh)
    rows_file = open(out / f"rows_{jax.process_index()}.jsonl", "a")

    def batch_fn(t):
        if t == sigterm_before_step and jax.process_index() == 0:
            os.kill(os.getpid(), signal.SIGTERM)   # handled before the next bytecode: the flag is set now
        batch = batches(t)
        rows_file.write(json.dumps({"step": t, "rows": loaded_rows(batch)}) + "\n")
        return batch

    def log(step, _, metrics):
        if jax.process_index() == 0:
            with open(out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": metrics["loss"]}) + "\n")
    with jp.loop.PreemptionHandler() as preemption:
        hooks = [jp.loop.Hook(log, every=1, needs_state=False), jp.loop.checkpoint(ckpt, data=batches)]
        jp.loop.run(step_fn, state, batch_fn, start, steps, hooks=hooks, preemption=preemption)
    rows_file.close()
    ckpt.close()
    return start, preemption.stopped_at


def finite_pass_documents(n: int = 96) -> list:
    """``n`` documents dealt (in order, ``[j::NUM_SHARDS]``) so that shards 0..3, process 0's of 2, get short ones
    (1 to 4 pairs) and shards 4..7 ones of a whole row each: process 0's shards run out batches earlier."""
    import numpy as np
    rng = np.random.default_rng(1)
    return [rng.integers(0, VOCAB, SEQ_LEN + 1 if i % NUM_SHARDS >= NUM_SHARDS // 2 else int(rng.integers(2, 6)))
            .astype(np.int32) for i in range(n)]


def finite_pass(out: str | Path, mesh_sizes=(2, 2, 2)) -> int:
    """Iterates one unshuffled pass (``num_epochs=1``) over :func:`finite_pass_documents` to its end, every
    process writing ``DIR/rows_<process>.jsonl`` as :func:`train` does; returns the number of batches."""
    import grain
    import jax

    import jaxpar as jp
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    batches = jp.data.grain_batches(grain.MapDataset.source(finite_pass_documents()), global_batch=GLOBAL_BATCH,
                                    mesh=make_mesh(mesh_sizes), seed=SEED, seq_len=SEQ_LEN, num_shards=NUM_SHARDS,
                                    shuffle=False, num_epochs=1)
    with open(out / f"rows_{jax.process_index()}.jsonl", "w") as f:
        for t, batch in enumerate(batches):
            f.write(json.dumps({"step": t, "rows": loaded_rows(batch)}) + "\n")
    return batches.step


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--mesh", default="2,2,2", help="data,fsdp,tensor")
    p.add_argument("--model", default="gpt", choices=["gpt", "bigram"])
    p.add_argument("--sigterm-before-step", type=int, default=None)
    p.add_argument("--finite-pass", action="store_true", help="iterate one pass to its end instead of training")
    a = p.parse_args(argv)
    from ckpt_worker import start_worker
    jax = start_worker()
    if a.finite_pass:
        batches = finite_pass(a.out, tuple(int(v) for v in a.mesh.split(",")))
        print(f"worker {jax.process_index()}: finite pass of {batches} batches", flush=True)
        return 0
    start, stopped = train(a.out, a.steps, tuple(int(v) for v in a.mesh.split(",")), a.model, a.sigterm_before_step)
    if jax.process_index() == 0:
        print(f"worker: trained from step {start} to {stopped or a.steps}" + (" (preempted)" if stopped else ""),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
