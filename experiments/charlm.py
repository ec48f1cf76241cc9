"""Character-level GPT on real English text, trained on a data x fsdp x tensor mesh.

Command (CPU: simulates 8 devices, mesh data=2 x fsdp=2 x tensor=2)::

    python experiments/charlm.py                      # the main job; see --help for every option
    python experiments/charlm.py --steps 200 --out-dir runs/quick

Resuming and preemption: a run restarted with the same ``--out-dir`` continues from its latest checkpoint
(``<out-dir>/checkpoints``, every ``--checkpoint-interval`` steps) bit-identically; ``--resume`` insists on
one. SIGTERM finishes the current step, saves and exits 0 (a second SIGTERM exits at once). Multi-process
(two local processes, 4 simulated CPU devices each, gloo collectives)::

    python -m jaxpar.launch -n 2 experiments/charlm.py --steps 200 --out-dir runs/mh

Pipeline parallelism (data=2 x pipe=2 x tensor=2; 2 layers per stage, 1F1B over 4 microbatches)::

    python experiments/charlm.py --pipe 2 --fsdp 1 --tensor 2 --schedule 1f1b --microbatches 4

Expected (2-core CPU, defaults): about 8 minutes, final validation loss about 1.3 nats/character on
CPython's ``pydoc_data.topics`` text; writes metrics.jsonl, TensorBoard events, loss.png and config.json to
``--out-dir`` (with checkpoints/) and prints a generated sample.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import check_resumed_config, log_devices, simulate_cpu_devices  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    """Main job configuration. Mesh axes multiply to the device count (one may be -1 to fill)."""
    data: int = -1                 # data-parallel axis size (-1: the devices left over)
    fsdp: int = 2                  # FSDP axis size (params and optimizer state sharded over it)
    tensor: int = 2                # tensor-parallel axis size (Megatron split of attention and MLP)
    pipe: int = 1                  # pipeline stages (layers split over them); > 1 trains through jp.pipeline
    schedule: Literal["gpipe", "1f1b"] = "1f1b"  # pipeline schedule (pipe > 1)
    microbatches: int = 4          # pipeline microbatches per (accumulation) batch (pipe > 1)
    simulate_devices: int = 8      # host CPU devices to simulate when running on CPU
    num_layers: int = 4            # transformer blocks
    num_heads: int = 4             # attention heads (divisible by tensor)
    d_model: int = 128             # model width
    seq_len: int = 128             # characters per training sequence
    positions: Literal["learned", "rotary"] = "learned"  # learned position table or rotary (RoPE)
    tie_embeddings: bool = True    # share the input embedding and the output projection
    scan_layers: bool = False      # lax.scan over layers (faster compile) instead of unrolling
    remat: Literal["none", "full", "dots"] = "none"  # activation checkpointing per block
    precision: Literal["f32", "bf16", "fp16"] = "f32"  # bf16: params f32, compute bf16; fp16: same + loss scaling
    steps: int = 800               # optimizer steps
    batch_size: int = 32           # global batch (sequences per step), independent of the mesh
    grad_accum_steps: int = 1      # microbatches per step
    learning_rate: float = 3e-3    # peak AdamW learning rate
    warmup_steps: int = -1         # linear warm-up steps; -1: min(100, steps // 8)
    weight_decay: float = 0.1      # decoupled weight decay on kernels
    clip_norm: float = 1.0         # global-norm gradient clipping (0 disables)
    seed: int = 0                  # seeds init, data order and sampling
    eval_interval: int = 200       # steps between validation evaluations
    eval_batches: int = 8          # validation batches per evaluation (final evaluation uses 4x)
    sample_chars: int = 300        # characters to generate at the end
    text: str | None = None        # a UTF-8 text file; None = CPython's pydoc_data.topics
    out_dir: str = "runs/charlm"   # where metrics, plots, the config and checkpoints/ are written
    sparsity: float = 0.0          # final fraction of pruned kernel weights (0: dense; with n_m: 1 - N/M)
    distribution: Literal["uniform", "global", "erk"] = "uniform"  # how sparsity is spread over kernels
    n_m: tuple[int, int] | None = None  # N:M structured sparsity along each kernel's input axis, e.g. 2 4
    prune_begin: int = -1          # first pruning step (Zhu & Gupta cubic ramp); -1: steps // 4
    prune_end: int = -1            # step at which the final sparsity is reached; -1: 3 * steps // 4
    prune_frequency: int = 20      # steps between mask refreshes
    resume: bool = False           # require a checkpoint in <out-dir>/checkpoints (one there is always resumed)
    checkpoint_interval: int = 100  # steps between checkpoints (0: only at the end and on SIGTERM)

    def __post_init__(self):
        for name in ("steps", "batch_size", "grad_accum_steps", "eval_interval", "eval_batches", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < -1 or self.warmup_steps >= self.steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps} must lie in [0, steps={self.steps}) (or -1: auto)")
        if self.seed < 0:
            raise ValueError(f"--seed {self.seed} must be >= 0")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning-rate must be positive, got {self.learning_rate}")
        if self.precision not in ("f32", "bf16", "fp16"):
            raise ValueError(f"--precision {self.precision!r}: use f32, bf16 or fp16")
        if self.pipe < 1 or self.microbatches < 1:
            raise ValueError(f"--pipe {self.pipe} and --microbatches {self.microbatches} must be >= 1")
        if self.schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"--schedule {self.schedule!r}: use gpipe or 1f1b")
        if self.num_layers % self.pipe:
            raise ValueError(f"--num-layers {self.num_layers} is not divisible by --pipe {self.pipe}: each stage "
                             "runs num_layers / pipe layers")
        if self.pipe > 1 and self.schedule == "1f1b" and self.microbatches < self.pipe:
            raise ValueError(f"--schedule 1f1b needs --microbatches >= --pipe ({self.pipe}), got {self.microbatches}")
        if not 0 <= self.sparsity < 1:
            raise ValueError(f"--sparsity {self.sparsity} must lie in [0, 1)")
        if self.n_m is not None and not 0 < self.n_m[0] < self.n_m[1]:
            raise ValueError(f"--n-m {self.n_m} must be N M with 0 < N < M, e.g. 2 4")
        begin, end = self.prune_window
        if (self.sparsity > 0 or self.n_m) and not (0 <= begin < end <= self.steps and self.prune_frequency >= 1):
            raise ValueError(f"need 0 <= --prune-begin < --prune-end <= --steps and --prune-frequency >= 1, got "
                             f"{begin}, {end}, {self.steps}, {self.prune_frequency}")
        if self.checkpoint_interval < 0:
            raise ValueError(f"--checkpoint-interval must be >= 0 (0: only at the end and on SIGTERM), "
                             f"got {self.checkpoint_interval}")


    @property
    def prune_window(self) -> tuple[int, int]:
        return (self.prune_begin if self.prune_begin >= 0 else self.steps // 4,
                self.prune_end if self.prune_end >= 0 else 3 * self.steps // 4)


def pruning_transform(cfg: Config, axis_names):
    """``jp.pruning.magnitude_pruning`` for the config (None when dense)."""
    import jaxpar as jp
    if cfg.sparsity == 0 and cfg.n_m is None:
        return None
    final = cfg.sparsity if cfg.sparsity > 0 else 1 - cfg.n_m[0] / cfg.n_m[1]
    schedule = jp.pruning.polynomial_sparsity(final, *cfg.prune_window, frequency=cfg.prune_frequency)
    return jp.pruning.magnitude_pruning(schedule, cfg.distribution, cfg.n_m, axis_names=axis_names)


# Settings a resumed run may change: the mesh (checkpoints restore onto any layout), the length of the run and
# what is logged. Anything else (model, optimizer, data, seed, precision, pruning) needs a new --out-dir.
RESUMABLE_CHANGES = frozenset({"data", "fsdp", "tensor", "pipe", "schedule", "microbatches", "simulate_devices",
                               "steps", "eval_interval", "eval_batches", "sample_chars", "out_dir", "resume",
                               "checkpoint_interval"})


def main(cfg: Config) -> float | None:
    simulate_cpu_devices(cfg.simulate_devices)
    import jax
    import numpy as np
    import optax
    from tqdm import tqdm

    import jaxpar as jp
    from jaxpar.models import GPT, GPTConfig

    jp.initialize_distributed()  # a no-op unless started by `python -m jaxpar.launch` or on a cluster
    corpus = jp.data.CharCorpus.load(cfg.text)
    if min(len(corpus.train), len(corpus.val)) <= cfg.seq_len + 1:
        raise ValueError(f"--seq-len {cfg.seq_len} is too long for this text ({len(corpus.train)} train / "
                         f"{len(corpus.val)} validation characters); use a shorter --seq-len or a longer text")
    mesh = jp.make_mesh(data=cfg.data, pipe=cfg.pipe, fsdp=cfg.fsdp, tensor=cfg.tensor)
    log_devices(mesh)
    policy = jp.Policy.from_string({"f32": "float32", "bf16": "mixed_bf16", "fp16": "mixed_fp16"}[cfg.precision])
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                          d_model=cfg.d_model, max_seq_len=cfg.seq_len, positions=cfg.positions,
                          tie_embeddings=cfg.tie_embeddings, scan_layers=cfg.scan_layers, remat=cfg.remat,
                          dtype=policy.compute_dtype, param_dtype=policy.param_dtype,
                          output_dtype=policy.output_dtype))
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 0 else min(100, cfg.steps // 8)
    axis_names = jax.eval_shape(model.init, jax.random.key(0))   # logical names: what each leaf is
    tx = jp.train.adamw(cfg.learning_rate, total_steps=cfg.steps, warmup_steps=warmup,
                        weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm or None, axis_names=axis_names)
    pruning = pruning_transform(cfg, axis_names)
    if pruning is not None:
        tx = optax.chain(tx, pruning)  # after the optimizer; inside loss scaling (a skipped step prunes nothing)
    if cfg.precision == "fp16":
        tx = jp.precision.loss_scaling(tx, jp.precision.DynamicLossScale())
    jp.train.check_batch_size(cfg.batch_size, mesh, jp.sharding.DEFAULT_RULES, cfg.grad_accum_steps)
    out = Path(cfg.out_dir)
    check_resumed_config(out, cfg, RESUMABLE_CHANGES)
    ckpt = jp.checkpoint.CheckpointManager(out / "checkpoints", save_interval_steps=cfg.checkpoint_interval)
    state, step0 = jp.checkpoint.restore_or_init(  # resumes from the latest checkpoint when there is one
        ckpt, lambda: jp.train.init_state(model.init, tx, jax.random.key(cfg.seed), mesh=mesh, policy=policy),
        lambda: jp.train.abstract_state(model.init, tx, mesh=mesh, policy=policy), require=cfg.resume)
    schedule = {"gpipe": jp.pipeline.gpipe, "1f1b": jp.pipeline.one_f_one_b}[cfg.schedule]
    pipeline = model.pipeline(schedule(cfg.pipe, cfg.microbatches)) if cfg.pipe > 1 else None
    train_step = jp.train.make_train_step(model.loss, tx, mesh=mesh, policy=policy,
                                          grad_accum_steps=cfg.grad_accum_steps, pipeline=pipeline,
                                          check_batch=model.check_batch)
    eval_step = jp.train.make_eval_step(model.loss, mesh=mesh, policy=policy, check_batch=model.check_batch)

    writer = jp.metrics.MetricsWriter(out, resume_step=step0)
    if writer.active:
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    print(f"corpus: {len(corpus.train):,} train / {len(corpus.val):,} val characters, vocab {corpus.vocab_size} "
          f"(padded {model.cfg.padded_vocab}); model: {model.cfg.num_params():,} params"
          + (f"; resumed from step {step0}" if step0 else ""), flush=True)
    rows = jp.data.process_slice(cfg.batch_size, mesh)  # this process's rows of every global batch

    def evaluate(state, n):
        batches = (corpus.batch(cfg.seed, i, cfg.batch_size, cfg.seq_len, "val", rows) for i in range(n))
        losses = [float(eval_step(state, b)["loss"]) for b in batches]
        return float(np.mean(losses))

    batch_fn = lambda t: corpus.batch(cfg.seed, t, cfg.batch_size, cfg.seq_len, rows=rows)
    extras = lambda t: {"data_step": t, "config": dataclasses.asdict(cfg)}
    val = None
    speed = jp.metrics.Throughput(cfg.batch_size * cfg.seq_len, model.cfg.flops_per_token(cfg.seq_len))
    bar = tqdm(total=cfg.steps, initial=step0, desc="train", disable=jax.process_index() != 0, mininterval=1.0)
    with jp.checkpoint.PreemptionHandler() as preemption, bar:  # SIGTERM: finish the step, save, exit 0
        for start in range(step0 - step0 % cfg.eval_interval, cfg.steps, cfg.eval_interval):
            start, stop = max(start, step0), min(start + cfg.eval_interval, cfg.steps)
            for t, m, state in jp.checkpoint.run_steps(train_step, state, batch_fn, start, stop, ckpt,
                                                       preemption=preemption, extras_fn=extras):
                m.update(speed.tick())
                writer.write(t + 1, m)
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m.get('tokens_per_s', 0):,.0f}")
            if preemption.stopped_at is not None:
                break
            n_eval = cfg.eval_batches * (4 if stop == cfg.steps else 1)
            val = evaluate(state, n_eval)
            val_metrics = {"loss": val}
            if pruning is not None:
                val_metrics["sparsity"] = jp.pruning.sparsity_report(state.params)["prunable"]["sparsity"]
            writer.write(stop, val_metrics, "val")
            if jax.process_index() == 0:
                bar.write(f"step {stop}: validation loss {val:.4f} nats/char"
                          + (f", kernel sparsity {val_metrics['sparsity']:.3f}" if pruning is not None else ""))
    if preemption.stopped_at is not None:
        writer.close()
        ckpt.close()
        if jax.process_index() == 0:
            print(f"preempted: saved a checkpoint at step {preemption.stopped_at} in {out / 'checkpoints'}; run "
                  "the same command again to resume", flush=True)
        return None
    ckpt.save(cfg.steps, state, extras(cfg.steps), force=True)
    ckpt.close()
    if val is None:  # resumed at the last step: nothing was trained
        val = evaluate(state, cfg.eval_batches * 4)
    writer.close()

    prompt = "The "
    sample = model.generate(state.params, corpus.encode(prompt), cfg.sample_chars,  # every process: SPMD
                            jax.random.key(cfg.seed + 1))
    if writer.active:
        jp.plot.loss_curve(jp.metrics.read_jsonl(out / "metrics.jsonl"), out / "loss.png",
                           title=f"char-GPT on {jp.describe(mesh)}")
        print("\n--- sample ---\n" + prompt + corpus.decode(sample) + "\n--------------")
        print(f"final validation loss: {val:.4f} nats/character after {cfg.steps} steps "
              f"({cfg.steps * cfg.batch_size * cfg.seq_len:,} training characters); outputs in {out}/")
    return val


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Config))
