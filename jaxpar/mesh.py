"""Device meshes with jaxpar's four named axes.

The mesh axes are ``('data', 'pipe', 'fsdp', 'tensor')``: slow links outside (data and pipe tolerate
inter-host links), fast links inside (fsdp gathers every layer, tensor all-reduces inside every layer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES: tuple[str, ...] = ("data", "pipe", "fsdp", "tensor")


def _resolve_sizes(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
    """Fills a single ``-1`` so the sizes multiply to ``num_devices``; raises ValueError otherwise."""
    for name, size in sizes.items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool):
            raise ValueError(f"mesh axis {name}={size!r} must be an int (or -1 to fill)")
        if size == 0 or size < -1:
            raise ValueError(f"mesh axis {name}={size} must be positive, or -1 to fill the remaining devices")
    fill = [n for n, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {fill}; give explicit sizes to all but one")
    known = math.prod(s for s in sizes.values() if s != -1)
    desc = " x ".join(f"{n}={s}" for n, s in sizes.items())
    if fill:
        if num_devices % known:
            raise ValueError(
                f"cannot fill {fill[0]}=-1: the other axes ({desc}) multiply to {known}, "
                f"which does not divide the {num_devices} devices")
        sizes = {**sizes, fill[0]: num_devices // known}
    elif known != num_devices:
        raise ValueError(
            f"mesh sizes {desc} multiply to {known}, but there are {num_devices} devices; "
            f"change the sizes, set one axis to -1, or pass devices= with {known} devices")
    return sizes


def make_mesh(data: int = -1, pipe: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None,
              axis_types: tuple[AxisType, ...] | None = None) -> Mesh:
    """Builds a ``Mesh`` with axes ``('data', 'pipe', 'fsdp', 'tensor')``.

    Args:
      data, pipe, fsdp, tensor: axis sizes; at most one may be ``-1`` to take the remaining devices.
      devices: the devices to use (default: all of ``jax.devices()``); a subset gives a smaller mesh.
      axis_types: one ``jax.sharding.AxisType`` per axis; default all ``Auto`` (``jax.make_mesh``
        defaults to ``Explicit`` on jax 0.10, under which Flax tensor-parallel layers raise).

    Returns:
      A ``jax.sharding.Mesh`` of shape ``(data, pipe, fsdp, tensor)``, tensor innermost (adjacent devices).

    Raises:
      ValueError: sizes that are zero, below -1, more than one -1, or that do not multiply to the number of
        devices; an ``axis_types`` of the wrong length.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices= is empty; pass at least one device")
    sizes = _resolve_sizes(dict(data=data, pipe=pipe, fsdp=fsdp, tensor=tensor), len(devices))
    if axis_types is None:
        axis_types = (AxisType.Auto,) * len(AXES)
    axis_types = tuple(axis_types)
    if len(axis_types) != len(AXES):
        raise ValueError(f"axis_types has {len(axis_types)} entries; give one per axis {AXES}")
    shape = tuple(sizes[a] for a in AXES)
    return jax.make_mesh(shape, AXES, axis_types=axis_types, devices=devices)


def describe(mesh: Mesh) -> str:
    """One line naming each axis size and the device kind, e.g. ``data=2 pipe=1 fsdp=2 tensor=2 (8 x cpu)``."""
    axes = " ".join(f"{n}={s}" for n, s in mesh.shape.items())
    kind = mesh.devices.flat[0].platform
    return f"{axes} ({mesh.devices.size} x {kind}, {jax.process_count()} process(es))"
