"""Hugging Face ``config.json`` <-> jaxpar configs: :class:`LlamaConfig` from and to ``LlamaForCausalLM``'s,
:class:`GPTConfig` from and to ``GPT2LMHeadModel``'s, with errors naming the field (used by
:mod:`jaxpar.models.hf`)."""

from __future__ import annotations

import json
import os
from typing import Any

from jaxpar.models.generation import token_ids
from jaxpar.models.gpt import GPTConfig
from jaxpar.models.hf.files import inside
from jaxpar.models.llama import LlamaConfig


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory; pass a Hugging Face checkpoint directory (config.json and "
                         "model*.safetensors, as save_pretrained writes)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} has no config.json; it is not a Hugging Face checkpoint directory")
    return _read_json(path, "config.json")


def _read_json(path: str, name: str) -> dict:
    """The JSON object in file ``name`` of checkpoint directory ``path`` (inside it once links are resolved);
    ValueError when it is unreadable, not JSON, nested too deep, or not an object."""
    file = inside(path, name, "the checkpoint")
    try:
        with open(file) as f:
            obj = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{os.path.join(path, name)!r} is not a readable JSON file ({type(e).__name__}: "
                         f"{str(e)[:200]}); restore the checkpoint's {name}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{os.path.join(path, name)!r} holds a JSON {type(obj).__name__}, not an object of fields")
    return obj


def eos_token_ids(path: str, hf: dict, vocab_size: int) -> tuple[int, ...]:
    """The ids that end generation: ``generation_config.json``'s ``eos_token_id`` where the directory has that
    file (what ``transformers``' ``generate`` reads), else ``config.json``'s (``hf``; a multimodal config's
    ``text_config`` where its top level has none); an id, a list of ids, or none (absent or null).

    Raises:
      ValueError: ``generation_config.json`` present but unreadable (a folder, a broken link) or not an object,
        or an id that is not an int in ``[0, vocab_size)`` (naming the file).
    """
    name, source = "config.json", hf
    if os.path.lexists(os.path.join(path, "generation_config.json")):   # a folder or a broken link: refused
        name = "generation_config.json"
        source = _read_json(path, name)
    elif "eos_token_id" not in hf and isinstance(hf.get("text_config"), dict):
        source = hf["text_config"]   # Gemma3ForConditionalGeneration: the text decoder's ids
    return token_ids(source.get("eos_token_id"), vocab_size, f"{name} has eos_token_id")


def _need(hf: dict, key: str) -> Any:
    """``hf[key]``, or a ValueError naming the missing config.json field."""
    if key not in hf:
        raise ValueError(f"config.json lacks {key!r}, which the {hf.get('model_type', '?')} config needs")
    return hf[key]


def _num(hf: dict, key: str, default: Any) -> float:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config.json has {key}={value!r}; it must be a number")
    return float(value)


def _flag(hf: dict, key: str, default: bool) -> bool:
    value = hf.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"config.json has {key}={value!r}; it must be true or false")
    return value


_HEADS = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
          "gemma3": "Gemma3ForConditionalGeneration", "mixtral": "MixtralForCausalLM",
          "qwen3_moe": "Qwen3MoeForCausalLM"}
# architectures refused by name, with what is missing
_REFUSED = {"deepseek_v3": ("DeepseekV3ForCausalLM", "its attention is multi-head latent attention (MLA: q_lora_rank, "
                            "kv_lora_rank, a compressed key/value cache), which jaxpar does not build; its routing "
                            "(sigmoid affinities, selection bias, group-limited top-k, shared experts) is "
                            "jaxpar.layers.moe.MoEConfig(router='sigmoid', ...), usable in a jaxpar model trained "
                            "from scratch, but the checkpoint's attention weights have no place"),
            "deepseek_v2": ("DeepseekV2ForCausalLM", "its attention is multi-head latent attention (MLA), which jaxpar "
                            "does not build"),
            "qwen2_moe": ("Qwen2MoeForCausalLM", "its shared expert's output is scaled by a per-token sigmoid gate "
                          "(shared_expert_gate), which jaxpar's shared experts (MoEConfig.num_shared_experts) do not "
                          "compute; Qwen3MoeForCausalLM and MixtralForCausalLM load")}

# Config fields that change what a model computes, in ways the models here do not: field -> (the values that
# mean "off", what the field turns on). An absent field is off; a list is off when each of its items is (Gemma's
# and Qwen's per-layer `layer_types`). Fields of other architectures are here because their configs are
# relabelled as a Llama's (Mistral's with `sliding_window`), and a relabelled field would be ignored silently.
# Dropout fields are absent on purpose: they change training only, and jaxpar trains without dropout.
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "sliding_window": ((None,), "sliding-window attention (Mistral, Qwen2, Gemma 2)"),
    "use_sliding_window": ((None, False), "sliding-window attention (Qwen2)"),
    "layer_types": (("full_attention",), "per-layer attention kinds (sliding windows, chunks)"),
    "attention_chunk_size": ((None,), "chunked attention (Llama 4)"),
    "no_rope_layers": ((1,), "layers without rotary positions (Llama 4, SmolLM3)"),
    "attn_logit_softcapping": ((None,), "attention logit soft-capping (Gemma 2)"),
    "final_logit_softcapping": ((None,), "output logit soft-capping (Gemma 2)"),
    "query_pre_attn_scalar": ((None,), "another attention scale (Gemma 2)"),
    "use_bidirectional_attention": ((None, False), "bidirectional attention"),
    "learnable_sink_init": ((None,), "attention sinks"),
    "attention_multiplier": ((None,), "another attention scale (Granite)"),
    "embedding_multiplier": ((None, 1), "scaled embeddings (Granite)"),
    "residual_multiplier": ((None, 1), "scaled residuals (Granite)"),
    "logits_scaling": ((None, 1), "scaled logits (Granite)"),
    "logit_scale": ((None, 1), "scaled logits (Cohere)"),
    "use_qk_norm": ((None, False), "query/key normalization"),
    "partial_rotary_factor": ((None, 1), "rotary positions on part of each head"),
    "add_cross_attention": ((None, False), "cross-attention"),
}
# the same for one architecture: fields whose "off" values are that model's
_UNSUPPORTED_BY_ARCH = {
    "llama": {"attention_bias": ((None, False), "biases (jaxpar's Llama has none)"),
              "mlp_bias": ((None, False), "biases (jaxpar's Llama has none)"),
              "hidden_act": (("silu",), "another activation (the Llama's SwiGLU uses silu)"),
              "hidden_activation": ((None, "silu"), "another activation (the Llama's SwiGLU uses silu)")},
    "gpt2": {"activation_function": (("gelu_new", "gelu_pytorch_tanh"),
                                     "another activation (the GPT's MLP uses GELU with the tanh approximation)"),
             "scale_attn_weights": ((True,), "another attention scaling (the GPT scales logits by 1/sqrt(head_dim))"),
             "scale_attn_by_inverse_layer_idx": ((None, False), "another attention scaling (the GPT scales logits by "
                                                 "1/sqrt(head_dim))"),
             "reorder_and_upcast_attn": ((None, False), "another attention scaling (the GPT scales logits by "
                                         "1/sqrt(head_dim))")},
    # the families of jaxpar.models.families (jaxpar.models.hf.family_config honours their windows and scales)
    "qwen2": {"hidden_act": (("silu",), "another activation (Qwen2's SwiGLU uses silu)")},
    "qwen3": {"hidden_act": (("silu",), "another activation (Qwen3's SwiGLU uses silu)"),
              "attention_bias": ((None, False), "biases on q, k, v and o (Qwen3 has none)")},
    "mistral": {"hidden_act": (("silu",), "another activation (Mistral's SwiGLU uses silu)")},
    "mixtral": {"hidden_act": (("silu",), "another activation (Mixtral's SwiGLU experts use silu)")},
    "qwen3_moe": {"hidden_act": (("silu",), "another activation (Qwen3-MoE's SwiGLU experts use silu)"),
                  "attention_bias": ((None, False), "biases on q, k, v and o (Qwen3-MoE has none)")},
    "gemma3_text": {"hidden_activation": ((None, "gelu_pytorch_tanh"), "another activation (Gemma 3's GeGLU uses "
                                          "gelu with the tanh approximation)"),
                    "hidden_act": ((None, "gelu_pytorch_tanh"), "another activation (Gemma 3's GeGLU uses gelu with "
                                   "the tanh approximation)"),
                    "attention_bias": ((None, False), "biases on q, k, v and o (Gemma 3 has none)")},
}


def _off(value: Any, off: tuple) -> bool:
    return all(item in off for item in (value if isinstance(value, list) else [value]))


def _check_computation(hf: dict, kind: str, honoured: tuple[str, ...] = ()) -> None:
    """Raises a ValueError naming the first field of :data:`UNSUPPORTED` (or ``kind``'s own) that ``hf`` (or its
    ``rope_parameters``) sets on, but those the caller computes (``honoured``)."""
    fields = {k: v for k, v in {**UNSUPPORTED, **_UNSUPPORTED_BY_ARCH[kind]}.items() if k not in honoured}
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    for where, values in (("", hf), ("rope_parameters.", rope)):
        for key, (off, what) in fields.items():
            if key in values and not _off(values[key], off):
                raise ValueError(f"config.json has {where}{key}={values[key]!r}: {what}, which the {_HEADS[kind]} "
                                 f"loaded here does not compute (it takes {' or '.join(map(json.dumps, off))} or no "
                                 f"{key}), so its outputs would differ from those of the checkpoint's model")


def _arch(hf: dict) -> str:
    """The family (a key of ``_HEADS``): ``model_type`` and, when given, ``architectures`` must name its model."""
    arch = hf.get("architectures") or []
    kind = hf.get("model_type")
    for refused, (head, why) in _REFUSED.items():
        if kind == refused or head in arch:
            raise ValueError(f"config.json is a {head}'s (model_type={kind!r}): {why}")
    kind = kind if kind in _HEADS else next((k for k, head in _HEADS.items() if head in arch), None)
    if kind is None:
        raise ValueError(f"config.json has model_type={hf.get('model_type')!r}, architectures={arch}; "
                         f"jaxpar.models.hf loads {', '.join(_HEADS.values())} checkpoints")
    if arch and _HEADS[kind] not in arch:
        raise ValueError(f"config.json has architectures={arch}: a {kind} model with another head; jaxpar.models.hf "
                         f"loads the causal language model {_HEADS[kind]} (save that one with save_pretrained)")
    return kind


def gpt2_config(hf: dict, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a ``GPT2LMHeadModel`` ``config.json`` (a dict), with ``overrides``.

    Raises:
      ValueError: features the GPT here lacks (another activation, LayerNorm epsilon, unscaled attention, a field
        of :data:`UNSUPPORTED` set on), naming the field.
    """
    _check_computation(hf, "gpt2")
    if abs(float(hf.get("layer_norm_epsilon", 1e-5)) - 1e-5) > 1e-12:
        raise ValueError(f"config.json has layer_norm_epsilon={hf['layer_norm_epsilon']}; the GPT's LayerNorm uses 1e-5")
    kwargs = dict(vocab_size=_need(hf, "vocab_size"), num_layers=_need(hf, "n_layer"), num_heads=_need(hf, "n_head"),
                  d_model=_need(hf, "n_embd"), d_mlp=hf.get("n_inner") or 0, max_seq_len=_need(hf, "n_positions"),
                  positions="learned", tie_embeddings=_flag(hf, "tie_word_embeddings", True), qkv_bias=True,
                  init_std=_num(hf, "initializer_range", 0.02))
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


def llama_config(hf: dict, **overrides: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``LlamaForCausalLM`` ``config.json`` (a dict), with ``overrides``.

    Raises:
      ValueError: a config another architecture wrote, or features the Llama here lacks (biases, another
        activation, a rope type other than Llama 3's, a field of :data:`UNSUPPORTED` set on: a sliding window,
        soft-capping, attention sinks, ...), naming the field.
    """
    if _arch(hf) != "llama":
        raise ValueError(f"config.json has model_type={hf.get('model_type')!r}; llama_config reads a Llama's")
    _check_computation(hf, "llama")
    rope = dict(hf.get("rope_parameters") or {})       # transformers >= 5
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    d, heads = _need(hf, "hidden_size"), _need(hf, "num_attention_heads")
    if isinstance(scaling, str):
        raise ValueError(f"config.json has rope_scaling={scaling!r}; it must be an object such as Llama 3's "
                         "{'rope_type': 'llama3', 'factor': ..., ...}, or null")
    kwargs = dict(vocab_size=_need(hf, "vocab_size"), num_layers=_need(hf, "num_hidden_layers"), num_heads=heads,
                  num_kv_heads=hf.get("num_key_value_heads") or heads, d_model=d, d_mlp=_need(hf, "intermediate_size"),
                  head_dim=hf.get("head_dim") or (d // heads if isinstance(d, int) and isinstance(heads, int) and heads
                                                  else 0),
                  max_seq_len=hf.get("max_position_embeddings", 2048),
                  rope_theta=_num({"rope_theta": theta}, "rope_theta", None), rope_scaling=scaling,
                  rms_norm_eps=_num(hf, "rms_norm_eps", 1e-6), tie_embeddings=_flag(hf, "tie_word_embeddings", False),
                  init_std=_num(hf, "initializer_range", 0.02))
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def gpt2_hf_config(cfg: GPTConfig) -> dict:
    """The ``config.json`` (a dict) of a GPT's ``GPT2LMHeadModel`` checkpoint."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_embd": cfg.d_model, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
            "n_inner": cfg.mlp_dim, "n_positions": cfg.max_seq_len, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std, "scale_attn_weights": True, "torch_dtype": "float32"}


def llama_hf_config(cfg: LlamaConfig) -> dict:
    """The ``config.json`` (a dict) of a Llama's ``LlamaForCausalLM`` checkpoint."""
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
           "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
           "initializer_range": cfg.init_std, "rope_theta": cfg.rope_theta, "torch_dtype": "float32"}
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope.update(dict(cfg.rope_scaling))
        out["rope_scaling"] = dict(cfg.rope_scaling)
    out["rope_parameters"] = rope
    return out
