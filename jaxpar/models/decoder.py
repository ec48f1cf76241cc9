"""The decoder base every built-in decoder family is a configuration of (torchtitan's ``models/common/decoder.py``
shape): token embedding, ``num_layers`` stacked pre-norm blocks and a head, as pure functions over one params tree
``{"embed", "blocks", "head"}``, so a pipeline can run the layer stack as stages:

* ``embed(params, tokens_BL) -> x_BLD``
* ``stage(blocks, x_BLD) -> x_BLD`` over any slice of the stacked ``[layers, ...]`` block params
* ``head_loss(params, x_BLD, targets_BL) -> (loss, aux)``

A family (:mod:`jaxpar.models.gpt`, :mod:`jaxpar.models.llama`, :mod:`jaxpar.models.families`) is a config whose ``architecture``
(:class:`jaxpar.models.blocks.Architecture`) picks the attention variant (multi-head with a fused q/k/v kernel, or
grouped-query), the norm (LayerNorm or RMSNorm), the MLP (GELU or SwiGLU) and the projection biases; its fields
pick positions (learned, or rotary with optional scaled frequencies), a tied or untied head, the attention kernel
(:func:`jaxpar.layers.attention.attend`), remat and ``scan_layers``. The Linen modules are in
:mod:`jaxpar.models.blocks`.

The config fields the base reads: ``architecture``, ``vocab_size``, ``padded_vocab``, ``num_layers``,
``num_heads``, ``head_dim``, ``d_model``, ``mlp_dim``, ``max_seq_len``, ``positions`` (``"learned"`` or
``"rotary"``), ``tie_embeddings``, ``scan_layers``, ``remat``, ``attention``, ``attention_blocks``,
``context_attention``, ``dtype``, ``param_dtype``, ``output_dtype``, ``init_std``; with rotary positions
``rope_base`` and ``rotary_freq()`` (None: ``rope_base``'s frequencies); ``qkv_bias``; with ``"gqa"``
``kv_heads``; with ``"rms"`` ``norm_eps``; optionally ``layer_kinds()`` (one
:class:`jaxpar.models.blocks.LayerKind` per layer: sliding windows, per-layer rotary frequencies; absent: every
layer alike) and ``query_pre_attn_scalar`` (the attention logits' ``q.k / sqrt(this)``; absent or None:
``head_dim``), ``moe`` (absent or None: the dense MLP; a :class:`jaxpar.layers.moe.MoEConfig`: experts in every
block, :mod:`jaxpar.models.moe_block`). Compaction's ``replace`` (the smaller config) is the family class's: it
knows its config's field names. The families of :mod:`jaxpar.models.families` (Qwen2, Qwen3, Mistral, Gemma 3)
share one config class.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpar._validate import nonnegative_int, positive_int
from jaxpar.layers import attention as cp
from jaxpar.layers import sliding_window
from jaxpar.layers.losses import _nan_where_invalid, check_token_ids, cross_entropy
from jaxpar.layers.per_token import PACKED_KEYS, check_packed_entries, check_packed_shapes
from jaxpar.models import generation, moe_block
from jaxpar.models.blocks import Block, Embed, Head, LayerKind, kv_heads, layer_kinds
from jaxpar.precision.policy import is_floating_dtype
from jaxpar.sharding.names import BATCH, HEADS, KV, KV_HEADS, LAYERS, TENSOR, Rules
from jaxpar.sharding.rules import constrain, has_explicit_axes

REMAT = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
         "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
"""Activation checkpointing per block (``cfg.remat``) -> its ``jax.checkpoint`` policy."""
ATTENTION = ("blocked", "xla", "cudnn")
"""The attention kernels a config may name (``cfg.attention``; :func:`jaxpar.layers.attention.attend`)."""


def rotary_inv_freq(base: float, head_dim: int, scaling: dict | None = None) -> np.ndarray:
    """The ``head_dim // 2`` rotary inverse frequencies (float64 numpy): ``base ** (-2 i / head_dim)``, with Llama
    3's scaling when ``scaling`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``) is given (Grattafiori et al. 2024, sec. 4.3; HF's
    ``_compute_llama3_parameters``): wavelengths longer than ``original_max_position_embeddings /
    low_freq_factor`` are divided by ``factor``, shorter than ``... / high_freq_factor`` kept, and those between
    interpolated linearly in ``original_max_position_embeddings / wavelength``."""
    half = head_dim // 2
    inv = base ** (-np.arange(0, 2 * half, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv
    factor, low, high, old = (float(scaling[k]) for k in
                              ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    out = np.where(wavelen > old / low, inv / factor, inv)
    between = (wavelen <= old / low) & (wavelen >= old / high)
    return np.where(between, mid, out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFields:
    """How a rotary grouped-query config runs, the fields :class:`jaxpar.models.LlamaConfig` and
    :class:`jaxpar.models.families.FamilyConfig` share (keyword-only, after each config's own fields)."""
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
    # the ids that end generation by default (Decoder.generate's eos_id="config"): a Hugging Face checkpoint's
    # generation_config.json (else config.json) eos_token_id, set by jaxpar.models.hf.load; none for a new model
    eos_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertFields:
    """The mixture-of-experts field of :class:`jaxpar.models.LlamaConfig` and
    :class:`jaxpar.models.families.FamilyConfig` (keyword-only): ``moe``, None for the dense gated MLP (the
    programs of a config without it are those of before it), or a :class:`jaxpar.layers.moe.MoEConfig` whose
    experts replace it in every block (:mod:`jaxpar.models.moe_block`)."""
    moe: Any = None


class RotaryFields:
    """What the decoder base reads from a rotary grouped-query config, derived from its fields (``rms_norm_eps``,
    ``rope_theta``, ``num_kv_heads``, ``d_mlp``, ``vocab_size``, ``vocab_multiple``): mixed into
    :class:`jaxpar.models.LlamaConfig` and :class:`jaxpar.models.families.FamilyConfig`."""

    @property
    def norm_eps(self) -> float:
        return self.rms_norm_eps

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


def check_run_fields(cfg: Any) -> None:
    """Raises ValueError for a config's ``remat``, ``attention`` or ``context_attention`` outside their choices, or
    ``eos_token_ids`` not token ids (:func:`jaxpar.models.generation.token_ids`; stored as a tuple of ints)."""
    if hasattr(cfg, "eos_token_ids"):   # a GPTConfig has none
        object.__setattr__(cfg, "eos_token_ids", generation.token_ids(cfg.eos_token_ids, cfg.vocab_size,
                                                                      f"{type(cfg).__name__}.eos_token_ids"))
    if cfg.remat not in REMAT:
        raise ValueError(f"remat={cfg.remat!r}; use one of {sorted(REMAT)}")
    if cfg.attention not in ATTENTION:
        raise ValueError(f"attention={cfg.attention!r}; use one of {list(ATTENTION)}")
    if cfg.context_attention not in cp.STRATEGIES:
        raise ValueError(f"context_attention={cfg.context_attention!r}; use one of {list(cp.STRATEGIES)}")


def check_rotary_fields(cfg: Any) -> None:
    """Checks and completes, in place, the fields a rotary grouped-query config (:class:`jaxpar.models.LlamaConfig`,
    :class:`jaxpar.models.families.FamilyConfig`) shares: sizes, ``num_kv_heads`` / ``head_dim`` / ``d_mlp`` of 0
    resolved (``num_heads``; ``d_model // num_heads``; ``8 * d_model / 3`` rounded up to 64), dtypes, positive
    numbers, flags and the kernels' names.

    Raises:
      ValueError: naming the field, the value and the constraint.
    """
    name = type(cfg).__name__
    put = lambda field, value: object.__setattr__(cfg, field, value)
    for field in ("vocab_size", "num_layers", "num_heads", "d_model", "max_seq_len", "vocab_multiple",
                  "attention_blocks"):
        put(field, positive_int(f"{name}.{field}", getattr(cfg, field)))
    for field, zero in (("num_kv_heads", "num_heads"), ("head_dim", "d_model // num_heads"),
                        ("d_mlp", "8 * d_model / 3 rounded up to 64")):
        put(field, nonnegative_int(f"{name}.{field}", getattr(cfg, field), f" (0 means {zero})"))
    if cfg.num_kv_heads == 0:
        put("num_kv_heads", cfg.num_heads)
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"{name}.num_kv_heads={cfg.num_kv_heads} must divide num_heads={cfg.num_heads} "
                         "(each key/value head serves num_heads // num_kv_heads query heads)")
    if cfg.head_dim == 0:
        if cfg.d_model % cfg.num_heads:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by num_heads {cfg.num_heads}; "
                             "set head_dim explicitly or change num_heads")
        put("head_dim", cfg.d_model // cfg.num_heads)
    if cfg.head_dim % 2:
        raise ValueError(f"rotary positions need an even head_dim, got {cfg.head_dim}")
    if cfg.d_mlp == 0:
        put("d_mlp", -(-(8 * cfg.d_model) // (3 * 64)) * 64)
    for field in ("dtype", "param_dtype", "output_dtype"):
        value = getattr(cfg, field)
        if value is not None and not is_floating_dtype(value):
            raise ValueError(f"{name}.{field}={value!r} must be a floating dtype (float32, bfloat16, float16)")
    for field in ("init_std", "rope_theta", "rms_norm_eps"):
        value = getattr(cfg, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}.{field}={value!r} must be a positive finite number")
    for field in ("tie_embeddings", "scan_layers"):
        if not isinstance(getattr(cfg, field), bool):
            raise ValueError(f"{name}.{field}={getattr(cfg, field)!r} must be True or False")
    check_run_fields(cfg)
    moe_block.check(cfg)


def compact_grouped(cfg: Any, sizes: dict[tuple, int], family: str) -> Any:
    """The config of a grouped-query family after compaction (its model's ``replace``): ``sizes`` maps
    ``("blocks", "mlp")`` (the kept gated-MLP width: gate, up and down coupled) and ``("blocks", "heads")`` (the
    kept query heads, the same number in each key/value group, see :mod:`jaxpar.pruning.groups`) to the kept
    counts, and ``("blocks", "experts")`` a mixture of experts' kept experts
    (:func:`jaxpar.models.moe_block.with_experts`); ``num_kv_heads`` and ``head_dim`` are kept.

    Raises:
      ValueError: a group other than ``blocks/mlp``, ``blocks/heads`` or ``blocks/experts``; a head count that is
        not a multiple of ``num_kv_heads``; ``blocks/mlp`` of a mixture of experts (its ``mlp`` params are the
        shared experts'); an experts count the routing cannot take (``with_experts``).
    """
    cfg, sizes = moe_block.with_experts(cfg, sizes, family)   # blocks/experts: the routed experts kept
    if ("blocks", "mlp") in sizes and moe_block.moe_of(cfg) is not None:
        raise ValueError(f"the {family} has experts: its 'mlp' params are the shared experts' (routed experts are "
                         "'expert_mlp', never pruned with the dense MLP), so compacting blocks/mlp would not change "
                         "d_mlp; prune heads only, or exclude the shared experts from the mask")
    bad = [k for k in sizes if tuple(k[:-1]) != ("blocks",) or k[-1] not in ("mlp", "heads")]
    if bad:
        raise ValueError(f"the {family}'s prunable groups are blocks/mlp (gate, up and down coupled) and blocks/heads "
                         f"(query heads within their key/value group); got masks for {['/'.join(k) for k in bad]}")
    heads, mlp = sizes.get(("blocks", "heads"), cfg.num_heads), sizes.get(("blocks", "mlp"), cfg.d_mlp)
    if heads % cfg.num_kv_heads:
        raise ValueError(f"a compacted {family} needs its query heads ({heads}) to be a multiple of num_kv_heads="
                         f"{cfg.num_kv_heads}: each key/value group keeps the same number of query heads")
    return dataclasses.replace(cfg, num_heads=heads, d_mlp=mlp, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)


def _check_auto_mesh(name: str) -> None:
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and has_explicit_axes(mesh):
        raise ValueError(f"the {name} runs on meshes with Auto axes only (its gathers and matmuls leave output "
                         f"shardings to the compiler); got axis_types {tuple(mesh.axis_types)}: build the mesh "
                         "with jp.make_mesh(...)'s default axis_types (all jax.sharding.AxisType.Auto)")


_WARNED: set = set()


def _warn_replicated_kv(name: str, cfg: Any) -> None:
    """Warns once per config and mesh when grouped-query key/value heads are replicated over a ``tensor`` axis of
    more than one device (the rules leave ``kv_heads`` unmapped, or it does not divide them)."""
    mesh = jax.sharding.get_abstract_mesh()
    tensor = 1 if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes)).get(TENSOR, 1)
    # the first rule naming kv_heads decides (DEFAULT_RULES has ("kv_heads", None): a later one is never read)
    mapped = Rules(nn.get_logical_axis_rules()).mesh_axes(KV_HEADS)
    if tensor == 1 or mapped or (cfg, tensor) in _WARNED:
        return
    _WARNED.add((cfg, tensor))
    why = (f"tensor={tensor} exceeds num_kv_heads={cfg.kv_heads}" if tensor > cfg.kv_heads else
           "the rules leave kv_heads unmapped; rules whose first kv_heads entry is ('kv_heads', 'tensor'), given "
           "to init_state and make_train_step, split them: e.g. (('kv_heads', 'tensor'),) + jp.sharding.DEFAULT_RULES")
    warnings.warn(f"the {name}'s {cfg.kv_heads} key/value heads are replicated over the tensor axis ({why}): "
                  f"every tensor shard computes all of them, the {cfg.num_heads} query heads are split (correct, "
                  "some duplicated work)", stacklevel=3)


def _period(kinds: tuple) -> int:
    """The smallest ``P`` with ``kinds[i] == kinds[i % P]`` for every ``i`` (Gemma 3's five local layers and one
    global: 6; layers all alike: 1)."""
    return next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))


def _add_layers_axis(tree: Any) -> Any:
    box = lambda x: isinstance(x, nn.LogicallyPartitioned)
    return jax.tree.map(lambda b: b.replace(names=("layers",) + tuple(b.names)) if box(b) else b, tree, is_leaf=box)


class Decoder:
    """A decoder as pure functions over a params tree ``{"embed", "blocks", "head"}``: every part of the model
    protocol (:mod:`jaxpar.protocol`) but ``replace`` (compaction; the family's, which knows its config's fields).

    ``blocks`` leaves carry a leading ``layers`` axis of size ``num_layers``. A decoder is its config: equal
    configs compute the same functions (compiled programs are shared between equal models).
    """
    stage_key = "blocks"
    shards_activations = True   # every layer constrains its activations by logical names: the step gathers nothing

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and other.cfg == self.cfg

    def __hash__(self) -> int:
        return hash(self.cfg)

    def init(self, rng: jax.Array) -> dict:
        """Flax-boxed params (``nn.LogicallyPartitioned`` leaves carrying logical axis names)."""
        c = self.cfg
        k_embed, k_blocks, k_head = jax.random.split(rng, 3)
        block = Block(c)
        blocks = jax.vmap(lambda k: block.init(k, method=Block.declare)["params"])(
            jax.random.split(k_blocks, c.num_layers))
        return {"embed": Embed(c).init(k_embed, method=lambda m: m.embedding)["params"],
                "blocks": _add_layers_axis(blocks),
                "head": Head(c).init(k_head, method=Head.declare)["params"]}

    def embed(self, params: dict, tokens_BL: jax.Array, positions_BL: jax.Array | None = None) -> jax.Array:
        """``tokens_BL (int) -> x_BLD``; ``positions_BL`` (int ``[B, L]``, packed documents): each token's position
        for learned position embeddings (rotary ones take them in :meth:`stage`).

        A token outside ``[0, vocab_size)`` gives NaN activations (so a NaN loss and gradients), not a wrapped
        or zero row (check host batches first with :meth:`check_batch`).

        Raises:
          ValueError: sequences longer than ``max_seq_len``; a mesh with Explicit axes in context.
        """
        _check_auto_mesh(type(self).__name__)
        if self.cfg.architecture.attention == "gqa":
            _warn_replicated_kv(type(self).__name__, self.cfg)
        if tokens_BL.ndim != 2:
            raise ValueError(f"tokens have shape {tuple(tokens_BL.shape)}; need [batch, seq]")
        if tokens_BL.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens_BL.shape[1]} exceeds max_seq_len {self.cfg.max_seq_len}; "
                             f"use shorter sequences or a larger {type(self.cfg).__name__}.max_seq_len")
        x_BLD = Embed(self.cfg).apply({"params": params["embed"]}, tokens_BL, 0, positions_BL)
        return x_BLD * _nan_where_invalid(tokens_BL, self.cfg.vocab_size, x_BLD.dtype)[..., None]

    def stage(self, blocks: dict, x_BLD: jax.Array, segment_ids_BL: jax.Array | None = None,
              positions_BL: jax.Array | None = None) -> jax.Array:
        """Runs the blocks whose params are stacked along ``blocks``' leading axis (any number of layers).

        Packed documents: ``segment_ids_BL`` keeps attention within each document, ``positions_BL`` gives rotary
        positions (int ``[B, L]`` each, optional; see :meth:`loss`).

        Layers of different kinds (:func:`jaxpar.models.blocks.layer_kinds`: windows, rotary bases) are different
        programs. A slice of ``R < num_layers`` layers (a pipeline stage's) is taken to start at a multiple of
        ``R``, as a pipeline's virtual stages do: every stage runs one program, so the model's kinds must repeat
        every ``R`` layers. With ``scan_layers`` the scan runs over repeats of the kinds' period ``P`` (the
        ``P`` layers of one repeat unrolled inside its body), and the ``R mod P`` layers left over run unrolled.

        Raises:
          ValueError: a slice of ``R`` layers of a model whose layer kinds do not repeat every ``R`` layers; a
            mixture of experts with auxiliary router losses (a stage passes activations only:
            :func:`jaxpar.models.moe_block.check_stage`).
        """
        if moe_block.moe_of(self.cfg) is None:
            return self._layers(blocks, x_BLD, segment_ids_BL, positions_BL)
        moe_block.check_stage(self.cfg)
        return self.stage_with_stats(blocks, x_BLD, segment_ids_BL, positions_BL)[0]

    def stage_with_stats(self, blocks: dict, x_BLD: jax.Array, segment_ids_BL: jax.Array | None = None,
                         positions_BL: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """:meth:`stage`'s ``x_BLD`` and, for a mixture of experts, its layers' router statistics summed
        (:class:`jaxpar.layers.moe.MoEStats`, float32; None for a dense model): what :meth:`loss` adds its
        auxiliary losses from."""
        if moe_block.moe_of(self.cfg) is None:
            return self._layers(blocks, x_BLD, segment_ids_BL, positions_BL), None
        return self._layers(blocks, (x_BLD, moe_block.zero_stats(self.cfg)), segment_ids_BL, positions_BL)

    def _layers(self, blocks: dict, carry: Any, segment_ids_BL: jax.Array | None,
                positions_BL: jax.Array | None) -> Any:
        """:meth:`stage`'s layer loop over ``carry``: ``x_BLD``, or for a mixture of experts ``(x_BLD, summed
        router statistics)``."""
        x_BLD = carry
        moe = moe_block.moe_of(self.cfg) is not None
        num = jax.tree.leaves(blocks)[0].shape[0]
        kinds = self._slice_kinds(num)
        period = _period(kinds)
        packed = segment_ids_BL is not None or positions_BL is not None

        def layer(kind: LayerKind):
            block = Block(self.cfg, kind)
            if moe:
                f = lambda p, x: block.apply({"params": p}, x, segment_ids_BL, positions_BL, method=Block.forward)
            else:
                f = (lambda p, x: block.apply({"params": p}, x, segment_ids_BL, positions_BL)) if packed else (
                    lambda p, x: block.apply({"params": p}, x))
            f = f if self.cfg.remat == "none" else jax.checkpoint(f, policy=REMAT[self.cfg.remat])
            if not moe:
                return f

            def with_stats(p, carry):   # (x, stats so far) -> (x, stats so far plus this layer's)
                y, stats = f(p, carry[0])
                return y, moe_block.add_stats(carry[1], stats)
            return with_stats
        fs = [layer(kind) for kind in kinds[:period]]
        take = lambda i: jax.tree.map(lambda a: a[i], blocks)
        done = 0
        if self.cfg.scan_layers and period == 1:
            return jax.lax.scan(lambda x, p: (fs[0](p, x), None), x_BLD, blocks)[0]
        if self.cfg.scan_layers and num >= period:
            repeats = num // period
            done = repeats * period
            grouped = jax.tree.map(lambda a: a[:done].reshape((repeats, period) + a.shape[1:]), blocks)

            def body(x, p):
                for r in range(period):
                    x = fs[r](jax.tree.map(lambda a: a[r], p), x)
                return x, None
            x_BLD = jax.lax.scan(body, x_BLD, grouped)[0]
        for i in range(done, num):
            x_BLD = fs[i % period](take(i), x_BLD)
        return x_BLD

    def _slice_kinds(self, num: int) -> tuple[LayerKind, ...]:
        """The layer kinds of a slice of ``num`` stacked layers (:meth:`stage`)."""
        kinds = layer_kinds(self.cfg)
        if num == len(kinds) or all(k == kinds[i % num] for i, k in enumerate(kinds)):
            return kinds[:num]
        raise ValueError(f"a stage of {num} layers of a {type(self.cfg).__name__} whose layers differ in kind "
                         f"(sliding windows {[k.window for k in kinds]}, or rotary bases) that does not repeat every "
                         f"{num} layers: pipeline stages run one program each; choose pipe x chunks so that each "
                         "virtual stage's layers repeat the pattern of the model's layers")

    def logits(self, params: dict, x_BLD: jax.Array) -> jax.Array:
        """Logits ``[B, L, V]`` (``output_dtype``) with padded vocabulary entries set to a large negative value."""
        emb = params["embed"]["embedding"] if self.cfg.tie_embeddings else None
        logits_BLV = Head(self.cfg).apply({"params": params["head"]}, x_BLD, emb)
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
        x_BLD = self.stage_with_stats(params["blocks"], self.embed(params, cp.to_zigzag(tokens_BL, context)))[0]
        return cp.from_zigzag(self.logits(params, x_BLD), context)

    def loss(self, params: dict, batch: dict, rng: jax.Array | None = None):
        """``loss_fn`` for the train step: ``batch = {"inputs": int [B, L], "targets": int [B, L]}``, optionally with
        packed documents' entries (:data:`PACKED_KEYS`, each ``[B, L]``, e.g. from ``jp.data.grain_batches``):
        ``"segment_ids"`` (int; attention only within a segment), ``"positions"`` (int; each token's position in
        its document, for learned or rotary positions), ``"loss_mask"`` (bool or numbers; the loss is the masked
        mean, see :meth:`head_loss`). Without them, the computation is exactly the plain one.

        A mixture of experts (``cfg.moe``) adds ``load_balance_coef * mean_layers(load_balance_loss) + z_loss_coef *
        mean_layers(z_loss)`` to the cross-entropy and reports ``moe_load_balance_loss``, ``moe_z_loss`` (means
        over layers) and ``moe_dropped_fraction`` in the aux dict (:func:`jaxpar.models.moe_block.aux_loss`).

        Raises:
          ValueError: a packed entry whose shape is not the inputs' (at trace time).
        """
        del rng
        self._check_layers(params)
        check_packed_shapes(batch)
        batch = cp.shard_sequence(batch)   # a sequence sharded over a context axis: the zigzag layout
        segment_ids, positions, loss_mask = (batch.get(k) for k in PACKED_KEYS)   # None: the plain computation
        x_BLD, stats = self.stage_with_stats(params["blocks"], self.embed(params, batch["inputs"], positions),
                                             segment_ids, positions)
        loss, aux = self.head_loss(params, x_BLD, batch["targets"], loss_mask)
        if stats is None:
            return loss, aux
        extra, metrics = moe_block.aux_loss(self.cfg, stats)
        return loss + extra, {**aux, **metrics}

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
            raise ValueError(f"the {type(self).__name__}'s batch is a dict with 'inputs' and 'targets' (int [batch, seq]); got "
                             f"{sorted(batch) if isinstance(batch, dict) else type(batch).__name__}")
        shapes = {key: tuple(np.shape(batch[key])) for key in ("inputs", "targets")}
        if shapes["inputs"] != shapes["targets"] or len(shapes["inputs"]) != 2 or not shapes["inputs"][1]:
            raise ValueError(f"the {type(self).__name__}'s inputs and targets must both be [batch, seq] with seq >= 1 (targets are the "
                             f"inputs shifted by one, cut to the same length); got shapes {shapes}")
        if shapes["inputs"][1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {shapes['inputs'][1]} exceeds max_seq_len {self.cfg.max_seq_len}; "
                             f"use shorter sequences or a larger {type(self.cfg).__name__}.max_seq_len")
        for key in ("inputs", "targets"):
            if not isinstance(batch[key], jax.Array):
                check_token_ids(f"batch[{key!r}]", batch[key], self.cfg.vocab_size)
        check_packed_entries(batch, self.cfg.max_seq_len if self.cfg.positions == "learned" else None)

    def prune_groups(self) -> None:
        """None: the groups follow from the logical names (``blocks`` alone holds ``mlp`` and ``heads``)."""
        return None

    # ------------------------------------- generation (the protocol; max_seq_len, vocab_size from self.cfg)
    def init_cache(self, params: dict, batch_size: int, max_len: int) -> dict:
        """Zero keys and values ``{"k", "v"}: [layers, batch_size, S, heads, head_dim]`` (grouped-query attention:
        its ``kv_heads``) in the compute dtype (``cfg.dtype``, else the params'), logical names ``("layers",
        "batch", None, "heads" | "kv_heads", "kv")``. ``S = max_len``, or for a layer with a sliding window shorter
        than ``max_len`` the window (a ring buffer, :func:`jaxpar.layers.sliding_window.cache_slots`); where the
        layers' slot counts differ (Gemma 3's global and local layers), ``"k"`` and ``"v"`` are tuples of one
        ``[batch_size, S_layer, heads, head_dim]`` array per layer, each of its own length."""
        c = self.cfg
        dtype = c.dtype if c.dtype is not None else params["embed"]["embedding"].dtype
        slots = [sliding_window.cache_slots(max_len, kind.window) for kind in layer_kinds(c)]
        names = (LAYERS, BATCH, None, KV_HEADS if c.architecture.attention == "gqa" else HEADS, KV)
        zeros = lambda *shape: constrain(jnp.zeros((*shape, kv_heads(c), c.head_dim), dtype), *names[-len(shape) - 2:])
        if len(set(slots)) == 1:
            return {t: zeros(c.num_layers, batch_size, slots[0]) for t in ("k", "v")}
        return {t: tuple(zeros(batch_size, S) for S in slots) for t in ("k", "v")}

    def decode_step(self, params: dict, tokens_B: jax.Array, cache: dict, pos: jax.Array,
                    start: jax.Array | None = None):
        """``(logits_BV float32, cache)`` after tokens ``tokens_B`` (int32 ``[B]``, or ``[B, L]`` for ``L`` slots at
        once: a prefill) written at cache slot ``pos`` (int32 scalar; ``pos .. pos + L - 1``): their keys and values
        written, ``logits_BV`` those after the last of them, equal to ``apply(params, tokens)[:, pos]`` for the
        tokens written at ``0 .. pos`` (float32 rounding). ``start`` (int32 ``[B]``, default 0): the slot where
        each row's sequence begins (left-padded prompts), its positions counted from there and the slots before
        it never attended to. Traceable; ``pos + L <= max_len`` of the cache. Layers with a sliding window keep
        the ring buffers :meth:`init_cache` made (:meth:`jaxpar.models.blocks.Block.decode`). Experts run dropless
        here whatever ``moe.capacity_factor`` says (:func:`jaxpar.models.moe_block.mlp`): the logits are those
        of :meth:`apply` of the dropless config."""
        self._check_layers(params)
        tokens_BL = jnp.asarray(tokens_B, jnp.int32)
        tokens_BL = tokens_BL[:, None] if tokens_BL.ndim == 1 else tokens_BL
        start_B = jnp.zeros(tokens_BL.shape[:1], jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
        x_BLD = Embed(self.cfg).apply({"params": params["embed"]}, tokens_BL, pos - start_B)
        x_BLD = x_BLD * _nan_where_invalid(tokens_BL, self.cfg.vocab_size, x_BLD.dtype)[..., None]
        kinds, ks, vs = layer_kinds(self.cfg), [], []
        for i, kind in enumerate(kinds):
            layer, block = jax.tree.map(lambda a: a[i], params["blocks"]), Block(self.cfg, kind)
            x_BLD, k, v = block.apply({"params": layer}, x_BLD, cache["k"][i], cache["v"][i], pos, start_B, kind.window,
                                      method=Block.decode)
            ks.append(k)
            vs.append(v)
        logits_BV = self.logits(params, x_BLD[:, -1:])[:, 0].astype(jnp.float32)
        stack = jnp.stack if isinstance(cache["k"], jax.Array) else tuple   # per-layer lengths: a tuple
        return logits_BV, {"k": stack(ks), "v": stack(vs)}

    def generate(self, params: dict, prompts: Any, max_new_tokens: int, rng: jax.Array,
                 temperature: float = 0.8, *, top_k: int | None = None, top_p: float | None = None,
                 eos_id: int | Sequence[int] | str | None = "config") -> list:
        """Samples up to ``max_new_tokens`` tokens after ``prompts``: one prompt (a list of ids; returns one list,
        the window sliding past ``max_seq_len``) or a batch (a list of id lists of any lengths, left-padded; returns
        a list per prompt). ``temperature=0`` is greedy decoding, through the KV cache; ``top_k``, ``top_p`` and a
        stop at ``eos_id`` are options (:func:`jaxpar.models.generation.generate_any`). ``eos_id="config"`` (the
        default) stops at the config's ``eos_token_ids`` (a Hugging Face checkpoint's end-of-text ids, as
        ``transformers``' ``generate`` stops; none for a model built here); None never stops early.

        Raises:
          ValueError: as :func:`jaxpar.models.generation.generate_any`; an empty list of prompts.
        """
        if isinstance(eos_id, str):
            if eos_id != "config":
                raise ValueError(f"eos_id={eos_id!r}: use 'config' (the config's eos_token_ids), None, an id or a "
                                 "list of ids")
            eos_id = list(getattr(self.cfg, "eos_token_ids", ())) or None
        return generation.generate_any(self, params, prompts, max_new_tokens, rng, temperature, top_k=top_k,
                                       top_p=top_p, eos_id=eos_id)
