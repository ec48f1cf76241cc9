"""jaxpar/models/decoder.py: a decoder family is a configuration of the base, not a subclass. A third family is
defined here, in the test file (a GPT with RMSNorm, a SwiGLU MLP, rotary positions and no biases), and its loss
is checked against the same model written out in plain JAX; the GPT and the Llama are siblings on the base."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_tree_close

import jaxpar as jp
from jaxpar.models.blocks import Architecture
from jaxpar.models.decoder import Decoder


@dataclasses.dataclass(frozen=True)
class RmsSwigluConfig:
    """The fields the decoder base reads, and nothing else."""
    architecture: Any = Architecture(attention="mha", norm="rms", mlp="swiglu", bias=False)
    vocab_size: int = 29
    padded_vocab: int = 32
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 8
    d_model: int = 16
    mlp_dim: int = 24
    max_seq_len: int = 12
    positions: str = "rotary"
    rope_base: float = 100.0
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = True
    scan_layers: bool = False
    remat: str = "none"
    attention: str = "blocked"
    attention_blocks: int = 2
    context_attention: str = "ring"
    dtype: Any = None
    param_dtype: Any = None
    output_dtype: Any = None
    init_std: float = 0.3

    def rotary_freq(self) -> None:
        return None


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def _rotate(x_BLHK, base):
    L, K = x_BLHK.shape[1], x_BLHK.shape[-1]
    angle = np.arange(L)[:, None] * base ** (-np.arange(0, K, 2) / K)[None]       # [L, K / 2]
    cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
    x1, x2 = x_BLHK[..., :K // 2], x_BLHK[..., K // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _reference_loss(cfg, p, inputs, targets):
    """The model written out in float64 numpy: pre-norm RMSNorm blocks, fused q/k/v, rotary, causal softmax
    attention, SwiGLU, tied unembedding over the real vocabulary."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    B, L = inputs.shape
    K = cfg.head_dim
    x = p["embed"]["embedding"][inputs]
    for i in range(cfg.num_layers):
        b = jax.tree.map(lambda a: a[i], p["blocks"])
        h = _rms(x, b["attn_norm_scale"], cfg.norm_eps)
        qkv = np.einsum("bld,dhtk->blhtk", h, b["qkv_kernel"])
        q, k, v = (qkv[:, :, :, t] for t in range(3))
        q, k = _rotate(q, cfg.rope_base), _rotate(k, cfg.rope_base)
        s = np.einsum("blhk,bshk->bhls", q, k) / np.sqrt(K)
        s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        a = np.einsum("bhls,bshk->blhk", w / w.sum(-1, keepdims=True), v)
        x = x + np.einsum("blhk,hkd->bld", a, b["out_kernel"])
        h = _rms(x, b["mlp_norm_scale"], cfg.norm_eps)
        g = h @ b["gate_kernel"]
        x = x + (g / (1 + np.exp(-g)) * (h @ b["up_kernel"])) @ b["down_kernel"]
    logits = (_rms(x, p["head"]["norm_scale"], cfg.norm_eps) @ p["embed"]["embedding"].T)[..., :cfg.vocab_size]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return float(np.mean(logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]))


def test_a_family_defined_in_a_test_file_is_a_configuration_of_the_decoder():
    cfg = RmsSwigluConfig()
    model = Decoder(cfg)
    boxed = model.init(jax.random.key(0))
    assert set(boxed["blocks"]) == {"attn_norm_scale", "qkv_kernel", "out_kernel", "mlp_norm_scale", "gate_kernel",
                                    "up_kernel", "down_kernel"}
    assert set(boxed["head"]) == {"norm_scale"} and set(boxed["embed"]) == {"embedding"}
    assert boxed["blocks"]["gate_kernel"].names == ("layers", "embed", "mlp")
    params = nn.meta.unbox(boxed)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, cfg.max_seq_len + 1)).astype(np.int32)
    loss, aux = jax.jit(model.loss)(params, {"inputs": ids[:, :-1], "targets": ids[:, 1:]})
    want = _reference_loss(cfg, params, ids[:, :-1], ids[:, 1:])
    assert abs(float(loss) - want) <= 1e-5 * abs(want), (float(loss), want)
    assert float(aux["weight"]) == ids[:, 1:].size


def test_the_third_family_generates_through_its_cache():
    """Its one-token step (the base's KV cache) equals ``apply``, so ``generate`` works for it unchanged."""
    cfg = RmsSwigluConfig()
    model = Decoder(cfg)
    params = nn.meta.unbox(model.init(jax.random.key(1)))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    cache, steps = model.init_cache(params, 2, 6), []
    for pos in range(6):
        logits, cache = model.decode_step(params, tokens[:, pos], cache, jnp.int32(pos))
        steps.append(logits)
    valid = np.arange(cfg.padded_vocab) < cfg.vocab_size
    assert_tree_close(jnp.stack(steps, 1)[..., valid], model.apply(params, tokens)[..., valid], what="decode vs apply")
    assert len(model.generate(params, [[1, 2], [3]], 3, 0, temperature=0)[1]) == 3


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_gpt_and_llama_are_siblings_on_the_decoder_base():
    """Neither family module imports the other, nor subclasses it; both build on the base."""
    root = pathlib.Path(jp.__file__).parent / "models"
    for name, other in (("gpt", "llama"), ("llama", "gpt")):
        assert not {m for m in _imports(root / f"{name}.py") if f"models.{other}" in m or m.endswith(f"models.{other}")}, \
            f"jaxpar/models/{name}.py imports the {other} module"
    GPT, Llama = jp.models.GPT, jp.models.Llama
    assert not issubclass(Llama, GPT) and not issubclass(GPT, Llama)
    assert issubclass(GPT, Decoder) and issubclass(Llama, Decoder)
    assert "Block" not in vars(GPT) and "Block" not in vars(Llama)   # no template hooks: the config decides
