"""Hugging Face ``transformers``' own decoders as the PyTorch side of ``vs_pytorch.py --model llama|qwen3|gemma3``.

:func:`save_random` builds ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` or ``Gemma3ForCausalLM`` from a small
config (transformers' own random initialisation, float32) and saves it; ``jaxpar.models.hf.load`` reads the same
directory, so both sides start from the same weights through the checkpoint mapping the tests check against
``transformers``. :func:`build` reads it back with ``from_pretrained(dir, attn_implementation="sdpa")``; the
wrapper's ``forward(inputs_BL, targets_BL)`` is the mean token cross-entropy over HF's vocabulary (jaxpar's padded
logits are ``finfo.min / 2``, so the two losses agree), without HF's own label shift: the targets are given.
"""

from __future__ import annotations

from torch_gpt import torch_module

# family -> (transformers config class, model class)
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def _transformers():
    from jaxpar._optional import require
    return require("transformers", "vs_pytorch.py --model llama|qwen3|gemma3", extra="bench")


def hf_config(family: str, *, vocab: int, layers: int, d_model: int, heads: int, kv_heads: int, d_mlp: int,
              head_dim: int, seq: int, window: int):
    """The ``transformers`` config of ``family`` at the benchmark's sizes: Llama untied with ``head_dim =
    d_model / heads``; Qwen3 with its own ``head_dim``, q/k norms, rope theta 1e6, tied embeddings; Gemma 3 with
    its own ``head_dim`` (``query_pre_attn_scalar`` = ``head_dim``), layers alternating local (sliding
    ``window``) and global, rotary bases 1e4 / 1e6, tied embeddings, GeGLU (tanh gelu)."""
    tf = _transformers()
    shared = dict(vocab_size=vocab, hidden_size=d_model, intermediate_size=d_mlp, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
                  rms_norm_eps=1e-6, initializer_range=0.02, pad_token_id=None)  # a padding_idx row gets no gradient
    if family == "llama":
        return tf.LlamaConfig(**shared, tie_word_embeddings=False)
    if family == "qwen3":
        return tf.Qwen3Config(**shared, head_dim=head_dim, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "gemma3":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return tf.Gemma3TextConfig(**shared, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                                   sliding_window=window, layer_types=types, tie_word_embeddings=True)
    raise ValueError(f"family={family!r}; use one of {list(CLASSES)}")


def save_random(family: str, directory: str, seed: int = 0, **sizes) -> None:
    """Writes a randomly initialised ``family`` model of ``transformers`` (seeded, float32) to ``directory``."""
    torch = torch_module()
    tf = _transformers()
    torch.manual_seed(seed)
    model = getattr(tf, CLASSES[family][1])(hf_config(family, **sizes)).float()
    model.save_pretrained(directory)


def build(family: str, directory: str):
    """``(module, hf_model)``: ``module(inputs, targets) -> loss`` wrapping ``family``'s model read from
    ``directory`` (``attn_implementation="sdpa"``, float32)."""
    torch = torch_module()
    tf = _transformers()
    ref = getattr(tf, CLASSES[family][1]).from_pretrained(directory, attn_implementation="sdpa", dtype=torch.float32)

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = ref

        def forward(self, inputs, targets):
            logits = self.hf(input_ids=inputs, use_cache=False).logits
            return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return Loss().train(), ref
