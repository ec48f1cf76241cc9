"""Sliding-window attention: the FLOPs of a compiled training step against the window.

    python benchmarks/sliding_window.py [--seq 2048] [--windows 1024 256 64 0] [--layers 2] [--d-model 128]
                                        [--heads 4] [--backends blocked xla]

A GPT-shaped model written here (learned positions, pre-LayerNorm blocks of attention and a GELU MLP of width
``4 * d_model``, tied unembedding, batch 1) whose attention is ``jaxpar.layers.attention.BACKENDS[backend]``
with ``window=`` (0 on the command line: None, full causal). Its loss and gradients are compiled on the CPU
(never run) and the HLO reader (``jp.plan.hlo.analyze``: dot FLOPs, loops by trip count) counts the step's
FLOPs; the attention FLOPs are those minus the FLOPs of the same step with attention replaced by passing the
values through (the scores, their softmax products and their gradients, every layer). One JSON row per backend
and window, with the ratio to full causal attention of the same backend and the scores the ``"blocked"`` kernel
computes per head (``jaxpar.layers.sliding_window.keys_computed``, masked ones included) beside the scores the
window leaves visible.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the CPU's compiled HLO is what is counted

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxpar as jp  # noqa: E402
from jaxpar.layers import attention, sliding_window  # noqa: E402
from jaxpar.layers.losses import cross_entropy  # noqa: E402
from jaxpar.layers.norms import gelu, layer_norm  # noqa: E402

VOCAB = 128


def init(rng: np.random.Generator, layers: int, d_model: int, seq: int) -> dict:
    normal = lambda *shape: jnp.asarray(rng.normal(scale=0.02, size=shape), jnp.float32)
    block = lambda: {"qkv": normal(d_model, 3 * d_model), "out": normal(d_model, d_model),
                     "up": normal(d_model, 4 * d_model), "down": normal(4 * d_model, d_model),
                     "ln1": jnp.ones(d_model), "ln2": jnp.ones(d_model)}
    return {"embed": normal(VOCAB, d_model), "pos": normal(seq, d_model), "blocks": [block() for _ in range(layers)]}


def loss_fn(params: dict, tokens_BL: jax.Array, *, heads: int, backend: str | None, window: int | None) -> jax.Array:
    """Next-token cross-entropy; ``backend=None`` replaces attention by the values (the FLOPs baseline)."""
    B, L = tokens_BL.shape
    x = params["embed"][tokens_BL] + params["pos"][:L]
    D = x.shape[-1]
    for p in params["blocks"]:
        h = layer_norm(x, p["ln1"], jnp.zeros(D))
        q, k, v = (t.reshape(B, L, heads, D // heads) for t in jnp.split(h @ p["qkv"], 3, axis=-1))
        a = v if backend is None else attention.BACKENDS[backend](q, k, v, None, num_blocks=2, window=window)
        x = x + a.reshape(B, L, D) @ p["out"]
        x = x + gelu(layer_norm(x, p["ln2"], jnp.zeros(D)) @ p["up"]) @ p["down"]
    return cross_entropy(x[:, :-1] @ params["embed"].T, tokens_BL[:, 1:]).mean()


def step_flops(params: dict, tokens: jax.Array, heads: int, backend: str | None, window: int | None) -> float:
    """FLOPs of the compiled loss-and-gradients step (HLO reader; compiled, never run)."""
    step = jax.jit(jax.value_and_grad(lambda p, t: loss_fn(p, t, heads=heads, backend=backend, window=window)))
    return jp.plan.hlo.analyze(step.lower(params, tokens).compile().as_text(), {}).flops


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 1024, 256, 64], help="0: full causal attention")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--backends", nargs="+", default=["blocked", "xla"], choices=list(attention.ONE_DEVICE[:2]))
    args = ap.parse_args(argv)
    params = init(np.random.default_rng(0), args.layers, args.d_model, args.seq)
    tokens = jnp.zeros((1, args.seq), jnp.int32)
    base = step_flops(params, tokens, args.heads, None, None)
    windows = [w or None for w in args.windows]
    visible = lambda w: sum(min(i + 1, w or args.seq) for i in range(args.seq))   # per head: j <= i, i - j < w
    rows = []
    for backend in args.backends:
        full = step_flops(params, tokens, args.heads, backend, None) - base
        for w in windows:
            attn = full if w is None else step_flops(params, tokens, args.heads, backend, w) - base
            rows.append({"backend": backend, "seq": args.seq, "window": w, "attention_flops": attn,
                         "ratio_to_full": attn / full, "step_flops": attn + base,
                         "blocked_scores_per_head": sliding_window.keys_computed(args.seq, 2, w),
                         "visible_scores_per_head": visible(w), "layers": args.layers, "d_model": args.d_model,
                         "heads": args.heads, "device": jax.devices()[0].device_kind})
            print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
