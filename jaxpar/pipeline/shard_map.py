"""The traceable cores of :func:`jaxpar.pipeline.value_and_grad` and :func:`jaxpar.pipeline.apply`: the interpreter
(:mod:`jaxpar.pipeline.interpreter`) wrapped in its ``jax.shard_map`` (manual over ``pipe`` and the batch axes,
:func:`manual_batch_axes`), with the microbatch split, the stage parameters' specs (:func:`fsdp_dims`), the
logical rules inside the body and the step's key carried in as raw key data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.train.grads import merge_microbatches, split_microbatches
from jaxpar.pipeline.interpreter import AXIS, Interpreter
from jaxpar.pipeline.schedules import Schedule
from jaxpar.sharding.names import CONTEXT, FSDP, Rules


# ----------------------------------------------------------------------------------- traceable cores

def _over_pipe(body: Callable, schedule: Schedule, mesh: Mesh, in_specs: tuple, out_specs: Any,
               batch: tuple[str, ...] = ()) -> Callable:
    """``jax.shard_map`` of the interpreter over ``pipe`` and the manual batch axes ``batch`` (``tensor`` and any
    other axis stay automatic: GSPMD partitions the stage function over them); with one stage, the body itself
    (plain GSPMD: XLA rejects the pipe psums of a size-1 manual axis beside sharded auto axes)."""
    if schedule.num_stages == 1:
        return body
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS, *batch},
                         check_vma=True)


def manual_batch_axes(schedule: Schedule, mesh: Mesh, batch_axes: tuple[str, ...], takes_rng: bool = False,
                      grad_reduce: str = "step") -> tuple[str, ...]:
    """The batch mesh axes (of size > 1) the interpreter's ``shard_map`` is manual over: those of ``batch_axes``
    with ``grad_reduce='step'``, more than one stage and a stage function without an rng; else ``()`` (GSPMD then
    reduces the data-parallel gradient inside each backward action, once per microbatch).

    ``takes_rng`` keeps the GSPMD path: a stage function draws its dropout masks over the shape it is given,
    and a manual shard sees only its rows, so its masks would differ from the non-pipelined step's (which
    draws over the global microbatch); GSPMD's partitionable ``threefry`` draws the global values."""
    if grad_reduce == "action" or schedule.num_stages == 1 or takes_rng:
        return ()
    return tuple(a for a in batch_axes if mesh.shape[a] > 1)


def context_axes(schedule: Schedule, mesh: Mesh, takes_rng: bool = False,
                 grad_reduce: str = "step") -> tuple[str, ...]:
    """``('context',)`` when the interpreter's ``shard_map`` is manual over the sequence's context axis: the mesh
    has ``context > 1`` and more than one stage. Each device then runs its chunk of every microbatch's sequence
    (the zigzag layout, :mod:`jaxpar.layers.attention`; leaves of rank >= 3 after the microbatch split, ``[B/m, m, L,
    ...]``), and the loss and gradients are reduced over ``context`` as over the manual batch axes.

    Raises:
      ValueError: ``context > 1`` with ``grad_reduce='action'`` or a stage function that takes an rng.
    """
    if schedule.num_stages == 1 or dict(mesh.shape).get(CONTEXT, 1) == 1:
        return ()
    if grad_reduce == "action" or takes_rng:
        raise ValueError(f"a pipeline over a context axis (context={mesh.shape[CONTEXT]}) runs manual over it, which "
                         f"needs grad_reduce='step' and a stage function without an rng; got grad_reduce="
                         f"{grad_reduce!r}, "
                         f"stage_takes_rng={takes_rng}")
    return (CONTEXT,)


def fsdp_dims(stage_specs: Any, num_leaves: int) -> tuple:
    """Per stage-param leaf, the dim of its ``[chunks, layers, ...]`` block sharded over ``fsdp`` by
    ``stage_specs`` (its ``PartitionSpec``\\ s as the state holds them; an entry ``fsdp`` or led by it), else None
    (also for every leaf when ``stage_specs`` is None: weights replicated over ``fsdp``)."""
    if stage_specs is None:
        return (None,) * num_leaves
    lead = lambda entry: entry[0] if isinstance(entry, tuple) and entry else entry
    return tuple(next((d for d, e in enumerate(tuple(s or ())) if d >= 2 and lead(e) == FSDP), None)
                 for s in jax.tree.leaves(stage_specs, is_leaf=lambda s: isinstance(s, P) or s is None))


@contextlib.contextmanager
def _local_rules(manual: tuple[str, ...]):
    """The logical rules in context with the manual axes removed: inside the body a stage function's logical
    constraints (e.g. ``constrain(x, 'batch', 'seq', 'embed')``) may name only automatic axes."""
    rules = nn.get_logical_axis_rules()
    if not manual or not rules:
        yield
        return
    with nn.logical_axis_rules(Rules(rules).without_axes(manual)):
        yield


def _stage_specs(stage_params: Any, interp: Interpreter, sharded: bool) -> Any:
    """Per stage-param leaf: ``P('pipe')``, or (``sharded``) ``P('pipe', ..., 'fsdp')`` with fsdp at its dim."""
    leaves, treedef = jax.tree.flatten(stage_params)
    dims = interp.dims() or (None,) * len(leaves)
    spec = lambda d: P(AXIS) if d is None or not sharded else P(AXIS, *([None] * (d - 1)), FSDP)
    return treedef.unflatten([spec(d) for d in dims])


def _key_data(rng: jax.Array | None, takes_rng: bool) -> tuple[jax.Array | None, Callable]:
    """``(raw key data, unwrap)``: a typed key crosses ``shard_map`` as its ``uint32`` data (``None`` without
    ``takes_rng``)."""
    if not takes_rng:
        return None, lambda data: None
    if rng is None:
        raise ValueError("the stage function takes an rng (stage_takes_rng=True) but no key was given")
    if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)
    impl = jax.random.key_impl(rng)
    return jax.random.key_data(rng), lambda data: jax.random.wrap_key_data(data, impl=impl)


def value_and_grad_core(stage_fn: Callable, loss_fn: Callable, schedule: Schedule, mesh: Mesh,
                        batch_axes: tuple[str, ...], stash: str = "residuals", has_aux: bool = False,
                        takes_rng: bool = False, fsdp_gather: str = "step", grad_reduce: str = "step") -> Callable:
    """The traceable (unvalidated, unjitted) body of :func:`jaxpar.pipeline.value_and_grad`.

    Returns ``f(stage_params, head_params, x, targets, scale=None, rng=None, stage_specs=None) -> ((loss,
    (g_stage, g_head, g_x)), aux)``, where ``aux`` holds ``loss_fn``'s aux per microbatch (leading axis ``m``; ``{}`` without aux) and the
    gradients are of ``scale * loss`` (a float32 loss scale; the loss itself is unscaled). With ``takes_rng``
    the stage function is ``stage_fn(params, x_mb, keys)``: the F of microbatch ``j`` on virtual stage ``vs``
    (and its B and W) gets ``keys[l] = fold_in(fold_in(rng, j), vs * R + l)``, ``R`` the rows of one virtual
    stage's params (its layers): one key per global layer. For use inside another jitted function (the train
    step), under ``jax.set_mesh(mesh)``.

    Communication (``grad_reduce='step'``, the default; see :func:`manual_batch_axes` for when it applies): the
    ``shard_map`` is manual over ``pipe`` and the batch axes, so each device runs its rows of every
    microbatch, accumulates its stage's float32 gradient locally over the microbatches and reduces it once
    after the tick loop: ``psum_scatter`` over ``fsdp`` along the dim :func:`fsdp_dims` reads from ``stage_specs``
    (the caller's state's specs; ``psum`` for a leaf not sharded over it) and ``psum`` over ``data``.
    ``fsdp_gather``: ``'step'`` gathers each stage's weights over ``fsdp`` once, at the ``shard_map``'s entry, for
    all microbatches; ``'action'`` all-gathers the chunk's weights inside each F, B and W.
    ``grad_reduce='action'``: the ``shard_map`` is manual over ``pipe`` only and GSPMD reduces the data-parallel
    gradient inside every backward action (once per microbatch: more traffic, for comparison).
    """
    rows_over = manual_batch_axes(schedule, mesh, batch_axes, takes_rng, grad_reduce)
    manual = rows_over + context_axes(schedule, mesh, takes_rng, grad_reduce)   # the shards of one microbatch
    batch_size = int(np.prod([mesh.shape[a] for a in manual], dtype=int))
    fsdp = mesh.shape[FSDP] if FSDP in manual else 1

    def run(stage_params, head_params, x, targets, scale=None, rng=None, stage_specs=None):
        m = schedule.num_microbatches
        dims = fsdp_dims(stage_specs, len(jax.tree.leaves(stage_params))) if fsdp > 1 else ()
        interp = Interpreter(stage_fn, loss_fn, schedule, stash, has_aux, takes_rng, manual, batch_size, dims,
                              fsdp_gather, fsdp)

        def inner(stage_params, head_params, x_micro, t_micro, scale, data):
            with _local_rules(manual):
                return interp.value_and_grad(stage_params, head_params, x_micro, t_micro, scale, unwrap(data))

        x_micro = split_microbatches(x, m, batch_axes)
        t_micro = jax.tree.map(lambda t: split_microbatches(t, m, batch_axes), targets)
        scale = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
        data, unwrap = _key_data(rng, takes_rng)
        rows = lambda t: P(rows_over or None, *((None, CONTEXT) if CONTEXT in manual and t.ndim >= 3 else ()))
        body = _over_pipe(inner, schedule, mesh,
                          in_specs=(_stage_specs(stage_params, interp, interp.gathers), P(), rows(x_micro),
                                    jax.tree.map(rows, t_micro), P(), P()),
                          out_specs=(P(), (_stage_specs(stage_params, interp, True), P(), rows(x_micro)), P()),
                          batch=manual)
        loss, (g_stage, g_head, gx_micro), aux = body(stage_params, head_params, x_micro, t_micro, scale, data)
        return (loss, (g_stage, g_head, merge_microbatches(gx_micro, batch_axes))), aux
    return run


def apply_core(stage_fn: Callable, schedule: Schedule, mesh: Mesh, batch_axes: tuple[str, ...],
               takes_rng: bool = False) -> Callable:
    """The traceable body of :func:`jaxpar.pipeline.apply`: ``f(stage_params, x, rng=None) -> y`` (with
    ``takes_rng``, the stage function gets the keys :func:`value_and_grad_core` gives the same F)."""
    # manual over the axes training is manual over: a stage's collectives over them (expert parallelism's) then
    # run inside its own action, among the devices of its stage; left automatic, GSPMD's resharding collectives
    # inside the per-stage action switch span every stage, and the idle stages never join them (a deadlock)
    rows_over = manual_batch_axes(schedule, mesh, batch_axes, takes_rng)
    manual = rows_over + context_axes(schedule, mesh, takes_rng)
    interp = Interpreter(stage_fn, None, schedule.forward_only() if schedule.has_backward else schedule,
                         takes_rng=takes_rng, batch=manual)

    def run(stage_params, x, rng=None):
        x_micro = split_microbatches(x, schedule.num_microbatches, batch_axes)
        data, unwrap = _key_data(rng, takes_rng)

        def inner(stage_params, x_micro, data):
            with _local_rules(manual):
                return interp.apply(stage_params, x_micro, unwrap(data))
        rows = P(rows_over or None, *((None, CONTEXT) if CONTEXT in manual and x_micro.ndim >= 3 else ()))
        body = _over_pipe(inner, schedule, mesh, in_specs=(P(AXIS), rows, P()), out_specs=rows, batch=manual)
        return merge_microbatches(body(stage_params, x_micro, data), batch_axes)
    return run
