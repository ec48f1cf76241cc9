"""experiments/plan.py: the layout sweep runs end to end (subprocess) and refuses bad flags before compiling."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
plan_cli = load_script("experiments/plan.py", "experiments_plan")

TINY_SWEEP = ["--model", "tiny", "--devices", "4", "--global-batch", "8", "--seq-len", "16", "--remat", "full"]


def _run(args: list[str], tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "plan.py"), *args, "--out-dir", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "data"])
    return [line.split() for line in lines[start + 1:] if re.match(r"^\s+\d+\s", line)]


@pytest.mark.slow  # ~35 s: a planner sweep in subprocesses; .ci/run runs it
def test_sweep_prints_a_ranked_table_and_writes_the_plot(tmp_path):
    proc = _run([*TINY_SWEEP, "--max-layouts", "3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 4 devices: (data, fsdp, context, tensor) with tensor x context 1 (3 ways), 2 (2 x 2 ways) or 4 (3 x 1 way); the
    # model, the batch 8 and the sequence 16 split all
    assert "compiling 3 of 10 layouts" in proc.stdout
    rows = _rows(proc.stdout)
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert all(int(r[1]) * int(r[2]) * int(r[3]) * int(r[4]) * int(r[5]) == 4 and r[11] == "yes" for r in rows)
    steps = [float(r[13]) for r in rows]
    assert steps == sorted(steps)
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert [p["mesh"] for p in saved] == [dict(data=int(r[1]), pipe=int(r[2]), fsdp=int(r[3]), context=int(r[4]),
                                               tensor=int(r[5])) for r in rows]
    png = (tmp_path / "plan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


@pytest.mark.slow  # a planner sweep in a subprocess (~16 s); tests/plan/test_planner.py's advice tests stay fast
def test_sweep_reports_a_layout_that_does_not_fit(tmp_path):
    proc = _run([*TINY_SWEEP, "--max-layouts", "1", "--memory-fraction", "1e-9"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _rows(proc.stdout)[0][11] == "no"
    assert re.search(r"rank 1: does not fit: [\d.]+ GiB needed per device, 0\.0 available; try ", proc.stdout)
    assert (tmp_path / "plan.png").exists()


@pytest.mark.slow  # a GPU compile and a CPU compile of the tiny model in a subprocess (~40 s)
def test_sweep_for_a_gpu_target_compiles_with_xla_gpu_and_recommends_a_layout(tmp_path):
    from jaxpar.plan import targets
    try:
        targets.check_cuda_plugin()
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"--target needs the jax CUDA plugin (the gpu extra): {e}")
    proc = _run(["--model", "tiny", "--target", "h100", "--hosts", "1", "--seq-len", "64", "--max-layouts", "1"],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "XLA:GPU compilation for h100 (1x1x8)" in proc.stdout and "CPU-simulated" in proc.stdout
    (row,) = _rows(proc.stdout)
    assert float(row[9]) > 0 and float(row[10]) > 0 and row[11] == "yes"        # GPU and CPU GiB per device
    assert re.search(r"^recommended: .*MFU [\d.]+%", proc.stdout, re.M)
    (saved,) = json.loads((tmp_path / "plan.json").read_text())
    assert saved["gpu"]["target"] == "h100" and all(r["is_async"] for r in saved["gpu"]["collectives"])


@pytest.mark.slow  # a planner sweep of the tiny mixture of experts in a subprocess (~40 s)
def test_sweep_plans_a_mixture_of_experts_with_expert_parallelism(tmp_path):
    proc = _run(["--model", "moe-tiny", "--devices", "4", "--global-batch", "8", "--seq-len", "16", "--max-context",
                 "1", "--expert-parallel", "4", "--max-layouts", "1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"skipped \d+ layout\(s\): expert_parallel=4 but the batch axes are", proc.stdout)
    assert re.search(r"experts: [\d.]+M params, [\d.]+M active; EP 4: ", proc.stdout)
    (saved,) = json.loads((tmp_path / "plan.json").read_text())
    assert saved["experts"]["expert_parallel"] == 4 and saved["experts"]["dispatch"]["total"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--devices", "0"], "--devices must be >= 1, got 0"),
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["--global-batch", "-8"], "--global-batch must be >= 1, got -8"),
    (["--devices", "12"], "--devices 12 are not whole hosts of --gpus-per-host 8"),
    (["--memory-fraction", "0"], r"--memory-fraction must lie in \(0, 1\]"),
    (["--model", "300b"], "invalid choice: '300b'"),
    (["--hosts", "0"], "--hosts must be >= 1, got 0"),
    (["--hosts", "2"], "--devices 4 is not --hosts 2 x --gpus-per-host 8; give one of them"),
    (["--expert-parallel", "2"], "--expert-parallel 2 needs a mixture of experts"),
])
def test_bad_flags_are_refused_by_the_parser(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        plan_cli.parse([*TINY_SWEEP, *flags])
    assert e.value.code == 2 and re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("flags, message", [
    (["--device", "tpu-v5"], "--target: .tpu-v5. is not a GPU target; use one of"),
    # the schedule names are jp.pipeline.SCHEDULES', read once jax has started with the sweep's devices
    (["--schedules", "pipedream"], r"invalid choice: 'pipedream' \(choose from 'gpipe', '1f1b', .*'dualpipev'\)"),
    # one GPU a host keeps tensor at 1, so data x fsdp = 4 rows never split a batch of 3
    (["--global-batch", "3", "--gpus-per-host", "1"], "no layout of 4 devices passes the checks"),
])
def test_bad_sweeps_are_refused_before_compiling(flags, message, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))   # main() sets it: restored after the test
    monkeypatch.setattr("jaxpar.plan.plan", lambda *a, **k: pytest.fail("compiled a layout"))
    with pytest.raises(SystemExit) as e:
        plan_cli.main([*TINY_SWEEP, *flags, "--out-dir", str(tmp_path)])
    assert e.value.code == 2 and re.search(message, capsys.readouterr().err)
