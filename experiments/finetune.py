"""Fine-tune a Hugging Face checkpoint (``LlamaForCausalLM`` or ``GPT2LMHeadModel``) on a mesh, and save it back.

Command (CPU: simulates 8 devices, mesh data=2 x fsdp=2 x tensor=2)::

    python experiments/finetune.py --hf path/to/checkpoint --steps 100 --out-dir runs/finetune

The checkpoint is read straight onto the mesh (``jp.models.hf.load(dir, mesh=mesh)``: each device's slice of
each tensor read from the safetensors files by itself), trained with ``jp.optim.adamw`` on byte-level text
(token ``i`` is byte ``i``: the checkpoint's vocabulary must hold the 256 byte values; a subword tokenizer is
the subject of issue 27), and written to ``<out-dir>/hf`` by ``jp.models.hf.save``, which
``transformers``' ``from_pretrained`` reads. The text is ``--text`` (a UTF-8 file) or CPython's
``pydoc_data.topics``; metrics go to ``<out-dir>/metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import jax
import numpy as np

import jaxpar as jp
from jaxpar.cli import experiment
from jaxpar.models import hf

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
    seq_len: int = 128             # bytes per training sequence
    learning_rate: float = 3e-4    # peak AdamW learning rate (warm-up then cosine)
    warmup_steps: int = 10
    seed: int = 0
    text: str | None = None        # a UTF-8 text file; None = CPython's pydoc_data.topics
    out_dir: str = "runs/finetune"

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")


def byte_text(path: str | None) -> np.ndarray:
    if path is None:
        from pydoc_data.topics import topics
        text = "\n\n".join(topics[k] for k in sorted(topics))
    else:
        text = Path(path).read_text(encoding="utf-8")
    data = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    if data.size < 2:
        raise ValueError(f"the text {path!r} is empty; pass a UTF-8 file with some text")
    return data


def batch(data: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int) -> dict:
    starts = np.random.default_rng([seed, step]).integers(0, data.size - seq_len - 1, batch_size)
    rows = np.stack([data[s:s + seq_len + 1] for s in starts])
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def main(cfg: Config) -> dict:
    """Fine-tunes; returns ``{"first_loss", "last_loss", "saved"}``."""
    experiment.simulate_cpu_devices(cfg.mesh.simulate_devices)
    mesh = cfg.mesh.make()
    model, params = hf.load(cfg.hf, mesh=mesh)
    if model.cfg.vocab_size < 256:
        raise ValueError(f"the checkpoint's vocabulary has {model.cfg.vocab_size} tokens; byte-level fine-tuning "
                         "needs at least 256 (one per byte value)")
    if cfg.seq_len > model.cfg.max_seq_len:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the checkpoint's max_position_embeddings "
                         f"{model.cfg.max_seq_len}")
    data = byte_text(cfg.text)
    if data.size <= cfg.seq_len + 1:
        raise ValueError(f"the text has {data.size} bytes; --seq-len {cfg.seq_len} needs more")
    tx = jp.optim.adamw(cfg.learning_rate, total_steps=cfg.steps, warmup_steps=min(cfg.warmup_steps, cfg.steps // 2),
                        axis_names=jax.eval_shape(model.init, jax.random.key(0)))
    # the loaded params are already in place: init_state keeps their layout (its init returns them)
    state = jp.train.init_state(lambda rng: hf.with_names(model, params), tx, cfg.seed, mesh=mesh, report=False)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, check_batch=model.check_batch)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = jp.metrics.MetricsWriter(out)
    losses = []
    for i in range(cfg.steps):
        state, metrics = step(state, batch(data, cfg.seed, i, cfg.batch_size, cfg.seq_len))
        losses.append(float(metrics["loss"]))
        writer.write(i + 1, {"loss": losses[-1]}, split="train")
        if i == 0 or (i + 1) % max(1, cfg.steps // 10) == 0:
            print(f"step {i + 1}: loss {losses[-1]:.4f}", flush=True)
    writer.close()
    hf.save(model, state.params, str(out / "hf"))
    experiment.say(f"fine-tuned {cfg.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved {out / 'hf'}")
    return {"first_loss": losses[0], "last_loss": losses[-1], "saved": str(out / "hf")}


if __name__ == "__main__":
    main(tyro.cli(Config))
