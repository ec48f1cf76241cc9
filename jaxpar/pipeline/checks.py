"""The pipeline runtime's argument checks: run on the host, before tracing, so that a config mistake is a
ValueError/TypeError naming the value and the fix, never an XLA error from inside ``shard_map``.

Batch divisibility is :func:`jaxpar.grads.check_batch_size` (the one batch-size check of jaxpar); here only
what is particular to a pipeline: the mesh against the schedule, the stacked stage parameters, the stage
function keeping the activation's shape, and the loss returning a scalar.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxpar import grads
from jaxpar import sharding as shd
from jaxpar.pipeline.interpreter import AXIS, FSDP_GATHER
from jaxpar.pipeline.schedules import Schedule
from jaxpar.pipeline.stash import STASH_MODES


def struct(a: Any, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    """The ``ShapeDtypeStruct`` of ``a`` (an array or scalar), with ``shape`` in place of its own if given."""
    return jax.ShapeDtypeStruct(np.shape(a) if shape is None else shape, jnp.result_type(a))


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


def check_comm_options(fsdp_gather: str, comm: str = "step", what: str = "fsdp_gather") -> None:
    """Raises ValueError unless ``fsdp_gather`` is ``'step'`` or ``'action'`` (and the private ``comm`` is
    ``'step'`` or ``'action'``)."""
    if fsdp_gather not in FSDP_GATHER:
        raise ValueError(f"{what}={fsdp_gather!r}; use 'step' (gather each stage's weights over fsdp once per step "
                         "and keep them: least traffic) or 'action' (gather them inside every F/B/W action: least "
                         "memory)")
    if comm not in ("step", "action"):
        raise ValueError(f"comm={comm!r}; use 'step' (reduce gradients once per step) or 'action' (GSPMD reduces "
                         "them inside every backward action)")


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
            raise ValueError(f"stage_params{jax.tree_util.keystr(path)} has shape {shape}: every leaf needs a "
                             f"leading axis of exactly {where}")


def check_batch(x: Any, targets: Any, num_microbatches: int, mesh: Mesh, rules: shd.Rules) -> None:
    """Raises ValueError unless ``x`` and ``targets`` share a leading batch axis that splits into
    ``num_microbatches`` microbatches that split over the batch mesh axes of ``rules``
    (:func:`jaxpar.grads.check_batch_size`)."""
    if np.ndim(x) == 0:
        raise ValueError(f"x of shape {np.shape(x)} has no leading batch axis")
    batch = np.shape(x)[0]
    for path, t in jax.tree_util.tree_flatten_with_path(targets)[0]:
        if np.ndim(t) == 0 or np.shape(t)[0] != batch:
            raise ValueError(f"targets{jax.tree_util.keystr(path)} has shape {np.shape(t)}; its leading axis must "
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
