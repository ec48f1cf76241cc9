"""Hugging Face mixtures of experts: ``MixtralForCausalLM`` (Jiang et al. 2024) as a ``"mistral"``
:class:`jaxpar.models.families.FamilyConfig` with ``moe``, ``Qwen3MoeForCausalLM`` (Yang et al. 2025) as a
``"qwen3"`` one, both as :class:`jaxpar.models.FamilyModel` params and back (config mapping and weight adapter).

The attention, norms, embedding and head are the dense family's (:mod:`jaxpar.models.hf.families`); the MLP's
tensors are the experts'. ``save_pretrained`` of transformers 5 writes (and ``from_pretrained`` reads) one tensor
per expert and projection (its modules hold them fused as ``experts.gate_up_proj [E, 2 F_e, D]`` and
``experts.down_proj [E, D, F_e]`` and convert on load and save):

* Mixtral, under ``model.layers.{i}.block_sparse_moe.``: ``gate.weight [E, D]`` (the router), ``experts.{j}.w1
  .weight [F_e, D]`` (gate), ``w3 [F_e, D]`` (up), ``w2 [D, F_e]`` (down);
* Qwen3-MoE, under ``model.layers.{i}.mlp.``: ``gate.weight [E, D]``, ``experts.{j}.gate_proj.weight`` /
  ``up_proj.weight [F_e, D]``, ``down_proj.weight [D, F_e]``;

-> ``router_kernel [N, D, E]``, ``experts_gate_kernel`` / ``experts_up_kernel [N, E, D, F_e]``,
``experts_down_kernel [N, E, F_e, D]``. Loading also reads the fused layout (``save_pretrained(...,
save_original_format=False)`` writes it, for both families under ``model.layers.{i}.mlp.``: ``gate.weight``,
``experts.gate_up_proj [E, 2 F_e, D]`` (gate rows first), ``experts.down_proj [E, D, F_e]``); saving writes the
per-expert one.

Routing: softmax over the ``E`` router logits, the top ``k`` (``num_experts_per_tok``), renormalised to sum 1
(Mixtral always; Qwen3-MoE when ``norm_topk_prob``); both compute every chosen expert (dropless), which is what
``MoEConfig(capacity_factor=None)`` computes. ``router_aux_loss_coef`` becomes ``load_balance_coef`` (training
only; it changes no output) when ``output_router_logits`` is true (transformers adds the loss only then), times
``k``: transformers' balance loss counts each token's ``k`` choices as whole tokens (``k * E * sum_i f_i P_i``
with ``f_i`` the fraction of choices), jaxpar's ``E * sum_i f_i P_i`` (and transformers pools the layers' tokens
where jaxpar averages per layer).

Refused, naming the field: a nonzero ``router_jitter_noise`` (Mixtral's multiplicative input noise in training),
a non-empty ``mlp_only_layers`` or ``decoder_sparse_step > 1`` (Qwen3-MoE layers with a dense MLP); DeepSeek-V3
by its ``model_type`` in :func:`jaxpar.models.hf.config._arch` (its attention is MLA, not built here). Saving
refuses what no such checkpoint can say: shared experts, sigmoid or group-limited routing, scaled weights, a
capacity factor, a nonzero router selection bias.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jaxpar.layers import moe as moe_layer
from jaxpar.layers.moe import MoEConfig
from jaxpar.models.families import FamilyConfig, FamilyModel
from jaxpar.models.moe_block import CARRIED
from jaxpar.models.hf import families
from jaxpar.models.hf.config import _flag, _need, _num
from jaxpar.models.hf.family_config import check_save, family_config, family_hf_config
from jaxpar.models.hf.weights import Adapter, host, span
from jaxpar.models.hf.weights import linear as linear_leaf

FAMILY = {"mixtral": "mistral", "qwen3_moe": "qwen3"}
"""config.json's ``model_type`` -> the jaxpar family of its attention and norms."""
HEADS = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# where a layer's MoE tensors are, and each projection's per-expert name: (module, gate, up, down)
_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"), "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}
_HF_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")   # the dense MLP's tensors


def _int(hf: dict, key: str, default: Any = None) -> int:
    value = hf.get(key, default) if default is not None else _need(hf, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json has {key}={value!r}; it must be a positive int")
    return value


def _refuse_unhonoured(hf: dict, kind: str) -> None:
    """Raises ValueError for the MoE fields whose computation is not built here."""
    head = HEADS[kind]
    noise = _num(hf, "router_jitter_noise", 0.0)
    if noise != 0.0:
        what = (f"{head} multiplies the router's input by uniform noise in [1 - noise, 1 + noise] while training"
                if kind == "mixtral" else f"router jitter (Mixtral's training noise on the router's input; the "
                                          f"{head} itself ignores the field)")
        raise ValueError(f"config.json has router_jitter_noise={noise}: {what}, which jaxpar's router does not "
                         "do; set it to 0.0 to load the model (its inference outputs are the same)")
    layers = hf.get("mlp_only_layers") or []
    if layers:
        raise ValueError(f"config.json has mlp_only_layers={layers!r}: those layers of the {head} have a dense MLP "
                         "instead of experts, which a jaxpar model (experts in every layer) does not compute; only "
                         "checkpoints with mlp_only_layers=[] load")
    step = hf.get("decoder_sparse_step", 1)
    if step != 1:
        raise ValueError(f"config.json has decoder_sparse_step={step!r}: only every {step}-th layer of the {head} has "
                         "experts (the others a dense MLP), which a jaxpar model (experts in every layer) does not "
                         "compute; only checkpoints with decoder_sparse_step=1 load")


def moe_config(hf: dict, **overrides: Any) -> FamilyConfig:
    """The :class:`FamilyConfig` (with ``moe``) of a Mixtral or Qwen3-MoE ``config.json`` (a dict), with
    ``overrides`` (``moe=`` replaces the MoE config read).

    Raises:
      ValueError: a field whose computation is not built here (named: see the module's docstring), a malformed
        field, a field :func:`jaxpar.models.hf.family_config.family_config` refuses.
    """
    kind = hf.get("model_type")
    _refuse_unhonoured(hf, kind)
    n, k = _need(hf, "num_hidden_layers"), _int(hf, "num_experts_per_tok")
    experts = _int(hf, "num_local_experts") if kind == "mixtral" else _int(
        hf, "num_experts" if "num_experts" in hf else "num_local_experts")
    width = _int(hf, "intermediate_size" if kind == "mixtral" else "moe_intermediate_size")
    coef = _num(hf, "router_aux_loss_coef", 0.001) * k if _flag(hf, "output_router_logits", False) else 0.0
    moe = MoEConfig(num_experts=experts, experts_per_token=k, expert_d_mlp=width,
                    norm_topk_prob=True if kind == "mixtral" else _flag(hf, "norm_topk_prob", False),
                    load_balance_coef=coef)
    dense = dict(hf)
    if kind == "qwen3_moe" and _flag(hf, "use_sliding_window", False) and "layer_types" not in hf:
        dense["layer_types"] = ["sliding_attention"] * n   # Qwen3-MoE windows every layer (no max_window_layers)
    return family_config(dense, **{"moe": moe, **overrides})


def moe_hf_config(cfg: FamilyConfig) -> dict:
    """The ``config.json`` (a dict, transformers 5's fields) of a MoE :class:`FamilyConfig`'s checkpoint."""
    moe, kind = cfg.moe, _kind(cfg)
    out = family_hf_config(cfg)
    k = moe.experts_per_token
    out.update(architectures=[HEADS[kind]], model_type=kind, num_experts_per_tok=k, num_local_experts=moe.num_experts,
               router_aux_loss_coef=moe.load_balance_coef / k, output_router_logits=moe.load_balance_coef > 0)
    if kind == "mixtral":
        out.update(intermediate_size=moe.expert_width(cfg.d_mlp), router_jitter_noise=0.0)
    else:
        out.pop("max_window_layers", None)
        out.pop("layer_types", None)
        out.update(moe_intermediate_size=moe.expert_width(cfg.d_mlp), norm_topk_prob=moe.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[])
    return out


def _kind(cfg: FamilyConfig) -> str:
    return next(kind for kind, family in FAMILY.items() if family == cfg.family)


def check_save_moe(cfg: FamilyConfig) -> None:
    """Raises ValueError for a MoE config no Mixtral or Qwen3-MoE checkpoint can say (the model transformers
    builds from it would compute something else); as :func:`jaxpar.models.hf.family_config.check_save` besides."""
    check_save(cfg)
    moe, head = cfg.moe, HEADS[_kind(cfg)]
    wrong = [(field, getattr(moe, field), want) for field, want in
             (("router", "softmax"), ("num_shared_experts", 0), ("routed_scaling_factor", 1.0), ("num_groups", 1),
              ("capacity_factor", None)) if getattr(moe, field) != want]
    if cfg.family == "mistral" and not moe.norm_topk_prob:
        wrong.append(("norm_topk_prob", False, True))
    if cfg.family == "qwen3" and cfg.windows and None in cfg.windows:
        raise ValueError(f"a {head} checkpoint windows every layer or none; this config's windows are {cfg.windows}")
    if wrong:
        field, value, want = wrong[0]
        raise ValueError(f"a {head} checkpoint computes MoEConfig.{field}={want!r}; this config has {value!r} "
                         f"(a dropless softmax top-k router without shared experts is all it can say): save a config "
                         f"with {field}={want!r}, e.g. dataclasses.replace(cfg.moe, {field}={want!r})")


class _Where(str):
    """The prefix of a checkpoint's decoder tensors (a ``str``, as every adapter's), which also says whether its
    experts are stored fused (``fused``: the layout of transformers' modules) or one tensor per expert."""
    fused: bool = False


def _prefix(names) -> _Where:
    where = _Where("model.")
    where.fused = any(n.endswith(".mlp.experts.gate_up_proj") for n in names)
    return where


def _experts(name: Callable[[int, int], str], layers: int, experts: int):
    """A leaf ``[N, E, A, B]`` from one HF ``[B, A]`` tensor per layer and expert (``name(layer, expert)``)."""
    def leaf(reader, index: tuple[slice, ...]) -> np.ndarray:
        (n0, n1), (e0, e1) = span(index[0], layers), span(index[1], experts)
        return np.stack([np.stack([reader.read(name(i, j), index[3], index[2]).T for j in range(e0, e1)])
                         for i in range(n0, n1)])
    return leaf


def _fused(name: Callable[[int], str], layers: int, width: int, offset: int = 0):
    """A leaf ``[N, E, A, B]`` (``B = width``) from one fused HF ``[E, B', A]`` tensor per layer (``name(layer)``),
    rows ``offset .. offset + width`` of its ``B'`` axis (the up projection's follow the gate's in
    ``gate_up_proj``)."""
    def leaf(reader, index: tuple[slice, ...]) -> np.ndarray:
        (n0, n1), (b0, b1) = span(index[0], layers), span(index[3], width)
        rows = slice(offset + b0, offset + b1)
        return np.stack([reader.read(name(i), index[1], rows, index[2]).transpose(0, 2, 1) for i in range(n0, n1)])
    return leaf


def _constant(shape: tuple[int, ...], value: np.ndarray):
    """A leaf ``value`` broadcast to ``shape`` (the router's fresh carried state, which a checkpoint lacks)."""
    return lambda reader, index: np.broadcast_to(np.asarray(value, np.float32), shape)[index]


def _moe_names(cfg: FamilyConfig, prefix: str) -> tuple[Callable, dict]:
    """``(router name of layer i, {leaf: per-expert name of (layer i, expert j)})`` of a checkpoint (fused: the
    layer's one tensor ``name(i)`` of each leaf)."""
    if getattr(prefix, "fused", False):
        base = lambda i: f"{prefix}layers.{i}.mlp."
        fused = lambda t: (lambda i: f"{base(i)}experts.{t}")
        return (lambda i: f"{base(i)}gate.weight"), {"experts_gate_kernel": fused("gate_up_proj"),
                                                       "experts_up_kernel": fused("gate_up_proj"),
                                                       "experts_down_kernel": fused("down_proj")}
    module, gate, up, down = _NAMES[_kind(cfg)]
    base = lambda i: f"{prefix}layers.{i}.{module}."
    per = lambda proj: (lambda i, j: f"{base(i)}experts.{j}.{proj}.weight")
    return (lambda i: f"{base(i)}gate.weight"), {"experts_gate_kernel": per(gate), "experts_up_kernel": per(up),
                                                   "experts_down_kernel": per(down)}


def _leaves(cfg: FamilyConfig, prefix: str) -> dict:
    tree = families._leaves(cfg, prefix)
    b, N, D, E = tree["blocks"], cfg.num_layers, cfg.d_model, cfg.moe.num_experts
    for leaf in ("gate_kernel", "up_kernel", "down_kernel"):
        del b[leaf]
    router, experts = _moe_names(cfg, prefix)
    b["router_kernel"] = linear_leaf(router, (E, D), 1, (1, 0), N)   # leaf [D, E] from HF [E, D]
    if getattr(prefix, "fused", False):
        F = cfg.moe.expert_width(cfg.d_mlp)
        b.update({leaf: _fused(experts[leaf], N, width, offset) for leaf, width, offset in
                  (("experts_gate_kernel", F, 0), ("experts_up_kernel", F, F), ("experts_down_kernel", D, 0))})
    else:
        b.update({leaf: _experts(name, N, E) for leaf, name in experts.items()})
    b[CARRIED] = {k: _constant((N,) + v.shape, v) for k, v in moe_layer.router_state(cfg.moe).items()}
    return tree


def _hf_shapes(cfg: FamilyConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    want = {k: v for k, v in families._hf_shapes(cfg, prefix).items() if not k.endswith(_HF_MLP)}
    D, E, F = cfg.d_model, cfg.moe.num_experts, cfg.moe.expert_width(cfg.d_mlp)
    router, experts = _moe_names(cfg, prefix)
    shape = {"experts_gate_kernel": (F, D), "experts_up_kernel": (F, D), "experts_down_kernel": (D, F)}
    for i in range(cfg.num_layers):
        want[router(i)] = (E, D)
        if getattr(prefix, "fused", False):
            want.update({experts["experts_gate_kernel"](i): (E, 2 * F, D),
                         experts["experts_down_kernel"](i): (E, D, F)})
        else:
            want.update({name(i, j): shape[leaf] for leaf, name in experts.items() for j in range(E)})
    return want


def _export(cfg: FamilyConfig, params: dict) -> dict[str, Callable[[], np.ndarray]]:
    """The checkpoint's tensors (thunks); refuses params whose router carries a nonzero selection bias.

    Raises:
      ValueError: a nonzero ``moe_router`` bias (the checkpoint's router has none: its model would choose other
        experts); params without the router state of a config with ``bias_update_rate > 0`` (its bias unknown).
    """
    b = params["blocks"]
    if CARRIED not in b and cfg.moe.bias_update_rate:
        raise ValueError(f"the params hold no router state ({CARRIED!r}) and the config's MoE has bias_update_rate="
                         f"{cfg.moe.bias_update_rate}: its selection bias (in the train state's carried state) "
                         "decides whether a checkpoint can hold this model; pass jp.train.carried.merge(params, "
                         "state.carried)")
    bias = b.get(CARRIED, {}).get("bias")
    if bias is not None and np.any(host(bias) != 0):
        raise ValueError(f"the params' router selection bias (blocks/moe_router/bias, max |bias| "
                         f"{np.abs(host(bias)).max():.3g}) is nonzero: a {HEADS[_kind(cfg)]} checkpoint has no such "
                         "bias, so transformers would route tokens to other experts than this model does; train "
                         "without the aux-loss-free bias (bias_update_rate=0) to save such a checkpoint")
    out = {k: v for k, v in families._export(cfg, params).items() if not k.endswith(_HF_MLP)}
    router, experts = _moe_names(cfg, "model.")
    for i in range(cfg.num_layers):
        out[router(i)] = lambda i=i: host(b["router_kernel"][i]).T
        for leaf, name in experts.items():
            out.update({name(i, j): (lambda leaf=leaf, i=i, j=j: host(b[leaf][i, j]).T)
                        for j in range(cfg.moe.num_experts)})
    return out


def _adapter(model_type: str) -> Adapter:
    family = FAMILY[model_type]
    return Adapter(model_type=model_type, config_type=FamilyConfig, model=FamilyModel, from_hf=moe_config,
                   to_hf=moe_hf_config, prefix=_prefix, save_prefix="model.", hf_shapes=_hf_shapes,
                   leaves=_leaves, export=_export, check_save=check_save_moe,
                   accepts=lambda cfg: cfg.family == family and cfg.moe is not None)


ADAPTERS = (_adapter("mixtral"), _adapter("qwen3_moe"))
"""The weight adapters of ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``."""

__all__ = ["ADAPTERS", "FAMILY", "HEADS", "check_save_moe", "moe_config", "moe_hf_config"]
