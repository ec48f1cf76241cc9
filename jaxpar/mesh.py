"""Device meshes with jaxpar's four named axes.

The mesh axes are ``('data', 'pipe', 'fsdp', 'tensor')``: slow links outside (data and pipe tolerate
inter-host links), fast links inside (fsdp gathers every layer, tensor all-reduces inside every layer).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar import _compat

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
            others = " x ".join(f"{n}={s}" for n, s in sizes.items() if s != -1)
            raise ValueError(
                f"cannot fill {fill[0]}=-1: the other axes ({others}) multiply to {known}, "
                f"which does not divide the {num_devices} devices; change their sizes")
        sizes = {**sizes, fill[0]: num_devices // known}
    elif known != num_devices:
        raise ValueError(
            f"mesh sizes {desc} multiply to {known}, but there are {num_devices} device{'s' if num_devices != 1 else ''}; "
            f"change the sizes, set one axis to -1, or pass devices= with {known} devices (on CPU, simulate "
            f"devices with XLA_FLAGS=--xla_force_host_platform_device_count={known} set before jax is imported)")
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
    if len({id(d) for d in devices}) != len(devices) or len(set(devices)) != len(devices):
        raise ValueError(f"devices= lists a device more than once ({len(devices)} entries, {len(set(devices))} "
                         "distinct); pass each device once")
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


# ------------------------------------------------------------------------------------------ multi-process

# Set by ``python -m jaxpar.launch`` for each process it starts.
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = (
    "JAXPAR_COORDINATOR_ADDRESS", "JAXPAR_NUM_PROCESSES", "JAXPAR_PROCESS_ID")


# Whether JAX's own auto-detection would find a cluster (SLURM, Open MPI, TPU, k8s, ...); a module attribute so
# tests can replace it.
_cluster_detected = _compat.cluster_detected


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
                           **kwargs) -> bool:
    """Joins a multi-process run: a thin layer over ``jax.distributed.initialize``.

    Where the parameters come from, first match wins: the arguments; the ``JAXPAR_*`` variables that
    ``python -m jaxpar.launch`` sets; JAX's own auto-detection (SLURM, Open MPI, Cloud TPU, Kubernetes,
    ``JAX_COORDINATOR_ADDRESS``). With none of these it is a single-process run: nothing happens and the
    result is False, so entry points may call it unconditionally. On CPU it selects gloo cross-process
    collectives (``jax_cpu_collectives_implementation``: jax 0.10's default, set explicitly so another
    version's default cannot leave cross-process CPU collectives without an implementation).

    Must run before anything touches devices (``jax.devices()``, any computation). Calling it again after
    a successful initialization returns True.

    Args:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: the number of processes.
      process_id: this process's index in ``[0, num_processes)``.
      local_device_ids: the local devices this process uses (GPU ids; None: all).
      **kwargs: passed to ``jax.distributed.initialize`` (e.g. ``initialization_timeout`` in seconds).

    Returns:
      True when running as one of several processes (or a cluster of one) after the call; False otherwise.

    Raises:
      RuntimeError: devices were already initialized (call it first thing in the program).
      ValueError: a malformed ``JAXPAR_*`` variable.
    """
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    if coordinator_address is None and ENV_COORDINATOR in env:
        try:
            coordinator_address = env[ENV_COORDINATOR]
            num_processes = int(env[ENV_NUM_PROCESSES]) if num_processes is None else num_processes
            process_id = int(env[ENV_PROCESS_ID]) if process_id is None else process_id
        except (KeyError, ValueError) as e:
            raise ValueError(f"{ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID} are missing or "
                             f"not ints ({e}); start processes with python -m jaxpar.launch") from None
    if coordinator_address is None and num_processes is None and not _cluster_detected():
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU client only; GPUs use NCCL
    jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids, **kwargs)
    return True
