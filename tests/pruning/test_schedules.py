"""jaxpar/pruning/schedules.py: sparsity schedules, their values and refresh steps."""

from __future__ import annotations

import numpy as np

import jaxpar as jp


def test_polynomial_schedule_values_and_refresh_steps():
    s = jp.pruning.polynomial_sparsity(0.9, begin_step=2, end_step=10, initial=0.1, frequency=3)
    steps = np.arange(14)
    expected = [0.0, 0.0] + [0.9 + (0.1 - 0.9) * (1 - (t - 2) / 8) ** 3 for t in range(2, 11)] + [0.9] * 3
    np.testing.assert_allclose([float(s(t)) for t in steps], expected, rtol=1e-6)
    assert [int(t) for t in steps if s.refresh(t)] == [2, 5, 8, 10]     # grid steps, and always end_step
    assert [int(t) for t in range(300) if jp.pruning.constant_sparsity(0.5).refresh(t)] == [0, 100, 200]
    assert [int(t) for t in range(10) if jp.pruning.one_shot(0.5, step=4).refresh(t)] == [4]
