"""Mixed-precision policies (param / compute / output dtypes).

A policy follows DeepMind jmp's convention (Micikevicius et al. 2018, "Mixed Precision Training", sec. 3):
parameters are stored in ``param_dtype`` (fp32 master weights), cast to ``compute_dtype`` for the forward
and backward pass, and outputs are cast to ``output_dtype``. Casts touch floating-point leaves only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
            object.__setattr__(self, f.name, jnp.dtype(getattr(self, f.name)))

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
        ``f32/bf16/f16``). A bare dtype sets all three. Missing keys default to: params float32, compute
        follows params, output follows compute.

        Raises:
          ValueError: an empty string, an unknown key or an unknown dtype.
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"empty policy string {text!r}; e.g. 'params=float32,compute=bfloat16,output=float32'")
        if "=" not in text:
            d = _parse_dtype(text)
            return cls(d, d, d)
        found: dict[str, Any] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep or key.strip().lower() not in _KEYS:
                raise ValueError(f"unknown policy key in {part!r}; use params=, compute=, output= (or p=, c=, o=)")
            found[_KEYS[key.strip().lower()]] = _parse_dtype(value)
        p = found.get("param_dtype", jnp.float32)
        c = found.get("compute_dtype", p)
        return cls(p, c, found.get("output_dtype", c))

    def __str__(self) -> str:
        return f"params={self.param_dtype.name},compute={self.compute_dtype.name},output={self.output_dtype.name}"
