"""A Llama-family decoder (Touvron et al. 2023; Grattafiori et al. 2024) on the GPT's code, with logical axis names.

Shape legend as :mod:`jaxpar.models.gpt`, plus G key/value heads (``num_kv_heads``; H query heads share each).

Blocks are pre-norm with RMSNorm (Zhang & Sennrich 2019), grouped-query attention (Ainslie et al. 2023) with
rotary positions (Su et al. 2021; the half-rotation layout of Hugging Face's ``LlamaForCausalLM``, whose
``q_proj``/``k_proj`` rows are already permuted for it) and Llama 3's frequency scaling, and a SwiGLU MLP
(Shazeer 2020): ``down(silu(gate(h)) * up(h))``. No biases. The embedding, the attention kernels, the
pipeline parts (``embed``/``stage``/``head_loss``), ``scan_layers``, remat, the loss and the checks are the
GPT's (:class:`jaxpar.models.GPT`): :class:`Llama` swaps in its own Linen block and head only.

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
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.precision import fp8
from jaxpar._validate import nonnegative_int, positive_int
from jaxpar.models import gpt
from jaxpar.layers.attention import STRATEGIES
from jaxpar.models.gpt import _REMAT, ATTENTION, _param
from jaxpar.layers.norms import rms_norm, silu
from jaxpar.layers.rotary import rope
from jaxpar.layers.per_token import token_names, tokens
from jaxpar.precision.policy import is_floating_dtype
from jaxpar.sharding.rules import constrain

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
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
    scan_layers: bool = False
    remat: str = "none"            # "none", "full" or "dots"
    attention: str = "blocked"     # as GPTConfig.attention
    attention_blocks: int = 2
    context_attention: str = "ring"  # as GPTConfig.context_attention
    dtype: Any = None              # compute dtype (None: the params')
    param_dtype: Any = None        # None: float32
    output_dtype: Any = None       # logits dtype (None: compute dtype)
    vocab_multiple: int = 128
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "num_heads", "d_model", "max_seq_len", "vocab_multiple",
                     "attention_blocks"):
            object.__setattr__(self, name, positive_int(f"LlamaConfig.{name}", getattr(self, name)))
        for name, zero in (("num_kv_heads", "num_heads"), ("head_dim", "d_model // num_heads"),
                           ("d_mlp", "8 * d_model / 3 rounded up to 64")):
            object.__setattr__(self, name, nonnegative_int(f"LlamaConfig.{name}", getattr(self, name),
                                                           f" (0 means {zero})"))
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                             "(each key/value head serves num_heads // num_kv_heads query heads)")
        if self.head_dim == 0:
            if self.d_model % self.num_heads:
                raise ValueError(f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}; "
                                 "set head_dim explicitly or change num_heads")
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim}")
        if self.d_mlp == 0:
            object.__setattr__(self, "d_mlp", -(-(8 * self.d_model) // (3 * 64)) * 64)
        for name in ("dtype", "param_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not is_floating_dtype(value):
                raise ValueError(f"LlamaConfig.{name}={value!r} must be a floating dtype (float32, bfloat16, float16)")
        for name in ("init_std", "rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"LlamaConfig.{name}={value!r} must be a positive finite number")
        for name in ("tie_embeddings", "scan_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LlamaConfig.{name}={getattr(self, name)!r} must be True or False")
        if self.remat not in _REMAT:
            raise ValueError(f"remat={self.remat!r}; use one of {sorted(_REMAT)}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r}; use one of {list(ATTENTION)}")
        if self.context_attention not in STRATEGIES:
            raise ValueError(f"context_attention={self.context_attention!r}; use one of {list(STRATEGIES)}")
        object.__setattr__(self, "rope_scaling", _check_rope_scaling(self.rope_scaling))

    def as_model(self, params: Any = None) -> "Llama":
        return Llama(self)

    # the names the GPT's shared code reads
    positions = "rotary"

    @property
    def rope_base(self) -> float:
        return float(self.rope_theta)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads

    @property
    def mlp_dim(self) -> int:
        return self.d_mlp

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def num_params(self, embeddings: bool = True) -> int:
        D, F, N, H, G, K = (self.d_model, self.d_mlp, self.num_layers, self.num_heads, self.num_kv_heads,
                            self.head_dim)
        block = D * H * K + 2 * D * G * K + H * K * D + 3 * D * F + 2 * D
        head = D + (0 if self.tie_embeddings else D * self.padded_vocab)
        return N * block + head + (self.padded_vocab * D if embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * (non-embedding params + unembedding) + 12 * N * L * H * K (attention;
        Kaplan et al. 2020, sec. 2.1)."""
        dense = self.num_params(embeddings=False) + (self.padded_vocab * self.d_model if self.tie_embeddings else 0)
        return 6.0 * dense + 12.0 * self.num_layers * seq_len * self.num_heads * self.head_dim

    def inv_freq(self) -> np.ndarray:
        """The ``head_dim // 2`` rotary inverse frequencies (float64 numpy): ``rope_theta ** (-2 i / head_dim)``,
        with Llama 3's scaling when ``rope_scaling`` is set (Grattafiori et al. 2024, sec. 4.3; HF's
        ``_compute_llama3_parameters``): wavelengths longer than ``original_max_position_embeddings /
        low_freq_factor`` are divided by ``factor``, shorter than ``... / high_freq_factor`` kept, and those between
        interpolated linearly in ``original_max_position_embeddings / wavelength``."""
        half = self.head_dim // 2
        inv = self.rope_base ** (-np.arange(0, 2 * half, 2, dtype=np.float64) / self.head_dim)
        if self.rope_scaling is None:
            return inv
        s = dict(self.rope_scaling)
        factor, low, high, old = (float(s[k]) for k in _LLAMA3_KEYS)
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = np.where(wavelen > old / low, inv / factor, inv)
        between = (wavelen <= old / low) & (wavelen >= old / high)
        return np.where(between, mid, out)


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


_WARNED: set = set()


def _warn_replicated_kv(cfg: LlamaConfig) -> None:
    mesh = jax.sharding.get_abstract_mesh()
    tensor = 1 if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes)).get("tensor", 1)
    # Flax takes the first rule naming an axis (DEFAULT_RULES has ("kv_heads", None): a later one is never read)
    rule = next((axis for name, axis in nn.get_logical_axis_rules() if name == "kv_heads"), None)
    if tensor == 1 or rule is not None or (cfg, tensor) in _WARNED:
        return
    _WARNED.add((cfg, tensor))
    why = (f"tensor={tensor} exceeds num_kv_heads={cfg.num_kv_heads}" if tensor > cfg.num_kv_heads else
           "the rules leave kv_heads unmapped; rules whose first kv_heads entry is ('kv_heads', 'tensor'), given "
           "to init_state and make_train_step, split them: e.g. (('kv_heads', 'tensor'),) + jp.sharding.DEFAULT_RULES")
    warnings.warn(f"the Llama's {cfg.num_kv_heads} key/value heads are replicated over the tensor axis ({why}): "
                  f"every tensor shard computes all of them, the {cfg.num_heads} query heads are split (correct, "
                  "some duplicated work)", stacklevel=3)


class LlamaBlock(gpt.Block):
    """One pre-norm Llama block ``x_BLD -> x_BLD`` (Megatron split: q/k/v, gate/up by column; out/down by row)."""

    def setup(self):
        c = self.cfg
        D, H, G, K, F = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.d_mlp
        out_std = c.init_std / math.sqrt(2 * c.num_layers)
        self.attn_norm_scale = _param(self, "attn_norm_scale", (D,), ("embed",), None)
        self.q_kernel = _param(self, "q_kernel", (D, H, K), ("embed", "heads", "kv"), c.init_std)
        self.k_kernel = _param(self, "k_kernel", (D, G, K), ("embed", "kv_heads", "kv"), c.init_std)
        self.v_kernel = _param(self, "v_kernel", (D, G, K), ("embed", "kv_heads", "kv"), c.init_std)
        self.out_kernel = _param(self, "out_kernel", (H, K, D), ("heads", "kv", "embed"), out_std)
        self.mlp_norm_scale = _param(self, "mlp_norm_scale", (D,), ("embed",), None)
        self.gate_kernel = _param(self, "gate_kernel", (D, F), ("embed", "mlp"), c.init_std)
        self.up_kernel = _param(self, "up_kernel", (D, F), ("embed", "mlp"), c.init_std)
        self.down_kernel = _param(self, "down_kernel", (F, D), ("mlp", "embed"), out_std)
        self.fp8_meta = fp8.declare(self, ("q", "k", "v", "out", "gate", "up", "down"))   # gpt.Block._dot's

    def declare(self) -> None:
        self.attn_norm_scale  # noqa: B018

    def _qkv(self, x_BLD: jax.Array):
        """RMSNorm, then ``q [B, L, H, K]``, ``k, v [B, L, G, K]`` (compute dtype)."""
        c = self.cfg
        B, L, D = x_BLD.shape
        h_TD = tokens(rms_norm(x_BLD, self.attn_norm_scale, c.rms_norm_eps))
        w = lambda p: self._w(p, x_BLD).reshape(D, -1)
        q = constrain(self._dot("q", h_TD, w(self.q_kernel)).reshape(B, L, c.num_heads, c.head_dim), "batch", "seq",
                      "heads", "kv")
        k, v = (self._dot(n, h_TD, w(p)).reshape(B, L, c.num_kv_heads, c.head_dim)
                for n, p in (("k", self.k_kernel), ("v", self.v_kernel)))
        return q, constrain(k, "batch", "seq", "kv_heads", "kv"), constrain(v, "batch", "seq", "kv_heads", "kv")

    def _positions(self, q_BLHK, k_BLGK, offset=0, positions_BL=None):
        freq = self.cfg.inv_freq().astype(np.float32)
        return rope(q_BLHK, 0.0, offset, freq, positions_BL), rope(k_BLGK, 0.0, offset, freq, positions_BL)

    def _expand_kv(self, t_BLGK: jax.Array) -> jax.Array:
        """``[B, L, G, K] -> [B, L, H, K]``: query head ``h`` reads key/value head ``h // (H // G)`` (HF's
        ``repeat_kv``)."""
        rep = self.cfg.num_heads // self.cfg.num_kv_heads
        t = t_BLGK if rep == 1 else jnp.repeat(t_BLGK, rep, axis=2)
        return constrain(t, "batch", "seq", "heads", "kv")

    def _finish(self, x_BLD: jax.Array, a_BLHK: jax.Array) -> jax.Array:
        c = self.cfg
        B, L, D = x_BLD.shape
        w = lambda p: self._w(p, x_BLD)
        o_TD = self._dot("out", tokens(a_BLHK), w(self.out_kernel).reshape(-1, D))
        x_BLD = constrain(x_BLD + o_TD.reshape(B, L, D), "batch", "seq", "embed")
        h_TD = tokens(rms_norm(x_BLD, self.mlp_norm_scale, c.rms_norm_eps))
        g_TF = constrain(silu(self._dot("gate", h_TD, w(self.gate_kernel))), *token_names(), "mlp")
        u_TF = constrain(g_TF * self._dot("up", h_TD, w(self.up_kernel)), *token_names(), "mlp")
        return constrain(x_BLD + self._dot("down", u_TF, w(self.down_kernel)).reshape(B, L, D), "batch", "seq", "embed")


class LlamaHead(gpt.Head):
    """Final RMSNorm and unembedding: ``x_BLD -> logits_BLV``."""

    def setup(self):
        c = self.cfg
        self.norm_scale = _param(self, "norm_scale", (c.d_model,), ("embed",), None)
        if not c.tie_embeddings:
            self.kernel = _param(self, "kernel", (c.d_model, c.padded_vocab), ("embed", "vocab"), c.init_std)

    def declare(self) -> None:
        self.norm_scale  # noqa: B018

    def _norm(self, x_BLD: jax.Array) -> jax.Array:
        return rms_norm(x_BLD, self.norm_scale, self.cfg.rms_norm_eps)


class Llama(gpt.GPT):
    """The Llama as pure functions over ``{"embed", "blocks", "head"}``: the GPT's protocol parts (``init``,
    ``embed``, ``stage``, ``head_loss``, ``apply``, ``loss``, ``check_batch``, ``init_cache``, ``decode_step``,
    ``generate``) with the Llama's block and head. ``init_cache`` keeps the G key/value heads:
    ``[layers, batch, max_len, num_kv_heads, head_dim]``."""
    Block, Head = LlamaBlock, LlamaHead

    def embed(self, params: dict, tokens_BL: jax.Array, positions_BL: jax.Array | None = None) -> jax.Array:
        """As :meth:`jaxpar.models.GPT.embed`; warns (once per config and mesh) when the key/value heads are
        replicated over a ``tensor`` axis of more than one device (the rules leave ``kv_heads`` unmapped).
        The Llama's positions are rotary: ``positions_BL`` is used by :meth:`stage`, not here."""
        _warn_replicated_kv(self.cfg)
        return super().embed(params, tokens_BL, positions_BL)

    def replace(self, sizes: dict[tuple, int]) -> LlamaConfig:
        """The config after compaction: ``sizes`` maps ``("blocks", "mlp")`` (the kept SwiGLU width: gate, up and down
        coupled) and ``("blocks", "heads")`` (the kept query heads, the same number in each key/value group, see
        :mod:`jaxpar.pruning.groups`) to the kept counts; ``num_kv_heads`` and ``head_dim`` are kept.

        Raises:
          ValueError: a group other than ``blocks/mlp`` or ``blocks/heads``; a head count that is not a multiple
            of ``num_kv_heads``.
        """
        bad = [k for k in sizes if tuple(k[:-1]) != ("blocks",) or k[-1] not in ("mlp", "heads")]
        if bad:
            raise ValueError(f"the Llama's prunable groups are blocks/mlp (gate, up and down coupled) and blocks/heads "
                             f"(query heads within their key/value group); got masks for {['/'.join(k) for k in bad]}")
        c = self.cfg
        heads, mlp = sizes.get(("blocks", "heads"), c.num_heads), sizes.get(("blocks", "mlp"), c.d_mlp)
        if heads % c.num_kv_heads:
            raise ValueError(f"a compacted Llama needs its query heads ({heads}) to be a multiple of num_kv_heads="
                             f"{c.num_kv_heads}: each key/value group keeps the same number of query heads")
        return dataclasses.replace(c, num_heads=heads, d_mlp=mlp, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
