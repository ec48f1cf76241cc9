"""The pruning entry points: digits.py's pruning flags and prune_sweep.py (short configurations)."""

import json

import pytest

from jaxpar.cli import experiment
from test_experiments import load


def test_digits_pruning_flags_prune_and_train(tmp_path):
    digits = load("digits")
    cfg = digits.Config(steps=120, pruning=experiment.PruningConfig(sparsity=0.8, distribution="global", prune_begin=20,
                                                                prune_end=80, prune_frequency=5), out_dir=str(tmp_path))
    test = digits.run(cfg)
    assert test["sparsity"] == pytest.approx(0.8, abs=1e-3)
    assert test["accuracy"] > 0.8


@pytest.mark.slow  # heavy (subprocesses or several compiles); .ci/run runs it
def test_prune_sweep_writes_results_plot_and_table(tmp_path, capsys):
    sweep = load("prune_sweep")
    cfg = sweep.Config(sparsities=(0.8,), distributions=("global",), n_m=(2, 4), seeds=(0,), steps=60,
                       prune_begin=10, prune_end=40, out_dir=str(tmp_path))
    summary = sweep.main(cfg)
    assert set(summary) == {"dense", "global 80%", "2:4"}
    assert summary["global 80%"]["sparsity"] == pytest.approx(0.8, abs=1e-3)
    assert summary["2:4"]["sparsity"] == pytest.approx(0.5, abs=1e-6)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["runs"]) == 3 and saved["summary"]["dense"]["seeds"] == 1
    assert (tmp_path / "accuracy_vs_sparsity.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "| sparsity | global |" in out and "| 80% |" in out and "| 2:4 (50%) |" in out


@pytest.mark.slow  # a charlm run (about 15 s warm, 80 s with a cold compilation cache); .ci/run runs it
def test_charlm_prune_structure_compacts_and_reports(tmp_path, capsys):
    """--prune-structure both --sparsity 0.5 on a tiny char-GPT: half the heads and MLP neurons of every layer go
    (uniform), the compacted model is smaller and its validation loss is the masked model's."""
    charlm = load("charlm")
    cfg = charlm.Config(steps=12, eval_interval=12, eval_batches=1, batch_size=8, seq_len=16, d_model=32, num_heads=4,
                        num_layers=2, sample_chars=2, checkpoint_interval=0, out_dir=str(tmp_path),
                        pruning=experiment.PruningConfig(sparsity=0.5, prune_structure="both", prune_begin=2, prune_end=8,
                                                     prune_frequency=2))
    charlm.main(cfg)
    out = json.loads((tmp_path / "compaction.json").read_text())
    masked, compacted = out["masked"], out["compacted"]
    assert (masked["num_heads"], masked["d_mlp"], compacted["num_heads"], compacted["d_mlp"]) == (4, 128, 2, 64)
    assert compacted["params"] < masked["params"] and compacted["param_bytes"] < masked["param_bytes"]
    assert abs(compacted["val_loss"] - masked["val_loss"]) <= 1e-5 * masked["val_loss"]
    assert all(v > 0 for v in out["speedup"].values())
    assert "compacted (both): heads 4 -> 2, d_mlp 128 -> 64" in capsys.readouterr().out
