"""Analytic per-device memory of a decoder's train step: the estimate set beside XLA's compiled ``memory_analysis``.

One formula, used by :func:`jaxpar.plan.plan` and ``benchmarks/memory.py``. Per device, in bytes, with ``s(x)``
the number of devices a leaf ``x`` is split over (its sharding) and ``b(x)`` its dtype's bytes:

* params ``P = sum_x b(x) |x| / s(x)`` (the stored dtype: float32 master weights under a bf16 policy);
  gradients ``P`` (the params' dtype); optimizer state: its leaves' bytes the same way (AdamW: ``2 P``);
  with gradient accumulation a float32 accumulator ``P`` more;
* a compute copy of the params when the compute dtype is narrower: ``P c / b`` (``P / 2`` for bf16 over f32);
* activations ``A = T (S N_d r_saved + r_live + h)``. ``T`` is the tokens of one (micro)batch on a device:
  ``B L / (data * fsdp * context * k)`` for ``k`` accumulation steps, under a pipeline of ``m`` microbatches
  ``B L / (data * fsdp * context * m * k)`` (a microbatch is split over ``data`` and ``fsdp`` like a batch, its
  sequence over ``context``); ``S`` the
  stashed (micro)batches: 1 without a pipeline, else the schedule's peak stash ``max(schedule.peak_stash)``,
  counted in chunk-microbatches; ``N_d`` the layers of one stash slot: ``N`` without a pipeline, else those of
  one chunk, ``N / (pipe * num_chunks)``. ``r_live`` (the block being recomputed) and the head's
  ``h = c D + 2 * 4 V / t`` (final LayerNorm input, float32 logits and their softmax) are live for one
  microbatch at a time, so they are not multiplied by ``S``. ``r`` is what one block keeps per token for its
  backward without remat:
  ``r = c (2 D + 3 H K / t + H K / t + 2 F / t) + 4 H Lk / t (+ c H Lk / t when c < 4)`` (block input and the
  residual after attention, q, k, v and the attention output, the MLP pre-activation and GELU output, the
  float32 softmax probabilities over ``Lk`` visible keys on average and their cast; with a context axis of
  ``C > 1`` devices ``Lk = (2C + 1) L / (4C)``, the ``2C + 1`` blocks of ``(L / 2C)^2`` scores a device computes for
  its ``L / C`` queries, :func:`jaxpar.layers.attention.work_per_device`). By ``GPTConfig.remat``:

  - ``"none"``: ``r_saved = r``, ``r_live = 0``;
  - ``"full"`` (``jax.checkpoint``, nothing saveable): ``r_saved = c D`` (the block input), ``r_live = r``
    (one block recomputed during its backward);
  - ``"dots"`` (dots without batch dims saveable): ``r_saved = c (D + 3 H K / t + D + F / t + D)`` (input, the
    qkv, out-projection, up and down matmul outputs), ``r_live = r``.

  ``c`` is the compute dtype's bytes, ``t`` the tensor-parallel size, ``D, H, K, F, V`` the model's width,
  heads, head dim, MLP width and padded vocabulary.

* under a pipeline (``pipe > 1``), ``pipeline_buffers``: the stage's float32 gradient accumulator, which is
  not sharded over ``fsdp`` (the runtime accumulates each device's rows unreduced and reduce-scatters once
  after the tick loop): ``P_b 4 / b * fsdp`` with ``P_b`` the per-device bytes of the stacked blocks; the
  gradient one action returns before it is added (one chunk's: ``P_b 4 / b * fsdp / num_chunks``); with
  ``fsdp > 1`` the stage weights gathered once per step in the compute dtype (``fsdp_gather="step"``, the
  default): ``P_b c / b * fsdp``; and the input cotangent of every microbatch the first stage writes
  (``B L / (data * fsdp)`` tokens of ``c D`` bytes).

Left out (so a compiled figure may exceed it): XLA's transient buffers (the gradient of one activation while
the next is computed; the attention gradients), the batch and metrics, the pipeline's receive buffers, and on
XLA:CPU the float32 copies it makes of bfloat16 buffers it computes in float32.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from jaxpar.sharding.names import CONTEXT, DATA, FSDP, PIPE, TENSOR, entry_axes
from jaxpar import protocol

SIZES = ("d_model", "num_heads", "head_dim", "mlp_dim", "num_layers", "padded_vocab", "max_seq_len", "attention",
         "attention_blocks", "remat", "dtype", "param_dtype", "num_params")
"""What the planner's formulas read of a model's config (its width, heads, layers, vocabulary, precision)."""


def model_and_config(model_or_config: Any) -> tuple[Any, Any]:
    """``(model, config)`` of a model of the protocol (its sizes from ``model.cfg``) or of a config that builds
    one (``config.as_model()``, e.g. a ``GPTConfig`` or ``LlamaConfig``).

    Raises:
      TypeError: no ``init`` and ``loss`` (a model of the protocol), or a config lacking one of :data:`SIZES`.
    """
    model = protocol.as_model(model_or_config)
    cfg = model_or_config if model is not model_or_config else getattr(model, "cfg", None)
    missing = [name for name in SIZES if not hasattr(cfg, name)]
    if missing or not all(callable(getattr(model, part, None)) for part in ("init", "loss")):
        raise TypeError(f"model_config must be a model of the protocol (init, loss) whose cfg gives its sizes, or "
                        f"a config that builds one (e.g. jaxpar.models.GPTConfig or LlamaConfig), got "
                        f"{type(model_or_config).__name__}" + (f" (its config lacks {missing})" if cfg is not None
                                                               and missing else ""))
    return model, cfg


def spec_axes(spec: Any) -> list[str]:
    """The mesh axis names a ``PartitionSpec`` uses."""
    return [a for entry in spec for a in entry_axes(entry)]


def sharded_bytes(tree: Any) -> float:
    """Per-device bytes of a tree of arrays or ``jax.ShapeDtypeStruct``s with ``NamedSharding``s (even splits)."""
    total = 0.0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        split = 1 if sharding is None else math.prod(sharding.mesh.shape[a] for a in spec_axes(sharding.spec))
        total += np.dtype(x.dtype).itemsize * math.prod(x.shape) / split if hasattr(x.dtype, "itemsize") else 0
    return total


def mean_visible_keys(cfg: Any, seq_len: int, context: int = 1) -> float:
    """Mean number of keys a query's attention computes over (``L`` for ``attention="xla"``; for ``"blocked"``
    the mean block end, since each query block attends to every key up to its own end; over a context axis of
    ``context > 1`` devices ``(2 context + 1) L / (4 context)``: the zigzag kernel's blocks)."""
    if context > 1:
        return (2 * context + 1) * seq_len / (4 * context)
    if cfg.attention != "blocked":
        return float(seq_len)
    n = max(1, min(cfg.attention_blocks, seq_len))
    ends = [round((i + 1) * seq_len / n) for i in range(n)]
    sizes = [e - round(i * seq_len / n) for i, e in enumerate(ends)]
    return sum(s * e for s, e in zip(sizes, ends)) / seq_len


def block_bytes_per_token(cfg: Any, seq_len: int, c: int, t: int, context: int = 1) -> tuple[float, float]:
    """``(r_saved, r_live)`` of the module docstring: bytes per token one block keeps for its backward, and
    those of the one block being recomputed (remat)."""
    D, H, K, F = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    Lk = mean_visible_keys(cfg, seq_len, context)
    r = c * (2 * D + 4 * H * K / t + 2 * F / t) + 4 * H * Lk / t + (c * H * Lk / t if c < 4 else 0)
    if cfg.remat == "none":
        return r, 0.0
    if cfg.remat == "full":
        return c * D, r
    return c * (3 * D + 3 * H * K / t + F / t), r


def estimate(cfg: Any, state: Any, mesh: Any, global_batch: int, seq_len: int, schedule: Any = None,
             grad_accum_steps: int = 1) -> dict[str, float]:
    """The estimate of the module docstring, per device, in bytes: ``{"params", "grads", "opt_state",
    "grad_accumulator", "compute_params", "activations", "pipeline_buffers"}``.

    Args:
      cfg: the model's config (``GPTConfig``, ``LlamaConfig``), or the model (its ``cfg``): its sizes
        (:data:`SIZES`), and its ``stage_key`` (the protocol's) naming the stacked layers' params.
      state: the ``TrainState`` (arrays or ``jax.ShapeDtypeStruct``s with shardings, e.g.
        ``jp.train.abstract_state``); its ``policy`` gives the compute dtype (None: the params' dtype).
      mesh: the mesh (``data``, ``fsdp``, ``context``, ``tensor``, ``pipe`` sizes).
      global_batch, seq_len: sequences per step and tokens per sequence.
      schedule: the pipeline schedule, or None.
      grad_accum_steps: accumulation steps per update.
    """
    model, cfg = model_and_config(cfg)
    P = sharded_bytes(state.params)
    param_bytes = max((np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state.params)), default=4)
    policy = state.policy
    c = param_bytes if policy is None else np.dtype(policy.compute_dtype).itemsize
    if cfg.dtype is not None:
        c = np.dtype(cfg.dtype).itemsize
    t, k, context = mesh.shape[TENSOR], grad_accum_steps, dict(mesh.shape).get(CONTEXT, 1)
    r_saved, r_live = block_bytes_per_token(cfg, seq_len, c, t, context)
    h = c * cfg.d_model + 2 * 4 * cfg.padded_vocab / t
    tokens = global_batch * seq_len / (mesh.shape[DATA] * mesh.shape[FSDP] * context * k)
    stash, layers = 1, cfg.num_layers
    if schedule is not None:
        tokens /= schedule.num_microbatches
        stash, layers = max(schedule.peak_stash), cfg.num_layers / (mesh.shape[PIPE] * schedule.num_chunks)
    pipeline = 0.0
    if schedule is not None and mesh.shape[PIPE] > 1:
        blocks, fsdp = sharded_bytes(state.params[protocol.stage_key(model)]), mesh.shape[FSDP]
        grad = blocks * 4 / param_bytes * fsdp
        pipeline = grad + grad / schedule.num_chunks + (blocks * c / param_bytes * fsdp if fsdp > 1 else 0.0)
        pipeline += global_batch * seq_len / (mesh.shape[DATA] * fsdp) * c * cfg.d_model
    return {"params": P, "grads": P, "opt_state": sharded_bytes(state.opt_state),
            "grad_accumulator": P * 4 / param_bytes if k > 1 else 0.0,
            "compute_params": P * c / param_bytes if c < param_bytes else 0.0,
            "activations": tokens * (stash * layers * r_saved + r_live + h), "pipeline_buffers": pipeline}


__all__ = ["SIZES", "estimate", "model_and_config", "sharded_bytes"]
