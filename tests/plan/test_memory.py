"""jaxpar/plan/memory.py: the analytic activation estimate, written out here term by term."""

from __future__ import annotations

import pytest

import jaxpar as jp

from .test_planner import TINY4


def test_pipeline_activations_count_stash_chunks_and_fsdp():
    sched = jp.pipeline.zero_bubble_v(2, 4)           # 2 chunks a stage, peak stash 2p = 4 chunk-microbatches
    est = jp.plan.estimate(TINY4, dict(pipe=2, fsdp=2, tensor=2), global_batch=8, seq_len=16, schedule=sched)
    D, H, K, F, V, c, t, L = 32, 2, 16, TINY4.mlp_dim, TINY4.padded_vocab, 4, 2, 16
    tokens = 8 * 16 / (2 * 4)                         # a microbatch over fsdp (data = 1)
    keys = (8 * 8 + 8 * 16) / 16                      # blocked attention, 2 query blocks: mean keys per query
    block = c * (2 * D + 4 * H * K / t + 2 * F / t) + 4 * H * keys / t   # one block recomputed (remat full)
    saved = max(sched.peak_stash) * (4 / (2 * 2)) * c * D               # block inputs of one layer per chunk
    head = c * D + 2 * 4 * V / t
    assert max(sched.peak_stash) == 4
    assert est["memory"]["activations"] == pytest.approx(tokens * (saved + block + head), rel=1e-12)
