"""The step builders' defaults: a protocol model's ``check_batch`` runs on host batches (GPT, plain and
pipelined), device batches are not pulled back; the step's phases are named in the compiled program."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from helpers import SMALL_GPT, gpt_batch

import jaxpar as jp
from jaxpar.models import GPT

CFG = dataclasses.replace(SMALL_GPT, num_layers=2, d_model=32, num_heads=4, head_dim=0)


def _bad_batch(rows):
    batch = gpt_batch(np.random.default_rng(0), rows, CFG)
    batch["inputs"][1, 3] = CFG.vocab_size   # one id >= vocab
    return batch


def test_gpt_loss_step_rejects_out_of_range_ids_by_default(mesh_factory):
    mesh = mesh_factory(data=2)
    model, tx = GPT(CFG), optax.sgd(0.1)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    with pytest.raises(ValueError, match=r"token id 61 at index \(1, 3\)"):
        jp.train.make_train_step(model.loss, tx, mesh=mesh)(state, _bad_batch(4))
    with pytest.raises(ValueError, match="token id 61"):
        jp.train.make_eval_step(model.loss, mesh=mesh)(state, _bad_batch(4))
    # told not to check: the NaN the model gives for a bad id, never a finite wrong loss
    _, metrics = jp.train.make_train_step(model.loss, tx, mesh=mesh, check_batch=None, donate=False)(state, _bad_batch(4))
    assert np.isnan(float(metrics["loss"]))
    # a batch already on the devices is not pulled back to the host to be checked
    placed = jp.train.shard_batch(_bad_batch(4), mesh)
    _, metrics = jp.train.make_train_step(model.loss, tx, mesh=mesh, donate=False)(state, placed)
    assert np.isnan(float(metrics["loss"]))


def test_pipelined_gpt_step_rejects_out_of_range_ids_by_default(mesh_factory):
    mesh = mesh_factory(pipe=2)
    model, tx = GPT(CFG), optax.sgd(0.1)
    pipe = jp.pipeline.Pipeline.from_model(model, jp.pipeline.one_f_one_b(2, 2))
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh, pipeline=pipe)
    with pytest.raises(ValueError, match="token id 61"):
        jp.train.make_train_step(pipe, tx, mesh=mesh, grad_accum_steps=2)(state, _bad_batch(4))


def test_check_batch_rejects_a_bad_value(mesh_factory):
    with pytest.raises(TypeError, match="check_batch"):
        jp.train.make_train_step(GPT(CFG).loss, optax.sgd(0.1), mesh=mesh_factory(), check_batch="yes")


def test_step_phases_are_named_in_the_compiled_program(mesh_factory):
    mesh = mesh_factory(data=2)
    model, tx = GPT(CFG), optax.adam(1e-3)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    step = jp.train.make_train_step(model.loss, tx, mesh=mesh, grad_accum_steps=2)
    text = step.lower(state, gpt_batch(np.random.default_rng(1), 4, CFG)).compile().as_text()
    scopes = {part for name in re.findall(r'op_name="([^"]*)"', text) for part in name.split("/")}
    assert {"forward_backward", "optimizer_update", "accumulation"} <= scopes, sorted(scopes)[:40]


def test_shape_suffixes_of_every_model_are_in_the_legend():
    """Every ``name_SUFFIX`` array name in jaxpar/models uses letters of the one legend (SHAPE_LEGEND)."""
    legend = jp.models.SHAPE_LEGEND
    assert all(isinstance(axis, (str, type(None))) for _, axis in legend.values())
    used = {}
    for path in (Path(jp.__file__).parent / "models").glob("*.py"):
        for suffix in re.findall(r"\b[a-z][a-z0-9]*_([A-Z]{1,5})\b", path.read_text()):
            used.setdefault(suffix, path.name)
    assert used, "no shape-suffixed name found: the scan is broken"
    unknown = {s: f for s, f in used.items() if any(letter not in legend for letter in s)}
    assert not unknown, f"suffix letters outside jp.models.SHAPE_LEGEND: {unknown}"


def test_pipeline_actions_are_named_in_the_compiled_program(mesh_factory):
    mesh = mesh_factory(pipe=2)
    model, tx = GPT(CFG), optax.sgd(0.1)
    pipe = jp.pipeline.Pipeline.from_model(model, jp.pipeline.zero_bubble(2, 2))
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh, pipeline=pipe)
    step = jp.train.make_train_step(pipe, tx, mesh=mesh)
    text = step.lower(state, gpt_batch(np.random.default_rng(1), 4, CFG)).compile().as_text()
    scopes = {part for name in re.findall(r'op_name="([^"]*)"', text) for part in name.split("/")}
    want = {"pipeline_fwd", "pipeline_fwd_last", "pipeline_bwd_input", "pipeline_bwd_weight"}
    assert want <= scopes, sorted(s for s in scopes if s.startswith("pipeline"))
