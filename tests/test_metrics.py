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


def test_expert_load_metrics_find_every_router_collection(tmp_path):
    """The experts' load from any carried tree (two routers at different depths beside other carried state):
    per-expert shares, max/mean and dropped fraction as numpy gives them, written to metrics.jsonl, read back
    and plotted."""
    import jax
    import numpy as np
    import jaxpar as jp
    rng = np.random.default_rng(0)
    load = rng.integers(1, 50, size=(3, 4)).astype(np.float32)      # 3 MoE layers x 4 experts
    dropped = rng.integers(0, 5, size=(3,)).astype(np.float32)
    router = lambda l, d: {"bias": np.zeros_like(l), "load": l, "dropped": d, "rate": np.zeros(d.shape, np.float32)}
    carried = {"blocks": {"moe_router": router(load[:2], dropped[:2]), "fp8": {"load": np.ones(4, np.float32)}},
               "extra": [{"moe_router": router(load[2], dropped[2])}]}   # stacked [2, E], then one layer [E]
    share = load / load.sum(1, keepdims=True)
    expected = {**{f"expert_load_{i}": share[:, i].mean() for i in range(4)},
                "max_mean_load": (load.max(1) / load.mean(1)).mean(), "moe_choices": load.sum(1).mean(),
                "moe_dropped_fraction": (dropped / load.sum(1)).mean(),
                **{f"expert_load_l{l}_{i}": share[l, i] for l in range(3) for i in range(4)},
                **{f"moe_choices_l{l}": load[l].sum() for l in range(3)}}
    got = jax.jit(jp.metrics.expert_load_metrics, static_argnums=1)(carried, True)
    assert set(got) == set(expected)
    np.testing.assert_allclose([got[k] for k in expected], list(expected.values()), rtol=1e-6)
    assert jp.metrics.expert_load_metrics({"blocks": {"kernel": np.ones(2)}}) == {}
    with pytest.raises(ValueError, match=r"router collections of \[4, 6\] experts"):
        jp.metrics.expert_load_metrics({"a": {"moe_router": {"load": np.ones(4)}},
                                        "b": {"moe_router": {"load": np.ones(6)}}})
    writer = jp.metrics.MetricsWriter(tmp_path, tensorboard=False)
    for step in (1, 2):
        writer.write(step, {"loss": 1.0, **jp.metrics.expert_load_metrics(carried)})
    writer.close()
    steps, shares = jp.metrics.expert_load_rows(jp.metrics.read_jsonl(tmp_path / "metrics.jsonl"))
    assert steps == [1, 2] and np.allclose(shares, [share.mean(0)] * 2)
