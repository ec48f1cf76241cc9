"""jp.data.grain_batches (jaxpar/data/grain_pipeline.py): packing against a reference written here, process sharding,
exact resume through the checkpoint (also on another mesh and from 2 processes to 1), and clear errors.

The packing reference re-implements first-fit and concat-then-split packing in plain Python over the document
order that grain's own shuffle gives (``grain.MapDataset.range(n).shuffle(seed)``); the first-fit bins of one
flush leave grain in a seeded random order, so they are compared as a set per flush.
"""

from __future__ import annotations

import collections
import json
import re

import grain
import jax
import numpy as np
import pytest

import grain_worker as worker
import jaxpar as jp
from helpers import launch
from jaxpar.data import prepare as tokens
from jaxpar.data.grain_pipeline import KEYS

L = 8


def one_device_mesh():
    return jp.make_mesh(data=1, devices=jax.devices()[:1])


def random_docs(n: int, max_len: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 100, int(rng.integers(2, max_len + 1))).astype(np.int32) for _ in range(n)]


def shard_docs(docs, seed: int, num_shards: int, shard: int, count: int) -> list[np.ndarray]:
    """The first ``count`` documents of a shard: grain's shuffled order (epochs repeated), every S-th."""
    order = grain.MapDataset.range(len(docs)).shuffle(seed=seed).repeat()
    return [docs[int(order[shard + i * num_shards])] for i in range(count)]


def packed_row(docs: list[np.ndarray]) -> tuple:
    """A row of whole documents, written out: inputs, targets, segment ids 1..n, positions, loss mask."""
    row = np.zeros((5, L), np.int32)
    at = 0
    for s, doc in enumerate(docs, start=1):
        n = len(doc) - 1
        row[:, at:at + n] = [doc[:-1], doc[1:], np.full(n, s), np.arange(n), np.ones(n)]
        at += n
    return tuple(map(tuple, row))


def first_fit_flushes(docs: list[np.ndarray], num_bins: int) -> list[list[tuple]]:
    """First fit (Johnson 1973): each document into the first open bin with room; when none has room and
    ``num_bins`` are open, every open bin is emitted (one flush) and the document starts a new bin."""
    flushes, bins = [], []
    for doc in docs:
        n = len(doc) - 1
        for b in bins:
            if sum(len(d) - 1 for d in b) + n <= L:
                b.append(doc)
                break
        else:
            if len(bins) == num_bins:
                flushes.append([packed_row(b) for b in bins])
                bins = []
            bins.append([doc])
    return flushes


def shard_rows(batches: list[dict], shard: int, rows_per_shard: int) -> list[tuple]:
    keys = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
    return [tuple(tuple(int(v) for v in b[k][r]) for k in keys) for b in batches
            for r in range(shard * rows_per_shard, (shard + 1) * rows_per_shard)]


def test_first_fit_packing_matches_a_reference():
    docs = random_docs(30, L + 1, seed=1)               # 30 documents: several epochs in 8 batches
    seed, shards, bins, steps = 3, 2, 3, 8
    b = jp.data.grain_batches(grain.MapDataset.source(docs), global_batch=4, mesh=one_device_mesh(), seed=seed,
                              seq_len=L, num_shards=shards, num_packing_bins=bins)
    got = [jax.device_get(b(t)) for t in range(steps)]
    assert all(v.dtype == np.int32 and v.shape == (4, L) for g in got for v in g.values())
    for j in range(shards):
        rows = shard_rows(got, j, 2)
        flushes = first_fit_flushes(shard_docs(docs, seed, shards, j, 80), bins)
        at = 0
        for flush in flushes:
            if at + len(flush) > len(rows):
                break
            assert sorted(rows[at:at + len(flush)]) == sorted(flush), f"shard {j}, rows {at}.."
            at += len(flush)
        assert at >= len(rows) - bins                    # every complete flush was compared


def test_concat_then_split_packing_matches_a_reference():
    docs = random_docs(25, 12, seed=2)                  # documents longer than a row are split
    seed, shards, steps = 4, 2, 6
    b = jp.data.grain_batches(grain.MapDataset.source(docs), global_batch=4, mesh=one_device_mesh(), seed=seed,
                              seq_len=L, num_shards=shards, packing="concat_then_split")
    got = [jax.device_get(b(t)) for t in range(steps)]
    for j in range(shards):
        # reference: the documents' pairs back to back, cut every L; segments numbered and positions counted
        # from 0 within each row (a document cut at a row end continues as a new segment in the next row)
        stream = shard_docs(docs, seed, shards, j, 60)
        inputs = np.concatenate([d[:-1] for d in stream])
        targets = np.concatenate([d[1:] for d in stream])
        doc_id = np.concatenate([np.full(len(d) - 1, i) for i, d in enumerate(stream)])
        rows = shard_rows(got, j, 2)
        for r, row in enumerate(rows):
            ids = doc_id[r * L:(r + 1) * L]
            seg = np.cumsum(np.r_[1, ids[1:] != ids[:-1]])
            pos = np.concatenate([np.arange(c) for c in np.unique(seg, return_counts=True)[1]])
            want = (inputs[r * L:(r + 1) * L], targets[r * L:(r + 1) * L], seg, pos, np.ones(L))
            assert row == tuple(tuple(int(v) for v in w) for w in want), f"shard {j} row {r}"


def test_two_processes_load_disjoint_rows_whose_union_is_the_global_batch(monkeypatch):
    """The light sibling of the two-process test: this process plays process 0 and then 1 of 2 (their
    rows of the batch, as ``process_batch_rows`` gives them); each builds only its shards."""
    docs = grain.MapDataset.source(random_docs(50, L + 1, seed=3))
    kwargs = dict(global_batch=8, mesh=one_device_mesh(), seed=0, seq_len=L, num_shards=4)
    whole = jp.data.grain_batches(docs, **kwargs)
    want = [whole.local_batch() for _ in range(3)]
    halves = []
    for p in (0, 1):
        monkeypatch.setattr(jp.sharding.rules, "process_batch_rows", lambda n, mesh, rules, p=p: slice(p * n // 2,
                                                                                                  (p + 1) * n // 2))
        b = jp.data.grain_batches(docs, **kwargs)
        assert list(b.shards) == [2 * p, 2 * p + 1]
        halves.append([b.local_batch() for _ in range(3)])
    for t in range(3):
        for k, v in want[t].items():
            np.testing.assert_array_equal(np.concatenate([halves[0][t][k], halves[1][t][k]]), v)


def test_sigterm_and_resume_give_the_same_batches_and_losses(tmp_path):
    """Bigram model (defined in grain_worker): 6 steps straight == SIGTERM while batch 2 is built (saved at
    step 3 with the data state), resume: rows and losses bitwise. Resumed on another mesh (data=8 -> data=4 x fsdp=2):
    the same rows bitwise, the losses within the parity tolerance (another reduction order)."""
    straight, killed, moved = tmp_path / "straight", tmp_path / "killed", tmp_path / "moved"
    worker.train(straight, 6, (8, 1, 1), "bigram")
    for run, resume_mesh in ((killed, (8, 1, 1)), (moved, (4, 2, 1))):
        start, stopped = worker.train(run, 6, (8, 1, 1), "bigram", sigterm_before_step=2)
        assert (start, stopped) == (0, 3)
        ckpt = jp.checkpoint.CheckpointManager(run / "ckpt")
        assert ckpt.all_steps() == [2, 3] and ckpt.restore_extras(3)["data"]["step"] == 3
        assert worker.train(run, 6, resume_mesh, "bigram") == (3, None)
    want_rows = worker.read_jsonl(straight / "rows_0.jsonl")
    want_loss = worker.read_jsonl(straight / "losses.jsonl")
    for run in (killed, moved):
        assert worker.read_jsonl(run / "rows_0.jsonl") == want_rows
    assert worker.read_jsonl(killed / "losses.jsonl") == want_loss
    got = worker.read_jsonl(moved / "losses.jsonl")
    assert [r["step"] for r in got] == list(range(1, 7))
    got, want = np.array([r["loss"] for r in got]), np.array([r["loss"] for r in want_loss])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    print(f"\n[grain resume] other mesh: losses max rel diff {np.max(np.abs(got / want - 1)):.1e}")


@pytest.mark.slow  # two processes, then resumes here: subprocesses and several compiles; .ci/run runs it
def test_two_processes_sigterm_resume_on_one_process_and_another_mesh(tmp_path):
    """The GPT on packed batches, 2 processes x 4 devices (2x2x2), SIGTERM while batch 3 is built: stopped and
    saved at step 4. Resumed here, 1 process, data=4 x tensor=2: from step 4 on the batches are bitwise those of
    an uninterrupted one-process run, the losses equal within the parity tolerance (another mesh sums in
    another order). Before the stop, the union of the two processes' rows is the global batch, no row twice."""
    two, ref = tmp_path / "two", tmp_path / "ref"
    job = launch(["-n", "2", "tests/grain_worker.py", "--out", str(two), "--steps", "8", "--mesh", "2,2,2",
                  "--sigterm-before-step", "3"])
    assert job.returncode == 0 and "trained from step 0 to 4 (preempted)" in job.stdout, job.stdout[-4000:]
    assert worker.train(two, 8, (4, 1, 2), "gpt") == (4, None)
    worker.train(ref, 8, (2, 2, 2), "gpt")
    want = {r["step"]: r["rows"] for r in worker.read_jsonl(ref / "rows_0.jsonl")}
    assert all(len(rows) == worker.GLOBAL_BATCH for rows in want.values())
    procs = [worker.read_jsonl(two / f"rows_{p}.jsonl") for p in (0, 1)]
    for t in range(4):
        parts = [next(r["rows"] for r in rows if r["step"] == t) for rows in procs]
        assert not set(parts[0]) & set(parts[1]), f"step {t}: a row loaded by both processes"
        assert {**parts[0], **parts[1]} == want[t], f"step {t}"
    resumed = [r for r in procs[0] if r["step"] >= 4]
    assert [r["step"] for r in resumed] == [4, 5, 6, 7]
    assert all(r["rows"] == want[r["step"]] for r in resumed)
    got = worker.read_jsonl(two / "losses.jsonl")
    assert [r["step"] for r in got] == list(range(1, 9))
    got = np.array([r["loss"] for r in got])
    want = np.array([r["loss"] for r in worker.read_jsonl(ref / "losses.jsonl")])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    print(f"\n[grain 2 -> 1 process] losses max rel diff: steps 1-4 {np.max(np.abs(got[:4] / want[:4] - 1)):.1e}, "
          f"5-8 {np.max(np.abs(got[4:] / want[4:] - 1)):.1e}")


def test_restored_state_must_match_the_pipeline(tmp_path):
    docs = grain.MapDataset.source(random_docs(20, L + 1, seed=4))
    mesh = one_device_mesh()
    b = jp.data.grain_batches(docs, global_batch=2, mesh=mesh, seed=0, seq_len=L)
    b(0)
    state = json.loads(json.dumps(b.get_state()))
    for change, name in ((dict(seq_len=L + 1), "seq_len"), (dict(seed=1), "seed"), (dict(num_shards=1), "num_shards")):
        other = jp.data.grain_batches(docs, **{**dict(global_batch=2, mesh=mesh, seed=0, seq_len=L), **change})
        with pytest.raises(ValueError, match=f"another pipeline: its {name} is"):
            other.set_state(state)
    with pytest.raises(ValueError, match="not a grain_batches state"):
        b.set_state({"parent": {"next_index": 3}})
    with pytest.raises(ValueError, match="asked for batch 0, the next one is 1.*restore_data"):
        b(0)
    ckpt = jp.checkpoint.CheckpointManager(tmp_path / "ckpt")
    ckpt.save(1, {"w": np.zeros(2, np.float32)}, force=True)
    ckpt.wait()
    with pytest.raises(jp.checkpoint.CheckpointError, match="holds no data state"):
        jp.loop.restore_data(ckpt, b, 1)
    with pytest.raises(TypeError, match="get_state"):
        jp.loop.checkpoint(ckpt, data=object())


def test_bad_inputs_are_clear_errors():
    mesh = one_device_mesh()
    docs = random_docs(10, L + 1, seed=5)
    ds = grain.MapDataset.source(docs)
    with pytest.raises(TypeError, match="needs a grain.MapDataset of documents, got list"):
        jp.data.grain_batches(docs, global_batch=2, mesh=mesh, seed=0, seq_len=L)
    with pytest.raises(TypeError, match="got an IterDataset"):
        jp.data.grain_batches(ds.to_iter_dataset(), global_batch=2, mesh=mesh, seed=0, seq_len=L)
    with pytest.raises(ValueError, match="global_batch=6 is not divisible by num_shards=4"):
        jp.data.grain_batches(ds, global_batch=6, mesh=mesh, seed=0, seq_len=L, num_shards=4)
    with pytest.raises(ValueError, match=r"global batch 6 is not divisible by the batch mesh axes \(data\*fsdp = 4\)"):
        jp.data.grain_batches(ds, global_batch=6, mesh=jp.make_mesh(data=4, devices=jax.devices()[:4]), seed=0,
                              seq_len=L, num_shards=3)
    with pytest.raises(ValueError, match="packing='best'"):
        jp.data.grain_batches(ds, global_batch=2, mesh=mesh, seed=0, seq_len=L, packing="best")
    long = grain.MapDataset.source([np.arange(L + 2, dtype=np.int32)])
    with pytest.raises(ValueError, match=r"document of 10 tokens \(9 input/target pairs\) is longer than a row"):
        jp.data.grain_batches(long, global_batch=1, mesh=mesh, seed=0, seq_len=L)(0)
    floats = grain.MapDataset.source([np.ones(4, np.float32)])
    with pytest.raises(ValueError, match="documents must be 1-D integer token ids"):
        jp.data.grain_batches(floats, global_batch=1, mesh=mesh, seed=0, seq_len=L)(0)


@pytest.mark.parametrize("packing", ["first_fit", "concat_then_split"])
def test_state_through_json_resumes_exactly_at_every_step(packing):
    """The state as a checkpoint stores it (JSON): a pipeline restored after batch k gives batches k, k+1, ... of the
    uninterrupted one, for both packings (grain's concat-then-split marker is a tuple that JSON turns into a list)."""
    docs = grain.MapDataset.source(random_docs(40, 3 * L, seed=6) if packing == "concat_then_split"
                                   else random_docs(40, L + 1, seed=6))
    make = lambda: jp.data.grain_batches(docs, global_batch=2, mesh=one_device_mesh(), seed=3, seq_len=L,
                                         packing=packing)
    straight = make()
    want = [jax.device_get(straight(t)) for t in range(6)]
    for k in range(4):
        first = make()
        for t in range(k):
            first(t)
        resumed = make()
        resumed.set_state(json.loads(json.dumps(first.get_state())))
        for t in range(k, 6):
            got = jax.device_get(resumed(t))
            assert all(np.array_equal(got[key], want[t][key]) for key in got), (packing, k, t)


def test_a_truncated_state_is_refused_before_anything_is_applied_and_running_out_is_named():
    docs = grain.MapDataset.source(random_docs(6, L + 1, seed=7))
    b = jp.data.grain_batches(docs, global_batch=2, mesh=one_device_mesh(), seed=0, seq_len=L, num_epochs=1)
    state = b.get_state()
    b(0)
    with pytest.raises(ValueError, match="holds 1 shard states; this pipeline has num_shards=2"):
        b.set_state({**state, "shards": state["shards"][:1]})
    assert b.step == 1
    with pytest.raises(ValueError, match="ran out of documents at batch"):
        for t in range(1, 10):
            b(t)
    big = grain.MapDataset.source([np.asarray([3, 2 ** 32 + 7, 4], np.int64)])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 2\*\*31\)"):
        jp.data.grain_batches(big, global_batch=1, mesh=one_device_mesh(), seed=0, seq_len=L)(0)


def test_a_garbage_shard_state_is_refused_whole_naming_the_shard_and_field():
    """A state whose shard 1 is ``{"foo": 1}`` is refused with a ValueError naming shard 1 and its missing field
    ``parent`` (not grain's KeyError), and nothing is applied: neither shard 0 before it nor the step change, so
    the next batch is the one an untouched twin gives."""
    docs = grain.MapDataset.source(random_docs(16, L + 1, seed=None))
    make = lambda: jp.data.grain_batches(docs, global_batch=2, mesh=one_device_mesh(), seed=1, seq_len=L,
                                         shuffle=False)
    b, twin = make(), make()
    state = json.loads(json.dumps(b.get_state()))
    for _ in range(2):
        b.local_batch(), twin.local_batch()
    state["shards"][1] = {"foo": 1}
    with pytest.raises(ValueError, match=r"shard 1 is not a shard state of this pipeline: field 'parent' is missing "
                                         r"\(the shard state has \['foo'\]"):
        b.set_state(state)
    assert b.step == 2
    good = json.loads(json.dumps(b.get_state()))
    paths = []

    def ints(x, path):   # every int field of shard 1's state, by path
        if isinstance(x, dict):
            for k, v in x.items():
                ints(v, (*path, k))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                ints(v, (*path, i))
        elif isinstance(x, int) and not isinstance(x, bool):
            paths.append(path)
    ints(good["shards"][1], ())
    assert paths
    for path in paths:   # a position or count below -1 (grain's marker) is refused, naming the field
        bad = json.loads(json.dumps(good))
        leaf = bad["shards"][1]
        for k in path[:-1]:
            leaf = leaf[k]
        leaf[path[-1]] = -10 ** 6
        with pytest.raises(ValueError, match=r"shard 1 is not a shard state of this pipeline: field .* is -1000000"):
            b.set_state(bad)
    assert b.step == 2
    got, want = b.local_batch(), twin.local_batch()
    assert all(np.array_equal(got[k], want[k]) for k in want)


def segments(batches: list[dict]) -> list[tuple]:
    """Each packed document of the batches' rows as (inputs, targets), read back by its segment id."""
    out = []
    for b in batches:
        for r in range(b["segment_ids"].shape[0]):
            seg = b["segment_ids"][r]
            for s in np.unique(seg[seg > 0]):
                out.append((tuple(b["inputs"][r][seg == s]), tuple(b["targets"][r][seg == s])))
    return out


def test_a_finite_pass_serves_every_target_token_once_and_ends():
    """shuffle=False, num_epochs=1, 3 shards, shard 0 dealt documents filling a row each and the others short
    ones, so shards 1 and 2 run out first: iterating gives every document exactly once (read back by segment; the
    target-token count is that of the documents), rows of shards that ran out padded with loss mask 0, then the
    iteration ends (StopIteration); asking for a batch after it is named."""
    rng = np.random.default_rng()
    docs = [rng.integers(0, 100, L + 1 if i % 3 == 0 else int(rng.integers(2, 5))).astype(np.int32)
            for i in range(int(rng.integers(18, 30)))]
    b = jp.data.grain_batches(grain.MapDataset.source(docs), global_batch=3, mesh=one_device_mesh(), seed=0,
                              seq_len=L, shuffle=False, num_epochs=1, num_packing_bins=2)
    got = [jax.device_get(batch) for batch in b]
    assert sum(int(g["loss_mask"].sum()) for g in got) == sum(len(d) - 1 for d in docs)
    assert sorted(segments(got)) == sorted((tuple(d[:-1]), tuple(d[1:])) for d in docs)
    assert all(np.array_equal(g["loss_mask"], g["segment_ids"] > 0) for g in got)
    assert b.step == len(got) and not got[-1]["loss_mask"][1:].any()     # shards 1 and 2 ran out before the end
    with pytest.raises(StopIteration):
        next(b)
    with pytest.raises(ValueError, match=f"ran out of documents at batch {len(got)}: the pass over num_epochs=1 "
                                         f"served every document in batches 0..{len(got) - 1}"):
        b(len(got))


def leaf_paths(state, path=()):
    """The paths (tuples of keys) of a nested dict's leaves."""
    if isinstance(state, dict):
        return [q for k, v in state.items() for q in leaf_paths(v, (*path, k))]
    return [path]


def mutations(shard: dict):
    """Ways to break a real shard state, each with the message part naming the field: a shard of another kind,
    none, and per leaf: removed, an unknown sibling, a string, a bool (an int leaf) or a sequence of another
    length and a string element (a sequence leaf, as grain's concat-then-split marker)."""
    def edit(path, value=None, pop=False):
        out = json.loads(json.dumps(shard))
        node = out
        for k in path[:-1]:
            node = node[k]
        node.pop(path[-1]) if pop else node.__setitem__(path[-1], value)
        return out
    yield {"foo": 1}, f"field '{next(iter(shard))}' is missing"
    yield None, "the shard state is None of type NoneType"
    for path in leaf_paths(shard):
        name, leaf = ".".join(path), shard
        for k in path:
            leaf = leaf[k]
        yield edit(path, pop=True), f"field '{name}' is missing"
        yield edit((*path[:-1], "extra"), 0), f"field '{'.'.join((*path[:-1], 'extra'))}' is unknown"
        if isinstance(leaf, list):
            yield edit(path, "3"), f"field '{name}' is '3', expected a sequence of {len(leaf)} values"
            yield edit(path, [*leaf, 0]), f"field '{name}' is {[*leaf, 0]!r}, expected a sequence of {len(leaf)}"
            yield edit(path, ["3", *leaf[1:]]), f"field '{name}[0]' is '3' of type str"
        else:
            yield edit(path, "3"), f"field '{name}' is '3' of type str"
            yield edit(path, True), f"field '{name}' is True of type bool"


@pytest.mark.slow  # about 100 refusals over both packings and two process layouts; the fast sibling is above
@pytest.mark.parametrize("packing", ["first_fit", "concat_then_split"])
def test_every_kind_of_bad_shard_state_is_refused_whole(monkeypatch, packing):
    """Each shard (of this process, or one another process builds) broken in every way: refused, naming the shard
    and the field, before anything is applied; after all the refusals the batches are an untouched twin's, and
    the state taken before them still resumes exactly."""
    docs = grain.MapDataset.source(random_docs(40, 3 * L if packing == "concat_then_split" else L + 1, seed=None))
    make = lambda: jp.data.grain_batches(docs, global_batch=4, mesh=one_device_mesh(), seed=2, seq_len=L,
                                         num_shards=4, packing=packing)
    whole = make()
    for _ in range(3):
        whole.local_batch()
    saved = json.loads(json.dumps(whole.get_state()))
    for rows in (None, slice(2, 4)):                     # every shard here, or shards 2 and 3 of 4 (process 1 of 2)
        if rows is not None:
            monkeypatch.setattr(jp.sharding.rules, "process_batch_rows", lambda n, mesh, rules: rows)
        b, twin, resumed = make(), make(), make()
        for _ in range(3):
            b.local_batch(), twin.local_batch()
        refused = 0
        for j in range(4):
            for shard, field in mutations(saved["shards"][j]):
                with pytest.raises(ValueError, match=f"state's shard {j} is not a shard state of this pipeline: "
                                                     + re.escape(field)):
                    b.set_state({**saved, "step": 7, "shards": [*saved["shards"][:j], shard,
                                                                *saved["shards"][j + 1:]]})
                refused += 1
        assert refused >= 4 * 10 and b.step == 3
        resumed.set_state(saved)
        for _ in range(3):
            want = twin.local_batch()
            for got in (b.local_batch(), resumed.local_batch()):
                assert all(np.array_equal(got[k], want[k]) for k in want)


def held_out_documents(tmp_path) -> tuple[list[np.ndarray], int]:
    """The validation documents of a token directory prepared here (CPython's documentation, byte-level BPE),
    read back from val.bin with numpy and split after each end-of-document id; and the split's target-token
    count (each document of n tokens gives n - 1 input/target pairs)."""
    text = jp.data.default_text()
    (tmp_path / "pydoc.txt").write_text(text[:text.index("\n\n", 40_000)])
    meta = tokens.prepare([tmp_path / "pydoc.txt"], tmp_path / "tok", train_bpe_vocab=400, val_fraction=0.2,
                          workers=1, progress=False)
    ids = np.fromfile(tmp_path / "tok" / "val.bin", "<u2").astype(np.int32)
    docs = np.split(ids, np.flatnonzero(ids == meta["eod_id"])[:-1] + 1)
    assert len(docs) == meta["splits"]["val"]["documents"] and all(d[-1] == meta["eod_id"] for d in docs)
    return docs, len(ids) - len(docs)


def pair_counts(batches: list[dict]) -> collections.Counter:
    return collections.Counter((int(i), int(t)) for b in batches
                               for i, t in zip(b["inputs"][b["loss_mask"] > 0], b["targets"][b["loss_mask"] > 0]))


@pytest.mark.slow  # 14 finite passes over a prepared split and their resumes; the fast sibling is above
def test_finite_passes_over_a_held_out_split_serve_every_target_token_once(tmp_path):
    """A held-out split (val.bin of a prepared directory, read back independently): every finite pass (both
    packings, shuffled or not, 1, 2 or 4 shards, num_epochs 1 or 2) serves exactly the split's target tokens
    num_epochs times (each input/target pair as often as the documents hold it; first-fit rows hold whole
    documents) and then ends; a pass resumed from its state after any batch (through JSON) gives the same
    remaining batches and ends at the same batch."""
    docs, targets = held_out_documents(tmp_path)
    want_pairs = collections.Counter((int(i), int(t)) for d in docs for i, t in zip(d[:-1], d[1:]))
    assert sum(want_pairs.values()) == targets > 1000
    longest = max(len(d) for d in docs) - 1
    cases = [(packing, shuffle, shards, 1) for packing in ("first_fit", "concat_then_split")
             for shuffle in (False, True) for shards in (1, 2, 4)]
    cases += [("first_fit", True, 2, 2), ("concat_then_split", False, 4, 2)]
    for packing, shuffle, shards, epochs in cases:
        seq_len = longest if packing == "first_fit" else 32
        make = lambda: jp.data.grain_batches(grain.MapDataset.source(docs), global_batch=4, mesh=one_device_mesh(),
                                             seed=3, seq_len=seq_len, packing=packing, num_shards=shards,
                                             shuffle=shuffle, num_epochs=epochs)
        got = [jax.device_get(b) for b in make()]
        case = (packing, shuffle, shards, epochs)
        assert sum(int(g["loss_mask"].sum()) for g in got) == epochs * targets, case
        assert pair_counts(got) == collections.Counter({k: epochs * v for k, v in want_pairs.items()}), case
        if packing == "first_fit":
            assert sorted(segments(got)) == sorted((tuple(d[:-1]), tuple(d[1:])) for d in docs for _ in range(epochs))
        if shards == 4 and epochs == 1:
            for k in range(len(got)):
                first = make()
                for _ in range(k):
                    first.local_batch()
                resumed = make()
                resumed.set_state(json.loads(json.dumps(first.get_state())))
                rest = [jax.device_get(b) for b in resumed]
                assert len(rest) == len(got) - k, (case, k)
                assert all(np.array_equal(r[key], g[key]) for r, g in zip(rest, got[k:]) for key in g), (case, k)
    print(f"\n[grain finite pass] {targets} held-out target tokens of {len(docs)} documents, each served once "
          f"per epoch in {len(cases)} passes")


@pytest.mark.slow  # two processes through the launcher; the fast sibling is above
def test_two_processes_end_a_finite_pass_at_the_same_batch(tmp_path):
    """2 processes x 4 devices, a finite pass whose process-0 shards run out batches before process 1's: both
    take every batch up to the same last one (process 0's rows padded), and together their rows hold every
    document once."""
    job = launch(["-n", "2", "tests/grain_worker.py", "--out", str(tmp_path), "--steps", "0", "--finite-pass"])
    assert job.returncode == 0, job.stdout[-4000:]
    procs = [worker.read_jsonl(tmp_path / f"rows_{p}.jsonl") for p in (0, 1)]
    assert [r["step"] for r in procs[0]] == [r["step"] for r in procs[1]] == list(range(len(procs[0])))
    keys = sorted(KEYS)
    batches = [{k: np.array([rows[r][keys.index(k)] for r in sorted(rows, key=int)]) for k in keys}
               for rows in ({**a["rows"], **b["rows"]} for a, b in zip(*procs))]
    assert all(len(b["inputs"]) == worker.GLOBAL_BATCH for b in batches)
    docs = worker.finite_pass_documents()
    assert sorted(segments(batches)) == sorted((tuple(d[:-1]), tuple(d[1:])) for d in docs)
    early = [t for t, b in enumerate(batches) if not b["loss_mask"][:worker.GLOBAL_BATCH // 2].any()]
    assert early and early[-1] == len(batches) - 1      # process 0's rows were all padding before the end
    print(f"\n[grain finite pass, 2 processes] {len(batches)} batches, process 0 padded from batch {early[0]}")
