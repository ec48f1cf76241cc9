"""Pipeline schedules as data: builders, the validator, and the analysis derived from the table."""

from __future__ import annotations

import numpy as np
import pytest

import jaxpar as jp
from jaxpar.pipeline import B, F, Schedule, W, gpipe, one_f_one_b
from jaxpar.pipeline.table import control_table

GRID = [(p, m) for p in range(1, 7) for m in range(1, 17)]
BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b}


def _valid_for(name, p, m):
    return name == "gpipe" or m >= p


@pytest.mark.parametrize("name", list(BUILDERS))
def test_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1(name):
    """Computed from the table (idle slots / all slots, unit-cost actions), over a grid of (p, m)."""
    checked = 0
    for p, m in GRID:
        if not _valid_for(name, p, m):
            continue
        s = BUILDERS[name](p, m)
        assert s.num_ticks == 2 * (m + p - 1), (name, p, m)
        assert s.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (name, p, m, str(s))
        checked += 1
    assert checked >= 50


def test_stash_gpipe_holds_every_microbatch_1f1b_holds_p_minus_s():
    for p, m in GRID:
        assert gpipe(p, m).peak_stash == (m,) * p
        if m >= p:
            assert one_f_one_b(p, m).peak_stash == tuple(p - s for s in range(p)), (p, m)


def test_receive_slots():
    """Unit-cost GPipe and 1F1B consume every activation and cotangent the tick after it arrives, except the
    loss cotangents GPipe's last stage keeps from its forwards until its backwards."""
    for p, m in [(2, 2), (4, 8), (4, 16), (3, 5)]:
        g, f = gpipe(p, m).recv_slots, one_f_one_b(p, m).recv_slots
        assert g == ((0, 1),) + ((1, 1),) * (p - 2) + ((1, m),), (p, m, g)
        assert f == ((0, 1),) + ((1, 1),) * (p - 1), (p, m, f)


# every builder, at the (p, m) cases below (interleaved with 2 chunks, m a multiple of p)
TABLES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": lambda p, m: jp.pipeline.interleaved_1f1b(p, m, 2),
          "zb-h1": jp.pipeline.zero_bubble, "zb-v": jp.pipeline.zero_bubble_v}
TABLE_CASES = [(1, 3), (2, 2), (2, 8), (3, 6), (4, 4), (4, 8)]


def _cases(name):
    return [(p, m) for p, m in TABLE_CASES if name == "gpipe" or (m >= p and (name != "interleaved" or m % p == 0))]


@pytest.mark.parametrize("name", list(TABLES))
def test_runtime_buffers_come_from_the_table(name):
    """The interpreter's slot assignment uses exactly the table's peak counts (maximum over stages); with split
    backwards the B-only leaves and B's carry to W share the stash's slots (bstash == wstash == stash)."""
    for p, m in _cases(name):
        s = TABLES[name](p, m)
        ct = control_table(s)
        assert len(ct.actions) == 11
        for field, a in ct.actions._asdict().items():
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
    """Each entry's kind, microbatch and chunk are the table's action; every buffer interval is read from the
    slot it was written to; intervals live at once on a stage never share a slot; arrivals come from the
    neighbour that holds the producing virtual stage, over a ppermute pair the table lists."""
    for p, m in _cases(name):
        s = TABLES[name](p, m)
        ct = control_table(s)
        a_ = ct.actions
        for t, row in enumerate(s.table):
            for st, a in enumerate(row):
                v = None if a is None else s.virtual_stage(st, a.chunk)
                want = 0 if a is None else {"F": 2 if v == s.num_virtual_stages - 1 else 1, "W": 5,
                                            "B": 4 if s.split_backward else 3}[a.kind]
                assert a_.kind[t, st] == want, (name, p, m, t, st, a)
                assert a_.microbatch[t, st] == (0 if a is None else a.microbatch)
                assert a_.chunk[t, st] == (0 if a is None else a.chunk) and a_.first[t, st] == (v == 0)
        arrivals = 0
        for buffer, ivs in s.lifetimes().items():
            write, read, code = FIELDS[buffer]
            slot = {}
            for iv in ivs:
                if code is None:
                    slot[iv] = int(getattr(a_, write)[iv.start, iv.stage])
                else:
                    src = _expected_source(s, iv, buffer)
                    assert a_.arrive_buffer[iv.start, iv.stage, src] == code, (name, buffer, iv, src)
                    slot[iv] = int(a_.arrive_slot[iv.start, iv.stage, src])
                    pairs = {PREV: ct.to_next, NEXT: ct.to_prev, SELF: None}[src]
                    if pairs is not None:
                        sender = (iv.stage - 1) % p if src == PREV else (iv.stage + 1) % p
                        assert (sender, iv.stage) in pairs, (name, buffer, iv, ct.to_next, ct.to_prev)
                    arrivals += 1
            for iv in ivs:
                assert getattr(a_, read)[iv.stop, iv.stage] == slot[iv] and 0 <= slot[iv] < getattr(ct.sizes, buffer)
                clash = [o for o in ivs if o != iv and o.stage == iv.stage and slot[o] == slot[iv]
                         and o.start < iv.stop and iv.start < o.stop]
                assert not clash, (name, p, m, buffer, iv, clash)
        assert int((a_.arrive_buffer > 0).sum()) == arrivals
        if s.split_backward:   # B reads the stash slot its F wrote (held until its W)
            when = s.ticks()
            for (kind, j, v), t in when.items():
                if kind == "B":
                    st = s.location(v)[0]
                    assert a_.stash_slot[t, st] == a_.stash_slot[when[("F", j, v)], st]


def test_1f1b_phases_follow_narayanan():
    """Stage s: p-1-s warm-up forwards, then alternating F/B, then the remaining backwards."""
    p, m = 4, 8
    s = one_f_one_b(p, m)
    for stage in range(p):
        order = [row[stage] for row in s.table if row[stage] is not None]
        warm = p - 1 - stage
        assert order[:warm] == [F(j) for j in range(warm)]
        steady = order[warm:warm + 2 * (m - warm)]
        assert steady[0::2] == [F(j) for j in range(warm, m)] and steady[1::2] == [B(j) for j in range(m - warm)]
        assert order[warm + 2 * (m - warm):] == [B(j) for j in range(m - warm, m)]


def test_gpipe_runs_all_forwards_first():
    s = gpipe(3, 5)
    for stage in range(3):
        kinds = [row[stage].kind for row in s.table if row[stage] is not None]
        assert kinds == ["F"] * 5 + ["B"] * 5


def test_forward_only_table():
    s = one_f_one_b(4, 8).forward_only()
    assert not s.has_backward and s.num_ticks == 8 + 3
    assert s.bubble_fraction == pytest.approx(3 / 11)
    assert s.peak_stash == (0, 0, 0, 0) and s.recv_slots == ((0, 0), (1, 0), (1, 0), (1, 0))


def test_text_gantt():
    text = str(one_f_one_b(2, 2))
    assert text.splitlines()[1:] == ["s0 | F0 F1 .  B0 .  B1", "s1 | .  F0 B0 F1 B1 . "]


def test_gantt_plot(tmp_path):
    path = jp.plot.schedule_gantt(one_f_one_b(4, 8), tmp_path / "1f1b.png")
    assert path.stat().st_size > 5000
    fig = jp.plot.schedule_gantt(jp.pipeline.zero_bubble_v(2, 4))   # chunks and W
    ax = fig.axes[0]
    labels = {t.get_text() for t in ax.texts}
    assert {"0c0", "3c1"} <= labels and len(ax.texts) == 3 * 4 * 4     # one label per action: 3 kinds, m=4, V=4
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [f"{k}, chunk {c}" for k in ("F (forward)", "B (input grad)", "W (weight grad)") for c in (0, 1)]


def test_compare_compiled_memory(mesh_factory):
    """``compare`` with a stage function and shapes: compiled temporary memory per device; GPipe (stashes every
    microbatch) above 1F1B (at most p) at m = 8; the shapes are required together."""
    import jax
    import jax.numpy as jnp
    stage = lambda prm, x: jnp.tanh(x @ prm["w"][0])
    loss = lambda head, y, t: jnp.mean((y - t) ** 2)
    s = jax.ShapeDtypeStruct
    shapes = {"layers": {"w": s((2, 32, 32), jnp.float32)}, "head": {}, "x": s((32, 8, 32), jnp.float32),
              "targets": s((32, 8, 32), jnp.float32), "mesh": mesh_factory(pipe=2)}
    rows = jp.pipeline.compare([gpipe(2, 8), one_f_one_b(2, 8)], stage_fn=stage, loss_fn=loss, **shapes)
    assert rows[0]["temp_bytes"] > rows[1]["temp_bytes"] > 0, rows
    with pytest.raises(ValueError, match=r"missing \['loss_fn'\]"):
        jp.pipeline.compare([gpipe(2, 8)], stage_fn=stage, **shapes)


def test_hand_written_table_with_w_actions_and_chunks():
    """The table model goes beyond the two builders: split W actions and two chunks per stage validate."""
    table = [(F(0, 0), None), (None, F(0, 0)), (F(0, 1), None), (None, F(0, 1)), (None, B(0, 1)),
             (B(0, 1), W(0, 1)), (W(0, 1), B(0, 0)), (B(0, 0), W(0, 0)), (W(0, 0), None)]
    s = Schedule("zb-like", 2, 1, table, num_chunks=2)
    assert s.num_ticks == 9 and s.peak_stash == (2, 2)


# ------------------------------------------------------------------------------------------- validator

BAD_TABLES = [
    ([(F(0), None), (None, F(0)), (None, B(0))], r"B0 never runs on stage 0"),
    ([(F(0), None), (None, F(0)), (None, B(0)), (B(0), None), (F(0), None)], r"F0 on stage 0 appears twice"),
    ([(F(0), F(0)), (None, B(0)), (B(0), None)], r"F0 on stage 1 at tick 0 needs F0 of stage 0 at an earlier tick"),
    ([(F(0), None), (None, F(0)), (B(0), B(0))], r"B0 on stage 0 at tick 2 needs B0 of stage 1 at an earlier tick"),
    ([(F(0), None), (None, B(0)), (None, F(0)), (B(0), None)], r"B0 on stage 1 at tick 1 needs F0 of stage 1"),
    ([(F(0), None, None)], r"tick 0 has 3 entries; every row needs one per stage \(2\)"),
    ([(F(1), None)], r"F1 is out of range"),
    ([("F0", None)], r"holds 'F0'; use F\(mb, chunk\)"),
    ([], r"empty table"),
]


@pytest.mark.parametrize("table,match", BAD_TABLES)
def test_validator_rejects(table, match):
    with pytest.raises(ValueError, match=match):
        Schedule("bad", 2, 1, table)


def test_validator_rejects_w_before_b():
    table = [(F(0),), (W(0),), (B(0),)]
    with pytest.raises(ValueError, match=r"W0 on stage 0 at tick 1 needs B0 of stage 0"):
        Schedule("bad", 1, 1, table)


def test_builder_errors():
    with pytest.raises(ValueError, match=r"1F1B needs num_microbatches >= num_stages, got 2 microbatches for 4"):
        one_f_one_b(4, 2)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="must be a positive int"):
            gpipe(bad, 4)
        with pytest.raises(ValueError, match="must be a positive int"):
            one_f_one_b(2, bad)


def test_public_names():
    assert jp.pipeline.gpipe is gpipe and jp.pipeline.one_f_one_b is one_f_one_b
    assert jp.pipeline.Schedule is Schedule
    assert callable(jp.pipeline.value_and_grad) and callable(jp.pipeline.apply)
