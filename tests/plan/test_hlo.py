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
    reductions = """
      %8 = "stablehlo.all_reduce"(%7) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>}> ({
      ^bb0(%arg1: tensor<bf16>, %arg2: tensor<bf16>):
      %9 = "stablehlo.reduce_scatter"(%8) <{scatter_dimension = 0 : i64, use_global_device_ids}> ({
      ^bb0(%arg3: tensor<f32>, %arg4: tensor<f32>):
    """
    assert plan_hlo.stablehlo_reductions(_LOWERED + reductions) == [("all_reduce", "bf16"), ("reduce_scatter", "f32")]


# XLA:GPU's forms, written by hand: an fp8 GEMM fusion, a cuBLAS GEMM call, and async collectives whose
# ``-start`` result holds (inputs, outputs) while their operands are printed without types (as jax prints them).
_GPU_MODULE = """HloModule g, entry_computation_layout={(f8e4m3fn[64,32]{1,0}, f8e5m2[32,16]{1,0})->bf16[64,16]{1,0}}

%gemm (p0: f8e4m3fn[64,32], p1: f8e5m2[32,16]) -> bf16[64,16] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = f8e5m2[32,16]{1,0} parameter(1)
  ROOT %d = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f8e4m3fn[64,32], w: f8e5m2[32,16]) -> bf16[64,16] {
  %x = f8e4m3fn[64,32]{1,0} parameter(0)
  %w = f8e5m2[32,16]{1,0} parameter(1)
  %f = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm
  %c = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%f, %f), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %g = f32[8,16]{1,0} parameter(2)
  %ag = ((f32[8,16]{1,0}, bf16[64,16]{1,0}), (f32[64,16]{1,0}, bf16[512,16]{1,0})) all-gather-start(%g, %f), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = (f32[64,16]{1,0}, bf16[512,16]{1,0}) all-gather-done(%ag)
  %h = f32[64,16]{1,0} parameter(3)
  %rs = ((f32[64,16]{1,0}), f32[8,16]{1,0}) reduce-scatter-start(%h), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %rsd = f32[8,16]{1,0} reduce-scatter-done(%rs)
  %ar = f32[8,16]{1,0} all-reduce-start(%g), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %ard = f32[8,16]{1,0} all-reduce-done(%ar)
  %cp = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%g), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[8,16]{1,0} collective-permute-done(%cp)
  ROOT %o = bf16[64,16]{1,0} get-tuple-element(%c), index=0
}
"""


def test_fp8_dots_gemm_calls_and_async_collectives_of_a_hand_written_gpu_module():
    stats = plan_hlo.analyze(_GPU_MODULE, {"fsdp": 8})
    assert stats.flops == 2 * (64 * 16 * 32) + 2 * (64 * 16 * 16)   # the fp8 dot, then the cuBLAS call on 64x16
    by_kind = {c.kind: (c.bytes, c.axes, c.group_size) for c in stats.collectives}
    assert by_kind == {"all-gather": ((8 * 16 * 4 + 64 * 16 * 2) * 8, ("fsdp",), 8),   # the gathered outputs
                       "reduce-scatter": (64 * 16 * 4, ("fsdp",), 8),                 # the scattered input
                       "all-reduce": (8 * 16 * 4, ("fsdp",), 2),
                       "collective-permute": (8 * 16 * 4, ("fsdp",), 2)}
    fusion = 64 * 32 + 32 * 16 + 64 * 16 * 2                                  # fp8 inputs (1 byte), bf16 output
    gemm = 2 * 64 * 16 * 2 + 64 * 16 * 2 + 1024                               # operands, (output, workspace)
    gather = 8 * 16 * 4 + 64 * 16 * 2 + (64 * 16 * 4 + 512 * 16 * 2)         # inputs + outputs, once
    rest = (64 * 16 * 4 + 8 * 16 * 4) + 2 * 8 * 16 * 4 + 2 * 8 * 16 * 4       # scatter, all-reduce, permute
    assert stats.bytes_accessed == fusion + gemm + gather + rest
    sites = plan_hlo.collective_sites(_GPU_MODULE, {"fsdp": 8})
    assert sorted(s.bytes for s in sites) == sorted(b for b, _, _ in by_kind.values())
