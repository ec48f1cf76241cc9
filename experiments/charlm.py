"""Character-level GPT on real English text, trained on a data x fsdp x tensor mesh.

Command (CPU: simulates 8 devices, mesh data=2 x fsdp=2 x tensor=2)::

    python experiments/charlm.py                      # the main job; see --help for every option
    python experiments/charlm.py --steps 200 --out-dir runs/quick

Expected (2-core CPU, defaults): about 8 minutes, final validation loss about 1.5 nats/character on
CPython's ``pydoc_data.topics`` text; writes metrics.jsonl, TensorBoard events, loss.png and config.json to
``--out-dir`` and prints a generated sample.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import log_devices, simulate_cpu_devices  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    """Main job configuration. Mesh axes multiply to the device count (one may be -1 to fill)."""
    data: int = -1                 # data-parallel axis size (-1: the devices left over)
    fsdp: int = 2                  # FSDP axis size (params and optimizer state sharded over it)
    tensor: int = 2                # tensor-parallel axis size (Megatron split of attention and MLP)
    simulate_devices: int = 8      # host CPU devices to simulate when running on CPU
    num_layers: int = 4            # transformer blocks
    num_heads: int = 4             # attention heads (divisible by tensor)
    d_model: int = 128             # model width
    seq_len: int = 128             # characters per training sequence
    positions: str = "learned"     # "learned" or "rotary"
    tie_embeddings: bool = True    # share the input embedding and the output projection
    scan_layers: bool = False      # lax.scan over layers (faster compile) instead of unrolling
    remat: str = "none"            # activation checkpointing: "none", "full", "dots"
    precision: str = "f32"         # "f32"; "bf16" (params f32, compute bf16); "fp16" (same, f16, dynamic loss scaling)
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
    out_dir: str = "runs/charlm"   # where metrics, plots and the config are written

    def __post_init__(self):
        for name in ("steps", "batch_size", "grad_accum_steps", "eval_interval", "eval_batches", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < -1 or self.warmup_steps > self.steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps} must lie in [0, steps={self.steps}] (or -1: auto)")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning-rate must be positive, got {self.learning_rate}")
        if self.precision not in ("f32", "bf16", "fp16"):
            raise ValueError(f"--precision {self.precision!r}: use f32, bf16 or fp16")


def main(cfg: Config) -> float:
    simulate_cpu_devices(cfg.simulate_devices)
    import jax
    import numpy as np
    from tqdm import tqdm

    import jaxpar as jp
    from jaxpar.models import GPT, GPTConfig

    corpus = jp.data.CharCorpus.load(cfg.text)
    mesh = jp.make_mesh(data=cfg.data, fsdp=cfg.fsdp, tensor=cfg.tensor)
    log_devices(mesh)
    policy = jp.Policy.from_string({"f32": "float32", "bf16": "mixed_bf16", "fp16": "mixed_fp16"}[cfg.precision])
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                          d_model=cfg.d_model, max_seq_len=cfg.seq_len, positions=cfg.positions,
                          tie_embeddings=cfg.tie_embeddings, scan_layers=cfg.scan_layers, remat=cfg.remat,
                          dtype=policy.compute_dtype, param_dtype=policy.param_dtype,
                          output_dtype=policy.output_dtype))
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 0 else min(100, cfg.steps // 8)
    tx = jp.train.adamw(cfg.learning_rate, total_steps=cfg.steps, warmup_steps=warmup,
                        weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm or None)
    if cfg.precision == "fp16":
        tx = jp.precision.loss_scaling(tx, jp.precision.DynamicLossScale())
    jp.train.check_batch_size(cfg.batch_size, mesh, jp.sharding.DEFAULT_RULES, cfg.grad_accum_steps)
    state = jp.train.init_state(model.init, tx, jax.random.key(cfg.seed), mesh=mesh, policy=policy)
    train_step = jp.train.make_train_step(model.loss, tx, mesh=mesh, policy=policy,
                                          grad_accum_steps=cfg.grad_accum_steps)
    eval_step = jp.train.make_eval_step(model.loss, mesh=mesh, policy=policy)

    out = Path(cfg.out_dir)
    writer = jp.metrics.MetricsWriter(out)
    if writer.active:
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    print(f"corpus: {len(corpus.train):,} train / {len(corpus.val):,} val characters, vocab {corpus.vocab_size} "
          f"(padded {model.cfg.padded_vocab}); model: {model.cfg.num_params():,} params", flush=True)

    def evaluate(state, n):
        losses = [float(eval_step(state, corpus.batch(cfg.seed, i, cfg.batch_size, cfg.seq_len, "val"))["loss"])
                  for i in range(n)]
        return float(np.mean(losses))

    batch_fn = lambda t: corpus.batch(cfg.seed, t, cfg.batch_size, cfg.seq_len)
    speed = jp.metrics.Throughput(cfg.batch_size * cfg.seq_len, model.cfg.flops_per_token(cfg.seq_len))
    with tqdm(total=cfg.steps, desc="train", disable=jax.process_index() != 0, mininterval=1.0) as bar:
        for start in range(0, cfg.steps, cfg.eval_interval):
            stop = min(start + cfg.eval_interval, cfg.steps)
            for t, m, state in jp.train.run_steps(train_step, state, batch_fn, start, stop):
                m.update(speed.tick())
                writer.write(t + 1, m)
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m.get('tokens_per_s', 0):,.0f}")
            n_eval = cfg.eval_batches * (4 if stop == cfg.steps else 1)
            val = evaluate(state, n_eval)
            writer.write(stop, {"loss": val}, "val")
            bar.write(f"step {stop}: validation loss {val:.4f} nats/char")
    writer.close()

    if writer.active:
        jp.plot.loss_curve(jp.metrics.read_jsonl(out / "metrics.jsonl"), out / "loss.png",
                           title=f"char-GPT on {jp.describe(mesh)}")
        prompt = "The "
        sample = model.generate(state.params, corpus.encode(prompt), cfg.sample_chars,
                                jax.random.key(cfg.seed + 1))
        print("\n--- sample ---\n" + prompt + corpus.decode(sample) + "\n--------------")
        print(f"final validation loss: {val:.4f} nats/character after {cfg.steps} steps "
              f"({cfg.steps * cfg.batch_size * cfg.seq_len:,} training characters); outputs in {out}/")
    return val


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Config))
