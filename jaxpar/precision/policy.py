"""Mixed precision dtype policies (jmp's strings) and float32 optimizer state.

A policy follows DeepMind jmp's convention (Micikevicius et al. 2018, "Mixed Precision Training", sec. 3):
parameters are stored in ``param_dtype`` (fp32 master weights), cast to ``compute_dtype`` for the forward
and backward pass, and outputs are cast to ``output_dtype``. Casts touch floating-point leaves only.
jaxpar's jmp compatibility is the policy string grammar and these three dtypes; of jmp's ``Policy`` methods
it has ``cast_to_param`` and ``cast_to_compute`` (what the train step uses), not ``cast_to_output``. Loss
scaling is :mod:`jaxpar.precision.scaling`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar import protocol

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
         "output": "output_dtype", "o": "output_dtype", "dot": "dot", "amax_history": "amax_history"}
_DOTS = {"fp8": "fp8", "fp8_delayed": "fp8", "fp8_current": "fp8_current"}   # policy dot= values (jaxpar.precision.fp8)
_DTYPE_FIELDS = ("param_dtype", "compute_dtype", "output_dtype")


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
    def cast(path, x):
        if protocol.carried_of(path) is not None:   # carried state (fp8 scales, counters) keeps its dtype
            return x
        if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) and jnp.issubdtype(x.dtype, jnp.floating):
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
            return x.astype(dtype)
        return x
    return jax.tree_util.tree_map_with_path(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters are stored in, computed in, and returned in.

    jmp's ``cast_to_output`` is not provided: the train step never holds a model's outputs (they are made
    inside the user's loss function, and the step takes the loss in float32), so nothing here would call
    it; model code that wants its outputs in ``output_dtype`` casts them with ``x.astype(output_dtype)``.

    Attributes:
      param_dtype: storage dtype of parameters (master weights), e.g. ``jnp.float32``.
      compute_dtype: dtype of the forward/backward pass.
      output_dtype: dtype of model outputs (logits); the step's loss is float32 whatever it is.
      dot: None (matmuls in ``compute_dtype``), ``"fp8"`` (the models' dense matmuls in fp8 with delayed
        scaling from an amax history) or ``"fp8_current"`` (fp8 with current scaling): :mod:`jaxpar.precision.fp8`.
        Attention projections and MLPs only; the embedding, the logits and the attention scores stay in the
        compute dtype. fp8 needs ``compute_dtype`` bfloat16 or float32.
      amax_history: steps of amax history per tensor for ``dot="fp8"`` (Transformer Engine's and flax's
        default 1024).
    """
    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32
    dot: str | None = None
    amax_history: int = 1024

    def __post_init__(self):
        if self.dot is not None and self.dot not in _DOTS:
            raise ValueError(f"Policy dot={self.dot!r}; use None, 'fp8' (delayed scaling) or 'fp8_current'")
        if self.dot is not None:
            object.__setattr__(self, "dot", _DOTS[self.dot])
        if isinstance(self.amax_history, bool) or not isinstance(self.amax_history, (int, np.integer)) \
                or not self.amax_history >= 1:
            raise ValueError(f"Policy amax_history={self.amax_history!r} must be an int >= 1 (steps)")
        object.__setattr__(self, "amax_history", int(self.amax_history))
        for name in _DTYPE_FIELDS:
            value = getattr(self, name)
            try:
                dtype = jnp.dtype(value) if value is not None else None
            except TypeError:
                dtype = None
            if dtype not in _POLICY_DTYPES:
                raise ValueError(f"Policy {name}={value!r} must be float32, bfloat16 or float16")
            object.__setattr__(self, name, dtype)
        if self.dot is not None and self.compute_dtype == jnp.float16:
            raise ValueError(f"Policy dot={self.dot!r} with compute_dtype float16: fp8 matmuls need bfloat16 or "
                             "float32 compute (float16 would need loss scaling on top of fp8's per-tensor scaling, "
                             "which jaxpar does not combine); use e.g. 'p=f32,c=bf16,o=f32,dot=fp8'")

    def cast_to_param(self, tree: Any) -> Any:
        """Casts floating leaves to ``param_dtype``; ints, bools and Python scalars are untouched."""
        return _cast(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts floating leaves to ``compute_dtype``."""
        return _cast(tree, self.compute_dtype)

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

        fp8 matmuls (jaxpar's, :mod:`jaxpar.precision.fp8`): the key ``dot=`` with ``fp8`` (or ``fp8_delayed``: delayed
        scaling) or ``fp8_current`` (current scaling), and ``amax_history=N`` (delayed scaling's history length,
        default 1024), e.g. ``"p=f32,c=bf16,o=f32,dot=fp8"``; they do not change the dtype defaults.

        Where jaxpar differs from jmp: it is lenient with case and whitespace (``" P = Full , c = BF16 "``);
        it refuses a key given twice (jmp keeps the last); and it refuses jmp's ``float64``/``f64``, because
        JAX disables x64 by default (float64 silently becomes float32) and params and optimizer state live
        on accelerators where float64 is slow or missing.

        Raises:
          TypeError: ``text`` is not a str.
          ValueError: an empty string, an unknown key, a key given twice, an unknown or 64-bit dtype, an
            unknown ``dot`` value, or ``dot`` with float16 compute.
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
                raise ValueError(f"unknown policy key in {part!r}; use params=, compute=, output= (or p=, c=, o=), "
                                 "dot=, amax_history=")
            if _KEYS[key.strip().lower()] in found:
                raise ValueError(f"policy {text!r} sets {_KEYS[key.strip().lower()]} twice; give each key once")
            found[_KEYS[key.strip().lower()]] = _parse_value(_KEYS[key.strip().lower()], value)
        p = found.get("param_dtype", jnp.float32)           # jmp: params default to float32,
        c = found.get("compute_dtype", p)                   # compute follows params,
        extra = {k: found[k] for k in ("dot", "amax_history") if k in found}
        return cls(p, c, found.get("output_dtype", c), **extra)   # output follows compute

    def __str__(self) -> str:
        text = f"params={self.param_dtype.name},compute={self.compute_dtype.name},output={self.output_dtype.name}"
        if self.dot is not None:
            text += f",dot={self.dot}" + ("" if self.amax_history == 1024 else f",amax_history={self.amax_history}")
        return text


def _parse_value(field: str, text: str) -> Any:
    """A policy string's value for ``field``: a dtype, a ``dot`` name or an ``amax_history`` int."""
    value = text.strip().lower()
    if field == "dot":
        if value not in _DOTS:
            raise ValueError(f"unknown dot {text!r} in policy; use one of {sorted(_DOTS)}")
        return value
    if field == "amax_history":
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"amax_history={text!r} in policy must be a positive int (steps)")
        return int(value)
    return _parse_dtype(text)


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


def is_floating_dtype(value: Any) -> bool:
    """Whether ``value`` names a floating-point dtype (``jnp.float32``, ``"bfloat16"``, ...)."""
    try:
        return value is not None and bool(jnp.issubdtype(jnp.dtype(value), jnp.floating))
    except TypeError:
        return False


# ------------------------------------------------------------------------------- the policy while tracing

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jaxpar_policy", default=None)
_PROGRAM_CHECKS: list[Callable[[Any, Policy | None], None]] = []


@contextlib.contextmanager
def using(policy: Policy | None):
    """Makes ``policy`` the one model code reads while jaxpar traces it (:func:`active`): ``init_state``,
    ``abstract_state`` and the steps enter it around their own tracing only (fp8 matmuls read their recipe
    from it, :mod:`jaxpar.precision.fp8`)."""
    token = _ACTIVE.set(policy)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> Policy | None:
    """The policy jaxpar is tracing under (:func:`using`), or None."""
    return _ACTIVE.get()


def add_program_check(check: Callable[[Any, Policy | None], None]) -> None:
    """Registers ``check(jaxpr, policy)``, run by :func:`check_program` (a precision feature's own check of a
    traced step, e.g. fp8's: the policy asks for fp8 matmuls and the program has none)."""
    if check not in _PROGRAM_CHECKS:
        _PROGRAM_CHECKS.append(check)


def check_program(jaxpr: Any, policy: Policy | None) -> None:
    """Runs every registered program check on a traced step's program (once per compiled program, before it
    runs or is lowered). Raises what a check raises (ValueError)."""
    for check in _PROGRAM_CHECKS:
        check(jaxpr, policy)


__all__ = ["PRESETS", "Policy", "active", "add_program_check", "check_program", "f32_optimizer_state",
           "is_floating_dtype", "using"]
