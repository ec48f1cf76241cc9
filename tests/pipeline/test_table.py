"""jaxpar/pipeline/table.py: the interpreter's control table (actions, slots, arrivals) derived from a schedule,
DualPipeV's fused FB entries (their B in ``Actions.fused``, its message on the second channel) included."""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
import pytest

from helpers import SMALL_GPT, gpt_batch

import jaxpar as jp
from jaxpar import _hlo as plan_hlo
from jaxpar.models import GPT
from jaxpar.pipeline.table import control_table


# every registered builder, at the (p, m) cases below (interleaved with its default 2 chunks, m a multiple of p)
TABLES = jp.pipeline.SCHEDULES


TABLE_CASES = [(1, 3), (2, 2), (2, 8), (3, 6), (4, 4), (4, 8)]


def _cases(name):
    least = 2 if name == "dualpipev" else 1          # microbatches per stage at least
    return [(p, m) for p, m in TABLE_CASES
            if name == "gpipe" or (m >= least * p and (name != "interleaved" or m % p == 0))]


@pytest.mark.parametrize("name", list(TABLES))
def test_runtime_buffers_come_from_the_table(name):
    """The interpreter's slot assignment uses exactly the table's peak counts (maximum over stages); with split
    backwards the B-only leaves and B's carry to W share the stash's slots (bstash == wstash == stash)."""
    for p, m in _cases(name):
        s = TABLES[name](p, m)
        ct = control_table(s)
        assert len(ct.actions) == 12 and (ct.actions.fused is None) == (name != "dualpipev")
        fused = [] if ct.actions.fused is None else list(ct.actions.fused._asdict().items())
        for field, a in list(ct.actions._asdict().items())[:-1] + fused:
            shape = (s.num_ticks, p, 3) if field.startswith("arrive") else (s.num_ticks, p)
            assert a.shape == shape and a.dtype == np.int32, (field, a.shape, a.dtype)
        shared = max(s.peak_stash) if s.split_backward else 1
        assert ct.sizes._asdict() == {"stash": max(s.peak_stash), "bstash": shared, "wstash": shared,
                                      "activations": max(max(a for a, _ in s.recv_slots), 1),
                                      "cotangents": max(c for _, c in s.recv_slots)}, (name, p, m)


# buffer -> (the field holding its slot when written, the field holding it when read, the arrival code or None)
FIELDS = {"stash": ("stash_slot", "stash_slot", None), "bstash": ("bstash_slot", "bstash_slot", None),
          "wstash": ("wstash_slot", "wstash_slot", None),
          "activations": ("arrive_slot", "act_read", 1), "cotangents": ("arrive_slot", "cot_read", 2)}


PREV, NEXT, SELF = 0, 1, 2


def _expected_source(s, iv, buffer):
    """Where a received value comes from, from the placement: previous stage, next stage or this one."""
    v = s.virtual_stage(iv.stage, iv.chunk)
    last = s.num_virtual_stages - 1
    sender = s.location(v - 1)[0] if buffer == "activations" else iv.stage if v == last else s.location(v + 1)[0]
    return SELF if sender == iv.stage else PREV if sender == (iv.stage - 1) % s.num_stages else NEXT


@pytest.mark.parametrize("name", list(TABLES))
def test_control_table_follows_the_schedule(name):
    """Each entry's kind, microbatch and chunk are the table's action (an FB's F; its B in ``fused``; a B is
    input-only where its W is in the table); every buffer interval is read from the slot it was written to;
    intervals live at once on a stage never share a slot; arrivals come from the neighbour that holds the
    producing virtual stage, over a ppermute pair the table lists (an FB's B's message on the second channel)."""
    for p, m in _cases(name):
        s = TABLES[name](p, m)
        ct = control_table(s)
        a_, f_, when, last = ct.actions, ct.actions.fused, s.ticks(), s.num_virtual_stages - 1
        fb = {(t, st): a.backward for t, row in enumerate(s.table) for st, a in enumerate(row)
              if a is not None and a.kind == "FB"}
        assert bool(fb) == (name == "dualpipev")
        for t, row in enumerate(s.table):
            for st, a in enumerate(row):
                v = None if a is None else s.virtual_stage(st, a.chunk)
                want = 0 if a is None else {"F": 2 if v == last else 1, "W": 5, "FB": 7 if v == last else 6,
                                            "B": 4 if ("W", a.microbatch, v) in when else 3}[a.kind]
                assert a_.kind[t, st] == want, (name, p, m, t, st, a)
                assert a_.microbatch[t, st] == (0 if a is None else a.microbatch)
                assert a_.chunk[t, st] == (0 if a is None else a.chunk) and a_.first[t, st] == (v == 0)
                if (t, st) in fb:
                    b = fb[(t, st)]
                    assert (f_.microbatch[t, st], f_.chunk[t, st]) == (b.microbatch, b.chunk)
                    assert f_.first[t, st] == (s.virtual_stage(st, b.chunk) == 0)
        arrivals = 0
        for buffer, ivs in s.lifetimes().items():
            write, read, code = FIELDS[buffer]
            slot = {}
            for iv in ivs:
                if code is None:
                    slot[iv] = int(getattr(a_, write)[iv.start, iv.stage])
                else:
                    src = _expected_source(s, iv, buffer)
                    sender = {PREV: (iv.stage - 1) % p, NEXT: (iv.stage + 1) % p, SELF: iv.stage}[src]
                    second = (buffer == "cotangents" and (iv.start, sender) in fb
                              and s.virtual_stage(iv.stage, iv.chunk) < last)      # sent by an FB's B
                    chan = f_ if second else a_
                    assert chan.arrive_buffer[iv.start, iv.stage, src] == code, (name, buffer, iv, src)
                    slot[iv] = int(chan.arrive_slot[iv.start, iv.stage, src])
                    pairs = {PREV: ct.to_next, NEXT: ct.to_prev, SELF: None}[src]
                    if pairs is not None:
                        sender = (iv.stage - 1) % p if src == PREV else (iv.stage + 1) % p
                        assert (sender, iv.stage) in pairs, (name, buffer, iv, ct.to_next, ct.to_prev)
                    arrivals += 1
            for iv in ivs:
                fused_read = (iv.stop, iv.stage) in fb and buffer in ("stash", "bstash")   # an FB's B's stash
                got = f_.stash_slot[iv.stop, iv.stage] if fused_read else getattr(a_, read)[iv.stop, iv.stage]
                assert got == slot[iv] and 0 <= slot[iv] < getattr(ct.sizes, buffer), (name, buffer, iv)
                clash = [o for o in ivs if o != iv and o.stage == iv.stage and slot[o] == slot[iv]
                         and o.start < iv.stop and iv.start < o.stop]
                assert not clash, (name, p, m, buffer, iv, clash)
        assert int((a_.arrive_buffer > 0).sum()) + (0 if f_ is None else int((f_.arrive_buffer > 0).sum())) == arrivals
        if s.split_backward:   # B reads the stash slot its F wrote (held until its W)
            for (kind, j, v), t in when.items():
                if kind == "B":
                    st = s.location(v)[0]
                    got = f_.stash_slot[t, st] if (t, st) in fb else a_.stash_slot[t, st]
                    assert got == a_.stash_slot[when[("F", j, v)], st]


def test_pipeline_actions_are_named_in_the_compiled_program(mesh_factory):
    mesh = mesh_factory(pipe=2)
    model, tx = GPT(dataclasses.replace(SMALL_GPT, num_layers=2, d_model=32, num_heads=4, head_dim=0)), optax.sgd(0.1)
    pipe = jp.pipeline.Pipeline.from_model(model, jp.pipeline.zero_bubble(2, 2))
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh, pipeline=pipe)
    step = jp.train.make_train_step(pipe, tx, mesh=mesh)
    text = step.lower(state, gpt_batch(np.random.default_rng(1), 4, SMALL_GPT)).compile().as_text()
    scopes = plan_hlo.scopes(text)
    want = {"pipeline_fwd", "pipeline_fwd_last", "pipeline_bwd_input", "pipeline_bwd_weight"}
    assert want <= scopes, sorted(s for s in scopes if s.startswith("pipeline"))
