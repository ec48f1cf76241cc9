"""Where a training state's bytes live: per leaf, per device against global, and how each leaf was placed.

``jp.sharding.describe_params`` / ``TrainState.report()`` build a :class:`ShardingReport` from arrays' (or
``jax.ShapeDtypeStruct``\\ s') shardings; ``jp.train.init_state`` prints one when it placed a param the model
did not name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def key_path(path: Sequence[Any]) -> str:
    """A pytree key path as ``a/b/0/kernel`` (dict keys, attributes, sequence indices)."""
    part = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
    return "/".join(part(k) for k in path)


@dataclasses.dataclass(frozen=True)
class LeafReport:
    """One leaf of a :class:`ShardingReport`: global shape and bytes, per-device bytes, spec, and how it got it."""
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    nbytes: int
    nbytes_per_device: int
    source: str = ""


def _leaf_reports(tree: Any, sources: dict[str, str] | None) -> tuple[LeafReport, ...]:
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        sharding = getattr(x, "sharding", None)
        shape, itemsize = tuple(np.shape(x)), np.dtype(getattr(x, "dtype", np.float32)).itemsize \
            if not jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key) else 8
        local = sharding.shard_shape(shape) if sharding is not None else shape
        name = key_path(path)
        out.append(LeafReport(name, shape, str(getattr(x, "dtype", "")), str(getattr(sharding, "spec", None)),
                              math.prod(shape) * itemsize, math.prod(local) * itemsize, (sources or {}).get(name, "")))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """Where a training state's bytes live: per leaf, and per device against global.

    Iterating yields ``(path, global shape, PartitionSpec as text)`` per param leaf. ``str(report)`` is the
    summary the step's set-up prints: bytes per device of params and optimizer state, the fraction of param
    bytes sharded, and the largest replicated leaves.

    Attributes:
      params, opt_state: :class:`LeafReport` per leaf (``source``: ``rules`` for logical names, ``mesh axes`` for
        mesh-axis names, ``path rule <regex>``, ``auto fsdp``, ``replicated``; empty when unknown).
      notes: problems found while placing (unknown logical names, path rules that matched nothing).
    """
    params: tuple[LeafReport, ...]
    opt_state: tuple[LeafReport, ...] = ()
    notes: tuple[str, ...] = ()

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
        """The fraction of param bytes in leaves split over some mesh axis."""
        return sum(r.nbytes for r in self.params if r.nbytes_per_device < r.nbytes) / max(
            sum(r.nbytes for r in self.params), 1)

    def replicated(self, k: int = 5) -> list[LeafReport]:
        """The ``k`` largest param leaves every device holds whole."""
        return sorted((r for r in self.params if r.nbytes_per_device == r.nbytes), key=lambda r: -r.nbytes)[:k]

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:.3f} MiB"
        pg, pd = sum(r.nbytes for r in self.params), sum(r.nbytes_per_device for r in self.params)
        og, od = sum(r.nbytes for r in self.opt_state), sum(r.nbytes_per_device for r in self.opt_state)
        lines = [f"params: {mib(pd)} per device of {mib(pg)}; optimizer state: {mib(od)} of {mib(og)}; "
                 f"per device / global {self.ratio:.3f}; {100 * self.fraction_sharded:.1f}% of param bytes sharded"]
        lines += [f"  {r.path}  {r.shape}  {r.spec}  {r.source}".rstrip() for r in self.params]
        big = [f"{r.path} ({mib(r.nbytes)})" for r in self.replicated() if r.nbytes]
        lines += [f"largest replicated: {', '.join(big) or 'none'}", *self.notes]
        return "\n".join(lines)


def describe_params(params: Any, opt_state: Any = None, sources: dict[str, str] | None = None) -> ShardingReport:
    """The :class:`ShardingReport` of ``params`` (and ``opt_state``): arrays or ``jax.ShapeDtypeStruct``\\ s with
    shardings, e.g. ``jp.sharding.describe_params(state.params, state.opt_state)`` (``state.report()``).
    Iterating it yields ``(path, shape, spec)`` per param leaf. ``sources``: path -> how the leaf was placed."""
    return ShardingReport(_leaf_reports(params, sources), _leaf_reports(opt_state, None) if opt_state is not None
                          else ())


__all__ = ["LeafReport", "ShardingReport", "describe_params", "key_path"]
