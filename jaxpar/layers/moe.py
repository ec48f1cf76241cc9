"""A mixture-of-experts MLP any model can call: a router, routed SwiGLU experts, optional shared experts.

* **Router** (float32 under every precision policy): ``"softmax"`` scores over the E experts, top-k, the k weights
  renormalised to sum 1 (Mixtral; Qwen3-MoE's ``norm_topk_prob``); or ``"sigmoid"`` affinities (DeepSeek-V3,
  arXiv 2412.19437 sec. 2.1.2): a per-expert bias added for the **selection only**, group-limited top-k (the
  experts split in ``num_groups`` groups, only the ``topk_groups`` groups with the largest sum of their top-2
  biased scores eligible), the chosen affinities normalised and scaled by ``routed_scaling_factor``.
* **Routed experts** (SwiGLU, weights stacked ``[E, ...]``), dropless by default: the choices sorted by expert and
  ``jax.lax.ragged_dot``; or GShard's capacity mode (Lepikhin et al. 2020): ``ceil(capacity_factor * L * k / E)``
  slots per expert per sequence, first choices before second choices and earlier positions first, a choice past
  its expert's capacity dropped (it adds 0). The group is the batch row of L tokens (GShard's per-sequence
  groups), fixed whatever the mesh: under context parallelism the priority follows the tokens' true positions
  (``capacity_slots(positions=)``), so every layout drops the choices one device drops; packed documents share
  their row's slots, earlier documents first. Expert parallelism and the dispatches: :mod:`expert_parallel`.
* **Auxiliary losses**: the Switch/GShard load-balancing loss ``E * sum_i f_i P_i`` (Fedus et al. 2021, eq. 4:
  ``f_i`` the fraction of the choices routed to expert i, ``P_i`` its mean router probability) and the router
  z-loss ``mean_t logsumexp(logits_t)^2`` (ST-MoE, Zoph et al. 2022, eq. 5), returned for the model's loss.
* **Load balancing without an auxiliary loss** (DeepSeek-V3; Wang et al. 2024): the carried collection
  ``moe_router`` (:data:`ROUTER`) holds each layer's selection bias, its last step's global expert load and
  dropped count, and the bias rate. The layer returns this microbatch's counts as their cotangent; the step sums
  them over microbatches and replicas and applies :func:`update_router` once per optimizer step:
  ``bias += rate * sign(mean(load) - load)``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import _validate
from jaxpar.layers import expert_parallel
from jaxpar.protocol import declare_carried, overwrite
from jaxpar.sharding.names import CONTEXT, EMBED, EXPERT_MLP, EXPERTS, MLP, SEQ

ROUTERS = ("softmax", "sigmoid")
"""Router score functions: softmax over the experts (Mixtral, Qwen3-MoE), sigmoid affinities (DeepSeek-V3)."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (module docstring).

    Attributes:
      num_experts: E routed experts. experts_per_token: k, the experts each token is routed to (1 <= k <= E).
      expert_d_mlp: each routed expert's SwiGLU width F_e (0: the model's ``d_mlp``).
      router: one of :data:`ROUTERS`. norm_topk_prob: renormalise the chosen k weights to sum 1.
      routed_scaling_factor: the routed weights times this (DeepSeek-V3), > 0.
      num_groups, topk_groups: group-limited routing: E splits in ``num_groups`` groups, the ``topk_groups`` best
        eligible (1, 1: every expert eligible).
      num_shared_experts: dense SwiGLU experts every token passes through; shared_d_mlp: their total width (0:
        ``num_shared_experts * F_e``).
      capacity_factor: None: dropless; > 0: GShard capacity mode, ``ceil(capacity_factor * L * k / E)`` slots
        per expert per batch row of L tokens (packed documents share their row's), whatever the mesh.
      load_balance_coef, z_loss_coef: the auxiliary losses' weights in the model's loss (>= 0).
      bias_update_rate: gamma of the aux-loss-free bias step (1e-3 in DeepSeek-V3; 0: the bias stays 0).
      dispatch: the expert-parallel dispatch, one of :data:`jaxpar.layers.expert_parallel.DISPATCHES`.

    Raises:
      ValueError: from ``__post_init__``, for any field outside its range, naming it and the fix.
    """
    num_experts: int = 8
    experts_per_token: int = 2
    expert_d_mlp: int = 0
    router: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    num_shared_experts: int = 0
    shared_d_mlp: int = 0
    capacity_factor: float | None = None
    load_balance_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    dispatch: str = "ring"

    def __post_init__(self):
        E = _validate.positive_int("MoEConfig.num_experts", self.num_experts)
        k = _validate.positive_int("MoEConfig.experts_per_token", self.experts_per_token)
        if k > E:
            raise ValueError(f"MoEConfig.experts_per_token={k} > num_experts={E}: a token is routed to at most "
                             "every expert; choose experts_per_token <= num_experts")
        for name in ("expert_d_mlp", "num_shared_experts", "shared_d_mlp"):
            _validate.nonnegative_int(f"MoEConfig.{name}", getattr(self, name), " (0: the default)")
        if self.shared_d_mlp and not self.num_shared_experts:
            raise ValueError(f"MoEConfig.shared_d_mlp={self.shared_d_mlp} without shared experts (num_shared_experts=0) "
                             "would be ignored: set num_shared_experts >= 1, or shared_d_mlp=0")
        if self.router not in ROUTERS:
            raise ValueError(f"MoEConfig.router={self.router!r}; use one of {ROUTERS}")
        if self.dispatch not in expert_parallel.DISPATCHES:
            raise ValueError(f"MoEConfig.dispatch={self.dispatch!r}; use one of {expert_parallel.DISPATCHES}")
        G = _validate.positive_int("MoEConfig.num_groups", self.num_groups)
        top = _validate.positive_int("MoEConfig.topk_groups", self.topk_groups)
        if E % G:
            raise ValueError(f"MoEConfig.num_experts={E} is not divisible by num_groups={G}: routing groups split "
                             "the experts evenly; choose num_groups dividing num_experts")
        if top > G:
            raise ValueError(f"MoEConfig.topk_groups={top} > num_groups={G}: choose topk_groups <= num_groups")
        if k > top * (E // G):
            raise ValueError(f"MoEConfig.experts_per_token={k} > the {top * (E // G)} experts of topk_groups={top} "
                             f"groups of {E // G}: raise topk_groups or lower experts_per_token")
        cf = self.capacity_factor
        real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))   # numpy scalars too
        if cf is not None and not (real(cf) and 0 < cf < math.inf):
            raise ValueError(f"MoEConfig.capacity_factor={cf!r} must be None (dropless) or a finite number > 0 "
                             "(e.g. 1.25)")
        for name in ("load_balance_coef", "z_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if not (real(value) and 0 <= value < math.inf):
                raise ValueError(f"MoEConfig.{name}={value!r} must be a finite number >= 0 (0: off)")
        scale = self.routed_scaling_factor
        if not (real(scale) and 0 < scale < math.inf):
            raise ValueError(f"MoEConfig.routed_scaling_factor={scale!r} must be a finite number > 0 (1: none)")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"MoEConfig.norm_topk_prob={self.norm_topk_prob!r} must be a bool")

    def expert_width(self, d_mlp: int) -> int:
        """F_e: each routed expert's SwiGLU width (``expert_d_mlp``, or the model's ``d_mlp``)."""
        return self.expert_d_mlp or d_mlp

    def shared_width(self, d_mlp: int) -> int:
        """F_s: the shared experts' total width (0: none)."""
        return self.shared_d_mlp or self.num_shared_experts * self.expert_width(d_mlp) if self.num_shared_experts \
            else 0

    def capacity(self, group_len: int) -> int:
        """Slots per expert per group of ``group_len`` tokens: ``ceil(capacity_factor * L * k / E)``, at most ``L`` (a
        token chooses an expert once, so an expert never receives more: larger buffers would only be empty; 0:
        dropless)."""
        if self.capacity_factor is None:
            return 0
        slots = self.capacity_factor * group_len * self.experts_per_token / self.num_experts
        return group_len if slots >= group_len else math.ceil(slots)


# ------------------------------------------------------------------------------------- params and state

def param_axes(cfg: MoEConfig) -> dict[str, tuple]:
    """The logical names of one MoE block's params (unstacked), by param name."""
    out = {"router_kernel": (EMBED, None), "experts_gate_kernel": (EXPERTS, EMBED, EXPERT_MLP),
           "experts_up_kernel": (EXPERTS, EMBED, EXPERT_MLP), "experts_down_kernel": (EXPERTS, EXPERT_MLP, EMBED)}
    if cfg.num_shared_experts:
        out.update(shared_gate_kernel=(EMBED, MLP), shared_up_kernel=(EMBED, MLP), shared_down_kernel=(MLP, EMBED))
    return out


def param_shapes(cfg: MoEConfig, d_model: int, d_mlp: int) -> dict[str, tuple[int, ...]]:
    """The shapes of :func:`param_axes`' params for a model of width ``d_model`` and MLP width ``d_mlp``."""
    D, E, F, S = d_model, cfg.num_experts, cfg.expert_width(d_mlp), cfg.shared_width(d_mlp)
    out = {"router_kernel": (D, E), "experts_gate_kernel": (E, D, F), "experts_up_kernel": (E, D, F),
           "experts_down_kernel": (E, F, D)}
    if S:
        out.update(shared_gate_kernel=(D, S), shared_up_kernel=(D, S), shared_down_kernel=(S, D))
    return out


def init_params(cfg: MoEConfig, d_model: int, d_mlp: int, rng: jax.Array, dtype: Any = jnp.float32) -> dict:
    """One MoE block's params (:func:`param_shapes`), each normal with std ``1 / sqrt(fan_in)``."""
    shapes = param_shapes(cfg, d_model, d_mlp)
    keys = jax.random.split(rng, len(shapes))
    return {name: (jax.random.normal(key, shape, jnp.float32) / math.sqrt(shape[-2])).astype(dtype)
            for key, (name, shape) in zip(keys, shapes.items())}


def update_router(old: dict, total: dict) -> dict:
    """The router state after an optimizer step (:data:`ROUTER`'s update): ``total`` holds the step's summed
    counts (every microbatch and replica); the load and dropped count become them, the bias steps by
    ``rate * sign(mean_i load_i - load_i)`` (DeepSeek-V3 sec. 2.1.2), the rate stays. Leading (stacked layer)
    dims pass through."""
    load = total["load"]
    step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return {**old, "load": load, "dropped": total["dropped"], "bias": old["bias"] + old["rate"][..., None] * step}


def check_router_bias(cfg: MoEConfig, bias: Any) -> None:
    """Raises ValueError for a stored non-zero router bias (host values, any leading stacked dims) when
    ``cfg.bias_update_rate`` is 0: a bias that selects experts but never moves (a router bias without the
    aux-free mode)."""
    _refuse_bias_without_rate(np.asarray(bias), np.full(np.shape(bias)[:-1], cfg.bias_update_rate),
                              "MoEConfig.bias_update_rate is 0")


def check_router_state(state: dict) -> None:
    """:data:`ROUTER`'s check (host values of a state's ``moe_router`` subtree, leading stacked dims allowed):
    raises ValueError for a layer whose bias is non-zero while its stored ``rate`` is 0."""
    _refuse_bias_without_rate(np.asarray(state["bias"]), np.asarray(state["rate"]), "its stored rate is 0")


def _refuse_bias_without_rate(bias: np.ndarray, rate: np.ndarray, why: str) -> None:
    bad = np.any(bias != 0, axis=-1) & (rate == 0)
    if np.any(bad):
        where = f" (layers {np.flatnonzero(bad).tolist()})" if bad.ndim else ""
        raise ValueError(f"a router bias without the aux-free mode: the stored moe_router bias is non-zero{where}, max "
                         f"|bias| {np.abs(bias).max():.3g}, but {why}: it would select experts and never move; set "
                         "MoEConfig.bias_update_rate > 0 (1e-3 in DeepSeek-V3) for a state built from it, or zero "
                         "the bias")


ROUTER = declare_carried("moe_router", "sum", what="the MoE router's load and selection bias",
                         update=update_router, check=check_router_state)
"""The carried collection of each MoE layer: ``{"bias": [E], "load": [E], "dropped": [], "rate": []}`` float32."""


def router_state(cfg: MoEConfig) -> dict:
    """A fresh :data:`ROUTER` collection for one layer: zero bias, load and dropped count; the rate."""
    zeros = jnp.zeros((cfg.num_experts,), jnp.float32)
    return {"bias": zeros, "load": zeros, "dropped": jnp.zeros((), jnp.float32),
            "rate": jnp.full((), cfg.bias_update_rate, jnp.float32)}


# --------------------------------------------------------------------------------------------- routing

class Routing(NamedTuple):
    """A router's decision for tokens ``[..., D]``.

    Attributes:
      expert: ``[..., k]`` int32 chosen experts, best first. weights: ``[..., k]`` float32 their weights.
      probs: ``[..., E]`` float32 router probabilities (sigmoid: affinities normalised over E), for the
        load-balancing loss. logits: ``[..., E]`` float32.
    """
    expert: jax.Array
    weights: jax.Array
    probs: jax.Array
    logits: jax.Array


def _group_limited(cfg: MoEConfig, select: jax.Array) -> jax.Array:
    """``select`` with the experts outside the ``topk_groups`` best groups at -inf (each group scored by the sum
    of its top-2 scores, DeepSeek-V3's ``n_group`` / ``topk_group``)."""
    if cfg.num_groups == 1:
        return select
    G = cfg.num_groups
    grouped = select.reshape(*select.shape[:-1], G, -1)
    score = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], axis=-1)
    keep = jnp.sum(jax.nn.one_hot(jax.lax.top_k(score, cfg.topk_groups)[1], G, dtype=bool), axis=-2) > 0
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(select.shape)


def route(cfg: MoEConfig, router_kernel_DE: jax.Array, h: jax.Array, bias_E: jax.Array | None = None) -> Routing:
    """Routes tokens ``h`` ``[..., D]`` (module docstring), in float32; ``bias_E`` (float32, or None: 0) is added
    to the scores for the selection only."""
    logits = jnp.einsum("...d,de->...e", h.astype(jnp.float32), router_kernel_DE.astype(jnp.float32))
    if cfg.router == "softmax":
        scores = probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    select = scores if bias_E is None else scores + bias_E
    expert = jax.lax.top_k(_group_limited(cfg, select), cfg.experts_per_token)[1].astype(jnp.int32)
    weights = jnp.take_along_axis(scores, expert, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + (1e-20 if cfg.router == "sigmoid" else 0))
    return Routing(expert, weights * cfg.routed_scaling_factor, probs, logits)


def capacity_slots(cfg: MoEConfig, expert: jax.Array, seq_len: int | None = None,
                   positions: Any = None) -> tuple[jax.Array, int]:
    """``(slot, capacity)``: each choice's position in its expert's buffer (GShard priority: within a sequence,
    every first choice before any second choice, earlier positions first) and the slots per expert per
    sequence; a choice with ``slot >= capacity`` is dropped.

    ``expert``: ``[B, L, k]`` (sequences of L) or ``[T, k]`` (sequences of ``seq_len`` rows; None: one of T).
    ``positions``: int ``[L]``, the position in its sequence of the token each of a sequence's L rows holds (a
    permutation of ``0 .. L-1``, the same for every sequence: the zigzag layout of context parallelism,
    :func:`jaxpar.layers.attention.positions`); priority follows it, so the choices kept are those of the tokens
    in order whatever the layout. None: the rows are in order.

    Raises:
      ValueError: ``positions`` not of shape ``[L]``.
    """
    shape, k, E = expert.shape, expert.shape[-1], cfg.num_experts
    L = shape[1] if expert.ndim == 3 else (seq_len or shape[0])
    grouped = expert.reshape(-1, L, k)
    if positions is not None:
        if np.shape(positions) != (L,):
            raise ValueError(f"capacity_slots: positions of shape {np.shape(positions)}; give each of the {L} rows of "
                             "a sequence its position in the sequence, int [L]")
        # rows in sequence order for the running count; the inverse permutation of a host array stays static
        order = np.argsort(positions) if isinstance(positions, np.ndarray) else jnp.argsort(positions)
        grouped = jnp.take(grouped, order, axis=1)
    one = jax.nn.one_hot(grouped.transpose(0, 2, 1).reshape(grouped.shape[0], k * L), E, dtype=jnp.int32)
    slot = jnp.sum((jnp.cumsum(one, axis=1) - 1) * one, axis=-1)          # [G, k * L], rank-major order
    slot = slot.reshape(-1, k, L).transpose(0, 2, 1)
    if positions is not None:   # back to the rows' layout: row s holds the token at positions[s]
        slot = jnp.take(slot, positions, axis=1)
    return slot.reshape(shape), cfg.capacity(L)


# ----------------------------------------------------------------------------------------------- the layer

class MoEStats(NamedTuple):
    """What an MoE layer reports (float32): ``counts`` ``[E]`` choices routed to each expert (before any drop),
    ``dropped`` ``[]`` choices dropped by capacity, ``load_balance_loss`` ``[]``, ``z_loss`` ``[]``."""
    counts: jax.Array
    dropped: jax.Array
    load_balance_loss: jax.Array
    z_loss: jax.Array


def aux_losses(cfg: MoEConfig, routing: Routing, counts_E: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(load_balance_loss, z_loss)`` (module docstring) of one layer's routing, float32 scalars."""
    f = counts_E / jnp.sum(counts_E)
    P = jnp.mean(routing.probs.reshape(-1, cfg.num_experts), axis=0)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1)))
    return cfg.num_experts * jnp.sum(f * P), z


def _swiglu(h, gate_DF, up_DF, down_FD):
    return (jax.nn.silu(h @ gate_DF) * (h @ up_DF)) @ down_FD


def _check_layer_inputs(cfg: MoEConfig, w: dict, h: jax.Array, seq_len: Any, mesh: Any, rules: Any) -> None:
    """The layer's tokens, ``seq_len`` and weights' expert counts against ``cfg`` (static shapes: checked while
    tracing, before any compile). Inside a region manual over the expert axes (a pipeline's stages) the expert
    weights arrive as this device's share, ``E / n``."""
    E = cfg.num_experts
    if h.ndim not in (2, 3) or h.size == 0:
        raise ValueError(f"the MoE layer takes [T, D] tokens or [B, L, D] sequences, at least one; got {h.shape}")
    if seq_len is not None and h.ndim == 2 and (isinstance(seq_len, bool) or not isinstance(seq_len, int)
                                                 or seq_len < 1 or h.shape[0] % seq_len):
        raise ValueError(f"seq_len={seq_len!r} must be an int >= 1 dividing the {h.shape[0]} rows of the [T, D] "
                         "tokens (the rows of one sequence), or None (T is one sequence)")
    abstract = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    manual = expert_parallel.manual_axes(abstract)
    split = math.prod(abstract.shape[a] for a in expert_parallel.expert_axes(abstract, rules) if a in manual)
    # (param, its experts dim, the sizes allowed there): the router's columns, the stacked experts' leading dim
    for name, axis, allowed in (("router_kernel", -1, (E,)),
                                *((f"experts_{p}_kernel", 0, (E, E // split)) for p in ("gate", "up", "down"))):
        shape = jnp.shape(w[name]) if name in w else ()
        if not shape or shape[axis] not in allowed:
            raise ValueError(f"MoE weight {name} has shape {shape if name in w else 'missing'}: its experts dim must "
                             f"be MoEConfig.num_experts={E} (weights of another expert count: compact the config "
                             "with them, jp.pruning.compact_state, or set num_experts to theirs)")


def moe_mlp(cfg: MoEConfig, w: dict, h: jax.Array, carried: dict | None = None, *, mesh: Any = None,
            rules: Any = None, seq_len: int | None = None, positions: Any = None) -> tuple[jax.Array, MoEStats]:
    """The mixture-of-experts MLP of tokens ``h`` (module docstring).

    Args:
      cfg: the layer's config. w: its params (:func:`param_shapes`; one layer, unstacked).
      h: ``[T, D]`` tokens or ``[B, L, D]`` sequences (:func:`jaxpar.layers.per_token.tokens`), compute dtype.
      carried: the layer's :data:`ROUTER` collection (its bias selects; the layer returns its new counts as
        the cotangent), or None (no state: inference).
      mesh, rules: default the abstract mesh and the logical rules jaxpar traces under (expert parallelism where
        the rules split ``experts``: :mod:`expert_parallel`).
      seq_len: capacity mode with ``[T, D]`` tokens: the rows of one sequence (None: T is one sequence).
      positions: capacity mode: int ``[L]``, the position in its sequence of each of a sequence's rows (the zigzag
        layout of context parallelism; :func:`capacity_slots`); None: the rows are in order.

    Returns:
      ``(y, stats)``: ``y`` of ``h``'s shape and dtype; :class:`MoEStats`, global over the axes GSPMD or this
      layer partitions, local over axes that were manual before (a pipeline's stages).

    Raises:
      ValueError: capacity mode inside a region manual over the sequence's axis (a device holds part of each
        sequence there: use dropless routing), or over ``[T, D]`` tokens whose device shares are not whole
        sequences; weights whose expert count disagrees with ``cfg``; a ``seq_len`` that does not divide T; :func:`expert_parallel.check_expert_parallel`'s errors.
    """
    _check_layer_inputs(cfg, w, h, seq_len, mesh, rules)
    bias = None if carried is None else jax.lax.stop_gradient(carried["bias"]).astype(jnp.float32)
    routing = route(cfg, w["router_kernel"], h, bias)
    counts = jnp.sum(jax.nn.one_hot(routing.expert.reshape(-1), cfg.num_experts, dtype=jnp.float32), axis=0)
    slot, capacity, dropped = None, 0, jnp.zeros((), jnp.float32)
    if cfg.capacity_factor is not None:
        abstract = jax.sharding.get_abstract_mesh() if mesh is None else mesh
        seq_axes = (*expert_parallel.current_rules(rules).mesh_axes(SEQ), CONTEXT)   # a stage region drops it
        if set(seq_axes) & expert_parallel.manual_axes(abstract):
            raise ValueError("MoE capacity mode counts slots per sequence, but this region is manual over the "
                             f"sequence's mesh axes {seq_axes} (a device holds part of each sequence): use dropless "
                             "routing (capacity_factor=None) here")
        slot, capacity = capacity_slots(cfg, routing.expert, seq_len, positions)
        dropped = jnp.sum(slot >= capacity).astype(jnp.float32)
    experts = tuple(w[f"experts_{p}_kernel"].astype(h.dtype) for p in ("gate", "up", "down"))
    y = expert_parallel.dispatch(h, routing.expert, routing.weights, slot, experts, num_experts=cfg.num_experts,
                                 capacity=capacity, group_rows=seq_len, how=cfg.dispatch, mesh=mesh, rules=rules)
    if cfg.num_shared_experts:
        shared = (w[f"shared_{p}_kernel"].astype(h.dtype) for p in ("gate", "up", "down"))
        y = y + _swiglu(h, *shared).astype(jnp.float32)
    y = y.astype(h.dtype)
    if carried is not None:
        new = {"bias": counts, "load": counts, "dropped": dropped}
        y = overwrite(y, carried, {key: new.get(key, jnp.zeros_like(v)) for key, v in carried.items()})
    return y, MoEStats(counts, dropped, *aux_losses(cfg, routing, counts))


__all__ = ["MoEConfig", "MoEStats", "ROUTER", "ROUTERS", "Routing", "aux_losses", "capacity_slots", "check_router_bias",
           "check_router_state", "init_params", "moe_mlp", "param_axes", "param_shapes", "route", "router_state",
           "update_router"]
