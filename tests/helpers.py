"""Shared test helpers: tree comparison with the suite's parity tolerance, small models and batches, the launcher."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar as jp
from jaxpar.models import MLP, GPTConfig, LlamaConfig, classification_loss
from jaxpar.models import families

# docs/architecture.md "Tests": per leaf max|got - ref| <= 1e-5 * max|ref|. Elementwise rtol cannot hold when a layout
# changes the reduction order (sums split over devices), so the error is scaled by the leaf's largest value.
RTOL = 1e-5


def max_rel_err(got: Any, ref: Any) -> float:
    """``max|got - ref| / max|ref|`` of one array (``0`` when both are all zero, ``inf`` when only ref is)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err, scale = np.max(np.abs(got - ref), initial=0.0), np.max(np.abs(ref), initial=0.0)
    if scale == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return float(err / scale)


def assert_tree_close(got: Any, ref: Any, rtol: float = RTOL, what: str = "") -> float:
    """Asserts per leaf ``max|got - ref| <= rtol * max|ref|`` and returns the worst ratio over the leaves.

    Leaves whose reference is exactly zero must be exactly zero in ``got`` too. The trees must have the same
    structure; ``got`` may be sharded (it is fetched to the host).
    """
    got, ref = jax.device_get(got), jax.device_get(ref)
    assert jax.tree.structure(got) == jax.tree.structure(ref), (
        f"{what}: tree structures differ:\n{jax.tree.structure(got)}\n{jax.tree.structure(ref)}")
    worst, failures = 0.0, []
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref)):
        e = max_rel_err(g, r)
        worst = max(worst, e)
        if not e <= rtol:
            failures.append(f"{jax.tree_util.keystr(path)}: max|got-ref|/max|ref| = {e:.3g} > {rtol:g}")
    assert not failures, f"{what}: {len(failures)} leaves differ:\n" + "\n".join(failures)
    return worst


def assert_scalar_close(got: Any, ref: Any, rtol: float = RTOL, what: str = "") -> float:
    got, ref = float(np.asarray(got)), float(np.asarray(ref))
    e = abs(got - ref) / abs(ref) if ref != 0 else abs(got)
    assert e <= rtol, f"{what}: got {got!r}, reference {ref!r} (relative error {e:.3g} > {rtol:g})"
    return e


# ---------------------------------------------------------------------------------------------- models

SMALL_GPT = GPTConfig(vocab_size=61, num_layers=2, num_heads=8, d_model=64, max_seq_len=16)
SMALL_GPT_VARIANT = GPTConfig(vocab_size=61, num_layers=2, num_heads=8, d_model=64, max_seq_len=16,
                              positions="rotary", tie_embeddings=False, scan_layers=True)
SMALL_LLAMA = LlamaConfig(vocab_size=61, num_layers=2, num_heads=8, num_kv_heads=2, d_model=64, d_mlp=128,
                          max_seq_len=16, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
SMALL_QWEN3 = families.qwen3(vocab_size=61, num_layers=2, num_heads=8, num_kv_heads=2, d_model=64, d_mlp=128,
                              head_dim=16, max_seq_len=16)
SMALL_GEMMA3 = families.gemma3(vocab_size=61, num_layers=4, num_heads=8, num_kv_heads=2, d_model=64, d_mlp=128,
                               head_dim=16, max_seq_len=16, sliding_window=5, pattern=2, query_pre_attn_scalar=12,
                               rope_factor=4.0, scan_layers=True)
MLP_FEATURES = 64


def gpt_batch(rng: np.random.Generator, batch_size: int, cfg: GPTConfig = SMALL_GPT,
              seq_len: int | None = None) -> dict[str, np.ndarray]:
    seq_len = seq_len or cfg.max_seq_len
    return {"inputs": rng.integers(0, cfg.vocab_size, (batch_size, seq_len), dtype=np.int32),
            "targets": rng.integers(0, cfg.vocab_size, (batch_size, seq_len), dtype=np.int32)}


def mlp_batch(rng: np.random.Generator, batch_size: int, num_classes: int = 10) -> dict[str, np.ndarray]:
    return {"x": rng.normal(size=(batch_size, MLP_FEATURES)).astype(np.float32),
            "y": rng.integers(0, num_classes, (batch_size,), dtype=np.int32)}


def mlp_parts(hidden=(64, 128, 32), num_classes: int = 10):
    """(init_fn, loss_fn) for an MLP whose every sharded width divides by 8."""
    model = MLP(hidden=hidden, num_classes=num_classes)
    init_fn = lambda rng: model.init(rng, jnp.zeros((1, MLP_FEATURES), jnp.float32))["params"]
    return init_fn, classification_loss(model)


def gpt_parts(cfg: GPTConfig = SMALL_GPT):
    """(init, loss) of the GPT, or of the Llama for a ``LlamaConfig``."""
    model = cfg.as_model()
    return model.init, model.loss


def gpt_pipeline(model, schedule, **kwargs):
    """The GPT as a ``jp.pipeline.Pipeline`` of its three parts (``kwargs``: e.g. ``stash="inputs"``)."""
    return jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, schedule, **kwargs)


# -------------------------------------------------------------------------------------------- launcher

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 240  # seconds for the whole two-process job (the launcher kills its processes at TIMEOUT - 20)


def launch(args: list[str], timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess:
    """Runs ``python -m jaxpar.cli.launch ...`` in its own process group; kills the whole group on timeout."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxpar.cli.launch", "--timeout", str(timeout - 20), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        pytest.fail(f"the two-process job did not finish in {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def run_isolated(code: str, timeout: float = 600) -> dict:
    """Runs ``code`` in a fresh Python process (this one's environment: the simulated devices; the repository
    and ``tests/`` importable) so a crash of XLA aborts it, not pytest. ``code`` prints one line
    ``RESULT <json>``; returns that JSON. Fails the test on a timeout or a non-zero exit, with the output's tail.
    """
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the isolated process did not finish in {timeout} s:\n{proc.communicate()[0][-4000:]}")
    assert proc.returncode == 0, f"the isolated process exited with {proc.returncode}:\n{out[-4000:]}"
    results = [line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
    assert results, f"the isolated process printed no RESULT line:\n{out[-4000:]}"
    return json.loads(results[-1])


def load_script(relpath: str, name: str):
    """The repository file ``relpath`` (e.g. ``"experiments/charlm.py"``) executed as a fresh module ``name``,
    registered in ``sys.modules`` (dataclasses and pickling look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------ token batches

def batch_recorder(path: str | os.PathLike, batch):
    """``jp.data.TokenCorpus.batch`` (passed as ``batch``) that also appends each training batch it serves to
    ``path`` as a JSON line ``{"step": t, "rows": {global row index: sha1 of the row's inputs and targets}}``, so
    runs in other processes (or on other meshes) can be compared row by row."""
    import hashlib
    import json

    def recorded(self, seed, step, batch_size, seq_len, split="train", rows=None, **kwargs):
        out = batch(self, seed, step, batch_size, seq_len, split, rows, **kwargs)
        if split == "train":
            first = rows.start if rows is not None else 0
            digests = {first + i: hashlib.sha1(out["inputs"][i].tobytes() + out["targets"][i].tobytes()).hexdigest()
                       for i in range(len(out["inputs"]))}
            with open(path, "a") as f:
                f.write(json.dumps({"step": int(step), "rows": digests}) + "\n")
        return out
    return recorded


def recorded_batches(*paths) -> dict[int, dict[str, str]]:
    """The rows :func:`batch_recorder` wrote to ``paths`` (e.g. one file per process), merged by step; a row
    recorded twice with different contents fails."""
    import json
    merged: dict[int, dict[str, str]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            entry = json.loads(line)
            rows = merged.setdefault(entry["step"], {})
            for row, digest in entry["rows"].items():
                assert rows.get(row, digest) == digest, f"step {entry['step']} row {row} differs between records"
                rows[row] = digest
    return merged


# ------------------------------------------------------------------------------------------ tokenizers

def pydoc_tokenizer(vocab_size: int, chars: int = 50_000, eos: str = "<|endoftext|>"):
    """A ``tokenizers`` BPE of ``vocab_size`` ids trained here on the first ``chars`` characters of CPython's
    pydoc text (no download): GPT-2's byte-level pre-tokenizer and decoder, ``eos`` a special token. From 258
    ids on, its alphabet is all 256 bytes; below, only the bytes of that text, and ``<unk>`` stands for others."""
    import tokenizers as tk
    small = vocab_size < 258
    tokenizer = tk.Tokenizer(tk.models.BPE(unk_token="<unk>" if small else None))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", eos] if small else [eos],
                                     initial_alphabet=[] if small else tk.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False)
    tokenizer.train_from_iterator(jp.data.default_text()[:chars].split("\n\n"), trainer)
    assert tokenizer.get_vocab_size() == vocab_size, (tokenizer.get_vocab_size(), vocab_size)
    return tokenizer


def assert_hf_logits_and_save(label: str, ref, model, params, out_dir, vocab: int, seq: int) -> float:
    """A model loaded from the transformers model ``ref``: its logits on random tokens ``[2, seq]`` within 1e-4 of
    ``ref``'s, and ``jaxpar.models.hf.save`` into ``out_dir`` read back by transformers to ``ref``'s very tensors.
    Returns the largest logit difference."""
    import json

    import torch

    from jaxpar.models import hf
    tokens = np.random.default_rng(1).integers(0, vocab, (2, seq))
    with torch.no_grad():
        want = ref(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(jax.jit(model.apply)(params, jnp.asarray(tokens, jnp.int32)))[..., :vocab]
    diff = float(np.abs(got - want).max())
    print(f"\n[{label}]: max |logits - transformers'| {diff:.2e}")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    hf.save(model, params, str(out_dir))
    back = type(ref).from_pretrained(out_dir).eval()
    assert json.load(open(Path(out_dir) / "config.json"))["model_type"] == ref.config.model_type
    theirs, ours = ref.state_dict(), back.state_dict()
    assert set(theirs) == set(ours)
    for key in theirs:
        np.testing.assert_array_equal(ours[key].numpy(), theirs[key].numpy(), err_msg=key)
    return diff


def transformers_greedy(ref, prompt: list[int], new: int) -> list[int]:
    """``new`` greedy tokens after ``prompt`` from the transformers model ``ref`` (no end-of-text stop)."""
    import torch
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    return out[0, len(prompt):].tolist()
