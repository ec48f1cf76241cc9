"""What a pipeline stage keeps from a microbatch's forward for its backward (the stash), and how it is rebuilt.

Two modes (``stash=`` of ``jp.pipeline.value_and_grad``):

* ``'residuals'``: the forward is ``jax.vjp`` of the stage function; of its pullback's residuals, only those
  that depend on the stage input are stashed (:func:`residual_plan`). Those that depend only on the
  parameters (e.g. a reshaped weight) are recomputed by the backward and never stashed per microbatch.
* ``'inputs'``: only the stage input is stashed; the backward recomputes the forward (activation
  checkpointing of the whole stage: less memory, one more forward per microbatch).

The interpreter keeps one buffer per stashed leaf, ``[stash slots, ...]``, written by F and read by B in the
slot the control table names (:mod:`jaxpar.pipeline.table`). In a table with split backwards the stashed
leaves fall in two groups (:func:`held_to_weight`): those W reads stay in the stash until the W, those only B
reads are needed from the F to the B; and the values a split B hands to its W (:mod:`jaxpar.pipeline.split`'s
carry) from the B to the W. The last two never live at once for one (microbatch, chunk), so they share
buffers (:class:`SharedSlots`, leaves of equal shape paired): each slot holds the B-only leaves until the B,
which overwrites them with its carry. A (microbatch, chunk) then costs about ``held + max(B-only, carry)``
bytes from its F to its W, instead of ``held + B-only`` and ``carry`` in two buffers each sized for its own
peak.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

STASH_MODES = ("residuals", "inputs")

# ``residual_plan``'s result: (per pullback leaf, whether it is stashed; the struct of each stashed leaf).
Plan = tuple[tuple[bool, ...], tuple[jax.ShapeDtypeStruct, ...]]


def residual_plan(stage_fn: Callable, params: Any, x: jax.Array) -> Plan:
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


def stashed_structs(mode: str, plan: Plan | None, x_mb: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The ``ShapeDtypeStruct`` of each leaf stashed per microbatch (``x_mb``: one microbatch's input)."""
    return (jax.ShapeDtypeStruct(x_mb.shape, x_mb.dtype),) if mode == "inputs" else plan[1]


def forward_and_stash(stage_fn: Callable, mode: str, params: Any, x: jax.Array, plan: Plan | None) -> tuple:
    """One microbatch's forward: ``(stage_fn(params, x), the leaves to stash)``.

    Raises:
      RuntimeError: the vjp has another number of residuals than when ``plan`` was made (a stage function
        whose traced program depends on more than shapes and dtypes).
    """
    if mode == "inputs":
        return stage_fn(params, x), (x,)
    y, pullback = jax.vjp(stage_fn, params, x)
    leaves = jax.tree.leaves(pullback)
    if len(leaves) != len(plan[0]):
        raise RuntimeError(f"stage_fn's vjp has {len(leaves)} residuals here but {len(plan[0])} when planned")
    return y, tuple(r for r, keep in zip(leaves, plan[0]) if keep)


def backward_leaves(stage_fn: Callable, mode: str, params: Any, x: jax.Array, res: tuple,
                    plan: Plan | None) -> tuple[Any, list]:
    """The pullback's residual leaves at the stashed microbatch, and its tree: ``(treedef, leaves)``.

    ``'residuals'``: the stashed leaves (``res``) and, for the others, a forward at ``x`` whose input-dependent
    part is dead code (the compiler removes it), so only the parameter-only residuals are recomputed.
    ``'inputs'``: the leaves of a fresh vjp at the stashed input (the forward recomputed).
    """
    if mode == "inputs":
        leaves, treedef = jax.tree.flatten(jax.vjp(stage_fn, params, res[0])[1])
        return treedef, leaves
    leaves, treedef = jax.tree.flatten(jax.vjp(stage_fn, params, x)[1])
    stashed = iter(res)
    return treedef, [next(stashed) if keep else r for r, keep in zip(leaves, plan[0])]


def pullback_from_stash(stage_fn: Callable, mode: str, params: Any, x: jax.Array, res: tuple,
                        plan: Plan | None) -> Callable:
    """The pullback of ``stage_fn`` at the stashed microbatch: ``g -> (d params, d x)`` (see
    :func:`backward_leaves` for how it is rebuilt)."""
    treedef, leaves = backward_leaves(stage_fn, mode, params, x, res, plan)
    return jax.tree.unflatten(treedef, leaves)


def held_to_weight(mode: str, plan: Plan | None, split: Any | None) -> tuple[bool, ...]:
    """Per stashed leaf, whether it is held until the ``W`` (the leaves ``W`` reads) rather than freed at the
    ``B`` (the leaves only ``B`` reads). Without a split (``split is None``) every leaf is freed at the ``B``
    (reported as ``True``: they all live in the one stash); with ``stash='inputs'`` the stage input is held to
    ``W`` (which recomputes the forward from it)."""
    if mode == "inputs" or split is None:
        return (True,) * (1 if mode == "inputs" else sum(plan[0]))
    leaf_index = [i for i, keep in enumerate(plan[0]) if keep]
    return tuple(i in split.w_leaves for i in leaf_index)


class SharedSlots(NamedTuple):
    """Two groups of leaves, ``first`` and ``second``, that take turns in the same buffer slots.

    Each leaf of ``second`` takes the buffer of a leaf of ``first`` of the same shape and dtype (the first such
    one not yet taken); a leaf with no partner gets a buffer of its own. Leaves are never reshaped, so a
    sharded leaf keeps its layout (a flat union buffer would reshard inside the action branches, and a
    collective inside a branch only some stages take deadlocks). :meth:`buffer_structs` are the slots'
    structs; :meth:`pack` gives one group's values per buffer (zeros for the buffers it does not use).
    """
    first: tuple[jax.ShapeDtypeStruct, ...]
    second: tuple[jax.ShapeDtypeStruct, ...]

    def _layout(self) -> tuple[tuple[jax.ShapeDtypeStruct, ...], tuple[int, ...], tuple[int, ...]]:
        """``(buffer structs, buffer of each first leaf, buffer of each second leaf)``."""
        key = lambda r: (tuple(r.shape), jnp.dtype(r.dtype))
        buffers, free = list(self.first), list(range(len(self.first)))
        of_second = []
        for r in self.second:
            match = next((i for i in free if key(buffers[i]) == key(r)), None)
            if match is None:
                buffers.append(r)
                match = len(buffers) - 1
            else:
                free.remove(match)
            of_second.append(match)
        return tuple(buffers), tuple(range(len(self.first))), tuple(of_second)

    def buffer_structs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return self._layout()[0]

    def zeros(self, num_slots: int) -> tuple:
        """The empty buffers, ``[num_slots, ...]`` per buffer."""
        return tuple(jnp.zeros((num_slots, *r.shape), r.dtype) for r in self.buffer_structs())

    def pack(self, values: tuple, second: bool) -> tuple:
        """One slot's value per buffer: ``values`` (the ``second`` group's leaves, or the ``first``'s) in their
        buffers, zeros in the others."""
        buffers, of_first, of_second = self._layout()
        out = [jnp.zeros(r.shape, r.dtype) for r in buffers]
        for v, i in zip(values, of_second if second else of_first):
            out[i] = v
        return tuple(out)

    def unpack(self, slot: tuple, second: bool) -> tuple:
        """The leaves of the ``second`` group (or the ``first``) from one slot's values (one per buffer)."""
        _, of_first, of_second = self._layout()
        return tuple(slot[i] for i in (of_second if second else of_first))


def write_stash(stash: tuple, res: tuple, slot: jax.Array, on: jax.Array) -> tuple:
    """Writes one microbatch's residuals into their slot when ``on`` (F ticks), in place.

    A two-way ``lax.cond`` whose false branch passes the buffers through: XLA updates them in place. (Threaded
    through the multi-way action switch instead, every stash buffer was copied at every tick; a masked
    select-and-write reads the slot back at every tick.) The action switch only reads the stash.
    """
    write = lambda st: tuple(jax.lax.dynamic_update_index_in_dim(b, r, slot, 0) for b, r in zip(st, res))
    return jax.lax.cond(on, write, lambda st: st, stash)
