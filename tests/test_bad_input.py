"""Bad input found by adversarial testing: each gets a clear error (or a correct result), never a crash,
a NaN, or silently wrong training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig
from jaxpar.precision import DynamicLossScale, Policy, StaticLossScale, loss_scaling

from helpers import mlp_batch, mlp_parts


@pytest.fixture
def mesh(mesh_factory):
    return mesh_factory(data=2, fsdp=2, tensor=2)


def test_reusing_a_donated_state_is_a_clear_error(mesh):
    init_fn, loss_fn = mlp_parts()
    tx = optax.sgd(0.1)
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh)
    batch = mlp_batch(np.random.default_rng(0), 16)
    new, _ = step(state, batch)
    with pytest.raises(ValueError, match="donated"):
        step(state, batch)
    step(new, batch)  # the returned state works


def test_a_state_in_another_layout_is_accepted_by_the_same_step(mesh_factory):
    init_fn, loss_fn = mlp_parts()
    tx = optax.sgd(0.1)
    a, b = mesh_factory(data=2, fsdp=2, tensor=2), mesh_factory(fsdp=8)
    step = jp.train.make_train_step(loss_fn, tx, mesh=a, donate=False)
    batch = mlp_batch(np.random.default_rng(0), 16)
    ref, _ = step(jp.train.init_state(init_fn, tx, 0, mesh=a), batch)
    got, _ = step(jp.train.init_state(init_fn, tx, 0, mesh=b), batch)
    for x, y in zip(jax.tree.leaves(got.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_empty_microbatch_weight_zero_gives_finite_whole_batch_mean(mesh):
    """A fully masked microbatch (weight 0, mean 0/0) must not poison the accumulated step."""
    init_fn, _ = mlp_parts()
    from jaxpar.models import MLP
    model = MLP(hidden=(64, 128, 32))

    def masked_loss(params, batch, rng):
        logits = model.apply({"params": params}, batch["x"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        w = batch["mask"].sum()
        return (ce * batch["mask"]).sum() / w, {"weight": w}

    tx = optax.sgd(0.1)
    batch = mlp_batch(np.random.default_rng(1), 32)
    batch["mask"] = np.ones(32, np.float32)
    batch["mask"][0::4] = 0.0                        # microbatch 0 of 4 (rows 0::4) is empty
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step4 = jp.train.make_train_step(masked_loss, tx, mesh=mesh, grad_accum_steps=4, donate=False)
    step1 = jp.train.make_train_step(masked_loss, tx, mesh=mesh, donate=False)
    s4, m4 = step4(state, batch)
    s1, m1 = step1(state, batch)
    assert np.isfinite(float(m4["loss"]))
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(s4.params), jax.tree.leaves(s1.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, match", [
    (lambda loss, aux: loss, "must return \\(loss, aux\\)"),
    (lambda loss, aux: (jnp.stack([loss, loss]), aux), "floating scalar"),
    (lambda loss, aux: (loss, [1.0]), "aux must be a dict"),
    (lambda loss, aux: (loss, {"loss": 123.0}), "aux key 'loss' is not allowed"),
    (lambda loss, aux: (loss, {"per_example": jnp.ones(4)}), "must be scalars"),
])
def test_malformed_loss_fn_output(mesh, bad, match):
    init_fn, loss_fn = mlp_parts()
    tx = optax.sgd(0.1)
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(lambda p, b, r: bad(*loss_fn(p, b, r)), tx, mesh=mesh, donate=False)
    with pytest.raises(ValueError, match=match):
        step(state, mlp_batch(np.random.default_rng(0), 16))


def test_empty_batch(mesh):
    with pytest.raises(ValueError, match="batch 0 is empty"):
        jp.grads.check_batch_size(0, mesh, jp.sharding.DEFAULT_RULES)


@pytest.mark.parametrize("kwargs, match", [
    (dict(clip_norm=-1.0), "clip_norm"), (dict(learning_rate=-1e-3), "learning_rate"),
    (dict(learning_rate=float("nan")), "learning_rate"), (dict(b2=1.5), "b2"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(warmup_steps=100), "warmup_steps"),
])
def test_adamw_rejects_out_of_range_hyperparameters(kwargs, match):
    args = {"learning_rate": 1e-3, "total_steps": 100, **kwargs}
    with pytest.raises(ValueError, match=match):
        jp.optim.adamw(args.pop("learning_rate"), **args)


def test_tx_must_be_a_gradient_transformation(mesh):
    init_fn, loss_fn = mlp_parts()
    for tx in (None, optax.adam):
        with pytest.raises(TypeError, match="optax.GradientTransformation"):
            jp.train.init_state(init_fn, tx, 0, mesh=mesh)


@pytest.mark.parametrize("make, match", [
    (lambda: DynamicLossScale(initial_scale=2.0 ** 16, dtype=jnp.float16), "exceed the largest float16"),
    (lambda: DynamicLossScale(initial_scale=float("inf"), max_scale=float("inf")), "finite"),
    (lambda: DynamicLossScale(growth_factor=float("nan")), "finite"),
    (lambda: StaticLossScale(float("inf")), "finite"),
    (lambda: DynamicLossScale(dtype=jnp.int32), "floating dtype"),
])
def test_loss_scale_configs_are_validated(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_loss_scaling_must_be_outermost(mesh):
    init_fn, loss_fn = mlp_parts()
    tx = optax.chain(optax.clip_by_global_norm(1.0), loss_scaling(optax.sgd(0.1), StaticLossScale(1024.0)))
    state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(loss_fn, tx, mesh=mesh)
    with pytest.raises(ValueError, match="outermost"):
        step(state, mlp_batch(np.random.default_rng(0), 16))
    nested = loss_scaling(loss_scaling(optax.sgd(0.1), StaticLossScale(2.0)), StaticLossScale(2.0))
    with pytest.raises(ValueError, match="more than one"):
        jp.precision.loss_scale(nested.init({"w": jnp.ones(3)}))


@pytest.mark.parametrize("text, exc", [("params=int8", ValueError), ("p=f32,p=bf16", ValueError), (b"bf16", TypeError)])
def test_policy_rejects(text, exc):
    with pytest.raises(exc):
        Policy.from_string(text)


def test_policy_rejects_non_float_dtypes():
    with pytest.raises(ValueError, match="must be float32, bfloat16 or float16"):
        Policy(jnp.float32, jnp.int8, jnp.float32)
    with pytest.raises(ValueError, match="must be float32"):
        Policy(None)


@pytest.mark.parametrize("kwargs", [dict(dtype=jnp.int32), dict(init_std=float("nan")), dict(rope_base=0.0),
                                    dict(tie_embeddings="no")])
def test_gpt_config_rejects(kwargs):
    with pytest.raises(ValueError, match="GPTConfig"):
        GPTConfig(**kwargs)


def test_generate_rejects_bad_arguments():
    model = GPT(GPTConfig(vocab_size=11, num_layers=1, num_heads=2, d_model=16, max_seq_len=8))
    params = jax.tree.map(lambda x: x.value, model.init(jax.random.key(0)), is_leaf=lambda x: hasattr(x, "value"))
    for kwargs in (dict(temperature=0.0), dict(temperature=-1.0), dict(num_tokens=-1), dict(prompt=[11]),
                   dict(prompt=[])):
        args = {"prompt": [1, 2], "num_tokens": 3, "temperature": 1.0, **kwargs}
        with pytest.raises(ValueError):
            model.generate(params, args["prompt"], args["num_tokens"], jax.random.key(0), args["temperature"])
    assert len(model.generate(params, [1, 2], 3, jax.random.key(0))) == 3


def test_corpus_batch_rejects_bad_split_and_lengths():
    corpus = jp.data.CharCorpus.from_text("hello world, " * 50)
    with pytest.raises(ValueError, match="split"):
        corpus.batch(0, 0, 4, 8, split="Train")
    with pytest.raises(ValueError, match="seq_len"):
        corpus.batch(0, 0, 4, 0)


def test_make_mesh_rejects_duplicated_devices():
    with pytest.raises(ValueError, match="more than once"):
        jp.make_mesh(data=2, devices=[jax.devices()[0]] * 2)


@pytest.mark.parametrize("rules", [None, "batch", (("batch", 3),), (("batch", ("data", "data")),)])
def test_malformed_rules(mesh, rules):
    with pytest.raises(ValueError, match="rule"):
        jp.sharding.validate_rules(rules, mesh)


# ------------------------------------------------------------------------------- token ids out of range

def _gpt_setup(mesh):
    model = GPT(GPTConfig(vocab_size=50, num_layers=1, num_heads=2, d_model=16, max_seq_len=8))
    tx = optax.sgd(0.1)
    return model, tx, jp.train.init_state(model.init, tx, 0, mesh=mesh)


def _tokens(rng, shape=(8, 8)):
    return {"inputs": rng.integers(0, 50, shape).astype(np.int32),
            "targets": rng.integers(0, 50, shape).astype(np.int32)}


@pytest.mark.parametrize("key", ["inputs", "targets"])
@pytest.mark.parametrize("bad", [-1, 50, 127, 128, 10_000])   # vocab 50 is padded to 128
def test_out_of_range_token_ids_on_the_host_are_a_clear_error(mesh, key, bad):
    model, tx, state = _gpt_setup(mesh)
    batch = _tokens(np.random.default_rng(0))
    batch[key][3, 5] = bad
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, check_batch=model.check_batch)
    with pytest.raises(ValueError, match=rf"batch\['{key}'\] holds token id {bad} at index \(3, 5\).*\[0, "
                                         r"vocab_size=50\)"):
        step(state, batch)
    evaluate = jp.train.make_eval_step(model.loss, mesh=mesh, check_batch=model.check_batch)
    with pytest.raises(ValueError, match="holds token id"):
        evaluate(state, batch)


@pytest.mark.parametrize("key", ["inputs", "targets"])
@pytest.mark.parametrize("bad", [-1, 50, 128])
def test_out_of_range_token_ids_on_the_devices_give_nan_not_a_wrong_loss(mesh, key, bad):
    """A batch already on the devices is checked in the step: loss and gradient norm become NaN."""
    model, tx, state = _gpt_setup(mesh)
    batch = _tokens(np.random.default_rng(1))
    batch[key][2, 1] = bad
    batch = jax.tree.map(jnp.asarray, batch)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, check_batch=model.check_batch, donate=False)
    _, metrics = step(state, batch)
    assert np.isnan(float(metrics["loss"])) and np.isnan(float(metrics["grad_norm"])), metrics
    good = jax.tree.map(lambda x: jnp.clip(x, 0, 49), batch)
    _, metrics = step(state, good)
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))


def test_float_token_ids_are_a_clear_error(mesh):
    model, _, _ = _gpt_setup(mesh)
    batch = _tokens(np.random.default_rng(2))
    batch["inputs"] = batch["inputs"].astype(np.float32)
    with pytest.raises(ValueError, match="must be integers"):
        model.check_batch(batch)


# --------------------------------------------------------------------------------- Explicit-axis meshes

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


def test_gpt_step_on_an_explicit_mesh_is_a_clear_error(devices):
    from jax.sharding import AxisType
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2, axis_types=(AxisType.Explicit,) * 4)
    model = GPT(GPTConfig(vocab_size=50, num_layers=1, num_heads=2, d_model=16, max_seq_len=8))
    tx = optax.sgd(0.1)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
    with pytest.raises(ValueError, match="Auto axes only.*axis_types"):
        step(state, _tokens(np.random.default_rng(3)))


def nn_unbox(tree):
    import flax.linen as nn
    return nn.meta.unbox(tree)


# ------------------------------------------------------------------- found by adversarial testing (#10)

@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=jnp.float16, min_scale=2.0 ** -30, initial_scale=1.0), "below the smallest normal float16"),
    (dict(min_scale=5e-324, initial_scale=1e-300), "below the smallest normal float32"),
    (dict(growth_interval=True), "growth_interval=True must be an int"),
    (dict(growth_interval=2.5), "growth_interval=2.5 must be an int"),
    (dict(growth_interval=2 ** 40), "must be an int in"),
    (dict(dtype=jnp.float8_e5m2), "floating dtype: float32, float16 or bfloat16"),
    (dict(dtype=jnp.float64), "floating dtype: float32, float16 or bfloat16"),
])
def test_dynamic_loss_scale_rejects_configs_that_would_break_it(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScale(**kwargs)


def test_policy_rejects_float8():
    with pytest.raises(ValueError, match="must be float32, bfloat16 or float16"):
        Policy(jnp.float8_e4m3fn, jnp.float32, jnp.float32)


@pytest.mark.parametrize("kwargs", [dict(learning_rate=optax.constant_schedule(1e-3)),
                                    dict(learning_rate=1e-3, weight_decay=None),
                                    dict(learning_rate=1e-3, total_steps=10.5)])
def test_adamw_names_a_hyperparameter_that_is_not_a_number(kwargs):
    kwargs.setdefault("total_steps", 10)
    with pytest.raises(TypeError, match=r"adamw \w+=.* must be"):
        jp.optim.adamw(**kwargs)


@pytest.mark.parametrize("shapes", [((8, 8), (8, 7)), ((8, 0), (8, 0)), ((8,), (8,)), ((8, 9), (8, 9))])
def test_gpt_check_batch_names_bad_shapes(mesh, shapes):
    model, _, _ = _gpt_setup(mesh)   # max_seq_len 8
    batch = {"inputs": np.zeros(shapes[0], np.int32) + 1, "targets": np.zeros(shapes[1], np.int32) + 2}
    with pytest.raises(ValueError, match=r"\[batch, seq\]|exceeds max_seq_len"):
        model.check_batch(batch)


def test_a_file_where_the_checkpoint_trash_goes_is_a_clear_error(tmp_path):
    (tmp_path / jp.checkpoint.TRASH).write_text("not a directory")
    with pytest.raises(jp.checkpoint.CheckpointError, match="is a file"):
        jp.checkpoint.CheckpointManager(tmp_path)


def test_grad_accumulation_on_an_explicit_mesh_matches_auto(devices, np_rng):
    from jax.sharding import AxisType
    init_fn = lambda r: {"w": jax.random.normal(r, (16,))}
    loss_fn = lambda p, b, r: (jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), {})
    batch = {"x": np_rng.normal(size=(16, 16)).astype(np.float32), "y": np_rng.normal(size=16).astype(np.float32)}
    tx = optax.sgd(0.1)
    out = []
    for types in [(AxisType.Explicit,) * 4, (AxisType.Auto,) * 4]:
        mesh = jp.make_mesh(data=8, axis_types=types)
        state = jp.train.init_state(init_fn, tx, 0, mesh=mesh)
        state, metrics = jp.train.make_train_step(loss_fn, tx, mesh=mesh, grad_accum_steps=2)(state, batch)
        out.append((float(metrics["loss"]), np.asarray(state.params["w"])))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)
    np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-6)
