"""The decoder's Linen modules: token embedding, one pre-norm block and the head, each shaped by the family's
:class:`Architecture` (:mod:`jaxpar.models.decoder` runs them as pure functions over one params tree).

Shape legend (suffixes in variable names): B batch, L sequence, D embed (``d_model``), H query heads, G key/value
heads, K head dim, F MLP width, V padded vocabulary, S cache slots, T tokens (``B * L`` rows).

Speed notes (measured, ``benchmarks/README.md``): matmul operands stay 2-D (``[B * L, D]``), which XLA:CPU's
backward handles much better than 3-D; LayerNorm and GELU are rematerialised inside :mod:`jaxpar.layers.norms`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.layers import attention as cp
from jaxpar.layers import sliding_window
from jaxpar.layers.attention import attend
from jaxpar.layers.norms import gelu, layer_norm, rms_norm, rms_norm_plus_one, silu
from jaxpar.layers.rotary import rope
from jaxpar.layers.per_token import token_names, tokens
from jaxpar.models import moe_block
from jaxpar.precision import fp8
from jaxpar.sharding.names import BATCH, EMBED, HEADS, KV, KV_HEADS, MLP, POSITION, SEQ, VOCAB
from jaxpar.sharding.rules import constrain


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What makes a decoder family: its attention variant, norms, MLP activation and projection biases. Positions
    (``cfg.positions``: learned or rotary, ``cfg.rotary_freq()`` for scaled frequencies), the tied head
    (``cfg.tie_embeddings``), biases on the q/k/v projections alone (``cfg.qkv_bias``) and what differs between
    layers (:func:`layer_kinds`: sliding windows, rotary bases) are config fields of their own.

    The parameter names follow from it (checkpoints, weight adapters and pruning read them): the norms are
    ``ln1``/``ln2``/``ln`` (LayerNorm: ``_scale`` and ``_bias``) or ``attn_norm``/``mlp_norm``/``norm`` (RMSNorm:
    ``_scale``) before attention, before the MLP and in the head; ``post_norms`` adds ``attn_post_norm`` and
    ``mlp_post_norm`` (after each, before its residual: Gemma 2 and 3); ``qk_norm`` adds ``q_norm_scale`` /
    ``k_norm_scale`` ``[K]``, an RMSNorm over each head of the queries and keys before rotary positions (Qwen3,
    Gemma 3; Dehghani et al. 2023, sec. 3.1.1). The switches after ``bias`` default off: the GPT and the Llama
    compute (and name their params) as before them.
    """
    attention: str = "mha"   # "mha": one fused [D, H, 3, K] q/k/v kernel (qkv_kernel; qkv_bias when cfg.qkv_bias);
                             # "gqa": q_kernel [D, H, K], k_kernel / v_kernel [D, G, K] with G = cfg.kv_heads
                             # (q_bias [H, K], k_bias / v_bias [G, K] when cfg.qkv_bias)
    norm: str = "layer"      # "layer": LayerNorm (scale and bias); "rms": RMSNorm (scale; epsilon cfg.norm_eps)
    mlp: str = "gelu"        # "gelu": down(gelu(up h)); "swiglu": down(silu(gate h) * up h) (Shazeer 2020);
                             # "geglu": down(gelu(gate h) * up h), gelu tanh-approximated (Shazeer 2020; Gemma)
    bias: bool = True        # biases on the out, gate, up and down projections
    qk_norm: bool = False    # RMSNorm of each query and key head before rotary positions (Qwen3, Gemma 3)
    post_norms: bool = False  # norms after attention and after the MLP too, before their residuals (Gemma 3)
    norm_plus_one: bool = False  # RMSNorm multiplies by (1 + scale), in float32, scales initialised at 0 (Gemma)
    embed_scale: bool = False    # embeddings times sqrt(d_model), rounded to the compute dtype first (Gemma)

    def __post_init__(self):
        for name, allowed in (("attention", ("mha", "gqa")), ("norm", ("layer", "rms")),
                              ("mlp", ("gelu", "swiglu", "geglu"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Architecture.{name}={getattr(self, name)!r}; use one of {list(allowed)}")
        for name in ("bias", "qk_norm", "post_norms", "norm_plus_one", "embed_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Architecture.{name}={getattr(self, name)!r} must be True or False")
        if self.norm == "layer" and (self.qk_norm or self.norm_plus_one):
            raise ValueError("Architecture: qk_norm and norm_plus_one are RMSNorm variants; set norm='rms'")

    @property
    def norm_names(self) -> tuple[str, str, str]:
        """The norms' name prefixes: before attention, before the MLP, in the head."""
        return ("ln1", "ln2", "ln") if self.norm == "layer" else ("attn_norm", "mlp_norm", "norm")

    @property
    def qkv_names(self) -> tuple[str, ...]:
        return ("qkv",) if self.attention == "mha" else ("q", "k", "v")

    @property
    def mlp_names(self) -> tuple[str, ...]:
        return ("up", "down") if self.mlp == "gelu" else ("gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What may differ between the layers of one decoder (static: each kind is its own compiled block).

    ``window``: sliding-window attention, keys ``j`` visible from query ``i`` iff ``0 <= i - j < window``
    (Beltagy et al. 2020; Hugging Face's semantics); None: all earlier keys. ``inv_freq``: this layer's ``K // 2``
    rotary inverse frequencies (None: ``cfg.rotary_freq()``'s, e.g. Gemma 3's local layers have their own base).
    """
    window: int | None = None
    inv_freq: tuple[float, ...] | None = None


def layer_kinds(cfg: Any) -> tuple[LayerKind, ...]:
    """One :class:`LayerKind` per layer: ``cfg.layer_kinds()`` where the config defines it, else all the default
    (the GPT and the Llama: every layer the same)."""
    kinds = getattr(cfg, "layer_kinds", None)
    return tuple(kinds()) if kinds is not None else (LayerKind(),) * cfg.num_layers


def kv_heads(cfg: Any) -> int:
    """The key/value heads a block computes and a cache keeps: ``cfg.kv_heads`` under grouped-query attention,
    else one per query head."""
    return cfg.kv_heads if cfg.architecture.attention == "gqa" else cfg.num_heads


def _param(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple, std: float | None):
    # a norm's scale starts at the identity: 1, or 0 where the norm multiplies by (1 + scale)
    ones = name.endswith("scale") and not module.cfg.architecture.norm_plus_one
    init = nn.initializers.normal(std) if std is not None else (nn.initializers.ones if ones else nn.initializers.zeros)
    return module.param(name, nn.with_logical_partitioning(init, names), shape,
                        jnp.float32 if module.cfg.param_dtype is None else module.cfg.param_dtype)


def compute_dtype(cfg: Any, like: jax.Array) -> Any:
    """The configured compute dtype, or (None) the dtype of ``like``: params already cast by the policy."""
    return cfg.dtype if cfg.dtype is not None else like.dtype


def _norm_params(module: nn.Module, prefix: str) -> dict:
    D = module.cfg.d_model
    out = {"scale": _param(module, f"{prefix}_scale", (D,), (EMBED,), None)}
    if module.cfg.architecture.norm == "layer":
        out["bias"] = _param(module, f"{prefix}_bias", (D,), (EMBED,), None)
    return out


def _normalize(cfg: Any, x_BLD: jax.Array, p: dict) -> jax.Array:
    """The architecture's norm over the last axis of ``x`` (any leading shape)."""
    if cfg.architecture.norm == "layer":
        return layer_norm(x_BLD, p["scale"], p["bias"])
    if cfg.architecture.norm_plus_one:
        return rms_norm_plus_one(x_BLD, p["scale"], cfg.norm_eps)
    return rms_norm(x_BLD, p["scale"], cfg.norm_eps)


class Embed(nn.Module):
    """Token (and learned position) embedding: ``tokens_BL -> x_BLD``."""
    cfg: Any

    def setup(self):
        c = self.cfg
        self.embedding = _param(self, "embedding", (c.padded_vocab, c.d_model), (VOCAB, EMBED), c.init_std)
        if c.positions == "learned":
            self.pos_embedding = _param(self, "pos_embedding", (c.max_seq_len, c.d_model), (POSITION, EMBED),
                                        c.init_std / 2)

    def __call__(self, tokens_BL: jax.Array, offset: jax.Array | int = 0,
                 positions_BL: jax.Array | None = None) -> jax.Array:
        """``offset``: the position of ``tokens_BL[:, 0]`` (a decode step's; 0 for a whole sequence), an int32 scalar
        or ``[B]`` (one per row); ``positions_BL`` (int ``[B, L]``, packed documents): each token's own position
        instead (one out of ``[0, max_seq_len)`` gives NaN: ``jnp.take``'s fill)."""
        c = self.cfg
        dtype = compute_dtype(c, self.embedding)
        # Gather the FSDP-sharded model dim of the table first (as FSDP does for every weight), so the lookup
        # is a vocab-parallel gather whose output can take the batch sharding directly.
        table_VD = constrain(self.embedding.astype(dtype), VOCAB, None)
        x_BLD = jnp.take(table_VD, tokens_BL, axis=0)
        if c.architecture.embed_scale:   # the factor rounded to the compute dtype first, as Gemma's embedding does
            x_BLD = x_BLD * jnp.asarray(math.sqrt(c.d_model), dtype)
        if c.positions == "learned":
            L = tokens_BL.shape[1]
            if positions_BL is not None:
                # a negative index would wrap to the table's end: send it out of range, so it fills NaN too
                safe_BL = jnp.where(positions_BL < 0, c.max_seq_len, positions_BL)
                pos_BLD = jnp.take(self.pos_embedding, safe_BL, axis=0, mode="fill", fill_value=jnp.nan)
            elif isinstance(offset, int) and offset == 0:   # a context axis: the slots' own positions
                zz = cp.positions(L)
                pos_BLD = (self.pos_embedding[:L] if zz is None else jnp.take(self.pos_embedding, zz, axis=0))[None]
            else:   # per-row offsets (left-padded prompts): padding slots' negative positions clip to 0
                pos_BL = jnp.clip(jnp.reshape(offset, (-1, 1)) + jnp.arange(L), 0, c.max_seq_len - 1)
                pos_BLD = jnp.take(self.pos_embedding, pos_BL, axis=0)
            x_BLD = x_BLD + pos_BLD.astype(dtype)
        return constrain(x_BLD, BATCH, SEQ, EMBED)


class Block(nn.Module):
    """One pre-norm block ``x_BLD -> x_BLD`` (Megatron split: q/k/v, gate/up by column; out/down by row).

    Params are declared in one order for every family (norm, attention, out, norm, MLP, then the optional q/k
    biases, q/k norms and post-norms), which fixes each one's initialisation key. ``kind``: what this layer does
    differently (:class:`LayerKind`: its sliding window, its rotary frequencies); it holds no params, so every
    kind's params have the same tree."""
    cfg: Any
    kind: LayerKind = LayerKind()

    def setup(self):
        c, a = self.cfg, self.cfg.architecture
        D, H, G, K, F = c.d_model, c.num_heads, kv_heads(c), c.head_dim, c.mlp_dim
        out_std = c.init_std / math.sqrt(2 * c.num_layers)
        norm1, norm2, _ = a.norm_names
        self.norm1 = _norm_params(self, norm1)
        if a.attention == "mha":
            w = {"qkv": _param(self, "qkv_kernel", (D, H, 3, K), (EMBED, HEADS, None, KV), c.init_std)}
            if c.qkv_bias:
                w["qkv_bias"] = _param(self, "qkv_bias", (H, 3, K), (HEADS, None, KV), None)
        else:
            w = {"q": _param(self, "q_kernel", (D, H, K), (EMBED, HEADS, KV), c.init_std),
                 "k": _param(self, "k_kernel", (D, G, K), (EMBED, KV_HEADS, KV), c.init_std),
                 "v": _param(self, "v_kernel", (D, G, K), (EMBED, KV_HEADS, KV), c.init_std)}
        w["out"] = _param(self, "out_kernel", (H, K, D), (HEADS, KV, EMBED), out_std)
        if a.bias:
            w["out_bias"] = _param(self, "out_bias", (D,), (EMBED,), None)
        self.norm2 = _norm_params(self, norm2)
        shapes = {"gate": ((D, F), (EMBED, MLP), (F,), (MLP,), c.init_std),
                  "up": ((D, F), (EMBED, MLP), (F,), (MLP,), c.init_std),
                  "down": ((F, D), (MLP, EMBED), (D,), (EMBED,), out_std)}
        self.moe = moe_block.moe_of(c)
        for name in a.mlp_names if self.moe is None else ():
            shape, names, bias_shape, bias_names, std = shapes[name]
            w[name] = _param(self, f"{name}_kernel", shape, names, std)
            if a.bias:
                w[f"{name}_bias"] = _param(self, f"{name}_bias", bias_shape, bias_names, None)
        if a.attention == "gqa" and c.qkv_bias:   # biases on q, k, v alone (Qwen2)
            w["q_bias"] = _param(self, "q_bias", (H, K), (HEADS, KV), None)
            w["k_bias"] = _param(self, "k_bias", (G, K), (KV_HEADS, KV), None)
            w["v_bias"] = _param(self, "v_bias", (G, K), (KV_HEADS, KV), None)
        if a.qk_norm:   # one [K] scale shared by every head: pruning a head leaves it whole
            self.qk_norm = {t: {"scale": _param(self, f"{t}_norm_scale", (K,), (KV,), None)} for t in ("q", "k")}
        if a.post_norms:
            self.post_norms = (_norm_params(self, "attn_post_norm"), _norm_params(self, "mlp_post_norm"))
        if self.moe is not None:   # experts in the MLP's place (jaxpar.models.moe_block), their matmuls unscaled
            self.moe_weights, self.moe_router = moe_block.declare(self, _param, out_std)
        self.weights = w
        self.fp8_meta = fp8.declare(self, a.qkv_names + ("out",) + (a.mlp_names if self.moe is None else ()))

    def declare(self) -> None:
        """Creates the parameters without running the block (used by ``init``)."""
        self.weights  # noqa: B018  (touching an attribute runs setup, which declares every param)

    def _dot(self, name: str, x_TD: jax.Array, w_DF: jax.Array) -> jax.Array:   # x_TD @ w_DF (fp8: jaxpar.precision.fp8)
        return fp8.matmul(x_TD, w_DF, None if self.fp8_meta is None else self.fp8_meta[name])

    def _w(self, name: str, x: jax.Array) -> jax.Array:
        """A weight in the compute dtype (the configured one, or the activation ``x``'s)."""
        return self.weights[name].astype(compute_dtype(self.cfg, x))

    def _proj(self, name: str, x_TD: jax.Array, w_DF: jax.Array, x: jax.Array) -> jax.Array:
        """``x_TD @ w_DF`` plus the projection's bias where the architecture has one."""
        y = self._dot(name, x_TD, w_DF)
        return y + self._w(f"{name}_bias", x) if self.cfg.architecture.bias else y

    def _qkv(self, x_BLD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The first norm, then ``q [B, L, H, K]`` and ``k, v [B, L, G, K]`` (compute dtype)."""
        c = self.cfg
        B, L, D = x_BLD.shape
        H, K = c.num_heads, c.head_dim
        h_TD = tokens(_normalize(c, x_BLD, self.norm1))
        if c.architecture.attention == "mha":
            qkv_flat = self._dot("qkv", h_TD, self._w("qkv", x_BLD).reshape(D, H * 3 * K))
            if c.qkv_bias:
                qkv_flat = qkv_flat + self._w("qkv_bias", x_BLD).reshape(H * 3 * K)
            qkv = qkv_flat.reshape(B, L, H, 3, K)
            return tuple(constrain(qkv[:, :, :, i], BATCH, SEQ, HEADS, KV) for i in range(3))
        a = c.architecture

        def project(n: str, heads: int) -> jax.Array:
            t = self._dot(n, h_TD, self._w(n, x_BLD).reshape(D, -1))
            t = t + self._w(f"{n}_bias", x_BLD).reshape(-1) if c.qkv_bias else t
            t = t.reshape(B, L, heads, K)
            return _normalize(c, t, self.qk_norm[n]) if a.qk_norm and n != "v" else t
        q = project("q", H)
        scalar = getattr(c, "query_pre_attn_scalar", None)
        if scalar is not None and scalar != K:
            # logits q.k / sqrt(scalar) (Gemma) from every kernel's q.k / sqrt(K): scale the queries, not the kernels
            q = q * jnp.asarray(math.sqrt(K / scalar), q.dtype)
        k, v = project("k", c.kv_heads), project("v", c.kv_heads)
        q = constrain(q, BATCH, SEQ, HEADS, KV)
        return q, constrain(k, BATCH, SEQ, KV_HEADS, KV), constrain(v, BATCH, SEQ, KV_HEADS, KV)

    def _positions(self, q_BLHK: jax.Array, k_BLGK: jax.Array, offset: jax.Array | int = 0,
                   positions_BL: jax.Array | None = None):
        """Rotary positions on queries and keys (learned positions: unchanged); row 0 is position ``offset``, or
        each token is at ``positions_BL`` when given. ``cfg.rotary_freq()``: the inverse frequencies (None:
        ``rope_base``'s), or the layer's own (``kind.inv_freq``)."""
        c = self.cfg
        if c.positions != "rotary":
            return q_BLHK, k_BLGK
        freq = c.rotary_freq() if self.kind.inv_freq is None else np.asarray(self.kind.inv_freq, np.float32)
        return (rope(q_BLHK, c.rope_base, offset, freq, positions_BL),
                rope(k_BLGK, c.rope_base, offset, freq, positions_BL))

    def _expand_kv(self, t_BLGK: jax.Array) -> jax.Array:
        """Keys or values for every query head: ``[B, L, G, K] -> [B, L, H, K]``, query head ``h`` reading key/value
        head ``h // (H // G)`` (HF's ``repeat_kv``); multi-head attention has one per head already."""
        c = self.cfg
        if c.architecture.attention == "mha":
            return t_BLGK
        rep = c.num_heads // c.kv_heads
        t = t_BLGK if rep == 1 else jnp.repeat(t_BLGK, rep, axis=2)
        return constrain(t, BATCH, SEQ, HEADS, KV)

    def _finish(self, x_BLD: jax.Array, a_BLHK: jax.Array, decode: bool = False):
        """The attention output projection and residual, then the MLP and its residual: ``(x_BLD, stats)``, the
        router statistics of an MoE block (:class:`jaxpar.layers.moe.MoEStats`; None for a dense one); ``decode``:
        the experts run dropless (:func:`jaxpar.models.moe_block.mlp`)."""
        c = self.cfg
        B, L, D = x_BLD.shape
        a = c.architecture
        post = (lambda y_TD, i: _normalize(c, y_TD, self.post_norms[i])) if a.post_norms else (lambda y_TD, i: y_TD)
        o_TD = post(self._proj("out", tokens(a_BLHK), self._w("out", x_BLD).reshape(-1, D), x_BLD), 0)
        x_BLD = constrain(x_BLD + o_TD.reshape(B, L, D), BATCH, SEQ, EMBED)
        h_TD = tokens(_normalize(c, x_BLD, self.norm2))
        if self.moe is not None:
            m_TD, stats = moe_block.mlp(c, self.moe_weights, self.moe_router, h_TD, L, compute_dtype(c, x_BLD),
                                        decode)
            return constrain(x_BLD + post(m_TD, 1).reshape(B, L, D), BATCH, SEQ, EMBED), stats
        mlp = lambda u_TF: constrain(u_TF, *token_names(), MLP)
        if a.mlp == "gelu":
            u_TF = mlp(gelu(self._proj("up", h_TD, self._w("up", x_BLD), x_BLD)))
        else:
            act = silu if a.mlp == "swiglu" else gelu
            g_TF = mlp(act(self._proj("gate", h_TD, self._w("gate", x_BLD), x_BLD)))
            u_TF = mlp(g_TF * self._proj("up", h_TD, self._w("up", x_BLD), x_BLD))
        m_TD = post(self._proj("down", u_TF, self._w("down", x_BLD), x_BLD), 1)
        return constrain(x_BLD + m_TD.reshape(B, L, D), BATCH, SEQ, EMBED), None

    def __call__(self, x_BLD: jax.Array, segment_ids_BL: jax.Array | None = None,
                 positions_BL: jax.Array | None = None) -> jax.Array:
        """``x_BLD -> x_BLD``; packed documents: attention within each segment of ``segment_ids_BL``, rotary
        positions from ``positions_BL`` (both int ``[B, L]``, optional)."""
        return self.forward(x_BLD, segment_ids_BL, positions_BL)[0]

    def forward(self, x_BLD: jax.Array, segment_ids_BL: jax.Array | None = None,
                positions_BL: jax.Array | None = None):
        """``(x_BLD, stats)``: :meth:`__call__`'s output and an MoE block's router statistics (None: dense)."""
        q_BLHK, k_BLGK, v_BLGK = self._qkv(x_BLD)
        q_BLHK, k_BLGK = self._positions(q_BLHK, k_BLGK, positions_BL=positions_BL)
        a_BLHK = attend(self.cfg, q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, self._expand_kv, self.kind.window)
        a_BLHK = constrain(a_BLHK, BATCH, SEQ, HEADS, KV)
        return self._finish(x_BLD, a_BLHK)

    def decode(self, x_BLD: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, pos: jax.Array,
               start_B: jax.Array | None = None, window: int | None = None):
        """``L`` cache slots ``pos .. pos + L - 1`` of the block with a key/value cache of ``S`` slots:
        ``(x_BLD, k_BSGK, v_BSGK) -> (x_BLD, k_BSGK, v_BSGK)``, these slots' keys and values written.

        Row ``b``'s sequence starts at slot ``start_B[b]`` (int32 ``[B]``, default 0: left-padded prompts start
        later), so slot ``t`` is its position ``t - start_B[b]``, and a query at slot ``t`` attends to slots
        ``start_B[b] <= s <= t`` (float32 logits and softmax, as :func:`jaxpar.layers.attention.causal_attention`).
        ``L = 1`` is one decode step; ``L > 1`` at ``pos = 0`` is a prompt's prefill in one pass. The cache keeps
        the G key/value heads.

        ``window`` (the layer's sliding window, a positive int or None): a query at slot ``t`` also needs
        ``t - s < window``, and the cache may be a ring buffer of ``S < pos + L`` slots (at least ``window``;
        :func:`jaxpar.layers.sliding_window.cache_slots`) holding slot ``t`` at ``t % S``: the new queries meet the
        cached keys (:func:`~jaxpar.layers.sliding_window.slot_indices`) and their own, then the last ``S`` of
        theirs are written (:func:`~jaxpar.layers.sliding_window.ring_write`), so a prefill longer than the window
        sees every key it needs.
        """
        c = self.cfg
        B, L, _ = x_BLD.shape
        S = k_BSGK.shape[1]
        start_B = jnp.zeros((B,), jnp.int32) if start_B is None else start_B
        q_BLHK, k_BLGK, v_BLGK = self._qkv(x_BLD)
        q_BLHK, k_BLGK = self._positions(q_BLHK, k_BLGK, pos - start_B)
        slot_L = pos + jnp.arange(L)
        if window is None:   # slot t at t: the new keys written first, then every slot read
            k_BSGK = jax.lax.dynamic_update_slice_in_dim(k_BSGK, k_BLGK.astype(k_BSGK.dtype), pos, axis=1)
            v_BSGK = jax.lax.dynamic_update_slice_in_dim(v_BSGK, v_BLGK.astype(v_BSGK.dtype), pos, axis=1)
            keys, values, slot_S = k_BSGK, v_BSGK, jnp.arange(S)
        else:
            keys, values = (jnp.concatenate([cached, new.astype(cached.dtype)], axis=1)
                            for cached, new in ((k_BSGK, k_BLGK), (v_BSGK, v_BLGK)))
            slot_S = jnp.concatenate([sliding_window.slot_indices(pos, S), slot_L])
            k_BSGK, v_BSGK = (sliding_window.ring_write(cached, new, pos)
                              for cached, new in ((k_BSGK, k_BLGK), (v_BSGK, v_BLGK)))
        k_all, v_all = self._expand_kv(keys), self._expand_kv(values)
        s_BHLS = jnp.einsum("blhk,bshk->bhls", q_BLHK, k_all.astype(q_BLHK.dtype),
                            preferred_element_type=jnp.float32) * (1.0 / math.sqrt(c.head_dim))
        gap_LS = slot_L[:, None] - slot_S[None, :]
        visible_BLS = (gap_LS >= 0)[None] & (slot_S[None, None, :] >= start_B[:, None, None])
        if window is not None:
            visible_BLS = visible_BLS & (gap_LS < window)[None]
        p_BHLS = jax.nn.softmax(jnp.where(visible_BLS[:, None], s_BHLS, jnp.finfo(jnp.float32).min / 2), axis=-1)
        a_BLHK = jnp.einsum("bhls,bshk->blhk", p_BHLS.astype(v_all.dtype), v_all).astype(x_BLD.dtype)
        return self._finish(x_BLD, a_BLHK, decode=True)[0], k_BSGK, v_BSGK


class Head(nn.Module):
    """Final norm and unembedding: ``x_BLD -> logits_BLV`` (``output_dtype``)."""
    cfg: Any

    def setup(self):
        c = self.cfg
        self.norm = _norm_params(self, c.architecture.norm_names[2])
        if not c.tie_embeddings:
            self.kernel = _param(self, "kernel", (c.d_model, c.padded_vocab), (EMBED, VOCAB), c.init_std)

    def declare(self) -> None:
        """Creates the parameters without running the head (used by ``init``)."""
        self.norm  # noqa: B018

    def __call__(self, x_BLD: jax.Array, embedding_VD: jax.Array | None = None) -> jax.Array:
        c = self.cfg
        B, L, D = x_BLD.shape
        dtype = compute_dtype(c, x_BLD)
        h_TD = tokens(_normalize(c, x_BLD, self.norm))
        if c.tie_embeddings:
            logits_TV = h_TD @ embedding_VD.astype(dtype).T
        else:
            logits_TV = h_TD @ self.kernel.astype(dtype)
        out_dtype = dtype if c.output_dtype is None else c.output_dtype
        return constrain(logits_TV.reshape(B, L, -1).astype(out_dtype), BATCH, SEQ, VOCAB)
