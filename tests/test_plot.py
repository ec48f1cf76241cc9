"""jaxpar/tools/plot.py: every figure the notebooks draw, and the pipeline schedule's Gantt chart."""

from __future__ import annotations

import pytest

import jaxpar as jp
from jaxpar.pipeline import one_f_one_b


def test_plot_helpers_return_figures_and_write_pngs(tmp_path, mesh_factory):
    """Every figure the notebooks draw: ``path=None`` returns a Figure, a path gets a PNG; bad input raises."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from matplotlib.figure import Figure
    import jaxpar as jp

    rng = np.random.default_rng(0)
    x = jax.device_put(rng.normal(size=(4, 8)).astype(np.float32),
                       NamedSharding(mesh_factory(data=2, tensor=2), P("data", "tensor")))
    kernel = rng.normal(size=(8, 4)).astype(np.float32) * (rng.random((8, 4)) > 0.5)
    schedules = [jp.pipeline.gpipe(2, m) for m in (2, 4)] + [jp.pipeline.one_f_one_b(2, 4)]
    sparsity = jp.pruning.polynomial_sparsity(0.8, 2, 8, frequency=2)
    calls = {
        "loss_curve": lambda path: jp.plot.loss_curve([{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.0}], path),
        "curves": lambda path: jp.plot.curves({"a": ([0, 1], [2.0, 1.0])}, path),
        "grouped_bars": lambda path: jp.plot.grouped_bars({"DP": {"x": 1.0}, "TP": {"x": 0.5, "y": 2.0}}, path),
        "accuracy_vs_sparsity": lambda path: jp.plot.accuracy_vs_sparsity({"g": [(0.5, 0.9, 0.01)]}, path),
        "schedule_gantt": lambda path: jp.plot.schedule_gantt(schedules[-1], path),
        "bubble_vs_microbatches": lambda path: jp.plot.bubble_vs_microbatches(schedules, path),
        "loss_scale_curve": lambda path: jp.plot.loss_scale_curve([0, 1, 2], [4.0, 8.0, 4.0], [0, 1, 0], path),
        "sparsity_schedule": lambda path: jp.plot.sparsity_schedule(sparsity, 10, path, measured=[(9, 0.8)]),
        "layer_sparsity": lambda path: jp.plot.layer_sparsity({"u": jp.pruning.sparsity_report({"w": kernel})}, path),
        "nm_mask": lambda path: jp.plot.nm_mask(rng.random((8, 8)) > 0.5, (2, 4), path),
        "array_sharding": lambda path: jp.plot.array_sharding(x, path),
        "expert_load": lambda path: jp.plot.expert_load(
            {"aux loss": [{"step": s, "expert_load_0": 0.2, "expert_load_1": 0.8} for s in (1, 2)],
             "bias": [{"step": 1, "expert_load_0": 0.5, "expert_load_1": 0.5}]}, path),
    }
    for name, call in calls.items():
        assert isinstance(call(None), Figure), name
        written = call(tmp_path / f"{name}.png")
        assert written == tmp_path / f"{name}.png" and written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    # array_sharding labels each block with the devices holding it (read here from the shards themselves)
    blocks = {}
    for shard in x.addressable_shards:
        blocks.setdefault(tuple((s.start, s.stop) for s in shard.index), set()).add(shard.device.id)
    expected = sorted("dev " + ",".join(map(str, sorted(ids))) for ids in blocks.values())
    assert sorted(t.get_text() for t in jp.plot.array_sharding(x).axes[0].texts) == expected
    bad = [lambda: jp.plot.grouped_bars({}), lambda: jp.plot.nm_mask(np.ones((2, 2, 2), bool), (2, 4)),
           lambda: jp.plot.array_sharding(np.ones((2, 2))), lambda: jp.plot.loss_scale_curve([0], [1.0, 2.0], [0]),
           lambda: jp.plot.sparsity_schedule(sparsity, 0), lambda: jp.plot.bubble_vs_microbatches([]),
           lambda: jp.plot.layer_sparsity({}), lambda: jp.plot.expert_load([{"step": 1, "loss": 2.0}])]
    for call in bad:
        with pytest.raises(ValueError):
            call()


def test_gantt_plot(tmp_path):
    path = jp.plot.schedule_gantt(one_f_one_b(4, 8), tmp_path / "1f1b.png")
    assert path.stat().st_size > 5000
    fig = jp.plot.schedule_gantt(jp.pipeline.zero_bubble_v(2, 4))   # chunks and W
    ax = fig.axes[0]
    labels = {t.get_text() for t in ax.texts}
    assert {"0c0", "3c1"} <= labels and len(ax.texts) == 3 * 4 * 4     # one label per action: 3 kinds, m=4, V=4
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [f"{k}, chunk {c}" for k in ("F (forward)", "B (input grad)", "W (weight grad)") for c in (0, 1)]
    fig = jp.plot.schedule_gantt(jp.pipeline.dualpipe_v(2, 4))    # fused FB entries: one split bar, two labels
    ax = fig.axes[0]
    s = jp.pipeline.dualpipe_v(2, 4)
    fused = sum(a is not None and a.kind == "FB" for row in s.table for a in row)
    assert fused and len(ax.texts) == sum(a is not None for row in s.table for a in row)
    first = next(a for row in s.table for a in row if a is not None and a.kind == "FB")
    want = f"{first.microbatch}c{first.chunk}/{first.backward.microbatch}c{first.backward.chunk}"
    assert sum("/" in t.get_text() for t in ax.texts) == fused and want in {t.get_text() for t in ax.texts}
    assert "B (backward; input grad before a W), chunk 0" in [t.get_text() for t in ax.get_legend().get_texts()]
