"""The step a plan compiles and the plan it returns: :func:`build_step` (the train step of a model of the protocol
on a mesh, as a run builds it), :func:`batch_structs`, :func:`policy_of`, :func:`default_tx`, and the :class:`Plan`
with its report (a CPU-simulated plan's, or a GPU target's: :mod:`jaxpar.plan.gpu_plan`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar import _hlo as plan_hlo
from jaxpar.layers.per_token import LM_KEYS
from jaxpar.plan import memory as plan_memory
from jaxpar.plan.mesh_sizes import GiB


@dataclasses.dataclass
class Plan:
    """A planned layout, per device (bytes, FLOPs, seconds). ``report()`` prints it; ``to_dict()`` for JSON.

    ``memory``: ``compiled_bytes`` (XLA:CPU ``memory_analysis``: arguments + outputs - aliased + temporaries) and
    its parts, ``params_bytes`` / ``opt_state_bytes`` (the sharded state exactly), ``analytic`` (the
    :mod:`jaxpar.plan.memory` parts) and ``analytic_bytes``, ``ratio`` (compiled / analytic),
    ``cpu_upcast_bytes`` (the largest float32 copy of a bf16 buffer in the program). ``flops``: ``hlo`` (matmul
    FLOPs, loops by trip count), ``cost_analysis`` (XLA's, loop bodies once), ``model`` (``6 N`` per token times
    the device's tokens). ``collectives``: ``{kind: {axes: bytes}}`` per step. ``time``: the roofline terms
    and ``step_s``, ``step_overlap_s``, ``mfu``. ``hosts``: ``per_host`` and ``across_hosts`` sizes of the
    mesh (:func:`host_split`). ``analytic_time``: :func:`analytic_time` of the layout (no compilation).
    ``experts`` (a model with ``moe``): :func:`jaxpar.plan.experts.compiled_experts` (parameters, expert weights
    per device by expert-parallel size, dispatch bytes, the experts' FLOPs and the matmuls they compiled to).
    """
    label: str
    model: dict
    mesh: dict
    hosts: dict
    device: str
    global_batch: int
    seq_len: int
    schedule: str | None
    grad_accum_steps: int
    memory: dict
    flops: dict
    collectives: dict
    time: dict
    fits: bool
    needed_bytes: float
    available_bytes: float
    advice: str
    compile_s: float
    analytic_time: dict
    gpu: dict | None = None    # a GPU target's plan (jaxpar.plan.gpu_plan): collectives by dtype, fp8 GEMMs, attention
    experts: dict | None = None  # a mixture of experts' plan (jaxpar.plan.experts.compiled_experts); None when dense

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def report(self) -> str:
        """A few lines: layout, memory (compiled beside analytic), FLOPs, collectives, time, fit."""
        if self.gpu is not None:
            return gpu_report(self) + self._experts_line()
        mem, gib = self.memory, GiB_text
        across = [f"{a}={s}" for a, s in self.hosts["across_hosts"].items() if s > 1]
        lines = [f"{self.label}: {self.model['name']} on {' x '.join(f'{a}={s}' for a, s in self.mesh.items())}"
                 f" ({self.device}; across hosts: {' x '.join(across) or 'none'}), batch {self.global_batch} x "
                 f"{self.seq_len}"
                 + (f", schedule {self.schedule}" if self.schedule else "") + f"; compiled in {self.compile_s:.1f} s",
                 f"  memory/device: compiled {gib(mem['compiled_bytes'])} (args {gib(mem['argument_bytes'])}, temp "
                 f"{gib(mem['temp_bytes'])}); analytic {gib(mem['analytic_bytes'])} = "
                 + ", ".join(f"{k} {gib(v)}" for k, v in mem["analytic"].items() if v) + f"; ratio {mem['ratio']:.2f}"
                 + (f"; largest XLA:CPU f32 upcast copy {gib(mem['cpu_upcast_bytes'])}" if mem["cpu_upcast_bytes"]
                    else ""),
                 f"  FLOPs/device: HLO {self.flops['hlo']:.3e} (cost_analysis {self.flops['cost_analysis']:.3e}, "
                 f"model 6N {self.flops['model']:.3e})",
                 "  collectives/step: " + (", ".join(f"{k} over {a} {GiB_text(b)}" for k, d in self.collectives.items()
                                                     for a, b in d.items()) or "none"),
                 f"  time: compute {self.time['compute_s'] * 1e3:.3g} ms, HBM {self.time['hbm_s'] * 1e3:.3g} ms, comm "
                 f"{self.time['comm_s'] * 1e3:.3g} ms -> step {self.time['step_s'] * 1e3:.3g} ms (overlapped "
                 f"{self.time['step_overlap_s'] * 1e3:.3g} ms), MFU {self.time['mfu']:.1%}; analytic step "
                 f"{self.analytic_time['step_s'] * 1e3:.3g} ms",
                 f"  fits: {gib(self.needed_bytes)} needed, {gib(self.available_bytes)} available" if self.fits
                 else f"  {self.advice}"]
        return "\n".join(lines) + self._experts_line()

    def _experts_line(self) -> str:
        from jaxpar.plan.experts import report_line
        return "" if self.experts is None else "\n" + report_line(self.experts)


def GiB_text(b: float) -> str:
    """``b`` bytes as GiB, MiB or KiB (binary units), three significant digits."""
    for unit, size in (("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= size or unit == "KiB":
            return f"{b / size:.3g} {unit}"



def policy_of(cfg: Any):
    """The state's precision policy from the model config (its one source): params ``param_dtype`` (None:
    float32), compute ``dtype`` (None: float32), output float32."""
    from jaxpar.precision.policy import Policy
    return Policy(cfg.param_dtype or jnp.float32, cfg.dtype or jnp.float32, jnp.float32)


def default_tx(model: Any) -> Any:
    """The optimizer a plan assumes unless given one: the experiments' ``jp.optim.adamw`` (float32 moments)."""
    from jaxpar.train import optim
    return optim.adamw(3e-4, total_steps=10_000, warmup_steps=100,
                       axis_names=jax.eval_shape(model.init, jax.random.key(0)))


def build_step(model_config: Any, mesh: Any, schedule: Any = None, grad_accum_steps: int = 1, donate: bool = True,
               *, tx: Any = None, policy: Any = None, rules: Any = None):
    """``(model, tx, step, abstract_state)`` of the train step of a model of the protocol, or of the model a config
    builds, on ``mesh``: the same step a run builds (a pipeline's state in its schedule's stage layout, as
    ``experiments/charlm.py`` trains it). ``tx``: the optimizer (None: :func:`default_tx`); ``policy``: the
    precision policy (None: :func:`policy_of` the config; give one for fp8 dots, ``dot="fp8"``); ``rules``: the
    logical rules (None: ``jp.sharding.DEFAULT_RULES``; e.g. ``jp.sharding.expert_parallel_rules``).

    Raises:
      TypeError: as :func:`jaxpar.plan.memory.model_and_config`.
    """
    from jaxpar.train import step as train
    from jaxpar import pipeline
    model, cfg = plan_memory.model_and_config(model_config)
    tx = default_tx(model) if tx is None else tx
    from jaxpar.sharding.rules import DEFAULT_RULES
    rules = DEFAULT_RULES if rules is None else rules
    pipe = None if schedule is None else pipeline.Pipeline.from_model(model, schedule)
    step = train.make_train_step(model.loss if pipe is None else pipe, tx, mesh=mesh, rules=rules,
                                 grad_accum_steps=grad_accum_steps, donate=donate)
    state = train.abstract_state(model.init, tx, mesh=mesh, rules=rules, policy=policy or policy_of(cfg),
                                 pipeline=pipe)
    return model, tx, step, state


def batch_structs(global_batch: int, seq_len: int) -> dict:
    return {k: jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32) for k in LM_KEYS}


def collectives_by_kind(stats: plan_hlo.HloStats) -> dict[str, dict[str, float]]:
    """``{kind: {axes: payload bytes per step}}`` of a program's collectives (axes ``"+"``-joined)."""
    out: dict[str, dict[str, float]] = {}
    for c in stats.collectives:
        by_axes = out.setdefault(c.kind, {})
        by_axes["+".join(c.axes)] = by_axes.get("+".join(c.axes), 0.0) + c.bytes * c.count
    return out


def model_summary(model: Any, cfg: Any) -> dict:
    n = cfg.num_params()
    name = f"{type(model).__name__} {f'{n / 1e9:.2f}B' if n >= 1e9 else f'{n / 1e6:.2f}M'} (d={cfg.d_model}, layers={cfg.num_layers}, heads={cfg.num_heads})"
    return {"name": name, "num_params": cfg.num_params(), "d_model": cfg.d_model, "num_layers": cfg.num_layers,
            "num_heads": cfg.num_heads, "vocab": cfg.padded_vocab, "remat": cfg.remat,
            "compute_dtype": jnp.dtype(cfg.dtype or jnp.float32).name, "scan_layers": cfg.scan_layers}


def _gib(b: float) -> str:
    return f"{b / GiB:.3g} GiB"


def gpu_report(plan: Any) -> str:
    """The lines of a GPU :class:`jaxpar.plan.planner.Plan`: layout, memory (GPU beside CPU-simulated and
    analytic), collectives by kind/axes/dtype, fp8 GEMMs, attention kernel, replayed time, fit."""
    mem, t, g = plan.memory, plan.time, plan.gpu
    across = [f"{a}={s}" for a, s in plan.hosts["across_hosts"].items() if s > 1]
    cpu = mem.get("cpu_compiled_bytes")
    d = g["dots"]
    fp8 = (f"{d['fp8_dots']:.0f} of {d['dots']:.0f} dots fp8 ({d['fp8_triton_gemms']:.0f} Triton GEMMs, "
           f"{d['fp8_cublaslt_gemms']:.0f} cuBLASLt, {d['fp8_other']:.0f} not GEMM kernels; "
           f"{d['fp8_flops'] / max(d['flops'], 1):.0%} of the FLOPs)" if d["fp8_dots"] else "no fp8 dots")
    rows = [f"{r['kind']} over {r['axes']} {r['dtype']}{' async' if r['is_async'] else ' sync'} {_gib(r['bytes'])}"
            for r in g["collectives"] if r["bytes"] > 1024]
    by_link = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in sorted(t["comm_s_by"].items(), key=lambda kv: -kv[1]))
    return "\n".join([
        f"{plan.label}: {plan.model['name']} on {' x '.join(f'{a}={s}' for a, s in plan.mesh.items() if s > 1)}"
        f" (across hosts: {' x '.join(across) or 'none'}), batch {plan.global_batch} x {plan.seq_len}"
        + (f", schedule {plan.schedule}" if plan.schedule else "") + f"; compiled in {plan.compile_s:.1f} s",
        f"  GPU memory/device: {_gib(mem['compiled_bytes'])} (args {_gib(mem['argument_bytes'])}, temp "
        f"{_gib(mem['temp_bytes'])}) of {_gib(plan.available_bytes)} usable; CPU-simulated "
        + (_gib(cpu) if cpu is not None else "not compiled") + f"; analytic {_gib(mem['analytic_bytes'])}",
        f"  FLOPs/device: HLO {plan.flops['hlo']:.3e} (model 6N {plan.flops['model']:.3e}); {fp8}",
        f"  attention: {g['attention']}",
        "  collectives/step: " + ("; ".join(rows) or "none"),
        f"  time (replayed schedule, optimistic): kernels {t['compute_s'] * 1e3:.4g} ms (with matmuls "
        f"{t['gemm_s'] * 1e3:.4g} ms), collectives "
        f"{t['comm_s'] * 1e3:.4g} ms ({by_link or 'none'}), exposed {t['exposed_comm_s'] * 1e3:.4g} ms -> step "
        f"{t['step_s'] * 1e3:.4g} ms, {t['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {t['mfu']:.1%}; "
        f"analytic step {plan.analytic_time['step_s'] * 1e3:.4g} ms",
        f"  fits: {_gib(plan.needed_bytes)} needed, {_gib(plan.available_bytes)} available" if plan.fits
        else f"  {plan.advice}"])




__all__ = ["GiB_text", "Plan", "batch_structs", "build_step", "collectives_by_kind", "default_tx", "gpu_report",
           "model_summary", "policy_of"]
