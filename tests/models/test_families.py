"""jaxpar/models/families.py and its Hugging Face adapters (jaxpar/models/hf/families.py, family_config.py) against
``transformers``' ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Gemma3ForCausalLM`` and
``Gemma3ForConditionalGeneration``, each built here on a tiny random config (random norms and biases too, so a
swapped or missing tensor shows): logits within 1e-4 (float32), greedy cached generation equal to ``generate``'s,
and ``hf.save`` read back by ``from_pretrained`` with the same tensors. The cases cover grouped-query and
multi-head attention, tied and untied embeddings, Gemma 3's local/global pattern and Mistral's window shorter than
the sequence, Qwen2's window written beside ``use_sliding_window: false`` (full attention), and bad configs.
Beyond transformers: one training step of Qwen3 and Gemma 3 with a 1F1B pipeline of 2 stages and with the ring over
context=2 against the single-device float32 step (their data=2 x fsdp=2 x tensor=2 cases are in
tests/test_parity.py), their fp8 matmuls in the lowered step, and loading onto a 2x2x2 mesh.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers as T
from helpers import (SMALL_GEMMA3, SMALL_QWEN3, assert_hf_logits_and_save, assert_scalar_close, assert_tree_close,
                     gpt_batch, transformers_greedy)

import jaxpar as jp
from jaxpar.models import FamilyConfig, families, hf

V, SEQ = 97, 24
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, eos_token_id=None, bos_token_id=None, pad_token_id=None)
# name -> (transformers config class, model class, fields beyond BASE)
CASES = {
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(num_hidden_layers=2, tie_word_embeddings=True,
                                                      use_sliding_window=False, sliding_window=4)),
    "qwen2_window": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(num_hidden_layers=3, use_sliding_window=True,
                                                             sliding_window=5, max_window_layers=1)),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(num_hidden_layers=2, head_dim=16)),
    "qwen3_mha_tied": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(num_hidden_layers=2, head_dim=8, num_key_value_heads=4,
                                                               tie_word_embeddings=True, rope_theta=1e6)),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(num_hidden_layers=2, sliding_window=5)),
    "mistral_global": (T.MistralConfig, T.MistralForCausalLM, dict(num_hidden_layers=2, sliding_window=None,
                                                                   tie_word_embeddings=True)),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(
        num_hidden_layers=3, head_dim=16, sliding_window=6, query_pre_attn_scalar=12, sliding_window_pattern=3,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "gemma3_untied": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(
        num_hidden_layers=4, head_dim=8, sliding_window=5, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
}
FAST = ("qwen2", "qwen3", "mistral", "gemma3")


def hf_model(name: str, seed: int = 0):
    cfg_cls, model_cls, extra = CASES[name]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**BASE, **extra})).eval()
    with torch.no_grad():   # norms at 1 (or Gemma's at 0) and zero biases would hide a swapped or dropped tensor
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p) + (1.0 if "gemma" not in name and "norm" in pname else 0.0))
    return model


@pytest.fixture(scope="module", params=[n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def loaded(request, tmp_path_factory):
    ref = hf_model(request.param)
    path = tmp_path_factory.mktemp("hf") / request.param
    ref.save_pretrained(path)
    model, params = hf.load(str(path))
    return request.param, ref, model, params


def _logits(model, params, tokens):
    return np.asarray(jax.jit(model.apply)(params, jnp.asarray(tokens, jnp.int32)))[..., :V]


def test_logits_match_transformers_and_save_is_read_back(loaded, tmp_path):
    name, ref, model, params = loaded
    assert_hf_logits_and_save(f"{name} windows {model.cfg.windows}", ref, model, params, tmp_path / "out", V, SEQ)


@pytest.mark.slow  # one compile of the cached decode per case: ~10 s each
def test_greedy_cached_generation_equals_transformers(loaded):
    name, ref, model, params = loaded
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, V, 7)]
    new = 12   # past every window here: the ring buffers wrap
    want = transformers_greedy(ref, prompt, new)
    got = model.generate(params, prompt, new, jax.random.key(0), temperature=0.0)
    assert got == want, (name, got, want)


def _eos_checkpoint(tmp_path, eos):
    """A tiny Qwen3 saved by transformers with ``eos`` as its generation config's ``eos_token_id``."""
    ref = hf_model("qwen3")
    ref.generation_config.eos_token_id = eos
    ref.save_pretrained(tmp_path)
    return ref


@pytest.mark.slow  # two compiles of the cached decode (the stop ids are compile-time constants): ~20 s
def test_generation_stops_at_the_checkpoints_eos_as_transformers_does(tmp_path):
    """transformers' ``generate`` stops at the generation config's ``eos_token_id`` (here a list, as Llama 3's):
    ``hf.load`` reads it into ``eos_token_ids`` and ``model.generate`` stops there too by default; ``eos_id=None``
    does not stop; ``hf.save`` writes the ids back."""
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, V, 7)]
    free = transformers_greedy(hf_model("qwen3"), prompt, 12)
    stop = next(i for i in range(2, 12) if free[i] not in free[:i])   # the first repeat-free token after two
    unused = next(t for t in range(V) if t not in free)
    ref = _eos_checkpoint(tmp_path / "ckpt", [unused, free[stop]])
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = want[0, len(prompt):].tolist()
    assert want == free[:stop + 1]   # transformers stopped at the eos
    model, params = hf.load(str(tmp_path / "ckpt"))
    assert model.cfg.eos_token_ids == (unused, free[stop])
    assert model.generate(params, prompt, 12, jax.random.key(0), temperature=0.0) == want
    assert model.generate(params, prompt, 12, jax.random.key(0), temperature=0.0, eos_id=None) == free
    hf.save(model, params, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == [unused, free[stop]]


def test_eos_is_read_from_generation_config_then_config_and_checked(tmp_path):
    """``hf.load``'s ``eos_token_ids``: the generation config's ``eos_token_id`` first (an id or a list), else
    config.json's; an id outside the vocabulary is refused naming the file; an override wins."""
    _eos_checkpoint(tmp_path, 5)
    assert hf.load(str(tmp_path))[0].cfg.eos_token_ids == (5,)
    assert hf.load(str(tmp_path), eos_token_ids=(7, 8))[0].cfg.eos_token_ids == (7, 8)
    (tmp_path / "generation_config.json").unlink()
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 3}))
    assert hf.load(str(tmp_path))[0].cfg.eos_token_ids == (3,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": V + 5}))
    with pytest.raises(ValueError, match=r"generation_config.json has eos_token_id=102"):
        hf.load(str(tmp_path))
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json' holds a JSON list"):
        hf.load(str(tmp_path))
    with pytest.raises(ValueError, match="eos_token_ids"):
        families.qwen3(vocab_size=V, eos_token_ids=(V,))
    assert families.qwen3(vocab_size=V, eos_token_ids=[np.int64(3)]).eos_token_ids == (3,)
    from jaxpar.models.hf.config import eos_token_ids   # a multimodal config: its text decoder's ids
    (tmp_path / "generation_config.json").unlink()
    assert eos_token_ids(str(tmp_path), {"text_config": {"eos_token_id": [20, 1]}}, V) == (20, 1)
    (tmp_path / "generation_config.json").write_text("[" * 100_000)
    with pytest.raises(ValueError, match="not a readable JSON file"):
        eos_token_ids(str(tmp_path), {}, V)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "generation_config.json").mkdir()               # not the config.json fallback: refused
    with pytest.raises(ValueError, match="generation_config.json' is not a readable JSON file"):
        eos_token_ids(str(tmp_path), {"eos_token_id": 1}, V)
    (tmp_path / "generation_config.json").rmdir()
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="eos_id='stop'"):
        model, params = hf.load(str(tmp_path), eos_token_ids=())
        model.generate(params, [1], 1, 0, eos_id="stop")


def test_family_configs_match_their_presets_and_refuse_bad_fields():
    g = families.gemma3(num_layers=8, sliding_window=16)
    assert g.windows == (16,) * 5 + (None,) + (16,) * 2
    kinds = g.layer_kinds()
    assert kinds[0].inv_freq is not None and kinds[5].inv_freq is None and kinds[0] == kinds[6]
    assert families.mistral(sliding_window=8, num_layers=3).windows == (8, 8, 8)
    assert families.qwen3().windows == () and families.qwen3().rope_theta == 1e6
    for bad, match in [(dict(family="gemma2"), "family"), (dict(windows=(4, None)), "one entry per layer"),
                       (dict(num_layers=2, windows=(4, 0)), r"windows\[1\]"),
                       (dict(query_pre_attn_scalar=-1.0), "query_pre_attn_scalar"),
                       (dict(rope_factor=0.0), "rope_factor")]:
        with pytest.raises(ValueError, match=match):
            FamilyConfig(**bad)


@pytest.mark.parametrize("field, value", [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                                          ("use_bidirectional_attention", True), ("attention_bias", True),
                                          ("hidden_activation", "gelu")])
def test_gemma3_fields_that_change_the_computation_are_refused(field, value):
    from jaxpar.models.hf.family_config import family_config
    hf_cfg = {"model_type": "gemma3_text", "vocab_size": V, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "sliding_window": 4, "query_pre_attn_scalar": 8}
    assert family_config(hf_cfg).windows == (4, 4)
    with pytest.raises(ValueError, match=field):
        family_config({**hf_cfg, field: value})


def test_qwen_window_beside_use_sliding_window_false_is_full_attention_and_rope_types_are_checked():
    from jaxpar.models.hf.family_config import family_config
    hf_cfg = {"model_type": "qwen2", "vocab_size": V, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": 4, "max_window_layers": 0,
              "layer_types": ["sliding_attention"] * 2}
    assert family_config({**hf_cfg, "use_sliding_window": False}).windows == ()
    assert family_config({**hf_cfg, "use_sliding_window": True}).windows == (4, 4)
    with pytest.raises(ValueError, match="yarn"):
        family_config({**hf_cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="attention_bias"):
        family_config({**hf_cfg, "model_type": "qwen3", "attention_bias": True})


def test_mistral_layer_types_that_window_some_layers_only_are_refused():
    """transformers' AutoModelForCausalLM reads a Mistral config with layer_types as a Ministral (windows on the
    sliding_attention layers only), MistralForCausalLM windows every layer: loading one as either would be a guess."""
    from jaxpar.models.hf.family_config import family_config
    hf_cfg = {"model_type": "mistral", "vocab_size": V, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": 4}
    assert family_config({**hf_cfg, "layer_types": ["sliding_attention"] * 2}).windows == (4, 4)
    with pytest.raises(ValueError, match="layer_types=.*Ministral"):
        family_config({**hf_cfg, "layer_types": ["full_attention", "sliding_attention"]})


def test_a_tied_checkpoint_storing_its_head_anyway_loads_when_the_head_is_the_embedding(tmp_path):
    """Some exporters write lm_head.weight beside tie_word_embeddings=true; transformers ties it (ignores the copy)."""
    from safetensors.numpy import save_file

    from jaxpar.models.hf.families import _hf_shapes
    from jaxpar.models.hf.family_config import family_hf_config
    cfg = families.qwen2(vocab_size=V, num_layers=1, num_heads=4, num_kv_heads=2, d_model=32, d_mlp=48,
                         max_seq_len=32, tie_embeddings=True)
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in _hf_shapes(cfg, "model.").items()}
    path, weights = str(tmp_path), str(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(family_hf_config(cfg)))
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}, weights)
    _, params = hf.load(path)
    np.testing.assert_array_equal(np.asarray(params["embed"]["embedding"])[:V], tensors["model.embed_tokens.weight"])
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1}, weights)
    with pytest.raises(ValueError, match="tie_word_embeddings=true .*'lm_head.weight', which differs"):
        hf.load(path)


@pytest.mark.slow  # transformers' vision tower: ~5 s
def test_gemma3_conditional_generation_loads_its_text_decoder_with_text_only(tmp_path):
    text = {**BASE, **CASES["gemma3"][2]}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    ref = T.Gemma3ForConditionalGeneration(T.Gemma3Config(text_config=text, vision_config=vision,
                                                           mm_tokens_per_image=4)).eval()
    ref.save_pretrained(tmp_path / "mm")
    with pytest.raises(ValueError, match="text_only=True"):
        hf.load(str(tmp_path / "mm"))
    model, params = hf.load(str(tmp_path / "mm"), text_only=True)
    tokens = np.random.default_rng(3).integers(0, V, (1, SEQ))
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(_logits(model, params, tokens), want, atol=1e-4, rtol=0)


def _trace(opt_state):
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
                if isinstance(s, optax.TraceState)).trace


@pytest.mark.slow   # a pipelined and a context-parallel step of each: ~60 s a family
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.parametrize("layout", ["pipe2_1f1b", "context2"])
def test_step_with_pipe_or_context_matches_single_device(family, layout, mesh_factory):
    """Qwen3 (4 layers), and Gemma 3's local (window 5 < 16 tokens) and global layers: a 1F1B pipeline of 2 stages
    (each Gemma stage's two layers one local, one global: the pattern repeats every stage) and the ring over
    context=2 (zigzag layout) reproduce the single-device float32 loss and gradients (per leaf 1e-5 relative)."""
    cfg = SMALL_GEMMA3 if family == "gemma3" else dataclasses.replace(SMALL_QWEN3, num_layers=4)
    model, tx = cfg.as_model(), optax.sgd(0.1, momentum=0.9)
    batch = gpt_batch(np.random.default_rng(4), 8, cfg)
    if layout == "pipe2_1f1b":
        grad_fn = jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, jp.pipeline.one_f_one_b(2, 4))
        mesh = mesh_factory(data=2, pipe=2, tensor=2)
        state = jp.train.init_state(model.init, tx, 5, mesh=mesh, pipeline=grad_fn)
    else:
        grad_fn, mesh = model.loss, mesh_factory(data=2, fsdp=2, context=2)
        state = jp.train.init_state(model.init, tx, 5, mesh=mesh)
    ref_params = jax.device_put(jax.device_get(jp.train.to_model_order(state).params), jax.devices()[0])
    (loss, _), grads = jax.jit(jax.value_and_grad(model.loss, has_aux=True))(ref_params, batch)
    new_state, metrics = jp.train.make_train_step(grad_fn, tx, mesh=mesh)(state, batch)
    assert_scalar_close(metrics["loss"], loss, what=f"{layout} loss")
    assert_tree_close(_trace(jp.train.to_model_order(new_state).opt_state), jax.device_get(grads),
                      what=f"{layout} grads")


def test_a_stage_whose_layers_do_not_repeat_the_pattern_is_refused():
    model = families.gemma3(num_layers=6, sliding_window=4, pattern=3, d_model=32, head_dim=8).as_model()
    x = jnp.zeros((1, 4, 32))
    blocks = jax.tree.map(lambda b: b.value[:2], model.init(jax.random.key(0))["blocks"],
                          is_leaf=lambda b: hasattr(b, "names"))
    with pytest.raises(ValueError, match="does not repeat every 2 layers"):
        jax.eval_shape(model.stage, blocks, x)


@pytest.mark.slow   # lowering two steps: ~10 s; the Llama's sibling is in the fast set (tests/test_fp8.py)
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_family_matmuls_are_fp8_in_the_lowered_program(family):
    from jaxpar.precision import fp8
    cfg = getattr(families, family)(vocab_size=61, num_layers=1, num_heads=4, num_kv_heads=2, d_model=32, d_mlp=64,
                                    head_dim=16, max_seq_len=16)
    model, tx = cfg.as_model(), optax.sgd(0.1)
    mesh = jp.make_mesh(data=1, devices=jax.devices()[:1])
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh, policy=jp.Policy.from_string("c=bf16,o=f32,dot=fp8"),
                                report=False)
    lowered = jp.train.make_train_step(model.loss, tx, mesh=mesh).lower(state, gpt_batch(np.random.default_rng(0), 2,
                                                                                         cfg))
    assert fp8.fp8_dot_counts(lowered) == {"e4m3 x e4m3": 7, "e5m2 x e4m3": 14}   # q, k, v, out, gate, up, down


@pytest.mark.slow   # ~5 s
@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_load_onto_a_2x2x2_mesh_is_the_single_device_load(name, tmp_path, mesh_factory):
    """Each device's block read by itself (biases and q/k norms included) equals the single-device load."""
    ref = hf_model(name)
    ref.save_pretrained(tmp_path / name)
    model, whole = hf.load(str(tmp_path / name))
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    _, sharded = hf.load(str(tmp_path / name), mesh=mesh)
    assert any(x.addressable_shards[0].data.shape != x.shape for x in jax.tree.leaves(sharded["blocks"]))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(sharded), jax.device_get(whole))
