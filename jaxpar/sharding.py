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
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
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


__all__: Sequence[str] = (
    "DEFAULT_RULES", "validate_rules", "batch_axes", "batch_sharding", "logical_specs", "leaf_axis_names", "mesh_specs",
    "named_shardings", "effective_rules", "check_divisible", "constrain", "constrain_spec", "use", "use_for_init", "has_explicit_axes",
    "replicated", "describe_params",
    "process_batch_rows", "global_batch_rows")
