"""jaxpar/pipeline/checks.py: the argument checks the schedule API shares, each a TypeError/ValueError in plain
Python, before any tracing, naming the value and the fix."""

from __future__ import annotations

import math

import pytest

import jaxpar as jp
from jaxpar.pipeline import B, F, Schedule, checks, schedules
from jaxpar.pipeline.analysis import compiled_temp_bytes, timing

from .test_custom import OK

P = jp.pipeline


def test_check_schedule_names_the_caller():
    """The check ``to_stage_layout`` / ``from_stage_layout`` use (through jaxpar.pipeline.checks)."""
    with pytest.raises(TypeError, match=r"to_stage_layout takes a jp.pipeline.Schedule, got str 'il'"):
        checks.check_schedule("il", "to_stage_layout")


def test_the_bound_is_on_ticks_times_stages(monkeypatch):
    """GPipe on one stage has exactly 2 m ticks: at a bound of 100 entries m = 50 builds, m = 51 does not; a
    hand-written Schedule and from_actions obey the same bound."""
    monkeypatch.setattr(schedules, "MAX_TABLE_ENTRIES", 100)
    assert P.gpipe(1, 50).num_ticks == 100
    with pytest.raises(ValueError, match=r"a table of at least 102 ticks x 1 stages = 102 entries exceeds the bound "
                                         r"of 100"):
        P.gpipe(1, 51)
    table = [(F(0), None), (None, F(0)), (None, B(0)), (B(0), None)] + [(None, None)] * 47
    with pytest.raises(ValueError, match=r"schedule 'big': a table of 51 ticks x 2 stages = 102 entries exceeds"):
        Schedule("big", 2, 1, table)
    with pytest.raises(ValueError, match=r"from_actions \(11 lists, the longest of 2 entries\): a table of at least "
                                         r"11 ticks x 11 stages = 121 entries"):
        P.from_actions([["F0", "B0"]] * 11)
    with pytest.raises(ValueError, match=r"a table of 51 ticks x 2 stages"):
        P.from_actions([["F0"] + [None] * 50, ["F0"]], timed=True)


def test_bad_input_raises_before_any_tracing(monkeypatch):
    """None of these checks reach jax: a tracing entry point patched to fail is never called."""
    import jax
    def boom(*a, **k):
        raise AssertionError("traced")
    monkeypatch.setattr(jax, "jit", boom)
    monkeypatch.setattr(jax, "eval_shape", boom)
    for call in (lambda: timing("1f1b"), lambda: P.compare([P.gpipe(2, 2)], {"F": math.nan, "B": 1}),
                 lambda: P.gpipe(10 ** 6, 1), lambda: P.from_actions(OK, num_microbatches=0),
                 lambda: compiled_temp_bytes("x", None, None, layers={}, head={}, x=None, targets=None, mesh=None)):
        with pytest.raises((TypeError, ValueError)):
            call()
