"""Models nobody here wrote get real FSDP (and TP where they name it): a plain-dict MLP (the JAX docs' form), an
unannotated Linen CNN (the Flax MNIST tutorial's form), Flax's scale-up-guide annotations (mesh axis names), path
rules (t5x / EasyLM), a Linen model with MaxText's logical names and the user's rules, and ``nn.DenseGeneral``
kernels named in 3-D. Each is defined here, and each parity check is against a plain-JAX single-device
reference (``jax.value_and_grad`` + the optax update, no jaxpar), on fresh random inputs."""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar as jp
from tests.helpers import assert_scalar_close, assert_tree_close

SGD = optax.sgd(0.05, momentum=0.9)
ADAMW = optax.adamw(1e-3, weight_decay=0.1)


def init_key(seed: int = 0) -> jax.Array:
    """The key ``init_state(..., rng=seed)`` hands the init function (the first half of ``split(key(seed))``)."""
    return jax.random.split(jax.random.key(seed))[0]


def reference_run(loss_fn, params, tx, batches):
    """Single-device float32 training in plain JAX: ``(losses, final params)``."""
    params = jax.device_put(params, jax.devices()[0])
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, jax.random.key(0))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(loss)
    return losses, params


def jaxpar_run(init_fn, loss_fn, tx, batches, mesh, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = jp.train.init_state(init_fn, tx, 0, mesh=mesh, report=False, **{k: v for k, v in kw.items()
                                                                                 if k != "rules"},
                                    rules=kw.get("rules", jp.sharding.DEFAULT_RULES))
        step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, rules=kw.get("rules", jp.sharding.DEFAULT_RULES))
        first, losses = jax.device_get(state.params), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
    return first, state, losses


def check_parity(init_fn, loss_fn, tx, batches, mesh, rtol=1e-5, **kw):
    """jaxpar on ``mesh`` against the plain-JAX reference: every step's loss and every updated param."""
    ref_losses, ref_params = reference_run(loss_fn, nn.meta.unbox(init_fn(init_key())), tx, batches)
    first, state, losses = jaxpar_run(init_fn, loss_fn, tx, batches, mesh, **kw)
    for k, (got, ref) in enumerate(zip(losses, ref_losses)):
        assert_scalar_close(got, ref, rtol, f"loss at step {k}")
    return first, state, assert_tree_close(state.params, ref_params, rtol, "params after the steps")


# --------------------------------------------------------------------------------------------- models

def mlp_init(key):
    """The JAX docs' MLP: a dict of arrays, no names anywhere."""
    sizes, keys = [64, 512, 512, 10], jax.random.split(key, 3)
    return {f"layer{i}": {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
            for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}


def mlp_loss(params, batch, rng):
    h = batch["x"]
    for i in range(3):
        h = h @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
        h = jax.nn.relu(h) if i < 2 else h
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean(), {}


class CNN(nn.Module):
    """The Flax MNIST tutorial's CNN, sized for 8x8 digits: no partitioning anywhere."""

    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), (2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(64, (3, 3))(x)), (2, 2), (2, 2))
        x = nn.relu(nn.Dense(512)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


def cnn_init(key):
    return CNN().init(key, jnp.zeros((1, 8, 8, 1)))


def cnn_loss(params, batch, rng):
    return optax.softmax_cross_entropy_with_integer_labels(CNN().apply(params, batch["x"]), batch["y"]).mean(), {}


def mlp_batches(n, batch_size=16, seed=1):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(batch_size, 64)).astype(np.float32),
             "y": rng.integers(0, 10, batch_size).astype(np.int32)} for _ in range(n)]


def image_batches(n, batch_size=16, seed=2):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(batch_size, 8, 8, 1)).astype(np.float32),
             "y": rng.integers(0, 10, batch_size).astype(np.int32)} for _ in range(n)]


def ratio(state) -> float:
    return state.report().ratio


# ------------------------------------------------------------------------------------------ auto FSDP

@pytest.mark.parametrize("name", ["dict_mlp", pytest.param("linen_cnn", marks=pytest.mark.slow)])
def test_unannotated_models_shard_over_fsdp_and_match_one_device(mesh_factory, name):
    init_fn, loss_fn, batches = {"dict_mlp": (mlp_init, mlp_loss, mlp_batches(3)),
                                 "linen_cnn": (cnn_init, cnn_loss, image_batches(3))}[name]
    first, state, worst = check_parity(init_fn, loss_fn, SGD, batches, mesh_factory(fsdp=8))
    r = ratio(state)
    print(f"{name}: fsdp=8 per-device / global bytes (params + SGD momentum) {r:.3f}; worst param error {worst:.2e}")
    assert r <= 0.15
    assert_tree_close(first, nn.meta.unbox(init_fn(init_key())), 1e-6, "initial params")   # 1 ulp: fused scaling


def test_adamw_parity_figure_on_an_unannotated_model(mesh_factory):
    _, _, worst = check_parity(mlp_init, mlp_loss, ADAMW, mlp_batches(3), mesh_factory(fsdp=8), rtol=1e-4)
    print(f"dict MLP, AdamW, fsdp=8: worst per-leaf max|diff|/max|ref| after 3 steps {worst:.2e}")


def test_auto_fsdp_picks_the_largest_divisible_dim_and_skips_small_leaves(mesh_factory):
    mesh = mesh_factory(fsdp=8)
    init = lambda k: {"wide": jnp.ones((12, 1024)), "square": jnp.ones((64, 64)), "odd": jnp.ones((99, 77)),
                      "bias": jnp.ones((512,)), "conv": jnp.ones((3, 3, 64, 128))}
    state = jp.train.init_state(init, SGD, 0, mesh=mesh, report=False)
    specs = {k: v.sharding.spec for k, v in state.params.items()}
    assert specs == {"wide": P(None, "fsdp"), "square": P("fsdp", None), "odd": P(), "bias": P(),
                     "conv": P(None, None, None, "fsdp")}
    off = jp.train.init_state(init, SGD, 0, mesh=mesh, report=False, auto_fsdp=False)
    assert all(v.sharding.spec == P() for v in off.params.values())
    small = jp.train.init_state(init, SGD, 0, mesh=mesh, report=False, auto_fsdp_min_size=0)
    assert small.params["bias"].sharding.spec == P("fsdp")


def test_the_summary_names_sharded_and_replicated_leaves(mesh_factory, capsys):
    state = jp.train.init_state(cnn_init, SGD, 0, mesh=mesh_factory(fsdp=8))
    out = capsys.readouterr().out
    assert re.search(r"params/Conv_1/kernel\s+\(3, 3, 32, 64\)\s+P\(None, None, None, 'fsdp'\)\s+auto fsdp", out)
    assert re.search(r"params/Conv_0/kernel\s+\(3, 3, 1, 32\)\s+P\(\)\s+replicated", out)
    assert "largest replicated: params/Dense_0/bias" in out and "per device / global 0.1" in out
    report = state.report()
    assert [r.path for r in report.replicated(1)] == ["params/Dense_0/bias"]
    assert 0.95 < report.fraction_sharded < 1.0
    assert list(report)[0] == ("params/Conv_0/bias", (32,), "P()")   # rows as describe_params gave
    jp.train.init_state(cnn_init, SGD, 0, mesh=mesh_factory(fsdp=8), report=False)
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------------------- names and path rules

class ScaleUpMLP(nn.Module):
    """Flax's scale-up guide's annotations: mesh axis names, ``nn.with_partitioning(init, ("fsdp", None))``."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.relu(nn.Dense(512, kernel_init=nn.with_partitioning(init, ("fsdp", None)))(x))
        return nn.Dense(10, kernel_init=nn.with_partitioning(init, (None, "tensor")))(x)


def test_mesh_axis_annotations_are_honoured_as_partition_specs(mesh_factory):
    init = lambda k: ScaleUpMLP().init(k, jnp.zeros((1, 64)))
    loss = lambda p, b, r: (optax.softmax_cross_entropy_with_integer_labels(ScaleUpMLP().apply(p, b["x"]),
                                                                            b["y"]).mean(), {})
    ref = nn.meta.unbox(init(init_key()))
    _, state, _ = check_parity(lambda k: init(k), loss, SGD, mlp_batches(2), mesh_factory(data=2, fsdp=2, tensor=2))
    assert state.params["params"]["Dense_0"]["kernel"].sharding.spec == P("fsdp", None)
    assert state.params["params"]["Dense_1"]["kernel"].sharding.spec == P(None, "tensor")
    assert jax.tree.structure(state.params) == jax.tree.structure(ref)


MLP_PATH_RULES = [(r"layer0/w", ("embed", "mlp")), (r"layer1/w", ("mlp", "embed")), (r"layer2/w", P("tensor")),
                  (r"layer[01]/b", ("mlp",))]


def test_path_rules_give_a_plain_pytree_tensor_parallelism(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    _, state, worst = check_parity(mlp_init, mlp_loss, SGD, mlp_batches(3), mesh,
                                   param_rules=jp.sharding.path_rules(MLP_PATH_RULES))
    specs = {k: (v["w"].sharding.spec, v["b"].sharding.spec) for k, v in state.params.items()}
    assert specs == {"layer0": (P("fsdp", "tensor"), P("tensor")), "layer1": (P("tensor", "fsdp"), P("tensor")),
                     "layer2": (P("tensor"), P())}
    print(f"dict MLP with path rules on 2x2x2: worst param error {worst:.2e}")


def test_path_rules_win_over_annotations_first_match_and_unmatched_rules_are_reported(mesh_factory):
    mesh = mesh_factory(fsdp=2, tensor=2)
    init = lambda k: ScaleUpMLP().init(k, jnp.zeros((1, 64)))
    rules = jp.sharding.path_rules([(r"Dense_0/kernel", (None, "mlp")), (r"Dense_\d+/kernel", P()),
                                    (r"no_such_param", ("embed",))])
    with pytest.warns(UserWarning, match=r"path rule 'no_such_param' matched no param"):
        state = jp.train.init_state(init, SGD, 0, mesh=mesh, param_rules=rules, report=False)
    assert state.params["params"]["Dense_0"]["kernel"].sharding.spec == P(None, "tensor")
    assert state.params["params"]["Dense_1"]["kernel"].sharding.spec == P()


@pytest.mark.parametrize("rules, error, match", [
    ([(r"layer(0/w", ("embed", "mlp"))], ValueError, r"path rule regex 'layer\(0/w' is invalid"),
    ([(r"layer0/w", ("embed", "mlp", None))], ValueError,
     r"path rule 'layer0/w' names 3 dimensions .* of param layer0/w, of rank 2"),
    ([(r"layer0/w", P(None, None, "fsdp"))], ValueError, r"gives P\(None, None, 'fsdp'\) \(3 entries\)"),
    ([(r"layer0/w", P("pipeline"))], ValueError, r"the mesh .* has no axis \['pipeline'\]"),
    ([(r"layer0/w", 3)], ValueError, r"target 3 must be a tuple of logical axis names"),
    ("layer0/w", ValueError, r"path_rules takes a list of \(regex, logical names \| PartitionSpec\) pairs"),
], ids=["regex", "names_rank", "spec_rank", "mesh_axis", "target", "not_a_list"])
def test_bad_path_rules_are_refused_before_tracing(mesh_factory, no_compiling, rules, error, match):
    with pytest.raises(error, match=match):
        jp.train.init_state(mlp_init, SGD, 0, mesh=mesh_factory(fsdp=2), param_rules=rules)


def test_tensor_parallelism_with_nothing_to_split_is_an_error(mesh_factory, no_compiling):
    with pytest.raises(ValueError, match=r"tensor=2 but no parameter maps to the tensor axis.*path_rules"):
        jp.train.init_state(mlp_init, SGD, 0, mesh=mesh_factory(fsdp=2, tensor=2))
    with pytest.raises(TypeError, match=r"auto_fsdp must be True .* or False"):
        jp.train.init_state(mlp_init, SGD, 0, mesh=mesh_factory(fsdp=2), auto_fsdp="yes")


# --------------------------------------------------------------------- MaxText's names, user's rules

MAXTEXT_RULES = (
    ("activation_batch", ("data", "fsdp")), ("activation_length", None), ("activation_embed", None),
    ("activation_heads", "tensor"), ("activation_kv", None), ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"), ("q_heads", "tensor"), ("kv", None),
    ("vocab", "tensor"),
)
VOCAB, D, HEADS, KV, MLP_DIM, SEQ = 128, 64, 4, 16, 256, 16


def _named(*names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class MaxTextLM(nn.Module):
    """A one-block decoder in MaxText's naming: ``activation_*`` constraints, ``q_heads`` on 3-D DenseGeneral
    kernels, ``embed``/``mlp``/``vocab`` params."""

    @nn.compact
    def __call__(self, tokens):
        c = lambda x, *names: nn.with_logical_constraint(x, names)
        emb = self.param("embedding", nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")),
                         (VOCAB, D))
        x = c(jnp.take(emb, tokens, axis=0), "activation_batch", "activation_length", "activation_embed")
        h = nn.LayerNorm(use_bias=False)(x)
        q, k, v = (c(nn.DenseGeneral((HEADS, KV), kernel_init=_named("embed", "q_heads", "kv"), use_bias=False,
                                     name=n)(h), "activation_batch", "activation_length", "activation_heads",
                     "activation_kv") for n in ("query", "key", "value"))
        scores = jnp.einsum("blhk,bmhk->bhlm", q, k) / np.sqrt(KV)
        scores = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), scores, -1e9)
        att = jnp.einsum("bhlm,bmhk->blhk", jax.nn.softmax(scores, -1), v)
        x = x + nn.DenseGeneral(D, axis=(-2, -1), kernel_init=_named("q_heads", "kv", "embed"), use_bias=False,
                                name="out")(att)
        h = c(nn.Dense(MLP_DIM, kernel_init=_named("embed", "mlp"), use_bias=False)(nn.LayerNorm(use_bias=False)(x)),
              "activation_batch", "activation_length", "activation_mlp")
        x = x + nn.Dense(D, kernel_init=_named("mlp", "embed"), use_bias=False)(nn.gelu(h))
        logits = nn.Dense(VOCAB, kernel_init=_named("embed", "vocab"), use_bias=False)(x)
        return c(logits, "activation_batch", "activation_length", "activation_vocab")


def maxtext_init(key):
    return MaxTextLM().init(key, jnp.zeros((1, SEQ), jnp.int32))


def maxtext_loss(params, batch, rng):
    logits = MaxTextLM().apply(params, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(), {}


def token_batches(n, batch_size=16, seed=3):
    rng = np.random.default_rng(seed)
    return [{k: rng.integers(0, VOCAB, (batch_size, SEQ)).astype(np.int32) for k in ("inputs", "targets")}
            for _ in range(n)]


def _flops(mesh, rules, batch_size=64):
    abstract = jp.train.abstract_state(maxtext_init, SGD, mesh=mesh, rules=rules)
    step = jp.train.make_train_step(maxtext_loss, SGD, mesh=mesh, rules=rules)
    batch = {k: jax.ShapeDtypeStruct((batch_size, SEQ), jnp.int32) for k in ("inputs", "targets")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = step.lower(abstract, batch)
    compiled = lowered.compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return float(analysis["flops"]), compiled.input_shardings[0][1]["inputs"].spec


@pytest.mark.slow   # three compiles (~19 s busy); the default-rules sibling stays fast
def test_maxtext_names_with_the_users_rules_shard_batch_and_params(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    _, state, worst = check_parity(maxtext_init, maxtext_loss, SGD, token_batches(2), mesh, rules=MAXTEXT_RULES)
    params = state.params["params"]
    assert params["query"]["kernel"].sharding.spec == P("fsdp", "tensor", None)
    assert params["out"]["kernel"].sharding.spec == P("tensor", None, "fsdp")
    assert params["embedding"].sharding.spec == P("tensor", "fsdp")
    one, _ = _flops(mesh_factory(), MAXTEXT_RULES)
    eight, batch_spec = _flops(mesh, MAXTEXT_RULES)
    print(f"MaxText-named LM on 2x2x2 with its rules: per-device FLOPs / one device's = {eight / one:.3f} "
          f"(ideal 0.125); input batch {batch_spec}; worst param error {worst:.2e}")
    assert batch_spec == P(("data", "fsdp"), None)
    assert eight <= 1.2 * one / 8
    fsdp8 = jp.train.abstract_state(maxtext_init, SGD, mesh=mesh_factory(fsdp=8), rules=MAXTEXT_RULES)
    r = jp.sharding.describe_params(fsdp8.params, fsdp8.opt_state).ratio
    print(f"MaxText-named LM, fsdp=8 with its rules: per-device / global bytes {r:.3f}")
    assert r <= 0.15


def test_maxtext_names_under_the_default_rules_are_reported(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    with pytest.warns(UserWarning, match=r"param params/query/kernel: logical names \['q_heads'\] are known to no "
                                         r"rule"):
        state = jp.train.init_state(maxtext_init, SGD, 0, mesh=mesh, report=False)
    step = jp.train.make_train_step(maxtext_loss, SGD, mesh=mesh)
    with pytest.warns(UserWarning, match=r"activation constraints name logical axes no rule knows: "
                                         r"'activation_batch' \(at .*test_placement.py:\d+\)"):
        step(state, token_batches(1)[0])


class HeadsAttention(nn.Module):
    """``nn.DenseGeneral`` kernels named in 3-D with jaxpar's names (``embed``, ``heads``, ``kv``)."""

    @nn.compact
    def __call__(self, x):
        qkv = [nn.DenseGeneral((HEADS, KV), kernel_init=_named("embed", "heads", "kv"), use_bias=False, name=n)(x)
               for n in ("query", "key", "value")]
        att = jax.nn.dot_product_attention(*qkv, is_causal=True)
        return nn.DenseGeneral(D, axis=(-2, -1), kernel_init=_named("heads", "kv", "embed"), name="out")(att)


def test_dense_general_named_in_3d_initialises_and_trains_with_heads_on_tensor(mesh_factory):
    init = lambda k: HeadsAttention().init(k, jnp.zeros((1, SEQ, D)))
    loss = lambda p, b, r: (jnp.mean((HeadsAttention().apply(p, b["x"]) - b["y"]) ** 2), {})
    rng = np.random.default_rng(4)
    batches = [{k: rng.normal(size=(8, SEQ, D)).astype(np.float32) for k in ("x", "y")} for _ in range(2)]
    _, state, _ = check_parity(init, loss, SGD, batches, mesh_factory(data=2, fsdp=2, tensor=2))
    assert state.params["params"]["query"]["kernel"].sharding.spec == P("fsdp", "tensor", None)
    assert state.params["params"]["out"]["kernel"].sharding.spec == P("tensor", None, "fsdp")


def test_names_longer_than_the_rank_name_the_parameter(mesh_factory, no_compiling):
    init = lambda k: {"w": nn.LogicallyPartitioned(jnp.ones((4, 4)), ("embed", "mlp", "kv"))}
    with pytest.raises(ValueError, match=r"param w of shape \(4, 4\) is named \('embed', 'mlp', 'kv'\): more names"):
        jp.train.init_state(init, SGD, 0, mesh=mesh_factory(fsdp=2))


# -------------------------------------------------------------- the rest of jaxpar on these models

def test_magnitude_pruning_on_an_unannotated_model_matches_one_device(mesh_factory):
    """Pruning masks live in the optimizer state and follow the auto-FSDP params' shardings; the pruned run
    equals the same optax chain on one device."""
    tx = optax.chain(SGD, jp.pruning.magnitude_pruning(jp.pruning.one_shot(0.5, 0)))
    _, state, _ = check_parity(mlp_init, mlp_loss, tx, mlp_batches(2), mesh_factory(fsdp=8))
    masks = jp.pruning.masks(state.opt_state)
    w = state.params["layer1"]["w"]
    assert masks["layer1"]["w"].sharding.spec == w.sharding.spec == P("fsdp", None)
    assert float(jnp.mean(w == 0)) == 0.5 and float(jnp.mean(state.params["layer1"]["b"] == 0)) < 0.5


def test_mixed_bf16_on_an_unannotated_cnn(mesh_factory):
    """The policy casts params and images: every dot of the step is bf16; the loss is the f32 one to bf16 accuracy."""
    from tests.test_precision import BF16_TOL, dot_dtypes
    mesh, batch = mesh_factory(fsdp=8), image_batches(1)[0]
    state = jp.train.init_state(cnn_init, SGD, 0, mesh=mesh, policy=jp.Policy.from_string("mixed_bf16"),
                                report=False)
    step = jp.train.make_train_step(cnn_loss, SGD, mesh=mesh, donate=False)
    n_dots, n_bf16 = dot_dtypes(step, state, batch)
    assert n_dots >= 2 and n_bf16 == n_dots, (n_dots, n_bf16)
    ref_losses, _ = reference_run(cnn_loss, nn.meta.unbox(cnn_init(init_key())), SGD, [batch])
    _, metrics = step(state, batch)
    assert_scalar_close(metrics["loss"], ref_losses[0], BF16_TOL, "mixed_bf16 loss against f32")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))


@pytest.mark.parametrize("target", [P("fsdp", "fsdp"), ("embed", "embed")])
def test_a_path_rule_naming_an_axis_twice_is_refused(target):
    with pytest.raises(ValueError, match=r"path rule 'w1': target .* names an axis twice"):
        jp.sharding.path_rules([("w1", target)])


# ----------------------------------------------------- the Flax docs' NNX MiniGPT: names on tensor alone

MINI = dict(maxlen=32, vocab=256, d=64, heads=4, ff=256, blocks=2)
MODEL_RULES = jp.sharding.DEFAULT_RULES + (("model", "tensor"),)


def _on_model(init, names):
    return nnx.with_partitioning(init, names)


class MiniBlock(nnx.Module):
    """The Flax docs' MiniGPT block: ``nnx.MultiHeadAttention`` (query/key/value/out projections), post-norm
    LayerNorms and a ReLU MLP, every variable named ``(None, 'model')`` or ``('model',)``."""

    def __init__(self, d, heads, ff, *, rngs):
        xavier, zeros = nnx.initializers.xavier_uniform(), nnx.initializers.zeros_init()
        ones = nnx.initializers.ones_init()
        kernel, vector = _on_model(xavier, (None, "model")), lambda init: _on_model(init, ("model",))
        self.mha = nnx.MultiHeadAttention(num_heads=heads, in_features=d, kernel_init=kernel,
                                          bias_init=vector(zeros), decode=False, rngs=rngs)
        self.norm1, self.norm2 = (nnx.LayerNorm(d, epsilon=1e-6, scale_init=vector(ones), bias_init=vector(zeros),
                                                rngs=rngs) for _ in range(2))
        self.up = nnx.Linear(d, ff, kernel_init=kernel, bias_init=vector(zeros), rngs=rngs)
        self.down = nnx.Linear(ff, d, kernel_init=kernel, bias_init=vector(zeros), rngs=rngs)

    def __call__(self, x_BLD):
        mask = nnx.make_causal_mask(x_BLD[..., 0])
        x_BLD = self.norm1(x_BLD + self.mha(x_BLD, mask=mask, decode=False))
        return self.norm2(x_BLD + self.down(jax.nn.relu(self.up(x_BLD))))


class MiniGPT(nnx.Module):
    """Token and position embeddings, the blocks, an LM head: the Flax docs' NNX MiniGPT, small."""

    def __init__(self, rngs: nnx.Rngs, maxlen=MINI["maxlen"], vocab=MINI["vocab"], d=MINI["d"],
                 heads=MINI["heads"], ff=MINI["ff"], blocks=MINI["blocks"]):
        normal, xavier = nnx.initializers.normal(0.02), nnx.initializers.xavier_uniform()
        self.tok = nnx.Embed(vocab, d, embedding_init=_on_model(normal, ("model", None)), rngs=rngs)
        self.pos = nnx.Embed(maxlen, d, embedding_init=_on_model(normal, (None, "model")), rngs=rngs)
        self.blocks = nnx.List([MiniBlock(d, heads, ff, rngs=rngs) for _ in range(blocks)])
        self.head = nnx.Linear(d, vocab, kernel_init=_on_model(xavier, (None, "model")),
                               bias_init=_on_model(nnx.initializers.zeros_init(), ("model",)), rngs=rngs)

    def __call__(self, tokens_BL):
        x_BLD = self.tok(tokens_BL) + self.pos(jnp.arange(tokens_BL.shape[1]))[None]
        for block in self.blocks:
            x_BLD = block(x_BLD)
        return self.head(x_BLD)


def mini_loss(model, batch, rng):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(), {}


def _mini_expected(shapes, min_size=4096):
    """Worked out from the names alone on data=2 x fsdp=2 x tensor=2: every leaf has one ``model`` dimension
    (tensor, 2 ways); one of at least ``min_size`` elements (automatic FSDP's default threshold) also has an
    unnamed even dimension (fsdp, 2 more); data holds copies.

    Returns:
      (per-device / global param bytes, the share of param bytes split over fsdp).
    """
    sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)]
    big = sum(n for n in sizes if n >= min_size)
    return (big / 4 + (sum(sizes) - big) / 2) / sum(sizes), big / sum(sizes)


def test_a_minigpt_named_on_tensor_alone_also_gets_fsdp_and_the_report_says_per_axis(mesh_factory):
    """The MiniGPT's names map to tensor only: automatic FSDP adds fsdp on a free dimension of every leaf large
    enough, and the report gives each mesh axis its own share (without automatic FSDP: fsdp 0%, not 'sharded')."""
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    abstract = lambda **kw: jp.train.abstract_state(MiniGPT, ADAMW, mesh=mesh, rules=MODEL_RULES, **kw)
    state, off = abstract(), abstract(auto_fsdp=False)
    ratio, on_fsdp = _mini_expected(state.params)
    report, off_report = state.report(), off.report()
    print(f"NNX MiniGPT on 2x2x2, ('model', 'tensor'): per device / global {off_report.ratio:.3f} without automatic "
          f"FSDP, {report.ratio:.3f} with it (worked out {ratio:.3f}; data=2 holds copies, so 0.25 is the floor)")
    block = state.params["blocks"][0]
    assert block["mha"]["query"]["kernel"].sharding.spec == P("fsdp", "tensor", None)
    assert block["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert state.params["tok"]["embedding"].sharding.spec == P("tensor", "fsdp")
    assert state.params["pos"]["embedding"].sharding.spec == P(None, "tensor")     # 2048 elements: too small
    assert block["up"]["bias"].sharding.spec == P("tensor")
    assert report.ratio == pytest.approx(ratio, abs=1e-3) and report.ratio <= 0.26
    assert report.fraction_over("fsdp") == pytest.approx(on_fsdp)
    assert f"params data 0.0%, fsdp {100 * on_fsdp:.1f}%, tensor 100.0%" in str(report)
    assert off_report.ratio == pytest.approx(0.5, abs=1e-3)
    assert "params data 0.0%, fsdp 0.0%, tensor 100.0%; optimizer state data 0.0%, fsdp 0.0%" in str(off_report)
    assert "of param bytes sharded" not in str(off_report)


@pytest.mark.slow   # an 8-device compile of the MiniGPT's step; the placement itself is checked in the fast set
def test_the_minigpt_with_fsdp_added_matches_one_device(mesh_factory):
    """Its activations carry no constraints, so the step gathers its FSDP weights (without: the second loss is
    5.80796 against 5.80332, jaxpar._compat.gathers_fsdp_weights)."""
    from tests.models.test_nnx_bridge import check, reference
    rng = np.random.default_rng(7)
    batches = [{k: rng.integers(0, MINI["vocab"], (8, 16)).astype(np.int32) for k in ("inputs", "targets")}
               for _ in range(2)]
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    state = jp.train.init_state(MiniGPT, SGD, 0, mesh=mesh, rules=MODEL_RULES, report=False)
    step = jp.train.make_train_step(mini_loss, SGD, mesh=mesh, rules=MODEL_RULES)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    ref_losses, ref_params, ref_state = reference(MiniGPT, mini_loss, SGD, batches)
    got = jax.device_get(state.params)
    # the key bias adds one constant to each query's attention logits, to which softmax is blind: its gradient
    # is 0 in exact arithmetic and both sides hold rounding noise (~1e-10), which no relative error can compare
    for params in (got, ref_params):
        for block in params["blocks"].values():
            assert np.abs(block["mha"]["key"]["bias"]).max() < 1e-8
            block["mha"]["key"]["bias"] = np.zeros_like(block["mha"]["key"]["bias"])
    worst = check(losses, state.replace(params=got), (ref_losses, ref_params, ref_state))
    assert state.params["blocks"][1]["down"]["kernel"].sharding.spec == P("fsdp", "tensor")
    print(f"NNX MiniGPT on 2x2x2 with fsdp added: worst param error {worst:.2e} after 2 steps")


# the param specs of the built-in GPT and Llama on data=2 x fsdp=2 x tensor=2 under DEFAULT_RULES, recorded
# before automatic FSDP completed logical names: their names never leave a dimension free, so they must hold.
# At these sizes blocks/up_bias ([layers, mlp], 4096 elements) is large enough that an fsdp on its "layers"
# dimension would be a change.
BUILT_IN_SPECS = {
    "gpt": {"blocks/down_bias": P(None, "fsdp"), "blocks/down_kernel": P(None, "tensor", "fsdp"),
            "blocks/ln1_bias": P(None, "fsdp"), "blocks/ln1_scale": P(None, "fsdp"),
            "blocks/ln2_bias": P(None, "fsdp"), "blocks/ln2_scale": P(None, "fsdp"),
            "blocks/out_bias": P(None, "fsdp"), "blocks/out_kernel": P(None, "tensor", None, "fsdp"),
            "blocks/qkv_kernel": P(None, "fsdp", "tensor", None, None), "blocks/up_bias": P(None, "tensor"),
            "blocks/up_kernel": P(None, "fsdp", "tensor"), "embed/embedding": P("tensor", "fsdp"),
            "embed/pos_embedding": P(None, "fsdp"), "head/ln_bias": P("fsdp"), "head/ln_scale": P("fsdp")},
    "llama": {"blocks/attn_norm_scale": P(None, "fsdp"), "blocks/down_kernel": P(None, "tensor", "fsdp"),
              "blocks/gate_kernel": P(None, "fsdp", "tensor"), "blocks/k_kernel": P(None, "fsdp", None, None),
              "blocks/mlp_norm_scale": P(None, "fsdp"), "blocks/out_kernel": P(None, "tensor", None, "fsdp"),
              "blocks/q_kernel": P(None, "fsdp", "tensor", None), "blocks/up_kernel": P(None, "fsdp", "tensor"),
              "blocks/v_kernel": P(None, "fsdp", None, None), "embed/embedding": P("tensor", "fsdp"),
              "head/kernel": P("fsdp", "tensor"), "head/norm_scale": P("fsdp")},
}


@pytest.mark.slow   # a regression guard (two abstract inits); test_sharding and test_train check smaller GPTs' specs fast
def test_the_built_in_models_placements_are_unchanged(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    models = {"gpt": jp.models.GPT(jp.models.GPTConfig(vocab_size=512, num_layers=4, num_heads=4, d_model=256,
                                                       max_seq_len=256)),
              "llama": jp.models.Llama(jp.models.LlamaConfig(vocab_size=512, num_layers=4, num_heads=8,
                                                             num_kv_heads=2, d_model=256))}
    for name, model in models.items():
        state = jp.train.abstract_state(model.init, SGD, mesh=mesh)
        got = {path: spec for path, _, spec in state.report()}
        assert got == {k: str(v) for k, v in BUILT_IN_SPECS[name].items()}, name


@pytest.mark.parametrize("seq_rules, refused", [
    ((("seq", None), ("seq", "context")), True),    # the first seq rule leaves the sequence whole: context unused
    ((("seq", "context"), ("seq", None)), False),   # the first maps it to context; the later None is ignored
], ids=["first-whole", "first-context"])
def test_activation_audit_reads_the_first_rule_of_a_name(mesh_factory, seq_rules, refused):
    """The activation audit's check that some activation uses ``context`` reads the rules as Flax does (first
    match wins), not through a dict (last wins)."""
    from jaxpar.sharding.params import audit_activation_names
    mesh = mesh_factory(data=4, context=2)
    rules = seq_rules + tuple(r for r in jp.sharding.DEFAULT_RULES if r[0] != "seq")
    x = jax.ShapeDtypeStruct((8, 4, 16), jnp.float32)

    def trace():
        with audit_activation_names(mesh, rules), jp.sharding.use(mesh, rules):
            jax.eval_shape(lambda v: jp.sharding.constrain(v, "batch", "seq", "embed"), x)
    if refused:
        with pytest.raises(ValueError, match=r"context=2, but no activation of this step names a logical axis"):
            trace()
    else:
        trace()
