"""jp.plan.gpu_target and the one GPU table: the shipped XLA target files parse and agree with the datasheet rows,
every reader of the table gets the same figures, the gpu extra stays matched to jaxlib, bad input fails clearly.

No compiles here (the GPU programs are tests/plan/test_gpu_structure.py's).
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import jax
import pytest

import jaxpar as jp
from jaxpar.plan import targets
from jaxpar.tools import datasheets, metrics

REPO = Path(__file__).resolve().parents[2]

try:
    targets.check_cuda_plugin()
    NO_PLUGIN = None
except ImportError as e:   # a mismatched plugin (RuntimeError) is a broken install: it fails, never skips
    NO_PLUGIN = str(e)
needs_plugin = pytest.mark.skipif(NO_PLUGIN is not None, reason=f"the gpu extra is not installed: {NO_PLUGIN}")


def _field(text: str, name: str) -> float:
    return float(re.search(rf"\b{name}: ([\d.]+)", text).group(1))


@needs_plugin
@pytest.mark.parametrize("name", ["h100", "h200", "b200", "a100"])
def test_each_shipped_target_parses_and_matches_its_datasheet(name):
    """Each target file parses with this jaxlib into 2 hosts x 4 devices whose kind is the row's GPU, and its
    memory size and bandwidth (XLA's measured figures) are the datasheet's within 10% / 5% (two sources agree)."""
    target = jp.plan.gpu_target(name, hosts=2, gpus_per_host=4)
    assert len(target.devices) == 8 and target.topology == "1x2x4"
    assert [d.process_index for d in target.devices] == [0] * 4 + [1] * 4
    assert {datasheets.for_device_kind(d.device_kind) for d in target.devices} == {target.datasheet}
    text = target.target_config
    assert not re.search(r"^\s*collective_memory_granularity:", text, re.MULTILINE)
    assert _field(text, "device_memory_size") == pytest.approx(target.memory_bytes, rel=0.10)
    assert _field(text, "memory_bandwidth") == pytest.approx(target.hbm_bytes_per_s, rel=0.05)


@needs_plugin
@pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()),
                    reason="needs a real GPU (run with JAX_PLATFORMS=cuda; the tests pin cpu otherwise)")
def test_on_a_gpu_the_device_config_is_used():
    """On a GPU of the table, the target compiles for the device's own config (exact for this jaxlib)."""
    row = datasheets.for_device_kind(jax.devices()[0].device_kind)
    if row is None or row.target_config is None:
        pytest.skip(f"{jax.devices()[0].device_kind} has no target in the table")
    target = jp.plan.gpu_target(row.name, gpus_per_host=2)
    assert target.config_source == "device" and "gpu_device_info" in target.target_config
    assert {d.device_kind for d in target.devices} == {jax.devices()[0].device_kind}


def test_every_reader_gets_the_table_figures():
    """jp.plan.gpu (the roofline's), metrics.GPU_DATASHEETS and datasheet_peak_flops (MFU) read one table; the
    old names stay accepted and the PCIe / NVL parts keep their own peaks."""
    for name in ("h100", "h100-80gb", "h200", "b200", "a100", "a100-80gb"):
        row, spec = datasheets.datasheet(name), jp.plan.gpu(name)
        assert (spec.memory_bytes, spec.peak_flops, spec.hbm_bytes_per_s, spec.nvlink_bytes_per_s,
                spec.infiniband_bytes_per_s) == (row.memory_bytes, row.bf16_flops, row.hbm_bytes_per_s,
                                                 row.nvlink_bytes_per_s, row.infiniband_bytes_per_s)
        assert metrics.GPU_DATASHEETS[name]["fp8_flops"] == row.fp8_flops
    assert datasheets.datasheet("h100-80gb") is datasheets.datasheet("H100")
    kinds = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
             "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA B200": 2.25e15, "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA GB200": None, "cpu": None}
    assert {k: metrics.datasheet_peak_flops(k) for k in kinds} == kinds
    for row in datasheets.DATASHEETS:    # dense fp8 is twice dense bf16 on Hopper and Blackwell
        assert row.fp8_flops is None or row.fp8_flops == pytest.approx(2 * row.bf16_flops, rel=0.001), row.name
        assert row.source


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"name='h300' is not a GPU target; use one of \[.*'h100'"):
        jp.plan.gpu_target("h300")
    with pytest.raises(ValueError, match="'h100-pcie' is not a GPU target"):
        jp.plan.gpu_target("h100-pcie")          # in the table, but no XLA target file ships for it
    with pytest.raises(ValueError, match="hosts=0 must be a positive int"):
        jp.plan.gpu_target("h100", hosts=0)
    with pytest.raises(ValueError, match="gpus_per_host=2.5 must be a positive int"):
        jp.plan.gpu_target("h100", gpus_per_host=2.5)


@needs_plugin
def test_bad_target_files_and_meshes_are_named():
    text = targets.shipped_target_config("h100").replace("core_count: 132", "core_count: 132\n  new_field: 1")
    with pytest.raises(ValueError, match=r"mine.txtpb does not parse .*line 10, column \d+: .*no field named "
                                         r"\"new_field\".*delete the field 'new_field'"):
        targets.compile_only_devices(text, 1, 8, "mine.txtpb")
    with pytest.raises(ValueError, match="line 1, column 31: Expected integer"):
        targets.compile_only_devices("gpu_device_info { core_count: x }", 1, 8, "mine.txtpb")
    # these parse, and the first compile for their devices died of SIGFPE
    with pytest.raises(ValueError, match=r"mine.txtpb has no threads_per_warp \(gpu_device_info\)"):
        targets.compile_only_devices("", 1, 8, "mine.txtpb")
    with pytest.raises(ValueError, match=r"mine.txtpb has threads_per_warp: 0 "):
        zero = targets.shipped_target_config("h100").replace("threads_per_warp: 32", "threads_per_warp: 0")
        targets.compile_only_devices(zero, 1, 8, "mine.txtpb")
    target = jp.plan.gpu_target("h100", hosts=2)
    with pytest.raises(ValueError, match=r"make 8 devices, but target 'h100' topology 1x2x8 has 16 \(2 hosts x 8"):
        target.mesh(fsdp=8)
    assert dict(target.mesh(data=2, fsdp=8).shape) == dict(data=2, pipe=1, fsdp=8, context=1, tensor=1)


def test_jax_started_without_jax_platforms_cpu_is_named(monkeypatch):
    """With JAX_PLATFORMS unset on a machine without a GPU, jax starts its CUDA plugin as a runtime (which fails),
    and get_topology_desc says only "topology not implemented for cuda"."""
    def no_topology(**kwargs):
        raise NotImplementedError("topology not implemented for cuda")
    monkeypatch.setattr(targets.topologies, "get_topology_desc", no_topology)
    with pytest.raises(RuntimeError, match=r"set JAX_PLATFORMS=cpu .*before jax starts"):
        targets.compile_only_devices("", 1, 8, "h100_sxm.txtpb")


def test_missing_or_mismatched_plugin_is_named(monkeypatch):
    real = importlib.metadata.version
    jaxlib = real("jaxlib")

    def installed(versions):
        def version(name):
            if name.startswith("jax-cuda"):
                if name not in versions:
                    raise importlib.metadata.PackageNotFoundError(name)
                return versions[name]
            return real(name)
        monkeypatch.setattr(importlib.metadata, "version", version)

    installed({})
    with pytest.raises(ImportError, match=rf"pip install 'jaxpar\[gpu\]'.*jax-cuda12-plugin=={jaxlib} "):
        jp.plan.gpu_target("h100")
    installed({"jax-cuda12-plugin": "0.9.0", "jax-cuda12-pjrt": "0.9.0"})
    with pytest.raises(RuntimeError, match=rf"of jaxlib's version {jaxlib}; installed: .*'jax-cuda12-plugin': '0.9.0'"):
        jp.plan.gpu_target("h100")
    installed({"jax-cuda12-plugin": jaxlib})
    with pytest.raises(RuntimeError, match="jax-cuda12-pjrt of jaxlib's version"):
        jp.plan.gpu_target("h100")


def test_gpu_extra_pins_the_plugin_to_jaxlib():
    """pyproject's gpu extra pins jaxlib and both plugin packages to one version, the installed jaxlib's (bump
    them together), and CI installs it beside the test extra (.ci/run)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = dict(re.fullmatch(r"([\w-]+)==([\w.]+)", r).groups() for r in extras["gpu"])
    assert set(pins) == {"jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt"}
    assert set(pins.values()) == {importlib.metadata.version("jaxlib")} == {targets.CHECKED_JAXLIB}
    assert re.search(r"^export JAXPAR_EXTRAS=test,gpu$", (REPO / ".ci" / "run").read_text(), re.M)


@pytest.mark.slow
def test_target_files_ship_in_the_wheel(tmp_path):
    """A non-editable install finds the target files: they are in the built wheel beside jaxpar/tools."""
    src = tmp_path / "src"     # a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(REPO / "jaxpar", src / "jaxpar", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(src)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("jaxpar-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for row in datasheets.DATASHEETS:
        if row.target_config:
            assert f"jaxpar/tools/target_configs/{row.target_config}" in names, sorted(names)
