"""Which parameter each value of a traced optimizer update is computed from, and along which axes.

A small dependence walk over a jaxpr (a sharding propagation): ``jp.sharding.opt_state_shardings`` places each
optimizer-state leaf along the parameter it follows, and the pipeline's stage layout
(``jaxpar.pipeline.stage_layout``) moves the leaves computed along a stage parameter's layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import optax
from jax.extend import core as jcore
from jax.sharding import Mesh

# The origins of a value in a traced program: for each parameter leaf it is computed from along some of its
# axes, the parameter axis each axis of the value runs along (None: along none). Only aligned axes matter
# for a sharding: a scalar such as a global norm carries no axis, a mean over rows drops the row axis.
Origins = dict[int, tuple[int | None, ...]]

_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                         "reduce_xor", "argmax", "argmin"})


def _merge(*origins: Origins) -> Origins:
    """Union of origins; an axis two of them align with different parameter axes aligns with none."""
    out: dict[int, tuple[int | None, ...]] = {}
    for o in origins:
        for i, dims in o.items():
            old = out.get(i, dims)
            out[i] = tuple(a if b is None or a == b else b if a is None else None for a, b in zip(old, dims))
    return {i: d for i, d in out.items() if any(a is not None for a in d)}


def _remap(o: Origins, axes: Sequence[int | None]) -> Origins:
    """Origins of a value whose axis ``k`` is axis ``axes[k]`` of the value ``o`` describes (None: a new axis)."""
    return _merge({i: tuple(None if a is None else d[a] for a in axes) for i, d in o.items()})


def _reshape_axes(old: tuple[int, ...], new: tuple[int, ...]) -> list[int | None]:
    """For each axis of a reshape's output, the input axis it is: size-1 axes aside, a common prefix and suffix."""
    src, dst = [k for k, n in enumerate(old) if n != 1], [k for k, n in enumerate(new) if n != 1]
    axes: list[int | None] = [None] * len(new)
    i = j = 0
    while i < min(len(src), len(dst)) and old[src[i]] == new[dst[i]]:
        axes[dst[i]], i = src[i], i + 1
    while j < min(len(src), len(dst)) - i and old[src[-1 - j]] == new[dst[-1 - j]]:
        axes[dst[-1 - j]], j = src[-1 - j], j + 1
    return axes


def _dot_origins(dimension_numbers, shapes: list[tuple[int, ...]], ins: list[Origins]) -> Origins:
    """``dot_general``'s output axes: batch axes, then the lhs's free axes, then the rhs's."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf = [k for k in range(len(shapes[0])) if k not in lc and k not in lb]
    rf = [k for k in range(len(shapes[1])) if k not in rc and k not in rb]
    return _merge(_remap(ins[0], [*lb, *lf, *[None] * len(rf)]), _remap(ins[1], [*rb, *[None] * len(lf), *rf]))


def _fixed_point(body, carry: list[Origins], steps: int = 4) -> list[Origins]:
    """A loop carry's origins: merged over iterations of ``body`` (carry -> new carry) until they settle."""
    for _ in range(steps):
        new = [_merge(a, b) for a, b in zip(carry, body(carry))]
        if new == carry:
            break
        carry = new
    return carry


def _loop_origins(eqn, ins: list[Origins]) -> list[Origins]:
    """``while``: the carry's origins. ``scan``: the carry's, then the stacked outputs' (leading axis new)."""
    p = eqn.params
    if eqn.primitive.name == "while":
        consts, carry = ins[:p["cond_nconsts"] + p["body_nconsts"]][p["cond_nconsts"]:], \
            ins[p["cond_nconsts"] + p["body_nconsts"]:]
        return _fixed_point(lambda c: _walk(p["body_jaxpr"].jaxpr, [*consts, *c]), carry)
    nc, nk, body = p["num_consts"], p["num_carry"], p["jaxpr"].jaxpr
    xs = [_remap(o, range(1, v.aval.ndim)) for o, v in zip(ins[nc + nk:], eqn.invars[nc + nk:])]
    run = lambda c: _walk(body, [*ins[:nc], *c, *xs])
    carry = _fixed_point(lambda c: run(c)[:nk], ins[nc:nc + nk])
    ys = run(carry)[nk:]
    return carry + [_remap(o, [None, *range(v.aval.ndim - 1)]) for o, v in zip(ys, eqn.outvars[nk:])]


def _eqn_origins(eqn, ins: list[Origins]) -> list[Origins]:
    """The origins of one equation's outputs from its inputs'. Unknown primitives: an output is aligned with
    every input of its shape (elementwise ops, selects, casts, sharding constraints, in-place updates)."""
    name, p = eqn.primitive.name, eqn.params
    shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
    out_shapes = [getattr(v.aval, "shape", ()) for v in eqn.outvars]
    if name == "transpose":
        return [_remap(ins[0], p["permutation"])]
    if name == "broadcast_in_dim":
        axes = [None] * len(out_shapes[0])
        for k, d in enumerate(p["broadcast_dimensions"]):
            axes[d] = k if shapes[0][k] == out_shapes[0][d] else None
        return [_remap(ins[0], axes)]
    if name in _REDUCTIONS or name == "squeeze":
        dropped = p["axes"] if name in _REDUCTIONS else p["dimensions"]
        return [_remap(ins[0], [k for k in range(len(shapes[0])) if k not in dropped])]
    if name == "reshape":
        return [_remap(ins[0], _reshape_axes(shapes[0], out_shapes[0]))]
    if name in ("stack", "concatenate"):     # stack: a new axis; concatenate: along an axis of every input
        k = p["axis"] if name == "stack" else p["dimension"]
        keep = [*range(k), None, *range(k + 1 if name == "concatenate" else k, len(shapes[0]))]
        return [_merge(*(_remap(o, keep) for o in ins))]
    if name == "dot_general":
        return [_dot_origins(p["dimension_numbers"], shapes, ins)]
    if name == "cond":
        return [_merge(*outs) for outs in zip(*(_walk(b.jaxpr, ins[1:]) for b in p["branches"]))]
    if name in ("while", "scan"):
        return _loop_origins(eqn, ins)
    subs = [x.jaxpr if isinstance(x, jcore.ClosedJaxpr) else x for v in p.values()
            for x in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr))]
    if len(subs) == 1 and len(subs[0].invars) == len(ins) and len(subs[0].outvars) == len(out_shapes):
        return _walk(subs[0], ins)           # jit, custom_jvp/vjp calls, remat, shard_map bodies
    return [_merge(*(o for o, s in zip(ins, shapes) if s == shape)) if shape else {} for shape in out_shapes]


def _walk(jaxpr: jcore.Jaxpr, ins: Sequence[Origins]) -> list[Origins]:
    """The origins of ``jaxpr``'s outputs given its inputs' (constants have none)."""
    env = dict(zip(jaxpr.invars, ins))
    read = lambda v: {} if isinstance(v, jcore.Literal) else env.get(v, {})
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, _eqn_origins(eqn, [read(v) for v in eqn.invars])))
    return [read(v) for v in jaxpr.outvars]


def update_origins(tx: optax.GradientTransformation, param_shapes: Any, opt_shapes: Any,
                    mesh: Mesh) -> list[Origins]:
    """The origins of every leaf of the state ``tx.update(grads, opt_state, params)`` returns.

    The update is traced on shapes only (under ``jax.set_mesh(mesh)``) with gradients and params shaped like
    the params, and its jaxpr walked: a value computed elementwise from parameter leaf ``i`` (its gradient or
    itself) along some axes has origin ``{i: (param axis of each of its axes)}``; reductions drop axes,
    broadcasts, transposes and reshapes move them. State inputs take the origins of the previous walk's state
    outputs (a leaf passed through a branch unchanged keeps its own), repeated until they settle.

    Returns:
      One ``{param leaf index: param axis (or None) per axis of the leaf}`` per state leaf, in flattening order.

    Raises:
      ValueError: the update returns a state whose leaves' shapes differ from ``opt_shapes``.
    """
    with jax.set_mesh(mesh):
        closed = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p)[1])(param_shapes, opt_shapes, param_shapes)
    want = [tuple(x.shape) for x in jax.tree.leaves(opt_shapes)]
    if [tuple(a.shape) for a in closed.out_avals] != want:
        raise ValueError(f"tx.update returns state leaves of shapes {[a.shape for a in closed.out_avals]}; tx.init "
                         f"gave {want}")
    seed = [{i: tuple(range(len(x.shape)))} if len(x.shape) else {}
            for i, x in enumerate(jax.tree.leaves(param_shapes))]
    state: list[Origins] = [{} for _ in want]
    for _ in range(4):
        new = _walk(closed.jaxpr, [*seed, *state, *seed])
        if new == state:
            break
        state = new
    return state


__all__ = ["Origins", "update_origins"]
