"""Where a training state's bytes live: per leaf, per device against global, and how each leaf was placed.

``jp.sharding.describe_params`` / ``TrainState.report()`` build a :class:`ShardingReport` from arrays' (or
``jax.ShapeDtypeStruct``\\ s') shardings; ``jp.train.init_state`` prints one when it placed a param the model
did not name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar._tree import key_path
from jaxpar.sharding.names import entry_axes


@dataclasses.dataclass(frozen=True)
class LeafReport:
    """One leaf of a :class:`ShardingReport`: global shape and bytes, per-device bytes, spec, how it got it, and
    ``axes``: the mesh axes of size > 1 it is split over (a size-1 axis in its spec splits nothing)."""
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    nbytes: int
    nbytes_per_device: int
    source: str = ""
    axes: tuple[str, ...] = ()


def _split_axes(sharding: Any) -> tuple[str, ...]:
    """The mesh axes of size > 1 a ``NamedSharding`` splits its array over (in spec order); () for any other."""
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return ()
    axes = [a for e in spec for a in entry_axes(e)]
    return tuple(a for a in axes if dict(mesh.shape).get(a, 1) > 1)


def _leaf_reports(tree: Any, sources: dict[str, str] | None) -> tuple[LeafReport, ...]:
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        sharding = getattr(x, "sharding", None)
        shape, itemsize = tuple(np.shape(x)), np.dtype(getattr(x, "dtype", np.float32)).itemsize \
            if not jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key) else 8
        local = sharding.shard_shape(shape) if sharding is not None else shape
        name = key_path(path)
        out.append(LeafReport(name, shape, str(getattr(x, "dtype", "")), str(getattr(sharding, "spec", None)),
                              math.prod(shape) * itemsize, math.prod(local) * itemsize, (sources or {}).get(name, ""),
                              _split_axes(sharding)))
    return tuple(out)


def _mesh_axes(*trees: Any) -> tuple[tuple[str, int], ...]:
    """``(name, size)`` of the axes of size > 1 of the mesh the first ``NamedSharding`` leaf of ``trees`` lives on."""
    for x in jax.tree.leaves(trees):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if getattr(mesh, "shape", None) is not None and getattr(x.sharding, "spec", None) is not None:
            return tuple((a, n) for a, n in mesh.shape.items() if n > 1)
    return ()


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """Where a training state's bytes live: per leaf, and per device against global.

    Iterating yields ``(path, global shape, PartitionSpec as text)`` per param leaf. ``str(report)`` is the
    summary the step's set-up prints: bytes per device of params and optimizer state, for each mesh axis of
    size > 1 the share of param and of optimizer-state bytes split over it (a leaf on ``tensor`` alone counts
    for ``tensor``, never for ``fsdp``: ``data`` and any axis no leaf uses hold full copies), each leaf, and the
    largest replicated leaves.

    Attributes:
      params, opt_state: :class:`LeafReport` per leaf (``source``: ``rules`` for logical names, ``mesh axes`` for
        mesh-axis names, ``path rule <regex>``, ``auto fsdp``, ``rules + auto fsdp`` (logical names, and
        ``fsdp`` on a dimension they leave free), ``replicated``; empty when unknown).
      notes: problems found while placing (unknown logical names, path rules that matched nothing).
      mesh_axes: ``(name, size)`` of the mesh's axes of size > 1, in mesh order.
    """
    params: tuple[LeafReport, ...]
    opt_state: tuple[LeafReport, ...] = ()
    notes: tuple[str, ...] = ()
    mesh_axes: tuple[tuple[str, int], ...] = ()

    def __iter__(self):
        return iter((r.path, r.shape, r.spec) for r in self.params)

    def __len__(self) -> int:
        return len(self.params)

    @property
    def bytes(self) -> int:
        """Global bytes of params and optimizer state."""
        return sum(r.nbytes for r in self.params + self.opt_state)

    @property
    def bytes_per_device(self) -> int:
        """Bytes of params and optimizer state one device holds."""
        return sum(r.nbytes_per_device for r in self.params + self.opt_state)

    @property
    def ratio(self) -> float:
        """Per-device over global bytes of params and optimizer state (1.0: every device holds everything)."""
        return self.bytes_per_device / max(self.bytes, 1)

    @property
    def fraction_sharded(self) -> float:
        """The fraction of param bytes in leaves split over some mesh axis, whichever (:meth:`fraction_over`
        says which)."""
        return sum(r.nbytes for r in self.params if r.nbytes_per_device < r.nbytes) / max(
            sum(r.nbytes for r in self.params), 1)

    def fraction_over(self, axis: str, opt_state: bool = False) -> float:
        """The fraction of param bytes (``opt_state=True``: optimizer-state bytes) in leaves split over the mesh
        axis ``axis``; 0.0 for an axis of size 1 or one the mesh lacks."""
        leaves = self.opt_state if opt_state else self.params
        return sum(r.nbytes for r in leaves if axis in r.axes) / max(sum(r.nbytes for r in leaves), 1)

    def replicated(self, k: int = 5) -> list[LeafReport]:
        """The ``k`` largest param leaves every device holds whole."""
        return sorted((r for r in self.params if r.nbytes_per_device == r.nbytes), key=lambda r: -r.nbytes)[:k]

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:.3f} MiB"
        pg, pd = sum(r.nbytes for r in self.params), sum(r.nbytes_per_device for r in self.params)
        og, od = sum(r.nbytes for r in self.opt_state), sum(r.nbytes_per_device for r in self.opt_state)
        lines = [f"params: {mib(pd)} per device of {mib(pg)}; optimizer state: {mib(od)} of {mib(og)}; "
                 f"per device / global {self.ratio:.3f}"]
        shares = lambda opt: ", ".join(f"{a} {100 * self.fraction_over(a, opt):.1f}%" for a, _ in self.mesh_axes)
        if self.mesh_axes:
            lines.append(f"bytes split over each mesh axis: params {shares(False)}"
                         + (f"; optimizer state {shares(True)}" if self.opt_state else ""))
        else:
            lines.append("bytes split over each mesh axis: none (no mesh axis of size > 1)")
        lines += [f"  {r.path}  {r.shape}  {r.spec}  {r.source}".rstrip() for r in self.params]
        big = [f"{r.path} ({mib(r.nbytes)})" for r in self.replicated() if r.nbytes]
        lines += [f"largest replicated: {', '.join(big) or 'none'}", *self.notes]
        return "\n".join(lines)


def describe_params(params: Any, opt_state: Any = None, sources: dict[str, str] | None = None) -> ShardingReport:
    """The :class:`ShardingReport` of ``params`` (and ``opt_state``): arrays or ``jax.ShapeDtypeStruct``\\ s with
    shardings, e.g. ``jp.sharding.describe_params(state.params, state.opt_state)`` (``state.report()``).
    Iterating it yields ``(path, shape, spec)`` per param leaf. ``sources``: path -> how the leaf was placed."""
    return ShardingReport(_leaf_reports(params, sources), _leaf_reports(opt_state, None) if opt_state is not None
                          else (), mesh_axes=_mesh_axes(params, opt_state))


__all__ = ["LeafReport", "ShardingReport", "describe_params", "key_path"]
