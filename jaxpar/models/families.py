"""The dense decoder families researchers fine-tune from Hugging Face, as configurations of the decoder base
(:mod:`jaxpar.models.decoder`): Qwen2 / Qwen2.5 (Yang et al. 2024), Qwen3 dense (Yang et al. 2025), Mistral
(Jiang et al. 2023) and Gemma 3's text decoder (Gemma Team 2025). Each is a row of :data:`FAMILIES` (an
:class:`jaxpar.models.blocks.Architecture` plus whether q/k/v carry biases) and the fields of one config,
:class:`FamilyConfig`; nothing here is a subclass of another family.

What each family adds to a Llama block (rotary grouped-query attention, RMSNorm, SwiGLU):

* ``"qwen2"``: biases on the q, k and v projections (``q_bias [H, K]``, ``k_bias`` / ``v_bias [G, K]``).
* ``"qwen3"``: an RMSNorm over each query and key head before rotary positions (``q_norm_scale`` /
  ``k_norm_scale [K]``); ``head_dim`` independent of ``d_model / num_heads``.
* ``"mistral"``: a sliding window on every layer (``windows``).
* ``"gemma3"``: q/k norms, norms after attention and after the MLP too (``attn_post_norm_scale``,
  ``mlp_post_norm_scale``), GeGLU with the tanh gelu, RMSNorm scaled by ``1 + w``, embeddings times
  ``sqrt(d_model)``, the attention scale ``query_pre_attn_scalar ** -0.5``, and per layer five local layers
  (sliding window, rotary base ``local_rope_theta``) to one global (rotary base ``rope_theta`` with positions
  divided by ``rope_factor``).

What differs between layers is data of the config (``windows``: one entry per layer), turned into one
:class:`jaxpar.models.blocks.LayerKind` per layer; the decoder runs each kind as its own block program and scans
over repeats of the kinds' period (:meth:`jaxpar.models.decoder.Decoder.stage`).

Build one with the family's constructor (:func:`qwen2`, :func:`qwen3`, :func:`mistral`, :func:`gemma3`), which
sets the family's defaults, or with ``FamilyConfig(family=...)``; ``jaxpar.models.hf.load`` reads Hugging Face
checkpoints of all four into it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxpar.models.blocks import Architecture, LayerKind
from jaxpar.models import moe_block
from jaxpar.models.decoder import (Decoder, ExpertFields, RotaryFields, RunFields, check_rotary_fields,
                                   compact_grouped, rotary_inv_freq)

_GQA = dict(attention="gqa", norm="rms", bias=False)
FAMILIES: dict[str, tuple[Architecture, bool]] = {
    "qwen2": (Architecture(mlp="swiglu", **_GQA), True),
    "qwen3": (Architecture(mlp="swiglu", qk_norm=True, **_GQA), False),
    "mistral": (Architecture(mlp="swiglu", **_GQA), False),
    "gemma3": (Architecture(mlp="geglu", qk_norm=True, post_norms=True, norm_plus_one=True, embed_scale=True,
                            **_GQA), False),
}
"""Each family's architecture and whether its q/k/v projections carry biases (``FamilyConfig.qkv_bias``)."""


@dataclasses.dataclass(frozen=True)
class FamilyConfig(RotaryFields, RunFields, ExpertFields):
    family: str = "qwen3"          # a key of FAMILIES: the architecture (norms, activation, biases, scales)
    vocab_size: int = 256          # tokens; padded to vocab_multiple
    num_layers: int = 4            # N blocks, stacked on a leading "layers" axis
    num_heads: int = 4             # H query heads
    num_kv_heads: int = 0          # G key/value heads (divides num_heads); 0 means num_heads
    d_model: int = 128             # D model width
    d_mlp: int = 0                 # F gated-MLP width; 0 means 8 * d_model / 3 rounded up to a multiple of 64
    head_dim: int = 0              # K; 0 means d_model // num_heads (Qwen3 and Gemma 3 set their own)
    max_seq_len: int = 128         # longest sequence (HF: max_position_embeddings)
    rope_theta: float = 10000.0    # rotary base of the global layers (every layer without local_rope_theta)
    rope_factor: float = 1.0       # global layers' positions divided by this (HF rope_type "linear"; Gemma 3 4B+: 8)
    local_rope_theta: float | None = None   # rotary base of the windowed layers (Gemma 3: 10000); None: rope_theta
    windows: Any = ()              # sliding window per layer (None: global), one per layer; () all global; an int:
                                   # every layer (Mistral). Keys j visible from query i iff 0 <= i - j < window
    query_pre_attn_scalar: float | None = None   # attention logits q.k / sqrt(this) (Gemma 3); None: head_dim
    rms_norm_eps: float = 1e-6     # RMSNorm epsilon (HF: rms_norm_eps)
    tie_embeddings: bool = False   # logits = x @ embedding.T (HF: tie_word_embeddings)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"FamilyConfig.family={self.family!r}; use one of {list(FAMILIES)}")
        check_rotary_fields(self)
        object.__setattr__(self, "windows", _check_windows(self.windows, self.num_layers))
        for name in ("rope_factor", "local_rope_theta", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is None and name != "rope_factor":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
                raise ValueError(f"FamilyConfig.{name}={value!r} must be a positive finite number"
                                 + ("" if name == "rope_factor" else " or None"))

    def as_model(self, params: Any = None) -> "FamilyModel":
        return FamilyModel(self)

    # what the decoder base reads besides the fields (jaxpar.models.decoder)
    positions = "rotary"

    @property
    def architecture(self) -> Architecture:
        return FAMILIES[self.family][0]

    @property
    def qkv_bias(self) -> bool:
        return FAMILIES[self.family][1]

    def rotary_freq(self) -> np.ndarray:
        """The global layers' ``head_dim // 2`` rotary inverse frequencies (float32): ``rope_theta``'s divided by
        ``rope_factor`` (linear position interpolation, Chen et al. 2023)."""
        return (rotary_inv_freq(self.rope_base, self.head_dim) / self.rope_factor).astype(np.float32)

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """One :class:`jaxpar.models.blocks.LayerKind` per layer: its window, and for a windowed layer with
        ``local_rope_theta`` set, that base's frequencies (unscaled, as Gemma 3's local layers)."""
        windows = self.windows or (None,) * self.num_layers
        local = None if self.local_rope_theta is None else tuple(
            float(f) for f in rotary_inv_freq(float(self.local_rope_theta), self.head_dim).astype(np.float32))
        return tuple(LayerKind(w, local if w is not None else None) for w in windows)

    def num_params(self, embeddings: bool = True, active: bool = False) -> int:
        """Parameters (embeddings included unless ``embeddings=False``): every expert of a mixture of experts, or
        (``active``) the ``k`` routed experts a token runs (:func:`jaxpar.models.moe_block.mlp_params`)."""
        D, N, H, G, K = self.d_model, self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim
        a = self.architecture
        norms = (4 if a.post_norms else 2) * D + (2 * K if a.qk_norm else 0)
        block = (D * H * K + 2 * D * G * K + H * K * D + moe_block.mlp_params(self, active) + norms
                 + ((H + 2 * G) * K if self.qkv_bias else 0))
        head = D + (0 if self.tie_embeddings else D * self.padded_vocab)
        return N * block + head + (self.padded_vocab * D if embeddings else 0)

    def active_params(self, embeddings: bool = True) -> int:
        """The parameters one token runs through: :meth:`num_params` with ``k`` routed experts of ``E``."""
        return self.num_params(embeddings, active=True)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * (active non-embedding params + unembedding) + 12 * N * L_eff * H * K
        (attention; Kaplan et al. 2020, sec. 2.1), ``L_eff`` a layer's mean keys per query: ``(L + 1) / 2`` causal,
        at most ``window`` windowed, times 2 as Kaplan's full-sequence count."""
        dense = self.active_params(embeddings=False) + (self.padded_vocab * self.d_model if self.tie_embeddings else 0)
        L = seq_len
        keys = [L if k.window is None or k.window >= L else 2 * (k.window - (k.window - 1) * k.window / (2 * L))
                for k in self.layer_kinds()]
        return 6.0 * dense + 12.0 * sum(keys) * self.num_heads * self.head_dim


def _check_windows(windows: Any, num_layers: int) -> tuple:
    """``windows`` as a tuple of ``num_layers`` entries (an int: every layer's; ``()``: all global)."""
    if windows is None or (isinstance(windows, (tuple, list)) and len(windows) == 0):
        return ()
    if isinstance(windows, (int, np.integer)) and not isinstance(windows, bool):
        windows = (int(windows),) * num_layers
    if not isinstance(windows, (tuple, list)) or len(windows) != num_layers:
        raise ValueError(f"FamilyConfig.windows={windows!r} must be one entry per layer ({num_layers}: None for a "
                         "global layer, a positive int for a sliding window), an int for every layer, or ()")
    out = []
    for i, w in enumerate(windows):
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1):
            raise ValueError(f"FamilyConfig.windows[{i}]={w!r} must be None (global attention) or a positive int")
        out.append(None if w is None else int(w))
    return () if all(w is None for w in out) else tuple(out)


def qwen2(**fields: Any) -> FamilyConfig:
    """A Qwen2 / Qwen2.5 config (``Qwen2ForCausalLM``): rope_theta 1e6 unless given; q/k/v biases."""
    return FamilyConfig(**{"rope_theta": 1e6, **fields, "family": "qwen2"})


def qwen3(**fields: Any) -> FamilyConfig:
    """A Qwen3 dense config (``Qwen3ForCausalLM``): rope_theta 1e6 unless given; q/k norms."""
    return FamilyConfig(**{"rope_theta": 1e6, **fields, "family": "qwen3"})


def mistral(sliding_window: int | None = None, **fields: Any) -> FamilyConfig:
    """A Mistral config (``MistralForCausalLM``): ``sliding_window`` on every layer (None: a Llama's attention)."""
    return FamilyConfig(**{**fields, "family": "mistral", "windows": sliding_window or ()})


def gemma3(sliding_window: int = 1024, pattern: int = 6, **fields: Any) -> FamilyConfig:
    """A Gemma 3 text config (``Gemma3ForCausalLM``): layer ``i`` is global when ``(i + 1) % pattern == 0``, else
    local with ``sliding_window`` (pass ``windows`` to give each layer's); rope_theta 1e6 (global) and 1e4
    (local), head_dim 256 and query_pre_attn_scalar 256 unless given; tied embeddings."""
    n = fields.get("num_layers", FamilyConfig.num_layers)
    windows = tuple(None if (i + 1) % pattern == 0 else sliding_window for i in range(n))
    defaults = {"rope_theta": 1e6, "local_rope_theta": 1e4, "head_dim": 256, "query_pre_attn_scalar": 256,
                "tie_embeddings": True, "windows": windows}
    return FamilyConfig(**{**defaults, **fields, "family": "gemma3"})


class FamilyModel(Decoder):
    """A :class:`FamilyConfig`'s model, as pure functions over ``{"embed", "blocks", "head"}``: every part of the
    model protocol (:mod:`jaxpar.protocol`), from :class:`jaxpar.models.decoder.Decoder`. Params as the Llama's
    (:mod:`jaxpar.models.llama`) plus the family's: ``q_bias``, ``k_bias``, ``v_bias`` (Qwen2), ``q_norm_scale``,
    ``k_norm_scale`` (Qwen3, Gemma 3), ``attn_post_norm_scale``, ``mlp_post_norm_scale`` (Gemma 3). With ``moe``
    (Mixtral is ``"mistral"`` with it, Qwen3-MoE ``"qwen3"``): the router, the experts and the router's carried
    state instead of ``gate``/``up``/``down`` (:mod:`jaxpar.models.moe_block`)."""

    def replace(self, sizes: dict[tuple, int]) -> FamilyConfig:
        """The config after compaction (:func:`jaxpar.models.decoder.compact_grouped`; ``q_bias`` is compacted with
        its heads by its logical name, the q/k norms are shared by every head and kept whole).

        Raises:
          ValueError: a group other than ``blocks/mlp`` or ``blocks/heads``; a head count that is not a multiple
            of ``num_kv_heads``.
        """
        return compact_grouped(self.cfg, sizes, self.cfg.family)


__all__ = ["FAMILIES", "FamilyConfig", "FamilyModel", "gemma3", "mistral", "qwen2", "qwen3"]
