"""The README's "use it in your own script" example runs exactly as written, and trains."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    section = (ROOT / "README.md").read_text().split("## Use it in your own script", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs_and_trains(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the block sets it itself
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert last < 0.2 * first, out.stdout
    assert "PartitionSpec('fsdp', 'tensor')" in out.stdout or "P('fsdp', 'tensor')" in out.stdout, out.stdout


def own_model_blocks() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## Your own model", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.mark.slow  # ~20 s of compiles; fast siblings: test_readme_example_runs_and_trains (a README block run as
# written), and each block's API: tests/test_model_init.py (Linen BatchNorm), tests/models/test_nnx_bridge.py (NNX),
# tests/test_placement.py (path rules, automatic FSDP)
def test_readme_your_own_model_blocks_run_in_order(tmp_path):
    """Linen with names, Linen without, a plain pytree, path rules, NNX, Linen BatchNorm: one script, the blocks in
    the README's order, as written; their printed specs and shapes are the ones the comments state."""
    blocks = own_model_blocks()
    assert len(blocks) == 7, len(blocks)
    script = tmp_path / "own_model.py"
    script.write_text("\n".join(blocks))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout
    for expected in ["P('fsdp', 'tensor')", "P(None, 'fsdp')", "('data', 'fsdp')", "per device / global bytes 0.1", "True",
                     "['batch_stats'] (512,)", "params/Dense_0/kernel  (64, 512)  P(None, 'fsdp')  auto fsdp",
                     "params/Dense_1/kernel  (512, 10)  P('fsdp', None)  auto fsdp"]:
        assert expected in lines, (expected, lines)


def hf_block() -> str:
    section = (ROOT / "README.md").read_text().split("Loaded params go straight into a sharded train state", 1)[1]
    return textwrap.dedent(re.search(r"```python\n(.*?)```", section, re.S).group(1))


@pytest.mark.slow  # ~11 s; fast siblings: tests/models/test_llama.py's test_load_onto_a_2x2x2_mesh_is_bitwise_the_
# single_device_load and test_save_is_read_by_from_pretrained (the block's load, mesh and save against transformers)
def test_readme_hugging_face_block_runs_as_written(tmp_path, monkeypatch):
    """The Hugging Face block, on a tiny random ``LlamaForCausalLM`` made here: load onto 2x2x2, one step, save; the
    saved directory gives ``transformers`` the trained params' logits (jaxpar's own apply on them)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf_in")
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(hf_block().replace("path/to/hf_dir", str(tmp_path / "hf_in")), scope)
    import jax
    import numpy as np
    import jaxpar as jp
    model, state = scope["model"], scope["state"]
    assert np.isfinite(float(scope["metrics"]["loss"]))
    tokens = np.random.default_rng(1).integers(0, 96, (2, 17))
    got = np.asarray(model.apply(jax.device_get(jp.train.to_model_order(state).params), tokens))[..., :96]
    out = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf")
    with torch.no_grad():
        want = out(torch.tensor(tokens)).logits.numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
