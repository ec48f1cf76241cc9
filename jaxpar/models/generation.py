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

from jaxpar import protocol

MIN_TEMPERATURE = 1e-8
"""The smallest sampling temperature (far smaller ones round to 0 in float32 or overflow ``logits / temperature``);
a temperature of 1e-6 is practically greedy decoding."""


def _prompt(prompt: Any, vocab_size: int) -> list[int]:
    if not isinstance(prompt, (list, tuple, np.ndarray, jax.Array)):
        raise ValueError(f"prompt must be a list, tuple or 1-D array of int token ids, got {type(prompt).__name__}")
    if isinstance(prompt, (list, tuple)) and any(isinstance(t, bool) or not isinstance(t, numbers.Integral)
                                                 for t in prompt):
        raise ValueError(f"prompt must hold int token ids (no floats, bools or nested lists); got {list(prompt)[:10]}")
    if not len(prompt):
        raise ValueError("the prompt is empty: give at least one token id (e.g. a beginning-of-text or newline id)")
    ids = np.asarray(prompt)
    if ids.ndim != 1 or not ids.size or ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt must hold at least one int token id (a 1-D sequence of ints, no floats or bools); "
                         f"got dtype {ids.dtype}, shape {ids.shape}")
    if ((ids < 0) | (ids >= vocab_size)).any():
        raise ValueError(f"prompt ids must lie in [0, {vocab_size}), got {ids[:10].tolist()}")
    return [int(t) for t in ids]


def _check(num_tokens: Any, temperature: Any) -> tuple[int, float]:
    """``(num_tokens, temperature)`` checked: an int >= 0, and 0 (greedy) or a finite number >= MIN_TEMPERATURE
    (Python, numpy or 0-d JAX scalars)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral) or num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens!r} must be an int >= 0")
    t = temperature
    if isinstance(t, (np.ndarray, jax.Array)) and t.ndim == 0 and jnp.issubdtype(t.dtype, jnp.floating):
        t = float(t)
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (
            t == 0 or (math.isfinite(t) and t >= MIN_TEMPERATURE)):
        raise ValueError(f"temperature={temperature!r} must be 0 (greedy decoding) or a finite number >= "
                         f"{MIN_TEMPERATURE} (e.g. 0.8; lower is greedier)")
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

    Token ``i`` is ``argmax(logits[:vocab_size])`` at ``temperature == 0``, else drawn from
    ``softmax(logits[:vocab_size] / temperature)`` (``jax.random.categorical``) with the
    key ``jax.random.fold_in(rng, i)``, the logits being those after the last ``max_seq_len`` tokens (prompt and
    tokens drawn so far): from ``decode_step`` while they fit in the cache, then from ``apply`` over the
    sliding window.

    Args:
      model: provides ``init_cache``, ``decode_step``, ``max_seq_len`` and ``vocab_size`` (attributes or
        ``cfg.`` fields), and ``apply(params, tokens_BL) -> logits_BLV`` once the context outgrows the cache;
        see :mod:`jaxpar.protocol`. Compiled programs are reused for an equal (hashable) model.
      params: the model's params in model order (``jp.train.to_model_order(state).params``); Flax-boxed
        leaves are unboxed.
      prompt: a non-empty list, tuple or 1-D array of int token ids in ``[0, vocab_size)``.
      num_tokens: how many tokens to draw (an int >= 0).
      rng: a typed PRNG key, a raw uint32 key or an int seed.
      temperature: 0 for greedy decoding (argmax), else a finite number >= :data:`MIN_TEMPERATURE`.

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
        z = logits[0, :vocab].astype(jnp.float32)   # a float16 apply's logits / a small temperature overflow
        token = int(jnp.argmax(z) if temperature == 0 else jax.random.categorical(jax.random.fold_in(rng, i),
                                                                                  z / temperature))
        out.append(token)
        tokens.append(token)
        if i < num_tokens - 1 and len(tokens) <= max_len:   # the new token's position still fits in the cache
            logits, cache = step(params, jnp.asarray(token, jnp.int32), cache, jnp.asarray(len(tokens) - 1, jnp.int32))
    return out


# ------------------------------------------------------------------------- batched generation (KV cache)

def sample_logits(logits_BV: jax.Array, key: jax.Array, temperature: float, top_k: int | None = None,
                  top_p: float | None = None) -> jax.Array:
    """One token per row (int32 ``[B]``) from float ``logits_BV``: greedy (``argmax``) at ``temperature == 0``,
    else ``jax.random.categorical`` of ``logits / temperature`` restricted to the ``top_k`` largest logits and then
    to the smallest set whose probabilities sum to at least ``top_p`` (nucleus sampling, Holtzman et al. 2020,
    sec. 3.1; as ``transformers``' ``TopKLogitsWarper`` then ``TopPLogitsWarper``). Traceable."""
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    neg = jnp.finfo(jnp.float32).min
    z_BV = logits_BV.astype(jnp.float32) / temperature
    if top_k is not None and top_k < z_BV.shape[-1]:
        kth_B1 = jax.lax.top_k(z_BV, top_k)[0][:, -1:]
        z_BV = jnp.where(z_BV < kth_B1, neg, z_BV)
    if top_p is not None and top_p < 1.0:
        sorted_BV = jnp.sort(z_BV, axis=-1)[:, ::-1]
        p_BV = jax.nn.softmax(sorted_BV, axis=-1)
        before_BV = jnp.cumsum(p_BV, axis=-1) - p_BV           # mass of the more likely tokens
        keep_BV = before_BV < top_p                             # the first token is always kept
        cut_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        z_BV = jnp.where(z_BV < cut_B1, neg, z_BV)
    return jax.random.categorical(key, z_BV, axis=-1).astype(jnp.int32)


def _batched(model, max_len, vocab, num_new, temperature, top_k, top_p, eos_id, params, tokens_BL, start_B, rng):
    """Prefill of the left-padded prompts in one ``decode_step`` over ``P`` slots, then a ``while_loop`` of
    one-token steps until ``num_new`` tokens or every row has drawn ``eos_id``; the drawn ids ``[B, num_new]``
    (-1 after a row's eos) and how many steps ran."""
    B, P = tokens_BL.shape
    cache = model.init_cache(params, B, max_len)
    logits_BV, cache = model.decode_step(params, tokens_BL, cache, jnp.int32(0), start=start_B)
    out_BN = jnp.full((B, num_new), -1, jnp.int32)

    def cond(carry):
        i, _, _, _, done_B = carry
        return (i < num_new) & ~jnp.all(done_B)

    def body(carry):
        i, logits_BV, cache, out_BN, done_B = carry
        token_B = sample_logits(logits_BV[:, :vocab], jax.random.fold_in(rng, i), temperature, top_k, top_p)
        token_B = jnp.where(done_B, 0, token_B)
        out_BN = jax.lax.dynamic_update_slice_in_dim(out_BN, jnp.where(done_B, -1, token_B)[:, None], i, axis=1)
        if eos_id is not None:
            done_B = done_B | (token_B == eos_id)
        pos = jnp.minimum(P + i, max_len - 1)   # the last step's write is never read
        logits_BV, cache = model.decode_step(params, token_B, cache, pos, start=start_B)
        return i + 1, logits_BV, cache, out_BN, done_B

    carry = (jnp.int32(0), logits_BV, cache, out_BN, jnp.zeros((B,), bool))
    steps, _, _, out_BN, _ = jax.lax.while_loop(cond, body, carry)
    return out_BN, steps


_BATCHED = jax.jit(_batched, static_argnums=tuple(range(8)))


def generate_batch(model: Any, params: Any, prompts: Any, max_new_tokens: int, rng: Any, *,
                   temperature: float = 0.8, top_k: int | None = None, top_p: float | None = None,
                   eos_id: int | None = None) -> list[list[int]]:
    """Samples up to ``max_new_tokens`` tokens after each of a batch of prompts, in one jitted program: the
    prompts left-padded to the longest (length ``P``) and written into a preallocated cache by one prefill pass,
    then one ``decode_step`` per token for the whole batch (a ``lax.while_loop``), each row stopping at
    ``eos_id``. Token ``i`` of every row is drawn by :func:`sample_logits` with ``jax.random.fold_in(rng, i)``.

    The model's ``decode_step`` must take ``[B, L]`` tokens and ``start=`` (each row's first slot), as the GPT's
    and the Llama's do (:meth:`jaxpar.models.GPT.decode_step`).

    Args:
      prompts: a non-empty list of non-empty int id sequences (of any lengths) in ``[0, vocab_size)``.
      max_new_tokens: an int >= 0; ``P + max_new_tokens`` must not exceed ``max_seq_len``.
      rng: a typed key, a raw uint32 key or an int seed.
      temperature: 0 for greedy decoding (argmax), else a finite number >= :data:`MIN_TEMPERATURE`.
      top_k: None, or keep the ``top_k >= 1`` largest logits.
      top_p: None, or nucleus sampling with ``0 < top_p <= 1``.
      eos_id: None, or the id that ends a row (kept as its last token).

    Returns:
      one list of drawn ids per prompt (Python ints; up to ``max_new_tokens``, ending at ``eos_id`` if drawn).

    Raises:
      ValueError: bad prompts (naming the row), arguments out of range, a context longer than ``max_seq_len``.
      TypeError: the model lacks a generation part, or its ``decode_step`` takes no ``start``.
    """
    protocol.require(model, ("init_cache", "decode_step"), "generation")
    max_seq = protocol.size(model, "max_seq_len", "generation", "the longest context its cache holds")
    vocab = protocol.size(model, "vocab_size", "generation", "the prompt's ids must lie below it")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token id lists, got {type(prompts).__name__}")
    rows = []
    for r, p in enumerate(prompts):
        try:
            rows.append(_prompt(p, vocab))
        except ValueError as e:
            raise ValueError(f"prompts[{r}]: {e}") from None
    num_new, temperature = _check(max_new_tokens, temperature)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be None or an int >= 1")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real)
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must be None or a number in (0, 1]")
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, numbers.Integral)
                               or not 0 <= eos_id < vocab):
        raise ValueError(f"eos_id={eos_id!r} must be None or a token id in [0, {vocab})")
    P = max(len(r) for r in rows)
    if P + num_new > max_seq:
        raise ValueError(f"the longest prompt ({P} tokens) plus max_new_tokens={num_new} exceeds max_seq_len="
                         f"{max_seq}: shorten the prompts or ask for fewer tokens (jp.models.generate slides a "
                         "window past max_seq_len for one prompt)")
    if num_new == 0:
        return [[] for _ in rows]
    tokens = np.zeros((len(rows), P), np.int32)
    for r, ids in enumerate(rows):
        tokens[r, P - len(ids):] = ids
    start = np.asarray([P - len(ids) for ids in rows], np.int32)
    params = nn.meta.unbox(params)
    try:
        jax.eval_shape(lambda p: model.decode_step(p, jnp.zeros((1, 1), jnp.int32), model.init_cache(p, 1, 2),
                                                   jnp.int32(0), start=jnp.zeros((1,), jnp.int32)), params)
    except TypeError as e:
        if "start" in str(e):
            raise TypeError(f"{type(model).__name__}.decode_step takes no start=: batched generation needs "
                            "decode_step(params, tokens_BL, cache, pos, start=start_B) (jp.models.GPT's form); "
                            "generate one prompt at a time with jp.models.generate") from None
        raise
    top_k = None if top_k is None else int(top_k)
    top_p = None if top_p is None else float(top_p)
    eos = None if eos_id is None else int(eos_id)
    out, _ = _BATCHED(model, P + num_new, vocab, num_new, float(temperature), top_k, top_p, eos, params,
                      jnp.asarray(tokens), jnp.asarray(start), _key(rng))
    out = np.asarray(out)
    return [[int(t) for t in row if t >= 0] for row in out]


def generate_any(model: Any, params: Any, prompts: Any, max_new_tokens: int, rng: Any, temperature: float = 0.8, *,
                 top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None) -> list:
    """A model's ``generate``: :func:`generate_batch` for a list of prompts (or a ``[B, P]`` array), :func:`generate`
    for one flat prompt unless ``top_k``, ``top_p`` or ``eos_id`` ask for the batched form (a batch of one).

    Raises:
      ValueError: as those functions; an empty list of prompts.
    """
    if isinstance(prompts, (list, tuple)) and not len(prompts):
        raise ValueError("prompts is empty: give one prompt (a list of token ids) or a list of prompts")
    if isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 2:   # a [B, P] array: B prompts
        prompts = [list(np.asarray(row)) for row in prompts]
    flat = isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 1 or (
        isinstance(prompts, (list, tuple)) and prompts and not isinstance(prompts[0], (list, tuple, np.ndarray,
                                                                                       jax.Array)))
    if flat and top_k is None and top_p is None and eos_id is None:
        return generate(model, params, prompts, max_new_tokens, rng, temperature)
    rows = [prompts] if flat else prompts
    out = generate_batch(model, params, rows, max_new_tokens, rng, temperature=temperature, top_k=top_k, top_p=top_p,
                         eos_id=eos_id)
    return out[0] if flat else out
