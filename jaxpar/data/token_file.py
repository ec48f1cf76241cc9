"""Token files: a flat stream of token ids on disk (nanoGPT's ``train.bin`` / ``val.bin``), memory-mapped and served
as step-indexed global batches of windows, like :class:`jaxpar.data.CharCorpus`.

A token directory (written by ``experiments/prepare_tokens.py``, :func:`jaxpar.data.prepare.prepare`) holds
``train.bin`` and ``val.bin`` (little-endian ``uint16`` when the vocabulary has at most 65536 ids, else ``uint32``,
no header), ``meta.json`` (vocabulary size, dtype, eod id, per split its token, document and UTF-8 byte counts)
and ``tokenizer.json`` (a Hugging Face ``tokenizers`` file). Opening a split checks the file against
``meta.json``, meta.json's vocabulary fields against ``tokenizer.json``, every path against leaving the directory
and every token id against the vocabulary, so a bad file fails at once, naming itself, never inside a step.
Re-exported as ``jaxpar.data.TokenFile`` and ``jaxpar.data.TokenCorpus``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zlib
from pathlib import Path
from typing import Any, Literal

import numpy as np

from jaxpar._optional import require
from jaxpar.sharding.batches import process_slice

META = "meta.json"
TOKENIZER = "tokenizer.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}   # little-endian, as nanoGPT writes them
CHECK_CHUNK = 1 << 24   # tokens per vectorised chunk of the id check on open (32-64 MiB read at a time)


SPLIT_CODES = {"train": 0, "val": 1}   # the split's entry in the window seed (CharCorpus and TokenFile alike)


def check_window_sizes(num_tokens: int, batch_size: int, seq_len: int, what: str) -> None:
    """ValueError unless ``batch_size, seq_len >= 1`` and ``what`` (``num_tokens`` long) holds a window of
    ``seq_len + 1`` tokens with room to move (``num_tokens > seq_len + 1``)."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"need seq_len >= 1 and batch_size >= 1, got {seq_len=}, {batch_size=}")
    if num_tokens <= seq_len + 1:
        raise ValueError(f"{what} has {num_tokens} tokens, too few for seq_len {seq_len} (windows of seq_len + 1 "
                         "tokens); use more text or a shorter seq_len")


def check_draw(seed: Any, step: Any, rows: Any, batch_size: int) -> None:
    """ValueError unless ``seed`` and ``step`` are ints >= 0 and ``rows`` (None or a slice) lies in the batch."""
    for name, value in (("seed", seed), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name}={value!r} must be an int >= 0")
    if rows is None:
        return
    ok = isinstance(rows, slice) and rows.step in (None, 1)
    if not ok or not 0 <= (rows.start or 0) < (batch_size if rows.stop is None else rows.stop) <= batch_size:
        raise ValueError(f"rows={rows!r} must be a slice of contiguous rows within the batch of {batch_size} "
                         "(e.g. jp.data.process_slice(batch_size, mesh))")


def random_window_starts(seed: int, step: int, split_code: int, num_tokens: int, batch_size: int,
                         seq_len: int) -> np.ndarray:
    """int64 ``[batch_size]`` window offsets of global batch ``step``, uniform in ``[0, num_tokens - seq_len - 1)``
    from ``numpy.random.default_rng([seed, step, split_code])``: a function of these numbers only (not of the
    process count or of the batches drawn before)."""
    rng = np.random.default_rng([seed, step, split_code])
    return rng.integers(0, num_tokens - seq_len - 1, size=batch_size)


def windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """``{"inputs", "targets"}``, int32 ``[len(starts), seq_len]``: ``data[s : s + seq_len]`` and the same window
    one token later, for each start ``s`` (``data`` may be a ``numpy.memmap``: only these windows are read)."""
    window = data[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)
    return {"inputs": window[:, :-1], "targets": window[:, 1:]}


def token_dtype(vocab_size: int) -> str:
    """``"uint16"`` for a vocabulary of at most 65536 ids (nanoGPT's choice), else ``"uint32"``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``meta.json`` at ``path``, checked: ``vocab_size`` (int >= 1), ``dtype`` (``uint16``/``uint32``, wide
    enough for the vocabulary), ``eod_id`` (< vocab_size) and ``splits`` (per split ``file``, ``tokens``, ``bytes``).

    Raises:
      ValueError: unreadable JSON or a missing / inconsistent entry; the message names the file.
    """
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not a readable meta.json ({e}); prepare the directory again with "
                         "experiments/prepare_tokens.py") from None
    bad = lambda what: ValueError(f"{str(path)!r}: {what}; prepare the directory again with "
                                  "experiments/prepare_tokens.py")
    if not isinstance(meta, dict):
        raise bad(f"it holds a {type(meta).__name__}, not an object")
    vocab, dtype = meta.get("vocab_size"), meta.get("dtype")
    if not isinstance(vocab, int) or vocab < 1:
        raise bad(f"vocab_size is {vocab!r}, not an int >= 1")
    if dtype not in DTYPES:
        raise bad(f"dtype is {dtype!r}, not one of {sorted(DTYPES)}")
    if vocab > np.iinfo(DTYPES[dtype]).max + 1:
        raise bad(f"vocab_size {vocab} does not fit dtype {dtype}")
    if not isinstance(meta.get("eod_id"), int) or not 0 <= meta["eod_id"] < vocab:
        raise bad(f"eod_id is {meta.get('eod_id')!r}, not an id below vocab_size {vocab}")
    if not isinstance(meta.get("splits"), dict) or not meta["splits"]:
        raise bad("it lists no splits")
    for name, split in meta["splits"].items():
        if not (isinstance(split, dict) and isinstance(split.get("file"), str)
                and all(isinstance(split.get(k), int) and split[k] >= 0 for k in ("tokens", "bytes"))):
            raise bad(f"split {name!r} is {split!r}; it needs a file name and token and byte counts")
    return meta


def _member(directory: Path, name: str, what: str) -> Path:
    """``directory / name``, checked to stay inside ``directory`` once links are resolved: a token directory is one
    artefact, so a listed file never reads data from elsewhere (``../other/train.bin``, an absolute path, a link).

    Raises:
      ValueError: the path leaves the directory; the message names the entry and where it leads.
    """
    path = directory / name
    root, target = directory.resolve(), path.resolve()
    if not target.is_relative_to(root):
        raise ValueError(f"{what} ({name!r}) leads to {str(target)!r}, outside the token directory {str(directory)!r}: "
                         "a token directory is one artefact and its files stay inside it; copy the file into the "
                         "directory (or prepare it again with experiments/prepare_tokens.py)")
    return path


def _locate(path: Path, split: str) -> tuple[Path, Path | None, str]:
    """(the .bin file, its meta.json or None, the split name) for a token directory or a .bin file; every path
    meta.json leads to is checked to stay inside the directory (:func:`_member`)."""
    if not path.exists():
        raise ValueError(f"{str(path)!r} does not exist; pass a token directory written by "
                         "experiments/prepare_tokens.py or a .bin token file")
    if path.is_dir():
        meta = _member(path, META, META)
        if not meta.is_file():
            raise ValueError(f"{str(path)!r} holds no {META}; pass a token directory written by "
                             "experiments/prepare_tokens.py (or a .bin file with dtype= and vocab_size=)")
        splits = read_meta(meta)["splits"]
        if split not in splits:
            raise ValueError(f"{str(meta)!r} lists no split {split!r} (it has {sorted(splits)})")
        return _member(path, splits[split]["file"], f"{META}'s file of split {split!r}"), meta, split
    meta = path.parent / META
    if not meta.is_file():
        return path, None, path.stem
    meta = _member(path.parent, META, META)
    splits = read_meta(meta)["splits"]
    named = [k for k, v in splits.items() if v["file"] == path.name]
    if not named:
        files = sorted(v["file"] for v in splits.values())
        raise ValueError(f"{str(path)!r} is none of the files {str(meta)!r} lists ({files}); open one of those, or "
                         "move the file away from that meta.json")
    return _member(path.parent, path.name, f"{META}'s file of split {named[0]!r}"), meta, named[0]


def _tokenizer_bytes(directory: Path, meta: dict | None) -> bytes | None:
    """The bytes of ``tokenizer.json`` in ``directory`` (None if there is none), checked against the sha256
    ``meta`` names.

    Raises:
      ValueError: the file leaves the directory, is missing although meta.json names its ``tokenizer_sha256``, or
        its sha256 is not that one.
    """
    path = _member(directory, TOKENIZER, TOKENIZER)
    want = (meta or {}).get("tokenizer_sha256")
    if not path.is_file():
        if want is not None:   # the fields it defines could no longer be checked
            raise ValueError(f"{str(path)!r} is missing, but {META} names its sha256: the directory is incomplete; "
                             "copy it whole, or run prepare_tokens.py again")
        return None
    raw = path.read_bytes()
    if want is not None and hashlib.sha256(raw).hexdigest() != want:
        raise ValueError(f"{str(path)!r} is not the tokenizer {META} names (its sha256 differs): the directory "
                         "was prepared with another tokenizer; run prepare_tokens.py again")
    return raw


def _tokenizer_vocab(spec: dict) -> dict[str, int]:
    """Token -> id of a parsed Hugging Face ``tokenizer.json`` (its model's vocabulary and its added tokens), read
    without ``tokenizers``: its length is ``Tokenizer.get_vocab_size(with_added_tokens=True)``.

    Raises:
      ValueError: no vocabulary where a ``tokenizers`` file keeps one (``model.vocab``: a dict, or Unigram's list).
    """
    model = spec.get("model") if isinstance(spec, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        ids = dict(vocab)
    elif isinstance(vocab, list) and all(isinstance(v, list) and v for v in vocab):
        ids = {v[0]: i for i, v in enumerate(vocab)}   # Unigram: [piece, score], the id is the index
    else:
        raise ValueError("it holds no model vocabulary (model.vocab)")
    for added in spec.get("added_tokens") or []:
        ids[added["content"]] = added["id"]
    return ids


def _check_against_tokenizer(meta: dict, meta_path: Path) -> None:
    """Checks ``meta.json``'s tokenizer-derived fields against the ``tokenizer.json`` beside it (if there is one):
    ``vocab_size`` must be the tokenizer's vocabulary size and ``eod_id`` the id of ``eod_token``.

    The fields are checked against the tokenizer rather than meta.json being covered by a checksum: the tokenizer
    is already pinned by ``tokenizer_sha256``, so each field is checked against what defines it and an
    inconsistent field is named (a checksum only says that something changed, would live in a fifth file edited
    as easily, and refuses harmless edits). The token counts are checked against the files on open.

    Raises:
      ValueError: a field disagrees with the tokenizer, or tokenizer.json is unreadable (naming the files).
    """
    raw = _tokenizer_bytes(meta_path.parent, meta)
    if raw is None:
        return
    where = f"{str(meta_path.parent / TOKENIZER)!r}"
    try:
        ids = _tokenizer_vocab(json.loads(raw))
    except (ValueError, KeyError, TypeError) as e:   # JSON and UTF-8 errors are ValueErrors
        raise ValueError(f"{where} is not a readable tokenizers tokenizer.json ({e}); prepare the directory again "
                         "with experiments/prepare_tokens.py") from None
    again = "; the fields must be the tokenizer's: prepare the directory again with experiments/prepare_tokens.py"
    if meta["vocab_size"] != len(ids):
        raise ValueError(f"{str(meta_path)!r}: vocab_size {meta['vocab_size']} is not the vocabulary size "
                         f"{len(ids)} of the tokenizer {where}{again}")
    eod = meta.get("eod_token")
    if eod is None and meta.get("eod_id") is not None:
        raise ValueError(f"{str(meta_path)!r} has an eod_id ({meta['eod_id']}) but no eod_token, so the id cannot be "
                         f"checked against the tokenizer {where}{again}")
    if eod is not None and ids.get(eod) != meta["eod_id"]:
        raise ValueError(f"{str(meta_path)!r}: eod_id {meta['eod_id']} is not the id ({ids.get(eod)}) of its eod_token "
                         f"{eod!r} in the tokenizer {where}{again}")


class TokenFile:
    """One split of a token corpus: a memory-mapped stream of token ids served as step-indexed batches.

    ``TokenFile(dir, split="train")`` opens ``dir/meta.json``'s file of that split; ``TokenFile("x/val.bin")``
    opens that file (with the ``meta.json`` beside it, or ``dtype=`` and ``vocab_size=`` for a bare nanoGPT file).
    Opening reads the whole file once, in chunks of ``CHECK_CHUNK`` tokens, to check every id against the
    vocabulary (``check_ids=False`` skips it); batches then read only their windows.

    Attributes:
      path: the ``.bin`` file. split: its split name. tokens: the ``numpy.memmap`` of its ids.
      vocab_size: the vocabulary size (every id is below it). eod_id: the end-of-document id (None without
      meta.json). num_bytes: the UTF-8 bytes of the split's documents (None without meta.json). meta: the
      ``meta.json`` dict or None.

    Raises (on open, each naming the file):
      ValueError: a missing file or directory, a split meta.json does not list, a file size that is not a
        multiple of the dtype's size (truncated) or disagrees with meta.json's token count, an empty split, a
        token id >= vocab_size, a meta.json that is unreadable or inconsistent, a file of the directory
        (meta.json, a split's file, tokenizer.json) whose path leads outside it (``..``, an absolute path, a
        link), a tokenizer.json that is not the one meta.json's ``tokenizer_sha256`` names or whose vocabulary
        size / eod token id are not meta.json's ``vocab_size`` / ``eod_id``, or ``dtype=`` / ``vocab_size=``
        missing for a bare file or contradicting meta.json.
    """

    def __init__(self, path: str | os.PathLike, split: str = "train", *, dtype: str | None = None,
                 vocab_size: int | None = None, check_ids: bool = True):
        self.path, meta_path, self.split = _locate(Path(path), split)
        self.meta = read_meta(meta_path) if meta_path is not None else None
        if self.meta is not None:
            _check_against_tokenizer(self.meta, meta_path)
        self.dtype, self.vocab_size = self._dtype_and_vocab(dtype, vocab_size)
        if not self.path.is_file():
            raise ValueError(f"token file {str(self.path)!r} does not exist; prepare the directory again with "
                             "experiments/prepare_tokens.py")
        size, itemsize = self.path.stat().st_size, DTYPES[self.dtype].itemsize
        if size % itemsize:
            raise ValueError(f"{str(self.path)!r} is truncated: {size} bytes is not a multiple of the {itemsize}-byte "
                             f"{self.dtype} ids; prepare it again")
        n = size // itemsize
        if self.meta is not None and n != self.meta["splits"][self.split]["tokens"]:
            raise ValueError(f"{str(self.path)!r} holds {n} tokens but {str(meta_path)!r} says "
                             f"{self.meta['splits'][self.split]['tokens']}: the file is truncated or from another "
                             "run; prepare the directory again")
        if n == 0:
            raise ValueError(f"{str(self.path)!r} holds no tokens: the {self.split!r} split is empty; "
                             + self._empty_split_fix())
        self.tokens = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")
        if check_ids:
            self._check_ids()
        self.eod_id = self.meta["eod_id"] if self.meta is not None else None
        self.num_bytes = self.meta["splits"][self.split]["bytes"] if self.meta is not None else None
        self._tokenizer, self._epochs = None, {}

    def _empty_split_fix(self) -> str:
        if self.split == "val" and (self.meta or {}).get("val_fraction") == 0:
            return ("the directory was prepared with val_fraction 0, so every document is in 'train': open "
                    "split='train', or prepare it again with --val-fraction > 0 for a validation split")
        return "open another split, or prepare the directory again with documents in this split"

    def _dtype_and_vocab(self, dtype, vocab_size) -> tuple[str, int]:
        if self.meta is None:
            if dtype not in DTYPES or not isinstance(vocab_size, int) or vocab_size < 1:
                raise ValueError(f"{str(self.path)!r} has no {META} beside it: pass dtype= (one of {sorted(DTYPES)}) "
                                 f"and vocab_size= (got {dtype=}, {vocab_size=}), or prepare it with "
                                 "experiments/prepare_tokens.py")
            return dtype, vocab_size
        for name, given in (("dtype", dtype), ("vocab_size", vocab_size)):
            if given is not None and given != self.meta[name]:
                raise ValueError(f"{name}={given!r} contradicts {META} beside {str(self.path)!r} "
                                 f"({name} {self.meta[name]!r}); leave {name}= out")
        return self.meta["dtype"], self.meta["vocab_size"]

    def _check_ids(self) -> None:
        for start in range(0, len(self.tokens), CHECK_CHUNK):
            chunk = np.asarray(self.tokens[start:start + CHECK_CHUNK])
            if int(chunk.max()) >= self.vocab_size:
                at = start + int(np.argmax(chunk >= self.vocab_size))
                raise ValueError(f"{str(self.path)!r}: token id {int(self.tokens[at])} at position {at} is >= the "
                                 f"vocabulary size {self.vocab_size}; the file is corrupt or from another tokenizer: "
                                 "prepare it again")

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int, rows: slice | None = None, *,
              order: Literal["random", "epoch"] = "random") -> dict[str, np.ndarray]:
        """Global batch ``step``: ``{"inputs", "targets"}``, int32 ``[batch_size, seq_len]`` (this process's rows).

        ``targets`` is ``inputs`` shifted by one token. ``order="random"`` draws each window's offset uniformly as
        :meth:`jaxpar.data.CharCorpus.batch` does (``numpy.random.default_rng([seed, step, split])``);
        ``order="epoch"`` reads the ``(len - 1) // seq_len`` non-overlapping windows (offsets multiple of
        ``seq_len``) in a seeded permutation per epoch, so every token is an input once per epoch; sample ``i`` of
        the run is ``step * batch_size + i``. Both are functions of ``(seed, step)`` alone: the global batch does
        not depend on the mesh, the process count or the batches drawn before, so a resumed run needs no data
        state. ``rows`` selects this process's rows (default :func:`jaxpar.data.process_slice`); only those are
        read.

        Raises:
          ValueError: ``seq_len`` or ``batch_size`` < 1, a split too short for ``seq_len`` (naming the file), an
            unknown ``order``, a negative or non-int ``seed`` / ``step``, ``rows`` outside the batch.
        """
        check_window_sizes(len(self), batch_size, seq_len, f"{str(self.path)!r} (split {self.split!r})")
        check_draw(seed, step, rows, batch_size)
        if order == "random":
            starts = random_window_starts(seed, step, self._split_code, len(self), batch_size, seq_len)
        elif order == "epoch":
            starts = self._epoch_starts(seed, step, batch_size, seq_len)
        else:
            raise ValueError(f"order={order!r}; use 'random' (windows at random offsets) or 'epoch'")
        return windows(self.tokens, starts[rows if rows is not None else process_slice(batch_size)], seq_len)

    @property
    def _split_code(self) -> int:
        return SPLIT_CODES.get(self.split, zlib.crc32(self.split.encode()))

    def _epoch_starts(self, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
        count = (len(self) - 1) // seq_len           # non-overlapping windows of seq_len + 1 tokens (one shared)
        sample = step * batch_size + np.arange(batch_size, dtype=np.int64)
        epoch, within = np.divmod(sample, count)
        out = np.empty(batch_size, np.int64)
        for e in np.unique(epoch):
            key = (seed, int(e), seq_len)
            if key not in self._epochs:   # keep two epochs' permutations: a batch spans at most two
                if len(self._epochs) >= 2:
                    self._epochs.pop(next(iter(self._epochs)))
                self._epochs[key] = np.random.default_rng([seed, int(e), self._split_code, seq_len]).permutation(count)
            out[epoch == e] = self._epochs[key][within[epoch == e]]
        return out * seq_len

    def bits_per_byte(self, nats_per_token: float) -> float:
        """A loss in nats per token as bits per UTF-8 byte of the split's documents: ``nats / ln 2 * tokens / bytes``
        (tokens count each end-of-document token; the bytes are meta.json's), so runs with different tokenizers
        compare.

        Raises:
          ValueError: no meta.json (no byte count).
        """
        if not self.num_bytes:
            raise ValueError(f"{str(self.path)!r} has no byte count ({META}); bits per byte needs one")
        return nats_per_token / math.log(2) * len(self) / self.num_bytes

    @property
    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` of ``tokenizer.json`` beside the file (loaded on first use).

        Raises:
          ValueError: no tokenizer.json there. ImportError: ``tokenizers`` not installed (``jaxpar[data]``).
        """
        if self._tokenizer is None:
            raw = _tokenizer_bytes(self.path.parent, self.meta)
            if raw is None:
                raise ValueError(f"no {TOKENIZER} beside {str(self.path)!r}; encode/decode need the tokenizer the "
                                 "file was prepared with")
            self._tokenizer = require("tokenizers", "jp.data.TokenFile.encode/decode", "data").Tokenizer.from_str(
                raw.decode("utf-8"))
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        """``text`` as token ids (no special tokens added), through ``tokenizer.json``."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """Token ids as text, through ``tokenizer.json`` (special tokens such as the end of document kept)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class TokenCorpus:
    """The train and validation splits of a token directory, with :class:`jaxpar.data.CharCorpus`'s interface
    (``batch(..., split=)``, ``encode``, ``decode``, ``vocab_size``, ``bits_per_byte``), so a training script takes
    either.

    Attributes:
      train, val: the :class:`TokenFile` of each split.
    """

    def __init__(self, directory: str | os.PathLike, *, check_ids: bool = True):
        self.train = TokenFile(directory, "train", check_ids=check_ids)
        self.val = TokenFile(directory, "val", check_ids=check_ids)

    @property
    def vocab_size(self) -> int:
        return self.train.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.train.encode(text)

    def decode(self, ids) -> str:
        return self.train.decode(ids)

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int, split: str = "train",
              rows: slice | None = None, *, order: Literal["random", "epoch"] = "random") -> dict[str, np.ndarray]:
        """:meth:`TokenFile.batch` of the ``split`` (``"train"`` or ``"val"``)."""
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}; use 'train' or 'val'")
        return getattr(self, split).batch(seed, step, batch_size, seq_len, rows, order=order)

    def bits_per_byte(self, nats_per_token: float, split: str = "val") -> float:
        """:meth:`TokenFile.bits_per_byte` of the ``split``."""
        return getattr(self, split).bits_per_byte(nats_per_token)


__all__ = ["SPLIT_CODES", "TokenCorpus", "TokenFile", "check_window_sizes", "random_window_starts", "read_meta",
           "token_dtype", "windows"]
