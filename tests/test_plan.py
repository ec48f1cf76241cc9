"""jp.plan: AOT planning on simulated meshes (memory, FLOPs, collectives by axis, fit, errors)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxpar as jp
from jaxpar import plan_hlo
from jaxpar.models import GPTConfig

TINY = GPTConfig(vocab_size=61, num_layers=2, num_heads=2, d_model=32, max_seq_len=16, remat="full",
                 scan_layers=True)


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


def test_plan_memory_equals_the_step_that_runs(mesh_factory, np_rng):
    sizes = dict(data=2, fsdp=2, tensor=2)
    planned = jp.plan.plan(TINY, sizes, global_batch=8, seq_len=16)
    assert planned.label == "XLA:CPU compilation" and planned.fits
    mesh = mesh_factory(**sizes)
    model, tx, step, _ = jp.plan.build_step(TINY, mesh)   # donating, as planned
    state = jp.train.init_state(model.init, tx, jax.random.key(0), mesh=mesh, policy=jp.plan.policy_of(TINY))
    tokens = np_rng.integers(0, TINY.vocab_size, (8, 17)).astype(np.int32)
    batch = jp.train.shard_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
    param_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))
    compiled = step.lower(state, batch).compile()
    new_state, metrics = compiled(state, batch)          # the program whose memory is compared runs
    assert np.isfinite(float(metrics["loss"])) and int(new_state.step) == 1
    m = compiled.memory_analysis()
    assert planned.memory["compiled_bytes"] == (m.argument_size_in_bytes + m.output_size_in_bytes
                                                - m.alias_size_in_bytes + m.temp_size_in_bytes)
    assert planned.memory["params_bytes"] == param_bytes
    assert 0.3 < planned.memory["ratio"] < 3
    assert planned.flops["hlo"] > planned.flops["cost_analysis"] * 0.99 > 0   # loop bodies by trip count
    assert set(planned.collectives) <= set(plan_hlo.COLLECTIVES)
    assert planned.time["step_s"] > 0 and 0 < planned.time["mfu"] < 1


def test_does_not_fit_gives_a_message_not_a_crash():
    cfg = GPTConfig(vocab_size=61, num_layers=2, num_heads=2, d_model=32, max_seq_len=16)
    p = jp.plan.plan(cfg, dict(data=8), global_batch=8, seq_len=16, memory_fraction=1e-6)
    assert not p.fits
    assert p.advice.startswith("does not fit: ") and "GiB needed per device" in p.advice and "try remat='full'" in p.advice
    assert "DOES NOT FIT" in p.report()


def test_bad_layouts_raise_before_compiling():
    with pytest.raises(ValueError, match="multiplies to 8, not the 16 devices"):
        jp.plan.plan(TINY, dict(data=8), global_batch=8, seq_len=16, num_devices=16)
    with pytest.raises(ValueError, match="tensor=16 would span hosts"):
        jp.plan.plan(GPTConfig(num_heads=16, d_model=256, num_layers=2), dict(tensor=16), global_batch=8, seq_len=16)
    with pytest.raises(ValueError, match="pipe=2 needs a pipeline schedule"):
        jp.plan.plan(TINY, dict(data=4, pipe=2), global_batch=8, seq_len=16)
    with pytest.raises(ValueError, match="device="):
        jp.plan.plan(TINY, dict(data=8), global_batch=8, seq_len=16, device="tpu")


@pytest.mark.slow
def test_plan_64_devices_in_a_subprocess():
    cfg = GPTConfig(vocab_size=61, num_layers=2, num_heads=8, d_model=64, max_seq_len=16, remat="full",
                    scan_layers=True, dtype=jnp.bfloat16)
    p = jp.plan.plan(cfg, dict(data=2, fsdp=4, tensor=8), global_batch=16, seq_len=16)
    assert p.mesh == dict(data=2, pipe=1, fsdp=4, tensor=8) and p.memory["compiled_bytes"] > 0
    assert "tensor" in p.collectives["all-reduce"]
