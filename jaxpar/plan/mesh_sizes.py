"""Layouts of a planned run: mesh sizes, their split over hosts, the checks a layout must pass, and the
changes that lower per-device memory when a layout does not fit.

Plain Python on sizes (nothing is traced): :func:`check_layout` is what :func:`jaxpar.plan.plan` and
:func:`jaxpar.plan.estimate` run before compiling, and what a layout sweep (``experiments/plan.py``) filters its
candidates by; :func:`suggestions` proposes only layouts that pass it (but for a deeper pipeline, which needs its
own schedule).
"""

from __future__ import annotations

import math
from typing import Any


from jaxpar._validate import positive_int
from jaxpar.sharding.mesh import split_axes
from jaxpar.sharding.names import AXES, CONTEXT, DATA, FSDP, PIPE, TENSOR

GiB = 2 ** 30


def mesh_sizes(mesh_shape: Any, num_devices: int | None = None) -> dict[str, int]:
    """``{data, pipe, fsdp, context, tensor}`` from a dict (missing axes are 1) or a tuple in ``jp.AXES`` order
    (five sizes, or four without context: data, pipe, fsdp, tensor).

    Raises:
      ValueError: an unknown axis, a size that is not a positive int, or (``num_devices`` given) sizes that do
        not multiply to it.
    """
    if isinstance(mesh_shape, (tuple, list)):
        if len(mesh_shape) not in (len(AXES), len(AXES) - 1):
            raise ValueError(f"mesh_shape {mesh_shape!r} must give one size per axis {AXES}")
        mesh_shape = dict(zip(AXES if len(mesh_shape) == len(AXES) else
                              [a for a in AXES if a != CONTEXT], mesh_shape))
    if not isinstance(mesh_shape, dict):
        raise ValueError(f"mesh_shape must be a dict like dict(data=8, fsdp=16, tensor=8), got {mesh_shape!r}")
    unknown = set(mesh_shape) - set(AXES)
    if unknown:
        raise ValueError(f"mesh_shape names unknown axes {sorted(unknown)}; the axes are {AXES}")
    sizes = {a: positive_int(f"mesh axis {a}", mesh_shape.get(a, 1)) for a in AXES}
    n = math.prod(sizes.values())
    if num_devices is not None and n != num_devices:
        desc = " x ".join(f"{a}={s}" for a, s in sizes.items())
        raise ValueError(f"mesh {desc} multiplies to {n}, not the {num_devices} devices planned for; change the "
                         f"axis sizes so they multiply to {num_devices}")
    return sizes


def host_split(sizes: dict[str, int], gpus_per_host: int) -> tuple[dict[str, int], dict[str, int]]:
    """``(per_host, across_hosts)`` sizes of the mesh on hosts of ``gpus_per_host`` GPUs: the default split of
    :func:`jaxpar.sharding.mesh.split_axes` (what ``jp.make_mesh(..., devices_per_host=gpus_per_host)`` builds); a mesh
    of at most one host is all within it.

    Raises:
      ValueError: more devices than one host that are not whole hosts, or the errors of ``split_axes`` (a
        tensor axis larger than a host).
    """
    gpus_per_host = positive_int("gpus_per_host", gpus_per_host)
    n = math.prod(sizes.values())
    if n <= gpus_per_host:
        return dict(sizes), {a: 1 for a in AXES}
    if n % gpus_per_host:
        raise ValueError(f"{n} devices are not whole hosts of gpus_per_host={gpus_per_host} GPUs; plan a multiple "
                         f"of {gpus_per_host} devices, or set gpus_per_host to the GPUs of one node")
    return split_axes(sizes, n // gpus_per_host)


def check_layout(cfg: Any, sizes: dict[str, int], global_batch: int, seq_len: int, schedule: Any,
                 grad_accum_steps: int, gpus_per_host: int) -> None:
    """Raises ValueError for a layout that cannot be compiled or cannot be built on hosts of ``gpus_per_host``:
    a tensor axis spanning hosts, model sizes the axes do not divide, a bad ``seq_len`` / ``global_batch``, a
    schedule that is not a ``jp.pipeline.Schedule`` matching ``pipe``, a mesh that is not whole hosts."""
    from jaxpar.pipeline import Schedule
    gpus_per_host = positive_int("gpus_per_host", gpus_per_host)
    t, f, p = sizes[TENSOR], sizes[FSDP], sizes[PIPE]
    if t > gpus_per_host or gpus_per_host % t:
        raise ValueError(f"tensor={t} would span hosts of {gpus_per_host} GPUs (tensor parallelism all-reduces "
                         f"inside every layer and needs NVLink): use a tensor size that divides {gpus_per_host}, "
                         "and more fsdp or data for the rest")
    host_split(sizes, gpus_per_host)
    for what, size, axis, n in (("num_heads", cfg.num_heads, TENSOR, t), ("mlp_dim", cfg.mlp_dim, TENSOR, t),
                                ("padded vocab", cfg.padded_vocab, TENSOR, t), ("d_model", cfg.d_model, FSDP, f)):
        if size % n:
            raise ValueError(f"{what} {size} is not divisible by {axis}={n}; choose a {axis} size dividing it")
    positive_int("seq_len", seq_len)
    if seq_len % (2 * sizes.get(CONTEXT, 1)) and sizes.get(CONTEXT, 1) > 1:
        raise ValueError(f"seq_len {seq_len} is not divisible by 2 x context = {2 * sizes['context']} (the zigzag "
                         "split of context parallelism); choose a context size whose double divides seq_len")
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds GPTConfig.max_seq_len {cfg.max_seq_len}; raise max_seq_len")
    if schedule is not None and not isinstance(schedule, Schedule):
        raise ValueError(f"schedule={schedule!r} is not a jp.pipeline.Schedule; build the table, e.g. "
                         f"jp.pipeline.one_f_one_b({p}, 8) (also gpipe, interleaved_1f1b, zero_bubble, "
                         "zero_bubble_v), or pass None for pipe=1")
    if schedule is None and p > 1:
        raise ValueError(f"pipe={p} needs a pipeline schedule (e.g. jp.pipeline.one_f_one_b({p}, 8)); got "
                         "schedule=None")
    if schedule is not None and p == 1:
        other = (f"a mesh with pipe={schedule.num_stages} (the schedule's num_stages)" if schedule.num_stages > 1
                 else "a mesh with pipe > 1 and a schedule of that many stages")
        raise ValueError(f"schedule={schedule.name!r} was given but the mesh has pipe=1 (planned without a "
                         f"pipeline): pass schedule=None, or {other}")
    m = 1
    if schedule is not None:
        m, stages = schedule.num_microbatches, schedule.num_stages * schedule.num_chunks
        if schedule.num_stages != p or cfg.num_layers % stages:
            raise ValueError(f"the schedule has {schedule.num_stages} stages x {schedule.num_chunks} chunks; it needs "
                             f"num_stages = pipe = {p} and num_layers ({cfg.num_layers}) divisible by {stages}")
    rows = grad_accum_steps * m * sizes[DATA] * f
    multiple = (f" multiple of grad_accum_steps x microbatches x data x fsdp = {grad_accum_steps} x {m} x "
                f"{sizes['data']} x {f} = {rows}")
    if positive_int("global_batch", global_batch, multiple) % rows:
        raise ValueError(f"global_batch={global_batch!r} must be a positive int{multiple}")


def does_not_fit_message(needed: float, available: float, suggestions: list[str]) -> str:
    return (f"does not fit: {needed / GiB:.1f} GiB needed per device, {available / GiB:.1f} available; try "
            + ", or ".join(suggestions))


def suggestions(cfg: Any, sizes: dict[str, int], parts: dict[str, float], grad_accum_steps: int,
                global_batch: int, seq_len: int, schedule: Any, gpus_per_host: int, available: float) -> list[str]:
    """Concrete changes that lower per-device memory, each keeping the device count and, but for a deeper
    pipeline (which needs its own schedule), passing :func:`check_layout`: remat, moving a factor of ``data``
    to ``fsdp`` (the smallest that fits ``available`` bytes by the analytic ``parts``, else all of it), twice
    the accumulation steps, doubling ``pipe``, ``tensor`` or (activations larger than the state) ``context`` (the
    factor taken from ``data``, else ``fsdp``)."""
    out = [] if cfg.remat == "full" else ["remat='full' (GPTConfig.remat: saves only each block's input)"]

    def valid(new_sizes: dict[str, int], accum: int = grad_accum_steps) -> bool:
        try:
            check_layout(cfg, new_sizes, global_batch, seq_len, schedule, accum, gpus_per_host)
        except ValueError:
            return False
        return True

    def moved(axis: str, source: str) -> dict[str, int] | None:
        return None if sizes[source] % 2 else {**sizes, axis: sizes[axis] * 2, source: sizes[source] // 2}

    state = parts["params"] + parts["grads"] + parts["opt_state"] + parts["compute_params"] + parts["grad_accumulator"]
    fixed = parts["activations"] + parts.get("pipeline_buffers", 0.0)   # not divided by a larger fsdp
    d = sizes[DATA]
    moves = [{**sizes, FSDP: sizes[FSDP] * k, DATA: d // k} for k in range(2, d + 1) if d % k == 0]
    moves = [m for m in moves if valid(m)]
    if moves:
        new = next((m for m in moves if state * sizes[FSDP] / m[FSDP] + fixed <= available),
                   moves[-1])
        out.append(f"fsdp={new['fsdp']}, data={new['data']} (params, gradients and optimizer state sharded "
                   f"{new['fsdp'] // sizes['fsdp']} times as finely)")
    if valid(sizes, accum=grad_accum_steps * 2):
        out.append(f"grad_accum_steps={grad_accum_steps * 2} (half the activations)")
    for axis, why in ((PIPE, " (half the layers per device)"), (TENSOR, ""),
                      (CONTEXT, " (each sequence over twice the devices: half the activations)")):
        if axis == TENSOR and state <= parts["activations"] or axis == CONTEXT and state > parts["activations"]:
            continue
        for source in (DATA, FSDP):
            new = moved(axis, source)
            if new and (axis == PIPE and cfg.num_layers % new[PIPE] == 0 or axis != PIPE and valid(new)):
                out.append(f"{axis}={new[axis]}, {source}={new[source]}{why}")
                break
    n = math.prod(sizes.values())
    whole = state * n / sizes[DATA]          # the state once, over all shards
    if whole / n + fixed > available:
        room = available - fixed
        least = math.ceil(whole / room / gpus_per_host) * gpus_per_host if room > 0 else None
        out.append(f"more devices (the state alone is {whole / GiB:.0f} GiB: at least {least} GPUs sharding it)"
                   if least else "fewer tokens per device (the activations alone exceed the memory)")
    return out or ["more devices"]
