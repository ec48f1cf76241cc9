"""The roofline cost model of a planned layout: datasheet GPUs, step times from HLO statistics or model sizes.

These models read whole-program totals (an XLA:CPU compile's, or the model's sizes). A program compiled by XLA:GPU
is timed kernel by kernel in its scheduled order, async collectives overlapped, by
:func:`jaxpar.plan.step_time.scheduled_time` (what ``jp.plan.plan(..., target=)`` reports).

:func:`roofline` reads a compiled program's statistics (:class:`jaxpar._hlo.HloStats`); :func:`analytic_time`
needs only the model's sizes (no compilation). Both take the GPU's figures from
:data:`jaxpar.tools.metrics.GPU_DATASHEETS` (:func:`gpu`).

:func:`roofline`: compute ``t_c = FLOPs / peak``, memory ``t_m = bytes accessed / HBM bandwidth``, communication
``t_x = sum over collectives of f * bytes / link`` with ring factors ``f`` (all-reduce ``2 (g - 1) / g``,
all-gather / reduce-scatter / all-to-all ``(g - 1) / g``, permute 1; ``g`` the group size; ``f * bytes`` is what
one device sends) and the link NVLink when the group lies inside one host, InfiniBand otherwise. The mesh is
the one a run on hosts of ``gpus_per_host`` GPUs builds: ``jp.make_mesh(..., hosts=,
devices_per_host=gpus_per_host)``, whose default split (:func:`jaxpar.sharding.mesh.split_axes`) keeps ``tensor`` and
as much of ``fsdp`` as fits inside a host and puts the rest (``pipe``, ``data``, a large ``fsdp``) across
hosts; a collective whose mesh axes include one with an across-host part is an InfiniBand one.
``step_s = max(t_c, t_m) + t_x`` and ``step_overlap_s = max(t_c, t_m, t_x)``. The ranking uses ``step_s``, the
sum: XLA overlaps compute with memory traffic inside a kernel (hence their max), but whether a collective
hides behind compute depends on the latency-hiding scheduler and on data dependencies (a tensor-parallel
all-reduce sits between two matmuls of the same layer and cannot hide), so the no-overlap figure is the
conservative one and ``step_overlap_s`` the best case. ``mfu = 6 N B L / (step_s * devices * peak)`` with ``N``
the parameter count (a mixture of experts' active ones; embeddings included; attention's ``L^2`` FLOPs and
remat's recompute are not model FLOPs), ``B L`` the tokens of a step and ``peak`` the dense bf16 FLOP/s per GPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxpar.tools import metrics as _metrics
from jaxpar._hlo import HloStats
from jaxpar.plan.experts import expert_rules, flop_params, moe_plan
from jaxpar.sharding.names import CONTEXT, DATA, EXPERTS, FSDP, PIPE, TENSOR

_RING = {"all-reduce": lambda g: 2 * (g - 1) / g, "all-gather": lambda g: (g - 1) / g,
         "reduce-scatter": lambda g: (g - 1) / g, "all-to-all": lambda g: (g - 1) / g,
         "collective-permute": lambda g: 1.0}


@dataclasses.dataclass(frozen=True)
class GPU:
    """Datasheet figures of one GPU (see :data:`jaxpar.tools.metrics.GPU_DATASHEETS` for the sources)."""
    name: str
    memory_bytes: float
    peak_flops: float          # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per GPU, each direction
    infiniband_bytes_per_s: float


def gpu(name: str) -> GPU:
    """The :class:`GPU` named ``name`` (``"h100-80gb"``, ``"h200"``, ``"a100-80gb"``); ValueError otherwise."""
    sheets = _metrics.GPU_DATASHEETS
    if name not in sheets:
        raise ValueError(f"device={name!r} is not in the datasheet table; use one of {sorted(sheets)}")
    d = sheets[name]
    return GPU(name, d["memory_bytes"], _metrics.datasheet_peak_flops(d["kind"]), d["hbm_bytes_per_s"],
               d["nvlink_bytes_per_s"], d["infiniband_bytes_per_s"])


def _link(axes: tuple[str, ...], across: dict[str, int], spec: GPU) -> float:
    """Bytes/s per GPU of a collective over ``axes``: InfiniBand when one of them has an across-host part."""
    return spec.infiniband_bytes_per_s if any(across[a] > 1 for a in axes) else spec.nvlink_bytes_per_s


def roofline(stats: HloStats, sizes: dict[str, int], spec: GPU, across: dict[str, int],
             model_flops_total: float) -> dict:
    """The step-time terms of the module docstring (seconds) and the MFU they imply; ``across`` the mesh's
    across-host sizes (:func:`host_split`)."""
    comm: dict[str, float] = {}
    for c in stats.collectives:
        label = "+".join(c.axes)
        comm[label] = comm.get(label, 0.0) + _RING[c.kind](c.group_size) * c.bytes * c.count / _link(c.axes, across,
                                                                                                      spec)
    t_c, t_m, t_x = stats.flops / spec.peak_flops, stats.bytes_accessed / spec.hbm_bytes_per_s, sum(comm.values())
    step = max(t_c, t_m) + t_x
    n = math.prod(sizes.values())
    return {"compute_s": t_c, "hbm_s": t_m, "comm_s": t_x, "comm_s_by_axes": comm, "step_s": step,
            "step_overlap_s": max(t_c, t_m, t_x), "mfu": model_flops_total / (step * n * spec.peak_flops),
            "mfu_formula": "6 * num_params (of experts: active) * global_batch * seq_len / (step_s * num_devices * "
                           "peak_bf16_flops)"}


def analytic_time(cfg: Any, sizes: dict[str, int], across: dict[str, int], global_batch: int, seq_len: int,
                  schedule: Any, spec: GPU, grad_accum_steps: int = 1, expert_parallel: int = 1) -> dict:
    """A step time from the model's sizes alone (seconds, per device; no compilation), to rank layouts.

    Compute: ``k N T / (devices * peak) / (1 - bubble)`` with ``T = B L`` the step's tokens, ``k = 8`` under
    ``remat="full"`` (the forward runs twice), else 6, and the schedule's unit-tick bubble fraction. Traffic
    per device (ring factors and links as in :func:`roofline`; ``c``/``b`` the compute/param dtype bytes,
    ``T_d = T / (data fsdp)`` the tokens through a device's layers, ``N_s = N / (pipe tensor)`` a stage's
    parameters on one tensor shard): tensor, 4 all-reduces of ``T_d D c`` per layer (2 forward, 2 backward;
    Megatron's column/row split, Shoeybi et al. 2019, sec. 3); fsdp, the compute params gathered twice per
    accumulation step (forward, backward) and the gradients reduce-scattered once, ``(2 k_acc c + b) N_s``;
    data, an all-reduce of the ``N_s b / fsdp`` gradient shard; pipe, each chunk boundary's activations and
    their gradients, ``2 v T_d D c``; context (``C > 1``, ``T_d`` then ``T / (data fsdp C)``), each device's keys and
    values passed on ``C - 1`` times per layer in the forward and their gradients in the backward (ring; the
    all-gather and its reduce-scatter move the same bytes), ``4 (C - 1) T_d G K c / t`` per layer (``G K`` the
    key/value width); experts (a mixture of experts at ``expert_parallel > 1``), the dispatch's bytes over the
    expert axes (:func:`jaxpar.plan.experts.moe_plan`) with the ring factor of their size. ``N`` counts a mixture
    of experts' active parameters. ``step_s`` is the sum (no overlap, as ``roofline``'s ``step_s``).
    """
    n, t, f, d, p = (math.prod(sizes.values()), sizes[TENSOR], sizes[FSDP], sizes[DATA], sizes[PIPE])
    c, b = (np.dtype(x or jnp.float32).itemsize for x in (cfg.dtype, cfg.param_dtype))
    N, tokens = flop_params(cfg), float(global_batch * seq_len)
    bubble = 0.0 if schedule is None else schedule.bubble_fraction
    compute = (8 if cfg.remat == "full" else 6) * N * tokens / (n * spec.peak_flops) / (1 - bubble)
    C = sizes.get(CONTEXT, 1)
    t_d, n_s, ring = tokens / (d * f * C), N / (p * t), lambda g: (g - 1) / g
    link = lambda axis: _link((axis,), across, spec)
    comm = {}
    if t > 1:
        comm[TENSOR] = 4 * cfg.num_layers / p * t_d * cfg.d_model * c * 2 * ring(t) / link(TENSOR)
    if f > 1:
        comm[FSDP] = (2 * grad_accum_steps * c + b) * n_s * ring(f) / link(FSDP)
    if d > 1:
        comm[DATA] = n_s / f * b * 2 * ring(d) / link(DATA)
    if C > 1:
        kv = getattr(cfg, "kv_heads", cfg.num_heads) * cfg.head_dim
        comm[CONTEXT] = 4 * (C - 1) * cfg.num_layers / p * t_d * kv * c / t / link(CONTEXT)
    if p > 1:
        comm[PIPE] = 2 * schedule.num_chunks * t_d * cfg.d_model * c / link(PIPE)
    if expert_parallel > 1:
        axes = expert_rules(sizes, expert_parallel).mesh_axes(EXPERTS)
        dispatch = moe_plan(cfg, sizes, global_batch, seq_len, expert_parallel, grad_accum_steps=grad_accum_steps)
        comm["experts"] = (dispatch["dispatch"]["total"] / p * ring(expert_parallel)
                           / _link(tuple(axes), across, spec))
    step = compute + sum(comm.values())
    return {"compute_s": compute, "comm_s_by_axis": comm, "step_s": step,
            "mfu": 6 * N * tokens / (step * n * spec.peak_flops)}
