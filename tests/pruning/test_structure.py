"""jaxpar/pruning/paths.py: which leaves are pruned along which axes, from logical names; another model's
state or names refused with a ValueError naming the leaf (never a raw JAX error, never a silent acceptance)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxpar as jp
from jaxpar.models import GPT
from jaxpar.pruning.paths import make_plans

from .test_structured import TINY, gpt_names, random_params
from .test_transform import KERNELS, names


def test_reduction_axes_from_logical_names():
    plans = {p.name: p for p in make_plans(nn.meta.unbox(names()), names()) if p}
    assert set(plans) == {f"blocks/{k}" for k in KERNELS} | {"extra/kernel"}   # no norms, biases, embeddings
    assert plans["blocks/qkv_kernel"].reduction_axes == (1,)       # [layers, embed, heads, 3, kv]
    assert plans["blocks/out_kernel"].reduction_axes == (1, 2)     # [layers, heads, kv, embed]
    assert plans["blocks/up_kernel"].reduction_axes == (1,)        # [layers, embed, mlp]
    assert plans["blocks/down_kernel"].reduction_axes == (1,)      # [layers, mlp, embed]
    assert plans["extra/kernel"].reduction_axes == (0,)            # unnamed (in, out)
    assert all(plans[f"blocks/{k}"].batch_axes == (0,) for k in KERNELS)
    over = make_plans({"w": jnp.zeros((4, 8, 12))}, reduction_axes=lambda path, shape: (1, 2))
    assert over[0].reduction_axes == (1, 2)


# ------------------------------------------------------------------------------------ another model's

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
