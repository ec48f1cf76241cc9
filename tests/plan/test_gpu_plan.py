"""jp.plan.plan(..., target=): the train step compiled by XLA:GPU for a GPU target's compile-only devices."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jaxpar as jp
from jaxpar.models import GPTConfig

_CFG = GPTConfig(d_model=64, num_layers=2, num_heads=4, vocab_size=61, max_seq_len=64, positions="rotary",
                 scan_layers=True, dtype=jnp.bfloat16)


def _target(hosts: int):
    from jaxpar.plan import targets
    try:
        targets.check_cuda_plugin()
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"planning for a GPU target needs the jax CUDA plugin (the gpu extra): {e}")
    return jp.plan.gpu_target("h100", hosts=hosts)


def test_a_target_whose_topology_is_not_the_mesh_is_refused_before_compiling():
    target = _target(hosts=2)
    with pytest.raises(ValueError, match=r"target topology 1x2x8 has 16 devices, the mesh 8; build "
                                         r"gpu_target\('h100', hosts=, gpus_per_host=\)"):
        jp.plan.plan(_CFG, dict(fsdp=8), global_batch=8, seq_len=64, target=target)


@pytest.mark.slow  # one XLA:GPU compile and one XLA:CPU compile of a tiny GPT on 16 devices (~40 s)
def test_plan_on_two_h100_hosts_reads_the_gpu_program_and_puts_the_cpu_memory_beside(capsys):
    p = jp.plan.plan(_CFG, dict(data=2, fsdp=8), global_batch=32, seq_len=64, target=_target(hosts=2),
                     compare_cpu=True)
    assert p.label == "XLA:GPU compilation for h100 (1x2x8)" and p.hosts["across_hosts"]["data"] == 2
    assert p.memory["compiled_bytes"] > 0 and p.memory["cpu_compiled_bytes"] > 0
    rows = p.gpu["collectives"]
    assert {(r["kind"], r["axes"]) for r in rows} >= {("all-gather", "fsdp"), ("reduce-scatter", "fsdp")}
    assert all(r["is_async"] for r in rows)
    # the data axis crosses the hosts: its gradient all-reduce goes over InfiniBand, fsdp's traffic over NVLink
    assert any(k.startswith("all-reduce/data") and k.endswith("/infiniband") for k in p.time["comm_s_by"])
    assert all(k.endswith("/nvlink") for k in p.time["comm_s_by"] if k.split("/")[1] == "fsdp")
    assert p.time["step_s"] >= p.time["compute_s"] > 0 and 0 < p.time["mfu"] < 1
    assert p.time["tokens_per_s_per_gpu"] == pytest.approx(32 * 64 / (16 * p.time["step_s"]))
    text = p.report()
    assert "GPU memory/device" in text and "CPU-simulated" in text and "attention: XLA" in text
