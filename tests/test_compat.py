"""jaxpar/_compat.py: the workarounds for the jax version (manual axes a value varies over, a 16-bit psum)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar import _compat


def test_compat_varying_axes_and_16bit_psum(mesh_factory):
    """``_compat.varying_axes`` reads the manual axes a value varies over (empty outside shard_map, ``pipe``
    inside for a ``P('pipe')`` input, and after a ``pcast``); ``_compat.psum_16bit_safe`` sums bfloat16 values
    that one stage holds exactly and keeps their dtype (the runtime's psum of g_x in a bf16 model)."""
    mesh = mesh_factory(data=2, pipe=4)
    rng = np.random.default_rng(11)
    x = rng.normal(size=(4, 6)).astype(jnp.bfloat16)            # row s: stage s's value
    hold = np.zeros((4, 6), np.float32)
    hold[2] = 1.0                                               # only stage 2 contributes
    seen = {}

    def body(x_s, hold_s, r):
        seen["in"], seen["replicated"] = _compat.varying_axes(x_s), _compat.varying_axes(r)
        seen["cast"] = _compat.varying_axes(jax.lax.pcast(r, "pipe", to="varying"))
        return _compat.psum_16bit_safe(x_s * hold_s.astype(x_s.dtype), "pipe")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("pipe"), P("pipe"), P()), out_specs=P(),
                              axis_names={"pipe"}, check_vma=True))
    with jax.set_mesh(mesh):
        out = f(x, hold, jnp.ones((), jnp.float32))
    assert out.dtype == jnp.bfloat16 and out.shape == (1, 6)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), np.asarray(x[2], np.float32))
    assert seen == {"in": frozenset({"pipe"}), "replicated": frozenset(), "cast": frozenset({"pipe"})}, seen
    assert _compat.varying_axes(jnp.ones(3)) == frozenset()
