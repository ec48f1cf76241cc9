"""The planner's view of a mixture of experts: parameters (all experts, the active ones), expert weights per device
at each expert-parallel size, the expert-parallel dispatch's bytes over the expert axes, the experts' matmul FLOPs
(the useful, active ones; what the capacity buffers and ``ragged_dot``'s lowering compute), and what a compiled
program made of them.

Counts come from the model config (``LlamaConfig`` / ``FamilyConfig`` with ``moe``: ``num_params()`` counts every
expert, ``active_params()`` the ``k`` routed experts a token runs and the shared ones). Notation: ``E`` routed
experts, ``k`` per token, ``D`` the model width, ``F`` one expert's SwiGLU width, ``n`` the expert-parallel size,
``E_l = E / n`` the experts a device holds, ``T`` the tokens a device holds per microbatch (``B L / (data fsdp
context)``), ``c`` the compute dtype's bytes. Payloads are counted as :mod:`jaxpar._hlo` counts a collective: an
all-gather's output, a reduce-scatter's or all-to-all's input (the full buffer), per device, per MoE layer.

**Ring dispatch** (:mod:`jaxpar.layers.expert_parallel`): forward, one all-gather over the expert axes of the
tokens and their routing, ``n T (D c + 4 k + 4 k [+ 4 k slots in capacity mode])`` (activations, float32
weights, int32 experts), and one reduce-scatter of the float32 outputs ``4 n T D``; backward, their transposes:
an all-gather of the outputs' cotangent ``n T D c`` and a reduce-scatter of the tokens' and weights' cotangents
``n T (4 D + 4 k)``, float32 whatever the compute dtype (``jaxpar._compat.all_gather_16bit_safe``: a 16-bit
reduction inside the partial-manual region aborts XLA:CPU). (The cotangent arrives in the compute dtype and jax gathers it as float32; XLA moves the
conversion after the gather, so the wire carries ``c`` bytes an element, as counted; with ``c = 4`` the same.)
**All-to-all dispatch**, dropless: each destination's buffer holds every local choice (the worst case), so each
all-to-all moves ``n T k D c``; forward two (out and back) plus the int32 experts ``4 n T k``, backward two; in
capacity mode the GShard buffers ``[T / L_g, E, C, D]`` (``L_g`` the tokens of a capacity group, ``C =
ceil(capacity_factor L_g k / E)``), two forward, two backward. ``n = 1``: no dispatch traffic. ``remat="full"``
recomputes the forward in the backward, so the forward's collectives run twice.

**FLOPs** of the routed experts' three matmuls per device and layer, forward: useful ``6 T k D F`` (each of the
``T k`` choices through ``D x F``, ``D x F`` and ``F x D``; a train step 3 times that); capacity buffers ``6
(T / L_g) E C D F`` (``capacity_factor`` times the useful, plus rounding); the dropless ``ragged_dot`` as XLA
lowers it on CPU and (jaxlib 0.10.2) on GPU: one dense matmul of a block-masked copy of the rows ``[R, E_l D]``
against the weights flattened ``[E_l D, F]`` (the down projection a batched ``[E_l, R, F] x [E_l, F, D]``), with
``R = n T k`` rows in the ring (every gathered choice; another device's sort last, outside every group) and ``R =
n T k`` in the all-to-all's worst-case buffers: ``E_l n = E`` times the useful FLOPs, whatever ``n``.

**What ragged_dot lowers to on GPU** (XLA:GPU for compile-only H100s, jaxlib 0.10.2, read from the MoE Llama's
train step by :func:`expert_dots`; ``benchmarks/README.md``): no grouped-GEMM kernel (no custom call); every
``ragged_dot`` of the forward and backward is a loop fusion that writes the masked ``[R, E_l D]`` expansion (an
iota / compare / select per group, then a transpose) and a dense Triton GEMM over it, so the experts' matmuls
do ``E`` times the useful FLOPs (8x for 8 experts, measured at expert-parallel 2, 4 and 8, forward and backward)
and write ``E_l`` times the rows' bytes. The capacity form is dense batched Triton GEMMs over ``[groups, E_l, C,
D]`` buffers: ``capacity_factor`` times the useful FLOPs, no ragged op.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from jaxpar import _hlo
from jaxpar._validate import positive_int
from jaxpar.layers.moe import param_axes, param_shapes
from jaxpar.plan.gpu_program import fusion_kinds
from jaxpar.sharding.experts import expert_parallel_rules
from jaxpar.sharding.names import EXPERTS, FSDP, Rules
from jaxpar.sharding.rules import DEFAULT_RULES

# op_name metadata of the experts' matmuls in a compiled program: jax.lax.ragged_dot (dropless) and the capacity
# buffers' batched einsums (jaxpar.layers.expert_parallel.swiglu_buffers)
_RAGGED = "ragged_dot"
_BUFFER_EINSUMS = ("ecd,edf->", "ecf,efd->")


def _moe(cfg: Any):
    moe = getattr(cfg, "moe", None)
    if moe is None:
        raise ValueError(f"{type(cfg).__name__} has no mixture of experts (moe=None): the expert plan needs a "
                         "config with moe=jaxpar.layers.moe.MoEConfig(...)")
    return moe


def _widths(cfg: Any) -> tuple[int, int]:
    moe = cfg.moe
    f_e = moe.expert_width(cfg.mlp_dim)
    return f_e, moe.shared_width(cfg.mlp_dim)


def param_counts(cfg: Any) -> dict[str, int]:
    """Parameters of a model config with ``moe``: ``total`` (every expert; ``cfg.num_params()``), ``active``
    (``cfg.active_params()``: ``k`` routed experts and the shared ones), ``routed_experts`` (all layers' ``E``
    experts, ``3 D F`` each), ``active_routed`` (``k`` of them), ``router`` (``D E`` a layer), ``shared`` (the
    shared experts), ``rest`` (attention, norms, embeddings).

    Raises:
      ValueError: ``cfg.moe`` is None.
    """
    moe = _moe(cfg)
    N, D = cfg.num_layers, cfg.d_model
    f_e, f_s = _widths(cfg)
    routed, router, shared = N * moe.num_experts * 3 * D * f_e, N * D * moe.num_experts, N * 3 * D * f_s
    total = int(cfg.num_params())
    return {"total": total, "active": int(cfg.active_params()), "routed_experts": routed,
            "active_routed": N * moe.experts_per_token * 3 * D * f_e, "router": router, "shared": shared,
            "rest": total - routed - router - shared}


class _Sizes:
    """A mesh's axis sizes and names, as :mod:`jaxpar.sharding.experts` reads a mesh (no devices needed)."""

    def __init__(self, sizes: dict[str, int]):
        self.shape = dict(sizes)
        self.axis_names = tuple(sizes)


def expert_rules(sizes: dict[str, int], expert_parallel: int, rules: Any = DEFAULT_RULES) -> Rules:
    """``jp.sharding.expert_parallel_rules`` for a mesh of ``sizes`` (no devices needed).

    Raises:
      ValueError: as ``expert_parallel_rules`` (no fold of that size onto the batch axes).
    """
    return expert_parallel_rules(_Sizes(sizes), expert_parallel, Rules(rules))


def expert_memory(cfg: Any, sizes: dict[str, int], expert_parallel: tuple[int, ...] = (1, 2, 4, 8), *,
                  param_bytes: int = 4, rules: Any = DEFAULT_RULES) -> dict[int, dict]:
    """Per-device bytes of the routed experts' weights (all layers) at each expert-parallel size that folds onto
    the mesh ``sizes`` (others left out): ``{n: {"axes", "bytes", "total_bytes", "split"}}``.

    The experts' dim goes over the fold's axes (``n`` ways), ``embed`` over ``fsdp`` unless ``fsdp`` is one of
    them, each expert's hidden dim over ``tensor`` (``expert_mlp``): ``bytes = total_bytes / split`` with
    ``total_bytes = 3 N E D F param_bytes``, ``split = n * fsdp (when not an expert axis) * tensor``.
    """
    moe = _moe(cfg)
    N, D = cfg.num_layers, cfg.d_model
    f_e, _ = _widths(cfg)
    shapes, names = param_shapes(moe, D, f_e), param_axes(moe)
    out = {}
    for n in expert_parallel:
        try:
            r = expert_rules(sizes, n, rules).without_absent(_Sizes(sizes))
        except ValueError:
            continue
        total = per_device = 0.0
        for key in ("experts_gate_kernel", "experts_up_kernel", "experts_down_kernel"):
            spec = r.spec(names[key])
            split = math.prod(sizes[a] for entry in spec if entry for a in ((entry,) if isinstance(entry, str)
                                                                             else entry))
            full = N * math.prod(shapes[key]) * param_bytes
            total, per_device = total + full, per_device + full / split
        out[n] = {"axes": r.mesh_axes(EXPERTS), "bytes": per_device, "total_bytes": total,
                  "split": total / per_device}
    return out


def tokens_per_device(sizes: dict[str, int], global_batch: int, seq_len: int, grad_accum_steps: int = 1) -> float:
    """``T``: tokens a device holds per microbatch, ``B L / (data fsdp context k_acc)``."""
    split = sizes.get("data", 1) * sizes.get(FSDP, 1) * sizes.get("context", 1) * grad_accum_steps
    return global_batch * seq_len / split


def dispatch_bytes(moe: Any, d_model: int, tokens: float, expert_parallel: int, *, compute_bytes: int = 2,
                   group_len: int | None = None) -> dict[str, dict[str, float]]:
    """The dispatch's collective payload bytes over the expert axes per device and MoE layer (module docstring):
    ``{"forward": {kind: bytes}, "backward": {kind: bytes}}`` for ``moe.dispatch`` (``"ring"`` or
    ``"all_to_all"``), ``tokens`` = ``T`` per device, ``compute_bytes`` = ``c``, ``group_len`` the tokens of a
    capacity group (capacity mode; default ``T``).

    Raises:
      ValueError: capacity mode with a ``group_len`` that does not divide the ``n T`` gathered tokens.
    """
    n, T, k, D, c = expert_parallel, float(tokens), moe.experts_per_token, d_model, compute_bytes
    if n == 1:
        return {"forward": {}, "backward": {}}
    capacity = moe.capacity_factor is not None
    if moe.dispatch == "ring":
        gathered = n * T * (D * c + 8 * k + (4 * k if capacity else 0))
        return {"forward": {"all-gather": gathered, "reduce-scatter": 4 * n * T * D},
                "backward": {"all-gather": n * T * D * c, "reduce-scatter": n * T * (D * 4 + 4 * k)}}
    if not capacity:
        rows = n * T * k * D * c
        return {"forward": {"all-to-all": 2 * rows + 4 * n * T * k}, "backward": {"all-to-all": 2 * rows}}
    L = group_len or T
    if T % L:
        raise ValueError(f"group_len={L} does not divide the {T:g} tokens of a device")
    buffers = T / L * moe.num_experts * moe.capacity(L) * D * c
    return {"forward": {"all-to-all": 2 * buffers}, "backward": {"all-to-all": 2 * buffers}}


def expert_flops(moe: Any, d_model: int, d_mlp: int, tokens: float, expert_parallel: int = 1, *,
                 group_len: int | None = None) -> dict[str, float]:
    """Forward FLOPs of the routed experts' matmuls per device and MoE layer (module docstring): ``useful``
    (``6 T k D F``: the active ones), ``capacity`` (the GShard buffers, when ``capacity_factor`` is set; groups
    of ``group_len`` tokens, default ``T``), ``ragged_lowered`` (``ragged_dot`` as XLA lowers it, dropless:
    ``E`` times the useful). A train step computes about 3 times these."""
    k, E, D, F = moe.experts_per_token, moe.num_experts, d_model, moe.expert_width(d_mlp)
    T = float(tokens)
    out = {"useful": 6 * T * k * D * F, "ragged_lowered": 6 * T * k * D * F * E}
    if moe.capacity_factor is not None:
        L = group_len or T
        out["capacity"] = 6 * (T / L) * E * moe.capacity(int(L)) * D * F
    del expert_parallel   # E_l n = E: the lowered ragged FLOPs do not change with the expert-parallel size
    return out


def moe_plan(cfg: Any, sizes: dict[str, int], global_batch: int, seq_len: int, expert_parallel: int = 1, *,
             grad_accum_steps: int = 1) -> dict:
    """The analytic expert plan of a layout: ``{"params", "memory", "dispatch", "flops"}`` per device, per step
    (``dispatch`` and ``flops`` summed over the ``num_layers`` MoE layers and ``grad_accum_steps``
    microbatches; ``dispatch["total"]`` forward (twice under ``remat="full"``) plus backward; ``flops`` the
    forward's; capacity groups are sequences of ``seq_len``; ``memory`` in the config's ``param_dtype``).

    Raises:
      ValueError: ``cfg.moe`` is None; an ``expert_parallel`` that does not fold onto ``sizes``' batch axes.
    """
    moe = _moe(cfg)
    expert_rules(sizes, expert_parallel)   # the fold exists, or its error
    T = tokens_per_device(sizes, global_batch, seq_len, grad_accum_steps)
    c = np.dtype(cfg.dtype or np.float32).itemsize
    per_layer = dispatch_bytes(moe, cfg.d_model, T, expert_parallel, compute_bytes=c, group_len=seq_len)
    layers = cfg.num_layers * grad_accum_steps
    forward_runs = 2 if cfg.remat == "full" else 1
    dispatch = {phase: {kind: b * layers for kind, b in kinds.items()} for phase, kinds in per_layer.items()}
    dispatch["total"] = (forward_runs * sum(dispatch["forward"].values()) + sum(dispatch["backward"].values()))
    flops = {key: v * layers for key, v in expert_flops(moe, cfg.d_model, cfg.mlp_dim, T, expert_parallel,
                                                        group_len=seq_len).items()}
    return {"params": param_counts(cfg), "expert_parallel": expert_parallel, "tokens_per_device": T,
            "memory": expert_memory(cfg, sizes, param_bytes=np.dtype(cfg.param_dtype or np.float32).itemsize),
            "dispatch": dispatch, "flops": flops}


def expert_dots(text: str) -> dict:
    """The experts' matmuls in a compiled program (XLA:CPU or XLA:GPU), found by their ``op_name``:
    ``{"ragged": [...], "capacity": [...], "ragged_flops", "capacity_flops", "grouped_gemm_calls"}``. Each row
    ``{"computation", "shape", "operands", "flops", "runs", "backward", "kernel"}`` (FLOPs as
    :func:`jaxpar._hlo.dot_flops`, times the runs of its computation; ``backward`` whether jax's transpose made it;
    ``kernel`` the fusion kind running it, e.g. ``__triton_nested_gemm_fusion`` on GPU); ``grouped_gemm_calls`` the
    custom calls whose target names a grouped or ragged GEMM (none: ``ragged_dot`` became dense dots).

    Read GPU programs with it: XLA:GPU keeps every dot's ``op_name``. On XLA:CPU jax decomposes ``ragged_dot``
    before XLA sees it (its dots are named ``dot_general``), and XLA:CPU's passes drop the metadata of many dots
    of a whole train step (the capacity buffers' among them), so a CPU program's rows are incomplete."""
    comps, entry = _hlo.parse_module(text)
    runs = _hlo.runs_per_computation(comps, entry)
    kernels = fusion_kinds(comps)
    out: dict[str, Any] = {"ragged": [], "capacity": []}
    for name, instrs in comps.items():
        if name not in runs:
            continue
        shapes = {i.name: i.shape for i in instrs}
        for i in instrs:
            if i.opcode != "dot" and not _hlo.is_gemm_call(i):
                continue
            op = _hlo.op_name(i)
            kind = "ragged" if _RAGGED in op else "capacity" if any(e in op for e in _BUFFER_EINSUMS) else None
            if kind is None:
                continue
            out[kind].append({"computation": name, "shape": i.shape.split("{")[0],
                              "operands": [shapes.get(o, "").split("{")[0] for o in i.operands[:2]],
                              "flops": _hlo.dot_flops(i, shapes) * runs[name][0], "runs": runs[name][0],
                              "backward": "transpose(" in op, "kernel": kernels.get(name, "")})
    out["ragged_flops"] = sum(r["flops"] for r in out["ragged"])
    out["capacity_flops"] = sum(r["flops"] for r in out["capacity"])
    targets = re.findall(r'custom_call_target="([^"]*)"', text)
    out["grouped_gemm_calls"] = sorted({t for t in targets if "ragged" in t.lower() or "group" in t.lower()})
    return out


def dispatch_collectives(text: str, mesh_shape: dict[str, int], expert_axes: tuple[str, ...]) -> dict[str, float]:
    """Collective payload bytes per step over exactly ``expert_axes`` by kind, read from a compiled program
    (:func:`jaxpar._hlo.collective_sites`; scalars left out): what :func:`dispatch_bytes` predicts, plus any
    other traffic on those axes (FSDP's weight gathers when ``fsdp`` is an expert axis)."""
    out: dict[str, float] = {}
    for s in _hlo.collective_sites(text, mesh_shape):
        if s.axes == tuple(expert_axes) and not s.scalar:
            out[s.kind] = out.get(s.kind, 0.0) + s.bytes * s.runs
    return out




def flop_params(cfg: Any) -> float:
    """The parameters a token's ``6 N`` training FLOPs count: ``cfg.active_params()`` for a mixture of experts (k
    routed experts, not all E), else ``cfg.num_params()``."""
    return float(cfg.active_params() if getattr(cfg, "moe", None) is not None else cfg.num_params())


def check_experts(cfg: Any, sizes: dict[str, int], expert_parallel: int) -> None:
    """Raises ValueError (before tracing) for an ``expert_parallel`` size a plan cannot build: not a positive int,
    above 1 for a model without experts, not dividing ``num_experts``, or not a fold onto ``sizes``' batch axes
    (the message of ``jp.sharding.expert_parallel_rules``, naming the sizes that work)."""
    positive_int("expert_parallel", expert_parallel, " (1: every device holds every expert)")
    if expert_parallel == 1:
        return
    moe = getattr(cfg, "moe", None)
    if moe is None:
        raise ValueError(f"expert_parallel={expert_parallel} but {type(cfg).__name__} has no experts (moe=None); "
                         "use expert_parallel=1 or a config with moe=jaxpar.layers.moe.MoEConfig(...)")
    if moe.num_experts % expert_parallel:
        raise ValueError(f"num_experts={moe.num_experts} is not divisible by expert_parallel={expert_parallel}; "
                         "choose an expert-parallel size dividing the experts")
    expert_rules(sizes, expert_parallel)


def compiled_experts(cfg: Any, sizes: dict[str, int], global_batch: int, seq_len: int, expert_parallel: int,
                     grad_accum_steps: int, text: str, gpu: bool) -> dict | None:
    """A plan's ``experts`` entry (None for a dense model): :func:`moe_plan` with ``compiled``, what the compiled
    program ``text`` holds: ``dispatch`` (:func:`dispatch_collectives` over the expert axes) and, for a ``gpu``
    program, ``dots`` (:func:`expert_dots`; None for an XLA:CPU one, whose dots lose their names)."""
    if getattr(cfg, "moe", None) is None:
        return None
    out = moe_plan(cfg, sizes, global_batch, seq_len, expert_parallel, grad_accum_steps=grad_accum_steps)
    axes = expert_rules(sizes, expert_parallel).mesh_axes(EXPERTS)
    axes = tuple(a for a in axes if sizes.get(a, 1) > 1)
    out["compiled"] = {"dots": expert_dots(text) if gpu else None,
                       "dispatch": dispatch_collectives(text, sizes, axes) if axes else {}}
    return out


def report_line(experts: dict) -> str:
    """One line of a plan's report: parameters, expert weights per device, dispatch bytes, experts' FLOPs."""
    p, f, d = experts["params"], experts["flops"], experts["dispatch"]
    mem = experts["memory"].get(experts["expert_parallel"])
    dots = experts.get("compiled", {}).get("dots")
    lowered = "".join(f"; compiled {kind} dots {dots[kind + '_flops']:.3e} FLOPs ("
                      f"{dots[kind + '_flops'] / (3 * f['useful']):.2f} x the useful train FLOPs)"
                      for kind in ("ragged", "capacity") if dots and dots[kind])
    return (f"  experts: {p['total'] / 1e6:.4g}M params, {p['active'] / 1e6:.4g}M active; EP "
            f"{experts['expert_parallel']}: expert weights {(mem or {}).get('bytes', float('nan')) / 2**30:.3g} "
            f"GiB/device; dispatch {d['total'] / 2**30:.3g} GiB/step/device; useful expert FLOPs (forward) "
            f"{f['useful']:.3e}{lowered}")


__all__ = ["check_experts", "compiled_experts", "dispatch_bytes", "dispatch_collectives", "expert_dots",
           "expert_flops", "expert_memory", "expert_rules", "flop_params", "moe_plan", "param_counts", "report_line",
           "tokens_per_device"]
