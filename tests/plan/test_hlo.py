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


# A compiled module written by hand: an all-reduce in the entry, a collective-permute (async) in a loop body.
_MODULE = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element((s32[], f32[8]{0}) %p), index=1
  %cp = (f32[8]{0}, f32[8]{0}) collective-permute-start(f32[8]{0} %x), source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(f)/tick/ppermute" source_file="a.py" source_line=3}
  %y = f32[8]{0} collective-permute-done((f32[8]{0}, f32[8]{0}) %cp)
  %i = s32[] get-tuple-element((s32[], f32[8]{0}) %p), index=0
  ROOT %t = (s32[], f32[8]{0}) tuple(s32[] %i, f32[8]{0} %y)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[8]{0}) %p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %r = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(f)/step/psum"}
  %z = s32[] constant(0)
  %t = (s32[], f32[8]{0}) tuple(s32[] %z, f32[8]{0} %r)
  %w = (s32[], f32[8]{0}) while((s32[], f32[8]{0}) %t), condition=%cond, body=%body
  ROOT %o = f32[8]{0} get-tuple-element((s32[], f32[8]{0}) %w), index=1
}

FileNames
1 "a.py"
"""


def test_collective_counts_and_loop_depths_of_a_hand_written_module():
    assert plan_hlo.collective_counts(_MODULE) == {"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0,
                                                   "all-to-all": 0, "collective-permute": 1}
    depths = {name: depth for name, (_, depth) in plan_hlo.loop_depths(_MODULE).items()}
    assert depths == {"main": 0, "cond": 0, "body": 1}   # reducers are not computations that run; a condition
                                                         # runs where its loop is
    assert [i.opcode for i in plan_hlo.loop_depths(_MODULE)["body"][0] if "permute" in i.opcode] == \
        ["collective-permute-start", "collective-permute-done"]


def test_program_text_and_scopes_of_a_hand_written_module():
    text = plan_hlo.program_text(_MODULE)
    assert "metadata" not in text and "FileNames" not in text and "collective-permute-start" in text
    assert text == plan_hlo.program_text(_MODULE.replace("source_line=3", "source_line=9"))
    assert plan_hlo.scopes(_MODULE) == {"jit(f)", "tick", "ppermute", "step", "psum"}


_LOWERED = """
    %3 = stablehlo.dot_general %1, %2, contracting_dims = [1] x [0] : (tensor<16x64xbf16>, tensor<64x32xbf16>) -> tensor<16x32xf32>
    %4 = stablehlo.dot_general %a, %b, batching_dims = [0] x [0], contracting_dims = [2] x [1], precision = [DEFAULT, DEFAULT] : (tensor<2x16x64xf8E4M3FN>, tensor<2x64x8xf8E5M2>) -> tensor<2x16x8xf32>
    %5 = stablehlo.add %3, %3 : tensor<16x32xf32>
    %6 = sdy.sharding_constraint %5 <@mesh, [{}, {"tensor"}]> : tensor<16x32xf32>
    %7 = sdy.sharding_constraint %s <@mesh, []> : tensor<f32>
"""


def test_stablehlo_dots_and_constraints_of_hand_written_text():
    assert plan_hlo.stablehlo_dots(_LOWERED) == [("bf16", "bf16"), ("f8E4M3FN", "f8E5M2")]
    assert plan_hlo.sharding_constraints(_LOWERED) == [('<@mesh, [{}, {"tensor"}]>', "16x32", "f32"),
                                                       ("<@mesh, []>", "", "f32")]
