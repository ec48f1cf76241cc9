"""Expert pruning on the main job's corpus: a mixture of experts trained, pruned 8 -> 6 experts, compacted, recovered.

    python benchmarks/moe_prune.py                      # see benchmarks/README.md for the time it takes
    python benchmarks/moe_prune.py --steps 4 --finetune-steps 2 --d-model 32 --num-layers 1 --seq-len 16 \\
        --batch-size 8 --expert-d-mlp 16 --eval-batches 1 --rounds 1            # smoke test

experiments/charlm.py's ``--model moe`` (a Llama whose MLPs are ``--experts`` routed SwiGLU experts of width
``--expert-d-mlp``, top-``--experts-per-token`` softmax routing, dropless, no balancing) trained ``--steps`` steps on
charlm's corpus (CPython's ``pydoc_data.topics`` characters) on 8 simulated devices (data parallel), with AdamW
scheduled (warm-up + cosine) over ``--steps + --finetune-steps``. Then, in every layer, the ``--experts - --keep``
experts with the lowest router load measured on ``--load-batches`` training batches are removed
(``jp.pruning.measure_expert_load``, ``select_experts``), the state compacted (``jp.pruning.compact_state``:
expert weights, router columns, router state and Adam's moments) and trained on for ``--finetune-steps`` steps
with the same schedule. Beside it, the unpruned model trained the same ``--steps + --finetune-steps`` steps, and the
pruned model chosen by weight norm instead of load (pruned, not fine-tuned).

Rows (validation loss, nats/character, over ``--eval-batches`` batches): before pruning; right after pruning
(compacted; checked equal to the unpruned model whose router never selects the removed experts, its selection bias
at -inf); after recovery; the unpruned model at the same step. The stated gap: after recovery the pruned model's
loss is within ``--gap`` (relative, default 2%) of the unpruned model's at the same step (``within_gap``).
Speed: the median ms of a train step of the 8- and the 6-expert model (and an eval step), timed side by side in
interleaved rounds on one device (``benchmarks/compact.py``'s ``step_times``), and their ratio. The parameter count
falls by the removed experts; the FLOPs per token do not (each token still runs ``k`` experts): what the step saves
is what grows with the expert count (the grouped matmul's lowering, the router, the optimizer update).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxpar as jp  # noqa: E402
import charlm  # noqa: E402  (experiments/charlm.py: its Config builds the model)
from compact import step_times  # noqa: E402  (benchmarks/compact.py: interleaved step timing)
from jaxpar.cli import experiment  # noqa: E402


def val_loss(model, state, mesh, rules, batches) -> float:
    evaluate = jp.train.make_eval_step(model.loss, mesh=mesh, rules=rules)
    return jp.loop.mean_metrics(evaluate, state, batches)["loss"]


def train(step, state, corpus, cfg, start: int, stop: int, label: str):
    for t in range(start, stop):
        state, metrics = step(state, corpus.batch(cfg.seed, t, cfg.batch_size, cfg.seq_len))
        if (t + 1) % 50 == 0 or t + 1 == stop:
            print(f"{label} step {t + 1}: loss {float(metrics['loss']):.4f}", file=sys.stderr, flush=True)
    return state


def masked_state(state, masks):
    """The unpruned state whose router never selects the removed experts: their selection bias at -inf, in the
    aux-free mode (a stored rate > 0: a bias with rate 0 is refused; an evaluation never updates it)."""
    router = state.carried["blocks"]["moe_router"]
    bias = jnp.where(masks["blocks"]["experts"], router["bias"], -jnp.inf)
    router = {**router, "bias": bias, "rate": jnp.full_like(router["rate"], 1e-3)}
    return state.replace(carried={**state.carried, "blocks": {**state.carried["blocks"], "moe_router": router}})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps before pruning")
    ap.add_argument("--finetune-steps", type=int, default=150, help="steps after pruning (recovery)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--keep", type=int, default=6, help="experts each layer keeps")
    ap.add_argument("--experts-per-token", type=int, default=2)
    ap.add_argument("--expert-d-mlp", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--load-batches", type=int, default=8, help="training batches the router load is measured on")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds")
    ap.add_argument("--gap", type=float, default=0.02, help="stated relative gap after recovery")
    args = ap.parse_args(argv)
    total = args.steps + args.finetune_steps
    cfg = charlm.Config(model="moe", steps=total, d_model=args.d_model, num_layers=args.num_layers,
                        num_heads=args.num_heads, seq_len=args.seq_len, batch_size=args.batch_size, sample_chars=1,
                        mesh=experiment.MeshConfig(data=-1, fsdp=1, tensor=1),
                        moe=charlm.ExpertsConfig(experts=args.experts, experts_per_token=args.experts_per_token,
                                                 expert_d_mlp=args.expert_d_mlp))
    corpus = jp.data.CharCorpus.load(None)
    mesh = cfg.mesh.make()
    rules = cfg.rules(mesh)
    model = cfg.build_model(corpus.vocab_size)
    names = jax.eval_shape(model.init, jax.random.key(0))
    tx = cfg.optimizer(names)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, rules=rules, donate=False)
    val = [corpus.batch(cfg.seed, i, cfg.batch_size, cfg.seq_len, "val") for i in range(args.eval_batches)]
    start = time.perf_counter()
    state = jp.train.init_state(model.init, tx, jax.random.key(cfg.seed), mesh=mesh, rules=rules)
    state = train(step, state, corpus, cfg, 0, args.steps, f"{args.experts} experts")
    before = val_loss(model, state, mesh, rules, val)

    fit = [corpus.batch(cfg.seed + 1, i, cfg.batch_size, cfg.seq_len) for i in range(args.load_batches)]
    params = jp.train.carried.merge(jax.device_get(state.params), jax.device_get(state.carried))
    load = jp.pruning.measure_expert_load(model.loss, params, fit)
    masks = jp.pruning.select_experts(state.params, names, args.keep, load=load)
    small_state, small_cfg = jp.pruning.compact_state(state, model.cfg, tx, mesh=mesh, rules=rules, masks=masks)
    small = type(model)(small_cfg)
    small_step = jp.train.make_train_step(small.loss, tx, mesh=mesh, rules=rules, donate=False)
    pruned = val_loss(small, small_state, mesh, rules, val)
    masked = val_loss(model, masked_state(state, masks), mesh, rules, val)
    by_norm = jp.pruning.select_experts(state.params, names, args.keep, by="norm")
    norm_state, _ = jp.pruning.compact_state(state, model.cfg, tx, mesh=mesh, rules=rules, masks=by_norm)
    pruned_by_norm = val_loss(small, norm_state, mesh, rules, val)

    recovered_state = train(small_step, small_state, corpus, cfg, args.steps, total, f"{args.keep} experts")
    recovered = val_loss(small, recovered_state, mesh, rules, val)
    dense_state = train(step, state, corpus, cfg, args.steps, total, f"{args.experts} experts")
    unpruned = val_loss(model, dense_state, mesh, rules, val)
    wall = time.perf_counter() - start

    counts = np.asarray(load["blocks"]["moe_router"]["load"])
    kept = masks["blocks"]["experts"]
    timing = argparse.Namespace(steps=total, batch=args.batch_size, seq=args.seq_len, rounds=args.rounds)
    one = jp.make_mesh(data=1, devices=jax.devices()[:1])
    times = step_times(timing, {f"{args.experts} experts": (model, tx, dense_state),
                                f"{args.keep} experts": (small, tx, recovered_state)}, one, corpus)
    a, b = times[f"{args.experts} experts"], times[f"{args.keep} experts"]
    out = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "devices": jax.device_count(),
           "cpu_load_1min": round(os.getloadavg()[0], 1), "args": vars(args),
           "model": {"params": model.cfg.num_params(), "active_params": model.cfg.active_params(),
                     "pruned_params": small_cfg.num_params(), "pruned_active_params": small_cfg.active_params()},
           "load_share_removed": round(float(counts[~kept].sum() / counts.sum()), 4),
           "removed_experts": [np.flatnonzero(~row).tolist() for row in kept],
           "val_loss": {"before_pruning": round(before, 4), "pruned_by_load": round(pruned, 4),
                        "pruned_by_norm": round(pruned_by_norm, 4),
                        "after_recovery": round(recovered, 4), "unpruned_same_steps": round(unpruned, 4)},
           "compacted_equals_masked": abs(pruned - masked) <= 1e-5 * abs(masked),
           "gap_after_recovery": round((recovered - unpruned) / unpruned, 4), "stated_gap": args.gap,
           "recovered_vs_before_pruning": round((recovered - before) / before, 4),
           "within_gap": bool((recovered - unpruned) / unpruned <= args.gap),
           "step_ms_1_device": times,
           "speedup": {k: round(a[k] / b[k], 3) for k in a}, "wall_s": round(wall, 1)}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
