"""The sliding-window KV cache (:meth:`jaxpar.models.decoder.Decoder.init_cache` / ``decode_step`` with
:mod:`jaxpar.layers.sliding_window`): a layer with window ``w`` keeps ``w`` slots, a ring buffer, and its decoding
matches the full forward pass over the last ``w`` tokens (one layer, rotary positions: attention sees exactly those
tokens, and rotary logits depend only on relative positions)."""

from __future__ import annotations

import dataclasses
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_tree_close

from jaxpar.models import GPT, GPTConfig


@dataclasses.dataclass(frozen=True)
class WindowedGPT(GPTConfig):
    """A GPT whose layers carry sliding windows (a config of the test's own; the families define ``layer_kinds``)."""
    windows: tuple = (3,)

    def layer_kinds(self):
        return tuple(types.SimpleNamespace(window=w) for w in self.windows)


def test_window_cache_holds_window_slots_and_decodes_like_the_forward_pass():
    w, V = 3, 37
    cfg = WindowedGPT(vocab_size=V, num_layers=1, num_heads=2, d_model=16, max_seq_len=12, positions="rotary",
                      vocab_multiple=8, init_std=0.3, windows=(w,))
    model = GPT(cfg)
    params = nn.meta.unbox(model.init(jax.random.key(4)))
    tokens = jnp.asarray(np.random.default_rng(43).integers(0, V, (2, 10)), jnp.int32)
    cache = model.init_cache(params, 2, 10)
    assert cache["k"].shape == (1, 2, w, 2, 8) and cache["v"].shape == cache["k"].shape   # w slots, not 10
    decode, full = jax.jit(model.decode_step), jax.jit(model.apply)
    logits, cache = decode(params, tokens[:, :6], cache, jnp.int32(0))   # a prefill twice the window
    got, want = [logits], [full(params, tokens[:, 6 - w:6])[:, -1]]
    for pos in range(6, 10):
        logits, cache = decode(params, tokens[:, pos], cache, jnp.int32(pos))
        got.append(logits)
        want.append(full(params, tokens[:, pos + 1 - w:pos + 1])[:, -1])
    assert cache["k"].shape == (1, 2, w, 2, 8)
    assert_tree_close(jnp.stack(got)[..., :V], jnp.stack(want)[..., :V], what="windowed decode vs forward")
    # layers of different windows keep caches of their own lengths (Gemma 3's local and global layers)
    mixed = GPT(dataclasses.replace(cfg, num_layers=2, windows=(w, None)))
    p2 = jax.eval_shape(mixed.init, jax.random.key(0))
    c2 = jax.eval_shape(lambda p: mixed.init_cache(p, 2, 10), nn.meta.unbox(p2))
    assert [a.shape for a in c2["k"]] == [(2, w, 2, 8), (2, 10, 2, 8)]
    out = jax.eval_shape(mixed.decode_step, nn.meta.unbox(p2), tokens[:, 0], c2, jnp.int32(0))[1]
    assert jax.tree.structure(out) == jax.tree.structure(c2)
