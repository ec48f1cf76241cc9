"""Documents from a grain pipeline, packed into fixed-length rows, as the global batches of the train step.

:func:`grain_batches` turns a ``grain.MapDataset`` of documents (1-D integer token arrays; tokenization is the
user's own ``.map``) into step-ordered global batches of packed rows::

    {"inputs", "targets", "segment_ids", "positions", "loss_mask"}    each int32 [global_batch, seq_len]

``targets`` are a document's next tokens (each document of ``n`` tokens gives ``n - 1`` input/target pairs,
shifted within the document before packing, so no target crosses into another document); ``segment_ids``
number a row's documents 1, 2, ... (0: padding), ``positions`` restart at 0 for each document, ``loss_mask``
is 1 on real targets and 0 on padding. The GPT and the Llama take these entries
(:meth:`jaxpar.models.GPT.loss`): attention stays within a document and the loss is the masked mean.

**Shards: the same global batches for any process count.** The dataset is (optionally) shuffled once,
globally, by grain (``MapDataset.shuffle(seed)``: a new permutation each epoch), repeated, and dealt into
``num_shards`` fixed shards: shard ``j`` holds documents ``j, j + S, j + 2S, ...`` (grain's slicing
``[j::S]``). Each shard is packed on its own by grain's packing transform
(``grain.experimental.FirstFitPackIterDataset``, or ``ConcatThenSplitIterDataset``) and gives ``global_batch
/ S`` consecutive rows of every global batch. A process builds the shards whose rows its devices hold
(``jp.sharding.process_batch_rows``) and places them with ``jax.make_array_from_process_local_data``. So
global batch ``t`` depends on the dataset, ``seed``, ``seq_len``, the packing and ``S`` only, never on the
number of processes or the mesh, and the union of the processes' rows is the global batch, no row twice.

**State.** :meth:`GrainBatches.get_state` is one JSON dict: the step reached and every shard's grain iterator
state (``DatasetIterator.get_state``), gathered over processes; :meth:`GrainBatches.set_state` hands each
process its shards' states. It is process-count independent: a run saved by 2 processes resumes in 1 (or on
another mesh) with the same batches. ``jp.loop.checkpoint(manager, data=batches)`` saves it in the same
(atomic) orbax checkpoint as the train state, ``jp.loop.restore_data(manager, batches, step)`` restores it.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxpar.layers.per_token import BATCH_KEYS
from jaxpar.sharding import rules as shd
from jaxpar._optional import require
from jaxpar.sharding.batches import Batches
from jaxpar._validate import nonnegative_int, positive_int

FORMAT = "jaxpar.grain_batches/1"
PACKINGS = ("first_fit", "concat_then_split")
KEYS = BATCH_KEYS


def _grain():
    return require("grain", "jp.data.grain_batches", extra="data")


class _Pairs:
    """A document (1-D integer tokens) -> ``{"inputs": doc[:-1], "targets": doc[1:]}`` (int32), checked."""

    def __init__(self, seq_len: int, split: bool):
        self.seq_len, self.split = seq_len, split

    def __call__(self, doc: Any) -> dict[str, np.ndarray]:
        doc = np.asarray(doc)
        if doc.ndim != 1 or not np.issubdtype(doc.dtype, np.integer):
            raise ValueError(f"grain_batches: a document is an array of shape {doc.shape} and dtype {doc.dtype}; "
                             "documents must be 1-D integer token ids (tokenize in a .map of the dataset)")
        if len(doc) < 2:
            raise ValueError(f"grain_batches: a document has {len(doc)} token(s); each needs at least 2 (an input "
                             "and its target): drop short documents with .filter(lambda d: len(d) >= 2)")
        if not self.split and len(doc) - 1 > self.seq_len:
            raise ValueError(f"grain_batches: a document of {len(doc)} tokens ({len(doc) - 1} input/target pairs) is "
                             f"longer than a row (seq_len={self.seq_len}), and packing='first_fit' never splits a "
                             "document: use packing='concat_then_split', a larger seq_len, or cut documents in a .map")
        if doc.min() < 0 or doc.max() >= 2 ** 31:
            raise ValueError(f"grain_batches: a document holds token id {int(doc.min() if doc.min() < 0 else doc.max())}"
                             "; token ids must lie in [0, 2**31) (int32)")
        doc = doc.astype(np.int32)
        return {"inputs": doc[:-1], "targets": doc[1:]}


def _rows(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """grain's packed element (``inputs``, ``inputs_segment_ids``, ...) -> this module's row entries."""
    segment_ids = np.asarray(packed["inputs_segment_ids"], np.int32)
    return {"inputs": np.asarray(packed["inputs"], np.int32), "targets": np.asarray(packed["targets"], np.int32),
            "segment_ids": segment_ids, "positions": np.asarray(packed["inputs_positions"], np.int32),
            "loss_mask": (segment_ids > 0).astype(np.int32)}


def _allgather_json(value: Any) -> list[Any]:
    """Every process's JSON value, in process order (a collective: all processes call it together)."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    every = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(every[p, :int(n)]).decode()) for p, n in enumerate(sizes)]


class GrainBatches:
    """Step-ordered global batches of packed documents from a grain pipeline (see :func:`grain_batches`).

    ``batches(t)`` (or ``next(batches)``) returns global batch ``t``: a dict of :data:`KEYS` to int32
    ``jax.Array`` s of shape ``[global_batch, seq_len]``, sharded over the rules' batch axes. Batches come in
    order: ``t`` must be :attr:`step`, the number of batches taken (restore a state to start elsewhere). With
    ``num_epochs`` set, iterating ends after the batch that serves the last document (the rows of shards that
    ran out before it are padding, loss mask 0).

    Attributes:
      step: the index of the next batch.
      config: what the batches depend on (saved in the state and compared on restore).
      shards: the shard indices this process builds.
    """

    def __init__(self, dataset: Any, *, global_batch: int, mesh: Mesh, rules: shd.Rules, seed: int, seq_len: int,
                 packing: str, num_packing_bins: int, num_shards: int, shuffle: bool, num_epochs: int | None,
                 read_options: Any = None):
        grain = _grain()
        # default: no reader threads; each shard is read in the calling thread (faster here than grain's 16
        # threads a shard, and one thread instead of 16 x num_shards)
        self._read_options = read_options or grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        self.config = {"global_batch": global_batch, "seq_len": seq_len, "num_shards": num_shards, "seed": seed,
                       "packing": packing, "num_packing_bins": num_packing_bins, "shuffle": shuffle,
                       "num_epochs": num_epochs, "dataset_len": len(dataset)}
        self._batches = Batches(mesh, rules)
        self.rows_per_shard = global_batch // num_shards
        rows = shd.process_batch_rows(global_batch, mesh, rules)
        if rows.start % self.rows_per_shard or rows.stop % self.rows_per_shard:
            raise ValueError(f"this process holds rows {rows.start}..{rows.stop - 1} of the global batch, which do not "
                             f"fall on whole shards of {self.rows_per_shard} rows (num_shards={num_shards}); use a "
                             "num_shards that is a multiple of the number of processes")
        self.shards = range(rows.start // self.rows_per_shard, rows.stop // self.rows_per_shard)
        docs = dataset.shuffle(seed=seed) if shuffle else dataset
        docs = docs.repeat(num_epochs)
        pairs = _Pairs(seq_len, split=packing == "concat_then_split")
        self._packed = [self._pack(grain, docs[j::num_shards].map(pairs), j) for j in self.shards]
        self._iters = [iter(packed) for packed in self._packed]
        self.step = 0

    def _pack(self, grain: Any, pairs: Any, shard: int) -> Any:
        c = self.config
        lengths = {"inputs": c["seq_len"], "targets": c["seq_len"]}
        if c["packing"] == "concat_then_split":
            packed = grain.experimental.ConcatThenSplitIterDataset(pairs.to_iter_dataset(self._read_options),
                                                                   length_struct=lengths)
        else:   # grain shuffles a flush of bins with this seed: per shard, a function of (seed, shard) only
            packed = grain.experimental.FirstFitPackIterDataset(
                pairs.to_iter_dataset(self._read_options), length_struct=lengths,
                num_packing_bins=c["num_packing_bins"],
                seed=int(np.random.default_rng([c["seed"], shard]).integers(2 ** 31)))
        return packed.map(_rows)

    def local_batch(self) -> dict[str, np.ndarray]:
        """This process's rows of the next global batch (numpy, int32); advances :attr:`step`.

        Raises:
          ValueError: a finite pass (``num_epochs``) has served every row already.
        """
        batch = self._take()
        if batch is None:
            raise ValueError(f"grain_batches ran out of documents at batch {self.step}: the pass over num_epochs="
                             f"{self.config['num_epochs']} served every document in batches 0..{self.step - 1}; stop "
                             f"the loop at {self.step} (or iterate: next() ends it), or pass num_epochs=None to repeat "
                             "the data")
        return batch

    def _take(self) -> dict[str, np.ndarray] | None:
        """This process's rows of the next global batch, advancing :attr:`step`: ``rows_per_shard`` rows of each
        of its shards, a shard that has run out giving padding rows (all 0, loss mask 0); None when a finite pass
        is over: no shard of any process has a row left. Every process takes part (a collective, for finite
        passes only), so all agree on the batch that ends the pass."""
        rows, real = [], False
        for it in self._iters:
            for _ in range(self.rows_per_shard):
                row = next(it, None)
                real |= row is not None
                rows.append(self._padding if row is None else row)
        if self.config["num_epochs"] is not None and not any(_allgather_json(real)):
            return None
        self.step += 1
        return {k: np.stack([r[k] for r in rows]) for k in KEYS}

    @property
    def _padding(self) -> dict[str, np.ndarray]:
        return {k: np.zeros(self.config["seq_len"], np.int32) for k in KEYS}

    def __call__(self, step: int) -> dict[str, jax.Array]:
        """Global batch ``step`` (must be :attr:`step`: the batches come in order).

        Raises:
          ValueError: ``step`` is not the next batch's index, or a finite pass (``num_epochs``) has ended.
        """
        if nonnegative_int("step", step) != self.step:
            raise ValueError(f"grain batches come in order: asked for batch {step}, the next one is {self.step}; "
                             "to resume at a checkpoint, restore the data state with jp.loop.restore_data(manager, "
                             "batches, step) (or batches.set_state(...)) first")
        return self._batches.place(self.local_batch())

    def __iter__(self) -> "GrainBatches":
        return self

    def __next__(self) -> dict[str, jax.Array]:
        """The next global batch; StopIteration when a finite pass (``num_epochs``) has served every row."""
        batch = self._take()
        if batch is None:
            raise StopIteration
        return self._batches.place(batch)

    def get_state(self) -> dict:
        """``{"format", "step", "config", "shards": [state of shard 0, ..., shard S-1]}``, JSON-able.

        A collective in a multi-process run (every process calls it at the same step): each process's shard
        states are gathered, so the state holds every shard whatever the number of processes.
        """
        mine = {str(j): it.get_state() for j, it in zip(self.shards, self._iters)}
        shards: dict[str, Any] = {}
        for part in _allgather_json(mine):
            shards.update(part)
        return {"format": FORMAT, "step": self.step, "config": dict(self.config),
                "shards": [shards[str(j)] for j in range(self.config["num_shards"])]}

    def set_state(self, state: dict) -> None:
        """Continues from a state of :meth:`get_state` (saved by any number of processes).

        The whole state is checked before any of it is applied: its format, the pipeline's settings, the step and
        every shard's state, those of the shards other processes build too (each must have the fields and value
        types of this pipeline's shard states), so every process refuses the same state. The shard states are
        then set on new iterators, which replace the current ones only once every shard took its state: a refused
        state changes nothing (neither the shards nor :attr:`step`).

        Raises:
          ValueError: not such a state, one of another pipeline (naming the first setting that differs), or a
            shard state that is not one of this pipeline's (naming the shard and the field) or that grain refuses.
        """
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a grain_batches state (format {got!r}, expected {FORMAT!r}): pass what "
                             "GrainBatches.get_state() returned")
        saved = state.get("config", {})
        for key, value in self.config.items():
            if saved.get(key) != value:
                raise ValueError(f"the restored data state is of another pipeline: its {key} is {saved.get(key)!r}, "
                                 f"this pipeline's is {value!r}; build grain_batches with the settings (and dataset) "
                                 "of the run that saved it")
        shards, step = state.get("shards"), nonnegative_int("state['step']", state.get("step"))
        if not isinstance(shards, list) or len(shards) != self.config["num_shards"]:
            raise ValueError(f"the restored data state holds {len(shards) if isinstance(shards, list) else shards!r} "
                             f"shard states; this pipeline has num_shards={self.config['num_shards']}")
        shards = [_tuples(shard) for shard in shards]
        template = self._iters[0].get_state()
        for j, shard in enumerate(shards):
            _check_like(shard, template, f"shard {j}", "")
        fresh = [iter(packed) for packed in self._packed]
        for j, it in zip(self.shards, fresh):
            try:
                it.set_state(shards[j])
            except Exception as e:  # grain's own error types (KeyError, IndexError, ...) for a state it cannot take
                raise ValueError(f"the restored data state's shard {j} is refused by grain ({type(e).__name__}: {e}); "
                                 "pass a state GrainBatches.get_state() returned for this pipeline") from e
        self._iters, self.step = fresh, step


def _check_like(value: Any, template: Any, shard: str, field: str) -> None:
    """ValueError unless ``value`` has ``template``'s structure: the same dict keys, sequences of the same length,
    leaves of the same type (an int is never a bool), no int below -1; the message names ``shard`` and the field.
    Values within those bounds are left to grain (a count far beyond the data makes its ``set_state`` replay that
    many elements)."""
    def bad(what: str) -> ValueError:
        return ValueError(f"the restored data state's {shard} is not a shard state of this pipeline: {what}; pass "
                          "a state GrainBatches.get_state() returned for this pipeline")
    where = f"field {field!r}" if field else "the shard state"
    if isinstance(template, dict):
        if not isinstance(value, dict):
            raise bad(f"{where} is {value!r:.80} of type {type(value).__name__}, expected a dict with fields "
                      f"{list(template)}")
        extra = [key for key in value if key not in template]
        for key in [*template, *extra]:
            name = f"{field}.{key}" if field else str(key)
            if key not in value or key not in template:
                raise bad(f"field {name!r} is {'missing' if key not in value else 'unknown'} ({where} has "
                          f"{list(value)}, expected {list(template)})")
            _check_like(value[key], template[key], shard, name)
    elif isinstance(template, (tuple, list)):
        if not isinstance(value, (tuple, list)) or len(value) != len(template):
            raise bad(f"{where} is {value!r:.80}, expected a sequence of {len(template)} values")
        for i, (v, t) in enumerate(zip(value, template)):
            _check_like(v, t, shard, f"{field}[{i}]")
    elif isinstance(value, bool) != isinstance(template, bool) or not isinstance(value, type(template)):
        raise bad(f"{where} is {value!r:.80} of type {type(value).__name__}, expected type {type(template).__name__}")
    elif isinstance(value, int) and not isinstance(value, bool) and value < -1:   # -1: grain's "none" marker
        raise bad(f"{where} is {value}: grain's positions and counts are never below -1")


def _tuples(state: Any) -> Any:
    """A shard state after a JSON round trip with its 2-element lists as the tuples grain wrote: grain's
    ConcatThenSplitIterDataset compares its ``remainder_slices`` marker with ``(-1, -1)``, so a list would silently
    skip the rest of a split document on resume."""
    if isinstance(state, dict):
        return {k: _tuples(v) for k, v in state.items()}
    if isinstance(state, list):
        items = [_tuples(v) for v in state]
        return tuple(items) if len(items) == 2 and all(isinstance(v, int) for v in items) else items
    return state


def grain_batches(dataset: Any, *, global_batch: int, mesh: Mesh, rules: shd.Rules = shd.DEFAULT_RULES, seed: int,
                  seq_len: int, packing: str = "first_fit", num_packing_bins: int = 8, num_shards: int | None = None,
                  shuffle: bool = True, num_epochs: int | None = None, read_options: Any = None) -> GrainBatches:
    """Global batches of packed documents from a grain ``MapDataset``, one process's share built per process.

    Args:
      dataset: a ``grain.MapDataset`` whose elements are documents: 1-D integer token-id arrays of at least 2
        tokens (tokenize on the fly with ``.map``). Random access is what lets every process build its own
        shards and resume on any number of processes; an ``IterDataset`` is refused (pass the ``MapDataset``
        before ``.to_iter_dataset()``).
      global_batch: rows of a global batch (all processes together).
      mesh, rules: the mesh and logical rules of the train step; the rows go over the rules' batch axes.
      seed: seeds the global document shuffle (grain's, one permutation per epoch) and the bin shuffles.
      seq_len: the row length ``L`` (input/target pairs per row).
      packing: ``"first_fit"`` (grain's ``FirstFitPackIterDataset``: whole documents into the first of
        ``num_packing_bins`` rows with room, the rest padded; a document longer than a row is an error) or
        ``"concat_then_split"`` (grain's ``ConcatThenSplitIterDataset``: documents back to back, split at row
        ends, positions restarting in each row; no padding).
      num_packing_bins: rows first-fit packs at once per shard (more: less padding, more documents held).
      num_shards: the fixed number of shards ``S`` (default ``global_batch``); it must divide ``global_batch``
        and be a multiple of the processes' row blocks. A state resumes on any process count whose row blocks
        fall on whole shards (e.g. any count dividing ``S``).
      shuffle: shuffle the documents (globally, by ``seed``) before dealing them to shards.
      num_epochs: passes over the dataset (None: endless). A finite pass serves every document's input/target
        pairs exactly ``num_epochs`` times: once a shard has run out its rows are padding (all 0, loss mask 0) until
        every shard has, then iteration ends (``next`` raises StopIteration; ``batches(t)`` past the end raises
        ValueError). The processes of a multi-process run agree on the last batch with one small all-gather of a
        flag per batch (finite passes only).
      read_options: a ``grain.ReadOptions`` for reading each shard (default: ``num_threads=0``, read in the
        calling thread, the fastest here for a cheap ``.map``; threads help a ``.map`` that releases the GIL).
        It does not change the batches.

    Returns:
      A :class:`GrainBatches`: ``batches(t)`` / ``next(batches)`` give the global batches in order;
      ``get_state`` / ``set_state`` (JSON) resume them exactly.

    Raises:
      TypeError: ``dataset`` is not a ``grain.MapDataset``; ``read_options`` not a ``grain.ReadOptions``.
      ValueError: ``global_batch`` not divisible by ``num_shards`` or by the mesh's batch axes; this process's
        rows not on whole shards; an unknown ``packing``; non-positive sizes. While iterating: a document that
        is not 1-D integers, shorter than 2 tokens, or (first_fit) longer than ``seq_len + 1``; a batch asked for
        after a finite pass ended.
      ImportError: grain is not installed (``pip install 'jaxpar[data]'``).
    """
    grain = _grain()
    if isinstance(dataset, grain.IterDataset):
        raise TypeError("grain_batches needs a grain.MapDataset (random access: each process builds its own shards "
                        "and a state resumes on any process count); got an IterDataset: pass the MapDataset before "
                        ".to_iter_dataset()")
    if not isinstance(dataset, grain.MapDataset):
        raise TypeError(f"grain_batches needs a grain.MapDataset of documents, got {type(dataset).__name__}: wrap "
                        "a sequence with grain.MapDataset.source(documents)")
    global_batch = positive_int("global_batch", global_batch)
    seq_len = positive_int("seq_len", seq_len)
    num_packing_bins = positive_int("num_packing_bins", num_packing_bins)
    num_shards = global_batch if num_shards is None else positive_int("num_shards", num_shards)
    nonnegative_int("seed", seed)
    if num_epochs is not None:
        positive_int("num_epochs", num_epochs, " or None (endless)")
    if read_options is not None and not isinstance(read_options, grain.ReadOptions):
        raise TypeError(f"read_options must be a grain.ReadOptions or None, got {type(read_options).__name__}")
    if packing not in PACKINGS:
        raise ValueError(f"packing={packing!r}; use one of {list(PACKINGS)}")
    if global_batch % num_shards:
        raise ValueError(f"global_batch={global_batch} is not divisible by num_shards={num_shards}: every shard gives "
                         "the same number of rows per batch; pick num_shards dividing global_batch")
    if len(dataset) == 0:
        raise ValueError("grain_batches: the dataset is empty; pass a MapDataset with at least one document")
    return GrainBatches(dataset, global_batch=global_batch, mesh=mesh, rules=rules, seed=seed, seq_len=seq_len,
                        packing=packing, num_packing_bins=num_packing_bins, num_shards=num_shards, shuffle=shuffle,
                        num_epochs=num_epochs, read_options=read_options)


__all__ = ["GrainBatches", "grain_batches"]
