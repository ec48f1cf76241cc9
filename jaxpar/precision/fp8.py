"""fp8 matmuls with per-tensor scaling, chosen by the precision policy (``dot=fp8`` / ``dot=fp8_current``).

Formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", sec. 3-4): activations and weights are
quantized to ``float8_e4m3fn`` (max 448), output gradients to ``float8_e5m2`` (max 57344); each tensor ``x`` is
divided by a float32 scale ``s`` before the saturating cast (``clip(x / s, -max, max)``), the fp8 product is
taken in the compute dtype (``preferred_element_type``) and multiplied back by ``s_lhs * s_rhs``. The scale
that fills the format is ``s = amax / max`` (computed as Transformer Engine does, ``1 / (max / amax)``, and
1 where ``amax`` is 0 or not finite: ``flax.linen.fp8_ops.compute_scale``).

Two scaling recipes:

* ``"delayed"`` (policy ``dot=fp8``; Transformer Engine's default ``DelayedScaling``): each matmul keeps, per
  operand (input, kernel, output gradient), an amax history of the last ``amax_history`` steps and a scale.
  A step quantizes with the scale computed from the *previous* history's maximum, then records its own
  amax in slot 0 of the rolled history. The algorithm is flax's ``Fp8DirectDotGeneralOp`` (its
  ``fp8_scaled_dot_general``: ``in_q``, ``quantized_dot``, ``out_dq``, ``update_fp8_meta``), called here with
  the meta state jaxpar keeps, so the operands of the lowered dots are fp8. (flax's ``Fp8DotGeneralOp``, the
  quantize-dequantize form, implements the same recipe but leaves the dot itself in the compute dtype.)
* ``"current"`` (policy ``dot=fp8_current``; just-in-time scaling): each tensor's scale is computed from its
  own amax at the moment it is quantized; no state. :func:`current_scaled_dot_general`, built from flax's
  ``quantize``, ``dequantize``, ``compute_scale`` and ``dot_general_transpose_lhs/rhs``.

The meta state ("OWG", overwrite-with-gradient, flax's ``_overwrite_with_gradient`` collection): a dict per
matmul with ``input_amax_history``, ``kernel_amax_history``, ``output_grad_amax_history`` (float32
``[amax_history]``) and ``input_scale``, ``kernel_scale``, ``output_grad_scale`` (float32 ``[1]``), flax's names
and shapes. In a params tree it sits under the key :data:`OWG` at any depth (the GPT: ``blocks/OWG/{qkv, out,
up, down}``, with the blocks' leading layers axis; a Linen model using :class:`DotGeneral`: the variables dict's
``OWG`` collection beside ``params``). It is carried state (:data:`CARRIED`, :mod:`jaxpar.train.carried`):
``jp.train.init_state`` takes it out of the params into the state's carried state, read as ``TrainState.fp8``
(replicated on every device, checkpointed with the state); the train step puts it back, differentiates with
respect to both, hands only the params' gradients to the optax chain and replaces the meta state by its
"gradient", which the custom VJPs define as the new value. Gradient accumulation and the pipeline combine the
new values of the microbatches by a maximum (the declared rule; a ``pmax`` over the manual batch axes): the
scales are equal (computed from the same old history) and slot 0 becomes the amax over all microbatches, so
delayed scaling through ``jp.pipeline`` equals one device (single-chunk schedules; a state in a multi-chunk
stage layout is refused).
Over data/fsdp/tensor shards nothing is summed: under GSPMD ``jnp.max(|x|)`` of a sharded tensor is a global
reduction (the partitioner inserts an all-reduce max, also inside the custom VJPs), so every shard records the
global amax and the replicated meta state needs no further reduction. (A partitioned bf16 program may still
compute a tensor one ulp away from one device's: XLA's excess precision, on by default, and sums split over
``tensor``; fp8 rounding amplifies such ulps: ``benchmarks/fp8_parity.py``.) Policy casts never touch leaves
under :data:`OWG`.

A model opts in per matmul (without an fp8 policy in context each route is the plain ``lax.dot_general``):

* Linen: ``nn.Dense(..., dot_general_cls=jp.fp8.DotGeneral)`` (:class:`DotGeneral`), both recipes;
* NNX: ``nnx.Linear(..., dot_general=jp.fp8.NnxDotGeneral())``, one instance per layer
  (:class:`NnxDotGeneral`: its meta state is an ``nnx.Param`` under :data:`OWG`, so ``init_state`` moves it to
  ``TrainState.fp8`` as a Linen model's), both recipes; ``dot_general=jp.fp8.dot_general`` (the bare function,
  which takes Flax's ``precision=``, ``preferred_element_type=``, ``out_sharding=``) serves ``dot=fp8_current``
  only: delayed scaling needs variables to keep its state in, and it raises a ValueError saying so;
* any function: :func:`matmul` / :func:`dot_general` with its meta (:func:`declare` in a Linen ``setup``).

A policy asking for fp8 on a model that did not opt in is refused when the train step is first called or
lowered (:func:`check_program`: no matmul of the traced program has fp8 operands), rather than training in the
compute dtype without a word.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT as OWG
from jax import lax

from jaxpar import protocol
from jaxpar.precision import policy as precision_policy
from jaxpar.precision.policy import Policy
from jaxpar.sharding.names import PIPE
from jaxpar._hlo import stablehlo_dots

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
RECIPES = {"fp8": "delayed", "fp8_current": "current"}     # Policy.dot -> scaling recipe
META_KEYS = ("input_amax_history", "kernel_amax_history", "output_grad_amax_history", "input_scale",
             "kernel_scale", "output_grad_scale")
CARRIED = protocol.declare_carried(
    OWG, "max", what="fp8 meta state (scales, amax histories)", attribute="fp8",
    fix="build it with the policy that wrote the checkpoint (jp.train.abstract_state(..., policy=...)); a state "
        "without it was written without fp8 delayed scaling (dot=fp8): restore with that policy, or start the fp8 "
        "run from scratch")
"""The meta state is carried state (:mod:`jaxpar.train.carried`): new values combine by a maximum (both microbatches
start from the same old state, so their scales are equal and their histories differ in slot 0 only, where the
maximum is the amax over both), read as ``TrainState.fp8``."""


# ------------------------------------------------------------------------------------------------ context

def recipe(policy: Policy | None) -> str | None:
    """``"delayed"``, ``"current"`` or None: the scaling recipe of ``policy.dot``."""
    return None if policy is None or policy.dot is None else RECIPES[policy.dot]


using = precision_policy.using
"""Makes ``policy`` the one :func:`matmul`, :func:`declare` and :class:`DotGeneral` read while tracing
(:func:`jaxpar.precision.policy.using`: jaxpar's ``init_state``, ``abstract_state`` and steps enter it)."""


def active() -> Policy | None:
    """The policy in context when it asks for fp8 matmuls, else None."""
    policy = precision_policy.active()
    return policy if recipe(policy) is not None else None


# ---------------------------------------------------------------------------------------------- meta state

def init_meta(history: int) -> dict[str, jax.Array]:
    """One matmul's delayed-scaling meta state: amax histories of zeros (float32 ``[history]``) and scales of
    one (float32 ``[1]``), as flax's ``Fp8DotGeneralBase`` initializes them."""
    zeros, one = jnp.zeros((history,), jnp.float32), jnp.ones((1,), jnp.float32)
    return {k: (one if k.endswith("scale") else zeros) for k in META_KEYS}


def declare(module: nn.Module, names: tuple[str, ...]) -> dict | None:
    """In a Linen module's ``setup``: the meta state of its matmuls ``names`` as the param :data:`OWG` (a dict
    name -> :func:`init_meta`) when the policy in context uses delayed scaling, else None.

    Raises:
      ValueError: delayed scaling in context but the params applied hold no meta state (a state built
        without the fp8 policy, or meta dropped from the params).
    """
    policy = active()
    if recipe(policy) != "delayed":
        return None
    if not module.is_initializing() and not module.has_variable("params", OWG):
        raise ValueError(f"the policy {policy} asks for fp8 matmuls with delayed scaling, but the params of "
                         f"{type(module).__name__} hold no fp8 meta state ({OWG!r}): build the state with "
                         "jp.train.init_state(..., policy=policy), or restore it from a checkpoint written with "
                         "that policy")
    return module.param(OWG, lambda _: {n: init_meta(policy.amax_history) for n in names})


def split(tree: Any) -> tuple[Any, Any]:
    """``(tree without its OWG entries, the OWG entries)``: every subtree under the key :data:`OWG` of a nested
    mapping, in a tree of the same nesting holding only those (None when there is none); a mapping that held
    meta state only (an NNX layer's :class:`NnxDotGeneral`) is dropped from the first. :func:`merge` restores it
    (:func:`jaxpar.protocol.split_carried` for the meta state alone)."""
    return protocol.split_carried(tree, (OWG,))


def merge(params: Any, meta: Any) -> Any:
    """The inverse of :func:`split`: ``meta``'s entries put back into ``params`` (``params`` itself for None)."""
    return protocol.merge_carried(params, meta)


def is_meta(path: tuple) -> bool:
    """Whether a key path (``jax.tree_util``'s) leads into fp8 meta state (a key :data:`OWG` on the way)."""
    return any(getattr(k, "key", None) == OWG for k in path)


def add(path: tuple, acc: jax.Array, value: jax.Array) -> jax.Array:
    """How a gradient accumulator takes one more microbatch's leaf at ``path``: ``acc + value``, or the maximum
    for fp8 meta state (:func:`max_combine`)."""
    return jnp.maximum(acc, value) if is_meta(path) else acc + value


def max_combine(a: Any, b: Any) -> Any:
    """Combines two microbatches' new meta states (:func:`split` of their gradients): elementwise maximum.

    Both started from the same old state, so their scales are equal and their histories differ in slot 0
    only, where the maximum is the amax over both microbatches. Zeros are a neutral start (amaxes are >= 0,
    scales > 0)."""
    return None if a is None else jax.tree.map(jnp.maximum, a, b)


# --------------------------------------------------------------------------------------------- matmuls

def _amax_scale(x: jax.Array, q_dtype: Any) -> jax.Array:
    """Current scaling: the float32 scale ``amax(|x|) / max(q_dtype)`` (1 for an all-zero ``x``), by flax's
    ``compute_scale`` (Transformer Engine's formula). Inside a ``shard_map`` (the pipeline) the amax is a
    ``pmax`` over the manual axes other than ``pipe`` (the batch shards), so every shard uses the global scale."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    manual = tuple(a for a in getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) if a != PIPE)
    if manual:
        amax = lax.pmax(amax, manual)
    return fp8_ops.compute_scale(amax, jnp.ones((), jnp.float32), fp8_ops.get_fp8_max(q_dtype, jnp.float32))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def current_scaled_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, dtype: Any) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` in fp8 with current (just-in-time) scaling.

    Forward: ``lhs`` and ``rhs`` quantized to e4m3 with ``s = amax / 448`` each, their fp8 product taken in
    ``dtype`` and multiplied by ``s_lhs * s_rhs``. Backward: the output gradient quantized to e5m2 with its own
    ``amax / 57344``; both operand gradients are fp8 products (e5m2 x e4m3) dequantized by their scales. The
    residuals are the fp8 operands and their scales (as Transformer Engine saves them).

    Args:
      lhs, rhs: arrays in the compute dtype ``dtype`` (float32 or bfloat16).
      dimension_numbers: as ``lax.dot_general``'s.
      dtype: the compute dtype: the quantization arithmetic, the product's accumulation and the result.
    """
    return _current_fwd(lhs, rhs, dimension_numbers, dtype)[0]


def _current_fwd(lhs, rhs, dimension_numbers, dtype):
    s_l, s_r = _amax_scale(lhs, E4M3), _amax_scale(rhs, E4M3)
    q_l, q_r = fp8_ops.quantize(lhs, E4M3, s_l, dtype), fp8_ops.quantize(rhs, E4M3, s_r, dtype)
    y = lax.dot_general(q_l, q_r, dimension_numbers, preferred_element_type=dtype)
    return fp8_ops.dequantize(y, dtype, s_l * s_r), (q_l, s_l, q_r, s_r)


def _current_bwd(dimension_numbers, dtype, res, g):
    q_l, s_l, q_r, s_r = res
    s_g = _amax_scale(g, E5M2)
    q_g = fp8_ops.quantize(g, E5M2, s_g, dtype)
    kw = dict(dimension_numbers=dimension_numbers, precision=lax.Precision.HIGHEST, preferred_element_type=dtype)
    d_l = fp8_ops.dot_general_transpose_lhs(q_g, q_l, q_r, **kw)
    d_r = fp8_ops.dot_general_transpose_rhs(q_g, q_l, q_r, **kw)
    return fp8_ops.dequantize(d_l, dtype, s_r * s_g), fp8_ops.dequantize(d_r, dtype, s_l * s_g)


current_scaled_dot_general.defvjp(_current_fwd, _current_bwd)


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, meta: dict | None = None,
                policy: Policy | None = None, *, precision: Any = None, preferred_element_type: Any = None,
                out_sharding: Any = None) -> jax.Array:
    """``lax.dot_general`` in fp8 as ``policy`` (default: the one in context, :func:`using`) asks.

    ``lhs`` is cast to ``rhs``'s dtype (the compute dtype: flax's rule), which is also the result's. No fp8
    policy: the plain ``lax.dot_general`` (with ``precision``, ``preferred_element_type``, ``out_sharding``).
    Delayed scaling: flax's ``fp8_scaled_dot_general`` with ``meta`` (:func:`init_meta`'s dict; its new values
    are the cotangents of ``meta``). Current scaling: :func:`current_scaled_dot_general` (``meta`` unused).

    The keyword arguments are those Flax passes to a layer's dot-general (``nnx.Linear(..., dot_general=
    jp.fp8.dot_general)``: NNX with ``dot=fp8_current``). Under an fp8 policy ``precision`` is ignored (the fp8
    product sets its own), the result is cast to ``preferred_element_type`` when given and constrained to
    ``out_sharding`` when given.

    Raises:
      ValueError: delayed scaling without ``meta`` (a bare function has nowhere to keep it: NNX layers take
        :class:`NnxDotGeneral`, Linen layers :class:`DotGeneral`).
    """
    policy = active() if policy is None else policy
    how = recipe(policy)
    if how is None:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, out_sharding=out_sharding)
    dtype = rhs.dtype
    lhs = lhs.astype(dtype)
    if how == "current":
        y = current_scaled_dot_general(lhs, rhs, dimension_numbers, dtype)
    elif meta is None:
        raise ValueError(f"dot={policy.dot} (fp8 delayed scaling) needs each matmul's meta state (amax histories "
                         "and scales), which a bare jp.fp8.dot_general has nowhere to keep: NNX layers take "
                         "dot_general=jp.fp8.NnxDotGeneral() (one per layer), Linen layers dot_general_cls="
                         "jp.fp8.DotGeneral, a function jp.fp8.matmul(x, w, meta) with meta from jp.fp8.declare; or "
                         "use dot=fp8_current (no state), with which a bare jp.fp8.dot_general works")
    else:
        y = fp8_ops.fp8_scaled_dot_general(
            lhs, rhs, dimension_numbers, preferred_element_type=dtype, lhs_scale=meta["input_scale"],
            rhs_scale=meta["kernel_scale"], grad_scale=meta["output_grad_scale"],
            lhs_amax_history=meta["input_amax_history"], rhs_amax_history=meta["kernel_amax_history"],
            grad_amax_history=meta["output_grad_amax_history"], quantize_compute_type=dtype)
    if preferred_element_type is not None:
        y = y.astype(preferred_element_type)
    return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)


def matmul(x_TD: jax.Array, w_DF: jax.Array, meta: dict | None = None) -> jax.Array:
    """``x_TD @ w_DF`` (``x`` 2-D, or ``[B, L, D]`` where the sequence is sharded over a context axis: its last
    axis contracted), through :func:`dot_general` under an fp8 policy in context; without one exactly
    ``x_TD @ w_DF`` (the program is unchanged)."""
    if active() is None:
        return x_TD @ w_DF
    return dot_general(x_TD, w_DF, (((x_TD.ndim - 1,), (0,)), ((), ())), meta)


class DotGeneral(nn.Module):
    """A Linen dot-general for a user's model: ``nn.Dense(..., dot_general_cls=jp.fp8.DotGeneral)``, or called
    as ``DotGeneral()(lhs, rhs, dimension_numbers)``.

    Under an fp8 policy in context (jaxpar's ``init_state`` and steps enter the state's policy) it runs
    :func:`dot_general`; with delayed scaling its meta state lives in the :data:`OWG` collection under flax's
    names (as ``flax.linen.Fp8DirectDotGeneralOp``), which ``init_state`` moves to ``TrainState.fp8`` and the
    step passes back in the variables dict the loss applies (``model.apply(params, x)``). Outside (no policy,
    plain ``model.apply``) it is ``lax.dot_general`` and declares nothing.
    """

    def setup(self):
        policy = active()
        if recipe(policy) == "delayed":
            self.meta = {k: self.variable(OWG, k, lambda v=v: v).value
                         for k, v in init_meta(policy.amax_history).items()}
        else:
            self.meta = None

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
        return dot_general(lhs, rhs, dimension_numbers, self.meta, precision=precision,
                           preferred_element_type=preferred_element_type, out_sharding=out_sharding)


class _Meta(nnx.Module):
    """One matmul's delayed-scaling meta state as NNX ``Param`` variables under flax's names (:func:`init_meta`)."""

    def __init__(self, history: int):
        for k, v in init_meta(history).items():
            setattr(self, k, nnx.Param(v))


class NnxDotGeneral(nnx.Module):
    """An NNX dot-general for a user's layer, both recipes: ``nnx.Linear(..., dot_general=jp.fp8.NnxDotGeneral())``
    (one instance per layer: an instance holds one matmul's meta state).

    Built under a delayed-scaling policy (``jp.train.init_state`` constructs the model inside the state's policy)
    it holds :func:`init_meta`'s state as ``nnx.Param`` variables under the attribute :data:`OWG`, so the meta
    sits in the params at ``.../dot_general/_overwrite_with_gradient/...``; ``init_state`` moves it to
    ``TrainState.fp8`` as it does a Linen model's, and the step merges it back, so the NNX model the loss gets
    (``nnx.merge``) reads it and its VJP gives the new values. Otherwise it holds nothing. Called, it runs
    :func:`dot_general` with the policy in context: a plain ``lax.dot_general`` without one. (A bare
    ``dot_general=jp.fp8.dot_general`` serves ``dot=fp8_current`` only: it has no variables to keep the
    delayed recipe's state in.)
    """

    def __init__(self):
        policy = active()
        if recipe(policy) == "delayed":
            setattr(self, OWG, _Meta(policy.amax_history))

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
        """:func:`dot_general` with this layer's meta state (Flax's dot-general call form).

        Raises:
          ValueError: a delayed-scaling policy in context and no meta state here (the model was built without
            that policy).
        """
        held = getattr(self, OWG, None)
        if held is None and recipe(active()) == "delayed":
            raise ValueError(f"the policy {active()} asks for fp8 delayed scaling (dot=fp8) but this NnxDotGeneral "
                             "was built without it and holds no meta state: build the model through "
                             "jp.train.init_state(model_fn, tx, rng, mesh=mesh, policy=policy), which constructs it "
                             "under the policy (or restore a checkpoint written with that policy)")
        meta = None if held is None else {k: getattr(held, k)[...] for k in META_KEYS}
        return dot_general(lhs, rhs, dimension_numbers, meta, precision=precision,
                           preferred_element_type=preferred_element_type, out_sharding=out_sharding)


# --------------------------------------------------------------------------------------- the program's dots

def fp8_dot_counts(lowered: Any) -> dict[str, int]:
    """The lowered program's fp8 matmuls by operand types, e.g. ``{"e4m3 x e4m3": 16, "e5m2 x e4m3": 32}``.

    Args:
      lowered: a ``jax.stages.Lowered`` (``step.lower(state, batch)``) or its StableHLO text. The lowered
        program is what JAX hands to XLA: XLA:GPU runs these dots on fp8 tensor cores (cuBLASLt), XLA:CPU
        emulates them (it converts the fp8 operands to float32 after compilation: the values are fp8's).
    """
    text = lowered if isinstance(lowered, str) else lowered.as_text()
    short = {"f8E4M3FN": "e4m3", "f8E5M2": "e5m2"}
    counts: dict[str, int] = {}
    for a, b in stablehlo_dots(text):
        if a not in short or b not in short:
            continue
        key = f"{short[a]} x {short[b]}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def _jaxprs(params: Mapping) -> Any:
    """The sub-programs among an equation's params (scan, cond, shard_map, custom_vjp and pjit bodies)."""
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            x = getattr(x, "jaxpr", x)          # a ClosedJaxpr holds its Jaxpr
            if hasattr(x, "eqns"):
                yield x


def _has_fp8_dot(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and any(
                jnp.dtype(getattr(v.aval, "dtype", jnp.float32)).name.startswith("float8") for v in eqn.invars):
            return True
        if any(_has_fp8_dot(sub) for sub in _jaxprs(eqn.params)):
            return True
    return False


def check_program(jaxpr: Any, policy: Policy | None) -> None:
    """Refuses a traced step whose policy asks for fp8 matmuls when none of its matmuls is fp8.

    A model whose layers did not opt in (a plain ``nn.Dense``, ``nnx.Linear`` or ``x @ w``) would otherwise
    train in the compute dtype under ``dot=fp8`` without a word. The train step calls this once per compiled
    program, on the program it traced (``jax.jit(...).trace``), before running or lowering it.

    Args:
      jaxpr: the step's traced program (a ``ClosedJaxpr`` or ``Jaxpr``; every sub-program is searched).
      policy: the state's precision policy; nothing is checked without ``dot=``.

    Raises:
      ValueError: ``dot=fp8`` / ``dot=fp8_current`` and no ``dot_general`` with an fp8 operand in the program,
        naming the ways a model opts in.
    """
    if recipe(policy) is None or _has_fp8_dot(getattr(jaxpr, "jaxpr", jaxpr)):
        return
    raise ValueError(
        f"the policy {policy} asks for fp8 matmuls (dot={policy.dot}), but no matmul of this step's program is "
        "fp8: the model's layers did not opt in, so it would train in the compute dtype. Opt in (both recipes): "
        "Linen nn.Dense(..., dot_general_cls=jp.fp8.DotGeneral); NNX nnx.Linear(..., dot_general="
        "jp.fp8.NnxDotGeneral()), one per layer (a bare dot_general=jp.fp8.dot_general serves dot=fp8_current "
        "only); any function jp.fp8.matmul(x, w, meta) / jp.fp8.dot_general (jaxpar's GPT and Llama opt in). "
        "Or drop dot= from the policy")


precision_policy.add_program_check(check_program)

__all__ = ["CARRIED", "DotGeneral", "META_KEYS", "NnxDotGeneral", "OWG", "RECIPES", "add", "check_program",
           "current_scaled_dot_general", "declare", "dot_general", "fp8_dot_counts", "init_meta", "is_meta", "matmul",
           "max_combine", "merge", "recipe", "split", "using"]
