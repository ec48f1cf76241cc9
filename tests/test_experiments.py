"""The experiment entry points run end to end (short configurations) and write what they promise."""

import dataclasses
import json
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import load_script

import jaxpar as jp
from jaxpar.cli import experiment

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    """experiments/<name>.py as a module, imported as ``python experiments/<name>.py`` would run it: with
    experiments/ on sys.path (Python puts a script's directory there; prune_sweep imports digits)."""
    if str(ROOT / "experiments") not in sys.path:
        sys.path.append(str(ROOT / "experiments"))
    module = load_script(f"experiments/{name}.py", f"experiments_{name}")
    return module


@pytest.mark.slow  # ~17 s: a whole digits run; .ci/run runs it
def test_digits_reaches_95_percent(tmp_path):
    digits = load("digits")
    accuracy = digits.main(digits.Config(out_dir=str(tmp_path)))
    assert accuracy >= 0.95
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "loss.png").exists()


@pytest.mark.slow  # a charlm run; .ci/run runs it
def test_charlm_short_run_writes_outputs(tmp_path, capsys):
    charlm = load("charlm")
    cfg = charlm.Config(steps=40, eval_interval=20, eval_batches=2, batch_size=16, seq_len=32, d_model=64,
                        num_layers=2, warmup_steps=5, sample_chars=20, out_dir=str(tmp_path))
    val = charlm.main(cfg)
    assert val < 3.5  # from ln(103) = 4.63 at init
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert len(train) == 40 and train[-1]["loss"] < train[0]["loss"]
    assert [r["step"] for r in rows if r["split"] == "val"] == [20, 40]
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 40
    assert (tmp_path / "loss.png").stat().st_size > 1000 and any((tmp_path / "tb").iterdir())
    assert "final validation loss" in capsys.readouterr().out


def test_charlm_rejects_bad_config():
    charlm = load("charlm")
    with pytest.raises(ValueError, match="warmup"):
        charlm.Config(steps=10, warmup_steps=20)


def test_charlm_names_its_own_flags_when_heads_do_not_divide_the_width():
    charlm = load("charlm")
    with pytest.raises(ValueError, match=r"--num-heads 3 must divide --d-model 128.*--num-heads 2 or 4"):
        charlm.Config(num_heads=3)
    with pytest.raises(ValueError, match="--num-heads must be >= 1"):
        charlm.Config(num_heads=0)
    with pytest.raises(ValueError, match="--positions rotary needs an even head width"):
        charlm.Config(d_model=96, num_heads=32, positions="rotary")   # 96 / 32 = 3
    assert charlm.Config(d_model=96, num_heads=3).num_heads == 3


def test_charlm_failed_resume_leaves_no_directory(tmp_path):
    charlm = load("charlm")
    small = dict(steps=4, batch_size=8, seq_len=16, d_model=32, num_layers=2, resume=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (empty, tmp_path / "missing"):
        with pytest.raises(jp.checkpoint.CheckpointError, match=r"asked to resume \(--resume\)"):
            charlm.main(charlm.Config(out_dir=str(out), **small))
    assert list(empty.iterdir()) == [] and not (tmp_path / "missing").exists()


def test_resume_is_refused_with_steps_below_the_checkpoint_and_other_settings(tmp_path):
    """A rerun in the same --out-dir with --steps below its latest checkpoint (the README's quick check after the
    default 800-step run) exits naming both steps and the fixes, before anything starts; so does a changed setting
    outside the resumable ones; --steps at or past the checkpoint, and a directory without checkpoints, pass."""
    charlm = load("charlm")
    out = tmp_path / "run"
    (out / "checkpoints" / "800").mkdir(parents=True)
    (out / "checkpoints" / "400.orbax-checkpoint-tmp-1").mkdir()      # an unfinished write: not a step
    (out / "config.json").write_text(json.dumps(experiment.flat_config(charlm.Config(out_dir=str(out)))))
    with pytest.raises(SystemExit, match=r"checkpoint at step 800, past --steps 30: pass --steps 800 or more.*"
                                         r"new --out-dir"):
        experiment.check_resumed_config(out, charlm.Config(steps=30, out_dir=str(out)), charlm.RESUMABLE_CHANGES)
    for steps in (800, 1600):
        experiment.check_resumed_config(out, charlm.Config(steps=steps, out_dir=str(out)), charlm.RESUMABLE_CHANGES)
    with pytest.raises(SystemExit, match=r"--d-model 128 -> 64"):
        experiment.check_resumed_config(out, charlm.Config(d_model=64, out_dir=str(out)), charlm.RESUMABLE_CHANGES)
    (out / "checkpoints" / "800").rmdir()
    experiment.check_resumed_config(out, charlm.Config(steps=30, d_model=64, out_dir=str(out)),
                                    charlm.RESUMABLE_CHANGES)


@pytest.mark.slow  # heavy (subprocesses or several compiles); .ci/run runs it
def test_charlm_with_pruning_and_fp16(tmp_path):
    charlm = load("charlm")
    cfg = charlm.Config(steps=40, eval_interval=20, eval_batches=1, batch_size=16, seq_len=32, d_model=64,
                        num_layers=2, sample_chars=5, pruning=experiment.PruningConfig(sparsity=0.5, distribution="global"),
                        precision=experiment.PrecisionConfig("fp16"), out_dir=str(tmp_path))
    assert charlm.main(cfg) < 3.5
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if r["split"] == "val"][-1]
    assert abs(final["sparsity"] - 0.5) < 0.01
    assert all("loss_scale" in r for r in rows if r["split"] == "train")


def test_charlm_help_explains_every_schedule(capsys):
    """--help gives each --schedule choice its own line with its meaning (tyro reads the field's docstring)."""
    import tyro
    charlm = load("charlm")
    with pytest.raises(SystemExit):
        tyro.cli(charlm.Config, args=["--help"])
    text = " ".join(line.strip(" │") for line in capsys.readouterr().out.splitlines())  # undo rich's wrapping
    text = " ".join(text.split())
    assert "--schedule {gpipe,1f1b,interleaved,zb,zbv,dualpipev}" in text
    for line in ("gpipe: all forwards, then all backwards;", "1f1b: forwards and backwards alternate",
                 "interleaved: 1F1B over --chunks stages per device;", "zb: ZB-H1, weight grads fill the bubble",
                 "zbv: ZB-V, 2 chunks per device in a V", "dualpipev: DualPipeV, the V with one microbatch's forward"):
        assert line in text, (line, text[:3000])


def test_charlm_header_names_the_pipeline():
    charlm = load("charlm")
    head = lambda **kw: charlm.pipeline_header(charlm.Config(**kw))
    assert head(pipe=2, schedule="1f1b", microbatches=4) == "pipeline: schedule 1f1b, pipe 2, microbatches 4"
    assert head(pipe=2, schedule="interleaved", chunks=2, microbatches=4) == (
        "pipeline: schedule interleaved, pipe 2, microbatches 4, 2 chunks per device")
    assert head(pipe=2, schedule="zbv", microbatches=4) == (
        "pipeline: schedule zbv, pipe 2, microbatches 4, 2 chunks per device")
    assert head(pipe=2, schedule="dualpipev", microbatches=4) == (
        "pipeline: schedule dualpipev, pipe 2, microbatches 4, 2 chunks per device")


# ------------------------------------------------------------------------------------- charlm pipelined

def _charlm():
    return load_script("experiments/charlm.py", "experiments_charlm_pipe")


def test_charlm_pipeline_config_errors():
    charlm = _charlm()
    with pytest.raises(ValueError, match=r"--num-layers 3 is not divisible by --pipe 2"):
        charlm.Config(pipe=2, num_layers=3)
    with pytest.raises(ValueError, match=r"--schedule 1f1b with --pipe 4 --microbatches 2: 1F1B needs "
                                         r"num_microbatches >= num_stages"):
        charlm.Config(pipe=4, microbatches=2, num_layers=4)
    with pytest.raises(ValueError, match=r"--schedule dualpipev with --pipe 2 --microbatches 3: dualpipe_v needs "
                                         r"num_microbatches >= 2 \* num_stages .* use num_microbatches >= 4"):
        charlm.Config(pipe=2, microbatches=3, num_layers=4, schedule="dualpipev")
    fp8 = charlm.experiment.PrecisionConfig("fp8")
    with pytest.raises(ValueError, match=r"--precision fp8 \(delayed scaling\) runs through one-chunk pipeline "
                                         r"schedules only; got --schedule dualpipev"):
        charlm.Config(pipe=2, num_layers=4, schedule="dualpipev", microbatches=4, precision=fp8)


def test_charlm_context_config_errors():
    charlm = _charlm()
    mesh = charlm.experiment.MeshConfig(fsdp=1, context=2)
    with pytest.raises(ValueError, match=r"--seq-len 130 must be a multiple of 2 x --context 2 .* use --seq-len 132"):
        charlm.Config(mesh=mesh, seq_len=130)
    with pytest.raises(ValueError, match=r"--context-attention ring cannot run inside pipeline stages"):
        charlm.Config(mesh=mesh, pipe=2, num_layers=4, context_attention="ring")
    charlm.Config(mesh=mesh, pipe=2, num_layers=4)   # auto: all_gather with a pipeline


@pytest.mark.slow  # one short charlm run per schedule (~30 s each); .ci/run runs it
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"])
def test_charlm_runs_data2_pipe2_tensor2(schedule, tmp_path):
    """The main job end to end with each schedule on data=2 x pipe=2 x tensor=2: training lowers the loss, the
    eval loss is finite, and the Gantt chart of the schedule it ran is saved beside the metrics."""
    charlm = _charlm()
    cfg = charlm.Config(pipe=2, mesh=experiment.MeshConfig(fsdp=1, tensor=2), schedule=schedule, microbatches=4,
                        steps=6, eval_interval=6, eval_batches=1, batch_size=16, seq_len=32, d_model=64,
                        num_layers=4, warmup_steps=1, sample_chars=5, out_dir=str(tmp_path), checkpoint_interval=0)
    val = charlm.main(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert len(train) == 6 and train[-1]["loss"] < train[0]["loss"] and np.isfinite(val)
    assert (tmp_path / "schedule.png").stat().st_size > 0


# slow set: a lighter sibling stays in the fast set (the README's 10-minute budget)
@pytest.mark.slow
def test_charlm_trains_a_llama_on_data2_tensor2_pipe2(tmp_path, capsys):
    """--model llama (GQA: 4 query heads, 2 key/value heads) through the 1F1B pipeline on data=2 x pipe=2 x
    tensor=2: the loss falls and it samples text through the KV cache."""
    charlm = load("charlm")
    cfg = charlm.Config(model="llama", num_kv_heads=2, steps=30, eval_interval=30, eval_batches=1, batch_size=16,
                        seq_len=32, d_model=64, num_layers=2, warmup_steps=5, sample_chars=20, pipe=2,
                        mesh=experiment.MeshConfig(data=2, fsdp=1, tensor=2), out_dir=str(tmp_path))
    val = charlm.main(cfg)
    assert val < 3.8, val    # from ln(103) = 4.63 at init
    out = capsys.readouterr().out
    assert "final validation loss" in out


@pytest.mark.slow  # ~15 s end to end; .ci/run runs it
def test_finetune_a_hf_llama_end_to_end(tmp_path):
    """experiments/finetune.py --hf: a tiny random transformers Llama (vocab 256: bytes), loaded onto data=2 x
    fsdp=2 x tensor=2, fine-tuned 30 steps (the loss falls), saved; from_pretrained reads the result and its
    logits equal the fine-tuned jaxpar model's."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(HFLlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
                     ).save_pretrained(tmp_path / "base")
    finetune = load("finetune")
    cfg = finetune.Config(hf=str(tmp_path / "base"), steps=30, batch_size=8, seq_len=32, learning_rate=3e-3,
                          out_dir=str(tmp_path / "run"), checkpoint_interval=20)
    out = finetune.main(cfg)
    assert out["last_loss"] < out["first_loss"] - 0.5, out
    assert jp.checkpoint.CheckpointManager(tmp_path / "run" / "checkpoints").all_steps() == [20, 30]
    tuned = LlamaForCausalLM.from_pretrained(out["saved"]).eval()
    model, params = jp.models.hf.load(out["saved"])
    tokens = np.random.default_rng(0).integers(0, 256, (2, 24))
    with torch.no_grad():
        ref = tuned(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(model.apply(params, tokens.astype(np.int32)))[..., :256]
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    # the same command with more steps resumes from the orbax checkpoint of step 30: one row per step in the log
    finetune.main(dataclasses.replace(cfg, steps=34))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == list(range(1, 35))
    for out_dir in (tmp_path / "run", tmp_path / "run" / "hf"):   # its own output as its input
        with pytest.raises(ValueError, match="overwrites"):
            finetune.Config(hf=out["saved"] if out_dir.name == "run" else str(out_dir), out_dir=str(out_dir))
    with pytest.raises(ValueError, match=r"--expert-parallel 2 splits a mixture of experts' experts; .* a dense model"):
        finetune.main(dataclasses.replace(cfg, expert_parallel=2, out_dir=str(tmp_path / "ep")))


def tiny_hf_model(family: str, vocab_size: int):
    """A tiny random transformers causal LM of ``family`` (GQA; seeded), untrained."""
    import torch
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if family == "qwen3":   # q/k norms, a head size (32) other than hidden / heads (16), tied embeddings
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True))
    raise ValueError(family)


def transformers_loss(model, ids: np.ndarray, seq_len: int, windows: int = 16) -> float:
    """transformers' mean next-token loss of ``model`` over ``windows`` evenly spaced windows of ``ids``."""
    import torch
    starts = np.linspace(0, ids.size - seq_len - 1, windows).astype(int)
    batch = torch.tensor(np.stack([ids[s:s + seq_len] for s in starts]).astype(np.int64))
    with torch.no_grad():
        return float(model.eval()(batch, labels=batch).loss)


@pytest.mark.slow  # ~40 s each: 100 steps on data=2 x fsdp=2 x tensor=2; .ci/run runs it
@pytest.mark.parametrize("family, vocab, tokenizer_vocab, beside", [("qwen3", 640, 512, True),
                                                                     ("llama", 200, 200, False)])
def test_finetune_with_a_tokenizer_lowers_the_loss_transformers_measures(tmp_path, family, vocab, tokenizer_vocab,
                                                                        beside):
    """experiments/finetune.py --hf on a tiny random transformers checkpoint whose tokenizer (a BPE trained on
    pydoc text in the test, saved by transformers) is in the checkpoint (``beside``) or passed by --tokenizer:
    100 steps on the first 90% of CPython's pydoc text, saved; transformers reloads the result and its tokenizer,
    and its loss on the held-out 10% (tokens by that tokenizer) is lower than the checkpoint's before. A
    vocabulary under 256 works (no bytes). Without a tokenizer such a vocabulary is refused, as is a tokenizer
    with more ids than the model."""
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    from helpers import pydoc_tokenizer
    text = jp.data.default_text()
    cut = text.index("\n\n", int(0.9 * len(text)))
    (tmp_path / "train.txt").write_text(text[:cut])
    held_out = text[cut + 2:]
    base, tokenizer_dir = tmp_path / "base", tmp_path / ("base" if beside else "tokenizer")
    before = tiny_hf_model(family, vocab)
    before.save_pretrained(base)
    tokenizer = pydoc_tokenizer(tokenizer_vocab)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(tokenizer_dir)
    finetune = load("finetune")
    cfg = finetune.Config(hf=str(base), tokenizer=None if beside else str(tokenizer_dir), steps=100, batch_size=16,
                          seq_len=64, learning_rate=3e-3, text=str(tmp_path / "train.txt"),
                          out_dir=str(tmp_path / "run"), checkpoint_interval=0)
    if not beside:   # refused before any step: bytes need 256 ids; a tokenizer beyond the model's vocabulary
        with pytest.raises(ValueError, match=rf"no tokenizer.json and a vocabulary of {vocab} ids; byte-level"):
            finetune.main(dataclasses.replace(cfg, tokenizer=None))
        pydoc_tokenizer(vocab + 1).save(str(tmp_path / "big.json"))
        with pytest.raises(ValueError, match=rf"has id {vocab} .*beyond the model's vocabulary of {vocab} ids"):
            finetune.main(dataclasses.replace(cfg, tokenizer=str(tmp_path / "big.json")))
    out = finetune.main(cfg)
    assert out["last_loss"] < out["first_loss"] - 1.0, out

    reloaded = AutoTokenizer.from_pretrained(out["saved"])   # the tokenizer it was trained with went with it
    ids = np.asarray(reloaded(held_out, add_special_tokens=False)["input_ids"])
    assert ids.tolist() == tokenizer.encode(held_out, add_special_tokens=False).ids and ids.max() < tokenizer_vocab
    loss_before = transformers_loss(before, ids, 64)
    loss_after = transformers_loss(AutoModelForCausalLM.from_pretrained(out["saved"]), ids, 64)
    print(f"{family}: held-out loss in transformers {loss_before:.3f} -> {loss_after:.3f}; "
          f"training loss {out['first_loss']:.3f} -> {out['last_loss']:.3f}")
    assert loss_after < loss_before - 1.0, (loss_before, loss_after)


# ------------------------------------------------------------------------------------- charlm on tokens

@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    """A slice of CPython's documentation as a token directory (byte-level BPE of 300 ids, 10% validation)."""
    from jaxpar.data import prepare as tokens
    tmp = tmp_path_factory.mktemp("tokens")
    text = jp.data.default_text()
    (tmp / "pydoc.txt").write_text(text[:text.index("\n\n", 120_000)])
    tokens.prepare([tmp / "pydoc.txt"], tmp / "bpe", train_bpe_vocab=300, val_fraction=0.1, workers=1, progress=False)
    return tmp / "bpe"


def test_charlm_takes_one_corpus():
    charlm = load("charlm")
    with pytest.raises(ValueError, match=r"--text a.txt and --data-dir d: pass one corpus"):
        charlm.Config(text="a.txt", data_dir="d")
    assert charlm.unit(charlm.Config(data_dir="d")) == "token" and charlm.unit(charlm.Config()) == "character"


@pytest.mark.slow  # a charlm run; .ci/run runs it
def test_charlm_trains_on_a_token_directory(token_dir, tmp_path, capsys):
    """--data-dir: the model's vocabulary is meta.json's, the loss falls from ln(300), and validation is reported
    in nats/token and bits/byte = nats / ln 2 * tokens / bytes of the validation split (meta.json)."""
    charlm = load("charlm")
    cfg = charlm.Config(data_dir=str(token_dir), steps=30, eval_interval=15, eval_batches=2, batch_size=16,
                        seq_len=32, d_model=64, num_layers=2, warmup_steps=5, sample_chars=10, out_dir=str(tmp_path))
    val = charlm.main(cfg)
    assert val < np.log(300) - 0.8, val
    meta = json.loads((token_dir / "meta.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["split"] == "val"]
    assert [r["step"] for r in evals] == [15, 30]
    tokens_per_byte = meta["splits"]["val"]["tokens"] / meta["splits"]["val"]["bytes"]
    for r in evals:
        assert r["bits_per_byte"] == pytest.approx(r["loss"] / np.log(2) * tokens_per_byte, rel=1e-9)
    out = capsys.readouterr().out
    assert f"vocab 300 (padded {charlm.GPTConfig(vocab_size=300).padded_vocab})" in out
    assert re.search(r"final validation loss: [\d.]+ nats/token \([\d.]+ bits/byte\)", out), out[-2000:]


TOKEN_RUN = dict(steps=16, eval_interval=8, eval_batches=1, batch_size=16, seq_len=32, d_model=32, num_layers=1,
                 num_heads=2, warmup_steps=2, sample_chars=5, checkpoint_interval=0)

# experiments/charlm.py as written: after process 0 logs step 2 it blocks until its PreemptionHandler has handled
# the SIGTERM (the launcher forwards it to both processes); every process records the training rows it loads
TOKEN_WRAPPER = """
import os, runpy, sys
sys.path[:0] = ["tests"]
import jaxpar as jp
from ckpt_worker import await_sigterm_after_logging
from helpers import batch_recorder
await_sigterm_after_logging(2)
record = sys.argv.pop(1)
jp.data.TokenCorpus.batch = batch_recorder(f"{record}_{os.environ['JAXPAR_PROCESS_ID']}.jsonl", jp.data.TokenCorpus.batch)
sys.argv = ["experiments/charlm.py", *sys.argv[1:]]
runpy.run_path("experiments/charlm.py", run_name="__main__")
"""


@pytest.mark.slow  # two processes through the launcher, then two runs in this process; .ci/run runs it
def test_charlm_tokens_sigterm_on_two_processes_resume_on_one(token_dir, tmp_path, monkeypatch):
    """charlm --data-dir on 2 processes x 4 devices (data=2 x fsdp=2 x tensor=2), SIGTERM after step 2: it saves
    the step reached and exits 0; resumed in 1 process on another mesh (fsdp=4 x tensor=2) it sees, from that step
    on, bitwise the training rows of an uninterrupted 1-process run, as the 2 processes did before (each loading
    only its half, no row twice), and the same losses (2 -> 1 processes and another mesh change the reduction
    order: within 1e-5)."""
    from helpers import batch_recorder, recorded_batches
    from test_checkpoint import finish, read_until, start, train_rows
    charlm, batch = load("charlm"), jp.data.TokenCorpus.batch
    monkeypatch.setattr(jp.data.TokenCorpus, "batch", batch_recorder(tmp_path / "straight.jsonl", batch))
    charlm.main(charlm.Config(**TOKEN_RUN, data_dir=str(token_dir), out_dir=str(tmp_path / "straight")))
    (tmp_path / "wrapper.py").write_text(TOKEN_WRAPPER)
    run = tmp_path / "run"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TOKEN_RUN.items()]
    proc = start(["-m", "jaxpar.cli.launch", "-n", "2", "--timeout", "500", str(tmp_path / "wrapper.py"),
                  str(tmp_path / "two"), *args, "--data-dir", str(token_dir), "--out-dir", str(run)])
    read_until(proc, "SYNC awaiting SIGTERM after logging step 2")
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    reached = train_rows(run)[-1]["step"]
    assert 2 < reached < 16 and f"preempted: saved a checkpoint at step {reached}" in out
    monkeypatch.setattr(jp.data.TokenCorpus, "batch", batch_recorder(tmp_path / "resumed.jsonl", batch))
    charlm.main(charlm.Config(**TOKEN_RUN, data_dir=str(token_dir), out_dir=str(run), resume=True,
                              mesh=experiment.MeshConfig(fsdp=4, tensor=2)))
    want = recorded_batches(tmp_path / "straight.jsonl")
    two = [recorded_batches(tmp_path / f"two_{i}.jsonl") for i in (0, 1)]
    resumed = recorded_batches(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == list(range(reached, 16))
    for step, rows in two[0].items():     # each process loaded its half; together the global batch, once
        assert sorted(map(int, rows)) == list(range(8)) and sorted(map(int, two[1][step])) == list(range(8, 16))
        assert {**rows, **two[1][step]} == want[step]
    assert set(range(reached)) <= set(two[0])
    assert all(resumed[step] == want[step] for step in resumed)
    got, ref = train_rows(run), train_rows(tmp_path / "straight")
    assert [r["step"] for r in got] == list(range(1, 17))
    rel = [abs(g["loss"] - w["loss"]) / abs(w["loss"]) for g, w in zip(got, ref)]
    print(f"resumed at step {reached}: largest relative loss difference {max(rel):.3g} (before: "
          f"{max(rel[:reached]):.3g})")
    assert max(rel) <= 1e-5, rel


@pytest.mark.slow  # two short charlm runs; .ci/run runs it
def test_charlm_context_2_follows_context_1(tmp_path):
    """``--context 2`` (data=2 x context=2 x tensor=2, ring attention over the zigzag split) against ``--context 1``
    (data=4 x tensor=2): the first step's loss equal to 1e-5 relative, the curve close after (the 50-step run in
    the README: drift at most 9.2e-7)."""
    charlm = _charlm()
    losses = {}
    for c in (1, 2):
        cfg = charlm.Config(mesh=charlm.experiment.MeshConfig(fsdp=1, context=c), steps=6, eval_interval=6,
                            eval_batches=1, batch_size=8, seq_len=64, d_model=64, num_layers=2, sample_chars=5,
                            checkpoint_interval=0, out_dir=str(tmp_path / f"c{c}"))
        charlm.main(cfg)
        rows = [json.loads(line) for line in (tmp_path / f"c{c}" / "metrics.jsonl").read_text().splitlines()]
        losses[c] = np.array([r["loss"] for r in rows if r["split"] == "train"])
    np.testing.assert_allclose(losses[2][0], losses[1][0], rtol=1e-5)
    np.testing.assert_allclose(losses[2], losses[1], rtol=1e-4)


def test_entry_points_split_key_value_heads_over_tensor_when_it_divides_them(mesh_factory):
    """charlm and finetune split a Llama-like model's key/value heads over --tensor when it divides them (the
    library's defaults keep them whole for any head count, and the model warns of the duplicated work)."""
    from jaxpar.cli import experiment
    mesh = mesh_factory(data=2, fsdp=2, tensor=2)
    split = experiment.split_kv_heads(jp.sharding.DEFAULT_RULES, mesh, 4)
    assert split.mesh_axes("kv_heads") == ("tensor",) and split.mesh_axes("heads") == \
        jp.sharding.DEFAULT_RULES.mesh_axes("heads")
    assert experiment.split_kv_heads(split, mesh, 4) == split                      # once, first
    for kv, m in ((3, mesh), (0, mesh), (4, mesh_factory(data=8))):
        assert experiment.split_kv_heads(jp.sharding.DEFAULT_RULES, m, kv).mesh_axes("kv_heads") == ()
