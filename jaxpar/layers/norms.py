"""Norms and activations of the decoder blocks, with float32 statistics.

Each is rematerialised (``jax.checkpoint``): the backward pass saves its input only, not float32
intermediates, which would otherwise be most of a bf16 model's saved activations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.checkpoint
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis with float32 statistics; returns ``x``'s dtype.

    Rematerialised in the backward pass: it saves only its input (in the compute dtype), not float32
    intermediates, which would otherwise be most of a bf16 model's saved activations.
    """
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


@jax.checkpoint
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019, eq. 4) over the last axis with float32 statistics, as HF's
    ``LlamaRMSNorm``: ``scale * (x / sqrt(mean(x^2) + eps))`` (the normalised value in ``x``'s dtype first);
    rematerialised like :func:`layer_norm`."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)).astype(x.dtype)
    return (scale.astype(jnp.float32) * y.astype(jnp.float32)).astype(x.dtype)


@jax.checkpoint
def rms_norm_plus_one(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm scaled by ``1 + scale``, all in float32 and cast last, as Hugging Face's ``GemmaRMSNorm`` /
    ``Gemma3RMSNorm``: ``(x / sqrt(mean(x^2) + eps)) * (1 + scale)`` (a zero scale is the identity scaling);
    rematerialised like :func:`layer_norm`."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)
    return (y * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


@jax.checkpoint
def gelu(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (Hendrycks & Gimpel 2016, sec. 2), ``jax.nn.gelu(approximate=True)``.

    Rematerialised like :func:`layer_norm`: the backward pass saves only the input and recomputes ``tanh``
    inside its own fused loop, so the forward pass is one elementwise pass instead of two (``tanh``, then the
    product), and no ``[tokens, mlp]`` tanh buffer is kept for the backward pass.
    """
    return jax.nn.gelu(x, approximate=True)


@jax.checkpoint
def silu(x: jax.Array) -> jax.Array:
    """``x * sigmoid(x)`` (Elfwing et al. 2018), rematerialised like :func:`gelu`."""
    return jax.nn.silu(x)


__all__ = ["gelu", "layer_norm", "rms_norm", "rms_norm_plus_one", "silu"]
