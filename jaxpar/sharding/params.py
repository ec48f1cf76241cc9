"""How params and model state are placed on the mesh: path rules, the model's names, automatic FSDP.

Each leaf is placed by the first of these that applies:

1. a **path rule** (``jp.sharding.path_rules``) whose regex is found in the leaf's key path: the user's layout
   over the model author's;
2. the **model's names**: Linen ``nn.with_logical_partitioning`` (logical names, through the rules),
   ``nn.with_partitioning`` (mesh axis names: Flax's scale-up guide), NNX ``nnx.with_partitioning`` (a
   variable's ``out_sharding`` names, logical or mesh axes, as ``nnx.get_partition_spec`` reads them), each
   name as :func:`jaxpar.sharding.resolve_names` maps it;
3. **automatic FSDP** (``auto_fsdp=True``, the default): a leaf nothing above names (or whose names no rule
   knows), with at least ``auto_fsdp_min_size`` elements, is split over ``fsdp`` along its largest dimension
   that ``fsdp`` divides (ties: the first), as ZeRO-3 (Rajbhandari et al. 2020, sec. 5) and PyTorch FSDP
   (Zhao et al. 2023) shard every parameter without annotation. Smaller leaves (biases, norm scales) and
   leaves no dimension of which ``fsdp`` divides stay replicated, and the report says so.
   A leaf the model names by **logical** names that the rules map to other mesh axes only (the Flax NNX
   MiniGPT's ``(None, 'model')`` with a ``('model', 'tensor')`` rule) gets ``fsdp`` the same way, on its
   largest *free* dimension: one named None or by a name no rule knows. A dimension a rule maps to None
   (``layers``, ``kv``, ``kv_heads``) is left whole as the rule says, and names that are mesh axes
   (``nn.with_partitioning(init, (None, 'tensor'))``) and path rules are literal layouts, kept as written.

Tensor parallelism is never guessed (a Megatron split needs the model's semantics): asking for ``tensor > 1``
when no param maps to ``tensor`` is an error naming the fix. What was placed how is returned as ``sources``
for :class:`jaxpar.sharding.ShardingReport`; unknown names and path rules that matched nothing as ``notes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
import traceback
import warnings
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar import _compat
from jaxpar.sharding import rules as shd
from jaxpar.sharding.names import CONTEXT, FSDP, TENSOR, Rules, entry_axes

AUTO_FSDP_MIN_SIZE = 2**12
"""Elements below which automatic FSDP leaves a param replicated (a bias, a norm scale): gathering it would cost
more in latency than its bytes save."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each leaf of a tree goes: ``shardings`` (``NamedSharding`` per leaf, the tree's structure),
    ``sources`` (key path -> how it was placed) and ``notes`` (problems to report)."""
    shardings: Any
    sources: dict[str, str]
    notes: tuple[str, ...]


def boxed_names(boxed: Any) -> Any:
    """Per leaf of a (possibly Flax-boxed) tree: the names of its dimensions (a tuple) when the leaf carries
    ``nn.Partitioned`` / ``nn.LogicallyPartitioned`` metadata, else None. The structure of the unboxed tree."""
    box = lambda x: isinstance(x, nn.Partitioned)
    return jax.tree.map(lambda x: tuple(x.names) if box(x) else None, boxed, is_leaf=box)


def _auto_spec(shape: tuple[int, ...], mesh: Mesh, min_size: int, spec: P = P(),
               free: tuple[int, ...] | None = None) -> P | None:
    """``spec`` with ``fsdp`` on the largest of the ``free`` dimensions (default: all) that ``fsdp`` divides (ties:
    the first), for a leaf of at least ``min_size`` elements on a mesh with ``fsdp > 1`` that ``spec`` does not
    already split over ``fsdp``; None when nothing is added."""
    n = mesh.shape.get(FSDP, 1)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    taken = {a for e in entries for a in entry_axes(e)}
    if n == 1 or FSDP in taken or math.prod(shape) < min_size:
        return None
    dims = [d for d in (range(len(shape)) if free is None else free) if entries[d] is None and shape[d] % n == 0]
    if not dims:
        return None
    best = max(dims, key=lambda d: (shape[d], -d))
    entries[best] = FSDP
    return P(*entries)


def _free_dims(names: tuple[Any, ...], spec: P, unknown: list[Any]) -> tuple[int, ...]:
    """The dimensions of a leaf named ``names`` (one per dimension) that no name places: named None, or by a
    name in ``unknown``. A name a rule maps to None keeps its dimension whole."""
    return tuple(d for d, (n, s) in enumerate(zip(names, spec)) if s is None and (n is None or n in unknown))


def _path_rule_spec(target: Any, rx: str, where: str, ndim: int, rules: shd.Rules, mesh: Mesh) -> tuple[P, list]:
    if target is None:
        return P(), []
    if isinstance(target, P):
        if len(target) > ndim:
            raise ValueError(f"path rule {rx!r} gives {target} ({len(target)} entries) to {where}, of rank {ndim}: "
                             "a PartitionSpec has at most one entry per dimension")
        axes = {a for s in target for a in entry_axes(s)}
        if axes - set(mesh.axis_names):
            raise ValueError(f"path rule {rx!r} gives {target} to {where}: the mesh {tuple(mesh.axis_names)} has no "
                             f"axis {sorted(axes - set(mesh.axis_names))}")
        return target, []
    if len(target) != ndim:
        raise ValueError(f"path rule {rx!r} names {len(target)} dimensions {target} of {where}, of rank {ndim}: "
                         f"give one logical name (or None) per dimension")
    return Rules(rules).resolve(target, mesh)


def place(shapes: Any, names: Any, mesh: Mesh, rules: shd.Rules, *, param_rules: shd.PathRules | None = None,
          auto_fsdp: bool = True, auto_fsdp_min_size: int = AUTO_FSDP_MIN_SIZE, what: str = "param") -> Placement:
    """Places every leaf of ``shapes`` (arrays or ``jax.ShapeDtypeStruct``; unboxed) as the module docstring says.

    Args:
      shapes: the tree to place.
      names: per leaf of ``shapes``, a tuple of dimension names (logical or mesh axes) or None (unnamed):
        :func:`boxed_names` of a Flax-boxed tree, or NNX's ``out_sharding`` names.
      mesh, rules: the mesh and logical rules (applied as :func:`jaxpar.sharding.effective_rules`).
      param_rules, auto_fsdp, auto_fsdp_min_size: path rules, automatic FSDP and its size threshold.
      what: the tree's role in messages (``param``, ``model state``).

    Raises:
      ValueError: a leaf's names longer than its rank; a path rule's target of the wrong rank or naming an axis
        the mesh lacks; a sharded dimension its mesh axes do not divide (naming the path).
    """
    rules = shd.effective_rules(rules, mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    flat_names = treedef.flatten_up_to(names) if names is not None else [None] * len(flat)
    specs, sources, notes = [], {}, []
    hits = [0] * len(param_rules.rules) if param_rules is not None else []
    for (path, leaf), nm in zip(flat, flat_names):
        where, ndim = shd.key_path(path), len(leaf.shape)
        rule = param_rules.match(where) if param_rules is not None else None
        spec, unknown = None, []
        if rule is not None:
            hits[rule] += 1
            rx, target = param_rules.rules[rule]
            spec, unknown = _path_rule_spec(target, rx, f"{what} {where}", ndim, rules, mesh)
            sources[where] = f"path rule {rx!r}"
        elif nm is not None:
            if len(nm) > ndim:
                raise ValueError(f"{what} {where} of shape {tuple(leaf.shape)} is named {nm}: more names than "
                                 "dimensions; give one name (or None) per dimension")
            full = tuple(nm) + (None,) * (ndim - len(nm))
            spec, unknown = rules.resolve(full, mesh)
            literal = all(n is None or n in mesh.axis_names for n in nm)
            sources[where] = "mesh axes" if literal else "rules"
            more = None if literal or not auto_fsdp or not any(spec) else _auto_spec(
                tuple(leaf.shape), mesh, auto_fsdp_min_size, spec, _free_dims(full, spec, unknown))
            if more is not None:
                spec, sources[where] = more, "rules + auto fsdp"
        if unknown:
            notes.append(f"{what} {where}: logical names {unknown} are known to no rule and name no mesh axis: add "
                         f"rules for them (rules=(..., ({unknown[0]!r}, 'fsdp'), ...)) or a path rule")
        if spec is None or (unknown and all(s is None for s in spec)):
            auto = _auto_spec(tuple(leaf.shape), mesh, auto_fsdp_min_size) if auto_fsdp else None
            spec = auto or P()
            sources[where] = "auto fsdp" if auto else "replicated"
        specs.append(spec)
    if param_rules is not None:
        notes += [f"path rule {rx!r} matched no {what}" for (rx, _), n in zip(param_rules.rules, hits) if n == 0]
    spec_tree = treedef.unflatten(specs)
    shd.check_divisible(shapes, spec_tree, mesh, treedef.unflatten([P(*n) if n else P() for n in flat_names]))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree, is_leaf=lambda x: isinstance(x, P))
    return Placement(shardings, sources, tuple(notes))


def check_tensor_used(placement: Placement, mesh: Mesh) -> None:
    """Raises ValueError when the mesh has ``tensor > 1`` and no param is split over ``tensor``."""
    if mesh.shape.get(TENSOR, 1) == 1:
        return
    specs = [s.spec for s in jax.tree.leaves(placement.shardings)]
    if not any(TENSOR in entry_axes(e) for s in specs for e in s):
        raise ValueError(
            f"the mesh has tensor={mesh.shape['tensor']} but no parameter maps to the tensor axis, so every device "
            "of a tensor group would compute the same thing: tensor parallelism needs the model's semantics "
            "(which matmuls split by columns and rows). Name the kernels' dimensions (logical names the rules map "
            "to tensor: 'mlp', 'heads', 'vocab'), or give jp.sharding.path_rules([(r'Dense_0/kernel', "
            "(None, 'mlp')), ...]) as init_state(..., param_rules=), or build the mesh with tensor=1 (e.g. more "
            "fsdp)")


# ------------------------------------------------------------------------------------ activation names

_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, nn, shd) if getattr(m, "__file__", None))
_audit = threading.local()


def _recording(original, array_dim_names, rules=None):
    """Flax's resolution of ``array_dim_names``, noting (in an auditing thread) the names used and those no rule
    knows."""
    out = original(array_dim_names, rules)
    record, used = getattr(_audit, "record", None), getattr(_audit, "used", None)
    if used is not None and array_dim_names is not None:
        used.update(n for n in array_dim_names if isinstance(n, str))
    if record is not None and array_dim_names is not None:
        known = set(Rules(rules if rules is not None else nn.get_logical_axis_rules()).names)
        for n in array_dim_names:
            if isinstance(n, str) and n not in known and n not in record:
                record[n] = _caller()
    return out


def _rank_tolerant(original, axis_resources, x, *args, **kwargs):
    """Flax's logical constraint of one value, skipped when the names outnumber the value's rank inside a jaxpar
    step: ``nn.DenseGeneral`` builds its kernel flat (2-D) and constrains it by the full kernel's names, and Flax's
    apply re-evaluates that init to check the param's shape (under the rules). The param itself is placed by
    the state's shardings; the constraint could not apply."""
    if getattr(_audit, "record", None) is not None and axis_resources is not None and \
            len(axis_resources) > getattr(x, "ndim", len(axis_resources)):
        return x
    return original(axis_resources, x, *args, **kwargs)


def _caller() -> str:
    """The innermost frame outside jax, flax and jaxpar's sharding: where the constraint was written."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(_LIBRARY_DIRS):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def record_unknown_names():
    """Records, in this thread, the logical names that activation constraints (``nn.with_logical_constraint``,
    ``jp.sharding.constrain``) traced inside use and no rule knows: yields ``{name: "file:line"}``.

    Flax maps such a name to an unsharded dimension silently; a step reports them once, when traced. Inside,
    a Flax logical constraint with more names than its value's rank is skipped (:func:`_rank_tolerant`). Flax's
    functions are hooked only while some thread is inside (:func:`jaxpar._compat.flax_spmd_hooks`).
    """
    outer = getattr(_audit, "record", None), getattr(_audit, "used", None)
    with _compat.flax_spmd_hooks(_recording, _rank_tolerant):
        _audit.record, _audit.used = {}, set()
        try:
            yield _audit.record
        finally:
            _audit.record, _audit.used = outer


def names_used() -> set[str]:
    """The logical names the constraints traced so far inside :func:`record_unknown_names` used (empty outside)."""
    return set(getattr(_audit, "used", None) or ())


@contextlib.contextmanager
def audit_activation_names(mesh: Mesh, rules: shd.Rules):
    """A step's trace: warns (once per trace) of activation constraints whose logical names no rule knows, and
    refuses a mesh whose ``context`` axis no traced activation uses.

    Raises:
      ValueError: ``context > 1`` and no activation constraint traced inside names a logical axis the rules map to
        ``context`` (the sequence would be replicated on every context device: the model's activations never name
        ``seq``).
    """
    with record_unknown_names() as unknown:
        yield
        used = names_used()
    if unknown:
        where = ", ".join(f"{n!r} (at {w})" for n, w in unknown.items())
        warnings.warn(f"activation constraints name logical axes no rule knows: {where}; Flax leaves those "
                      "dimensions unsharded. Add rules for them (rules=(..., (name, mesh axes), ...)), e.g. "
                      "MaxText's names with MaxText's rules", stacklevel=3)
    context = dict(mesh.shape).get(CONTEXT, 1)
    if context > 1 and not any(CONTEXT in Rules(rules).mesh_axes(n) for n in used):
        raise ValueError(
            f"the mesh has context={context}, but no activation of this step names a logical axis the rules map to "
            f"'context' (names used: {sorted(used)}), so every context device would hold the whole sequence. "
            "Name the sequence axis of activations (jp.sharding.constrain(x, 'batch', 'seq', 'embed'); "
            "DEFAULT_RULES map 'seq' to 'context') and attend with jp.attention.causal, or build the mesh with "
            "context=1")


__all__ = ["AUTO_FSDP_MIN_SIZE", "Placement", "audit_activation_names", "boxed_names", "check_tensor_used", "names_used",
           "place", "record_unknown_names"]
