"""GPU defaults: XLA flags for compute/communication overlap, and float32 matmul precision (TF32 on or off).

``apply_gpu_defaults()`` is called first thing by the experiments (before ``jax.distributed`` or any device
use: XLA reads ``XLA_FLAGS`` once, when its GPU backend starts). On anything but a GPU it changes nothing.
Flags already in ``XLA_FLAGS`` win: a flag the user set is never overridden, only missing ones are added.

The flags (each checked against the flag table of the jaxlib it runs with: an unknown name makes XLA abort
at startup, so ``tests/test_gpu.py`` starts a CPU process with all of them, which parses the same table):

=============================================================  ==================================================
flag                                                           why (source)
=============================================================  ==================================================
``--xla_gpu_enable_latency_hiding_scheduler=true``             schedules async collectives early and their ends
                                                               late so NCCL runs under compute [1][2][3]
``--xla_gpu_all_reduce_combine_threshold_bytes=134217728``     combine small all-reduces (per-layer gradient
                                                               reductions) into 128 MiB NCCL calls: fewer
                                                               launches, full bandwidth [2][3]
``--xla_gpu_all_gather_combine_threshold_bytes=134217728``     same for FSDP's per-layer parameter gathers [2][3]
``--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864``  same for FSDP's gradient reduce-scatters [3]
``--xla_gpu_enable_all_gather_combine_by_dim=false``           combine gathers of different shapes too [2][3]
``--xla_gpu_enable_reduce_scatter_combine_by_dim=false``       same for reduce-scatters [2][3]
``--xla_gpu_enable_pipelined_all_gather=true``                 in a scanned layer loop, gather layer i+1's
                                                               params while layer i computes (FSDP) [2][3]
``--xla_gpu_enable_pipelined_reduce_scatter=true``             reduce-scatter layer i's gradients during the
                                                               next layer's backward [2][3]
``--xla_gpu_enable_pipelined_all_reduce=true``                 same for all-reduces [2][3]
``--xla_gpu_enable_while_loop_double_buffering=true``          unrolls loops by two so the pipelined
                                                               collectives above have a slot to overlap [2][3]
``--xla_gpu_threshold_for_windowed_einsum_mib=0``              collective matmul (only with
``--xla_gpu_multi_streamed_windowed_einsum=true``              ``collective_matmul=True``): split a
                                                               tensor-parallel matmul and its all-gather /
                                                               reduce-scatter into chunks that overlap [2][4]
=============================================================  ==================================================

Collective matmul is opt-in (the experiments turn it on when ``tensor > 1``): it only applies to
tensor-parallel matmuls, and with threshold 0 it rewrites every such matmul, which users report can cost
throughput on small ones; XLA's default threshold (100000 MiB) leaves it off.

Matmul precision (``jax_default_matmul_precision``) for float32 inputs [1]: ``"tf32"`` (``tensorfloat32``:
10-bit mantissa inputs on the tensor cores, Ampere and later), ``"fp32"`` (``float32``: full precision, TF32
off), ``"bf16"`` (``bfloat16``), ``None`` / ``"default"``: JAX's default left alone (``DEFAULT`` precision, which
XLA:GPU runs as TF32 on Ampere and later). bfloat16 / float16 matmuls (``jp.precision.Policy`` mixed precision) are
not affected.

Sources: [1] JAX, "GPU performance tips" (docs.jax.dev/en/latest/gpu_performance_tips.html);
[2] NVIDIA JAX-Toolbox, "GPU performance" (rosetta/docs/GPU_performance.md, docs.nvidia.com/jax-toolbox);
[3] MaxText's GPU end-to-end scripts (tests/end_to_end/gpu/a3/test_convergence_125m_params.sh, XLA_ARGS);
[4] openxla/xla discussion #8865, "collective matmul" on GPU (windowed einsum in the SPMD partitioner).

Detecting a GPU without starting JAX's backends (first match wins): the ``platform`` argument; else
``JAX_PLATFORMS`` when set (its first entry: ``cuda``/``gpu``/``rocm`` is a GPU, anything else is not);
else a GPU when a jax CUDA (or ROCm) plugin is installed, the driver's device node exists (``/dev/nvidiactl``
resp. ``/dev/kfd``) and ``CUDA_VISIBLE_DEVICES`` does not hide every device (``""`` or ``-1``).
"""

from __future__ import annotations

import dataclasses
import os
import pkgutil
import re
import warnings

import jax

from jaxpar import _compat

COMBINE_THRESHOLD_BYTES = 128 * 1024 * 1024

OVERLAP_FLAGS: dict[str, str] = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_all_reduce_combine_threshold_bytes": str(COMBINE_THRESHOLD_BYTES),
    "xla_gpu_all_gather_combine_threshold_bytes": str(COMBINE_THRESHOLD_BYTES),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(COMBINE_THRESHOLD_BYTES // 2),
    "xla_gpu_enable_all_gather_combine_by_dim": "false",
    "xla_gpu_enable_reduce_scatter_combine_by_dim": "false",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
}

COLLECTIVE_MATMUL_FLAGS: dict[str, str] = {
    "xla_gpu_threshold_for_windowed_einsum_mib": "0",
    "xla_gpu_multi_streamed_windowed_einsum": "true",
}

# --matmul-precision choice -> jax_default_matmul_precision value (None: leave JAX's default)
MATMUL_PRECISIONS: dict[str, str | None] = {"default": None, "tf32": "tensorfloat32", "fp32": "float32",
                                            "bf16": "bfloat16"}

_GPU_PLATFORMS = ("cuda", "gpu", "rocm")


@dataclasses.dataclass(frozen=True)
class GpuDefaults:
    """What :func:`apply_gpu_defaults` did.

    Attributes:
      platform: ``"gpu"`` or the platform seen (``"cpu"``, ``"tpu"``, ``None`` when undetected: not a GPU).
      flags: the flags added to ``XLA_FLAGS`` (name -> value); empty off GPU.
      kept: the flags of ours the user had already set (name -> the user's value), left as they were.
      matmul_precision: the ``jax_default_matmul_precision`` value set, or None when untouched.
    """
    platform: str | None
    flags: dict[str, str]
    kept: dict[str, str]
    matmul_precision: str | None

    @property
    def applied(self) -> bool:
        return self.platform == "gpu"


def detect_platform(platform: str | None = None, environ: dict[str, str] | None = None) -> str | None:
    """``"gpu"``, another platform name, or None, without initializing JAX (rule: module docstring).

    Args:
      platform: an explicit platform (``"gpu"``, ``"cuda"``, ``"rocm"``, ``"cpu"``, ``"tpu"``; case-insensitive).
      environ: the environment to read (default ``os.environ``).

    Raises:
      ValueError: ``platform`` not a non-empty string.
    """
    env = os.environ if environ is None else environ
    if platform is not None:
        if not isinstance(platform, str) or not platform.strip():
            raise ValueError(f"platform={platform!r}: pass 'gpu', 'cpu', 'tpu' (or None to detect)")
        name = platform.strip().lower()
        return "gpu" if name in _GPU_PLATFORMS else name
    platforms = env.get("JAX_PLATFORMS", "").strip()
    if platforms:
        first = platforms.split(",")[0].strip().lower()
        return "gpu" if first in _GPU_PLATFORMS else first
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return None
    plugins = _gpu_plugins()
    if ("cuda" in plugins and os.path.exists("/dev/nvidiactl")) or ("rocm" in plugins and os.path.exists("/dev/kfd")):
        return "gpu"
    return None


def _gpu_plugins() -> set[str]:
    """``{"cuda", "rocm"}`` or a subset: the kinds of jax GPU plugin installed (``jax_cuda12_plugin``, ...),
    found by module name only (nothing is imported)."""
    found = set()
    for module in pkgutil.iter_modules():
        match = re.fullmatch(r"jax_(cuda|rocm)\d*_plugin", module.name)
        if match:
            found.add(match.group(1))
    return found


def parse_xla_flags(text: str) -> dict[str, str]:
    """``XLA_FLAGS`` text -> ``{name: value}`` (``--name`` alone gives ``""``; the last occurrence wins)."""
    flags = {}
    for token in text.split():
        match = re.fullmatch(r"--([A-Za-z0-9_]+)(?:=(.*))?", token)
        if match:
            flags[match.group(1)] = match.group(2) or ""
    return flags


def gpu_flags(collective_matmul: bool = False) -> dict[str, str]:
    """The flags :func:`apply_gpu_defaults` adds on a GPU (name -> value), before the user's flags win."""
    return {**OVERLAP_FLAGS, **(COLLECTIVE_MATMUL_FLAGS if collective_matmul else {})}


def apply_gpu_defaults(platform: str | None = None, *, matmul_precision: str | None = None,
                       collective_matmul: bool = False) -> GpuDefaults:
    """On a GPU: adds the overlap flags to ``XLA_FLAGS`` and sets the float32 matmul precision; else nothing.

    Call it before anything starts JAX's backends (``jax.devices()``, ``jax.distributed.initialize``, any
    computation); importing jax is fine. Idempotent: flags already present are not added again.

    Args:
      platform: force the platform (``"gpu"``, ``"cpu"``, ...); None detects it (module docstring).
      matmul_precision: ``"default"`` / None (leave JAX's), ``"tf32"``, ``"fp32"`` (TF32 off) or ``"bf16"``.
      collective_matmul: also add the windowed-einsum flags (worth it with a tensor axis > 1).

    Returns:
      A :class:`GpuDefaults`: the platform, the flags added, the user's flags kept, the precision set.

    Raises:
      ValueError: an unknown ``matmul_precision`` or ``platform``.

    Warns:
      RuntimeWarning: on a GPU, when JAX's backends already started (XLA_FLAGS is no longer read): no flags
        are added (``flags`` is empty); the matmul precision, a JAX option, is still set.
    """
    if matmul_precision is not None and matmul_precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision={matmul_precision!r}: use one of {', '.join(MATMUL_PRECISIONS)} "
                         "(or None)")
    found = detect_platform(platform)
    if found != "gpu":
        return GpuDefaults(found, {}, {}, None)
    user = parse_xla_flags(os.environ.get("XLA_FLAGS", ""))
    wanted = gpu_flags(collective_matmul)
    added = {k: v for k, v in wanted.items() if k not in user}
    kept = {k: user[k] for k in wanted if k in user}
    if added and _compat.backends_initialized():  # XLA read XLA_FLAGS already: adding them would be a no-op
        warnings.warn("jp.gpu.apply_gpu_defaults() ran after JAX's backends started, so XLA no longer reads "
                      "XLA_FLAGS and the overlap flags are not applied; call it first thing in the program, before "
                      "jax.devices() or any computation", RuntimeWarning, stacklevel=2)
        added = {}
    if added:
        extra = " ".join(f"--{k}={v}" for k, v in added.items())
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {extra}".strip()
    precision = MATMUL_PRECISIONS[matmul_precision or "default"]
    if precision is not None:
        jax.config.update("jax_default_matmul_precision", precision)
    return GpuDefaults("gpu", added, kept, precision)


__all__ = ["GpuDefaults", "apply_gpu_defaults", "detect_platform", "gpu_flags"]
