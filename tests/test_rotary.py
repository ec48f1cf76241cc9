"""jaxpar.layers.rotary.rope: positions known at trace time give sines and cosines as constants (no sin or cos left
in the compiled program, where XLA:CPU would evaluate them per element of x), equal to the traced path and to a
float64 reference of RoPE (Su et al. 2021, eq. 34: the two halves of the head dim form the pairs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.layers.rotary import rope


def reference(x, base, positions, freq=None):
    """RoPE in float64 numpy: pairs (x[i], x[i + K/2]) rotated by position * base ** (-2i / K)."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    freq = base ** (-np.arange(half) / half) if freq is None else np.asarray(freq, np.float64)
    angle = np.asarray(positions, np.float64)[..., None] * freq             # [B or 1, L, half]
    sin, cos = np.sin(angle)[:, :, None], np.cos(angle)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def test_static_positions_are_constants_equal_to_the_traced_path_and_the_reference():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 24, 3, 8)), jnp.float32)
    freq = np.asarray([1.0, 0.3, 0.05, 0.002], np.float32)       # a family's own frequencies (e.g. scaled)
    for offset, fr in ((0, None), (5, freq)):
        static = jax.jit(lambda x: rope(x, 1e4, offset, fr))
        traced = jax.jit(lambda x, pos: rope(x, 1e4, freq=fr, positions_BL=pos))   # positions as a traced array
        pos = np.arange(24)[None] + offset
        got, want = static(x), traced(x, jnp.asarray(np.repeat(pos, 2, 0), jnp.int32))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
        np.testing.assert_allclose(got, reference(x, 1e4, pos, fr), rtol=0, atol=2e-6)
        hlo = static.lower(x).compile().as_text()
        assert "sine(" not in hlo and "cosine(" not in hlo, "static angles must not be computed in the program"
        assert "cosine(" in traced.lower(x, jnp.zeros((2, 24), jnp.int32)).compile().as_text()
    # numpy positions (a context axis' zigzag slots) are static too; a traced offset is not
    zig = np.asarray([[0, 1, 6, 7, 2, 3, 4, 5]])
    x8 = x[:1, :8]
    np.testing.assert_allclose(jax.jit(lambda x: rope(x, 1e4, positions_BL=zig))(x8), reference(x8, 1e4, zig),
                               rtol=0, atol=2e-6)
    offset_traced = jax.jit(lambda x, o: rope(x, 1e4, o))
    np.testing.assert_allclose(offset_traced(x8, jnp.int32(3)), reference(x8, 1e4, np.arange(8)[None] + 3),
                               rtol=0, atol=2e-6)


def test_positions_of_the_wrong_shape_and_an_odd_head_size_are_named():
    import pytest
    x = jnp.zeros((2, 8, 3, 4), jnp.float32)
    for bad in (np.arange(7)[None], np.arange(8), np.zeros((3, 8), np.int32)):
        with pytest.raises(ValueError, match=r"positions_BL has shape .* \[B, L\] = \[2, 8\]"):
            rope(x, 1e4, positions_BL=bad)
    with pytest.raises(ValueError, match="must be even"):
        rope(jnp.zeros((1, 8, 1, 5)), 1e4)
    np.testing.assert_allclose(rope(x + 1, 1e4, positions_BL=np.arange(8)[None]), rope(x + 1, 1e4), atol=2e-6)


def test_prefill_and_decode_rotate_alike_for_any_head_size_and_bad_arguments_are_named():
    """The static path (positions known at trace time) and the traced one (a decode step's offset) use the same
    default frequencies, so they agree for a head size whose half is not a power of two (K = 96: they differed by
    3.4e-3 at position 32,000 when the traced path took a float32 power) and far positions."""
    import pytest
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 64, 2, 96)), jnp.float32)
    for start in (0, 4000, 32000):
        static = rope(x, 1e4, start)
        traced = jax.jit(lambda x, o: rope(x, 1e4, o))(x, jnp.int32(start))
        np.testing.assert_allclose(traced, static, rtol=0, atol=5e-6)
    # both round the angles to float32 as transformers does: near position 0 that is the float64 reference's
    np.testing.assert_allclose(rope(x, 1e4), reference(x, 1e4, np.arange(64)[None]), rtol=0, atol=1e-5)
    x = jnp.zeros((2, 8, 3, 4), jnp.float32)
    for kwargs, match in ((dict(offset=jnp.zeros(3, jnp.int32)), r"offset has shape \(3,\)"),
                          (dict(offset=jnp.zeros((2, 8), jnp.int32)), "offset has shape"),
                          (dict(freq=np.ones(3, np.float32)), r"K // 2 = 2"),
                          (dict(base=0.0), "finite number > 0"), (dict(base=float("nan")), "finite number > 0")):
        with pytest.raises(ValueError, match=match):
            rope(x, **{"base": 1e4, **kwargs})
    with pytest.raises(ValueError, match=r"\[B, L, H, K\]"):
        rope(jnp.zeros((8, 3, 4)), 1e4)
