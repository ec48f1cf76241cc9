"""jaxpar/_hlo.py: collectives read from compiled HLO, attributed to mesh axes, loops counted by trip count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import _hlo as plan_hlo


def test_psum_over_one_axis_is_attributed_to_it(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    for axis in ("data", "fsdp", "tensor"):
        f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, axis), mesh=mesh, in_specs=P(("data", "fsdp", "tensor")),
                                  out_specs=P(("data", "fsdp", "tensor"))))
        x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=NamedSharding(mesh, P(("data", "fsdp", "tensor"))))
        stats = plan_hlo.analyze(f.lower(x).compile().as_text(), dict(mesh.shape))
        assert stats.bytes_by("kind/axes") == {f"all-reduce/{axis}": 128 * 4}, (axis, stats.collectives)
        assert [c.group_size for c in stats.collectives] == [2]


def test_loop_collectives_count_by_trip_count(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    spec = P(("data", "fsdp", "tensor"))

    def body(x):
        return jax.lax.fori_loop(0, 5, lambda i, y: jax.lax.pcast(jax.lax.psum(y, "fsdp") * 0.5, "fsdp", to="varying"), x)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, spec))
    stats = plan_hlo.analyze(f.lower(x).compile().as_text(), dict(mesh.shape))
    assert stats.bytes_by("kind/axes") == {"all-reduce/fsdp": 5 * 64 * 4}
