"""Load balance of a mixture of experts on the main job's corpus: no balancing, the auxiliary loss, the aux-free bias.

    python benchmarks/moe_load.py                       # 300 steps x 5 runs (see benchmarks/README.md for the time)
    python benchmarks/moe_load.py --steps 5 --d-model 32 --num-layers 1 --seq-len 16 --batch-size 8   # smoke test

experiments/charlm.py's ``--model moe`` (a Llama whose MLPs are ``--experts`` routed SwiGLU experts of width
``--expert-d-mlp``, top-``--experts-per-token``, dropless) trained ``--steps`` steps on charlm's corpus (CPython's
``pydoc_data.topics`` characters), same seed and batches, in one process, once per mode:

* ``none``: the router alone (no balancing);
* ``aux_loss``: the Switch/GShard auxiliary loss ``E * sum_i f_i * P_i`` at weight ``--load-balance-coef`` (1e-2);
* ``aux_free_bias``: DeepSeek-V3's selection bias, ``b_i += gamma * sign(mean load - load_i)`` after each step,
  ``gamma = --bias-update-rate`` (1e-3; arXiv 2412.19437 sec. 2.1.2, Wang et al. 2024 arXiv 2408.15664);
* ``capacity``: no balancing, GShard capacity mode (``--capacity-factor`` 1.25: ``ceil(1.25 L k / E)`` choices
  per expert per sequence, the rest dropped), reporting the dropped fraction;

and the dense Llama of the same active parameters (one SwiGLU of width ``d_mlp = k * F_e``) beside them. Each row:
max/mean expert load (``max_i load_i / mean load`` per layer, mean over layers; 1 is perfect balance) over the last
50 steps and over the whole run, the final validation loss (nats/character, ``--eval-batches`` batches), the
dropped fraction and the wall time. The load is read each step from the state's carried router counts
(``jp.metrics.expert_load_metrics``), and every step of every dropless run is checked: in each layer the expert
counts add up to tokens x k and nothing is dropped (the script stops with an AssertionError otherwise). The plot
(``<out-dir>/moe_load.png``) draws each expert's share of the choices over training, one panel per mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxpar as jp  # noqa: E402
import charlm  # noqa: E402  (experiments/charlm.py: its Config builds the model)
from jaxpar.cli import experiment  # noqa: E402

LAST = 50   # steps the "last" load figure averages over


def modes(args) -> dict[str, dict]:
    """The MoE runs: name -> charlm's expert flags besides the shared ones."""
    return {"none": {}, "aux_loss": {"load_balance_coef": args.load_balance_coef},
            "aux_free_bias": {"bias_update_rate": args.bias_update_rate},
            "capacity": {"capacity_factor": args.capacity_factor}}


def run(cfg: charlm.Config, corpus, mesh, eval_batches: int, check_dropless: bool) -> dict:
    """Trains ``cfg``'s model for ``cfg.steps`` steps; returns its metrics rows, final validation loss, wall time
    and, for a MoE, the per-step expert load (asserting the dropless counts when ``check_dropless``)."""
    model = cfg.build_model(corpus.vocab_size)
    rules = cfg.rules(mesh)
    tx = cfg.optimizer(jax.eval_shape(model.init, jax.random.key(0)))
    state = jp.train.init_state(model.init, tx, jax.random.key(cfg.seed), mesh=mesh, rules=rules)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, rules=rules)
    eval_step = jp.train.make_eval_step(model.loss, mesh=mesh, rules=rules)
    load = jax.jit(lambda carried: jp.metrics.expert_load_metrics(carried, per_layer=True))
    choices = cfg.batch_size * cfg.seq_len * cfg.moe.experts_per_token   # tokens x k per layer and step
    rows, start = [], time.perf_counter()
    for t in range(cfg.steps):
        state, metrics = step(state, corpus.batch(cfg.seed, t, cfg.batch_size, cfg.seq_len))
        row = {"step": t + 1, **{k: float(v) for k, v in jax.device_get({**load(state.carried), **metrics}).items()}}
        if check_dropless:
            per_layer = {k: v for k, v in row.items() if k.startswith("moe_choices_l")}
            assert per_layer and all(v == choices for v in per_layer.values()), \
                f"step {t + 1}: routed choices per layer {per_layer}, expected tokens x k = {choices}"
            assert row["moe_dropped_fraction"] == 0.0, f"step {t + 1}: dropless run dropped {row}"
        rows.append(row)
    wall = time.perf_counter() - start
    val = [corpus.batch(cfg.seed, i, cfg.batch_size, cfg.seq_len, "val") for i in range(eval_batches)]
    return {"rows": rows, "val_loss": jp.loop.mean_metrics(eval_step, state, val)["loss"], "wall_s": wall,
            "params": model.cfg.num_params(), "active_params": model.cfg.active_params()}


def summary(result: dict) -> dict:
    """A run's row of the table."""
    rows = result["rows"]
    out = {"val_loss": round(result["val_loss"], 4), "params": result["params"],
           "active_params": result["active_params"], "wall_s": round(result["wall_s"], 1)}
    if "max_mean_load" in rows[0]:
        out["max_mean_load_last"] = round(float(np.mean([r["max_mean_load"] for r in rows[-LAST:]])), 3)
        out["max_mean_load_train"] = round(float(np.mean([r["max_mean_load"] for r in rows])), 3)
        out["max_mean_load_final"] = round(rows[-1]["max_mean_load"], 3)
        out["dropped_fraction"] = round(float(np.mean([r["moe_dropped_fraction"] for r in rows])), 4)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--experts-per-token", type=int, default=2)
    ap.add_argument("--expert-d-mlp", type=int, default=128, help="F_e; the dense model's d_mlp is k * F_e")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--load-balance-coef", type=float, default=1e-2)
    ap.add_argument("--bias-update-rate", type=float, default=1e-3)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--modes", nargs="+", default=["none", "aux_loss", "aux_free_bias", "capacity", "dense"])
    ap.add_argument("--out-dir", default="runs/moe_load", help="where the plot and the metrics rows are written")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.modes) - {*modes(args), "dense"})
    if unknown:
        raise SystemExit(f"--modes {unknown}: use some of {[*modes(args), 'dense']}")
    shared = dict(steps=args.steps, d_model=args.d_model, num_layers=args.num_layers, num_heads=args.num_heads,
                  seq_len=args.seq_len, batch_size=args.batch_size, sample_chars=1,
                  mesh=experiment.MeshConfig(data=-1, fsdp=1, tensor=1))
    experts = charlm.ExpertsConfig(experts=args.experts, experts_per_token=args.experts_per_token,
                                   expert_d_mlp=args.expert_d_mlp)
    corpus = jp.data.CharCorpus.load(None)
    mesh = shared["mesh"].make()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.modes:
        if name == "dense":
            cfg = charlm.Config(model="llama", d_mlp=args.experts_per_token * args.expert_d_mlp, **shared)
        else:
            cfg = charlm.Config(model="moe", moe=dataclasses.replace(experts, **modes(args)[name]), **shared)
        results[name] = run(cfg, corpus, mesh, args.eval_batches, check_dropless=name not in ("dense", "capacity"))
        with open(out_dir / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results[name]["rows"])
    moe_runs = {n: r["rows"] for n, r in results.items() if n != "dense"}
    plot = jp.plot.expert_load(moe_runs, out_dir / "moe_load.png",
                               title=f"expert load, {args.experts} experts top-{args.experts_per_token}") \
        if moe_runs else None
    dropless = [n for n in moe_runs if n != "capacity"]
    out = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "devices": jax.device_count(),
           "cpu_load_1min": round(os.getloadavg()[0], 1), "args": vars(args),
           "rows": {n: summary(r) for n, r in results.items()},
           "dropless_check": {"runs": dropless, "steps_each": args.steps, "layers": args.num_layers,
                              "choices_per_layer_and_step": args.batch_size * args.seq_len * args.experts_per_token,
                              "all_equal_and_nothing_dropped": True},   # run() asserted it on every step
           "plot": str(plot) if plot else None}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
