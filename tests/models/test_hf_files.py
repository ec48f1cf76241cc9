"""jaxpar/models/hf/files.py through ``hf.load`` / ``hf.save``: a checkpoint directory read from inside itself only
(an index or a link leading out is refused; a hub cache snapshot's links into its blobs are inside), stored dtypes
checked, and what a killed save leaves recovered by the next load or save.

The fast cases write tiny Llama checkpoints by hand with ``safetensors.numpy`` (HF names and ``[out, in]``
layouts, random values), so the loaded params are checked against the numbers written, not against a save.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxpar.models import hf
from jaxpar.models.hf import files as hf_files

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
V, D, H, G, K, F = 16, 8, 2, 1, 4, 12   # vocab, d_model, heads, kv heads, head_dim, d_mlp; one layer
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": D,
          "intermediate_size": F, "num_hidden_layers": 1, "num_attention_heads": H, "num_key_value_heads": G,
          "max_position_embeddings": 16}
GATE = "model.layers.0.mlp.gate_proj.weight"


def _tensors(seed: int) -> dict[str, np.ndarray]:
    layer = {"input_layernorm": (D,), "post_attention_layernorm": (D,), "self_attn.q_proj": (H * K, D),
             "self_attn.k_proj": (G * K, D), "self_attn.v_proj": (G * K, D), "self_attn.o_proj": (D, H * K),
             "mlp.gate_proj": (F, D), "mlp.up_proj": (F, D), "mlp.down_proj": (D, F)}
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D),
              **{f"model.layers.0.{k}.weight": s for k, s in layer.items()}}
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _write(path: Path, tensors: dict[str, np.ndarray], shards: int = 1) -> Path:
    """A checkpoint as ``save_pretrained`` lays it out: config.json, one file or ``shards`` files and an index."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names, weight_map = sorted(tensors), {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({k: tensors[k] for k in part}, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _gate(params: dict) -> np.ndarray:
    """The loaded gate_proj of layer 0 in HF's ``[F, D]`` layout."""
    return np.asarray(params["blocks"]["gate_kernel"][0], np.float32).T


def test_load_refuses_files_outside_the_checkpoint_directory(tmp_path):
    """An index naming ``../other/...`` or an absolute path, a shard or config.json that is a link out: refused
    before anything is read from there. A hub cache snapshot (links into ``../../blobs``) is one artefact: it loads."""
    tensors = _tensors(0)
    ck = _write(tmp_path / "ck", tensors, shards=2)
    shard = "model-00002-of-00002.safetensors"
    (tmp_path / "other").mkdir()
    shutil.copy(ck / shard, tmp_path / "other" / shard)
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    for outside in (f"../other/{shard}", str(tmp_path / "other" / shard)):
        moved = {k: (outside if v == shard else v) for k, v in index["weight_map"].items()}
        (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": moved}))
        with pytest.raises(ValueError, match=f"names '{outside}'.*(leads out of the checkpoint|relative to its) dir"):
            hf.load(str(ck))
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    (ck / shard).unlink()
    (ck / shard).symlink_to(tmp_path / "other" / shard)
    with pytest.raises(ValueError, match=f"names '{shard}', which leads out of the checkpoint directory"):
        hf.load(str(ck))
    (ck / shard).unlink()
    shutil.copy(tmp_path / "other" / shard, ck / shard)
    (tmp_path / "other" / "config.json").write_text((ck / "config.json").read_text())
    (ck / "config.json").unlink()
    (ck / "config.json").symlink_to(tmp_path / "other" / "config.json")
    with pytest.raises(ValueError, match="names 'config.json', which leads out"):
        hf.load(str(ck))

    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = _write(repo / "snapshots" / "abc123", tensors)
    for f in ("config.json", "model.safetensors"):
        os.replace(snapshot / f, repo / "blobs" / f"blob-{f}")
        (snapshot / f).symlink_to(f"../../blobs/blob-{f}")
    model, params = hf.load(str(snapshot))
    np.testing.assert_array_equal(_gate(params), tensors[GATE])
    (snapshot / "tokenizer.json").symlink_to(tmp_path / "other" / "config.json")   # save(like=) copies such files
    with pytest.raises(ValueError, match="names 'tokenizer.json', which leads out"):
        hf.save(model, params, str(tmp_path / "out"), like=str(snapshot))
    assert not [f for f in os.listdir(tmp_path) if "out" in f]


def test_load_accepts_float_weights_and_refuses_other_stored_dtypes(tmp_path):
    """float16 and bfloat16 weights load as their values; int8 (-3..3), bool and float64 ones are refused, the
    tensor and its dtype named."""
    tensors = _tensors(1)
    low = {k: v.astype(np.float16 if i % 2 else ml_dtypes.bfloat16) for i, (k, v) in enumerate(sorted(tensors.items()))}
    params = hf.load(str(_write(tmp_path / "low", low)))[1]
    np.testing.assert_array_equal(_gate(params), low[GATE].astype(np.float32))
    assert low[GATE].dtype != np.float32
    up = "model.layers.0.mlp.up_proj.weight"
    for i, (bad, stored) in enumerate(((np.random.default_rng(2).integers(-3, 4, (F, D)).astype(np.int8), "I8"),
                                       (np.ones((F, D), bool), "BOOL"), (tensors[up].astype(np.float64), "F64"))):
        path = _write(tmp_path / f"bad{i}", {**tensors, up: bad})
        with pytest.raises(ValueError, match=rf"tensor '{up}' in .* is stored as {stored}; .*float32, float16 or "
                                             "bfloat16"):
            hf.load(str(path))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_load_and_save_recover_what_a_killed_save_left(tmp_path):
    """Laid out by hand as a ``kill -9`` leaves them: the old checkpoint renamed aside and no ``ck`` (killed
    between the renames), a dead writer's temporary directory; ``load`` renames the old one back and removes the
    temporary one, leaving a live process's (this one's) and another host's. A dead writer's old checkpoint beside
    a new ``ck`` (killed after the second rename) is removed by the next ``save``."""
    tensors, dead = _tensors(3), hf_files.owner(_dead_pid())
    ck = _write(tmp_path / "ck", tensors)
    os.rename(ck, tmp_path / f".ck.jaxpar-old-{dead}-abc_1")
    live, elsewhere = f".ck.jaxpar-tmp-{hf_files.owner()}-live", ".ck.jaxpar-tmp-00000000-1-1-z"
    for name in (f".ck.jaxpar-tmp-{dead}-x7", live, elsewhere):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    model, params = hf.load(str(ck))
    np.testing.assert_array_equal(_gate(params), tensors[GATE])
    assert sorted(os.listdir(tmp_path)) == sorted(["ck", live, elsewhere])
    shutil.copytree(ck, tmp_path / f".ck.jaxpar-old-{dead}-b")
    hf.save(model, params, str(ck))
    assert f".ck.jaxpar-old-{dead}-b" not in os.listdir(tmp_path)
    assert live in os.listdir(tmp_path)


_KILLED_SAVE = r"""
import os, sys, time
import jax, safetensors.numpy
from jaxpar.models import hf
point, src, flag = sys.argv[1:]
model, params = hf.load(src)

def pause():
    open(flag, "w").close()
    time.sleep(600)
if point == "write":      # after the first shard's file is in the temporary directory
    real_save = safetensors.numpy.save_file
    def save_file(*args, **kwargs):
        real_save(*args, **kwargs)
        pause()
    safetensors.numpy.save_file = save_file
else:                     # the old checkpoint renamed aside, the new one not yet in its place
    real_rename, calls = os.rename, []
    def rename(a, b):
        calls.append(a)
        if len(calls) == 2:
            pause()
        real_rename(a, b)
    os.rename = rename
hf.save(model, jax.tree.map(lambda a: 2 * a, params), src, max_shard_bytes=2_000)
"""


@pytest.mark.slow  # two processes importing jax, each killed mid-save
@pytest.mark.parametrize("point, recover", [("write", "save"), ("between renames", "load")])
def test_a_save_killed_by_sigkill_is_recovered(tmp_path, point, recover):
    """A real ``hf.save`` in a child process, SIGKILLed while writing its temporary directory or between its two
    renames: the leftovers are there (``.ck.jaxpar-tmp-*``; with no ``ck`` in the second case), then the next
    ``save`` or ``load`` in this process recovers: the checkpoint holds the numbers written first (or, after a
    save, the new ones) and nothing hidden is left."""
    tensors = _tensors(4)
    ck, flag = _write(tmp_path / "ck", tensors), tmp_path / "paused"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, point, str(ck), str(flag)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert child.poll() is None, child.communicate()[0].decode()[-2000:]
            assert time.monotonic() < deadline, "the child never reached the point to kill it at"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    left = sorted(os.listdir(tmp_path))
    assert any(f.startswith(".ck.jaxpar-tmp-") for f in left), left
    assert ("ck" in left) == (point == "write") and any(f.startswith(".ck.jaxpar-old-") for f in left) == (
        point != "write"), left
    if recover == "save":   # the first call after the kill is a save of the same numbers
        model, params = hf.load(str(_write(tmp_path / "copy", tensors)))
        hf.save(model, params, str(ck))
    np.testing.assert_array_equal(_gate(hf.load(str(ck))[1]), tensors[GATE])
    assert sorted(os.listdir(tmp_path)) == sorted(["ck", "paused"] + (["copy"] if recover == "save" else []))
