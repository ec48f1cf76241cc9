"""jaxpar/data/corpora.py: step-indexed data (deterministic batches, shifted targets, the default corpus, digits, row
slicing) and the text files it refuses, each with a clear error naming the file."""

from __future__ import annotations

import numpy as np
import pytest

import jaxpar as jp


@pytest.fixture(scope="module")
def corpus():
    return jp.data.CharCorpus.load()


@pytest.fixture(scope="module")
def digits():
    return jp.data.Digits.load()


def test_default_corpus(corpus):
    text = jp.data.load_text()
    assert text == jp.data.default_text()
    assert len(text) >= 400_000
    assert corpus.vocab_size == len(corpus.chars) == 103
    assert list(corpus.chars) == sorted(set(text))
    assert len(corpus.train) + len(corpus.val) == len(text)
    assert len(corpus.val) == len(text) - int(len(text) * 0.9)
    assert corpus.train.dtype == corpus.val.dtype == np.int32
    assert corpus.decode(corpus.train[:200]) == text[:200]
    assert corpus.decode(corpus.val[:50]) == text[len(corpus.train):len(corpus.train) + 50]


def test_encode_decode_round_trip(corpus):
    text = "def f(x):\n    return x + 1  # ok"
    assert corpus.decode(corpus.encode(text)) == text
    assert corpus.encode("a\u2603b") == corpus.encode("ab")      # characters outside the vocabulary are dropped


def test_char_batch_shapes_and_shift(corpus):
    batch = corpus.batch(seed=0, step=3, batch_size=8, seq_len=32)
    assert set(batch) == {"inputs", "targets"}
    for x in batch.values():
        assert x.shape == (8, 32) and x.dtype == np.int32
        assert x.min() >= 0 and x.max() < corpus.vocab_size
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    # every row is a window of the training text, and the target's last token follows it there
    train = corpus.train
    for row_in, row_t in zip(batch["inputs"], batch["targets"]):
        hits = [s for s in np.flatnonzero(train[:len(train) - 32] == row_in[0])
                if np.array_equal(train[s:s + 32], row_in)]
        assert any(train[s + 32] == row_t[-1] for s in hits)


@pytest.mark.parametrize("split", ["train", "val"])
def test_char_batch_is_step_indexed(corpus, split):
    a = corpus.batch(seed=1, step=5, batch_size=16, seq_len=24, split=split)
    b = corpus.batch(seed=1, step=5, batch_size=16, seq_len=24, split=split)
    same = lambda u, v: all(np.array_equal(u[k], v[k]) for k in u)
    assert same(a, b)
    assert not same(a, corpus.batch(seed=1, step=6, batch_size=16, seq_len=24, split=split))
    assert not same(a, corpus.batch(seed=2, step=5, batch_size=16, seq_len=24, split=split))
    # a batch does not depend on which batches were drawn before it
    corpus.batch(seed=1, step=0, batch_size=16, seq_len=24, split=split)
    assert same(a, corpus.batch(seed=1, step=5, batch_size=16, seq_len=24, split=split))


def test_train_and_val_batches_differ(corpus):
    a = corpus.batch(seed=0, step=0, batch_size=8, seq_len=16, split="train")
    b = corpus.batch(seed=0, step=0, batch_size=8, seq_len=16, split="val")
    assert not np.array_equal(a["inputs"], b["inputs"])


@pytest.mark.parametrize("rows", [slice(0, 4), slice(4, 8), slice(12, 16), slice(3, 11)])
def test_char_batch_rows(corpus, rows):
    """A process's ``rows=`` are exactly those rows of the global batch."""
    full = corpus.batch(seed=7, step=2, batch_size=16, seq_len=20)
    part = corpus.batch(seed=7, step=2, batch_size=16, seq_len=20, rows=rows)
    for k in full:
        np.testing.assert_array_equal(part[k], full[k][rows])


def test_process_slice_single_process():
    assert jp.data.process_slice(16) == slice(0, 16)


def test_digits_shapes(digits):
    assert digits.x_train.shape == (1437, 64) and digits.x_test.shape == (360, 64)
    assert digits.y_train.shape == (1437,) and digits.y_test.shape == (360,)
    assert digits.x_train.dtype == np.float32 and digits.y_train.dtype == np.int32
    assert 0.0 <= digits.x_train.min() and digits.x_train.max() <= 1.0
    assert set(np.unique(digits.y_train)) == set(range(10))
    batch = digits.batch(seed=0, step=0, batch_size=32)
    assert batch["x"].shape == (32, 64) and batch["y"].shape == (32,)
    assert batch["x"].dtype == np.float32 and batch["y"].dtype == np.int32
    test = digits.test_set(multiple=16)
    assert test["x"].shape == (352, 64) and test["y"].shape == (352,)


def test_digits_batch_is_step_indexed(digits):
    a, b = digits.batch(0, 3, 32), digits.batch(0, 3, 32)
    np.testing.assert_array_equal(a["x"], b["x"])
    np.testing.assert_array_equal(a["y"], b["y"])
    assert not np.array_equal(a["x"], digits.batch(0, 4, 32)["x"])
    assert not np.array_equal(a["x"], digits.batch(1, 3, 32)["x"])


@pytest.mark.parametrize("rows", [slice(0, 8), slice(8, 16), slice(24, 32)])
def test_digits_batch_rows(digits, rows):
    full = digits.batch(seed=3, step=44, batch_size=32)       # step 44 crosses the first epoch boundary
    part = digits.batch(seed=3, step=44, batch_size=32, rows=rows)
    np.testing.assert_array_equal(part["x"], full["x"][rows])
    np.testing.assert_array_equal(part["y"], full["y"][rows])


def test_digits_epochs_cover_the_training_set(digits):
    """Consecutive batches walk a permutation per epoch: the first 1437 examples are the training set once,
    including across a batch that straddles the epoch boundary."""
    n, bs = len(digits.y_train), 32
    xs = np.concatenate([digits.batch(seed=5, step=t, batch_size=bs)["x"] for t in range(n // bs + 2)])
    assert len(xs) == (n // bs + 2) * bs
    epoch0 = xs[:n]
    key = lambda a: np.lexsort(a.T[::-1])
    np.testing.assert_array_equal(epoch0[key(epoch0)], digits.x_train[key(digits.x_train)])
    assert not np.array_equal(xs[n:n + bs], epoch0[:bs]), "the second epoch repeats the first one's order"


def test_process_batch_rows_follow_the_sharding(mesh_factory):
    """One process: every layout's batch rows are the whole batch (the multi-process split is tested above)."""
    for sizes in (dict(data=8), dict(data=2, fsdp=2, tensor=2), dict(tensor=8)):
        mesh = mesh_factory(**sizes)
        assert jp.data.process_slice(16, mesh) == slice(0, 16)
        assert jp.sharding.global_batch_rows(16, mesh) == 16
    with pytest.raises(ValueError, match="not divisible"):
        jp.data.process_slice(6, mesh_factory(data=8))


# ------------------------------------------------------------------------------------------- text files

def _text_loaders():
    return [jp.data.load_text, jp.data.CharCorpus.load]


@pytest.mark.parametrize("load", _text_loaders(), ids=["load_text", "CharCorpus.load"])
@pytest.mark.parametrize("content, pattern", [
    (b"", r"is empty; pass a file with some text"),
    (b" \n\t\n", r"is empty; pass a file with some text"),
    (b"hello\x00world", r"looks binary \(it holds NUL bytes\); pass a UTF-8 text file"),
    (b"caf\xe9 latin-1", r"is not UTF-8 text \(invalid continuation byte at byte 3\); pass a UTF-8 text file"),
    (b"\xff\xfeh\x00i\x00", r"looks binary"),                      # UTF-16 holds NUL bytes
], ids=["empty", "whitespace", "binary", "latin1", "utf16"])
def test_bad_text_files(tmp_path, load, content, pattern):
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=pattern) as info:
        load(path)
    assert "corpus.txt" in str(info.value)


@pytest.mark.parametrize("load", _text_loaders(), ids=["load_text", "CharCorpus.load"])
def test_missing_text_file_and_directory(tmp_path, load):
    with pytest.raises(ValueError, match=r"'.*nope.txt' does not exist; pass a UTF-8 text file or omit it"):
        load(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match=r"is not a file; pass a UTF-8 text file"):
        load(tmp_path)


def test_good_text_file(tmp_path):
    path = tmp_path / "ok.txt"
    path.write_text("héllo wörld, " * 50, encoding="utf-8")
    assert jp.data.load_text(str(path)) == "héllo wörld, " * 50
    corpus = jp.data.CharCorpus.load(path)
    assert corpus.vocab_size == len(set("héllo wörld, "))


def test_corpus_too_short_for_seq_len():
    corpus = jp.data.CharCorpus.from_text("abcdefghij" * 10)
    with pytest.raises(ValueError, match=r"the val split has 10 tokens, too few for seq_len 16"):
        corpus.batch(0, 0, 4, 16, split="val")
    with pytest.raises(ValueError, match=r"text is empty"):
        jp.data.CharCorpus.from_text("")
    with pytest.raises(ValueError, match=r"val_fraction=1.0 must lie in \(0, 1\)"):
        jp.data.CharCorpus.from_text("abc", val_fraction=1.0)


def test_corpus_batch_rejects_bad_split_and_lengths():
    corpus = jp.data.CharCorpus.from_text("hello world, " * 50)
    with pytest.raises(ValueError, match="split"):
        corpus.batch(0, 0, 4, 8, split="Train")
    with pytest.raises(ValueError, match="seq_len"):
        corpus.batch(0, 0, 4, 0)
