"""Generation through the protocol on the GPT: its KV-cache step against the full forward pass, and its samples
against a sampler written out here that re-runs ``apply`` on the whole window (no cache)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig


def _gpt(positions):
    cfg = GPTConfig(vocab_size=37, num_layers=2, num_heads=2, d_model=16, max_seq_len=12, positions=positions,
                    vocab_multiple=8, init_std=0.3)
    model = GPT(cfg)
    return model, nn.meta.unbox(model.init(jax.random.key(3)))


@pytest.mark.parametrize("positions", [pytest.param("learned", marks=pytest.mark.slow), "rotary"])
def test_decode_step_equals_apply(positions):
    model, params = _gpt(positions)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 37, (3, 12)), jnp.int32)
    cache = model.init_cache(params, 3, 12)
    assert cache["k"].shape == (2, 3, 12, 2, 8)
    steps, decode = [], jax.jit(model.decode_step)
    for pos in range(12):
        logits, cache = decode(params, tokens[:, pos], cache, jnp.int32(pos))
        steps.append(logits)
    valid = np.arange(model.cfg.padded_vocab) < 37
    # apply jitted: op by op it compiles each of its ~70 operations (most of this test's time)
    assert_tree_close(jnp.stack(steps, 1)[..., valid], jax.jit(model.apply)(params, tokens)[..., valid],
                      what=f"{positions} decode_step vs apply")


def _reference_sample(model, params, prompt, num_tokens, rng, temperature):
    """Every token from ``apply`` over the last ``max_seq_len`` tokens, padded to that length (jitted once; by
    causality the padding after the window is not seen), at the window's last real position."""
    L, V = model.cfg.max_seq_len, model.cfg.vocab_size
    apply = jax.jit(model.apply)
    tokens = list(prompt)
    for i in range(num_tokens):
        window = tokens[-L:]
        logits = apply(params, jnp.asarray(window + [0] * (L - len(window)), jnp.int32)[None])[0, len(window) - 1]
        tokens.append(int(np.argmax(logits[:V])) if temperature == 0 else
                      int(jax.random.categorical(jax.random.fold_in(rng, i), logits[:V] / temperature)))
    return tokens[len(prompt):]


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_generate_equals_cache_free_sampler(positions):
    """18 tokens after a 4-token prompt with a 12-token window: the cache fills, then the window slides."""
    model, params = _gpt(positions)
    rng = jax.random.key(5)
    got = model.generate(params, [1, 5, 2, 9], 18, rng, temperature=0.9)
    assert got == jp.models.generate(model, params, [1, 5, 2, 9], 18, rng, temperature=0.9)
    assert got == _reference_sample(model, params, [1, 5, 2, 9], 18, rng, 0.9)


def test_generate_at_temperature_zero_is_greedy():
    """``temperature=0`` takes the argmax of the window's logits (as the batched form does), also past the cache."""
    model, params = _gpt("rotary")
    got = jp.models.generate(model, params, [3, 1, 4], 15, jax.random.key(1), 0)
    assert got == _reference_sample(model, params, [3, 1, 4], 15, None, 0)


def test_float16_sliding_window_at_a_low_temperature_samples_the_argmax():
    """Past the cache the logits are ``apply``'s, float16 here: divided by 1e-4 in float16 they overflow to inf and
    the first inf would win; in float32 the top logit's token is drawn (its probability is 1 at this temperature)."""
    cfg = GPTConfig(vocab_size=37, num_layers=1, num_heads=2, d_model=16, max_seq_len=8, vocab_multiple=8,
                    init_std=2.0, dtype=jnp.float16)
    model = GPT(cfg)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(1)))   # jitted: one compile, not one per operation
    prompt = list(range(1, 12))   # longer than max_seq_len: the window slides
    logits = jax.jit(model.apply)(params, jnp.asarray([prompt[-8:]], jnp.int32))
    want = int(np.argmax(np.asarray(logits, np.float32)[0, -1, :37]))
    assert jp.models.generate(model, params, prompt, 1, jax.random.key(0), 1e-4) == [want]


@pytest.mark.parametrize("kwargs", [dict(temperature=1e-9), dict(temperature=-1.0), dict(temperature=float("nan")),
                                    dict(num_tokens=-1), dict(num_tokens=1.5), dict(prompt=[37]), dict(prompt=[]),
                                    dict(prompt="ab")])
def test_generate_rejects_bad_arguments(kwargs):
    model, params = _gpt("learned")
    args = {"prompt": [1, 2], "num_tokens": 3, "temperature": 1.0, **kwargs}
    with pytest.raises(ValueError):
        jp.models.generate(model, params, args["prompt"], args["num_tokens"], jax.random.key(0), args["temperature"])
    assert len(jp.models.generate(model, params, [1, 2], 0, jax.random.key(0))) == 0


@pytest.mark.parametrize("prompt", [[1.7, 2.9], np.array([1.5, 2.5]), "12", [True, 2], {1: "a", 2: "b"}, [[1, 2]]])
def test_generate_rejects_prompts_that_are_not_int_ids(prompt):
    model, params = _gpt("learned")
    with pytest.raises(ValueError, match="prompt"):
        jp.models.generate(model, params, prompt, 2, jax.random.key(0))


def test_generate_accepts_numpy_and_jax_scalars_seeds_and_boxed_params():
    model, params = _gpt("learned")
    want = jp.models.generate(model, params, [1, 2], 3, jax.random.key(4), 0.8)
    boxed = model.init(jax.random.key(3))   # the same params, still Flax-boxed
    assert jp.models.generate(model, boxed, np.array([1, 2]), np.int64(3), 4, np.float32(0.8)) == want
    assert jp.models.generate(model, params, jnp.asarray([1, 2]), 3, jax.random.key(4), jnp.float32(0.8)) == want
    for bad in (dict(temperature=1e-300), dict(rng="seed")):
        with pytest.raises((ValueError, TypeError)):
            jp.models.generate(model, params, [1], 2, bad.get("rng", 0), bad.get("temperature", 1.0))


def test_generate_recompiles_for_a_changed_model():
    """Programs are shared between equal models only: a GPT whose config changed samples from the new config."""
    model, params = _gpt("learned")
    assert max(jp.models.generate(model, params, [1], 60, 0, 3.0)) >= 33
    model.cfg = dataclasses.replace(model.cfg, vocab_size=33)   # same padded vocab (40): the params still fit
    assert max(jp.models.generate(model, params, [1], 60, 0, 3.0)) < 33


class _Counter:
    """A model whose decode_step returns what the test says (its cache: a step count)."""
    vocab_size, max_seq_len = 5, 4

    def __init__(self, logits_shape=(1, 5), cache_dtype=jnp.int32, pair=True):
        self.logits_shape, self.cache_dtype, self.pair = logits_shape, cache_dtype, pair

    def init_cache(self, params, batch_size, max_len):
        return {"n": jnp.zeros((), jnp.int32)}

    def decode_step(self, params, tokens_B, cache, pos):
        logits = jnp.zeros(self.logits_shape, jnp.float32)
        return (logits, {"n": (cache["n"] + 1).astype(self.cache_dtype)}) if self.pair else logits


@pytest.mark.parametrize("kwargs,match", [(dict(logits_shape=(5,)), "logits"), (dict(logits_shape=(1, 1, 5)), "logits"),
                                          (dict(logits_shape=(1, 3)), "V >= vocab_size"),
                                          (dict(cache_dtype=jnp.float32), "cache"), (dict(pair=False), r"\(logits_BV, cache\)")])
def test_generate_names_a_bad_decode_step(kwargs, match):
    with pytest.raises(TypeError, match=f"_Counter.decode_step.*{match}|{match}.*_Counter"):
        jp.models.generate(_Counter(**kwargs), {}, [1], 2, 0)
    assert len(jp.models.generate(_Counter(), {}, [1], 2, 0)) == 2
