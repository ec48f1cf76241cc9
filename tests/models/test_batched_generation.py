"""Batched generation with the KV cache (jaxpar/models/generation.py ``generate_batch``, ``model.generate`` with a
list of prompts): greedy decoding of left-padded prompts of lengths 3, 17, 40 and 64 equals the argmax of a
whole-window forward pass (``apply``, no cache) token by token, for the GPT (learned positions) and the Llama
(rotary, GQA), also under tensor=2; eos stops a row; top-k / top-p filter as transformers' warpers do (written
out here in numpy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig, Llama, LlamaConfig
from jaxpar.models.generation import sample_logits

MODELS = {
    "gpt": GPT(GPTConfig(vocab_size=61, num_layers=2, num_heads=4, d_model=64, max_seq_len=128)),
    "llama": Llama(LlamaConfig(vocab_size=61, num_layers=2, num_heads=4, num_kv_heads=2, d_model=64, d_mlp=128,
                               max_seq_len=128, rope_theta=500000.0)),
}
LENGTHS = (3, 17, 40, 64)
NEW = 64


def _params(model, seed=0):
    params = jax.tree.map(lambda b: b.value, model.init(jax.random.key(seed)), is_leaf=lambda b: hasattr(b, "names"))
    return jax.tree.map(lambda a: a * 8 if a.ndim >= 2 else a, params)    # sharper logits: fewer near-ties


def _greedy_reference(model, params, prompt, n):
    """Token by token: argmax of apply over the whole (right-padded, so one compile) window at the last position."""
    fwd = jax.jit(model.apply)
    ctx, out = list(prompt), []
    for _ in range(n):
        window = np.zeros((1, model.cfg.max_seq_len), np.int32)
        window[0, :len(ctx)] = ctx
        t = int(np.argmax(np.asarray(fwd(params, jnp.asarray(window)))[0, len(ctx) - 1, :model.cfg.vocab_size]))
        out.append(t)
        ctx.append(t)
    return out


@pytest.fixture(scope="module")
def references():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 61, n).tolist() for n in LENGTHS]
    out = {}
    for name, model in MODELS.items():
        params = _params(model)
        out[name] = (params, prompts, [_greedy_reference(model, params, p, NEW) for p in prompts])
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_batched_cache_decoding_equals_whole_window_argmax(name, references):
    params, prompts, want = references[name]
    got = MODELS[name].generate(params, prompts, NEW, jax.random.key(0), temperature=0)
    for n, g, w in zip(LENGTHS, got, want):
        assert g == w, f"{name}, prompt length {n}: first difference at {next(i for i in range(NEW) if g[i] != w[i])}"


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_batched_decoding_under_tensor_parallelism(name, references, mesh_factory):
    params, prompts, want = references[name]
    mesh = mesh_factory(data=1, tensor=2)
    model = MODELS[name]
    shardings = jp.sharding.named_shardings(model.init(jax.random.key(0)), mesh)
    sharded = jax.device_put(params, shardings)
    assert sharded["blocks"]["out_kernel"].sharding.spec[1] == "tensor"
    with jp.sharding.use(mesh):
        got = model.generate(sharded, prompts, NEW, 0, temperature=0)
    assert got == want


def test_eos_stops_each_row_and_is_kept(references):
    params, prompts, want = references["gpt"]
    eos = want[1][5]           # the 6th greedy token of row 1
    got = MODELS["gpt"].generate(params, prompts, NEW, 0, temperature=0, eos_id=eos)
    for g, w in zip(got, want):
        cut = w.index(eos) + 1 if eos in w else NEW
        assert g == w[:cut]
    assert len(got[1]) <= 6


def _warped_reference(z, top_k, top_p):
    """transformers' TopKLogitsWarper then TopPLogitsWarper, written out in numpy: the kept token ids per row."""
    keep = []
    for row in z:
        allowed = np.ones_like(row, bool)
        if top_k is not None:
            allowed &= row >= np.sort(row)[-top_k]
        r = np.where(allowed, row, -np.inf)
        order = np.argsort(r)                       # ascending, as the HF warper sorts
        p = np.exp(r[order] - r[order].max())
        p /= p.sum()
        removed = np.cumsum(p) <= 1 - top_p if top_p is not None else np.zeros_like(p, bool)
        removed[-1] = False                         # keep at least one
        kept = np.zeros_like(allowed)
        kept[order[~removed]] = True
        keep.append(set(np.flatnonzero(kept & allowed).tolist()))
    return keep


@pytest.mark.parametrize("top_k,top_p", [(5, None), (None, 0.6), (7, 0.8), (None, 1.0)])
def test_top_k_top_p_draw_only_what_the_warpers_keep(top_k, top_p):
    z = np.random.default_rng(3).normal(size=(4, 50)).astype(np.float32) * 2
    keep = _warped_reference(z, top_k, top_p)
    seen = [set() for _ in z]
    draw = jax.jit(lambda k: sample_logits(jnp.asarray(z), k, 1.0, top_k, top_p))
    for i in range(300):
        for r, t in enumerate(np.asarray(draw(jax.random.key(i)))):
            seen[r].add(int(t))
    for r in range(len(z)):
        assert seen[r] <= keep[r], (r, seen[r] - keep[r])
        assert len(seen[r]) >= min(len(keep[r]), 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[1, 2], []]), r"prompts\[1\]"),
    (dict(prompts=[[1, 99]]), r"prompts\[0\].*\[0, 61\)"),
    (dict(max_new_tokens=120), "exceeds max_seq_len=128"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=1.5), "top_p"),
    (dict(eos_id=61), "eos_id"),
])
def test_bad_generation_arguments_are_clear_errors(kwargs, match, references):
    params, _, _ = references["llama"]
    args = dict(prompts=[[1, 2, 3], [4] * 20], max_new_tokens=4, temperature=0.0) | kwargs
    with pytest.raises(ValueError, match=match):
        MODELS["llama"].generate(params, args.pop("prompts"), args.pop("max_new_tokens"), 0, **args)
