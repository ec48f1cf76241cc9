"""A Llama-family decoder (Touvron et al. 2023; Grattafiori et al. 2024): the decoder base
(:mod:`jaxpar.models.decoder`) configured with pre-norm RMSNorm (Zhang & Sennrich 2019), grouped-query attention
(Ainslie et al. 2023) with rotary positions (Su et al. 2021; the half-rotation layout of Hugging Face's
``LlamaForCausalLM``, whose ``q_proj``/``k_proj`` rows are already permuted for it) and Llama 3's frequency scaling,
and a SwiGLU MLP (Shazeer 2020): ``down(silu(gate(h)) * up(h))``. No biases.

Params ``{"embed": {"embedding" [V, D]}, "blocks": {attn_norm_scale, q_kernel [N, D, H, K], k_kernel /
v_kernel [N, D, G, K], out_kernel [N, H, K, D], mlp_norm_scale, gate_kernel / up_kernel [N, D, F],
down_kernel [N, F, D]}, "head": {"norm_scale" [D], "kernel" [D, V] unless tied}}``. ``k_kernel`` and
``v_kernel`` carry the logical name ``kv_heads``, which the default rules leave unmapped: under tensor
parallelism the G key/value heads are replicated on every tensor shard (each shard computes them; the query
heads, ``heads``, are split), which is correct for any ``tensor`` including ``tensor > num_kv_heads``. Add the
rule ``("kv_heads", "tensor")`` before the defaults (Flax reads the first rule naming an axis) to split them as well
where ``tensor`` divides ``num_kv_heads``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxpar.models.blocks import Architecture
from jaxpar.models import moe_block
from jaxpar.models.decoder import (Decoder, ExpertFields, RotaryFields, RunFields, check_rotary_fields,
                                   compact_grouped, rotary_inv_freq)

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class LlamaConfig(RotaryFields, RunFields, ExpertFields):
    vocab_size: int = 256          # tokens; padded to vocab_multiple
    num_layers: int = 4            # N blocks, stacked on a leading "layers" axis
    num_heads: int = 4             # H query heads
    num_kv_heads: int = 0          # G key/value heads (divides num_heads); 0 means num_heads (multi-head attention)
    d_model: int = 128             # D model width
    d_mlp: int = 0                 # F SwiGLU width; 0 means 8 * d_model / 3 rounded up to a multiple of 64
    head_dim: int = 0              # K; 0 means d_model // num_heads
    max_seq_len: int = 128         # longest sequence (HF: max_position_embeddings)
    rope_theta: float = 10000.0    # rotary base frequency (HF: rope_theta; Llama 3 uses 500000)
    rope_scaling: Any = None       # None, or Llama 3's frequency scaling as in the HF config: {"rope_type": "llama3",
                                   # "factor", "low_freq_factor", "high_freq_factor",
                                   # "original_max_position_embeddings"} (stored as a sorted tuple of items)
    rms_norm_eps: float = 1e-5     # RMSNorm epsilon (HF: rms_norm_eps)
    tie_embeddings: bool = False   # logits = x @ embedding.T (HF: tie_word_embeddings)

    def __post_init__(self):
        check_rotary_fields(self)
        object.__setattr__(self, "rope_scaling", _check_rope_scaling(self.rope_scaling))

    def as_model(self, params: Any = None) -> "Llama":
        return Llama(self)

    # what the decoder base reads besides the fields (jaxpar.models.decoder)
    architecture = Architecture(attention="gqa", norm="rms", mlp="swiglu", bias=False)
    positions = "rotary"
    qkv_bias = False

    def num_params(self, embeddings: bool = True, active: bool = False) -> int:
        """Parameters (embeddings included unless ``embeddings=False``): every expert of a mixture of experts, or
        (``active``) the ``k`` routed experts a token runs (:func:`jaxpar.models.moe_block.mlp_params`)."""
        D, N, H, G, K = self.d_model, self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim
        block = D * H * K + 2 * D * G * K + H * K * D + moe_block.mlp_params(self, active) + 2 * D
        head = D + (0 if self.tie_embeddings else D * self.padded_vocab)
        return N * block + head + (self.padded_vocab * D if embeddings else 0)

    def active_params(self, embeddings: bool = True) -> int:
        """The parameters one token runs through: :meth:`num_params` with ``k`` routed experts of ``E``."""
        return self.num_params(embeddings, active=True)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * (active non-embedding params + unembedding) + 12 * N * L * H * K (attention;
        Kaplan et al. 2020, sec. 2.1)."""
        dense = self.active_params(embeddings=False) + (self.padded_vocab * self.d_model if self.tie_embeddings else 0)
        return 6.0 * dense + 12.0 * self.num_layers * seq_len * self.num_heads * self.head_dim

    def inv_freq(self) -> np.ndarray:
        """The ``head_dim // 2`` rotary inverse frequencies (float64 numpy) from ``rope_theta``, with Llama 3's
        scaling when ``rope_scaling`` is set (:func:`jaxpar.models.decoder.rotary_inv_freq`)."""
        return rotary_inv_freq(self.rope_base, self.head_dim,
                               None if self.rope_scaling is None else dict(self.rope_scaling))

    def rotary_freq(self) -> np.ndarray:
        """The inverse frequencies the blocks' rotary positions use (float32)."""
        return self.inv_freq().astype(np.float32)


def _check_rope_scaling(value: Any) -> Any:
    if value is None:
        return None
    items = dict(value)
    kind = items.get("rope_type", items.get("type"))
    if kind in ("default", None) and not set(items) & set(_LLAMA3_KEYS):
        return None
    if kind != "llama3":
        raise ValueError(f"LlamaConfig.rope_scaling={value!r}: only Llama 3's scaling is supported "
                         "(rope_type 'llama3' with factor, low_freq_factor, high_freq_factor, "
                         "original_max_position_embeddings), or None")
    missing = [k for k in _LLAMA3_KEYS if k not in items]
    if missing:
        raise ValueError(f"LlamaConfig.rope_scaling={value!r} lacks {missing} (Llama 3's scaling needs all of "
                         f"{list(_LLAMA3_KEYS)})")
    for k in _LLAMA3_KEYS:
        v = items[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"LlamaConfig.rope_scaling[{k!r}]={v!r} must be a positive finite number")
    if items["high_freq_factor"] <= items["low_freq_factor"]:
        raise ValueError(f"LlamaConfig.rope_scaling: high_freq_factor {items['high_freq_factor']} must exceed "
                         f"low_freq_factor {items['low_freq_factor']}")
    return tuple(sorted({**{k: items[k] for k in _LLAMA3_KEYS}, "rope_type": "llama3"}.items()))


class Llama(Decoder):
    """The Llama as pure functions over ``{"embed", "blocks", "head"}``: every part of the model protocol
    (:mod:`jaxpar.protocol`), from :class:`jaxpar.models.decoder.Decoder`. ``init_cache`` keeps the G key/value
    heads: ``[layers, batch, max_len, num_kv_heads, head_dim]``; ``embed`` warns (once per config and mesh) when
    they are replicated over a ``tensor`` axis of more than one device (the rules leave ``kv_heads`` unmapped).
    ``LlamaConfig(moe=MoEConfig(...))``: a mixture of experts in every block instead of the SwiGLU MLP
    (:mod:`jaxpar.models.moe_block`)."""

    def replace(self, sizes: dict[tuple, int]) -> LlamaConfig:
        """The config after compaction (:func:`jaxpar.models.decoder.compact_grouped`): ``sizes`` maps
        ``("blocks", "mlp")`` and ``("blocks", "heads")`` to the kept counts.

        Raises:
          ValueError: a group other than ``blocks/mlp`` or ``blocks/heads``; a head count that is not a multiple
            of ``num_kv_heads``.
        """
        return compact_grouped(self.cfg, sizes, "Llama")
