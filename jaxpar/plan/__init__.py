"""AOT planning of a large GPU run on this machine: compile the real train step for a simulated mesh, read its costs.

``jp.plan.plan(GPTConfig(...), dict(data=8, fsdp=16, tensor=8), global_batch=1024, seq_len=2048)`` compiles the
step a run trains with on that many simulated CPU devices and returns a :class:`Plan` (memory, FLOPs, collectives
by mesh axis, a roofline step time, whether it fits); ``jp.plan.estimate(...)`` is the analytic part alone (no
compilation). With ``target=`` (a :func:`gpu_target` or its name) the step is compiled by XLA's GPU compiler for
compile-only GPU devices instead, and the plan reads the GPU program (memory, collectives, fp8 GEMMs, a step time
replayed from its schedule).

* :mod:`jaxpar.plan.planner`: :func:`plan`, :func:`estimate`, the :class:`Plan`, and the step they compile
  (:func:`build_step`, :func:`policy_of`, :func:`planning_mesh`); the planning subprocess.
* :mod:`jaxpar.plan.mesh_sizes`: mesh sizes (``mesh_sizes``), their split over hosts (:func:`host_split`), the
  checks a layout must pass (:func:`check_layout`) and the changes that make one fit (``suggestions``).
* :mod:`jaxpar.plan.costs`: datasheet GPUs (:func:`gpu`, :class:`GPU`) and the step-time models
  (:func:`roofline` from the compiled program, :func:`analytic_time` from the model's sizes).
* :mod:`jaxpar.plan.targets`: GPU targets (:func:`gpu_target`, :class:`GpuTarget`): compile-only H100 / H200 /
  B200 / A100 devices of XLA's GPU compiler, for compiling GPU programs on a CPU-only machine.
* :mod:`jaxpar.plan.gpu_plan`: the plan of a GPU target (:func:`plan` with ``target=``) and its report.
* :mod:`jaxpar.plan.step_time`: a step time replayed from XLA:GPU's scheduled HLO (:func:`scheduled_time`:
  kernels at the datasheet peaks, NCCL's ring/tree costs over NVLink or InfiniBand, async collectives
  overlapped), tokens/s per GPU and MFU.
* :mod:`jaxpar.plan.gpu_program`: what a GPU program does (collectives by dtype and async, fp8 dots and their
  GEMM kernels, the attention kernel).
* :mod:`jaxpar._hlo`: reading a compiled program's HLO text (FLOPs with loops by trip count, bytes accessed,
  collectives by mesh axis).
* :mod:`jaxpar.plan.memory`: the analytic per-device memory of the GPT train step.
* :mod:`jaxpar.plan.experts`: a mixture of experts' plan (``plan(..., expert_parallel=)``): all and active
  parameters, expert weights per device by expert-parallel size, the dispatch's bytes over the expert axes, the
  experts' FLOPs, and what ``ragged_dot`` compiled to (on GPU: dense GEMMs over a masked expansion, E times the
  useful FLOPs).
"""

from jaxpar import _hlo as hlo
from jaxpar.plan import experts, gpu_program, memory, step_time
from jaxpar.plan.costs import GPU, analytic_time, gpu, roofline
from jaxpar.plan.mesh_sizes import check_layout, host_split
from jaxpar.plan.targets import GpuTarget, gpu_target
from jaxpar.plan.planner import MAX_DEVICES, Plan, build_step, estimate, plan, planning_mesh, policy_of

__all__ = ["GPU", "GpuTarget", "MAX_DEVICES", "Plan", "analytic_time", "build_step", "check_layout", "estimate",
           "experts", "gpu", "gpu_program", "gpu_target", "hlo", "host_split", "memory", "plan", "planning_mesh",
           "policy_of", "roofline", "step_time"]
