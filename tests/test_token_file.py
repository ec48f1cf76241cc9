"""jaxpar/data/token_file.py (``jp.data.TokenFile``, ``jp.data.TokenCorpus``): memory-mapped token streams as
step-indexed batches, checked on open; exact resume through a SIGTERM.

Token files here are written by the test itself (numpy ``tofile`` and a hand-written meta.json in the format
the module documents), on fresh random ids; batches are compared with numpy references written here."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from jaxpar.data import prepare as tokens
from helpers import launch

BYTES_PER_TOKEN = 3


def write_tokens(directory, splits: dict, vocab: int, dtype: str = "uint16", meta: dict | None = None):
    """``<split>.bin`` per split (little-endian ids) and meta.json, as experiments/prepare_tokens.py writes them."""
    directory.mkdir(parents=True, exist_ok=True)
    entry = {}
    for name, ids in splits.items():
        np.asarray(ids).astype(np.dtype(dtype).newbyteorder("<")).tofile(directory / f"{name}.bin")
        entry[name] = {"file": f"{name}.bin", "tokens": len(ids), "bytes": BYTES_PER_TOKEN * len(ids)}
    (directory / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": dtype, "eod_id": 0,
                                                     "splits": entry, **(meta or {})}))
    return directory


@pytest.fixture
def stream(tmp_path):
    rng = np.random.default_rng(11)
    ids = {"train": rng.integers(0, 1000, 5000), "val": rng.integers(0, 1000, 700)}
    return write_tokens(tmp_path / "tok", ids, vocab=1000), ids


def reference_random(data, seed, step, batch, seq, split_code):
    """The documented draw: offsets from numpy's ``default_rng([seed, step, split])``, windows of seq + 1."""
    starts = np.random.default_rng([seed, step, split_code]).integers(0, len(data) - seq - 1, size=batch)
    window = np.stack([data[s:s + seq + 1] for s in starts])
    return window[:, :-1], window[:, 1:]


@pytest.mark.parametrize("split, code", [("train", 0), ("val", 1)])
def test_random_windows_match_numpy_and_char_corpus(stream, split, code):
    directory, ids = stream
    file = jp.data.TokenFile(directory, split)
    assert len(file) == len(ids[split]) and file.vocab_size == 1000 and file.tokens.dtype == np.dtype("<u2")
    for seed, step in ((0, 0), (3, 17), (3, 18)):
        got = file.batch(seed, step, 8, 24)
        want_in, want_t = reference_random(ids[split], seed, step, 8, 24, code)
        assert got["inputs"].dtype == got["targets"].dtype == np.int32
        np.testing.assert_array_equal(got["inputs"], want_in)
        np.testing.assert_array_equal(got["targets"], want_t)
    # the same draws as CharCorpus on the same ids (TokenCorpus.batch has its interface)
    chars = jp.data.CharCorpus("x" * 1000, ids["train"].astype(np.int32), ids["val"].astype(np.int32))
    corpus = jp.data.TokenCorpus(directory)
    for k, v in chars.batch(2, 5, 4, 16, split).items():
        np.testing.assert_array_equal(corpus.batch(2, 5, 4, 16, split)[k], v)


def test_a_bin_file_path_and_a_bare_nanogpt_file(stream, tmp_path):
    directory, ids = stream
    by_path = jp.data.TokenFile(directory / "val.bin")
    assert by_path.split == "val"
    np.testing.assert_array_equal(by_path.batch(1, 2, 4, 8)["inputs"], jp.data.TokenFile(directory, "val").batch(
        1, 2, 4, 8)["inputs"])
    ids["train"].astype("<u2").tofile(tmp_path / "bare.bin")
    bare = jp.data.TokenFile(tmp_path / "bare.bin", dtype="uint16", vocab_size=1000)
    np.testing.assert_array_equal(np.asarray(bare.tokens), ids["train"])
    assert bare.eod_id is None and bare.num_bytes is None


@pytest.mark.parametrize("rows", [[slice(0, 8), slice(8, 16)], [slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 16)]])
def test_process_rows_partition_the_global_batch(stream, rows):
    """Each process's ``rows=`` are exactly its rows of the one global batch: their union is the global batch
    and no row is loaded twice (the two-process run is the slow test below)."""
    file = jp.data.TokenFile(stream[0])
    for order in ("random", "epoch"):
        full = file.batch(4, 9, 16, 32, order=order)
        parts = [file.batch(4, 9, 16, 32, r, order=order) for r in rows]
        for k in full:
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), full[k])


def test_epoch_order_reads_every_window_once_per_epoch(tmp_path):
    """order='epoch': the (n - 1) // seq_len non-overlapping windows, each once per epoch (inputs cover the
    first windows * seq_len tokens exactly once), a new permutation each epoch, across batch boundaries."""
    ids = np.random.default_rng(5).integers(0, 300, 1003)
    file = jp.data.TokenFile(write_tokens(tmp_path / "t", {"train": ids}, vocab=300))
    seq, batch = 10, 6
    count = (len(ids) - 1) // seq                       # 100 windows: 16 batches of 6 and 4 rows of the next
    rows = np.concatenate([file.batch(7, t, batch, seq, order="epoch")["inputs"] for t in range(2 * count // batch + 1)])
    targets = np.concatenate([file.batch(7, t, batch, seq, order="epoch")["targets"] for t in range(2)])
    epoch0, epoch1 = rows[:count], rows[count:2 * count]
    windows = ids[:count * seq].reshape(count, seq)
    key = lambda a: np.lexsort(a.T[::-1])
    for epoch in (epoch0, epoch1):
        np.testing.assert_array_equal(epoch[key(epoch)], windows[key(windows)])
    assert not np.array_equal(epoch0, epoch1)
    starts = [int(np.flatnonzero((windows == r).all(1))[0]) * seq for r in rows[:len(targets)]]
    np.testing.assert_array_equal(targets, [ids[s + 1:s + seq + 1] for s in starts])
    with pytest.raises(ValueError, match="order='shuffled'"):
        file.batch(0, 0, 2, 4, order="shuffled")


def test_uint32_ids_for_a_large_vocabulary(tmp_path):
    ids = np.random.default_rng(6).integers(0, 100_000, 600)
    file = jp.data.TokenFile(write_tokens(tmp_path / "t", {"train": ids}, vocab=100_000, dtype="uint32"))
    assert file.tokens.dtype == np.dtype("<u4") and int(file.batch(0, 0, 32, 16)["inputs"].max()) > 65535
    assert jp.token_file.token_dtype(65536) == "uint16" and jp.token_file.token_dtype(65537) == "uint32"


def test_bits_per_byte(stream):
    file = jp.data.TokenFile(stream[0], "val")
    assert file.bits_per_byte(2.5) == pytest.approx(2.5 / math.log(2) / BYTES_PER_TOKEN, rel=1e-12)
    chars = jp.data.CharCorpus.from_text("ab\u00e9" * 100)      # 3 characters, 4 UTF-8 bytes
    assert chars.bits_per_byte(1.0, "train") == pytest.approx(3 / 4 / math.log(2), rel=1e-12)


def test_encode_decode_through_the_tokenizer_beside_the_file(tmp_path):
    tk = pytest.importorskip("tokenizers")
    text = "".join(f"def f{i}(x):\n    return x * {i}  # naïve ok\n\n" for i in range(200))
    (tmp_path / "a.txt").write_text(text)
    tokens.prepare([tmp_path / "a.txt"], tmp_path / "out", train_bpe_vocab=300, val_fraction=0.2, workers=1,
                      progress=False)
    corpus = jp.data.TokenCorpus(tmp_path / "out")
    tok = tk.Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    sample = "def g(y):\n    return y  # Zürich 🙂"
    assert corpus.encode(sample) == tok.encode(sample, add_special_tokens=False).ids
    assert corpus.decode(corpus.encode(sample)) == sample
    assert corpus.vocab_size == 300 and corpus.train.eod_id == tok.token_to_id("<|endoftext|>")
    row = corpus.batch(0, 0, 1, 40, "val")["inputs"][0]
    assert corpus.decode(row) == tok.decode(row.tolist(), skip_special_tokens=False)
    other = tk.Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    other.add_special_tokens(["<|other|>"])
    other.save(str(tmp_path / "out" / "tokenizer.json"))   # a tokenizer swapped in after prepare
    with pytest.raises(ValueError, match="not the tokenizer meta.json names"):
        jp.data.TokenCorpus(tmp_path / "out").decode([1, 2])


# ------------------------------------------------------------------------------------------- bad input

def bad(tmp_path, case):
    """A token directory broken in one way; returns (path to open, split, message pattern)."""
    d, rng = tmp_path / "t", np.random.default_rng(0)
    ok = {"train": rng.integers(0, 50, 400), "val": rng.integers(0, 50, 100)}
    if case == "id >= vocab":
        ids = ok["train"].copy()
        ids[123] = 77
        write_tokens(d, {**ok, "train": ids}, vocab=50)
        return d, "train", r"train.bin': token id 77 at position 123 is >= the vocabulary size 50"
    write_tokens(d, ok, vocab=50)
    if case == "truncated":
        with open(d / "val.bin", "ab") as f:
            f.write(b"\x01")
        return d, "val", r"val.bin' is truncated: 201 bytes is not a multiple of the 2-byte uint16"
    if case == "count disagrees":
        (d / "val.bin").write_bytes((d / "val.bin").read_bytes()[:-20])
        return d, "val", r"val.bin' holds 90 tokens but .*meta.json' says 100"
    if case == "meta dtype":
        meta = json.loads((d / "meta.json").read_text())
        (d / "meta.json").write_text(json.dumps({**meta, "dtype": "int8"}))
        return d, "train", r"meta.json': dtype is 'int8', not one of"
    if case == "meta vocab":
        meta = json.loads((d / "meta.json").read_text())
        (d / "meta.json").write_text(json.dumps({**meta, "vocab_size": 70_000}))
        return d, "train", r"meta.json': vocab_size 70000 does not fit dtype uint16"
    if case == "meta json":
        (d / "meta.json").write_text("{not json")
        return d, "train", r"meta.json' is not a readable meta.json"
    if case == "empty split":
        write_tokens(d, {**ok, "val": ok["val"][:0]}, vocab=50)
        return d, "val", r"val.bin' holds no tokens: the 'val' split is empty"
    if case == "missing bin":
        os.remove(d / "train.bin")
        return d, "train", r"token file .*train.bin' does not exist"
    if case == "missing dir":
        return tmp_path / "nowhere", "train", r"nowhere' does not exist; pass a token directory"
    if case == "unlisted bin":
        (d / "train.bin").rename(d / "other.bin")
        return d / "other.bin", "train", r"other.bin' is none of the files .*meta.json' lists \(\['train.bin', 'val.bin'\]\)"
    if case == "meta splits":
        (d / "meta.json").write_text(json.dumps({"vocab_size": 50, "dtype": "uint16", "eod_id": 0, "splits": []}))
        return d, "train", r"meta.json': it lists no splits"
    if case == "unknown split":
        return d, "test", r"lists no split 'test' \(it has \['train', 'val'\]\)"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["id >= vocab", "truncated", "count disagrees", "meta dtype", "meta vocab",
                                  "meta json", "empty split", "missing bin", "missing dir", "unknown split",
                                  "unlisted bin", "meta splits"])
def test_bad_files_are_clear_errors_on_open(tmp_path, case):
    path, split, pattern = bad(tmp_path, case)
    with pytest.raises(ValueError, match=pattern):
        jp.data.TokenFile(path, split)


def test_a_file_leading_out_of_the_directory_is_refused(tmp_path):
    """A token directory is one artefact: a split file listed as ``../elsewhere/train.bin`` or as an absolute path,
    a ``train.bin`` or ``meta.json`` that is a link out, are refused (each would open a valid file elsewhere); a
    link inside the directory and the directory reached through a link open."""
    rng = np.random.default_rng()
    ids, other = rng.integers(0, 50, 300), rng.integers(0, 50, 300)
    d = write_tokens(tmp_path / "t", {"train": ids, "val": ids[:40]}, vocab=50)
    elsewhere = write_tokens(tmp_path / "elsewhere", {"train": other, "val": other[:40]}, vocab=50)
    meta = json.loads((d / "meta.json").read_text())
    out = r"leads to '.*elsewhere/{}', outside the token directory '.*t'"
    for name in ("../elsewhere/train.bin", str(elsewhere / "train.bin")):
        listed = {**meta, "splits": {**meta["splits"], "train": {**meta["splits"]["train"], "file": name}}}
        (d / "meta.json").write_text(json.dumps(listed))
        with pytest.raises(ValueError, match=r"meta.json's file of split 'train' \('" + re.escape(name) + r"'\) "
                           + out.format("train.bin")):
            jp.data.TokenFile(d, "train")
    (d / "meta.json").write_text(json.dumps(meta))
    (d / "train.bin").unlink()
    (d / "train.bin").symlink_to(elsewhere / "train.bin")
    for path in (d, d / "train.bin"):
        with pytest.raises(ValueError, match=r"file of split 'train' \('train.bin'\) " + out.format("train.bin")):
            jp.data.TokenFile(path, "train")
    (d / "train.bin").unlink()
    (d / "data").mkdir()
    ids.astype("<u2").tofile(d / "data" / "train.bin")
    (d / "train.bin").symlink_to(Path("data") / "train.bin")          # a link that stays inside opens
    (tmp_path / "link").symlink_to(d)                                   # and so does the directory through a link
    np.testing.assert_array_equal(np.asarray(jp.data.TokenFile(tmp_path / "link", "train").tokens), ids)
    (d / "meta.json").unlink()
    (d / "meta.json").symlink_to(elsewhere / "meta.json")
    with pytest.raises(ValueError, match=r"meta.json \('meta.json'\) " + out.format("meta.json")):
        jp.data.TokenFile(d, "val")


def word_level_tokenizer(words: list[str], eod: str):
    """A tokenizers WordLevel tokenizer of ``[UNK]`` + ``words`` with ``eod`` added as a special token."""
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.add_special_tokens([eod])
    return tok


def test_meta_fields_are_checked_against_the_tokenizer(tmp_path):
    """meta.json's vocab_size and eod_id must be the tokenizer's (tokenizers' own vocabulary size and id): a
    vocab_size raised from the tokenizer's to 50000, with or without the tokenizer hash, or another eod_id is
    refused on open, naming the field and both values."""
    rng = np.random.default_rng()
    eod = "<|endoftext|>"
    tok = word_level_tokenizer([f"w{i}" for i in range(int(rng.integers(20, 300)))], eod)
    vocab, eod_id = tok.get_vocab_size(with_added_tokens=True), tok.token_to_id(eod)
    d = tmp_path / "t"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    fields = {"eod_token": eod, "eod_id": eod_id,
              "tokenizer_sha256": hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()}
    ids = rng.integers(0, vocab, 500)
    write_tokens(d, {"train": ids}, vocab=vocab, meta=fields)
    assert jp.data.TokenFile(d).vocab_size == vocab
    meta = json.loads((d / "meta.json").read_text())
    for change, pattern in (
            ({"vocab_size": 50_000}, f"vocab_size 50000 is not the vocabulary size {vocab} of the tokenizer"),
            ({"vocab_size": 50_000, "tokenizer_sha256": None}, f"vocab_size 50000 is not the vocabulary size {vocab}"),
            ({"eod_id": 1}, f"eod_id 1 is not the id \\({eod_id}\\) of its eod_token '<\\|endoftext\\|>'")):
        edited = {k: v for k, v in {**meta, **change}.items() if v is not None}
        (d / "meta.json").write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=r"meta.json': " + pattern):
            jp.data.TokenFile(d)
    # the checks cannot be dodged by dropping what they read: the eod_token, or the tokenizer meta.json pins
    (d / "meta.json").write_text(json.dumps({k: v for k, v in {**meta, "eod_id": 1}.items() if k != "eod_token"}))
    with pytest.raises(ValueError, match=r"has an eod_id \(1\) but no eod_token"):
        jp.data.TokenFile(d)
    (d / "meta.json").write_text(json.dumps({**meta, "vocab_size": 50_000}))
    (d / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"tokenizer.json' is missing, but meta.json names its sha256"):
        jp.data.TokenFile(d)


def user_tokenizers(docs: list[str]):
    """A tokenizer of each tokenizers model kind trained on ``docs``, with special tokens added after training."""
    tk = pytest.importorskip("tokenizers")
    made = {}
    for kind, model, trainer in (
            ("BPE", tk.models.BPE(unk_token="[UNK]"), tk.trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]"],
                                                                            show_progress=False)),
            ("WordPiece", tk.models.WordPiece(unk_token="[UNK]"),
             tk.trainers.WordPieceTrainer(vocab_size=80, special_tokens=["[UNK]"], show_progress=False)),
            ("WordLevel", tk.models.WordLevel(unk_token="[UNK]"),
             tk.trainers.WordLevelTrainer(special_tokens=["[UNK]"])),
            ("Unigram", tk.models.Unigram(), tk.trainers.UnigramTrainer(vocab_size=60, special_tokens=["<unk>"],
                                                                         unk_token="<unk>", show_progress=False))):
        tok = tk.Tokenizer(model)
        tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
        tok.train_from_iterator(docs, trainer)
        tok.add_special_tokens(["<|pad|>", "[UNK]"])     # one new, one that may already be in the vocabulary
        made[kind] = tok
    return made


@pytest.mark.slow  # four tokenizer kinds trained and prepared; the fast sibling is above
def test_directories_of_every_tokenizer_kind_open_and_a_changed_vocab_size_is_refused(tmp_path):
    """A directory prepared with a user's tokenizer of each tokenizers model kind (BPE, WordPiece, WordLevel,
    Unigram; special tokens added after training) opens, its vocab_size tokenizers' own; the same meta.json with
    vocab_size one more, or 50000, is refused."""
    rng = np.random.default_rng()
    words = ["the", "cat", "sat", "on", "mat", "Zürich", "x+1", "naïve", "def", "return"]
    docs = [" ".join(rng.choice(words, int(rng.integers(1, 12)))) for _ in range(60)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    for kind, tok in user_tokenizers(docs).items():
        tok.save(str(tmp_path / f"{kind}.json"))
        out = tmp_path / kind
        tokens.prepare([tmp_path / "d.jsonl"], out, tokenizer=tmp_path / f"{kind}.json", val_fraction=0.0, workers=1,
                       progress=False)
        vocab = pytest.importorskip("tokenizers").Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size(
            with_added_tokens=True)
        assert jp.data.TokenFile(out).vocab_size == vocab, kind
        meta = json.loads((out / "meta.json").read_text())
        for wrong in (vocab + 1, 50_000):
            (out / "meta.json").write_text(json.dumps({**meta, "vocab_size": wrong}))
            with pytest.raises(ValueError, match=f"vocab_size {wrong} is not the vocabulary size {vocab} of the "
                                                 "tokenizer"):
                jp.data.TokenFile(out, check_ids=False)


def test_bad_arguments(stream, tmp_path):
    directory, _ = stream
    val = jp.data.TokenFile(directory, "val")
    with pytest.raises(ValueError, match=r"val.bin' \(split 'val'\) has 700 tokens, too few for seq_len 700"):
        val.batch(0, 0, 4, 700)
    with pytest.raises(ValueError, match="need seq_len >= 1"):
        val.batch(0, 0, 4, 0)
    for kwargs, match in ((dict(seed=-1), "seed=-1 must be an int >= 0"), (dict(step=1.5), "step=1.5"),
                          (dict(rows=slice(10, 20)), "rows=slice"), (dict(rows=3), "rows=3")):
        with pytest.raises(ValueError, match=match):
            val.batch(**{"seed": 0, "step": 0, "batch_size": 4, "seq_len": 8, **kwargs})
    with pytest.raises(ValueError, match=r"dtype='uint32' contradicts meta.json .* \(dtype 'uint16'\)"):
        jp.data.TokenFile(directory, dtype="uint32")
    (tmp_path / "x.bin").write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match=r"x.bin' has no meta.json beside it: pass dtype="):
        jp.data.TokenFile(tmp_path / "x.bin")
    with pytest.raises(ValueError, match=r"no tokenizer.json beside"):
        val.decode([1, 2])


# ------------------------------------------------------------------------------------ exact resume

def bigram_parts(vocab: int, dim: int = 16):
    """A model defined here: a plain pytree (embedding, output projection) and its next-token loss."""
    def init(rng):
        k1, k2 = jax.random.split(rng)
        return {"embed": 0.1 * jax.random.normal(k1, (vocab, dim)), "out": 0.1 * jax.random.normal(k2, (dim, vocab))}

    def loss(params, batch, rng):
        del rng
        logits = params["embed"][batch["inputs"]] @ params["out"]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], axis=-1)
        return nll.mean(), {}
    return init, loss


def run_job(file, mesh, stop: int, directory, sigterm_before: int | None = None):
    """Trains the bigram model on ``file``'s batches up to ``stop`` (resuming from ``directory``'s checkpoint),
    SIGTERM to this process while batch ``sigterm_before`` is built. Returns (result, batches, losses by step)."""
    init, loss = bigram_parts(file.vocab_size)
    tx = optax.adam(3e-2)
    manager = jp.checkpoint.CheckpointManager(directory, save_interval_steps=0)
    state, start = jp.checkpoint.restore_or_init(
        manager, lambda: jp.train.init_state(init, tx, jax.random.key(0), mesh=mesh),
        lambda: jp.train.abstract_state(init, tx, mesh=mesh))
    batches, losses = {}, {}

    def batch_fn(t):
        if t == sigterm_before:
            os.kill(os.getpid(), signal.SIGTERM)
        batches[t] = file.batch(5, t, 16, 12)
        return batches[t]
    hooks = [jp.loop.Hook(lambda s, _, m: losses.__setitem__(s, float(m["loss"])), every=1, needs_state=False),
             jp.loop.checkpoint(manager)]
    with jp.loop.PreemptionHandler() as preemption:
        result = jp.loop.run(jp.train.make_train_step(loss, tx, mesh=mesh), state, batch_fn, start, stop, hooks=hooks,
                             preemption=preemption)
    manager.close()
    return result, batches, losses


@pytest.mark.parametrize("resume_mesh", [dict(data=2, fsdp=4), dict(data=8)])
def test_sigterm_then_resume_gives_the_same_batches_and_losses(stream, tmp_path, mesh_factory, resume_mesh):
    """Killed (SIGTERM) at step 3 and resumed: batches from step 3 on bitwise equal to an uninterrupted run's; the
    losses and params bitwise equal on the same mesh, and within the parity tolerance on another mesh (a
    different reduction order). The TokenFile needs no data state: the batch is a function of the step."""
    file = jp.data.TokenFile(stream[0])
    mesh = mesh_factory(data=2, fsdp=4)
    straight, want_batches, want_losses = run_job(file, mesh, 7, tmp_path / "straight")
    stopped, _, first = run_job(file, mesh, 7, tmp_path / "run", sigterm_before=2)
    assert stopped.preempted and stopped.step == 3 and sorted(first) == [1, 2, 3]
    resumed, batches, losses = run_job(file, mesh_factory(**resume_mesh), 7, tmp_path / "run")
    assert sorted(batches) == [3, 4, 5, 6] and sorted(losses) == [4, 5, 6, 7]
    for t, batch in batches.items():
        for k in batch:
            np.testing.assert_array_equal(batch[k], want_batches[t][k])
    assert [first[s] for s in (1, 2, 3)] == [want_losses[s] for s in (1, 2, 3)]
    if resume_mesh == dict(data=2, fsdp=4):
        assert [losses[s] for s in range(4, 8)] == [want_losses[s] for s in range(4, 8)]
        for got, want in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(straight.state.params)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        np.testing.assert_allclose([losses[s] for s in range(4, 8)], [want_losses[s] for s in range(4, 8)], rtol=1e-5)


ROWS_SCRIPT = """
import json, sys
import numpy as np
import jaxpar as jp
from jaxpar import tokens
jp.initialize_distributed()
mesh = jp.make_mesh(data=2, fsdp=2, tensor=2)
rows = jp.data.process_slice(16, mesh)
batch = jp.data.TokenFile(sys.argv[1]).batch(3, 11, 16, 32, rows)
np.savez(f"{sys.argv[2]}/rows_{jax.process_index()}.npz", start=rows.start, stop=rows.stop, **batch)
"""


@pytest.mark.slow  # two processes through the launcher; .ci/run runs it
def test_two_processes_load_the_global_batch_once(stream, tmp_path):
    """2 processes x 4 devices on data=2 x fsdp=2 x tensor=2: each loads only its rows; together the rows are the
    one-process global batch, none twice."""
    script = tmp_path / "rows.py"
    script.write_text("import jax\n" + textwrap.dedent(ROWS_SCRIPT))
    job = launch(["-n", "2", str(script), str(stream[0]), str(tmp_path)])
    assert job.returncode == 0, job.stdout[-4000:]
    parts = [np.load(tmp_path / f"rows_{i}.npz") for i in (0, 1)]
    assert [(int(p["start"]), int(p["stop"])) for p in parts] == [(0, 8), (8, 16)]
    full = jp.data.TokenFile(stream[0]).batch(3, 11, 16, 32)
    for k in full:
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), full[k])
