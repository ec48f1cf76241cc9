"""jaxpar's train step against a hand-written ``jax.jit`` + ``NamedSharding`` step of the same model.

    python benchmarks/overhead.py [--pairs 10] [--steps 2] [--layouts data=8 fsdp=8 2x2x2]

The hand-written step is what a user of Flax's logical partitioning writes without jaxpar: parameter shardings
from ``nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_params), mesh, rules)``, the optimizer state
from ``jax.jit(tx.init)`` on the sharded params (shardings left to the compiler), the batch as
``NamedSharding(mesh, P(("data", "fsdp")))``, and one ``jax.jit(..., donate_argnums=...)`` of
``value_and_grad`` + ``tx.update`` + ``optax.apply_updates`` traced under ``jax.set_mesh`` and the same rules
(the GPT's activation constraints read them). Model: the main job's GPT (``--layers``, ``--d-model``, batch
``--batch`` x ``--seq``), optimizer ``jp.optim.adamw``.

Per layout (``data=8``, ``fsdp=8``, ``data=2 x fsdp=2 x tensor=2`` on 8 simulated CPU devices) the JSON gives:

* ``same_outputs``: from the same initial state and batch, the max relative difference of loss, grad norm and
  every leaf of the updated params and optimizer state (float32; reduction orders may differ slightly);
* ``cost``: ``compiled.cost_analysis()`` FLOPs and bytes accessed of both programs, and their ratio;
* ``collectives``: the count of each collective kind in both compiled HLO texts (``all-reduce``,
  ``all-gather``, ``reduce-scatter``, ``collective-permute``, ``all-to-all``; async ``-start`` forms counted
  once);
* ``hand_written_naive_opt_init``: the collectives, cost and argument bytes of the hand-written step whose
  optimizer state comes from a plain ``jax.jit(tx.init)`` (replicated moments), beside jaxpar's arguments;
* ``time``: ``--pairs`` interleaved pairs (each implementation runs ``--steps`` steps, the order alternating
  from pair to pair); the per-pair ratio jaxpar / hand-written of the mean step time, its median and
  interquartile range (25th-75th percentile), and the median ms/step of each.

Each step is waited for before the next is dispatched (XLA:CPU's collectives abort when many steps queue on a
busy machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxpar as jp  # noqa: E402
from jaxpar._hlo import collective_counts  # noqa: E402
from jaxpar.models import GPT, GPTConfig  # noqa: E402

LAYOUTS = {"data=8": dict(data=8), "fsdp=8": dict(data=1, fsdp=8), "2x2x2": dict(data=2, fsdp=2, tensor=2)}


def cost(compiled) -> dict[str, float]:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return {"flops": float(c.get("flops", 0.0)), "bytes_accessed": float(c.get("bytes accessed", 0.0))}


def hand_written(model: GPT, tx, mesh, rules, params_host, naive_init: bool = False):
    """``(step, params, opt_state)``: the plain jax.jit + NamedSharding step and its sharded state.

    The optimizer state takes its params' shardings through ``optax.tree_map_params`` (other leaves
    replicated); ``naive_init``: ``jax.jit(tx.init)`` decides instead (it replicates Adam's moments: zeros
    carry no sharding), which the JSON shows as the cost of not placing the optimizer state.
    """
    boxed = jax.eval_shape(model.init, jax.random.key(0))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        param_sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    params = jax.tree.map(lambda x, s: jax.device_put(x, s), params_host, param_sh)
    rep = NamedSharding(mesh, P())
    if naive_init:
        opt_state = jax.jit(tx.init)(params)
        # leaves the compiler placed on the mesh keep their sharding; scalars (step counts) land on one device
        on_mesh = lambda x: isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
        opt_sh = jax.tree.map(lambda x: x.sharding if on_mesh(x) else rep, opt_state)
    else:
        opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, jax.eval_shape(tx.init, params), param_sh,
                                       transform_non_params=lambda _: rep)
        opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    opt_state = jax.tree.map(jax.device_put, opt_state, opt_sh)

    def step(params, opt_state, batch):
        (loss, _), grads = jax.value_and_grad(model.loss, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    jitted = jax.jit(step, out_shardings=(param_sh, opt_sh, rep), donate_argnums=(0, 1))

    def run(params, opt_state, batch):
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            return jitted(params, opt_state, batch)

    def lower(params, opt_state, batch):
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            return jitted.lower(params, opt_state, batch)

    run.lower = lower
    return run, params, opt_state


def _max_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


class Layout:
    """Both steps of one layout, their states, and what they computed on the first step."""

    def __init__(self, sizes: dict, cfg: GPTConfig, args, corpus):
        n = int(np.prod(list(sizes.values())))
        self.mesh = mesh = jp.make_mesh(**sizes, devices=jax.devices()[:n])
        self.model, rules = GPT(cfg), jp.sharding.DEFAULT_RULES
        names = jax.eval_shape(self.model.init, jax.random.key(0))
        tx = jp.optim.adamw(1e-3, total_steps=1000, warmup_steps=10, axis_names=names)
        self.state = jp.train.init_state(self.model.init, tx, 0, mesh=mesh)
        host = jax.tree.map(np.asarray, self.state.params)
        self.jp_step = jp.train.make_train_step(self.model.loss, tx, mesh=mesh)
        self.hand_step, self.params, self.opt_state = hand_written(self.model, tx, mesh, rules, host)
        self.naive = hand_written(self.model, tx, mesh, rules, host, naive_init=True)
        self.batch_sh = NamedSharding(mesh, P(("data", "fsdp")))
        self.args, self.corpus = args, corpus

    def batch(self, t: int):
        b = self.corpus.batch(0, t, self.args.batch, self.args.seq)
        return {k: jax.device_put(v, self.batch_sh) for k, v in b.items()}

    def compare(self) -> dict:
        b = self.batch(0)
        jl = self.jp_step.lower(self.state, b).compile()
        hl = self.hand_step.lower(self.params, self.opt_state, b).compile()
        costs = {"jaxpar": cost(jl), "hand_written": cost(hl)}
        costs["ratio"] = {k: costs["jaxpar"][k] / max(costs["hand_written"][k], 1.0) for k in costs["jaxpar"]}
        colls = {"jaxpar": collective_counts(jl.as_text()), "hand_written": collective_counts(hl.as_text())}
        colls["equal"] = colls["jaxpar"] == colls["hand_written"]
        naive = self.naive[0].lower(*self.naive[1:], b).compile()
        naive_row = {"collectives": collective_counts(naive.as_text()), **cost(naive),
                     "argument_bytes": int(naive.memory_analysis().argument_size_in_bytes),
                     "jaxpar_argument_bytes": int(jl.memory_analysis().argument_size_in_bytes)}
        del self.naive
        self.state, jm = self.jp_step(self.state, b)
        self.params, self.opt_state, hm = self.hand_step(self.params, self.opt_state, b)
        diffs = {"loss": _max_rel(jm["loss"], hm["loss"]), "grad_norm": _max_rel(jm["grad_norm"], hm["grad_norm"]),
                 "params": max(map(_max_rel, jax.tree.leaves(self.state.params), jax.tree.leaves(self.params))),
                 "opt_state": max(_max_rel(a, b) for a, b in zip(jax.tree.leaves(self.state.opt_state),
                                                                 jax.tree.leaves(self.opt_state))
                                  if np.issubdtype(np.asarray(a).dtype, np.floating))}
        return {"same_outputs_max_rel_diff": diffs, "cost": costs, "collectives": colls,
                "hand_written_naive_opt_init": naive_row}

    def time_jaxpar(self, batches) -> float:
        start = time.perf_counter()
        for b in batches:
            self.state, m = self.jp_step(self.state, b)
            jax.block_until_ready(m)
        return (time.perf_counter() - start) / len(batches)

    def time_hand(self, batches) -> float:
        start = time.perf_counter()
        for b in batches:
            self.params, self.opt_state, m = self.hand_step(self.params, self.opt_state, b)
            jax.block_until_ready(m)
        return (time.perf_counter() - start) / len(batches)


def timing(layout: Layout, args) -> dict:
    layout.time_jaxpar([layout.batch(1)])      # warm-up (both compiled already)
    layout.time_hand([layout.batch(1)])
    tj, th = [], []
    for i in range(args.pairs):
        batches = [layout.batch(2 + i * args.steps + s) for s in range(args.steps)]
        if i % 2:
            th.append(layout.time_hand(batches)); tj.append(layout.time_jaxpar(batches))
        else:
            tj.append(layout.time_jaxpar(batches)); th.append(layout.time_hand(batches))
    ratios = [a / b for a, b in zip(tj, th)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"ratio_median": round(statistics.median(ratios), 4), "ratio_iqr": [round(q1, 4), round(q3, 4)],
            "jaxpar_ms": round(1e3 * statistics.median(tj), 2),
            "hand_written_ms": round(1e3 * statistics.median(th), 2)}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--steps", type=int, default=2, help="steps of each implementation per pair")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    corpus = jp.data.CharCorpus.load()
    cfg = GPTConfig(vocab_size=corpus.vocab_size, num_layers=args.layers, d_model=args.d_model,
                    num_heads=args.heads, max_seq_len=args.seq)
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
           "date": time.strftime("%Y-%m-%d"), "batch": args.batch, "seq": args.seq, "pairs": args.pairs,
           "steps_per_pair": args.steps, "layouts": {}}
    for name in args.layouts:
        layout = Layout(LAYOUTS[name], cfg, args, corpus)
        out["layouts"][name] = {**layout.compare(), "time": timing(layout, args)}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
