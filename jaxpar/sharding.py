"""Logical axis rules and the shardings they give, built on Flax's logical partitioning.

Models name every parameter and key activation dimension with a logical axis (``batch``, ``seq``,
``embed``, ``mlp``, ``heads``, ``kv``, ``vocab``, ``layers``, ``stage``); a rules table maps logical names
to mesh axes. Changing the layout is changing the rules, never the model. Rules are matched in order and
a mesh axis is used at most once per array (Flax's ``logical_to_mesh_axes`` semantics), so an activation
``[batch, seq, embed]`` takes ``data`` and ``fsdp`` on its batch dimension while a parameter
``[embed, mlp]`` takes ``fsdp`` on ``embed`` (ZeRO-3 / FSDP) and ``tensor`` on ``mlp`` (Megatron split).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jcore
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

Rules = tuple[tuple[str, Any], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),   # activations: batch over every data-parallel axis
    ("seq", None),                 # no sequence parallelism
    ("embed", "fsdp"),             # params: FSDP shards the model dimension of every weight
    ("mlp", "tensor"),             # Megatron column split of the MLP up-projection, row split of down
    ("heads", "tensor"),           # Megatron split of attention by heads
    ("kv", None),                  # head_dim stays whole
    ("vocab", "tensor"),           # vocab-parallel embedding / logits
    ("layers", None),              # stacked layers live whole on each stage
    ("stage", "pipe"),             # pipeline stages
)


def _mesh_axes_of(rules: Rules) -> set[str]:
    axes: set[str] = set()
    for _, target in rules:
        if target is None:
            continue
        axes.update((target,) if isinstance(target, str) else target)
    return axes


def validate_rules(rules: Rules, mesh: Mesh) -> None:
    """Raises ValueError if a rule names a mesh axis that ``mesh`` does not have, or is malformed."""
    if not isinstance(rules, (tuple, list)):
        raise ValueError(f"rules must be a sequence of (logical_name, mesh_axes) pairs, got {type(rules).__name__}")
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"rule {rule!r} must be a pair (logical_name, mesh_axis | tuple | None)")
        target = rule[1]
        axes = () if target is None else (target,) if isinstance(target, str) else target
        if not isinstance(axes, (tuple, list)) or not all(isinstance(a, str) for a in axes) \
                or len(set(axes)) != len(axes):
            raise ValueError(f"rule {tuple(rule)!r}: the target must be None, a mesh axis name, or a tuple of "
                             "distinct mesh axis names")
    unknown = sorted(_mesh_axes_of(rules) - set(mesh.axis_names))
    if unknown:
        bad = [r for r in rules if r[1] is not None and set((r[1],) if isinstance(r[1], str) else r[1]) & set(unknown)]
        raise ValueError(
            f"rules name mesh axes {unknown} that the mesh {tuple(mesh.axis_names)} does not have "
            f"(in {bad}); use axes of the mesh, e.g. jp.make_mesh(...) gives {tuple(mesh.axis_names)}")


def batch_axes(rules: Rules, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the ``batch`` logical axis maps to, e.g. ``('data', 'fsdp')``."""
    spec = nn.logical_to_mesh_axes(("batch",), rules)
    target = spec[0]
    if target is None:
        return ()
    return tuple(a for a in ((target,) if isinstance(target, str) else target) if a in mesh.axis_names)


def batch_sharding(rules: Rules, mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Sharding of an array whose leading axis is the global batch (other axes replicated)."""
    axes = batch_axes(rules, mesh)
    return NamedSharding(mesh, P(axes if axes else None, *([None] * (ndim - 1))))


def process_batch_rows(global_batch: int, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> slice:
    """The rows of a global batch that this process's devices hold under :func:`batch_sharding`.

    They are what this process must load in a multi-process run. It is the process's contiguous share of
    the batch when the batch axes span processes (process ``i`` of ``n`` gets block ``i`` on meshes from
    :func:`jaxpar.make_mesh`, whose device order follows the process order), and the whole batch when
    the batch axes lie within each process (e.g. only ``tensor`` crosses processes).

    Raises:
      ValueError: the rows are not contiguous (a hand-made mesh interleaving processes along the batch
        axes); ``global_batch`` not divisible by the batch axes.
    """
    n = math.prod(mesh.shape[a] for a in batch_axes(rules, mesh))
    if global_batch % n:
        raise ValueError(f"global batch {global_batch} is not divisible by the batch mesh axes "
                         f"({'*'.join(batch_axes(rules, mesh))} = {n})")
    index_map = batch_sharding(rules, mesh, 1).addressable_devices_indices_map((global_batch,))
    spans = sorted({(s[0].start or 0, global_batch if s[0].stop is None else s[0].stop) for s in index_map.values()})
    lo, hi = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != hi - lo:
        raise ValueError(f"this process's devices hold rows {spans} of the batch, not one contiguous block; build "
                         "the mesh with jp.make_mesh (devices in process order) so each process loads one slice")
    return slice(lo, hi)


def global_batch_rows(local_rows: int, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    """The global batch size of which this process's :func:`process_batch_rows` share has ``local_rows`` rows."""
    n = math.prod(mesh.shape[a] for a in batch_axes(rules, mesh))
    share = process_batch_rows(n, mesh, rules)
    return local_rows * n // (share.stop - share.start)


def logical_specs(tree: Any) -> Any:
    """Logical ``PartitionSpec`` of every leaf of a (possibly Flax-boxed) tree; unboxed leaves get ``P()``."""
    return nn.get_partition_spec(tree)


def _is_names(x) -> bool:
    return x is None or isinstance(x, P) or (isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))


STACKED_AXIS_NAMES = frozenset({"layers", "stage"})
"""Logical names of stacked-layer axes (one copy of a layer per entry, e.g. the GPT's ``[layers, ...]`` blocks):
never a matrix dimension. Weight decay, pruning and compaction treat each slice along them as its own tensor."""

NON_MATRIX_NAME_PARTS = ("bias", "scale", "norm", "embedding")
"""Parts of a leaf's name that mark it as no weight matrix (a bias, a norm scale, an embedding table), for
leaves without logical names: never decayed by ``jp.optim.decay_mask``, never pruned by default."""


def leaf_axis_names(params: Any, axis_names: Any) -> list[tuple[str | None, ...] | None]:
    """Logical axis names of every leaf of ``params`` (in flattening order); None where a leaf has none.

    Parameters reach optimizers unboxed (plain arrays), so their logical names come separately: ``axis_names``
    is the Flax-boxed tree of ``jax.eval_shape(init_fn, rng)``, or a tree of logical ``PartitionSpec`` s /
    name tuples with the structure of ``params`` (:func:`logical_specs`), or None (no names). Each returned
    tuple has one entry per axis of the leaf (padded with None).

    Raises:
      ValueError: ``axis_names`` does not have the structure of ``params``, or a leaf's names are longer than
        its rank.
    """
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if axis_names is None:
        return [None] * len(leaves)
    box = lambda x: isinstance(x, nn.LogicallyPartitioned)
    if any(box(x) for x in jax.tree.leaves(axis_names, is_leaf=box)):
        axis_names = nn.get_partition_spec(axis_names)
    try:
        specs = jax.tree.structure(params).flatten_up_to(axis_names)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "axis_names must have the structure of the params: pass jax.eval_shape(init_fn, rng) (Flax-boxed) "
            f"or jp.sharding.logical_specs of it; structures differ: {e}") from None
    out = []
    for (path, leaf), spec in zip(leaves, specs):
        where = jax.tree_util.keystr(path)
        if not _is_names(spec):
            raise ValueError(f"axis_names at {where} is {spec!r}; expected a PartitionSpec or tuple of logical "
                             "axis names")
        names = tuple(spec) if spec is not None else ()
        if len(names) > jnp.ndim(leaf):
            raise ValueError(f"axis_names {names} at {where} name more axes than the parameter's rank "
                             f"{jnp.ndim(leaf)}")
        names = names + (None,) * (jnp.ndim(leaf) - len(names))
        out.append(names if any(n is not None for n in names) else None)
    return out


def mesh_specs(tree: Any, rules: Rules) -> Any:
    """Mesh ``PartitionSpec`` of every leaf of a Flax-boxed tree under ``rules``."""
    return nn.logical_to_mesh(logical_specs(tree), rules)


def named_shardings(tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """Tree of ``NamedSharding`` for a tree of Flax-boxed params (or their ``eval_shape``).

    Leaves carrying ``nn.LogicallyPartitioned`` metadata are placed by ``rules`` (as :func:`effective_rules`
    applies them on ``mesh``: with ``pipe > 1``, unsharded stacked ``layers`` go over ``pipe``); plain leaves
    are replicated. The result has the structure of the **unboxed** tree.

    Raises:
      ValueError: a rule names an axis ``mesh`` does not have, or a sharded dimension is not divisible by
        the product of the mesh axes it is split over (the message names the parameter path).
    """
    validate_rules(rules, mesh)
    rules = effective_rules(rules, mesh)
    specs = mesh_specs(tree, rules)
    check_divisible(nn.meta.unbox(tree), specs, mesh, logical_specs(tree))
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def effective_rules(rules: Rules, mesh: Mesh) -> Rules:
    """The rules as applied to parameters on ``mesh``.

    With a ``pipe`` axis larger than 1, a ``layers`` axis the rules leave unsharded goes over ``pipe``: the
    contiguous split of stacked ``[layers, ...]`` parameters over ``pipe`` is exactly the pipeline's stage
    split (stage ``s`` holds layers ``s*L/p .. (s+1)*L/p - 1``), so the pipeline reshapes them to
    ``[stages, layers/stages, ...]`` without moving data. (``stage`` keeps precedence for arrays with both.)
    With ``pipe == 1`` the rules are returned unchanged.
    """
    if mesh.shape.get("pipe", 1) == 1 or ("layers", None) not in tuple(tuple(r) for r in rules):
        return rules
    stage = tuple(r for r in rules if r[0] == "stage")
    rest = tuple(("layers", "pipe") if tuple(r) == ("layers", None) else r for r in rules if r[0] != "stage")
    return stage + rest


def check_divisible(shapes: Any, specs: Any, mesh: Mesh, logical: Any | None = None) -> None:
    """Raises ValueError naming the path of the first leaf whose sharded dim does not divide evenly."""
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    flat_logical = (jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, P))
                    if logical is not None else [None] * len(flat_specs))
    paths = jax.tree_util.tree_flatten_with_path(shapes)[0]
    for (path, leaf), spec, lspec in zip(paths, flat_specs, flat_logical):
        for dim, axes in enumerate(spec):
            if axes is None:
                continue
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            n = math.prod(mesh.shape[a] for a in axes)
            if leaf.shape[dim] % n:
                name = lspec[dim] if lspec is not None and dim < len(lspec) else f"dim {dim}"
                raise ValueError(
                    f"{jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}: its {name!r} dimension "
                    f"({leaf.shape[dim]}) is not divisible by {'*'.join(axes)} = {n}; change the model size "
                    f"or the mesh (e.g. a smaller {axes[-1]} axis)")


# ------------------------------------------------------------------------------------ optimizer state
# The origins of a value in a traced program: for each parameter leaf it is computed from along some of its
# axes, the parameter axis each axis of the value runs along (None: along none). Only aligned axes matter
# for a sharding: a scalar such as a global norm carries no axis, a mean over rows drops the row axis.
_Origins = dict[int, tuple[int | None, ...]]

_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                         "reduce_xor", "argmax", "argmin"})


def _merge(*origins: _Origins) -> _Origins:
    """Union of origins; an axis two of them align with different parameter axes aligns with none."""
    out: dict[int, tuple[int | None, ...]] = {}
    for o in origins:
        for i, dims in o.items():
            old = out.get(i, dims)
            out[i] = tuple(a if b is None or a == b else b if a is None else None for a, b in zip(old, dims))
    return {i: d for i, d in out.items() if any(a is not None for a in d)}


def _remap(o: _Origins, axes: Sequence[int | None]) -> _Origins:
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


def _dot_origins(dimension_numbers, shapes: list[tuple[int, ...]], ins: list[_Origins]) -> _Origins:
    """``dot_general``'s output axes: batch axes, then the lhs's free axes, then the rhs's."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf = [k for k in range(len(shapes[0])) if k not in lc and k not in lb]
    rf = [k for k in range(len(shapes[1])) if k not in rc and k not in rb]
    return _merge(_remap(ins[0], [*lb, *lf, *[None] * len(rf)]), _remap(ins[1], [*rb, *[None] * len(lf), *rf]))


def _fixed_point(body, carry: list[_Origins], steps: int = 4) -> list[_Origins]:
    """A loop carry's origins: merged over iterations of ``body`` (carry -> new carry) until they settle."""
    for _ in range(steps):
        new = [_merge(a, b) for a, b in zip(carry, body(carry))]
        if new == carry:
            break
        carry = new
    return carry


def _loop_origins(eqn, ins: list[_Origins]) -> list[_Origins]:
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


def _eqn_origins(eqn, ins: list[_Origins]) -> list[_Origins]:
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


def _walk(jaxpr: jcore.Jaxpr, ins: Sequence[_Origins]) -> list[_Origins]:
    """The origins of ``jaxpr``'s outputs given its inputs' (constants have none)."""
    env = dict(zip(jaxpr.invars, ins))
    read = lambda v: {} if isinstance(v, jcore.Literal) else env.get(v, {})
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, _eqn_origins(eqn, [read(v) for v in eqn.invars])))
    return [read(v) for v in jaxpr.outvars]


def _update_origins(tx: optax.GradientTransformation, param_shapes: Any, opt_shapes: Any,
                    mesh: Mesh) -> list[_Origins]:
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
    state: list[_Origins] = [{} for _ in want]
    for _ in range(4):
        new = _walk(closed.jaxpr, [*seed, *state, *seed])
        if new == state:
            break
        state = new
    return state


def _path_matches(opt_shapes: Any, param_shapes: Any) -> list[int | None]:
    """Per state leaf, the param whose key path its path ends with and whose shape it has (Adam's mu), or None."""
    by_path = {tuple(map(str, path)): (i, tuple(x.shape))
               for i, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(param_shapes)[0])}
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_shapes)[0]:
        key = tuple(map(str, path))
        hits = (by_path.get(key[j:]) for j in range(len(key)))
        out.append(next((h[0] for h in hits if h is not None and h[1] == tuple(leaf.shape)), None))
    return out


def _spec_along(shape: tuple[int, ...], dims: tuple[int | None, ...], spec: P, mesh: Mesh) -> P:
    """The spec of a value whose axis ``k`` runs along axis ``dims[k]`` of a param sharded as ``spec``.

    An axis its mesh axes do not divide, or whose mesh axes an earlier axis took, is left whole.
    """
    used, out = set(), []
    for n, d in zip(shape, dims):
        axes = spec[d] if d is not None and d < len(spec) else None
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        if axes and (n % math.prod(mesh.shape[a] for a in axes) or used & set(axes)):
            axes = ()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def check_transformation(tx: Any) -> optax.GradientTransformation:
    """``tx`` as a GradientTransformation: optax's ``MultiSteps`` wrapper is taken as optax users pass it.

    Raises:
      TypeError: ``tx`` is neither (e.g. ``optax.adamw`` not called).
    """
    if isinstance(tx, optax.MultiSteps):
        return tx.gradient_transformation()
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"tx must be an optax.GradientTransformation (e.g. optax.adamw(1e-3), called) or an "
                        f"optax.MultiSteps, got {tx!r}")
    return tx


def _param_specs(param_shapes: Any, param_shardings: Any, mesh: Mesh) -> list[P]:
    try:
        shardings = jax.tree.structure(param_shapes).flatten_up_to(param_shardings)
    except (ValueError, TypeError) as e:
        raise ValueError(f"param_shardings must have the structure of param_shapes (jp.sharding.named_shardings "
                         f"of the boxed params gives it); structures differ: {e}") from None
    for s in shardings:
        if not isinstance(s, NamedSharding) or s.mesh.shape_tuple != mesh.shape_tuple:
            raise TypeError(f"param_shardings leaves must be NamedShardings on the mesh {dict(mesh.shape)}, "
                            f"got {s!r}")
    return [s.spec for s in shardings]


def _leaf_sharding(leaf: Any, origins: _Origins, path_hit: int | None, specs: list[P], mesh: Mesh) -> NamedSharding:
    """One state leaf's sharding: along the param it has most axes aligned with (ties: the param its path
    ends with, then the first); else the param its path and shape match; else replicated."""
    rank = lambda kv: (-sum(d is not None for d in kv[1]), kv[0] != path_hit, kv[0])
    best = min(origins.items(), key=rank, default=None)
    if best is None and path_hit is not None:
        best = (path_hit, tuple(range(len(leaf.shape))))
    return NamedSharding(mesh, P() if best is None else _spec_along(leaf.shape, best[1], specs[best[0]], mesh))


def opt_state_shardings(tx: Any, param_shapes: Any, param_shardings: Any, mesh: Mesh) -> Any:
    """A ``NamedSharding`` for every leaf of ``tx.init(params)``, for any optax transformation.

    A state leaf follows the parameter it is computed from, found by tracing ``tx.update`` on shapes and
    walking its jaxpr while tracking axes (a dependence walk, a small sharding propagation): each axis of the
    leaf that runs along an axis of that parameter takes that axis's mesh axes. So moments (Adam's ``mu`` and
    ``nu``, Lion's ``mu``), accumulated gradients (``optax.MultiSteps``) and pruning masks get the parameter's
    spec, and factored moments (Adafactor's ``v_row``/``v_col``, means over one axis) the parameter's spec
    without the reduced axis, whatever the shapes (a square kernel's two factors included). A leaf that no
    parameter axis reaches, but whose key path ends with a parameter's path and which has its shape, gets
    that parameter's spec. Every other leaf (counts, loss scales, placeholders) is replicated, ``P()``. An
    axis its mesh axes do not divide, or whose mesh axes another axis of the leaf took, stays whole.

    (Flax lm1b / MaxText instead read ``nn.get_partition_spec`` of ``jax.eval_shape(tx.init, boxed_params)``;
    that fails here: Adafactor keeps a ``[rows, cols]`` param's two axis names on its ``[rows]`` and ``[1]``
    leaves, and pruning's init cannot run on boxed params.)

    Args:
      tx: an ``optax.GradientTransformation`` or an ``optax.MultiSteps``.
      param_shapes: the unboxed parameter tree (arrays or ``jax.ShapeDtypeStruct``), as ``tx`` sees it (in
        the policy's ``param_dtype``).
      param_shardings: a tree of ``NamedSharding`` on ``mesh`` with the structure of ``param_shapes``
        (:func:`named_shardings`).
      mesh: the mesh.

    Returns:
      A tree of ``NamedSharding`` with the structure of ``jax.eval_shape(tx.init, param_shapes)``.

    Raises:
      TypeError: ``tx`` is not a transformation; a ``param_shardings`` leaf is not a ``NamedSharding`` on
        ``mesh``.
      ValueError: ``param_shardings`` does not have the structure of ``param_shapes``.

    Warns:
      UserWarning: ``tx.update`` cannot be traced on shapes (e.g. it needs extra arguments); then only the
        key-path rule applies.
    """
    tx = check_transformation(tx)
    specs = _param_specs(param_shapes, param_shardings, mesh)
    opt_shapes = jax.eval_shape(tx.init, param_shapes)
    leaves, treedef = jax.tree.flatten(opt_shapes)
    try:
        origins = _update_origins(tx, param_shapes, opt_shapes, mesh)
    except Exception as e:  # noqa: BLE001  (a user's update: its own error surfaces at the first step)
        warnings.warn(f"could not trace tx.update on shapes ({type(e).__name__}: {e}); optimizer state leaves "
                      "follow parameters by key path and shape only", stacklevel=2)
        origins = [{} for _ in leaves]
    hits = _path_matches(opt_shapes, param_shapes)
    return treedef.unflatten([_leaf_sharding(x, o, h, specs, mesh) for x, o, h in zip(leaves, origins, hits)])


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """Constrains an activation's sharding by logical axis names, e.g. ``constrain(x, 'batch', 'seq', 'embed')``.

    Takes effect under a mesh and rules in context (jaxpar's init/step builders enter both); elsewhere it is
    the identity, as Flax's ``with_logical_constraint`` is.
    """
    if len(names) != x.ndim:
        raise ValueError(f"constrain got {len(names)} names {names} for an array of rank {x.ndim}")
    rules = nn.get_logical_axis_rules()
    if rules and _explicit_in_context():
        return constrain_spec(x, nn.logical_to_mesh_axes(names, rules))
    return nn.with_logical_constraint(x, names)


def _explicit_in_context() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and any(t == AxisType.Explicit for t in mesh.axis_types)


def constrain_spec(x: jax.Array, spec: P) -> jax.Array:
    """Constrains ``x`` to the mesh ``PartitionSpec`` ``spec`` of the mesh in context.

    ``with_sharding_constraint`` on Auto axes; ``jax.sharding.reshard`` on a mesh with Explicit axes, where
    ``with_sharding_constraint`` only asserts that the value already has that sharding.
    """
    if _explicit_in_context():
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


@contextlib.contextmanager
def use(mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Enters ``jax.set_mesh(mesh)`` and ``nn.logical_axis_rules(rules)``: the context for tracing jaxpar code."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def has_explicit_axes(mesh: Mesh) -> bool:
    """Whether any axis of ``mesh`` has ``AxisType.Explicit`` (sharding carried in the types)."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


@contextlib.contextmanager
def use_for_init(mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """The context for tracing parameter initialisation (whose outputs are placed by ``out_shardings``).

    As :func:`use`, except on a mesh with Explicit axes: there ``with_sharding_constraint`` is an assertion
    that a value already has the given sharding, so Flax's boxed init (which constrains every new parameter
    to its logical sharding) would fail on the unsharded values it creates. There the rules are left out,
    which makes Flax's logical constraints no-ops, and ``jit``'s ``out_shardings`` place the parameters.
    """
    if has_explicit_axes(mesh):
        with jax.set_mesh(mesh):
            yield
    else:
        with use(mesh, rules):
            yield


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def describe_params(params: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """For each parameter leaf: (path, global shape, PartitionSpec as text). Handy in notebooks."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        out.append((jax.tree_util.keystr(path), tuple(leaf.shape), str(spec)))
    return out


__all__ = ["DEFAULT_RULES", "NON_MATRIX_NAME_PARTS", "Rules", "STACKED_AXIS_NAMES", "batch_axes", "batch_sharding", "check_transformation", "constrain",
           "describe_params", "effective_rules", "logical_specs", "named_shardings", "opt_state_shardings",
           "replicated", "use", "validate_rules"]
