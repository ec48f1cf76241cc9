"""jaxpar/train/_jit.py: a step compiled on a mesh follows its inputs' shardings and refuses arrays donated to an
earlier call (jaxlib 0.10's CPU client can segfault on them) with a clear error."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import mlp_batch, mlp_parts

import jaxpar as jp


def test_reusing_a_donated_state_is_a_clear_error(mesh):
    init_fn, loss_fn = mlp_parts()
    tx = optax.sgd(0.1)
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh)
    batch = mlp_batch(np.random.default_rng(0), 16)
    new, _ = step(state, batch)
    with pytest.raises(ValueError, match="donated"):
        step(state, batch)
    step(new, batch)  # the returned state works


def test_a_state_in_another_layout_is_accepted_by_the_same_step(mesh_factory):
    init_fn, loss_fn = mlp_parts()
    tx = optax.sgd(0.1)
    a, b = mesh_factory(data=2, fsdp=2, tensor=2), mesh_factory(fsdp=8)
    step = jp.train.make_train_step(loss_fn, tx, mesh=a, donate=False)
    batch = mlp_batch(np.random.default_rng(0), 16)
    ref, _ = step(jp.train.init_state(init_fn, tx, 0, mesh=a), batch)
    got, _ = step(jp.train.init_state(init_fn, tx, 0, mesh=b), batch)
    for x, y in zip(jax.tree.leaves(got.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
