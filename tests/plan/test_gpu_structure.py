"""What the GPU compiler makes of jaxpar's train steps, read from the optimized H100 program (XLA:GPU run deviceless
on this CPU machine through jp.plan.gpu_target; no GPU needed).

XLA:CPU cannot show these: it all-reduces FSDP gradients, gathers f32 weights, runs collectives synchronously and
upcasts fp8 dots. Each step is compiled once per module (10-30 CPU-s for the larger ones); the FSDP step is the
fast test's, the rest are slow.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from jaxpar import _hlo
from jaxpar.layers import attention
from jaxpar.models import GPT, GPTConfig
from jaxpar.plan import targets

try:
    targets.check_cuda_plugin()
except ImportError as e:
    pytest.skip(f"the gpu extra is not installed: {e}", allow_module_level=True)

CFG = GPTConfig(vocab_size=61, num_layers=1, num_heads=4, d_model=64, d_mlp=256, max_seq_len=32)
PIPE_CFG = dataclasses.replace(CFG, num_layers=2)    # a layer per stage
BATCH, SEQ = 16, 32
NO_CUDNN = importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.cudnn") is None
BF16 = "mixed_bf16"


pytestmark = pytest.mark.usefixtures("no_persistent_cache")   # compile-only programs (tests/plan/conftest.py)


@pytest.fixture(scope="module")
def target():
    return jp.plan.gpu_target("h100")


@pytest.fixture(scope="module")
def compiled(target):
    """``compiled(policy, schedule=None, cfg=CFG, **mesh_sizes) -> (mesh, state, compiled step)`` on H100s,
    cached per case; the batch is host (numpy) token ids, as a run passes them."""
    cache = {}
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, CFG.vocab_size, (BATCH, SEQ), dtype=np.int32) for k in ("inputs", "targets")}

    def get(policy, schedule=None, cfg=CFG, **sizes):
        key = (policy, schedule, cfg, tuple(sorted(sizes.items())))
        if key not in cache:
            mesh = jp.make_mesh(**sizes, devices=target.devices)
            model, tx = GPT(cfg), optax.adam(1e-3)
            pipe = None if schedule is None else jp.pipeline.Pipeline.from_model(model, schedule)
            state = jp.train.abstract_state(model.init, tx, mesh=mesh, policy=jp.Policy.from_string(policy),
                                            pipeline=pipe)
            step = jp.train.make_train_step(model.loss if pipe is None else pipe, tx, mesh=mesh)
            cache[key] = mesh, state, step.lower(state, batch).compile()
        return cache[key]
    return get


def _instrs(text: str):
    comps, _ = _hlo.parse_module(text)
    return [(comp, i) for comp, instrs in comps.items() for i in instrs]


def _elements(shape: str, dtype: str | None = None) -> int:
    return sum(math.prod(dims) for t, dims in _hlo.array_dims(shape) if dtype is None or t == dtype)


def _collective_io(text: str, kind: str) -> list[tuple[str, str]]:
    """``(operand shapes, result shapes)`` of every ``kind`` collective (its async ``-start`` included): an async
    start's shape is ``((operands), (results))``, a sync one's the results."""
    out = []
    for _, i in _instrs(text):
        if i.opcode == f"{kind}-start" and i.shape.startswith("(("):
            depth = 0
            for end, ch in enumerate(i.shape[1:], 1):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    break
            out.append((i.shape[1:end + 1], i.shape[end + 1:-1]))
        elif i.opcode in (kind, f"{kind}-start"):
            out.append(("", i.shape))
    return out


def _matrix_sizes(state, blocks_only: bool = False) -> list[int]:
    """Elements of each param that is a matrix (or more), one layer's for the stacked blocks."""
    sizes = []
    for path, x in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        stacked = "blocks" in jax.tree_util.keystr(path)
        if x.ndim - stacked >= 2 and (stacked or not blocks_only):
            sizes += [math.prod(x.shape[stacked:])] * (x.shape[0] if stacked else 1)
    return sizes


def _matrix_elements(state, blocks_only: bool = False) -> int:
    return sum(_matrix_sizes(state, blocks_only))


def test_fsdp_gradients_are_reduce_scattered(compiled):
    """fsdp=8 on H100s: every weight matrix's gradient leaves the backward pass through a reduce-scatter (each
    device receives its 1/8); what is still all-reduced is smaller than any matrix (biases the rules leave
    whole, the loss). XLA:CPU all-reduces them all."""
    _, state, comp = compiled(BF16, fsdp=8)
    text = comp.as_text()
    scattered = _collective_io(text, "reduce-scatter")
    assert scattered, "no reduce-scatter in the GPU program"
    inputs = sum(_elements(ins) for ins, _ in scattered)
    assert inputs == 8 * sum(_elements(outs) for _, outs in scattered)
    assert inputs >= _matrix_elements(state), (inputs, _matrix_elements(state))
    smallest = min(_matrix_sizes(state))
    reduced = [_elements(outs) for _, outs in _collective_io(text, "all-reduce")]
    assert max(reduced, default=0) < smallest, (reduced, smallest)


@pytest.mark.slow
def test_fsdp_gathers_block_weights_in_bf16(compiled):
    """Under a bf16 compute policy the blocks' float32 weights are cast before they are gathered: the bf16
    all-gathers carry at least every block matrix; float32 gathers only the embedding tables (their lookup reads
    the float32 table)."""
    _, state, comp = compiled(BF16, fsdp=8)
    gathered = [outs for _, outs in _collective_io(comp.as_text(), "all-gather")]
    bf16 = sum(_elements(s, "bf16") for s in gathered)
    f32 = sum(_elements(s, "f32") for s in gathered)
    assert bf16 >= _matrix_elements(state, blocks_only=True), (bf16, _matrix_elements(state, blocks_only=True))
    embeddings = sum(x.size for path, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
                     if "blocks" not in jax.tree_util.keystr(path) and x.ndim >= 2)
    assert f32 <= embeddings, (f32, embeddings)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp", "fp8", "pipeline"])
def test_every_collective_is_async(compiled, case):
    """Every collective of the GPU program is an async start/done pair (the latency-hiding scheduler can move
    compute between them): none is issued in its synchronous form."""
    text = _case(compiled, case)[2].as_text()
    opcodes = [i.opcode for _, i in _instrs(text)]
    sync = [op for op in opcodes if op in _hlo.COLLECTIVES]
    starts = [op for op in opcodes if op.removesuffix("-start") in _hlo.COLLECTIVES and op.endswith("-start")]
    dones = [op for op in opcodes if op.removesuffix("-done") in _hlo.COLLECTIVES and op.endswith("-done")]
    assert not sync and starts and len(starts) == len(dones), (sync, len(starts), len(dones))


def _case(compiled, case):
    if case == "fsdp":
        return compiled(BF16, fsdp=8)
    if case == "fp8":
        return compiled("p=f32,c=bf16,o=f32,dot=fp8", fsdp=8)
    return compiled(BF16, jp.pipeline.gpipe(2, 4), PIPE_CFG, data=4, pipe=2)


def _fp8_gemm_dots(text: str) -> list[tuple[str, str, str]]:
    """``(lhs type, rhs type, how)`` of each dot whose operands are both fp8, ``how`` the GEMM that runs it: a
    Triton GEMM fusion (``__triton_gemm`` / nested GEMM fusion backend configs) or a cuBLASLt custom call."""
    comps, _ = _hlo.parse_module(text)
    triton = {dict(_hlo.callees(i)).get("calls") for instrs in comps.values() for i in instrs
              if i.opcode == "fusion" and "__triton" in i.attrs}
    found = []
    for comp, instrs in comps.items():
        shapes = {i.name: i.shape for i in instrs}
        for i in instrs:
            if i.opcode == "dot":
                # the element type read here: jaxpar._hlo's byte table may not know fp8 types
                types = [t.group(1) for t in (re.match(r"(\w+)\[", shapes.get(o, "")) for o in i.operands[:2]) if t]
                if len(types) == 2 and all(t.startswith("f8") for t in types):
                    found.append((*types, "triton" if comp in triton else "other"))
            elif i.opcode == "custom-call" and "cublas$lt$matmul$f8" in i.attrs:
                found.append(("f8", "f8", "cublaslt"))
    return found


@pytest.mark.slow
def test_fp8_policy_gives_fp8_gemms(compiled):
    """``dot=fp8``: every dense matmul of the blocks runs as an fp8 GEMM on the GPU (e4m3 x e4m3 forward, e5m2
    gradients against e4m3 backward), in Triton GEMM fusions or cuBLASLt: none is upcast as on XLA:CPU."""
    _, _, comp = compiled("p=f32,c=bf16,o=f32,dot=fp8", fsdp=8)
    dots = _fp8_gemm_dots(comp.as_text())
    assert all(how in ("triton", "cublaslt") for *_, how in dots), dots
    kinds = {(a, b) for a, b, _ in dots}
    assert ("f8e4m3fn", "f8e4m3fn") in kinds and any("f8e5m2" in k for k in kinds), kinds
    per_layer = 4                      # qkv, attention out, MLP up, MLP down
    assert len(dots) >= 3 * per_layer * CFG.num_layers, len(dots)     # forward + two backward GEMMs each


@pytest.mark.slow
@pytest.mark.skipif(NO_CUDNN, reason="cuDNN attention needs nvidia-cudnn-cu12 (about 0.6 GB; not in the test extra): "
                                     "pip install nvidia-cudnn-cu12")
def test_cudnn_attention_gives_cudnn_fused_attention(compiled):
    """``attention="cudnn"`` on compile-only H100s passes jaxpar's GPU guard (the mesh's devices) and compiles to
    cuDNN's fused attention calls, forward and backward, one per layer."""
    cfg = dataclasses.replace(CFG, attention="cudnn")
    _, _, comp = compiled(BF16, None, cfg, fsdp=8)
    calls = [i.attrs for _, i in _instrs(comp.as_text()) if i.opcode == "custom-call"]
    forward = [a for a in calls if '"__cudnn$fmhaSoftmax"' in a]
    backward = [a for a in calls if '"__cudnn$fmhaSoftmaxBackward"' in a]
    assert len(forward) == len(backward) == CFG.num_layers, (len(forward), len(backward))


def test_cudnn_guard_reads_the_mesh_devices(target):
    """The guard looks at the mesh in context: compile-only GPU devices pass it on this CPU machine (tracing
    reaches jax's cuDNN lowering), CPU meshes still get jaxpar's error."""
    cfg = dataclasses.replace(CFG, attention="cudnn")
    x = jax.ShapeDtypeStruct((2, SEQ, CFG.num_heads, CFG.head_dim), jnp.bfloat16)
    attend = jax.jit(lambda q: attention.attend(cfg, q, q, q))
    with jax.set_mesh(jp.make_mesh(data=8, devices=target.devices)):
        try:
            assert jax.eval_shape(attend, x).shape == x.shape
        except RuntimeError as e:      # past jaxpar's guard: jax's own cuDNN check, without nvidia-cudnn-cu12
            assert NO_CUDNN and "cuDNN" in str(e), e
    with jax.set_mesh(jp.make_mesh(data=8, devices=jax.devices("cpu")[:8])), \
            pytest.raises(ValueError, match="needs a GPU .* got cpu devices"):
        jax.eval_shape(attend, x)


@pytest.mark.slow
def test_pipeline_stages_exchange_by_collective_permute(compiled):
    """A GPipe step over pipe=2: inside the tick loop the only collectives over ``pipe`` are collective-permutes
    (activations forward, gradients back); over ``pipe`` outside it only the stage-shared gradients are summed,
    once per step."""
    mesh, _, comp = _case(compiled, "pipeline")
    sites = [s for s in _hlo.collective_sites(comp.as_text(), dict(mesh.shape)) if "pipe" in s.axes]
    in_loop = {s.kind for s in sites if s.loop_depth > 0}
    assert in_loop == {"collective-permute"}, [(s.kind, s.axes, s.loop_depth) for s in sites]
    after = [s for s in sites if s.loop_depth == 0]
    assert {s.kind for s in after} <= {"all-reduce"} and all(s.runs == 1 for s in after), after


@pytest.mark.slow
def test_a_1b_step_fits_an_h100(target):
    """A 1.3B GPT (GPT-3 XL shapes), fsdp=8, bf16 compute, full remat, 16 x 2048 tokens: the GPU compiler's
    memory per device (arguments + temporaries + outputs not aliased to arguments) fits the H100's 80 GB, and its
    arguments hold the float32 params and Adam moments split 8 ways."""
    cfg = GPTConfig(vocab_size=50304, num_layers=24, num_heads=16, d_model=2048, max_seq_len=2048, scan_layers=True,
                    remat="full")
    model, tx = GPT(cfg), optax.adam(1e-3)
    mesh = target.mesh(fsdp=8)
    state = jp.train.abstract_state(model.init, tx, mesh=mesh, policy=jp.Policy.from_string(BF16))
    batch = {k: jax.ShapeDtypeStruct((16, 2048), jnp.int32) for k in ("inputs", "targets")}
    mem = jp.train.make_train_step(model.loss, tx, mesh=mesh).lower(state, batch).compile().memory_analysis()
    state_bytes = 3 * 4 * cfg.num_params() / 8
    assert state_bytes <= mem.argument_size_in_bytes <= 1.05 * state_bytes + 1e6, (mem, state_bytes)
    total = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    assert total <= target.memory_bytes, (total, mem)


@pytest.mark.slow
def test_b200_target_compiles_a_step():
    """jaxlib 0.10.2's compiler handles B200 (sm_100): an FSDP step compiles and reduce-scatters its gradients. (Its
    Triton GEMM tiling rejects some tiny dots, e.g. CFG's 64 x 64 qkv gradient: "Couldn't find output tile sizes";
    hence d_model=256 here; XLA_FLAGS=--xla_gpu_enable_triton_gemm=false avoids it.)"""
    target = jp.plan.gpu_target("b200")
    cfg = GPTConfig(vocab_size=512, num_layers=1, num_heads=8, d_model=256, max_seq_len=256)
    model, tx = GPT(cfg), optax.adam(1e-3)
    mesh = target.mesh(fsdp=8)
    state = jp.train.abstract_state(model.init, tx, mesh=mesh, policy=jp.Policy.from_string(BF16))
    batch = {k: jax.ShapeDtypeStruct((16, 256), jnp.int32) for k in ("inputs", "targets")}
    text = jp.train.make_train_step(model.loss, tx, mesh=mesh).lower(state, batch).compile().as_text()
    assert {d.device_kind for d in target.devices} == {"NVIDIA B200"}
    assert sum(_elements(ins) for ins, _ in _collective_io(text, "reduce-scatter")) >= _matrix_elements(state)
