"""A decoder-only GPT (Radford et al. 2019): the decoder base (:mod:`jaxpar.models.decoder`) configured with
multi-head attention (one fused q/k/v kernel, an optional q/k/v bias), pre-norm LayerNorm (Ba et al. 2016), a
GELU MLP with biases, learned or rotary positions (Su et al. 2021) and a tied or untied head.

Params ``{"embed": {"embedding" [V, D], "pos_embedding" [max_seq_len, D] (learned positions)}, "blocks":
{ln1_scale, ln1_bias, qkv_kernel [N, D, H, 3, K], qkv_bias (qkv_bias=True), out_kernel [N, H, K, D], out_bias,
ln2_scale, ln2_bias, up_kernel [N, D, F], up_bias, down_kernel [N, F, D], down_bias}, "head": {"ln_scale",
"ln_bias", "kernel" [D, V] unless tied}}`` (shape legend: :data:`jaxpar.protocol.SHAPE_LEGEND`).

Attention (``GPTConfig.attention``) is :func:`jaxpar.layers.attention.causal_attention` by default (einsums and a
float32 softmax in query blocks that skip the fully masked key blocks), or ``jax.nn.dot_product_attention`` with
``implementation="xla"`` or ``"cudnn"`` (flash attention on GPUs). Speed notes (measured,
``benchmarks/README.md``): LayerNorm and GELU are rematerialised; the block-skipping attention does
``(n + 1) / (2 n)`` of the attention work and avoids the ``[B, H, L, L]`` mask select of the XLA path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxpar._validate import nonnegative_int, positive_int
from jaxpar.models.blocks import Architecture
from jaxpar.models.decoder import Decoder, check_run_fields
from jaxpar.precision.policy import is_floating_dtype


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 103          # characters (or tokens) in the corpus; padded to vocab_multiple
    num_layers: int = 4            # N transformer blocks, stacked on a leading "layers" axis
    num_heads: int = 4             # H attention heads (divisible by the tensor axis)
    d_model: int = 128             # D model width
    d_mlp: int = 0                 # F MLP width; 0 means 4 * d_model
    head_dim: int = 0              # K per head; 0 means d_model // num_heads, resolved at construction (so
                                   # dataclasses.replace(cfg, num_heads=...) keeps the head size; pass 0 to re-derive)
    max_seq_len: int = 128         # longest sequence (learned position table size)
    positions: str = "learned"     # "learned" or "rotary"
    tie_embeddings: bool = True    # logits = x @ embedding.T when True, else a separate head kernel
    scan_layers: bool = False      # lax.scan over layers (fast compile at depth) or unrolled (fast on CPU)
    remat: str = "none"            # activation checkpointing per block: "none", "full" or "dots"
    attention: str = "blocked"     # "blocked": causal_attention below (any backend; skips the masked blocks);
                                   # "xla" or "cudnn": jax.nn.dot_product_attention(implementation=...)
                                   # ("cudnn": cuDNN flash attention, GPU only, float16/bfloat16 compute)
    attention_blocks: int = 2      # query blocks of "blocked" attention: the work is (n + 1) / (2 n) of full
    context_attention: str = "ring"  # with the sequence sharded over a context mesh axis: "ring" or "all_gather"
                                   # (jaxpar.layers.attention; the batch is put in the zigzag layout by loss and apply)
    dtype: Any = None              # compute dtype; None: the dtype of the params given (the step casts them
                                   # to the state's policy's compute dtype), passed to every layer explicitly
    param_dtype: Any = None        # dtype params are created in; None: float32 (init_state casts to the policy's)
    output_dtype: Any = None       # logits dtype; None: the compute dtype (the cross-entropy is always float32)
    vocab_multiple: int = 128      # pad the vocabulary to a multiple of this (mesh axes must divide it)
    init_std: float = 0.02         # std of weight initialisation (GPT-2)
    rope_base: float = 10000.0     # rotary base frequency
    qkv_bias: bool = False         # a bias on the q, k, v projections (GPT-2 has one: jaxpar.models.hf)

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "num_heads", "d_model", "max_seq_len", "vocab_multiple",
                     "attention_blocks"):
            object.__setattr__(self, name, positive_int(f"GPTConfig.{name}", getattr(self, name)))
        object.__setattr__(self, "head_dim", nonnegative_int("GPTConfig.head_dim", self.head_dim,
                                                             " (0 means d_model // num_heads)"))
        if self.head_dim == 0:
            if self.d_model % self.num_heads:
                raise ValueError(f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}; "
                                 "set head_dim explicitly or change num_heads")
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head dim, got {self.head_dim}")
        for name in ("dtype", "param_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not is_floating_dtype(value):
                raise ValueError(f"GPTConfig.{name}={value!r} must be a floating dtype (float32, bfloat16, float16)")
        for name in ("init_std", "rope_base"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"GPTConfig.{name}={value!r} must be a positive finite number")
        for name in ("tie_embeddings", "scan_layers", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} must be True or False")
        if self.positions not in ("learned", "rotary"):
            raise ValueError(f"positions={self.positions!r}; use 'learned' or 'rotary'")
        check_run_fields(self)
        object.__setattr__(self, "d_mlp", nonnegative_int("GPTConfig.d_mlp", self.d_mlp, " (0 means 4 * d_model)"))

    def as_model(self, params: Any = None) -> "GPT":
        """The model this config builds (the protocol's config -> model step)."""
        return GPT(self)

    # what the decoder base reads besides the fields (jaxpar.models.decoder)
    architecture = Architecture(attention="mha", norm="layer", mlp="gelu", bias=True)

    def rotary_freq(self) -> None:
        """None: rotary positions take ``rope_base``'s frequencies."""
        return None

    @property
    def mlp_dim(self) -> int:
        return self.d_mlp or 4 * self.d_model

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def num_params(self, embeddings: bool = True) -> int:
        D, F, N, HK = self.d_model, self.mlp_dim, self.num_layers, self.num_heads * self.head_dim
        block = 3 * D * HK + HK * D + D + 2 * D * F + F + D + 4 * D + (3 * HK if self.qkv_bias else 0)
        emb = self.padded_vocab * D + (self.max_seq_len * D if self.positions == "learned" else 0)
        head = 2 * D + (0 if self.tie_embeddings else D * self.padded_vocab)
        return N * block + head + (emb if embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * (non-embedding params + unembedding) + 12 * N * L * H * K for attention
        (Kaplan et al. 2020, sec. 2.1, with H * K = d_model; PaLM, Chowdhery et al. 2022, app. B)."""
        dense = self.num_params(embeddings=False) + self.padded_vocab * self.d_model
        return 6.0 * dense + 12.0 * self.num_layers * seq_len * self.num_heads * self.head_dim



class GPT(Decoder):
    """The GPT as pure functions over a params tree ``{"embed", "blocks", "head"}``: every part of the model
    protocol (:mod:`jaxpar.protocol`), from :class:`jaxpar.models.decoder.Decoder`.

    ``blocks`` leaves carry a leading ``layers`` axis of size ``num_layers``.
    """

    # ------------------------------------------------------------------ structured pruning (the protocol)
    def replace(self, sizes: dict[tuple, int]) -> GPTConfig:
        """The config after compaction: ``sizes`` maps ``("blocks", "heads")`` / ``("blocks", "mlp")`` to the kept
        counts; ``head_dim`` is kept (pruned heads are removed whole).

        Raises:
          ValueError: a group other than ``blocks/mlp`` or ``blocks/heads``.
        """
        bad = [k for k in sizes if tuple(k[:-1]) != ("blocks",) or k[-1] not in ("mlp", "heads")]
        if bad:
            raise ValueError(f"the GPT's prunable groups are blocks/mlp and blocks/heads; got masks for "
                             f"{['/'.join(k) for k in bad]}")
        heads, mlp = sizes.get(("blocks", "heads"), self.cfg.num_heads), sizes.get(("blocks", "mlp"), self.cfg.mlp_dim)
        return dataclasses.replace(self.cfg, num_heads=heads, d_mlp=mlp, head_dim=self.cfg.head_dim)
