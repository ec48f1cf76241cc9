"""Checkpoints over orbax: async atomic saves, restore onto any mesh, corruption checks.

One checkpoint is one step directory written by orbax's ``CheckpointManager``: orbax writes it under a
temporary name and renames it when every item and every process is done (atomic finalize), so only
complete checkpoints are ever listed; a crash mid-save leaves a temporary directory that is ignored (and
removed the next time a manager opens the directory)::

    <directory>/<step>/state/    the state pytree (orbax PyTree handler: OCDBT + zarr through tensorstore)
    <directory>/<step>/extras/   the caller's JSON dict (data position, config, ...)
    <directory>/<step>/jaxpar/   JSON: format, and per leaf its path, shape, dtype and a checksum;
                                 the implementation of every typed PRNG key

Old checkpoints beyond ``max_to_keep`` are deleted atomically too: orbax first renames the step directory
into ``<directory>/.jaxpar-trash/`` (one ``rename``, so the step leaves the listing at once; orbax's
``todelete_subdir``), and jaxpar then removes the trash once no save is in flight (before the next save,
in :meth:`~CheckpointManager.wait`, :meth:`~CheckpointManager.close`, and when a manager opens the
directory). A crash while deleting can only leave a partly removed trash directory, which nothing lists
or restores; it never leaves a half-deleted step next to the newest one. The newest checkpoint is
finalized before any old one is deleted (orbax's order), so it is complete whenever a deletion starts.

Nothing is loaded with pickle or eval: arrays are tensorstore chunks, everything else is JSON.

Typed PRNG keys (``jax.random.key``) are saved as their ``uint32`` key data
(``jax.random.key_data``) and wrapped back on restore, so the state's ``rng`` round-trips whatever orbax
version handles extended dtypes or not.

Corruption policy: a checkpoint whose files cannot be read (truncated, deleted, undecodable) or whose
restored arrays do not match the checksums recorded at save time raises :class:`CheckpointError`, naming
the step, the first bad leaf and the earlier steps that can be restored instead. There is no silent
fallback to an older step: the caller decides (``restore(step=...)``), so a resumed run never starts from
a step it did not ask for. The checksum is a position-weighted wrapping uint32 sum of each leaf's bits,
computed on the devices, so it does not depend on the mesh the state is saved from or restored onto.

Pipeline stage layouts: a ``jp.train.TrainState`` whose ``layout`` is set (params and optimizer state in an
interleaved or ZB-V schedule's stage layout, ``init_state(..., pipeline=)``) is saved in **model order**
(``jp.train.to_model_order``: a one-off permutation on the devices, an extra copy of the staged leaves while
saving), and a restore puts the arrays into the target's layout (``abstract_state(..., pipeline=)``). So a
checkpoint restores under any schedule, any ``pipe`` size and no pipeline at all; the checksums are those of
the model-order arrays.

Saving every n steps and on preemption is the training loop's: ``jaxpar.train.loop.checkpoint(manager)``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxpar._tree import key_path
from jaxpar._validate import nonnegative_int, positive_int
from jaxpar.train import carried
from jaxpar.train._jit import check_live
from jaxpar.train.step import TrainState, to_layout, to_model_order

from jaxpar._compat import orbax_state_handler

FORMAT = "jaxpar.train.checkpoint/1"
FIRST_FORMAT = "jaxpar.checkpoint/1"
"""The format before ``TrainState.carried``: each carried collection that declares an attribute was a state field of
that name. Read (its field renamed to ``carried``), never written."""
TRASH = ".jaxpar-trash"  # under the checkpoint directory: old steps renamed here, then removed (not a step name)
_MISSING = object()


class CheckpointError(ValueError):
    """A checkpoint that is missing, not a jaxpar checkpoint, unreadable or corrupted."""


# ------------------------------------------------------------------------------------------ tree helpers

def _is_key(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _key_impl(leaf: Any) -> Any:
    """The PRNG implementation of a typed key array or of its ``ShapeDtypeStruct``."""
    found = []
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), leaf)
    return found[0]


def _leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    return [(key_path(p, indexing=True), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _to_saveable(state: Any) -> tuple[Any, dict[str, str]]:
    """Replaces typed PRNG keys by their uint32 key data; returns (tree, {path: key impl name})."""
    impls: dict[str, str] = {}

    def convert(path, x):
        if _is_key(x):
            impls[key_path(path, indexing=True)] = str(_key_impl(x))
            return jax.random.key_data(x)
        return x
    return jax.tree_util.tree_map_with_path(convert, state), impls


def _key_data_struct(leaf: Any) -> jax.ShapeDtypeStruct:
    """``ShapeDtypeStruct`` of the key data of a typed key (struct or array), in a compatible sharding."""
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, sharding.spec)  # trailing key dims replicated
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def _describe(tree: Any) -> list[dict[str, Any]]:
    """[{path, shape, dtype}] of every leaf, typed keys described by their key data."""
    out = []
    for path, x in _leaves_with_paths(tree):
        if _is_key(x):
            x = _key_data_struct(x)
        out.append({"path": path, "shape": list(np.shape(x)), "dtype": str(np.dtype(x.dtype))})
    return out


# -------------------------------------------------------------------------------------------- checksums

def _bits(x: jax.Array) -> jax.Array | None:
    """The raw bits of ``x`` as uint32 (one per element; two per 64-bit element), or None if unsupported."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return None
    size = jnp.dtype(x.dtype).itemsize
    if size in (4, 8):
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32)
    return None


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """uint32 scalar: wrapping sum over elements of a mix of (bits, linear index). Layout independent."""
    bits = _bits(x)
    if bits is None:
        return jnp.zeros((), jnp.uint32)
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(bits.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d) * jnp.uint32(stride % 2 ** 32)
        stride *= bits.shape[d]
    h = bits ^ (index * jnp.uint32(0x85EBCA6B) + jnp.uint32(0x27D4EB2F))
    h = h * jnp.uint32(0xCC9E2D51)
    h = h ^ (h >> 15)
    return jnp.sum(h, dtype=jnp.uint32)


@jax.jit
def _checksums_jit(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([_leaf_checksum(x) for x in leaves])


def _checksums(tree: Any) -> list[int]:
    """One uint32 checksum per leaf of a (key-free) tree of arrays, fetched to the host.

    One jitted computation per set of devices the leaves live on (usually one: the mesh).
    """
    leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in jax.tree.leaves(tree)]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(tuple(sorted(d.id for d in x.sharding.device_set)), []).append(i)
    sums = [0] * len(leaves)
    for idx in groups.values():
        out = _checksums_jit([leaves[i] for i in idx])
        for i, v in zip(idx, np.asarray(out.addressable_data(0))):
            sums[i] = int(v)
    return sums


# --------------------------------------------------------------------------------------------- manager

def _handlers() -> dict[str, Any]:
    return {"state": orbax_state_handler(), "extras": ocp.JsonCheckpointHandler(),
            "jaxpar": ocp.JsonCheckpointHandler()}


def _layout(tree: Any) -> Any:
    """A training state's stage layout (``TrainState.layout``), None for model order or any other pytree."""
    return getattr(tree, "layout", None)


def _check_saveable(state: Any) -> None:
    """TypeError naming the first leaf that is not an array; ValueError for donated arrays."""
    for path, x in _leaves_with_paths(state):
        if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
            raise TypeError(f"state leaf {path} is a {type(x).__name__}; a checkpoint holds arrays (jax or numpy) "
                            "only: put other values in extras=")
    check_live(state)


def _check_extras(extras: Any) -> dict:
    if extras is None:
        return {}
    if not isinstance(extras, dict):
        raise TypeError(f"extras must be a dict of JSON values (e.g. {{'data_step': 100}}), "
                        f"got {type(extras).__name__}")
    try:
        json.dumps(extras, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"extras must be JSON-serialisable (str keys; str, int, float, bool, None, lists, dicts): "
                        f"{e}") from None
    return extras


class CheckpointManager:
    """Saves and restores training states (e.g. ``jp.train.TrainState``) in ``directory``, over orbax.

    Args:
      directory: where step directories go (``<directory>/<step>``); created if missing (by process 0). A
        directory without checkpoints is fine until something is restored from it.
      max_to_keep: keep this many most recent checkpoints (None: keep all).
      save_interval_steps: :meth:`should_save` is true every this many steps (0: never; ``save(...,
        force=True)`` still saves, e.g. at the end and on preemption).
      async_save: write in a background thread: :meth:`save` returns once the arrays are copied to host
        memory; :meth:`wait` blocks until the checkpoint is finalized.

    In a multi-process run every process calls every method (orbax's protocol: each process writes the
    shards it owns, process 0 writes the JSON items and finalizes after a barrier).

    Raises:
      ValueError: ``directory`` is an existing file; a negative ``max_to_keep`` or ``save_interval_steps``.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3, save_interval_steps: int = 1,
                 async_save: bool = True):
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {str(self.directory)!r} is a file; pass a directory")
        if max_to_keep is not None:
            max_to_keep = positive_int("max_to_keep", max_to_keep, " or None (keep all)")
        self.save_interval_steps = nonnegative_int("save_interval_steps", save_interval_steps,
                                                   " (0: only forced saves)")
        self._async = async_save
        if (self.directory / TRASH).exists() and not (self.directory / TRASH).is_dir():
            raise CheckpointError(f"{str(self.directory / TRASH)!r} is a file, but jaxpar needs that name for the "
                                  "directory old checkpoints are moved to before deletion: remove or rename it")
        # Leftover temporary directories of crashed saves are removed when an existing directory is opened.
        # Old steps are deleted by one atomic rename into TRASH (orbax's rmtree of a step directory in place
        # leaves a half-deleted, still listed step when the process dies during it); see _empty_trash.
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                               create=True, cleanup_tmp_directories=self.directory.is_dir(),
                                               todelete_subdir=TRASH)
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())
        self._started: set[int] = set()  # steps saved (or being saved) through this manager
        self._empty_trash()  # what a process killed while deleting left behind

    # ------------------------------------------------------------------------------------------ listing
    def all_steps(self) -> list[int]:
        """The steps of every complete (finalized) checkpoint, ascending."""
        return sorted(int(s) for s in self._mgr.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _empty_trash(self) -> None:
        """Removes the old steps orbax renamed into TRASH; call only when no save is in flight.

        Process 0 only (orbax renames on its primary host only). A kill during the removal leaves part of
        the trash, which is not a step (never listed) and is removed the next time.
        """
        trash = self.directory / TRASH
        if jax.process_index() != 0 or not trash.is_dir():
            return
        try:
            shutil.rmtree(trash)
        except FileNotFoundError:
            pass
        except OSError as e:  # only disk space is at stake: the checkpoints are intact
            warnings.warn(f"could not remove deleted checkpoints in {str(trash)!r} ({e}); remove it by hand",
                          RuntimeWarning, stacklevel=3)

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a multiple of ``save_interval_steps`` (never when it is 0)."""
        return self.save_interval_steps > 0 and step % self.save_interval_steps == 0

    # ------------------------------------------------------------------------------------------- saving
    def save(self, step: int, state: Any, extras: dict | None = None, *, force: bool = False) -> bool:
        """Starts saving ``state`` (any pytree of jax arrays, typed PRNG keys included) as checkpoint ``step``.

        Returns False without saving when ``step`` is not due (:meth:`should_save`, unless ``force``) or
        is already saved or being saved; True otherwise. Blocks until the state is computed, checksummed and
        copied to host memory (the caller may then donate its buffers); with ``async_save`` the files are
        written in the background (:meth:`wait`). A previous save still in flight is waited for first.
        Arrays keep their dtypes and global shapes; each process writes the shards it holds.

        Args:
          step: int >= 0, the number of updates ``state`` has applied.
          state: the pytree to save; a ``TrainState`` in a stage layout is written in model order.
          extras: a small JSON-able dict stored next to it (e.g. ``{"data_step": step, "config": {...}}``).
          force: save even if ``step`` is not a multiple of ``save_interval_steps``.

        Raises:
          TypeError: extras that are not a JSON-serialisable dict.
          ValueError: a negative step.
        """
        step = nonnegative_int("step", step)
        extras = _check_extras(extras)
        if not (force or self.should_save(step)) or step in self._started or step in self._mgr.all_steps():
            return False
        _check_saveable(state)
        tree, impls = _to_saveable(to_model_order(state) if _layout(state) is not None else state)
        meta = {"format": FORMAT, "step": step, "prng_keys": impls,
                "leaves": [dict(d, checksum=c) for d, c in zip(_describe(tree), _checksums(tree))]}
        self._started.add(step)   # only once the state is known good: a failed save can be retried
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(tree), extras=ocp.args.JsonSave(extras),
                                  jaxpar=ocp.args.JsonSave(meta))
        # orbax waits for the previous save anyway; waiting here first lets the steps it pushed out (renamed
        # into the trash when it was finalized) be removed before this save adds to the disk.
        self._mgr.wait_until_finished()
        self._empty_trash()
        saved = bool(self._mgr.save(step, args=args, force=True))
        if not self._async:  # finalized (and old steps trashed) already
            self._empty_trash()
        return saved

    def wait(self) -> None:
        """Blocks until every started save is finalized on disk (and old checkpoints are deleted)."""
        self._mgr.wait_until_finished()
        self._empty_trash()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        self._mgr.wait_until_finished()
        self._mgr.close()
        self._empty_trash()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------- restoring
    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(
                f"no checkpoint in {str(self.directory)!r}: it holds no complete step directories (a directory "
                "of numbered steps written by jp.checkpoint.CheckpointManager.save); check the path")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {str(self.directory)!r}; "
                                  f"available steps: {steps}")
        return int(step)

    def _others(self, step: int) -> str:
        earlier = [s for s in self.all_steps() if s < step]
        if earlier:
            return (f"; restore an earlier one with restore(step={earlier[-1]}, ...) (available: {earlier}), or "
                    f"delete {str(self.directory / str(step))!r} so that an automatic resume takes the previous one")
        return "; there is no earlier checkpoint"

    def _read_json(self, step: int, item: str) -> Any:
        try:
            return self._mgr.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]
        except Exception as e:  # orbax raises many types for missing / unreadable files
            if item == "jaxpar" and not (self.directory / str(step) / "jaxpar").exists():
                raise CheckpointError(
                    f"{str(self.directory / str(step))!r} is not a jaxpar checkpoint (it has no 'jaxpar' metadata "
                    "item); restore it with orbax directly, or point CheckpointManager at a jaxpar checkpoint "
                    "directory") from None
            raise CheckpointError(f"checkpoint step {step} in {str(self.directory)!r}: its {item!r} item cannot be "
                                  f"read ({type(e).__name__}: {e}){self._others(step)}") from e

    def metadata(self, step: int | None = None) -> dict:
        """The jaxpar metadata of a checkpoint: ``{"format", "step", "leaves": [{path, shape, dtype,
        checksum}], "prng_keys": {path: impl}}``. Raises CheckpointError as :meth:`restore`."""
        step = self._resolve(step)
        meta = self._read_json(step, "jaxpar")
        if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, FIRST_FORMAT):
            raise CheckpointError(f"checkpoint step {step} in {str(self.directory)!r} has metadata of an unknown "
                                  f"format {meta.get('format') if isinstance(meta, dict) else meta!r}; "
                                  f"expected {FORMAT!r}")
        return meta

    def restore_extras(self, step: int | None = None) -> dict:
        """The ``extras`` dict saved with checkpoint ``step`` (default: the latest).

        Raises:
          CheckpointError (a ValueError): no checkpoint, no such step, an unreadable item.
        """
        return self._read_json(self._resolve(step), "extras")

    def restore(self, step: int | None = None, *, target: Any = _MISSING) -> Any:
        """Restores checkpoint ``step`` (default: the latest) into ``target``'s structure and shardings.

        Args:
          step: the step to restore, or None for the latest.
          target: a pytree of ``jax.ShapeDtypeStruct`` (with shardings) or of arrays giving the tree
            structure, shapes, dtypes and the sharding of every leaf, usually
            ``jp.train.abstract_state(init_fn, tx, mesh=mesh, ...)`` for the *current* mesh. Required.

        Returns:
          The state, with the target's pytree types (``TrainState``, optax and jaxpar ``NamedTuple``
          states, typed PRNG keys) and every array placed directly in the target's sharding: each
          process reads only the slices its devices hold, whatever mesh the checkpoint was saved from. A
          target ``TrainState`` with a ``layout`` gets its arrays in that stage layout (the checkpoint holds
          model order), whatever schedule wrote it.

        Raises:
          TypeError: no ``target``; a target leaf that is not an array or ``ShapeDtypeStruct`` with a sharding.
          ValueError: the target differs from the checkpoint (the message names the first differing path
            and both shapes/dtypes).
          CheckpointError (a ValueError): no checkpoint, not a jaxpar checkpoint, unreadable or corrupted
            files, checksums that do not match (the message names the step and earlier usable steps).
        """
        if target is _MISSING or target is None:
            raise TypeError("restore() needs target=: the abstract state for the current mesh, e.g. "
                            "ckpt.restore(target=jp.train.abstract_state(init_fn, tx, mesh=mesh)); the "
                            "checkpoint's own layout is never used, so arrays land in the target's shardings")
        _check_target(target)
        layout = _layout(target)
        if layout is not None:   # the files hold model order: restore that, then stage it on the devices
            target = target.replace(layout=None)
        step = self._resolve(step)
        meta = self.metadata(step)
        field = self._first_format_field(step, target) if meta["format"] == FIRST_FORMAT else None
        saved = meta["leaves"] if field is None else _renamed(meta["leaves"], field, "carried")
        compare(saved, target, what=f"checkpoint step {step} in {str(self.directory)!r}")
        _check_key_impls(meta.get("prng_keys", {}), target)
        abstract = jax.tree.map(
            lambda x: _key_data_struct(x) if _is_key(x) else jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                                  sharding=x.sharding), target)
        item = abstract if field is None else _fields(abstract, {"carried": field})
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
        try:
            tree = self._mgr.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item, restore_args=restore_args)))["state"]
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} in {str(self.directory)!r} cannot be read: it is "
                                  f"truncated or corrupted ({type(e).__name__}: {e}){self._others(step)}") from e
        if field is not None:
            tree = abstract.replace(**{("carried" if k == field else k): v for k, v in tree.items()})
        _verify(saved, tree, f"checkpoint step {step} in {str(self.directory)!r}", self._others(step))
        state = jax.tree.map(lambda t, x: _wrap_key(x, t) if _is_key(t) else x, target, tree)
        return state if layout is None else to_layout(state, layout)


    def _first_format_field(self, step: int, target: Any) -> str | None:
        """The field that held a :data:`FIRST_FORMAT` checkpoint's carried state: the saved top-level field the
        target lacks that a carried collection declares as its attribute (None: the target is no ``TrainState``).

        Raises:
          CheckpointError: no such field, or several.
        """
        if not isinstance(target, TrainState):
            return None
        names = set(getattr(self._mgr.item_metadata(step)["state"], "tree", None) or ())
        found = [n for n in names - set(_fields(target, {})) if carried.by_attribute(n) is not None]
        if len(found) != 1:
            raise CheckpointError(f"checkpoint step {step} in {str(self.directory)!r} has the format {FIRST_FORMAT!r}, "
                                  f"whose carried state is one state field named by its collection's attribute; "
                                  f"found {sorted(found) or 'none'} among its fields {sorted(names)}: restore it "
                                  "with the jaxpar version that wrote it")
        return found[0]


def _fields(state: Any, rename: dict[str, str]) -> dict[str, Any]:
    """A ``TrainState``'s array fields as a dict (orbax saves a dataclass by its field names), ``rename``d."""
    return {rename.get(f.name, f.name): getattr(state, f.name) for f in dataclasses.fields(state)
            if f.metadata.get("pytree_node", True)}


def _renamed(leaves: Sequence[dict[str, Any]], old: str, new: str) -> list[dict[str, Any]]:
    """Saved leaf descriptions with the top-level field ``old`` of their paths called ``new``."""
    rename = lambda p: f".{new}{p[len(old) + 1:]}" if p == f".{old}" or p.startswith(f".{old}[") else p
    return [dict(d, path=rename(d["path"])) for d in leaves]


def _check_target(target: Any) -> None:
    for path, x in _leaves_with_paths(target):
        if not isinstance(x, (jax.ShapeDtypeStruct, jax.Array)):
            raise TypeError(f"target leaf {path} is a {type(x).__name__}; the target must hold jax.ShapeDtypeStruct "
                            "(jp.train.abstract_state) or jax arrays")
        if getattr(x, "sharding", None) is None:
            raise TypeError(f"target leaf {path} has no sharding; build the target with "
                            "jp.train.abstract_state(..., mesh=mesh) so every array knows where it goes")


def _check_key_impls(saved: dict[str, str], target: Any) -> None:
    for path, x in _leaves_with_paths(target):
        if _is_key(x) and path in saved and saved[path] != str(_key_impl(x)):
            raise ValueError(f"{path}: the checkpoint holds a {saved[path]} PRNG key, the target a "
                             f"{_key_impl(x)} key; build the target with the same PRNG implementation")


def compare(saved: Sequence[dict[str, Any]], target: Any, what: str = "checkpoint") -> None:
    """Raises ValueError naming the first path where ``target`` differs from saved leaf descriptions.

    Args:
      saved: ``[{"path", "shape", "dtype"}, ...]`` as in :meth:`CheckpointManager.metadata` ``["leaves"]``.
      target: the restore target (typed keys are compared through their key data).
      what: names the checkpoint in the message.
    """
    want = {d["path"]: (tuple(d["shape"]), d["dtype"]) for d in saved}
    got = {d["path"]: (tuple(d["shape"]), d["dtype"]) for d in _describe(target)}
    carried.check_checkpoint(set(want), set(got), what)
    for path, (shape, dtype) in got.items():
        if path not in want:
            raise ValueError(f"{what} has no leaf {path} (the target's is {shape} {dtype}); the target's tree "
                             f"structure differs from the saved one (e.g. another optimizer or model)")
        if want[path] != (shape, dtype):
            raise ValueError(f"{what} does not match the target at {path}: saved shape {want[path][0]} "
                             f"{want[path][1]}, target shape {shape} {dtype}; build the target with the "
                             "configuration that wrote the checkpoint")
    for path, (shape, dtype) in want.items():
        if path not in got:
            raise ValueError(f"{what} has a leaf {path} ({shape} {dtype}) that the target lacks; the target's "
                             "tree structure differs from the saved one (e.g. another optimizer or model)")


def _verify(saved: Sequence[dict[str, Any]], tree: Any, what: str, others: str) -> None:
    recorded = {d["path"]: d.get("checksum") for d in saved}
    for (path, _), got in zip(_leaves_with_paths(tree), _checksums(tree)):
        if recorded.get(path) is not None and recorded[path] != got:
            raise CheckpointError(f"{what} is corrupted: {path} does not match the checksum recorded when it "
                                  f"was saved ({got} != {recorded[path]}){others}")


def _wrap_key(data: jax.Array, like: Any) -> jax.Array:
    impl = _key_impl(like)
    return jax.jit(lambda d: jax.random.wrap_key_data(d, impl=impl), out_shardings=like.sharding)(data)


def restore_or_init(manager: CheckpointManager, init: Callable[[], Any], target: Callable[[], Any], *,
                    require: bool = False) -> tuple[Any, int]:
    """``(state, step)``: the latest checkpoint restored into ``target()``, else ``(init(), 0)``.

    The automatic resume of MaxText / Levanter: a job restarted in the same directory continues.

    Args:
      manager: where checkpoints live.
      init: builds a fresh state (e.g. ``lambda: jp.train.init_state(...)``); called only without a checkpoint.
      target: builds the restore target (e.g. ``lambda: jp.train.abstract_state(...)``).
      require: raise instead of initializing when there is no checkpoint (``--resume``).

    Returns:
      The state and the checkpoint's step (the number of updates it has applied; 0 when fresh).

    Raises:
      CheckpointError: ``require`` and no checkpoint; as :meth:`CheckpointManager.restore`.
    """
    step = manager.latest_step()
    if step is None:
        if require:
            raise CheckpointError(f"asked to resume, but {str(manager.directory)!r} holds no checkpoint; drop "
                                  "the resume flag to start fresh, or point at the directory of the earlier run")
        return init(), 0
    return manager.restore(step, target=target()), step


__all__ = ["CheckpointError", "CheckpointManager", "restore_or_init"]
