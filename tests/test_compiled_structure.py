"""Structure tests from the compiled program and the placed arrays (deterministic; no timing).

They catch a silently replicated parameter, an all-gather of whole weight matrices under tensor
parallelism, or a layout that does all the work on every device.
"""

from __future__ import annotations

import itertools
import math

import jax
import numpy as np
import optax
import pytest

import jaxpar as jp
from jaxpar import _hlo as plan_hlo
from helpers import gpt_batch
from jaxpar.models import GPT, GPTConfig

# d_mlp=320 (not 4*64=256) so no weight shape collides with an activation shape ([B*L, D] = [256, 64]).
CFG = GPTConfig(vocab_size=61, num_layers=2, num_heads=8, d_model=64, d_mlp=320, max_seq_len=16)
BATCH, SEQ = 16, 16
D, F, H, K, V, N = CFG.d_model, CFG.mlp_dim, CFG.num_heads, CFG.head_dim, CFG.padded_vocab, CFG.num_layers

def _collectives(hlo: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """``(kind, [result shapes])`` of every collective in an HLO module's text (tuple results expanded)."""
    return [(i.opcode.removesuffix("-start"), [dims for _, dims in plan_hlo.array_dims(i.shape)])
            for instrs in plan_hlo.parse_module(hlo)[0].values() for i in instrs
            if i.opcode.removesuffix("-start") in plan_hlo.COLLECTIVES]


def _parse_hlo(hlo: str) -> dict[str, dict[str, dict]]:
    """``{computation: {instruction: {op, shapes, tuple, operands, calls, index, param}}}`` of an HLO module."""
    def entry(i):
        index = plan_hlo.attribute(i.attrs, "index") if i.opcode == "get-tuple-element" else None
        return dict(op=i.opcode, tuple=i.shape.startswith("("), operands=i.operands,
                    shapes=[dims for _, dims in plan_hlo.array_dims(i.shape)],
                    calls=dict(plan_hlo.callees(i)).get("calls"), index=None if index is None else int(index),
                    param=int(i.args) if i.opcode == "parameter" else None)
    return {name: {i.name: entry(i) for i in instrs} for name, instrs in plan_hlo.parse_module(hlo)[0].items()}


def _users(comp: dict, name: str) -> list[tuple[str, dict]]:
    return [(n, i) for n, i in comp.items() if name in i["operands"]]


def _uses_other_than_a_device_slice(comps: dict, comp: dict, name: str, ways: int, numel: int) -> list[str]:
    """The uses of value ``name`` that are not a ``dynamic-slice`` to ``numel / ways`` elements at a
    device-dependent offset (looking into the fusions it enters). Empty: the value is only ever sliced."""
    bad = []
    for n, u in _users(comp, name):
        if u["op"] == "dynamic-slice" and u["operands"][0] == name:
            offsets = [comp[o]["op"] for o in u["operands"][1:] if o in comp]
            if math.prod(u["shapes"][0]) * ways != numel or all(op == "constant" for op in offsets):
                bad.append(f"{n}: dynamic-slice to {u['shapes'][0]} at offsets {offsets}")
        elif u["op"] == "fusion":
            fused = comps[u["calls"]]
            for k in (k for k, o in enumerate(u["operands"]) if o == name):
                param = next(p for p, i in fused.items() if i["op"] == "parameter" and i["param"] == k)
                bad += [f"{n} > {b}" for b in _uses_other_than_a_device_slice(comps, fused, param, ways, numel)]
        else:
            bad.append(f"{n}: {u['op']} -> {u['shapes']}")
    return bad if _users(comp, name) else [f"{name} is unused"]


def _squeeze(shape):
    return tuple(d for d in shape if d != 1)


def _full_kernel_shapes(extra=()) -> set[tuple[int, ...]]:
    """Every shape a whole (unsplit) block kernel or embedding could take in the program: as stored, as the 2-D
    matmul operand the model reshapes it to, transposed, and stacked over the layers."""
    kernels = [(D, F), (D, H, 3, K), (D, H * 3 * K), (H, K, D), (H * K, D), (V, D), *extra]
    shapes = set()
    for k in kernels:
        for perm in itertools.permutations(k):
            shapes.add(_squeeze(perm))
            shapes.add(_squeeze((N, *perm)))
    return shapes


@pytest.fixture(scope="module")
def compiled(mesh_factory):
    """``compiled(**mesh_sizes) -> (state, compiled train step)`` for the GPT with Adam, cached per layout."""
    cache = {}
    model, tx = GPT(CFG), optax.adam(1e-3)
    batch = gpt_batch(np.random.default_rng(0), BATCH, CFG, SEQ)

    def get(**sizes):
        key = tuple(sorted(sizes.items()))
        if key not in cache:
            mesh = mesh_factory(**sizes)
            state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
            step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
            cache[key] = state, step.lower(state, batch).compile()
        return cache[key]
    return get


def _flops(compiled) -> float:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):      # older jax: one dict per program
        analysis = analysis[0]
    return float(analysis["flops"])


def _bytes_on(device, tree) -> int:
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def test_fsdp_splits_params_and_optimizer_state(compiled, devices):
    """fsdp=8 holds at most 1/8 of the replicated (data=8) params + Adam state per device, plus the few
    vectors the rules leave whole (biases over 'mlp', Adam's count)."""
    rep_state, rep_compiled = compiled(data=8)
    fsdp_state, fsdp_compiled = compiled(data=1, fsdp=8)
    rep = _bytes_on(devices[0], (rep_state.params, rep_state.opt_state))
    got = _bytes_on(devices[0], (fsdp_state.params, fsdp_state.opt_state))
    assert rep == 3 * 4 * CFG.num_params() + 4        # params, mu, nu in float32, and the int32 count
    assert got <= rep / 8 * 1.05, (got, rep / 8)

    # no matrix (or bigger) of the params or the optimizer state is left whole on a device
    for path, x in jax.tree_util.tree_flatten_with_path((fsdp_state.params, fsdp_state.opt_state))[0]:
        if x.ndim - (1 if "blocks" in jax.tree_util.keystr(path) else 0) >= 2:
            assert x.addressable_shards[0].data.size * 8 == x.size, (
                f"{jax.tree_util.keystr(path)} {x.shape} is not split 8 ways: {x.sharding.spec}")

    # the compiled step's per-device arguments (state + batch) shrink the same way
    rep_args = rep_compiled.memory_analysis().argument_size_in_bytes
    got_args = fsdp_compiled.memory_analysis().argument_size_in_bytes
    assert got_args <= rep_args / 8 * 1.05, (got_args, rep_args / 8)


# the fast set keeps tensor8 (its program is compiled for test_tensor_parallel_reduces_activations_not_weights
# anyway, and tensor parallelism is where a layout could repeat work); data2_fsdp2_tensor2 (~9 CPU-s, a program
# of its own) is slow: its fast sibling is [data1_tensor8], and test_parity's 2x2x2 steps run that layout
@pytest.mark.parametrize("sizes", [pytest.param(dict(data=8), marks=pytest.mark.slow),
                                   pytest.param(dict(data=1, fsdp=8), marks=pytest.mark.slow),
                                   dict(data=1, tensor=8),
                                   pytest.param(dict(data=2, fsdp=2, tensor=2), marks=pytest.mark.slow)],
                         ids=lambda s: "_".join(f"{k}{v}" for k, v in s.items()))
def test_work_is_split(compiled, sizes):
    """Every layout's per-device FLOPs are about 1/8 of the single-device step's (a layout computing
    everything on every device would be 8x)."""
    _, one = compiled()
    _, got = compiled(**sizes)
    flops_one, flops = _flops(one), _flops(got)
    # tensor parallelism repeats the LayerNorms, residual adds and softmax statistics on every device
    assert flops_one / 8 <= flops * 1.01 and flops <= 1.5 * flops_one / 8, (flops, flops_one / 8)


def test_data_parallel_all_reduces_gradients_and_gathers_nothing(compiled):
    _, comp = compiled(data=8)
    colls = _collectives(comp.as_text())
    assert not [c for c in colls if c[0] == "all-gather"], colls
    reduced = {s for kind, shapes in colls if kind == "all-reduce" for s in shapes}
    assert (D, F) in reduced and (F, D) in reduced, reduced        # whole gradients of the MLP kernels


def test_fsdp_gathers_weights_per_layer(compiled):
    _, comp = compiled(data=1, fsdp=8)
    gathered = [s for kind, shapes in _collectives(comp.as_text()) if kind == "all-gather" for s in shapes]
    # each layer gathers its up and down kernels (the layers are unrolled, so once per layer)
    assert gathered.count((D, F)) >= N and gathered.count((F, D)) >= N, gathered


def test_fsdp_reduce_scatters_weight_gradients(compiled):
    """fsdp=8: every whole weight-matrix gradient (the up/down, qkv and out kernels of each layer, the
    embeddings) that is summed over the devices is reduce-scattered: a ``reduce-scatter``, or, as XLA:CPU
    emits it, an ``all-reduce`` whose full-size result is only ever cut to this device's 1/8 by a
    ``dynamic-slice`` at a partition-dependent offset before anything else reads it. A replicated parameter
    (e.g. ``embed`` mapped to no mesh axis) has its whole reduced gradient read by the optimizer: it fails.
    (On XLA:CPU the full gradient is still all-reduced, so this checks the layout, not the traffic.)"""
    _, comp = compiled(data=1, fsdp=8)
    comps = _parse_hlo(comp.as_text())
    full = _full_kernel_shapes(extra=[(CFG.max_seq_len, D)])    # + the learned position embedding
    scattered, misused = [], []
    for comp_ in comps.values():
        for name, ins in comp_.items():
            if ins["op"] == "reduce-scatter":
                scattered += [comp_[o]["shapes"][0] for o in ins["operands"] if o in comp_]
            if ins["op"] != "all-reduce":
                continue
            for k, shape in enumerate(ins["shapes"]):
                if _squeeze(shape) not in full:
                    continue
                values = [g for g, i in _users(comp_, name) if i["op"] == "get-tuple-element" and i["index"] == k] \
                    if ins["tuple"] else [name]
                for v in values:
                    bad = _uses_other_than_a_device_slice(comps, comp_, v, 8, math.prod(shape))
                    if bad:
                        misused.append((shape, v, bad))
                    else:
                        scattered.append(shape)
    assert not misused, "whole reduced weight gradients read unsliced (replicated parameters):\n" + "\n".join(
        f"{s} {v}: {b}" for s, v, b in misused)
    # not vacuous: the gradients of every layer's up and down kernels and of the token embedding are among them
    scattered = [_squeeze(s) for s in scattered]
    assert sum(s in {(D, F), (F, D)} for s in scattered) >= 2 * N, scattered
    assert sum(s in {(V, D), (D, V)} for s in scattered) >= 1, scattered


def test_tensor_parallel_reduces_activations_not_weights(compiled):
    """Megatron: the row-parallel out and down projections end in an all-reduce of the [B*L, D] activations
    (2 per layer in the forward pass); no weight matrix is ever gathered whole."""
    _, comp = compiled(data=1, tensor=8)
    colls = _collectives(comp.as_text())
    reduced = [s for kind, shapes in colls if kind == "all-reduce" for s in shapes]
    activation = [s for s in reduced if s in {(BATCH * SEQ, D), (BATCH, SEQ, D)}]
    assert len(activation) >= 2 * N, reduced
    full = _full_kernel_shapes()
    gathered = [s for kind, shapes in colls if kind == "all-gather" for s in shapes]
    assert not [s for s in gathered if _squeeze(s) in full], gathered


def test_fsdp_with_tensor_gathers_only_tensor_local_weights(compiled):
    """fsdp=2 x tensor=4: FSDP all-gathers each kernel's tensor-local slice ([D, F/4]), never the whole kernel."""
    _, comp = compiled(data=1, fsdp=2, tensor=4)
    colls = _collectives(comp.as_text())
    gathered = [s for kind, shapes in colls if kind == "all-gather" for s in shapes]
    assert (D, F // 4) in gathered and (F // 4, D) in gathered, gathered
    assert not [s for s in gathered if _squeeze(s) in _full_kernel_shapes()], gathered
    assert any(kind == "all-reduce" for kind, _ in colls)
