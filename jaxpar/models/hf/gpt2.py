"""The Hugging Face weight adapter of the GPT family: ``GPT2LMHeadModel`` checkpoints as :class:`jaxpar.models.GPT`
params (learned positions, tied embeddings, ``qkv_bias=True``) and back.

GPT-2's ``Conv1D`` weights are ``[in, out]`` already: ``c_attn [D, 3*H*K]`` (columns q | k | v) ``-> qkv_kernel
[D, H, 3, K]``, ``c_attn.bias -> qkv_bias [H, 3, K]``, ``attn.c_proj [H*K, D] -> out_kernel [H, K, D]``,
``c_fc``/``mlp.c_proj`` as they are; layers stacked on a leading axis, the vocabulary padded with zero rows to
``vocab_multiple``. Tensor names carry ``transformer.`` (``save_pretrained``) or no prefix (the original
checkpoints).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxpar.models.gpt import GPT, GPTConfig
from jaxpar.models.hf.config import gpt2_config, gpt2_hf_config
from jaxpar.models.hf.weights import Adapter, checkpoint_shapes, host, linear, small, vector, vocab_rows


def _leaves(cfg: GPTConfig, prefix: str) -> dict:
    N, D, H, K, F = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    lay = lambda suffix: (lambda i: f"{prefix}h.{i}.{suffix}")
    one = lambda suffix: (lambda i: prefix + suffix)
    blocks = {
        "ln1_scale": vector(lay("ln_1.weight"), N), "ln1_bias": vector(lay("ln_1.bias"), N),
        "ln2_scale": vector(lay("ln_2.weight"), N), "ln2_bias": vector(lay("ln_2.bias"), N),
        # leaf [D, H, 3, K] from view [D, 3, H, K] (Conv1D [in, out], out = q | k | v)
        "qkv_kernel": linear(lay("attn.c_attn.weight"), (D, 3, H, K), 1, (0, 2, 1, 3), N),
        "qkv_bias": small(lay("attn.c_attn.bias"), lambda b: b.reshape(3, H, K).transpose(1, 0, 2), N),
        "out_kernel": linear(lay("attn.c_proj.weight"), (H, K, D), 2, (0, 1, 2), N),
        "out_bias": vector(lay("attn.c_proj.bias"), N),
        "up_kernel": linear(lay("mlp.c_fc.weight"), (D, F), 1, (0, 1), N), "up_bias": vector(lay("mlp.c_fc.bias"), N),
        "down_kernel": linear(lay("mlp.c_proj.weight"), (F, D), 1, (0, 1), N),
        "down_bias": vector(lay("mlp.c_proj.bias"), N),
    }
    head = {"ln_scale": vector(one("ln_f.weight"), None), "ln_bias": vector(one("ln_f.bias"), None)}
    if not cfg.tie_embeddings:
        head["kernel"] = vocab_rows("lm_head.weight", cfg.vocab_size, transpose=True)
    return {"embed": {"embedding": vocab_rows(prefix + "wte.weight", cfg.vocab_size, transpose=False),
                      "pos_embedding": linear(one("wpe.weight"), (cfg.max_seq_len, D), 1, (0, 1), None)},
            "blocks": blocks, "head": head}


def _hf_shapes(cfg: GPTConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    D, H, K, V, F = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.vocab_size, cfg.mlp_dim
    want = {prefix + "wte.weight": (V, D), prefix + "wpe.weight": (cfg.max_seq_len, D),
            prefix + "ln_f.weight": (D,), prefix + "ln_f.bias": (D,)}
    per = {"ln_1.weight": (D,), "ln_1.bias": (D,), "ln_2.weight": (D,), "ln_2.bias": (D,),
           "attn.c_attn.weight": (D, 3 * H * K), "attn.c_attn.bias": (3 * H * K,),
           "attn.c_proj.weight": (H * K, D), "attn.c_proj.bias": (D,), "mlp.c_fc.weight": (D, F),
           "mlp.c_fc.bias": (F,), "mlp.c_proj.weight": (F, D), "mlp.c_proj.bias": (D,)}
    return checkpoint_shapes(want, per, prefix + "h.", cfg.num_layers, None if cfg.tie_embeddings else (V, D))


def _export(cfg: GPTConfig, params: dict) -> dict[str, Callable[[], np.ndarray]]:
    V, D, b, t = cfg.vocab_size, cfg.d_model, params["blocks"], "transformer."
    lay = lambda k, i: (lambda: host(b[k][i]))
    out = {t + "wte.weight": lambda: host(params["embed"]["embedding"])[:V],
           t + "wpe.weight": lambda: host(params["embed"]["pos_embedding"]),
           t + "ln_f.weight": lambda: host(params["head"]["ln_scale"]),
           t + "ln_f.bias": lambda: host(params["head"]["ln_bias"])}
    for i in range(cfg.num_layers):
        p, L = f"{t}h.{i}.", (lambda k, i=i: host(b[k][i]))
        qkv_bias = (lambda L=L: L("qkv_bias").transpose(1, 0, 2).reshape(-1)) if cfg.qkv_bias else \
            (lambda: np.zeros(3 * cfg.num_heads * cfg.head_dim, np.float32))
        out.update({
            p + "ln_1.weight": lay("ln1_scale", i), p + "ln_1.bias": lay("ln1_bias", i),
            p + "ln_2.weight": lay("ln2_scale", i), p + "ln_2.bias": lay("ln2_bias", i),
            p + "attn.c_attn.weight": lambda L=L: L("qkv_kernel").transpose(0, 2, 1, 3).reshape(D, -1),
            p + "attn.c_attn.bias": qkv_bias,
            p + "attn.c_proj.weight": lambda L=L: L("out_kernel").reshape(-1, D),
            p + "attn.c_proj.bias": lay("out_bias", i),
            p + "mlp.c_fc.weight": lay("up_kernel", i), p + "mlp.c_fc.bias": lay("up_bias", i),
            p + "mlp.c_proj.weight": lay("down_kernel", i), p + "mlp.c_proj.bias": lay("down_bias", i)})
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = lambda: host(params["head"]["kernel"])[:, :V].T
    return out


def _check_save(cfg: GPTConfig) -> None:
    if cfg.positions != "learned":
        raise ValueError("a GPT with positions='rotary' has no GPT-2 checkpoint (GPT-2 learns its positions); "
                         "save a GPTConfig(positions='learned') model")


ADAPTER = Adapter(model_type="gpt2", config_type=GPTConfig, model=GPT, from_hf=gpt2_config, to_hf=gpt2_hf_config,
                  # save_pretrained's names carry "transformer.", the original checkpoints' none
                  prefix=lambda names: "transformer." if "transformer.wte.weight" in names else "",
                  save_prefix="transformer.", hf_shapes=_hf_shapes, leaves=_leaves, export=_export,
                  check_save=_check_save)
