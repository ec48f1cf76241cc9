"""fp8 on a mesh against one device: per-leaf gradient differences and the fp8 meta state, per recipe and mesh.

    python benchmarks/fp8_parity.py                     # the small Llama, bf16 / fp8 / fp8_current x 3 meshes (~2 min)
    python benchmarks/fp8_parity.py --precisions fp8 --meshes data=8
    python benchmarks/fp8_parity.py --model qwen3 --meshes 2x2x2   # or gemma3

The built-in Llama (2 layers, d=64, 8 query / 2 key-value heads, batch 16 x 16), or ``--model qwen3`` / ``gemma3``
at the same sizes (head 16; Qwen3's q/k norms; Gemma 3's local layer with a window of 5 beside a global one, q/k
norms, four norms a layer, GeGLU, ``query_pre_attn_scalar`` 12, scaled global rotary positions), takes two steps at
the same params (the optimizer records the gradient and changes nothing), on one device and on each mesh of
simulated CPU devices, with the same batch. Per step and mesh the JSON gives, per gradient leaf,
``max|got - ref| / max|ref|`` (the worst leaf first), the worst fp8 meta-state difference (``meta_max_abs``: 0 when
the amax histories and scales equal one device's exactly), the loss and its difference. Step 1 runs delayed
scaling at the initial scales (1: the histories are zeros); step 2 at the scales step 1 recorded, which is what
every later step looks like. The recipes run with bf16 compute around the fp8 dots; ``--precisions fp8_f32
fp8_current_f32`` with float32 compute (tensor parallelism's partial sums then differ by float32 ulps, not bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxpar as jp  # noqa: E402
from jaxpar.models import LlamaConfig, families  # noqa: E402

CFG = LlamaConfig(vocab_size=61, num_layers=2, num_heads=8, num_kv_heads=2, d_model=64, d_mlp=128, max_seq_len=16)
_SIZES = dict(vocab_size=61, num_layers=2, num_heads=8, num_kv_heads=2, d_model=64, d_mlp=128, head_dim=16,
              max_seq_len=16)
CONFIGS = {"llama": CFG, "qwen3": families.qwen3(**_SIZES),
           "gemma3": families.gemma3(sliding_window=5, pattern=2, query_pre_attn_scalar=12, rope_factor=4.0, **_SIZES)}
PRECISIONS = {"bf16": "p=f32,c=bf16,o=f32", "fp8": "p=f32,c=bf16,o=f32,dot=fp8",
              "fp8_current": "p=f32,c=bf16,o=f32,dot=fp8_current",
              # float32 compute around the fp8 dots: tensor parallelism's partial sums then differ by float32 ulps
              "fp8_f32": "p=f32,c=f32,o=f32,dot=fp8", "fp8_current_f32": "p=f32,c=f32,o=f32,dot=fp8_current"}
DEFAULT_PRECISIONS = ("bf16", "fp8", "fp8_current")
MESHES = {"data=8": dict(data=8), "fsdp=8": dict(fsdp=8), "2x2x2": dict(data=2, fsdp=2, tensor=2)}

# The optimizer state is the last gradient and the params stay put: every step differentiates at the same point.
RECORD = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                      lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def run(policy: str, mesh: jax.sharding.Mesh, batch: dict, steps: int, cfg=CFG) -> list[dict]:
    """Per step: the loss, the gradient (host arrays by leaf path) and the fp8 meta state after it."""
    model = cfg.as_model()
    state = jp.train.init_state(model.init, RECORD, 0, mesh=mesh, policy=jp.Policy.from_string(policy), report=False)
    step = jp.train.make_train_step(model.loss, RECORD, mesh=mesh)
    out = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        flat = lambda t: {jax.tree_util.keystr(p): np.asarray(x, np.float64)
                          for p, x in jax.tree_util.tree_flatten_with_path(jax.device_get(t))[0]}
        out.append({"loss": float(metrics["loss"]), "grads": flat(state.opt_state), "meta": flat(state.fp8)})
    return out


def rel(got: np.ndarray, ref: np.ndarray) -> float:
    scale = np.abs(ref).max()
    return float(np.abs(got - ref).max() / scale) if scale else float(np.abs(got).max())


def compare(got: dict, ref: dict) -> dict:
    leaves = sorted(((rel(got["grads"][k], r), k) for k, r in ref["grads"].items()), reverse=True)
    meta = max((float(np.abs(got["meta"][k] - r).max()) for k, r in ref["meta"].items()), default=None)
    return {"loss_ref": ref["loss"], "loss_diff": abs(got["loss"] - ref["loss"]), "meta_max_abs": meta,
            "worst_leaf": leaves[0][1], "worst_rel": leaves[0][0],
            "grad_rel": {k.replace("['", "").replace("']", "/").rstrip("/"): float(f"{e:.3g}") for e, k in leaves}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama", choices=CONFIGS)
    ap.add_argument("--precisions", nargs="+", default=list(DEFAULT_PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--meshes", nargs="+", default=list(MESHES), choices=MESHES)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = CONFIGS[args.model]
    rng = np.random.default_rng(args.seed)
    batch = {k: rng.integers(0, cfg.vocab_size, (args.batch, cfg.max_seq_len), dtype=np.int32)
             for k in ("inputs", "targets")}
    one = jp.make_mesh(data=1, devices=jax.devices()[:1])
    out = {"model": args.model, "config": repr(cfg), "batch": [args.batch, cfg.max_seq_len],
           "xla_flags": os.environ["XLA_FLAGS"], "results": {}}
    for p in args.precisions:
        ref = run(PRECISIONS[p], one, batch, args.steps, cfg)
        for m in args.meshes:
            got = run(PRECISIONS[p], jp.make_mesh(**MESHES[m]), batch, args.steps, cfg)
            out["results"][f"{p} {m}"] = {f"step{t + 1}": compare(g, r) for t, (g, r) in enumerate(zip(got, ref))}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
