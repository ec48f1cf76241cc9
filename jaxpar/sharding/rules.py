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
import dataclasses
import math
import re
import warnings
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxpar import protocol
from jaxpar.sharding.names import (AXES, BATCH, CONTEXT, DATA, EMBED, EXPERT_MLP, EXPERTS, FSDP, HEADS, KV, KV_HEADS,
                                   LAYERS, MLP, PIPE, POSITION, SEQ, STAGE, TENSOR, VOCAB, Rules, axes_entry,
                                   entry_axes)
from jaxpar.sharding.opt_state import Origins, update_origins
from jaxpar.sharding.report import LeafReport, ShardingReport, describe_params, key_path

DEFAULT_RULES: Rules = Rules((
    (BATCH, (DATA, FSDP)),     # activations: batch over every data-parallel axis
    (SEQ, CONTEXT),            # activations' sequence: context parallelism (jaxpar.layers.attention); a context
                               # axis of size 1 (the default mesh) leaves it whole
    (POSITION, None),          # the rows of a learned position table: whole on every device
    (EMBED, FSDP),             # params: FSDP shards the model dimension of every weight
    (MLP, TENSOR),             # Megatron column split of the MLP up-projection, row split of down
    (HEADS, TENSOR),           # Megatron split of attention by heads
    (KV, None),                # head_dim stays whole
    (KV_HEADS, None),          # grouped-query key/value heads (the Llama): replicated over tensor, as any
                               # tensor size may exceed num_kv_heads; ("kv_heads", "tensor") splits them
    (VOCAB, TENSOR),           # vocab-parallel embedding / logits
    (LAYERS, None),            # stacked layers live whole on each stage
    (STAGE, PIPE),             # pipeline stages
    (EXPERTS, None),           # routed experts: every device holds every expert (expert parallelism maps them to
                               # batch axes: the experts fold onto the data/fsdp ranks)
    (EXPERT_MLP, TENSOR),      # expert-tensor parallelism: each expert's gate/up column split, down row split
))


def validate_rules(rules: Rules, mesh: Mesh) -> None:
    """Raises ValueError if a rule is malformed or names a mesh axis that ``mesh`` does not have and that is not
    one of jaxpar's mesh axes (:data:`jaxpar.sharding.names.AXES`; one of those a mesh built without jaxpar lacks
    is an axis of size 1, dropped by :meth:`Rules.without_absent`)."""
    if not isinstance(rules, (tuple, list)):
        raise ValueError(f"rules must be a sequence of (logical_name, mesh_axes) pairs, got {type(rules).__name__}")
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"rule {rule!r} must be a pair (logical_name, mesh_axis | tuple | None)")
        target = rule[1]
        axes = entry_axes(target) if target is None or isinstance(target, (str, tuple, list)) else None
        if axes is None or not all(isinstance(a, str) for a in axes) \
                or len(set(axes)) != len(axes):
            raise ValueError(f"rule {tuple(rule)!r}: the target must be None, a mesh axis name, or a tuple of "
                             "distinct mesh axis names")
    unknown = sorted(Rules(rules).all_mesh_axes() - set(mesh.axis_names) - set(AXES))
    if unknown:
        bad = [r for r in rules if set(entry_axes(r[1])) & set(unknown)]
        raise ValueError(
            f"rules name mesh axes {unknown} that the mesh {tuple(mesh.axis_names)} does not have "
            f"(in {bad}); use axes of the mesh, e.g. jp.make_mesh(...) gives {tuple(mesh.axis_names)}")


def batch_name(rules: Rules) -> str:
    """The logical name of the batch axis in ``rules``: ``batch`` when a rule names it, else the first rule's name
    that contains ``batch`` (MaxText's ``activation_batch``), else ``batch``."""
    names = Rules(rules).names
    return BATCH if BATCH in names else next((n for n in names if BATCH in n), BATCH)


def with_batch_axis(rules: Rules, batch_axis: str | None) -> Rules:
    """``rules`` with the input batch placed as the logical axis ``batch_axis`` is (a ``batch`` rule with its
    target, first); ``rules`` itself for None.

    Raises:
      ValueError: no rule names ``batch_axis``.
    """
    if batch_axis is None:
        return rules
    target = next((r[1] for r in rules if r[0] == batch_axis), _MISSING)
    if target is _MISSING:
        raise ValueError(f"batch_axis={batch_axis!r} is named by no rule (rules name {[r[0] for r in rules]}); pass "
                         "the logical name of your batch axis, e.g. 'activation_batch' with MaxText's rules")
    return ((BATCH, target), *(r for r in rules if r[0] != BATCH))


_MISSING = object()


def batch_axes(rules: Rules, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes of ``mesh`` the batch axis (:func:`batch_name`) maps to, e.g. ``('data', 'fsdp')``."""
    return Rules(rules).mesh_axes(batch_name(rules), mesh)


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


STACKED_AXIS_NAMES = frozenset({LAYERS, STAGE})
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
    tuple has one entry per axis of the leaf (padded with None). Carried collections (a MoE router's counts) in
    ``axis_names`` are dropped when ``params`` holds none: ``init_state`` moves them out of the optimizer's params.

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
    if protocol.split_carried(params)[1] is None:   # an init's names hold the carried state the optimizer never sees
        axis_names = protocol.split_carried(axis_names)[0]
    try:
        specs = jax.tree.structure(params).flatten_up_to(axis_names)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "axis_names must have the structure of the params: pass jax.eval_shape(init_fn, rng) (Flax-boxed) "
            f"or jp.sharding.logical_specs of it; structures differ: {e}") from None
    out = []
    for (path, leaf), spec in zip(leaves, specs):
        where = key_path(path, indexing=True)
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


def resolve_names(names: Sequence[Any], rules: Rules, mesh: Mesh) -> tuple[P, list[Any]]:
    """The mesh ``PartitionSpec`` of an array whose dimensions carry ``names``, and the names nothing resolves:
    :meth:`Rules.resolve`."""
    return Rules(rules).resolve(names, mesh)


def named_shardings(tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """Tree of ``NamedSharding`` for a tree of Flax-boxed params (or their ``eval_shape``).

    Leaves carrying ``nn.LogicallyPartitioned`` metadata are placed by ``rules`` (as :func:`effective_rules`
    applies them on ``mesh``: with ``pipe > 1``, unsharded stacked ``layers`` go over ``pipe``); names that are
    mesh axes (``nn.Partitioned``, or a logical name no rule knows that is a mesh axis) as
    :func:`resolve_names` says; plain leaves are replicated. The result has the structure of the **unboxed**
    tree. (``jp.train.init_state`` places params through ``jaxpar.sharding.params``, which adds path rules and
    automatic FSDP for leaves nothing names.)

    Raises:
      ValueError: a rule names an axis ``mesh`` does not have, or a sharded dimension is not divisible by
        the product of the mesh axes it is split over (the message names the parameter path).
    """
    validate_rules(rules, mesh)
    rules = effective_rules(rules, mesh)
    names = logical_specs(tree)
    specs = jax.tree.map(lambda s: resolve_names(tuple(s), rules, mesh)[0], names, is_leaf=lambda x: isinstance(x, P))
    check_divisible(nn.meta.unbox(tree), specs, mesh, names)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def without_absent_context(rules: Rules, mesh: Any) -> Rules:
    """``rules`` with every mesh axis ``mesh`` does not have dropped (:meth:`Rules.without_absent`): on a mesh
    built without jaxpar, e.g. ``jax.make_mesh(..., ('data', 'fsdp'))``, :data:`DEFAULT_RULES`' ``seq -> context``
    and ``mlp -> tensor`` mean an unsharded sequence and MLP."""
    return Rules(rules).without_absent(mesh)


def effective_rules(rules: Rules, mesh: Mesh) -> Rules:
    """The rules as applied to parameters on ``mesh``.

    With a ``pipe`` axis larger than 1, a ``layers`` axis the rules leave unsharded goes over ``pipe``: the
    contiguous split of stacked ``[layers, ...]`` parameters over ``pipe`` is exactly the pipeline's stage
    split (stage ``s`` holds layers ``s*L/p .. (s+1)*L/p - 1``), so the pipeline reshapes them to
    ``[stages, layers/stages, ...]`` without moving data. (``stage`` keeps precedence for arrays with both.)
    With ``pipe == 1`` the rules are returned unchanged.
    """
    rules = Rules(rules).without_absent(mesh)
    if mesh.shape.get(PIPE, 1) == 1 or (LAYERS, None) not in tuple(tuple(r) for r in rules):
        return rules
    stage = tuple(r for r in rules if r[0] == STAGE)
    rest = tuple((LAYERS, PIPE) if tuple(r) == (LAYERS, None) else r for r in rules if r[0] != STAGE)
    return Rules(stage + rest)


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
            axes = entry_axes(axes)
            n = math.prod(mesh.shape[a] for a in axes)
            if leaf.shape[dim] % n:
                name = lspec[dim] if lspec is not None and dim < len(lspec) else f"dim {dim}"
                raise ValueError(
                    f"{key_path(path, indexing=True)} has shape {tuple(leaf.shape)}: its {name!r} dimension "
                    f"({leaf.shape[dim]}) is not divisible by {'*'.join(axes)} = {n}; change the model size "
                    f"or the mesh (e.g. a smaller {axes[-1]} axis)")


# ------------------------------------------------------------------------------------ optimizer state
# (the dependence walk that finds what each state leaf follows: jaxpar.sharding.opt_state)
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
        axes = entry_axes(axes)
        if axes and (n % math.prod(mesh.shape[a] for a in axes) or used & set(axes)):
            axes = ()
        used.update(axes)
        out.append(axes_entry(axes))
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


def _leaf_sharding(leaf: Any, origins: Origins, path_hit: int | None, specs: list[P], mesh: Mesh) -> NamedSharding:
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
        origins = update_origins(tx, param_shapes, opt_shapes, mesh)
    except Exception as e:  # noqa: BLE001  (a user's update: its own error surfaces at the first step)
        warnings.warn(f"could not trace tx.update on shapes ({type(e).__name__}: {e}); optimizer state leaves "
                      "follow parameters by key path and shape only", stacklevel=2)
        origins = [{} for _ in leaves]
    hits = _path_matches(opt_shapes, param_shapes)
    return treedef.unflatten([_leaf_sharding(x, o, h, specs, mesh) for x, o, h in zip(leaves, origins, hits)])


def constrain(x: jax.Array, *names: str | tuple[str, ...] | None) -> jax.Array:
    """Constrains an activation's sharding by logical axis names, e.g. ``constrain(x, 'batch', 'seq', 'embed')``.

    A dimension that flattens several logical axes takes a tuple of names, sharded over all their mesh axes in
    order: ``constrain(h_TF, ('batch', 'seq'), 'mlp')`` for tokens ``T = B * L`` (the batch axes, then the context
    axis). Takes effect under a mesh and rules in context (jaxpar's init/step builders enter both); elsewhere it
    is the identity, as Flax's ``with_logical_constraint`` is.
    """
    if len(names) != x.ndim:
        raise ValueError(f"constrain got {len(names)} names {names} for an array of rank {x.ndim}")
    rules = nn.get_logical_axis_rules()
    if any(isinstance(n, tuple) for n in names):
        if not rules or jax.sharding.get_abstract_mesh().empty:
            return x
        rules = Rules(rules)
        return constrain_spec(x, P(*(rules.mesh_axes(n) or None if isinstance(n, tuple) else
                                     axes_entry(rules.mesh_axes(n)) for n in names)))
    if rules and _explicit_in_context():
        return constrain_spec(x, Rules(rules).spec(names))
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
    """Enters ``jax.set_mesh(mesh)`` and ``nn.logical_axis_rules(rules)``: the context for tracing jaxpar code
    (the rules without the mesh axes ``mesh`` lacks, :meth:`Rules.without_absent`)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(Rules(rules).without_absent(mesh)):
        yield


def has_explicit_axes(mesh: Mesh) -> bool:
    """Whether any axis of ``mesh`` has ``AxisType.Explicit`` (sharding carried in the types)."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


@contextlib.contextmanager
def use_for_init(mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """The context for tracing parameter initialisation, whose outputs ``jit``'s ``out_shardings`` place.

    The mesh without the rules: Flax's logical constraints are no-ops there, so an init that plain Flax runs
    runs here (``nn.DenseGeneral`` constrains its flattened 2-D kernel by 3-D names under rules; on Explicit
    axes a constraint is an assertion on the unsharded values init creates), and the params are placed by
    their names afterwards. ``rules`` is accepted for symmetry with :func:`use` and not entered.
    """
    del rules
    with jax.set_mesh(mesh):
        yield


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ------------------------------------------------------------------------------------------- path rules

@dataclasses.dataclass(frozen=True)
class PathRules:
    """Partition rules over parameter key paths (t5x / EasyLM style), from :func:`path_rules`.

    Attributes:
      rules: ``(regex, target)`` pairs; ``target`` a tuple of logical axis names (resolved through the logical
        rules, or taken as mesh axes where they are mesh axis names) or a mesh ``PartitionSpec``.
    """
    rules: tuple[tuple[str, Any], ...]

    def match(self, path: str) -> int | None:
        """The index of the first rule whose regex is found in ``path`` (``re.search``), or None."""
        return next((i for i, (rx, _) in enumerate(self.rules) if re.search(rx, path)), None)


def path_rules(rules: Sequence[tuple[str, Any]]) -> PathRules:
    """Names parameters by their key path: ``[(regex, logical_names_or_PartitionSpec), ...]``.

    A param's path is its keys joined by ``/`` (``params/Dense_0/kernel``; NNX: ``blocks/0/attn/query/kernel``);
    the first rule whose regex ``re.search`` finds in it wins, and its target names the param's dimensions: a
    tuple of logical names (one per dimension; mapped by the logical rules, or mesh axes themselves), or a
    ``PartitionSpec`` of mesh axes (at most one entry per dimension), or None (replicated). A path rule takes
    precedence over the model's own annotations (the layout is the rules', never the model's). Pass the result
    as ``jp.train.init_state(..., param_rules=)``; a rule that matches no parameter is reported there.

    Raises:
      ValueError: not a sequence of pairs; an invalid regex (naming it); a target that is neither.
    """
    if isinstance(rules, PathRules):
        return rules
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise ValueError(f"path_rules takes a list of (regex, logical names | PartitionSpec) pairs, got {rules!r}")
    out = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"path rule {rule!r} must be a pair (regex, logical names | PartitionSpec | None)")
        rx, target = rule
        try:
            re.compile(rx)
        except re.error as e:
            raise ValueError(f"path rule regex {rx!r} is invalid ({e}); e.g. r'Dense_\\d+/kernel'") from None
        if isinstance(target, list):
            target = tuple(target)
        if not (target is None or isinstance(target, P) or (isinstance(target, tuple) and all(
                n is None or isinstance(n, str) or (isinstance(n, tuple) and all(isinstance(a, str) for a in n))
                for n in target))):
            raise ValueError(f"path rule {rx!r}: target {target!r} must be a tuple of logical axis names (one per "
                             "dimension, None for whole), a PartitionSpec of mesh axes, or None")
        used = [a for n in (target or ()) for a in entry_axes(n)]
        if len(used) != len(set(used)):
            raise ValueError(f"path rule {rx!r}: target {target!r} names an axis twice; each logical name or mesh "
                             "axis may split one dimension only")
        out.append((rx, target))
    return PathRules(tuple(out))


__all__ = ["DEFAULT_RULES", "LeafReport", "NON_MATRIX_NAME_PARTS", "PathRules", "Rules", "STACKED_AXIS_NAMES",
           "ShardingReport", "batch_axes", "batch_sharding", "check_transformation", "constrain", "describe_params",
           "effective_rules", "logical_specs", "named_shardings", "opt_state_shardings", "path_rules", "replicated",
           "use", "validate_rules", "without_absent_context"]
