"""The MoE layer's train step on CPU, side by side in one run: dropless ``ragged_dot``, the capacity-padded form and
a dense SwiGLU MLP of the same active size; and the expert weights per device at expert-parallel 1/2/4/8.

    python benchmarks/moe_layer.py                                  # the README's table
    python benchmarks/moe_layer.py --tokens 64 --d-model 32 --expert-d-mlp 16 --steps 1   # smoke test

**Step**: forward and backward (gradients of the weights and the input) of the layer alone on one CPU device,
``jax.jit`` of ``jax.value_and_grad`` of ``sum(y * r)`` (``r`` a fixed random cotangent), float32, on ``--tokens``
tokens in sequences of ``--seq-len``:

* ``dropless``: :func:`jaxpar.layers.moe.moe_mlp` with ``capacity_factor=None`` (sort by expert,
  ``jax.lax.ragged_dot``, unsort, weighted combine), ``--experts`` experts of width ``--expert-d-mlp``, top-k;
* ``capacity``: the same layer in GShard's capacity mode (``--capacity-factor`` 1.25 slots per choice per
  sequence: dense batched matmuls over ``[sequences, E, C, D]`` buffers);
* ``dense``: a SwiGLU MLP of width ``d_mlp = k * F_e`` (the active expert parameters of a token, no router).

The three are timed in interleaved rounds (``--rounds`` x ``--steps`` steps each, after a compile step); each row
holds the median wall and process-CPU milliseconds per step, the ratio to ``dense`` (the CPU is shared: compare
the ratios of one run), the matmul FLOPs of the compiled program (:mod:`jaxpar._hlo`) and, the router's ``6 T D
E`` taken off, their ratio to the useful train FLOPs (:func:`jaxpar.plan.experts.expert_flops` times 3: ``k``
experts a token): XLA:CPU lowers ``ragged_dot`` to one dense matmul over a block-masked copy of the rows, ``E``
times the useful FLOPs, as XLA:GPU does (``benchmarks/README.md``).

**Memory**: a MoE Llama (``--layers`` layers, width ``--d-model``) on 8 simulated CPU devices, mesh data=2 x
fsdp=4, the experts folded onto the batch axes by ``jp.sharding.expert_parallel_rules`` at each size (2: data, 4:
fsdp, 8: both): the per-device bytes of the expert weights in the sharded state training builds
(``jp.train.abstract_state``; the arrays' shard sizes) beside the planner's
(:func:`jaxpar.plan.experts.expert_memory`), ``params / EP``, the split, and the ring dispatch's bytes per step
and device (:func:`jaxpar.plan.experts.moe_plan`, batch ``--batch`` x ``--seq-len``). Two layouts:
``fsdp_embed`` (the default rules: ``fsdp`` splits each expert's ``embed`` dim unless it is an expert axis, so
EP 4 over fsdp holds what EP 1 holds) and ``whole_embed`` (``embed`` left whole: params / EP exactly).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxpar as jp  # noqa: E402
from jaxpar import _hlo  # noqa: E402
from jaxpar.layers.moe import MoEConfig, init_params, moe_mlp  # noqa: E402
from jaxpar.models.llama import Llama, LlamaConfig  # noqa: E402
from jaxpar.plan import experts  # noqa: E402
from jaxpar.sharding.names import EMBED  # noqa: E402


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of one step (sequences of --seq-len)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--experts-per-token", type=int, default=2)
    ap.add_argument("--expert-d-mlp", type=int, default=256)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4, help="layers of the memory table's MoE Llama")
    ap.add_argument("--batch", type=int, default=64, help="global batch of the memory table's dispatch bytes")
    args = ap.parse_args(argv)
    if args.tokens % args.seq_len or min(args.tokens, args.seq_len, args.steps, args.rounds) < 1:
        ap.error("--tokens must be a positive multiple of --seq-len; --steps and --rounds >= 1")
    return args


def layer_steps(args) -> dict:
    """``{name: (jitted step, its arguments, useful forward FLOPs)}`` of the three MLPs."""
    D, F, k = args.d_model, args.expert_d_mlp, args.experts_per_token
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(args.tokens, D)), jnp.float32)
    r = jnp.asarray(rng.normal(size=(args.tokens, D)), jnp.float32)
    out = {}
    for name, cf in (("dropless", None), ("capacity", args.capacity_factor)):
        moe = MoEConfig(num_experts=args.experts, experts_per_token=k, expert_d_mlp=F, capacity_factor=cf)
        w = init_params(moe, D, F, jax.random.key(0))
        loss = lambda w, x, r, moe=moe: jnp.sum(moe_mlp(moe, w, x, None, seq_len=args.seq_len)[0] * r)
        out[name] = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (w, x, r))
    keys = jax.random.split(jax.random.key(1), 3)
    width = k * F
    dense = {"gate": jax.random.normal(keys[0], (D, width)) / np.sqrt(D),
             "up": jax.random.normal(keys[1], (D, width)) / np.sqrt(D),
             "down": jax.random.normal(keys[2], (width, D)) / np.sqrt(width)}

    def dense_loss(w, x, r):
        return jnp.sum(((jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]) * r)
    out["dense"] = (jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1))), (dense, x, r))
    return out


def time_steps(steps: dict, args) -> dict:
    """Median wall and process-CPU ms per step of each, interleaved in rounds; compiled matmul FLOPs."""
    compiled = {name: fn.lower(*a).compile() for name, (fn, a) in steps.items()}
    for name, c in compiled.items():
        jax.block_until_ready(c(*steps[name][1]))
    wall = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, c in compiled.items():
            a = steps[name][1]
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                jax.block_until_ready(c(*a))
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    useful = experts.expert_flops(MoEConfig(num_experts=args.experts, experts_per_token=args.experts_per_token,
                                            capacity_factor=args.capacity_factor),
                                  args.d_model, args.expert_d_mlp, args.tokens, group_len=args.seq_len)["useful"]
    router = 6 * args.tokens * args.d_model * args.experts    # its logits' matmul, forward and backward
    rows = {}
    for name, c in compiled.items():
        flops = _hlo.analyze(c.as_text(), {}).flops
        mlp = flops - (0 if name == "dense" else router)
        rows[name] = {"wall_ms": 1e3 * statistics.median(wall[name]), "cpu_ms": 1e3 * statistics.median(cpu[name]),
                      "matmul_flops": flops, "mlp_flops_over_useful": mlp / (3 * useful)}
    for row in rows.values():
        for key in ("wall_ms", "cpu_ms"):
            row[f"{key}_over_dense"] = row[key] / rows["dense"][key]
    return rows


def memory_rows(args) -> dict:
    """Expert weights per device at EP 1/2/4/8 on data=2 x fsdp=4: measured shard sizes beside the planner's."""
    moe = MoEConfig(num_experts=args.experts, experts_per_token=args.experts_per_token, expert_d_mlp=args.expert_d_mlp)
    cfg = LlamaConfig(vocab_size=256, d_model=args.d_model, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                      d_mlp=4 * args.d_model, max_seq_len=args.seq_len, moe=moe)
    mesh = jp.make_mesh(data=2, fsdp=4, devices=jax.devices()[:8])
    sizes = dict(mesh.shape)
    layouts = {"fsdp_embed": jp.sharding.DEFAULT_RULES,   # the default: fsdp splits embed unless it holds experts
               "whole_embed": jp.sharding.Rules(((EMBED, None), *jp.sharding.DEFAULT_RULES))}
    out = {"model": {"num_params": cfg.num_params(), "active_params": cfg.active_params(),
                     "expert_params": experts.param_counts(cfg)["routed_experts"]}, "mesh": sizes}
    for layout, rules in layouts.items():
        rows = {}
        for ep, p in experts.expert_memory(cfg, sizes, rules=rules).items():
            state = jp.train.abstract_state(Llama(cfg).init, optax.sgd(0.1), mesh=mesh,
                                            rules=jp.sharding.expert_parallel_rules(mesh, ep, rules))
            leaves = {k: v for k, v in state.params["blocks"].items() if k.startswith("experts_")}
            plan = experts.moe_plan(cfg, sizes, args.batch, args.seq_len, ep)
            rows[ep] = {"axes": list(p["axes"]), "measured_bytes": jp.plan.memory.sharded_bytes(leaves),
                        "planned_bytes": p["bytes"], "total_bytes": p["total_bytes"],
                        "params_over_ep_bytes": p["total_bytes"] / ep, "split": p["split"],
                        "ring_dispatch_bytes_per_step": plan["dispatch"]["total"]}
        out[layout] = rows
    return out


def main(argv=None) -> dict:
    args = parse(argv)
    out = {"config": vars(args), "device": jax.devices()[0].device_kind, "cpu_cores": os.cpu_count(),
           "step": time_steps(layer_steps(args), args), "memory": memory_rows(args),
           "note": "ratios from one run on a shared CPU; absolute times vary with the load"}
    print(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
