"""jaxpar/train/optim.py: weight decay reaches every weight matrix, decided by what a leaf is (logical names), not its
leaf name; the learning-rate schedule; adamw's argument checks.

The check is the AdamW update itself: with zero gradients optax's AdamW moves a decayed leaf by exactly
``-lr * weight_decay * p`` (the moments stay zero) and leaves every other leaf unchanged. The expected sets
of decayed leaves are written out by hand for each model.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from jaxpar.models import MLP
from jaxpar.models.gpt import GPT, GPTConfig

LR, WD = 0.01, 0.1


def zero_grad_step(init_fn, axis_names, mesh):
    """Params before and after one jp.optim.adamw step of a loss with zero gradient, as flat {path: array}."""
    tx = jp.optim.adamw(LR, total_steps=10, warmup_steps=0, weight_decay=WD, clip_norm=None,
                        axis_names=axis_names)
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    before = jax.device_get(state.params)
    loss_fn = lambda params, batch, rng: (0.0 * sum(jnp.sum(p) for p in jax.tree.leaves(params)), {})
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False)
    state, _ = step(state, {"x": np.ones((8, 1), np.float32)})
    flat = lambda t: {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x)
                      for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
    return flat(before), flat(jax.device_get(state.params))


def check_decayed(before, after, expected):
    assert set(expected) <= set(before), sorted(before)
    for path, p in before.items():
        if path in expected:
            np.testing.assert_allclose(after[path], p * (1 - LR * WD), rtol=1e-6, atol=0, err_msg=path)
        else:
            np.testing.assert_array_equal(after[path], p, err_msg=f"{path} must not decay")


GPT_MATRICES = {"blocks/qkv_kernel", "blocks/out_kernel", "blocks/up_kernel", "blocks/down_kernel"}


# untied-rotary: slow (~6 CPU-s, a second 8-device compile); its fast siblings: the tied case here, and the
# untied GPT's decayed leaves by hand (test_adamw_decays_gpt_block_matrices_with_and_without_names[False])
@pytest.mark.parametrize("tie,positions", [(True, "learned"), pytest.param(False, "rotary", marks=pytest.mark.slow)])
def test_gpt_decays_its_block_matrices_only(mesh_factory, tie, positions):
    """All four block kernels decay; LayerNorm scales, biases, token/position tables and the
    [embed, vocab] unembedding do not."""
    model = GPT(GPTConfig(vocab_size=50, num_layers=2, num_heads=2, d_model=16, max_seq_len=8,
                          tie_embeddings=tie, positions=positions))
    names = jax.eval_shape(model.init, jax.random.key(0))
    before, after = zero_grad_step(model.init, names, mesh_factory(data=2, fsdp=2, tensor=2))
    check_decayed(before, after, GPT_MATRICES)


def test_mlp_decays_hidden_and_head_kernels(mesh_factory):
    model = MLP(hidden=(16, 8), num_classes=10)
    init_fn = lambda r: model.init(r, jnp.ones((1, 12)))["params"]
    before, after = zero_grad_step(init_fn, jax.eval_shape(init_fn, jax.random.key(0)), mesh_factory(fsdp=2))
    check_decayed(before, after, {"dense_0/kernel", "dense_1/kernel", "head/kernel"})


class OddNames(nn.Module):
    """A user model whose leaves have names jaxpar has never seen."""

    @nn.compact
    def __call__(self, tokens):
        p = lambda name, shape, names: self.param(name, nn.with_logical_partitioning(
            nn.initializers.normal(1.0), names), shape)
        table = p("lookup", (32, 8), ("vocab", "embed"))
        w_in = p("w_in", (8, 16), ("embed", "mlp"))
        w_out = p("w_out", (16, 8), ("mlp", "embed"))
        gain = p("gain", (8,), ("embed",))
        stacked = p("stacked_w", (3, 8, 8), ("layers", "embed", None))
        stacked_gain = p("stacked_gain", (3, 8), ("layers", "embed"))
        h = table[tokens] * gain
        for i in range(3):
            h = h @ stacked[i] * stacked_gain[i]
        return jax.nn.relu(h @ w_in) @ w_out


def test_user_model_with_other_leaf_names(mesh_factory):
    model = OddNames()
    init_fn = lambda r: model.init(r, jnp.zeros((1, 4), jnp.int32))["params"]
    before, after = zero_grad_step(init_fn, jax.eval_shape(init_fn, jax.random.key(0)), mesh_factory(tensor=2))
    check_decayed(before, after, {"w_in", "w_out", "stacked_w"})


def test_fallback_without_names_is_rank_two_and_not_an_embedding():
    params = {"Embed_0": {"embedding": jnp.ones((10, 4))}, "dense": {"kernel": jnp.ones((4, 3)),
              "bias": jnp.ones((3,))}, "w": jnp.ones((2, 3, 4)), "scale": jnp.ones((4,))}
    mask = jp.optim.decay_mask(params)
    assert mask == {"Embed_0": {"embedding": False}, "dense": {"kernel": True, "bias": False}, "w": True,
                    "scale": False}


def test_axis_names_of_another_tree_is_a_clear_error():
    with pytest.raises(ValueError, match="axis_names must have the structure of the params"):
        jp.optim.decay_mask({"a": jnp.ones((2, 2))}, axis_names={"b": None, "c": None})


def test_learning_rate_schedule_is_warmup_then_cosine():
    """jp.optim.adamw's schedule against the formula: linear 0 -> lr over warm-up, cosine to final_lr_ratio*lr."""
    lr, total, warm, final = 1e-3, 100, 10, 0.1
    tx = jp.optim.adamw(lr, total_steps=total, warmup_steps=warm, final_lr_ratio=final, clip_norm=None,
                        weight_decay=0.0, b1=0.0, b2=0.0)
    params = {"w": jnp.ones((2, 2))}
    state = tx.init(params)
    grads = {"w": jnp.ones((2, 2))}   # with b1 = b2 = 0 an Adam update is -lr_t * sign(g) (up to eps)
    got = []
    for _ in range(total + 1):
        updates, state = tx.update(grads, state, params)
        got.append(-float(updates["w"][0, 0]))
    expect = lambda t: lr * t / warm if t < warm else \
        final * lr + (lr - final * lr) * 0.5 * (1 + np.cos(np.pi * (t - warm) / (total - warm)))
    for t in (0, 5, warm, (warm + total) // 2 + 0, total):
        np.testing.assert_allclose(got[t], expect(t), rtol=1e-5, err_msg=f"step {t}")


def test_multisteps_is_accepted_as_optax_users_pass_it(mesh_factory, np_rng):
    """optax.MultiSteps (not itself a GradientTransformation) trains: 4 calls make one Adam update of the
    mean gradient, as optax defines it (reference: plain optax on one device)."""
    mesh = mesh_factory(data=2)
    tx = optax.MultiSteps(optax.adam(0.1), every_k_schedule=4)
    init_fn = lambda r: {"w": jax.random.normal(r, (3,))}
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    w0 = np.asarray(state.params["w"])
    loss_fn = lambda params, batch, rng: (jnp.mean((batch["x"] @ params["w"]) ** 2), {})
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh)
    xs = [np_rng.normal(size=(4, 3)).astype(np.float32) for _ in range(4)]
    for x in xs:
        state, _ = step(state, {"x": x})
    grads = [jax.grad(lambda w, x=x: jnp.mean((x @ w) ** 2))(jnp.asarray(w0)) for x in xs]
    ref_tx = optax.adam(0.1)
    g = sum(grads) / 4
    update, _ = ref_tx.update(g, ref_tx.init(jnp.asarray(w0)))
    np.testing.assert_allclose(np.asarray(state.params["w"]), w0 + np.asarray(update), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------- adamw's arguments

@pytest.mark.parametrize("kwargs, match", [
    (dict(clip_norm=-1.0), "clip_norm"), (dict(learning_rate=-1e-3), "learning_rate"),
    (dict(learning_rate=float("nan")), "learning_rate"), (dict(b2=1.5), "b2"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(warmup_steps=100), "warmup_steps"),
])
def test_adamw_rejects_out_of_range_hyperparameters(kwargs, match):
    args = {"learning_rate": 1e-3, "total_steps": 100, **kwargs}
    with pytest.raises(ValueError, match=match):
        jp.optim.adamw(args.pop("learning_rate"), **args)


@pytest.mark.parametrize("kwargs", [dict(learning_rate=optax.constant_schedule(1e-3)),
                                    dict(learning_rate=1e-3, weight_decay=None),
                                    dict(learning_rate=1e-3, total_steps=10.5)])
def test_adamw_names_a_hyperparameter_that_is_not_a_number(kwargs):
    kwargs.setdefault("total_steps", 10)
    with pytest.raises(TypeError, match=r"adamw \w+=.* must be"):
        jp.optim.adamw(**kwargs)


# ----------------------------------------------------- which leaves decay, with and without names (by hand)

GPT_DECAYED = {"blocks/qkv_kernel", "blocks/out_kernel", "blocks/up_kernel", "blocks/down_kernel"}   # by hand


def _decayed(tx, params):
    """The leaves a step of ``tx`` decays, seen from outside: zero gradients, so only weight decay moves a leaf."""
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    flat = jax.tree_util.tree_flatten_with_path(updates)[0]
    return {"/".join(str(k.key) for k in path) for path, u in flat if bool(jnp.any(u != 0))}


@pytest.mark.parametrize("tie", [pytest.param(True, marks=pytest.mark.slow), False])
def test_adamw_decays_gpt_block_matrices_with_and_without_names(tie):
    cfg = GPTConfig(vocab_size=11, num_layers=3, num_heads=2, d_model=8, max_seq_len=4, tie_embeddings=tie)
    names = jax.eval_shape(GPT(cfg).init, jax.random.key(0))
    params = nn.meta.unbox(GPT(cfg).init(jax.random.key(0)))
    params = jax.tree.map(lambda x: x + 0.5, params)   # no zero leaf (norm biases start at 0)
    make = lambda **kw: jp.optim.adamw(1e-2, total_steps=10, weight_decay=0.1, clip_norm=None, **kw)
    assert _decayed(make(axis_names=names), params) == GPT_DECAYED
    without = _decayed(make(), params)
    # the fallback cannot tell an untied [embed, vocab] unembedding from a matrix (documented)
    assert without == GPT_DECAYED | ({"head/kernel"} if not tie else set())


@dataclasses.dataclass(frozen=True)
class _Stacked:
    """A user's model with stacked layers: matrices [layers, d, d], a norm scale and a bias [layers, d]."""
    def init(self, rng):
        k = jax.random.split(rng, 3)
        box = lambda x, *n: nn.LogicallyPartitioned(x, n)
        return {"layers": {"w_q": box(jax.random.normal(k[0], (3, 4, 4)), "layers", "embed", "mlp"),
                           "w_o": box(jax.random.normal(k[1], (3, 4, 4)), "layers", "mlp", "embed"),
                           "norm_scale": box(jnp.ones((3, 4)), "layers", "embed"),
                           "out_bias": box(jnp.ones((3, 4)), "layers", "embed")},
                "readout": box(jax.random.normal(k[2], (4, 2)), "embed", None)}


def test_adamw_decays_a_stacked_user_model_with_and_without_names():
    model = _Stacked()
    names = jax.eval_shape(model.init, jax.random.key(0))
    params = nn.meta.unbox(model.init(jax.random.key(0)))
    want = {"layers/w_q", "layers/w_o", "readout"}
    tx = lambda **kw: jp.optim.adamw(1e-2, total_steps=10, clip_norm=None, **kw)
    assert _decayed(tx(axis_names=names), params) == want
    assert _decayed(tx(), params) == want


def test_decay_mask_is_optax_adamw_mask():
    """jaxpar's adamw is optax.adamw with the mask: the same update as optax's with the mask written out."""
    cfg = GPTConfig(vocab_size=11, num_layers=2, num_heads=2, d_model=8, max_seq_len=4)
    params = nn.meta.unbox(GPT(cfg).init(jax.random.key(1)))
    grads = jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(0).normal(size=x.shape), x.dtype), params)
    mask = jax.tree_util.tree_map_with_path(
        lambda p, x: "/".join(str(k.key) for k in p) in GPT_DECAYED, params)
    ours = jp.optim.adamw(1e-2, total_steps=10, weight_decay=0.1, clip_norm=None, warmup_steps=0, final_lr_ratio=1.0)
    ref = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 0, 10, end_value=1e-2), b1=0.9, b2=0.95,
                      weight_decay=0.1, mask=mask)
    got, _ = ours.update(grads, ours.init(params), params)
    want, _ = ref.update(grads, ref.init(params), params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)


def test_adamw_decays_bfloat16_matrices():
    """bfloat16 is floating for jax, not for numpy: its matrices decay like float32 ones."""
    params = {"kernel": jnp.full((4, 4), 2.0, jnp.bfloat16), "bias": jnp.full((4,), 2.0, jnp.bfloat16)}
    assert jp.optim.decay_mask(params) == {"kernel": True, "bias": False}
    assert _decayed(jp.optim.adamw(1e-2, total_steps=10, clip_norm=None), params) == {"kernel"}
