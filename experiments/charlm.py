"""Character-level GPT on real English text, trained on a data x fsdp x tensor mesh.

Command (CPU: simulates 8 devices, mesh data=2 x fsdp=2 x tensor=2)::

    python experiments/charlm.py                      # the main job; see --help for every option
    python experiments/charlm.py --steps 200 --out-dir runs/quick

Resuming and preemption: a run restarted with the same ``--out-dir`` continues from its latest checkpoint
(``<out-dir>/checkpoints``, every ``--checkpoint-interval`` steps) bit-identically; ``--resume`` insists on
one. SIGTERM finishes the current step, saves and exits 0 (a second SIGTERM exits at once). Multi-process
(two local processes, 4 simulated CPU devices each, gloo collectives)::

    python -m jaxpar.cli.launch -n 2 experiments/charlm.py --steps 200 --out-dir runs/mh

A token corpus (a subword tokenizer; ``experiments/prepare_tokens.py`` writes the directory): validation loss in
nats/token and bits/byte (from meta.json's byte counts), so runs with different tokenizers compare::

    python experiments/prepare_tokens.py --input pydoc.txt --train-bpe 1024 --out data/pydoc-bpe1k
    python experiments/charlm.py --data-dir data/pydoc-bpe1k --out-dir runs/bpe1k

Pipeline parallelism (data=2 x pipe=2 x tensor=2; 2 layers per stage, 1F1B over 4 microbatches)::

    python experiments/charlm.py --pipe 2 --fsdp 1 --tensor 2 --schedule 1f1b --microbatches 4

Context parallelism (long sequences: each sequence split over 2 devices, data=2 x context=2 x tensor=2, ring
attention over the zigzag layout; ``--context-attention all_gather`` gathers K/V instead)::

    python experiments/charlm.py --context 2 --fsdp 1 --seq-len 512

fp8 matmuls (attention projections and MLP on fp8 operands, bf16 elsewhere; ``fp8``: delayed scaling from an amax
history, ``fp8_current``: current scaling; 400 steps: validation loss within 0.02 nats/character of bf16)::

    python experiments/charlm.py --precision fp8 --steps 400 --out-dir runs/fp8

Structured pruning (whole MLP neurons and attention heads, Zhu & Gupta's ramp over the middle half of the run),
compacted at the end into a smaller dense GPT whose speed-up and validation loss are printed and written to
``<out-dir>/compaction.json``::

    python experiments/charlm.py --prune-structure both --sparsity 0.5 --out-dir runs/structured

A mixture of experts (a Llama whose MLPs are 8 routed SwiGLU experts, top-2, dropless; jaxpar.layers.moe), the
experts split over 4 devices folded onto the batch axes (the dense layers and the batch placed as without; the
per-expert load is logged to metrics.jsonl and drawn in expert_load.png)::

    python experiments/charlm.py --model moe --experts 8 --experts-per-token 2 --expert-parallel 4 --fsdp 2 --tensor 1
    python experiments/charlm.py --model moe --bias-update-rate 1e-3          # DeepSeek-V3's aux-loss-free balancing

Expected (2-core CPU, defaults): about 8 minutes, final validation loss about 1.3 nats/character on
CPython's ``pydoc_data.topics`` text; writes metrics.jsonl, TensorBoard events, loss.png and config.json to
``--out-dir`` (with checkpoints/) and prints a generated sample.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Annotated, Literal

import jax
import optax

import jaxpar as jp
from jaxpar.cli import experiment
from jaxpar.layers.moe import MoEConfig
from jaxpar.models import GPT, GPTConfig, Llama, LlamaConfig

experiment.require_extra("experiments/charlm.py")  # a core-only install stops here, told which extra to install
import tyro  # noqa: E402  (after the check above)

Flat = tyro.conf.OmitArgPrefixes  # a shared config piece's flags stay flat: --fsdp, --precision, --sparsity


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
    """--model moe: each block's MLP is a mixture of routed SwiGLU experts (jaxpar.layers.moe.MoEConfig)."""
    experts: int = 8               # routed experts per MoE layer
    experts_per_token: int = 2     # experts each token is routed to (top-k)
    expert_d_mlp: int = 0          # each expert's SwiGLU width (0: --d-mlp's)
    expert_parallel: int = 1
    """devices the experts are split over (1: every device holds every expert): folded onto the batch axes
    (jp.sharding.expert_parallel_rules), so it divides --experts and is --fsdp, --data or their product; the
    global batch and the dense layers' placement are those of 1"""
    router: Literal["softmax", "sigmoid"] = "softmax"
    """softmax: top-k of a softmax over the experts, renormalised (Mixtral, Qwen3-MoE); sigmoid: DeepSeek-V3's
    sigmoid affinities"""
    capacity_factor: float | None = None  # None: dropless; > 0: GShard capacity per expert per sequence, rest dropped
    load_balance_coef: float = 0.0  # weight of the Switch/GShard auxiliary load-balancing loss
    z_loss_coef: float = 0.0       # weight of the router z-loss (ST-MoE)
    bias_update_rate: float = 0.0  # DeepSeek-V3's aux-loss-free selection bias step gamma (1e-3); 0: no bias
    dispatch: Literal["ring", "all_to_all"] = "ring"
    """how tokens reach experts on other devices (--expert-parallel > 1): ring (all-gather, then psum_scatter) or
    all_to_all; both give the same result"""

    def flags(self) -> str:
        """These settings as the command line gives them, e.g. ``--experts 8 --experts-per-token 2 ...``."""
        return " ".join(f"--{f.name.replace('_', '-')} {getattr(self, f.name)}" for f in dataclasses.fields(self))

    def moe_config(self, d_mlp: int = 0) -> MoEConfig:
        """The layer's config (``expert_d_mlp`` 0: ``d_mlp``; 0 again: the model's). ValueError (from
        ``MoEConfig``) in flag terms."""
        try:
            return MoEConfig(num_experts=self.experts, experts_per_token=self.experts_per_token,
                             expert_d_mlp=self.expert_d_mlp or d_mlp, router=self.router,
                             capacity_factor=self.capacity_factor, load_balance_coef=self.load_balance_coef,
                             z_loss_coef=self.z_loss_coef, bias_update_rate=self.bias_update_rate,
                             dispatch=self.dispatch)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--model moe with {self.flags()}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Config:
    """Main job configuration. Mesh axes multiply to the device count (one may be -1 to fill)."""
    mesh: Annotated[experiment.MeshConfig, Flat] = experiment.MeshConfig()
    pipe: int = 1                  # pipeline stages (layers split over them); > 1 trains through jp.pipeline
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"] = "1f1b"
    """pipeline schedule (pipe > 1):
    gpipe: all forwards, then all backwards;
    1f1b: forwards and backwards alternate (less memory);
    interleaved: 1F1B over --chunks stages per device;
    zb: ZB-H1, weight grads fill the bubble (Qi et al.);
    zbv: ZB-V, 2 chunks per device in a V (least bubble);
    dualpipev: DualPipeV, the V with one microbatch's forward and another's backward fused per tick (DeepSeek-V3;
    --microbatches >= 2 x --pipe)"""
    chunks: int = 2                # virtual stages per device of --schedule interleaved
    microbatches: int = 4          # pipeline microbatches per (accumulation) batch (pipe > 1)
    model: Literal["gpt", "llama", "moe"] = "gpt"
    """gpt: GPT-2-style blocks (LayerNorm, GELU, --positions); llama: Llama blocks (RMSNorm, SwiGLU, rotary,
    grouped-query attention with --num-kv-heads); moe: the Llama with a mixture of experts for each MLP (--experts)"""
    moe: Annotated[ExpertsConfig, Flat] = ExpertsConfig()
    num_layers: int = 4            # transformer blocks
    num_kv_heads: int = 0          # --model llama: key/value heads (divides num_heads); 0: num_heads
    num_heads: int = 4             # attention heads (divisible by tensor)
    d_model: int = 128             # model width
    d_mlp: int = 0                 # MLP width (0: the model's default, 4 x d_model for gpt, 8/3 x for llama)
    seq_len: int = 128             # characters (tokens with --data-dir) per training sequence
    positions: Literal["learned", "rotary"] = "learned"  # learned position table or rotary (RoPE)
    context_attention: Literal["auto", "ring", "all_gather"] = "auto"
    """attention over a sequence split over --context devices (jp.attention): ring (K/V passed round the devices)
    or all_gather (K/V gathered once); auto: ring, all_gather with --pipe > 1 (the ring cannot run inside stages)"""
    tie_embeddings: bool = True    # share the input embedding and the output projection
    scan_layers: bool = False      # lax.scan over layers (faster compile) instead of unrolling
    remat: Literal["none", "full", "dots"] = "none"  # activation checkpointing per block
    precision: Annotated[experiment.PrecisionConfig, Flat] = experiment.PrecisionConfig()
    steps: int = 800
    """optimizer steps; the warm-up, cosine decay and default pruning window are computed from it, so a run
    resumed with another --steps continues on the new length's schedule from the step it resumed at"""
    batch_size: int = 32           # global batch (sequences per step), independent of the mesh
    grad_accum_steps: int = 1      # microbatches per step
    learning_rate: float = 3e-3    # peak AdamW learning rate
    warmup_steps: int = -1         # linear warm-up steps; -1: min(100, steps // 8)
    weight_decay: float = 0.1      # decoupled weight decay on kernels
    clip_norm: float = 1.0         # global-norm gradient clipping (0 disables)
    seed: int = 0                  # seeds init, data order and sampling
    eval_interval: int = 200       # steps between validation evaluations
    eval_batches: int = 8          # validation batches per evaluation (final evaluation uses 4x)
    sample_chars: int = 300        # characters (tokens with --data-dir) to generate at the end
    text: str | None = None        # a UTF-8 text file; None = CPython's pydoc_data.topics
    data_dir: str | None = None
    """a token directory (train.bin, val.bin, meta.json, tokenizer.json from experiments/prepare_tokens.py) to train
    on instead of the characters of --text; the model's vocabulary is meta.json's (the mesh flag --data is the
    data-parallel axis)"""
    out_dir: str = "runs/charlm"   # where metrics, plots, the config and checkpoints/ are written
    pruning: Annotated[experiment.PruningConfig, Flat] = experiment.PruningConfig()
    resume: bool = False           # require a checkpoint in <out-dir>/checkpoints (one there is always resumed)
    checkpoint_interval: int = 100  # steps between checkpoints (0: only at the end and on SIGTERM)

    def __post_init__(self):
        if self.text is not None and self.data_dir is not None:
            raise ValueError(f"--text {self.text} and --data-dir {self.data_dir}: pass one corpus (characters of a "
                             "text file, or a token directory)")
        for name in ("eval_interval", "eval_batches", "num_layers", "num_heads", "d_model", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        try:   # the library's own checks, each answered in flags
            jp.attention.zigzag_order(self.seq_len, self.mesh.context)
        except ValueError as e:
            parts = 2 * self.mesh.context
            raise ValueError(f"--seq-len {self.seq_len} must be a multiple of 2 x --context {self.mesh.context} ({e}): "
                             f"use --seq-len {-(-self.seq_len // parts) * parts}") from e
        try:
            jp.attention.check_in_stages(self.context_attention, self.mesh.context, self.pipe > 1)
        except ValueError as e:
            raise ValueError(f"--context-attention ring cannot run inside pipeline stages (--pipe > 1); use all_gather "
                             f"or auto ({e})") from e
        if self.d_model % self.num_heads:   # each head is d_model / num_heads wide
            near = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
            lower = max(h for h in near if h < self.num_heads)
            upper = min((h for h in near if h > self.num_heads), default=None)
            raise ValueError(f"--num-heads {self.num_heads} must divide --d-model {self.d_model} (each head is "
                             f"d_model / num_heads wide): use --num-heads {lower}"
                             + (f" or {upper}" if upper else "") + f", or a --d-model divisible by {self.num_heads}")
        if self.positions == "rotary" and (self.d_model // self.num_heads) % 2:
            raise ValueError(f"--positions rotary needs an even head width --d-model / --num-heads, got "
                             f"{self.d_model} / {self.num_heads} = {self.d_model // self.num_heads}")
        if self.pipe >= 1 and self.num_layers % self.pipe:
            raise ValueError(f"--num-layers {self.num_layers} is not divisible by --pipe {self.pipe}: each stage "
                             "runs num_layers / pipe layers")
        if self.pipe > 1:
            try:   # the builder checks --microbatches against --pipe / --chunks
                schedule = self.pipeline_schedule()
            except ValueError as e:
                raise ValueError(f"--schedule {self.schedule} with --pipe {self.pipe} --microbatches {self.microbatches}"
                                 f"{f' --chunks {self.chunks}' if self.schedule == 'interleaved' else ''}: {e}") from e
            try:   # the state init_state(..., pipeline=) builds holds the stage layout of a multi-chunk schedule
                jp.pipeline.Pipeline.check_carried(
                    carried="fp8 meta state" if self.precision.policy().dot == "fp8" else "",
                    staged=schedule.num_chunks > 1)
            except ValueError as e:
                raise ValueError(f"--precision {self.precision.precision} (delayed scaling) runs through one-chunk "
                                 f"pipeline schedules only; got --schedule {self.schedule}: use gpipe, 1f1b or zb, or "
                                 f"--precision fp8_current ({e})") from e
            stages = self.pipe * schedule.num_chunks
            if self.num_layers % stages:
                raise ValueError(f"--num-layers {self.num_layers} is not divisible by the {stages} virtual stages of "
                                 f"--schedule {self.schedule} (--pipe {self.pipe} x {schedule.num_chunks} chunks)")
        self.check_experts()
        self.optimizer()  # the library checks the optimizer, pruning and precision flags now, before any work

    def check_experts(self) -> None:
        """The --model moe flags: the layer's checks (in flags), --expert-parallel dividing --experts, no auxiliary
        loss through a pipeline; the other flags only with --model moe."""
        moe = self.moe
        if self.model != "moe":
            if moe != ExpertsConfig():
                changed = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(moe)
                           if getattr(moe, f.name) != f.default]
                raise ValueError(f"{', '.join(changed)} configure a mixture of experts: add --model moe "
                                 f"(--model is {self.model})")
            return
        moe.moe_config()
        if moe.expert_parallel < 1 or moe.experts % moe.expert_parallel:
            works = [e for e in range(1, moe.experts + 1) if moe.experts % e == 0]
            raise ValueError(f"--expert-parallel {moe.expert_parallel} must divide --experts {moe.experts} (each "
                             f"device holds experts / expert_parallel of them): use one of {works}")
        if self.pipe > 1 and (moe.load_balance_coef or moe.z_loss_coef):
            raise ValueError(f"--load-balance-coef {moe.load_balance_coef} / --z-loss-coef {moe.z_loss_coef} with "
                             f"--pipe {self.pipe}: pipeline stages carry activations only, so auxiliary losses "
                             "cannot reach the loss; use --bias-update-rate (aux-loss-free balancing) or --pipe 1")

    def rules(self, mesh: jax.sharding.Mesh) -> jp.sharding.Rules:
        """The logical rules: ``jp.sharding.DEFAULT_RULES`` with the experts split --expert-parallel ways over the
        batch axes (--model moe), and the Llama's key/value heads over --tensor when it divides them. ValueError in
        flags when the expert-parallel size folds onto no batch axes."""
        size = self.moe.expert_parallel if self.model == "moe" else 1
        kv_heads = (self.num_kv_heads or self.num_heads) if self.model != "gpt" else 0
        try:
            return experiment.split_kv_heads(jp.sharding.expert_parallel_rules(mesh, size), mesh, kv_heads)
        except ValueError as e:
            data, fsdp = mesh.shape.get("data", 1), mesh.shape.get("fsdp", 1)
            works = [s for s in jp.sharding.expert_fold_choices(mesh) if self.moe.experts % s == 0]
            fix = (f", or --fsdp {size} --data {data * fsdp // size} (the same devices)"
                   if (data * fsdp) % size == 0 else "")
            raise ValueError(f"--expert-parallel {size} splits the experts over the batch axes (--data {data} x "
                             f"--fsdp {fsdp}), so it must be --fsdp, --data or their product: use "
                             f"--expert-parallel {' or '.join(map(str, works))}{fix} ({e})") from None

    def build_model(self, vocab_size: int):
        """The --model (GPT, Llama, or the Llama with --experts) for a vocabulary of ``vocab_size``."""
        strategy = self.context_attention if self.context_attention != "auto" else \
            "all_gather" if self.pipe > 1 else "ring"
        shared = dict(vocab_size=vocab_size, num_layers=self.num_layers, num_heads=self.num_heads,
                      d_model=self.d_model, d_mlp=self.d_mlp, max_seq_len=self.seq_len,
                      tie_embeddings=self.tie_embeddings, scan_layers=self.scan_layers, remat=self.remat,
                      context_attention=strategy)
        if self.model == "gpt":
            return GPT(GPTConfig(positions=self.positions, **shared))
        moe = self.moe.moe_config() if self.model == "moe" else None
        return Llama(LlamaConfig(num_kv_heads=self.num_kv_heads, moe=moe, **shared))

    def optimizer(self, axis_names=None) -> optax.GradientTransformation:
        """AdamW (warm-up + cosine), then pruning, inside loss scaling for fp16. ValueError on bad flags."""
        warmup = self.warmup_steps if self.warmup_steps != -1 else min(100, self.steps // 8)
        tx = jp.optim.adamw(self.learning_rate, total_steps=self.steps, warmup_steps=warmup,
                            weight_decay=self.weight_decay, clip_norm=self.clip_norm or None, axis_names=axis_names)
        return self.precision.wrap(self.pruning.apply(tx, self.steps, axis_names))

    def grad_fn(self, model: GPT):
        """What the step differentiates: the GPT's loss, or with --pipe > 1 its parts as a pipeline."""
        if self.pipe == 1:
            return model.loss
        return jp.pipeline.Pipeline.from_model(model, self.pipeline_schedule())

    def pipeline_schedule(self) -> jp.pipeline.Schedule:
        """The --schedule table for --pipe stages and --microbatches (ValueError on sizes it cannot run)."""
        options = {"num_chunks": self.chunks} if self.schedule == "interleaved" else {}
        return jp.pipeline.build(self.schedule, self.pipe, self.microbatches, **options)


# Settings a resumed run may change: the mesh (checkpoints restore onto any layout), the length of the run and
# what is logged. Anything else (model, optimizer, data, seed, precision, pruning) needs a new --out-dir.
RESUMABLE_CHANGES = frozenset({"data", "fsdp", "tensor", "context", "context_attention", "pipe", "schedule", "chunks",
                               "microbatches", "simulate_devices", "expert_parallel", "dispatch",
                               "devices_per_host", "steps", "eval_interval", "eval_batches", "sample_chars", "out_dir",
                               "resume", "checkpoint_interval"})


def main(cfg: Config) -> float | None:
    """Trains (or resumes) and returns the final validation loss; None when preempted."""
    jp.gpu.apply_gpu_defaults(matmul_precision=cfg.precision.matmul_precision,  # GPU only; before any device use
                              collective_matmul=cfg.mesh.tensor > 1)
    experiment.simulate_cpu_devices(cfg.mesh.simulate_devices)
    experiment.reuse_cpu_host_memory()
    jp.initialize_distributed()  # a no-op unless started by `python -m jaxpar.cli.launch` or on a cluster
    corpus = jp.data.TokenCorpus(cfg.data_dir) if cfg.data_dir else jp.data.CharCorpus.load(cfg.text)
    mesh = cfg.mesh.make(pipe=cfg.pipe)
    rules = cfg.rules(mesh)   # --expert-parallel: the experts folded onto the batch axes
    experiment.log_devices(mesh)
    # the step checks this too, but only after init and the first outputs: fail before anything is written
    jp.grads.check_batch_size(cfg.batch_size, mesh, rules, cfg.grad_accum_steps,
                              cfg.microbatches if cfg.pipe > 1 else 1)
    model = cfg.build_model(corpus.vocab_size)
    tx = cfg.optimizer(jax.eval_shape(model.init, jax.random.key(0)))  # logical names: what each leaf is
    out, policy = Path(cfg.out_dir), cfg.precision.policy()
    experiment.check_resumed_config(out, cfg, RESUMABLE_CHANGES)
    if cfg.resume and not (out / "checkpoints").is_dir():  # fail before the manager creates the directory
        raise jp.checkpoint.CheckpointError(f"asked to resume (--resume), but {str(out / 'checkpoints')!r} does not "
                                            "exist, so it holds no checkpoint; drop --resume to start fresh, or pass "
                                            "the --out-dir of the earlier run")
    ckpt = jp.checkpoint.CheckpointManager(out / "checkpoints", save_interval_steps=cfg.checkpoint_interval)
    # with --pipe > 1 the state holds the schedule's stage layout (interleaved, zbv: no weight crosses pipe in a
    # step); checkpoints are written in model order, so a run resumes under any --schedule / --pipe
    staged = cfg.grad_fn(model) if cfg.pipe > 1 else None
    state, step0 = jp.checkpoint.restore_or_init(  # resumes from the latest checkpoint when there is one
        ckpt, lambda: jp.train.init_state(model.init, tx, jax.random.key(cfg.seed), mesh=mesh, rules=rules,
                                          policy=policy, pipeline=staged),
        lambda: jp.train.abstract_state(model.init, tx, mesh=mesh, rules=rules, policy=policy, pipeline=staged),
        require=cfg.resume)
    writer = jp.metrics.MetricsWriter(out, resume_step=step0)
    if writer.active:
        (out / "config.json").write_text(json.dumps(experiment.flat_config(cfg), indent=2))
    print(f"corpus: {len(corpus.train):,} train / {len(corpus.val):,} val {unit(cfg)}s, vocab {corpus.vocab_size} "
          f"(padded {model.cfg.padded_vocab}); model: {model.cfg.num_params():,} params"
          + (f" ({model.cfg.active_params():,} active), {experts_header(cfg, rules)}" if cfg.model == "moe" else "")
          + (f"; {pipeline_header(cfg)}" if cfg.pipe > 1 else "") + (f"; resumed from step {step0}" if step0 else ""),
          flush=True)
    result, val = train(cfg, model, corpus, mesh, tx, state, step0, ckpt, writer)
    ckpt.close()
    writer.close()
    if result.preempted:
        experiment.say(f"preempted: saved a checkpoint at step {result.step} in {out / 'checkpoints'}; run the same "
                   "command again to resume")
        return None
    final = jp.train.to_model_order(result.state)   # sampling and compaction read the params as the model
    report(cfg, model, corpus, mesh, final, val, writer.active)
    if cfg.pruning.structured:
        compaction_report(cfg, model, corpus, mesh, tx, final, writer.active)
    return val


def unit(cfg: Config) -> str:
    """What a position of a sequence is: ``"token"`` (--data-dir) or ``"character"``."""
    return "token" if cfg.data_dir else "character"


def experts_header(cfg: Config, rules: jp.sharding.Rules) -> str:
    """The run header's experts part (--model moe), e.g. ``8 experts, top-2, split 4 ways over ('data',)``."""
    axes = rules.mesh_axes(jp.sharding.names.EXPERTS)
    return (f"{cfg.moe.experts} experts, top-{cfg.moe.experts_per_token}, "
            + (f"split {cfg.moe.expert_parallel} ways over {'x'.join(axes)} ({cfg.moe.dispatch} dispatch)" if axes
               else "on every device"))


def pipeline_header(cfg: Config) -> str:
    """The run header's pipeline part (pipe > 1), e.g. ``pipeline: schedule 1f1b, pipe 2, microbatches 4``."""
    chunks = cfg.pipeline_schedule().num_chunks
    return (f"pipeline: schedule {cfg.schedule}, pipe {cfg.pipe}, microbatches {cfg.microbatches}"
            + (f", {chunks} chunks per device" if chunks > 1 else ""))


def train(cfg: Config, model, corpus, mesh, tx, state, step0, ckpt, writer):
    """The loop with its hooks (throughput, log, progress bar, evaluation, checkpoints); SIGTERM stops it
    cleanly. Returns ``(jp.loop.LoopResult, final validation loss)``."""
    rows = jp.data.process_slice(cfg.batch_size, mesh)  # this process's rows of every global batch
    rules = cfg.rules(mesh)
    # both steps run the GPT's check_batch on every host batch (the default for a model's own loss or parts)
    train_step = jp.train.make_train_step(cfg.grad_fn(model), tx, mesh=mesh, rules=rules,
                                          grad_accum_steps=cfg.grad_accum_steps)
    if cfg.model == "moe":
        train_step = with_expert_load(train_step)
    # with --pipe > 1 the eval runs through the pipeline too (its forward-only table)
    eval_step = jp.train.make_eval_step(cfg.grad_fn(model), mesh=mesh, rules=rules)
    val_batches = lambda s: [corpus.batch(cfg.seed, i, cfg.batch_size, cfg.seq_len, "val", rows)
                             for i in range(cfg.eval_batches * (4 if s == cfg.steps else 1))]
    vals = {}

    def log_val(step, state, results):
        val = {"loss": results["loss"], "bits_per_byte": corpus.bits_per_byte(results["loss"])}
        if cfg.pruning.enabled:
            val["sparsity"] = jp.pruning.sparsity_report(state.params)["prunable"]["sparsity"]
        writer.write(step, val, "val")
        vals[step] = val["loss"]
        experiment.say(f"step {step}: validation loss {val['loss']:.4f} nats/{unit(cfg)}, "
                       f"{val['bits_per_byte']:.4f} bits/byte"
                   + (f", kernel sparsity {val['sparsity']:.3f}" if "sparsity" in val else ""))

    speed = jp.metrics.Throughput(cfg.batch_size * cfg.seq_len, model.cfg.flops_per_token(cfg.seq_len))
    hooks = [experiment.throughput(speed), experiment.write_metrics(writer), experiment.progress_bar(cfg.steps, step0),
             jp.loop.evaluate(eval_step, val_batches, log_val, every=cfg.eval_interval),
             jp.loop.checkpoint(ckpt, lambda t: {"data_step": t, "config": experiment.flat_config(cfg)})]
    batch_fn = lambda t: corpus.batch(cfg.seed, t, cfg.batch_size, cfg.seq_len, rows=rows)
    with jp.loop.PreemptionHandler() as preemption:  # SIGTERM: finish the step, save, exit 0
        result = jp.loop.run(train_step, state, batch_fn, step0, cfg.steps, hooks=hooks, preemption=preemption)
    if cfg.steps not in vals and not result.preempted:  # resumed at the last step: nothing was trained
        vals[cfg.steps] = jp.loop.mean_metrics(eval_step, result.state, val_batches(cfg.steps))["loss"]
    return result, vals.get(cfg.steps)


def with_expert_load(train_step):
    """``train_step`` whose metrics also hold the experts' load after the step (``expert_load_{i}``,
    ``max_mean_load``, ...: ``jp.metrics.expert_load_metrics`` of the new state's carried router counts)."""
    load = jax.jit(jp.metrics.expert_load_metrics)

    def step(state, batch):
        state, metrics = train_step(state, batch)
        return state, {**load(state.carried), **metrics}   # the loss's own entries (aux) win a shared name
    return step


def report(cfg: Config, model, corpus, mesh, state, val: float, active: bool) -> None:
    """A generated sample (every process: SPMD), the loss plot and the final line (process 0)."""
    prompt = "The" if cfg.data_dir else "The "   # a subword vocabulary starts words with their space
    params = state.params
    if cfg.model == "moe" and state.carried is not None:   # the routers' selection bias, which the step carries
        params = jp.train.carried.merge(params, jp.train.carried.part(state.carried, jp.layers.moe.ROUTER))
    sample = model.generate(params, corpus.encode(prompt), cfg.sample_chars, jax.random.key(cfg.seed + 1))
    if active:
        out = Path(cfg.out_dir)
        rows = jp.metrics.read_jsonl(out / "metrics.jsonl")
        jp.plot.loss_curve(rows, out / "loss.png", title=f"char-{cfg.model} on {jp.describe(mesh)}")
        if cfg.model == "moe":
            jp.plot.expert_load([r for r in rows if r["split"] == "train"], out / "expert_load.png",
                                title=f"expert load, {cfg.moe.experts} experts top-{cfg.moe.experts_per_token}")
        if cfg.pipe > 1:   # the schedule this run trained with, beside its metrics
            jp.plot.schedule_gantt(cfg.pipeline_schedule(), out / "schedule.png")
        print("\n--- sample ---\n" + prompt + corpus.decode(sample) + "\n--------------")
        print(f"final validation loss: {val:.4f} nats/{unit(cfg)} ({corpus.bits_per_byte(val):.4f} bits/byte) after "
              f"{cfg.steps} steps ({cfg.steps * cfg.batch_size * cfg.seq_len:,} training {unit(cfg)}s); outputs in "
              f"{out}/")


def step_times(runs: dict, batch, rounds: int) -> dict:
    """Median ms of a train and an eval step per run, interleaved over ``rounds`` rounds (after a warm-up call),
    so that background load affects the runs alike. ``runs[name]`` holds ``state``, ``train`` and ``eval``."""
    def ms(fn):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        return 1e3 * (time.perf_counter() - start)

    calls = {name: {"train_ms": lambda r=r: r["train"](r["state"], batch)[1],
                    "eval_ms": lambda r=r: r["eval"](r["state"], batch)} for name, r in runs.items()}
    for fns in calls.values():
        for fn in fns.values():
            ms(fn)   # compile
    times = {name: {k: [] for k in fns} for name, fns in calls.items()}
    for _ in range(rounds):
        for name, fns in calls.items():
            for k, fn in fns.items():
                times[name][k].append(ms(fn))
    return {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}


def compaction_report(cfg: Config, model, corpus, mesh, tx, state, active: bool, rounds: int = 5) -> dict:
    """With --prune-structure: compacts the pruned model (``jp.pruning.compact_state``), evaluates it on the
    final validation batches, and times a train and an eval step of the masked model (the dense shapes) and of
    the compacted one side by side (:func:`step_times`). Writes ``<out-dir>/compaction.json`` and prints one
    line; returns the figures."""
    small_state, small_cfg = jp.pruning.compact_state(state, model.cfg, tx, mesh=mesh)
    small = small_cfg.as_model()
    rows = jp.data.process_slice(cfg.batch_size, mesh)
    val_batches = [corpus.batch(cfg.seed, i, cfg.batch_size, cfg.seq_len, "val", rows) for i in range(cfg.eval_batches * 4)]
    runs = {}
    for name, (m, s) in {"masked": (model, state), "compacted": (small, small_state)}.items():
        train_step = jp.train.make_train_step(cfg.grad_fn(m), tx, mesh=mesh, rules=cfg.rules(mesh),
                                              grad_accum_steps=cfg.grad_accum_steps, donate=False)
        eval_step = jp.train.make_eval_step(m.loss, mesh=mesh, rules=cfg.rules(mesh))
        runs[name] = dict(state=s, train=train_step, eval=eval_step, cfg=m.cfg,
                          val=jp.loop.mean_metrics(eval_step, s, val_batches)["loss"])
    timed = step_times(runs, corpus.batch(cfg.seed, cfg.steps, cfg.batch_size, cfg.seq_len, rows=rows), rounds)
    out = {name: {"val_loss": r["val"], "params": r["cfg"].num_params(), "num_heads": r["cfg"].num_heads,
                  "d_mlp": r["cfg"].mlp_dim, "param_bytes": sum(x.nbytes for x in jax.tree.leaves(r["state"].params)),
                  **timed[name]} for name, r in runs.items()}
    out["speedup"] = {k: out["masked"][k] / out["compacted"][k] for k in ("train_ms", "eval_ms")}
    if active:
        (Path(cfg.out_dir) / "compaction.json").write_text(json.dumps(out, indent=2))
        m, c = out["masked"], out["compacted"]
        print(f"compacted ({cfg.pruning.prune_structure}): heads {m['num_heads']} -> {c['num_heads']}, d_mlp "
              f"{m['d_mlp']} -> {c['d_mlp']}, {m['params']:,} -> {c['params']:,} params; validation loss "
              f"{c['val_loss']:.4f} (masked {m['val_loss']:.4f}); train step {m['train_ms']:.0f} -> "
              f"{c['train_ms']:.0f} ms ({out['speedup']['train_ms']:.2f}x), eval step {m['eval_ms']:.0f} -> "
              f"{c['eval_ms']:.0f} ms ({out['speedup']['eval_ms']:.2f}x)", flush=True)
    return out


if __name__ == "__main__":
    main(tyro.cli(Config))
