"""Structured pruning and compaction of the families of jaxpar/models/families.py: Qwen2's q/k/v biases and
Qwen3's / Gemma 3's q/k norms beside grouped-query heads. The query heads' bias (``q_bias [layers, H, K]``,
logical names ``heads``) is pruned and compacted with its heads; the key/value biases (``kv_heads``) are never
pruned; the q/k norms (one ``[K]`` scale shared by every head) are kept whole. The compacted model computes what
the masked model computes, and the compacted Qwen2 / Gemma 3 load in ``transformers`` with the same logits.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxpar as jp
from jaxpar.models import families, hf

from helpers import gpt_batch, max_rel_err

from .test_compact import masked, masks_for
from .test_structured import random_params

CONFIGS = {
    "qwen2": families.qwen2(vocab_size=61, num_layers=2, num_heads=8, num_kv_heads=2, d_model=64, d_mlp=128,
                            max_seq_len=16),
    "gemma3": families.gemma3(vocab_size=61, num_layers=2, num_heads=8, num_kv_heads=2, d_model=64, d_mlp=128,
                              head_dim=16, max_seq_len=16, sliding_window=5, pattern=2, query_pre_attn_scalar=12),
}
pytestmark = pytest.mark.filterwarnings("ignore:the .* key/value heads are replicated")


@pytest.mark.slow   # two compiles of each model and transformers' load: ~15 s
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compacted_family_equals_masked_and_loads_in_transformers(name, np_rng, tmp_path):
    cfg = CONFIGS[name]
    names = jax.eval_shape(cfg.as_model().init, jax.random.key(0))
    params = random_params(names, seed=31)
    masks = masks_for(params, names, 0.5, "uniform")
    new_params, small = jp.pruning.compact(params, masks, cfg)
    assert (small.num_heads, small.num_kv_heads, small.head_dim) == (4, 2, cfg.head_dim)
    blocks = new_params["blocks"]
    if cfg.qkv_bias:   # q's bias keeps the kept heads' rows; k's and v's keep every key/value head
        assert blocks["q_bias"].shape == (2, 4, cfg.head_dim) and blocks["k_bias"].shape == (2, 2, cfg.head_dim)
        kept = np.asarray(masks["blocks"]["heads"], bool)
        np.testing.assert_array_equal(blocks["q_bias"], np.asarray(params["blocks"]["q_bias"])[kept].reshape(2, 4, -1))
    if cfg.architecture.qk_norm:
        np.testing.assert_array_equal(blocks["q_norm_scale"], params["blocks"]["q_norm_scale"])
    tokens = gpt_batch(np_rng, 3, cfg)["inputs"]
    ref = np.asarray(cfg.as_model().apply(masked(jax.device_get(params), names, masks,
                                                 {"blocks": {("blocks",)}}), tokens))[..., :61]
    got = np.asarray(small.as_model().apply(jax.device_get(new_params), tokens))[..., :61]
    assert max_rel_err(got, ref) <= 1e-5 and np.abs(ref).max() > 0.1

    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf.save(small.as_model(), new_params, str(tmp_path / "hf"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        want = back(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert max_rel_err(got, want) <= 1e-5
