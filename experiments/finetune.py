"""Fine-tune a Hugging Face checkpoint (any ``jp.models.hf.load`` reads: Llama, GPT-2, Qwen2/2.5, Qwen3, Mistral,
Gemma 3) on a mesh, and save it back.

Command (CPU: simulates 8 devices, mesh data=2 x fsdp=2 x tensor=2)::

    python experiments/finetune.py --hf path/to/checkpoint --steps 100 --out-dir runs/finetune

The checkpoint is read straight onto the mesh (``jp.models.hf.load(dir, mesh=mesh)``: each device's slice of
each tensor read from the safetensors files by itself), trained with ``jp.optim.adamw`` on the text encoded by
the checkpoint's own tokenizer (its ``tokenizer.json``, or ``--tokenizer``: any vocabulary size; every id it can
produce must be one of the model's) or, when it has none, on bytes (token ``i`` is byte ``i``: the vocabulary must
hold the 256 byte values), checkpointed with orbax to ``<out-dir>/checkpoints`` every ``--checkpoint-interval`` steps
and at the end (a rerun of the same command resumes from the latest; SIGTERM saves and exits), and at the end written
to ``<out-dir>/hf`` by ``jp.models.hf.save``, which ``transformers``' ``from_pretrained`` reads. The text is
``--text`` (a UTF-8 file) or CPython's ``pydoc_data.topics``, encoded whole (no special tokens added); training
sequences are random windows of it. Metrics go to ``<out-dir>/metrics.jsonl``. A ``--tokenizer`` that is not the
checkpoint's own is written into ``<out-dir>/hf`` as its ``tokenizer.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Annotated

import jax
import numpy as np

import jaxpar as jp
from jaxpar.cli import experiment
from jaxpar.models import hf
from jaxpar.models.hf import tokenizer as hf_tokenizer

experiment.require_extra("experiments/finetune.py")
import tyro  # noqa: E402

Flat = tyro.conf.OmitArgPrefixes


@dataclasses.dataclass(frozen=True)
class Config:
    """Fine-tuning configuration."""
    hf: str                        # the Hugging Face checkpoint directory (config.json, *.safetensors)
    mesh: Annotated[experiment.MeshConfig, Flat] = experiment.MeshConfig()
    steps: int = 100               # optimizer steps
    batch_size: int = 16           # global batch (sequences per step)
    seq_len: int = 128             # tokens (bytes without a tokenizer) per training sequence
    learning_rate: float = 3e-4    # peak AdamW learning rate (warm-up then cosine)
    warmup_steps: int = 10
    seed: int = 0
    text: str | None = None        # a UTF-8 text file; None = CPython's pydoc_data.topics
    tokenizer: str | None = None
    """a tokenizer.json or a directory holding one; None: the checkpoint's own tokenizer.json, else bytes"""
    out_dir: str = "runs/finetune"
    checkpoint_interval: int = 50  # orbax checkpoint every this many steps (and at the end); 0: only at the end
    expert_parallel: int = 1       # a mixture of experts (Mixtral, Qwen3-MoE): its experts split this many ways over
                                   # the batch axes (--fsdp, --data or their product); 1: every device holds them all

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        if self.checkpoint_interval < 0:
            raise ValueError(f"--checkpoint-interval={self.checkpoint_interval} must be >= 0 (0: only at the end)")
        out, source = Path(self.out_dir).resolve(), Path(self.hf).resolve()
        if source in (out, out / "hf"):
            raise ValueError(f"--hf {self.hf} is --out-dir {self.out_dir} or its hf/ output, which the run overwrites "
                             "(config.json, checkpoints, metrics): pass another --out-dir")


RESUMABLE_CHANGES = frozenset({"data", "fsdp", "tensor", "pipe", "simulate_devices", "devices_per_host", "steps",
                               "out_dir", "checkpoint_interval", "expert_parallel"})


def token_stream(text: str, tokenizer) -> np.ndarray:
    """``text`` as int32 token ids: ``tokenizer``'s (``jaxpar.models.hf.tokenizer.encode``), or its UTF-8 bytes
    when None."""
    if tokenizer is None:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    return hf_tokenizer.encode(tokenizer, text)


def checkpoint_tokenizer(cfg: Config, vocab_size: int):
    """The tokenizer fine-tuning encodes with (``--tokenizer``, else the checkpoint's ``tokenizer.json``) and its
    file, or ``(None, None)`` for bytes; ids beyond ``vocab_size`` and a byte vocabulary under 256 are refused."""
    file = hf_tokenizer.tokenizer_file(cfg.tokenizer if cfg.tokenizer is not None else cfg.hf)
    if file is not None:
        return hf_tokenizer.load_tokenizer(file, vocab_size), file
    if vocab_size < 256:
        raise ValueError(f"the checkpoint {cfg.hf!r} has no tokenizer.json and a vocabulary of {vocab_size} ids; "
                         "byte-level fine-tuning needs at least 256 (one per byte value): pass --tokenizer with "
                         "the model's tokenizer.json")
    return None, None


def batch(data: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int) -> dict:
    starts = np.random.default_rng([seed, step]).integers(0, data.size - seq_len - 1, batch_size)
    rows = np.stack([data[s:s + seq_len + 1] for s in starts])
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def main(cfg: Config) -> dict:
    """Fine-tunes; returns ``{"first_loss", "last_loss", "saved"}`` (the losses of this run's first and last steps),
    or None when preempted (a checkpoint was saved)."""
    experiment.simulate_cpu_devices(cfg.mesh.simulate_devices)
    experiment.reuse_cpu_host_memory()
    mesh = cfg.mesh.make()
    experiment.log_devices(mesh)
    experts = jp.sharding.expert_parallel_rules(mesh, cfg.expert_parallel)   # ValueError: folds onto no batch axes
    model, params = hf.load(cfg.hf, mesh=mesh, rules=experts)
    moe = getattr(model.cfg, "moe", None)
    if cfg.expert_parallel > 1 and (moe is None or moe.num_experts % cfg.expert_parallel):
        raise ValueError(f"--expert-parallel {cfg.expert_parallel} splits a mixture of experts' experts; {cfg.hf} is "
                         + ("a dense model: drop the flag" if moe is None else
                            f"a mixture of {moe.num_experts} experts, which it does not divide"))
    rules = experiment.split_kv_heads(experts, mesh, getattr(model.cfg, "kv_heads", 0))
    tokenizer, tokenizer_path = checkpoint_tokenizer(cfg, model.cfg.vocab_size)
    if cfg.seq_len > model.cfg.max_seq_len:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the checkpoint's max_position_embeddings "
                         f"{model.cfg.max_seq_len}")
    data = token_stream(jp.data.load_text(cfg.text), tokenizer)
    unit = "bytes" if tokenizer is None else "tokens"
    if data.size <= cfg.seq_len + 1:
        raise ValueError(f"the text has {data.size} {unit}; --seq-len {cfg.seq_len} needs more")
    tx = jp.optim.adamw(cfg.learning_rate, total_steps=cfg.steps, warmup_steps=min(cfg.warmup_steps, cfg.steps // 2),
                        axis_names=jax.eval_shape(model.init, jax.random.key(0)))
    # the loaded params are already in place: init_state keeps their layout (its init returns them)
    init_fn = lambda rng: hf.with_names(model, params)
    out = Path(cfg.out_dir)
    experiment.check_resumed_config(out, cfg, RESUMABLE_CHANGES)
    ckpt = jp.checkpoint.CheckpointManager(out / "checkpoints", save_interval_steps=cfg.checkpoint_interval)
    state, step0 = jp.checkpoint.restore_or_init(  # a rerun in the same --out-dir resumes
        ckpt, lambda: jp.train.init_state(init_fn, tx, cfg.seed, mesh=mesh, rules=rules, report=False),
        lambda: jp.train.abstract_state(init_fn, tx, mesh=mesh, rules=rules))
    writer = jp.metrics.MetricsWriter(out, resume_step=step0)
    if writer.active:
        (out / "config.json").write_text(json.dumps(experiment.flat_config(cfg), indent=2))
    print(f"{type(model).__name__} from {cfg.hf}: {model.cfg.num_params():,} params, {data.size:,} {unit} of text"
          + (f" ({tokenizer_path})" if tokenizer_path else "")
          + (f"; resumed from step {step0}" if step0 else ""), flush=True)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, rules=rules, check_batch=model.check_batch)
    losses = {}
    hooks = [experiment.write_metrics(writer), experiment.progress_bar(cfg.steps, step0),
             jp.loop.Hook(lambda t, _, m: losses.__setitem__(t, float(m["loss"])), every=1, needs_state=False),
             jp.loop.checkpoint(ckpt, lambda t: {"data_step": t, "config": experiment.flat_config(cfg)})]
    batch_fn = lambda t: batch(data, cfg.seed, t, cfg.batch_size, cfg.seq_len)
    with jp.loop.PreemptionHandler() as preemption:  # SIGTERM: finish the step, save, exit 0
        result = jp.loop.run(step, state, batch_fn, step0, cfg.steps, hooks=hooks, preemption=preemption)
    ckpt.close()
    writer.close()
    if result.preempted:
        experiment.say(f"preempted: saved a checkpoint at step {result.step} in {out / 'checkpoints'}; run the same "
                       "command again to resume")
        return None
    # the source's tokenizer files and special token ids go with the fine-tuned weights
    hf.save(model, jp.train.to_model_order(result.state).params, str(out / "hf"), like=cfg.hf)
    if tokenizer_path is not None and tokenizer_path != hf_tokenizer.tokenizer_file(cfg.hf):
        shutil.copyfile(tokenizer_path, out / "hf" / "tokenizer.json.tmp")   # the ids it was trained on
        os.replace(out / "hf" / "tokenizer.json.tmp", out / "hf" / "tokenizer.json")
    first, last = (losses[min(losses)], losses[max(losses)]) if losses else (float("nan"), float("nan"))
    experiment.say(f"fine-tuned steps {step0 + 1}-{cfg.steps}: loss {first:.4f} -> {last:.4f}; saved {out / 'hf'}")
    return {"first_loss": first, "last_loss": last, "saved": str(out / "hf")}


if __name__ == "__main__":
    main(tyro.cli(Config))
