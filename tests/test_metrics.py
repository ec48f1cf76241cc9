"""jaxpar/tools/metrics.py: datasheet peak FLOPs, the matmul measurement, MFU and throughput."""

from __future__ import annotations

import pytest


def test_mfu_and_peak_flops():
    import jaxpar as jp
    m = jp.metrics
    assert m.datasheet_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert m.datasheet_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert m.datasheet_peak_flops("NVIDIA H200") == 989e12
    assert m.datasheet_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert m.datasheet_peak_flops("cpu") is None
    # 12,000 tokens/s of a 5.64 MFLOP/token model on 2 devices of 100 GFLOP/s: 67.68e9 / 200e9
    assert m.mfu(12_000, 5.64e6, 100e9, num_devices=2) == pytest.approx(0.3384)
    with pytest.raises(ValueError, match="peak_flops_per_device > 0"):
        m.mfu(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="n >= 1"):
        m.measure_matmul_flops(n=0)
    assert m.measure_matmul_flops(n=64, repeats=1) > 0
    assert m.peak_flops(measure=False) is None          # a CPU: no datasheet figure, nothing measured
    speed = m.Throughput(tokens_per_step=100, flops_per_token=10.0, peak_flops_per_device=1e3)
    speed.tick()
    out = speed.tick()
    assert out["mfu"] == pytest.approx(out["tokens_per_s"] * 10.0 / (1e3 * 8))   # 8 simulated devices
