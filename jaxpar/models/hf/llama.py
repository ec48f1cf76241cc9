"""The Hugging Face weight adapter of the Llama family: ``LlamaForCausalLM`` checkpoints as
:class:`jaxpar.models.Llama` params and back.

Layouts (HF ``nn.Linear`` weights are ``[out, in]``): ``q_proj [H*K, D] -> q_kernel [D, H, K]``, ``k_proj`` /
``v_proj [G*K, D] -> [D, G, K]``, ``o_proj [D, H*K] -> out_kernel [H, K, D]``, ``gate/up_proj [F, D] -> [D, F]``,
``down_proj [D, F] -> [F, D]``, ``lm_head [V, D] -> head/kernel [D, V]``, layers stacked on a leading axis, the
vocabulary padded with zero rows to ``vocab_multiple``. HF's ``q_proj``/``k_proj`` rows are already in the
half-rotation order jaxpar's rotary embedding uses (``transformers``' ``convert_llama_weights_to_hf`` permutes
Meta's interleaved pairs), so they are copied as they are.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxpar.models.hf.config import llama_config, llama_hf_config
from jaxpar.models.hf.weights import Adapter, checkpoint_shapes, host, linear, vector, vocab_rows
from jaxpar.models.llama import Llama, LlamaConfig


def head_name(decoder: str) -> str:
    """The untied head's tensor beside the decoder whose tensors are named ``decoder + "layers..."``:
    ``lm_head.weight`` next to ``model.`` (and ``model.language_model.``), ``language_model.lm_head.weight`` next to
    ``language_model.model.`` (Gemma 3's multimodal checkpoints)."""
    return decoder[: -len("model.")] + "lm_head.weight" if decoder.endswith(".model.") else "lm_head.weight"


def _leaves(cfg: LlamaConfig, prefix: str, decoder: str = "model.") -> dict:
    """The params tree of leaf readers of a Llama-shaped checkpoint whose decoder's tensors start with ``decoder``
    (the families of :mod:`jaxpar.models.hf.families` add theirs)."""
    N, D, H, G, K, F = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_mlp
    lay = lambda suffix: (lambda i: f"{decoder}layers.{i}.{suffix}")
    blocks = {
        "attn_norm_scale": vector(lay("input_layernorm.weight"), N),
        "mlp_norm_scale": vector(lay("post_attention_layernorm.weight"), N),
        # leaf [D, H, K] from view [H, K, D]: view axes (H, K, D) are leaf axes (1, 2, 0)
        "q_kernel": linear(lay("self_attn.q_proj.weight"), (H, K, D), 2, (1, 2, 0), N),
        "k_kernel": linear(lay("self_attn.k_proj.weight"), (G, K, D), 2, (1, 2, 0), N),
        "v_kernel": linear(lay("self_attn.v_proj.weight"), (G, K, D), 2, (1, 2, 0), N),
        # leaf [H, K, D] from view [D, H, K]: (D, H, K) -> leaf axes (2, 0, 1)
        "out_kernel": linear(lay("self_attn.o_proj.weight"), (D, H, K), 1, (2, 0, 1), N),
        "gate_kernel": linear(lay("mlp.gate_proj.weight"), (F, D), 1, (1, 0), N),
        "up_kernel": linear(lay("mlp.up_proj.weight"), (F, D), 1, (1, 0), N),
        "down_kernel": linear(lay("mlp.down_proj.weight"), (D, F), 1, (1, 0), N),
    }
    head = {"norm_scale": vector(lambda i: f"{decoder}norm.weight", None)}
    if not cfg.tie_embeddings:
        head["kernel"] = vocab_rows(head_name(decoder), cfg.vocab_size, transpose=True)
    return {"embed": {"embedding": vocab_rows(f"{decoder}embed_tokens.weight", cfg.vocab_size, transpose=False)},
            "blocks": blocks, "head": head}


def _hf_shapes(cfg: LlamaConfig, prefix: str, decoder: str = "model.", extra: dict | None = None) -> dict:
    """``{HF tensor name: shape}``; ``extra``: more per-layer tensors (a family's)."""
    D, H, K, V, G, F = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.vocab_size, cfg.num_kv_heads, cfg.d_mlp
    want = {f"{decoder}embed_tokens.weight": (V, D), f"{decoder}norm.weight": (D,)}
    per = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
           "self_attn.q_proj.weight": (H * K, D), "self_attn.k_proj.weight": (G * K, D),
           "self_attn.v_proj.weight": (G * K, D), "self_attn.o_proj.weight": (D, H * K),
           "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F),
           **(extra or {})}
    want = checkpoint_shapes(want, per, f"{decoder}layers.", cfg.num_layers, None)
    return want if cfg.tie_embeddings else {**want, head_name(decoder): (V, D)}


def _export(cfg: LlamaConfig, params: dict) -> dict[str, Callable[[], np.ndarray]]:
    V, D, b = cfg.vocab_size, cfg.d_model, params["blocks"]
    lay = lambda k, i: (lambda: host(b[k][i]))
    out = {"model.embed_tokens.weight": lambda: host(params["embed"]["embedding"])[:V],
           "model.norm.weight": lambda: host(params["head"]["norm_scale"])}
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", (lambda k, i=i: host(b[k][i]))
        out.update({
            p + "input_layernorm.weight": lay("attn_norm_scale", i),
            p + "post_attention_layernorm.weight": lay("mlp_norm_scale", i),
            p + "self_attn.q_proj.weight": lambda L=L: L("q_kernel").reshape(D, -1).T,
            p + "self_attn.k_proj.weight": lambda L=L: L("k_kernel").reshape(D, -1).T,
            p + "self_attn.v_proj.weight": lambda L=L: L("v_kernel").reshape(D, -1).T,
            p + "self_attn.o_proj.weight": lambda L=L: L("out_kernel").reshape(-1, D).T,
            p + "mlp.gate_proj.weight": lambda L=L: L("gate_kernel").T,
            p + "mlp.up_proj.weight": lambda L=L: L("up_kernel").T,
            p + "mlp.down_proj.weight": lambda L=L: L("down_kernel").T})
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = lambda: host(params["head"]["kernel"])[:, :V].T
    return out


ADAPTER = Adapter(model_type="llama", config_type=LlamaConfig, model=Llama, from_hf=llama_config,
                  to_hf=llama_hf_config, prefix=lambda names: "", save_prefix="", hf_shapes=_hf_shapes,
                  leaves=_leaves, export=_export, accepts=lambda cfg: cfg.moe is None)
