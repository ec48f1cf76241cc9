"""jaxpar.models.hf beyond the transformers references of test_llama.py / test_hf_gpt2.py: saves that replace a
checkpoint as a whole (or leave it as it was), what a save carries over, and the errors of bad checkpoints."""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

import jaxpar as jp
from jaxpar.models import Llama, LlamaConfig, hf

pytest.importorskip("safetensors")

CFG = LlamaConfig(vocab_size=61, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32, d_mlp=48, max_seq_len=32)
TOKENS = np.random.default_rng(0).integers(0, 61, (2, 9)).astype(np.int32)


def _params(seed: int, cfg: LlamaConfig = CFG) -> dict:
    return jax.tree.map(np.asarray, jax.device_get(nn.meta.unbox(Llama(cfg).init(jax.random.key(seed)))))


def _logits(path: str) -> np.ndarray:
    model, params = hf.load(path)
    return np.asarray(model.apply(params, TOKENS))


def _checkpoint(tmp_path, name: str = "ck", seed: int = 0, **save_kwargs) -> str:
    path = str(tmp_path / name)
    hf.save(Llama(CFG), _params(seed), path, **save_kwargs)
    return path


def test_save_replaces_a_checkpoint_whole_and_keeps_other_files(tmp_path):
    """A single-file save over a sharded checkpoint leaves no index or shard behind (either loader would pick the
    stale one); a tokenizer file in the directory survives; no temporary directory is left."""
    path = _checkpoint(tmp_path, seed=1, max_shard_bytes=20_000)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    open(os.path.join(path, "tokenizer.json"), "w").write("{}")
    hf.save(Llama(CFG), _params(2), path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "tokenizer.json"]
    want = np.asarray(Llama(CFG).apply(_params(2), TOKENS))
    np.testing.assert_array_equal(_logits(path), want)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path, seed=1, max_shard_bytes=20_000)
    before = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}
    import safetensors.numpy
    real, calls = safetensors.numpy.save_file, []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("No space left on device")
        return real(tensors, filename, metadata=metadata)
    monkeypatch.setattr(safetensors.numpy, "save_file", failing)
    with pytest.raises(OSError, match="No space"):
        hf.save(Llama(CFG), _params(2), path, max_shard_bytes=20_000)
    assert {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)} == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_save_like_carries_token_ids_and_tokenizer_files(tmp_path):
    source = _checkpoint(tmp_path, "source")
    config = json.load(open(os.path.join(source, "config.json")))
    json.dump({**config, "bos_token_id": 1, "eos_token_id": 2}, open(os.path.join(source, "config.json"), "w"))
    for f in ("tokenizer.json", "generation_config.json"):
        open(os.path.join(source, f), "w").write('{"x": 1}')
    out = str(tmp_path / "tuned")
    hf.save(Llama(CFG), _params(3), out, like=source)
    saved = json.load(open(os.path.join(out, "config.json")))
    assert (saved["bos_token_id"], saved["eos_token_id"]) == (1, 2) and "pad_token_id" not in saved
    assert open(os.path.join(out, "tokenizer.json")).read() == '{"x": 1}'
    assert os.path.isfile(os.path.join(out, "generation_config.json"))


def test_save_takes_boxed_params_and_refuses_a_file_path(tmp_path):
    boxed = Llama(CFG).init(jax.random.key(4))
    hf.save(Llama(CFG), boxed, str(tmp_path / "boxed"))
    np.testing.assert_array_equal(_logits(str(tmp_path / "boxed")), Llama(CFG).apply(_params(4), TOKENS))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        hf.save(Llama(CFG), boxed, str(tmp_path / "file"))


def _edit_config(path: str, **changes) -> None:
    config = json.load(open(os.path.join(path, "config.json")))
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    json.dump(config, open(os.path.join(path, "config.json"), "w"))


@pytest.mark.parametrize("changes, match", [
    (dict(hidden_size=None), "lacks 'hidden_size'"),
    (dict(rope_theta="abc", rope_parameters=None), "rope_theta='abc'; it must be a number"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings='false'; it must be true or false"),
    (dict(architectures=["LlamaForSequenceClassification"]), "another head"),
    (dict(num_hidden_layers=1), "no place for"),   # a 2-layer checkpoint read as 1 layer would drop layer 1
])
def test_load_names_bad_config_fields(tmp_path, changes, match):
    path = _checkpoint(tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=match):
        hf.load(path)


def test_load_refuses_unused_tensors_and_broken_files(tmp_path):
    from safetensors.numpy import load_file, save_file
    path = _checkpoint(tmp_path)
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    save_file({**tensors, "model.layers.0.self_attn.q_proj.bias": np.ones(32, np.float32)}, weights)
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        hf.load(path)
    save_file({**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}, weights)
    hf.load(path)   # a rotary buffer is not a weight
    raw = open(weights, "rb").read()
    open(weights, "wb").write(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="model.safetensors.*not a readable safetensors file"):
        hf.load(path)
    open(os.path.join(path, "config.json"), "w").write("[1, 2]")
    with pytest.raises(ValueError, match="JSON list"):
        hf.load(path)
    open(os.path.join(path, "config.json"), "w").write("{oops")
    with pytest.raises(ValueError, match="config.json.*not a readable JSON"):
        hf.load(path)


def test_load_names_a_broken_index(tmp_path):
    path = _checkpoint(tmp_path, max_shard_bytes=20_000)
    index = os.path.join(path, "model.safetensors.index.json")
    json.dump({"metadata": {}}, open(index, "w"))
    with pytest.raises(ValueError, match="weight_map"):
        hf.load(path)


def test_with_names_and_apply_check_the_params_against_the_config(tmp_path):
    model = Llama(CFG)
    params = _params(0)
    wrong = {**params, "blocks": {**params["blocks"], "gate_kernel": np.zeros((2, 32, 40), np.float32)}}
    with pytest.raises(ValueError, match=r"gate_kernel has shape \(2, 32, 40\)"):
        hf.with_names(model, wrong)
    three = Llama(LlamaConfig(**{**CFG.__dict__, "num_layers": 3}))
    with pytest.raises(ValueError, match=r"hold \[2\] layers; LlamaConfig.num_layers is 3"):
        three.apply(params, TOKENS)
    with pytest.raises(ValueError, match="layers"):
        three.generate(params, [[1, 2]], 2, 0, temperature=0)
