"""Hugging Face ``config.json`` <-> :class:`jaxpar.models.families.FamilyConfig` for ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Gemma3ForCausalLM`` and the text decoder of
``Gemma3ForConditionalGeneration`` (transformers 5's fields, and the older ones hub checkpoints still carry).

Honoured: per-layer attention kinds (``layer_types``: ``"full_attention"`` or ``"sliding_attention"``, the latter
with ``sliding_window``), Qwen's ``use_sliding_window`` (false: every layer global, whatever ``sliding_window``
says) and ``max_window_layers``, rotary bases (``rope_parameters``, keyed by layer type for Gemma 3: ``default`` or
``linear`` scaling), ``query_pre_attn_scalar``. Refused, by name (:mod:`jaxpar.models.hf.config`): everything else
that changes the computation (soft-capping, bidirectional attention, other rope types, biases a family lacks, ...).
"""

from __future__ import annotations

from typing import Any

from jaxpar.models.families import FamilyConfig
from jaxpar.models.hf.config import _check_computation, _flag, _need, _num

# config.json's model_type -> jaxpar family (Gemma 3's two checkpoints share one decoder)
FAMILY = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "gemma3_text": "gemma3", "gemma3": "gemma3",
          "mixtral": "mistral", "qwen3_moe": "qwen3"}   # the last two with experts (jaxpar.models.hf.moe)
_KINDS = ("full_attention", "sliding_attention")


def text_config(hf: dict, text_only: bool) -> dict:
    """The decoder's config: ``hf`` itself, or ``Gemma3ForConditionalGeneration``'s ``text_config``.

    Raises:
      ValueError: a ``Gemma3ForConditionalGeneration`` checkpoint without ``text_only=True`` (its vision tower is not
        computed here), or one without a ``text_config`` object.
    """
    if hf.get("model_type") != "gemma3":
        return hf
    if not text_only:
        raise ValueError("config.json is a Gemma3ForConditionalGeneration's (a vision tower and a text decoder); "
                         "jaxpar computes the text decoder alone, not the vision tower or image inputs: pass "
                         "text_only=True to jaxpar.models.hf.load to load the text weights (the vision tower's are "
                         "left on disk), or load a Gemma3ForCausalLM checkpoint")
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json's text_config is {text!r}; a Gemma3ForConditionalGeneration's holds the text "
                         "decoder's config object")
    return {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **text, "model_type": "gemma3_text"}


def _rope(params: Any, where: str, theta_default: float) -> tuple[float, float]:
    """``(rope_theta, linear factor)`` of one rope parameter set, refusing other rope types."""
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"config.json has {where}rope_type={kind!r}: that rotary scaling is not computed here "
                         "(only 'default' and 'linear'), so the outputs would differ from the checkpoint's model")
    other = sorted(set(params) - {"rope_type", "type", "rope_theta", "factor"})
    if other:   # e.g. partial_rotary_factor: rotary positions on part of each head
        raise ValueError(f"config.json has {where}{other[0]}={params[other[0]]!r}, which the rotary positions here do "
                         "not compute (they read rope_type, rope_theta and a linear factor)")
    theta = _num({"rope_theta": params.get("rope_theta", theta_default)}, "rope_theta", None)
    factor = _num(params, "factor", 1.0) if kind == "linear" else 1.0
    return theta, factor


def _windows(hf: dict, family: str, n: int) -> tuple:
    """The per-layer windows the checkpoint's model computes (None: global)."""
    window = hf.get("sliding_window")
    if family == "mistral":   # transformers' Mistral windows every layer and reads no layer_types
        types = hf.get("layer_types")
        if window is not None and types is not None and types != ["sliding_attention"] * n:
            raise ValueError(f"config.json has model_type='mistral' with layer_types={types!r}: MistralForCausalLM "
                             "windows every layer, but transformers' AutoModelForCausalLM reads such a config as a "
                             "Ministral (a window on the sliding_attention layers only), so which model it is is "
                             "ambiguous; delete layer_types (every layer windowed) or list sliding_attention for each")
        return (window,) * n if window is not None else ()
    if family in ("qwen2", "qwen3") and not _flag(hf, "use_sliding_window", False):
        return ()
    types = hf.get("layer_types")
    if types is None:
        if family == "gemma3":
            pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        else:
            start = hf.get("max_window_layers", 28)
            types = ["sliding_attention" if window is not None and i >= start else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in _KINDS for t in types):
        raise ValueError(f"config.json has layer_types={types!r}: it must list {n} entries (num_hidden_layers), each "
                         f"one of {list(_KINDS)}")
    if "sliding_attention" in types and window is None:
        return ()   # transformers gives sliding layers no window then: global attention
    return tuple(window if t == "sliding_attention" else None for t in types)


def family_config(hf: dict, *, text_only: bool = False, **overrides: Any) -> FamilyConfig:
    """The :class:`FamilyConfig` of a Qwen2, Qwen3, Mistral or Gemma 3 ``config.json`` (a dict), with ``overrides``.

    Raises:
      ValueError: a field that changes the computation and is not computed here (named), a malformed field, a
        ``Gemma3ForConditionalGeneration`` without ``text_only=True``.
    """
    hf = text_config(hf, text_only)
    kind = hf.get("model_type")
    family = FAMILY[kind]
    honoured = ("sliding_window", "use_sliding_window", "layer_types") + (
        ("query_pre_attn_scalar",) if family == "gemma3" else ())
    _check_computation(hf, kind, honoured)
    d, heads, n = _need(hf, "hidden_size"), _need(hf, "num_attention_heads"), _need(hf, "num_hidden_layers")
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling") and not isinstance(hf["rope_scaling"], dict):
        raise ValueError(f"config.json has rope_scaling={hf['rope_scaling']!r}; it must be an object or null")
    extra: dict[str, Any] = {}
    if family == "gemma3":
        nested = isinstance(rope, dict) and set(rope) <= set(_KINDS) and rope
        full = rope.get("full_attention") if nested else {**(hf.get("rope_scaling") or {}), **rope}
        local = rope.get("sliding_attention") if nested else {}
        theta, factor = _rope(full, "rope_parameters.full_attention.", hf.get("rope_theta", 1e6))
        local_theta, local_factor = _rope(local, "rope_parameters.sliding_attention.",
                                          hf.get("rope_local_base_freq", 1e4))
        if local_factor != 1.0:
            raise ValueError(f"config.json scales the local layers' rotary positions (factor {local_factor}); "
                             "Gemma 3's local layers here take their base unscaled")
        extra = dict(local_rope_theta=local_theta, query_pre_attn_scalar=_num(hf, "query_pre_attn_scalar", 256))
    else:
        theta, factor = _rope({**(hf.get("rope_scaling") or {}), **rope}, "rope_parameters.",
                              hf.get("rope_theta", 10000.0))
    kwargs = dict(family=family, vocab_size=_need(hf, "vocab_size"), num_layers=n, num_heads=heads,
                  num_kv_heads=hf.get("num_key_value_heads") or heads, d_model=d, d_mlp=_need(hf, "intermediate_size"),
                  head_dim=hf.get("head_dim") or (d // heads if isinstance(d, int) and isinstance(heads, int) and heads
                                                  else 0),
                  max_seq_len=hf.get("max_position_embeddings", 2048), rope_theta=theta, rope_factor=factor,
                  windows=_windows(hf, family, n), rms_norm_eps=_num(hf, "rms_norm_eps", 1e-6),
                  tie_embeddings=_flag(hf, "tie_word_embeddings", family == "gemma3"),
                  init_std=_num(hf, "initializer_range", 0.02), **extra)
    kwargs.update(overrides)
    return FamilyConfig(**kwargs)


def _one_window(cfg: FamilyConfig) -> int | None:
    """The single window every windowed layer shares (None: no windowed layer)."""
    sizes = {w for w in cfg.windows if w is not None}
    if len(sizes) > 1:
        raise ValueError(f"a {cfg.family} checkpoint has one sliding_window for all windowed layers; this config's "
                         f"windows are {cfg.windows}: save a config whose windowed layers share one window")
    return sizes.pop() if sizes else None


def check_save(cfg: FamilyConfig) -> None:
    """Raises ValueError for a config no checkpoint of its family can say: several window sizes; a Mistral with
    global layers beside windowed ones; a Qwen whose windowed layers are not the last ones (``max_window_layers``
    only says where they start) are written as ``layer_types``, which transformers reads."""
    window = _one_window(cfg)
    if cfg.family == "mistral" and window is not None and None in cfg.windows:
        raise ValueError(f"a Mistral checkpoint windows every layer or none; this config's windows are {cfg.windows}")
    if cfg.family != "gemma3" and cfg.local_rope_theta is not None:
        raise ValueError(f"a {cfg.family} checkpoint has one rotary base; this config sets local_rope_theta")


def _whole(x: float) -> float | int:
    """``x`` as an int when it is one (transformers' strict configs type some fields int)."""
    return int(x) if float(x).is_integer() else x


def family_hf_config(cfg: FamilyConfig) -> dict:
    """The ``config.json`` (a dict, transformers 5's fields) of a :class:`FamilyConfig`'s checkpoint."""
    heads = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
             "gemma3": "Gemma3ForCausalLM"}
    window = _one_window(cfg)
    types = ["full_attention" if w is None else "sliding_attention" for w in (cfg.windows or (None,) * cfg.num_layers)]
    rope = lambda theta, factor: ({"rope_type": "default", "rope_theta": theta} if factor == 1.0 else
                                  {"rope_type": "linear", "factor": factor, "rope_theta": theta})
    out = {"architectures": [heads[cfg.family]], "model_type": "gemma3_text" if cfg.family == "gemma3" else cfg.family,
           "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
           "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_norm_eps,
           "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
           "sliding_window": window, "layer_types": types, "torch_dtype": "float32",
           "rope_parameters": rope(cfg.rope_theta, cfg.rope_factor)}
    if cfg.family == "gemma3":
        local = cfg.rope_theta if cfg.local_rope_theta is None else cfg.local_rope_theta
        out.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False, attn_logit_softcapping=None,
                   final_logit_softcapping=None, query_pre_attn_scalar=_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
                   rope_parameters={"full_attention": rope(cfg.rope_theta, cfg.rope_factor),
                                    "sliding_attention": rope(local, 1.0 if cfg.local_rope_theta else cfg.rope_factor)},
                   sliding_window=window or cfg.max_seq_len)
    else:
        out["hidden_act"] = "silu"
    if cfg.family == "mistral":   # transformers' Mistral windows every layer by sliding_window and warns at layer_types
        del out["layer_types"]
    if cfg.family in ("qwen2", "qwen3"):
        out.update(use_sliding_window=window is not None, max_window_layers=next(
            (i for i, t in enumerate(types) if t == "sliding_attention"), cfg.num_layers))
    if cfg.family == "qwen3":
        out["attention_bias"] = False
    return out
