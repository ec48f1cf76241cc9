"""jaxpar.models.hf beyond the transformers references of test_llama.py / test_hf_gpt2.py: saves that replace a
checkpoint as a whole (or leave it as it was), what a save carries over, and the errors of bad checkpoints."""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import optax
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
    stale one); a tokenizer file and a subfolder (with a link in it, kept as a link) in the directory survive; no
    temporary directory is left. A save through a link to the checkpoint writes the link's target and keeps the
    link."""
    path = _checkpoint(tmp_path, seed=1, max_shard_bytes=20_000)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    open(os.path.join(path, "tokenizer.json"), "w").write("{}")
    os.makedirs(os.path.join(path, "onnx"))
    open(os.path.join(path, "onnx", "model.onnx"), "w").write("exported")
    os.symlink("/etc/hostname", os.path.join(path, "onnx", "link"))
    hf.save(Llama(CFG), _params(2), path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "onnx", "tokenizer.json"]
    assert open(os.path.join(path, "onnx", "model.onnx")).read() == "exported"
    assert os.readlink(os.path.join(path, "onnx", "link")) == "/etc/hostname"
    want = np.asarray(Llama(CFG).apply(_params(2), TOKENS))
    np.testing.assert_array_equal(_logits(path), want)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    os.symlink(path, tmp_path / "link")
    hf.save(Llama(CFG), _params(3), str(tmp_path / "link"))
    assert os.path.islink(tmp_path / "link") and sorted(os.listdir(tmp_path)) == ["ck", "link"]
    np.testing.assert_array_equal(_logits(path), np.asarray(Llama(CFG).apply(_params(3), TOKENS)))


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


def test_loaded_params_build_a_state_under_an_fp8_policy(tmp_path):
    """``dot=fp8`` (delayed scaling) makes ``model.init`` add fp8 meta state: ``with_names`` adds it fresh (amax
    histories of zeros, scales of one, one set per matmul and layer) and the state holds the loaded params."""
    mesh = jp.make_mesh(data=8)
    model, params = hf.load(_checkpoint(tmp_path, seed=5), mesh=mesh)
    state = jp.train.init_state(lambda rng: hf.with_names(model, params), optax.sgd(1e-3), 0, mesh=mesh,
                                policy=jp.Policy.from_string("p=f32,c=bf16,o=f32,dot=fp8"), report=False)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), jax.device_get(params))
    meta = jax.device_get(state.fp8)["blocks"][jp.fp8.OWG]
    assert sorted(meta) == ["down", "gate", "k", "out", "q", "up", "v"]
    for name, leaves in meta.items():
        for key, value in leaves.items():
            assert value.shape == ((CFG.num_layers, 1) if key.endswith("scale") else (CFG.num_layers, 1024)), key
            np.testing.assert_array_equal(value, 1.0 if key.endswith("scale") else 0.0)


@pytest.mark.slow  # transformers and a compiled fp8 step on 2x2x2: 12 s with a warm compilation cache, 40 s cold
def test_a_loaded_llama_trains_under_fp8(tmp_path):
    """The README's path under ``dot=fp8`` (delayed scaling: meta state the loaded params lack) on a mesh: ``save_pretrained`` of a transformers Llama, ``hf.load``,
    ``init_state(with_names)``, two steps. The step's matmuls are fp8; its first loss is transformers' float32
    loss within 5e-3 relative (fp8 rounding of activations and weights: measured 5e-4; a model with its weights
    lost would be near ln(256), 5% away), and the second is lower."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)).eval()
    ref.save_pretrained(tmp_path / "llama")
    tokens = np.random.default_rng(6).integers(0, 256, (8, 33)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    with torch.no_grad():
        logits = ref(torch.tensor(batch["inputs"], dtype=torch.long)).logits.reshape(-1, 256)
        want = torch.nn.functional.cross_entropy(logits, torch.tensor(batch["targets"], dtype=torch.long).reshape(-1))
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2)
    model, params = hf.load(str(tmp_path / "llama"), mesh=mesh)
    tx = optax.adamw(1e-3)
    state = jp.train.init_state(lambda rng: hf.with_names(model, params), tx, 0, mesh=mesh,
                                policy=jp.Policy.from_string("p=f32,c=bf16,o=f32,dot=fp8"), report=False)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh)
    assert jp.fp8.fp8_dot_counts(step.lower(state, batch)) == {"e4m3 x e4m3": 14, "e5m2 x e4m3": 28}
    state, first = step(state, batch)
    state, second = step(state, batch)
    assert abs(float(first["loss"]) - float(want)) <= 5e-3 * float(want), (float(first["loss"]), float(want))
    assert float(second["loss"]) < float(first["loss"]) - 0.1


def test_load_refuses_config_fields_that_change_the_computation(tmp_path):
    """Fields the loaded Llama would ignore, each refused by name: a Mistral config relabelled as a Llama's with
    ``sliding_window: 8``, soft-capping, attention sinks, another activation, sliding layers, partial rotary
    positions. Their "off" values (null, false, all layers full attention) load."""
    path = _checkpoint(tmp_path)
    rope = json.load(open(os.path.join(path, "config.json")))["rope_parameters"]
    for field, value in [("sliding_window", 8), ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
                         ("learnable_sink_init", 0.0), ("hidden_act", "gelu"),
                         ("layer_types", ["sliding_attention", "full_attention"]),
                         ("rope_parameters", {**rope, "partial_rotary_factor": 0.5})]:
        _edit_config(path, **{field: value})
        named = "rope_parameters.partial_rotary_factor" if field == "rope_parameters" else field
        with pytest.raises(ValueError, match=rf"config.json has {named}=.*does not compute"):
            hf.load(path)
        _edit_config(path, **{field: rope if field == "rope_parameters" else None})   # None: the field removed
    config = json.load(open(os.path.join(path, "config.json")))
    config.update(sliding_window=None, use_sliding_window=False, layer_types=["full_attention"] * 2)
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    assert hf.load(path)[0] == Llama(CFG)


@pytest.mark.slow  # transformers' Mistral: 3 s warm, 30 s cold
def test_a_mistral_relabelled_as_a_llama_is_refused_unless_its_window_is_off(tmp_path):
    """transformers' ``MistralForCausalLM`` with ``sliding_window: 8`` saved, its config relabelled as a Llama's (a
    common workaround): ``hf.load`` refuses it, naming ``sliding_window``; the Llama loaded with the window off
    computes logits that differ from the windowed Mistral's on 24 tokens (what the refusal prevents) and equal those
    of the same Mistral without a window."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8,
        initializer_range=0.1)).eval()
    ref.save_pretrained(tmp_path / "mistral")
    config = json.load(open(tmp_path / "mistral" / "config.json"))
    json.dump({**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
              open(tmp_path / "mistral" / "config.json", "w"))
    with pytest.raises(ValueError, match="sliding_window=8: sliding-window attention"):
        hf.load(str(tmp_path / "mistral"))
    tokens = np.random.default_rng(7).integers(0, 128, (2, 24))
    with torch.no_grad():
        windowed = ref(torch.tensor(tokens)).logits.numpy()
        ref.config.sliding_window = None
        full = transformers.MistralForCausalLM(ref.config).eval()
        full.load_state_dict(ref.state_dict())
        full = full(torch.tensor(tokens)).logits.numpy()
    json.dump({**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "sliding_window": None},
              open(tmp_path / "mistral" / "config.json", "w"))
    model, params = hf.load(str(tmp_path / "mistral"))
    got = np.asarray(model.apply(params, tokens.astype(np.int32)))[..., :128]
    print(f"\n[relabelled Mistral] max |logits - windowed Mistral's| {np.abs(got - windowed).max():.3f}, "
          f"- unwindowed Mistral's {np.abs(got - full).max():.2e}")
    assert np.abs(got - windowed).max() > 0.05
    np.testing.assert_allclose(got, full, atol=2e-5 * np.abs(full).max())
