"""Batched KV-cache generation against re-running the whole window for every new token, side by side.

Both decode greedily (``temperature=0``) from the same params and prompts (the same tokens until a near-tie of two
logits, which float32 rounding may break either way; the first difference per row is reported); the
whole-window baseline is one jitted ``apply`` over a fixed, right-padded window per token (one compile), the way
a model without a cache generates. Prints one JSON object: seconds per generated token of each and their ratio.

  python benchmarks/kv_cache.py                 # Llama and GPT, batch 4, 256 new tokens
  python benchmarks/kv_cache.py --tiny          # seconds, for the tests
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.models import GPT, GPTConfig, Llama, LlamaConfig


def _models(tiny: bool, max_len: int):
    d, layers = (32, 1) if tiny else (256, 4)
    return {"llama": Llama(LlamaConfig(vocab_size=256, num_layers=layers, num_heads=4, num_kv_heads=2, d_model=d,
                                       max_seq_len=max_len)),
            "gpt": GPT(GPTConfig(vocab_size=256, num_layers=layers, num_heads=4, d_model=d, max_seq_len=max_len))}


def _whole_window(model, params, prompts, n):
    fwd = jax.jit(model.apply)
    L = model.cfg.max_seq_len
    ctx = [list(p) for p in prompts]
    for _ in range(n):
        # the same batch as the cache path: every row right-padded to the window, read at its own last position
        window = np.zeros((len(ctx), L), np.int32)
        for r, c in enumerate(ctx):
            window[r, :len(c)] = c
        logits = np.asarray(fwd(params, jnp.asarray(window)))
        for r, c in enumerate(ctx):
            c.append(int(np.argmax(logits[r, len(c) - 1, :model.cfg.vocab_size])))
    return [c[len(p):] for c, p in zip(ctx, prompts)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    new = 8 if args.tiny else args.new_tokens
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 17, 40, 64)]
    rows = {}
    for name, model in _models(args.tiny, 64 + new).items():
        params = jax.tree.map(lambda b: b.value, model.init(jax.random.key(0)), is_leaf=lambda b: hasattr(b, "names"))
        params = jax.tree.map(lambda a: a * 8 if a.ndim >= 2 else a, params)
        model.generate(params, prompts, new, 0, temperature=0)          # compile
        _whole_window(model, params, prompts, 1)
        t0 = time.perf_counter()
        cached = model.generate(params, prompts, new, 0, temperature=0)
        t_cache = time.perf_counter() - t0
        t0 = time.perf_counter()
        window = _whole_window(model, params, prompts, new)
        t_window = time.perf_counter() - t0
        rows[name] = {"cache_s_per_token": t_cache / new, "window_s_per_token": t_window / new,
                      "speedup": t_window / t_cache,
                      # greedy tokens agree until a near-tie of two logits, which the two computation orders (float32
                      # rounding) may break either way: the first row difference, per row (None: all the same)
                      "first_difference": [next((i for i, (a, b) in enumerate(zip(c, w)) if a != b), None)
                                           for c, w in zip(cached, window)]}
    report = {"batch": len(prompts), "prompt_lengths": [len(p) for p in prompts], "new_tokens": new,
              "backend": jax.default_backend(), "models": rows}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
