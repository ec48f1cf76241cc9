"""A step time read off XLA:GPU's optimized, scheduled HLO: every kernel against the GPU's peaks, every collective
by NCCL's cost model, async collectives overlapped with the kernels the scheduler put between their start and end.

:func:`scheduled_time` replays a compiled program (``compiled.as_text()`` of a step compiled for GPU devices,
e.g. :func:`jaxpar.plan.gpu_target`'s) in its printed order, which for XLA:GPU is the order the latency-hiding
scheduler chose. Two streams per device:

* **compute**: each top-level instruction that is not a collective (a fusion, a cuBLAS call, a copy) is one kernel
  taking ``max(FLOPs / peak, bytes / HBM bandwidth)`` (the roofline of one kernel: Williams et al., "Roofline",
  CACM 2009). FLOPs are its dots' (:mod:`jaxpar._hlo`: ``2 m n k``, fp8 included); the peak is the dense fp8 one
  when a dot's operands are 8-bit floats, else the dense bf16 one; bytes are its operands and output (a fusion's
  slices and in-place updates only what they touch, as :mod:`jaxpar._hlo` counts "bytes accessed").
* **communication**: a collective takes NCCL's modelled time (``ncclTopoGetAlgoTime`` in NCCL's
  ``src/graph/tuning.cc``, Simple protocol): ``latency + S / algbw`` with ``S`` the payload (:mod:`jaxpar._hlo`:
  an all-gather's output, a reduce-scatter's input), ring ``algbw = busbw n / nsteps`` (``nsteps``: all-reduce
  ``2 (n - 1)``, all-gather / reduce-scatter ``n - 1``, all-to-all ``n``, permute 1) with latency ``8.4 us +
  (nsteps - inter) 3.4 us + inter 9.6 us`` (``inter`` the steps that cross hosts: ``2 (hosts - 1)`` for an
  all-reduce, ``hosts - 1`` for the others); an all-reduce takes the faster of ring and tree (tree: ``algbw =
  busbw / 2``, latency ``2 ((n / hosts - 1) 28 us + log2(hosts) 50 us)``). ``busbw`` is the GPU's NVLink
  bandwidth per direction when the group lies in one host, its InfiniBand bandwidth when the group spans
  hosts (the ring's slowest links; one NIC per GPU). Which device sits on which host is the device assignment's
  (``host_of``: a compile-only GPU device's ``process_index``).

A ``*-start`` launches its collective on the communication stream (after the previous one ends) and
returns; its ``*-done`` waits for it: the kernels scheduled in between hide it. A synchronous collective
waits for the stream and then runs with the compute stream idle. A ``while`` body takes its trip count times
its own replay (XLA's ``known_trip_count``), a ``conditional`` its slowest branch, a ``call`` its callee.

Assumptions (all optimistic except the last): every kernel reaches the datasheet's dense peak or HBM
bandwidth (no autotuning: deviceless compiles use default Triton tiles; real kernels reach 60-80% of peak);
no kernel launch gaps or host overhead; NCCL reaches the link's datasheet bandwidth and its kernels do not slow
the compute kernels they overlap (on a GPU they share SMs and HBM); a collective's kernels start when its
``-start`` is reached. Elementwise FLOPs and cuDNN attention calls count only their bytes. Loops are replayed
once and scaled, so a collective started in one iteration and finished in the next is not overlapped across
the iteration boundary.

**Pipeline bubble.** jaxpar's pipeline runs one ``lax.scan`` step per tick with each stage's action chosen by
``lax.switch`` (:mod:`jaxpar.pipeline.interpreter`); the replay charges a ``conditional`` its slowest branch, so
every (tick, stage) slot, idle ones included, costs the same kernels. The idle share of the slots is the
schedule's unit-tick bubble fraction (:attr:`jaxpar.pipeline.Schedule.bubble_fraction`), so ``bubble_s =
bubble_fraction * compute_s`` of the kernels' time is spent waiting in the bubble. Kernels outside the tick loop
(the optimizer update) are counted in it too, which overstates the bubble by their share of ``compute_s``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from jaxpar import _hlo
from jaxpar.plan import gpu_program
from jaxpar.tools import metrics as _metrics

_US = 1e-6
# NCCL's tuning model (src/graph/tuning.cc), Simple protocol, microseconds.
_RING_BASE_US, _RING_NVLINK_US, _RING_NET_US = 8.4, 3.4, 9.6
_TREE_NVLINK_US, _TREE_NET_US = 28.0, 50.0


@dataclasses.dataclass(frozen=True)
class Peaks:
    """The per-GPU figures the replay needs (FLOP/s dense; bytes/s per direction)."""
    bf16_flops: float
    fp8_flops: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    infiniband_bytes_per_s: float

    @classmethod
    def of(cls, spec: Any) -> Peaks:
        """From a GPU target (:func:`jaxpar.plan.gpu_target`) or a :class:`jaxpar.plan.costs.GPU` (its fp8 peak
        then read from the GPU table by name); a GPU without fp8 tensor cores runs fp8 dots at its bf16 peak."""
        bf16 = getattr(spec, "bf16_flops", None) or spec.peak_flops
        fp8 = getattr(spec, "fp8_flops", None)
        if fp8 is None and not hasattr(spec, "fp8_flops"):
            fp8 = _metrics.GPU_DATASHEETS.get(spec.name, {}).get("fp8_flops")
        return cls(bf16, fp8 or bf16, spec.hbm_bytes_per_s, spec.nvlink_bytes_per_s, spec.infiniband_bytes_per_s)


def collective_seconds(kind: str, payload: float, size: int, hosts: int, peaks: Peaks) -> float:
    """NCCL's modelled time of one collective (module docstring): ``kind`` one of :data:`jaxpar._hlo.COLLECTIVES`,
    ``payload`` bytes (the full buffer), ``size`` ranks, ``hosts`` the hosts they span."""
    if size < 2 or payload <= 0:
        return 0.0
    busbw = peaks.infiniband_bytes_per_s if hosts > 1 else peaks.nvlink_bytes_per_s
    if kind == "collective-permute":   # one send and one receive per device
        return (_RING_BASE_US + (_RING_NET_US if hosts > 1 else _RING_NVLINK_US)) * _US + payload / busbw
    steps = 2 * (size - 1) if kind == "all-reduce" else size if kind == "all-to-all" else size - 1
    inter = (2 if kind == "all-reduce" else 1) * (hosts - 1)
    latency = (_RING_BASE_US + (steps - inter) * _RING_NVLINK_US + inter * _RING_NET_US) * _US
    ring = latency + payload * steps / (size * busbw)
    if kind != "all-reduce":
        return ring
    tree = 2 * ((size / hosts - 1) * _TREE_NVLINK_US + math.log2(hosts) * _TREE_NET_US) * _US + 2 * payload / busbw
    return min(ring, tree)


@dataclasses.dataclass
class _Replay:
    """One computation's replay: seconds of the whole, of its kernels, of its collectives (hidden or not)."""
    seconds: float = 0.0
    compute_s: float = 0.0
    gemm_s: float = 0.0
    fp8_gemm_s: float = 0.0
    comm_s: float = 0.0
    by_collective: dict = dataclasses.field(default_factory=lambda: defaultdict(float))

    def add(self, other: _Replay, times: float) -> None:
        self.compute_s += times * other.compute_s
        self.gemm_s += times * other.gemm_s
        self.fp8_gemm_s += times * other.fp8_gemm_s
        self.comm_s += times * other.comm_s
        for k, v in other.by_collective.items():
            self.by_collective[k] += times * v


class _Replayer:
    def __init__(self, text: str, mesh_shape: dict[str, int], host_of: Sequence[int], peaks: Peaks):
        self.comps, self.entry = _hlo.parse_module(text)
        self.walker = _hlo.Walker(self.comps, dict(mesh_shape))
        self.mesh_shape, self.host_of, self.peaks = dict(mesh_shape), list(host_of), peaks
        self.num_devices = math.prod(self.mesh_shape.values())
        self.memo: dict[str, _Replay] = {}

    def replay(self, name: str) -> _Replay:
        if name not in self.memo:
            self.memo[name] = self._replay(name)
        return self.memo[name]

    def _kernel(self, instr: _hlo.Instr, shapes: dict[str, str]) -> tuple[float, float, bool]:
        """Seconds of one kernel, its FLOPs and whether it runs fp8 dots."""
        callee = dict(_hlo.callees(instr)).get("calls") if instr.opcode == "fusion" else None
        flops = self.walker.cost(callee, fused=True).get("flops", 0.0) if callee else 0.0
        if instr.opcode == "dot" or _hlo.is_gemm_call(instr):
            flops += _hlo.dot_flops(instr, shapes)
        fp8 = flops > 0 and self._has_fp8_dot(callee, instr, shapes)
        peak = self.peaks.fp8_flops if fp8 else self.peaks.bf16_flops
        return max(flops / peak, self.walker.traffic(instr, shapes) / self.peaks.hbm_bytes_per_s), flops, fp8

    def _has_fp8_dot(self, callee: str | None, instr: _hlo.Instr, shapes: dict[str, str]) -> bool:
        dots = [(i, {j.name: j.shape for j in self.comps[callee]}) for i in self.comps.get(callee, [])
                if i.opcode == "dot"] if callee else [(instr, shapes)]
        lhs = [_hlo.array_dims(s.get(i.operands[0], "")) for i, s in dots]
        return any(d and gpu_program.is_fp8(d[0][0]) for d in lhs)

    def _collective(self, instr: _hlo.Instr, kind: str, shapes: dict[str, str]) -> tuple[float, str]:
        if kind == "collective-permute":
            groups, size = _hlo.permute_pairs(instr.attrs), 2
        else:
            groups = _hlo.replica_groups(instr.attrs, self.num_devices)
            size = max(len(g) for g in groups)
        hosts = max((len({self.host_of[i] for i in g}) for g in groups), default=1)
        axes = "+".join(_hlo.group_axes(groups, self.mesh_shape))
        payload = _hlo.collective_payload(instr, kind, size, shapes)
        label = f"{kind}/{axes or '-'}/{'infiniband' if hosts > 1 else 'nvlink'}"
        return collective_seconds(kind, payload, size, hosts, self.peaks), label

    def _replay(self, name: str) -> _Replay:
        out, t, comm_free, pending = _Replay(), 0.0, 0.0, {}
        instrs = self.comps.get(name, [])
        shapes = {i.name: i.shape for i in instrs}
        for instr in instrs:
            kind = instr.opcode.removesuffix("-start").removesuffix("-done")
            if kind in _hlo.COLLECTIVES:
                if instr.opcode.endswith("-done"):
                    t = max(t, pending.pop(instr.operands[0], t))
                    continue
                seconds, label = self._collective(instr, kind, shapes)
                out.comm_s += seconds
                out.by_collective[label] += seconds
                comm_free = max(comm_free, t) + seconds
                if instr.opcode.endswith("-start"):
                    pending[instr.name] = comm_free
                else:
                    t = comm_free
            elif instr.opcode in ("while", "conditional", "call"):
                t += self._control(instr, out)
            elif instr.opcode not in _hlo.NO_TRAFFIC and not instr.opcode.endswith(("-start", "-done")):
                seconds, flops, fp8 = self._kernel(instr, shapes)
                t += seconds
                out.compute_s += seconds
                out.gemm_s += seconds if flops else 0.0
                out.fp8_gemm_s += seconds if fp8 else 0.0
        out.seconds = max([t, comm_free, *pending.values()])
        return out

    def _control(self, instr: _hlo.Instr, out: _Replay) -> float:
        """Seconds of a loop, conditional or call, its parts added to ``out``."""
        called = _hlo.callees(instr)
        if instr.opcode == "while":
            trips = _hlo.trip_count(instr) or 1.0
            body, cond = (self.replay(c) for role in ("body", "condition") for r, c in called if r == role)
            out.add(body, trips)
            out.add(cond, trips + 1)
            return trips * body.seconds + (trips + 1) * cond.seconds
        parts = [self.replay(c) for _, c in called]
        if not parts:
            return 0.0
        worst = max(parts, key=lambda r: r.seconds)
        out.add(worst, 1.0)
        return worst.seconds


def scheduled_time(text: str, mesh_shape: dict[str, int], host_of: Sequence[int], spec: Any,
                   bubble_fraction: float = 0.0) -> dict:
    """The replayed step time of a compiled GPU program (module docstring), per device.

    Args:
      text: ``compiled.as_text()`` of a program compiled for GPU devices (XLA:GPU's scheduled HLO).
      mesh_shape: axis name -> size in the mesh's order (``dict(mesh.shape)``); replica-group ids are positions in
        ``mesh.devices.flat``.
      host_of: the host of each of those positions (``[d.process_index for d in mesh.devices.flat]``).
      spec: the GPU's figures (:meth:`Peaks.of`).
      bubble_fraction: the pipeline schedule's idle share of its (tick, stage) slots, in ``[0, 1)``
        (``schedule.bubble_fraction``; 0 without a pipeline).

    Returns:
      ``{"step_s", "compute_s", "gemm_s", "fp8_gemm_s", "comm_s", "exposed_comm_s", "bubble_s", "busy_s",
      "comm_s_by": {"kind/axes/link": s}, "unknown_trip_counts"}`` in seconds: ``compute_s`` the kernels' sum
      (``gemm_s`` of those with matmuls, ``fp8_gemm_s`` of those with fp8 matmuls), ``comm_s`` the collectives'
      sum, ``exposed_comm_s = step_s - compute_s`` the communication the schedule does not hide, ``bubble_s =
      bubble_fraction * compute_s`` the kernels' time charged to idle pipeline slots (module docstring) and
      ``busy_s = compute_s - bubble_s``; ``busy_s + exposed_comm_s + bubble_s == step_s``.

    Raises:
      ValueError: ``host_of`` shorter than the mesh, ``bubble_fraction`` outside ``[0, 1)``; the HLO errors of
        :func:`jaxpar._hlo.analyze`.
    """
    if not 0.0 <= bubble_fraction < 1.0:
        raise ValueError(f"bubble_fraction={bubble_fraction!r} must lie in [0, 1); pass the pipeline schedule's "
                         "bubble_fraction, or 0 without a pipeline")
    n = math.prod(mesh_shape.values())
    if len(host_of) < n:
        raise ValueError(f"host_of has {len(host_of)} entries, the mesh {dict(mesh_shape)} has {n} devices; pass "
                         "[d.process_index for d in mesh.devices.flat]")
    replayer = _Replayer(text, mesh_shape, host_of, Peaks.of(spec))
    r = replayer.replay(replayer.entry)
    bubble = bubble_fraction * r.compute_s
    return {"step_s": r.seconds, "compute_s": r.compute_s, "gemm_s": r.gemm_s, "fp8_gemm_s": r.fp8_gemm_s,
            "comm_s": r.comm_s, "exposed_comm_s": max(0.0, r.seconds - r.compute_s), "bubble_s": bubble,
            "busy_s": r.compute_s - bubble, "comm_s_by": dict(r.by_collective),
            "unknown_trip_counts": replayer.walker.unknown_trips}


def throughput(step_s: float, tokens_per_step: int, num_devices: int, model_flops_per_token: float,
               peak_flops: float) -> dict:
    """``tokens_per_s_per_gpu`` and ``mfu = model FLOPs per token * tokens/s per GPU / peak`` (PaLM's MFU,
    Chowdhery et al. 2022, app. B) of a step time."""
    per_gpu = tokens_per_step / (step_s * num_devices)
    return {"tokens_per_s_per_gpu": per_gpu, "mfu": model_flops_per_token * per_gpu / peak_flops}


__all__ = ["Peaks", "collective_seconds", "scheduled_time", "throughput"]
