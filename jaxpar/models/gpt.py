"""A decoder-only GPT (Radford et al. 2019) with logical axis names on every parameter and key activation.

Shape legend (suffixes in variable names): B batch, L sequence, D embed (``d_model``), H heads,
K head dim, F MLP width, V padded vocabulary, N layers.

The model is three pure functions over one params tree ``{"embed", "blocks", "head"}``, so a pipeline can
run the layer stack as stages:

* ``embed(params, tokens_BL) -> x_BLD``
* ``stage(blocks, x_BLD) -> x_BLD`` over any slice of the stacked ``[layers, ...]`` block params
* ``head_loss(params, x_BLD, targets_BL) -> (loss, aux)``

Blocks are pre-norm (LayerNorm, Ba et al. 2016) with causal multi-head attention and a GELU MLP; positions
are learned or rotary (Su et al. 2021). Attention (``GPTConfig.attention``) is :func:`causal_attention` by
default (einsums and a float32 softmax in query blocks that skip the fully masked key blocks), or
``jax.nn.dot_product_attention`` with ``implementation="xla"`` or ``"cudnn"`` (flash attention on GPUs).

Speed notes (measured, ``benchmarks/README.md``): LayerNorm and GELU are rematerialised (``jax.checkpoint``):
the backward pass saves their inputs only and recomputes them inside its own fused loops, which costs less
than writing and reading their float32 intermediates, and keeps bf16 residuals small. The block-skipping
attention does ``(n + 1) / (2 n)`` of the attention work and avoids the ``[B, H, L, L]`` mask select of the
XLA path. Matmul operands stay 2-D (``[B * L, D]``), which XLA:CPU's backward handles much better than 3-D.
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
from jaxpar.precision import fp8
from jaxpar._validate import nonnegative_int, positive_int
from jaxpar.models import generation
from jaxpar.layers.per_token import PACKED_KEYS, check_packed_entries, check_packed_shapes, token_names, tokens
from jaxpar.layers.losses import _nan_where_invalid, check_token_ids, cross_entropy
from jaxpar.layers.attention import attend as attention, causal_attention
from jaxpar.layers.norms import gelu, layer_norm
from jaxpar.layers.rotary import rope
from jaxpar.precision.policy import is_floating_dtype
from jaxpar.sharding.rules import constrain, has_explicit_axes

_REMAT = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
          "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
ATTENTION = ("blocked", "xla", "cudnn")


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
        if self.remat not in _REMAT:
            raise ValueError(f"remat={self.remat!r}; use one of {sorted(_REMAT)}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r}; use one of {list(ATTENTION)}")
        if self.context_attention not in cp.STRATEGIES:
            raise ValueError(f"context_attention={self.context_attention!r}; use one of {list(cp.STRATEGIES)}")
        object.__setattr__(self, "d_mlp", nonnegative_int("GPTConfig.d_mlp", self.d_mlp, " (0 means 4 * d_model)"))

    def as_model(self, params: Any = None) -> "GPT":
        """The model this config builds (the protocol's config -> model step)."""
        return GPT(self)

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


def _param(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple, std: float | None):
    init = nn.initializers.normal(std) if std is not None else (
        nn.initializers.ones if name.endswith("scale") else nn.initializers.zeros)
    return module.param(name, nn.with_logical_partitioning(init, names), shape,
                        jnp.float32 if module.cfg.param_dtype is None else module.cfg.param_dtype)


def _compute_dtype(cfg: GPTConfig, like: jax.Array) -> Any:
    """The configured compute dtype, or (None) the dtype of ``like``: params already cast by the policy."""
    return cfg.dtype if cfg.dtype is not None else like.dtype


class Embed(nn.Module):
    """Token (and learned position) embedding: ``tokens_BL -> x_BLD``."""
    cfg: GPTConfig

    def setup(self):
        c = self.cfg
        self.embedding = _param(self, "embedding", (c.padded_vocab, c.d_model), ("vocab", "embed"), c.init_std)
        if c.positions == "learned":
            self.pos_embedding = _param(self, "pos_embedding", (c.max_seq_len, c.d_model), ("position", "embed"),
                                        c.init_std / 2)

    def __call__(self, tokens_BL: jax.Array, offset: jax.Array | int = 0,
                 positions_BL: jax.Array | None = None) -> jax.Array:
        """``offset``: the position of ``tokens_BL[:, 0]`` (a decode step's; 0 for a whole sequence), an int32 scalar
        or ``[B]`` (one per row); ``positions_BL`` (int ``[B, L]``, packed documents): each token's own position
        instead (one out of ``[0, max_seq_len)`` gives NaN: ``jnp.take``'s fill)."""
        c = self.cfg
        dtype = _compute_dtype(c, self.embedding)
        # Gather the FSDP-sharded model dim of the table first (as FSDP does for every weight), so the lookup
        # is a vocab-parallel gather whose output can take the batch sharding directly.
        table_VD = constrain(self.embedding.astype(dtype), "vocab", None)
        x_BLD = jnp.take(table_VD, tokens_BL, axis=0)
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
        return constrain(x_BLD, "batch", "seq", "embed")


class Block(nn.Module):
    """One pre-norm transformer block ``x_BLD -> x_BLD`` (Megatron split: qkv/up by column, out/down by row)."""
    cfg: GPTConfig

    def setup(self):
        c = self.cfg
        D, H, K, F = c.d_model, c.num_heads, c.head_dim, c.mlp_dim
        out_std = c.init_std / math.sqrt(2 * c.num_layers)
        self.ln1_scale = _param(self, "ln1_scale", (D,), ("embed",), None)
        self.ln1_bias = _param(self, "ln1_bias", (D,), ("embed",), None)
        self.qkv_kernel = _param(self, "qkv_kernel", (D, H, 3, K), ("embed", "heads", None, "kv"), c.init_std)
        if c.qkv_bias:
            self.qkv_bias = _param(self, "qkv_bias", (H, 3, K), ("heads", None, "kv"), None)
        self.out_kernel = _param(self, "out_kernel", (H, K, D), ("heads", "kv", "embed"), out_std)
        self.out_bias = _param(self, "out_bias", (D,), ("embed",), None)
        self.ln2_scale = _param(self, "ln2_scale", (D,), ("embed",), None)
        self.ln2_bias = _param(self, "ln2_bias", (D,), ("embed",), None)
        self.up_kernel = _param(self, "up_kernel", (D, F), ("embed", "mlp"), c.init_std)
        self.up_bias = _param(self, "up_bias", (F,), ("mlp",), None)
        self.down_kernel = _param(self, "down_kernel", (F, D), ("mlp", "embed"), out_std)
        self.down_bias = _param(self, "down_bias", (D,), ("embed",), None)
        self.fp8_meta = fp8.declare(self, ("qkv", "out", "up", "down"))   # None unless the policy: dot=fp8

    def _dot(self, name: str, x_TD: jax.Array, w_DF: jax.Array) -> jax.Array:   # x_TD @ w_DF (fp8: jaxpar.precision.fp8)
        return fp8.matmul(x_TD, w_DF, None if self.fp8_meta is None else self.fp8_meta[name])

    def declare(self) -> None:
        """Creates the parameters without running the block (used by ``init``)."""
        self.ln1_scale  # noqa: B018  (touching an attribute runs setup, which declares every param)

    def _w(self, p: jax.Array, x: jax.Array) -> jax.Array:
        """A weight in the compute dtype (the configured one, or the activation ``x``'s)."""
        return p.astype(_compute_dtype(self.cfg, x))

    def _qkv(self, x_BLD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """LayerNorm, then the q, k, v projections ``[B, L, H, K]`` (compute dtype)."""
        c = self.cfg
        B, L, D = x_BLD.shape
        H, K = c.num_heads, c.head_dim
        # Matmul operands are kept 2-D ([B*L, D]): XLA:CPU is much faster on them than on 3-D operands.
        h_TD = tokens(layer_norm(x_BLD, self.ln1_scale, self.ln1_bias))
        qkv_flat = self._dot("qkv", h_TD, self._w(self.qkv_kernel, x_BLD).reshape(D, H * 3 * K))
        if c.qkv_bias:
            qkv_flat = qkv_flat + self._w(self.qkv_bias, x_BLD).reshape(H * 3 * K)
        qkv = qkv_flat.reshape(B, L, H, 3, K)
        return tuple(constrain(qkv[:, :, :, i], "batch", "seq", "heads", "kv") for i in range(3))

    def _finish(self, x_BLD: jax.Array, a_BLHK: jax.Array) -> jax.Array:
        """The attention output projection and residual, then the MLP and its residual: ``x_BLD -> x_BLD``."""
        c = self.cfg
        B, L, D = x_BLD.shape
        H, K = c.num_heads, c.head_dim
        w = lambda p: self._w(p, x_BLD)
        o_TD = self._dot("out", tokens(a_BLHK), w(self.out_kernel).reshape(H * K, D)) + w(self.out_bias)
        x_BLD = constrain(x_BLD + o_TD.reshape(B, L, D), "batch", "seq", "embed")
        h_TD = tokens(layer_norm(x_BLD, self.ln2_scale, self.ln2_bias))
        u_TF = constrain(gelu(self._dot("up", h_TD, w(self.up_kernel)) + w(self.up_bias)), *token_names(), "mlp")
        m_TD = self._dot("down", u_TF, w(self.down_kernel)) + w(self.down_bias)
        return constrain(x_BLD + m_TD.reshape(B, L, D), "batch", "seq", "embed")

    def _positions(self, q_BLHK: jax.Array, k_BLGK: jax.Array, offset: jax.Array | int = 0,
                   positions_BL: jax.Array | None = None):
        """Rotary positions on queries and keys (learned positions: unchanged); row 0 is position ``offset``, or
        each token is at ``positions_BL`` when given."""
        c = self.cfg
        if c.positions != "rotary":
            return q_BLHK, k_BLGK
        return rope(q_BLHK, c.rope_base, offset, positions_BL=positions_BL), rope(k_BLGK, c.rope_base, offset,
                                                                                   positions_BL=positions_BL)

    def _expand_kv(self, t_BLGK: jax.Array) -> jax.Array:
        """Keys or values for every query head (the GPT has one per head; grouped-query models repeat them)."""
        return t_BLGK

    def __call__(self, x_BLD: jax.Array, segment_ids_BL: jax.Array | None = None,
                 positions_BL: jax.Array | None = None) -> jax.Array:
        """``x_BLD -> x_BLD``; packed documents: attention within each segment of ``segment_ids_BL``, rotary
        positions from ``positions_BL`` (both int ``[B, L]``, optional)."""
        c = self.cfg
        q_BLHK, k_BLHK, v_BLHK = self._qkv(x_BLD)
        q_BLHK, k_BLHK = self._positions(q_BLHK, k_BLHK, positions_BL=positions_BL)
        a_BLHK = attention(c, q_BLHK, k_BLHK, v_BLHK, segment_ids_BL, self._expand_kv)
        a_BLHK = constrain(a_BLHK, "batch", "seq", "heads", "kv")
        return self._finish(x_BLD, a_BLHK)

    def decode(self, x_BLD: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, pos: jax.Array,
               start_B: jax.Array | None = None):
        """``L`` cache slots ``pos .. pos + L - 1`` of the block with a key/value cache of ``S`` slots:
        ``(x_BLD, k_BSGK, v_BSGK) -> (x_BLD, k_BSGK, v_BSGK)``, these slots' keys and values written.

        Row ``b``'s sequence starts at slot ``start_B[b]`` (int32 ``[B]``, default 0: left-padded prompts start
        later), so slot ``t`` is its position ``t - start_B[b]``, and a query at slot ``t`` attends to slots
        ``start_B[b] <= s <= t`` (float32 logits and softmax, as :func:`causal_attention`). ``L = 1`` is one decode
        step; ``L > 1`` at ``pos = 0`` is a prompt's prefill in one pass. The cache keeps the key/value heads
        (G; the GPT has one per query head).
        """
        c = self.cfg
        B, L, _ = x_BLD.shape
        S = k_BSGK.shape[1]
        start_B = jnp.zeros((B,), jnp.int32) if start_B is None else start_B
        q_BLHK, k_BLGK, v_BLGK = self._qkv(x_BLD)
        q_BLHK, k_BLGK = self._positions(q_BLHK, k_BLGK, pos - start_B)
        k_BSGK = jax.lax.dynamic_update_slice_in_dim(k_BSGK, k_BLGK.astype(k_BSGK.dtype), pos, axis=1)
        v_BSGK = jax.lax.dynamic_update_slice_in_dim(v_BSGK, v_BLGK.astype(v_BSGK.dtype), pos, axis=1)
        k_all, v_all = self._expand_kv(k_BSGK), self._expand_kv(v_BSGK)
        s_BHLS = jnp.einsum("blhk,bshk->bhls", q_BLHK, k_all.astype(q_BLHK.dtype),
                            preferred_element_type=jnp.float32) * (1.0 / math.sqrt(c.head_dim))
        slot_S, slot_L = jnp.arange(S), pos + jnp.arange(L)
        visible_BLS = (slot_S[None, None, :] <= slot_L[None, :, None]) & (slot_S[None, None, :] >= start_B[:, None, None])
        p_BHLS = jax.nn.softmax(jnp.where(visible_BLS[:, None], s_BHLS, jnp.finfo(jnp.float32).min / 2), axis=-1)
        a_BLHK = jnp.einsum("bhls,bshk->blhk", p_BHLS.astype(v_all.dtype), v_all).astype(x_BLD.dtype)
        return self._finish(x_BLD, a_BLHK), k_BSGK, v_BSGK


class Head(nn.Module):
    """Final LayerNorm and unembedding: ``x_BLD -> logits_BLV`` (``output_dtype``)."""
    cfg: GPTConfig

    def setup(self):
        c = self.cfg
        self.ln_scale = _param(self, "ln_scale", (c.d_model,), ("embed",), None)
        self.ln_bias = _param(self, "ln_bias", (c.d_model,), ("embed",), None)
        if not c.tie_embeddings:
            self.kernel = _param(self, "kernel", (c.d_model, c.padded_vocab), ("embed", "vocab"), c.init_std)

    def declare(self) -> None:
        """Creates the parameters without running the head (used by ``init``)."""
        self.ln_scale  # noqa: B018

    def _norm(self, x_BLD: jax.Array) -> jax.Array:
        return layer_norm(x_BLD, self.ln_scale, self.ln_bias)

    def __call__(self, x_BLD: jax.Array, embedding_VD: jax.Array | None = None) -> jax.Array:
        c = self.cfg
        B, L, D = x_BLD.shape
        dtype = _compute_dtype(c, x_BLD)
        h_TD = tokens(self._norm(x_BLD))
        if c.tie_embeddings:
            logits_TV = h_TD @ embedding_VD.astype(dtype).T
        else:
            logits_TV = h_TD @ self.kernel.astype(dtype)
        out_dtype = dtype if c.output_dtype is None else c.output_dtype
        return constrain(logits_TV.reshape(B, L, -1).astype(out_dtype), "batch", "seq", "vocab")


def _check_auto_mesh() -> None:
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and has_explicit_axes(mesh):
        raise ValueError(f"the GPT runs on meshes with Auto axes only (its gathers and matmuls leave output "
                         f"shardings to the compiler); got axis_types {tuple(mesh.axis_types)}: build the mesh "
                         "with jp.make_mesh(...)'s default axis_types (all jax.sharding.AxisType.Auto)")


def _add_layers_axis(tree: Any) -> Any:
    box = lambda x: isinstance(x, nn.LogicallyPartitioned)
    return jax.tree.map(lambda b: b.replace(names=("layers",) + tuple(b.names)) if box(b) else b, tree, is_leaf=box)


class GPT:
    """The GPT as pure functions over a params tree ``{"embed", "blocks", "head"}``: every part of the model
    protocol (:mod:`jaxpar.protocol`).

    ``blocks`` leaves carry a leading ``layers`` axis of size ``num_layers``.
    """
    stage_key = "blocks"
    shards_activations = True   # every layer constrains its activations by logical names: the step gathers nothing
    Embed, Block, Head = Embed, Block, Head   # the Linen modules (a subclass swaps its own in)

    def __init__(self, cfg: GPTConfig):
        self.cfg = cfg

    def __eq__(self, other: Any) -> bool:   # a GPT is its config: equal configs compute the same functions
        return type(other) is type(self) and other.cfg == self.cfg

    def __hash__(self) -> int:
        return hash(self.cfg)

    def init(self, rng: jax.Array) -> dict:
        """Flax-boxed params (``nn.LogicallyPartitioned`` leaves carrying logical axis names)."""
        c = self.cfg
        k_embed, k_blocks, k_head = jax.random.split(rng, 3)
        block = self.Block(c)
        blocks = jax.vmap(lambda k: block.init(k, method=self.Block.declare)["params"])(
            jax.random.split(k_blocks, c.num_layers))
        return {"embed": self.Embed(c).init(k_embed, method=lambda m: m.embedding)["params"],
                "blocks": _add_layers_axis(blocks),
                "head": self.Head(c).init(k_head, method=self.Head.declare)["params"]}

    def embed(self, params: dict, tokens_BL: jax.Array, positions_BL: jax.Array | None = None) -> jax.Array:
        """``tokens_BL (int) -> x_BLD``; ``positions_BL`` (int ``[B, L]``, packed documents): each token's position
        for learned position embeddings (rotary ones take them in :meth:`stage`).

        A token outside ``[0, vocab_size)`` gives NaN activations (so a NaN loss and gradients), not a wrapped
        or zero row (check host batches first with :meth:`check_batch`).

        Raises:
          ValueError: sequences longer than ``max_seq_len``; a mesh with Explicit axes in context.
        """
        _check_auto_mesh()
        if tokens_BL.ndim != 2:
            raise ValueError(f"tokens have shape {tuple(tokens_BL.shape)}; need [batch, seq]")
        if tokens_BL.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens_BL.shape[1]} exceeds max_seq_len {self.cfg.max_seq_len}; "
                             f"use shorter sequences or a larger {type(self.cfg).__name__}.max_seq_len")
        x_BLD = self.Embed(self.cfg).apply({"params": params["embed"]}, tokens_BL, 0, positions_BL)
        return x_BLD * _nan_where_invalid(tokens_BL, self.cfg.vocab_size, x_BLD.dtype)[..., None]

    def stage(self, blocks: dict, x_BLD: jax.Array, segment_ids_BL: jax.Array | None = None,
              positions_BL: jax.Array | None = None) -> jax.Array:
        """Runs the blocks whose params are stacked along ``blocks``' leading axis (any number of layers).

        Packed documents: ``segment_ids_BL`` keeps attention within each document, ``positions_BL`` gives rotary
        positions (int ``[B, L]`` each, optional; see :meth:`loss`)."""
        block = self.Block(self.cfg)
        packed = segment_ids_BL is not None or positions_BL is not None
        f = (lambda p, x: block.apply({"params": p}, x, segment_ids_BL, positions_BL)) if packed else (
            lambda p, x: block.apply({"params": p}, x))
        if self.cfg.remat != "none":
            f = jax.checkpoint(f, policy=_REMAT[self.cfg.remat])
        if self.cfg.scan_layers:
            return jax.lax.scan(lambda x, p: (f(p, x), None), x_BLD, blocks)[0]
        for i in range(jax.tree.leaves(blocks)[0].shape[0]):
            x_BLD = f(jax.tree.map(lambda a: a[i], blocks), x_BLD)
        return x_BLD

    def logits(self, params: dict, x_BLD: jax.Array) -> jax.Array:
        """Logits ``[B, L, V]`` (``output_dtype``) with padded vocabulary entries set to a large negative value."""
        emb = params["embed"]["embedding"] if self.cfg.tie_embeddings else None
        logits_BLV = self.Head(self.cfg).apply({"params": params["head"]}, x_BLD, emb)
        valid = jnp.arange(self.cfg.padded_vocab) < self.cfg.vocab_size
        return jnp.where(valid, logits_BLV, jnp.finfo(logits_BLV.dtype).min / 2)

    def head_loss(self, params: dict, x_BLD: jax.Array, targets_BL: jax.Array,
                  loss_mask_BL: jax.Array | None = None):
        """Mean next-token cross-entropy (nats per token, float32) and ``{"weight": token count}``.

        With ``loss_mask_BL`` (``[B, L]``, bool or numbers; 0 drops a target, e.g. padding of packed rows): the
        masked mean ``sum(mask * ce) / sum(mask)`` (0 when the mask is all 0) with ``weight = sum(mask)``, so the
        step's weighting of microbatches and batch shards by ``weight`` gives the exact masked mean of the whole
        global batch. A target outside ``[0, vocab_size)`` makes the loss and gradients NaN (check host batches
        first with :meth:`check_batch`); a masked one too (mask it by giving it a valid id, e.g. 0)."""
        logits_BLV = self.logits(params, x_BLD).astype(jnp.float32)
        ce_BL = cross_entropy(logits_BLV, targets_BL) * _nan_where_invalid(targets_BL, self.cfg.vocab_size)
        if loss_mask_BL is None:
            return ce_BL.mean(), {"weight": jnp.asarray(targets_BL.size, jnp.float32)}
        mask_BL = loss_mask_BL.astype(jnp.float32)
        weight = mask_BL.sum()   # 0 (not NaN) for a row block with no target left, as jp.grads.weighted_mean
        loss = jnp.where(weight > 0, (ce_BL * mask_BL).sum() / jnp.where(weight > 0, weight, 1.0), 0.0)
        return loss, {"weight": weight}

    def _check_layers(self, params: dict) -> None:
        """Raises ValueError unless every stacked block param has ``num_layers`` layers (at trace time; ``stage``
        takes any slice of them, the whole model's functions take all)."""
        counts = {np.shape(leaf)[0] for leaf in jax.tree.leaves(params["blocks"])}
        if counts != {self.cfg.num_layers}:
            raise ValueError(f"the params' blocks hold {sorted(counts)} layers; {type(self.cfg).__name__}.num_layers is "
                             f"{self.cfg.num_layers}: load the params with the config they were made with")

    def apply(self, params: dict, tokens_BL: jax.Array) -> jax.Array:
        """``tokens_BL (int32) -> logits_BLV`` (``output_dtype``).

        Raises:
          ValueError: params with another number of layers than the config (as :meth:`embed`).
        """
        self._check_layers(params)
        context = cp.context_axis()[1]   # > 1: the zigzag layout in, logits back in token order
        x_BLD = self.stage(params["blocks"], self.embed(params, cp.to_zigzag(tokens_BL, context)))
        return cp.from_zigzag(self.logits(params, x_BLD), context)

    def loss(self, params: dict, batch: dict, rng: jax.Array | None = None):
        """``loss_fn`` for the train step: ``batch = {"inputs": int [B, L], "targets": int [B, L]}``, optionally with
        packed documents' entries (:data:`PACKED_KEYS`, each ``[B, L]``, e.g. from ``jp.data.grain_batches``):
        ``"segment_ids"`` (int; attention only within a segment), ``"positions"`` (int; each token's position in
        its document, for learned or rotary positions), ``"loss_mask"`` (bool or numbers; the loss is the masked
        mean, see :meth:`head_loss`). Without them, the computation is exactly the plain one.

        Raises:
          ValueError: a packed entry whose shape is not the inputs' (at trace time).
        """
        del rng
        self._check_layers(params)
        check_packed_shapes(batch)
        batch = cp.shard_sequence(batch)   # a sequence sharded over a context axis: the zigzag layout
        segment_ids, positions, loss_mask = (batch.get(k) for k in PACKED_KEYS)   # None: the plain computation
        x_BLD = self.stage(params["blocks"], self.embed(params, batch["inputs"], positions), segment_ids, positions)
        return self.head_loss(params, x_BLD, batch["targets"], loss_mask)

    def check_batch(self, batch: Any) -> None:
        """Host-side check of a batch for :meth:`loss`: ``{"inputs", "targets"}`` of integer ids in
        ``[0, vocab_size)``. Pass it to the step builders (``make_train_step(..., check_batch=model.check_batch)``)
        so a bad batch raises before it reaches the devices.

        Only host (numpy) leaves are read; a batch already on the devices (``jax.Array`` leaves) is not pulled
        back: there an out-of-range id makes the step's loss and gradients NaN (see :meth:`embed` and
        :meth:`head_loss`), never a finite wrong loss.

        Raises:
          ValueError: a missing key, inputs and targets of different or non-``[batch, seq]`` shapes, a sequence
            longer than ``max_seq_len``, non-integer ids, or an id outside ``[0, vocab_size)`` (naming its index);
            packed entries (:data:`PACKED_KEYS`) of another shape than the inputs, ``segment_ids``/``positions``
            that are not integers >= 0, learned positions >= ``max_seq_len``, a ``loss_mask`` that is not bool or
            numeric (:func:`check_packed_entries`).
        """
        if not isinstance(batch, dict) or not {"inputs", "targets"} <= set(batch):
            raise ValueError(f"the GPT's batch is a dict with 'inputs' and 'targets' (int [batch, seq]); got "
                             f"{sorted(batch) if isinstance(batch, dict) else type(batch).__name__}")
        shapes = {key: tuple(np.shape(batch[key])) for key in ("inputs", "targets")}
        if shapes["inputs"] != shapes["targets"] or len(shapes["inputs"]) != 2 or not shapes["inputs"][1]:
            raise ValueError(f"the GPT's inputs and targets must both be [batch, seq] with seq >= 1 (targets are the "
                             f"inputs shifted by one, cut to the same length); got shapes {shapes}")
        if shapes["inputs"][1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {shapes['inputs'][1]} exceeds max_seq_len {self.cfg.max_seq_len}; "
                             f"use shorter sequences or a larger {type(self.cfg).__name__}.max_seq_len")
        for key in ("inputs", "targets"):
            if not isinstance(batch[key], jax.Array):
                check_token_ids(f"batch[{key!r}]", batch[key], self.cfg.vocab_size)
        check_packed_entries(batch, self.cfg.max_seq_len if self.cfg.positions == "learned" else None)

    # ------------------------------------------------------------------ structured pruning (the protocol)
    def prune_groups(self) -> None:
        """None: the GPT's groups follow from its logical names (``blocks`` alone holds ``mlp`` and ``heads``)."""
        return None

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

    # ------------------------------------- generation (the protocol; max_seq_len, vocab_size from self.cfg)
    def init_cache(self, params: dict, batch_size: int, max_len: int) -> dict:
        """Zero keys and values ``{"k", "v"}: [layers, batch_size, max_len, heads, head_dim]`` (the Llama: its
        ``num_kv_heads``) in the compute dtype (``cfg.dtype``, else the params'), logical names ``("layers",
        "batch", None, "heads" | "kv_heads", "kv")``."""
        c = self.cfg
        dtype = c.dtype if c.dtype is not None else params["embed"]["embedding"].dtype
        grouped = hasattr(c, "kv_heads")
        shape = (c.num_layers, batch_size, max_len, c.kv_heads if grouped else c.num_heads, c.head_dim)
        names = ("layers", "batch", None, "kv_heads" if grouped else "heads", "kv")
        return {"k": constrain(jnp.zeros(shape, dtype), *names), "v": constrain(jnp.zeros(shape, dtype), *names)}

    def decode_step(self, params: dict, tokens_B: jax.Array, cache: dict, pos: jax.Array,
                    start: jax.Array | None = None):
        """``(logits_BV float32, cache)`` after tokens ``tokens_B`` (int32 ``[B]``, or ``[B, L]`` for ``L`` slots at
        once: a prefill) written at cache slot ``pos`` (int32 scalar; ``pos .. pos + L - 1``): their keys and values
        written, ``logits_BV`` those after the last of them, equal to ``apply(params, tokens)[:, pos]`` for the
        tokens written at ``0 .. pos`` (float32 rounding). ``start`` (int32 ``[B]``, default 0): the slot where
        each row's sequence begins (left-padded prompts), its positions counted from there and the slots before
        it never attended to. Traceable; ``pos + L <= max_len`` of the cache."""
        self._check_layers(params)
        tokens_BL = jnp.asarray(tokens_B, jnp.int32)
        tokens_BL = tokens_BL[:, None] if tokens_BL.ndim == 1 else tokens_BL
        start_B = jnp.zeros(tokens_BL.shape[:1], jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
        x_BLD = self.Embed(self.cfg).apply({"params": params["embed"]}, tokens_BL, pos - start_B)
        x_BLD = x_BLD * _nan_where_invalid(tokens_BL, self.cfg.vocab_size, x_BLD.dtype)[..., None]
        block, ks, vs = self.Block(self.cfg), [], []
        for i in range(self.cfg.num_layers):
            layer = jax.tree.map(lambda a: a[i], params["blocks"])
            x_BLD, k, v = block.apply({"params": layer}, x_BLD, cache["k"][i], cache["v"][i], pos, start_B,
                                      method=self.Block.decode)
            ks.append(k)
            vs.append(v)
        logits_BV = self.logits(params, x_BLD[:, -1:])[:, 0].astype(jnp.float32)
        return logits_BV, {"k": jnp.stack(ks), "v": jnp.stack(vs)}

    def generate(self, params: dict, prompts: Any, max_new_tokens: int, rng: jax.Array,
                 temperature: float = 0.8, *, top_k: int | None = None, top_p: float | None = None,
                 eos_id: int | None = None) -> list:
        """Samples ``max_new_tokens`` tokens after the prompts.

        ``prompts`` a list of id lists (a batch, any lengths): :func:`jaxpar.models.generation.generate_batch`
        (left-padded, one jitted prefill and decode loop over the KV cache, ``temperature=0`` greedy, ``top_k``,
        ``top_p``, a stop at ``eos_id``); returns a list per prompt. One flat id list: :func:`jaxpar.models.generate`
        (a window sliding past ``max_seq_len``; ``temperature`` only); returns one list. A flat prompt with ``top_k``,
        ``top_p`` or ``eos_id`` runs as a batch of one (the cache: prompt plus new tokens within ``max_seq_len``).

        Raises:
          ValueError: as those functions; an empty list of prompts.
        """
        return generation.generate_any(self, params, prompts, max_new_tokens, rng, temperature, top_k=top_k,
                                       top_p=top_p, eos_id=eos_id)
