"""jaxpar/pruning/groups.py: the groups structured pruning removes (heads, MLP neurons), from logical names."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from helpers import MLP_FEATURES

import jaxpar as jp
from jaxpar.models import MLP
from jaxpar.pruning.groups import group_plans

from .test_structured import TINY, gpt_names, np_groups


def test_gpt_groups_come_from_logical_names():
    plans = {p.name: p for p in group_plans(nn.meta.unbox(gpt_names()), gpt_names())}
    assert set(plans) == {"blocks/mlp", "blocks/heads"}
    for axis, want in (("mlp", {"up_kernel", "up_bias", "down_kernel"}), ("heads", {"qkv_kernel", "out_kernel"})):
        plan = plans[f"blocks/{axis}"]
        ref = {p: (g, lay) for p, g, lay in np_groups(gpt_names(), {("blocks",)}, axis)}
        assert {m.path[-1] for m in plan.members} == want and set(ref) == {m.path for m in plan.members}
        assert all((m.axis, m.batch_axes) == (ref[m.path][0], (ref[m.path][1],)) for m in plan.members)
        assert plan.batch_shape == (TINY.num_layers,)
    assert plans["blocks/mlp"].size == 64 and plans["blocks/heads"].size == 8
    assert plans["blocks/mlp"].group_weights == 2 * 32 + 1
    assert plans["blocks/heads"].group_weights == 4 * 32 * TINY.head_dim


def test_mlp_hidden_layer_named_embed_is_never_pruned():
    """The MLP's odd hidden layers output ``embed``: no chain over them can be formed."""
    model = MLP(hidden=(16, 8), num_classes=3)
    names = jax.eval_shape(lambda r: model.init(r, jnp.zeros((1, MLP_FEATURES)))["params"], jax.random.key(0))
    tx = jp.pruning.structured_pruning(0.5, axes=("mlp",), axis_names=names, groups={"mlp": [("dense_1", "head")]})
    with pytest.raises(ValueError, match="holds no leaf with the logical axis 'mlp'"):
        tx.init(nn.meta.unbox(names))
