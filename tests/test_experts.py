"""jaxpar/sharding/experts.py: expert parallelism folded onto the batch axes (which axes, which sizes, errors)."""

from __future__ import annotations

import re

import pytest
from jax.sharding import PartitionSpec as P

import jaxpar as jp
from jaxpar.sharding import names

EXPERT_WEIGHT = (names.EXPERTS, names.EMBED, names.EXPERT_MLP)   # [E, D, F_e], as the MoE layer names it
DENSE = [(names.EMBED, names.MLP), (names.MLP, names.EMBED), (names.EMBED, names.HEADS, names.KV),
         (names.BATCH, names.SEQ, names.EMBED), (names.VOCAB, names.EMBED), (names.LAYERS, names.EMBED, names.MLP)]


@pytest.mark.parametrize("sizes, expected", [
    (dict(data=4, fsdp=2), {2: ("fsdp",), 4: ("data",), 8: ("data", "fsdp")}),
    (dict(data=2, fsdp=2, tensor=2), {2: ("fsdp",), 4: ("data", "fsdp")}),   # data and fsdp tie at 2: fsdp
    (dict(data=8), {8: ("data",)}),
    (dict(fsdp=4, tensor=2), {4: ("fsdp",)}),
])
def test_experts_fold_onto_the_inner_batch_axes_first(mesh_factory, sizes, expected):
    mesh = mesh_factory(**sizes)
    assert jp.sharding.expert_fold_choices(mesh) == {1: (), **expected}
    assert jp.sharding.expert_parallel_rules(mesh, 1) == jp.sharding.DEFAULT_RULES
    for size, axes in expected.items():
        rules = jp.sharding.expert_parallel_rules(mesh, size)
        assert rules[0] == (names.EXPERTS, axes) and [r[0] for r in rules].count(names.EXPERTS) == 1
        # one mesh axis splits one dim: the experts take fsdp first, else embed keeps its FSDP split
        embed = None if "fsdp" in axes else "fsdp"
        assert rules.spec(EXPERT_WEIGHT) == P(axes[0] if len(axes) == 1 else axes, embed, "tensor")
        for dense in DENSE:   # every dense weight and activation: the placement of expert_parallel=1
            assert rules.spec(dense) == jp.sharding.DEFAULT_RULES.spec(dense), dense


def test_expert_parallel_sizes_that_fold_nowhere_are_refused_with_the_fix(mesh_factory):
    message = "expert_parallel=2 but the batch axes are data=8, fsdp=1: choose 1 or 8, or set fsdp=2"
    with pytest.raises(ValueError, match=re.escape(message)):
        jp.sharding.expert_parallel_rules(mesh_factory(data=8), 2)
    with pytest.raises(ValueError, match=r"data=2, fsdp=2: choose 1, 2 or 4; .* must divide their 4 devices"):
        jp.sharding.expert_parallel_rules(mesh_factory(data=2, fsdp=2, tensor=2), 3)
    # rules whose batch is data alone: fsdp is no batch axis, so experts cannot fold onto it
    data_only = ((names.BATCH, names.DATA), *jp.sharding.DEFAULT_RULES[1:])
    with pytest.raises(ValueError, match=r"batch axes are data=4: choose 1 or 4"):
        jp.sharding.expert_parallel_rules(mesh_factory(data=4, fsdp=2), 2, data_only)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="expert_parallel=.* must be a positive int"):
            jp.sharding.expert_parallel_rules(mesh_factory(data=8), bad)
