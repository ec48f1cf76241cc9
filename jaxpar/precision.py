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
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

# jmp's names (jmp/_src/policy.py ``dtype_to_names``: "full"/"f32"/"float32", "bf16"/"bfloat16",
# "f16"/"float16", "f64"/"float64", and "half" via ``half_dtype()``) plus jaxpar's own aliases.
_DTYPES = {
    "float32": jnp.float32, "f32": jnp.float32, "full": jnp.float32, "fp32": jnp.float32, "float": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "f16": jnp.float16, "fp16": jnp.float16,
}
_HALF = "half"                                     # backend dependent, as jmp's half_dtype()
_DTYPES_64 = ("float64", "f64", "fp64", "double")  # jmp accepts float64/f64; jaxpar refuses them
_POLICY_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_KEYS = {"params": "param_dtype", "p": "param_dtype", "param": "param_dtype",
         "compute": "compute_dtype", "c": "compute_dtype",
         "output": "output_dtype", "o": "output_dtype"}


def _half_dtype() -> Any:
    """The dtype jmp's ``"half"`` names: bfloat16 on TPU, float16 elsewhere (jmp's ``half_dtype()``).

    Decided by ``jax.default_backend()`` when the policy string is parsed.
    """
    return jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16


def _parse_dtype(text: str) -> Any:
    name = text.strip().lower()
    if name == _HALF:
        return _half_dtype()
    if name in _DTYPES:
        return _DTYPES[name]
    names = sorted({*_DTYPES, _HALF})
    if name in _DTYPES_64:
        # Keeps the "unknown dtype ...; use one of [...]" prefix of every other unknown name.
        raise ValueError(
            f"unknown dtype {text!r} in policy; use one of {names}. jmp accepts 64-bit policies but jaxpar "
            f"refuses them: JAX disables x64 by default (float64 arrays silently become float32), and params "
            f"and optimizer state live on accelerators that run float64 slowly or not at all; use 'float32' "
            f"(or 'full', 'f32')") from None
    raise ValueError(f"unknown dtype {text!r} in policy; use one of {names}") from None


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
            if dtype not in _POLICY_DTYPES:
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
        """Parses a policy string as DeepMind jmp's ``get_policy`` does (jmp/_src/policy.py).

        Grammar (jmp's): either a single dtype name, which sets all three dtypes (``"bf16"``, ``"full"``),
        or a comma-separated list of ``key=dtype`` with keys ``params``/``p``, ``compute``/``c`` and
        ``output``/``o`` (``param`` is also accepted here), e.g. ``"p=full,c=bf16,o=full"`` (what jmp's
        ``str(policy)`` prints) or ``"params=float32,compute=float16,output=float32"``. As in jmp, keys left
        out default to: params float32, compute follows params, output follows compute; so ``"c=f16"`` is
        ``p=f32,c=f16,o=f16`` and ``"c=float16,o=full"`` is ``p=f32,c=f16,o=f32``.

        Dtype names (jmp's ``parse_dtype``): ``full``/``f32``/``float32`` (float32), ``bf16``/``bfloat16``,
        ``f16``/``float16``, and ``half``, which is jmp's ``half_dtype()``: bfloat16 when
        ``jax.default_backend()`` is ``"tpu"`` at parse time, float16 otherwise (CPU, GPU). jaxpar also
        accepts ``fp32``, ``float`` and ``fp16``, and the named presets ``"mixed_bf16"`` (params f32,
        compute bf16, output f32) and ``"mixed_fp16"`` (the same with f16).

        Where jaxpar differs from jmp: it is lenient with case and whitespace (``" P = Full , c = BF16 "``);
        it refuses a key given twice (jmp keeps the last); and it refuses jmp's ``float64``/``f64``, because
        JAX disables x64 by default (float64 silently becomes float32) and params and optimizer state live
        on accelerators where float64 is slow or missing.

        Raises:
          TypeError: ``text`` is not a str.
          ValueError: an empty string, an unknown key, a key given twice, or an unknown or 64-bit dtype.
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
        p = found.get("param_dtype", jnp.float32)           # jmp: params default to float32,
        c = found.get("compute_dtype", p)                   # compute follows params,
        return cls(p, c, found.get("output_dtype", c))      # output follows compute

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


def is_floating_dtype(value: Any) -> bool:
    """Whether ``value`` names a floating-point dtype (``jnp.float32``, ``"bfloat16"``, ...)."""
    try:
        return value is not None and bool(jnp.issubdtype(jnp.dtype(value), jnp.floating))
    except TypeError:
        return False


def _check_scale_dtype(dtype: Any) -> None:
    if not is_floating_dtype(dtype) or jnp.dtype(dtype) not in _POLICY_DTYPES:
        raise ValueError(f"loss scale dtype {dtype!r} must be a floating dtype: float32, float16 or bfloat16 "
                         "(float32 is usual)")


def _scale_params(ls) -> tuple[float, int, float, float, float, float, Any]:
    """(initial, growth_interval, growth, backoff, min, max, dtype) of a loss-scale config."""
    if isinstance(ls, DynamicLossScale):
        dtype = jnp.dtype(ls.dtype)
        cap = min(ls.max_scale, _max_pow2(dtype))
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
        # The dtype's power-of-two cap again: a state restored from a checkpoint written before the cap
        # was a power of two (65504 for float16) must not grow past 2**15 either.
        cap = jnp.minimum(state.max_scale, _max_pow2(state.scale.dtype))
        raised = jnp.minimum(scale * state.growth_factor, cap)
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
