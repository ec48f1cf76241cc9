"""The pipeline runtime's argument checks: run on the host, before tracing, so that a config mistake is a
ValueError/TypeError naming the value and the fix, never an XLA error from inside ``shard_map``.

Batch divisibility is :func:`jaxpar.train.grads.check_batch_size` (the one batch-size check of jaxpar); here only
what is particular to a pipeline: the mesh against the schedule, the stacked stage parameters, the stage
function keeping the activation's shape, and the loss returning a scalar; and the plain-Python checks of the
schedule API (builder sizes, a Schedule where one is needed, per-action costs, placements, and the entries of
a user's action lists). What a ``Schedule`` checks of itself on construction (its sizes, the table-size bound
:data:`~jaxpar.pipeline.schedules.MAX_TABLE_ENTRIES`, its actions) lives beside it in
:mod:`jaxpar.pipeline.schedules`, so the pipeline's modules import in one direction.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxpar._tree import key_path
from jaxpar.train import grads
from jaxpar.sharding import rules as shd
from jaxpar._validate import positive_int
from jaxpar.pipeline.interpreter import AXIS, FSDP_GATHER

GRAD_REDUCE = ("step", "action")   # where a pipeline reduces data-parallel gradients: once per step, or per backward
from jaxpar.pipeline.schedules import KINDS, Action, Placement, Schedule, check_table_size, is_index
from jaxpar.pipeline.stash import STASH_MODES


def struct(a: Any, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    """The ``ShapeDtypeStruct`` of ``a`` (an array or scalar), with ``shape`` in place of its own if given."""
    return jax.ShapeDtypeStruct(np.shape(a) if shape is None else shape, jnp.result_type(a))


# --------------------------------------------------------------------------------- the schedule API

_NO_CHUNKS = object()   # a builder without a num_chunks argument


def builder_sizes(name: str, num_stages: Any, num_microbatches: Any, num_chunks: Any = _NO_CHUNKS, *,
                  actions: int = 2) -> tuple[int, int, int]:
    """A builder's sizes as ints ``(p, m, v)`` (``v = 1`` for a builder without ``num_chunks``), checked: positive
    integers, and a table within :data:`~jaxpar.pipeline.schedules.MAX_TABLE_ENTRIES`. Every stage runs
    ``actions`` actions per microbatch and chunk (2: ``F``, ``B``; 3 with ``W``; ZB-V's two chunks: 6), the last
    stage's first at tick ``p - 1`` at the earliest, so the table has at least ``actions * v * m + p - 1`` ticks.

    Raises:
      ValueError: a size that is not a positive integer, or a table over the bound (naming the sizes).
    """
    p, m = positive_int("num_stages", num_stages), positive_int("num_microbatches", num_microbatches)
    v = 1 if num_chunks is _NO_CHUNKS else positive_int("num_chunks", num_chunks)
    call = f"{name}(num_stages={p}, num_microbatches={m}" + (")" if num_chunks is _NO_CHUNKS else f", num_chunks={v})")
    check_table_size(call, actions * v * m + p - 1, p, at_least=True)
    return p, m, v


def check_schedule(value: Any, what: str) -> None:
    """Raises TypeError unless ``value`` is a :class:`Schedule`, naming what ``what`` got and how to build one."""
    if not isinstance(value, Schedule):
        hint = " (a list of schedules goes to jp.pipeline.compare)" if isinstance(value, (list, tuple)) else ""
        raise TypeError(f"{what} takes a jp.pipeline.Schedule, got {type(value).__name__} {value!r:.60}{hint}; build "
                        "one with a builder (e.g. jp.pipeline.one_f_one_b(num_stages, num_microbatches)) or "
                        "jp.pipeline.from_actions")


def check_schedule_list(schedules: Any, what: str = "compare") -> list[Schedule]:
    """``schedules`` as a list, each a :class:`Schedule`; TypeError for one Schedule, a string or a non-list."""
    if isinstance(schedules, Schedule):
        raise TypeError(f"{what} takes a list of jp.pipeline.Schedule objects, got one Schedule "
                        f"({schedules.name!r}); pass [schedule]")
    if isinstance(schedules, (str, bytes)) or not isinstance(schedules, Iterable):
        raise TypeError(f"{what} takes a list of jp.pipeline.Schedule objects, got {type(schedules).__name__} "
                        f"{schedules!r:.60}; build them with the builders (e.g. [jp.pipeline.one_f_one_b(4, 8)])")
    out = list(schedules)
    for i, s in enumerate(out):
        if not isinstance(s, Schedule):
            raise TypeError(f"{what} takes jp.pipeline.Schedule objects, got {type(s).__name__} {s!r:.60} at index "
                            f"{i}; build it with a builder (e.g. jp.pipeline.one_f_one_b(4, 8))")
    return out


def check_costs(costs: Any) -> dict[str, float] | None:
    """Per-action costs as ``{kind: float}`` (``None`` stays ``None``: the defaults).

    Raises:
      TypeError: ``costs`` not a mapping.
      ValueError: a key that is not an action kind (``'F'``, ``'B'``, ``'W'``), or a cost that is not a
        finite positive number (NaN, inf, 0, negative, a bool or a string), naming the key and value.
    """
    if costs is None:
        return None
    if not isinstance(costs, Mapping):
        raise TypeError(f"costs must be a dict of per-action costs like {{'F': 1, 'B': 2, 'W': 1}}, got "
                        f"{type(costs).__name__} {costs!r:.60}")
    for key, value in costs.items():
        if key not in KINDS:
            raise ValueError(f"costs has unknown key {key!r}; the keys are the action kinds {KINDS} "
                             "(F forward, B backward, W weight gradient, FB a fused forward and backward)")
        if (not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value)
                or value <= 0):
            raise ValueError(f"costs[{key!r}]={value!r}: a cost must be a finite positive number (time units of "
                             "one action)")
    return {k: float(v) for k, v in costs.items()}


def check_placement(placement: Any, num_stages: int) -> Placement:
    """``placement`` as a tuple of tuples of ints: ``num_stages`` rows of ``v`` virtual-stage indices holding
    ``0 .. num_stages * v - 1`` once each; else ValueError naming it and the fix."""
    fix = (f"give {num_stages} rows (one per stage) of num_chunks virtual-stage indices holding 0..{num_stages}*"
           f"num_chunks-1 once each, e.g. jp.pipeline.round_robin({num_stages}, 2) or jp.pipeline.v_shape("
           f"{num_stages})")
    try:
        rows = tuple(tuple(row) for row in placement)
    except TypeError:
        raise ValueError(f"placement={placement!r:.80} is not a table of virtual stages; {fix}") from None
    v = len(rows[0]) if rows else 0
    flat = [x for row in rows for x in row]
    if (len(rows) != num_stages or v == 0 or any(len(row) != v for row in rows)
            or any(not isinstance(x, numbers.Integral) or isinstance(x, bool) for x in flat)
            or sorted(flat) != list(range(num_stages * v))):
        raise ValueError(f"placement={placement!r:.80} does not place each virtual stage 0..{num_stages}*num_chunks-1 "
                         f"exactly once over the {num_stages} stages; {fix}")
    return tuple(tuple(int(x) for x in row) for row in rows)


def check_action(entry: Any, where: str) -> Action:
    """An :class:`Action` with a known kind and int microbatch and chunk ``>= 0`` (numpy ints become ints);
    else ValueError naming ``where`` (e.g. ``'stage 0, entry 3'``) and the entry."""
    if entry.kind not in KINDS:
        raise ValueError(f"{where}: {entry!r} has kind {entry.kind!r}; the kinds are {KINDS} (jp.pipeline.F, B, W, "
                         "FB)")
    if (entry.kind == "FB") != isinstance(entry.backward, Action) or (
            entry.kind == "FB" and entry.backward.kind != "B"):
        raise ValueError(f"{where}: {entry!r}: only an FB action has a backward (a B), and it needs one; build it "
                         "with jp.pipeline.FB(mb, chunk, b_mb, b_chunk)")
    for x in entry.parts():
        for field in ("microbatch", "chunk"):
            if not is_index(getattr(x, field)):
                raise ValueError(f"{where}: {entry!r} has {field}={getattr(x, field)!r}; it must be an int >= 0")
    back = entry.backward
    return Action(entry.kind, int(entry.microbatch), int(entry.chunk),
                  None if back is None else Action("B", int(back.microbatch), int(back.chunk)))


# ------------------------------------------------------------------------------------- the runtime

def check_mesh_and_schedule(schedule: Schedule, mesh: Mesh, stash: str = "residuals") -> None:
    """Raises TypeError/ValueError unless ``mesh`` has a ``pipe`` axis of the schedule's size and ``stash`` is a
    known mode (the runtime executes every valid table: any chunks and placement, fused or split backwards)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a jp.pipeline.Schedule (e.g. jp.pipeline.one_f_one_b(p, m)), got "
                        f"{type(schedule).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (from jp.make_mesh), got {type(mesh).__name__}")
    if AXIS not in mesh.axis_names:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} have no {AXIS!r} axis; build it with jp.make_mesh")
    if mesh.shape[AXIS] != schedule.num_stages:
        raise ValueError(f"the mesh has {AXIS}={mesh.shape[AXIS]} but schedule {schedule.name!r} has num_stages="
                         f"{schedule.num_stages}; build the schedule for {mesh.shape[AXIS]} stages or the mesh with "
                         f"pipe={schedule.num_stages}")
    if stash not in STASH_MODES:
        raise ValueError(f"stash={stash!r}; use one of {STASH_MODES}")


def check_comm_options(fsdp_gather: str, grad_reduce: str = "step", owner: str = "") -> None:
    """Raises ValueError unless ``fsdp_gather`` and ``grad_reduce`` are each ``'step'`` or ``'action'`` (the
    message names them as ``owner`` + name, e.g. ``Pipeline.fsdp_gather``)."""
    if fsdp_gather not in FSDP_GATHER:
        raise ValueError(f"{owner}fsdp_gather={fsdp_gather!r}; use 'step' (gather each stage's weights over fsdp once per step "
                         "and keep them: least traffic) or 'action' (gather them inside every F/B/W action: least "
                         "memory)")
    if grad_reduce not in GRAD_REDUCE:
        raise ValueError(f"{owner}grad_reduce={grad_reduce!r}; use 'step' (reduce the data-parallel gradients once per "
                         "step: least traffic) or 'action' (GSPMD reduces them inside every backward action)")


def check_stage_params(stage_params: Any, schedule: Schedule) -> None:
    """Raises ValueError unless every leaf has a leading axis of exactly ``num_stages * num_chunks``."""
    leaves = jax.tree_util.tree_flatten_with_path(stage_params)[0]
    if not leaves:
        raise ValueError("stage_params has no arrays; pass the stacked parameters of the stages")
    p, v = schedule.num_stages, schedule.num_chunks
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if not shape or shape[0] != p * v:
            where = (f"num_stages = {p} (index s = stage s); reshape stacked [layers, ...] params to "
                     f"[num_stages, layers // num_stages, ...]") if v == 1 else (
                     f"num_stages * num_chunks = {p * v} (the virtual stages in stage layout: "
                     f"jp.pipeline.to_stage_layout of the [{p * v}, ...] params in model order)")
            raise ValueError(f"stage_params{key_path(path, indexing=True)} has shape {shape}: every leaf needs a "
                             f"leading axis of exactly {where}")


def check_batch(x: Any, targets: Any, num_microbatches: int, mesh: Mesh, rules: shd.Rules,
                differentiable: bool = False) -> None:
    """Raises TypeError unless ``x`` is one array (a pytree of arrays is not: stages hand one activation to each
    other) and, with ``differentiable``, a floating one (its gradient is taken); ValueError unless ``x`` and
    ``targets`` share a leading batch axis that splits into ``num_microbatches`` microbatches that split over the
    batch mesh axes of ``rules`` (:func:`jaxpar.train.grads.check_batch_size`)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"x must be one array [batch, ...] (the activation the stages hand to each other), got "
                        f"{type(x).__name__} {x!r:.60}; a pytree of inputs goes into the embedding before the "
                        "pipeline (jp.pipeline.Pipeline's embed_fn), or concatenate them into one array")
    if differentiable and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x has dtype {x.dtype}: it must be a floating array (the pipeline differentiates with "
                        "respect to x and returns g_x); embed integer inputs (e.g. token ids) before the pipeline, "
                        "or cast x, e.g. x.astype(jnp.float32)")
    if np.ndim(x) == 0:
        raise ValueError(f"x of shape {np.shape(x)} has no leading batch axis")
    batch = np.shape(x)[0]
    for path, t in jax.tree_util.tree_flatten_with_path(targets)[0]:
        if np.ndim(t) == 0 or np.shape(t)[0] != batch:
            raise ValueError(f"targets{key_path(path, indexing=True)} has shape {np.shape(t)}; its leading axis must "
                             f"be x's batch ({batch})")
    grads.check_batch_size(batch, mesh, rules, microbatches=num_microbatches)


def check_stage_fn(stage_fn: Callable, stage_params: Any, x: Any, num_microbatches: int) -> jax.ShapeDtypeStruct:
    """Raises ValueError unless ``stage_fn`` maps one stage's params and a microbatch to the same shape and
    dtype; returns the microbatch's ``ShapeDtypeStruct``. Traces abstractly (``jax.eval_shape``), under the
    caller's mesh and rules."""
    one = jax.tree.map(lambda a: struct(a, np.shape(a)[1:]), stage_params)
    x_mb = struct(x, (np.shape(x)[0] // num_microbatches, *np.shape(x)[1:]))
    y = jax.eval_shape(stage_fn, one, x_mb)
    if not (hasattr(y, "shape") and y.shape == x_mb.shape and y.dtype == x_mb.dtype):
        got = f"{y.dtype}{list(y.shape)}" if hasattr(y, "shape") else repr(y)
        raise ValueError(f"stage_fn maps a microbatch {x_mb.dtype}{list(x_mb.shape)} to {got}: a pipeline stage "
                         "must keep the activation's shape and dtype (stages hand it to each other); move shape "
                         "changes into the embedding before the pipeline or the loss after it")
    return x_mb


def check_loss_fn(loss_fn: Callable, head_params: Any, x_mb: Any, targets: Any, num_microbatches: int,
                  has_aux: bool) -> None:
    """Raises ValueError unless ``loss_fn(head, y_mb, targets_mb)`` returns a float scalar (and aux if asked)."""
    t_mb = jax.tree.map(lambda t: struct(t, (np.shape(t)[0] // num_microbatches, *np.shape(t)[1:])), targets)
    out = jax.eval_shape(loss_fn, jax.tree.map(struct, head_params), x_mb, t_mb)
    loss = out[0] if has_aux and isinstance(out, (tuple, list)) and len(out) == 2 else out
    if not (hasattr(loss, "shape") and loss.shape == () and jnp.issubdtype(loss.dtype, jnp.floating)):
        want = "(scalar loss, aux)" if has_aux else "a float scalar"
        raise ValueError(f"loss_fn(head_params, y_mb, targets_mb) must return {want}, got {out}")
