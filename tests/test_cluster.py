"""On a cluster: JAX's Slurm auto-detection through ``jp.initialize_distributed()``, and the cluster files.

The slow test starts 2 local processes (4 simulated CPU devices each, gloo) with only the variables
``srun`` sets for a 2-task step on one node (``localhost``): no ``JAXPAR_*`` and no coordinator address.
JAX's ``SlurmCluster`` (jax 0.10 / 0.11) reads ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``,
``SLURM_PROCID`` and ``SLURM_LOCALID``; the coordinator is the node list's first host on port
``SLURM_JOB_ID % 4096 + 61440`` (``JAX_COORDINATOR_PORT`` overrides it; not set here). The two processes
then train ``tests/ckpt_worker.py``'s GPT for 3 SGD steps on the hybrid mesh (each process a host: data
across the hosts, fsdp x tensor inside), compared with the same hybrid layout over fake hosts in this
process: per-step losses and the checkpoint they wrote together.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt_worker as worker
import jaxpar as jp
from helpers import assert_tree_close
from test_checkpoint import train_rows

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "experiments" / "cluster"
STEPS = 3
TIMEOUT = 300  # seconds for the two processes (gloo rendezvous and compiles are slow on a busy 2-core machine)
SPEC = worker.Spec(mesh=(2, 2, 2), precision="f32", pruning=False, loss_scale=False, interval=0, optimizer="sgd")

DRIVER = f"""
import json, os, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import jax
import jaxpar as jp
joined = jp.initialize_distributed(initialization_timeout={TIMEOUT - 60})
from jax._src import distributed  # test only: the address JAX's Slurm detection derived
info = dict(joined=joined, count=jax.process_count(), index=jax.process_index(), local=jax.local_device_count(),
            coordinator=distributed.global_state.coordinator_address)
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"process_{{os.environ['SLURM_PROCID']}}.json"), "w") as f:
    json.dump(info, f)
import ckpt_worker as w
mesh = jp.make_mesh(data=2, fsdp=2, tensor=2, hosts=jax.process_count())  # one host per process
spec = w.Spec(mesh=(2, 2, 2), precision="f32", pruning=False, loss_scale=False, interval=0, optimizer="sgd")
w.train(spec, out, {STEPS}, mesh=mesh)
"""


def slurm_job_id() -> int:
    """A job id whose derived coordinator port (``id % 4096 + 61440``) is free on 127.0.0.1 right now."""
    for _ in range(200):
        job = random.randrange(10_000, 10_000_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", job % 4096 + 61440))
                return job
            except OSError:
                continue
    pytest.fail("no free port in 61440..65535 for the Slurm coordinator")


def slurm_env(job: int, procid: int, ntasks: int) -> dict[str, str]:
    """What srun sets for task ``procid`` of a one-node step (plus the CPU simulation of 4 devices)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXPAR_", "JAX_COORDINATOR"))}
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    env.update(XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=4".strip(), JAX_PLATFORMS="cpu",
               SLURM_JOB_ID=str(job), SLURM_JOBID=str(job), SLURM_STEP_ID="0", SLURM_NTASKS=str(ntasks),
               SLURM_NPROCS=str(ntasks), SLURM_PROCID=str(procid), SLURM_LOCALID=str(procid), SLURM_NODEID="0",
               SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1", SLURM_STEP_NUM_NODES="1", SLURM_STEP_NUM_TASKS=str(ntasks),
               SLURM_NTASKS_PER_NODE=str(ntasks), SLURM_TASKS_PER_NODE=str(ntasks), SLURM_NODELIST="localhost",
               SLURM_JOB_NODELIST="localhost", SLURM_STEP_NODELIST="localhost", SLURMD_NODENAME="localhost")
    return env


def run_slurm_step(out: Path, ntasks: int = 2) -> list[str]:
    """Starts the driver as ``ntasks`` Slurm tasks; returns their outputs; kills them all on failure."""
    job = slurm_job_id()
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER, str(out)], cwd=ROOT, env=slurm_env(job, i, ntasks),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for i in range(ntasks)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"the Slurm-style job did not finish in {TIMEOUT} s")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    for i, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"task {i} exited with {p.returncode}:\n{text[-4000:]}"
    return outputs


@pytest.mark.slow  # two processes compile and train (about a minute on a busy 2-core machine)
def test_slurm_tasks_join_and_train_as_one(tmp_path):
    out = tmp_path / "slurm"
    run_slurm_step(out)
    infos = [json.loads((out / f"process_{i}.json").read_text()) for i in (0, 1)]
    job_port = {info["coordinator"].rsplit(":", 1)[1] for info in infos}
    assert len(job_port) == 1 and all(i["coordinator"].startswith("localhost:") for i in infos)
    assert 61440 <= int(job_port.pop()) <= 65535
    assert [(i["joined"], i["count"], i["index"], i["local"]) for i in infos] == [(True, 2, 0, 4), (True, 2, 1, 4)]

    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2, hosts=2)  # the same layout over 2 fake hosts
    ref_state, _, _ = worker.train(SPEC, tmp_path / "one", STEPS, mesh=mesh)
    got, want = train_rows(out), train_rows(tmp_path / "one")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    rel = [abs(g["loss"] - w["loss"]) / abs(w["loss"]) for g, w in zip(got, want)]
    assert max(rel) <= 1e-6, f"per-step relative loss differences {rel}"
    assert [json.loads((out / f"rows_{i}.json").read_text()) for i in (0, 1)] == [[0, 8], [8, 16]]
    _, init_fn, _, tx, policy = worker.build(SPEC, mesh)
    state = jp.checkpoint.CheckpointManager(out / "ckpt").restore(
        target=jp.train.abstract_state(init_fn, tx, mesh=mesh, policy=policy))
    assert int(state.step) == STEPS
    assert_tree_close(state.params, ref_state.params, what="params after 3 SGD steps, 2 Slurm tasks vs 1 process")


def test_slurm_variables_are_detected(monkeypatch):
    """The five variables JAX's Slurm detection needs make initialize_distributed join a cluster."""
    env = slurm_env(4242, 1, 2)
    for var in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"):
        monkeypatch.setenv(var, env[var])
    assert jp.mesh._cluster_detected()
    monkeypatch.delenv("SLURM_STEP_NODELIST")  # sbatch's own shell (no srun step): not a cluster process
    assert not jp.mesh._cluster_detected()


def sbatch_charlm_args(text: str) -> list[str]:
    """The charlm flags between the marker lines of the Slurm script's bash array (shell words)."""
    block = text.split("# charlm flags: begin", 1)[1].split("# charlm flags: end", 1)[0]
    words = shlex.split(block, comments=True)
    return [w.replace("${CKPT_ROOT}", "/shared/runs").replace("${SLURM_JOB_NAME}", "charlm") for w in words]


def check_charlm_flags(args: list[str]) -> None:
    tyro = pytest.importorskip("tyro")
    sys.path.insert(0, str(ROOT / "experiments"))
    import charlm
    cfg = tyro.cli(charlm.Config, args=args)
    assert cfg.mesh.devices_per_host == 8
    # 2 nodes (the smallest multi-node case) must give a valid hybrid mesh: tensor x fsdp fill a node
    per_host, across = jp.mesh.split_axes(dict(data=2, fsdp=cfg.mesh.fsdp, tensor=cfg.mesh.tensor), 2)
    assert per_host["tensor"] * per_host["fsdp"] == 8 and across == dict(data=2, pipe=1, fsdp=1, context=1, tensor=1)
    assert cfg.out_dir.startswith(("/shared", "/mnt/shared"))


def test_cluster_files_use_real_charlm_flags():
    """The Slurm script and the JobSet: charlm command lines that parse as charlm's own CLI (hybrid mesh, out
    dir on shared storage) and the settings JAX's auto-detection relies on."""
    sbatch = (CLUSTER / "charlm.sbatch").read_text()
    check_charlm_flags(sbatch_charlm_args(sbatch))
    assert "--ntasks-per-node=8" in sbatch and "--gpus-per-node=8" in sbatch
    assert subprocess.run(["bash", "-n", str(CLUSTER / "charlm.sbatch")]).returncode == 0

    yaml = pytest.importorskip("yaml")
    docs = {d["kind"]: d for d in yaml.safe_load_all((CLUSTER / "charlm-jobset.yaml").read_text())}
    [rjob] = docs["JobSet"]["spec"]["replicatedJobs"]
    job, pod = rjob["template"]["spec"], rjob["template"]["spec"]["template"]["spec"]
    assert rjob["replicas"] == 1 and job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    assert pod["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    assert {"pods", "services"} <= set(docs["Role"]["rules"][0]["resources"])
    [container] = pod["containers"]
    assert container["command"][-1] == "experiments/charlm.py"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    check_charlm_flags(container["args"])
