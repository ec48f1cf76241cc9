"""Loss scaling as an optax transform (Micikevicius et al. 2018, "Mixed Precision Training", sec. 3.2).

The loss is multiplied by a scale before differentiation so that small fp16 gradients do not flush to zero;
:func:`loss_scaling` unscales the gradients, skips the whole update when any is non-finite, and adapts a
dynamic scale.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.precision.policy import _POLICY_DTYPES, is_floating_dtype


# ------------------------------------------------------------------------------------------ loss scaling

class LossScaleState(NamedTuple):
    """State of :func:`loss_scaling`: only what changes from step to step. Every field is an array, so it
    survives jit, sharding and checkpoints.

    The hyperparameters (growth interval and factors, min and max scale, the scale's dtype) are not here:
    they live in the ``loss_scaling`` closure, from its ``DynamicLossScale``/``StaticLossScale`` config, as
    optax transforms keep theirs in closures and flax's ``DynamicScale`` on its dataclass. So a restored
    state follows the config it is given to, and two configs give states of the same tree.

    A checkpoint whose loss-scale state also holds the hyperparameters (``growth_interval``,
    ``growth_factor``, ``backoff_factor``, ``min_scale``, ``max_scale``) does not restore into this
    state: the trees differ.

    Attributes:
      scale: the current loss scale, a scalar in the config's ``dtype`` (float32 unless asked otherwise).
      good_steps: int32 scalar, finite steps in a row since the scale last changed.
      skipped: bool scalar, whether the latest update was skipped (a non-finite gradient).
      num_skipped: int32 scalar, skipped updates so far.
      inner_state: the wrapped transformation's state.
    """
    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array
    num_skipped: jax.Array
    inner_state: Any


def _is_pow2(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


def _pow2_floor(x: float) -> float:
    """The largest power of two <= ``x`` (``x`` positive, finite)."""
    return math.ldexp(0.5, math.frexp(x)[1])


def _pow2_ceil(x: float) -> float:
    """The smallest power of two >= ``x`` (``x`` positive, finite)."""
    return x if _is_pow2(x) else math.ldexp(1.0, math.frexp(x)[1])


def _max_pow2(dtype: Any) -> float:
    """The largest power of two a floating ``dtype`` holds: 2**15 for float16, 2**127 for float32/bfloat16."""
    return _pow2_floor(float(jnp.finfo(jnp.dtype(dtype)).max))


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling (Micikevicius et al. 2018, sec. 3.2; as jmp's DynamicLossScale and torch.amp's
    GradScaler).

    On a non-finite gradient the scale is multiplied by ``backoff_factor`` (not below ``min_scale``) and the
    step is skipped; after ``growth_interval`` finite steps in a row it is multiplied by ``growth_factor``
    (not above ``max_scale`` nor the largest power of two of ``dtype``: 2**15 for float16, where jmp's
    ``first_finite`` also stops, as 2**16 overflows).

    The scale stays a power of two, so multiplying the loss and dividing the gradients by it only shifts
    exponents and is exact (jmp's factor 2 and GradScaler's 2.0/0.5 keep it so). Therefore:

    * ``growth_factor`` must be a power of two >= 1 and ``backoff_factor`` a power of two in (0, 1]
      (e.g. 2.0 and 0.5, the defaults); other values raise ValueError.
    * ``initial_scale`` and ``max_scale`` are rounded **down** to a power of two and ``min_scale`` **up** to
      one (e.g. ``max_scale=1000`` becomes 512, ``min_scale=3`` becomes 4), so the scale never leaves
      the range asked for; the fields hold the rounded values.

    Raises:
      ValueError: a non-finite value, a factor that is not a power of two, ``initial_scale`` or
        ``min_scale`` above the largest power of two of ``dtype``, or (after rounding) not
        ``0 < min_scale <= initial_scale <= max_scale``.
    """
    initial_scale: float = 2.0 ** 15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0 ** 24
    dtype: Any = jnp.float32

    def __post_init__(self):
        _check_scale_dtype(self.dtype)
        for name in ("initial_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            _check_finite(name, getattr(self, name))
        if not isinstance(self.growth_interval, (int, np.integer)) or isinstance(self.growth_interval, bool) \
                or not 0 <= self.growth_interval < 2 ** 31:
            raise ValueError(f"DynamicLossScale growth_interval={self.growth_interval!r} must be an int in "
                             f"[0, 2**31) (steps; 0: never grow)")
        if self.growth_factor < 1 or not 0 < self.backoff_factor <= 1 or self.growth_interval < 0:
            raise ValueError(f"need growth_factor >= 1, 0 < backoff_factor <= 1, growth_interval >= 0; got "
                             f"{self.growth_factor}, {self.backoff_factor}, {self.growth_interval}")
        for name in ("growth_factor", "backoff_factor"):
            if not _is_pow2(float(getattr(self, name))):
                raise ValueError(f"DynamicLossScale {name}={getattr(self, name)!r} is not a power of two; the "
                                 f"scale must stay a power of two so that scaling and unscaling are exact; use "
                                 f"e.g. growth_factor=2.0, backoff_factor=0.5 (jmp's and torch.amp's defaults)")
        if not (self.min_scale > 0 and self.initial_scale > 0 and self.max_scale > 0):
            raise ValueError(f"need 0 < min_scale <= initial_scale <= max_scale, got {self.min_scale}, "
                             f"{self.initial_scale}, {self.max_scale}")
        name = jnp.dtype(self.dtype).name
        top = _max_pow2(self.dtype)
        init, lo, hi = (_pow2_floor(float(self.initial_scale)), _pow2_ceil(float(self.min_scale)),
                        _pow2_floor(float(self.max_scale)))
        if init > top or lo > top:
            raise ValueError(f"initial_scale {self.initial_scale} / min_scale {self.min_scale} exceed the largest "
                             f"{name} power of two {top} (the largest {name} value is "
                             f"{float(jnp.finfo(jnp.dtype(self.dtype)).max)}); lower them or keep the scale in "
                             f"float32")
        tiny = float(jnp.finfo(jnp.dtype(self.dtype)).tiny)
        if lo < tiny:
            raise ValueError(f"min_scale {self.min_scale} is below the smallest normal {name} value {tiny}: the "
                             f"scale could underflow to 0 and skip every step; use min_scale >= {tiny} (e.g. 1.0)")
        if not lo <= init <= hi:
            raise ValueError(f"need 0 < min_scale <= initial_scale <= max_scale, got {self.min_scale}, "
                             f"{self.initial_scale}, {self.max_scale} (as powers of two: {lo}, {init}, {hi})")
        object.__setattr__(self, "initial_scale", init)
        object.__setattr__(self, "min_scale", lo)
        object.__setattr__(self, "max_scale", hi)


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A fixed loss scale; non-finite steps are still skipped."""
    scale: float
    dtype: Any = jnp.float32

    def __post_init__(self):
        _check_scale_dtype(self.dtype)
        _check_finite("scale", self.scale)
        if not self.scale > 0 or self.scale > float(jnp.finfo(jnp.dtype(self.dtype)).max):
            raise ValueError(f"StaticLossScale({self.scale}) must be positive and finite in {jnp.dtype(self.dtype).name}")


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """Scale 1 and no skipping logic beyond the finite check (for f32 / bf16 training)."""
    dtype: Any = jnp.float32


def _check_finite(name: str, value: Any) -> None:
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool) \
            or not np.isfinite(value):
        raise ValueError(f"loss scale {name}={value!r} must be a finite number")


def _check_scale_dtype(dtype: Any) -> None:
    if not is_floating_dtype(dtype) or jnp.dtype(dtype) not in _POLICY_DTYPES:
        raise ValueError(f"loss scale dtype {dtype!r} must be a floating dtype: float32, float16 or bfloat16 "
                         "(float32 is usual)")


class _ScaleRule(NamedTuple):
    """The hyperparameters of a loss-scale config, closed over by :func:`loss_scaling` (Python numbers)."""
    initial: float    # first scale
    interval: int     # finite steps in a row before the scale grows; 0: never
    growth: float     # factor on growth (1.0: static)
    backoff: float    # factor on a non-finite step (1.0: static)
    lo: float         # the scale never goes below this ...
    hi: float         # ... nor above this (already capped at the dtype's largest power of two)
    dtype: Any        # the scale's dtype


def _scale_rule(ls) -> _ScaleRule:
    """The :class:`_ScaleRule` of a loss-scale config; TypeError for anything else."""
    if isinstance(ls, DynamicLossScale):
        dtype = jnp.dtype(ls.dtype)
        cap = min(ls.max_scale, _max_pow2(dtype))
        return _ScaleRule(ls.initial_scale, ls.growth_interval, ls.growth_factor, ls.backoff_factor,
                          ls.min_scale, cap, dtype)
    if not isinstance(ls, (StaticLossScale, NoOpLossScale)):
        raise TypeError(f"loss_scale must be NoOpLossScale, StaticLossScale or DynamicLossScale, got {ls!r}")
    scale = ls.scale if isinstance(ls, StaticLossScale) else 1.0
    return _ScaleRule(scale, 0, 1.0, 1.0, scale, scale, jnp.dtype(ls.dtype))


def all_finite(tree: Any) -> jax.Array:
    """A bool scalar: every element of every floating leaf is finite (a global reduction over shards)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def loss_scaling(inner: optax.GradientTransformation, loss_scale) -> optax.GradientTransformation:
    """Wraps ``inner`` (outermost): unscale, skip non-finite steps, adapt the scale.

    ``update(grads, state, params)`` expects gradients **of the scaled loss**. It divides them by the scale
    (in float32), and if all are finite passes them to ``inner``; otherwise it returns zero updates and keeps
    ``inner``'s state unchanged, so a skipped step skips everything inside (clipping, pruning, the
    optimizer). The decision is global: ``all_finite`` reduces over every shard. No host synchronisation.

    The config's hyperparameters stay in this closure; the state (:class:`LossScaleState`) holds only the
    scale, the counters and ``inner``'s state.

    Args:
      inner: any optax transformation (e.g. ``optax.chain(clip, adamw, magnitude_pruning(...))``).
      loss_scale: ``NoOpLossScale()``, ``StaticLossScale(s)`` or ``DynamicLossScale(...)``.

    Raises:
      TypeError: ``loss_scale`` is none of those; ``update`` given a state that is not a LossScaleState.
      ValueError: ``update`` given a state whose scale dtype is not the config's (made by another config).
    """
    rule = _scale_rule(loss_scale)

    def init_fn(params):
        return LossScaleState(scale=jnp.asarray(rule.initial, rule.dtype), good_steps=jnp.zeros((), jnp.int32),
                              skipped=jnp.asarray(False), num_skipped=jnp.zeros((), jnp.int32),
                              inner_state=inner.init(params))

    def update_fn(updates, state: LossScaleState, params=None):
        _check_state(state, rule)
        scale = state.scale.astype(jnp.float32)
        grads = jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), updates)
        finite = all_finite(grads)
        new_updates, new_inner = inner.update(grads, state.inner_state, params)
        new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        inner_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_inner, state.inner_state)
        new_scale, good = _next_scale(rule, scale, state.good_steps, finite)
        return new_updates, LossScaleState(
            scale=new_scale.astype(rule.dtype), good_steps=good, skipped=~finite,
            num_skipped=state.num_skipped + (~finite).astype(jnp.int32), inner_state=inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


def _check_state(state: Any, rule: _ScaleRule) -> None:
    if not isinstance(state, LossScaleState):
        raise TypeError(f"loss_scaling's update needs the LossScaleState its init made, got {type(state).__name__}; "
                        f"keep loss_scaling outermost and pass its whole state")
    if jnp.dtype(state.scale.dtype) != rule.dtype:
        raise ValueError(f"LossScaleState.scale is {jnp.dtype(state.scale.dtype).name} but this loss_scaling's "
                         f"config has dtype {rule.dtype.name}; the state was made by another config: init it with "
                         f"this transform (or give the config dtype={jnp.dtype(state.scale.dtype).name})")


def _next_scale(rule: _ScaleRule, scale: jax.Array, good_steps: jax.Array,
                finite: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(new scale in float32, new good_steps): back off on a non-finite step (not below ``rule.lo``), grow
    after ``rule.interval`` finite steps in a row (not above ``rule.hi``) and restart the count."""
    good = jnp.where(finite, good_steps + 1, 0)
    grow = finite & (good >= rule.interval) if rule.interval > 0 else jnp.asarray(False)
    raised = jnp.minimum(scale * rule.growth, rule.hi)
    lowered = jnp.maximum(scale * rule.backoff, rule.lo)
    new_scale = jnp.where(finite, jnp.where(grow, raised, scale), lowered)
    return new_scale, jnp.where(grow, 0, good)


def _loss_scale_states(tree: Any) -> list[LossScaleState]:
    """Every LossScaleState in ``tree``, nested ones (inside another's inner_state) included."""
    top = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, LossScaleState))
           if isinstance(x, LossScaleState)]
    return [s for t in top for s in [t, *_loss_scale_states(t.inner_state)]]


def check_outermost(opt_state: Any) -> None:
    """Raises ValueError unless a loss_scaling state, if any, is the whole ``opt_state`` (the outermost
    transform), and there is one only.

    Inside a chain, transforms before it (e.g. clipping) would see scaled gradients; two would scale twice.
    ``f32_optimizer_state`` returns its inner state unchanged, so a loss_scaling inside it stays outermost.

    Raises:
      ValueError: more than one LossScaleState in ``opt_state``, or one that is not ``opt_state`` itself.
    """
    found = _loss_scale_states(opt_state)
    if len(found) > 1:
        raise ValueError(f"opt_state holds more than one loss_scaling state ({len(found)}); wrap the optimizer "
                         f"once, outermost: tx = loss_scaling(optax.chain(clip, optimizer, ...), loss_scale)")
    if found and not isinstance(opt_state, LossScaleState):
        raise ValueError("jp.precision.loss_scaling must be the outermost transform: "
                         "tx = loss_scaling(optax.chain(clip, optimizer, ...), loss_scale), not inside a chain")


def loss_scale(opt_state: Any) -> jax.Array | None:
    """The current loss scale (a scalar in the config's dtype) of the outermost state, or None when
    ``opt_state`` is not a LossScaleState (no loss scaling).

    Raises:
      ValueError: as :func:`check_outermost` (a loss_scaling state nested inside another state, or two),
        rather than answer None for a loss scale that is there.
    """
    check_outermost(opt_state)
    return opt_state.scale if isinstance(opt_state, LossScaleState) else None


def skipped(opt_state: Any) -> jax.Array | None:
    """Whether the latest update was skipped (bool scalar) by the outermost loss_scaling, or None without
    one. Raises as :func:`loss_scale`."""
    check_outermost(opt_state)
    return opt_state.skipped if isinstance(opt_state, LossScaleState) else None


__all__ = ["DynamicLossScale", "LossScaleState", "NoOpLossScale", "StaticLossScale", "all_finite", "check_outermost",
           "loss_scale", "loss_scaling", "skipped"]
