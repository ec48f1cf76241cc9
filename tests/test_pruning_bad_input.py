"""Pruning given another model's state or names: clear ValueErrors naming the leaf (never raw JAX errors, never
a silent acceptance), for magnitude_pruning, structured_pruning, param_masks, compact and compact_opt_state."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from jaxpar.models import GPT

from test_compact import masks_for
from test_structured_pruning import TINY, gpt_names, random_params

OTHER = dataclasses.replace(TINY, num_layers=3, d_mlp=128)   # another model: 3 layers, wider MLP


def other_names():
    return jax.eval_shape(GPT(OTHER).init, jax.random.key(0))


TRANSFORMS = {"structured": lambda names: jp.pruning.structured_pruning(0.5, axis_names=names),
              "magnitude": lambda names: jp.pruning.magnitude_pruning(0.5, axis_names=names)}


@pytest.mark.parametrize("kind", list(TRANSFORMS))
@pytest.mark.parametrize("jit", [False, True])
def test_update_with_another_models_state_names_the_leaf(kind, jit):
    params, other = random_params(gpt_names(), seed=1), random_params(other_names(), seed=2)
    tx = TRANSFORMS[kind](gpt_names())
    state = TRANSFORMS[kind](other_names()).init(other)
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(ValueError, match=r"blocks/\w+ has shape \(3, .*tx\.init\(params\)"):
        update(params, state, params)
    with pytest.raises(ValueError, match="state of type"):
        update(params, (state,), params)


def test_magnitude_update_with_a_state_of_other_prunable_leaves():
    params = random_params(gpt_names(), seed=3)
    tx = jp.pruning.magnitude_pruning(0.5, axis_names=gpt_names())
    state = jp.pruning.magnitude_pruning(0.5, axis_names=gpt_names(), prunable=lambda p: p[-1] == "up_kernel")
    with pytest.raises(ValueError, match=r"blocks/down_kernel has shape None but this param needs \(2, 64, 32\)"):
        tx.update(params, state.init(params), params)


@pytest.mark.parametrize("kind", list(TRANSFORMS))
def test_init_with_another_models_axis_names_names_the_leaf(kind):
    params = random_params(gpt_names(), seed=4)
    with pytest.raises(ValueError, match=r"axis_names describe blocks/\w+ with shape \(3, .*but the param has shape "
                                         r"\(2, .*jax\.eval_shape"):
        TRANSFORMS[kind](other_names()).init(params)
    swapped = dict(gpt_names())   # same structure, another model's embedding table
    swapped["embed"] = dict(swapped["embed"], embedding=nn.LogicallyPartitioned(
        jax.ShapeDtypeStruct((256, TINY.d_model), jnp.float32), ("vocab", "embed")))
    with pytest.raises(ValueError, match="embed/embedding with shape"):
        TRANSFORMS[kind](swapped).init(params)


def test_names_of_the_compacted_model_may_differ_along_mlp_and_heads_only():
    """Training continues after compaction with the transform built from the original names: sizes along mlp and
    heads may differ (the compacted model), no other axis."""
    params = random_params(gpt_names(), seed=5)
    small, cfg = jp.pruning.compact(params, masks_for(params, gpt_names(), 0.5, "uniform"), TINY)
    for kind, make in TRANSFORMS.items():
        tx = make(gpt_names())
        updates, _ = tx.update(jax.tree.map(jnp.zeros_like, small), tx.init(small), small)
        assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, small), kind


def test_compaction_with_another_models_state_names_the_leaf():
    params, other = random_params(gpt_names(), seed=6), random_params(other_names(), seed=7)
    masks = masks_for(params, gpt_names(), 0.5, "uniform")
    with pytest.raises(ValueError, match=r"mask blocks/\w+ has shape \(3, "):
        jp.pruning.compact(params, masks_for(other, other_names(), 0.5, "uniform"), TINY)
    with pytest.raises(ValueError, match=r"mask blocks/\w+ has shape \(3, "):
        jp.pruning.param_masks(params, masks_for(other, other_names(), 0.5, "uniform"), gpt_names())
    for opt in (optax.adam(1e-3), optax.adafactor(1e-3, min_dim_size_to_factor=4)):
        with pytest.raises(ValueError, match=r"\[0\]\.\w+\['blocks'\]\['\w+'\] .*param blocks/\w+ of shape \(2, .*"
                                             r"optimizer state of these params"):
            jp.pruning.compact_opt_state(opt.init(other), params, masks, TINY)
    # a state of these params compacts (leaves of another shape are only refused for another model)
    state = optax.adafactor(1e-3).init(params)
    new = jp.pruning.compact_opt_state(state, params, masks, TINY)
    assert np.shape(new[0].v["blocks"]["up_kernel"])[-1] == TINY.d_mlp // 2
