"""Sampling text from any model of the protocol with its cache (``init_cache`` / ``decode_step``).

:func:`generate` encodes the prompt through the model's one-token step into its cache, then samples one token
per step from the logits after the last ``max_seq_len`` tokens: while the context fits, each new token costs one
``decode_step``; once it is longer the window slides (its positions move), and each token is sampled from
``apply`` over the window (one forward pass, as a model without a cache computes it).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.models import protocol

MIN_TEMPERATURE = 1e-8
"""The smallest sampling temperature (far smaller ones round to 0 in float32 or overflow ``logits / temperature``);
a temperature of 1e-6 is practically greedy decoding."""


def _prompt(prompt: Any, vocab_size: int) -> list[int]:
    if not isinstance(prompt, (list, tuple, np.ndarray, jax.Array)):
        raise ValueError(f"prompt must be a list, tuple or 1-D array of int token ids, got {type(prompt).__name__}")
    if isinstance(prompt, (list, tuple)) and any(isinstance(t, bool) or not isinstance(t, numbers.Integral)
                                                 for t in prompt):
        raise ValueError(f"prompt must hold int token ids (no floats, bools or nested lists); got {list(prompt)[:10]}")
    ids = np.asarray(prompt)
    if ids.ndim != 1 or not ids.size or ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt must hold at least one int token id (a 1-D sequence of ints, no floats or bools); "
                         f"got dtype {ids.dtype}, shape {ids.shape}")
    if ((ids < 0) | (ids >= vocab_size)).any():
        raise ValueError(f"prompt ids must lie in [0, {vocab_size}), got {ids[:10].tolist()}")
    return [int(t) for t in ids]


def _check(num_tokens: Any, temperature: Any) -> tuple[int, float]:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral) or num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens!r} must be an int >= 0")
    t = temperature
    if isinstance(t, (np.ndarray, jax.Array)) and t.ndim == 0 and jnp.issubdtype(t.dtype, jnp.floating):
        t = float(t)
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (math.isfinite(t) and t >= MIN_TEMPERATURE):
        raise ValueError(f"temperature={temperature!r} must be a finite number >= {MIN_TEMPERATURE} (e.g. 0.8; lower "
                         f"is greedier, 1e-6 practically greedy)")
    return int(num_tokens), float(t)


def _key(rng: Any) -> jax.Array:
    if isinstance(rng, numbers.Integral) and not isinstance(rng, bool):
        return jax.random.key(int(rng))
    if isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.ndim == 0:
        return rng
    if isinstance(rng, (jax.Array, np.ndarray)) and rng.dtype == np.uint32 and rng.shape == (2,):
        return jax.random.wrap_key_data(jnp.asarray(rng))
    raise TypeError(f"rng must be a typed key (jax.random.key(seed)), a raw uint32 key or an int seed; got {rng!r:.80}")


def _check_step(model: Any, params: Any, max_len: int, vocab_size: int) -> None:
    """The protocol's generation parts give what :func:`generate` reads (traced abstractly, nothing computed)."""
    name = type(model).__name__
    cache = jax.eval_shape(lambda p: model.init_cache(p, 1, max_len), params)
    out = jax.eval_shape(model.decode_step, params, jax.ShapeDtypeStruct((1,), jnp.int32), cache,
                         jax.ShapeDtypeStruct((), jnp.int32))
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{name}.decode_step must return (logits_BV, cache); got {type(out).__name__}")
    logits, new_cache = out
    if (getattr(logits, "ndim", None) != 2 or logits.shape[0] != 1 or logits.shape[1] < vocab_size
            or not jnp.issubdtype(logits.dtype, jnp.floating)):
        raise TypeError(f"{name}.decode_step's logits must be floating [batch, V] with V >= vocab_size={vocab_size} "
                        f"(for a batch of 1: [1, V]); got {getattr(logits, 'dtype', '?')}{list(getattr(logits, 'shape', []))}")
    shape = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)
    if jax.tree.structure(new_cache) != jax.tree.structure(cache) or shape(new_cache) != shape(cache):
        raise TypeError(f"{name}.decode_step must return a cache of init_cache's structure, shapes and dtypes "
                        f"{shape(cache)}; got {shape(new_cache)}")


def _step(model, params, token, cache, pos):
    return model.decode_step(params, token[None], cache, pos)


def _encode(model, max_len, params, window, length):
    """The first ``length`` tokens of ``window [max_len]`` through ``decode_step`` from an empty cache (a
    ``fori_loop`` stopping at ``length``: a cache that accumulates, not only one written by position, sees no
    padding); the last logits and the cache."""
    cache = model.init_cache(params, 1, max_len)
    logits = jax.eval_shape(model.decode_step, params, window[:1], cache, jnp.int32(0))[0]

    def one(pos, carry):
        return model.decode_step(params, jax.lax.dynamic_slice_in_dim(window, pos, 1), carry[1], pos)
    return jax.lax.fori_loop(0, length, one, (jnp.zeros(logits.shape, logits.dtype), cache))


def _window_logits(model, params, window):
    return model.apply(params, window[None])[:, -1]


def _programs(model: Any, max_len: int):
    """The jitted step, prompt encoding and sliding-window forward, with the model static: compiled once per
    model value (a model compares and hashes by what it computes, e.g. the GPT by its config); an unhashable
    model gets programs for this call only."""
    try:
        hash(model)
    except TypeError:
        return (jax.jit(lambda *a: _step(model, *a)), jax.jit(lambda *a: _encode(model, max_len, *a)),
                jax.jit(lambda *a: _window_logits(model, *a)))
    step, encode, window = _STEP, _ENCODE, _WINDOW
    return (lambda *a: step(model, *a)), (lambda *a: encode(model, max_len, *a)), (lambda *a: window(model, *a))


_STEP = jax.jit(_step, static_argnums=0)
_ENCODE = jax.jit(_encode, static_argnums=(0, 1))
_WINDOW = jax.jit(_window_logits, static_argnums=0)


def generate(model: Any, params: Any, prompt: Any, num_tokens: int, rng: Any, temperature: float = 0.8) -> list[int]:
    """Samples ``num_tokens`` token ids after ``prompt`` from ``model`` (the protocol's generation parts).

    Token ``i`` is drawn from ``softmax(logits[:vocab_size] / temperature)`` (``jax.random.categorical``) with the
    key ``jax.random.fold_in(rng, i)``, the logits being those after the last ``max_seq_len`` tokens (prompt and
    tokens drawn so far): from ``decode_step`` while they fit in the cache, then from ``apply`` over the
    sliding window.

    Args:
      model: provides ``init_cache``, ``decode_step``, ``max_seq_len`` and ``vocab_size`` (attributes or
        ``cfg.`` fields), and ``apply(params, tokens_BL) -> logits_BLV`` once the context outgrows the cache;
        see :mod:`jaxpar.models.protocol`. Compiled programs are reused for an equal (hashable) model.
      params: the model's params in model order (``jp.train.to_model_order(state).params``); Flax-boxed
        leaves are unboxed.
      prompt: a non-empty list, tuple or 1-D array of int token ids in ``[0, vocab_size)``.
      num_tokens: how many tokens to draw (an int >= 0).
      rng: a typed PRNG key, a raw uint32 key or an int seed.
      temperature: a finite number >= :data:`MIN_TEMPERATURE`.

    Returns:
      The ``num_tokens`` drawn ids (Python ints), the prompt excluded.

    Raises:
      TypeError: the model lacks a generation part (named), its ``decode_step`` returns something other than
        ``(floating logits [1, V >= vocab_size], a cache like init_cache's)``; a bad ``rng``.
      ValueError: an empty prompt, one that is not ints, or an id outside ``[0, vocab_size)``; ``num_tokens``
        not an int >= 0; a temperature out of range.
    """
    protocol.require(model, ("init_cache", "decode_step"), "generation")
    max_len = protocol.size(model, "max_seq_len", "generation", "the longest context its cache holds")
    vocab = protocol.size(model, "vocab_size", "generation", "the prompt's ids must lie below it")
    tokens = _prompt(prompt, vocab)
    num_tokens, temperature = _check(num_tokens, temperature)
    rng = _key(rng)
    params = nn.meta.unbox(params)
    _check_step(model, params, max_len, vocab)
    step, encode, window_logits = _programs(model, max_len)

    def window(ctx: list[int]):
        return jnp.asarray(ctx + [0] * (max_len - len(ctx)), jnp.int32), len(ctx)

    if len(tokens) <= max_len:   # the prompt fits: the cache takes it
        logits, cache = encode(params, *window(tokens))
    out = []
    for i in range(num_tokens):
        if len(tokens) > max_len:   # the window slides: its positions move, one forward pass over it
            protocol.require(model, "apply", "generation past max_seq_len tokens")
            logits = window_logits(params, jnp.asarray(tokens[-max_len:], jnp.int32))
        token = int(jax.random.categorical(jax.random.fold_in(rng, i), logits[0, :vocab] / temperature))
        out.append(token)
        tokens.append(token)
        if i < num_tokens - 1 and len(tokens) <= max_len:   # the new token's position still fits in the cache
            logits, cache = step(params, jnp.asarray(token, jnp.int32), cache, jnp.asarray(len(tokens) - 1, jnp.int32))
    return out
