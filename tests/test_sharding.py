"""jaxpar/sharding/rules.py: logical rules -> PartitionSpecs, rule and divisibility validation, activation constraints,
and optimizer-state shardings for the optimizers users pass.

``jp.sharding.opt_state_shardings`` gives every leaf of ``tx.init(params)`` a sharding from the parameter its
update is computed from. Checked here on an MLP whose widths divide by 8 and whose ``dense_1`` ``[256, 128]``
and ``dense_2`` ``[128, 128]`` kernels are factored by Adafactor (optax factors two axes >= 128):

1. the sharding of every state leaf, against an expectation written out per optimizer: the leaves that are
   replicated, by path; Adafactor's factored moments, by spec; every other leaf has the spec of the param
   whose path its own path ends with;
2. per-device bytes of params + optimizer state on fsdp=8: at most 1/8 of the replicated bytes plus the bytes
   of the leaves the layout keeps whole (the replicated list above and the params the rules do not split over
   ``fsdp``, stated in the test);
3. one ``jp.train.make_train_step`` step (MultiSteps: 4 mini-steps, one real update) on fsdp=8 against the
   same step on one device: params and every optimizer-state leaf, per leaf max|got-ref| <= 1e-5 * max|ref|.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxpar as jp
from helpers import assert_tree_close, mlp_batch, mlp_parts
from jaxpar.models import GPT, GPTConfig, MLP

LOGICAL = ("batch", "seq", "position", "embed", "mlp", "heads", "kv", "kv_heads", "vocab", "layers", "stage", "experts",
           "expert_mlp")
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
    assert rules["seq"] == "context"        # context parallelism; a size-1 context axis leaves the sequence whole
    assert rules["position"] is None and rules["kv"] is None and rules["layers"] is None


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


def _data_fsdp_mesh() -> jax.sharding.Mesh:
    """A mesh built without jaxpar over 4 devices with axes data=2 x fsdp=2 only: no pipe, context or tensor."""
    return jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "fsdp"))


def test_rules_drop_any_mesh_axis_the_mesh_lacks():
    """``Rules.without_absent`` removes every mesh axis the mesh does not have (a target left empty is None, a tuple
    keeps the axes the mesh has), and ``without_absent_context`` is the same operation."""
    mesh = _data_fsdp_mesh()
    rules = jp.sharding.Rules((("x", ("data", "tensor")), ("y", "pipe"), ("z", "fsdp"), ("w", ("context", "data"))))
    assert rules.without_absent(mesh) == (("x", "data"), ("y", None), ("z", "fsdp"), ("w", "data"))
    assert jp.sharding.without_absent_context(tuple(rules), mesh) == rules.without_absent(mesh)
    default = jp.sharding.Rules(jp.sharding.DEFAULT_RULES).without_absent(mesh)
    assert [default.mesh_axes(n) for n in ("batch", "seq", "embed", "mlp", "heads", "vocab", "stage")] == [
        ("data", "fsdp"), (), ("fsdp",), (), (), (), ()]


def test_rules_that_name_tensor_place_and_lower_on_a_mesh_without_tensor(np_rng):
    """The default rules map ``mlp`` to ``tensor``; on a mesh with only data and fsdp the MLP's kernels are split
    over fsdp alone, and its step lowers (the slow sibling below runs it)."""
    init, loss_fn = mlp_parts()
    mesh, tx = _data_fsdp_mesh(), optax.sgd(0.1)
    state = jp.train.abstract_state(init, tx, mesh=mesh)
    assert state.params["dense_0"]["kernel"].sharding.spec == P("fsdp", None)   # [embed, mlp]
    assert state.params["dense_1"]["kernel"].sharding.spec == P(None, "fsdp")   # [mlp, embed]
    jp.train.make_train_step(loss_fn, tx, mesh=mesh).lower(state, mlp_batch(np_rng, 8))


@pytest.mark.slow   # two compiles and a placement (~5 s); the fast sibling above places and lowers
def test_rules_that_name_tensor_step_on_a_mesh_without_tensor(mesh_factory, np_rng):
    """One step of the MLP on the data x fsdp mesh gives the params one device computes."""
    init, loss_fn = mlp_parts()
    mesh, tx, batch = _data_fsdp_mesh(), optax.sgd(0.1), mlp_batch(np_rng, 8)
    new, _ = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False)(
        jp.train.init_state(init, tx, 0, mesh=mesh, report=False), batch)
    one = mesh_factory()
    ref, _ = jp.train.make_train_step(loss_fn, tx, mesh=one, donate=False)(
        jp.train.init_state(init, tx, 0, mesh=one, report=False), batch)
    assert_tree_close(new.params, ref.params)


def test_rules_read_the_first_rule_of_a_name(mesh_factory):
    """First match wins (Flax's semantics) in every operation of ``Rules``: a later rule for the same name is
    ignored, in a name's mesh axes, a names tuple's spec and the resolution of names under a mesh."""
    rules = jp.sharding.Rules((("embed", "fsdp"), ("mlp", "tensor"), ("embed", "tensor")))
    assert rules.mesh_axes("embed") == ("fsdp",)
    assert rules.spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert rules.resolve(("mlp", "embed", "other"), mesh_factory(fsdp=2, tensor=2)) == (P("tensor", "fsdp", None),
                                                                                        ["other"])
    assert jp.sharding.batch_axes((("batch", "data"), ("batch", ("data", "fsdp"))), mesh_factory(data=2)) == ("data",)


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

_CONSTRAINTS = ("sharding_constraint", "mhlo.sharding", "sdy.sharding")   # the markers of a sharding constraint


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
    # the residual stream [B, L, D] is split by batch over data and fsdp (and the sequence over the context axis,
    # of size 1 here: the compiled program is the four-axis mesh's, tests/test_context.py)
    assert any('[{"data", "fsdp"}, {"context"}, {}]' in line and "16x16x64" in line for line in constraints), \
        constraints[:5]
    # attention activations [B, L, H, K] are split by heads over tensor
    assert any('[{"data", "fsdp"}, {"context"}, {"tensor"}, {}]' in line for line in constraints), constraints[:5]
    # the embedding table is gathered along its FSDP axis before the lookup (vocab stays on tensor)
    assert any('[{"tensor"}, {}]' in line and "128x64" in line for line in constraints), constraints[:5]

    # outside jaxpar's context: no mesh, no rules, so Flax's logical constraints are the identity
    plain = jax.jit(model.loss).lower(jax.device_get(state.params), batch).as_text()
    assert not [m for m in _CONSTRAINTS if m in plain], [m for m in _CONSTRAINTS if m in plain]


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
    assert any('[{"data"}, {"context"}, {"tensor"}, {}]' in line for line in constraints)


@pytest.mark.parametrize("rules", [None, "batch", (("batch", 3),), (("batch", ("data", "data")),)])
def test_malformed_rules(mesh, rules):
    with pytest.raises(ValueError, match="rule"):
        jp.sharding.validate_rules(rules, mesh)


# -------------------------------------------------------------------------- model sizes vs the mesh

def _gpt_cfg(**kw):
    return GPTConfig(**{**dict(vocab_size=61, num_layers=2, num_heads=8, d_model=64, max_seq_len=16), **kw})


@pytest.mark.parametrize("cfg, pattern", [
    # heads: out_kernel [layers, H, K, D] comes first in the tree, qkv_kernel would fail the same way
    (_gpt_cfg(num_heads=6, d_model=48),
     r"\['blocks'\]\['(out|qkv)_kernel'\] has shape .*'heads' dimension \(6\) is not divisible by tensor = 4; "
     r"change the model size or the mesh \(e.g. a smaller tensor axis\)"),
    (_gpt_cfg(d_mlp=90),
     r"\['blocks'\]\['(down|up)_(bias|kernel)'\] has shape .*'mlp' dimension \(90\) is not divisible by tensor = 4"),
    (_gpt_cfg(vocab_multiple=2),
     r"\['embed'\]\['embedding'\] has shape \(62, 64\): its 'vocab' dimension \(62\) is not divisible by tensor = 4"),
    (_gpt_cfg(d_model=36, num_heads=4, d_mlp=64),
     r"has shape .*'embed' dimension \(36\) is not divisible by fsdp = 8"),
], ids=["heads", "mlp", "vocab", "embed"])
def test_gpt_sizes_not_divisible(mesh_factory, cfg, pattern):
    mesh = mesh_factory(fsdp=8) if "fsdp = 8" in pattern else mesh_factory(fsdp=2, tensor=4)
    model = GPT(cfg)
    with pytest.raises(ValueError, match=pattern):
        jp.train.init_state(model.init, optax.sgd(0.1), 0, mesh=mesh)
    with pytest.raises(ValueError, match=pattern):
        jp.train.abstract_state(model.init, optax.sgd(0.1), mesh=mesh)


def test_mlp_width_not_divisible(mesh_factory):
    init_fn, _ = mlp_parts(hidden=(30,))
    with pytest.raises(ValueError, match=r"\['dense_0'\]\['(bias|kernel)'\] has shape .*'mlp' dimension \(30\) "
                                         r"is not divisible by tensor = 4"):
        jp.train.init_state(init_fn, optax.sgd(0.1), 0, mesh=mesh_factory(fsdp=2, tensor=4))


# ------------------------------------------------------------------------------ optimizer-state shardings

HIDDEN = (256, 128, 128)
FACTORED = ("['dense_1']['kernel']", "['dense_2']['kernel']")
UNFACTORED = ("['dense_0']['bias']", "['dense_0']['kernel']", "['dense_1']['bias']", "['dense_2']['bias']",
              "['head']['bias']", "['head']['kernel']")

# eps=1e-3 for Adam: its first update is g / (|g| + eps), which turns a reduction-order rounding difference in a
# gradient element near 0 into an O(1) difference of that element's update (with optax's eps=1e-8 the fsdp=8
# step differs from the one-device step by 2.5e-4 * max|param|); 1e-3 is far above that noise. Lion's first
# update is sign(g): exact here, as no gradient element of this seed lies within rounding of 0.
OPTIMIZERS = {
    "adafactor": lambda: optax.adafactor(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "multisteps_adam": lambda: optax.MultiSteps(optax.adam(1e-2, eps=1e-3), every_k_schedule=4),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, eps=1e-3)),
    "adamw_pruning": lambda: optax.chain(optax.adamw(1e-2, eps=1e-3),
                                         jp.pruning.magnitude_pruning(0.5, distribution="global")),
    "loss_scaling_adamw": lambda: jp.precision.loss_scaling(optax.adamw(1e-2, eps=1e-3),
                                                            jp.precision.DynamicLossScale()),
}

# Per optimizer: the state leaves that are replicated (P()), and the factored moments' specs on fsdp=8
# (dense_1's kernel [mlp, embed] is P('tensor', 'fsdp'), dense_2's [embed, mlp] is P('fsdp', 'tensor')).
# optax factors a [r, c] kernel over its two largest axes d1 <= d0 (argsort order): v_row drops d0, v_col d1;
# for the square dense_2 both are 128, so only the update's dependence tells them apart.
EXPECTED = {
    "adafactor": dict(
        replicated=("[0].count", *(f"[0].{f}{p}" for f in ("v_row", "v_col") for p in UNFACTORED),
                    *(f"[0].v{p}" for p in FACTORED)),
        factored={"[0].v_row['dense_1']['kernel']": P("fsdp"), "[0].v_col['dense_1']['kernel']": P("tensor"),
                  "[0].v_row['dense_2']['kernel']": P("fsdp"), "[0].v_col['dense_2']['kernel']": P("tensor")},
        mirrors=6),
    "lion": dict(replicated=("[0].count",), mirrors=8),
    "multisteps_adam": dict(replicated=(".mini_step", ".gradient_step", ".inner_opt_state[0].count"), mirrors=24),
    "clip_adamw": dict(replicated=("[1][0].count",), mirrors=16),
    "adamw_pruning": dict(replicated=("[0][0].count", "[1].count"), mirrors=16 + 4),   # masks: the 4 kernels
    "loss_scaling_adamw": dict(replicated=(".scale", ".good_steps", ".skipped", ".num_skipped",
                                           ".inner_state[0].count"), mirrors=16),
}


_gt = jp.sharding.check_transformation     # optax.MultiSteps -> its GradientTransformation


@functools.cache
def _model():
    return mlp_parts(hidden=HIDDEN)


def _layout(mesh):
    """(boxed param shapes, unboxed param shapes, param shardings) of the MLP on ``mesh``."""
    init_fn, _ = _model()
    with jp.sharding.use(mesh):
        boxed = jax.eval_shape(init_fn, jax.random.key(0))
    return boxed, nn.meta.unbox(boxed), jp.sharding.named_shardings(boxed, mesh)


def _by_path(tree):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _expected_specs(name, opt_shapes, param_specs):
    """The expected spec of every state leaf: replicated, factored, or the spec of the param its path ends with."""
    exp, out, mirrors = EXPECTED[name], {}, 0
    for key in _by_path(opt_shapes):
        if key in exp["replicated"]:
            out[key] = P()
        elif key in exp.get("factored", {}):
            out[key] = exp["factored"][key]
        else:
            hits = [p for p in param_specs if key.endswith(p)]
            assert len(hits) == 1, (key, hits)
            out[key], mirrors = param_specs[hits[0]], mirrors + 1
    assert mirrors == exp["mirrors"], (name, mirrors)
    assert set(exp["replicated"]) <= set(out), set(exp["replicated"]) - set(out)
    return out


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_shardings(mesh_factory, name):
    mesh = mesh_factory(fsdp=8)
    _, shapes, shardings = _layout(mesh)
    tx = OPTIMIZERS[name]()
    got = jp.sharding.opt_state_shardings(tx, shapes, shardings, mesh)
    opt_shapes = jax.eval_shape(_gt(tx).init, shapes)
    assert jax.tree.structure(got) == jax.tree.structure(opt_shapes)
    expected = _expected_specs(name, opt_shapes, {k: s.spec for k, s in _by_path(shardings).items()})
    specs = {k: s.spec for k, s in _by_path(got).items()}
    assert specs == expected, {k: (specs[k], v) for k, v in expected.items() if specs[k] != v}
    assert all(isinstance(s, NamedSharding) and s.mesh == mesh for s in jax.tree.leaves(got))


def test_factored_moments_drop_the_reduced_axis(mesh_factory):
    """On fsdp=2 x tensor=4 both factors of each factored kernel are split: v_row keeps the row axis's mesh
    axes, v_col the column axis's (the shapes alone cannot tell them apart for the square dense_2)."""
    mesh = mesh_factory(fsdp=2, tensor=4)
    _, shapes, shardings = _layout(mesh)
    got = _by_path(jp.sharding.opt_state_shardings(optax.adafactor(1e-2), shapes, shardings, mesh))
    assert shardings["dense_1"]["kernel"].spec == P("tensor", "fsdp")     # [256, 128]: d1 = 1, d0 = 0
    assert got["[0].v_row['dense_1']['kernel']"].spec == P("fsdp")
    assert got["[0].v_col['dense_1']['kernel']"].spec == P("tensor")
    assert shardings["dense_2"]["kernel"].spec == P("fsdp", "tensor")     # [128, 128]: d1 = 0, d0 = 1
    assert got["[0].v_row['dense_2']['kernel']"].spec == P("fsdp")
    assert got["[0].v_col['dense_2']['kernel']"].spec == P("tensor")


def _per_device_and_total(tree):
    leaves = jax.tree.leaves(tree)
    return (sum(x.addressable_shards[0].data.nbytes for x in leaves), sum(x.nbytes for x in leaves))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_per_device_bytes(mesh_factory, name):
    """Params + state placed by ``jit(init, out_shardings=...)``: each device holds 1/8 of the bytes, plus the
    leaves the layout keeps whole: those listed as replicated in EXPECTED and the params (and their mirrors)
    whose spec has no ``fsdp`` (the biases on ``mlp`` and the head, replicated by the rules on this mesh)."""
    mesh = mesh_factory(fsdp=8)
    _, shapes, shardings = _layout(mesh)
    init_fn, _ = _model()
    tx = OPTIMIZERS[name]()
    state_shardings = jp.sharding.opt_state_shardings(tx, shapes, shardings, mesh)
    with jp.sharding.use(mesh):
        params = jax.jit(lambda k: nn.meta.unbox(init_fn(k)), out_shardings=shardings)(jax.random.key(0))
    opt_state = jax.jit(_gt(tx).init, out_shardings=state_shardings)(params)
    per_device, total = _per_device_and_total((params, opt_state))
    opt_shapes = jax.eval_shape(_gt(tx).init, shapes)
    param_specs = {k: s.spec for k, s in _by_path(shardings).items()}
    specs = {**param_specs, **_expected_specs(name, opt_shapes, param_specs)}
    leaves = {**_by_path(shapes), **_by_path(opt_shapes)}
    whole = sum(math.prod(leaves[k].shape) * leaves[k].dtype.itemsize for k, s in specs.items() if "fsdp" not in s)
    print(f"{name}: {per_device} B per device, {total} B replicated, {whole} B kept whole")
    assert whole <= total / 20                      # the small term: under 5% of the bytes (measured 2-4.5%)
    assert per_device <= total / 8 + whole, (per_device, total / 8, whole)


def test_the_report_gives_each_mesh_axis_its_own_share(mesh_factory):
    """Per mesh axis of size > 1, the share of bytes split over it: a leaf on tensor alone counts for tensor, not
    fsdp; an axis of size 1 in a spec (pipe, context) splits nothing and is not listed; data holds copies."""
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    rng = np.random.default_rng(11)
    rows = [int(4 * rng.integers(4, 32)) for _ in range(4)]
    specs = {"tp": P(None, "tensor"), "fsdp_tp": P("fsdp", "tensor"), "pipe": P("pipe", None),
             "both": P(("data", "fsdp"))}
    tree = {k: jax.ShapeDtypeStruct((n, 4) if k != "both" else (n,), jnp.float32, sharding=NamedSharding(mesh, spec))
            for (k, spec), n in zip(specs.items(), rows)}
    report = jp.sharding.describe_params(tree, {"mu": tree})
    nbytes = {k: 4 * math.prod(x.shape) for k, x in tree.items()}
    total = sum(nbytes.values())
    want = {"data": nbytes["both"] / total, "fsdp": (nbytes["fsdp_tp"] + nbytes["both"]) / total,
            "tensor": (nbytes["tp"] + nbytes["fsdp_tp"]) / total}
    assert report.mesh_axes == (("data", 2), ("fsdp", 2), ("tensor", 2))
    for axis, share in want.items():
        assert report.fraction_over(axis) == pytest.approx(share)
        assert report.fraction_over(axis, opt_state=True) == pytest.approx(share)
    assert report.fraction_over("pipe") == 0.0
    line = ", ".join(f"{a} {100 * want[a]:.1f}%" for a in ("data", "fsdp", "tensor"))
    assert f"bytes split over each mesh axis: params {line}; optimizer state {line}" in str(report)
    assert "pipe" not in str(report).splitlines()[1]


@functools.cache
def _batches(n):
    rng = np.random.default_rng(5)
    return [mlp_batch(rng, 32) for _ in range(n)]


def _run(name, mesh, steps):
    """(initial params, state after ``steps`` steps) of ``jp.train`` on ``mesh``."""
    init_fn, loss_fn = _model()
    tx = OPTIMIZERS[name]()
    state = jp.train.init_state(init_fn, tx, 3, mesh=mesh)
    _, shapes, shardings = _layout(mesh)
    placed = jax.tree.map(lambda x: x.sharding.spec, state.opt_state)
    want = jax.tree.map(lambda s: s.spec, jp.sharding.opt_state_shardings(tx, shapes, shardings, mesh))
    assert placed == want, "jp.train.init_state does not place the state by jp.sharding.opt_state_shardings"
    initial = jax.device_get(state.params)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False)
    for batch in _batches(steps):
        state, _ = step(state, batch)
    return initial, state


# Stepping parity of these runs in the slow set (fast-set time); their state placement is checked fast above.
# adamw_pruning's stepping: fast sibling multisteps_adam (the same fsdp=8 vs one-device run); its placement is
# test_per_device_bytes[adamw_pruning].
SLOW_STEPS = ("clip_adamw", "loss_scaling_adamw", "lion", "adafactor", "adamw_pruning")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_STEPS else []) for n in OPTIMIZERS])
def test_step_matches_single_device(mesh_factory, name):
    steps = 4 if name == "multisteps_adam" else 1
    initial, ref = _run(name, mesh_factory(), steps)
    _, got = _run(name, mesh_factory(fsdp=8), steps)
    worst = assert_tree_close(got.params, ref.params, what=f"{name} params")
    worst = max(worst, assert_tree_close(got.opt_state, ref.opt_state, what=f"{name} opt_state"))
    print(f"{name}: worst max|got-ref|/max|ref| = {worst:.3g}")
    moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), jax.device_get(ref.params), initial)
    assert all(jax.tree.leaves(moved["dense_1"])), "the reference step did not update the params"


# ------------------------------------------------------------------------- the dependence walk, the rules

def _probe_tx():
    """A transformation whose state moves axes: a transposed moment, a Gram matrix, a reshaped moment, a
    moment carried through a ``fori_loop`` and one through a ``scan``."""
    def init(params):
        w = params["w"]
        z = lambda *s: jnp.zeros(s, w.dtype)
        return {"t": z(w.shape[1], w.shape[0]), "gram": z(w.shape[0], w.shape[0]),
                "split": z(w.shape[0], w.shape[1] // 4, 4), "loop": jnp.zeros_like(w), "scan": jnp.zeros_like(w),
                "count": jnp.zeros((), jnp.int32)}

    def update(grads, state, params=None):
        g = grads["w"]
        loop = jax.lax.fori_loop(0, 3, lambda i, a: 0.5 * a + g, state["loop"])
        scan, _ = jax.lax.scan(lambda a, x: (a * 0.9 + x, None), state["scan"], jnp.stack([g, 2 * g]))
        new = {"t": 0.9 * state["t"] + g.T, "gram": g @ g.T, "split": g.reshape(state["split"].shape),
               "loop": loop, "scan": scan, "count": state["count"] + 1}
        return grads, new
    return optax.GradientTransformation(init, update)


def test_walk_follows_moved_axes(mesh_factory):
    mesh = mesh_factory(fsdp=2, tensor=4)
    shapes = {"w": jax.ShapeDtypeStruct((16, 32), jnp.float32)}
    shardings = {"w": NamedSharding(mesh, P("fsdp", "tensor"))}
    got = jax.tree.map(lambda s: s.spec, jp.sharding.opt_state_shardings(_probe_tx(), shapes, shardings, mesh))
    assert got == {"t": P("tensor", "fsdp"), "gram": P("fsdp", None),     # fsdp used once per array
                   "split": P("fsdp", None, None), "loop": P("fsdp", "tensor"), "scan": P("fsdp", "tensor"),
                   "count": P()}


def test_indivisible_axis_stays_whole(mesh_factory):
    mesh = mesh_factory(fsdp=8)
    shapes = {"a": jax.ShapeDtypeStruct((12, 16), jnp.float32)}
    shardings = {"a": NamedSharding(mesh, P("fsdp", None))}     # a hand-made layout that does not divide
    got = jp.sharding.opt_state_shardings(optax.adam(1e-3), shapes, shardings, mesh)
    assert got[0].mu["a"].spec == P(None, None) and got[0].count.spec == P()


def test_untraceable_update_falls_back_to_paths(mesh_factory):
    """An update that needs an extra argument cannot be traced on shapes: a warning, and the state leaves
    follow the params whose path and shape they have."""
    def update(updates, state, params=None, *, value):
        return updates, state
    tx = optax.GradientTransformationExtraArgs(lambda p: {"mu": jax.tree.map(jnp.zeros_like, p), "n": jnp.zeros(())},
                                               update)
    mesh = mesh_factory(fsdp=8)
    _, shapes, shardings = _layout(mesh)
    with pytest.warns(UserWarning, match=r"could not trace tx.update"):
        got = jp.sharding.opt_state_shardings(tx, shapes, shardings, mesh)
    assert got["mu"]["dense_1"]["kernel"].spec == P("tensor", "fsdp") and got["n"].spec == P()


def test_bad_input(mesh_factory):
    mesh = mesh_factory(fsdp=8)
    _, shapes, shardings = _layout(mesh)
    with pytest.raises(TypeError, match=r"tx must be an optax.GradientTransformation"):
        jp.sharding.opt_state_shardings(optax.adam, shapes, shardings, mesh)
    with pytest.raises(ValueError, match=r"param_shardings must have the structure of param_shapes"):
        jp.sharding.opt_state_shardings(optax.adam(1e-3), shapes, {"dense_0": shardings["dense_0"]}, mesh)
    with pytest.raises(TypeError, match=r"NamedShardings on the mesh"):
        jp.sharding.opt_state_shardings(optax.adam(1e-3), shapes, jax.tree.map(lambda s: s.spec, shardings), mesh)
