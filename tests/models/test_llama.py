"""jaxpar/models/llama.py and jaxpar/models/hf/checkpoint.py against Hugging Face ``transformers``' ``LlamaForCausalLM``.

The reference is built here on tiny random configs (2 layers, d_model 64, 4 heads, 2 KV heads, rope_theta 500000
with Llama 3's frequency scaling, vocab 256): its logits, and the loss and gradient with respect to the token
embeddings computed by torch's autograd, against jaxpar's Llama loaded from the checkpoint ``save_pretrained``
wrote. Saving goes the other way (jaxpar writes, ``from_pretrained`` reads).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from helpers import assert_scalar_close, assert_tree_close, gpt_batch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

import jaxpar as jp
from jaxpar.models import Llama, LlamaConfig, hf
from jaxpar.models import decoder as decoder_module

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_llama(tie: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = HFLlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=tie, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():   # norms start at ones: make them random too, so a swapped or missing scale shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=[False, pytest.param(True, marks=pytest.mark.slow)], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory):
    model = hf_llama(tie=request.param)
    path = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(path, max_shard_size="100KB")     # several shards and their index
    return model, str(path)


def _torch_loss_and_embedding_grad(model, tokens, targets):
    model.zero_grad()
    logits = model(torch.tensor(tokens)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(targets, dtype=torch.long).reshape(-1))
    loss.backward()
    return logits.detach().numpy(), loss.item(), model.model.embed_tokens.weight.grad.numpy().copy()


def test_load_matches_transformers_logits_loss_and_embedding_grad(checkpoint):
    ref_model, path = checkpoint
    assert any(f.endswith(".index.json") for f in os.listdir(path))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, (2, 48), dtype=np.int32)
    targets = rng.integers(0, 256, (2, 48), dtype=np.int32)
    ref_logits, ref_loss, ref_grad = _torch_loss_and_embedding_grad(ref_model, tokens, targets)

    model, params = hf.load(path)
    assert model.cfg.num_kv_heads == 2 and model.cfg.rope_scaling is not None
    logits = np.asarray(model.apply(params, jnp.asarray(tokens)))[..., :256]
    err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
    assert err <= 1e-5, err
    (loss, _), grads = jax.value_and_grad(model.loss, has_aux=True)(params, {"inputs": tokens, "targets": targets})
    assert_scalar_close(loss, ref_loss, rtol=1e-4, what="loss")
    g = np.asarray(grads["embed"]["embedding"])
    assert_tree_close(g[:256], ref_grad, rtol=1e-4, what="embedding grad")
    print(f"\n[hf llama] logits {err:.2e}")


def test_save_is_read_by_from_pretrained(checkpoint, tmp_path):
    ref_model, path = checkpoint
    model, params = hf.load(path)
    out = tmp_path / "saved"
    hf.save(model, params, str(out), max_shard_bytes=150_000)
    files = os.listdir(out)
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert not [f for f in files if f.endswith(".tmp")]
    again = LlamaForCausalLM.from_pretrained(out).eval()
    tokens = torch.tensor(np.random.default_rng(2).integers(0, 256, (3, 20)))
    with torch.no_grad():
        np.testing.assert_array_equal(again(tokens).logits.numpy(), ref_model(tokens).logits.numpy())
    model2, params2 = hf.load(str(out))       # and back: the same model and params, bit for bit
    assert model2 == model
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params2), jax.device_get(params))


def test_load_onto_a_2x2x2_mesh_is_bitwise_the_single_device_load(checkpoint, mesh_factory):
    _, path = checkpoint
    _, params = hf.load(path)
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    _, sharded = hf.load(path, mesh=mesh)
    split = [x for x in jax.tree.leaves(sharded) if x.addressable_shards[0].data.shape != x.shape]
    assert len(split) >= 9, "the load did not shard the params"
    assert sharded["blocks"]["q_kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(sharded), jax.device_get(params))


_PEAK = r"""
import os, sys, threading, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jaxpar as jp
from jaxpar.models import hf
anon = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) * 1024
mesh = jp.make_mesh(fsdp=8)
jax.numpy.ones(8).block_until_ready()
before, peak, done = anon(), [0], []
def watch():
    while not done:
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)
watcher = threading.Thread(target=watch)
watcher.start()
model, params = hf.load(sys.argv[1], mesh=mesh)
jax.block_until_ready(params)
done.append(1)
watcher.join()
print(before, max(peak[0], anon()))
"""


def test_load_peak_host_memory_is_under_1p5x_the_checkpoint(tmp_path):
    """A 128 MiB float32 checkpoint loaded onto fsdp=8: the process's anonymous resident memory (sampled every
    millisecond) grows by less than 1.5x the checkpoint's bytes. The simulated devices' memory is host memory, so
    the loaded params themselves are 1x of it; the rest is the per-block reads. The safetensors files are
    memory-mapped: their pages are the kernel's page cache (file-backed, dropped under pressure), not counted."""
    torch.manual_seed(0)
    cfg = HFLlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="40MB")
    size = sum(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    out = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, peak = map(int, out.stdout.split()[-2:])
    growth = (peak - before) / size
    print(f"\n[hf load] checkpoint {size / 2**20:.0f} MiB, peak anonymous memory growth {growth:.2f}x")
    assert growth < 1.5, growth


# ----------------------------------------------------------------------------------- training on a mesh

SMALL_LLAMA = LlamaConfig(vocab_size=61, num_layers=2, num_heads=8, num_kv_heads=2, d_model=64, d_mlp=128,
                          max_seq_len=16, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)


def test_tensor_parallel_step_replicates_kv_heads_and_matches_one_device(mesh_factory):
    """tensor=8 > num_kv_heads=2: the key/value kernels stay replicated (kv_heads is unmapped), the query heads
    are split, and one step's loss and gradients match plain JAX on one device."""
    model, tx = Llama(SMALL_LLAMA), optax.sgd(0.1)
    batch = gpt_batch(np.random.default_rng(3), 8, SMALL_LLAMA)
    mesh = mesh_factory(data=1, tensor=8)
    state = jp.train.init_state(model.init, tx, 5, mesh=mesh)
    assert "tensor" not in state.params["blocks"]["k_kernel"].sharding.spec
    assert state.params["blocks"]["q_kernel"].sharding.spec[2] == "tensor"
    params = jax.device_put(jax.device_get(state.params), jax.devices()[0])
    (loss, _), grads = jax.jit(jax.value_and_grad(model.loss, has_aux=True))(params, batch)
    with jp.sharding.use(mesh), pytest.warns(UserWarning, match="key/value heads are replicated over the tensor"):
        (loss2, _), grads2 = jax.jit(jax.value_and_grad(model.loss, has_aux=True))(
            state.params, jp.train.shard_batch(batch, mesh))
    assert_scalar_close(loss2, loss, what="tensor=8 loss")
    assert_tree_close(grads2, jax.device_get(grads), what="tensor=8 grads")


# slow set: a lighter sibling stays in the fast set (the README's 10-minute budget)
@pytest.mark.slow
def test_kv_heads_rule_first_splits_them_and_a_later_one_is_still_warned_of(mesh_factory):
    """Flax reads the first rule naming an axis: ``("kv_heads", "tensor")`` before the defaults splits the key/value
    kernels (no warning); after them it is never read, so they stay replicated and the warning says so."""
    import warnings
    model, mesh = Llama(SMALL_LLAMA), mesh_factory(data=4, tensor=2)
    batch = jp.train.shard_batch(gpt_batch(np.random.default_rng(5), 8, SMALL_LLAMA), mesh)
    decoder_module._WARNED.clear()
    for rules, split in ((( ("kv_heads", "tensor"),) + jp.sharding.DEFAULT_RULES, True),
                         (jp.sharding.DEFAULT_RULES + (("kv_heads", "tensor"),), False)):
        state = jp.train.init_state(model.init, optax.sgd(0.1), 0, mesh=mesh, rules=rules)
        assert ("tensor" in state.params["blocks"]["k_kernel"].sharding.spec) == split
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            jp.train.make_train_step(model.loss, optax.sgd(0.1), mesh=mesh, rules=rules)(state, batch)
        assert any("key/value heads are replicated" in str(w.message) for w in seen) != split


@pytest.mark.slow   # the GPT's pipeline parity and an NNX model's 1F1B stay in the fast set
@pytest.mark.parametrize("schedule", [jp.pipeline.one_f_one_b, jp.pipeline.zero_bubble_v], ids=["1f1b", "zbv"])
def test_pipelined_llama_step_matches_single_device(schedule, mesh_factory):
    cfg = dataclasses.replace(SMALL_LLAMA, num_layers=4)
    model, tx = Llama(cfg), optax.sgd(0.1, momentum=0.9)
    batch = gpt_batch(np.random.default_rng(4), 8, cfg)
    pipeline = jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, schedule(2, 4))
    mesh = mesh_factory(data=2, pipe=2, tensor=2)
    state = jp.train.init_state(model.init, tx, 5, mesh=mesh, pipeline=pipeline)
    ref_params = jax.device_put(jax.device_get(jp.train.to_model_order(state).params), jax.devices()[0])
    (loss, _), grads = jax.jit(jax.value_and_grad(model.loss, has_aux=True))(ref_params, batch)
    step = jp.train.make_train_step(pipeline, tx, mesh=mesh)
    new_state, metrics = step(state, batch)
    assert_scalar_close(metrics["loss"], loss, what="pipelined loss")
    trace = [s for s in jax.tree.leaves(jp.train.to_model_order(new_state).opt_state,
                                        is_leaf=lambda s: isinstance(s, optax.TraceState))
             if isinstance(s, optax.TraceState)][0].trace
    assert_tree_close(trace, jax.device_get(grads), what="pipelined grads")


def _momentum_trace(opt_state):
    return next(s for s in jax.tree.leaves(opt_state,
                                           is_leaf=lambda s: isinstance(s, optax.TraceState))
                if isinstance(s, optax.TraceState)).trace


# Measured (mixed_bf16: float32 master params, bfloat16 compute), per leaf max|diff| / max|ref|, against jaxpar's
# bf16 step on one device: 2x2x2 loss 3.9e-6, grads 1.1e-2; pipe=2 1F1B loss 3.9e-6, grads 1.2e-2; against the
# float32 reference: grads 1.5e-2 and 1.8e-2 (bf16 keeps 8 mantissa bits; the layouts round partial sums at
# different points).
# Tolerance 3e-2, as the GPT's bf16 cases (tests/test_pipeline_users.py); the grads must also differ from float32
# by more than 1e-4, so the policy really applies.
BF16_RTOL = 3e-2


@pytest.mark.slow   # bf16 policies on the GPT stay in the fast set (tests/test_precision.py)
@pytest.mark.parametrize("layout", ["2x2x2", "pipe2_1f1b"])
def test_mixed_bf16_llama_step_matches_the_single_device_bf16_step(layout, mesh_factory):
    policy = jp.precision.Policy.from_string("mixed_bf16")
    cfg = dataclasses.replace(SMALL_LLAMA, num_layers=4)
    model, tx = Llama(cfg), optax.sgd(0.1, momentum=0.9)
    batch = gpt_batch(np.random.default_rng(6), 8, cfg)
    one = mesh_factory()
    ref_state = jp.train.init_state(model.init, tx, 5, mesh=one, policy=policy)
    ref_new, ref_metrics = jp.train.make_train_step(model.loss, tx, mesh=one, donate=False)(ref_state, batch)
    params = jax.device_get(ref_state.params)
    (f32_loss, _), f32_grads = jax.jit(jax.value_and_grad(model.loss, has_aux=True))(params, batch)
    if layout == "2x2x2":
        mesh, loss_fn, pipeline = mesh_factory(data=2, fsdp=2, tensor=2), model.loss, None
    else:
        mesh = mesh_factory(data=2, pipe=2, tensor=2)
        pipeline = loss_fn = jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss,
                                                  jp.pipeline.one_f_one_b(2, 4))
    state = jp.train.init_state(model.init, tx, 5, mesh=mesh, policy=policy, pipeline=pipeline)
    new_state, metrics = jp.train.make_train_step(loss_fn, tx, mesh=mesh)(state, batch)
    new_state = jp.train.to_model_order(new_state) if pipeline else new_state
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(new_state.params)), "master params stay float32"
    grads, ref_grads = _momentum_trace(new_state.opt_state), _momentum_trace(ref_new.opt_state)
    e_loss = assert_scalar_close(metrics["loss"], ref_metrics["loss"], rtol=BF16_RTOL, what="vs bf16 step loss")
    e_grads = assert_tree_close(grads, ref_grads, rtol=BF16_RTOL, what="vs bf16 step grads")
    f_grads = assert_tree_close(grads, jax.device_get(f32_grads), rtol=BF16_RTOL, what="vs float32 grads")
    assert_scalar_close(metrics["loss"], f32_loss, rtol=BF16_RTOL, what="vs float32 loss")
    assert f_grads > 1e-4, f"mixed_bf16 grads equal float32 ones ({f_grads:.2e}): the policy did not apply"
    print(f"\n[llama mixed_bf16 {layout}] vs bf16 step: loss {e_loss:.2e} grads {e_grads:.2e}; vs f32 grads {f_grads:.2e}")


# --------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,match", [
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "only Llama 3's scaling"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(d_model=60, num_heads=8), "not divisible"),
])
def test_bad_llama_configs_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**kwargs)


def test_bad_checkpoints_are_clear_errors(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="not a directory"):
        hf.load(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        hf.load(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="loads LlamaForCausalLM"):
        hf.load(str(tmp_path))
    _, path = checkpoint
    with pytest.raises(ValueError, match="has shape"):      # a config that disagrees with the tensors
        bad = tmp_path / "bad"
        shutil.copytree(path, bad)
        cfg = json.loads((bad / "config.json").read_text())
        cfg["intermediate_size"] = 128
        (bad / "config.json").write_text(json.dumps(cfg))
        hf.load(str(bad))
    with pytest.raises(ValueError, match="writes a jaxpar.models.Llama or GPT"):
        hf.save(object(), {}, str(tmp_path / "out"))
    model, params = hf.load(path)
    params["blocks"]["q_kernel"] = params["blocks"]["q_kernel"][:, :, :2]
    with pytest.raises(ValueError, match="blocks/q_kernel has shape"):
        hf.save(model, params, str(tmp_path / "out"))


def test_packed_documents_match_transformers_with_a_document_mask(checkpoint):
    """Three documents and padding in one row: jaxpar's Llama with segment ids and per-document positions
    against LlamaForCausalLM given the same row with a 4-D additive mask (causal within each document) and
    ``position_ids`` restarting per document."""
    ref_model, path = checkpoint
    model, params = hf.load(path)
    L = 24
    seg = np.array([[1] * 7 + [2] * 5 + [3] * 9 + [0] * 3], np.int32)
    pos = np.array([[*range(7), *range(5), *range(9), 0, 1, 2]], np.int32)
    tokens = np.random.default_rng(4).integers(0, 256, (1, L)).astype(np.int32)
    visible = (seg[:, :, None] == seg[:, None, :]) & (np.arange(L)[None, :] <= np.arange(L)[:, None])[None]
    mask = torch.where(torch.tensor(visible)[:, None], 0.0, torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref = ref_model(torch.tensor(tokens), attention_mask=mask, position_ids=torch.tensor(pos, dtype=torch.long))
        plain = ref_model(torch.tensor(tokens)).logits.numpy()
    ref = ref.logits.numpy()
    got = np.asarray(model.logits(params, model.stage(params["blocks"], model.embed(params, tokens, pos), seg, pos)))
    err = np.abs(got[..., :256] - ref).max() / np.abs(ref).max()
    assert err <= 1e-5, err
    assert np.abs(plain - ref).max() > 0.1 * np.abs(ref).max()       # the document mask matters here
    print(f"\n[hf llama packed] logits {err:.2e}")
