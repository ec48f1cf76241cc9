"""The pipeline interpreter: one ``jax.shard_map`` body that executes any valid schedule table.

The interpreter's ``shard_map`` is manual over ``pipe`` and the batch axes (``data``, ``fsdp``: see
:func:`manual_batch_axes`); ``tensor`` stays automatic, so GSPMD keeps partitioning the stage function over
it. Each device runs its rows of every microbatch and accumulates its stage's float32 gradient locally; the
reductions over the batch axes run once per step, after the tick loop (``psum`` over ``data``,
``psum_scatter`` over ``fsdp``), not inside every backward action as GSPMD does when the batch axes are
automatic. Only ``jax.shard_map``, ``lax.psum``/``psum_scatter``/``all_gather``/``pcast`` and ``check_vma`` are
used: the same on jax 0.10 and 0.11 (``reduced`` shardings, the other way to keep the reduction out of the
loop, exist only from 0.11). It is a ``lax.scan`` over the schedule's ticks; at every tick each stage

1. reads its entry of the constant control table (:func:`jaxpar.pipeline.table.control_table`: its action,
   microbatch, chunk, and the buffer slots it reads and writes), indexed by ``lax.axis_index('pipe')``;
2. runs that action on the chunk's parameters through ``lax.switch``: idle; ``F`` (``jax.vjp`` of the stage
   function, stashing what the backward needs); ``F`` on the last virtual stage (also the loss, its gradient
   for the head parameters and the loss cotangent of the stage output); ``B`` (the stashed pullback applied
   to the received cotangent: parameter gradients are accumulated, the input cotangent is sent back); in a
   table with split backwards, ``B`` computes the input cotangent only and stashes what ``W`` needs, and ``W``
   the parameter gradient (:mod:`jaxpar.pipeline.split`); a ``B`` without a ``W`` is a full one; ``FB``
   (DualPipeV) runs an ``F`` and a full ``B`` of another microbatch and chunk in one branch (independent
   computations the compiler may overlap), its ``B`` read from :class:`~jaxpar.pipeline.table.Fused`;
3. hands its one output (activation or cotangent; an ``FB``'s ``B`` has a second, on a second channel, in tables
   with ``FB``\\ s) to both neighbouring stages with ``lax.ppermute``\\ s and keeps it itself, and writes what
   it received into the receive slots the table names (the table's routing: sends in both directions in one
   tick, local hand-offs between chunks of one stage).

The backward is driven by hand, one ``jax.vjp`` per microbatch and chunk, not by differentiating a forward
loop, so any order of ``F``\\ s, ``B``\\ s and ``W``\\ s runs: GPipe, a true 1F1B whose stash holds only the
microbatches in flight, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV. Buffers are sized from the table
(:class:`~jaxpar.pipeline.table.BufferSizes`).

Stage parameters come in the stage layout (:func:`jaxpar.pipeline.stage_layout.to_stage_layout`): leading axis
``num_stages * num_chunks``, stage ``s``'s chunks ``s*v .. s*v + v - 1`` on its own devices; chunk ``c`` is
row ``c`` of the stage's block. What a stage stashes for its backward, and how it rebuilds the pullback:
:mod:`jaxpar.pipeline.stash`.

Microbatches are strided, in :mod:`jaxpar.train.grads`' ``[B/m, m, ...]`` layout: microbatch ``j`` holds global rows
``j, j + m, j + 2m, ...``, so each stays spread over the batch mesh axes (as gradient accumulation does).

Randomness (``takes_rng``): the step's key enters the ``shard_map`` replicated (as raw key data); each action
derives its own keys from it and the table's (microbatch, chunk): ``stage_fn(params, x, keys)`` with
``keys[l] = fold_in(fold_in(rng, j), vs * R + l)`` (:meth:`Interpreter._layer_keys`). A microbatch's B and W
derive the same keys as its F, so what the pullback recomputes (a dropout mask) is what the forward drew.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import _compat
from jaxpar.train import carried
from jaxpar.train.grads import microbatch
from jaxpar.pipeline import split as split_lib
from jaxpar.pipeline.schedules import Schedule
from jaxpar.sharding.names import FSDP, PIPE
from jaxpar.pipeline.stash import (SharedSlots, backward_leaves, forward_and_stash, held_to_weight,
                                   pullback_from_stash, residual_plan, stashed_structs, write_stash)
from jaxpar.pipeline.table import (ACTIVATIONS, COTANGENTS, NEXT, PREV, SELF, Actions, BufferSizes, ControlTable, Fused,
                                   Kind, control_table, switch_branches)

AXIS = PIPE   # the axis the interpreter's shard_map is manual over
FSDP_GATHER = ("step", "action")


# ---------------------------------------------------------------------------------------- small helpers

def _varying(tree: Any, axes: tuple[str, ...] = (AXIS,)) -> Any:
    """Marks every leaf as varying over ``axes`` (a type-level cast; nothing moves). Casting the parameters
    before they enter a ``jax.vjp`` is what keeps the vjp from summing their cotangent over ``axes``."""
    def cast(x):
        missing = tuple(a for a in axes if a not in _compat.varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(cast, tree)


def _zeros(tree: Any, dtype: Any = None) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, dtype or a.dtype), tree)


def _put(buf: jax.Array, value: jax.Array, index: jax.Array, on: jax.Array, axis: int = 0) -> jax.Array:
    """``buf[index] = value`` along ``axis`` where ``on``, else unchanged (written in place)."""
    old = jax.lax.dynamic_index_in_dim(buf, index, axis, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(on, value.astype(buf.dtype), old), index, axis)


def _chunk(tree: Any, chunk: jax.Array, num_chunks: int) -> Any:
    """Row ``chunk`` of every leaf (static row 0 with one chunk)."""
    if num_chunks == 1:
        return jax.tree.map(lambda a: a[0], tree)
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, chunk, 0, keepdims=False), tree)


def _add_chunk(acc: Any, value: Any, chunk: jax.Array, num_chunks: int, mb: jax.Array) -> Any:
    """``acc[chunk] += value`` for every leaf (in place); a carried leaf's accumulator holds one row per
    microbatch (:func:`_per_microbatch`): ``acc[chunk, mb] += value``."""
    def add(p, a, g):
        if carried.is_carried(p):
            c = chunk if num_chunks > 1 else 0
            block = jax.lax.dynamic_index_in_dim(a, c, 0, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(a, _add_at(block, g, mb), c, 0)
        return a + g[None] if num_chunks == 1 else _add_at(a, g, chunk)
    return jax.tree_util.tree_map_with_path(add, acc, value)


def _add_at(acc: jax.Array, value: jax.Array, index: jax.Array) -> jax.Array:
    """``acc[index] += value`` along the leading axis (in place)."""
    row = jax.lax.dynamic_index_in_dim(acc, index, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(acc, row + value, index, 0)


def _per_microbatch(tree: Any, m: int, axis: int) -> Any:
    """Accumulator shapes: a carried leaf gets ``m`` rows (one per microbatch) at ``axis``, so its new values
    combine by its declared rule after the tick loop (a split backward's B and W parts add up in their row);
    other leaves as given."""
    def grow(path, a):
        return jax.ShapeDtypeStruct((*a.shape[:axis], m, *a.shape[axis:]), a.dtype) if carried.is_carried(path) else a
    return jax.tree_util.tree_map_with_path(grow, tree)


def _combine_microbatches(tree: Any, axis: int) -> Any:
    """The carried leaves' per-microbatch rows (:func:`_per_microbatch`) combined by their rules."""
    return jax.tree_util.tree_map_with_path(
        lambda p, a: carried.reduce_microbatches(p, a, axis) if carried.is_carried(p) else a, tree)


def _route(kinds: np.ndarray, c: Actions | Fused, act, cot, messages: tuple) -> tuple:
    """Writes the messages of this tick (from the previous stage, the next one, this one) into the receive
    slots ``c`` (this stage's entry of the fields of one channel: :class:`Actions`, or :class:`Fused` for an
    ``FB``'s second message) names; a (source, buffer) pair the channel's ``kinds`` (its ``arrive_buffer``
    field, the whole table) never uses is not traced at all."""
    for k in (PREV, NEXT, SELF):
        if (kinds[..., k] == ACTIVATIONS).any():
            act = _put(act, messages[k], c.arrive_slot[k], c.arrive_buffer[k] == ACTIVATIONS)
        if (kinds[..., k] == COTANGENTS).any():
            cot = _put(cot, messages[k], c.arrive_slot[k], c.arrive_buffer[k] == COTANGENTS)
    return act, cot


def _is(kind: jax.Array, *kinds: Kind) -> jax.Array:
    """Whether ``kind`` is one of ``kinds`` (``==`` terms or-ed in the order given)."""
    return functools.reduce(operator.or_, [kind == k for k in kinds])


def _num_rows(chunk_params: Any) -> int:
    """The leading (layers) size of one chunk's params (0 for scalar leaves: no layer keys)."""
    leaves = jax.tree.leaves(chunk_params)
    return int(leaves[0].shape[0]) if leaves and leaves[0].ndim else 0


def _part(held: tuple[bool, ...], values: tuple) -> tuple[tuple, tuple]:
    """The stashed values split into (held until W, freed at B)."""
    return (tuple(v for v, h in zip(values, held) if h), tuple(v for v, h in zip(values, held) if not h))


def _merge(held: tuple[bool, ...], kept: tuple, rest: tuple) -> tuple:
    kept, rest = iter(kept), iter(rest)
    return tuple(next(kept) if h else next(rest) for h in held)


class _Stashes(NamedTuple):
    """The stash buffers (per leaf ``[slots, ...]``) and, in the action branches, the slot each is read at."""
    stash: Any             # F writes, B (and W) read: the leaves W reads (without a split: all)
    bstash: Any            # split backwards: F writes the leaves only B reads, B reads them and writes in their
                           # place what W needs (one buffer, stash.SharedSlots; the stash's slots)
    wstash: Any            # buffers: () (B's carry lives in bstash); slots: where B writes and W reads it


class _Out(NamedTuple):
    """What one tick's action produces (zeros for the parts an action does not produce)."""
    send: jax.Array        # the message: F's activation (last virtual stage: the loss cotangent), B's d input
    res: tuple             # one stash slot's values, (held leaves, shared buffers): F's stash, or (split B)
                           # zeros and, in the shared buffers, what its W needs (SharedSlots: B-only leaves' room)
    dparams: Any           # B (full) or W: this microbatch's chunk-parameter gradient (float32); a split B: its part
    dhead: Any             # F on the last virtual stage: head-parameter gradient (float32)
    loss: jax.Array        # F on the last virtual stage: loss / m (float32)
    aux: Any               # F on the last virtual stage: loss_fn's aux
    send2: Any = None      # FB: its B's d input (the second channel); None in a table without FBs


class _FusedBackward(NamedTuple):
    """An ``FB`` action's full backward, beside its forward: its chunk's params, layer keys and stash slot."""
    params: Any
    keys: jax.Array | None
    slot: jax.Array


class _Operands(NamedTuple):
    """What every action branch of a tick takes (``lax.switch``'s operand): one action's inputs."""
    params: Any            # the action's chunk parameters (gathered over fsdp inside the branch when asked)
    head: Any              # the head parameters (the last virtual stage's loss)
    x: jax.Array           # the action's input activation: the microbatch, or the one received
    g: jax.Array           # the cotangent received (a B's or W's output gradient)
    tgt: Any               # the microbatch's targets
    stashes: _Stashes      # the stash buffers (read-only in the branches)
    slots: _Stashes        # the slots this action reads
    keys: jax.Array | None  # the action's layer keys (None without takes_rng)
    fused: _FusedBackward | None = None   # a table with FBs: the FB's backward (every branch takes it)


class _ForwardOperands(NamedTuple):
    """What every action branch of the forward-only table takes."""
    params: Any            # the action's chunk parameters
    x: jax.Array           # its input activation
    keys: jax.Array | None  # its layer keys (None without takes_rng)


class _Carry(NamedTuple):
    stashes: _Stashes      # per stashed leaf [slots, ...] (see _Stashes)
    act: jax.Array         # [activation slots, mb, ...] received activations
    cot: jax.Array         # [cotangent slots, mb, ...] received (last virtual stage: loss) cotangents
    gx: jax.Array          # [B/m, m, ...] d loss / d x, written by virtual stage 0's B
    dparams: Any           # float32 [chunks, ...] stage-parameter gradient
    dhead: Any             # float32 head-parameter gradient
    loss: jax.Array
    aux: Any               # per leaf [m]


# ------------------------------------------------------------------------------------------ interpreter

@dataclasses.dataclass(frozen=True)
class Interpreter:
    """The shard_map body (internal: :mod:`jaxpar.pipeline.shard_map` wraps it). Static: the functions, the schedule
    and how to stash."""
    stage_fn: Callable
    loss_fn: Callable | None
    schedule: Schedule
    stash: str = "residuals"
    has_aux: bool = False
    takes_rng: bool = False
    batch: tuple[str, ...] = ()       # the batch mesh axes the body is manual over (() : GSPMD reduces in actions)
    batch_size: int = 1               # their product: the shards of one microbatch
    fsdp_dims: tuple = ()             # per stage-param leaf: its dim sharded over fsdp (None: none), with fsdp manual
    fsdp_gather: str = "step"         # 'step': weights gathered once at entry; 'action': inside each action
    fsdp_size: int = 1

    @property
    def axes(self) -> tuple[str, ...]:
        """The manual axes: ``pipe`` and the manual batch axes."""
        return (AXIS, *self.batch)

    @property
    def gathers(self) -> bool:
        """Whether each action all-gathers its chunk's weights over ``fsdp`` (``fsdp_gather='action'``)."""
        return FSDP in self.batch and self.fsdp_gather == "action"

    def dims(self) -> tuple:
        """Per stage-param leaf, the dim its gradient is reduce-scattered along over ``fsdp`` (or None)."""
        return self.fsdp_dims if FSDP in self.batch else ()

    @property
    def fused(self) -> bool:
        """Whether the table has ``FB`` entries (then every action takes the fused ``B``'s operands too)."""
        return any(a is not None and a.kind == "FB" for row in self.schedule.table for a in row)

    @property
    def p(self) -> int:
        return self.schedule.num_stages

    @property
    def m(self) -> int:
        return self.schedule.num_microbatches

    @property
    def v(self) -> int:
        return self.schedule.num_chunks

    # --- the pipe axis (absent with one stage: the interpreter then runs as plain GSPMD, no shard_map) ---
    def _stage(self) -> jax.Array:
        return jax.lax.axis_index(AXIS) if self.p > 1 else jnp.zeros((), jnp.int32)

    def _vary(self, tree: Any) -> Any:
        return _varying(tree, self.axes) if self.p > 1 else tree

    def _gather(self, params: Any, offset: int = 1) -> Any:
        """With ``fsdp_gather='action'``: ``params`` (one chunk: ``offset=1``; the ``[chunks, ...]`` block:
        ``offset=0``) all-gathered over ``fsdp`` along each leaf's fsdp dim; otherwise ``params`` as given."""
        if not self.gathers:
            return params
        leaves, treedef = jax.tree.flatten(params)
        full = [a if d is None else jax.lax.all_gather(a, FSDP, axis=d - offset, tiled=True)
                for a, d in zip(leaves, self.fsdp_dims)]
        return self._vary(treedef.unflatten(full))

    def _full(self, params: Any) -> Any:
        """The (abstract) unsharded block of ``[chunks, ...]`` params: the float32 gradient accumulator's shape."""
        leaves, treedef = jax.tree.flatten(params)
        grow = lambda a, d: a.shape if d is None else (*a.shape[:d], a.shape[d] * self.fsdp_size, *a.shape[d + 1:])
        dims = self.fsdp_dims if self.gathers else (None,) * len(leaves)
        return treedef.unflatten([jax.ShapeDtypeStruct(grow(a, d), a.dtype) for a, d in zip(leaves, dims)])

    def _share(self, aux: dict) -> jax.Array | None:
        """This shard's part of its microbatch's loss (None without manual batch axes): with ``aux['weight']``,
        ``w_s / sum_s w_s`` (the loss being a mean over what the weight counts, the microbatch's loss is
        ``sum_s w_s l_s / sum_s w_s``: a scalar ``psum`` inside the action); without, ``1 / shards`` (equal rows
        per shard: the mean of the shards' means). The loss cotangent of shard ``s`` is seeded with it."""
        if not self.batch:
            return None
        if "weight" in aux:
            w = jax.lax.stop_gradient(jnp.asarray(aux["weight"], jnp.float32))
            return w / jax.lax.psum(w, self.batch)
        return jnp.asarray(1.0 / self.batch_size, jnp.float32)

    def _layer_keys(self, rng: jax.Array | None, mb: jax.Array, chunk: jax.Array, layers: int) -> jax.Array | None:
        """The keys of one action (``None`` without ``takes_rng``): ``[layers]`` typed keys, entry ``l`` being
        ``fold_in(fold_in(rng, mb), vs * layers + l)`` for the action's virtual stage ``vs`` (model order), that
        is the global index of the layer (row of the stacked stage params) it runs."""
        if not self.takes_rng:
            return None
        placement = jnp.asarray(self.schedule.placement, jnp.int32)
        vs = placement[self._stage(), chunk]
        mb_key = jax.random.fold_in(rng, mb)
        return jax.vmap(lambda l: jax.random.fold_in(mb_key, l))(vs * layers + jnp.arange(layers))

    def _bind(self, keys: jax.Array | None) -> Callable:
        """The stage function of one action, ``(params, x) -> y``: ``stage_fn`` with the action's keys."""
        if keys is None:
            return self.stage_fn
        return lambda params, x: self.stage_fn(params, x, keys)

    def _psum(self, tree: Any, from_one_stage: bool = False, batch: bool = False) -> Any:
        """``psum`` over ``pipe`` (``batch``: and the manual batch axes); ``from_one_stage``: of values one stage
        holds (the others zeros), which is exact, so 16-bit floats are summed in float32
        (:func:`jaxpar._compat.psum_16bit_safe`)."""
        if self.p == 1:
            return tree
        psum = _compat.psum_16bit_safe if from_one_stage else jax.lax.psum
        axes = self.axes if batch and self.batch else AXIS
        return jax.tree.map(lambda x: psum(x, axes), tree)

    def _reduce_stage(self, dparams: Any) -> Any:
        """Once per step, after the tick loop: the float32 stage gradient reduce-scattered over ``fsdp`` (along
        each leaf's fsdp dim) and summed over the other manual batch axes."""
        if not self.batch:
            return dparams
        leaves, treedef = jax.tree_util.tree_flatten_with_path(dparams)
        out = []
        for (path, g), d in zip(leaves, self.dims() or (None,) * len(leaves)):
            rest = self.batch
            if carried.is_carried(path):   # carried state's new value: combined over the shards as declared
                g, d, rest = carried.reduce_shards(path, g, self.batch), None, ()
            if d is not None:
                g = jax.lax.psum_scatter(g, FSDP, scatter_dimension=d, tiled=True)
                rest = tuple(a for a in self.batch if a != FSDP)
            out.append(jax.lax.psum(g, rest) if rest else g)
        return treedef.unflatten(out)

    def _reduce_head(self, dhead: Any) -> Any:
        """Once per step: the head gradient summed over ``pipe`` and the manual batch axes; a carried leaf's new
        value summed over ``pipe`` (the last stage's alone is not zero) and combined over the batch shards as
        declared."""
        def one(path, g):
            if not carried.is_carried(path):
                return self._psum(g, batch=True)
            g = self._psum(g)
            return carried.reduce_shards(path, g, self.batch) if self.p > 1 else g
        return jax.tree_util.tree_map_with_path(one, dhead)

    def _send(self, table: ControlTable, message: jax.Array) -> tuple:
        """``(from the previous stage, from the next stage, own)``: the message handed round over the pairs the
        table uses (with two stages one ``ppermute`` reaches both neighbours)."""
        none = jnp.zeros_like(message)
        if self.p == 1:
            return none, none, message
        from_prev = jax.lax.ppermute(message, AXIS, table.to_next) if table.to_next else none
        from_next = jax.lax.ppermute(message, AXIS, table.to_prev) if table.to_prev else none
        return from_prev, (from_prev if self.p == 2 else from_next), message

    def _scaled_loss(self, head, y, tgt, scale):
        """``(scale * loss / m, (loss / m, aux))``: the differentiated value carries the loss scale."""
        out = self.loss_fn(head, y, tgt)
        loss, aux = out if self.has_aux else (out, {})
        loss = loss.astype(jnp.float32) / self.m
        share = self._share(aux)
        if share is not None:   # this shard's part; summed over the batch axes after the loop
            loss = loss * share
            aux = {k: v if k == "weight" else v * share for k, v in aux.items()}
        return loss * scale, (loss, aux)

    def _branches(self, plan, split, zero: _Out, scale):
        """The actions, ``(op: _Operands) -> _Out`` (``op.stashes``, ``op.slots``: :class:`_Stashes` of buffers
        and of the slots to read; ``op.keys``: the action's layer keys or None); the stashes are read-only here
        (B and W read their slots inside their branches, so other ticks never touch them). B and W rebuild a
        microbatch's pullback with the keys of its F, so a dropout mask is the same."""
        f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
        held, shared = held_to_weight(self.stash, plan, split), self._shared(plan, split, zero.send)
        read = lambda bufs, slot: tuple(b[slot] for b in bufs)
        stashed = lambda st, sl: _merge(held, read(st.stash, sl.stash),
                                        shared.unpack(read(st.bstash, sl.bstash), False))
        leaves = lambda sf, params, x, res: backward_leaves(sf, self.stash, params, x, res, plan)[1]
        def slot(res):   # F's stash as one slot: (held leaves, the B-only leaves in the shared buffers)
            kept, freed = _part(held, res)
            return kept, shared.pack(freed, False)

        def idle(op: _Operands):
            return zero

        def fwd(op: _Operands):
            params = self._gather(op.params)
            y, res = forward_and_stash(self._bind(op.keys), self.stash, params, op.x, plan)
            return self._vary(zero._replace(send=y, res=slot(res)))

        def fwd_last(op: _Operands):
            params = self._gather(op.params)
            y, res = forward_and_stash(self._bind(op.keys), self.stash, params, op.x, plan)
            (_, (loss, aux)), (dhead, dy) = jax.value_and_grad(self._scaled_loss, (0, 1), has_aux=True)(
                op.head, y, op.tgt, scale)
            return self._vary(zero._replace(send=dy, res=slot(res), dhead=f32(dhead), loss=loss, aux=aux))

        def bwd(op: _Operands):
            params = self._gather(op.params)
            res = stashed(op.stashes, op.slots)
            dparams, dx = pullback_from_stash(self._bind(op.keys), self.stash, params, op.x, res, plan)(op.g)
            return zero._replace(send=dx, dparams=f32(dparams))

        def bwd_input(op: _Operands):
            params = self._gather(op.params)
            res = leaves(self._bind(op.keys), params, op.x, stashed(op.stashes, op.slots))
            dx, carry, dparams = split_lib.backward_input(split, params, op.x, res, op.g)
            return self._vary(zero._replace(send=dx, res=(zero.res[0], shared.pack(carry, True)),
                                            dparams=f32(dparams)))

        def bwd_weight(op: _Operands):
            params = self._gather(op.params)
            freed = tuple(jnp.zeros(r.shape, r.dtype) for r in shared.first)   # read by B only: dead code here
            res = leaves(self._bind(op.keys), params, op.x, _merge(held, read(op.stashes.stash, op.slots.stash), freed))
            carry = shared.unpack(read(op.stashes.bstash, op.slots.wstash), True)
            dparams = split_lib.backward_weight(split, params, op.x, res, carry)
            return self._vary(zero._replace(dparams=f32(dparams)))
        split_kinds = {Kind.BWD_INPUT: bwd_input, Kind.BWD_WEIGHT: bwd_weight} if split is not None else {}
        kinds = {Kind.IDLE: idle, Kind.FWD: fwd, Kind.FWD_LAST: fwd_last, Kind.BWD: bwd, **split_kinds}
        if not self.fused:
            return switch_branches(kinds)

        def fused(forward):   # FB: the F, and the full B of the fused operands (op.fused), in one branch
            def run(op: _Operands):
                fb = op.fused
                out = forward(op)
                back = bwd(op._replace(params=fb.params, keys=fb.keys,
                                       slots=op.slots._replace(stash=fb.slot, bstash=fb.slot)))
                return out._replace(send2=back.send, dparams=back.dparams)
            return run
        return switch_branches({**kinds, Kind.FWD_BWD: fused(fwd), Kind.FWD_LAST_BWD: fused(fwd_last)})

    # --- value and gradient ------------------------------------------------------------------------------
    def _shared(self, plan, split, x0) -> SharedSlots:
        """The B-only stashed leaves and B's carry to W: one buffer, taking turns in each slot."""
        _, freed = _part(held_to_weight(self.stash, plan, split), stashed_structs(self.stash, plan, x0))
        return SharedSlots(freed, split.carry_structs if split is not None else ())

    def _init(self, params, head, x_micro, t_micro, sizes: BufferSizes, plan, split) -> tuple[_Carry, _Out]:
        x0 = x_micro[:, 0]
        res = stashed_structs(self.stash, plan, x0)
        aux = jax.eval_shape(lambda h, y, t: self._scaled_loss(h, y, t, 1.0)[1][1], head, x0,
                             jax.tree.map(lambda t: t[:, 0], t_micro))
        f32 = jnp.float32
        full = self._full(params)
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), full)
        held, shared = held_to_weight(self.stash, plan, split), self._shared(plan, split, x0)
        one_slot = (_zeros(_part(held, res)[0]), _zeros(shared.buffer_structs()))
        zero = _Out(jnp.zeros_like(x0), one_slot, _zeros(one, f32), _zeros(head, f32),
                    jnp.zeros((), f32), _zeros(aux), jnp.zeros_like(x0) if self.fused else None)
        buffers = lambda n: jnp.zeros((n, *x0.shape), x0.dtype)
        slots = lambda n, structs: tuple(jnp.zeros((n, *r.shape), r.dtype) for r in structs)
        stashes = _Stashes(slots(sizes.stash, _part(held, res)[0]), shared.zeros(sizes.bstash), ())
        carry = _Carry(stashes=stashes,
                       act=buffers(sizes.activations), cot=buffers(sizes.cotangents),
                       gx=jnp.zeros(x_micro.shape, x_micro.dtype),
                       dparams=_zeros(_per_microbatch(full, self.m, 1), f32),
                       dhead=_zeros(_per_microbatch(head, self.m, 0), f32),
                       loss=zero.loss, aux=jax.tree.map(lambda a: jnp.zeros((self.m, *a.shape), a.dtype), aux))
        return self._vary(carry), self._vary(zero)

    def value_and_grad(self, stage_params, head, x_micro, t_micro, scale, rng=None):
        """Inside shard_map: this stage's ``[num_chunks, ...]`` params, replicated head, ``[B/m, m, ...]``
        inputs/targets, the loss scale (gradients are of ``scale * loss``; the loss is returned unscaled) and,
        with ``takes_rng``, the step's key (:meth:`_layer_keys`)."""
        table = control_table(self.schedule)
        stage = self._stage()
        stage_params, head, x_micro, t_micro, scale = self._vary((stage_params, head, x_micro, t_micro, scale))
        one = self._gather(_chunk(stage_params, 0, 1))
        layers = _num_rows(one)
        sf0 = self._bind(self._layer_keys(rng, 0, 0, layers))   # the plans read shapes only: any action's keys
        plan = residual_plan(sf0, one, x_micro[:, 0]) if self.stash == "residuals" else None
        split = split_lib.split_plan(sf0, one, x_micro[:, 0]) if self.schedule.split_backward else None
        carry, zero = self._init(stage_params, head, x_micro, t_micro, table.sizes, plan, split)
        branches = self._branches(plan, split, zero, scale)

        fb_kinds = (Kind.FWD_BWD, Kind.FWD_LAST_BWD) if self.fused else ()

        def tick(carry: _Carry, row: Actions):
            c = jax.tree.map(lambda a: a[stage], row)
            kind, mb, f = c.kind, c.microbatch, c.fused           # f: an FB's B (None in a table without FBs)
            params = _chunk(stage_params, c.chunk, self.v)
            x_in = jnp.where(c.first == 1, microbatch(x_micro, mb), carry.act[c.act_read])
            tgt = jax.tree.map(lambda t: microbatch(t, mb), t_micro)
            st, sl = carry.stashes, _Stashes(c.stash_slot, c.bstash_slot, c.wstash_slot)
            keys = self._layer_keys(rng, mb, c.chunk, layers)
            fb = None if f is None else _FusedBackward(_chunk(stage_params, f.chunk, self.v),
                                                       self._layer_keys(rng, f.microbatch, f.chunk, layers),
                                                       f.stash_slot)
            out = jax.lax.switch(kind, branches, _Operands(params, head, x_in, carry.cot[c.cot_read], tgt, st, sl,
                                                           keys, fb))
            act, cot = _route(table.actions.arrive_buffer, c, carry.act, carry.cot, self._send(table, out.send))
            is_fwd, is_b_input = _is(kind, Kind.FWD, Kind.FWD_LAST, *fb_kinds), kind == Kind.BWD_INPUT
            stashes = _Stashes(write_stash(st.stash, out.res[0], c.stash_slot, is_fwd),
                               write_stash(st.bstash, out.res[1], c.bstash_slot, is_fwd | is_b_input), ())
            gx = _put(carry.gx, out.send, mb, (c.first == 1) & ((kind == Kind.BWD) | is_b_input), axis=1)
            g_chunk, g_mb = c.chunk, mb
            if f is not None:       # the FB's B: its message on the second channel, its d input, its chunk
                act, cot = _route(table.actions.fused.arrive_buffer, f, act, cot, self._send(table, out.send2))
                gx = _put(gx, out.send2, f.microbatch, (f.first == 1) & _is(kind, *fb_kinds), axis=1)
                g_chunk = jnp.where(_is(kind, *fb_kinds), f.chunk, c.chunk)
                g_mb = jnp.where(_is(kind, *fb_kinds), f.microbatch, mb)
            return _Carry(
                stashes=stashes, act=act, cot=cot, gx=gx,
                dparams=_add_chunk(carry.dparams, out.dparams, g_chunk, self.v, g_mb),
                dhead=jax.tree_util.tree_map_with_path(   # a carried leaf's row: the F's microbatch
                    lambda p, a, b: _add_at(a, b, mb) if carried.is_carried(p) else a + b, carry.dhead, out.dhead),
                loss=carry.loss + out.loss,
                aux=jax.tree.map(lambda acc, a: _put(acc, a, mb, _is(kind, Kind.FWD_LAST, *fb_kinds[1:])), carry.aux,
                                 out.aux)), None

        carry, _ = jax.lax.scan(tick, carry, jax.tree.map(jnp.asarray, table.actions))
        # once per step: the gradients' (and the loss's) reductions over pipe and the manual batch axes
        g_stage = jax.tree.map(lambda g, a: g.astype(a.dtype), self._reduce_stage(
            _combine_microbatches(carry.dparams, 1)), stage_params)
        g_head = jax.tree.map(lambda g, a: g.astype(a.dtype), self._reduce_head(_combine_microbatches(carry.dhead, 0)),
                              head)
        g_x = self._psum(carry.gx, from_one_stage=True)
        loss, aux = self._psum(carry.loss, batch=True), self._psum(carry.aux, from_one_stage=True, batch=True)
        return loss, (g_stage, g_head, g_x), aux

    # --- forward only ---------------------------------------------------------------------------------
    def apply(self, stage_params, x_micro, rng=None):
        """Inside shard_map: runs the schedule's F actions (with ``takes_rng``, each with the keys of
        :meth:`_layer_keys`, as in training); returns the last virtual stage's outputs ``[B/m, m, ...]``."""
        table = control_table(self.schedule)
        stage = self._stage()
        x_micro = self._vary(x_micro)
        x0 = x_micro[:, 0]
        zero = self._vary(jnp.zeros_like(x0))
        layers = _num_rows(_chunk(stage_params, 0, 1))
        run = lambda op: self._bind(op.keys)(op.params, op.x)
        branches = switch_branches({Kind.IDLE: lambda op: zero, Kind.FWD: run, Kind.FWD_LAST: run})

        def tick(carry, row: Actions):
            act, ys = carry
            c = jax.tree.map(lambda a: a[stage], row)
            kind, mb = c.kind, c.microbatch
            x_in = jnp.where(c.first == 1, microbatch(x_micro, mb), act[c.act_read])
            keys = self._layer_keys(rng, mb, c.chunk, layers)
            y = jax.lax.switch(kind, branches, _ForwardOperands(_chunk(stage_params, c.chunk, self.v), x_in, keys))
            act, _ = _route(table.actions.arrive_buffer, c, act, None, self._send(table, y))
            return (act, _put(ys, y, mb, kind == Kind.FWD_LAST, 1)), None

        init = self._vary((jnp.zeros((table.sizes.activations, *x0.shape), x0.dtype), jnp.zeros_like(x_micro)))
        (_, ys), _ = jax.lax.scan(tick, init, jax.tree.map(jnp.asarray, table.actions))
        return self._psum(ys, from_one_stage=True)
