"""jaxpar/data/prepare.py and experiments/prepare_tokens.py: documents (txt, JSON lines, parquet) into token files.

The references are ``tokenizers``' own encoding of each document (from the saved tokenizer.json) plus one
end-of-document id, documents split out of the text by a regular expression written here, and the inputs the
test wrote; never jaxpar's output."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from helpers import load_script, pydoc_tokenizer

import jaxpar as jp
from jaxpar.data import prepare as tokens

tk = pytest.importorskip("tokenizers")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

FILES = ("train.bin", "val.bin", "tokenizer.json", "meta.json")
WORDS = ["the", "def", "lambda", "Zürich", "naïve", "日本語", "🙂", "x+1", "\t", "→", "  ", "A", "é", "class"]


def paragraphs(text: str) -> list[str]:
    """Blank-line-separated paragraphs (a blank line holds only whitespace), as a regular expression splits them."""
    return [p.strip("\n") for p in re.split(r"\n[^\S\n]*(?:\n[^\S\n]*)*\n", text) if p.strip()]


def random_docs(rng: np.random.Generator, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, rng.integers(1, 40))) + ("\nline two" if rng.random() < 0.3 else "")
            for _ in range(n)]


def pydoc_slice(chars: int = 30_000) -> str:
    text = jp.data.default_text()
    return text[:text.index("\n\n", chars)]


def reference_stream(out, docs: list[str]) -> tuple[np.ndarray, int]:
    """Each document through the saved tokenizer.json (``tokenizers``), followed by the end-of-document id."""
    tok = tk.Tokenizer.from_file(str(out / "tokenizer.json"))
    eod = tok.token_to_id(tokens.EOD_TOKEN)
    ids = [i for d in docs for i in tok.encode(d, add_special_tokens=False).ids + [eod]]
    return np.array(ids, np.int64), eod


def assert_stream(out, docs: list[str]) -> None:
    """``train.bin`` (val_fraction 0: every document) is the reference stream; meta.json's counts agree."""
    want, eod = reference_stream(out, docs)
    meta = json.loads((out / "meta.json").read_text())
    got = np.fromfile(out / "train.bin", dtype=np.dtype(meta["dtype"]).newbyteorder("<"))
    np.testing.assert_array_equal(got, want)
    assert meta["eod_id"] == eod and (got == eod).sum() == len(docs)
    assert meta["splits"]["train"] == {"file": "train.bin", "tokens": len(want), "documents": len(docs),
                                       "bytes": sum(len(d.encode("utf-8")) for d in docs)}
    assert meta["splits"]["val"]["tokens"] == 0 == (out / "val.bin").stat().st_size


def test_txt_paragraphs_match_tokenizers_and_round_trip(tmp_path):
    """CPython's documentation (a slice): one document per paragraph, each exactly tokenizers' encoding + EOD;
    the byte-level BPE decodes every document back to its text."""
    text = pydoc_slice()
    (tmp_path / "pydoc.txt").write_text(text + "\n  \n\n")
    meta = tokens.prepare([tmp_path / "pydoc.txt"], tmp_path / "out", train_bpe_vocab=400, val_fraction=0.0,
                          workers=1, progress=False)
    docs = paragraphs(text)
    assert len(docs) > 50
    assert_stream(tmp_path / "out", docs)
    assert meta["vocab_size"] == 400 and meta["dtype"] == "uint16"
    tok = tk.Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert all(tok.decode(tok.encode(d).ids) == d for d in docs)
    file = jp.data.TokenFile(tmp_path / "out", "train")
    assert all(file.decode(file.encode(d)) == d for d in docs[:20])


def test_txt_document_boundaries(tmp_path):
    """Whitespace-only lines separate documents; a document keeps its inner line breaks and indentation."""
    (tmp_path / "a.txt").write_text("one\n  two\n\n \t \n\n    three\nfour  \n\n\nfive")
    assert list(tokens.read_documents(tmp_path / "a.txt")) == ["one\n  two", "    three\nfour  ", "five"]


def test_jsonl_field_matches_tokenizers(tmp_path):
    rng = np.random.default_rng(0)
    docs = random_docs(rng, 60)
    lines = [json.dumps({"id": i, "content": d, "meta": {"x": 1}}, ensure_ascii=bool(i % 2)) for i, d in enumerate(docs)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines[:30]) + "\n\n" + "\n".join(lines[30:]) + "\n")
    tokens.prepare([tmp_path / "d.jsonl"], tmp_path / "out", field="content", train_bpe_vocab=300, val_fraction=0.0,
                   workers=1, progress=False)
    assert_stream(tmp_path / "out", docs)


def test_parquet_field_and_given_tokenizer(tmp_path):
    """Parquet rows in two files (documents numbered across them), and a tokenizer.json given by the user that
    lacks the end-of-document token: it is added as a new id."""
    rng = np.random.default_rng(1)
    docs = random_docs(rng, 50)
    for part, chunk in enumerate((docs[:20], docs[20:])):
        pq.write_table(pa.table({"content": chunk, "n": list(range(len(chunk)))}), tmp_path / f"p{part}.parquet",
                       row_group_size=7)
    user = tk.Tokenizer(tk.models.BPE(unk_token="[UNK]"))
    user.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    user.train_from_iterator(docs, tk.trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"],
                                                          show_progress=False))
    user.save(str(tmp_path / "user.json"))
    meta = tokens.prepare([tmp_path / "p0.parquet", tmp_path / "p1.parquet"], tmp_path / "out", field="content",
                          tokenizer=tmp_path / "user.json", val_fraction=0.0, workers=1, progress=False)
    assert meta["eod_id"] == user.get_vocab_size() and meta["vocab_size"] == user.get_vocab_size() + 1
    assert_stream(tmp_path / "out", docs)


def split_documents(stream: np.ndarray, eod: int) -> list[tuple[int, ...]]:
    ends = np.flatnonzero(stream == eod)
    return [tuple(d) for d in np.split(stream, ends + 1)[:-1]]


def test_split_partitions_documents_in_order(tmp_path):
    """With a validation fraction every document lands in exactly one split, in input order within each, about
    that fraction in val; the two streams hold every document's tokens + EOD."""
    rng = np.random.default_rng(2)
    docs = random_docs(rng, 400)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    meta = tokens.prepare([tmp_path / "d.jsonl"], tmp_path / "out", train_bpe_vocab=300, val_fraction=0.25,
                          workers=1, chunk_documents=37, progress=False)
    want, eod = reference_stream(tmp_path / "out", docs)
    per_doc = split_documents(want, eod)
    train, val = (split_documents(np.fromfile(tmp_path / "out" / f, "<u2").astype(np.int64), eod)
                  for f in ("train.bin", "val.bin"))
    is_val = tokens.validation_documents(np.arange(len(docs)), 0.25)
    assert train == [d for d, v in zip(per_doc, is_val) if not v]
    assert val == [d for d, v in zip(per_doc, is_val) if v]
    assert 0.15 < len(val) / len(docs) < 0.35
    assert meta["splits"]["val"]["documents"] == len(val)
    assert meta["splits"]["val"]["bytes"] == sum(len(d.encode()) for d, v in zip(docs, is_val) if v)


def test_rerun_is_byte_identical_whatever_the_chunking(tmp_path):
    (tmp_path / "pydoc.txt").write_text(pydoc_slice(20_000))
    for name, chunk in (("a", 1024), ("b", 5)):
        tokens.prepare([tmp_path / "pydoc.txt"], tmp_path / name, train_bpe_vocab=350, val_fraction=0.1,
                       workers=1, chunk_documents=chunk, progress=False)
    for f in FILES:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


@pytest.mark.slow  # spawns worker processes (each imports jax: ~10 s on 2 busy cores); .ci/run runs it
def test_all_of_pydoc_through_worker_processes(tmp_path):
    """All of CPython's pydoc topics (2608 paragraphs) through 2 worker processes in chunks of 16 documents: the
    same files as one process writes, and exactly tokenizers' encoding of each paragraph + EOD."""
    text = jp.data.default_text()
    (tmp_path / "pydoc.txt").write_text(text)
    for name, workers in (("one", 1), ("two", 2)):
        tokens.prepare([tmp_path / "pydoc.txt"], tmp_path / name, train_bpe_vocab=1024, val_fraction=0.0,
                       workers=workers, chunk_documents=16, progress=False)
    for f in FILES:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f
    assert_stream(tmp_path / "two", paragraphs(text))


def test_validation_split_is_a_hash_of_the_index():
    idx = np.arange(200_000)
    val = tokens.validation_documents(idx, 0.01, seed=3)
    assert 0.008 < val.mean() < 0.012
    np.testing.assert_array_equal(val[1000:2000], tokens.validation_documents(idx[1000:2000], 0.01, seed=3))
    assert not np.array_equal(val, tokens.validation_documents(idx, 0.01, seed=4))


def test_prepare_tokens_cli(tmp_path, capsys):
    """The entry point's flags (tyro) reach prepare: --input, --format, --field, --train-bpe, --out."""
    import tyro
    script = load_script("experiments/prepare_tokens.py", "experiments_prepare_tokens")
    (tmp_path / "docs.data").write_text("".join(json.dumps({"body": f"document {i} " * (i % 7 + 1)}) + "\n"
                                                for i in range(300)))
    cfg = tyro.cli(script.Config, args=["--input", str(tmp_path / "docs.data"), "--format", "jsonl", "--field", "body",
                                        "--train-bpe", "300", "--out", str(tmp_path / "out"), "--val-fraction", "0.1",
                                        "--workers", "1"])
    meta = script.main(cfg)
    assert meta["splits"]["val"]["documents"] > 0 and meta["field"] == "body"
    assert "vocab 300 (uint16)" in capsys.readouterr().out
    # --tokenizer a Hugging Face checkpoint directory: its tokenizer.json (a BPE trained on pydoc text) encodes
    reference = pydoc_tokenizer(280, chars=20_000)
    (tmp_path / "ckpt").mkdir()
    reference.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    docs = [json.loads(line)["body"] for line in (tmp_path / "docs.data").read_text().splitlines()]
    args = ["--input", str(tmp_path / "docs.data"), "--format", "jsonl", "--field", "body", "--val-fraction", "0",
            "--workers", "1"]
    meta = script.main(tyro.cli(script.Config, args=args + ["--tokenizer", str(tmp_path / "ckpt"),
                                                            "--out", str(tmp_path / "hf_tokens")]))
    assert meta["vocab_size"] == 280 and meta["eod_id"] == reference.token_to_id(tokens.EOD_TOKEN)
    assert_stream(tmp_path / "hf_tokens", docs)
    assert tk.Tokenizer.from_file(str(tmp_path / "hf_tokens" / "tokenizer.json")).get_vocab() == reference.get_vocab()
    (tmp_path / "no_tokenizer").mkdir()
    with pytest.raises(ValueError, match="no_tokenizer: the directory holds no tokenizer.json"):
        script.main(tyro.cli(script.Config, args=args + ["--tokenizer", str(tmp_path / "no_tokenizer"),
                                                         "--out", str(tmp_path / "x")]))


# ------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("name, content, kwargs, pattern", [
    ("a.jsonl", '{"text": "ok"}\nnot json\n', {}, r"a.jsonl' line 2 is not valid JSON"),
    ("a.jsonl", '{"text": "ok"}\n{"body": "x"}\n', {}, r"a.jsonl' line 2 has no string field 'text' .*\['body'\]"),
    ("a.jsonl", '{"text": 3}\n', {}, r"line 1 has no string field 'text'"),
    ("a.csv", "x", {}, r"cannot tell the format of .*a.csv.*--format"),
    ("a.txt", "x", {"format": "xml"}, r"format='xml'"),
    ("a.txt", b"caf\xe9\n", {}, r"a.txt' is not UTF-8"),
    ("a.txt", "x", {"tokenizer": "t.json"}, r"either a tokenizer file .* or --train-bpe"),
    ("a.txt", "x", {"val_fraction": 1.0}, r"val_fraction=1.0 must lie in \[0, 1\)"),
    ("a.txt", "one\n\ntwo\n", {"val_fraction": 0.001}, r"no document of the 2 fell in the validation split"),
    ("a.txt", "a cat sat\n\non a mat\n", {"eod_token": "a"}, r"holds the end-of-document token 'a' in its text"),
    ("a.txt", "x", {"eod_token": ""}, r"eod_token='' must be a non-empty string"),
    ("a.txt", "x", {"seed": -1}, r"seed=-1 must be an int in \[0, 2\*\*63\)"),
])
def test_bad_input_names_the_file(tmp_path, name, content, kwargs, pattern):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    kwargs = {"train_bpe_vocab": 300, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        tokens.prepare([path], tmp_path / "out", workers=1, progress=False, **kwargs)


def test_empty_splits_are_refused_when_written_and_val_fraction_0_opens_for_train(tmp_path):
    """Blank input with val_fraction 0 is refused by prepare (no train.bin, no meta.json written), and so is a
    training split that gets no document; val_fraction 0 on text gives a directory whose train split opens with
    every document (tokenizers' count) and whose val split is refused naming val_fraction 0."""
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    with pytest.raises(ValueError, match=r"the inputs hold no documents"):
        tokens.prepare([tmp_path / "blank.txt"], tmp_path / "empty", train_bpe_vocab=300, val_fraction=0.0, workers=1,
                       progress=False)
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == []
    (tmp_path / "two.txt").write_text("one\n\ntwo\n")
    in_val = next(f for f in (0.5, 0.9, 0.99) if tokens.validation_documents(np.arange(2), f).all())
    with pytest.raises(ValueError, match=rf"all 2 documents fell in the validation split \(val_fraction {in_val}\)"):
        tokens.prepare([tmp_path / "two.txt"], tmp_path / "all_val", train_bpe_vocab=300, val_fraction=in_val,
                       workers=1, progress=False)
    docs = random_docs(np.random.default_rng(), 30)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokens.prepare([tmp_path / "d.jsonl"], tmp_path / "out", train_bpe_vocab=300, val_fraction=0.0, workers=1,
                   progress=False)
    train = jp.data.TokenFile(tmp_path / "out", "train")
    assert len(train) == len(reference_stream(tmp_path / "out", docs)[0])
    with pytest.raises(ValueError, match=r"'val' split is empty; the directory was prepared with val_fraction 0, so "
                                         r"every document is in 'train': open split='train'"):
        jp.data.TokenFile(tmp_path / "out", "val")


def test_missing_files_and_bad_parquet_column(tmp_path):
    with pytest.raises(ValueError, match=r"input file .*nope.txt' does not exist"):
        tokens.prepare([tmp_path / "nope.txt"], tmp_path / "out", train_bpe_vocab=300, progress=False)
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ValueError, match=r"tokenizer file .*t.json' does not exist"):
        tokens.prepare([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tmp_path / "t.json", progress=False)
    with pytest.raises(ValueError, match=r"needs >= 257 ids"):
        tokens.prepare([tmp_path / "a.txt"], tmp_path / "out", train_bpe_vocab=100, progress=False)
    pq.write_table(pa.table({"body": ["a"], "n": [1]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p.parquet' has no string column 'text' \(columns: .*'body': 'string'"):
        list(tokens.read_documents(tmp_path / "p.parquet"))
    with pytest.raises(ValueError, match=r"no string column 'n'"):
        list(tokens.read_documents(tmp_path / "p.parquet", field="n"))


def test_entry_point_without_the_data_extra_names_it():
    """prepare_tokens.py without tokenizers fails at start naming the 'data' extra and the pip command."""
    from test_core_install import run_script
    out = run_script("prepare_tokens", "import sys\nsys.modules['tokenizers'] = None\n")
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "ImportError: experiments/prepare_tokens.py needs the 'data' extra, and tokenizers is not installed: "
        "pip install 'jaxpar[data]' (from a checkout: pip install -e '.[data]')"), out.stderr[-2000:]


def test_an_ordinary_token_as_eod_is_refused_and_a_failed_rerun_leaves_the_directory_whole(tmp_path):
    """A given tokenizer's ordinary token as the eod token would end documents at every occurrence; a rerun into
    an existing directory that fails halfway (bad input) or is refused (no documents) leaves the previous
    directory whole: it opens with the same tokens and tokenizer, never old bins beside a new tokenizer."""
    (tmp_path / "a.txt").write_text("".join(f"line {i} of some text\n\n" for i in range(60)))
    tokens.prepare([tmp_path / "a.txt"], tmp_path / "out", train_bpe_vocab=300, val_fraction=0.2, workers=1,
                   progress=False)
    before = {name: (tmp_path / "out" / name).read_bytes() for name in ("meta.json", "tokenizer.json", "train.bin")}
    with pytest.raises(ValueError, match=r"'e' is an ordinary token"):
        tokens.prepare([tmp_path / "a.txt"], tmp_path / "other", tokenizer=tmp_path / "out" / "tokenizer.json",
                       eod_token="e", progress=False)
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        tokens.prepare([tmp_path / "a.txt", tmp_path / "bad.txt"], tmp_path / "out", train_bpe_vocab=280,
                       val_fraction=0.2, workers=1, progress=False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="the inputs hold no documents"):
        tokens.prepare([tmp_path / "empty.txt"], tmp_path / "out", tokenizer=tmp_path / "out" / "tokenizer.json",
                       val_fraction=0.2, workers=1, progress=False)
    assert {name: (tmp_path / "out" / name).read_bytes() for name in before} == before
    assert len(jp.data.TokenFile(tmp_path / "out", "train")) == len(before["train.bin"]) // 2   # uint16 ids
