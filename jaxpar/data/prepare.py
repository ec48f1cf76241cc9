"""Preparing token corpora: documents (text, JSON lines, parquet) through a Hugging Face tokenizer into token files.

:func:`prepare` writes a token directory that :class:`jaxpar.data.TokenFile` reads: ``train.bin`` and ``val.bin``
(flat little-endian ``uint16`` / ``uint32`` token streams as nanoGPT's ``prepare.py`` writes them, each document
followed by one end-of-document token), ``tokenizer.json`` and ``meta.json``. It streams: documents are read,
tokenized in worker processes and written in chunks of ``chunk_documents``, so a corpus larger than memory works.
It is reproducible: the split of documents into train and validation is a hash of the document's index (not of
timing or of the number of workers), chunks are written in order, and a rerun writes byte-identical files.

Documents:
  * ``txt``: a document is a run of non-blank lines; blank (whitespace-only) lines separate documents, so
    paragraphs are documents. Its text is those lines with their line breaks, less the last one (universal
    newlines: ``\\r\\n`` reads as ``\\n``).
  * ``jsonl``: one JSON object a line (blank lines skipped); the document is its ``field`` (a string).
  * ``parquet``: the document is each row's ``field`` column (a string column), read in record batches.

The tokenizer is a ``tokenizer.json`` file or, with ``train_bpe=VOCAB_SIZE``, a byte-level BPE (GPT-2's
pre-tokenizer and byte alphabet; Radford et al. 2019, section 2.2) trained here on the input documents with
``tokenizers``' ``BpeTrainer`` (no download). The end-of-document token (``<|endoftext|>`` unless told) is added
to a tokenizer that lacks it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from jaxpar._compat import backends_initialized
from jaxpar._optional import require
from jaxpar.data.token_file import DTYPES, META, TOKENIZER, token_dtype

EOD_TOKEN = "<|endoftext|>"
FORMATS = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
           ".parquet": "parquet", ".pq": "parquet"}   # file suffix -> format when none is given
SPLITS = ("train", "val")


# -------------------------------------------------------------------------------------------- documents

def file_format(path: str | os.PathLike, format: str | None = None) -> str:
    """``format`` (checked) or the one ``path``'s suffix names (:data:`FORMATS`).

    Raises:
      ValueError: an unknown format, or none given for a suffix that names none.
    """
    if format is not None:
        if format not in set(FORMATS.values()):
            raise ValueError(f"format={format!r}; use one of txt, jsonl, parquet")
        return format
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot tell the format of {str(path)!r} from its suffix {suffix!r}; pass --format "
                         "txt|jsonl|parquet")
    return FORMATS[suffix]


def read_documents(path: str | os.PathLike, format: str | None = None, field: str = "text") -> Iterator[str]:
    """The documents of one file, streamed (see the module docstring for what a document is in each format).

    Raises:
      ValueError: a missing file, text that is not UTF-8, a JSON line that is not an object with a string
        ``field``, a parquet file without a string column ``field``; the message names the file (and line/row).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"input file {str(path)!r} does not exist (or is not a file)")
    reader = {"txt": _txt_documents, "jsonl": _jsonl_documents, "parquet": _parquet_documents}
    yield from reader[file_format(path, format)](path, field)


def _txt_documents(path: Path, field: str) -> Iterator[str]:
    del field
    lines: list[str] = []
    with open(path, encoding="utf-8") as f:
        try:
            for line in f:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield _paragraph(lines)
                    lines = []
        except UnicodeDecodeError as e:
            raise ValueError(f"{str(path)!r} is not UTF-8 text ({e.reason}); pass UTF-8 text") from None
    if lines:
        yield _paragraph(lines)


def _paragraph(lines: list[str]) -> str:
    text = "".join(lines)
    return text[:-1] if text.endswith("\n") else text


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        try:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield _json_field(line, field, f"{str(path)!r} line {number}")
        except UnicodeDecodeError as e:
            raise ValueError(f"{str(path)!r} is not UTF-8 text ({e.reason}); pass UTF-8 JSON lines") from None


def _json_field(line: str, field: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e.msg}); pass one JSON object a line") from None
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where} has no string field {field!r} (it has {keys}); pass --field with the text's key")
    return record[field]


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    pa = require("pyarrow", "jaxpar.data.prepare (parquet input)", "data")
    pq = require("pyarrow.parquet", "jaxpar.data.prepare (parquet input)", "data")
    try:
        file = pq.ParquetFile(path)
    except pa.ArrowException as e:
        raise ValueError(f"{str(path)!r} is not a parquet file ({e})") from None
    schema = file.schema_arrow
    if field not in schema.names or not (pa.types.is_string(schema.field(field).type)
                                         or pa.types.is_large_string(schema.field(field).type)):
        columns = {n: str(schema.field(n).type) for n in schema.names}
        raise ValueError(f"{str(path)!r} has no string column {field!r} (columns: {columns}); pass --field with "
                         "the text column")
    row = 0
    for batch in file.iter_batches(batch_size=1024, columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is None:
                raise ValueError(f"{str(path)!r} row {row}: column {field!r} is null; drop or fill such rows")
            row += 1
            yield text


def documents(inputs: Iterable[str | os.PathLike], format: str | None = None, field: str = "text") -> Iterator[str]:
    """The documents of every input file in order (:func:`read_documents`)."""
    for path in inputs:
        yield from read_documents(path, format, field)


# -------------------------------------------------------------------------------------------- tokenizer

def train_bpe(docs: Iterable[str], vocab_size: int, eod_token: str = EOD_TOKEN):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` ids trained on ``docs`` (streamed).

    GPT-2's byte-level pre-tokenizer (regex split, bytes as 256 printable symbols, no prefix space) and decoder,
    so ``decode(encode(text)) == text`` for any text; id 0 is ``eod_token``.

    Raises:
      ValueError: ``vocab_size`` below 257 (the 256 bytes and the end-of-document token).
    """
    tk = require("tokenizers", "jaxpar.data.prepare.train_bpe", "data")
    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise ValueError(f"train_bpe vocab_size={vocab_size!r}: a byte-level BPE needs >= 257 ids (256 bytes + "
                         "the end-of-document token)")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eod_token], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer)
    return tokenizer


def read_tokenizer(path: str | os.PathLike, feature: str = "jaxpar.data.prepare.load_tokenizer",
                   extra: str = "data"):
    """The ``tokenizers.Tokenizer`` of the ``tokenizer.json`` file at ``path``, as saved.

    Args:
      feature, extra: what needs ``tokenizers`` and the pip extra that provides it (named when it is missing).

    Raises:
      ValueError: ``path`` is no file (a directory: pass its ``tokenizer.json``), or not a ``tokenizers`` file
        (malformed JSON, an unknown model or field); the message names the path.
    """
    tk = require("tokenizers", feature, extra)
    if not Path(path).is_file():
        hint = " (a directory: pass its tokenizer.json)" if Path(path).is_dir() else ""
        raise ValueError(f"tokenizer file {str(path)!r} does not exist{hint}; pass a tokenizers tokenizer.json")
    try:
        return tk.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise ValueError(f"{str(path)!r} is not a tokenizers tokenizer.json ({e}); pass the tokenizer.json that "
                         "tokenizers' Tokenizer.save or transformers' save_pretrained wrote") from None


def load_tokenizer(path: str | os.PathLike, eod_token: str = EOD_TOKEN):
    """The ``tokenizers.Tokenizer`` saved at ``path`` (:func:`read_tokenizer`), with ``eod_token`` added as a
    special token if it lacks it.

    Raises:
      ValueError: a missing or unreadable tokenizer file, or ``eod_token`` an ordinary token of it.
    """
    tokenizer = read_tokenizer(path)
    eod = tokenizer.token_to_id(eod_token)
    if eod is None:
        tokenizer.add_special_tokens([eod_token])
    elif not any(t.content == eod_token and t.special for t in tokenizer.get_added_tokens_decoder().values()):
        raise ValueError(f"the end-of-document token {eod_token!r} is an ordinary token (id {eod}) of {str(path)!r}, "
                         "so text would encode to it: pass --eod-token with the tokenizer's own end-of-text token "
                         "or a new string")
    return tokenizer


# ---------------------------------------------------------------------------------------------- encoding

_WORKER: dict[str, Any] = {}


def _start_worker(tokenizer_json: str, eod_id: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # processes are the parallelism
    _WORKER["tokenizer"] = require("tokenizers", "jaxpar.data.prepare", "data").Tokenizer.from_str(tokenizer_json)
    _WORKER["eod_id"] = eod_id


def encode_documents(docs: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uint32 ids of every document each followed by the eod id, int64 tokens per document with its eod, int64
    UTF-8 bytes per document) with the worker's tokenizer (set by ``_start_worker``)."""
    tokenizer, eod = _WORKER["tokenizer"], _WORKER["eod_id"]
    encoded = [e.ids + [eod] for e in tokenizer.encode_batch(docs, add_special_tokens=False)]
    for doc, ids in zip(docs, encoded):
        if eod in ids[:-1]:   # the text itself holds the eod token: it would end documents in their middle
            raise ValueError(f"a document holds the end-of-document token {tokenizer.id_to_token(eod)!r} in its text "
                             f"({doc[:60]!r}...): choose an eod token that never occurs in the corpus (--eod-token)")
    lengths = np.fromiter((len(ids) for ids in encoded), np.int64, len(encoded))
    ids = np.fromiter((i for e in encoded for i in e), np.uint32, int(lengths.sum()))
    return ids, lengths, np.fromiter((len(d.encode("utf-8")) for d in docs), np.int64, len(docs))


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def encoded_chunks(chunks: Iterable[list[str]], tokenizer_json: str, eod_id: int, workers: int):
    """:func:`encode_documents` of each chunk, in order, over ``workers`` processes (0 or 1: in this process).

    At most ``2 * workers`` chunks are in flight (``Pool.imap`` would read every chunk ahead), so memory stays
    bounded. Workers are forked while no JAX backend runs in this process, else spawned (JAX's threads do not
    survive a fork)."""
    if workers <= 1:
        _start_worker(tokenizer_json, eod_id)
        yield from map(encode_documents, chunks)
        return
    context = multiprocessing.get_context(_start_method())
    with context.Pool(workers, initializer=_start_worker, initargs=(tokenizer_json, eod_id)) as pool:
        pending = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(encode_documents, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _start_method() -> str:
    # forking a process whose XLA backends run (they start on first device use) can deadlock the child
    return "fork" if not backends_initialized() and "fork" in multiprocessing.get_all_start_methods() else "spawn"


def validation_documents(index: np.ndarray, val_fraction: float, seed: int = 0) -> np.ndarray:
    """Whether each document index goes to the validation split: ``u(seed, index) < val_fraction``, with ``u``
    uniform in [0, 1) from SplitMix64 (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number
    generators") of the index offset by the mixed seed: independent of chunking and workers."""
    def mix(z):
        with np.errstate(over="ignore"):
            z = (z + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            return z ^ (z >> np.uint64(31))
    with np.errstate(over="ignore"):
        z = mix(np.asarray(index, np.uint64) + mix(np.array([seed], np.uint64))[0])
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53 < val_fraction


# ----------------------------------------------------------------------------------------------- prepare

def prepare(inputs: Iterable[str | os.PathLike], out: str | os.PathLike, *, format: str | None = None,
            field: str = "text", tokenizer: str | os.PathLike | None = None, train_bpe_vocab: int | None = None,
            val_fraction: float = 0.01, seed: int = 0, eod_token: str = EOD_TOKEN, workers: int = 0,
            chunk_documents: int = 1024, progress: bool = True) -> dict[str, Any]:
    """Tokenizes the documents of ``inputs`` into the token directory ``out``; returns its ``meta.json`` dict.

    Args:
      inputs: input files, read in order (documents numbered across them from 0).
      out: the directory to write (created; its four files are replaced).
      format: ``txt``, ``jsonl`` or ``parquet`` for every input; None: each file's suffix tells.
      field: the JSON key / parquet column holding the text.
      tokenizer: a ``tokenizer.json``; or ``train_bpe_vocab``: train a byte-level BPE of that many ids on the
        inputs (one of the two).
      val_fraction: the expected fraction of documents in ``val.bin`` (:func:`validation_documents`), in [0, 1).
      seed: seeds the train/validation split.
      eod_token: the end-of-document token appended to every document (added to a tokenizer that lacks it).
      workers: tokenizing processes (0: ``os.cpu_count()``; 1: this process).
      chunk_documents: documents per chunk (a worker's unit of work, and what is held in memory per chunk).
      progress: show a tqdm bar (documents).

    Returns:
      ``meta.json``'s contents: ``vocab_size``, ``dtype``, ``eod_id``, ``eod_token``, ``tokenizer_sha256``,
      ``splits`` (per split: ``file``, ``tokens`` (each eod included), ``documents``, ``bytes`` (UTF-8 bytes of its
      documents, for bits per byte)), ``sources`` (each input's path, format and size in bytes), ``field``,
      ``val_fraction``, ``seed``.

    Raises:
      ValueError: no inputs, both or neither of ``tokenizer`` / ``train_bpe_vocab``, a bad ``val_fraction``, a
        bad input (:func:`read_documents`), no document in the inputs or in the training split, no document in
        the validation split while ``val_fraction > 0`` (refused before ``train.bin`` / ``val.bin`` are replaced).
        With ``val_fraction=0`` every document goes to ``train.bin`` and ``val.bin`` is empty.
    """
    inputs = [Path(p) for p in inputs]
    _check_prepare_args(inputs, format, tokenizer, train_bpe_vocab, val_fraction, chunk_documents, seed, eod_token)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = (train_bpe(documents(inputs, format, field), train_bpe_vocab, eod_token) if train_bpe_vocab
           else load_tokenizer(tokenizer, eod_token))
    tokenizer_text = tok.to_str(pretty=True)
    vocab_size, eod_id = tok.get_vocab_size(with_added_tokens=True), tok.token_to_id(eod_token)
    dtype = token_dtype(vocab_size)
    chunks = _chunks(documents(inputs, format, field), chunk_documents)
    counts = _write_splits(out, encoded_chunks(chunks, tok.to_str(), eod_id, workers or os.cpu_count() or 1),
                           dtype, vocab_size, val_fraction, seed, progress)
    _write_text(out / TOKENIZER, tokenizer_text)
    meta = {"format": "jaxpar.data.prepare", "version": 1, "vocab_size": vocab_size, "dtype": dtype, "eod_id": eod_id,
            "eod_token": eod_token, "tokenizer": TOKENIZER,
            "tokenizer_sha256": hashlib.sha256(tokenizer_text.encode("utf-8")).hexdigest(),
            "splits": {s: {"file": f"{s}.bin", **counts[s]} for s in SPLITS},
            "sources": [{"path": str(p), "format": file_format(p, format), "bytes": p.stat().st_size} for p in inputs],
            "field": field, "val_fraction": val_fraction, "seed": seed}
    _write_text(out / META, json.dumps(meta, indent=2) + "\n")
    return meta


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _check_prepare_args(inputs, format, tokenizer, train_bpe_vocab, val_fraction, chunk_documents, seed,
                        eod_token) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**63)")
    if not isinstance(eod_token, str) or not eod_token:
        raise ValueError(f"eod_token={eod_token!r} must be a non-empty string (e.g. {EOD_TOKEN!r})")
    if not inputs:
        raise ValueError("no input files; pass --input FILE [FILE ...]")
    for path in inputs:
        if not path.is_file():
            raise ValueError(f"input file {str(path)!r} does not exist (or is not a file)")
        file_format(path, format)
    if (tokenizer is None) == (train_bpe_vocab is None):
        raise ValueError("pass either a tokenizer file (--tokenizer tokenizer.json) or --train-bpe VOCAB_SIZE")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must lie in [0, 1)")
    if chunk_documents < 1:
        raise ValueError(f"chunk_documents={chunk_documents} must be >= 1")


def _check_counts(counts: dict[str, dict[str, int]], val_fraction: float) -> None:
    """Refuses splits a token directory cannot serve, before they replace anything: an empty training split (no
    document at all, or every one in validation) or, with ``val_fraction > 0``, an empty validation split."""
    train, val = counts["train"]["documents"], counts["val"]["documents"]
    if not train + val:
        raise ValueError("the inputs hold no documents (empty or blank files): a token directory needs at least one "
                         "training document; pass files with text")
    if not train:
        raise ValueError(f"all {val} documents fell in the validation split (val_fraction {val_fraction}), none in "
                         "train; give more documents or a smaller --val-fraction")
    if val_fraction > 0 and not val:
        raise ValueError(f"no document of the {train} fell in the validation split (val_fraction {val_fraction}); "
                         "give more documents or a larger --val-fraction")


def _write_splits(out: Path, chunks, dtype: str, vocab_size: int, val_fraction: float, seed: int,
                  progress: bool) -> dict[str, dict[str, int]]:
    """Writes each chunk's documents to ``train.bin`` / ``val.bin`` (through ``*.tmp`` files renamed at the end,
    once :func:`_check_counts` accepts the splits); returns per split the counts of tokens, documents and UTF-8
    bytes."""
    tqdm = require("tqdm", "jaxpar.data.prepare.prepare (progress bar)").tqdm if progress else None
    bar = tqdm(desc="tokenize", unit="doc") if progress else None
    counts = {s: {"tokens": 0, "documents": 0, "bytes": 0} for s in SPLITS}
    files = {s: open(out / f"{s}.bin.tmp", "wb") for s in SPLITS}
    first, done = 0, False
    try:
        for ids, lengths, nbytes in chunks:
            if len(ids) and int(ids.max()) >= vocab_size:
                raise ValueError(f"the tokenizer produced id {int(ids.max())} >= its vocabulary size {vocab_size}")
            val = validation_documents(np.arange(first, first + len(lengths)), val_fraction, seed)
            per_token = np.repeat(val, lengths)
            for split, docs, tokens in (("train", ~val, ~per_token), ("val", val, per_token)):
                ids[tokens].astype(DTYPES[dtype]).tofile(files[split])   # little-endian
                counts[split]["tokens"] += int(tokens.sum())
                counts[split]["documents"] += int(docs.sum())
                counts[split]["bytes"] += int(nbytes[docs].sum())
            first += len(lengths)
            if bar is not None:
                bar.update(len(lengths))
        _check_counts(counts, val_fraction)
        done = True
    finally:
        for f in files.values():
            f.close()
            if not done:
                os.remove(f.name)
        if bar is not None:
            bar.close()
    # meta.json goes before the first file is replaced and comes back last: a directory interrupted in between is
    # refused by TokenFile, and a refused or failed run leaves the previous directory whole
    (out / META).unlink(missing_ok=True)
    for s in SPLITS:
        os.replace(out / f"{s}.bin.tmp", out / f"{s}.bin")
    return counts


__all__ = ["EOD_TOKEN", "FORMATS", "documents", "encode_documents", "encoded_chunks", "file_format", "load_tokenizer",
           "prepare", "read_documents", "read_tokenizer", "train_bpe", "validation_documents"]
