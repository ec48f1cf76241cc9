"""The pipeline runtime: parity with a sequential single-device reference, memory from the compiled program,
and the errors it raises before tracing.

The stage function is the user's (a residual tanh MLP block with a Megatron-split hidden layer), not the
GPT's. Parity (DESIGN.md): loss and all three gradients per leaf max|got - ref| <= 1e-5 * max|ref|, the
reference being plain ``jax.value_and_grad`` of the whole sequential model on one device in float32 (the
whole-batch mean loss, which equals the mean of the equal-size microbatch losses). Run with ``-s`` to see the
errors reached.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_scalar_close, assert_tree_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar as jp
from jaxpar import _compat
from jaxpar.pipeline import B, F, Schedule

D, FF, S, C, MB = 16, 32, 4, 8, 4          # model width, hidden width, sequence, head outputs, microbatch rows
SCHEDULES = {"gpipe": jp.pipeline.gpipe, "1f1b": jp.pipeline.one_f_one_b}
MESHES = {"d2p2t2": {"data": 2, "pipe": 2, "tensor": 2}, "d2p4": {"data": 2, "pipe": 4},
          "p4t2": {"pipe": 4, "tensor": 2}}
# (stages, microbatches) -> mesh per schedule: p=2 beside data=2 and tensor=2; p=4 beside data=2 or tensor=2,
# alternating so that both schedules run on both p=4 meshes.
CASES = [(2, 2, "gpipe", "d2p2t2"), (2, 2, "1f1b", "d2p2t2"), (2, 8, "gpipe", "d2p2t2"), (2, 8, "1f1b", "d2p2t2"),
         (4, 4, "gpipe", "d2p4"), (4, 4, "1f1b", "p4t2"), (4, 8, "gpipe", "p4t2"), (4, 8, "1f1b", "d2p4"),
         (4, 16, "gpipe", "d2p4"), (4, 16, "1f1b", "p4t2")]
STAGE_SPECS = {"w_in": P("pipe", None, "tensor"), "b_in": P("pipe", "tensor"), "w_out": P("pipe", "tensor", None)}


def mlp_block(params, x_BSD):
    """The user's stage: ``x + tanh(x @ w_in + b_in) @ w_out`` (hidden layer split over ``tensor``)."""
    h_BSF = jnp.tanh(x_BSD @ params["w_in"] + params["b_in"])
    h_BSF = jax.lax.with_sharding_constraint(h_BSF, P(None, None, "tensor"))
    return x_BSD + h_BSF @ params["w_out"]


def head_loss(head, y_BSD, t_BSC):
    return jnp.mean(jnp.square(y_BSD @ head["w"] + head["b"] - t_BSC))


def make_problem(p, m, seed=0):
    rng = np.random.default_rng(seed + 100 * p + m)
    normal = lambda *shape, scale=1.0: (scale * rng.normal(size=shape)).astype(np.float32)
    stage = {"w_in": normal(p, D, FF, scale=0.3), "b_in": normal(p, FF, scale=0.1),
             "w_out": normal(p, FF, D, scale=0.2)}
    head = {"w": normal(D, C, scale=0.3), "b": normal(C, scale=0.1)}
    return stage, head, normal(MB * m, S, D), normal(MB * m, S, C)


def sequential(stage, x):
    for s in range(stage["w_in"].shape[0]):
        x = mlp_block({k: v[s] for k, v in stage.items()}, x)
    return x


def on_one_device(fn, *args):
    """``jit(fn)(*args)`` on a single device (a 1-device mesh in context for the stage's constraint)."""
    device = jax.devices()[0]
    with jax.set_mesh(jp.make_mesh(devices=[device])):
        return jax.device_get(jax.jit(fn)(*jax.device_put(args, device)))


def reference(stage, head, x, t):
    """Sequential single-device float32: ``jax.value_and_grad`` of the whole model, no pipeline code."""
    loss = lambda stage, head, x: head_loss(head, sequential(stage, x), t)
    return on_one_device(jax.value_and_grad(loss, argnums=(0, 1, 2)), stage, head, x)


def place(mesh, stage, head, x, t):
    stage = {k: jax.device_put(v, NamedSharding(mesh, STAGE_SPECS[k])) for k, v in stage.items()}
    return stage, head, *jp.train.shard_batch((x, t), mesh)


def check_parity(got, ref, what):
    loss, grads = got
    ref_loss, ref_grads = ref
    errs = {"loss": assert_scalar_close(loss, ref_loss, what=f"{what} loss"),
            "g_stage": assert_tree_close(grads[0], ref_grads[0], what=f"{what} g_stage"),
            "g_head": assert_tree_close(grads[1], ref_grads[1], what=f"{what} g_head"),
            "g_x": assert_tree_close(grads[2], ref_grads[2], what=f"{what} g_x")}
    print(f"{what}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    return errs


@pytest.mark.parametrize("p,m,schedule,mesh_name", CASES, ids=[f"{s}-p{p}-m{m}-{n}" for p, m, s, n in CASES])
def test_value_and_grad_matches_sequential_reference(p, m, schedule, mesh_name, mesh_factory):
    mesh = mesh_factory(**MESHES[mesh_name])
    stage, head, x, t = make_problem(p, m)
    ref = reference(stage, head, x, t)
    args = place(mesh, stage, head, x, t)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, SCHEDULES[schedule](p, m), mesh=mesh)
    loss, (g_stage, g_head, g_x) = f(*args)
    check_parity((loss, (g_stage, g_head, g_x)), ref, f"{schedule} p={p} m={m} {mesh_name}")
    # gradients come back with their inputs' shardings
    assert jax.tree.map(lambda g: g.sharding, g_stage) == jax.tree.map(lambda a: a.sharding, args[0])
    assert g_x.sharding == args[2].sharding and g_x.sharding.spec[0] == ("data", "fsdp")
    assert loss.dtype == jnp.float32 and g_x.dtype == jnp.float32


def test_stash_inputs_recomputes_and_matches(mesh_factory):
    p, m = 4, 8
    mesh = mesh_factory(**MESHES["d2p4"])
    stage, head, x, t = make_problem(p, m, seed=1)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, jp.pipeline.one_f_one_b(p, m), mesh=mesh, stash="inputs")
    check_parity(f(*place(mesh, stage, head, x, t)), reference(stage, head, x, t), "1f1b stash=inputs p=4 m=8")


def test_bfloat16_runs_close_to_float32(mesh_factory):
    """A bfloat16 model (params, activations, loss in bf16) runs; its numbers are close to float32's."""
    p, m = 2, 4
    mesh = mesh_factory(**MESHES["d2p2t2"])
    stage, head, x, t = make_problem(p, m, seed=5)
    bf16 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, jp.pipeline.one_f_one_b(p, m), mesh=mesh)
    loss, grads = f(*place(mesh, *bf16((stage, head, x, t))))
    assert loss.dtype == jnp.float32 and all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
    ref_loss, ref_grads = reference(stage, head, x, t)
    assert_scalar_close(loss, ref_loss, rtol=2e-2, what="bf16 loss")   # bf16 keeps 8 bits of mantissa
    assert_tree_close(jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_grads, rtol=5e-2, what="bf16 grads")


def random_schedule(p: int, m: int, seed: int) -> Schedule:
    """A valid but irregular table: each tick every stage runs a random ready action, or idles (1 in 5)."""
    rng, done, table = random.Random(seed), {}, []
    todo = [{(k, j) for k in "FB" for j in range(m)} for _ in range(p)]

    def ready(s, k, j):
        deps = [("F", j, s - 1)] if k == "F" and s else []
        deps += [("F", j, s)] + ([("B", j, s + 1)] if s < p - 1 else []) if k == "B" else []
        return all(d in done for d in deps)

    while any(todo):
        row = []
        for s in range(p):
            options = sorted(a for a in todo[s] if ready(s, *a))
            pick = rng.choice(options) if options and rng.random() > 0.2 else None
            row.append(pick)
        for s, a in enumerate(row):
            if a is not None:
                todo[s].discard(a)
                done[(a[0], a[1], s)] = len(table)
        table.append(tuple(None if a is None else (F if a[0] == "F" else B)(a[1]) for a in row))
    return Schedule(f"random{seed}", p, m, table)


def test_one_stage_runs_without_shard_map(mesh_factory):
    """p=1 (a mesh whose pipe axis has size 1) is plain microbatching, beside data, fsdp and tensor."""
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    stage, head, x, t = make_problem(1, 4, seed=6)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, jp.pipeline.one_f_one_b(1, 4), mesh=mesh)
    check_parity(f(*place(mesh, stage, head, x, t)), reference(stage, head, x, t), "1f1b p=1 m=4 d2f2t2")


def test_any_valid_table_runs(mesh_factory):
    """One interpreter for every table: an irregular random schedule gives the same numbers."""
    p, m = 4, 6
    sched = random_schedule(p, m, seed=3)
    assert max(sched.peak_stash) > 1 and max(c for _, c in sched.recv_slots) > 1, str(sched)
    mesh = mesh_factory(**MESHES["d2p4"])
    stage, head, x, t = make_problem(p, m, seed=2)
    f = jp.pipeline.value_and_grad(mlp_block, head_loss, sched, mesh=mesh)
    check_parity(f(*place(mesh, stage, head, x, t)), reference(stage, head, x, t), f"random table p={p} m={m}")


def test_apply_matches_sequential_forward(mesh_factory):
    p, m = 2, 4
    mesh = mesh_factory(**MESHES["d2p2t2"])
    stage, head, x, t = make_problem(p, m, seed=4)
    stage_p, _, x_p, _ = place(mesh, stage, head, x, t)
    y = jp.pipeline.apply(mlp_block, jp.pipeline.one_f_one_b(p, m), mesh=mesh)(stage_p, x_p)
    ref = on_one_device(sequential, stage, x)
    assert y.sharding == x_p.sharding
    print(f"apply p=2 m=4: {assert_tree_close(y, ref, what='apply'):.2e}")


# ---------------------------------------------------------------------------------------------- memory

def _benchmark():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_memory.py"
    spec = importlib.util.spec_from_file_location("pipeline_memory", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # four compiles; benchmarks/pipeline_memory.py and memory.py report the same figures; .ci/run runs it
def test_memory_1f1b_stash_grows_with_stages_not_microbatches(devices):
    """Compiled temp memory at p=4 for m = 8, 16, 32 (microbatch size fixed), less the g_x accumulator.

    GPipe stashes all m microbatches: its activation part grows by at least the stash of 24 microbatches
    from m=8 to m=32. 1F1B stashes at most p: its activation part stays within one microbatch's stash. At
    m=16, 1F1B's activation part is at most half of GPipe's. From p=2 to p=4, 1F1B's grows (2 more slots).
    """
    bench = _benchmark()
    rows = {(s, m): bench.measure(s, 4, m) for s in ("gpipe", "1f1b") for m in (8, 16, 32)}
    for (s, m), r in sorted(rows.items()):
        print(f"p=4 {s:5s} m={m:2d}: temp {r['temp_bytes'] / 2**20:6.2f} MiB, activation part "
              f"{r['activation_bytes'] / 2**20:6.2f} MiB, stash slots {r['stash_slots']}")
    act = {k: r["activation_bytes"] for k, r in rows.items()}
    one = rows[("1f1b", 8)]["microbatch_activation_bytes"]
    # one microbatch's stash in this model: 2 layers x (x, 4x hidden, 4x tanh') >= 10 activations
    per_mb = (act[("gpipe", 32)] - act[("gpipe", 8)]) / 24
    assert per_mb >= 10 * one, per_mb / one
    assert max(act[("1f1b", m)] for m in (8, 16, 32)) - min(act[("1f1b", m)] for m in (8, 16, 32)) < per_mb
    assert act[("1f1b", 16)] <= 0.5 * act[("gpipe", 16)], (act[("1f1b", 16)], act[("gpipe", 16)])
    p2 = bench.measure("1f1b", 2, 8)
    print(f"p=2 1f1b  m= 8: activation part {p2['activation_bytes'] / 2**20:6.2f} MiB")
    assert act[("1f1b", 8)] - p2["activation_bytes"] >= 1.5 * per_mb


@pytest.mark.parametrize("schedule,m", [("1f1b", 8), ("gpipe", 16)])
def test_stash_is_written_and_read_in_place(schedule, m, devices):
    """The compiled program never copies a stash buffer (``[slots, ...]``) after initialising it: F writes
    its slot in place and B reads its slot, whatever the other ticks do. (Threading the stash through the
    multi-way action switch made XLA copy every stash buffer at every tick.)"""
    bench = _benchmark()
    p = 4
    slots = max(SCHEDULES[schedule](p, m).peak_stash)
    text = bench.compile_program(schedule, p, m).as_text()
    local = bench.MICROBATCH // bench.DATA
    shapes = [f"f32[{slots},{local},{bench.SEQ},{n}]" for n in (bench.D, bench.F)]
    assert any(s in text for s in shapes), "the stash buffers were not found; has the benchmark model changed?"
    copies = [line.strip() for line in text.splitlines()
              if " copy(" in line and "broadcast" not in line and any(s + "{" in line for s in shapes)]
    assert not copies, copies[:3]


# ----------------------------------------------------------------------------------------------- errors

def _f(mesh, p=2, m=2, schedule="1f1b", stage_fn=mlp_block, loss_fn=head_loss, **kw):
    return jp.pipeline.value_and_grad(stage_fn, loss_fn, SCHEDULES[schedule](p, m), mesh=mesh, **kw)


def test_errors_at_the_api_boundary(mesh_factory):
    mesh = mesh_factory(**MESHES["d2p2t2"])
    stage, head, x, t = make_problem(2, 2)
    with pytest.raises(ValueError, match=r"the mesh has pipe=2 but schedule '1f1b' has num_stages=4"):
        _f(mesh, p=4, m=4)
    with pytest.raises(ValueError, match=r"no 'pipe' axis"):
        jp.pipeline.value_and_grad(mlp_block, head_loss, jp.pipeline.gpipe(2, 2),
                                   mesh=jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,)))
    with pytest.raises(TypeError, match=r"schedule must be a jp.pipeline.Schedule"):
        jp.pipeline.value_and_grad(mlp_block, head_loss, "1f1b", mesh=mesh)
    with pytest.raises(ValueError, match=r"forward-only; use jp.pipeline.apply"):
        jp.pipeline.value_and_grad(mlp_block, head_loss, jp.pipeline.gpipe(2, 2).forward_only(), mesh=mesh)
    with pytest.raises(ValueError, match=r"stash='all'"):
        _f(mesh, stash="all")
    f = _f(mesh)
    bad_stage = {**stage, "w_in": stage["w_in"][:1]}
    with pytest.raises(ValueError, match=r"stage_params\['w_in'\] has shape \(1, 16, 32\): every leaf needs a "
                                         r"leading axis of exactly num_stages = 2"):
        f(bad_stage, head, x, t)
    with pytest.raises(ValueError, match=r"batch 7 is not divisible by num_microbatches = 2"):
        f(stage, head, x[:7], t[:7])
    with pytest.raises(ValueError, match=r"microbatch 3 \(batch 6 / 2 microbatches\) is not divisible by data\*fsdp "
                                         r"= 2; use a batch that is a multiple of 4"):
        f(stage, head, x[:6], t[:6])
    with pytest.raises(ValueError, match=r"targets has shape \(4, 4, 8\); its leading axis must be x's batch \(8\)"):
        f(stage, head, x, t[:4])
    shrink = lambda params, x: mlp_block(params, x)[:, :2]
    with pytest.raises(ValueError, match=r"stage_fn maps a microbatch float32\[4, 4, 16\] to float32\[4, 2, 16\]: "
                                         r"a pipeline stage must keep the activation's shape"):
        _f(mesh, stage_fn=shrink)(stage, head, x, t)
    with pytest.raises(ValueError, match=r"loss_fn\(head_params, y_mb, targets_mb\) must return a float scalar"):
        _f(mesh, loss_fn=lambda h, y, t: y)(stage, head, x, t)
    with pytest.raises(ValueError, match=r"1F1B needs num_microbatches >= num_stages"):
        _f(mesh, p=2, m=1)
    apply = jp.pipeline.apply(mlp_block, jp.pipeline.gpipe(2, 2), mesh=mesh)
    with pytest.raises(ValueError, match=r"batch 5 is not divisible by num_microbatches = 2"):
        apply(stage, x[:5])


# ------------------------------------------------------------------------------------ version workarounds

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


@pytest.mark.slow  # five compiles (~20 s); benchmarks/pipeline_memory.py prints the same table
def test_zero_bubble_v_memory_within_1f1b(devices):
    """Every schedule at p=4, m=16, the same model and microbatch size: ZB-V's peak stash per device is no more
    than 1F1B's, in (microbatch x 1/p of the layers) units and in compiled bytes (the stash buffers, and the
    whole activation part of the compiled temporaries); 1F1B keeps at most 0.36 of GPipe's activation part."""
    rows = {r["schedule"]: r for r in _benchmark().schedule_table(4, 16)}
    for name, r in rows.items():
        print(f"{name:12s} peak stash (layer units) {max(r['peak_stash_layers']):4.1f}  stash "
              f"{r['stash_bytes'] / 2**20:5.2f} MiB  activation part {r['activation_bytes'] / 2**20:5.2f} MiB  "
              f"over 1F1B {r['activation_over_1f1b']:.3f}  over GPipe {r['activation_over_gpipe']:.3f}")
    zbv, ofob = rows["zbv"], rows["1f1b"]
    assert max(zbv["peak_stash_layers"]) <= max(ofob["peak_stash_layers"])
    assert zbv["stash_bytes"] <= ofob["stash_bytes"], (zbv["stash_bytes"], ofob["stash_bytes"])
    assert zbv["activation_bytes"] <= ofob["activation_bytes"], (zbv["activation_bytes"], ofob["activation_bytes"])
    assert ofob["activation_over_gpipe"] <= 0.36
