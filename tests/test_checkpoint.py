"""jaxpar/train/checkpoint.py: resume parity after SIGKILL, reshard on restore, preemption, crashes mid-save, bad input.

The training job is ``tests/ckpt_worker.py`` (small GPT on data=2 x fsdp=2 x tensor=2, mixed fp16 with
dynamic loss scaling, magnitude pruning), run in this process or as a subprocess that a test kills.

No test depends on timing: a test signals a subprocess only after reading the line the subprocess prints
at the exact point (``SYNC ...``: after checkpoint n is final, inside orbax's writer mid-save, once the
SIGTERM handler ran), while the subprocess blocks there. ``SUBPROCESS_TIMEOUT`` is only a hang guard.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ckpt_worker as worker
import jaxpar as jp
from helpers import SMALL_GPT, assert_scalar_close, assert_tree_close, gpt_parts

ROOT = Path(__file__).resolve().parents[1]
SPEC = worker.Spec(mesh=(2, 2, 2), precision="fp16", pruning=True)
SUBPROCESS_TIMEOUT = 600  # seconds: a hang guard only (every subprocess is killed after it), never a sync


# ---------------------------------------------------------------------------------------------- helpers

def host(tree):
    """The tree on the host, typed PRNG keys as their key data (so trees compare leaf by leaf)."""
    unkey = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return jax.device_get(jax.tree.map(unkey, tree))


def assert_bitwise(got, ref):
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(host(got))[0], jax.tree.leaves(host(ref))):
        assert g.dtype == r.dtype and np.array_equal(g, r), f"{jax.tree_util.keystr(path)} differs"


def bytes_per_device(tree) -> dict[int, int]:
    """Bytes each device holds: summed over every array's addressable shards."""
    out = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] += shard.data.nbytes
    return dict(out)


def train_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return [r for r in rows if r["split"] == "train"]


def start(args: list[str]) -> subprocess.Popen:
    """``python *args`` (stdout and stderr merged, as text); killed after SUBPROCESS_TIMEOUT if still running."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    proc.guard = threading.Timer(SUBPROCESS_TIMEOUT, proc.kill)  # a hang guard: a kill makes readline() end
    proc.guard.daemon = True
    proc.guard.start()
    proc.seen = []  # the output read_until consumed
    return proc


def read_until(proc: subprocess.Popen, line: str) -> None:
    """Blocks reading ``proc``'s output until it prints exactly ``line``; fails if its output ends first."""
    for got in iter(proc.stdout.readline, ""):
        proc.seen.append(got)
        if got.rstrip("\n").rsplit("\r", 1)[-1] == line:  # after a progress bar's carriage returns
            return
    proc.wait()
    proc.guard.cancel()
    pytest.fail(f"the process exited with {proc.returncode} before printing {line!r}:\n{''.join(proc.seen)[-3000:]}")


def finish(proc: subprocess.Popen) -> str:
    """Waits for ``proc`` to exit (the hang guard kills it after SUBPROCESS_TIMEOUT); returns all its output."""
    out = proc.communicate()[0]
    proc.guard.cancel()
    return "".join(proc.seen) + out


# ------------------------------------------------------------------------------------- a saved state

@pytest.fixture(scope="module")
def saved(tmp_path_factory, devices):
    """A state trained 3 steps on data=2 x fsdp=2 x tensor=2 (f32, loss scaling, pruning), saved at step 3."""
    del devices
    spec = dataclasses.replace(SPEC, precision="f32")
    mesh, init_fn, loss_fn, tx, policy = worker.build(spec)
    state = jp.train.init_state(init_fn, tx, jax.random.key(0), mesh=mesh, policy=policy)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False)
    for t in range(3):
        state, _ = step(state, worker.batch(spec, t, mesh))
    directory = tmp_path_factory.mktemp("saved")
    with jp.checkpoint.CheckpointManager(directory, max_to_keep=None) as ckpt:
        assert ckpt.save(3, state, {"data_step": 3, "note": "three steps"})
    return dict(spec=spec, dir=directory, state=state, step=step, init_fn=init_fn, loss_fn=loss_fn, tx=tx,
                policy=policy)


def test_round_trip_keeps_types_and_bits(saved):
    ckpt = jp.checkpoint.CheckpointManager(saved["dir"])
    assert ckpt.all_steps() == [3] and ckpt.latest_step() == 3
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2)
    target = jp.train.abstract_state(saved["init_fn"], saved["tx"], mesh=mesh)
    state = ckpt.restore(target=target)
    assert type(state) is jp.train.TrainState
    assert type(state.opt_state) is jp.precision.LossScaleState
    adam, pruning = state.opt_state.inner_state
    assert type(adam[0]) is optax.ScaleByAdamState and type(pruning) is jp.pruning.MagnitudePruningState
    assert jnp.issubdtype(state.rng.dtype, jax.dtypes.prng_key)
    assert_bitwise(state, saved["state"])
    assert all(x.sharding == t.sharding for x, t in zip(jax.tree.leaves(state), jax.tree.leaves(target)))
    assert int(state.opt_state.inner_state[1].count) == 3
    assert ckpt.restore_extras() == {"data_step": 3, "note": "three steps"}
    assert ckpt.restore_extras(3)["data_step"] == 3
    assert not ckpt.save(3, state, force=True)  # a step is saved once
    ckpt2 = jp.checkpoint.CheckpointManager(saved["dir"] / "more", save_interval_steps=2)
    assert not ckpt2.save(3, state) and ckpt2.save(4, state) and not ckpt2.save(4, state, force=True)
    assert ckpt2.save(5, state, force=True)
    ckpt2.close()
    assert ckpt2.all_steps() == [4, 5]


@pytest.mark.parametrize("layout", [pytest.param(dict(data=8), marks=pytest.mark.slow), dict(fsdp=4),
                                    pytest.param(dict(), marks=pytest.mark.slow)], ids=["data8", "fsdp4", "single"])
def test_reshard_on_restore(saved, layout):
    n = int(np.prod(list(layout.values()))) if layout else 1
    mesh = jp.make_mesh(**{"data": 1, **layout}, devices=jax.devices()[:n])
    args = (saved["init_fn"], saved["tx"])
    state = jp.checkpoint.CheckpointManager(saved["dir"]).restore(target=jp.train.abstract_state(*args, mesh=mesh))
    assert_bitwise(state, saved["state"])
    fresh = jp.train.init_state(*args, jax.random.key(0), mesh=mesh)
    assert bytes_per_device(state) == bytes_per_device(fresh)
    assert set(bytes_per_device(state)) == {d.id for d in mesh.devices.flat}
    # Training goes on from the restored state: step 4 here equals step 4 on the saving layout.
    batch = worker.batch(saved["spec"], 3, mesh)
    step = jp.train.make_train_step(saved["loss_fn"], saved["tx"], mesh=mesh)
    got, m = step(state, batch)
    ref, m_ref = saved["step"](saved["state"], batch)
    assert_scalar_close(m["loss"], m_ref["loss"], what="loss after restore")
    assert_tree_close(got.params, ref.params, what="params one step after restore")


def test_restore_into_another_model_names_the_path(saved):
    ckpt = jp.checkpoint.CheckpointManager(saved["dir"])
    init_fn, _ = gpt_parts(dataclasses.replace(SMALL_GPT, d_model=32, num_heads=4, head_dim=0))
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2)
    with pytest.raises(ValueError, match=r"\.params\['blocks'\]\['down_bias'\].*saved shape \(2, 64\) float32, "
                                         r"target shape \(2, 32\) float32"):
        ckpt.restore(target=jp.train.abstract_state(init_fn, worker.make_tx(saved["spec"], init_fn), mesh=mesh))
    with pytest.raises(ValueError, match=r"has no leaf \.opt_state\[0\]\.count \(the target's is \(\) int32\)"):
        ckpt.restore(target=jp.train.abstract_state(saved["init_fn"], optax.adamw(1e-3), mesh=mesh))


def test_restore_without_target_is_a_type_error(saved):
    ckpt = jp.checkpoint.CheckpointManager(saved["dir"])
    with pytest.raises(TypeError, match="target="):
        ckpt.restore()
    with pytest.raises(TypeError, match="target="):
        ckpt.restore(3, target=None)
    with pytest.raises(TypeError, match="no sharding"):
        ckpt.restore(target={"w": jax.ShapeDtypeStruct((2,), jnp.float32)})


def test_not_a_checkpoint_is_a_clear_error(tmp_path):
    target = {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=jp.sharding.replicated(jp.make_mesh()))}
    with pytest.raises(jp.checkpoint.CheckpointError, match="no checkpoint in"):
        jp.checkpoint.CheckpointManager(tmp_path / "empty").restore(target=target)
    (tmp_path / "other" / "7").mkdir(parents=True)
    (tmp_path / "other" / "7" / "weights.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(jp.checkpoint.CheckpointError, match="is not a jaxpar checkpoint"):
        jp.checkpoint.CheckpointManager(tmp_path / "other").restore(target=target)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        jp.checkpoint.CheckpointManager(tmp_path / "file")
    with pytest.raises(TypeError, match="JSON"):
        jp.checkpoint.CheckpointManager(tmp_path / "x").save(1, {"w": jnp.ones(8)}, extras={"bad": object()})


# orbax leaves tensorstore reads pending when a read fails; their callbacks then meet a closed event loop.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupted_latest_checkpoint_is_a_clear_error(tmp_path):
    """Policy: a corrupted or truncated checkpoint raises CheckpointError naming the step and the earlier
    steps to use instead; there is no silent fallback."""
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "fsdp"))
    make = lambda v: {"w": jax.device_put(jnp.arange(4096.0).reshape(64, 64) + v, sharding),
                      "rng": jax.random.key(v)}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), make(0))
    ckpt = jp.checkpoint.CheckpointManager(tmp_path, max_to_keep=None, async_save=False)
    for s in (1, 2, 3, 4):
        ckpt.save(s, make(s))
    ckpt.wait()

    # A value that does not match its checksum (as a flipped bit would give).
    meta_file = tmp_path / "2" / "jaxpar" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["leaves"][1]["checksum"] ^= 1
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(jp.checkpoint.CheckpointError, match=r"step 2 .* is corrupted: \['w'\].*restore\(step=1"):
        ckpt.restore(2, target=target)
    # Truncated array files.
    for f in (tmp_path / "3" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(jp.checkpoint.CheckpointError, match=r"step 3 .*(truncated or corrupted|is corrupted)"):
        ckpt.restore(3, target=target)
    # Overwritten bytes in the middle of the array files, the latest checkpoint: never a silent wrong restore.
    for f in (tmp_path / "4" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d" and f.stat().st_size > 64:
            data = bytearray(f.read_bytes())
            data[len(data) // 2: len(data) // 2 + 16] = bytes(16)
            f.write_bytes(bytes(data))
    with pytest.raises(jp.checkpoint.CheckpointError, match=r"step 4 .*restore\(step=3"):
        ckpt.restore(target=target)
    assert_bitwise(ckpt.restore(1, target=target), make(1))


def test_crash_during_async_save_keeps_the_previous_checkpoint(tmp_path):
    """SIGKILL inside orbax's background writer, after it wrote an item of step 2 into the temporary step
    directory (the writer signals, then blocks): step 1 stays the only checkpoint and restores; the leftover
    is cleaned up when the directory is opened again."""
    script = textwrap.dedent("""
        import os, sys, threading
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp
        from orbax.checkpoint._src.handlers import json_checkpoint_handler
        import jaxpar as jp
        directory = os.path.abspath(sys.argv[1])
        write = json_checkpoint_handler.JsonCheckpointHandler._save_fn
        first = threading.Lock()   # orbax writes several JSON items at once, from several threads

        async def write_then_block(self, item, path):  # orbax's writer (a background thread), one JSON item
            await write(self, item, path)
            if os.path.relpath(str(path), directory).startswith("2."):
                if first.acquire(blocking=False):   # one thread announces, in one write: lines never interleave
                    sys.stdout.write(f"wrote {os.path.relpath(str(path), directory)}\\nSYNC step 2 mid-save\\n")
                    sys.stdout.flush()
                threading.Event().wait(600)  # until killed (a hang guard only)
                os._exit(3)
        json_checkpoint_handler.JsonCheckpointHandler._save_fn = write_then_block

        mesh = jp.make_mesh(data=8)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        ckpt = jp.checkpoint.CheckpointManager(directory)
        ckpt.save(1, {"w": jax.device_put(jnp.arange(1024.0), sharding)})
        ckpt.wait()
        ckpt.save(2, {"w": jax.device_put(jnp.arange(1024.0) + 2, sharding)})  # the files are written in the background
        ckpt.wait()
        print("not blocked: step 2 wrote no JSON item through JsonCheckpointHandler._save_fn", flush=True)
    """)
    proc = start(["-c", script, str(tmp_path)])
    read_until(proc, "SYNC step 2 mid-save")
    proc.kill()
    out = finish(proc)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("2.")]
    assert leftovers, f"expected an unfinished temporary directory for step 2, found {os.listdir(tmp_path)}"
    ckpt = jp.checkpoint.CheckpointManager(tmp_path)
    assert ckpt.all_steps() == [1]
    sharding = jax.sharding.NamedSharding(jp.make_mesh(data=4, devices=jax.devices()[:4]),
                                          jax.sharding.PartitionSpec("data"))
    w = ckpt.restore(target={"w": jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=sharding)})["w"]
    np.testing.assert_array_equal(np.asarray(w), np.arange(1024.0))
    assert ckpt.save(2, {"w": w})  # the directory takes new checkpoints (the leftover was cleaned up)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2] and not [p for p in tmp_path.iterdir() if p.name.startswith("2.")]


def test_kill_while_deleting_an_old_checkpoint_keeps_the_newest(tmp_path):
    """max_to_keep=2: saving step 3 pushes out step 1. The process is SIGKILLed from inside the function
    that deletes step 1's files, after it removed half of them (no timing involved). Then no half-deleted
    step is listed or restored: the steps are [2, 3], the newest restores bit-exactly (also through
    restore_or_init), restoring step 1 is a clear CheckpointError, and the directory takes new saves."""
    script = textwrap.dedent("""
        import os, shutil, signal, sys
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp
        import jaxpar as jp
        try:  # orbax deletes through shutil.rmtree, after unlinking in threads on machines with many cores
            from orbax.checkpoint._src.path import deleter
            deleter._ParallelDirectoryDeleter.delete = lambda self, path: path.rmtree()
        except (ImportError, AttributeError):
            pass
        directory = os.path.abspath(sys.argv[1])
        mesh = jp.make_mesh(data=8)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        make = lambda s: {"w": jax.device_put(jnp.arange(1024.0) + s, sharding), "rng": jax.random.key(s)}
        ckpt = jp.checkpoint.CheckpointManager(directory, max_to_keep=2)
        for s in (1, 2):
            ckpt.save(s, make(s))
        ckpt.wait()

        def dying_rmtree(path, *args, **kwargs):  # deletes half of the files, then dies
            files = sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs)
            for f in files[: len(files) // 2]:
                os.unlink(f)
            print(f"killed while deleting {os.path.relpath(path, directory)}: removed "
                  f"{len(files) // 2} of {len(files)} files", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        shutil.rmtree = dying_rmtree
        ckpt.save(3, make(3))
        ckpt.wait()
        print("not killed: nothing was deleted through shutil.rmtree", flush=True)
    """)
    proc = start(["-c", script, str(tmp_path)])
    out = finish(proc)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    killed = re.search(r"killed while deleting .*: removed (\d+) of (\d+) files", out)
    removed, total = (int(v) for v in killed.groups())
    assert 0 < removed < total, out[-3000:]
    steps_on_disk = sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit())
    assert steps_on_disk == ["2", "3"], f"a half-deleted step directory is left: {steps_on_disk}"

    mesh = jp.make_mesh(data=4, devices=jax.devices()[:4])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    target = {"w": jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=sharding),
              "rng": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=jax.sharding.NamedSharding(
                  mesh, jax.sharding.PartitionSpec()))}
    want = lambda s: {"w": np.arange(1024.0, dtype=np.float32) + s, "rng": jax.random.key(s)}
    ckpt = jp.checkpoint.CheckpointManager(tmp_path, max_to_keep=2)
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    assert sorted(os.listdir(tmp_path)) == ["2", "3"]  # what the killed deletion left is gone too
    assert_bitwise(ckpt.restore(target=target), want(3))
    state, step = jp.checkpoint.restore_or_init(ckpt, lambda: pytest.fail("must resume"), lambda: target)
    assert step == 3
    assert_bitwise(state, want(3))
    assert_bitwise(ckpt.restore(2, target=target), want(2))
    with pytest.raises(jp.checkpoint.CheckpointError, match=r"no checkpoint for step 1 .*available steps: \[2, 3\]"):
        ckpt.restore(1, target=target)
    assert ckpt.save(4, {"w": jnp.arange(1024.0) + 4, "rng": jax.random.key(4)})
    ckpt.close()
    assert ckpt.all_steps() == [3, 4] and sorted(os.listdir(tmp_path)) == ["3", "4"]


# ------------------------------------------------------------------------------------------ resume parity

@pytest.mark.slow  # heavy (subprocesses or several compiles); .ci/run runs it
def test_resume_after_sigkill_is_bit_identical(tmp_path, devices):
    """2N steps straight == N steps, SIGKILL, resume, N more: params, optimizer, loss-scale and pruning state
    bitwise, and the same loss curve; fp16 with dynamic loss scaling and magnitude pruning on 2x2x2."""
    del devices
    n = 4
    ref, _, _ = worker.train(SPEC, tmp_path / "straight", 2 * n)
    run = tmp_path / "killed"
    proc = start(["tests/ckpt_worker.py", "--out", str(run), "--steps", str(2 * n), "--pruning",
                  "--block-after-checkpoint", str(n)])
    read_until(proc, f"SYNC checkpoint {n} final")  # the worker blocks there until killed
    proc.kill()
    out = finish(proc)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    ckpt = jp.checkpoint.CheckpointManager(run / "ckpt")
    saved_step = ckpt.latest_step()
    assert saved_step == n and ckpt.all_steps() == [n - 2, n - 1, n]  # max_to_keep=3
    assert [r["step"] for r in train_rows(run)] == list(range(1, n + 1))  # logged before the checkpoint existed
    resumed, start_step, _ = worker.train(SPEC, run, 2 * n)
    assert start_step == saved_step
    assert_bitwise(resumed, ref)
    got, want = train_rows(run), train_rows(tmp_path / "straight")
    assert [r["step"] for r in got] == list(range(1, 2 * n + 1))
    assert got == want  # loss, loss scale, gradient norm: exactly the same floats
    assert len({r["loss_scale"] for r in want}) > 1  # the loss scale changed along the way


@pytest.mark.slow  # heavy (subprocesses or several compiles); .ci/run runs it
def test_sigterm_saves_the_step_reached_and_exits_zero(tmp_path):
    """SIGTERM while the worker waits before step 3 (it blocks until the handler ran): it finishes step 3,
    saves checkpoint 4 (the only one: --interval 0), and exits 0."""
    run = tmp_path / "run"
    proc = start(["tests/ckpt_worker.py", "--out", str(run), "--steps", "8", "--interval", "0", "--pruning",
                  "--await-sigterm-before-step", "3"])
    read_until(proc, "SYNC awaiting SIGTERM before step 3")
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "worker: trained from step 0 to 4 (preempted)" in out, out[-3000:]
    assert [r["step"] for r in train_rows(run)] == [1, 2, 3, 4]
    ckpt = jp.checkpoint.CheckpointManager(run / "ckpt")
    assert ckpt.all_steps() == [4]  # --interval 0: the preemption save is the only one
    assert ckpt.restore_extras() == {"data_step": 4}


def test_second_sigterm_exits_at_once(tmp_path):
    """The first SIGTERM is handled (a flag); a second one, during the long final save, terminates the
    process by the default action. The script blocks "saving" until a handler runs again, which would make
    it exit 3 (the second signal caught instead of fatal)."""
    script = textwrap.dedent("""
        import os, sys
        sys.path.insert(0, "tests")
        import jaxpar.train.loop
        from ckpt_worker import sigterm_pipe
        handler = jaxpar.train.loop.PreemptionHandler()
        handled = sigterm_pipe()  # chained onto jaxpar's handler
        print("SYNC ready", flush=True)
        os.read(handled, 1)  # the first SIGTERM was handled
        assert handler.requested and handler.should_stop()
        print("SYNC stopping", flush=True)
        os.read(handled, 1)  # "a long final save": only a handled (not fatal) second SIGTERM ends it
        print("the second SIGTERM was caught instead of terminating the process", flush=True)
        sys.exit(3)
    """)
    proc = start(["-c", script])
    for line in ("SYNC ready", "SYNC stopping"):
        read_until(proc, line)
        proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == -signal.SIGTERM, out[-3000:]


# ------------------------------------------------------------------------------------------------ charlm

@pytest.mark.slow  # heavy (subprocesses or several compiles); .ci/run runs it
def test_charlm_sigterm_then_resume_is_bit_identical(tmp_path):
    """charlm: SIGTERM mid-run exits 0 with a checkpoint at the step reached; rerunning the same command
    (``--resume``) continues to the same losses, validation losses and final params as a straight run."""
    from test_experiments import load
    charlm = load("charlm")
    small = dict(steps=100, eval_interval=40, eval_batches=1, batch_size=16, seq_len=32, d_model=32, num_layers=1,
                 num_heads=2, warmup_steps=2, sample_chars=5, checkpoint_interval=15)
    straight = charlm.main(charlm.Config(**small, out_dir=str(tmp_path / "straight")))
    run = tmp_path / "run"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in small.items()]
    # experiments/charlm.py as written, with two sync hooks: after it logs step 2 it blocks until its
    # PreemptionHandler has handled the SIGTERM this test sends on reading the SYNC line
    wrapper = textwrap.dedent("""
        import runpy, sys
        sys.path.insert(0, "tests")
        from ckpt_worker import await_sigterm_after_logging
        await_sigterm_after_logging(2)
        sys.argv = ["experiments/charlm.py", *sys.argv[1:]]
        runpy.run_path("experiments/charlm.py", run_name="__main__")
    """)
    proc = start(["-c", wrapper, *args, "--out-dir", str(run)])
    read_until(proc, "SYNC awaiting SIGTERM after logging step 2")
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    reached = train_rows(run)[-1]["step"]
    assert 2 < reached < 15 and [r["step"] for r in train_rows(run)] == list(range(1, reached + 1))
    assert f"preempted: saved a checkpoint at step {reached}" in out
    ckpt = jp.checkpoint.CheckpointManager(run / "checkpoints")
    assert ckpt.latest_step() == reached
    assert ckpt.restore_extras()["config"]["d_model"] == 32
    resumed = charlm.main(charlm.Config(**small, out_dir=str(run), resume=True))
    assert resumed == straight
    strip = lambda rows: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]
    assert strip(train_rows(run)) == strip(train_rows(tmp_path / "straight"))
    a, b = (jp.checkpoint.CheckpointManager(d / "checkpoints") for d in (run, tmp_path / "straight"))
    assert a.latest_step() == b.latest_step() == 100
    assert a.metadata()["leaves"] == b.metadata()["leaves"]  # same shapes, dtypes and checksums of every leaf
    with pytest.raises(jp.checkpoint.CheckpointError, match="asked to resume"):
        charlm.main(charlm.Config(**small, out_dir=str(tmp_path / "fresh"), resume=True))


# -------------------------------------------------------------------------------------------- bad input

def test_a_file_where_the_checkpoint_trash_goes_is_a_clear_error(tmp_path):
    (tmp_path / jp.checkpoint.TRASH).write_text("not a directory")
    with pytest.raises(jp.checkpoint.CheckpointError, match="is a file"):
        jp.checkpoint.CheckpointManager(tmp_path)


def test_donated_state_is_refused_by_save_and_sparsity_report(adam_mlp, tmp_path):
    """jaxlib 0.10's CPU client segfaults when a compiled function meets a donated array: refuse first."""
    init_fn, loss_fn, mesh, tx, batch = adam_mlp
    ckpt = jp.checkpoint.CheckpointManager(tmp_path, max_to_keep=2)
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    ckpt.save(1, state)
    ckpt.wait()
    new, _ = jp.train.make_train_step(loss_fn, tx, mesh=mesh)(state, batch)   # donates state
    with pytest.raises(ValueError, match="donated"):
        ckpt.save(2, state)
    with pytest.raises(ValueError, match="donated"):
        jp.pruning.sparsity_report(state.params)
    with pytest.raises(TypeError, match=r"state leaf .*\['junk'\] is a object"):
        ckpt.save(2, new.replace(params={**new.params, "junk": object()}))
    assert ckpt.save(2, new, force=True), "a failed save must not block its step"
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    ckpt.close()
