"""Checkpoints written by earlier jaxpar versions restore into today's state.

``tests/data/first_format/`` holds two checkpoints written by the jaxpar that stored carried state as a
``TrainState`` field named by its collection's attribute (format ``jaxpar.checkpoint/1``): a small GPT (vocabulary 61,
2 layers, 2 heads, d_model 16, 8 positions) with Adam(1e-3), initialised from seed 0 on a data=2 mesh, under an fp8
policy (with scales and amax histories) and under mixed_bf16 (no carried state). Each is restored onto another mesh
and compared with a fresh initialisation from the same seed (the
restore itself checks every leaf against the checksum written with it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig

DATA = Path(__file__).parent / "data" / "first_format"
POLICIES = {"fp8": "p=f32,c=bf16,o=f32,dot=fp8", "mixed_bf16": "mixed_bf16"}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_first_format_checkpoint_restores_onto_another_mesh(name, tmp_path):
    saved = json.loads((DATA / name / "1" / "jaxpar" / "metadata").read_text())
    assert saved["format"] == "jaxpar.checkpoint/1"   # written by the earlier version, not by this one
    model = GPT(GPTConfig(vocab_size=61, num_layers=2, num_heads=2, d_model=16, max_seq_len=8))
    policy, tx = jp.Policy.from_string(POLICIES[name]), optax.adam(1e-3)
    mesh = jp.make_mesh(fsdp=4, devices=jax.devices()[:4])
    shutil.copytree(DATA / name, tmp_path / name)
    with jp.checkpoint.CheckpointManager(tmp_path / name) as ckpt:
        state = ckpt.restore(target=jp.train.abstract_state(model.init, tx, mesh=mesh, policy=policy))
    fresh = jp.train.init_state(model.init, tx, 0, mesh=mesh, policy=policy, report=False)
    for got, want in zip(jax.tree.leaves((state.params, state.opt_state, state.carried)),
                         jax.tree.leaves((fresh.params, fresh.opt_state, fresh.carried)), strict=True):
        # last-bit differences only: the tests compile at another LLVM optimisation level than the writer did
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-12)
    held = len(jax.tree.leaves(state.carried))
    assert held == (24 if name == "fp8" else 0) == sum(".fp8" in d["path"] for d in saved["leaves"])
    assert jax.tree.structure(state) == jax.tree.structure(fresh)
