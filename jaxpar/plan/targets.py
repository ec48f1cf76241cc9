"""GPU targets: compile-only devices of an H100 / H200 / B200 / A100 cluster, for compiling on a machine without GPUs.

``target = jp.plan.gpu_target("h100", hosts=2)`` gives 16 compile-only devices (2 hosts x 8 GPUs) of XLA's GPU
compiler ("deviceless AOT"): a mesh over them (``jp.make_mesh(fsdp=8, devices=target.devices)`` or
``target.mesh(fsdp=16)``) lets ``jax.jit(step).lower(...).compile()`` run the real XLA:GPU pipeline (fusion,
collective combining, the latency-hiding scheduler, memory assignment) on a CPU-only machine with
``jax_platforms=cpu``. ``compiled.memory_analysis()`` and ``compiled.as_text()`` (the optimized, scheduled GPU
HLO) are the GPU compiler's own; nothing autotunes (default Triton tiles), and ``cost_analysis()`` is None.

The compiler needs the jax CUDA plugin of the installed jaxlib's version (``pip install 'jaxpar[gpu]'``:
``jax-cuda12-plugin`` and ``jax-cuda12-pjrt``; no driver or CUDA libraries). The GPU is described by XLA's
``GpuTargetConfigProto`` text (openxla/xla ``xla/backends/gpu/target_config/specs/``), shipped in
``jaxpar/tools/target_configs/`` and named by the row of the GPU table (:mod:`jaxpar.tools.datasheets`), which also
gives the target's datasheet figures. On a machine whose devices are that GPU, the device's own config is used.

The API: ``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=<text>,
topology="1x<hosts>x<gpus_per_host>")`` (one slice of ``hosts`` hosts; devices of host ``h`` have
``process_index == h``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.resources
import math
import os
import re
import sys
import tempfile
from typing import Any

import jax
from jax.experimental import topologies

from jaxpar import _compat
from jaxpar._validate import positive_int
from jaxpar.plan import costs
from jaxpar.sharding import mesh as _mesh
from jaxpar.tools import datasheets as _datasheets

# The jaxlib the shipped target files were checked with (each parses and compiles a sharded step there).
CHECKED_JAXLIB = "0.10.2"
_CUDA_PLUGINS = (("jax-cuda12-plugin", "jax-cuda12-pjrt"), ("jax-cuda13-plugin", "jax-cuda13-pjrt"))
_INSTALL = "pip install 'jaxpar[gpu]' (from a checkout: pip install -e '.[gpu]')"


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU cluster to compile for: ``hosts`` hosts of ``gpus_per_host`` GPUs of one datasheet row.

    Attributes:
      datasheet: the GPU's row of the table (:class:`jaxpar.tools.datasheets.Datasheet`: figures and source).
      hosts, gpus_per_host: the topology (``1 x hosts x gpus_per_host``).
      target_config: the ``GpuTargetConfigProto`` text compiled for.
      config_source: where that text came from (the shipped file's name, or ``"device"``).
      devices: the ``hosts * gpus_per_host`` compile-only devices, host by host (``process_index`` = host).
    """
    datasheet: _datasheets.Datasheet
    hosts: int
    gpus_per_host: int
    target_config: str = dataclasses.field(repr=False)
    config_source: str
    devices: tuple[Any, ...] = dataclasses.field(repr=False)

    name = property(lambda self: self.datasheet.name)
    num_devices = property(lambda self: self.hosts * self.gpus_per_host)
    topology = property(lambda self: f"1x{self.hosts}x{self.gpus_per_host}")
    bf16_flops = property(lambda self: self.datasheet.bf16_flops)        # dense, FLOP/s per GPU
    fp8_flops = property(lambda self: self.datasheet.fp8_flops)          # dense, FLOP/s per GPU (None: no fp8)
    memory_bytes = property(lambda self: self.datasheet.memory_bytes)    # HBM capacity per GPU
    hbm_bytes_per_s = property(lambda self: self.datasheet.hbm_bytes_per_s)
    nvlink_bytes_per_s = property(lambda self: self.datasheet.nvlink_bytes_per_s)          # per GPU, each way
    infiniband_bytes_per_s = property(lambda self: self.datasheet.infiniband_bytes_per_s)  # per GPU, each way
    source = property(lambda self: self.datasheet.source)

    @property
    def gpu(self) -> costs.GPU:
        """The same figures as the planner's :class:`jaxpar.plan.costs.GPU`."""
        return costs.gpu(self.name)

    def mesh(self, **sizes: int) -> jax.sharding.Mesh:
        """``jp.make_mesh(**sizes, devices=self.devices, hosts=self.hosts, devices_per_host=self.gpus_per_host)``:
        the mesh split into within-host (NVLink) and across-host (InfiniBand) parts.

        Raises:
          ValueError: sizes (``-1`` aside) that do not multiply to this topology's device count, and the errors
            of :func:`jaxpar.sharding.mesh.make_mesh`.
        """
        product = math.prod(sizes.values())
        if -1 not in sizes.values() and product != self.num_devices:
            raise ValueError(f"mesh sizes {sizes} make {product} devices, but target {self.name!r} topology "
                             f"{self.topology} has {self.num_devices} ({self.hosts} hosts x {self.gpus_per_host} "
                             f"GPUs); change the sizes or gpu_target(..., hosts=, gpus_per_host=)")
        return _mesh.make_mesh(**sizes, devices=self.devices, hosts=self.hosts, devices_per_host=self.gpus_per_host)


def target_names() -> list[str]:
    """The names :func:`gpu_target` accepts (rows of the GPU table with a shipped target file, and aliases)."""
    return sorted(n for d in _datasheets.DATASHEETS if d.target_config for n in (d.name, *d.aliases))


def shipped_target_config(name: str) -> str:
    """The text of the shipped ``GpuTargetConfigProto`` file of GPU ``name`` (package data, found from any
    install).

    Raises:
      ValueError: an unknown name, or a GPU of the table without a target file.
    """
    row = _datasheets.datasheet(name)
    if row.target_config is None:
        raise ValueError(f"GPU {name!r} has no XLA target file; compile targets are {target_names()}")
    return importlib.resources.files("jaxpar.tools").joinpath("target_configs", row.target_config).read_text()


def check_cuda_plugin() -> str:
    """The installed jax CUDA plugin's version, checked against jaxlib's.

    Raises:
      ImportError: no jax CUDA plugin (or its PJRT package) installed; the message names the install command.
      RuntimeError: a plugin whose version differs from jaxlib's (XLA's plugin ABI is per release).
    """
    jaxlib = importlib.metadata.version("jaxlib")
    for plugin, pjrt in _CUDA_PLUGINS:
        versions = {}
        for pkg in (plugin, pjrt):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                versions[pkg] = importlib.metadata.version(pkg)
        if not versions:
            continue
        if len(versions) < 2 or set(versions.values()) != {jaxlib}:
            raise RuntimeError(f"compiling for a GPU target needs {plugin} and {pjrt} of jaxlib's version "
                               f"{jaxlib}; installed: {versions or 'none'}; {_INSTALL} or pip install "
                               f"{plugin}=={jaxlib} {pjrt}=={jaxlib}")
        return jaxlib
    raise ImportError(f"compiling for a GPU target needs the jax CUDA plugin of jaxlib's version {jaxlib}, which is "
                      f"not installed: {_INSTALL}, or pip install jax-cuda12-plugin=={jaxlib} "
                      f"jax-cuda12-pjrt=={jaxlib}")


@contextlib.contextmanager
def _stderr_captured():
    """Redirects file descriptor 2 (where XLA's C++ logging writes) to a temporary file; yields a function that
    returns what was written."""
    with tempfile.TemporaryFile() as f:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield lambda: (f.seek(0), f.read().decode(errors="replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


# gpu_device_info fields XLA's GPU compiler divides by: a text that parses without them (an empty file) or with 0
# gives devices whose first compile kills the process (SIGFPE, threads_per_warp: 0 or absent, tried with 0.10.2)
_POSITIVE = ("threads_per_warp", "threads_per_block_limit", "shared_memory_per_block", "core_count")


def _check_device_info(target_config: str, what: str) -> None:
    for field in _POSITIVE:
        found = re.search(rf"\b{field}\s*:\s*([-+0-9.eE]+)", target_config)
        if found is None or float(found.group(1)) <= 0:
            raise ValueError(f"target config {what} has " + (f"{field}: {found.group(1)}" if found else f"no {field}")
                             + f" (gpu_device_info); XLA's GPU compiler needs a positive {field} (the shipped files "
                             "have one: copy it from there)")


def compile_only_devices(target_config: str, hosts: int, gpus_per_host: int, what: str) -> tuple[Any, ...]:
    """The compile-only devices of ``1 x hosts x gpus_per_host`` GPUs described by ``target_config`` (text).

    Raises:
      ValueError: text that does not parse; the message names ``what`` (the file), the line, column and field
        XLA's parser reports. Text without a positive ``threads_per_warp``, ``threads_per_block_limit``,
        ``shared_memory_per_block`` or ``core_count`` (an empty file parses; its first compile died of SIGFPE).
      RuntimeError: the CUDA plugin did not start (on a machine without CUDA libraries, JAX not limited to the
        CPU).
    """
    with _stderr_captured() as log:
        try:
            topo = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                                topology=f"1x{hosts}x{gpus_per_host}")
            _check_device_info(target_config, what)
            return tuple(topo.devices)
        except NotImplementedError as e:   # jax started its CUDA plugin as a runtime (no GPU), not compile-only
            raise RuntimeError(f"compiling for a GPU target on a machine without a usable GPU needs jax started on the "
                               f"CPU platform: set JAX_PLATFORMS=cpu (or jax.config.update('jax_platforms', 'cpu')) "
                               f"before jax starts; here jax_platforms={jax.config.jax_platforms!r} and the CUDA "
                               f"plugin could not start ({e})") from e
        except Exception as e:  # noqa: BLE001  (jax raises its runtime error; the reason is in XLA's log)
            if "GpuTargetConfigProto" not in str(e):
                raise
            found = re.search(r"Error parsing text-format[^:]*: (\d+):(\d+): (.*)", log())
            where = (f"line {found.group(1)}, column {found.group(2)}: {found.group(3).strip()}" if found
                     else "no detail from XLA")
            field = re.search(r'no field named "(\w+)"', found.group(3)) if found else None
            fix = (f"delete the field {field.group(1)!r} (this jaxlib's XLA does not know it)" if field
                   else "fix the text")
            raise ValueError(f"target config {what} does not parse with jaxlib {jax.__version__} "
                             f"(GpuTargetConfigProto): {where}; {fix} (the shipped files parse with jaxlib "
                             f"{CHECKED_JAXLIB})") from e


def gpu_target(name: str, hosts: int = 1, gpus_per_host: int = 8, *, use_device_config: bool = True) -> GpuTarget:
    """A :class:`GpuTarget`: compile-only devices of ``hosts`` x ``gpus_per_host`` GPUs ``name`` and their figures.

    Args:
      name: a GPU of the table with a target file: ``"h100"`` (H100 SXM; alias ``"h100-80gb"``), ``"h200"``,
        ``"b200"``, ``"a100"`` (A100 SXM 80GB; alias ``"a100-80gb"``); see :func:`target_names`.
      hosts: hosts (nodes) of the cluster; devices of host ``h`` get ``process_index == h``.
      gpus_per_host: GPUs per host (NVLink domain), 8 in DGX / HGX systems.
      use_device_config: on a machine whose JAX devices are this GPU, compile for the device's own
        ``GpuTargetConfigProto`` (exact for the installed jaxlib) instead of the shipped file.

    Returns:
      The target; ``.devices`` are ``hosts * gpus_per_host`` compile-only devices for a mesh.

    With jaxlib 0.10.2, ``"b200"`` compiles (sm_100), but XLA's Triton GEMM tiling rejects some tiny dots (e.g. a
    ``64 x 64`` weight gradient: "Couldn't find output tile sizes"); ``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false``
    (set before jax starts) sends dots to cuBLAS instead. Model-sized dots compile either way.

    Raises:
      ValueError: an unknown name, a GPU without a target file, non-positive sizes, a target file that does not
        parse (naming the field).
      ImportError / RuntimeError: the jax CUDA plugin missing, or not of jaxlib's version
        (:func:`check_cuda_plugin`), or not started (:func:`compile_only_devices`).
    """
    hosts = positive_int("hosts", hosts, " (hosts of the cluster)")
    gpus_per_host = positive_int("gpus_per_host", gpus_per_host, " (GPUs per host, e.g. 8)")
    if not isinstance(name, str) or name.lower() not in target_names():
        raise ValueError(f"gpu_target name={name!r} is not a GPU target; use one of {target_names()}")
    row = _datasheets.datasheet(name)
    check_cuda_plugin()
    config, source = None, row.target_config
    if use_device_config:
        own = [d for d in jax.devices()
               if d.platform in ("gpu", "cuda") and _datasheets.for_device_kind(d.device_kind) == row]
        if own:
            config, source = _compat.device_target_config(own), "device"
    if config is None:
        config = shipped_target_config(row.name)
    devices = compile_only_devices(config, hosts, gpus_per_host, source)
    return GpuTarget(row, hosts, gpus_per_host, config, source, devices)


__all__ = ["CHECKED_JAXLIB", "GpuTarget", "check_cuda_plugin", "compile_only_devices", "gpu_target",
           "shipped_target_config", "target_names"]
