"""The names sharding speaks: mesh axes, logical axes, and :class:`Rules`, the one resolver between them.

Mesh axis names (:data:`AXES`, in ``jp.make_mesh``'s order) and the logical names jaxpar's models and layers give
their dimensions are constants here, so a name is written once (MaxText's ``common_types.py``). A :class:`Rules`
value maps logical names to mesh axes with Flax's semantics (the first rule naming a logical axis wins; a mesh
axis splits at most one dimension of an array), and every reader of rules goes through it: params, activations,
batches, the activation audit, context parallelism and compaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import flax.linen as nn
from jax.sharding import PartitionSpec as P

# ------------------------------------------------------------------------------------------------- mesh axes

DATA = "data"          # data parallelism: replicas of the params, each on its own rows of the batch
PIPE = "pipe"          # pipeline stages
FSDP = "fsdp"          # fully sharded data parallelism: rows of the batch and shards of every weight
CONTEXT = "context"    # context parallelism: chunks of the sequence
TENSOR = "tensor"      # tensor (Megatron) parallelism: columns and rows of the matmuls
AXES: tuple[str, ...] = (DATA, PIPE, FSDP, CONTEXT, TENSOR)
"""The mesh axes of ``jp.make_mesh``, in mesh order: slow links outside, fast ones inside."""

# ---------------------------------------------------------------------------------------------- logical axes

BATCH = "batch"        # the global batch of an activation
SEQ = "seq"            # an activation's sequence
EMBED = "embed"        # the model dimension
MLP = "mlp"            # the MLP's hidden dimension
HEADS = "heads"        # attention query heads
KV = "kv"              # one head's dimension
KV_HEADS = "kv_heads"  # grouped-query key/value heads
VOCAB = "vocab"        # the vocabulary
LAYERS = "layers"      # stacked layers
STAGE = "stage"        # pipeline stages of stacked layers
POSITION = "position"  # the rows of a learned position table
EXPERTS = "experts"    # the routed experts of a mixture-of-experts layer (expert parallelism)
EXPERT_MLP = "expert_mlp"  # one expert's hidden dimension (expert-tensor parallelism), apart from the dense `mlp`


# ----------------------------------------------------------------------------------------------- resolving

def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry or rule target: None -> (), ``'fsdp'`` -> ``('fsdp',)``, a
    tuple (or list) of axis names as a tuple."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def axes_entry(axes: Sequence[str]) -> str | tuple[str, ...] | None:
    """The ``PartitionSpec`` entry of a dimension split over ``axes``: None, one axis name, or a tuple of them."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def spec_without(spec: P, axes: Iterable[str]) -> P:
    """``spec`` with the mesh ``axes`` removed from every entry (entries that are neither an axis name nor a tuple
    of them, e.g. ``P.UNCONSTRAINED``, are kept)."""
    drop = set(axes)
    keep = lambda e: axes_entry(tuple(a for a in entry_axes(e) if a not in drop)) if isinstance(e, (str, tuple)) else e
    return type(spec)(*map(keep, spec))


class Rules(tuple):
    """Logical axis rules: a tuple of ``(logical_name, mesh_axes)`` pairs, ``mesh_axes`` None, a mesh axis name or
    a tuple of them, read with Flax's semantics (``nn.logical_to_mesh_axes``): rules in order, the first rule
    naming a logical axis wins, and a mesh axis splits at most one dimension of an array.

    A plain tuple of pairs is a rules table too (``(*jp.sharding.DEFAULT_RULES, ('experts', 'fsdp'))``); every
    function taking rules accepts one and reads it through ``Rules(rules)``.
    """

    __slots__ = ()

    def __new__(cls, pairs: Iterable[Any] = ()) -> Rules:
        return pairs if type(pairs) is cls else super().__new__(cls, tuple(pairs))

    @property
    def names(self) -> tuple[str, ...]:
        """The logical names the rules map, in rule order (a name ruled twice appears twice)."""
        return tuple(r[0] for r in self)

    def mesh_axes(self, name: str | tuple[str, ...] | None, mesh: Any = None) -> tuple[str, ...]:
        """The mesh axes a dimension named ``name`` alone is split over (the first rule naming it; () for None
        or a name no rule maps); a tuple of names, for a dimension flattening several, their axes concatenated.
        With ``mesh``, only the axes ``mesh`` has."""
        if isinstance(name, tuple):
            axes = tuple(a for e in nn.logical_to_mesh_axes(name, self) for a in entry_axes(e))
        else:
            axes = entry_axes(nn.logical_to_mesh_axes((name,), self)[0])
        return axes if mesh is None else tuple(a for a in axes if a in mesh.axis_names)

    def spec(self, names: Sequence[str | None]) -> P:
        """The mesh ``PartitionSpec`` of an array whose dimensions are named ``names`` (logical names or None),
        resolved together: a mesh axis an earlier rule gave one dimension is not given to another."""
        return P(*nn.logical_to_mesh_axes(tuple(names), self))

    def resolve(self, names: Sequence[Any], mesh: Any) -> tuple[P, list[Any]]:
        """The mesh ``PartitionSpec`` of an array whose dimensions carry ``names``, and the names nothing resolves.

        A name a rule knows maps as :meth:`spec` maps it; a name that is a mesh axis of ``mesh`` (or a tuple of
        them: Flax's ``nn.with_partitioning(init, ("fsdp", None))``, the scale-up guide's form) is that axis, when
        no other dimension took it. Any other name is unknown: its dimension stays whole and the name is returned.
        """
        keys = set(self.names)
        known = tuple(n if isinstance(n, str) and n in keys else None for n in names)
        spec = list(self.spec(known))
        used = {a for s in spec for a in entry_axes(s)}
        unknown = []
        for d, n in enumerate(names):
            if n is None or known[d] is not None:
                continue
            axes = entry_axes(n)
            if all(isinstance(a, str) and a in mesh.axis_names for a in axes) and not used & set(axes):
                spec[d], used = n if isinstance(n, str) else axes, used | set(axes)
            else:
                unknown.append(n)
        return P(*spec), unknown

    def all_mesh_axes(self) -> set[str]:
        """Every mesh axis some rule names."""
        return {a for _, target in self for a in entry_axes(target)}

    def without_axes(self, axes: Iterable[str]) -> Rules:
        """The rules with the mesh ``axes`` removed from every target (a target left empty becomes None): those
        dimensions stay whole."""
        drop = set(axes)
        if not drop & self.all_mesh_axes():
            return self
        strip = lambda t: axes_entry(tuple(a for a in entry_axes(t) if a not in drop))
        return Rules((name, strip(t)) for name, t in self)

    def without_absent(self, mesh: Any) -> Rules:
        """The rules with every mesh axis ``mesh`` lacks removed (a mesh built without jaxpar, e.g.
        ``jax.make_mesh(..., ('data', 'fsdp'))``: an axis it does not have is one of size 1)."""
        return self.without_axes(self.all_mesh_axes() - set(getattr(mesh, "axis_names", ())))


__all__ = ["AXES", "BATCH", "CONTEXT", "DATA", "EMBED", "EXPERTS", "EXPERT_MLP", "FSDP", "HEADS", "KV", "KV_HEADS", "LAYERS", "MLP", "PIPE",
           "POSITION", "Rules", "SEQ", "STAGE", "TENSOR", "VOCAB", "axes_entry", "entry_axes", "spec_without"]
