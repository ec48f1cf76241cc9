"""The Hugging Face weight adapters of the families of :mod:`jaxpar.models.families`, one per checkpoint kind:
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Gemma3ForCausalLM`` and
``Gemma3ForConditionalGeneration`` (its text decoder, with ``text_only=True``; the vision tower's tensors are
left on disk), as :class:`jaxpar.models.families.FamilyModel` params and back (saved as the ``...ForCausalLM``).

Each is the Llama's table (:mod:`jaxpar.models.hf.llama`: same names and layouts for the embedding, the q/k/v/o,
gate/up/down projections and the norms) plus the family's tensors:

* Qwen2: ``self_attn.{q,k,v}_proj.bias [H*K] / [G*K] -> q_bias [H, K], k_bias / v_bias [G, K]``.
* Qwen3, Gemma 3: ``self_attn.{q,k}_norm.weight [K] -> q_norm_scale / k_norm_scale``.
* Gemma 3: four norms per layer, ``input_layernorm -> attn_norm_scale``, ``post_attention_layernorm ->
  attn_post_norm_scale``, ``pre_feedforward_layernorm -> mlp_norm_scale``, ``post_feedforward_layernorm ->
  mlp_post_norm_scale`` (Gemma's norm weights are the ``w`` of ``1 + w``, copied as they are).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxpar.models.families import FamilyConfig, FamilyModel
from jaxpar.models.hf import llama
from jaxpar.models.hf.family_config import check_save, family_config, family_hf_config
from jaxpar.models.hf.weights import Adapter, host, small, vector

# Gemma 3's norms: (jaxpar leaf, HF tensor) beside the Llama's attn_norm (input_layernorm)
_GEMMA_NORMS = (("attn_post_norm_scale", "post_attention_layernorm.weight"),
                ("mlp_norm_scale", "pre_feedforward_layernorm.weight"),
                ("mlp_post_norm_scale", "post_feedforward_layernorm.weight"))
# the tensors of a multimodal Gemma 3 checkpoint that the text decoder leaves on disk
VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _extra(cfg: FamilyConfig) -> dict[str, tuple[int, ...]]:
    """The family's per-layer tensors beyond a Llama's: ``{name after layers.i.: shape}``."""
    H, G, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_model
    a, out = cfg.architecture, {}
    if cfg.qkv_bias:
        out.update({"self_attn.q_proj.bias": (H * K,), "self_attn.k_proj.bias": (G * K,),
                    "self_attn.v_proj.bias": (G * K,)})
    if a.qk_norm:
        out.update({"self_attn.q_norm.weight": (K,), "self_attn.k_norm.weight": (K,)})
    if a.post_norms:
        out.update({hf: (D,) for _, hf in _GEMMA_NORMS})
    return out


def _leaves(cfg: FamilyConfig, prefix: str) -> dict:
    tree = llama._leaves(cfg, prefix, decoder=prefix)
    N, H, G, K = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lay = lambda suffix: (lambda i: f"{prefix}layers.{i}.{suffix}")
    b = tree["blocks"]
    if cfg.qkv_bias:
        b["q_bias"] = small(lay("self_attn.q_proj.bias"), lambda t: t.reshape(H, K), N)
        b["k_bias"] = small(lay("self_attn.k_proj.bias"), lambda t: t.reshape(G, K), N)
        b["v_bias"] = small(lay("self_attn.v_proj.bias"), lambda t: t.reshape(G, K), N)
    if cfg.architecture.qk_norm:
        b["q_norm_scale"] = vector(lay("self_attn.q_norm.weight"), N)
        b["k_norm_scale"] = vector(lay("self_attn.k_norm.weight"), N)
    if cfg.architecture.post_norms:
        b.update({leaf: vector(lay(hf), N) for leaf, hf in _GEMMA_NORMS})
    return tree


def _hf_shapes(cfg: FamilyConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    return llama._hf_shapes(cfg, prefix, decoder=prefix, extra=_extra(cfg))


def _export(cfg: FamilyConfig, params: dict) -> dict[str, Callable[[], np.ndarray]]:
    out = llama._export(cfg, params)
    b = params["blocks"]
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", (lambda k, i=i: host(b[k][i]))
        if cfg.qkv_bias:
            out.update({p + f"self_attn.{t}_proj.bias": (lambda t=t, L=L: L(f"{t}_bias").reshape(-1)) for t in "qkv"})
        if cfg.architecture.qk_norm:
            out.update({p + f"self_attn.{t}_norm.weight": (lambda t=t, L=L: L(f"{t}_norm_scale")) for t in "qk"})
        if cfg.architecture.post_norms:   # replaces the Llama's post_attention_layernorm (its pre-MLP norm)
            out.update({p + hf: (lambda leaf=leaf, L=L: L(leaf)) for leaf, hf in _GEMMA_NORMS})
    return out


def _prefix(names) -> str:
    """Where the decoder's tensors are: ``model.`` (``...ForCausalLM``), or in a multimodal Gemma 3
    checkpoint ``language_model.model.`` (as transformers saves it) or ``model.language_model.``."""
    for prefix in ("language_model.model.", "model.language_model."):
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    return "model."


def _adapter(model_type: str, family: str, **kw) -> Adapter:
    return Adapter(model_type=model_type, config_type=FamilyConfig, model=FamilyModel, from_hf=family_config,
                   to_hf=family_hf_config, prefix=_prefix, save_prefix="model.", hf_shapes=_hf_shapes,
                   leaves=_leaves, export=_export, check_save=check_save,
                   accepts=lambda cfg: cfg.family == family and cfg.moe is None, **kw)


ADAPTERS = (_adapter("qwen2", "qwen2"), _adapter("qwen3", "qwen3"), _adapter("mistral", "mistral"),
            _adapter("gemma3_text", "gemma3"),
            # read only: a FamilyConfig is saved as the Gemma3ForCausalLM above
            _adapter("gemma3", "gemma3", saves=False, left_on_disk=VISION))
