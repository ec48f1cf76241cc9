"""Logical rules -> PartitionSpecs, rule and divisibility validation, and activation constraints."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig, MLP

LOGICAL = ("batch", "seq", "embed", "mlp", "heads", "kv", "vocab", "layers", "stage")
SMALL_GPT = GPTConfig(vocab_size=61, num_layers=2, num_heads=8, d_model=64, max_seq_len=16)


def test_default_rules_name_every_logical_axis():
    rules = dict(jp.sharding.DEFAULT_RULES)
    assert set(rules) == set(LOGICAL)
    assert len(jp.sharding.DEFAULT_RULES) == len(LOGICAL), "a logical name appears twice"
    mesh_axes = set()
    for target in rules.values():
        if target is not None:
            mesh_axes.update((target,) if isinstance(target, str) else target)
    assert mesh_axes <= set(jp.AXES)


def test_default_rules_mapping():
    rules = dict(jp.sharding.DEFAULT_RULES)
    assert tuple(rules["batch"]) == ("data", "fsdp")
    assert rules["embed"] == "fsdp"
    assert rules["mlp"] == rules["heads"] == rules["vocab"] == "tensor"
    assert rules["stage"] == "pipe"
    assert rules["seq"] is None and rules["kv"] is None and rules["layers"] is None


def test_named_shardings_of_boxed_tree(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    tree = {
        "up": nn.LogicallyPartitioned(jnp.zeros((8, 16)), ("embed", "mlp")),
        "down": nn.LogicallyPartitioned(jnp.zeros((16, 8)), ("mlp", "embed")),
        "qkv": nn.LogicallyPartitioned(jnp.zeros((3, 8, 4, 3, 2)), ("layers", "embed", "heads", None, "kv")),
        "emb": nn.LogicallyPartitioned(jnp.zeros((32, 8)), ("vocab", "embed")),
        "stages": nn.LogicallyPartitioned(jnp.zeros((2, 8)), ("stage", "embed")),
        "plain": jnp.zeros((5,)),
    }
    out = jp.sharding.named_shardings(tree, mesh)
    assert set(out) == set(tree)
    specs = {k: v.spec for k, v in out.items()}
    assert all(isinstance(v, NamedSharding) and v.mesh == mesh for v in out.values())
    assert specs["up"] == P("fsdp", "tensor")
    assert specs["down"] == P("tensor", "fsdp")
    assert specs["qkv"] == P(None, "fsdp", "tensor", None, None)
    assert specs["emb"] == P("tensor", "fsdp")
    assert specs["stages"] == P("pipe", "fsdp")
    assert specs["plain"] == P()


def test_named_shardings_of_eval_shape(mesh_factory):
    """Works on ``jax.eval_shape`` of a boxed init (no arrays allocated), e.g. the GPT's params."""
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    model = GPT(SMALL_GPT)
    with jp.sharding.use(mesh):
        boxed = jax.eval_shape(model.init, jax.random.key(0))
    specs = jax.tree.map(lambda s: s.spec, jp.sharding.named_shardings(boxed, mesh))
    assert specs["embed"]["embedding"] == P("tensor", "fsdp")
    assert specs["embed"]["pos_embedding"] == P(None, "fsdp")
    assert specs["blocks"]["qkv_kernel"] == P(None, "fsdp", "tensor", None, None)
    assert specs["blocks"]["out_kernel"] == P(None, "tensor", None, "fsdp")
    assert specs["blocks"]["up_kernel"] == P(None, "fsdp", "tensor")
    assert specs["blocks"]["up_bias"] == P(None, "tensor")
    assert specs["blocks"]["down_kernel"] == P(None, "tensor", "fsdp")
    assert specs["blocks"]["ln1_scale"] == P(None, "fsdp")
    assert specs["head"]["ln_scale"] == P("fsdp")


def test_mlp_alternates_column_and_row_splits(mesh_factory):
    mesh = mesh_factory(fsdp=2, tensor=4)
    model = MLP(hidden=(32, 16, 8), num_classes=10)
    with jp.sharding.use(mesh):
        boxed = jax.eval_shape(lambda k: model.init(k, jnp.zeros((8, 64)))["params"], jax.random.key(0))
    specs = jax.tree.map(lambda s: s.spec, jp.sharding.named_shardings(boxed, mesh))
    assert specs["dense_0"]["kernel"] == P("fsdp", "tensor")
    assert specs["dense_1"]["kernel"] == P("tensor", "fsdp")
    assert specs["dense_2"]["kernel"] == P("fsdp", "tensor")
    assert specs["head"]["kernel"] == P("tensor", None)
    assert specs["dense_0"]["bias"] == P("tensor")
    assert specs["dense_1"]["bias"] == P("fsdp")


def test_init_state_places_params_and_opt_state(mesh_factory):
    """Params and Adam's mu/nu get the rules' shardings; the count and the rng are replicated."""
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    model = GPT(SMALL_GPT)
    state = jp.train.init_state(model.init, optax.adam(1e-3), 0, mesh=mesh)
    up = state.params["blocks"]["up_kernel"]
    assert up.sharding.spec == P(None, "fsdp", "tensor")
    assert up.addressable_shards[0].data.shape == (2, 32, 128)
    adam = state.opt_state[0]
    assert adam.mu["blocks"]["up_kernel"].sharding.spec == P(None, "fsdp", "tensor")
    assert adam.nu["embed"]["embedding"].sharding.spec == P("tensor", "fsdp")
    assert adam.count.sharding.spec == P()
    assert state.step.sharding.spec == P()


def test_masked_optimizer_state_is_sharded_like_params(mesh_factory):
    """jp.optim.adamw (clip, then AdamW with a weight-decay mask): mu/nu still mirror the params' layout."""
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    model = GPT(SMALL_GPT)
    state = jp.train.init_state(model.init, jp.optim.adamw(1e-3, total_steps=10), 0, mesh=mesh)
    param_specs = {jax.tree_util.keystr(p): x.sharding.spec
                   for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    mirrored = 0
    for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
        key = jax.tree_util.keystr(path)
        hits = [k for k in param_specs if key.endswith(k)]
        if hits:
            assert x.sharding.spec == param_specs[hits[0]], key
            mirrored += 1
        else:
            assert x.ndim == 0 and x.sharding.spec == P(), key
    assert mirrored == 2 * len(param_specs)


@pytest.mark.parametrize("rules, missing", [
    (jp.sharding.DEFAULT_RULES + (("experts", "expert"),), "expert"),
    ((("batch", ("data", "model")),) + jp.sharding.DEFAULT_RULES[1:], "model"),
])
def test_rules_with_unknown_mesh_axis(mesh_factory, rules, missing):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    tree = {"w": nn.LogicallyPartitioned(jnp.zeros((8, 8)), ("embed", "mlp"))}
    pattern = rf"rules name mesh axes \['{missing}'\].*does not have"
    with pytest.raises(ValueError, match=pattern):
        jp.sharding.validate_rules(rules, mesh)
    with pytest.raises(ValueError, match=pattern):
        jp.sharding.named_shardings(tree, mesh, rules)
    model = GPT(SMALL_GPT)
    with pytest.raises(ValueError, match=pattern):
        jp.train.init_state(model.init, optax.sgd(0.1), 0, mesh=mesh, rules=rules)
    with pytest.raises(ValueError, match=pattern):
        jp.train.make_train_step(model.loss, optax.sgd(0.1), mesh=mesh, rules=rules)


def test_malformed_rule(mesh_factory):
    with pytest.raises(ValueError, match=r"must be a pair"):
        jp.sharding.validate_rules((("embed", "fsdp", "tensor"),), mesh_factory())


def test_indivisible_param_names_the_path(mesh_factory):
    mesh = mesh_factory(fsdp=2, tensor=4)
    tree = {"layer": {"w": nn.LogicallyPartitioned(jnp.zeros((8, 6)), ("embed", "mlp"))}}
    with pytest.raises(ValueError, match=r"\['layer'\]\['w'\] has shape \(8, 6\): its 'mlp' dimension \(6\) "
                                         r"is not divisible by tensor = 4"):
        jp.sharding.named_shardings(tree, mesh)


def test_indivisible_multi_axis(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    rules = (("embed", ("fsdp", "tensor")),)
    tree = {"w": nn.LogicallyPartitioned(jnp.zeros((6, 4)), ("embed", None))}
    with pytest.raises(ValueError, match=r"\['w'\].*\(6\) is not divisible by fsdp\*tensor = 4"):
        jp.sharding.named_shardings(tree, mesh, rules)


def test_batch_sharding(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    assert jp.sharding.batch_axes(jp.sharding.DEFAULT_RULES, mesh) == ("data", "fsdp")
    assert jp.sharding.batch_sharding(jp.sharding.DEFAULT_RULES, mesh, 2).spec == P(("data", "fsdp"), None)
    batch = {"x": np.arange(32 * 3, dtype=np.float32).reshape(32, 3)}
    placed = jp.train.shard_batch(batch, mesh)
    assert placed["x"].sharding.spec == P(("data", "fsdp"), None)
    np.testing.assert_array_equal(np.asarray(placed["x"]), batch["x"])


def test_constrain_rank_mismatch():
    with pytest.raises(ValueError, match=r"constrain got 2 names"):
        jp.sharding.constrain(jnp.zeros((2, 3, 4)), "batch", "embed")


def test_constrain_is_identity_outside_context():
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(jp.sharding.constrain(x, "batch", "embed"), x)


# ------------------------------------------------------------------------------ activation constraints

_CONSTRAINT = re.compile(r"sharding_constraint|mhlo\.sharding|sdy\.sharding")


def _gpt_batch(rng, batch_size=16, seq_len=16, vocab=61):
    return {"inputs": rng.integers(0, vocab, (batch_size, seq_len), dtype=np.int32),
            "targets": rng.integers(0, vocab, (batch_size, seq_len), dtype=np.int32)}


def test_train_step_lowers_with_activation_constraints(mesh_factory, np_rng):
    """jaxpar's step traces the model under its mesh and rules, so the model's logical constraints become
    sharding constraints in the lowered program; plain ``jax.jit`` of the same loss has none."""
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    model = GPT(SMALL_GPT)
    tx = optax.sgd(0.1)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    batch = _gpt_batch(np_rng)
    text = jp.train.make_train_step(model.loss, tx, mesh=mesh).lower(state, batch).as_text()
    # jax 0.10 lowers through Shardy: `sdy.sharding_constraint %x <@mesh, [{"data", "fsdp"}, {}, {}]>`.
    constraints = [line for line in text.splitlines() if "sharding_constraint" in line]
    # every block constrains q, k, v, the attention output, two residuals and the MLP hidden: >= 7 per layer
    assert len(constraints) >= 7 * SMALL_GPT.num_layers, len(constraints)
    # the residual stream [B, L, D] is split by batch over data and fsdp
    assert any('[{"data", "fsdp"}, {}, {}]' in line and "16x16x64" in line for line in constraints), constraints[:5]
    # attention activations [B, L, H, K] are split by heads over tensor
    assert any('[{"data", "fsdp"}, {}, {"tensor"}, {}]' in line for line in constraints), constraints[:5]
    # the embedding table is gathered along its FSDP axis before the lookup (vocab stays on tensor)
    assert any('[{"tensor"}, {}]' in line and "128x64" in line for line in constraints), constraints[:5]

    # outside jaxpar's context: no mesh, no rules, so Flax's logical constraints are the identity
    plain = jax.jit(model.loss).lower(jax.device_get(state.params), batch).as_text()
    assert not _CONSTRAINT.search(plain), _CONSTRAINT.search(plain).group(0)


def test_constraints_follow_the_rules(mesh_factory, np_rng):
    """Changing the rules (not the model) changes the constraints: with batch -> data only, no activation
    is split over fsdp on its batch dimension."""
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    rules = tuple(("batch", "data") if name == "batch" else (name, t) for name, t in jp.sharding.DEFAULT_RULES)
    model = GPT(SMALL_GPT)
    tx = optax.sgd(0.1)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh, rules=rules)
    text = jp.train.make_train_step(model.loss, tx, mesh=mesh, rules=rules).lower(
        state, _gpt_batch(np_rng)).as_text()
    constraints = [line for line in text.splitlines() if "sharding_constraint" in line]
    assert constraints
    assert not any('[{"data", "fsdp"}' in line for line in constraints)
    assert any('[{"data"}, {}, {"tensor"}, {}]' in line for line in constraints)
