"""The pipeline runtime's public API: :func:`value_and_grad` and :func:`apply` of a stack of stages.

Both run a schedule's table over the ``pipe`` mesh axis, in three parts:

* :mod:`jaxpar.pipeline.table`: the control-table compiler (a ``Schedule`` -> named ``[ticks, stages]``
  arrays and buffer sizes);
* :mod:`jaxpar.pipeline.interpreter`: the ``shard_map`` body that executes any table, and
  :mod:`jaxpar.pipeline.shard_map`: the traceable cores :func:`value_and_grad_core` / :func:`apply_core` (for use
  inside another jitted function);
* :mod:`jaxpar.pipeline.checks`: the argument checks, run before tracing.

This module validates, places host inputs, and jits the cores (``jaxpar.train._jit.MeshJit``) with outputs in the
inputs' shardings.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.sharding import rules as shd
from jaxpar.train._jit import MeshJit
from jaxpar.pipeline.checks import (check_batch, check_comm_options, check_loss_fn,
                                    check_mesh_and_schedule, check_stage_fn, check_stage_params)
from jaxpar.pipeline.shard_map import apply_core, value_and_grad_core
from jaxpar.pipeline.interpreter import AXIS
from jaxpar.pipeline.schedules import Schedule

__all__ = ["apply", "value_and_grad"]

def _placer(mesh: Mesh, specs: tuple) -> Callable:
    """``place(*args)``: host arrays (or arrays on other devices) put on ``mesh`` with the default spec of their
    argument (a function of the array's rank); arrays already on the mesh's devices are left as they are."""
    devices = set(mesh.devices.flat)

    def place_one(a, spec):
        if isinstance(a, jax.Array) and a.sharding.device_set == devices:
            return a
        return jax.device_put(a, NamedSharding(mesh, spec(np.ndim(a))))

    def place(*args):
        return tuple(jax.tree.map(lambda a, s=s: place_one(a, s), arg) for arg, s in zip(args, specs))
    return place


def _specs(mesh: Mesh, rules: shd.Rules):
    axes = shd.batch_axes(rules, mesh)
    staged = lambda ndim: P(AXIS)
    replicated = lambda ndim: P()
    batched = lambda ndim: P(axes or None)
    return axes, staged, replicated, batched


def value_and_grad(stage_fn: Callable, loss_fn: Callable, schedule: Schedule, *, mesh: Mesh,
                   rules: shd.Rules = shd.DEFAULT_RULES, stash: str = "residuals",
                   fsdp_gather: str = "step") -> Callable:
    """Loss and gradients of a pipelined model: ``f(stage_params, head_params, x, targets)``.

    The model is ``loss = mean_j loss_fn(head_params, stage_{V-1}(... stage_0(x_j)), targets_j)`` over the
    ``m`` microbatches ``j``, where ``stage_v(x) = stage_fn(params of virtual stage v, x)`` and ``V =
    num_stages * num_chunks``. The schedule's table decides the order of the forward and backward passes and
    where each virtual stage runs (GPipe: Huang et al. 2019; 1F1B and interleaved 1F1B: Narayanan et al.
    2021, sec. 2.2; ZB-H1 and ZB-V with split backwards: Qi et al. 2024); every schedule gives the same
    numbers up to float rounding.

    Args:
      stage_fn: ``stage_fn(params_of_one_virtual_stage, x_mb) -> y_mb``, ``y_mb`` of ``x_mb``'s shape and dtype.
        ``params_of_one_virtual_stage`` is one row of ``stage_params`` (its leading axis removed). It may use
        GSPMD constraints over the non-pipe axes (it runs inside ``shard_map`` over ``pipe`` only).
      loss_fn: ``loss_fn(head_params, y_mb, targets_mb) -> scalar`` (a mean over the microbatch), run on
        the stage holding the last virtual stage.
      schedule: a training :class:`Schedule` (``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``,
        ``zero_bubble``, ``zero_bubble_v``, or a user's table, e.g. ``from_actions``) with ``num_stages`` equal
        to the mesh's ``pipe`` size.
      mesh: a jaxpar mesh (``jp.make_mesh``).
      rules: logical axis rules; the ``batch`` rule gives the axes each microbatch is split over.
      stash: ``'residuals'`` (stash the input-dependent vjp residuals) or ``'inputs'`` (stash stage inputs
        and recompute the forward in the backward, and in the ``W`` of a split backward).
      fsdp_gather: ``'step'`` or ``'action'``: see "Communication".

    Returns:
      ``f(stage_params, head_params, x, targets) -> (loss, (g_stage_params, g_head_params, g_x))``, jitted.
      ``stage_params``: a pytree whose every leaf has a leading axis of ``V = num_stages * num_chunks``
      virtual stages in the schedule's **stage layout** (:func:`jaxpar.pipeline.to_stage_layout` of the
      ``[V, ...]`` params in model order; the identity with one chunk), placed on ``P('pipe')`` (host arrays
      are placed so); ``g_stage_params`` comes back in the same layout (:func:`jaxpar.pipeline.from_stage_layout`
      gives model order). ``head_params``: any pytree, replicated over ``pipe``. ``x``: ``[B, ...]``, the
      global batch leading; ``targets``: a pytree of ``[B, ...]`` arrays. Microbatch ``j`` is rows ``j, j+m,
      j+2m, ...`` (strided: each stays spread over the ``data``/``fsdp`` axes). ``loss``: float32 scalar.
      Gradients have their inputs' shapes, dtypes and shardings; ``g_x`` is ``d loss / d x`` (it includes the
      ``1/m``).

    Communication: with ``pipe > 1`` the ``shard_map`` is manual over ``pipe`` and the batch axes (``data``,
    ``fsdp``; ``tensor`` stays automatic), so gradients accumulate locally over the microbatches and are
    reduced once per step, after the tick loop (``psum`` over ``data``, ``psum_scatter`` over ``fsdp``), as
    Megatron and torchtitan do; inside, the stage function's logical constraints run with the batch axes
    mapped to None. This path because it uses only ``jax.shard_map``, ``lax.psum``/``psum_scatter``/
    ``all_gather``/``pcast`` with ``check_vma``, which behave the same on jax 0.10 and 0.11 (the ``reduced``
    sharding annotation exists only from 0.11). Each shard's loss is its part of the microbatch's loss
    (``w_s / sum w`` with an aux weight, else ``1 / shards``). ``fsdp_gather='step'`` (default) gathers each
    stage's weights over ``fsdp`` once at entry and keeps them; ``'action'`` gathers inside every F/B/W;
    both accumulate the stage gradient unsharded in float32 (4 bytes per parameter of the device's layers).
    Stage functions that take an rng keep the former GSPMD path (their masks are drawn over the global
    microbatch).

    Raises (before tracing):
      TypeError: ``schedule`` not a Schedule or ``mesh`` not a Mesh; ``x`` not one array (e.g. a tuple), or
        not a floating one (its dtype is named).
      ValueError: the mesh's ``pipe`` size is not ``schedule.num_stages``; a forward-only schedule; a
        ``stage_params`` leaf whose leading axis is not ``num_stages * num_chunks``; a batch not divisible by
        ``num_microbatches``, or a microbatch not divisible by the batch axes (``data*fsdp``); ``targets`` with
        another batch size; a ``stage_fn`` that changes the activation's shape or dtype; a ``loss_fn`` that
        does not return a float scalar; an unknown ``stash``.
    """
    check_mesh_and_schedule(schedule, mesh, stash)
    check_comm_options(fsdp_gather)
    if not schedule.has_backward:
        raise ValueError(f"schedule {schedule.name!r} is forward-only; use jp.pipeline.apply for inference, or a "
                         "training schedule (gpipe, one_f_one_b, interleaved_1f1b, zero_bubble, zero_bubble_v)")
    shd.validate_rules(rules, mesh)
    axes, staged, replicated, batched = _specs(mesh, rules)
    core = value_and_grad_core(stage_fn, loss_fn, schedule, mesh, axes, stash, fsdp_gather=fsdp_gather)
    place = _placer(mesh, (staged, replicated, batched, batched))
    # the stage params' own shardings say which dim (if any) is sharded over fsdp
    specs = lambda shardings: jax.tree.map(lambda sh: getattr(sh, "spec", None), shardings[0])
    jitted = MeshJit(lambda shardings, s, h, x, t: core(s, h, x, t, stage_specs=specs(shardings))[0], mesh, rules,
                     lambda s, h, x, t: (shd.replicated(mesh), (s, h, x)), checked_args=(), pass_shardings=True)

    def check(stage_params, head_params, x, targets):
        m = schedule.num_microbatches
        check_stage_params(stage_params, schedule)
        check_batch(x, targets, m, mesh, rules, differentiable=True)
        with shd.use(mesh, rules):
            x_mb = check_stage_fn(stage_fn, stage_params, x, m)
            check_loss_fn(loss_fn, head_params, x_mb, targets, m, has_aux=False)

    def run(stage_params, head_params, x, targets):
        check(stage_params, head_params, x, targets)
        return jitted(*place(stage_params, head_params, x, targets))

    def lower(stage_params, head_params, x, targets):
        check(stage_params, head_params, x, targets)
        return jitted.lower(*place(stage_params, head_params, x, targets))
    run.lower = lower
    return run


def apply(stage_fn: Callable, schedule: Schedule, *, mesh: Mesh, rules: shd.Rules = shd.DEFAULT_RULES) -> Callable:
    """Forward pass of a pipelined stack (inference): ``f(stage_params, x) -> y``.

    Runs the forward-only table of the schedule (:meth:`Schedule.forward_only`: its ``F``\\ s in its order, each
    at its earliest tick; GPipe and 1F1B: ``F(j)`` on stage ``s`` at tick ``j + s``) through the same
    interpreter as :func:`value_and_grad`.

    Args:
      stage_fn, schedule, mesh, rules: as for :func:`value_and_grad`.

    Returns:
      ``f(stage_params, x) -> y``, jitted: ``y = stage_{V-1}(... stage_0(x))`` with ``x``'s shape, dtype and
      sharding, computed microbatch by microbatch (strided, as in :func:`value_and_grad`).

    Raises (before tracing):
      TypeError, ValueError: as for :func:`value_and_grad` (except the loss checks; ``x`` may be of any dtype
        that ``stage_fn`` keeps).
    """
    check_mesh_and_schedule(schedule, mesh)
    shd.validate_rules(rules, mesh)
    axes, staged, _, batched = _specs(mesh, rules)
    place = _placer(mesh, (staged, batched))
    jitted = MeshJit(apply_core(stage_fn, schedule, mesh, axes), mesh, rules, lambda s, x: x, checked_args=())

    def run(stage_params, x):
        check_stage_params(stage_params, schedule)
        check_batch(x, {}, schedule.num_microbatches, mesh, rules)
        with shd.use(mesh, rules):
            check_stage_fn(stage_fn, stage_params, x, schedule.num_microbatches)
        return jitted(*place(stage_params, x))
    return run
