"""A stage's backward split in two: ``B`` (the input gradient) and ``W`` (the weight gradient), for zero-bubble tables.

Qi et al. 2024 ("Zero Bubble Pipeline Parallelism", sec. 2) split each backward into ``B``, the cotangent of
the stage input (on the critical path: the previous stage waits for it), and ``W``, the parameter gradient
(off it: it can run later, in a bubble). The split must be real: ``W`` must not recompute the input-gradient
chain. XLA does not remove it from a pullback that computes both, so the split is made on the pullback's
program itself:

1. trace ``jax.vjp(stage_fn)``'s pullback as a function of its residuals and the output cotangent ``g`` into
   a jaxpr (nested ``jit`` and ``checkpoint`` calls inlined, so that a layer's ``dx`` and ``dW`` parts
   separate);
2. ``B`` is the backward slice of ``dx``: the equations ``dx`` depends on, nothing else;
3. ``W`` is the backward slice of the parameter gradients, less the equations ``B`` already ran. Values of
   ``B``'s that ``W`` reads and that depend on ``g`` (the cotangents inside the stage, and ``g`` itself) are
   handed from ``B`` to ``W`` (the *carry*, stashed between them); values that do not depend on ``g`` (functions
   of the parameters and residuals only, e.g. a transposed weight) are recomputed by ``W`` rather than
   stashed.

4. ``g`` itself is never handed over: the weight-gradient equations that read it (the last layer's, e.g.
   ``a^T g`` of an output projection) run in ``B``, which adds their part of the parameter gradient to the
   accumulator at once (:func:`_finish_g`). Handing ``g`` to ``W`` would keep one more activation-sized value per
   (microbatch, chunk) from its ``B`` to its ``W``, one that no buffer freed at ``B`` has room for; ``B`` has just
   read ``g`` from the cotangent buffer, so this costs no extra memory and no extra FLOPs. What then joins ``W``'s
   part of the same gradient (a sum over the layers of a stacked weight) is split by linearity: the equations
   between such a product and the gradient (sums, pads, reshapes: no matmul) run in both, each on its own part,
   the other part zero. The residuals only those equations read are freed at ``B``.

Limits: an inner loop (``lax.scan`` over layers, ``fori_loop``) is one equation that computes both ``dx`` and
the weight gradients, so it runs in ``B`` whole (a warning says so). Under ``jax.checkpoint`` inside the stage,
``W`` recomputes the forward values it needs rather than receiving them (``B + W`` is then about one forward
more than the fused backward). Correct in every case; the split only moves work.

So ``FLOPs(B) + FLOPs(W)`` is the fused backward's plus those small recomputations, and ``W`` alone is the
weight-gradient matmuls but the last layer's that read ``g`` (about half of a matmul layer's backward, less that
product: with one two-matmul layer per chunk, a quarter).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jaxpar._compat import varying_axes

_CALLS = ("jit", "pjit", "closed_call", "core_call")      # params["jaxpr"]: a ClosedJaxpr (or Jaxpr)
_REMATS = ("checkpoint", "remat2", "remat")                # params["jaxpr"]: a Jaxpr

Atom = Any   # an int key into the evaluation environment, or a jax Literal


class _Op(NamedTuple):
    eqn: Any                  # the JaxprEqn whose primitive and params are bound
    ins: tuple[Atom, ...]
    outs: tuple[int, ...]


class SplitPlan(NamedTuple):
    """The two halves of a pullback (:func:`split_plan`)."""
    inputs: tuple[int, ...]           # keys of the flat inputs: params leaves, x, residual leaves, g
    consts: tuple[tuple[int, Any], ...]
    b_ops: tuple[_Op, ...]            # B: the equations d x depends on
    w_ops: tuple[_Op, ...]            # W: the rest of what d params depends on
    dx: Atom
    dparams: tuple[Atom, ...]
    carry: tuple[int, ...]            # keys B hands to W
    carry_structs: tuple[jax.ShapeDtypeStruct, ...]
    dparams_structs: tuple[jax.ShapeDtypeStruct, ...]
    dparams_tree: Any
    g: int                            # the key of the output cotangent
    w_leaves: tuple[int, ...]         # indices of the residual leaves W reads (the others only B reads)
    bw_ops: tuple[_Op, ...] = ()      # weight-gradient equations B runs (those on g, see _finish_g)
    b_grads: tuple[bool, ...] = ()    # per dparams leaf: B adds a part of it
    w_grads: tuple[bool, ...] = ()    # per dparams leaf: W adds a part of it
    zeroable: frozenset = frozenset()  # keys on g: a phase that does not compute one reads it as zero


class _Flat:
    """A jaxpr flattened into :class:`_Op`\\ s over int keys, nested calls inlined."""

    def __init__(self):
        self.ops: list[_Op] = []
        self.avals: dict[int, Any] = {}
        self.consts: dict[int, Any] = {}

    def key(self, aval) -> int:
        k = len(self.avals)
        self.avals[k] = aval
        return k

    def add(self, jaxpr, ins: list[Atom], consts=()) -> list[Atom]:
        env: dict[Any, Atom] = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = self.key(v.aval)
            self.consts[env[v]] = c
        env.update(zip(jaxpr.invars, ins))
        read = lambda a: a if isinstance(a, jcore.Literal) else env[a]
        for eqn in jaxpr.eqns:
            args, name = [read(a) for a in eqn.invars], eqn.primitive.name
            inner = eqn.params.get("jaxpr")
            if name in _CALLS and inner is not None:
                closed = inner if isinstance(inner, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(inner, ())
                outs = self.add(closed.jaxpr, args, closed.consts)
            elif name in _REMATS and isinstance(inner, jcore.Jaxpr) and not inner.constvars:
                outs = self.add(inner, args)
            else:
                outs = [self.key(v.aval) for v in eqn.outvars]
                self.ops.append(_Op(eqn, tuple(args), tuple(outs)))
            env.update(zip(eqn.outvars, outs))
        return [read(a) for a in jaxpr.outvars]


def _producers(ops: list[_Op]) -> dict[int, int]:
    return {k: i for i, op in enumerate(ops) for k in op.outs}


def _slice(ops: list[_Op], roots: list[Atom]) -> set[int]:
    """Indices of the ops the ``roots`` depend on."""
    producer, live = _producers(ops), set()
    todo = [r for r in roots if isinstance(r, int)]
    while todo:
        k = todo.pop()
        if k in producer and producer[k] not in live:
            live.add(producer[k])
            todo.extend(a for a in ops[producer[k]].ins if isinstance(a, int))
    return live


def _weight_slice(ops: list[_Op], roots: list[Atom], carried) -> tuple[set[int], set[int]]:
    """``(ops W runs, keys B hands over)``: the slice of ``roots``, cut at the keys ``carried(k)`` says B
    computed on ``g`` (W reads those from B) and walking on through everything else (W recomputes it)."""
    producer, live, carry = _producers(ops), set(), set()
    todo = [r for r in roots if isinstance(r, int)]
    while todo:
        k = todo.pop()
        if carried(k):
            carry.add(k)
        elif k in producer and producer[k] not in live:
            live.add(producer[k])
            todo.extend(a for a in ops[producer[k]].ins if isinstance(a, int))
    return live, carry


# Equations linear in their cotangent operands whatever the others are, so that one may run twice, in B on g's
# part and in W on the rest, each with the other part zero (see _finish_g): sums and layout changes. Matmuls
# are linear too but left out: running one twice would cost its FLOPs twice.
_RELAYOUT = frozenset(("reshape", "transpose", "squeeze", "expand_dims", "convert_element_type", "copy", "copy_p",
                       "sharding_constraint", "pvary", "pcast", "mesh_cast", "reshard"))
_LINEAR = _RELAYOUT | frozenset(("add_any", "add", "sub", "neg", "broadcast_in_dim", "pad", "slice", "dynamic_slice",
                                 "dynamic_update_slice", "concatenate", "reduce_sum", "rev", "gather", "scatter-add",
                                 "scatter_add", "select_n"))
# _RELAYOUT: layout changes of one operand; a B value made from g by these is g by another name (_g_aliases).


# Operand positions that are not summed into the result (indices, predicates): they may be anything.
_NOT_SUMMED = {"select_n": (0,), "dynamic_slice": "1:", "gather": (1,), "dynamic_update_slice": "2:",
               "scatter-add": (1,), "scatter_add": (1,)}


def _is_zero(a: Atom, zeros: set[int]) -> bool:
    return (a in zeros) if isinstance(a, int) else bool(np.all(np.asarray(a.val) == 0))


def _zeros_of(ops: list[_Op]) -> set[int]:
    """Keys that hold constant zeros (a zero literal broadcast, cast or reshaped: what transposes pad into)."""
    zeros: set[int] = set()
    for op in ops:
        if op.eqn.primitive.name in ("broadcast_in_dim", "convert_element_type", "reshape") and _is_zero(
                op.ins[0], zeros):
            zeros.update(op.outs)
    return zeros


def _linear(op: _Op, on_g: set[int], zeros: set[int]) -> bool:
    """Whether ``op`` is linear in its cotangent operands (those in ``on_g``) and cheap, so that it may run in
    both phases on parts: a product with one cotangent factor, or a sum or layout change every summed operand of
    which is a cotangent or a constant zero (``g + 1`` is affine, not linear). Matmuls are linear but not cheap."""
    name, ins = op.eqn.primitive.name, op.ins
    ct = [isinstance(a, int) and a in on_g for a in ins]
    if name in ("mul", "div"):                       # a product with one cotangent factor (the numerator)
        return sum(ct) == 1 and (name == "mul" or ct[0])
    if name not in _LINEAR:
        return False
    fixed = _NOT_SUMMED.get(name, ())
    fixed = range(int(fixed[0]), len(ins)) if isinstance(fixed, str) else fixed
    return all((not ct[i]) if i in fixed else (ct[i] or _is_zero(a, zeros)) for i, a in enumerate(ins))


def _g_aliases(ops: list[_Op], b_live: set[int], g: int, on_g: set[int]) -> set[int]:
    """``g`` and the values B makes from it by layout changes alone (e.g. the 2-D view of a 3-D output a
    matmul's backward reads): handing any of them to W would hand g over."""
    alias = {g}
    for i in sorted(b_live):
        op = ops[i]
        ct = [a for a in op.ins if isinstance(a, int) and a in on_g]
        if op.eqn.primitive.name in _RELAYOUT and len(ct) == 1 and ct[0] in alias:
            alias.update(op.outs)
    return alias


class _Early(NamedTuple):
    moved: set[int]       # W's equations that B runs instead (every cotangent they read is g's or B's)
    tail: set[int]        # W's equations between those and the gradient that also read W's part: run in both
    recompute: set[int]   # W's equations on neither (functions of params and residuals) the two above read


def _finish_g(ops: list[_Op], w_live: set[int], aliases: set[int], on_g: set[int], b_side) -> _Early | None:
    """The weight-gradient equations ``B`` runs so that ``g`` (or a view of it, ``aliases``) is not handed to
    ``W`` (module docstring, 4.).

    In order, a W equation that reads g or a value made by such an equation is *moved* to B when every
    cotangent it reads is whole in B (``b_side(k)``: g and B's values, or made whole by a moved equation): it
    runs once, on whole values. Otherwise (it also reads W's part, or a value B has only g's part of) it is
    *tail*, run by both phases with the other's part zero, which is exact only for an equation linear in the
    cotangents (:func:`_linear`: sums, layout changes; not a user's ``custom_vjp`` rule such as a clip).
    ``None`` when a tail equation is not such an equation: then g is handed over whole, unsplit."""
    whole, part, moved, tail = set(aliases), set(), set(), set()   # values B has whole / only g's part of
    zeros = _zeros_of(ops)
    for i in sorted(w_live):
        op = ops[i]
        ct = [a for a in op.ins if isinstance(a, int) and a in on_g]
        if not any(a in whole or a in part for a in ct):
            continue
        if all(a in whole or (b_side(a) and a not in part) for a in ct):
            moved.add(i)
            whole.update(op.outs)
        elif _linear(op, on_g, zeros):
            tail.add(i)
            part.update(op.outs)
        else:
            return None
    producer, recompute = _producers(ops), set()
    todo = [a for i in moved | tail for a in ops[i].ins if isinstance(a, int) and a not in on_g]
    while todo:
        k = todo.pop()
        i = producer.get(k)
        if i is not None and i in w_live and i not in recompute:
            recompute.add(i)
            todo.extend(a for a in ops[i].ins if isinstance(a, int))
    return _Early(moved, tail, recompute)


def _depends_on(ops: list[_Op], key: int) -> set[int]:
    dep = {key}
    for op in ops:
        if any(isinstance(a, int) and a in dep for a in op.ins):
            dep.update(op.outs)
    return dep


def split_plan(stage_fn: Callable, params: Any, x: Any) -> SplitPlan:
    """Splits the pullback of ``stage_fn`` at ``(params, x)`` into B and W.

    ``params`` and ``x`` are tracers (inside ``shard_map`` their varying axes carry into the plan), or arrays
    or ``ShapeDtypeStruct``\\ s outside any trace.

    Returns:
      a :class:`SplitPlan` for :func:`backward_input` and :func:`backward_weight`.
    """
    leaves_of = lambda p, x: jax.tree.leaves(jax.vjp(stage_fn, p, x)[1])
    if all(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((params, x))):
        leaves = leaves_of(params, x)   # traced (inside shard_map: their varying axes carry into the plan); dead code
    else:
        leaves = jax.eval_shape(leaves_of, params, x)

    def pullback(params, x, leaves, g):
        _, treedef = jax.tree.flatten(jax.vjp(stage_fn, params, x)[1])
        return jax.tree.unflatten(treedef, leaves)(g)

    closed, out_shape = jax.make_jaxpr(pullback, return_shape=True)(params, x, leaves, x)
    flat = _Flat()
    inputs = [flat.key(v.aval) for v in closed.jaxpr.invars]
    outs = flat.add(closed.jaxpr, inputs, closed.consts)
    ops, dx, dparams, g = flat.ops, outs[-1], tuple(outs[:-1]), inputs[-1]
    b_live = _slice(ops, [dx])
    loops = sorted({ops[i].eqn.primitive.name for i in b_live if any(
        isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in ops[i].eqn.params.values())})
    if loops:
        warnings.warn(f"the stage's backward runs {', '.join(loops)}, which the B/W split cannot look inside: B "
                      f"computes the weight gradients of what runs in it and W gets none of them, so a zero-bubble "
                      f"schedule has little W to fill its bubbles with (unroll the layers, e.g. "
                      f"GPTConfig(scan_layers=False))", stacklevel=3)
    b_keys, on_g = {k for i in b_live for k in ops[i].outs}, _depends_on(ops, g)
    b_side = lambda k: k == g or (k in b_keys and k in on_g)
    w_live, carry = _weight_slice(ops, list(dparams), b_side)
    aliases = _g_aliases(ops, b_live, g, on_g)
    early = _finish_g(ops, w_live, aliases, on_g, b_side)
    if early is None:   # keep g handed over: B adds nothing, W all
        bw_live, b_grads, w_grads = set(), (False,) * len(dparams), (True,) * len(dparams)
    else:
        made = aliases | {k for i in early.moved | early.tail for k in ops[i].outs}
        tail_outs = {k for i in early.tail for k in ops[i].outs}
        b_grads = tuple(isinstance(a, int) and (a in made or b_side(a)) for a in dparams)
        w_grads = tuple(not b or a in tail_outs for a, b in zip(dparams, b_grads))
        w_live = w_live - early.moved
        bw_live = (early.moved | early.tail | early.recompute) - b_live
        w_roots = [a for a, w in zip(dparams, w_grads) if w and isinstance(a, int)]
        carry = {a for i in w_live for a in ops[i].ins if isinstance(a, int) and b_side(a) and a not in aliases}
        carry |= {a for a in w_roots if b_side(a) and a not in aliases}
    carry = tuple(sorted(carry))
    struct = lambda aval: jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    dparams_shape, _ = out_shape
    first_leaf = len(jax.tree.leaves(params)) + 1
    w_reads = {a for i in w_live for a in ops[i].ins if isinstance(a, int)}
    w_reads |= {a for a, w in zip(dparams, w_grads) if w and isinstance(a, int)}
    w_leaves = tuple(i for i, k in enumerate(inputs[first_leaf:-1]) if k in w_reads)
    return SplitPlan(tuple(inputs), tuple(flat.consts.items()), tuple(ops[i] for i in sorted(b_live)),
                     tuple(ops[i] for i in sorted(w_live)), dx, dparams, carry,
                     tuple(struct(flat.avals[k]) for k in carry), tuple(jax.tree.leaves(dparams_shape)),
                     jax.tree.structure(dparams_shape), g, w_leaves,
                     tuple(ops[i] for i in sorted(bw_live)), b_grads, w_grads, frozenset(on_g))


def _zeros(aval, like_axes: frozenset) -> jax.Array:
    z = jnp.zeros(aval.shape, aval.dtype)
    return jax.lax.pcast(z, tuple(like_axes), to="varying") if like_axes else z


def _vary_missing(x: Any, axes: tuple[str, ...]) -> Any:
    """``pvary`` over those of ``axes`` that ``x`` does not already vary over (a replayed ``pvary`` equation)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _run(ops: tuple[_Op, ...], env: dict[int, Any], zeroable: frozenset = frozenset()) -> None:
    """Binds ``ops`` in order over ``env``. A key in ``zeroable`` (a cotangent the other phase computes) that is
    not in ``env`` is zero: an equation whose cotangents all are zero makes zeros (left out of ``env``, as the
    equations are linear in them), ``add_any`` passes its other operand, any other equation reads real zeros."""
    read = lambda a: a.val if isinstance(a, jcore.Literal) else env[a]
    for op in ops:
        absent = [isinstance(a, int) and a not in env and a in zeroable for a in op.ins]
        if any(absent):
            present = [a for a, z in zip(op.ins, absent) if not z]
            if not any(isinstance(a, int) and a in zeroable for a in present):
                continue
            if op.eqn.primitive.name == "add_any":
                env[op.outs[0]] = read(present[0])
                continue
            axes = frozenset().union(*(varying_axes(read(a)) for a in present))
            for a, z in zip(op.ins, absent):
                if z:
                    env[a] = _zeros(op.eqn.invars[op.ins.index(a)].aval, axes)
        params = op.eqn.primitive.get_bind_params(op.eqn.params)
        if isinstance(params, tuple):                                  # older jax: (subfuns, params)
            subfuns, params = params
            args = [*subfuns, *map(read, op.ins)]
        else:
            args = list(map(read, op.ins))
        if op.eqn.primitive.name == "pvary":   # a value may already vary here (e.g. a zero cotangent made varying)
            args = [_vary_missing(x, params["axes"]) for x in args]
            env.update(zip(op.outs, args))
            continue
        with op.eqn.ctx.manager:
            out = op.eqn.primitive.bind(*args, **params)
        env.update(zip(op.outs, out if op.eqn.primitive.multiple_results else [out]))


def _env(plan: SplitPlan, flat_inputs: list[Any], skip: int | None = None) -> dict[int, Any]:
    env = dict(plan.consts)
    env.update((k, v) for k, v in zip(plan.inputs, flat_inputs) if k != skip)
    return env


def _grads(plan: SplitPlan, env: dict[int, Any], mine: tuple[bool, ...]) -> Any:
    """The parameter gradient's leaves this phase computes (``mine``), zeros for the others."""
    def leaf(a, s, m):
        if not m or (isinstance(a, int) and a not in env):
            return jnp.zeros(s.shape, s.dtype)
        v = jnp.asarray(a.val) if isinstance(a, jcore.Literal) else env[a]
        return jnp.broadcast_to(v, s.shape).astype(s.dtype)
    return jax.tree.unflatten(plan.dparams_tree, [leaf(a, s, m) for a, s, m in
                                                  zip(plan.dparams, plan.dparams_structs, mine)])


def backward_input(plan: SplitPlan, params: Any, x: Any, leaves: list, g: Any) -> tuple[Any, tuple, Any]:
    """``B``: ``(d x, carry, d params from g)`` from the pullback's residual ``leaves`` and the output cotangent
    ``g``; the last is the part of the parameter gradient B computes (``params``' structure; zeros where it has
    none): add it to the gradient, and :func:`backward_weight`'s result later."""
    env = _env(plan, [*jax.tree.leaves(params), x, *leaves, g])
    _run(plan.b_ops, env)
    _run(plan.bw_ops, env, plan.zeroable)
    read = lambda a: a.val if isinstance(a, jcore.Literal) else env[a]
    return read(plan.dx), tuple(env[k] for k in plan.carry), _grads(plan, env, plan.b_grads)


def backward_weight(plan: SplitPlan, params: Any, x: Any, leaves: list, carry: tuple) -> Any:
    """``W``: its part of the parameter gradient (``params``' structure) from the residual ``leaves`` and
    ``B``'s carry; the sum with :func:`backward_input`'s part is the gradient."""
    env = _env(plan, [*jax.tree.leaves(params), x, *leaves, None], skip=plan.g)
    env.update(zip(plan.carry, carry))
    _run(plan.w_ops, env, plan.zeroable)
    return _grads(plan, env, plan.w_grads)
