"""Tokenizes a corpus of documents into a token directory that ``charlm.py --data-dir`` and ``jp.data.TokenFile``
read: ``train.bin``, ``val.bin`` (flat uint16/uint32 token streams, nanoGPT's format, one end-of-document token
after each document), ``tokenizer.json`` and ``meta.json`` (vocabulary, dtype, token/document/byte counts per split,
sources, tokenizer hash). The logic is ``jaxpar.data.prepare.prepare``; see its docstring for what a document is.

Command (CPython's own documentation as the corpus, a byte-level BPE of 1024 ids trained here)::

    python -c "from jaxpar.data import default_text; open('pydoc.txt', 'w').write(default_text())"
    python experiments/prepare_tokens.py --input pydoc.txt --train-bpe 1024 --out data/pydoc-bpe1k
    python experiments/prepare_tokens.py --input a.jsonl b.jsonl --field text --tokenizer tokenizer.json --out data/x
    python experiments/prepare_tokens.py --input pydoc.txt --tokenizer path/to/hf-checkpoint --out data/z
    python experiments/prepare_tokens.py --input part-*.parquet --field content --train-bpe 32000 --out data/y

Expected (2-core CPU): pydoc.txt (465k characters, 2608 paragraphs) in about 5 seconds, about 150k tokens with
1024 ids; a rerun writes byte-identical files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from jaxpar.cli import experiment

experiment.require_extra("experiments/prepare_tokens.py")  # a core-only install stops here, told what to install
experiment.require_extra("experiments/prepare_tokens.py", "data")
import tyro  # noqa: E402  (after the checks above)

from jaxpar.data import prepare as tokens  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    """Token preparation: documents in, a token directory out."""
    input: tuple[str, ...]         # input files (documents numbered across them in this order)
    out: str                       # the token directory to write (train.bin, val.bin, tokenizer.json, meta.json)
    format: Literal["txt", "jsonl", "parquet"] | None = None
    """txt: blank-line-separated paragraphs are documents; jsonl: one JSON object a line; parquet: rows;
    None: each file's suffix tells (.txt, .jsonl/.json, .parquet)"""
    field: str = "text"            # the JSON key / parquet column holding a document's text
    tokenizer: str | None = None
    """a Hugging Face tokenizers tokenizer.json, or a checkpoint directory holding one (or --train-bpe)"""
    train_bpe: int | None = None   # train a byte-level BPE with this many ids on the inputs (or --tokenizer)
    val_fraction: float = 0.01     # expected fraction of documents in val.bin (a hash of each document's index)
    seed: int = 0                  # seeds the train/validation split
    eod_token: str = tokens.EOD_TOKEN  # appended after every document; added to a tokenizer that lacks it
    workers: int = 0               # tokenizing processes (0: one per CPU core; 1: no worker processes)
    chunk_documents: int = 1024    # documents per chunk (a worker's unit; what is held in memory at once)


def main(cfg: Config) -> dict:
    """Prepares the directory, prints a summary line and returns its meta.json dict."""
    tokenizer = cfg.tokenizer
    if tokenizer is not None and Path(tokenizer).is_dir():   # a checkpoint's tokenizer.json, read from inside it
        from jaxpar.models.hf.tokenizer import tokenizer_file
        tokenizer = tokenizer_file(tokenizer)   # a link out of the directory is refused
        if tokenizer is None:
            raise ValueError(f"--tokenizer {cfg.tokenizer}: the directory holds no tokenizer.json; pass a checkpoint "
                             "directory with one, or the file")
    meta = tokens.prepare(cfg.input, cfg.out, format=cfg.format, field=cfg.field, tokenizer=tokenizer,
                          train_bpe_vocab=cfg.train_bpe, val_fraction=cfg.val_fraction, seed=cfg.seed,
                          eod_token=cfg.eod_token, workers=cfg.workers, chunk_documents=cfg.chunk_documents)
    split = meta["splits"]
    print(f"{cfg.out}: vocab {meta['vocab_size']} ({meta['dtype']}), eod id {meta['eod_id']}; "
          + "; ".join(f"{s} {v['tokens']:,} tokens, {v['documents']:,} documents, {v['bytes']:,} bytes "
                      f"({v['bytes'] / max(v['tokens'], 1):.2f} bytes/token)" for s, v in split.items()), flush=True)
    return meta


if __name__ == "__main__":
    main(tyro.cli(Config))
