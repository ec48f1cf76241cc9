"""The mixture-of-experts part of a decoder block: what replaces the dense gated MLP of
:class:`jaxpar.models.blocks.Block` when the config's ``moe`` is a :class:`jaxpar.layers.moe.MoEConfig` (Mixtral,
Jiang et al. 2024; Qwen3-MoE, Yang et al. 2025): its params, its call of :func:`jaxpar.layers.moe.moe_mlp`, the
per-layer router statistics the loss adds up, and the parameter counts (all experts, or the active ones).

Params of one block (stacked ``[N, ...]`` over layers like every block param), shape legend as
:mod:`jaxpar.models.blocks` plus E routed experts, F_e one expert's SwiGLU width, F_s the shared experts' width:

* ``router_kernel [D, E]`` (``embed``, None): the router's logits ``h @ router_kernel`` (float32 math);
* ``experts_gate_kernel`` / ``experts_up_kernel [E, D, F_e]`` (``experts``, ``embed``, ``expert_mlp``) and
  ``experts_down_kernel [E, F_e, D]`` (``experts``, ``expert_mlp``, ``embed``): each expert's SwiGLU;
* with shared experts, ``shared_gate_kernel`` / ``shared_up_kernel [D, F_s]`` and ``shared_down_kernel [F_s, D]``;
* the carried collection ``moe_router`` ``{"bias" [E], "load" [E], "dropped" [], "rate" []}`` (float32, no
  logical names; :mod:`jaxpar.layers.moe`): the selection bias, the last step's expert load, the dropped
  choices, and the bias update rate (``MoEConfig.bias_update_rate``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxpar.layers import attention as cp
from jaxpar.layers import moe as moe_layer
from jaxpar.layers.moe import MoEConfig, MoEStats
from jaxpar.sharding.names import EXPERTS

CARRIED = moe_layer.ROUTER.key
"""The key of the router's carried collection in a block's params."""


def moe_of(cfg: Any) -> MoEConfig | None:
    """The config's :class:`MoEConfig`, or None for a dense model (a config without the field too)."""
    return getattr(cfg, "moe", None)


def check(cfg: Any) -> None:
    """Raises ValueError unless ``cfg.moe`` is None or a :class:`MoEConfig` whose experts the block can build: a
    SwiGLU architecture without projection biases (the experts are SwiGLU with no biases)."""
    moe = cfg.moe
    if moe is None:
        return
    name = type(cfg).__name__
    if not isinstance(moe, MoEConfig):
        raise ValueError(f"{name}.moe={moe!r:.80} must be None (a dense MLP) or a jaxpar.layers.moe.MoEConfig")
    a = cfg.architecture
    if a.mlp != "swiglu" or a.bias:
        raise ValueError(f"{name}.moe: the experts are SwiGLU without biases, but this architecture's MLP is "
                         f"{a.mlp!r}{' with biases' if a.bias else ''}; use a SwiGLU family (llama, qwen3, mistral)")


def mlp_params(cfg: Any, active: bool = False) -> int:
    """The MLP params of one block: ``3 * D * F`` dense; with experts the router ``D * E``, ``3 * D * F_e`` per
    routed expert (all ``E``, or the ``k`` a token runs when ``active``) and the shared experts' ``3 * D * F_s``."""
    D, moe = cfg.d_model, moe_of(cfg)
    if moe is None:
        return 3 * D * cfg.mlp_dim
    experts = moe.experts_per_token if active else moe.num_experts
    return (D * moe.num_experts + 3 * D * moe.expert_width(cfg.mlp_dim) * experts
            + 3 * D * moe.shared_width(cfg.mlp_dim))


def declare(module: Any, param: Callable[..., Any], out_std: float) -> tuple[dict, dict | None]:
    """In :class:`jaxpar.models.blocks.Block`'s ``setup``: ``(weights, carried)``, the MoE params
    (:func:`jaxpar.layers.moe.param_shapes` and ``param_axes``, declared by ``param(module, name, shape, names,
    std)``, the block's own; the down projections with the block's ``out_std``) and the ``moe_router`` collection
    (:func:`jaxpar.layers.moe.router_state`; None when the params applied hold none and the config has no
    aux-loss-free bias: inference from params without carried state, the bias 0 as it stays without updates).

    Raises:
      ValueError: params without the router state for a config with ``bias_update_rate > 0`` (their selection
        bias, in ``TrainState.carried``, would be taken as 0: other experts than training chose); params applied
        outside ``jit`` whose stored bias is non-zero under a config with ``bias_update_rate == 0``
        (:func:`jaxpar.layers.moe.check_router_bias`).
    """
    c = module.cfg
    axes = moe_layer.param_axes(c.moe)
    w = {name: param(module, name, shape, axes[name], out_std if name.endswith("down_kernel") else c.init_std)
         for name, shape in moe_layer.param_shapes(c.moe, c.d_model, c.mlp_dim).items()}
    if not module.is_initializing() and not module.has_variable("params", CARRIED):
        if c.moe.bias_update_rate:
            raise ValueError(f"the params hold no router state ({CARRIED!r}), but the config's MoE has "
                             f"bias_update_rate={c.moe.bias_update_rate}: its selection bias lives in the train "
                             "state's carried state; apply jp.train.carried.merge(params, state.carried) (the params "
                             "jp.train.to_model_order(state).params with it put back)")
        return w, None
    router = module.param(CARRIED, lambda _: moe_layer.router_state(c.moe))
    if not module.is_initializing() and not isinstance(router["bias"], jax.core.Tracer):   # applied eagerly
        moe_layer.check_router_bias(c.moe, router["bias"])   # (the train step checks a state's before tracing)
    return w, router


def mlp(cfg: Any, weights: dict, carried: dict | None, h_TD: jax.Array, seq_len: int, dtype: Any,
        decode: bool = False) -> tuple[jax.Array, MoEStats]:
    """The MoE layer (:func:`jaxpar.layers.moe.moe_mlp`) on the block's normed tokens ``h_TD [T, D]``, rows of
    sequences of ``seq_len``: ``(y_TD, stats)``. The experts' and shared kernels go in the compute ``dtype``, the
    router's as stored (its math is float32).

    Capacity mode counts each row's slots in its tokens' order: with the sequence over a context axis the rows
    arrive in the zigzag layout, so the layer is given each row's position (:func:`jaxpar.layers.attention.positions`)
    and drops the choices one device drops. Packed documents share their row's capacity (the row is the group, as
    GShard's sequence; their own ``positions`` restart per document and do not order the row).

    ``decode``: a cached generation step or prefill runs dropless whatever ``capacity_factor`` says: the capacity
    counts choices per sequence, so a step of one token per row would drop other tokens than the whole sequence
    did; dropless gives every token its ``k`` experts, as Mixtral and Qwen3-MoE compute (they never drop).
    """
    moe = cfg.moe
    if decode and moe.capacity_factor is not None:
        moe = dataclasses.replace(moe, capacity_factor=None)
    order = cp.positions(seq_len) if moe.capacity_factor is not None else None   # None: no context axis
    w = {k: v if k == "router_kernel" else v.astype(dtype) for k, v in weights.items()}
    # plain dicts (a Linen module's attributes hand them back frozen), the structure of the layer's new values
    return moe_layer.moe_mlp(moe, w, h_TD, None if carried is None else dict(carried), seq_len=seq_len,
                             positions=order)


def zero_stats(cfg: Any) -> MoEStats:
    """Zero router statistics of ``cfg``'s layer (float32): the sum over no layers."""
    z = jnp.zeros((), jnp.float32)
    return MoEStats(jnp.zeros((cfg.moe.num_experts,), jnp.float32), z, z, z)


def add_stats(a: MoEStats, b: MoEStats) -> MoEStats:
    return MoEStats(*(x + jnp.asarray(y, jnp.float32) for x, y in zip(a, b)))


def aux_loss(cfg: Any, total: MoEStats) -> tuple[jax.Array, dict]:
    """``(the auxiliary loss, its metrics)`` from the router statistics summed over the ``num_layers`` layers:
    ``load_balance_coef * mean_layers(load_balance_loss) + z_loss_coef * mean_layers(z_loss)`` (Switch / GShard's
    balance loss, ST-MoE's router z-loss, eq. 5) and ``{"moe_load_balance_loss", "moe_z_loss"}`` (the means over
    layers) with ``"moe_dropped_fraction"`` (dropped choices over all ``tokens * k`` choices of every layer)."""
    moe, n = cfg.moe, cfg.num_layers
    lb, z = total.load_balance_loss / n, total.z_loss / n
    choices = jnp.sum(total.counts)
    dropped = jnp.where(choices > 0, total.dropped / jnp.where(choices > 0, choices, 1.0), 0.0)
    loss = moe.load_balance_coef * lb + moe.z_loss_coef * z
    return loss, {"moe_load_balance_loss": lb, "moe_z_loss": z, "moe_dropped_fraction": dropped}


def check_stage(cfg: Any) -> None:
    """Raises ValueError for a pipeline stage of a model whose loss has router auxiliary losses: a stage passes
    activations only (the pipeline protocol), so the losses would be dropped."""
    moe = moe_of(cfg)
    if moe is not None and (moe.load_balance_coef or moe.z_loss_coef):
        raise ValueError(f"the MoE config has load_balance_coef={moe.load_balance_coef}, z_loss_coef="
                         f"{moe.z_loss_coef}: a pipeline stage passes activations only, so these auxiliary losses "
                         "cannot reach the loss; set both to 0 under a pipeline and balance the experts with the "
                         "aux-loss-free bias (MoEConfig.bias_update_rate, e.g. 1e-3)")


def with_experts(cfg: Any, sizes: dict[tuple, int], family: str) -> tuple[Any, dict[tuple, int]]:
    """Compaction's experts group (:mod:`jaxpar.pruning.experts`): ``(cfg with moe.num_experts = E', the other
    sizes)`` when ``sizes`` holds ``("blocks", "experts")``, else ``(cfg, sizes)``. The routing groups stay: each of
    the ``num_groups`` groups keeps ``E' / num_groups`` experts (the selection keeps them so).

    Raises:
      ValueError: experts kept by a dense model; ``E' < experts_per_token``; ``E'`` not a multiple of
        ``num_groups``; a group left with one expert where it had more (group scores sum each group's top 2);
        fewer experts in ``topk_groups`` groups than ``experts_per_token``.
    """
    key = ("blocks", EXPERTS)
    if key not in sizes:
        return cfg, sizes
    moe, count = moe_of(cfg), sizes[key]
    if moe is None:
        raise ValueError(f"the {family} is dense (moe=None) but got a compacted count for blocks/experts")
    G, k = moe.num_groups, moe.experts_per_token
    if count < k:
        raise ValueError(f"compacting the {family} to {count} experts leaves fewer than experts_per_token={k}: keep "
                         f"at least {k}")
    if count % G:
        raise ValueError(f"compacting the {family} to {count} experts: group-limited routing splits them in "
                         f"num_groups={G} groups of equal size, so keep a multiple of {G} (the same number per group)")
    if count // G < min(2, moe.num_experts // G) or k > moe.topk_groups * (count // G):
        raise ValueError(f"compacting the {family} to {count} experts leaves {count // G} per routing group: a group "
                         f"is scored by its top 2 experts and topk_groups={moe.topk_groups} groups must hold "
                         f"experts_per_token={k}; keep more experts per group")
    rest = {s: n for s, n in sizes.items() if s != key}
    return dataclasses.replace(cfg, moe=dataclasses.replace(moe, num_experts=count)), rest


__all__ = ["CARRIED", "add_stats", "aux_loss", "check", "check_stage", "declare", "mlp", "mlp_params", "moe_of",
           "with_experts", "zero_stats"]
