"""The pipeline runtime: one interpreter that executes any valid schedule table inside ``jax.shard_map``.

The interpreter runs over the ``pipe`` mesh axis only (``axis_names={'pipe'}``): inside a stage the
``data``, ``fsdp`` and ``tensor`` axes stay automatic, so GSPMD keeps partitioning the stage function as it
does outside a pipeline. It is a ``lax.scan`` over the schedule's ticks; at every tick each stage

1. reads its row of a constant control table built from the schedule (its action, microbatch, and the
   buffer slots it reads and writes), indexed by ``lax.axis_index('pipe')`` and the tick;
2. runs that action through ``lax.switch``: idle; ``F`` (``jax.vjp`` of the stage function, stashing what
   the backward needs); ``F`` on the last stage (also the loss, its gradient for the head parameters and the
   loss cotangent of the stage output); ``B`` (the stashed pullback applied to the received cotangent:
   parameter gradients are accumulated, the input cotangent is sent back);
3. sends its output activation to the next stage and its input cotangent to the previous one with two
   ``lax.ppermute``\\ s, and writes what it received into the receive slots the table names.

The backward is driven by hand, one ``jax.vjp`` per microbatch, not by differentiating a forward loop, so
any order of ``F``\\ s and ``B``\\ s runs: GPipe, and a true 1F1B whose stash holds only the microbatches in
flight. Buffers are sized from the table (:meth:`Schedule.peak_stash`, :meth:`Schedule.recv_slots`); every
stage allocates the largest stage's size, as SPMD requires one program for all stages.

Stash (``stash=``): ``'residuals'`` keeps the vjp residuals that depend on the stage input (those that only
depend on the parameters, e.g. a reshaped weight, are recomputed by the backward and never stashed per
microbatch); ``'inputs'`` keeps only the stage input and recomputes the forward in the backward
(activation checkpointing of the whole stage: less memory, one more forward per microbatch).

Microbatches are strided: microbatch ``j`` holds global rows ``j, j + m, j + 2m, ...``, so each stays spread
over the batch mesh axes (as ``jp.train``'s gradient accumulation does).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import dispatch, sharding as shd
from jaxpar.pipeline.schedules import Interval, Schedule

AXIS = "pipe"
STASH_MODES = ("residuals", "inputs")
_IDLE, _FWD, _FWD_LAST, _BWD = range(4)
_KIND, _MB, _STASH, _ACT_READ, _ACT_WRITE, _ACT_ON, _COT_READ, _COT_WRITE, _COT_ON = range(9)
_NCOL = 9


# ------------------------------------------------------------------------------------------ control table

def _colour(intervals: list[Interval]) -> dict[Interval, int]:
    """Slot of each interval, greedily in order of start tick (optimal: uses exactly the peak overlap)."""
    slot_of: dict[Interval, int] = {}
    busy: dict[int, int] = {}                       # slot -> tick it frees at
    for iv in sorted(intervals, key=lambda i: (i.start, i.stop)):
        free = [k for k, stop in busy.items() if stop <= iv.start]
        k = min(free) if free else len(busy)
        busy[k] = iv.stop
        slot_of[iv] = k
    return slot_of


def control_table(schedule: Schedule) -> tuple[np.ndarray, dict[str, int]]:
    """The interpreter's program: int32 ``[num_ticks, num_stages, 9]`` and the buffer sizes.

    Columns: action kind (idle, F, F on the last stage, B), microbatch, stash slot (F writes, B reads),
    activation slot read by F, activation slot written with what arrives at this tick and its on-flag,
    then the same three for cotangents. Sizes: ``{'stash', 'activations', 'cotangents'}`` -> slots, the
    maximum over stages of the schedule's own counts (at least 1).
    """
    p = schedule.num_stages
    ctrl = np.zeros((schedule.num_ticks, p, _NCOL), np.int32)
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is not None:
                ctrl[t, s, _KIND] = _BWD if a.kind == "B" else (_FWD_LAST if s == p - 1 else _FWD)
                ctrl[t, s, _MB] = a.microbatch
    columns = {"stash": (_STASH, _STASH, None), "activations": (_ACT_READ, _ACT_WRITE, _ACT_ON),
               "cotangents": (_COT_READ, _COT_WRITE, _COT_ON)}
    sizes = {}
    for name, intervals in schedule.lifetimes().items():
        read, write, on = columns[name]
        used = 0
        for s in range(p):
            for iv, k in _colour([iv for iv in intervals if iv.stage == s]).items():
                ctrl[iv.start, s, write], ctrl[iv.stop, s, read] = k, k
                if on is not None:
                    ctrl[iv.start, s, on] = 1
                used = max(used, k + 1)
        sizes[name] = max(used, 1)
    return ctrl, sizes


# ---------------------------------------------------------------------------------------- small helpers

def _varying_axes(x: Any) -> frozenset:
    """The manual axes ``x`` varies over (``aval.mat.varying`` on jax 0.10, ``aval.vma`` elsewhere)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _varying(tree: Any) -> Any:
    """Marks every leaf as varying over ``pipe`` (a type-level cast; nothing moves)."""
    def cast(x):
        return x if AXIS in _varying_axes(x) else jax.lax.pcast(x, AXIS, to="varying")
    return jax.tree.map(cast, tree)


def _psum_from_one_stage(x: jax.Array) -> jax.Array:
    """``psum`` over ``pipe`` of a value that one stage holds (the others zeros): exact, so done in float32 for
    16-bit floats (XLA:CPU's all-reduce promotion aborts on shard_map's 16-bit psum, jax 0.10.2)."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
        return jax.lax.psum(x.astype(jnp.float32), AXIS).astype(x.dtype)
    return jax.lax.psum(x, AXIS)


def _zeros(tree: Any, dtype: Any = None) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, dtype or a.dtype), tree)


def _put(buf: jax.Array, value: jax.Array, index: jax.Array, on: jax.Array, axis: int = 0) -> jax.Array:
    """``buf[index] = value`` along ``axis`` where ``on``, else unchanged (written in place)."""
    old = jax.lax.dynamic_index_in_dim(buf, index, axis, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(on, value.astype(buf.dtype), old), index, axis)


def _microbatch(x_micro: jax.Array, j: jax.Array) -> jax.Array:
    """Microbatch ``j`` of a ``[B/m, m, ...]`` array (a strided read of the batch, no copy of the rest)."""
    return jax.lax.dynamic_index_in_dim(x_micro, j, 1, keepdims=False)


def _residual_plan(stage_fn: Callable, params: Any, x: jax.Array) -> tuple[tuple[bool, ...], tuple]:
    """Which leaves of ``jax.vjp(stage_fn, params, x)``'s pullback depend on ``x`` (those are stashed).

    Returns ``(stashed flag per leaf, ShapeDtypeStruct of each stashed leaf)``. Dependence is traced through
    the jaxpr (an equation's outputs depend on ``x`` when any of its inputs does).
    """
    closed = jax.make_jaxpr(lambda p, x: jax.tree.leaves(jax.vjp(stage_fn, p, x)[1]))(params, x)
    jaxpr = closed.jaxpr
    dep = set(jaxpr.invars[len(jax.tree.leaves(params)):])
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, jcore.Literal) and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    stashed = tuple(not isinstance(v, jcore.Literal) and v in dep for v in jaxpr.outvars)
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a, keep in zip(closed.out_avals, stashed) if keep)
    return stashed, avals


class _Out(NamedTuple):
    """What one tick's action produces (zeros for the parts an action does not produce)."""
    send_f: jax.Array      # activation for the next stage
    send_b: jax.Array      # input cotangent for the previous stage (last stage, F: the loss cotangent)
    res: tuple             # F: what it stashes
    dparams: Any           # B: this microbatch's stage-parameter gradient (float32)
    dhead: Any             # F on the last stage: head-parameter gradient (float32)
    loss: jax.Array        # F on the last stage: loss / m (float32)
    aux: Any               # F on the last stage: loss_fn's aux


class _Carry(NamedTuple):
    stash: tuple           # per stashed leaf [stash slots, ...]: F writes its slot, B reads it
    act: jax.Array         # [activation slots, mb, ...] received activations
    cot: jax.Array         # [cotangent slots, mb, ...] received (last stage: loss) cotangents
    gx: jax.Array          # [B/m, m, ...] d loss / d x, written by stage 0's B
    dparams: Any           # float32 stage-parameter gradient
    dhead: Any             # float32 head-parameter gradient
    loss: jax.Array
    aux: Any               # per leaf [m]


def _write_stash(stash: tuple, res: tuple, slot: jax.Array, on: jax.Array) -> tuple:
    """Writes one microbatch's residuals into their slot when ``on`` (F ticks), in place.

    A two-way ``lax.cond`` whose false branch passes the buffers through: XLA updates them in place. (Threaded
    through the multi-way action switch instead, every stash buffer was copied at every tick; a masked
    select-and-write reads the slot back at every tick.) The action switch only reads the stash.
    """
    write = lambda st: tuple(jax.lax.dynamic_update_index_in_dim(b, r, slot, 0) for b, r in zip(st, res))
    return jax.lax.cond(on, write, lambda st: st, stash)


# ------------------------------------------------------------------------------------------ interpreter

@dataclasses.dataclass(frozen=True)
class _Interpreter:
    """The shard_map body. Static: the functions, the schedule and how to stash."""
    stage_fn: Callable
    loss_fn: Callable | None
    schedule: Schedule
    stash: str = "residuals"
    has_aux: bool = False

    @property
    def p(self) -> int:
        return self.schedule.num_stages

    @property
    def m(self) -> int:
        return self.schedule.num_microbatches

    # --- the pipe axis (absent with one stage: the interpreter then runs as plain GSPMD, no shard_map) ---
    def _stage(self) -> jax.Array:
        return jax.lax.axis_index(AXIS) if self.p > 1 else jnp.zeros((), jnp.int32)

    def _vary(self, tree: Any) -> Any:
        return _varying(tree) if self.p > 1 else tree

    def _psum(self, tree: Any, from_one_stage: bool = False) -> Any:
        if self.p == 1:
            return tree
        return jax.tree.map(_psum_from_one_stage if from_one_stage else lambda x: jax.lax.psum(x, AXIS), tree)

    def _send(self, send_f, send_b):
        if self.p == 1:
            return jnp.zeros_like(send_f), jnp.zeros_like(send_b)
        fwd = [(s, s + 1) for s in range(self.p - 1)]
        return (jax.lax.ppermute(send_f, AXIS, fwd),
                jax.lax.ppermute(send_b, AXIS, [(b, a) for a, b in fwd]))

    # --- one microbatch through the stage ------------------------------------------------------------
    def _forward(self, params, x, plan):
        if self.stash == "inputs":
            return self.stage_fn(params, x), (x,)
        y, pullback = jax.vjp(self.stage_fn, params, x)
        leaves = jax.tree.leaves(pullback)
        if len(leaves) != len(plan[0]):
            raise RuntimeError(f"stage_fn's vjp has {len(leaves)} residuals here but {len(plan[0])} when planned")
        return y, tuple(r for r, keep in zip(leaves, plan[0]) if keep)

    def _pullback(self, params, x, res, plan):
        if self.stash == "inputs":
            return jax.vjp(self.stage_fn, params, res[0])[1]
        # Rebuild the pullback: parameter-only residuals are recomputed here (the x-dependent part of this
        # forward is dead code, removed by the compiler); x-dependent ones come from the stash.
        leaves, treedef = jax.tree.flatten(jax.vjp(self.stage_fn, params, x)[1])
        stashed = iter(res)
        return jax.tree.unflatten(treedef, [next(stashed) if keep else r for r, keep in zip(leaves, plan[0])])

    def _scaled_loss(self, head, y, tgt, scale):
        """``(scale * loss / m, (loss / m, aux))``: the differentiated value carries the loss scale."""
        out = self.loss_fn(head, y, tgt)
        loss, aux = out if self.has_aux else (out, {})
        loss = loss.astype(jnp.float32) / self.m
        return loss * scale, (loss, aux)

    def _branches(self, plan, zero: _Out, scale):
        """The actions, ``(params, head, x, g, tgt, stash, slot) -> _Out``; the stash is read-only here (B
        reads its slot inside its branch, so other ticks never touch it)."""
        f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)

        def idle(params, head, x, g, tgt, stash, slot):
            return zero

        def fwd(params, head, x, g, tgt, stash, slot):
            y, res = self._forward(params, x, plan)
            return zero._replace(send_f=y, res=res)

        def fwd_last(params, head, x, g, tgt, stash, slot):
            y, res = self._forward(params, x, plan)
            (_, (loss, aux)), (dhead, dy) = jax.value_and_grad(self._scaled_loss, (0, 1), has_aux=True)(
                head, y, tgt, scale)
            return self._vary(zero._replace(send_b=dy, res=res, dhead=f32(dhead), loss=loss, aux=aux))

        def bwd(params, head, x, g, tgt, stash, slot):
            dparams, dx = self._pullback(params, x, tuple(b[slot] for b in stash), plan)(g)
            return zero._replace(send_b=dx, dparams=f32(dparams))
        return [idle, fwd, fwd_last, bwd]

    # --- value and gradient ------------------------------------------------------------------------------
    def _init(self, params, head, x_micro, t_micro, sizes, plan) -> tuple[_Carry, _Out]:
        x0 = x_micro[:, 0]
        res = (jax.ShapeDtypeStruct(x0.shape, x0.dtype),) if self.stash == "inputs" else plan[1]
        aux = jax.eval_shape(lambda h, y, t: self._scaled_loss(h, y, t, 1.0)[1][1], head, x0,
                             jax.tree.map(lambda t: t[:, 0], t_micro))
        f32 = jnp.float32
        zero = _Out(jnp.zeros_like(x0), jnp.zeros_like(x0), _zeros(res), _zeros(params, f32), _zeros(head, f32),
                    jnp.zeros((), f32), _zeros(aux))
        buffers = lambda n: jnp.zeros((n, *x0.shape), x0.dtype)
        carry = _Carry(stash=tuple(jnp.zeros((sizes["stash"], *r.shape), r.dtype) for r in res),
                       act=buffers(sizes["activations"]), cot=buffers(sizes["cotangents"]),
                       gx=jnp.zeros(x_micro.shape, x_micro.dtype), dparams=zero.dparams, dhead=zero.dhead,
                       loss=zero.loss, aux=jax.tree.map(lambda a: jnp.zeros((self.m, *a.shape), a.dtype), aux))
        return self._vary(carry), self._vary(zero)

    def value_and_grad(self, stage_params, head, x_micro, t_micro, scale):
        """Inside shard_map: per-stage ``[1, ...]`` params, replicated head, ``[B/m, m, ...]`` inputs/targets,
        and the loss scale (gradients are of ``scale * loss``; the loss is returned unscaled)."""
        ctrl, sizes = control_table(self.schedule)
        stage = self._stage()
        params = jax.tree.map(lambda a: a[0], stage_params)
        head, x_micro, t_micro, scale = self._vary((head, x_micro, t_micro, scale))
        plan = _residual_plan(self.stage_fn, params, x_micro[:, 0]) if self.stash == "residuals" else None
        carry, zero = self._init(params, head, x_micro, t_micro, sizes, plan)
        branches = self._branches(plan, zero, scale)

        def tick(carry: _Carry, ctrl_t):
            c = ctrl_t[stage]
            kind, mb = c[_KIND], c[_MB]
            x_in = jnp.where(stage == 0, _microbatch(x_micro, mb), carry.act[c[_ACT_READ]])
            tgt = jax.tree.map(lambda t: _microbatch(t, mb), t_micro)
            out = jax.lax.switch(kind, branches, params, head, x_in, carry.cot[c[_COT_READ]], tgt, carry.stash,
                                 c[_STASH])
            recv_f, recv_b = self._send(out.send_f, out.send_b)
            add = lambda a, b: jax.tree.map(jnp.add, a, b)
            return _Carry(
                stash=_write_stash(carry.stash, out.res, c[_STASH], (kind == _FWD) | (kind == _FWD_LAST)),
                act=_put(carry.act, recv_f, c[_ACT_WRITE], c[_ACT_ON] == 1),
                cot=_put(carry.cot, jnp.where(stage == self.p - 1, out.send_b, recv_b), c[_COT_WRITE],
                         c[_COT_ON] == 1),
                gx=_put(carry.gx, out.send_b, mb, (stage == 0) & (kind == _BWD), axis=1),
                dparams=add(carry.dparams, out.dparams), dhead=add(carry.dhead, out.dhead),
                loss=carry.loss + out.loss,
                aux=jax.tree.map(lambda acc, a: _put(acc, a, mb, kind == _FWD_LAST), carry.aux, out.aux)), None

        carry, _ = jax.lax.scan(tick, carry, jnp.asarray(ctrl))
        g_stage = jax.tree.map(lambda g, a: g.astype(a.dtype)[None], carry.dparams, params)
        g_head = jax.tree.map(lambda g, a: g.astype(a.dtype), self._psum(carry.dhead), head)
        g_x = self._psum(carry.gx, from_one_stage=True)
        return self._psum(carry.loss), (g_stage, g_head, g_x), self._psum(carry.aux, from_one_stage=True)

    # --- forward only ---------------------------------------------------------------------------------
    def apply(self, stage_params, x_micro):
        """Inside shard_map: runs the schedule's F actions; returns the last stage's outputs ``[B/m, m, ...]``."""
        ctrl, sizes = control_table(self.schedule)
        stage = self._stage()
        params = jax.tree.map(lambda a: a[0], stage_params)
        x_micro = self._vary(x_micro)
        x0 = x_micro[:, 0]
        zero = self._vary(jnp.zeros_like(x0))
        run = lambda params, x: self.stage_fn(params, x)
        branches = [lambda params, x: zero, run, run]

        def tick(carry, ctrl_t):
            act, ys = carry
            c = ctrl_t[stage]
            kind, mb = c[_KIND], c[_MB]
            x_in = jnp.where(stage == 0, _microbatch(x_micro, mb), act[c[_ACT_READ]])
            y = jax.lax.switch(kind, branches, params, x_in)
            recv, _ = self._send(y, zero)
            return (_put(act, recv, c[_ACT_WRITE], c[_ACT_ON] == 1), _put(ys, y, mb, kind == _FWD_LAST, 1)), None

        init = self._vary((jnp.zeros((sizes["activations"], *x0.shape), x0.dtype), jnp.zeros_like(x_micro)))
        (_, ys), _ = jax.lax.scan(tick, init, jnp.asarray(ctrl))
        return self._psum(ys, from_one_stage=True)


# ---------------------------------------------------------------------------------------- microbatches

def split_microbatches(x: jax.Array, m: int, batch_axes: tuple[str, ...] = ()) -> jax.Array:
    """``[B, ...] -> [B/m, m, ...]`` (a reshape, no copy): microbatch ``j`` is ``[:, j]``, rows ``j, j+m, ...``,
    spread over the batch axes."""
    x = x.reshape(x.shape[0] // m, m, *x.shape[1:])
    return jax.lax.with_sharding_constraint(x, P(batch_axes or None))


def merge_microbatches(x: jax.Array, batch_axes: tuple[str, ...] = ()) -> jax.Array:
    """Inverse of :func:`split_microbatches`: ``[B/m, m, ...] -> [B, ...]``."""
    x = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return jax.lax.with_sharding_constraint(x, P(batch_axes or None))


# ----------------------------------------------------------------------------------- traceable cores

def _over_pipe(body: Callable, schedule: Schedule, mesh: Mesh, in_specs: tuple, out_specs: Any) -> Callable:
    """``jax.shard_map`` of the interpreter over ``pipe`` only; with one stage, the body itself (plain GSPMD:
    XLA rejects the pipe psums of a size-1 manual axis beside sharded auto axes)."""
    if schedule.num_stages == 1:
        return body
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS},
                         check_vma=True)


def value_and_grad_core(stage_fn: Callable, loss_fn: Callable, schedule: Schedule, mesh: Mesh,
                        batch_axes: tuple[str, ...], stash: str = "residuals", has_aux: bool = False) -> Callable:
    """The traceable (unvalidated, unjitted) body of :func:`jaxpar.pipeline.value_and_grad`.

    Returns ``f(stage_params, head_params, x, targets, scale=None) -> ((loss, (g_stage, g_head, g_x)), aux)``,
    where ``aux`` holds ``loss_fn``'s aux per microbatch (leading axis ``m``; ``{}`` without aux) and the
    gradients are of ``scale * loss`` (a float32 loss scale; the loss itself is unscaled). For use inside
    another jitted function (the train step), under ``jax.set_mesh(mesh)``.
    """
    interp = _Interpreter(stage_fn, loss_fn, schedule, stash, has_aux)
    body = _over_pipe(interp.value_and_grad, schedule, mesh, in_specs=(P(AXIS), P(), P(), P(), P()),
                      out_specs=(P(), (P(AXIS), P(), P()), P()))

    def run(stage_params, head_params, x, targets, scale=None):
        m = schedule.num_microbatches
        x_micro = split_microbatches(x, m, batch_axes)
        t_micro = jax.tree.map(lambda t: split_microbatches(t, m, batch_axes), targets)
        scale = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
        loss, (g_stage, g_head, gx_micro), aux = body(stage_params, head_params, x_micro, t_micro, scale)
        return (loss, (g_stage, g_head, merge_microbatches(gx_micro, batch_axes))), aux
    return run


def apply_core(stage_fn: Callable, schedule: Schedule, mesh: Mesh, batch_axes: tuple[str, ...]) -> Callable:
    """The traceable body of :func:`jaxpar.pipeline.apply`: ``f(stage_params, x) -> y``."""
    interp = _Interpreter(stage_fn, None, schedule.forward_only() if schedule.has_backward else schedule)
    body = _over_pipe(interp.apply, schedule, mesh, in_specs=(P(AXIS), P()), out_specs=P())

    def run(stage_params, x):
        x_micro = split_microbatches(x, schedule.num_microbatches, batch_axes)
        return merge_microbatches(body(stage_params, x_micro), batch_axes)
    return run


# ------------------------------------------------------------------------------------------- validation

def check_mesh_and_schedule(schedule: Schedule, mesh: Mesh, stash: str = "residuals") -> None:
    """Raises TypeError/ValueError unless ``mesh`` has a ``pipe`` axis of the schedule's size and the runtime
    can execute the schedule."""
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
    if schedule.num_chunks != 1 or any(a is not None and a.kind == "W" for row in schedule.table for a in row):
        raise ValueError(f"schedule {schedule.name!r} has {schedule.num_chunks} chunks per stage or W actions; the "
                         "runtime executes tables of F and B actions with one chunk per stage")
    if stash not in STASH_MODES:
        raise ValueError(f"stash={stash!r}; use one of {STASH_MODES}")


def check_stage_params(stage_params: Any, num_stages: int) -> None:
    """Raises ValueError unless every leaf has a leading axis of exactly ``num_stages``."""
    leaves = jax.tree_util.tree_flatten_with_path(stage_params)[0]
    if not leaves:
        raise ValueError("stage_params has no arrays; pass the stacked parameters of the stages")
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if not shape or shape[0] != num_stages:
            raise ValueError(
                f"stage_params{jax.tree_util.keystr(path)} has shape {shape}: every leaf needs a leading axis of "
                f"exactly num_stages = {num_stages} (index s = stage s); reshape stacked [layers, ...] params to "
                f"[num_stages, layers // num_stages, ...]")


def check_batch(x: Any, targets: Any, num_microbatches: int, mesh: Mesh, batch_axes: tuple[str, ...]) -> None:
    """Raises ValueError unless ``x`` and ``targets`` share a batch that splits into microbatches that split
    over the batch mesh axes."""
    if np.ndim(x) == 0:
        raise ValueError(f"x of shape {np.shape(x)} has no leading batch axis")
    batch = np.shape(x)[0]
    for path, t in jax.tree_util.tree_flatten_with_path(targets)[0]:
        if np.ndim(t) == 0 or np.shape(t)[0] != batch:
            raise ValueError(f"targets{jax.tree_util.keystr(path)} has shape {np.shape(t)}; its leading axis must "
                             f"be x's batch ({batch})")
    m = num_microbatches
    if batch % m:
        raise ValueError(f"batch {batch} is not divisible by num_microbatches = {m}; use a batch that is a "
                         f"multiple of {m}, or another number of microbatches")
    n = math.prod(mesh.shape[a] for a in batch_axes)
    if (batch // m) % n:
        names = "*".join(batch_axes)
        raise ValueError(f"microbatch {batch // m} (batch {batch} / {m} microbatches) is not divisible by {names} "
                         f"= {n}; use a batch that is a multiple of {m * n}")


def _struct(a: Any, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(a) if shape is None else shape, jnp.result_type(a))


def check_stage_fn(stage_fn: Callable, stage_params: Any, x: Any, num_microbatches: int) -> jax.ShapeDtypeStruct:
    """Raises ValueError unless ``stage_fn`` maps one stage's params and a microbatch to the same shape and
    dtype; returns the microbatch's ``ShapeDtypeStruct``."""
    one = jax.tree.map(lambda a: _struct(a, np.shape(a)[1:]), stage_params)
    x_mb = _struct(x, (np.shape(x)[0] // num_microbatches, *np.shape(x)[1:]))
    y = jax.eval_shape(stage_fn, one, x_mb)
    if not (hasattr(y, "shape") and y.shape == x_mb.shape and y.dtype == x_mb.dtype):
        got = f"{y.dtype}{list(y.shape)}" if hasattr(y, "shape") else repr(y)
        raise ValueError(f"stage_fn maps a microbatch {x_mb.dtype}{list(x_mb.shape)} to {got}: a pipeline stage "
                         "must keep the activation's shape and dtype (stages hand it to each other); move shape "
                         "changes into the embedding before the pipeline or the loss after it")
    return x_mb


def check_loss_fn(loss_fn: Callable, head_params: Any, x_mb: Any, targets: Any, num_microbatches: int,
                  has_aux: bool) -> None:
    """Raises ValueError unless ``loss_fn(head, y_mb, targets_mb)`` returns a scalar (and aux if asked)."""
    t_mb = jax.tree.map(lambda t: _struct(t, (np.shape(t)[0] // num_microbatches, *np.shape(t)[1:])), targets)
    out = jax.eval_shape(loss_fn, jax.tree.map(_struct, head_params), x_mb, t_mb)
    loss = out[0] if has_aux and isinstance(out, (tuple, list)) and len(out) == 2 else out
    if not (hasattr(loss, "shape") and loss.shape == () and jnp.issubdtype(loss.dtype, jnp.floating)):
        want = "(scalar loss, aux)" if has_aux else "a float scalar"
        raise ValueError(f"loss_fn(head_params, y_mb, targets_mb) must return {want}, got {out}")


# ------------------------------------------------------------------------------------------ public API

class _PlacedJit:
    """``jax.jit`` of a core with outputs in the inputs' shardings; places host inputs; enters the mesh."""

    def __init__(self, core: Callable, mesh: Mesh, rules: shd.Rules, default_specs: tuple, out_of: Callable):
        self._core, self._mesh, self._rules = core, mesh, rules
        self._default_specs, self._out_of, self._cache = default_specs, out_of, {}

    def _place(self, args):
        devices = set(self._mesh.devices.flat)

        def place(a, spec):
            if isinstance(a, jax.Array) and a.sharding.device_set == devices:
                return a
            return jax.device_put(a, NamedSharding(self._mesh, spec(np.ndim(a))))
        return tuple(jax.tree.map(lambda a, s=s: place(a, s), arg) for arg, s in zip(args, self._default_specs))

    def _jitted(self, args):
        shardings = jax.tree.map(lambda a: a.sharding, args)
        key = (jax.tree.structure(args), tuple(jax.tree.leaves(shardings)))
        if key not in self._cache:
            self._cache[key] = jax.jit(self._core, out_shardings=self._out_of(self._mesh, *shardings))
        return self._cache[key]

    def __call__(self, *args):
        args = self._place(args)

        def call():
            with shd.use(self._mesh, self._rules):
                return self._jitted(args)(*args)
        return dispatch.bounded(self._mesh, call)

    def lower(self, *args):
        args = self._place(args)
        with shd.use(self._mesh, self._rules):
            return self._jitted(args).lower(*args)


def _specs(mesh: Mesh, rules: shd.Rules):
    axes = shd.batch_axes(rules, mesh)
    staged = lambda ndim: P(AXIS)
    replicated = lambda ndim: P()
    batched = lambda ndim: P(axes or None)
    return axes, staged, replicated, batched


def value_and_grad(stage_fn: Callable, loss_fn: Callable, schedule: Schedule, *, mesh: Mesh,
                   rules: shd.Rules = shd.DEFAULT_RULES, stash: str = "residuals") -> Callable:
    """Loss and gradients of a pipelined model: ``f(stage_params, head_params, x, targets)``.

    The model is ``loss = mean_j loss_fn(head_params, stage_{p-1}(... stage_0(x_j)), targets_j)`` over the
    ``m`` microbatches ``j``, where ``stage_s(x) = stage_fn(stage_params[s], x)``. The schedule's table
    decides the order of the forward and backward passes (GPipe: Huang et al. 2019; 1F1B: Narayanan et al.
    2021, sec. 2.2); every schedule gives the same numbers up to float rounding.

    Args:
      stage_fn: ``stage_fn(params_of_one_stage, x_mb) -> y_mb``, ``y_mb`` of ``x_mb``'s shape and dtype.
        ``params_of_one_stage`` is ``stage_params`` without its leading axis. It may use GSPMD constraints
        over the non-pipe axes (it runs inside ``shard_map`` over ``pipe`` only).
      loss_fn: ``loss_fn(head_params, y_mb, targets_mb) -> scalar`` (a mean over the microbatch), run on
        the last stage.
      schedule: a training :class:`Schedule` (``gpipe``, ``one_f_one_b``) with ``num_stages`` equal to the
        mesh's ``pipe`` size.
      mesh: a jaxpar mesh (``jp.make_mesh``).
      rules: logical axis rules; the ``batch`` rule gives the axes each microbatch is split over.
      stash: ``'residuals'`` (stash the input-dependent vjp residuals) or ``'inputs'`` (stash stage inputs
        and recompute the forward in the backward).

    Returns:
      ``f(stage_params, head_params, x, targets) -> (loss, (g_stage_params, g_head_params, g_x))``, jitted.
      ``stage_params``: a pytree whose every leaf has a leading axis of ``num_stages``, placed on
      ``P('pipe')`` (host arrays are placed so). ``head_params``: any pytree, replicated over ``pipe``.
      ``x``: ``[B, ...]``, the global batch leading; ``targets``: a pytree of ``[B, ...]`` arrays. Microbatch
      ``j`` is rows ``j, j+m, j+2m, ...`` (strided: each stays spread over the ``data``/``fsdp`` axes).
      ``loss``: float32 scalar. Gradients have their inputs' shapes, dtypes and shardings; ``g_x`` is
      ``d loss / d x`` (it includes the ``1/m``).

    Raises (before tracing):
      TypeError: ``schedule`` not a Schedule or ``mesh`` not a Mesh.
      ValueError: the mesh's ``pipe`` size is not ``schedule.num_stages``; a forward-only, interleaved or
        ``W`` schedule; a ``stage_params`` leaf whose leading axis is not ``num_stages``; a batch not
        divisible by ``num_microbatches``, or a microbatch not divisible by the batch axes (``data*fsdp``);
        ``targets`` with another batch size; a ``stage_fn`` that changes the activation's shape or dtype; a
        ``loss_fn`` that does not return a float scalar; an unknown ``stash``.
    """
    check_mesh_and_schedule(schedule, mesh, stash)
    if not schedule.has_backward:
        raise ValueError(f"schedule {schedule.name!r} is forward-only; use jp.pipeline.apply for inference, or a "
                         "training schedule (gpipe, one_f_one_b)")
    shd.validate_rules(rules, mesh)
    axes, staged, replicated, batched = _specs(mesh, rules)
    core = value_and_grad_core(stage_fn, loss_fn, schedule, mesh, axes, stash)
    out_of = lambda mesh, s, h, x, t: (NamedSharding(mesh, P()), (s, h, x))
    jitted = _PlacedJit(lambda *a: core(*a)[0], mesh, rules, (staged, replicated, batched, batched), out_of)

    def check(stage_params, head_params, x, targets):
        m = schedule.num_microbatches
        check_stage_params(stage_params, schedule.num_stages)
        check_batch(x, targets, m, mesh, axes)
        with shd.use(mesh, rules):
            x_mb = check_stage_fn(stage_fn, stage_params, x, m)
            check_loss_fn(loss_fn, head_params, x_mb, targets, m, has_aux=False)

    def run(stage_params, head_params, x, targets):
        check(stage_params, head_params, x, targets)
        return jitted(stage_params, head_params, x, targets)

    def lower(stage_params, head_params, x, targets):
        check(stage_params, head_params, x, targets)
        return jitted.lower(stage_params, head_params, x, targets)
    run.lower = lower
    return run


def apply(stage_fn: Callable, schedule: Schedule, *, mesh: Mesh, rules: shd.Rules = shd.DEFAULT_RULES) -> Callable:
    """Forward pass of a pipelined stack (inference): ``f(stage_params, x) -> y``.

    Runs the forward-only table of the schedule's ``(p, m)`` (:meth:`Schedule.forward_only`: ``F(j)`` on stage
    ``s`` at tick ``j + s``) through the same interpreter as :func:`value_and_grad`.

    Args:
      stage_fn, schedule, mesh, rules: as for :func:`value_and_grad`.

    Returns:
      ``f(stage_params, x) -> y``, jitted: ``y = stage_{p-1}(... stage_0(x))`` with ``x``'s shape, dtype and
      sharding, computed microbatch by microbatch (strided, as in :func:`value_and_grad`).

    Raises (before tracing):
      TypeError, ValueError: as for :func:`value_and_grad` (except the loss checks).
    """
    check_mesh_and_schedule(schedule, mesh)
    shd.validate_rules(rules, mesh)
    axes, staged, _, batched = _specs(mesh, rules)
    jitted = _PlacedJit(apply_core(stage_fn, schedule, mesh, axes), mesh, rules, (staged, batched),
                        lambda mesh, s, x: x)

    def run(stage_params, x):
        check_stage_params(stage_params, schedule.num_stages)
        check_batch(x, {}, schedule.num_microbatches, mesh, axes)
        with shd.use(mesh, rules):
            check_stage_fn(stage_fn, stage_params, x, schedule.num_microbatches)
        return jitted(stage_params, x)
    return run
