"""Multi-process runs through ``jax.distributed``: 2 local processes x 4 CPU devices (gloo) against 1 x 8.

The job is ``tests/ckpt_worker.py`` on data=2 x fsdp=2 x tensor=2 started by ``python -m jaxpar.cli.launch``;
the single-process reference runs in this process. A second job runs layouts whose fsdp resp. tensor axis
spans both processes (data=1 x fsdp=8, tensor=8: the collectives of FSDP and of Megatron cross processes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import ckpt_worker as worker
import jaxpar as jp
import jaxpar.cli.launch
from helpers import assert_tree_close
from test_checkpoint import train_rows

ROOT = Path(__file__).resolve().parents[1]
SPEC = worker.Spec(mesh=(2, 2, 2), precision="f32", pruning=False, loss_scale=True, interval=10)
STEPS = 20
TIMEOUT = 240  # seconds for the whole two-process job (the launcher kills its processes at TIMEOUT - 20)


def launch(args: list[str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Runs ``python -m jaxpar.cli.launch ...`` in its own process group; kills the whole group on timeout."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxpar.cli.launch", "--timeout", str(timeout - 20), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        pytest.fail(f"the two-process job did not finish in {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


@pytest.mark.slow  # heavy (subprocesses or several compiles); .ci/run runs it
def test_two_processes_match_one_process(tmp_path, devices):
    del devices
    out = tmp_path / "two"
    job = launch(["-n", "2", "tests/ckpt_worker.py", "--out", str(out), "--steps", str(STEPS), "--interval", "10",
                  "--precision", "f32", "--check-resume-from", "10"])
    assert job.returncode == 0, job.stdout[-4000:]

    ref_state, _, _ = worker.train(SPEC, tmp_path / "one", STEPS)
    got, want = train_rows(out), train_rows(tmp_path / "one")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # one row per step: only process 0 writes
    rel = [abs(g["loss"] - w["loss"]) / abs(w["loss"]) for g, w in zip(got, want)]
    assert max(rel) <= 1e-6, f"per-step relative loss differences {rel}"

    # Each process loaded only its rows of the global batch of 16: its devices hold data=0 resp. data=1.
    assert [json.loads((out / f"rows_{i}.json").read_text()) for i in (0, 1)] == [[0, 8], [8, 16]]

    # The checkpoint the two processes wrote together (orbax's multi-process protocol) restores in this one
    # process on 8 devices; the checksums recorded at save time verify every leaf bit for bit.
    ckpt = jp.checkpoint.CheckpointManager(out / "ckpt")
    assert ckpt.all_steps() == [10, 20]
    mesh, init_fn, _, tx, policy = worker.build(SPEC)
    state = ckpt.restore(target=jp.train.abstract_state(init_fn, tx, mesh=mesh, policy=policy))
    assert int(state.step) == STEPS
    assert_tree_close(state.params, ref_state.params, rtol=1e-5, what="params after 20 steps, 2 vs 1 process")

    # Restoring step 10 onto the two-process mesh and replaying reproduced steps 11..20 exactly.
    replay = json.loads((out / "replay.json").read_text())
    assert replay == [r["loss"] for r in got[10:]]


CROSS = {(1, 8, 1): [[0, 8], [8, 16]],   # data, fsdp, tensor -> each process's batch rows
         (1, 1, 8): [[0, 16], [0, 16]]}  # tensor only: every process loads the whole batch
CROSS_STEPS = 3


@pytest.mark.slow  # heavier compile; .ci/run runs it
def test_fsdp_and_tensor_across_processes_match_one_process(tmp_path):
    """2 processes x 4 devices on data=1 x fsdp=8 and on tensor=8, so every FSDP all-gather / gradient
    reduction resp. every Megatron all-reduce spans both processes: per-step losses and the params of the
    checkpoint they wrote together equal the same layout's 1-process run (3 SGD steps, float32)."""
    out = tmp_path / "two"
    meshes = [a for layout in CROSS for a in ("--mesh", ",".join(map(str, layout)))]
    job = launch(["-n", "2", "tests/ckpt_worker.py", "--out", str(out), "--steps", str(CROSS_STEPS), "--interval",
                  "0", "--precision", "f32", "--no-loss-scale", "--optimizer", "sgd", *meshes])
    assert job.returncode == 0, job.stdout[-4000:]
    for layout, rows in CROSS.items():
        got_dir, one = out / ("mesh" + "x".join(map(str, layout))), tmp_path / f"one{layout}"
        spec = worker.Spec(mesh=layout, precision="f32", pruning=False, loss_scale=False, interval=0, optimizer="sgd")
        ref_state, _, _ = worker.train(spec, one, CROSS_STEPS)
        got, want = train_rows(got_dir), train_rows(one)
        assert [r["step"] for r in got] == list(range(1, CROSS_STEPS + 1)), layout
        rel = [abs(g["loss"] - w["loss"]) / abs(w["loss"]) for g, w in zip(got, want)]
        assert max(rel) <= 1e-6, f"{layout}: per-step relative loss differences {rel}"
        assert [json.loads((got_dir / f"rows_{i}.json").read_text()) for i in (0, 1)] == rows, layout
        mesh, init_fn, _, tx, policy = worker.build(spec)
        state = jp.checkpoint.CheckpointManager(got_dir / "ckpt").restore(
            target=jp.train.abstract_state(init_fn, tx, mesh=mesh, policy=policy))
        assert int(state.step) == CROSS_STEPS
        # SGD with a large step (0.5): the params move by the summed gradients themselves, so this is the
        # suite's gradient parity (1e-5). (AdamW divides by sqrt(nu): an element whose gradient is at
        # rounding level moves by up to lr either way under another reduction order, 1.6e-4 seen here.)
        assert_tree_close(state.params, ref_state.params, what=f"{layout} params, 2 vs 1 process")


def test_process_batch_rows_follow_the_sharding(mesh_factory):
    """One process: every layout's batch rows are the whole batch (the multi-process split is tested above)."""
    for sizes in (dict(data=8), dict(data=2, fsdp=2, tensor=2), dict(tensor=8)):
        mesh = mesh_factory(**sizes)
        assert jp.data.process_slice(16, mesh) == slice(0, 16)
        assert jp.sharding.global_batch_rows(16, mesh) == 16
    with pytest.raises(ValueError, match="not divisible"):
        jp.data.process_slice(6, mesh_factory(data=8))


def test_initialize_distributed_is_a_no_op_alone(monkeypatch):
    for var in (jp.mesh.ENV_COORDINATOR, "JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(jp.mesh, "_cluster_detected", lambda: False)
    assert jp.initialize_distributed() is False
    assert jax.process_count() == 1


def test_launcher_stops_everything_when_a_process_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['JAXPAR_PROCESS_ID'] == '1':\n    sys.exit(3)\n"
                      "time.sleep(60)\n")
    job = launch(["-n", "2", str(script)], timeout=60)
    assert job.returncode == 3 and "process 1 exited with 3" in job.stdout
    env = jaxpar.cli.launch.process_env(1, 2, 1234, 4, base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --x"})
    assert env["XLA_FLAGS"] == "--x --xla_force_host_platform_device_count=4"
    assert (env["JAXPAR_COORDINATOR_ADDRESS"], env["JAXPAR_NUM_PROCESSES"], env["JAXPAR_PROCESS_ID"]) == (
        "127.0.0.1:1234", "2", "1")
