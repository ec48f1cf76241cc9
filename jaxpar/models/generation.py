"""Sampling text from any model of the protocol with a key/value cache (``init_cache`` / ``decode_step``).

:func:`generate` encodes the prompt through the model's one-token step into its cache, then samples one token
per step, each from the logits of the last ``max_seq_len`` tokens: while the context fits, each new token costs
one ``decode_step``; once it is longer, the window slides and is encoded again (positions move), as a model
without a cache would recompute it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.models import protocol


def _check(prompt: Any, num_tokens: Any, temperature: Any, vocab_size: int) -> list[int]:
    try:
        tokens = [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise ValueError(f"prompt must be a sequence of int token ids, got {prompt!r:.80}") from None
    if not tokens or not all(0 <= t < vocab_size for t in tokens):
        raise ValueError(f"prompt must hold at least one token id in [0, {vocab_size}), got {tokens[:10]}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens!r} must be an int >= 0")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0 (e.g. 0.8; lower is greedier)")
    return tokens


@functools.lru_cache(maxsize=16)
def _programs(model: Any, max_len: int):
    """``(step, encode)`` jitted for one model: ``step(params, token, cache, pos)`` and ``encode(params, window,
    length)``: the first ``length`` tokens of the window ``[max_len]`` (int32) run through ``decode_step``
    position by position from an empty cache (a ``fori_loop`` stopping at ``length``, so a cache that
    accumulates, not only one written by position, sees no padding), returning the last logits and the cache."""
    def step(params, token, cache, pos):
        return model.decode_step(params, token[None], cache, pos)

    def encode(params, window, length):
        cache = model.init_cache(params, 1, max_len)
        logits = jax.eval_shape(model.decode_step, params, window[:1], cache, jnp.int32(0))[0]

        def one(pos, carry):
            return model.decode_step(params, jax.lax.dynamic_slice_in_dim(window, pos, 1), carry[1], pos)
        return jax.lax.fori_loop(0, length, one, (jnp.zeros(logits.shape, logits.dtype), cache))
    return jax.jit(step), jax.jit(encode)


def generate(model: Any, params: Any, prompt: Any, num_tokens: int, rng: jax.Array,
             temperature: float = 0.8) -> list[int]:
    """Samples ``num_tokens`` token ids after ``prompt`` from ``model`` (the protocol's generation parts).

    Token ``i`` is drawn from ``softmax(logits / temperature)`` with the key ``jax.random.fold_in(rng, i)``, the
    logits being those after the last ``max_seq_len`` tokens (prompt and tokens drawn so far).

    Args:
      model: provides ``init_cache``, ``decode_step``, ``max_seq_len`` and ``vocab_size`` (attributes or
        ``cfg.`` fields); see :mod:`jaxpar.models.protocol`.
      params: the model's params (unboxed, in model order: ``jp.train.to_model_order(state).params``).
      prompt: a non-empty sequence of int token ids in ``[0, vocab_size)``.
      num_tokens: how many tokens to draw (>= 0).
      rng: a typed PRNG key.
      temperature: > 0.

    Returns:
      The ``num_tokens`` drawn ids (Python ints), the prompt excluded.

    Raises:
      TypeError: the model lacks a generation part (named).
      ValueError: an empty prompt or an id outside ``[0, vocab_size)``; ``num_tokens`` < 0; ``temperature`` <= 0.
    """
    protocol.require(model, ("init_cache", "decode_step"), "generation")
    max_len = protocol.size(model, "max_seq_len", "generation", "the longest context its cache holds")
    tokens = _check(prompt, num_tokens, temperature,
                    protocol.size(model, "vocab_size", "generation", "the prompt's ids must lie below it"))
    try:
        step, encode = _programs(model, max_len)
    except TypeError:   # an unhashable model: build the programs for this call
        step, encode = _programs.__wrapped__(model, max_len)

    def window(ctx: list[int]):
        return jnp.asarray(ctx + [0] * (max_len - len(ctx)), jnp.int32), len(ctx)

    logits, cache = encode(params, *window(tokens[-max_len:]))
    pos = min(len(tokens), max_len)
    out = []
    for i in range(num_tokens):
        token = int(jax.random.categorical(jax.random.fold_in(rng, i), logits[0] / temperature))
        out.append(token)
        tokens.append(token)
        if i == num_tokens - 1:
            break
        if pos < max_len:
            logits, cache = step(params, jnp.asarray(token, jnp.int32), cache, jnp.asarray(pos, jnp.int32))
            pos += 1
        else:   # the window slides by one: its positions move, so it is encoded again
            logits, cache = encode(params, *window(tokens[-max_len:]))
    return out
