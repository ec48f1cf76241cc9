"""Experiment tooling for entry points (``experiments/*.py``): what every script shares, outside the core.

* start-up: :func:`require_extra` (a script's optional libraries, checked before it imports them),
  :func:`simulate_cpu_devices`, :func:`reuse_cpu_host_memory`, :func:`log_devices`, :func:`check_resumed_config`;
* config pieces shared by the scripts, frozen dataclasses whose flags stay flat on the command line
  (``Annotated[MeshConfig, tyro.conf.OmitArgPrefixes]`` gives ``--fsdp``, not ``--mesh.fsdp``):
  :class:`MeshConfig`, :class:`PrecisionConfig`, :class:`PruningConfig`, and :func:`flat_config`, the one
  flat dict a run's ``config.json`` and checkpoints hold;
* the standard loop hooks (``jp.loop.Hook``): :func:`write_metrics`, :func:`throughput`,
  :func:`progress_bar`, and :func:`say` for a line above the bar.

``import jaxpar`` never imports this package (the cli imports the core, never the reverse). Optional libraries
(tqdm) are imported where used. Importing this module starts no JAX backend, so :func:`simulate_cpu_devices`
works after ``import jaxpar`` as long as nothing has run on a device yet.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

import jax
import optax

from jaxpar import _compat, pruning
from jaxpar.train.loop import Hook
from jaxpar.sharding.mesh import describe, make_mesh
from jaxpar.sharding.names import KV_HEADS, TENSOR, Rules
from jaxpar.tools.cpu import reuse_host_memory
from jaxpar.tools.metrics import MetricsWriter, Throughput
from jaxpar.precision.scaling import DynamicLossScale, loss_scaling
from jaxpar.precision.policy import Policy
from jaxpar._optional import require, require_extra
from jaxpar._validate import positive_int

_DEVICE_FLAG = "xla_force_host_platform_device_count"


# --------------------------------------------------------------------------------------------- start-up

def simulate_cpu_devices(n: int) -> None:
    """Asks XLA for ``n`` host CPU devices (``--xla_force_host_platform_device_count``); no effect on GPU/TPU.

    Call it before anything runs on a device (importing jax or jaxpar is fine: JAX starts its backends on
    first use). A device count already in ``XLA_FLAGS`` (e.g. set by ``python -m jaxpar.cli.launch``) is kept.

    Raises:
      ValueError: ``n`` not an int >= 1.
    """
    n = positive_int("simulate_devices", n, " (1: no simulated devices)")
    if n > 1 and _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_DEVICE_FLAG}={n}".strip()


def reuse_cpu_host_memory() -> None:
    """A CPU run's malloc settings (:func:`jaxpar.tools.cpu.reuse_host_memory`: XLA:CPU's per-step working memory
    kept instead of faulted in afresh), when ``JAXPAR_REUSE_HOST_MEMORY=1`` is in the environment and this process
    has not started JAX's backends yet (a notebook or a test calling ``main`` again keeps its settings).

    Opt-in because of its memory cost with several simulated devices: one arena that is never trimmed holds every
    device's working memory and fragments (charlm ``--model moe --expert-parallel 4 --fsdp 2``, 20 steps on 8
    simulated devices: 12.3 GB peak resident at ``--tensor 2`` against 3.4 GB without, 4.3 against 2.9 GB at
    ``--tensor 1``), against its gain on one device (1.3x the Llama's CPU step, ``benchmarks/README.md``).
    Nothing changes on a GPU run."""
    if os.environ.get("JAXPAR_REUSE_HOST_MEMORY", "0") == "1" and not _compat.backends_initialized():
        reuse_host_memory()


def split_kv_heads(rules: Any, mesh: jax.sharding.Mesh, kv_heads: int) -> Rules:
    """``rules`` with grouped-query key/value heads split over ``tensor`` (a first ``("kv_heads", "tensor")`` rule)
    when the mesh's tensor size divides ``kv_heads``, as Megatron's tensor-parallel attention splits them; else the
    rules unchanged (the heads stay whole on every tensor shard, which the model warns of). The library's
    ``DEFAULT_RULES`` leave them whole, so that any head count runs; an entry point knows its model's."""
    tensor = dict(zip(mesh.axis_names, mesh.axis_sizes)).get(TENSOR, 1)
    if tensor > 1 and kv_heads > 0 and kv_heads % tensor == 0:
        return Rules(((KV_HEADS, TENSOR), *(r for r in Rules(rules) if r[0] != KV_HEADS)))
    return Rules(rules)


def log_devices(mesh: jax.sharding.Mesh) -> None:
    """Process 0 prints the jax version, the devices and the mesh, e.g. ``jax 0.10.2 | 8 devices (cpu) | ...``."""
    if jax.process_index() == 0:
        print(f"jax {jax.__version__} | {jax.device_count()} devices ({jax.devices()[0].device_kind}) | "
              f"mesh {describe(mesh)}", flush=True)


def flat_config(cfg: Any) -> dict[str, Any]:
    """A config dataclass as one flat JSON dict (tuples as lists), nested configs merged in as their flags are.

    Raises:
      ValueError: two fields of the same name (they would be one flag).
    """
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        items = flat_config(value).items() if dataclasses.is_dataclass(value) else [(field.name, value)]
        for name, v in items:
            if name in out:
                raise ValueError(f"config field {name!r} appears twice in {type(cfg).__name__}; rename one")
            out[name] = v
    return json.loads(json.dumps(out))


def check_resumed_config(out_dir: str | os.PathLike, cfg: Any, may_change: frozenset[str]) -> None:
    """Refuses to resume a run whose ``<out_dir>/config.json`` differs from ``cfg`` outside ``may_change``, or
    whose latest checkpoint is past ``cfg.steps`` (where ``cfg`` has ``steps``).

    A checkpoint in ``<out_dir>/checkpoints`` would otherwise silently continue the old run under new
    settings (model, optimizer, data, seed), or fail to restore. Nothing is checked when that directory
    holds no checkpoint.

    Raises:
      SystemExit: with a message naming each changed flag (old -> new), or the checkpoint's step and
        ``--steps``, and the ways out.
    """
    out_dir = Path(out_dir)
    saved_path, ckpt_dir = out_dir / "config.json", out_dir / "checkpoints"
    steps = [int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()] if ckpt_dir.is_dir() else []
    if steps and isinstance(getattr(cfg, "steps", None), int) and cfg.steps < max(steps):
        raise SystemExit(f"{out_dir} holds a checkpoint at step {max(steps)}, past --steps {cfg.steps}: pass "
                         f"--steps {max(steps)} or more to resume that run, or a new --out-dir for a new run")
    if not saved_path.is_file() or not steps:
        return
    saved, now = json.loads(saved_path.read_text()), flat_config(cfg)
    changed = sorted(k for k in now if k not in may_change and k in saved and saved[k] != now[k])
    if changed:
        diff = ", ".join(f"--{k.replace('_', '-')} {saved[k]!r} -> {now[k]!r}" for k in changed)
        raise SystemExit(f"{out_dir} holds checkpoints of a run with other settings ({diff}); resuming would "
                         f"continue that run: pass a new --out-dir for a new run, or delete {out_dir}/checkpoints")


# ------------------------------------------------------------------------------------------ config pieces

@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh (``jp.make_mesh``, which checks the sizes): they multiply to the device count."""
    data: int = -1                 # data-parallel axis size (-1: the devices left over)
    fsdp: int = 2                  # FSDP axis size (params and optimizer state sharded over it)
    tensor: int = 2                # tensor-parallel axis size (Megatron split of attention and MLP)
    context: int = 1               # context-parallel axis size: the sequence split over it (jp.attention)
    simulate_devices: int = 8      # host CPU devices to simulate when running on CPU
    devices_per_host: int = 0      # hybrid mesh over hosts of this many devices (GPUs per node): tensor and fsdp
                                   # inside a node, data/pipe across nodes; 0: flat mesh

    def make(self, pipe: int = 1) -> jax.sharding.Mesh:
        """``jp.make_mesh`` with these sizes and ``pipe`` pipeline stages (hybrid with ``devices_per_host``)."""
        return make_mesh(data=self.data, pipe=pipe, fsdp=self.fsdp, tensor=self.tensor, context=self.context,
                         devices_per_host=self.devices_per_host or None)


PRECISIONS = {"f32": "float32", "bf16": "mixed_bf16", "fp16": "mixed_fp16",   # flag -> jp.Policy.from_string
              "fp8": "p=f32,c=bf16,o=f32,dot=fp8", "fp8_current": "p=f32,c=bf16,o=f32,dot=fp8_current"}


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision: the policy, and dynamic loss scaling for float16."""
    precision: Literal["f32", "bf16", "fp16", "fp8", "fp8_current"] = "f32"
    """bf16: params f32, compute bf16; fp16: the same + dynamic loss scaling; fp8: bf16 with the dense matmuls in
    fp8, delayed scaling (amax history); fp8_current: the same with current scaling (jaxpar.precision.fp8)"""
    matmul_precision: Literal["default", "tf32", "fp32", "bf16"] = "default"  # float32 matmuls, GPU only
                                   # (jp.gpu): tf32 (JAX's GPU default), fp32 (TF32 off), bf16

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")

    def policy(self) -> Policy:
        return Policy.from_string(PRECISIONS[self.precision])

    def wrap(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """``tx`` inside dynamic loss scaling for fp16 (outermost: a skipped step skips everything), else ``tx``."""
        return loss_scaling(tx, DynamicLossScale()) if self.precision == "fp16" else tx


PRUNE_STRUCTURES = {"none": (), "neurons": ("mlp",), "heads": ("heads",), "both": ("mlp", "heads")}


@dataclasses.dataclass(frozen=True)
class PruningConfig:
    """Gradual magnitude pruning (Zhu & Gupta 2017) after the optimizer; dense when sparsity is 0.

    Unstructured (single weights, or N:M) by default; with ``prune_structure`` whole MLP neurons and/or attention
    heads (``jp.pruning.structured_pruning``), which ``jp.pruning.compact`` then removes.
    """
    sparsity: float = 0.0          # final fraction of pruned kernel weights, or of neurons/heads (0: dense)
    distribution: Literal["uniform", "global", "erk"] = "uniform"  # how sparsity is spread (structured: no erk)
    n_m: tuple[int, int] | None = None  # N:M structured sparsity along each kernel's input axis, e.g. 2 4
    prune_begin: int = -1          # first pruning step (Zhu & Gupta cubic ramp); -1: steps // 4
    prune_end: int = -1            # step at which the final sparsity is reached; -1: 3 * steps // 4
    prune_frequency: int = 20      # steps between mask refreshes
    prune_structure: Literal["none", "neurons", "heads", "both"] = "none"  # prune whole MLP neurons/heads; compact

    def __post_init__(self):
        if self.prune_structure not in PRUNE_STRUCTURES:
            raise ValueError(f"pruning flags: --prune-structure {self.prune_structure!r}; use one of "
                             f"{', '.join(PRUNE_STRUCTURES)}")

    @property
    def enabled(self) -> bool:
        return self.sparsity != 0 or self.n_m is not None

    @property
    def structured(self) -> bool:
        """Whether whole neurons / heads are pruned (``--prune-structure`` other than none)."""
        return self.prune_structure != "none"

    @property
    def target(self) -> float:
        """The final sparsity: ``sparsity``, or ``1 - N/M`` for N:M alone (0.0 when dense)."""
        if self.n_m is not None and not self.sparsity:
            return 1 - self.n_m[0] / self.n_m[1]
        return self.sparsity

    def window(self, steps: int) -> tuple[int, int]:
        """(first pruning step, step the final sparsity is reached) in a run of ``steps`` steps."""
        return (self.prune_begin if self.prune_begin != -1 else steps // 4,
                self.prune_end if self.prune_end != -1 else 3 * steps // 4)

    def apply(self, tx: optax.GradientTransformation, steps: int, axis_names: Any = None, groups: Any = None):
        """``optax.chain(tx, pruning)`` for a run of ``steps`` steps (``tx`` itself when dense).

        The pruning is ``jp.pruning.magnitude_pruning(...)``, or with ``prune_structure``
        ``jp.pruning.structured_pruning(..., axes=..., groups=groups)`` (its groups are read from ``axis_names``,
        needed by then at ``init``; ``groups``: chains across modules, e.g. an MLP's). ``jp.pruning`` checks the
        values; this method adds the defaults relative to the run's length (-1) and that the pruning window lies
        inside the run.

        Raises:
          ValueError: a setting ``jp.pruning`` rejects, a window ending after ``steps``, structured pruning
            with ``n_m`` or without a sparsity; the message names the flags.
        """
        if not self.enabled:
            if self.structured:
                raise ValueError(f"pruning flags --prune-structure {self.prune_structure}: give the fraction of "
                                 "neurons / heads to remove with --sparsity (e.g. 0.5)")
            return tx
        begin, end = self.window(steps)
        flags = (f"--sparsity {self.sparsity} --distribution {self.distribution} --n-m {self.n_m} "
                 f"--prune-begin {begin} --prune-end {end} --prune-frequency {self.prune_frequency}"
                 + (f" --prune-structure {self.prune_structure}" if self.structured else ""))
        try:
            if end > steps:
                raise ValueError(f"the pruning window ends after the run's {steps} steps; pick steps inside the run")
            schedule = pruning.polynomial_sparsity(self.target, begin, end, frequency=self.prune_frequency)
            if self.structured:
                if self.n_m is not None:
                    raise ValueError("N:M masks single weights; it does not combine with --prune-structure")
                transform = pruning.structured_pruning(schedule, self.distribution, axis_names=axis_names,
                                                       axes=PRUNE_STRUCTURES[self.prune_structure], groups=groups)
            else:
                transform = pruning.magnitude_pruning(schedule, self.distribution, self.n_m, axis_names=axis_names)
        except (TypeError, ValueError) as e:
            raise ValueError(f"pruning flags {flags}: {e}") from None
        return optax.chain(tx, transform)


# ------------------------------------------------------------------------------------------------ hooks

def write_metrics(writer: MetricsWriter, split: str = "train") -> Hook:
    """A metrics hook writing every step's metrics to ``writer`` (JSONL, TensorBoard) under ``split``."""
    return Hook(lambda step, _, metrics: writer.write(step, metrics, split), every=1, needs_state=False)


def throughput(speed: Throughput) -> Hook:
    """A metrics hook adding ``speed.tick()`` (``tokens_per_s``, ``mfu``) to every step's metrics; put it
    before the hooks that log them."""
    return Hook(lambda step, _, metrics: metrics.update(speed.tick()), every=1, needs_state=False)


def progress_bar(total: int, initial: int = 0, desc: str = "train") -> Hook:
    """A metrics hook advancing a tqdm bar (process 0 only) with the loss and tokens/s; closed at the end."""
    tqdm = require("tqdm", "jaxpar.cli.experiment.progress_bar").tqdm
    bar = tqdm(total=total, initial=initial, desc=desc, disable=jax.process_index() != 0, mininterval=1.0)

    def advance(step, _, metrics):
        bar.update(1)
        shown = {"loss": ("loss", "{:.3f}"), "tok_s": ("tokens_per_s", "{:,.0f}")}
        bar.set_postfix({k: f.format(metrics[m]) for k, (m, f) in shown.items() if m in metrics})
    return Hook(advance, every=1, needs_state=False, finish=bar.close)


def say(text: str) -> None:
    """Process 0 prints ``text`` on stdout, above a progress bar if one is shown, and flushes."""
    if jax.process_index() == 0:
        require("tqdm", "jaxpar.cli.experiment.say").tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()


__all__ = ["MeshConfig", "PrecisionConfig", "PruningConfig", "check_resumed_config", "flat_config",
           "log_devices", "progress_bar", "require_extra", "reuse_cpu_host_memory", "say", "simulate_cpu_devices",
           "split_kv_heads", "throughput", "write_metrics"]
