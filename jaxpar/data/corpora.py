"""Data: a character-level text corpus, token files (:class:`TokenFile`, prepared by ``jaxpar.data.prepare``) and
scikit-learn's digits, served as step-indexed global batches.

``batch = f(seed, step)``: the same seed and step always give the same global batch, whatever the mesh or
the number of processes, so a resumed run sees exactly the data it would have seen. Each process builds only
its own rows of the global batch (``process_slice``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np

from jaxpar._optional import require
from jaxpar.sharding.batches import process_slice
from jaxpar.data.grain_pipeline import GrainBatches, grain_batches  # noqa: F401 (grain pipelines: jaxpar/data/grain_pipeline.py)
from jaxpar.data.token_file import SPLIT_CODES, TokenCorpus, TokenFile, check_window_sizes, random_window_starts, windows


def default_text() -> str:
    """CPython's own ``pydoc_data.topics`` help text (about 465k characters of English), sorted by topic."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def load_text(path: str | os.PathLike | None = None) -> str:
    """The default corpus, or a UTF-8 text file.

    Raises:
      ValueError: a missing path, a directory, an empty file, or a binary / non-UTF-8 file.
    """
    if path is None:
        return default_text()
    p = Path(path)
    if not p.exists():
        raise ValueError(f"text file {str(p)!r} does not exist; pass a UTF-8 text file or omit it for the default")
    if not p.is_file():
        raise ValueError(f"{str(p)!r} is not a file; pass a UTF-8 text file")
    raw = p.read_bytes()
    if not raw.strip():
        raise ValueError(f"text file {str(p)!r} is empty; pass a file with some text")
    if b"\x00" in raw:
        raise ValueError(f"{str(p)!r} looks binary (it holds NUL bytes); pass a UTF-8 text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start}); pass a UTF-8 text file") from None


@dataclasses.dataclass(frozen=True)
class CharCorpus:
    """A character-level corpus with a train/validation split.

    Attributes:
      chars: the vocabulary, sorted; token id ``i`` is ``chars[i]``.
      train: int32 token ids of the training part.
      val: int32 token ids of the validation part (the last ``val_fraction`` of the text).
    """
    chars: str
    train: np.ndarray
    val: np.ndarray

    @classmethod
    def from_text(cls, text: str, val_fraction: float = 0.1) -> "CharCorpus":
        if not text:
            raise ValueError("text is empty")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must lie in (0, 1)")
        chars = "".join(sorted(set(text)))
        lookup = {c: i for i, c in enumerate(chars)}
        ids = np.fromiter((lookup[c] for c in text), dtype=np.int32, count=len(text))
        cut = int(len(ids) * (1.0 - val_fraction))
        return cls(chars, ids[:cut], ids[cut:])

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, val_fraction: float = 0.1) -> "CharCorpus":
        return cls.from_text(load_text(path), val_fraction)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        lookup = {c: i for i, c in enumerate(self.chars)}
        return [lookup[c] for c in text if c in lookup]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int, split: str = "train",
              rows: slice | None = None) -> dict[str, np.ndarray]:
        """Global batch ``step`` of random windows: ``{"inputs", "targets"}``, int32 ``[batch_size, seq_len]``.

        ``targets`` is ``inputs`` shifted by one character. ``rows`` selects this process's rows (default
        :func:`process_slice`); the window offsets are drawn for the whole global batch from
        ``numpy.random.default_rng([seed, step, split])`` so they do not depend on the process count.
        """
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}; use 'train' or 'val'")
        data = self.train if split == "train" else self.val
        check_window_sizes(len(data), batch_size, seq_len, f"the {split} split")
        starts = random_window_starts(seed, step, SPLIT_CODES[split], len(data), batch_size, seq_len)
        return windows(data, starts[rows if rows is not None else process_slice(batch_size)], seq_len)

    def bits_per_byte(self, nats_per_token: float, split: str = "val") -> float:
        """A loss in nats per character as bits per UTF-8 byte of the ``split`` text (``nats / ln 2 * chars /
        bytes``), comparable across tokenizers."""
        data = self.train if split == "train" else self.val
        return nats_per_token / math.log(2) * len(data) / len(self.decode(data).encode("utf-8"))


@dataclasses.dataclass(frozen=True)
class Digits:
    """scikit-learn's bundled 8x8 digits (1797 images), features scaled to [0, 1], a fixed train/test split."""
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @classmethod
    def load(cls, test_fraction: float = 0.2, seed: int = 0) -> "Digits":
        datasets = require("sklearn.datasets", "jp.data.Digits")
        train_test_split = require("sklearn.model_selection", "jp.data.Digits").train_test_split
        d = datasets.load_digits()
        x = (d.data / 16.0).astype(np.float32)
        y = d.target.astype(np.int32)
        xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
        return cls(xtr, ytr, xte, yte)

    def batch(self, seed: int, step: int, batch_size: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        """Global batch ``step``: a fresh permutation each epoch, ``{"x": float32 [B, 64], "y": int32 [B]}``."""
        n = len(self.y_train)
        start = step * batch_size
        idx = np.concatenate([np.random.default_rng([seed, e]).permutation(n)
                              for e in range(start // n, (start + batch_size - 1) // n + 1)])
        offset = start - (start // n) * n
        idx = idx[offset: offset + batch_size][rows if rows is not None else process_slice(batch_size)]
        return {"x": self.x_train[idx], "y": self.y_train[idx]}

    def test_set(self, multiple: int) -> dict[str, np.ndarray]:
        """The test set truncated to a multiple of ``multiple`` rows (this process's slice)."""
        n = len(self.y_test) // multiple * multiple
        rows = process_slice(n)
        return {"x": self.x_test[:n][rows], "y": self.y_test[:n][rows]}


__all__ = ["CharCorpus", "Digits", "GrainBatches", "TokenCorpus", "TokenFile", "default_text", "grain_batches", "load_text",
           "process_slice"]
