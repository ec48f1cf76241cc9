"""jaxpar/models/hf/checkpoint.py with GPT-2: ``GPT2LMHeadModel`` checkpoints (Conv1D ``[in, out]`` weights, fused q|k|v with
its bias, learned positions, tied embeddings) load as jaxpar's GPT and save back, against ``transformers`` on a
tiny random config built here (2 layers, d_model 64, 4 heads, vocab 256)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_scalar_close, assert_tree_close
from transformers import GPT2Config, GPT2LMHeadModel

from jaxpar.models import GPT, GPTConfig, hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():   # biases and norms start at zeros and ones: make them random, so a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.startswith("transformer.ln") or ".ln_" in name:
                p.copy_(0.3 * torch.randn_like(p) + (1.0 if name.endswith("weight") else 0.0))
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    model.save_pretrained(path, max_shard_size="100KB")
    return model, str(path)


@pytest.mark.slow  # ~16 s; the Llama's transformers comparison stays in the fast set
def test_gpt2_load_matches_transformers_logits_loss_and_embedding_grad(checkpoint):
    ref, path = checkpoint
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, (2, 40), dtype=np.int32)
    targets = rng.integers(0, 256, (2, 40), dtype=np.int32)
    ref.zero_grad()
    logits_t = ref(torch.tensor(tokens, dtype=torch.long)).logits
    loss_t = torch.nn.functional.cross_entropy(logits_t.reshape(-1, 256), torch.tensor(targets, dtype=torch.long).reshape(-1))
    loss_t.backward()

    model, params = hf.load(path)
    assert isinstance(model, GPT) and model.cfg.qkv_bias and model.cfg.tie_embeddings
    logits = np.asarray(model.apply(params, jnp.asarray(tokens)))[..., :256]
    ref_logits = logits_t.detach().numpy()
    err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
    assert err <= 1e-5, err
    (loss, _), grads = jax.value_and_grad(model.loss, has_aux=True)(params, {"inputs": tokens, "targets": targets})
    assert_scalar_close(loss, float(loss_t), rtol=1e-4, what="loss")
    assert_tree_close(np.asarray(grads["embed"]["embedding"])[:256], ref.transformer.wte.weight.grad.numpy(),
                      rtol=1e-4, what="embedding grad")
    print(f"\n[hf gpt2] logits {err:.2e}")


def test_gpt2_save_is_read_by_from_pretrained_and_sharded_load_is_bitwise(checkpoint, tmp_path, mesh_factory):
    ref, path = checkpoint
    model, params = hf.load(path)
    hf.save(model, params, str(tmp_path), max_shard_bytes=150_000)
    assert "model.safetensors.index.json" in os.listdir(tmp_path)
    again = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    tokens = torch.tensor(np.random.default_rng(2).integers(0, 256, (3, 20)))
    with torch.no_grad():
        np.testing.assert_array_equal(again(tokens).logits.numpy(), ref(tokens).logits.numpy())
    _, sharded = hf.load(path, mesh=mesh_factory(data=2, fsdp=2, tensor=2))
    assert sharded["blocks"]["qkv_kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None, None)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(sharded), jax.device_get(params))


def test_gpt2_bad_configs_are_clear_errors(tmp_path):
    import json
    for extra, match in (({"activation_function": "relu"}, "tanh approximation"),
                         ({"layer_norm_epsilon": 1e-6}, "1e-5"),
                         ({"scale_attn_by_inverse_layer_idx": True}, "attention scaling")):
        cfg = {"model_type": "gpt2", "vocab_size": 10, "n_embd": 8, "n_layer": 1, "n_head": 2, "n_positions": 8, **extra}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        (tmp_path / "model.safetensors").write_bytes(b"")
        with pytest.raises(ValueError, match=match):
            hf.load(str(tmp_path))
    with pytest.raises(ValueError, match="positions='rotary' has no GPT-2"):
        model = GPT(GPTConfig(positions="rotary", num_layers=1))
        hf.save(model, jax.tree.map(lambda b: b.value, model.init(jax.random.key(0)),
                                    is_leaf=lambda b: hasattr(b, "names")), str(tmp_path / "out"))
