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


def test_flax_hooks_act_only_inside_their_context():
    """``_compat.flax_spmd_hooks`` routes Flax's logical-name resolution through a hook while some context is
    open (nested contexts keep the outer hooks) and restores Flax's own functions on leaving; the activation
    audit leaves Flax as it found it."""
    import flax.linen as nn
    from flax.linen import spmd
    from jaxpar.sharding.params import record_unknown_names
    flax_own = (spmd._logical_to_mesh_axes, spmd._with_sharding_constraint_one_fallback)
    rules, seen = (("embed", "fsdp"), ("mlp", "tensor")), []

    def resolve(original, names, rules=None):
        seen.append(tuple(names))
        return original(names, rules)
    keep = lambda original, *args, **kwargs: original(*args, **kwargs)
    with _compat.flax_spmd_hooks(resolve, keep):
        with _compat.flax_spmd_hooks(resolve, keep):
            assert nn.logical_to_mesh_axes(("embed",), rules) == P("fsdp")
        assert nn.logical_to_mesh_axes(("mlp",), rules) == P("tensor")
    assert (spmd._logical_to_mesh_axes, spmd._with_sharding_constraint_one_fallback) == flax_own
    nn.logical_to_mesh_axes(("embed", "mlp"), rules)
    assert seen == [("embed",), ("mlp",)]
    with record_unknown_names():
        assert spmd._logical_to_mesh_axes is not flax_own[0]
    assert (spmd._logical_to_mesh_axes, spmd._with_sharding_constraint_one_fallback) == flax_own
