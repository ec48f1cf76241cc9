"""Sampling text from any model of the protocol with its cache (``init_cache`` / ``decode_step``): the one
:func:`generate` every door calls (``jp.models.generate``, each decoder's ``model.generate``).

The prompts (a batch, left-padded to the longest) are written into a preallocated cache by one prefill (a
``decode_step`` over all their slots, for a model whose step takes ``start=``; else one token at a time), then
one jitted loop draws a token per step for the whole batch (:func:`sample_logits`: greedy, temperature, top-k,
top-p), each row stopping at ``eos_id``. Token ``i`` of every row is drawn with ``jax.random.fold_in(rng, i)``.
Past ``max_seq_len`` (one prompt) the window slides (its positions move): each token is drawn from ``apply``
over the last ``max_seq_len`` tokens (one forward pass, as a model without a cache computes it).
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Sequence

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


def _compiled(fn: Any, model: Any, static: tuple) -> Any:
    """``fn(model, *static, *args)`` jitted with the model and ``static`` as compile-time constants: compiled once per
    model value (a model compares and hashes by what it computes, e.g. a decoder by its config); an unhashable
    model gets a program for this call only."""
    try:
        hash(model)
    except TypeError:
        return jax.jit(lambda *args: fn(model, *static, *args))
    return lambda *args: _JITTED[fn](model, *static, *args)


def _takes_start(model: Any) -> bool:
    """Whether the model's ``decode_step`` takes ``start=`` (each row's first slot) and ``[B, L]`` tokens: a
    one-pass prefill of left-padded prompts."""
    try:
        parameters = inspect.signature(model.decode_step).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "start" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _prefill(model, takes_start, cache_len, params, tokens_BL, start_B):
    """``(logits_BV, cache)`` after the left-padded prompts ``tokens_BL`` written at slots ``0 .. P - 1``: one
    ``decode_step`` over them all, or (a model whose step takes one token of rows without padding) a
    ``fori_loop`` of one-token steps."""
    B, P = tokens_BL.shape
    cache = model.init_cache(params, B, cache_len)
    if takes_start:
        return model.decode_step(params, tokens_BL, cache, jnp.int32(0), start=start_B)
    logits = jax.eval_shape(model.decode_step, params, tokens_BL[:, 0], cache, jnp.int32(0))[0]

    def one(pos, carry):
        return model.decode_step(params, jax.lax.dynamic_index_in_dim(tokens_BL, pos, 1, keepdims=False), carry[1],
                                 pos)
    return jax.lax.fori_loop(0, P, one, (jnp.zeros(logits.shape, logits.dtype), cache))


def _cached(model, takes_start, cache_len, vocab, num_new, temperature, top_k, top_p, eos_id, params, tokens_BL,
            start_B, rng):
    """The prefill, then a ``while_loop`` of one-token steps until ``num_new`` tokens or every row has drawn one of
    ``eos_id`` (a tuple of ids, or None): the drawn ids ``[B, num_new]`` (-1 after a row's eos)."""
    B, P = tokens_BL.shape
    logits_BV, cache = _prefill(model, takes_start, cache_len, params, tokens_BL, start_B)
    step = ((lambda token_B, cache, pos: model.decode_step(params, token_B, cache, pos, start=start_B))
            if takes_start else (lambda token_B, cache, pos: model.decode_step(params, token_B, cache, pos)))
    out_BN = jnp.full((B, num_new), -1, jnp.int32)

    def cond(carry):
        i, _, _, _, done_B = carry
        return (i < num_new) & ~jnp.all(done_B)

    def body(carry):
        i, logits_BV, cache, out_BN, done_B = carry
        token_B = sample_logits(logits_BV[:, :vocab], jax.random.fold_in(rng, i), temperature, top_k, top_p)
        token_B = jnp.where(done_B, 0, token_B)
        out_BN = jax.lax.dynamic_update_slice_in_dim(out_BN, jnp.where(done_B, -1, token_B)[:, None], i, axis=1)
        for e in eos_id or ():
            done_B = done_B | (token_B == e)
        pos = jnp.minimum(P + i, cache_len - 1)   # the last step's write is never read
        logits_BV, cache = step(token_B, cache, pos)
        return i + 1, logits_BV, cache, out_BN, done_B

    carry = (jnp.int32(0), logits_BV, cache, out_BN, jnp.zeros((B,), bool))
    return jax.lax.while_loop(cond, body, carry)[3]


def _window(model, vocab, temperature, top_k, top_p, params, window_L, key):
    """One token from ``apply`` over a full window of ``max_seq_len`` tokens (its last position's logits)."""
    return sample_logits(model.apply(params, window_L[None])[:, -1, :vocab], key, temperature, top_k, top_p)[0]


_JITTED = {_cached: jax.jit(_cached, static_argnums=tuple(range(9))),
           _window: jax.jit(_window, static_argnums=(0, 1, 2, 3, 4))}


def _rows(prompts: Any, vocab: int) -> tuple[list[list[int]], bool]:
    """``(rows, flat)``: the prompts as checked id lists, and whether one flat prompt was given.

    Raises:
      ValueError: no prompt; a bad prompt (naming its row in a batch).
    """
    if isinstance(prompts, (list, tuple)) and not len(prompts):
        raise ValueError("prompts is empty: give one prompt (a list of token ids) or a list of prompts")
    if isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 2:   # a [B, P] array: B prompts
        prompts = [list(np.asarray(row)) for row in prompts]
    batch = isinstance(prompts, (list, tuple)) and isinstance(prompts[0], (list, tuple, np.ndarray, jax.Array))
    if not batch:
        return [_prompt(prompts, vocab)], True
    rows = []
    for r, p in enumerate(prompts):
        try:
            rows.append(_prompt(p, vocab))
        except ValueError as e:
            raise ValueError(f"prompts[{r}]: {e}") from None
    return rows, False


def token_ids(value: Any, vocab: int, what: str) -> tuple[int, ...]:
    """``value`` (None, one token id, or a list or tuple of them, as a Hugging Face config's ``eos_token_id``) as a
    tuple of Python ints.

    Raises:
      ValueError: an id that is not an int in ``[0, vocab)`` (a bool included), naming ``what`` and the value.
    """
    ids = tuple(value) if isinstance(value, (list, tuple)) else () if value is None else (value,)
    if any(isinstance(e, (bool, np.bool_)) or not isinstance(e, numbers.Integral) or not 0 <= e < vocab for e in ids):
        raise ValueError(f"{what}={value!r}: token ids must be ints in [0, {vocab}), one or a list of them (or None)")
    return tuple(int(e) for e in ids)


def _options(top_k: Any, top_p: Any, eos_id: Any, vocab: int) -> tuple[int | None, float | None, tuple | None]:
    """``(top_k, top_p, eos_ids)`` checked and as Python numbers (compile-time constants); ``eos_id`` (one id or a
    non-empty list of them, as Hugging Face's ``eos_token_id``) as a tuple of ids, or None."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be None or an int >= 1")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real)
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must be None or a number in (0, 1]")
    if isinstance(eos_id, (list, tuple)) and not eos_id:
        raise ValueError(f"eos_id={eos_id!r} is empty: give None (no stop), an id or a non-empty list of ids")
    return (None if top_k is None else int(top_k), None if top_p is None else float(top_p),
            token_ids(eos_id, vocab, "eos_id") or None)


def generate_any(model: Any, params: Any, prompts: Any, max_new_tokens: int, rng: Any, temperature: float = 0.8, *,
                 top_k: int | None = None, top_p: float | None = None,
                 eos_id: int | Sequence[int] | None = None) -> list:
    """Samples up to ``max_new_tokens`` tokens after each prompt from ``model`` (the protocol's generation parts).

    Token ``i`` of every row is drawn by :func:`sample_logits` (greedy at ``temperature == 0``, else
    ``jax.random.categorical`` of ``logits[:vocab_size] / temperature`` within ``top_k`` / ``top_p``) with the key
    ``jax.random.fold_in(rng, i)``, from the logits after the row's context: ``decode_step``'s while the context
    fits in ``max_seq_len`` (the prompts left-padded and prefilled into the cache, one jitted loop for the batch),
    then (one prompt) ``apply``'s over the last ``max_seq_len`` tokens, the window sliding.

    Args:
      model: provides ``init_cache``, ``decode_step``, ``max_seq_len`` and ``vocab_size`` (attributes or
        ``cfg.`` fields), and ``apply(params, tokens_BL) -> logits_BLV`` once one prompt's context outgrows the
        cache; see :mod:`jaxpar.protocol`. Prompts of different lengths need a ``decode_step`` that takes ``[B, L]``
        tokens and ``start=`` (each row's first slot), as the decoders' do. Compiled programs are reused for an
        equal (hashable) model.
      params: the model's params in model order (``jp.train.to_model_order(state).params``); Flax-boxed
        leaves are unboxed.
      prompts: one prompt (a non-empty list, tuple or 1-D array of int ids in ``[0, vocab_size)``), or a batch: a
        non-empty list of them (any lengths) or a ``[B, P]`` array.
      max_new_tokens: an int >= 0; for a batch of more than one, the longest prompt plus ``max_new_tokens`` must
        fit in ``max_seq_len``.
      rng: a typed PRNG key, a raw uint32 key or an int seed.
      temperature: 0 for greedy decoding (argmax), else a finite number >= :data:`MIN_TEMPERATURE`.
      top_k: None, or keep the ``top_k >= 1`` largest logits.
      top_p: None, or nucleus sampling with ``0 < top_p <= 1``.
      eos_id: None, or the id that ends a row (kept as its last token), or a non-empty list of such ids (as a
        Hugging Face config's ``eos_token_id``).

    Returns:
      The drawn ids (Python ints, the prompt excluded, ending at an ``eos_id`` if one is drawn): one list for one
      prompt, a list of them for a batch.

    Raises:
      TypeError: the model lacks a generation part (named), its ``decode_step`` returns something other than
        ``(floating logits [1, V >= vocab_size], a cache like init_cache's)``, or takes no ``start=`` for prompts
        of different lengths; a bad ``rng``.
      ValueError: no prompt, one that is not ints or holds an id outside ``[0, vocab_size)`` (naming its row);
        ``max_new_tokens`` not an int >= 0; a temperature, ``top_k``, ``top_p`` or ``eos_id`` out of range; a
        batch whose context exceeds ``max_seq_len``.
    """
    protocol.require(model, ("init_cache", "decode_step"), "generation")
    max_len = protocol.size(model, "max_seq_len", "generation", "the longest context its cache holds")
    vocab = protocol.size(model, "vocab_size", "generation", "the prompt's ids must lie below it")
    rows, flat = _rows(prompts, vocab)
    num_new, temperature = _check(max_new_tokens, temperature)
    top_k, top_p, eos_id = _options(top_k, top_p, eos_id, vocab)
    rng = _key(rng)
    P = max(len(r) for r in rows)
    if len(rows) > 1 and P + num_new > max_len:
        raise ValueError(f"the longest prompt ({P} tokens) plus max_new_tokens={num_new} exceeds max_seq_len="
                         f"{max_len}: shorten the prompts or ask for fewer tokens (one prompt at a time, the window "
                         "slides past max_seq_len)")
    params = nn.meta.unbox(params)
    _check_step(model, params, max_len, vocab)
    takes_start = _takes_start(model)
    if not takes_start and len({len(r) for r in rows}) > 1:
        raise TypeError(f"{type(model).__name__}.decode_step takes no start=: prompts of different lengths need "
                        "decode_step(params, tokens_BL, cache, pos, start=start_B) (the decoders' form); generate "
                        "one prompt at a time, or prompts of one length")
    out = [[] for _ in rows]
    cached = 0 if P > max_len else min(num_new, max_len - P + 1)   # tokens drawn from the cache's logits
    if cached:
        tokens = np.zeros((len(rows), P), np.int32)
        for r, ids in enumerate(rows):
            tokens[r, P - len(ids):] = ids
        start = np.asarray([P - len(ids) for ids in rows], np.int32)
        run = _compiled(_cached, model, (takes_start, min(P + num_new, max_len), vocab, cached, temperature, top_k,
                                         top_p, eos_id))
        drawn = np.asarray(run(params, jnp.asarray(tokens), jnp.asarray(start), rng))
        out = [[int(t) for t in row if t >= 0] for row in drawn]
    if cached < num_new and not set(eos_id or ()) & set(out[0]):   # one prompt past max_seq_len
        protocol.require(model, "apply", "generation past max_seq_len tokens")
        context, window = rows[0] + out[0], _compiled(_window, model, (vocab, temperature, top_k, top_p))
        for i in range(cached, num_new):
            token = int(window(params, jnp.asarray(context[-max_len:], jnp.int32), jax.random.fold_in(rng, i)))
            out[0].append(token)
            context.append(token)
            if token in (eos_id or ()):
                break
    return out[0] if flat else out


def generate(model: Any, params: Any, prompt: Any, num_tokens: int, rng: Any, temperature: float = 0.8, *,
             top_k: int | None = None, top_p: float | None = None,
             eos_id: int | Sequence[int] | None = None) -> list[int]:
    """:func:`generate_any` of one prompt: ``num_tokens`` ids after ``prompt`` (a non-empty list, tuple or 1-D
    array of int ids), the window sliding past ``max_seq_len``.

    Raises:
      ValueError: ``prompt`` is not one flat sequence of int ids in ``[0, vocab_size)``; as :func:`generate_any`.
      TypeError: as :func:`generate_any`.
    """
    protocol.require(model, ("init_cache", "decode_step"), "generation")
    _prompt(prompt, protocol.size(model, "vocab_size", "generation", "the prompt's ids must lie below it"))
    return generate_any(model, params, prompt, num_tokens, rng, temperature, top_k=top_k, top_p=top_p, eos_id=eos_id)


def generate_batch(model: Any, params: Any, prompts: Any, max_new_tokens: int, rng: Any, *,
                   temperature: float = 0.8, top_k: int | None = None, top_p: float | None = None,
                   eos_id: int | Sequence[int] | None = None) -> list[list[int]]:
    """:func:`generate_any` of a batch: ``prompts`` a non-empty list of prompts (id sequences of any lengths) or a
    ``[B, P]`` array; one list of drawn ids per prompt.

    Raises:
      ValueError: ``prompts`` is not a batch of prompts (naming the row); as :func:`generate_any`.
      TypeError: as :func:`generate_any`.
    """
    if isinstance(prompts, (list, tuple)) and prompts:
        for r, p in enumerate(prompts):
            if not isinstance(p, (list, tuple, np.ndarray, jax.Array)):
                raise ValueError(f"prompts[{r}]={p!r:.40}: a batch is a list of prompts (token id lists); "
                                 "pass one prompt to jp.models.generate")
    elif not (isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 2):
        raise ValueError(f"prompts must be a non-empty list of token id lists, got {type(prompts).__name__}")
    return generate_any(model, params, prompts, max_new_tokens, rng, temperature, top_k=top_k, top_p=top_p,
                        eos_id=eos_id)


# ------------------------------------------------------------------------- sampling

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


