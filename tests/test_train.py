"""jaxpar/train/step.py: the train state (``init_state`` / ``abstract_state``), ``make_train_step`` and
``make_eval_step``, what they check before tracing, lowering from shapes, and the rng a ``loss_fn`` gets.

Evaluation and randomness are checked against losses computed here. The loss_fn is the suite's MLP classifier
behind inverted dropout on its inputs (``jax.random.bernoulli(rng, 0.5, x.shape)``), so the loss depends on the
exact key it is given. The key is derived in the test from the seed alone: ``jp.train.init_state`` splits
``jax.random.key(seed)`` into ``(init_key, state_rng)``; step ``t`` uses ``fold_in(state_rng, t)``; with
``grad_accum_steps=k``, microbatch ``j`` (rows ``j::k``) uses ``fold_in(fold_in(state_rng, t), j)``. Parity as
docs/architecture.md "Tests": per leaf ``max|got - ref| <= 1e-5 * max|ref|``. Run with ``-s`` to see the errors reached.
"""

from __future__ import annotations

import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (SMALL_GPT, SMALL_LLAMA, assert_scalar_close, assert_tree_close, gpt_batch, gpt_parts, max_rel_err,
                     mlp_batch, mlp_parts)
from jax.sharding import PartitionSpec as P

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig
from jaxpar import _hlo as plan_hlo
from jaxpar.train.grads import check_parts


# ------------------------------------------------------------------------------- init_state, abstract_state

def test_tx_must_be_a_gradient_transformation(mesh):
    init_fn, loss_fn = mlp_parts()
    for tx in (None, optax.adam):
        with pytest.raises(TypeError, match="optax.GradientTransformation"):
            jp.train.init_state(init_fn, tx, 0, mesh=mesh)


def test_wrong_argument_types(mesh_factory):
    init_fn, loss_fn = gpt_parts()
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh .*got dict"):
        jp.train.init_state(init_fn, optax.sgd(0.1), 0, mesh={"data": 8})
    with pytest.raises(TypeError, match=r"policy must be a jp.precision.Policy or None, got 'bf16'"):
        jp.train.init_state(init_fn, optax.sgd(0.1), 0, mesh=mesh_factory(), policy="bf16")
    with pytest.raises(TypeError, match=r"rng must be a typed key"):
        jp.train.init_state(init_fn, optax.sgd(0.1), "seed", mesh=mesh_factory())


def test_rules_with_unknown_mesh_axis(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    rules = tuple((n, "model" if n == "mlp" else t) for n, t in jp.sharding.DEFAULT_RULES)
    init_fn, loss_fn = gpt_parts()
    pattern = (r"rules name mesh axes \['model'\] that the mesh \('data', 'pipe', 'fsdp', 'context', 'tensor'\) does not have "
               r"\(in \[\('mlp', 'model'\)\]\); use axes of the mesh")
    for build in (lambda: jp.train.init_state(init_fn, optax.sgd(0.1), 0, mesh=mesh, rules=rules),
                  lambda: jp.train.abstract_state(init_fn, optax.sgd(0.1), mesh=mesh, rules=rules),
                  lambda: jp.train.make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, rules=rules),
                  lambda: jp.train.make_eval_step(loss_fn, mesh=mesh, rules=rules)):
        with pytest.raises(ValueError, match=pattern):
            build()


@pytest.mark.slow  # heavier compile (30 s under load); .ci/run runs it
def test_init_state_on_an_all_explicit_mesh(devices):
    """init_state works under Explicit axes: params placed by the rules, values equal to a plain init."""
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2, axis_types=(AxisType.Explicit,) * 4)
    model = GPT(GPTConfig(vocab_size=50, num_layers=2, num_heads=2, d_model=16, max_seq_len=8))
    tx = optax.adam(1e-3)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    assert state.params["blocks"]["up_kernel"].sharding.spec == P(None, "fsdp", "tensor")
    assert state.opt_state[0].mu["blocks"]["up_kernel"].sharding.spec == P(None, "fsdp", "tensor")
    init_key, _ = jax.random.split(jax.random.key(0))
    reference = jax.device_get(nn_unbox(jax.jit(model.init)(init_key)))
    for got, ref in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(reference)):
        # The same random bits; the partitioned init may round the scaling by the std differently (1 ulp).
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0)
    abstract = jp.train.abstract_state(model.init, tx, mesh=mesh)
    assert abstract.params["blocks"]["up_kernel"].sharding.spec == P(None, "fsdp", "tensor")


def nn_unbox(tree):
    import flax.linen as nn
    return nn.meta.unbox(tree)


# ----------------------------------------------------------------------- the step's inputs, before tracing

class _CountingLoss:
    """A loss_fn that counts how often it is traced, to show that a bad batch is refused before tracing."""

    def __init__(self, loss_fn):
        self.loss_fn, self.calls = loss_fn, 0

    def __call__(self, params, batch, rng):
        self.calls += 1
        return self.loss_fn(params, batch, rng)


@pytest.fixture(scope="module")
def mlp_on_2x2(mesh_factory):
    """(mesh, state, init_fn, loss_fn) of the MLP on data=2 x fsdp=2 (4 devices), batch axes data*fsdp = 4."""
    mesh = mesh_factory(data=2, fsdp=2)
    init_fn, loss_fn = mlp_parts()
    return mesh, jp.train.init_state(init_fn, optax.sgd(0.1), 0, mesh=mesh), init_fn, loss_fn


@pytest.mark.parametrize("batch_size, accum, pattern", [
    (30, 1, r"batch 30 is not divisible by data\*fsdp = 4; use a batch that is a multiple of 4"),
    (6, 1, r"batch 6 is not divisible by data\*fsdp = 4"),
    (30, 4, r"batch 30 is not divisible by grad_accum_steps = 4; use a batch that is a multiple of 16"),
    (24, 4, r"microbatch 6 \(batch 24 / grad_accum_steps 4\) is not divisible by data\*fsdp = 4; "
            r"use a batch that is a multiple of 16"),
], ids=["batch30", "batch6", "batch30-accum4", "batch24-accum4"])
def test_bad_batch_size_before_tracing(mlp_on_2x2, np_rng, batch_size, accum, pattern):
    mesh, state, _, loss_fn = mlp_on_2x2
    counting = _CountingLoss(loss_fn)
    step = jp.train.make_train_step(counting, optax.sgd(0.1), mesh=mesh, grad_accum_steps=accum, donate=False)
    with pytest.raises(ValueError, match=pattern):
        step(state, mlp_batch(np_rng, batch_size))
    assert counting.calls == 0, "the loss was traced before the batch was checked"


def test_bad_batch_size_in_eval_step(mlp_on_2x2, np_rng):
    mesh, state, _, loss_fn = mlp_on_2x2
    counting = _CountingLoss(loss_fn)
    eval_step = jp.train.make_eval_step(counting, mesh=mesh)
    with pytest.raises(ValueError, match=r"batch 30 is not divisible by data\*fsdp = 4"):
        eval_step(state, mlp_batch(np_rng, 30))
    assert counting.calls == 0


def test_batch_leaves_disagree(mlp_on_2x2, np_rng):
    mesh, state, _, loss_fn = mlp_on_2x2
    step = jp.train.make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, donate=False)
    batch = mlp_batch(np_rng, 16)
    batch["y"] = batch["y"][:8]
    with pytest.raises(ValueError, match=r"batch leaves disagree on the batch size: \[8, 16\]"):
        step(state, batch)
    with pytest.raises(ValueError, match=r"batch has no arrays"):
        step(state, {})
    with pytest.raises(ValueError, match=r"has no leading batch axis"):
        step(state, {"x": np.float32(1.0)})


@pytest.mark.parametrize("accum", [0, -1, 2.0, None])
def test_bad_grad_accum_steps(mlp_on_2x2, accum):
    mesh, _, _, loss_fn = mlp_on_2x2
    with pytest.raises(ValueError, match=rf"grad_accum_steps={accum!r} must be a positive int"):
        jp.train.make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, grad_accum_steps=accum)


def test_good_batch_after_bad_one_still_works(mlp_on_2x2, np_rng):
    mesh, state, _, loss_fn = mlp_on_2x2
    step = jp.train.make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, donate=False)
    with pytest.raises(ValueError):
        step(state, mlp_batch(np_rng, 30))
    _, metrics = step(state, mlp_batch(np_rng, 32))
    assert np.isfinite(float(metrics["loss"]))


def test_state_that_does_not_fit_the_step(adam_mlp):
    init_fn, loss_fn, mesh, tx, batch = adam_mlp
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False)
    with pytest.raises(ValueError, match="opt_state does not have the structure this step's tx gives"):
        jp.train.make_train_step(loss_fn, optax.sgd(0.1, momentum=0.9), mesh=mesh)(state, batch)
    with pytest.raises(TypeError, match="policy must be a jp.precision.Policy or None, got 'mixed_bf16'"):
        step(state.replace(policy="mixed_bf16"), batch)
    with pytest.raises(TypeError, match="state must be a jp.train.TrainState"):
        step(state.params, batch)
    with pytest.raises(TypeError, match=r"use step.lower\(state, batch\)"):
        step(state, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch))
    with pytest.raises(TypeError, match="check_batch must be a function"):
        jp.train.make_train_step(loss_fn, tx, mesh=mesh, check_batch=3)


# ------------------------------------------------------------------- lowering from shapes; the state's policy

GPT_SEED = 5


GPT_MESH = dict(data=2, fsdp=2, tensor=2)


def test_lower_from_abstract_state_and_batch_compiles_the_gpt(mesh_factory):
    init_fn, loss_fn = gpt_parts(SMALL_GPT)
    mesh, tx = mesh_factory(**GPT_MESH), optax.adamw(1e-3)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh)
    abstract = jp.train.abstract_state(init_fn, tx, mesh=mesh)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    shapes = {k: jax.ShapeDtypeStruct((16, SMALL_GPT.max_seq_len), jnp.int32) for k in ("inputs", "targets")}
    lowered = step.lower(abstract, shapes)
    compiled = lowered.compile()
    assert compiled.memory_analysis() is not None
    # the same program as lowered from a real state and batch
    state = jp.train.init_state(init_fn, tx, GPT_SEED, mesh=mesh)
    real = step.lower(state, gpt_batch(np.random.default_rng(GPT_SEED), 16, SMALL_GPT))
    assert lowered.as_text() == real.as_text()
    # abstract inputs are checked as real ones are
    with pytest.raises(ValueError, match=r"batch 6 is not divisible by data\*fsdp = 4"):
        step.lower(abstract, {k: jax.ShapeDtypeStruct((6, 8), jnp.int32) for k in ("inputs", "targets")})
    with pytest.raises(TypeError, match=r"abstract inputs need shardings"):
        step.lower(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), abstract), shapes)
    with pytest.raises(TypeError, match=r"use step.lower\(state, batch\)"):
        step(abstract, gpt_batch(np.random.default_rng(GPT_SEED), 16, SMALL_GPT))


@pytest.mark.slow  # heavy (subprocesses or several compiles); .ci/run runs it
def test_the_policy_travels_on_the_state(mesh_factory):
    """One step built once: a float32 state computes in float32, a mixed_bf16 state in bfloat16 (its loss
    differs from the float32 one by bf16 rounding, not 0), and the restore target carries the policy."""
    init_fn, loss_fn = gpt_parts(SMALL_GPT)
    mesh, tx = mesh_factory(**GPT_MESH), optax.sgd(0.1)
    batch = gpt_batch(np.random.default_rng(GPT_SEED), 16, SMALL_GPT)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh, donate=False)
    policy = jp.Policy.from_string("mixed_bf16")
    f32 = jp.train.init_state(init_fn, tx, GPT_SEED, mesh=mesh)
    bf16 = jp.train.init_state(init_fn, tx, GPT_SEED, mesh=mesh, policy=policy)
    assert f32.policy is None and bf16.policy == policy
    assert jp.train.abstract_state(init_fn, tx, mesh=mesh, policy=policy).policy == policy
    hlo = step.lower(bf16, batch).as_text()
    assert "bf16" in hlo and "bf16" not in step.lower(f32, batch).as_text()
    l32, l16 = float(step(f32, batch)[1]["loss"]), float(step(bf16, batch)[1]["loss"])
    assert 0 < abs(l32 - l16) < 3e-2 * abs(l32), (l32, l16)
    new = step(bf16, batch)[0]
    assert new.policy == policy and all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.params))


# ------------------------------------------------------------------------------ evaluation and randomness

SEED = 17
LAYOUTS = {"1dev": {}, "data8": {"data": 8}, "fsdp8": {"fsdp": 8}, "tensor8": {"tensor": 8},
           "d2f2t2": {"data": 2, "fsdp": 2, "tensor": 2}}
init_fn, base_loss = mlp_parts()


def dropout_loss(params, batch, rng):
    """Inverted dropout (keep probability 0.5) on the inputs, then the MLP's cross-entropy."""
    keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
    x = jnp.where(keep, batch["x"] / 0.5, 0.0)
    return base_loss(params, {"x": x, "y": batch["y"]}, rng)


def keys(seed=SEED):
    """(init_key, state_rng) exactly as the docs of jp.train.init_state say: a split of key(seed)."""
    init_key, state_rng = jax.random.split(jax.random.key(seed))
    return init_key, state_rng


_LOSS = jax.jit(dropout_loss)
_VALUE_AND_GRAD = jax.jit(jax.value_and_grad(lambda p, b, r: dropout_loss(p, b, r)[0]))


def on_one_device(fn, *args):
    """``fn(*args)`` (fn jitted) with every argument on the first device: plain JAX, no mesh."""
    return jax.device_get(fn(*jax.device_put(args, jax.devices()[0])))


def ref_loss(params, batch, key):
    return on_one_device(_LOSS, params, batch, key)


def ref_loss_and_grads(params, batch, key, k=1):
    """Plain value_and_grad of the dropout loss; with k microbatches (rows j::k, key fold_in(key, j)) the mean
    of their losses and gradients (equal sizes: their weights are equal)."""
    out = [on_one_device(_VALUE_AND_GRAD, params, jax.tree.map(lambda a: a[j::k], batch),
                         key if k == 1 else jax.random.fold_in(key, j)) for j in range(k)]
    loss = np.mean([float(l) for l, _ in out])
    grads = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *[g for _, g in out])
    return loss, grads


def trace_of(opt_state):
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
                if isinstance(s, optax.TraceState)).trace


def test_state_rng_is_the_second_half_of_the_split_and_init_is_the_first():
    init_key, state_rng = keys()
    state = jp.train.init_state(init_fn, optax.sgd(0.1), SEED, mesh=jp.make_mesh(devices=jax.devices()[:1]))
    assert np.array_equal(jax.random.key_data(state.rng), jax.random.key_data(state_rng))
    params = on_one_device(jax.jit(lambda k: nn.meta.unbox(init_fn(k))), init_key)
    assert_tree_close(state.params, params, rtol=0.0, what="params from init_key")


# The single-axis layouts run in the slow set (fast-set time): their fast sibling is d2f2t2, which has all three axes.
@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.slow] if name in ("data8", "fsdp8", "tensor8")
                                                 else []) for name in LAYOUTS])
def test_eval_step_matches_the_loss_computed_here(layout, mesh_factory):
    """The eval loss and aux at step 0 and step 3 equal the dropout loss with fold_in(state_rng, step)."""
    mesh = mesh_factory(**LAYOUTS[layout])
    _, state_rng = keys()
    batch = mlp_batch(np.random.default_rng(SEED), 32)
    state = jp.train.init_state(init_fn, optax.sgd(0.1), SEED, mesh=mesh)
    params = jax.device_get(state.params)
    eval_step = jp.train.make_eval_step(dropout_loss, mesh=mesh)
    errs, losses = [], []
    for t in (0, 3):
        s = state.replace(step=jax.device_put(jnp.asarray(t, jnp.int32), state.step.sharding))
        got = eval_step(s, batch)
        loss, aux = ref_loss(params, batch, jax.random.fold_in(state_rng, t))
        errs.append(assert_scalar_close(got["loss"], loss, what=f"{layout} eval loss at step {t}"))
        assert float(got["weight"]) == float(aux["weight"]) == 32
        assert_scalar_close(got["accuracy"], aux["accuracy"], what=f"{layout} accuracy at step {t}")
        losses.append(float(got["loss"]))
    # the rng matters: another step is another dropout mask, hence another loss
    assert abs(losses[0] - losses[1]) > 1e-4 * abs(losses[0]), losses   # 10x the parity tolerance
    print(f"\n[eval {layout}] loss err {max(errs):.2e} (step 0 {losses[0]:.4f}, step 3 {losses[1]:.4f})")


TRAIN_LAYOUTS = {"1dev": {}, "data8": {"data": 8}, "d2f2t2": {"data": 2, "fsdp": 2, "tensor": 2}}


# all three layouts in one test: slow (~14 CPU-s at k=1); the fast sibling [1-d2f2t2] steps the three-axis layout
@pytest.mark.parametrize("k,layouts", [pytest.param(1, ("d2f2t2",), id="1-d2f2t2"),
                                       pytest.param(1, tuple(TRAIN_LAYOUTS), id="1", marks=pytest.mark.slow),
                                       pytest.param(4, tuple(TRAIN_LAYOUTS), id="4", marks=pytest.mark.slow)])
def test_train_step_rng_per_step_and_per_microbatch(k, layouts, mesh_factory):
    """Two sgd steps: step t's loss and gradient are the dropout loss's with fold_in(state_rng, t), and with
    grad_accum_steps=k microbatch j gets fold_in(that key, j) (a distinct mask per microbatch); the same
    numbers on one device, data=8 and data2 x fsdp2 x tensor2."""
    _, state_rng = keys()
    rng = np.random.default_rng(SEED + k)
    batches = [mlp_batch(rng, 32), mlp_batch(rng, 32)]
    tx = optax.sgd(0.1, momentum=0.9)
    params = jax.device_get(jp.train.init_state(init_fn, tx, SEED, mesh=mesh_factory()).params)
    loss0, grads0 = ref_loss_and_grads(params, batches[0], jax.random.fold_in(state_rng, 0), k)
    params1 = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads0)   # sgd(0.1, momentum) from a zero trace
    loss1, _ = ref_loss_and_grads(params1, batches[1], jax.random.fold_in(state_rng, 1), k)

    # the test can tell the keys apart: no fold_in of the step, or one key for every microbatch, is another loss
    # (10x the parity tolerance on the loss; the gradient, where the mask enters directly, by far more)
    wrong = {"no step fold_in": ref_loss_and_grads(params, batches[0], state_rng, k)}
    if k > 1:
        same = [ref_loss_and_grads(params, jax.tree.map(lambda a: a[j::k], batches[0]),
                                   jax.random.fold_in(state_rng, 0)) for j in range(k)]
        wrong["same key per microbatch"] = (np.mean([l for l, _ in same]),
                                            jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *[g for _, g in same]))
    for what, (w_loss, w_grads) in wrong.items():
        assert abs(w_loss - loss0) > 1e-4 * abs(loss0), (what, loss0, w_loss)
        assert max(max_rel_err(a, b) for a, b in zip(jax.tree.leaves(w_grads), jax.tree.leaves(grads0))) > 1e-2, what

    losses, errs = {}, []
    for name in layouts:
        mesh = mesh_factory(**TRAIN_LAYOUTS[name])
        state = jp.train.init_state(init_fn, tx, SEED, mesh=mesh)
        step = jp.train.make_train_step(dropout_loss, tx, mesh=mesh, grad_accum_steps=k)
        new_state, metrics = step(state, batches[0])
        errs += [assert_scalar_close(metrics["loss"], loss0, what=f"{name} k={k} step 0 loss"),
                 assert_tree_close(trace_of(new_state.opt_state), grads0, what=f"{name} k={k} step 0 grads")]
        assert_tree_close(new_state.params, params1, what=f"{name} k={k} params after step 0")
        _, metrics1 = step(new_state, batches[1])
        errs.append(assert_scalar_close(metrics1["loss"], loss1, what=f"{name} k={k} step 1 loss"))
        losses[name] = (float(metrics["loss"]), float(metrics1["loss"]))
    for name, got in losses.items():       # equal across layouts, directly
        for t in (0, 1):
            assert_scalar_close(got[t], losses[layouts[0]][t], what=f"k={k} step {t}: {name} vs {layouts[0]}")
    print(f"\n[train rng k={k}] max err {max(errs):.2e}; losses {losses}")


# ------------------------------------------- defaults: the model's batch check; the step's phases are named

CHECK_CFG = dataclasses.replace(SMALL_GPT, num_layers=2, d_model=32, num_heads=4, head_dim=0)

def _bad_batch(rows):
    batch = gpt_batch(np.random.default_rng(0), rows, CHECK_CFG)
    batch["inputs"][1, 3] = CHECK_CFG.vocab_size   # one id >= vocab
    return batch

@pytest.fixture(scope="module")
def check_gpt(mesh_factory):
    """``(model, tx, mesh, state)``: the narrow GPT's state on data=2, built (compiled) once; the tests that
    use it run only steps that do not donate it."""
    mesh, model, tx = mesh_factory(data=2), GPT(CHECK_CFG), optax.sgd(0.1)
    return model, tx, mesh, jp.train.init_state(model.init, tx, 0, mesh=mesh)

def test_gpt_loss_step_rejects_out_of_range_ids_by_default(check_gpt):
    model, tx, mesh, state = check_gpt
    with pytest.raises(ValueError, match=r"token id 61 at index \(1, 3\)"):
        jp.train.make_train_step(model.loss, tx, mesh=mesh)(state, _bad_batch(4))
    with pytest.raises(ValueError, match="token id 61"):
        jp.train.make_eval_step(model.loss, mesh=mesh)(state, _bad_batch(4))
    # told not to check: the NaN the model gives for a bad id, never a finite wrong loss
    _, metrics = jp.train.make_train_step(model.loss, tx, mesh=mesh, check_batch=None, donate=False)(state, _bad_batch(4))
    assert np.isnan(float(metrics["loss"]))
    # a batch already on the devices is not pulled back to the host to be checked
    placed = jp.train.shard_batch(_bad_batch(4), mesh)
    _, metrics = jp.train.make_train_step(model.loss, tx, mesh=mesh, donate=False)(state, placed)
    assert np.isnan(float(metrics["loss"]))

def test_pipelined_gpt_step_rejects_out_of_range_ids_by_default(mesh_factory):
    mesh = mesh_factory(pipe=2)
    model, tx = GPT(CHECK_CFG), optax.sgd(0.1)
    pipe = jp.pipeline.Pipeline.from_model(model, jp.pipeline.one_f_one_b(2, 2))
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh, pipeline=pipe)
    with pytest.raises(ValueError, match="token id 61"):
        jp.train.make_train_step(pipe, tx, mesh=mesh, grad_accum_steps=2)(state, _bad_batch(4))

def test_check_batch_rejects_a_bad_value(mesh_factory):
    with pytest.raises(TypeError, match="check_batch"):
        jp.train.make_train_step(GPT(CHECK_CFG).loss, optax.sgd(0.1), mesh=mesh_factory(), check_batch="yes")

def test_step_phases_are_named_in_the_compiled_program(check_gpt):
    model, tx, mesh, state = check_gpt
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, grad_accum_steps=2)
    text = step.lower(state, gpt_batch(np.random.default_rng(1), 4, CHECK_CFG)).compile().as_text()
    scopes = plan_hlo.scopes(text)
    assert {"forward_backward", "optimizer_update", "accumulation"} <= scopes, sorted(scopes)[:40]


# --------------------------------- FSDP weights gathered for a model whose activations carry no constraints

def unconstrained_model(rng, d=64, v=256):
    """``(params, init_fn)`` of a plain pytree model whose activations carry no sharding constraints:
    ``h = x + tanh(x @ up)``, loss ``mean(sin(h @ W))`` (:func:`unconstrained_loss`). ``W`` is named
    ``('embed', 'vocab')``, ``up`` ``(None, 'mlp')`` (automatic FSDP adds fsdp on its rows): on
    data=2 x fsdp=2 x tensor=2 both are ``P('fsdp', 'tensor')``, the layout XLA's partitioner got wrong."""
    params = {"up": (rng.normal(size=(d, d)) / 8).astype(np.float32),
              "W": (rng.normal(size=(d, v)) / 8).astype(np.float32)}
    names = {"up": (None, "mlp"), "W": ("embed", "vocab")}
    return params, lambda key: {k: nn.LogicallyPartitioned(jnp.asarray(p), names[k]) for k, p in params.items()}


def unconstrained_loss(params, batch, rng):
    h = batch["x"] + jnp.tanh(batch["x"] @ params["up"])
    return jnp.mean(jnp.sin(h @ params["W"])), {}


def unconstrained_reference(params, x):
    """The loss and gradients of :func:`unconstrained_loss`, written out in float64 numpy."""
    up, w, x = (np.asarray(a, np.float64) for a in (params["up"], params["W"], x))
    a = np.tanh(x @ up)
    z = (x + a) @ w
    dz = np.cos(z) / z.size
    return np.sin(z).mean(), {"up": x.T @ ((dz @ w.T) * (1 - a ** 2)), "W": (x + a).T @ dz}


# an optimizer whose state is the last gradient and whose update is zero: the step's exact gradients
KEEP_GRADS = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                          lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def test_a_model_without_activation_constraints_gets_exact_gradients_on_fsdp_and_tensor(mesh_factory, capsys):
    """The step gathers the FSDP weights of a model that declares no ``shards_activations``; the layout automatic
    FSDP completed is printed (``report=None``)."""
    rng = np.random.default_rng(40)
    params, init = unconstrained_model(rng)
    x = rng.normal(size=(16, 64)).astype(np.float32)
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    state = jp.train.init_state(init, KEEP_GRADS, 0, mesh=mesh)
    out = capsys.readouterr().out
    assert "jaxpar: the state's layout" in out and "rules + auto fsdp" in out, out
    assert {k: v.sharding.spec for k, v in state.params.items()} == {k: P("fsdp", "tensor") for k in ("up", "W")}
    new, metrics = jp.train.make_train_step(unconstrained_loss, KEEP_GRADS, mesh=mesh)(state, {"x": x})
    loss, grads = unconstrained_reference(params, x)
    assert_scalar_close(metrics["loss"], loss, what="loss")
    worst = assert_tree_close(new.opt_state, grads, what="gradients")
    print(f"unconstrained model on 2x2x2, weights gathered: worst gradient error {worst:.1e}")


@pytest.mark.slow   # two more 8-device compiles; the gathered step is checked in the fast set
def test_without_the_gather_the_unconstrained_model_shows_the_partitioner_defect(mesh_factory):
    """``gather_weights=False`` on the model above: the defect :func:`jaxpar._compat.gathers_fsdp_weights` works
    around. On the jax it was seen with (0.10.2) its gradients must be wrong (else the workaround may go); on
    another jax the error is recorded as a warning, never a failure. The eval step's loss is exact either way."""
    rng = np.random.default_rng(41)
    params, init = unconstrained_model(rng)
    x = rng.normal(size=(16, 64)).astype(np.float32)
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    state = jp.train.init_state(init, KEEP_GRADS, 0, mesh=mesh, report=False)
    loss, grads = unconstrained_reference(params, x)
    assert_scalar_close(jp.train.make_eval_step(unconstrained_loss, mesh=mesh)(state, {"x": x})["loss"], loss)
    new, _ = jp.train.make_train_step(unconstrained_loss, KEEP_GRADS, mesh=mesh, gather_weights=False,
                                      donate=False)(state, {"x": x})
    errors = {k: max_rel_err(new.opt_state[k], grads[k]) for k in grads}
    print(f"unconstrained model on 2x2x2, jax {jax.__version__}, no gather: gradient errors {errors}")
    if jax.__version__ == "0.10.2":
        assert errors["up"] > 0.1, errors
    elif max(errors.values()) <= 1e-5:
        warnings.warn(f"jax {jax.__version__} computes the unconstrained FSDP+TP model exactly without the weight "
                      "gather: see jaxpar._compat.gathers_fsdp_weights for retiring it")


@pytest.mark.slow   # a lowering (no compile), kept out of the fast set's budget
def test_the_weight_gather_comes_after_the_cast_to_the_compute_dtype(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    policy = jp.Policy.from_string("p=f32,c=bf16,o=f32")
    state = jp.train.abstract_state(unconstrained_model(np.random.default_rng(0))[1], KEEP_GRADS, mesh=mesh,
                                    policy=policy)
    text = jp.train.make_train_step(unconstrained_loss, KEEP_GRADS, mesh=mesh).lower(
        state, {"x": jax.ShapeDtypeStruct((16, 64), jnp.float32)}).as_text()
    gathers = [(dims, dtype) for sharding, dims, dtype in plan_hlo.sharding_constraints(text)
               if sharding == '<@mesh, [{}, {"tensor"}]>' and dims.count("x") == 1]
    # each weight gathered in the forward, its gradient reduce-scattered by the transpose in the backward
    assert sorted(gathers) == [("64x256", "bf16")] * 2 + [("64x64", "bf16")] * 2, gathers


@pytest.mark.slow   # five 8-device compiles of the GPT's and Llama's steps
def test_models_that_declare_sharded_activations_compile_without_the_gather(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    tx = optax.sgd(0.1)

    def program(model, **kw):   # each computation's instructions (opcode and shape), metadata left out
        step = jp.train.make_train_step(model.loss, tx, mesh=mesh, **kw)
        text = step.lower(jp.train.abstract_state(model.init, tx, mesh=mesh),
                          gpt_batch(np.random.default_rng(2), 8, model.cfg)).compile().as_text()
        return {name: [(i.opcode, i.shape) for i in instrs] for name, instrs in plan_hlo.parse_module(text)[0].items()}

    programs = {}
    for model in (GPT(CHECK_CFG), jp.models.Llama(SMALL_LLAMA)):
        assert model.shards_activations
        programs[type(model).__name__] = program(model)
        assert programs[type(model).__name__] == program(model, gather_weights=False), type(model).__name__
    assert program(GPT(CHECK_CFG), gather_weights=True) != programs["GPT"]


@pytest.mark.parametrize("value, error, match", [
    ("auto", TypeError, r"gather_weights must be None .*, True or False; got 'auto'"),
    (True, ValueError, r"gather_weights=True applies to the GSPMD step .* not to a jp.pipeline.Pipeline")],
    ids=["not_a_bool", "true_with_a_pipeline"])
def test_bad_gather_weights_are_refused_when_the_step_is_built(mesh_factory, value, error, match):
    mesh, model = mesh_factory(pipe=2), GPT(CHECK_CFG)
    pipeline = jp.pipeline.Pipeline.from_model(model, jp.pipeline.one_f_one_b(2, 2))
    for build in (lambda: jp.train.make_train_step(pipeline, optax.sgd(0.1), mesh=mesh, gather_weights=value),
                  lambda: jp.train.make_eval_step(pipeline, mesh=mesh, gather_weights=value)):
        with pytest.raises(error, match=match):
            build()


# ----------------------------------------------------------------------------------- features check themselves

class _Refusing(jp.grads.GradFn):
    """A user's gradient function whose own rule refuses a state whose step count is odd."""
    def __init__(self, loss_fn):
        self.inner, self.traced, self.checked = jp.grads.value_and_grad(loss_fn), 0, []

    def check_step(self, state, grad_fn, mesh):
        self.checked.append((grad_fn, mesh))
        if int(state.step) % 2:
            raise ValueError(f"_Refusing steps even states only, got step {int(state.step)}")

    def __call__(self, params, batch, rng, scale, ctx):
        self.traced += 1
        return self.inner(params, batch, rng, scale, ctx)


@pytest.mark.parametrize("accum", [1, 2])
def test_the_step_calls_a_gradient_functions_check_before_tracing(accum, mesh_factory):
    """``make_train_step`` (and accumulation around it) calls the gradient function's ``check_step(state, grad_fn,
    mesh)`` before tracing: its refusal comes out and nothing was traced; an accepted state is then traced."""
    init_fn, loss_fn = mlp_parts()
    mesh, tx = mesh_factory(data=2), optax.sgd(0.1)
    grad_fn = _Refusing(loss_fn)
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(grad_fn, tx, mesh=mesh, grad_accum_steps=accum, donate=False)
    batch = mlp_batch(np.random.default_rng(3), 8)
    with pytest.raises(ValueError, match=r"_Refusing steps even states only, got step 1"):
        step(state.replace(step=state.step + 1), batch)
    assert grad_fn.traced == 0 and grad_fn.checked[0][1] is mesh
    step.lower(state, batch)
    assert grad_fn.traced >= 1


def test_check_parts_calls_each_part_that_defines_check_step_in_order(mesh_factory):
    """The state's static parts (its policy, stage layout, graph definition) are asked after the gradient
    function; parts without ``check_step`` are skipped."""
    calls = []

    class Part:
        def __init__(self, name):
            self.name = name

        def check_step(self, state, grad_fn, mesh):
            calls.append(self.name)

    mesh = mesh_factory(data=2)
    state = jp.train.TrainState(step=jnp.zeros((), jnp.int32), params={}, opt_state=(), rng=jax.random.key(0),
                                layout=Part("layout"), graphdef=Part("graphdef"))
    check_parts(state, Part("grad_fn"), mesh)
    assert calls == ["grad_fn", "layout", "graphdef"]
