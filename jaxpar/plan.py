"""Plan a large GPU run on this machine: compile the real train step for a simulated mesh, read its costs.

``jp.plan.plan(GPTConfig(...), dict(data=8, fsdp=16, tensor=8), global_batch=1024, seq_len=2048)`` builds the
GPT's abstract state and batch (``jax.ShapeDtypeStruct``\\ s with the shardings training would give them) on a
mesh of that many host CPU devices, lowers and compiles the step ``jp.train.make_train_step`` builds (the code
that trains: ``step.lower(jp.train.abstract_state(...), batch).compile()``; a pipeline through
``jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, schedule)``), and reports per device:

* memory: XLA's ``memory_analysis()`` of the compiled step (arguments + outputs - donated + temporaries) beside
  the analytic estimate of :mod:`jaxpar.plan_memory` (params, optimizer state, gradients, activations), and
  whether it fits the GPU (datasheet capacity times ``memory_fraction``);
* FLOPs: ``cost_analysis()`` (which counts a loop body once) and the HLO's matmul FLOPs with every loop body
  counted by its trip count (:mod:`jaxpar.plan_hlo`), beside the model's ``6 N`` per token;
* collectives: payload bytes by kind (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute)
  and mesh axis, read from the HLO's replica groups;
* a roofline step time from :data:`jaxpar.metrics.GPU_DATASHEETS`: compute ``t_c = FLOPs / peak``, memory
  ``t_m = bytes accessed / HBM bandwidth``, communication ``t_x = sum over collectives of f * bytes / link``
  with ring factors ``f`` (all-reduce ``2 (g - 1) / g``, all-gather / reduce-scatter / all-to-all
  ``(g - 1) / g``, permute 1; ``g`` the group size) and the link NVLink when the group lies inside one host
  (``gpus_per_host`` consecutive devices of the mesh, tensor innermost: ``tensor`` and by default ``fsdp``),
  InfiniBand otherwise. ``step_s = max(t_c, t_m) + t_x`` (no overlap: the ranking's figure) and
  ``step_overlap_s = max(t_c, t_m, t_x)`` (perfect overlap); ``mfu = 6 N B L / (step_s * devices * peak)``
  with ``N`` the parameter count, ``B L`` the tokens of a step and ``peak`` the dense bf16 FLOP/s per GPU.

All figures are those of an **XLA:CPU compilation**: XLA:CPU computes bf16 work in float32 and keeps float32
copies of some bf16 buffers, and its collectives are not rewritten as a GPU's are (gradients stay all-reduces,
where XLA:GPU makes reduce-scatters), so GPU memory and traffic can differ; :attr:`Plan.memory` also gives the
largest such float32 copy found in the program.

Precision and remat come from the model config, their one source: ``GPTConfig.dtype`` (compute; None is
float32) and ``GPTConfig.param_dtype`` (storage; None is float32) become the state's
``jp.precision.Policy(param_dtype, compute_dtype, float32)``, and ``GPTConfig.remat`` is the GPT's own remat.
The optimizer is the experiments' ``jp.optim.adamw`` (float32 moments).

The device count is fixed when jax starts: a plan for ``n`` devices runs in this process when it has ``n`` CPU
devices (it uses the first ``n``: a process started with the largest count plans every smaller mesh), and in
a subprocess started with ``XLA_FLAGS=--xla_force_host_platform_device_count=n`` otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import metrics as _metrics
from jaxpar import plan_hlo, plan_memory
from jaxpar.mesh import AXES

GiB = 2 ** 30
_RING = {"all-reduce": lambda g: 2 * (g - 1) / g, "all-gather": lambda g: (g - 1) / g,
         "reduce-scatter": lambda g: (g - 1) / g, "all-to-all": lambda g: (g - 1) / g,
         "collective-permute": lambda g: 1.0}


@dataclasses.dataclass(frozen=True)
class GPU:
    """Datasheet figures of one GPU (see :data:`jaxpar.metrics.GPU_DATASHEETS` for the sources)."""
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


# ------------------------------------------------------------------------------------------------ checks

def mesh_sizes(mesh_shape: Any, num_devices: int | None = None) -> dict[str, int]:
    """``{data, pipe, fsdp, tensor}`` from a dict (missing axes are 1) or a 4-tuple in ``jp.AXES`` order.

    Raises:
      ValueError: an unknown axis, a size that is not a positive int, or (``num_devices`` given) sizes that do
        not multiply to it.
    """
    if isinstance(mesh_shape, (tuple, list)):
        if len(mesh_shape) != len(AXES):
            raise ValueError(f"mesh_shape {mesh_shape!r} must give one size per axis {AXES}")
        mesh_shape = dict(zip(AXES, mesh_shape))
    if not isinstance(mesh_shape, dict):
        raise ValueError(f"mesh_shape must be a dict like dict(data=8, fsdp=16, tensor=8), got {mesh_shape!r}")
    unknown = set(mesh_shape) - set(AXES)
    if unknown:
        raise ValueError(f"mesh_shape names unknown axes {sorted(unknown)}; the axes are {AXES}")
    sizes = {a: mesh_shape.get(a, 1) for a in AXES}
    for a, s in sizes.items():
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1:
            raise ValueError(f"mesh axis {a}={s!r} must be a positive int")
    n = math.prod(sizes.values())
    if num_devices is not None and n != num_devices:
        desc = " x ".join(f"{a}={s}" for a, s in sizes.items())
        raise ValueError(f"mesh {desc} multiplies to {n}, not the {num_devices} devices planned for; change the "
                         f"axis sizes so they multiply to {num_devices}")
    return {a: int(s) for a, s in sizes.items()}


def check_layout(cfg: Any, sizes: dict[str, int], global_batch: int, seq_len: int, schedule: Any,
                 grad_accum_steps: int, gpus_per_host: int) -> None:
    """Raises ValueError for a layout that cannot be compiled or cannot be built on hosts of ``gpus_per_host``."""
    t, f, p = sizes["tensor"], sizes["fsdp"], sizes["pipe"]
    if t > gpus_per_host or gpus_per_host % t:
        raise ValueError(f"tensor={t} would span hosts of {gpus_per_host} GPUs (tensor parallelism all-reduces "
                         f"inside every layer and needs NVLink): use a tensor size that divides {gpus_per_host}, "
                         "and more fsdp or data for the rest")
    for what, size, axis, n in (("num_heads", cfg.num_heads, "tensor", t), ("mlp_dim", cfg.mlp_dim, "tensor", t),
                                ("padded vocab", cfg.padded_vocab, "tensor", t), ("d_model", cfg.d_model, "fsdp", f)):
        if size % n:
            raise ValueError(f"{what} {size} is not divisible by {axis}={n}; choose a {axis} size dividing it")
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds GPTConfig.max_seq_len {cfg.max_seq_len}; raise max_seq_len")
    if (schedule is None) != (p == 1):
        raise ValueError(f"pipe={p} needs a pipeline schedule (e.g. jp.pipeline.one_f_one_b({p}, 8)); pipe=1 takes "
                         f"none; got schedule={getattr(schedule, 'name', schedule)!r}")
    m = 1
    if schedule is not None:
        m, stages = schedule.num_microbatches, schedule.num_stages * schedule.num_chunks
        if schedule.num_stages != p or cfg.num_layers % stages:
            raise ValueError(f"the schedule has {schedule.num_stages} stages x {schedule.num_chunks} chunks; it needs "
                             f"num_stages = pipe = {p} and num_layers ({cfg.num_layers}) divisible by {stages}")
    rows = grad_accum_steps * m * sizes["data"] * f
    if not isinstance(global_batch, (int, np.integer)) or global_batch < 1 or global_batch % rows:
        raise ValueError(f"global_batch {global_batch!r} must be a multiple of grad_accum_steps x microbatches x "
                         f"data x fsdp = {grad_accum_steps} x {m} x {sizes['data']} x {f} = {rows}")


# ------------------------------------------------------------------------------------------------ result

@dataclasses.dataclass
class Plan:
    """A planned layout, per device (bytes, FLOPs, seconds). ``report()`` prints it; ``to_dict()`` for JSON.

    ``memory``: ``compiled_bytes`` (XLA:CPU ``memory_analysis``: arguments + outputs - aliased + temporaries) and
    its parts, ``params_bytes`` / ``opt_state_bytes`` (the sharded state exactly), ``analytic`` (the
    :mod:`jaxpar.plan_memory` parts) and ``analytic_bytes``, ``ratio`` (compiled / analytic),
    ``cpu_upcast_bytes`` (the largest float32 copy of a bf16 buffer in the program). ``flops``: ``hlo`` (matmul
    FLOPs, loops by trip count), ``cost_analysis`` (XLA's, loop bodies once), ``model`` (``6 N`` per token times
    the device's tokens). ``collectives``: ``{kind: {axes: bytes}}`` per step. ``time``: the roofline terms
    and ``step_s``, ``step_overlap_s``, ``mfu``.
    """
    label: str
    model: dict
    mesh: dict
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def report(self) -> str:
        """A few lines: layout, memory (compiled beside analytic), FLOPs, collectives, time, fit."""
        mem, gib = self.memory, lambda b: f"{b / GiB:.2f} GiB"
        lines = [f"{self.label}: {self.model['name']} on {' x '.join(f'{a}={s}' for a, s in self.mesh.items())}"
                 f" ({self.device}), batch {self.global_batch} x {self.seq_len}"
                 + (f", schedule {self.schedule}" if self.schedule else "") + f"; compiled in {self.compile_s:.1f} s",
                 f"  memory/device: compiled {gib(mem['compiled_bytes'])} (args {gib(mem['argument_bytes'])}, temp "
                 f"{gib(mem['temp_bytes'])}); analytic {gib(mem['analytic_bytes'])} = "
                 + ", ".join(f"{k} {gib(v)}" for k, v in mem["analytic"].items() if v) + f"; ratio {mem['ratio']:.2f}"
                 + (f"; largest XLA:CPU f32 upcast copy {gib(mem['cpu_upcast_bytes'])}" if mem["cpu_upcast_bytes"] else ""),
                 f"  FLOPs/device: HLO {self.flops['hlo']:.3e} (cost_analysis {self.flops['cost_analysis']:.3e}, "
                 f"model 6N {self.flops['model']:.3e})",
                 "  collectives/step: " + (", ".join(f"{k} over {a} {b / GiB:.2f} GiB" for k, d in self.collectives.items()
                                                     for a, b in d.items()) or "none"),
                 f"  time: compute {self.time['compute_s'] * 1e3:.1f} ms, HBM {self.time['hbm_s'] * 1e3:.1f} ms, comm "
                 f"{self.time['comm_s'] * 1e3:.1f} ms -> step {self.time['step_s'] * 1e3:.1f} ms (overlapped "
                 f"{self.time['step_overlap_s'] * 1e3:.1f} ms), MFU {self.time['mfu']:.1%}",
                 f"  {'fits' if self.fits else 'DOES NOT FIT'}: {gib(self.needed_bytes)} needed, "
                 f"{gib(self.available_bytes)} available" + ("" if self.fits else f"; {self.advice}")]
        return "\n".join(lines)


def does_not_fit_message(needed: float, available: float, suggestions: list[str]) -> str:
    return (f"does not fit: {needed / GiB:.1f} GiB needed per device, {available / GiB:.1f} available; try "
            + ", or ".join(suggestions))


def suggestions(cfg: Any, sizes: dict[str, int], parts: dict[str, float], grad_accum_steps: int,
                global_batch: int, gpus_per_host: int) -> list[str]:
    """Concrete changes that lower per-device memory, the largest part's remedy first."""
    out = []
    state = parts["params"] + parts["grads"] + parts["opt_state"] + parts["compute_params"]
    if cfg.remat == "none":
        out.append("remat='full' (GPTConfig.remat: saves only each block's input)")
    if sizes["data"] >= 2:
        out.append(f"fsdp={sizes['fsdp'] * 2}, data={sizes['data'] // 2} (shards params, gradients and optimizer "
                   "state twice as finely)")
    rows = grad_accum_steps * 2 * sizes["data"] * sizes["fsdp"]
    if global_batch % rows == 0:
        out.append(f"grad_accum_steps={grad_accum_steps * 2} (half the microbatch, half the activations)")
    if cfg.num_layers % (sizes["pipe"] * 2) == 0 and (sizes["data"] >= 2 or sizes["fsdp"] >= 2):
        out.append(f"pipe={sizes['pipe'] * 2} (half the layers per device)")
    if state > parts["activations"] and sizes["tensor"] * 2 <= gpus_per_host:
        out.append(f"tensor={sizes['tensor'] * 2}")
    return out or ["more devices"]


# ------------------------------------------------------------------------------------------------ costs

def _spans_hosts(axes: tuple[str, ...], sizes: dict[str, int], gpus_per_host: int) -> bool:
    """Whether a group along ``axes`` (from device 0, mesh order row-major) holds devices of several hosts."""
    grids = np.meshgrid(*[np.arange(sizes[a]) if a in axes else np.zeros(1, int) for a in AXES], indexing="ij")
    flat = np.ravel_multi_index([g.ravel() for g in grids], [sizes[a] for a in AXES])
    return len(set((flat // gpus_per_host).tolist())) > 1


def roofline(stats: plan_hlo.HloStats, sizes: dict[str, int], spec: GPU, gpus_per_host: int,
             model_flops_total: float) -> dict:
    """The step-time terms of the module docstring (seconds) and the MFU they imply."""
    comm: dict[str, float] = {}
    for c in stats.collectives:
        link = spec.infiniband_bytes_per_s if _spans_hosts(c.axes, sizes, gpus_per_host) else spec.nvlink_bytes_per_s
        label = "+".join(c.axes)
        comm[label] = comm.get(label, 0.0) + _RING[c.kind](c.group_size) * c.bytes * c.count / link
    t_c, t_m, t_x = stats.flops / spec.peak_flops, stats.bytes_accessed / spec.hbm_bytes_per_s, sum(comm.values())
    step = max(t_c, t_m) + t_x
    n = math.prod(sizes.values())
    return {"compute_s": t_c, "hbm_s": t_m, "comm_s": t_x, "comm_s_by_axes": comm, "step_s": step,
            "step_overlap_s": max(t_c, t_m, t_x), "mfu": model_flops_total / (step * n * spec.peak_flops),
            "mfu_formula": "6 * num_params * global_batch * seq_len / (step_s * num_devices * peak_bf16_flops)"}


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

def policy_of(cfg: Any):
    """The state's precision policy from the model config (its one source): params ``param_dtype`` (None:
    float32), compute ``dtype`` (None: float32), output float32."""
    from jaxpar.precision import Policy
    return Policy(cfg.param_dtype or jnp.float32, cfg.dtype or jnp.float32, jnp.float32)


def build_step(cfg: Any, mesh: Any, schedule: Any = None, grad_accum_steps: int = 1, donate: bool = True):
    """``(model, tx, step, abstract_state)`` of the GPT train step on ``mesh``: the same step a run builds."""
    from jaxpar import optim, pipeline, train
    from jaxpar.models import GPT
    model = GPT(cfg)
    tx = optim.adamw(3e-4, total_steps=10_000, warmup_steps=100,
                     axis_names=jax.eval_shape(model.init, jax.random.key(0)))
    grad_fn = model.loss if schedule is None else pipeline.Pipeline(model.embed, model.stage, model.head_loss,
                                                                    schedule)
    step = train.make_train_step(grad_fn, tx, mesh=mesh, grad_accum_steps=grad_accum_steps, donate=donate)
    state = train.abstract_state(model.init, tx, mesh=mesh, policy=policy_of(cfg))
    return model, tx, step, state


def batch_structs(global_batch: int, seq_len: int) -> dict:
    return {k: jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32) for k in ("inputs", "targets")}


def _cpu_devices() -> list:
    try:
        return jax.devices("cpu")
    except RuntimeError:
        return []


def _plan_here(cfg, sizes, global_batch, seq_len, schedule, spec, grad_accum_steps, gpus_per_host,
               memory_fraction) -> Plan:
    from jaxpar.mesh import make_mesh
    n = math.prod(sizes.values())
    start = time.perf_counter()
    mesh = make_mesh(**sizes, devices=_cpu_devices()[:n])
    _, _, step, state = build_step(cfg, mesh, schedule, grad_accum_steps)
    compiled = step.lower(state, batch_structs(global_batch, seq_len)).compile()
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    stats = plan_hlo.analyze(text, dict(mesh.shape))
    parts = plan_memory.estimate(cfg, state, mesh, global_batch, seq_len, schedule, grad_accum_steps)
    memory = _memory(compiled, state, parts, text)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    tokens = global_batch * seq_len
    model_flops = 6.0 * cfg.num_params() * tokens
    collectives: dict[str, dict[str, float]] = {}
    for c in stats.collectives:
        by_axes = collectives.setdefault(c.kind, {})
        by_axes["+".join(c.axes)] = by_axes.get("+".join(c.axes), 0.0) + c.bytes * c.count
    available = spec.memory_bytes * memory_fraction
    needed = memory["compiled_bytes"]
    fits = needed <= available
    advice = "" if fits else does_not_fit_message(needed, available, suggestions(
        cfg, sizes, parts, grad_accum_steps, global_batch, gpus_per_host))
    return Plan(label="XLA:CPU compilation", model=_model_summary(cfg), mesh=sizes, device=spec.name,
                global_batch=global_batch, seq_len=seq_len, schedule=None if schedule is None else schedule.name,
                grad_accum_steps=grad_accum_steps, memory=memory,
                flops={"hlo": stats.flops, "cost_analysis": float(cost.get("flops", 0.0)), "model": model_flops / n,
                       "hlo_bytes_accessed": stats.bytes_accessed, "unknown_trip_counts": stats.unknown_trip_counts},
                collectives=collectives, time=roofline(stats, sizes, spec, gpus_per_host, model_flops), fits=fits,
                needed_bytes=needed, available_bytes=available, advice=advice, compile_s=compile_s)


def _model_summary(cfg: Any) -> dict:
    name = f"GPT {cfg.num_params() / 1e9:.2f}B (d={cfg.d_model}, layers={cfg.num_layers}, heads={cfg.num_heads})"
    return {"name": name, "num_params": cfg.num_params(), "d_model": cfg.d_model, "num_layers": cfg.num_layers,
            "num_heads": cfg.num_heads, "vocab": cfg.padded_vocab, "remat": cfg.remat,
            "compute_dtype": jnp.dtype(cfg.dtype or jnp.float32).name, "scan_layers": cfg.scan_layers}


def _plan_in_subprocess(args: tuple, n: int, timeout: float) -> Plan:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = os.path.join(tmp, "in.pkl"), os.path.join(tmp, "out.pkl")
        with open(inp, "wb") as f:
            pickle.dump(args, f)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        code = "import sys; from jaxpar.plan import _subprocess_main; _subprocess_main(sys.argv[1:])"
        proc = subprocess.run([sys.executable, "-c", code, inp, out], env=env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"planning on {n} simulated devices failed in its subprocess:\n{proc.stderr[-3000:]}")
        with open(out, "rb") as f:
            return pickle.load(f)


def plan(model_config: Any, mesh_shape: Any, *, global_batch: int, seq_len: int, schedule: Any = None,
         device: str = "h100-80gb", num_devices: int | None = None, grad_accum_steps: int = 1,
         gpus_per_host: int = 8, memory_fraction: float = 0.9, timeout: float = 900.0) -> Plan:
    """Compiles the GPT train step for ``mesh_shape`` on simulated CPU devices and returns its :class:`Plan`.

    Args:
      model_config: a ``jaxpar.models.GPTConfig``; its ``dtype`` / ``param_dtype`` give the precision policy and
        its ``remat`` the activation checkpointing (use ``scan_layers=True`` for deep models: compile time).
      mesh_shape: ``dict(data=, pipe=, fsdp=, tensor=)`` (missing axes 1) or a 4-tuple in that order.
      global_batch, seq_len: sequences per step and tokens per sequence.
      schedule: a ``jp.pipeline.Schedule`` with ``num_stages == pipe`` when ``pipe > 1``; None otherwise.
      device: a key of :data:`jaxpar.metrics.GPU_DATASHEETS` (``"h100-80gb"``, ``"h200"``, ``"a100-80gb"``).
      num_devices: if given, the mesh must multiply to it.
      grad_accum_steps: accumulation steps per update (``make_train_step``'s).
      gpus_per_host: GPUs per host (NVLink domain); ``tensor`` must divide it.
      memory_fraction: the part of the GPU's memory the run may use (jax preallocates 75% unless
        ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is raised; 0.9 assumes it is).
      timeout: seconds allowed for the planning subprocess (when one is needed).

    Returns:
      A :class:`Plan`; a layout that does not fit is a Plan with ``fits=False`` and ``advice`` reading "does not
      fit: X GiB needed per device, Y available; try ...", not an exception.

    Raises:
      ValueError (before anything compiles): a mesh that does not multiply to ``num_devices``, a ``tensor``
        axis that would span hosts, sizes the model does not divide, a batch the layout cannot split, a
        schedule that does not match ``pipe``, an unknown ``device``.
    """
    from jaxpar.models import GPTConfig
    if not isinstance(model_config, GPTConfig):
        raise TypeError(f"model_config must be a jaxpar.models.GPTConfig, got {type(model_config).__name__}")
    spec = gpu(device)
    sizes = mesh_sizes(mesh_shape, num_devices)
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps={grad_accum_steps!r} must be a positive int")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction={memory_fraction!r} must lie in (0, 1]")
    check_layout(model_config, sizes, global_batch, seq_len, schedule, grad_accum_steps, gpus_per_host)
    args = (model_config, sizes, global_batch, seq_len, schedule, spec, grad_accum_steps, gpus_per_host,
            memory_fraction)
    n = math.prod(sizes.values())
    if len(_cpu_devices()) >= n:
        return _plan_here(*args)
    return _plan_in_subprocess(args, n, timeout)


def _subprocess_main(argv: list[str]) -> None:
    with open(argv[0], "rb") as f:
        args = pickle.load(f)
    result = _plan_here(*args)
    with open(argv[1], "wb") as f:
        pickle.dump(result, f)

