"""Device meshes with jaxpar's five named axes, flat or split over hosts (interconnect-aware).

The mesh axes are ``('data', 'pipe', 'fsdp', 'context', 'tensor')``: slow links outside (data and pipe
tolerate inter-host links), fast links inside (fsdp gathers every layer; context passes keys and values inside
every attention layer; tensor all-reduces inside every layer). ``context`` (default 1) shards the sequence:
context parallelism (:mod:`jaxpar.layers.attention`); at size 1 it changes no device and no program.

Public API (signatures are stable; the planner ``jaxpar/plan/`` builds on them)::

    make_mesh(data=-1, pipe=1, fsdp=1, tensor=1, devices=None, axis_types=None, *, context=1,
              hosts=None, devices_per_host=None, across_hosts=None) -> Mesh
        # flat form: hosts, devices_per_host and across_hosts all None.
        # hybrid form (any of them given): data/pipe/fsdp/tensor are still the WHOLE mesh's sizes;
        # the devices are grouped into hosts (by process_index; simulated CPU devices: consecutive
        # groups of devices_per_host = fake hosts) and each axis is split into a within-host part and
        # an across-host part (split_axes), like MaxText's ici_*/dcn_* parallelism.
        # context is keyword-only: positional sizes are data, pipe, fsdp, tensor.
    split_axes(sizes: Mapping[str, int], hosts: int, across_hosts: Mapping[str, int] | None = None)
        -> tuple[dict[str, int], dict[str, int]]      # (per_host, across_hosts), keys AXES, ints
    make_hybrid_mesh(per_host: Mapping[str, int], across_hosts: Mapping[str, int],
                     devices=None, axis_types=None) -> Mesh
        # mesh of prod(per_host) * prod(across_hosts) devices (pass devices=jax.devices()[:N] for a
        # subset of the simulated devices); axis a has size per_host[a] * across_hosts[a].
    host_groups(devices, devices_per_host) -> list[list[Device]]   # the hosts, in mesh order
    describe(mesh) -> str; initialize_distributed(...) -> bool

Hybrid device order: along every axis the across-host index is the major part of the coordinate
(coordinate ``c`` of axis ``a`` lies on host block ``c // per_host[a]``), so neighbours along an axis
share a host wherever the axis has a within-host part. ``tensor`` never spans hosts (ValueError).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxpar import _compat
from jaxpar._validate import positive_int
from jaxpar.sharding.names import AXES, TENSOR


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


def _check_axis_types(axis_types: tuple[AxisType, ...] | None) -> tuple[AxisType, ...]:
    """One type per axis of ``AXES``; four types (data, pipe, fsdp, tensor) give context tensor's type."""
    if axis_types is None:
        return (AxisType.Auto,) * len(AXES)
    axis_types = tuple(axis_types)
    if len(axis_types) == len(AXES) - 1:
        axis_types = (*axis_types[:3], axis_types[3], axis_types[3])
    if len(axis_types) != len(AXES):
        raise ValueError(f"axis_types has {len(axis_types)} entries; give one per axis {AXES}")
    return axis_types


def _check_devices(devices: Sequence[jax.Device] | None) -> list[jax.Device]:
    devices = list(jax.devices() if devices is None else np.ravel(devices) if isinstance(devices, np.ndarray)
                   else devices)   # an array of devices (another mesh's ``mesh.devices``) in its flat order
    if not devices:
        raise ValueError("devices= is empty; pass at least one device")
    if len({id(d) for d in devices}) != len(devices) or len(set(devices)) != len(devices):
        raise ValueError(f"devices= lists a device more than once ({len(devices)} entries, {len(set(devices))} "
                         "distinct); pass each device once")
    return devices


def make_mesh(data: int = -1, pipe: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None,
              axis_types: tuple[AxisType, ...] | None = None, *, context: int = 1,
              hosts: int | None = None, devices_per_host: int | None = None,
              across_hosts: Mapping[str, int] | None = None) -> Mesh:
    """Builds a ``Mesh`` with axes ``('data', 'pipe', 'fsdp', 'context', 'tensor')``, flat or split over hosts.

    Flat form (``hosts``, ``devices_per_host``, ``across_hosts`` all None): the devices in order,
    reshaped, tensor innermost (adjacent devices). Hybrid form (any of the three given), for multi-host
    GPU clusters: the sizes are still the whole mesh's; the devices are grouped into hosts
    (:func:`host_groups`: by ``process_index``, simulated CPU devices into fake hosts of
    ``devices_per_host`` consecutive devices) and each axis is split into a within-host (NVLink) and an
    across-host (InfiniBand) part by :func:`split_axes`; ``across_hosts`` overrides the default split.
    E.g. 4 hosts x 8 GPUs: ``make_mesh(data=4, fsdp=4, tensor=2, hosts=4)`` puts data across the hosts and
    fsdp x tensor inside each.

    Args:
      data, pipe, fsdp, tensor, context: axis sizes; at most one may be ``-1`` to take the remaining devices.
        ``context`` (keyword-only) shards the sequence (context parallelism, :mod:`jaxpar.layers.attention`); 1, the
        default, changes no device and no program.
      devices: the devices to use (default: all of ``jax.devices()``); a subset gives a smaller mesh.
      axis_types: one ``jax.sharding.AxisType`` per axis (or four, without context: it takes tensor's); default
        all ``Auto`` (``jax.make_mesh`` defaults to ``Explicit`` on jax 0.10, under which Flax tensor-parallel
        layers raise).
      hosts: the number of hosts the devices form (real multi-host: ``jax.process_count()`` with one
        process per host).
      devices_per_host: devices per host (GPUs per node, e.g. 8); ``len(devices) // hosts`` if omitted.
      across_hosts: the across-host size of some axes, e.g. ``dict(data=2, fsdp=4)`` (MaxText's
        ``dcn_*_parallelism``); omitted axes get 1; the within-host sizes are the quotients.

    Returns:
      A ``jax.sharding.Mesh`` of shape ``(data, pipe, fsdp, context, tensor)``.

    Raises:
      ValueError: sizes that are zero, below -1, more than one -1, or that do not multiply to the number of
        devices; an ``axis_types`` of the wrong length; in the hybrid form, hosts that do not divide the
        devices, a tensor axis larger than a host or that would span hosts, and the errors of
        :func:`split_axes` and :func:`host_groups`.
    """
    devices = _check_devices(devices)
    sizes = _resolve_sizes(dict(data=data, pipe=pipe, fsdp=fsdp, context=context, tensor=tensor), len(devices))
    axis_types = _check_axis_types(axis_types)
    if hosts is None and devices_per_host is None and across_hosts is None:
        shape = tuple(sizes[a] for a in AXES)
        return jax.make_mesh(shape, AXES, axis_types=axis_types, devices=devices)
    hosts = _resolve_hosts(len(devices), hosts, devices_per_host, across_hosts)
    per_host, across = split_axes(sizes, hosts, across_hosts)
    return make_hybrid_mesh(per_host, across, devices=devices, axis_types=axis_types)


def _resolve_hosts(num_devices: int, hosts: int | None, devices_per_host: int | None,
                   across_hosts: Mapping[str, int] | None) -> int:
    """The host count from ``hosts`` / ``devices_per_host`` / ``across_hosts``; ValueError if they disagree."""
    if hosts is not None:
        hosts = positive_int("hosts", hosts)
    if devices_per_host is not None:
        k = positive_int("devices_per_host", devices_per_host)
        if num_devices % k:
            raise ValueError(f"devices_per_host={k} does not divide the {num_devices} devices; pass the number of "
                             "devices each host (node) has, e.g. 8 GPUs")
        if hosts is not None and hosts * k != num_devices:
            raise ValueError(f"hosts={hosts} x devices_per_host={k} = {hosts * k}, but there are {num_devices} "
                             "devices; give one of the two, or sizes that agree")
        hosts = num_devices // k
    if hosts is None:  # across_hosts alone: its product is the host count
        hosts = math.prod(positive_int(f"across_hosts[{a!r}]", n) for a, n in (across_hosts or {}).items())
    if num_devices % hosts:
        raise ValueError(f"hosts={hosts} does not divide the {num_devices} devices; every host must hold the same "
                         "number of devices")
    return hosts


def split_axes(sizes: Mapping[str, int], hosts: int,
               across_hosts: Mapping[str, int] | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """Splits whole-mesh axis sizes into within-host and across-host parts: ``(per_host, across_hosts)``.

    Default split (``across_hosts`` None): each host's devices are filled from the innermost axis out:
    ``tensor`` entirely (it all-reduces inside every layer: it never spans hosts), then as much of ``context``
    (it passes keys and values in every attention layer) and then of ``fsdp`` as fits (``gcd`` with the room
    left), then ``pipe``, then ``data``; what does not fit goes across
    hosts. So tensor and fsdp stay inside a host whenever tensor x fsdp fits in one, and data / pipe take
    the hosts; a larger fsdp spans hosts (MaxText's ``dcn_fsdp_parallelism``, e.g. FSDP over 128 nodes).

    Args:
      sizes: the whole mesh's size per axis (keys a subset of ``AXES``, missing ones 1; no ``-1``), whose
        product is divisible by ``hosts``.
      hosts: the number of hosts (>= 1); each holds ``prod(sizes) // hosts`` devices.
      across_hosts: explicit across-host sizes for some axes (missing ones 1); their product must be
        ``hosts`` and each must divide its axis.

    Returns:
      Two dicts over ``AXES`` of ints: per host and across hosts; ``per_host[a] * across[a] == sizes[a]``,
      ``prod(per_host) == devices per host``, ``prod(across) == hosts``.

    Raises:
      ValueError: unknown axis names, non-positive sizes, hosts not dividing the devices, a tensor axis
        larger than a host, not dividing the devices per host, or given an across-host size above 1, an
        ``across_hosts`` whose product is not ``hosts`` or that does not divide an axis.
    """
    sizes = _axis_dict("sizes", sizes)
    hosts = positive_int("hosts", hosts)
    total = math.prod(sizes.values())
    if total % hosts:
        raise ValueError(f"hosts={hosts} does not divide the mesh's {total} devices; every host must hold the same "
                         "number of devices")
    per = total // hosts
    if sizes[TENSOR] > per or per % sizes[TENSOR]:
        raise ValueError(
            f"tensor={sizes['tensor']} cannot stay inside a host of {per} devices (a tensor group would span hosts, "
            f"all-reducing over InfiniBand inside every layer); use tensor <= {per} that divides {per}, and put the "
            "rest in fsdp, pipe or data")
    if across_hosts is None:
        return _default_split(sizes, per)
    across = _axis_dict("across_hosts", across_hosts)
    if across[TENSOR] != 1:
        raise ValueError(f"across_hosts['tensor']={across['tensor']}: the tensor axis must stay inside a host; "
                         "move the across-host factor to data, pipe or fsdp")
    bad = [f"{a}={sizes[a]} by {across[a]}" for a in AXES if sizes[a] % across[a]]
    if bad:
        raise ValueError(f"across_hosts does not divide the axis sizes ({', '.join(bad)}); give each axis an "
                         "across-host size that divides it")
    if math.prod(across.values()) != hosts:
        raise ValueError(f"across_hosts {dict(across)} multiplies to {math.prod(across.values())}, but there are "
                         f"{hosts} hosts; the across-host sizes must multiply to the host count")
    return {a: sizes[a] // across[a] for a in AXES}, across


def _default_split(sizes: dict[str, int], per: int) -> tuple[dict[str, int], dict[str, int]]:
    """Fills a host of ``per`` devices innermost-first (tensor, context, fsdp, pipe, data); see :func:`split_axes`."""
    per_host, room = {}, per
    for a in reversed(AXES):
        per_host[a] = math.gcd(sizes[a], room)
        room //= per_host[a]
    if room != 1:
        raise ValueError(
            f"cannot split {' x '.join(f'{a}={sizes[a]}' for a in AXES)} into hosts of {per} devices by the default "
            f"rule (tensor, then context, fsdp, pipe, data fill a host); pass across_hosts= explicitly")
    per_host = {a: per_host[a] for a in AXES}
    return per_host, {a: sizes[a] // per_host[a] for a in AXES}


def _axis_dict(what: str, sizes: Mapping[str, int]) -> dict[str, int]:
    unknown = sorted(set(sizes) - set(AXES))
    if unknown:
        raise ValueError(f"{what} names unknown axes {unknown}; the axes are {AXES}")
    return {a: positive_int(f"{what}[{a!r}]", sizes.get(a, 1)) for a in AXES}


@dataclasses.dataclass(frozen=True, eq=False)
class _OnHost:
    """A device with the host index :func:`host_groups` gave it, as ``slice_index`` for ``mesh_utils``."""
    device: jax.Device
    slice_index: int

    platform = property(lambda self: self.device.platform)
    device_kind = property(lambda self: self.device.device_kind)
    id = property(lambda self: self.device.id)
    process_index = property(lambda self: self.device.process_index)


def make_hybrid_mesh(per_host: Mapping[str, int], across_hosts: Mapping[str, int],
                     devices: Sequence[jax.Device] | None = None,
                     axis_types: tuple[AxisType, ...] | None = None) -> Mesh:
    """A mesh from explicit within-host and across-host sizes (MaxText's ``ici_*`` and ``dcn_*``).

    The devices are grouped into ``prod(across_hosts)`` hosts of ``prod(per_host)`` devices by
    :func:`host_groups` and laid out by ``jax.experimental.mesh_utils.create_hybrid_device_mesh`` (each
    host's devices reshaped to ``per_host``; hosts arranged in ``across_hosts``; axis ``a``'s coordinate
    ``c`` lies on host block ``c // per_host[a]``). ``mesh_utils`` groups by a device's ``slice_index``
    (TPU) or ``process_index``; GPU and CPU devices have no ``slice_index`` and simulated devices all share
    process 0, so each device is passed wrapped with the host index computed here.

    Args:
      per_host, across_hosts: sizes per axis (keys a subset of ``AXES``, missing ones 1).
      devices: the devices (default ``jax.devices()``); exactly ``prod(per_host) * prod(across_hosts)``. For
        a plan on N simulated devices of a larger simulated set: ``devices=jax.devices()[:N]``.
      axis_types: as in :func:`make_mesh` (default all ``Auto``).

    Returns:
      A ``Mesh`` over ``AXES`` with ``mesh.shape[a] == per_host[a] * across_hosts[a]``.

    Raises:
      ValueError: unknown axes, non-positive sizes, the wrong number of devices, a tensor axis across
        hosts, hosts that would straddle processes (:func:`host_groups`).
    """
    per_host, across = _axis_dict("per_host", per_host), _axis_dict("across_hosts", across_hosts)
    if across[TENSOR] != 1:
        raise ValueError(f"across_hosts['tensor']={across['tensor']}: the tensor axis must stay inside a host")
    devices = _check_devices(devices)
    k, hosts = math.prod(per_host.values()), math.prod(across.values())
    if k * hosts != len(devices):
        raise ValueError(f"per_host {per_host} x across_hosts {across} make {k} x {hosts} = {k * hosts} devices, "
                         f"but there are {len(devices)}; pass devices= with {k * hosts} devices")
    wrapped = [_OnHost(d, h) for h, group in enumerate(host_groups(devices, k)) for d in group]
    grid = mesh_utils.create_hybrid_device_mesh([per_host[a] for a in AXES], [across[a] for a in AXES], wrapped)
    grid = np.vectorize(lambda w: w.device, otypes=[object])(grid)
    return Mesh(grid, AXES, axis_types=_check_axis_types(axis_types))


def host_groups(devices: Sequence[jax.Device], devices_per_host: int) -> list[list[jax.Device]]:
    """Groups ``devices`` into hosts of ``devices_per_host``: by process, then in the given order.

    The devices are ordered by ``process_index`` (stable: the given order within a process) and cut into
    consecutive groups. One process per host: a group is a process's devices. One process per GPU (Slurm
    ``--ntasks-per-node=8``): consecutive processes form a host (Slurm's block distribution numbers the
    tasks of a node consecutively). One process holding all (simulated CPU) devices: fake hosts of
    ``devices_per_host`` consecutive devices.

    Returns:
      ``len(devices) // devices_per_host`` lists of devices, host 0 first.

    Raises:
      ValueError: ``devices_per_host`` not dividing the devices, or a process whose device count is
        neither a multiple nor a divisor of it (a host would straddle processes unevenly).
    """
    k = positive_int("devices_per_host", devices_per_host)
    devices = list(devices)
    if len(devices) % k:
        raise ValueError(f"devices_per_host={k} does not divide the {len(devices)} devices")
    by_process: dict[int, list[jax.Device]] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    for p, local in by_process.items():
        if len(local) % k and k % len(local):
            raise ValueError(f"process {p} has {len(local)} devices, neither a multiple nor a divisor of "
                             f"devices_per_host={k}: a host would straddle processes; pass the GPUs per node")
    ordered = [d for p in sorted(by_process) for d in by_process[p]]
    return [ordered[i:i + k] for i in range(0, len(ordered), k)]


def describe(mesh: Mesh) -> str:
    """One line naming each axis size and the device kind, e.g. ``data=2 pipe=1 fsdp=2 context=1 tensor=2 (8 x cpu)``."""
    axes = " ".join(f"{n}={s}" for n, s in mesh.shape.items())
    kind = mesh.devices.flat[0].platform
    return f"{axes} ({mesh.devices.size} x {kind}, {jax.process_count()} process(es))"


# ------------------------------------------------------------------------------------------ multi-process

# Set by ``python -m jaxpar.cli.launch`` for each process it starts.
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
    ``python -m jaxpar.cli.launch`` sets; JAX's own auto-detection (SLURM, Open MPI, Cloud TPU, Kubernetes,
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
                             f"not ints ({e}); start processes with python -m jaxpar.cli.launch") from None
    if coordinator_address is None and num_processes is None and not _cluster_detected():
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU client only; GPUs use NCCL
    jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids, **kwargs)
    return True


# make_mesh, AXES, describe and initialize_distributed are exported by jaxpar itself (jp.make_mesh); the hybrid
# (hosts x devices) helpers here.
__all__ = ["make_hybrid_mesh", "split_axes"]
