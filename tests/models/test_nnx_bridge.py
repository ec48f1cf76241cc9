"""Flax NNX models, written here the way the NNX guides write them, trained by jaxpar with real FSDP/TP.

References are plain NNX on one device (``nnx.split`` / ``nnx.merge`` and an optax update in ``jax.jit``, no
jaxpar), from the same init key; every step's loss, every updated param and the model state (batch statistics,
dropout RNG counts) are compared per leaf at 1e-5 * max|ref|.
"""

from __future__ import annotations

import functools
import warnings

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
VOCAB, D, HEADS, MLP_DIM, SEQ = 128, 64, 4, 256, 16


def named(*names, init=nnx.initializers.lecun_normal()):
    return nnx.with_partitioning(init, names)


class TransformerLM(nnx.Module):
    """One pre-norm transformer block with token embedding and an LM head; every kernel named."""

    def __init__(self, rngs: nnx.Rngs, embed_dtype=None):
        # nnx.Embed computes in its param dtype unless given dtype= (unlike Linen's, it ignores a policy's cast)
        self.embed = nnx.Embed(VOCAB, D, embedding_init=named("vocab", "embed", init=nnx.initializers.normal(1.0)),
                               dtype=embed_dtype, rngs=rngs)
        self.norm1, self.norm2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.query, self.key, self.value = (nnx.Linear(D, D, kernel_init=named("embed", "heads"), use_bias=False,
                                                       rngs=rngs) for _ in range(3))
        self.out = nnx.Linear(D, D, kernel_init=named("heads", "embed"), use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D, MLP_DIM, kernel_init=named("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(MLP_DIM, D, kernel_init=named("mlp", "embed"), rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, kernel_init=named("embed", "vocab"), use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        h = self.norm1(x)
        split = lambda t: t.reshape(*t.shape[:2], HEADS, D // HEADS)
        att = jax.nn.dot_product_attention(split(self.query(h)), split(self.key(h)), split(self.value(h)),
                                           is_causal=True)
        x = x + self.out(att.reshape(x.shape))
        x = x + self.down(jax.nn.gelu(self.up(self.norm2(x))))
        return self.head(x)


def lm_loss(model, batch, rng):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(), {}


class BNClassifier(nnx.Module):
    """An MLP classifier with BatchNorm and Dropout (the NNX MNIST tutorial's layers), no names anywhere."""

    def __init__(self, rngs: nnx.Rngs, hidden: int = 512, momentum: float = 0.99):
        # no bias before BatchNorm (its gradient is zero: the normalisation removes it)
        self.l1 = nnx.Linear(64, hidden, use_bias=False, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(hidden, momentum=momentum, rngs=rngs)
        self.bn2 = nnx.BatchNorm(hidden, momentum=momentum, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.l3 = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x):
        x = self.dropout(jax.nn.relu(self.bn1(self.l1(x))))
        x = self.dropout(jax.nn.relu(self.bn2(self.l2(x))))
        return self.l3(x)


def cls_loss(model, batch, rng):
    logits = model(batch["x"])
    acc = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {"accuracy": acc}


def init_key(seed: int = 0) -> jax.Array:
    return jax.random.split(jax.random.key(seed))[0]


def reference(model_fn, loss_fn, tx, batches):
    """Plain NNX on one device: ``(losses, params, model_state)`` as pure dicts."""
    with nnx.use_eager_sharding(False):
        model = model_fn(nnx.Rngs(init_key()))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = jax.device_put((params, rest), jax.devices()[0])
    opt_state = tx.init(params)

    @jax.jit
    def step(params, rest, opt_state, batch):
        def f(p):
            m = nnx.merge(graphdef, p, rest, copy=True)
            loss, _ = loss_fn(m, batch, None)
            return loss, nnx.state(m, nnx.Not(nnx.Param))
        (loss, rest), grads = jax.value_and_grad(f, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss
    losses = []
    for batch in batches:
        params, rest, opt_state, loss = step(params, rest, opt_state, batch)
        losses.append(loss)
    return losses, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def train(model_fn, loss_fn, tx, batches, mesh, state=None):
    if state is None:
        state = jp.train.init_state(model_fn, tx, 0, mesh=mesh, report=False)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return state, losses


def key_data(tree):
    """Typed PRNG keys (NNX's RngKey) as their uint32 data, so trees of them compare as arrays."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)


def check(losses, state, ref):
    ref_losses, ref_params, ref_state = ref
    for k, (got, want) in enumerate(zip(losses, ref_losses)):
        assert_scalar_close(got, want, what=f"loss at step {k}")
    worst = assert_tree_close(state.params, ref_params, what="params")
    assert_tree_close(key_data(state.model_state), key_data(ref_state), what="model state")
    return worst


def token_batches(n, batch_size=16, seed=5):
    rng = np.random.default_rng(seed)
    return [{k: rng.integers(0, VOCAB, (batch_size, SEQ)).astype(np.int32) for k in ("inputs", "targets")}
            for _ in range(n)]


def digit_batches(n, batch_size=64, seed=6):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(batch_size, 64)).astype(np.float32),
             "y": rng.integers(0, 10, batch_size).astype(np.int32)} for _ in range(n)]


LM_SPECS = {"embed": {"embedding": P("tensor", "fsdp")}, "query": {"kernel": P("fsdp", "tensor")},
            "key": {"kernel": P("fsdp", "tensor")}, "value": {"kernel": P("fsdp", "tensor")},
            "out": {"kernel": P("tensor", "fsdp")}, "up": {"kernel": P("fsdp", "tensor"), "bias": P()},
            "down": {"kernel": P("tensor", "fsdp"), "bias": P()}, "head": {"kernel": P("fsdp", "tensor")},
            "norm1": {"scale": P(), "bias": P()}, "norm2": {"scale": P(), "bias": P()}}


# fsdp8: slow (~7 CPU-s); fast sibling: 2x2x2, the same parity with fsdp beside data and tensor
@pytest.mark.parametrize("layout", [dict(data=2, fsdp=2, tensor=2), pytest.param(dict(fsdp=8), marks=pytest.mark.slow)],
                         ids=["2x2x2", "fsdp8"])
def test_nnx_transformer_with_partitioning_names_matches_one_device(mesh_factory, layout):
    batches = token_batches(3)
    state, losses = train(TransformerLM, lm_loss, SGD, batches, mesh_factory(**layout))
    worst = check(losses, state, reference(TransformerLM, lm_loss, SGD, batches))
    specs = jax.tree.map(lambda x: x.sharding.spec, state.params)
    assert specs == LM_SPECS      # exactly the names' specs (tensor of size 1 under fsdp=8)
    if "tensor" not in layout:
        r = state.report().ratio
        print(f"NNX transformer, fsdp=8: per-device / global bytes (params + momentum) {r:.3f}")
        assert r <= 0.15
    print(f"NNX transformer on {layout}: worst param error {worst:.2e}; specs {specs}")


# slow set: a lighter sibling stays in the fast set (the README's 10-minute budget)
@pytest.mark.slow
def test_nnx_batchnorm_and_dropout_on_data8_match_one_device_with_running_stats(mesh_factory):
    batches = digit_batches(20)
    model_fn = lambda rngs: BNClassifier(rngs)
    state, losses = train(model_fn, cls_loss, SGD, batches, mesh_factory(data=8))
    worst = check(losses, state, reference(model_fn, cls_loss, SGD, batches))
    moved = float(jnp.max(jnp.abs(state.model_state["bn1"]["mean"])))
    print(f"NNX BN+Dropout, 20 steps on data=8: worst param error {worst:.2e}; bn1 running mean max|.| {moved:.4f} "
          f"(0 at init); dropout count {int(state.model_state['dropout']['rngs']['count'])}")
    assert moved > 1e-3 and int(state.model_state["dropout"]["rngs"]["count"]) == 2 * 20
    fsdp = jp.train.init_state(model_fn, SGD, 0, mesh=mesh_factory(fsdp=8), report=False)
    r = fsdp.report().ratio
    print(f"NNX BN classifier, fsdp=8: per-device / global bytes {r:.3f}")
    assert r <= 0.15


@pytest.mark.slow   # 120 steps; the Linen sibling (test_model_init) stays fast
def test_nnx_eval_with_running_statistics_on_digits(mesh_factory):
    """Eval mode (running statistics, no dropout) classifies held-out digits at least as well as train mode."""
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    train_idx, test_idx = order[:1536], order[1536:1792]
    mesh = mesh_factory(data=8)
    model_fn = lambda rngs: BNClassifier(rngs, hidden=128, momentum=0.9)
    tx = optax.adam(3e-3)
    state = jp.train.init_state(model_fn, tx, 0, mesh=mesh, report=False)
    step = jp.train.make_train_step(cls_loss, tx, mesh=mesh)
    for k in range(120):
        rows = train_idx[(k * 128) % 1536:(k * 128) % 1536 + 128]
        state, _ = step(state, {"x": x[rows], "y": y[rows]})
    test = {"x": x[test_idx], "y": y[test_idx]}
    eval_acc = float(jp.train.make_eval_step(cls_loss, mesh=mesh)(state, test)["accuracy"])

    def train_mode(model, batch, rng):      # what the eval would see without the running statistics
        model.train()
        return cls_loss(model, batch, rng)
    train_acc = float(jp.train.make_eval_step(train_mode, mesh=mesh)(state, test)["accuracy"])
    print(f"digits, held-out accuracy: eval mode (running statistics) {eval_acc:.3f}, train mode {train_acc:.3f}")
    assert eval_acc >= train_acc and eval_acc > 0.9


def test_nnx_state_restores_on_another_mesh_and_continues(mesh_factory, tmp_path):
    batches = digit_batches(8, seed=7)
    model_fn = lambda rngs: BNClassifier(rngs, hidden=128)
    whole, _ = train(model_fn, cls_loss, SGD, batches, mesh_factory(data=8))
    half, _ = train(model_fn, cls_loss, SGD, batches[:4], mesh_factory(data=8))
    with jp.checkpoint.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(4, half, force=True)
        ckpt.wait()
        target = jp.train.abstract_state(model_fn, SGD, mesh=mesh_factory(data=2, fsdp=4))
        restored = ckpt.restore(4, target=target)
    assert restored.graphdef == half.graphdef
    resumed, _ = train(model_fn, cls_loss, SGD, batches[4:], mesh_factory(data=2, fsdp=4), state=restored)
    assert_tree_close(resumed.params, whole.params, what="params")
    assert_tree_close(key_data(resumed.model_state), key_data(whole.model_state), what="model state")


def test_nnx_module_class_forms_and_bad_losses(mesh_factory, no_compiling):
    mesh = mesh_factory(fsdp=2)
    by_class = jp.train.abstract_state(BNClassifier, SGD, mesh=mesh)
    by_key = jp.train.abstract_state(lambda key: BNClassifier(nnx.Rngs(key)), SGD, mesh=mesh)
    assert jax.tree.structure(by_class) == jax.tree.structure(by_key)
    assert by_class.model_state["bn1"]["mean"].shape == (512,)


def test_an_nnx_loss_with_the_wrong_structure_is_named(mesh_factory):
    mesh = mesh_factory(fsdp=2)
    state = jp.train.init_state(BNClassifier, SGD, 0, mesh=mesh, report=False)
    bad = jp.train.make_train_step(lambda model, batch, rng: model(batch["x"]).mean(), SGD, mesh=mesh)
    with pytest.raises(ValueError, match=r"the NNX loss_fn\(model, batch, rng\) must return \(loss, aux\)"):
        bad(state, digit_batches(1)[0])
    two_args = jp.train.make_train_step(lambda model, batch: (model(batch["x"]).mean(), {}), SGD, mesh=mesh)
    with pytest.raises(TypeError, match=r"loss_fn\(model, batch, rng\) -> \(loss, aux\), model the NNX module"):
        two_args(state, digit_batches(1)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jp.train.abstract_state(TransformerLM, SGD, mesh=mesh)    # every name known: nothing to warn of


def test_nnx_under_mixed_bf16_computes_in_bf16_and_keeps_f32_params(mesh_factory):
    from tests.test_precision import BF16_TOL, dot_dtypes
    mesh, batch = mesh_factory(data=2, fsdp=2, tensor=2), token_batches(1)[0]
    model_fn = functools.partial(TransformerLM, embed_dtype=jnp.bfloat16)
    state = jp.train.init_state(model_fn, SGD, 0, mesh=mesh, policy=jp.Policy.from_string("mixed_bf16"))
    step = jp.train.make_train_step(lm_loss, SGD, mesh=mesh, donate=False)
    n_dots, n_bf16 = dot_dtypes(step, state, batch)
    assert n_dots >= 8 and n_bf16 >= n_dots - 2, (n_dots, n_bf16)    # attention's two dots may stay f32
    new, metrics = step(state, batch)
    ref_losses, _, _ = reference(model_fn, lm_loss, SGD, [batch])
    assert_scalar_close(metrics["loss"], ref_losses[0], BF16_TOL, "mixed_bf16 loss against f32")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.params))


# ----------------------------------------------------------------------- an NNX model with the protocol's parts

LAYERS = 4


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, MLP_DIM, kernel_init=named("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(MLP_DIM, D, kernel_init=named("mlp", "embed"), rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class StackedLM(nnx.Module):
    """Blocks stacked along a leading ``layers`` axis (``nnx.vmap`` over the constructor, the NNX scan-over-layers
    pattern), with the model protocol's pipeline parts as pure functions of its params (``nnx.merge`` of each
    part's graph definition): what ``Pipeline.from_model`` needs, written by the model's author."""
    stage_key = "blocks"

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=named("vocab", "embed", init=nnx.initializers.normal(1.0)),
                               rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def blocks(rngs):
            return Block(rngs)
        self.blocks = blocks(rngs)
        self.head = nnx.Linear(D, VOCAB, kernel_init=named("embed", "vocab"), use_bias=False, rngs=rngs)


class StackedParts:
    """The protocol parts of :class:`StackedLM` over its pure-dict params."""
    stage_key = "blocks"

    def __init__(self):
        with nnx.use_eager_sharding(False):
            model = nnx.eval_shape(lambda: StackedLM(nnx.Rngs(0)))
            block = nnx.eval_shape(lambda: Block(nnx.Rngs(0)))
        self.embed_def = nnx.split(model.embed)[0]
        self.head_def = nnx.split(model.head)[0]
        self.block_def = nnx.split(block)[0]

    def embed(self, params, tokens_BL):
        return nnx.merge(self.embed_def, params["embed"])(tokens_BL)

    def stage(self, blocks, x_BLD):
        for i in range(jax.tree.leaves(blocks)[0].shape[0]):
            x_BLD = nnx.merge(self.block_def, jax.tree.map(lambda a: a[i], blocks))(x_BLD)
        return x_BLD

    def head_loss(self, params, x_BLD, targets_BL):
        logits = nnx.merge(self.head_def, params["head"])(x_BLD)
        one_hot = jax.nn.one_hot(targets_BL, VOCAB, dtype=logits.dtype)   # no gather over a vocab-sharded axis
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.sum(logits * one_hot, -1)), {}

    def loss(self, params, batch, rng=None):
        return self.head_loss(params, self.stage(params["blocks"], self.embed(params, batch["inputs"])),
                              batch["targets"])


@pytest.mark.slow   # a pipeline compile; tests/models/test_protocol.py pipelines a protocol model in the fast set
def test_an_nnx_model_with_the_protocol_parts_pipelines_like_the_gpt(mesh_factory):
    """``Pipeline.from_model`` with 1F1B on pipe=2 x fsdp=2 trains an NNX model built by jaxpar's NNX path
    (graphdef and pure params in the state): loss and gradients equal ``jax.value_and_grad`` of the parts' loss
    on one device, and the stacked blocks (named ``layers`` by ``nnx.vmap``) live over ``pipe``."""
    mesh, parts = mesh_factory(pipe=2, fsdp=2), StackedParts()
    pipe = jp.pipeline.Pipeline.from_model(parts, jp.pipeline.one_f_one_b(2, 4))
    state = jp.train.init_state(StackedLM, SGD, 0, mesh=mesh, pipeline=pipe)
    assert state.params["blocks"]["up"]["kernel"].sharding.spec == P("pipe", "fsdp", "tensor")   # tensor: size 1
    step = jp.train.make_train_step(pipe, SGD, mesh=mesh, donate=False)
    batch = token_batches(1, batch_size=16)[0]
    params = jax.device_get(state.params)
    (loss, _), grads = jax.jit(jax.value_and_grad(parts.loss, has_aux=True))(params, batch)
    new_state, metrics = step(state, batch)
    assert_scalar_close(metrics["loss"], loss, what="pipelined loss")
    trace = next(s for s in jax.tree.leaves(new_state.opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
                 if isinstance(s, optax.TraceState)).trace
    assert_tree_close(trace, grads, what="pipelined grads")


class Sowing(BNClassifier):
    def __call__(self, x):
        h = self.l1(x)
        self.sow(nnx.Intermediate, "hidden", h)       # per-call intermediates never enter the model state
        return self.l3(jax.nn.relu(self.bn2(self.l2(jax.nn.relu(self.bn1(h))))))


def test_nnx_model_state_is_checked_and_intermediates_are_left_out(mesh_factory):
    mesh = mesh_factory(fsdp=2)
    state = jp.train.init_state(Sowing, SGD, 0, mesh=mesh, report=False)
    new, _ = jp.train.make_train_step(cls_loss, SGD, mesh=mesh, donate=False)(state, digit_batches(1)[0])
    assert jax.tree.structure(new.model_state) == jax.tree.structure(state.model_state)

    def reshaping(model, batch, rng):
        out = cls_loss(model, batch, rng)
        model.bn1.mean = nnx.BatchStat(jnp.zeros(7))
        return out
    with pytest.raises(ValueError, match=r"the NNX model's variables after loss_fn: \['bn1'\]\['mean'\] is "
                                         r"float32\[7\], the state holds float32\[512\]"):
        jp.train.make_train_step(reshaping, SGD, mesh=mesh)(state, digit_batches(1)[0])
    with pytest.raises(TypeError, match=r"got an nnx.Module instance \(BNClassifier\); pass its class.*"
                                        r"init_state\(BNClassifier, tx"):
        jp.train.init_state(BNClassifier(nnx.Rngs(0)), SGD, 0, mesh=mesh)
