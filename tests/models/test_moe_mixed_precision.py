"""A Llama with experts trained under the ``mixed_bf16`` precision policy (float32 master params, bfloat16
compute) on data=2 x fsdp=2 x tensor=2, without and with expert parallelism: the step runs (in a subprocess: a
16-bit reduction inside the expert dispatch's partial-manual region aborted XLA:CPU, killing the process) and its
loss and gradients equal the single-device float32 step's within bfloat16 rounding. The layer alone:
tests/test_moe.py (``test_bf16_*``)."""

from __future__ import annotations

import pytest
from helpers import run_isolated

DRIVER = """
import dataclasses, json
import jax, numpy as np, optax
import jaxpar as jp
from helpers import SMALL_LLAMA, gpt_batch, max_rel_err
from jaxpar.layers.moe import MoEConfig
from jaxpar.models import Llama

LAYOUTS = {   # name: (experts per token, expert axes, dispatch); all on data=2 x fsdp=2 x tensor=2
    "EP1, ring": (4, (), "ring"),
    "EP2 over fsdp, all_to_all": (4, ("fsdp",), "all_to_all"),
    "EP4 over data x fsdp, ring": (4, ("data", "fsdp"), "ring"),
    "EP4 over data x fsdp, ring, top-2": (2, ("data", "fsdp"), "ring"),
}


def step(cfg, mesh, policy, rules):
    model, tx = Llama(cfg), optax.sgd(0.1, momentum=0.9)
    batch = gpt_batch(np.random.default_rng(3), 8, cfg)
    state = jp.train.init_state(model.init, tx, 5, mesh=mesh, policy=policy, rules=rules)
    new, metrics = jp.train.make_train_step(model.loss, tx, mesh=mesh, donate=False, rules=rules)(state, batch)
    trace = next(s for s in jax.tree.leaves(new.opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState))
                 if isinstance(s, optax.TraceState)).trace   # the first step's momentum: the gradients
    return float(metrics["loss"]), jax.device_get(trace)


out, refs = {}, {}
mesh = jp.make_mesh(data=2, fsdp=2, tensor=2)
for name, (k, experts, how) in LAYOUTS.items():
    cfg = dataclasses.replace(SMALL_LLAMA, moe=MoEConfig(num_experts=4, experts_per_token=k, expert_d_mlp=32,
                                                         load_balance_coef=0.01, dispatch=how))
    if k not in refs:
        refs[k] = step(cfg, jp.make_mesh(devices=jax.devices()[:1]), None, jp.sharding.DEFAULT_RULES)
    rules = ((("experts", experts),) if experts else ()) + tuple(jp.sharding.DEFAULT_RULES)
    loss, grads = step(cfg, mesh, jp.precision.Policy.from_string("mixed_bf16"), rules)
    ref_loss, ref_grads = refs[k]
    errors = jax.tree.map(max_rel_err, grads, ref_grads)
    out[name] = {"loss": abs(loss - ref_loss) / abs(ref_loss), "finite": bool(np.isfinite(loss) and all(
        np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))), "grads": max(jax.tree.leaves(errors)),
        "worst": jax.tree_util.keystr(max(jax.tree_util.tree_leaves_with_path(errors), key=lambda kv: kv[1])[0])}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow   # a subprocess of 6 step compiles: ~90 s
def test_mixed_bf16_moe_llama_step_runs_and_equals_float32_with_and_without_expert_parallelism():
    """Every token routed to all 4 experts (k = E: a bf16 rounding of the router's input cannot flip a discrete
    choice, so every gradient is comparable per leaf) on EP 1, 2 (all-to-all) and 4 (ring); and top-2 on EP 4,
    whose loss is compared (there bf16 flips a few tokens' choices, which moves those experts' gradients by up
    to ~30% of their largest entry: measured 0.30 on one device as on 8)."""
    result = run_isolated(DRIVER)
    for name, r in result.items():
        print(f"[mixed_bf16 {name}] vs float32 one device: loss {r['loss']:.2e}, grads {r['grads']:.2e} "
              f"(worst {r['worst']})")
        assert r["finite"] and r["loss"] <= 2e-2, (name, r)   # bf16 keeps 8 mantissa bits
        if "top-2" not in name:
            assert 1e-4 < r["grads"] <= 3e-2, (name, r)   # as the dense Llama's mixed_bf16 step (test_llama.py)
