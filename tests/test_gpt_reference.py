"""The GPT against an independent reference written here in plain ``jax.numpy``.

The reference reuses no jaxpar function: attention with the softmax written out and an explicit causal mask,
LayerNorm (eps 1e-5), the tanh GELU (``jax.nn.gelu``'s default ``approximate=True``) written out, learned or
rotary positions (Su et al. 2021, eq. 34: the two halves of the head dim form the pairs, frequencies
``base ** (-i / half)``, applied here as a complex multiplication), tied or untied unembedding. It reads the
param tree that ``GPT(cfg).init`` produces (unboxed). Float32 throughout; tolerance as in DESIGN.md "Tests":
``max|got - ref| <= 1e-5 * max|ref|``.

``init`` sets LayerNorm scales to 1 and every bias to 0, which would hide a missing or swapped bias, and its
small weights make attention nearly uniform, which would hide a wrong mask or position encoding; most tests
therefore add random noise to every leaf of the init params (same tree, same shapes).
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

from helpers import RTOL, assert_scalar_close, assert_tree_close, max_rel_err
from jaxpar.models import GPT, GPTConfig

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
