"""Mixed precision: dtype policies and loss scaling as an optax transform.

A policy follows DeepMind jmp's convention (Micikevicius et al. 2018, "Mixed Precision Training", sec. 3):
parameters are stored in ``param_dtype`` (fp32 master weights), cast to ``compute_dtype`` for the forward
and backward pass, and outputs are cast to ``output_dtype``. Casts touch floating-point leaves only.

Loss scaling (Micikevicius et al. 2018, sec. 3.2): the loss is multiplied by a scale before
differentiation so small fp16 gradients do not flush to zero; :func:`loss_scaling` unscales the gradients,
skips the whole update when any is non-finite, and adapts a dynamic scale.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

_DTYPES = {
    "float32": jnp.float32, "f32": jnp.float32, "fp32": jnp.float32, "float": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "f16": jnp.float16, "fp16": jnp.float16, "half": jnp.float16,
}
_KEYS = {"params": "param_dtype", "p": "param_dtype", "param": "param_dtype",
         "compute": "compute_dtype", "c": "compute_dtype",
         "output": "output_dtype", "o": "output_dtype"}


def _parse_dtype(text: str) -> Any:
    try:
        return _DTYPES[text.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {text!r} in policy; use one of {sorted(set(_DTYPES))}") from None


def _cast(tree: Any, dtype: Any) -> Any:
    def cast(x):
        if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) and jnp.issubdtype(x.dtype, jnp.floating):
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
            return x.astype(dtype)
        return x
    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters are stored in, computed in, and returned in.

    Attributes:
      param_dtype: storage dtype of parameters (master weights), e.g. ``jnp.float32``.
      compute_dtype: dtype of the forward/backward pass.
      output_dtype: dtype of model outputs (logits) and the loss.
    """
    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            try:
                dtype = jnp.dtype(value) if value is not None else None
            except TypeError:
                dtype = None
            if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize > 4:
                raise ValueError(f"Policy {f.name}={value!r} must be float32, bfloat16 or float16")
            object.__setattr__(self, f.name, dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """Casts floating leaves to ``param_dtype``; ints, bools and Python scalars are untouched."""
        return _cast(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts floating leaves to ``compute_dtype``."""
        return _cast(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts floating leaves to ``output_dtype``."""
        return _cast(tree, self.output_dtype)

    @classmethod
    def from_string(cls, text: str) -> "Policy":
        """Parses jmp's format, e.g. ``"params=float32,compute=bfloat16,output=float32"`` or ``"bf16"``.

        Keys ``params/compute/output`` (or ``p/c/o``); dtypes ``float32/bfloat16/float16`` (or
        ``f32/bf16/f16``). A bare dtype sets all three (as in jmp). Missing keys default to: params
        float32, compute follows params, output follows compute. Named presets: ``"mixed_bf16"``
        (params f32, compute bf16, output f32) and ``"mixed_fp16"`` (the same with f16).

        Raises:
          ValueError: an empty string, an unknown key or an unknown dtype.
        """
        if not isinstance(text, str):
            raise TypeError(f"policy must be given as a str, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"empty policy string {text!r}; e.g. 'params=float32,compute=bfloat16,output=float32'")
        if text.strip().lower() in PRESETS:
            return cls.from_string(PRESETS[text.strip().lower()])
        if "=" not in text:
            d = _parse_dtype(text)
            return cls(d, d, d)
        found: dict[str, Any] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep or key.strip().lower() not in _KEYS:
                raise ValueError(f"unknown policy key in {part!r}; use params=, compute=, output= (or p=, c=, o=)")
            if _KEYS[key.strip().lower()] in found:
                raise ValueError(f"policy {text!r} sets {_KEYS[key.strip().lower()]} twice; give each key once")
            found[_KEYS[key.strip().lower()]] = _parse_dtype(value)
        p = found.get("param_dtype", jnp.float32)
        c = found.get("compute_dtype", p)
        return cls(p, c, found.get("output_dtype", c))

    def __str__(self) -> str:
        return f"params={self.param_dtype.name},compute={self.compute_dtype.name},output={self.output_dtype.name}"


PRESETS = {
    "mixed_bf16": "params=float32,compute=bfloat16,output=float32",
    "mixed_fp16": "params=float32,compute=float16,output=float32",
}


def f32_optimizer_state(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Runs ``inner`` on float32 copies of low-precision params and gradients.

    optax keeps moments in the param dtype (Adam's ``nu`` in bf16 for bf16 params, which loses small
    second moments); this keeps every optimizer-state leaf in float32 and casts the updates back to each
    param's dtype. Float32 params pass through unchanged.
    """
    up = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32) if _is_low_float(x) else x, t)

    def init_fn(params):
        return inner.init(up(params))

    def update_fn(updates, state, params=None):
        new, state = inner.update(up(updates), state, None if params is None else up(params))
        return jax.tree.map(lambda n, u: n.astype(u.dtype), new, updates), state

    return optax.GradientTransformation(init_fn, update_fn)


def _is_low_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4


# ------------------------------------------------------------------------------------------ loss scaling

class LossScaleState(NamedTuple):
    """State of :func:`loss_scaling`; every field is an array so it survives jit, sharding and checkpoints.

    Attributes:
      scale: the current loss scale (float32 or float16 scalar).
      good_steps: int32, finite steps in a row since the scale last changed.
      growth_interval: int32, finite steps in a row after which the scale grows (0: never).
      growth_factor, backoff_factor, min_scale, max_scale: float32 scalars.
      skipped: bool, whether the latest update was skipped (a non-finite gradient).
      num_skipped: int32, skipped updates so far.
      inner_state: the wrapped transformation's state.
    """
    scale: jax.Array
    good_steps: jax.Array
    growth_interval: jax.Array
    growth_factor: jax.Array
    backoff_factor: jax.Array
    min_scale: jax.Array
    max_scale: jax.Array
    skipped: jax.Array
    num_skipped: jax.Array
    inner_state: Any


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling (Micikevicius et al. 2018, sec. 3.2; as torch.amp's GradScaler).

    On a non-finite gradient the scale is multiplied by ``backoff_factor`` (not below ``min_scale``) and the
    step is skipped; after ``growth_interval`` finite steps in a row it is multiplied by ``growth_factor``
    (not above ``max_scale`` nor the largest finite value of ``dtype``).
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
        top = float(jnp.finfo(jnp.dtype(self.dtype)).max)
        if self.initial_scale > top or self.min_scale > top:
            raise ValueError(f"initial_scale {self.initial_scale} / min_scale {self.min_scale} exceed the largest "
                             f"{jnp.dtype(self.dtype).name} value {top}; lower them or keep the scale in float32")
        if not (self.min_scale > 0 and self.min_scale <= self.initial_scale <= self.max_scale):
            raise ValueError(f"need 0 < min_scale <= initial_scale <= max_scale, got {self.min_scale}, "
                             f"{self.initial_scale}, {self.max_scale}")
        if self.growth_factor < 1 or not 0 < self.backoff_factor <= 1 or self.growth_interval < 0:
            raise ValueError(f"need growth_factor >= 1, 0 < backoff_factor <= 1, growth_interval >= 0; got "
                             f"{self.growth_factor}, {self.backoff_factor}, {self.growth_interval}")


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


def is_floating_dtype(value: Any) -> bool:
    """Whether ``value`` names a floating-point dtype (``jnp.float32``, ``"bfloat16"``, ...)."""
    try:
        return value is not None and bool(jnp.issubdtype(jnp.dtype(value), jnp.floating))
    except TypeError:
        return False


def _check_scale_dtype(dtype: Any) -> None:
    if not is_floating_dtype(dtype):
        raise ValueError(f"loss scale dtype {dtype!r} must be a floating dtype (float32 or float16)")


def _scale_params(ls) -> tuple[float, int, float, float, float, float, Any]:
    """(initial, growth_interval, growth, backoff, min, max, dtype) of a loss-scale config."""
    if isinstance(ls, DynamicLossScale):
        dtype = jnp.dtype(ls.dtype)
        cap = min(ls.max_scale, float(jnp.finfo(dtype).max))
        return (ls.initial_scale, ls.growth_interval, ls.growth_factor, ls.backoff_factor, ls.min_scale, cap, dtype)
    scale = ls.scale if isinstance(ls, StaticLossScale) else 1.0
    if not isinstance(ls, (StaticLossScale, NoOpLossScale)):
        raise TypeError(f"loss_scale must be NoOpLossScale, StaticLossScale or DynamicLossScale, got {ls!r}")
    return scale, 0, 1.0, 1.0, scale, scale, jnp.dtype(ls.dtype)


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

    Args:
      inner: any optax transformation (e.g. ``optax.chain(clip, adamw, magnitude_pruning(...))``).
      loss_scale: ``NoOpLossScale()``, ``StaticLossScale(s)`` or ``DynamicLossScale(...)``.
    """
    init_scale, interval, growth, backoff, lo, hi, dtype = _scale_params(loss_scale)

    def init_fn(params):
        f32 = lambda v: jnp.asarray(v, jnp.float32)
        return LossScaleState(
            scale=jnp.asarray(init_scale, dtype), good_steps=jnp.zeros((), jnp.int32),
            growth_interval=jnp.asarray(interval, jnp.int32), growth_factor=f32(growth),
            backoff_factor=f32(backoff), min_scale=f32(lo), max_scale=f32(hi),
            skipped=jnp.asarray(False), num_skipped=jnp.zeros((), jnp.int32), inner_state=inner.init(params))

    def update_fn(updates, state: LossScaleState, params=None):
        scale = state.scale.astype(jnp.float32)
        grads = jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), updates)
        finite = all_finite(grads)
        new_updates, new_inner = inner.update(grads, state.inner_state, params)
        new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        inner_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_inner, state.inner_state)
        good = jnp.where(finite, state.good_steps + 1, 0)
        grow = finite & (state.growth_interval > 0) & (good >= state.growth_interval)
        raised = jnp.minimum(scale * state.growth_factor, state.max_scale)
        lowered = jnp.maximum(scale * state.backoff_factor, state.min_scale)
        new_scale = jnp.where(finite, jnp.where(grow, raised, scale), lowered)
        return new_updates, LossScaleState(
            scale=new_scale.astype(state.scale.dtype), good_steps=jnp.where(grow, 0, good),
            growth_interval=state.growth_interval, growth_factor=state.growth_factor,
            backoff_factor=state.backoff_factor, min_scale=state.min_scale, max_scale=state.max_scale,
            skipped=~finite, num_skipped=state.num_skipped + (~finite).astype(jnp.int32), inner_state=inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


def _loss_scale_states(tree: Any) -> list[LossScaleState]:
    """Every LossScaleState in ``tree``, nested ones (inside another's inner_state) included."""
    top = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, LossScaleState))
           if isinstance(x, LossScaleState)]
    return [s for t in top for s in [t, *_loss_scale_states(t.inner_state)]]


def _find_loss_scale_state(opt_state: Any) -> LossScaleState | None:
    found = _loss_scale_states(opt_state)
    if len(found) > 1:
        raise ValueError("opt_state holds more than one loss_scaling state; wrap the optimizer once, outermost")
    return found[0] if found else None


def check_outermost(opt_state: Any) -> None:
    """Raises ValueError unless a loss_scaling state, if any, is the whole ``opt_state`` (the outermost
    transform): inside a chain, transforms before it (e.g. clipping) would see scaled gradients."""
    found = _find_loss_scale_state(opt_state)
    if found is not None and not isinstance(opt_state, LossScaleState):
        raise ValueError("jp.precision.loss_scaling must be the outermost transform: "
                         "tx = loss_scaling(optax.chain(clip, optimizer, ...), loss_scale), not inside a chain")


def loss_scale(opt_state: Any) -> jax.Array | None:
    """The current loss scale found anywhere in ``opt_state``, or None when there is no loss scaling."""
    found = _find_loss_scale_state(opt_state)
    return None if found is None else found.scale


def skipped(opt_state: Any) -> jax.Array | None:
    """Whether the latest update was skipped (bool scalar), or None without loss scaling."""
    found = _find_loss_scale_state(opt_state)
    return None if found is None else found.skipped
