"""Version workarounds: every place jaxpar depends on a JAX or orbax version, or on a private module.

jaxpar supports jax 0.10 (CPU machines) and 0.11 (the GPU machine) with orbax-checkpoint 0.12. Each
function here names the version it works around and what to do once that version is no longer
supported, so dropping a version is reading this file, not searching the code base. Nothing else in
jaxpar reads ``jax._src`` or a private Flax function, or branches on a version. This module imports no part of
jaxpar: the rooms build on it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

try:  # private: JAX's cluster auto-detection (SLURM, Open MPI, TPU, k8s); see cluster_detected
    from jax._src import clusters as _clusters
except ImportError:  # a JAX that moved it
    _clusters = None

# The environment variables the common cluster managers set, for a JAX without ``jax._src.clusters``.
_CLUSTER_VARIABLES = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES")


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes that ``x`` (a value traced inside ``jax.shard_map``) varies over.

    jax 0.10 keeps them in ``jax.typeof(x).mat.varying`` (a ``ManualAxisType``); jax 0.11 in
    ``jax.typeof(x).vma``. Outside ``shard_map`` the set is empty.

    When jax 0.10 is dropped: read ``jax.typeof(x).vma`` directly and delete this function.
    """
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _is_16bit_float(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32


def psum_16bit_safe(x: jax.Array, axis_name: str) -> jax.Array:
    """``jax.lax.psum(x, axis_name)`` inside ``shard_map``, taken in float32 for 16-bit floats.

    XLA:CPU's all-reduce promotion aborts the process on a ``psum`` of bfloat16/float16 values inside
    ``shard_map`` (jax 0.10.2, CPU). The float32 sum is rounded back to ``x``'s dtype, so the result is
    exact wherever one device holds the value and the others zeros (how the pipeline uses it); a sum of
    several non-zero 16-bit terms rounds once instead of at every step.

    When jax 0.10 is dropped (and a 16-bit ``psum`` runs on XLA:CPU): use ``jax.lax.psum`` directly.
    """
    if _is_16bit_float(x):
        return jax.lax.psum(x.astype(jnp.float32), axis_name).astype(x.dtype)
    return jax.lax.psum(x, axis_name)


def vary_16bit_safe(x: jax.Array, axes: Any) -> jax.Array:
    """``x`` made varying over the manual mesh ``axes`` it does not vary over yet (``jax.lax.pcast(...,
    to='varying')``), so that its gradient's sum over them (pcast's transpose, a ``psum``) runs in float32 when
    ``x`` is a 16-bit float; other dtypes, and ``x`` already varying over ``axes``, pass unchanged.

    Inside a ``jax.shard_map`` manual over some mesh axes and automatic over others, jax (0.10.2) lowers every
    reduction's reducer with a sharding constraint around its ``add`` (``lower_with_sharding_in_types``: the
    mesh is neither all manual nor all automatic), which XLA turns into a ``copy``; XLA:CPU's all-reduce
    promotion of 16-bit floats rebuilds the reducer as a binary op and aborts the process on that ``copy``
    ("Invalid binary instruction opcode copy"). The implicit ``pvary`` jax inserts where a replicated 16-bit
    value meets a varying one transposes to exactly such a ``psum``; this one is float32 (the value round-trips
    through float32 exactly, the sum rounds once).

    When jax 0.10 is dropped (and a 16-bit ``psum`` inside a partial-manual ``shard_map`` runs on XLA:CPU):
    return ``x`` (jax inserts the cast where it is needed) and delete this function.
    """
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing or not _is_16bit_float(x):
        return x
    return jax.lax.pcast(x.astype(jnp.float32), missing, to="varying").astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_with_f32_transpose(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return jax.lax.all_gather(x, axes, tiled=True)


def _gather_fwd(x, axes):
    return jax.lax.all_gather(x, axes, tiled=True), None


def _gather_bwd(axes, _, ct):
    summed = jax.lax.psum_scatter(ct.astype(jnp.float32), axes, scatter_dimension=0, tiled=True)
    return (summed.astype(ct.dtype),)


_gather_with_f32_transpose.defvjp(_gather_fwd, _gather_bwd)


def all_gather_16bit_safe(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``jax.lax.all_gather(x, axes, tiled=True)`` inside ``jax.shard_map`` whose transpose (the gradient's
    ``psum_scatter``) sums in float32 when ``x`` is a 16-bit float; the gather itself moves ``x``'s dtype.

    The reason and the retirement are :func:`vary_16bit_safe`'s (a 16-bit reduce-scatter's reducer there aborts
    XLA:CPU the same way). When jax 0.10 is dropped: call ``jax.lax.all_gather`` and delete this function.
    """
    if not _is_16bit_float(x):
        return jax.lax.all_gather(x, axes, tiled=True)
    return _gather_with_f32_transpose(x, tuple(axes))


def gathers_fsdp_weights() -> bool:
    """Whether the train and eval steps gather FSDP-sharded weights (each param's spec without ``fsdp``: FSDP's
    weight all-gather, whose transpose is the gradient reduce-scatter) where a loss starts that declares no
    activation constraints: True while the oldest supported jax needs it.

    XLA's SPMD partitioner (jax and jaxlib 0.10.2, CPU; Shardy and GSPMD alike) computes wrong gradients for a
    model whose activations carry no sharding constraints when its params are sharded over ``fsdp`` and
    ``tensor`` and the batch over ``('data', 'fsdp')``: on data=2 x fsdp=2 x tensor=2, ``x + tanh(x @ up)``
    then ``sum(sin(x @ W))`` with ``up [64, 64]`` and ``W [64, 256]`` on ``P('fsdp', 'tensor')`` and ``x [16, 64]``
    on ``P(('data', 'fsdp'))`` gives ``up``'s and ``x``'s gradients 50-90% off for normal random values: the
    compiled program swaps batch shards between devices 2 and 4, 3 and 5 by collective-permutes and never swaps
    them back. Other mesh shapes are exact, and so is the same program with the hidden activation's batch
    dimension constrained, or with every param gathered over ``fsdp`` first. The train and eval steps gather
    (:func:`jaxpar.train.grads.with_weight_gather`) unless the model declares ``shards_activations``.

    When the oldest supported jax computes ``tests/test_train.py``'s unconstrained model exactly without it (its
    test records the unguarded error): return False (the steps' ``gather_weights`` then defaults off), then
    delete this function and the gather.
    """
    return True


@contextlib.contextmanager
def flax_spmd_hooks(resolve: Callable, constrain: Callable):
    """Inside, Flax's resolution of logical names and its logical constraint of one value go through hooks:
    ``flax.linen.spmd._logical_to_mesh_axes(names, rules)`` (behind ``nn.logical_to_mesh_axes`` and every
    logical constraint) calls ``resolve(original, names, rules)``, and
    ``flax.linen.spmd._with_sharding_constraint_one_fallback(axis_resources, x, ...)`` calls
    ``constrain(original, axis_resources, x, ...)``. Flax's functions are restored when the outermost such
    context exits (in any thread); while one is open they are replaced for every thread, so the hooks must
    delegate unchanged where their thread is not auditing. One pair of hooks at a time: a nested entry keeps
    the outer pair.

    Flax 0.12 (flax.linen.spmd) offers no public hook into logical-name resolution; jaxpar's activation audit
    (:func:`jaxpar.sharding.params.record_unknown_names`) needs one. When Flax offers one (or the audit reads
    names another way): use it and delete this function.
    """
    from flax.linen import spmd
    global _flax_hook_depth
    with _flax_hook_lock:
        if _flax_hook_depth == 0:
            _flax_originals[:] = [spmd._logical_to_mesh_axes, spmd._with_sharding_constraint_one_fallback]
            spmd._logical_to_mesh_axes = functools.partial(resolve, _flax_originals[0])
            spmd._with_sharding_constraint_one_fallback = functools.partial(constrain, _flax_originals[1])
        _flax_hook_depth += 1
    try:
        yield
    finally:
        with _flax_hook_lock:
            _flax_hook_depth -= 1
            if _flax_hook_depth == 0:
                spmd._logical_to_mesh_axes, spmd._with_sharding_constraint_one_fallback = _flax_originals


_flax_hook_lock = threading.Lock()
_flax_hook_depth = 0
_flax_originals: list[Callable] = []


def cluster_detected() -> bool:
    """Whether JAX's own cluster auto-detection would find a cluster in this process's environment.

    JAX exposes no public probe for what ``jax.distributed.initialize()`` would detect; its detectors live
    in the private ``jax._src.clusters`` (jax 0.10 and 0.11: ``ClusterEnv._cluster_types``, each with
    ``opt_in_only_method`` and ``is_env_present()``). A JAX that moves or changes them falls back to the
    variables SLURM, Open MPI and Cloud TPU set. ``JAX_COORDINATOR_ADDRESS`` counts as a cluster.

    When JAX offers a public detection API: use it and delete this function.
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    try:
        return any(not env.opt_in_only_method and env.is_env_present() for env in _clusters.ClusterEnv._cluster_types)
    except Exception:  # noqa: BLE001  (no _clusters, or another internal layout: use the common variables)
        return any(v in os.environ for v in _CLUSTER_VARIABLES)


def backends_initialized() -> bool:
    """Whether JAX's backends (its XLA clients) have started, after which ``XLA_FLAGS`` is no longer read.

    JAX has no public probe; ``jax._src.xla_bridge.backends_are_initialized()`` (jax 0.10 and 0.11) is what
    ``jax.distributed.initialize`` itself checks. A JAX without it is reported as not initialized (the
    caller's flags then may not take effect, and nothing warns).

    When JAX offers a public probe: use it and delete this function.
    """
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


def orbax_state_handler() -> ocp.PyTreeCheckpointHandler:
    """orbax's PyTree handler with replica-parallel array saving turned off, where orbax has the option.

    Replica-parallel saving (orbax-checkpoint 0.12's default) slices every replicated shard with a jitted
    op per shape: about 70 XLA compiles, ~6 s on CPU, for a small GPT's first save. One replica writing
    each shard is enough here. The option goes in through a type-handler registry
    (``ocp.type_handlers.create_type_handler_registry`` with ``ArrayHandler(use_replica_parallel=False)``,
    orbax-checkpoint 0.12); an orbax without these names or arguments gets its default handler, which
    writes the same checkpoint, only slower.

    The fallback is for an orbax-checkpoint without ``ArrayHandler(use_replica_parallel=...)`` (releases
    before the 0.12 series jaxpar is tested with, or a later one that drops the option). When the
    supported orbax versions all have it: remove the fallback; if orbax's default stops being
    replica-parallel: return ``ocp.PyTreeCheckpointHandler()`` and delete this function.
    """
    try:
        th = ocp.type_handlers
        registry = th.create_type_handler_registry(
            (int, th.ScalarHandler()), (float, th.ScalarHandler()), (np.number, th.ScalarHandler()),
            (np.ndarray, th.NumpyHandler()), (jax.Array, th.ArrayHandler(use_replica_parallel=False)))
        return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
    except (AttributeError, TypeError):  # an orbax without these options: its defaults work, only slower
        return ocp.PyTreeCheckpointHandler()


def device_target_config(devices: list) -> str:
    """The XLA ``GpuTargetConfigProto`` text of real GPU ``devices``: the exact description the installed jaxlib
    compiles for (``jax._src.lib.xla_client.get_topology_for_devices(devices).target_config``, jaxlib 0.10 and
    0.11), so a compile for a topology of these GPUs matches them.

    When JAX exposes a device's target config publicly: use that and delete this function.

    Raises:
      RuntimeError: this jaxlib has no such call, or the devices' topology has no target config.
    """
    try:
        from jax._src.lib import xla_client
        config = xla_client.get_topology_for_devices(list(devices)).target_config
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"this jaxlib ({jax.__version__}) cannot read the GPU's target config ({e}); use "
                           "a shipped target (jp.plan.gpu_target(name, use_device_config=False))") from e
    return config.decode() if isinstance(config, bytes) else str(config)
