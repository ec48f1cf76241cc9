"""The pipeline interpreter: one ``jax.shard_map`` body that executes any valid schedule table.

The interpreter runs over the ``pipe`` mesh axis only (``axis_names={'pipe'}``): inside a stage the
``data``, ``fsdp`` and ``tensor`` axes stay automatic, so GSPMD keeps partitioning the stage function as it
does outside a pipeline. It is a ``lax.scan`` over the schedule's ticks; at every tick each stage

1. reads its entry of the constant control table (:func:`jaxpar.pipeline.table.control_table`: its action,
   microbatch, and the buffer slots it reads and writes), indexed by ``lax.axis_index('pipe')``;
2. runs that action through ``lax.switch``: idle; ``F`` (``jax.vjp`` of the stage function, stashing what
   the backward needs); ``F`` on the last stage (also the loss, its gradient for the head parameters and the
   loss cotangent of the stage output); ``B`` (the stashed pullback applied to the received cotangent:
   parameter gradients are accumulated, the input cotangent is sent back);
3. sends its output activation to the next stage and its input cotangent to the previous one with two
   ``lax.ppermute``\\ s, and writes what it received into the receive slots the table names.

The backward is driven by hand, one ``jax.vjp`` per microbatch, not by differentiating a forward loop, so
any order of ``F``\\ s and ``B``\\ s runs: GPipe, and a true 1F1B whose stash holds only the microbatches in
flight. Buffers are sized from the table (:class:`~jaxpar.pipeline.table.BufferSizes`).

What a stage stashes for its backward, and how it rebuilds the pullback: :mod:`jaxpar.pipeline.stash`.

Microbatches are strided, in :mod:`jaxpar.grads`' ``[B/m, m, ...]`` layout: microbatch ``j`` holds global rows
``j, j + m, j + 2m, ...``, so each stays spread over the batch mesh axes (as gradient accumulation does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar import _compat
from jaxpar.grads import merge_microbatches, microbatch, split_microbatches
from jaxpar.pipeline.schedules import Schedule
from jaxpar.pipeline.stash import forward_and_stash, pullback_from_stash, residual_plan, stashed_structs, write_stash
from jaxpar.pipeline.table import BWD, FWD, FWD_LAST, Actions, BufferSizes, control_table

AXIS = "pipe"


# ---------------------------------------------------------------------------------------- small helpers

def _varying(tree: Any) -> Any:
    """Marks every leaf as varying over ``pipe`` (a type-level cast; nothing moves)."""
    def cast(x):
        return x if AXIS in _compat.varying_axes(x) else jax.lax.pcast(x, AXIS, to="varying")
    return jax.tree.map(cast, tree)


def _zeros(tree: Any, dtype: Any = None) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, dtype or a.dtype), tree)


def _put(buf: jax.Array, value: jax.Array, index: jax.Array, on: jax.Array, axis: int = 0) -> jax.Array:
    """``buf[index] = value`` along ``axis`` where ``on``, else unchanged (written in place)."""
    old = jax.lax.dynamic_index_in_dim(buf, index, axis, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(on, value.astype(buf.dtype), old), index, axis)


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
        """``psum`` over ``pipe``; ``from_one_stage``: of values one stage holds (the others zeros), which is
        exact, so 16-bit floats are summed in float32 (:func:`jaxpar._compat.psum_16bit_safe`)."""
        if self.p == 1:
            return tree
        psum = _compat.psum_16bit_safe if from_one_stage else jax.lax.psum
        return jax.tree.map(lambda x: psum(x, AXIS), tree)

    def _send(self, send_f, send_b):
        if self.p == 1:
            return jnp.zeros_like(send_f), jnp.zeros_like(send_b)
        fwd = [(s, s + 1) for s in range(self.p - 1)]
        return (jax.lax.ppermute(send_f, AXIS, fwd),
                jax.lax.ppermute(send_b, AXIS, [(b, a) for a, b in fwd]))

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
            y, res = forward_and_stash(self.stage_fn, self.stash, params, x, plan)
            return zero._replace(send_f=y, res=res)

        def fwd_last(params, head, x, g, tgt, stash, slot):
            y, res = forward_and_stash(self.stage_fn, self.stash, params, x, plan)
            (_, (loss, aux)), (dhead, dy) = jax.value_and_grad(self._scaled_loss, (0, 1), has_aux=True)(
                head, y, tgt, scale)
            return self._vary(zero._replace(send_b=dy, res=res, dhead=f32(dhead), loss=loss, aux=aux))

        def bwd(params, head, x, g, tgt, stash, slot):
            res = tuple(b[slot] for b in stash)
            dparams, dx = pullback_from_stash(self.stage_fn, self.stash, params, x, res, plan)(g)
            return zero._replace(send_b=dx, dparams=f32(dparams))
        return [idle, fwd, fwd_last, bwd]

    # --- value and gradient ------------------------------------------------------------------------------
    def _init(self, params, head, x_micro, t_micro, sizes: BufferSizes, plan) -> tuple[_Carry, _Out]:
        x0 = x_micro[:, 0]
        res = stashed_structs(self.stash, plan, x0)
        aux = jax.eval_shape(lambda h, y, t: self._scaled_loss(h, y, t, 1.0)[1][1], head, x0,
                             jax.tree.map(lambda t: t[:, 0], t_micro))
        f32 = jnp.float32
        zero = _Out(jnp.zeros_like(x0), jnp.zeros_like(x0), _zeros(res), _zeros(params, f32), _zeros(head, f32),
                    jnp.zeros((), f32), _zeros(aux))
        buffers = lambda n: jnp.zeros((n, *x0.shape), x0.dtype)
        carry = _Carry(stash=tuple(jnp.zeros((sizes.stash, *r.shape), r.dtype) for r in res),
                       act=buffers(sizes.activations), cot=buffers(sizes.cotangents),
                       gx=jnp.zeros(x_micro.shape, x_micro.dtype), dparams=zero.dparams, dhead=zero.dhead,
                       loss=zero.loss, aux=jax.tree.map(lambda a: jnp.zeros((self.m, *a.shape), a.dtype), aux))
        return self._vary(carry), self._vary(zero)

    def value_and_grad(self, stage_params, head, x_micro, t_micro, scale):
        """Inside shard_map: per-stage ``[1, ...]`` params, replicated head, ``[B/m, m, ...]`` inputs/targets,
        and the loss scale (gradients are of ``scale * loss``; the loss is returned unscaled)."""
        actions, sizes = control_table(self.schedule)
        stage = self._stage()
        params = jax.tree.map(lambda a: a[0], stage_params)
        head, x_micro, t_micro, scale = self._vary((head, x_micro, t_micro, scale))
        plan = residual_plan(self.stage_fn, params, x_micro[:, 0]) if self.stash == "residuals" else None
        carry, zero = self._init(params, head, x_micro, t_micro, sizes, plan)
        branches = self._branches(plan, zero, scale)

        def tick(carry: _Carry, row: Actions):
            c = jax.tree.map(lambda a: a[stage], row)
            kind, mb = c.kind, c.microbatch
            x_in = jnp.where(stage == 0, microbatch(x_micro, mb), carry.act[c.act_read])
            tgt = jax.tree.map(lambda t: microbatch(t, mb), t_micro)
            out = jax.lax.switch(kind, branches, params, head, x_in, carry.cot[c.cot_read], tgt, carry.stash,
                                 c.stash_slot)
            recv_f, recv_b = self._send(out.send_f, out.send_b)
            add = lambda a, b: jax.tree.map(jnp.add, a, b)
            return _Carry(
                stash=write_stash(carry.stash, out.res, c.stash_slot, (kind == FWD) | (kind == FWD_LAST)),
                act=_put(carry.act, recv_f, c.act_write, c.act_on == 1),
                cot=_put(carry.cot, jnp.where(stage == self.p - 1, out.send_b, recv_b), c.cot_write,
                         c.cot_on == 1),
                gx=_put(carry.gx, out.send_b, mb, (stage == 0) & (kind == BWD), axis=1),
                dparams=add(carry.dparams, out.dparams), dhead=add(carry.dhead, out.dhead),
                loss=carry.loss + out.loss,
                aux=jax.tree.map(lambda acc, a: _put(acc, a, mb, kind == FWD_LAST), carry.aux, out.aux)), None

        carry, _ = jax.lax.scan(tick, carry, jax.tree.map(jnp.asarray, actions))
        g_stage = jax.tree.map(lambda g, a: g.astype(a.dtype)[None], carry.dparams, params)
        g_head = jax.tree.map(lambda g, a: g.astype(a.dtype), self._psum(carry.dhead), head)
        g_x = self._psum(carry.gx, from_one_stage=True)
        return self._psum(carry.loss), (g_stage, g_head, g_x), self._psum(carry.aux, from_one_stage=True)

    # --- forward only ---------------------------------------------------------------------------------
    def apply(self, stage_params, x_micro):
        """Inside shard_map: runs the schedule's F actions; returns the last stage's outputs ``[B/m, m, ...]``."""
        actions, sizes = control_table(self.schedule)
        stage = self._stage()
        params = jax.tree.map(lambda a: a[0], stage_params)
        x_micro = self._vary(x_micro)
        x0 = x_micro[:, 0]
        zero = self._vary(jnp.zeros_like(x0))
        run = lambda params, x: self.stage_fn(params, x)
        branches = [lambda params, x: zero, run, run]

        def tick(carry, row: Actions):
            act, ys = carry
            c = jax.tree.map(lambda a: a[stage], row)
            kind, mb = c.kind, c.microbatch
            x_in = jnp.where(stage == 0, microbatch(x_micro, mb), act[c.act_read])
            y = jax.lax.switch(kind, branches, params, x_in)
            recv, _ = self._send(y, zero)
            return (_put(act, recv, c.act_write, c.act_on == 1), _put(ys, y, mb, kind == FWD_LAST, 1)), None

        init = self._vary((jnp.zeros((sizes.activations, *x0.shape), x0.dtype), jnp.zeros_like(x_micro)))
        (_, ys), _ = jax.lax.scan(tick, init, jax.tree.map(jnp.asarray, actions))
        return self._psum(ys, from_one_stage=True)


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
