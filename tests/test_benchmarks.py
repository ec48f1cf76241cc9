"""Tiny-size smoke tests of every script in ``benchmarks/``: each runs end to end through its ``main(argv)``.

No timing is asserted (the machines are shared and noisy); what is asserted is what the scripts claim beside
their timings: the PyTorch GPT has jaxpar's parameter count and, from the same weights and batches, the same
losses step by step (an independent implementation of the model and of AdamW with clipping and the schedule), and so
does transformers' LlamaForCausalLM, Qwen3ForCausalLM and Gemma3ForCausalLM against jaxpar's load of their checkpoints;
the hand-written jit step computes jaxpar's outputs with the same FLOPs and collectives; the memory rows hold
compiled figures beside the analytic estimate. The heavier ones (the GPU script's tiny run, the model-module
comparison, the pipeline memory rows) are marked slow. ``torch.compile`` is left out (``--no-compile``): compiling
with inductor takes longer on a 2-core CPU than all these tests together; it is the same module, compiled.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

TINY_GPT = ["--layers", "1", "--d-model", "32", "--heads", "2"]


def test_vs_pytorch_same_model_same_losses():
    pytest.importorskip("torch")
    import vs_pytorch
    out = vs_pytorch.main(["--rounds", "1", "--steps-per-round", "1", "--check-steps", "3", "--warmup-steps", "0",
                           "--batch", "4", "--seq", "16", "--no-compile", "--no-reuse-host-memory", *TINY_GPT])
    counts = out["param_counts"]
    assert counts["jaxpar"] == counts["torch_eager"] > 0
    jl, tl = (np.asarray(out["results"][k]["first_losses"]) for k in ("jaxpar", "torch_eager"))
    assert jl.shape == (3,) and jl[0] != jl[2]                # the updates change the loss
    np.testing.assert_allclose(jl, tl, rtol=2e-5)            # rounded to 5 decimals in the JSON
    assert out["tokens_per_s_ratios"]["jaxpar_over_torch_eager"]["median"] > 0


def test_ab_script_compares_variants_in_one_process():
    """benchmarks/ab.py: the tree, XLA's default compile options and the derived attention backward pass, compiled
    in one process; every variant trains the same model (the same losses to float32 rounding) and gets a ratio to
    the first; an unknown variant is refused before anything is built."""
    import ab
    out = ab.main(["--variants", "tree,opt:,autodiff_attention", "--rounds", "2", "--steps-per-round", "1",
                   "--warmup-steps", "2", "--batch", "4", "--seq", "16", "--no-reuse-host-memory", *TINY_GPT])
    v = out["variants"]
    assert list(v) == ["tree", "opt:", "autodiff_attention"] and v["tree"]["speedup_over_tree"] == 1.0
    for name in ("opt:", "autodiff_attention"):
        np.testing.assert_allclose(v[name]["first_losses"], v["tree"]["first_losses"], rtol=1e-5)
        assert v[name]["speedup_over_tree"] > 0 and v[name]["ms_per_step"] > 0
    with pytest.raises(ValueError, match="variant 'nope'"):
        ab.main(["--variants", "tree,nope", *TINY_GPT])
    with pytest.raises(ValueError, match="variant 'opt:x'.*NAME=VALUE"):
        ab.main(["--variants", "tree,opt:x", *TINY_GPT])
    with pytest.raises(ValueError, match="XLA refuses"):
        ab.main(["--variants", "tree,opt:xla_cpu_use_onednn=yes", *TINY_GPT])
    with pytest.raises(ValueError, match="--warmup-steps=0"):   # the first warm-up step compiles in the context
        ab.main(["--variants", "tree,autodiff_attention", "--warmup-steps", "0", *TINY_GPT])
    assert ab.parse(["--variants", "tree,tree,opt:,tree"]).variants == ["tree", "tree#2", "opt:", "tree#3"]
    with pytest.raises(ValueError, match="patch name 'tree'"):
        ab.patch("tree")


# slow set: a lighter sibling stays in the fast set (the README's 10-minute budget)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_vs_pytorch_against_transformers_same_losses(family):
    """--model llama|qwen3|gemma3: transformers' own model (sdpa, random weights saved by transformers and read
    by jaxpar.models.hf.load; GQA: 4 query heads, 2 key/value heads; Gemma 3 with a window shorter than the
    sequence) and jaxpar's give the same losses over three AdamW steps."""
    pytest.importorskip("transformers")
    import vs_pytorch
    out = vs_pytorch.main(["--model", family, "--kv-heads", "2", "--rounds", "1", "--steps-per-round", "1",
                           "--check-steps", "3", "--warmup-steps", "0", "--batch", "4", "--seq", "16", "--no-compile",
                           "--layers", "2", "--d-model", "32", "--heads", "4", "--head-dim", "16", "--window", "8",
                           "--d-mlp", "64", "--lr", "1e-2", "--no-reuse-host-memory"])
    counts = out["param_counts"]
    assert counts["jaxpar"] == counts["torch_eager"] > 0
    assert out["model"]["num_kv_heads"] == 2 and out["cpu_model"]
    if family == "gemma3":
        assert out["model"]["windows"] == [8, None]
    jl, tl = (np.asarray(out["results"][k]["first_losses"]) for k in ("jaxpar", "torch_eager"))
    assert jl.shape == (3,) and jl[1] != jl[2]                # the updates change the loss
    np.testing.assert_allclose(jl, tl, rtol=2e-5)


@pytest.mark.slow  # fast-set time; .ci/run runs it
def test_overhead_same_outputs_flops_and_collectives():
    import overhead
    out = overhead.main(["--pairs", "2", "--steps", "1", "--layouts", "2x2x2", "--batch", "8", "--seq", "16",
                         *TINY_GPT])
    row = out["layouts"]["2x2x2"]
    diffs = row["same_outputs_max_rel_diff"]
    assert diffs["loss"] <= 1e-5 and diffs["grad_norm"] <= 1e-5
    assert diffs["params"] <= 1e-5 and diffs["opt_state"] <= 1e-4
    assert row["collectives"]["equal"] and sum(row["collectives"]["jaxpar"].values()) > 0
    assert row["cost"]["ratio"]["flops"] == pytest.approx(1.0, rel=0.01)
    assert row["time"]["ratio_median"] > 0


def _memory_rows(layouts, precisions):
    import memory
    out = memory.main(["--layouts", *layouts, "--precisions", *precisions, "--batch", "8", "--seq", "16",
                       "--layers", "2", "--d-model", "32", "--heads", "2", "--microbatches", "2"])
    rows = {(r["layout"], r["precision"]): r for r in out["rows"]}
    for r in rows.values():
        assert r["measured_bytes"] > 0 and r["analytic_bytes"] > 0
        assert 0.2 < r["ratio"] < 5, r                       # the estimate is of the right size
    return rows


@pytest.mark.slow  # fast-set time; .ci/run runs it
def test_memory_rows_compare_compiled_and_analytic():
    rows = _memory_rows(["FSDP"], ["f32", "bf16"])
    assert set(rows) == {("FSDP", "f32"), ("FSDP", "bf16")}
    for r in rows.values():
        assert r["measured_bytes"] > 0 and r["analytic_bytes"] > 0
        assert 0.2 < r["ratio"] < 5, r                       # the estimate is of the right size
    # bf16 keeps float32 params and moments and adds a bf16 copy: the analytic state part grows by P / 2
    assert rows[("FSDP", "bf16")]["analytic_parts"]["compute_params"] * 2 == pytest.approx(
        rows[("FSDP", "f32")]["analytic_parts"]["params"], rel=1e-6)
    assert rows[("FSDP", "bf16")]["measured_bytes"] < rows[("FSDP", "f32")]["measured_bytes"] * 1.25


@pytest.mark.slow
def test_memory_pipeline_rows():
    rows = _memory_rows(["1f1b", "gpipe"], ["f32"])
    assert rows[("pipe 1f1b", "f32")]["peak_stash"] <= rows[("pipe gpipe", "f32")]["peak_stash"]


@pytest.mark.slow
def test_gpu_script_tiny_on_cpu():
    pytest.importorskip("torch")
    import gpu
    out = gpu.main(["--tiny", "--no-compile"])
    res = out["results"]["tiny"]
    assert res["params"]["jaxpar"] == res["params"]["torch"]
    for k in ("jaxpar", "jaxpar_fp8", "jaxpar_fp8_current", "torch"):
        assert res[k]["tokens_per_s"] > 0 and 0 < res[k]["mfu"] and np.isfinite(res[k]["last_loss"])
    # scan_layers: the lowered program holds the scanned block's 4 dense matmuls once (3 dots each with the backward)
    assert res["jaxpar"]["fp8_dots"] == {} and res["jaxpar_fp8"]["fp8_dots"] == {"e4m3 x e4m3": 4, "e5m2 x e4m3": 8}
    assert res["jaxpar_fp8_current"]["fp8_dots"] == res["jaxpar_fp8"]["fp8_dots"]
    assert out["target_config"] == "n/a off GPU"
    for k in ("jaxpar", "jaxpar_fp8"):   # predicted for one compile-only H100 where the gpu extra is installed
        if "predicted" in res[k]:
            assert res[k]["predicted"].startswith("n/a")
        else:
            assert res[k]["predicted_ms_per_step"] > 0 and 0 < res[k]["predicted_bytes"] < 2**30
            assert res[k]["predicted_over_measured_time"] == "n/a off GPU"


@pytest.mark.slow
def test_train_step_script_compares_a_model_module():
    import train_step
    gpt_file = pathlib.Path(__file__).resolve().parents[1] / "jaxpar" / "models" / "gpt.py"
    out = train_step.main(["--steps", "1", "--batch", "8", "--seq", "16", "--configs", "1 device",
                           "--compare-module", str(gpt_file), "--layers", "1", "--d-model", "32"])
    assert set(out["results"]) == {"1 device", "before: 1 device"}
    assert out["after_over_before_ms_per_step"]["1 device"] > 0


# slow set: a lighter sibling stays in the fast set (the README's 10-minute budget)
@pytest.mark.slow
def test_pipeline_memory_script():
    import pipeline_memory
    out = pipeline_memory.main(["--stages", "2", "--growth-stages", "--microbatches", "4",
                                "--stash", "residuals", "--table-microbatches", "4"])
    by = {(r["schedule"], r["microbatches"]): r for r in out["rows"]}
    assert by[("1f1b", 4)]["stash_slots"] < by[("gpipe", 4)]["stash_slots"]
    assert all(r["temp_bytes"] > 0 for r in out["rows"])
    assert [r["schedule"] for r in out["schedules"]] == ["gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"]


@pytest.mark.slow   # compiles the GPT's train step three times (~1 min)
def test_pipeline_schedules_script():
    import pipeline_schedules
    out = pipeline_schedules.main(["--steps", "2", "--rounds", "1", "--timed-steps", "1", "--schedules", "zbv"])
    row = out["schedules"]["zbv"]
    assert row["rel_diff_step1"] <= 1e-5 and len(row["losses"]) == 2 and row["step_seconds"] > 0
    assert row["lockstep_time"] >= row["ideal_time"] > 0


# slow set: a lighter sibling stays in the fast set (the README's 10-minute budget)
@pytest.mark.slow
def test_kv_cache_script_tiny():
    import kv_cache
    report = kv_cache.main(["--tiny"])
    for row in report["models"].values():
        assert row["first_difference"] == [None] * 4 and row["cache_s_per_token"] > 0


@pytest.mark.slow  # ~9 CPU-s; fast siblings: test_token_file.py (TokenFile batches of both orders), test_loop.py
def test_data_script_tiny(tmp_path):
    """benchmarks/data.py on a tiny job: TokenFile batches of both orders timed, the main-job step run through
    jp.loop.run with its data time measured inside, the ratio the issue asks for."""
    from jaxpar.data import prepare as tokens
    import data as data_benchmark
    (tmp_path / "a.txt").write_text("".join(f"paragraph {i}: " + "some words here " * (i % 9 + 1) + "\n\n"
                                            for i in range(400)))
    tokens.prepare([tmp_path / "a.txt"], tmp_path / "tok", train_bpe_vocab=300, workers=1, val_fraction=0.1,
                   progress=False)
    report = data_benchmark.main(["--tokens", str(tmp_path / "tok"), "--tiny", "--batch", "4", "--seq", "64",
                                  "--calls", "3", "--steps", "2"])
    for order in ("random", "epoch"):
        assert report["token_file"][order]["batch"] == 4 and report["token_file"][order]["tokens_per_s"] > 0
    job = report["main_job"]
    assert job["steps"] == 2 and job["batch"] == 8 and 0 < job["data_fraction_of_step"] < 1
    assert report["token_file_over_training"] == pytest.approx(
        report["token_file"]["random"]["tokens_per_s"] / job["training_tokens_per_s"])


@pytest.mark.slow  # ~14 CPU-s; fast siblings: test_grain_data.py (both packings against references, the packed
# step trained and resumed: test_sigterm_and_resume_give_the_same_batches_and_losses)
def test_grain_data_script_tiny():
    """benchmarks/grain_data.py: the main job's step, both grain packings and the packed step, with ratios."""
    import grain_data
    out = grain_data.main(["--batch", "4", "--seq", "16", "--steps", "1", "--batches", "2", "--layers", "1",
                           "--d-model", "32"])
    results = out["results"]
    assert set(results) == {"main_job", "grain_first_fit", "grain_concat_then_split", "packed_step",
                            "packed_training_fed_by_grain"}
    assert 0 < results["grain_first_fit"]["fill"] <= 1 and results["grain_concat_then_split"]["fill"] == 1
    assert all(r["tokens_per_s"] > 0 for r in results.values()) and all(v > 0 for v in out["ratios"].values())


@pytest.mark.slow
def test_fp8_quality_script_tiny():
    import fp8_quality
    out = fp8_quality.main(["--steps", "2", "--extra", "--num-layers", "1", "--eval-batches", "1",
                            "--eval-interval", "2", "--batch-size", "8", "--seq-len", "16"])
    assert set(out["runs"]) == {"bf16", "fp8", "fp8_current"} and set(out["gap_vs_bf16"]) == {"fp8", "fp8_current"}
    assert all(np.isfinite(r["val_loss"]) for r in out["runs"].values())


@pytest.mark.slow  # compiles the GPT step four times; .ci/run runs it
def test_context_script_tiny():
    import context
    rows = context.main(["--memory-seq", "256", "--time-seq", "64", "--steps", "1", "--contexts", "1", "2"])
    memory = [r for r in rows if r["part"] == "memory"]
    assert [(r["strategy"], r["context"]) for r in memory] == [("ring", 1), ("ring", 2), ("all_gather", 1),
                                                               ("all_gather", 2)]
    assert all(r["temp_bytes"] > 0 for r in memory) and memory[1]["ratio_to_context_1"] < 1
    assert [r["context"] for r in rows if r["part"] == "time"] == [1, 2]


@pytest.mark.slow  # compiles the step seven times
def test_sliding_window_script_tiny():
    import sliding_window
    rows = sliding_window.main(["--seq", "128", "--windows", "0", "32", "8", "--layers", "1", "--d-model", "32",
                                "--heads", "2", "--backends", "blocked", "xla"])
    blocked = [r["attention_flops"] for r in rows if r["backend"] == "blocked"]
    assert blocked[0] > blocked[1] > blocked[2] > 0          # the blocked kernel's FLOPs fall with the window
    assert len({r["attention_flops"] for r in rows if r["backend"] == "xla"}) == 1   # XLA's path only masks


@pytest.mark.slow  # two XLA:GPU compiles of a tiny Llama on compile-only H100s (~30-60 s)
@pytest.mark.filterwarnings("ignore:jp.gpu.apply_gpu_defaults\\(\\) ran after JAX's backends started")  # pytest's jax
def test_gpu_published_script_tiny(tmp_path, monkeypatch):
    from jaxpar.plan import targets
    try:
        targets.check_cuda_plugin()
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"the GPU planner needs the jax CUDA plugin (the gpu extra): {e}")
    monkeypatch.setenv("XLA_FLAGS", __import__("os").environ.get("XLA_FLAGS", ""))   # main() sets it
    import gpu_published
    bf16, fp8 = gpu_published.main(["--tiny", "--out", str(tmp_path / "rows.json")])
    for row, published in ((bf16, 5762), (fp8, 8532)):
        assert "error" not in row, row
        assert row["ratio"] == pytest.approx(row["predicted_tokens_per_s_per_gpu"] / published)
        assert row["step_s"] >= row["compute_s"] > 0 and 0 < row["predicted_mfu"] < 1
    assert bf16["fp8_dots"] == 0 < fp8["fp8_dots"]


@pytest.mark.slow  # five tiny training runs (four MoE modes and the dense model), each compiled
def test_moe_load_script_tiny(tmp_path):
    """benchmarks/moe_load.py: a row per mode with the load figures, the dropless counts checked on every step (the
    script asserts them), the capacity run's dropped fraction, the dense model's active parameters equal to the
    MoE's, and the plot."""
    import moe_load
    out = moe_load.main(["--steps", "5", "--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--seq-len", "16",
                         "--batch-size", "8", "--expert-d-mlp", "16", "--eval-batches", "1",
                         "--out-dir", str(tmp_path)])
    rows = out["rows"]
    assert set(rows) == {"none", "aux_loss", "aux_free_bias", "capacity", "dense"}
    for name in ("none", "aux_loss", "aux_free_bias"):
        assert 1.0 <= rows[name]["max_mean_load_last"] <= 8.0 and rows[name]["dropped_fraction"] == 0.0
    assert 0.0 <= rows["capacity"]["dropped_fraction"] < 1.0 and np.isfinite(rows["dense"]["val_loss"])
    router = 1 * 32 * 8                                    # the MoE's active params add one router [D, E] per layer
    assert rows["dense"]["active_params"] + router == rows["none"]["active_params"] < rows["none"]["params"]
    assert out["dropless_check"]["all_equal_and_nothing_dropped"] and out["dropless_check"]["steps_each"] == 5
    assert (tmp_path / "moe_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # three layer steps and four sharded states, each compiled or traced
def test_moe_layer_script_tiny():
    """benchmarks/moe_layer.py: the three steps timed side by side with their ratios; the compiled matmul FLOPs
    (router taken off) are the useful ones for the dense MLP, about capacity_factor times them for the capacity
    form and E = 8 times them for ragged_dot's lowering; the expert weights per device at EP 1/2/4/8 measured
    from the sharded state equal the planner's, params / EP (times fsdp=4 where fsdp is not an expert axis)."""
    import moe_layer
    out = moe_layer.main(["--tokens", "64", "--seq-len", "16", "--d-model", "32", "--expert-d-mlp", "16",
                          "--steps", "1", "--rounds", "1", "--layers", "2", "--batch", "16"])
    step = out["step"]
    assert set(step) == {"dropless", "capacity", "dense"} and step["dense"]["cpu_ms_over_dense"] == 1.0
    assert all(row["wall_ms"] > 0 and row["wall_ms_over_dense"] > 0 for row in step.values())
    assert step["dense"]["mlp_flops_over_useful"] == pytest.approx(1.0)
    assert 1.25 <= step["capacity"]["mlp_flops_over_useful"] < 1.4      # 5 slots per expert per 16-token sequence
    assert 8.0 <= step["dropless"]["mlp_flops_over_useful"] < 8.2       # plus the weighted combine's einsum
    for layout in ("fsdp_embed", "whole_embed"):
        rows = out["memory"][layout]
        assert sorted(rows) == [1, 2, 4, 8]
        for ep, row in rows.items():
            fsdp = 1 if "fsdp" in row["axes"] or layout == "whole_embed" else 4
            assert row["measured_bytes"] == row["planned_bytes"] == row["params_over_ep_bytes"] / fsdp > 0
            assert (row["ring_dispatch_bytes_per_step"] > 0) == (ep > 1)


@pytest.mark.slow  # trains a tiny MoE, compacts it twice, fine-tunes it, and times both steps
def test_moe_prune_script_tiny():
    """benchmarks/moe_prune.py: 8 -> 6 experts per layer by measured load, the compacted model's loss equal to the
    masked model's, the losses of every stage finite, fewer parameters and the same active ones less two router
    columns per layer, the speed ratios computed from the timings beside them."""
    import moe_prune
    out = moe_prune.main(["--steps", "4", "--finetune-steps", "2", "--d-model", "32", "--num-layers", "1",
                          "--seq-len", "16", "--batch-size", "8", "--expert-d-mlp", "16", "--eval-batches", "1",
                          "--rounds", "1", "--load-batches", "2"])
    assert out["compacted_equals_masked"] and all(np.isfinite(v) for v in out["val_loss"].values())
    assert [len(r) for r in out["removed_experts"]] == [2] and 0 <= out["load_share_removed"] <= 0.25
    m = out["model"]
    assert m["params"] - m["pruned_params"] == 2 * (32 + 3 * 32 * 16)        # two experts and their router columns
    assert m["active_params"] - m["pruned_active_params"] == 2 * 32
    t = out["step_ms_1_device"]
    assert out["speedup"]["train_ms"] == pytest.approx(t["8 experts"]["train_ms"] / t["6 experts"]["train_ms"], 1e-2)
