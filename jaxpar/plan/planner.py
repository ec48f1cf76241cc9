"""Plan a large GPU run on this machine: compile the real train step for a simulated mesh, read its costs.

``jp.plan.plan(GPTConfig(...), dict(data=8, fsdp=16, tensor=8), global_batch=1024, seq_len=2048)`` builds the
GPT's abstract state and batch (``jax.ShapeDtypeStruct``\\ s with the shardings training would give them) on a
mesh of that many host CPU devices, lowers and compiles the step ``jp.train.make_train_step`` builds (the code
that trains: ``step.lower(jp.train.abstract_state(...), batch).compile()``; a pipeline through
``jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, schedule)``), and reports per device:

* memory: XLA's ``memory_analysis()`` of the compiled step (arguments + outputs - donated + temporaries) beside
  the analytic estimate of :mod:`jaxpar.plan.memory` (params, optimizer state, gradients, activations), and
  whether it fits the GPU (datasheet capacity times ``memory_fraction``);
* FLOPs: ``cost_analysis()`` (which counts a loop body once) and the HLO's matmul FLOPs with every loop body
  counted by its trip count (:mod:`jaxpar._hlo`), beside the model's ``6 N`` per token;
* collectives: payload bytes by kind (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute)
  and mesh axis, read from the HLO's replica groups;
* a roofline step time (:mod:`jaxpar.plan.costs`: compute, HBM traffic and collectives over NVLink or
  InfiniBand by the GPU's datasheet) and the MFU it implies.

The layout's checks, its split over hosts and the advice when it does not fit are :mod:`jaxpar.plan.mesh_sizes`'s.

:func:`estimate` gives the analytic memory and step time of a layout without compiling (a sweep ranks and
prunes its layouts by it before compiling the best).

All figures are those of an **XLA:CPU compilation**: XLA:CPU computes bf16 work in float32 and keeps float32
copies of some bf16 buffers, and its collectives are not rewritten as a GPU's are (gradients stay all-reduces,
where XLA:GPU makes reduce-scatters), so GPU memory and traffic can differ; :attr:`Plan.memory` also gives the
largest such float32 copy found in the program.

Precision and remat come from the model config, their one source: ``GPTConfig.dtype`` (compute; None is
float32) and ``GPTConfig.param_dtype`` (storage; None is float32) become the state's
``jp.precision.Policy(param_dtype, compute_dtype, float32)``, and ``GPTConfig.remat`` is the GPT's own remat.
The optimizer is ``tx`` when given, else the experiments' ``jp.optim.adamw`` (float32 moments). The model is
any model of the protocol whose ``cfg`` gives its sizes, or a config that builds one.

The device count is fixed when jax starts: a plan for ``n`` devices runs in this process when it has ``n`` CPU
devices (it uses the first ``n``: a process started with the largest count plans every smaller mesh), and in
a subprocess started with ``XLA_FLAGS=--xla_force_host_platform_device_count=n`` otherwise.
"""

from __future__ import annotations

import math
import numbers
import os
import pickle
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax

from jaxpar._validate import positive_int
from jaxpar import _hlo as plan_hlo
from jaxpar.plan import experts as plan_experts
from jaxpar.plan import memory as plan_memory
from jaxpar.plan.mesh_sizes import check_layout, does_not_fit_message, host_split, mesh_sizes, suggestions
from jaxpar.plan.costs import GPU, analytic_time, gpu, roofline
# Plan, build_step and policy_of are also jp.plan's faces (imported from here).
from jaxpar.plan.compiled_step import (Plan, batch_structs, build_step, collectives_by_kind,  # noqa: F401
                                       default_tx, model_summary, policy_of)

MAX_DEVICES = 8192   # simulated CPU devices a plan may use (each one a host thread and its buffers' metadata)
PLANNING_XLA_FLAGS = ("--xla_disable_hlo_passes=all-reduce-promotion",)
"""XLA flags of a planning process, which compiles and never runs: XLA:CPU's pass widening bf16 all-reduces to
float32 aborts the process (jaxlib 0.10.2: "Invalid binary instruction opcode copy") on the bf16 psum jax emits
for a weight entering a ``shard_map`` whole over a manual axis (a mixture of experts' expert weights over a batch
axis that holds no experts); without it the all-reduce stays bf16, as XLA:GPU keeps it."""


def _memory(compiled: Any, state: Any, parts: dict[str, float], text: str) -> dict:
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    analytic = sum(parts.values())
    upcasts = plan_hlo.upcast_copies(text)
    return {"compiled_bytes": float(total), "argument_bytes": float(m.argument_size_in_bytes),
            "output_bytes": float(m.output_size_in_bytes), "alias_bytes": float(m.alias_size_in_bytes),
            "temp_bytes": float(m.temp_size_in_bytes),
            "params_bytes": plan_memory.sharded_bytes(state.params),
            "opt_state_bytes": plan_memory.sharded_bytes(state.opt_state),
            "analytic": parts, "analytic_bytes": analytic, "ratio": total / analytic,
            "cpu_upcast_bytes": upcasts[0] if upcasts else 0.0}


# ------------------------------------------------------------------------------------------------ compile

def _cpu_devices() -> list:
    try:
        return jax.devices("cpu")
    except RuntimeError:
        return []


def planning_mesh(sizes: dict[str, int], gpus_per_host: int):
    """The mesh a run on hosts of ``gpus_per_host`` GPUs builds, over the first ``prod(sizes)`` CPU devices:
    ``jp.make_mesh(**sizes, hosts=, devices_per_host=gpus_per_host)`` (simulated hosts of consecutive devices),
    flat when it is one host. Raises ValueError when this process has fewer CPU devices."""
    from jaxpar.sharding.mesh import make_mesh
    n, devices = math.prod(sizes.values()), _cpu_devices()
    if len(devices) < n:
        raise ValueError(f"this process has {len(devices)} CPU devices, the mesh needs {n}: start it with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n} (jp.plan.plan does so in a subprocess)")
    if n <= gpus_per_host:
        return make_mesh(**sizes, devices=devices[:n])
    return make_mesh(**sizes, devices=devices[:n], hosts=n // gpus_per_host, devices_per_host=gpus_per_host)


def _fit(cfg, sizes, parts, needed, spec, memory_fraction, global_batch, seq_len, schedule, grad_accum_steps,
         gpus_per_host) -> tuple[bool, float, str]:
    available = spec.memory_bytes * memory_fraction
    fits = needed <= available
    advice = "" if fits else does_not_fit_message(needed, available, suggestions(
        cfg, sizes, parts, grad_accum_steps, global_batch, seq_len, schedule, gpus_per_host, available))
    return fits, available, advice


def _plan_here(model_config, sizes, global_batch, seq_len, schedule, spec, grad_accum_steps, gpus_per_host,
               memory_fraction, tx=None, policy=None, expert_parallel=1) -> Plan:
    start = time.perf_counter()
    per_host, across = host_split(sizes, gpus_per_host)
    mesh = planning_mesh(sizes, gpus_per_host)
    model, _, step, state = build_step(model_config, mesh, schedule, grad_accum_steps, tx=tx, policy=policy,
                                       rules=plan_experts.expert_rules(sizes, expert_parallel))
    cfg = plan_memory.model_and_config(model_config)[1]
    compiled = step.lower(state, batch_structs(global_batch, seq_len)).compile()
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    stats = plan_hlo.analyze(text, dict(mesh.shape))
    parts = plan_memory.estimate(model, state, mesh, global_batch, seq_len, schedule, grad_accum_steps)
    memory = _memory(compiled, state, parts, text)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    n = math.prod(sizes.values())
    model_flops = 6.0 * plan_experts.flop_params(cfg) * global_batch * seq_len
    collectives = collectives_by_kind(stats)
    needed = memory["compiled_bytes"]
    fits, available, advice = _fit(cfg, sizes, parts, needed, spec, memory_fraction, global_batch, seq_len,
                                   schedule, grad_accum_steps, gpus_per_host)
    return Plan(label="XLA:CPU compilation", model=model_summary(model, cfg), mesh=sizes,
                hosts={"per_host": per_host, "across_hosts": across}, device=spec.name,
                global_batch=global_batch, seq_len=seq_len, schedule=None if schedule is None else schedule.name,
                grad_accum_steps=grad_accum_steps, memory=memory,
                flops={"hlo": stats.flops, "cost_analysis": float(cost.get("flops", 0.0)), "model": model_flops / n,
                       "hlo_bytes_accessed": stats.bytes_accessed, "unknown_trip_counts": stats.unknown_trip_counts},
                collectives=collectives, time=roofline(stats, sizes, spec, across, model_flops), fits=fits,
                needed_bytes=needed, available_bytes=available, advice=advice, compile_s=compile_s,
                analytic_time=analytic_time(cfg, sizes, across, global_batch, seq_len, schedule, spec,
                                            grad_accum_steps, expert_parallel),
                experts=plan_experts.compiled_experts(cfg, sizes, global_batch, seq_len, expert_parallel,
                                                      grad_accum_steps, text, gpu=False))


def _plan_in_subprocess(args: tuple, n: int, timeout: float) -> Plan:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, *PLANNING_XLA_FLAGS, f"--xla_force_host_platform_device_count={n}"])
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = os.path.join(tmp, "in.pkl"), os.path.join(tmp, "out.pkl")
        with open(inp, "wb") as f:
            pickle.dump(args, f)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        code = "import sys; from jaxpar.plan.planner import _subprocess_main; _subprocess_main(sys.argv[1:])"
        try:
            proc = subprocess.run([sys.executable, "-c", code, inp, out], env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"planning on {n} simulated devices did not finish within timeout={timeout:g} s; "
                               "raise timeout= (compiling a large mesh on CPU can take many minutes), or plan a "
                               "smaller mesh with the same per-device shapes") from None
        if proc.returncode != 0:
            raise RuntimeError(f"planning on {n} simulated devices failed in its subprocess:\n{proc.stderr[-3000:]}")
        with open(out, "rb") as f:
            return pickle.load(f)


def _validate(model_config, mesh_shape, global_batch, seq_len, schedule, device, num_devices, grad_accum_steps,
              gpus_per_host, memory_fraction, expert_parallel=1) -> tuple[GPU, dict[str, int]]:
    """The checks of :func:`plan` (all before anything is traced); returns ``(gpu spec, mesh sizes)``."""
    model_config = plan_memory.model_and_config(model_config)[1]
    spec = gpu(device)
    if num_devices is not None:
        positive_int("num_devices", num_devices)
    sizes = mesh_sizes(mesh_shape, num_devices)
    if math.prod(sizes.values()) > MAX_DEVICES:
        raise ValueError(f"a mesh of {math.prod(sizes.values())} devices: the planner simulates every device on this "
                         f"machine's CPU and plans at most {MAX_DEVICES}; plan a smaller mesh with the same "
                         "per-device shapes (e.g. fewer data replicas: only their gradient all-reduce grows)")
    positive_int("grad_accum_steps", grad_accum_steps)
    if (isinstance(memory_fraction, bool) or not isinstance(memory_fraction, numbers.Real)
            or not 0 < float(memory_fraction) <= 1):
        raise ValueError(f"memory_fraction={memory_fraction!r} must be a number in (0, 1]")
    check_layout(model_config, sizes, global_batch, seq_len, schedule, grad_accum_steps, gpus_per_host)
    plan_experts.check_experts(model_config, sizes, expert_parallel)
    return spec, sizes


def estimate(model_config: Any, mesh_shape: Any, *, global_batch: int, seq_len: int, schedule: Any = None,
             device: str = "h100-80gb", num_devices: int | None = None, grad_accum_steps: int = 1,
             gpus_per_host: int = 8, memory_fraction: float = 0.9, tx: Any = None, expert_parallel: int = 1) -> dict:
    """The analytic side of :func:`plan` without compiling (a fraction of a second): the state's exact sharded
    bytes and the :mod:`jaxpar.plan.memory` estimate, per device, and :func:`analytic_time`.

    Arguments and errors as for :func:`plan`; the process must hold ``prod(mesh_shape)`` CPU devices (the
    state's shardings are built on the planning mesh), else ValueError.

    Returns:
      ``{"memory": {part: bytes}, "needed_bytes", "available_bytes", "fits", "advice", "time": {...}}``.
    """
    spec, sizes = _validate(model_config, mesh_shape, global_batch, seq_len, schedule, device, num_devices,
                            grad_accum_steps, gpus_per_host, memory_fraction, expert_parallel)
    memory_fraction = float(memory_fraction)
    _, across = host_split(sizes, gpus_per_host)
    mesh = planning_mesh(sizes, gpus_per_host)
    model, _, _, state = build_step(model_config, mesh, schedule, grad_accum_steps, tx=tx,
                                    rules=plan_experts.expert_rules(sizes, expert_parallel))
    cfg = plan_memory.model_and_config(model_config)[1]
    parts = plan_memory.estimate(model, state, mesh, global_batch, seq_len, schedule, grad_accum_steps)
    needed = sum(parts.values())
    fits, available, advice = _fit(cfg, sizes, parts, needed, spec, memory_fraction, global_batch, seq_len,
                                   schedule, grad_accum_steps, gpus_per_host)
    return {"memory": parts, "needed_bytes": needed, "available_bytes": available, "fits": fits, "advice": advice,
            "time": analytic_time(cfg, sizes, across, global_batch, seq_len, schedule, spec, grad_accum_steps,
                                  expert_parallel)}


def plan(model_config: Any, mesh_shape: Any, *, global_batch: int, seq_len: int, schedule: Any = None,
         device: str = "h100-80gb", num_devices: int | None = None, grad_accum_steps: int = 1,
         gpus_per_host: int = 8, memory_fraction: float = 0.9, timeout: float = 900.0, tx: Any = None,
         target: Any = None, policy: Any = None, compare_cpu: bool = False, expert_parallel: int = 1) -> Plan:
    """Compiles a model's train step for ``mesh_shape`` on simulated CPU devices, or with XLA's GPU compiler for
    a GPU ``target``, and returns its :class:`Plan`.

    Args:
      model_config: a model config that builds a model of the protocol (``jaxpar.models.GPTConfig``,
        ``LlamaConfig``), or such a model (its ``cfg`` gives the sizes,
        :data:`jaxpar.plan.memory.SIZES`); the config's ``dtype`` / ``param_dtype`` give the precision policy and
        its ``remat`` the activation checkpointing (use ``scan_layers=True`` for deep models: compile time).
      mesh_shape: ``dict(data=, pipe=, fsdp=, tensor=)`` (missing axes 1) or a 4-tuple in that order; the
        whole mesh's sizes (the host split follows from ``gpus_per_host``).
      global_batch, seq_len: sequences per step and tokens per sequence (positive ints).
      schedule: a ``jp.pipeline.Schedule`` with ``num_stages == pipe`` when ``pipe > 1``; None otherwise.
      device: a key of :data:`jaxpar.tools.metrics.GPU_DATASHEETS` (``"h100-80gb"``, ``"h200"``, ``"a100-80gb"``).
      num_devices: if given, the mesh must multiply to it.
      grad_accum_steps: accumulation steps per update (``make_train_step``'s).
      gpus_per_host: GPUs per host (NVLink domain); ``tensor`` must divide it, and a mesh of more devices must
        be whole hosts; the mesh is ``jp.make_mesh(..., hosts=, devices_per_host=gpus_per_host)``'s.
      memory_fraction: the part of the GPU's memory the run may use (jax preallocates 75% unless
        ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is raised; 0.9 assumes it is).
      timeout: seconds allowed for the planning subprocess (when one is needed).
      tx: the optimizer (an optax ``GradientTransformation``; None: :func:`default_tx`, AdamW). A plan in a
        subprocess sends it pickled.
      target: None (simulated CPU devices), or a GPU target: a :func:`jaxpar.plan.gpu_target` whose device
        count is the mesh's, or its name (``"h100"``, ``"h200"``, ...; ``prod(mesh) / gpus_per_host`` hosts). The
        step is compiled by XLA:GPU for its compile-only devices in this process (:mod:`jaxpar.plan.gpu_plan`:
        GPU memory, collectives by dtype, fp8 GEMMs, attention kernel, a replayed step time); ``device`` is then
        the target's. XLA reads its GPU flags once, from ``XLA_FLAGS`` when jax starts: to compile what a jaxpar
        GPU run compiles, start the process after ``jp.tools.gpu.apply_gpu_defaults(platform="gpu")`` (the
        latency-hiding scheduler, collective combining and pipelining; ``experiments/plan.py --target`` does).
      policy: the precision policy (None: the config's, :func:`policy_of`); e.g. ``dot="fp8"`` for fp8 matmuls.
      compare_cpu: with a ``target``, also compile for simulated CPU devices and put that plan's memory beside
        the GPU's (``memory["cpu_compiled_bytes"]``).
      expert_parallel: a mixture of experts' expert-parallel size (``jp.sharding.expert_parallel_rules``: the
        experts folded onto batch axes of the mesh; 1: every device holds every expert). A config with ``moe``
        gets :attr:`Plan.experts` (:mod:`jaxpar.plan.experts`) and its model FLOPs count the active parameters.

    Returns:
      A :class:`Plan`; a layout that does not fit is a Plan with ``fits=False`` and ``advice`` reading "does not
      fit: X GiB needed per device, Y available; try ...", not an exception.

    Raises:
      TypeError: ``model_config`` is neither a model of the protocol with a sized ``cfg`` nor a config building one.
      ValueError (before anything is traced): a mesh size that is not a positive int, sizes that do not
        multiply to ``num_devices`` or exceed :data:`MAX_DEVICES`; a ``tensor`` axis that would span hosts; a mesh that is not whole hosts;
        sizes the model does not divide; a ``seq_len`` that is not a positive int or exceeds
        ``max_seq_len``; a batch the layout cannot split; a schedule that is not a ``Schedule`` or does not
        match ``pipe``; an unknown ``device``; a bad ``grad_accum_steps``, ``gpus_per_host`` or
        ``memory_fraction`` (any real number type, numpy's included); a ``timeout`` that is not a positive
        finite number; an ``expert_parallel`` that is not a fold of the batch axes or does not divide the experts
        (:func:`jaxpar.plan.experts.check_experts`).
      RuntimeError: the planning subprocess failed (its stderr attached) or ran past ``timeout``.
      ImportError / RuntimeError: a ``target`` without the jax CUDA plugin of jaxlib's version.
    """
    if (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(float(timeout))
            or float(timeout) <= 0):
        raise ValueError(f"timeout={timeout!r} must be a positive finite number of seconds, e.g. timeout=1800")
    if target is not None:
        device = target if isinstance(target, str) else target.name
        gpus_per_host = gpus_per_host if isinstance(target, str) else target.gpus_per_host
    spec, sizes = _validate(model_config, mesh_shape, global_batch, seq_len, schedule, device, num_devices,
                            grad_accum_steps, gpus_per_host, memory_fraction, expert_parallel)
    args = (model_config, sizes, int(global_batch), int(seq_len), schedule, spec, int(grad_accum_steps),
            int(gpus_per_host), float(memory_fraction), tx, policy, int(expert_parallel))
    n = math.prod(sizes.values())
    if target is not None:
        from jaxpar.plan import gpu_plan
        resolved = gpu_plan.resolve_target(target, n, int(gpus_per_host))
        result = gpu_plan.plan_on_target(model_config, sizes, resolved, int(global_batch), int(seq_len), schedule,
                                         int(grad_accum_steps), float(memory_fraction), tx, policy,
                                         int(expert_parallel))
        if compare_cpu:
            cpu = plan(model_config, sizes, global_batch=global_batch, seq_len=seq_len, schedule=schedule,
                       device=device, grad_accum_steps=grad_accum_steps, gpus_per_host=gpus_per_host,
                       memory_fraction=memory_fraction, timeout=timeout, tx=tx, policy=policy,
                       expert_parallel=expert_parallel)
            result.memory.update(cpu_compiled_bytes=cpu.needed_bytes, cpu_temp_bytes=cpu.memory["temp_bytes"],
                                 cpu_upcast_bytes=cpu.memory["cpu_upcast_bytes"])
        return result
    if len(_cpu_devices()) >= n:
        return _plan_here(*args)
    try:
        pickle.dumps(args)
    except Exception as e:   # closures (a custom tx, a model defined in a function) do not pickle
        raise ValueError(f"planning {n} devices runs in a subprocess, which cannot receive this model or tx ({e}); "
                         f"start this process with XLA_FLAGS=--xla_force_host_platform_device_count={n} to plan "
                         "here, or pass a picklable model and tx") from None
    return _plan_in_subprocess(args, n, float(timeout))


def _subprocess_main(argv: list[str]) -> None:
    with open(argv[0], "rb") as f:
        args = pickle.load(f)
    result = _plan_here(*args)
    with open(argv[1], "wb") as f:
        pickle.dump(result, f)
