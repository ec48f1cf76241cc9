"""The sliding-window KV cache (:meth:`jaxpar.models.decoder.Decoder.init_cache` / ``decode_step`` with
:mod:`jaxpar.layers.sliding_window`): a layer with window ``w`` keeps ``w`` slots, a ring buffer, layers of other
windows caches of their own lengths, and decoding (a prefill twice the window, then steps past it) matches the
forward pass, itself checked against a dense masked softmax in tests/test_sliding_window.py."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_tree_close

from jaxpar.models import GPT, GPTConfig
from jaxpar.models.blocks import LayerKind


@dataclasses.dataclass(frozen=True)
class WindowedGPT(GPTConfig):
    """A GPT whose layers carry sliding windows (a config of the test's own; the families define ``layer_kinds``)."""
    windows: tuple = (3, None)

    def layer_kinds(self):
        return tuple(LayerKind(window=w) for w in self.windows)


def test_window_cache_holds_window_slots_and_decodes_like_the_forward_pass():
    w, V = 3, 37
    cfg = WindowedGPT(vocab_size=V, num_layers=2, num_heads=2, d_model=16, max_seq_len=10, positions="rotary",
                      vocab_multiple=8, init_std=0.3, windows=(w, None))
    model = GPT(cfg)
    params = nn.meta.unbox(model.init(jax.random.key(4)))
    tokens = jnp.asarray(np.random.default_rng(43).integers(0, V, (2, 10)), jnp.int32)
    cache = model.init_cache(params, 2, 10)
    shapes = lambda c: [a.shape for a in c["k"]] + [a.shape for a in c["v"]]
    assert shapes(cache) == [(2, w, 2, 8), (2, 10, 2, 8)] * 2     # the local layer keeps w slots, the global 10
    decode = jax.jit(model.decode_step)
    logits, cache = decode(params, tokens[:, :6], cache, jnp.int32(0))   # a prefill twice the window
    got = [logits]
    for pos in range(6, 10):                                             # steps wrapping the ring buffer
        logits, cache = decode(params, tokens[:, pos], cache, jnp.int32(pos))
        got.append(logits)
    assert shapes(cache) == [(2, w, 2, 8), (2, 10, 2, 8)] * 2
    want = jax.jit(model.apply)(params, tokens)[:, 5:]
    assert_tree_close(jnp.stack(got, 1)[..., :V], want[..., :V], what="windowed decode vs forward")
