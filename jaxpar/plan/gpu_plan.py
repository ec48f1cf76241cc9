"""Planning on a GPU target: compile the real train step with XLA's GPU compiler for compile-only devices, read
its memory, collectives, fp8 GEMMs, attention kernel and replayed step time.

:func:`jaxpar.plan.plan` calls :func:`plan_on_target` when given ``target=`` (a :func:`jaxpar.plan.gpu_target`,
or a name such as ``"h100"``). The mesh is ``target.mesh(**sizes)`` (within-host and across-host parts as a
run on ``target.hosts`` hosts builds them); the step is the one :func:`jaxpar.plan.planner.build_step` builds.
The :class:`jaxpar.plan.planner.Plan` it returns has the usual fields, read from the GPU program:

* ``memory``: ``compiled_bytes`` from XLA:GPU's ``memory_analysis()`` (arguments + outputs - aliased +
  temporaries) and its parts, the analytic estimate beside it, and ``cpu_compiled_bytes`` (the same step compiled
  for simulated CPU devices, :func:`jaxpar.plan.plan` without a target) when that comparison was asked for;
* ``flops``: matmul FLOPs (loops by trip count, fp8 ones included) beside the model's ``6 N`` per token;
* ``collectives``: ``{kind: {axes: bytes}}`` per step, and in ``gpu["collectives"]`` the rows by kind, axes,
  dtype and async-or-not (:func:`jaxpar.plan.gpu_program.collectives`);
* ``time``: :func:`jaxpar.plan.step_time.scheduled_time` (the scheduled program replayed: kernels at the
  datasheet peaks, NCCL's ring/tree costs over NVLink or InfiniBand, async collectives hidden by the kernels
  between start and done; its assumptions are that module's), with ``tokens_per_s_per_gpu`` and ``mfu``
  (``6 N`` per token over the dense bf16 peak);
* ``gpu``: the target and topology, the fp8 dots and the kernels they became, the attention kernel.
"""

from __future__ import annotations

import math
import time
from typing import Any

from jaxpar import _hlo
from jaxpar.plan import compiled_step, gpu_program, step_time
from jaxpar.plan import experts as plan_experts
from jaxpar.plan import memory as plan_memory
from jaxpar.plan.mesh_sizes import does_not_fit_message, host_split, suggestions


def resolve_target(target: Any, num_devices: int, gpus_per_host: int) -> Any:
    """A :class:`jaxpar.plan.GpuTarget` for a mesh of ``num_devices``: ``target`` itself (its device count must be
    the mesh's), or the target of that name with ``num_devices / gpus_per_host`` hosts (one host of
    ``num_devices`` GPUs when fewer).

    Raises:
      ValueError: a target whose topology has another device count than the mesh, devices that are not whole
        hosts, an unknown name; ImportError / RuntimeError: the CUDA plugin missing or not of jaxlib's version.
    """
    from jaxpar.plan import targets
    if isinstance(target, targets.GpuTarget):
        if target.num_devices != num_devices:
            raise ValueError(f"target topology {target.topology} has {target.num_devices} devices, the mesh "
                             f"{num_devices}; build gpu_target({target.name!r}, hosts=, gpus_per_host=) to match it")
        return target
    if num_devices <= gpus_per_host:
        return targets.gpu_target(target, hosts=1, gpus_per_host=num_devices)
    if num_devices % gpus_per_host:
        raise ValueError(f"{num_devices} devices are not whole hosts of gpus_per_host={gpus_per_host} GPUs")
    return targets.gpu_target(target, hosts=num_devices // gpus_per_host, gpus_per_host=gpus_per_host)


def _memory(compiled: Any, state: Any, parts: dict[str, float]) -> dict:
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    analytic = sum(parts.values())
    return {"compiled_bytes": float(total), "argument_bytes": float(m.argument_size_in_bytes),
            "output_bytes": float(m.output_size_in_bytes), "alias_bytes": float(m.alias_size_in_bytes),
            "temp_bytes": float(m.temp_size_in_bytes), "params_bytes": plan_memory.sharded_bytes(state.params),
            "opt_state_bytes": plan_memory.sharded_bytes(state.opt_state), "analytic": parts,
            "analytic_bytes": analytic, "ratio": total / analytic, "cpu_upcast_bytes": 0.0}


def plan_on_target(model_config: Any, sizes: dict[str, int], target: Any, global_batch: int, seq_len: int,
                   schedule: Any, grad_accum_steps: int, memory_fraction: float, tx: Any = None,
                   policy: Any = None, expert_parallel: int = 1):
    """The :class:`jaxpar.plan.compiled_step.Plan` of a layout compiled for ``target`` (module docstring); arguments as
    :func:`jaxpar.plan.plan` (already checked), ``target`` a :class:`jaxpar.plan.GpuTarget` of the mesh's size."""
    start = time.perf_counter()
    per_host, across = host_split(sizes, target.gpus_per_host)
    mesh = target.mesh(**sizes)
    model, _, step, state = compiled_step.build_step(model_config, mesh, schedule, grad_accum_steps, tx=tx,
                                                     policy=policy,
                                                     rules=plan_experts.expert_rules(sizes, expert_parallel))
    cfg = plan_memory.model_and_config(model_config)[1]
    compiled = step.lower(state, compiled_step.batch_structs(global_batch, seq_len)).compile()
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    shape = dict(mesh.shape)
    stats = _hlo.analyze(text, shape)
    parts = plan_memory.estimate(model, state, mesh, global_batch, seq_len, schedule, grad_accum_steps)
    memory = _memory(compiled, state, parts)
    n = math.prod(sizes.values())
    model_flops = 6.0 * plan_experts.flop_params(cfg) * global_batch * seq_len
    collectives = compiled_step.collectives_by_kind(stats)
    host_of = [d.process_index for d in mesh.devices.flat]
    replay = step_time.scheduled_time(text, shape, host_of, target,
                                      0.0 if schedule is None else schedule.bubble_fraction)
    replay.update(step_time.throughput(replay["step_s"], global_batch * seq_len, n,
                                       6.0 * plan_experts.flop_params(cfg), target.bf16_flops))
    replay.update(step_overlap_s=replay["step_s"], hbm_s=0.0)
    needed, available = memory["compiled_bytes"], target.memory_bytes * memory_fraction
    fits = needed <= available
    advice = "" if fits else does_not_fit_message(needed, available, suggestions(
        cfg, sizes, parts, grad_accum_steps, global_batch, seq_len, schedule, target.gpus_per_host, available))
    from jaxpar.plan.costs import analytic_time
    return compiled_step.Plan(
        label=f"XLA:GPU compilation for {target.name} ({target.topology})", model=compiled_step.model_summary(model, cfg),
        mesh=sizes, hosts={"per_host": per_host, "across_hosts": across}, device=target.name,
        global_batch=global_batch, seq_len=seq_len, schedule=None if schedule is None else schedule.name,
        grad_accum_steps=grad_accum_steps, memory=memory,
        flops={"hlo": stats.flops, "cost_analysis": 0.0, "model": model_flops / n,
               "hlo_bytes_accessed": stats.bytes_accessed, "unknown_trip_counts": stats.unknown_trip_counts},
        collectives=collectives, time=replay, fits=fits, needed_bytes=needed, available_bytes=available,
        advice=advice, compile_s=compile_s,
        analytic_time=analytic_time(cfg, sizes, across, global_batch, seq_len, schedule, target.gpu,
                                    grad_accum_steps, expert_parallel),
        gpu={"target": target.name, "topology": target.topology, "config_source": target.config_source,
             "collectives": gpu_program.collectives(text, shape), "dots": gpu_program.dots(text),
             "attention": gpu_program.attention_kernel(text)},
        experts=plan_experts.compiled_experts(cfg, sizes, global_batch, seq_len, expert_parallel, grad_accum_steps,
                                              text, gpu=True))


__all__ = ["plan_on_target", "resolve_target"]
