"""jaxpar/models/gpt.py: the GPT against an independent reference written here in plain ``jax.numpy``, its
attention options, its config checks and the batch checks of its loss.

The reference reuses no jaxpar function: attention with the softmax written out and an explicit causal mask,
LayerNorm (eps 1e-5), the tanh GELU (``jax.nn.gelu``'s default ``approximate=True``) written out, learned or
rotary positions (Su et al. 2021, eq. 34: the two halves of the head dim form the pairs, frequencies
``base ** (-i / half)``, applied here as a complex multiplication), tied or untied unembedding. It reads the
param tree that ``GPT(cfg).init`` produces (unboxed). Float32 throughout; tolerance as in docs/architecture.md "Tests":
``max|got - ref| <= 1e-5 * max|ref|``.

``init`` sets LayerNorm scales to 1 and every bias to 0, which would hide a missing or swapped bias, and its
small weights make attention nearly uniform, which would hide a wrong mask or position encoding; most tests
therefore add random noise to every leaf of the init params (same tree, same shapes).

``causal_attention`` (query blocks that skip masked key blocks) is checked, forward and gradients, against a
plain full-matrix softmax attention in float32 with an explicit mask, for block counts that divide the
sequence and that do not; the ``attention`` options of the GPT give the same loss and gradients; bad options
raise before tracing.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import RTOL, SMALL_GPT, SMALL_GPT_VARIANT, assert_scalar_close, assert_tree_close, gpt_batch, max_rel_err

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig
from jaxpar.layers.attention import causal_attention


BASE = GPTConfig(vocab_size=37, vocab_multiple=64, num_layers=2, num_heads=4, d_model=32, max_seq_len=16)
CONFIGS = {
    "learned-tied": BASE,
    "learned-untied": dataclasses.replace(BASE, tie_embeddings=False, d_mlp=48),
    "rotary-tied": dataclasses.replace(BASE, positions="rotary", num_heads=2, head_dim=0, d_mlp=48),  # K = 16
    "rotary-untied": dataclasses.replace(BASE, positions="rotary", tie_embeddings=False),
    # head size independent of d_model / num_heads (what structural pruning leaves after removing heads)
    "rotary-head_dim": dataclasses.replace(BASE, positions="rotary", num_heads=3, head_dim=6),
}
ids = list(CONFIGS)


# ------------------------------------------------------------------------------------------ reference

def ref_layer_norm(x, scale, bias):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * scale + bias


def ref_gelu(x):  # tanh approximation (Hendrycks & Gimpel 2016), jax.nn.gelu(approximate=True)
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def ref_rotary(x, base):
    """x [B, L, H, K]: pairs (x[i], x[i + K/2]) rotated by angle pos * base**(-i / (K/2)) (complex product)."""
    L, K = x.shape[1], x.shape[-1]
    half = K // 2
    theta = base ** (-np.arange(half) / half)                      # float64 on the host
    angle = np.arange(L)[:, None] * theta[None, :]                 # [L, half]
    rot = jnp.asarray(np.exp(1j * angle).astype(np.complex64))[None, :, None, :]
    z = jax.lax.complex(x[..., :half], x[..., half:]) * rot
    return jnp.concatenate([jnp.real(z), jnp.imag(z)], axis=-1)


def ref_attention(q, k, v):
    """q, k, v [B, L, H, K] -> [B, L, H, K]; causal, softmax written out."""
    L, K = q.shape[1], q.shape[-1]
    s = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(K)
    allowed = np.tril(np.ones((L, L), bool))                       # query q sees keys s <= q
    s = jnp.where(allowed, s, -jnp.inf)
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    p = e / jnp.sum(e, axis=-1, keepdims=True)
    return jnp.einsum("bhqs,bshk->bqhk", p, v)


def ref_logits(cfg: GPTConfig, params, tokens):
    """Logits [B, L, vocab_size] (valid vocabulary only)."""
    L = tokens.shape[1]
    emb = params["embed"]["embedding"]
    x = emb[tokens]
    if cfg.positions == "learned":
        x = x + params["embed"]["pos_embedding"][:L]
    for i in range(cfg.num_layers):
        p = jax.tree.map(lambda a: a[i], params["blocks"])
        h = ref_layer_norm(x, p["ln1_scale"], p["ln1_bias"])
        qkv = jnp.einsum("bld,dhck->blhck", h, p["qkv_kernel"])
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        if cfg.positions == "rotary":
            q, k = ref_rotary(q, cfg.rope_base), ref_rotary(k, cfg.rope_base)
        a = ref_attention(q, k, v)
        x = x + jnp.einsum("blhk,hkd->bld", a, p["out_kernel"]) + p["out_bias"]
        h = ref_layer_norm(x, p["ln2_scale"], p["ln2_bias"])
        x = x + ref_gelu(h @ p["up_kernel"] + p["up_bias"]) @ p["down_kernel"] + p["down_bias"]
    h = ref_layer_norm(x, params["head"]["ln_scale"], params["head"]["ln_bias"])
    w = emb.T if cfg.tie_embeddings else params["head"]["kernel"]
    return (h @ w)[..., : cfg.vocab_size]


# ------------------------------------------------------------------------------------------ fixtures
# Compilation dominates the runtime on CPU: the jitted functions are cached per config and every forward
# pass uses the same [B, max_seq_len] shape, so the tests share compiled programs.

B = 4


@functools.lru_cache(maxsize=None)
def _init_params(cfg: GPTConfig, seed: int):
    # eager, with the "rbg" PRNG: compiling threefry for every leaf costs seconds of CPU per config
    return nn.meta.unbox(GPT(cfg).init(jax.random.key(seed, impl="rbg")))


def make_params(cfg: GPTConfig, seed: int = 0, noise: float = 0.1):
    """``GPT(cfg).init`` unboxed, plus ``noise * N(0, 1)`` (host numpy) on every leaf."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: a + noise * rng.standard_normal(a.shape, np.float32), _init_params(cfg, seed))


@functools.lru_cache(maxsize=None)
def apply_fn(cfg: GPTConfig):
    return jax.jit(GPT(cfg).apply)


@functools.lru_cache(maxsize=None)
def ref_fn(cfg: GPTConfig):
    return jax.jit(functools.partial(ref_logits, cfg))


@functools.lru_cache(maxsize=None)
def loss_grad_fn(cfg: GPTConfig):
    return jax.jit(jax.value_and_grad(GPT(cfg).loss, has_aux=True))


def tokens(rng, cfg, batch=B, seq=None):
    return rng.integers(0, cfg.vocab_size, (batch, seq or cfg.max_seq_len), dtype=np.int32)


def test_param_tree_is_the_documented_one():
    """The reference indexes the params by these names and shapes: fail here, not with a KeyError."""
    for cfg in CONFIGS.values():
        p = nn.meta.unbox(jax.eval_shape(GPT(cfg).init, jax.random.key(0)))
        D, H, K, F, N, V = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.num_layers, cfg.padded_vocab
        assert V == 64
        shapes = jax.tree.map(lambda a: a.shape, p)
        want_embed = {"embedding": (V, D)} | ({"pos_embedding": (cfg.max_seq_len, D)}
                                               if cfg.positions == "learned" else {})
        assert shapes["embed"] == want_embed
        assert shapes["blocks"] == {
            "ln1_scale": (N, D), "ln1_bias": (N, D), "qkv_kernel": (N, D, H, 3, K), "out_kernel": (N, H, K, D),
            "out_bias": (N, D), "ln2_scale": (N, D), "ln2_bias": (N, D), "up_kernel": (N, D, F),
            "up_bias": (N, F), "down_kernel": (N, F, D), "down_bias": (N, D)}
        assert shapes["head"] == {"ln_scale": (D,), "ln_bias": (D,)} | (
            {} if cfg.tie_embeddings else {"kernel": (D, V)})


@pytest.mark.parametrize("name", ids)
def test_logits_match_reference(name, np_rng):
    """Catches: a wrong mask, qkv slice order, rotary convention, LayerNorm eps/placement, GELU variant,
    bias, tying, head, or padded-vocabulary masking."""
    cfg = CONFIGS[name]
    apply, ref = apply_fn(cfg), ref_fn(cfg)
    for noise in (0.0, 0.1):                   # the init params as they are, and with every leaf perturbed
        params = make_params(cfg, seed=3, noise=noise)
        x = tokens(np_rng, cfg)
        got, want = np.asarray(apply(params, x)), np.asarray(ref(params, x))
        assert got.shape == (B, cfg.max_seq_len, cfg.padded_vocab) and got.dtype == np.float32
        e = max_rel_err(got[..., : cfg.vocab_size], want)
        print(f"{name} noise={noise}: max|apply - ref| / max|ref| = {e:.3g}")
        assert e <= RTOL, f"{name} noise={noise}: max|apply - ref| / max|ref| = {e:.3g}"
        assert np.all(got[..., cfg.vocab_size:] < -1e30), "padded vocabulary entries must be masked"
        # the masked entries never win a softmax: the probabilities over the valid vocabulary sum to 1
        np.testing.assert_allclose(np.asarray(jax.nn.softmax(got, -1))[..., : cfg.vocab_size].sum(-1), 1.0,
                                   rtol=1e-6)
    if name == "learned-untied":               # a shorter sequence: the position table sliced to its length
        x5 = tokens(np_rng, cfg, seq=5)
        e5 = max_rel_err(np.asarray(apply(params, x5))[..., : cfg.vocab_size], np.asarray(ref(params, x5)))
        assert e5 <= RTOL, f"{name} L=5: {e5:.3g}"


@pytest.mark.parametrize("name", ["learned-tied", "rotary-untied"])
def test_loss_matches_optax_cross_entropy(name, np_rng):
    """GPT.loss is the mean optax cross-entropy of the reference logits over the valid vocabulary (padding
    takes no probability)."""
    cfg = CONFIGS[name]
    params = make_params(cfg, seed=5)
    batch = {"inputs": tokens(np_rng, cfg), "targets": tokens(np_rng, cfg)}
    loss, aux = jax.jit(GPT(cfg).loss)(params, batch)
    ref = ref_fn(cfg)(params, batch["inputs"])
    want = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(ref, batch["targets"]))
    e = assert_scalar_close(loss, want, what=f"{name} loss")
    print(f"{name}: loss {float(loss)!r} vs reference {float(want)!r}: relative error {e:.3g}")
    assert float(aux["weight"]) == batch["targets"].size


@pytest.mark.parametrize("name", ["learned-tied", "rotary-untied"])
def test_causal(name, np_rng):
    """Changing token t leaves the logits before t bit-identical and changes the logits at t and after."""
    cfg = CONFIGS[name]
    params = make_params(cfg, seed=3, noise=0.1)
    apply = apply_fn(cfg)
    L = cfg.max_seq_len
    x = tokens(np_rng, cfg)
    positions = (0, 1, L // 2, L - 1)          # row b changes token positions[b]
    y = x.copy()
    for b, t in enumerate(positions):
        y[b, t] = (x[b, t] + 1 + np_rng.integers(0, cfg.vocab_size - 1)) % cfg.vocab_size
    base = np.asarray(apply(params, x))[..., : cfg.vocab_size]
    out = np.asarray(apply(params, y))[..., : cfg.vocab_size]
    scale = np.max(np.abs(base))
    for b, t in enumerate(positions):
        assert y[b, t] != x[b, t]
        np.testing.assert_array_equal(out[b, :t], base[b, :t], err_msg=f"{name}: token {t} leaked backwards")
        assert np.max(np.abs(out[b, t] - base[b, t])) > 1e-3 * scale, f"{name}: token {t} ignored at {t}"
        if t < L - 1:
            assert np.max(np.abs(out[b, t + 1:] - base[b, t + 1:])) > 1e-3 * scale, f"{name}: {t} ignored later"


@pytest.mark.slow  # heavier compile; .ci/run runs it
def test_remat_and_scan_match_plain(np_rng):
    """remat "full", scan_layers, and remat "dots" inside the scan give the plain model's loss and gradients."""
    cfg = CONFIGS["rotary-untied"]
    assert cfg.remat == "none" and not cfg.scan_layers
    params = make_params(cfg, seed=5)
    batch = {"inputs": tokens(np_rng, cfg), "targets": tokens(np_rng, cfg)}
    (loss, _), grads = loss_grad_fn(cfg)(params, batch)
    # padded vocabulary rows: their tokens are never looked up, their logits are masked
    assert np.all(np.asarray(grads["embed"]["embedding"])[cfg.vocab_size:] == 0)
    assert np.all(np.asarray(grads["head"]["kernel"])[:, cfg.vocab_size:] == 0)
    for kw in ({"remat": "full"}, {"scan_layers": True}, {"scan_layers": True, "remat": "dots"}):
        (l2, _), g2 = loss_grad_fn(dataclasses.replace(cfg, **kw))(params, batch)
        el = assert_scalar_close(l2, loss, what=f"{kw} loss")
        eg = assert_tree_close(g2, grads, what=f"{kw} grads")
        print(f"{kw}: loss err {el:.3g}, worst grad leaf err {eg:.3g}")


def _greedy_logits(cfg, params, window):
    """apply's logits [len(window), vocab_size] for one window (batched to B rows to share the compile)."""
    w = np.zeros((B, cfg.max_seq_len), np.int32)
    w[:, : len(window)] = window
    return np.asarray(apply_fn(cfg)(params, w))[0, : len(window), : cfg.vocab_size]


@pytest.mark.parametrize("name", ["learned-tied", "rotary-untied"])
def test_generate_tiny_temperature_is_greedy(name, np_rng):
    """generate at temperature 1e-6 is the argmax of apply over the last max_seq_len tokens."""
    cfg = CONFIGS[name]
    model = GPT(cfg)
    # params whose greedy continuation is not one token repeated (which could not tell a window bug)
    params = make_params(cfg, seed=13, noise=0.3 if name == "learned-tied" else 0.0)
    L, n = cfg.max_seq_len, 6
    prompt = [int(t) for t in np_rng.integers(0, cfg.vocab_size, L + 5)]   # longer than max_seq_len
    if name == "rotary-untied":
        # a short prompt instead, generating past max_seq_len: padded windows, then sliding ones
        prompt, n = prompt[:3], L + 3
    got = model.generate(params, prompt, n, jax.random.key(0), temperature=1e-6)
    seq, margins = list(prompt), []
    for _ in range(n):
        window = seq[-L:]
        logits = _greedy_logits(cfg, params, window)[len(window) - 1]   # by causality: padding is not seen
        top2 = np.sort(logits)[-2:]
        margins.append(top2[1] - top2[0])
        seq.append(int(np.argmax(logits)))
    # logits / 1e-6 then separate the top two by > 100: Gumbel noise cannot flip them
    assert min(margins) > 1e-4, f"near-tie in the greedy reference (margins {margins}); pick another seed"
    assert len(set(seq[len(prompt):])) >= 4, f"degenerate greedy path {seq[len(prompt):]}; pick another seed"
    assert got == seq[len(prompt):], (got, seq[len(prompt):])
    assert all(0 <= t < cfg.vocab_size for t in got)


# ------------------------------------------------------------------------------------------- attention

def ref_masked_attention(q, k, v):
    """q, k, v [B, L, H, K] -> [B, L, H, K]: softmax(q k^T / sqrt(K)) v with query t seeing keys s <= t."""
    L, K = q.shape[1], q.shape[-1]
    s = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(K)
    s = jnp.where(np.tril(np.ones((L, L), bool)), s, -jnp.inf)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    return jnp.einsum("bhqs,bshk->bqhk", p / p.sum(-1, keepdims=True), v)


def _out_and_grads(f, q, k, v, ct):
    def run(q, k, v, ct):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(ct)
    return jax.jit(run)(q, k, v, ct)


@pytest.mark.parametrize("L,blocks", [(16, 2), (15, 4), (5, 8)])   # dividing, not dividing, more blocks than rows
def test_causal_attention_matches_reference(L, blocks, np_rng):
    q, k, v, ct = (jnp.asarray(np_rng.standard_normal((2, L, 3, 8)), jnp.float32) for _ in range(4))
    got = _out_and_grads(lambda *t: causal_attention(*t, num_blocks=blocks), q, k, v, ct)
    assert_tree_close(got, _out_and_grads(ref_masked_attention, q, k, v, ct))


def test_causal_attention_bf16_keeps_dtype_and_is_close(np_rng):
    q, k, v = (jnp.asarray(np_rng.standard_normal((2, 16, 2, 8)), jnp.bfloat16) for _ in range(3))
    got = jax.jit(causal_attention)(q, k, v)
    assert got.dtype == jnp.bfloat16
    ref = ref_masked_attention(*(t.astype(jnp.float32) for t in (q, k, v)))
    # bf16 inputs and probabilities: 8 mantissa bits, so ~1e-2 relative, not the f32 tolerance
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref))) <= 2e-2 * float(jnp.max(jnp.abs(ref)))


def test_gpt_attention_options_agree(np_rng):
    base = GPTConfig(vocab_size=37, vocab_multiple=64, num_layers=2, num_heads=2, d_model=16, max_seq_len=12)
    params = nn.meta.unbox(GPT(base).init(jax.random.key(0, impl="rbg")))
    params = jax.tree.map(lambda a: a + 0.1 * np_rng.standard_normal(a.shape).astype(np.float32), params)
    batch = {k: np_rng.integers(0, 37, (3, 12), dtype=np.int32) for k in ("inputs", "targets")}

    def loss_grad(cfg):
        return jax.jit(jax.value_and_grad(lambda p: GPT(cfg).loss(p, batch)[0]))(params)

    ref = loss_grad(dataclasses.replace(base, attention="xla"))
    for cfg in (base, dataclasses.replace(base, attention_blocks=3)):
        assert_tree_close(loss_grad(cfg), ref)


def test_attention_options_are_validated():
    with pytest.raises(ValueError, match="attention='flash'"):
        GPTConfig(attention="flash")
    with pytest.raises(ValueError, match="attention_blocks"):
        GPTConfig(attention_blocks=0)
    cfg = GPTConfig(vocab_size=37, vocab_multiple=64, num_layers=1, num_heads=2, d_model=16, max_seq_len=8,
                    attention="cudnn")
    params = nn.meta.unbox(jax.eval_shape(GPT(cfg).init, jax.random.key(0)))
    batch = {k: jax.ShapeDtypeStruct((2, 8), jnp.int32) for k in ("inputs", "targets")}
    if jax.devices()[0].platform != "gpu":
        with pytest.raises(ValueError, match="needs a GPU and float16/bfloat16"):
            jax.eval_shape(lambda p, b: GPT(cfg).loss(p, b), params, batch)


# ------------------------------------------------------------------------------------------ GPTConfig

@pytest.mark.parametrize("kwargs, pattern", [
    (dict(vocab_size=0), r"GPTConfig.vocab_size=0 must be a positive int"),
    (dict(num_layers=-1), r"GPTConfig.num_layers=-1 must be a positive int"),
    (dict(num_heads=2.0), r"GPTConfig.num_heads=2.0 must be a positive int"),
    (dict(max_seq_len=0), r"GPTConfig.max_seq_len=0 must be a positive int"),
    (dict(vocab_multiple=0), r"GPTConfig.vocab_multiple=0 must be a positive int"),
    (dict(d_model=64, num_heads=3), r"d_model 64 is not divisible by num_heads 3"),
    (dict(d_model=12, num_heads=4, positions="rotary"), r"rotary positions need an even head dim, got 3"),
    (dict(positions="alibi"), r"positions='alibi'; use 'learned' or 'rotary'"),
    (dict(remat="some"), r"remat='some'; use one of \['dots', 'full', 'none'\]"),
    (dict(d_mlp=-1), r"d_mlp=-1 must be an int >= 0"),
    # d_mlp is the one int field without a type check: 2.5 is accepted and fails later inside Flax
    (dict(d_mlp=2.5), r"d_mlp=2.5"),
], ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else "")
def test_invalid_gpt_config(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        GPTConfig(**kwargs)


def test_gpt_config_derived_sizes():
    cfg = GPTConfig(vocab_size=103, d_model=128, num_heads=4)
    assert (cfg.head_dim, cfg.mlp_dim, cfg.padded_vocab) == (32, 512, 128)
    assert GPTConfig(vocab_size=129).padded_vocab == 256
    assert GPTConfig(d_mlp=100).mlp_dim == 100
    for cfg in (SMALL_GPT, SMALL_GPT_VARIANT):
        shapes = jax.eval_shape(lambda k: nn.meta.unbox(GPT(cfg).init(k)), jax.random.key(0))
        assert sum(x.size for x in jax.tree.leaves(shapes)) == cfg.num_params()


@pytest.mark.parametrize("kwargs", [dict(dtype=jnp.int32), dict(init_std=float("nan")), dict(rope_base=0.0),
                                    dict(tie_embeddings="no")])
def test_gpt_config_rejects(kwargs):
    with pytest.raises(ValueError, match="GPTConfig"):
        GPTConfig(**kwargs)


def test_generate_rejects_bad_arguments():
    model = GPT(GPTConfig(vocab_size=11, num_layers=1, num_heads=2, d_model=16, max_seq_len=8))
    params = jax.tree.map(lambda x: x.value, model.init(jax.random.key(0)), is_leaf=lambda x: hasattr(x, "value"))
    for kwargs in (dict(temperature=float("inf")), dict(temperature=-1.0), dict(num_tokens=-1), dict(prompt=[11]),
                   dict(prompt=[])):
        args = {"prompt": [1, 2], "num_tokens": 3, "temperature": 1.0, **kwargs}
        with pytest.raises(ValueError):
            model.generate(params, args["prompt"], args["num_tokens"], jax.random.key(0), args["temperature"])
    assert len(model.generate(params, [1, 2], 3, jax.random.key(0))) == 3


# ------------------------------------------------------------------------------------- the loss's batch

@pytest.mark.parametrize("cfg", [SMALL_GPT, SMALL_GPT_VARIANT], ids=["learned", "rotary"])
def test_sequence_longer_than_max_seq_len(mesh_factory, cfg):
    """``GPT.apply`` refuses a sequence longer than ``max_seq_len``; the training loss must too.

    (``GPT.loss`` skips the check: learned positions fail with a broadcasting TypeError from inside the
    model, rotary positions silently train past ``max_seq_len``.)
    """
    model = GPT(cfg)
    batch = gpt_batch(np.random.default_rng(0), 4, cfg, seq_len=cfg.max_seq_len + 4)
    params = jax.device_get(jp.train.init_state(model.init, optax.sgd(0.1), 0, mesh=mesh_factory()).params)
    with pytest.raises(ValueError, match=r"sequence length 20 exceeds max_seq_len 16"):
        model.apply(params, jnp.asarray(batch["inputs"]))
    with pytest.raises(ValueError, match=r"sequence length 20 exceeds max_seq_len 16"):
        model.loss(params, batch)


def _gpt_setup(mesh):
    model = GPT(GPTConfig(vocab_size=50, num_layers=1, num_heads=2, d_model=16, max_seq_len=8))
    tx = optax.sgd(0.1)
    return model, tx, jp.train.init_state(model.init, tx, 0, mesh=mesh)


def _tokens(rng, shape=(8, 8)):
    return {"inputs": rng.integers(0, 50, shape).astype(np.int32),
            "targets": rng.integers(0, 50, shape).astype(np.int32)}


@pytest.mark.parametrize("key", ["inputs", "targets"])
@pytest.mark.parametrize("bad", [-1, 50, 127, 128, 10_000])   # vocab 50 is padded to 128
def test_out_of_range_token_ids_on_the_host_are_a_clear_error(mesh, key, bad):
    model, tx, state = _gpt_setup(mesh)
    batch = _tokens(np.random.default_rng(0))
    batch[key][3, 5] = bad
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, check_batch=model.check_batch)
    with pytest.raises(ValueError, match=rf"batch\['{key}'\] holds token id {bad} at index \(3, 5\).*\[0, "
                                         r"vocab_size=50\)"):
        step(state, batch)
    evaluate = jp.train.make_eval_step(model.loss, mesh=mesh, check_batch=model.check_batch)
    with pytest.raises(ValueError, match="holds token id"):
        evaluate(state, batch)


@pytest.mark.parametrize("key", ["inputs", "targets"])
@pytest.mark.parametrize("bad", [-1, 50, 128])
def test_out_of_range_token_ids_on_the_devices_give_nan_not_a_wrong_loss(mesh, key, bad):
    """A batch already on the devices is checked in the step: loss and gradient norm become NaN."""
    model, tx, state = _gpt_setup(mesh)
    batch = _tokens(np.random.default_rng(1))
    batch[key][2, 1] = bad
    batch = jax.tree.map(jnp.asarray, batch)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, check_batch=model.check_batch, donate=False)
    _, metrics = step(state, batch)
    assert np.isnan(float(metrics["loss"])) and np.isnan(float(metrics["grad_norm"])), metrics
    good = jax.tree.map(lambda x: jnp.clip(x, 0, 49), batch)
    _, metrics = step(state, good)
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))


def test_float_token_ids_are_a_clear_error(mesh):
    model, _, _ = _gpt_setup(mesh)
    batch = _tokens(np.random.default_rng(2))
    batch["inputs"] = batch["inputs"].astype(np.float32)
    with pytest.raises(ValueError, match="must be integers"):
        model.check_batch(batch)


@pytest.mark.parametrize("shapes", [((8, 8), (8, 7)), ((8, 0), (8, 0)), ((8,), (8,)), ((8, 9), (8, 9))])
def test_gpt_check_batch_names_bad_shapes(mesh, shapes):
    model, _, _ = _gpt_setup(mesh)   # max_seq_len 8
    batch = {"inputs": np.zeros(shapes[0], np.int32) + 1, "targets": np.zeros(shapes[1], np.int32) + 2}
    with pytest.raises(ValueError, match=r"\[batch, seq\]|exceeds max_seq_len"):
        model.check_batch(batch)


def test_gpt_step_on_an_explicit_mesh_is_a_clear_error(devices):
    from jax.sharding import AxisType
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2, axis_types=(AxisType.Explicit,) * 4)
    model = GPT(GPTConfig(vocab_size=50, num_layers=1, num_heads=2, d_model=16, max_seq_len=8))
    tx = optax.sgd(0.1)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
    with pytest.raises(ValueError, match="Auto axes only.*axis_types"):
        step(state, _tokens(np.random.default_rng(3)))
