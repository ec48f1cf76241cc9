"""What an XLA:GPU program does, read from its optimized HLO: collectives by kind, mesh axes, dtype and whether they
run async; the fp8 dots and the kernels they became; the attention kernel.

The text is ``compiled.as_text()`` of a step compiled for GPU devices (:func:`jaxpar.plan.gpu_target`). XLA:GPU
turns a ``dot`` into a Triton GEMM fusion (``backend_config`` kind ``__triton_gemm`` or
``__triton_nested_gemm_fusion``) or a cuBLAS / cuBLASLt call (``custom_call_target`` ``__cublas$gemm``,
``__cublas$lt$matmul``, ``__cublas$lt$matmul$f8`` for fp8); an fp8 dot left in any other fusion is computed by a
generic kernel (not on the fp8 tensor cores). cuDNN's fused attention is a ``custom-call`` whose target names
``cudnn`` and ``fmha`` (``__cudnn$fmhaSoftmax``, ``__cudnn$fmhaSoftmaxBackward``, ...).
"""

from __future__ import annotations

import re
from collections import defaultdict

from jaxpar import _hlo

_FP8_TYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz", "f8e3m4")
_TRITON_GEMMS = ("__triton_gemm", "__triton_nested_gemm_fusion")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


def is_fp8(dtype: str) -> bool:
    """Whether an HLO element type is an 8-bit float (a GEMM on the fp8 tensor cores takes these)."""
    return dtype in _FP8_TYPES


def collectives(text: str, mesh_shape: dict[str, int]) -> list[dict]:
    """Collective bytes per step grouped by ``kind``, ``axes`` (``"+"``-joined), ``dtype`` (the operands' element
    types) and ``async`` (an XLA:GPU ``-start``/``-done`` pair), largest first; ``bytes`` the payload summed over
    the executions (loops by trip count), ``count`` the executions. Scalar reductions (loss, metrics) included.

    Raises:
      ValueError: as :func:`jaxpar._hlo.analyze`.
    """
    out: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in _hlo.collective_sites(text, mesh_shape):
        if not s.axes:
            continue
        key = (s.kind, "+".join(s.axes), "/".join(s.dtypes), s.is_async)
        out[key][0] += s.bytes * s.runs
        out[key][1] += s.runs
    rows = [dict(kind=k, axes=a, dtype=d, is_async=x, bytes=b, count=n) for (k, a, d, x), (b, n) in out.items()]
    return sorted(rows, key=lambda r: -r["bytes"])


def fusion_kinds(comps: dict[str, list[_hlo.Instr]]) -> dict[str, str]:
    """``{fused computation: its fusion's kind}`` (the ``backend_config`` kind, else the ``kind=kLoop`` attribute)."""
    kinds = {}
    for instrs in comps.values():
        for i in instrs:
            if i.opcode != "fusion":
                continue
            m = re.search(r'"kind"\s*:\s*"([^"]+)"', i.attrs) or re.search(r"\bkind=(\w+)", i.attrs)
            for _, callee in _hlo.callees(i):
                kinds[callee] = m.group(1) if m else ""
    return kinds


def dots(text: str) -> dict:
    """The program's matmuls: ``{"dots", "fp8_dots", "fp8_triton_gemms", "fp8_cublaslt_gemms", "fp8_other",
    "flops", "fp8_flops"}`` with dots counted per execution (loops by trip count) and FLOPs as
    :mod:`jaxpar._hlo` counts them; ``fp8_other`` are fp8 dots not in a GEMM kernel (a generic fusion upcasts
    them)."""
    comps, entry = _hlo.parse_module(text)
    runs = _hlo.runs_per_computation(comps, entry)
    kinds = fusion_kinds(comps)
    out = dict.fromkeys(("dots", "fp8_dots", "fp8_triton_gemms", "fp8_cublaslt_gemms", "fp8_other", "flops",
                         "fp8_flops"), 0.0)
    for name, instrs in comps.items():
        if name not in runs:
            continue
        shapes = {i.name: i.shape for i in instrs}
        n = runs[name][0]
        for i in instrs:
            if i.opcode != "dot" and not _hlo.is_gemm_call(i):
                continue
            flops = _hlo.dot_flops(i, shapes) * n
            types = {d for o in i.operands[:2] for d, _ in _hlo.array_dims(shapes.get(o, ""))}
            out["dots"] += n
            out["flops"] += flops
            if not any(is_fp8(t) for t in types):
                continue
            out["fp8_dots"] += n
            out["fp8_flops"] += flops
            if i.opcode == "custom-call":
                out["fp8_cublaslt_gemms"] += n
            elif kinds.get(name) in _TRITON_GEMMS:
                out["fp8_triton_gemms"] += n
            else:
                out["fp8_other"] += n
    return out


def attention_kernel(text: str) -> str:
    """``"cuDNN fused attention (N calls)"`` when the program calls cuDNN's fused attention, else ``"XLA (no
    fused attention kernel: its matmuls and softmax are separate fusions)"``."""
    targets = [t for t in _TARGET.findall(text) if "cudnn" in t.lower() and "fmha" in t.lower()]
    if targets:
        return f"cuDNN fused attention ({len(targets)} calls: {', '.join(sorted(set(targets)))})"
    return "XLA (no fused attention kernel: its matmuls and softmax are separate fusions)"


__all__ = ["attention_kernel", "collectives", "dots", "fusion_kinds", "is_fp8"]
