"""How batches reach the devices: the leading (global batch) axis over the rules' batch mesh axes, each process
placing its rows (``jax.make_array_from_process_local_data``)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.sharding import rules as shd


class Batches:
    """How batches reach the devices, fixed when a step is built: their sharding and this process's rows."""

    def __init__(self, mesh: Mesh, rules: shd.Rules):
        self.mesh, self.rules = mesh, rules
        axes = shd.batch_axes(rules, mesh)
        self._n = math.prod(mesh.shape[a] for a in axes)
        share = shd.process_batch_rows(self._n, mesh, rules)
        self._share = share.stop - share.start                # this process's rows of every n global rows
        self._spec = (axes or None,)

    def sharding(self, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, P(*self._spec, *([None] * (ndim - 1))))

    def global_rows(self, leaf: Any) -> int:
        """A leaf's global batch: its leading size (jax arrays and abstract leaves are global), or the global
        size of which a host leaf is this process's share."""
        n = np.shape(leaf)[0]
        return n if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) else n * self._n // self._share

    def size(self, batch: Any) -> int:
        """The global batch size; ValueError for an empty batch, a scalar leaf or leaves that disagree."""
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise ValueError("batch has no arrays; pass a pytree of arrays whose leading axis is the global batch")
        for leaf in leaves:
            if np.ndim(leaf) == 0:
                raise ValueError(f"batch leaf of shape {np.shape(leaf)} has no leading batch axis")
        sizes = {self.global_rows(leaf) for leaf in leaves}
        if len(sizes) != 1:
            raise ValueError(f"batch leaves disagree on the batch size: {sorted(sizes)}; give every leaf the same "
                             "leading (global batch) axis")
        return sizes.pop()

    def place(self, batch: Any, abstract: bool = False) -> Any:
        """Global arrays with the leading axis over the batch axes (abstract leaves get the sharding). With
        ``abstract``, host leaves become ``jax.ShapeDtypeStruct``\\ s of their global shape instead: lowering
        needs no data, and compile-only devices (``jp.plan.gpu_target``) cannot hold any."""
        def place(x):
            sharding = self.sharding(np.ndim(x))
            if abstract and not isinstance(x, jax.Array):
                x = jax.ShapeDtypeStruct((self.global_rows(x), *np.shape(x)[1:]), jnp.result_type(x))
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            if isinstance(x, jax.Array):
                return x if x.sharding == sharding else jax.device_put(x, sharding)
            x = np.asarray(x)
            return jax.make_array_from_process_local_data(sharding, x, (self.global_rows(x), *x.shape[1:]))
        return jax.tree.map(place, batch)


def process_slice(global_batch: int, mesh: Mesh | None = None, rules: shd.Rules = shd.DEFAULT_RULES) -> slice:
    """The rows of a global batch this process builds.

    With a ``mesh``: the rows this process's devices hold under the batch sharding
    (:func:`jaxpar.sharding.process_batch_rows`; the whole batch when the batch axes lie within each
    process). Without: block ``process_index`` of ``process_count`` equal blocks, which is the same for
    meshes whose batch axes span the processes in order (``jp.make_mesh`` with data/fsdp outermost).

    Raises:
      ValueError: ``global_batch`` not divisible by the processes (or the mesh's batch axes).
    """
    if mesh is not None:
        return shd.process_batch_rows(global_batch, mesh, rules)
    n, i = jax.process_count(), jax.process_index()
    if global_batch % n:
        raise ValueError(f"global batch {global_batch} is not divisible by the {n} processes")
    per = global_batch // n
    return slice(i * per, (i + 1) * per)


def shard_batch(batch: Any, mesh: Mesh, rules: shd.Rules = shd.DEFAULT_RULES, *, batch_axis: str | None = None) -> Any:
    """Places a batch on the mesh, leading axis split over the batch axes.

    Host (numpy) leaves are this process's rows of the global batch (``jp.data.process_slice(global_batch_size, mesh)``;
    the whole batch in a single-process run) and become global arrays through
    ``jax.make_array_from_process_local_data``; jax arrays are taken as global and resharded if needed;
    ``jax.ShapeDtypeStruct`` leaves get the batch sharding. The batch axis is ``batch_axis`` (a logical name the
    rules map) or the rules' batch axis (``jp.sharding.batch_axes``: the ``batch`` rule, else the first rule
    whose name contains ``batch``).
    """
    return Batches(mesh, shd.with_batch_axis(rules, batch_axis)).place(batch)


__all__ = ["Batches", "shard_batch"]
