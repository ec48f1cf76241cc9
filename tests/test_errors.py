"""Config mistakes give a clear ValueError (naming the value, the constraint and the fix), before tracing."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar as jp
from helpers import SMALL_GPT, SMALL_GPT_VARIANT, gpt_batch, gpt_parts, mlp_batch, mlp_parts
from jaxpar.models import GPT, GPTConfig
from jaxpar.precision import Policy


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


# -------------------------------------------------------------------------------------------- batches

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


# ---------------------------------------------------------------------------- model sizes vs the mesh

def _gpt_cfg(**kw):
    return GPTConfig(**{**dict(vocab_size=61, num_layers=2, num_heads=8, d_model=64, max_seq_len=16), **kw})


@pytest.mark.parametrize("cfg, pattern", [
    # heads: out_kernel [layers, H, K, D] comes first in the tree, qkv_kernel would fail the same way
    (_gpt_cfg(num_heads=6, d_model=48),
     r"\['blocks'\]\['(out|qkv)_kernel'\] has shape .*'heads' dimension \(6\) is not divisible by tensor = 4; "
     r"change the model size or the mesh \(e.g. a smaller tensor axis\)"),
    (_gpt_cfg(d_mlp=90),
     r"\['blocks'\]\['(down|up)_(bias|kernel)'\] has shape .*'mlp' dimension \(90\) is not divisible by tensor = 4"),
    (_gpt_cfg(vocab_multiple=2),
     r"\['embed'\]\['embedding'\] has shape \(62, 64\): its 'vocab' dimension \(62\) is not divisible by tensor = 4"),
    (_gpt_cfg(d_model=36, num_heads=4, d_mlp=64),
     r"has shape .*'embed' dimension \(36\) is not divisible by fsdp = 8"),
], ids=["heads", "mlp", "vocab", "embed"])
def test_gpt_sizes_not_divisible(mesh_factory, cfg, pattern):
    mesh = mesh_factory(fsdp=8) if "fsdp = 8" in pattern else mesh_factory(fsdp=2, tensor=4)
    model = GPT(cfg)
    with pytest.raises(ValueError, match=pattern):
        jp.train.init_state(model.init, optax.sgd(0.1), 0, mesh=mesh)
    with pytest.raises(ValueError, match=pattern):
        jp.train.abstract_state(model.init, optax.sgd(0.1), mesh=mesh)


def test_mlp_width_not_divisible(mesh_factory):
    init_fn, _ = mlp_parts(hidden=(30,))
    with pytest.raises(ValueError, match=r"\['dense_0'\]\['(bias|kernel)'\] has shape .*'mlp' dimension \(30\) "
                                         r"is not divisible by tensor = 4"):
        jp.train.init_state(init_fn, optax.sgd(0.1), 0, mesh=mesh_factory(fsdp=2, tensor=4))


@pytest.mark.parametrize("cfg", [SMALL_GPT, SMALL_GPT_VARIANT], ids=["learned", "rotary"])
def test_sequence_longer_than_max_seq_len(mesh_factory, cfg):
    """``GPT.apply`` refuses a sequence longer than ``max_seq_len``; the training loss must too.

    (``GPT.loss`` skips the check: learned positions fail with a broadcasting TypeError from inside the
    model, rotary positions silently train past ``max_seq_len``.)
    """
    model = GPT(cfg)
    batch = gpt_batch(np.random.default_rng(0), 4, cfg, seq_len=cfg.max_seq_len + 4)
    params = jax.device_get(jp.train.init_state(model.init, optax.sgd(0.1), 0, mesh=mesh_factory()).params)
    with pytest.raises(ValueError, match=r"sequence length 20 exceeds max_seq_len 16"):
        model.apply(params, jnp.asarray(batch["inputs"]))
    with pytest.raises(ValueError, match=r"sequence length 20 exceeds max_seq_len 16"):
        model.loss(params, batch)


# ------------------------------------------------------------------------------------- rules and types

def test_rules_with_unknown_mesh_axis(mesh_factory):
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    rules = tuple((n, "model" if n == "mlp" else t) for n, t in jp.sharding.DEFAULT_RULES)
    init_fn, loss_fn = gpt_parts()
    pattern = (r"rules name mesh axes \['model'\] that the mesh \('data', 'pipe', 'fsdp', 'tensor'\) does not have "
               r"\(in \[\('mlp', 'model'\)\]\); use axes of the mesh")
    for build in (lambda: jp.train.init_state(init_fn, optax.sgd(0.1), 0, mesh=mesh, rules=rules),
                  lambda: jp.train.abstract_state(init_fn, optax.sgd(0.1), mesh=mesh, rules=rules),
                  lambda: jp.train.make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, rules=rules),
                  lambda: jp.train.make_eval_step(loss_fn, mesh=mesh, rules=rules)):
        with pytest.raises(ValueError, match=pattern):
            build()


def test_wrong_argument_types(mesh_factory):
    init_fn, loss_fn = gpt_parts()
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh .*got dict"):
        jp.train.init_state(init_fn, optax.sgd(0.1), 0, mesh={"data": 8})
    with pytest.raises(TypeError, match=r"policy must be a jp.precision.Policy or None, got 'bf16'"):
        jp.train.init_state(init_fn, optax.sgd(0.1), 0, mesh=mesh_factory(), policy="bf16")
    with pytest.raises(TypeError, match=r"rng must be a typed key"):
        jp.train.init_state(init_fn, optax.sgd(0.1), "seed", mesh=mesh_factory())


# ------------------------------------------------------------------------------------------ GPTConfig

@pytest.mark.parametrize("kwargs, pattern", [
    (dict(vocab_size=0), r"GPTConfig.vocab_size=0 must be a positive int"),
    (dict(num_layers=-1), r"GPTConfig.num_layers=-1 must be a positive int"),
    (dict(num_heads=2.0), r"GPTConfig.num_heads=2.0 must be a positive int"),
    (dict(max_seq_len=0), r"GPTConfig.max_seq_len=0 must be a positive int"),
    (dict(vocab_multiple=0), r"GPTConfig.vocab_multiple=0 must be a positive int"),
    (dict(d_model=64, num_heads=3), r"d_model 64 is not divisible by num_heads 3"),
    (dict(d_model=12, num_heads=4, positions="rotary"), r"rotary positions need an even head dim, got 3"),
    (dict(positions="alibi"), r"positions='alibi'; use 'learned' or 'rotary'"),
    (dict(remat="some"), r"remat='some'; use one of \['dots', 'full', 'none'\]"),
    (dict(d_mlp=-1), r"d_mlp=-1 must be an int >= 0"),
    # d_mlp is the one int field without a type check: 2.5 is accepted and fails later inside Flax
    (dict(d_mlp=2.5), r"d_mlp=2.5"),
], ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else "")
def test_invalid_gpt_config(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        GPTConfig(**kwargs)


def test_gpt_config_derived_sizes():
    cfg = GPTConfig(vocab_size=103, d_model=128, num_heads=4)
    assert (cfg.head_dim, cfg.mlp_dim, cfg.padded_vocab) == (32, 512, 128)
    assert GPTConfig(vocab_size=129).padded_vocab == 256
    assert GPTConfig(d_mlp=100).mlp_dim == 100
    for cfg in (SMALL_GPT, SMALL_GPT_VARIANT):
        shapes = jax.eval_shape(lambda k: nn.meta.unbox(GPT(cfg).init(k)), jax.random.key(0))
        assert sum(x.size for x in jax.tree.leaves(shapes)) == cfg.num_params()


# -------------------------------------------------------------------------------------------- text files

def _text_loaders():
    return [jp.data.load_text, jp.data.CharCorpus.load]


@pytest.mark.parametrize("load", _text_loaders(), ids=["load_text", "CharCorpus.load"])
@pytest.mark.parametrize("content, pattern", [
    (b"", r"is empty; pass a file with some text"),
    (b" \n\t\n", r"is empty; pass a file with some text"),
    (b"hello\x00world", r"looks binary \(it holds NUL bytes\); pass a UTF-8 text file"),
    (b"caf\xe9 latin-1", r"is not UTF-8 text \(invalid continuation byte at byte 3\); pass a UTF-8 text file"),
    (b"\xff\xfeh\x00i\x00", r"looks binary"),                      # UTF-16 holds NUL bytes
], ids=["empty", "whitespace", "binary", "latin1", "utf16"])
def test_bad_text_files(tmp_path, load, content, pattern):
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=pattern) as info:
        load(path)
    assert "corpus.txt" in str(info.value)


@pytest.mark.parametrize("load", _text_loaders(), ids=["load_text", "CharCorpus.load"])
def test_missing_text_file_and_directory(tmp_path, load):
    with pytest.raises(ValueError, match=r"'.*nope.txt' does not exist; pass a UTF-8 text file or omit it"):
        load(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match=r"is not a file; pass a UTF-8 text file"):
        load(tmp_path)


def test_good_text_file(tmp_path):
    path = tmp_path / "ok.txt"
    path.write_text("héllo wörld, " * 50, encoding="utf-8")
    assert jp.data.load_text(str(path)) == "héllo wörld, " * 50
    corpus = jp.data.CharCorpus.load(path)
    assert corpus.vocab_size == len(set("héllo wörld, "))


def test_corpus_too_short_for_seq_len():
    corpus = jp.data.CharCorpus.from_text("abcdefghij" * 10)
    with pytest.raises(ValueError, match=r"the val split has 10 tokens, too few for seq_len 16"):
        corpus.batch(0, 0, 4, 16, split="val")
    with pytest.raises(ValueError, match=r"text is empty"):
        jp.data.CharCorpus.from_text("")
    with pytest.raises(ValueError, match=r"val_fraction=1.0 must lie in \(0, 1\)"):
        jp.data.CharCorpus.from_text("abc", val_fraction=1.0)


# -------------------------------------------------------------------------------------------- Policy

@pytest.mark.parametrize("text, expected", [
    ("params=float32,compute=bfloat16,output=float32", (jnp.float32, jnp.bfloat16, jnp.float32)),
    ("p=f32,c=bf16,o=f32", (jnp.float32, jnp.bfloat16, jnp.float32)),
    ("params=float32,compute=float16", (jnp.float32, jnp.float16, jnp.float16)),   # output follows compute
    ("compute=bf16", (jnp.float32, jnp.bfloat16, jnp.bfloat16)),                   # params default float32
    ("params=bf16", (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)),                   # compute follows params
    ("bf16", (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)),                          # a bare dtype sets all three
    ("float32", (jnp.float32, jnp.float32, jnp.float32)),
    ("half", (jnp.float16, jnp.float16, jnp.float16)),
    (" Params = FP32 , Compute = BFloat16 ", (jnp.float32, jnp.bfloat16, jnp.bfloat16)),
])
def test_policy_from_string(text, expected):
    policy = Policy.from_string(text)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == tuple(map(jnp.dtype, expected))
    assert Policy.from_string(str(policy)) == policy


@pytest.mark.parametrize("text, pattern", [
    ("", r"empty policy string ''; e.g. 'params=float32,compute=bfloat16,output=float32'"),
    ("   ", r"empty policy string"),
    ("params=float64", r"unknown dtype 'float64' in policy; use one of \[.*'bfloat16'.*\]"),
    ("float8", r"unknown dtype 'float8'"),
    ("weights=float32", r"unknown policy key in 'weights=float32'; use params=, compute=, output="),
    ("params=float32,compute", r"unknown policy key in 'compute'"),
    ("params=float32,,", r"unknown policy key in ''"),
    ("params=", r"unknown dtype ''"),
])
def test_policy_from_string_bad_input(text, pattern):
    with pytest.raises(ValueError, match=pattern):
        Policy.from_string(text)


def test_policy_casts_floating_leaves_only():
    policy = Policy.from_string("params=float32,compute=bfloat16,output=float32")
    tree = {"w": jnp.ones((2,), jnp.float32), "i": jnp.ones((2,), jnp.int32), "n": np.ones(2, np.float64), "s": 1.0}
    cast = policy.cast_to_compute(tree)
    assert cast["w"].dtype == jnp.bfloat16 and cast["n"].dtype == jnp.bfloat16
    assert cast["i"].dtype == jnp.int32 and cast["s"] == 1.0
    sds = policy.cast_to_param(jax.ShapeDtypeStruct((3,), jnp.bfloat16))
    assert sds.dtype == jnp.float32 and sds.shape == (3,)


def test_policy_from_string_rejects_non_strings():
    with pytest.raises(TypeError, match="must be given as a str"):
        Policy.from_string(None)
