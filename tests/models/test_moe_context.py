"""GShard capacity mode in the decoder under context parallelism: the decoder's loss puts each sequence in the
zigzag layout over the ``context`` axis (:func:`jaxpar.layers.attention.shard_sequence`), and the capacity must
still be counted per sequence row in the tokens' true order, so the choices dropped (and so the loss, every
gradient and the router's carried load and dropped count) are those of one device."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import SMALL_LLAMA, assert_scalar_close, assert_tree_close, gpt_batch

import jaxpar as jp
from jaxpar.layers.moe import MoEConfig
from jaxpar.models import Llama

# top-2 of 4 experts with half the balanced capacity: ceil(0.5 * 16 * 2 / 4) = 4 slots per expert per row of 16
CAPACITY_LLAMA = dataclasses.replace(SMALL_LLAMA, moe=MoEConfig(
    num_experts=4, experts_per_token=2, expert_d_mlp=32, capacity_factor=0.5, load_balance_coef=0.01,
    z_loss_coef=0.001))
EP_OVER_FSDP = (("experts", "fsdp"),) + tuple(jp.sharding.DEFAULT_RULES)


def packed_batch(rng: np.random.Generator, rows: int, cfg) -> dict[str, np.ndarray]:
    """Random documents packed back to back in each row (cuts at random slots; the last slots padding)."""
    L = cfg.max_seq_len
    batch = gpt_batch(rng, rows, cfg)
    starts = rng.random((rows, L)) < 0.25
    starts[:, 0] = True
    segment_ids = np.cumsum(starts, axis=1).astype(np.int32)
    first = np.maximum.accumulate(np.where(starts, np.arange(L), 0), axis=1)
    keep = np.arange(L) < L - 2                                # two padding slots (segment 0) at each row's end
    return dict(batch, segment_ids=np.where(keep, segment_ids, 0), positions=np.where(keep, np.arange(L) - first, 0)
                .astype(np.int32), loss_mask=keep[None].repeat(rows, 0).astype(np.int32))


def one_step(cfg, mesh, batch, rules=jp.sharding.DEFAULT_RULES):
    model, tx = Llama(cfg), optax.sgd(0.1, momentum=0.9)
    state = jp.train.init_state(model.init, tx, 3, mesh=mesh, rules=rules)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, rules=rules, donate=False,
                                    check_batch=model.check_batch)
    return jax.device_get(step(state, batch))


def grads_of(state):   # the momentum trace after one step from zero: the gradients
    return next(s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
                if isinstance(s, optax.TraceState)).trace


@pytest.mark.slow   # two compiles of a 2-layer Llama step per case: ~10 CPU-s each
@pytest.mark.parametrize("packed, dispatch", [(False, "ring"), (True, "all_to_all")], ids=["plain-ring",
                                                                                          "packed-all_to_all"])
def test_capacity_mode_over_context_drops_what_one_device_drops(packed, dispatch, mesh_factory):
    """data=2 x fsdp=2 x context=2, the experts split over fsdp (EP 2): loss, per-leaf gradients (1e-5 relative),
    the carried load and dropped count of every layer and the dropped fraction equal the single-device step's,
    with choices dropped in every layer."""
    cfg = dataclasses.replace(CAPACITY_LLAMA, moe=dataclasses.replace(CAPACITY_LLAMA.moe, dispatch=dispatch))
    rng = np.random.default_rng(11)
    batch = packed_batch(rng, 8, cfg) if packed else gpt_batch(rng, 8, cfg)
    ref, ref_metrics = one_step(cfg, mesh_factory(), batch)
    new, metrics = one_step(cfg, mesh_factory(data=2, fsdp=2, context=2), batch, rules=EP_OVER_FSDP)
    router, ref_router = new.carried["blocks"]["moe_router"], ref.carried["blocks"]["moe_router"]
    assert np.all(ref_router["dropped"] > 0), "every layer drops choices, else capacity is untested"
    np.testing.assert_array_equal(router["dropped"], ref_router["dropped"])
    np.testing.assert_array_equal(router["load"], ref_router["load"])
    what = f"context 2, {'packed' if packed else 'plain'}, {dispatch}"
    e_loss = assert_scalar_close(metrics["loss"], ref_metrics["loss"], what=f"{what} loss")
    e_drop = assert_scalar_close(metrics["moe_dropped_fraction"], ref_metrics["moe_dropped_fraction"], what=what)
    e_grads = assert_tree_close(grads_of(new), grads_of(ref), what=f"{what} grads")
    print(f"\n[{what}] loss {e_loss:.2e}, grads {e_grads:.2e} (relative, worst leaf), dropped fraction {e_drop:.1e}, "
          f"dropped per layer {ref_router['dropped'].tolist()}")
